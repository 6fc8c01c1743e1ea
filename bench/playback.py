"""The live workload's arithmetic: a listener playing one reply's audio at 1x real time behind a jitter
buffer (underruns, the slack series), the percentiles of a level, and the capacity search over levels.
Pure functions of hand-checkable timelines; bench/live.py drives the sessions that produce them.

Playback of one reply (all times in seconds on one clock; packet i arrives at a[i] holding d[i] seconds
of audio, in stream order):
- the play clock starts at P = a[0] + jitter (the jitter buffer: 200 ms by default);
- the player plays the packets back to back: packet i starts at s[i] = max(e[i-1], a[i]) with
  e[-1] = P, and ends at e[i] = s[i] + d[i];
- an **underrun** is a packet that arrives after its play time: a[i] > e[i-1] (the buffer ran dry at
  e[i-1]). The player then plays silence until the packet arrives and resumes from there (no
  re-buffering); the **silence inserted** is a[i] - e[i-1]. A reply's underrun count is the number of
  such packets, its underrun ms the sum of their silences. Packet 0 is never late (a[0] <= P);
- playback ends at e[-1] (the last packet's end); the next turn is asked a think time after it;
- **slack** at time t = audio delivered by t (the d[i] with a[i] <= t) minus audio played by t (each
  packet's part of [s[i], e[i]] before t): the jitter buffer's fill while waiting for P, never
  negative (the player stalls instead), 0 before the first packet and after the end;
- a packet's **margin** = e[i-1] - a[i] for i >= 1: the audio left to play when it arrived (negative:
  the silence it caused); a reply's margin is its smallest.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from .workload import pct


@dataclass(frozen=True)
class Played:
    """One reply's playback (see the module's definitions)."""

    start: float                  # P: the play clock's start (first arrival + jitter)
    end: float                    # the last packet's end of play
    starts: tuple[float, ...]     # s[i]: when each packet starts playing
    durations: tuple[float, ...]  # d[i] seconds
    arrivals: tuple[float, ...]   # a[i]
    underruns: int                # packets that arrived after their play time
    silence_s: float              # silence inserted for them, seconds
    margin_s: float               # min over i >= 1 of e[i-1] - a[i] (inf for a one-packet reply)

    def delivered(self, t: float) -> float:
        """Seconds of audio that had arrived by t."""
        return sum(d for a, d in zip(self.arrivals, self.durations) if a <= t)

    def played(self, t: float) -> float:
        """Seconds of audio played by t."""
        return sum(min(max(t - s, 0.0), d) for s, d in zip(self.starts, self.durations))

    def slack(self, t: float) -> float:
        """Audio delivered minus audio played at t, seconds."""
        return self.delivered(t) - self.played(t)


def play(packets: Sequence[tuple[float, float]], jitter_s: float) -> Played:
    """Playback of `packets`, (arrival s, audio s) in stream order with non-decreasing arrivals, at 1x
    real time behind a jitter buffer of `jitter_s`."""
    if not packets:
        raise ValueError("a reply without audio has no playback")
    arrivals = tuple(a for a, _ in packets)
    durations = tuple(d for _, d in packets)
    start = arrivals[0] + jitter_s
    end, starts, underruns, silence, margin = start, [], 0, 0.0, math.inf
    for i, (a, d) in enumerate(packets):
        if i:
            margin = min(margin, end - a)
        if a > end:
            underruns += 1
            silence += a - end
        s = max(end, a)
        starts.append(s)
        end = s + d
    return Played(start, end, tuple(starts), durations, arrivals, underruns, silence, margin)


def slack_series(replies: Sequence[Played], times: Sequence[float]) -> list[float]:
    """One session's slack at each of `times`: that of the reply whose audio spans t (first arrival
    to end of play), 0 between replies (waiting for a first packet or thinking)."""
    out = []
    for t in times:
        live = [r for r in replies if r.arrivals[0] <= t <= r.end]
        out.append(live[0].slack(t) if live else 0.0)
    return out


def percentiles_ms(values_s: Sequence[float]) -> dict[str, float]:
    """p50 / p90 / p99 / mean in ms of values in seconds (linear interpolation between order
    statistics, bench.workload.pct; nan for none)."""
    vals = list(values_s)
    return {"p50": pct(vals, 0.5) * 1000.0, "p90": pct(vals, 0.9) * 1000.0, "p99": pct(vals, 0.99) * 1000.0,
            "mean": (sum(vals) / len(vals) * 1000.0) if vals else float("nan")}


# ------------------------------------------------------------------------------------------ capacity

class Verdict(Protocol):
    """What the capacity search needs of one level (bench.live.LiveLevel)."""

    sessions: int
    holds: bool        # zero underruns, no refusal or failure, TTFP p90 within budget


V = TypeVar("V", bound=Verdict)


def bounds(tried: Sequence[Verdict]) -> tuple[int, int | None]:
    """(lo, hi): hi = the fewest sessions that failed (None: none failed); lo = the most sessions that
    held below hi (0: none). Non-monotone results (a level holding above one that failed) count
    against the capacity: it is never above a failed level."""
    failed = [v.sessions for v in tried if not v.holds]
    hi = min(failed) if failed else None
    held = [v.sessions for v in tried if v.holds and (hi is None or v.sessions < hi)]
    return (max(held) if held else 0), hi


def capacity(tried: Sequence[Verdict]) -> int:
    """The live-stream capacity the tried levels show: the most sessions that held with no failed
    level at or below it."""
    return bounds(tried)[0]


async def search(run: Callable[[int], Awaitable[V]], first: Sequence[int], most: int,
                 resolution: int = 1) -> list[V]:
    """Levels tried, in order: each of `first` (capped at `most`), then doubling the capacity found
    while no level failed and it is below `most`, then bisecting between the capacity and the fewest
    sessions that failed until they are at most `resolution` apart. A level is run once."""
    if most < 1 or resolution < 1 or not first or min(first) < 1:
        raise ValueError("levels, the maximum and the resolution are positive session counts")
    tried: dict[int, V] = {}

    async def at(n: int) -> None:
        if n not in tried:
            tried[n] = await run(n)

    for n in sorted({min(n, most) for n in first}):
        await at(n)
    lo, hi = bounds(list(tried.values()))
    while hi is None and 0 < lo < most:
        await at(min(2 * lo, most))
        lo, hi = bounds(list(tried.values()))
    while hi is not None and hi - lo > resolution:
        await at((lo + hi) // 2)
        lo, hi = bounds(list(tried.values()))
    return list(tried.values())
