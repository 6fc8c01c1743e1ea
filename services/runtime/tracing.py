"""OpenTelemetry tracing for every hop: gateway -> thinker -> talker -> code2wav.

Configured only by the standard OTEL_* environment variables and OFF unless an OTLP endpoint
is set (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT). When off, no SDK
is installed: the API's no-op tracer still forwards an incoming `traceparent` unchanged, and
the stage servers skip span work entirely.

    setup_tracing("voxpipe-thinker")       # once per process, before serving

W3C trace context travels in gRPC metadata (`traceparent`, `tracestate`) and HTTP headers.
Stage servers open a SERVER span per stream (`traced_rpc`) and, when the request is done,
add its phases from the engine's timestamps (`record_phases`): queue_wait (arrived ->
started), prefill / first_frame / first_chunk_out (thinker / talker / code2wav: started -> first
output), decode (first output -> end).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .calls import ClientGone
from .outputs import Finished

log = logging.getLogger(__name__)

TRACER_NAME = "voxpipe"
_enabled = False
_stage_providers: dict = {}      # stage -> TracerProvider, for stages colocated in one process
# the stage of each stage service (its spans' tracer: `stage_tracer(stage)`)
STAGE_OF_SERVICE = {"voxpipe.v1.Thinker": "thinker", "voxpipe.v1.Talker": "talker", "voxpipe.v1.Code2Wav": "code2wav"}

# the phase between "started" and "first output", per stage
# the talker's: its prefill, and with a text prompt (sent before the text) also its wait for text row 0
FIRST_OUTPUT_PHASE = {"thinker": "prefill", "talker": "first_frame", "code2wav": "first_chunk_out"}


def otlp_endpoint() -> str | None:
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or None)


def setup_tracing(default_service_name: str) -> bool:
    """Install the SDK (OTLP/gRPC exporter, batch processor) when an OTLP endpoint is configured
    and the SDK is not disabled. Sampler, resource, exporter and batching options come from the
    OTEL_* variables; `default_service_name` applies when OTEL_SERVICE_NAME (or service.name in
    OTEL_RESOURCE_ATTRIBUTES) is not set. Returns whether tracing is on."""
    global _enabled
    if _enabled:
        return True
    provider = _provider(default_service_name)
    if provider is None:
        return False
    trace.set_tracer_provider(provider)                   # flushed and shut down at exit
    _enabled = True
    return True


def setup_stage_tracing(stage: str) -> bool:
    """For stages colocated in one process (services/runtime/colocate.py): `stage`'s spans get a
    provider of their own, service.name voxpipe-STAGE (OTEL_SERVICE_NAME=NAME, one name for the
    process: NAME-STAGE), as if the stage ran alone; `stage_tracer(stage)` hands it out. Returns whether
    tracing is on."""
    global _enabled
    provider = _provider(f"voxpipe-{stage}", stage)
    if provider is None:
        return False
    _stage_providers[stage] = provider
    _enabled = True
    return True


def _provider(default_service_name: str, stage: str | None = None):
    """A TracerProvider exporting over OTLP/gRPC as the OTEL_* variables say, or None when tracing
    is off (no endpoint, OTEL_SDK_DISABLED, another exporter or protocol). `stage`: its service.name
    is the configured one with -STAGE appended (colocated stages)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower()
    if "otlp" not in [e.strip() for e in exporters.split(",")] or not otlp_endpoint():
        return None
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip().lower()
    if protocol != "grpc":
        log.warning("OTEL_EXPORTER_OTLP_PROTOCOL=%s is not supported (only grpc); tracing stays off", protocol)
        return None

    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: default_service_name}))
    elif stage is not None:
        resource = resource.merge(Resource({SERVICE_NAME: f"{resource.attributes[SERVICE_NAME]}-{stage}"}))
    provider = TracerProvider(resource=resource)          # sampler: OTEL_TRACES_SAMPLER(_ARG)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))   # OTEL_BSP_*, OTEL_EXPORTER_OTLP_*
    log.info("tracing on: service %s -> %s", resource.attributes.get(SERVICE_NAME), otlp_endpoint())
    return provider


def enabled() -> bool:
    return _enabled


