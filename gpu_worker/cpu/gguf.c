/* Linear layers on GGUF block-format weights: y[r, :] = W x[r, :] (+ bias), W kept quantized.
 *
 * A decode step is bound by reading the weights; a Q4_1 model is 1/5 of its float32 bytes.
 * Each row of x is quantized to int8 in blocks of 32 with its own float scale (Q8_0-like, per
 * row: a sequence's output never depends on its batch) and its blocks' float sums; each weight
 * block is unpacked to 32 bytes in registers once and multiplied with every row of x by the
 * CPU's byte dot product (AVX-512 VNNI / AVX-VNNI `vpdpbusd`, else AVX2 `vpmaddubsw` +
 * `vpmaddwd`), one float FMA per block for its scales. Signed quants (Q4_0, Q5_0, Q8_0, Q6_K)
 * take the sign trick: |w| (unsigned) times x carrying w's sign. A block's min (Q4_1, Q5_1,
 * Q4_K, Q5_K) multiplies the exact float sum of x over the block.
 * The one error beyond float rounding: x's rounding to int8, at most half of (max |x| over the
 * block / 127) per value.
 *
 * Weight rows are handed to the OpenMP threads in chunks, dynamically (as linear.c); each
 * chunk is read from memory once for all rows of x (in tiles of GGUF_ROW_TILE rows).
 * Two units per AVX-512 register halve the instructions per row but not the time (measured on
 * Sapphire Rapids, one thread: Q4_1 1536x576 at 8 rows 196 vs 190 us, at one row 40 vs 58;
 * Q6_K 576x1536 at 8 rows 300 vs 201 but at one row 72 vs 88), and a path chosen by the row
 * count would make a row's result depend on its batch: 256-bit only (the GEMM uses 512).
 * Without AVX2 the same entry takes the float path: each weight row dequantized to float32
 * (L1-resident) and multiplied in float32 (gguf_linear_rows_f32, also exported to measure:
 * 3-4x slower than the int8 kernel at 1 to 8 rows).
 * More rows: gguf_linear_many, an int8 GEMM on 8 or 16 weight rows at a time (gguf_gemm.h),
 * for the 32-value types; 1 for K-quants (the caller dequantizes and multiplies in float).
 *
 * Files: gguf.h (formats, scalar; x's quantized layout), gguf_rows.h (the few-row kernel's
 * AVX2 pieces), gguf_gemm.h (the GEMM), this file (x's quantization, entries). Each header
 * includes what it uses (tests/unit/gpu_worker/cpu/test_headers.py compiles each alone).
 * No global state, static helpers only: gpu_worker/cpu/one_call_step.c may #include this file.
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/gguf.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "gguf_rows.h"
#include "gguf_gemm.h"
#include "gguf_amx.h"

#define GGUF_CHUNK 16   /* weight rows per scheduling unit, at the least */
#define GGUF_UNITS_PER_THREAD 2

/* Weight rows a scheduling unit of a loop over `rows` rows: GGUF_CHUNK, or more where that
 * would make over GGUF_UNITS_PER_THREAD units a thread. Each unit a thread takes is an atomic
 * add on the loop's shared counter, whose cache line then moves between the cores, and its
 * first rows come in unprefetched (gguf_rows_range sweeps them in at its start now): at 16
 * rows a unit, a one-row product of Q4_1 [3072, 576] (192 units) took 51 us on two Zen 4
 * cores, no less than on one (50). Two units a thread rather than one or four: a thread held
 * up by another process leaves half its share to the other, and on the same 2-core VM a
 * B=1 MoE Q8_0 step took 5.8-5.9 ms against 6.3 at four (served ITL p50 6.7-6.8 against 7.2).
 * A unit's outputs are the same bits however the rows are split. */
static inline int gguf_unit_rows(int rows, int nthreads) {
    int units = (nthreads > 0 ? nthreads : 1) * GGUF_UNITS_PER_THREAD;
    int per = (rows + units - 1) / units;
    per = (per + GGUF_CHUNK - 1) / GGUF_CHUNK * GGUF_CHUNK;
    return per > GGUF_CHUNK ? per : GGUF_CHUNK;
}

/* each row of x to int8 per 32 values (round to nearest), scale max|x| / 127; on AVX-512 the
 * same operations on 16 lanes (the max and the integer sum exact, the products and their
 * rounding (to nearest even, as lrintf) per value): the same bytes */
