"""The gateway's gRPC pipeline API, voxpipe.v1.Gateway/Converse, on a real gateway process
(--grpc-port) in front of the session's three stage processes; and a Node.js client of it."""

from __future__ import annotations

import asyncio
import io
import json
import queue
import re
import socket
import subprocess
import time
import urllib.request
import wave
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import STAGES, GatewayProcess, free_port, install_node_package
from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc
from voxpipe.v1 import stages_pb2 as pb

ROOT = Path(__file__).resolve().parent.parent
TEXT = "Hello there, how are you?"


@pytest.fixture(scope="module")
def converse_gateway(stack, tiny_model_dir):
    """`voxpipe gateway --grpc-port M` as a process in front of `stack`; yields the Converse address."""
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"), "--grpc-port", str(grpc_port),
                             "--reflection")
    yield f"127.0.0.1:{grpc_port}"
    process.stop()


@pytest.fixture(scope="module")
def channel(converse_gateway):
    with grpc.insecure_channel(converse_gateway) as ch:
        grpc.channel_ready_future(ch).result(timeout=30)
        yield ch


def start(**kw) -> gw.ConverseRequest:
    kw.setdefault("sampling", pb.Sampling(temperature=0.0))
    return gw.ConverseRequest(start=gw.ConverseStart(**kw))


def converse(channel, *requests: gw.ConverseRequest, timeout: float = 120) -> list[gw.ConverseResponse]:
    return list(gw_grpc.GatewayStub(channel).Converse(iter(requests), timeout=timeout))


def split(responses):
    kinds = [r.WhichOneof("kind") for r in responses]
    text = [r.text for r in responses if r.WhichOneof("kind") == "text"]
    audio = [r.audio for r in responses if r.WhichOneof("kind") == "audio"]
    assert kinds[-1] == "done" and kinds.count("done") == 1, kinds
    return text, audio, responses[-1].done


def check_audio_chunks(audio: list[pb.AudioChunk], encoding: int) -> int:
    """Contiguous offsets, 24 kHz, sample counts matching the bytes; returns the total samples."""
    width = 4 if encoding == pb.AUDIO_FLOAT32 else 2
    offset = 0
    for chunk in audio:
        assert chunk.sample_rate == 24000 and chunk.encoding == encoding
        assert chunk.sample_offset == offset and chunk.num_samples == len(chunk.data) // width > 0
        offset += chunk.num_samples
    return offset


def pipeline_reference(stack, **kw):
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
            return await client.collect(SpeechRequest(**kw))
    return asyncio.run(go())


