"""Text to speech: /v1/audio/speech (and ThinkerStart.assistant_text under it) speaks `input`
verbatim -- exactly what transformers' generate makes when its thinker is forced to say `input`
-- in every OpenAI format, streamed as it is made, raw or as server-sent events. Driven by the
unmodified `openai` SDKs (Python, and Node where it applies) against real gateway and stage
processes."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import av
import httpx
import numpy as np
import openai
import pytest
import torch

from oracle import reference_generate
from conftest import install_node_package
from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.gateway.speech import MAX_INPUT_CHARS, MAX_INSTRUCTIONS_CHARS
from voxpipe.services.thinker.prompt import encode_text, render, speech_turn
from voxpipe.v1 import stages_pb2 as pb

SAMPLES_PER_FRAME, FIRST_CHUNK_SHORTFALL = 1920, 555
FRAMES = 10                                      # max_audio_frames with ignore_eos: 9 frames spoken
EXPECTED_SAMPLES = SAMPLES_PER_FRAME * (FRAMES - 1) - FIRST_CHUNK_SHORTFALL
FIXED = {"max_audio_frames": FRAMES, "ignore_eos": True, "temperature": 0}
FORMATS = ("wav", "mp3", "opus", "flac", "aac", "pcm")
# the lossy codecs' decoders also play the encoder's delay and padding (no header carries it when
# the file is streamed): at most this many extra samples at 24 kHz
CODEC_SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024}
# over the thinker's --prefill-chunk (512 tokens) as a prompt: prefilled in chunks
LONG_INPUT = " ".join(f"Sentence number {i} of a long text that is read aloud, word for word." for i in range(16))




def collect(stack, req: SpeechRequest):
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            return await pc.collect(req)
    return asyncio.run(go())


def decoded_samples(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """PyAV's decode of a whole response body: (mono samples, rate); pcm is raw int16 at 24 kHz."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0, 24000
    with av.open(io.BytesIO(data), format={"opus": "ogg", "aac": "aac"}.get(fmt, fmt)) as container:
        frames = [(f.to_ndarray().reshape(-1), f.sample_rate) for f in container.decode(audio=0)]
    samples = np.concatenate([s for s, _ in frames])
    scale = 1.0 if samples.dtype.kind == "f" else float(np.iinfo(samples.dtype).max + 1)   # integer formats
    return samples.astype(np.float32) / scale, frames[0][1]


def assert_decodes_to_the_expected_length(data: bytes, fmt: str, expected: int = EXPECTED_SAMPLES) -> None:
    samples, rate = decoded_samples(data, fmt)
    at_24k = samples.size * 24000 / rate          # opus decodes at 48 kHz
    assert expected <= at_24k <= expected + CODEC_SLACK.get(fmt, 0), (fmt, at_24k, expected)
    assert np.abs(samples).max() > 0.01, fmt      # sound, not silence


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("text,instructions,voice,max_frames,min_frames", [
    ("Hello world, this is spoken as written.", None, "ethan", 14, 6),
    ("Read <|im_end|> literally: ünïcödé, 你好 🎉", "Speak slowly, warmly.", "chelsie", 12, 12),
    ("A short input after long instructions.", LONG_INPUT, "aiden", 6, 6),
], ids=["short", "instructions-special-unicode", "long-prompt-chunked-prefill"])
def test_tts_equals_the_reference_with_its_thinker_forced_to_say_the_input(stack, client, model, tiny_model_dir,
                                                                             tokenizer, omni_config, text, instructions,
                                                                             voice, max_frames, min_frames):
    prompt = render(tokenizer, omni_config.thinker, speech_turn(text, instructions)).token_ids
    forced = encode_text(tokenizer, text) + [omni_config.thinker.tokens.im_end]
    ref = reference_generate(tiny_model_dir, prompt, speaker=voice, forced_ids=forced, max_frames=max_frames,
                             min_frames=min_frames)
    assert ref.text_ids == forced          # the reference's thinker said the input, then ended its turn
    res = collect(stack, SpeechRequest(token_ids=prompt, assistant_text=text, speaker=voice, max_frames=max_frames,
                                       min_frames=min_frames, encoding=pb.AUDIO_FLOAT32, echo_frames=True))
    assert res.text == text and res.text_ids == forced
    assert res.done.text_finish == pb.STOP and res.done.completion_tokens == len(forced)
    assert res.done.prompt_tokens == len(prompt)
    assert (len(prompt) > 512) == (instructions == LONG_INPUT)
    assert torch.equal(res.codes, ref.codes), (res.codes.shape, ref.codes.shape)
    assert res.done.frames == ref.codes.shape[0]
    assert res.audio.shape[0] == ref.wav.shape[0] == SAMPLES_PER_FRAME * ref.codes.shape[0] - FIRST_CHUNK_SHORTFALL
    assert float(np.abs(res.audio - ref.wav.numpy()).max()) < 1e-4

    if min_frames != max_frames:
        return
    # the gateway's request for the same input (ignore_eos: min = max frames) is that prompt and that reply:
    # its pcm is the reference's waveform (to pcm16 rounding)
    extra = {"instructions": instructions} if instructions else {}
    speech = client.audio.speech.create(model=model, voice=voice.capitalize(), input=text, response_format="pcm",
                                        extra_body={"max_audio_frames": max_frames, "ignore_eos": True,
                                                    "temperature": 0}, **extra)
    pcm = np.frombuffer(speech.content, dtype="<i2").astype(np.int32)
    want = (np.clip(ref.wav.numpy(), -1, 1) * 32767).round().astype(np.int32)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1


