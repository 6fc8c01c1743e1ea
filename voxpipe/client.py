"""The pipeline client: one request's streams, as a caller (gateway, `voxpipe say`, the bench) opens them.

    async with PipelineClient(thinker="localhost:50051", code2wav="localhost:50053") as client:
        async for event in client.stream(SpeechRequest(token_ids=ids, speaker="ethan")):
            ...   # TextEvent / AudioEvent / DoneEvent (and StageEvent, FramesEvent when asked)

The caller opens two streams: one to a thinker (text comes back), and -- for a spoken reply --
one to the code2wav replica that the request's talker picked (audio comes back). Rows and codec
frames never pass through the caller: the thinker streams them to a talker replica it picks, the
talker to a code2wav replica it picks (proto/voxpipe/v1/stages.proto). The thinker stream
reports both picks (Routed); the audio stream then attaches to that code2wav replica with its
one-time listen token. Cancelling the iteration (or a failure anywhere) cancels both streams,
which frees the request in every stage.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from voxpipe.services.runtime import tracing
from voxpipe.services.runtime.affinity import RouteKey, content_digest, prompt_key
from voxpipe.services.runtime.block_pool import PrefixHasher
from voxpipe.services.runtime.balancer import BalancedStream, BalancerOptions, NoReplicaError, Replica
from voxpipe.services.runtime.calls import SESSION_METADATA, context_exceeded, failed_stage
from voxpipe.services.runtime.downstream import HEALTH_SERVICES, stage_balancer
from voxpipe.services.runtime.flags import KV_BLOCK_SIZE
from voxpipe.services.runtime.tensors import from_proto, ids_proto, split_message, to_proto
from voxpipe.services.runtime.tls import ClientTLS
from voxpipe.services.thinker.constraint import Constraint
from voxpipe.services.thinker.streamed import around_last_clip
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# audio chunks read from code2wav and not yet taken by the caller: past this the Listen stream is read
# only as fast as the caller takes the audio, so flow control holds code2wav's writes and code2wav
# sees a slow client as one that was delivered less (its playback clock: stages.proto Playback)
AUDIO_READ_AHEAD = 32
# a prompt with more clip feature bytes or more tokens than these is hashed in a worker thread
HASH_OFF_LOOP_BYTES = 256 * 1024
HASH_OFF_LOOP_TOKENS = 8192
ROUTE_HASH_TOKENS = 1 << 20     # prompt tokens whose block hashes the client remembers for its route keys


@dataclass
class SpeechRequest:
    token_ids: list[int] | None = None        # rendered prompt (see services.thinker.prompt.render)
    text: str | None = None                   # or: one user turn, rendered by the thinker
    # or the reply, verbatim (text to speech; ThinkerStart.assistant_text): the thinker samples nothing, so
    # the sampling values are the talker's alone, and max_tokens / min_tokens must stay 0
    assistant_text: str | None = None
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
    stop: tuple[str, ...] = ()                # stop strings (ThinkerStart.stop)
    unspoken_tool_calls: bool = False         # the talker's text ends where a tool call begins (ThinkerStart)
    top_logprobs: int | None = None           # None: no log probabilities; else ThinkerStart.top_logprobs
    constraint: Constraint | None = None      # constrained decoding (ThinkerStart.constraint); None: free text
    text_cap: tuple[int, int] | None = None   # (frames per text token, base frames); None: the talker's default
    encoding: int = pb.AUDIO_PCM16
    echo_frames: bool = False                 # debug: also the codec frames code2wav received (FramesEvent)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    # routing only: the requests of one session (a realtime conversation, or a chat completion
    # prompt_cache_key as "chat-key:" + key) prefer the thinker replica
    # of its previous one, and that thinker the talker replica of its previous one (services.runtime
    # .affinity; sent as calls.SESSION_METADATA, at most 128 characters); None: by the prompt's prefix alone
    session: str | None = None

    def sampling(self) -> pb.Sampling:
        s = pb.Sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p)
        if self.seed is not None:
            s.seed = self.seed
        return s


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float
    token: bytes                   # the token's bytes (may be part of a UTF-8 character)

    def to_proto(self) -> pb.TopLogprob:
        return pb.TopLogprob(token_id=self.token_id, logprob=self.logprob, token=self.token)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and the most likely tokens at its step, most likely first."""
    token_id: int
    logprob: float
    token: bytes
    top: tuple[TopLogprob, ...] = ()

    @classmethod
    def from_proto(cls, m: pb.TokenLogprob) -> "TokenLogprob":
        return cls(m.token_id, m.logprob, m.token, tuple(TopLogprob(t.token_id, t.logprob, t.token) for t in m.top))

    def to_proto(self) -> pb.TokenLogprob:
        return pb.TokenLogprob(token_id=self.token_id, logprob=self.logprob, token=self.token,
                               top=[t.to_proto() for t in self.top])


