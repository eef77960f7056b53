/* A mixture of experts' layer on the CPU, one call per layer and step: the routing (router
 * logits to each token's top-k experts and weights) and the experts themselves, for every
 * weight kind the CPU MoE methods keep (gpu_worker/layers/moe_methods/): float32 / bf16
 * (linear.c), GGUF blocks (gguf.c), int8 W8A8 (int8.c), MXFP4 (mxfp4.c).
 *
 * The step's (token, slot) pairs are grouped by expert with a stable counting sort (an
 * expert's rows keep the tokens' order, as lora.c groups rows by slot); each selected
 * expert's rows are gathered and run through its kernels as a dense layer's would be, gate|up
 * (+ bias), the activation, then down (+ bias); only the selected experts' bytes are read.
 * Each token's outputs are then added in increasing expert id order from zero, each times its
 * routing weight. Every kernel gives a row the same bits whatever other rows share its call
 * (float32: linear.c's GEMM, any rows; bf16: linear.c at most MAX_ROWS rows a call; GGUF's
 * few-row kernel up to gguf_few_rows_here() rows and its int8 GEMM beyond, which agree; int8 and
 * MXFP4 per row), so a token's result never depends on the other tokens of the step.
 *
 * Both paths run this code: the layers one by one (gpu_worker/cpu/moe.py, called by the CPU
 * MoE methods and the CPU layer ops' routing) and the one-call step (one_call_step.c includes
 * this file), so the two give a token the same bits.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/moe.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SHUTTLE_STEP_KERNELS /* one_call_step.c includes these itself */
#include "linear.c"
#include "gguf.c"
#include "int8.c"
#include "layers.c"
#endif
#undef TILE /* linear.c's; mxfp4.c has its own */
#include "mxfp4.c"

/* routing (fused_moe.py's SCORINGS): softmax over every expert then the top k, or the top k
 * logits then a softmax over them (gpt-oss) */
enum { MOE_SOFTMAX = 0, MOE_TOPK_SOFTMAX = 1 };
/* the experts' weights (moe.py's kinds) */
enum { MOE_F32 = 0, MOE_BF16 = 1, MOE_GGUF = 2, MOE_INT8 = 3, MOE_MXFP4 = 4 };
/* the activation (fused_moe.py's ACTIVATIONS): silu(gate) * up on [gate | up] halves, or
 * gpt-oss's clamped SwiGLU on interleaved gate/up columns */
enum { MOE_SILU = 0, MOE_SWIGLU_CLAMP = 1 };

/* One layer's experts as its method keeps them: w13 [E, 2I, ...] (gate rows then up rows, or
 * interleaved for MOE_SWIGLU_CLAMP) and w2 [E, H, ...]:
 *   MOE_F32            [E, ceil(out / 16), in, 16] float32 in linear.c's GEMM panels
 *   MOE_BF16           [E, out, in] bfloat16
 *   MOE_GGUF           [E, out, row_bytes] of GGUF type qt13 / qt2
 *   MOE_INT8           [E, out, in] int8 with s13 / s2 float32 [E, out]
 *   MOE_MXFP4          [E, out, in / 32, 16] uint8 with s13 / s2 uint8 [E, out, in / 32]
 * b13 [E, 2I], b2 [E, H]: float32 biases or NULL. */
typedef struct {
    int kind, num_experts, width, hidden;
    const void *w13, *w2, *s13, *s2;
    int qt13, qt2;
    const float *b13, *b2;
    int activation;
    float limit, alpha;
} moe_experts_t;

/* wts [T, k], ids [T, k] from logits [T, E]: a token's experts by decreasing score (ties: the
 * lower id first). Returns 0; 1 for a shape it does not take. */
