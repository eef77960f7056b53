"""OpenAI-shaped errors for the HTTP front end: `{"error": {"message", "type", "param",
"code"}}` with the status as code, the request id echoed when it is known, and Retry-After on
429 and 503."""

from __future__ import annotations

import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from services.gateway.engine.client import RequestFailed
from services.gateway.http.access_log import CLIENT_CLOSED, note_refusal
from services.gateway.http.deltas import ClientGone
from services.gateway.openai.protocol import REQUEST_ID_PATTERN
from services.gateway.openai.request_errors import RequestRejected, describe_error

REQUEST_ID_HEADER = "X-Request-Id"
_CLIENT_GONE = CLIENT_CLOSED  # nobody reads it, logs do
ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    429: "RateLimitError",
    _CLIENT_GONE: "ClientClosedRequest",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


def error_response(
    request: Request, status: int, message: str, param: str | None = None
) -> Response:
    """An OpenAI-shaped error, echoing the request id when it is known."""
    body = {"message": message, "type": error_type(status), "param": param, "code": status}
    note_refusal(request.state, message)  # the access log's line names the reason
    headers = {}
    if (request_id := _known_request_id(request)) is not None:
        headers[REQUEST_ID_HEADER] = request_id
    if status in (429, 503):
        headers["Retry-After"] = "1"
    return _json({"error": body}, status, headers)


def _known_request_id(request: Request) -> str | None:
    """The request's id once a route chose it; before that (a refusal by the API key check,
    say) the client's own `X-Request-Id` when it is a valid one."""
    request_id = getattr(request.state, "request_id", None)
    if request_id is None:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        if request_id is not None and not REQUEST_ID_PATTERN.fullmatch(request_id):
            return None
    return request_id


def take_request_id(request: Request, prefix: str) -> str:
    """The request's id: the client's X-Request-Id if valid (else a 400), or `prefix` and a
    fresh hex; remembered on the request, so every refusal echoes it."""
    request_id = request.headers.get(REQUEST_ID_HEADER)
    if request_id is None:
        request_id = prefix + uuid.uuid4().hex
    elif not REQUEST_ID_PATTERN.fullmatch(request_id):
        raise RequestRejected(
            f"{REQUEST_ID_HEADER}: must be 1..128 characters of [A-Za-z0-9._:-]",
            REQUEST_ID_HEADER,
        )
    request.state.request_id = request_id  # the error handlers echo it too
    return request_id


def install_error_handlers(app: FastAPI) -> None:
    """Every refusal and failure as an OpenAI error body (never FastAPI's 422)."""

    async def rejected(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestRejected | RequestFailed)
        return error_response(request, exc.status, exc.message, exc.param)

    async def invalid(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        error = dict(exc.errors()[0])
        error["loc"] = tuple(error.get("loc", ()))[1:]  # drop "body" / "header" / "query"
        message, param = describe_error(error)
        return error_response(request, 400, message, param)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(request, exc.status_code, str(exc.detail))

    async def client_gone(request: Request, exc: Exception) -> Response:
        return error_response(request, _CLIENT_GONE, "client closed the request")

    async def internal(request: Request, exc: Exception) -> Response:
        return error_response(request, 500, "internal error")

    app.add_exception_handler(RequestRejected, rejected)
    app.add_exception_handler(RequestFailed, rejected)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(ClientGone, client_gone)
    # a client that disconnects in the middle of its body: routine, not an app error (500)
    app.add_exception_handler(ClientDisconnect, client_gone)
    app.add_exception_handler(Exception, internal)


def _json(obj: Any, status: int, headers: dict[str, str]) -> Response:
    return Response(orjson.dumps(obj), status, headers, media_type="application/json")
