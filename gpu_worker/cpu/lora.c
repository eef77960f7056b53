/* Batched LoRA on the CPU: each token's adapter delta added into a linear layer's output, for
 * a step whose tokens use different adapters (gpu_worker/lora/layer.py states the formula;
 * its lora_delta_reference is what the tests compare against).
 *
 *   a [max_loras, num_slices, R, in]   b [max_loras, out, R]   (float32, or bfloat16)
 *   y[t, j] += sum_k b[s, j, k] * z[t, slice(j), k],  z[t, c, k] = sum_i a[s, c, k, i] x[t, i]
 *
 * Tokens are grouped by slot (a stable counting sort: S-LoRA's gather) and each slot's tokens
 * cut into runs of at most LORA_RUN: a prefill chunk of one adapter is a few long runs
 * (segment-wise, as Punica's sgmv), and so is a decode batch whose rows take the adapters
 * round-robin (gathered by index, as bgmv gathers each row's slot). Two phases, one OpenMP
 * region:
 *   shrink  one work item per (run, slice): z of the run's tokens, a small GEMM whose A
 *           [R, in] stays in L1/L2 while the run's rows of x stream past it
 *   expand  one work item per (run, LORA_CHUNK output rows): the run's tokens' z times those
 *           rows of its B, added into y (items of one run in a row: its B read in order)
 * Each value is summed by one thread in a fixed order, whatever the number of threads, so the
 * layer-by-layer path and the one-call step (one_call_step.c includes this file) get the
 * same bits. Sums are float32; y is float32, or bf16 (rounded once, after the add).
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/lora.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* rows of A (B) per inner loop, sharing each load of x (z): linear.c's TILE */
#if defined(__AVX512F__)
#define LORA_TILE 16
#else
#define LORA_TILE 8
#endif
#define LORA_RUN 16    /* tokens per shrink work item */
#define LORA_CHUNK 64  /* output rows per expand work item */
#define LORA_SMALL_WORK (1 << 12) /* multiply-adds below which one thread runs */

typedef struct {
    int slot, lo, hi; /* tokens order[lo .. hi), all of adapter slot `slot` (>= 0) */
} lora_run_t;

/* z[t, k] (stride zs) = w [R, in] . x[t] for the tokens t = tokens[0 .. nt) of x (stride
 * in): linear.c's rows() shape, LORA_TILE rows of w per pass over x. Defined for float32 w
 * (lora_dots) and bf16 w (lora_dots_bf16, widened as it is read: the same values and sums). */
#define LORA_DOTS(NAME, WT, WIDEN)                                                             \
    static void NAME(const float *x, const int *tokens, int nt, int in, const WT *w, int rank, \
                     float *z, int zs) {                                                       \
        int k = 0;                                                                             \
        for (; k + LORA_TILE <= rank; k += LORA_TILE) {                                        \
            const WT *w0 = w + (int64_t)k * in;                                                \
            for (int j = 0; j < nt; j++) {                                                     \
                int64_t t = tokens[j];                                                         \
                const float *xt = x + t * in;                                                  \
                float acc[LORA_TILE] = {0};                                                    \
                _Pragma("omp simd reduction(+ : acc[:LORA_TILE])")                             \
                for (int i = 0; i < in; i++) {                                                 \
                    float xv = xt[i];                                                          \
                    for (int r = 0; r < LORA_TILE; r++) acc[r] += xv * WIDEN(w0[r * in + i]);  \
                }                                                                              \
                for (int r = 0; r < LORA_TILE; r++) z[t * zs + k + r] = acc[r];                \
            }                                                                                  \
        }                                                                                      \
        for (; k < rank; k++) {                                                                \
            const WT *wr = w + (int64_t)k * in;                                                \
            for (int j = 0; j < nt; j++) {                                                     \
                int64_t t = tokens[j];                                                         \
                const float *xt = x + t * in;                                                  \
                float acc = 0.f;                                                               \
                _Pragma("omp simd reduction(+ : acc)")                                         \
                for (int i = 0; i < in; i++) acc += xt[i] * WIDEN(wr[i]);                      \
                z[t * zs + k] = acc;                                                           \
            }                                                                                  \
        }                                                                                      \
    }
#define LORA_AS_IS(v) (v)
LORA_DOTS(lora_dots, float, LORA_AS_IS)
LORA_DOTS(lora_dots_bf16, uint16_t, bf16_to_f32)

