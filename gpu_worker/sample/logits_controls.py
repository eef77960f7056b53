"""Logits controls: what a request asks to change in its logits before a token is chosen.

Applied to the rows of a step whose request has controls (`SamplingParams.has_controls`),
before the greedy argmax and before temperature, in vLLM's order:

    allowed ids   -inf on every token but the request's allowed_token_ids
    bad words     -inf on a bad word's last token when the rest of the word ends the output
                  (a one-token word: always)
    min_tokens    -inf on the tokens that would end the request (EOS unless ignore_eos,
                  stop_token_ids) while fewer than min_tokens tokens are out
    logit_bias    + bias on the named tokens
    penalties     repetition over the prompt and output tokens (logit / r if logit > 0, else
                  logit * r), then frequency (- f * count) and presence (- p if count > 0)
                  over the output tokens

Rows without controls are neither touched nor copied. The work is batched over the
controlled rows: Python builds small index lists (tokens to mask or bias, new tokens to
count) from each request's few bad words and stop ids; nothing loops over the vocabulary.

Penalties read per-request token counts from `TokenCounts`, one row per request of a
[capacity, vocab] tensor: filled from the request's tokens the first time it needs one,
then updated with only its new tokens, and freed when the request leaves the worker.

    TokenCounts.output_counts      [capacity, vocab] int32   row = a request's slot
    TokenCounts.prompt_mask        [capacity, vocab] bool
      slot 0  | 0 2 0 1 0 ... |    a request that generated token 1 twice, token 3 once
      slot 1  | (free)        |
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

import torch

from common.messages.types import SamplingParams

_MIN_CAPACITY = 8


class RowHistory(Protocol):
    """What the controls read about one row's request (the worker's RequestState has it)."""

    @property
    def req_id(self) -> str: ...

    @property
    def token_ids(self) -> list[int]:
        """Prompt, then output so far (read, never changed here)."""
        ...

    @property
    def num_prompt(self) -> int: ...

    @property
    def stop_token_ids(self) -> list[int]:
        """The tokens that would end it, which min_tokens masks ([] without min_tokens)."""
        ...


@dataclasses.dataclass
class History:
    """The requests of a step's rows, in row order, and the token counts of their model."""

    rows: Sequence[RowHistory]  # [S]
    counts: TokenCounts


class TokenCounts:
    """How often each request generated each token, and which tokens its prompt holds: one
    row per request (that has penalties) of two [capacity, vocab] tensors, grown by doubling.
    See the module's docstring."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self._slot: dict[str, int] = {}  # request id -> its row
        self._num_counted: dict[str, int] = {}  # request id -> output tokens counted
        self._free: list[int] = []  # free rows, the lowest last
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)

    def __len__(self) -> int:
        return len(self._slot)

    @property
    def capacity(self) -> int:
        return self.output_counts.shape[0]

    def gather(self, rows: Sequence[RowHistory]) -> tuple[torch.Tensor, torch.Tensor]:
        """The output counts [R, vocab] (int32) and prompt masks [R, vocab] (bool) of these
        requests, after counting each one's tokens not counted yet."""
        self._admit([row for row in rows if row.req_id not in self._slot])
        slots: list[int] = []
        tokens: list[int] = []
        for row in rows:
            start = row.num_prompt + self._num_counted[row.req_id]
            new = row.token_ids[start:]  # usually the one token sampled last step
            slots.extend([self._slot[row.req_id]] * len(new))
            tokens.extend(new)
            self._num_counted[row.req_id] += len(new)
        if tokens:
            self.output_counts.index_put_(
                (self._tensor(slots), self._tensor(tokens)),
                torch.ones(len(tokens), dtype=torch.int32, device=self.device),
                accumulate=True,
            )
        index = self._tensor([self._slot[row.req_id] for row in rows])
        return self.output_counts[index], self.prompt_mask[index]

    def release(self, req_id: str) -> None:
        """Free a request's row (idempotent)."""
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            del self._num_counted[req_id]
            self._free.append(slot)

    def clear(self) -> None:
        for req_id in list(self._slot):
            self.release(req_id)

    def _admit(self, rows: Sequence[RowHistory]) -> None:
        """Give each new request a zeroed row and mark its prompt's tokens."""
        if not rows:
            return
        if len(rows) > len(self._free):
            self._grow(len(rows) - len(self._free))
        slots = [self._free.pop() for _ in rows]
        index = self._tensor(slots)
        self.output_counts[index] = 0
        self.prompt_mask[index] = False
        mark_slots: list[int] = []
        mark_tokens: list[int] = []
        for slot, row in zip(slots, rows, strict=True):
            self._slot[row.req_id] = slot
            self._num_counted[row.req_id] = 0
            prompt = row.token_ids[: row.num_prompt]
            mark_slots.extend([slot] * len(prompt))
            mark_tokens.extend(prompt)
        if mark_tokens:
            self.prompt_mask[self._tensor(mark_slots), self._tensor(mark_tokens)] = True

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(2 * old, old + need, _MIN_CAPACITY)
        counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
        mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old] = self.output_counts
        mask[:old] = self.prompt_mask
        self.output_counts, self.prompt_mask = counts, mask
        self._free = list(range(new - 1, old - 1, -1)) + self._free  # lowest rows used first

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(self.device)


