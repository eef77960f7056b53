"""Beam search (`use_beam_search`, vLLM's request field), run by the gateway as vLLM V1 runs
it: each step asks the engine for one token of every live beam, as an ordinary request whose
prompt is the prompt and the beam's tokens so far, with the top 2 x `beam_width` logprobs of
the raw distribution; the beams pick their continuations from those. The beams' common
tokens are full KV blocks the prefix cache hands from one step's requests to the next
(`prefix_cache_hits` in /admin/stats): no step recomputes more than a beam's last partial
block. Nothing below the gateway learns a new protocol.

The choice of beams is transformers' `generate(num_beams=...)` (its early_stopping=False
default), so the beams returned equal its sequences on the same weights:

    candidates   the top 2 x beam_width of (beam score + token logprob) over all beams
    running      the best beam_width candidates that are neither EOS nor at max_tokens
    finished     among the best beam_width candidates, those that are EOS or at max_tokens,
                 scored sum / generated_len ** length_penalty; the best beam_width kept
    stop         at max_tokens, or once the best running beam cannot beat the worst
                 finished one (sum / current_len ** length_penalty; sticky)

Sampling controls other than max_tokens do not apply (as vLLM's beam search); the answer is
the `n` best finished beams (finish reason stop for EOS, else length).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Sequence

from common.messages import FinishReason, GenerateRequest, SamplingParams
from services.gateway.engine.client import EngineClient, OutputDelta, RequestFailed


@dataclasses.dataclass(frozen=True, slots=True)
class Beam:
    """One hypothesis: its output tokens and the sum of their logprobs."""

    token_ids: tuple[int, ...]
    sum_logprobs: float
    is_eos: bool = False


Candidates = Sequence[tuple[int, float]]  # (token id, logprob), best first


class BeamSearch:
    """The choice of beams (see the module's docstring), fed one step's candidates per
    running beam; pure, no engine."""

    def __init__(
        self, beam_width: int, max_tokens: int, eos_ids: Sequence[int], length_penalty: float
    ) -> None:
        self.beam_width = beam_width
        self.max_tokens = max_tokens
        self.eos_ids = set(eos_ids)
        self.length_penalty = length_penalty
        self.running = [Beam((), 0.0)]
        self.finished: list[tuple[float, Beam]] = []  # (score, beam), best first
        self.num_steps = 0
        self._improvable = True

    @property
    def num_candidates(self) -> int:
        """Candidates each running beam must offer per step."""
        return max(2, 1 + len(self.eos_ids)) * self.beam_width

    @property
    def is_done(self) -> bool:
        return self.num_steps >= self.max_tokens or not self._improvable or not self.running

    def step(self, candidates: Sequence[Candidates]) -> None:
        """Advance by one token, `candidates[b]` being running beam b's best tokens."""
        k = self.num_candidates
        ranked = sorted(
            (
                (beam.sum_logprobs + logprob, b, token)
                for b, beam in enumerate(self.running)
                for token, logprob in candidates[b][:k]
            ),
            key=lambda c: -c[0],
        )[:k]
        self.num_steps += 1
        at_end = self.num_steps >= self.max_tokens
        grown = [
            Beam((*self.running[b].token_ids, token), total, token in self.eos_ids)
            for total, b, token in ranked
        ]
        ends = [beam.is_eos or at_end for beam in grown]
        if self._improvable:
            scale = self.num_steps**self.length_penalty
            for beam, end in zip(grown[: self.beam_width], ends, strict=False):
                if end:
                    self.finished.append((beam.sum_logprobs / scale, beam))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[self.beam_width :]
        self.running = [b for b, end in zip(grown, ends, strict=True) if not end][: self.beam_width]
        if self._improvable and len(self.finished) == self.beam_width and self.running:
            best = self.running[0].sum_logprobs / self.num_steps**self.length_penalty
            self._improvable = best > self.finished[-1][0]

    def best(self, n: int) -> list[Beam]:
        """The n best finished beams (the running ones too when it stopped early)."""
        return [beam for _, beam in self.finished[:n]]


async def beam_answers(
    engine: EngineClient, request: GenerateRequest, beam_width: int, n: int, length_penalty: float
) -> tuple[int, list[tuple[Beam, str]]]:
    """Search for `request` (its prompt tokenised as the engine would); the prompt's
    length, and the n best beams with their text (EOS left out)."""
    prompt_ids = await _prompt_ids(engine, request)
    room = engine.max_model_len - len(prompt_ids)
    max_tokens = min(request.sampling.max_tokens or room, room)
    if max_tokens < 1:
        raise RequestFailed(
            400, f"prompt: {len(prompt_ids)} tokens leave no room in the model's context", "prompt"
        )
    search = BeamSearch(beam_width, max_tokens, engine.eos_token_ids, length_penalty)
    await run_beam_search(engine, request, prompt_ids, search)
    eos = set(engine.eos_token_ids)
    answers = []
    for beam in search.best(n):
        text = await engine.detokenize([t for t in beam.token_ids if t not in eos])
        answers.append((beam, text))
    return len(prompt_ids), answers


async def _prompt_ids(engine: EngineClient, request: GenerateRequest) -> list[int]:
    if request.prompt_token_ids is not None:
        ids = list(request.prompt_token_ids)
    elif request.messages is not None:
        ids = await engine.tokenize(
            messages=request.messages,
            add_special_tokens=bool(request.add_special_tokens),
            add_generation_prompt=request.add_generation_prompt,
            chat_template=request.chat_template,
            chat_template_kwargs=request.chat_template_kwargs,
            tools=request.tools,
        )
    else:
        ids = await engine.tokenize(
            request.prompt, add_special_tokens=request.add_special_tokens is not False
        )
    truncate = request.truncate_prompt_tokens
    return ids[-truncate:] if truncate is not None else ids


async def run_beam_search(
    engine: EngineClient, template: GenerateRequest, prompt_ids: list[int], search: BeamSearch
) -> None:
    """Drive `search` to its end: one engine request per running beam and step (ids
    `<request id>-<step>-<beam>`), all of a step at once."""
    sampling = SamplingParams(max_tokens=1, temperature=0.0, logprobs=search.num_candidates)
    while not search.is_done:
        requests = [
            dataclasses.replace(
                template,
                request_id=f"{template.request_id}-{search.num_steps}-{b}",
                sampling=sampling,
                prompt=None,
                messages=None,
                prompt_token_ids=prompt_ids + list(beam.token_ids),
                tools=None,
                unset_sampling=[],
            )
            for b, beam in enumerate(search.running)
        ]
        deltas = await asyncio.gather(*(_first_token(engine, r) for r in requests))
        search.step([_candidates(d) for d in deltas])


async def _first_token(engine: EngineClient, request: GenerateRequest) -> OutputDelta:
    """The delta carrying the request's one output token (the engine aborts the rest)."""
    async with contextlib.aclosing(engine.generate(request)) as deltas:
        async for delta in deltas:
            if delta.logprobs:
                return delta
    raise RequestFailed(500, f"beam step {request.request_id} ended without a token")


def _candidates(delta: OutputDelta) -> list[tuple[int, float]]:
    entry = delta.logprobs[0]
    return [(token_id, logprob) for token_id, _, logprob in entry.top]


def finish_reason(beam: Beam) -> FinishReason:
    return FinishReason.STOP if beam.is_eos else FinishReason.LENGTH
