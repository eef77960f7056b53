/* Paged decode attention for the CPU: one query token per sequence, K/V read in place.
 *
 * Built at first use by gpu_worker/cpu/paged_decode.py (gcc -O3 -march=native -fopenmp)
 * and called through ctypes with raw pointers; torch's own libgomp serves its threads.
 *
 * One task per (sequence i, KV head h): the G = num_heads / num_kv_heads query rows of that
 * head attend over the sequence's first seq_lens[i] positions, whose K/V rows are found
 * through the block table (no gather, no copy, no padding to the longest sequence):
 *
 *   row(l) = cache + ((table[i][l / bs] * bs + l % bs) * KVH + h) * D
 *   s[j][l] = scale * q[i][h*G + j] . K(l);  p = softmax_l(s);  o[i][h*G + j] = sum_l p V(l)
 *
 * With a sliding window W > 0 the query (at position seq_len - 1) sees only the last W positions,
 * l >= seq_len - W (transformers' sliding_window: a key j is visible to a query i when
 * i - W < j <= i); the positions before are never read.
 *
 * With a soft cap c > 0 (Gemma 2's attn_logit_softcapping) each score becomes c * tanh(s / c)
 * before the softmax.
 *
 * With sinks (gpt-oss), head j's learned logit sinks[j] joins its softmax as a key with no
 * value: m = max(m, sink), sum += exp(sink - m).
 *
 * Scores, softmax and the output accumulate in float32 for every cache kind. q and out are
 * float32 [n, H, D] contiguous; caches [blocks, bs, KVH, row] where a row is one token's K (or
 * V) of one head, stored as `kind` says (gpu_worker/kv_quant.py):
 *
 *   0 float32 [D]   1 bfloat16 [D]
 *   2 int8 [D] then the row's float32 scale (4 bytes): x = q * scale
 *   3 fp8 e4m3fn [D], 4 fp8 e5m2 [D] (scale 1): x = the fp8 value
 *
 * Rows other than float32 are converted to float32 as they are read (fp8 by bit manipulation:
 * fp8_e4m3_value); an int8 row's scale multiplies its dot product and its weight p, not each
 * value (attend_fixed).
 */
#include <math.h>
#include <stdint.h>

#ifdef SHUTTLE_LIBMVEC
/* glibc's vector expf (libmvec) for the omp simd loops below: build.py's VECTOR_MATH */
#pragma omp declare simd notinbranch
float expf(float);
#endif
#include <stdlib.h>
#include <string.h>

#include "bf16.h"



/* A vector reduction the compiler lays out (lanes, then a log-step horizontal sum). */
static inline float dot(const float *a, const float *b, int d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int x = 0; x < d; x++) s += a[x] * b[x];
    return s;
}

enum { KV_F32 = 0, KV_BF16 = 1, KV_INT8 = 2, KV_FP8_E4M3 = 3, KV_FP8_E5M2 = 4 };

/* bytes of one row of d elements */
static inline int64_t row_bytes(int kind, int d) {
    switch (kind) {
    case KV_F32: return 4 * (int64_t)d;
    case KV_BF16: return 2 * (int64_t)d;
    case KV_INT8: return (int64_t)d + 4;
    default: return d;
    }
}

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The float32 value of fp8 bits b, exactly as torch reads them (NaN and, for e5m2, the
 * infinities included), in integer and float operations only, so that a loop of them
 * vectorizes: a normal number moves its exponent and mantissa into float32's fields (the bias
 * difference added, or as much as makes the exponent 255 for NaN/inf), a subnormal one is its
 * mantissa times the smallest subnormal. (A 256-entry table of the values costs a gather per
 * vector instead, ~2x slower measured on Zen 4.) */
static inline float fp8_e4m3_value(uint32_t b) { /* s eeee mmm, bias 7, NaN: eeee mmm all 1 */
    uint32_t em = b & 0x7f, sign = (b & 0x80) << 24;
    uint32_t normal = (em << 20) + ((em == 0x7f ? 240u : 120u) << 23);
    float sub = (float)(int)em * 0x1p-9f; /* m * 2^-6 / 8 */
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    return bits_to_f32((em < 8 ? sub_bits : normal) | sign);
}

static inline float fp8_e5m2_value(uint32_t b) { /* s eeeee mm, bias 15, inf/NaN: eeeee 1s */
    uint32_t em = b & 0x7f, sign = (b & 0x80) << 24;
    uint32_t normal = (em << 21) + ((em >= 0x7c ? 224u : 112u) << 23);
    float sub = (float)(int)em * 0x1p-16f; /* m * 2^-14 / 4 */
    uint32_t sub_bits;
    memcpy(&sub_bits, &sub, 4);
    return bits_to_f32((em < 4 ? sub_bits : normal) | sign);
}

/* Element x of a row stored as `kind` (not float32), before the row's scale (row_scale):
 * exact, a bf16 or fp8 value or an int8 integer as float32 */
