"""Request-body limits for the HTTP front end, as pure ASGI middleware (it sees the bytes
before any route parses them).

- A body larger than `max_bytes` is refused with 413: at once when Content-Length says so,
  else as soon as the bytes read pass the limit (chunked uploads). The rest of the body is
  read and dropped before the answer (at most `MAX_DRAIN_BYTES` within `MAX_DRAIN_S`): a
  server that closes a connection with the body unread resets it, and a client still
  sending (httpx, the openai client, curl) then sees a reset instead of the 413.
- A client that pauses longer than `body_timeout` seconds in the middle of its body gets 408
  and its connection back; the handler waiting on it is released (uvicorn alone would wait
  for the socket to close).
- A POST whose body is declared as something other than JSON gets 415.

Refusals raised while a route reads the body are `RequestRejected`, so the app's own error
handler writes them, OpenAI-shaped and with the request id, like every other refusal.
"""

from __future__ import annotations

import asyncio
import dataclasses

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.http.errors import error_type
from services.gateway.openai.protocol import REQUEST_ID_PATTERN
from services.gateway.openai.request_errors import RequestRejected

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
DEFAULT_BODY_TIMEOUT_S = 30.0
# a refused body is read to its end (so the client can read the refusal) up to these bounds;
# past them the connection is closed with the rest unread
MAX_DRAIN_BYTES = 64 * 1024 * 1024
MAX_DRAIN_S = 10.0


@dataclasses.dataclass(frozen=True, slots=True)
class BodyLimits:
    """The limits one app enforces."""

    max_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S


class BodyTooLarge(RequestRejected):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            f"body: the request body is larger than the limit of {max_bytes} bytes "
            "(--max-request-bytes)",
            None,
            413,
        )


class BodyStalled(RequestRejected):
    def __init__(self, timeout: float) -> None:
        super().__init__(
            f"body: the client sent no data for {timeout:g} s in the middle of the request "
            "body (--request-body-timeout)",
            None,
            408,
        )


class BodyLimitMiddleware:
    """Enforces `BodyLimits` on every HTTP request (see the module docstring)."""

    def __init__(self, app: ASGIApp, limits: BodyLimits = BodyLimits()) -> None:
        self.app = app
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if (refusal := _refuse_early(scope, self.limits.max_bytes)) is not None:
            # a client waiting for "100 Continue" has sent no body: it gets the refusal
            # instead (reading would ask for the body)
            if not _expects_continue(scope):
                await drain_body(receive)
            await _send_error(send, refusal, _client_request_id(scope))
            return
        await self.app(scope, _BodyReader(receive, self.limits), send)


def _refuse_early(scope: Scope, max_bytes: int) -> RequestRejected | None:
    """A refusal the headers alone justify: a declared size over the limit, or a body that
    is declared as something other than JSON."""
    headers = dict(scope.get("headers") or [])
    length = headers.get(b"content-length")
    if length is not None:
        try:
            declared = int(length)
        except ValueError:
            return RequestRejected("Content-Length: must be an integer", "Content-Length")
        if declared > max_bytes:
            return BodyTooLarge(max_bytes)
    has_body = length not in (None, b"0") or b"transfer-encoding" in headers
    content_type = headers.get(b"content-type")
    if scope.get("method") == "POST" and has_body and content_type is not None:
        media = content_type.split(b";")[0].strip().lower()
        if media != b"application/json" and not media.endswith(b"+json"):
            shown = media.decode("latin-1")[:60]
            return RequestRejected(
                f"Content-Type: must be application/json, got {shown!r}", "Content-Type", 415
            )
    return None


class _BodyReader:
    """`receive` that counts body bytes and times out a stalled body."""

    def __init__(self, receive: Receive, limits: BodyLimits) -> None:
        self._receive = receive
        self._limits = limits
        self._num_bytes = 0
        self._body_done = False

    async def __call__(self) -> Message:
        if self._body_done:  # after the body only a disconnect comes; waiting is normal then
            return await self._receive()
        try:
            message = await asyncio.wait_for(self._receive(), self._limits.body_timeout)
        except TimeoutError:
            raise BodyStalled(self._limits.body_timeout) from None
        if message["type"] == "http.request":
            self._num_bytes += len(message.get("body", b""))
            self._body_done = not message.get("more_body", False)
            if self._num_bytes > self._limits.max_bytes:
                if not self._body_done:
                    await drain_body(self._receive)
                    self._body_done = True
                raise BodyTooLarge(self._limits.max_bytes)
        else:
            self._body_done = True
        return message


async def drain_body(
    receive: Receive, max_bytes: int = MAX_DRAIN_BYTES, timeout: float = MAX_DRAIN_S
) -> bool:
    """Read and drop the rest of a request body; True if it was read to its end (or the
    client left), False if it passed `max_bytes` or `timeout` seconds first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    num_bytes = 0
    while num_bytes <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), deadline - loop.time())
        except TimeoutError:
            return False
        if message["type"] != "http.request" or not message.get("more_body", False):
            return True
        num_bytes += len(message.get("body", b""))
    return False


def _expects_continue(scope: Scope) -> bool:
    expect = dict(scope.get("headers") or []).get(b"expect", b"")
    return bool(expect.lower() == b"100-continue")


def _client_request_id(scope: Scope) -> bytes | None:
    """The client's X-Request-Id when it is a valid one, to echo in a refusal."""
    value = dict(scope.get("headers") or []).get(b"x-request-id")
    if value is None or not REQUEST_ID_PATTERN.fullmatch(value.decode("latin-1")):
        return None
    return value


async def _send_error(send: Send, refusal: RequestRejected, request_id: bytes | None) -> None:
    error = {
        "message": refusal.message,
        "type": error_type(refusal.status),
        "param": refusal.param,
        "code": refusal.status,
    }
    body = orjson.dumps({"error": error})
    await send(
        {
            "type": "http.response.start",
            "status": refusal.status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
                *([(b"x-request-id", request_id)] if request_id is not None else []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
