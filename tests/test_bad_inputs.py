"""Bad requests against the three real stage processes (raw gRPC stubs): each gets a clear status whose
details name the problem, and afterwards the stage is still SERVING, its active-stream gauge is back to
0 and a small real request succeeds."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from voxpipe.services.runtime.calls import context_exceeded
from voxpipe.services.runtime.tensors import split_message, to_proto
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

# the tiny checkpoint (checked against the config in test_the_tiny_numbers)
HIDDEN = 64          # thinker hidden size = talker rows width
VOCAB = 448
MEL = 128
GROUPS = 16
CODEBOOK = 2048
IM_START, IM_END, USER, ASSISTANT = 388, 389, 268, 272
AUDIO_PAD, IMAGE_PAD, VIDEO_PAD = 392, 393, 394
NL = 198             # any ordinary token
SERVER_MAX_MESSAGE = 64 * 1024 * 1024
THINKER_CONTEXT = TALKER_CONTEXT = 65536   # the tiny model's max_position_embeddings (each stage's default)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 256 * 1024 * 1024),
                   ("grpc.max_receive_message_length", 256 * 1024 * 1024)]
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PAST_CONTEXT = grpc.StatusCode.OUT_OF_RANGE        # a request longer than the stage's context

STUBS = {"thinker": (pb_grpc.ThinkerStub, "Generate"), "talker": (pb_grpc.TalkerStub, "Generate"),
         "code2wav": (pb_grpc.Code2WavStub, "Decode")}
SERVICE = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}


def test_the_tiny_numbers(omni_config, stack):
    c = omni_config
    assert (c.thinker.text.hidden_size, c.thinker.text.vocab_size, c.thinker.audio.num_mel_bins) == (HIDDEN, VOCAB, MEL)
    assert (c.talker.thinker_hidden_size, c.talker.num_code_groups, c.code2wav.codebook_size) == (HIDDEN, GROUPS, CODEBOOK)
    t = c.thinker.tokens
    assert (t.im_start, t.im_end, t.user, t.assistant) == (IM_START, IM_END, USER, ASSISTANT)
    assert (t.audio_token, t.image_token, t.video_token) == (AUDIO_PAD, IMAGE_PAD, VIDEO_PAD)
    assert sorted(c.talker.speakers) == ["aiden", "chelsie", "ethan"]


# ---------------------------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def channels(stack):
    chans = {s: grpc.insecure_channel(stack.address(s), options=CHANNEL_OPTIONS) for s in STUBS}
    yield chans
    for c in chans.values():
        c.close()


def call(channels, stage: str, messages: list, timeout: float = 60.0) -> tuple[list, grpc.RpcError | None]:
    stub_cls, method = STUBS[stage]
    responses = []
    try:
        for r in getattr(stub_cls(channels[stage]), method)(iter(messages), timeout=timeout):
            responses.append(r)
    except grpc.RpcError as e:
        return responses, e
    return responses, None


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rows(n: int, width: int = HIDDEN, seed: int = 0, dtype=torch.float32) -> pb.Tensor:
    return to_proto(torch.randn(n, width, generator=gen(seed)).to(dtype))


def prompt_ids(n_text: int = 4) -> list[int]:
    return [IM_START, USER] + [NL + i for i in range(n_text)] + [IM_END, IM_START, ASSISTANT, NL]


def thinker_start(**kw) -> pb.ThinkerRequest:
    kw.setdefault("token_ids", pb.TokenIds(ids=prompt_ids()))
    return pb.ThinkerRequest(start=pb.ThinkerStart(**kw))


def talker_prompt(users: int = 5, **override) -> pb.TalkerPrompt:
    p = pb.TalkerPrompt(user_rows=rows(users, seed=1), user_mm_mask=to_proto(torch.zeros(users, dtype=torch.bool)),
                        user_token_ids=to_proto(torch.arange(users, dtype=torch.int64)),
                        assistant_head=rows(3, seed=2), assistant_prefix=rows(0), tts_special=rows(3, seed=3))
    for k, v in override.items():
        if v is None:
            p.ClearField(k)
        else:
            getattr(p, k).CopyFrom(v)
    return p


def audio_prompt(audio_rows: pb.Tensor | None | bool = True, keys: list[bytes] | None = None,
                 follow: bool = False) -> pb.TalkerPrompt:
    """A talker prompt of 5 user rows as token ids, rows 1 and 2 multimodal (one run): their rows in
    audio_rows (`audio_rows`: True, a tensor, or None for none), one key each run unless `keys`."""
    p = talker_prompt(user_rows=None, user_mm_mask=to_proto(torch.tensor([False, True, True, False, False])))
    if audio_rows is True:
        audio_rows = rows(2, seed=6)
    if audio_rows is not None:
        p.audio_rows.CopyFrom(audio_rows)
    p.audio_keys.extend([b"k" * 16] if keys is None else keys)
    p.audio_rows_follow = follow
    return p


def talker_start(prompt: pb.TalkerPrompt | None = None, **kw) -> pb.TalkerRequest:
    kw.setdefault("speaker", "ethan")
    kw.setdefault("max_frames", 4)
    kw.setdefault("min_frames", 4)
    start = pb.TalkerStart(prompt=prompt if prompt is not None else talker_prompt(), **kw)
    return pb.TalkerRequest(start=start)


def text_rows(n: int, **kw) -> pb.TalkerRequest:
    return pb.TalkerRequest(rows=pb.TextRows(rows=rows(n, seed=4), **kw))


TEXT_END = pb.TalkerRequest(text_end=pb.TextEnd())


def codes(n: int, low: int = 0, high: int = CODEBOOK, dtype=torch.uint16, groups: int = GROUPS) -> pb.Tensor:
    return to_proto(torch.randint(low, high, (n, groups), generator=gen(5)).to(dtype))


def frames(n: int = 2, **kw) -> pb.Code2WavRequest:
    tensor = kw.pop("tensor", None)
    return pb.Code2WavRequest(frames=pb.CodecFrames(codes=tensor if tensor is not None else codes(n, **kw)))


C2W_START = pb.Code2WavRequest(start=pb.Code2WavStart(encoding=pb.AUDIO_FLOAT32))
FRAMES_END = pb.Code2WavRequest(frames_end=pb.FramesEnd())


def bad_bytes(t: pb.Tensor, delta: int) -> pb.Tensor:
    out = pb.Tensor()
    out.CopyFrom(t)
    out.data = t.data[:delta] if delta < 0 else t.data + b"\0" * delta
    return out


def with_dtype(t: pb.Tensor, dtype: int) -> pb.Tensor:
    out = pb.Tensor()
    out.CopyFrom(t)
    out.dtype = dtype
    return out


def with_shape(t: pb.Tensor, shape: list[int]) -> pb.Tensor:
    out = pb.Tensor()
    out.CopyFrom(t)
    del out.shape[:]
    out.shape.extend(shape)
    return out


def good_request(stage: str) -> list:
    if stage == "thinker":
        return [thinker_start(max_tokens=2)]
    if stage == "talker":
        return [talker_start(), text_rows(2), TEXT_END]
    return [C2W_START, frames(2), FRAMES_END]


def active_streams(stack, stage: str) -> float:
    url = f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    m = re.search(rf'^voxpipe_active_streams\{{stage="{stage}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def assert_still_serving(stack, channels, stage: str) -> None:
    resp = health_pb2_grpc.HealthStub(channels[stage]).Check(
        health_pb2.HealthCheckRequest(service=SERVICE[stage]), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    deadline = time.monotonic() + 10
    while active_streams(stack, stage) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active_streams(stack, stage) == 0, f"{stage} still counts an active stream after the bad request"
    responses, err = call(channels, stage, good_request(stage))
    assert err is None, (err.code(), err.details())
    assert responses[-1].WhichOneof("kind") == "finished"
    if stage != "thinker":
        assert any(r.WhichOneof("kind") in ("frames", "audio") for r in responses)


# ---------------------------------------------------------------------------------------------- cases


@dataclass
class Case:
    stage: str
    name: str
    messages: Callable[[], list]
    match: str                       # regex the status details must contain
    code: grpc.StatusCode = INVALID


def _thinker_audio(frames_: int = 100, pads: int = 13, **tensor) -> list:
    feats = to_proto(torch.randn(MEL, frames_, generator=gen(6)))
    if "shape" in tensor:
        del feats.shape[:]
        feats.shape.extend(tensor.pop("shape"))
    for k, v in tensor.items():
        setattr(feats, k, v)
    ids = [IM_START, USER, 390] + [AUDIO_PAD] * pads + [391, IM_END, IM_START, ASSISTANT, NL]
    return [thinker_start(token_ids=pb.TokenIds(ids=ids), audio_features=[feats], max_tokens=2)]


def _incomplete_start_then(*after) -> list:
    """A TalkerStart whose user_rows bytes are cut short (as a split head) followed by `after`."""
    head = talker_start(talker_prompt(users=40))
    head.start.prompt.user_rows.data = head.start.prompt.user_rows.data[:100]
    return [head, *after]


LONG = dict(max_tokens=200, min_tokens=200)  # keeps the stream open while the reader sees the bad message

CASES = [
    # ------------------------------------------------------------------ thinker
    Case("thinker", "empty-stream", lambda: [], r"empty request stream"),
    Case("thinker", "first-not-start", lambda: [pb.ThinkerRequest(chunk=pb.PayloadChunk(data=b"x"))],
         r"first message must be start, got chunk"),
    Case("thinker", "cancel-first", lambda: [pb.ThinkerRequest(cancel=pb.Cancel())], r"first message must be start"),
    Case("thinker", "no-prompt", lambda: [pb.ThinkerRequest(start=pb.ThinkerStart(max_tokens=2))], r"needs a prompt"),
    Case("thinker", "empty-prompt", lambda: [thinker_start(token_ids=pb.TokenIds())], r"empty prompt"),
    Case("thinker", "token-out-of-range", lambda: [thinker_start(token_ids=pb.TokenIds(ids=[IM_START, VOCAB]))],
         rf"token id {VOCAB} out of range \[0, {VOCAB}\)"),
    Case("thinker", "huge-token-id", lambda: [thinker_start(token_ids=pb.TokenIds(ids=[2**32 - 1]))],
         r"token id 4294967295 out of range"),
    Case("thinker", "packed-and-ids", lambda: [thinker_start(token_ids=pb.TokenIds(ids=[IM_START], packed=bytes(8)))],
         r"token_ids: set ids or packed, not both"),
    Case("thinker", "packed-odd-bytes", lambda: [thinker_start(token_ids=pb.TokenIds(packed=bytes(10)))],
         r"token_ids.packed: 10 bytes is not a whole number of uint32 ids"),
    Case("thinker", "packed-token-out-of-range",
         lambda: [thinker_start(token_ids=pb.TokenIds(packed=np.array([IM_START, VOCAB], "<u4").tobytes()))],
         rf"token id {VOCAB} out of range \[0, {VOCAB}\)"),
    Case("thinker", "image-token", lambda: [thinker_start(token_ids=pb.TokenIds(ids=prompt_ids() + [IMAGE_PAD]))],
         r"image and video input are not supported"),
    Case("thinker", "video-token", lambda: [thinker_start(token_ids=pb.TokenIds(ids=[VIDEO_PAD] + prompt_ids()))],
         r"image and video input are not supported"),
    Case("thinker", "audio-pad-count", lambda: _thinker_audio(pads=12),
         r"12 audio placeholder tokens but the 1 audio feature tensors make 13"),
    Case("thinker", "audio-pads-without-features",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=prompt_ids() + [AUDIO_PAD] * 2))],
         r"2 audio placeholder tokens but the 0 audio feature tensors make 0"),
    Case("thinker", "audio-wrong-shape", lambda: _thinker_audio(shape=[64, 200]),
         r"audio_features\[0\]: shape \[64, 200\], expected \[128, \*\]"),
    Case("thinker", "audio-1d", lambda: _thinker_audio(shape=[MEL * 100]), r"audio_features\[0\]: shape \[12800\]"),
    Case("thinker", "audio-wrong-dtype", lambda: _thinker_audio(dtype=pb.INT32),
         r"audio_features\[0\]: dtype INT32, expected FLOAT32"),
    Case("thinker", "audio-unknown-dtype", lambda: _thinker_audio(dtype=99),
         r"audio_features\[0\]: unknown tensor dtype 99"),
    Case("thinker", "audio-unspecified-dtype", lambda: _thinker_audio(dtype=pb.DTYPE_UNSPECIFIED),
         r"audio_features\[0\]: unknown tensor dtype 0"),
    Case("thinker", "audio-extra-bytes", lambda: _thinker_audio(data=bytes(MEL * 100 * 4 + 3)),
         r"audio_features\[0\]: 51203 bytes, its shape \[128, 100\] FLOAT32 needs 51200"),
    Case("thinker", "audio-short-bytes-stream-ends", lambda: _thinker_audio(data=bytes(MEL * 100 * 4 - 4)),
         r"request stream ended before the start payload was complete"),
    Case("thinker", "audio-nan", lambda: _thinker_audio(data=torch.full((MEL, 100), float("nan")).numpy().tobytes()),
         r"audio_features\[0\] contains NaN or infinity"),
    Case("thinker", "audio-inf", lambda: _thinker_audio(data=torch.full((MEL, 100), float("-inf")).numpy().tobytes()),
         r"audio_features\[0\] contains NaN or infinity"),
    Case("thinker", "audio-huge-finite", lambda: _thinker_audio(data=torch.full((MEL, 100), 3e38).numpy().tobytes()),
         r"audio_features\[0\] has values of magnitude 3e\+38, beyond the limit of 1000"),
    Case("thinker", "audio-zero-frames", lambda: _thinker_audio(frames_=0, pads=0), r"zero frames"),
    Case("thinker", "negative-dim", lambda: _thinker_audio(shape=[MEL, -100]),
         r"audio_features\[0\]: negative dimension"),
    Case("thinker", "min-over-max", lambda: [thinker_start(max_tokens=3, min_tokens=5)],
         r"min_tokens 5 > max_tokens 3"),
    Case("thinker", "prompt-too-long",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[NL] * (THINKER_CONTEXT - 100)), max_tokens=200)],
         rf"prompt of {THINKER_CONTEXT - 100} tokens \+ max_tokens 200 exceeds the context of {THINKER_CONTEXT}",
         PAST_CONTEXT),
    Case("thinker", "prompt-filling-the-context-without-max-tokens",      # names no max_tokens: none was sent
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[NL] * THINKER_CONTEXT))],
         rf"prompt of {THINKER_CONTEXT} tokens \+ a reply of at least 1 token exceeds the context of {THINKER_CONTEXT}",
         PAST_CONTEXT),
    Case("thinker", "talker-rows-without-assistant-turn",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[IM_START, USER, NL]), talker_rows=True, max_tokens=2)],
         r"talker_rows needs a prompt ending in an assistant turn"),
    Case("thinker", "bad-top-p", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=1.0, top_p=0.0))],
         r"top_p must be in \(0, 1\]"),
    Case("thinker", "negative-temperature", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=-1))],
         r"temperature must be in \[0, 100\]"),
    Case("thinker", "nan-temperature", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=float("nan")))],
         r"temperature must be in \[0, 100\], got nan"),
    Case("thinker", "inf-temperature", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=float("inf")))],
         r"temperature must be in \[0, 100\], got inf"),
    Case("thinker", "negative-top-k", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=1, top_k=-1))],
         r"top_k must be >= 0, got -1"),
    Case("thinker", "top-p-over-one", lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=1, top_p=1.5))],
         r"top_p must be in \(0, 1\], got 1\.5"),
    Case("thinker", "tiny-repetition-penalty",
         lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(temperature=1, repetition_penalty=1e-40))],
         r"repetition_penalty must be in \[0\.01, 100\], got 9\.9"),
    Case("thinker", "huge-repetition-penalty",
         lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(repetition_penalty=1e9))],
         r"repetition_penalty must be in \[0\.01, 100\], got 1000000000\.0"),
    Case("thinker", "nan-repetition-penalty",
         lambda: [thinker_start(max_tokens=2, sampling=pb.Sampling(repetition_penalty=float("nan")))],
         r"repetition_penalty must be in \[0\.01, 100\], got nan"),
    Case("thinker", "five-stop-strings", lambda: [thinker_start(max_tokens=2, stop=["a", "b", "c", "d", "e"])],
         r"at most 4 stop strings, got 5"),
    Case("thinker", "empty-stop-string", lambda: [thinker_start(max_tokens=2, stop=["a", ""])],
         r"stop string 1 is empty"),
    Case("thinker", "long-stop-string", lambda: [thinker_start(max_tokens=2, stop=["z" * 257])],
         r"stop string 0 has 257 characters; the limit is 256"),
    Case("thinker", "top-logprobs-over-20", lambda: [thinker_start(max_tokens=2, logprobs=True, top_logprobs=21)],
         r"top_logprobs must be from 0 to 20, got 21"),
    Case("thinker", "top-logprobs-without-logprobs", lambda: [thinker_start(max_tokens=2, top_logprobs=5)],
         r"top_logprobs needs logprobs"),
    Case("thinker", "second-start", lambda: [thinker_start(**LONG), thinker_start(**LONG)], r"unexpected start after start"),
    Case("thinker", "chunk-after-complete-start",
         lambda: [thinker_start(**LONG), pb.ThinkerRequest(chunk=pb.PayloadChunk(data=b"abc"))],
         r"unexpected chunk after start"),
    Case("thinker", "oversize-message",
         lambda: [thinker_start(audio_features=[to_proto(torch.zeros(MEL, SERVER_MAX_MESSAGE // (4 * MEL) + 10))])],
         r"larger than max", grpc.StatusCode.RESOURCE_EXHAUSTED),
    # ------------------------------------------------------------------ talker
    Case("talker", "empty-stream", lambda: [], r"empty request stream"),
    Case("talker", "first-not-start", lambda: [text_rows(2), TEXT_END], r"first message must be start, got rows"),
    Case("talker", "unknown-speaker", lambda: [talker_start(speaker="Bob"), text_rows(2), TEXT_END],
         r"unknown speaker 'Bob'; valid: aiden, chelsie, ethan"),
    Case("talker", "unknown-speaker-10000-characters", lambda: [talker_start(speaker="b" * 10_000), text_rows(2), TEXT_END],
         r"^unknown speaker 'b{63}\.\.\. \(10002 characters\); valid: aiden, chelsie, ethan$"),
    Case("talker", "no-prompt", lambda: [pb.TalkerRequest(start=pb.TalkerStart(speaker="ethan"))],
         r"start\.prompt is required"),
    Case("talker", "user-rows-wrong-width", lambda: [talker_start(talker_prompt(user_rows=rows(5, width=32)))],
         r"prompt\.user_rows: shape \[5, 32\], expected \[\*, 64\]"),
    Case("talker", "user-rows-int", lambda: [talker_start(talker_prompt(
        user_rows=to_proto(torch.zeros(5, HIDDEN, dtype=torch.int64))))],
         r"prompt\.user_rows: rows must be float32, bfloat16 or float16"),
    # user turns as token ids (user_rows unset): the talker looks them up, so they must be text rows it knows
    Case("talker", "ids-only-with-mm-rows", lambda: [talker_start(talker_prompt(
        user_rows=None, user_mm_mask=to_proto(torch.tensor([False, True, False, False, False]))))],
         r"prompt\.audio_rows \(or prompt\.user_rows\) is required when a user row is multimodal"),
    # multimodal rows alone (audio_rows), keyed (audio_keys), or following the start (audio_rows_follow)
    Case("talker", "audio-rows-count", lambda: [talker_start(audio_prompt(audio_rows=rows(1)))],
         r"prompt\.audio_rows: shape \[1, 64\], expected \[2, 64\]"),
    Case("talker", "audio-rows-with-user-rows", lambda: [talker_start(talker_prompt(audio_rows=rows(2)))],
         r"prompt\.audio_rows goes without prompt\.user_rows"),
    Case("talker", "audio-keys-count", lambda: [talker_start(audio_prompt(keys=[b"k" * 16] * 2))],
         r"prompt\.audio_keys: 2 keys for 1 runs of multimodal user rows"),
    Case("talker", "audio-key-too-long", lambda: [talker_start(audio_prompt(keys=[b"k" * 65]))],
         r"prompt\.audio_keys: each key has 1 to 64 bytes"),
    Case("talker", "audio-follow-without-keys", lambda: [talker_start(audio_prompt(audio_rows=None, keys=[],
                                                                                   follow=True))],
         r"prompt\.audio_rows_follow needs multimodal user rows with their audio_keys"),
    Case("talker", "audio-rows-message-without-follow", lambda: [
        talker_start(audio_prompt()), pb.TalkerRequest(audio_rows=pb.AudioRows(rows=rows(2))), TEXT_END],
         r"audio_rows only once, for a prompt with audio_rows_follow"),
    Case("talker", "audio-rows-message-wrong-first", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(first=1, rows=rows(1))), TEXT_END],
         r"audio_rows\.first 1: this talker holds the first 0 audio rows"),
    Case("talker", "audio-rows-message-count", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=rows(3))), TEXT_END],
         r"audio_rows\.rows: shape \[3, 64\], expected \[2, 64\]"),
    Case("talker", "audio-rows-message-twice", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=rows(2))),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=rows(2))), TEXT_END],
         r"audio_rows only once"),
    # the rows as raw bytes: each malformed tensor is refused naming its field
    Case("talker", "audio-rows-message-wrong-bytes", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=bad_bytes(rows(2, dtype=torch.bfloat16), -2))), TEXT_END],
         r"audio_rows\.rows: 254 bytes for shape \[2, 64\] BFLOAT16 \(expected 256\)"),
    Case("talker", "audio-rows-message-unknown-dtype", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=with_dtype(rows(2), 42))), TEXT_END],
         r"audio_rows\.rows: unknown dtype 42"),
    Case("talker", "audio-rows-message-negative-dim", lambda: [
        talker_start(audio_prompt(audio_rows=None, follow=True)),
        pb.TalkerRequest(audio_rows=pb.AudioRows(rows=with_shape(rows(2), [-2, HIDDEN]))), TEXT_END],
         r"audio_rows\.rows: negative dimension in shape \[-2, 64\]"),
    Case("talker", "rows-negative-dim",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=with_shape(rows(2), [2, -HIDDEN]))), TEXT_END],
         r"^rows: negative dimension in shape \[2, -64\]"),
    Case("talker", "rows-many-dims",     # the error quotes 8 of them
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=with_shape(rows(1, 1), [1] * 10_000))), TEXT_END],
         r"^rows: shape \[1, 1, 1, 1, 1, 1, 1, 1, \.\.\. \(10000 dims\)\], expected \[\*, 64\]$"),
    # rows as token ids (TextRows.rows unset)
    Case("talker", "rows-neither-rows-nor-ids",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(more=True)), TEXT_END],
         r"rows: TextRows needs rows or token_ids"),
    Case("talker", "rows-ids-past-vocab",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(token_ids=[NL, VOCAB])), TEXT_END],
         r"rows\.token_ids: ids must be in \[0, 448\) without rows, got up to 448"),
    Case("talker", "ids-only-out-of-vocab", lambda: [talker_start(talker_prompt(
        user_rows=None, user_token_ids=to_proto(torch.tensor([1, 2, 3, 4, 10**9]))))],
         r"prompt\.user_token_ids: ids must be in \[0, \d+\) without prompt\.user_rows, got 1\.\.1000000000"),
    Case("talker", "ids-only-negative", lambda: [talker_start(talker_prompt(
        user_rows=None, user_token_ids=to_proto(torch.tensor([-1, 2, 3, 4, 5]))))],
         r"prompt\.user_token_ids: ids must be in \[0, \d+\)"),
    Case("talker", "ids-only-mask-length", lambda: [talker_start(talker_prompt(
        user_rows=None, user_mm_mask=to_proto(torch.zeros(4, dtype=torch.bool))))],
         r"prompt\.user_mm_mask: shape \[4\], expected \[5\]"),
    Case("talker", "ids-only-ids-float", lambda: [talker_start(talker_prompt(
        user_rows=None, user_token_ids=to_proto(torch.zeros(5))))],
         r"prompt\.user_token_ids: dtype FLOAT32, expected INT64"),
    Case("talker", "mm-mask-length", lambda: [talker_start(talker_prompt(
        user_mm_mask=to_proto(torch.zeros(4, dtype=torch.bool))))],
         r"prompt\.user_mm_mask: shape \[4\], expected \[5\]"),
    Case("talker", "mm-mask-dtype", lambda: [talker_start(talker_prompt(user_mm_mask=to_proto(torch.zeros(5))))],
         r"prompt\.user_mm_mask: dtype FLOAT32, expected BOOL"),
    Case("talker", "head-shape", lambda: [talker_start(talker_prompt(assistant_head=rows(2)))],
         r"prompt\.assistant_head: shape \[2, 64\], expected \[3, 64\]"),
    Case("talker", "tts-special-missing", lambda: [talker_start(talker_prompt(tts_special=None))],
         r"prompt\.tts_special"),
    Case("talker", "user-rows-unknown-dtype",
         lambda: [talker_start(talker_prompt(user_rows=with_dtype(rows(5), 77)))], r"prompt\.user_rows: unknown tensor dtype 77"),
    Case("talker", "user-rows-nan", lambda: [talker_start(talker_prompt(
        user_rows=to_proto(torch.full((5, HIDDEN), float("nan"))))), text_rows(2), TEXT_END],
         r"prompt\.user_rows contains NaN or infinity"),
    Case("talker", "user-rows-huge-finite", lambda: [talker_start(talker_prompt(
        user_rows=to_proto(torch.full((5, HIDDEN), -3e38)))), text_rows(2), TEXT_END],
         r"prompt\.user_rows has values of magnitude 3e\+38, beyond the limit of 100000"),
    Case("talker", "head-huge-finite", lambda: [talker_start(talker_prompt(assistant_head=to_proto(
        torch.full((3, HIDDEN), 1e6)))), text_rows(2), TEXT_END],
         r"prompt\.assistant_head has values of magnitude 1e\+06"),
    Case("talker", "rows-inf", lambda: [talker_start(sampling=pb.Sampling(temperature=0.9, seed=1)),
                                        pb.TalkerRequest(rows=pb.TextRows(rows=to_proto(
                                            torch.tensor([[float("inf")] * HIDDEN] * 2)))), TEXT_END],
         r"^rows contains NaN or infinity"),
    Case("talker", "rows-huge-finite", lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=to_proto(
        torch.full((2, HIDDEN), 3e38)))), TEXT_END],
         r"^rows has values of magnitude 3e\+38, beyond the limit of 100000"),
    Case("talker", "rows-wrong-bytes",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=bad_bytes(rows(2), -8))), TEXT_END],
         r"rows: 504 bytes for shape \[2, 64\] FLOAT32 \(expected 512\)"),
    Case("talker", "rows-wrong-shape", lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=rows(2, 32)))],
         r"rows: shape \[2, 32\], expected \[\*, 64\]"),
    Case("talker", "rows-wrong-dtype",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=to_proto(torch.zeros(2, HIDDEN, dtype=torch.int32))))],
         r"rows must be float32, bfloat16 or float16"),
    Case("talker", "rows-unknown-dtype",
         lambda: [talker_start(), pb.TalkerRequest(rows=pb.TextRows(rows=with_dtype(rows(2), 42)))],
         r"rows: unknown dtype 42"),
    Case("talker", "rows-token-count", lambda: [talker_start(), text_rows(2, token_ids=[1, 2, 3]), TEXT_END],
         r"3 token ids for 2 rows"),
    Case("talker", "rows-after-text-end",
         lambda: [talker_start(max_frames=200, min_frames=200), text_rows(3), TEXT_END, text_rows(1)],
         r"rows after text_end"),
    Case("talker", "ends-before-text-end", lambda: [talker_start(), text_rows(1)],
         r"request stream ended before text_end"),
    Case("talker", "ends-before-payload-complete", lambda: _incomplete_start_then(),
         r"request stream ended before the start payload was complete"),
    Case("talker", "payload-then-rows",
         lambda: _incomplete_start_then(text_rows(2)), r"expected chunk continuation bytes, got rows"),
    Case("talker", "payload-overflow",
         lambda: _incomplete_start_then(pb.TalkerRequest(chunk=pb.PayloadChunk(data=bytes(40 * HIDDEN * 4)))),
         r"more payload bytes than the message's tensors need"),
    Case("talker", "declared-payload-over-limit",
         lambda: [talker_start(talker_prompt(user_rows=pb.Tensor(dtype=pb.FLOAT32, shape=[3_000_000, HIDDEN])))],
         rf"payload of {3_000_000 * HIDDEN * 4 + 5 + 40 + 2 * 3 * HIDDEN * 4} bytes exceeds the limit of {512 * 1024 * 1024}"),
    Case("talker", "min-over-max", lambda: [talker_start(max_frames=4, min_frames=9)],
         r"min_frames 9 > max_frames 4"),
    Case("talker", "too-long-for-context", lambda: [talker_start(talker_prompt(users=8000), max_frames=60000,
                                                                  min_frames=0)],
         rf"8000 user rows \+ 9 prompt rows \+ max_frames 60000 exceed the talker context of {TALKER_CONTEXT}",
         PAST_CONTEXT),
    Case("talker", "bad-repetition-penalty",
         lambda: [talker_start(sampling=pb.Sampling(repetition_penalty=0.0))],
         r"repetition_penalty must be in \[0\.01, 100\], got 0\.0"),
    Case("talker", "tiny-repetition-penalty",
         lambda: [talker_start(sampling=pb.Sampling(temperature=0.9, repetition_penalty=1e-40)), text_rows(2), TEXT_END],
         r"repetition_penalty must be in \[0\.01, 100\], got 9\.9"),
    Case("talker", "nan-temperature",
         lambda: [talker_start(sampling=pb.Sampling(temperature=float("nan"))), text_rows(2), TEXT_END],
         r"temperature must be in \[0, 100\], got nan"),
    Case("talker", "negative-top-k",
         lambda: [talker_start(sampling=pb.Sampling(temperature=0.9, top_k=-5)), text_rows(2), TEXT_END],
         r"top_k must be >= 0, got -5"),
    Case("talker", "second-start",
         lambda: [talker_start(max_frames=200, min_frames=200), text_rows(3), talker_start()],
         r"unexpected start after start"),
    Case("talker", "oversize-message",
         lambda: [talker_start(talker_prompt(users=SERVER_MAX_MESSAGE // (4 * HIDDEN) + 10))],
         r"larger than max", grpc.StatusCode.RESOURCE_EXHAUSTED),
    # ------------------------------------------------------------------ code2wav
    Case("code2wav", "empty-stream", lambda: [], r"empty request stream"),
    Case("code2wav", "first-not-start", lambda: [frames(2), FRAMES_END], r"first message must be start, got frames"),
    Case("code2wav", "unknown-encoding",
         lambda: [pb.Code2WavRequest(start=pb.Code2WavStart(encoding=7)), frames(1), FRAMES_END],
         r"unknown audio encoding 7"),
    Case("code2wav", "code-too-large", lambda: [C2W_START, frames(3, low=CODEBOOK, high=CODEBOOK + 1), FRAMES_END],
         rf"codec codes must be in \[0, {CODEBOOK}\), got {CODEBOOK}\.\.{CODEBOOK}"),
    Case("code2wav", "code-negative",
         lambda: [C2W_START, frames(3, low=-5, high=-4, dtype=torch.int32), FRAMES_END],
         rf"codec codes must be in \[0, {CODEBOOK}\), got -5\.\.-5"),
    Case("code2wav", "wrong-groups", lambda: [C2W_START, frames(2, groups=15), FRAMES_END],
         r"frames\.codes: shape \[2, 15\], expected \[\*, 16\]"),
    Case("code2wav", "float-codes", lambda: [C2W_START, frames(2, dtype=torch.float32), FRAMES_END],
         r"frames\.codes must be uint16, int32 or int64"),
    Case("code2wav", "wrong-bytes", lambda: [C2W_START, frames(tensor=bad_bytes(codes(2), 2)), FRAMES_END],
         r"frames\.codes: 66 bytes for shape \[2, 16\] UINT16 \(expected 64\)"),
    Case("code2wav", "unknown-dtype", lambda: [C2W_START, frames(tensor=with_dtype(codes(2), 12)), FRAMES_END],
         r"frames\.codes: unknown dtype 12"),
    Case("code2wav", "frames-after-end", lambda: [C2W_START, frames(300), FRAMES_END, frames(1)],
         r"frames after frames_end"),
    Case("code2wav", "ends-before-frames-end", lambda: [C2W_START, frames(2)],
         r"request stream ended before frames_end"),
    Case("code2wav", "second-start", lambda: [C2W_START, frames(300), C2W_START], r"unexpected start after start"),
    Case("code2wav", "oversize-message",
         lambda: [C2W_START, frames(SERVER_MAX_MESSAGE // (2 * GROUPS) + 10), FRAMES_END],
         r"larger than max", grpc.StatusCode.RESOURCE_EXHAUSTED),
]

# the stage-to-stage inputs (the stack's thinker has --talker, its talker --code2wav)
SPEECH = dict(max_tokens=2, min_tokens=2)
CASES += [
    Case("thinker", "speech-and-talker-rows",
         lambda: [thinker_start(speech=pb.SpeechParams(max_frames=3), talker_rows=True, **SPEECH)],
         r"speech and talker_rows exclude each other"),
    Case("thinker", "speech-unknown-speaker", lambda: [thinker_start(speech=pb.SpeechParams(speaker="Bob"), **SPEECH)],
         r"unknown speaker 'Bob'; valid: aiden, chelsie, ethan"),
    Case("thinker", "speech-unknown-speaker-10000-characters",
         lambda: [thinker_start(speech=pb.SpeechParams(speaker="b" * 10_000), **SPEECH)],
         r"^unknown speaker 'b{63}\.\.\. \(10002 characters\); valid: aiden, chelsie, ethan$"),
    Case("thinker", "speech-min-over-max-frames",
         lambda: [thinker_start(speech=pb.SpeechParams(max_frames=3, min_frames=5), **SPEECH)],
         r"speech\.min_frames 5 > max_frames 3"),
    Case("thinker", "speech-unknown-encoding",
         lambda: [thinker_start(speech=pb.SpeechParams(code2wav=pb.Code2WavParams(encoding=7)), **SPEECH)],
         r"unknown audio encoding 7"),
    Case("thinker", "speech-without-assistant-turn",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[IM_START, USER, NL]), speech=pb.SpeechParams(), **SPEECH)],
         r"speech needs a prompt ending in an assistant turn"),
    Case("talker", "code2wav-unknown-encoding",
         lambda: [talker_start(code2wav=pb.Code2WavParams(encoding=9)), text_rows(2), TEXT_END],
         r"unknown audio encoding 9"),
    Case("code2wav", "echo-frames-without-to-listener",
         lambda: [pb.Code2WavRequest(start=pb.Code2WavStart(echo_frames=True)), frames(2), FRAMES_END],
         r"echo_frames needs to_listener"),
    Case("code2wav", "playback-reports-without-to-listener",
         lambda: [pb.Code2WavRequest(start=pb.Code2WavStart(playback_reports=True)), frames(2), FRAMES_END],
         r"playback_reports needs to_listener"),
]

# a reply given verbatim (text to speech: ThinkerStart.assistant_text)
CASES += [
    Case("thinker", "assistant-text-empty", lambda: [thinker_start(assistant_text="")], r"assistant_text is empty"),
    Case("thinker", "unspoken-tool-calls-without-rows", lambda: [thinker_start(unspoken_tool_calls=True)],
         r"unspoken_tool_calls needs talker rows"),
    Case("thinker", "assistant-text-too-long", lambda: [thinker_start(assistant_text="a" * 32769)],
         r"assistant_text has 32769 characters; the limit is 32768"),
    Case("thinker", "assistant-text-over-the-context",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[NL] * (THINKER_CONTEXT - 1)), assistant_text="Hi.")],
         rf"prompt of {THINKER_CONTEXT - 1} tokens \+ assistant_text of \d+ tokens \(<\|im_end\|> included\) "
         rf"exceeds the context of {THINKER_CONTEXT}", PAST_CONTEXT),
    Case("thinker", "assistant-text-with-max-tokens", lambda: [thinker_start(assistant_text="Hi.", max_tokens=2)],
         r"assistant_text excludes max_tokens: the reply is given"),
    Case("thinker", "assistant-text-with-stop-and-logprobs",
         lambda: [thinker_start(assistant_text="Hi.", stop=["."], logprobs=True)],
         r"assistant_text excludes stop, logprobs"),
    Case("thinker", "assistant-text-with-sampling-and-min-tokens",
         lambda: [thinker_start(assistant_text="Hi.", min_tokens=1, sampling=pb.Sampling(temperature=0.5))],
         r"assistant_text excludes sampling, min_tokens"),
    Case("thinker", "assistant-text-speech-without-assistant-turn",
         lambda: [thinker_start(token_ids=pb.TokenIds(ids=[IM_START, USER, NL]), assistant_text="Hi.",
                                speech=pb.SpeechParams())],
         r"speech needs a prompt ending in an assistant turn"),
    Case("thinker", "assistant-text-speech-unknown-speaker",
         lambda: [thinker_start(assistant_text="Hi.", speech=pb.SpeechParams(speaker="Bob"))],
         r"unknown speaker 'Bob'"),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.stage}-{c.name}" for c in CASES])
def test_bad_request_gets_a_clear_status_and_the_stage_keeps_serving(stack, channels, case):
    responses, err = call(channels, case.stage, case.messages())
    assert err is not None, f"accepted: {[r.WhichOneof('kind') for r in responses]}"
    assert err.code() == case.code, (err.code(), err.details())
    assert re.search(case.match, err.details() or ""), err.details()
    assert not any(r.WhichOneof("kind") == "finished" for r in responses)
    assert_still_serving(stack, channels, case.stage)


def test_a_request_past_the_thinker_context_carries_its_numbers(stack, channels):
    """OUT_OF_RANGE's trailing metadata holds a ContextExceeded (what realtime truncation learns the
    context from): the prompt, the reply's room (max_tokens, or assistant_text's tokens), the context."""
    _, err = call(channels, "thinker", [thinker_start(token_ids=pb.TokenIds(ids=[NL] * (THINKER_CONTEXT - 100)),
                                                      max_tokens=200)])
    assert err.code() == PAST_CONTEXT
    assert context_exceeded(err) == pb.ContextExceeded(prompt_tokens=THINKER_CONTEXT - 100, reply_tokens=200,
                                                       context_tokens=THINKER_CONTEXT)
    _, err = call(channels, "thinker", [thinker_start(token_ids=pb.TokenIds(ids=[NL] * (THINKER_CONTEXT - 1)),
                                                      assistant_text="Hi.")])
    detail = context_exceeded(err)
    assert err.code() == PAST_CONTEXT and detail.prompt_tokens == THINKER_CONTEXT - 1
    assert detail.context_tokens == THINKER_CONTEXT and detail.reply_tokens >= 2     # "Hi." and <|im_end|>
    assert_still_serving(stack, channels, "thinker")


def test_packed_token_ids_give_the_reply_of_repeated_ids(stack, channels):
    """TokenIds.packed (little-endian uint32, what PipelineClient sends from PACKED_IDS_MIN ids on) is
    the same prompt as TokenIds.ids: the same tokens back, greedy."""
    ids = [IM_START, USER] + [NL + i % 50 for i in range(300)] + [IM_END, IM_START, ASSISTANT, NL]
    replies = []
    for form in (pb.TokenIds(ids=ids), pb.TokenIds(packed=np.array(ids, "<u4").tobytes())):
        responses, err = call(channels, "thinker", [thinker_start(token_ids=form, max_tokens=6, min_tokens=6)])
        assert err is None
        replies.append([t for r in responses if r.WhichOneof("kind") == "text" for t in r.text.token_ids])
    assert len(replies[0]) == 6 and replies[0] == replies[1]


# ---------------------------------------------------------------------------------------------- large, chunked


def test_chunked_talker_start_with_3000_user_rows_is_accepted(stack, channels):
    start = talker_start(talker_prompt(users=3000), max_frames=5, min_frames=5).start
    head, chunks = split_message(start, 128 * 1024)
    assert len(chunks) >= 6 and head.ByteSize() < 128 * 1024
    msgs = [pb.TalkerRequest(start=head)] + [pb.TalkerRequest(chunk=pb.PayloadChunk(data=c)) for c in chunks]
    responses, err = call(channels, "talker", msgs + [text_rows(3), TEXT_END])
    assert err is None, (err.code(), err.details())
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds == ["frames"] * 4 + ["finished"]
    assert responses[-1].finished.reason == pb.LENGTH
    assert_still_serving(stack, channels, "talker")


def test_chunked_thinker_start_with_audio_features(stack, channels):
    feats = torch.randn(MEL, 1000, generator=gen(8))  # 1000 frames -> 130 audio tokens
    ids = [IM_START, USER, 390] + [AUDIO_PAD] * 130 + [391, IM_END, IM_START, ASSISTANT, NL]
    start = pb.ThinkerStart(token_ids=pb.TokenIds(ids=ids), audio_features=[to_proto(feats)], max_tokens=3,
                            min_tokens=3)
    head, chunks = split_message(start, 100 * 1024)
    assert len(chunks) >= 5
    msgs = [pb.ThinkerRequest(start=head)] + [pb.ThinkerRequest(chunk=pb.PayloadChunk(data=c)) for c in chunks]
    responses, err = call(channels, "thinker", msgs)
    assert err is None, (err.code(), err.details())
    # text deltas that wait together travel as one message: count tokens, not messages
    assert {r.WhichOneof("kind") for r in responses[:-1]} == {"text"} and responses[-1].WhichOneof("kind") == "finished"
    assert sum(len(r.text.token_ids) for r in responses[:-1]) == 3
    assert responses[-1].finished.prompt_tokens == len(ids)


def test_bad_requests_do_not_disturb_a_running_request(stack, channels):
    """While a long greedy request streams, every bad thinker request above is refused; the running one
    finishes with all its tokens."""
    import threading

    result: dict = {}

    def long_request() -> None:
        result["out"] = call(channels, "thinker", [thinker_start(max_tokens=300, min_tokens=300)], timeout=120)

    runner = threading.Thread(target=long_request)
    runner.start()
    try:
        for case in (c for c in CASES if c.stage == "thinker" and c.code == INVALID):
            _, err = call(channels, "thinker", case.messages())
            assert err is not None and err.code() == INVALID, case.name
    finally:
        runner.join(timeout=120)
    responses, err = result["out"]
    assert err is None, (err.code(), err.details())
    assert {r.WhichOneof("kind") for r in responses[:-1]} == {"text"} and responses[-1].WhichOneof("kind") == "finished"
    assert sum(len(r.text.token_ids) for r in responses[:-1]) == 300    # deltas may travel together
    assert responses[-1].finished.reason == pb.LENGTH


# ---------------------------------------------------------------------------------------------- wire-level refusals


@pytest.mark.parametrize("stage", list(STUBS))
def test_garbage_bytes_are_invalid_argument(stack, channels, stage):
    service, method = SERVICE[stage], STUBS[stage][1]
    raw = channels[stage].stream_stream(f"/{service}/{method}", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as err:
        list(raw(iter([b"\xff\xff\xff\xff not a protobuf message"]), timeout=30))
    assert err.value.code() == INVALID
    request_type = {"thinker": "ThinkerRequest", "talker": "TalkerRequest", "code2wav": "Code2WavRequest"}[stage]
    assert f"request message 1 is not a valid voxpipe.v1.{request_type}" in err.value.details()
    assert_still_serving(stack, channels, stage)


def test_a_refusal_reaches_an_asyncio_client_that_is_still_writing(stack):
    """gRPC asyncio clients report INTERNAL when the status arrives while they write
    (grpc/grpc#36066); the stage reads what the client still sends before refusing, so each of
    these calls gets the real INVALID_ARGUMENT."""
    async def refused_while_writing() -> list[tuple[grpc.StatusCode, str]]:
        out = []
        async with grpc.aio.insecure_channel(stack.address("talker"), options=CHANNEL_OPTIONS) as ch:
            for _ in range(10):
                call = pb_grpc.TalkerStub(ch).Generate()
                try:
                    for msg in [talker_start(speaker="Bob")] + [text_rows(2)] * 40 + [TEXT_END]:
                        await call.write(msg)
                    await call.done_writing()
                    [r async for r in call]
                except grpc.aio.AioRpcError as e:
                    out.append((e.code(), e.details()))
        return out

    statuses = asyncio.run(refused_while_writing())
    assert [code for code, _ in statuses] == [INVALID] * 10, statuses
    assert all("unknown speaker 'Bob'" in details for _, details in statuses)


def test_a_row_sent_with_more_is_spoken_before_the_next_row(stack, channels):
    """TextRows.more says the reply goes on after a row: the talker prefills on it (and makes frame
    0) without waiting for the next row, as it must wait without the flag. A client that says more
    and then ends the text gets its frames and a normal end, and the stage keeps serving."""
    async def first_frame_wait(more: bool) -> tuple[float | None, list[str]]:
        async with grpc.aio.insecure_channel(stack.address("talker"), options=CHANNEL_OPTIONS) as ch:
            call = pb_grpc.TalkerStub(ch).Generate()
            await call.write(talker_start())
            await call.write(text_rows(1, more=more))
            t0 = time.monotonic()
            reading = asyncio.ensure_future(call.read())     # not cancelled on the timeout: that ends the call
            done, _ = await asyncio.wait([reading], timeout=3.0)
            waited = time.monotonic() - t0 if done else None
            await call.write(text_rows(2))
            await call.write(TEXT_END)
            await call.done_writing()
            kinds = [(await reading).WhichOneof("kind")]
            while (r := await call.read()) is not grpc.aio.EOF:
                kinds.append(r.WhichOneof("kind"))
            return waited, kinds

    waited, kinds = asyncio.run(first_frame_wait(True))
    assert waited is not None and kinds[0] == "frames" and kinds[-1] == "finished", (waited, kinds)
    waited, kinds = asyncio.run(first_frame_wait(False))
    assert waited is None and kinds[0] == "frames" and kinds[-1] == "finished", (waited, kinds)
    # more on every row, then the end: the rows all count as spoken, the request ends normally
    responses, err = call(channels, "talker", [talker_start(), text_rows(2, more=True), TEXT_END])
    assert err is None, (err.code(), err.details())
    assert responses[-1].WhichOneof("kind") == "finished"
    assert_still_serving(stack, channels, "talker")


def pending_upload_bytes(stack, stage: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()
    m = re.search(rf'^voxpipe_pending_upload_bytes\{{stage="{stage}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_unadmitted_uploads_are_bounded_and_counted(stack, channels):
    """Chunked talker starts whose payload has not all arrived hold their declared bytes in
    voxpipe_pending_upload_bytes; past the stage's budget (1 GiB by default) the next is
    RESOURCE_EXHAUSTED; cancelled uploads give their bytes back."""
    users = 400 * 1024 * 1024 // (4 * HIDDEN)                 # 400 MiB of user rows declared, none sent

    def head() -> pb.TalkerRequest:
        prompt = talker_prompt(user_rows=pb.Tensor(dtype=pb.FLOAT32, shape=[users, HIDDEN]),
                               user_mm_mask=pb.Tensor(dtype=pb.BOOL, shape=[users]),
                               user_token_ids=pb.Tensor(dtype=pb.INT64, shape=[users]))
        return talker_start(prompt)

    async def go():
        async with grpc.aio.insecure_channel(stack.address("talker"), options=CHANNEL_OPTIONS) as ch:
            held = []
            for _ in range(2):
                call = pb_grpc.TalkerStub(ch).Generate()
                await call.write(head())
                held.append(call)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while pending_upload_bytes(stack, "talker") < 2 * users * HIDDEN * 4 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            pending = pending_upload_bytes(stack, "talker")
            third = pb_grpc.TalkerStub(ch).Generate()
            await third.write(head())
            await third.done_writing()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                [r async for r in third]
            for call in held:
                call.cancel()
            deadline = loop.time() + 10
            while pending_upload_bytes(stack, "talker") != 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            return pending, refused.value

    pending, refused = asyncio.run(go())
    assert pending >= 2 * users * HIDDEN * 4, pending
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.details()
    assert "incomplete uploads pending" in refused.details()
    assert pending_upload_bytes(stack, "talker") == 0
    assert_still_serving(stack, channels, "talker")


# ---------------------------------------------------------------------------------------------- stage-to-stage inputs


@pytest.fixture(scope="module")
def bare(tiny_model_dir):
    """A thinker without --talker, a talker without --code2wav, and a code2wav that waits 1 s for a
    listener (--listen-timeout 1): their own processes, started together."""
    from conftest import StageProcesses

    procs = StageProcesses(tiny_model_dir)
    procs.start("thinker", "thinker", "--talker", "")
    procs.start("talker", "talker", "--code2wav", "")
    procs.start("code2wav", "code2wav", "--listen-timeout", "1")
    yield procs.wait_ready()
    procs.stop()


def test_speech_on_a_thinker_without_talkers_is_failed_precondition(bare):
    with grpc.insecure_channel(bare.address("thinker"), options=CHANNEL_OPTIONS) as ch:
        responses, err = call({"thinker": ch}, "thinker", [thinker_start(speech=pb.SpeechParams(max_frames=3),
                                                                         **SPEECH)])
        assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "--talker" in err.details() and not responses
        # text only still works there
        responses, err = call({"thinker": ch}, "thinker", good_request("thinker"))
        assert err is None and responses[-1].WhichOneof("kind") == "finished"
    assert bare.metric("thinker") == 0


def test_routed_talker_start_on_a_talker_without_code2wav_is_failed_precondition(bare):
    with grpc.insecure_channel(bare.address("talker"), options=CHANNEL_OPTIONS) as ch:
        responses, err = call({"talker": ch}, "talker", [talker_start(code2wav=pb.Code2WavParams()), text_rows(2),
                                                         TEXT_END])
        assert err is not None and err.code() == grpc.StatusCode.FAILED_PRECONDITION, err
        assert "--code2wav" in err.details() and not responses
        responses, err = call({"talker": ch}, "talker", good_request("talker"))     # frames back to the caller
        assert err is None and responses[-1].WhichOneof("kind") == "finished"
        assert any(r.WhichOneof("kind") == "frames" for r in responses)
    assert bare.metric("talker") == 0


@pytest.mark.parametrize("token", ["", "not-a-token"])
def test_listen_with_an_unknown_token_is_not_found(stack, channels, token):
    with pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.Code2WavStub(channels["code2wav"]).Listen(pb.ListenRequest(listen_token=token), timeout=30))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no audio stream for this listen token" in err.value.details()


async def read_all(call) -> list:
    """The rest of a call's responses through its read API (a call is read one way only)."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def listen_start(**kw) -> pb.Code2WavRequest:
    return pb.Code2WavRequest(start=pb.Code2WavStart(to_listener=True, encoding=pb.AUDIO_FLOAT32, **kw))


def test_a_listen_token_is_used_once(stack, channels):
    """A to_listener Decode stream carries Accepted then Finished; its audio (and with echo_frames
    the frames code2wav received) goes to the one Listen stream that took the token: a second
    Listen with the same token is NOT_FOUND, and the first still gets every frame and sample."""
    sent = torch.randint(0, CODEBOOK, (5, GROUPS), generator=gen(7)).to(torch.uint16)

    async def go():
        async with grpc.aio.insecure_channel(stack.address("code2wav"), options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.Code2WavStub(ch)
            decode = stub.Decode()
            await decode.write(listen_start(echo_frames=True))
            accepted = await decode.read()
            token = accepted.accepted.listen_token
            listen = stub.Listen(pb.ListenRequest(listen_token=token))
            await decode.write(pb.Code2WavRequest(frames=pb.CodecFrames(index=0, codes=to_proto(sent[:2]))))
            got = [await listen.read()]          # the first Listen holds the token now
            with pytest.raises(grpc.aio.AioRpcError) as second:
                [r async for r in stub.Listen(pb.ListenRequest(listen_token=token))]
            await decode.write(pb.Code2WavRequest(frames=pb.CodecFrames(index=2, codes=to_proto(sent[2:]))))
            await decode.write(FRAMES_END)
            await decode.done_writing()
            got += await read_all(listen)
            rest = await read_all(decode)
            return accepted, got, second.value, rest

    accepted, got, second, rest = asyncio.run(go())
    assert accepted.WhichOneof("kind") == "accepted" and accepted.accepted.listen_token
    assert second.code() == grpc.StatusCode.NOT_FOUND, second.details()
    kinds = [r.WhichOneof("kind") for r in got]
    assert set(kinds) == {"frames", "audio", "finished"} and kinds[-1] == "finished", kinds
    echoed = torch.cat([torch.from_numpy(np.frombuffer(r.frames.codes.data, dtype="<u2").reshape(-1, GROUPS)
                                         .astype(np.int64)) for r in got if r.WhichOneof("kind") == "frames"])
    assert torch.equal(echoed, sent.to(torch.int64))
    samples = sum(r.audio.num_samples for r in got if r.WhichOneof("kind") == "audio")
    assert samples == got[-1].finished.samples == 1920 * 5 - 555
    assert [r.WhichOneof("kind") for r in rest] == ["finished"] and rest[0].finished.completion_tokens == 5
    assert_still_serving(stack, channels, "code2wav")


def test_a_listener_that_never_attaches_fails_the_request_after_the_listen_timeout(bare):
    """--listen-timeout 1: a to_listener request whose Listen never comes fails with
    DEADLINE_EXCEEDED, the stage frees it, and its token is gone."""
    async def go():
        async with grpc.aio.insecure_channel(bare.address("code2wav"), options=CHANNEL_OPTIONS) as ch:
            stub = pb_grpc.Code2WavStub(ch)
            decode = stub.Decode()
            await decode.write(listen_start())
            token = (await decode.read()).accepted.listen_token
            await decode.write(frames(3))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await read_all(decode)
            with pytest.raises(grpc.aio.AioRpcError) as late:
                [r async for r in stub.Listen(pb.ListenRequest(listen_token=token))]
            return err.value, late.value

    err, late = asyncio.run(go())
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, (err.code(), err.details())
    assert "no listener attached within 1 s" in err.details()
    assert late.code() == grpc.StatusCode.NOT_FOUND
    deadline = time.monotonic() + 10
    while bare.metric("code2wav") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert bare.metric("code2wav") == 0
