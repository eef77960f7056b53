/* Every decoder layer of a float32 Llama-family model for a decode step of a few sequences
 * (of up to DECODE_MAX_ROWS where every linear is GGUF blocks: decode_many_rows), in one
 * call: no interpreter between the kernels.
 *
 * A decode step of one sequence is ~20 ms of weight reads and, run layer by layer from
 * Python, ~6 ms of torch dispatch, tensor bookkeeping and ctypes calls around ~10 kernels per
 * layer (docs/benchmarks.md, "Peers": the step account). This runs the same kernels in the
 * same order with the same arithmetic, so its output equals the layer-by-layer path's bit
 * for bit (tests/unit/gpu_worker/cpu/test_one_call_step.py):
 *
 *   h = rmsnorm(x) w_in;  qkv = h Wqkv^T (+b);  rotate q, k;  k, v -> cache slots
 *   a = paged attention(q);  x += a Wo^T (+b);  h = rmsnorm(x) w_post
 *   x += (silu(h Wg^T) * (h Wu^T)) Wd^T          (gate and up are one weight, [2I, hidden])
 *
 * with q and k normed (per head or over the whole projections) before rotary where the
 * layer has q/k norms, and each head's sink logit in the softmax where it has sinks. A mixture
 * of experts' layer runs its sparse MLP instead (run_moe: the router, moe.c's routing and
 * experts, Qwen2-MoE's gated shared expert), the same C functions its layers call.
 *
 * x [n, hidden] is the residual stream, updated in place; what comes out is the input of the
 * final norm. The kernels are linear.c, gguf.c, int8.c, layers.c, lora.c, paged_decode.c and
 * moe.c (with mxfp4.c), compiled in here.
 *
 * Each linear runs the kernel of its layer's linear method (run_linear): float32 or bf16
 * weights (linear.c), GGUF blocks (gguf.c), int8 W8A8 (int8.c), the same kernels the layers
 * call one by one. A bfloat16 model (bf16 weights, a bf16 cache) runs the same loop with linear.c's
 * bf16 path and a bf16 cache (K/V rounded to nearest even as they are stored, as torch
 * rounds); activations stay float32 between the kernels, where torch's bf16 layers round
 * each op's output to bf16, so it equals that path only within bf16's precision
 * (tests/unit/gpu_worker/cpu/test_one_call_step.py bounds it).
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/one_call_step.py.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "linear.c"
#include "gguf.c"
#include "int8.c"
#include "layers.c"
#include "lora.c"
#include "paged_decode.c"
#define SHUTTLE_STEP_KERNELS /* moe.c: the kernels above are here already */
#include "moe.c"

/* K (and as many V) elements below which one thread attends. Lower than gpu_worker/cpu/
 * paged_decode.py's SMALL_WORK (1 << 18), where a layer's attention may wake sleeping
 * threads: here they spin still from the qkv projection's loop just before. One sequence of
 * SmolLM2's shape (9 heads over 3 of 64), 30 layers' attention on a 2-core Zen 4: context
 * 64 one / two threads 0.150 / 0.169 ms, 160 0.345 / 0.241, 512 1.95 / 0.97. */
#define ATTEND_SMALL_WORK (1 << 14)

/* One linear layer's weight as its linear method keeps it (gpu_worker/layers/linear_methods/):
 *   LIN_F32, LIN_BF16  w[0] [out, in] float32 / bfloat16 (linear.c)
 *   LIN_GGUF           nshards row ranges, each rows[s] x in of GGUF type qtype[s] (gguf.c)
 *   LIN_INT8           w[0] int8 [out, in], scale[out] float32 (int8.c)
 * b: the bias, float32, or NULL.
 * lora_a, lora_b: the layer's LoRA slots (lora.c's a and b; NULL: no LoRA), lora_bounds its
 * output slices; added after the base kernel for the rows whose slot is >= 0, as
 * LoraLinearMethod adds them layer by layer */
