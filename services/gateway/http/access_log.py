"""The access log: one info line per HTTP request once its response is sent (streams
included), on logger `shuttle.access`:

    request chatcmpl-1f.. POST /v1/chat/completions 200 prompt_tokens=12 output_tokens=40
        ttft=0.081s time=0.912s

and for a refusal (any status >= 400) the reason, as the client read it:

    refused chatcmpl-2a.. POST /v1/chat/completions 400 (max_token: unknown field; ...)

A client that went away before its answer (mid-body, or while it waited) is nginx's 499,
neither a refusal nor a server error:

    closed chatcmpl-3b.. POST /v1/chat/completions 499 (client closed the request)

The fields are also in the JSON log line's `access` object. Routes that generate hand an
`AccessRecord` to their delta reader (it sees every delta); the error handler notes the
refusal's message. `--no-access-log` leaves the middleware out.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.engine.client import OutputDelta

log = logging.getLogger("shuttle.access")

REQUEST_ID_HEADER = b"x-request-id"
CLIENT_CLOSED = 499  # nginx's "client closed request": the client left before its answer
_NO_PATH_LOGGED = ("/health", "/ping", "/metrics")  # probes: every few seconds, say nothing


@dataclasses.dataclass(slots=True)
class AccessRecord:
    """What one request's log line says about generation: token counts and time to the
    first output token (counts per sequence; each prompt once)."""

    n: int = 1  # choices per prompt: choice index // n is the prompt's
    started: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: float | None = None
    _num_prompt_tokens: dict[int, int] = dataclasses.field(default_factory=dict)
    _num_output_tokens: dict[int, int] = dataclasses.field(default_factory=dict)

    def see(self, delta: OutputDelta) -> None:
        """Count one delta (of choice `delta.index`)."""
        if self.first_token_at is None and delta.token_ids:
            self.first_token_at = time.monotonic()
        self._num_prompt_tokens[delta.index // self.n] = delta.num_prompt_tokens
        self._num_output_tokens[delta.index] = delta.num_output_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return sum(self._num_prompt_tokens.values())

    @property
    def num_output_tokens(self) -> int:
        return sum(self._num_output_tokens.values())

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started


def note_refusal(state: Any, reason: str) -> None:
    """Keep a refusal's message for the access line (`state`: the request's state)."""
    state.refusal = reason


class AccessLogMiddleware:
    """Pure ASGI, so it sees the last byte of a stream, not just the response's start."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _NO_PATH_LOGGED:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = [500]  # what a handler that never answered amounts to
        request_id = [_header(scope, REQUEST_ID_HEADER)]
        scope.setdefault("state", {})  # shared with the routes' request.state

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                request_id[0] = _header(message, REQUEST_ID_HEADER) or request_id[0]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            write_line(scope, status[0], request_id[0], time.monotonic() - started)


def write_line(scope: Scope, status: int, request_id: str | None, seconds: float) -> None:
    """Log the access line of one finished request."""
    state = scope.get("state") or {}
    fields: dict[str, Any] = {
        "method": scope["method"],
        "route": scope["path"],
        "status": status,
        "time_s": round(seconds, 4),
    }
    head = f"{request_id or '-'} {scope['method']} {scope['path']} {status}"
    if status >= 400:
        fields["reason"] = state.get("refusal", "")
        word = "closed" if status == CLIENT_CLOSED else "refused"
        log.info("%s %s (%s)", word, head, fields["reason"], extra=_extra(request_id, fields))
        return
    record = state.get("access")
    text = ""
    if isinstance(record, AccessRecord):
        ttft = record.ttft
        fields |= {
            "prompt_tokens": record.num_prompt_tokens,
            "output_tokens": record.num_output_tokens,
            "ttft_s": None if ttft is None else round(ttft, 4),
        }
        text = (
            f" prompt_tokens={record.num_prompt_tokens} output_tokens={record.num_output_tokens}"
            f" ttft={'-' if ttft is None else f'{ttft:.3f}s'}"
        )
    log.info("request %s%s time=%.3fs", head, text, seconds, extra=_extra(request_id, fields))


def _extra(request_id: str | None, fields: dict[str, Any]) -> dict[str, Any]:
    return {"request_id": request_id, "access": fields}


def _header(scope: Scope | Message, name: bytes) -> str | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return bytes(value).decode("latin-1")
    return None
