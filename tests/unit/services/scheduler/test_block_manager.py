"""Block manager: allocation, freeing, and its invariants under random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager


def test_allocate_grows_table_by_whole_blocks() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 1) == [0]
    assert bm.allocate("a", 4) == []  # still fits in block 0
    assert bm.allocate("a", 5) == [1]
    assert bm.allocate("a", 16) == [2, 3]
    assert bm.block_tables["a"] == [0, 1, 2, 3]
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_free_is_idempotent_and_returns_blocks() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    bm.allocate("a", 5)
    assert bm.free("a") == 3
    assert bm.free("a") == 0
    assert bm.num_free_blocks == 4
    bm.check_integrity()


def test_over_allocation_raises_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=2, block_size=2)
    bm.allocate("a", 3)
    with pytest.raises(MemoryError):
        bm.allocate("b", 1)
    assert "b" not in bm.block_tables
    bm.check_integrity()


def test_can_allocate_respects_reserve() -> None:
    bm = BlockManager(num_blocks=10, block_size=16)
    assert bm.can_allocate(9, reserve=1)
    assert not bm.can_allocate(10, reserve=1)


def test_integrity_check_catches_a_lost_block() -> None:
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 2)
    bm.block_tables["a"].clear()  # corrupt: block 0 is now owned by nobody but counted
    with pytest.raises(AssertionError):
        bm.check_integrity()


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 5), st.integers(1, 40)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(seq: list[tuple[str, int, int]]) -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sizes: dict[str, int] = {}
    for op, who, n in seq:
        rid = f"r{who}"
        if op == "alloc":
            target = sizes.get(rid, 0) + n
            if bm.can_allocate(bm.num_new_blocks(rid, target)):
                bm.allocate(rid, target)
                sizes[rid] = target
            else:
                with pytest.raises(MemoryError):
                    bm.allocate(rid, target)
        else:
            bm.free(rid)
            sizes.pop(rid, None)
        bm.check_integrity()
        for rid, size in sizes.items():
            assert len(bm.block_tables[rid]) == bm.num_blocks_for(size)
    for rid in list(sizes):
        bm.free(rid)
    assert bm.num_free_blocks == 16


def test_blocks_are_counted_per_lora_adapter_and_dropped_on_unload() -> None:
    bm = BlockManager(8, 2, track_hash_changes=True)
    tokens = [1, 2, 3, 4, 5]
    for rid, owner, root in [("a", "A", 11), ("base", "", 0)]:
        bm.allocate(rid, 5)
        bm.cache_full_blocks(rid, root, tokens, 5, owner=owner)
    assert bm.num_hashed_by_owner() == {"A": 2}  # (the base model is not counted)
    bm.free("a")
    bm.drain_hash_changes()
    assert bm.drop_cached("A") == 2
    assert bm.match_prefix(11, tokens) == [] and bm.num_hashed_by_owner() == {}
    assert len(bm.drain_hash_changes()[1]) == 2  # the router hears they are gone
    assert bm.match_prefix(0, tokens) != []  # the base model's blocks stay
    bm.free("base")
    bm.check_integrity()
