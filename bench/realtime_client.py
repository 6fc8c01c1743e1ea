"""The benchmark's realtime client: one WebSocket session per request against the gateway's OpenAI
Realtime API (GA event names), turned into the events the other clients yield. A text turn's clock
starts at response.create (RequestSent), after the session is set up and the user item exists; a
spoken turn's is appended as it is spoken (`pace`: times real time), and its clock starts at its
input_audio_buffer.commit -- the end of speech, what a person waits from -- with response.create
right behind it (the gateway streams the audio to the thinker as it comes: gateway/realtime/heard.py)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np

from voxpipe.client import AudioEvent, DoneEvent, TextEvent

from .requests import REALTIME_RATE, RealtimeRequest
from .workload import RequestSent

APPEND_SECONDS = 1.0          # input audio sent in appends of this much audio (all at once: pace 0)
PACED_APPEND_SECONDS = 0.1    # paced: appends of this much audio, each when it has been spoken


class RealtimeError(RuntimeError):
    """The server answered with an error event (`code`: its error.code) or a response that did not complete."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class RealtimeStream:
    def __init__(self, base_url: str, model: str, pace: float = 0.0) -> None:
        """`base_url`: the gateway's http://HOST:PORT. `pace`: a spoken turn's audio is appended at
        this many times real time (0: all at once)."""
        self.url = base_url.replace("http://", "ws://", 1).rstrip("/") + f"/v1/realtime?model={model}"
        self.pace = pace

    async def __call__(self, req: RealtimeRequest) -> AsyncIterator:
        from websockets.asyncio.client import connect

        async with connect(self.url, max_size=None, open_timeout=60) as ws:
            await _expect(ws, "session.created")
            await _send(ws, "session.update", session={
                "type": "realtime", "instructions": req.instructions, "output_modalities": ["audio"],
                "audio": {"input": {"turn_detection": None}, "output": {"voice": req.voice}},
                "max_output_tokens": req.max_tokens, "temperature": req.temperature,
                "ignore_eos": True, "max_audio_frames": req.max_audio_frames})
            await _expect(ws, "session.updated")
            if req.text is not None:
                await _send(ws, "conversation.item.create", item={
                    "type": "message", "role": "user", "content": [{"type": "input_text", "text": req.text}]})
                await _expect(ws, "conversation.item.done")
                yield RequestSent()
            else:
                await self._speak(ws, req.audio_pcm16)
                await _send(ws, "input_audio_buffer.commit")
                yield RequestSent()            # the end of speech
            await _send(ws, "response.create", response={})
            samples = index = 0
            while True:
                event = await _receive(ws)
                kind = event["type"]
                if kind == "response.output_audio.delta":
                    pcm = base64.b64decode(event["delta"])
                    audio = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767.0
                    yield AudioEvent(samples, REALTIME_RATE, audio, pcm)
                    samples += audio.shape[0]
                elif kind == "response.output_audio_transcript.delta":
                    yield TextEvent(index, [], event["delta"])
                    index += 1
                elif kind == "response.done":
                    response = event["response"]
                    # forced lengths end at max_output_tokens: "incomplete" is the expected status
                    if response["status"] not in ("completed", "incomplete"):
                        error = (response.get("status_details") or {}).get("error") or {}
                        raise RealtimeError(f"response {response['status']}: {response.get('status_details')}",
                                            error.get("code"))    # e.g. rate_limit_exceeded: refused for capacity
                    usage = response.get("usage") or {}
                    details = usage.get("output_token_details") or {}
                    yield DoneEvent(0, 0, usage.get("input_tokens", 0), details.get("text_tokens", 0),
                                    details.get("audio_tokens", 0), samples)
                    return


    async def _speak(self, ws, pcm16: bytes) -> None:
        await speak(ws, pcm16, self.pace)


async def speak(ws, pcm16: bytes, pace: float) -> None:
    """Append a clip (24 kHz pcm16): each piece once it has been spoken at `pace` times real time
    (0: a second at a time, at once)."""
    seconds = PACED_APPEND_SECONDS if pace else APPEND_SECONDS
    step = int(seconds * REALTIME_RATE) * 2
    began = time.perf_counter()
    for at in range(0, len(pcm16), step):
        chunk = pcm16[at:at + step]
        if pace:
            spoken = (at + len(chunk)) / 2 / REALTIME_RATE / pace
            await asyncio.sleep(max(0.0, began + spoken - time.perf_counter()))
        await _send(ws, "input_audio_buffer.append", audio=base64.b64encode(chunk).decode("ascii"))


async def _send(ws, kind: str, **body: Any) -> None:
    await ws.send(json.dumps({"type": kind, **body}))


async def _receive(ws) -> dict[str, Any]:
    event = json.loads(await ws.recv())
    if event.get("type") == "error":
        err = event.get("error") or {}
        raise RealtimeError(f"{err.get('code')}: {err.get('message')}", err.get("code"))
    return event


async def _expect(ws, kind: str) -> dict[str, Any]:
    """Read events up to the first of type `kind` (others before it are acknowledgements)."""
    while True:
        event = await _receive(ws)
        if event["type"] == kind:
            return event
