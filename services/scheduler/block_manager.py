"""Paged KV block accounting with a versioned prefix cache and copy-on-write.

    request r1, block_size 4, 10 tokens:   table [7, 2, 9]
      block 7: t0 t1 t2 t3 | block 2: t4 t5 t6 t7 | block 9: t8 t9 .. ..
               full, hashed           full, hashed           partial, private

Blocks are only ids here; the worker owns the tensors. Every block is in exactly one state:

    free       ref 0, no hash         on the free list
    cached     ref 0, hashed          in the LRU; reusable by a prefix hit, evicted (oldest
                                      first) only when a fresh block is needed
    used       ref >= 1               in that many block tables

so free + cached + used = total. A full block is hashed as a chain,
`h_i = H(h_{i-1}, tokens of block i)`, whose root `h_-1` is the request's cache root:
H(model id, weights version, tokenizer fingerprint, rope config). A new model version has
another root, so no block computed by the old weights can match. A hit is confirmed by
comparing token ids, never by the hash alone. Shared blocks are read-only: before a request
writes into a block that another table also holds (a fork for `n > 1`), the block is copied
(copy-on-write; the worker copies the KV).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque

from common.prefix_hash import block_hash, num_matchable_blocks


class PoolCapacity:
    """What a pool of `num_blocks` blocks of `block_size` tokens holds: its free list, its
    LRU of cached blocks nobody uses and the ref counts (BlockManager's and
    GroupedBlockManager's)."""

    num_blocks: int
    block_size: int
    _free: deque[int]
    _lru: OrderedDict[int, None]
    _ref_counts: list[int]

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones and cached ones nobody uses."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _ref(self, block: int) -> None:
        """One more table holds `block` (a cached one with no user leaves the LRU)."""
        if self._ref_counts[block] == 0:
            del self._lru[block]
        self._ref_counts[block] += 1


class BlockManager(PoolCapacity):
    grouped = False  # (grouped_blocks.py: one table per layer group, for sliding windows)

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        track_hash_changes: bool = False,
        record_evictions: bool = False,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached blocks with no user
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_blocks
        self._owner_of: list[str] = [""] * num_blocks  # the LoRA adapter of a hashed block
        self._by_hash: dict[int, int] = {}
        self.block_tables: dict[str, list[int]] = {}
        # prefill/decode hand-over: blocks being written by an import (ref 1, in no table),
        # by key; each becomes cached under its key once the import landed, or free
        self._importing: dict[int, int] = {}
        # a handed-over sequence's last, partial prompt block, imported and held for it
        # until admission adds it to its table: request id -> (block, tokens it holds)
        self._tails: dict[str, tuple[int, int]] = {}
        self._chains: dict[str, list[int]] = {}  # per request: hashes of its full blocks
        self.num_cached_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_cached_hits = 0  # of which found
        self.num_evictions = 0
        # data parallelism: hash -> cached (True) or evicted (False) since the last
        # drain_hash_changes(), the router's view of this replica; None: nobody asks
        self._hash_changes: dict[int, bool] | None = {} if track_hash_changes else None
        # the prefix cache's lower tiers: (block, hash, tokens) of each cached block evicted
        # since the last drain_evictions(), to be saved before the plan reuses the block
        self._evicted: list[tuple[int, int, tuple[int, ...]]] | None = (
            [] if record_evictions else None
        )

    # capacity: PoolCapacity's ------------------------------------------------------------
    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks `req_id` must add so that its table holds `num_tokens` tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= self.num_free_blocks

    def fork_need(self, num_shared_tokens: int, num_tokens: int) -> int:
        """Blocks past the shared ones, plus one for the copy of a shared partial block."""
        return self.num_blocks_for(num_tokens) - self.num_blocks_for(num_shared_tokens) + 1

    def is_shared(self, req_id: str, position: int) -> bool:
        """Does writing token `position` of req_id land in a block another table holds?"""
        table = self.block_tables.get(req_id, ())
        index = position // self.block_size
        return index < len(table) and self._ref_counts[table[index]] > 1

    # prefix cache -------------------------------------------------------------------------
    def match_prefix(self, root: int, token_ids: list[int]) -> list[int]:
        """Cached blocks holding the longest prefix of `token_ids` (no references taken).

        The block holding the last token is never matched: its token must be computed
        again to sample from, and a block being written must not be shared.
        """
        if not self.enable_prefix_caching:
            return []
        bs, parent, hits = self.block_size, root, []
        for i in range(num_matchable_blocks(len(token_ids), bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent = block_hash(parent, tokens)
            block = self._by_hash.get(parent)
            if block is None or self._tokens_of[block] != tokens:
                break
            hits.append(block)
        return hits

    def hash_after(self, root: int, hits: list[int]) -> int:
        """The chain's hash after `hits` (a match_prefix answer): where a lookup in a lower
        tier goes on."""
        if not hits:
            return root
        h = self._hash_of[hits[-1]]
        assert h is not None, "a prefix hit has a hash"
        return h

    def take_loaded(self, req_id: str, blocks: list[tuple[int, tuple[int, ...]]]) -> list[int]:
        """Append fresh blocks to req_id's table for prefix blocks a lower tier holds
        ((hash, tokens) each, in chain order) and cache them under their hashes; the worker
        copies their KV in before the step. Returns the blocks, in order."""
        table, chain = self.block_tables[req_id], self._chains.setdefault(req_id, [])
        assert len(chain) == len(table), "loaded blocks go right after the prefix hits"
        new_ids = []
        for h, tokens in blocks:
            block = self._fresh()
            table.append(block)
            chain.append(h)
            if h not in self._by_hash:
                self._hash_of[block], self._tokens_of[block] = h, tokens
                self._by_hash[h] = block
                if self._hash_changes is not None:
                    self._hash_changes[h] = True
            new_ids.append(block)
        self.num_cached_hits += len(blocks) * self.block_size
        return new_ids

    def drain_evictions(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """(block, hash, tokens) of the cached blocks evicted since the last call."""
        evicted = self._evicted or []
        if self._evicted:
            self._evicted = []
        return evicted

    def num_hit_blocks_to_take(self, hits: list[int]) -> int:
        """How many of `hits` now sit in the LRU (taking them lowers the free count)."""
        return sum(1 for b in hits if self._ref_counts[b] == 0)

    def take_prefix(self, req_id: str, root: int, hits: list[int], num_prompt_tokens: int) -> None:
        """Start req_id's table with the matched blocks; count the lookup."""
        assert req_id not in self.block_tables or not self.block_tables[req_id]
        for b in hits:
            self._ref(b)
        self.block_tables[req_id] = list(hits)
        self._chains[req_id] = [h for b in hits if (h := self._hash_of[b]) is not None]
        self.num_cached_queries += num_prompt_tokens
        self.num_cached_hits += len(hits) * self.block_size

    def cache_full_blocks(
        self, req_id: str, root: int, token_ids: list[int], num_computed: int, owner: str = ""
    ) -> None:
        """Hash the request's blocks that `num_computed` tokens have filled, so later
        requests can share them; `owner` tags them with the LoRA adapter that computed them
        ("": the base model), for per-adapter counts and drop_cached."""
        if not self.enable_prefix_caching:
            return
        table, chain, bs = (
            self.block_tables[req_id],
            self._chains.setdefault(req_id, []),
            self.block_size,
        )
        for i in range(len(chain), num_computed // bs):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = block_hash(chain[-1] if chain else root, tokens)
            chain.append(h)
            block = table[i]
            if self._hash_of[block] is None and h not in self._by_hash:
                self._hash_of[block], self._tokens_of[block] = h, tokens
                self._owner_of[block] = owner
                self._by_hash[h] = block
                if self._hash_changes is not None:
                    self._hash_changes[h] = True

    def num_hashed_by_owner(self) -> Counter[str]:
        """Hashed blocks (cached or in use) per LoRA adapter, the base model ("") left out."""
        return Counter(o for b, o in enumerate(self._owner_of) if o and self._hash_of[b])

    def drop_cached(self, owner: str) -> int:
        """Forget the cached blocks of LoRA adapter `owner` (unloaded): none is reachable
        by a prefix hit any more; they go back to the free list. Returns how many."""
        dropped = [b for b in self._lru if self._owner_of[b] == owner]
        for b in dropped:
            del self._lru[b]
            h = self._hash_of[b]
            assert h is not None, "a cached block has a hash"
            del self._by_hash[h]
            if self._hash_changes is not None:
                self._hash_changes[h] = False
            self._hash_of[b] = self._tokens_of[b] = None
            self._owner_of[b] = ""
            self._free.append(b)
        return len(dropped)

    def cached_hashes(self) -> list[int]:
        """Hashes of every block the prefix cache can match now (a full resync)."""
        return list(self._by_hash)

    def drain_hash_changes(self) -> tuple[list[int], list[int]]:
        """(hashes cached, hashes evicted) since the last call; each hash in at most one."""
        changes = self._hash_changes
        if not changes:
            return [], []
        self._hash_changes = {}
        return [h for h, c in changes.items() if c], [h for h, c in changes.items() if not c]

    # prefill/decode hand-over ---------------------------------------------------------------
    def cached_block(self, key: int, tokens: tuple[int, ...]) -> int | None:
        """The block cached (or in use) under `key` holding `tokens`, or None."""
        block = self._by_hash.get(key)
        return block if block is not None and self._tokens_of[block] == tokens else None

    def is_importing(self, key: int) -> bool:
        return key in self._importing

    def import_block(self, key: int) -> int:
        """The block the import of `key` writes."""
        return self._importing[key]

    def reserve_import(self, key: int) -> int:
        """A fresh block for the import of `key` (the caller checked can_allocate)."""
        block = self._fresh()
        self._importing[key] = block
        return block

    def finish_import(
        self, key: int, tokens: tuple[int, ...], landed: bool, owner: str = ""
    ) -> None:
        """The import of `key` ended: its block is cached under it (a later request's prefix
        hit; `owner`: the LoRA adapter that computed it), or, when it did not land or the
        key is cached meanwhile, free."""
        block = self._importing.pop(key)
        if landed and self.enable_prefix_caching and key not in self._by_hash:
            self._hash_of[block], self._tokens_of[block] = key, tokens
            self._owner_of[block] = owner
            self._by_hash[key] = block
            if self._hash_changes is not None:
                self._hash_changes[key] = True
        self._unref(block)

    def finish_tail_import(self, key: int, req_id: str, num_tokens: int, landed: bool) -> None:
        """The import of a sequence's partial last block (`key`: never cached) ended: held
        for `req_id` until its admission (take_tail) when it landed, else free."""
        block = self._importing.pop(key)
        if landed:
            self._tails[req_id] = (block, num_tokens)
        else:
            self._unref(block)

    def tail_of(self, req_id: str) -> tuple[int, int] | None:
        """(block, tokens) of the partial block held for `req_id`, if any."""
        return self._tails.get(req_id)

    def free_tail(self, req_id: str) -> None:
        """The partial block held for `req_id` is not used: free."""
        block, _ = self._tails.pop(req_id)
        self._unref(block)

    def take_tail(self, req_id: str) -> None:
        """Admission: the held partial block ends `req_id`'s table (after its prefix hits)."""
        block, _ = self._tails.pop(req_id)
        self.block_tables.setdefault(req_id, []).append(block)

    # allocation ---------------------------------------------------------------------------
    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens`; return the blocks added."""
        need = self.num_new_blocks(req_id, num_tokens)
        if need > self.num_free_blocks:
            raise MemoryError(f"{req_id} needs {need} blocks, {self.num_free_blocks} free")
        new_ids = [self._fresh() for _ in range(need)]
        self.block_tables.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def copy_on_write(self, req_id: str, position: int) -> tuple[int, int, int] | None:
        """Before writing token `position`: if its block is shared, give req_id a private
        copy. Returns (index in table, source block, new block) for the worker, or None."""
        table = self.block_tables[req_id]
        index = position // self.block_size
        if index >= len(table) or self._ref_counts[table[index]] <= 1:
            return None
        if not self.can_allocate(1):
            raise MemoryError(f"{req_id} needs a block to copy, none free")
        src, dst = table[index], self._fresh()
        self._unref(src)
        table[index] = dst
        chain = self._chains.get(req_id)
        if chain is not None:
            del chain[index:]
        return index, src, dst

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> list[int]:
        """Share the parent's blocks that hold its first `num_tokens` tokens with a child."""
        shared = self.block_tables[parent_id][: self.num_blocks_for(num_tokens)]
        for b in shared:
            self._ref(b)
        self.block_tables[child_id] = list(shared)
        full = num_tokens // self.block_size
        self._chains[child_id] = list(self._chains.get(parent_id, [])[:full])
        return list(shared)

    def trim(self, req_id: str, num_tokens: int) -> int:
        """Release the blocks past those that hold the first `num_tokens` tokens (slots of
        rejected draft tokens); return how many were released."""
        table = self.block_tables.get(req_id)
        keep = self.num_blocks_for(num_tokens)
        if not table or len(table) <= keep:
            return 0
        tail = table[keep:]
        del table[keep:]
        chain = self._chains.get(req_id)
        if chain is not None:
            del chain[keep:]
        for b in reversed(tail):
            self._unref(b)
        return len(tail)

    def free(self, req_id: str) -> int:
        """Release the request's blocks (idempotent); return how many no longer have a user."""
        table = self.block_tables.pop(req_id, None)
        self._chains.pop(req_id, None)
        tail = self._tails.pop(req_id, None)  # (never admitted: ended before it started)
        released = self._unref(tail[0]) if tail is not None else 0
        if not table:
            return released
        # tail first: in the LRU, a chain's head outlives its tail, as a prefix should
        return released + sum(self._unref(b) for b in reversed(table))

    def _fresh(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._lru.popitem(last=False)  # least recently used cached block
            evicted = self._hash_of[block]
            assert evicted is not None, "a cached block has a hash"
            del self._by_hash[evicted]
            if self._hash_changes is not None:
                self._hash_changes[evicted] = False
            if self._evicted is not None:
                tokens = self._tokens_of[block]
                assert tokens is not None
                self._evicted.append((block, evicted, tokens))
            self._hash_of[block] = self._tokens_of[block] = None
            self._owner_of[block] = ""
            self.num_evictions += 1
        self._ref_counts[block] = 1
        return block

    def _unref(self, block: int) -> bool:
        self._ref_counts[block] -= 1
        if self._ref_counts[block]:
            return False
        if self._hash_of[block] is not None:
            self._lru[block] = None
        else:
            self._free.append(block)
        return True

    # checks -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any block is lost, double-owned or miscounted."""
        held = Counter(b for table in self.block_tables.values() for b in table)
        held.update(self._importing.values())
        held.update(block for block, _ in self._tails.values())
        free, lru = set(self._free), set(self._lru)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & lru, "a block is both free and cached"
        for b in range(self.num_blocks):
            assert self._ref_counts[b] == held.get(b, 0), f"block {b} refcount is off"
            idle = self._ref_counts[b] == 0
            assert idle == (b in free or b in lru), f"block {b} is lost or double-owned"
            assert (b in lru) <= (self._hash_of[b] is not None), f"cached block {b} has no hash"
            if (block_hash := self._hash_of[b]) is not None:
                assert self._by_hash.get(block_hash) == b, f"block {b} hash map is off"
        assert len(self._by_hash) == sum(h is not None for h in self._hash_of)
        assert len(free) + len(lru) + sum(1 for c in self._ref_counts if c) == self.num_blocks
        for req_id, chain in self._chains.items():
            assert len(chain) <= len(self.block_tables.get(req_id, ())), req_id


class HostBlockPool:
    """Host-memory blocks for swapped-out requests (`--preemption-mode swap`)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"{n} host blocks wanted, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def check_integrity(self, held: list[int]) -> None:
        assert len(set(held)) == len(held), "a host block is held twice"
        assert not set(held) & set(self._free), "a held host block is also free"
        assert len(held) + len(self._free) == self.num_blocks, "a host block is lost"
