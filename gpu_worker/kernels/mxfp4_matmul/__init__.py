"""MXFP4 GEMM (gpt-oss's packed experts) on CUDA: kernel.py, against the torch dequantization
(gpu_worker/layers/moe_methods/mxfp4.py's dequantize_mxfp4)."""
