"""Stage to stage, through real processes: the caller's Listen stream going away frees the request in
every stage, and a talker or code2wav that dies mid-stream reaches the caller as a PipelineError
naming that stage, failing only the streams on the dead replica."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import torch

from conftest import STAGES, start_chain
from voxpipe.client import AudioEvent, DoneEvent, PipelineClient, PipelineError, SpeechRequest, StageEvent
from voxpipe.services.runtime.calls import AWAITS_ADMISSION_METADATA, STAGE_METADATA, is_admitted
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

LONG = dict(max_tokens=40, min_tokens=40, max_frames=400, min_frames=400)   # still speaking when a test acts


def wait_for(condition, timeout: float = 20.0) -> bool:
    """Poll `condition` (a state the stages reach, not a duration) until it holds or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def stack_metric(stack, stage: str, name: str = "voxpipe_active_streams", labels: str = "") -> float:
    import re

    import httpx

    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics").text
    m = re.search(rf'^{name}{{{labels}stage="{stage}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


# ----------------------------------------------------------------------------- the caller's Listen stream

def test_a_cancelled_listen_stream_frees_the_request_in_every_stage(stack):
    """The caller reads text from the thinker and audio from code2wav; when it cancels only the
    Listen stream (keeping the thinker stream), code2wav ends the request, the talker and the
    thinker follow, and the thinker stream ends with CANCELLED naming code2wav."""
    cancelled = {s: stack_metric(stack, s, "voxpipe_streams_total", 'outcome="cancelled",') for s in STAGES}
    errors = {s: stack_metric(stack, s, "voxpipe_streams_total", 'outcome="error",') for s in STAGES}

    async def go():
        async with grpc.aio.insecure_channel(stack.address("thinker")) as th, \
                grpc.aio.insecure_channel(stack.address("code2wav")) as cw:
            generate = pb_grpc.ThinkerStub(th).Generate()
            # the thinker must still be generating when the first audio reaches the listener: 40 tokens
            # were sometimes all made by then on a loaded 2-core CI machine (the talker starts on the
            # first row); 400 take far longer than the first frame
            await generate.write(pb.ThinkerRequest(start=pb.ThinkerStart(
                text="Talk for a while.", max_tokens=400, min_tokens=400,
                speech=pb.SpeechParams(max_frames=LONG["max_frames"], min_frames=LONG["min_frames"]))))
            await generate.done_writing()
            token = None
            while token is None:
                resp = await generate.read()
                if resp.WhichOneof("kind") == "routed" and resp.routed.stage == "code2wav":
                    token = resp.routed.listen_token
            listen = pb_grpc.Code2WavStub(cw).Listen(pb.ListenRequest(listen_token=token))
            while (await listen.read()).WhichOneof("kind") != "audio":
                pass
            # every stage holds the request now
            held = {s: stack_metric(stack, s) for s in STAGES}
            listen.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while await generate.read() is not grpc.aio.EOF:
                    pass
            return held, ended.value

    held, ended = asyncio.run(go())
    assert held == {s: 1 for s in STAGES}, held
    assert ended.code() == grpc.StatusCode.CANCELLED, (ended.code(), ended.details())
    assert (STAGE_METADATA, "code2wav") in tuple(ended.trailing_metadata() or ())
    assert "listener went away" in ended.details()
    assert wait_for(lambda: all(stack_metric(stack, s) == 0 for s in STAGES)), \
        {s: stack_metric(stack, s) for s in STAGES}
    assert stack_metric(stack, "code2wav", "voxpipe_streams_total", 'outcome="cancelled",') == cancelled["code2wav"] + 1
    assert {s: stack_metric(stack, s, "voxpipe_streams_total", 'outcome="error",') for s in STAGES} == errors


def test_a_routed_decode_cancelled_by_its_talker_frees_the_request(stack):
    """A to_listener Decode that its caller (a talker) cancels -- right after Accepted, after some
    frames, or while its listener reads -- leaves code2wav's engine idle every time. (The handler is
    cancelled while it waits for the request's end; that wait must not swallow the engine's cancel.)"""
    cancelled = stack_metric(stack, "code2wav", "voxpipe_streams_total", 'outcome="cancelled",')
    frames = pb.CodecFrames(codes=to_proto(torch.zeros(4, 16, dtype=torch.int32)))

    async def once(moment: int) -> None:
        async with grpc.aio.insecure_channel(stack.address("code2wav")) as cw:
            stub = pb_grpc.Code2WavStub(cw)
            decode = stub.Decode()
            await decode.write(pb.Code2WavRequest(start=pb.Code2WavStart(to_listener=True)))
            token = (await decode.read()).accepted.listen_token
            assert token
            if moment >= 1:
                await decode.write(pb.Code2WavRequest(frames=frames))
            if moment == 2:
                listen = stub.Listen(pb.ListenRequest(listen_token=token))
                assert (await listen.read()).WhichOneof("kind") == "audio"
            decode.cancel()
            if moment == 2:
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while await listen.read() is not grpc.aio.EOF:
                        pass
                assert ended.value.code() == grpc.StatusCode.CANCELLED

    for i in range(12):
        asyncio.run(once(i % 3))
        assert wait_for(lambda: stack_metric(stack, "code2wav") == 0, timeout=10), (i, stack_metric(stack, "code2wav"))
    assert stack_metric(stack, "code2wav", "voxpipe_streams_total", 'outcome="cancelled",') == cancelled + 12


# ----------------------------------------------------------------------------- admission

def test_a_stage_admits_a_stream_with_headers_and_refuses_a_waiting_caller_at_once(stack):
    """A stage sends its admission headers (calls.ADMITTED_METADATA) once it has read and queued a
    start, before any response; a refused start gets no such headers. A caller that says it awaits
    admission (and so writes nothing after its start) gets the refusal while its stream is still
    open: the server does not first wait for the client to stop writing."""
    async def go():
        async with grpc.aio.insecure_channel(stack.address("code2wav")) as cw:
            stub = pb_grpc.Code2WavStub(cw)
            decode = stub.Decode()
            await decode.write(pb.Code2WavRequest(start=pb.Code2WavStart(to_listener=True)))
            admitted = await decode.initial_metadata()
            decode.cancel()
            refused = stub.Decode(metadata=((AWAITS_ADMISSION_METADATA, "1"),), timeout=60)
            await refused.write(pb.Code2WavRequest(start=pb.Code2WavStart(encoding=99)))
            headers = await refused.initial_metadata()      # no done_writing: the stream stays open
            return admitted, headers, await refused.code(), await refused.details()

    admitted, headers, code, details = asyncio.run(go())
    assert is_admitted(admitted), admitted
    assert not is_admitted(headers), headers
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "encoding" in details, (code, details)


def test_a_refusal_waits_for_a_writing_caller_unless_it_awaits_admission_after_its_whole_start():
    """rpc_guard's drain, on a real grpc.aio server: a refusal waits for the caller to stop writing
    (grpc-Python would report it as INTERNAL otherwise) -- also for a caller that awaits admission
    while the server is still reading its start (it is still writing the start's chunks); only once
    the whole start is read (`start_read`) does the refusal of such a caller go out at once."""
    from voxpipe.services.runtime.rpc_guard import DRAIN_S, RequestGuard

    async def handler(requests, context):
        first = await requests.__anext__()
        if first == b"whole start":
            context.start_read()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "refused")
        yield b""

    async def go() -> dict:
        server = grpc.aio.server(interceptors=[RequestGuard()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "t.T", {"S": grpc.stream_stream_rpc_method_handler(handler)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        outcome = {}
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                for first, awaits in ((b"whole start", True), (b"part of a start", True), (b"whole start", False)):
                    call = ch.stream_stream("/t.T/S")(metadata=((AWAITS_ADMISSION_METADATA, "1"),) if awaits else ())
                    await call.write(first)
                    try:    # the status before the caller half-closes? (the drain would hold it DRAIN_S)
                        code = await asyncio.wait_for(asyncio.shield(call.code()), DRAIN_S / 4)
                        at_once = True
                    except asyncio.TimeoutError:
                        await call.done_writing()
                        code, at_once = await call.code(), False
                    outcome[(first, awaits)] = (code, at_once)
        finally:
            await server.stop(None)
        return outcome

    outcome = asyncio.run(go())
    assert outcome == {(b"whole start", True): (grpc.StatusCode.INVALID_ARGUMENT, True),
                       (b"part of a start", True): (grpc.StatusCode.INVALID_ARGUMENT, False),
                       (b"whole start", False): (grpc.StatusCode.INVALID_ARGUMENT, False)}, outcome


def test_a_stage_stream_writes_on_to_a_replica_without_admission_headers():
    """A replica from before admission headers (its headers come with its first response, without
    the key) still gets everything written after the start: the stream takes it for an older version
    once no status follows the headers. One that refuses (headers and status together) gets nothing
    more, and the reader sees its status."""
    from voxpipe.services.runtime.balancer import BalancedStream, StageBalancer

    async def old_server(requests, context):
        seen = []
        async for msg in requests:
            seen.append(msg)
            if len(seen) == 1:
                yield b"accepted"
        yield b"|".join(seen)

    async def refusing(requests, context):
        await requests.__anext__()
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        yield b""

    async def go() -> tuple:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Old": grpc.stream_stream_rpc_method_handler(old_server),
            "Refusing": grpc.stream_stream_rpc_method_handler(refusing)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        balancer = StageBalancer("talker", f"127.0.0.1:{port}", channel_options=[])
        try:
            results = []
            for method in ("Old", "Refusing"):
                stream = await BalancedStream(balancer, lambda ch: ch.stream_stream(f"/t.T/{method}")()).open()
                await stream.write(b"start")
                stream.end_head()
                await stream.write(b"row")
                await stream.done_writing()
                try:
                    results.append([r async for r in stream])
                except grpc.aio.AioRpcError as e:
                    results.append(e.code())
                stream.close()
            return tuple(results)
        finally:
            await balancer.close()
            await server.stop(None)

    old, refused = asyncio.run(go())
    assert old == [b"accepted", b"start|row"], old
    assert refused == grpc.StatusCode.RESOURCE_EXHAUSTED, refused


@pytest.mark.parametrize("reader", ["reading on", "stopped"])
def test_a_stream_failing_after_admission_sends_ending_and_its_status_beats_the_writes(reader):
    """A stage stream that fails after its admission while the caller writes without pause: the
    server (through rpc_guard) sends an Ending response, the caller's BalancedStream half-closes
    on it and drops later writes, and the status arrives with its own code every time, at once.
    Without Ending, a server whose reader had stopped drained for 2 s and then sent its status
    into the writes, which grpc-Python turned into INTERNAL "Internal error from Core". The Ending
    is not passed on to the reader. A caller that does not say it takes Ending (a stage from
    before it, which would fail on the unknown response) gets none."""
    from voxpipe.services.runtime.balancer import BalancedStream, StageBalancer
    from voxpipe.services.runtime.calls import ADMITTED_METADATA, TAKES_ENDING_METADATA
    from voxpipe.services.runtime.rpc_guard import RequestGuard

    takes = []

    async def failing(requests, context):
        await requests.__anext__()
        await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
        takes.append(context.takes_ending)
        if not context.takes_ending:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no ending for an older caller")
        rows = []

        async def read():
            async for msg in requests:
                rows.append(msg)
                if reader == "stopped" and len(rows) == 20:
                    return
        task = asyncio.ensure_future(read())        # as a stage's request reader
        while len(rows) < 20:
            await asyncio.sleep(0.001)
        assert context.takes_ending
        context.ending_sent()
        yield pb.TalkerResponse(ending=pb.Ending())
        try:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"failed after {len(rows)} rows")
        finally:
            task.cancel()

    async def go() -> list:
        server = grpc.aio.server(interceptors=[RequestGuard()])
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
            "Failing": grpc.stream_stream_rpc_method_handler(
                failing, request_deserializer=pb.TalkerRequest.FromString,
                response_serializer=pb.TalkerResponse.SerializeToString)})])
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        balancer = StageBalancer("talker", f"127.0.0.1:{port}", channel_options=[])
        row = pb.TalkerRequest(rows=pb.TextRows(token_ids=[1], rows=to_proto(torch.zeros(1, 4096))))
        outcomes = []
        try:
            for i in range(9):
                metadata = ((AWAITS_ADMISSION_METADATA, "1"),) + (((TAKES_ENDING_METADATA, "1"),) if i < 8 else ())
                stream = await BalancedStream(balancer, lambda ch: ch.stream_stream(
                    "/t.T/Failing", request_serializer=pb.TalkerRequest.SerializeToString,
                    response_deserializer=pb.TalkerResponse.FromString)(metadata=metadata)).open()
                await stream.write(pb.TalkerRequest(start=pb.TalkerStart(request_id="r")))
                stream.end_head()
                ended = asyncio.Event()

                async def write_on():
                    while not ended.is_set():
                        await stream.write(row)
                        await asyncio.sleep(0)      # a dropped write returns without yielding

                # the older caller writes nothing more: its status would race the writes (what Ending fixes)
                writer = asyncio.ensure_future(write_on() if i < 8 else asyncio.sleep(0))
                t0 = time.monotonic()
                try:
                    outcomes.append(("responses", [r async for r in stream], 0.0))
                except grpc.aio.AioRpcError as e:
                    outcomes.append((e.code(), e.details(), time.monotonic() - t0))
                ended.set()
                await asyncio.wait_for(writer, 30)
                stream.close()
            return outcomes
        finally:
            await balancer.close()
            await server.stop(None)

    outcomes = asyncio.run(go())
    for code, details, took in outcomes[:8]:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith("failed after"), (code, details)
        assert took < 1.5, f"the status waited {took:.1f} s: the caller did not half-close on the Ending"
    assert takes == [True] * 8 + [False], takes


