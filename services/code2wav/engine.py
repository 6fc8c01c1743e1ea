"""Code2Wav engine: every step decodes the frames that arrived for each running utterance and sends
each utterance's new samples as one AudioOut.

    step: scheduler (slots, frames per utterance: scheduler.py) -> runner (decode: runner.py)
          -> output step here (non-finite audio fails its utterance alone; samples out; finish)"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime import metrics
from ..runtime.config import Code2WavConfig
from ..runtime.engine import EngineRequest, StageEngine, StageError
from ..runtime.playback import PlaybackClock
from ..runtime.outputs import AudioOut, Finished, FinishReason
from .model import Code2WavModel
from .runner import Code2WavRunner, FrameWork
from .scheduler import Code2WavScheduler


@dataclass
class Code2WavJob(EngineRequest):
    encoding: int = pb.AUDIO_PCM16   # the wire encoding of its audio (the servicer encodes)
    first_chunk_frames: int = 1
    chunk_frames: int = 1
    frames: list[torch.Tensor] = field(default_factory=list)   # received, not yet decoded: [Q] int64 codes
    frames_end: bool = False
    slot: int | None = None
    frames_decoded: int = 0
    samples_sent: int = 0
    owed: int = 0              # frames of a due chunk not yet decoded (see scheduler.py)
    # to_listener (see server.py): the audio goes to a Code2Wav.Listen stream
    to_listener: bool = False
    echo_frames: bool = False
    ended: "asyncio.Future | None" = None   # the request's last item (Finished or StageError)
    # its listener: emitted = audio decoded; delivered = audio its Listen stream has written
    # (Code2WavEngine.delivered) when to_listener (measured), else = emitted
    playback: PlaybackClock = field(default_factory=PlaybackClock)
    skips: int = 0             # steps sat out in a row (scheduler: DeadlinePolicy)
    playback_reports: bool = False   # to_listener: report the listener on the Decode stream (Code2WavStart)
    reports: "asyncio.Queue | None" = None   # with playback_reports: pb.Playback for the Decode stream (server.py)
    reported_at: float = float("-inf")      # monotonic time of the last report

    def end(self, final: Finished | StageError) -> None:
        """Resolve `ended` (first caller wins)."""
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(final)

    def take(self, n: int) -> list[torch.Tensor]:
        """The next n waiting frames, for this step (n: what the schedule gave it)."""
        taken, self.frames = self.frames[:n], self.frames[n:]
        return taken


class Code2WavEngine(StageEngine):
    name = "code2wav"

    def __init__(self, model: Code2WavModel, cfg: Code2WavConfig, *, device: torch.device, max_active: int,
                 cuda_graphs: bool = True, eager_fallback: bool = False) -> None:
        super().__init__(max_active)
        self.cfg, self.device = cfg, device
        self.scheduler = Code2WavScheduler()
        self.slack_gauges = metrics.SlackGauges(self.name)
        self.runner = Code2WavRunner(model, cfg, device=device, max_active=max_active, cuda_graphs=cuda_graphs,
                                     eager_fallback=eager_fallback)

    # ---- inputs from the handler
    def add_frames(self, job: Code2WavJob, codes: torch.Tensor) -> None:
        with self.lock:
            job.frames.extend(codes.to(torch.int64).unbind(0))
            self.lock.notify_all()

    def end_frames(self, job: Code2WavJob) -> None:
        with self.lock:
            job.frames_end = True
            self.lock.notify_all()

    def delivered(self, job: Code2WavJob, samples: int) -> None:
        """`samples` of the request's audio were written to its stream (toward the listener)."""
        with self.lock:
            clock = job.playback
            before = clock.underruns
            clock.deliver(samples / self.cfg.sample_rate, time.monotonic())
            metrics.count_underruns(self.name, clock, before)

    # ---- the loop's hooks
    def has_work(self) -> bool:
        return self.scheduler.has_work(self.waiting, self.running, self.runner.free_slots)

    def _set_gauges(self) -> None:
        super()._set_gauges()
        self.slack_gauges.update((*self.waiting, *self.running), time.monotonic())

    def release(self, req: Code2WavJob) -> None:
        if req.slot is not None:
            self.runner.release(req.slot)
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            plan = self.scheduler.schedule(self.waiting, self.running, self.runner.free_slots, time.monotonic())
            for job in plan.admitted:
                job.slot = self.runner.allocate()
                job.mark_started()
                self.running.append(job)
                self.waiting.remove(job)
            for job in plan.finished:
                self.finish(job, Finished(FinishReason.STOP, completion_tokens=job.frames_decoded,
                                          samples=job.samples_sent))
            work = [(job, job.take(n)) for job, n in plan.decode]
        if not work:
            return
        audio, usable = self.runner.decode([FrameWork(job.slot, job.frames_decoded, frames) for job, frames in work])
        self._output(work, audio, usable)

    def _output(self, work: list[tuple[Code2WavJob, list[torch.Tensor]]], audio: list[np.ndarray],
                usable: list[bool]) -> None:
        now = time.monotonic()
        for (job, frames), samples, ok in zip(work, audio, usable):
            if not ok:
                self.runner.scrub(job.slot)     # its state must not reach the slot's next utterance
                self.finish(job, self.nonfinite(job, "audio samples"))
                continue
            job.frames_decoded += len(frames)
            with self.lock:
                job.playback.emit(samples.shape[0] / self.cfg.sample_rate, now)
            job.mark_output()
            job.outbox.put(AudioOut(job.samples_sent, samples))
            job.samples_sent += samples.shape[0]
