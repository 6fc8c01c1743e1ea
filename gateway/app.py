"""The gateway's FastAPI app: shared state, auth, errors, health/readiness, models and metrics;
the OpenAI chat and speech routes come from openai_chat.py and speech.py, the realtime
WebSocket route from realtime.py when it exposes a `router`, the voice console at `/` from
console.py; cors.py checks browsers' Origin on every request.

`app.state.gateway` is the GatewayState every API uses: the pipeline client, the tokenizer and
feature extractor for rendering prompts, the SessionLimiter shared by HTTP and realtime, the
metrics and the store of assistant audio transcripts."""

from __future__ import annotations

import asyncio
import hmac
import importlib
import importlib.util
import logging
import re
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import Gauge
from starlette.exceptions import HTTPException as StarletteHTTPException

from voxpipe.client import PipelineClient, PipelineError
from voxpipe.services.runtime.logs import REQUEST_ID, AccessRecord, log_access
from voxpipe.services.runtime.tracing import TracingMiddleware, fastapi_tracing_off
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.runtime.metrics import watch_loop_lag
from voxpipe.services.runtime.tls import ClientTLS, aio_channel
from voxpipe.services.thinker.prompt import FeatureExtractor

from .config import GatewayConfig
from .cors import OriginCheck
from .errors import APIError, from_pipeline_error, too_many_sessions
from .metrics import GatewayMetrics
from .transcripts import TranscriptStore

log = logging.getLogger(__name__)
STAGES = ("thinker", "code2wav")   # the stages the gateway calls (the talker is the thinker's)


class Session:
    """One admitted session; `release()` (or leaving the `with`) frees its slot, once."""

    def __init__(self, limiter: "SessionLimiter", api: str) -> None:
        self._limiter: SessionLimiter | None = limiter
        self.api = api

    def release(self) -> None:
        if self._limiter is not None:
            self._limiter.active -= 1
            self._limiter.gauge.labels(self.api).dec()
            self._limiter = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class SessionLimiter:
    """Concurrent sessions across the HTTP generations, realtime connections and Converse calls
    (0: no limit), counted per API in the `voxpipe_gateway_sessions{api}` gauge. `acquire(api)`
    admits one or raises the 429 APIError; `try_acquire(api)` returns None instead."""

    def __init__(self, limit: int, gauge: Gauge) -> None:
        self.limit, self.active, self.gauge = limit, 0, gauge

    def try_acquire(self, api: str) -> Session | None:
        if self.limit and self.active >= self.limit:
            return None
        self.active += 1
        self.gauge.labels(api).inc()
        return Session(self, api)

    def acquire(self, api: str) -> Session:
        session = self.try_acquire(api)
        if session is None:
            raise too_many_sessions(self.limit)
        return session


@dataclass
class GatewayState:
    config: GatewayConfig
    omni: OmniConfig
    tokenizer: Any
    features: FeatureExtractor
    metrics: GatewayMetrics
    sessions: SessionLimiter
    transcripts: TranscriptStore | None = None
    pipeline: PipelineClient | None = None          # opened on startup, on the serving event loop
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(cls, config: GatewayConfig) -> "GatewayState":
        from voxpipe.services.thinker.server import load_tokenizer

        metrics = GatewayMetrics()
        omni = OmniConfig.load(config.model_dir)
        return cls(config=config, omni=omni, tokenizer=load_tokenizer(config.model_dir),
                   features=FeatureExtractor.for_model(config.model_dir, omni.thinker), metrics=metrics,
                   sessions=SessionLimiter(config.max_sessions, metrics.sessions),
                   transcripts=TranscriptStore(config.audio_expiry_s, config.max_stored_audio))

    @property
    def speakers(self) -> dict[str, int]:
        return self.omni.talker.speakers

    def open_pipeline(self) -> PipelineClient:
        self.pipeline = PipelineClient(self.config.thinker, self.config.code2wav, tls=self.config.stage_tls)
        return self.pipeline


