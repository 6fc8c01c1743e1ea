"""POST /v1/audio/transcriptions and /v1/audio/translations, as OpenAI's: speech to text by the
served model (speech_to_text.py, the transcriber realtime input transcription uses too).

The request is OpenAI's multipart form: `file` (wav, mp3, flac, ogg ... decoded as chat's
`input_audio`, audio_formats.decode_clip), `model` (the served model's id), `prompt`,
`response_format`, `temperature` (0 to 1; default 0: greedy) and, for transcriptions, `language`
and `stream`. A translation is the same request with the instruction to translate into English.
OpenAI parameters this server cannot honour (`timestamp_granularities`, `include`,
`chunking_strategy`, diarization and keyword hints) are refused with a 400 naming them, as is any
name OpenAI does not define.

response_format: `json` ({text, usage} with the request's tokens), `text`, `verbose_json` ({task,
language, duration, text, usage} with the audio's duration; no segments or words: the model gives
no timestamps inside the audio), `srt` / `vtt` (one cue spanning the whole audio). `stream: true`
(json or text) sends OpenAI's SSE events: `transcript.text.delta` per piece of text, then
`transcript.text.done` with the text and usage; the status waits for the first event, so a failure
before any text is an HTTP error status, and one after it ends the stream with an `error` event."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from voxpipe.client import PipelineError

from . import speech_to_text
from .audio_formats import INPUT_SAMPLE_RATE, decode_clip
from .errors import bad_request, from_pipeline_error
from .generation import Generation
from .params import bounded_body, check_model
from .speech_to_text import Transcript
from .state import GatewayState, gateway_state
from .streaming import CancellableStream, prepended, sse, until_disconnect

router = APIRouter()
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
STREAMED_FORMATS = ("json", "text")
TRANSCRIPTION_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream")
TRANSLATION_FIELDS = ("file", "model", "prompt", "response_format", "temperature")
# OpenAI's transcription parameters that are not served, and why
NOT_SERVED = {
    "timestamp_granularities": "the model gives no timestamps inside the audio",
    "include": "log probabilities of transcripts are not served",
    "chunking_strategy": "the audio is transcribed as one block",
    "known_speaker_names": "speaker diarization is not served",
    "known_speaker_references": "speaker diarization is not served",
    "keywords": "keyword hints are not served (use 'prompt')",
    "languages": "a list of languages is not served (give one 'language')",
}
MAX_FIELDS = 32
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class SpeechToTextOptions:
    audio: np.ndarray               # 16 kHz mono float32
    language: str | None
    prompt: str | None
    response_format: str
    temperature: float
    stream: bool
    translate: bool

    @property
    def seconds(self) -> float:
        return self.audio.size / INPUT_SAMPLE_RATE


async def read_form(request: Request, max_bytes: int) -> FormData:
    """The multipart form (413 over `max_bytes`, 400 when it is not a multipart form)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("this endpoint takes a multipart/form-data body (the audio as 'file')",
                          code="invalid_request")
    parser = MultiPartParser(request.headers, bounded_body(request, max_bytes), max_files=1, max_fields=MAX_FIELDS)
    try:
        return await parser.parse()
    except MultiPartException as e:
        raise bad_request(f"the multipart body could not be read: {e.message}", code="invalid_request") from None


def _fields(form: FormData, allowed: tuple[str, ...]) -> dict[str, str | UploadFile]:
    """The form's fields by name (an array's `name[]` as `name`), each given once."""
    fields: dict[str, str | UploadFile] = {}
    for raw_key, value in form.multi_items():
        key = raw_key.removesuffix("[]")
        if key not in allowed:
            if key in NOT_SERVED:
                raise bad_request(f"'{key}' is not supported: {NOT_SERVED[key]}", param=key,
                                  code="unsupported_parameter")
            raise bad_request(f"unrecognized request argument supplied: '{key[:64]}'", param=key[:64],
                              code="unknown_parameter")
        if key in fields:
            raise bad_request(f"'{key}' is given more than once", param=key, code="invalid_value")
        fields[key] = value
    return fields


def _text(fields: dict, key: str, limit: int) -> str | None:
    value = fields.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{key}' must be a string, not a file", param=key, code="invalid_type")
    if len(value) > limit:
        raise bad_request(f"'{key}' has {len(value)} characters; the limit is {limit}", param=key,
                          code="invalid_value")
    return value


def _choice(fields: dict, key: str, choices: tuple[str, ...], default: str) -> str:
    value = _text(fields, key, 64) or default
    if value not in choices:
        raise bad_request(f"'{key}' must be one of {', '.join(choices)}, got {value!r}", param=key,
                          code="invalid_value")
    return value


def _temperature(fields: dict) -> float:
    value = _text(fields, "temperature", 64)
    try:
        temperature = 0.0 if value is None else float(value)
    except ValueError:
        temperature = float("nan")
    if not 0.0 <= temperature <= 1.0:
        raise bad_request(f"'temperature' must be a number from 0 to 1, got {value!r}", param="temperature",
                          code="invalid_value")
    return temperature