int moe_route(const float *logits, int T, int E, int k, int scoring, int renormalize,
              float *wts, int64_t *ids) {
    if (T < 0 || E < 1 || k < 1 || k > E || k > 64) return 1;
    for (int t = 0; t < T; t++) {
        const float *l = logits + (int64_t)t * E;
        float *w = wts + (int64_t)t * k;
        int64_t *id = ids + (int64_t)t * k;
        float score[1024];
        const float *s = l;
        if (scoring == MOE_SOFTMAX) { /* softmax over every expert */
            if (E > 1024) return 1;
            float mx = l[0], sum = 0.f;
            for (int e = 1; e < E; e++) mx = l[e] > mx ? l[e] : mx;
            for (int e = 0; e < E; e++) sum += score[e] = expf(l[e] - mx);
            for (int e = 0; e < E; e++) score[e] /= sum;
            s = score;
        }
        for (int j = 0; j < k; j++) { /* selection: the best not yet taken */
            int best = -1;
            for (int e = 0; e < E; e++) {
                int taken = 0;
                for (int m = 0; m < j; m++) taken |= id[m] == e;
                if (!taken && (best < 0 || s[e] > s[best])) best = e;
            }
            id[j] = best, w[j] = s[best];
        }
        if (scoring == MOE_TOPK_SOFTMAX) { /* a softmax over the k logits */
            float mx = w[0], sum = 0.f;
            for (int j = 0; j < k; j++) sum += w[j] = expf(w[j] - mx);
            for (int j = 0; j < k; j++) w[j] /= sum;
        } else if (renormalize) {
            float sum = 0.f;
            for (int j = 0; j < k; j++) sum += w[j];
            for (int j = 0; j < k; j++) w[j] /= sum;
        }
    }
    return 0;
}

/* y [n, out] = x [n, in] @ W.T (+ b) for expert e's weight of projection `down` (0: w13) */
static int moe_project(const moe_experts_t *M, int down, int e, const float *x, int n, float *y,
                       int nthreads) {
    int out = down ? M->hidden : 2 * M->width, in = down ? M->width : M->hidden;
    const void *w = down ? M->w2 : M->w13;
    const void *s = down ? M->s2 : M->s13;
    const float *b = down ? M->b2 : M->b13;
    if (b) b += (int64_t)e * out;
    int64_t rows = (int64_t)e * out;
    switch (M->kind) {
    case MOE_BF16: {
        const char *we = (const char *)w + rows * in * 2;
        for (int lo = 0; lo < n; lo += MAX_ROWS) { /* at most MAX_ROWS rows a call */
            int nb = n - lo < MAX_ROWS ? n - lo : MAX_ROWS;
            int rc = linear_small(x + (int64_t)lo * in, nb, we, 1, b, y + (int64_t)lo * out,
                                  out, in, nthreads);
            if (rc) return rc;
        }
        return 0;
    }
    case MOE_GGUF: {
        int qt = down ? M->qt2 : M->qt13;
        const uint8_t *we = (const uint8_t *)w + rows * (in / gguf_block_values(qt)) *
                                                     gguf_block_bytes(qt);
        if (n > gguf_few_rows_here(qt)) {
            int rc = gguf_linear_many(x, n, we, qt, b, y, out, in, nthreads);
            if (rc != 1) return rc;
        }
        return gguf_linear_rows(x, n, we, qt, b, y, out, in, nthreads);
    }
    case MOE_INT8:
        return int8_linear_rows(x, n, (const int8_t *)w + rows * in, (const float *)s + rows, b,
                                y, out, in, nthreads);
    case MOE_MXFP4: {
        int64_t groups = in / 32;
        return mxfp4_linear_rows(x, n, in, (const uint8_t *)w + rows * groups * 16,
                                 (const uint8_t *)s + rows * groups, b, out, y, nthreads) ? 1 : 0;
    }
    default:
        return 1;
    }
}

/* pairs from which moe_experts' own loops (gathering x, the activation, the weighted sums) run
 * on every thread: fewer, as in a decode step, cost less than waking the threads */
#define MOE_PARALLEL_PAIRS 256

