"""A slow client is throttled without stalling anyone else, and loses nothing."""

from __future__ import annotations

import asyncio
import time

import grpc
import torch

from voxpipe.services.runtime.engine import Outbox
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc


def test_outbox_saturates_and_wakes_the_engine_when_half_drained():
    async def go():
        box = Outbox(asyncio.get_running_loop(), limit=8)
        woken = []
        box.on_drain = lambda: woken.append(box.backlog)
        for i in range(8):
            box.put(i)
        assert box.saturated
        got = [await box.get() for _ in range(4)]
        assert got == [0, 1, 2, 3] and woken == [4] and not box.saturated
        assert [await box.get() for _ in range(4)] == [4, 5, 6, 7]
    asyncio.run(go())


def test_waiting_outputs_travel_as_one_message(tiny_model_dir):
    """A stage handler sends the outputs already waiting in a request's outbox as one message where
    they concatenate (talker frames, code2wav audio), and nothing else changes: order, offsets and
    content are kept, non-contiguous or different outputs go separately. The audio is encoded
    (pcm16 or float32, as the request asked) after merging: the same bytes as chunk by chunk."""
    import functools

    import numpy as np

    from voxpipe.cli import build_parser
    from voxpipe.services.code2wav import server as code2wav_server
    from voxpipe.services.code2wav.engine import Code2WavJob
    from voxpipe.services.code2wav.server import encode_samples
    from voxpipe.services.runtime.outputs import AudioOut, Finished, FinishReason, FramesOut
    from voxpipe.services.runtime.tensors import concat_rows, from_proto, to_proto
    from voxpipe.services.talker import server as talker_server

    def audio(offset: int, n: int) -> AudioOut:
        return AudioOut(offset, np.linspace(-1.2, 1.2, n, dtype=np.float32) * (offset % 5) / 4)

    ns = build_parser().parse_args(["code2wav", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "2"])
    servicer = code2wav_server.build(ns)
    echo = FramesOut(0, torch.ones(2, 16, dtype=torch.uint16))
    items = (audio(0, 10), audio(10, 5), audio(15, 7), audio(40, 3), echo, audio(43, 2), Finished(FinishReason.STOP))

    async def go(encoding: int) -> list:
        job = Code2WavJob(request_id="c", outbox=Outbox(asyncio.get_running_loop()), encoding=encoding)
        for item in items:
            job.outbox.put(item)
        await asyncio.sleep(0)             # the puts land on the loop
        return [m async for m in servicer.serve_request(job, None, None)]

    for encoding in (pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
        sent = asyncio.run(go(encoding))
        assert [m.WhichOneof("kind") for m in sent] == ["audio", "audio", "frames", "audio", "finished"]
        first = sent[0].audio
        assert (first.sample_offset, first.num_samples, first.encoding, first.sample_rate) == (0, 22, encoding, 24000)
        assert first.data == b"".join(encode_samples(a.samples, encoding) for a in items[:3])
        assert (sent[1].audio.sample_offset, sent[1].audio.num_samples) == (40, 3)      # an echo between: apart
        assert torch.equal(from_proto(sent[2].frames.codes), echo.codes)
        assert sent[4].finished.reason == pb.STOP

    ns = build_parser().parse_args(["talker", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "2"])
    talker = talker_server.build(ns)
    a, b = ((torch.arange(16 * n).view(n, 16) + k).to(torch.uint16) for n, k in ((1, 0), (2, 100)))
    frames = [FramesOut(0, a), FramesOut(1, b)]
    merged = talker.merge(*frames)
    assert merged.index == 0 and torch.equal(merged.codes, torch.cat((a, b)))
    wire = talker.to_proto(None, merged).frames                                       # as the bytes concatenated
    assert wire.index == 0 and wire.codes == concat_rows(to_proto(a), to_proto(b))
    assert talker.merge(frames[1], frames[0]) is None                                # out of order: apart
    assert talker.merge(frames[0], Finished(FinishReason.STOP)) is None
    assert concat_rows(to_proto(a), to_proto(a.view(16, 1))) is None                 # shapes differ

    from voxpipe.services.runtime.outputs import TextOut, TokenLogprob
    from voxpipe.services.thinker import server as thinker_server
    from voxpipe.services.thinker.job import ThinkerJob

    ns = build_parser().parse_args(["thinker", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "2"])
    thinker, _ = thinker_server.build(ns)
    rows = torch.randn(3, 8).to(torch.bfloat16)
    job = ThinkerJob(request_id="t", outbox=None)
    logprob = TokenLogprob(7, -0.25, ((7, -0.25), (9, -2.0)))

    def text(index: int, ids: list[int], txt: str, emb: torch.Tensor | None, lp=()) -> TextOut:
        return TextOut(index, tuple(ids), txt, emb, lp)

    merged = thinker.merge(text(4, [7], "He", rows[:1], (logprob,)), text(5, [8, 9], "llo", rows[1:]))
    assert (merged.index, merged.token_ids, merged.text, merged.logprobs) == (4, (7, 8, 9), "Hello", (logprob,))
    assert torch.equal(merged.rows, rows)
    wire = thinker.to_proto(job, merged).text                                        # as the bytes concatenated
    assert (wire.index, list(wire.token_ids), wire.text) == (4, [7, 8, 9], "Hello")
    assert wire.embeddings == concat_rows(to_proto(rows[:1]), to_proto(rows[1:]))
    assert wire.logprobs[0] == pb.TokenLogprob(token_id=7, logprob=-0.25, token=thinker.token_bytes(7), top=[
        pb.TopLogprob(token_id=7, logprob=-0.25, token=thinker.token_bytes(7)),
        pb.TopLogprob(token_id=9, logprob=-2.0, token=thinker.token_bytes(9))]) and len(wire.logprobs) == 1
    assert thinker.merge(text(4, [7], "a", None), text(5, [8], "b", None)).text == "ab"
    assert thinker.merge(text(4, [7], "a", rows[:1]), text(5, [8], "b", None)) is None   # rows on one side only
    assert thinker.merge(text(4, [7], "a", None), text(6, [8], "b", None)) is None       # a gap
    assert thinker.merge(text(4, [7], "a", rows[:1]), Finished(FinishReason.STOP)) is None
    # outputs whose text the engine left out (no stop strings) merge too; the servicer makes it once, in order
    ids = thinker.tokenizer.encode("Hello world, again", add_special_tokens=False)
    plain = [text(i, [t], None, None) for i, t in enumerate(ids)]
    merged = functools.reduce(thinker.merge, plain)
    assert merged.text is None and merged.token_ids == tuple(ids)
    assert thinker.merge(plain[0], text(1, [7], "x", None)) is None                  # text made and not: apart
    assert thinker.to_proto(ThinkerJob("u", None), merged).text.text == "Hello world, again"
    one = ThinkerJob("v", None)
    assert "".join(thinker.to_proto(one, o).text.text for o in plain) == "Hello world, again"


def test_typed_finished_is_the_wire_finished():
    from voxpipe.services.runtime.outputs import Finished, FinishReason
    from voxpipe.services.runtime.server import finished_proto

    assert {r.name: r.value for r in FinishReason} == {
        "UNSPECIFIED": pb.FINISH_REASON_UNSPECIFIED, "STOP": pb.STOP, "LENGTH": pb.LENGTH, "CANCELLED": pb.CANCELLED}
    assert len(FinishReason) == len(pb.FinishReason.keys())
    assert finished_proto(Finished(FinishReason.LENGTH, 3, 4, 5)) == pb.Finished(
        reason=pb.LENGTH, prompt_tokens=3, completion_tokens=4, samples=5)


def _gauge(stack, stage: str, name: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and f'stage="{stage}"' in line)


def _start(prompt: list[int], tokens: int, rows: bool) -> pb.ThinkerRequest:
    return pb.ThinkerRequest(start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=prompt), max_tokens=tokens,
                                                   min_tokens=tokens, talker_rows=rows))


