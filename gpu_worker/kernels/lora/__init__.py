"""Batched LoRA (Punica's bgmv shape): each token's adapter delta added into a linear layer's
output, tokens of several adapters and of the base model in one launch.

    shrink  z[t, c, :] = A[slot(t), c] x[t]            one program per (token, slice)
    expand  y[t, n] += B[slot(t), n] . z[t, c(n)]      one program per (token, N block)

A token whose slot is -1 costs a program that returns at once. The formula and the buffers'
layout are gpu_worker/lora/layer.py's; `reference.py` is its torch reference.
"""
