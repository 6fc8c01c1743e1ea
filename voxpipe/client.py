"""The pipeline client: chains the Thinker, Talker and Code2Wav streams for one request.

    async with PipelineClient(thinker="localhost:50051", talker="localhost:50052",
                              code2wav="localhost:50053") as client:
        async for event in client.stream(SpeechRequest(token_ids=ids, speaker="ethan")):
            ...   # TextEvent / AudioEvent / DoneEvent

The thinker's talker rows go to the talker as they arrive; every codec frame goes to code2wav
the moment it exists; audio comes back chunk by chunk. Cancelling the iteration (or an error
in any stage) cancels all three calls, which frees the request's slot in every stage.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from voxpipe.balancer import BalancedStream, BalancerOptions, NoReplicaError, Replica, StageBalancer
from voxpipe.services.runtime import tracing
from voxpipe.services.runtime.tensors import from_proto, split_message, to_proto
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass
class SpeechRequest:
    token_ids: list[int] | None = None        # rendered prompt (see services.thinker.prompt.render)
    text: str | None = None                   # or: one user turn, rendered by the thinker
    audio_features: list[torch.Tensor] = field(default_factory=list)
    speaker: str = "ethan"
    audio: bool = True                        # False: text only (the talker and code2wav are not used)
    max_tokens: int = 0
    min_tokens: int = 0
    max_frames: int = 0
    min_frames: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    encoding: int = pb.AUDIO_PCM16
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def sampling(self) -> pb.Sampling:
        s = pb.Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        if self.seed is not None:
            s.seed = self.seed
        return s


@dataclass
class TextEvent:
    index: int
    token_ids: list[int]
    text: str


@dataclass
class AudioEvent:
    sample_offset: int
    sample_rate: int
    samples: np.ndarray            # float32 in [-1, 1] (decoded from the wire encoding)
    data: bytes                    # the wire bytes (pcm16 or float32 little-endian)


@dataclass
class FramesEvent:
    index: int
    codes: torch.Tensor            # [n, num_code_groups] int64


@dataclass
class DoneEvent:
    text_finish: int               # pb.FinishReason
    audio_finish: int | None
    prompt_tokens: int
    completion_tokens: int
    frames: int
    samples: int


class PipelineError(RuntimeError):
    """A stage failed the request. `replica`: the address of the stage replica it was on (for
    logs; not part of the message, which clients may see)."""

    def __init__(self, stage: str, code: grpc.StatusCode | None, details: str, replica: str | None = None) -> None:
        super().__init__(f"{stage}: {code.name if code else 'ERROR'}: {details}")
        self.stage, self.code, self.details, self.replica = stage, code, details, replica


def _options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


HEALTH_SERVICES = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}


def _balancer(stage: str, addresses: str | list[str], max_message_bytes: int,
              options: BalancerOptions | None) -> StageBalancer:
    return StageBalancer(stage, addresses, channel_options=_options(max_message_bytes), options=options,
                         health_service=HEALTH_SERVICES[stage])


def _decode_audio(chunk: pb.AudioChunk) -> np.ndarray:
    if chunk.encoding == pb.AUDIO_FLOAT32:
        return np.frombuffer(chunk.data, dtype="<f4").astype(np.float32)
    return np.frombuffer(chunk.data, dtype="<i2").astype(np.float32) / 32767.0


class PipelineClient:
    def __init__(self, thinker: str | list[str], talker: str | list[str] | None = None,
                 code2wav: str | list[str] | None = None, *, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 metadata: tuple[tuple[str, str], ...] = (), balancing: BalancerOptions | None = None) -> None:
        """Each stage: `host:port` and/or `dns:///name:port` entries, comma-separated or a list; every
        address (every DNS record) is one replica (see voxpipe.balancer). `balancing`: re-resolution,
        health cool-down and retry settings."""
        self.max_message_bytes = max_message_bytes
        self.thinker = _balancer("thinker", thinker, max_message_bytes, balancing)
        self.talker = _balancer("talker", talker, max_message_bytes, balancing) if talker else None
        self.code2wav = _balancer("code2wav", code2wav, max_message_bytes, balancing) if code2wav else None
        self.metadata = metadata

    async def __aenter__(self) -> "PipelineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for p in (self.thinker, self.talker, self.code2wav):
            if p is not None:
                await p.close()

    async def _write(self, call, msg, chunk_type, wrap) -> None:
        """Write `wrap(msg)`, split into a head and PayloadChunk continuations when too large."""
        head, chunks = split_message(msg, self.max_message_bytes - 1024)
        await call.write(wrap(head))
        for data in chunks:
            await call.write(chunk_type(data))

    async def stream(self, req: SpeechRequest, *, metadata: tuple[tuple[str, str], ...] = (),
                     context: otel_context.Context | None = None,
                     ) -> AsyncIterator[TextEvent | FramesEvent | AudioEvent | DoneEvent]:
        """`metadata`: extra gRPC metadata for the three calls. `context`: the OpenTelemetry context
        to trace under (default: the current one). The thinker call is a child span of it, the
        talker call a child of the thinker call, the code2wav call a child of the talker call;
        each call carries its span as W3C `traceparent` metadata."""
        parent_context = context if context is not None else otel_context.get_current()
        if req.audio and (self.talker is None or self.code2wav is None):
            raise ValueError("audio output needs talker and code2wav addresses")
        start = pb.ThinkerStart(request_id=req.request_id, sampling=req.sampling(), max_tokens=req.max_tokens,
                                min_tokens=req.min_tokens, talker_rows=req.audio,
                                audio_features=[to_proto(f.float()) for f in req.audio_features])
        if req.token_ids is not None:
            start.token_ids.ids.extend(req.token_ids)
        else:
            start.text = req.text or ""
        events: asyncio.Queue = asyncio.Queue()
        streams: dict[str, BalancedStream] = {}

        spans: dict[str, trace.Span] = {}

        async def open_call(balancer: StageBalancer, method: str, parent: otel_context.Context):
            """A stream on one replica of the stage (BalancedStream: moved to another replica if
            refused before its first response)."""
            stage = balancer.stage
            stub_cls = {"thinker": pb_grpc.ThinkerStub, "talker": pb_grpc.TalkerStub,
                        "code2wav": pb_grpc.Code2WavStub}[stage]
            service = stub_cls.__name__.removesuffix("Stub")
            span = tracing.tracer().start_span(
                f"voxpipe.v1.{service}/{method}", context=parent, kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": f"voxpipe.v1.{service}", "rpc.method": method,
                            "voxpipe.request_id": req.request_id})
            spans[stage] = span
            span_context = trace.set_span_in_context(span, parent)
            call_metadata = tuple(self.metadata) + tuple(metadata) + tracing.inject_metadata(span_context)

            def on_replica(replica: Replica) -> None:
                span.set_attribute("server.address", replica.address)

            stream = BalancedStream(balancer, lambda channel: getattr(stub_cls(channel), method)(
                metadata=call_metadata), on_replica)
            streams[stage] = stream
            try:
                await stream.open()
            except NoReplicaError as e:
                raise PipelineError(stage, grpc.StatusCode.UNAVAILABLE, str(e)) from None
            return stream, span_context

        def replica_of(stage: str) -> str | None:
            stream = streams.get(stage)
            return stream.replica.address if stream is not None and stream.replica is not None else None

        async def to_stage(stage: str, write) -> None:
            """A write into `stage`'s call: when it fails, the failure is that stage's, not the writer's."""
            try:
                await write
            except grpc.aio.AioRpcError as e:
                raise PipelineError(stage, e.code(), e.details(), replica_of(stage)) from None

        async def to_talker(ta, msg: pb.TalkerRequest | None) -> None:
            """Text for the talker (None: half-close). A talker that has finished (max_frames reached
            before the text ended) takes no more: the write is dropped, not an error."""
            if done["audio"] is not None:
                return
            try:
                await to_stage("talker", ta.write(msg) if msg is not None else ta.done_writing())
            except asyncio.InvalidStateError:  # it finished while this write was on its way
                pass
            except PipelineError:
                # The talker may have finished (max_frames) and closed its stream before its Finished
                # message was read here: let the reader catch up, then only a real failure counts.
                reader = talker_task.get("task")
                if reader is not None:
                    await asyncio.wait([reader], timeout=10)
                if done["audio"] is None:
                    raise

        async def guarded(stage: str, coro):
            try:
                await coro
            except PipelineError as e:
                if e.stage in spans:
                    tracing.grpc_error(spans[e.stage], e.code, e.details or "")
                await events.put(e)
            except grpc.aio.AioRpcError as e:
                if stage in spans:
                    tracing.grpc_error(spans[stage], e.code(), e.details() or "")
                await events.put(PipelineError(stage, e.code(), e.details(), replica_of(stage)))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - surfaced to the caller
                if stage in spans:
                    tracing.grpc_error(spans[stage], None, repr(e))
                await events.put(PipelineError(stage, None, repr(e)))
            finally:
                span = spans.pop(stage, None)
                if span is not None:
                    span.end()

        done = {"text": None, "audio": None}
        talker_task: dict[str, asyncio.Task] = {}
        usage = {"prompt": 0, "completion": 0, "frames": 0, "samples": 0}

        async def run_thinker() -> None:
            th, thinker_context = await open_call(self.thinker, "Generate", parent_context)
            await self._write(th, start, lambda d: pb.ThinkerRequest(chunk=pb.PayloadChunk(data=d)),
                              lambda m: pb.ThinkerRequest(start=m))
            await th.done_writing()
            ta = None
            async for resp in th:
                kind = resp.WhichOneof("kind")
                if kind == "talker_prompt":
                    ta, talker_context = await open_call(self.talker, "Generate", thinker_context)
                    talker_task["task"] = asyncio.ensure_future(guarded("talker", run_talker(ta, talker_context)))
                    tasks.append(talker_task["task"])
                    ts = pb.TalkerStart(request_id=req.request_id, prompt=resp.talker_prompt, speaker=req.speaker,
                                        sampling=req.sampling(), max_frames=req.max_frames, min_frames=req.min_frames)
                    await to_stage("talker", self._write(
                        ta, ts, lambda d: pb.TalkerRequest(chunk=pb.PayloadChunk(data=d)),
                        lambda m: pb.TalkerRequest(start=m)))
                elif kind == "text":
                    t = resp.text
                    await events.put(TextEvent(t.index, list(t.token_ids), t.text))
                    if ta is not None:
                        await to_talker(ta, pb.TalkerRequest(rows=pb.TextRows(token_ids=t.token_ids,
                                                                               rows=t.embeddings)))
                elif kind == "finished":
                    usage["prompt"], usage["completion"] = resp.finished.prompt_tokens, resp.finished.completion_tokens
                    done["text"] = resp.finished.reason
                    if ta is not None:
                        await to_talker(ta, pb.TalkerRequest(text_end=pb.TextEnd()))
                        await to_talker(ta, None)
            if req.audio and ta is None:
                raise PipelineError("thinker", None, "the thinker finished without a talker prompt")
            await events.put("thinker-done")

        async def run_talker(ta, talker_context: otel_context.Context) -> None:
            cw, _ = await open_call(self.code2wav, "Decode", talker_context)
            tasks.append(asyncio.ensure_future(guarded("code2wav", run_code2wav(cw))))
            await to_stage("code2wav", cw.write(
                pb.Code2WavRequest(start=pb.Code2WavStart(request_id=req.request_id, encoding=req.encoding))))
            try:
                async for resp in ta:
                    kind = resp.WhichOneof("kind")
                    if kind == "frames":
                        usage["frames"] += resp.frames.codes.shape[0]
                        await to_stage("code2wav", cw.write(pb.Code2WavRequest(frames=resp.frames)))
                        await events.put(FramesEvent(resp.frames.index, from_proto(resp.frames.codes).to(torch.int64)))
                    elif kind == "finished":
                        done["audio"] = resp.finished.reason
            except grpc.aio.AioRpcError:
                # After its Finished, the talker's call can still end in INTERNAL: a text write of ours
                # raced the end of the stream (max_frames reached before the text ended). Its output is whole.
                if done["audio"] is None:
                    raise
            await to_stage("code2wav", cw.write(pb.Code2WavRequest(frames_end=pb.FramesEnd())))
            await to_stage("code2wav", cw.done_writing())

        async def run_code2wav(cw) -> None:
            async for resp in cw:
                if resp.WhichOneof("kind") == "audio":
                    a = resp.audio
                    usage["samples"] += a.num_samples
                    await events.put(AudioEvent(a.sample_offset, a.sample_rate, _decode_audio(a), a.data))
            await events.put("code2wav-done")

        tasks: list[asyncio.Task] = []
        tasks.append(asyncio.ensure_future(guarded("thinker", run_thinker())))
        pending = {"thinker-done"} | ({"code2wav-done"} if req.audio else set())
        try:
            while pending:
                ev = await events.get()
                if isinstance(ev, PipelineError):
                    raise ev
                if isinstance(ev, str):
                    pending.discard(ev)
                    continue
                yield ev
            yield DoneEvent(done["text"], done["audio"], usage["prompt"], usage["completion"], usage["frames"],
                            usage["samples"])
        finally:
            for stream in streams.values():
                stream.close()
            for t in tasks:
                t.cancel()
            for span in spans.values():
                span.set_attribute("voxpipe.cancelled", True)
                span.end()
            spans.clear()

    async def collect(self, req: SpeechRequest) -> "SpeechResult":
        res = SpeechResult()
        async for ev in self.stream(req):
            if isinstance(ev, TextEvent):
                res.text_ids.extend(ev.token_ids)
                res.text += ev.text
            elif isinstance(ev, AudioEvent):
                res.chunks.append(ev.samples)
            elif isinstance(ev, FramesEvent):
                res.frames.append(ev.codes)
            else:
                res.done = ev
        res.audio = np.concatenate(res.chunks) if res.chunks else np.zeros(0, np.float32)
        return res


@dataclass
class SpeechResult:
    text_ids: list[int] = field(default_factory=list)
    text: str = ""
    chunks: list[np.ndarray] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)
    audio: np.ndarray | None = None

    @property
    def codes(self) -> torch.Tensor:
        return torch.cat(self.frames) if self.frames else torch.zeros(0, 16, dtype=torch.int64)
    done: DoneEvent | None = None
