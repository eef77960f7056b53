"""The prefix cache's lower tiers, as the scheduler sees them: which block keys sit in host
memory (and in which slot) and which on disk, LRU per tier, and the moves a plan asks the
worker to make. Pure: no torch, no sockets; the worker holds the bytes (gpu_worker/kv_tiers.py).

    device pool --evict--> host slots --evict--> files
         ^  load (plan)        ^  fetch (plan; answered in the step's result)
         +---------------------+-----------------+

A key is a block's hash chain value (common/prefix_hash.py), whose root is the model version,
adapter and cache salt: another version never matches another's keys, so the tiers stay
correct across hot swaps and restarts by construction; like the device cache, a hit is
confirmed by the block's token ids, never by the key alone.

Host memory is exclusive of the pool (a block loaded back leaves its slot); disk is
inclusive (a file stays after it is read up, so a block evicted from host memory again is
not written again). Writes go down asynchronously: a spilled key counts as on disk at once
(the worker reads a write still in its queue from memory). Reads come up before a prefill is
planned: a request whose prefix continues on disk waits until the fetch is answered.

Within one plan the worker runs drops, spills, fetches, saves, then loads, so:
- a slot a load reads is freed only when the plan is done (a save of the same plan would
  overwrite it first);
- a slot saved or fetched into by this plan is not evicted by this plan (its spill would
  read the slot before it is written).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, deque

Tokens = tuple[int, ...]

HOST, FETCHING, DISK = "host", "fetching", "disk"


@dataclasses.dataclass
class TierMoves:
    """What one plan asks the worker to do with the tiers (fields as in the StepPlan)."""

    drops: list[int] = dataclasses.field(default_factory=list)  # keys
    spills: list[tuple[int, int, Tokens]] = dataclasses.field(default_factory=list)
    # (slot, key, tokens)
    fetches: list[tuple[int, Tokens, int]] = dataclasses.field(default_factory=list)
    # (key, tokens, slot)
    saves: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (block, slot)
    loads: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (slot, block)

    @property
    def is_empty(self) -> bool:
        return not (self.drops or self.spills or self.fetches or self.saves or self.loads)


@dataclasses.dataclass
class _HostEntry:
    slot: int
    tokens: Tokens
    state: str  # HOST (readable) | FETCHING (a fetch not answered yet)


class TierIndex:
    """Host slots and disk keys, LRU each (oldest first), and the counters stats report."""

    def __init__(self, num_host_slots: int, num_disk_blocks: int = 0) -> None:
        if num_host_slots < 0 or num_disk_blocks < 0:
            raise ValueError("tier sizes must be >= 0")
        self.num_host_slots = num_host_slots
        self.num_disk_blocks = num_disk_blocks
        self._host: OrderedDict[int, _HostEntry] = OrderedDict()
        self._free_slots: deque[int] = deque(range(num_host_slots))
        self._disk: OrderedDict[int, Tokens] = OrderedDict()
        self._moves = TierMoves()
        self._pinned: set[int] = set()  # keys saved or fetched into by the plan being built
        self._freed_after_plan: list[int] = []  # slots loads of this plan read
        self._spilled_in_plan: set[int] = set()
        # counters (blocks)
        self.num_saves = self.num_spills = self.num_dropped = 0
        self.num_host_hits = self.num_disk_hits = self.num_fetch_failures = 0

    # start-up ------------------------------------------------------------------------------
    def adopt_disk(self, keys: list[int], tokens: list[list[int]]) -> None:
        """Blocks the worker found on disk (oldest first): they outlive a restart."""
        for key, toks in zip(keys, tokens, strict=True):
            if len(self._disk) >= self.num_disk_blocks:
                break
            self._disk[key] = tuple(toks)

    # sizes ---------------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.num_host_slots > 0

    @property
    def num_host_blocks(self) -> int:
        return len(self._host)

    @property
    def num_disk_blocks_used(self) -> int:
        return len(self._disk)

    def where(self, key: int, tokens: Tokens) -> str | None:
        """HOST, FETCHING or DISK (the highest tier holding the block), or None."""
        entry = self._host.get(key)
        if entry is not None and entry.tokens == tokens:
            return entry.state
        if self._disk.get(key) == tokens:
            return DISK
        return None

    # down ----------------------------------------------------------------------------------
    def save(self, block: int, key: int, tokens: Tokens) -> None:
        """A full cached block leaves the device pool: keep it in host memory (the worker
        copies it at the plan's start, before anything overwrites the block)."""
        entry = self._host.get(key)
        if entry is not None:
            self._host.move_to_end(key)  # (already there: the copies are the same KV)
            return
        slot = self._take_slot()
        if slot is None:
            self.num_dropped += 1
            return
        self._host[key] = _HostEntry(slot, tokens, HOST)
        self._pinned.add(key)
        self._moves.saves.append((block, slot))
        self.num_saves += 1

    def _take_slot(self) -> int | None:
        """A free host slot, or the least recently used readable one (its block goes down
        to disk); None when every slot is pinned or being fetched into."""
        if self._free_slots:
            return self._free_slots.popleft()
        victim = next(
            (k for k, e in self._host.items() if e.state == HOST and k not in self._pinned),
            None,
        )
        if victim is None:
            return None
        entry = self._host.pop(victim)
        self._spill(victim, entry)
        return entry.slot

    def _spill(self, key: int, entry: _HostEntry) -> None:
        if not self.num_disk_blocks:
            return
        if key in self._disk:
            self._disk.move_to_end(key)  # written once: the file is still there
            return
        while len(self._disk) >= self.num_disk_blocks:
            old, _ = self._disk.popitem(last=False)
            if old in self._spilled_in_plan:  # written and dropped in one plan: neither
                self._moves.spills = [s for s in self._moves.spills if s[1] != old]
                self._spilled_in_plan.discard(old)
            else:
                self._moves.drops.append(old)
        self._disk[key] = entry.tokens
        self._moves.spills.append((entry.slot, key, entry.tokens))
        self._spilled_in_plan.add(key)
        self.num_spills += 1

    # up ------------------------------------------------------------------------------------
    def pin(self, key: int) -> None:
        """Keep a block of a request's prefix from eviction while this plan is built (the
        request's host part must not make room for its disk part, nor a spill drop a file
        it is about to read): the newest in its tier, and a host one pinned."""
        if key in self._host:
            self._host.move_to_end(key)
            self._pinned.add(key)
        elif key in self._disk:
            self._disk.move_to_end(key)

    def fetch(self, key: int, tokens: Tokens) -> bool:
        """Read a disk block up into host memory (answered by the step's result); False
        when no slot is free for it now."""
        assert self._disk.get(key) == tokens and key not in self._host
        self._disk.move_to_end(key)  # (first: a spill making room must not drop it)
        slot = self._take_slot()
        if slot is None:
            return False
        self._host[key] = _HostEntry(slot, tokens, FETCHING)
        self._pinned.add(key)
        self._moves.fetches.append((key, tokens, slot))
        return True

    def on_fetched(self, ok: list[int], failed: list[int]) -> None:
        """The worker's answer to fetches: readable now, or discarded (the file is gone)."""
        for key in ok:
            entry = self._host.get(key)
            if entry is not None and entry.state == FETCHING:
                entry.state = HOST
                self._host.move_to_end(key)
                self.num_disk_hits += 1
        for key in failed:
            entry = self._host.get(key)
            if entry is not None and entry.state == FETCHING:
                del self._host[key]
                self._free_slots.append(entry.slot)  # (nothing reads a slot being fetched)
            self._disk.pop(key, None)
            self.num_fetch_failures += 1

    def load(self, key: int, block: int) -> None:
        """A prefix hit in host memory: copy the slot into device block `block`; the block
        leaves host memory (it is in the pool now)."""
        entry = self._host.pop(key)
        assert entry.state == HOST
        self._moves.loads.append((entry.slot, block))
        self._freed_after_plan.append(entry.slot)
        self.num_host_hits += 1

    # the plan ------------------------------------------------------------------------------
    def end_plan(self) -> TierMoves:
        """The moves of the plan just built; slots its loads read are free from now on."""
        moves, self._moves = self._moves, TierMoves()
        self._free_slots.extend(self._freed_after_plan)
        self._freed_after_plan = []
        self._pinned.clear()
        self._spilled_in_plan.clear()
        return moves

    def stats(self, block_bytes: int) -> dict[str, int]:
        return {
            "host_blocks": len(self._host),
            "host_capacity_blocks": self.num_host_slots,
            "host_bytes": len(self._host) * block_bytes,
            "disk_blocks": len(self._disk),
            "disk_capacity_blocks": self.num_disk_blocks,
            "disk_bytes": len(self._disk) * block_bytes,
            "host_hits": self.num_host_hits,
            "disk_hits": self.num_disk_hits,
            "saves": self.num_saves,
            "spills": self.num_spills,
            "dropped": self.num_dropped,
            "fetch_failures": self.num_fetch_failures,
        }

    def check_integrity(self) -> None:
        slots = [e.slot for e in self._host.values()]
        held = set(slots) | set(self._free_slots) | set(self._freed_after_plan)
        assert len(slots) == len(set(slots)), "a host slot is held twice"
        assert len(held) == len(slots) + len(self._free_slots) + len(self._freed_after_plan)
        assert held == set(range(self.num_host_slots)), "a host slot is lost"
        assert len(self._disk) <= self.num_disk_blocks, "the disk tier is over its size"
