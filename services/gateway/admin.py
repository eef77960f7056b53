"""Admin HTTP routes under /admin, behind the admin token (`--admin-token`).

    GET /admin/stats   the scheduler's counters: num_running, num_waiting, num_free_blocks,
                       num_total_blocks, kv_cache_usage, ... (as the scheduler reports them)

Every route wants `Authorization: Bearer <admin token>`. With no token configured the admin
API is closed: every call is refused (401) with a message saying so, never left open.
The gRPC Admin service checks the same token (services/gateway/grpc_server.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from services.gateway.protocol import RequestRejected

NO_ADMIN_TOKEN = (
    "no admin token is configured on this server (set --admin-token or "
    "SHUTTLE_ADMIN_TOKEN); the admin API is disabled"
)
BAD_ADMIN_TOKEN = "invalid or missing admin token; send 'Authorization: Bearer <token>'"


class StatsSource(Protocol):
    async def stats(self, timeout: float = 5.0) -> dict[str, Any]: ...


def check_admin_token(authorization: str | None, admin_token: str | None) -> str | None:
    """None if `authorization` (the header's value) carries the admin token, else why not."""
    if not admin_token:
        return NO_ADMIN_TOKEN
    expected = f"Bearer {admin_token}".encode()
    # constant time: no token guessing by timing
    if not hmac.compare_digest((authorization or "").encode(), expected):
        return BAD_ADMIN_TOKEN
    return None


def admin_router(engine: StatsSource, admin_token: str | None) -> APIRouter:
    """The /admin routes over `engine`, guarded by `admin_token`."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(_require_admin(admin_token))])

    async def stats() -> Response:
        try:
            data = await engine.stats(timeout=5.0)
        except TimeoutError:
            raise RequestRejected("the scheduler did not answer in time", None, 503) from None
        return Response(orjson.dumps(data), media_type="application/json")

    router.add_api_route("/stats", stats, methods=["GET"])
    return router


def _require_admin(admin_token: str | None) -> Callable[[Request], Awaitable[None]]:
    async def require_admin(request: Request) -> None:
        why = check_admin_token(request.headers.get("authorization"), admin_token)
        if why is not None:
            raise RequestRejected(why, None, 401)

    return require_admin
