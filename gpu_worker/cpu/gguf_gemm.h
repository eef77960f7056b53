/* Many rows of x against a 32-value GGUF block type (Q4_0, Q4_1, Q5_0, Q5_1; Q8_0 where the
 * CPU has VNNI): an int8 GEMM on the weights' own blocks. Included by gguf.c: static only.
 * 16-lane tiles against 8-lane ones on Sapphire Rapids (one thread, Q4_1 [1536, 576], 256
 * rows): 1.62 vs 2.13 ms.
 *
 * A tile of 8 weight rows (16 with AVX-512 VNNI) is unpacked once (L1-resident) with its bytes
 * transposed so that a register holds 4 consecutive bytes of each row: one `vpdpbusd` then
 * adds 4 products to each of 8 (16) outputs, against 4 bytes of x broadcast. x (quantized per
 * row as in the few-row kernel) goes as the unsigned operand, x + 128; the weights' quants as
 * the signed one (raw quants, <= 31, or Q8_0's int8). So
 *     dot(x, q - off) = dpbusd(x + 128, q) - 128 * sum(q) - off * sum(x)
 * with off 8 / 16 for Q4_0 / Q5_0, 0 otherwise (128 for Q8_0 is its own int8). Without VNNI,
 * maddubs's int16 pairs would saturate on Q8_0 (255 * 127 * 2): the caller gets 1 back.
 * Each output is then a float sum over blocks in block order, per row: a row's result does not
 * depend on the other rows of its batch.
 */
#ifndef SHUTTLE_GGUF_GEMM_H
#define SHUTTLE_GGUF_GEMM_H
#include <stdint.h>

#include "gguf.h"
#include "gguf_rows.h"
#if defined(__AVX2__)
#include <immintrin.h>

/* GGUF_GW weight rows per tile: 16 in AVX-512 registers where the CPU has 512-bit VNNI, else 8.
 * GGUF_GEMM_R rows of x per register tile: 6 in AVX-512's 32 registers (12 dot sums, 6 float
 * ones), 4 in AVX2's 16. One Zen 4 thread, Q4_1 [1536, 576] / Q8_0 [576, 1536] at 512 rows, the
 * 16-lane tile at 4 rows a pass: ~180 / ~210 GOPS; at 6: ~250 / ~300 (8 rows spill: ~105).
 * `vpdpbusd` zmm runs one a cycle there, sharing its pipes with the float FMAs. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define GGUF_GW 16
#define GGUF_GEMM_R 6
typedef __m512i gguf_gvi;
typedef __m512 gguf_gvf;
#define GV_ZERO() _mm512_setzero_si512()
#define GV_SET1 _mm512_set1_epi32
#define GV_ADD _mm512_add_epi32
#define GV_SUB _mm512_sub_epi32
#define GV_DOT _mm512_dpbusd_epi32
#define GF_ZERO() _mm512_setzero_ps()
#define GF_SET1 _mm512_set1_ps
#define GF_LOADU _mm512_loadu_ps
#define GF_STOREU _mm512_storeu_ps
#define GF_MUL _mm512_mul_ps
#define GF_FMA _mm512_fmadd_ps
#define GF_CVT _mm512_cvtepi32_ps
#else
#define GGUF_GW 8
#define GGUF_GEMM_R 4
typedef __m256i gguf_gvi;
typedef __m256 gguf_gvf;
#define GV_ZERO() _mm256_setzero_si256()
#define GV_SET1 _mm256_set1_epi32
#define GV_ADD _mm256_add_epi32
#define GV_SUB _mm256_sub_epi32
#define GV_DOT gguf_dot_us_acc
#define GF_ZERO() _mm256_setzero_ps()
#define GF_SET1 _mm256_set1_ps
#define GF_LOADU _mm256_loadu_ps
#define GF_STOREU _mm256_storeu_ps
#define GF_MUL _mm256_mul_ps
#define GF_FMA _mm256_fmadd_ps
#define GF_CVT _mm256_cvtepi32_ps
#endif

/* one unit of GGUF_GW weight rows, transposed: t[g] lane i = bytes 4g..4g+3 of row i */
typedef struct {
    gguf_gvi t[8];
    gguf_gvi wsum128; /* 128 * the sum of each row's quants */
    gguf_gvf d, m;    /* each row's scale and min */
} gguf_tile_unit;

