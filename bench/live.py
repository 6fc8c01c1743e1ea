"""`voxpipe bench --workload live`: the live-stream capacity of the served stack. N sessions talk to
the gateway at once; each asks for a reply (the seedtts-like text prompt, ~10 s of audio forced),
plays its audio at 1x real time behind a jitter buffer as it arrives, and asks its next turn a think
time after its playback ends (a refused or failed turn: a think time after it ended). Per level (N
sessions for --live-duration seconds): underruns and the silence they insert (bench/playback.py
defines them), TTFP p50 / p90 / p99, refusals (429) apart from other failures. A level **holds**
with zero underruns, no refusal, no failure, at least one reply and TTFP p90 <= --ttfp-budget-ms;
the live-stream capacity is the most sessions that held with no failed level at or below them,
found by doubling then bisecting over N (bench.playback.search), once per client: the realtime
WebSocket (audio deltas read as they come, one WebSocket per turn, TTFP from response.create) and
chat completions streamed over SSE by the openai SDK (TTFP from the call)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from .playback import Played, capacity, percentiles_ms, play, search, slack_series
from .workload import SAMPLE_RATE, WORKLOADS, RequestRecord, Workload, pct, run_one

CLIENTS = ("realtime", "chat")
SLACK_SESSIONS = 16          # sessions whose slack series the report keeps (the plot's lines)
SLACK_STEP_S = 0.1           # the slack series' sampling step


def client_names(spec: str) -> list[str]:
    import argparse

    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names or any(n not in CLIENTS for n in names):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(CLIENTS)}, got {spec!r}")
    return list(dict.fromkeys(names))


def _positive(kind):
    import argparse

    def parse(spec: str):
        try:
            v = kind(spec)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole ' if kind is int else ''}number: {spec!r}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise argparse.ArgumentTypeError(f"must be positive, got {spec}")
        return v
    return parse


def _non_negative(spec: str) -> float:
    import argparse

    try:
        v = float(spec)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {spec!r}") from None
    if not 0.0 <= v < math.inf:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {spec}")
    return v


def add_arguments(p) -> None:
    g = p.add_argument_group("--workload live (the live-stream capacity)")
    g.add_argument("--reply-seconds", type=_positive(float), default=10.0,
                   help="audio per reply (sets the frames forced, and the text tokens in seedtts-like's proportion, "
                        "unless --frames / --text-tokens are given; default 10)")
    g.add_argument("--think-seconds", type=_non_negative, default=2.0,
                   help="a session asks its next turn this long after its playback ends (default 2)")
    g.add_argument("--jitter-ms", type=_non_negative, default=200.0,
                   help="the listener's jitter buffer: play starts this long after the first audio arrives (default 200)")
    g.add_argument("--ttfp-budget-ms", type=_positive(float), default=300.0,
                   help="a level holds with TTFP p90 at most this (and zero underruns; default 300)")
    g.add_argument("--live-duration", type=_positive(float), default=None,
                   help="seconds each level asks new turns (turns under way then finish; default 60, --quick 8)")
    g.add_argument("--live-max", type=_positive(int), default=None,
                   help="the most sessions the search tries (default 1024, --quick 2)")
    g.add_argument("--live-resolution", type=_positive(int), default=None,
                   help="bisect until the capacity and the fewest sessions that failed are this close (default 8, "
                        "--quick 1)")
    g.add_argument("--live-clients", type=client_names, default=list(CLIENTS),
                   help="comma list of realtime (the WebSocket), chat (chat completions over SSE); default both")


@dataclass(frozen=True)
class Settings:
    """One live run's settings (the flags, --quick resolved)."""

    first: tuple[int, ...]        # the levels tried first (--concurrency, else the workload's)
    most: int
    resolution: int
    duration_s: float
    reply_s: float
    think_s: float
    jitter_s: float
    ttfp_budget_ms: float
    clients: tuple[str, ...]
    warmup: int

    @classmethod
    def of(cls, args, wl: Workload) -> "Settings":
        quick = args.quick
        return cls(first=tuple(args.concurrency) or ((1, 2) if quick else wl.levels),
                   most=args.live_max or (2 if quick else 1024),
                   resolution=args.live_resolution or (1 if quick else 8),
                   duration_s=args.live_duration or (8.0 if quick else 60.0), reply_s=args.reply_seconds,
                   think_s=args.think_seconds, jitter_s=args.jitter_ms / 1000.0, ttfp_budget_ms=args.ttfp_budget_ms,
                   clients=tuple(args.live_clients), warmup=min(args.warmup, 2) if quick else args.warmup)

    @property
    def period_s(self) -> float:
        """A session's nominal turn: the reply's playback and the think time. Sessions start spread
        evenly over one period (the phases of a steady state), not all at once."""
        return self.reply_s + self.think_s

    def as_dict(self) -> dict:
        """As JSON holds it (lists for the tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def reply_sized(wl: Workload, cfg, seconds: float, frames: int = 0, text_tokens: int = 0) -> Workload:
    """`wl` forced to about `seconds` of audio a reply: the frames at the codec's rate (config), the
    text tokens in seedtts-like's proportion; non-zero `frames` / `text_tokens` (the flags) win."""
    per_s = cfg.code2wav.sample_rate / cfg.code2wav.samples_per_frame
    n = frames or max(1, round(seconds * per_s))
    seed = WORKLOADS["seedtts-like"]
    return replace(wl, frames=n, text_tokens=text_tokens or max(1, round(n * seed.text_tokens / seed.frames)))