def test_sampled_speech_equals_the_reference_sampling_with_the_same_seed(stack, client, model, tiny_model_dir,
                                                                           tokenizer, omni_config):
    """Speech samples its talker (and the code predictor, inside its CUDA graph on a GPU). Each
    sampled request draws from its own generator seeded with `seed`, in the order transformers draws
    from its global one (code 0, then the predictor's 15 codes, frame by frame), so a seeded request
    equals the reference sampling with that seed -- alone, beside a greedy request and another
    sampled one in the same steps, and through /v1/audio/speech."""
    text, max_frames, min_frames = "Sampled speech is the reference's too.", 12, 12
    temperature, top_k, top_p, seed = 0.9, 50, 0.8, 11
    prompt = render(tokenizer, omni_config.thinker, speech_turn(text, None)).token_ids
    forced = encode_text(tokenizer, text) + [omni_config.thinker.tokens.im_end]
    ref = reference_generate(tiny_model_dir, prompt, forced_ids=forced, max_frames=max_frames, min_frames=min_frames,
                             talker_sampling=(temperature, top_k, top_p, seed))
    greedy = reference_generate(tiny_model_dir, prompt, forced_ids=forced, max_frames=max_frames, min_frames=min_frames)
    assert not torch.equal(ref.codes, greedy.codes)      # it did sample

    def request(**kw):
        return SpeechRequest(token_ids=prompt, assistant_text=text, max_frames=max_frames, min_frames=min_frames,
                             encoding=pb.AUDIO_FLOAT32, echo_frames=True, **kw)

    sampled = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)

    async def together():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            return await asyncio.gather(pc.collect(request(**sampled)), pc.collect(request()),
                                        pc.collect(request(**{**sampled, "seed": seed + 1})))

    alone = collect(stack, request(**sampled))
    for res, want in [(alone, ref)] + list(zip(asyncio.run(together())[:2], (ref, greedy))):
        assert torch.equal(res.codes, want.codes), (res.codes.shape, want.codes.shape)
        assert float(np.abs(res.audio - want.wav.numpy()).max()) < 1e-4
    speech = client.audio.speech.create(model=model, voice="Ethan", input=text, response_format="pcm",
                                        extra_body={"max_audio_frames": max_frames, "ignore_eos": True, **sampled})
    pcm = np.frombuffer(speech.content, dtype="<i2").astype(np.int32)
    want = (np.clip(ref.wav.numpy(), -1, 1) * 32767).round().astype(np.int32)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1


def test_a_given_reply_is_one_prefill_and_its_text_comes_back_verbatim(stack, tokenizer, omni_config):
    """Text only and through the thinker's own rendering (ThinkerStart.text): the text is the input,
    unchanged, the finish is STOP, and the thinker's rows follow the given tokens."""
    text = "  Spaces,\ttabs and\nnew lines stay; <|im_start|>user is text.  "
    res = collect(stack, SpeechRequest(text=text, assistant_text=text, audio=False))
    assert res.text == text and res.done.text_finish == pb.STOP and res.audio.size == 0
    assert res.text_ids == encode_text(tokenizer, text) + [omni_config.thinker.tokens.im_end]


