"""bench/BENCHMARK.md's workloads (seedtts-like, long-prompt, voice-in, realtime) and the client-side metrics
of one run."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import asdict, dataclass, field, replace

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from voxpipe.services.runtime.config import OmniConfig

SAMPLE_RATE = 24000


@dataclass(frozen=True)
class Workload:
    """One bench/BENCHMARK.md workload: what each request asks for and the concurrency levels it is
    reported at (all lengths forced: ignore EOS, min = max)."""

    name: str = "seedtts-like"
    prompt_tokens: int = 100          # text prompts (a voice prompt's length is the clip's and voice_text's)
    text_tokens: int = 48
    frames: int = 125
    speaker: str = "ethan"
    seed: int = 0
    levels: tuple[int, ...] = (1, 16, 32, 64)
    voice: bool = False               # the user turn is the speech clip followed by `voice_text`
    voice_text: str = ""
    realtime: bool = False            # driven through the gateway's realtime WebSocket (gateway mode only)
    realtime_pace: float = 1.0        # a spoken realtime turn is appended at this many times real time (0: at once)
    temperature: float = 0.0          # > 0: thinker and talker sample (each request seeded by its index)
    live: bool = False                # sessions paced at 1x playback, the capacity searched (bench/live.py)
    conversation: bool = False        # sessions that re-send their history turn by turn (bench/conversation.py)
    sessions: bool = False            # realtime voice sessions of --turns turns each (bench/realtime_session.py)

    def prompt(self, cfg: OmniConfig, index: int) -> list[int]:
        """ChatML system + user turn; user tokens random ids from the normal text range; ends with the
        assistant generation prompt. Exactly `prompt_tokens` ids."""
        t = cfg.thinker.tokens
        nl = 198 if cfg.thinker.text.vocab_size > 151000 else 10  # "\n" in the Qwen vocab / byte vocab
        head = [t.im_start, t.system, nl] + [9707, 525, 264, 10950, 17847, 13][: 6 if nl == 198 else 0] + [t.im_end, nl]
        head += [t.im_start, t.user, nl]
        tail = [t.im_end, nl, t.im_start, t.assistant, nl]
        rng = random.Random(self.seed * 100003 + index)
        high = min(t.im_start, cfg.thinker.text.vocab_size) - 1
        body = [rng.randrange(1000 if high > 2000 else 0, high) for _ in range(self.prompt_tokens - len(head) - len(tail))]
        return head + body + tail

    def modes(self, asked: list[str]) -> list[str]:
        """The asked client modes this workload runs in: a realtime or live workload only through the
        gateway, a conversation only through the pipeline client (its history as token ids)."""
        if self.conversation:
            return [m for m in asked if m == "split"]
        return [m for m in asked if m == "gateway"] if self.realtime or self.live else list(asked)

    def with_overrides(self, prompt_tokens: int = 0, text_tokens: int = 0, frames: int = 0,
                       realtime_audio: bool = False, temperature: float = 0.0,
                       realtime_pace: float | None = None) -> "Workload":
        """Non-zero lengths (and temperature) replace the workload's; `realtime_audio` makes a realtime
        workload's user turn the voice clip (input_audio_buffer.append + commit, no text) instead of a
        text prompt."""
        wl = replace(self, prompt_tokens=prompt_tokens or self.prompt_tokens, text_tokens=text_tokens or self.text_tokens,
                     frames=frames or self.frames, temperature=temperature or self.temperature,
                     realtime_pace=self.realtime_pace if realtime_pace is None else realtime_pace)
        return replace(wl, voice=True, voice_text="") if realtime_audio and self.realtime else wl

    def describe(self) -> str:
        if self.voice and self.realtime:
            user = "the voice clip appended to the input audio buffer and committed"
        elif self.voice:
            user = f"the voice clip + \"{self.voice_text}\"" if self.voice_text else "the voice clip"
        else:
            user = f"a {self.prompt_tokens}-token text prompt"
        via = " over the realtime WebSocket (TTFP from response.create)" if self.realtime else ""
        if self.realtime and self.voice:
            pace = f"at {self.realtime_pace:g}x real time" if self.realtime_pace else "all at once"
            via = f" over the realtime WebSocket, appended {pace} (TTFP from the commit: the end of speech)"
        via = " per turn of each live session (realtime WebSocket and chat SSE)" if self.live else via
        if self.sessions:
            pace = f"at {self.realtime_pace:g}x real time" if self.realtime_pace else "all at once"
            user = "a voice clip a turn (rotated per session and turn)"
            via = (f" appended {pace} in realtime sessions of --turns turns (TTFP from the commit: the end of speech; "
                   f"--concurrency: sessions)")
        how = (f"sampled at temperature {self.temperature:g} (seed: the request's index)" if self.temperature
               else "greedy")
        return f"{self.name}: {user}{via}, {self.text_tokens} text tokens, {self.frames} frames forced, {how}"


SYSTEM_TEXT = "You are a helpful assistant."
VOICE_TEXT = "Please answer briefly."           # voice-in's short text after the clip

# bench/BENCHMARK.md's workloads; "long-prompt" keeps seedtts-like's audio per text token (125 / 48)
WORKLOADS = {
    "seedtts-like": Workload(),
    "long-prompt": Workload(name="long-prompt", prompt_tokens=2500, text_tokens=900, frames=round(900 * 125 / 48),
                            levels=(1, 16)),
    "voice-in": Workload(name="voice-in", voice=True, voice_text=VOICE_TEXT, levels=(1, 16)),
    "realtime": Workload(name="realtime", realtime=True, levels=(1, 8)),
    # levels: where the capacity search starts (then doubles, then bisects); 125 frames: 10 s replies
    "live": Workload(name="live", live=True, levels=(16,)),
    # ~250 tokens a turn: a 200-token user turn and a 48-token reply; 25 frames (2 s) a reply; its
    # transformers reference: one prompt the size of turn 15's (3,800 tokens), uncached
    "conversation": Workload(name="conversation", conversation=True, prompt_tokens=3800, frames=25, levels=(1, 16)),
    # a clip a turn (bench/conversation.py); its reference: the voice-in prompt (one clip), uncached
    "voice-conversation": Workload(name="voice-conversation", conversation=True, voice=True, frames=25, levels=(1, 16)),
    # realtime voice sessions through the gateway, a clip spoken every turn, manual commits (bench/realtime_session.py);
    # levels: concurrent sessions (issue 23's goals: c = 1 and 16 sessions of 40 turns)
    "realtime-conversation": Workload(name="realtime-conversation", realtime=True, voice=True, sessions=True,
                                      text_tokens=8, frames=16, levels=(1, 16)),
}


@dataclass(frozen=True)
class RequestSent:
    """Yielded by a client whose request starts after some set-up (the realtime client: after the
    connection, session.update and the user item): the request's clock starts here."""