def authorized(config: GatewayConfig, authorization: str | None) -> bool:
    """`Authorization: Bearer <key>` matches the configured key (always true when none is set)."""
    if not config.api_key:
        return True
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), config.api_key.encode())


def gateway_state(request: Request) -> GatewayState:
    return request.app.state.gateway


def require_api_key(request: Request) -> None:
    if not authorized(gateway_state(request).config, request.headers.get("authorization")):
        raise APIError(401, "missing or incorrect API key; send it as 'Authorization: Bearer <key>'",
                       code="invalid_api_key")


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


async def stage_health(addresses: str, timeout: float = 2.0, tls: ClientTLS | None = None) -> dict[str, str]:
    """grpc.health.v1 status of every replica in a comma-separated address list (dialled with `tls`)."""
    async def check(addr: str) -> str:
        try:
            async with aio_channel(addr, tls) as ch:
                resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
        except grpc.aio.AioRpcError as e:
            return e.code().name

    addrs = [a for a in addresses.split(",") if a]
    return dict(zip(addrs, await asyncio.gather(*(check(a) for a in addrs))))


async def readiness(cfg: GatewayConfig) -> tuple[bool, dict[str, dict[str, str]]]:
    """Whether every replica of the stages the gateway calls is SERVING (what /ready answers, and
    what the Converse port's grpc.health.v1 status follows), and each replica's status."""
    stages = dict(zip(STAGES, await asyncio.gather(*(stage_health(getattr(cfg, s), tls=cfg.stage_tls)
                                                     for s in STAGES))))
    ok = all(status == "SERVING" for per_stage in stages.values() for status in per_stage.values())
    return ok, stages


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(PipelineError)
    async def pipeline_error(request: Request, exc: PipelineError) -> JSONResponse:
        return from_pipeline_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return APIError(400, f"invalid request: {exc.errors()}").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind).response()


def _add_basic_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        ok, stages = await readiness(gateway_state(request).config)
        return JSONResponse({"ready": ok, "stages": stages}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(gateway_state(request).metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models(request: Request) -> dict:
        st = gateway_state(request)
        return {"object": "list", "data": [_model(st)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])   # ids may hold "/"
    async def get_model(model_id: str, request: Request) -> dict:
        st = gateway_state(request)
        if model_id != st.config.model_id:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return _model(st)


def _model(st: GatewayState) -> dict:
    return {"id": st.config.model_id, "object": "model", "created": st.created, "owned_by": "voxpipe"}


def _optional_router(module: str):
    """The router of a sibling API module that may not exist yet (realtime is built separately)."""
    name = f"voxpipe.gateway.{module}"
    if importlib.util.find_spec(name) is None:
        log.info("no %s API in this build", module)
        return None
    return getattr(importlib.import_module(name), "router", None)


def create_app(config: GatewayConfig, state: GatewayState | None = None) -> FastAPI:
    state = state or GatewayState.load(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.open_pipeline()
        lag_watch = asyncio.ensure_future(watch_loop_lag(state.metrics.loop_lag.labels("gateway").observe))
        try:
            yield
        finally:
            lag_watch.cancel()
            await state.pipeline.close()

    app = FastAPI(title="voxpipe gateway", lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json", **fastapi_tracing_off())
    app.state.gateway = state
    app.add_middleware(OriginCheck, allowed=config.cors_allow_origins)   # inside RequestId: refusals carry ids
    app.add_middleware(BodyTimeout, seconds=config.body_timeout_s)
    app.add_middleware(RequestMetrics, metrics=state.metrics)
    app.add_middleware(AccessLog)           # inside RequestId and the tracing span: its lines carry their ids
    app.add_middleware(RequestId)
    app.add_middleware(TracingMiddleware)   # outermost: one span per request, honouring `traceparent`
    _add_error_handlers(app)
    _add_basic_routes(app)
    from . import console, openai_chat, speech

    console.add_console(app)
    app.include_router(openai_chat.router, dependencies=[Depends(require_api_key)])
    app.include_router(speech.router, dependencies=[Depends(require_api_key)])
    realtime = _optional_router("realtime")
    if realtime is not None:
        app.include_router(realtime)
    return app
