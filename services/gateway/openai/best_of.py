"""vLLM's (and OpenAI's legacy) `best_of` for /v1/completions: the engine samples `best_of`
sequences per prompt (as `n` does, sharing the prompt's KV blocks), asking for the sampled
tokens' logprobs; the answer keeps the `n` with the highest cumulative logprob, as vLLM's
`RequestOutput` ranks them, best first, numbered prompt-major again. Usage counts every
sequence sampled. A stream cannot rank what it has already sent, so `best_of` > `n` is
refused with `stream` (as OpenAI does)."""

from __future__ import annotations

import dataclasses
from typing import Protocol, TypeVar

from services.gateway.openai.logprobs import TokenLogprob


class _Ranked(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def logprobs(self) -> list[TokenLogprob]: ...


C = TypeVar("C", bound=_Ranked)


def cumulative_logprob(choice: _Ranked) -> float:
    return sum(e.logprob for e in choice.logprobs if e.logprob is not None)


def best_choices(choices: list[C], best_of: int, n: int) -> list[C]:
    """Of each prompt's `best_of` choices (choice index // best_of is the prompt), the `n`
    with the highest cumulative logprob, renumbered prompt-major (prompt p: p*n .. p*n+n-1)."""
    by_prompt: dict[int, list[C]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.index // best_of, []).append(choice)
    out: list[C] = []
    for prompt in sorted(by_prompt):
        ranked = sorted(by_prompt[prompt], key=cumulative_logprob, reverse=True)[:n]
        out += [
            dataclasses.replace(c, index=prompt * n + k)  # type: ignore[type-var]
            for k, c in enumerate(ranked)
        ]
    return out
