/* int8 W8A8 linear layers on the CPU:
 *   y[b, o] = (sum_i xq[b, i] * w[o, i]) * w_scale[o] * x_scale[b] (+ bias[o])
 * with w int8 [out, in] quantized per output row (symmetric) and x quantized here per row,
 * dynamically: x_scale[b] = max|x[b, :]| / 127, xq = round(x * 127 / max|x[b, :]|) in
 * [-127, 127].
 * Each row has its own scale, so a sequence's output never depends on the rest of its batch:
 * the dot products are exact int32 sums, and every float step below is the same for a row
 * whatever the batch, whichever path (this kernel or oneDNN's, see int8.py) computed its sums.
 *
 * Dot products by the CPU's best integer instruction:
 *   AVX512-VNNI  vpdpbusd (u8 x s8 -> s32) on 64 bytes. Its first operand is unsigned, so the
 *                weight goes in as w ^ 0x80 = w + 128 (u8) and 128 * sum(xq[b]) is taken off.
 *   AVX-VNNI     the same instruction on 32 bytes, with |w| (u8) against xq signed by w.
 *   AVX2         vpmaddubsw on |w| (u8, <= 128) x sign(xq, w) (s8, |.| <= 127): pair sums stay
 *                under 32767 (no saturation), then vpmaddwd by ones to s32.
 *   otherwise    plain loops (gcc vectorizes what it can).
 * Rows of w are handed to the OpenMP threads in chunks, dynamically (other processes share
 * the cores); a chunk is read from memory once for every row of x.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/int8.py. A one-call
 * decode step can #include this file (beside linear.c) and call int8_linear_rows.
 */
/* the float steps (scales, bias) must round the same in every loop they are inlined into and
 * the same as torch's elementwise ops: no fast-math reassociation or fused multiply-add here
 * (push/pop: a file that #includes this one keeps its own options; names are i8_ / I8_) */
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) || defined(__AVXVNNI__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define I8_MAX_IN 131072 /* 127 * 128 * 131072 < 2**31 */
#define I8_CHUNK 64 /* weight rows per scheduling unit */
#define I8_MAX_NB 4 /* rows of x sharing each weight load */
/* weight rows per tile for one or two rows of x (half that for three or four): the
 * accumulators fill half the vector registers (32 with AVX-512, 16 with AVX2) */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_TW 8
#else
#define I8_TW 4
#endif

/* x_scale = max|x| / 127 and xq = round-half-even(x * (127 / max|x|)), as int8.py's torch
 * reference writes it; an all-zero row gets scale 0 and zeros. xsum = sum(xq) (VNNI's
 * correction). */
static void i8_quantize_row(const float *x, int in, int8_t *xq, float *x_scale, int32_t *xsum) {
    float amax = 0.f;
    for (int i = 0; i < in; i++) {
        float a = fabsf(x[i]);
        amax = a > amax ? a : amax;
    }
    float inv = amax > 0.f ? 127.f / amax : 0.f;
    int32_t s = 0;
    for (int i = 0; i < in; i++) {
        float q = nearbyintf(x[i] * inv);
        q = q > 127.f ? 127.f : (q < -127.f ? -127.f : q);
        xq[i] = (int8_t)q;
        s += (int32_t)q;
    }
    *x_scale = amax / 127.f;
    *xsum = s;
}

/* the one float epilogue of every path: ((float)acc * w_scale) * x_scale + bias, each step
 * rounded (int8_finish_rows applies it to oneDNN's sums; int8.py's torch path does the same
 * steps with torch's elementwise ops) */
static inline float i8_finish(float acc, float w_scale, float x_scale, const float *bias, int o) {
    float y = acc * w_scale * x_scale;
    return bias ? y + bias[o] : y;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* sums of weight rows w[0..tw) (stride in) with nb rows of xq (stride ldx) into acc[t][b]:
 * u8(w + 128) . xq, the 128 * sum(xq) taken off by the caller; the tail by masked loads */
static inline __attribute__((always_inline)) void i8_dots(
    const int8_t *w, int tw, const int8_t *xq, int nb, int in, int ldx,
    int32_t acc[I8_TW][I8_MAX_NB]) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i a[I8_TW][I8_MAX_NB];
    for (int t = 0; t < I8_TW; t++)
        for (int b = 0; b < I8_MAX_NB; b++) a[t][b] = _mm512_setzero_si512();
    for (int i = 0; i < in; i += 64) {
        __mmask64 m = in - i >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (in - i)) - 1);
        __m512i xv[I8_MAX_NB];
        for (int b = 0; b < I8_MAX_NB; b++)
            if (b < nb) xv[b] = _mm512_maskz_loadu_epi8(m, xq + (int64_t)b * ldx + i);
        for (int t = 0; t < I8_TW; t++) {
            if (t >= tw) break;
            /* masked-off bytes: w = 0 -> 128, against xq = 0 */
            __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + (int64_t)t * in + i),
                                          flip);
            for (int b = 0; b < I8_MAX_NB; b++)
                if (b < nb) a[t][b] = _mm512_dpbusd_epi32(a[t][b], wv, xv[b]);
        }
    }
    for (int t = 0; t < tw; t++)
        for (int b = 0; b < nb; b++) acc[t][b] = _mm512_reduce_add_epi32(a[t][b]);
}
#define I8_OFFSET 128
#elif defined(__AVXVNNI__) || defined(__AVX2__)
static inline __m256i i8_dot32(__m256i acc, __m256i wabs, __m256i xs) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, wabs, xs);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs),
                                                   _mm256_set1_epi16(1)));