@dataclass
class TextEvent:
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] = field(default_factory=list)   # with SpeechRequest.top_logprobs


@dataclass
class AudioEvent:
    sample_offset: int
    sample_rate: int
    samples: np.ndarray            # float32 in [-1, 1] (decoded from the wire encoding)
    data: bytes                    # the wire bytes (pcm16 or float32 little-endian)
    received: float = 0.0          # time.monotonic() when it was read from code2wav (0: not recorded)


@dataclass
class FramesEvent:
    """Codec frames as code2wav received them (only with SpeechRequest.echo_frames: a debug echo)."""
    index: int
    codes: torch.Tensor            # [n, num_code_groups] int64


@dataclass
class StageEvent:
    """A downstream stage's report: `kind` "first_output" (its first frame: the talker),
    "routed" (it holds the request on `address`) or "silent" (the talker: the reply has nothing to
    speak -- a function call only -- so no talker ran and no audio comes)."""
    stage: str
    kind: str
    address: str = ""


@dataclass
class DoneEvent:
    text_finish: int               # pb.FinishReason
    audio_finish: int | None
    prompt_tokens: int
    completion_tokens: int
    frames: int                    # codec frames the talker made (its own report)
    samples: int
    routes: dict[str, str] = field(default_factory=dict)   # stage -> the replica that served it
    cached_tokens: int = 0         # of prompt_tokens, those the thinker's prefix cache held (prefill skipped)
    streamed_tokens: int = 0       # a streamed turn (AudioTurn): of prompt_tokens, those prefilled before its commit


class PipelineError(RuntimeError):
    """A stage failed the request. `replica`: the address of the stage replica it was on (for
    logs; not part of the message, which clients may see). `via`: the stream that reported it
    ("thinker" or "code2wav": the caller's two streams). `context`: the numbers of a thinker's
    OUT_OF_RANGE refusal (the prompt, the reply's room, and the context they did not fit)."""

    def __init__(self, stage: str, code: grpc.StatusCode | None, details: str, replica: str | None = None,
                 via: str | None = None, context: pb.ContextExceeded | None = None) -> None:
        super().__init__(f"{stage}: {code.name if code else 'ERROR'}: {details}")
        self.stage, self.code, self.details, self.replica, self.via = stage, code, details, replica, via
        self.context = context


def session_metadata(session: str | None) -> tuple[tuple[str, str], ...]:
    """A thinker call's session header: the thinker then picks the session's talker replica too."""
    return () if session is None else ((SESSION_METADATA, session),)


def _decode_audio(chunk: pb.AudioChunk) -> np.ndarray:
    if chunk.encoding == pb.AUDIO_FLOAT32:
        return np.frombuffer(chunk.data, dtype="<f4").astype(np.float32)
    return np.frombuffer(chunk.data, dtype="<i2").astype(np.float32) / 32767.0


