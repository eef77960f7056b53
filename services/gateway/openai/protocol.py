"""What the OpenAI generate bodies share (chat: openai/chat_protocol.py, completions:
openai/completions_protocol.py): the common fields, their parsing, limits and errors.

Parsing is strict about types (a string "5" is not an integer, `true` is not a number,
NaN and infinities are refused) and lenient about presence: `null` means "use the default",
as OpenAI treats it. Every field of the OpenAI and vLLM APIs is honoured, refused (a 400
naming it, services/gateway/openai/refused.py), or on that module's short list of fields that
change nothing (`user`, `metadata`, `store`, ...); a field nobody defines is a 400 naming it
with the name likely meant (services/gateway/openai/unknown_fields.py;
`--ignore-unknown-fields` logs it instead). Every refusal is a `RequestRejected` whose
message starts with the field it names (services/gateway/openai/request_errors.py, which
parses a body against these models).

Defaults:
- `max_tokens`: 16 for completions (OpenAI's legacy default); for chat 0, meaning as many as
  fit in the model's context after the prompt (the tokenizer resolves it).
- `temperature` 1.0, `top_p` 1.0, `top_k` off (-1 or 0), `min_p` 0, `repetition_penalty` 1:
  when the client leaves one of these unset, the tokenizer may take the model's default
  from its generation_config.json instead (`--generation-config auto`, as vLLM).
- `n` 1, `stream` false; every other control off.

Limits (common/limits.py): at most `MAX_STOP_STRINGS` stop strings of 1..`MAX_STOP_CHARS`
characters each; `n` (choices per prompt, sampled as sequences that share the prompt's KV
blocks) at most `MAX_N`;
`best_of` >= `n` (services/gateway/openai/best_of.py); at most `MAX_PROMPTS` prompts in a
/v1/completions batch (a list of strings or of token-id lists; each is its own engine
request). Not yet supported,
refused with a clear message: `suffix`. `stream_options` only with `stream: true`.

Logprobs (from the model's raw distribution, as vLLM's default): chat `logprobs: true` with
`top_logprobs` in [0, `MAX_LOGPROBS`] (refused without `logprobs: true`); completions
`logprobs` in [0, `MAX_LOGPROBS`] and `echo` (the prompt before the output, and with
`logprobs` its tokens' logprobs first); vLLM's `prompt_logprobs` in [0, `MAX_LOGPROBS`] on
both endpoints, streamed too (in the first chunk of each completion choice, or of a chat
response; vLLM refuses them with `stream`).

Sampling controls: `presence_penalty` and `frequency_penalty` in [-2, 2] (OpenAI), `logit_bias`
(a map of token ids, as strings, to a bias in [-100, 100]: at most `MAX_LOGIT_BIAS`; ids
outside the vocabulary are refused by the tokenizer, naming `logit_bias`); vLLM's
`repetition_penalty` (> 0), `min_p` in [0, 1], `min_tokens` (<= max_tokens; EOS, stop
token ids and stop strings do not end the output before it, as vLLM) and `bad_words`
(at most `MAX_BAD_WORDS` strings).

Structured outputs (services/gateway/openai/structured.py reads them; the worker compiles and
enforces them): `response_format` (json_object, json_schema), vLLM's `structured_outputs`
and `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; at most one, and not
with `ignore_eos` or `min_tokens`.

vLLM extensions: `top_k`, `ignore_eos`, `return_token_ids`, `stop_token_ids`,
`add_generation_prompt` (chat), `priority` (int, default 0: lower is served first; anything
but 0 is refused unless the server runs `--scheduling-policy priority`, as vLLM does) and
`timeout` (seconds, at most `MAX_TIMEOUT_S`: past it the request ends with finish reason
"timeout").
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from common.limits import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    LOGIT_BIAS_VALUE,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_TOKEN_IDS,
    MAX_TIMEOUT_S,
    MAX_TOKENS,
    MIN_P,
    MIN_TOKENS,
    PENALTY,
    REPETITION_PENALTY,
    TEMPERATURE,
    TOKEN_ID,
    TOP_K,
    TOP_P,
    Range,
    bad_words_problem,
    logit_bias_problem,
    stop_strings_problem,
)
from common.messages import SamplingParams
from common.messages.types import MODEL_DEFAULT_FIELDS
from services.gateway.openai.request_errors import RequestRejected
from services.gateway.openai.structured import (
    Structured,
    StructuredError,
    check_compatible,
    parse_structured,
)

# a client-chosen request id (X-Request-Id, gRPC request_id): safe in logs and headers
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# a logit_bias key: a token id in canonical digits, so two keys never name one token ("5", "05")
_TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,9}")

_STRICT = ConfigDict(strict=True, extra="ignore")
_STRUCTURED_FIELDS = {
    "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar",
}  # fmt: skip


def _int32(allowed: Range) -> Any:
    """An integer field's constraints: its range, and at most INT32_MAX on the wire."""
    return Field(**({"le": INT32_MAX} | allowed.bounds()))


