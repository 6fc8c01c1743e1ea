"""The gateway's OpenAI-compatible HTTP API, driven by the unmodified `openai` SDK (and raw httpx
where the SDK hides the wire), against real gateway and stage processes."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import socket
import threading
import time
import wave

import httpx
import numpy as np
import openai
import pytest
import soundfile

from conftest import STAGES, GatewayProcess, start_chain
from voxpipe.audio import resample
from voxpipe.client import AudioEvent, PipelineClient, SpeechRequest, TextEvent
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, render

MODEL = "tiny-checkpoint"          # the strict gateway's --served-model-name
GREEDY = {"temperature": 0, "max_tokens": 6}
FORCED = {"ignore_eos": True, "max_audio_frames": 10}   # 9 frames (max_new_tokens semantics)
SAMPLES_PER_FRAME, FIRST_CHUNK_SHORTFALL = 1920, 555




@pytest.fixture(scope="module")
def chain(tiny_model_dir):
    """A thinker -> talker -> code2wav chain of this module's own: its code2wav is killed by the tests
    below (the mid-stream failure first, then the stage-down test, in file order)."""
    procs = start_chain(tiny_model_dir)
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def strict_gateway(chain, tiny_model_dir):
    """API key, one session at a time, 64 KB bodies arriving within 1 s, in front of `chain`
    (test_stage_down_is_503 kills its code2wav)."""
    gw = GatewayProcess(tiny_model_dir, chain.address("thinker"), chain.address("code2wav"),
                        "--api-key", "sesame", "--max-sessions", "1", "--max-body-mb", "0.0625",
                        "--body-timeout", "1", "--served-model-name", MODEL)
    yield gw
    gw.stop()


def pipeline_result(stack, prompt, **kw):
    """What the pipeline client makes for the same request (the reference for the gateway)."""
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            text, pcm = "", bytearray()
            async for ev in pc.stream(SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features,
                                                    **kw)):
                if isinstance(ev, TextEvent):
                    text += ev.text
                elif isinstance(ev, AudioEvent):
                    pcm += ev.data
            return text, np.frombuffer(bytes(pcm), dtype="<i2")
    return asyncio.run(go())


def encoded_base64(samples: np.ndarray, rate: int, fmt: str) -> str:
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt.upper(), subtype={"wav": "PCM_16", "mp3": "MPEG_LAYER_III"}[fmt])
    return base64.b64encode(buf.getvalue()).decode()


# ----------------------------------------------------------------------------- the happy paths

def test_models_health_and_ready(gateway, tiny_model_dir):
    models = httpx.get(f"{gateway.base_url}/v1/models").json()
    assert models["object"] == "list"
    [m] = models["data"]
    assert m["id"] == tiny_model_dir.name and m["object"] == "model" and m["owned_by"] and m["created"] > 0
    assert httpx.get(f"{gateway.base_url}/health").status_code == 200
    ready = httpx.get(f"{gateway.base_url}/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_chat_audio_wav(client, model):
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], modalities=["text", "audio"],
        audio={"voice": "Chelsie", "format": "wav"}, extra_body=FORCED, **GREEDY)
    msg = resp.choices[0].message
    assert resp.object == "chat.completion" and msg.role == "assistant" and msg.content is None
    assert msg.audio.id.startswith("audio_") and msg.audio.expires_at > time.time()
    assert len(msg.audio.transcript) > 0
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(msg.audio.data)), dtype="int16")
    frames = resp.usage.completion_tokens_details.audio_tokens
    assert rate == 24000 and samples.ndim == 1
    assert frames == 9 and samples.shape[0] == SAMPLES_PER_FRAME * frames - FIRST_CHUNK_SHORTFALL
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens_details.text_tokens == 6
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_pcm16_equals_pipeline_client(client, model, stack, tokenizer, omni_config):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}]
    stream = client.chat.completions.create(
        model=model, messages=messages, modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
        stream=True, stream_options={"include_usage": True}, extra_body=FORCED, **GREEDY)
    pcm, transcript, ids, expiries, finish, usage = bytearray(), "", set(), [], None, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            audio = choice.delta.audio
            if audio is None:
                continue
            if audio.id:
                ids.add(audio.id)
            if audio.expires_at:
                expiries.append(audio.expires_at)
            pcm += base64.b64decode(audio.data or "")
            transcript += audio.transcript or ""
    prompt = render(tokenizer, omni_config.thinker, [ChatMessage.text("system", "Be brief."),
                                                     ChatMessage.text("user", "Tell me about rivers.")])
    ref_text, ref_pcm = pipeline_result(stack, prompt, speaker="ethan", max_tokens=6, min_tokens=6, max_frames=10,
                                        min_frames=10)
    got = np.frombuffer(bytes(pcm), dtype="<i2")
    assert got.shape[0] == SAMPLES_PER_FRAME * 9 - FIRST_CHUNK_SHORTFALL
    # the same stream as the pipeline client's, from another run: equal up to pcm16 rounding of
    # float32 differences (decode batches depend on which requests share an engine step)
    assert np.abs(got.astype(np.int32) - ref_pcm.astype(np.int32)).max() <= 1
    assert transcript == ref_text and len(ids) == 1 and len(expiries) == 1
    assert finish == "length" and usage.completion_tokens_details.audio_tokens == 9


def test_chat_text_only_stream_equals_pipeline_client(client, model, stack, tokenizer, omni_config):
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Just text."}],
                                            stream=True, temperature=0, max_completion_tokens=5,
                                            extra_body={"ignore_eos": True})
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            assert choice.delta.audio is None
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    prompt = render(tokenizer, omni_config.thinker, [ChatMessage.text("user", "Just text.")])
    ref_text, ref_pcm = pipeline_result(stack, prompt, audio=False, max_tokens=5, min_tokens=5)
    assert "".join(pieces) == ref_text and ref_pcm.size == 0 and finish == "length"
    # streamed as chunks: the text (deltas already waiting when one is sent travel together, so on a
    # loaded machine the 5 tokens may come as one piece) and the finish in a chunk of its own
    assert sum(1 for p in pieces if p) >= 1 and len(pieces) >= 2 and pieces[-1] == ""


@pytest.mark.parametrize("fmt", ["wav", "mp3"])
def test_chat_input_audio_part(client, model, stack, tokenizer, omni_config, tiny_model_dir, fmt):
    rate = 22050
    t = np.arange(int(0.8 * rate)) / rate
    clip = (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)
    data = encoded_base64(clip, rate, fmt)
    resp = client.chat.completions.create(
        model=model, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}},
                                               {"type": "text", "text": "What is this sound?"}]}])
    # the same clip as the gateway sees it: decoded, resampled to 16 kHz
    decoded, _ = soundfile.read(io.BytesIO(base64.b64decode(data)), dtype="float32")
    prompt = render(tokenizer, omni_config.thinker,
                    [ChatMessage("user", [ChatPart(audio=resample(decoded, rate, 16000)),
                                          ChatPart(text="What is this sound?")])],
                    FeatureExtractor.for_model(tiny_model_dir))
    ref_text, _ = pipeline_result(stack, prompt, audio=False, max_tokens=4)
    assert resp.choices[0].message.content == ref_text
    assert resp.usage.prompt_tokens == len(prompt.token_ids)
    assert resp.usage.prompt_tokens_details.audio_tokens > 0


def test_multi_turn_refers_to_earlier_audio_by_id(client, model, gateway):
    first = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi!"}], modalities=["text", "audio"],
        audio={"voice": "aiden", "format": "flac"}, max_tokens=4, temperature=0, extra_body={"max_audio_frames": 4})
    audio = first.choices[0].message.audio
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(audio.data)))
    assert rate == 24000 and samples.size > 0
    follow_up = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "audio": {"id": audio.id}},
                 {"role": "user", "content": "Again?"}]
    second = client.chat.completions.create(model=model, messages=follow_up, max_tokens=4, temperature=0)
    # the reply's message object sent back as it came (its annotations, audio data, expiry and transcript)
    echoed = client.chat.completions.create(model=model, messages=[follow_up[0], first.choices[0].message, follow_up[2]],
                                            max_tokens=4, temperature=0)
    assert echoed.usage.prompt_tokens == second.usage.prompt_tokens
    # the earlier reply's transcript is part of the prompt: same prompt as sending that text
    as_text = [follow_up[0], {"role": "assistant", "content": audio.transcript}, follow_up[2]]
    third = client.chat.completions.create(model=model, messages=as_text, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == third.usage.prompt_tokens
    assert second.choices[0].message.content == third.choices[0].message.content


def test_speech_wav(client, model):
    resp = client.audio.speech.create(model=model, voice="Aiden", input="Read this aloud.", response_format="wav",
                                      extra_body={"max_audio_frames": 8, "ignore_eos": True, "temperature": 0})
    assert resp.response.headers["content-type"].startswith("audio/wav")
    samples, rate = soundfile.read(io.BytesIO(resp.content), dtype="int16")
    assert rate == 24000 and samples.shape[0] == SAMPLES_PER_FRAME * 7 - FIRST_CHUNK_SHORTFALL


def test_speech_sse_equals_pcm_stream(gateway, model):
    body = {"model": model, "voice": "chelsie", "input": "Stream this.", "response_format": "pcm",
            "max_audio_frames": 8, "ignore_eos": True, "temperature": 0}
    raw = httpx.post(f"{gateway.base_url}/v1/audio/speech", json=body, timeout=60)
    assert raw.status_code == 200 and raw.headers["content-type"] == "audio/pcm"
    events = []
    with httpx.stream("POST", f"{gateway.base_url}/v1/audio/speech", json={**body, "stream_format": "sse"},
                      timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] > 0
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == len(raw.content) == 2 * (SAMPLES_PER_FRAME * 7 - FIRST_CHUNK_SHORTFALL)
    a, b = (np.frombuffer(x, dtype="<i2").astype(np.int32) for x in (pcm, raw.content))
    assert np.abs(a - b).max() <= 1     # two runs: equal up to pcm16 rounding


# ----------------------------------------------------------------------------- errors

def post(gateway, path: str, content: bytes | str, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}{path}", content=content,
                      headers={"content-type": "application/json", **(headers or {})}, timeout=60)


def assert_openai_error(resp: httpx.Response, status: int, pattern: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert re.search(pattern, err["message"]), err["message"]
    return err


def chat_body(model: str, **kw) -> str:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw})


def test_bad_json(gateway):
    assert_openai_error(post(gateway, "/v1/chat/completions", "{not json"), 400, "not valid JSON")


def test_unknown_voice_names_the_valid_ones(gateway, model):
    body = chat_body(model, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})
    err = assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, "alloy")
    assert all(v in err["message"] for v in ("aiden", "chelsie", "ethan")) and err["param"] == "audio.voice"
    speech = json.dumps({"model": model, "input": "hi", "voice": "nova"})
    assert_openai_error(post(gateway, "/v1/audio/speech", speech), 400, "chelsie")


LONG = "x" * 10_000


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": LONG, "format": "wav"}},
     "audio.voice"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": LONG}},
     "audio.format"),
    ("/v1/chat/completions", {"model": LONG}, "model"),
    ("/v1/chat/completions", {LONG: 1}, LONG[:256] + "... (10000 characters)"),
    ("/v1/chat/completions", {"stream": True, "stream_options": {LONG: True}},
     f"stream_options.{LONG}"[:256] + "... (10015 characters)"),
    ("/v1/audio/speech", {"input": "hi", "voice": LONG}, "voice"),
    ("/v1/audio/speech", {"input": "hi", "voice": "ethan", "response_format": LONG}, "response_format"),
    ("/v1/audio/speech", {"input": "hi", "voice": "ethan", LONG: 1}, LONG[:256] + "... (10000 characters)"),
], ids=["chat-voice", "chat-format", "model", "chat-key", "stream-option", "speech-voice", "speech-format",
        "speech-key"])
def test_errors_quote_long_values_cut_short(gateway, model, path, body, param):
    """A 10,000-character value or key: the 400 (404 for the model) names it, quoting a bounded start."""
    base = {"model": model, "messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"model": model}
    resp = post(gateway, path, json.dumps({**base, **body}))
    assert resp.status_code == (404 if param == "model" else 400), resp.text
    err = resp.json()["error"]
    assert err["param"] == param
    assert len(err["message"]) < 400 and re.search(r"x{63,64}\.\.\. \(1000[02] characters\)", err["message"]), \
        err["message"]


AUDIO_OUT = {"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}}
HI = {"role": "user", "content": "hi"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages,param,code", [
    ([{**HI, "nmae": "bob"}], "messages[0].nmae", "unknown_parameter"),
    ([{"role": "system", "content": "s", "tool_call_id": "x"}, HI], "messages[0].tool_call_id", "unknown_parameter"),
    ([HI, {"role": "assistant", "content": "a", "tool_calls": [CALL]},
      {"role": "tool", "content": "r", "tool_call_id": "call_1", "name": "f"}], "messages[2].name", "unknown_parameter"),
    ([{**HI, "name": 7}], "messages[0].name", "invalid_value"),
    ([HI, {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}], "messages[1].function_call",
     "unsupported_parameter"),
    ([HI, {"role": "assistant", "content": "a", "refusal": 3}], "messages[1].refusal", "invalid_type"),
    ([HI, {"role": "assistant", "content": "a", "annotations": "x"}], "messages[1].annotations", "invalid_type"),
    ([{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {}}]}],
     "messages[0].content[0].cache_control", "unknown_parameter"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav",
                                                                            "rate": 16000}}]}],
     "messages[0].content[0].input_audio.rate", "unknown_parameter"),
    ([HI, {"role": "assistant", "tool_calls": [{**CALL, "idx": 0}]}], "messages[1].tool_calls[0].idx",
     "unknown_parameter"),
    ([HI, {"role": "assistant", "tool_calls": [{**CALL, "function": {**CALL["function"], "strict": True}}]}],
     "messages[1].tool_calls[0].function.strict", "unknown_parameter"),
    ([HI, {"role": "assistant", "audio": {"id": "x", "voice": "ethan"}}], "messages[1].audio.voice",
     "unknown_parameter"),
], ids=["user-key", "system-key", "tool-name", "name-type", "function-call", "refusal-type", "annotations-type",
        "part-key", "audio-key", "call-key", "call-function-key", "audio-ref-key"])
def test_message_fields_outside_their_role_are_400_naming_them(gateway, model, messages, param, code):
    """Each role's message takes OpenAI's fields for that role: an unknown one (a typo, another API's
    extension) is a 400 naming it, never silently dropped from the prompt."""
    resp = post(gateway, "/v1/chat/completions", json.dumps({"model": model, "messages": messages, "max_tokens": 2}))
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert len(err["message"]) < 400


@pytest.mark.parametrize("extra,pattern", [
    ({"max_completion_tokens": 2**31}, r"the thinker rejected the request: prompt of \d+ tokens \+ max_tokens "
                                       r"2147483648 exceeds the context of 65536"),
    ({"max_tokens": 2**32}, r"'max_tokens' must be an integer from 1 to 4294967295"),
    ({**AUDIO_OUT, "max_tokens": 2, "max_audio_frames": 70000},
     r"the talker rejected the request: \d+ user rows \+ \d+ prompt rows \+ max_frames 70000 exceed the talker "
     r"context of 65536"),
    ({"messages": [{"role": "user", "content": "x" * 200_001}]}, r"the limit is 200000"),
    ({"stop": ["a"] * 5}, r"at most 4 stop strings"),
    ({"logprobs": True, "top_logprobs": 21}, r"'top_logprobs' must be an integer from 0 to 20"),
], ids=["thinker-context", "uint32", "talker-context", "prompt-chars", "stop", "top-logprobs"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_every_limit_is_checked_before_a_stream_opens(gateway, model, extra, pattern, stream):
    """What the stages refuse as well as what the gateway does: the same 400, streamed or not (no
    200 whose stream then carries the error)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **extra}
    err = assert_openai_error(post(gateway, "/v1/chat/completions", json.dumps(body)), 400, pattern)
    assert err["type"] == "invalid_request_error"
    assert (err["code"] == "context_length_exceeded") == ("context" in pattern), err


