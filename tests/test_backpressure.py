"""A slow client is throttled without stalling anyone else, and loses nothing."""

from __future__ import annotations

import asyncio
import time

import grpc

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
    slow_tokens = 3000  # with talker rows: far more bytes than the (fixed, 64 KiB) HTTP/2 window holds unread

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