/* a [n, I] = the activation of h [n, 2I] (each element by itself: any split of the rows) */
static void moe_activate(const moe_experts_t *M, const float *h, int n, float *a, int nthreads) {
    int I = M->width;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n >= MOE_PARALLEL_PAIRS)
    for (int j = 0; j < n; j++) {
        const float *hj = h + (int64_t)j * 2 * I;
        float *aj = a + (int64_t)j * I;
        if (M->activation == MOE_SILU) {
            for (int i = 0; i < I; i++) aj[i] = hj[i] / (1.f + expf(-hj[i])) * hj[I + i];
            continue;
        }
        for (int i = 0; i < I; i++) { /* gate 2i, up 2i + 1 */
            float g = hj[2 * i] < M->limit ? hj[2 * i] : M->limit;
            float u = hj[2 * i + 1];
            u = u < -M->limit ? -M->limit : u > M->limit ? M->limit : u;
            float glu = g / (1.f + expf(-g * M->alpha));
            aj[i] = (u + 1.f) * glu;
        }
    }
}

/* projection `down` (0: w13) of every expert at once: expert e's rows are rows [start[e],
 * start[e + 1]) of x [P, in] and y [P, out]. Float32 experts: linear.c's grouped GEMM, every
 * expert in one parallel region (its outputs do not depend on an expert's rows). GGUF experts
 * of at most gguf_few_rows_here() rows (a decode step's) share one quantization of x and one
 * parallel loop over (expert, chunk of outputs): a step's k experts cost one OpenMP region,
 * not k, with each output computed by the same kernel (gguf_rows_range) as one expert alone.
 * Other experts: moe_project, one by one. */
static int moe_projections(const moe_experts_t *M, int down, const int *start, const float *x,
                           float *y, int nthreads) {
    int E = M->num_experts, out = down ? M->hidden : 2 * M->width;
    int in = down ? M->width : M->hidden, few = 0;
    if (M->kind == MOE_F32)
        return linear_gemm_groups(x, start, E, (const float *)(down ? M->w2 : M->w13),
                                  down ? M->b2 : M->b13, y, out, in, nthreads);
#if defined(__AVX2__)
    if (M->kind == MOE_GGUF) {
        int qt = down ? M->qt2 : M->qt13;
        int64_t row_bytes = (int64_t)(in / gguf_block_values(qt)) * gguf_block_bytes(qt);
        int items = 0;
        few = gguf_few_rows_here(qt);
        int *item = (int *)malloc(sizeof(int) * (size_t)E);
        if (!item) return 2;
        for (int e = 0; e < E; e++) {
            int n = start[e + 1] - start[e];
            if (n > 0 && n <= few) item[items++] = e;
        }
        /* units of the loop's rows over every selected expert (gguf_unit_rows), one expert's
           rows at most */
        int unit = gguf_unit_rows(items * out, nthreads);
        unit = unit < out ? unit : out;
        int chunks = (out + unit - 1) / unit;
        gguf_xq xq;
        if (items && gguf_xq_make(x, start[E], in, &xq)) {
            free(item);
            return 2;
        }
        const uint8_t *w = (const uint8_t *)(down ? M->w2 : M->w13);
        const float *b = down ? M->b2 : M->b13;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
        for (int i = 0; i < items * chunks; i++) {
            int e = item[i / chunks], lo = (i % chunks) * unit;
            int hi = lo + unit < out ? lo + unit : out, s = start[e];
            /* the prefetch runs on into the next selected expert, not the one after e */
            int after = i / chunks + 1 < items ? item[i / chunks + 1] : e + 1;
            gguf_rows_range(&xq, s, start[e + 1] - s, w + (int64_t)e * out * row_bytes, qt,
                            row_bytes, b ? b + (int64_t)e * out : NULL, y + (int64_t)s * out,
                            out, lo, hi, out, w + (int64_t)after * out * row_bytes);
        }
        if (items) free(xq.d);
        free(item);
    }
#endif
    for (int e = 0; e < E; e++) {
        int s = start[e], n = start[e + 1] - s;
        if (n <= few) continue; /* none, or done above */
        int rc = moe_project(M, down, e, x + (int64_t)s * in, n, y + (int64_t)s * out, nthreads);
        if (rc) return rc;
    }
    return 0;
}

static int moe_check(const moe_experts_t *M) {
    if (M->kind < MOE_F32 || M->kind > MOE_MXFP4 || M->num_experts < 1 || M->width < 1 ||
        M->hidden < 1)
        return 1;
    if (M->kind == MOE_GGUF &&
        (gguf_check(1, M->qt13, 2 * M->width, M->hidden) || gguf_check(1, M->qt2, M->hidden,
                                                                        M->width)))
        return 1;
    if (M->kind == MOE_MXFP4 && (M->hidden % 32 || M->width % 32)) return 1;
    return 0;
}

