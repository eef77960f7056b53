"""Paged KV blocks for a model with sliding-window layers: one block table per layer group
(common/kv_groups.py), all groups' blocks from one pool.

    window 8, block_size 4, 22 tokens computed (the next token to compute is t22):
      global group   [7, 2, 9, 4, 11, 5]       every block of the sequence
      sliding group  [-, -, -, 3, 12, 8]       t22 reads t15..t22: blocks 3.. only

A sliding group's table keeps an entry per block of the sequence, and `PLACEHOLDER` where
the block went back to the pool: blocks that fall wholly before the window of the next
token to compute (every later token's window starts later still) are released as soon as
the policy has advanced the request (`release_out_of_window`). A released full block is
hashed: it goes to the LRU like any cached block and may serve a later prefix hit.

Every block is in one state, as in block_manager.py: free (no group), cached (ref 0,
hashed, in the LRU, of one group) or used (ref >= 1, in that many tables of one group),
so free + cached + used = total, and each group's cached and used blocks are counted.

The prefix cache: each group has its own map hash -> block (one hash chain of the
request's tokens, one block per group for it). A hit of k blocks needs every block of the
global groups' first k, and in each sliding group the blocks that the token at k *
block_size still reads; the longest k that every group serves is the hit.

The worker's copy of a table may keep a released block's id: the block is outside the
window of every token the request still computes, so no kernel reads it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, deque

from common.kv_groups import PLACEHOLDER, reference_group
from common.prefix_hash import block_hash, num_matchable_blocks
from services.scheduler.block_manager import PoolCapacity

GroupTables = list[list[int]]  # per group: a block table


@dataclasses.dataclass(frozen=True)
class GroupHits:
    """A prefix hit: per group its blocks (PLACEHOLDER before a sliding window), and the
    chain's hashes of the hit blocks."""

    tables: GroupTables
    chain: list[int]

    @property
    def num_blocks(self) -> int:
        return len(self.chain)


NO_HITS = GroupHits([], [])


