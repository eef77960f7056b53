"""Unknown request fields: a field no schema of ours defines is a 400 naming it, as OpenAI
answers, with the field most likely meant when the name is a near miss (difflib):

    {"max_token": 50}  ->  400 "max_token: unknown field; did you mean `max_tokens`?"

The walk covers the request model's declared fields, the fields refused or ignored by name
(services/gateway/openai/refused.py) at the top level, and, recursively, every nested pydantic model
(`messages[i]`, their `tool_calls[j].function`, `stream_options`). Fields typed `Any` that
hold a JSON object of their own (`tools`, `response_format`, `structured_outputs`) check
their keys where they are parsed (services/gateway/openai/structured.py).

With `--ignore-unknown-fields` (vLLM's flag) unknown fields are logged as a warning and
ignored instead.
"""

from __future__ import annotations

import difflib
import functools
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
    names, shapes = _plan(model)
    found: list[tuple[Loc, str | None]] = []
    for key, value in data.items():
        if key not in names and key not in known:
            found.append(((*loc, key), suggest(key, {*names, *known})))
            continue
        shape = shapes.get(key)
        if shape is not None and value is not None:
            found += _find_nested(value, shape, (*loc, key))
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


# what to walk into: a model, a list of a shape
Shape = type[BaseModel] | tuple[str, "Shape"]


@functools.cache
def _plan(model: type[BaseModel]) -> tuple[frozenset[str], dict[str, Shape]]:
    """A model's field names (aliases too) and the shapes of the fields that hold models,
    read from its annotations once."""
    names = set(model.model_fields)
    names |= {f.alias for f in model.model_fields.values() if f.alias}
    if model.__name__ == "ChatMessage":
        names |= set(MESSAGE_ECHO_FIELDS)
    shapes = {}
    for name, field in model.model_fields.items():
        shape = _shape(field.annotation)
        if shape is not None:
            shapes[name] = shape
    return frozenset(names), shapes


def _shape(annotation: Any) -> Shape | None:
    """What of an annotation holds a model: itself, an optional of one, a list of one."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return _shape(args[0])
    if origin in (types.UnionType, typing.Union):
        shapes = [s for s in map(_shape, args) if s is not None]
        return shapes[0] if len(shapes) == 1 else None
    if origin is list and args:
        inner = _shape(args[0])
        return ("list", inner) if inner is not None else None
    return None


def _find_nested(value: Any, shape: Shape, loc: Loc) -> list[tuple[Loc, str | None]]:
    """Walk into a field's value by its shape."""
    if isinstance(shape, tuple):
        if not isinstance(value, list):
            return []
        found: list[tuple[Loc, str | None]] = []
        for i, item in enumerate(value):
            found += _find_nested(item, shape[1], (*loc, i))
        return found
    return find_unknown(value, shape, (), loc)


def _path(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out