static inline float row_value(const uint8_t *row, int kind, int x) {
    switch (kind) {
    case KV_BF16: return bf16_to_f32(((const uint16_t *)row)[x]);
    case KV_INT8: return (float)((const int8_t *)row)[x];
    case KV_FP8_E4M3: return fp8_e4m3_value(row[x]);
    default: return fp8_e5m2_value(row[x]);
    }
}

/* what a row's values are multiplied by: an int8 row's scale (the 4 bytes after its d
 * values), else 1 */
static inline float row_scale(const uint8_t *row, int kind, int d) {
    float sc = 1.0f;
    if (kind == KV_INT8) memcpy(&sc, row + d, sizeof sc);
    return sc;
}

/* x [d] rounded to fp8 bits (RNE, clamped to +-max): exact power-of-2 scalings and rintf, as
 * torch converts float32 to float8 (man_bits 3 / bias 7 for e4m3fn, 2 / 15 for e5m2). */
static uint8_t fp8_encode(float x, float max, int man_bits, int bias) {
    float a = fabsf(x) < max ? fabsf(x) : max;
    int e;
    frexpf(a, &e); /* a = f * 2^e, f in [0.5, 1): the unbiased exponent is e - 1 */
    e = a == 0.0f ? 1 - bias : e - 1;
    if (e < 1 - bias) e = 1 - bias;
    float r = ldexpf(rintf(ldexpf(a, man_bits - e)), e - man_bits);
    int bits = 0;
    if (r != 0.0f) {
        int re;
        float f = frexpf(r, &re);
        re -= 1;
        if (re < 1 - bias)
            bits = (int)ldexpf(r, bias - 1 + man_bits); /* a subnormal's mantissa */
        else
            bits = ((re + bias) << man_bits) | ((int)ldexpf(2.0f * f - 1.0f, man_bits));
    }
    return (uint8_t)(x < 0.0f ? bits | 128 : bits);
}

/* A row of d floats stored as `kind` at dst (gpu_worker/kv_quant.py's quantize, bit for bit:
 * no reciprocal for the int8 division, whatever the file's -ffast-math). */
__attribute__((optimize("no-fast-math"))) static void store_row(void *dst, int kind,
                                                                const float *x, int d) {
    if (kind == KV_F32) {
        memcpy(dst, x, sizeof(float) * d);
    } else if (kind == KV_BF16) {
        uint16_t *o = dst;
        for (int e = 0; e < d; e++) o[e] = f32_to_bf16(x[e]);
    } else if (kind == KV_INT8) {
        float amax = 0.0f;
        for (int e = 0; e < d; e++) amax = fabsf(x[e]) > amax ? fabsf(x[e]) : amax;
        float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
        int8_t *o = dst;
        for (int e = 0; e < d; e++) {
            float q = rintf(x[e] / scale);
            o[e] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
        }
        memcpy(o + d, &scale, sizeof scale);
    } else {
        uint8_t *o = dst;
        int e4m3 = kind == KV_FP8_E4M3;
        for (int e = 0; e < d; e++)
            o[e] = fp8_encode(x[e], e4m3 ? 448.0f : 57344.0f, e4m3 ? 3 : 2, e4m3 ? 7 : 15);
    }
}

/* The rows of heads [h0, h0 + nh) at `slot`, as float32: in place for float32, else
 * converted into buf. */
static inline const float *load_rows(const void *cache, int kind, int64_t slot, int kvh, int h0,
                                     int nh, int d, float *buf) {
    int64_t first = slot * kvh + h0;
    if (kind == KV_F32) return (const float *)cache + first * d;
    if (kind == KV_BF16) {
        const uint8_t *src = (const uint8_t *)((const uint16_t *)cache + first * d);
        for (int x = 0; x < nh * d; x++) buf[x] = row_value(src, KV_BF16, x);
        return buf;
    }
    int64_t rb = row_bytes(kind, d);
    for (int hh = 0; hh < nh; hh++) {
        const uint8_t *row = (const uint8_t *)cache + (first + hh) * rb;
        float *o = buf + (int64_t)hh * d;
        float sc = row_scale(row, kind, d);
        if (kind == KV_INT8)
            for (int x = 0; x < d; x++) o[x] = row_value(row, KV_INT8, x) * sc;
        else if (kind == KV_FP8_E4M3)
            for (int x = 0; x < d; x++) o[x] = row_value(row, KV_FP8_E4M3, x);
        else
            for (int x = 0; x < d; x++) o[x] = row_value(row, KV_FP8_E5M2, x);
    }
    return buf;
}

/* s = cap * tanh(s / cap) over n scores, as transformers' Gemma 2 soft-caps them */
static void soft_cap(float *s, int n, float cap) {
    for (int l = 0; l < n; l++) s[l] = tanhf(s[l] / cap) * cap;
}