def _finite(allowed: Range) -> Any:
    return Field(**allowed.bounds(), allow_inf_nan=False)


# every range is common/limits.py's, shared with the tokenizer's checks
MaxTokens = Annotated[int, _int32(MAX_TOKENS)]
Temperature = Annotated[float, _finite(TEMPERATURE)]
TopP = Annotated[float, _finite(TOP_P)]
TopK = Annotated[int, _int32(TOP_K)]
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, _finite(PENALTY)]
RepetitionPenalty = Annotated[float, _finite(REPETITION_PENALTY)]
MinP = Annotated[float, _finite(MIN_P)]
MinTokens = Annotated[int, _int32(MIN_TOKENS)]
Bias = Annotated[float, _finite(LOGIT_BIAS_VALUE)]
TokenId = Annotated[int, _int32(TOKEN_ID)]
NumChoices = Annotated[int, Field(ge=1, le=MAX_N)]
Priority = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Timeout = Annotated[float, Field(gt=0.0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


def check_model(
    requested: str | None, served_names: list[str], ready: bool, draining: bool = False
) -> None:
    """Refuse a request the served model cannot take: 503 (retryable) while nothing is
    served or the engine is not taking requests (`draining`: the server is shutting down),
    404 for a name the model does not answer to. Readiness first: while starting, no name
    is known yet, and a right one is not 404."""
    if draining:
        raise RequestRejected(
            "the server is draining (shutting down): it takes no new requests; "
            "retry on another replica",
            None,
            503,
        )
    if not ready:
        raise RequestRejected("the engine is not ready yet; retry the request", None, 503)
    if requested is not None and requested not in served_names:
        raise RequestRejected(f"model: the model `{requested}` does not exist", "model", 404)


def lora_of(
    requested: str | None,
    served_names: list[str],
    adapters: Collection[str],
    ready: bool,
    draining: bool = False,
) -> str:
    """check_model, where `model` may also name a LoRA adapter served (--enable-lora):
    the adapter's name, or "" for the base model (a name of the base model comes first)."""
    check_model(requested, [*served_names, *adapters], ready, draining)
    if requested is None or requested in served_names:
        return ""
    return requested


def _refuse(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    """OpenAI's `stream_options`."""

    model_config = _STRICT
    include_usage: bool | None = None
    # vLLM's: with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool | None = None


class _CommonRequest(BaseModel):
    """Fields shared by both endpoints."""

    model_config = _STRICT

    model: str | None = None  # None: the served model
    max_tokens: MaxTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None  # vLLM extension; -1 or 0 = off
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list)  # also a single str, see _stop_list
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    n: NumChoices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = None  # vLLM extension
    return_token_ids: bool | None = None  # vLLM extension: output token ids in the answer
    detokenize: bool | None = None  # vLLM: false = token ids, no text (token_output.py)
    include_stop_str_in_output: bool | None = None  # vLLM: the stop string ends the text
    skip_special_tokens: bool | None = None  # vLLM: special tokens left out of the text
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs' tokens as "token_id:<id>"
    user: str | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None  # vLLM extension
    min_p: MinP | None = None  # vLLM extension
    min_tokens: MinTokens | None = None  # vLLM extension
    logit_bias: dict[str, Bias] | None = None  # token id (a string, as JSON keys) -> bias
    bad_words: list[str] | None = None  # vLLM extension
    # vLLM extension: only these tokens may be generated (ids outside the vocabulary are
    # refused by the tokenizer)
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    priority: Priority | None = None  # vLLM extension: lower first (priority scheduling)
    timeout: Timeout | None = None  # vLLM-style extension: seconds until finish "timeout"
    prompt_logprobs: NumLogprobs | None = None  # vLLM extension
    # vLLM extensions: how the prompt is tokenised (special tokens: the endpoint's default
    # when null), and keep only its last k tokens (-1: the model's length)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    # vLLM extensions: beam search (services/gateway/engine/beam_search.py), n beams of a
    # width of best_of (completions) or n; length_penalty scores a finished beam sum / len ** it
    use_beam_search: bool | None = None
    length_penalty: Annotated[float, Field(allow_inf_nan=False)] | None = None
    # vLLM extension: only requests with the same salt share prefix-cache blocks
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # structured outputs (services/gateway/openai/structured.py checks them; at most one)
    response_format: Any = None
    structured_outputs: Any = None  # vLLM extension, and its older guided_* fields:
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, value: Any) -> list[str]:
        stops = [value] if isinstance(value, str) else [] if value is None else value
        if not isinstance(stops, list):
            raise PydanticCustomError("stop_type", "must be a string or a list of strings")
        if (problem := stop_strings_problem(stops)) is not None:
            raise PydanticCustomError(f"stop_{problem[0]}", problem[1])
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return value
        if (problem := logit_bias_problem(len(value))) is not None:
            raise PydanticCustomError(f"logit_bias_{problem[0]}", problem[1])
        for key in value:
            if not _TOKEN_ID_KEY.fullmatch(key) or int(key) > INT32_MAX:
                raise PydanticCustomError(
                    "logit_bias_key",
                    "keys must be token ids (non-negative integers, as strings), got {key!r}",
                    {"key": key[:40]},
                )
        return value

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words(cls, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, list):
            raise PydanticCustomError("bad_words_type", "must be a list of strings")
        if (problem := bad_words_problem(value)) is not None:
            raise PydanticCustomError(f"bad_words_{problem[0]}", problem[1])
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        # as vLLM: options for a stream that is not asked for are a mistake, not a no-op
        if value is not None and "stream" in info.data and not info.data["stream"]:
            raise _refuse("only allowed when stream is true")
        return value

    @field_validator("detokenize")
    @classmethod
    def _token_ids_only(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value is False and info.data.get("stop"):
            raise _refuse("false cannot go with stop strings (they match text)")
        if value is False and info.data.get("stream"):
            raise _refuse("false is not supported with stream")
        return value

    @property
    def with_token_ids(self) -> bool:
        """The answer carries the output token ids (return_token_ids, or detokenize false)."""
        return bool(self.return_token_ids) or self.detokenize is False

    @field_validator("priority")
    @classmethod
    def _priority_policy(cls, value: int | None, info: ValidationInfo) -> int | None:
        # parse_request's context names the server's --scheduling-policy (HTTP); as vLLM,
        # a priority other than 0 is an error unless the policy orders by it
        policy = (info.context or {}).get("scheduling_policy", "priority")
        if value and policy != "priority":
            raise _refuse(f"needs --scheduling-policy priority; this server schedules by {policy}")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: needs include_usage too)."""
        options = self.stream_options
        return bool(self.include_usage and options and options.continuous_usage_stats)

    def _sampling(
        self,
        max_tokens: int | None,
        field: str,
        default: int,
        max_model_len: int,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        forced: Structured | None = None,
    ) -> SamplingParams:
        limit = max_tokens if max_tokens is not None else default
        if limit > max_model_len:
            raise RequestRejected(
                f"{field}: must be <= {max_model_len} (the model's context length), got {limit}",
                field,
            )
        if self.min_tokens and limit and self.min_tokens > limit:  # (limit 0: as many as fit)
            raise RequestRejected(
                f"min_tokens: must be <= {field} ({limit}), got {self.min_tokens}", "min_tokens"
            )
        bias = sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        try:
            structured = parse_structured(self.model_dump(include=_STRUCTURED_FIELDS))
            if forced is not None and structured is not None:
                raise StructuredError(
                    "tool_choice", f"cannot force a tool call and {structured.field} at once"
                )
            structured = structured or forced
            check_compatible(
                structured, {"ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens}
            )
        except StructuredError as e:
            raise RequestRejected(str(e), e.field) from None
        return SamplingParams(
            max_tokens=limit,
            temperature=1.0 if self.temperature is None else float(self.temperature),
            top_p=1.0 if self.top_p is None else float(self.top_p),
            top_k=max(self.top_k or 0, 0),
            seed=self.seed,
            stop=list(self.stop),
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=bool(self.ignore_eos),
            n=self.n or 1,
            min_p=float(self.min_p or 0.0),
            presence_penalty=float(self.presence_penalty or 0.0),
            frequency_penalty=float(self.frequency_penalty or 0.0),
            repetition_penalty=(
                1.0 if self.repetition_penalty is None else float(self.repetition_penalty)
            ),
            logit_bias_token_ids=[token for token, _ in bias],
            logit_bias_values=[value for _, value in bias],
            min_tokens=self.min_tokens or 0,
            bad_words=list(self.bad_words or []),
            allowed_token_ids=list(self.allowed_token_ids or []),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_kind=structured.kind if structured else "",
            structured_spec=structured.spec if structured else "",
            structured_field=structured.field if structured else "",
        )

    def _unset_sampling(self) -> list[str]:
        """The fields a model's generation_config may fill: those the client left unset."""
        return [name for name in MODEL_DEFAULT_FIELDS if getattr(self, name) is None]

    @field_validator("length_penalty")
    @classmethod
    def _only_with_beams(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value != 1.0 and not info.data.get("use_beam_search"):
            raise _refuse("only with use_beam_search: true")
        return value

    @field_validator("use_beam_search")
    @classmethod
    def _beams_are_not_streamed(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("stream"):
            raise _refuse("cannot be streamed (the best beams are known at the end)")
        return value

    @property
    def beam_width(self) -> int:
        """Beams kept per step (use_beam_search): n (completions: best_of when larger)."""
        return self.n or 1

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_to_some(cls, value: int | None) -> int | None:
        if value == 0:
            raise _refuse("must be -1 (the model's length) or at least 1, got 0")
        return value

    def _scheduling(self, max_model_len: int) -> dict[str, Any]:
        """The GenerateRequest fields that steer the tokenizer and the scheduler rather
        than sampling, and the sampling fields left unset."""
        truncate = self.truncate_prompt_tokens
        if truncate is not None and truncate > max_model_len:
            raise RequestRejected(
                f"truncate_prompt_tokens: must be <= {max_model_len} (the model's context "
                f"length), got {truncate}",
                "truncate_prompt_tokens",
            )
        return {
            "priority": self.priority or 0,
            "timeout": self.timeout,
            "unset_sampling": self._unset_sampling(),
            "add_special_tokens": self.add_special_tokens,
            "truncate_prompt_tokens": max_model_len if truncate == -1 else truncate,
            "cache_salt": self.cache_salt or "",
        }
