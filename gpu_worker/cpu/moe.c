/* A mixture of experts' layer on GGUF block-quantized experts, one call per layer and step.
 *
 * The step's (token, slot) pairs are grouped by expert with a stable counting sort (an
 * expert's rows keep the tokens' order, as lora.c groups rows by slot); each selected
 * expert's rows are gathered and run through gguf.c's kernels as a dense layer's would be
 * (the few-row int8 kernel up to GGUF_MOE_FEW_ROWS rows, the int8 GEMM beyond where it takes
 * the type: both give a row the same bits), gate|up, then silu(gate) * up, then down; only
 * the selected experts' bytes are read. Each token's outputs are then added in increasing
 * expert id order from zero, each times its routing weight. A token's result therefore never
 * depends on the other tokens of the step.
 *
 * Built at first use by gpu_worker/cpu/build.py; called from gpu_worker/cpu/moe.py.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gguf.c"

#define GGUF_MOE_FEW_ROWS 4 /* gguf.py's MAX_KERNEL_ROWS */

/* y [n, out] = x [n, in] @ W.T for one expert's GGUF bytes w [out, row_bytes] */
static int moe_project(const float *x, int n, const uint8_t *w, int qt, float *y, int out,
                       int in, int nthreads) {
    if (n > GGUF_MOE_FEW_ROWS) {
        int rc = gguf_linear_many(x, n, w, qt, NULL, y, out, in, nthreads);
        if (rc != 1) return rc;
    }
    return gguf_linear_rows(x, n, w, qt, NULL, y, out, in, nthreads);
}

/* y [T, H] = the layer's output for x [T, H] routed to ids [T, k] with weights [T, k];
 * w13 [E, 2 * I, row_bytes(qt13, H)] (gate rows then up rows) and w2 [E, H, row_bytes(qt2, I)]
 * GGUF bytes. counts [E] gets each expert's number of pairs. Returns 0; 1 for a type, shape
 * or expert id it does not take; 2 when memory ran out. */
int gguf_moe(const float *x, int T, const int64_t *ids, const float *wts, int k, int E,
             const uint8_t *w13, int qt13, const uint8_t *w2, int qt2, int I, int H, float *y,
             int64_t *counts, int nthreads) {
    if (T < 1 || k < 1 || E < 1 || gguf_check(1, qt13, 2 * I, H) || gguf_check(1, qt2, H, I))
        return 1;
    int P = T * k;
    for (int p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return 1;
    int64_t rb13 = (int64_t)(H / gguf_block_values(qt13)) * gguf_block_bytes(qt13);
    int64_t rb2 = (int64_t)(I / gguf_block_values(qt2)) * gguf_block_bytes(qt2);
    int *start = (int *)calloc((size_t)E + 1, sizeof(int));
    int *fill = (int *)malloc(sizeof(int) * ((size_t)E + 1));
    int *order = (int *)malloc(sizeof(int) * (size_t)P);
    float *xe = (float *)malloc(sizeof(float) * (size_t)P * H);
    float *h = (float *)malloc(sizeof(float) * (size_t)P * 2 * I);
    float *a = (float *)malloc(sizeof(float) * (size_t)P * I);
    float *oe = (float *)malloc(sizeof(float) * (size_t)P * H);
    float *out = (float *)malloc(sizeof(float) * (size_t)P * H);
    int rc = 0;
    if (!start || !fill || !order || !xe || !h || !a || !oe || !out) {
        rc = 2;
        goto done;
    }
    /* the stable counting sort: pairs by expert, in pair (token) order within one */
    for (int p = 0; p < P; p++) start[ids[p] + 1]++;
    for (int e = 0; e < E; e++) start[e + 1] += start[e];
    memcpy(fill, start, sizeof(int) * ((size_t)E + 1));
    for (int p = 0; p < P; p++) order[fill[ids[p]]++] = p;
    for (int e = 0; e < E && rc == 0; e++) {
        int s = start[e], n = start[e + 1] - s;
        counts[e] = n;
        if (n == 0) continue;
        for (int j = 0; j < n; j++)
            memcpy(xe + (int64_t)j * H, x + (int64_t)(order[s + j] / k) * H, sizeof(float) * H);
        rc = moe_project(xe, n, w13 + (int64_t)e * 2 * I * rb13, qt13, h, 2 * I, H, nthreads);
        if (rc) break;
        for (int j = 0; j < n; j++) {
            const float *g = h + (int64_t)j * 2 * I, *u = g + I;
            float *aj = a + (int64_t)j * I;
            for (int i = 0; i < I; i++) aj[i] = g[i] / (1.f + expf(-g[i])) * u[i];
        }
        rc = moe_project(a, n, w2 + (int64_t)e * H * rb2, qt2, oe, H, I, nthreads);
        if (rc) break;
        for (int j = 0; j < n; j++)
            memcpy(out + (int64_t)order[s + j] * H, oe + (int64_t)j * H, sizeof(float) * H);
    }
    if (rc) goto done;
    /* each token's weighted sum, its experts in increasing id order, from zero */
    for (int t = 0; t < T; t++) {
        int slot[64];
        int kk = k < 64 ? k : 64;
        for (int j = 0; j < kk; j++) slot[j] = j;
        for (int j = 1; j < kk; j++) /* insertion sort of the slots by expert id */
            for (int m = j; m > 0 && ids[(int64_t)t * k + slot[m - 1]] > ids[(int64_t)t * k + slot[m]]; m--) {
                int tmp = slot[m];
                slot[m] = slot[m - 1];
                slot[m - 1] = tmp;
            }
        float *yt = y + (int64_t)t * H;
        for (int i = 0; i < H; i++) yt[i] = 0.f;
        for (int j = 0; j < kk; j++) {
            int64_t p = (int64_t)t * k + slot[j];
            const float *op = out + p * H;
            float wgt = wts[p];
            for (int i = 0; i < H; i++) yt[i] += op[i] * wgt;
        }
    }
done:
    free(start), free(fill), free(order), free(xe), free(h), free(a), free(oe), free(out);
    return rc;
}
