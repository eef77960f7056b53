"""The wire codec: orjson frames `{"k": KIND, ...fields}` and a registry KIND -> message class.

Messages are frozen, slotted dataclasses declared with `@message("kind")`. A duplicate KIND
fails at import. Fields may hold JSON values, other registered structs (`@struct`), optional
structs and lists of structs; the decoder rebuilds those from the annotations, resolved once
per class. No pickle, ever.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar, dataclass_transform

import orjson

T = TypeVar("T")

_REGISTRY: dict[str, type] = {}
_DECODERS: dict[type, Callable[[dict[str, Any]], Any]] = {}
_STRUCTS: set[type] = set()


class CodecError(ValueError):
    """A frame that is not valid JSON, has no known KIND, or does not fit its message."""


# dataclass_transform: type checkers see these decorators as the frozen dataclasses they make
@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def struct(cls: type[T]) -> type[T]:
    """A frozen, slotted dataclass that can sit inside a message (it has no KIND)."""
    dc = dataclasses.dataclass(frozen=True, slots=True)(cls)
    _STRUCTS.add(dc)
    return dc


@dataclass_transform(frozen_default=True, field_specifiers=(dataclasses.field,))
def message(kind: str) -> Callable[[type[T]], type[T]]:
    """Declare a wire message with a unique KIND."""

    def wrap(cls: type[T]) -> type[T]:
        if kind in _REGISTRY:
            raise TypeError(f"duplicate message KIND {kind!r}: {_REGISTRY[kind]} and {cls}")
        cls.__annotations__["KIND"] = ClassVar[str]
        cls.KIND = kind  # type: ignore[attr-defined]  # declared just above, at run time
        dc = dataclasses.dataclass(frozen=True, slots=True)(cls)
        _REGISTRY[kind] = dc
        return dc

    return wrap


def registry() -> dict[str, type]:
    """KIND -> class for every registered message (a copy)."""
    return dict(_REGISTRY)


def encode(msg: Any) -> bytes:
    cls = type(msg)
    kind = getattr(cls, "KIND", None)
    if kind is None or _REGISTRY.get(kind) is not cls:
        raise CodecError(f"{cls.__name__} is not a registered message")
    body = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)}
    body["k"] = kind
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def decode(frame: bytes) -> Any:
    try:
        body = orjson.loads(frame)
    except orjson.JSONDecodeError as e:
        raise CodecError(f"frame is not JSON: {e}") from e
    if not isinstance(body, dict) or "k" not in body:
        raise CodecError("frame has no message kind 'k'")
    cls = _REGISTRY.get(body.pop("k"))
    if cls is None:
        raise CodecError("unknown message kind")
    try:
        return _decoder(cls)(body)
    except (TypeError, KeyError) as e:
        raise CodecError(f"frame does not fit {cls.__name__}: {e}") from e


def _decoder(cls: type) -> Callable[[dict[str, Any]], Any]:
    fn = _DECODERS.get(cls)
    if fn is None:
        hints = typing.get_type_hints(cls)
        convs = {
            f.name: c
            for f in dataclasses.fields(cls)
            if (c := _converter(hints[f.name])) is not None
        }

        def fn(body: dict[str, Any], cls: type = cls, convs: dict = convs) -> Any:
            for name, conv in convs.items():
                if name in body:
                    body[name] = conv(body[name])
            return cls(**body)

        _DECODERS[cls] = fn
    return fn


def _converter(hint: Any) -> Callable[[Any], Any] | None:
    """How to rebuild a field of this annotation from JSON, or None when JSON is enough."""
    if hint in _STRUCTS:
        dec = _decoder(hint)
        return lambda v: dec(dict(v))
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1 and (conv := _converter(inner[0])) is not None:
            return _optional(conv)
        return None
    if origin is list and args and (conv := _converter(args[0])) is not None:
        return _each(conv)
    return None


def _optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else conv(v)


def _each(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: [conv(x) for x in v]
