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
 * count would make a row's result depend on its batch: 256-bit only.
 * Without AVX2 the same entry takes the float path: each weight row dequantized to float32
 * (L1-resident) and multiplied in float32 (gguf_linear_rows_f32, also exported to measure).
 *
 * No global state, static helpers only: gpu_worker/cpu/decode_step.c may #include this file.
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/gguf.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.h"

#define GGUF_ROW_TILE 8 /* rows of x per pass over a chunk of weight rows */
#define GGUF_CHUNK 16   /* weight rows per scheduling unit */
#ifndef GGUF_PREFETCH
/* bytes of weights ahead of the block being read, prefetched: one thread streaming SmolLM2's
 * Q4_1 weights (CPU time, busy Sapphire Rapids): 18.5 ms with none, 12.8 (512 B), 11.4 (1 KB),
 * 10.2 (2 KB), 10.3 (4 KB) */
#define GGUF_PREFETCH 2048
#endif

/* rows of x quantized per 32 values: q [rows, in], d and s [rows, in / 32] */
typedef struct {
    int8_t *q;
    float *d; /* the block's scale: x ~= d * q */
    float *s; /* the block's exact float sum of x */
    int in, nu;
} gguf_xq;

#if defined(__AVX2__)
#include <immintrin.h>

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones */
static inline __m256i gguf_nib32(const uint8_t *qs) {
    __m128i v = _mm_loadu_si128((const __m128i *)qs), m = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m));
}

/* 32 bits at p -> 32 bytes, 0x10 where bit j is set (the 5th bit of a Q5 quant) */
static inline __m256i gguf_bits32(const uint8_t *p) {
    uint32_t h;
    memcpy(&h, p, 4);
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                             0x0101010101010101LL, 0x0000000000000000LL);
    __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), spread);
    /* every bit but bit (j % 8) set: all ones exactly where bit j of h is set */
    bytes = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfeLL));
    bytes = _mm256_cmpeq_epi8(bytes, _mm256_set1_epi64x(-1));
    return _mm256_and_si256(bytes, _mm256_set1_epi8(0x10));
}

/* unsigned bytes u times signed bytes s: eight int32 sums of four products (lane k: bytes
 * 4k..4k+3). maddubs's int16 pairs cannot saturate: |u| <= 128, |s| <= 127. */
static inline __m256i gguf_dot_us(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

static inline float gguf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* one 32-value unit of quants q (signed when sgn) against rows [r0, r0 + nr) of x, unit u;
 * the int32 lanes scaled by sv (per-lane weight scale) times the row's d */
#define GGUF_UNIT_ROWS(q, sgn, sv, u, MIN_TERM)                                               \
    do {                                                                                       \
        __m256i qa_ = (sgn) ? _mm256_abs_epi8(q) : (q);                                        \
        for (int r = 0; r < nr; r++) {                                                         \
            int64_t xr_ = (int64_t)(r0 + r) * x->nu + (u);                                     \
            __m256i xv_ = _mm256_loadu_si256((const __m256i *)(x->q + xr_ * 32));              \
            if (sgn) xv_ = _mm256_sign_epi8(xv_, q);                                           \
            __m256 p_ = _mm256_cvtepi32_ps(gguf_dot_us(qa_, xv_));                             \
            acc[r] = _mm256_fmadd_ps(p_, _mm256_mul_ps(sv, _mm256_set1_ps(x->d[xr_])), acc[r]); \
            macc[r] += (MIN_TERM) * x->s[xr_];                                                 \
        }                                                                                      \
    } while (0)

/* or, dequantizing (dst set), the unit's 32 floats: lanes of sv scale values 0..15 (low half)
 * and 16..31 (high half) */
#define GGUF_UNIT_STORE(q, sv, u, MIN_TERM)                                                    \
    do {                                                                                       \
        __m128i lo_ = _mm256_castsi256_si128(q), hi_ = _mm256_extracti128_si256(q, 1);         \
        __m256 s0_ = _mm256_permute2f128_ps(sv, sv, 0x00);                                     \
        __m256 s1_ = _mm256_permute2f128_ps(sv, sv, 0x11), m_ = _mm256_set1_ps(MIN_TERM);      \
        __m128i part_[4] = {lo_, _mm_srli_si128(lo_, 8), hi_, _mm_srli_si128(hi_, 8)};         \
        for (int i_ = 0; i_ < 4; i_++) {                                                       \
            __m256 v_ = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part_[i_]));                   \
            _mm256_storeu_ps(dst + (int64_t)(u) * 32 + 8 * i_,                                 \
                             _mm256_add_ps(_mm256_mul_ps(i_ < 2 ? s0_ : s1_, v_), m_));        \
        }                                                                                      \
    } while (0)
