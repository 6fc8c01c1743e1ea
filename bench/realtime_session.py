"""Realtime voice sessions of many turns, timed from the end of speech: `voxpipe bench --workload
realtime-conversation` (the bench starts the services and the gateway; --concurrency: sessions,
--turns: turns each, --realtime-pace, --audio), or on a running gateway:

    python -m voxpipe.bench.realtime_session --gateway http://127.0.0.1:8000 [--sessions 1] [--turns 40]
        [--pace 1] [--audio CLIP.wav] [--text-tokens 8] [--frames 16]

Each session (a WebSocket, GA events, no turn detection, greedy) speaks a clip every turn -- the
voice clip rotated by an offset of the session and turn, so that every turn is new audio -- appended
as it is spoken (`pace` times real time; the gateway streams it to the thinker as it comes), commits
it and asks for a spoken reply right behind: a turn's TTFP is the commit to the reply's first
`response.output_audio.delta`. The conversation grows turn by turn (each reply's forced text and
audio). A level reports per turn the TTFP p50 / p90 / max across its sessions, the same over all
turns, the share of the prompts their cache held (usage: cached / input tokens), the gateway's mean
share of each streamed prompt prefilled before its commit (its /metrics), and with several thinker
replicas each one's streams and prefix-cache hits (their /metrics) and the load spread."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from .realtime_client import REALTIME_RATE, RealtimeError, _expect, _receive, _send, speak
from .voice_clip import rotated
from .workload import SYSTEM_TEXT

WARMUP_TURNS = 2              # an unmeasured session before the levels (--warmup > 0): first shapes, first graphs


@dataclass(frozen=True)
class Settings:
    turns: int = 40
    pace: float = 1.0             # times real time the clip is appended at (0: at once)
    text_tokens: int = 8          # each reply's forced text tokens
    frames: int = 16              # each reply's codec frames (max_audio_frames)
    voice: str | None = None      # the session's output voice (None: the gateway's default)
    warmup: bool = True           # one unmeasured session of WARMUP_TURNS turns before the first level


@dataclass
class TurnRecord:
    session: int
    turn: int                     # from 1
    ttfp_ms: float | None = None  # the commit to the first audio delta
    input_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


async def session(url: str, index: int, pcm16: np.ndarray, settings: Settings, records: list[TurnRecord],
                  echo: bool = False) -> None:
    """One session of `settings.turns` turns; each turn's record appended to `records` (a failed turn
    ends the session: its conversation is incomplete). `pcm16`: the clip, 24 kHz int16."""
    from websockets.asyncio.client import connect

    rec = TurnRecord(index, 0)
    try:
        async with connect(url, max_size=None, open_timeout=60) as ws:
            await _expect(ws, "session.created")
            audio = {"input": {"turn_detection": None}}
            if settings.voice:
                audio["output"] = {"voice": settings.voice}
            await _send(ws, "session.update", session={
                "type": "realtime", "instructions": SYSTEM_TEXT, "output_modalities": ["audio"], "audio": audio,
                "temperature": 0, "ignore_eos": True, "max_output_tokens": settings.text_tokens,
                "max_audio_frames": settings.frames})
            await _expect(ws, "session.updated")
            for turn in range(1, settings.turns + 1):
                rec = TurnRecord(index, turn)
                records.append(rec)
                await speak(ws, rotated(pcm16, index, turn).tobytes(), settings.pace)
                await _send(ws, "input_audio_buffer.commit")
                committed = time.perf_counter()
                await _send(ws, "response.create", response={})
                while True:
                    event = await _receive(ws)
                    if event["type"] == "response.output_audio.delta" and rec.ttfp_ms is None:
                        rec.ttfp_ms = round((time.perf_counter() - committed) * 1000, 2)
                    elif event["type"] == "response.done":
                        response = event["response"]
                        if response["status"] not in ("completed", "incomplete"):    # forced lengths: incomplete
                            raise RealtimeError(f"response {response['status']}: {response.get('status_details')}")
                        usage = response.get("usage") or {}
                        rec.input_tokens = usage.get("input_tokens", 0)
                        rec.cached_tokens = (usage.get("input_token_details") or {}).get("cached_tokens", 0)
                        break
                if echo:
                    print(json.dumps(asdict(rec)), flush=True)
    except Exception as e:      # noqa: BLE001 - the turn (or the session's set-up: turn 0) fails alone
        rec.error = f"{type(e).__name__}: {e}"[:300]
        if rec.turn == 0:
            records.append(rec)


@dataclass(frozen=True)
class GatewayCounts:
    """What the level reads from the gateway's /metrics before and after it."""

    streamed_sum: float = 0.0       # voxpipe_gateway_realtime_prefilled_before_commit: sum of the shares
    streamed_count: float = 0.0     # ... and the streamed turns
    routed: tuple[tuple[str, float], ...] = ()     # voxpipe_gateway_routed_total{stage="thinker"} by outcome

    @classmethod
    def read(cls, base_url: str) -> "GatewayCounts":
        from prometheus_client.parser import text_string_to_metric_families

        body = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
        found, routed = {}, {}
        for fam in text_string_to_metric_families(body):
            for s in fam.samples:
                if s.name.startswith("voxpipe_gateway_realtime_prefilled_before_commit_"):
                    found[s.name.rsplit("_", 1)[1]] = s.value
                elif s.name == "voxpipe_gateway_routed_total" and s.labels.get("stage") == "thinker":
                    routed[s.labels["outcome"]] = s.value
        return cls(found.get("sum", 0.0), found.get("count", 0.0), tuple(sorted(routed.items())))

    def since(self, before: "GatewayCounts") -> tuple[int, float | None, dict[str, int]]:
        """Streamed turns, their mean share prefilled before the commit, thinker picks by outcome."""
        count = self.streamed_count - before.streamed_count
        share = round((self.streamed_sum - before.streamed_sum) / count, 4) if count else None
        was = dict(before.routed)
        return int(count), share, {k: int(v - was.get(k, 0.0)) for k, v in self.routed}


