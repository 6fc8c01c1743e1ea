"""POST /v1/audio/transcriptions and /v1/audio/translations through the unmodified openai SDK, against
the real gateway process in front of the session's stage processes. Every transcript is compared
with what the pipeline makes for the same prompt (the served model's own transcription request);
bad inputs get OpenAI-shaped 400 / 404 / 413 errors naming the parameter."""

from __future__ import annotations

import io
import re
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from test_realtime_transcription import pipeline_text
from voxpipe.audio import read_wav, write_wav
from voxpipe.gateway import speech_to_text
from voxpipe.gateway.audio_formats import INPUT_SAMPLE_RATE, decode_clip
from voxpipe.services.thinker.prompt import FeatureExtractor, render

CLIP = Path(__file__).resolve().parents[1] / "bench" / "data" / "voice-in.wav"
CLIP_SECONDS = 1.5          # the shipped speech clip's first 1.5 s: a short prompt, few tokens


@pytest.fixture(scope="module")
def wav() -> bytes:
    samples, rate = read_wav(CLIP.read_bytes())
    out = io.BytesIO()
    write_wav(out, samples[:int(rate * CLIP_SECONDS)], rate)
    return out.getvalue()


@pytest.fixture(scope="module")
def reference(stack, tokenizer, omni_config, tiny_model_dir, wav):
    """(language, prompt, translate) -> (text, prompt tokens, completion tokens, audio tokens): what the
    pipeline makes for that transcription request of `wav`, greedy."""
    audio = decode_clip(wav)
    features = FeatureExtractor.for_model(tiny_model_dir)(audio)
    audio_token = omni_config.thinker.tokens.audio_token
    cache = {}

    def ref(language=None, prompt=None, translate=False):
        key = (language, prompt, translate)
        if key not in cache:
            text = speech_to_text.instruction(language, prompt, translate=translate)
            rendered = render(tokenizer, omni_config.thinker, speech_to_text.messages(features, text))
            out, _, done = pipeline_text(stack, rendered, speech_to_text.max_tokens(audio.size, INPUT_SAMPLE_RATE))
            cache[key] = (out, len(rendered.token_ids), done.completion_tokens,
                          rendered.token_ids.count(audio_token))
        return cache[key]
    return ref


def test_every_response_format_through_the_sdk(client, model, wav, reference):
    text, prompt_tokens, completion_tokens, audio_tokens = reference("en", "a short greeting")
    assert text, "the tiny checkpoint transcribes to some text (random weights: gibberish by design)"
    asked = {"model": model, "language": "en", "prompt": "a short greeting"}
    as_json = client.audio.transcriptions.create(file=("clip.wav", wav, "audio/wav"), **asked)
    assert as_json.text == text
    usage = as_json.usage
    assert usage.type == "tokens" and (usage.input_tokens, usage.output_tokens) == (prompt_tokens, completion_tokens)
    assert usage.total_tokens == prompt_tokens + completion_tokens
    assert usage.input_token_details.audio_tokens == audio_tokens > 0
    assert usage.input_token_details.text_tokens == prompt_tokens - audio_tokens

    assert client.audio.transcriptions.create(file=("clip.wav", wav), response_format="text", **asked) == text
    verbose = client.audio.transcriptions.create(file=("clip.wav", wav), response_format="verbose_json",
                                                 temperature=0, **asked)
    assert verbose.text == text and verbose.language == "en"
    assert verbose.duration == pytest.approx(CLIP_SECONDS, abs=1e-3)
    assert verbose.usage.type == "duration" and verbose.usage.seconds == verbose.duration
    assert verbose.segments is None and verbose.words is None      # no timestamps inside the audio
    srt = client.audio.transcriptions.create(file=("clip.wav", wav), response_format="srt", **asked)
    assert srt == f"1\n00:00:00,000 --> 00:00:01,500\n{text}\n\n"
    vtt = client.audio.transcriptions.create(file=("clip.wav", wav), response_format="vtt", **asked)
    assert vtt == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.500\n{text}\n\n"