__attribute__((unused)) static void gguf_quantize_x(const float *x, int rows, gguf_xq *xq) {
    for (int64_t u = 0; u < (int64_t)rows * xq->nu; u++) {
        const float *xb = x + u * 32;
        int64_t r = u / xq->nu, k = u % xq->nu; /* row r, unit k */
        /* tiled: row r % 16 of unit k's tile in the row tile r / 16; else row-major */
        int8_t *q = xq->qa ? xq->qa + (((r / 16) * xq->nu + k) * 16 + r % 16) * 32 : xq->q + u * 32;
        float amax = 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
        for (int i = 0; i < 32; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
        }
#endif
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int32_t isum = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(id)));
        __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(id)));
        __m256i b = _mm256_set_m128i(_mm512_cvtsepi32_epi8(i1), _mm512_cvtsepi32_epi8(i0));
        _mm256_storeu_si256((__m256i *)q, b);
        if (!xq->qa)
            _mm256_storeu_si256((__m256i *)(xq->xu + u * 32),
                                _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80)));
        isum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
#else
        for (int i = 0; i < 32; i++) {
            int8_t qi = (int8_t)__builtin_lrintf(xb[i] * id);
            q[i] = qi;
            if (!xq->qa) xq->xu[u * 32 + i] = (uint8_t)(qi + 128);
            isum += qi;
        }
#endif
        xq->isum[u] = isum;
        xq->d[u] = d;
        xq->s[u] = d * (float)isum;
    }
}

/* x quantized (gguf_quantize_x) into one allocation; with `tiled`, q in AMX tiles only (qa,
 * zero rows up to a multiple of 32 rows; q and xu NULL); 2 when memory ran out */
__attribute__((unused)) static int gguf_xq_make_tiled(const float *x, int rows, int in, int tiled,
                                                      gguf_xq *xq) {
    int padded = tiled ? (rows + 31) / 32 * 32 : 0;
    size_t n = tiled ? 0 : (size_t)rows * in, na = (size_t)padded * in;
    size_t nb = (size_t)rows * (in / 32);
    char *mem = (char *)malloc(2 * n + na + nb * (2 * sizeof(float) + sizeof(int32_t)));
    if (!mem) return 2;
    xq->d = (float *)mem;
    xq->s = xq->d + nb;
    xq->isum = (int32_t *)(xq->s + nb);
    xq->q = tiled ? NULL : (int8_t *)(xq->isum + nb);
    xq->xu = tiled ? NULL : (uint8_t *)xq->q + n;
    xq->qa = tiled ? (int8_t *)(xq->isum + nb) : NULL;
    xq->in = in;
    xq->nu = in / 32;
    if (tiled) memset(xq->qa + (size_t)rows * in, 0, na - (size_t)rows * in);
    gguf_quantize_x(x, rows, xq);
    return 0;
}

/* x quantized (gguf_quantize_x) into one allocation; 2 when memory ran out */
__attribute__((unused)) static int gguf_xq_make(const float *x, int rows, int in, gguf_xq *xq) {
    return gguf_xq_make_tiled(x, rows, in, 0, xq);
}

/* weight rows [lo, hi) of the float path: each dequantized into wf, then fp32 dots */
static void gguf_rows_f32(const float *x, int rows, const uint8_t *w, int qt, int64_t row_bytes,
                          float *y, int out, int in, int lo, int hi, float *wf) {
    for (int o = lo; o < hi; o++) {
        const uint8_t *wr = w + (int64_t)o * row_bytes;
        gguf_dequant_row(qt, wr, in / 32, wf);
        for (int r = 0; r < rows; r++) {
            const float *xr = x + (int64_t)r * in;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int i = 0; i < in; i++) acc += xr[i] * wf[i];
            y[(int64_t)r * out + o] = acc;
        }
    }
}

static int gguf_check(int rows, int qt, int out, int in) {
    int bv = gguf_block_values(qt);
    return bv == 0 || rows < 1 || out < 1 || in < 1 || in % bv != 0;
}

static void gguf_add_bias(const float *bias, float *y, int rows, int out) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int o = 0; o < out; o++) y[r * out + o] += bias[o];
}

/* y [rows, out] = x [rows, in] @ dequantize(w).T (+ bias), float path. Returns 0; 1 for a
 * type or shape it does not take, 2 when memory ran out. */