def test_a_talker_refusing_a_start_reaches_every_caller_with_its_code_while_text_streams(stack):
    """The thinker opens the talker stream at admission and writes text rows for as long as its
    reply runs; a talker that refuses the start (max_frames beyond its context) fails each request
    with INVALID_ARGUMENT naming the talker -- not grpc's INTERNAL "Internal error from Core", which a
    status racing those writes turned into (tests/test_converse.py's bad input saw it on CI)."""
    def one(i: int) -> tuple:
        with grpc.insecure_channel(stack.address("thinker")) as ch:
            req = pb.ThinkerRequest(start=pb.ThinkerStart(
                request_id=f"refused-{i}", text="Talk for a while.", max_tokens=400, min_tokens=400,
                speech=pb.SpeechParams(max_frames=2**32 - 1)))
            with pytest.raises(grpc.RpcError) as err:
                list(pb_grpc.ThinkerStub(ch).Generate(iter([req]), timeout=120))
            stage = dict(err.value.trailing_metadata() or ()).get(STAGE_METADATA)
            return err.value.code(), err.value.details(), stage

    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(24)))
    for code, details, stage in results:
        assert code == grpc.StatusCode.OUT_OF_RANGE and "exceed the talker context" in details, (code, details)
        assert stage == "talker"


def test_the_callers_text_does_not_wait_for_the_talkers_admission(tiny_model_dir):
    """A real thinker process whose talker (a stand-in speaking the Talker protocol) admits the
    stream only once the thinker's caller has text: the text comes before the admission headers
    (the thinker's relay writes to the talker from a task of its own, so the first token never waits
    for the talker to read a large start), and the talker still gets every row in order."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from conftest import StageProcesses
    from voxpipe.services.runtime.calls import ADMITTED_METADATA

    async def go(procs: StageProcesses) -> tuple[dict, list[str]]:
        first_text, seen = asyncio.Event(), {}
        server = grpc.aio.server()
        talker_port = server.add_insecure_port("127.0.0.1:0")

        async def generate(requests, context):
            start = await requests.__anext__()
            seen["start"] = start.WhichOneof("kind")
            try:
                await asyncio.wait_for(first_text.wait(), 30)
                seen["text_before_admission"] = True
            except asyncio.TimeoutError:
                seen["text_before_admission"] = False
            await context.send_initial_metadata(((ADMITTED_METADATA, "1"),))
            seen["rows"] = []
            async for msg in requests:
                if msg.WhichOneof("kind") == "rows":
                    seen["rows"] += list(msg.rows.token_ids)
                elif msg.WhichOneof("kind") == "text_end":
                    seen["text_end"] = True
            yield pb.TalkerResponse(finished=pb.Finished(reason=pb.STOP, completion_tokens=0))

        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("voxpipe.v1.Talker", {
            "Generate": grpc.stream_stream_rpc_method_handler(
                generate, request_deserializer=pb.TalkerRequest.FromString,
                response_serializer=pb.TalkerResponse.SerializeToString)})])
        checker = health.aio.HealthServicer() if hasattr(health, "aio") else health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        await server.start()
        await checker.set("voxpipe.v1.Talker", health_pb2.HealthCheckResponse.SERVING)
        procs.start("thinker", "thinker", "--talker", f"127.0.0.1:{talker_port}")
        await asyncio.get_running_loop().run_in_executor(None, procs.wait_ready)
        kinds: list[str] = []
        text_ids: list[int] = []
        try:
            await talk(procs, first_text, kinds, text_ids)
        finally:
            await server.stop(None)
        seen["text_ids"] = text_ids
        return seen, kinds

    async def talk(procs, first_text, kinds, text_ids) -> None:
        async with grpc.aio.insecure_channel(procs.address("thinker")) as ch:
            call = pb_grpc.ThinkerStub(ch).Generate()
            await call.write(pb.ThinkerRequest(start=pb.ThinkerStart(
                request_id="admission-late", text="Say something.", max_tokens=6, min_tokens=6,
                speech=pb.SpeechParams(max_frames=8))))
            await call.done_writing()
            async for resp in call:
                kinds.append(resp.WhichOneof("kind"))
                if kinds[-1] == "text":
                    text_ids += list(resp.text.token_ids)
                    first_text.set()
            assert await call.code() == grpc.StatusCode.OK

    procs = StageProcesses(tiny_model_dir)
    try:
        seen, kinds = asyncio.run(go(procs))
    finally:
        procs.stop()
    assert seen["start"] == "start" and seen["text_before_admission"], seen
    assert "text" in kinds and kinds[-1] == "talker_finished", kinds
    assert seen.get("text_end") and len(seen["text_ids"]) == 6, seen
    assert seen["rows"] == seen["text_ids"][:len(seen["rows"])] and seen["rows"], seen


# ----------------------------------------------------------------------------- a replica dying mid-stream

@pytest.fixture(scope="module")
def chain(tiny_model_dir):
    """A thinker with two talkers, both sending frames to one code2wav: processes of this module's
    own (the tests kill them: a talker first, then code2wav)."""
    procs = start_chain(tiny_model_dir, talkers=2)
    yield procs
    procs.stop()


def talker_named(chain, address: str) -> str:
    return next(n for n in ("talker0", "talker1") if chain.address(n) == address)


def test_a_talker_dying_mid_stream_fails_its_streams_naming_the_talker(chain):
    """Two requests on the two talkers; the talker of the first is killed once its audio flows: that
    request fails with a PipelineError naming the talker, the other one completes."""
    async def go():
        async with PipelineClient(chain.address("thinker"), chain.address("code2wav")) as pc:
            first = pc.stream(SpeechRequest(text="Talk for a while.", **LONG))
            victim = None
            async for ev in first:
                if isinstance(ev, StageEvent) and ev.stage == "talker" and ev.kind == "routed":
                    victim = talker_named(chain, ev.address)
                if isinstance(ev, AudioEvent):
                    break
            # the second request goes to the other talker (fewest streams) and runs while the first fails
            second = asyncio.ensure_future(pc.collect(SpeechRequest(text="And you?", max_tokens=6, min_tokens=6,
                                                                    max_frames=30, min_frames=30)))
            chain.kill(victim)
            with pytest.raises(PipelineError) as failed:
                async for ev in first:
                    assert not isinstance(ev, DoneEvent)
            await first.aclose()
            return victim, failed.value, await second

    victim, failed, other = asyncio.run(go())
    # from the thinker stream (the thinker lost its talker) or the Listen stream (code2wav lost the
    # talker's frames stream), whichever the caller hears first: the talker, never the client's fault
    assert failed.stage == "talker", failed
    assert failed.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), failed
    assert failed.replica == chain.address(victim)
    assert other.done.frames == 29 and other.audio.shape[0] == 1920 * 29 - 555
    assert other.done.routes["talker"] != chain.address(victim)
    assert wait_for(lambda: all(chain.metric(n) == 0 for n in ("thinker", "code2wav")))


def test_code2wav_dying_mid_stream_fails_the_request_naming_code2wav(chain):
    """The chain's code2wav is killed once its audio flows: the caller gets a PipelineError naming
    code2wav (from the Listen stream or, through the talker and the thinker, the thinker stream),
    and the thinker and the surviving talker free the request."""
    async def go():
        async with PipelineClient(chain.address("thinker"), chain.address("code2wav")) as pc:
            stream = pc.stream(SpeechRequest(text="Talk for a while.", **LONG))
            with pytest.raises(PipelineError) as failed:
                async for ev in stream:
                    if isinstance(ev, AudioEvent) and chain.alive("code2wav"):
                        chain.kill("code2wav")
                    assert not isinstance(ev, DoneEvent)
            await stream.aclose()
            return failed.value

    failed = asyncio.run(go())
    assert failed.stage == "code2wav", failed
    assert failed.code == grpc.StatusCode.UNAVAILABLE, failed
    talkers = [n for n in ("talker0", "talker1") if chain.alive(n)]
    assert wait_for(lambda: all(chain.metric(n) == 0 for n in ["thinker", *talkers]))
