"""When waiting requests may be admitted: the three generations of batching, side by side.

- continuous (default): at every step, as budget, sequence cap and blocks allow;
- static: wait until a full batch (max_num_seqs) waits, or the oldest has waited
  `static_batch_timeout` seconds; admit that batch, run it to completion, repeat;
- dynamic: collect for `batch_window` seconds from the first arrival (or until a full
  batch), admit it, run it to completion, repeat.
"""

from __future__ import annotations

BATCH_POLICIES = ("continuous", "static", "dynamic")


class BatchGate:
    """How many waiting requests a step may admit under the batch policy. It holds no timer:
    the scheduler asks at every step, and its actor steps at least every 50 ms
    (services/scheduler/actor.py `_TICK_S`), so a window closes within one tick of its end."""

    def __init__(
        self, policy: str, max_batch: int, batch_window: float, static_batch_timeout: float
    ) -> None:
        if policy not in BATCH_POLICIES:
            raise ValueError(f"unknown batch policy {policy!r}; known: {BATCH_POLICIES}")
        self.policy = policy
        self.max_batch = max_batch
        self.wait_s = batch_window if policy == "dynamic" else static_batch_timeout
        self._num_open = 0  # members of the current batch not yet admitted

    def num_admissible(self, num_running: int, num_waiting: int, oldest_wait_s: float) -> int:
        """How many waiting requests may be admitted now."""
        if self.policy == "continuous":
            return num_waiting
        if self._num_open == 0 and num_running == 0 and num_waiting:
            if num_waiting >= self.max_batch or oldest_wait_s >= self.wait_s:
                self._num_open = min(num_waiting, self.max_batch)
        return min(self._num_open, num_waiting)

    def admitted(self) -> None:
        if self._num_open:
            self._num_open -= 1
