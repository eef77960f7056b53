"""The ports every gateway process serves on, opened once by the supervisor.

HTTP: the supervisor binds and listens once, and passes the listening socket's file
descriptor to each gateway process it starts (`--listen-fd`, subprocess `pass_fds`): a
listening socket shared by fork. There is one accept queue; whichever live gateway process
accepts first takes a connection. When one dies only the connections it had accepted go
with it: those waiting in the queue are taken by the others, and while none is alive they
wait there (up to the backlog) instead of being refused. SO_REUSEPORT would give each
process a queue of its own, and the connections waiting in a dying process's queue would
be reset with it; the port would also be free for anyone to take while all are down.

gRPC (grpc.aio) binds its own sockets and takes no file descriptor, so there the processes
share the port with SO_REUSEPORT (each its own queue: a dying process loses the connections
waiting in its queue too). The supervisor fixes the port first (picks a free one for
`--grpc-port 0`) and holds a bound, non-listening SO_REUSEPORT socket on it, so a process
restarted later finds the same port, and no other program's socket can take it.
"""

from __future__ import annotations

import socket

BACKLOG = 2048


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def listen_http(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (0: a free port), inheritable by children."""
    sock = socket.create_server((host or "0.0.0.0", port), family=_family(host), backlog=BACKLOG)
    sock.set_inheritable(True)
    return sock


def hold_grpc_port(host: str, port: int) -> socket.socket:
    """A bound, not listening, SO_REUSEPORT socket on host:port (0: a free port): the gRPC
    port the gateway processes then bind with SO_REUSEPORT themselves."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host or "0.0.0.0", port))
    return sock


def inherited(fd: int) -> socket.socket:
    """The listening socket the supervisor passed as `fd` (its family read from it)."""
    return socket.socket(fileno=fd)
