"""One log format for every voxpipe process (the three stages, the gateway, the CLI).

    setup_logging("INFO", "plain")     # once per process (voxpipe.cli.main does it from --log-level / --log-format)

`plain` (the default) is one line per record:

    2026-12-01 13:45:00,123 INFO voxpipe.access: POST /v1/chat/completions 200 0.412s [request_id=req_1f... trace_id=4bf9...]

`json` is one JSON object per line: time (ISO 8601, UTC), level, logger, message, request_id and
trace_id / span_id when known, the exception text when there is one, and for access lines an
`access` object (method, path, status, duration_s, client).

The request id is the current one of this context (REQUEST_ID: set by the gateway per HTTP
request, realtime session and Converse call, and by the stages per stream from the start
message's request_id); the trace and span ids are the current OpenTelemetry span's (a recording
span, or a caller's `traceparent` honoured with tracing off). Uvicorn's, transformers' and
Python's warnings go through the same handler; the gateway writes the access lines itself
(logger `voxpipe.access`). The gRPC C core's own messages (GRPC_VERBOSITY) are not Python logs.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
from dataclasses import asdict, dataclass
from typing import TextIO

from opentelemetry import trace

FORMATS = ("plain", "json")
LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("voxpipe_request_id", default=None)
ACCESS = logging.getLogger("voxpipe.access")


@dataclass(frozen=True)
class AccessRecord:
    """What an access line says about one call (logged with `extra={"access": record}`)."""

    method: str                 # POST, WEBSOCKET, GRPC
    path: str
    status: str                 # the HTTP status, the WebSocket close code, the gRPC status name
    duration_s: float
    client: str | None = None


def log_access(record: AccessRecord) -> None:
    ACCESS.info("%s %s %s %.3fs", record.method, record.path, record.status, record.duration_s,
                extra={"access": record})


class ContextFilter(logging.Filter):
    """Puts the current request id and trace / span ids on every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = REQUEST_ID.get()
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = format(ctx.trace_id, "032x") if ctx.is_valid else None
        record.span_id = format(ctx.span_id, "016x") if ctx.is_valid else None
        return True


class PlainFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        ids = [f"{name}={value}" for name in ("request_id", "trace_id")
               if (value := getattr(record, name, None))]
        if not ids:
            return line
        head, sep, rest = line.partition("\n")       # after the message, before a traceback
        return f"{head} [{' '.join(ids)}]{sep}{rest}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for name in ("request_id", "trace_id", "span_id"):
            if (value := getattr(record, name, None)) is not None:
                body[name] = value
        access = getattr(record, "access", None)
        if isinstance(access, AccessRecord):
            body["access"] = {**asdict(access), "duration_s": round(access.duration_s, 6)}
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            body["exception"] = record.exc_text
        return json.dumps(body, ensure_ascii=False)


def level_name(value: str) -> str:
    """A --log-level value: a level name in any case (argparse `type`)."""
    name = value.strip().upper()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {value!r}")
    return name


_configured = False


def adopt_transformers_logging() -> None:
    """transformers logs through a handler of its own, in its own format: once this process has
    set up voxpipe's logging, send its records through voxpipe's handler instead. Call it where
    transformers is imported anyway (importing it costs seconds)."""
    if not _configured:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()


def setup_logging(level: str = "INFO", fmt: str = "plain", stream: TextIO | None = None) -> None:
    """Every record of this process, uvicorn's and grpc's Python loggers included, through one
    handler in `fmt` ("plain" or "json") at `level`."""
    global _configured
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; use one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_name(level))
    logging.captureWarnings(True)           # Python warnings in the same format (logger py.warnings)
    _configured = True
    if "transformers" in sys.modules:
        adopt_transformers_logging()
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):     # uvicorn's, when it has set them up
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
