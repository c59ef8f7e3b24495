/* kgp's fused CPU pass: out += K^T (K v + w) for the RBF and Matern 3/2, 5/2 kernels, a tile of rows at a time.

   Compiled on first use by kgp/operators/fused_cpu.py (gcc -O3 -march=native, loaded with ctypes); read
   that module's docstring for when it runs. An RBF entry is K[i, j] = exp2(clamp(r_i . c_j, lo, hi = 0)) with
   r_i = [u_i, -|u_i|^2 / 2, 1] and c_j = log2(e) [v_j, 1, -|v_j|^2 / 2]; a Matern entry reads a^2 = r_i . c_j
   = |u_i - v_j|^2 (r_i = [u_i, |u_i|^2, 1], c_j = [-2 v_j, 1, |v_j|^2], sqrt 3 or sqrt 5 folded into u and v),
   clamped to [lo = 0, hi], as kgp/kernels/recipes.py's blocks do. A tile is formed, multiplied by v and multiplied back while it sits in the cache: the block is never written to
   memory, which is what bounds the blocked pass (docs/backend.md, "A native CPU pass").

   Layouts (row-major): R is n x D (the rows), CT is D x MP (the columns, transposed, padded to MP, a multiple
   of two vectors; padded columns are never read back), VT is k x MP (v transposed, zero in the padding),
   W is n x k or NULL (k <= MAX_K), OUT is k x MP (accumulated into, in ACC) or NULL (K v alone), BUF is
   TILE x MP of scratch, KV is n x k or NULL: where given, K v + w is written there too. STORE is n x M or NULL:
   where given, the entries formed are written there too (kernel_cache="auto" keeps K from then on), and
   later products read it with the stored pass below.
   Built three times: float entries with float sums, float entries with double sums, double with double. */

#include <stdint.h>
#include <string.h>

#define TILE 8
#define MAX_K 16
/* one vector: a 512-bit register where the CPU has them; else 256 bits (a 512-bit vector on AVX2 takes two of
   its 16 registers, and the distance loop's 2 x TILE accumulators alone would need 32) */
#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#else
#define VECTOR_BYTES 32
#endif

enum { RBF = 0, MATERN32 = 1, MATERN52 = 2 };

int kgp_vector_bytes(void) { return VECTOR_BYTES; }
int kgp_max_columns(void) { return MAX_K; }

