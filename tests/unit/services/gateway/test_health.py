"""What the health endpoints answer across a gateway's life, with the real ZmqEngineClient:
starting (503 / NOT_SERVING), serving (200 / SERVING), draining (503 / NOT_SERVING again).
Kubernetes' readiness probe reads /health and its startup probe the gRPC health service
(deploy/kubernetes): a draining pod must stop looking ready on both, at once."""

from __future__ import annotations

import asyncio

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.config import SchedulerConfig, ServerConfig
from services.gateway.engine.zmq_client import ZmqEngineClient
from services.gateway.grpc.server import GrpcGateway
from services.gateway.http.app import create_app
from tests.unit.services.gateway.engine.test_zmq_client import make_client, model_changed
from tests.unit.services.gateway.http.test_app import CHAT, chat_body
from tests.waiting import wait_until_async

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _answers(
    engine: ZmqEngineClient, http: httpx.AsyncClient, health: health_pb2_grpc.HealthStub
) -> tuple[int, int, int, int]:
    """(/health, /ping, a chat request's status (0 when ready: not sent), the gRPC health
    status) once the gRPC health poller has caught up with `engine.is_ready()`."""
    want = SERVING if engine.is_ready() else NOT_SERVING

    async def grpc_status() -> int:
        return (await health.Check(health_pb2.HealthCheckRequest(service=""))).status

    async def caught_up() -> bool:
        return await grpc_status() == want

    await wait_until_async(caught_up, 10, f"gRPC health to say {want}")
    chat = 0  # a request taken while ready would wait on the fake outboxes for ever
    if not engine.is_ready():
        chat = (await http.post(CHAT, json=chat_body(model="m"))).status_code
    return (
        (await http.get("/health")).status_code,
        (await http.get("/ping")).status_code,
        chat,
        await grpc_status(),
    )


def test_health_is_503_and_not_serving_while_starting_and_draining() -> None:
    engine, _, _ = make_client()

    async def go() -> list[tuple[int, int, int, int]]:
        server = ServerConfig(host="127.0.0.1", grpc_port=0)
        gateway = GrpcGateway(engine, server, SchedulerConfig(), health_poll_s=0.02)
        port = await gateway.start()
        transport = httpx.ASGITransport(app=create_app(engine, server))
        try:
            async with (
                httpx.AsyncClient(transport=transport, base_url="http://test") as http,
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel,
            ):
                health = health_pb2_grpc.HealthStub(channel)
                seen = [await _answers(engine, http, health)]  # starting: no model yet
                engine.on_model_changed(model_changed("v1"))
                seen.append(await _answers(engine, http, health))  # serving
                engine.draining = True  # what the gateway does on Drain or SIGTERM
                seen.append(await _answers(engine, http, health))
                return seen
        finally:
            await gateway.stop(grace=0)

    starting, serving, draining = asyncio.run(go())
    assert starting == (503, 503, 503, NOT_SERVING)
    assert serving == (200, 200, 0, SERVING)
    assert draining == (503, 503, 503, NOT_SERVING)