@pytest.mark.parametrize("stream_format", ["audio", "sse"])
def test_speech_limits_are_checked_before_the_audio_starts(gateway, model, stream_format):
    body = {"model": model, "input": "hi", "voice": "ethan", "response_format": "pcm", "max_audio_frames": 70000,
            "stream_format": stream_format}
    err = assert_openai_error(post(gateway, "/v1/audio/speech", json.dumps(body)), 400,
                              r"the talker rejected the request: .*max_frames 70000 exceed the talker context of 65536")
    assert err["code"] == "context_length_exceeded"


def test_a_stream_that_passes_every_check_starts_with_the_role_and_ends_done(gateway, model):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 3,
            "temperature": 0, **AUDIO_OUT, "max_audio_frames": 4}
    resp = post(gateway, "/v1/chat/completions", json.dumps(body))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
    assert any("data" in (json.loads(e)["choices"][0]["delta"].get("audio") or {}) for e in events[1:-1])


def test_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as e:     # as OpenAI: 404 model_not_found
        client.chat.completions.create(model="gpt-4o-audio-preview", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.code == "model_not_found"


def test_bad_base64_and_undecodable_audio(gateway, model):
    for data, pattern in (("%%% not base64 %%%", "base64"), (base64.b64encode(b"hello, not audio").decode(),
                                                             "could not decode")):
        part = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": [part]}]})
        err = assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, pattern)
        assert err["param"] == "messages[0].content[0].input_audio.data"