#define DEFINE_PASS(NAME, T, ACC, IT, BIAS, MANT, DEGREE, COEFFS, SQRT)                                          \
    enum { NAME##_lanes = VECTOR_BYTES / sizeof(T) };                                                             \
    typedef T NAME##_vt __attribute__((vector_size(VECTOR_BYTES)));                                               \
    typedef IT NAME##_vi __attribute__((vector_size(VECTOR_BYTES)));                                              \
    typedef ACC NAME##_va __attribute__((vector_size(sizeof(ACC) * NAME##_lanes)));                               \
    static const T NAME##_coeff[DEGREE + 1] = COEFFS;                                                             \
    /* 2^x for lo <= x <= 0: x = f - m with m = round(-x), |f| <= 1/2; 2^f by its Taylor polynomial in f ln 2    \
       (error below the type's rounding for the degree chosen), 2^-m from the exponent bits (m is at most       \
       about 1010 in double, 62 in float: a normal number) */                                                     \
    static inline NAME##_vt NAME##_exp2(NAME##_vt x) {                                                            \
        NAME##_vt y = -x + (T)0.5;                                                                                 \
        NAME##_vi m = __builtin_convertvector(y, NAME##_vi);                                                     \
        NAME##_vt f = x + __builtin_convertvector(m, NAME##_vt);                                                 \
        NAME##_vt p = f * 0 + NAME##_coeff[DEGREE];                                                               \
        for (int c = DEGREE - 1; c >= 0; --c) p = p * f + NAME##_coeff[c];                                        \
        NAME##_vi bits = (BIAS - m) << MANT;                                                                      \
        return p * (NAME##_vt)bits;                                                                               \
    }                                                                                                             \
    void NAME(const T *R, const T *CT, const T *VT, const T *W, ACC *OUT, T *BUF, T *KV, T *STORE, int64_t n0,  \
              int64_t n1, int64_t D, int64_t MP, int64_t k, int64_t family, T lo, T hi, int64_t M) {             \
        T u[TILE * MAX_K];                                                                                        \
        const NAME##_vt vlo = (NAME##_vt){0} + lo, vhi = (NAME##_vt){0} + hi, vzero = {0};                        \
        for (int64_t i0 = n0; i0 < n1; i0 += TILE) {                                                              \
            /* a short last tile repeats its last row; those rows get u = 0 below, so they add nothing */          \
            const T *rp[TILE];                                                                                    \
            for (int r = 0; r < TILE; ++r) rp[r] = R + (i0 + r < n1 ? i0 + r : n1 - 1) * D;                       \
            /* two vectors of columns at a time: each broadcast row entry feeds two FMAs (MP is a multiple  \
               of two vectors) */                                                                             \
            for (int64_t j = 0; j < MP; j += 2 * NAME##_lanes) {                                                  \
                NAME##_vt acc[2][TILE];                                                                           \
                for (int r = 0; r < TILE; ++r) acc[0][r] = acc[1][r] = vzero;                                     \
                for (int64_t d = 0; d < D; ++d) {                                                                 \
                    NAME##_vt c0, c1;                                                                             \
                    memcpy(&c0, CT + d * MP + j, sizeof c0);                                                      \
                    memcpy(&c1, CT + d * MP + j + NAME##_lanes, sizeof c1);                                       \
                    for (int r = 0; r < TILE; ++r) {                                                              \
                        T a = rp[r][d];                                                                           \
                        acc[0][r] += a * c0;                                                                      \
                        acc[1][r] += a * c1;                                                                      \
                    }                                                                                             \
                }                                                                                                 \
                for (int h = 0; h < 2; ++h)                                                                       \
                    for (int r = 0; r < TILE; ++r) {                                                              \
                        NAME##_vt x = acc[h][r];                                                                  \
                        NAME##_vi low = x < vlo, high = x > vhi;                                                  \
                        x = (NAME##_vt)(((NAME##_vi)x & ~low) | ((NAME##_vi)vlo & low));                          \
                        x = (NAME##_vt)(((NAME##_vi)x & ~high) | ((NAME##_vi)vhi & high));                        \
                        NAME##_vt e;                                                                              \
                        if (family == RBF) {                                                                      \
                            e = NAME##_exp2(x); /* x: the base-2 exponent */                                      \
                        } else { /* x = a^2, the scaled squared distance: (1 + a [+ a^2 / 3]) exp(-a) */          \
                            NAME##_vt a;                                                                          \
                            for (int l = 0; l < NAME##_lanes; ++l) a[l] = SQRT(x[l]);                             \
                            e = NAME##_exp2(a * (T)-1.4426950408889634);                                          \
                            e *= family == MATERN32 ? a + 1 : a * a * (T)(1.0 / 3.0) + a + 1;                     \
                        }                                                                                         \
                        memcpy(BUF + r * MP + j + h * NAME##_lanes, &e, sizeof e);                                \
                    }                                                                                             \
            }                                                                                                     \
            int64_t rows = n1 - i0 < TILE ? n1 - i0 : TILE;                                                       \
            /* the tile's rows into the stored K (n x M, row-major) as they were formed */                        \
            if (STORE)                                                                                            \
                for (int64_t r = 0; r < rows; ++r) memcpy(STORE + (i0 + r) * M, BUF + r * MP, M * sizeof(T));    \
            /* the tile times v (its rows' inner products), plus w */                                             \
            for (int64_t r = 0; r < TILE; ++r) {                                                                  \
                const T *row = BUF + r * MP;                                                                      \
                for (int64_t c = 0; c < k; ++c) {                                                                 \
                    if (r >= rows) {                                                                              \
                        u[r * k + c] = 0;                                                                         \
                        continue;                                                                                 \
                    }                                                                                             \
                    const T *vc = VT + c * MP;                                                                    \
                    NAME##_vt s = vzero;                                                                          \
                    for (int64_t j = 0; j < MP; j += NAME##_lanes) {                                                     \
                        NAME##_vt a, b;                                                                           \
                        memcpy(&a, row + j, sizeof a);                                                            \
                        memcpy(&b, vc + j, sizeof b);                                                             \
                        s += a * b;                                                                               \
                    }                                                                                             \
                    T total = 0;                                                                                  \
                    for (int l = 0; l < NAME##_lanes; ++l) total += s[l];                                                \
                    u[r * k + c] = total + (W ? W[(i0 + r) * k + c] : (T)0);                                      \
                    if (KV) KV[(i0 + r) * k + c] = u[r * k + c];                                                  \
                }                                                                                                 \
            }                                                                                                     \
            if (!OUT) continue; /* K v (+ w) alone */                                                            \
            /* the tile's rows times their inner products, summed into OUT in ACC */                              \
            for (int64_t c = 0; c < k; ++c) {                                                                     \
                ACC *oc = OUT + c * MP;                                                                           \
                for (int64_t j = 0; j < MP; j += NAME##_lanes) {                                                         \
                    NAME##_vt s = vzero;                                                                          \
                    for (int r = 0; r < TILE; ++r) {                                                              \
                        NAME##_vt a;                                                                              \
                        memcpy(&a, BUF + r * MP + j, sizeof a);                                                   \
                        s += a * u[r * k + c];                                                                    \
                    }                                                                                             \
                    NAME##_va o;                                                                                  \
                    memcpy(&o, oc + j, sizeof o);                                                                 \
                    o += __builtin_convertvector(s, NAME##_va);                                                   \
                    memcpy(oc + j, &o, sizeof o);                                                                 \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

#define COEFFS32 {1.0f, 0.6931471805599453f, 0.2402265069591007f, 0.055504108664821576f, 0.009618129107628477f,    \
                  0.0013333558146428441f, 0.00015403530393381606f, 1.5252733804059838e-05f}
#define COEFFS64 {1.0, 0.6931471805599453, 0.2402265069591007, 0.055504108664821576, 0.009618129107628477,         \
                  0.0013333558146428441, 0.00015403530393381606, 1.5252733804059838e-05, 1.3215486790144305e-06,    \
                  1.0178086009239696e-07, 7.054911620801121e-09, 4.44553827187081e-10, 2.5678435993488196e-11,      \
                  1.3691488853904124e-12, 6.778726354822543e-14}

DEFINE_PASS(kgp_pass_f32, float, float, int32_t, 127, 23, 7, COEFFS32, __builtin_sqrtf)
DEFINE_PASS(kgp_pass_f32_f64, float, double, int32_t, 127, 23, 7, COEFFS32, __builtin_sqrtf)
DEFINE_PASS(kgp_pass_f64, double, double, int64_t, 1023, 52, 14, COEFFS64, __builtin_sqrt)

/* The stored pass: OUT += K^T (K v + w) reading a stored K (n x M, row stride LDK) once. Same sums as the pass
   above: a row's inner product with v and each TILE rows' part of K^T u in T, that part added to OUT in ACC.
   A tile (TILE rows, 64 KB at M = 2,000 in float) is read from memory by its inner products and read back
   from the cache by the transposed product; while the latter runs, the next tile's rows are prefetched, so
   that memory is not idle for half of the pass (at n = 219,082, M = 2,000 float, two threads: 0.042-0.055 s
   with the prefetch, 0.058-0.064 s without, 0.19 s for torch's two matrix-vector products).
   VT is k x M (v transposed), W n x k or NULL, OUT k x M. */
#define DEFINE_STORED_PASS(NAME, T, ACC)                                                                          \
    enum { NAME##_lanes = VECTOR_BYTES / sizeof(T) };                                                             \
    typedef T NAME##_vt __attribute__((vector_size(VECTOR_BYTES)));                                               \
    typedef ACC NAME##_va __attribute__((vector_size(sizeof(ACC) * NAME##_lanes)));                               \
    void NAME(const T *K, int64_t LDK, const T *VT, const T *W, ACC *OUT, int64_t n0, int64_t n1, int64_t M,      \
              int64_t k) {                                                                                        \
        enum { L = NAME##_lanes };                                                                                \
        const int64_t mv = M / L * L;                                                                             \
        T u[TILE * MAX_K];                                                                                        \
        for (int64_t i0 = n0; i0 < n1; i0 += TILE) {                                                              \
            /* a short last tile repeats its last row, with u = 0 */                                              \
            const int rows = n1 - i0 < TILE ? (int)(n1 - i0) : TILE;                                              \
            const T *r[TILE];                                                                                     \
            for (int q = 0; q < TILE; ++q) r[q] = K + (i0 + (q < rows ? q : rows - 1)) * LDK;                     \
            const T *next = i0 + 2 * TILE <= n1 ? K + (i0 + TILE) * LDK : 0;                                      \
            for (int64_t c = 0; c < k; ++c) {                                                                     \
                const T *v = VT + c * M;                                                                          \
                NAME##_vt a[TILE];                                                                                \
                for (int q = 0; q < TILE; ++q) a[q] = (NAME##_vt){0};                                             \
                int64_t j = 0;                                                                                    \
                for (; j < mv; j += L) {                                                                          \
                    NAME##_vt x;                                                                                  \
                    memcpy(&x, v + j, sizeof x);                                                                  \
                    for (int q = 0; q < TILE; ++q) {                                                              \
                        NAME##_vt y;                                                                              \
                        memcpy(&y, r[q] + j, sizeof y);                                                           \
                        a[q] += y * x;                                                                            \
                    }                                                                                             \
                }                                                                                                 \
                for (int q = 0; q < TILE; ++q) {                                                                  \
                    T s = 0;                                                                                      \
                    for (int l = 0; l < L; ++l) s += a[q][l];                                                     \
                    for (int64_t t = j; t < M; ++t) s += r[q][t] * v[t];                                          \
                    u[q * MAX_K + c] = q < rows ? s + (W ? W[(i0 + q) * k + c] : (T)0) : (T)0;                    \
                }                                                                                                 \
            }                                                                                                     \
            for (int64_t c = 0; c < k; ++c) {                                                                     \
                ACC *o = OUT + c * M;                                                                             \
                const T *uc = u + c;                                                                              \
                int64_t j = 0;                                                                                    \
                for (; j < mv; j += L) {                                                                          \
                    if (next && c == 0)                                                                           \
                        for (int q = 0; q < TILE; ++q) __builtin_prefetch(next + q * LDK + j, 0, 2);              \
                    NAME##_vt s = {0};                                                                            \
                    for (int q = 0; q < TILE; ++q) {                                                              \
                        NAME##_vt y;                                                                              \
                        memcpy(&y, r[q] + j, sizeof y);                                                           \
                        s += y * uc[q * MAX_K];                                                                   \
                    }                                                                                             \
                    NAME##_va acc;                                                                                \
                    memcpy(&acc, o + j, sizeof acc);                                                              \
                    acc += __builtin_convertvector(s, NAME##_va);                                                 \
                    memcpy(o + j, &acc, sizeof acc);                                                              \
                }                                                                                                 \
                for (; j < M; ++j) {                                                                              \
                    T s = 0;                                                                                      \
                    for (int q = 0; q < TILE; ++q) s += r[q][j] * uc[q * MAX_K];                                  \
                    o[j] += s;                                                                                    \
                }                                                                                                 \
            }                                                                                                     \
        }                                                                                                         \
    }

DEFINE_STORED_PASS(kgp_stored_pass_f32, float, float)
DEFINE_STORED_PASS(kgp_stored_pass_f32_f64, float, double)
DEFINE_STORED_PASS(kgp_stored_pass_f64, double, double)
