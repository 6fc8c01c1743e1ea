"""Streams of every gateway API at once, each client recording what it saw, for a stage to be killed
(SIGKILL) or drained (SIGTERM) under them: tests/test_chaos.py and the reliability suite's chaos phase.

A client is one streamed spoken reply (text and pcm16 audio, `ignore_eos`, so that it runs until its
lengths): chat completions over SSE (raw, and through the unmodified `openai` SDK), /v1/audio/speech
(`stream_format: "sse"`, and a raw pcm body), a realtime WebSocket response, a gRPC Converse turn.
Each ends in one of three ways (`Seen.outcome`):

    complete   the API's own end of a whole reply: chat `finish_reason` then `[DONE]`; speech
               `speech.audio.done` (raw pcm: the body's terminating chunk); realtime `response.done`
               with status completed / incomplete; Converse `done` and status OK
    error      an error the client can act on, with nothing after it: chat / speech an `error` event
               (raw pcm: the body cut short, which httpx raises); realtime `response.done` failed or an
               `error` event; Converse a non-OK status (after a ConverseError message when output had
               started). `error` holds its message and `error_at` when it arrived
    cut        anything else -- a stream that ended without saying how, or said complete after an
               error -- which no client can tell from a whole reply
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc

# 4 streams of each API: chat (3 raw SSE, 1 through the openai SDK), speech (3 SSE, 1 raw pcm),
# realtime, Converse
MIX = {"chat": 3, "chat_sdk": 1, "speech": 3, "speech_pcm": 1, "realtime": 4, "converse": 4}
API_OF = {"chat": "chat", "chat_sdk": "chat", "speech": "speech", "speech_pcm": "speech", "realtime": "realtime",
          "converse": "converse"}
NAMES_NO_STAGE = {"speech_pcm"}       # a raw audio body has no way to say why it was cut


@dataclass
class Seen:
    """What one client saw of its stream."""
    kind: str                               # a key of MIX
    status: str = ""                        # HTTP status / gRPC code (the end status for Converse)
    events: list[str] = field(default_factory=list)     # the stream's marker events, in order (see `_mark`)
    error: str = ""                         # the error's message (an exception's repr for raw pcm)
    error_at: float | None = None           # time.monotonic() when the error arrived
    running_at: float | None = None         # first audio
    ended_at: float | None = None

    @property
    def outcome(self) -> str:
        complete = {"chat": ["finish", "[DONE]"], "chat_sdk": ["finish"], "speech": ["done"], "speech_pcm": ["eof"],
                    "realtime": ["done"], "converse": ["done", "OK"]}[self.kind]
        if self.error:
            return "error" if self.events[-1:] == ["error"] and self.events.count("error") == 1 else "cut"
        return "complete" if self.events[-len(complete):] == complete and "error" not in self.events else "cut"

    def names(self, stage: str) -> bool:
        """Whether the error says `stage` failed: "the <stage> stage ..." (HTTP, realtime), "<stage>: ..." (Converse)."""
        if self.kind == "converse":
            return self.error.startswith(f"{stage}: ")
        return re.match(rf"the {stage} (stage|rejected)\b", self.error) is not None

    def _mark(self, event: str, error: str = "") -> None:
        self.events.append(event)
        if error:
            self.error, self.error_at = error[:500], time.monotonic()

    def _running(self, flag: asyncio.Event) -> None:
        if self.running_at is None:
            self.running_at = time.monotonic()
        flag.set()


@dataclass(frozen=True)
class Gateway:
    base_url: str                           # http://host:port
    converse: str                           # host:port of --grpc-port
    model: str
    api_key: str = "unused"
    tokens: int = 10                        # max_tokens (= min: ignore_eos)
    frames: int = 16                        # max_audio_frames / max_frames (= min)
    voice: str = "ethan"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}


async def _chat(g: Gateway, http, seen: Seen, running: asyncio.Event, i: int) -> None:
    body = {"model": g.model, "messages": [{"role": "user", "content": f"Tell me a story, {i}."}], "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": g.voice, "format": "pcm16"},
            "max_tokens": g.tokens, "max_audio_frames": g.frames, "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        seen.status = str(r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                seen._mark("[DONE]")
                continue
            obj = json.loads(data)
            if "error" in obj:
                seen._mark("error", obj["error"].get("message") or "")
            elif obj.get("choices"):
                choice = obj["choices"][0]
                if choice.get("finish_reason"):
                    seen._mark("finish")
                if (choice.get("delta", {}).get("audio") or {}).get("data"):
                    seen._running(running)


async def _chat_sdk(g: Gateway, seen: Seen, running: asyncio.Event, i: int) -> None:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{g.base_url}/v1", api_key=g.api_key, max_retries=0, timeout=120)
    try:
        stream = await client.chat.completions.create(
            model=g.model, messages=[{"role": "user", "content": f"Tell me a story, {i}."}], stream=True,
            modalities=["text", "audio"], audio={"voice": g.voice, "format": "pcm16"}, max_tokens=g.tokens,
            extra_body={"max_audio_frames": g.frames, "ignore_eos": True})
        seen.status = str(stream.response.status_code)
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].finish_reason:
                    seen._mark("finish")
                audio = getattr(chunk.choices[0].delta, "audio", None) if chunk.choices else None
                if audio is not None and audio.data:
                    seen._running(running)
        except openai.APIError as e:            # the SDK raises on an `error` event
            seen._mark("error", e.message)
    finally:
        await client.close()


async def _speech(g: Gateway, http, seen: Seen, running: asyncio.Event, i: int, sse: bool) -> None:
    import httpx

    body = {"model": g.model, "input": f"One, two, three, four, five, six, {i}.", "voice": g.voice,
            "response_format": "pcm", "max_audio_frames": g.frames, "ignore_eos": True}
    if sse:
        body["stream_format"] = "sse"
    async with http.stream("POST", "/v1/audio/speech", json=body) as r:
        seen.status = str(r.status_code)
        if not sse:
            try:
                async for piece in r.aiter_bytes():
                    if piece:
                        seen._running(running)
            except httpx.RemoteProtocolError as e:     # the body ended without its terminating chunk
                seen._mark("error", repr(e))
                return
            seen._mark("eof")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            obj = json.loads(line.removeprefix("data: "))
            if obj.get("type") == "speech.audio.delta":
                seen._running(running)
            elif obj.get("type") == "speech.audio.done":
                seen._mark("done")
            elif obj.get("type") == "error":
                seen._mark("error", obj["error"].get("message") or "")


async def _realtime(g: Gateway, seen: Seen, running: asyncio.Event, i: int) -> None:
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    url = g.base_url.replace("http://", "ws://", 1) + f"/v1/realtime?model={g.model}"
    async with connect(url, additional_headers=g.headers, max_size=None, open_timeout=60) as ws:
        async def send(kind: str, **body) -> None:
            await ws.send(json.dumps({"type": kind, **body}))

        await send("session.update", session={
            "type": "realtime", "output_modalities": ["audio"], "turn_detection": None, "voice": g.voice,
            "max_output_tokens": g.tokens, "ignore_eos": True, "max_audio_frames": g.frames})
        await send("conversation.item.create", item={"type": "message", "role": "user",
                                                     "content": [{"type": "input_text", "text": f"A story, {i}."}]})
        await send("response.create")
        seen.status = "open"
        try:
            async for raw in ws:
                ev = json.loads(raw)
                kind = ev.get("type")
                if kind == "response.output_audio.delta":
                    seen._running(running)
                elif kind == "error":
                    seen._mark("error", ev["error"].get("message") or "")
                    return
                elif kind == "response.done":
                    resp = ev["response"]
                    if resp["status"] in ("completed", "incomplete"):
                        seen._mark("done")
                    else:
                        err = ((resp.get("status_details") or {}).get("error") or {})
                        seen._mark("error", err.get("message") or f"response {resp['status']}")
                    return
        except ConnectionClosed as e:
            seen.status = f"closed {e.rcvd.code if e.rcvd else ''}".strip()


async def _converse(g: Gateway, seen: Seen, running: asyncio.Event, i: int) -> None:
    start = gw.ConverseStart(text=f"Tell me a story, {i}.", voice=g.voice, max_tokens=g.tokens, max_frames=g.frames,
                             ignore_eos=True)
    async with grpc.aio.insecure_channel(g.converse) as ch:
        call = gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=start)]),
                                                metadata=(("authorization", f"Bearer {g.api_key}"),))
        try:
            async for resp in call:
                kind = resp.WhichOneof("kind")
                if kind == "audio":
                    seen._running(running)
                elif kind == "done":
                    seen._mark("done")
                elif kind == "error":
                    seen.events.append("error-message")
            seen.status = "OK"
            seen._mark("OK")
        except grpc.aio.AioRpcError as e:
            seen.status = e.code().name
            seen._mark("error", e.details() or e.code().name)


async def _client(g: Gateway, http, kind: str, i: int, seen: Seen, running: asyncio.Event) -> Seen:
    import httpx

    try:
        if kind == "chat":
            await _chat(g, http, seen, running, i)
        elif kind == "chat_sdk":
            await _chat_sdk(g, seen, running, i)
        elif kind in ("speech", "speech_pcm"):
            await _speech(g, http, seen, running, i, sse=kind == "speech")
        elif kind == "realtime":
            await _realtime(g, seen, running, i)
        else:
            await _converse(g, seen, running, i)
    except (httpx.HTTPError, OSError) as e:     # the connection itself failed: counted as cut
        seen.events.append(f"exception {type(e).__name__}")
    finally:
        seen.ended_at = time.monotonic()
        running.set()
    return seen


async def streams(g: Gateway, mix: dict[str, int] = MIX, while_running: Callable[[], Awaitable[None]] | None = None,
                  start_timeout: float = 120, end_timeout: float = 180) -> list[Seen]:
    """`mix[kind]` clients of each kind at once. `while_running()` is awaited once every one has its
    first audio (or has ended); then every client is read to its end."""
    import httpx

    async with httpx.AsyncClient(base_url=g.base_url, headers=g.headers, timeout=120) as http:
        seen = [Seen(kind) for kind, n in mix.items() for _ in range(n)]
        flags = [asyncio.Event() for _ in seen]
        tasks = [asyncio.ensure_future(_client(g, http, s.kind, i, s, f)) for i, (s, f) in enumerate(zip(seen, flags))]
        try:
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), start_timeout)
            if while_running is not None:
                await while_running()
            await asyncio.wait_for(asyncio.gather(*tasks), end_timeout)
        finally:
            for t in tasks:
                t.cancel()
    return seen


def summary(seen: list[Seen], signalled_at: float | None = None, stage: str | None = None) -> dict:
    """Per kind: outcomes; and for the errors, whether they name `stage` and how long after
    `signalled_at` they arrived (the worst)."""
    out: dict = {}
    for s in seen:
        row = out.setdefault(s.kind, {"streams": 0, "complete": 0, "error": 0, "cut": 0, "names_stage": 0,
                                      "worst_report_s": None, "errors": []})
        row["streams"] += 1
        row[s.outcome] += 1
        if s.outcome == "error":
            if stage is not None and s.names(stage):
                row["names_stage"] += 1
            if signalled_at is not None and s.error_at is not None:
                late = round(s.error_at - signalled_at, 3)
                row["worst_report_s"] = late if row["worst_report_s"] is None else max(row["worst_report_s"], late)
            if s.error[:120] not in row["errors"]:
                row["errors"].append(s.error[:120])
        elif s.outcome == "cut":
            row["errors"].append(f"cut: status {s.status}, events {s.events[-4:]}")
    return out
