"""The gRPC API on the real processes and the real small model, with a grpc.aio client:
the same tokens as HTTP, concurrency, cancellation and deadlines (blocks freed in the
scheduler), each error status, health and reflection."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from tests.server import Server, running_server
from tests.waiting import wait_until

Code = grpc.StatusCode
TOKEN = "test-admin-token"
ADMIN = (("authorization", f"Bearer {TOKEN}"),)
PROMPT_IDS = [504, 2365, 6354, 16438, 27003, 690, 260, 23790, 3240, 30]
LONG = 600  # max_tokens of a request that is still running when it is cut short
T = TypeVar("T")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with running_server("--grpc-port", "0", "--admin-token", TOKEN) as s:
        assert s.grpc_addr is not None
        yield s


class Stubs:
    """The stubs of one channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.shuttle = pb_grpc.ShuttleStub(channel)
        self.admin = pb_grpc.AdminStub(channel)


def run(server: Server, test: Callable[[Stubs], Awaitable[T]]) -> T:
    async def go() -> T:
        async with grpc.aio.insecure_channel(server.grpc_addr) as channel:  # type: ignore[arg-type]
            return await test(Stubs(channel))

    return asyncio.run(go())


async def generate(stub: pb_grpc.ShuttleStub, **fields: Any) -> list[pb.GenerateResponse]:
    return [r async for r in stub.Generate(pb.GenerateRequest(**fields), timeout=120)]


def stats(server: Server) -> dict[str, Any]:
    r = httpx.get(server.url + "/admin/stats", headers=dict(ADMIN), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def idle_stats(server: Server) -> dict[str, Any] | None:
    """The scheduler's stats if nothing runs or waits and every block is free, else None."""
    s = stats(server)
    idle = s["num_running"] == 0 and s["num_waiting"] == 0
    return s if idle and s["num_free_blocks"] == s["num_total_blocks"] else None


async def until_idle(server: Server) -> dict[str, Any]:
    """The scheduler's stats once nothing runs or waits and every block is free again."""
    return await asyncio.to_thread(
        wait_until, lambda: idle_stats(server), 60, "every block free, nothing running or waiting"
    )


def test_greedy_generate_streams_the_same_tokens_as_http(server: Server) -> None:
    fields = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = run(
        server,
        lambda rpc: generate(
            rpc.shuttle, token_ids=pb.TokenIds(ids=PROMPT_IDS), request_id="parity-1", **fields
        ),
    )
    http = httpx.post(
        server.url + "/v1/completions",
        timeout=120,
        json={"model": server.model, "prompt": PROMPT_IDS, "return_token_ids": True, **fields},
    ).json()
    choice = http["choices"][0]
    assert [t for r in out for t in r.token_ids] == choice["token_ids"]
    assert "".join(r.text for r in out) == choice["text"] and choice["text"]
    assert len(out) > 1 and {r.request_id for r in out} == {"parity-1"}
    last = out[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and choice["finish_reason"] == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT_IDS), 12)
    assert last.system_fingerprint == http["system_fingerprint"] != ""
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in out[:-1])


def test_logprobs_and_prompt_logprobs_equal_http(server: Server) -> None:
    """GenerateRequest.logprobs / prompt_logprobs on the real model: the same entries as
    /v1/completions' `logprobs` and vLLM's `prompt_logprobs` for the same greedy request."""
    fields = dict(max_tokens=5, temperature=0.0, ignore_eos=True, repetition_penalty=1.1)
    out = run(
        server,
        lambda rpc: generate(
            rpc.shuttle, token_ids=pb.TokenIds(ids=PROMPT_IDS), logprobs=3, prompt_logprobs=2,
            **fields,
        ),
    )  # fmt: skip
    body = {"prompt": PROMPT_IDS, "logprobs": 3, "prompt_logprobs": 2, "return_token_ids": True}
    http = httpx.post(
        server.url + "/v1/completions", timeout=120, json={"model": server.model, **body, **fields}
    ).json()
    choice = http["choices"][0]
    entries = [e for r in out for e in r.logprobs]
    assert (
        [e.token_id for e in entries]
        == choice["token_ids"]
        == [t for r in out for t in r.token_ids]
    )
    lp = choice["logprobs"]
    assert [e.token for e in entries] == lp["tokens"]
    for e, value, top in zip(entries, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert abs(e.logprob - value) < 1e-3 and len(e.top_logprobs) == 3
        assert {t.token: pytest.approx(t.logprob, abs=1e-3) for t in e.top_logprobs}.items() <= (
            top.items()
        )
    prompt = [e for r in out for e in r.prompt_logprobs]
    assert [e.token_id for e in prompt] == PROMPT_IDS and not prompt[0].HasField("logprob")
    for e, want in zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True):
        assert abs(e.logprob - want[str(e.token_id)]["logprob"]) < 1e-3
        assert [str(t.token_id) for t in e.top_logprobs] == [
            k
            for k, v in sorted(want.items(), key=lambda kv: kv[1]["logprob"], reverse=True)
            if v["rank"] is not None and v["rank"] <= 2
        ]