class GroupedBlockManager(PoolCapacity):
    grouped = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: list[int] | tuple[int, ...],
        enable_prefix_caching: bool = True,
        track_hash_changes: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if not windows or any(w < 0 for w in windows):
            raise ValueError(f"layer group windows must be >= 0, one per group: {windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = tuple(windows)
        self.num_groups = len(self.windows)
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._ref_counts = [0] * num_blocks
        self._group_of = [-1] * num_blocks  # -1: free
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._owner_of: list[str] = [""] * num_blocks
        self._by_hash: list[dict[int, int]] = [{} for _ in self.windows]
        self.tables: dict[str, GroupTables] = {}
        # the group whose table stands for the request where one table is asked for
        self.ref_group = reference_group(self.windows)
        self.block_tables: dict[str, list[int]] = {}  # the ref group's tables
        self._released: dict[str, list[int]] = {}  # per request and group: entries released
        self._chains: dict[str, list[int]] = {}
        self.num_cached_queries = 0
        self.num_cached_hits = 0
        self.num_evictions = 0
        self.num_released = 0  # blocks sliding groups let go of (out of their window)
        self._hash_changes: dict[int, bool] | None = {} if track_hash_changes else None

    # capacity (num_free_blocks, usage, ...: PoolCapacity's) ------------------------------
    def window_start(self, group: int, position: int) -> int:
        """The first block of `group` that a token at `position` reads."""
        w = self.windows[group]
        return max(0, position - w + 1) // self.block_size if w else 0

    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        tables = self.tables.get(req_id)
        have = [len(t) for t in tables] if tables else [0] * self.num_groups
        want = self.num_blocks_for(num_tokens)
        return sum(max(0, want - h) for h in have)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= self.num_free_blocks

    def is_shared(self, req_id: str, position: int) -> int:
        """How many groups' blocks for token `position` another table also holds."""
        tables = self.tables.get(req_id)
        if not tables:
            return 0
        index = position // self.block_size
        return sum(
            1
            for t in tables
            if index < len(t) and t[index] != PLACEHOLDER and self._ref_counts[t[index]] > 1
        )

    def num_blocks_by_group(self) -> list[dict[str, int]]:
        """Per group: its window, the blocks in use and the cached ones (for /admin/stats)."""
        used, cached = Counter[int](), Counter[int]()
        for b in range(self.num_blocks):
            if self._ref_counts[b]:
                used[self._group_of[b]] += 1
        for b in self._lru:
            cached[self._group_of[b]] += 1
        return [
            {"window": w, "num_used_blocks": used[g], "num_cached_blocks": cached[g]}
            for g, w in enumerate(self.windows)
        ]

    # admission ----------------------------------------------------------------------------
    def hit_tokens(self, hits: GroupHits) -> int:
        return hits.num_blocks * self.block_size

    def start_need(self, hits: GroupHits, start: int, end: int) -> int:
        """Blocks from the pool that computing tokens [start, end) takes after the hits:
        per group, the blocks from the window of `start` to `end`, less the hits there,
        plus the hits in the LRU (taking them lowers the free count)."""
        need = 0
        for g in range(self.num_groups):
            lo = self.window_start(g, start)
            held = max(0, self.num_blocks_for(end) - lo)
            real = [b for b in (hits.tables[g][lo:] if hits.tables else []) if b != PLACEHOLDER]
            need += held - len(real) + sum(1 for b in real if self._ref_counts[b] == 0)
        return need

    def fork_need(self, num_shared_tokens: int, num_tokens: int) -> int:
        return self.num_groups * (
            self.num_blocks_for(num_tokens) - self.num_blocks_for(num_shared_tokens) + 1
        )

    def can_fork(self, parent_id: str, num_tokens: int) -> bool:
        """Does the parent still hold every block a child that computes from token
        `num_tokens` reads (a sliding group may have released them)?"""
        tables = self.tables.get(parent_id)
        if not tables:
            return False
        first = self.num_blocks_for(num_tokens)
        for g, t in enumerate(tables):
            lo = self.window_start(g, num_tokens)
            if len(t) < first or any(b == PLACEHOLDER for b in t[lo:first]):
                return False
        return True

    # prefix cache -------------------------------------------------------------------------
    def match_prefix(self, root: int, token_ids: list[int]) -> GroupHits:
        """Per group, the cached blocks of the longest prefix every group serves (the
        sliding groups' entries before their window are PLACEHOLDER); no references
        taken."""
        if not self.enable_prefix_caching:
            return NO_HITS
        bs, parent, chain = self.block_size, root, []
        # per block of the chain: per group its cached block or None
        found: list[list[int | None]] = []
        for i in range(num_matchable_blocks(len(token_ids), bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            row: list[int | None] = []
            for g in range(self.num_groups):
                b = self._by_hash[g].get(parent)
                row.append(b if b is not None and self._tokens_of[b] == tokens else None)
            if all(b is None for b in row):
                break
            found.append(row)
            chain.append(parent)
        for k in range(len(found), 0, -1):
            if all(
                all(found[i][g] is not None for i in range(self.window_start(g, k * bs), k))
                for g in range(self.num_groups)
            ):
                tables: GroupTables = []
                for g in range(self.num_groups):
                    lo = self.window_start(g, k * bs)
                    tables.append([PLACEHOLDER] * lo)
                    for i in range(lo, k):
                        b = found[i][g]
                        assert b is not None
                        tables[g].append(b)
                return GroupHits(tables, chain[:k])
        return NO_HITS

    def num_hit_blocks_to_take(self, hits: GroupHits) -> int:
        return sum(
            1 for t in hits.tables for b in t if b != PLACEHOLDER and self._ref_counts[b] == 0
        )

    def take_prefix(self, req_id: str, root: int, hits: GroupHits, num_prompt_tokens: int) -> None:
        assert not self.tables.get(req_id) or not any(self.tables[req_id])
        tables = [list(t) for t in hits.tables] if hits.tables else [[] for _ in self.windows]
        for t in tables:
            for b in t:
                if b != PLACEHOLDER:
                    self._ref(b)
        self._set_tables(req_id, tables)
        self._released[req_id] = [sum(1 for b in t if b == PLACEHOLDER) for t in tables]
        self._chains[req_id] = list(hits.chain)
        self.num_cached_queries += num_prompt_tokens
        self.num_cached_hits += hits.num_blocks * self.block_size

    def cache_full_blocks(
        self, req_id: str, root: int, token_ids: list[int], num_computed: int, owner: str = ""
    ) -> None:
        if not self.enable_prefix_caching:
            return
        tables, chain, bs = (
            self.tables[req_id],
            self._chains.setdefault(req_id, []),
            self.block_size,
        )
        for i in range(len(chain), num_computed // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(chain[-1] if chain else root, tokens)
            chain.append(h)
            for g, table in enumerate(tables):
                block = table[i]
                if block == PLACEHOLDER or self._hash_of[block] is not None:
                    continue
                if h not in self._by_hash[g]:
                    self._hash_of[block], self._tokens_of[block] = h, tokens
                    self._owner_of[block] = owner
                    self._by_hash[g][h] = block
                    if self._hash_changes is not None and g == self.ref_group:
                        self._hash_changes[h] = True

    def num_hashed_by_owner(self) -> Counter[str]:
        return Counter(o for b, o in enumerate(self._owner_of) if o and self._hash_of[b])

    def drop_cached(self, owner: str) -> int:
        dropped = [b for b in self._lru if self._owner_of[b] == owner]
        for b in dropped:
            del self._lru[b]
            self._forget_hash(b)
            self._group_of[b] = -1
            self._free.append(b)
        return len(dropped)

    def cached_hashes(self) -> list[int]:
        return list(self._by_hash[self.ref_group])

    def drain_hash_changes(self) -> tuple[list[int], list[int]]:
        changes = self._hash_changes
        if not changes:
            return [], []
        self._hash_changes = {}
        return [h for h, c in changes.items() if c], [h for h, c in changes.items() if not c]

    def drain_evictions(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return []  # (no lower tiers for grouped models: refused at start)

    # allocation ---------------------------------------------------------------------------
    def table_lengths(self, req_id: str) -> list[int]:
        tables = self.tables.get(req_id)
        return [len(t) for t in tables] if tables else [0] * self.num_groups

    def blocks_since(self, req_id: str, lengths: list[int] | None) -> GroupTables:
        """Per group, the entries past `lengths` (all of them for None)."""
        tables = self.tables[req_id]
        if lengths is None:
            return [list(t) for t in tables]
        return [t[n:] for t, n in zip(tables, lengths, strict=True)]

    def allocate(self, req_id: str, num_tokens: int) -> GroupTables:
        """Grow every group's table to hold `num_tokens`; return the blocks added."""
        need = self.num_new_blocks(req_id, num_tokens)
        if need > self.num_free_blocks:
            raise MemoryError(f"{req_id} needs {need} blocks, {self.num_free_blocks} free")
        if req_id not in self.tables:
            self._set_tables(req_id, [[] for _ in self.windows])
            self._released[req_id] = [0] * self.num_groups
        want, added = self.num_blocks_for(num_tokens), []
        for g, table in enumerate(self.tables[req_id]):
            new_ids = [self._fresh(g) for _ in range(max(0, want - len(table)))]
            table.extend(new_ids)
            added.append(new_ids)
        return added

    def layout(self, req_id: str) -> tuple[list[int], list[list[bool]]]:
        """The request's blocks, group by group in table order, and which entries of each
        table are blocks (a swap-out copies those, a swap-in puts them back)."""
        tables = self.tables.get(req_id, [])
        blocks = [b for t in tables for b in t if b != PLACEHOLDER]
        return blocks, [[b != PLACEHOLDER for b in t] for t in tables]

    def allocate_layout(self, req_id: str, layout: list[list[bool]]) -> list[int]:
        """Tables of fresh blocks where `layout` has blocks (PLACEHOLDER elsewhere) for a
        request swapped back in; returns the blocks in layout's order."""
        need = sum(sum(t) for t in layout)
        if need > self.num_free_blocks:
            raise MemoryError(f"{req_id} needs {need} blocks, {self.num_free_blocks} free")
        assert not self.tables.get(req_id) or not any(self.tables[req_id])
        tables = [
            [self._fresh(g) if real else PLACEHOLDER for real in t] for g, t in enumerate(layout)
        ]
        self._set_tables(req_id, tables)
        self._released[req_id] = [sum(1 for b in t if b == PLACEHOLDER) for t in tables]
        self._chains[req_id] = []
        return [b for t in tables for b in t if b != PLACEHOLDER]

    def release_out_of_window(self, req_id: str, position: int) -> int:
        """The next token `req_id` computes is at `position`: each sliding group lets go
        of the blocks before that token's window. Returns how many went back."""
        tables, done = self.tables.get(req_id), self._released.get(req_id)
        if not tables or done is None:
            return 0
        released = 0
        for g, table in enumerate(tables):
            if not self.windows[g]:
                continue
            upto = min(self.window_start(g, position), len(table))
            for i in range(done[g], upto):
                b = table[i]
                if b != PLACEHOLDER:
                    table[i] = PLACEHOLDER
                    self._unref(b)
                    released += 1
            done[g] = max(done[g], upto)
        self.num_released += released
        return released

    def copy_on_write(self, req_id: str, position: int) -> list[tuple[int, int, int, int]]:
        """Before writing token `position`: per group whose block is shared, a private
        copy. Returns (group, index in table, source block, new block) for the worker."""
        tables = self.tables[req_id]
        index = position // self.block_size
        shared = [
            g
            for g, t in enumerate(tables)
            if index < len(t) and t[index] != PLACEHOLDER and self._ref_counts[t[index]] > 1
        ]
        if not shared:
            return []
        if not self.can_allocate(len(shared)):
            raise MemoryError(f"{req_id} needs {len(shared)} blocks to copy, too few free")
        copies = []
        for g in shared:
            src, dst = tables[g][index], self._fresh(g)
            self._unref(src)
            tables[g][index] = dst
            copies.append((g, index, src, dst))
        chain = self._chains.get(req_id)
        if chain is not None:
            del chain[index:]
        return copies

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> GroupTables:
        n = self.num_blocks_for(num_tokens)
        shared = [list(t[:n]) for t in self.tables[parent_id]]
        for t in shared:
            for b in t:
                if b != PLACEHOLDER:
                    self._ref(b)
        self._set_tables(child_id, [list(t) for t in shared])
        self._released[child_id] = [sum(1 for b in t if b == PLACEHOLDER) for t in shared]
        self._chains[child_id] = list(
            self._chains.get(parent_id, [])[: num_tokens // self.block_size]
        )
        return shared

    def trim(self, req_id: str, num_tokens: int) -> int:
        tables = self.tables.get(req_id)
        keep = self.num_blocks_for(num_tokens)
        released = 0
        for g, table in enumerate(tables or []):
            if len(table) <= keep:
                continue
            tail = table[keep:]
            del table[keep:]
            for b in reversed(tail):
                if b != PLACEHOLDER:
                    self._unref(b)
                    released += 1
            done = self._released.get(req_id)
            if done is not None:
                done[g] = min(done[g], keep)
        chain = self._chains.get(req_id)
        if chain is not None:
            del chain[keep:]
        return released

    def free(self, req_id: str) -> int:
        tables = self.tables.pop(req_id, None)
        self.block_tables.pop(req_id, None)
        self._chains.pop(req_id, None)
        self._released.pop(req_id, None)
        if not tables:
            return 0
        return sum(self._unref(b) for t in tables for b in reversed(t) if b != PLACEHOLDER)

    def _set_tables(self, req_id: str, tables: GroupTables) -> None:
        self.tables[req_id] = tables
        self.block_tables[req_id] = tables[self.ref_group]

    def _forget_hash(self, block: int) -> None:
        h = self._hash_of[block]
        assert h is not None, "a cached block has a hash"
        del self._by_hash[self._group_of[block]][h]
        if self._hash_changes is not None and self._group_of[block] == self.ref_group:
            self._hash_changes[h] = False
        self._hash_of[block] = self._tokens_of[block] = None
        self._owner_of[block] = ""

    def _fresh(self, group: int) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)
            self._forget_hash(block)
            self.num_evictions += 1
        self._ref_counts[block] = 1
        self._group_of[block] = group
        return block

    def _unref(self, block: int) -> bool:
        self._ref_counts[block] -= 1
        if self._ref_counts[block]:
            return False
        if self._hash_of[block] is not None:
            self._lru[block] = None
        else:
            self._group_of[block] = -1
            self._free.append(block)
        return True

    # checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any block is lost, double-owned, in the wrong group or
        miscounted; per group, its tables' blocks are its own and its hash map is exact."""
        held = Counter(
            b for tables in self.tables.values() for t in tables for b in t if b != PLACEHOLDER
        )
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & lru, "a block is both free and cached"
        for tables in self.tables.values():
            assert len(tables) == self.num_groups, "a request lacks a group's table"
            for g, t in enumerate(tables):
                for b in t:
                    assert b == PLACEHOLDER or self._group_of[b] == g, f"block {b} not group {g}'s"
        for b in range(self.num_blocks):
            assert self._ref_counts[b] == held.get(b, 0), f"block {b} refcount is off"
            idle = self._ref_counts[b] == 0
            assert idle == (b in free or b in lru), f"block {b} is lost or double-owned"
            assert (b in free) == (self._group_of[b] == -1), f"block {b} group is off"
            assert (b in lru) <= (self._hash_of[b] is not None), f"cached block {b} has no hash"
            if (h := self._hash_of[b]) is not None:
                assert self._by_hash[self._group_of[b]].get(h) == b, f"block {b} hash map is off"
        assert sum(len(m) for m in self._by_hash) == sum(h is not None for h in self._hash_of)
        per_group = self.num_blocks_by_group()
        counted = sum(g["num_used_blocks"] + g["num_cached_blocks"] for g in per_group)
        assert len(free) + counted == self.num_blocks, "free + cached + used != total"
        for req_id, chain in self._chains.items():
            assert len(chain) <= len(self.block_tables.get(req_id, ())), req_id
        for req_id, tables in self.tables.items():
            assert self.block_tables[req_id] is tables[self.ref_group], req_id
