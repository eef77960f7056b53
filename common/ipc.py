"""Typed ZeroMQ sockets for asyncio: business code sends and receives messages, never frames.

Every actor binds one PULL `Inbox`; whoever talks to it connects a PUSH `Outbox`. An Outbox
connected to several addresses round-robins between them (how the gateway spreads requests
over tokenizer processes).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import zmq
import zmq.asyncio

from common import codec
from common.curve import uses_curve

if TYPE_CHECKING:
    from common.curve import CurveKeys

log = logging.getLogger(__name__)

_HWM = 100_000  # messages queued per peer before send fails; far above any real backlog


def _context() -> zmq.asyncio.Context:
    return zmq.asyncio.Context.instance()


class Inbox:
    """The actor's one receiving socket (PULL, bound). Peers reach it at `addr`; it binds
    `bind_addr` when given (a container binds 0.0.0.0). With `curve` a tcp:// inbox is a
    CURVE server that admits only the authorized client keys."""

    def __init__(
        self, addr: str, curve: CurveKeys | None = None, bind_addr: str | None = None
    ) -> None:
        self.addr = addr
        self.num_bad_frames = 0
        self._sock = _context().socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, _HWM)
        self._sock.setsockopt(zmq.LINGER, 0)
        if curve is not None and uses_curve(addr):
            curve.serve(self._sock)
        self._sock.bind(bind_addr or addr)
        # a plain (not asyncio) view of the same socket, for non-blocking drains
        self._sync: zmq.Socket[bytes] = zmq.Socket.shadow(self._sock.underlying)
        if addr.startswith("tcp://") and addr.endswith(":0"):
            self.addr = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def recv(self) -> Any:
        """The next well-formed message; bad frames are logged, counted and skipped."""
        while True:
            msg = self._decode(await self._sock.recv())
            if msg is not None:
                return msg

    def recv_nowait(self) -> Any | None:
        """A message if one is queued now, else None."""
        while True:
            try:
                frame = self._sync.recv(zmq.NOBLOCK)
            except zmq.Again:
                return None
            msg = self._decode(frame)
            if msg is not None:
                return msg

    def _decode(self, frame: bytes) -> Any | None:
        try:
            return codec.decode(frame)
        except codec.CodecError as e:
            self.num_bad_frames += 1
            log.warning("dropped a bad frame", extra={"error": str(e), "addr": self.addr})
            return None

    def close(self) -> None:
        self._sock.close(linger=0)


class Outbox:
    """A sending socket (PUSH) connected to one or more inboxes; send never blocks. With
    `curve`, tcp:// links are CURVE-encrypted and authenticated with the client key."""

    def __init__(self, addrs: str | list[str], curve: CurveKeys | None = None) -> None:
        self.addrs = [addrs] if isinstance(addrs, str) else list(addrs)
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, _HWM)
        self._sock.setsockopt(zmq.LINGER, 2000)  # flush on close, but never hang shutdown
        if curve is not None and any(uses_curve(a) for a in self.addrs):
            curve.connect(self._sock)
        for addr in self.addrs:
            self._sock.connect(addr)

    def send(self, msg: Any) -> None:
        self._sock.send(codec.encode(msg), zmq.NOBLOCK)

    def send_frame(self, frame: bytes) -> None:
        self._sock.send(frame, zmq.NOBLOCK)

    def close(self) -> None:
        self._sock.close()


class Sender(Protocol):
    """Anything a message can be sent through: an Outbox, or a Fanout of them."""

    def send(self, msg: Any) -> None: ...


class Fanout:
    """Sends each message to every one of several outboxes (every replica's scheduler: an
    abort, a stats query, a swap), unlike one Outbox over several addresses, which picks one."""

    def __init__(self, boxes: list[Outbox]) -> None:
        self.boxes = boxes

    def send(self, msg: Any) -> None:
        frame = codec.encode(msg)
        for box in self.boxes:
            box.send_frame(frame)
