/* The elementwise parts of a Llama layer on the CPU, one call each instead of 5-10 torch
 * ops: RMSNorm (optionally after the residual add), neox rotary in place, SiLU-and-multiply.
 * At decode sizes a torch op costs more in dispatch than in arithmetic; these run over all
 * rows in one OpenMP loop. Rows are parallel only when there are enough of them to pay for
 * waking the second thread.
 *
 * Tensors are float32, or bfloat16 with `bf16` (activations and weights alike; the rotary
 * tables stay float32). In bf16 every value is rounded where the torch modules they replace
 * (gpu_worker/models/llama.py, HF's Llama) round it, so the two agree up to the last bit of
 * an exp: the norm is computed in float32 and the normalized x rounded to bf16 before the
 * weight multiplies it; a residual sum is rounded; rotary multiplies by cos/sin rounded to
 * bf16 and rounds each product and the sum; SiLU's output is rounded before the multiply.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/layers.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"

#ifdef SHUTTLE_LIBMVEC
/* glibc's vector expf (libmvec) for the omp simd loops below: build.py's VECTOR_MATH */
#pragma omp declare simd notinbranch
float expf(float);
#endif


/* v rounded to the nearest bf16, as a float */
static inline float round_bf16(float v) { return bf16_to_f32(f32_to_bf16(v)); }

#define PAR_ROWS 16 /* fewer rows: one thread */

static void norm_row(const float *x, const float *w, float eps, float *out, int dim) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * r);
}

/* bf16 x (already summed), into bf16 out: weight * bf16(x * r) */
static void norm_row_bf16(const uint16_t *x, const uint16_t *w, float eps, uint16_t *out,
                          int dim) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; i++) ss += bf16_to_f32(x[i]) * bf16_to_f32(x[i]);
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_bf16(bf16_to_f32(x[i]) * r));
}

/* out = rmsnorm(x) * w; with `add`: sum = x + add is written to `sum` and normed instead.
 * Every row is contiguous, `dim` elements. */
void rms_norm(const void *x, const void *add, const void *w, float eps, void *out, void *sum,
              int rows, int dim, int nthreads, int bf16) {
#pragma omp parallel for num_threads(nthreads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        int64_t at = (int64_t)r * dim;
        if (bf16) {
            const uint16_t *xr = (const uint16_t *)x + at;
            uint16_t *o = (uint16_t *)out + at;
            if (add) {
                const uint16_t *ar = (const uint16_t *)add + at;
                uint16_t *sr = (uint16_t *)sum + at;
#pragma omp simd
                for (int i = 0; i < dim; i++)
                    sr[i] = f32_to_bf16(bf16_to_f32(xr[i]) + bf16_to_f32(ar[i]));
                xr = sr;
            }
            norm_row_bf16(xr, (const uint16_t *)w, eps, o, dim);
        } else {
            const float *xr = (const float *)x + at;
            float *o = (float *)out + at;
            if (add) {
                const float *ar = (const float *)add + at;
                float *sr = (float *)sum + at;
#pragma omp simd
                for (int i = 0; i < dim; i++) sr[i] = xr[i] + ar[i];
                xr = sr;
            }
            norm_row(xr, (const float *)w, eps, o, dim);
        }
    }
}

/* x [tokens, heads, head_dim] (token stride `stride` elements, heads contiguous) rotated in
 * place by position: pairs (i, i + rotary_dim/2) of each head's first rotary_dim dims, HF's
 * rotate_half; the dims past rotary_dim are left as they are (Phi-3's partial rotary).
 * cos/sin [positions, rotary_dim/2], float32 (rounded to bf16 here for a bf16 x, as the torch
 * path casts them). */
void rotary_neox(void *x, const int64_t *positions, const float *cos_t, const float *sin_t,
                 int tokens, int heads, int head_dim, int rotary_dim, int64_t stride,
                 int nthreads, int bf16) {
    int half = rotary_dim / 2;
#pragma omp parallel for num_threads(nthreads) if (tokens >= PAR_ROWS)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int h = 0; h < heads; h++) {
            int64_t at = t * stride + (int64_t)h * head_dim;
            if (bf16) {
                uint16_t *x1 = (uint16_t *)x + at, *x2 = x1 + half;
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    float a = bf16_to_f32(x1[i]), b = bf16_to_f32(x2[i]);
                    float ci = round_bf16(c[i]), si = round_bf16(s[i]);
                    x1[i] = f32_to_bf16(round_bf16(a * ci) - round_bf16(b * si));
                    x2[i] = f32_to_bf16(round_bf16(b * ci) + round_bf16(a * si));
                }
            } else {
                float *x1 = (float *)x + at, *x2 = x1 + half;
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    float a = x1[i], b = x2[i];
                    x1[i] = a * c[i] - b * s[i];
                    x2[i] = b * c[i] + a * s[i];
                }
            }
        }
    }
}

/* out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:] */
void silu_mul(const void *gate_up, void *out, int rows, int n, int nthreads, int bf16) {
#pragma omp parallel for num_threads(nthreads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        if (bf16) {
            const uint16_t *g = (const uint16_t *)gate_up + (int64_t)r * 2 * n, *u = g + n;
            uint16_t *o = (uint16_t *)out + (int64_t)r * n;
#pragma omp simd
            for (int i = 0; i < n; i++) {
                float gi = bf16_to_f32(g[i]);
                o[i] = f32_to_bf16(round_bf16(gi / (1.0f + expf(-gi))) * bf16_to_f32(u[i]));
            }
        } else {
            const float *g = (const float *)gate_up + (int64_t)r * 2 * n, *u = g + n;
            float *o = (float *)out + (int64_t)r * n;
#pragma omp simd
            for (int i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
    }
}
