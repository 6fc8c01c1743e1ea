"""POST /v1/audio/speech, as OpenAI's: text to speech. The reply speaks `input` verbatim.

The prompt is the chat template with one user turn (`instructions`, when given, then `input`),
and the assistant's reply is `input` itself: the thinker generates nothing (ThinkerStart.
assistant_text), it streams `input`'s tokens and their talker rows as if it had generated them,
so the voice is exactly what transformers' generate makes when its thinker is forced to say
`input` (tests/test_tts.py). Sampling parameters (`temperature`, `top_p`, `top_k`, `seed`) and
`max_audio_frames` / `ignore_eos` are the talker's; text-length parameters (`max_tokens` ...) are
refused: the text is given.

stream_format "audio" (default): the body is the file in `response_format`, streamed: each piece
leaves as soon as the encoder has it (wav with unknown sizes 0xFFFFFFFF in its header, mp3, Ogg
Opus, flac, ADTS aac, raw pcm). stream_format "sse": `speech.audio.delta` events ({audio: base64
of the next piece of that file}) then `speech.audio.done` with usage.

The status waits for the first piece, so a failure before any audio is an HTTP error status. After
it (the status is sent): a raw body ends without its terminating chunk (the exception reaches the
server, which drops the connection: clients see an incomplete body), an SSE stream with an `error`
event instead of `speech.audio.done`."""

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
from voxpipe.services.runtime.echo import clipped, quoted
from voxpipe.services.thinker.prompt import speech_turn

from . import audio_formats
from .state import GatewayState, gateway_state
from .errors import bad_request, from_pipeline_error
from .generation import render_prompt, run_pipeline, speech_request
from .params import GenerationParams, check_model, generation_params, optional, read_json, required, resolve_voice
from .streaming import CancellableStream, prepended, read_ahead, sse

router = APIRouter()
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
MAX_INPUT_CHARS = 4096          # OpenAI's limit for `input`
MAX_INSTRUCTIONS_CHARS = 4096
TEXT_LENGTH_PARAMS = ("max_tokens", "max_completion_tokens", "min_tokens")
OPENAI_PARAMS = frozenset({"model", "input", "voice", "instructions", "response_format", "speed", "stream_format"})
EXTENSIONS = frozenset({"max_audio_frames", "ignore_eos", "temperature", "top_p", "top_k", "seed"})   # the talker's
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class SpeechOptions:
    text: str
    instructions: str | None
    voice: str
    response_format: str
    stream_format: str


def _text(body: dict, key: str, limit: int, *, needed: bool) -> str | None:
    """A text parameter of 1 to `limit` characters, not blank; an optional one may be absent or ""."""
    value = required(body, key, str) if needed else optional(body, key, str)
    if value is None or (not needed and value == ""):
        return None
    if not value.strip() or len(value) > limit:
        raise bad_request(f"'{key}' must be 1 to {limit} characters, not blank", param=key, code="invalid_value")
    return value


def speech_options(body: dict, st: GatewayState) -> SpeechOptions:
    check_model(body, st.config.model_id)
    text = _text(body, "input", MAX_INPUT_CHARS, needed=True)
    instructions = _text(body, "instructions", MAX_INSTRUCTIONS_CHARS, needed=False)
    voice = resolve_voice(body.get("voice"), st.speakers, "voice")
    fmt = optional(body, "response_format", str, "mp3")
    if fmt not in SPEECH_FORMATS:
        raise bad_request(f"'response_format' must be one of {', '.join(SPEECH_FORMATS)}, got {quoted(fmt)}",
                          param="response_format", code="invalid_value")
    stream_format = optional(body, "stream_format", str, "audio")
    if stream_format not in STREAM_FORMATS:
        raise bad_request(f"'stream_format' must be 'audio' or 'sse', got {quoted(stream_format)}", param="stream_format",
                          code="invalid_value")
    speed = optional(body, "speed", (int, float), 1.0)
    if speed != 1.0:
        raise bad_request("only 'speed' 1.0 is supported", param="speed", code="unsupported_value")
    return SpeechOptions(text=text, instructions=instructions, voice=voice, response_format=fmt,
                         stream_format=stream_format)


