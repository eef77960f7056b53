/* The few-row kernel of gguf.c on AVX2: weight blocks unpacked to bytes in registers, dotted with
 * every row of x (int8 per 32 values) by vpdpbusd or vpmaddubsw; the same unpacking dequantizes
 * (gguf_dequant_row). Included by gguf.c: static only. */
#ifndef SHUTTLE_GGUF_ROWS_H
#define SHUTTLE_GGUF_ROWS_H
#include <stdint.h>
#include <string.h>

#include "gguf.h"
#if defined(__AVX2__)
#include <immintrin.h>

/* 16 bytes of nibbles -> 32 bytes: the low nibbles, then the high ones (a broadcast load and
 * a per-lane shift: no cross-lane shuffle, whose one port the dot products' reduction needs) */
static inline __m256i gguf_nib32(const uint8_t *qs) {
    __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    v = _mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0));
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
}

/* the first 4 bytes of 8 blocks (b[i]: block i): lane i of *d is block i's half-float scale
 * (bytes 0-1), of *m its min (bytes 2-3, Q4_1/Q5_1). Loaded as 32-bit words and packed in
 * registers: halves stored to the stack one by one then loaded as a vector stall on store
 * forwarding, which cost the Q4_1 decode kernel ~40% of its time (Sapphire Rapids). */
static inline void gguf_scales8(const uint8_t *const *b, __m256 *d, __m256 *m) {
    uint64_t pair[4];
    for (int i = 0; i < 4; i++) {
        uint32_t lo, hi;
        memcpy(&lo, b[2 * i], 4);
        memcpy(&hi, b[2 * i + 1], 4);
        pair[i] = (uint64_t)lo | (uint64_t)hi << 32;
    }
    __m256i v = _mm256_set_epi64x((int64_t)pair[3], (int64_t)pair[2], (int64_t)pair[1],
                                  (int64_t)pair[0]);
    /* per 128-bit lane: the low halves, then the high halves; then lanes' quarters reordered */
    const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                           0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    v = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xd8);
    *d = _mm256_cvtph_ps(_mm256_castsi256_si128(v));
    *m = _mm256_cvtph_ps(_mm256_extracti128_si256(v, 1));
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
            macc[r] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(MIN_TERM), _mm_set_ss(x->s[xr_]),   \
                                                 _mm_set_ss(macc[r])));                        \
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

/* an int32 vector's lanes summed (exact) */
static inline int32_t gguf_hsum_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

/* the 32-value block types: one weight row against nr rows of x. Each unit's dot product is
 * one exact int32, then, per row and in unit order, acc = fma(float(dot), dw * dx, acc) and
 * for Q4_1/Q5_1 acc = fma(mw, sum(x), acc): the float operations of the GEMM
 * (gguf_gemm.h), by intrinsics the compiler does not reassociate, so a row's result is the
 * same bits on both paths, whatever the batch (tests/unit/gpu_worker/cpu/test_gguf.py) */
static inline __attribute__((always_inline)) void gguf_dot32(int qt, const uint8_t *w, int nu,
                                                             const gguf_xq *x, int r0, int nr,
                                                             float *res, float *dst) {
    __m128 acc[GGUF_ROW_TILE];
    for (int r = 0; r < nr; r++) acc[r] = _mm_setzero_ps();
    const int bb = gguf_block_bytes(qt);
    const int has_min = qt == GGUF_Q4_1 || qt == GGUF_Q5_1;
    for (int u = 0; u < nu; u++) {
        const uint8_t *b = w + (int64_t)u * bb;
        _mm_prefetch((const char *)b + GGUF_PREFETCH, _MM_HINT_T0);
        float dw = gguf_half(b), mw = 0.f;
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
        if (dst) {
            __m256 sv = _mm256_set1_ps(dw);
            GGUF_UNIT_STORE(q, sv, u, mw);
            continue;
        }
        __m256i qa = sgn ? _mm256_abs_epi8(q) : q;
        __m128 dw1 = _mm_set_ss(dw), mw1 = _mm_set_ss(mw);
        for (int r = 0; r < nr; r++) {
            int64_t xr = (int64_t)(r0 + r) * x->nu + u;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + xr * 32));
            if (sgn) xv = _mm256_sign_epi8(xv, q);
            __m128 dot = _mm_cvtsi32_ss(_mm_setzero_ps(), gguf_hsum_epi32(gguf_dot_us(qa, xv)));
            acc[r] = _mm_fmadd_ss(dot, _mm_mul_ss(dw1, _mm_set_ss(x->d[xr])), acc[r]);
            if (has_min) acc[r] = _mm_fmadd_ss(mw1, _mm_set_ss(x->s[xr]), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) res[r] = _mm_cvtss_f32(acc[r]);
}