def test_a_long_given_reply_streams_its_tokens_and_rows_in_order(stack, tokenizer, omni_config):
    """Raw gRPC with talker_rows: the talker prompt, then the reply's tokens in order with one row
    each (the embedding lookup the talker gets for generated tokens), the text in the first delta."""
    import grpc

    from voxpipe.services.runtime.tensors import from_proto
    from voxpipe.v1 import stages_pb2_grpc as pb_grpc

    text = LONG_INPUT[:600]
    start = pb.ThinkerStart(text="Say it.", assistant_text=text, talker_rows=True)
    with grpc.insecure_channel(stack.address("thinker")) as ch:
        responses = list(pb_grpc.ThinkerStub(ch).Generate(iter([pb.ThinkerRequest(start=start)]), timeout=60))
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[0] == "talker_prompt" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"text"}
    deltas = [r.text for r in responses[1:-1]]
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == encode_text(tokenizer, text) + [omni_config.thinker.tokens.im_end] and len(ids) > 64
    assert [d.index for d in deltas] == list(np.cumsum([0] + [len(d.token_ids) for d in deltas[:-1]]))
    assert deltas[0].text == text and all(d.text == "" for d in deltas[1:])
    # the reply goes on after every delta but the last (TextDelta.more, passed on as TextRows.more)
    assert [d.more for d in deltas] == [True] * (len(deltas) - 1) + [False]
    rows = torch.cat([from_proto(d.embeddings) for d in deltas])
    assert rows.shape == (len(ids), omni_config.thinker.text.hidden_size)
    first = {t: i for i, t in reversed(list(enumerate(ids)))}   # a token's row is the same wherever it is
    assert all(torch.equal(rows[i], rows[first[t]]) for i, t in enumerate(ids))
    done = responses[-1].finished
    assert (done.reason, done.completion_tokens) == (pb.STOP, len(ids))


def test_text_deltas_merge_only_up_to_a_bounded_message():
    """A given reply is put out whole at once: waiting deltas travel together, but rows stop merging
    at MERGED_ROWS_MAX_BYTES (a long reply on a wide model is several messages, none over the limit)."""
    from voxpipe.services.runtime.outputs import TextOut
    from voxpipe.services.thinker.server import MERGED_ROWS_MAX_BYTES, ThinkerServicer

    servicer = ThinkerServicer.__new__(ThinkerServicer)       # merge needs no engine
    n = MERGED_ROWS_MAX_BYTES // (2 * 2048 * 4) + 1             # rows of 2048 float32: a bit over half the limit

    def delta(index: int, count: int) -> TextOut:
        return TextOut(index, (7,) * count, "", torch.zeros(count, 2048))

    small = servicer.merge(delta(0, 2), delta(2, 3))
    assert small.token_ids == (7,) * 5 and small.rows.shape == (5, 2048)
    going_on = dataclasses.replace(delta(0, 2), more=True)
    assert servicer.merge(going_on, dataclasses.replace(delta(2, 3), more=True)).more       # the later one's
    assert not servicer.merge(going_on, delta(2, 3)).more
    assert servicer.merge(delta(0, n), delta(n, n)) is None


def test_say_verbatim_speaks_the_text(stack, tmp_path):
    from voxpipe.audio import read_wav

    out = tmp_path / "said.wav"
    cmd = [sys.executable, "-m", "voxpipe.cli", "say", "Exactly these words.", "--verbatim", "-o", str(out),
           "--thinker", stack.address("thinker"), "--code2wav", stack.address("code2wav"), "--max-frames", "7",
           "--ignore-eos"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "text: 'Exactly these words.'" in proc.stdout
    wav, rate = read_wav(out.read_bytes())
    assert rate == 24000 and wav.shape[0] == SAMPLES_PER_FRAME * 6 - FIRST_CHUNK_SHORTFALL
    proc = subprocess.run(cmd + ["--max-tokens", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "do not apply with --verbatim" in proc.stderr


# ----------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_decodes_to_the_spoken_length(client, model, fmt):
    speech = client.audio.speech.create(model=model, voice="aiden", input="Every format, the same words.",
                                        response_format=fmt, extra_body=FIXED)
    ctype = {"wav": "audio/wav", "mp3": "audio/mpeg", "opus": "audio/ogg", "flac": "audio/flac", "aac": "audio/aac",
             "pcm": "audio/pcm"}[fmt]
    assert speech.response.headers["content-type"].startswith(ctype)
    assert_decodes_to_the_expected_length(speech.content, fmt)
    if fmt == "wav":     # streamed: the sizes are unknown when the header leaves, as OpenAI's
        data = speech.content
        assert data[:4] == b"RIFF" and data[4:8] == b"\xff\xff\xff\xff" and data[8:12] == b"WAVE"
        assert data[36:40] == b"data" and data[40:44] == b"\xff\xff\xff\xff"
        assert len(data) == 44 + 2 * EXPECTED_SAMPLES


def test_lossless_formats_carry_the_pcm_samples(client, model):
    """wav and flac hold exactly the samples the raw pcm stream has (two runs: up to pcm16 rounding)."""
    def body(fmt: str) -> bytes:
        return client.audio.speech.create(model=model, voice="ethan", input="Lossless.", response_format=fmt,
                                          extra_body=FIXED).content
    pcm = np.frombuffer(body("pcm"), dtype="<i2").astype(np.int32)
    for fmt in ("wav", "flac"):
        samples, rate = decoded_samples(body(fmt), fmt)
        assert rate == 24000
        assert np.abs((samples * 32768).round().astype(np.int32) - pcm).max() <= 1, fmt


def test_chat_completions_serve_aac_too(client, model):
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}], max_tokens=3,
                                           modalities=["text", "audio"], audio={"voice": "ethan", "format": "aac"},
                                           extra_body={"max_audio_frames": FRAMES, "ignore_eos": True,
                                                       "temperature": 0})
    assert_decodes_to_the_expected_length(base64.b64decode(reply.choices[0].message.audio.data), "aac")