def test_unknown_audio_id(gateway, model):
    body = json.dumps({"model": model, "messages": [{"role": "assistant", "audio": {"id": "audio_123"}},
                                                     {"role": "user", "content": "and?"}]})
    assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, "audio_123")


def test_streaming_needs_pcm16(client, model):
    with pytest.raises(openai.BadRequestError, match="pcm16"):
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], stream=True,
                                       modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})


def test_bad_sampling_parameters(gateway, model):
    assert_openai_error(post(gateway, "/v1/chat/completions", chat_body(model, temperature=7)), 400, "temperature")
    assert_openai_error(post(gateway, "/v1/chat/completions", chat_body(model, max_tokens=0)), 400, "max_tokens")
    assert_openai_error(post(gateway, "/v1/chat/completions", chat_body(model, max_tokens=100000)), 400, "context")


OUT_OF_RANGE = [("max_tokens", 2**32), ("max_completion_tokens", 2**32), ("min_tokens", 2**32), ("top_k", 2**31),
                ("max_audio_frames", 2**32), ("seed", 2**64), ("seed", -(2**63) - 1)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_integers_out_of_range_are_400_naming_the_parameter(gateway, model, stream):
    for key, value in OUT_OF_RANGE:
        resp = post(gateway, "/v1/chat/completions", chat_body(model, stream=stream, **{key: value}))
        err = assert_openai_error(resp, 400, rf"'{key}' must be an integer from -?\d+ to \d+, got {value}")
        assert err["param"] == key and err["code"] == "invalid_value"
    speech = json.dumps({"model": model, "input": "hi", "voice": "ethan", "max_audio_frames": 2**32})
    assert assert_openai_error(post(gateway, "/v1/audio/speech", speech), 400, "4294967295")["param"] == \
        "max_audio_frames"


def test_deeply_nested_json_is_400(gateway, model):
    deep = "[" * 2000 + "]" * 2000
    for path in ("/v1/chat/completions", "/v1/audio/speech"):
        assert_openai_error(post(gateway, path, deep), 400, "nested too deeply")
    inside = '{"model": "%s", "messages": %s}' % (model, deep)
    assert_openai_error(post(gateway, "/v1/chat/completions", inside), 400, "nested too deeply")
    assert httpx.get(f"{gateway.base_url}/health").status_code == 200


def _wav_header_only(rate: int, samples: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.zeros(samples, dtype="<i2").tobytes())
    return buf.getvalue()


def test_audio_is_refused_on_its_claimed_rate_and_length_before_decoding(gateway, model):
    """A 6 KB wav claiming 1 Hz (50 minutes of audio at 16 kHz once resampled), and an 11-minute
    flac of silence that compresses to a few KB: refused from their headers."""
    silence = io.BytesIO()
    soundfile.write(silence, np.zeros(660 * 8000, dtype=np.int16), 8000, format="FLAC", subtype="PCM_16")
    cases = [(_wav_header_only(1, 3000), "wav", "sample rate must be 1000 to 384000 Hz, got 1"),
             (silence.getvalue(), "flac", "the audio is 660 s long; the limit is 600 s")]
    for data, fmt, pattern in cases:
        assert len(data) < 100_000
        part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": [part]}], "max_tokens": 2})
        err = assert_openai_error(post(gateway, "/v1/chat/completions", body), 400, pattern)
        assert err["param"] == "messages[0].content[0].input_audio.data"


def test_text_over_the_limit_is_400_before_tokenizing(gateway, model):
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "word " * 50_000}], "max_tokens": 2})
    err = assert_openai_error(post(gateway, "/v1/chat/completions", body), 400,
                              "250004 characters of text; the limit is 200000")
    assert err["param"] == "messages"


