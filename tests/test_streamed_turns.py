"""Streamed turns on a real thinker (ThinkerStart.stream_audio, then AudioFrames, then StreamCommit):
the outputs equal the same turn sent whole (and transformers'), for clips shorter and longer than
an encoder window, several frame-message sizes, a clamp that rises late, after a cached earlier
turn; a turn cancelled, abandoned or disconnected mid-utterance frees everything; bad inputs are
refused."""

from __future__ import annotations

import asyncio
import re

import grpc
import numpy as np
import pytest
import torch

from conftest import StageProcesses
from oracle import reference_thinker
from voxpipe.services.runtime.tensors import from_proto, to_proto
from voxpipe.services.thinker.log_mel import LogMelStream, scale
from voxpipe.services.thinker.model import audio_output_length
from voxpipe.services.thinker.streamed import around_last_clip
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, load_tokenizer, render
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

MAX_TOKENS = 4


@pytest.fixture(scope="module")
def thinker(tiny_model_dir):
    procs = StageProcesses(tiny_model_dir)
    procs.start("thinker", "thinker", "--max-batch", "4", "--max-len", "4096")
    procs.wait_ready()
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def kit(tiny_model_dir):
    cfg = OmniConfig.load(tiny_model_dir)
    return load_tokenizer(tiny_model_dir), cfg.thinker, FeatureExtractor.for_model(tiny_model_dir)


def speech(seconds: float, seed: int, levels=(0.1,)) -> np.ndarray:
    """Noise at `levels` in equal parts (a rising level makes the clip's maximum come late)."""
    n = int(16000 * seconds / len(levels))
    rng = np.random.default_rng(seed)
    return np.concatenate([(rng.standard_normal(n) * lv).astype(np.float32) for lv in levels])


def raw_frames(fe: FeatureExtractor, wav: np.ndarray, piece: int = 4800) -> list[torch.Tensor]:
    s = LogMelStream(fe.fe.mel_filters)
    out = [s.push(wav[i:i + piece]) for i in range(0, len(wav), piece)] + [s.finish()]
    return [f for f in out if f.shape[1]]


def conversation(history: list[ChatMessage], clip: torch.Tensor) -> list[ChatMessage]:
    return history + [ChatMessage("user", [ChatPart(features=clip), ChatPart(text="Answer.")])]


def split(kit, messages: list[ChatMessage]):
    """The whole turn's ids and clips, and its parts around the last clip's placeholders."""
    tok, cfg, _ = kit
    r = render(tok, cfg, messages)
    return (r, *around_last_clip(r.token_ids, cfg.tokens.audio_token))


async def collect(call) -> tuple[list[int], bytes, pb.Finished, pb.TalkerPrompt | None]:
    """Token ids, their talker rows' bytes, the Finished and the talker prompt."""
    ids, rows, finished, prompt = [], [], None, None
    async for msg in call:
        kind = msg.WhichOneof("kind")
        if kind == "text":
            ids += list(msg.text.token_ids)
            rows.append(msg.text.embeddings.data)
        elif kind == "talker_prompt":
            prompt = msg.talker_prompt
        elif kind == "finished":
            finished = msg.finished
    return ids, b"".join(rows), finished, prompt       # rows joined: how deltas merge into messages varies


