"""Data parallelism on the real processes (--data-parallel-size 2): greedy parity with
transformers through batching, chunked prefill and prefix hits; requests that share a prefix
land on one replica (more prefix hits than round-robin, from the per-replica counters); a
cancel storm over both replicas; a hot-swap of both; a replica whose worker or scheduler
dies, or the router, is routed around or replaced while the other replica serves on.

The default suite runs on a tiny random model (one server, plus a round-robin one to
compare): ~50 s on 2 cores. `make test-slow` adds the drain swap and, on the default model,
its parity and the killed processes."""

from __future__ import annotations

import asyncio
import os
import random
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from tests.integration.test_parity_serving import NUM_NEW, TEXTS, _complete
from tests.integration.test_swap import TOKEN, _reference, _swap_under_load
from tests.reference import hf_greedy
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until

# (test_swap's token: its swap-under-load helper drives the tiny server's swaps)
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
DP = ("--data-parallel-size", "2", "--admin-token", TOKEN, "--num-threads", "1")


def _stats(server: Server) -> dict:
    r = httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _idle(server: Server) -> bool:
    s = _stats(server)
    replicas = s["replicas"]
    return (
        all(r["ready"] for r in replicas)
        and all(r["num_used_blocks"] == 0 for r in replicas)
        and s["num_running"] == 0
        and s["num_waiting"] == 0
        and not s["request_ids"]
    )


