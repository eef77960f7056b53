"""The families with new attention through the real processes: a tiny Gemma 3 (5 sliding
layers : 1 global, local rope) and a tiny Phi-3 (fused weights, a window on every layer)
served by `shuttle serve --model FOLDER`, their greedy tokens equal to transformers' for
prompts that cross the window several times, one at a time and all at once in chunks. And a
tiny gpt-oss with MXFP4 experts as shipped (sinks, alternating windows, YaRN) the same way."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.reference import hf_greedy
from tests.server import running_server
from tests.tiny_models import VOCAB_SIZE, make_tiny_model
from tests.tiny_moe_models import make_tiny_mxfp4_gpt_oss

NUM_NEW = 16
PROMPT_LENS = (3, 17, 40, 75)  # windows of 15 and 16: up to 5 windows deep


def _complete(client, model: str, prompt: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    r = client.post(
        "/v1/completions",
        json={
            "model": model,
            "prompt": prompt,
            "max_tokens": NUM_NEW,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("arch", ["gemma3", "phi3"])
def test_served_tokens_equal_transformers(arch: str, tmp_path: Path) -> None:
    folder = make_tiny_model(tmp_path / arch, arch)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = [hf_greedy(folder, p, NUM_NEW) for p in prompts]
    flags = ("--model", str(folder), "--max-num-batched-tokens", "24")
    with running_server(*flags) as server, server.client(timeout=600) as client:
        assert [_complete(client, server.model, p) for p in prompts] == expected
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _complete(client, server.model, p), prompts))
        assert together == expected


def test_served_mxfp4_gpt_oss_equals_transformers(tmp_path: Path) -> None:
    """`shuttle serve --model` on an MXFP4 gpt-oss folder: transformers' greedy tokens on the
    same folder (it dequantizes the experts), alone and all at once in chunks; a chat request
    renders the folder's template."""
    folder, _ = make_tiny_mxfp4_gpt_oss(tmp_path)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    expected = [hf_greedy(folder, p, NUM_NEW) for p in prompts]
    flags = ("--model", str(folder), "--max-num-batched-tokens", "24")
    with running_server(*flags) as server, server.client(timeout=600) as client:
        assert [_complete(client, server.model, p) for p in prompts] == expected
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(lambda p: _complete(client, server.model, p), prompts))
        assert together == expected
        r = client.post(
            "/v1/chat/completions",
            json={
                "model": server.model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 4,
                "temperature": 0.0,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
