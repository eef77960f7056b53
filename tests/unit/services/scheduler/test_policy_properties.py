"""Property-based: random sequences of add / step / result / abort / timeout / version
change drive the policy, with forks (n > 1), both preemption modes, both queue policies and
up to two steps in flight; after every operation the integrity check holds (free + cached +
used = total, references match tables, host blocks accounted), and in the end every request
finishes and every block comes back."""

from __future__ import annotations

import random
from collections import deque

from hypothesis import given, settings
from hypothesis import strategies as st

from common.messages import FinishReason, SamplingParams
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.policy import PolicyConfig, SchedulerOutput, SchedulingPolicy
from services.scheduler.request import Request


class _Worker:
    """Mirrors what the worker would hold, to check the plans' diffs are consistent."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def run(self, out: SchedulerOutput) -> list[str]:
        for rid in out.finished_req_ids:
            self.tables.pop(rid, None)
            self.computed.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.tables[rid] = []
        for rid, index, _src, dst in out.copies:
            table = self.tables.get(rid, [])
            if index < len(table):
                table[index] = dst
        sampled = []
        for s in out.scheduled:
            rid = s.request.request_id
            table = self.tables.setdefault(rid, [])
            if not table:
                self.computed[rid] = s.num_computed_tokens
            assert self.computed.get(rid, 0) == s.num_computed_tokens, rid
            table.extend(s.new_block_ids)
            self.computed[rid] = s.num_computed_tokens + s.num_new_tokens
            assert len(table) * 4 >= self.computed[rid], "blocks do not cover the tokens"
            assert len(set(table)) == len(table), "a block twice in one table"
            if s.samples:
                sampled.append(rid)
        return sampled


@settings(max_examples=50, deadline=None)
@given(
    seed=st.integers(0, 10**9),
    num_blocks=st.integers(8, 48),
    budget=st.integers(1, 40),
    depth=st.sampled_from([1, 2]),
    mode=st.sampled_from(["recompute", "swap"]),
    queue=st.sampled_from(["fcfs", "priority"]),
)
def test_random_operations_keep_every_invariant(
    seed: int, num_blocks: int, budget: int, depth: int, mode: str, queue: str
) -> None:
    rng = random.Random(seed)
    clock = [0.0]
    s = SchedulingPolicy(
        BlockManager(num_blocks, 4),
        PolicyConfig(
            max_num_seqs=rng.randint(1, 8),
            max_num_batched_tokens=budget,
            watermark=0.0,
            preemption_mode=mode,
            scheduling_policy=queue,
        ),
        host_pool=HostBlockPool(rng.choice([0, 8, 64])),
        clock=lambda: clock[0],
    )
    worker, in_flight, root, n_ids = _Worker(), deque(), 1, 0
    max_len = num_blocks * 4
    for _ in range(200):
        op = rng.random()
        if op < 0.12:  # a request, sometimes n > 1, sometimes sharing a prefix
            n_ids += 1
            plen = rng.randint(1, max(1, max_len // 3))
            prompt = [rng.choice([1, 2]) for _ in range(plen)]
            n = rng.choice([1, 1, 1, 2, 3])
            sp = SamplingParams(max_tokens=rng.randint(1, 10), n=n)
            leader, priority = None, rng.randint(0, 3)
            for i in range(n):
                rid = f"r{n_ids}" if n == 1 else f"r{n_ids}#{i}"
                req = Request(
                    rid,
                    prompt,
                    sp,
                    eos_token_ids=(0,),
                    max_model_len=max_len,
                    cache_root=root,
                    priority=priority,
                    fork_of=leader,
                    timeout=rng.choice([None, None, 5.0]),
                    arrival_time=clock[0],
                )
                leader = leader or req
                s.add(req)
        elif op < 0.17 and s.requests:
            s.abort(rng.choice(sorted(s.requests)), FinishReason.CANCELLED)
        elif op < 0.19:
            root += 1  # a model version change: new requests hash differently
        elif op < 0.21:
            s.expire(now_wall=clock[0] + rng.choice([0.0, 10.0]))
        elif op < 0.6 and len(in_flight) < depth and s.has_work():
            out = s.schedule()
            assert out.num_tokens <= budget
            in_flight.append(worker.run(out))
        elif in_flight:
            sampled = in_flight.popleft()
            s.update(sampled, [rng.choice([0, 5, 6, 7]) for _ in sampled])
        clock[0] += 0.01
        s.check_integrity()
    # drain: everything admitted must finish and give its blocks back
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
    assert s.blocks.num_used_blocks == 0
    assert s.blocks.num_free_blocks == num_blocks
    assert s.host_pool.num_free_blocks == s.host_pool.num_blocks


def test_a_new_root_never_matches_old_blocks() -> None:
    bm = BlockManager(16, 4)
    bm.allocate("a", 9)
    bm.cache_full_blocks("a", 1, list(range(9)), 9)
    assert len(bm.match_prefix(1, list(range(9)))) == 2
    assert bm.match_prefix(2, list(range(9))) == []
    bm.free("a")
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 16
    bm.check_integrity()


def test_hit_is_confirmed_by_token_ids_not_hash_alone() -> None:
    bm = BlockManager(8, 2)
    bm.allocate("a", 3)
    bm.cache_full_blocks("a", 7, [5, 6, 9], 3)
    block = bm.block_tables["a"][0]
    bm._tokens_of[block] = (5, 99)  # as if another prefix had collided on the same hash
    assert bm.match_prefix(7, [5, 6, 1]) == []


def test_lru_evicts_least_recently_used_cached_block_first() -> None:
    bm = BlockManager(3, 2)
    for rid, toks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        bm.allocate(rid, 3)
        bm.cache_full_blocks(rid, 0, toks, 3)
        bm.free(rid)
    assert bm.num_cached_blocks == 2
    bm.allocate("c", 2)  # takes the one free block
    bm.allocate("d", 2)  # must evict: a's block is the oldest
    assert bm.match_prefix(0, [1, 2, 3]) == [] and len(bm.match_prefix(0, [4, 5, 6])) == 1
    assert bm.num_evictions == 1
    bm.check_integrity()


def test_copy_on_write_gives_a_private_block() -> None:
    bm = BlockManager(8, 4)
    bm.allocate("p", 6)
    shared = bm.fork("p", "c", 5)
    assert shared == bm.block_tables["p"]
    index, src, dst = bm.copy_on_write("c", 5)
    assert (index, src) == (1, bm.block_tables["p"][1]) and dst not in bm.block_tables["p"]
    assert bm.copy_on_write("c", 5) is None  # now private
    bm.check_integrity()
    bm.free("p")
    bm.free("c")
    assert bm.num_free_blocks == 8
