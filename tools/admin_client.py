"""What tools/cancel and tools/swap-model share: where the gateway is, the token, output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from proto import shuttle_pb2_grpc

EXIT_OK, EXIT_FAILED, EXIT_UNREACHABLE = 0, 1, 2


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get("SHUTTLE_URL", "http://127.0.0.1:8000"),
        help="the gateway's HTTP address (env SHUTTLE_URL)",
    )
    p.add_argument(
        "--grpc", default="", metavar="HOST:PORT", help="speak gRPC to this address instead of HTTP"
    )
    p.add_argument(
        "--admin-token",
        default=os.environ.get("SHUTTLE_ADMIN_TOKEN", ""),
        help="the admin token (env SHUTTLE_ADMIN_TOKEN)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait")


def post(
    args: argparse.Namespace, path: str, body: dict[str, Any] | None = None
) -> tuple[int, dict[str, Any]]:
    """POST to the admin API; (status, JSON body). Exits 2 when the gateway is unreachable."""
    headers = {"Authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    try:
        r = httpx.post(
            args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as e:
        fail(f"cannot reach the gateway at {args.url}: {e}", EXIT_UNREACHABLE)
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text[:500]}}


def error_message(body: dict[str, Any]) -> str:
    err = body.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err or body)


def emit(args: argparse.Namespace, data: Any, human: str) -> None:
    print(json.dumps(data) if args.json else human)


def fail(message: str, code: int = EXIT_FAILED) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(code)


def grpc_admin(
    args: argparse.Namespace,
) -> tuple[shuttle_pb2_grpc.AdminStub, tuple[tuple[str, str], ...]]:
    """An Admin stub and call metadata for --grpc."""
    import grpc

    from proto import shuttle_pb2_grpc

    channel = grpc.insecure_channel(args.grpc)
    meta = (("authorization", f"Bearer {args.admin_token}"),) if args.admin_token else ()
    return shuttle_pb2_grpc.AdminStub(channel), meta
