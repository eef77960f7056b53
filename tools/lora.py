"""tools/lora: list, load and unload the LoRA adapters a server with --enable-lora serves.

    tools/lora list                       adapters (and the base model) /v1/models lists
    tools/lora load NAME PATH             serve the PEFT folder PATH under the model name NAME
    tools/lora unload NAME                stop serving NAME (running requests finish first)

Load and unload want the admin token (--admin-token or SHUTTLE_ADMIN_TOKEN); list wants the
API key when the server has one (--api-key or SHUTTLE_API_KEY).
Exit status: 0 done, 1 refused (the reason is printed), 2 unreachable or not authorised.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import httpx

from tools.admin_client import (
    EXIT_UNREACHABLE,
    add_connection_flags,
    emit,
    error_message,
    fail,
    grpc_admin,
)


def _call(args: argparse.Namespace, method: str, path: str, body: Any = None) -> httpx.Response:
    token = args.api_key if method == "GET" else args.admin_token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        return httpx.request(
            method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout
        )
    except httpx.HTTPError as e:
        fail(f"cannot reach the gateway at {args.url}: {e}", EXIT_UNREACHABLE)
        raise  # (fail exits)


def _error(r: httpx.Response) -> str:
    try:
        return error_message(r.json())
    except ValueError:
        return r.text[:500]


def _list(args: argparse.Namespace) -> int:
    r = _call(args, "GET", "/v1/models")
    if r.status_code != 200:
        fail(_error(r), EXIT_UNREACHABLE if r.status_code == 401 else 1)
    cards = r.json()["data"]
    adapters = [c for c in cards if c.get("parent")]
    lines = [f"{c['id']}\t{c.get('root', '')}\t(on {c['parent']})" for c in adapters]
    emit(args, adapters, "\n".join(lines) if lines else "no adapters loaded")
    return 0


def _change(args: argparse.Namespace) -> int:
    body = {"lora_name": args.name}
    if args.command == "load":
        body["lora_path"] = args.path
    r = _call(args, "POST", f"/v1/{args.command}_lora_adapter", body)
    if r.status_code == 401:
        fail(_error(r), EXIT_UNREACHABLE)
    ok = r.status_code == 200
    message = r.text if ok else _error(r)
    emit(args, {"ok": ok, "status": r.status_code, "message": message}, message)
    return 0 if ok else 1


def _grpc(args: argparse.Namespace) -> int:
    """The same three over gRPC: Shuttle.ListModels, Admin.Load/UnloadLoraAdapter."""
    import grpc

    from proto import shuttle_pb2, shuttle_pb2_grpc

    stub, meta = grpc_admin(args)
    try:
        if args.command == "list":
            channel = grpc.insecure_channel(args.grpc)
            key = (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
            listed = shuttle_pb2_grpc.ShuttleStub(channel).ListModels(
                shuttle_pb2.ListModelsRequest(), metadata=key, timeout=args.timeout
            )
            adapters = [{"id": m.id, "root": m.root, "parent": m.parent} for m in listed.models]
            adapters = [a for a in adapters if a["parent"]]
            lines = [f"{a['id']}\t{a['root']}\t(on {a['parent']})" for a in adapters]
            emit(args, adapters, "\n".join(lines) if lines else "no adapters loaded")
            return 0
        if args.command == "load":
            request = shuttle_pb2.LoadLoraAdapterRequest(lora_name=args.name, lora_path=args.path)
            stub.LoadLoraAdapter(request, metadata=meta, timeout=args.timeout)
        else:
            request = shuttle_pb2.UnloadLoraAdapterRequest(lora_name=args.name)
            stub.UnloadLoraAdapter(request, metadata=meta, timeout=args.timeout)
    except grpc.RpcError as e:
        unreachable = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAVAILABLE)
        fail(e.details() or str(e.code()), EXIT_UNREACHABLE if e.code() in unreachable else 1)
    emit(args, {"ok": True}, f"{args.command}ed {args.name}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="tools/lora",
        description=__doc__.splitlines()[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_connection_flags(p)
    p.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY", ""), help="for `list`")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the adapters served")
    load = sub.add_parser("load", help="serve an adapter")
    load.add_argument("name")
    load.add_argument("path")
    unload = sub.add_parser("unload", help="stop serving an adapter")
    unload.add_argument("name")
    args = p.parse_args(argv)
    if args.grpc:
        return _grpc(args)
    return _list(args) if args.command == "list" else _change(args)


if __name__ == "__main__":
    sys.exit(main())
