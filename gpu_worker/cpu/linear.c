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
 * the fused multiply-adds x[b, i] * W[o, i] in increasing i from zero, one after another,
 * then + bias[o]. The weight is packed once at load into panels of GEMM_PW outputs
 * ([ceil(out / GEMM_PW)][in][GEMM_PW], the outputs past `out` zero: linear.py's
 * pack_panels), so that one vector load gives GEMM_PW outputs' weights at one i; a register
 * tile of GEMM_MR rows of x by two vectors of outputs broadcasts each x[b, i] once to both
 * (an outer product a step of i). A tile's shape changes where the operands come from, never
 * an output's operations: a token gets the same result alone as among a prefill's hundreds of
 * rows (what a mixture of experts' float experts need: the rows a step routes to an expert
 * vary with the batch), and on every instruction set (the scalar path runs the same chain).
 * Each tile's rows of x are first packed side by side ([in][GEMM_MR]): the broadcasts of one i
 * read one line, where the rows themselves, `in` floats apart, would all fall in one L1 set.
 * It replaced a dot-product GEMM on the row-major weight (lanes of i summed at the end), whose
 * tile read GEMM_MR rows of x and 4 of W per step of i, more than L1 holds at in = 1024: see
 * docs/benchmarks.md for both on Zen 4. */
#define GEMM_PW 16 /* outputs a panel of the packed weight */
#if defined(__AVX512F__)
#include <immintrin.h>
#define GEMM_VF 16 /* floats a vector: a tile is 2 panels */
#define GEMM_MR 12 /* rows of x a tile: 24 accumulators of 32 registers */
typedef __m512 gemm_v;
#define GEMM_ZERO() _mm512_setzero_ps()
#define GEMM_LOAD(p) _mm512_loadu_ps(p)
#define GEMM_BCAST(p) _mm512_set1_ps(*(p))
#define GEMM_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static inline void gemm_store(float *y, gemm_v v, const float *bias, int n) {
    __mmask16 k = (__mmask16)((1u << n) - 1);
    __m512 b = bias ? _mm512_maskz_loadu_ps(k, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y, k, _mm512_add_ps(v, b));
}
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define GEMM_VF 8 /* a tile is one panel */
#define GEMM_MR 6 /* 12 accumulators of 16 registers */
typedef __m256 gemm_v;
#define GEMM_ZERO() _mm256_setzero_ps()
#define GEMM_LOAD(p) _mm256_loadu_ps(p)
#define GEMM_BCAST(p) _mm256_broadcast_ss(p)
#define GEMM_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline void gemm_store(float *y, gemm_v v, const float *bias, int n) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i k = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lane);
    __m256 b = bias ? _mm256_maskload_ps(bias, k) : _mm256_setzero_ps();
    _mm256_maskstore_ps(y, k, _mm256_add_ps(v, b));
}
#endif

#if defined(GEMM_VF)
#define GEMM_TN (2 * GEMM_VF) /* outputs a tile */
/* Steps of i a tile prefetches its weight lines ahead (one 64-byte line a panel a step). A
 * work item's first tile of rows reads its unit of the weight from memory, the others from
 * L2; without the prefetch that first tile waited on the memory bus: a mixture of experts'
 * float experts, 16 layers of 32 experts (SPR, 2 threads, 2026-12-07), ran 32.9 -> 28.0 ms a
 * layer at 512 tokens and 10.5 -> 8.8 at 64. 32, 64 and 128 steps gave the same. */
#define GEMM_AHEAD 64
/* A work item's tiles after its first also prefetch the next item's unit of the weight, a
 * line every 2 steps of i (1 << GEMM_NEXT_SHIFT): the memory bus streams through the whole item,
 * not only in its first tile, where it was the bound (a float expert's 64 rows: 6 tiles, the
 * next unit fetched over 4 of them). MoE float experts as above: 28.5 -> 26.1 ms a layer at 512
 * tokens; a line every step or every 4 steps gained less. */
#define GEMM_NEXT_SHIFT 1

/* y [mr, out] (row stride out), outputs [o, o + GEMM_TN) clipped to out, for the packed tile
 * of x xp [in][GEMM_MR] against the packed weight wp (mr <= GEMM_MR: compiled per row count
 * by gemm_rows' constants; an odd last panel under AVX-512 loads its own twice) */
