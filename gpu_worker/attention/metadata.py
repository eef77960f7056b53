"""Attention metadata for one step: every scheduled request's new tokens packed end to end.

    request   r0 (decode)   r1 (decode)   r2 (extend: 5 cached + 3 new)
    tokens    [t0]          [t1]          [t2 t3 t4]
    query_start_loc  0  1  2  5           seq_lens  [c0+1, c1+1, 8]

Single-token decodes come first (`num_decodes` of them) so a backend can run them as one
batch; the rest are prefill or extend chunks, causal among their new tokens and attending to
their earlier tokens through the block table. Built once per step and passed as an argument
into the model's forward, never read from a global.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch


@dataclasses.dataclass(frozen=True)
class AttentionMetadata:
    """What every attention backend needs to know about the step's packed batch."""

    positions: torch.Tensor  # [T] int64, position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset to store K/V in
    query_start_loc: torch.Tensor  # [B + 1] int32, token range of request b
    seq_lens: torch.Tensor  # [B] int32, context length including this step's tokens
    num_computed: torch.Tensor  # [B] int32, tokens already in the KV cache before this step
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with block 0
    block_size: int
    # requests [0, num_decodes) compute exactly one token each and own tokens [0, num_decodes)
    num_decodes: int
    # host copies of the same numbers, for per-request loops without a device sync
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    num_computed_host: list[int]
    # KV layer groups (common/kv_groups.py): per group, this metadata with the group's block
    # tables and slot mapping (a layer of group g attends with group_metas[g]); () for one
    # dense group
    group_metas: tuple[AttentionMetadata, ...] = dataclasses.field(default=(), kw_only=True)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]


def num_leading_decodes(num_new_tokens: list[int]) -> int:
    """How many requests at the front of the batch compute exactly one token."""
    n = 0
    while n < len(num_new_tokens) and num_new_tokens[n] == 1:
        n += 1
    return n


def build_metadata(
    num_computed: list[int],
    num_new_tokens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Pack a batch. Put single-token decodes first to let backends batch them."""
    num_reqs = len(num_new_tokens)
    assert len(num_computed) == num_reqs == len(block_tables) and num_reqs > 0
    qsl = [0]
    for n in num_new_tokens:
        qsl.append(qsl[-1] + n)
    seq_lens = [c + n for c, n in zip(num_computed, num_new_tokens, strict=True)]
    for seq_len, blocks in zip(seq_lens, block_tables, strict=True):
        if len(blocks) * block_size < seq_len:
            raise ValueError(f"{len(blocks)} blocks of {block_size} cannot hold {seq_len} tokens")
    table = _block_table(block_tables)
    positions, slots = _positions_and_slots(
        num_computed, num_new_tokens, qsl, block_tables, table, block_size
    )
    ints = torch.tensor([*qsl, *seq_lens, *num_computed], dtype=torch.int32)  # one conversion
    return AttentionMetadata(
        positions=_on(positions, device),
        slot_mapping=_on(slots, device),
        query_start_loc=_on(ints[: num_reqs + 1], device),
        seq_lens=_on(ints[num_reqs + 1 : 2 * num_reqs + 1], device),
        num_computed=_on(ints[2 * num_reqs + 1 :], device),
        block_tables=_on(table, device),
        block_size=block_size,
        num_decodes=num_leading_decodes(num_new_tokens),
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
        num_computed_host=list(num_computed),
    )


def group_metadata(
    meta: AttentionMetadata,
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """`meta` (of the same batch, in the same order) with another layer group's block
    tables and slot mapping. A sliding group's table holds -1 where its block went back to
    the pool: such an entry is out of the window of every token of the step, never read; it
    becomes block 0 here (a valid index for a backend that gathers the whole table and masks)."""
    table = _block_table(block_tables).clamp_(min=0)
    _, slots = _positions_and_slots(
        meta.num_computed_host,
        [b - a for a, b in itertools.pairwise(meta.query_start_loc_host)],
        meta.query_start_loc_host,
        block_tables,
        table,
        block_size,
    )
    return dataclasses.replace(
        meta,
        slot_mapping=_on(slots, device),
        block_tables=_on(table, device),
    )


def _on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """t (built on the host) on `device`: itself on the CPU (no dispatch)."""
    return t if torch.device(device).type == "cpu" else t.to(device, non_blocking=True)


def _block_table(block_tables: list[list[int]]) -> torch.Tensor:
    """[B, max_blocks] int32, each row padded with block 0."""
    width = max(1, max(len(t) for t in block_tables))
    flat = [b for t in block_tables for b in (*t, *[0] * (width - len(t)))]
    return torch.tensor(flat, dtype=torch.int32).view(len(block_tables), width)


# tokens up to which positions and slots are listed in Python: a decode step's few cost less
# so than as arrays (each array operation ~10 us right after a forward, caches cold)
_LISTED_TOKENS = 256


def _positions_and_slots(
    num_computed: list[int],
    num_new_tokens: list[int],
    qsl: list[int],
    block_tables: list[list[int]],
    table: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token t of request r sits at num_computed[r] + (t - start[r]); its slot is its
    block's id * block_size + its offset in the block (block_tables as lists, table the
    same padded: a token's own block is never a padding or a -1 entry). [T] int64 each."""
    if qsl[-1] <= _LISTED_TOKENS:
        listed: list[int] = []  # the positions, then the slots
        slot_of: list[int] = []
        for blocks, c, n in zip(block_tables, num_computed, num_new_tokens, strict=True):
            span = range(c, c + n)
            listed += span
            slot_of += (blocks[p // block_size] * block_size + p % block_size for p in span)
        both = torch.tensor(listed + slot_of, dtype=torch.int64)  # (flat: a nested list
        return both[: qsl[-1]], both[qsl[-1] :]  # converts ~5x slower)
    counts = torch.tensor(num_new_tokens, dtype=torch.int64)  # vectorised on the host
    req_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [T]
    starts = torch.tensor(qsl[:-1], dtype=torch.int64)[req_of_token]
    offsets = torch.tensor(num_computed, dtype=torch.int64)[req_of_token]
    positions = torch.arange(qsl[-1], dtype=torch.int64) - starts + offsets
    block_ids = table[req_of_token, positions // block_size].to(torch.int64)
    return positions, block_ids * block_size + positions % block_size
