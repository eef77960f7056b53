"""The console's routes (services/gateway/http/console/__init__.py) and its session cookie
(services/gateway/admin_auth.py), in process against the fake engine: the login form, the
cookie it sets, what the cookie opens (and what it alone does not), and the closed console
when no admin token is configured."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from common.config import ServerConfig
from services.gateway.admin_auth import (
    SESSION_COOKIE,
    SESSION_TTL_S,
    check_session_cookie,
    session_cookie,
)
from services.gateway.http.app import create_app
from tests.fake_engine import FakeEngine

TOKEN = "console-secret"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CONSOLE = {"X-Shuttle-Console": "1"}


def calls(
    admin_token: str | None, *requests: tuple[str, str, dict[str, Any]]
) -> list[httpx.Response]:
    """Each (method, url, httpx keywords) in turn, on one client (its cookie jar kept)."""

    async def go() -> list[httpx.Response]:
        engine = FakeEngine(stats={"num_running": 0})
        app = create_app(engine, ServerConfig(admin_token=admin_token or ""))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.request(m, url, **kw) for m, url, kw in requests]

    return asyncio.run(go())


def login(token: str) -> tuple[str, str, dict[str, Any]]:
    return ("POST", "/console/login", {"json": {"token": token}})


def test_the_page_without_a_token_redirects_to_the_login_form() -> None:
    page, form = calls(TOKEN, ("GET", "/console", {}), ("GET", "/console/login", {}))
    assert page.status_code == 303 and page.headers["location"] == "/console/login"
    assert form.status_code == 200 and '<form method="post" action="/console/login"' in form.text
    assert "{{error}}" not in form.text


def test_the_bearer_header_opens_the_page() -> None:
    (page,) = calls(TOKEN, ("GET", "/console", {"headers": ADMIN}))
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="/console/static/console.js"' in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]


def test_logging_in_sets_a_strict_httponly_cookie_that_opens_the_page_and_feeds() -> None:
    answer, page, stats = calls(
        TOKEN, login(TOKEN), ("GET", "/console", {}), ("GET", "/admin/stats", {})
    )
    assert answer.status_code == 200 and answer.json() == {"ok": True}
    set_cookie = answer.headers["set-cookie"].lower()
    assert set_cookie.startswith(f"{SESSION_COOKIE}=")
    assert "httponly" in set_cookie and "samesite=strict" in set_cookie and "path=/" in set_cookie
    assert TOKEN not in set_cookie  # the cookie stands for the token, it does not hold it
    assert page.status_code == 200 and "shuttle console" in page.text
    assert stats.status_code == 200 and stats.json() == {"num_running": 0}


def test_a_wrong_token_is_401_saying_why() -> None:
    answer, page, malformed = calls(
        TOKEN, login("nope"), ("GET", "/console", {}), ("POST", "/console/login", {"json": [1]})
    )
    assert answer.status_code == 401 and "set-cookie" not in answer.headers
    assert answer.json()["error"]["message"].startswith("invalid or missing admin token")
    assert page.status_code == 303  # no session came of it
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "token"


def test_a_cookie_alone_changes_nothing_without_the_console_header() -> None:
    _, bare, with_header = calls(
        TOKEN,
        login(TOKEN),
        ("POST", "/admin/cancel/r1", {}),
        ("POST", "/admin/cancel/r1", {"headers": CONSOLE}),
    )
    assert bare.status_code == 401  # a cross-site form could send the cookie, not the header
    assert with_header.status_code == 200 and with_header.json()["id"] == "r1"


def test_logging_out_clears_the_cookie() -> None:
    _, out = calls(TOKEN, login(TOKEN), ("POST", "/console/logout", {}))
    assert out.status_code == 303 and out.headers["location"] == "/console/login"
    assert out.headers["set-cookie"].startswith(f'{SESSION_COOKIE}=""')


def test_without_an_admin_token_the_console_is_closed() -> None:
    page, form, answer, feed = calls(
        None,
        ("GET", "/console", {"headers": {"Authorization": "Bearer "}}),
        ("GET", "/console/login", {}),
        login(""),
        ("GET", "/admin/events", {}),
    )
    assert page.status_code == 303
    assert "no admin token is configured" in form.text
    assert answer.status_code == 401 and "set-cookie" not in answer.headers
    assert feed.status_code == 401
    assert "no admin token is configured" in feed.json()["error"]["message"]


def test_the_feed_wants_the_token_or_the_cookie() -> None:
    (missing, wrong) = calls(
        TOKEN,
        ("GET", "/admin/events", {}),
        ("GET", "/admin/events", {"headers": {"Authorization": "Bearer nope"}}),
    )
    assert missing.status_code == wrong.status_code == 401


def test_static_files_are_served_and_nothing_else() -> None:
    js, css, outside, unknown, page = calls(
        TOKEN,
        ("GET", "/console/static/console.js", {}),
        ("GET", "/console/static/console.css", {}),
        ("GET", "/console/static/..%2F__init__.py", {}),
        ("GET", "/console/static/nope.js", {}),
        ("GET", "/console/static/index.html", {}),  # the page only at /console, behind login
    )
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "EventSource" in js.text
    assert css.status_code == 200 and css.headers["content-type"].startswith("text/css")
    assert outside.status_code == unknown.status_code == page.status_code == 404


def test_a_session_cookie_expires_and_is_bound_to_its_token() -> None:
    cookie = session_cookie(TOKEN, now=1000.0)
    assert check_session_cookie(cookie, TOKEN, now=1000.0 + SESSION_TTL_S - 1)
    assert not check_session_cookie(cookie, TOKEN, now=1000.0 + SESSION_TTL_S)
    assert not check_session_cookie(cookie, "another-token", now=1000.0)
    assert not check_session_cookie(cookie, None, now=1000.0)
    expiry, _, signature = cookie.partition(".")
    forged = f"{int(expiry) + 3600}.{signature}"  # a later expiry, the old signature
    assert not check_session_cookie(forged, TOKEN, now=1000.0)
    for junk in ("", "x", ".", "abc.def", f"{expiry}."):
        assert not check_session_cookie(junk, TOKEN, now=1000.0)
