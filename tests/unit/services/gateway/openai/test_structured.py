"""The gateway's reading of the structured-output fields (services/gateway/openai/
structured.py): one grammar spec per request, or a refusal naming the field."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from services.gateway.openai.structured import StructuredError, parse_structured

# --- the gateway's fields ---------------------------------------------------------------------
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "kind", "field"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },  # fmt: skip
            "json",
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, "json", "structured_outputs.json"),
        ({"structured_outputs": {"regex": "a+"}}, "regex", "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", "structured_outputs.choice"),
        (
            {"structured_outputs": {"grammar": "root ::= 'a'"}},
            "grammar",
            "structured_outputs.grammar",
        ),  # fmt: skip
        (
            {"structured_outputs": {"json_object": True}},
            "json_object",
            "structured_outputs.json_object",
        ),  # fmt: skip
        ({"guided_json": orjson.dumps(SCHEMA).decode()}, "json", "guided_json"),
        ({"guided_regex": "a+"}, "regex", "guided_regex"),
        ({"guided_choice": ["a", "b"]}, "choice", "guided_choice"),
        ({"guided_grammar": "root ::= 'a'"}, "grammar", "guided_grammar"),
    ],
)
def test_each_field_gives_one_grammar(body: dict[str, Any], kind: str, field: str) -> None:
    got = parse_structured(body)
    assert got is not None and (got.kind, got.field) == (kind, field)
    if kind == "json":
        assert orjson.loads(got.spec) == SCHEMA


def test_free_text_asks_for_nothing() -> None:
    assert parse_structured({}) is None
    assert parse_structured({"response_format": {"type": "text"}}) is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format.json_schema.schema",
        ),  # fmt: skip
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": [1]}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"structured_outputs": {"regex": "a", "flavour": 1}}, "structured_outputs.flavour"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}},
            "response_format.json_schema.x",
        ),  # fmt: skip
    ],
)
def test_bad_shapes_name_the_field(body: dict[str, Any], field: str) -> None:
    with pytest.raises(StructuredError) as e:
        parse_structured(body)
    assert e.value.field == field and str(e.value).startswith(field + ": ")
