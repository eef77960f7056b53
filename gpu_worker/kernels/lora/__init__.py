"""Batched LoRA (Punica's shapes): each token's adapter delta added into a linear layer's
output, tokens of several adapters and of the base model in one launch.

    shrink  z[t, c, :] = A[slot(t), c] x[t]
    expand  y[t, n] += B[slot(t), n] . z[t, c(n)]

Decode steps (at most MAX_BGMV_TOKENS tokens), bgmv: one program per (token, slice) for the
shrink and per (token, N block) for the expand, each gathering its token's slot; a base
token's programs return at once; nothing but the slots is read, so a CUDA graph replays it.
Prefill chunks, sgmv: the tokens sorted by slot on the device (`slot_groups`), then one
program per (32 tokens of one slot, slice, slot) computes a tl.dot tile; programs past a
slot's tokens return at once. The formula and the buffers'
layout are gpu_worker/lora/layer.py's; `reference.py` is its torch reference.
"""
