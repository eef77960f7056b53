"""CURVE between processes: key holders get through, everyone else's frames are dropped."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from common import codec
from common.config import Config
from common.curve import CurveKeys, keygen, main
from common.ipc import Inbox, Outbox
from common.messages import Ping

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE")

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


def test_keygen_writes_a_key_set_once(tmp_path: Path) -> None:
    assert main(["keygen", str(tmp_path / "keys")]) == 0
    keys = CurveKeys.load(tmp_path / "keys")
    assert len(keys.server_public) == 40 and keys.server_public != keys.client_public
    assert (tmp_path / "keys" / "server.key_secret").stat().st_mode & 0o077 == 0
    assert not keygen(tmp_path / "keys")  # kept: a second keygen must not break a deployment
    assert CurveKeys.load(tmp_path / "keys") == keys
    assert keygen(tmp_path / "keys", force=True)
    assert CurveKeys.load(tmp_path / "keys").server_public != keys.server_public


def test_missing_keys_fail_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="keygen"):
        CurveKeys.load(tmp_path)


def _intruder(addr: str, server_key: bytes | None) -> tuple[zmq.Socket, zmq.Socket]:  # type: ignore[type-arg]
    """A PUSH socket of a process without our client keys: plain, or with its own key pair
    (and our server's public key, which is no secret)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if server_key is not None:
        public, secret = zmq.curve_keypair()
        sock.curve_publickey, sock.curve_secretkey = public, secret
        sock.curve_serverkey = server_key
    monitor = sock.get_monitor_socket(_FAILED)
    sock.connect(addr)
    return sock, monitor


async def _exchange(keys: CurveKeys) -> list[int]:
    inbox = Inbox("tcp://127.0.0.1:0", keys)
    intruders = [_intruder(inbox.addr, None), _intruder(inbox.addr, keys.server_public)]
    keyed = Outbox(inbox.addr, keys)
    try:
        for nonce, (sock, monitor) in enumerate(intruders, start=100):
            sock.send(codec.encode(Ping(reply_to="ipc:///nowhere", nonce=nonce)))
            # the handshake was refused: from here on nothing of theirs can arrive
            assert monitor.poll(10_000), "the intruder's handshake neither failed nor passed"
            assert recv_monitor_message(monitor)["event"] & _FAILED
        keyed.send(Ping(reply_to="ipc:///nowhere", nonce=1))
        keyed.send(Ping(reply_to="ipc:///nowhere", nonce=2))
        got = [(await asyncio.wait_for(inbox.recv(), 10)).nonce for _ in range(2)]
        while (extra := inbox.recv_nowait()) is not None:
            got.append(extra.nonce)
        return got
    finally:
        keyed.close()
        for sock, monitor in intruders:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        inbox.close()


def test_only_key_holders_can_send(tmp_path: Path) -> None:
    keygen(tmp_path)
    assert asyncio.run(_exchange(CurveKeys.load(tmp_path))) == [1, 2]


def test_plain_links_still_work_without_keys() -> None:
    async def run() -> int:
        inbox = Inbox("tcp://127.0.0.1:0")
        box = Outbox(inbox.addr)
        try:
            box.send(Ping(reply_to="ipc:///nowhere", nonce=7))
            return (await asyncio.wait_for(inbox.recv(), 10)).nonce
        finally:
            box.close()
            inbox.close()

    assert asyncio.run(run()) == 7


def test_defaults_bind_loopback_or_ipc_only(tmp_path: Path) -> None:
    cfg = Config().replace(server={"run_dir": str(tmp_path)})
    assert cfg.server.host == "127.0.0.1"
    names = ("gateway", "scheduler", "worker", "detokenizer", "supervisor")
    addrs = [cfg.addr(n) for n in names] + cfg.tokenizer_addrs()
    assert all(a.startswith(f"ipc://{tmp_path}/") for a in addrs)
    assert [cfg.bind_addr(a) for a in addrs] == addrs


def test_bind_host_overrides_only_tcp_binds() -> None:
    cfg = Config().replace(
        addresses={"zmq_bind_host": "0.0.0.0", "scheduler_addr": "tcp://scheduler:5551"}
    )
    assert cfg.addr("scheduler") == "tcp://scheduler:5551"  # where peers connect
    assert cfg.bind_addr(cfg.addr("scheduler")) == "tcp://0.0.0.0:5551"  # where it binds
    assert cfg.bind_addr("ipc:///run/x.sock") == "ipc:///run/x.sock"
