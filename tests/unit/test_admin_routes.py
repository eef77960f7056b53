"""The /admin HTTP routes (services/gateway/admin.py), in process against a fake engine."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from services.gateway.app import create_app
from tests.unit.test_gateway_app import FakeEngine

TOKEN = "admin-secret"


class StatsEngine(FakeEngine):
    def __init__(self, stats: dict[str, Any] | None = None) -> None:
        super().__init__()
        self._stats = stats

    async def stats(self, timeout: float = 5.0, what: str = "stats") -> dict[str, Any]:
        if self._stats is None:
            raise TimeoutError
        return self._stats


def get(engine: FakeEngine, admin_token: str | None, headers: dict[str, str]) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(engine, api_key="api-key", admin_token=admin_token)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/admin/stats", headers=headers)

    return asyncio.run(go())


def test_stats_with_the_admin_token() -> None:
    stats = {"num_running": 1, "num_free_blocks": 7, "num_total_blocks": 8}
    resp = get(StatsEngine(stats), TOKEN, {"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200 and resp.json() == stats


def test_wrong_missing_or_api_key_is_refused() -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer api-key"}):
        resp = get(StatsEngine({}), TOKEN, headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["message"].startswith("invalid or missing admin token")


def test_admin_is_closed_without_a_configured_token() -> None:
    resp = get(StatsEngine({}), None, {"Authorization": "Bearer "})
    assert resp.status_code == 401
    assert "no admin token is configured" in resp.json()["error"]["message"]


def test_a_silent_scheduler_is_503() -> None:
    resp = get(StatsEngine(None), TOKEN, {"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