/* Blocks are scattered: ask for position l + bs's rows now, one block ahead of their use,
 * into L2 (prefetcht1): into L1 (t0) each request holds one of the core's few L1 miss
 * buffers until it lands, and the loop stalled on them (a 64-sequence step's attention read
 * its KV at 17 GB/s with t0, 21 GB/s with t1, on a 2-core EPYC). */
static inline void prefetch_ahead(const void *cache, int kind, const int32_t *table, int l,
                                  int seq_len, int bs, int kvh, int h0, int d, int count) {
    int ahead = l + bs;
    if (ahead >= seq_len) return;
    int64_t slot = (int64_t)table[ahead / bs] * bs + ahead % bs;
    int64_t rb = row_bytes(kind, d), bytes = (int64_t)(count / d) * rb;
    const char *row = (const char *)cache + (slot * kvh + h0) * rb;
    for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
}

/* Each of `rows` rows of scores [rows][seq_len] (positions start..seq_len - 1) soft-capped
 * (softcap > 0) and turned into its softmax, with its sink's logit in the denominator
 * (sinks: NULL for none); out [rows][d], the weighted sums to come, zeroed. One compiled copy
 * (noipa: never inlined or specialised per caller), so a row's softmax is the same machine
 * code in attend_fixed and attend_tile. */
__attribute__((noipa)) static void softmax_rows(float *scores, int rows, int start,
                                               int seq_len, float softcap, const float *sinks,
                                               float *out, int d) {
    for (int r = 0; r < rows; r++) {
        float *s = scores + (int64_t)r * seq_len, m = -INFINITY, sum = 0.0f;
        if (softcap > 0.0f) soft_cap(s + start, seq_len - start, softcap);
        for (int l = start; l < seq_len; l++) m = s[l] > m ? s[l] : m;
        if (sinks && sinks[r] > m) m = sinks[r];
#pragma omp simd reduction(+ : sum)
        for (int l = start; l < seq_len; l++) {
            s[l] = expf(s[l] - m);
            sum += s[l];
        }
        if (sinks) sum += expf(sinks[r] - m);
        float inv = 1.0f / sum;
        for (int l = start; l < seq_len; l++) s[l] *= inv;
    }
    memset(out, 0, sizeof(float) * (size_t)rows * d);
}

/* Query rows of KV heads [h0, h0 + nh) of one sequence. Positions are walked in order and
 * each position's rows of those heads are adjacent in memory, so a block streams through
 * once per pass (K, then V) instead of once per head. */
static void attend(const float *q, const void *k_cache, const void *v_cache, int kind,
                   const int32_t *table, int start, int seq_len, int h0, int nh, int kvh, int g,
                   int d, int bs, float scale, float softcap, const float *sinks, float *out,
                   float *scores, float *row_buf) {
    int rows = nh * g;
    for (int l = start; l < seq_len; l++) {
        int64_t slot = (int64_t)table[l / bs] * bs + l % bs;
        prefetch_ahead(k_cache, kind, table, l, seq_len, bs, kvh, h0, d, nh * d);
        const float *k = load_rows(k_cache, kind, slot, kvh, h0, nh, d, row_buf);
        for (int r = 0; r < rows; r++)
            scores[(int64_t)r * seq_len + l] = dot(q + (int64_t)r * d, k + (r / g) * d, d) * scale;
    }
    softmax_rows(scores, rows, start, seq_len, softcap, sinks, out, d);
    for (int l = start; l < seq_len; l++) {
        int64_t slot = (int64_t)table[l / bs] * bs + l % bs;
        prefetch_ahead(v_cache, kind, table, l, seq_len, bs, kvh, h0, d, nh * d);
        const float *v = load_rows(v_cache, kind, slot, kvh, h0, nh, d, row_buf);
        for (int r = 0; r < rows; r++) {
            float p = scores[(int64_t)r * seq_len + l];
            const float *vr = v + (r / g) * d;
            float *restrict o = out + (int64_t)r * d;
            for (int x = 0; x < d; x++) o[x] += p * vr[x];
        }
    }
}

/* The two steps of a query row against one block's rows j0 <= j < n, as block_rows reads them
 * (row j at k + j * stride, an int8 row's scale in scales[j]), for a head size D known when
 * compiled (64, 128) and one row format:
 *
 *   score_rows:      s[j] = (q . k_j) * scale_k * scale       (vector dot products, below)
 *   accumulate_rows: o += sum_j (p[j] * scale_v) v_j, in j's order, o held in vector
 *                    registers across the block (attend() loads and stores it per position)
 *
 * An int8 row's scale multiplies the sums, not each element. Each (D, format) pair has one
 * compiled copy of each step (DEFINE_ROW_STEPS: noipa, never inlined or specialised per
 * caller), and attend_fixed (a row's whole context) and attend_tile (a tile of a prefill
 * chunk's rows) both call it, so a row's scores and sums are the same machine code, the same
 * bits, on either path.
 *
 * score_rows' dot products are vectors of KV_LANES (16 with AVX-512, 8 on an AVX2 build)
 * floats: q . k_j is a chain of multiply-adds per lane over the D / KV_LANES chunks, its lanes
 * then summed by a fixed halving tree (t_i = a_i + a_i+8, u_i = t_i + t_i+4, v_i = u_i + u_i+2,
 * v_0 + v_1; on 8 lanes the last three). Eight key rows at a time run that tree together (each
 * level's shuffles and adds halve every row's lanes and pack the rows closer: 3 operations a
 * row instead of a horizontal sum's 8); a block's last rows share theirs with zeros. A row's
 * sum is the same tree, the same bits, whichever rows share its eight. 13% off the CPU time
 * of a 512-token chunk's attention and of a B=64 decode step's (Zen 4, one thread:
 * tools/benchmarks/prefill_attention.py, kv_attention.py --cpu-time). */