async def _audio(fields: dict) -> np.ndarray:
    file = fields.get("file")
    if file is None:
        raise bad_request("missing required parameter: 'file'", param="file", code="missing_required_parameter")
    if not isinstance(file, UploadFile):
        raise bad_request("'file' must be an uploaded file (a multipart part with a filename)", param="file",
                          code="invalid_type")
    raw = await file.read()
    if not raw:
        raise bad_request("'file' is empty", param="file", code="invalid_value")
    try:
        return await asyncio.to_thread(decode_clip, raw)
    except ValueError as e:
        raise bad_request(f"'file': {e}", param="file", code="invalid_value") from None


async def speech_to_text_options(request: Request, st: GatewayState, translate: bool) -> SpeechToTextOptions:
    form = await read_form(request, st.config.max_body_bytes)
    try:
        fields = _fields(form, TRANSLATION_FIELDS if translate else TRANSCRIPTION_FIELDS)
        check_model(fields, st.config.model_id)
        language = _text(fields, "language", speech_to_text.MAX_LANGUAGE_CHARS + 1)
        if language is not None and not speech_to_text.valid_language(language):
            raise bad_request(f"'language' must be a language code such as \"en\", got {language!r}",
                              param="language", code="invalid_value")
        prompt = _text(fields, "prompt", speech_to_text.MAX_PROMPT_CHARS)
        fmt = _choice(fields, "response_format", RESPONSE_FORMATS, "json")
        stream = _choice(fields, "stream", ("true", "false", "True", "False"), "false").lower() == "true"
        if stream and fmt not in STREAMED_FORMATS:
            raise bad_request(f"'stream' needs response_format json or text, got {fmt!r}", param="stream",
                              code="unsupported_value")
        temperature = _temperature(fields)
        audio = await _audio(fields)
    finally:
        await form.close()
    return SpeechToTextOptions(audio=audio, language=language, prompt=prompt, response_format=fmt,
                               temperature=temperature, stream=stream, translate=translate)


def _timestamp(seconds: float, separator: str) -> str:
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{separator}{ms % 1000:03d}"


def formatted(t: Transcript, opts: SpeechToTextOptions) -> Response:
    """The whole transcript in `opts.response_format`."""
    fmt, seconds = opts.response_format, opts.seconds
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": t.usage()})
    if fmt == "verbose_json":
        language = "english" if opts.translate else (opts.language or "unknown")
        return JSONResponse({"task": "translate" if opts.translate else "transcribe", "language": language,
                             "duration": seconds, "text": t.text, "usage": {"type": "duration", "seconds": seconds}})
    if fmt == "srt":
        return PlainTextResponse(f"1\n{_timestamp(0, ',')} --> {_timestamp(seconds, ',')}\n{t.text}\n\n")
    if fmt == "vtt":
        return PlainTextResponse(f"WEBVTT\n\n{_timestamp(0, '.')} --> {_timestamp(seconds, '.')}\n{t.text}\n\n",
                                 media_type="text/vtt")
    return PlainTextResponse(t.text)


async def _events(pieces: AsyncIterator[str | Transcript]) -> AsyncIterator[str]:
    """The pieces as `transcript.text.delta` events, then `transcript.text.done`. A failure before
    the first event raises (the HTTP status says it); after it, an `error` event ends the stream."""
    started = False
    try:
        async with aclosing(pieces):
            async for piece in pieces:
                if isinstance(piece, Transcript):
                    event = {"type": "transcript.text.done", "text": piece.text, "usage": piece.usage()}
                else:
                    event = {"type": "transcript.text.delta", "delta": piece}
                started = True
                yield sse(event)
    except PipelineError as e:
        if not started:
            raise
        yield sse({"type": "error", **from_pipeline_error(e).body()})


async def _last(pieces: AsyncIterator[str | Transcript]) -> Transcript:
    async with aclosing(pieces):
        async for piece in pieces:
            if isinstance(piece, Transcript):
                return piece
    raise RuntimeError("the transcription ended without its transcript")


async def _serve(request: Request, translate: bool) -> Response:
    arrived = time.perf_counter()
    st = gateway_state(request)
    opts = await speech_to_text_options(request, st, translate)
    instruction = speech_to_text.instruction(opts.language, opts.prompt, translate=translate)
    session, handed_over = st.sessions.acquire("http"), False
    try:
        pieces = speech_to_text.transcribe(
            Generation.of(st, param="file"), speech_to_text.messages(opts.audio, instruction),
            max_new_tokens=speech_to_text.max_tokens(opts.audio.size, INPUT_SAMPLE_RATE),
            temperature=opts.temperature, arrived=arrived)
        try:
            if not opts.stream:
                return formatted(await until_disconnect(request.receive, _last(pieces)), opts)
            events = _events(pieces)
            try:  # wait for the first event, so that an early failure is still an HTTP error status
                first = await until_disconnect(request.receive, anext(events, None))
            except BaseException:
                await events.aclose()
                raise
        except ClientDisconnect:
            return Response(status_code=499)
        handed_over = True
        return CancellableStream(prepended([] if first is None else [first], events), on_close=session.release, media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    finally:
        if not handed_over:
            session.release()


@router.post("/v1/audio/transcriptions")
async def create_transcription(request: Request) -> Response:
    return await _serve(request, translate=False)


@router.post("/v1/audio/translations")
async def create_translation(request: Request) -> Response:
    return await _serve(request, translate=True)
