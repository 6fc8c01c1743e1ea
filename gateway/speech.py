"""POST /v1/audio/speech, shaped as OpenAI's: the `input` text is the user's turn (and
`instructions`, when given, the system turn); the body is the spoken reply.

stream_format "audio" (default): the file in `response_format`; raw `pcm` streams each chunk
as it is made. stream_format "sse": `speech.audio.delta` events ({audio: base64}) then
`speech.audio.done` with usage; pcm deltas stream, other formats come as one delta.

A failure before the first audio is an HTTP error status. After it (the status is sent): a raw pcm
body ends without its terminating chunk (the exception reaches the server, which drops the
connection: clients see an incomplete body), an SSE stream with an `error` event instead of
`speech.audio.done`."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from voxpipe.client import AudioEvent, DoneEvent, PipelineError, SpeechRequest
from voxpipe.services.thinker.prompt import ChatMessage

from . import audio_formats
from .app import GatewayState, gateway_state
from .errors import bad_request, from_pipeline_error
from .generation import render_prompt, run_pipeline, speech_request
from .params import check_model, generation_params, optional, read_json, required, resolve_voice
from .streaming import CancellableStream, sse, until_disconnect

router = APIRouter()
SPEECH_FORMATS = ("mp3", "opus", "flac", "wav", "pcm")
MAX_INPUT_CHARS = 4096


@dataclass(frozen=True)
class SpeechOptions:
    text: str
    instructions: str | None
    voice: str
    response_format: str
    stream_format: str


def speech_options(body: dict, st: GatewayState) -> SpeechOptions:
    check_model(body, st.config.model_id)
    text = required(body, "input", str)
    if not text.strip() or len(text) > MAX_INPUT_CHARS:
        raise bad_request(f"'input' must be 1 to {MAX_INPUT_CHARS} characters", param="input", code="invalid_value")
    voice = resolve_voice(body.get("voice"), st.speakers, "voice")
    fmt = optional(body, "response_format", str, "mp3")
    if fmt not in SPEECH_FORMATS:
        raise bad_request(f"'response_format' must be one of {', '.join(SPEECH_FORMATS)}, got {fmt!r}",
                          param="response_format", code="invalid_value")
    stream_format = optional(body, "stream_format", str, "audio")
    if stream_format not in ("audio", "sse"):
        raise bad_request(f"'stream_format' must be 'audio' or 'sse', got {stream_format!r}", param="stream_format",
                          code="invalid_value")
    speed = optional(body, "speed", (int, float), 1.0)
    if speed != 1.0:
        raise bad_request("only 'speed' 1.0 is supported", param="speed", code="unsupported_value")
    return SpeechOptions(text=text, instructions=optional(body, "instructions", str), voice=voice,
                         response_format=fmt, stream_format=stream_format)


@router.post("/v1/audio/speech")
async def create_speech(request: Request) -> Response:
    arrived = time.perf_counter()
    st = gateway_state(request)
    body = await read_json(request, st.config.max_body_bytes)
    opts = speech_options(body, st)
    params = generation_params(body)
    session, handed_over = st.sessions.acquire("http"), False
    try:
        messages = ([ChatMessage.text("system", opts.instructions)] if opts.instructions else []) + \
            [ChatMessage.text("user", opts.text)]
        prompt = await render_prompt(st, messages)
        spoken = SpokenReply(st, speech_request(prompt, params, opts.voice, audio=True), arrived, opts.response_format)
        media_type = audio_formats.content_type(opts.response_format)
        if opts.stream_format == "sse":
            handed_over = True
            return CancellableStream(spoken.sse_events(), on_close=session.release, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if opts.response_format == "pcm":
            chunks = spoken.pcm_chunks()
            try:  # wait for the first audio, so that an early failure is still an HTTP error status
                first = await until_disconnect(request.receive, anext(chunks, b""))
            except ClientDisconnect:
                return Response(status_code=499)
            handed_over = True
            return CancellableStream(_prepend(first, chunks), on_close=session.release, media_type=media_type)
        try:
            return Response(await until_disconnect(request.receive, spoken.file()), media_type=media_type)
        except ClientDisconnect:
            return Response(status_code=499)
    finally:
        if not handed_over:
            session.release()


async def _prepend(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    async with aclosing(rest):
        if first:
            yield first
        async for chunk in rest:
            yield chunk


class SpokenReply:
    def __init__(self, st: GatewayState, req: SpeechRequest, arrived: float, fmt: str) -> None:
        self.st, self.req, self.arrived, self.fmt = st, req, arrived, fmt
        self.done: DoneEvent | None = None

    async def pcm_chunks(self) -> AsyncIterator[bytes]:
        async with aclosing(run_pipeline(self.st, self.req, self.arrived)) as events:
            async for ev in events:
                if isinstance(ev, AudioEvent) and ev.data:
                    yield ev.data
                elif isinstance(ev, DoneEvent):
                    self.done = ev

    async def file(self) -> bytes:
        pcm = bytearray()
        async with aclosing(self.pcm_chunks()) as chunks:
            async for chunk in chunks:
                pcm += chunk
        return await asyncio.to_thread(audio_formats.encode, bytes(pcm), self.st.omni.code2wav.sample_rate, self.fmt)

    def usage(self) -> dict:
        d = self.done
        output = d.completion_tokens + d.frames
        return {"input_tokens": d.prompt_tokens, "output_tokens": output, "total_tokens": d.prompt_tokens + output}

    async def sse_events(self) -> AsyncIterator[str]:
        try:
            if self.fmt == "pcm":
                async with aclosing(self.pcm_chunks()) as chunks:
                    async for chunk in chunks:
                        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
            else:
                data = await self.file()
                yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        except PipelineError as e:
            yield sse({"type": "error", **from_pipeline_error(e).body()})
            return
        yield sse({"type": "speech.audio.done", "usage": self.usage()})
