"""Model hot-swap on the real processes, under load: zero failed requests, every output
equal to the greedy reference of the version that served it (its system_fingerprint), no
prefix-cache reuse across versions, and a bad swap leaves the old model serving."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from tests.reference import hf_greedy
from tests.server import REPO, Server, running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until, wait_until_async

TOKEN = "swap-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
NUM_NEW = 24
PROMPTS = [f"Request {i}: the quick brown fox jumps over the lazy dog and" for i in range(32)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    root = tmp_path_factory.mktemp("models")
    return {
        "a": make_tiny_model(root / "tiny-a", "llama", seed=1),
        "b": make_tiny_model(root / "tiny-b", "llama", seed=2),  # same KV layout as a
        "c": make_tiny_model(root / "tiny-c", "llama", num_layers=3, seed=3),  # another layout
        "root": root,
    }


def _reference(folder: Path, prompt: str) -> str:
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.encode(prompt)
    return tok.decode(hf_greedy(folder, ids, NUM_NEW), skip_special_tokens=True)


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


async def _stream(
    c: httpx.AsyncClient, model: str, prompt: str, begun: list[str] | None = None
) -> tuple[str, str, str]:
    """One greedy stream; (text, finish reason, version). `begun` gets the prompt with the
    stream's first event."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NUM_NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    text, finish, version = "", "", ""
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = orjson.loads(line[6:])
                if begun is not None and prompt not in begun:
                    begun.append(prompt)
                version = chunk.get("system_fingerprint") or version
                if chunk.get("choices"):
                    text += chunk["choices"][0].get("text") or ""
                    finish = chunk["choices"][0].get("finish_reason") or finish
    return text, finish, version


def _swap_under_load(
    server: Server, target: Path, mode: str, label: str
) -> tuple[list[tuple[str, str, str]], dict]:
    result: dict = {}

    def swap() -> None:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tools.swap_model",
                "--model",
                str(target),
                "--version",
                label,
                "--mode",
                mode,
                "--url",
                server.url,
                "--admin-token",
                TOKEN,
                "--json",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        result.update(orjson.loads(out.stdout), returncode=out.returncode)

    def new_requests_get_the_new_version() -> bool:
        """The swap reached the phase where a new request starts on the new version (or it
        is over): drain pauses starts at once; overlap once the new version is loaded."""
        phase = (_stats(server).get("swap") or {}).get("phase")
        return bool(result) or phase in (
            ("retiring",) if mode == "overlap" else ("draining", "loading")
        )

    async def load() -> list[tuple[str, str, str]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
            begun: list[str] = []
            first = [asyncio.create_task(_stream(c, server.model, p, begun)) for p in PROMPTS[:16]]
            # (a stream that failed ends the wait too: gather below raises its error)
            await wait_until_async(
                lambda: len(begun) == 16 or any(t.done() for t in first),
                120,
                "the first 16 streams to begin",
            )
            swapper = threading.Thread(target=swap)
            swapper.start()
            await asyncio.to_thread(
                wait_until,
                new_requests_get_the_new_version,
                300,
                f"the {mode} swap to take new requests",
            )
            later = [asyncio.create_task(_stream(c, server.model, p)) for p in PROMPTS[16:]]
            outs = await asyncio.gather(*first, *later)
            await asyncio.to_thread(swapper.join, 300)
            return list(outs)

    return asyncio.run(load()), result


@pytest.mark.parametrize("mode", ["overlap", "drain"])
def test_swap_under_32_streams_fails_nothing(models: dict[str, Path], mode: str) -> None:
    a, target = models["a"], models["b"] if mode == "overlap" else models["c"]
    flags = (
        "--model",
        str(a),
        "--admin-token",
        TOKEN,
        "--model-root",
        str(models["root"]),
        "--max-num-seqs",
        "32",
    )
    with running_server(*flags) as server:
        version_a = _stats(server)["version"]
        # the same prompt before the swap: its blocks are cached under version a
        httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": PROMPTS[0], "max_tokens": 2},
        )
        outs, result = _swap_under_load(server, target, mode, f"v-{mode}")
        assert result["returncode"] == 0 and result["ok"], result
        assert result["previous_version"] == version_a and result["version"] == f"v-{mode}"
        refs = {version_a: a, f"v-{mode}": target}
        served = {v for _, _, v in outs}
        assert served <= set(refs), served
        for prompt, (text, finish, version) in zip(PROMPTS, outs, strict=True):
            assert finish == "length"
            assert text == _reference(refs[version], prompt), (prompt, version)
        assert f"v-{mode}" in served  # requests after the swap ran on the new version
        # the same prompt after the swap: no block of the old version is reused
        before = _stats(server)
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": PROMPTS[0] + " again", "max_tokens": 2},
        )
        assert r.json()["system_fingerprint"] == f"v-{mode}"
        after = _stats(server)
        assert after["prefix_cache_hits"] == before["prefix_cache_hits"]
        models_list = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]
        assert models_list["version"] == f"v-{mode}"
        assert after["num_used_blocks"] == 0


def test_a_bad_swap_changes_nothing(models: dict[str, Path], tmp_path: Path) -> None:
    flags = (
        "--model",
        str(models["a"]),
        "--admin-token",
        TOKEN,
        "--model-root",
        str(models["root"]),
    )
    with running_server(*flags) as server:
        before = _stats(server)["version"]
        text = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.0},
        ).json()["choices"][0]["text"]
        cases = [
            ({"model": str(models["root"] / "missing")}, 404, "config.json"),
            ({"model": "/etc"}, 403, "outside the model root"),
            ({"model": str(models["root"] / ".." / "x")}, 403, "outside the model root"),
            ({"model": str(models["c"]), "mode": "overlap"}, 400, "layout"),
            ({"model": str(models["a"]), "mode": "sideways"}, 400, "mode"),
        ]
        for body, status, words in cases:
            r = httpx.post(server.url + "/admin/swap-model", json=body, headers=ADMIN, timeout=120)
            assert r.status_code == status, (body, r.text)
            assert words in r.text, (body, r.text)
        unauthorized = httpx.post(
            server.url + "/admin/swap-model", timeout=30, json={"model": str(models["b"])}
        )
        assert unauthorized.status_code == 401
        assert _stats(server)["version"] == before
        again = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            json={"model": server.model, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0.0},
        ).json()
        assert again["choices"][0]["text"] == text and again["system_fingerprint"] == before
