"""ZmqEngineClient's routing of detokenizer outputs into per-request streams, with fake
outboxes (no sockets): OutputBatch messages are fed straight to `on_outputs`."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from common.messages import (
    Abort,
    FinishReason,
    GenerateRequest,
    OutputBatch,
    RequestError,
    SamplingParams,
)
from services.gateway.engine_client import OutputDelta, RequestFailed
from services.gateway.zmq_client import ZmqEngineClient, split_sequence_id

NONE, STOP, LENGTH = FinishReason.NONE, FinishReason.STOP, FinishReason.LENGTH


class FakeOutbox:
    """Records what would have been sent."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def make_client() -> tuple[ZmqEngineClient, FakeOutbox, FakeOutbox]:
    tokenizers, scheduler = FakeOutbox(), FakeOutbox()
    client = ZmqEngineClient(tokenizers, scheduler, "inproc://gateway")  # type: ignore[arg-type]
    return client, tokenizers, scheduler


def request(request_id: str, n: int = 1) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, model="m", sampling=SamplingParams(n=n), prompt="hi"
    )


def batch(*entries: tuple[str, str, FinishReason, int]) -> OutputBatch:
    """Entries of (sequence id, text, finish reason, output tokens so far)."""
    return OutputBatch(
        request_ids=[e[0] for e in entries],
        texts=[e[1] for e in entries],
        token_ids=[[e[3]] for e in entries],
        finish_reasons=[int(e[2]) for e in entries],
        num_prompt_tokens=[4] * len(entries),
        num_output_tokens=[e[3] for e in entries],
    )


async def consume(
    client: ZmqEngineClient, req: GenerateRequest, *batches: OutputBatch
) -> list[OutputDelta]:
    """Read the request's deltas while `batches` arrive one by one."""
    task = asyncio.ensure_future(_read_all(client, req))
    await asyncio.sleep(0)  # the generator registers the request and sends it
    for msg in batches:
        client.on_outputs(msg)
        await asyncio.sleep(0)
    return await asyncio.wait_for(task, 5)


async def _read_all(client: ZmqEngineClient, req: GenerateRequest) -> list[OutputDelta]:
    return [d async for d in client.generate(req)]


def summary(deltas: list[OutputDelta]) -> list[tuple[int, str, FinishReason, bool]]:
    return [(d.index, d.text, d.finish_reason, d.last) for d in deltas]


def test_split_sequence_id() -> None:
    assert split_sequence_id("req-1") == ("req-1", 0)
    assert split_sequence_id("req-1#0") == ("req-1", 0)
    assert split_sequence_id("a:b.c#12") == ("a:b.c", 12)


def test_n1_ends_on_the_finish_and_sends_no_abort() -> None:
    client, tokenizers, scheduler = make_client()
    deltas = asyncio.run(
        consume(
            client,
            request("r"),
            batch(("r", "a", NONE, 1)),
            batch(("other", "z", NONE, 1), ("r", "b", STOP, 2)),
            batch(("r", "late", NONE, 3)),
        )
    )
    assert summary(deltas) == [(0, "a", NONE, False), (0, "b", STOP, True)]
    assert [d.num_output_tokens for d in deltas] == [1, 2]
    assert [m.request_id for m in tokenizers.sent] == ["r"]
    assert scheduler.sent == [] and client.num_in_flight == 0


def test_n3_sequences_route_to_one_stream_by_index() -> None:
    client, _, scheduler = make_client()
    deltas = asyncio.run(
        consume(
            client,
            request("r", n=3),
            batch(("r#0", "a", NONE, 1), ("r#2", "x", NONE, 1), ("r#1", "m", STOP, 1)),
            batch(("r#2", "y", LENGTH, 2), ("q#0", "not ours", NONE, 1)),
            batch(("r#0", "b", STOP, 2)),
            batch(("r#1", "late", NONE, 2)),
        )
    )
    assert summary(deltas) == [
        (0, "a", NONE, False),
        (2, "x", NONE, False),
        (1, "m", STOP, False),
        (2, "y", LENGTH, False),
        (0, "b", STOP, True),
    ]
    assert scheduler.sent == [] and client.num_in_flight == 0


def test_the_last_finish_in_one_batch_ends_the_stream() -> None:
    client, _, scheduler = make_client()
    deltas = asyncio.run(
        consume(client, request("r", n=2), batch(("r#1", "b", STOP, 1), ("r#0", "a", LENGTH, 1)))
    )
    assert summary(deltas) == [(1, "b", STOP, False), (0, "a", LENGTH, True)]
    assert scheduler.sent == []


@pytest.mark.parametrize("n", [1, 3])
def test_early_close_sends_one_abort_for_the_request_id(n: int) -> None:
    client, _, scheduler = make_client()

    async def go() -> OutputDelta:
        stream = client.generate(request("r", n=n))
        first = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        client.on_outputs(batch((f"r#{n - 1}" if n > 1 else "r", "a", STOP, 1)))
        delta = await asyncio.wait_for(first, 5)
        await stream.aclose()  # the client went away
        return delta

    delta = asyncio.run(go())
    assert (delta.index, delta.last) == (n - 1, n == 1)
    expected = [] if n == 1 else [Abort(request_ids=["r"], reason=int(FinishReason.CANCELLED))]
    assert scheduler.sent == expected
    assert client.num_in_flight == 0


@pytest.mark.parametrize("error_id", ["r", "r#1"])
def test_an_error_fails_the_whole_request(error_id: str) -> None:
    client, _, scheduler = make_client()

    async def go() -> None:
        task = asyncio.ensure_future(_read_all(client, request("r", n=2)))
        await asyncio.sleep(0)
        client.on_outputs(batch(("r#0", "a", NONE, 1)))
        client.on_error(RequestError(request_id=error_id, status=503, message="worker died"))
        await asyncio.wait_for(task, 5)

    with pytest.raises(RequestFailed, match="worker died"):
        asyncio.run(go())
    assert scheduler.sent == [] and client.num_in_flight == 0
