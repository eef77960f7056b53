"""A bounded soak: mixed load with random cancels against every real process.

Eight concurrent clients send a random mix (chat and completions, streamed or not, n = 1 or
2, greedy or sampled, short and long prompts, 1-48 output tokens) to a server whose KV pool
is small enough that requests get preempted (swap). A quarter of the requests are
cancelled mid-flight, half through the admin API, half by the client closing its stream.
After a warm-up, the resident memory of every process is recorded; when the load ends:

- every request that was not cancelled succeeded, with the tokens it asked for (or a stop);
- nothing is left in flight and every KV block is free (the scheduler's stats);
- every process's resident memory is within 10% of its post-warm-up figure.

`SHUTTLE_SOAK_S` sets the duration (default 60 s; the closing note's figures used 240 s).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import httpx
import orjson
import pytest

from tests.server import Server, running_server
from tests.waiting import wait_until

TOKEN = "soak-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DURATION_S = float(os.environ.get("SHUTTLE_SOAK_S", "60"))
WARMUP_FRACTION = 0.3
CLIENTS = 8
WORDS = (
    "river stone lamp orange window quiet seven market cloud paper engine garden "
    "silver number morning table"
).split()


def _processes(server: Server) -> dict[str, int]:
    """Each shuttle process's pid by name (the supervisor's children, and itself)."""
    out = {"supervisor": server.proc.pid}
    for module, pid in server.children():
        name = "worker" if module == "gpu_worker" else module.removeprefix("services.")
        out[f"{name}-{pid}" if name in out else name] = pid
    return out


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


class Tally:
    def __init__(self) -> None:
        self.ok = self.cancelled = self.client_closed = 0
        self.failures: list[str] = []

    def enough(self) -> bool:
        """The load the assertions need, however slowly this machine gets through it."""
        return self.ok > 20 and self.cancelled + self.client_closed > 5


async def _one(
    client: httpx.AsyncClient, server: Server, rng: random.Random, n: int, tally: Tally
) -> None:
    rid = f"soak-{n}"
    words = rng.choices(WORDS, k=rng.choice([3, 12, 40, 120]))
    max_tokens = rng.randint(1, 48)
    sampled = rng.random() < 0.5
    body: dict = {
        "model": server.model,
        "max_tokens": max_tokens,
        "ignore_eos": rng.random() < 0.5,
        "temperature": 0.8 if sampled else 0.0,
        "n": 2 if rng.random() < 0.15 else 1,
    }
    chat = rng.random() < 0.5
    if chat:
        body["messages"] = [{"role": "user", "content": " ".join(words)}]
    else:
        body["prompt"] = " ".join(words)
    stream = rng.random() < 0.7
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True}
    cancel = rng.random() < 0.25
    how = rng.choice(["admin", "close"]) if cancel and stream else ("admin" if cancel else "")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    headers = {"X-Request-Id": rid}

    async def admin_cancel() -> None:
        await asyncio.sleep(rng.uniform(0.0, 1.5))  # under test: a cancel at a random moment
        await client.post(f"/admin/cancel/{rid}", headers=ADMIN)

    canceller = asyncio.create_task(admin_cancel()) if how == "admin" else None
    try:
        if not stream:
            r = await client.post(path, json=body, headers=headers)
            _check_whole(r, body, how, tally, rid)
            return
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code != 200:
                tally.failures.append(f"{rid}: HTTP {r.status_code} {(await r.aread())[:200]!r}")
                return
            finishes, tokens, seen = [], 0, 0
            close_after = rng.randint(1, 4) if how == "close" else -1
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if "error" in chunk:
                    tally.failures.append(f"{rid}: stream error {chunk['error']}")
                    return
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    seen += 1
                    if c.get("finish_reason"):
                        finishes.append(c["finish_reason"])
                if seen == close_after:
                    tally.client_closed += 1
                    return  # leaving the block closes the connection mid-stream
            _check_finishes(finishes, body, how, tally, rid, tokens)
    finally:
        if canceller is not None:
            await canceller


def _check_whole(r: httpx.Response, body: dict, how: str, tally: Tally, rid: str) -> None:
    if r.status_code != 200:
        tally.failures.append(f"{rid}: HTTP {r.status_code} {r.text[:200]}")
        return
    data = r.json()
    finishes = [c["finish_reason"] for c in data["choices"]]
    _check_finishes(finishes, body, how, tally, rid, data["usage"]["completion_tokens"])


def _check_finishes(
    finishes: list[str], body: dict, how: str, tally: Tally, rid: str, tokens: int
) -> None:
    if len(finishes) != body["n"]:
        tally.failures.append(f"{rid}: {len(finishes)} finished choices, wanted {body['n']}")
    elif "cancelled" in finishes:
        if how != "admin":
            tally.failures.append(f"{rid}: cancelled but nobody cancelled it")
        tally.cancelled += 1
    elif any(f not in ("stop", "length") for f in finishes):
        tally.failures.append(f"{rid}: finish reasons {finishes}")
    elif body["ignore_eos"] and tokens and tokens != body["max_tokens"] * body["n"]:
        tally.failures.append(f"{rid}: {tokens} tokens, wanted {body['max_tokens']} each")
    else:
        tally.ok += 1  # (an admin cancel that came after the end cancels nothing)


async def _load(server: Server, until: float, tally: Tally, seed: int) -> None:
    counter = iter(range(seed * 1_000_000, (seed + 1) * 1_000_000))

    async def client_loop(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        async with httpx.AsyncClient(base_url=server.url, timeout=180) as client:
            # the soak's length (SHUTTLE_SOAK_S), extended until the load the assertions
            # count has happened; a failure ends it early
            while not tally.failures and (time.monotonic() < until or not tally.enough()):
                await _one(client, server, rng, next(counter), tally)

    await asyncio.gather(*(client_loop(i) for i in range(CLIENTS)))


def _idle_stats(server: Server) -> dict | None:
    """The scheduler's stats once no request and no step is left in flight, else None."""
    stats = httpx.get(f"{server.url}/admin/stats", headers=ADMIN, timeout=30).json()
    return stats if not stats["request_ids"] and not stats["num_steps_in_flight"] else None