@dataclass
class LevelReport:
    sessions: int
    turns: list[dict] = field(default_factory=list)      # per turn: n, TTFP p50 / p90 / max, input tokens, cached
    ttfp_ms: dict = field(default_factory=dict)          # over every turn of every session: p50 p90 max
    worst_turn_p90_ms: float | None = None               # the highest per-turn p90 across sessions
    failed: int = 0                                      # turns (or session set-ups) that failed
    errors: list[str] = field(default_factory=list)      # the first few
    without_audio: int = 0                               # turns that finished without an audio delta
    wall_s: float = 0.0
    cached_fraction: float = 0.0                         # usage: cached / input tokens over the finished turns
    streamed_turns: int = 0                              # the gateway's streamed turns in the level
    prefilled_before_commit: float | None = None         # their mean share of the prompt prefilled before the commit
    routed: dict[str, int] = field(default_factory=dict)  # the gateway's thinker picks by how they were made
                                                          # (session, prefix, least_loaded: all with one replica)
    server: dict[str, dict] = field(default_factory=dict)    # per stage: means over the level (bench.server_stats)
    replicas: dict[str, dict] = field(default_factory=dict)  # thinker process -> streams, prefix tokens and hits
    load_spread: float = 0.0                                 # (max - min) / mean of the replicas' streams


def _pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 2) if values else None


