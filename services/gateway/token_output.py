"""`detokenize: false` (vLLM's SamplingParams field): the answer carries the output token ids
and no text. The engine still detokenises (its detokenizer finds stop strings and finish
reasons); the gateway drops the text, so what the client reads is vLLM's answer: empty
text, `token_ids` per choice. Stop strings need text, so they are refused beside it, as
vLLM refuses them; a stream, whose chunks carry text only here, is refused too."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator

from services.gateway.engine_client import OutputDelta


async def without_text(
    deltas: AsyncGenerator[OutputDelta, None],
) -> AsyncGenerator[OutputDelta, None]:
    """`deltas` with their text dropped; closing this closes `deltas` (an abort there)."""
    try:
        async for delta in deltas:
            yield dataclasses.replace(delta, text="")
    finally:
        await deltas.aclose()
