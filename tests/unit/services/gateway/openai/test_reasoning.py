"""Reasoning parsers (services/gateway/openai/reasoning.py): whole outputs, streams split at any
character, the detokenizer's text of a test-built tokenizer with think tags, and the chat
and Responses answers of the real app with --reasoning-parser over the scripted engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer

from common.config import ServerConfig
from common.messages import FinishReason
from services.detokenizer.incremental import IncrementalDetokenizer
from services.gateway.engine.client import OutputDelta
from services.gateway.http.app import create_app
from services.gateway.openai.reasoning import ReasoningStream, split_reasoning
from tests.fake_engine import FakeEngine
from tests.sse_events import parse_sse
from tests.tiny_models import make_own_vocab_tokenizer

THOUGHT = "<think>\nThe user asks about France.\n</think>\n\nParis."


def test_whole_outputs() -> None:
    assert split_reasoning(THOUGHT, "deepseek_r1") == (
        "\nThe user asks about France.\n",
        "\n\nParis.",
    )
    assert split_reasoning(THOUGHT, "qwen3") == ("\nThe user asks about France.\n", "\n\nParis.")
    # the template opened <think> in the prompt: the output starts inside it
    assert split_reasoning("hmm</think>Paris", "deepseek_r1") == ("hmm", "Paris")
    # cut off while thinking / thinking switched off
    assert split_reasoning("<think>hmm", "deepseek_r1") == ("hmm", "")
    assert split_reasoning("Paris.", "deepseek_r1") == ("Paris.", "")
    assert split_reasoning("Paris.", "qwen3") == (None, "Paris.")


def _stream(pieces: list[str], parser: str) -> tuple[str, str]:
    split = ReasoningStream(parser)
    thought, answer = "", ""
    for k, piece in enumerate(pieces):
        t, a = split.feed(piece, final=k == len(pieces) - 1)
        thought, answer = thought + t, answer + a
    return thought, answer


@pytest.mark.parametrize("parser", ["deepseek_r1", "qwen3"])
def test_a_stream_split_at_every_character_equals_the_whole(parser: str) -> None:
    whole = split_reasoning(THOUGHT, parser)
    assert _stream(list(THOUGHT), parser) == whole
    assert _stream([THOUGHT[:3], THOUGHT[3:20], THOUGHT[20:]], parser) == whole
    assert _stream(list("Paris."), "qwen3") == ("", "Paris.")


def test_think_tags_of_a_test_built_tokenizer_come_through_the_detokenizer(tmp_path: Path) -> None:
    folder = make_own_vocab_tokenizer(tmp_path / "tok", vocab_size=300)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(
        [AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)]
    )
    ids = tokenizer.encode("<think>the fox</think>The dog").ids
    assert tokenizer.token_to_id("<think>") in ids and tokenizer.token_to_id("</think>") in ids
    detok = IncrementalDetokenizer(tokenizer)
    split = ReasoningStream("qwen3")
    thought, answer = "", ""
    for k, token in enumerate(ids):
        text, _ = detok.add([token], final=k == len(ids) - 1)
        t, a = split.feed(text, final=k == len(ids) - 1)
        thought, answer = thought + t, answer + a
    assert (thought.strip(), answer.strip()) == ("the fox", "The dog")


def _post(url: str, body: dict[str, Any], script: list[OutputDelta]) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(FakeEngine(script), ServerConfig(reasoning_parser="deepseek_r1"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(url, json=body)

    return asyncio.run(go())


SCRIPT = [
    OutputDelta("<think>a b", [7], FinishReason.NONE, 5, 1, last=False),
    OutputDelta(" c</thi", [7], FinishReason.NONE, 5, 2, last=False),
    OutputDelta("nk>Paris", [7], FinishReason.STOP, 5, 3, last=True),
]
CHAT = {"messages": [{"role": "user", "content": "Capital of France?"}]}


def test_chat_reasoning_content() -> None:
    out = _post("/v1/chat/completions", CHAT, SCRIPT).json()
    assert out["choices"][0]["message"] == {
        "role": "assistant", "content": "Paris", "reasoning_content": "a b c",
    }  # fmt: skip
    events = parse_sse(_post("/v1/chat/completions", CHAT | {"stream": True}, SCRIPT).content)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if isinstance(e, dict)]
    thought = "".join(d.get("reasoning_content", "") for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert (thought, answer) == ("a b c", "Paris")


def test_responses_reasoning_item() -> None:
    out = _post("/v1/responses", {"input": "Capital of France?"}, SCRIPT).json()
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "a b c"}]
    assert message["content"][0]["text"] == "Paris"
    events = parse_sse(_post("/v1/responses", {"input": "x", "stream": True}, SCRIPT).content)
    kinds = [e["type"] for e in events if isinstance(e, dict)]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.completed"


def test_a_structured_output_waits_for_the_reasoning_to_end() -> None:
    body = CHAT | {"response_format": {"type": "json_object"}}
    engine = FakeEngine(SCRIPT)

    async def go(parser: str) -> None:
        app = create_app(engine, ServerConfig(reasoning_parser=parser))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            assert (await client.post("/v1/chat/completions", json=body)).is_success

    asyncio.run(go("qwen3"))
    asyncio.run(go(""))
    with_parser, without = (r.sampling for r in engine.requests)
    assert (
        with_parser.structured_kind == "json_object" and with_parser.structured_after == "</think>"
    )
    assert without.structured_after == ""


def test_a_responses_stream_sends_the_reasoning_then_the_message_as_they_come() -> None:
    import openai

    async def go() -> tuple[list[Any], Any]:
        app = create_app(FakeEngine(SCRIPT), ServerConfig(reasoning_parser="deepseek_r1"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test/v1") as http:
            client = openai.AsyncOpenAI(
                base_url="http://test/v1", api_key="x", http_client=http, max_retries=0
            )
            async with client.responses.stream(model="test-model", input="x") as stream:
                events = [e async for e in stream]
                return events, await stream.get_final_response()

    events, final = asyncio.run(go())
    deltas = [
        (e.type, e.output_index, e.delta)
        for e in events
        if e.type in ("response.reasoning_text.delta", "response.output_text.delta")
    ]
    assert deltas == [
        ("response.reasoning_text.delta", 0, "a b"),
        ("response.reasoning_text.delta", 0, " c"),
        ("response.output_text.delta", 1, "Paris"),
    ]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == "Paris"
