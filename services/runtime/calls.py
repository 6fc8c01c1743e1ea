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

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """The caller cancelled the call (or its connection went away): nothing can reach it any more."""


async def abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """`context.abort(code, message)`, or ClientGone when the caller already cancelled the call.

    A cancelled call shows itself in two ways, whichever comes first: a read that ends early
    (which looks like a bad request: "empty request stream", "ended before text_end") and a
    status that can no longer be sent (grpc raises ExecuteBatchError from the send). Either
    way the outcome is the caller's cancellation."""
    if context.cancelled():
        raise ClientGone()
    try:
        await context.abort(code, message)
    except (grpc.aio.AbortError, asyncio.CancelledError):
        raise
    except Exception as e:  # noqa: BLE001 - the send failed: the call is gone
        log.debug("status %s not sent, the call is gone: %r", code.name, e)
        raise ClientGone() from None
