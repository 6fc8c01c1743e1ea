"""The conversation workload: sessions that keep their history, as a voice app does. Each turn
sends everything said so far -- the system turn, every earlier user turn and reply, the new user
turn -- and the bench measures that turn's TTFP and how much of its prompt the thinker's prefix
cache held (Finished.cached_tokens).

Turns go through the gRPC pipeline client as token ids (split mode): turn t's prompt is turn t-1's
prompt, its reply's token ids as generated, <|im_end|>\\n, then the new user turn and the assistant
head. So the history is exactly what the model saw and said, as it is for a client whose tokenizer
round-trips the reply's text (with full-size dummy weights the replies are random ids that no text
reproduces; a chat client would re-send their decoded text and miss the cache from the first reply
on). A user turn is `turn_tokens` random ids from the normal text range (~250 tokens a turn with the
reply); replies are forced to `text_tokens` tokens and `frames` frames.

A voice conversation (workload "voice-conversation") makes each user turn a clip: the bench's voice
clip rotated by a per-session, per-turn offset (so that no two turns' audio is the same content and
every new clip is a miss for the thinker's audio encoder cache, as a new utterance is), its log-mel
features computed once by the driver, then its placeholders in the prompt and every earlier clip's
features re-sent with the history (the encoder cache and the prefix cache hold those).

With several thinker replicas (--devices thinker=cuda:0*2, say) each turn goes where its prompt's
longest known prefix went (services.runtime.affinity): the report gives each replica's turns,
cached share and the load spread ((max - min) / mean of the replicas' turns), to set beside one
replica's cached share.

Also the long-context probe: one `context_tokens`-token prompt sent cold, then again (its prefix
cached), TTFP of each."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from voxpipe.client import SpeechRequest

TurnAudio = Callable[[int, int], "torch.Tensor"]     # (session, turn) -> that turn's clip's features [mel, frames]


def add_arguments(p) -> None:
    g = p.add_argument_group("conversation workload")
    g.add_argument("--turns", type=int, default=40, help="turns per conversation session (conversation, voice-conversation, realtime-conversation)")
    g.add_argument("--turn-tokens", type=int, default=200, help="tokens of each user turn")
    g.add_argument("--context-tokens", type=int, default=32768,
                   help="the long-context probe's prompt (0: skip it); sent cold, then repeated")


@dataclass(frozen=True)
class Settings:
    turns: int
    turn_tokens: int
    text_tokens: int
    frames: int
    context_tokens: int
    seed: int = 0

    @classmethod
    def of(cls, args, text_tokens: int, frames: int) -> "Settings":
        for flag, v in (("--turns", args.turns), ("--turn-tokens", args.turn_tokens)):
            if v < 1:
                raise SystemExit(f"{flag} must be at least 1, got {v}")
        if args.context_tokens < 0:
            raise SystemExit(f"--context-tokens must be 0 or more, got {args.context_tokens}")
        return cls(args.turns, args.turn_tokens, text_tokens, frames, args.context_tokens)


@dataclass
class TurnRecord:
    session: int
    turn: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttfp_ms: float | None = None
    ttft_ms: float | None = None    # the first text token (the thinker's part of the TTFP)
    error: str | None = None
    thinker: str = ""               # the replica that served it (DoneEvent.routes)


class Conversation:
    """One session's history as token ids (ChatML), turn by turn."""

    def __init__(self, cfg, settings: Settings, session: int, level: int = 0, audio: TurnAudio | None = None) -> None:
        """Session `session` of the level of `level` sessions: its own words (no two sessions of a run
        share more than the ChatML around them). `audio`: user turns are clips (a voice conversation)."""
        t = cfg.thinker.tokens
        self.t, self.settings, self.session, self.audio = t, settings, session, audio
        self.n_window = cfg.thinker.audio.n_window
        self.features: list = []          # every clip of the history so far, in order
        self.nl = 198 if cfg.thinker.text.vocab_size > 151000 else 10        # "\n"
        self.high = min(t.im_start, cfg.thinker.text.vocab_size) - 1
        self.rng = random.Random((settings.seed * 100003 + level) * 1009 + session)
        self.ids = [t.im_start, t.system, self.nl] + self._words(24) + [t.im_end, self.nl]

    def _words(self, n: int) -> list[int]:
        low = 1000 if self.high > 2000 else 0
        return [self.rng.randrange(low, self.high) for _ in range(n)]

    def ask(self) -> list[int]:
        """The next turn's prompt: the history, a new user turn, the assistant head."""
        t = self.t
        if self.audio is None:
            body = self._words(self.settings.turn_tokens)
        else:   # <|audio_start|> placeholders <|audio_end|>, as the chat template renders an audio part
            from voxpipe.services.thinker.model import audio_output_length

            feats = self.audio(self.session, len(self.features) + 1)
            self.features.append(feats)
            body = [t.audio_start] + [t.audio_token] * audio_output_length(feats.shape[1], self.n_window) + [t.audio_end]
        self.ids += [t.im_start, t.user, self.nl] + body + [t.im_end, self.nl]
        return self.ids + [t.im_start, t.assistant, self.nl]

    def answered(self, prompt: list[int], reply: list[int]) -> None:
        """The reply as generated (its end of turn, if it made one, replaced by ours), into the history.
        An image or video placeholder the (random) weights happened to generate becomes a newline: a
        prompt may not hold them (the thinker refuses it), so the next turn's cache hit ends there."""
        t = self.t
        body = [self.nl if i in (t.image_token, t.video_token) else i for i in reply if i != t.im_end]
        self.ids = prompt + body + [self.t.im_end, self.nl]