static inline __attribute__((always_inline)) void gemm_tile(const float *xp, int mr,
                                                            const float *wp, int o, int in,
                                                            const float *bias, float *y,
                                                            int out, const char *pf,
                                                            int pf_lines) {
    const float *w[2];
    for (int v = 0; v < 2; v++) {
        int c = o + v * GEMM_VF < out ? o + v * GEMM_VF : o;
        w[v] = wp + (int64_t)(c / GEMM_PW) * in * GEMM_PW + c % GEMM_PW;
    }
    gemm_v acc[GEMM_MR][2];
    for (int m = 0; m < GEMM_MR; m++) acc[m][0] = acc[m][1] = GEMM_ZERO();
    for (int i = 0; i < in; i++) {
        /* the weight's lines GEMM_AHEAD steps on (past a panel's end: the next one's) */
        __builtin_prefetch(w[0] + (int64_t)(i + GEMM_AHEAD) * GEMM_PW);
        __builtin_prefetch(w[1] + (int64_t)(i + GEMM_AHEAD) * GEMM_PW);
        if (!(i & ((1 << GEMM_NEXT_SHIFT) - 1)) && (i >> GEMM_NEXT_SHIFT) < pf_lines)
            __builtin_prefetch(pf + (int64_t)(i >> GEMM_NEXT_SHIFT) * 64);
        gemm_v w0 = GEMM_LOAD(w[0] + (int64_t)i * GEMM_PW);
        gemm_v w1 = GEMM_LOAD(w[1] + (int64_t)i * GEMM_PW);
        const float *xi = xp + (int64_t)i * GEMM_MR;
        for (int m = 0; m < GEMM_MR; m++) {
            if (m >= mr) continue;
            gemm_v xv = GEMM_BCAST(xi + m);
            acc[m][0] = GEMM_FMA(xv, w0, acc[m][0]);
            acc[m][1] = GEMM_FMA(xv, w1, acc[m][1]);
        }
    }
    for (int v = 0; v < 2; v++) {
        int c = o + v * GEMM_VF, n = out - c < GEMM_VF ? out - c : GEMM_VF;
        if (n <= 0) break;
        for (int m = 0; m < mr; m++)
            gemm_store(y + (int64_t)m * out + c, acc[m][v], bias ? bias + c : NULL, n);
    }
}

#define GEMM_ROWS_CASE(M)                                                                      \
    case M:                                                                                    \
        gemm_tile(xt, M, wp, o, in, bias, yb, out, pf, pf_lines);                              \
        break;
#if GEMM_MR == 12
#define GEMM_ROWS_SWITCH                                                                       \
    GEMM_ROWS_CASE(1) GEMM_ROWS_CASE(2) GEMM_ROWS_CASE(3) GEMM_ROWS_CASE(4) GEMM_ROWS_CASE(5)  \
    GEMM_ROWS_CASE(6) GEMM_ROWS_CASE(7) GEMM_ROWS_CASE(8) GEMM_ROWS_CASE(9)                   \
    GEMM_ROWS_CASE(10) GEMM_ROWS_CASE(11) GEMM_ROWS_CASE(12)
#else
#define GEMM_ROWS_SWITCH                                                                       \
    GEMM_ROWS_CASE(1) GEMM_ROWS_CASE(2) GEMM_ROWS_CASE(3) GEMM_ROWS_CASE(4) GEMM_ROWS_CASE(5)  \
    GEMM_ROWS_CASE(6)
#endif
/* y rows [0, nb) of x (packed tiles xp) against outputs [lo, hi) of the packed weight wp; a
 * tile's rows by a register tile compiled for their count (a run-time count tests each row in
 * the inner loop: a one-row tile, as each expert of a decoded token is, ran at half speed) */
static void gemm_rows(const float *xp, int nb, const float *wp, const float *bias, float *y,
                      int out, int in, int lo, int hi, const float *next, int next_lines) {
    const int per_tile = in >> GEMM_NEXT_SHIFT; /* lines of `next` a tile prefetches */
    int tt = 0;
    for (int b = 0; b < nb; b += GEMM_MR) {
        int mr = nb - b < GEMM_MR ? nb - b : GEMM_MR;
        const float *xt = xp + (int64_t)(b / GEMM_MR) * GEMM_MR * in;
        float *yb = y + (int64_t)b * out;
        for (int o = lo; o < hi; o += GEMM_TN, tt++) {
            /* the first tile fetches its own unit (GEMM_AHEAD); tile tt >= 1 part tt - 1 of next */
            int done = (tt - 1) * per_tile, left = next && tt ? next_lines - done : 0;
            int pf_lines = left < 0 ? 0 : left < per_tile ? left : per_tile;
            const char *pf = pf_lines ? (const char *)next + (int64_t)done * 64 : NULL;
            switch (mr) { GEMM_ROWS_SWITCH }
        }
    }
}

