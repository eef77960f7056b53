"""Resumes on the gateway (services/gateway/engine/stream.py and the engine client that drives
it): a request lost to a process's death waits, paused, and is sent again under a new wire
id with the tokens it streamed once the scheduler says again what it serves; what an earlier
attempt leaves behind is ignored; past the resume timeout, or when it cannot be resumed, it
fails with a retryable 503. Fake outboxes, no sockets."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from common.messages import (
    Abort,
    FinishReason,
    GenerateRequest,
    OutputBatch,
    RequestError,
    SamplingParams,
)
from services.gateway.engine.client import OutputDelta, RequestFailed
from services.gateway.engine.stream import Stream, resume_id
from services.gateway.engine.zmq_client import ZmqEngineClient
from tests.unit.services.gateway.engine.test_zmq_client import FakeOutbox, model_changed

NONE, LENGTH, CANCELLED = FinishReason.NONE, FinishReason.LENGTH, FinishReason.CANCELLED


def make_client(resume_timeout: float = 30.0) -> tuple[ZmqEngineClient, FakeOutbox, FakeOutbox]:
    tokenizers, scheduler = FakeOutbox(), FakeOutbox()
    client = ZmqEngineClient(
        tokenizers,  # type: ignore[arg-type]
        scheduler,  # type: ignore[arg-type]
        "inproc://gateway",
        resume_timeout=resume_timeout,
    )
    client.on_model_changed(model_changed("v1"))
    return client, tokenizers, scheduler


def request(request_id: str = "r", **sampling: object) -> GenerateRequest:
    return GenerateRequest(
        request_id=request_id, model="m", sampling=SamplingParams(**sampling), prompt="hi"
    )


def out(wire_id: str, token_ids: list[int], num_output: int, finish: FinishReason = NONE):  # type: ignore[no-untyped-def]
    return OutputBatch(
        request_ids=[wire_id],
        texts=["".join(f"<{t}>" for t in token_ids)],
        token_ids=[token_ids],
        finish_reasons=[int(finish)],
        num_prompt_tokens=[3],
        num_output_tokens=[num_output],
    )


def lost(wire_id: str) -> RequestError:
    return RequestError(wire_id, 503, "the worker process restarted", resumable=True)


async def _start(
    client: ZmqEngineClient, req: GenerateRequest
) -> asyncio.Future[list[OutputDelta]]:
    async def read() -> list[OutputDelta]:
        return [d async for d in client.generate(req)]

    task = asyncio.ensure_future(read())
    await asyncio.sleep(0)
    return task


def test_a_lost_request_resumes_after_the_tokens_it_streamed() -> None:
    client, tokenizers, scheduler = make_client()

    async def go() -> list[OutputDelta]:
        task = await _start(client, request("r"))
        client.on_outputs(out("r", [7, 8], 2))
        client.on_error(lost("r"))
        client.on_outputs(out("r", [9], 3))  # late, from before the death: still this attempt's
        client.on_model_lost()
        assert not task.done() and not client.is_ready()
        client.on_model_changed(model_changed("v1"))  # serving again: sent again
        client.on_outputs(out("r", [10], 4))  # the old attempt's id: moot now
        client.on_outputs(out(resume_id("r", 1), [10, 11], 5, LENGTH))
        return await asyncio.wait_for(task, 5)

    deltas = asyncio.run(go())
    assert [d.token_ids for d in deltas] == [[7, 8], [9], [10, 11]]
    assert [d.num_output_tokens for d in deltas] == [2, 3, 5]
    first, again = tokenizers.sent
    assert first.request_id == "r" and first.resumed_token_ids == []
    assert again == dataclasses.replace(first, request_id="r/resume-1", resumed_token_ids=[7, 8, 9])
    assert scheduler.sent == [Abort(request_ids=["r"], reason=int(CANCELLED))]
    assert client.num_in_flight == 0


def test_the_prompt_logprobs_are_not_asked_twice() -> None:
    stream = Stream(request("r", prompt_logprobs=2))
    assert stream.next_attempt().sampling.prompt_logprobs == 2  # no output yet: as it was
    stream.has_output = True
    assert stream.next_attempt().sampling.prompt_logprobs is None


@pytest.mark.parametrize(
    ("sampling", "resumable"),
    [({}, True), ({"n": 2}, False), ({"structured_kind": "json"}, False)],
)
def test_only_one_plain_sequence_resumes_after_output(
    sampling: dict[str, object], resumable: bool
) -> None:
    stream = Stream(request("r", **sampling))
    assert stream.is_resumable  # with no output yet, anything may be sent again
    stream.has_output = True
    assert stream.is_resumable == resumable


def test_one_that_cannot_resume_fails_with_a_retryable_503() -> None:
    client, tokenizers, _ = make_client()

    async def go() -> None:
        task = await _start(client, request("r", n=2))
        client.on_outputs(out("r", [7], 1))
        client.on_error(lost("r"))
        await asyncio.wait_for(task, 5)

    with pytest.raises(RequestFailed) as failed:
        asyncio.run(go())
    assert (failed.value.status, failed.value.message) == (503, "the worker process restarted")
    assert len(tokenizers.sent) == 1


def test_past_the_resume_timeout_it_fails_with_a_retryable_503() -> None:
    client, tokenizers, _ = make_client(resume_timeout=0.01)

    async def go() -> None:
        task = await _start(client, request("r"))
        client.on_outputs(out("r", [7], 1))
        assert client.resumes.lose_all("the scheduler process restarted") == 1
        await asyncio.wait_for(task, 5)  # no ModelChanged comes

    with pytest.raises(RequestFailed) as failed:
        asyncio.run(go())
    assert failed.value.status == 503 and "did not come back within" in failed.value.message
    assert len(tokenizers.sent) == 1


def test_resumes_off_fail_as_the_error_says() -> None:
    client, _, _ = make_client(resume_timeout=0)

    async def go() -> None:
        task = await _start(client, request("r"))
        client.on_error(lost("r"))
        await asyncio.wait_for(task, 5)

    with pytest.raises(RequestFailed, match="the worker process restarted"):
        asyncio.run(go())


def test_a_dead_tokenizer_s_requests_with_no_output_are_sent_again_at_once() -> None:
    client, tokenizers, scheduler = make_client()

    async def go() -> list[OutputDelta]:
        waiting = await _start(client, request("w"))
        streaming = await _start(client, request("s"))
        client.on_outputs(out("s", [5], 1))
        assert client.resumes.resend_waiting("the tokenizer-0 process restarted") == 1
        client.on_outputs(out("s", [6], 2, LENGTH))
        client.on_outputs(out(resume_id("w", 1), [1], 1, LENGTH))
        return [*await waiting, *await streaming]

    deltas = asyncio.run(go())
    assert [d.token_ids for d in deltas] == [[1], [5], [6]]
    assert [m.request_id for m in tokenizers.sent] == ["w", "s", "w/resume-1"]
    assert scheduler.sent == [Abort(request_ids=["w"], reason=int(CANCELLED))]


def test_cancelling_a_paused_request_ends_it_there() -> None:
    client, tokenizers, scheduler = make_client()

    async def go() -> list[OutputDelta]:
        task = await _start(client, request("r"))
        client.on_outputs(out("r", [7], 1))
        client.on_error(lost("r"))
        await client.abort("r")
        client.on_model_changed(model_changed("v1"))  # nothing left to resume
        return await asyncio.wait_for(task, 5)

    deltas = asyncio.run(go())
    assert [(d.finish_reason, d.last, d.num_output_tokens) for d in deltas] == [
        (NONE, False, 1),
        (CANCELLED, True, 1),
    ]
    assert len(tokenizers.sent) == 1 and scheduler.sent == []


def test_a_dead_detokenizer_s_requests_are_all_sent_again_at_once() -> None:
    """Its last outputs may be lost, also of a request the scheduler finished (no error
    comes for it): every request goes again from the tokens the gateway has; the scheduler's
    resumable errors for the earlier attempts are moot."""
    client, tokenizers, _ = make_client()

    async def go() -> list[OutputDelta]:
        task = await _start(client, request("r"))
        client.on_outputs(out("r", [7], 1))
        assert client.resumes.resend_all("the detokenizer process restarted") == 1
        client.on_error(lost("r"))  # the earlier attempt's: moot
        client.on_model_changed(model_changed("v1"))  # nothing is lost: nothing more is sent
        client.on_outputs(out(resume_id("r", 1), [8], 2, LENGTH))
        return await asyncio.wait_for(task, 5)

    deltas = asyncio.run(go())
    assert [d.token_ids for d in deltas] == [[7], [8]]
    assert [m.resumed_token_ids for m in tokenizers.sent] == [[], [7]]


def test_a_resumed_attempt_a_dead_tokenizer_held_is_sent_again() -> None:
    client, tokenizers, _ = make_client()

    async def go() -> list[OutputDelta]:
        task = await _start(client, request("r"))
        client.on_outputs(out("r", [7], 1))
        client.on_error(lost("r"))
        client.on_model_changed(model_changed("v1"))  # attempt 1 goes to a tokenizer...
        assert (
            client.resumes.resend_waiting("the tokenizer-1 process restarted") == 1
        )  # ...that died
        client.on_outputs(out(resume_id("r", 2), [8], 2, LENGTH))
        return await asyncio.wait_for(task, 5)

    deltas = asyncio.run(go())
    assert [d.token_ids for d in deltas] == [[7], [8]]
    assert [(m.request_id, m.resumed_token_ids) for m in tokenizers.sent] == [
        ("r", []),
        ("r/resume-1", [7]),
        ("r/resume-2", [7]),
    ]
