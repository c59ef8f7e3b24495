/* kgp's triangular solves with a float32 factor and float64 right-hand sides and sums.

   Compiled on first use by kgp/native_build.py and driven by kgp/triangular.py (LowerFactor), which splits
   a solve into block rows and runs each block's panel product on several threads and its diagonal block on
   one; read that module's docstring for why. L is lower triangular, row-major with row stride LDL; only its
   lower triangle is read. X holds k columns of length M, each contiguous (k x M, row-major): the right-hand
   sides on entry, overwritten in place. Every float32 entry is widened exactly to float64 before it is
   multiplied, so a solve is the float64 solve with the widened factor, up to the order of the float64 sums,
   while reading half the bytes. */

#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VECTOR_BYTES 64
#else
#define VECTOR_BYTES 32
#endif

typedef double vd __attribute__((vector_size(VECTOR_BYTES)));
typedef float vh __attribute__((vector_size(VECTOR_BYTES / 2))); /* as many floats as a vd has doubles */
enum { LANES = VECTOR_BYTES / 8 };

int kgp_solve_vector_bytes(void) { return VECTOR_BYTES; }

static inline vd widen(const float *p) {
    vh h;
    memcpy(&h, p, sizeof h);
    return __builtin_convertvector(h, vd);
}

/* sum_j l[j] x[j] over j < n; four independent accumulators hide the FMA latency */
static inline double dot(const float *l, const double *x, int64_t n) {
    vd a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t j = 0;
    for (; j + 4 * LANES <= n; j += 4 * LANES) {
        vd x0, x1, x2, x3;
        memcpy(&x0, x + j, sizeof x0);
        memcpy(&x1, x + j + LANES, sizeof x1);
        memcpy(&x2, x + j + 2 * LANES, sizeof x2);
        memcpy(&x3, x + j + 3 * LANES, sizeof x3);
        a0 += widen(l + j) * x0;
        a1 += widen(l + j + LANES) * x1;
        a2 += widen(l + j + 2 * LANES) * x2;
        a3 += widen(l + j + 3 * LANES) * x3;
    }
    a0 = (a0 + a1) + (a2 + a3);
    double s = 0;
    for (int i = 0; i < LANES; ++i) s += a0[i];
    for (; j < n; ++j) s += (double)l[j] * x[j];
    return s;
}

/* y[j] += a l[j] over j < n */
static inline void axpy(double *y, const float *l, double a, int64_t n) {
    const vd va = (vd){0} + a;
    int64_t j = 0;
    for (; j + 2 * LANES <= n; j += 2 * LANES) {
        vd y0, y1;
        memcpy(&y0, y + j, sizeof y0);
        memcpy(&y1, y + j + LANES, sizeof y1);
        y0 += va * widen(l + j);
        y1 += va * widen(l + j + LANES);
        memcpy(y + j, &y0, sizeof y0);
        memcpy(y + j + LANES, &y1, sizeof y1);
    }
    for (; j < n; ++j) y[j] += a * (double)l[j];
}

/* y[j] += a0 l0[j] + a1 l1[j] + a2 l2[j] + a3 l3[j] over j < n, with l1 = l0 + ldl, ...: y is loaded and
   stored once for four rows */
static inline void axpy4(double *y, const float *l0, int64_t ldl, double a0, double a1, double a2, double a3,
                         int64_t n) {
    const float *l1 = l0 + ldl, *l2 = l1 + ldl, *l3 = l2 + ldl;
    const vd v0 = (vd){0} + a0, v1 = (vd){0} + a1, v2 = (vd){0} + a2, v3 = (vd){0} + a3;
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        vd acc;
        memcpy(&acc, y + j, sizeof acc);
        acc += v0 * widen(l0 + j) + v1 * widen(l1 + j);
        acc += v2 * widen(l2 + j) + v3 * widen(l3 + j);
        memcpy(y + j, &acc, sizeof acc);
    }
    for (; j < n; ++j) y[j] += a0 * (double)l0[j] + a1 * (double)l1[j] + a2 * (double)l2[j] + a3 * (double)l3[j];
}