def _hits_by_replica(server: Server) -> dict[str, tuple[float, float]]:
    """(prefix-cache queries, hits) of each replica, from /metrics' labelled counters."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    found: dict[str, dict[str, float]] = {}
    pattern = r'prefix_cache_(queries|hits)_total\{[^}]*replica="(\d+)"[^}]*\} (\S+)'
    for kind, replica, value in re.findall(pattern, text):
        found.setdefault(replica, {})[kind] = float(value)
    return {r: (v.get("queries", 0.0), v.get("hits", 0.0)) for r, v in sorted(found.items())}


def _pid_of(server: Server, module: str, replica: int | None = None) -> int:
    for name, pid in server.children():
        if name == module:
            if replica is None:
                return pid
            argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            if any(a.endswith(f"config-replica-{replica}.json") for a in argv):
                return pid
    raise AssertionError(f"no {module} of replica {replica}")


# tiny models (the default suite): parity, a cancel storm, routing against round-robin, and
# a hot-swap of both replicas (it changes the served model: last) ---------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("dp-models")
    return {
        "a": make_tiny_model(root / "tiny-a", "llama", seed=1),
        "b": make_tiny_model(root / "tiny-b", "llama", seed=2),
        "c": make_tiny_model(root / "tiny-c", "llama", num_layers=3, seed=3),
        "root": root,
    }


def _tiny_flags(models: dict[str, Path], routing: str) -> tuple[str, ...]:
    return (*DP, "--model", str(models["a"]), "--model-root", str(models["root"]),
            "--dp-routing", routing, "--max-num-seqs", "32",
            "--max-num-batched-tokens", "32")  # fmt: skip


SYSTEMS = [f"System prompt {k}: " + f"you answer as persona {k}, briefly. " * 12 for k in "ABC"]


def _shared_prefix_hit_rate(server: Server) -> tuple[float, dict[str, tuple[float, float]]]:
    """12 requests, one at a time, over 3 system prompts (A B C A B C ...): the prefix-cache
    hit rate, in tokens, from the per-replica counters."""
    before = _hits_by_replica(server)
    for i in range(12):
        body = {"model": server.model, "prompt": SYSTEMS[i % 3] + f"User {i}: hi", "max_tokens": 2}
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
    after = _hits_by_replica(server)
    delta = {
        k: (q - before.get(k, (0.0, 0.0))[0], h - before.get(k, (0.0, 0.0))[1])
        for k, (q, h) in after.items()
    }
    queries = sum(q for q, _ in delta.values())
    return sum(h for _, h in delta.values()) / max(1.0, queries), delta


@pytest.fixture(scope="module")
def tiny(models):  # type: ignore[no-untyped-def]
    with running_server(*_tiny_flags(models, "prefix")) as s:
        yield s


def test_parity_batched_chunked_and_from_the_prefix_cache(
    tiny: Server, models: dict[str, Path]
) -> None:
    _check_parity(tiny, models["a"])


def test_a_cancel_storm_over_both_replicas_fails_nothing(tiny: Server) -> None:
    _cancel_storm(tiny)


def test_shared_prefixes_land_on_one_replica(tiny: Server, models: dict[str, Path]) -> None:
    prefix_rate, prefix_delta = _shared_prefix_hit_rate(tiny)
    assert _stats(tiny)["router"]["num_prefix_routed"] >= 9  # the repeats, by affinity
    metrics = httpx.get(tiny.url + "/metrics", timeout=30).text
    assert re.search(r'dp_routed_requests_total\{[^}]*how="prefix"[^}]*\} (\d+)', metrics)
    with running_server(*_tiny_flags(models, "round-robin")) as rr:
        rr_rate, rr_delta = _shared_prefix_hit_rate(rr)
    print(f"\nprefix hit rate: prefix routing {prefix_rate:.3f} {prefix_delta}")
    print(f"prefix hit rate: round-robin {rr_rate:.3f} {rr_delta}")
    # every repeat of a system prompt went where it was cached: 9 of 12 requests hit
    # (round-robin: each prompt is cold on both replicas, 6 of 12)
    assert prefix_rate > rr_rate
    assert all(q > 0 for q, _ in rr_delta.values())  # round-robin used both


@pytest.mark.parametrize("mode", ["overlap", pytest.param("drain", marks=pytest.mark.slow)])
def test_a_swap_of_both_replicas_loses_no_request(
    tiny: Server, models: dict[str, Path], mode: str
) -> None:
    stats = _stats(tiny)
    before, serving = stats["version"], Path(stats["model"]["model_path"])  # (a, or b after
    # the overlap swap)
    target = models["b"] if mode == "overlap" else models["c"]
    refs = {before: serving, f"v-{mode}": target}
    outs, result = _swap_under_load(tiny, target, mode, f"v-{mode}")
    assert result["returncode"] == 0 and result["ok"], result
    assert result["version"] == f"v-{mode}"
    for (text, finish, version), prompt in zip(outs, _prompts(), strict=True):
        assert finish == "length" and version in refs, (finish, version)
        assert text == _reference(refs[version], prompt), (prompt, version)
    stats = _stats(tiny)
    assert [r["version"] for r in stats["replicas"]] == [f"v-{mode}"] * 2
    wait_until(lambda: _idle(tiny), 60, "both replicas idle, every block free")


def _prompts() -> list[str]:
    from tests.integration.test_swap import PROMPTS

    return PROMPTS


# SmolLM2 (slow tests): two replicas, a token budget that chunks every long prompt ---------


@pytest.fixture(scope="module")
def smol():  # type: ignore[no-untyped-def]
    with running_server(*DP, "--max-num-batched-tokens", "32", "--max-num-seqs", "16") as s:
        yield s


def _check_parity(server: Server, model_dir: Path) -> None:
    """4 prompts (one of > 100 tokens: chunked by the 32-token budget) all at once (batched,
    over both replicas), then again one by one (from the prefix cache): transformers'
    greedy tokens each time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(t) for t in TEXTS[::2]]
    expected = [hf_greedy(model_dir, p, NUM_NEW) for p in prompts]
    with server.client(timeout=900) as client:
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _complete(client, server.model, p), prompts))
        assert together == expected
        before = _stats(server)["prefix_cache_hits"]
        again = [_complete(client, server.model, p) for p in prompts]
        assert again == expected
    assert _stats(server)["prefix_cache_hits"] > before
    wait_until(lambda: _idle(server), 60, "both replicas idle, every block free")


@pytest.mark.slow  # the default model's parity (the tiny model's is in the default suite)
def test_parity_on_the_default_model(smol: Server) -> None:
    from common.prepare_model import prepare_default_model

    _check_parity(smol, prepare_default_model())