def _request(prompt: list[int], settings: Settings, rid: str, features: list | None = None) -> SpeechRequest:
    from voxpipe.client import SpeechRequest

    return SpeechRequest(token_ids=prompt, audio_features=list(features or ()), max_tokens=settings.text_tokens,
                         min_tokens=settings.text_tokens, max_frames=settings.frames, min_frames=settings.frames,
                         request_id=rid)


async def _one(stream_fn, req: SpeechRequest, rec: TurnRecord) -> list[int]:
    """Run one turn; its reply's token ids."""
    from voxpipe.client import AudioEvent, DoneEvent, TextEvent

    start = time.perf_counter()
    ids: list[int] = []
    try:
        async for ev in stream_fn(req):
            if isinstance(ev, TextEvent):
                if rec.ttft_ms is None and ev.token_ids:
                    rec.ttft_ms = (time.perf_counter() - start) * 1000.0
                ids += ev.token_ids
            elif isinstance(ev, AudioEvent) and rec.ttfp_ms is None:
                rec.ttfp_ms = (time.perf_counter() - start) * 1000.0
            elif isinstance(ev, DoneEvent):
                rec.cached_tokens = ev.cached_tokens
                rec.thinker = ev.routes.get("thinker", "")
    except Exception as e:      # the turn fails alone; the session stops (its history is incomplete)
        rec.error = f"{type(e).__name__}: {e}"[:300]
    return ids


async def _session(stream_fn, cfg, settings: Settings, session: int, level: int, records: list[TurnRecord],
                   audio: TurnAudio | None = None) -> None:
    conv = Conversation(cfg, settings, session, level, audio)
    for turn in range(1, settings.turns + 1):
        prompt = conv.ask()
        rec = TurnRecord(session, turn, len(prompt))
        records.append(rec)
        reply = await _one(stream_fn, _request(prompt, settings, f"conv-{session}-{turn}", conv.features), rec)
        if rec.error is not None:
            return
        conv.answered(prompt, reply)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class LevelReport:
    sessions: int
    turns: list[dict] = field(default_factory=list)     # per turn: TTFP p50 / p90, cached fraction, prompt tokens
    failed: int = 0
    wall_s: float = 0.0
    cached_fraction: float = 0.0                        # over every turn that finished
    replicas: dict[str, dict] = field(default_factory=dict)   # thinker address -> its turns, cached share
    load_spread: float = 0.0                            # (max - min) / mean of the replicas' turns
    server: dict[str, dict] = field(default_factory=dict)     # per stage: means over the level (server_stats)


