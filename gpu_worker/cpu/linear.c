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
#include <math.h>
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

/* A float32 GEMM whose every output is the same bits for any number of rows of x: y[b, o] =
 * x[b, :] . W[o, :] accumulated in one vector of GEMM_VF lanes (lane j: the products of i = j
 * mod GEMM_VF, fused multiply-adds from zero in increasing i), the lanes summed by one fixed
 * reduction, then the in % GEMM_VF last products, one by one. Register tiles of GEMM_MR rows
 * of x by GEMM_NR weight rows (each weight vector loaded once for GEMM_MR rows, each x vector
 * once for GEMM_NR) change where the operands come from, never an output's operations: a
 * token gets the same result alone as among a prefill's hundreds of rows (what a mixture of
 * experts' float experts need: the rows a step routes to an expert vary with the batch).
 * Measured on Sapphire Rapids, 2 threads, 1024x1024: ~210 GFLOP/s at 256 rows against
 * linear_small's 60-90 by 8 rows a call (oneDNN's own f32 GEMM ~300, batch-dependent); tiles
 * of 6 x 4 (a decode step's ~6 rows an expert in one pass) against 4 x 6, 8 x 3, 5 x 4:
 * 94 / 71 / 78 / 82 GFLOP/s at 6 rows streaming a 128 MB weight, 209 / 189 / 168 / 222 at 256
 * rows of a 4 MB one. Each tile's rows of x are first packed side by side (one stream for the
 * tile instead of GEMM_MR rows a row length apart, which at in = 1024 all fall in one L1 set
 * with the weight rows): on Zen 4, 2 threads, 1024x1024, 256 / 512 rows 125 -> 139 / 128 ->
 * 140 GFLOP/s (torch's oneDNN 151 / 173). Blocking over in (the accumulators stored between
 * blocks of 128-512) measured slower there. */
#if defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_VF 16
#define GEMM_MR 6
#define GEMM_NR 4
typedef __m512 gemm_v;
#define GEMM_ZERO() _mm512_setzero_ps()
#define GEMM_LOAD(p) _mm512_loadu_ps(p)
#define GEMM_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define GEMM_SUM(v) _mm512_reduce_add_ps(v)
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMM_VF 8
#define GEMM_MR 3
#define GEMM_NR 4
typedef __m256 gemm_v;
#define GEMM_ZERO() _mm256_setzero_ps()
#define GEMM_LOAD(p) _mm256_loadu_ps(p)
#define GEMM_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float gemm_sum8(__m256 v) { /* a fixed order: halves, then pairs */
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#define GEMM_SUM(v) gemm_sum8(v)
#endif

#if defined(GEMM_VF)
/* y [mr, out] (row stride out) for x [mr, in] against W rows [nr, in], mr <= GEMM_MR, nr <=
 * GEMM_NR (compiled per tile shape by the callers' constants) */
