"""A batch of prompts (`/v1/completions` with `prompt` a list) as one stream of deltas.

Each prompt is its own engine request (`<id>-<k>`, with `n` sequences); their delta streams
are merged into one, renumbered prompt-major as vLLM numbers choices:

    prompt 0: seq 0..n-1  ->  choices 0..n-1
    prompt 1: seq 0..n-1  ->  choices n..2n-1          choice index = k * n + i

The merged stream's `last` delta is the last of the last request to finish. A failure of any
request fails the whole batch, and closing the merged stream (client gone, a failure, the
end) closes every request's stream, which aborts in the engine those not finished.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator

from services.gateway.engine.client import OutputDelta, RequestFailed


async def merge_deltas(
    streams: list[AsyncGenerator[OutputDelta, None]], n: int
) -> AsyncGenerator[OutputDelta, None]:
    """The deltas of `streams` (one per prompt, `n` sequences each) as one request's, in
    the order they come; choice index k * n + i for sequence i of prompt k."""
    pending: dict[asyncio.Task[OutputDelta | None], int] = {}

    def read(k: int) -> None:
        pending[asyncio.create_task(_next_or_none(streams[k]))] = k

    for k in range(len(streams)):
        read(k)
    num_running = len(streams)
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):  # ties in prompt order
                k = pending.pop(task)
                try:
                    delta = task.result()
                except RequestFailed as e:  # in a batch, say which prompt
                    raise e.naming_prompt(f"prompt[{k}]") from None
                if delta is None:
                    raise RequestFailed(500, "the engine ended a stream without a finish reason")
                if delta.last:
                    num_running -= 1
                else:
                    read(k)
                yield dataclasses.replace(delta, index=k * n + delta.index, last=num_running == 0)
    finally:
        for task in pending:
            task.cancel()  # a read in flight: its request's stream ends (and aborts) with it
        if pending:
            await asyncio.wait(pending)
            for task in pending:
                if not task.cancelled():
                    task.exception()  # retrieved: a sibling's failure is already reported
        for stream in streams:
            await stream.aclose()


async def _next_or_none(stream: AsyncGenerator[OutputDelta, None]) -> OutputDelta | None:
    return await anext(stream, None)
