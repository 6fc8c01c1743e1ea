"""The gateway's FastAPI app: it wires the routes -- error handlers, health/readiness, models and
metrics here; the OpenAI chat, speech and transcription routes from openai_chat.py, speech.py and
transcriptions.py, the realtime WebSocket route from the realtime package when it exposes a
`router`, the voice console at `/` from console.py -- and the middleware (middleware.py; cors.py
checks browsers' Origin on every request).

`app.state.gateway` is the GatewayState (state.py) every API uses."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from voxpipe import version
from voxpipe.client import PipelineError
from voxpipe.services.runtime.echo import quoted
from voxpipe.services.runtime.metrics import watch_loop_lag
from voxpipe.services.runtime.tracing import TracingMiddleware, fastapi_tracing_off

from . import console, openai_chat, speech, transcriptions
from .config import GatewayConfig
from .cors import OriginCheck
from .errors import APIError, from_pipeline_error
from .health import readiness
from .middleware import AccessLog, BodyTimeout, RequestId, RequestMetrics
from .state import GatewayState, gateway_state, require_api_key

log = logging.getLogger(__name__)


CLIENT_CLOSED_REQUEST = 499     # nginx's status for a request whose client went away before the answer


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(PipelineError)
    async def pipeline_error(request: Request, exc: PipelineError) -> JSONResponse:
        return from_pipeline_error(exc).response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client left while its body was read: its doing, not the server's (nobody reads this)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

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

    @app.get("/metrics", dependencies=[Depends(require_api_key)])     # with --api-key, scrapers send it too
    async def metrics(request: Request) -> Response:
        st = gateway_state(request)
        st.capacity.set_gauges()
        return Response(st.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version", dependencies=[Depends(require_api_key)])      # the model id is behind the key
    async def version_info(request: Request) -> dict:
        return {"version": version(), "model": gateway_state(request).config.model_id}

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def list_models(request: Request) -> dict:
        st = gateway_state(request)
        return {"object": "list", "data": [_model(st)]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(require_api_key)])   # ids may hold "/"
    async def get_model(model_id: str, request: Request) -> dict:
        st = gateway_state(request)
        if model_id != st.config.model_id:
            raise APIError(404, f"the model {quoted(model_id)} does not exist", param="model", code="model_not_found")
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
    console.add_console(app)
    app.include_router(openai_chat.router, dependencies=[Depends(require_api_key)])
    app.include_router(speech.router, dependencies=[Depends(require_api_key)])
    app.include_router(transcriptions.router, dependencies=[Depends(require_api_key)])
    realtime = _optional_router("realtime")
    if realtime is not None:
        app.include_router(realtime)
    return app