static inline void gguf_transpose8x8(const __m256i *q, __m256i *t) {
    __m256i a[8], b[8];
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm256_unpacklo_epi32(q[2 * i], q[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(q[2 * i], q[2 * i + 1]);
    }
    for (int h = 0; h < 2; h++) { /* rows 0-3, then 4-7 */
        __m256i *ah = a + 4 * h, *bh = b + 4 * h;
        bh[0] = _mm256_unpacklo_epi64(ah[0], ah[2]); /* groups 0 | 4 */
        bh[1] = _mm256_unpackhi_epi64(ah[0], ah[2]); /* 1 | 5 */
        bh[2] = _mm256_unpacklo_epi64(ah[1], ah[3]); /* 2 | 6 */
        bh[3] = _mm256_unpackhi_epi64(ah[1], ah[3]); /* 3 | 7 */
    }
    for (int g = 0; g < 4; g++) {
        t[g] = _mm256_permute2x128_si256(b[g], b[g + 4], 0x20);
        t[g + 4] = _mm256_permute2x128_si256(b[g], b[g + 4], 0x31);
    }
}

/* 8 rows from o0 (the last one repeated past `out`), unit u: transposed quants and sums */
static void gguf_gemm_unpack8(int qt, const uint8_t *w, int64_t row_bytes, int o0, int out,
                              int u, __m256i *t, __m256i *wsum, float *d, float *m) {
    const int bb = gguf_block_bytes(qt);
    __m256i q[8];
    for (int i = 0; i < 8; i++) {
        int o = o0 + i < out ? o0 + i : out - 1;
        const uint8_t *b = w + (int64_t)o * row_bytes + (int64_t)u * bb;
        d[i] = gguf_half(b);
        m[i] = qt == GGUF_Q4_1 || qt == GGUF_Q5_1 ? gguf_half(b + 2) : 0.f;
        if (qt == GGUF_Q8_0) q[i] = _mm256_loadu_si256((const __m256i *)(b + 2));
        else if (qt == GGUF_Q4_0) q[i] = gguf_nib32(b + 2);
        else if (qt == GGUF_Q4_1) q[i] = gguf_nib32(b + 4);
        else if (qt == GGUF_Q5_0)
            q[i] = _mm256_or_si256(gguf_nib32(b + 6), gguf_bits32(b + 2));
        else q[i] = _mm256_or_si256(gguf_nib32(b + 8), gguf_bits32(b + 4));
    }
    gguf_transpose8x8(q, t);
    __m256i s = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++) /* signed bytes summed per lane: maddubs(1, q) then madd */
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), t[g]),
                                                  _mm256_set1_epi16(1)));
    *wsum = _mm256_slli_epi32(s, 7);
}

#if GGUF_GW == 16
/* 16 rows' 16 bytes (row i at p[i]) transposed as 4-byte groups: t[k] lane i = bytes 4k..4k+3
 * of row i (a 4 x 4 transpose of 32-bit words in each 128-bit lane, rows 4L..4L+3 in lane L) */
static inline void gguf_transpose16x16b(const uint8_t *const *p, __m512i *t) {
    __m512i q[4];
    for (int r = 0; r < 4; r++) {
        q[r] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)p[r]));
        q[r] = _mm512_inserti32x4(q[r], _mm_loadu_si128((const __m128i *)p[4 + r]), 1);
        q[r] = _mm512_inserti32x4(q[r], _mm_loadu_si128((const __m128i *)p[8 + r]), 2);
        q[r] = _mm512_inserti32x4(q[r], _mm_loadu_si128((const __m128i *)p[12 + r]), 3);
    }
    __m512i a0 = _mm512_unpacklo_epi32(q[0], q[1]), a1 = _mm512_unpackhi_epi32(q[0], q[1]);
    __m512i a2 = _mm512_unpacklo_epi32(q[2], q[3]), a3 = _mm512_unpackhi_epi32(q[2], q[3]);
    t[0] = _mm512_unpacklo_epi64(a0, a2);
    t[1] = _mm512_unpackhi_epi64(a0, a2);
    t[2] = _mm512_unpacklo_epi64(a1, a3);
    t[3] = _mm512_unpackhi_epi64(a1, a3);
}

/* gguf_gemm_unpack's unit u for Q4_0, Q4_1 and Q8_0 on 16 rows: whole registers, no per-row
 * nibble unpacking or 8 x 8 transposes; the same bytes, sums and scales */
static void gguf_gemm_unpack16(int qt, const uint8_t *w, int64_t row_bytes, int o0, int out,
                               int u, gguf_tile_unit *tu) {
    const int bb = gguf_block_bytes(qt), qo = qt == GGUF_Q4_1 ? 4 : 2;
    const uint8_t *p[16];
    int32_t at[16];
    for (int i = 0; i < 16; i++) {
        int o = o0 + i < out ? o0 + i : out - 1;
        at[i] = (int32_t)((o - o0) * row_bytes);
    }
    const uint8_t *b0 = w + (int64_t)o0 * row_bytes + (int64_t)u * bb;
    for (int i = 0; i < 16; i++) p[i] = b0 + at[i] + qo;
    if (qt == GGUF_Q8_0) {
        gguf_transpose16x16b(p, tu->t);
        for (int i = 0; i < 16; i++) p[i] += 16;
        gguf_transpose16x16b(p, tu->t + 4);
    } else {
        __m512i r[4], lo = _mm512_set1_epi8(0x0f);
        gguf_transpose16x16b(p, r);
        for (int k = 0; k < 4; k++) {
            tu->t[k] = _mm512_and_si512(r[k], lo);
            tu->t[k + 4] = _mm512_and_si512(_mm512_srli_epi16(r[k], 4), lo);
        }
    }
    __m512i s = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
    for (int g = 0; g < 8; g++) s = _mm512_dpbusd_epi32(s, ones, tu->t[g]);
    tu->wsum128 = _mm512_slli_epi32(s, 7);
    __m512i dm = _mm512_i32gather_epi32(_mm512_loadu_si512(at), b0, 1);
    tu->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    tu->m = qt == GGUF_Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)))
                            : _mm512_setzero_ps();
}
#endif

