"""The gateway's gRPC front end: shuttle.v1.Shuttle and shuttle.v1.Admin over an
`EngineClient`, with grpc.health.v1 and server reflection, on a grpc.aio server that runs in
the gateway's event loop beside uvicorn and the ZeroMQ inbox.

    client ──Generate──▶ ShuttleServicer ──engine.generate()──▶ deltas ──write──▶ client
              cancel / deadline ─▶ handler task cancelled ─▶ finally: deltas.aclose()
                                                              └─▶ Abort to the scheduler

A request ends in the engine whenever its call ends: grpc.aio cancels the handler's task when
the client cancels or its deadline passes, and the handler's `finally` closes the engine's
iterator, which sends the Abort (ZmqEngineClient.generate). The handler is a coroutine that
writes with `context.write`, not an async generator, so that `finally` runs at once rather
than whenever the garbage collector finalises a suspended generator.

Health: "", "shuttle.v1.Shuttle" and "shuttle.v1.Admin" report SERVING while
`engine.is_ready()`, NOT_SERVING otherwise (polled every `health_poll_s`), and NOT_SERVING
for good once the server is stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.config import SchedulerConfig, ServerConfig
from proto import shuttle_pb2 as pb
from proto import shuttle_pb2_grpc as pb_grpc
from services.gateway.admin_auth import (
    check_admin_token,
    resolve_adapter_folder,
    resolve_model_folder,
)
from services.gateway.engine.client import EngineClient, OutputDelta, RequestFailed
from services.gateway.engine.embed import embed
from services.gateway.grpc.convert import (
    check_request_id,
    rename_field,
    renames_for,
    request_id_of,
    status_code,
    to_generate_request,
    to_response,
    tool_plan_of,
    wants_token_ids,
)
from services.gateway.grpc.embed import RENAMES as EMBED_RENAMES
from services.gateway.grpc.embed import (
    embed_request_id,
    to_embed_response,
    to_embedding_request,
    to_engine_requests,
)
from services.gateway.openai.request_errors import RequestRejected
from services.gateway.openai.tool_stream import ToolStream
from services.gateway.openai.tools import ToolPlan

log = logging.getLogger("shuttle.gateway.grpc")

SHUTTLE_SERVICE = pb.DESCRIPTOR.services_by_name["Shuttle"].full_name
ADMIN_SERVICE = pb.DESCRIPTOR.services_by_name["Admin"].full_name
SERVICE_NAMES = (SHUTTLE_SERVICE, ADMIN_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
REQUEST_ID_METADATA = "x-request-id"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

M = TypeVar("M")


class GrpcError(Exception):
    """End the call with this status."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _statuses(
    method: Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[M]],
) -> Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[M]]:
    """Turn a handler's refusals into call statuses; an unexpected error is INTERNAL."""

    @functools.wraps(method)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> M:
        try:
            return await method(self, request, context)
        except grpc.aio.BaseError:  # context.abort() and friends: already a status
            raise
        except GrpcError as e:
            code, message = e.code, e.message
        except (RequestRejected, RequestFailed) as e:
            code, message = status_code(e.status), e.message
        except Exception:
            log.exception("%s failed", method.__name__)
            code, message = grpc.StatusCode.INTERNAL, "internal error"
        await context.abort(code, message)
        raise AssertionError("unreachable: context.abort() raises")

    return handler


def _authorization(context: grpc.aio.ServicerContext) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value if isinstance(value, str) else None
    return None