enum { LIN_F32 = 0, LIN_BF16 = 1, LIN_GGUF = 2, LIN_INT8 = 3 };
#define MAX_SHARDS 4
typedef struct {
    int kind, nshards;
    const void *w[MAX_SHARDS];
    int qtype[MAX_SHARDS], rows[MAX_SHARDS];
    const float *scale, *b;
    const void *lora_a, *lora_b;
    const int32_t *lora_bounds;
    int lora_bf16, lora_slices, lora_rank, lora_loras;
} decode_linear_t;

/* A sparse layer's MLP (gpu_worker/models/moe.py's SparseMoeBlock): its router (a linear to
 * one logit per expert, + bias), the routing (moe.c's scoring, top_k, renormalize), the
 * experts (moe.c), and Qwen2-MoE's shared expert (shared_width 0: none): gate_up, down and
 * its gate, a linear to one logit, whose sigmoid scales it. counts [E] gets each expert's
 * (token, slot) pairs of the step. */
typedef struct {
    decode_linear_t router;
    int top_k, scoring, renormalize;
    moe_experts_t experts;
    decode_linear_t shared_gate_up, shared_down, shared_gate;
    int shared_width;
    int64_t *counts;
} decode_moe_t;

/* One layer: its norms' weights (float32), its four linears (gate_up and down: a dense MLP
 * of width `inter`) or its sparse MLP (`moe`, not NULL), its attention's sliding window (0:
 * the whole context), its q/k norms (NULL: none; over each head, or over the whole q and k
 * projections with qk_norm_whole: OLMoE) and its sinks (a logit per head, NULL: none) */
typedef struct {
    const float *input_norm, *post_norm;
    decode_linear_t qkv, o, gate_up, down;
    int window, inter;
    const float *q_norm, *k_norm;
    int qk_norm_whole;
    const float *sinks;
    const decode_moe_t *moe;
} decode_layer_t;

static int run_base(const decode_linear_t *L, const float *x, int n, float *y, int out, int in,
                    int nthreads) {
    switch (L->kind) {
    case LIN_F32:
    case LIN_BF16:
        return linear_small(x, n, L->w[0], L->kind == LIN_BF16, L->b, y, out, in, nthreads);
    case LIN_INT8:
        return int8_linear_rows(x, n, (const int8_t *)L->w[0], L->scale, L->b, y, out, in,
                                nthreads);
    case LIN_GGUF:
        return gguf_linear_shards_any(x, n, (const uint8_t *const *)L->w, L->qtype, L->rows,
                                      L->nshards, L->b, y, in, nthreads);
    default:
        return 1;
    }
}

/* y [n, out] = x [n, in] W^T (+ b) by the layer's kernel, plus each row's LoRA delta where
 * lora_slots (the rows' adapter slots) is not NULL and the layer has LoRA */
static int run_linear(const decode_linear_t *L, const float *x, int n, float *y, int out, int in,
                      const int32_t *lora_slots, int nthreads) {
    int code = run_base(L, x, n, y, out, in, nthreads);
    if (code || !lora_slots || !L->lora_a) return code;
    return lora_add(x, n, in, L->lora_a, L->lora_b, L->lora_bf16, L->lora_slices, L->lora_rank,
                    L->lora_bounds, out, lora_slots, L->lora_loras, y, 0, nthreads);
}

/* q and k of each row of qkv [n, qkv_size] normed in place (layers.c's rms_norm, as the
 * layers' RMSNorm calls it): per head, or over the whole projections */
static void qk_norm(const decode_layer_t *w, float *qkv, int n, int heads, int kvh, int d,
                    int qkv_size, float eps) {
    for (int i = 0; i < n; i++) {
        float *q = qkv + (size_t)i * qkv_size, *k = q + (size_t)heads * d;
        if (w->qk_norm_whole) {
            rms_norm(q, NULL, w->q_norm, eps, q, NULL, 1, heads * d, 1, 0);
            rms_norm(k, NULL, w->k_norm, eps, k, NULL, 1, kvh * d, 1, 0);
        } else {
            rms_norm(q, NULL, w->q_norm, eps, q, NULL, heads, d, 1, 0);
            rms_norm(k, NULL, w->k_norm, eps, k, NULL, kvh, d, 1, 0);
        }
    }
}

/* y [n, hidden] = the sparse MLP of h [n, hidden] (see decode_moe_t): the same kernels, in
 * the same order, as the layers (gpu_worker/models/moe.py) */