def apply_controls(
    logits: torch.Tensor,  # [S, vocab] float32
    params: Sequence[SamplingParams],  # [S]
    history: History,
) -> torch.Tensor:
    """The logits with every row's controls applied: a new tensor when a row has controls
    (the rows without are copied unchanged), else `logits` itself."""
    rows = [i for i, p in enumerate(params) if p.has_controls]
    if not rows:
        return logits
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device)
    sub = logits[index]  # [R, vocab], a copy
    sub_params = [params[i] for i in rows]
    sub_history = [history.rows[i] for i in rows]
    mask_and_bias(sub, sub_params, sub_history)
    penalised = [j for j, p in enumerate(sub_params) if p.has_penalties]
    if penalised:
        counts, prompt_mask = history.counts.gather([sub_history[j] for j in penalised])
        pen_params = [sub_params[j] for j in penalised]
        if len(penalised) == len(rows):
            sub = apply_penalties(sub, counts, prompt_mask, pen_params)
        else:
            pen_index = torch.tensor(penalised, dtype=torch.int64).to(logits.device)
            sub[pen_index] = apply_penalties(sub[pen_index], counts, prompt_mask, pen_params)
    # controls no token can satisfy (allowed_token_ids all banned by min_tokens or bad words)
    # leave a row without a finite logit, whose probabilities would be NaN and fail the whole
    # step: such a row keeps its model logits for this step (found by the schemathesis fuzz)
    stuck = ~torch.isfinite(sub).any(dim=-1)
    if bool(stuck.any()):
        sub[stuck] = logits[index][stuck]
    return logits.index_copy(0, index, sub)


def mask_and_bias(
    logits: torch.Tensor,  # [R, vocab], changed in place
    params: Sequence[SamplingParams],  # [R]
    rows: Sequence[RowHistory],  # [R]
) -> None:
    """Allowed token ids, bad words and min_tokens (-inf), then logit_bias (+ bias), for
    every row at once."""
    keep_only(logits, [p.allowed_token_ids for p in params])
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    for r, (p, row) in enumerate(zip(params, rows, strict=True)):
        banned = banned_tokens(p, row)
        ban_rows.extend([r] * len(banned))
        ban_tokens.extend(banned)
        bias_rows.extend([r] * len(p.logit_bias_token_ids))
        bias_tokens.extend(p.logit_bias_token_ids)
        bias_values.extend(p.logit_bias_values)
    device = logits.device
    if ban_tokens:
        index = (_index(ban_rows, device), _index(ban_tokens, device))
        logits.index_put_(index, torch.tensor(float("-inf"), device=device))
    if bias_tokens:
        index = (_index(bias_rows, device), _index(bias_tokens, device))
        values = torch.tensor(bias_values, dtype=logits.dtype).to(device)
        logits.index_put_(index, values, accumulate=True)