def stage_metric(stack, stage: str, prefix: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read()
    for line in body.decode().splitlines():
        if line.startswith(prefix):
            return float(line.split()[-1])
    return 0.0


def active_streams(stack) -> dict[str, float]:
    return {s: stage_metric(stack, s, f'voxpipe_active_streams{{stage="{s}"}}') for s in STAGES}


def cancelled_streams(stack) -> dict[str, float]:
    return {s: stage_metric(stack, s, f'voxpipe_streams_total{{outcome="cancelled",stage="{s}"}}') for s in STAGES}


def wait_all_free(stack, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        active = active_streams(stack)
        if all(v == 0 for v in active.values()) or time.monotonic() > deadline:
            return active
        time.sleep(0.05)


def wait_kv_free(stack, timeout: float = 10.0) -> dict[str, float]:
    """The KV blocks the thinker and the talker say their running sequences hold, once 0 (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        used = {s: stage_metric(stack, s, f'voxpipe_kv_blocks{{stage="{s}",state="used"}}') for s in ("thinker", "talker")}
        if all(v == 0 for v in used.values()) or time.monotonic() > deadline:
            return used
        time.sleep(0.05)


def tone(seconds: float, rate: int) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.4 * np.sin(2 * np.pi * 440 * t) * np.exp(-t)).astype(np.float32)


def pcm16_bytes(x: np.ndarray) -> bytes:
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


def wav_file(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm16_bytes(x))
    return buf.getvalue()


# ----------------------------------------------------------------------------- text in, text + audio out

def test_text_in_text_and_audio_out_equals_the_pipeline(channel, stack):
    responses = converse(channel, start(text=TEXT, voice="chelsie", max_tokens=6, max_frames=9, ignore_eos=True,
                                        request_id="converse-1"))
    text, audio, done = split(responses)
    frames = 8                                          # ignore_eos: max_frames - 1 frames spoken
    assert sum(len(t.token_ids) for t in text) == 6
    # index = the position of a delta's first token (consecutive deltas may travel as one)
    assert [t.index for t in text] == [sum(len(u.token_ids) for u in text[:k]) for k in range(len(text))]
    assert check_audio_chunks(audio, pb.AUDIO_PCM16) == 1920 * frames - 555
    assert done.request_id == "converse-1"
    assert done.text_finish == pb.LENGTH and done.audio_finish == pb.LENGTH
    assert done.usage.completion_tokens == 6 and done.usage.audio_frames == frames
    assert done.usage.audio_samples == 1920 * frames - 555 and done.usage.prompt_tokens > 0

    # the same turn straight through the pipeline client: same tokens, same pcm16 bytes
    ref = pipeline_reference(stack, text=TEXT, speaker="chelsie", max_tokens=6, min_tokens=6, max_frames=9,
                             min_frames=9, encoding=pb.AUDIO_PCM16)
    assert [i for t in text for i in t.token_ids] == ref.text_ids
    assert "".join(t.text for t in text) == ref.text
    ref_pcm = (np.clip(ref.audio, -1, 1) * 32767).round().astype("<i2")
    got_pcm = np.frombuffer(b"".join(a.data for a in audio), dtype="<i2")
    assert got_pcm.shape == ref_pcm.shape and np.abs(got_pcm.astype(int) - ref_pcm).max() <= 1


def test_stop_and_logprobs(channel, stack, tokenizer):
    """ConverseStart.stop ends text and speech (greedy: the text without stop, cut before the stop
    string; the audio equals the run that ends by length one token after the last spoken one);
    logprobs come with each text output, one per token."""
    full = converse(channel, start(text=TEXT, max_tokens=12, output_modalities=[gw.MODALITY_TEXT], logprobs=True,
                                   top_logprobs=3))
    text, _, done = split(full)
    tokens = [i for t in text for i in t.token_ids]
    entries = [e for t in text for e in t.logprobs]
    assert [e.token_id for e in entries] == tokens and all(len(e.top) == 3 for e in entries)
    assert all(e.top[0].logprob == e.logprob for e in entries)            # greedy: the top token was chosen
    ref = pipeline_reference(stack, text=TEXT, audio=False, max_tokens=12)
    assert tokens == ref.text_ids
    from voxpipe.services.thinker.output import IncrementalDetokenizer
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in tokens]
    whole = "".join(pieces)
    m = next(m for m in range(1, len(pieces) - 1) if len(pieces[m]) >= 2 and pieces[m + 1] and pieces[m - 1]
             and "\ufffd" not in pieces[m][-1] + pieces[m + 1][0]
             and whole.find(pieces[m][-1] + pieces[m + 1][0]) == len("".join(pieces[:m + 1])) - 1)
    stop, at = pieces[m][-1] + pieces[m + 1][0], len("".join(pieces[:m + 1])) - 1
    text, audio, done = split(converse(channel, start(text=TEXT, max_tokens=12, max_frames=30, stop=[stop])))
    assert "".join(t.text for t in text) == whole[:at] and done.text_finish == pb.STOP
    _, ref_audio, ref_done = split(converse(channel, start(text=TEXT, max_tokens=m + 1, max_frames=30)))
    got, want = (np.frombuffer(b"".join(a.data for a in x), dtype="<i2").astype(int) for x in (audio, ref_audio))
    assert got.shape == want.shape and got.size > 0 and np.abs(got - want).max() <= 1
    assert done.usage.audio_frames == ref_done.usage.audio_frames


def test_float32_audio_and_text_only_modality(channel):
    _, audio, done = split(converse(channel, start(text=TEXT, max_tokens=4, max_frames=6, ignore_eos=True,
                                                   audio_encoding=pb.AUDIO_FLOAT32)))
    assert check_audio_chunks(audio, pb.AUDIO_FLOAT32) == 1920 * 5 - 555
    samples = np.frombuffer(b"".join(a.data for a in audio), dtype="<f4")
    assert np.isfinite(samples).all() and np.abs(samples).max() <= 1.0 and np.abs(samples).max() > 0

    text, audio, done = split(converse(channel, start(text=TEXT, max_tokens=5, ignore_eos=True,
                                                      output_modalities=[gw.MODALITY_TEXT])))
    assert not audio and sum(len(t.token_ids) for t in text) == 5
    assert done.audio_finish == pb.FINISH_REASON_UNSPECIFIED and done.usage.audio_samples == 0


# ----------------------------------------------------------------------------- audio in

def test_audio_in_as_pcm16_or_wav_is_the_same_prompt(channel):
    clip = tone(1.2, 24000)
    as_pcm = gw.AudioInput(pcm16=gw.Pcm16Audio(data=pcm16_bytes(clip), sample_rate=24000))
    as_wav = gw.AudioInput(wav=wav_file(clip, 24000))
    results = []
    for audio_in in (as_pcm, as_wav):
        text, audio, done = split(converse(channel, start(audio=[audio_in], text="What is this sound?",
                                                          max_tokens=4, max_frames=6, ignore_eos=True)))
        results.append(([i for t in text for i in t.token_ids], done.usage.prompt_tokens))
        assert check_audio_chunks(audio, pb.AUDIO_PCM16) == 1920 * 5 - 555
    text_only = split(converse(channel, start(text="What is this sound?", max_tokens=1,
                                              output_modalities=[gw.MODALITY_TEXT])))[2]
    assert results[0] == results[1]
    assert results[0][1] > text_only.usage.prompt_tokens + 10      # the clip's audio placeholders

    # audio alone (no text) is a valid turn
    text, _, done = split(converse(channel, start(audio=[as_pcm], max_tokens=3, ignore_eos=True,
                                                  output_modalities=[gw.MODALITY_TEXT])))
    assert done.usage.completion_tokens == 3


# ----------------------------------------------------------------------------- cancel

def error_streams(stack) -> dict[str, float]:
    return {s: stage_metric(stack, s, f'voxpipe_streams_total{{outcome="error",stage="{s}"}}') for s in STAGES}


def long_turn() -> gw.ConverseRequest:
    """A turn that is still speaking when the tests cancel it (200 frames forced)."""
    return start(text=TEXT, max_tokens=8, max_frames=200, ignore_eos=True)


def test_cancel_message_ends_the_turn_and_frees_every_stage(channel, stack):
    """Cancel at the first text delta (the talker and code2wav streams may still be opening) and at
    the first audio chunk (every stage holds the request), 20 turns in all: each turn ends CANCELLED,
    every stage frees it, no stage counts an error, and a stage that produced output counts the
    stream as cancelled."""
    errors = error_streams(stack)
    for turn in range(20):
        at_audio = turn % 2 == 1
        before = cancelled_streams(stack)
        requests: queue.Queue = queue.Queue()
        requests.put(long_turn())

        def request_stream():
            while (item := requests.get()) is not None:
                yield item

        got = []
        for resp in gw_grpc.GatewayStub(channel).Converse(request_stream(), timeout=120):
            got.append(resp)
            kinds = [r.WhichOneof("kind") for r in got]
            if kinds.count("audio" if at_audio else "text") == 1 and kinds[-1] == ("audio" if at_audio else "text"):
                requests.put(gw.ConverseRequest(cancel=pb.Cancel()))
                requests.put(None)
        text, audio, done = split(got)
        assert done.text_finish in (pb.CANCELLED, pb.LENGTH) and done.audio_finish == pb.CANCELLED, (turn, done)
        assert check_audio_chunks(audio, pb.AUDIO_PCM16) < 1920 * 199 - 555
        assert wait_all_free(stack) == {s: 0 for s in STAGES}, turn
        # the talker's gauge stayed at the cancelled stream's blocks until its next step
        assert wait_kv_free(stack) == {"thinker": 0, "talker": 0}, turn
        after = cancelled_streams(stack)
        if at_audio:
            assert after["talker"] == before["talker"] + 1 and after["code2wav"] == before["code2wav"] + 1, \
                (turn, before, after)
        else:
            assert all(before[s] <= after[s] <= before[s] + 1 for s in STAGES), (turn, before, after)
    assert error_streams(stack) == errors


def test_done_after_a_cancel_carries_the_whole_usage(channel, omni_config):
    """A turn cancelled once audio flows ends with a Done whose usage has the prompt's tokens (as
    the uncancelled turn reports them), the text tokens and audio samples sent, and the frames of
    that audio."""
    whole = split(converse(channel, start(text=TEXT, max_tokens=2, max_frames=3)))[2]
    requests: queue.Queue = queue.Queue()
    requests.put(long_turn())

    def request_stream():
        while (item := requests.get()) is not None:
            yield item

    got = []
    for resp in gw_grpc.GatewayStub(channel).Converse(request_stream(), timeout=120):
        got.append(resp)
        if [r.WhichOneof("kind") for r in got].count("audio") == 2 and resp.WhichOneof("kind") == "audio":
            requests.put(gw.ConverseRequest(cancel=pb.Cancel()))
            requests.put(None)
    text, audio, done = split(got)
    assert done.audio_finish == pb.CANCELLED
    usage = done.usage
    samples = sum(a.num_samples for a in audio)
    assert usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert usage.completion_tokens == sum(len(t.token_ids) for t in text) > 0
    assert usage.audio_samples == samples > 0
    per_frame = omni_config.code2wav.samples_per_frame
    assert usage.audio_frames == -(-samples // per_frame) >= 2


def test_client_cancelling_the_call_frees_every_stage(channel, stack):
    errors = error_streams(stack)
    for turn in range(6):
        before = cancelled_streams(stack)
        call = gw_grpc.GatewayStub(channel).Converse(iter([long_turn()]), timeout=120)
        for resp in call:
            if resp.WhichOneof("kind") == ("audio" if turn % 2 else "text"):
                break
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(call)
        assert err.value.code() == grpc.StatusCode.CANCELLED
        assert wait_all_free(stack) == {s: 0 for s in STAGES}, turn
        after = cancelled_streams(stack)
        if turn % 2:
            assert after["talker"] == before["talker"] + 1 and after["code2wav"] == before["code2wav"] + 1, \
                (turn, before, after)
    assert error_streams(stack) == errors
    # and the gateway still serves
    assert split(converse(channel, start(text=TEXT, max_tokens=2, output_modalities=[gw.MODALITY_TEXT])))[2]


# ----------------------------------------------------------------------------- bad input

BAD = [
    ([], "the first message must be start"),
    ([gw.ConverseRequest(cancel=pb.Cancel())], "the first message must be start"),
    ([start()], "the turn is empty"),
    ([start(text="hi", voice="nobody")], "unknown voice 'nobody'"),
    ([start(audio=[gw.AudioInput(pcm16=gw.Pcm16Audio(data=b"\x01\x02\x03", sample_rate=16000))])],
     "odd number of bytes"),
    ([start(audio=[gw.AudioInput(pcm16=gw.Pcm16Audio(data=b"\x01\x02", sample_rate=0))])], "sample_rate"),
    ([start(audio=[gw.AudioInput(wav=b"RIFF this is not a wav file")])], "audio[0].wav"),
    ([start(audio=[gw.AudioInput()])], "audio[0] needs pcm16 or wav"),
    ([start(text="hi", ignore_eos=True)], "ignore_eos needs max_tokens"),
    ([start(text="hi", output_modalities=[gw.MODALITY_UNSPECIFIED])], "output_modalities"),
    ([start(text="hi", audio_encoding=7)], "audio_encoding"),
    ([start(text="hi", sampling=pb.Sampling(temperature=5.0))], "temperature"),
    ([start(text="hi", max_tokens=2, min_tokens=3)], "min_tokens 3 > max_tokens 2"),
    ([start(text="hi", max_tokens=2), start(text="again")], "unexpected start after start"),
    ([start(audio=[gw.AudioInput(wav=wav_file(np.zeros(3000, np.float32), 1))])],
     "audio[0].wav: the audio's sample rate must be 1000 to 384000 Hz, got 1"),
    ([start(audio=[gw.AudioInput(pcm16=gw.Pcm16Audio(data=bytes(2 * 1000 * 601), sample_rate=1000))])],
     "audio[0].pcm16: the audio is 601 s long; the limit is 600 s"),
    ([start(text="x" * 200_001, output_modalities=[gw.MODALITY_TEXT])], "the limit is 200000"),
    ([start(text="hi", stop=["a", "b", "c", "d", "e"])], "stop: at most 4 stop strings, got 5"),
    ([start(text="hi", stop=["a", ""])], "stop: stop string 1 is empty"),
    ([start(text="hi", stop=["y" * 257])], "stop: stop string 0 has 257 characters; the limit is 256"),
    ([start(text="hi", logprobs=True, top_logprobs=21)], "top_logprobs must be from 0 to 20, got 21"),
    ([start(text="hi", top_logprobs=2)], "top_logprobs needs logprobs"),
]


@pytest.mark.parametrize("requests,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_is_invalid_argument(channel, requests, message):
    with pytest.raises(grpc.RpcError) as err:
        converse(channel, *requests)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details()


def test_a_long_value_is_quoted_cut_short(channel):
    """A 10,000-character voice is INVALID_ARGUMENT quoting its start (whole, it would pass gRPC's
    metadata limit: the client would get RESOURCE_EXHAUSTED)."""
    with pytest.raises(grpc.RpcError) as err:
        converse(channel, start(text="hi", voice="v" * 10_000))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details() == f"unknown voice '{'v' * 63}... (10002 characters); valid voices: aiden, chelsie, ethan"


def test_garbage_request_bytes_are_invalid_argument(channel):
    raw = channel.stream_stream("/voxpipe.v1.Gateway/Converse", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff\xff not a protobuf message"]), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request message 1 is not a valid voxpipe.v1.ConverseRequest" in err.value.details()


def test_converse_listens_on_the_host_only(converse_gateway):
    port = int(converse_gateway.rsplit(":", 1)[1])
    with pytest.raises(ConnectionRefusedError):     # --host 127.0.0.1: not on another loopback address
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


def test_a_stage_refusal_is_its_status_with_the_stage_named(channel):
    # the thinker's context is 65,536 tokens (the tiny model's): a longer max_tokens is its OUT_OF_RANGE
    with pytest.raises(grpc.RpcError) as err:
        converse(channel, start(text="hi", max_tokens=100000))
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert err.value.details().startswith("thinker: ") and "exceeds the context" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        converse(channel, start(text="hi", max_frames=2**32 - 1))      # in range: the talker's own refusal
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert err.value.details().startswith("talker: ") and "exceed the talker context" in err.value.details()


def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "voxpipe.v1.Gateway"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [resp] = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"voxpipe.v1.Gateway", "grpc.health.v1.Health"} <= names


# ----------------------------------------------------------------------------- API key, sessions, reflection off

@pytest.fixture(scope="module")
def keyed_gateway(stack, tiny_model_dir):
    """--api-key, --max-sessions 4, no reflection; yields (the gateway process, the Converse address)."""
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"), "--grpc-port", str(grpc_port),
                             "--api-key", "sesame", "--max-sessions", "4", "--no-reflection")
    yield process, f"127.0.0.1:{grpc_port}"
    process.stop()


KEY = (("authorization", "Bearer sesame"),)


def test_converse_needs_the_api_key(keyed_gateway):
    _, address = keyed_gateway
    turn = start(text=TEXT, max_tokens=2, output_modalities=[gw.MODALITY_TEXT])
    with grpc.insecure_channel(address) as ch:
        stub = gw_grpc.GatewayStub(ch)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", "sesame"),)):
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Converse(iter([turn]), metadata=metadata, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()
            assert "API key" in err.value.details()
        assert split(list(stub.Converse(iter([turn]), metadata=KEY, timeout=60)))[2].usage.completion_tokens == 2
        health = health_pb2_grpc.HealthStub(ch)     # probes need no key
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                 timeout=5))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def gateway_sessions(process) -> dict[str, float]:
    text = httpx.get(f"{process.base_url}/metrics", headers={"Authorization": "Bearer sesame"}, timeout=5).text
    return {api: float(v) for api, v in re.findall(r'^voxpipe_gateway_sessions\{api="(\w+)"\} (\S+)$', text, re.M)}


def test_cancel_and_channel_drop_free_the_session_slots(keyed_gateway, stack):
    """20 Converse calls that send Cancel once output flows and drop their channel, with
    --max-sessions 4: every slot comes back (the gauge returns to 0) and chat requests are served."""
    process, address = keyed_gateway
    for i in range(20):
        requests: queue.Queue = queue.Queue()
        requests.put(start(text=TEXT, max_tokens=8, max_frames=12, ignore_eos=True))

        def request_stream():
            while (item := requests.get()) is not None:
                yield item

        ch = grpc.insecure_channel(address)
        call = gw_grpc.GatewayStub(ch).Converse(request_stream(), metadata=KEY, timeout=60)
        if i % 2:
            next(call)                          # cancel once output flows; otherwise right after start
        requests.put(gw.ConverseRequest(cancel=pb.Cancel()))
        ch.close()                              # the request iterator is left hanging: a dropped client
    deadline = time.monotonic() + 10
    while any(gateway_sessions(process).values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway_sessions(process) == {"http": 0, "realtime": 0, "converse": 0}
    key = {"Authorization": "Bearer sesame"}
    model = httpx.get(f"{process.base_url}/v1/models", headers=key, timeout=5).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    statuses = [httpx.post(f"{process.base_url}/v1/chat/completions", json=body, headers=key,
                           timeout=60).status_code for _ in range(5)]
    assert statuses == [200] * 5
    assert wait_all_free(stack) == {s: 0 for s in STAGES}


def test_cancel_after_done_then_cancelling_the_call_keeps_no_slot(keyed_gateway, stack):
    """The worst timing for the slot: Cancel, read on until Done, then cancel the call while the
    gateway winds the turn down; 20 such calls, 2 at a time, with --max-sessions 4. Every slot
    comes back, and 4 calls at once are admitted after."""
    process, address = keyed_gateway

    async def one(stub) -> None:
        call = stub.Converse(metadata=KEY, timeout=60)
        await call.write(start(text="a story", max_tokens=60, max_frames=200))
        for _ in range(3):
            assert (await call.read()).WhichOneof("kind") in ("text", "audio")
        await call.write(gw.ConverseRequest(cancel=pb.Cancel()))
        while (msg := await call.read()) is not grpc.aio.EOF and msg.WhichOneof("kind") != "done":
            pass
        assert msg is not grpc.aio.EOF
        call.cancel()

    async def go() -> list:
        async with grpc.aio.insecure_channel(address) as ch:
            stub = gw_grpc.GatewayStub(ch)
            for round_ in range(10):
                await asyncio.gather(one(stub), one(stub))
                deadline = time.monotonic() + 10        # the turns wind down in every stage first
                while any(gateway_sessions(process).values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                assert gateway_sessions(process) == {"http": 0, "realtime": 0, "converse": 0}, round_
            turn = start(text=TEXT, max_tokens=2, output_modalities=[gw.MODALITY_TEXT])
            return await asyncio.gather(*[whole(stub.Converse(iter([turn]), metadata=KEY, timeout=60))
                                          for _ in range(4)])

    async def whole(call) -> list[gw.ConverseResponse]:
        return [msg async for msg in call]

    for responses in asyncio.run(go()):
        assert split(responses)[2].usage.completion_tokens == 2
    assert wait_all_free(stack) == {s: 0 for s in STAGES}


# ----------------------------------------------------------------------------- a Node.js client

@pytest.fixture(scope="module")
def node_client(tmp_path_factory) -> Path:
    return install_node_package(tmp_path_factory, "node", "converse.js")


def test_node_client_converses(converse_gateway, node_client):
    max_frames = 9
    proc = subprocess.run(["node", "converse.js", converse_gateway, "--text", TEXT, "--voice", "aiden",
                           "--max-tokens", "5", "--max-frames", str(max_frames), "--proto-root", str(ROOT / "proto")],
                          cwd=node_client, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    frames = summary["usage"]["audio_frames"]
    assert 1 <= frames <= max_frames - 1
    assert summary["audio_samples"] == 1920 * frames - 555 == int(summary["usage"]["audio_samples"])
    assert summary["sample_rate"] == 24000 and summary["chunks"] >= 1 and summary["first_offsets_ok"]
    assert summary["token_count"] >= 1 and summary["text_finish"] in ("STOP", "LENGTH")
    assert summary["audio_finish"] in ("STOP", "LENGTH") and summary["request_id"]


def test_node_client_reports_invalid_argument(converse_gateway, node_client):
    proc = subprocess.run(["node", "converse.js", converse_gateway, "--voice", "nobody",
                           "--proto-root", str(ROOT / "proto")],
                          cwd=node_client, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "INVALID_ARGUMENT" in proc.stderr and "unknown voice 'nobody'" in proc.stderr
