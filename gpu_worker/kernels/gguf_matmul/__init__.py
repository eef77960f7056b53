"""x @ W^T with W in a GGUF block format, dequantized tile by tile inside the GEMM.

The weight is the file's raw bytes, a uint8 tensor [N, row_bytes]: each row is K / QK
blocks of `type_size` bytes in ggml's layout (gguf-py `gguf/quants.py`). For element j of
a block (0 <= j < QK) the kernel computes which byte(s) hold its quant and its scales:

    Q8_0  (32, 34)  d f16 | q int8[32]                     w = d q
    Q4_0  (32, 18)  d | qs[16]  j -> qs[j % 16] >> 4 (j / 16)    w = d (q - 8)
    Q4_1  (32, 20)  d | m | qs[16]                         w = d q + m
    Q5_0  (32, 22)  d | qh[4] | qs[16]  bit 4 = qh bit j   w = d (q - 16)
    Q5_1  (32, 24)  d | m | qh[4] | qs[16]                 w = d q + m
    Q4_K (256,144)  d | dmin | scales[12] | qs[128]        w = d sc[s] q - dmin mn[s]
    Q5_K (256,176)  d | dmin | scales[12] | qh[32] | qs[128]
    Q6_K (256,210)  ql[128] | qh[64] | scales int8[16] | d   w = d sc[j / 16] (q - 32)

(K-quant sub-blocks s = j / 32 have 6-bit scales and mins packed in 12 bytes.) One kernel
with the type as a constexpr: one specialization per type, fp32 accumulation.
"""