static int run_moe(const decode_moe_t *M, const float *h, int n, float *y, int hidden,
                   int nthreads) {
    int E = M->experts.num_experts, k = M->top_k, S = M->shared_width;
    size_t floats = (size_t)n * (E + k + (S ? 3 * S + hidden + 1 : 0));
    float *logits = malloc(sizeof(float) * floats);
    int64_t *ids = malloc(sizeof(int64_t) * (size_t)n * k);
    int64_t *counts = malloc(sizeof(int64_t) * (size_t)E);
    int code = 0;
    if (!logits || !ids || !counts) {
        code = 2;
        goto done;
    }
    float *wts = logits + (size_t)n * E;
    code |= run_linear(&M->router, h, n, logits, E, hidden, NULL, nthreads);
    code |= moe_route(logits, n, E, k, M->scoring, M->renormalize, wts, ids);
    if (code) goto done;
    code |= moe_experts(&M->experts, h, n, ids, wts, k, y, counts, nthreads);
    for (int e = 0; e < E && !code; e++) M->counts[e] += counts[e];
    if (S && !code) {
        float *gate_up = wts + (size_t)n * k, *act = gate_up + (size_t)n * 2 * S;
        float *shared = act + (size_t)n * S, *g = shared + (size_t)n * hidden;
        code |= run_linear(&M->shared_gate_up, h, n, gate_up, 2 * S, hidden, NULL,
                           nthreads);
        silu_mul(gate_up, act, n, S, nthreads, 0);
        code |= run_linear(&M->shared_down, act, n, shared, hidden, S, NULL, nthreads);
        code |= run_linear(&M->shared_gate, h, n, g, 1, hidden, NULL, nthreads);
        if (!code) moe_add_gated(y, shared, g, n, hidden);
    }
done:
    free(logits), free(ids), free(counts);
    return code ? 2 : 0;
}

/* DECODE_MAX_ROWS where a step of these layers may take more than MAX_ROWS rows: every
 * linear GGUF blocks without LoRA and every layer dense (gguf_linear_shards_any takes any rows
 * on the kernel the layers take); else 0: MAX_ROWS at most (linear.c's float kernel; int8 and
 * LoRA layers, and the experts, take other kernels beyond it). Layer by layer, a B=64 decode
 * step of SmolLM2's Q4_1 file (2 Sapphire Rapids threads) spent ~6 ms of its ~97 in torch and
 * Python between the kernels and ~2 storing K/V by torch; in one call it takes ~86. Its
 * buffers grow with n; past DECODE_MAX_ROWS the layers' own overhead is small. */
#define DECODE_MAX_ROWS 256
static int takes_many(const decode_linear_t *L) { return L->kind == LIN_GGUF && !L->lora_a; }
int decode_many_rows(const decode_layer_t *layers, int num_layers) {
    for (int l = 0; l < num_layers; l++) {
        const decode_layer_t *w = layers + l;
        if (w->moe || !takes_many(&w->qkv) || !takes_many(&w->o) || !takes_many(&w->gate_up) ||
            !takes_many(&w->down))
            return 0;
    }
    return DECODE_MAX_ROWS;
}

/* Returns 0; 1 when the shapes are outside what it takes (n past MAX_ROWS, or past
 * decode_many_rows where that is not 0), 2 when memory ran out or a kernel refused (the
 * caller runs the layers one by one). kv_base is the cache [layers, 2, blocks, bs, kvh, row]
 * (rows as kv_kind stores them, paged_decode.c: float32, bf16, int8 with its scale, fp8
 * e4m3 / e5m2; each new row quantized once): layer l's K at l * layer_stride, its V
 * half_stride further (elements). lora_slots [n]: each row's adapter slot (-1: none), or NULL
 * when no row has one (the step then costs nothing more). Each head of d dims rotates its
 * first rot (cos_t / sin_t [positions, rot / 2]). inter sizes the buffers: the widest of the
 * layers' dense MLPs and shared experts, and half the widest router's outputs (each layer's
 * own width is its decode_layer_t's). */