def by_replica(records: list[TurnRecord]) -> tuple[dict[str, dict], float]:
    """Each thinker replica's finished turns, their prompt tokens and cached share; the load spread."""
    out: dict[str, dict] = {}
    for r in records:
        if r.error is None:
            d = out.setdefault(r.thinker, {"turns": 0, "prompt_tokens": 0, "cached_tokens": 0})
            d["turns"] += 1
            d["prompt_tokens"] += r.prompt_tokens
            d["cached_tokens"] += r.cached_tokens
    for d in out.values():
        d["cached_fraction"] = d["cached_tokens"] / max(d["prompt_tokens"], 1)
    loads = [d["turns"] for d in out.values()]
    spread = (max(loads) - min(loads)) / statistics.mean(loads) if loads else 0.0
    return out, spread


async def run_level(stream_fn, cfg, settings: Settings, sessions: int, audio: TurnAudio | None = None,
                    scrape: Callable[[], str] | None = None) -> LevelReport:
    """`scrape`: the services' /metrics text, read before and after the level for its per-stage means."""
    from . import server_stats

    records: list[TurnRecord] = []
    before = server_stats.parse(await asyncio.to_thread(scrape)) if scrape else None
    t0 = time.perf_counter()
    await asyncio.gather(*(_session(stream_fn, cfg, settings, s, sessions, records, audio) for s in range(sessions)))
    rep = LevelReport(sessions, failed=sum(r.error is not None for r in records), wall_s=time.perf_counter() - t0)
    if scrape:
        after = server_stats.parse(await asyncio.to_thread(scrape))
        rep.server = {k: v for k, v in server_stats.level_stats(before, after, ("thinker", "talker", "code2wav")).items()
                      if v}
    ok = [r for r in records if r.error is None]
    rep.cached_fraction = sum(r.cached_tokens for r in ok) / max(sum(r.prompt_tokens for r in ok), 1)
    rep.replicas, rep.load_spread = by_replica(records)
    for turn in range(1, settings.turns + 1):
        done = [r for r in records if r.turn == turn and r.error is None and r.ttfp_ms is not None]
        if not done:
            continue
        ttfp = [r.ttfp_ms for r in done]
        ttft = [r.ttft_ms for r in done if r.ttft_ms is not None]
        rep.turns.append({"turn": turn, "n": len(done), "prompt_tokens": round(statistics.mean(r.prompt_tokens for r in done)),
                          "ttfp_p50_ms": _pct(ttfp, 50), "ttfp_p90_ms": _pct(ttfp, 90), "ttft_p50_ms": _pct(ttft, 50),
                          "cached_fraction": sum(r.cached_tokens for r in done) / sum(r.prompt_tokens for r in done)})
    errors = [r.error for r in records if r.error]
    if errors:
        print(f"conversation c={sessions}: {len(errors)} turns failed, first: {errors[0]}", flush=True)
    return rep


async def long_context(stream_fn, cfg, settings: Settings, scrape: Callable[[], str] | None = None) -> dict:
    """One long prompt cold, then the same prompt again: TTFP of each and the second's cached tokens
    (with `scrape`: each one's per-stage server means)."""
    from . import server_stats

    conv = Conversation(cfg, Settings(1, settings.context_tokens, settings.text_tokens, settings.frames, 0, seed=7), 0)
    prompt = conv.ask()
    out = {"prompt_tokens": len(prompt)}
    for name in ("cold", "repeated"):
        rec = TurnRecord(0, 1, len(prompt))
        before = server_stats.parse(await asyncio.to_thread(scrape)) if scrape else None
        await _one(stream_fn, _request(prompt, settings, f"context-{name}"), rec)
        out[name] = asdict(rec)
        if scrape:
            after = server_stats.parse(await asyncio.to_thread(scrape))
            out[name]["server"] = {k: v for k, v in server_stats.level_stats(
                before, after, ("thinker", "talker", "code2wav")).items() if v}
    return out