int gguf_linear_rows_f32(const float *x, int rows, const uint8_t *w, int qtype,
                         const float *bias, float *y, int out, int in, int nthreads) {
    if (gguf_check(rows, qtype, out, in)) return 1;
    int64_t row_bytes = (int64_t)(in / gguf_block_values(qtype)) * gguf_block_bytes(qtype);
    const int unit = gguf_unit_rows(out, nthreads);
    int chunks = (out + unit - 1) / unit, failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *wf = (float *)malloc(sizeof(float) * (size_t)in);
        if (!wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < chunks; c++) {
            int lo = c * unit, hi = lo + unit < out ? lo + unit : out;
            if (wf) gguf_rows_f32(x, rows, w, qtype, row_bytes, y, out, in, lo, hi, wf);
        }
        free(wf);
    }
    if (failed) return 2;
    gguf_add_bias(bias, y, rows, out);
    return 0;
}

#if defined(__AVX2__)
/* weight rows [lo, hi) of w (wrows rows of row_bytes) against rows [r0, r0 + rows) of xq: y
 * [rows, out] (y's row 0 is x's row r0), + bias. Per output, the same operations whatever the
 * range and the rows around it: a caller may split a layer's outputs (and its rows) any way.
 * `next`: the weight rows read after w's (the prefetch runs on into them; w + wrows *
 * row_bytes where they follow in memory). */
static void gguf_rows_range(const gguf_xq *xq, int r0, int rows, const uint8_t *w, int qtype,
                            int64_t row_bytes, const float *bias, float *y, int out, int lo,
                            int hi, int wrows, const uint8_t *next) {
    float res[GGUF_ROW_TILE];
    if (gguf_takes_x8(qtype)) { /* the groups the sweep below starts ahead of, swept now */
        int first = hi - lo < 8 * GGUF_PREFETCH_GROUPS ? hi - lo : 8 * GGUF_PREFETCH_GROUPS;
        const char *at = (const char *)(w + (int64_t)lo * row_bytes);
        for (int64_t l = 0; l < (int64_t)first * row_bytes; l += 64)
            _mm_prefetch(at + l, _MM_HINT_T1);
    }
    for (int t0 = 0; t0 < rows; t0 += GGUF_ROW_TILE) {
        int nr = rows - t0 < GGUF_ROW_TILE ? rows - t0 : GGUF_ROW_TILE;
        if (gguf_takes_x8(qtype)) { /* 8 weight rows at a time (the last one repeated) */
            for (int o0 = lo; o0 < hi; o0 += 8) {
                const uint8_t *wr[8];
                __m256 acc[GGUF_ROW_TILE];
                float v[8];
                for (int i = 0; i < 8; i++)
                    wr[i] = w + (int64_t)(o0 + i < hi ? o0 + i : hi - 1) * row_bytes;
                int ahead = o0 + 8 * GGUF_PREFETCH_GROUPS;
                const uint8_t *sweep = ahead < wrows ? w + (int64_t)ahead * row_bytes
                                                     : next + (int64_t)(ahead - wrows) * row_bytes;
                gguf_dot_rows8(qtype, wr, xq->nu, xq, r0 + t0, nr, acc, (const char *)sweep);
                for (int r = 0; r < nr; r++) {
                    _mm256_storeu_ps(v, acc[r]);
                    for (int i = 0; i < 8 && o0 + i < hi; i++)
                        y[(int64_t)(t0 + r) * out + o0 + i] = v[i] + (bias ? bias[o0 + i] : 0.f);
                }
            }
            continue;
        }
        for (int o = lo; o < hi; o++) {
            gguf_dot_row(qtype, w + (int64_t)o * row_bytes, xq, r0 + t0, nr, res);
            for (int r = 0; r < nr; r++)
                y[(int64_t)(t0 + r) * out + o] = res[r] + (bias ? bias[o] : 0.f);
        }
    }
}
#endif

/* a linear kernel's signature (gguf_linear_rows_f32, gguf_linear_many) */
typedef int gguf_linear_fn(const float *x, int rows, const uint8_t *w, int qtype,
                           const float *bias, float *y, int out, int in, int nthreads);

/* y [rows, out] = the nshards weights' outputs side by side, each shard by `kernel` (the whole
 * of y where there is one shard, bias included), else into a buffer whose columns are copied
 * into y's, then the bias added over all of them, as the layers concatenate the shards and add
 * it. Returns as the kernel; 2 when memory ran out. */