#if defined(__AVX512F__)
#define KV_LANES 16
typedef float vfw __attribute__((vector_size(64)));
#else /* AVX2: 16-lane vectors would be lowered to slow element-wise shuffles (5x slower) */
#define KV_LANES 8
typedef float vfw __attribute__((vector_size(32)));
#endif
typedef float vf8 __attribute__((vector_size(32)));
/* (always inlined: a narrower build's note that such vectors pass differently does not apply) */
#pragma GCC diagnostic ignored "-Wpsabi"

static inline __attribute__((always_inline)) vfw loadw(const float *p) {
    vfw v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) vfw row_dot(const int D, const vfw *q,
                                                         const float *k) {
    vfw acc = q[0] * loadw(k);
    for (int c = 1; c < D / KV_LANES; c++) acc += q[c] * loadw(k + KV_LANES * c);
    return acc;
}

/* The halving tree's sums of a[0..8), lane p of the result holding a[p]'s */
static inline __attribute__((always_inline)) vf8 sum_rows8(const vfw *a) {
#if KV_LANES == 16
    vfw t[4], u[2], v;
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20,
                                       21, 22, 23, 28, 29, 30, 31);
    v = __builtin_shufflevector(u[0], u[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                29) +
        __builtin_shufflevector(u[0], u[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27,
                                30, 31);
    return __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14) +
           __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15);
