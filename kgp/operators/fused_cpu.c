/* kgp's fused CPU pass: out += K^T (K v + w) for the RBF and Matern 3/2, 5/2 kernels, a tile of rows at a time.

   Compiled on first use by kgp/operators/fused_cpu.py (gcc -O3 -march=native, loaded with ctypes); read
   that module's docstring for when it runs. An RBF entry is K[i, j] = exp2(clamp(r_i . c_j, lo, hi = 0)) with
   r_i = [u_i, -|u_i|^2 / 2, 1] and c_j = log2(e) [v_j, 1, -|v_j|^2 / 2]; a Matern entry reads a^2 = r_i . c_j
   = |u_i - v_j|^2 (r_i = [u_i, |u_i|^2, 1], c_j = [-2 v_j, 1, |v_j|^2], sqrt 3 or sqrt 5 folded into u and v),
   clamped to [lo = 0, hi], as kgp/kernels/formulas.py's blocks do. A tile is formed, multiplied by v and multiplied back while it sits in the cache: the block is never written to
   memory, which is what bounds the blocked pass (docs/backend.md, "The native CPU pass").

   Layouts (row-major): R is n x D (the rows), CT is D x MP (the columns, transposed, padded to MP, a multiple
   of two vectors; padded columns are never read back), VT is k x MP (v transposed, zero in the padding),
   W is n x k or NULL (k <= MAX_K), OUT is k x MP (accumulated into, in ACC) or NULL (K v alone), BUF is
   TILE x MP of scratch, KV is n x k or NULL: where given, K v + w is written there too. STORE is NULL or the
   first h rows of an n x M matrix (row i at STORE + i M; h = n for the whole K, less for a head of it, and a
   call that stores covers rows below h only): where given, the entries formed are written there too
   (kernel_cache="auto" keeps them from then on), and later products read them with the stored pass below.
   SELF is NULL or n entries: where SELF[i] >= 0, row i's entry in column SELF[i] is set to SELF_VALUE (the
   exact k(x, x) of a row that is that column's point: the GEMM's cancellation leaves rounding there, and at
   extreme input scales anything in [0, 1]) before it is stored or multiplied.
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

/* 2^(-j/16), j = 0..15, correctly rounded (from 60-digit decimal arithmetic), for the exponential below */
static const double EXP2_TABLE64[16] = {
    0x1.0000000000000p+0, 0x1.ea4afa2a490dap-1, 0x1.d5818dcfba487p-1, 0x1.c199bdd85529cp-1,
    0x1.ae89f995ad3adp-1, 0x1.9c49182a3f090p-1, 0x1.8ace5422aa0dbp-1, 0x1.7a11473eb0187p-1,
    0x1.6a09e667f3bcdp-1, 0x1.5ab07dd485429p-1, 0x1.4bfdad5362a27p-1, 0x1.3dea64c123422p-1,
    0x1.306fe0a31b715p-1, 0x1.2387a6e756238p-1, 0x1.172b83c7d517bp-1, 0x1.0b5586cf9890fp-1};
static const float EXP2_TABLE32[16] = {
    0x1.000000p+0f, 0x1.ea4afap-1f, 0x1.d5818ep-1f, 0x1.c199bep-1f, 0x1.ae89fap-1f, 0x1.9c4918p-1f,
    0x1.8ace54p-1f, 0x1.7a1148p-1f, 0x1.6a09e6p-1f, 0x1.5ab07ep-1f, 0x1.4bfdaep-1f, 0x1.3dea64p-1f,
    0x1.306fe0p-1f, 0x1.2387a6p-1f, 0x1.172b84p-1f, 0x1.0b5586p-1f};

/* The exponential: 2^x for lo <= x <= 0 as 2^-(q / N) 2^f with q = round(-x N), f = x + q / N (exact by
   Sterbenz's lemma), |f| <= 1 / (2 N). 2^-(q / N) is a table entry 2^-((q mod N) / N) -- one or two vectors
   of N = min(16, 2 lanes) entries, picked by a register permute -- with q / N (rounded down) subtracted from its
   exponent bits (at most 1010 in double, 62 in float: a normal number); 2^f is its Taylor polynomial in
   f ln 2 of the lowest degree whose remainder is below 1/12 of the type's rounding: 7 in double and 3 in
   float with N = 16, 8 in double with N = 8 (256-bit vectors). Against the reduction to |f| <= 1/2 and
   degrees 14 / 7 this saves 7 / 4 of the entry's ~30 multiply-adds. */
#define EXP2_DEGREE(T, N) (sizeof(T) == 8 ? ((N) == 16 ? 7 : 8) : ((N) == 16 ? 3 : 4))

