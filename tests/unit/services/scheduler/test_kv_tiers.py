"""The prefix cache's lower tiers as the scheduler runs them: the index (LRU per tier, sizes,
the order rules of one plan), and the policy moving a prompt's blocks down and back up,
checked against a simulated worker that carries each block's contents."""

from __future__ import annotations

import itertools
import random

import pytest

from common.messages import FinishReason, SamplingParams
from common.prefix_hash import prefix_hashes
from services.scheduler.block_manager import BlockManager, HostBlockPool
from services.scheduler.kv_tiers import DISK, FETCHING, HOST, TierIndex, TierMoves
from services.scheduler.policy import PolicyConfig, SchedulingPolicy
from services.scheduler.request import Request
from services.scheduler.step_output import SchedulerOutput


def test_host_lru_spills_the_oldest_to_disk_and_disk_drops_its_oldest() -> None:
    t = TierIndex(num_host_slots=2, num_disk_blocks=2)
    for i, key in enumerate((10, 11, 12, 13)):
        t.save(block=i, key=key, tokens=(key,))
        t.end_plan()
    # host holds the newest two; 10 and 11 went to disk in turn
    assert t.where(12, (12,)) == HOST and t.where(13, (13,)) == HOST
    assert t.where(10, (10,)) == DISK and t.where(11, (11,)) == DISK
    t.save(block=5, key=14, tokens=(14,))
    moves = t.end_plan()
    assert moves.spills == [(moves.saves[0][1], 12, (12,))]  # 12's slot, reused by 14
    assert moves.drops == [10]  # disk full: its oldest file goes
    assert t.where(10, (10,)) is None
    assert t.where(11, (11,)) == DISK and t.where(14, (14,)) == HOST
    t.check_integrity()


def test_a_hit_needs_the_same_tokens_not_only_the_key() -> None:
    t = TierIndex(num_host_slots=2)
    t.save(block=0, key=7, tokens=(1, 2))
    t.end_plan()
    assert t.where(7, (1, 2)) == HOST
    assert t.where(7, (1, 3)) is None


def test_a_slot_a_load_reads_is_not_reused_by_the_same_plan() -> None:
    """Loads run after saves on the worker: the slot is free only once the plan is built."""
    t = TierIndex(num_host_slots=1)
    t.save(block=0, key=1, tokens=(1,))
    t.end_plan()
    t.load(1, block=3)
    t.save(block=4, key=2, tokens=(2,))  # no free slot in this plan: not kept
    moves = t.end_plan()
    assert moves.loads == [(0, 3)] and moves.saves == []
    assert t.num_dropped == 1
    t.save(block=4, key=2, tokens=(2,))  # the next plan has the slot
    assert t.end_plan().saves == [(4, 0)]
    t.check_integrity()


def test_a_block_saved_in_a_plan_is_not_evicted_by_the_same_plan() -> None:
    """Its spill would read the slot before the save writes it."""
    t = TierIndex(num_host_slots=1, num_disk_blocks=4)
    t.save(block=0, key=1, tokens=(1,))
    t.save(block=1, key=2, tokens=(2,))
    moves = t.end_plan()
    assert moves.saves == [(0, 0)] and moves.spills == []
    assert t.where(2, (2,)) is None


def test_fetch_is_answered_and_a_failed_one_forgets_the_file() -> None:
    t = TierIndex(num_host_slots=2, num_disk_blocks=4)
    t.adopt_disk([5, 6], [[5], [6]])  # found at start-up
    assert t.where(5, (5,)) == DISK
    assert t.fetch(5, (5,)) and t.fetch(6, (6,))
    moves = t.end_plan()
    assert [(k, s) for k, _, s in moves.fetches] == [(5, 0), (6, 1)]
    assert t.where(5, (5,)) == FETCHING
    t.on_fetched(ok=[5], failed=[6])
    assert t.where(5, (5,)) == HOST and t.where(6, (6,)) is None
    assert t.num_disk_hits == 1 and t.num_fetch_failures == 1
    t.check_integrity()


def test_a_fetching_slot_is_never_evicted() -> None:
    t = TierIndex(num_host_slots=1, num_disk_blocks=4)
    t.adopt_disk([5], [[5]])
    assert t.fetch(5, (5,))
    t.end_plan()
    t.save(block=0, key=9, tokens=(9,))
    assert t.end_plan().saves == []  # the only slot is being fetched into


