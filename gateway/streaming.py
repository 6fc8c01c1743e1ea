"""Responses that stop the pipeline when the client goes away.

A client that disconnects mid-stream must free the request in every stage at once, not when the
next chunk fails to send: `CancellableStream` watches for the disconnect while it streams and
cancels the body iterator (whose `finally` cancels the gRPC calls). `until_disconnect` does the
same for a non-streaming request. `prepended` puts back what was read ahead of a stream (to
check it before the response starts) in front of the rest."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TypeVar

import anyio
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


def sse(payload: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


class CancellableStream(StreamingResponse):
    def __init__(self, content: AsyncIterator, *, on_close: Callable[[], None] | None = None, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client is gone (ASGI 2.4 servers raise on send)
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.CancelScope(shield=True):
                    await aclose()
            if self.on_close is not None:
                self.on_close()


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """`await work`, cancelled (ClientDisconnect raised) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled() or not task.done():
        try:
            await task
        except asyncio.CancelledError:
            pass
        raise ClientDisconnect()
    return task.result()


async def prepended(head: Sequence[T], rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`head`'s items, then `rest`'s (closed when this iterator is)."""
    async with aclosing(rest):
        for item in head:
            yield item
        async for item in rest:
            yield item


async def read_ahead(receive: Receive, stream: AsyncIterator, read: Awaitable[T]) -> T:
    """`await read` -- what reads `stream` ahead of the response -- cancelled when the client
    disconnects first (ClientDisconnect); `stream` is closed when it fails either way."""
    try:
        return await until_disconnect(receive, read)
    except BaseException:
        await stream.aclose()
        raise