@dataclass
class Turn:
    """One turn of one session: the request as the client saw it and, with audio, its playback."""

    session: int
    record: RequestRecord
    played: Played | None


@dataclass
class LiveLevel:
    """One level of the search: `sessions` sessions for `duration_s` seconds through one client."""

    client: str
    sessions: int
    duration_s: float
    wall_s: float                    # from the level's start until its last turn ended (or was cut)
    requests: int                    # turns asked (refused and failed ones included)
    completed: int                   # turns with audio and no error
    refusals: int                    # turns the gateway refused (429 / session limit)
    failed: int                      # other errors, and turns cut at the level's end (see errors)
    underruns: int                   # late packets, over every completed turn
    underrun_ms: float               # silence they inserted
    sessions_with_underruns: int
    ttfp_ms: dict                    # p50 p90 p99 mean over the completed turns
    margin_ms: dict                  # per completed turn its smallest margin (bench.playback): min, p1, p50
    audio_s: float                   # mean audio per completed turn
    packets: float                   # mean audio packets (deltas / SSE chunks) per completed turn
    req_per_s: float                 # completed turns per second of wall
    holds: bool
    client_lag_ms: dict = field(default_factory=dict)   # the driver's own event loop: how late it woke (mean, max)
    errors: list = field(default_factory=list)      # the first few failures' messages
    turns: list = field(default_factory=list, repr=False)   # Turn, kept for the slack series (not reported)

    @classmethod
    def of(cls, client: str, sessions: int, settings: Settings, turns: list[Turn], wall: float,
           lags: list[float] | None = None) -> "LiveLevel":
        ok = [t for t in turns if t.played is not None]
        refused = sum(t.record.refused for t in turns)
        failed = len(turns) - len(ok) - refused
        underruns = sum(t.played.underruns for t in ok)
        ttfp = percentiles_ms([t.record.ttfp for t in ok])
        margins = [t.played.margin_s for t in ok if math.isfinite(t.played.margin_s)]
        holds = bool(ok) and underruns == 0 and refused == 0 and failed == 0 and ttfp["p90"] <= settings.ttfp_budget_ms
        return cls(client=client, sessions=sessions, duration_s=settings.duration_s, wall_s=wall,
                   requests=len(turns), completed=len(ok), refusals=refused, failed=failed, underruns=underruns,
                   underrun_ms=sum(t.played.silence_s for t in ok) * 1000.0,
                   sessions_with_underruns=len({t.session for t in ok if t.played.underruns}),
                   ttfp_ms=ttfp,
                   margin_ms={"min": pct(margins, 0.0) * 1000.0, "p1": pct(margins, 0.01) * 1000.0,
                              "p50": pct(margins, 0.5) * 1000.0},
                   audio_s=sum(t.record.samples for t in ok) / SAMPLE_RATE / len(ok) if ok else 0.0,
                   packets=sum(len(t.record.packets) for t in ok) / len(ok) if ok else 0.0,
                   req_per_s=len(ok) / wall if wall else 0.0, holds=holds,
                   client_lag_ms={"mean": sum(lags) / len(lags) * 1000.0, "max": max(lags) * 1000.0} if lags else {},
                   errors=[t.record.error for t in turns if t.record.error and not t.record.refused][:3],
                   turns=turns)

    def as_dict(self) -> dict:
        d = asdict(self)
        del d["turns"]
        return d

    def slack(self, t0: float) -> dict:
        """The first SLACK_SESSIONS sessions' slack (s) every SLACK_STEP_S from the level's start `t0`."""
        end = max((t.played.end for t in self.turns if t.played), default=t0) - t0
        times = [i * SLACK_STEP_S for i in range(int(end / SLACK_STEP_S) + 2)]
        series = {}
        for s in range(min(self.sessions, SLACK_SESSIONS)):
            replies = [t.played for t in self.turns if t.session == s and t.played]
            series[str(s)] = [round(v, 4) for v in slack_series(replies, [t0 + x for x in times])]
        return {"client": self.client, "sessions": self.sessions, "holds": self.holds,
                "t_s": [round(x, 3) for x in times], "slack_s": series}


