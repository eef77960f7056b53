"""Prefill / extend attention over the paged KV cache, variable-length, in one launch.

Each request r of the batch brings q_len new tokens (packed at query_start_loc[r]) after
num_computed[r] tokens already cached; its new K/V are stored in the cache first (KV store),
so the whole context is read through the block table:

    keys   0 ........ num_computed-1 | num_computed ... seq_len-1
           cached prefix (any length, |  this step's tokens: causal,
           may end mid-block)         |  query i sees keys <= num_computed + i

One program per (request, query head, BLOCK_M new tokens) streams the context in BLOCK_N
tiles with an online softmax (running max and sum), never materialising the score matrix,
and stops at the last key its rows can see. This is what chunked prefill and prefix-cache
hits need; a plain prefill is the case num_computed = 0.
"""
