"""The Thinker stream of a streamed turn (ThinkerStart.stream_audio), the servicer's side: the
pending start checked and its job opened in the engine (streaming.py), the clip's AudioFrames
checked and handed over as they come, and at the StreamCommit the whole turn checked as one
ordinary start would be (the servicer's `job_of`) and submitted to take the pending job's place.
Cancel, the end of the request stream or a disconnect before the commit frees the pending job."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

import grpc
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.calls import abort, when_done
from ..runtime.engine import Outbox
from ..runtime.sampling import MAX_AUDIO_FEATURE, check_features
from ..runtime.server import Abort
from ..runtime.tensors import TensorError, from_proto, ids_of
from .job import ThinkerJob
from .model import audio_output_length
from .streamed import StreamedClip

if TYPE_CHECKING:
    from .server import ThinkerServicer

# the only ThinkerStart fields of a pending start: the conversation before the clip
PENDING_FIELDS = {"request_id", "token_ids", "audio_features", "stream_audio"}
COMMIT_REFUSED = ("request_id", "audio_features", "stream_audio", "text")


class StreamedTurns:
    def __init__(self, servicer: "ThinkerServicer") -> None:
        self.servicer = servicer
        self.engine = servicer.engine
        self.cfg = servicer.cfg.thinker

    def pending_job(self, start: pb.ThinkerStart, audio: list[torch.Tensor]) -> ThinkerJob:
        """The job of a pending start (checked: the conversation before the clip, nothing else)."""
        if start.WhichOneof("prompt") != "token_ids":
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "stream_audio needs token_ids: the conversation before the clip")
        given = sorted(f.name for f, _ in start.ListFields() if f.name not in PENDING_FIELDS)
        if given:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"stream_audio: the start gives the conversation before the streamed clip only; "
                        f"{', '.join(given)}: in the commit (StreamCommit.start)")
        try:
            ids = ids_of(start.token_ids)
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        self.servicer.check_prompt(ids, audio)
        self._check_length(len(ids), 0)
        return ThinkerJob(request_id=start.request_id or uuid.uuid4().hex, outbox=Outbox(asyncio.get_running_loop()),
                          prompt=ids, audio=audio, pending=True, stream_start=len(ids),
                          streamed=StreamedClip.for_tower(self.engine.runner.model.audio_tower))

    def _check_length(self, prefix: int, frames: int) -> None:
        tokens = prefix + audio_output_length(frames, self.cfg.audio.n_window) + 1
        if tokens > self.engine.max_len:
            raise Abort(grpc.StatusCode.OUT_OF_RANGE,
                        f"the conversation of {prefix} tokens and the streamed clip of {frames} frames make "
                        f"{tokens - 1} prompt tokens, past the context of {self.engine.max_len}")

    def _frames(self, t: pb.Tensor, name: str) -> torch.Tensor:
        try:
            raw = from_proto(t, dtype=torch.float32, shape=(self.cfg.audio.num_mel_bins, None), name=name)
            check_features(raw, name, MAX_AUDIO_FEATURE)
        except (TensorError, ValueError) as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return raw

    async def stream(self, pending: ThinkerJob, it, context: grpc.aio.ServicerContext) -> ThinkerJob | None:
        """Read the clip's frames until the commit: the committed job (submitted by the caller as any
        job), or None when the turn was cancelled or the stream ended first."""
        self.engine.streams.open(pending)
        handed = False

        def on_done(_context) -> None:       # the call ended (a disconnect among them) before the commit
            if not handed:
                self.engine.cancel(pending)

        when_done(context, on_done)
        frames = 0
        try:
            async for msg in it:
                kind = msg.WhichOneof("kind")
                if kind == "audio":
                    raw = self._frames(msg.audio.log_mel, "audio.log_mel")
                    frames += raw.shape[1]
                    self._check_length(pending.stream_start, frames)
                    self.engine.streams.hear(pending, raw)
                elif kind == "commit":
                    raw = (self._frames(msg.commit.log_mel, "commit.log_mel") if msg.commit.HasField("log_mel")
                           else torch.zeros(self.cfg.audio.num_mel_bins, 0))
                    frames += raw.shape[1]
                    job = self._committed(pending, msg.commit.start, frames)
                    await self.servicer.prepare(job)
                    self.engine.streams.hear(pending, raw)
                    handed = True
                    return job
                elif kind == "cancel":
                    return None
                else:
                    raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} in a streamed turn "
                                                                  "(audio, commit or cancel)")
            return None
        except Abort as e:
            await abort(context, e.code, e.message)
            return None
        finally:
            if not handed:
                self.engine.cancel(pending)

    def _committed(self, pending: ThinkerJob, start: pb.ThinkerStart, frames: int) -> ThinkerJob:
        """The whole turn as one start: the pending start's conversation, the clip's placeholders,
        then the commit's token ids, with the commit's parameters (checked as any start's)."""
        refused = [name for name in COMMIT_REFUSED if _given(start, name)]
        if refused:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"commit.start must leave {', '.join(refused)} unset: they are the stream's")
        if frames == 0:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the streamed clip has no frames")
        self._check_length(pending.stream_start, frames)
        tokens = audio_output_length(frames, self.cfg.audio.n_window)
        try:
            tail = ids_of(start.token_ids, "commit.start.token_ids")
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        ids = pending.prompt[:pending.stream_start] + [self.cfg.tokens.audio_token] * tokens + tail
        job = self.servicer.job_of(start, ids, list(pending.audio), streamed_tokens=tokens)
        job.request_id, job.adopts = pending.request_id, pending
        return job


def _given(start: pb.ThinkerStart, name: str) -> bool:
    if name == "text":
        return start.WhichOneof("prompt") == "text"
    value = getattr(start, name)
    return len(value) > 0 if name == "audio_features" else bool(value)