/* w as float32: itself, or its `count` bf16 values widened into `wide` */
static const float *lora_f32(const void *w, int bf16, int64_t count, float *wide) {
    if (!bf16) return (const float *)w;
    const uint16_t *src = (const uint16_t *)w;
#pragma omp simd
    for (int64_t i = 0; i < count; i++) wide[i] = bf16_to_f32(src[i]);
    return wide;
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* 16 rows of b [16, R] (R a multiple of 16) times z [R]: one vector of the 16 sums. Each
 * row's products are summed in a vector, then the 16 vectors are reduced together (a
 * transposing tree: 30 shuffles and 15 adds for 16 sums, where 16 separate horizontal
 * sums take ~130 instructions: the expand of a decode token was bound by them). */
static inline __m512 lora_dot16(const float *b, const float *z, int rank) {
    __m512 v[16], a[8], c[4], e[2];
    for (int r = 0; r < 16; r++) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(b + (int64_t)r * rank), _mm512_loadu_ps(z));
        for (int k = 16; k < rank; k += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(b + (int64_t)r * rank + k),
                                  _mm512_loadu_ps(z + k), acc);
        v[r] = acc;
    }
    for (int i = 0; i < 8; i++) /* halves of rows 2i | 2i+1 */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) { /* quarter q of b: row 4i + q's 4 partial sums */
        __m512 q = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                                 _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
        a[i] = q;
    }
    for (int i = 0; i < 2; i++) /* lane q: rows 8i + q, 8i + 4 + q, two partials each */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
    e[0] = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    /* element 4q + m holds row 4m + q */
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, e[0]);
}
#endif

/* y[t, lo:hi] += b_rows [hi - lo, R] . z[t] for the run's tokens */
static void lora_expand_rows(const lora_run_t *run, const int *order, const float *z, int zs,
                             const float *b_rows, int rank, void *y, int y_bf16, int out, int lo,
                             int hi) {
    int cols = hi - lo;
    float acc[LORA_TILE];
    for (int j = 0; j < cols; j += LORA_TILE) {
        int nj = cols - j < LORA_TILE ? cols - j : LORA_TILE;
        const float *b0 = b_rows + (int64_t)j * rank;
        for (int i = run->lo; i < run->hi; i++) {
            int64_t t = order[i];
            const float *zt = z + t * zs;
#if defined(__AVX512F__)
            if (nj == 16 && rank % 16 == 0) {
                _mm512_storeu_ps(acc, lora_dot16(b0, zt, rank));
            } else
#endif
            if (nj == LORA_TILE) {
                for (int r = 0; r < LORA_TILE; r++) acc[r] = 0.f;
#pragma omp simd reduction(+ : acc[:LORA_TILE])
                for (int k = 0; k < rank; k++) {
                    float zv = zt[k];
                    for (int r = 0; r < LORA_TILE; r++) acc[r] += zv * b0[r * rank + k];
                }
            } else {
                for (int r = 0; r < nj; r++) {
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int k = 0; k < rank; k++) s += zt[k] * b0[r * rank + k];
                    acc[r] = s;
                }
            }
            int64_t at = t * out + lo + j;
            if (y_bf16) {
                uint16_t *yb = (uint16_t *)y + at;
                for (int r = 0; r < nj; r++) yb[r] = f32_to_bf16(bf16_to_f32(yb[r]) + acc[r]);
            } else {
                float *yf = (float *)y + at;
                for (int r = 0; r < nj; r++) yf[r] += acc[r];
            }
        }
    }
}

/* Group the tokens by slot (stable: a counting sort into `order`, base tokens left out) and
 * cut each slot's tokens into runs of at most LORA_RUN: a decode batch of round-robin
 * adapters gets the same long runs as a prefill of contiguous segments. Returns the number
 * of runs, -1 when a slot is out of range. counts: max_loras + 1 ints of scratch. */
static int lora_runs(const int32_t *slots, int n, int max_loras, int *counts, int *order,
                     lora_run_t *runs) {
    memset(counts, 0, sizeof(int) * (size_t)(max_loras + 1));
    for (int t = 0; t < n; t++) {
        if (slots[t] < -1 || slots[t] >= max_loras) return -1;
        if (slots[t] >= 0) counts[slots[t] + 1]++;
    }
    for (int s = 0; s < max_loras; s++) counts[s + 1] += counts[s]; /* slot s starts at [s] */
    int count = 0;
    for (int s = 0; s < max_loras; s++) /* runs before the fill moves counts[] */
        for (int lo = counts[s]; lo < counts[s + 1]; lo += LORA_RUN)
            runs[count++] = (lora_run_t){s, lo, lo + LORA_RUN < counts[s + 1] ? lo + LORA_RUN
                                                                             : counts[s + 1]};
    for (int t = 0; t < n; t++)
        if (slots[t] >= 0) order[counts[slots[t]]++] = t;
    return count;
}

