"""Tensor-parallel sharding math (Megatron-style), pure: no torch, no zmq.

Each of N ranks keeps a slice of every large weight; the checkpoint's tensors (HF names,
before q/k/v and gate/up are fused) are cut like this:

    q_proj k_proj v_proj gate_proj up_proj   column-parallel: rows (output features) split,
                                             so rank r owns heads [r*H/N, (r+1)*H/N) and KV
                                             heads [r*K/N, (r+1)*K/N); biases split the same
    qkv_proj gate_up_proj (Phi-3's fused)    fused column-parallel: each part (q | k | v,
                                             gate | up) split as its own layer would be, the
                                             rank's slices of the parts stacked in that order
    o_proj down_proj                         row-parallel: columns (input features) split; the
                                             partial outputs are summed by an all-reduce; a
                                             bias is added once (rank 0 keeps it, others 0)
    embed_tokens lm_head                     vocabulary-parallel: rows split into equal shards
                                             of ceil(V/N), the last one padded with zero rows
    norms (q_norm, k_norm too)               replicated
    MoE experts.{e}.gate/up/down (w1/w3/w2)  each expert like a dense MLP; the router (gate)
                                             and a shared expert's gate replicated
    gpt-oss's stacked experts                gate_up_proj [E, in, 2W] by its columns (dim 2:
                                             adjacent gate/up pairs stay together), its bias
                                             [E, 2W] by dim 1; down_proj [E, W, out] by rows
                                             (dim 1), its bias rank 0 only; MXFP4 blocks and
                                             scales [E, out, groups, ...] of gate/up by out
                                             (dim 1), of down by their 32-value groups (dim 2)
    gpt-oss's sinks [heads]                  split with the heads (dim 0)
    int8 layers (compressed-tensors)         weight and weight_packed as the weight; the scale
                                             [out, 1] split with the rows of a column-parallel
                                             layer, whole on every rank of a row-parallel one

    vocab V=10, N=3: shard 4   rank 0 [0, 4)   rank 1 [4, 8)   rank 2 [8, 10) + 2 pad rows
"""

from __future__ import annotations

import enum

FLAG = "--tensor-parallel-size"


class Split(enum.Enum):
    REPLICATED = "replicated"
    COLUMN = "column"  # dim 0 (out features), even split
    ROW = "row"  # dim 1 (in features), even split
    ROW_BIAS = "row_bias"  # a row-parallel layer's bias: rank 0 only
    VOCAB = "vocab"  # dim 0, padded shards
    FUSED = "fused"  # dim 0, each of the stacked parts split evenly (fused_ranges)
    DIM2 = "dim2"  # dim 2, even split (gpt-oss's stacked experts)

    @property
    def dim(self) -> int | None:
        return {Split.COLUMN: 0, Split.ROW: 1, Split.VOCAB: 0, Split.FUSED: 0, Split.DIM2: 2}.get(
            self
        )


# (w1, w3, w2: Mixtral's experts' gate, up and down)
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
_ROW = ("o_proj", "down_proj", "w2")
_FUSED = ("qkv_proj", "gate_up_proj")  # Phi-3's checkpoint stores them fused
_VOCAB = ("embed_tokens.weight", "lm_head.weight")
# an int8 compressed-tensors checkpoint's shape of a packed weight: whole on every rank
_INT8_META = ("weight_shape",)
# gpt-oss's stacked experts (`mlp.experts.<name>`), float and MXFP4
_STACKED_EXPERTS = {
    "gate_up_proj": Split.DIM2,
    "gate_up_proj_bias": Split.ROW,
    "down_proj": Split.ROW,
    "down_proj_bias": Split.ROW_BIAS,
    "gate_up_proj_blocks": Split.ROW,
    "gate_up_proj_scales": Split.ROW,
    "down_proj_blocks": Split.DIM2,
    "down_proj_scales": Split.DIM2,
}