/* four rows' sums l_r[j] x[j] over j < n at once: each x vector is loaded once for four rows */
static inline void dot4(const float *l0, int64_t ldl, const double *x, int64_t n, double out[4]) {
    const float *l1 = l0 + ldl, *l2 = l1 + ldl, *l3 = l2 + ldl;
    vd a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
    int64_t j = 0;
    for (; j + 2 * LANES <= n; j += 2 * LANES) {
        vd x0, x1;
        memcpy(&x0, x + j, sizeof x0);
        memcpy(&x1, x + j + LANES, sizeof x1);
        a0 += widen(l0 + j) * x0;
        a1 += widen(l1 + j) * x0;
        a2 += widen(l2 + j) * x0;
        a3 += widen(l3 + j) * x0;
        b0 += widen(l0 + j + LANES) * x1;
        b1 += widen(l1 + j + LANES) * x1;
        b2 += widen(l2 + j + LANES) * x1;
        b3 += widen(l3 + j + LANES) * x1;
    }
    a0 += b0, a1 += b1, a2 += b2, a3 += b3;
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (int i = 0; i < LANES; ++i) s0 += a0[i], s1 += a1[i], s2 += a2[i], s3 += a3[i];
    for (; j < n; ++j) {
        s0 += (double)l0[j] * x[j];
        s1 += (double)l1[j] * x[j];
        s2 += (double)l2[j] * x[j];
        s3 += (double)l3[j] * x[j];
    }
    out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

/* L X = B, the panel left of a block row: X[c][i] -= L[i, :s] . X[c][:s] for rows r0 <= i < r1 */
void kgp_solve_panel(const float *L, int64_t ldl, double *X, int64_t M, int64_t k, int64_t r0, int64_t r1,
                     int64_t s) {
    int64_t i = r0;
    for (; i + 4 <= r1; i += 4)
        for (int64_t c = 0; c < k; ++c) {
            double d[4];
            dot4(L + i * ldl, ldl, X + c * M, s, d);
            for (int r = 0; r < 4; ++r) X[c * M + i + r] -= d[r];
        }
    for (; i < r1; ++i)
        for (int64_t c = 0; c < k; ++c) X[c * M + i] -= dot(L + i * ldl, X + c * M, s);
}

/* L^T X = B, a share of the panel below a block column: ACC[c][j - s] = sum_{i0 <= i < i1} L[i, j] X[c][i]
   for s <= j < e (k (e - s) doubles, overwritten). Reading whole row segments in memory order; the caller
   subtracts the threads' sums from X[c][s:e] */
void kgp_solve_panel_t(const float *L, int64_t ldl, const double *X, int64_t M, int64_t k, int64_t s, int64_t e,
                       int64_t i0, int64_t i1, double *ACC) {
    const int64_t w = e - s;
    memset(ACC, 0, sizeof(double) * (size_t)(k * w));
    int64_t i = i0;
    for (; i + 4 <= i1; i += 4)
        for (int64_t c = 0; c < k; ++c) {
            const double *x = X + c * M + i;
            axpy4(ACC + c * w, L + i * ldl + s, ldl, x[0], x[1], x[2], x[3], w);
        }
    for (; i < i1; ++i)
        for (int64_t c = 0; c < k; ++c) axpy(ACC + c * w, L + i * ldl + s, X[c * M + i], w);
}

/* the diagonal block s <= i < e once its panel is subtracted: forward substitution with L, or back
   substitution with L^T (column by column, reading the rows of L) */
void kgp_solve_diagonal(const float *L, int64_t ldl, double *X, int64_t M, int64_t k, int64_t s, int64_t e,
                        int64_t transpose) {
    for (int64_t c = 0; c < k; ++c) {
        double *x = X + c * M;
        if (!transpose) {
            for (int64_t i = s; i < e; ++i) x[i] = (x[i] - dot(L + i * ldl + s, x + s, i - s)) / (double)L[i * ldl + i];
        } else {
            for (int64_t i = e - 1; i >= s; --i) {
                x[i] /= (double)L[i * ldl + i];
                axpy(x + s, L + i * ldl + s, -x[i], i - s);
            }
        }
    }
}