def keep_only(
    logits: torch.Tensor,  # [R, vocab], changed in place
    allowed: Sequence[list[int]],  # [R][a] each row's allowed ids; [] = any
) -> None:
    """-inf on every token outside a row's allowed ids (rows with none are untouched)."""
    rows = [r for r, ids in enumerate(allowed) if ids]
    if not rows:
        return
    device = logits.device
    mask = torch.full((len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype)
    mask_rows = [j for j, r in enumerate(rows) for _ in allowed[r]]
    mask_tokens = [t for r in rows for t in allowed[r]]
    mask[_index(mask_rows, mask.device), _index(mask_tokens, mask.device)] = 0.0
    index = _index(rows, device)
    logits.index_add_(0, index, mask.to(device))


def banned_tokens(params: SamplingParams, row: RowHistory) -> list[int]:
    """The tokens a row may not produce next: stop tokens under min_tokens, and the last
    token of each bad word whose other tokens end the output."""
    tokens = row.token_ids
    num_output = len(tokens) - row.num_prompt
    banned = list(row.stop_token_ids) if num_output < params.min_tokens else []
    for word in params.bad_words_token_ids:
        prefix = len(word) - 1
        if prefix == 0 or (num_output >= prefix and tokens[-prefix:] == word[:-1]):
            banned.append(word[-1])
    return banned


def apply_penalties(
    logits: torch.Tensor,  # [R, vocab] float32
    output_counts: torch.Tensor,  # [R, vocab] int32
    prompt_mask: torch.Tensor,  # [R, vocab] bool
    params: Sequence[SamplingParams],  # [R]
) -> torch.Tensor:
    """Repetition, then frequency and presence penalties (vLLM's formulas), per row; a
    penalty no row uses is skipped (it would change no logit)."""
    device, dtype = logits.device, logits.dtype

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device)[:, None]

    generated = output_counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        logits = _repetition(logits, prompt_mask | generated, params)
    if any(p.frequency_penalty != 0.0 for p in params):
        frequency = column([p.frequency_penalty for p in params])
        logits = logits - frequency * output_counts
    if any(p.presence_penalty != 0.0 for p in params):
        presence = column([p.presence_penalty for p in params])
        logits = logits - presence * generated
    return logits


def _repetition(
    logits: torch.Tensor, seen: torch.Tensor, params: Sequence[SamplingParams]
) -> torch.Tensor:
    """logit / r where the logit is positive, logit * r elsewhere, on the tokens seen.

    With r >= 1 that is the smaller of the two values, with r < 1 the larger (where they
    are equal either will do), so no element-wise select is needed: torch.where over a
    [rows, vocab] tensor costs on a CPU about five times what min/max do."""
    penalties = [p.repetition_penalty for p in params]
    # a valid penalty may round to 0 in the logits' dtype (5e-324 in float32): at least the
    # dtype's smallest normal number, so no logit becomes x / 0 or -inf * 0 (NaN)
    tiny = torch.finfo(logits.dtype).tiny
    repetition = torch.tensor(penalties, dtype=logits.dtype).clamp_(min=tiny)
    repetition = repetition.to(logits.device)[:, None]
    scale = torch.where(seen, repetition, 1.0)
    divided, multiplied = logits / scale, logits * scale
    out = torch.minimum(divided, multiplied)
    below_one = [j for j, r in enumerate(penalties) if r < 1.0]
    if below_one:
        index = _index(below_one, logits.device)
        out[index] = torch.maximum(divided[index], multiplied[index])
    return out


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64).to(device)
