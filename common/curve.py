"""ZeroMQ CURVE between processes: encryption, and only key holders may send.

    python -m common.curve keygen DIR      # once; then every process gets --curve-dir DIR

DIR holds one server key pair (every actor's inbox is a CURVE server with it), one client
key pair (every outbox is a CURVE client with it) and `authorized_clients/`, the public
client keys an inbox admits:

    DIR/server.key  server.key_secret  client.key  client.key_secret
    DIR/authorized_clients/client.key          (add more public .key files to admit others)

An inbox runs a ZAP authenticator that admits only those client keys. A peer without the
server's public key cannot finish the handshake; one with it but with an unknown client key
is refused by ZAP. Either way its frames never reach the actor. CURVE applies to tcp://
links only: ipc:// sockets live in the supervisor's private (0700) run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import threading
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

AUTHORIZED_DIR = "authorized_clients"
_SERVER, _CLIENT = "server", "client"


@dataclasses.dataclass(frozen=True)
class CurveKeys:
    """The key pairs of one deployment, as read from a keygen folder."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    authorized_dir: Path  # public keys of the clients an inbox admits

    @classmethod
    def load(cls, folder: str | Path) -> CurveKeys:
        folder = Path(folder)
        server_public, server_secret = _load_pair(folder, _SERVER)
        client_public, client_secret = _load_pair(folder, _CLIENT)
        authorized = folder / AUTHORIZED_DIR
        if not any(authorized.glob("*.key")):
            raise ValueError(f"CURVE keys: no public client key in {authorized}")
        return cls(server_public, server_secret, client_public, client_secret, authorized)

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it binds) a CURVE server admitting only authorized clients."""
        _ensure_authenticator(sock.context, self.authorized_dir)
        sock.curve_secretkey = self.server_secret
        sock.curve_publickey = self.server_public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it connects) a CURVE client of our servers."""
        sock.curve_secretkey = self.client_secret
        sock.curve_publickey = self.client_public
        sock.curve_serverkey = self.server_public


def uses_curve(addr: str) -> bool:
    return addr.startswith("tcp://")


def _load_pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    path = folder / f"{name}.key_secret"
    if not path.is_file():
        raise ValueError(f"CURVE keys: {path} is missing (python -m common.curve keygen DIR)")
    public, secret = zmq.auth.load_certificate(path)
    if secret is None:
        raise ValueError(f"CURVE keys: {path} holds no secret key")
    return public, secret


# One ZAP handler per libzmq context (ZAP is per context), started before the first bind.
_authenticators: dict[int, ThreadAuthenticator] = {}
_auth_lock = threading.Lock()


def _ensure_authenticator(ctx: zmq.Context, authorized_dir: Path) -> None:
    with _auth_lock:
        if ctx.underlying in _authenticators:
            return
        # a plain (sync) context over the same libzmq context: the ZAP thread must not use
        # asyncio sockets, and it must share the context the servers bind in
        auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
        auth.start()
        auth.configure_curve(domain="*", location=str(authorized_dir))
        _authenticators[ctx.underlying] = auth


def keygen(folder: str | Path, force: bool = False) -> bool:
    """Write a fresh key set into `folder`; False (and nothing written) if one is there."""
    folder = Path(folder)
    if (folder / f"{_SERVER}.key_secret").exists() and not force:
        return False
    authorized = folder / AUTHORIZED_DIR
    authorized.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for name in (_SERVER, _CLIENT):
        _, secret_path = zmq.auth.create_certificates(folder, name)
        os.chmod(secret_path, 0o600)
    (authorized / f"{_CLIENT}.key").write_text((folder / f"{_CLIENT}.key").read_text())
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m common.curve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("keygen", help="write a key set into DIR (kept if one is there)")
    gen.add_argument("dir", type=Path)
    gen.add_argument("--force", action="store_true", help="replace an existing key set")
    args = parser.parse_args(argv)
    if not zmq.has("curve"):
        print("this libzmq has no CURVE support", file=sys.stderr)
        return 1
    made = keygen(args.dir, force=args.force)
    print(f"CURVE keys {'written to' if made else 'already in'} {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
