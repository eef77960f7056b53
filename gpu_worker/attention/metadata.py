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
    max_blocks = max(1, max(len(t) for t in block_tables))
    table = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    positions, slots = _positions_and_slots(num_computed, num_new_tokens, qsl, table, block_size)
    return AttentionMetadata(
        positions=positions.to(device, non_blocking=True),
        slot_mapping=slots.to(device, non_blocking=True),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        num_computed=torch.tensor(num_computed, dtype=torch.int32, device=device),
        block_tables=table.to(device, non_blocking=True),
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
    max_blocks = max(1, max(len(t) for t in block_tables))
    table = torch.zeros(len(block_tables), max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    table.clamp_(min=0)
    _, slots = _positions_and_slots(
        meta.num_computed_host,
        [b - a for a, b in itertools.pairwise(meta.query_start_loc_host)],
        meta.query_start_loc_host,
        table,
        block_size,
    )
    return dataclasses.replace(
        meta,
        slot_mapping=slots.to(device, non_blocking=True),
        block_tables=table.to(device, non_blocking=True),
    )


def _positions_and_slots(
    num_computed: list[int],
    num_new_tokens: list[int],
    qsl: list[int],
    table: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised on the host: token t of request r sits at num_computed[r] + (t - start[r])."""
    counts = torch.tensor(num_new_tokens, dtype=torch.int64)
    req_of_token = torch.repeat_interleave(torch.arange(len(counts)), counts)  # [T]
    starts = torch.tensor(qsl[:-1], dtype=torch.int64)[req_of_token]
    offsets = torch.tensor(num_computed, dtype=torch.int64)[req_of_token]
    positions = torch.arange(qsl[-1], dtype=torch.int64) - starts + offsets
    block_ids = table[req_of_token, positions // block_size].to(torch.int64)
    return positions, block_ids * block_size + positions % block_size