def _cancel_storm(server: Server) -> None:
    rng = random.Random(15)

    async def run() -> dict[str, list[str]]:
        finishes: dict[str, list[str]] = {}
        begun = {i: asyncio.Event() for i in range(40)}

        async def one(c: httpx.AsyncClient, i: int) -> None:
            rid, fin = f"storm-{i}", []
            body = {
                "model": server.model,
                "prompt": f"Fact {i}: the river",
                "max_tokens": 64,
                "ignore_eos": True,
                "stream": True,
            }
            async with c.stream(
                "POST", "/v1/completions", json=body, headers={"X-Request-Id": rid}
            ) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        begun[i].set()
                        ch = orjson.loads(line[6:])["choices"][0]
                        fin += [ch["finish_reason"]] if ch.get("finish_reason") else []
            finishes[rid] = fin

        async def cancel(c: httpx.AsyncClient, i: int) -> None:
            # once its stream began, after a random number of turns of the event loop (its
            # own and the other streams' events): a random point of its decoding
            await begun[i].wait()
            for _ in range(rng.randrange(60)):
                await asyncio.sleep(0)
            await c.post(f"/admin/cancel/storm-{i}", headers=ADMIN)

        async with httpx.AsyncClient(base_url=server.url, timeout=600) as c:
            doomed = rng.sample(range(40), 20)
            await asyncio.gather(*(one(c, i) for i in range(40)), *(cancel(c, i) for i in doomed))
        return finishes

    finishes = asyncio.run(run())
    assert len(finishes) == 40
    for rid, fin in finishes.items():
        assert fin in (["length"], ["cancelled"]), (rid, fin)
    assert any(f == ["cancelled"] for f in finishes.values())
    wait_until(lambda: _idle(server), 60, "both replicas idle, every block free")
    assert all(r["num_steps"] > 0 for r in _stats(server)["replicas"])  # both served


@pytest.mark.slow  # a restart: ~12 s more on 2 cores (make test-slow)
@pytest.mark.parametrize("module", ["gpu_worker", "services.scheduler"])
def test_a_dead_replica_is_routed_around(smol: Server, module: str) -> None:
    """Replica 1's worker (or scheduler) is killed under load: its requests end with a
    retryable 503, replica 0's finish, new requests are served while it restarts, and it
    comes back."""
    wait_until(lambda: _idle(smol), 60, "both replicas idle")
    results: list[tuple[int, str]] = []

    def one(i: int) -> None:
        body = {
            "model": smol.model,
            "prompt": f"Story {i}:",
            "max_tokens": 96,
            "ignore_eos": True,
        }
        r = httpx.post(smol.url + "/v1/completions", json=body, timeout=300)
        finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else ""
        results.append((r.status_code, finish))

    def decoding() -> bool:
        rows = httpx.get(smol.url + "/admin/requests", headers=ADMIN, timeout=30).json()
        by_replica = {r["replica"] for r in rows["requests"] if r["state"] == "decoding"}
        return by_replica == {0, 1}

    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(one, i) for i in range(6)]
        wait_until(decoding, 120, "requests decoding on both replicas", 0.01)
        os.kill(_pid_of(smol, module, 1), signal.SIGKILL)
        for f in futures:
            f.result()
        served = [_complete_text(smol, f"Meanwhile {i}:") for i in range(3)]
    statuses = sorted(s for s, _ in results)
    assert 503 in statuses and 200 in statuses, results  # replica 1's failed, 0's finished
    assert all(f == "length" for s, f in results if s == 200), results
    assert all(served), "the other replica stopped serving"
    wait_until(lambda: _idle(smol), 180, "replica 1 back, every block free")


@pytest.mark.slow
def test_a_new_router_learns_the_replicas_again(smol: Server) -> None:
    """The router is killed: the supervisor starts another, the schedulers tell it what
    they hold, and requests are routed again (and to where their prefix is cached)."""
    wait_until(lambda: _idle(smol), 60, "both replicas idle")
    prompt = "Shared: " + "the same long preamble, " * 20
    assert _complete_text(smol, prompt + "first")
    os.kill(_pid_of(smol, "services.router"), signal.SIGKILL)
    before = _stats(smol)["prefix_cache_hits"]
    assert _complete_text(smol, prompt + "second")
    assert _stats(smol)["prefix_cache_hits"] > before  # routed to where the prefix was
    wait_until(lambda: _idle(smol), 60, "both replicas idle")


def _complete_text(server: Server, prompt: str) -> bool:
    body = {"model": server.model, "prompt": prompt, "max_tokens": 4}
    for _ in range(20):  # a request routed there just before the router heard: retry
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        if r.status_code == 200:
            return True
        assert r.status_code == 503, r.text
    return False