class AudioTurn:
    """A thinker request whose last clip is heard while it is spoken (ThinkerStart.stream_audio):
    opened with the conversation before the clip (`token_ids`, its earlier `audio_features`), then
    `hear(raw)` for each piece of the clip's raw log-mel frames (services/thinker/log_mel.py), and
    either `PipelineClient.stream(req, turn=this)`, whose request the commit carries, or `close()`,
    which cancels it (the thinker frees what it held). Its messages are written in order by its own
    task; a failure before the commit is read at the commit (the stream's status)."""

    def __init__(self, client: "PipelineClient", token_ids: list[int], audio_features: list[torch.Tensor],
                 session: str | None, request_id: str) -> None:
        self.client, self.token_ids, self.audio_features = client, list(token_ids), list(audio_features)
        self.session, self.request_id = session, request_id
        self.stream: BalancedStream | None = None
        self.replica: str | None = None
        self.frames = 0                            # raw frames heard so far
        self._queue: asyncio.Queue[pb.ThinkerRequest | None] = asyncio.Queue()
        self._opened: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closed = self._committed = False
        self._task = asyncio.ensure_future(self._write())

    @property
    def usable(self) -> bool:
        """Not closed, not committed, and nothing failed so far (the writer runs, the call is open)."""
        return not (self._closed or self._committed or self._task.done()
                    or (self.stream is not None and self.stream.ended))

    def hear(self, raw: torch.Tensor) -> None:
        """More raw log-mel frames [num_mel_bins, k] float32 of the clip, in order."""
        if raw.shape[1] and self.usable:
            self.frames += raw.shape[1]
            self._queue.put_nowait(pb.ThinkerRequest(audio=pb.AudioFrames(log_mel=to_proto(raw.contiguous()))))

    async def _write(self) -> None:
        client = self.client
        key = await client.route_key(SpeechRequest(token_ids=self.token_ids, audio_features=self.audio_features,
                                                   session=self.session))

        def on_replica(replica: Replica) -> None:
            self.replica = replica.address

        md = tuple(client.metadata) + session_metadata(self.session)
        self.stream = BalancedStream(client.thinker, lambda channel: pb_grpc.ThinkerStub(channel).Generate(
            metadata=md), on_replica, key)
        try:
            await self.stream.open()
        except BaseException as e:
            self._opened.set_exception(e)
            raise
        self._opened.set_result(self.stream)
        start = pb.ThinkerStart(request_id=self.request_id, stream_audio=True, token_ids=ids_proto(self.token_ids),
                                audio_features=[to_proto(f.float()) for f in self.audio_features])
        head, chunks = split_message(start, client.max_message_bytes - 1024)
        await self.stream.write(pb.ThinkerRequest(start=head))
        for data in chunks:
            await self.stream.write(pb.ThinkerRequest(chunk=pb.PayloadChunk(data=data)))
        while (msg := await self._queue.get()) is not None:
            await self.stream.write(msg)
            if msg.WhichOneof("kind") == "commit":
                await self.stream.done_writing()
                return

    async def commit(self, start: pb.ThinkerStart) -> BalancedStream:
        """The clip is complete (every frame heard): the turn's start (its token ids: the prompt after
        the clip's placeholders) goes; the stream to read the turn's responses from (the caller closes it)."""
        if not self.usable:
            raise ValueError("the turn is closed, committed or failed")
        self._committed = True
        self._queue.put_nowait(pb.ThinkerRequest(commit=pb.StreamCommit(start=start)))
        self._queue.put_nowait(None)
        return await asyncio.shield(self._opened)

    async def close(self) -> None:
        """Cancel the turn (idempotent): the thinker call ends, the replica is given back."""
        if self._closed:
            return
        self._closed = True
        if not self._committed:
            self._task.cancel()
        if self.stream is not None and not self._committed:
            self.stream.close()
        await asyncio.gather(self._task, return_exceptions=True)
        if not self._opened.done():
            self._opened.cancel()
        elif not self._opened.cancelled():
            self._opened.exception()        # read: an open that failed is not an unretrieved error


