/* GGUF (ggml) block formats, scalar: block sizes, fp16, and one block dequantized to float32.
 *
 * Each format stores a row of a weight matrix as blocks, exactly as ggml writes them (see
 * gguf-py's gguf/quants.py); d, m, dmin are fp16, little-endian:
 *
 *   Q4_0  32 values, 18 B: d, qs[16]            w = d * (q - 8), q = nibble (lo: 0..15, hi: 16..31)
 *   Q4_1  32 values, 20 B: d, m, qs[16]         w = d * q + m
 *   Q5_0  32 values, 22 B: d, qh[4], qs[16]     w = d * (q - 16)   q = nibble | bit j of qh << 4
 *   Q5_1  32 values, 24 B: d, m, qh[4], qs[16]  w = d * q + m
 *   Q8_0  32 values, 34 B: d, qs[32] (int8)     w = d * q
 *   Q4_K 256 values, 144 B: d, dmin, scales[12], qs[128]
 *        8 sub-blocks of 32 with 6-bit (sc, m): w = d*sc * q - dmin*m;
 *        sub-block s takes the low (s even) or high nibbles of qs[32*(s/2) .. +32]
 *   Q5_K 256 values, 176 B: d, dmin, scales[12], qh[32], qs[128]: as Q4_K, q |= bit s of qh[l] << 4
 *   Q6_K 256 values, 210 B: ql[128], qh[64], scales[16] (int8, one per 16 values), d
 *        w = d*scale * (q - 32), q = 4 bits of ql | 2 bits of qh << 4 (gguf_dequant_block)
 *
 * Included by gguf.c (and through it by any C source that includes gguf.c): static only.
 */
#ifndef SHUTTLE_GGUF_H
#define SHUTTLE_GGUF_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

/* gguf.GGMLQuantizationType values */
enum {
    GGUF_Q4_0 = 2,
    GGUF_Q4_1 = 3,
    GGUF_Q5_0 = 6,
    GGUF_Q5_1 = 7,
    GGUF_Q8_0 = 8,
    GGUF_Q4_K = 12,
    GGUF_Q5_K = 13,
    GGUF_Q6_K = 14,
};

/* values per block, 0 for a type these kernels do not take */
static inline int gguf_block_values(int qtype) {
    switch (qtype) {
    case GGUF_Q4_0: case GGUF_Q4_1: case GGUF_Q5_0: case GGUF_Q5_1: case GGUF_Q8_0: return 32;
    case GGUF_Q4_K: case GGUF_Q5_K: case GGUF_Q6_K: return 256;
    default: return 0;
    }
}

static inline int gguf_block_bytes(int qtype) {
    switch (qtype) {
    case GGUF_Q4_0: return 18;
    case GGUF_Q4_1: return 20;
    case GGUF_Q5_0: return 22;
    case GGUF_Q5_1: return 24;
    case GGUF_Q8_0: return 34;
    case GGUF_Q4_K: return 144;
    case GGUF_Q5_K: return 176;
    case GGUF_Q6_K: return 210;
    default: return 0;
    }
}

