"""Is an actor alive? Send it a `Ping` and wait for its `Pong` (a container health check).

    python -m common.healthcheck scheduler            # an actor named in the config
    python -m common.healthcheck tokenizer-1          # the second tokenizer's inbox
    python -m common.healthcheck tcp://10.0.0.5:5551  # any inbox address
    python -m common.healthcheck http                 # the gateway's GET /health

Addresses and CURVE keys come from the same flags and SHUTTLE_* variables the service reads,
so in a container the check needs no arguments beyond the name. Exit 0: healthy; 1: not.
The reply inbox is an ipc socket whose path depends only on the target, so an actor that
is checked every few seconds keeps one cached reply outbox rather than one per check.
"""

from __future__ import annotations

import argparse
import hashlib
import secrets
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import zmq

from common import codec
from common.config import Config, ConfigError, add_flags, from_args
from common.curve import CurveKeys, uses_curve
from common.messages import Ping, Pong
from common.topology import router_addr


def resolve_target(config: Config, target: str) -> str:
    """An inbox address from an actor name ("scheduler", "tokenizer-1") or an address."""
    if "://" in target:
        return target
    name, _, index = target.partition("-")
    if name == "tokenizer":
        return config.tokenizer_addrs()[int(index or 0)]
    if name == "router":
        return router_addr(config)
    return config.addr(name)


def ping(addr: str, timeout: float = 5.0, curve: CurveKeys | None = None) -> bool:
    """True when the inbox at `addr` answers a Ping within `timeout` seconds."""
    digest = hashlib.sha1(addr.encode()).hexdigest()[:16]
    reply_path = Path(tempfile.gettempdir()) / f"shuttle-health-{digest}.sock"
    reply_addr = f"ipc://{reply_path}"
    ctx = zmq.Context()
    try:
        reply = ctx.socket(zmq.PULL)
        reply.setsockopt(zmq.LINGER, 0)
        reply.bind(reply_addr)
        push = ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        if curve is not None and uses_curve(addr):
            curve.connect(push)
        push.connect(addr)
        nonce = secrets.randbits(31)
        push.send(codec.encode(Ping(reply_to=reply_addr, nonce=nonce)), zmq.NOBLOCK)
        return _await_pong(reply, nonce, time.monotonic() + timeout)
    finally:
        ctx.destroy(linger=0)
        reply_path.unlink(missing_ok=True)


def _await_pong(reply: zmq.Socket, nonce: int, deadline: float) -> bool:
    while (left := deadline - time.monotonic()) > 0:
        if not reply.poll(int(left * 1000) + 1):
            break
        try:
            msg = codec.decode(reply.recv())
        except codec.CodecError:
            continue
        if isinstance(msg, Pong) and msg.nonce == nonce:  # a late Pong of an earlier check
            return True  # carries another nonce
    return False


def http_ok(config: Config, timeout: float = 5.0) -> bool:
    """True when the gateway's GET /health answers 200 (the engine is ready)."""
    host = config.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    try:
        with urllib.request.urlopen(
            f"http://{host}:{config.server.port}/health", timeout=timeout
        ) as r:
            return r.status == 200
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.healthcheck", description=__doc__.splitlines()[0]
    )
    parser.add_argument("target", help="actor name, tokenizer-N, inbox address, or http")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    add_flags(parser)
    args = parser.parse_args(argv)
    try:
        config = from_args(args)
        if args.target == "http":
            ok, what = http_ok(config, args.timeout), "gateway /health"
        else:
            what = resolve_target(config, args.target)
            curve_dir = config.addresses.curve_dir
            curve = CurveKeys.load(curve_dir) if curve_dir else None
            ok = ping(what, args.timeout, curve)
    except (ConfigError, ValueError, IndexError) as e:
        print(f"healthcheck: {e}", file=sys.stderr)
        return 1
    print(f"{what}: {'healthy' if ok else 'no answer'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
