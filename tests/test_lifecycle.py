"""Service lifecycle: health and reflection, cancellation and client disconnects freeing the request's
slot in every stage, and graceful SIGTERM (drain in-flight streams, refuse new ones, exit 0)."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from conftest import free_port
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

STAGES = ("thinker", "talker", "code2wav")
SERVICE = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}
HIDDEN, GROUPS = 64, 16
PROMPT = [388, 268, 198, 199, 200, 389, 388, 272, 198]  # <|im_start|>user ... <|im_end|><|im_start|>assistant\n
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def run(coro):
    return asyncio.run(coro)


def metrics(stack, stage: str) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()


def metric(text: str, name: str, **labels) -> float:
    """The sample of `name` with exactly these labels (in any order) in a Prometheus text exposition."""
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) == labels:
            return float(m.group(2))
    return 0.0


def active(stack, stage: str) -> float:
    return metric(metrics(stack, stage), "voxpipe_active_streams", stage=stage)


def cancelled_total(stack, stage: str) -> float:
    return metric(metrics(stack, stage), "voxpipe_streams_total", stage=stage, outcome="cancelled")


def wait_idle(stack, stage: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while active(stack, stage) != 0:
        assert time.monotonic() < deadline, f"{stage}: voxpipe_active_streams did not return to 0"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- requests


def thinker_start(max_tokens: int, min_tokens: int = 0) -> pb.ThinkerRequest:
    return pb.ThinkerRequest(start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=PROMPT), max_tokens=max_tokens,
                                                   min_tokens=min_tokens))


def talker_start(max_frames: int = 40) -> pb.TalkerRequest:
    g = torch.Generator().manual_seed(0)
    f32 = lambda n: to_proto(torch.randn(n, HIDDEN, generator=g))  # noqa: E731
    prompt = pb.TalkerPrompt(user_rows=f32(4), user_mm_mask=to_proto(torch.zeros(4, dtype=torch.bool)),
                             user_token_ids=to_proto(torch.arange(4)), assistant_head=f32(3), tts_special=f32(3))
    return pb.TalkerRequest(start=pb.TalkerStart(prompt=prompt, speaker="chelsie", max_frames=max_frames,
                                                 min_frames=max_frames))


def talker_rows(n: int) -> pb.TalkerRequest:
    return pb.TalkerRequest(rows=pb.TextRows(rows=to_proto(torch.randn(n, HIDDEN))))


def code2wav_frames(n: int) -> pb.Code2WavRequest:
    return pb.Code2WavRequest(frames=pb.CodecFrames(codes=to_proto(torch.randint(0, 2048, (n, GROUPS)).to(torch.uint16))))


# Per stage: how to open a stream that keeps running (or waiting for input) until we stop it.
OPENING = {
    "thinker": lambda: [thinker_start(400, 400)],
    "talker": lambda: [talker_start(), talker_rows(2)],        # makes a frame, then waits for more text
    "code2wav": lambda: [pb.Code2WavRequest(start=pb.Code2WavStart()), code2wav_frames(3)],  # audio, then waits
}
CANCEL = {"thinker": pb.ThinkerRequest(cancel=pb.Cancel()), "talker": pb.TalkerRequest(cancel=pb.Cancel()),
          "code2wav": pb.Code2WavRequest(cancel=pb.Cancel())}
GOOD = {
    "thinker": lambda: [thinker_start(3)],
    "talker": lambda: [talker_start(4), talker_rows(2), pb.TalkerRequest(text_end=pb.TextEnd())],
    "code2wav": lambda: [pb.Code2WavRequest(start=pb.Code2WavStart()), code2wav_frames(2),
                         pb.Code2WavRequest(frames_end=pb.FramesEnd())],
}


async def read_rest(call) -> list:
    """The remaining responses (read() style: a call cannot mix read() and async iteration)."""
    out = []
    while (r := await call.read()) is not grpc.aio.EOF:
        out.append(r)
    return out


def open_call(channel: grpc.aio.Channel, stage: str):
    if stage == "code2wav":
        return pb_grpc.Code2WavStub(channel).Decode()
    stub = pb_grpc.ThinkerStub(channel) if stage == "thinker" else pb_grpc.TalkerStub(channel)
    return stub.Generate()


async def good_request(address: str, stage: str) -> list:
    async with grpc.aio.insecure_channel(address) as ch:
        call = open_call(ch, stage)
        for m in GOOD[stage]():
            await call.write(m)
        await call.done_writing()
        out = [r async for r in call]
    assert out[-1].WhichOneof("kind") == "finished"
    return out


# ---------------------------------------------------------------------------------------------- health, reflection


@pytest.mark.parametrize("stage", STAGES)
def test_health_and_reflection(stack, stage):
    """The session's stack is started as `voxpipe up` starts it (LocalStack): reflection on."""
    with grpc.insecure_channel(stack.address(stage)) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE[stage]):
            assert health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == SERVING
        with pytest.raises(grpc.RpcError) as e:
            health.Check(health_pb2.HealthCheckRequest(service="voxpipe.v1.Nope"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND

        reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
        reqs = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE[stage])]
        listed, files = list(reflect.ServerReflectionInfo(iter(reqs), timeout=5))
        names = {s.name for s in listed.list_services_response.service}
        assert {SERVICE[stage], "grpc.health.v1.Health"} <= names
        assert not (names & (set(SERVICE.values()) - {SERVICE[stage]}))  # only its own stage
        assert files.file_descriptor_response.file_descriptor_proto  # the stages.proto descriptor


