"""The operator console: one page at GET /console, its assets shipped in this package
(static/: no CDN, no build step), fed by the admin API and one event feed.

    GET  /console                 the page; without the admin token (bearer header or the
                                  session cookie) a redirect (303) to the login form
    GET  /console/login           the login form
    POST /console/login           {"token": the admin token} (JSON, as every POST here):
                                  sets the session cookie (HttpOnly, SameSite=Strict)
    POST /console/logout          clears the cookie
    GET  /console/static/{file}   the page's script, styles and login form
    GET  /admin/events            the event feed (events.py), behind the admin token

The page acts through the admin routes that exist (cancel, swap-model, the LoRA routes) and
chats through /v1/chat/completions; it holds no state of its own beyond its plots' history.
With no admin token configured the console is closed as the admin API is: the login form
says so and every feed answers 401.
"""

from __future__ import annotations

import html
from importlib import resources

import orjson
from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import RedirectResponse, Response

from services.gateway.admin_auth import (
    NO_ADMIN_TOKEN,
    SESSION_COOKIE,
    SESSION_TTL_S,
    check_admin_token,
    session_cookie,
)
from services.gateway.engine.client import EngineClient
from services.gateway.engine.live_requests import LiveRequests, chain_observers
from services.gateway.http.admin import has_console_session, require_admin
from services.gateway.http.console.events import ConsoleEvents
from services.gateway.http.streaming import SSE_HEADERS, SseResponse
from services.gateway.openai.protocol import RequestRejected

_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
_STATIC = resources.files(__name__) / "static"
# what GET /console/static/{name} serves: scripts and styles (the pages have their routes)
_ASSETS = frozenset(p.name for p in _STATIC.iterdir() if p.name.endswith((".js", ".css")))
# the page runs only its own files; nothing inline, nothing from elsewhere
_CSP = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'"


def install_console(app: FastAPI, engine: EngineClient, admin_token: str | None) -> ConsoleEvents:
    """Serve the console on `app`; watch `engine`'s requests for it (after whoever watches
    them already, /metrics)."""
    live = LiveRequests(lambda: engine.model_name)
    engine.observer = chain_observers(engine.observer, live.observe)
    events = ConsoleEvents(engine, live)
    app.include_router(_router(events, admin_token))
    app.state.console = events
    return events


def _router(events: ConsoleEvents, admin_token: str | None) -> APIRouter:
    router = APIRouter()

    async def page(request: Request) -> Response:
        why = check_admin_token(request.headers.get("authorization"), admin_token)
        if why is not None and not has_console_session(request, admin_token):
            return RedirectResponse("/console/login", 303)
        return _static("index.html")

    async def login_form() -> Response:
        return _login_page("" if admin_token else NO_ADMIN_TOKEN)

    async def login(request: Request) -> Response:
        token = _token_of(await request.body())
        why = check_admin_token(f"Bearer {token}", admin_token)
        if why is not None or admin_token is None:
            raise RequestRejected(why or NO_ADMIN_TOKEN, "token", 401)
        answer = Response(b'{"ok":true}', media_type="application/json")
        answer.set_cookie(
            SESSION_COOKIE,
            session_cookie(admin_token),
            max_age=SESSION_TTL_S,
            path="/",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return answer

    async def logout() -> Response:
        answer = RedirectResponse("/console/login", 303)
        answer.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return answer

    async def asset(name: str) -> Response:
        if name not in _ASSETS:  # (no path walks out of static/ either)
            return Response(b"not found", 404, media_type="text/plain")
        return _static(name)

    async def feed() -> Response:
        return SseResponse(events.stream(), headers=SSE_HEADERS)

    router.add_api_route("/console", page, methods=["GET"], include_in_schema=False)
    router.add_api_route("/console/login", login_form, methods=["GET"], include_in_schema=False)
    router.add_api_route("/console/login", login, methods=["POST"], include_in_schema=False)
    router.add_api_route("/console/logout", logout, methods=["POST"], include_in_schema=False)
    router.add_api_route("/console/static/{name}", asset, methods=["GET"], include_in_schema=False)
    router.add_api_route(
        "/admin/events",
        feed,
        methods=["GET"],
        dependencies=[Depends(require_admin(admin_token))],
        include_in_schema=False,
    )
    return router


def _token_of(raw: bytes) -> str:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise RequestRejected(f"body: not valid JSON ({e})", "body") from None
    if not isinstance(body, dict) or not isinstance(body.get("token"), str):
        raise RequestRejected("token: the admin token (a string) is required", "token")
    return str(body["token"])


def _login_page(error: str, status: int = 200) -> Response:
    """The login form, saying why the last try failed (or that no token is configured)."""
    text = (_STATIC / "login.html").read_text().replace("{{error}}", html.escape(error))
    headers = {"Cache-Control": "no-store", "Content-Security-Policy": _CSP}
    return Response(text, status, headers, media_type="text/html")


def _static(name: str) -> Response:
    """A file of static/, never cached stale."""
    path = _STATIC / name
    suffix = name[name.rfind(".") :]
    headers = {"Cache-Control": "no-cache", "Content-Security-Policy": _CSP}
    return Response(path.read_bytes(), headers=headers, media_type=_TYPES[suffix])
