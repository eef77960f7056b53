"""Fused mixture-of-experts on float experts (CUDA): the step's (token, slot) pairs sorted by
expert and each expert's run padded to BLOCK_M rows (a block never mixes experts), then two
launches:

    gate_up   per block of rows and of width: x[token] @ [gate | up] of the block's expert,
              silu(gate) * up fused in the epilogue -> h [pairs, width]
    down      per block of rows and of hidden: h @ down.T of the expert, times the pair's
              routing weight -> out [pairs, hidden]

then each token's pairs are added in increasing expert id order (gpu_worker/layers/
moe_routing.py's `combine`, the order transformers adds in). A row's dot products never mix
with another row's, and the tiles are fixed, so a token's result does not depend on the
other tokens of the step. `reference.py` is the same computation in torch.
"""