def streamed_audio(thinker) -> tuple[float, float]:
    """voxpipe_streamed_audio_tokens_total: (before the commit, after it)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{thinker.metrics_ports['thinker']}/metrics").text
    found = [re.search(rf'^voxpipe_streamed_audio_tokens_total{{stage="thinker",when="{when}"}} (\S+)$', text, re.M)
             for when in ("before_commit", "after_commit")]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)     # none before the first streamed turn


def same_outputs(got, want) -> None:
    """Token ids and their rows equal; the talker prompt's lookups equal, and its audio rows (a hidden
    layer, which another chunking of the prefill sums in another order, as for any prefix-cache hit)
    within float32 rounding."""
    assert got[0] == want[0] and got[1] == want[1]
    g, w = got[3], want[3]
    for name in ("user_mm_mask", "user_token_ids", "assistant_head", "assistant_prefix", "tts_special"):
        assert getattr(g, name) == getattr(w, name), name
    a, b = from_proto(g.user_rows), from_proto(w.user_rows)
    mm = from_proto(w.user_mm_mask)
    assert torch.equal(a[~mm], b[~mm]) and torch.allclose(a[mm], b[mm], rtol=1e-4, atol=1e-5)


def params(**kw) -> dict:
    return dict(max_tokens=MAX_TOKENS, talker_rows=True, **kw)


async def whole(stub, rendered, **kw) -> tuple:
    start = pb.ThinkerStart(token_ids=pb.TokenIds(ids=rendered.token_ids),
                            audio_features=[to_proto(f) for f in rendered.audio_features], **(params() | kw))

    async def requests():
        yield pb.ThinkerRequest(start=start)

    return await collect(stub.Generate(requests()))


async def streamed(stub, prefix, prefix_clips, frames: list[torch.Tensor], suffix, per_message: int,
                   commit_tail: bool = True) -> tuple:
    raw = torch.cat(frames, dim=1)
    tail = raw[:, -3:] if commit_tail else raw[:, :0]
    body = raw[:, :raw.shape[1] - tail.shape[1]]

    async def requests():
        yield pb.ThinkerRequest(start=pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=prefix),
                                                      audio_features=[to_proto(f) for f in prefix_clips]))
        for i in range(0, body.shape[1], per_message):
            yield pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(body[:, i:i + per_message].contiguous())))
            # paced as speech is, roughly: a window's frames take 8 s to speak, its prefill far less
            await asyncio.sleep(0.5 if (i + per_message) // 800 > i // 800 else 0)
        start = pb.ThinkerStart(token_ids=pb.TokenIds(ids=suffix), **params())
        yield pb.ThinkerRequest(commit=pb.StreamCommit(log_mel=to_proto(tail.contiguous()), start=start))

    return await collect(stub.Generate(requests()))


def run(coro):
    return asyncio.run(coro)


def stub_of(thinker):
    return pb_grpc.ThinkerStub(grpc.aio.insecure_channel(thinker.address("thinker")))


@pytest.mark.parametrize("seconds,levels,per_message", [
    (3.0, (0.1,), 7),               # shorter than a window: all of it after the commit
    (17.3, (0.1,), 100),            # two windows prefilled before the commit
    (17.3, (1e-4, 0.3), 800),       # the maximum comes late: the windows are encoded again at the commit
])
def test_a_streamed_turn_equals_the_whole_turn(thinker, kit, tiny_model_dir, seconds, levels, per_message):
    frames = raw_frames(kit[2], speech(seconds, seed=int(seconds), levels=levels))
    clip = scale(torch.cat(frames, dim=1))
    rendered, prefix, suffix = split(kit, conversation([ChatMessage.text("system", "Be brief.")], clip))

    async def go():
        stub = stub_of(thinker)
        want = await whole(stub, rendered)
        got = await streamed(stub, prefix, [], frames, suffix, per_message)
        return want, got

    audio_before = streamed_audio(thinker)
    want, got = run(go())
    same_outputs(got, want)
    assert got[2].reason == want[2].reason and got[2].prompt_tokens == want[2].prompt_tokens
    windows = clip.shape[1] // 800
    # the clip's audio tokens by when their keys were made: only complete windows' before the commit,
    # none once the clip's maximum came late (its windows encoded again at the commit)
    heard, rest = (a - b for a, b in zip(streamed_audio(thinker), audio_before))
    assert heard + rest == audio_output_length(clip.shape[1], 50)
    assert heard % 104 == 0 and (heard == windows * 104 if levels == (0.1,) else heard == 0), (heard, rest)
    if levels == (0.1,):
        assert got[2].streamed_tokens >= len(prefix) // 16 * 16 + windows * 104 - 16
    if seconds > 10 and levels == (0.1,):
        ref = reference_thinker(tiny_model_dir, rendered.token_ids, rendered.audio_features, max_tokens=MAX_TOKENS)
        assert got[0] == ref.text_ids[:len(got[0])]


def test_a_streamed_second_turn_after_a_cached_first_equals_the_whole(thinker, kit):
    """Turn 1 sent whole (its blocks published), a later turn's clip streamed after an earlier clip:
    the conversation's text prefix comes from the cache (a streamed turn may be spoken: not past the
    earlier clip, whose talker rows no spoken turn left in the AudioRowCache), the outputs are the
    whole turn's."""
    first = scale(torch.cat(raw_frames(kit[2], speech(2.5, seed=5)), dim=1))
    turn1 = [ChatMessage.text("system", "You listen carefully and answer every recording in one short line."),
             ChatMessage.text("user", "I will send you recordings; are you ready?")]
    history = turn1 + [ChatMessage.text("assistant", "Ready."), *conversation([], first),
                       ChatMessage.text("assistant", "Yes.")]
    frames = raw_frames(kit[2], speech(9.0, seed=6))
    rendered, prefix, suffix = split(kit, conversation(history, scale(torch.cat(frames, dim=1))))

    async def go():
        stub = stub_of(thinker)
        await whole(stub, render(kit[0], kit[1], turn1))
        got = await streamed(stub, prefix, rendered.audio_features[:1], frames, suffix, 50, commit_tail=False)
        want = await whole(stub, rendered)
        again = await whole(stub, rendered, talker_rows=False)     # finds the streamed turn's published blocks
        return want, got, again

    want, got, again = run(go())
    same_outputs(got, want)
    assert got[2].cached_tokens > 0
    assert again[0] == want[0] and again[2].cached_tokens >= (len(rendered.token_ids) - 1) // 16 * 16