def test_metrics_need_the_api_key_when_one_is_set(strict_gateway, gateway):
    """/metrics is on the API port: with --api-key it needs the key (401 otherwise, as OpenAI-shaped
    as the API's); the probes (/health, /ready) need none. Without a key it is open."""
    url = strict_gateway.base_url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"}):
        resp = httpx.get(f"{url}/metrics", headers=headers, timeout=5)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
        assert "voxpipe_gateway" not in resp.text
    resp = httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sesame"}, timeout=5)
    assert resp.status_code == 200 and "voxpipe_gateway_sessions" in resp.text
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200
    assert httpx.get(f"{url}/ready", timeout=5).status_code in (200, 503)
    assert httpx.get(f"{gateway.base_url}/metrics", timeout=5).status_code == 200


def test_a_body_that_stops_arriving_is_408(strict_gateway):
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer sesame\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    with socket.create_connection(("127.0.0.1", strict_gateway.port), timeout=30) as conn:
        conn.sendall(head)                  # ... and nothing more
        reply = b""
        while not reply.endswith(b"}}"):
            chunk = conn.recv(65536)
            assert chunk, reply
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"the request body did not arrive within 1 s" in reply


def test_api_key(strict_gateway):
    url = f"{strict_gateway.base_url}/v1/models"
    assert_openai_error(httpx.get(url), 401, "API key")
    assert_openai_error(httpx.get(url, headers={"Authorization": "Bearer wrong"}), 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{strict_gateway.base_url}/v1", api_key="wrong", max_retries=0).models.list()
    sdk = openai.OpenAI(base_url=f"{strict_gateway.base_url}/v1", api_key="sesame", max_retries=0)
    assert [m.id for m in sdk.models.list()] == [MODEL]
    assert httpx.get(f"{strict_gateway.base_url}/health").status_code == 200    # probes need no key


def test_oversize_body(strict_gateway):
    body = chat_body(MODEL, user="x" * 100_000)
    resp = post(strict_gateway, "/v1/chat/completions", body, {"Authorization": "Bearer sesame"})
    assert_openai_error(resp, 413, "exceeds")


def test_too_many_sessions(strict_gateway):
    async def burst():
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": "Bearer sesame"}) as http:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                    "ignore_eos": True}
            return await asyncio.gather(*(http.post(f"{strict_gateway.base_url}/v1/chat/completions", json=body)
                                          for _ in range(4)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses[0] == 200 and statuses[-1] == 429, statuses
    limited = next(r for r in responses if r.status_code == 429)
    assert_openai_error(limited, 429, "concurrent sessions")


# ----------------------------------------------------------------------------- disconnects and metrics

def stage_metric(stack, stage: str, name: str = "voxpipe_active_streams", labels: str = "") -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics").text
    m = re.search(rf'^{name}{{{labels}stage="{stage}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def cancelled_streams(stack) -> float:
    return sum(stage_metric(stack, s, "voxpipe_streams_total", 'outcome="cancelled",') for s in STAGES)


def test_disconnect_mid_stream_frees_every_stage(gateway, model, stack):
    body = {"model": model, "messages": [{"role": "user", "content": "Talk for a while."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "max_tokens": 8, "max_audio_frames": 12, "ignore_eos": True}
    cancelled_before = cancelled_streams(stack)
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"data":' in line:      # the first audio chunk
                break
    deadline = time.monotonic() + 5
    while any(stage_metric(stack, s) for s in STAGES) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [stage_metric(stack, s) for s in STAGES] == [0, 0, 0]
    # cancelled, not run to the end: (at least) code2wav still had frames to decode
    assert cancelled_streams(stack) > cancelled_before
    metrics = httpx.get(f"{gateway.base_url}/metrics").text
    assert re.search(r"^voxpipe_gateway_active_streams 0\.0$", metrics, re.M)


def test_gateway_metrics(gateway, client, model):
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   modalities=["text", "audio"], audio={"voice": "ethan", "format": "pcm16"},
                                   extra_body={"max_audio_frames": 3})
    text = httpx.get(f"{gateway.base_url}/metrics").text
    assert re.search(r'^voxpipe_gateway_requests_total\{route="/v1/chat/completions",status="200"\} [1-9]', text,
                     re.M)
    for name in ("voxpipe_gateway_audio_ttfp_seconds_count", "voxpipe_gateway_audio_rtf_count"):
        assert float(re.search(rf"^{name} (\S+)$", text, re.M).group(1)) >= 1
    for stage in STAGES:
        assert re.search(rf'^voxpipe_gateway_stage_first_output_seconds_count\{{stage="{stage}"\}} [1-9]', text, re.M)


# ----------------------------------------------------------------------------- a stage failing mid-stream

def test_a_stage_failing_mid_stream_ends_pcm_abnormally_and_sse_with_an_error_event(chain, tiny_model_dir):
    """A pcm /v1/audio/speech stream whose code2wav dies after audio was sent ends without the
    terminating chunk (the client sees an incomplete body, not a short clean one); an SSE stream
    ends with an `error` event naming code2wav."""
    assert chain.alive("code2wav"), "this test runs before test_stage_down_is_503, which kills it"
    gw = GatewayProcess(tiny_model_dir, chain.address("thinker"), chain.address("code2wav"))
    body = {"model": tiny_model_dir.name, "input": "Talk for a long while.", "voice": "ethan", "response_format": "pcm",
            "ignore_eos": True, "max_audio_frames": 400}
    started = {"pcm": threading.Event(), "sse": threading.Event()}
    outcome: dict = {}

    def pcm() -> None:
        try:
            with httpx.stream("POST", f"{gw.base_url}/v1/audio/speech", json=body, timeout=60) as r:
                for _ in r.iter_raw():
                    started["pcm"].set()
            outcome["pcm"] = "clean end"
        except httpx.RemoteProtocolError as e:
            outcome["pcm"] = e

    def sse() -> None:
        with httpx.stream("POST", f"{gw.base_url}/v1/audio/speech", json={**body, "stream_format": "sse"},
                          timeout=60) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    started["sse"].set()
            outcome["sse"] = events

    threads = [threading.Thread(target=pcm), threading.Thread(target=sse)]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(60) for e in started.values())
        chain.kill("code2wav")
        for t in threads:
            t.join(60)
    finally:
        chain.kill("code2wav")
        gw.stop()
    assert isinstance(outcome["pcm"], httpx.RemoteProtocolError), outcome["pcm"]
    assert "incomplete chunked read" in str(outcome["pcm"])
    events = outcome["sse"]
    assert events[0]["type"] == "speech.audio.delta" and events[-1]["type"] == "error"
    assert events[-1]["error"]["code"] == "service_unavailable" and "code2wav" in events[-1]["error"]["message"]
    assert not any(e["type"] == "speech.audio.done" for e in events)


def test_stage_down_is_503(strict_gateway, chain):
    """The talker cannot reach its code2wav: a clear 503 naming code2wav (the stage that is down,
    reported through the talker and the thinker), and the gateway is not ready (it cannot reach
    code2wav either). Runs last: the mid-stream test above needs the chain's code2wav alive."""
    chain.kill("code2wav")
    sdk = openai.OpenAI(base_url=f"{strict_gateway.base_url}/v1", api_key="sesame", max_retries=0)
    audio = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], modalities=["text", "audio"],
                 audio={"voice": "ethan", "format": "pcm16"}, max_tokens=2, extra_body={"max_audio_frames": 3})
    with pytest.raises(openai.APIStatusError) as e:
        sdk.chat.completions.create(**audio)
    assert e.value.status_code == 503 and "code2wav" in e.value.message
    with pytest.raises(openai.APIError, match="code2wav"):
        for _ in sdk.chat.completions.create(**audio, stream=True):
            pass
    ready = httpx.get(f"{strict_gateway.base_url}/ready")
    assert ready.status_code == 503 and ready.json()["ready"] is False


def _requests_total(gateway, route: str) -> dict[str, float]:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(rf'^voxpipe_gateway_requests_total{{route="{re.escape(route)}",status="(\d+)"}} (\S+)$', text, re.M)}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/audio/speech"])
def test_a_client_gone_before_its_answer_is_499_not_a_server_error(gateway, model, path):
    """A client that sends its whole request and closes the socket at once (the bench's `at_once`
    disconnects): the gateway sees the disconnect while reading the body -- that is the client's doing,
    counted as 499 (nginx's "client closed request"), never a 500 with a traceback."""
    body = (chat_body(model, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"})
            if path == "/v1/chat/completions" else json.dumps({"model": model, "input": "Hi.", "voice": "ethan"}))
    before = _requests_total(gateway, path)
    rounds = 10
    for _ in range(rounds):
        with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as conn:
            conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    deadline = time.monotonic() + 30
    while True:
        after = _requests_total(gateway, path)
        counted = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        if sum(counted.values()) >= rounds or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not counted.get("500"), counted
    assert sum(counted.values()) == rounds, counted
