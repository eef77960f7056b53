"""The load: streamed /v1/completions requests at a rate, each turned into a Timing.

Every request goes out with `ignore_eos`, streamed, so TTFT and every inter-token gap are
seen; `Extras` adds body fields to every request (tools/bench --logprobs,
--repetition-penalty) and others to a share of them (--structured-share: a JSON schema).
Arrivals: all at once (rate inf), or Poisson at `rate`, capped by `concurrency`. The lean
client (client.py) carries plain http:// URLs; httpx anything else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import sys
import time
from typing import Any

import httpx
import orjson

from tools.benchmarks.client import HttpError, SseConnection
from tools.benchmarks.report import Timing
from tools.benchmarks.workload import Workload

INF = float("inf")


class ProgressLine:
    """One stderr line, redrawn at most 5 times a second: done/total, failures, tokens."""

    def __init__(self, total: int, label: str = "", enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = self.tokens = 0
        self.start = self.drawn = time.perf_counter()

    def add(self, t: Timing) -> None:
        self.done += 1
        self.failed += bool(t.error)
        self.tokens += t.output_tokens
        now = time.perf_counter()
        if self.enabled and (now - self.drawn > 0.2 or self.done == self.total):
            self.drawn = now
            width = 30
            filled = width * self.done // max(1, self.total)
            sys.stderr.write(
                f"\r{self.label}[{'#' * filled}{'.' * (width - filled)}] "
                f"{self.done}/{self.total} done, {self.failed} failed, "
                f"{self.tokens / (now - self.start):,.0f} tok/s, "
                f"{now - self.start:.1f} s "
            )
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class Extras:
    """Body fields a request adds: `every` to all, `chosen` to a `share` of them (spread
    evenly: request i is chosen when (i + 1) * share passes a whole number)."""

    every: dict[str, Any] = dataclasses.field(default_factory=dict)
    chosen: dict[str, Any] = dataclasses.field(default_factory=dict)
    share: float = 0.0

    def of(self, i: int) -> dict[str, Any]:
        picked = int((i + 1) * self.share) > int(i * self.share)
        return self.every | self.chosen if picked else self.every


def _body(
    model: str, prompt: list[int] | str, out_len: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": out_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    } | (extra or {})


class _Stamper:
    """Turns a stream's `data:` payloads into one request's Timing."""

    def __init__(self) -> None:
        self.t = Timing()
        self.start = self.last = time.perf_counter()

    def event(self, data: bytes | str) -> None:
        if data == b"[DONE]" or data == "[DONE]":
            return
        chunk = orjson.loads(data)
        if chunk.get("usage"):
            self.t.output_tokens = chunk["usage"]["completion_tokens"]
            self.t.prompt_tokens = chunk["usage"]["prompt_tokens"]
        logprobs = chunk["choices"][0].get("logprobs") if chunk.get("choices") else None
        if logprobs:
            self.t.logprob_tokens += len(logprobs["tokens"])
        if chunk.get("choices") and chunk["choices"][0].get("text"):
            now = time.perf_counter()
            if not self.t.ttft:
                self.t.ttft = now - self.start
            else:
                self.t.itl.append(now - self.last)
            self.last = now
        if "error" in chunk:
            self.t.error = f"stream error: {chunk['error'].get('message', '')[:200]}"

    def done(self, error: str = "") -> Timing:
        self.t.error = self.t.error or error
        self.t.e2e = time.perf_counter() - self.start
        return self.t


async def _one(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int] | str,
    out_len: int,
    extra: dict[str, Any] | None = None,
) -> Timing:
    """One streamed request through httpx (any URL)."""
    stamp = _Stamper()
    try:
        async with client.stream(
            "POST", "/v1/completions", json=_body(model, prompt, out_len, extra)
        ) as r:
            if r.status_code != 200:
                return stamp.done(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if line.startswith("data: "):  # not blank separators or keep-alive comments
                    stamp.event(line[6:])
    except httpx.HTTPError as e:
        return stamp.done(f"{type(e).__name__}: {e}")
    return stamp.done()


async def _one_lean(
    conn: SseConnection,
    model: str,
    prompt: list[int] | str,
    out_len: int,
    extra: dict[str, Any] | None = None,
) -> Timing:
    """One streamed request through the lean client (plain http://)."""
    stamp = _Stamper()
    try:
        async for data in conn.stream(
            "/v1/completions", orjson.dumps(_body(model, prompt, out_len, extra))
        ):
            stamp.event(data)
    except HttpError as e:
        return stamp.done(str(e))
    return stamp.done()


async def run_load(
    url: str,
    model: str,
    wl: Workload,
    concurrency: int,
    rate: float,
    seed: int,
    progress: ProgressLine | None = None,
    lean: bool = True,
    extras: Extras | None = None,
) -> tuple[list[Timing], float, int]:
    """Send every request of `wl`; returns their timings, the duration and peak concurrency.
    `lean`: the lean client on http:// URLs (client.py), else httpx. `extras`: body fields
    requests add (e.g. {"logprobs": 5, "repetition_penalty": 1.1})."""
    extras = extras or Extras()
    n = len(wl.prompts)
    slots = concurrency if concurrency > 0 else n
    lean = lean and url.startswith("http://")
    pool: asyncio.Queue[SseConnection] = asyncio.Queue()
    for _ in range(slots if lean else 0):
        pool.put_nowait(SseConnection(url))
    limits = httpx.Limits(max_connections=slots + 4, max_keepalive_connections=slots + 4)
    sem = asyncio.Semaphore(slots)
    rng = random.Random(seed)
    peak = active = 0

    async def send(client: httpx.AsyncClient, i: int) -> Timing:
        extra = extras.of(i)
        if not lean:
            return await _one(client, model, wl.prompts[i], wl.output_lens[i], extra)
        conn = pool.get_nowait()  # the semaphore guarantees one is free
        try:
            return await _one_lean(conn, model, wl.prompts[i], wl.output_lens[i], extra)
        finally:
            pool.put_nowait(conn)

    async def guarded(client: httpx.AsyncClient, i: int) -> Timing:
        nonlocal peak, active
        async with sem:
            active += 1
            peak = max(peak, active)
            try:
                t = await send(client, i)
            finally:
                active -= 1
        if progress is not None:
            progress.add(t)
        return t

    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for i in range(n):
            tasks.append(asyncio.create_task(guarded(client, i)))
            if rate != INF:
                await asyncio.sleep(rng.expovariate(rate))
        timings = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
    while not pool.empty():
        await pool.get_nowait().close()
    return timings, duration, peak