#else /* 8 lanes: t_i = a_i + a_i+4, u_i = t_i + t_i+2, u_0 + u_1, by shuffles within the
         128-bit halves after the first (rows land in the order 0 2 4 6 1 3 5 7) */
    vf8 t[4], u[2], v;
    for (int i = 0; i < 4; i++)
        t[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
               __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
    for (int i = 0; i < 2; i++)
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(t[2 * i], t[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    v = __builtin_shufflevector(u[0], u[1], 0, 2, 8, 10, 4, 6, 12, 14) +
        __builtin_shufflevector(u[0], u[1], 1, 3, 9, 11, 5, 7, 13, 15);
    return __builtin_shufflevector(v, v, 0, 4, 1, 5, 2, 6, 3, 7);
#endif
}

static inline __attribute__((always_inline)) void
score_row(const int D, const int kind, const float *qr, const float *k, int64_t stride,
          const float *scales, int j0, int n, float scale, float *s) {
    vfw q[D / KV_LANES];
    for (int c = 0; c < D / KV_LANES; c++) q[c] = loadw(qr + KV_LANES * c);
    int j = j0;
    for (; j + 8 <= n; j += 8) {
        vfw acc[8];
        for (int p = 0; p < 8; p++) acc[p] = row_dot(D, q, k + (j + p) * stride);
        vf8 sums = sum_rows8(acc);
        for (int p = 0; p < 8; p++)
            s[j + p] = sums[p] * (kind == KV_INT8 ? scales[j + p] : 1.0f) * scale;
    }
    if (j < n) { /* the last rows, and zeros (a separate loop: the one above keeps its eight
                    in registers) */
        vfw acc[8] = {0};
        for (int p = 0; p < n - j; p++) acc[p] = row_dot(D, q, k + (j + p) * stride);
        vf8 sums = sum_rows8(acc);
        for (int p = 0; p < n - j; p++)
            s[j + p] = sums[p] * (kind == KV_INT8 ? scales[j + p] : 1.0f) * scale;
    }
}

/* The g query rows of one KV head (q [g][D]; row r's scores at s + r * s_stride) */
static inline __attribute__((always_inline)) void
score_rows(const int D, const int kind, const float *q, int g, const float *k, int64_t stride,
           const float *scales, int j0, int n, float scale, float *s, int64_t s_stride) {
    for (int r = 0; r < g; r++)
        score_row(D, kind, q + (int64_t)r * D, k, stride, scales, j0, n, scale,
                  s + r * s_stride);
}

/* The weight of value row j for a query row's probabilities p */
#define VALUE_WEIGHT(p, j) (kind == KV_INT8 ? (p)[j] * scales[j] : (p)[j])

/* R (1 or 2) query rows' value sums, each value row loaded once for the R */
static inline __attribute__((always_inline)) void
accumulate_r(const int D, const int kind, const int R, const float *p, int64_t p_stride,
             const float *v, int64_t stride, const float *scales, int j0, int n, float *o) {
    vfw a[2][D / KV_LANES];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < D / KV_LANES; c++) a[r][c] = loadw(o + r * D + KV_LANES * c);
    for (int j = j0; j < n; j++) {
        const float *vj = v + j * stride;
        float w[2];
        for (int r = 0; r < R; r++) w[r] = VALUE_WEIGHT(p + r * p_stride, j);
        for (int c = 0; c < D / KV_LANES; c++) {
            vfw x = loadw(vj + KV_LANES * c);
            for (int r = 0; r < R; r++) a[r][c] += w[r] * x;
        }
    }
    for (int r = 0; r < R; r++) memcpy(o + r * D, a[r], sizeof a[r]);
}

/* The g query rows of one KV head (out [g][D]; row r's probabilities at p + r * p_stride),
 * two at a time: each value row is loaded once for both, and their 2 * D / KV_LANES sums are
 * independent chains (one row's D / KV_LANES leave the multiply-adds waiting on their latency);
 * an odd last row alone. Each row's sums are the same operations in the same order either
 * way, and a row of a head always takes the same way (its place among the g). */
static inline __attribute__((always_inline)) void
accumulate_rows(const int D, const int kind, const float *p, int64_t p_stride, int g,
                const float *v, int64_t stride, const float *scales, int j0, int n, float *o) {
    int r = 0;
    for (; r + 2 <= g; r += 2)
        accumulate_r(D, kind, 2, p + r * p_stride, p_stride, v, stride, scales, j0, n,
                     o + (int64_t)r * D);
    if (r < g)
        accumulate_r(D, kind, 1, p + r * p_stride, p_stride, v, stride, scales, j0, n,
                     o + (int64_t)r * D);
}

typedef void score_fn(const float *q, int g, const float *k, int64_t stride,
                      const float *scales, int j0, int n, float scale, float *s,
                      int64_t s_stride);
typedef void accumulate_fn(const float *p, int64_t p_stride, int g, const float *v,
                           int64_t stride, const float *scales, int j0, int n, float *o);
#define DEFINE_ROW_STEPS(D, KIND)                                                              \
    __attribute__((noipa)) static void score_##D##_##KIND(                                     \
        const float *q, int g, const float *k, int64_t stride, const float *scales, int j0,    \
        int n, float scale, float *s, int64_t s_stride) {                                      \
        score_rows(D, KIND, q, g, k, stride, scales, j0, n, scale, s, s_stride);               \
    }                                                                                          \
    __attribute__((noipa)) static void accumulate_##D##_##KIND(                                \
        const float *p, int64_t p_stride, int g, const float *v, int64_t stride,               \
        const float *scales, int j0, int n, float *o) {                                        \
        accumulate_rows(D, KIND, p, p_stride, g, v, stride, scales, j0, n, o);                 \
    }

/* Rows j0 <= j < n of one block and KV head, row j at `rows` + j * stride bytes, as float32:
 * in place for float32 (*stride_out: floats from one row to the next), else each row's values
 * converted once into buf [n][D] (the query rows that use them then read them from L1) and
 * its scale into scales[j]. */
static inline __attribute__((always_inline)) const float *
block_rows(const int D, const int kind, const uint8_t *rows, int64_t stride, int j0, int n,
           float *buf, float *scales, int64_t *stride_out) {
    if (kind == KV_F32) {
        *stride_out = stride / (int64_t)sizeof(float);
        return (const float *)rows;
    }
    for (int j = j0; j < n; j++) {
        const uint8_t *row = rows + j * stride;
        float *o = buf + (int64_t)j * D;
#pragma omp simd
        for (int x = 0; x < D; x++) o[x] = row_value(row, kind, x);
        scales[j] = row_scale(row, kind, D);
    }
    *stride_out = D;
    return buf;
}

/* attend() for a head size D known when compiled (64, 128) and one row format: a block of
 * positions and one KV head at a time, its rows converted to float32 once (block_rows) for
 * the head's g query rows, each row's scores and sums by the (D, format)'s row steps. The
 * sums are those of attend() in another order; a token's are the same whatever its batch
 * (they depend on its own rows and D alone). buf holds bs * D floats and bs scales. */
