"""The actor runtime every process runs on.

An actor binds one inbox, registers one handler per message type, and runs one short loop:
wait for a message, drain whatever else is queued, dispatch each through the table, then
give the actor an `on_idle` turn (where the scheduler plans its next step). It answers
`Ping` with `Pong`, reports `Ready` once started, and stops cleanly on SIGTERM, SIGINT or a
`Shutdown` message. An unknown message is logged and counted; a handler error is logged and
never kills the loop (the handler itself fails the one request it was about).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from collections.abc import Callable
from typing import Any

from common.config import Config, ConfigError
from common.curve import CurveKeys
from common.gateway_outbox import GatewayOutbox
from common.ipc import Fanout, Inbox, Outbox, Sender
from common.messages import ModelInfo, Ping, Pong, Progress, Ready, Shutdown
from common.topology import gateway_addrs

log = logging.getLogger(__name__)

Handler = Callable[[Any], Any]


class Actor:
    """Base of every shuttle process. Subclasses fill `handlers` and override the hooks."""

    name = "actor"

    def __init__(self, config: Config, inbox_addr: str | None = None) -> None:
        self.config = config
        self.inbox_addr = inbox_addr or config.addr(self.name)
        self.handlers: dict[type, Handler] = {Ping: self._on_ping, Shutdown: self._on_shutdown}
        self.num_unknown_messages = 0
        self.num_handler_errors = 0
        self._outboxes: dict[str, Outbox] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = False
        self.inbox: Inbox | None = None
        curve_dir = config.addresses.curve_dir
        self.curve = CurveKeys.load(curve_dir) if curve_dir else None

    # hooks ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect peers, load what the actor needs; runs before Ready is sent."""

    def ready_info(self) -> dict[str, Any]:
        return {}

    def ready_model(self) -> ModelInfo | None:
        """The model this actor serves, for its Ready (a worker's); None elsewhere."""
        return None

    def report_progress(self, stage: str) -> None:
        """Tell whoever waits for this actor's Ready (the supervisor) what it is doing now."""
        progress = Progress(name=self.inbox_name, stage=stage)
        for target in self.supervisors():
            self.outbox(target).send(progress)

    def supervisors(self) -> list[str]:
        """The supervisor's inbox when there is one (told of progress and of Ready)."""
        try:
            return [self.config.addr("supervisor")]
        except ConfigError:
            return []

    def ready_targets(self) -> list[str]:
        """Inboxes told when this actor is ready (the supervisor, when there is one)."""
        return self.supervisors()

    async def on_idle(self) -> None:
        """Called after each drained batch of messages."""

    async def stop(self) -> None:
        """Release resources; runs once when the loop ends."""

    # runtime -------------------------------------------------------------------------------
    def outbox(self, addrs: str | list[str]) -> Outbox:
        key = addrs if isinstance(addrs, str) else ",".join(addrs)
        box = self._outboxes.get(key)
        if box is None:
            box = self._outboxes[key] = Outbox(addrs, self.curve)
        return box

    def outboxes(self, addrs: list[str]) -> Sender:
        """One sender to every address at once: an outbox for one, a fan-out for several."""
        if len(addrs) == 1:
            return self.outbox(addrs[0])
        return Fanout([self.outbox(a) for a in addrs])

    def gateways(self) -> GatewayOutbox:
        """Every gateway process, each message to the one it concerns (a request's outputs
        and errors to its owner, notices to all: common/gateway_outbox.py)."""
        return GatewayOutbox([self.outbox(a) for a in gateway_addrs(self.config)])

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        bind_addr = self.config.bind_addr(self.inbox_addr)
        self.inbox = Inbox(self.inbox_addr, self.curve, bind_addr)
        try:
            if not self._stopping:
                self._loop_task = asyncio.create_task(self._serve())
                await self._loop_task
        except asyncio.CancelledError:
            pass  # stop requested: the serving task was cancelled, not this one
        finally:
            await self.stop()
            self.inbox.close()
            for box in self._outboxes.values():
                box.close()
            log.info("stopped")

    @property
    def inbox_name(self) -> str:
        return self.name

    async def _serve(self) -> None:
        assert self.inbox is not None
        await self.start()
        ready = Ready(name=self.inbox_name, info=self.ready_info(), model=self.ready_model())
        for target in self.ready_targets():
            self.outbox(target).send(ready)
        log.info("ready", extra={"addr": self.inbox.addr})
        while True:
            await self.dispatch(await self.inbox.recv())
            while (msg := self.inbox.recv_nowait()) is not None:
                await self.dispatch(msg)
            await self.on_idle()

    async def dispatch(self, msg: Any) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.num_unknown_messages += 1
            log.warning("unknown message %s", type(msg).__name__)
            return
        try:
            result = handler(msg)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.num_handler_errors += 1
            log.exception("handler for %s failed", type(msg).__name__)

    def request_stop(self) -> None:
        self._stopping = True
        if self._loop_task is not None and not self._loop_task.done():
            self._loop_task.cancel()

    def _on_ping(self, msg: Ping) -> None:
        self.outbox(msg.reply_to).send(Pong(name=self.inbox_name, nonce=msg.nonce))

    def _on_shutdown(self, msg: Shutdown) -> None:
        log.info("shutdown requested: %s", msg.reason)
        self.request_stop()