/* lanes i of p[0..7] summed into lane i (exact int32 adds), by hadd: fewest uops */
static inline __m256i gguf_hsum8x8(const __m256i *p) {
    __m256i a0 = _mm256_hadd_epi32(p[0], p[1]), a1 = _mm256_hadd_epi32(p[2], p[3]);
    __m256i a2 = _mm256_hadd_epi32(p[4], p[5]), a3 = _mm256_hadd_epi32(p[6], p[7]);
    __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20),
                            _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* the same sums by shifts and blends (any port) where they do, three shuffles in all (hadd
 * takes 14 uops on the one shuffle port): faster where the unpacking, not the dot products,
 * dominates (one or two rows of x) */
static inline __m256i gguf_hsum8x8_blend(const __m256i *p) {
    __m256i r[4], s[2];
    for (int j = 0; j < 4; j++) { /* 64-bit lane k of r[j]: p[2j]'s pair k sum, p[2j+1]'s */
        __m256i a = p[2 * j], b = p[2 * j + 1];
        a = _mm256_add_epi32(a, _mm256_srli_epi64(a, 32));
        b = _mm256_add_epi32(b, _mm256_slli_epi64(b, 32));
        r[j] = _mm256_blend_epi32(a, b, 0xaa);
    }
    for (int j = 0; j < 2; j++) { /* per 128-bit lane: the four rows' sums of its half */
        __m256i a = r[2 * j], b = r[2 * j + 1];
        __m256i x = _mm256_blend_epi32(a, b, 0xcc);
        __m256i y = _mm256_shuffle_epi32(_mm256_blend_epi32(b, a, 0xcc), 0x4e);
        s[j] = _mm256_add_epi32(x, y);
    }
    return _mm256_add_epi32(_mm256_blend_epi32(s[0], s[1], 0xf0),
                            _mm256_permute2x128_si256(s[0], s[1], 0x21));
}

/* Q8_0's quants go to vpdpbusd as unsigned bytes, q + 128 (one xor a block), where VNNI adds
 * them without saturating: dot(q, x) = dpbusd(q + 128, x) - 128 * sum(x), exactly, against
 * the sign trick's abs (a block) and sign (a block and row of x). One Zen 4 thread, Q8_0
 * [8192, 576] hot in cache, 1 / 2 / 4 rows of x: 1.36 / 1.91 / 3.26 -> 1.15 / 1.72 / 3.04 ns a
 * block. maddubs's int16 pairs would saturate on q + 128 (255 * 127 * 2): AVX2 keeps the trick. */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define GGUF_Q8_BIASED 1
#else
#define GGUF_Q8_BIASED 0
#endif

/* Q4_0 / Q4_1 / Q8_0, 8 weight rows: rows i and i + 4 side by side in one register (the 16
 * bytes of each block's nibbles in a 128-bit lane), the low nibbles against x's first 16
 * values and the high ones against its last 16 accumulated in the same int32 lanes (Q8_0:
 * quants 0..15 of both rows in one register, 16..31 in another): four lanes a row, reduced by
 * three horizontal adds to the 8 rows' exact block sums, against eight lanes a row and ten
 * reductions when each row's 32 quants fill a register (gguf_dot32x8). Then, per row and in
 * unit order, the GEMM's float operations (gguf_gemm.h), so the same bits. One Zen 4 thread,
 * weights hot, 1 / 2 / 4 / 8 rows of x, Q4_1 [3072+576+960, 576] + [576, 1536]: 0.135 / 0.191
 * / 0.331 / 0.516 -> 0.099 / 0.134 / 0.207 / 0.359 ms; Q8_0 the same shapes 0.117 / 0.180 /
 * 0.299 / 0.558 -> 0.114 / 0.146 / 0.229 / 0.411 (an AVX2-only build on the same CPU, Q8_0:
 * 0.155 / 0.241 / 0.381 -> 0.127 / 0.204 / 0.342). */
