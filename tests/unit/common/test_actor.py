"""common/actor.py: progress goes to the supervisor alone, before the Ready that every ready
target gets (real ZeroMQ sockets on ipc:// paths, no loop needed: outboxes send at once)."""

from __future__ import annotations

from pathlib import Path

import zmq

from common import codec
from common.actor import Actor
from common.config import Config
from common.messages import Progress, Ready


class _Inbox:
    def __init__(self, addr: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(addr)

    def next(self, timeout_ms: int = 10_000) -> object:
        assert self.sock.poll(timeout_ms), "no message before the deadline"
        return codec.decode(self.sock.recv())


class _TwoTargets(Actor):
    """An actor told of Ready by the supervisor and a peer (as the worker tells the
    scheduler)."""

    name = "probe"

    def __init__(self, config: Config, peer: str) -> None:
        super().__init__(config, inbox_addr=peer + "-own")
        self.peer = peer

    def ready_targets(self) -> list[str]:
        return [*super().ready_targets(), self.peer]


def test_progress_goes_to_the_supervisor_only(tmp_path: Path) -> None:
    supervisor_addr, peer_addr = f"ipc://{tmp_path}/sup", f"ipc://{tmp_path}/peer"
    supervisor, peer = _Inbox(supervisor_addr), _Inbox(peer_addr)
    config = Config().replace(addresses={"supervisor_addr": supervisor_addr})
    actor = _TwoTargets(config, peer_addr)
    try:
        actor.report_progress("loading weights")
        ready = Ready(name="probe", info={})
        for target in actor.ready_targets():
            actor.outbox(target).send(ready)
        assert supervisor.next() == Progress(name="probe", stage="loading weights")
        assert supervisor.next() == ready
        assert peer.next() == ready  # the peer's first message: no progress before it
    finally:
        for box in actor._outboxes.values():
            box.close()
        supervisor.sock.close()
        peer.sock.close()


def test_without_a_supervisor_progress_goes_nowhere() -> None:
    actor = Actor(Config(), inbox_addr="ipc:///nonexistent/inbox")
    assert actor.supervisors() == []
    actor.report_progress("loading")  # no socket is made, nothing raises
    assert actor._outboxes == {}