#define GGUF_UNIT(q, sgn, sv, u, MIN_TERM)                                                     \
    do {                                                                                       \
        if (dst)                                                                               \
            GGUF_UNIT_STORE(q, sv, u, MIN_TERM);                                               \
        else                                                                                   \
            GGUF_UNIT_ROWS(q, sgn, sv, u, MIN_TERM);                                           \
    } while (0)

/* the 32-value block types: one weight row against nr rows of x */
static inline __attribute__((always_inline)) void gguf_dot32(int qt, const uint8_t *w, int nu,
                                                             const gguf_xq *x, int r0, int nr,
                                                             float *res, float *dst) {
    __m256 acc[GGUF_ROW_TILE];
    float macc[GGUF_ROW_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.f;
    const int bb = gguf_block_bytes(qt);
    for (int u = 0; u < nu; u++) {
        const uint8_t *b = w + (int64_t)u * bb;
        _mm_prefetch((const char *)b + GGUF_PREFETCH, _MM_HINT_T0);
        __m256 sv = _mm256_set1_ps(gguf_half(b));
        float mw = 0.f;
        __m256i q;
        int sgn = qt == GGUF_Q8_0 || qt == GGUF_Q4_0 || qt == GGUF_Q5_0;
        if (qt == GGUF_Q8_0) {
            q = _mm256_loadu_si256((const __m256i *)(b + 2));
        } else if (qt == GGUF_Q4_0) {
            q = _mm256_sub_epi8(gguf_nib32(b + 2), _mm256_set1_epi8(8));
        } else if (qt == GGUF_Q4_1) {
            mw = gguf_half(b + 2);
            q = gguf_nib32(b + 4);
        } else if (qt == GGUF_Q5_0) {
            q = _mm256_or_si256(gguf_nib32(b + 6), gguf_bits32(b + 2));
            q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
        } else { /* Q5_1 */
            mw = gguf_half(b + 2);
            q = _mm256_or_si256(gguf_nib32(b + 8), gguf_bits32(b + 4));
        }
        GGUF_UNIT(q, sgn, sv, u, mw);
    }
    for (int r = 0; r < nr; r++) res[r] = gguf_hsum(acc[r]) + macc[r];
}

/* Q6_K's super-block b (units u0..u0+7): groups of 32 with a scale per 16 values */
static inline __attribute__((always_inline)) void gguf_q6k_block(
    const uint8_t *b, int u0, const gguf_xq *x, int r0, int nr, __m256 *acc, float *macc,
    float *dst) {
    const __m256i low = _mm256_set1_epi8(0x0f), two = _mm256_set1_epi8(3);
    const int8_t *sc = (const int8_t *)(b + 192);
    float d = gguf_half(b + 208);
    for (int h = 0; h < 2; h++) {
        __m256i ql_a = _mm256_loadu_si256((const __m256i *)(b + 64 * h));
        __m256i ql_b = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        for (int k = 0; k < 4; k++) {
            __m256i ql = (k & 1) ? ql_b : ql_a;
            if (k >> 1) ql = _mm256_srli_epi16(ql, 4);
            __m256i hi = _mm256_slli_epi16(_mm256_and_si256(qh, two), 4);
            qh = _mm256_srli_epi16(qh, 2);
            __m256i q = _mm256_or_si256(_mm256_and_si256(ql, low), hi);
            q = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
            int g = 4 * h + k;
            __m256 sv = _mm256_set_m128(_mm_set1_ps(d * (float)sc[2 * g + 1]),
                                        _mm_set1_ps(d * (float)sc[2 * g]));
            GGUF_UNIT(q, 1, sv, u0 + g, 0.f);
        }
    }
}

/* Q4_K/Q5_K's super-block b: 8 sub-blocks of 32 with 6-bit scales and mins */
static inline __attribute__((always_inline)) void gguf_q45k_block(
    int qt, const uint8_t *b, int u0, const gguf_xq *x, int r0, int nr, __m256 *acc,
    float *macc, float *dst) {
    const __m256i low = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    float d = gguf_half(b), dmin = gguf_half(b + 2);
    const uint8_t *qs = qt == GGUF_Q5_K ? b + 48 : b + 16;
    __m256i qh = qt == GGUF_Q5_K ? _mm256_loadu_si256((const __m256i *)(b + 16))
                                 : _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        for (int t = 0; t < 2; t++) {
            int s = 2 * j + t, sc, m;
            gguf_k_scale_min(b + 4, s, &sc, &m);
            __m256i q = _mm256_and_si256(t ? _mm256_srli_epi16(v, 4) : v, low);
            if (qt == GGUF_Q5_K) {
                q = _mm256_or_si256(q, _mm256_slli_epi16(_mm256_and_si256(qh, one), 4));
                qh = _mm256_srli_epi16(qh, 1);
            }
            __m256 sv = _mm256_set1_ps(d * (float)sc);
            GGUF_UNIT(q, 0, sv, u0 + s, -dmin * (float)m);
        }
    }
}