async def _session(index: int, sessions: int, stream_fn, request_for: Callable[[int], object], settings: Settings,
                   t0: float, turns: list[Turn]) -> None:
    """Session `index` of `sessions`: starts index / sessions of a period after t0, asks turns until
    the level's duration is over."""
    await asyncio.sleep(index * settings.period_s / sessions)
    stop = t0 + settings.duration_s
    turn = 0
    while time.perf_counter() < stop:
        req = request_for(index + turn * sessions)
        turn += 1
        start = time.perf_counter()
        try:
            rec = await run_one(stream_fn, req)
        except asyncio.CancelledError:
            turns.append(Turn(index, RequestRecord(start=start, error="unfinished at the level's end"), None))
            raise
        played = None
        if rec.error is None and rec.packets:
            played = play([(a, n / SAMPLE_RATE) for a, n in rec.packets], settings.jitter_s)
        elif rec.error is None:
            rec.error = "a reply without audio"
        turns.append(Turn(index, rec, played))
        wake = (played.end if played else time.perf_counter()) + settings.think_s
        if wake >= stop:
            return
        await asyncio.sleep(max(0.0, wake - time.perf_counter()))


async def run_level(client: str, stream_fn, request_for, sessions: int, settings: Settings) -> tuple[LiveLevel, float]:
    """`sessions` sessions through `stream_fn`; the turns under way at the level's end may finish for
    one more duration (at least 30 s), then are cut (failed). Returns the level and its start."""
    from voxpipe.services.runtime.metrics import watch_loop_lag

    turns: list[Turn] = []
    lags: list[float] = []
    lag = asyncio.ensure_future(watch_loop_lag(lags.append))
    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(_session(i, sessions, stream_fn, request_for, settings, t0, turns))
             for i in range(sessions)]
    cutoff = settings.duration_s + max(settings.duration_s, 30.0)
    done, pending = await asyncio.wait(tasks, timeout=max(0.0, t0 + cutoff - time.perf_counter()))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    lag.cancel()
    for task in done:
        task.result()              # a bug in the driver surfaces here
    return LiveLevel.of(client, sessions, settings, turns, time.perf_counter() - t0, lags), t0


@dataclass
class ClientRun:
    """One client's search: its levels in the order tried and the capacity they show."""

    client: str
    capacity: int
    levels: list[LiveLevel]
    starts: dict = field(default_factory=dict, repr=False)     # sessions -> the level's t0

    def as_dict(self) -> dict:
        return {"client": self.client, "capacity": self.capacity, "levels": [lv.as_dict() for lv in self.levels]}


