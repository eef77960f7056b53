"""OpenAPI request bodies for routes that parse their raw body themselves.

The generate routes read `await request.body()` and validate it with the pydantic models in
protocol.py (strict types, OpenAI-shaped errors), so FastAPI cannot see their bodies. Their
schemas are declared here instead, from the same models, so /openapi.json describes what
the routes accept (clients and fuzzers such as schemathesis read it).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from common.limits import MAX_PROMPTS

_TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
_TEXT = {"type": "string", "minLength": 1}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": _TOKEN_ID}
# fields typed loosely in the models (a validator parses them) and precisely here
_PRECISE = {
    "prompt": {
        "anyOf": [
            _TEXT,
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": _TEXT},
            {"type": "array", "minItems": 1, "maxItems": MAX_PROMPTS, "items": _TOKEN_IDS},
        ],
        "description": "a string, a list of token ids, or a batch: a list of either",
    },
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    schema = _inline(model.model_json_schema(mode="validation"))
    props = schema.get("properties", {})
    props.update({k: v for k, v in _PRECISE.items() if k in props})
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with its `$defs` references replaced by the definitions (ours are not
    recursive), since an operation's schema cannot point into a `$defs` of its own."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                rest = {k: v for k, v in node.items() if k != "$ref"}
                return resolve({**defs[ref.removeprefix("#/$defs/")], **rest})
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)
