"""The /v1/embeddings body (services/gateway/openai/embeddings.py): its inputs, the engine
requests it makes, the vector's shaping and encoding; and, as for the other routes, every
field of OpenAI's schema (from the installed `openai` package) and of vLLM's extensions is
honoured, refused with a 400 naming it, or on the short ignore list."""

from __future__ import annotations

import base64
import dataclasses
import struct
from typing import Any

import orjson
import pytest

from common.limits import MAX_EMBEDDING_INPUTS
from services.gateway.openai.embeddings import (
    EmbeddingRequest,
    encode_vector,
    shape_vector,
)
from services.gateway.openai.refused import IGNORED_FIELDS, REFUSED_EMBEDDING
from services.gateway.openai.request_errors import RequestRejected, parse_request
from tests.fake_engine import MODEL, FakeEngine
from tests.unit.services.gateway.http.test_app import error_of, run

openai = pytest.importorskip("openai")
from openai.types import embedding_create_params  # noqa: E402

URL = "/v1/embeddings"
VLLM_EXTRAS = {"truncate_prompt_tokens", "add_special_tokens", "normalize"}
# a value of each honoured field that changes what reaches the engine, or the answer
CHANGES_THE_REQUEST: dict[str, Any] = {
    "input": [1, 2, 3],
    "dimensions": 2,
    "truncate_prompt_tokens": 2,
    "add_special_tokens": False,
}
SHAPES_THE_ANSWER: dict[str, Any] = {"encoding_format": "base64", "normalize": False}
FIELDS = sorted(set(embedding_create_params.EmbeddingCreateParams.__annotations__) | VLLM_EXTRAS)


def _parse(**body: Any) -> EmbeddingRequest:
    return parse_request(EmbeddingRequest, orjson.dumps({"model": MODEL} | body))


def test_every_input_form_is_one_engine_request_per_input() -> None:
    (one,) = _parse(input="hello").to_generate_requests("embd-1", MODEL, "last", 64)
    assert one.request_id == "embd-1" and one.prompt == "hello"
    assert one.sampling.pooling == "last" and one.sampling.is_greedy
    assert one.add_special_tokens is True  # vLLM's default for embeddings
    (ids,) = _parse(input=[5, 6]).to_generate_requests("r", MODEL, "mean", 64)
    assert ids.prompt_token_ids == [5, 6] and ids.prompt is None
    batch = _parse(input=["a", "b"], dimensions=4).to_generate_requests("r", MODEL, "mean", 64)
    assert [r.request_id for r in batch] == ["r-0", "r-1"] and batch[1].dimensions == 4
    lists = _parse(input=[[1], [2, 3]], add_special_tokens=False, truncate_prompt_tokens=3)
    got = lists.to_generate_requests("r", MODEL, "mean", 64)
    assert [r.prompt_token_ids for r in got] == [[1], [2, 3]]
    assert got[0].add_special_tokens is False and got[0].truncate_prompt_tokens == 3


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": []}, "input: must not be empty"),
        ({"input": ""}, "input: must not be empty"),
        ({"input": ["a", ""]}, "input: input 1 must not be empty"),
        ({"input": [[1], [-1]]}, "input: input 1 token ids must be integers"),
        ({"input": 3}, "input: must be a string, a list of token ids"),
        ({"input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input: at most 2048 inputs"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "embed_dtype": "float16"}, "embed_dtype"),
    ],
)
def test_bad_bodies_are_refused_naming_the_field(body: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestRejected) as e:
        _parse(**body)
    assert e.value.message.startswith(message), e.value.message


def test_truncate_prompt_tokens_past_the_model_length_is_refused() -> None:
    with pytest.raises(RequestRejected, match="truncate_prompt_tokens: must be <= "):
        _parse(input="a", truncate_prompt_tokens=65).to_generate_requests("r", MODEL, "last", 64)


def test_shape_cuts_then_normalises() -> None:
    assert shape_vector([3.0, 4.0, 12.0], None, True) == pytest.approx([3 / 13, 4 / 13, 12 / 13])
    assert shape_vector([3.0, 4.0, 12.0], 2, True) == pytest.approx([0.6, 0.8])
    assert shape_vector([3.0, 4.0, 12.0], 2, False) == [3.0, 4.0]
    assert shape_vector([0.0, 0.0], None, True) == [0.0, 0.0]  # (no division by zero)


def test_base64_is_little_endian_float32() -> None:
    vector = [0.5, -1.25, 3.0]
    assert encode_vector(vector, "float") == vector
    encoded = encode_vector(vector, "base64")
    assert isinstance(encoded, str)
    assert list(struct.unpack("<3f", base64.b64decode(encoded))) == vector


def _sent(engine: FakeEngine) -> Any:
    return dataclasses.replace(engine.requests[-1], request_id="", arrival_time=0.0)


@pytest.mark.parametrize("field", FIELDS)
def test_every_embeddings_field_is_honoured_refused_or_ignored(field: str) -> None:
    engine = FakeEngine()
    base = {"model": MODEL, "input": "hello there"}
    baseline_answer = run(engine, "POST", URL, json=base)
    assert baseline_answer.status_code == 200, baseline_answer.text
    baseline = _sent(engine)
    if field in ("model",):  # required by OpenAI; a wrong one is a 404 (check_model)
        assert error_of(run(engine, "POST", URL, json=base | {"model": "x"}), 404)
        return
    if field in IGNORED_FIELDS:
        assert run(engine, "POST", URL, json=base | {field: "some-value"}).status_code == 200
        assert _sent(engine) == baseline, f"{field} is on the ignore list yet changed the request"
        return
    if field in REFUSED_EMBEDDING:
        error = error_of(run(engine, "POST", URL, json=base | {field: {"asks": 1}}), 400)
        assert error["param"] == field
        return
    if field in CHANGES_THE_REQUEST:
        got = run(engine, "POST", URL, json=base | {field: CHANGES_THE_REQUEST[field]})
        assert got.status_code == 200, got.text
        assert _sent(engine) != baseline, f"{field} was accepted but changed nothing"
        return
    assert field in SHAPES_THE_ANSWER, f"{field} is neither honoured, refused nor ignored"
    got = run(engine, "POST", URL, json=base | {field: SHAPES_THE_ANSWER[field]})
    assert got.status_code == 200 and got.json()["data"] != baseline_answer.json()["data"]
