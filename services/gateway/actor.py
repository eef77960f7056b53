"""The gateway process: HTTP (FastAPI on uvicorn), gRPC (grpc.aio, with --grpc-port) and the
ZeroMQ side, in one event loop.

With --gateway-processes N > 1 there are N of these, `gateway-0`..`gateway-{N-1}`, on one
HTTP port (the supervisor's listening socket, `listen_fd`) and one gRPC port
(services/gateway/listen.py), each with its own inbox; each mints the wire ids of its
requests (common/wire_id.py) so that their outputs come back to it, and asks the others
(services/gateway/engine/peers.py) what concerns the whole server."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import uvicorn

from common.actor import Actor
from common.config import Config
from common.ipc import Fanout
from common.messages import (
    Drain,
    Drained,
    GatewayAnswer,
    GatewayQuery,
    LoraAdapterResult,
    LorasChanged,
    ModelChanged,
    OutputBatch,
    ProcessDown,
    RequestError,
    Retokenize,
    Stats,
    SwapResult,
    TokenizeResult,
)
from common.topology import (
    gateway_addrs,
    gateway_name,
    num_gateways,
    process_names,
    replica_addrs,
    router_addr,
)
from services.gateway.engine.peers import GatewayPeers
from services.gateway.engine.stream import WireIds
from services.gateway.engine.zmq_client import ZmqEngineClient
from services.gateway.listen import inherited

if TYPE_CHECKING:
    from services.gateway.grpc.server import GrpcGateway
    from services.gateway.http.console.events import ConsoleEvents

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the actor owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


class GatewayActor(Actor):
    name = "gateway"

    def __init__(self, config: Config, index: int = 0, listen_fd: int | None = None) -> None:
        self.index = index  # which of the gateway processes this is
        self.num_gateways = num_gateways(config)
        self.addrs = gateway_addrs(config)  # every gateway process's inbox, by index
        super().__init__(config, self.addrs[index])
        self.listen_fd = listen_fd  # the supervisor's listening socket, or None: bind one
        self.port = 0
        self._engine: ZmqEngineClient | None = None  # built in start()
        self.server: _Server | None = None
        self.grpc: GrpcGateway | None = None
        self.grpc_port = 0
        self.console: ConsoleEvents | None = None  # the console's feed, told of restarts
        self.handlers.update(
            {
                OutputBatch: self._on_outputs,
                RequestError: self._on_error,
                Stats: self._on_stats,
                SwapResult: self._on_swap_result,
                ProcessDown: self._on_process_down,
                Drain: self._on_drain,
                ModelChanged: self._on_model_changed,
                Retokenize: self._on_retokenize,
                TokenizeResult: self._on_tokenize_result,
                LoraAdapterResult: self._on_lora_result,
                LorasChanged: self._on_loras_changed,
                GatewayQuery: self._on_gateway_query,
                GatewayAnswer: self._on_gateway_answer,
            }
        )

    @property
    def inbox_name(self) -> str:
        return gateway_name(self.index, self.num_gateways)

    @property
    def engine(self) -> ZmqEngineClient:
        if self._engine is None:
            raise RuntimeError("the gateway's engine client exists once start() has run")
        return self._engine

    async def start(self) -> None:
        from services.gateway.http.app import create_app

        self._engine = ZmqEngineClient(
            tokenizers=self.outbox(self.config.tokenizer_addrs()),
            # every replica's scheduler at once (aborts, stats, swaps)
            scheduler=self.outboxes(replica_addrs(self.config, "scheduler")),
            inbox_addr=self.inbox_addr,
            aliases=self.config.model.served_model_names,
            num_replicas=self.config.data_parallel.data_parallel_size,
            enable_lora=self.config.lora.enable_lora,
            # (one replica: with several, the router and the other replicas serve on)
            resume_timeout=(
                self.config.server.resume_timeout
                if self.config.data_parallel.data_parallel_size == 1
                else 0.0
            ),
            router=(
                self.outbox(router_addr(self.config))
                if self.config.data_parallel.data_parallel_size > 1
                else None
            ),
            wire_ids=WireIds(self.index, self.num_gateways),
            peers=self._peers(),
        )
        server = self.config.server
        app = create_app(self.engine, server, self.config.scheduler)
        self.console = app.state.console
        self.console.serve_as(self.inbox_name, process_names(self.config))
        uv_config = uvicorn.Config(
            app,
            host=self.config.server.host,
            port=self.config.server.port,
            loop="none",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=server.http_keep_alive_timeout,
        )
        self.server = uv_server = _Server(uv_config)
        sockets = None if self.listen_fd is None else [inherited(self.listen_fd)]
        self.server_task = asyncio.create_task(uv_server.serve(sockets))
        while not uv_server.started:
            if self.server_task.done():
                self.server_task.result()
                raise RuntimeError(
                    f"cannot serve HTTP on {self.config.server.host}:{self.config.server.port}"
                )
            await asyncio.sleep(0.02)
        self.port = uv_server.servers[0].sockets[0].getsockname()[1]
        log.info("HTTP on %s:%d", self.config.server.host, self.port)
        if server.grpc_port >= 0:
            await self._start_grpc()

    async def _start_grpc(self) -> None:
        from services.gateway.grpc.server import GrpcGateway

        server = self.config.server
        # run by the supervisor, the gateway processes share the port it holds
        share = self.listen_fd is not None
        self.grpc = GrpcGateway(self.engine, server, self.config.scheduler, share_port=share)
        self.grpc_port = await self.grpc.start()
        log.info("gRPC on %s:%d", server.host, self.grpc_port)

    def _peers(self) -> GatewayPeers | None:
        """The other gateway processes (none with one)."""
        others = [a for i, a in enumerate(self.addrs) if i != self.index]
        if not others:
            return None
        boxes = Fanout([self.outbox(a) for a in others])
        return GatewayPeers(boxes, len(others), self.inbox_addr, itertools.count())

    async def _on_gateway_query(self, msg: GatewayQuery) -> None:
        """Another gateway process asks: cancel a request if this one holds it, or list
        this one's live requests."""
        data: dict[str, Any] = {}
        if msg.what == "cancel":
            held = self.engine.is_in_flight(msg.request_id)
            if held:
                await self.engine.abort(msg.request_id)
            data = {"cancelled": held}
        elif msg.what == "requests" and self.console is not None:
            data = {"requests": self.console.live.rows()}
        self.outbox(msg.reply_to).send(
            GatewayAnswer(name=self.inbox_name, query_id=msg.query_id, data=data)
        )

    def _on_gateway_answer(self, msg: GatewayAnswer) -> None:
        self.engine.peers.on_answer(msg)

    def ready_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"host": self.config.server.host, "port": self.port}
        if self.grpc is not None:
            info["grpc_port"] = self.grpc_port
        return info

    async def stop(self) -> None:
        # both front ends drain at once: streams in flight get the same grace on each
        draining = []
        if self.console is not None:  # its feeds never end by themselves
            self.console.close()
        if self.server is not None:
            self.server.should_exit = True
            draining.append(asyncio.wait_for(self.server_task, 10))
        if self.grpc is not None:
            draining.append(self.grpc.stop(grace=5))
        await asyncio.gather(*draining, return_exceptions=True)

    def _on_outputs(self, msg: OutputBatch) -> None:
        self.engine.on_outputs(msg)

    def _on_error(self, msg: RequestError) -> None:
        self.engine.on_error(msg)

    def _on_stats(self, msg: Stats) -> None:
        self.engine.on_stats(msg)

    def _on_swap_result(self, msg: SwapResult) -> None:
        self.engine.on_swap_result(msg)

    def _on_model_changed(self, msg: ModelChanged) -> None:
        self.engine.on_model_changed(msg)

    def _on_lora_result(self, msg: LoraAdapterResult) -> None:
        self.engine.loras.on_result(msg)

    def _on_loras_changed(self, msg: LorasChanged) -> None:
        self.engine.loras.on_changed(msg)

    def _on_retokenize(self, msg: Retokenize) -> None:
        self.engine.on_retokenize(msg)

    def _on_tokenize_result(self, msg: TokenizeResult) -> None:
        self.engine.on_tokenize_result(msg)

    def _on_process_down(self, msg: ProcessDown) -> None:
        """The scheduler or detokenizer holds every request's state: with resumes on, the
        requests of a dead scheduler wait for the new one's ModelChanged and are sent again;
        those of a dead detokenizer are sent again at once (it may have lost the last outputs
        of a request the scheduler has finished); those of a dead worker come back from the
        scheduler as resumable errors. A tokenizer held only requests not yet scheduled:
        those with no output yet are sent again. With resumes off (--resume-timeout 0) each
        of these fails with a retryable 503, as do the router's. With several replicas, one
        replica's worker or scheduler: the others serve on; the router fails the requests a
        dead scheduler held, its scheduler those of a dead worker."""
        if self.console is not None:
            self.console.on_process_down(msg)
        if msg.name.startswith(("worker-", "scheduler-")):
            log.warning("%s died: its replica is routed around until it is back", msg.name)
            return
        if msg.name in ("worker", "scheduler"):  # health says NOT_SERVING until it is back
            self.engine.on_model_lost()
        why = f"the {msg.name} process restarted"
        if self.engine.resumes.timeout > 0 and msg.name != "router":
            if msg.name == "scheduler":
                n = self.engine.resumes.lose_all(why)
                log.warning("%s died: %d requests wait to be resumed", msg.name, n)
            elif msg.name == "detokenizer":
                n = self.engine.resumes.resend_all(why)
                log.warning("%s died: %d requests sent again", msg.name, n)
            elif msg.name.startswith("tokenizer"):
                n = self.engine.resumes.resend_waiting(why)
                log.warning("%s died: %d requests sent to a tokenizer again", msg.name, n)
            return
        if msg.name in ("scheduler", "detokenizer"):
            n = self.engine.fail_all(f"the {msg.name} process restarted")
        elif msg.name.startswith("tokenizer") or msg.name == "router":
            n = self.engine.fail_all(f"the {msg.name} process restarted", only_waiting=True)
        else:
            return
        log.warning("%s died: failed %d requests in flight", msg.name, n)

    def request_stop(self) -> None:
        """SIGTERM on the gateway itself (compose stops it first, its peers still running):
        drain as the supervisor's Drain does, up to --shutdown-timeout, then stop. A second
        signal, or nothing in flight, stops at once."""
        engine = self._engine  # (none before start)
        if engine is None or engine.draining or not engine.num_in_flight:
            super().request_stop()
            return
        stop = super().request_stop
        self._drain(self.config.server.shutdown_timeout, lambda _: stop())

    def _on_drain(self, msg: Drain) -> None:
        self._drain(
            msg.timeout_s,
            lambda unfinished: self.outbox(msg.reply_to).send(
                Drained(num_unfinished=unfinished, name=self.inbox_name)
            ),
        )

    def _drain(self, timeout_s: float, then: Callable[[int], None]) -> None:
        """Refuse new requests (503) from now on; once those in flight have finished, or
        after timeout_s, call `then` with how many are still unfinished."""
        self.engine.draining = True
        log.info("draining: %d requests in flight", self.engine.num_in_flight)

        async def wait() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while self.engine.num_in_flight and loop.time() < deadline:
                await asyncio.sleep(0.05)
            then(self.engine.num_in_flight)

        self._drain_task = asyncio.get_running_loop().create_task(wait())
