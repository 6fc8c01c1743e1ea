"""Which browser pages may use the gateway: `--cors-allow-origins` and the checks behind it.

A browser names the page's origin (`Origin: https://app.example`) on every cross-origin request,
on same-origin POSTs and on every WebSocket handshake; other clients (the SDKs, curl) send none
and are never refused here. A request whose Origin is neither the gateway's own host nor in the
allowed list is refused before any work: HTTP with a 403 error, the realtime WebSocket with a 403
before the upgrade. With origins allowed, HTTP responses carry the CORS headers of the Fetch
standard (preflights answered here) so pages elsewhere can call the API; without, there are none
and only pages served by the gateway itself (the console at `/`) get in.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from starlette.websockets import WebSocket

FLAG = "--cors-allow-origins"
ENV = "VOXPIPE_CORS_ALLOW_ORIGINS"
DEFAULT_PORTS = {"http": 80, "https": 443}
ALLOWED_METHODS = ("GET", "POST")
# response headers a page may read besides the CORS-safelisted ones (the SDKs read these)
EXPOSED_HEADERS = "x-request-id, retry-after, www-authenticate"
PREFLIGHT_MAX_AGE_S = 600

_HOST = re.compile(r"^[a-z0-9-]+(?:\.[a-z0-9-]+)*\.?$")
_HOST_HEADER = re.compile(r"^(?P<host>\[[0-9a-f:.]+\]|[a-z0-9._-]+)(?::(?P<port>[0-9]{1,5}))?$")
_TOKEN_LIST = re.compile(r"^[!#$%&'*+.^_`|~0-9a-z-]+(?:\s*,\s*[!#$%&'*+.^_`|~0-9a-z-]+)*$")


class OriginsError(ValueError):
    """A malformed `--cors-allow-origins` value (the message says what is wrong and what to write)."""


@dataclass(frozen=True)
class Origin:
    """A serialized web origin, `scheme://host[:port]` (what browsers send in `Origin`)."""

    scheme: str
    host: str                      # lower case; an IPv6 address in brackets
    port: int | None = None        # None: the scheme's default port

    @classmethod
    def parse(cls, text: str) -> "Origin":
        """OriginsError saying what is wrong unless `text` is an http(s) origin."""
        example = "write scheme://host[:port], e.g. https://app.example or http://localhost:3000"
        if "*" in text:
            raise OriginsError(f"{text!r}: wildcards are not supported; list each origin, or give '*' alone")
        try:
            url = urlsplit(text.strip())
            port = url.port
        except ValueError as e:
            raise OriginsError(f"{text!r} is not an origin ({e}); {example}") from None
        scheme = url.scheme.lower()
        if scheme not in DEFAULT_PORTS or not url.hostname:
            raise OriginsError(f"{text!r} is not an http or https origin; {example}")
        if url.path or url.query or url.fragment or text.rstrip().endswith(("?", "#")):
            raise OriginsError(f"{text!r}: an origin has no path, query or fragment; write {scheme}://{url.netloc}")
        if "@" in url.netloc:
            raise OriginsError(f"{text!r}: an origin has no user name or password")
        if port == 0:
            raise OriginsError(f"{text!r}: port 0 is not a port a page can be served from")
        host = url.hostname
        if ":" in host:
            host = f"[{host}]"
        elif not _HOST.match(host):
            raise OriginsError(f"{text!r}: {host!r} is not a host name (letters, digits, '-' and '.'; "
                               "international names in their xn-- form)")
        return cls(scheme, host, None if port == DEFAULT_PORTS[scheme] else port)

    @classmethod
    def of_header(cls, text: str) -> "Origin | None":
        """The `Origin` header's origin; None for `null` and anything else that is not an http(s) origin."""
        try:
            return cls.parse(text)
        except OriginsError:
            return None

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}" + ("" if self.port is None else f":{self.port}")

    def served_at(self, host_header: str) -> bool:
        """The page comes from the host the request was sent to (`Host`): the same name and port,
        a Host without a port standing for the default port of either scheme (a TLS proxy in front)."""
        m = _HOST_HEADER.match(host_header.strip().lower())
        if m is None or m["host"] != self.host:
            return False
        if m["port"] is None:
            return self.port is None
        return int(m["port"]) == (self.port or DEFAULT_PORTS[self.scheme])


