"""Unknown request fields: a field no schema of ours defines is a 400 naming it, as OpenAI
answers, with the field most likely meant when the name is a near miss (difflib):

    {"max_token": 50}  ->  400 "max_token: unknown field; did you mean `max_tokens`?"

The walk covers the request model's declared fields, the fields refused or ignored by name
(services/gateway/refused.py) at the top level, and, recursively, every nested pydantic model
(`messages[i]`, their `tool_calls[j].function`, `stream_options`). Fields typed `Any` that
hold a JSON object of their own (`tools`, `response_format`, `structured_outputs`) check
their keys where they are parsed (services/gateway/structured.py).

With `--ignore-unknown-fields` (vLLM's flag) unknown fields are logged as a warning and
ignored instead.
"""

from __future__ import annotations

import difflib
import logging
import types
import typing
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import InitErrorDetails, PydanticCustomError

log = logging.getLogger("shuttle.gateway")

Loc = tuple[str | int, ...]

# keys OpenAI's own message types carry that change nothing here: the openai client sends
# them back when a conversation replays an earlier answer (`message.model_dump()`)
MESSAGE_ECHO_FIELDS = ("refusal", "audio", "function_call", "annotations")


def find_unknown(
    data: Any, model: type[BaseModel], known: Iterable[str] = (), loc: Loc = ()
) -> list[tuple[Loc, str | None]]:
    """Every key of `data` (a body, or a nested object) that `model` does not declare and
    `known` does not list, as (location, the declared name it is closest to, or None)."""
    if not isinstance(data, dict):
        return []  # the model's own validation says what is wrong
    names = set(_field_names(model)) | set(known)
    found: list[tuple[Loc, str | None]] = []
    for key, value in data.items():
        if key not in names:
            found.append(((*loc, key), suggest(key, names)))
            continue
        field = model.model_fields.get(key)
        if field is not None and value is not None:
            found += _find_nested(value, field.annotation, (*loc, key))
    return found


def suggest(name: str, names: Iterable[str]) -> str | None:
    """The name of `names` that `name` most likely misspells (None: no close one)."""
    close = difflib.get_close_matches(name, sorted(names), n=1, cutoff=0.75)
    return close[0] if close else None


def check_unknown(
    data: Any,
    model: type[BaseModel],
    known: Iterable[str],
    title: str,
    context: dict[str, Any] | None,
) -> None:
    """Raise a ValidationError naming every unknown field of `data` (see the module's
    docstring); with the context's `ignore_unknown_fields`, log them instead."""
    found = find_unknown(data, model, known)
    if not found:
        return
    if (context or {}).get("ignore_unknown_fields"):
        log.warning("ignored unknown request fields: %s", ", ".join(_path(loc) for loc, _ in found))
        return
    # one error, on the first field, naming the others too
    (loc, hint), others = found[0], found[1:]
    text = "unknown field" + _hint(hint)
    if others:
        text += " (also unknown: " + ", ".join(_path(o) + _hint(h) for o, h in others) + ")"
    error = PydanticCustomError("unknown_field", "{text}", {"text": text})
    raise ValidationError.from_exception_data(
        title, [InitErrorDetails(type=error, loc=loc, input=None)]
    )


def _hint(hint: str | None) -> str:
    return f"; did you mean `{hint}`?" if hint is not None else ""


def _field_names(model: type[BaseModel]) -> list[str]:
    names = list(model.model_fields)
    names += [f.alias for f in model.model_fields.values() if f.alias]
    if model.__name__ == "ChatMessage":
        names += MESSAGE_ECHO_FIELDS
    return names


def _find_nested(value: Any, annotation: Any, loc: Loc) -> list[tuple[Loc, str | None]]:
    """Walk into a field's value by its annotation: a model, a list or an optional of one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return find_unknown(value, annotation, (), loc)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _find_nested(value, args[0], loc)
    if origin in (types.UnionType, typing.Union):
        models = [a for a in args if _holds_model(a)]
        return _find_nested(value, models[0], loc) if len(models) == 1 else []
    if origin is list and args and isinstance(value, list):
        found: list[tuple[Loc, str | None]] = []
        for i, item in enumerate(value):
            found += _find_nested(item, args[0], (*loc, i))
        return found
    return []


def _holds_model(annotation: Any) -> bool:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    return any(_holds_model(a) for a in typing.get_args(annotation))


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
