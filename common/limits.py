"""Every limit and range a request is checked against, in one place (pure: no pydantic).

The gateway turns these into its request models' constraints (services/gateway/openai/
protocol.py) and the tokenizer checks the engine's `SamplingParams` against them
(services/tokenizer/validate.py), so a limit has one name and one value, and the message
that refuses a value names the range the code enforces.

Two ranges differ between a request and the engine on purpose: a client's `max_tokens` is
at least 1 (OpenAI), while the engine's 0 means "as many as fit" (what the gateway sends when
the client leaves it out); a client's `top_k` of -1 means off (vLLM), the engine's off is 0.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # orjson carries 64-bit ints

# counts and sizes of a request's fields
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16  # choices per request: each is a sequence holding its own KV blocks
MAX_PROMPTS = 64  # prompts in one /v1/completions request (one engine request each)
MAX_EMBEDDING_INPUTS = 2048  # inputs in one /v1/embeddings request (OpenAI's limit)
MAX_TIMEOUT_S = 86400.0  # a day
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BAD_WORDS = 64
MAX_BAD_WORD_CHARS = 256
MAX_CHAT_TEMPLATE_CHARS = 64 * 1024  # a request's chat_template; its chat_template_kwargs
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CACHE_SALT_CHARS = 1024  # vLLM's cache_salt
MAX_ALLOWED_TOKEN_IDS = 1 << 18  # allowed_token_ids: more than any vocabulary served here


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """A numeric interval a field must fall in; None leaves that side unbounded. A float
    that is NaN or infinite is in no range."""

    low: float | None
    high: float | None
    low_open: bool = False  # (low, ...: low itself is outside
    high_open: bool = False
    note: str = ""  # what a special value means, shown in the message ("0 = off")

    def __contains__(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self) -> str:
        """'in [0, 2]', 'in (0, 1]', '>= 0', '> 0', with the note after: '>= 0 (0 = off)'."""
        low, high = _num(self.low), _num(self.high)
        if self.low is not None and self.high is not None:
            text = (
                f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
            )
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        else:
            text = f"{'<' if self.high_open else '<='} {high}"
        return f"{text} ({self.note})" if self.note else text

    def bounds(self) -> dict[str, Any]:
        """The range as pydantic `Field` keyword arguments (ge/gt, le/lt)."""
        out: dict[str, Any] = {}
        if self.low is not None:
            out["gt" if self.low_open else "ge"] = self.low
        if self.high is not None:
            out["lt" if self.high_open else "le"] = self.high
        return out


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# ranges of the sampling fields, as a client sends them (gateway) and as the engine takes
# them (tokenizer): the same unless said otherwise. Integer fields are also at most INT32_MAX
# on the way in (the gateway's wire limit, not a range of the field).
TEMPERATURE = Range(0.0, 2.0)
TOP_P = Range(0.0, 1.0, low_open=True)
MIN_P = Range(0.0, 1.0)
PENALTY = Range(-2.0, 2.0)  # presence_penalty, frequency_penalty
REPETITION_PENALTY = Range(0.0, None, low_open=True, note="1 = off")
LOGIT_BIAS_VALUE = Range(-100.0, 100.0)
MIN_TOKENS = Range(0, None)
TOKEN_ID = Range(0, None)
MAX_TOKENS = Range(1, None)  # a request's
ENGINE_MAX_TOKENS = Range(0, None, note="0 = as many as fit")  # SamplingParams'
TOP_K = Range(-1, None)  # a request's: -1 or 0 = off (vLLM)
ENGINE_TOP_K = Range(0, None, note="0 = off")  # SamplingParams'

# what is wrong with a list field, when something is: ("count" | "item", the message)
Problem = tuple[Literal["count", "item"], str]


def stop_strings_problem(stops: Sequence[object]) -> Problem | None:
    """Too many stop strings, or one empty or too long (or not a string)."""
    if len(stops) > MAX_STOP_STRINGS:
        return "count", f"at most {MAX_STOP_STRINGS} stop strings"
    if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS for s in stops):
        return "item", f"each stop string must be 1..{MAX_STOP_CHARS} characters"
    return None


def bad_words_problem(words: Sequence[object]) -> Problem | None:
    """Too many bad words, or one blank or too long (or not a string)."""
    if len(words) > MAX_BAD_WORDS:
        return "count", f"at most {MAX_BAD_WORDS} words"
    for word in words:
        if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
            return (
                "item",
                f"each bad word must be 1..{MAX_BAD_WORD_CHARS} characters, not all spaces",
            )
    return None


def logit_bias_problem(num_entries: int) -> Problem | None:
    if num_entries > MAX_LOGIT_BIAS:
        return "count", f"at most {MAX_LOGIT_BIAS} entries"
    return None


# the float fields of SamplingParams by name, checked alike by the tokenizer
SAMPLING_FLOAT_RANGES: dict[str, Range] = {
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "min_p": MIN_P,
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "repetition_penalty": REPETITION_PENALTY,
}
# the fields a model's generation_config.json may set, in a request's terms
GENERATION_CONFIG_RANGES: dict[str, Range] = {
    "temperature": TEMPERATURE,
    "top_p": TOP_P,
    "min_p": MIN_P,
    "repetition_penalty": REPETITION_PENALTY,
    "top_k": TOP_K,
}