def test_16_concurrent_streams_complete(server: Server) -> None:
    async def test(rpc: Stubs) -> list[list[pb.GenerateResponse]]:
        calls = [
            generate(
                rpc.shuttle,
                token_ids=pb.TokenIds(ids=[*PROMPT_IDS, 100 + i]),
                max_tokens=8,
                temperature=0.0,
                ignore_eos=True,
                request_id=f"many-{i}",
            )
            for i in range(16)
        ]
        return list(await asyncio.gather(*calls))

    streams = run(server, test)
    for i, out in enumerate(streams):
        assert {r.request_id for r in out} == {f"many-{i}"}
        assert len([t for r in out for t in r.token_ids]) == 8
        assert out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert out[-1].usage.completion_tokens == 8


def test_client_cancel_frees_the_blocks(server: Server) -> None:
    async def test(rpc: Stubs) -> None:
        call = rpc.shuttle.Generate(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=PROMPT_IDS * 4), max_tokens=LONG, ignore_eos=True
            )
        )
        assert (await call.read()).request_id
        busy = await asyncio.to_thread(stats, server)
        assert busy["num_running"] == 1 and busy["num_free_blocks"] < busy["num_total_blocks"]
        call.cancel()
        await until_idle(server)

    run(server, test)


def test_deadline_frees_the_blocks(server: Server) -> None:
    received: list[pb.GenerateResponse] = []

    async def test(rpc: Stubs) -> None:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=PROMPT_IDS * 4), max_tokens=LONG, ignore_eos=True
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for r in rpc.shuttle.Generate(request, timeout=5.0):
                received.append(r)
        assert info.value.code() == Code.DEADLINE_EXCEEDED
        await until_idle(server)

    run(server, test)
    assert received, "the request should have been running when its deadline passed"
    assert received[-1].finish_reason == pb.FINISH_REASON_UNSPECIFIED


def test_cancel_by_id_ends_the_stream_cancelled(server: Server) -> None:
    async def cancelled_by(
        rpc: Stubs, request_id: str, cancel: Callable[[], Awaitable[Any]]
    ) -> pb.GenerateResponse:
        call = rpc.shuttle.Generate(
            pb.GenerateRequest(
                request_id=request_id,
                text="Count to one thousand:",
                max_tokens=LONG,
                ignore_eos=True,
            ),
            timeout=120,
        )
        last = await call.read()
        await cancel()
        while (r := await call.read()) is not grpc.aio.EOF:  # read() and iteration do not mix
            last = r
        return last

    async def test(rpc: Stubs) -> list[pb.GenerateResponse]:
        by_user = await cancelled_by(
            rpc, "cancel-me", lambda: rpc.shuttle.Cancel(pb.CancelRequest(request_id="cancel-me"))
        )
        by_admin = await cancelled_by(
            rpc,
            "admin-cancels-me",
            lambda: rpc.admin.CancelRequest(
                pb.AdminCancelRequest(request_id="admin-cancels-me"), metadata=ADMIN
            ),
        )
        await until_idle(server)
        return [by_user, by_admin]

    for last in run(server, test):
        assert last.finish_reason == pb.FINISH_REASON_CANCELLED
        assert 0 < last.usage.completion_tokens < LONG


