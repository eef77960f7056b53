"""tools/cancel: end in-flight requests by id; their streams end with `cancelled`.

    tools/cancel REQUEST_ID [REQUEST_ID ...] [--url URL | --grpc HOST:PORT] [--json]

Exit status: 0 when every id was in flight and is cancelled, 1 when some were not in flight
(finished, never sent, or cancelled already: cancelling is idempotent), 2 when the gateway
cannot be reached or refuses the token.
"""

from __future__ import annotations

import argparse
import sys

from tools.admin_client import (
    EXIT_UNREACHABLE,
    add_connection_flags,
    emit,
    error_message,
    fail,
    grpc_admin,
    post,
)


def _cancel_http(args: argparse.Namespace, rid: str) -> dict:
    status, body = post(args, f"/admin/cancel/{rid}")
    if status == 401:
        fail(error_message(body), EXIT_UNREACHABLE)
    if status != 200:
        return {"id": rid, "cancelled": False, "detail": error_message(body)}
    return body


def _cancel_grpc(args: argparse.Namespace, rid: str) -> dict:
    import grpc

    from proto import shuttle_pb2

    stub, meta = grpc_admin(args)
    try:
        reply = stub.CancelRequest(
            shuttle_pb2.AdminCancelRequest(request_id=rid), metadata=meta, timeout=args.timeout
        )
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE):
            fail(e.details() or str(e.code()), EXIT_UNREACHABLE)
        return {"id": rid, "cancelled": False, "detail": e.details()}
    return {"id": rid, "cancelled": bool(getattr(reply, "cancelled", True)), "detail": ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/cancel",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("request_ids", nargs="+", metavar="REQUEST_ID")
    add_connection_flags(p)
    args = p.parse_args(argv)
    one = _cancel_grpc if args.grpc else _cancel_http
    results = [one(args, rid) for rid in args.request_ids]
    human = "\n".join(
        f"{r['id']}: {'cancelled' if r['cancelled'] else 'not in flight'}" for r in results
    )
    emit(args, results, human)
    return 0 if all(r["cancelled"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
