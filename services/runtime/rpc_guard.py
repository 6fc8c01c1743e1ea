"""A server interceptor for the bidirectional-streaming RPCs of the stages and the gateway's
Converse: every refusal reaches the client with its own status code.

- A request message that does not parse is INVALID_ARGUMENT naming the message type (gRPC's own
  handling would end the call as UNKNOWN with the parser's exception).
- A refusal (`context.abort`) first reads and discards what the client is still sending, until it
  half-closes or `drain_s` passes: a status that arrives while a gRPC asyncio client is writing
  reaches that client as INTERNAL "Internal error from Core" instead of the real code
  (grpc/grpc#36066), so the status is sent once the client is done writing where that happens
  within the bound. A stage calling the next one (request header calls.AWAITS_ADMISSION_METADATA)
  writes nothing past its start until the server admits the stream (calls.send_admitted), so a
  refusal before then goes out at once. Such a stream failing after its admission sends the
  client an Ending response first (StageServicer.serve_request): the client half-closes, and the
  status goes out once the stream's reader has seen that (`GuardedContext.ending_sent`).

`Abort` is the exception servicer code raises to refuse a call (turned into `context.abort` by
the stage runtime and by this interceptor when it escapes a handler)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from .calls import AWAITS_ADMISSION_METADATA, TAKES_ENDING_METADATA, is_admitted
from .echo import bounded_message

DRAIN_S = 2.0        # how long a refusal waits for the client to half-close before it is sent anyway


class Abort(Exception):
    """A refusal: the call ends with `code` and `message`; `trailing`: metadata sent with the status."""

    def __init__(self, code: grpc.StatusCode, message: str, trailing: tuple[tuple[str, str | bytes], ...] = ()) -> None:
        super().__init__(message)
        self.code, self.message, self.trailing = code, message, trailing


class _Undecodable:
    """What the lenient deserializer returns for bytes that are not the request message."""

    def __init__(self, type_name: str, error: Exception) -> None:
        self.type_name, self.error = type_name, error


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    type_name = getattr(getattr(deserializer, "__self__", None), "DESCRIPTOR", None)
    type_name = type_name.full_name if type_name is not None else "request message"

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, ValueError) as e:
            return _Undecodable(type_name, e)
    return parse


class GuardedRequests:
    """The request stream as the servicer sees it: parse failures raise Abort(INVALID_ARGUMENT);
    `drain()` discards what is left (only while no one else is reading)."""

    def __init__(self, requests: AsyncIterator) -> None:
        self._it = requests.__aiter__()
        self._count = 0
        self.reading = False
        self.ended = False
        self._end = asyncio.Event()     # set with `ended`, or when a read fails (the stream broke)

    def __aiter__(self) -> "GuardedRequests":
        return self

    async def __anext__(self) -> Any:
        self.reading = True
        try:
            msg = await self._it.__anext__()
        except StopAsyncIteration:
            self.ended = True
            self._end.set()
            raise
        except Exception:
            self._end.set()
            raise
        finally:
            self.reading = False
        self._count += 1
        if isinstance(msg, _Undecodable):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"request message {self._count} is not a valid {msg.type_name} ({msg.error})")
        return msg

    async def wait_end(self, seconds: float) -> None:
        """Until the client half-closed (or `seconds` passed): seen by the handler's own reader
        while one reads, or read here and discarded (`drain`) once none does (a reader may stop
        before the end: a bad message, a cancel)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self._end.is_set() and (left := deadline - loop.time()) > 0:
            if not self.reading:
                await self.drain(left)
                return
            try:
                await asyncio.wait_for(self._end.wait(), min(left, 0.05))
            except asyncio.TimeoutError:
                pass

    async def drain(self, seconds: float) -> None:
        if self.reading or self.ended:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        try:
            while (left := deadline - loop.time()) > 0:
                await asyncio.wait_for(self._it.__anext__(), left)
        except (StopAsyncIteration, asyncio.TimeoutError, grpc.RpcError, asyncio.InvalidStateError):
            pass
        except Exception:   # whatever the stream does now, the refusal is sent next
            pass
        self.ended = True
        self._end.set()


class GuardedContext:
    """The servicer context with an `abort` that drains the request stream first -- unless the
    client awaits admission, the whole start was read (`start_read`) and the stream was not
    admitted yet: that client is not writing then. After an Ending response (`ending_sent`),
    `abort` waits for the client's half-close instead, even while the handler's reader reads."""

    def __init__(self, context: grpc.aio.ServicerContext, requests: GuardedRequests, drain_s: float) -> None:
        self._context, self._requests, self._drain_s = context, requests, drain_s
        keys = {key for key, _ in context.invocation_metadata() or ()}
        self._awaits_admission = AWAITS_ADMISSION_METADATA in keys
        self._takes_ending = TAKES_ENDING_METADATA in keys
        self._start_read = self._admitted = self._ending = False

    @property
    def takes_ending(self) -> bool:
        """The client half-closes on an Ending response (it says so: calls.TAKES_ENDING_METADATA;
        a stage from before Ending would fail on one) and the stream was admitted."""
        return self._takes_ending and self._admitted

    def ending_sent(self) -> None:
        self._ending = True

    def start_read(self) -> None:
        """The server has read the stream's whole start (its continuation chunks too)."""
        self._start_read = True

    async def send_initial_metadata(self, metadata) -> None:
        self._admitted = self._admitted or is_admitted(metadata)
        await self._context.send_initial_metadata(metadata)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata=()) -> None:
        details = bounded_message(details)      # the backstop: a status never carries unbounded client input
        if self._ending:
            await self._requests.wait_end(self._drain_s)
        elif not (self._awaits_admission and self._start_read and not self._admitted):
            await self._requests.drain(self._drain_s)
        await self._context.abort(code, details, trailing_metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class RequestGuard(grpc.aio.ServerInterceptor):
    """Wraps every stream-stream method as described in the module docstring."""

    def __init__(self, drain_s: float = DRAIN_S) -> None:
        self.drain_s = drain_s

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not (handler.request_streaming and handler.response_streaming):
            return handler
        inner, drain_s = handler.stream_stream, self.drain_s

        async def guarded(request_iterator, context):
            requests = GuardedRequests(request_iterator)
            ctx = GuardedContext(context, requests, drain_s)
            try:
                async for response in inner(requests, ctx):
                    yield response
            except Abort as e:          # a refusal no handler turned into a status
                await ctx.abort(e.code, e.message, e.trailing)

        return grpc.stream_stream_rpc_method_handler(guarded, request_deserializer=_lenient(handler.request_deserializer),
                                                     response_serializer=handler.response_serializer)