def split_of(name: str) -> Split:
    """How the checkpoint tensor `name` (HF naming) is cut across ranks."""
    if name.endswith(_VOCAB):
        return Split.VOCAB
    parts = name.split(".")
    layer = parts[-2] if len(parts) >= 2 else ""
    if parts[-1] in _INT8_META:
        return Split.REPLICATED
    if layer == "experts" and parts[-1] in _STACKED_EXPERTS:
        return _STACKED_EXPERTS[parts[-1]]
    if parts[-1] == "sinks":
        return Split.COLUMN
    if layer in _COLUMN:
        return Split.COLUMN
    if layer in _FUSED:
        return Split.FUSED
    if layer in _ROW:
        if parts[-1] in ("weight", "weight_packed"):
            return Split.ROW
        # an int8 row-parallel layer's per-output-row scales: every rank's partial sums
        # are scaled by all of them (gpu_worker/model_loader/compressed_tensors.py)
        return Split.ROW_BIAS if parts[-1] == "bias" else Split.REPLICATED
    return Split.REPLICATED


def even_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of `total` (which `world` must divide)."""
    _check_rank(rank, world)
    if total % world:
        raise ValueError(f"{total} does not divide into {world} equal shards")
    size = total // world
    return rank * size, (rank + 1) * size


def vocab_shard_size(vocab_size: int, world: int) -> int:
    """Rows of each rank's embedding / LM head shard: ceil(V / N) (the last one padded)."""
    return -(-vocab_size // world)


def vocab_range(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """[start, end) of the real vocabulary rows rank owns (end - start may be < the shard
    size on the last ranks, even 0 when V is tiny)."""
    _check_rank(rank, world)
    size = vocab_shard_size(vocab_size, world)
    start = min(rank * size, vocab_size)
    return start, min(start + size, vocab_size)


def shard_range(split: Split, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int]:
    """[start, end) along `split.dim` of a tensor of `shape` that rank keeps."""
    dim = split.dim
    if dim is None:
        raise ValueError(f"a {split.value} tensor is not sliced")
    if split is Split.VOCAB:
        return vocab_range(shape[0], rank, world)
    return even_range(shape[dim], rank, world)


def fused_ranges(parts: tuple[int, ...], rank: int, world: int) -> list[tuple[int, int]]:
    """[start, end) rows rank keeps of a tensor whose rows are `parts` stacked (Phi-3's
    qkv_proj: q, k, v rows; gate_up_proj: gate, up rows): its even share of each part.

        parts (8, 4, 4), world 2:  rank 0 [0, 4) [8, 10) [12, 14)   rank 1 [4, 8) [10, 12) [14, 16)
    """
    ranges, offset = [], 0
    for size in parts:
        start, end = even_range(size, rank, world)
        ranges.append((offset + start, offset + end))
        offset += size
    return ranges


def check_divisible(
    world: int,
    *,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    model: str = "the model",
) -> None:
    """Refuse a model whose heads, KV heads or MLP width do not split evenly over `world`
    ranks (no KV-head replication): a ValueError naming the flag and the numbers."""
    if world < 1:
        raise ValueError(f"{FLAG} must be >= 1, got {world}")
    dims = {
        "attention heads (num_attention_heads)": num_heads,
        "KV heads (num_key_value_heads)": num_kv_heads,
        "MLP width (intermediate_size)": intermediate_size,
    }
    bad = [f"{what} = {n}" for what, n in dims.items() if n % world]
    if bad:
        raise ValueError(
            f"{FLAG} {world} does not divide {model}'s " + ", ".join(bad) + f"; choose a "
            f"size that divides {num_heads} heads, {num_kv_heads} KV heads and "
            f"{intermediate_size}"
        )


def threads_per_rank(num_cores: int, ranks_on_host: int) -> int:
    """Default torch threads of one rank: the host's cores shared out, at least one."""
    return max(1, num_cores // max(1, ranks_on_host))


def _check_rank(rank: int, world: int) -> None:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
