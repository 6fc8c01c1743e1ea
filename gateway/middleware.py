"""The gateway's ASGI middleware: request ids, access lines, request metrics and the request
body's time limit (app.py adds them, with cors.py's OriginCheck)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid

from voxpipe.services.runtime.logs import REQUEST_ID, AccessRecord, log_access

from .errors import APIError
from .metrics import GatewayMetrics

REQUEST_ID_HEADER = b"x-request-id"
_REQUEST_ID_OK = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class RequestId:
    """ASGI middleware: every HTTP response carries `x-request-id` -- the client's own when it sent a
    well-formed one (letters, digits, `._:-`, at most 128), else a new `req_<hex>`. The id is in
    scope["state"]["request_id"] for the handlers and the current REQUEST_ID for the logs; a
    WebSocket session gets one the same way (its logs carry it; no header goes back)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers", ())).get(REQUEST_ID_HEADER, b"")
        request_id = given if _REQUEST_ID_OK.match(given) else f"req_{uuid.uuid4().hex}".encode()
        scope.setdefault("state", {})["request_id"] = request_id.decode()
        token = REQUEST_ID.set(request_id.decode())          # the logs of this request carry it

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (REQUEST_ID_HEADER, request_id)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id if scope["type"] == "http" else send)
        finally:
            REQUEST_ID.reset(token)


class AccessLog:
    """ASGI middleware: an access line (services.runtime.logs, logger voxpipe.access) for every
    HTTP request but GET / HEAD / OPTIONS (probes and scrapes) once its response has ended, and
    for every WebSocket session once it has ended (status: the close code the server sent, or
    101 when the client hung up)."""

    QUIET = ("GET", "HEAD", "OPTIONS")

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket") or (kind == "http" and scope.get("method") in self.QUIET):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"value": "500" if kind == "http" else "-"}

        async def watched(message) -> None:
            t = message["type"]
            if t in ("http.response.start", "websocket.http.response.start"):
                status["value"] = str(message["status"])
            elif t == "websocket.accept":
                status["value"] = "101"
            elif t == "websocket.close":
                status["value"] = str(message.get("code", 1000))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            client = scope.get("client")
            log_access(AccessRecord(scope.get("method", "GET") if kind == "http" else "WEBSOCKET",
                                    scope.get("path", ""), status["value"], time.perf_counter() - started,
                                    f"{client[0]}:{client[1]}" if client else None))


class RequestMetrics:
    """ASGI middleware counting HTTP requests by route template and status."""

    def __init__(self, app, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_with_status(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(status["code"])).inc()


class BodyTimeout:
    """ASGI middleware: an HTTP request body must arrive completely within `seconds` of the first
    read (a 408 APIError is raised into the reading endpoint otherwise; the server then closes the
    connection, the body being unread). Reads after the body is complete (waiting for a disconnect
    while a response streams) are not limited."""

    def __init__(self, app, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.seconds:
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        state = {"deadline": None, "complete": False}

        async def timed_receive():
            if state["complete"]:
                return await receive()
            if state["deadline"] is None:
                state["deadline"] = loop.time() + self.seconds
            try:
                message = await asyncio.wait_for(receive(), max(0.0, state["deadline"] - loop.time()))
            except asyncio.TimeoutError:
                raise APIError(408, f"the request body did not arrive within {self.seconds:g} s",
                               code="request_timeout") from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                state["complete"] = True
            return message

        await self.app(scope, timed_receive, send)