def test_a_block_written_and_dropped_in_one_plan_is_neither() -> None:
    t = TierIndex(num_host_slots=1, num_disk_blocks=1)
    t.save(block=0, key=1, tokens=(1,))
    t.end_plan()
    t.save(block=1, key=2, tokens=(2,))
    t.end_plan()  # 1 -> disk
    t.save(block=2, key=3, tokens=(3,))
    moves = t.end_plan()  # 2 -> disk, dropping 1
    assert moves.drops == [1] and [k for _, k, _ in moves.spills] == [2]


# the policy with tiers, against a simulated worker ----------------------------------------
BS = 4


class FakeWorker:
    """Block contents as the worker would hold them: each device block, host slot and file
    holds the tokens whose KV it carries, moved in the plan's documented order."""

    def __init__(self) -> None:
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}
        self.disk: dict[int, tuple[int, ...]] = {}
        self.corrupt: set[int] = set()

    def run(self, moves: TierMoves) -> tuple[list[int], list[int]]:
        for key in moves.drops:
            self.disk.pop(key, None)
        for slot, key, tokens in moves.spills:
            assert self.host[slot] == tokens
            self.disk[key] = tokens
        ok, failed = [], []
        for key, tokens, slot in moves.fetches:
            if key in self.corrupt or self.disk.get(key) != tokens:
                self.disk.pop(key, None)
                failed.append(key)
            else:
                self.host[slot] = tokens
                ok.append(key)
        for block, slot in moves.saves:
            self.host[slot] = self.device[block]
        for slot, block in moves.loads:
            self.device[block] = self.host[slot]
        return ok, failed


def _policy(num_blocks: int, host: int, disk: int) -> SchedulingPolicy:
    cfg = PolicyConfig(max_num_seqs=4, max_num_batched_tokens=64, watermark=0.0)
    bm = BlockManager(num_blocks, BS, record_evictions=True)
    p = SchedulingPolicy(bm, cfg, tiers=TierIndex(host, disk))
    p.set_version("v", root=12345)
    return p


