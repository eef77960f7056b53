"""What both front ends' admin APIs (services/gateway/http/admin.py, the gRPC Admin service
in services/gateway/grpc/server.py) check alike: the admin token, and the folder a swap may
load."""

from __future__ import annotations

import hmac
from pathlib import Path

from common.gguf_meta import is_gguf_file
from services.gateway.openai.request_errors import RequestRejected

NO_ADMIN_TOKEN = (
    "no admin token is configured on this server (set --admin-token or "
    "SHUTTLE_ADMIN_TOKEN); the admin API is disabled"
)
BAD_ADMIN_TOKEN = "invalid or missing admin token; send 'Authorization: Bearer <token>'"


def check_admin_token(authorization: str | None, admin_token: str | None) -> str | None:
    """None if `authorization` (the header's value) carries the admin token, else why not."""
    if not admin_token:
        return NO_ADMIN_TOKEN
    expected = f"Bearer {admin_token}".encode()
    # constant time: no token guessing by timing
    if not hmac.compare_digest((authorization or "").encode(), expected):
        return BAD_ADMIN_TOKEN
    return None


def _inside_root(path: str, model_root: str | None, field: str) -> Path:
    """`path` resolved inside --model-root when one is set (no `..` or link escapes)."""
    folder = Path(path).expanduser()
    if model_root:
        root = Path(model_root).resolve()
        folder = (root / folder).resolve() if not folder.is_absolute() else folder.resolve()
        if not folder.is_relative_to(root):
            raise RequestRejected(f"{field}: {path!r} is outside the model root {root}", field, 403)
    return folder


def resolve_adapter_folder(path: str, model_root: str | None) -> Path:
    """The folder a LoRA load may read: inside --model-root when one is set, and a PEFT
    adapter folder (adapter_config.json); what is in it the worker checks."""
    folder = _inside_root(path, model_root, "lora_path")
    if not (folder / "adapter_config.json").is_file():
        raise RequestRejected(
            f"lora_path: no PEFT adapter folder (adapter_config.json) at {path!r}",
            "lora_path",
            404,
        )
    return folder


def resolve_model_folder(path: str, model_root: str | None) -> Path:
    """The folder a swap may load: inside --model-root when one is set (no `..` or link
    escapes), and a Hugging Face folder (config.json) or a GGUF file."""
    folder = _inside_root(path, model_root, "model")
    if not (folder / "config.json").is_file() and not is_gguf_file(folder):
        raise RequestRejected(
            f"model: no Hugging Face model folder (config.json) or GGUF file at {path!r}",
            "model",
            404,
        )
    return folder
