"""ZmqEngineClient's routing of detokenizer outputs into per-request streams, its adoption of
the model the scheduler pushes, and its resending of requests a swap made stale, with fake
outboxes (no sockets): messages are fed straight to its `on_*` methods."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from common.messages import (
    Abort,
    DetokenizeQuery,
    FinishReason,
    GenerateRequest,
    ModelChanged,
    OutputBatch,
    RequestError,
    Retokenize,
    SamplingParams,
    SwapResult,
    TokenizeQuery,
    TokenizeResult,
)
from services.gateway.engine.client import OutputDelta, RequestFailed, TokenLogprob
from services.gateway.engine.zmq_client import MAX_RETOKENIZE, ZmqEngineClient

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


def batch(*entries: tuple[str, int, str, FinishReason, int]) -> OutputBatch:
    """Entries of (request id, sequence index, text, finish reason, output tokens so far)."""
    return OutputBatch(
        request_ids=[e[0] for e in entries],
        seq_indices=[e[1] for e in entries],
        texts=[e[2] for e in entries],
        token_ids=[[e[4]] for e in entries],
        finish_reasons=[int(e[3]) for e in entries],
        num_prompt_tokens=[4] * len(entries),
        num_output_tokens=[e[4] for e in entries],
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


def test_n1_ends_on_the_finish_and_sends_no_abort() -> None:
    client, tokenizers, scheduler = make_client()
    deltas = asyncio.run(
        consume(
            client,
            request("r"),
            batch(("r", 0, "a", NONE, 1)),
            batch(("other", 0, "z", NONE, 1), ("r", 0, "b", STOP, 2)),
            batch(("r", 0, "late", NONE, 3)),
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
            batch(("r", 0, "a", NONE, 1), ("r", 2, "x", NONE, 1), ("r", 1, "m", STOP, 1)),
            batch(("r", 2, "y", LENGTH, 2), ("q", 0, "not ours", NONE, 1)),
            batch(("r", 0, "b", STOP, 2)),
            batch(("r", 1, "late", NONE, 2)),
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
        consume(client, request("r", n=2), batch(("r", 1, "b", STOP, 1), ("r", 0, "a", LENGTH, 1)))
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
        client.on_outputs(batch(("r", n - 1, "a", STOP, 1)))
        delta = await asyncio.wait_for(first, 5)
        await stream.aclose()  # the client went away
        return delta

    delta = asyncio.run(go())
    assert (delta.index, delta.last) == (n - 1, n == 1)
    expected = [] if n == 1 else [Abort(request_ids=["r"], reason=int(FinishReason.CANCELLED))]
    assert scheduler.sent == expected
    assert client.num_in_flight == 0


def test_an_error_fails_the_whole_request() -> None:
    client, _, scheduler = make_client()

    async def go() -> None:
        task = asyncio.ensure_future(_read_all(client, request("r", n=2)))
        await asyncio.sleep(0)
        client.on_outputs(batch(("r", 0, "a", NONE, 1)))
        client.on_error(RequestError(request_id="r", status=503, message="worker died"))
        await asyncio.wait_for(task, 5)

    with pytest.raises(RequestFailed, match="worker died"):
        asyncio.run(go())
    assert scheduler.sent == [] and client.num_in_flight == 0


def test_an_output_batch_without_indices_is_sequence_0() -> None:
    client, _, _ = make_client()
    plain = OutputBatch(["r"], ["a"], [[1]], [int(STOP)], [4], [1])  # no seq_indices
    deltas = asyncio.run(consume(client, request("r"), plain))
    assert summary(deltas) == [(0, "a", STOP, True)]


def model_changed(version: str, name: str = "m", max_model_len: int = 2048) -> ModelChanged:
    return ModelChanged(
        name=name,
        version=version,
        path=f"/models/{version}",
        tokenizer_fingerprint=f"fp-{version}",
        max_model_len=max_model_len,
        vocab_size=512,
        eos_token_ids=[2],
    )


def test_ready_once_the_scheduler_says_what_it_serves() -> None:
    client, _, scheduler = make_client()
    assert not client.is_ready() and client.model_name == ""
    client.on_model_changed(model_changed("v1", max_model_len=1024))
    assert client.is_ready()
    assert (client.model_name, client.system_fingerprint, client.max_model_len) == ("m", "v1", 1024)
    client.on_model_changed(model_changed("v2", name="tiny", max_model_len=512))
    assert (client.model_name, client.system_fingerprint, client.max_model_len) == (
        "tiny",
        "v2",
        512,
    )
    client.on_model_lost()  # the worker died: not ready until the scheduler says again
    assert not client.is_ready() and client.model_name == "tiny"
    client.on_model_changed(model_changed("v2", name="tiny"))
    assert client.is_ready()
    assert scheduler.sent == []  # learnt by being told, never by asking


def test_aliases_follow_the_served_name() -> None:
    tokenizers, scheduler = FakeOutbox(), FakeOutbox()
    client = ZmqEngineClient(
        tokenizers,  # type: ignore[arg-type]
        scheduler,  # type: ignore[arg-type]
        "inproc://gateway",
        aliases=["m", "alias"],  # --served-model-name m,alias: the worker reports "m"
    )
    assert client.model_names == []  # nothing served yet
    client.on_model_changed(model_changed("v1"))
    assert client.model_names == ["m", "alias"]


def test_a_swap_names_the_new_version_when_it_returns() -> None:
    """The scheduler sends ModelChanged before the SwapResult, on the same socket: when
    swap_model returns, the client already serves the new version."""
    client, _, scheduler = make_client()
    client.on_model_changed(model_changed("v1"))

    async def go() -> str:
        swap = asyncio.ensure_future(client.swap_model("/models/v2", "v2", "overlap"))
        await asyncio.sleep(0)
        assert client.swap_status is not None and client.swap_status["to"] == "v2"
        ticket = scheduler.sent[-1].ticket
        client.on_model_changed(model_changed("v2"))
        client.on_swap_result(
            SwapResult(ticket=ticket, ok=True, version="v2", previous_version="v1", mode="overlap")
        )
        result = await asyncio.wait_for(swap, 5)
        return result.version

    assert asyncio.run(go()) == "v2" == client.system_fingerprint
    assert client.swap_status is None


def test_retokenize_sends_the_original_request_again() -> None:
    client, tokenizers, scheduler = make_client()
    req = request("r", n=2)

    async def go() -> list[OutputDelta]:
        task = asyncio.ensure_future(_read_all(client, req))
        await asyncio.sleep(0)
        client.on_retokenize(Retokenize(request_id="r"))
        client.on_retokenize(Retokenize(request_id="unknown"))  # gone already: ignored
        client.on_outputs(batch(("r", 0, "a", STOP, 1), ("r", 1, "b", LENGTH, 1)))
        return await asyncio.wait_for(task, 5)

    deltas = asyncio.run(go())
    assert summary(deltas) == [(0, "a", STOP, False), (1, "b", LENGTH, True)]
    assert tokenizers.sent == [req, req]  # the very request, arrival time and all
    assert scheduler.sent == [] and client.num_in_flight == 0


def test_retokenize_gives_up_with_a_retryable_503() -> None:
    client, tokenizers, scheduler = make_client()

    async def go() -> None:
        task = asyncio.ensure_future(_read_all(client, request("r")))
        await asyncio.sleep(0)
        for _ in range(MAX_RETOKENIZE + 1):
            client.on_retokenize(Retokenize(request_id="r"))
        await asyncio.wait_for(task, 5)

    with pytest.raises(RequestFailed) as failed:
        asyncio.run(go())
    assert failed.value.status == 503 and "retry" in failed.value.message
    assert len(tokenizers.sent) == 1 + MAX_RETOKENIZE
    # the scheduler dropped the request before asking: nothing to abort
    assert scheduler.sent == [] and client.num_in_flight == 0


def test_tokenize_asks_a_tokenizer_and_waits_for_its_answer() -> None:
    async def go() -> None:
        client, tokenizers, _ = make_client()
        task = asyncio.ensure_future(client.tokenize("hi there", add_special_tokens=False))
        await asyncio.sleep(0)
        (query,) = tokenizers.sent
        assert isinstance(query, TokenizeQuery) and query.reply_to == "inproc://gateway"
        assert (query.prompt, query.messages, query.add_special_tokens) == ("hi there", None, False)
        client.on_tokenize_result(TokenizeResult(query_id=query.query_id + 1, token_ids=[0]))
        client.on_tokenize_result(TokenizeResult(query_id=query.query_id, token_ids=[4, 5]))
        assert await asyncio.wait_for(task, 5) == [4, 5]

        task = asyncio.ensure_future(client.detokenize([10**6]))
        await asyncio.sleep(0)
        query = tokenizers.sent[-1]
        assert isinstance(query, DetokenizeQuery) and query.token_ids == [10**6]
        refusal = TokenizeResult(
            query_id=query.query_id, status=400, message="tokens: no", param="tokens"
        )
        client.on_tokenize_result(refusal)
        with pytest.raises(RequestFailed) as info:
            await asyncio.wait_for(task, 5)
        assert (info.value.status, info.value.param) == (400, "tokens")

        with pytest.raises(TimeoutError):  # no tokenizer answers
            await client.detokenize([1], timeout=0.01)

    asyncio.run(go())


def test_logprob_lists_become_the_deltas_entries() -> None:
    client, _, _ = make_client()
    msg = dataclasses.replace(
        batch(("r", 0, "ab", STOP, 1), ("other", 0, "z", NONE, 1)),
        logprob_token_ids=[[[7, 7, 9]], [[]]],
        logprob_values=[[[-0.5, -0.5, -1.5]], [[]]],
        logprob_tokens=[[["ab", "ab", "x"]], [[]]],
        prompt_logprob_token_ids=[[[3], [4, 5]], []],
        prompt_logprob_values=[[[], [-2.0, -0.1]], []],
        prompt_logprob_tokens=[[["p"], ["q", "s"]], []],
    )
    (delta,) = asyncio.run(consume(client, request("r"), msg))
    assert delta.logprobs == [TokenLogprob(7, "ab", -0.5, [(7, "ab", -0.5), (9, "x", -1.5)])]
    assert delta.prompt_logprobs == [
        TokenLogprob(3, "p", None, []),
        TokenLogprob(4, "q", -2.0, [(5, "s", -0.1)]),
    ]