/* y [T, H] = the layer's output for x [T, H] routed to ids [T, k] with weights [T, k].
 * counts [E] gets each expert's number of pairs. Returns 0; 1 for a kind, shape or expert id
 * it does not take; 2 when memory ran out or a kernel failed. */
int moe_experts(const moe_experts_t *M, const float *x, int T, const int64_t *ids,
                const float *wts, int k, float *y, int64_t *counts, int nthreads) {
    int E = M->num_experts, I = M->width, H = M->hidden;
    if (T < 1 || k < 1 || k > 64 || moe_check(M)) return 1;
    int P = T * k;
    for (int p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    int *start = (int *)calloc((size_t)E + 1, sizeof(int));
    int *fill = (int *)malloc(sizeof(int) * ((size_t)E + 1));
    int *order = (int *)malloc(sizeof(int) * (size_t)P);
    int *pos = (int *)malloc(sizeof(int) * (size_t)P);
    float *xe = (float *)malloc(sizeof(float) * (size_t)P * H);
    float *h = (float *)malloc(sizeof(float) * (size_t)P * 2 * I);
    float *a = (float *)malloc(sizeof(float) * (size_t)P * I);
    float *oe = (float *)malloc(sizeof(float) * (size_t)P * H);
    int rc = 0, par = P >= MOE_PARALLEL_PAIRS;
    if (!start || !fill || !order || !pos || !xe || !h || !a || !oe) {
        rc = 2;
        goto done;
    }
    /* the stable counting sort: pairs by expert, in pair (token) order within one */
    for (int p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int) * ((size_t)E + 1));
    for (int p = 0; p < P; p++) order[fill[ids[p]]++] = p;
    for (int j = 0; j < P; j++) pos[order[j]] = j; /* pair p's row in expert order */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int j = 0; j < P; j++) /* each expert's rows, gathered in its block of xe */
        memcpy(xe + (int64_t)j * H, x + (int64_t)(order[j] / k) * H, sizeof(float) * H);
    for (int e = 0; e < E; e++) counts[e] = start[e + 1] - start[e];
    rc = moe_projections(M, 0, start, xe, h, nthreads);
    if (rc == 0) {
        moe_activate(M, h, P, a, nthreads);
        rc = moe_projections(M, 1, start, a, oe, nthreads);
    }
    if (rc) goto done;
    /* each token's weighted sum, its experts in increasing id order, from zero */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (int t = 0; t < T; t++) {
        int slot[64];
        const int64_t *idt = ids + (int64_t)t * k;
        for (int j = 0; j < k; j++) slot[j] = j;
        for (int j = 1; j < k; j++) /* insertion sort of the slots by expert id */
            for (int m = j; m > 0 && idt[slot[m - 1]] > idt[slot[m]]; m--) {
                int tmp = slot[m];
                slot[m] = slot[m - 1];
                slot[m - 1] = tmp;
            }
        float *yt = y + (int64_t)t * H;
        for (int i = 0; i < H; i++) yt[i] = 0.f;
        for (int j = 0; j < k; j++) {
            int64_t p = (int64_t)t * k + slot[j];
            const float *op = oe + (int64_t)pos[p] * H;
            float wgt = wts[p];
            for (int i = 0; i < H; i++) yt[i] += op[i] * wgt;
        }
    }
done:
    free(start), free(fill), free(order), free(pos), free(xe), free(h), free(a), free(oe);
    return rc ? (rc == 1 ? 1 : 2) : 0;
}

/* y [T, H] += sigmoid(g [T]) * s [T, H]: Qwen2-MoE's gated shared expert */
void moe_add_gated(float *y, const float *s, const float *g, int T, int H) {
    for (int t = 0; t < T; t++) {
        float gate = 1.f / (1.f + expf(-g[t]));
        for (int i = 0; i < H; i++) y[(int64_t)t * H + i] += gate * s[(int64_t)t * H + i];
    }
}
