"""The requests this gateway has in flight, one row each, as the operator console shows them
(services/gateway/http/console/): who asked for which model or adapter, its state, its
tokens so far, its time to first token and its age.

It is fed by the engine client's observer hook (`EngineClient.observer`, the seam /metrics
times requests through), so it sees exactly the requests `generate()` holds:

    generate() called ──▶ queued ──first token──▶ running ──last delta / failure / close──▶ gone
    (row added, "started")                                         (row dropped, "finished")

Besides the rows it keeps only running totals (tokens out, finished requests, the sums of
their TTFTs and end-to-end times), from which a reader computes throughput and latency over
any interval as the difference of two readings, as a Prometheus counter is read.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from common.messages import FinishReason, GenerateRequest
from services.gateway.engine.client import OutputDelta, RequestObserver

# what a listener hears: ("started" | "finished", the request's row)
Listener = Callable[[str, dict[str, Any]], None]
ObserverFactory = Callable[[GenerateRequest], RequestObserver]


@dataclasses.dataclass(slots=True)
class Totals:
    """Running totals over every request that ended here (a counter each)."""

    num_finished: int = 0
    num_output_tokens: int = 0  # tokens streamed, counted as they come
    num_with_first_token: int = 0
    ttft_sum_s: float = 0.0  # over the requests that had a first token
    e2e_sum_s: float = 0.0  # over every finished request


@dataclasses.dataclass(slots=True)
class LiveRequest:
    """One request in flight at this gateway."""

    request_id: str
    model: str  # the LoRA adapter it runs with, else the served model's name
    arrival: float  # time.time() when generate() took it
    n: int
    max_tokens: int  # 0: as many as fit
    state: str = "queued"  # queued | running | then its finish reason, or "failed"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all its sequences together
    ttft_s: float | None = None
    version: str = ""  # the model version serving it, once the engine said

    def row(self, now: float) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "model": self.model,
            "state": self.state,
            "n": self.n,
            "max_tokens": self.max_tokens,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "elapsed_s": round(now - self.arrival, 3),
            "arrival": self.arrival,
            "version": self.version,
        }


class LiveRequests:
    """The registry: `observe` is an observer factory for `EngineClient.observer`."""

    def __init__(
        self, model_name: Callable[[], str], clock: Callable[[], float] = time.time
    ) -> None:
        self.model_name = model_name
        self.clock = clock
        self.live: dict[str, LiveRequest] = {}
        self.totals = Totals()
        self.listeners: list[Listener] = []

    def observe(self, request: GenerateRequest) -> RequestObserver:
        live = LiveRequest(
            request.request_id,
            request.lora_name or self.model_name(),
            self.clock(),
            request.sampling.n,
            request.sampling.max_tokens,
        )
        self.live[live.request_id] = live
        self._tell("started", live)
        return _Watch(self, live)

    def rows(self) -> list[dict[str, Any]]:
        """Every live request's row, oldest first."""
        now = self.clock()
        return [r.row(now) for r in sorted(self.live.values(), key=lambda r: r.arrival)]

    def _tell(self, what: str, live: LiveRequest) -> None:
        row = live.row(self.clock())
        for listener in self.listeners:
            listener(what, row)

    def _finish(self, live: LiveRequest) -> None:
        if self.live.pop(live.request_id, None) is None:
            return  # ended already
        t = self.totals
        t.num_finished += 1
        t.e2e_sum_s += self.clock() - live.arrival
        if live.ttft_s is not None:
            t.num_with_first_token += 1
            t.ttft_sum_s += live.ttft_s
        self._tell("finished", live)


class _Watch:
    """One request's observer: updates its row from its deltas."""

    __slots__ = ("registry", "live", "running")

    def __init__(self, registry: LiveRequests, live: LiveRequest) -> None:
        self.registry = registry
        self.live = live
        self.running = live.n

    def delta(self, delta: OutputDelta) -> None:
        live, registry = self.live, self.registry
        live.num_prompt_tokens = delta.num_prompt_tokens or live.num_prompt_tokens
        live.version = delta.version or live.version
        if delta.token_ids:
            if live.ttft_s is None:
                live.ttft_s = registry.clock() - live.arrival
                live.state = "running"
            live.num_output_tokens += len(delta.token_ids)
            registry.totals.num_output_tokens += len(delta.token_ids)
        if delta.finish_reason != FinishReason.NONE:
            self.running -= 1
            if self.running <= 0:  # the request's state is its last sequence's finish
                live.state = delta.finish_reason.openai or live.state
        if delta.last:
            registry._finish(live)

    def failed(self, status: int) -> None:
        self.live.state = f"failed ({status})"
        self.registry._finish(self.live)

    def end(self) -> None:
        if self.running > 0 and self.live.state in ("queued", "running"):
            self.live.state = FinishReason.CANCELLED.openai or "cancelled"
        self.registry._finish(self.live)


class _Both:
    """Two observers of one request, called in order."""

    __slots__ = ("first", "second")

    def __init__(self, first: RequestObserver, second: RequestObserver) -> None:
        self.first, self.second = first, second

    def delta(self, delta: OutputDelta) -> None:
        self.first.delta(delta)
        self.second.delta(delta)

    def failed(self, status: int) -> None:
        self.first.failed(status)
        self.second.failed(status)

    def end(self) -> None:
        self.first.end()
        self.second.end()


def chain_observers(first: ObserverFactory | None, second: ObserverFactory) -> ObserverFactory:
    """One observer factory calling both (`first` may be None: `second` alone)."""
    if first is None:
        return second

    def both(request: GenerateRequest) -> RequestObserver:
        return _Both(first(request), second(request))

    return both