class PipelineClient:
    def __init__(self, thinker: str | list[str], code2wav: str | list[str] | None = None, *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, metadata: tuple[tuple[str, str], ...] = (),
                 balancing: BalancerOptions | None = None, tls: ClientTLS | None = None,
                 audio_token: int | None = None) -> None:
        """Each stage: `host:port` and/or `dns:///name:port` entries, comma-separated or a list; every
        address (every DNS record) is one replica (see voxpipe.services.runtime.balancer). The talker
        is the thinker's business (its --talker); `code2wav` lists the replicas audio may come from:
        the one a talker picked must be among them. `balancing`: re-resolution, health cool-down and
        retry settings. `tls`: dial both stages with TLS, presenting its client certificate when it
        has one (voxpipe.services.runtime.tls); None: plaintext. With several thinker replicas a request
        goes where its session or its prompt's longest prefix went (services.runtime.affinity);
        `audio_token`: the thinker's audio placeholder id (the model config's), so that a prompt's
        clips count by content in its prefix (None: prompts with audio route by session alone)."""
        self.max_message_bytes = max_message_bytes
        self.audio_token = audio_token
        self.thinker = stage_balancer("thinker", thinker, max_message_bytes, balancing, tls)
        self.code2wav = stage_balancer("code2wav", code2wav, max_message_bytes, balancing, tls) if code2wav else None
        self.metadata = metadata
        # messages received, by (stage, kind): what crosses into the caller's process ("rows": text
        # deltas that carried talker rows, which a caller never gets in stage-to-stage operation)
        self.received: collections.Counter[tuple[str, str]] = collections.Counter()
        # route keys' block hashes, a conversation's history remembered (several thinker replicas only)
        self.hasher = PrefixHasher(KV_BLOCK_SIZE, max_tokens=ROUTE_HASH_TOKENS)

    async def __aenter__(self) -> "PipelineClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for p in (self.thinker, self.code2wav):
            if p is not None:
                await p.close()

    async def route_key(self, req: SpeechRequest) -> RouteKey | None:
        """The thinker pick's affinity for `req`: its session and its prompt's block hashes (clips by
        their features' content). None with one thinker replica (no choice: nothing is hashed)."""
        await self.thinker.start()
        if not self.thinker.choosing:
            return None
        if req.token_ids is None or (req.audio_features and self.audio_token is None):
            # the thinker renders the prompt (or the clips' places are unknown): the session alone
            return RouteKey(session=req.session) if req.session is not None else None
        ids, feats = req.token_ids, req.audio_features

        def key() -> RouteKey:
            return prompt_key(ids, req.session, self.audio_token, [content_digest(f) for f in feats],
                              hasher=self.hasher)

        if len(ids) > HASH_OFF_LOOP_TOKENS or sum(f.numel() * f.element_size() for f in feats) > HASH_OFF_LOOP_BYTES:
            return await asyncio.to_thread(key)
        return key()

    def end_session(self, session: str) -> None:
        """The session (a realtime conversation) is over: the thinker replica it was placed on no longer
        counts it as its load (services.runtime.affinity)."""
        self.thinker.end_session(session)

    def open_turn(self, token_ids: list[int], audio_features: list[torch.Tensor], session: str | None = None,
                  request_id: str | None = None) -> AudioTurn:
        """A streamed turn (AudioTurn) after the conversation `token_ids` (rendered, ending before the
        clip's placeholders) with its clips `audio_features`; call on the event loop."""
        return AudioTurn(self, token_ids, audio_features, session, request_id or uuid.uuid4().hex)

    async def _code2wav_replica(self, address: str) -> Replica:
        """The caller's own channel to the code2wav replica a talker reported (it never dials an
        address it was not configured with: a reported one must be among its replicas)."""
        for attempt in range(2):
            for replica in self.code2wav.replicas:
                if replica.address == address:
                    return replica
            if attempt == 0:
                await self.code2wav.start()
                self.code2wav.request_resolve()
                await asyncio.sleep(0.05)
        raise PipelineError("code2wav", grpc.StatusCode.FAILED_PRECONDITION,
                            f"the talker sent the audio to code2wav {address}, which is not among this client's "
                            f"code2wav replicas ({', '.join(t.text for t in self.code2wav.targets)}): configure "
                            "the caller and the talkers with the same code2wav addresses")

    async def stream(self, req: SpeechRequest, *, metadata: tuple[tuple[str, str], ...] = (),
                     context: otel_context.Context | None = None, turn: AudioTurn | None = None,
                     ) -> AsyncIterator[TextEvent | AudioEvent | StageEvent | FramesEvent | DoneEvent]:
        """`metadata`: extra gRPC metadata for the calls. `context`: the OpenTelemetry context to trace
        under (default: the current one): the thinker call and the code2wav Listen call are CLIENT
        spans of it, carried on as W3C `traceparent` (the stages chain their own calls under them).
        `turn`: `req` commits that streamed turn (all of its clip heard) instead of opening a thinker
        call: req.token_ids must be the turn's token ids, the clip's placeholders, then the rest of the
        prompt, and req.audio_features the turn's clips then the clip's features (the caller checked;
        the thinker checks the placeholders' count). A turn that failed before its commit (its
        replica went away, say) is not used: `req` goes whole."""
        parent = context if context is not None else otel_context.get_current()
        if req.audio and self.code2wav is None:
            raise ValueError("audio output needs code2wav addresses")
        start = pb.ThinkerStart(request_id=req.request_id, max_tokens=req.max_tokens, min_tokens=req.min_tokens,
                                stop=req.stop, logprobs=req.top_logprobs is not None, top_logprobs=req.top_logprobs or 0,
                                audio_features=[] if turn is not None else [to_proto(f.float()) for f in req.audio_features],
                                unspoken_tool_calls=req.unspoken_tool_calls)
        if req.constraint is not None:
            start.constraint.CopyFrom(req.constraint.to_proto())
        if req.assistant_text is None:
            start.sampling.CopyFrom(req.sampling())
        else:       # the thinker samples nothing: the sampling values are the talker's (speech.sampling)
            start.assistant_text = req.assistant_text
        if req.audio:
            start.speech.CopyFrom(pb.SpeechParams(
                speaker=req.speaker, sampling=req.sampling(), max_frames=req.max_frames, min_frames=req.min_frames,
                code2wav=pb.Code2WavParams(encoding=req.encoding, echo_frames=req.echo_frames)))
            if req.text_cap is not None:
                start.speech.text_cap.CopyFrom(pb.TextFrameCap(frames_per_token=req.text_cap[0],
                                                               base_frames=req.text_cap[1]))
        if req.token_ids is not None:
            ids_proto(req.token_ids, start.token_ids)
        else:
            start.text = req.text or ""
        events: asyncio.Queue = asyncio.Queue()
        audio_room = asyncio.Semaphore(AUDIO_READ_AHEAD)
        spans: dict[str, trace.Span] = {}
        calls: list = []        # what to cancel when the iteration ends
        tasks: list[asyncio.Task] = []
        done = {"text": None, "audio": None}
        usage = {"prompt": 0, "completion": 0, "frames": 0, "samples": 0, "cached": 0, "streamed": 0}
        routes: dict[str, str] = {}

        def client_span(stage: str, method: str) -> tuple[trace.Span, tuple[tuple[str, str], ...]]:
            service = HEALTH_SERVICES[stage]
            span = tracing.tracer().start_span(
                f"{service}/{method}", context=parent, kind=SpanKind.CLIENT,
                attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": method,
                            "voxpipe.request_id": req.request_id})
            spans[stage] = span
            md = tuple(self.metadata) + tuple(metadata) + tracing.inject_metadata(trace.set_span_in_context(span, parent))
            return span, md

        async def guarded(stage: str, run, *args) -> None:
            try:
                await run(*args)   # made here: a task cancelled before it starts leaves no coroutine unawaited
            except PipelineError as e:
                if stage in spans:
                    tracing.grpc_error(spans[stage], e.code, e.details or "")
                e.via = stage
                await events.put(e)
            except grpc.aio.AioRpcError as e:
                failed = failed_stage(e, stage)
                if stage in spans:
                    tracing.grpc_error(spans[stage], e.code(), e.details() or "")
                context = context_exceeded(e) if failed == "thinker" else None
                await events.put(PipelineError(failed, e.code(), e.details(), routes.get(failed), via=stage,
                                               context=context))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - surfaced to the caller
                if stage in spans:
                    tracing.grpc_error(spans[stage], None, repr(e))
                await events.put(PipelineError(stage, None, repr(e), via=stage))
            finally:
                span = spans.pop(stage, None)
                if span is not None:
                    span.end()

        async def open_thinker() -> BalancedStream:
            if turn is not None:        # the turn failed before its commit: the request goes whole
                start.audio_features.extend(to_proto(f.float()) for f in req.audio_features)
            span, md = client_span("thinker", "Generate")
            md += session_metadata(req.session)
            key = await self.route_key(req)

            def on_replica(replica: Replica) -> None:       # each attempt's (a refused stream moves)
                span.set_attribute("server.address", replica.address)
                routes["thinker"] = replica.address

            stream = BalancedStream(self.thinker, lambda channel: pb_grpc.ThinkerStub(channel).Generate(metadata=md),
                                    on_replica, key)
            calls.append(stream)
            try:
                await stream.open()
            except NoReplicaError as e:
                raise PipelineError("thinker", grpc.StatusCode.UNAVAILABLE, str(e)) from None
            head, chunks = split_message(start, self.max_message_bytes - 1024)
            await stream.write(pb.ThinkerRequest(start=head))
            for data in chunks:
                await stream.write(pb.ThinkerRequest(chunk=pb.PayloadChunk(data=data)))
            await stream.done_writing()
            return stream

        async def commit_turn() -> BalancedStream:
            """The streamed turn's commit: `start` with the prompt after the clip, what the turn has not."""
            client_span("thinker", "Generate")
            if self.audio_token is None or req.token_ids is None:
                raise ValueError("a streamed turn's commit needs token_ids and the client's audio_token")
            head, tail = around_last_clip(req.token_ids, self.audio_token)
            if head != turn.token_ids:
                raise ValueError("the request's prompt does not continue the streamed turn's conversation")
            commit = pb.ThinkerStart()
            commit.CopyFrom(start)
            commit.ClearField("request_id")
            commit.ClearField("audio_features")
            ids_proto(tail, commit.token_ids)
            try:
                stream = await turn.commit(commit)
            except NoReplicaError as e:
                raise PipelineError("thinker", grpc.StatusCode.UNAVAILABLE, str(e)) from None
            calls.append(stream)
            if turn.replica is not None:
                routes["thinker"] = turn.replica
                spans["thinker"].set_attribute("server.address", turn.replica)
            return stream

        async def run_thinker() -> None:
            stream = await (commit_turn() if turn is not None and turn.usable else open_thinker())
            async for resp in stream:
                kind = resp.WhichOneof("kind")
                self.received["thinker", kind] += 1
                if kind == "text" and resp.text.HasField("embeddings"):
                    self.received["thinker", "rows"] += 1
                if kind == "text":
                    t = resp.text
                    await events.put(TextEvent(t.index, list(t.token_ids), t.text,
                                               [TokenLogprob.from_proto(e) for e in t.logprobs]))
                elif kind == "routed":
                    r = resp.routed
                    routes[r.stage] = r.address
                    await events.put(StageEvent(r.stage, "routed", r.address))
                    if r.stage == "code2wav":
                        tasks.append(asyncio.ensure_future(guarded("code2wav", run_listen, r.address, r.listen_token)))
                elif kind == "first_output":
                    await events.put(StageEvent(resp.first_output.stage, "first_output"))
                elif kind == "finished":
                    usage["prompt"], usage["completion"] = resp.finished.prompt_tokens, resp.finished.completion_tokens
                    usage["cached"] = resp.finished.cached_tokens
                    usage["streamed"] = resp.finished.streamed_tokens
                    done["text"] = resp.finished.reason
                elif kind == "talker_finished":
                    done["audio"] = resp.talker_finished.reason
                    usage["frames"] = resp.talker_finished.completion_tokens
                    if req.audio and "code2wav" not in routes:     # nothing to speak: no audio stream comes
                        await events.put(StageEvent("talker", "silent"))
                        await events.put("code2wav-done")
                else:
                    raise PipelineError("thinker", grpc.StatusCode.INTERNAL, f"unexpected {kind} on a speech stream")
            if req.audio and done["audio"] is None and done["text"] != pb.CANCELLED:
                raise PipelineError("thinker", None, "the thinker ended without the talker's end")
            await events.put("thinker-done")

        async def run_listen(address: str, token: str) -> None:
            replica = await self._code2wav_replica(address)
            span, md = client_span("code2wav", "Listen")
            span.set_attribute("server.address", address)
            call = pb_grpc.Code2WavStub(replica.channel).Listen(pb.ListenRequest(listen_token=token), metadata=md)
            calls.append(call)
            async for resp in call:
                kind = resp.WhichOneof("kind")
                self.received["code2wav", kind] += 1
                if kind == "audio":
                    a = resp.audio
                    received = time.monotonic()
                    usage["samples"] += a.num_samples
                    await audio_room.acquire()      # released as the caller takes it
                    await events.put(AudioEvent(a.sample_offset, a.sample_rate, _decode_audio(a), a.data, received))
                elif kind == "frames":
                    f = resp.frames
                    await events.put(FramesEvent(f.index, from_proto(f.codes).to(torch.int64)))
                elif kind == "finished":
                    if done["audio"] is None:
                        done["audio"] = resp.finished.reason
            await events.put("code2wav-done")

        tasks.append(asyncio.ensure_future(guarded("thinker", run_thinker)))
        pending = {"thinker-done"} | ({"code2wav-done"} if req.audio else set())
        held: PipelineError | None = None     # the audio stream's report of an upstream failure
        try:
            while pending:
                ev = await events.get()
                if isinstance(ev, AudioEvent):
                    audio_room.release()
                if isinstance(ev, PipelineError):
                    if ev.replica is None:
                        ev.replica = routes.get(ev.stage)
                    if ev.via == "code2wav" and ev.stage != "code2wav" and "thinker-done" in pending:
                        # code2wav lost its talker: the thinker stream says why (the talker died, or the
                        # thinker itself failed) and ends soon; its verdict names the stage at fault
                        held = held or ev
                        pending.discard("code2wav-done")
                        continue
                    raise ev
                if isinstance(ev, str):
                    pending.discard(ev)
                    if ev == "thinker-done" and held is not None:
                        raise held
                    if ev == "thinker-done" and done["text"] == pb.CANCELLED and done["audio"] is None:
                        pending.discard("code2wav-done")      # cancelled before the talker started
                    continue
                yield ev
            yield DoneEvent(done["text"], done["audio"], usage["prompt"], usage["completion"], usage["frames"],
                            usage["samples"], dict(routes), usage["cached"], usage["streamed"])
        finally:
            for call in calls:
                if isinstance(call, BalancedStream):
                    call.close()
                else:
                    call.cancel()
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
                res.logprobs.extend(ev.logprobs)
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
    logprobs: list[TokenLogprob] = field(default_factory=list)
    chunks: list[np.ndarray] = field(default_factory=list)
    frames: list[torch.Tensor] = field(default_factory=list)
    audio: np.ndarray | None = None

    @property
    def codes(self) -> torch.Tensor:
        return torch.cat(self.frames) if self.frames else torch.zeros(0, 16, dtype=torch.int64)
    done: DoneEvent | None = None
