"""POST /v1/embeddings (services/gateway/http/embeddings.py) against the scripted fake
engine, in process: vectors in input order, shaped and encoded as asked, usage summed, and an
input's refusal or failure as the answer's error."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import httpx
import pytest

from common.config import ServerConfig
from common.messages import FinishReason
from services.gateway.engine.client import RequestFailed
from services.gateway.http.app import create_app
from tests.fake_engine import HANG, MODEL, FakeEngine, delta
from tests.unit.services.gateway.http.test_app import error_of, run

URL = "/v1/embeddings"


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": ["one", "two words", "three more words"]} | extra


def test_vectors_come_in_input_order_normalised_with_usage() -> None:
    # the fake engine's vector for an input of k words: [k, 3, 4, 0]
    got = run(FakeEngine(), "POST", URL, json=_body(), headers={"X-Request-Id": "abc"})
    assert got.status_code == 200 and got.headers["X-Request-Id"] == "abc"
    answer = got.json()
    assert answer["object"] == "list" and answer["model"] == MODEL and answer["id"] == "embd-abc"
    assert [d["index"] for d in answer["data"]] == [0, 1, 2]
    for k, item in enumerate(answer["data"], start=1):
        norm = (k * k + 25) ** 0.5
        assert item["object"] == "embedding"
        assert item["embedding"] == pytest.approx([k / norm, 3 / norm, 4 / norm, 0.0])
    assert answer["usage"] == {"prompt_tokens": 6, "total_tokens": 6}


def test_normalize_dimensions_and_base64() -> None:
    engine = FakeEngine()
    raw = run(engine, "POST", URL, json=_body(input="a b", normalize=False)).json()
    assert raw["data"][0]["embedding"] == [2.0, 3.0, 4.0, 0.0]
    cut = run(engine, "POST", URL, json=_body(input=[7, 8, 9], dimensions=2)).json()
    assert cut["data"][0]["embedding"] == pytest.approx([3 / 18**0.5, 3 / 18**0.5])
    assert engine.requests[-1].dimensions == 2  # (the tokenizer checks it against the model)
    packed = run(
        engine, "POST", URL, json=_body(input="a b", normalize=False, encoding_format="base64")
    )
    data = base64.b64decode(packed.json()["data"][0]["embedding"])
    assert struct.unpack("<4f", data) == (2.0, 3.0, 4.0, 0.0)


def test_the_server_setting_says_whether_to_normalise() -> None:
    async def go() -> httpx.Response:
        server = ServerConfig(embedding_normalize=False, pooling="mean")
        transport = httpx.ASGITransport(app=create_app(engine, server))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(URL, json=_body(input="a b"))

    engine = FakeEngine()
    assert asyncio.run(go()).json()["data"][0]["embedding"] == [2.0, 3.0, 4.0, 0.0]
    assert engine.requests[-1].sampling.pooling == "mean"


def test_an_input_refused_by_the_engine_is_the_answer_naming_input() -> None:
    engine = FakeEngine()
    refusal = RequestFailed(400, "prompt: the input has 9 tokens, more than ...", "prompt")
    engine.scripts["r-1"] = [refusal]
    error = error_of(run(engine, "POST", URL, json=_body(), headers={"X-Request-Id": "r"}), 400)
    assert error["param"] == "input" and error["message"].startswith("input: the input has 9")
    assert not engine.is_in_flight("r-0") and not engine.is_in_flight("r-2")


def test_a_request_ended_without_its_vector_is_a_500() -> None:
    engine = FakeEngine()
    engine.scripts["r"] = [delta("x", FinishReason.CANCELLED)]
    body = _body(input="a")
    error = error_of(run(engine, "POST", URL, json=body, headers={"X-Request-Id": "r"}), 500)
    assert "cancelled" in error["message"]


def test_unknown_fields_wrong_model_and_api_key() -> None:
    engine = FakeEngine()
    error = error_of(run(engine, "POST", URL, json=_body(dimension=3)), 400)
    assert error["param"] == "dimension" and "did you mean `dimensions`" in error["message"]
    assert error_of(run(engine, "POST", URL, json=_body(model="other")), 404)["param"] == "model"
    assert error_of(run(engine, "POST", URL, api_key="k", json=_body()), 401)
    assert not engine.requests


def test_a_hanging_input_is_aborted_with_the_others_when_one_fails() -> None:
    engine = FakeEngine()
    engine.scripts["r-0"] = [HANG]
    engine.scripts["r-1"] = [RequestFailed(400, "prompt: too long", "prompt")]
    error_of(
        run(engine, "POST", URL, json=_body(input=["a", "b"]), headers={"X-Request-Id": "r"}), 400
    )
    assert engine.aborted == ["r-0"]