def shutdown() -> None:
    """Flush and stop the exporters (also done at interpreter exit)."""
    for provider in (trace.get_tracer_provider(), *_stage_providers.values()):
        if hasattr(provider, "shutdown"):
            provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def stage_tracer(stage: str | None) -> trace.Tracer:
    """The tracer of `stage`'s spans: its own provider's when it is colocated with others
    (setup_stage_tracing), else the process's (`tracer()`)."""
    provider = _stage_providers.get(stage) if stage is not None else None
    return provider.get_tracer(TRACER_NAME) if provider is not None else tracer()


# ----------------------------------------------------------------------------- propagation

def inject_metadata(ctx: otel_context.Context | None = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying `ctx`'s span (W3C traceparent / tracestate)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return tuple((k.lower(), v) for k, v in carrier.items())


def extract_metadata(metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    carrier = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return propagate.extract(carrier)


def extract_headers(headers: Iterable[tuple[bytes, bytes]]) -> otel_context.Context:
    """Context from raw ASGI headers (lower-case byte pairs)."""
    return propagate.extract({k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers})


def annotate(**attributes: Any) -> None:
    """Set `voxpipe.<name>` attributes on the current span (no-op when it does not record)."""
    span = trace.get_current_span()
    if span.is_recording():
        for name, value in attributes.items():
            if value is not None:
                span.set_attribute(f"voxpipe.{name}", value)


def event(name: str, **attributes: Any) -> None:
    """An event, now, on the current span (no-op when it does not record): the gateway marks each
    stage's first output on its request span ("thinker first output": the first token, "talker
    first output": the first frame, "code2wav first output": the first audio)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, {f"voxpipe.{k}": v for k, v in attributes.items() if v is not None})


def grpc_error(span: trace.Span, code: grpc.StatusCode | None, details: str) -> None:
    name = code.name if code is not None else "UNKNOWN"
    span.set_attribute("rpc.grpc.status_code", code.value[0] if code is not None else 2)
    span.set_status(Status(StatusCode.ERROR, f"{name}: {details}"))


# ----------------------------------------------------------------------------- gRPC servers

def traced_rpc(service: str, method: str) -> Callable:
    """Decorate a stream-stream servicer method (an async generator): one SERVER span per call,
    parented on the caller's context from the metadata and current while the handler runs (each
    of its steps, `_within`).
    Failures (context.abort, exceptions) set status ERROR. A call the caller cancelled (the
    handler cancelled, or ClientGone from services.runtime.calls.abort) ends quietly and its span
    is marked cancelled with finish_reason "cancelled", whenever the cancel came; so does a call
    the handler ends with CANCELLED (a cancellation it passes on from the stage it called)."""

    def wrap(handler: Callable) -> Callable:
        @functools.wraps(handler)
        async def traced(self, request_iterator, context: grpc.aio.ServicerContext):
            inner = handler(self, request_iterator, context)
            if not _enabled:
                try:
                    async for item in inner:
                        yield item
                except ClientGone:
                    pass
                finally:
                    await inner.aclose()    # at once, also when the caller closes us early
                return
            parent = extract_metadata(context.invocation_metadata())
            span = stage_tracer(STAGE_OF_SERVICE.get(service)).start_span(f"{service}/{method}", context=parent,
                                                                     kind=SpanKind.SERVER,
                                       attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method})
            current = trace.set_span_in_context(span, parent)
            try:
                while True:
                    try:
                        item = await _within(current, inner.__anext__())
                    except StopAsyncIteration:
                        break
                    yield item
            except ClientGone:
                _mark_cancelled(span)
            except grpc.aio.AbortError:
                code, details = context.code(), context.details()
                if code == grpc.StatusCode.CANCELLED:
                    # a cancellation passed on (code2wav's listener went away, the talker's code2wav
                    # cancelled): the request was cancelled, nothing failed
                    span.set_attribute("rpc.grpc.status_code", code.value[0])
                    _mark_cancelled(span)
                else:
                    grpc_error(span, code if isinstance(code, grpc.StatusCode) else None, details or "aborted")
                raise
            except (GeneratorExit, asyncio.CancelledError):
                _mark_cancelled(span)
                raise
            except Exception as e:
                span.record_exception(e)
                grpc_error(span, grpc.StatusCode.UNKNOWN, repr(e))
                raise
            finally:
                await _within(current, inner.aclose())
                span.end()

        return traced

    return wrap


async def _within(ctx: otel_context.Context, step: Awaitable[Any]) -> Any:
    """Await `step` (one step of a handler's generator) with `ctx` current. The context is attached
    and detached within this one await, in the same task: a generator's steps, and its `finally`,
    may run in different tasks (one abandoned at a `yield`, its call gone, is closed by the event
    loop's finalizer in a task of its own), so an attachment must never span a `yield`."""
    token = otel_context.attach(ctx)
    try:
        return await step
    finally:
        otel_context.detach(token)


def _mark_cancelled(span: trace.Span) -> None:
    span.set_attribute("voxpipe.cancelled", True)
    if "voxpipe.finish_reason" not in (getattr(span, "attributes", None) or {}):
        span.set_attribute("voxpipe.finish_reason", "cancelled")


def record_phases(stage: str, req: Any, final: Any) -> None:
    """Child spans of the current (server) span from an EngineRequest's perf_counter timestamps,
    plus the request's outcome on the server span. `final` is the request's last outbox item
    (a Finished, a StageError) or None when the call ended early."""
    span = trace.get_current_span()
    if not _enabled or not span.is_recording():
        return
    now_perf, now_ns = time.perf_counter(), time.time_ns()

    def ns(t: float) -> int:
        return now_ns - int((now_perf - t) * 1e9)

    end = req.finished_at if req.finished_at is not None else now_perf
    parent = trace.set_span_in_context(span)
    common = {"voxpipe.request_id": req.request_id, "voxpipe.stage": stage}
    phases = [("queue_wait", req.arrived, req.started if req.started is not None else end)]
    if req.started is not None:
        first = req.first_output if req.first_output is not None else end
        phases.append((FIRST_OUTPUT_PHASE.get(stage, "first_output"), req.started, first))
        if req.first_output is not None:
            phases.append(("decode", req.first_output, end))
    for name, t0, t1 in phases:
        stage_tracer(stage).start_span(name, context=parent, start_time=ns(t0),
                                 attributes=common).end(end_time=ns(max(t0, t1)))

    span.set_attribute("voxpipe.request_id", req.request_id)
    if isinstance(final, Finished):
        span.set_attribute("voxpipe.finish_reason", final.reason.name.lower())
        if stage == "thinker":
            span.set_attribute("voxpipe.prompt_tokens", final.prompt_tokens)
            span.set_attribute("voxpipe.tokens", final.completion_tokens)
        else:
            span.set_attribute("voxpipe.frames", final.completion_tokens)
        if stage == "code2wav":
            span.set_attribute("voxpipe.samples", final.samples)
    elif final is None or req.cancelled:
        span.set_attribute("voxpipe.finish_reason", "cancelled")
    else:
        span.set_attribute("voxpipe.finish_reason", "error")


# ----------------------------------------------------------------------------- HTTP / WebSocket (ASGI)

def fastapi_tracing_off() -> dict:
    """FastAPI() keyword arguments that turn off FastAPI's own request spans (FastAPI >= 0.16x
    makes them natively when a tracer provider is set): TracingMiddleware makes the one request
    span, the same on every FastAPI version. Empty for FastAPI versions without native telemetry."""
    import inspect

    from fastapi import FastAPI

    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:
        return {}
    return {"telemetry": {"tracing": False}}


class TracingMiddleware:
    """ASGI middleware: one SERVER span per HTTP request or WebSocket session, parented on a
    client-supplied `traceparent` header and current while the app handles it (so pipeline
    calls made from the handler, and tasks it starts, are its children)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or not _enabled:
            if scope["type"] in ("http", "websocket"):
                # still honour a client's traceparent so the stages can join its trace
                token = otel_context.attach(extract_headers(scope.get("headers", ())))
                try:
                    await self.app(scope, receive, send)
                finally:
                    otel_context.detach(token)
                return
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        method = scope.get("method", "GET") if scope["type"] == "http" else "WEBSOCKET"
        parent = extract_headers(scope.get("headers", ()))
        attrs = {"url.path": path, "http.request.method": method, "network.protocol.name": scope["type"]}
        span = tracer().start_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER, attributes=attrs)
        token = otel_context.attach(trace.set_span_in_context(span, parent))
        status = {"code": None}

        async def traced_send(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                span.set_attribute("http.response.status_code", message["status"])
            elif message["type"] == "websocket.close":
                span.set_attribute("voxpipe.websocket.close_code", message.get("code", 1000))
            await send(message)

        try:
            await self.app(scope, receive, traced_send)
            if status["code"] is not None and status["code"] >= 500:
                span.set_status(Status(StatusCode.ERROR, f"HTTP {status['code']}"))
        except Exception as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, repr(e)))
            raise
        finally:
            span.end()
            otel_context.detach(token)
