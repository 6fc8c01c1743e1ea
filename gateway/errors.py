"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from voxpipe.client import PipelineError
from voxpipe.services.runtime.echo import PARAM_CHARS, bounded_message, clipped


RETRY_AFTER_S = 1


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        message = bounded_message(message)      # the backstop: never unbounded client input
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param = None if param is None else clipped(param, PARAM_CHARS)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.status == 429:      # a session slot frees when a running generation ends: retry soon
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def too_many_sessions(limit: int) -> APIError:
    return APIError(429, f"too many concurrent sessions (the limit is {limit}); retry later",
                    type="rate_limit_error", code="rate_limit_exceeded")


_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}


def from_pipeline_error(e: PipelineError) -> APIError:
    """A stage's refusal of the request is the client's fault (400; `context_length_exceeded` for
    a request past a stage's context, OUT_OF_RANGE); a stage that is down or
    overloaded is 503; anything else the stage did wrong is 502."""
    if e.code == grpc.StatusCode.OUT_OF_RANGE:     # the prompt and its reply do not fit the stage's context
        return APIError(400, f"the {e.stage} rejected the request: {e.details}", param="messages",
                        code="context_length_exceeded")
    if e.code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"the {e.stage} rejected the request: {e.details}", code="invalid_value")
    if e.code in _UNAVAILABLE:
        return APIError(503, f"the {e.stage} stage is unavailable: {e.details}", type="server_error",
                        code="service_unavailable")
    return APIError(502, f"the {e.stage} stage failed: {e.details}", type="server_error", code="upstream_error")