static int gguf_shards_each(gguf_linear_fn *kernel, const float *x, int rows,
                            const uint8_t *const *ws, const int *qtypes, const int *shard_rows,
                            int nshards, const float *bias, float *y, int out, int in,
                            int nthreads) {
    if (nshards == 1) return kernel(x, rows, ws[0], qtypes[0], bias, y, out, in, nthreads);
    float *part = (float *)malloc(sizeof(float) * (size_t)rows * out);
    if (!part) return 2;
    int code = 0;
    for (int s = 0, at = 0; s < nshards && !code; at += shard_rows[s], s++) {
        code = kernel(x, rows, ws[s], qtypes[s], NULL, part, shard_rows[s], in, nthreads);
        for (int r = 0; r < rows && !code; r++)
            memcpy(y + (int64_t)r * out + at, part + (int64_t)r * shard_rows[s],
                   sizeof(float) * shard_rows[s]);
    }
    free(part);
    if (!code) gguf_add_bias(bias, y, rows, out);
    return code;
}

/* y [rows, sum(shard_rows)] = x [rows, in] @ [W_0; W_1; ...].T (+ bias): nshards weights of
 * shard_rows[s] rows each (GGUF type qtypes[s], raw blocks), their outputs side by side in
 * y's columns (a q|k|v or gate|up projection stored as separate tensors); bias, where not
 * NULL, runs over all of y's columns. x is quantized once and every shard's chunks go to one
 * parallel loop: one wake of the threads instead of one per shard (on a 2-core Zen 4 VM a
 * sleeping thread's wake costs tens of microseconds, and a decode step of one sequence runs
 * a few hundred such loops). Each output is the same bits however the weights are split into
 * shards. Returns 0; 1 for a type or shape it does not take, 2 when memory ran out. */
int gguf_linear_shards(const float *x, int rows, const uint8_t *const *ws, const int *qtypes,
                       const int *shard_rows, int nshards, const float *bias, float *y, int in,
                       int nthreads) {
    int out = 0, chunks = 0;
    for (int s = 0; s < nshards; s++) {
        if (gguf_check(rows, qtypes[s], shard_rows[s], in)) return 1;
        out += shard_rows[s];
    }
    const int unit = gguf_unit_rows(out, nthreads);
    for (int s = 0; s < nshards; s++) chunks += (shard_rows[s] + unit - 1) / unit;
#if defined(__AVX2__)
    gguf_xq xq;
    if (gguf_xq_make(x, rows, in, &xq)) return 2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int c = 0; c < chunks; c++) {
        int s = 0, first = 0, at = 0; /* the shard of chunk c, its first chunk and column */
        while (c - first >= (shard_rows[s] + unit - 1) / unit) {
            first += (shard_rows[s] + unit - 1) / unit;
            at += shard_rows[s++];
        }
        int n = shard_rows[s], lo = (c - first) * unit;
        int hi = lo + unit < n ? lo + unit : n;
        int64_t rb = (int64_t)(in / gguf_block_values(qtypes[s])) * gguf_block_bytes(qtypes[s]);
        gguf_rows_range(&xq, 0, rows, ws[s], qtypes[s], rb, bias ? bias + at : NULL, y + at, out,
                        lo, hi, n, ws[s] + n * rb);
    }
    free(xq.d);
    return 0;
#else
    return gguf_shards_each(gguf_linear_rows_f32, x, rows, ws, qtypes, shard_rows, nshards, bias,
                            y, out, in, nthreads);
#endif
}

/* y [rows, out] = x [rows, in] @ dequantize(w).T (+ bias); w is [out, row_bytes] raw GGUF
 * blocks: gguf_linear_shards with one shard. Returns as it. */
int gguf_linear_rows(const float *x, int rows, const uint8_t *w, int qtype, const float *bias,
                     float *y, int out, int in, int nthreads) {
    return gguf_linear_shards(x, rows, &w, &qtype, &out, 1, bias, y, in, nthreads);
}

#if defined(__AVX2__)
#define GGUF_GEMM_CASE(T)                                                                      \
    case T:                                                                                    \
        gguf_gemm_rows(T, tile, xq, r0, rows, o0, out, bias, y);                               \
        break;
