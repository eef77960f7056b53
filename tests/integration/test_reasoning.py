"""--reasoning-parser on the real processes, with a tiny random model whose test-built
tokenizer has think tags as tokens of their own: the output (held to the tags and a few
words by allowed_token_ids, so the tags come up) is split into reasoning_content and
content as the parser splits its text, streamed and not alike."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from services.gateway.openai.reasoning import split_reasoning
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model_own_vocab

TAGS = ("<think>", "</think>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("thinker")
    return make_tiny_model_own_vocab(root / "tiny-thinker", seed=3, added_tokens=TAGS)


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Server]:
    with running_server(str(folder), "--reasoning-parser", "deepseek_r1") as s:
        yield s


def _chat(http: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r


def test_think_tags_split_the_answer(server: Server) -> None:
    http = server.client()
    ids = {tag: http.post("/tokenize", json={"prompt": tag}).json()["tokens"] for tag in TAGS}
    assert all(len(v) == 1 for v in ids.values())  # a token of its own each
    words = http.post("/tokenize", json={"prompt": " the fox the dog"}).json()["tokens"]
    end = ids["</think>"][0]
    base = {
        "messages": [{"role": "user", "content": "Where does the fox run?"}],
        "max_tokens": 12, "temperature": 1.0,
        "allowed_token_ids": sorted({*words, ids["<think>"][0], end}),
        "return_token_ids": True,
    }  # fmt: skip
    for seed in range(40):  # a seed whose output closes its thinking mid-way
        out = _chat(http, base | {"seed": seed}).json()
        token_ids = out["choices"][0]["token_ids"]
        if end in token_ids[1:-1]:
            break
    else:
        pytest.fail("no seed closed the thinking")
    text = http.post("/detokenize", json={"tokens": token_ids}).json()["prompt"]
    thought, answer = split_reasoning(text, "deepseek_r1")
    message = out["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (thought, answer)
    assert thought and answer
    # streamed: the same split, as deltas
    stream = http.post("/v1/chat/completions", json=base | {"seed": seed, "stream": True})
    deltas = [
        line[len("data: ") :] for line in stream.text.splitlines() if line.startswith("data: {")
    ]
    chunks = [orjson.loads(d)["choices"][0]["delta"] for d in deltas]
    streamed = (
        "".join(c.get("reasoning_content", "") for c in chunks),
        "".join(c.get("content") or "" for c in chunks),
    )
    assert streamed == (thought, answer)


def test_a_structured_output_starts_after_the_thinking(server: Server) -> None:
    http = server.client()
    end = http.post("/tokenize", json={"prompt": "</think>"}).json()["tokens"][0]
    body = {
        "messages": [{"role": "user", "content": "Which animal?"}],
        "max_tokens": 40, "temperature": 1.0,
        "guided_choice": ["the fox", "the dog"],
        "logit_bias": {str(end): 3.0},  # (a random model thinks briefly)
    }  # fmt: skip
    thoughts = []
    for seed in range(10):
        body |= {"seed": seed, "return_token_ids": True}
        choice = _chat(http, body).json()["choices"][0]
        if end not in choice["token_ids"]:
            continue  # thought to the end of max_tokens: the grammar never started
        # the grammar held the answer after the thinking to one of the choices
        assert choice["message"]["content"] in ("the fox", "the dog"), choice
        thoughts.append(choice["message"]["reasoning_content"])
    # and left the thinking free (the grammar alone would allow only the choices)
    assert any(t and t not in ("the fox", "the dog") for t in thoughts), thoughts
