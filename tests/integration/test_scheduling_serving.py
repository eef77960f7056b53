"""Scheduler features through the real processes: prefix-cache accounting, overload (429
with Retry-After, then recovery), timeouts and priorities."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.server import Server, running_server
from tests.waiting import wait_until

ADMIN = {"Authorization": "Bearer test-admin"}
LONG = (
    "The committee reviewed the quarterly report in detail, noting revenue, costs, staff "
    "changes, and the outlook for the coming year. "
) * 12


@pytest.fixture(scope="module")
def admin_server():  # type: ignore[no-untyped-def]
    with running_server("--admin-token", "test-admin", "--max-num-seqs", "8") as s:
        yield s


def _stats(server: Server) -> dict:
    r = httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(server: Server, prompt: str | list[int], **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0, **kw}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=300)


def test_second_identical_prompt_computes_only_the_uncached_tail(admin_server: Server) -> None:
    before = _stats(admin_server)
    first = _complete(admin_server, LONG).json()
    mid = _stats(admin_server)
    second = _complete(admin_server, LONG).json()
    after = _stats(admin_server)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    n_prompt = first["usage"]["prompt_tokens"]
    assert n_prompt > 200
    first_cost = mid["num_computed_tokens"] - before["num_computed_tokens"]
    second_cost = after["num_computed_tokens"] - mid["num_computed_tokens"]
    assert first_cost >= n_prompt
    block = after["model"]["block_size"]
    # only the last partial block (at most block_size tokens) plus the decode steps
    assert second_cost <= block + 4, (first_cost, second_cost)
    assert after["prefix_cache_hits"] - mid["prefix_cache_hits"] >= n_prompt - block
    assert after["num_used_blocks"] == 0 and after["num_running"] == 0


def test_timeout_finishes_the_request_and_frees_blocks(admin_server: Server) -> None:
    r = _complete(admin_server, "Count slowly:", max_tokens=2000, ignore_eos=True, timeout=0.5)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "timeout"
    wait_until(lambda: _stats(admin_server)["num_used_blocks"] == 0, 60, "every block free")


def test_overload_gets_429_with_retry_after_then_recovers() -> None:
    with running_server("--max-waiting", "2", "--max-num-seqs", "2") as server:

        async def one(c: httpx.AsyncClient, i: int) -> httpx.Response:
            return await c.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": f"Tell me a story number {i}.",
                    "max_tokens": 24,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                return list(await asyncio.gather(*(one(c, i) for i in range(24))))

        results = asyncio.run(burst())
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429}, codes
        assert codes.count(429) > 0 and codes.count(200) >= 2
        for r in results:
            if r.status_code == 429:
                assert r.headers["retry-after"] == "1"
                assert "overloaded" in r.json()["error"]["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 24
        after = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={"model": server.model, "prompt": "Hello", "max_tokens": 4},
        )
        assert after.status_code == 200


def test_priority_policy_serves_urgent_requests_first() -> None:
    """One slot, held by a long request until two low-priority requests and then an urgent
    one are queued behind it; once it is cancelled, the urgent one is served first."""
    flags = (
        "--scheduling-policy",
        "priority",
        "--max-num-seqs",
        "1",
        "--no-async-scheduling",
        "--admin-token",
        "test-admin",
    )
    with running_server(*flags) as server:
        finished: list[str] = []

        def waiting() -> int:
            return _stats(server)["num_waiting"]

        async def one(c: httpx.AsyncClient, name: str, prio: int) -> None:
            r = await c.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": "Name a colour.",
                    "max_tokens": 8,
                    "ignore_eos": True,
                    "temperature": 0.0,
                    "priority": prio,
                },
            )
            assert r.status_code == 200, r.text
            finished.append(name)

        async def run() -> None:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                # the blocker would run for minutes: it holds the slot until cancelled
                blocker = asyncio.create_task(
                    c.post(
                        "/v1/completions",
                        json={
                            "model": server.model,
                            "prompt": "Write a long essay.",
                            "max_tokens": 4000,
                            "ignore_eos": True,
                        },
                        headers={"X-Request-Id": "blocker"},
                    )
                )
                await asyncio.to_thread(
                    wait_until,
                    lambda: _stats(server)["num_running"] == 1,
                    120,
                    "the blocker to run",
                )
                tasks = []
                for n, (name, prio) in enumerate((("low1", 5), ("low2", 5), ("urgent", -1)), 1):
                    tasks.append(asyncio.create_task(one(c, name, prio)))
                    await asyncio.to_thread(
                        wait_until, lambda n=n: waiting() == n, 120, f"{name} to be queued"
                    )
                cancel = await c.post("/admin/cancel/blocker", headers=ADMIN)
                assert cancel.json()["cancelled"] is True
                await asyncio.gather(blocker, *tasks)

        asyncio.run(run())
        assert finished[0] == "urgent" and sorted(finished[1:]) == ["low1", "low2"], finished