def test_a_client_that_stops_reading_does_not_stall_others_and_loses_nothing(stack, tokenizer, omni_config):
    from voxpipe.services.thinker.prompt import ChatMessage, render

    prompt = render(tokenizer, omni_config.thinker, [ChatMessage.text("user", "slow reader")]).token_ids
    # with talker rows (a float row a token): several times what the (fixed, 64 KiB) HTTP/2 window and
    # the 64-item outbox hold unread (400 tokens were already throttled on a 2-core machine)
    slow_tokens = 1000

    async def go():
        # no BDP probing: the receive window stays small, so an unread stream really backs up
        async with grpc.aio.insecure_channel(stack.address("thinker"), options=[("grpc.http2.bdp_probe", 0)]) as ch:
            stub = pb_grpc.ThinkerStub(ch)
            slow = stub.Generate(iter([_start(prompt, slow_tokens, True)]))
            first = await slow.read()                       # then stop reading for a while
            assert first.WhichOneof("kind") in ("talker_prompt", "text")
            t0 = time.perf_counter()
            fast = [r async for r in stub.Generate(iter([_start(prompt, 16, False)]))]
            fast_s = time.perf_counter() - t0
            assert fast[-1].finished.reason == pb.LENGTH and fast[-1].finished.completion_tokens == 16
            throttled, deadline = 0.0, time.monotonic() + 20
            while throttled < 1 and time.monotonic() < deadline:  # the engine pauses the unread stream
                await asyncio.sleep(0.25)
                throttled = _gauge(stack, "thinker", "voxpipe_throttled_streams")
            indices = []
            while True:                                     # resume: everything arrives, in order
                r = await slow.read()
                if r is grpc.aio.EOF:
                    break
                if r.WhichOneof("kind") == "text":
                    indices.extend(range(r.text.index, r.text.index + len(r.text.token_ids)))
                elif r.WhichOneof("kind") == "finished":
                    assert r.finished.completion_tokens == slow_tokens
            return fast_s, indices, throttled

    fast_s, indices, throttled = asyncio.run(go())
    assert throttled >= 1, "the slow stream was never paused"
    assert fast_s < 30, f"the other request took {fast_s:.1f} s"
    assert indices == list(range(slow_tokens))
