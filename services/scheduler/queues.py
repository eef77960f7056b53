"""The waiting queue: first come first served, or by priority (lower value first)."""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from services.scheduler.request import Request


class WaitingQueue:
    """FCFS: arrival order, preempted requests back at the head. Priority: ordered by
    (priority, arrival); a preempted request keeps its place by the same key."""

    def __init__(self, policy: str = "fcfs") -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self._items: list[Request] = []
        self._keys: list[tuple[int, int]] = []
        self._num_front = 0  # FCFS head insertions get ever smaller keys, so keys stay sorted

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def _key(self, req: Request) -> tuple[int, int]:
        return (req.priority if self.policy == "priority" else 0, req.arrival_seq)

    def push(self, req: Request) -> None:
        key = self._key(req)
        i = bisect.bisect_right(self._keys, key)
        self._items.insert(i, req)
        self._keys.insert(i, key)

    def push_front(self, req: Request) -> None:
        """A preempted request: FCFS puts it first; priority puts it by its key."""
        if self.policy == "priority":
            self.push(req)
            return
        self._num_front += 1
        self._items.insert(0, req)
        self._keys.insert(0, (0, -self._num_front))

    def __getitem__(self, i: int) -> Request:
        return self._items[i]

    def peek(self) -> Request:
        return self._items[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._items.pop(0)

    def remove(self, req: Request) -> None:
        i = self._items.index(req)
        del self._items[i]
        del self._keys[i]
