"""LoRA serving on the real processes and the tiny model: adapters listed, loaded and unloaded
over HTTP (and tools/lora), a request's `model` selecting one (greedy tokens equal to
transformers + peft), unknown and unloaded adapters 404 before start, a malformed adapter
refused naming its file and field, cache isolation seen in /admin/stats, and 16 streaming
clients across 4 adapters while adapters are loaded and unloaded."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from tests.lora_adapters import make_adapter, peft_model
from tests.reference import greedy, hf_greedy
from tests.server import REPO, Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until

TOKEN = "lora-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_NEW = 12
PROMPT = "The quick brown fox jumps over the lazy dog and then runs far into the old forest"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(root / "tiny", "llama", seed=5)
    out = {"model": model, "root": root}
    targets = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], "all"]
    for i in range(6):  # a0..a3 for the load test, a4 and a5 (a4's name, other weights)
        t = targets[i % len(targets)]
        kw = {"target_modules": "all-linear"} if t == "all" else {"target_modules": t}
        out[f"a{i}"] = make_adapter(model, root / f"a{i}", r=4 * (1 + i % 3), seed=10 + i, **kw)
    bad = root / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(orjson.dumps({"r": "eight"}).decode())
    out["bad"] = bad
    big = make_adapter(model, root / "big", r=32, seed=3)  # above --max-lora-rank 16
    out["big"] = big
    return out


@pytest.fixture(scope="module")
def server(folders: dict[str, Path]) -> Iterator[Server]:
    with running_server(
        "--model",
        str(folders["model"]),
        "--enable-lora",
        "--lora-modules",
        f"a0={folders['a0']}",
        "--max-loras",
        "3",
        "--max-lora-rank",
        "16",
        "--max-cpu-loras",
        "4",
        "--admin-token",
        TOKEN,
        "--model-root",
        str(folders["root"]),
        "--max-num-seqs",
        "32",
        "--block-size",
        "4",
    ) as s:
        yield s


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


def _load(server: Server, name: str, path: Path) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(server.url + "/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=300)


def _unload(server: Server, name: str) -> httpx.Response:
    body = {"lora_name": name}
    return httpx.post(server.url + "/v1/unload_lora_adapter", json=body, headers=ADMIN, timeout=300)


def _complete(server: Server, model: str, prompt: str = PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NUM_NEW, "temperature": 0.0}
    body["ignore_eos"] = True
    return httpx.post(server.url + "/v1/completions", json=body, timeout=300)


def _reference(folders: dict[str, Path], adapter: str | None) -> str:
    tok = AutoTokenizer.from_pretrained(folders["model"])
    ids = tok.encode(PROMPT)
    if adapter is None:
        out = hf_greedy(folders["model"], ids, NUM_NEW)
    else:
        out = greedy(peft_model(str(folders["model"]), str(folders[adapter])), ids, NUM_NEW)
    return tok.decode(out, skip_special_tokens=True)


def test_startup_adapter_is_listed_and_equals_peft(server: Server, folders: dict) -> None:
    cards = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    by_id = {c["id"]: c for c in cards}
    assert by_id["a0"]["parent"] == server.model and by_id["a0"]["root"] == str(folders["a0"])
    base = _complete(server, server.model).json()["choices"][0]["text"]
    lora = _complete(server, "a0").json()
    assert lora["model"] == "a0"
    assert lora["choices"][0]["text"] == _reference(folders, "a0")
    assert base == _reference(folders, None) != lora["choices"][0]["text"]


def test_load_use_unload_and_404s(server: Server, folders: dict) -> None:
    r = _load(server, "a1", folders["a1"])
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'a1' added successfully."
    assert _load(server, "a1", folders["a1"]).status_code == 400  # already loaded
    assert _complete(server, "a1").json()["choices"][0]["text"] == _reference(folders, "a1")
    assert _unload(server, "a1").status_code == 200
    for name in ("a1", "never-loaded"):
        r = _complete(server, name)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert _unload(server, "a1").status_code == 404


def test_malformed_and_too_big_adapters_are_refused_naming_file_and_field(
    server: Server, folders: dict
) -> None:
    r = _load(server, "bad", folders["bad"])
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "adapter_config.json" in message and "r" in message
    r = _load(server, "big", folders["big"])
    assert r.status_code == 400 and "16" in r.json()["error"]["message"]
    outside = {"lora_name": "x", "lora_path": "/tmp"}
    r = httpx.post(server.url + "/v1/load_lora_adapter", json=outside, headers=ADMIN, timeout=30)
    assert r.status_code == 403
    assert server.serves()  # serving goes on


def test_tools_lora_lists_loads_and_unloads(server: Server, folders: dict) -> None:
    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "tools.lora", "--url", server.url, "--admin-token", TOKEN]
        return subprocess.run([*cmd, *args], cwd=REPO, capture_output=True, text=True, timeout=300)

    assert tool("load", "t2", str(folders["a2"])).returncode == 0
    listed = orjson.loads(tool("--json", "list").stdout)
    assert {a["id"] for a in listed} >= {"a0", "t2"}
    assert tool("unload", "t2").returncode == 0
    assert tool("unload", "t2").returncode == 1


def test_cache_isolation_in_admin_stats(server: Server, folders: dict) -> None:
    assert _load(server, "iso", folders["a4"]).status_code == 200
    prompt = "Cache isolation, a prompt no other test sends: " + PROMPT

    def hits() -> int:
        return _stats(server)["prefix_cache_hits"]

    first = {}
    for model in (server.model, "a0", "iso"):
        before = hits()
        assert _complete(server, model, prompt).status_code == 200
        first[model] = hits() - before
    assert first == {server.model: 0, "a0": 0, "iso": 0}  # nobody shares the others' blocks
    before = hits()
    assert _complete(server, "iso", prompt).status_code == 200
    assert hits() > before  # its own blocks hit
    rows = _stats(server)["lora_adapters"]
    assert rows["iso"]["num_cached_blocks"] > 0 and rows["iso"]["num_requests"] == 2
    assert _unload(server, "iso").status_code == 200
    assert "iso" not in _stats(server)["lora_adapters"]
    assert _load(server, "iso", folders["a5"]).status_code == 200  # other weights, same name
    before = hits()
    assert _complete(server, "iso", prompt).status_code == 200
    assert hits() == before  # computed again: the old blocks are unreachable
    assert _unload(server, "iso").status_code == 200


async def _client(
    c: httpx.AsyncClient, model: str, rounds: int, log: list[tuple[str, int, str]]
) -> None:
    """Greedy streams one after another, `rounds` of them or (rounds 0) until one is
    refused; (model, status, finish) of each."""
    for i in range(rounds or 1000):
        body = {
            "model": model,
            "prompt": f"{PROMPT} {i}",
            "max_tokens": NUM_NEW,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
        }
        async with c.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                log.append((model, r.status_code, ""))
                await r.aread()
                if not rounds:
                    return
                continue
            finish = ""
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = orjson.loads(line[6:])
                    if "error" in chunk:
                        finish = "error"
                    for choice in chunk.get("choices", []):
                        finish = choice.get("finish_reason") or finish
            log.append((model, 200, finish))


def test_16_streams_across_4_adapters_while_loading_and_unloading(
    server: Server, folders: dict
) -> None:
    for name in ("s1", "s2", "s3"):
        assert _load(server, name, folders[f"a{name[1]}"]).status_code == 200
    log: list[tuple[str, int, str]] = []

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            models = ["a0", "s1", "s2", "s3"]
            # s3's clients stream until it is unloaded (a 404), the others 4 times each
            clients = [
                asyncio.create_task(_client(c, models[i % 4], 0 if i % 4 == 3 else 4, log))
                for i in range(16)
            ]
            await asyncio.to_thread(wait_until, lambda: len(log) >= 8, 300, "8 streams done")
            load = {"lora_name": "s4", "lora_path": str(folders["a4"])}
            loaded = c.post("/v1/load_lora_adapter", json=load, headers=ADMIN)
            unloaded = c.post("/v1/unload_lora_adapter", json={"lora_name": "s3"}, headers=ADMIN)
            answers = await asyncio.gather(loaded, unloaded)
            assert [a.status_code for a in answers] == [200, 200]
            await asyncio.gather(*clients)

    asyncio.run(go())
    failed = [(m, s, f) for m, s, f in log if (s, f) != (200, "length")]
    assert sorted(failed) == [("s3", 404, "")] * 4  # each s3 client's last: 404 before start
    assert len([m for m, _, _ in log if m != "s3"]) == 48
    assert _complete(server, "s4").status_code == 200
    assert _complete(server, "s3").status_code == 404


def test_data_parallel_replicas_all_load_and_unload(folders: dict) -> None:
    """Two replicas: a load reaches both (each serves the adapter, /admin/stats sums them),
    requests of the adapter succeed wherever routed, an unload leaves neither serving it."""
    flags = ("--data-parallel-size", "2", "--num-threads", "1", "--admin-token", TOKEN)
    with running_server(
        *flags, "--model", str(folders["model"]), "--enable-lora", "--max-loras", "2"
    ) as s:
        assert _load(s, "dp", folders["a1"]).status_code == 200
        for i in range(4):
            r = _complete(s, "dp", f"{PROMPT} {i}")
            assert r.status_code == 200 and r.json()["model"] == "dp"
        stats = _stats(s)
        assert stats["lora_adapters"]["dp"]["num_requests"] == 4
        assert all("dp" in r["lora_adapters"] for r in stats["replicas"])
        assert _unload(s, "dp").status_code == 200
        assert _complete(s, "dp").status_code == 404
        assert all(not r["lora_adapters"] for r in _stats(s)["replicas"])
