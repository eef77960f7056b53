"""Rotary position embedding, neox style (HF Llama's rotate_half), applied in place.

For a token at position p and each head, the pairs (x[i], x[i + d/2]) rotate by the angle
p * inv_freq[i]:

    x[i]       <- x[i] cos - x[i + d/2] sin
    x[i + d/2] <- x[i + d/2] cos + x[i] sin

cos and sin come from tables [max_positions, d/2] indexed by `positions` on the device, so
the same launch serves any batch (CUDA graphs). q and k are rotated by one launch.
"""
