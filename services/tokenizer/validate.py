"""Request checks the tokenizer applies before anything reaches the scheduler (pure logic)."""

from __future__ import annotations

from common.limits import (
    ENGINE_MAX_TOKENS,
    ENGINE_TOP_K,
    LOGIT_BIAS_VALUE,
    MIN_TOKENS,
    SAMPLING_FLOAT_RANGES,
    Range,
    bad_words_problem,
    logit_bias_problem,
    stop_strings_problem,
)
from common.messages import SamplingParams


class InvalidRequest(ValueError):
    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = f"{param}: {message}"
        self.status = status


def check_range(param: str, value: float, allowed: Range, integer: bool = False) -> None:
    """Refuse `value` outside `allowed` (or not an int where one is due), naming the range."""
    if (integer and (not isinstance(value, int) or isinstance(value, bool))) or (
        value not in allowed
    ):
        raise InvalidRequest(param, f"must be {allowed.describe()}, got {value}")


def check_sampling(sp: SamplingParams) -> None:
    """Ranges of every sampling parameter (common/limits.py); raises InvalidRequest naming
    the field."""
    check_range("max_tokens", sp.max_tokens, ENGINE_MAX_TOKENS, integer=True)
    check_range("top_k", sp.top_k, ENGINE_TOP_K, integer=True)
    if (problem := stop_strings_problem(sp.stop)) is not None:
        raise InvalidRequest("stop", problem[1])
    check_controls(sp)


def check_controls(sp: SamplingParams) -> None:
    """Ranges of the float fields, logit_bias values, min_tokens and bad_words (their token
    ids are checked against the vocabulary by `check_control_token_ids`)."""
    for name, allowed in SAMPLING_FLOAT_RANGES.items():
        check_range(name, getattr(sp, name), allowed)
    if len(sp.logit_bias_token_ids) != len(sp.logit_bias_values):
        raise InvalidRequest("logit_bias", "token ids and values differ in number")
    if (problem := logit_bias_problem(len(sp.logit_bias_token_ids))) is not None:
        raise InvalidRequest("logit_bias", problem[1])
    for token, bias in zip(sp.logit_bias_token_ids, sp.logit_bias_values, strict=True):
        if bias not in LOGIT_BIAS_VALUE:
            raise InvalidRequest(
                "logit_bias", f"bias of token {token} must be {LOGIT_BIAS_VALUE.describe()}"
            )
    check_range("min_tokens", sp.min_tokens, MIN_TOKENS, integer=True)
    if (problem := bad_words_problem(sp.bad_words)) is not None:
        raise InvalidRequest("bad_words", problem[1])


def check_min_tokens(min_tokens: int, max_tokens: int) -> None:
    """min_tokens may not exceed the output budget (as vLLM: min_tokens <= max_tokens)."""
    if min_tokens > max_tokens:
        raise InvalidRequest(
            "min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}"
        )


def check_control_token_ids(sp: SamplingParams, vocab_size: int) -> None:
    """logit_bias ids, allowed_token_ids (and the bad words' token ids) inside the
    vocabulary."""
    for t in sp.logit_bias_token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequest(
                "logit_bias", f"token id {t} is outside the vocabulary (0..{vocab_size - 1})"
            )
    if any(not 0 <= t < vocab_size for ids in sp.bad_words_token_ids for t in ids):
        raise InvalidRequest("bad_words", "a word has a token id outside the vocabulary")
    for t in sp.allowed_token_ids:
        if not 0 <= t < vocab_size:
            raise InvalidRequest(
                "allowed_token_ids",
                f"token id {t} is outside the vocabulary (0..{vocab_size - 1})",
            )


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


def check_embedding_prompt(num_prompt_tokens: int, max_model_len: int) -> None:
    """An embeddings request generates nothing: its prompt may fill the model's length."""
    if num_prompt_tokens == 0:
        raise InvalidRequest("prompt", "must not be empty")
    if num_prompt_tokens > max_model_len:  # "prompt": the gateway says `input`
        raise InvalidRequest(
            "prompt",
            f"the input has {num_prompt_tokens} tokens, more than the model's maximum context "
            f"length ({max_model_len} tokens); send truncate_prompt_tokens to keep its last ones",
        )


def check_token_ids(token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    for t in token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequest(
                param, f"token id {t!r} is outside the vocabulary (0..{vocab_size - 1})"
            )
