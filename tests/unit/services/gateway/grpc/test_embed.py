"""gRPC Embed (services/gateway/grpc/embed.py) against the scripted fake engine, on a loopback
port in this process: the same engine requests and vectors as POST /v1/embeddings, the same
refusals with the proto's field names, and a cancelled call aborting every input."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import grpc
import pytest

from common.messages import GenerateRequest
from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from services.gateway.engine.client import RequestFailed
from tests.fake_engine import HANG, MODEL, FakeEngine
from tests.unit.services.gateway.grpc.test_server import run
from tests.unit.services.gateway.http.test_app import run as run_http
from tests.waiting import wait_until_async

Code = grpc.StatusCode


def _inputs(*items: str | list[int]) -> list[pb.EmbedInput]:
    return [
        pb.EmbedInput(text=i) if isinstance(i, str) else pb.EmbedInput(token_ids=pb.TokenIds(ids=i))
        for i in items
    ]


async def _embed(channel: grpc.aio.Channel, **fields: Any) -> pb.EmbedResponse:
    return await pb_grpc.ShuttleStub(channel).Embed(pb.EmbedRequest(**fields))


def _same(request: GenerateRequest) -> GenerateRequest:
    return dataclasses.replace(request, arrival_time=0.0)


def test_embed_answers_what_http_answers() -> None:
    engine = FakeEngine()
    fields = {"request_id": "e1", "inputs": _inputs("a b", [5, 6, 7]), "dimensions": 2}
    got = run(engine, lambda channel: _embed(channel, **fields))
    assert got.request_id == "e1" and got.model == MODEL
    assert [list(e.values) for e in got.embeddings] == [
        pytest.approx([2 / 13**0.5, 3 / 13**0.5]),
        pytest.approx([3 / 18**0.5, 3 / 18**0.5]),
    ]
    assert (got.usage.prompt_tokens, got.usage.total_tokens) == (5, 5)
    over_grpc = [_same(r) for r in engine.requests]
    body = {"model": MODEL, "input": ["a b", [5, 6, 7]], "dimensions": 2}
    http = run_http(engine, "POST", "/v1/embeddings", json=body, headers={"X-Request-Id": "e1"})
    assert http.status_code == 200
    assert [_same(r) for r in engine.requests[2:]] == over_grpc


def test_embed_options_and_server_settings() -> None:
    engine = FakeEngine()
    fields = {"inputs": _inputs("a b"), "normalize": False, "add_special_tokens": False}
    got = run(engine, lambda channel: _embed(channel, **fields), pooling="mean")
    assert list(got.embeddings[0].values) == [2.0, 3.0, 4.0, 0.0]
    assert got.request_id.startswith("embd-")
    (sent,) = engine.requests
    assert sent.sampling.pooling == "mean" and sent.add_special_tokens is False
    raw = run(
        engine, lambda channel: _embed(channel, inputs=_inputs("a b")), embedding_normalize=False
    )
    assert list(raw.embeddings[0].values) == [2.0, 3.0, 4.0, 0.0]


@pytest.mark.parametrize(
    ("fields", "start"),
    [
        ({"inputs": []}, "inputs: must not be empty"),
        ({"inputs": [pb.EmbedInput()]}, "inputs: must be a string or a list of token ids"),
        ({"inputs": _inputs("a"), "dimensions": 0}, "dimensions: "),
        ({"inputs": _inputs("a"), "request_id": "bad id"}, "request_id: "),
        ({"inputs": _inputs("a"), "model": "other"}, "model: the model `other` does not exist"),
    ],
)
def test_refusals_name_the_proto_field(fields: dict[str, Any], start: str) -> None:
    engine = FakeEngine()

    async def test(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _embed(channel, **fields)
        return info.value

    error = run(engine, test)
    assert error.code() in (Code.INVALID_ARGUMENT, Code.NOT_FOUND)
    assert (error.details() or "").startswith(start), error.details()
    assert not engine.requests


def test_an_engine_refusal_names_inputs() -> None:
    engine = FakeEngine()
    engine.scripts["e-1"] = [RequestFailed(400, "prompt: the input has 9 tokens", "prompt")]

    async def test(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _embed(channel, request_id="e", inputs=_inputs("a", "b"))
        return info.value

    error = run(engine, test)
    assert error.code() == Code.INVALID_ARGUMENT
    assert error.details() == "inputs: the input has 9 tokens"


def test_a_cancelled_call_aborts_every_input() -> None:
    engine = FakeEngine()
    engine.scripts["c-0"] = engine.scripts["c-1"] = [HANG]

    async def test(channel: grpc.aio.Channel) -> None:
        call = pb_grpc.ShuttleStub(channel).Embed(
            pb.EmbedRequest(request_id="c", inputs=_inputs("a", "b"))
        )
        await wait_until_async(lambda: len(engine.requests) == 2, 30, "both inputs sent")
        call.cancel()
        await wait_until_async(lambda: sorted(engine.aborted) == ["c-0", "c-1"], 30, "aborts")
        with pytest.raises(asyncio.CancelledError):
            await call

    run(engine, test)
