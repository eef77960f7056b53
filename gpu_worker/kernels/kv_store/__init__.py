"""KV store: write a step's new K and V into the paged cache by slot.

    kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
    token t  ->  slot = slot_mapping[t] = block_id * block_size + offset

A negative slot is padding (a CUDA-graph bucket's unused rows): that token is not written.
`kernel.store_kv` is the Triton launcher, `reference.store_kv_reference` the torch one.
"""