static inline __attribute__((always_inline)) void gguf_dotk(int qt, const uint8_t *w, int nu,
                                                            const gguf_xq *x, int r0, int nr,
                                                            float *res, float *dst) {
    __m256 acc[GGUF_ROW_TILE];
    float macc[GGUF_ROW_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm256_setzero_ps(), macc[r] = 0.f;
    const int bb = gguf_block_bytes(qt);
    for (int u0 = 0; u0 < nu; u0 += 8) {
        const uint8_t *b = w + (int64_t)(u0 / 8) * bb;
        for (int l = 0; l < bb; l += 64)
            _mm_prefetch((const char *)b + GGUF_PREFETCH + l, _MM_HINT_T0);
        if (qt == GGUF_Q6_K)
            gguf_q6k_block(b, u0, x, r0, nr, acc, macc, dst);
        else
            gguf_q45k_block(qt, b, u0, x, r0, nr, acc, macc, dst);
    }
    for (int r = 0; r < nr; r++) res[r] = gguf_hsum(acc[r]) + macc[r];
}

/* one weight row against rows [r0, r0 + nr) of x, compiled once per row count (1..8) so that
 * the accumulators stay in registers (a runtime count kept them on the stack: 3x slower at 4
 * rows) */
#define GGUF_NR(T, FN, N)                                                                      \
    case N:                                                                                    \
        FN(T, w, x->nu, x, r0, N, res, NULL);                                                  \
        return;
#define GGUF_CASE(T, FN)                                                                       \
    case T:                                                                                    \
        switch (nr) {                                                                          \
            GGUF_NR(T, FN, 1)                                                                  \
            GGUF_NR(T, FN, 2)                                                                  \
            GGUF_NR(T, FN, 3)                                                                  \
            GGUF_NR(T, FN, 4)                                                                  \
            GGUF_NR(T, FN, 5)                                                                  \
            GGUF_NR(T, FN, 6)                                                                  \
            GGUF_NR(T, FN, 7)                                                                  \
            GGUF_NR(T, FN, 8)                                                                  \
        }                                                                                      \
        return;

static void gguf_dot_row(int qt, const uint8_t *w, const gguf_xq *x, int r0, int nr,
                         float *res) {
    switch (qt) {
        GGUF_CASE(GGUF_Q4_0, gguf_dot32)
        GGUF_CASE(GGUF_Q4_1, gguf_dot32)
        GGUF_CASE(GGUF_Q5_0, gguf_dot32)
        GGUF_CASE(GGUF_Q5_1, gguf_dot32)
        GGUF_CASE(GGUF_Q8_0, gguf_dot32)
        GGUF_CASE(GGUF_Q4_K, gguf_dotk)
        GGUF_CASE(GGUF_Q5_K, gguf_dotk)
        GGUF_CASE(GGUF_Q6_K, gguf_dotk)
    }
}

/* one weight row of nu units dequantized to dst, by the same unpacking as the dots */
static void gguf_dequant_row(int qt, const uint8_t *w, int nu, float *dst) {
    const gguf_xq *x = NULL;
    float *res = NULL;
    switch (qt) {
    case GGUF_Q4_0: gguf_dot32(GGUF_Q4_0, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q4_1: gguf_dot32(GGUF_Q4_1, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q5_0: gguf_dot32(GGUF_Q5_0, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q5_1: gguf_dot32(GGUF_Q5_1, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q8_0: gguf_dot32(GGUF_Q8_0, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q4_K: gguf_dotk(GGUF_Q4_K, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q5_K: gguf_dotk(GGUF_Q5_K, w, nu, x, 0, 0, res, dst); return;
    case GGUF_Q6_K: gguf_dotk(GGUF_Q6_K, w, nu, x, 0, 0, res, dst); return;
    }
}
#else
/* without AVX2: block by block, scalar */
static void gguf_dequant_row(int qt, const uint8_t *w, int nu, float *dst) {
    int bv = gguf_block_values(qt), bb = gguf_block_bytes(qt);
    for (int k = 0; k < nu * 32 / bv; k++)
        gguf_dequant_block(w + (int64_t)k * bb, qt, dst + k * bv);
}
#endif

/* each row of x to int8 per 32 values (round to nearest), scale max|x| / 127 */
__attribute__((unused)) static void gguf_quantize_x(const float *x, int rows, gguf_xq *xq) {
    for (int64_t u = 0; u < (int64_t)rows * xq->nu; u++) {
        const float *xb = x + u * 32;
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < 32; i++) {
            float a = xb[i] < 0 ? -xb[i] : xb[i];
            amax = a > amax ? a : amax;
            sum += xb[i];
        }
        float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        for (int i = 0; i < 32; i++) xq->q[u * 32 + i] = (int8_t)__builtin_lrintf(xb[i] * id);
        xq->d[u] = d;
        xq->s[u] = sum;
    }
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
    int chunks = (out + GGUF_CHUNK - 1) / GGUF_CHUNK, failed = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *wf = (float *)malloc(sizeof(float) * (size_t)in);
        if (!wf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int c = 0; c < chunks; c++) {
            int lo = c * GGUF_CHUNK, hi = lo + GGUF_CHUNK < out ? lo + GGUF_CHUNK : out;
            if (wf) gguf_rows_f32(x, rows, w, qtype, row_bytes, y, out, in, lo, hi, wf);
        }
        free(wf);
    }
    if (failed) return 2;
    gguf_add_bias(bias, y, rows, out);
    return 0;
}

/* y [rows, out] = x [rows, in] @ dequantize(w).T (+ bias); w is [out, row_bytes] raw GGUF
 * blocks. Returns 0; 1 for a type or shape it does not take, 2 when memory ran out. */
int gguf_linear_rows(const float *x, int rows, const uint8_t *w, int qtype, const float *bias,
                     float *y, int out, int in, int nthreads) {
#if defined(__AVX2__)
    if (gguf_check(rows, qtype, out, in)) return 1;
    int64_t row_bytes = (int64_t)(in / gguf_block_values(qtype)) * gguf_block_bytes(qtype);
    gguf_xq xq = {NULL, NULL, NULL, in, in / 32};
    xq.q = (int8_t *)malloc((size_t)rows * in);
    xq.d = (float *)malloc(sizeof(float) * 2 * (size_t)rows * xq.nu);
    if (!xq.q || !xq.d) {
        free(xq.q);
        free(xq.d);
        return 2;
    }
    xq.s = xq.d + (size_t)rows * xq.nu;
    gguf_quantize_x(x, rows, &xq);
    int chunks = (out + GGUF_CHUNK - 1) / GGUF_CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int c = 0; c < chunks; c++) {
        int lo = c * GGUF_CHUNK, hi = lo + GGUF_CHUNK < out ? lo + GGUF_CHUNK : out;
        float res[GGUF_ROW_TILE];
        for (int r0 = 0; r0 < rows; r0 += GGUF_ROW_TILE) {
            int nr = rows - r0 < GGUF_ROW_TILE ? rows - r0 : GGUF_ROW_TILE;
            for (int o = lo; o < hi; o++) {
                gguf_dot_row(qtype, w + (int64_t)o * row_bytes, &xq, r0, nr, res);
                for (int r = 0; r < nr; r++)
                    y[(int64_t)(r0 + r) * out + o] = res[r] + (bias ? bias[o] : 0.f);
            }
        }
    }
    free(xq.q);
    free(xq.d);
    return 0;
#else
    return gguf_linear_rows_f32(x, rows, w, qtype, bias, y, out, in, nthreads);
#endif
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