def speech_params(body: dict) -> GenerationParams:
    """The talker's sampling and length; the text's length is `input`'s. A parameter that is neither
    OpenAI's nor an extension is refused (as OpenAI does), a text-length one too (the text is given)."""
    for key, value in body.items():
        if key in TEXT_LENGTH_PARAMS:
            if value is not None:
                raise bad_request(f"'{key}' does not apply to speech: the spoken text is exactly 'input' "
                                  "(use 'max_audio_frames' to bound the audio)", param=key,
                                  code="unsupported_parameter")
        elif key not in OPENAI_PARAMS and key not in EXTENSIONS:
            raise bad_request(f"unrecognized request argument supplied: '{clipped(key)}'", param=key,
                              code="unknown_parameter")
    return generation_params(body)


@router.post("/v1/audio/speech")
async def create_speech(request: Request) -> Response:
    arrived = time.perf_counter()
    st = gateway_state(request)
    body = await read_json(request, st.config.max_body_bytes)
    opts = speech_options(body, st)
    params = speech_params(body)
    session, handed_over = st.sessions.acquire("http"), False
    try:
        prompt = await render_prompt(st, speech_turn(opts.text, opts.instructions), param="input")
        req = speech_request(prompt, params, opts.voice, audio=True, assistant_text=opts.text)
        spoken = SpokenReply(st, req, arrived, opts.response_format)
        body_iter = spoken.sse_events() if opts.stream_format == "sse" else spoken.pieces()
        try:  # wait for the first piece, so that an early failure is still an HTTP error status
            first = await read_ahead(request.receive, body_iter, anext(body_iter, None))
        except ClientDisconnect:
            return Response(status_code=499)
        media_type = "text/event-stream" if opts.stream_format == "sse" else \
            audio_formats.content_type(opts.response_format)
        handed_over = True
        return CancellableStream(prepended([] if first is None else [first], body_iter), on_close=session.release,
                                 media_type=media_type, headers=SSE_HEADERS if opts.stream_format == "sse" else None)
    finally:
        if not handed_over:
            session.release()


class SpokenReply:
    """One spoken `input`: the pipeline's pcm16 audio, encoded to `fmt` as it comes."""

    def __init__(self, st: GatewayState, req: SpeechRequest, arrived: float, fmt: str) -> None:
        self.st, self.req, self.arrived, self.fmt = st, req, arrived, fmt
        self.done: DoneEvent | None = None

    async def pieces(self) -> AsyncIterator[bytes]:
        """The file in `fmt`, piece by piece: each non-empty piece as soon as the encoder makes it
        (the encoder runs in a worker thread, off the event loop)."""
        rate = self.st.omni.code2wav.sample_rate
        raw = self.fmt in audio_formats.RAW_PCM

        async def encoded(call, *args) -> bytes:
            return call(*args) if raw else await asyncio.to_thread(call, *args)

        encoder = await encoded(audio_formats.AudioEncoder, self.fmt, rate)
        try:
            async with aclosing(run_pipeline(self.st, self.req, self.arrived)) as events:
                async for ev in events:
                    if isinstance(ev, AudioEvent) and ev.data:
                        piece = await encoded(encoder.push, ev.data)
                        if piece:
                            yield piece
                    elif isinstance(ev, DoneEvent):
                        self.done = ev
            piece = await encoded(encoder.finish)
            if piece:
                yield piece
        finally:
            encoder.close()

    def usage(self) -> dict:
        """The text (the prompt and the given reply) is input; the audio frames are the output."""
        d = self.done
        given = d.prompt_tokens + d.completion_tokens
        return {"input_tokens": given, "output_tokens": d.frames, "total_tokens": given + d.frames}

    async def sse_events(self) -> AsyncIterator[str]:
        """The pieces as `speech.audio.delta` events, then `speech.audio.done`. A failure before the
        first event raises (the HTTP status says it); after it, an `error` event ends the stream."""
        started = False
        try:
            async with aclosing(self.pieces()) as pieces:
                async for piece in pieces:
                    started = True
                    yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()})
        except PipelineError as e:
            if not started:
                raise
            yield sse({"type": "error", **from_pipeline_error(e).body()})
            return
        yield sse({"type": "speech.audio.done", "usage": self.usage()})