/* rows [o0, o0 + GGUF_GW) of w unpacked into tile[nu] */
static void gguf_gemm_unpack(int qt, const uint8_t *w, int64_t row_bytes, int o0, int out, int nu,
                             gguf_tile_unit *tile) {
#if GGUF_GW == 16
    if (qt == GGUF_Q4_0 || qt == GGUF_Q4_1 || qt == GGUF_Q8_0) {
        for (int u = 0; u < nu; u++) gguf_gemm_unpack16(qt, w, row_bytes, o0, out, u, tile + u);
        return;
    }
#endif
    for (int u = 0; u < nu; u++) {
        __m256i t[GGUF_GW / 8][8], ws[GGUF_GW / 8];
        float d[GGUF_GW], m[GGUF_GW];
        for (int h = 0; h < GGUF_GW / 8; h++)
            gguf_gemm_unpack8(qt, w, row_bytes, o0 + 8 * h, out, u, t[h], ws + h, d + 8 * h,
                              m + 8 * h);
        gguf_tile_unit *tu = tile + u;
#if GGUF_GW == 16
        for (int g = 0; g < 8; g++)
            tu->t[g] = _mm512_inserti64x4(_mm512_castsi256_si512(t[0][g]), t[1][g], 1);
        tu->wsum128 = _mm512_inserti64x4(_mm512_castsi256_si512(ws[0]), ws[1], 1);
#else
        for (int g = 0; g < 8; g++) tu->t[g] = t[0][g];
        tu->wsum128 = ws[0];
#endif
        tu->d = GF_LOADU(d);
        tu->m = GF_LOADU(m);
    }
}

static inline __m256i gguf_dot_us_acc(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* rows [r0, r0 + GGUF_GEMM_R) of x (the last one repeated past `rows`) against a tile:
 * y[r, o0 .. o0 + GGUF_GW) */
static inline __attribute__((always_inline)) void gguf_gemm_rows(
    int qt, const gguf_tile_unit *tile, const gguf_xq *x, int r0, int rows, int o0, int out,
    const float *bias, float *y) {
    const int off = qt == GGUF_Q4_0 ? 8 : qt == GGUF_Q5_0 ? 16 : 0, nu = x->nu;
    int rr[GGUF_GEMM_R];
    gguf_gvf acc[GGUF_GEMM_R];
    for (int j = 0; j < GGUF_GEMM_R; j++) {
        rr[j] = r0 + j < rows ? r0 + j : rows - 1;
        acc[j] = GF_ZERO();
    }
    for (int u = 0; u < nu; u++) {
        const gguf_tile_unit *tu = tile + u;
        const int32_t *xb[GGUF_GEMM_R];
        gguf_gvi p[GGUF_GEMM_R][2];
        for (int j = 0; j < GGUF_GEMM_R; j++) {
            xb[j] = (const int32_t *)(x->xu + ((int64_t)rr[j] * nu + u) * 32);
            p[j][0] = p[j][1] = GV_ZERO();
        }
        /* each group of weight bytes loaded once for all rows; two sums per row (latency) */
        for (int g = 0; g < 8; g++) {
            gguf_gvi tg = tu->t[g];
            for (int j = 0; j < GGUF_GEMM_R; j++)
                p[j][g & 1] = GV_DOT(p[j][g & 1], GV_SET1(xb[j][g]), tg);
        }
        for (int j = 0; j < GGUF_GEMM_R; j++) {
            int64_t xr = (int64_t)rr[j] * nu + u;
            gguf_gvi q = GV_SUB(GV_ADD(p[j][0], p[j][1]), tu->wsum128);
            if (off) q = GV_SUB(q, GV_SET1(off * x->isum[xr]));
            acc[j] = GF_FMA(GF_CVT(q), GF_MUL(tu->d, GF_SET1(x->d[xr])), acc[j]);
            if (qt == GGUF_Q4_1 || qt == GGUF_Q5_1)
                acc[j] = GF_FMA(tu->m, GF_SET1(x->s[xr]), acc[j]);
        }
    }
    for (int j = 0; j < GGUF_GEMM_R && r0 + j < rows; j++) {
        float v[GGUF_GW];
        GF_STOREU(v, acc[j]);
        for (int i = 0; i < GGUF_GW && o0 + i < out; i++)
            y[(int64_t)(r0 + j) * out + o0 + i] = v[i] + (bias ? bias[o0 + i] : 0.f);
    }
}

/* whether the GEMM takes qt in this build */
static inline int gguf_gemm_takes(int qt) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__) || defined(__AVXVNNI__)
    if (qt == GGUF_Q8_0) return 1;
#endif
    return qt == GGUF_Q4_0 || qt == GGUF_Q4_1 || qt == GGUF_Q5_0 || qt == GGUF_Q5_1;
}
#endif
#endif