@dataclass(frozen=True)
class AllowedOrigins:
    """The origins `--cors-allow-origins` allows besides the gateway's own host (`any`: `*`).
    Empty (the default): no CORS, and browsers only from pages the gateway serves."""

    origins: frozenset[Origin] = frozenset()
    any: bool = False

    @classmethod
    def parse(cls, value: str) -> "AllowedOrigins":
        """`*`, or a comma-separated list of origins (`https://app.example,http://localhost:3000`)."""
        entries = [e.strip() for e in value.split(",")]
        if entries == ["*"]:
            return cls(any=True)
        if "*" in entries:
            raise OriginsError("'*' allows every origin and cannot be combined with a list")
        origins = []
        for entry in entries:
            if not entry:
                raise OriginsError(f"{value!r} has an empty entry; give origins like https://app.example, "
                                   "separated by commas, or '*'")
            origins.append(Origin.parse(entry))
        return cls(origins=frozenset(origins))

    @property
    def cors(self) -> bool:
        """Whether pages on other origins may call the API (CORS headers are sent)."""
        return self.any or bool(self.origins)

    def flag(self) -> str:
        """The `--cors-allow-origins` value that gives these ("" for the default)."""
        return "*" if self.any else ",".join(sorted(map(str, self.origins)))

    def allows(self, origin: str, host_header: str) -> bool:
        """A page of `origin` may send a request that was addressed to `host_header`."""
        if self.any:
            return True
        parsed = Origin.of_header(origin)
        return parsed is not None and (parsed.served_at(host_header) or parsed in self.origins)


def _refusal(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


def _origin_refusal(origin: str) -> JSONResponse:
    return _refusal(403, f"pages of origin {origin[:200]!r} may not use this gateway; start it with {FLAG} listing "
                         "that origin to allow them", "origin_not_allowed", "Origin")


class OriginCheck:
    """ASGI middleware: the Origin check for HTTP and WebSocket requests, the CORS preflight
    answers and the CORS headers on the responses to allowed cross-origin requests."""

    def __init__(self, app: ASGIApp, allowed: AllowedOrigins) -> None:
        self.app, self.allowed = app, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if origin is None:                           # not a browser (or a same-origin GET)
            await self.app(scope, receive, send)
            return
        allowed = self.allowed.allows(origin, headers.get("host", ""))
        if scope["type"] == "websocket":
            if allowed:
                await self.app(scope, receive, send)
            else:
                await _deny_websocket(scope, receive, send, _origin_refusal(origin))
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers and \
                (self.allowed.cors or not allowed):
            await self._preflight(origin, allowed, headers)(scope, receive, send)
            return
        if not allowed:
            await _origin_refusal(origin)(scope, receive, send)
            return
        if not self.allowed.cors:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *self._cors_headers(origin),
                                      (b"access-control-expose-headers", EXPOSED_HEADERS.encode())]
            await send(message)

        await self.app(scope, receive, send_with_cors)

    def _cors_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        if self.allowed.any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    def _preflight(self, origin: str, allowed: bool, headers: Headers) -> Response:
        """The answer to `OPTIONS` with `Access-Control-Request-Method`: 204 and what may follow, or 403."""
        if not allowed:
            return _origin_refusal(origin)
        method = headers["access-control-request-method"].strip()
        if method not in ALLOWED_METHODS:
            return _refusal(403, f"method {method!r} is not served; allowed: {', '.join(ALLOWED_METHODS)}",
                            "method_not_allowed", "Access-Control-Request-Method")
        requested = headers.get("access-control-request-headers", "").strip().lower()
        if requested and not _TOKEN_LIST.match(requested):
            return _refusal(400, "Access-Control-Request-Headers is not a comma-separated list of header names",
                            "invalid_value", "Access-Control-Request-Headers")
        out = {"access-control-allow-methods": ", ".join(ALLOWED_METHODS),
               "access-control-max-age": str(PREFLIGHT_MAX_AGE_S),
               "vary": "Origin, Access-Control-Request-Method, Access-Control-Request-Headers"}
        if requested:       # named one by one: `*` would not cover Authorization
            out["access-control-allow-headers"] = requested
        response = Response(status_code=204, headers=out)
        response.raw_headers.extend(h for h in self._cors_headers(origin) if h[0] != b"vary")
        return response


async def _deny_websocket(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
    """Refuse a WebSocket handshake with `response` (403 before the upgrade); a server without the
    denial-response extension answers a close before the accept with a bare 403."""
    ws = WebSocket(scope, receive, send)
    try:
        await ws.send_denial_response(response)
    except RuntimeError:
        await ws.close(1008, "origin not allowed")


def origins_flag(value: str) -> AllowedOrigins:
    """argparse `type` of `--cors-allow-origins`."""
    try:
        return AllowedOrigins.parse(value)
    except OriginsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def origins_from_env() -> AllowedOrigins:
    """`$VOXPIPE_CORS_ALLOW_ORIGINS` (unset or empty: the default); OriginsError naming it if malformed."""
    value = os.environ.get(ENV, "").strip()
    try:
        return AllowedOrigins.parse(value) if value else AllowedOrigins()
    except OriginsError as e:
        raise OriginsError(f"${ENV}: {e}") from None
