"""A request body parsed against its pydantic model, and what is wrong with it in words:
every refusal is a `RequestRejected` whose message starts with the field it names
("messages[0].role: must be one of ..."), with the HTTP status the gateway answers."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError


class RequestRejected(Exception):
    """A request the gateway refuses with `status`; `message` starts with the field it names."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status


R = TypeVar("R", bound=BaseModel)


def parse_request(cls: type[R], body: bytes, context: dict[str, Any] | None = None) -> R:
    """Validate a JSON body; raise RequestRejected naming the first offending field.
    `context`: what the server is set up to do (`scheduling_policy`)."""
    try:
        return cls.model_validate_json(body, context=context)
    except ValidationError as e:
        raise _rejection(e) from None


def validate_request(
    cls: type[R], data: dict[str, Any], context: dict[str, Any] | None = None
) -> R:
    """Validate a body already decoded (the gRPC front end builds it from a proto message)
    by the same rules and with the same messages as `parse_request`."""
    try:
        return cls.model_validate(data, context=context)
    except ValidationError as e:
        raise _rejection(e) from None


def _rejection(e: ValidationError) -> RequestRejected:
    errors = e.errors(include_url=False)
    message, param = describe_error(errors[0])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return RequestRejected(message, param)


def field_path(loc: tuple[Any, ...]) -> str:
    """("messages", 0, "role") -> "messages[0].role"."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}" if path else str(part)
    return path


def describe_error(error: Any) -> tuple[str, str | None]:
    """One pydantic error as ("<field>: <what is wrong>", field)."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "json_invalid":
        return f"body: is not valid JSON ({ctx.get('error', '')})", None
    param = field_path(error["loc"]) or None
    what = _WHAT.get(kind)
    text = what.format(**ctx) if what else error["msg"]
    if kind in _SHOW_INPUT:
        text += f", got {_json_repr(error.get('input'))}"
    return f"{param or 'body'}: {text}", param


_WHAT = {
    "missing": "is required",
    "greater_than_equal": "must be >= {ge}",
    "greater_than": "must be > {gt}",
    "less_than_equal": "must be <= {le}",
    "less_than": "must be < {lt}",
    "int_type": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be a boolean",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "model_type": "must be a JSON object",
    "dict_type": "must be a JSON object",
    "finite_number": "must be a finite number",
    "literal_error": "must be one of {expected}",
    "too_short": "must have at least {min_length} item(s)",
    "too_long": "must have at most {max_length} item(s)",
}
_SHOW_INPUT = set(_WHAT) - {"missing", "too_short", "too_long"}


def _json_repr(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, str):
        return f"string {value[:40]!r}"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return repr(value)
