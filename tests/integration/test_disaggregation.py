"""Prefill/decode replicas on the real processes (--prefill-replicas 1 --decode-replicas 1):
every request's prompt runs on the prefill replica, its first token streams from there, its
full KV blocks move to the decode replica (shared memory; and over the messages, --kv-transfer
tcp), which continues the stream. Greedy parity with transformers through the hand-over,
batched and chunked, n > 1, with prefix hits on both sides; logprobs and prompt logprobs
against log_softmax of transformers' logits; a cancel storm over every phase;
a process of either replica killed mid-transfer: nothing leaks on either side (blocks, or the
transfer's files).

A tiny random model, one server per transport: ~60 s on 2 cores."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from common.config import Config
from common.topology import kv_transfer_dir
from tests.integration.test_data_parallel import _pid_of
from tests.integration.test_parity_serving import NUM_NEW, TEXTS, _complete
from tests.integration.test_swap import TOKEN  # (the token its swap helper sends)
from tests.reference import hf_greedy
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until

ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PD = ("--prefill-replicas", "1", "--decode-replicas", "1", "--admin-token", TOKEN,
      "--num-threads", "1", "--max-num-seqs", "32", "--max-num-batched-tokens", "32")  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    return make_tiny_model(tmp_path_factory.mktemp("pd-models") / "tiny", "llama", seed=1)


@pytest.fixture(scope="module")
def shm(model: Path):  # type: ignore[no-untyped-def]
    with running_server(*PD, "--model", str(model)) as s:
        yield s


def _stats(server: Server) -> dict:
    r = httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _by_role(server: Server) -> dict[str, dict]:
    return {r["role"]: r for r in _stats(server)["replicas"] if "role" in r}


def _transfer_files(server: Server) -> list[Path]:
    folder = Path(kv_transfer_dir(Config().replace(server={"run_dir": str(server.run_dir)})))
    return [p for p in folder.rglob("*") if p.is_file()] if folder.is_dir() else []


def _idle(server: Server) -> bool:
    """Both replicas ready and idle, every block free or cached, no transfer file left."""
    s = _stats(server)
    replicas = s["replicas"]
    return (
        len(replicas) == 2
        and all(r.get("ready") for r in replicas)
        and all(r["num_used_blocks"] == 0 for r in replicas)
        and s["num_running"] == 0
        and s["num_waiting"] == 0
        and not s["request_ids"]
        and not _transfer_files(server)
    )


def _check_parity(server: Server, model_dir: Path) -> None:
    """4 prompts at once (one of > 100 tokens: chunked by the 32-token budget), then again
    one by one (prefix hits on the prefill replica, and the received blocks found cached on
    the decode replica): transformers' greedy tokens each time."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.encode(t) for t in TEXTS[::2]]
    expected = [hf_greedy(model_dir, p, NUM_NEW) for p in prompts]
    with server.client(timeout=900) as client:
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _complete(client, server.model, p), prompts))
        assert together == expected
        before = _by_role(server)
        again = [_complete(client, server.model, p) for p in prompts]
        assert again == expected
    after = _by_role(server)
    prefill, decode = after["prefill"], after["decode"]
    assert prefill["kv_handover_num_handed_over"] >= 8
    assert decode["kv_handover_num_received"] >= 8
    assert decode["kv_handover_blocks_received"] > 0  # blocks moved, not recomputed
    assert decode["kv_handover_blocks_failed"] == 0
    assert prefill["prefix_cache_hits"] > before["prefill"]["prefix_cache_hits"]
    assert decode["kv_handover_blocks_hit"] > before["decode"]["kv_handover_blocks_hit"]
    assert decode["kv_handover_bytes_received"] > 0
    wait_until(lambda: _idle(server), 60, "both replicas idle, every block free")


def test_parity_through_the_hand_over_over_shared_memory(shm: Server, model: Path) -> None:
    _check_parity(shm, model)


