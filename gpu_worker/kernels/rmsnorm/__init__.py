"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

    residual' = x + residual                       (rounded to the model dtype, returned)
    out       = (residual' / rms(residual')) * weight

computed in float32 like Hugging Face's LlamaRMSNorm: the normalised value is rounded to the
model dtype before the weight multiplies it, so results match the torch path bit for bit in
fp32 and to rounding in bf16. One program per row; one read and one write of each tensor
instead of the add, the norm and the scale as three passes.
"""
