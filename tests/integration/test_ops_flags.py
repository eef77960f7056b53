"""Operator flags on the real processes (the synthetic model: the plumbing, not the model,
matters): --chat-template and a request's chat_template / chat_template_kwargs rendered by a
tokenizer process, --metrics-vllm-names on GET /metrics, and gRPC Generate with n, priority,
timeout and return_token_ids."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from tests.server import Server, running_server
from tests.unit.services.gateway.http.test_metrics import VLLM_DASHBOARD_SERIES

TEMPLATE = (
    "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    "{% if thinking is not defined or thinking %} [think]{% endif %}"
)
CHAT = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    folder = Path(tempfile.mkdtemp(prefix="shuttle-template-"))
    (folder / "template.jinja").write_text(TEMPLATE)
    flags = (
        "--model",
        "synthetic",
        "--chat-template",
        str(folder / "template.jinja"),
        "--trust-request-chat-template",
        "--metrics-vllm-names",
        "--grpc-port",
        "0",
    )
    with running_server(*flags) as s:
        assert s.grpc_addr is not None
        yield s


def _count(client: httpx.Client, text: str) -> int:
    r = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _prompt_tokens(client: httpx.Client, server: Server, **extra: Any) -> int:
    body = {"model": server.model, "messages": CHAT, "max_tokens": 1} | extra
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens"])


def test_chats_render_with_the_operators_template_and_the_requests(server: Server) -> None:
    with server.client() as c:
        r = c.post("/tokenize", json={"messages": CHAT, "add_special_tokens": False})
        assert (
            r.json()["tokens"]
            == c.post(
                "/tokenize", json={"prompt": "<<hello there>> [think]", "add_special_tokens": False}
            ).json()["tokens"]
        )
        assert _prompt_tokens(c, server) == _count(c, "<<hello there>> [think]")
        no_thinking = _prompt_tokens(c, server, chat_template_kwargs={"thinking": False})
        assert no_thinking == _count(c, "<<hello there>>")
        own = "{{ messages[0]['content'] * 3 }}"
        assert _prompt_tokens(c, server, chat_template=own) == _count(c, "hello there" * 3)


def test_grpc_generate_with_n_priority_timeout_and_no_token_ids(server: Server) -> None:
    async def go() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(server.grpc_addr) as channel:  # type: ignore[arg-type]
            request = pb.GenerateRequest(
                text="hello",
                n=2,
                max_tokens=5,
                ignore_eos=True,
                priority=0,
                timeout=60.0,
                return_token_ids=False,
            )
            stub = pb_grpc.ShuttleStub(channel)
            return [r async for r in stub.Generate(request, timeout=120)]

    out = asyncio.run(go())
    assert {r.index for r in out} == {0, 1}
    assert all(not r.token_ids for r in out)
    finished = {r.index: r for r in out if r.finish_reason}
    assert set(finished) == {0, 1}
    assert all(f.finish_reason == pb.FINISH_REASON_LENGTH for f in finished.values())
    assert all(f.usage.completion_tokens == 5 for f in finished.values())


def test_metrics_carry_vllms_names(server: Server) -> None:
    with server.client() as c:  # at least one request has finished (the other tests too)
        body = {"model": server.model, "prompt": "hi", "max_tokens": 2}
        assert c.post("/v1/completions", json=body).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    series = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = [name for name in VLLM_DASHBOARD_SERIES if name not in series]
    assert not missing, missing
    assert not any(name.startswith("shuttle:") for name in series)


def test_grpc_chat_with_template_kwargs(server: Server) -> None:
    from google.protobuf.struct_pb2 import Struct

    kwargs = Struct()
    kwargs.update({"thinking": False})
    chat = pb.Chat(messages=[pb.ChatMessage(**m) for m in CHAT], chat_template_kwargs=kwargs)

    async def go() -> list[pb.GenerateResponse]:
        async with grpc.aio.insecure_channel(server.grpc_addr) as channel:  # type: ignore[arg-type]
            request = pb.GenerateRequest(chat=chat, max_tokens=1)
            return [r async for r in pb_grpc.ShuttleStub(channel).Generate(request, timeout=120)]

    out = asyncio.run(go())
    with server.client() as c:
        assert out[-1].usage.prompt_tokens == _count(c, "<<hello there>>")


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
]
# a request's tool-aware template (the Hugging Face way: it reads `tools`)
TOOL_TEMPLATE = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{{ messages[-1].content }}"


def test_tools_render_by_the_template_that_can_else_are_a_400(server: Server) -> None:
    with server.client() as c:
        # the operator's template has no tool support: the built-in prompt's system turn
        r = c.post(
            "/tokenize", json={"messages": CHAT, "tools": TOOLS, "add_special_tokens": False}
        )
        text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text.startswith("<<# Tools") and '"name":"get_weather"' in text
        assert text.endswith("<<hello there>> [think]")
        own = _prompt_tokens(c, server, tools=TOOLS, chat_template=TOOL_TEMPLATE)
        assert own == _count(c, "[get_weather]hello there")
        # a template that shows the model neither the tool list nor a system turn
        drops = "{% for m in messages if m.role != 'system' %}{{ m.content }}{% endfor %}"
        body = {"messages": CHAT, "max_tokens": 1, "tools": TOOLS, "chat_template": drops}
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "tools" and "get_weather" in r.text
        assert _prompt_tokens(c, server) == _count(c, "<<hello there>> [think]")  # serving on
