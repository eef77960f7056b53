"""Beam search on the real processes and the real small model: the beams returned equal
transformers' `generate(num_beams=...)` on the same weights, and the beams' steps share
the prompt's KV blocks through the prefix cache (/admin/stats)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from common.prepare_model import prepare_default_model
from tests.server import Server, running_server

ADMIN = "beam-admin-token"
PROMPT = (
    "The history of Paris spans more than two thousand years. The city grew on an island "
    "in the Seine and became the capital of France. Today, the most famous monument of Paris is"
)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--served-model-name", "smol", "--admin-token", ADMIN) as s:
        yield s


def _stats(server: Server) -> dict[str, Any]:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.get(server.url + "/admin/stats", headers=auth, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _transformers_beams(prompt_ids: list[int], beams: int, max_tokens: int) -> list[list[int]]:
    import transformers

    folder = prepare_default_model()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            num_beams=beams,
            num_return_sequences=beams,
            max_new_tokens=max_tokens,
            do_sample=False,
            early_stopping=False,
            length_penalty=1.0,
            eos_token_id=2,
            pad_token_id=2,
        )
    rows = out[:, len(prompt_ids) :].tolist()
    return [row[: row.index(2) + 1] if 2 in row else row for row in rows]


def test_beams_equal_transformers_and_share_prompt_blocks(server: Server) -> None:
    http = server.client()
    prompt_ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    before = _stats(server)
    body = {
        "model": "smol", "prompt": PROMPT, "max_tokens": 6, "n": 3, "use_beam_search": True,
        "return_token_ids": True,
    }  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    ours = [c["token_ids"] for c in r.json()["choices"]]
    after = _stats(server)
    assert ours == _transformers_beams(prompt_ids, 3, 6)
    # every step after the first found the prompt's full blocks cached
    assert after["prefix_cache_hits"] > before["prefix_cache_hits"]