class ShuttleServicer(pb_grpc.ShuttleServicer):
    """shuttle.v1.Shuttle: Generate, Cancel, ListModels; wants the API key when one is set."""

    def __init__(
        self,
        engine: EngineClient,
        api_key: str | None = None,
        context: dict[str, Any] | None = None,
        *,
        pooling: str = "last",
        embedding_normalize: bool = True,
    ) -> None:
        self.engine = engine
        self._expected = f"Bearer {api_key}".encode() if api_key else None
        self.context = context  # what request validation needs to know (as HTTP's)
        self.pooling, self.embedding_normalize = pooling, embedding_normalize  # (Embed)

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if self._expected is None:
            return
        got = (_authorization(context) or "").encode()
        if not hmac.compare_digest(got, self._expected):  # constant time
            raise GrpcError(
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid or missing API key; send 'authorization: Bearer <key>'",
            )

    @_statuses
    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        self._authorize(context)
        renames = renames_for(request)
        try:
            request_id = request_id_of(request)
            generate = to_generate_request(request, request_id, self.engine, self.context)
            tools = tool_plan_of(request, self.context)
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            deltas = self.engine.generate(generate)
            await self._stream(
                generate.request_id, deltas, context, wants_token_ids(request), tools
            )
        except (RequestRejected, RequestFailed) as e:
            message = rename_field(e.message, e.param, renames)
            raise GrpcError(status_code(e.status), message) from None

    async def _stream(
        self,
        request_id: str,
        deltas: AsyncGenerator[OutputDelta, None],
        context: grpc.aio.ServicerContext,
        with_token_ids: bool,
        tools: ToolPlan | None = None,
    ) -> None:
        # the version that serves the request, as its deltas name it (a swap may have
        # changed the served one since the call began); the served one if they never do
        version = ""
        streams: dict[int, ToolStream] = {}  # with tools: each sequence's held-back calls
        try:
            async for delta in deltas:
                version = delta.version or version
                fingerprint = version or self.engine.system_fingerprint
                stream = None
                if tools is not None:
                    stream = streams.setdefault(delta.index, ToolStream(tools))
                response = to_response(request_id, delta, fingerprint, with_token_ids, stream)
                await context.write(response)
                if delta.last:  # every sequence has finished (n = 1: this one)
                    return
            raise RequestFailed(500, "the engine ended the stream without a finish reason")
        finally:
            # cancelled (client gone, deadline) or failed: closing aborts it in the engine;
            # after a finish this is a no-op
            await deltas.aclose()

    @_statuses
    async def Cancel(
        self, request: pb.CancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.CancelResponse:
        self._authorize(context)
        check_request_id(request.request_id)
        await self.engine.abort(request.request_id)
        return pb.CancelResponse()

    @_statuses
    async def ListModels(
        self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListModelsResponse:
        """One model per name the served model answers to; none while starting, as HTTP's
        /v1/models lists none until a model is served."""
        self._authorize(context)
        engine = self.engine
        models = [
            pb.Model(id=name, max_model_len=engine.max_model_len, version=engine.system_fingerprint)
            for name in engine.model_names
        ]
        if models:  # then the LoRA adapters, as /v1/models lists them
            models += [
                pb.Model(
                    id=name,
                    max_model_len=engine.max_model_len,
                    version=engine.system_fingerprint,
                    parent=engine.model_name,
                    root=path,
                )
                for name, path in engine.lora_adapters.items()
            ]
        return pb.ListModelsResponse(models=models)

    @_statuses
    async def Embed(
        self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> pb.EmbedResponse:
        """POST /v1/embeddings' twin (services/gateway/engine/embed.py): every input in
        flight at once; a cancelled call aborts them all."""
        self._authorize(context)
        try:
            request_id = embed_request_id(request)
            body = to_embedding_request(request, self.engine, self.context)
            requests = to_engine_requests(body, request_id, self.engine, self.pooling)
            await context.send_initial_metadata(((REQUEST_ID_METADATA, request_id),))
            done = await embed(self.engine, requests, "input")
        except (RequestRejected, RequestFailed) as e:
            message = rename_field(e.message, e.param, EMBED_RENAMES)
            raise GrpcError(status_code(e.status), message) from None
        model = self.engine.model_name
        return to_embed_response(request_id, model, body, done, self.embedding_normalize)


class AdminServicer(pb_grpc.AdminServicer):
    """shuttle.v1.Admin, behind the admin token (refused entirely when none is configured)."""

    def __init__(
        self, engine: EngineClient, admin_token: str | None, model_root: str | None = None
    ) -> None:
        self.engine = engine
        self.admin_token = admin_token
        self.model_root = model_root

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        why = check_admin_token(_authorization(context), self.admin_token)
        if why is not None:
            raise GrpcError(grpc.StatusCode.UNAUTHENTICATED, why)

    @_statuses
    async def SwapModel(
        self, request: pb.SwapModelRequest, context: grpc.aio.ServicerContext
    ) -> pb.SwapModelResponse:
        self._authorize(context)
        try:
            path = resolve_model_folder(request.model, self.model_root)
        except RequestRejected as e:
            raise GrpcError(status_code(e.status), e.message) from None
        mode = "drain" if request.mode == pb.SWAP_MODE_DRAIN else "overlap"
        result = await self.engine.swap_model(str(path), request.version, mode)
        if not result.ok:
            code = (
                grpc.StatusCode.FAILED_PRECONDITION
                if "in progress" in result.error
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            raise GrpcError(code, f"SwapModel: {result.error}; the served model is unchanged")
        return pb.SwapModelResponse(
            version=result.version, previous_version=result.previous_version
        )

    @_statuses
    async def LoadLoraAdapter(
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoraAdapterResponse:
        self._authorize(context)
        self._lora_enabled()
        try:
            if request.lora_name in self.engine.model_names:
                raise RequestRejected(f"lora_name: `{request.lora_name}` is the base model's name")
            path = resolve_adapter_folder(request.lora_path, self.model_root)
        except RequestRejected as e:
            raise GrpcError(status_code(e.status), e.message) from None
        result = await self.engine.load_lora(request.lora_name, str(path))
        if result.status != 200:
            raise GrpcError(status_code(result.status), f"LoadLoraAdapter: {result.error}")
        return pb.LoadLoraAdapterResponse(weights_hash=result.weights_hash, rank=result.rank)

    @_statuses
    async def UnloadLoraAdapter(
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        self._authorize(context)
        self._lora_enabled()
        result = await self.engine.unload_lora(request.lora_name)
        if result.status != 200:
            raise GrpcError(status_code(result.status), f"UnloadLoraAdapter: {result.error}")
        return pb.UnloadLoraAdapterResponse()

    def _lora_enabled(self) -> None:
        if not self.engine.lora_enabled:
            raise GrpcError(
                grpc.StatusCode.NOT_FOUND,
                "LoRA adapters are not enabled on this server (start it with --enable-lora)",
            )

    @_statuses
    async def CancelRequest(
        self, request: pb.AdminCancelRequest, context: grpc.aio.ServicerContext
    ) -> pb.AdminCancelResponse:
        self._authorize(context)
        check_request_id(request.request_id)
        await self.engine.cancel(request.request_id)  # whichever gateway process holds it
        return pb.AdminCancelResponse()

    @_statuses
    async def ListRequests(
        self, request: pb.ListRequestsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRequestsResponse:
        self._authorize(context)
        try:
            rows = (await self.engine.stats(timeout=5.0, what="requests"))["requests"]
        except TimeoutError:
            raise GrpcError(grpc.StatusCode.UNAVAILABLE, "the scheduler did not answer") from None
        states = {
            "waiting": pb.REQUEST_STATE_WAITING,
            "preempted": pb.REQUEST_STATE_PREEMPTED,
            "swapped": pb.REQUEST_STATE_PREEMPTED,
        }
        return pb.ListRequestsResponse(
            requests=[
                pb.RequestInfo(
                    request_id=r["id"],
                    state=states.get(r["state"], pb.REQUEST_STATE_RUNNING),
                    num_prompt_tokens=r["num_prompt_tokens"],
                    num_output_tokens=r["num_output_tokens"],
                    arrival_time=r.get("arrival_time", 0.0),
                    model_version=r.get("version", ""),
                )
                for r in rows
            ]
        )


class GrpcGateway:
    """The grpc.aio server: both services, health and reflection, on `host:port`."""

    def __init__(
        self,
        engine: EngineClient,
        server: ServerConfig,
        scheduler: SchedulerConfig | None = None,
        *,
        health_poll_s: float = 0.5,
        share_port: bool = False,
    ) -> None:
        """Serves on the server section's host and grpc_port (0: a free one), with its API
        key and admin token; the scheduler section says whether `priority` is honoured."""
        self.engine = engine
        self.host = server.host
        self.requested_port = server.grpc_port
        api_key, admin_token = server.api_key or None, server.admin_token or None
        model_root = server.model_root or None
        self.port = 0  # the bound one, after start()
        self.health_poll_s = health_poll_s
        # no SO_REUSEPORT, a port already taken must fail here, not split the traffic;
        # but the gateway processes of one server share theirs (`share_port`: the
        # supervisor holds the port, services/gateway/listen.py)
        self.server = grpc.aio.server(options=[("grpc.so_reuseport", int(share_port))])
        self.health = health.aio.HealthServicer()
        context = {
            "scheduling_policy": (scheduler or SchedulerConfig()).scheduling_policy,
            "trust_request_chat_template": server.trust_request_chat_template,
            "tool_call_parser": server.tool_call_parser,
            "ignore_unknown_fields": server.ignore_unknown_fields,
        }
        shuttle = ShuttleServicer(
            engine,
            api_key,
            context,
            pooling=server.pooling,
            embedding_normalize=server.embedding_normalize,
        )
        pb_grpc.add_ShuttleServicer_to_server(shuttle, self.server)
        pb_grpc.add_AdminServicer_to_server(
            AdminServicer(engine, admin_token, model_root), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(SERVICE_NAMES, self.server)
        self._health_task: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind, serve, start reporting health; returns the bound port."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.requested_port}"
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"cannot serve gRPC on {address}: {e}") from None
        if self.port == 0:
            raise RuntimeError(f"cannot serve gRPC on {address}")
        await self.server.start()
        self._health_task = asyncio.create_task(self._report_health())
        return self.port

    async def _report_health(self) -> None:
        status = None
        while True:
            now = _SERVING if self.engine.is_ready() else _NOT_SERVING
            if now != status:
                for service in ("", SHUTTLE_SERVICE, ADMIN_SERVICE):
                    await self.health.set(service, now)
                status = now
            await asyncio.sleep(self.health_poll_s)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING, then let calls in flight finish for up to `grace` seconds."""
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
