"""Cancellation on the real processes: every path ends in one scheduler abort, the blocks
come back in that step, and the stream ends with finish reason `cancelled`."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading
import time

import httpx
import orjson
import pytest

from tests.server import REPO, Server, running_server
from tests.waiting import wait_until

TOKEN = "cancel-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def _get(server: Server, path: str) -> dict:
    r = httpx.get(server.url + path, headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _state_of(server: Server, rid: str) -> str | None:
    rows = _get(server, "/admin/requests")["requests"]
    return next((r["state"] for r in rows if r["id"] == rid), None)


def _all_free(server: Server) -> bool:
    s = _get(server, "/admin/stats")
    return (
        s["num_used_blocks"] == 0
        and s["num_running"] == 0
        and s["num_waiting"] == 0
        and not s["request_ids"]
    )


class _Stream(threading.Thread):
    """A streamed completion in the background; records its finish reason."""

    def __init__(self, server: Server, rid: str, prompt: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.server, self.rid, self.prompt, self.max_tokens = server, rid, prompt, max_tokens
        self.finish: str | None = None
        self.text = ""

    def run(self) -> None:
        body = {
            "model": self.server.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
        }
        with httpx.stream(
            "POST",
            self.server.url + "/v1/completions",
            json=body,
            timeout=300,
            headers={"X-Request-Id": self.rid},
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = orjson.loads(line[6:])["choices"][0]
                    self.text += choice.get("text") or ""
                    self.finish = choice.get("finish_reason") or self.finish


def _cancel_in_state(server: Server, rid: str, want: str, cli: bool = False) -> None:
    wait_until(lambda: _state_of(server, rid) == want, 120, f"{rid} in state {want}", 0.01)
    if cli:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.cancel",
                rid,
                "--url",
                server.url,
                "--admin-token",
                TOKEN,
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert orjson.loads(out.stdout)[0]["cancelled"] is True
    else:
        r = httpx.post(f"{server.url}/admin/cancel/{rid}", headers=ADMIN, timeout=30)
        assert r.json()["cancelled"] is True


@pytest.fixture(scope="module")
def small_server():  # type: ignore[no-untyped-def]
    # one sequence at a time, a 16-token budget (long prefills), a pool of ~30 blocks
    flags = (
        "--admin-token",
        TOKEN,
        "--max-num-seqs",
        "2",
        "--max-num-batched-tokens",
        "16",
        "--kv-cache-memory",
        "0.02",
        "--preemption-mode",
        "swap",
        "--swap-space",
        "0.01",
    )
    with running_server(*flags) as s:
        yield s


def test_cancel_waiting_prefill_and_decoding(small_server: Server) -> None:
    long_prompt = "word " * 300
    a = _Stream(small_server, "c-decoding", "Count to a thousand:", 400)
    b = _Stream(small_server, "c-prefill", long_prompt, 50)
    c = _Stream(small_server, "c-waiting", "Hello there", 50)
    a.start()
    wait_until(
        lambda: _state_of(small_server, "c-decoding") == "decoding", 120, "c-decoding to decode"
    )
    b.start()
    _cancel_in_state(small_server, "c-prefill", "prefill")
    d = _Stream(small_server, "c-other", "More words:", 400)  # fills the second slot
    d.start()
    wait_until(
        lambda: _state_of(small_server, "c-other") in ("prefill", "decoding"),
        120,
        "c-other to hold the second slot",
    )
    c.start()  # both slots taken: it waits (started before d, it could take the slot)
    _cancel_in_state(small_server, "c-waiting", "waiting", cli=True)
    _cancel_in_state(small_server, "c-decoding", "decoding")
    _cancel_in_state(small_server, "c-other", "decoding")
    for t in (a, b, c, d):
        t.join(60)
        assert t.finish == "cancelled", (t.rid, t.finish)
    wait_until(lambda: _all_free(small_server), 60, "every block free, nothing in flight")
    # idempotent: a second cancel is harmless and says it was not in flight
    r = httpx.post(f"{small_server.url}/admin/cancel/c-decoding", headers=ADMIN, timeout=30)
    assert r.status_code == 200 and r.json()["cancelled"] is False


def test_cancel_preempted_and_swapped(small_server: Server) -> None:
    # two long generations cannot both fit in ~30 blocks: one is pushed out (swapped first,
    # recomputed once the host pool is full)
    streams = [
        _Stream(small_server, f"p-{i}", f"Story {i}: once upon a time", 420) for i in range(2)
    ]
    for s in streams:
        s.start()

    def victim() -> tuple[str, str] | None:
        rows = _get(small_server, "/admin/requests")["requests"]
        return next(
            ((r["id"], r["state"]) for r in rows if r["state"] in ("swapped", "preempted")), None
        )

    rid, state = wait_until(victim, 240, "a swapped or preempted request", 0.01)
    r = httpx.post(f"{small_server.url}/admin/cancel/{rid}", headers=ADMIN, timeout=30)
    assert r.json()["cancelled"] is True
    other = next(s for s in streams if s.rid != rid)
    httpx.post(f"{small_server.url}/admin/cancel/{other.rid}", headers=ADMIN, timeout=30)
    for s in streams:
        s.join(120)
        assert s.finish == "cancelled"
    wait_until(lambda: _all_free(small_server), 60, "every block free, nothing in flight")
    assert state in ("swapped", "preempted")


def test_closing_an_sse_stream_frees_its_blocks(small_server: Server) -> None:
    body = {
        "model": small_server.model,
        "prompt": "Tell me everything:",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST",
        small_server.url + "/v1/completions",
        json=body,
        timeout=60,
        headers={"X-Request-Id": "closer"},
    ) as r:
        for i, _line in enumerate(r.iter_lines()):
            if i > 10:
                break  # the client goes away mid-generation
    wait_until(lambda: _state_of(small_server, "closer") is None, 60, "the closed stream's end")
    wait_until(lambda: _all_free(small_server), 60, "every block free, nothing in flight")


def test_200_requests_with_a_random_half_cancelled() -> None:
    rng = random.Random(7)
    prompts = [f"Fact {i % 5}:" for i in range(200)]
    with running_server("--admin-token", TOKEN, "--max-num-seqs", "64") as server:

        async def run() -> tuple[dict[str, str], dict[str, list[str]], list[float]]:
            texts: dict[str, str] = {}
            finishes: dict[str, list[str]] = {}
            latencies: list[float] = []
            cancel_at: dict[str, float] = {}

            async def one(c: httpx.AsyncClient, i: int) -> None:
                rid = f"bulk-{i}"
                body = {
                    "model": server.model,
                    "prompt": prompts[i],
                    "max_tokens": 12,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "stream": True,
                }
                text, fin = "", []
                async with c.stream(
                    "POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}
                ) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            ch = orjson.loads(line[6:])["choices"][0]
                            text += ch.get("text") or ""
                            if ch.get("finish_reason"):
                                fin.append(ch["finish_reason"])
                if rid in cancel_at and fin == ["cancelled"]:
                    latencies.append(time.monotonic() - cancel_at[rid])
                texts[rid], finishes[rid] = text, fin

            async def canceller(c: httpx.AsyncClient, i: int) -> None:
                # the thing under test: cancels at random moments, in any state
                await asyncio.sleep(rng.uniform(0, 3.0))
                cancel_at[f"bulk-{i}"] = time.monotonic()
                await c.post(f"/admin/cancel/bulk-{i}", headers=ADMIN)

            async with httpx.AsyncClient(
                base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=400)
            ) as c:
                doomed = rng.sample(range(200), 100)
                await asyncio.gather(
                    *(one(c, i) for i in range(200)), *(canceller(c, i) for i in doomed)
                )
            return texts, finishes, latencies

        texts, finishes, latencies = asyncio.run(run())
        solo = {}
        for p in sorted(set(prompts)):
            r = httpx.post(
                server.url + "/v1/completions",
                timeout=120,
                json={
                    "model": server.model,
                    "prompt": p,
                    "max_tokens": 12,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            solo[p] = r.json()["choices"][0]["text"]
        cancelled = [rid for rid, f in finishes.items() if f == ["cancelled"]]
        assert 0 < len(cancelled) <= 100
        for i in range(200):
            rid = f"bulk-{i}"
            assert len(finishes[rid]) == 1, (rid, finishes[rid])
            if finishes[rid] != ["cancelled"]:
                assert finishes[rid] == ["length"] and texts[rid] == solo[prompts[i]], rid
        wait_until(lambda: _all_free(server), 60, "every block free, nothing in flight")
        lat = sorted(latencies)
        print(
            f"\ncancel -> stream end: n={len(lat)} p50={lat[len(lat) // 2] * 1e3:.1f} ms "
            f"p99={lat[int(len(lat) * 0.99)] * 1e3:.1f} ms"
        )
