/* Every decoder layer of a float32 Llama-family model for a decode step of a few sequences,
 * in one call: no interpreter between the kernels.
 *
 * A decode step of one sequence is ~20 ms of weight reads and, run layer by layer from
 * Python, ~6 ms of torch dispatch, tensor bookkeeping and ctypes calls around ~10 kernels per
 * layer (docs/benchmarks.md, "Peers": the step account). This runs the same kernels in the
 * same order with the same arithmetic, so its output equals the layer-by-layer path's bit
 * for bit (tests/unit/test_cpu_decode_step.py):
 *
 *   h = rmsnorm(x) w_in;  qkv = h Wqkv^T (+b);  rotate q, k;  k, v -> cache slots
 *   a = paged attention(q);  x += a Wo^T (+b);  h = rmsnorm(x) w_post
 *   x += (silu(h Wg^T) * (h Wu^T)) Wd^T          (gate and up are one weight, [2I, hidden])
 *
 * x [n, hidden] is the residual stream, updated in place; what comes out is the input of the
 * final norm. The kernels are linear.c, layers.c and cpu_paged_decode.c, compiled in here.
 *
 * A bfloat16 model (w_bf16, kv_bf16) runs the same loop with bf16 linear weights (linear.c's
 * bf16 path) and a bf16 cache (K/V rounded to nearest even as they are stored, as torch
 * rounds); activations stay float32 between the kernels, where torch's bf16 layers round
 * each op's output to bf16, so it equals that path only within bf16's precision
 * (tests/unit/test_cpu_decode_step.py bounds it).
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/decode_step.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.c"
#include "layers.c"
#include "../attention/cpu_paged_decode.c"

/* K (and as many V) elements below which one thread attends: gpu_worker/attention/
 * cpu_kernel.py's SMALL_WORK, the same choice */
#define ATTEND_SMALL_WORK (1 << 18)

/* One layer's weights: the linears' in nn.Linear's [out, in] layout, contiguous, float32 or
 * bfloat16 (decode_forward's w_bf16); norms' weights and biases float32; biases may be NULL */
typedef struct {
    const float *input_norm, *qkv_w, *qkv_b, *o_w, *o_b;
    const float *post_norm, *gate_up_w, *gate_up_b, *down_w, *down_b;
} decode_layer_t;

/* Returns 0; 1 when the shapes are outside what it takes (n > MAX_ROWS), 2 when memory ran
 * out or a kernel refused (the caller runs the layers one by one). kv_base is the cache
 * [layers, 2, blocks, bs, kvh, d] (float32, or bf16 with kv_bf16): layer l's K at
 * l * layer_stride, its V half_stride further (elements). */
int decode_forward(const decode_layer_t *layers, int num_layers, float *x, int n, int hidden,
                   int heads, int kvh, int d, int inter, float eps, const float *cos_t,
                   const float *sin_t, const int64_t *positions, const int64_t *slots,
                   void *kv_base, int64_t layer_stride, int64_t half_stride,
                   const int32_t *tables, int table_stride, const int32_t *seq_lens, int bs,
                   float scale, int w_bf16, int kv_bf16, int nthreads) {
    if (n < 1 || n > MAX_ROWS || heads % kvh != 0) return 1;
    int q_size = heads * d, kv_size = kvh * d, qkv_size = q_size + 2 * kv_size;
    int64_t work = 0;
    for (int i = 0; i < n; i++) work += (int64_t)seq_lens[i] * kv_size;
    int attend_threads = work < ATTEND_SMALL_WORK ? 1 : nthreads;
    size_t floats = (size_t)n * (2 * hidden + qkv_size + 2 * q_size + 3 * inter);
    float *buf = malloc(sizeof(float) * floats);
    if (!buf) return 2;
    float *h = buf, *qkv = h + (size_t)n * hidden, *q = qkv + (size_t)n * qkv_size;
    float *att = q + (size_t)n * q_size, *proj = att + (size_t)n * q_size;
    float *gate_up = proj + (size_t)n * hidden, *act = gate_up + (size_t)n * 2 * inter;
    int code = 0;
    for (int l = 0; l < num_layers && code == 0; l++) {
        const decode_layer_t *w = layers + l;
        int64_t size = kv_bf16 ? 2 : 4;
        char *k_cache = (char *)kv_base + l * layer_stride * size;
        char *v_cache = k_cache + half_stride * size;
        rms_norm(x, NULL, w->input_norm, eps, h, NULL, n, hidden, nthreads, 0);
        code |= linear_small(h, n, w->qkv_w, w_bf16, w->qkv_b, qkv, qkv_size, hidden, nthreads);
        rotary_neox(qkv, positions, cos_t, sin_t, n, heads, d, qkv_size, nthreads, 0);
        rotary_neox(qkv + q_size, positions, cos_t, sin_t, n, kvh, d, qkv_size, nthreads, 0);
        for (int i = 0; i < n; i++) {
            const float *row = qkv + (size_t)i * qkv_size;
            memcpy(q + (size_t)i * q_size, row, sizeof(float) * q_size);
            const float *k = row + q_size, *v = k + kv_size;
            if (kv_bf16) {
                uint16_t *kd = (uint16_t *)k_cache + slots[i] * kv_size;
                uint16_t *vd = (uint16_t *)v_cache + slots[i] * kv_size;
                for (int e = 0; e < kv_size; e++) kd[e] = f32_to_bf16(k[e]), vd[e] = f32_to_bf16(v[e]);
            } else {
                memcpy((float *)k_cache + slots[i] * kv_size, k, sizeof(float) * kv_size);
                memcpy((float *)v_cache + slots[i] * kv_size, v, sizeof(float) * kv_size);
            }
        }
        if (paged_decode(q, k_cache, v_cache, kv_bf16, tables, table_stride, seq_lens, n, heads, kvh,
                         d, bs, scale, att, attend_threads) != 0)
            code = 2;
        code |= linear_small(att, n, w->o_w, w_bf16, w->o_b, proj, hidden, q_size, nthreads);
        /* x + proj into x, and its norm into h (the post-attention add-and-norm) */
        rms_norm(proj, x, w->post_norm, eps, h, x, n, hidden, nthreads, 0);
        code |= linear_small(h, n, w->gate_up_w, w_bf16, w->gate_up_b, gate_up, 2 * inter, hidden,
                             nthreads);
        silu_mul(gate_up, act, n, inter, nthreads, 0);
        code |= linear_small(act, n, w->down_w, w_bf16, w->down_b, proj, hidden, inter, nthreads);
        for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += proj[i];
    }
    free(buf);
    return code ? 2 : 0;
}
