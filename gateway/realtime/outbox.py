"""A realtime session's bounded send queue. Producers (the reply being generated, the event
handlers) wait while it is full, so a client that reads slowly slows only its own session; a
cancelled reply's audio still in the queue is dropped before it is sent."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_MAX_EVENTS = 128


@dataclass
class Outgoing:
    text: str                                        # the event's JSON
    response_id: str | None = None
    audio_samples: int = 0                           # > 0: an audio delta of `response_id`
    on_sent: Callable[[int], None] | None = None     # called with audio_samples once written to the socket


class Outbox:
    def __init__(self, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        self.max_events = max_events
        self._items: deque[Outgoing] = deque()
        self._cond = asyncio.Condition()
        self.closed = False
        self.in_flight: Outgoing | None = None       # taken by the sender, being written

    async def put(self, item: Outgoing) -> None:
        """Queue `item`, waiting while the queue is full; dropped once the outbox is closed."""
        async with self._cond:
            while len(self._items) >= self.max_events and not self.closed:
                await self._cond.wait()
            if self.closed:
                return
            self._items.append(item)
            self._cond.notify_all()

    async def get(self) -> Outgoing | None:
        """The next item (it becomes `in_flight`), or None once closed."""
        async with self._cond:
            while not self._items and not self.closed:
                await self._cond.wait()
            if self.closed:
                return None
            self.in_flight = self._items.popleft()
            self._cond.notify_all()
            return self.in_flight

    def sent(self, item: Outgoing) -> None:
        if self.in_flight is item:
            self.in_flight = None
        if item.on_sent is not None:
            item.on_sent(item.audio_samples)

    def in_flight_audio(self, response_id: str) -> int:
        """Audio samples of `response_id` being written right now (they will reach the client)."""
        item = self.in_flight
        return item.audio_samples if item is not None and item.response_id == response_id else 0

    async def drop_audio(self, response_id: str) -> int:
        """Remove the queued, unsent audio deltas of a response; returns how many samples."""
        async with self._cond:
            dropped = [i for i in self._items if i.response_id == response_id and i.audio_samples]
            if dropped:
                self._items = deque(i for i in self._items if not (i.response_id == response_id and i.audio_samples))
                self._cond.notify_all()
            return sum(i.audio_samples for i in dropped)

    async def withdraw_audio(self, response_id: str) -> int:
        """Drop the queued, unsent audio deltas of a response; returns the samples of its delta
        being written right now (they still reach the client)."""
        await self.drop_audio(response_id)
        return self.in_flight_audio(response_id)

    async def close(self) -> None:
        async with self._cond:
            self.closed = True
            self._items.clear()
            self._cond.notify_all()
