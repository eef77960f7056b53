"""The /admin HTTP routes (services/gateway/http/admin.py), in process against the fake engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from common.config import ServerConfig
from common.messages import GenerateRequest, SamplingParams
from services.gateway.http.app import create_app
from tests.fake_engine import HANG, MODEL, FakeEngine, delta

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def call(
    engine: FakeEngine,
    admin_token: str | None,
    headers: dict[str, str],
    method: str = "GET",
    url: str = "/admin/stats",
    **kw: Any,
) -> httpx.Response:
    async def go() -> httpx.Response:
        app = create_app(engine, ServerConfig(api_key="api-key", admin_token=admin_token or ""))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, url, headers=headers, **kw)

    return asyncio.run(go())


def test_stats_with_the_admin_token() -> None:
    stats = {"num_running": 1, "num_free_blocks": 7, "num_total_blocks": 8}
    resp = call(FakeEngine(stats=stats), TOKEN, ADMIN)
    assert resp.status_code == 200 and resp.json() == stats


def test_wrong_missing_or_api_key_is_refused() -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Bearer api-key"}):
        resp = call(FakeEngine(stats={}), TOKEN, headers)
        assert resp.status_code == 401
        assert resp.json()["error"]["message"].startswith("invalid or missing admin token")


def test_admin_is_closed_without_a_configured_token() -> None:
    resp = call(FakeEngine(stats={}), None, {"Authorization": "Bearer "})
    assert resp.status_code == 401
    assert "no admin token is configured" in resp.json()["error"]["message"]


def test_a_silent_scheduler_is_503() -> None:
    resp = call(FakeEngine(stats=None), TOKEN, ADMIN)
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"


def test_cancel_says_whether_the_request_was_in_flight() -> None:
    engine = FakeEngine([delta("a"), HANG])
    request = GenerateRequest(request_id="r1", model=MODEL, sampling=SamplingParams(), prompt="hi")

    async def go() -> list[dict[str, Any]]:
        app = create_app(engine, ServerConfig(admin_token=TOKEN))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            deltas = engine.generate(request)
            await anext(deltas)  # r1 is in flight now
            live = await client.post("/admin/cancel/r1", headers=ADMIN)
            await deltas.aclose()
            gone = await client.post("/admin/cancel/r1", headers=ADMIN)
        return [live.json(), gone.json()]

    live, gone = asyncio.run(go())
    assert live["cancelled"] is True and gone["cancelled"] is False
    assert "r1" in engine.aborted


def test_swap_model_reaches_the_engine(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    engine = FakeEngine()
    body = {"model": str(tmp_path), "version": "v2", "mode": "drain"}
    resp = call(engine, TOKEN, ADMIN, "POST", "/admin/swap-model", json=body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["version"] == "v2" and resp.json()["previous_version"] == "v-test"
    assert engine.swaps == [(str(tmp_path.resolve()), "v2", "drain")]