def test_the_stacks_stages_run_without_the_working_directory_on_sys_path(stack):
    """`voxpipe up` starts each stage as `python -P -m voxpipe.cli` (voxpipe.module_command): started in a
    checkout's root, a stage imports the installed packages, not the root's kernels/ folder."""
    for stage in STAGES:
        argv = open(f"/proc/{stack.procs[stage].pid}/cmdline", "rb").read().split(b"\0")
        assert argv[1:4] == [b"-P", b"-m", b"voxpipe.cli"], argv[:4]


# ---------------------------------------------------------------------------------------------- cancel, disconnect


async def _open_and_read(address: str, stage: str, ch: grpc.aio.Channel):
    call = open_call(ch, stage)
    for m in OPENING[stage]():
        await call.write(m)
    first = await asyncio.wait_for(call.read(), timeout=30)  # the request is running
    assert first.WhichOneof("kind") in ("text", "frames", "audio")
    return call


@pytest.mark.parametrize("stage", STAGES)
def test_cancel_message_ends_the_stream_and_frees_the_slot(stack, stage):
    wait_idle(stack, stage)
    before = cancelled_total(stack, stage)

    async def go():
        async with grpc.aio.insecure_channel(stack.address(stage)) as ch:
            call = await _open_and_read(stack.address(stage), stage, ch)
            assert active(stack, stage) == 1
            await call.write(CANCEL[stage])
            rest = await read_rest(call)
            assert rest and rest[-1].WhichOneof("kind") == "finished"
            assert rest[-1].finished.reason == pb.CANCELLED
            assert await call.code() == grpc.StatusCode.OK

    run(go())
    wait_idle(stack, stage)
    assert cancelled_total(stack, stage) == before + 1
    run(good_request(stack.address(stage), stage))


@pytest.mark.parametrize("stage", STAGES)
def test_client_disconnect_frees_the_slot(stack, stage):
    wait_idle(stack, stage)
    before = cancelled_total(stack, stage)

    async def go():
        async with grpc.aio.insecure_channel(stack.address(stage)) as ch:
            call = await _open_and_read(stack.address(stage), stage, ch)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call.read()

    run(go())
    wait_idle(stack, stage)
    assert cancelled_total(stack, stage) == before + 1
    run(good_request(stack.address(stage), stage))


def test_more_disconnects_than_slots_leak_nothing(stack):
    """20 cancelled / abandoned thinker streams (the engine has 16 slots); then 16 at once still run."""
    wait_idle(stack, "thinker")

    async def go():
        async with grpc.aio.insecure_channel(stack.address("thinker")) as ch:
            for i in range(20):
                call = await _open_and_read(stack.address("thinker"), "thinker", ch)
                if i % 2:
                    call.cancel()
                else:
                    await call.write(CANCEL["thinker"])
                    assert (await read_rest(call))[-1].finished.reason == pb.CANCELLED
        await asyncio.gather(*(asyncio.wait_for(good_request(stack.address("thinker"), "thinker"), 60)
                               for _ in range(16)))

    run(go())
    wait_idle(stack, "thinker")


# ---------------------------------------------------------------------------------------------- SIGTERM


def start_thinker(model_dir, grace: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voxpipe.cli", "thinker", "--model", str(model_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--grace", str(grace),
                             "--max-batch", "2"], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300      # a loaded 2-core machine imports and loads slowly
    while True:
        line = proc.stdout.readline()
        if "ready on port" in line:
            return proc, f"127.0.0.1:{port}"
        if (not line and proc.poll() is not None) or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"thinker did not start (exit code {proc.poll()})")


async def _health(health, name: str = "") -> int:
    return (await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)).status