def test_streamed_transcription_sends_openais_events(client, model, wav, reference):
    text, prompt_tokens, completion_tokens, _ = reference()
    events = list(client.audio.transcriptions.create(model=model, file=("clip.wav", wav), stream=True))
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == text
    usage = events[-1].usage
    assert (usage.input_tokens, usage.output_tokens) == (prompt_tokens, completion_tokens)


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")   # the SDK marks translations deprecated
def test_translation_into_english(client, model, wav, reference):
    text, prompt_tokens, completion_tokens, _ = reference(translate=True)
    assert client.audio.translations.create(model=model, file=("clip.wav", wav)).text == text
    verbose = client.audio.translations.create(model=model, file=("clip.wav", wav), response_format="verbose_json")
    assert verbose.text == text and verbose.language == "english"


def _error(e: openai.APIStatusError, status: int, param: str | None, pattern: str) -> None:
    assert e.status_code == status, e
    err = e.body if "message" in (e.body or {}) else e.body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    assert re.search(pattern, err["message"]), err["message"]


@pytest.mark.filterwarnings("ignore:deprecated:DeprecationWarning")
def test_bad_inputs_are_refused_naming_the_parameter(client, model, wav, gateway):
    create = client.audio.transcriptions.create
    cases = [
        (dict(file=("notes.wav", b"these are not audio bytes")), 400, "file", "could not decode"),
        (dict(file=("empty.wav", b"")), 400, "file", "empty"),
        (dict(file=("clip.wav", wav), response_format="docx"), 400, "response_format", "must be one of"),
        (dict(file=("clip.wav", wav), timestamp_granularities=["word"]), 400, "timestamp_granularities",
         "no timestamps"),
        (dict(file=("clip.wav", wav), include=["logprobs"]), 400, "include", "not supported"),
        (dict(file=("clip.wav", wav), temperature=1.5), 400, "temperature", "0 to 1"),
        (dict(file=("clip.wav", wav), language="english!"), 400, "language", "language code"),
        (dict(file=("clip.wav", wav), response_format="srt", stream=True), 400, "stream", "json or text"),
        (dict(file=("clip.wav", wav), extra_body={"voice": "ethan"}), 400, "voice", "unrecognized"),
    ]
    for kwargs, status, param, pattern in cases:
        with pytest.raises(openai.APIStatusError) as e:
            create(model=model, **kwargs)
        _error(e.value, status, param, pattern)
    with pytest.raises(openai.NotFoundError) as e:
        create(model="whisper-1", file=("clip.wav", wav))
    _error(e.value, 404, "model", "does not exist")
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.translations.create(model=model, file=("clip.wav", wav), extra_body={"language": "de"})
    _error(e.value, 400, "language", "unrecognized")

    url = f"{gateway.base_url}/v1/audio/transcriptions"
    missing = httpx.post(url, data={"model": model}, files={"other": ("x", b"x")}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "other"
    missing = httpx.post(url, files={"model": (None, model), "prompt": (None, "no file")}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file", missing.text
    as_text = httpx.post(url, files={"model": (None, model), "file": (None, "a field, not a file")}, timeout=30)
    assert as_text.status_code == 400 and as_text.json()["error"]["param"] == "file", as_text.text
    as_json = httpx.post(url, json={"model": model, "file": "clip.wav"}, timeout=30)
    assert as_json.status_code == 400 and "multipart/form-data" in as_json.json()["error"]["message"]
    silence_at_1_hz = io.BytesIO()
    write_wav(silence_at_1_hz, np.zeros(4, np.float32), 1)
    slow = httpx.post(url, data={"model": model}, files={"file": ("slow.wav", silence_at_1_hz.getvalue())}, timeout=30)
    assert slow.status_code == 400 and "sample rate" in slow.json()["error"]["message"], slow.text


def test_a_body_over_the_limit_is_413_before_and_while_reading(gateway, model):
    """The gateway's default --max-body-mb (32): a declared length over it is refused before the
    body is read, a chunked body without a length once it passes it."""
    url = f"{gateway.base_url}/v1/audio/transcriptions"
    big = b"\0" * (33 * 1024 * 1024)
    declared = httpx.post(url, data={"model": model}, files={"file": ("big.wav", big)}, timeout=60)
    assert declared.status_code == 413 and declared.json()["error"]["code"] == "request_too_large"

    def chunks():
        yield b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.wav\"\r\n\r\n"
        for _ in range(33):
            yield b"\0" * (1024 * 1024)
        yield b"\r\n--b--\r\n"

    chunked = httpx.post(url, content=chunks(), timeout=60, headers={"content-type": "multipart/form-data; boundary=b"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