/* the fp16 at p (unaligned, little-endian) as float32, exactly */
static inline float gguf_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    float f;
    if (e == 0) { /* zero or subnormal: man * 2^-24 */
        f = (float)man * (1.0f / 16777216.0f);
        return sign ? -f : f;
    }
    u = sign | (e == 31 ? 0x7f800000u | (man << 13) : ((e + 112u) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
#endif
}

/* Q4_K/Q5_K sub-block j's 6-bit scale and min from the 12 packed bytes */
static inline void gguf_k_scale_min(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* the 32 values of a Q4_0/Q4_1/Q5_0/Q5_1 block's quants (0..15 or 0..31) */
static inline void gguf_small_quants(const uint8_t *qs, const uint8_t *qh, uint8_t *q) {
    uint32_t h = 0;
    if (qh) memcpy(&h, qh, 4);
    for (int j = 0; j < 16; j++) {
        q[j] = (uint8_t)((qs[j] & 0x0f) | (((h >> j) & 1u) << 4));
        q[j + 16] = (uint8_t)((qs[j] >> 4) | (((h >> (j + 16)) & 1u) << 4));
    }
}

__attribute__((unused)) static void gguf_dequant_k(const uint8_t *b, int qtype, float *y) {
    if (qtype == GGUF_Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        float d = gguf_half(b + 208);
        for (int e = 0; e < 256; e++) {
            int h = e / 128, r = e % 128, k = r / 32, l = r % 32;
            int lo = (ql[h * 64 + (k & 1) * 32 + l] >> (4 * (k >> 1))) & 0x0f;
            int hi = (qh[h * 32 + l] >> (2 * k)) & 3;
            y[e] = d * (float)sc[e / 16] * (float)((lo | (hi << 4)) - 32);
        }
        return;
    }
    float d = gguf_half(b), dmin = gguf_half(b + 2);
    const uint8_t *scales = b + 4, *qh = qtype == GGUF_Q5_K ? b + 16 : NULL;
    const uint8_t *qs = qtype == GGUF_Q5_K ? b + 48 : b + 16;
    for (int s = 0; s < 8; s++) {
        int sc, m;
        gguf_k_scale_min(scales, s, &sc, &m);
        float ds = d * (float)sc, ms = dmin * (float)m;
        for (int l = 0; l < 32; l++) {
            int q = (qs[32 * (s / 2) + l] >> (4 * (s & 1))) & 0x0f;
            if (qh) q |= ((qh[l] >> s) & 1) << 4;
            y[32 * s + l] = ds * (float)q - ms;
        }
    }
}

/* one block of `qtype` at b as gguf_block_values(qtype) floats */
__attribute__((unused)) static void gguf_dequant_block(const uint8_t *b, int qtype, float *y) {
    uint8_t q[32];
    float d = gguf_half(b);
    switch (qtype) {
    case GGUF_Q8_0:
        for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
        return;
    case GGUF_Q4_0:
        gguf_small_quants(b + 2, NULL, q);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(q[j] - 8);
        return;
    case GGUF_Q5_0:
        gguf_small_quants(b + 6, b + 2, q);
        for (int j = 0; j < 32; j++) y[j] = d * (float)(q[j] - 16);
        return;
    case GGUF_Q4_1:
    case GGUF_Q5_1: {
        float m = gguf_half(b + 2);
        int five = qtype == GGUF_Q5_1;
        gguf_small_quants(b + (five ? 8 : 4), five ? b + 4 : NULL, q);
        for (int j = 0; j < 32; j++) y[j] = d * (float)q[j] + m;
        return;
    }
    default:
        gguf_dequant_k(b, qtype, y);
    }
}

/* The most rows of x the few-row kernel takes (gguf.py's few_rows, moe.c); more go to the int8
 * GEMM where it takes the type. Q4_0, Q4_1 and Q8_0 up to 8 (one pass of GGUF_ROW_TILE rows):
 * 2 threads on a Zen 4 VM (tools/benchmarks/gguf_kernels.py, weights hot), Q4_1 [1536, 576]
 * at 6 / 8 / 12 rows few-row 0.048 / 0.057 / 0.085 ms against the GEMM's 0.055 / 0.073 /
 * 0.074, Q8_0 [49152, 576] 1.84 / 2.40 / 3.59 against 3.02 / 3.53 / 3.55; the other types 4.
 * Where the GEMM runs on AMX tiles, gguf.c's gguf_few_rows_here doubles the 8. */
static inline int gguf_few_rows(int qtype) {
    return qtype == GGUF_Q4_0 || qtype == GGUF_Q4_1 || qtype == GGUF_Q8_0 ? 8 : 4;
}

/* x's rows quantized per 32 values, the int8 kernels' other operand (gguf.c fills it,
 * gguf_rows.h and gguf_gemm.h read it) */
#define GGUF_ROW_TILE 8 /* rows of x per pass over a chunk of weight rows */
#ifndef GGUF_PREFETCH
/* bytes of weights ahead of the block being read, prefetched: one thread streaming SmolLM2's
 * Q4_1 weights (CPU time, busy Sapphire Rapids): 18.5 ms with none, 12.8 (512 B), 11.4 (1 KB),
 * 10.2 (2 KB), 10.3 (4 KB) */
#define GGUF_PREFETCH 2048
#endif
#ifndef GGUF_PREFETCH_GROUPS
/* the 8-row kernel (gguf_dot_rows8) prefetches the rows this many groups of 8 ahead instead: a
 * 213 MB Q4_1 / Q8_0 matrix streamed from DRAM at one row of x, 2 threads (Sapphire Rapids,
 * 25 GB/s): 12.4 / 15.5 GB/s with 2 KB ahead, 17.7-19.0 / 20.6-23.2 with 3-4 groups; matrices
 * that stay in the last-level cache unchanged. Each line of that group once, into L2, rather
 * than each row's block into L1 (one prefetch per row and unit, most of them repeats of a
 * line): a 200 MB matrix on a Zen 4 VM (DRAM 33 GB/s by a plain sum), 2 threads, Q4_1 14.4 ->
 * 19.6-23.6 GB/s, Q8_0 13.5 -> 26.0-26.9 (medians of 10; one thread 8.9 -> 13.5-14.4 and 7.5
 * -> 18.6-20.8) */
#define GGUF_PREFETCH_GROUPS 4
#endif

/* rows of x quantized per 32 values: q [rows, in], d and s [rows, in / 32] */
typedef struct {
    int8_t *q;
    float *d; /* the block's scale: x ~= d * q */
    /* the block's sum of the rounded x, d * sum(q) (llama.cpp's Q8_1 s): a weight's min term
     * (Q4_1, Q5_1, K-quants) multiplies the same rounded activations as its scale term, so
     * their rounding errors cancel as in the exact product. With the exact float sum
     * instead, a Q4_1 layer's output was 2-3x further from x @ W.T (the min is about -8 d:
     * the rounding error weighted by q in 0..15 no longer cancels), SmolLM2's Q4_1 file
     * 1.2% above its float32 perplexity against llama.cpp's 0.2% */
    float *s;
    uint8_t *xu;   /* q + 128 (the GEMM's unsigned operand) */
    /* NULL; or for the AMX GEMM, x's int8 in tiles of 16 rows, [rows / 16][nu][16][32]
     * (then q and xu are NULL) */
    int8_t *qa;
    int32_t *isum; /* the block's sum of q */
    int in, nu;
} gguf_xq;

#endif
