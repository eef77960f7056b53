/* MXFP4 linear rows: y[r, o] = sum over in of x[r, i] * W[o, i] (+ bias[o]) with W as gpt-oss
 * checkpoints store it (gpu_worker/cpu/mxfp4.py): per output row, groups of 32 values of 16
 * bytes (two E2M1 values a byte, the low nibble first) and one E8M0 exponent per group,
 * W[o, 32 g + j] = FP4[nibble j] * 2 ** (scales[o, g] - 127).
 *
 * Each group is dequantized once to 32 floats (unscaled) and dotted with every row's 32 values
 * in a fixed-size loop; the group's dot is then scaled and added to the row's sum, groups in
 * order. Every (row, output) pair runs the same operations in the same order whatever the
 * other rows of the call or the thread that takes it, so a row's result is the same bits
 * alone or in any batch.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#define GROUP 32
#define TILE 8 /* rows sharing one dequantized group */

static const float FP4[16] = {
    +0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

static inline void unpack_group(const uint8_t *bytes, float *w) {
    for (int i = 0; i < GROUP / 2; i++) {
        w[2 * i] = FP4[bytes[i] & 0x0F];
        w[2 * i + 1] = FP4[bytes[i] >> 4];
    }
}

static inline float dot_group(const float *w, const float *x) {
    float d = 0.0f;
#pragma omp simd reduction(+ : d)
    for (int j = 0; j < GROUP; j++) d += w[j] * x[j];
    return d;
}

/* x [rows, in] float32, blocks uint8 [out, in / 32, 16], scales uint8 [out, in / 32],
 * bias float32 [out] or NULL, y [rows, out] float32. Returns 0, or 2 for a bad shape. */
int mxfp4_linear_rows(const float *x, int rows, int in, const uint8_t *blocks,
                      const uint8_t *scales, const float *bias, int out, float *y, int nthreads) {
    if (in <= 0 || in % GROUP || rows < 0 || out <= 0) return 2;
    const int groups = in / GROUP;
    const int64_t work = (int64_t)out * in * (rows > 0 ? rows : 1);
#pragma omp parallel for schedule(static) num_threads(nthreads) if (work > (1 << 18))
    for (int o = 0; o < out; o++) {
        const uint8_t *brow = blocks + (int64_t)o * groups * (GROUP / 2);
        const uint8_t *srow = scales + (int64_t)o * groups;
        const float b = bias ? bias[o] : 0.0f;
        for (int r0 = 0; r0 < rows; r0 += TILE) {
            const int n = rows - r0 < TILE ? rows - r0 : TILE;
            float acc[TILE] = {0};
            float w[GROUP];
            for (int g = 0; g < groups; g++) {
                unpack_group(brow + (int64_t)g * (GROUP / 2), w);
                const float scale = ldexpf(1.0f, (int)srow[g] - 127);
                for (int r = 0; r < n; r++) {
                    const float d = dot_group(w, x + (int64_t)(r0 + r) * in + (int64_t)g * GROUP);
                    acc[r] += d * scale;
                }
            }
            for (int r = 0; r < n; r++) y[(int64_t)(r0 + r) * out + o] = acc[r] + b;
        }
    }
    return 0;
}

/* Dequantize: w [out, in] float32 from blocks and scales (the reference's values). */
int mxfp4_dequantize(const uint8_t *blocks, const uint8_t *scales, int out, int in, float *w) {
    if (in <= 0 || in % GROUP || out <= 0) return 2;
    const int groups = in / GROUP;
    for (int64_t o = 0; o < out; o++) {
        for (int g = 0; g < groups; g++) {
            float *dst = w + o * in + (int64_t)g * GROUP;
            unpack_group(blocks + (o * groups + g) * (GROUP / 2), dst);
            const float scale = ldexpf(1.0f, (int)scales[o * groups + g] - 127);
            for (int j = 0; j < GROUP; j++) dst[j] *= scale;
        }
    }
    return 0;
}
