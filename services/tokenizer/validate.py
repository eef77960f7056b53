"""Request checks the tokenizer applies before anything reaches the scheduler (pure logic)."""

from __future__ import annotations

import math

from common.messages import SamplingParams

MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 256


class InvalidRequest(ValueError):
    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"
        self.status = status


def check_sampling(sp: SamplingParams) -> None:
    """Ranges of every sampling parameter; raises InvalidRequest naming the field."""
    if not isinstance(sp.max_tokens, int) or sp.max_tokens < 0:
        raise InvalidRequest("max_tokens", f"must be >= 1, got {sp.max_tokens}")
    if not math.isfinite(sp.temperature) or not 0.0 <= sp.temperature <= 2.0:
        raise InvalidRequest("temperature", f"must be in [0, 2], got {sp.temperature}")
    if not math.isfinite(sp.top_p) or not 0.0 < sp.top_p <= 1.0:
        raise InvalidRequest("top_p", f"must be in (0, 1], got {sp.top_p}")
    if sp.top_k < 0:
        raise InvalidRequest("top_k", f"must be >= 0 (0 = off), got {sp.top_k}")
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} strings, got {len(sp.stop)}")
    for s in sp.stop:
        if not s or len(s) > MAX_STOP_LEN:
            raise InvalidRequest("stop", f"each stop string must have 1..{MAX_STOP_LEN} characters")


def check_prompt_chars(param: str, num_chars: int, max_chars: int) -> None:
    """Refuse a prompt too long to be worth tokenising (--max-prompt-chars); 413 as for a
    body over the size limit, since no setting of the request's fields could make it fit."""
    if num_chars > max_chars:
        raise InvalidRequest(
            param,
            f"the prompt has {num_chars} characters, more than the "
            f"limit of {max_chars} (--max-prompt-chars)",
            413,
        )


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """The output budget: max_tokens 0 means 'as many as fit'; otherwise it must fit."""
    if num_prompt_tokens == 0:
        raise InvalidRequest("prompt", "must not be empty")
    room = max_model_len - num_prompt_tokens
    if room < 1:  # "prompt" names the request's prompt: the gateway says `messages` for chat
        raise InvalidRequest(
            "prompt",
            f"the prompt has {num_prompt_tokens} tokens; the model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room for output",
        )
    if max_tokens == 0:
        return room
    if max_tokens > room:
        raise InvalidRequest(
            "max_tokens",
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is "
            f"{num_prompt_tokens + max_tokens}, more than the model's maximum context length "
            f"({max_model_len} tokens)",
        )
    return max_tokens


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(
                param, f"token id {t!r} is outside the vocabulary (0..{vocab_size - 1})"
            )