def test_a_cancelled_or_abandoned_turn_frees_everything(thinker, kit):
    frames = raw_frames(kit[2], speech(12.0, seed=7))
    raw = torch.cat(frames, dim=1)
    rendered, prefix, _ = split(kit, conversation([], scale(raw)))

    async def abandoned(how: str):
        stub = stub_of(thinker)

        async def requests():
            yield pb.ThinkerRequest(start=pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=prefix)))
            for i in range(0, 1000, 100):
                yield pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(raw[:, i:i + 100].contiguous())))
            await asyncio.sleep(1.0)       # the windows heard so far are prefilled
            if how == "cancel":
                yield pb.ThinkerRequest(cancel=pb.Cancel())
            elif how == "disconnect":
                await asyncio.sleep(30)

        call = stub.Generate(requests())
        if how == "disconnect":
            async def drop():
                await asyncio.sleep(2.0)
                call.cancel()
            asyncio.ensure_future(drop())
            with pytest.raises(asyncio.CancelledError):
                await collect(call)
            return None
        return (await collect(call))[2]

    for how in ("cancel", "end", "disconnect"):
        finished = run(abandoned(how))
        if finished is not None:
            assert finished.reason == pb.CANCELLED
        for _ in range(50):
            if thinker.metric("thinker", "voxpipe_kv_blocks", 'state="used",') == 0 and \
                    thinker.metric("thinker") == 0:
                break
            import time
            time.sleep(0.1)
        assert thinker.metric("thinker", "voxpipe_kv_blocks", 'state="used",') == 0, how
        assert thinker.metric("thinker") == 0, how


@pytest.mark.parametrize("first,then,code,says", [
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2]), max_tokens=3), None,
     grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: in the commit"),
    (pb.ThinkerStart(stream_audio=True, text="hi"), None, grpc.StatusCode.INVALID_ARGUMENT, "needs token_ids"),
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2])),
     pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(torch.zeros(3, 5)))),
     grpc.StatusCode.INVALID_ARGUMENT, "audio.log_mel"),
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2])),
     pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(torch.full((128, 5), float("nan"))))),
     grpc.StatusCode.INVALID_ARGUMENT, "audio.log_mel"),
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2])),
     pb.ThinkerRequest(commit=pb.StreamCommit(start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=[3]), max_tokens=2))),
     grpc.StatusCode.INVALID_ARGUMENT, "no frames"),
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2])),
     pb.ThinkerRequest(commit=pb.StreamCommit(log_mel=to_proto(torch.zeros(128, 50)),
                                              start=pb.ThinkerStart(request_id="x", token_ids=pb.TokenIds(ids=[3])))),
     grpc.StatusCode.INVALID_ARGUMENT, "request_id"),
    (pb.ThinkerStart(stream_audio=True, token_ids=pb.TokenIds(ids=[1, 2])),     # 32,000 frames: 4,160 tokens
     [pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(torch.zeros(128, 2000))))] * 16,
     grpc.StatusCode.OUT_OF_RANGE, "past the context of 4096"),
])
def test_bad_streamed_turns_are_refused(thinker, first, then, code, says):
    async def go():
        stub = stub_of(thinker)

        async def requests():
            yield pb.ThinkerRequest(start=first)
            for msg in then if isinstance(then, list) else [then] if then is not None else []:
                yield msg
            await asyncio.sleep(5)

        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(stub.Generate(requests()))
        return err.value

    err = run(go())
    assert err.code() == code and says in err.details(), err.details()