def test_n_greater_than_one_hands_over_each_sequence(shm: Server, model: Path) -> None:
    """n = 3 greedy completions: each sequence samples its first token on the prefill
    replica and is handed over on its own; all three are transformers' tokens."""
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model).encode(TEXTS[1])
    expected = hf_greedy(model, prompt, 12)
    body = {"model": shm.model, "prompt": prompt, "max_tokens": 12, "n": 3,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    before = _by_role(shm)["decode"]["kv_handover_num_received"]
    r = httpx.post(shm.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == [expected] * 3
    assert _by_role(shm)["decode"]["kv_handover_num_received"] == before + 3
    wait_until(lambda: _idle(shm), 60, "both replicas idle, every block free")


def test_a_cancel_storm_across_the_roles_leaks_nothing(shm: Server) -> None:
    """40 streams, 20 cancelled at random points: in the prefill's queue or step, in the
    export, on the way, in the import, while decoding. Every stream ends as `length` or
    `cancelled`, and both pools and the transfer folder end empty."""
    rng = random.Random(32)

    async def run() -> dict[str, list[str]]:
        finishes: dict[str, list[str]] = {}
        begun = {i: asyncio.Event() for i in range(40)}

        async def one(c: httpx.AsyncClient, i: int) -> None:
            rid, fin = f"pd-storm-{i}", []
            body = {"model": shm.model, "prompt": f"Fact {i}: the river " * (1 + i % 5),
                    "max_tokens": 48, "ignore_eos": True, "stream": True}  # fmt: skip
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
            if i % 3 == 0:  # before its first token: queued or in its prefill
                for _ in range(rng.randrange(20)):
                    await asyncio.sleep(0)
            else:  # after it: around the hand-over, or decoding
                await begun[i].wait()
                for _ in range(rng.randrange(40)):
                    await asyncio.sleep(0)
            await c.post(f"/admin/cancel/pd-storm-{i}", headers=ADMIN)

        async with httpx.AsyncClient(base_url=shm.url, timeout=600) as c:
            doomed = rng.sample(range(40), 20)
            await asyncio.gather(*(one(c, i) for i in range(40)), *(cancel(c, i) for i in doomed))
        return finishes

    finishes = asyncio.run(run())
    assert len(finishes) == 40
    for rid, fin in finishes.items():
        assert fin in (["length"], ["cancelled"]), (rid, fin)
    assert any(f == ["cancelled"] for f in finishes.values())
    wait_until(lambda: _idle(shm), 60, "both replicas idle, every block free")


@pytest.mark.parametrize(
    ("module", "replica"),
    [("gpu_worker", 1), ("services.scheduler", 1), ("gpu_worker", 0)],
    ids=["decode-worker", "decode-scheduler", "prefill-worker"],
)
def test_a_replica_killed_mid_transfer_fails_only_its_requests(
    shm: Server, module: str, replica: int
) -> None:
    """A process is killed while blocks are on their way: the decode worker is stopped
    (SIGSTOP) until its scheduler has imports planned that it cannot run, so a transfer is
    certainly in flight; then the decode worker is killed in that state, or the decode
    scheduler or the prefill worker is killed and the decode worker let go (the files it
    reads outlive the replica that wrote them). Each request either completes (`length`) or
    fails with a retryable 503 (none hangs), the replica comes back, and nothing leaks on
    either side."""
    wait_until(lambda: _idle(shm), 60, "both replicas idle")
    results: list[tuple[int, str]] = []

    def one(i: int) -> None:
        body = {"model": shm.model, "prompt": f"Story {i}: " * 8, "max_tokens": 64,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(shm.url + "/v1/completions", json=body, timeout=300)
        finish = r.json()["choices"][0]["finish_reason"] if r.status_code == 200 else ""
        results.append((r.status_code, finish))

    def importing() -> bool:
        return _by_role(shm)["decode"]["kv_handover_num_importing"] > 0

    decode_worker = _pid_of(shm, "gpu_worker", 1)
    victim = _pid_of(shm, module, replica)
    os.kill(decode_worker, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(one, i) for i in range(8)]
            wait_until(importing, 120, "an import planned on the stopped decode worker", 0.01)
            os.kill(victim, signal.SIGKILL)
            if victim != decode_worker:
                os.kill(decode_worker, signal.SIGCONT)
            for f in futures:
                f.result()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(decode_worker, signal.SIGCONT)
    assert all(s in (200, 503) for s, _ in results), results
    assert all(f == "length" for s, f in results if s == 200), results
    if replica == 1:
        assert any(s == 503 for s, _ in results), results  # (those it held failed)
    wait_until(lambda: _idle(shm), 180, "the replica back, every block free")
    # and it serves again, through the hand-over
    with shm.client(timeout=300) as client:
        r = client.post("/v1/completions", json={"model": shm.model, "prompt": "After:",
                                                 "max_tokens": 4, "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200, r.text


def test_parity_through_the_hand_over_over_tcp(model: Path) -> None:
    """--kv-transfer tcp: the blocks travel in the messages (scheduler -> router ->
    scheduler -> worker, ZeroMQ), no shared folder."""
    with running_server(*PD, "--model", str(model), "--kv-transfer", "tcp") as s:
        _check_parity(s, model)


def test_logprobs_through_the_hand_over(shm: Server, model: Path) -> None:
    """Output logprobs (the first token's from the prefill replica, the rest from the decode
    replica) and prompt logprobs (the prefill replica's) equal log_softmax of transformers'
    logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model).encode(TEXTS[2])[:40]
    body = {"model": shm.model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": 2,
            "prompt_logprobs": 1}  # fmt: skip
    r = httpx.post(shm.url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    output = choice["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(input_ids=torch.tensor([prompt + output])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    n = len(prompt)
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(output) == 6
    for j, (token, value) in enumerate(zip(output, values, strict=True)):
        assert abs(value - float(ref[n - 1 + j, token])) < 1e-4, j
    prompt_entries = choice["prompt_logprobs"]
    assert len(prompt_entries) == n and prompt_entries[0] is None
    for pos in range(1, n):
        entry = prompt_entries[pos][str(prompt[pos])]
        assert abs(entry["logprob"] - float(ref[pos - 1, prompt[pos]])) < 1e-4, pos
    wait_until(lambda: _idle(shm), 60, "both replicas idle, every block free")


@pytest.mark.parametrize("mode", ["overlap", "drain"])
def test_a_swap_of_both_pools_under_hand_overs(
    tmp_path_factory: pytest.TempPathFactory, mode: str
) -> None:
    """tools/swap-model under load swaps both replicas: overlap, a sequence handed over
    keeps the version it started on (the decode replica runs it on the retiring one); drain,
    both replicas finish what they hold (hand-overs included) before the new version loads.
    Every output is one version's greedy tokens; then both pools are idle."""
    from tests.integration import test_swap

    root = tmp_path_factory.mktemp("pd-swap")
    a = make_tiny_model(root / "tiny-a", "llama", seed=1)
    b = make_tiny_model(root / "tiny-b", "llama", seed=2)
    with running_server(*PD, "--model", str(a), "--model-root", str(root)) as s:
        outs, result = test_swap._swap_under_load(s, b, mode, "v-b")
        assert result["returncode"] == 0 and result["ok"], result
        for (text, finish, version), prompt in zip(outs, test_swap.PROMPTS, strict=True):
            folder = b if version == "v-b" else a
            assert finish == "length", (finish, version)
            assert text == test_swap._reference(folder, prompt), (prompt, version)
        assert {r["version"] for r in test_swap._stats(s)["replicas"]} == {"v-b"}
        wait_until(lambda: _idle(s), 60, "both replicas idle, every block free")