static inline __attribute__((always_inline)) void
attend_fixed(const int D, const int kind, score_fn *score, accumulate_fn *accumulate,
             const float *q, const void *k_cache, const void *v_cache, const int32_t *table,
             int start, int seq_len, int h0, int nh, int kvh, int g, int bs, float scale,
             float softcap, const float *sinks, float *out, float *scores, float *buf) {
    int rows = nh * g;
    int64_t rb = row_bytes(kind, D), rs = kvh * rb; /* bytes from one position's row to the next */
    float *scales = buf + (int64_t)bs * D;
    int first = start - start % bs; /* the block holding position `start` */
    /* The next block's rows are prefetched a head at a time, before that head's rows of this
     * block are used, where a head's row is whole cache lines (float32, bfloat16): one burst
     * of every head's rows at the first head stalled the loop on the core's miss buffers
     * (a B=64 decode step of 30 layers of 3 KV heads, context 400, one Zen 4 thread: 138 ->
     * 91 ms). Narrower rows (int8, fp8) share lines between heads, and keep the one burst. */
    int by_head = rb % 64 == 0;
    for (int l0 = first; l0 < seq_len; l0 += bs) {
        int n = seq_len - l0 < bs ? seq_len - l0 : bs, j0 = l0 < start ? start - l0 : 0;
        int64_t at = (int64_t)table[l0 / bs] * bs * rs + h0 * rb; /* its row of head h0 */
        const uint8_t *block = (const uint8_t *)k_cache + at;
        for (int hh = 0; hh < nh; hh++) {
            int64_t stride;
            if (by_head || hh == 0) /* the next block's rows (see above) */
                for (int j = j0; j < n; j++)
                    prefetch_ahead(k_cache, kind, table, l0 + j, seq_len, bs, kvh,
                                   by_head ? h0 + hh : h0, D, by_head ? D : nh * D);
            const float *k = block_rows(D, kind, block + hh * rb, rs, j0, n, buf, scales,
                                        &stride);
            score(q + (int64_t)hh * g * D, g, k, stride, scales, j0, n, scale,
                  scores + (int64_t)hh * g * seq_len + l0, seq_len);
        }
    }
    softmax_rows(scores, rows, start, seq_len, softcap, sinks, out, D);
    for (int l0 = first; l0 < seq_len; l0 += bs) {
        int n = seq_len - l0 < bs ? seq_len - l0 : bs, j0 = l0 < start ? start - l0 : 0;
        int64_t at = (int64_t)table[l0 / bs] * bs * rs + h0 * rb; /* its row of head h0 */
        const uint8_t *block = (const uint8_t *)v_cache + at;
        for (int hh = 0; hh < nh; hh++) {
            int64_t stride;
            if (by_head || hh == 0)
                for (int j = j0; j < n; j++)
                    prefetch_ahead(v_cache, kind, table, l0 + j, seq_len, bs, kvh,
                                   by_head ? h0 + hh : h0, D, by_head ? D : nh * D);
            const float *v = block_rows(D, kind, block + hh * rb, rs, j0, n, buf, scales,
                                        &stride);
            accumulate(scores + (int64_t)hh * g * seq_len + l0, seq_len, g, v, stride, scales,
                       j0, n, out + (int64_t)hh * g * D);
        }
    }
}

/* The first position a query row of length len sees: len - window with a window, else 0 */
static inline int visible_from(int len, int window) {
    return window > 0 && len > window ? len - window : 0;
}

/* One pass (K, or V) of attend_tile over the tile's positions [lo, hi): each block's rows of
 * head h converted once (block_rows) for all the tile's rows, then each row's own visible
 * positions of it, [visible_from(len), len), by `step` (score_rows or accumulate_rows). */
#define TILE_PASS(cache, STEP_CALL)                                                            \
    for (int l0 = lo - lo % bs; l0 < hi; l0 += bs) {                                           \
        int n = hi - l0 < bs ? hi - l0 : bs, j0 = l0 < lo ? lo - l0 : 0;                       \
        const uint8_t *block = (const uint8_t *)(cache) + (int64_t)table[l0 / bs] * bs * rs +  \
                               h * rb;                                                         \
        for (int j = j0; j < n; j++)                                                           \
            prefetch_ahead(cache, kind, table, l0 + j, hi, bs, kvh, h, D, D);                  \
        int64_t stride;                                                                        \
        const float *rows_ = block_rows(D, kind, block, rs, j0, n, buf, scales, &stride);      \
        for (int t = 0; t < tile; t++) {                                                       \
            int a = visible_from(len0 + t, window) - l0, b = len0 + t - l0;                    \
            a = a < j0 ? j0 : a;                                                               \
            b = b > n ? n : b;                                                                 \
            int64_t r = (int64_t)t * g, row = t * row_stride; /* its first query row */        \
            if (a < b) STEP_CALL;                                                              \
        }                                                                                      \
    }

/* `tile` consecutive query tokens of one sequence (a prefill chunk's rows t0.., the first of
 * length len0: it sees positions < len0, the next < len0 + 1, ...) and the g query heads of
 * KV head h: q and out [tile][..][D] with row_stride floats from one token to the next. Each
 * block's K (then V) rows are read and converted once for the tile's tile * g rows instead of
 * once per row; each row is scored, soft-maxed and summed by the same row steps and softmax
 * as attend_fixed, over the same positions in the same order and blocks: a row's output is
 * the same bits as attend_fixed gives it as a decode of its own length. scores holds
 * tile * g rows of (len0 + tile - 1) floats; buf bs * D floats and bs scales. */
