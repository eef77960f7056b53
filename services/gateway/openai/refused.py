"""Request fields of the OpenAI and vLLM APIs that this server does not honour. None is
silently ignored: each is refused with a 400 naming it as soon as it asks for something (a
value other than null or the value that changes nothing), except the few on
IGNORED_FIELDS, which cannot change what is generated.

Fields the server honours, or refuses with a message of their own (`suffix`), are declared
on the request models in protocol.py; a field must not be both there and here (checked when
protocol.py is imported), so implementing one means moving it from here to there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson
from pydantic import ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

# accepted and ignored: bookkeeping and hints for OpenAI's platform, none of which changes
# the tokens generated
IGNORED_FIELDS = (
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    # vLLM's: how a slow (Python) tokenizer joins special tokens; its detokenizer for fast
    # tokenizers, the only kind served here, ignores it too
    "spaces_between_special_tokens",
)

ANY = object()  # refused whatever its value, null aside

# field -> the one value that asks for nothing (accepted), or ANY
_COMMON: dict[str, Any] = {
    # sampling controls not implemented yet (vLLM names)
    "logits_processors": ANY,
    # structured outputs: only through the server's own backend (xgrammar) and whitespace
    "guided_decoding_backend": ANY,
    "guided_whitespace_pattern": ANY,
    # vLLM plumbing
    "request_id": ANY,  # the id comes in the X-Request-Id header
    "kv_transfer_params": ANY,
    "vllm_xargs": ANY,
}
REFUSED_CHAT: dict[str, Any] = _COMMON | {
    "functions": ANY,
    "function_call": "none",
    "audio": ANY,
    "modalities": ["text"],
    "prediction": ANY,
    "reasoning_effort": ANY,
    "verbosity": ANY,
    "web_search_options": ANY,
    "moderation": ANY,
    "documents": ANY,
    "mm_processor_kwargs": ANY,
}
REFUSED_COMPLETION: dict[str, Any] = _COMMON
REFUSED_EMBEDDING: dict[str, Any] = {
    "request_id": ANY,  # the id comes in the X-Request-Id header
    "embed_dtype": "float32",  # vLLM's base64 element type: float32 only
    "mm_processor_kwargs": ANY,
}


def refuse_unsupported(data: Any, refused: Mapping[str, Any], title: str) -> Any:
    """`data` (a request body, before validation) unchanged; a ValidationError naming every
    field of `refused` that asks for something."""
    if not isinstance(data, dict):
        return data  # the model's own validation says what is wrong
    errors = [
        InitErrorDetails(type=_refusal(no_op), loc=(name,), input=data[name])
        for name, no_op in refused.items()
        if data.get(name) is not None and not _same(data[name], no_op)
    ]
    if errors:
        raise ValidationError.from_exception_data(title, errors)
    return data


def _same(value: Any, no_op: Any) -> bool:
    return no_op is not ANY and type(value) is type(no_op) and value == no_op


def _refusal(no_op: Any) -> PydanticCustomError:
    if no_op is ANY:
        return PydanticCustomError("unsupported", "is not supported by this server")
    shown = orjson.dumps(no_op).decode()
    return PydanticCustomError(
        "unsupported",
        "is not supported by this server; only {value} (or null) is accepted",
        {"value": shown},
    )


def check_disjoint(declared: Mapping[str, Any], refused: Mapping[str, Any], model: str) -> None:
    """A field the model declares (honours) must not be refused here as well."""
    both = sorted(set(declared) & set(refused))
    if both:
        raise TypeError(
            f"{model}: {both} are both declared and refused (services/gateway/openai/refused.py)"
        )