# ----------------------------------------------------------------------------- streamed as it is made


def talker_streams(stack, outcome: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports['talker']}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        name, _, rest = line.partition("{")
        labels, _, value = rest.partition("} ")
        if name == "voxpipe_streams_total" and set(labels.split(",")) == {'stage="talker"', f'outcome="{outcome}"'}:
            return float(value)
    return 0.0


@pytest.mark.parametrize("fmt,stream_format", [(f, "audio") for f in FORMATS] + [("mp3", "sse"), ("wav", "sse")])
def test_the_first_bytes_leave_before_the_last_frame_is_made(stack, client, model, fmt, stream_format):
    """Proof by order of events, not by timing: the client reads the body's first bytes, then hangs
    up; the talker then ends its stream cancelled -- it had not made its last frame when those
    bytes arrived (a reply encoded at the end would have let the talker finish: 3999 frames)."""
    before = {o: talker_streams(stack, o) for o in ("cancelled", "length", "stop")}
    with client.audio.speech.with_streaming_response.create(
            model=model, voice="ethan", input=LONG_INPUT, response_format=fmt, stream_format=stream_format,
            extra_body={"max_audio_frames": 4000, "ignore_eos": True}, timeout=120) as resp:
        first = next(resp.iter_bytes())
    assert first
    if stream_format == "sse":
        assert first.startswith(b"data: {\"type\":\"speech.audio.delta\"")
    deadline = time.monotonic() + 30
    while talker_streams(stack, "cancelled") == before["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert talker_streams(stack, "cancelled") == before["cancelled"] + 1
    assert all(talker_streams(stack, o) == before[o] for o in ("length", "stop"))


# ----------------------------------------------------------------------------- server-sent events


def sse_events(resp) -> list[dict]:
    return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]


@pytest.mark.parametrize("fmt", ["wav", "opus", "pcm"])
def test_sse_deltas_carry_the_file_and_done_the_usage(client, model, tokenizer, omni_config, fmt):
    text = "Server-sent speech."
    with client.audio.speech.with_streaming_response.create(model=model, voice="chelsie", input=text,
                                                             response_format=fmt, stream_format="sse",
                                                             extra_body=FIXED) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    deltas, done = events[:-1], events[-1]
    assert len(deltas) >= 2 and all(set(e) == {"type", "audio"} and e["type"] == "speech.audio.delta" for e in deltas)
    assert set(done) == {"type", "usage"} and done["type"] == "speech.audio.done"
    prompt = render(tokenizer, omni_config.thinker, speech_turn(text, None)).token_ids
    given = len(prompt) + len(encode_text(tokenizer, text)) + 1
    assert done["usage"] == {"input_tokens": given, "output_tokens": FRAMES - 1, "total_tokens": given + FRAMES - 1}
    assert_decodes_to_the_expected_length(b"".join(base64.b64decode(e["audio"]) for e in deltas), fmt)


# ----------------------------------------------------------------------------- bad inputs