#endif
}

/* |w| (u8) against xq carrying w's sign: exact, no offset; the tail in plain integers */
static inline __attribute__((always_inline)) void i8_dots(
    const int8_t *w, int tw, const int8_t *xq, int nb, int in, int ldx,
    int32_t acc[I8_TW][I8_MAX_NB]) {
    __m256i a[I8_TW][I8_MAX_NB];
    for (int t = 0; t < I8_TW; t++)
        for (int b = 0; b < I8_MAX_NB; b++) a[t][b] = _mm256_setzero_si256();
    int iv = in & ~31;
    for (int i = 0; i < iv; i += 32) {
        __m256i xv[I8_MAX_NB];
        for (int b = 0; b < I8_MAX_NB; b++)
            if (b < nb) xv[b] = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)b * ldx + i));
        for (int t = 0; t < I8_TW; t++) {
            if (t >= tw) break;
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (int64_t)t * in + i));
            __m256i wabs = _mm256_abs_epi8(wv); /* -128 -> 0x80 = 128 as u8 */
            for (int b = 0; b < I8_MAX_NB; b++)
                if (b < nb) a[t][b] = i8_dot32(a[t][b], wabs, _mm256_sign_epi8(xv[b], wv));
        }
    }
    for (int t = 0; t < tw; t++)
        for (int b = 0; b < nb; b++) {
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a[t][b]),
                                      _mm256_extracti128_si256(a[t][b], 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            int32_t r = _mm_cvtsi128_si32(s);
            const int8_t *wr = w + (int64_t)t * in, *xr = xq + (int64_t)b * ldx;
            for (int i = iv; i < in; i++) r += (int32_t)wr[i] * xr[i];
            acc[t][b] = r;
        }
}
#define I8_OFFSET 0
#else
static inline __attribute__((always_inline)) void i8_dots(
    const int8_t *w, int tw, const int8_t *xq, int nb, int in, int ldx,
    int32_t acc[I8_TW][I8_MAX_NB]) {
    for (int t = 0; t < tw; t++)
        for (int b = 0; b < nb; b++) {
            const int8_t *wr = w + (int64_t)t * in, *xr = xq + (int64_t)b * ldx;
            int32_t r = 0;
            for (int i = 0; i < in; i++) r += (int32_t)wr[i] * xr[i];
            acc[t][b] = r;
        }
}
#define I8_OFFSET 0
#endif

/* sums of weight rows [o, o + tw) with rows [b0, b0 + g) of x, then their epilogue */
static inline __attribute__((always_inline)) void i8_tile(
    const int8_t *xq, const float *xs, const int32_t *xsum, int b0, int g, int ldx,
    const int8_t *w, const float *w_scale, const float *bias, float *y, int out, int in, int o,
    int tw) {
    int32_t acc[I8_TW][I8_MAX_NB];
    i8_dots(w + (int64_t)o * in, tw, xq + (int64_t)b0 * ldx, g, in, ldx, acc);
    for (int t = 0; t < tw; t++)
        for (int b = 0; b < g; b++) {
            /* VNNI's sums carry +128 * sum(xq) and may wrap past int32 for long rows: the
             * difference is taken modulo 2**32 (unsigned: defined), exact as it fits */
            int32_t sum = (int32_t)((uint32_t)acc[t][b] - (uint32_t)(I8_OFFSET * xsum[b0 + b]));
            float a = (float)sum;
            y[(int64_t)(b0 + b) * out + o + t] =
                i8_finish(a, w_scale[o + t], xs[b0 + b], bias, o + t);
        }
}

/* weight rows [lo, hi) by rows [b0, b0 + G) of x: tiles of TW_G rows of w (as many as there
 * are registers for TW_G * G accumulators), then single rows; G and the tile sizes are
 * constants here, so the compiler unrolls the tiles into registers */
