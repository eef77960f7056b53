"""The prefix cache's block hash chain, in one place: the block manager keys its cache with it
and the data-parallel router (services/router) matches requests against replicas with it.

    h_-1 = cache root: H(model id, weights version, tokenizer fingerprint, rope config)
    h_i  = H(h_{i-1}, tokens of block i)

`hash()` of a tuple of ints does not depend on PYTHONHASHSEED, so every process on the same
interpreter computes the same chain for the same tokens.
"""

from __future__ import annotations

from collections.abc import Iterator


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    """h_i from h_{i-1} and the tokens of block i."""
    return hash((parent, tokens))


def num_matchable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prompt of `num_tokens` may find cached: never the block that holds the
    last token, which must be computed again to sample from."""
    return max(0, (num_tokens - 1) // block_size)


def prefix_hashes(root: int, token_ids: list[int], block_size: int) -> Iterator[int]:
    """h_0, h_1, ... of the prompt's matchable full blocks, lazily (a caller may stop early)."""
    parent = root
    for i in range(num_matchable_blocks(len(token_ids), block_size)):
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        yield parent