@dataclass
class RequestRecord:
    start: float
    first_text: float | None = None
    last_text: float | None = None
    first_audio: float | None = None
    last_audio: float | None = None
    samples: int = 0
    tokens: int = 0
    frames: int = 0
    prompt_tokens: int = 0
    error: str | None = None
    refused: bool = False                 # the error is the gateway's 429 / session limit (bench.workload.is_refusal)
    packets: list = field(default_factory=list)   # (arrival perf_counter s, samples) per audio event, in order

    @property
    def ttfp(self) -> float:
        return self.first_audio - self.start

    @property
    def e2el(self) -> float:
        return (self.last_audio or self.start) - self.start

    @property
    def rtf(self) -> float:
        return (self.last_audio - self.start) / (self.samples / SAMPLE_RATE)


async def run_one(stream_fn, req) -> RequestRecord:
    """One request through `stream_fn` (the pipeline client, the in-process engines, the gateway's
    SSE or realtime client), timed from here or from the client's RequestSent."""
    from voxpipe.client import AudioEvent, DoneEvent, TextEvent

    rec = RequestRecord(start=time.perf_counter())
    try:
        async for ev in stream_fn(req):
            now = time.perf_counter()
            if isinstance(ev, RequestSent):
                rec.start = now
            elif isinstance(ev, TextEvent):
                rec.first_text = rec.first_text or now
                rec.last_text = now
                rec.tokens += len(ev.token_ids)
            elif isinstance(ev, AudioEvent):
                rec.first_audio = rec.first_audio or now
                rec.last_audio = now
                rec.samples += len(ev.samples)
                rec.packets.append((now, len(ev.samples)))
            elif isinstance(ev, DoneEvent):
                rec.frames = ev.frames
                rec.prompt_tokens = ev.prompt_tokens
                rec.tokens = rec.tokens or ev.completion_tokens   # clients that see text, not token ids
    except Exception as e:  # noqa: BLE001 - recorded, counted as a failed request
        rec.error = repr(e)
        rec.refused = is_refusal(e)
    return rec


