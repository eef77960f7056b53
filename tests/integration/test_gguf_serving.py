"""A GGUF file served as it is, over real HTTP: its tokenizer from the file, its quantized
weights resident as stored (/admin/stats, /metrics), a hot-swap to another GGUF file, and a
file with a tensor type shuttle does not serve refused by name while the old model serves on.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import httpx
import pytest

from tests.gguf_models import make_tiny_k_model, write_gguf
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model

Q = gguf.GGMLQuantizationType
TOKEN = "gguf-admin"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-models")
    a = make_tiny_model(root / "tiny-a", "llama", seed=1)
    b = make_tiny_model(root / "tiny-b", "llama", seed=2)  # a's layout: an overlap swap
    k = make_tiny_k_model(root / "tiny-k")
    out = {"a": root / "a-q8_0.gguf", "b": root / "b-q4_0.gguf", "bad": root / "k-q2_k.gguf"}
    write_gguf(a, out["a"], Q.Q8_0)
    write_gguf(b, out["b"], Q.Q4_0)
    # one tensor of a type no kernel here serves
    write_gguf(k, out["bad"], Q.Q4_K, overrides={"model.layers.1.mlp.up_proj.weight": Q.Q2_K})
    return {**out, "root": root}


def _complete(server: Server) -> dict:
    body = {"model": server.model, "prompt": "hello world", "max_tokens": 8, "temperature": 0}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stats(server: Server) -> dict:
    return httpx.get(server.url + "/admin/stats", headers=ADMIN, timeout=30).json()


def test_a_gguf_file_serves_swaps_and_refuses_a_type_it_cannot_serve(
    files: dict[str, Path],
) -> None:
    flags = ("--model", str(files["a"]), "--admin-token", TOKEN, "--model-root", str(files["root"]))
    with running_server(*flags) as server:
        first = _complete(server)
        assert first["usage"]["completion_tokens"] == 8
        stats = _stats(server)
        assert stats["model"]["quantization"] == "gguf:Q8_0"
        assert 0 < stats["model_weight_bytes"] < 4 * files["a"].stat().st_size
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert "shuttle:model_weight_bytes" in metrics

        r = httpx.post(
            server.url + "/admin/swap-model",
            json={"model": str(files["bad"]), "mode": "drain"},
            headers=ADMIN,
            timeout=300,
        )
        assert r.status_code >= 400, r.text
        assert "Q2_K" in r.text and "ffn_up" in r.text, r.text  # the tensor and its type
        assert _stats(server)["version"] == stats["version"]
        again = _complete(server)  # the old model serves on, the same tokens
        assert again["choices"][0]["text"] == first["choices"][0]["text"]

        r = httpx.post(
            server.url + "/admin/swap-model",
            json={"model": str(files["b"]), "mode": "overlap"},
            headers=ADMIN,
            timeout=300,
        )
        assert r.status_code == 200, r.text
        after = _stats(server)
        assert after["version"] != stats["version"]
        assert after["model"]["quantization"] == "gguf:Q4_0"
        assert _complete(server)["system_fingerprint"] == after["version"]
