"""W8A8 int8 matmul: int8 weights with a float32 scale per output channel, activations
quantized per row (per token) on the fly, int8 x int8 dot products accumulated in int32.

    x_scale[m] = max_k |x[m, k]| / 127         x_q = round(x / x_scale)  (half away from 0)
    out[m, n]  = (sum_k x_q[m, k] w[n, k]) * x_scale[m] * w_scale[n]

Scales are per row, so a row's output never depends on the other rows of its batch.
Two launches: `quantize_rows` (one program per row), then the tiled int8 GEMM.
"""