@pytest.mark.slow  # a minute of load: `make test-slow` (pytest -m slow), not `make test`
def test_soak_mixed_load_with_cancels() -> None:
    with running_server(
        "--admin-token",
        TOKEN,
        "--max-num-seqs",
        "16",
        "--num-tokenizers",
        "2",
        "--kv-cache-memory",
        "0.03",
        "--preemption-mode",
        "swap",
        "--swap-space",
        "0.1",
        timeout=300,
    ) as server:
        tally = Tally()
        start = time.monotonic()
        warm_until = start + DURATION_S * WARMUP_FRACTION
        asyncio.run(_load(server, warm_until, tally, seed=1))
        procs = _processes(server)
        assert {"gateway", "scheduler", "worker", "detokenizer"} <= set(procs), procs
        warm = {name: _rss_mib(pid) for name, pid in procs.items()}
        asyncio.run(_load(server, start + DURATION_S, tally, seed=2))
        stats = wait_until(lambda: _idle_stats(server), 60, "no request or step in flight")
        end = {name: _rss_mib(pid) for name, pid in procs.items()}
        report = {name: f"{warm[name]:.0f} -> {end[name]:.0f} MiB" for name in procs}
        print(
            f"soak {DURATION_S:.0f}s: {tally.ok} ok, {tally.cancelled} cancelled by admin, "
            f"{tally.client_closed} closed by the client, {len(tally.failures)} failed; "
            f"{stats['num_preemptions']} preemptions; RSS {report}"
        )
        assert not tally.failures, tally.failures[:10]
        assert tally.enough()
        assert stats["num_preemptions"] > 0  # the pool is small on purpose
        assert stats["request_ids"] == [] and stats["num_used_blocks"] == 0, stats
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        for name in procs:
            assert end[name] <= warm[name] * 1.10, (name, report)
