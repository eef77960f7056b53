"""Paged KV block accounting: a free list, reference counts, one block table per request.

    request r1, block_size 4, 10 tokens:   table [7, 2, 9]
      block 7: t0 t1 t2 t3 | block 2: t4 t5 t6 t7 | block 9: t8 t9 .. ..

Blocks are only ids here; the worker owns the tensors. Reference counts leave room for
shared (prefix-cached, copy-on-write) blocks: a block returns to the free list when its
count drops to zero. Invariant: free + referenced = total, and each referenced block's count
equals the number of tables that hold it.
"""

from __future__ import annotations

from collections import Counter, deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, req_id: str, num_tokens: int) -> int:
        """Blocks `req_id` must add so that its table holds `num_tokens` tokens."""
        have = len(self.block_tables.get(req_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, num_blocks: int, reserve: int = 0) -> bool:
        return num_blocks + reserve <= len(self._free)

    def allocate(self, req_id: str, num_tokens: int) -> list[int]:
        """Grow the request's table to hold `num_tokens`; return the blocks added."""
        need = self.num_new_blocks(req_id, num_tokens)
        if need > len(self._free):
            raise MemoryError(f"{req_id} needs {need} blocks, {len(self._free)} free")
        new_ids = [self._free.popleft() for _ in range(need)]
        for b in new_ids:
            self._ref_counts[b] += 1
        self.block_tables.setdefault(req_id, []).extend(new_ids)
        return new_ids

    def free(self, req_id: str) -> int:
        """Release the request's blocks (idempotent); return how many went back to the list."""
        table = self.block_tables.pop(req_id, None)
        if not table:
            return 0
        released = 0
        for b in reversed(table):  # tail first: the head blocks are the likeliest to be shared
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
                released += 1
        return released

    def check_integrity(self) -> None:
        """Raise AssertionError if any block is lost, double-freed or miscounted."""
        held = Counter(b for table in self.block_tables.values() for b in table)
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            assert self._ref_counts[b] == held.get(b, 0), f"block {b} refcount is off"
            assert (b in free) == (self._ref_counts[b] == 0), f"block {b} is lost or double-owned"
        assert len(free) + sum(1 for c in self._ref_counts if c) == self.num_blocks
