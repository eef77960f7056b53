"""The block manager's layer groups (sliding windows): out-of-window blocks go back to the
pool, prefix hits per group, copy-on-write per group, preemption, and the integrity check
(free + cached + used = total, each group's blocks its own) under random operations."""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kv_groups import PLACEHOLDER, blocks_held, layer_groups, max_tokens_in_pool
from common.messages import FinishReason, ModelInfo, SamplingParams
from services.scheduler.block_manager import HostBlockPool
from services.scheduler.current_model import CurrentModel
from services.scheduler.grouped_blocks import GroupedBlockManager
from services.scheduler.kv_tiers import TierIndex
from services.scheduler.policy import PolicyConfig, SchedulerOutput, SchedulingPolicy
from services.scheduler.request import Request


def test_layer_groups_split_gemma3_proportions_into_equal_groups() -> None:
    groups = layer_groups([8, 8, 8, 8, 8, 0] * 2, 12)
    assert groups.num_slots == 2 and groups.windows == (0, 8, 8, 8, 8, 8)
    assert groups.layers[0] == (5, 11) and groups.layers[1] == (0, 1)
    assert groups.group_of[11] == 0 and groups.slot_of[11] == 1
    dense = layer_groups([], 4)
    assert dense.is_dense and dense.num_slots == 4 and dense.slot_of == (0, 1, 2, 3)
    alternating = layer_groups([0, 16] * 3, 6)  # gpt-oss, Gemma 2
    assert alternating.windows == (0, 16) and alternating.num_slots == 3
    with pytest.raises(ValueError, match="3 layer windows for 4 layers"):
        layer_groups([0, 1, 2], 4)


def test_sliding_group_releases_blocks_out_of_the_window() -> None:
    bm = GroupedBlockManager(64, 4, [0, 8])
    bm.allocate("a", 40)  # 10 blocks per group
    bm.cache_full_blocks("a", 1, list(range(40)), 40)
    # the next token is t40, it reads t33..t40: blocks 8.. of the sliding group
    assert bm.release_out_of_window("a", 40) == 8
    glob, slide = bm.tables["a"]
    assert PLACEHOLDER not in glob and len(glob) == 10
    assert slide[:8] == [PLACEHOLDER] * 8 and PLACEHOLDER not in slide[8:]
    assert bm.num_used_blocks == 12 and bm.num_cached_blocks == 8  # full, hashed: cached
    assert bm.release_out_of_window("a", 40) == 0  # idempotent
    bm.check_integrity()
    assert bm.free("a") == 12
    assert bm.num_free_blocks == 64
    bm.check_integrity()


