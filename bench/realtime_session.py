"""Realtime voice sessions of many turns on a running gateway, timed from the end of speech:

    python -m voxpipe.bench.realtime_session --gateway http://127.0.0.1:8000 [--sessions 1] [--turns 40]
        [--pace 1] [--audio CLIP.wav] [--text-tokens 8] [--frames 16]

Each session (a WebSocket, GA events, no turn detection, greedy) speaks the clip every turn, appended
as it is spoken (`--pace` times real time; the gateway streams it to the thinker as it comes), commits
it and asks for a spoken reply right behind: a turn's TTFP is the commit to the reply's first
`response.output_audio.delta`. The conversation grows turn by turn (each reply's forced text and
audio). Prints one JSON line per turn (session, turn, ttfp_ms, input and cached tokens), then a summary:
TTFP p50 / p90 / max over all turns, the worst turn's p90 across sessions, and the gateway's mean
share of each streamed prompt prefilled before its commit (its /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request

import numpy as np

from .realtime_client import REALTIME_RATE, RealtimeError, _expect, _receive, _send, speak
from .voice_clip import load_clip
from .workload import SYSTEM_TEXT


async def session(url: str, index: int, pcm16: bytes, args) -> list[dict]:
    from websockets.asyncio.client import connect

    out = []
    async with connect(url, max_size=None, open_timeout=60) as ws:
        await _expect(ws, "session.created")
        await _send(ws, "session.update", session={
            "type": "realtime", "instructions": SYSTEM_TEXT, "output_modalities": ["audio"],
            "audio": {"input": {"turn_detection": None}}, "temperature": 0, "ignore_eos": True,
            "max_output_tokens": args.text_tokens, "max_audio_frames": args.frames})
        await _expect(ws, "session.updated")
        for turn in range(args.turns):
            await speak(ws, pcm16, args.pace)
            await _send(ws, "input_audio_buffer.commit")
            committed = time.perf_counter()
            await _send(ws, "response.create", response={})
            ttfp = None
            while True:
                event = await _receive(ws)
                if event["type"] == "response.output_audio.delta" and ttfp is None:
                    ttfp = time.perf_counter() - committed
                elif event["type"] == "response.done":
                    response = event["response"]
                    if response["status"] not in ("completed", "incomplete"):
                        raise RealtimeError(f"turn {turn}: response {response['status']}: "
                                            f"{response.get('status_details')}")
                    usage = response.get("usage") or {}
                    break
            row = {"session": index, "turn": turn, "ttfp_ms": round(ttfp * 1000, 1) if ttfp is not None else None,
                   "input_tokens": usage.get("input_tokens", 0),
                   "cached_tokens": (usage.get("input_token_details") or {}).get("cached_tokens", 0)}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def streamed_share(base_url: str) -> tuple[float, float]:
    """The gateway's voxpipe_gateway_realtime_prefilled_before_commit (sum, count)."""
    body = urllib.request.urlopen(f"{base_url}/metrics", timeout=10).read().decode()
    found = {}
    for line in body.splitlines():
        for part in ("sum", "count"):
            if line.startswith(f"voxpipe_gateway_realtime_prefilled_before_commit_{part} "):
                found[part] = float(line.split()[1])
    return found.get("sum", 0.0), found.get("count", 0.0)


async def main(args) -> dict:
    base = args.gateway.rstrip("/")
    model = args.model or json.loads(urllib.request.urlopen(f"{base}/v1/models", timeout=10).read())["data"][0]["id"]
    clip = load_clip(args.audio).at_rate(REALTIME_RATE)
    pcm16 = (np.clip(clip, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
    url = base.replace("http://", "ws://", 1) + f"/v1/realtime?model={model}"
    before = streamed_share(base)
    rows = [r for s in await asyncio.gather(*(session(url, i, pcm16, args) for i in range(args.sessions))) for r in s]
    after = streamed_share(base)
    ttfp = np.array([r["ttfp_ms"] for r in rows if r["ttfp_ms"] is not None])
    per_turn = [np.percentile([r["ttfp_ms"] for r in rows if r["turn"] == t and r["ttfp_ms"] is not None], 90)
                for t in range(args.turns)]
    count = after[1] - before[1]
    return {"sessions": args.sessions, "turns": args.turns, "pace": args.pace, "clip_s": round(len(clip) / REALTIME_RATE, 2),
            "ttfp_ms": {"p50": round(float(np.percentile(ttfp, 50)), 1), "p90": round(float(np.percentile(ttfp, 90)), 1),
                        "max": round(float(ttfp.max()), 1)},
            "worst_turn_p90_ms": round(float(max(per_turn)), 1), "without_audio": int(len(rows) - ttfp.size),
            "streamed_turns": int(count),
            "prefilled_before_commit": round((after[0] - before[0]) / count, 3) if count else None}


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
    args = p.parse_args(argv)
    for name in ("sessions", "turns", "text_tokens", "frames"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}: must be at least 1")
    if not args.pace >= 0:
        p.error("--pace: must be >= 0")
    return args


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(parse_args()))))
