"""Structured-output fields of a request, checked and reduced to one grammar spec.

Accepted (at most one of them per request):
- OpenAI's `response_format`: `{"type": "text"}` (free text), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs`: exactly one of `json` (a schema, object or JSON text),
  `regex`, `choice` (a list of strings), `grammar` (EBNF), or `json_object: true`;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Here the shape is checked (types, one source, a non-empty choice list); whether the schema,
regex or grammar compiles is for the worker's compiler (gpu_worker/sample/structured.py), whose
error comes back as a 400 naming the field before the request is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from services.gateway.openai.unknown_fields import suggest

MAX_SPEC_BYTES = 256 * 1024  # a schema's JSON, a regex or a grammar
MAX_CHOICES = 1024
# vLLM's structured_outputs keys that choose the grammar; the others it defines are refused
_SO_KINDS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar"}
_SO_REFUSED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace",
               "disable_fallback", "disable_additional_properties", "backend")  # fmt: skip


class StructuredError(ValueError):
    """`field`: what is wrong (the gateway answers 400 naming `field`)."""

    def __init__(self, field: str, what: str) -> None:
        super().__init__(f"{field}: {what}")
        self.field = field


@dataclass(frozen=True, slots=True)
class Structured:
    """One request's grammar: SamplingParams.structured_{kind, spec, field}."""

    kind: str
    spec: str
    field: str


def parse_structured(body: dict[str, Any]) -> Structured | None:
    """The request's grammar from the fields above (None: free text)."""
    found = [
        s
        for s in (
            _response_format(body.get("response_format")),
            _structured_outputs(body.get("structured_outputs")),
            _guided(body),
        )
        if s is not None
    ]
    if len(found) > 1:
        raise StructuredError(
            found[1].field, f"only one structured output may be asked for (also {found[0].field})"
        )
    return found[0] if found else None


def _response_format(value: Any) -> Structured | None:
    if value is None:
        return None
    field = "response_format"
    if not isinstance(value, dict):
        raise StructuredError(field, "must be a JSON object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Structured("json_object", "", field)
    if kind != "json_schema":
        raise StructuredError(
            f"{field}.type", "must be one of 'text', 'json_object', 'json_schema'"
        )
    no_unknown_keys(value, {"type", "json_schema"}, field)
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise StructuredError(f"{field}.json_schema", "must be a JSON object")
    no_unknown_keys(inner, {"name", "description", "schema", "strict"}, f"{field}.json_schema")
    name = inner.get("name")
    if name is not None and not isinstance(name, str):
        raise StructuredError(f"{field}.json_schema.name", "must be a string")
    strict = inner.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise StructuredError(f"{field}.json_schema.strict", "must be a boolean")
    if "schema" not in inner or inner["schema"] is None:
        raise StructuredError(f"{field}.json_schema.schema", "is required")
    return _json_schema(inner["schema"], f"{field}.json_schema.schema")


def no_unknown_keys(value: dict[str, Any], known: set[str], field: str) -> None:
    """A key nobody defines is refused by name, not ignored."""
    unknown = sorted(k for k in value if k not in known and value[k] is not None)
    if unknown:
        meant = suggest(unknown[0], known)
        hint = f"; did you mean `{meant}`?" if meant else ""
        raise StructuredError(f"{field}.{unknown[0]}", f"is not a known field{hint}")


def _structured_outputs(value: Any) -> Structured | None:
    if value is None:
        return None
    field = "structured_outputs"
    if not isinstance(value, dict):
        raise StructuredError(field, "must be a JSON object")
    for key in _SO_REFUSED:
        if value.get(key) is not None:
            raise StructuredError(f"{field}.{key}", "is not supported by this server")
    no_unknown_keys(value, {*_SO_KINDS, "json_object", *_SO_REFUSED}, field)
    found = (
        [Structured("json_object", "", f"{field}.json_object")] if value.get("json_object") else []
    )
    for key, kind in _SO_KINDS.items():
        if value.get(key) is not None:
            found.append(_spec(kind, value[key], f"{field}.{key}"))
    if len(found) != 1:
        raise StructuredError(
            field, "must give exactly one of json, regex, choice, grammar, json_object"
        )
    return found[0]


def _guided(body: dict[str, Any]) -> Structured | None:
    found = [
        _spec(kind, body[f"guided_{kind}"], f"guided_{kind}")
        for kind in ("json", "regex", "choice", "grammar")
        if body.get(f"guided_{kind}") is not None
    ]
    if len(found) > 1:
        raise StructuredError(found[1].field, f"cannot be combined with {found[0].field}")
    return found[0] if found else None


def _spec(kind: str, value: Any, field: str) -> Structured:
    if kind == "json":
        return _json_schema(value, field)
    if kind == "choice":
        ok = isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)
        if not ok or len(value) > MAX_CHOICES:
            raise StructuredError(field, f"must be a list of 1..{MAX_CHOICES} non-empty strings")
        return Structured("choice", orjson.dumps(value).decode(), field)
    if not isinstance(value, str) or not value:
        raise StructuredError(field, "must be a non-empty string")
    if len(value.encode()) > MAX_SPEC_BYTES:
        raise StructuredError(field, f"must be at most {MAX_SPEC_BYTES} bytes")
    return Structured(kind, value, field)


def _json_schema(value: Any, field: str) -> Structured:
    """A JSON schema given as an object, or as its JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise StructuredError(field, f"is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise StructuredError(field, "must be a JSON schema object")
    try:
        text = orjson.dumps(value).decode()  # keeps key order: properties come out in it
    except orjson.JSONEncodeError as e:
        raise StructuredError(field, f"cannot be encoded ({e})") from None
    if len(text) > MAX_SPEC_BYTES:
        raise StructuredError(field, f"must be at most {MAX_SPEC_BYTES} bytes of JSON")
    return Structured("json", text, field)


def check_compatible(structured: Structured | None, body: dict[str, Any]) -> None:
    """Fields whose meaning a grammar would break: the grammar ends the output with EOS."""
    if structured is None:
        return
    if body.get("ignore_eos"):
        raise StructuredError(
            "ignore_eos", f"cannot be combined with {structured.field} (the grammar ends "
            "the output with the end-of-sequence token)"
        )  # fmt: skip
    if body.get("min_tokens"):
        raise StructuredError(
            "min_tokens", f"cannot be combined with {structured.field} (it would hold back "
            "the end-of-sequence token the grammar ends with)"
        )  # fmt: skip