def test_a_decoding_sequence_holds_a_window_of_blocks_in_a_sliding_group() -> None:
    bs, window = 4, 10
    bm = GroupedBlockManager(200, bs, [0, window])
    for position in range(300):  # decode one token at a time
        bm.release_out_of_window("a", position)
        bm.allocate("a", position + 1)
        held = [b for b in bm.tables["a"][1] if b != PLACEHOLDER]
        assert len(held) <= -(-window // bs) + 1
    assert len(bm.tables["a"][0]) == 75
    bm.check_integrity()


def test_prefix_hit_needs_the_global_prefix_and_the_sliding_window() -> None:
    bs = 4
    bm = GroupedBlockManager(64, bs, [0, 8])
    tokens = list(range(33))
    bm.allocate("a", 33)
    bm.cache_full_blocks("a", 1, tokens, 33)
    bm.release_out_of_window("a", 32)
    bm.free("a")
    hits = bm.match_prefix(1, tokens)
    assert hits.num_blocks == 8  # the block of the last token is never matched
    assert PLACEHOLDER not in hits.tables[0]
    # t32 reads t25..t32: sliding blocks 6 and 7 only
    assert hits.tables[1][:6] == [PLACEHOLDER] * 6 and PLACEHOLDER not in hits.tables[1][6:]
    assert bm.hit_tokens(hits) == 32
    bm.take_prefix("b", 1, hits, 33)
    bm.check_integrity()
    assert bm.num_used_blocks == 10
    bm.free("b")
    # another root: no hit in any group
    assert bm.match_prefix(2, tokens).num_blocks == 0
    bm.check_integrity()


def test_prefix_hit_shrinks_to_what_the_sliding_group_still_caches() -> None:
    bs = 4
    bm = GroupedBlockManager(64, bs, [0, 8])
    tokens = list(range(33))
    bm.allocate("a", 33)
    bm.cache_full_blocks("a", 1, tokens, 33)
    sliding_7 = bm.tables["a"][1][7]
    bm.free("a")
    # the sliding group's block 7 goes (its hash forgotten): a hit of 8 blocks lacks it,
    # a hit of 7 needs sliding blocks 5 and 6 (t28 reads t21..t28) and has them
    bm._lru.move_to_end(sliding_7, last=False)
    bm.allocate("x", 4 * 25)  # 50 blocks: every free one (48) and the 2 oldest cached
    assert bm._hash_of[sliding_7] is None
    hits = bm.match_prefix(1, tokens)
    assert hits.num_blocks == 7
    assert hits.tables[1][:5] == [PLACEHOLDER] * 5
    bm.check_integrity()


def test_copy_on_write_per_group_and_forks() -> None:
    bm = GroupedBlockManager(32, 4, [0, 8])
    bm.allocate("p", 6)
    assert bm.can_fork("p", 5)
    shared = bm.fork("p", "c", 5)
    assert shared == bm.tables["p"]
    assert bm.is_shared("c", 5) == 2
    copies = bm.copy_on_write("c", 5)
    assert [(g, i) for g, i, _, _ in copies] == [(0, 1), (1, 1)]
    for g, _, src, dst in copies:
        assert src == bm.tables["p"][g][1] and dst == bm.tables["c"][g][1]
    assert bm.copy_on_write("c", 5) == []
    bm.check_integrity()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 32
    bm.check_integrity()


def test_a_fork_is_refused_once_the_parent_released_what_it_reads() -> None:
    bm = GroupedBlockManager(64, 4, [0, 8])
    bm.allocate("p", 30)
    bm.release_out_of_window("p", 29)  # the parent decodes on
    assert bm.can_fork("p", 29) and not bm.can_fork("p", 12)


def test_trim_and_free_give_back_every_block() -> None:
    bm = GroupedBlockManager(64, 4, [0, 4, 4])
    bm.allocate("a", 20)
    bm.release_out_of_window("a", 16)
    bm.allocate("a", 28)
    assert bm.trim("a", 21) == 3 * 1 + 0  # block 6 of each group (block 5 holds t20)
    bm.check_integrity()
    bm.free("a")
    assert bm.num_free_blocks == 64
    bm.check_integrity()


def test_blocks_per_group_for_stats() -> None:
    bm = GroupedBlockManager(64, 4, [0, 8])
    bm.allocate("a", 40)
    bm.cache_full_blocks("a", 1, list(range(40)), 40)
    bm.release_out_of_window("a", 40)
    per_group = bm.num_blocks_by_group()
    assert per_group == [
        {"window": 0, "num_used_blocks": 10, "num_cached_blocks": 0},
        {"window": 8, "num_used_blocks": 2, "num_cached_blocks": 8},
    ]


def test_policy_refuses_tiers_by_name() -> None:
    with pytest.raises(ValueError, match="KV tiers"):
        SchedulingPolicy(GroupedBlockManager(8, 4, [0, 4]), tiers=TierIndex(4, 0))


class _Worker:
    """Mirrors the worker's per-group tables from the plans' diffs; checks that every
    block a step reads (its window in a sliding group) is a real block of the request."""

    def __init__(self, bm: GroupedBlockManager) -> None:
        self.bm = bm
        self.tables: dict[str, list[list[int]]] = {}
        self.computed: dict[str, int] = {}

    def run(self, out: SchedulerOutput) -> list[str]:
        bm = self.bm
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.tables[rid] = [[] for _ in bm.windows]
        assert len(out.copy_groups) == len(out.copies)
        for (rid, index, _src, dst), group in zip(out.copies, out.copy_groups, strict=True):
            table = self.tables.get(rid, [[] for _ in bm.windows])[group]
            if index < len(table):
                table[index] = dst
        reads: dict[int, str] = {}
        sampled = []
        for s in out.scheduled:
            rid = s.request.request_id
            tables = self.tables.setdefault(rid, [[] for _ in bm.windows])
            assert s.new_group_block_ids is not None
            for t, new in zip(tables, s.new_group_block_ids, strict=True):
                t.extend(new)
            end = s.num_computed_tokens + s.num_new_tokens
            for g, t in enumerate(tables):
                assert len(t) * bm.block_size >= end, "blocks do not cover the tokens"
                for i in range(bm.window_start(g, s.num_computed_tokens), bm.num_blocks_for(end)):
                    b = t[i]
                    assert b != PLACEHOLDER, f"{rid} reads a released block (group {g})"
                    # a block this step reads is the same block the scheduler has there
                    assert bm.tables[rid][g][i] == b, f"{rid} group {g} block {i} moved"
                    reads.setdefault(b, rid)
            if s.samples:
                sampled.append(rid)
        return sampled


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10**9),
    num_blocks=st.integers(16, 64),
    budget=st.integers(1, 40),
    depth=st.sampled_from([1, 2]),
    windows=st.sampled_from([[0, 6], [0, 9, 9], [5], [0, 4, 12]]),
    mode=st.sampled_from(["recompute", "swap"]),
)
def test_random_operations_keep_every_invariant_with_groups(
    seed: int, num_blocks: int, budget: int, depth: int, windows: list[int], mode: str
) -> None:
    rng = random.Random(seed)
    clock = [0.0]
    bm = GroupedBlockManager(num_blocks, 4, windows)
    s = SchedulingPolicy(
        bm,
        PolicyConfig(
            max_num_seqs=rng.randint(1, 8),
            max_num_batched_tokens=budget,
            watermark=0.0,
            preemption_mode=mode,
        ),
        host_pool=HostBlockPool(rng.choice([0, 8, 64])),
        clock=lambda: clock[0],
    )
    worker, in_flight, root, n_ids = _Worker(bm), deque(), 1, 0
    max_len = num_blocks * 4 // len(windows)
    for _ in range(200):
        op = rng.random()
        if op < 0.12:
            n_ids += 1
            plen = rng.randint(1, max(1, max_len // 2))
            prompt = [rng.choice([1, 2]) for _ in range(plen)]
            n = rng.choice([1, 1, 1, 2, 3])
            sp = SamplingParams(max_tokens=rng.randint(1, 12), n=n)
            leader = None
            for i in range(n):
                rid = f"r{n_ids}" if n == 1 else f"r{n_ids}#{i}"
                req = Request(
                    rid,
                    prompt,
                    sp,
                    eos_token_ids=(0,),
                    max_model_len=max_len,
                    cache_root=root,
                    fork_of=leader,
                    arrival_time=clock[0],
                )
                leader = leader or req
                s.add(req)
        elif op < 0.17 and s.requests:
            s.abort(rng.choice(sorted(s.requests)), FinishReason.CANCELLED)
        elif op < 0.19:
            root += 1
        elif op < 0.6 and len(in_flight) < depth and s.has_work():
            out = s.schedule()
            assert out.num_tokens <= budget
            in_flight.append(worker.run(out))
        elif in_flight:
            sampled = in_flight.popleft()
            s.update(sampled, [rng.choice([0, 5, 6, 7]) for _ in sampled])
        clock[0] += 0.01
        s.check_integrity()
    for _ in range(10_000):
        if not (s.has_work() or in_flight or s.requests):
            break
        if len(in_flight) < depth and s.has_work():
            in_flight.append(worker.run(s.schedule()))
        elif in_flight:
            sampled = in_flight.popleft()
            s.update(sampled, [5] * len(sampled))
        s.check_integrity()
    assert not s.requests and not in_flight
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == num_blocks
    assert s.host_pool.num_free_blocks == s.host_pool.num_blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_policy_preempts_with_groups(mode: str) -> None:
    bm = GroupedBlockManager(14, 4, [0, 8])
    config = PolicyConfig(max_num_batched_tokens=64, watermark=0.0, preemption_mode=mode)
    s = SchedulingPolicy(bm, config, host_pool=HostBlockPool(32))
    for rid in ("a", "b"):
        s.add(Request(rid, [1] * 12, SamplingParams(max_tokens=20), eos_token_ids=(0,),
                      max_model_len=64, cache_root=1))  # fmt: skip
    for _ in range(40):
        if not s.has_work():
            break
        out = s.schedule()
        s.check_integrity()
        sampled = [x.request.request_id for x in out.scheduled if x.samples]
        s.update(sampled, [5] * len(sampled))
        s.check_integrity()
    assert s.num_preemptions >= 1 and (s.num_swaps >= 1) == (mode == "swap")
    assert not s.requests and bm.num_used_blocks == 0
    assert s.host_pool.num_free_blocks == 32


def test_the_longest_sequence_a_grouped_pool_holds() -> None:
    # global group: every block; sliding group (window 8, chunks of 8): at most 5
    assert blocks_held([0, 8], 4, 100, 8) == 25 + 5
    assert max_tokens_in_pool([0, 8], 30, 4, 8, 1000) == 100
    assert max_tokens_in_pool([8], 6, 4, 8, 1000) == 1000  # all sliding: the window only
    assert max_tokens_in_pool([0], 30, 4, 8, 50) == 50
    info = ModelInfo(
        model_type="gemma3_text", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
        num_blocks=30, block_size=4, max_model_len=1000, vocab_size=0, eos_token_ids=[],
        weights_version="v", kv_group_windows=[0, 8],
    )  # fmt: skip
    assert CurrentModel(info=info, name="m", root=1, chunk=8).max_model_len == 100