#define I8_ROWS_OF_W(G, TW_G)                                                               \
    static void i8_rows_of_w_##G(const int8_t *xq, const float *xs, const int32_t *xsum,     \
                                 int b0, int ldx, const int8_t *w, const float *w_scale,     \
                                 const float *bias, float *y, int out, int in, int lo,       \
                                 int hi) {                                                   \
        int o = lo;                                                                         \
        for (; o + TW_G <= hi; o += TW_G)                                                   \
            i8_tile(xq, xs, xsum, b0, G, ldx, w, w_scale, bias, y, out, in, o, TW_G);       \
        for (; o < hi; o++)                                                                 \
            i8_tile(xq, xs, xsum, b0, G, ldx, w, w_scale, bias, y, out, in, o, 1);          \
    }
I8_ROWS_OF_W(1, I8_TW)
I8_ROWS_OF_W(2, I8_TW)
I8_ROWS_OF_W(3, I8_TW / 2)
I8_ROWS_OF_W(4, I8_TW / 2)

/* weight rows [lo, hi) against every row of x, in groups of up to I8_MAX_NB rows of x */
static void i8_rows_of_w(const int8_t *xq, const float *xs, const int32_t *xsum, int nb,
                         int ldx, const int8_t *w, const float *w_scale, const float *bias,
                         float *y, int out, int in, int lo, int hi) {
    for (int b0 = 0; b0 < nb; b0 += I8_MAX_NB) {
        switch (nb - b0 < I8_MAX_NB ? nb - b0 : I8_MAX_NB) {
        case 1: i8_rows_of_w_1(xq, xs, xsum, b0, ldx, w, w_scale, bias, y, out, in, lo, hi); break;
        case 2: i8_rows_of_w_2(xq, xs, xsum, b0, ldx, w, w_scale, bias, y, out, in, lo, hi); break;
        case 3: i8_rows_of_w_3(xq, xs, xsum, b0, ldx, w, w_scale, bias, y, out, in, lo, hi); break;
        default: i8_rows_of_w_4(xq, xs, xsum, b0, ldx, w, w_scale, bias, y, out, in, lo, hi);
        }
    }
}

/* x [rows, in] float32 -> xq [rows, in] int8 and x_scale [rows]; returns 0, 1 on bad sizes */
int int8_quantize_rows(const float *x, int rows, int in, int8_t *xq, float *x_scale,
                       int nthreads) {
    if (rows < 1 || in < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int b = 0; b < rows; b++) {
        int32_t s;
        i8_quantize_row(x + (int64_t)b * in, in, xq + (int64_t)b * in, x_scale + b, &s);
    }
    return 0;
}

/* y [rows, out] = i8_finish(acc[rows, out]) in place: the epilogue for sums computed elsewhere
 * (oneDNN's, exact int32 sums as float32). Returns 0, 1 on bad sizes. */
int int8_finish_rows(float *y, int rows, const float *x_scale, const float *w_scale,
                     const float *bias, int out, int nthreads) {
    if (rows < 1 || out < 1) return 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if ((int64_t)rows * out > 65536)
    for (int b = 0; b < rows; b++) {
        float *yb = y + (int64_t)b * out;
        for (int o = 0; o < out; o++) yb[o] = i8_finish(yb[o], w_scale[o], x_scale[b], bias, o);
    }
    return 0;
}

/* y [rows, out] = int8 linear of x [rows, in] (float32) by w [out, in] int8 with w_scale [out]
 * (+ bias [out] or NULL). Returns 0; 1 on bad sizes (in > I8_MAX_IN among them); 2 when memory
 * ran out. */
int int8_linear_rows(const float *x, int rows, const int8_t *w, const float *w_scale,
                     const float *bias, float *y, int out, int in, int nthreads) {
    /* |sum| <= 127 * 128 * in must fit an int32 */
    if (rows < 1 || in < 1 || out < 1 || in > I8_MAX_IN) return 1;
    int8_t *xq = (int8_t *)malloc((size_t)rows * in);
    float *xs = (float *)malloc(sizeof(float) * (size_t)rows);
    int32_t *xsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)rows);
    if (!xq || !xs || !xsum) {
        free(xq), free(xs), free(xsum);
        return 2;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int b = 0; b < rows; b++)
        i8_quantize_row(x + (int64_t)b * in, in, xq + (int64_t)b * in, xs + b, xsum + b);
    int chunks = (out + I8_CHUNK - 1) / I8_CHUNK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int c = 0; c < chunks; c++) {
        int lo = c * I8_CHUNK, hi = lo + I8_CHUNK < out ? lo + I8_CHUNK : out;
        i8_rows_of_w(xq, xs, xsum, rows, in, w, w_scale, bias, y, out, in, lo, hi);
    }
    free(xq), free(xs), free(xsum);
    return 0;
}

#pragma GCC pop_options
