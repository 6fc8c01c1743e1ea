"""A stage's calls to the next stage: the thinker's to a talker, the talker's to a code2wav.

`NextStage` holds the replicas a stage may dial -- only its own configured set (flags, env,
dns:/// names; see services.runtime.balancer), never an address a client sent -- and opens one
`Downstream` per request: a BalancedStream (moved to another replica when refused before its
first response) traced as a CLIENT span under the current server span, which it carries on as
W3C `traceparent` metadata.

Writes never raise. grpc-Python reports a status that races a client write as INTERNAL, and a
write after the stream ended as InvalidStateError; a downstream that finished early (a talker
at max_frames while text still comes) or failed drops later writes, and its real outcome comes
out of `responses()`: the one place where every stage client meets those races. Writes after
the start (`write_start`) wait for the replica's admission headers, so a refusal (bad start,
queue full, draining) never races one; a replica that fails the stream after admitting it sends
an Ending response first, on which the stream half-closes and drops later writes
(BalancedStream), so that status does not race one either.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from . import metrics, tracing
from .balancer import (BalancedStream, BalancerOptions, NoReplicaError, Replica, StageBalancer, is_lost_status,
                       parse_targets)
from .affinity import RouteKey
from .calls import AWAITS_ADMISSION_METADATA, TAKES_ENDING_METADATA, failed_stage
from .tensors import split_message
from .tls import ClientTLS

log = logging.getLogger(__name__)

HEALTH_SERVICES = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}
STUBS = {"thinker": pb_grpc.ThinkerStub, "talker": pb_grpc.TalkerStub, "code2wav": pb_grpc.Code2WavStub}


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


def stage_balancer(stage: str, addresses: str | list[str], max_message_bytes: int,
                   options: BalancerOptions | None = None, tls: ClientTLS | None = None) -> StageBalancer:
    return StageBalancer(stage, addresses, channel_options=channel_options(max_message_bytes), options=options,
                         health_service=HEALTH_SERVICES[stage], tls=tls)


class DownstreamFailed(Exception):
    """A downstream call failed: `stage` is the stage that failed (the callee, or the stage it
    names in its `voxpipe-stage` trailing metadata), `code` / `details` its status."""

    def __init__(self, stage: str, code: grpc.StatusCode | None, details: str, replica: str | None = None) -> None:
        super().__init__(f"{stage}: {code.name if code else 'ERROR'}: {details}")
        self.stage, self.code, self.details, self.replica = stage, code, details, replica


class NextStage:
    """The replicas of the stage after this one, for this stage's requests."""

    def __init__(self, stage: str, addresses: str | list[str], *, max_message_bytes: int,
                 options: BalancerOptions | None = None, tls: ClientTLS | None = None) -> None:
        """`tls`: dial the replicas with TLS / mTLS (services.runtime.tls); None: plaintext."""
        self.stage, self.tls = stage, tls
        self.max_message_bytes = max_message_bytes
        self.addresses, self.options = addresses, options
        parse_targets(addresses)            # a malformed address fails at start, not at the first request
        self._balancer: StageBalancer | None = None
        metrics.NEXT_STAGE_REPLICAS.add(self._replica_states)

    def _replica_states(self) -> tuple[str, list[Replica]] | None:
        """For voxpipe_next_stage_replicas (read by the metrics thread: a snapshot of the dict)."""
        balancer = self._balancer
        return None if balancer is None else (self.stage, balancer.replicas)

    @property
    def balancer(self) -> StageBalancer:
        """Made on first use: grpc.aio channels belong to the event loop they are made in, and a
        service builds its servicer before its loop runs."""
        if self._balancer is None:
            self._balancer = stage_balancer(self.stage, self.addresses, self.max_message_bytes, self.options,
                                            self.tls)
        return self._balancer

    async def open(self, method: str, request_id: str, metadata: tuple[tuple[str, str], ...] = (),
                   awaits_admission: bool = False, key: RouteKey | None = None) -> "Downstream":
        """A stream to one replica, as a CLIENT span child of the current context. Raises
        DownstreamFailed (UNAVAILABLE) when the stage has no replica at all. `awaits_admission`: the
        caller writes its start with `write_start` and nothing else before it (the server may then
        refuse the start without waiting for writes; see calls.AWAITS_ADMISSION_METADATA). `key`: the
        stream's affinity (its session: the replica of the session's previous stream, within its share)."""
        stub_cls = STUBS[self.stage]
        service = HEALTH_SERVICES[self.stage]
        span = tracing.stage_tracer(metrics.CALLER.get(self.stage)).start_span(
            f"{service}/{method}", kind=SpanKind.CLIENT,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                        "voxpipe.request_id": request_id})
        # BalancedStream half-closes on an Ending response: every stream says so
        call_metadata = ((TAKES_ENDING_METADATA, "1"),
                         *(((AWAITS_ADMISSION_METADATA, "1"),) if awaits_admission else ()), *metadata,
                         *tracing.inject_metadata(trace.set_span_in_context(span)))

        def on_replica(replica: Replica) -> None:
            span.set_attribute("server.address", replica.address)

        stream = BalancedStream(self.balancer, lambda channel: getattr(stub_cls(channel), method)(
            metadata=call_metadata), on_replica, key)
        metrics.NEXT_STAGE_STREAMS.labels(self.stage).inc()
        try:
            await stream.open()
        except NoReplicaError as e:
            tracing.grpc_error(span, grpc.StatusCode.UNAVAILABLE, str(e))
            span.end()
            raise DownstreamFailed(self.stage, grpc.StatusCode.UNAVAILABLE, str(e)) from None
        return Downstream(self, stream, span)

    async def close(self) -> None:
        if self._balancer is not None:
            await self._balancer.close()


