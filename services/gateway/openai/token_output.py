"""Two vLLM output options the gateway applies to the engine's deltas:

- `detokenize: false` (vLLM's SamplingParams field): the answer carries the output token
  ids and no text. The engine still detokenises (its detokenizer finds stop strings and
  finish reasons); the gateway drops the text, so what the client reads is vLLM's answer:
  empty text, `token_ids` per choice. Stop strings need text, so they are refused beside
  it, as vLLM refuses them; a stream, whose chunks carry text only here, is refused too.
- `return_tokens_as_token_ids`: each output logprob's token (and its top alternatives')
  is written `token_id:<id>`, so tokens that are not valid UTF-8 alone stay identifiable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

from services.gateway.engine.client import OutputDelta
from services.gateway.openai.logprobs import TokenLogprob


def shaped(
    deltas: AsyncGenerator[OutputDelta, None], drop_text: bool, tokens_as_ids: bool
) -> AsyncGenerator[OutputDelta, None]:
    """`deltas` as the options ask (`deltas` itself when they ask for nothing)."""
    if not (drop_text or tokens_as_ids):
        return deltas
    return _shaped(deltas, drop_text, tokens_as_ids)


async def _shaped(
    deltas: AsyncGenerator[OutputDelta, None], drop_text: bool, tokens_as_ids: bool
) -> AsyncGenerator[OutputDelta, None]:
    # closing this closes `deltas` (which aborts the request in the engine)
    try:
        async for delta in deltas:
            if drop_text:
                delta = dataclasses.replace(delta, text="")
            if tokens_as_ids and delta.logprobs:
                delta = dataclasses.replace(delta, logprobs=[_as_ids(e) for e in delta.logprobs])
            yield delta
    finally:
        await deltas.aclose()


def token_id_text(token_id: int) -> str:
    return f"token_id:{token_id}"


def _as_ids(entry: TokenLogprob) -> TokenLogprob:
    top = [(token_id, token_id_text(token_id), lp) for token_id, _, lp in entry.top]
    return dataclasses.replace(entry, token=token_id_text(entry.token_id), top=top)