def test_sigterm_drains_in_flight_streams_refuses_new_ones_and_exits_0(tiny_model_dir):
    # the drain ends when the stream does (~2 s on an idle machine), so a long grace costs nothing;
    # it only lets a loaded machine's slower stream finish inside it
    grace = 60.0
    proc, address = start_thinker(tiny_model_dir, grace)
    tokens = 400
    try:
        async def go():
            async with grpc.aio.insecure_channel(address) as ch:
                health = health_pb2_grpc.HealthStub(ch)
                assert await _health(health) == SERVING
                call = open_call(ch, "thinker")
                await call.write(thinker_start(tokens, tokens))
                await call.done_writing()
                got = [await call.read()]
                proc.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                while await _health(health) != NOT_SERVING:
                    assert time.monotonic() - t0 < 5, "health did not turn NOT_SERVING"
                    await asyncio.sleep(0.01)
                assert await _health(health, "voxpipe.v1.Thinker") == NOT_SERVING
                refused = open_call(ch, "thinker")
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await refused.write(thinker_start(2))
                    # half-closed: the refusal goes out at once, not after rpc_guard's wait for a writer
                    await refused.done_writing()
                    await refused.read()
                # "draining" (the servicer's refusal, not the stopped server's): the first stream was
                # still generating, and every check above ran while the server drained
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in e.value.details()
                in_flight = time.monotonic()
                got += await read_rest(call)
                assert await call.code() == grpc.StatusCode.OK
                return got, in_flight

        got, in_flight = run(go())
        texts = [r for r in got if r.WhichOneof("kind") == "text"]
        # every token, in order (deltas that wait together travel as one message)
        assert [i for t in texts for i in range(t.text.index, t.text.index + len(t.text.token_ids))] == list(range(tokens))
        assert got[-1].WhichOneof("kind") == "finished"
        assert got[-1].finished.reason == pb.LENGTH and got[-1].finished.completion_tokens == tokens
        assert proc.wait(timeout=grace) == 0
        assert time.monotonic() - in_flight < grace
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_with_a_stream_longer_than_the_grace_still_exits_0(tiny_model_dir):
    grace = 1.0
    proc, address = start_thinker(tiny_model_dir, grace)
    try:
        async def go():
            async with grpc.aio.insecure_channel(address) as ch:
                call = open_call(ch, "thinker")
                await call.write(thinker_start(3500, 3500))  # ~15 s of tokens on an idle machine
                await call.done_writing()
                await call.read()
                t0 = time.monotonic()      # before the signal: the server's grace starts after it
                proc.send_signal(signal.SIGTERM)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await read_rest(call)
                assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
                return t0, time.monotonic()

        t0, cut = run(go())
        assert cut - t0 >= grace      # the stream ran on for the whole grace, then was cut
        # exit 0 soon after the cut (not after the stream's remaining tokens); measured from the cut,
        # which a loaded machine delivers later than SIGTERM + grace
        assert proc.wait(timeout=15) == 0
        assert time.monotonic() - cut < 15
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- neighbours


def _thinker_prompt(i: int) -> pb.ThinkerRequest:
    ids = [388, 268] + [200 + 7 * i + j for j in range(3 + 2 * i)] + [389, 388, 272, 198]
    return pb.ThinkerRequest(start=pb.ThinkerStart(token_ids=pb.TokenIds(ids=ids), max_tokens=40, min_tokens=40))


def _talker_request(i: int) -> list:
    g = torch.Generator().manual_seed(100 + i)
    f32 = lambda n: to_proto(torch.randn(n, HIDDEN, generator=g))  # noqa: E731
    prompt = pb.TalkerPrompt(user_rows=f32(3 + i), user_mm_mask=to_proto(torch.zeros(3 + i, dtype=torch.bool)),
                             user_token_ids=to_proto(torch.arange(3 + i)), assistant_head=f32(3), tts_special=f32(3))
    return [pb.TalkerRequest(start=pb.TalkerStart(prompt=prompt, speaker="ethan", max_frames=25, min_frames=25)),
            pb.TalkerRequest(rows=pb.TextRows(rows=f32(4))), pb.TalkerRequest(text_end=pb.TextEnd())]


def _outputs(responses: list) -> list:
    kinds = [r.WhichOneof("kind") for r in responses]
    assert kinds[-1] == "finished"
    if "text" in kinds:
        return [t for r in responses if r.WhichOneof("kind") == "text" for t in r.text.token_ids]
    return [bytes(r.frames.codes.data) for r in responses if r.WhichOneof("kind") == "frames"]