REFUSAL_CODES = ("rate_limit_exceeded", "session_limit_reached")   # the gateway's 429 (HTTP) / realtime error codes


def is_refusal(e: BaseException) -> bool:
    """The gateway turned the request away for want of a session slot (--max-sessions): HTTP 429 from
    the openai SDK (APIStatusError.status_code), or the realtime error event's code."""
    return getattr(e, "status_code", None) == 429 or getattr(e, "code", None) in REFUSAL_CODES


async def run_level(stream_fn, make_request, concurrency: int, requests: int, warmup: int,
                    warmed=None) -> tuple[list[RequestRecord], float]:
    """`warmup` requests first (not measured), then `requests` with at most `concurrency` in flight.
    `make_request(index)` builds what `stream_fn` takes; every request is built before the clock starts
    (a long chat prompt takes a while to fit to its token count). `warmed`: awaited once the warm-up
    requests have all ended, before the measured ones start (the servers' metrics are read there)."""
    warm = [make_request(10_000 + i) for i in range(warmup)]
    measured = [make_request(i) for i in range(requests)]
    await asyncio.gather(*(run_one(stream_fn, req) for req in warm))
    if warmed is not None:
        await warmed()
    sem = asyncio.Semaphore(concurrency)

    async def one(req) -> RequestRecord:
        async with sem:
            return await run_one(stream_fn, req)

    t0 = time.perf_counter()
    records = await asyncio.gather(*(one(req) for req in measured))
    return list(records), time.perf_counter() - t0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    req_per_s: float
    ttfp_ms: dict = field(default_factory=dict)      # p50 p90 p99 mean
    rtf: dict = field(default_factory=dict)
    e2el_s: dict = field(default_factory=dict)
    ttft_ms: dict = field(default_factory=dict)
    thinker_tok_s: float = 0.0                       # per request (decode phase)
    talker_frames_s: float = 0.0                     # per request
    audio_s: float = 0.0                             # mean audio per request
    server: dict = field(default_factory=dict)       # per stage: server-side means (bench.server_stats)
    ttfp_each_ms: list = field(default_factory=list)  # every successful request's TTFP, in completion order
    workload: str = ""
    prompt_tokens: float = 0.0                       # mean prompt length (as the server counted it)
    errors: list = field(default_factory=list)       # the first few failures' messages
    path: list = field(default_factory=list)         # --trace: per span, median start / end ms (bench.trace_path)

    @classmethod
    def of(cls, mode: str, concurrency: int, records: list[RequestRecord], wall: float,
           workload: str = "") -> "LevelResult":
        ok = [r for r in records if r.error is None and r.first_audio is not None and r.samples]
        def summary(vals, scale=1.0):
            return {"p50": pct(vals, 0.5) * scale, "p90": pct(vals, 0.9) * scale, "p99": pct(vals, 0.99) * scale,
                    "mean": (statistics.fmean(vals) * scale) if vals else float("nan")}
        tok_rates = [(r.tokens - 1) / (r.last_text - r.first_text) for r in ok
                     if r.tokens > 1 and r.first_text and r.last_text > r.first_text]
        frame_rates = [r.frames / (r.last_audio - r.first_audio) for r in ok if r.frames and r.last_audio > r.first_audio]
        return cls(mode=mode, concurrency=concurrency, requests=len(records), failed=len(records) - len(ok), wall_s=wall,
                   req_per_s=len(ok) / wall if wall else 0.0,
                   ttfp_ms=summary([r.ttfp for r in ok], 1000.0), rtf=summary([r.rtf for r in ok]),
                   e2el_s=summary([r.e2el for r in ok]),
                   ttft_ms=summary([r.first_text - r.start for r in ok if r.first_text], 1000.0),
                   thinker_tok_s=statistics.fmean(tok_rates) if tok_rates else 0.0,
                   talker_frames_s=statistics.fmean(frame_rates) if frame_rates else 0.0,
                   audio_s=statistics.fmean([r.samples / SAMPLE_RATE for r in ok]) if ok else 0.0,
                   ttfp_each_ms=[round(r.ttfp * 1000.0, 2) for r in ok], workload=workload,
                   prompt_tokens=statistics.fmean([r.prompt_tokens for r in ok]) if ok else 0.0,
                   errors=[r.error for r in records if r.error][:3])

    def as_dict(self) -> dict:
        return asdict(self)