async def run_client(client: str, stream_fn, make_request: Callable[[int], object], settings: Settings,
                     label: str = "live") -> ClientRun:
    """Warm-up turns (not measured), then the capacity search through one client."""
    cache: dict[int, object] = {}

    def request_for(i: int):
        if i not in cache:
            cache[i] = make_request(i)
        return cache[i]

    per_session = int(settings.duration_s / settings.period_s) + 2
    if settings.warmup:
        await asyncio.gather(*(run_one(stream_fn, make_request(100_000 + i)) for i in range(settings.warmup)))
    starts: dict[int, float] = {}

    async def level(n: int) -> LiveLevel:
        for i in range(n * per_session):    # built before the clock starts (a chat prompt is fitted to its length)
            request_for(i)
        lv, starts[n] = await run_level(client, stream_fn, request_for, n, settings)
        print(f"[{label} / {client}] {n} sessions: {'holds' if lv.holds else 'fails'}; {lv.requests} turns, "
              f"{lv.underruns} underruns ({lv.underrun_ms:.0f} ms), TTFP p50 / p90 / p99 {lv.ttfp_ms['p50']:.1f} / "
              f"{lv.ttfp_ms['p90']:.1f} / {lv.ttfp_ms['p99']:.1f} ms, {lv.refusals} refused, {lv.failed} failed"
              + (f" ({lv.errors[0]})" if lv.errors else ""), flush=True)
        return lv

    levels = await search(level, settings.first, settings.most, settings.resolution)
    cap = capacity(levels)
    print(f"[{label} / {client}] live-stream capacity: {cap} sessions", flush=True)
    return ClientRun(client, cap, levels, starts)


def report(runs: list[ClientRun], settings: Settings, layout: str, wl: Workload) -> dict:
    """The JSON report: settings, per client the capacity and every level tried, and the slack series
    of the first client's level at its capacity and of the fewest sessions that failed above it."""
    slack = []
    if runs:
        first = runs[0]
        held = [lv for lv in first.levels if lv.holds and lv.sessions == first.capacity]
        above = sorted((lv for lv in first.levels if not lv.holds), key=lambda lv: lv.sessions)
        for lv in held[:1] + above[:1]:
            slack.append(lv.slack(first.starts[lv.sessions]))
    return {"workload": wl.describe(), "layout": layout, "settings": settings.as_dict(),
            "capacity": {r.client: r.capacity for r in runs}, "clients": [r.as_dict() for r in runs], "slack": slack}


def section(live: dict) -> str:
    """The live workload's part of results.md."""
    s = live["settings"]
    rows = [f"#### {live['workload']}",
            f"Sessions play each reply at 1x behind a {s['jitter_s'] * 1000:.0f} ms jitter buffer and ask again "
            f"{s['think_s']:g} s after it ends; {s['duration_s']:g} s a level; a level holds with 0 underruns, no "
            f"refusal or failure and TTFP p90 <= {s['ttfp_budget_ms']:g} ms. Layout: {live['layout']}.",
            "| client | sessions | turns | done | refused (429) | failed | underruns | underrun ms | sessions with "
            "underruns | TTFP p50 / p90 / p99 ms | min margin ms | req/s | driver loop lag mean / max ms | holds |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in live["clients"]:
        for lv in sorted(run["levels"], key=lambda lv: lv["sessions"]):
            t, lag, nan = lv["ttfp_ms"], lv["client_lag_ms"], float("nan")
            rows.append(f"| {run['client']} | {lv['sessions']} | {lv['requests']} | {lv['completed']} | {lv['refusals']} | "
                        f"{lv['failed']} | {lv['underruns']} | {lv['underrun_ms']:.0f} | {lv['sessions_with_underruns']} | "
                        f"{t['p50']:.1f} / {t['p90']:.1f} / {t['p99']:.1f} | {lv['margin_ms']['min']:.0f} | "
                        f"{lv['req_per_s']:.2f} | {lag.get('mean', nan):.1f} / {lag.get('max', nan):.1f} | "
                        f"{'yes' if lv['holds'] else 'no'} |")
    caps = "; ".join(f"{c}: **{n}** sessions" for c, n in live["capacity"].items())
    return "\n".join(rows[:2]) + "\n\n" + "\n".join(rows[2:]) + f"\n\nLive-stream capacity: {caps}"
