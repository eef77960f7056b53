"""Admin HTTP routes under /admin, behind the admin token (`--admin-token`).

    GET  /admin/stats        the scheduler's counters: num_running, num_waiting,
                             num_free_blocks, num_total_blocks, kv_cache_dtype,
                             block_size, kv_cache_usage, ...
    GET  /admin/requests     every in-flight request: id, state, tokens so far, age
    POST /admin/cancel/{id}  end a request (idempotent): its stream ends with `cancelled`
    POST /admin/swap-model   {"model": PATH, "version": LABEL?, "mode": "overlap"|"drain"}
    GET  /admin/events       the operator console's event feed (services/gateway/http/console/)

Every route wants `Authorization: Bearer <admin token>`, or the operator console's session
cookie (services/gateway/http/console/): SameSite=Strict, and on anything but GET also the
`X-Shuttle-Console` header, which a cross-origin form cannot send (no CORS here). With no
token configured the admin API is closed: every call is refused (401) with a message saying
so, never left open.
The gRPC Admin service checks the same token (services/gateway/grpc/server.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from services.gateway.admin_auth import (
    SESSION_COOKIE,
    check_admin_token,
    check_session_cookie,
    resolve_model_folder,
)
from services.gateway.engine.client import EngineClient
from services.gateway.openai.request_errors import RequestRejected


def admin_router(
    engine: EngineClient, admin_token: str | None, model_root: str | None = None
) -> APIRouter:
    """The /admin routes over `engine`, guarded by `admin_token`."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin(admin_token))])

    async def ask(what: str) -> dict[str, Any]:
        try:
            return await engine.stats(timeout=5.0, what=what)
        except TimeoutError:
            raise RequestRejected("the scheduler did not answer in time", None, 503) from None

    async def stats() -> Response:
        return _json(await ask("stats"))

    async def requests() -> Response:
        return _json(await ask("requests"))

    async def cancel(request_id: str) -> Response:
        # (whichever gateway process holds it; idempotent either way)
        in_flight = await engine.cancel(request_id)
        gone = "not in flight (finished, never sent, or cancelled already)"
        detail = "cancelled" if in_flight else gone
        return _json({"id": request_id, "cancelled": in_flight, "detail": detail})

    async def swap(request: Request) -> Response:
        body = _swap_body(await request.body())
        path = resolve_model_folder(body["model"], model_root)
        result = await engine.swap_model(
            str(path), body.get("version", ""), body.get("mode", "overlap")
        )
        data = {
            "ok": result.ok,
            "version": result.version,
            "previous_version": result.previous_version,
            "mode": result.mode,
            "duration_s": round(result.duration_s, 3),
            "error": result.error,
        }
        return _json(data, 200 if result.ok else (409 if "in progress" in result.error else 400))

    router.add_api_route("/stats", stats, methods=["GET"])
    router.add_api_route("/requests", requests, methods=["GET"])
    router.add_api_route("/cancel/{request_id}", cancel, methods=["POST"])
    router.add_api_route("/swap-model", swap, methods=["POST"])
    return router


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _swap_body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestRejected(f"body: not valid JSON ({e})", "body") from None
    if not isinstance(body, dict) or not isinstance(body.get("model"), str) or not body["model"]:
        raise RequestRejected("model: a model folder path is required", "model")
    if body.get("mode", "overlap") not in ("overlap", "drain"):
        raise RequestRejected(f"mode: must be overlap or drain, got {body.get('mode')!r}", "mode")
    if not isinstance(body.get("version", ""), str) or len(body.get("version", "")) > 64:
        raise RequestRejected("version: a label of at most 64 characters", "version")
    return body


def require_admin(admin_token: str | None) -> Callable[[Request], Awaitable[None]]:
    """A route dependency refusing (401) a request without the admin token."""

    async def check(request: Request) -> None:
        why = check_admin_token(request.headers.get("authorization"), admin_token)
        if why is not None and not has_console_session(request, admin_token):
            raise RequestRejected(why, None, 401)

    return check


CONSOLE_HEADER = "x-shuttle-console"


def has_console_session(request: Request, admin_token: str | None) -> bool:
    """The request carries a valid console session cookie (and, unless it only reads, the
    console's header: a cookie alone never authorises a change)."""
    if not check_session_cookie(request.cookies.get(SESSION_COOKIE), admin_token):
        return False
    return request.method in ("GET", "HEAD") or CONSOLE_HEADER in request.headers