static inline __attribute__((always_inline)) void gguf_dot4x8(int qt, const uint8_t *const *wr,
                                                              int nu, const gguf_xq *x, int r0,
                                                              int nr, __m256 *acc,
                                                              const char *sweep) {
    const int bb = gguf_block_bytes(qt), qo = qt == GGUF_Q4_1 ? 4 : 2;
    const int has_min = qt == GGUF_Q4_1, q8 = qt == GGUF_Q8_0;
    const int q8_sign = q8 && !GGUF_Q8_BIASED; /* abs and sign (AVX2) */
    const int off = qt == GGUF_Q4_0 ? 8 : q8 && !q8_sign ? 128 : 0; /* taken off with x's sum */
    const __m256i low = _mm256_set1_epi8(0x0f);
    __m256 a[GGUF_ROW_TILE];
    for (int r = 0; r < nr; r++) a[r] = _mm256_setzero_ps();
    for (int u = 0; u < nu; u++) {
        __m256i lo[4], hi[4];
        const uint8_t *bs[8];
        for (int l = u * 8 * bb; l < (u + 1) * 8 * bb; l += 64)
            _mm_prefetch(sweep + l, _MM_HINT_T1);
        for (int i = 0; i < 8; i++) bs[i] = wr[i] + (int64_t)u * bb;
        for (int p = 0; p < 4; p++) {
            __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(bs[p] + qo))),
                _mm_loadu_si128((const __m128i *)(bs[p + 4] + qo)), 1);
            if (q8) { /* quants 0..15 of both rows, then 16..31 */
                __m256i w = _mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(bs[p] + 18))),
                    _mm_loadu_si128((const __m128i *)(bs[p + 4] + 18)), 1);
                const __m256i flip = _mm256_set1_epi8((char)0x80);
                lo[p] = q8_sign ? v : _mm256_xor_si256(v, flip);
                hi[p] = q8_sign ? w : _mm256_xor_si256(w, flip);
                continue;
            }
            lo[p] = _mm256_and_si256(v, low);
            hi[p] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        __m256 dw, mw;
        gguf_scales8(bs, &dw, &mw);
        for (int r = 0; r < nr; r++) {
            int64_t xr = (int64_t)(r0 + r) * x->nu + u;
            const __m128i *xp = (const __m128i *)(x->q + xr * 32);
            __m256i x0 = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp));
            __m256i x1 = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp + 1)), s[4];
            for (int p = 0; p < 4; p++) {
                if (q8_sign) {
                    s[p] = _mm256_add_epi32(
                        gguf_dot_us(_mm256_abs_epi8(lo[p]), _mm256_sign_epi8(x0, lo[p])),
                        gguf_dot_us(_mm256_abs_epi8(hi[p]), _mm256_sign_epi8(x1, hi[p])));
                    continue;
                }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                s[p] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo[p], x0),
                                           hi[p], x1);
#else
                s[p] = _mm256_add_epi32(gguf_dot_us(lo[p], x0), gguf_dot_us(hi[p], x1));
#endif
            }
            __m256i tot = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]),
                                            _mm256_hadd_epi32(s[2], s[3]));
            if (off) tot = _mm256_sub_epi32(tot, _mm256_set1_epi32(off * x->isum[xr]));
            a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot),
                                   _mm256_mul_ps(dw, _mm256_set1_ps(x->d[xr])), a[r]);
            if (has_min) a[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->s[xr]), a[r]);
        }
    }
    for (int r = 0; r < nr; r++) acc[r] = a[r];
}

/* Q5_0 / Q5_1, 8 weight rows (wr[0..7]) at once against nr rows of x: lane i of acc[r] is row
 * r's output for weight row i. Per unit: each row's 32 products summed to one exact int32 (the
 * 8 sums reduced together), then acc = fma(float(dot), dw * dx, acc) and for Q5_1 acc =
 * fma(mw, sum(x), acc): exactly the GEMM's per-output operations (gguf_gemm.h), so both give a
 * row the same bits. Unsigned raw quants against signed x, Q5_0's offset taken off with x's
 * integer sum (as the GEMM does). ~10 instructions per block and row against ~27 one weight
 * row at a time. (Q4_0, Q4_1 and Q8_0: gguf_dot4x8, above.) */