async def _status_of(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


def test_each_error_status(server: Server) -> None:
    async def test(rpc: Stubs) -> dict[str, tuple[grpc.StatusCode, str]]:
        shuttle, admin = rpc.shuttle, rpc.admin
        wrong = (("authorization", "Bearer wrong"),)
        return {
            "bad temperature": await _status_of(generate(shuttle, text="x", temperature=3.0)),
            "bad token id": await _status_of(
                generate(shuttle, token_ids=pb.TokenIds(ids=[1, 10**6]), max_tokens=2)
            ),
            "too long": await _status_of(generate(shuttle, text="x", max_tokens=10**6)),
            "unknown model": await _status_of(generate(shuttle, text="x", model="no-such")),
            "no admin token": await _status_of(admin.ListRequests(pb.ListRequestsRequest())),
            "wrong admin token": await _status_of(
                admin.CancelRequest(pb.AdminCancelRequest(request_id="x"), metadata=wrong)
            ),
            "swap": await _status_of(
                admin.SwapModel(pb.SwapModelRequest(model="/m"), metadata=ADMIN)
            ),
        }

    got = run(server, test)
    assert got["bad temperature"] == (Code.INVALID_ARGUMENT, "temperature: must be <= 2.0, got 3.0")
    code, details = got["bad token id"]  # refused by the tokenizer, after the gateway
    assert code == Code.INVALID_ARGUMENT and details.startswith("token_ids.ids: token id 1000000")
    code, details = got["too long"]
    assert code == Code.INVALID_ARGUMENT and details.startswith("max_tokens: must be <= ")
    assert got["unknown model"] == (Code.NOT_FOUND, "model: the model `no-such` does not exist")
    assert got["no admin token"][0] == got["wrong admin token"][0] == Code.UNAUTHENTICATED
    code, details = got["swap"]  # a folder that is not a model: nothing is loaded
    assert code == Code.NOT_FOUND and "config.json" in details


def test_health_and_reflection(server: Server) -> None:
    async def test(rpc: Stubs) -> tuple[list[int], list[str], list[str]]:
        health = health_pb2_grpc.HealthStub(rpc.channel)
        statuses = [
            (await health.Check(health_pb2.HealthCheckRequest(service=s))).status
            for s in ("", "shuttle.v1.Shuttle", "shuttle.v1.Admin")
        ]
        reflect = reflection_pb2_grpc.ServerReflectionStub(rpc.channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        services: list[str] = []
        async for answer in reflect.ServerReflectionInfo(iter([ask])):
            services = sorted(s.name for s in answer.list_services_response.service)
        models = (await rpc.shuttle.ListModels(pb.ListModelsRequest())).models
        return statuses, services, [m.id for m in models]

    statuses, services, models = run(server, test)
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 3
    assert services == sorted(
        [
            "shuttle.v1.Shuttle",
            "shuttle.v1.Admin",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        ]
    )
    assert models == [server.model]


def test_overload_is_resource_exhausted_and_admin_is_closed_without_token() -> None:
    async def one(rpc: Stubs, i: int) -> tuple[grpc.StatusCode, str]:
        try:
            await generate(
                rpc.shuttle,
                token_ids=pb.TokenIds(ids=[*PROMPT_IDS, i]),
                max_tokens=2,
                ignore_eos=True,
            )
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details()
        return Code.OK, ""

    async def test(rpc: Stubs) -> Any:
        burst = await asyncio.gather(*(one(rpc, i) for i in range(8)))
        closed = await _status_of(rpc.admin.ListRequests(pb.ListRequestsRequest(), metadata=ADMIN))
        return burst, closed

    with running_server("--grpc-port", "0", "--max-waiting", "1", "--max-num-seqs", "1") as s:
        burst, closed = run(s, test)
    codes = [code for code, _ in burst]
    assert Code.OK in codes and Code.RESOURCE_EXHAUSTED in codes, burst
    assert set(codes) <= {Code.OK, Code.RESOURCE_EXHAUSTED}
    assert all("overloaded" in d for c, d in burst if c == Code.RESOURCE_EXHAUSTED)
    assert closed[0] == Code.UNAUTHENTICATED and "no admin token is configured" in closed[1]


def test_structured_outputs_over_grpc(server: Server) -> None:
    """A regex and a JSON schema constrain the output as over HTTP; a bad regex is
    INVALID_ARGUMENT naming the field."""
    import json
    import re

    schema = '{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, ' \
        '"maximum": 9}}, "required": ["n"], "additionalProperties": false}'  # fmt: skip

    async def test(s: Stubs) -> None:
        regex = pb.StructuredOutputs(regex=r"[A-Z]{2}-\d{3}")
        out = await generate(s.shuttle, text="Plate:", max_tokens=12, structured_outputs=regex)
        assert re.fullmatch(r"[A-Z]{2}-\d{3}", "".join(r.text for r in out))
        assert out[-1].finish_reason == pb.FINISH_REASON_STOP
        chat = pb.Chat(messages=[pb.ChatMessage(role="user", content="A number as JSON.")])
        spec = pb.StructuredOutputs(json=schema)
        out = await generate(s.shuttle, chat=chat, max_tokens=20, structured_outputs=spec)
        assert 0 <= json.loads("".join(r.text for r in out))["n"] <= 9
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await generate(s.shuttle, text="x", structured_outputs=pb.StructuredOutputs(regex="a("))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (e.value.details() or "").startswith("structured_outputs.regex: ")

    run(server, test)


def test_a_forced_tool_call_over_grpc(server: Server) -> None:
    """A named function over gRPC: the call comes back on the last message, its arguments
    matching the function's schema, finish reason TOOL_CALLS."""
    import json

    params = '{"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},' \
        ' "required": ["city"], "additionalProperties": false}'  # fmt: skip
    chat = pb.Chat(
        messages=[pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[pb.Tool(name="get_weather", description="The weather", parameters=params)],
        tool_choice="get_weather",
        parallel_tool_calls=False,
    )

    async def test(s: Stubs) -> list[pb.GenerateResponse]:
        return await generate(s.shuttle, chat=chat, max_tokens=40, temperature=0.0)

    out = run(server, test)
    (call,) = out[-1].tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert isinstance(json.loads(call.arguments)["city"], str)
    assert out[-1].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert "".join(r.text for r in out) == ""
