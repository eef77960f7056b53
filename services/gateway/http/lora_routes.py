"""vLLM's runtime LoRA routes, behind the admin token here (vLLM leaves them open):

    POST /v1/load_lora_adapter    {"lora_name": NAME, "lora_path": PEFT folder}
    POST /v1/unload_lora_adapter  {"lora_name": NAME}

As vLLM answers: 200 with a plain-text "Success: ..." line; a refusal is the usual JSON
error naming the field (400: a malformed adapter, naming its file and field, a name loaded
already; 404: an unknown name on unload, a folder with no adapter). Without --enable-lora
both are 404. A path must lie inside --model-root when one is set (as swap-model's).
After an unload the name is refused at once (404); requests already running finish first.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request
from starlette.responses import PlainTextResponse, Response

from common.config import ConfigError
from common.lora_config import check_lora_name
from common.messages import LoraAdapterResult
from services.gateway.admin_auth import resolve_adapter_folder
from services.gateway.engine.client import EngineClient
from services.gateway.http.admin import require_admin
from services.gateway.openai.request_errors import RequestRejected


def lora_router(
    engine: EngineClient, admin_token: str | None, model_root: str | None = None
) -> APIRouter:
    """The two LoRA routes over `engine`, guarded by `admin_token`."""
    router = APIRouter(prefix="/v1", dependencies=[Depends(require_admin(admin_token))])

    async def load(request: Request) -> Response:
        body = _body(await request.body(), ("lora_name", "lora_path"))
        name = body["lora_name"]
        if name in engine.model_names:
            raise RequestRejected(f"lora_name: `{name}` is the base model's name", "lora_name")
        path = resolve_adapter_folder(body["lora_path"], model_root)
        result = await engine.load_lora(name, str(path))
        return _answer(result, f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(request: Request) -> Response:
        name = _body(await request.body(), ("lora_name",))["lora_name"]
        result = await engine.unload_lora(name)
        return _answer(result, f"Success: LoRA adapter '{name}' removed successfully.")

    async def enabled() -> None:
        if not engine.lora_enabled:
            raise RequestRejected(
                "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                None,
                404,
            )

    router.add_api_route(
        "/load_lora_adapter", load, methods=["POST"], dependencies=[Depends(enabled)]
    )
    router.add_api_route(
        "/unload_lora_adapter", unload, methods=["POST"], dependencies=[Depends(enabled)]
    )
    return router


def _body(raw: bytes, fields: tuple[str, ...]) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestRejected(f"body: not valid JSON ({e})", "body") from None
    if not isinstance(body, dict):
        raise RequestRejected("body: a JSON object is required", "body")
    for field in fields:
        if not isinstance(body.get(field), str) or not body[field]:
            raise RequestRejected(f"{field}: a non-empty string is required", field)
    try:
        check_lora_name(body["lora_name"])
    except ConfigError as e:
        raise RequestRejected(str(e), "lora_name") from None
    return body


def _answer(result: LoraAdapterResult, success: str) -> Response:
    if result.status == 200:
        return PlainTextResponse(success)
    field = result.error.partition(":")[0] if ":" in result.error else None
    param = field if field in ("lora_name", "lora_path", "base_model_name") else "lora_path"
    raise RequestRejected(result.error, param, result.status)