/* every row of x against the tile of weight rows [o0, o0 + 8) */
static void gguf_gemm_tile(int qt, const gguf_tile_unit *tile, const gguf_xq *xq, int rows,
                           int o0, int out, const float *bias, float *y) {
    for (int r0 = 0; r0 < rows; r0 += GGUF_GEMM_R) switch (qt) {
            GGUF_GEMM_CASE(GGUF_Q4_0)
            GGUF_GEMM_CASE(GGUF_Q4_1)
            GGUF_GEMM_CASE(GGUF_Q5_0)
            GGUF_GEMM_CASE(GGUF_Q5_1)
            GGUF_GEMM_CASE(GGUF_Q8_0)
        }
}
#endif

/* whether gguf_linear_many takes the AMX tiles here: built with AMX-INT8 and the tile state
 * granted to this process by Linux */
int gguf_amx_available(void) {
#if GGUF_AMX
    return gguf_amx_ready();
#else
    return 0;
#endif
}

/* The most rows of x the few-row kernel takes here (gguf.py's few_rows, moe.c,
 * gguf_linear_shards_any); more go to the int8 GEMM where it takes the type. gguf.h's
 * gguf_few_rows where the GEMM runs on AVX; where it runs on AMX tiles, twice that for Q4_0,
 * Q4_1 and Q8_0 (two passes of GGUF_ROW_TILE rows), past which the tiles are faster. 2 threads
 * of a 2-core Sapphire Rapids VM, weights hot (tools/benchmarks/gguf_kernels.py's shapes), ms:
 * Q4_1 [1536, 576] at 12 / 16 / 20 rows few-row 0.072 / 0.085 / 0.107, AMX 0.099 / 0.102 /
 * 0.105 (the AVX GEMM 0.103 / 0.143 at 12 / 16); Q8_0 [49152, 576] at 16 / 17 rows few-row
 * 2.45 / 3.07, AMX 2.98 / 2.94. The same bits on each. */
int gguf_few_rows_here(int qtype) {
    int eight = qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q8_0;
    return eight && gguf_amx_available() ? 2 * gguf_few_rows(qtype) : gguf_few_rows(qtype);
}

/* AMX from this many rows of x (fewer: the AVX GEMM; the same bits). 2 threads of a 2-core
 * Sapphire Rapids VM, weights hot, at 9 / 16 rows, ms: Q4_1 [1536, 576] AMX 0.094 / 0.098,
 * the AVX-512 VNNI GEMM 0.102 / 0.143; Q8_0 [49152, 576] 2.62 / 2.63 against 3.08 / 4.14
 * (x is padded to 32 rows); up to 16 rows gguf_few_rows_here sends them to the few-row
 * kernel there */
#define GGUF_AMX_MIN_ROWS 16

/* gguf_linear_many on `path`: 0 AMX from GGUF_AMX_MIN_ROWS rows where gguf_amx_available(),
 * else the AVX GEMM; 1 the AVX (VNNI / AVX2) GEMM; 2 AMX (returns 1 where it is not
 * available) */
int gguf_linear_many_path(const float *x, int rows, const uint8_t *w, int qtype,
                          const float *bias, float *y, int out, int in, int nthreads, int path) {
#if defined(__AVX2__)
    if (gguf_check(rows, qtype, out, in) || !gguf_gemm_takes(qtype)) return 1;
    int amx = path == 2 || (path == 0 && rows >= GGUF_AMX_MIN_ROWS) ? gguf_amx_available() : 0;
    if (path == 2 && !amx) return 1;
    int64_t row_bytes = (int64_t)(in / 32) * gguf_block_bytes(qtype);
    gguf_xq xq;
#if GGUF_AMX
    const int per = amx ? GGUF_AMX_OUT / GGUF_GW : 1; /* AMX: two tiles of weight rows a pass */
#else
    const int per = 1;
#endif
    if (gguf_xq_make_tiled(x, rows, in, amx, &xq)) return 2;
    int tiles = (out + GGUF_GW * per - 1) / (GGUF_GW * per), failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        size_t size = sizeof(gguf_tile_unit) * (size_t)xq.nu * per;
        gguf_tile_unit *tile = (gguf_tile_unit *)aligned_alloc(sizeof(gguf_gvi), size);
        if (!tile) {
#pragma omp atomic write
            failed = 1;
        }
#if GGUF_AMX
        if (amx) gguf_amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tiles; t++) {
            if (!tile) continue;
#if GGUF_AMX
            if (amx) { /* a second tile past `out` repeats its last row (not stored) */
                int o0 = GGUF_AMX_OUT * t;
                gguf_gemm_unpack(qtype, w, row_bytes, o0, out, xq.nu, tile);
                gguf_gemm_unpack(qtype, w, row_bytes, o0 + GGUF_GW, out, xq.nu, tile + xq.nu);
                gguf_amx_offset(qtype, tile, 2 * xq.nu);
                gguf_amx_tile(qtype, tile, tile + xq.nu, &xq, rows, o0, out, bias, y);
                continue;
            }
#endif
            gguf_gemm_unpack(qtype, w, row_bytes, GGUF_GW * t, out, xq.nu, tile);
            gguf_gemm_tile(qtype, tile, &xq, rows, GGUF_GW * t, out, bias, y);
        }
