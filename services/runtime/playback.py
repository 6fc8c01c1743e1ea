"""Playback deadlines: how far a stream's audio is ahead of its listener, and which streams a step
serves first because of it. Pure Python on seconds (no tensors); every time is a `now` the caller
passes (time.monotonic() in the engines, a fake clock in the tests).

A stream's slack is the audio made for it minus the audio its listener has played since its first
packet. The listener is modelled as a player: it starts at the first audio delivered to it and
plays at 1x while it has delivered audio; when it has none it stalls (an underrun) and goes on
when more arrives. So

    slack(now) = emitted - played(now),   played(now) = min(played + (now - at), delivered)

`emitted`: audio this stage has made for the stream; `delivered`: audio that left toward the
listener (code2wav: samples its Listen stream has written, so a client that reads slowly -- gRPC
and HTTP flow control hold the writes -- has delivered less, and plays less: it gets more slack).
A stage that is told where the listener is (the talker, from code2wav's Playback reports) takes
the report's played / delivered; a stage that neither measures nor is told takes delivered =
emitted (1x after its first output).

The policy (`DeadlinePolicy.pick`) chooses the rows of one step: while any playing row is nearly
dry, rows seconds ahead sit the step out (at most `max_skips` steps in a row: no row starves) and
the others step with first-output rows and the least slack first; when nothing is dry, every row
steps in the order it came (the fast path: nothing changes, e.g. every closed loop that keeps up)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

DRY_S = 0.5        # nearly dry: a playing stream with less slack than this
AHEAD_S = 2.0      # seconds ahead: may sit out a step while a stream is nearly dry
MAX_SKIPS = 8      # consecutive steps a row may sit out: no stream starves
RECHECK_S = 0.05   # a calm verdict (no row nearly dry) holds this long

# voxpipe_streams_by_slack bands: (label, upper bound in seconds); the first is also
# voxpipe_streams_under_500ms_slack (the autoscalers' signal)
BANDS = (("under_0.5s", DRY_S), ("0.5s_to_2s", AHEAD_S), ("over_2s", float("inf")))


@dataclass
class PlaybackClock:
    """One stream's playback as a stage sees it (seconds of audio; `at` and `started` on the caller's clock)."""

    emitted: float = 0.0        # audio this stage made for the stream
    delivered: float = 0.0      # audio that left toward the listener
    played: float = 0.0         # the listener's position at `at`
    at: float = 0.0
    started: float | None = None   # the first delivery: the listener starts playing
    underruns: int = 0          # times the listener ran dry before the stream ended
    measured: bool = False      # delivered comes from deliver() or a report; else it is what was emitted

    def advance(self, now: float) -> None:
        """Move the listener to `now`: it plays what was delivered; a stall is an underrun."""
        if self.started is None:
            return
        want = self.played + max(0.0, now - self.at)
        if want > self.delivered + 1e-9:
            self.underruns += 1
            want = self.delivered
        self.played, self.at = want, now

    def emit(self, seconds: float, now: float) -> None:
        """This stage made `seconds` more audio; without reports it leaves toward the listener at once."""
        self.emitted += seconds
        if not self.measured:
            self.deliver(seconds, now)

    def deliver(self, seconds: float, now: float) -> None:
        self.advance(now)
        if self.started is None:
            self.started, self.at = now, now
        self.delivered += seconds

    def report(self, played: float, delivered: float, now: float) -> None:
        """A downstream stage's view of the listener (code2wav's Playback): taken as it is (one
        that is not a position -- negative, not finite -- is ignored)."""
        if not (math.isfinite(played) and math.isfinite(delivered)) or played < 0:
            return
        if self.started is None:
            self.started = now
        self.measured = True
        self.played, self.delivered, self.at = played, max(delivered, played), now

    def position(self, now: float) -> float:
        """Where the listener is at `now` (no underrun is counted here)."""
        if self.started is None:
            return 0.0
        return min(self.played + max(0.0, now - self.at), self.delivered)

    def slack(self, now: float) -> float:
        return self.emitted - self.position(now)

    def playing_for(self, now: float) -> float:
        return 0.0 if self.started is None else now - self.started


class Paced(Protocol):
    """A stream a step may serve (the talker's and code2wav's jobs)."""

    playback: PlaybackClock
    skips: int          # steps sat out in a row (DeadlinePolicy.pick keeps it)


P = TypeVar("P", bound=Paced)


def band(slack: float) -> str:
    return next(label for label, upper in BANDS if slack < upper)


def band_counts(slacks: Sequence[float]) -> dict[str, int]:
    counts = dict.fromkeys((label for label, _ in BANDS), 0)
    for s in slacks:
        counts[band(s)] += 1
    return counts


class DeadlinePolicy:
    """One scheduler's policy (it keeps state: give each scheduler its own)."""

    def __init__(self, dry_s: float = DRY_S, ahead_s: float = AHEAD_S, max_skips: int = MAX_SKIPS,
                 recheck_s: float = RECHECK_S) -> None:
        """`recheck_s`: a step that finds no row nearly dry lets the next steps within this long
        skip the check (slack moves at 1x; the threshold is 500 ms): the fast path costs a clock
        comparison, not a pass over every row."""
        self.dry_s, self.ahead_s, self.max_skips, self.recheck_s = dry_s, ahead_s, max_skips, recheck_s
        self._calm_until = float("-inf")
        self._skipping = False       # some row's skips may be non-zero

    def dry(self, clock: PlaybackClock, now: float) -> bool:
        """Nearly dry: playing for at least dry_s (a fresh stream's slack is still building) with
        less than dry_s of slack."""
        return clock.started is not None and clock.playing_for(now) >= self.dry_s and clock.slack(now) < self.dry_s

    def any_dry(self, rows: Sequence[Paced], now: float) -> bool:
        """Whether some row is nearly dry (`dry`, inlined)."""
        d = self.dry_s
        for r in rows:
            c = r.playback
            if c.started is None or now - c.started < d:
                continue
            if c.emitted - min(c.played + max(0.0, now - c.at), c.delivered) < d:
                return True
        return False

    def pick(self, rows: Sequence[P], now: float) -> tuple[list[P], list[P]]:
        """(the rows that step now, the rows that sit out), counting each row's consecutive skips.
        While some row is nearly dry, rows more than ahead_s ahead sit out -- never after max_skips
        steps in a row -- and the rest step in order: rows without output yet (first frames), then
        the least slack first. Otherwise every row steps, in the order given."""
        if now < self._calm_until or not self.any_dry(rows, now):
            if now >= self._calm_until:
                self._calm_until = now + self.recheck_s
            if self._skipping:
                for r in rows:
                    r.skips = 0
                self._skipping = False
            return list(rows), []
        slack = {id(r): r.playback.slack(now) for r in rows}
        chosen, out = [], []
        for r in sorted(rows, key=lambda r: (r.playback.started is not None, slack[id(r)])):
            if slack[id(r)] > self.ahead_s and r.skips < self.max_skips:
                r.skips += 1
                out.append(r)
            else:
                r.skips = 0
                chosen.append(r)
        self._skipping = True
        return chosen, out
