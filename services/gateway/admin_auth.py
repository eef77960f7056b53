"""What both front ends' admin APIs (services/gateway/http/admin.py, the gRPC Admin service
in services/gateway/grpc/server.py) check alike: the admin token, and the folder a swap may
load; and the operator console's session cookie, which stands for the token over HTTP.

A session cookie is `<expiry>.<HMAC-SHA256 of the expiry, keyed by the admin token>`: the
gateway keeps no session state (any gateway process with the same token accepts it), a
cookie expires on its own, and changing the token ends every session."""

from __future__ import annotations

import hashlib
import hmac
import time
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


SESSION_COOKIE = "shuttle_console"
SESSION_TTL_S = 12 * 3600


def session_cookie(admin_token: str, now: float | None = None) -> str:
    """A session cookie's value for `admin_token`, valid SESSION_TTL_S from `now`."""
    expiry = str(int((time.time() if now is None else now) + SESSION_TTL_S))
    return f"{expiry}.{_sign(admin_token, expiry)}"


def check_session_cookie(
    cookie: str | None, admin_token: str | None, now: float | None = None
) -> bool:
    """Whether `cookie` is an unexpired session cookie made with `admin_token`."""
    if not admin_token or not cookie:
        return False
    expiry, _, signature = cookie.partition(".")
    if not expiry.isdigit() or int(expiry) <= (time.time() if now is None else now):
        return False
    # constant time, as the token's own check
    return hmac.compare_digest(signature.encode(), _sign(admin_token, expiry).encode())


def _sign(admin_token: str, expiry: str) -> str:
    message = f"shuttle console session {expiry}".encode()
    return hmac.new(admin_token.encode(), message, hashlib.sha256).hexdigest()


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