#define DEFINE_PASS(NAME, T, ACC, IT, MANT, COEFFS, TABLE, SQRT)                                                \
    enum { NAME##_lanes = VECTOR_BYTES / sizeof(T) };                                                             \
    enum { NAME##_n = 2 * NAME##_lanes < 16 ? 2 * NAME##_lanes : 16 };                                           \
    enum { NAME##_degree = EXP2_DEGREE(T, NAME##_n) };                                                            \
    typedef T NAME##_vt __attribute__((vector_size(VECTOR_BYTES)));                                               \
    typedef IT NAME##_vi __attribute__((vector_size(VECTOR_BYTES)));                                              \
    typedef ACC NAME##_va __attribute__((vector_size(sizeof(ACC) * NAME##_lanes)));                               \
    static const T NAME##_coeff[] = COEFFS;                                                                       \
    static inline NAME##_vt NAME##_exp2(NAME##_vt x, NAME##_vt t0, NAME##_vt t1) {                                \
        enum { N = NAME##_n, SHIFT = N == 16 ? 4 : 3 };                                                           \
        NAME##_vt y = x * (T)(-N) + (T)0.5;                                                                       \
        NAME##_vi q = __builtin_convertvector(y, NAME##_vi);                                                     \
        NAME##_vt f = x + __builtin_convertvector(q, NAME##_vt) * (T)(1.0 / N);                                   \
        NAME##_vt p = f * 0 + NAME##_coeff[NAME##_degree];                                                        \
        for (int c = NAME##_degree - 1; c >= 1; --c) p = p * f + NAME##_coeff[c];                                 \
        NAME##_vi j = q & (N - 1);                                                                                \
        NAME##_vt e = (int)N == (int)NAME##_lanes ? __builtin_shuffle(t0, j) : __builtin_shuffle(t0, t1, j);      \
        NAME##_vt scale = (NAME##_vt)((NAME##_vi)e - ((q >> SHIFT) << MANT));                                     \
        /* scale (1 + f p), rounded once at the end (fused): f p = 2^f - 1 is small next to 1 */                  \
        return scale * (f * p) + scale;                                                                           \
    }                                                                                                             \
    /* the table's N entries in two vectors (the second unused where N is one vector's lanes) */                 \
    static inline void NAME##_tables(NAME##_vt *t0, NAME##_vt *t1) {                                              \
        for (int l = 0; l < NAME##_lanes; ++l) {                                                                  \
            (*t0)[l] = TABLE[(l % NAME##_n) * (16 / NAME##_n)];                                                   \
            (*t1)[l] = TABLE[((l + NAME##_lanes) % NAME##_n) * (16 / NAME##_n)];                                  \
        }                                                                                                         \
    }                                                                                                             \
    /* the exponential alone on n values (a multiple of the lanes), lo <= x <= 0: for the tests */                \
    void NAME##_exp2_values(const T *X, T *OUT, int64_t n) {                                                      \
        NAME##_vt t0, t1, x;                                                                                      \
        NAME##_tables(&t0, &t1);                                                                                  \
        for (int64_t i = 0; i < n; i += NAME##_lanes) {                                                           \
            memcpy(&x, X + i, sizeof x);                                                                          \
            x = NAME##_exp2(x, t0, t1);                                                                           \
            memcpy(OUT + i, &x, sizeof x);                                                                        \
        }                                                                                                         \
    }                                                                                                             \
    void NAME(const T *R, const T *CT, const T *VT, const T *W, ACC *OUT, T *BUF, T *KV, T *STORE,               \
              const int64_t *SELF, int64_t n0, int64_t n1, int64_t D, int64_t MP, int64_t k, int64_t family, T lo,  \
              T hi, T SELF_VALUE, int64_t M) {                                                                     \
        T u[TILE * MAX_K];                                                                                        \
        const NAME##_vt vlo = (NAME##_vt){0} + lo, vhi = (NAME##_vt){0} + hi, vzero = {0};                        \
        NAME##_vt t0, t1;                                                                                         \
        NAME##_tables(&t0, &t1);                                                                                  \
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
                            e = NAME##_exp2(x, t0, t1); /* x: the base-2 exponent */                                      \
                        } else { /* x = a^2, the scaled squared distance: (1 + a [+ a^2 / 3]) exp(-a) */          \
                            NAME##_vt a = x;                                                                      \
                            for (int l = 0; l < NAME##_lanes; ++l) a[l] = SQRT(x[l]);                             \
                            e = NAME##_exp2(a * (T)-1.4426950408889634, t0, t1);                                          \
                            e *= family == MATERN32 ? a + 1 : a * a * (T)(1.0 / 3.0) + a + 1;                     \
                        }                                                                                         \
                        memcpy(BUF + r * MP + j + h * NAME##_lanes, &e, sizeof e);                                \
                    }                                                                                             \
            }                                                                                                     \
            int64_t rows = n1 - i0 < TILE ? n1 - i0 : TILE;                                                       \
            /* a row's own column: the exact k(x, x) in place of the GEMM's rounding */                           \
            if (SELF)                                                                                             \
                for (int64_t r = 0; r < rows; ++r)                                                                \
                    if (SELF[i0 + r] >= 0) BUF[r * MP + SELF[i0 + r]] = SELF_VALUE;                               \
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

DEFINE_PASS(kgp_pass_f32, float, float, int32_t, 23, COEFFS32, EXP2_TABLE32, __builtin_sqrtf)
DEFINE_PASS(kgp_pass_f32_f64, float, double, int32_t, 23, COEFFS32, EXP2_TABLE32, __builtin_sqrtf)
DEFINE_PASS(kgp_pass_f64, double, double, int64_t, 52, COEFFS64, EXP2_TABLE64, __builtin_sqrt)

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
