"""The gateway's shared state, what every API (openai_chat.py, speech.py, realtime/, converse.py)
uses of it: GatewayState (the pipeline client, the tokenizer and feature extractor for rendering
prompts, the chat clips' features cache, the metrics, the store of assistant audio transcripts,
admission by capacity: admission.py), the SessionLimiter that `--max-sessions` sets, shared by HTTP, realtime and Converse, and the API-key check.

The FastAPI app (app.py) keeps one GatewayState in `app.state.gateway`; the routes read it with
`gateway_state(request)`. Nothing here imports the app or an API module."""

from __future__ import annotations

import hmac
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from prometheus_client import Gauge

from voxpipe.client import PipelineClient
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.thinker.prompt import FeatureExtractor, load_tokenizer

from .admission import Capacity
from .clip_cache import ClipCache
from .config import GatewayConfig
from .errors import APIError, too_many_sessions
from .metrics import GatewayMetrics
from .transcripts import TranscriptStore


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
    clips: ClipCache
    capacity: Capacity
    transcripts: TranscriptStore | None = None
    pipeline: PipelineClient | None = None          # opened on startup, on the serving event loop
    tokenizer_lock: threading.Lock = field(default_factory=threading.Lock)
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def load(cls, config: GatewayConfig) -> "GatewayState":
        metrics = GatewayMetrics()
        omni = OmniConfig.load(config.model_dir)
        features = FeatureExtractor.for_model(config.model_dir, omni.thinker)
        return cls(config=config, omni=omni, tokenizer=load_tokenizer(config.model_dir), features=features,
                   metrics=metrics, sessions=SessionLimiter(config.max_sessions, metrics.sessions),
                   clips=ClipCache(config.audio_cache_bytes, features, metrics),
                   capacity=Capacity(config.admission_wait_s, metrics.streams_by_slack, metrics.capacity_refusals),
                   transcripts=TranscriptStore(config.audio_expiry_s, config.max_stored_audio))

    @property
    def speakers(self) -> dict[str, int]:
        return self.omni.talker.speakers

    def open_pipeline(self) -> PipelineClient:
        self.pipeline = PipelineClient(self.config.thinker, self.config.code2wav, tls=self.config.stage_tls,
                                       audio_token=self.omni.thinker.tokens.audio_token)
        self.metrics.routing.watch(self.pipeline.thinker)
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

