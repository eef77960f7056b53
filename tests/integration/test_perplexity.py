"""tools/benchmarks/perplexity.py against a real shuttle server on a tiny random float32
model: the server's prompt logprobs give the perplexity transformers gives on the same
weights and the same token ids (the windows sent as lists of ids)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.server import running_server
from tests.tiny_models import make_tiny_model
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
from tools.benchmarks.perplexity_servers import served_model, server_logprobs

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
