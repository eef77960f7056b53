"""Linear methods: how each linear layer's weight is kept and multiplied, chosen at load.

    weights.py    what a checkpoint gives for a layer: float, GGUF blocks, int8 + scales
    cpu_float.py  float32/bf16 on the CPU: C few-row kernel, oneDNN packed for many rows
    gguf.py       GGUF block formats (C kernels on the CPU, Triton on CUDA, torch reference)
    int8.py       int8 W8A8 (per-channel weights, per-row dynamic activations)

The protocol and the plain-torch `FloatLinearMethod` are in gpu_worker/layers/linear.py; the
kernels the methods call are leaves in gpu_worker/cpu/ (C) and gpu_worker/kernels/ (Triton);
gpu_worker/layers/kernel_choice.py picks a method for each layer.
"""