static inline __attribute__((always_inline)) void gemm_tile(const float *xp, const float *x,
                                                            int mr, const float *w, int nr,
                                                            int in, const float *bias, float *y,
                                                            int out, const float *pf) {
    const int kv = in / GEMM_VF * GEMM_VF;
    gemm_v acc[GEMM_MR][GEMM_NR];
    for (int m = 0; m < GEMM_MR; m++)
        for (int n = 0; n < GEMM_NR; n++) acc[m][n] = GEMM_ZERO();
    for (int i = 0; i < kv; i += GEMM_VF, xp += GEMM_MR * GEMM_VF) {
        gemm_v xv[GEMM_MR];
        for (int m = 0; m < GEMM_MR; m++)
            if (m < mr) xv[m] = GEMM_LOAD(xp + m * GEMM_VF);
        if (pf && (i & 15) == 0) /* each line of the rows to come once (16 floats a line) */
            for (int n = 0; n < GEMM_NR; n++)
                _mm_prefetch((const char *)(pf + (int64_t)n * in + i), _MM_HINT_T1);
        for (int n = 0; n < GEMM_NR; n++) {
            if (n >= nr) continue;
            gemm_v wv = GEMM_LOAD(w + (int64_t)n * in + i);
            for (int m = 0; m < GEMM_MR; m++)
                if (m < mr) acc[m][n] = GEMM_FMA(xv[m], wv, acc[m][n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            const float *xm = x + (int64_t)m * in, *wn = w + (int64_t)n * in;
            float s = GEMM_SUM(acc[m][n]);
            __m128 t = _mm_set_ss(s); /* scalar intrinsics: never reassociated */
            for (int i = kv; i < in; i++)
                t = _mm_fmadd_ss(_mm_set_ss(xm[i]), _mm_set_ss(wn[i]), t);
            y[(int64_t)m * out + n] = _mm_cvtss_f32(t) + (bias ? bias[n] : 0.f);
        }
}
#endif

#if defined(GEMM_VF)
#ifndef GEMM_PF
#define GEMM_PF 8 /* weight rows ahead the first tile of x prefetches */
#endif

/* floats of one packed tile of x: GEMM_MR rows of in / GEMM_VF * GEMM_VF (at least a vector) */
static inline int64_t gemm_tile_floats(int in) {
    return (int64_t)GEMM_MR * (in >= GEMM_VF ? in / GEMM_VF * GEMM_VF : GEMM_VF);
}

/* the tile's rows, m = 0 to mr, by a register tile compiled for that row count (a run-time
 * mr tests each row in the inner loop: a one-row tile, as each expert of a decoded token is,
 * ran at half the speed), with the weight prefetch (pf) or without it (NULL: compiled out) */
#define GEMM_ROWS_CASE(M, PF)                                                                  \
    case M:                                                                                    \
        gemm_tile(xt, xb, M, wo, GEMM_NR, in, bo, yo, out, PF);                                \
        break;
#if GEMM_MR > 3
#define GEMM_ROWS_SWITCH(PF)                                                                   \
    switch (mr) {                                                                              \
        GEMM_ROWS_CASE(1, PF)                                                                  \
        GEMM_ROWS_CASE(2, PF)                                                                  \
        GEMM_ROWS_CASE(3, PF)                                                                  \
        GEMM_ROWS_CASE(4, PF)                                                                  \
        GEMM_ROWS_CASE(5, PF)                                                                  \
        GEMM_ROWS_CASE(6, PF)                                                                  \
    }
#else
#define GEMM_ROWS_SWITCH(PF)                                                                   \
    switch (mr) {                                                                              \
        GEMM_ROWS_CASE(1, PF)                                                                  \
        GEMM_ROWS_CASE(2, PF)                                                                  \
        GEMM_ROWS_CASE(3, PF)                                                                  \
    }
#endif
/* y rows [0, nb) of x [nb, in] (packed in xp) against W rows [lo, hi). The first tile of x
 * reads W from memory: it sweeps the rows GEMM_PF ahead into L2 as it goes, and the later
 * tiles, which find W there, run without the prefetches (they cost a many-row GEMM 10-15%
 * on Zen 4). */
static void gemm_rows(const float *xp, const float *x, int nb, const float *w,
                      const float *bias, float *y, int out, int in, int lo, int hi) {
    const int64_t tile_floats = gemm_tile_floats(in);
    for (int b = 0; b < nb; b += GEMM_MR) {
        int mr = nb - b < GEMM_MR ? nb - b : GEMM_MR;
        const float *xb = x + (int64_t)b * in, *xt = xp + b / GEMM_MR * tile_floats;
        for (int o = lo; o < hi; o += GEMM_NR) {
            int nr = hi - o < GEMM_NR ? hi - o : GEMM_NR;
            const float *wo = w + (int64_t)o * in, *bo = bias ? bias + o : NULL;
            const float *pf = wo + (int64_t)GEMM_PF * in;
            float *yo = y + (int64_t)b * out + o;
            if (nr < GEMM_NR)
                gemm_tile(xt, xb, mr, wo, nr, in, bo, yo, out, b == 0 ? pf : NULL);
            else if (b == 0)
                GEMM_ROWS_SWITCH(pf)
            else
                GEMM_ROWS_SWITCH(NULL)
        }
    }
}

/* tile t of x [nb, in] packed into dst: [kv / GEMM_VF][GEMM_MR][GEMM_VF], rows past nb zero */
static void gemm_pack_tile(const float *x, int nb, int in, int t, float *dst) {
    const int kv = in / GEMM_VF * GEMM_VF;
    for (int m = 0; m < GEMM_MR; m++) {
        int b = t * GEMM_MR + m;
        for (int i = 0; i < kv; i += GEMM_VF) {
            float *d = dst + (int64_t)i * GEMM_MR + m * GEMM_VF;
            if (b < nb)
                memcpy(d, x + (int64_t)b * in + i, sizeof(float) * GEMM_VF);
            else
                memset(d, 0, sizeof(float) * GEMM_VF);
        }
    }
}
#endif

/* weight rows a scheduling unit: a multiple of GEMM_NR, ~128 KB of W at in = 1024 (L2) */
#define GEMM_UNIT 32

/* Groups of rows, each against its own weight, in one parallel region: group g is rows
 * [start[g], start[g + 1]) of x [start[groups], in] and y [start[groups], out], against W_g =
 * w + g * out * in (float32 [out, in]) and bias + g * out (or no bias). Every group's tiles of
 * x are packed, then every (group, unit of weight rows) pair is one work item: one wake of
 * the threads for all of a mixture of experts' experts (one region per expert cost a decode
 * step of a few rows an expert more than its arithmetic on a 2-core VM). Each output is the
 * same bits as linear_gemm gives it (the same tile code); without AVX2 a scalar loop per
 * output. Returns 0; 1 for a shape it does not take; 2 when memory ran out. */
int linear_gemm_groups(const float *x, const int *start, int groups, const float *w,
                       const float *bias, float *y, int out, int in, int nthreads) {
    if (groups < 1 || in < 1 || out < 1 || start[0] != 0) return 1;
    for (int g = 0; g < groups; g++)
        if (start[g + 1] < start[g]) return 1;
    int *item = (int *)malloc(sizeof(int) * (size_t)groups); /* the groups with rows */
    int *tile0 = (int *)malloc(sizeof(int) * ((size_t)groups + 1)); /* each one's first tile */
    if (!item || !tile0) {
        free(item), free(tile0);
        return 2;
    }
    int used = 0;
    tile0[0] = 0;
    for (int g = 0; g < groups; g++) {
        int n = start[g + 1] - start[g];
        if (n > 0) item[used++] = g;
#if defined(GEMM_VF)
        tile0[g + 1] = tile0[g] + (n + GEMM_MR - 1) / GEMM_MR;
#endif
    }
    const int chunks = (out + GEMM_UNIT - 1) / GEMM_UNIT, items = used * chunks;
#if defined(GEMM_VF)
    const int tiles = tile0[groups];
    const int64_t tile_floats = gemm_tile_floats(in);
    float *xp = (float *)aligned_alloc(64, sizeof(float) * (size_t)(tiles * tile_floats + 16));
    if (!xp) {
        free(item), free(tile0);
        return 2;
    }
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int j = 0; j < used; j++) {
            int g = item[j], n = start[g + 1] - start[g];
            for (int t = tile0[g]; t < tile0[g + 1]; t++)
                gemm_pack_tile(x + (int64_t)start[g] * in, n, in, t - tile0[g],
                               xp + t * tile_floats);
        }
#pragma omp for schedule(dynamic, 1)
        for (int i = 0; i < items; i++) {
            int g = item[i / chunks], lo = (i % chunks) * GEMM_UNIT, s = start[g];
            int hi = lo + GEMM_UNIT < out ? lo + GEMM_UNIT : out;
            gemm_rows(xp + tile0[g] * tile_floats, x + (int64_t)s * in, start[g + 1] - s,
                      w + (int64_t)g * out * in, bias ? bias + (int64_t)g * out : NULL,
                      y + (int64_t)s * out, out, in, lo, hi);
        }
    }
    free(xp);
#else
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int i = 0; i < items; i++) {
        int g = item[i / chunks], lo = (i % chunks) * GEMM_UNIT;
        int hi = lo + GEMM_UNIT < out ? lo + GEMM_UNIT : out;
        const float *wg = w + (int64_t)g * out * in, *bg = bias ? bias + (int64_t)g * out : NULL;
        for (int b = start[g]; b < start[g + 1]; b++)
            for (int o = lo; o < hi; o++) {
                const float *xb = x + (int64_t)b * in, *wo = wg + (int64_t)o * in;
                float s = 0.f;
                for (int k = 0; k < in; k++) s = fmaf(xb[k], wo[k], s);
                y[(int64_t)b * out + o] = s + (bg ? bg[o] : 0.f);
            }
    }
#endif
    free(item), free(tile0);
    return 0;
}

/* y [nb, out] = x [nb, in] @ W.T (+ bias), W float32 [out, in], any nb >= 1: see above
 * (linear_gemm_groups with one group). Returns as it. */
int linear_gemm(const float *x, int nb, const float *w, const float *bias, float *y, int out,
                int in, int nthreads) {
    if (nb < 1) return 1;
    int start[2] = {0, nb};
    return linear_gemm_groups(x, start, 1, w, bias, y, out, in, nthreads);
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