static inline __attribute__((always_inline)) void
attend_tile(const int D, const int kind, score_fn *score, accumulate_fn *accumulate,
            const float *q, int64_t row_stride, const void *k_cache, const void *v_cache,
            const int32_t *table, int len0, int tile, int window, int h, int kvh, int g, int bs,
            float scale, float softcap, const float *sinks, float *out, float *scores,
            float *buf) {
    int64_t rb = row_bytes(kind, D), rs = kvh * rb;
    float *scales = buf + (int64_t)bs * D;
    int lo = visible_from(len0, window), hi = len0 + tile - 1; /* the positions any row sees */
    TILE_PASS(k_cache, score(q + row, g, rows_, stride, scales, a, b, scale,
                             scores + r * hi + l0, hi))
    for (int t = 0; t < tile; t++)
        for (int jj = 0; jj < g; jj++)
            softmax_rows(scores + ((int64_t)t * g + jj) * hi, 1, visible_from(len0 + t, window),
                         len0 + t, softcap, sinks ? sinks + jj : NULL,
                         out + t * row_stride + jj * D, D);
    TILE_PASS(v_cache, accumulate(scores + r * hi + l0, hi, g, rows_, stride, scales, a, b,
                                  out + row))
}

/* attend_fixed's and attend_tile's instances: one function per head size and row format */
typedef void attend_fn(const float *q, const void *k_cache, const void *v_cache,
                       const int32_t *table, int start, int seq_len, int h0, int nh, int kvh,
                       int g, int bs, float scale, float softcap, const float *sinks,
                       float *out, float *scores, float *buf);
typedef void tile_fn(const float *q, int64_t row_stride, const void *k_cache,
                     const void *v_cache, const int32_t *table, int len0, int tile, int window,
                     int h, int kvh, int g, int bs, float scale, float softcap,
                     const float *sinks, float *out, float *scores, float *buf);
#define DEFINE_ATTEND_FIXED(D, KIND)                                                           \
    DEFINE_ROW_STEPS(D, KIND)                                                                  \
    static void attend_##D##_##KIND(const float *q, const void *k_cache, const void *v_cache,  \
                                    const int32_t *table, int start, int seq_len, int h0,      \
                                    int nh, int kvh, int g, int bs, float scale,               \
                                    float softcap, const float *sinks, float *out,             \
                                    float *scores, float *buf) {                               \
        attend_fixed(D, KIND, score_##D##_##KIND, accumulate_##D##_##KIND, q, k_cache,         \
                     v_cache, table, start, seq_len, h0, nh, kvh, g, bs, scale, softcap,       \
                     sinks, out, scores, buf);                                                 \
    }                                                                                          \
    static void tile_##D##_##KIND(const float *q, int64_t row_stride, const void *k_cache,     \
                                  const void *v_cache, const int32_t *table, int len0,         \
                                  int tile, int window, int h, int kvh, int g, int bs,         \
                                  float scale, float softcap, const float *sinks, float *out,  \
                                  float *scores, float *buf) {                                 \
        attend_tile(D, KIND, score_##D##_##KIND, accumulate_##D##_##KIND, q, row_stride,       \
                    k_cache, v_cache, table, len0, tile, window, h, kvh, g, bs, scale,         \
                    softcap, sinks, out, scores, buf);                                         \
    }
#define DEFINE_ATTEND_FIXED_KINDS(D)                                                           \
    DEFINE_ATTEND_FIXED(D, KV_F32)                                                             \
    DEFINE_ATTEND_FIXED(D, KV_BF16)                                                            \
    DEFINE_ATTEND_FIXED(D, KV_INT8)                                                            \
    DEFINE_ATTEND_FIXED(D, KV_FP8_E4M3)                                                        \
    DEFINE_ATTEND_FIXED(D, KV_FP8_E5M2)                                                        \
    static attend_fn *const attend_##D[] = {attend_##D##_KV_F32, attend_##D##_KV_BF16,          \
                                            attend_##D##_KV_INT8, attend_##D##_KV_FP8_E4M3,     \
                                            attend_##D##_KV_FP8_E5M2};                          \
    static tile_fn *const tile_##D[] = {tile_##D##_KV_F32, tile_##D##_KV_BF16,                  \
                                        tile_##D##_KV_INT8, tile_##D##_KV_FP8_E4M3,             \
                                        tile_##D##_KV_FP8_E5M2};
DEFINE_ATTEND_FIXED_KINDS(64)
DEFINE_ATTEND_FIXED_KINDS(128)

/* Returns 0, or -1 when a shape is outside what the kernel handles (the caller falls back).
 * kind: the caches' row format (see the top); window: the sliding window, 0 for the whole
 * context; softcap: the scores' soft cap, 0 for none; sinks: [num_heads] float32 logits, or
 * NULL for none. Head sizes 64 and 128 run attend_fixed's instance for the row format,
 * others attend(). */
