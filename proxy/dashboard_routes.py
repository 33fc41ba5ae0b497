"""`/dashboard`: the operator view in a browser, behind the proxy's key.

Routes: `/dashboard` (the page), `/dashboard/static/{app.js,app.css}`, `/dashboard/state` (the JSON that
both the page and `hyperharness top` read, polled once a second).

Login, and why a cookie: every route but /health needs the key (proxy/auth.py), and a browser cannot
add a header to a plain navigation, so the page could not even load. A key kept in sessionStorage would
need an unauthenticated HTML shell; instead `DashboardLogin` (pure ASGI, outside `Guard`, which
stays as it is) serves a login form at `/dashboard/login`; a POST of the right key sets an HttpOnly,
SameSite=Strict cookie scoped to `/dashboard`, holding an HMAC of the key (not the key). For
`/dashboard*` requests only, a valid cookie is turned into the bearer header `Guard` checks, so
the cookie can never reach the API routes, and the shell itself needs the key like everything else.
Scripts (`top`, tests) send `Authorization: Bearer KEY` as for any route. A browser navigation without
a valid cookie is sent to the login form; anything else without a key gets `Guard`'s 401. Any of the
proxy's keys logs in; the cookie is bound to the key that was entered.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from http.cookies import SimpleCookie
from importlib import resources
from urllib.parse import parse_qs

from fastapi import APIRouter
from fastapi.responses import RedirectResponse, Response

from proxy.auth import ASGIApp, KeyRing, Receive, Scope, Send, presented_keys
from proxy.errors import NotFound
from proxy.http import json_response
from proxy.services import Services

PREFIX = "/dashboard"
LOGIN = PREFIX + "/login"
LOGOUT = PREFIX + "/logout"
LOGIN_CSS = PREFIX + "/login.css"
COOKIE = "hh_dashboard"
_STATIC = {"app.js": "text/javascript; charset=utf-8", "app.css": "text/css; charset=utf-8"}
# The page loads nothing from elsewhere and runs no inline script.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'")
_HEADERS = {"content-security-policy": _CSP, "x-content-type-options": "nosniff", "cache-control": "no-store",
            "referrer-policy": "no-referrer"}


def asset(name: str) -> bytes:
    return resources.files("proxy.dashboard").joinpath(name).read_bytes()


def cookie_token(api_key: str) -> str:
    """What the cookie holds: proves the key was entered, without being the key."""
    return hmac.new(api_key.encode(), b"hyperharness dashboard v1", hashlib.sha256).hexdigest()


class DashboardLogin:
    """The page's login (see the module doc). Installed only when the proxy has a key."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]) -> None:
        self.app = app
        self._ring = KeyRing(keys)
        self._by_token = {cookie_token(k): k for k in keys}  # cookie -> the key it stands for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        if path == LOGIN and method == "GET":
            page = asset("login.html")
            if b"failed=1" in scope.get("query_string", b""):
                page = page.replace(b"<!--FAILED-->", b'<p class="error">That key is not this proxy\'s.</p>')
            await _send(send, 200, page, "text/html; charset=utf-8")
        elif path == LOGIN_CSS and method == "GET":  # the form's style: no data in it
            await _send(send, 200, asset("login.css"), "text/css; charset=utf-8")
        elif path == LOGIN and method == "POST":
            await self._login(receive, send)
        elif path == LOGOUT and method == "POST":
            await _send(send, 303, b"", "text/plain", location=LOGIN, cookie=f"{COOKIE}=; Max-Age=0")
        elif not presented_keys(scope["headers"]) and (key := self._cookie_key(scope["headers"])) is not None:
            headers = [*scope["headers"], (b"authorization", b"Bearer " + key.encode("utf-8", "surrogateescape"))]
            await self.app({**scope, "headers": headers}, receive, send)
        elif not presented_keys(scope["headers"]) and method == "GET" and _wants_html(scope["headers"]):
            await _send(send, 303, b"", "text/plain", location=LOGIN)
        else:
            await self.app(scope, receive, send)  # Guard decides

    def _cookie_key(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        for name, value in headers:
            if name == b"cookie":
                jar: SimpleCookie = SimpleCookie()
                try:
                    jar.load(value.decode("latin-1"))
                except Exception:  # a malformed Cookie header: no login
                    continue
                got = jar.get(COOKIE)
                if got is None:
                    continue
                for token, key in self._by_token.items():  # a handful of keys: compare against each
                    if hmac.compare_digest(got.value.encode(), token.encode()):
                        return key
        return None

    async def _login(self, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body") or len(body) > 16384:
                break
        given = (parse_qs(body.decode("latin-1")).get("key") or [""])[0].strip()
        if given and self._ring.accepts(given.encode("utf-8", "surrogateescape")):
            cookie = f"{COOKIE}={cookie_token(given)}; Path={PREFIX}; HttpOnly; SameSite=Strict; Max-Age=43200"
            await _send(send, 303, b"", "text/plain", location=PREFIX, cookie=cookie)
        else:
            await _send(send, 303, b"", "text/plain", location=LOGIN + "?failed=1")


def _wants_html(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name == b"accept" and b"text/html" in value for name, value in headers)


async def _send(send: Send, status: int, body: bytes, ctype: str, *, location: str | None = None,
                cookie: str | None = None) -> None:
    headers = [(b"content-type", ctype.encode()), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in _HEADERS.items()]
    if location is not None:
        headers.append((b"location", location.encode()))
    if cookie is not None:
        headers.append((b"set-cookie", cookie.encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def dashboard_router(services: Services) -> APIRouter:
    router = APIRouter()

    @router.get(PREFIX)
    async def page() -> Response:
        return Response(asset("index.html"), media_type="text/html; charset=utf-8", headers=_HEADERS)

    @router.get(PREFIX + "/static/{name}")
    async def static(name: str) -> Response:
        ctype = _STATIC.get(name)
        if ctype is None:
            raise NotFound(f"no dashboard asset {name}")
        return Response(asset(name), media_type=ctype, headers=_HEADERS)

    @router.get(PREFIX + "/state")
    async def state() -> Response:
        view = services.view()
        await view.refresh()
        return json_response(view.state(services.settings.model_name), headers=_HEADERS)

    @router.get(LOGIN)
    async def login() -> Response:  # reached only without a key (no DashboardLogin): nothing to log in to
        return RedirectResponse(PREFIX, 303)

    return router