#if GGUF_AMX
        if (amx) _tile_release();
#endif
        free(tile);
    }
    free(xq.d);
    return failed ? 2 : 0;
#else
    (void)x, (void)rows, (void)w, (void)qtype, (void)bias, (void)y, (void)out, (void)in;
    (void)nthreads, (void)path;
    return 1;
#endif
}

/* y [rows, out] = x [rows, in] @ dequantize(w).T (+ bias) for many rows, by the int8 GEMM of
 * gguf_gemm.h (on AMX tiles where the CPU and the OS allow: gguf_amx.h). Returns 0; 1 for a
 * type, shape or CPU it does not take (the caller dequantizes and multiplies in float), 2 when
 * memory ran out. */
int gguf_linear_many(const float *x, int rows, const uint8_t *w, int qtype, const float *bias,
                     float *y, int out, int in, int nthreads) {
    return gguf_linear_many_path(x, rows, w, qtype, bias, y, out, in, nthreads, 0);
}

/* gguf_linear_shards for any number of rows, on the kernel the layers take
 * (gpu_worker/cpu/gguf.py's `linear`): beyond the few-row kernel's rows, each shard by the
 * int8 GEMM (gguf_linear_many, by gguf_shards_each). Both kernels give a row the same bits;
 * this picks the faster one for the row count. Returns as gguf_linear_shards. */
int gguf_linear_shards_any(const float *x, int rows, const uint8_t *const *ws, const int *qtypes,
                           const int *shard_rows, int nshards, const float *bias, float *y,
                           int in, int nthreads) {
    int out = 0, many = 1;
    for (int s = 0; s < nshards; s++) {
        out += shard_rows[s];
#if defined(__AVX2__)
        if (rows <= gguf_few_rows_here(qtypes[s]) || !gguf_gemm_takes(qtypes[s])) many = 0;
#else
        many = 0;
#endif
    }
    if (!many) return gguf_linear_shards(x, rows, ws, qtypes, shard_rows, nshards, bias, y, in,
                                         nthreads);
    return gguf_shards_each(gguf_linear_many, x, rows, ws, qtypes, shard_rows, nshards, bias, y,
                            out, in, nthreads);
}

/* y [out, in] float32 = w [out, row_bytes] dequantized. Returns 0; 1 for a type or shape it
 * does not take. */
int gguf_dequantize(const uint8_t *w, int qtype, float *y, int out, int in, int nthreads) {
    if (gguf_check(1, qtype, out, in)) return 1;
    int64_t row_bytes = (int64_t)(in / gguf_block_values(qtype)) * gguf_block_bytes(qtype);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int o = 0; o < out; o++)
        gguf_dequant_row(qtype, w + o * row_bytes, in / 32, y + (int64_t)o * in);
    return 0;
}

/* the sum of n bytes: the memory read limit the kernels are measured against */
uint64_t gguf_sum_bytes(const uint8_t *p, int64_t n, int nthreads) {
    uint64_t total = 0;
    int64_t n32 = n / 32;
#pragma omp parallel for reduction(+ : total) schedule(static) num_threads(nthreads)
    for (int64_t k = 0; k < n32; k += 64) {
        int64_t end = k + 64 < n32 ? k + 64 : n32;
#if defined(__AVX2__)
        __m256i acc = _mm256_setzero_si256();
        for (int64_t i = k; i < end; i++)
            acc = _mm256_add_epi64(
                acc, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i *)(p + 32 * i)),
                                     _mm256_setzero_si256()));
        uint64_t lanes[4];
        _mm256_storeu_si256((__m256i *)lanes, acc);
        total += lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
        for (int64_t i = 32 * k; i < 32 * end; i++) total += p[i];
#endif
    }
    for (int64_t i = 32 * n32; i < n; i++) total += p[i];
    return total;
}