def _serve(p: SchedulingPolicy, w: FakeWorker, rid: str, prompt: list[int]) -> int:
    """Run one request to its end; the prompt tokens its first step did not compute."""
    p.add(Request(rid, prompt, SamplingParams(max_tokens=1, temperature=0.0)))
    cached = None
    for _ in range(50):
        out = p.schedule()
        ok, failed = w.run(out.tiers)
        for s in out.scheduled:
            table = p.blocks.block_tables[rid]
            if cached is None:
                cached = s.num_computed_tokens
                # every block it starts with holds the prompt's own tokens
                for i in range(cached // BS):
                    assert w.device[table[i]] == tuple(prompt[i * BS : (i + 1) * BS])
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                if pos % BS == BS - 1 and pos < len(prompt):
                    w.device[table[pos // BS]] = tuple(prompt[pos - BS + 1 : pos + 1])
        p.tiers.on_fetched(ok, failed)  # type: ignore[union-attr]
        sampled = [s.request.request_id for s in out.scheduled if s.samples]
        p.update(sampled, [1] * len(sampled))
        if rid not in p.requests and out.tiers.is_empty:
            assert cached is not None
            return cached
    raise AssertionError("the request did not finish")


def _prompt(seed: int, n: int = 33) -> list[int]:
    return [seed * 1000 + i for i in range(n)]


def test_a_prompt_evicted_from_the_pool_comes_back_from_host_memory() -> None:
    p, w = _policy(num_blocks=10, host=16, disk=0), FakeWorker()
    a = _prompt(1)
    assert _serve(p, w, "a1", a) == 0
    assert _serve(p, w, "b", _prompt(2)) == 0  # evicts a's blocks
    assert _serve(p, w, "c", _prompt(3)) == 0
    assert _serve(p, w, "a2", a) == 32  # all 8 matchable blocks, from host memory
    assert p.tiers is not None and p.tiers.num_host_hits > 0
    p.check_integrity()


def test_a_prompt_evicted_from_host_memory_comes_back_from_disk() -> None:
    p, w = _policy(num_blocks=10, host=9, disk=64), FakeWorker()
    a = _prompt(1)
    _serve(p, w, "a1", a)
    for i in range(2, 6):
        _serve(p, w, f"x{i}", _prompt(i))
    assert p.tiers is not None
    assert all(
        p.tiers.where(k, tuple(a[i * BS : (i + 1) * BS])) != HOST
        for i, k in enumerate(prefix_hashes(12345, a, BS))
    )
    assert _serve(p, w, "a2", a) == 32
    assert p.tiers.num_disk_hits == 8
    p.check_integrity()


def test_a_corrupted_file_is_recomputed_from_there_on() -> None:
    p, w = _policy(num_blocks=10, host=9, disk=64), FakeWorker()
    a = _prompt(1)
    _serve(p, w, "a1", a)
    for i in range(2, 6):
        _serve(p, w, f"x{i}", _prompt(i))
    keys = list(prefix_hashes(12345, a, BS))
    w.corrupt.add(keys[3])
    assert _serve(p, w, "a2", a) == 3 * BS  # the blocks before the bad one
    assert p.tiers is not None and p.tiers.num_fetch_failures == 1


def test_another_version_never_reads_the_tiers_of_the_old_one() -> None:
    p, w = _policy(num_blocks=10, host=16, disk=64), FakeWorker()
    a = _prompt(1)
    _serve(p, w, "a1", a)
    _serve(p, w, "b", _prompt(2))
    _serve(p, w, "c", _prompt(3))
    p.set_version("w", root=999)  # a hot swap: another root
    assert _serve(p, w, "a2", a) == 0


class FullWorker(FakeWorker):
    """FakeWorker plus the swap pool and the order of a whole plan: tier moves but loads,
    swap-outs, loads, swap-ins, copies; then the step writes the blocks it fills."""

    def __init__(self) -> None:
        super().__init__()
        self.swapped: dict[int, tuple[int, ...]] = {}

    def run_plan(self, out: SchedulerOutput, policy: SchedulingPolicy) -> tuple[list, list]:
        loads, out.tiers.loads = out.tiers.loads, []
        ok, failed = self.run(out.tiers)
        for gpu, host in out.swap_out:
            if gpu in self.device:
                self.swapped[host] = self.device[gpu]
        for slot, block in loads:
            self.device[block] = self.host[slot]
        for host, gpu in out.swap_in:
            if host in self.swapped:
                self.device[gpu] = self.swapped[host]
        for _, _, src, dst in out.copies:
            if src in self.device:
                self.device[dst] = self.device[src]
        for s in out.scheduled:
            req = s.request
            table = policy.blocks.block_tables[req.request_id]
            tokens = req.all_token_ids
            for i in range(s.num_computed_tokens // BS):  # what it reads is its own
                assert self.device.get(table[i]) == tuple(tokens[i * BS : (i + 1) * BS]), (
                    req.request_id,
                    i,
                )
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                if pos % BS == BS - 1:
                    self.device[table[pos // BS]] = tuple(tokens[pos - BS + 1 : pos + 1])
        return ok, failed


@pytest.mark.parametrize("seed", range(12))
def test_random_workload_reads_only_its_own_blocks_through_the_tiers(seed: int) -> None:
    """Shared prefixes, aborts, preemption (recompute or swap), tiny tiers: every block a
    request reads holds its own tokens, whichever tier it came from."""
    rng = random.Random(seed)
    mode = "swap" if seed % 2 else "recompute"
    cfg = PolicyConfig(
        max_num_seqs=4, max_num_batched_tokens=24, watermark=0.0, preemption_mode=mode
    )
    bm = BlockManager(rng.randint(10, 16), BS, record_evictions=True)
    p = SchedulingPolicy(
        bm,
        cfg,
        host_pool=HostBlockPool(8),
        tiers=TierIndex(rng.randint(2, 8), rng.randint(0, 12)),
    )
    p.set_version("v", root=7)
    w = FullWorker()
    bases = [[b * 100 + i for i in range(24)] for b in range(3)]
    ids = itertools.count()
    for _ in range(300):
        r = rng.random()
        if r < 0.2:
            prompt = rng.choice(bases)[: rng.randint(5, 24)] + [rng.randint(1, 9)]
            params = SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0)
            p.add(Request(f"r{next(ids)}", prompt, params))
        elif r < 0.25 and p.requests:
            p.abort(rng.choice(sorted(p.requests)), FinishReason.CANCELLED)
        else:
            out = p.schedule()
            ok, failed = w.run_plan(out, p)
            if rng.random() < 0.1 and out.tiers.fetches:  # a bad file now and then
                bad = out.tiers.fetches[0][0]
                ok, failed = [k for k in ok if k != bad], [*failed, bad]
            assert p.tiers is not None
            p.tiers.on_fetched(ok, failed)
            sampled = [s.request.request_id for s in out.scheduled if s.samples]
            p.update(sampled, [rng.randint(1, 9) for _ in sampled])
        p.check_integrity()
    assert p.tiers is not None and p.tiers.num_saves > 0