int decode_forward(const decode_layer_t *layers, int num_layers, float *x, int n, int hidden,
                   int heads, int kvh, int d, int rot, int inter, float eps, const float *cos_t,
                   const float *sin_t, const int64_t *positions, const int64_t *slots,
                   void *kv_base, int64_t layer_stride, int64_t half_stride,
                   const int32_t *tables, int table_stride, const int32_t *seq_lens, int bs,
                   float scale, int kv_kind, const int32_t *lora_slots, int nthreads,
                   const int64_t *groups) {
    /* groups (NULL: one dense group): per layer 4 int64, its KV layer group's view
       (common/kv_groups.py): the slot of the KV tensor it keeps its K/V in, the address of
       its group's block tables, their row stride, and the address of its slot mapping */
    int most = decode_many_rows(layers, num_layers);
    if (n < 1 || n > (most ? most : MAX_ROWS) || heads % kvh != 0) return 1;
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
    if (kv_kind < KV_F32 || kv_kind > KV_FP8_E5M2) return 1;
    int64_t size = kv_kind == KV_F32 ? 4 : kv_kind == KV_BF16 ? 2 : 1, rb = row_bytes(kv_kind, d);
    for (int l = 0; l < num_layers && code == 0; l++) {
        const decode_layer_t *w = layers + l;
        int64_t kv_slot = l;
        const int32_t *l_tables = tables;
        int l_stride = table_stride;
        const int64_t *l_slots = slots;
        if (groups) {
            const int64_t *g = groups + 4 * (size_t)l;
            kv_slot = g[0];
            l_tables = (const int32_t *)(intptr_t)g[1];
            l_stride = (int)g[2];
            l_slots = (const int64_t *)(intptr_t)g[3];
        }
        char *k_cache = (char *)kv_base + kv_slot * layer_stride * size;
        char *v_cache = k_cache + half_stride * size;
        rms_norm(x, NULL, w->input_norm, eps, h, NULL, n, hidden, nthreads, 0);
        code |= run_linear(&w->qkv, h, n, qkv, qkv_size, hidden, lora_slots, nthreads);
        if (w->q_norm) qk_norm(w, qkv, n, heads, kvh, d, qkv_size, eps);
        rotary_neox(qkv, positions, cos_t, sin_t, n, heads, d, rot, qkv_size, nthreads, 0);
        rotary_neox(qkv + q_size, positions, cos_t, sin_t, n, kvh, d, rot, qkv_size, nthreads, 0);
        for (int i = 0; i < n; i++) {
            const float *row = qkv + (size_t)i * qkv_size;
            memcpy(q + (size_t)i * q_size, row, sizeof(float) * q_size);
            const float *k = row + q_size, *v = k + kv_size;
            for (int hh = 0; hh < kvh; hh++) { /* each row stored (quantized) once */
                int64_t at = (l_slots[i] * kvh + hh) * rb;
                store_row(k_cache + at, kv_kind, k + (size_t)hh * d, d);
                store_row(v_cache + at, kv_kind, v + (size_t)hh * d, d);
            }
        }
        if (paged_decode(q, k_cache, v_cache, kv_kind, l_tables, l_stride, seq_lens, n, heads, kvh,
                         d, bs, scale, w->window, 0.0f, w->sinks, att, attend_threads) != 0)
            code = 2;
        code |= run_linear(&w->o, att, n, proj, hidden, q_size, lora_slots, nthreads);
        /* x + proj into x, and its norm into h (the post-attention add-and-norm) */
        rms_norm(proj, x, w->post_norm, eps, h, x, n, hidden, nthreads, 0);
        if (w->moe) {
            code |= run_moe(w->moe, h, n, proj, hidden, nthreads);
        } else {
            int width = w->inter;
            code |= run_linear(&w->gate_up, h, n, gate_up, 2 * width, hidden, lora_slots,
                               nthreads);
            silu_mul(gate_up, act, n, width, nthreads, 0);
            code |= run_linear(&w->down, act, n, proj, hidden, width, lora_slots, nthreads);
        }
        for (size_t i = 0; i < (size_t)n * hidden; i++) x[i] += proj[i];
    }
    free(buf);
    return code ? 2 : 0;
}