class Downstream:
    """One request's stream to the next stage (see the module docstring)."""

    def __init__(self, next_stage: NextStage, stream: BalancedStream, span: trace.Span) -> None:
        self.next, self.stream, self.span = next_stage, stream, span
        self.ended = False          # the stream's outcome is known (responses() returned or raised)
        self._closed = False

    @property
    def stage(self) -> str:
        return self.next.stage

    @property
    def address(self) -> str:
        return self.stream.replica.address if self.stream.replica is not None else ""

    async def write(self, msg: Any) -> None:
        if self.ended or self._closed:
            return
        try:
            await self.stream.write(msg)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            log.debug("%s: write dropped, the stream ended: %r", self.stage, e)

    async def write_start(self, msg: Any, wrap: Callable[[Any], Any],
                          chunk: Callable[[bytes], Any] | None = None) -> None:
        """The stream's start: `wrap(msg)`, with its tensors' bytes beyond the message limit in
        `chunk(data)` continuations. Later writes wait until the replica admits the stream."""
        if chunk is None:
            await self.write(wrap(msg))
        else:
            head, chunks = split_message(msg, self.next.max_message_bytes - 1024)
            await self.write(wrap(head))
            for data in chunks:
                await self.write(chunk(data))
        self.stream.end_head()

    async def done_writing(self) -> None:
        if self.ended or self._closed:
            return
        try:
            await self.stream.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as e:
            log.debug("%s: half-close dropped, the stream ended: %r", self.stage, e)

    async def responses(self) -> AsyncIterator[Any]:
        """The responses until the stream ends; DownstreamFailed when it fails (the span says so)."""
        try:
            async for resp in self.stream:
                yield resp
        except grpc.aio.AioRpcError as e:
            self.ended = True
            stage, code, details = failed_stage(e, self.stage), e.code(), e.details() or ""
            if is_lost_status(code, details):
                # the call ended while a write was in flight, and grpc-Python lost its status: not a
                # failure of ours to report, and not a status the stages send -- they end failing
                # streams with Ending first -- so the replica went away (killed, its connection cut)
                code = grpc.StatusCode.UNAVAILABLE
                details = (f"the {stage} stream broke while this stage was writing to it (the {stage} went "
                           f"away; grpc lost the status: {details})")
            tracing.grpc_error(self.span, code, details)
            raise DownstreamFailed(stage, code, details, self.address) from None
        self.ended = True

    def close(self) -> None:
        """Cancel the call if it still runs (frees the request downstream), give the replica back,
        end the span; idempotent."""
        if self._closed:
            return
        self._closed = True
        if not self.ended:
            self.span.set_attribute("voxpipe.cancelled", True)
        self.stream.close()
        self.span.end()
