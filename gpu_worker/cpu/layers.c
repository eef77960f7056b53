/* The elementwise parts of a Llama layer on the CPU, one call each instead of 5-10 torch
 * ops: RMSNorm (optionally after the residual add), neox rotary in place, SiLU-and-multiply.
 * Float32 only. At decode sizes a torch op costs more in dispatch than in arithmetic; these
 * run over all rows in one OpenMP loop. Rows are parallel only when there are enough of
 * them to pay for waking the second thread.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/layers.py.
 */
#include <math.h>
#include <stdint.h>

#ifdef SHUTTLE_LIBMVEC
/* glibc's vector expf (libmvec) for the omp simd loops below: build.py's VECTOR_MATH */
#pragma omp declare simd notinbranch
float expf(float);
#endif

#define PAR_ROWS 16 /* fewer rows: one thread */

static void norm_row(const float *x, const float *w, float eps, float *out, int dim) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < dim; i++) ss += x[i] * x[i];
    float r = 1.0f / sqrtf(ss / (float)dim + eps);
#pragma omp simd
    for (int i = 0; i < dim; i++) out[i] = w[i] * (x[i] * r);
}

/* out = rmsnorm(x) * w; with `add`: sum = x + add is written to `sum` and normed instead.
 * Every row is contiguous, `dim` floats. */
void rms_norm(const float *x, const float *add, const float *w, float eps, float *out,
              float *sum, int rows, int dim, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (int64_t)r * dim;
        float *o = out + (int64_t)r * dim;
        if (add) {
            const float *ar = add + (int64_t)r * dim;
            float *sr = sum + (int64_t)r * dim;
#pragma omp simd
            for (int i = 0; i < dim; i++) sr[i] = xr[i] + ar[i];
            norm_row(sr, w, eps, o, dim);
        } else {
            norm_row(xr, w, eps, o, dim);
        }
    }
}

/* x [tokens, heads, head_dim] (token stride `stride` floats, heads contiguous) rotated in
 * place by position: pairs (i, i + head_dim/2), HF's rotate_half. cos/sin [positions, half]. */
void rotary_neox(float *x, const int64_t *positions, const float *cos_t, const float *sin_t,
                 int tokens, int heads, int head_dim, int64_t stride, int nthreads) {
    int half = head_dim / 2;
#pragma omp parallel for num_threads(nthreads) if (tokens >= PAR_ROWS)
    for (int t = 0; t < tokens; t++) {
        const float *c = cos_t + positions[t] * half, *s = sin_t + positions[t] * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * stride + (int64_t)h * head_dim, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* out [rows, n] = silu(gate_up[:, :n]) * gate_up[:, n:] */
void silu_mul(const float *gate_up, float *out, int rows, int n, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (rows >= PAR_ROWS)
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (int64_t)r * 2 * n, *u = g + n;
        float *o = out + (int64_t)r * n;
#pragma omp simd
        for (int i = 0; i < n; i++) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}
