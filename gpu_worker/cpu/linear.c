/* Small-batch linear layers on the CPU: y[b, :] = W x[b, :] (+ bias) for a few rows of x.
 *
 * Decoding one or a few sequences is bound by reading the weights: every step streams the
 * whole model from memory once. The BLAS path torch takes for a [1..8, K] x [K, N] product
 * reads W at a third of this machine's bandwidth; here each weight row is read once, for
 * every row of x, by plain loops that gcc vectorizes (-O3 -march=native -ffast-math).
 *
 * W is row-major [out, in] (nn.Linear's layout), float32 or bfloat16. bf16 weights go, on a
 * CPU with AVX512_BF16, to its bf16 dot product with x rounded to bf16 (what a bf16 model's
 * activations are); elsewhere they are widened to float32 as they are read (bf16 is the top
 * half of an fp32). x, bias and y are float32, contiguous.
 * Rows of W are handed out to the OpenMP threads in chunks, dynamically: on a machine whose
 * cores the server's other processes share, a thread that runs late gets fewer chunks
 * instead of holding the whole step at a barrier.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/linear.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define MAX_ROWS 8
/* weight rows per inner loop, all sharing each x load: as many as there are vector
 * registers for their partial sums (16 with AVX-512's 32 registers, measured 15-25% faster
 * than 4 or 8 at one row of x; 8 with AVX2's 16) */
#if defined(__AVX512F__)
#define TILE 16
#else
#define TILE 8
#endif
#define CHUNK 64   /* weight rows per scheduling unit */



#if defined(__AVX512BF16__)
#include <immintrin.h>
#define DP_TILE 16
static inline float dp_row(const uint16_t *xb, const uint16_t *wr, int in) {
    __m512 acc = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 32)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(wr + i),
                               (__m512bh)_mm512_loadu_si512(xb + i));
    return _mm512_reduce_add_ps(acc);
}

/* rows [lo, hi) of bf16 W against x rounded to bf16 (xh), by the CPU's bf16 dot product
 * (pairs of bf16 products summed into float32 lanes): half the bytes of float32 weights and
 * no widening. `in` is a multiple of 32. */
static void rows_dp(const uint16_t *xh, int nb, const uint16_t *w, const float *bias, float *y,
                    int out, int in, int lo, int hi) {
    int o = lo;
    for (; o + DP_TILE <= hi; o += DP_TILE) {
        const uint16_t *w0 = w + (int64_t)(o - lo) * in;
        for (int b = 0; b < nb; b++) {
            const uint16_t *xb = xh + (int64_t)b * in;
            __m512 acc[DP_TILE];
            for (int t = 0; t < DP_TILE; t++) acc[t] = _mm512_setzero_ps();
            for (int i = 0; i < in; i += 32) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + i);
                for (int t = 0; t < DP_TILE; t++)
                    acc[t] = _mm512_dpbf16_ps(
                        acc[t], (__m512bh)_mm512_loadu_si512(w0 + (int64_t)t * in + i), xv);
            }
            float *yb = y + (int64_t)b * out + o;
            for (int t = 0; t < DP_TILE; t++)
                yb[t] = _mm512_reduce_add_ps(acc[t]) + (bias ? bias[o + t] : 0.f);
        }
    }
    for (; o < hi; o++)
        for (int b = 0; b < nb; b++)
            y[(int64_t)b * out + o] =
                dp_row(xh + (int64_t)b * in, w + (int64_t)(o - lo) * in, in) +
                (bias ? bias[o] : 0.f);
}
#endif

/* rows [lo, hi) of W (already float32, row stride `in`) against every row of x */
static void rows(const float *x, int nb, const float *w, const float *bias, float *y,
                 int out, int in, int lo, int hi) {
    int o = lo;
    for (; o + TILE <= hi; o += TILE) {
        const float *w0 = w + (int64_t)(o - lo) * in;
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (int64_t)b * in;
            float acc[TILE] = {0};
#pragma omp simd reduction(+ : acc[:TILE])
            for (int i = 0; i < in; i++) {
                float xv = xb[i];
                for (int t = 0; t < TILE; t++) acc[t] += xv * w0[t * in + i];
            }
            float *yb = y + (int64_t)b * out + o;
            for (int t = 0; t < TILE; t++) yb[t] = acc[t] + (bias ? bias[o + t] : 0.f);
        }
    }
    for (; o < hi; o++) {
        const float *wr = w + (int64_t)(o - lo) * in;
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (int64_t)b * in;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < in; i++) acc += xb[i] * wr[i];
            y[(int64_t)b * out + o] = acc + (bias ? bias[o] : 0.f);
        }
    }
}

/* Returns 0; 1 when nb is out of range, 2 when memory ran out (the caller uses torch). */
int linear_small(const float *x, int nb, const void *w, int is_bf16, const float *bias,
                 float *y, int out, int in, int nthreads) {
    if (nb < 1 || nb > MAX_ROWS || in < 1 || out < 1) return 1;
    int chunks = (out + CHUNK - 1) / CHUNK, failed = 0;
#if defined(__AVX512BF16__)
    if (is_bf16 && in % 32 == 0) { /* x rounded to bf16 once, then the bf16 dot product */
        uint16_t *xh = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)nb * in);
        if (!xh) return 2;
        for (int64_t i = 0; i < (int64_t)nb * in; i++) xh[i] = f32_to_bf16(x[i]);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int c = 0; c < chunks; c++) {
            int lo = c * CHUNK, hi = lo + CHUNK < out ? lo + CHUNK : out;
            rows_dp(xh, nb, (const uint16_t *)w + (int64_t)lo * in, bias, y, out, in, lo, hi);
        }
        free(xh);
        return 0;
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
        /* one chunk of bf16 rows widened to fp32, per thread (L2-sized for small models) */
        float *wide = is_bf16 ? (float *)malloc(sizeof(float) * (size_t)CHUNK * in) : NULL;
        if (is_bf16 && !wide) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < chunks; c++) {
            int lo = c * CHUNK, hi = lo + CHUNK < out ? lo + CHUNK : out;
            if (is_bf16 && wide) {
                const uint16_t *src = (const uint16_t *)w + (int64_t)lo * in;
                int64_t n = (int64_t)(hi - lo) * in;
#pragma omp simd
                for (int64_t i = 0; i < n; i++) wide[i] = bf16_to_f32(src[i]);
                rows(x, nb, wide, bias, y, out, in, lo, hi);
            } else if (!is_bf16) {
                rows(x, nb, (const float *)w + (int64_t)lo * in, bias, y, out, in, lo, hi);
            }
        }
        free(wide);
    }
    return failed ? 2 : 0;
}