/* y [n, out] += each token's LoRA delta (see the top of the file). x [n, in] float32; a, b
 * float32 or bf16 (w_bf16); y float32 or bf16 (y_bf16), in place; bounds [num_slices + 1]
 * output offsets from 0 to out; slots [n], -1 for none. Returns 0; 1 for an argument out of
 * range (a slot, a bound), 2 when memory ran out. */
int lora_add(const float *x, int n, int in, const void *a, const void *b, int w_bf16,
             int num_slices, int rank, const int32_t *bounds, int out, const int32_t *slots,
             int max_loras, void *y, int y_bf16, int nthreads) {
    if (n < 0 || in < 1 || out < 1 || rank < 1 || num_slices < 1) return 1;
    if (bounds[0] != 0 || bounds[num_slices] != out) return 1;
    for (int c = 0; c < num_slices; c++)
        if (bounds[c + 1] < bounds[c]) return 1;
    if (n == 0) return 0;
    int zs = num_slices * rank;
    lora_run_t *runs = (lora_run_t *)malloc(sizeof(lora_run_t) * (size_t)n);
    int *order = (int *)malloc(sizeof(int) * ((size_t)n + max_loras + 1));
    float *z = (float *)malloc(sizeof(float) * (size_t)n * zs);
    int nruns = runs && order && z ? lora_runs(slots, n, max_loras, order + n, order, runs) : -2;
    if (nruns <= 0) {
        free(runs), free(order), free(z);
        return nruns == 0 ? 0 : (nruns == -1 ? 1 : 2);
    }
    int chunks = (out + LORA_CHUNK - 1) / LORA_CHUNK, failed = 0;
    int64_t wide_count = (int64_t)rank * LORA_CHUNK; /* a chunk of bf16 B, widened */
    /* one thread for a tiny amount of work */
    int threads = (int64_t)n * (num_slices * in + out) * rank < LORA_SMALL_WORK ? 1 : nthreads;
#pragma omp parallel num_threads(threads)
    {
        float *wide = w_bf16 ? (float *)malloc(sizeof(float) * (size_t)wide_count) : NULL;
        if (w_bf16 && !wide) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < nruns * num_slices; item++) {
            const lora_run_t *run = runs + item / num_slices;
            int c = item % num_slices;
            if (w_bf16 && !wide) continue;
            int64_t at = ((int64_t)run->slot * num_slices + c) * rank * in;
            const int *tokens = order + run->lo;
            if (w_bf16)
                lora_dots_bf16(x, tokens, run->hi - run->lo, in, (const uint16_t *)a + at, rank,
                               z + c * rank, zs);
            else
                lora_dots(x, tokens, run->hi - run->lo, in, (const float *)a + at, rank,
                          z + c * rank, zs);
        }
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < nruns * chunks; item++) {
            /* run-major: a thread's consecutive items read one slot's B in order (chunks of
             * several slots in turn defeated the prefetcher: 4 KB per slot at a time) */
            const lora_run_t *run = runs + item / chunks;
            int ch = item % chunks;
            if (w_bf16 && !wide) continue;
            int lo = ch * LORA_CHUNK, hi = lo + LORA_CHUNK < out ? lo + LORA_CHUNK : out;
            for (int c = 0; c < num_slices; c++) { /* the chunk's part in each slice */
                int clo = bounds[c] > lo ? bounds[c] : lo;
                int chi = bounds[c + 1] < hi ? bounds[c + 1] : hi;
                if (clo >= chi) continue;
                int64_t at = ((int64_t)run->slot * out + clo) * rank;
                const float *w = w_bf16 ? lora_f32((const uint16_t *)b + at, 1,
                                                   (int64_t)(chi - clo) * rank, wide)
                                        : (const float *)b + at;
                lora_expand_rows(run, order, z + c * rank, zs, w, rank, y, y_bf16, out, clo,
                                 chi);
            }
        }
        free(wide);
    }
    free(runs), free(order), free(z);
    return failed ? 2 : 0;
}