/* tile t of x [nb, in] packed into dst [in][GEMM_MR], rows past nb zero. One step of i
 * writes one row of dst from the tile's rows side by side: a row of x at a time (a store every
 * GEMM_MR floats) went through the tile's lines GEMM_MR times: 2048 rows of 1024 packed in
 * ~3.2 ms, now ~1.6 (one thread); a MoE layer's 512-token chunk, 29.2 -> 28.9 ms. */
static void gemm_pack_tile(const float *x, int nb, int in, int t, float *dst) {
    int b0 = t * GEMM_MR, mr = nb - b0 < GEMM_MR ? nb - b0 : GEMM_MR;
    const float *xt = x + (int64_t)b0 * in;
    if (mr == GEMM_MR) {
        for (int i = 0; i < in; i++)
            for (int m = 0; m < GEMM_MR; m++)
                dst[(int64_t)i * GEMM_MR + m] = xt[(int64_t)m * in + i];
        return;
    }
    for (int i = 0; i < in; i++)
        for (int m = 0; m < GEMM_MR; m++)
            dst[(int64_t)i * GEMM_MR + m] = m < mr ? xt[(int64_t)m * in + i] : 0.f;
}
#endif

/* outputs a scheduling unit: a multiple of GEMM_TN and of GEMM_PW, 128 KB of W at in = 1024
 * (L2: the unit's panels are read once for each tile of x) */
#define GEMM_UNIT 32

/* floats of one group's packed weight: ceil(out / GEMM_PW) panels of in x GEMM_PW */
static inline int64_t gemm_weight_floats(int out, int in) {
    return (int64_t)((out + GEMM_PW - 1) / GEMM_PW) * in * GEMM_PW;
}

/* Groups of rows, each against its own weight, in one parallel region: group g is rows
 * [start[g], start[g + 1]) of x [start[groups], in] and y [start[groups], out], against the
 * packed W_g = w + g * gemm_weight_floats(out, in) and bias + g * out (or no bias). Every
 * group's tiles of x are packed, then every (group, unit of outputs) pair is one work item:
 * one wake of the threads for all of a mixture of experts' experts (one region per expert cost
 * a decode step of a few rows an expert more than its arithmetic on a 2-core VM). Without
 * AVX2, a scalar chain per output (the same bits). Returns 0; 1 for a shape it does not take;
 * 2 when memory ran out. */
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
    const int64_t wfloats = gemm_weight_floats(out, in);
#if defined(GEMM_VF)
    const int64_t tile_floats = (int64_t)GEMM_MR * in;
    size_t xp_bytes = sizeof(float) * (size_t)(tile0[groups] * tile_floats + 16);
    float *xp = (float *)aligned_alloc(64, xp_bytes);
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
            /* the item this thread likely runs next (the threads take items in turn): its
               unit of the weight, whole panels of 64-byte lines */
            const float *next = NULL;
            int next_lines = 0;
            if (i + nthreads < items) {
                int j = i + nthreads, lo2 = (j % chunks) * GEMM_UNIT;
                int hi2 = lo2 + GEMM_UNIT < out ? lo2 + GEMM_UNIT : out;
                next = w + item[j / chunks] * wfloats + (int64_t)(lo2 / GEMM_PW) * in * GEMM_PW;
                next_lines = (hi2 - lo2 + GEMM_PW - 1) / GEMM_PW * in * GEMM_PW / 16;
            }
            gemm_rows(xp + tile0[g] * tile_floats, start[g + 1] - s, w + g * wfloats,
                      bias ? bias + (int64_t)g * out : NULL, y + (int64_t)s * out, out, in, lo,
                      hi, next, next_lines);
        }
    }
    free(xp);
#else
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int i = 0; i < items; i++) {
        int g = item[i / chunks], lo = (i % chunks) * GEMM_UNIT;
        int hi = lo + GEMM_UNIT < out ? lo + GEMM_UNIT : out;
        const float *wg = w + g * wfloats, *bg = bias ? bias + (int64_t)g * out : NULL;
        for (int b = start[g]; b < start[g + 1]; b++)
            for (int o = lo; o < hi; o++) {
                const float *xb = x + (int64_t)b * in;
                const float *wo = wg + (int64_t)(o / GEMM_PW) * in * GEMM_PW + o % GEMM_PW;
                float s = 0.f;
                for (int k = 0; k < in; k++) s = fmaf(xb[k], wo[(int64_t)k * GEMM_PW], s);
                y[(int64_t)b * out + o] = s + (bg ? bg[o] : 0.f);
            }
    }
#endif
    free(item), free(tile0);
    return 0;
}

/* y [nb, out] = x [nb, in] @ W.T (+ bias), W float32 packed in panels (see above), any nb >= 1
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
