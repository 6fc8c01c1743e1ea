"""Admission by capacity: a spoken generation starts while the stages keep every stream's playback
deadline, waits (within its time-to-first-audio budget, --admission-wait) while they do not, and is
refused with 429 only once that budget is spent. `--max-sessions` stays a hard cap on top.

"The stages can meet every deadline" is judged from what the gateway sees of its own streams, each
with a playback clock (services/runtime/playback.py): audio received from code2wav is what was
made for the listener, audio the API layer took for its client is what was delivered (a client
that reads slowly takes less: its listener plays less and the audio read ahead for it is slack,
not a shortage). They can while no stream that they are serving is nearly dry: none that has
played for DRY_S has less than DRY_S of slack while audio still comes for it (within the last
SERVED_S) -- its audio comes, but slower than it plays: the stages' frame rate (the thinker's
text included) falls short of what the streams need. A stream that gets nothing at all for a
while (a stage failing over, a stream stopped upstream) says nothing about that rate and holds
nobody up.

Text-only generations have no playback deadline and are not held here."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from voxpipe.services.runtime.playback import DeadlinePolicy, PlaybackClock, band_counts

from .errors import APIError

from .limits import DEFAULT_ADMISSION_WAIT_S  # noqa: F401  (the flag's default; limits.py imports nothing heavy)
POLL_S = 0.02                      # how often a waiting request looks again
SERVED_S = 1.0                     # a stream the stages are serving: audio came for it within this long


class AtCapacity(APIError):
    def __init__(self, waited: float, reason: str) -> None:
        super().__init__(429, f"the speech stages are at capacity ({reason}); waited {waited:.2f} s; retry later",
                         type="rate_limit_error", code="rate_limit_exceeded")


@dataclass(eq=False)
class Stream:
    """One spoken generation in flight, as the gateway sees it (times: time.monotonic())."""

    clock: PlaybackClock = field(default_factory=lambda: PlaybackClock(measured=True))
    last_received: float | None = None

    def received(self, seconds: float, at: float) -> None:
        """`seconds` of audio came from code2wav at `at`."""
        self.clock.emit(seconds, at)
        self.last_received = at

    def taken(self, seconds: float, now: float) -> None:
        """The API layer took `seconds` of audio for its client."""
        self.clock.deliver(seconds, now)


class Capacity:
    def __init__(self, wait_s: float, streams_gauge: Gauge, refused: Counter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.wait_s, self.streams_gauge, self.refused = wait_s, streams_gauge, refused
        self.now, self.policy = clock, DeadlinePolicy()
        self.streams: set[Stream] = set()

    def shortfall(self) -> str | None:
        """Why the stages cannot take another stream now, or None when they can (see the module doc)."""
        now = self.now()
        for s in self.streams:
            served = s.last_received is not None and now - s.last_received <= SERVED_S
            if served and self.policy.dry(s.clock, now):
                return f"a stream has {max(s.clock.slack(now), 0.0) * 1000:.0f} ms of audio left"
        return None

    async def admit(self) -> Stream:
        """A new stream, once the stages can take it; AtCapacity after the admission wait."""
        start = self.now()
        while (reason := self.shortfall()) is not None:
            waited = self.now() - start
            if waited >= self.wait_s:
                self.refused.inc()
                raise AtCapacity(waited, reason)
            await asyncio.sleep(min(POLL_S, self.wait_s - waited))
        stream = Stream()
        self.streams.add(stream)
        return stream

    def done(self, stream: Stream) -> None:
        self.streams.discard(stream)

    def set_gauges(self) -> None:
        now = self.now()
        for band, n in band_counts([s.clock.slack(now) for s in self.streams]).items():
            self.streams_gauge.labels(band).set(n)
