"""Greedy parity through the real processes: shuttle's tokens equal transformers' on
SmolLM2 (fp32), served one at a time, all together as one batch, and with a token budget
small enough to chunk every prompt."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from common.prepare_model import prepare_default_model
from tests.reference import hf_greedy
from tests.server import running_server

NUM_NEW = 32
TEXTS = [
    "The capital of France is",
    "Write a haiku about the sea and the wind.",
    "def fibonacci(n):\n    ",
    "List three primary colours:\n1.",
    "Once upon a time, in a village at the edge of a dark forest, there lived an old "
    "clockmaker who",
    "Translate to French: 'The weather is lovely today and we are going to the beach.'",
    " ".join(f"item {i}," for i in range(40)),
    "Explain, step by step, how a refrigerator keeps food cold. " * 6,
]


@pytest.fixture(scope="module")
def model_dir():  # type: ignore[no-untyped-def]
    return prepare_default_model()


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = [tok.encode(t) for t in TEXTS]
    assert len({len(p) for p in ids}) == len(ids), "prompts must have different lengths"
    assert min(len(p) for p in ids) > 4 and max(len(p) for p in ids) > 100
    return ids


@pytest.fixture(scope="module")
def expected(model_dir, prompts) -> list[list[int]]:  # type: ignore[no-untyped-def]
    return [hf_greedy(model_dir, p, NUM_NEW) for p in prompts]


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
    body = r.json()
    assert body["usage"]["completion_tokens"] == NUM_NEW
    return body["choices"][0]["token_ids"]


def _serve_all(server, prompts: list[list[int]], together: bool) -> list[list[int]]:  # type: ignore[no-untyped-def]
    with server.client(timeout=900) as client:
        if not together:
            return [_complete(client, server.model, p) for p in prompts]
        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(lambda p: _complete(client, server.model, p), prompts))


def test_parity_alone_and_batched(prompts, expected) -> None:  # type: ignore[no-untyped-def]
    with running_server("--max-num-batched-tokens", "2048") as server:
        assert _serve_all(server, prompts, together=False) == expected
        assert _serve_all(server, prompts, together=True) == expected


def test_parity_with_every_prompt_chunked(prompts, expected) -> None:  # type: ignore[no-untyped-def]
    budget = min(len(p) for p in prompts) - 1
    with running_server("--max-num-batched-tokens", str(budget)) as server:
        assert _serve_all(server, prompts, together=True) == expected
