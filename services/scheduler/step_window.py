"""The window of steps in flight: plans sent to the worker and not yet answered, oldest
first (the worker answers in order), and the timings of the steps it answered.

    open(): a plan leaves   [step 7][step 8]   close(): the result of step 7 comes back

With async scheduling the window holds two steps, so the worker starts the next plan while
the scheduler digests the last result; one otherwise.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque

from common.messages import StepResult

log = logging.getLogger(__name__)


@dataclasses.dataclass
class InFlightStep:
    step_id: int
    seq_keys: list[str]
    sent_at: float


class StepWindow:
    """The steps in flight (at most `max_in_flight`) and the counters `stats` reports."""

    def __init__(self, max_in_flight: int) -> None:
        self.max_in_flight = max_in_flight
        self.in_flight: deque[InFlightStep] = deque()
        self.step_counter = 0  # the last step id given out
        self.num_steps = 0  # steps answered
        self.step_time_s = 0.0
        self.worker_time_s = 0.0
        # result-to-result intervals of back-to-back steps, against the worker's own time
        self.interval_s = self.interval_forward_s = self._last_result_at = 0.0
        self.num_intervals = 0
        self._busy_since_last_result = False
        # a mixture of experts: (token, expert) pairs per expert since the served model was
        # adopted (StepResult's; EngineCore.adopt restarts them)
        self.expert_tokens: list[int] = []

    @property
    def has_room(self) -> bool:
        return len(self.in_flight) < self.max_in_flight

    def open(self, seq_keys: list[str]) -> int:
        """A plan for these sequences leaves now: its step id."""
        self.step_counter += 1
        self.in_flight.append(InFlightStep(self.step_counter, seq_keys, time.perf_counter()))
        return self.step_counter

    def planned(self) -> None:
        """Planning stopped: whether the worker is busy until the next result."""
        self._busy_since_last_result = bool(self.in_flight)

    def close(self, msg: StepResult) -> InFlightStep | None:
        """The step `msg` answers, out of the window; None if it is not the oldest."""
        if not self.in_flight or msg.step_id != self.in_flight[0].step_id:
            log.warning("unexpected step result %d", msg.step_id)
            return None
        return self.in_flight.popleft()

    def clear(self) -> None:
        """Forget the steps in flight: the worker that would answer them is gone."""
        self.in_flight.clear()

    def count(self, step: InFlightStep, msg: StepResult) -> None:
        """A step's result came back: its time, and the interval since the last result."""
        self.num_steps += 1
        now = time.perf_counter()
        self.step_time_s += now - step.sent_at
        self.worker_time_s += msg.forward_s
        if msg.expert_tokens:
            if len(msg.expert_tokens) != len(self.expert_tokens):  # another model: restart
                self.expert_tokens = [0] * len(msg.expert_tokens)
            self.expert_tokens = [
                a + b for a, b in zip(self.expert_tokens, msg.expert_tokens, strict=True)
            ]
        if self._busy_since_last_result and self._last_result_at:
            # back-to-back steps: the gap beyond the worker's own time is scheduling cost
            self.interval_s += now - self._last_result_at
            self.interval_forward_s += msg.forward_s
            self.num_intervals += 1
        self._last_result_at = now
