"""tools/benchmarks/perplexity.py against real servers: a shuttle server on a tiny random
float32 model, whose prompt logprobs give the perplexity transformers gives on the same
weights and the same token ids (the windows sent as lists of ids); and, where the peers are
installed, llama.cpp's llama-server on the default model's f32 GGUF, scored by forced
tokens, against transformers on the folder that GGUF was converted from."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from common.prepare_model import default_model_dir
from tests.server import running_server
from tests.tiny_models import make_tiny_model
from tests.waiting import wait_until
from tools.benchmarks.perplexity import (
    docs_section,
    held_text,
    load_tokenizer,
    load_transformers,
    main,
    make_windows,
    score,
    table,
    transformers_logprobs,
)
from tools.benchmarks.perplexity_servers import llamacpp_logprobs, served_model, server_logprobs

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny_model(tmp_path_factory.mktemp("ppl") / "tiny-llama", "llama")
    if not (folder / "tokenizer.json").is_file():
        pytest.skip("no default model folder to copy SmolLM2's tokenizer from")
    return folder


def test_server_perplexity_equals_transformers(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    windows = make_windows(load_tokenizer(str(tiny)), held_text(), 2, 64)
    reference = score("transformers", transformers_logprobs(load_transformers(str(tiny)), windows))
    with running_server("--model", str(tiny), "--max-num-batched-tokens", "48") as server:
        model = served_model(server.url)
        assert model == server.model
        # a 48-token budget: each 64-token prompt is prefilled (and its logprobs gathered)
        # in two chunks, both windows in flight at once
        got = server_logprobs(server.url, model, windows, concurrency=2)
        ours = score("shuttle", got)
        assert ours.tokens == reference.tokens == 126
        assert ours.ppl == pytest.approx(reference.ppl, rel=1e-3)
        # the command: one JSON line per source and the table, the server second
        out_file = tmp_path / "ppl.jsonl"
        argv = ["--transformers", str(tiny), "--url", f"shuttle fp32={server.url}"]
        assert main([*argv, "--windows", "2", "--window-len", "64", "--json", str(out_file)]) == 0
    lines = [json.loads(x) for x in out_file.read_text().splitlines()]
    assert [x["source"] for x in lines] == ["transformers:tiny-llama", "shuttle fp32"]
    assert all(x["tokens"] == 126 and x["windows"] == 2 for x in lines)
    assert lines[0]["tokens_sha256"] == lines[1]["tokens_sha256"]
    assert lines[0]["ppl"] == pytest.approx(reference.ppl, rel=1e-6)
    assert lines[1]["ppl"] == pytest.approx(reference.ppl, rel=1e-3)
    assert lines[0]["ratio"] == 1.0
    assert lines[1]["reference"] == lines[0]["source"] == "transformers:tiny-llama"
    assert lines[1]["ratio"] == pytest.approx(lines[1]["ppl"] / lines[0]["ppl"])
    printed = capsys.readouterr().out
    assert table(lines) in printed
    section = docs_section(out_file)
    assert section.startswith("## Quality") and table(lines) in section
    assert "2 windows of 64 tokens" in section and lines[0]["tokens_sha256"] in section


# --- llama.cpp, where the peers are installed (tools/peers/setup.sh) ----------------------------

PEERS = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "shuttle-peers"))
LLAMA_SERVER = PEERS / "llama.cpp" / "build" / "bin" / "llama-server"
F32_GGUF = PEERS / "models" / "model-f32.gguf"  # the default model's folder, converted


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _llama_server(gguf: Path, log: Path) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(LLAMA_SERVER), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-t", "2", "-np", "2", "-c", "1024", "--no-webui"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(url + "/health", timeout=5).status_code == 200
        return False

    try:
        wait_until(healthy, 300, "llama-server's /health")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(
    not (LLAMA_SERVER.is_file() and F32_GGUF.is_file()), reason="llama.cpp peer not installed"
)
def test_llamacpp_forced_tokens_give_transformers_perplexity(tmp_path: Path) -> None:
    folder = default_model_dir()
    windows = make_windows(load_tokenizer(str(folder)), held_text(), 2, 24)
    reference = score(
        "transformers", transformers_logprobs(load_transformers(str(folder)), windows)
    )
    with _llama_server(F32_GGUF, tmp_path / "llama-server.log") as url:
        ours = score("llama.cpp", llamacpp_logprobs(url, windows, concurrency=2))
    assert ours.tokens == reference.tokens == 46
    assert ours.ppl == pytest.approx(reference.ppl, rel=1e-3)  # (its KV cache is float16)
