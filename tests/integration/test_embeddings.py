"""POST /v1/embeddings on the real processes, over the `openai` client: on a tiny random model
(mean pooling, chunked prefill) and on SmolLM2 (last-token pooling, the default), each vector
equals transformers' `last_hidden_state` pooled the same way and L2-normalised, within 1e-4
(float32), while greedy generation streams on the same server (its tokens unchanged by the
embeddings requests beside it); batched inputs, token-id inputs, base64, and the refusals
(`dimensions` on a model without Matryoshka training, an input over the model length, an
unknown field)."""

from __future__ import annotations

import base64
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest
import torch

from common.prepare_model import prepare_default_model
from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from tests.reference import hf_pooled
from tests.server import Server, running_server
from tests.tiny_models import make_tiny_model

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors", "hi"]
IDS = [1, 200, 3000, 45, 6]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> Iterator[Server]:
    # chunks of 8 tokens: a prompt's mean is summed over several steps
    flags = ("--pooling", "mean", "--max-num-batched-tokens", "8", "--max-model-len", "256")
    flags += ("--grpc-port", "0")
    with running_server(str(tiny_dir), *flags) as s:
        yield s


@pytest.fixture(scope="module")
def smol() -> Iterator[Server]:
    with running_server(str(prepare_default_model()), "--max-model-len", "512") as s:
        yield s


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)


def _ids(server: Server, text: str) -> list[int]:
    """The ids the server embeds for `text` (as vLLM: with the tokenizer's special tokens)."""
    with server.client() as http:
        got = http.post("/tokenize", json={"prompt": text, "add_special_tokens": True})
    return list(got.json()["tokens"])


def _expected(model_dir: Path | str, ids: list[int], pooling: str) -> torch.Tensor:
    return torch.nn.functional.normalize(torch.tensor(hf_pooled(model_dir, ids, pooling)), dim=0)


class Generation:
    """Greedy completions streaming in the background; `started` once each has a token."""

    def __init__(self, client: openai.OpenAI, model: str, num: int, max_tokens: int) -> None:
        self.outputs: list[list[str]] = [[] for _ in range(num)]
        self.first = [threading.Event() for _ in range(num)]
        self.threads = [
            threading.Thread(target=self._run, args=(client, model, i, max_tokens), daemon=True)
            for i in range(num)
        ]
        for t in self.threads:
            t.start()

    def _run(self, client: openai.OpenAI, model: str, i: int, max_tokens: int) -> None:
        stream = client.completions.create(
            model=model,
            prompt=f"Count: {i}, {i + 1},",
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in stream:
            self.outputs[i].append(chunk.choices[0].text if chunk.choices else "")
            self.first[i].set()

    def wait_started(self) -> None:
        for event in self.first:
            assert event.wait(300), "a generation stream never started"

    def texts(self) -> list[str]:
        for t in self.threads:
            t.join(300)
            assert not t.is_alive(), "a generation stream never ended"
        return ["".join(parts) for parts in self.outputs]


def _embed_beside_generation(
    server: Server, model_dir: Path | str, pooling: str, max_tokens: int
) -> None:
    client = _client(server)
    inputs: list[str | list[int]] = [*TEXTS, IDS]
    gen = Generation(client, server.model, 2, max_tokens)
    gen.wait_started()
    got = client.embeddings.create(model=server.model, input=inputs)  # type: ignore[arg-type]
    mixed = gen.texts()
    assert [d.index for d in got.data] == [0, 1, 2, 3]
    ids = [*(_ids(server, t) for t in TEXTS), IDS]
    assert got.usage.prompt_tokens == sum(len(i) for i in ids)
    for item, prompt in zip(got.data, ids, strict=True):
        want = _expected(model_dir, prompt, pooling)
        torch.testing.assert_close(torch.tensor(item.embedding), want, rtol=0, atol=1e-4)
    # the generation beside them is what it is alone
    alone = Generation(client, server.model, 2, max_tokens).texts()
    assert mixed == alone


def test_tiny_mean_pooling_equals_transformers_beside_generation(
    tiny: Server, tiny_dir: Path
) -> None:
    _embed_beside_generation(tiny, tiny_dir, "mean", 200)


def test_smol_last_token_pooling_equals_transformers_beside_generation(smol: Server) -> None:
    _embed_beside_generation(smol, prepare_default_model(), "last", 24)


def test_base64_is_the_float_vector_as_little_endian_float32(tiny: Server) -> None:
    client = _client(tiny)
    floats = client.embeddings.create(model=tiny.model, input="a vector", encoding_format="float")
    with tiny.client() as http:  # (the openai client decodes base64 itself: read it raw)
        body = {"model": tiny.model, "input": "a vector", "encoding_format": "base64"}
        raw = http.post("/v1/embeddings", json=body).json()["data"][0]["embedding"]
    vector = floats.data[0].embedding
    assert struct.unpack(f"<{len(vector)}f", base64.b64decode(raw)) == tuple(vector)
    # left unset, the client asks for base64 and decodes it itself
    decoded = client.embeddings.create(model=tiny.model, input="a vector")
    assert decoded.data[0].embedding == vector


def test_refusals_name_their_field(tiny: Server) -> None:
    client = _client(tiny)
    cases = [
        ({"input": "x", "dimensions": 8}, "dimensions", "does not support matryoshka"),
        ({"input": [[5] * 257]}, "input", "more than the model's maximum context length"),
        ({"input": "x", "pooling_type": "cls"}, "pooling_type", "unknown field"),
    ]
    for body, param, words in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=tiny.model, input=body.pop("input"), extra_body=body)  # type: ignore[arg-type]
        error = info.value.body
        assert isinstance(error, dict) and error["param"] == param and words in error["message"]
    # truncate_prompt_tokens keeps the last tokens instead
    kept = client.embeddings.create(
        model=tiny.model, input=[[5] * 257], extra_body={"truncate_prompt_tokens": 256}
    )
    assert kept.usage.prompt_tokens == 256


def test_grpc_embed_answers_the_http_vectors(tiny: Server) -> None:
    assert tiny.grpc_addr is not None
    http = _client(tiny).embeddings.create(model=tiny.model, input=[TEXTS[0], IDS])
    with grpc.insecure_channel(tiny.grpc_addr) as channel:
        inputs = [pb.EmbedInput(text=TEXTS[0]), pb.EmbedInput(token_ids=pb.TokenIds(ids=IDS))]
        got = pb_grpc.ShuttleStub(channel).Embed(pb.EmbedRequest(inputs=inputs), timeout=300)
    # the same numbers up to float rounding: the two calls' batches may be composed otherwise
    # (a different row count in a matmul sums in another order)
    assert len(got.embeddings) == len(http.data)
    for e, d in zip(got.embeddings, http.data, strict=True):
        assert list(e.values) == pytest.approx(d.embedding, abs=1e-5)
    assert got.usage.prompt_tokens == http.usage.prompt_tokens
