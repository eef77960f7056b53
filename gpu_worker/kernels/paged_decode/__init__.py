"""Paged decode attention: one query token per sequence against its K/V in the paged cache.

Flash-decoding: the context of each sequence is cut into `num_splits` ranges, each range
attended by its own program (so a batch of one long sequence still fills the GPU), and the
partial results are merged with their log-sum-exp:

    stage 1, program (seq b, KV head g, split s):
        o_s = softmax(q K_s^T) V_s     lse_s = log2 sum exp2(scores)   over the range's tokens
    stage 2, program (seq b, query head h):
        o = sum_s 2^(lse_s - max lse) o_s  /  sum_s 2^(lse_s - max lse)

Query heads are grouped by KV head (GQA/MQA): one program holds all the q_per_kv query
heads of a KV head as the rows of one tile, so each K/V token is read once per group.
Split ranges are whole multiples of BLOCK_N and computed on the device from `seq_lens`,
so one launch configuration serves every batch (as a captured CUDA graph needs).
"""
