"""Request checks the tokenizer applies before anything reaches the scheduler (pure logic)."""

from __future__ import annotations

import math

from common.messages import SamplingParams

MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BAD_WORDS = 64
MAX_BAD_WORD_LEN = 256


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
    check_controls(sp)


def check_controls(sp: SamplingParams) -> None:
    """Ranges of min_p, the penalties, logit_bias values, min_tokens and bad_words (their
    token ids are checked against the vocabulary by `check_control_token_ids`)."""
    if not _in(sp.min_p, 0.0, 1.0):
        raise InvalidRequest("min_p", f"must be in [0, 1], got {sp.min_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sp, name)
        if not _in(value, -2.0, 2.0):
            raise InvalidRequest(name, f"must be in [-2, 2], got {value}")
    if not math.isfinite(sp.repetition_penalty) or sp.repetition_penalty <= 0.0:
        raise InvalidRequest(
            "repetition_penalty", f"must be > 0 (1 = off), got {sp.repetition_penalty}"
        )
    if len(sp.logit_bias_token_ids) != len(sp.logit_bias_values):
        raise InvalidRequest("logit_bias", "token ids and values differ in number")
    if len(sp.logit_bias_token_ids) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
    for token, bias in zip(sp.logit_bias_token_ids, sp.logit_bias_values, strict=True):
        if not _in(bias, -100.0, 100.0):
            raise InvalidRequest("logit_bias", f"bias of token {token} must be in [-100, 100]")
    if not isinstance(sp.min_tokens, int) or sp.min_tokens < 0:
        raise InvalidRequest("min_tokens", f"must be >= 0, got {sp.min_tokens}")
    if len(sp.bad_words) > MAX_BAD_WORDS:
        raise InvalidRequest("bad_words", f"at most {MAX_BAD_WORDS} words, got {len(sp.bad_words)}")
    for word in sp.bad_words:
        if not word.strip() or len(word) > MAX_BAD_WORD_LEN:
            raise InvalidRequest(
                "bad_words",
                f"each bad word must have 1..{MAX_BAD_WORD_LEN} characters, not all spaces",
            )


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


def _in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


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
