"""Reading one request's deltas from the engine for an HTTP exchange: a reader that can time
out or lose a race with a disconnect without cancelling the engine mid-read, and the whole
answer of a non-streamed request gathered from them (choices and usage)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.types import Receive

from common.messages import FinishReason
from services.gateway.engine.client import OutputDelta, RequestFailed, TokenLogprob
from services.gateway.http.access_log import AccessRecord
from services.gateway.openai.logprobs import ChoiceLogprobs

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its (non-streamed) answer was ready."""


class DeltaReader:
    """Reads one request's deltas, each in a task of its own, so that a wait can time out
    (keep-alive) or lose a race with a disconnect without cancelling the engine mid-read."""

    def __init__(
        self,
        deltas: AsyncGenerator[OutputDelta, None],
        prompt_field: str = "prompt",
        record: AccessRecord | None = None,
    ) -> None:
        self._deltas = deltas
        self._prompt_field = prompt_field  # what the endpoint calls the prompt, for refusals
        self._record = record  # the access log's (services/gateway/http/access_log.py)
        self._pending: asyncio.Task[OutputDelta | None] | None = None
        self.version = ""  # the model version named by the deltas read so far

    async def next(self, timeout: float | None = None) -> OutputDelta:
        """The next delta. Raises TimeoutError if none came within `timeout` (the read goes
        on, the next call picks it up) and RequestFailed if the engine failed the request."""
        if self._pending is None:
            self._pending = asyncio.create_task(_next_or_none(self._deltas))
        done, _ = await asyncio.wait({self._pending}, timeout=timeout)
        if not done:
            raise TimeoutError
        task, self._pending = self._pending, None
        try:
            delta = task.result()
        except RequestFailed as e:
            raise e.naming_prompt(self._prompt_field) from None
        if delta is None:
            raise RequestFailed(500, "the engine ended the stream without a finish reason")
        self.version = delta.version or self.version
        if self._record is not None:
            self._record.see(delta)
        return delta

    async def aclose(self) -> None:
        """Stop reading and close the engine's iterator, which aborts the request there."""
        task, self._pending = self._pending, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not log it as lost
        await self._deltas.aclose()


async def _next_or_none(deltas: AsyncIterator[OutputDelta]) -> OutputDelta | None:
    return await anext(deltas, None)


async def close_shielded(reader: DeltaReader) -> None:
    # this often runs while the request is being cancelled; the engine must still hear of it
    with anyio.CancelScope(shield=True):
        await reader.aclose()


@dataclasses.dataclass(slots=True)
class Choice:
    """One sequence's whole output, gathered from its deltas."""

    index: int
    parts: list[str] = dataclasses.field(default_factory=list)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: FinishReason = FinishReason.NONE
    stop_reason: str | int | None = None  # vLLM's: the stop string or token id that ended it
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # when asked

    @property
    def text(self) -> str:
        return "".join(self.parts)


class Usage:
    """A request's token counts: each prompt once (its `n` sequences share it), summed over
    a batch of prompts; outputs summed over every sequence."""

    def __init__(self, n: int = 1) -> None:
        self.n = n  # choices per prompt: choice index // n is the prompt's
        self._num_prompt_tokens: dict[int, int] = {}  # prompt index -> its count
        self._num_output_tokens: dict[int, int] = {}  # index -> that sequence's count so far
        self._num_cached_tokens: dict[int, int] = {}  # prompt index -> served by the cache

    def add_prompt(self, delta: OutputDelta) -> None:
        """Count the delta's prompt only (a stream's role chunks come before its tokens)."""
        self._num_prompt_tokens[delta.index // self.n] = delta.num_prompt_tokens
        self._num_cached_tokens[delta.index // self.n] = delta.num_cached_tokens

    def add(self, delta: OutputDelta) -> None:
        self.add_prompt(delta)
        self._num_output_tokens[delta.index] = delta.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._num_prompt_tokens.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(self._num_output_tokens.values())

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (OpenAI's `cached_tokens`)."""
        return sum(self._num_cached_tokens.values())

    def as_dict(self) -> dict[str, Any]:
        return usage_dict(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_tokens)


def usage_dict(prompt: int, output: int, cached: int) -> dict[str, Any]:
    """OpenAI's chat and completions `usage`."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": output,
        "total_tokens": prompt + output,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


async def collect(
    reader: DeltaReader, n: int = 1, lp: ChoiceLogprobs | None = None
) -> tuple[list[Choice], Usage]:
    """Every sequence's text, token ids, logprobs and finish reason (by index), and the
    usage (`n` choices per prompt); prompt logprobs go to `lp`."""
    choices: dict[int, Choice] = {}
    usage = Usage(n)
    while True:
        delta = await reader.next()
        usage.add(delta)
        choice = choices.setdefault(delta.index, Choice(delta.index))
        choice.parts.append(delta.text)
        choice.token_ids.extend(delta.token_ids)
        choice.logprobs.extend(delta.logprobs)
        if lp is not None:
            lp.see_prompt(delta.index, delta.prompt_logprobs)
        if delta.finish_reason != FinishReason.NONE:
            choice.finish_reason = delta.finish_reason
            choice.stop_reason = delta.stop_reason
        if delta.last:
            return sorted(choices.values(), key=lambda c: c.index), usage


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone."""
    task = asyncio.ensure_future(work)
    gone = asyncio.create_task(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()  # no-ops on finished tasks
        gone.cancel()
        await asyncio.wait({task, gone})
    if task.cancelled():
        raise ClientGone
    return task.result()


async def _wait_disconnect(receive: Receive) -> None:
    # the body has been read, so the next ASGI message is the disconnect (when it comes)
    while (await receive())["type"] != "http.disconnect":
        pass