async def run(stream_fn, cfg, settings: Settings, levels: list[int], audio: TurnAudio | None = None,
              scrape: Callable[[], str] | None = None) -> dict:
    """`audio`: a voice conversation (each user turn the clip it returns; no long-context probe)."""
    report = {"settings": asdict(settings), "voice": audio is not None, "levels": []}
    for c in levels:
        print(f"conversation: {c} sessions x {settings.turns} turns", flush=True)
        report["levels"].append(asdict(await run_level(stream_fn, cfg, settings, c, audio, scrape)))
    if settings.context_tokens and audio is None:
        print(f"conversation: a {settings.context_tokens}-token prompt, cold then repeated", flush=True)
        report["long_context"] = await long_context(stream_fn, cfg, settings, scrape)
    return report


def _fmt(v: float | None, digits: int = 1) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def section(report: dict) -> str:
    s = report["settings"]
    user = "a voice clip (rotated per turn)" if report.get("voice") else f"{s['turn_tokens']}-token"
    lines = [f"#### conversation: {user} user turns, {s['text_tokens']} text tokens and "
             f"{s['frames']} frames a reply, up to {s['turns']} turns, history re-sent as token ids (split mode)", ""]
    for lvl in report["levels"]:
        lines += [f"{lvl['sessions']} sessions ({lvl['failed']} turns failed, {lvl['wall_s']:.0f} s), "
                  f"{lvl['cached_fraction']:.1%} of prompt tokens cached:", ""]
        if len(lvl["replicas"]) > 1:
            lines += ["| thinker replica | turns | cached |", "|---|---|---|"]
            lines += [f"| {a} | {d['turns']} | {d['cached_fraction']:.1%} |" for a, d in sorted(lvl["replicas"].items())]
            lines += ["", f"load spread (max - min) / mean of turns: {lvl['load_spread']:.1%}", ""]
        lines += ["| turn | prompt tokens | TTFP p50 ms | TTFP p90 ms | first text p50 ms | cached |",
                  "|---|---|---|---|---|---|"]
        shown = [t for t in lvl["turns"] if t["turn"] in (1, 2, 5, 10, 15, 20, 30, 40) or t is lvl["turns"][-1]]
        for t in shown:
            lines.append(f"| {t['turn']} | {t['prompt_tokens']} | {_fmt(t['ttfp_p50_ms'])} | {_fmt(t['ttfp_p90_ms'])} "
                         f"| {_fmt(t.get('ttft_p50_ms'))} | {t['cached_fraction']:.0%} |")
        lines.append("")
        if lvl.get("server"):
            lines += ["| stage | queue wait ms | first output ms | step ms | steps | prefill batch | prefix hit tokens "
                      "| preemptions |", "|---|---|---|---|---|---|---|---|"]
            for stage, st in lvl["server"].items():
                lines.append(f"| {stage} | {_fmt(st.get('queue_wait_ms'))} | {_fmt(st.get('first_output_ms'))} | "
                             f"{_fmt(st.get('step_ms'), 2)} | {_fmt(st.get('steps'), 0)} | {_fmt(st.get('prefill_batch'), 2)} "
                             f"| {st.get('prefix_hit_tokens', 0):.0f} | {st.get('preemptions', 0):.0f} |")
            lines.append("")
    lc = report.get("long_context")
    if lc:
        lines.append(f"Long context, {lc['prompt_tokens']} tokens: cold TTFP {_fmt(lc['cold']['ttfp_ms'])} ms, "
                     f"repeated {_fmt(lc['repeated']['ttfp_ms'])} ms ({lc['repeated']['cached_tokens']} tokens cached)"
                     + (f"; errors: {lc['cold']['error'] or ''} {lc['repeated']['error'] or ''}"
                        if lc['cold']['error'] or lc['repeated']['error'] else ""))
        for name in ("cold", "repeated"):
            for stage, st in (lc[name].get("server") or {}).items():
                lines.append(f"- {name}, {stage}: first output {_fmt(st.get('first_output_ms'))} ms, queue wait "
                             f"{_fmt(st.get('queue_wait_ms'))} ms, {st.get('prefix_hit_tokens', 0):.0f} prefix tokens hit, "
                             f"{st.get('preemptions', 0):.0f} preemptions"
                             + "".join(f", {v:.0f} chunks {k.removeprefix('chunks_')}" for k, v in sorted(st.items())
                                       if k.startswith("chunks_")))
    return "\n".join(lines)