def post(gateway, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(f"{gateway.base_url}/v1/audio/speech", content=content,
                      headers={"content-type": "application/json"}, timeout=60)


BAD = [
    ({"input": None}, "input", r"missing required parameter: 'input'"),
    ({"input": 5}, "input", r"'input' must be a string"),
    ({"input": ""}, "input", rf"'input' must be 1 to {MAX_INPUT_CHARS} characters"),
    ({"input": " \n\t"}, "input", r"not blank"),
    ({"input": "x" * (MAX_INPUT_CHARS + 1)}, "input", rf"1 to {MAX_INPUT_CHARS} characters"),
    ({"instructions": ["loud"]}, "instructions", r"'instructions' must be a string"),
    ({"instructions": "   "}, "instructions", r"not blank"),
    ({"instructions": "y" * (MAX_INSTRUCTIONS_CHARS + 1)}, "instructions", rf"1 to {MAX_INSTRUCTIONS_CHARS}"),
    ({"response_format": "ogg"}, "response_format", r"one of mp3, opus, aac, flac, wav, pcm, got 'ogg'"),
    ({"response_format": 3}, "response_format", r"must be a string"),
    ({"stream_format": "json"}, "stream_format", r"'audio' or 'sse', got 'json'"),
    ({"stream_format": True}, "stream_format", r"must be a string"),
    ({"speed": 1.5}, "speed", r"only 'speed' 1.0"),
    ({"voice": "alloy"}, "voice", r"unknown voice 'alloy'; valid voices: aiden, chelsie, ethan"),
    ({"voice": {"name": "ethan"}}, "voice", r"must be a voice name"),
    ({"max_tokens": 5}, "max_tokens", r"'max_tokens' does not apply to speech"),
    ({"max_completion_tokens": 5}, "max_completion_tokens", r"does not apply to speech"),
    ({"min_tokens": 1}, "min_tokens", r"does not apply to speech"),
    ({"n": 2}, "n", r"unrecognized request argument supplied: 'n'"),
    ({"stop": "."}, "stop", r"unrecognized request argument supplied: 'stop'"),
    ({"speeed": 1.0}, "speeed", r"unrecognized request argument"),
    ({"max_audio_frames": 0}, "max_audio_frames", r"from 1 to 4294967295"),
    ({"temperature": 3}, "temperature", r"between 0 and 2"),
]


@pytest.mark.parametrize("override,param,pattern", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_speech_input_is_400_naming_the_parameter(gateway, model, override, param, pattern):
    body = {"model": model, "input": "Hello.", "voice": "ethan", **override}
    body = {k: v for k, v in body.items() if v is not None}
    resp = post(gateway, body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and re.search(pattern, err["message"]), err


def test_bad_speech_input_through_the_sdk(client, model):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=model, voice="ethan", input="Hi.", response_format="wav",
                                   extra_body={"max_tokens": 3})
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model=model, voice="ethan", input="Hi.", stream_format="ndjson")  # type: ignore
    assert e.value.body["param"] == "stream_format"


def test_the_longest_input_and_instructions_fit_the_thinkers_context(tokenizer, omni_config):
    """The gateway's own limits keep a speech request within the thinker's context (65,536 tokens on
    the tiny checkpoint, as on the released model): the longest input and instructions render to
    fewer tokens, so no speech request is refused there after the gateway accepted it (the thinker's
    own check of a given reply is in test_bad_inputs.py)."""
    from voxpipe.services.thinker.prompt import encode_text, render, speech_turn

    instructions, text = "\U0001F601" * MAX_INSTRUCTIONS_CHARS, "\U0001F600" * MAX_INPUT_CHARS
    prompt = render(tokenizer, omni_config.thinker, speech_turn(text, instructions)).token_ids
    reply = encode_text(tokenizer, text)
    assert len(prompt) + len(reply) + 1 < omni_config.thinker.text.max_position_embeddings


# ----------------------------------------------------------------------------- the Node SDK


@pytest.fixture(scope="module")
def node_speech(tmp_path_factory) -> Path:
    return install_node_package(tmp_path_factory, "node_speech", "speech.mjs")


def node(node_speech: Path, gateway, model: str, fmt: str, stream_format: str) -> dict:
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "OPENAI_API_KEY": "unused"}
    proc = subprocess.run(["node", "speech.mjs", f"{gateway.base_url}/v1", model, "Spoken from Node.", fmt,
                           stream_format, str(FRAMES)], cwd=node_speech, capture_output=True, text=True, timeout=120,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3"])
def test_node_sdk_speech_streams_the_file(node_speech, gateway, model, fmt):
    out = node(node_speech, gateway, model, fmt, "audio")
    assert out["content_type"].startswith({"wav": "audio/wav", "flac": "audio/flac", "mp3": "audio/mpeg"}[fmt])
    assert out["chunks"] >= 2
    assert_decodes_to_the_expected_length(base64.b64decode(out["body"]), fmt)


def test_node_sdk_speech_sse(node_speech, gateway, model):
    out = node(node_speech, gateway, model, "wav", "sse")
    types = [e["type"] for e in out["events"]]
    assert types[-1] == "speech.audio.done" and set(types[:-1]) == {"speech.audio.delta"} and len(types) >= 3
    assert out["events"][-1]["usage"]["output_tokens"] == FRAMES - 1
    assert_decodes_to_the_expected_length(base64.b64decode(out["body"]), "wav")
