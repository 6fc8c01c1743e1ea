"""Ending a server call the same way whatever the caller's timing.

A caller may cancel a stream at any moment: before its first message arrives, while a refusal is
being sent, or mid-stream. grpc-Python shows that in several ways (a read that ends early, a
status send that fails, the handler task cancelled). Every stage handler (and the gateway's
Converse) goes through `abort` and `traced_rpc` (services.runtime.tracing), so each of those
ends as one clean cancellation: counted as cancelled, traced as cancelled, never an error."""

from __future__ import annotations

import asyncio
import logging

import grpc
from google.protobuf.message import DecodeError

from voxpipe.v1 import stages_pb2 as pb

log = logging.getLogger(__name__)

# trailing metadata naming the stage whose failure a status reports, when a stage passes on the
# failure of a stage it called (the thinker for its talker, the talker for its code2wav)
STAGE_METADATA = "voxpipe-stage"
STAGES = ("thinker", "talker", "code2wav")
# response headers a stage sends the moment it admits a stream (its start read, validated and
# queued): a stage calling the next one waits for them before writing past the start, so that
# a refusal's status never races a write (grpc-Python then reports INTERNAL instead of it)
ADMITTED_METADATA = "voxpipe-admitted"
# request headers of such a client: it writes nothing past the start before the admission
# headers, so a refusal of the start goes out at once (rpc_guard drains no writes first)
AWAITS_ADMISSION_METADATA = "voxpipe-awaits-admission"
# request headers of a client that half-closes on an Ending response (stages.proto): a stream that
# fails after its admission sends it one first, so that the status does not race the client's writes
TAKES_ENDING_METADATA = "voxpipe-takes-ending"
# trailing metadata of a call refused OUT_OF_RANGE: a serialized stages.proto ContextExceeded
CONTEXT_METADATA = "voxpipe-context-bin"
# request headers naming the session (a realtime conversation) a thinker request belongs to: the
# thinker sends the session's talker streams to the talker replica of its previous one, which holds
# its talker prefix cache (services.runtime.affinity); routing only, never part of an answer
SESSION_METADATA = "voxpipe-session"
MAX_SESSION_CHARS = 128


def session_of(context) -> str | None:
    """The call's SESSION_METADATA (None without one); ValueError for an empty or over-long one."""
    values = [v for k, v in context.invocation_metadata() or () if k == SESSION_METADATA]
    if not values:
        return None
    if len(values) > 1 or not 0 < len(values[0]) <= MAX_SESSION_CHARS:
        raise ValueError(f"{SESSION_METADATA} metadata: expected one value of 1 to {MAX_SESSION_CHARS} characters")
    return values[0]


def is_admitted(initial_metadata) -> bool:
    return any(key == ADMITTED_METADATA for key, _ in initial_metadata or ())


async def send_admitted(context: grpc.aio.ServicerContext) -> None:
    """The stream is admitted: send the response headers that say so (ClientGone if the caller left)."""
    if context.cancelled():
        raise ClientGone()
    try:
        await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
    except Exception:
        if context.cancelled() or context.done():
            raise ClientGone() from None
        raise


def context_metadata(prompt_tokens: int, reply_tokens: int, context_tokens: int) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata of an OUT_OF_RANGE refusal: the numbers, as a ContextExceeded."""
    detail = pb.ContextExceeded(prompt_tokens=prompt_tokens, reply_tokens=reply_tokens, context_tokens=context_tokens)
    return ((CONTEXT_METADATA, detail.SerializeToString()),)


def context_exceeded(error: grpc.aio.AioRpcError) -> pb.ContextExceeded | None:
    """The ContextExceeded a failed call's trailing metadata carries (None: none, or not one)."""
    for key, value in error.trailing_metadata() or ():
        if key == CONTEXT_METADATA and isinstance(value, bytes):
            try:
                return pb.ContextExceeded.FromString(value)
            except DecodeError:
                return None
    return None


def failed_stage(error: grpc.aio.AioRpcError, callee: str) -> str:
    """The stage a failed call's status is about: the one its trailing metadata names, else the callee."""
    for key, value in error.trailing_metadata() or ():
        if key == STAGE_METADATA and value in STAGES:
            return value
    return callee


def when_done(context: grpc.aio.ServicerContext, callback) -> None:
    """`callback(context)` once the call has ended -- also when it already had (a callback added
    after the end is never called): a request freed from here is freed whatever the handler's state."""
    context.add_done_callback(callback)
    if context.done():
        callback(context)


class ClientGone(Exception):
    """The caller cancelled the call (or its connection went away): nothing can reach it any more."""


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str,
                stage: str | None = None, trailing: tuple[tuple[str, str | bytes], ...] = ()) -> None:
    """`context.abort(code, message)`, or ClientGone when the caller already cancelled the call.
    `stage`: the stage the failure is about, when not this one (sent as `voxpipe-stage`);
    `trailing`: more trailing metadata (e.g. CONTEXT_METADATA).

    A cancelled call shows itself in two ways, whichever comes first: a read that ends early
    (which looks like a bad request: "empty request stream", "ended before text_end") and a
    status that can no longer be sent (grpc raises ExecuteBatchError from the send). Either
    way the outcome is the caller's cancellation."""
    if context.cancelled():
        raise ClientGone()
    try:
        metadata = (((STAGE_METADATA, stage),) if stage is not None else ()) + tuple(trailing)
        if metadata:
            context.set_trailing_metadata(metadata)
        await context.abort(code, message)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - the send failed: the call is gone
        log.debug("status %s not sent, the call is gone: %r", code.name, e)
        raise ClientGone() from None
