"""Structured outputs through the real server with the real `openai` client: pydantic models
parsed by `client.beta.chat.completions.parse` (streamed and not, n = 3, side by side with
free requests), vLLM's regex / choice / grammar fields, and the 400s for bad specs. Every
JSON output is validated against its schema with `jsonschema`."""

from __future__ import annotations

import concurrent.futures
import enum
import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server import Server

MAX_TOKENS = 120


# twenty-odd schemas: nested objects, arrays, enums, bounded numbers, optional fields, anyOf.
# Strings and arrays are bounded so a 135M model cannot ramble past max_tokens.
Short = Field(max_length=12)


class Colour(enum.StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Short
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


class Line(BaseModel):
    start: Point
    end: Point


class Palette(BaseModel):
    colours: list[Colour] = Field(min_length=1, max_length=3)


class Rating(BaseModel):
    stars: int = Field(ge=1, le=5)
    score: float = Field(ge=0.0, le=1.0)


class Flag(BaseModel):
    enabled: bool


class Book(BaseModel):
    title: str = Short
    year: int = Field(ge=1900, le=2030)
    genre: Literal["fiction", "science", "history"]


class Library(BaseModel):
    books: list[Book] = Field(min_length=1, max_length=2)


class OptionalNote(BaseModel):
    note: str | None = Short
    priority: int | None = Field(default=None, ge=0, le=9)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    name: str = Short


class Owner(BaseModel):
    owner: Person
    pet: Pet


class Tags(BaseModel):
    tags: list[str] = Field(max_length=3)


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)
    unit: Literal["C"]


class Cat(BaseModel):
    kind: Literal["cat"]
    lives: int = Field(ge=1, le=9)


class Dog(BaseModel):
    kind: Literal["dog"]
    good: bool


class Animal(BaseModel):
    animal: Cat | Dog  # anyOf


class IdOrName(BaseModel):
    key: int | str = Field(union_mode="left_to_right")  # anyOf of scalars


Digit = Annotated[int, Field(ge=0, le=9)]


class Matrix(BaseModel):
    rows: list[Annotated[list[Digit], Field(min_length=1, max_length=3)]] = Field(max_length=2)


class Address(BaseModel):
    street: str = Short
    number: int = Field(ge=1, le=999)


class Company(BaseModel):
    name: str = Short
    address: Address
    employees: int = Field(ge=1, le=10000)


class Traffic(BaseModel):
    light: Colour
    seconds: int = Field(ge=0, le=99)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: float = Field(ge=0, le=1)


class Inventory(BaseModel):
    items: list[Pet] = Field(max_length=2)
    total: int = Field(ge=0, le=50)


class Event(BaseModel):
    name: str = Short
    attendees: list[Person] = Field(max_length=2)
    tag: Colour | None = None


SCHEMAS: list[type[BaseModel]] = [
    Person, Point, Line, Palette, Rating, Flag, Book, Library, OptionalNote, Pet, Owner, Tags,
    Temperature, Animal, IdOrName, Matrix, Company, Traffic, Answer, Inventory, Event,
]  # fmt: skip


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=300, max_retries=0)


def _messages(model: type[BaseModel]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Reply with a {model.__name__} as JSON."}]


def _check(model: type[BaseModel], content: str | None, parsed: Any) -> None:
    assert content is not None
    jsonschema.validate(json.loads(content), model.model_json_schema())
    assert isinstance(parsed, model), content


def _parse(server: Server, model: type[BaseModel], **kw: Any) -> None:
    completion = _client(server).beta.chat.completions.parse(
        model=server.model,
        messages=_messages(model),  # type: ignore[arg-type]
        response_format=model,
        max_tokens=MAX_TOKENS,
        **kw,
    )
    assert len(completion.choices) == kw.get("n", 1)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", choice.message.content
        _check(model, choice.message.content, choice.message.parsed)


def _free(server: Server) -> str:
    out = _client(server).chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=24,
        temperature=0.0,
    )
    return out.choices[0].message.content or ""


def test_parse_twenty_schemas_in_a_batch_with_free_requests(server: Server) -> None:
    """Every schema at once (greedy), with free requests in the same batches."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        free = [pool.submit(_free, server) for _ in range(3)]
        jobs = {m.__name__: pool.submit(_parse, server, m, temperature=0.0) for m in SCHEMAS}
        failed = {name: job.exception() for name, job in jobs.items() if job.exception()}
        assert not failed, failed
        assert all(f.result() for f in free)


@pytest.mark.parametrize("model", [Company, Animal, Library])
def test_parse_n3_sampled(server: Server, model: type[BaseModel]) -> None:
    """n = 3 sampled sequences, each with its own matcher."""
    _parse(server, model, n=3, temperature=1.0, seed=7)


@pytest.mark.parametrize("model", [Owner, Event, Rating])
def test_parse_streamed(server: Server, model: type[BaseModel]) -> None:
    with _client(server).beta.chat.completions.stream(
        model=server.model,
        messages=_messages(model),  # type: ignore[arg-type]
        response_format=model,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
    ) as stream:
        for _ in stream:
            pass
        completion = stream.get_final_completion()
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    _check(model, choice.message.content, choice.message.parsed)


def test_json_object_on_completions_and_chat(server: Server) -> None:
    client = _client(server)
    chat = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0.0,
    )
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    schema = Point.model_json_schema()
    done = client.completions.create(
        model=server.model,
        prompt="A point as JSON: ",
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {
            "name": "point", "schema": schema, "strict": True}}},
    )  # fmt: skip
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_regex_choice_and_grammar(server: Server) -> None:
    client = _client(server)
    regex = r"[A-Z]{2}-\d{3}"
    for body in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        out = client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "A licence plate:"}],
            max_tokens=20,
            temperature=1.0,
            n=3,
            extra_body=body,
        )
        for choice in out.choices:
            assert re.fullmatch(regex, choice.message.content or ""), choice.message.content
    choices = ["yes", "no", "perhaps"]
    for body in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        text = client.completions.create(
            model=server.model, prompt="Is water wet?", max_tokens=10, extra_body=body
        )
        assert text.choices[0].text in choices
    grammar = 'root ::= "I like " fruit "."\nfruit ::= "apples" | "pears"'
    out = client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Which fruit?"}],
        max_tokens=20,
        extra_body={"guided_grammar": grammar},
    )
    assert out.choices[0].message.content in ("I like apples.", "I like pears.")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs.grammar"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}},
                        },
                    },
                }
            },  # fmt: skip
            "response_format.json_schema.schema",
        ),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"guided_json": {"type": "object"}, "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_specs_are_400s_naming_the_field(
    server: Server, body: dict[str, Any], field: str
) -> None:
    with server.client() as http:
        for stream in (False, True):
            reply = http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "stream": stream,
                    **body,
                },  # fmt: skip
            )
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == field and error["message"].startswith(field + ":"), error