def settled(read: Callable[[], dict[str, dict]], quiet_s: float = 0.3, timeout_s: float = 10.0) -> dict[str, dict]:
    """`read()` once two reads `quiet_s` apart agree (a stage counts a stream when its handler ends,
    a moment after the client has the reply's last event), or after `timeout_s`."""
    last, deadline = read(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = read()
        if now == last:
            break
        last = now
    return last


def replica_stats(before: dict[str, dict], after: dict[str, dict]) -> tuple[dict[str, dict], float]:
    """Per thinker process, what grew between two reads of its counters (bench.server_stats.thinker_counts):
    streams, prompt tokens looked up in its prefix cache and found there, their share; and the load
    spread (max - min) / mean of the streams."""
    out = {}
    for name, a in after.items():
        d = {k: v - before.get(name, {}).get(k, 0.0) for k, v in a.items()}
        d["hit_rate"] = d["hit_tokens"] / d["queried_tokens"] if d["queried_tokens"] else 0.0
        out[name] = d
    loads = [d["streams"] for d in out.values()]
    spread = (max(loads) - min(loads)) / statistics.mean(loads) if loads and statistics.mean(loads) else 0.0
    return out, spread


async def run_level(url: str, base_url: str, pcm16: np.ndarray, settings: Settings, sessions: int,
                    scrape: Callable[[], str] | None = None,
                    replica_counts: Callable[[], dict[str, dict]] | None = None, echo: bool = False) -> LevelReport:
    """`sessions` sessions at once. `scrape`: the services' /metrics text (the level's per-stage means);
    `replica_counts`: per thinker process its counters (bench.server_stats.thinker_counts), read
    before and after the level."""
    from . import server_stats

    records: list[TurnRecord] = []
    counts = await asyncio.to_thread(settled, replica_counts) if replica_counts else None   # first: the warm-up's end
    before = server_stats.parse(await asyncio.to_thread(scrape)) if scrape else None
    gateway = await asyncio.to_thread(GatewayCounts.read, base_url)
    t0 = time.perf_counter()
    await asyncio.gather(*(session(url, s, pcm16, settings, records, echo) for s in range(sessions)))
    rep = LevelReport(sessions, wall_s=round(time.perf_counter() - t0, 2))
    if replica_counts:
        rep.replicas, rep.load_spread = replica_stats(counts, await asyncio.to_thread(settled, replica_counts))
    rep.streamed_turns, rep.prefilled_before_commit, rep.routed = \
        (await asyncio.to_thread(GatewayCounts.read, base_url)).since(gateway)
    if scrape:
        after = server_stats.parse(await asyncio.to_thread(scrape))
        stages = server_stats.level_stats(before, after, ("thinker", "talker", "code2wav"))
        rep.server = {k: v for k, v in stages.items() if v}
    bad = [r for r in records if r.error is not None]
    rep.failed, rep.errors = len(bad), [r.error for r in bad][:3]
    ok = [r for r in records if r.error is None]
    rep.without_audio = sum(r.ttfp_ms is None for r in ok)
    rep.cached_fraction = sum(r.cached_tokens for r in ok) / max(sum(r.input_tokens for r in ok), 1)
    timed = [r for r in ok if r.ttfp_ms is not None]
    all_ttfp = [r.ttfp_ms for r in timed]
    rep.ttfp_ms = {"p50": _pct(all_ttfp, 50), "p90": _pct(all_ttfp, 90), "max": max(all_ttfp, default=None)}
    for turn in range(1, settings.turns + 1):
        done = [r for r in timed if r.turn == turn]
        if done:
            ttfp, tokens = [r.ttfp_ms for r in done], [r.input_tokens for r in done]
            rep.turns.append({"turn": turn, "n": len(done), "ttfp_p50_ms": _pct(ttfp, 50), "ttfp_p90_ms": _pct(ttfp, 90),
                              "ttfp_max_ms": max(ttfp), "input_tokens": round(statistics.mean(tokens)),
                              "cached_fraction": sum(r.cached_tokens for r in done) / max(sum(tokens), 1)})
    rep.worst_turn_p90_ms = max((t["ttfp_p90_ms"] for t in rep.turns), default=None)
    print(f"realtime-conversation: {sessions} sessions x {settings.turns} turns in {rep.wall_s:.0f} s: TTFP from the "
          f"commit p50 / p90 / max {rep.ttfp_ms['p50']} / {rep.ttfp_ms['p90']} / {rep.ttfp_ms['max']} ms, worst turn's "
          f"p90 {rep.worst_turn_p90_ms} ms, cached {rep.cached_fraction:.1%}, prefilled before the commit "
          f"{_share(rep.prefilled_before_commit)} of {rep.streamed_turns} streamed turns, failed {rep.failed}"
          + (f", thinker picks {rep.routed}, streams per replica "
             f"{[round(d['streams']) for _, d in sorted(rep.replicas.items())]}" if len(rep.replicas) > 1 else "")
          + (f" ({rep.errors[0]})" if rep.errors else ""), flush=True)
    return rep


async def run(base_url: str, model: str, clip_pcm16: bytes, settings: Settings, levels: list[int],
              scrape: Callable[[], str] | None = None,
              replica_counts: Callable[[], dict[str, dict]] | None = None, echo: bool = False) -> dict:
    """Each level of sessions in turn on the gateway at `base_url` (http://HOST:PORT), after one
    unmeasured warm-up session (settings.warmup). `clip_pcm16`: the voice clip, 24 kHz pcm16."""
    pcm16 = np.frombuffer(clip_pcm16, "<i2")
    url = base_url.replace("http://", "ws://", 1).rstrip("/") + f"/v1/realtime?model={model}"
    report = {"settings": asdict(settings), "clip_s": round(len(pcm16) / REALTIME_RATE, 2), "levels": []}
    if settings.warmup:
        warm: list[TurnRecord] = []
        await session(url, 10_000, pcm16, Settings(**{**asdict(settings), "turns": min(settings.turns, WARMUP_TURNS)}),
                      warm)
        report["warmup_errors"] = [r.error for r in warm if r.error]
    for c in levels:
        print(f"realtime-conversation: {c} sessions x {settings.turns} turns, appended at "
              f"{_pace(settings.pace)}", flush=True)
        level = await run_level(url, base_url, pcm16, settings, c, scrape, replica_counts, echo)
        report["levels"].append(asdict(level))
    return report


def _pace(pace: float) -> str:
    return f"{pace:g}x real time" if pace else "once"


def _share(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1%}"


def _ms(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def section(report: dict) -> str:
    s = report["settings"]
    lines = [f"#### realtime-conversation: a {report['clip_s']:g} s voice clip a turn (rotated per session and "
             f"turn), appended at {_pace(s['pace'])}, manual commit, {s['text_tokens']} text tokens and "
             f"{s['frames']} frames a reply, {s['turns']} turns a session, over the realtime WebSocket (TTFP "
             f"from the commit: the end of speech)", ""]
    for lvl in report["levels"]:
        t = lvl["ttfp_ms"]
        lines += [f"{lvl['sessions']} sessions ({lvl['failed']} failed, {lvl['without_audio']} without audio, "
                  f"{lvl['wall_s']:.0f} s): TTFP p50 / p90 / max over every turn **{_ms(t['p50'])} / {_ms(t['p90'])} / "
                  f"{_ms(t['max'])} ms**, worst turn's p90 {_ms(lvl['worst_turn_p90_ms'])} ms; "
                  f"{lvl['cached_fraction']:.1%} of prompt tokens cached; prefilled before the commit "
                  f"{_share(lvl['prefilled_before_commit'])} of the prompt (mean of {lvl['streamed_turns']} streamed "
                  f"turns)" + "".join(f", {st['audio_prefilled_before_commit']:.0%} of the clips' audio tokens"
                                      for stage, st in lvl["server"].items()
                                      if stage == "thinker" and "audio_prefilled_before_commit" in st)
                  + (f"; first error: {lvl['errors'][0]}" if lvl["errors"] else ""), ""]
        if len(lvl["replicas"]) > 1:
            lines += replica_table(lvl["replicas"], lvl["load_spread"])
            lines += ["The gateway's thinker picks (session: the replica of the session's previous turn; least "
                      "loaded: a first turn, or a session whose replica was over the load bound): "
                      + ", ".join(f"{k} {v}" for k, v in sorted(lvl["routed"].items())), ""]
        lines += ["| turn | sessions | prompt tokens | TTFP p50 ms | TTFP p90 ms | TTFP max ms | cached |",
                  "|---|---|---|---|---|---|---|"]
        worst = max(lvl["turns"], key=lambda r: r["ttfp_max_ms"], default=None)
        for r in lvl["turns"]:
            if r["turn"] in (1, 2, 5, 10, 20, 30, 40) or r is lvl["turns"][-1] or r is worst:
                lines.append(f"| {r['turn']}{' (worst max)' if r is worst else ''} | {r['n']} | {r['input_tokens']} | "
                             f"{_ms(r['ttfp_p50_ms'])} | {_ms(r['ttfp_p90_ms'])} | {_ms(r['ttfp_max_ms'])} | "
                             f"{r['cached_fraction']:.0%} |")
        lines.append("")
    return "\n".join(lines)


def replica_table(replicas: dict[str, dict], spread: float) -> list[str]:
    lines = ["| thinker replica | streams | prompt tokens looked up in its prefix cache (a streamed turn: the "
             "conversation before its clip) | found there |", "|---|---|---|---|"]
    lines += [f"| {name} | {d['streams']:.0f} | {d['queried_tokens']:.0f} | {d['hit_tokens']:.0f} "
              f"({d['hit_rate']:.1%}) |" for name, d in sorted(replicas.items())]
    return lines + ["", f"load spread (max - min) / mean of streams: {spread:.1%}", ""]


async def main(args) -> dict:
    from .voice_clip import load_clip

    base = args.gateway.rstrip("/")
    model = args.model or json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())["data"][0]["id"]
    clip = load_clip(args.audio).at_rate(REALTIME_RATE)
    pcm16 = (np.clip(clip, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
    settings = Settings(args.turns, args.pace, args.text_tokens, args.frames, warmup=args.warmup)
    report = await run(base, model, pcm16, settings, [args.sessions], echo=True)
    return report["levels"][0]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m voxpipe.bench.realtime_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="the gateway's http://HOST:PORT")
    p.add_argument("--model", help="the served model (default: the gateway's first)")
    p.add_argument("--sessions", type=int, default=1)
    p.add_argument("--turns", type=int, default=40)
    p.add_argument("--pace", type=float, default=1.0, help="append at this many times real time (0: at once)")
    p.add_argument("--audio", help="the spoken clip, a wav file (default: bench/data/voice-in.wav)")
    p.add_argument("--text-tokens", type=int, default=8, help="each reply's forced text tokens")
    p.add_argument("--frames", type=int, default=16, help="each reply's codec frames (max_audio_frames)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help=f"one unmeasured session of {WARMUP_TURNS} turns first")
    args = p.parse_args(argv)
    for name in ("sessions", "turns", "text_tokens", "frames"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1")
    if not args.pace >= 0:
        p.error("--pace: must be >= 0")
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
