"""KV layer groups: how a model whose layers attend over different windows splits its KV
cache (vLLM's hybrid KV cache manager, equal-size groups sharing one pool).

    per-layer windows  [512, 512, 512, 512, 512, 0] (Gemma 3: 5 local : 1 global)
    slots per group    G = 1 (the fewest layers of one kind)
    groups             g0: window 0 [layer 5]      g1..g5: window 512 [layer 0] .. [layer 4]
    KV tensor          [G slots, 2, blocks, block_size, kv_heads, head_dim]

Every group holds G layers (the last group of a kind may hold fewer: its spare slots stay
empty), so one block, G layers' KV of `block_size` tokens, has one size whatever group
holds it, and all groups take their blocks from one pool. Layer l keeps its KV in slot
`slot_of[l]` of the blocks in its group's block table. A sliding group's table lets go of
the blocks its window no longer reads, and the pool lends them to any group: a long
sequence holds all its blocks in the global group only. A model without windows has one
group of every layer: G = num_layers, slot l = layer l, the dense layout.
"""

from __future__ import annotations

import dataclasses

PLACEHOLDER = -1  # a sliding group's block table entry whose block went back to the pool


@dataclasses.dataclass(frozen=True)
class LayerGroups:
    windows: tuple[int, ...]  # per group: the window its layers attend over (0: all)
    layers: tuple[tuple[int, ...], ...]  # per group: its layers, one per slot
    group_of: tuple[int, ...]  # per layer
    slot_of: tuple[int, ...]  # per layer
    num_slots: int  # G: layers per group, the KV tensor's first dimension

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def is_dense(self) -> bool:
        return self.windows == (0,)

    @property
    def ref_group(self) -> int:
        return reference_group(self.windows)


def reference_group(windows: tuple[int, ...] | list[int]) -> int:
    """The group whose table stands for a request where one table is asked for (its length
    is the sequence's): the widest window, a global group if there is one."""
    return max(range(len(windows)), key=lambda g: windows[g] or 2**62)


def layer_groups(windows: list[int] | tuple[int, ...], num_layers: int) -> LayerGroups:
    """Group the layers by window (`windows` per layer, empty or all 0: no window)."""
    if num_layers < 1:
        raise ValueError("num_layers must be >= 1")
    per_layer = tuple(windows) if windows else (0,) * num_layers
    if len(per_layer) != num_layers:
        raise ValueError(f"{len(per_layer)} layer windows for {num_layers} layers")
    if any(w < 0 for w in per_layer):
        raise ValueError(f"a layer window is negative: {per_layer}")
    kinds = sorted(set(per_layer))  # window 0 (global) first
    members = {w: [i for i, x in enumerate(per_layer) if x == w] for w in kinds}
    size = min(len(m) for m in members.values())
    group_windows, group_layers = [], []
    for w in kinds:
        m = members[w]
        for start in range(0, len(m), size):
            group_windows.append(w)
            group_layers.append(tuple(m[start : start + size]))
    group_of, slot_of = [0] * num_layers, [0] * num_layers
    for g, layers in enumerate(group_layers):
        for s, layer in enumerate(layers):
            group_of[layer], slot_of[layer] = g, s
    return LayerGroups(
        windows=tuple(group_windows),
        layers=tuple(group_layers),
        group_of=tuple(group_of),
        slot_of=tuple(slot_of),
        num_slots=size,
    )


def blocks_held(windows: tuple[int, ...] | list[int], block_size: int, num_tokens: int,
                chunk: int) -> int:  # fmt: skip
    """The most blocks one sequence of `num_tokens` holds over all groups, computed in
    chunks of at most `chunk` tokens: a global group every block, a sliding group those
    from the window of a chunk's first token to its last (fewer if the sequence is short)."""
    whole = -(-num_tokens // block_size)
    held = 0
    for w in windows:
        held += whole if not w else min(whole, -(-(w - 1 + chunk) // block_size) + 1)
    return held


def max_tokens_in_pool(
    windows: tuple[int, ...] | list[int], num_blocks: int, block_size: int, chunk: int, limit: int
) -> int:
    """The longest sequence (at most `limit` tokens) whose blocks fit in `num_blocks`."""
    if blocks_held(windows, block_size, limit, chunk) <= num_blocks:
        return limit
    lo, hi = 0, limit  # held(lo) fits, held(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if blocks_held(windows, block_size, mid, chunk) <= num_blocks:
            lo = mid
        else:
            hi = mid
    return lo