int paged_decode(const float *q, const void *k_cache, const void *v_cache, int kind,
                 const int32_t *block_tables, int table_stride, const int32_t *seq_lens,
                 int n, int num_heads, int kvh, int d, int bs, float scale, int window,
                 float softcap, const float *sinks, float *out, int num_threads) {
    int g = num_heads / kvh, max_len = 0;
    if (n <= 0 || num_threads <= 0 || kind < KV_F32 || kind > KV_FP8_E5M2) return -1;
    attend_fn *fixed = d == 64 ? attend_64[kind] : d == 128 ? attend_128[kind] : NULL;
    for (int i = 0; i < n; i++)
        if (seq_lens[i] > max_len) max_len = seq_lens[i];
    /* whole sequences per task when there are enough of them, else one KV head per task */
    int split = n >= 4 * num_threads ? 1 : kvh, nh = kvh / split;
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* the scores, then attend()'s rows or attend_fixed's block of rows and scales */
        size_t rows_floats = (size_t)(nh * d > bs * (d + 1) ? nh * d : bs * (d + 1));
        float *scores = malloc(sizeof(float) * ((size_t)nh * g * max_len + rows_floats));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < n * split; task++) {
            if (scores == NULL) continue;
            int i = task / split, h0 = (task % split) * nh;
            int64_t row = ((int64_t)i * num_heads + (int64_t)h0 * g) * d;
            const int32_t *table = block_tables + (int64_t)i * table_stride;
            int len = seq_lens[i], start = window > 0 && len > window ? len - window : 0;
            const float *task_sinks = sinks ? sinks + (int64_t)h0 * g : NULL; /* its rows' */
            float *rows_buf = scores + (size_t)nh * g * max_len;
            if (fixed)
                fixed(q + row, k_cache, v_cache, table, start, len, h0, nh, kvh, g, bs, scale,
                      softcap, task_sinks, out + row, scores, rows_buf);
            else
                attend(q + row, k_cache, v_cache, kind, table, start, len, h0, nh, kvh, g, d,
                       bs, scale, softcap, task_sinks, out + row, scores, rows_buf);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Tokens per attend_tile task: a block's K/V rows are read and converted once per
 * PREFILL_TILE tokens (times the g heads of their group) instead of once per row (4 and 32
 * measured no faster; the name is unique in one_call_step.c, which #includes this file) */
enum { PREFILL_TILE = 16 };

/* A prefill chunk's n query tokens of one sequence, batch-invariant: token i (q, out [n][H][D]
 * float32) attends to the first `first` + i + 1 positions of the sequence's blocks (table),
 * each of its rows the same bits as paged_decode gives it as a decode of that length.
 * One task per (tile of PREFILL_TILE tokens, KV head), the longest tiles first; which thread
 * runs a task changes no bits. Returns 0, or -1 when the kernel does not cover the shape
 * (head sizes other than 64 and 128: the caller keeps paged_decode's row-by-row path). */
int paged_prefill(const float *q, const void *k_cache, const void *v_cache, int kind,
                  const int32_t *table, int first, int n, int num_heads, int kvh, int d, int bs,
                  float scale, int window, float softcap, const float *sinks, float *out,
                  int num_threads) {
    if (n <= 0 || first < 0 || num_threads <= 0 || kind < KV_F32 || kind > KV_FP8_E5M2)
        return -1;
    tile_fn *tile = d == 64 ? tile_64[kind] : d == 128 ? tile_128[kind] : NULL;
    if (tile == NULL) return -1;
    int g = num_heads / kvh, tiles = (n + PREFILL_TILE - 1) / PREFILL_TILE, failed = 0;
    size_t score_floats = (size_t)PREFILL_TILE * g * (first + n);
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = malloc(sizeof(float) * (score_floats + (size_t)bs * (d + 1)));
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < tiles * kvh; task++) {
            if (scores == NULL) continue;
            int t0 = (tiles - 1 - task / kvh) * PREFILL_TILE, h = task % kvh;
            int count = n - t0 < PREFILL_TILE ? n - t0 : PREFILL_TILE;
            int64_t at = ((int64_t)t0 * num_heads + (int64_t)h * g) * d;
            tile(q + at, (int64_t)num_heads * d, k_cache, v_cache, table, first + t0 + 1, count,
                 window, h, kvh, g, bs, scale, softcap, sinks ? sinks + (int64_t)h * g : NULL,
                 out + at, scores, scores + score_floats);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* For the tests: `rows` rows of d floats stored as `kind` one after another (row_bytes). */
void shuttle_test_store_row(void *dst, int kind, const float *x, int d, int rows) {
    for (int r = 0; r < rows; r++)
        store_row((char *)dst + r * row_bytes(kind, d), kind, x + (size_t)r * d, d);
}
