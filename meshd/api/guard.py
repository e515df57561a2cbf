"""Who may use the API: the checks every request passes before a route sees it (ASGI middleware).

    request -> BodyDrain     an answer sent before the body was read drains it first
            -> HeaderBound   headers over MAX_HEADER_BYTES: 431
            -> HostGuard     a Host this node does not answer to: 400 (DNS rebinding)
            -> CORS          only when origins are configured (Starlette's CORSMiddleware)
            -> OriginGuard   a state-changing request from a foreign Origin: 403
            -> BearerAuth    with a key: every path but the page needs it: 401
            -> the app

Why each: a key-less node on loopback is reachable by any web page the user
opens. A page cannot read our answers cross-site (no CORS), but it can *send*:
a POST with a ``text/plain`` body needs no preflight (the app takes only
``application/json``: meshd/api/app.py), and a page whose name an attacker
re-points at 127.0.0.1 (DNS rebinding) is same-origin with us in the
browser's eyes -- only the Host header it sends still names the attacker's
domain. So:

* Host must be an IP literal, ``localhost`` or a name the operator allowed
  (``--api-allow-host``). An IP literal cannot be rebound: a browser sends one
  only to a page whose own origin is that address. A request without Host
  (HTTP/1.0 tools) passes: browsers always send it.
* A POST (anything but GET/HEAD/OPTIONS) that carries ``Origin`` must come
  from the node's own origin (scheme + the Host it was sent to) or from an
  origin configured for CORS. Browsers send Origin on every cross-site POST;
  scripts and SDKs send none and are not browsers.
* CORS is off unless ``--api-cors-origin`` names origins; then those origins
  get Starlette's CORS answers (preflights included, before the key check: a
  preflight carries no Authorization).

An answer given before the request's body was read (a refusal here, a 415,
a 404 for a POST) first reads and drops the rest of the body (at most
DRAIN_MAX_BYTES within DRAIN_TIMEOUT_S): HTTP/1.1 cannot reuse a connection
whose request was not read to its end, so Hypercorn closes it after the
answer -- while the client, told nothing, sends its next request on it and
gets "server disconnected".

The dashboard is same-origin: its GETs carry no foreign Origin and its Host
is the one the user typed. Pure request checks; no state.
"""
from __future__ import annotations

import hmac
import ipaddress

import trio
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from meshd.api.errors import ApiError, excerpt
from meshd.api.server import MAX_HEADER_BYTES

# Methods that only read; anything else changes state (runs a generation) and gets the Origin check.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# Paths anyone may fetch even with an API key: the page itself carries no data.
OPEN_PATHS = ("/", "/static/dashboard.js", "/static/dashboard.css", "/favicon.ico")
# Names a node always answers to besides IP literals (RFC 6761: localhost is loopback).
LOCAL_NAMES = frozenset({"localhost"})
# An unread body is drained up to this many bytes within this long; beyond, the connection closes.
DRAIN_MAX_BYTES = 8 << 20
DRAIN_TIMEOUT_S = 5.0


def _answer(err: ApiError, extra: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers={**err.headers(), **(extra or {})})


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value
    return None


def host_name(host: str) -> str:
    """The name part of a Host header value: ``[::1]:8080`` -> ``::1``, ``Example.org:80`` -> ``example.org``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    name = host_name(host)
    return bool(name) and (is_ip_literal(name) or name in LOCAL_NAMES or name in allowed)


class BodyDrain:
    """Before the last byte of an answer, read and drop what is left of the request's body (module doc)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return
        state = {"done": False}

        async def tracked_receive():
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body", False):
                state["done"] = True
            return message

        async def drain() -> None:
            seen = 0
            with trio.move_on_after(DRAIN_TIMEOUT_S):
                while not state["done"] and seen <= DRAIN_MAX_BYTES:
                    seen += len((await tracked_receive()).get("body", b""))

        async def drained_send(message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not state["done"]:
                await drain()
            await send(message)

        await self.app(scope, tracked_receive, drained_send)


class HeaderBound:
    """A request whose headers exceed MAX_HEADER_BYTES gets 431 (h11 bounds only the part of a
    request still incomplete in its buffer; a request read in one chunk is not checked there)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ())) > MAX_HEADER_BYTES:
            err = ApiError(431, f"the request headers exceed {MAX_HEADER_BYTES} bytes", code="headers_too_large")
            await _answer(err)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HostGuard:
    def __init__(self, app, allowed_hosts: frozenset[str]) -> None:
        self.app, self.allowed = app, frozenset(h.lower() for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            host = _header(scope, b"host")
            if host is not None and not host_allowed(host.decode("latin-1"), self.allowed):
                err = ApiError(400, f"this node does not answer to the host {excerpt(host.decode('latin-1'))}: use "
                                    "its IP address or localhost, or start it with --api-allow-host NAME",
                               code="host_not_allowed")
                await _answer(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OriginGuard:
    def __init__(self, app, cors_origins: frozenset[str]) -> None:
        self.app, self.cors = app, frozenset(o.lower().rstrip("/") for o in cors_origins)

    def _allowed(self, scope, origin: str) -> bool:
        origin = origin.strip().lower().rstrip("/")
        if origin in self.cors:
            return True
        host = _header(scope, b"host")
        scheme = scope.get("scheme", "http")
        return host is not None and origin == f"{scheme}://{host.decode('latin-1').strip().lower()}"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in SAFE_METHODS:
            origin = _header(scope, b"origin")
            if origin is not None and not self._allowed(scope, origin.decode("latin-1")):
                err = ApiError(403, f"requests from the web page {excerpt(origin.decode('latin-1'))} are refused: "
                                    "a page may drive this node only if started with --api-cors-origin ORIGIN",
                               type="permission_error", code="origin_not_allowed")
                await _answer(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BearerAuth:
    """Every path but OPEN_PATHS needs ``Authorization: Bearer <key>`` (compared in constant time)."""

    def __init__(self, app, key: str) -> None:
        self.app, self._key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            scheme, _, token = (_header(scope, b"authorization") or b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
                err = ApiError(401, "Incorrect API key provided: send Authorization: Bearer <the node's api key>",
                               type="authentication_error", code="invalid_api_key")
                await _answer(err, {"www-authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def guarded(app, *, key: str | None, allowed_hosts=(), cors_origins=()):
    """``app`` behind every check above, outermost first."""
    inner = BearerAuth(app, key) if key else app
    inner = OriginGuard(inner, frozenset(cors_origins))
    if cors_origins:
        inner = CORSMiddleware(inner, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                               allow_headers=["authorization", "content-type"], max_age=600)
    return BodyDrain(HeaderBound(HostGuard(inner, frozenset(allowed_hosts))))
