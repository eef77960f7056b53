"""Which waiting requests may start this step under `--max-loras` (pure, no sockets).

At most `max_loras` distinct adapters run in one step (the worker has that many adapter
slots); running requests' adapters count, the base model ("") never does. The waiting queue
is walked in its order (FCFS or priority):

    request of the base model, or of an adapter already in the step   -> may start
    request of a new adapter, and a slot is left                      -> may start
    request of a new adapter, no slot left                            -> skipped: younger
        requests of adapters already in the step (and the base model) may pass it, but no
        younger request of another new adapter does (it would take the slot it waits for)

No starvation: a request skipped in `max_skips` schedules stops the walk at itself (strict
FCFS from then on), so the adapters in the step drain and it gets the next free slot.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from services.scheduler.request import Request

MAX_SKIPS = 32  # schedules a request of a new adapter may be passed in before all wait


class AdmissionVerdict(enum.IntEnum):
    START = 0  # try to start it now
    SKIP = 1  # leave it waiting, look at the next
    STOP = 2  # nothing more starts this step


class LoraGate:
    """One step's adapter bookkeeping over the waiting queue; see the module docstring."""

    def __init__(self, max_loras: int, max_skips: int = MAX_SKIPS) -> None:
        self.max_loras = max_loras  # 0: no limit (LoRA off)
        self.max_skips = max_skips
        self.active: set[str] = set()
        self._blocked = False  # a request of a new adapter waits for a slot this step
        self._skips: dict[str, int] = {}  # request id -> schedules it was skipped in

    def begin(self, running: Iterable[Request]) -> None:
        """A new schedule: the adapters the running requests hold."""
        self.active = {r.lora_name for r in running if r.lora_name}
        self._blocked = False

    def verdict(self, req: Request) -> AdmissionVerdict:
        name = req.lora_name
        if not self.max_loras or not name or name in self.active:
            return AdmissionVerdict.START
        if not self._blocked and len(self.active) < self.max_loras:
            return AdmissionVerdict.START
        self._blocked = True
        skips = self._skips.get(req.request_id, 0) + 1
        self._skips[req.request_id] = skips
        return AdmissionVerdict.STOP if skips > self.max_skips else AdmissionVerdict.SKIP

    def started(self, req: Request) -> None:
        if req.lora_name:
            self.active.add(req.lora_name)
        self._skips.pop(req.request_id, None)

    def forget(self, request_id: str) -> None:
        """A request left the waiting queue another way (finished, aborted)."""
        self._skips.pop(request_id, None)
