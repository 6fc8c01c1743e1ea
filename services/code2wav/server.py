"""Code2Wav gRPC service: `voxpipe code2wav --model DIR --port N`."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from contextlib import aclosing
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from ..runtime.config import OmniConfig
from ..runtime import tracing
from ..runtime.calls import abort, when_done
from ..runtime.engine import Outbox, StageError
from ..runtime.outputs import AudioOut, Finished, FramesOut
from ..runtime.flags import add_code2wav_arguments as add_arguments  # noqa: F401  (its flags)
from voxpipe.errors import ConfigError

from ..runtime.flags import DEFAULT_LISTEN_TIMEOUT_S
from ..runtime.playback import PlaybackClock
from ..runtime.server import (Abort, StageServicer, finished_proto, frames_proto, load_stage_model,
                              serve_stage, stage_setup)
from ..runtime.tensors import TensorError, from_proto
from ..runtime.tracing import traced_rpc
from .engine import Code2WavEngine, Code2WavJob
from .model import Code2WavModel

CODE_DTYPES = (torch.uint16, torch.int32, torch.int64)


def encode_samples(samples: np.ndarray, encoding: int) -> bytes:
    """Samples [n] float32 in [-1, 1] as the wire's bytes: float32 or pcm16, little-endian."""
    if encoding == pb.AUDIO_FLOAT32:
        return samples.astype("<f4").tobytes()
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class FramesEndedEarly(Abort):
    """The frames stream ended (half-closed or cut) before frames_end."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, "request stream ended before frames_end")
CALL_END_GRACE_S = 0.5     # how long a request stream that ended early waits to see whether its call was cancelled
REPORT_EVERY_S = 0.25      # Playback reports on a Decode stream: at most one per this much wall time


class Code2WavServicer(StageServicer, pb_grpc.Code2WavServicer):
    @staticmethod
    def ending_message() -> pb.Code2WavResponse:
        return pb.Code2WavResponse(ending=pb.Ending())

    def __init__(self, engine: Code2WavEngine, opts, cfg: OmniConfig, first_chunk_frames: int, chunk_frames: int,
                 listen_timeout_s: float = DEFAULT_LISTEN_TIMEOUT_S) -> None:
        super().__init__(engine, opts)
        self.cfg = cfg
        self.first_chunk_frames, self.chunk_frames = first_chunk_frames, chunk_frames
        self.listen_timeout_s = listen_timeout_s
        self.listening: dict[str, Code2WavJob] = {}   # listen token -> a to_listener request no listener took yet

    def merge(self, first: AudioOut | FramesOut, then: AudioOut | FramesOut) -> AudioOut | None:
        """Consecutive audio of one request (contiguous samples) travels as one chunk."""
        if not isinstance(first, AudioOut) or not isinstance(then, AudioOut):
            return None
        if then.sample_offset != first.sample_offset + first.samples.shape[0]:
            return None
        return AudioOut(first.sample_offset, np.concatenate((first.samples, then.samples)))

    def to_proto(self, req: Code2WavJob, item: AudioOut | FramesOut | Finished) -> pb.Code2WavResponse:
        """Audio in the request's wire encoding (pcm16 or float32 little-endian)."""
        if isinstance(item, AudioOut):
            return pb.Code2WavResponse(audio=pb.AudioChunk(
                sample_offset=item.sample_offset, sample_rate=self.cfg.code2wav.sample_rate, encoding=req.encoding,
                data=encode_samples(item.samples, req.encoding), num_samples=item.samples.shape[0]))
        if isinstance(item, FramesOut):
            return pb.Code2WavResponse(frames=frames_proto(item))
        if isinstance(item, Finished):
            return pb.Code2WavResponse(finished=finished_proto(item))
        raise TypeError(f"code2wav has no message for {item!r}")

    def make_job(self, start: pb.Code2WavStart) -> Code2WavJob:
        if start.encoding not in (pb.AUDIO_ENCODING_UNSPECIFIED, pb.AUDIO_PCM16, pb.AUDIO_FLOAT32):
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown audio encoding {start.encoding}")
        if start.echo_frames and not start.to_listener:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "echo_frames needs to_listener")
        if start.playback_reports and not start.to_listener:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "playback_reports needs to_listener")
        return Code2WavJob(request_id=start.request_id or uuid.uuid4().hex, outbox=Outbox(asyncio.get_running_loop()),
                           encoding=start.encoding or pb.AUDIO_PCM16,
                           first_chunk_frames=start.first_chunk_frames or self.first_chunk_frames,
                           chunk_frames=start.chunk_frames or self.chunk_frames,
                           to_listener=start.to_listener, echo_frames=start.echo_frames,
                           playback=PlaybackClock(measured=start.to_listener),
                           playback_reports=start.to_listener and start.playback_reports)

    @traced_rpc("voxpipe.v1.Code2Wav", "Decode")
    async def Decode(self, request_iterator, context: grpc.aio.ServicerContext):
        it = request_iterator.__aiter__()
        job = await self.open_stream(it, context)
        if job is None:
            return
        cw = self.cfg.code2wav

        async def reader() -> None:
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "frames":
                    if job.frames_end:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "frames after frames_end")
                    received = from_proto(msg.frames.codes, shape=(None, cw.num_quantizers), name="frames.codes")
                    if received.dtype not in CODE_DTYPES:
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "frames.codes must be uint16, int32 or int64")
                    codes = received.to(torch.int64)
                    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= cw.codebook_size):
                        raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"codec codes must be in [0, {cw.codebook_size}), got {int(codes.min())}..{int(codes.max())}")
                    self.engine.add_frames(job, codes)
                    if job.echo_frames:
                        job.outbox.put(FramesOut(msg.frames.index, received))
                elif kind == "frames_end":
                    self.engine.end_frames(job)
                elif kind == "cancel":
                    self.engine.cancel(job)
                    job.outbox.put(self.cancelled())
                    return
                else:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} after start")
            if not job.frames_end:
                raise FramesEndedEarly()

        serve = self.serve_listened(job, context, reader) if job.to_listener else self.serve_request(job, context, reader)
        # aclosing: the request is freed the moment this handler ends, not when the generator is collected
        async with aclosing(serve) as outputs:
            async for item in outputs:
                yield item

    async def serve_listened(self, job: Code2WavJob, context: grpc.aio.ServicerContext,
                             reader: Callable[[], Any]) -> AsyncIterator[pb.Code2WavResponse]:
        """A to_listener Decode stream: Accepted (with a one-time listen token), Playback reports if
        asked for, then, once the request ended (its listener read the Finished, or it failed),
        Finished or the failure.
        The audio goes to the Listen stream; until a listener attaches it waits in the request's
        outbox (bounded: a full outbox pauses the request) for at most --listen-timeout."""
        loop = asyncio.get_running_loop()
        token = secrets.token_urlsafe(18)
        job.ended = loop.create_future()
        reports: asyncio.Queue[pb.Playback | None] = asyncio.Queue()
        job.ended.add_done_callback(lambda _f: reports.put_nowait(None))
        job.reports = reports if job.playback_reports else None
        self.listening[token] = job
        self.engine.submit(job)

        async def read() -> None:
            try:
                await reader()
            except FramesEndedEarly as e:
                # the talker went away mid-request (died, or cancelled by its own caller): to the
                # listener that is the talker's failure, which the thinker stream reports too. A
                # cancel may end the request stream a moment before the call ends: then on_done
                # below ends the request as cancelled; a stream only half-closed early is a bad one.
                try:
                    await asyncio.wait_for(asyncio.shield(job.ended), CALL_END_GRACE_S)
                except asyncio.TimeoutError:
                    self._fail(job, StageError(e.code, f"the talker's frames: {e.message}", "talker"))
            except (Abort, TensorError) as e:
                code = e.code if isinstance(e, Abort) else grpc.StatusCode.INVALID_ARGUMENT
                self._fail(job, StageError(code, e.message if isinstance(e, Abort) else str(e)))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - the talker went away mid-read
                self._fail(job, StageError(grpc.StatusCode.CANCELLED, f"the frames stream ended: {e!r}", "talker"))

        def no_listener() -> None:
            if self.listening.pop(token, None) is not None:
                self._fail(job, StageError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                           f"no listener attached within {self.listen_timeout_s:g} s"))

        task = asyncio.ensure_future(read())
        timer = loop.call_later(self.listen_timeout_s, no_listener)

        def on_done(_context) -> None:      # the talker's call ended: free the request now (see serve_request)
            timer.cancel()
            self.listening.pop(token, None)
            self._fail(job, StageError(grpc.StatusCode.CANCELLED, "the talker cancelled the request", "talker"))
            if not task.done():
                task.cancel()

        when_done(context, on_done)
        final = None
        try:
            yield pb.Code2WavResponse(accepted=pb.Accepted(listen_token=token))
            while (report := await reports.get()) is not None:    # None: `ended` is resolved
                yield pb.Code2WavResponse(playback=report)
            final = job.ended.result()
            if isinstance(final, StageError):
                if (ending := self.ending(context)) is not None:
                    yield ending        # the talker stops writing frames, then gets the status
                await abort(context, final.code, final.message)
            yield self.to_proto(job, final)
        finally:
            timer.cancel()
            self.listening.pop(token, None)
            if final is None:    # the talker went away: end the listener's stream too
                self._fail(job, StageError(grpc.StatusCode.CANCELLED, "the talker cancelled the request", "talker"))
            if not task.done():
                task.cancel()
            tracing.record_phases(self.engine.name, job, final)

    def _fail(self, job: Code2WavJob, error: StageError) -> None:
        """End a to_listener request with `error` on both its streams. The engine lets the request
        go in every case (a no-op once it finished): `ended` may be resolved -- or cancelled, with
        the handler that awaited it -- while the engine still holds the request."""
        self.engine.cancel(job)
        if job.ended is None or job.ended.done():
            return
        job.outbox.put(error)
        job.end(error)

    def _delivered(self, job: Code2WavJob, samples: int) -> None:
        """The listener's stream took `samples` more: its clock moves; a report goes up if one is due."""
        self.engine.delivered(job, samples)
        if job.reports is None:
            return
        now = time.monotonic()
        if now - job.reported_at >= REPORT_EVERY_S:
            job.reported_at = now
            clock = job.playback
            job.reports.put_nowait(pb.Playback(played_seconds=clock.position(now), delivered_seconds=clock.delivered))

    @traced_rpc("voxpipe.v1.Code2Wav", "Listen")
    async def Listen(self, request: pb.ListenRequest, context: grpc.aio.ServicerContext):
        job = self.listening.pop(request.listen_token, None)
        if job is None:
            await abort(context, grpc.StatusCode.NOT_FOUND,
                        "no audio stream for this listen token (unknown, already taken or expired)")
            return
        # the listener's call ended: nobody wants this audio any more (a no-op once the request ended)
        when_done(context, lambda _context: self._fail(
            job, StageError(grpc.StatusCode.CANCELLED, "the audio listener went away")))
        try:
            async for item in self._outputs(job):      # no cleanup of its own: the finally below is
                if isinstance(item, StageError):
                    job.end(item)
                    await abort(context, item.code, item.message, item.stage)
                yield self.to_proto(job, item)
                if isinstance(item, AudioOut):
                    self._delivered(job, item.samples.shape[0])
                if isinstance(item, Finished):
                    job.end(item)
                    return
        finally:
            if not job.ended.done():   # the listener went away: nobody wants this audio any more
                self._fail(job, StageError(grpc.StatusCode.CANCELLED, "the audio listener went away"))


def build(args) -> Code2WavServicer:
    setup = stage_setup(args)      # bad flags fail before the weights load (code2wav dials no stage: setup.tls unused)
    cfg = OmniConfig.load(args.model)
    model = load_stage_model(args, setup, lambda: Code2WavModel(cfg.code2wav), "code2wav.",
                             dtype=torch.float32 if args.dtype == "auto" else setup.dtype)
    engine = Code2WavEngine(model, cfg.code2wav, device=setup.device, max_active=args.max_batch,
                            cuda_graphs=args.cuda_graphs, eager_fallback=args.eager_fallback)
    if args.listen_timeout <= 0:
        raise ConfigError(f"--listen-timeout must be positive, got {args.listen_timeout}")
    return Code2WavServicer(engine, setup.opts, cfg, args.first_chunk_frames, args.chunk_frames,
                            args.listen_timeout)


def run(args) -> None:
    serve_stage(args, "code2wav", build, pb_grpc.add_Code2WavServicer_to_server, "voxpipe.v1.Code2Wav")
