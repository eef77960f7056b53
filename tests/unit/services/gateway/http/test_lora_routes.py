"""vLLM's LoRA routes (services/gateway/http/lora_routes.py), /v1/models' adapter cards and a
request's `model` naming an adapter, in process against the fake engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from common.config import ServerConfig
from common.messages import LoraAdapterResult
from services.gateway.http.app import create_app
from tests.fake_engine import MODEL, FakeEngine

TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
API = {"Authorization": "Bearer api-key"}


def call(
    engine: FakeEngine, method: str, url: str, headers: dict[str, str], **kw: Any
) -> httpx.Response:
    async def go() -> httpx.Response:
        server = ServerConfig(api_key="api-key", admin_token=TOKEN, model_root=kw.pop("root", ""))
        app = create_app(engine, server)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, url, headers=headers, **kw)

    return asyncio.run(go())


def _adapter(tmp_path: Path, name: str = "sql") -> Path:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "adapter_config.json").write_text('{"r": 8}')
    return folder


def _engine() -> FakeEngine:
    engine = FakeEngine()
    engine.lora_enabled = True
    return engine


def test_load_list_use_unload(tmp_path: Path) -> None:
    engine, folder = _engine(), _adapter(tmp_path)
    body = {"lora_name": "sql", "lora_path": str(folder)}
    resp = call(engine, "POST", "/v1/load_lora_adapter", ADMIN, json=body)
    assert resp.status_code == 200
    assert resp.text == "Success: LoRA adapter 'sql' added successfully."
    cards = call(engine, "GET", "/v1/models", API).json()["data"]
    assert [c["id"] for c in cards] == [MODEL, "sql"]
    assert (cards[1]["parent"], cards[1]["root"]) == (MODEL, str(folder))
    assert call(engine, "GET", "/v1/models/sql", API).json()["parent"] == MODEL
    chat = {"model": "sql", "messages": [{"role": "user", "content": "hi there"}]}
    resp = call(engine, "POST", "/v1/chat/completions", API, json=chat)
    assert resp.status_code == 200 and resp.json()["model"] == "sql"
    assert engine.requests[-1].lora_name == "sql"
    base = {"model": MODEL, "prompt": "hi"}
    assert call(engine, "POST", "/v1/completions", API, json=base).status_code == 200
    assert engine.requests[-1].lora_name == ""
    resp = call(engine, "POST", "/v1/unload_lora_adapter", ADMIN, json={"lora_name": "sql"})
    assert resp.status_code == 200 and "removed" in resp.text
    resp = call(engine, "POST", "/v1/chat/completions", API, json=chat)
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_routes_want_the_admin_token(tmp_path: Path) -> None:
    body = {"lora_name": "sql", "lora_path": str(_adapter(tmp_path))}
    resp = call(_engine(), "POST", "/v1/load_lora_adapter", API, json=body)
    assert resp.status_code == 401


def test_without_enable_lora_the_routes_are_404(tmp_path: Path) -> None:
    body = {"lora_name": "sql", "lora_path": str(_adapter(tmp_path))}
    resp = call(FakeEngine(), "POST", "/v1/load_lora_adapter", ADMIN, json=body)
    assert resp.status_code == 404 and "--enable-lora" in resp.json()["error"]["message"]


def test_bad_bodies_and_paths_name_the_field(tmp_path: Path) -> None:
    engine = _engine()
    for body, field, status in [
        ({"lora_path": "/x"}, "lora_name", 400),
        ({"lora_name": "a b", "lora_path": "/x"}, "lora_name", 400),
        ({"lora_name": MODEL, "lora_path": "/x"}, "lora_name", 400),
        ({"lora_name": "a"}, "lora_path", 400),
        ({"lora_name": "a", "lora_path": str(tmp_path)}, "lora_path", 404),
    ]:
        resp = call(engine, "POST", "/v1/load_lora_adapter", ADMIN, json=body)
        assert (resp.status_code, resp.json()["error"]["param"]) == (status, field), body
    outside = {"lora_name": "a", "lora_path": str(_adapter(tmp_path))}
    resp = call(engine, "POST", "/v1/load_lora_adapter", ADMIN, json=outside, root="/nonexistent")
    assert resp.status_code == 403


def test_the_workers_refusal_names_file_and_field(tmp_path: Path) -> None:
    engine = _engine()
    error = "lora_path: adapter_config.json: r: rank 64 is above --max-lora-rank 16"
    engine.lora_refusal = LoraAdapterResult(0, "big", 400, error)
    body = {"lora_name": "big", "lora_path": str(_adapter(tmp_path))}
    resp = call(engine, "POST", "/v1/load_lora_adapter", ADMIN, json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == error
    assert resp.json()["error"]["param"] == "lora_path"


def test_unload_of_an_unknown_adapter_is_404() -> None:
    resp = call(_engine(), "POST", "/v1/unload_lora_adapter", ADMIN, json={"lora_name": "x"})
    assert resp.status_code == 404


def test_base_cards_have_no_parent_and_no_adapters_without_a_model() -> None:
    engine = _engine()
    engine.lora_adapters["sql"] = "/a/sql"
    cards = call(engine, "GET", "/v1/models", API).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL, None), ("sql", MODEL)]
    engine.model_name = ""  # starting: nothing is served, adapters neither
    assert call(engine, "GET", "/v1/models", API).json()["data"] == []
    assert call(engine, "GET", "/v1/models/sql", API).status_code == 404
