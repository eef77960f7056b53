"""Embeddings over the engine, for every front end (HTTP /v1/embeddings, gRPC Embed): each
input's engine request in flight at once, their final deltas (each with its pooled vector)
gathered in input order.

Every engine request ends when this does, whatever happens: when one input is refused, or
the caller is cancelled (a client gone, a deadline), the others' reads are cancelled and
their iterators closed, which aborts them in the engine (shielded from the cancellation
that may be under way)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import anyio

from common.messages import FinishReason, GenerateRequest
from services.gateway.engine.client import EngineClient, OutputDelta, RequestFailed


async def embed(
    engine: EngineClient, requests: list[GenerateRequest], prompt_field: str = "input"
) -> list[OutputDelta]:
    """The final delta of each request, in order. Raises RequestFailed for the first input
    refused or failed (a refusal of the prompt names `prompt_field`, the front end's name)."""
    streams = [engine.generate(r) for r in requests]
    tasks = [asyncio.ensure_future(_final(s, prompt_field)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # (no-ops on finished ones)
        with anyio.CancelScope(shield=True):
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled():
                    task.exception()  # retrieved, so asyncio does not log it as lost
            for stream in streams:
                await stream.aclose()


async def _final(deltas: AsyncGenerator[OutputDelta, None], prompt_field: str) -> OutputDelta:
    """An embeddings request's last delta, which carries its vector."""
    try:
        async for delta in deltas:
            if not delta.last:
                continue
            if delta.finish_reason != FinishReason.STOP or not delta.embedding:
                reason = delta.finish_reason.openai or "no reason"
                raise RequestFailed(500, f"the request ended ({reason}) without its embedding")
            return delta
    except RequestFailed as e:
        raise e.naming_prompt(prompt_field) from None
    raise RequestFailed(500, "the engine ended the stream without a finish reason")
