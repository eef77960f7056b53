"""tools/swap-model: serve another model version without dropping a request.

    tools/swap-model --model PATH [--version LABEL] [--mode overlap|drain] [--url URL]

overlap (default): the new weights load beside the old ones; new requests go to the new
version, running ones finish on the old, which is then freed. drain: admission pauses,
running requests finish, the model is replaced (needed when memory holds one copy, or the
KV layout differs), admission resumes; queued requests wait, none fail.
Exit status: 0 swapped, 1 refused or failed (the old model goes on serving), 2 unreachable.
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


def _swap_http(args: argparse.Namespace) -> tuple[bool, dict]:
    body = {"model": args.model, "version": args.version, "mode": args.mode}
    status, reply = post(args, "/admin/swap-model", body)
    if status == 401:
        fail(error_message(reply), EXIT_UNREACHABLE)
    if "error" in reply and isinstance(reply["error"], dict):
        return False, {"ok": False, "error": error_message(reply)}
    return status == 200 and reply.get("ok", False), reply


def _swap_grpc(args: argparse.Namespace) -> tuple[bool, dict]:
    import grpc

    from proto import shuttle_pb2

    stub, meta = grpc_admin(args)
    try:
        drain = args.mode == "drain"
        mode = shuttle_pb2.SWAP_MODE_DRAIN if drain else shuttle_pb2.SWAP_MODE_OVERLAP
        r = stub.SwapModel(
            shuttle_pb2.SwapModelRequest(model=args.model, version=args.version, mode=mode),
            metadata=meta,
            timeout=args.timeout,
        )
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE):
            fail(e.details() or str(e.code()), EXIT_UNREACHABLE)
        return False, {"ok": False, "error": e.details()}
    return True, {
        "ok": True,
        "version": r.version,
        "previous_version": r.previous_version,
        "mode": args.mode,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/swap-model",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="Hugging Face folder of the new model")
    p.add_argument("--version", default="", help="label (default: hash of the weights)")
    p.add_argument("--mode", choices=("overlap", "drain"), default="overlap")
    add_connection_flags(p)
    args = p.parse_args(argv)
    ok, reply = (_swap_grpc if args.grpc else _swap_http)(args)
    if ok:
        human = (
            f"swapped {reply.get('previous_version')} -> {reply.get('version')} "
            f"({reply.get('mode')}) in {reply.get('duration_s', 0):.2f}s"
        )
    else:
        human = f"swap refused: {reply.get('error')}; the served model is unchanged"
    emit(args, reply, human)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