static inline __attribute__((always_inline)) void gguf_dot32x8(int qt, const uint8_t *const *wr,
                                                               int nu, const gguf_xq *x, int r0,
                                                               int nr, __m256 *acc,
                                                               const char *sweep) {
    const int bb = gguf_block_bytes(qt);
    const int off = qt == GGUF_Q5_0 ? 16 : 0; /* taken off with x's integer sum */
    const int has_min = qt == GGUF_Q5_1;
    __m256 a[GGUF_ROW_TILE]; /* in registers: acc may alias the loads (char pointers) */
    for (int r = 0; r < nr; r++) a[r] = _mm256_setzero_ps();
    /* `sweep`: the group of 8 rows read GGUF_PREFETCH_GROUPS groups further on (its 8 row
       lengths are one run of bytes: the rows are consecutive; gguf_rows_range), swept into L2,
       8 blocks' bytes a unit, each line once: the 8 rows read side by side span 8 row lengths,
       so a fixed distance shorter than that lands in rows this group is reading already */
    for (int u = 0; u < nu; u++) {
        __m256i q[8];
        const uint8_t *bs[8];
        for (int l = u * 8 * bb; l < (u + 1) * 8 * bb; l += 64)
            _mm_prefetch(sweep + l, _MM_HINT_T1);
        for (int i = 0; i < 8; i++) {
            const uint8_t *b = bs[i] = wr[i] + (int64_t)u * bb;
            if (qt == GGUF_Q5_0)
                q[i] = _mm256_or_si256(gguf_nib32(b + 6), gguf_bits32(b + 2));
            else /* Q5_1 */
                q[i] = _mm256_or_si256(gguf_nib32(b + 8), gguf_bits32(b + 4));
        }
        __m256 dw, mw; /* mw: the min where the type has one (else bytes of the quants) */
        gguf_scales8(bs, &dw, &mw);
        for (int r = 0; r < nr; r++) {
            int64_t xr = (int64_t)(r0 + r) * x->nu + u;
            __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + xr * 32)), p[8];
            for (int i = 0; i < 8; i++) p[i] = gguf_dot_us(q[i], xv);
            __m256i tot = nr <= 2 ? gguf_hsum8x8_blend(p) : gguf_hsum8x8(p);
            if (off) tot = _mm256_sub_epi32(tot, _mm256_set1_epi32(off * x->isum[xr]));
            a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot),
                                   _mm256_mul_ps(dw, _mm256_set1_ps(x->d[xr])), a[r]);
            if (has_min) a[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x->s[xr]), a[r]);
        }
    }
    for (int r = 0; r < nr; r++) acc[r] = a[r];
}

/* C(T, FN, N) for each row count N of x, 1..GGUF_ROW_TILE: a kernel compiled once per count,
 * so that its accumulators stay in registers (a runtime count kept them on the stack: 3x
 * slower at 4 rows) */
#define GGUF_EACH_NR(C, T, FN) C(T, FN, 1) C(T, FN, 2) C(T, FN, 3) C(T, FN, 4) \
    C(T, FN, 5) C(T, FN, 6) C(T, FN, 7) C(T, FN, 8)

#define GGUF_NR8(T, FN, N)                                                                     \
    case N:                                                                                    \
        FN(T, wr, nu, x, r0, N, acc, sweep);                                                   \
        break;
#define GGUF_CASE8(T, FN)                                                                      \
    case T:                                                                                    \
        switch (nr) { GGUF_EACH_NR(GGUF_NR8, T, FN) }                                          \
        break;

/* whether gguf_dot_rows8 takes qt (the 32-value block types) */
static inline int gguf_takes_x8(int qt) {
    return qt == GGUF_Q4_0 || qt == GGUF_Q4_1 || qt == GGUF_Q5_0 || qt == GGUF_Q5_1 ||
           qt == GGUF_Q8_0;
}

/* 8 weight rows against rows [r0, r0 + nr) of x, nr <= GGUF_ROW_TILE (compiled per nr) */
static void gguf_dot_rows8(int qt, const uint8_t *const *wr, int nu, const gguf_xq *x, int r0,
                           int nr, __m256 *acc, const char *sweep) {
    switch (qt) {
        GGUF_CASE8(GGUF_Q4_0, gguf_dot4x8)
        GGUF_CASE8(GGUF_Q4_1, gguf_dot4x8)
        GGUF_CASE8(GGUF_Q5_0, gguf_dot32x8)
        GGUF_CASE8(GGUF_Q5_1, gguf_dot32x8)
        GGUF_CASE8(GGUF_Q8_0, gguf_dot4x8)
    }
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
    /* intrinsics, not C arithmetic: -ffast-math may not reorder them differently for each
     * row count nr, so a row's result is the same bits in any batch */
    for (int r = 0; r < nr; r++)
        res[r] = _mm_cvtss_f32(_mm_add_ss(_mm_set_ss(gguf_hsum(acc[r])), _mm_set_ss(macc[r])));
}

/* one weight row against rows [r0, r0 + nr) of x (GGUF_EACH_NR: compiled per row count) */
#define GGUF_NR(T, FN, N)                                                                      \
    case N:                                                                                    \
        FN(T, w, x->nu, x, r0, N, res, NULL);                                                  \
        return;
#define GGUF_CASE(T, FN)                                                                       \
    case T:                                                                                    \
        switch (nr) { GGUF_EACH_NR(GGUF_NR, T, FN) }                                           \
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
#endif
