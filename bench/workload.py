"""The "seedtts-like" workload of BENCHMARK.md and the client-side metrics of one run."""

from __future__ import annotations

import asyncio
import random
import string
import statistics
import time
from dataclasses import asdict, dataclass, field

from voxpipe.client import AudioEvent, DoneEvent, SpeechRequest, TextEvent
from voxpipe.services.runtime.config import OmniConfig

SAMPLE_RATE = 24000


@dataclass(frozen=True)
class Workload:
    name: str = "seedtts-like"
    prompt_tokens: int = 100
    text_tokens: int = 48
    frames: int = 125
    speaker: str = "ethan"
    seed: int = 0

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

    def request(self, cfg: OmniConfig, index: int) -> SpeechRequest:
        return SpeechRequest(token_ids=self.prompt(cfg, index), speaker=self.speaker, max_tokens=self.text_tokens,
                             min_tokens=self.text_tokens, max_frames=self.frames + 1, min_frames=self.frames + 1,
                             request_id=f"bench-{index}")

    def chat(self, cfg: OmniConfig, tokenizer, index: int) -> "ChatRequest":
        """The same request for the gateway's OpenAI chat API: a system turn and a user turn of random
        lowercase words whose rendered prompt (the gateway renders it the same way) has exactly
        `prompt_tokens` ids; output forced with `ignore_eos`, greedy."""
        from voxpipe.services.thinker.prompt import ChatMessage, render

        system = "You are a helpful assistant."

        def length(user: str) -> int:
            msgs = [ChatMessage.text("system", system), ChatMessage.text("user", user)]
            return len(render(tokenizer, cfg.thinker, msgs).token_ids)

        target = self.prompt_tokens
        if length("x") > target:
            raise ValueError(f"the chat template alone takes more than {target} tokens")
        rng = random.Random(self.seed * 100003 + index)
        user = ""
        while length(user) < target:
            user = (user + " " + "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))).strip()
        while len(user) > 1 and length(user) > target:
            user = user[:-1].rstrip() or "x"
        # then one character at a time, preferring one that lands exactly
        for _ in range(4 * target):
            if length(user) >= target:
                break
            user += next((ch for ch in string.ascii_lowercase if length(user + ch) == target), "a")
        if length(user) != target:
            raise RuntimeError(f"could not build a {target}-token chat prompt (got {length(user)})")
        return ChatRequest(index=index, messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
                           voice=self.speaker, max_tokens=self.text_tokens, max_audio_frames=self.frames + 1)


# BENCHMARK.md's workloads; "long-prompt" keeps seedtts-like's audio per text token (125 / 48)
WORKLOADS = {
    "seedtts-like": Workload(),
    "long-prompt": Workload(name="long-prompt", prompt_tokens=2500, text_tokens=900, frames=round(900 * 125 / 48)),
}


@dataclass(frozen=True)
class ChatRequest:
    """One workload request as an OpenAI chat completion (see `Workload.chat`)."""

    index: int
    messages: list
    voice: str
    max_tokens: int
    max_audio_frames: int


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
    error: str | None = None

    @property
    def ttfp(self) -> float:
        return self.first_audio - self.start

    @property
    def e2el(self) -> float:
        return (self.last_audio or self.start) - self.start

    @property
    def rtf(self) -> float:
        return (self.last_audio - self.start) / (self.samples / SAMPLE_RATE)


async def run_one(stream_fn, req: SpeechRequest) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter())
    try:
        async for ev in stream_fn(req):
            now = time.perf_counter()
            if isinstance(ev, TextEvent):
                rec.first_text = rec.first_text or now
                rec.last_text = now
                rec.tokens += len(ev.token_ids)
            elif isinstance(ev, AudioEvent):
                rec.first_audio = rec.first_audio or now
                rec.last_audio = now
                rec.samples += len(ev.samples)
            elif isinstance(ev, DoneEvent):
                rec.frames = ev.frames
                rec.tokens = rec.tokens or ev.completion_tokens   # clients that see text, not token ids
    except Exception as e:  # noqa: BLE001 - recorded, counted as a failed request
        rec.error = repr(e)
    return rec


async def run_level(stream_fn, make_request, concurrency: int, requests: int,
                    warmup: int) -> tuple[list[RequestRecord], float]:
    """`warmup` requests first (not measured), then `requests` with at most `concurrency` in flight.
    `make_request(index)` builds what `stream_fn` takes."""
    await asyncio.gather(*(run_one(stream_fn, make_request(10_000 + i)) for i in range(warmup)))
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> RequestRecord:
        async with sem:
            return await run_one(stream_fn, make_request(i))

    t0 = time.perf_counter()
    records = await asyncio.gather(*(one(i) for i in range(requests)))
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

    @classmethod
    def of(cls, mode: str, concurrency: int, records: list[RequestRecord], wall: float) -> "LevelResult":
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
                   ttfp_each_ms=[round(r.ttfp * 1000.0, 2) for r in ok])

    def as_dict(self) -> dict:
        return asdict(self)
