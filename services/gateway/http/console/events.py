"""GET /admin/events: the operator console's one feed, server-sent events of what changes.

    event: snapshot   every TICK_S while someone listens (and at once on connect): the
                      served model, the swap in progress, the adapters, the live requests
                      (the gateway's rows with the scheduler's state), the scheduler's
                      counters, the running totals (services/gateway/engine/live_requests.py)
                      and the processes heard of
    event: request    {"event": "started" | "finished", ...row} as the engine client takes
                      or lets go of a request
    event: model      the served version changed (a swap or a worker restart finished)
    event: swap       a swap began, moved to another phase, or ended (null)
    event: adapters   the LoRA adapters served changed
    event: process    a process died and is being restarted: its name, exit code, restarts

With several gateway processes the live requests are every process's: this one's rows and
those the others answer (services/gateway/engine/peers.py), each naming its `gateway`; the
`request` events are this process's only (the next snapshot has the others'). The process
list is every process of the server (common/topology.py's names), each with its restarts.

Everything here is what the gateway already knows: the engine client's served model, swap
and adapters, and the scheduler's answers, sampled once per tick while a console listens
(no listener, no sampling); the engine client's requests and the supervisor's ProcessDown
notices, pushed as they happen. A slow listener whose queue fills is dropped (its browser
reconnects and starts from a fresh snapshot) rather than holding memory for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from common.messages import ProcessDown
from services.gateway.engine.client import EngineClient
from services.gateway.engine.live_requests import LiveRequests
from services.gateway.http.sse import sse_comment

log = logging.getLogger(__name__)

TICK_S = 1.0
STATS_TIMEOUT_S = 1.0
MAX_QUEUED = 256  # events per listener before it counts as gone


def sse_named(kind: str, data: Any) -> bytes:
    """One named event (`event: kind`) holding `data` as compact JSON."""
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class ConsoleEvents:
    """The feed's hub: listeners' queues, the sampler while any listen, the process log."""

    def __init__(self, engine: EngineClient, live: LiveRequests, tick_s: float = TICK_S) -> None:
        self.engine = engine
        self.live = live
        self.name = "gateway"  # this gateway process's, on its rows (`serve_as`)
        self.tick_s = tick_s
        # one queue per listener; None in it ends that listener's stream (it fell behind)
        self.listeners: set[asyncio.Queue[bytes | None]] = set()
        self.processes: dict[str, dict[str, Any]] = {}  # name -> restarts, last exit code
        self._sampler: asyncio.Task[None] | None = None
        self._last: dict[str, Any] = {}  # what the previous tick saw, to tell changes
        live.listeners.append(self._on_request)

    async def stream(self) -> AsyncGenerator[bytes, None]:
        """One listener's events: a snapshot, then whatever happens, until it goes."""
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(MAX_QUEUED)
        self.listeners.add(queue)
        if self._sampler is None or self._sampler.done():
            self._sampler = asyncio.create_task(self._sample())
        try:
            first = await self.snapshot()
            self._tell_changes(first)  # (what the ticks after it compare with)
            yield sse_named("snapshot", first)
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), 15.0)
                except TimeoutError:
                    event = sse_comment("keep-alive")
                if event is None:
                    return
                yield event
        finally:
            self.listeners.discard(queue)
            if not self.listeners and self._sampler is not None:
                self._sampler.cancel()
                self._sampler = None

    @property
    def is_sampling(self) -> bool:
        """Whether the sampler runs (it does while anyone listens)."""
        return self._sampler is not None and not self._sampler.done()

    def publish(self, kind: str, data: Any) -> None:
        event = sse_named(kind, data)
        for queue in list(self.listeners):
            if queue.qsize() >= MAX_QUEUED - 1:  # keep a slot for the end
                self.listeners.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait(event)

    def close(self) -> None:
        """End every listener's stream (the gateway stops: an open feed would hold the HTTP
        server's graceful shutdown to its deadline)."""
        for queue in list(self.listeners):
            self.listeners.discard(queue)
            queue.put_nowait(None)  # (a full queue was dropped already: a slot is free)

    def serve_as(self, name: str, processes: list[str]) -> None:
        """This gateway process's name, and every process of the server (each listed with
        its restarts, 0 until one dies)."""
        self.name = name
        for process in processes:
            self.processes.setdefault(process, {"name": process, "restarts": 0})

    def on_process_down(self, msg: ProcessDown) -> None:
        """The supervisor restarts `msg.name` (the gateway actor passes its notice on)."""
        entry = self.processes.setdefault(msg.name, {"name": msg.name, "restarts": 0})
        entry.update(restarts=entry["restarts"] + 1, exit_code=msg.exit_code, at=time.time())
        self.publish("process", entry)

    def _on_request(self, what: str, row: dict[str, Any]) -> None:
        self.publish("request", {"event": what, **row})

    async def snapshot(self) -> dict[str, Any]:
        engine = self.engine
        answer, rows, peer_rows = await asyncio.gather(
            self._ask("stats"), self._ask("requests"), engine.peer_requests(STATS_TIMEOUT_S)
        )
        # (every id again, as request_ids: the requests are listed anyway)
        stats = {k: v for k, v in answer.items() if k != "request_ids"}
        states = {r["id"]: r for r in rows.get("requests", ()) if r.get("index", 0) == 0}
        requests = []
        # this process's requests, then those the other gateway processes hold (the
        # operator's view is the whole server, whichever process serves the console)
        mine = [{**row, "gateway": self.name} for row in self.live.rows()]
        for row in sorted([*mine, *peer_rows], key=lambda r: r["arrival"]):
            seen = states.get(row["id"])
            if seen is not None:  # the scheduler's finer state: waiting, prefill, decoding, ...
                row |= {
                    "state": seen["state"],
                    "version": seen.get("version") or row["version"],
                    # (known there once tokenised, here only with the first output)
                    "num_prompt_tokens": row["num_prompt_tokens"] or seen["num_prompt_tokens"],
                }
            requests.append(row)
        return {
            "t": time.time(),
            "model": {
                "name": engine.model_name,
                "names": engine.model_names,
                "version": engine.system_fingerprint,
                "max_model_len": engine.max_model_len,
                "ready": engine.is_ready(),
                "draining": engine.draining,
            },
            # the scheduler's (its phase and time so far), else what this gateway asked for
            "swap": stats.get("swap") or engine.swap_status,
            "lora_enabled": engine.lora_enabled,
            "adapters": engine.lora_adapters,
            "requests": requests,
            "totals": {
                "num_finished": self.live.totals.num_finished,
                "num_output_tokens": self.live.totals.num_output_tokens,
                "num_with_first_token": self.live.totals.num_with_first_token,
                "ttft_sum_s": self.live.totals.ttft_sum_s,
                "e2e_sum_s": self.live.totals.e2e_sum_s,
            },
            "stats": stats,
            "processes": sorted(self.processes.values(), key=lambda p: p["name"]),
        }

    async def _ask(self, what: str) -> dict[str, Any]:
        try:
            return await self.engine.stats(timeout=STATS_TIMEOUT_S, what=what)
        except TimeoutError:
            return {"ready": False}  # busy or restarting: the snapshot says so, no error

    async def _sample(self) -> None:
        while self.listeners:
            await asyncio.sleep(self.tick_s)
            try:
                snapshot = await self.snapshot()
            except Exception:  # a bad tick must not end the feed; the next one may do
                log.exception("the console's snapshot failed")
                continue
            self._tell_changes(snapshot)
            self.publish("snapshot", snapshot)

    def _tell_changes(self, snapshot: dict[str, Any]) -> None:
        """Named events for what differs from the previous tick: model, swap, adapters."""
        now = {
            "model": snapshot["model"]["version"],
            "swap": snapshot["swap"],
            "adapters": snapshot["adapters"],
        }
        for kind, value in now.items():
            if kind in self._last and self._last[kind] != value:
                self.publish(kind, snapshot["model"] if kind == "model" else value)
        self._last = now