@pytest.mark.parametrize("stage,how", [("thinker", "cancel"), ("thinker", "disconnect"), ("talker", "cancel"),
                                       ("talker", "disconnect")])
def test_stopping_one_stream_leaves_its_neighbours_exact(stack, stage, how):
    """Three streams run together; the first (slot 0) is stopped mid-stream, so the engine moves another
    sequence's cache into its slot. The other two still produce exactly what they produce alone."""
    make = (lambda i: [_thinker_prompt(i)]) if stage == "thinker" else _talker_request
    wait_idle(stack, stage)

    async def alone(i: int) -> list:
        async with grpc.aio.insecure_channel(stack.address(stage)) as ch:
            call = open_call(ch, stage)
            for m in make(i):
                await call.write(m)
            await call.done_writing()
            return _outputs(await read_rest(call))

    async def together() -> list:
        async with grpc.aio.insecure_channel(stack.address(stage)) as ch:
            calls, seen = [], []
            for i in range(3):
                call = open_call(ch, stage)
                for m in make(i):
                    await call.write(m)
                seen.append([await call.read()])  # running before the next one starts: stream 0 holds slot 0
                calls.append(call)
            for c, s in zip(calls[1:], seen[1:]):
                s.append(await c.read())
            if how == "cancel":
                await calls[0].write(CANCEL[stage])
                assert (await read_rest(calls[0]))[-1].finished.reason == pb.CANCELLED
            else:
                calls[0].cancel()
            rest = await asyncio.gather(*(read_rest(c) for c in calls[1:]))
            return [s + r for s, r in zip(seen[1:], rest)]

    solo = [run(alone(i)) for i in (1, 2)]
    for i, (responses, want) in enumerate(zip(run(together()), solo), start=1):
        assert _outputs(responses) == want, i
    wait_idle(stack, stage)


# ---------------------------------------------------------------------------------------------- connection age


def test_an_aged_connection_keeps_its_active_stream(tiny_model_dir):
    """--max-connection-age 1 with a 0.5 s drain grace: a code2wav stream fed and read slowly for
    ~4 s on one connection gets all its audio (the aged connection is told to go away but not
    closed under the stream), and a new call after it is served. The same process has reflection
    off (the default: no flag) and its --metrics-port on --host only."""
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "voxpipe.cli", "code2wav", "--model", str(tiny_model_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                             "--max-connection-age", "1", "--grace", "0.5",
                             "--metrics-port", str(metrics_port)], stdout=subprocess.PIPE, text=True)
    while "ready on port" not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, "code2wav did not start"
    address, frames = f"127.0.0.1:{port}", 8
    try:
        async def go():
            async with grpc.aio.insecure_channel(address) as ch:
                t0 = time.monotonic()
                call = open_call(ch, "code2wav")
                await call.write(pb.Code2WavRequest(start=pb.Code2WavStart()))
                for _ in range(frames):                 # a slow writer ...
                    await call.write(code2wav_frames(1))
                    await asyncio.sleep(0.5)
                await call.write(pb.Code2WavRequest(frames_end=pb.FramesEnd()))
                await call.done_writing()
                got = []
                while (r := await call.read()) is not grpc.aio.EOF:   # ... and a slow reader
                    got.append(r)
                    await asyncio.sleep(0.05)
                elapsed = time.monotonic() - t0
                assert await call.code() == grpc.StatusCode.OK
                again = await good_request(address, "code2wav")
            # reflection off, asked on a new connection (the aged one may be going away: not what is checked)
            async with grpc.aio.insecure_channel(address) as fresh:
                # nothing written: an unknown method's status can race a client write, and grpc-Python
                # then reports INTERNAL instead of the server's UNIMPLEMENTED (grpc/grpc#36066)
                reflection = reflection_pb2_grpc.ServerReflectionStub(fresh).ServerReflectionInfo()
                return got, elapsed, again, await reflection.code()

        got, elapsed, again, reflection_code = run(go())
        assert elapsed > 1 + 0.5 + 2, elapsed                 # longer than the age plus its old grace
        assert got[-1].WhichOneof("kind") == "finished" and got[-1].finished.completion_tokens == frames
        assert sum(r.audio.num_samples for r in got if r.WhichOneof("kind") == "audio") == got[-1].finished.samples > 0
        assert again[-1].WhichOneof("kind") == "finished"
        assert reflection_code == grpc.StatusCode.UNIMPLEMENTED
        assert "voxpipe_active_streams" in urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                                                  timeout=5).read().decode()
        with pytest.raises(ConnectionRefusedError):      # not on another loopback address
            socket.create_connection(("127.0.0.2", metrics_port), timeout=5).close()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
