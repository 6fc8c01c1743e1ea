"""Code2Wav engine: every step decodes the frames that arrived for each running utterance and sends
each utterance's new samples as one chunk.

A step runs frame by frame, batched across utterances: one first-frame decode for the utterances
starting now, then rounds of the one-frame decode, round r over the utterances with more than r new
frames (at most MAX_FRAMES_PER_STEP rounds) -- CUDA-graph replays on the GPU, the same functions
eagerly elsewhere. The streaming decoder is exact, so this equals decoding any chunking at once;
decoding one frame at a time also makes an utterance's samples independent of how its frames
happened to arrive."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.config import Code2WavConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.sampling import finite_rows
from .model import Code2WavModel, StreamStore

log = logging.getLogger(__name__)

# frames per utterance per step (or the utterance's chunk size, if larger): bounds the rounds of a step,
# so an utterance that starts now gets its first chunk after a few rounds even while others work off a
# backlog (a step sends at its end)
MAX_FRAMES_PER_STEP = 4


@dataclass
class Code2WavJob(EngineRequest):
    encoding: int = pb.AUDIO_PCM16
    first_chunk_frames: int = 1
    chunk_frames: int = 1
    frames: list[torch.Tensor] = field(default_factory=list)   # pending [G] int64 codes
    frames_end: bool = False
    slot: int | None = None
    frames_decoded: int = 0
    samples_sent: int = 0
    owed: int = 0              # frames of a chunk already due but not yet decoded (a capped step left them)
    # to_listener (see server.py): the audio goes to a Code2Wav.Listen stream
    to_listener: bool = False
    echo_frames: bool = False
    ended: "asyncio.Future | None" = None   # the request's last item (Finished response or StageError)

    def end(self, final: Any) -> None:
        """Resolve `ended` (first caller wins)."""
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(final)

    def _need(self) -> int:
        return self.first_chunk_frames if self.frames_decoded == 0 else self.chunk_frames

    def _due(self) -> bool:
        """A chunk is due: `need` frames wait, or the frames ended."""
        n = len(self.frames)
        return n >= self._need() or (self.frames_end and n > 0)

    def ready_frames(self) -> int:
        """Frames the next step decodes for this utterance (0: wait for more): the frames waiting
        when a chunk is due, or what is still owed of one, at most max(MAX_FRAMES_PER_STEP, need)."""
        return min(len(self.frames) if self._due() else self.owed, max(MAX_FRAMES_PER_STEP, self._need()))

    def take(self, n: int) -> list[torch.Tensor]:
        """The next n frames, for this step (n = ready_frames())."""
        self.owed = (len(self.frames) if self._due() else self.owed) - n
        taken, self.frames = self.frames[:n], self.frames[n:]
        return taken


def encode_samples(samples: np.ndarray, encoding: int) -> bytes:
    if encoding == pb.AUDIO_FLOAT32:
        return samples.astype("<f4").tobytes()
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


def _checked(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclamped samples [n, S] -> (samples clamped to [-1, 1] [n, S], the row was finite [n] bool);
    inside the captured step, so the flag costs no host sync of its own."""
    return raw.clamp(-1.0, 1.0), finite_rows(raw)


class Code2WavEngine(StageEngine):
    name = "code2wav"

    def __init__(self, model: Code2WavModel, cfg: Code2WavConfig, *, device: torch.device, max_active: int,
                 cuda_graphs: bool = True, eager_fallback: bool = False) -> None:
        super().__init__(max_active)
        self.model, self.cfg, self.device = model, cfg, device
        dtype = next(model.parameters()).dtype
        self.store = StreamStore(model, max_active, dtype, device)
        self.graphs = self.first_graphs = None
        if cuda_graphs and graphs_available(device):
            q = cfg.num_quantizers
            example = (torch.zeros(max_active, q, 1, dtype=torch.long, device=device),
                       torch.full((max_active,), self.store.scratch, dtype=torch.long, device=device),
                       torch.zeros(max_active, dtype=torch.long, device=device))
            pad = (None, self.store.scratch, None)
            with torch.inference_mode():
                self.graphs = captured("code2wav one-frame step", lambda: GraphedStep(
                    self._frame_fn, example, buckets(max_active), [1], "code2wav one-frame step", pad=pad),
                    eager_fallback)
                self.first_graphs = captured("code2wav first frame", lambda: GraphedStep(
                    self._first_fn, example, buckets(max_active), [1], "code2wav first frame", pad=pad),
                    eager_fallback)

    def _frame_fn(self, n: int, _kv: int, codes: torch.Tensor, slots: torch.Tensor,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new frame for each of n utterances past their first chunk: codes [n, Q, 1]."""
        return _checked(self.model.decode_unclamped(codes, slots, start, self.store, first=False))

    def _first_fn(self, n: int, _kv: int, codes: torch.Tensor, slots: torch.Tensor,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first frame of n new utterances: codes [n, Q, 1]."""
        return _checked(self.model.decode_unclamped(codes, slots, start, self.store, first=True))

    def add_frames(self, job: Code2WavJob, codes: torch.Tensor) -> None:
        with self.lock:
            job.frames.extend(codes.to(torch.int64).unbind(0))
            self.lock.notify_all()

    def end_frames(self, job: Code2WavJob) -> None:
        with self.lock:
            job.frames_end = True
            self.lock.notify_all()

    def has_work(self) -> bool:
        if self.waiting and self.store.free_slots > 0:
            return True
        return any((j.ready_frames() and not j.outbox.saturated) or (j.frames_end and not j.frames)
                   for j in self.running)

    def release(self, req: Code2WavJob) -> None:
        if req.slot is not None:
            self.store.release(req.slot)
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        work: list[tuple[Code2WavJob, list[torch.Tensor]]] = []
        with self.lock:
            while self.waiting and self.store.free_slots > 0:
                job = self.waiting[0]
                job.slot = self.store.allocate()
                job.mark_started()
                self.running.append(job)
                self.waiting.pop(0)
            for job in list(self.running):
                n = 0 if job.outbox.saturated else job.ready_frames()
                if n:
                    work.append((job, job.take(n)))
                elif job.frames_end and not job.frames:
                    self.finish(job, pb.Code2WavResponse(finished=pb.Finished(
                        reason=pb.STOP, completion_tokens=job.frames_decoded, samples=job.samples_sent)))
        if not work:
            return
        decoded, usable = self._decode_frames(work)
        for (job, take), samples, ok in zip(work, decoded, usable):
            if not ok:
                self.store.scrub(job.slot)     # its state must not reach the slot's next utterance
                self.finish(job, self.nonfinite(job, "audio samples"))
                continue
            job.frames_decoded += len(take)
            job.mark_output()
            job.outbox.put(pb.Code2WavResponse(audio=pb.AudioChunk(
                sample_offset=job.samples_sent, sample_rate=self.cfg.sample_rate, encoding=job.encoding,
                data=encode_samples(samples, job.encoding), num_samples=samples.shape[0])))
            job.samples_sent += samples.shape[0]

    def _decode_frames(self, work: list[tuple[Code2WavJob, list[torch.Tensor]]]) -> tuple[list[np.ndarray], list[bool]]:
        """Frame by frame (first frames, then rounds); one copy to the host. Per utterance: its new
        samples, and whether all of them were finite."""
        dev = self.device
        done = [0] * len(work)
        outputs: list[torch.Tensor] = []                   # one [rows, samples] per replay
        finite: list[torch.Tensor] = []                    # one [rows] float32 (1.0: finite) per replay
        pieces: list[list[tuple[int, int]]] = [[] for _ in work]   # per utterance: (replay, row)
        first = [i for i, (job, _) in enumerate(work) if job.frames_decoded == 0]
        first_fn = self.first_graphs if self.first_graphs is not None else self._first_fn
        frame_fn = self.graphs if self.graphs is not None else self._frame_fn
        batch = (first_fn, first) if first else None
        while True:
            if batch is None:
                rows = [i for i, (_, take) in enumerate(work) if done[i] < len(take)]
                if not rows:
                    break
                batch = (frame_fn, rows)
            decode, rows = batch
            batch = None
            codes = torch.stack([work[i][1][done[i]] for i in rows])[:, :, None].to(dev, non_blocking=True)
            slots = torch.tensor([work[i][0].slot for i in rows]).to(dev, non_blocking=True)
            start = torch.tensor([work[i][0].frames_decoded + done[i] for i in rows]).to(dev, non_blocking=True)
            wav, ok = decode(len(rows), 1, codes, slots, start)
            outputs.append(wav.to(torch.float32, copy=True))   # a graph's next replay overwrites `wav`
            finite.append(ok.to(torch.float32))                # a copy too
            for r, i in enumerate(rows):
                pieces[i].append((len(outputs) - 1, r))
                done[i] += 1
        flat = torch.cat([o.flatten() for o in outputs + finite]).cpu()
        host = [h.numpy() for h in flat.split([o.numel() for o in outputs + finite])]
        host, ok = [h.reshape(o.shape) for h, o in zip(host, outputs)], host[len(outputs):]
        return ([np.concatenate([host[k][r] for k, r in p]) for p in pieces],
                [all(ok[k][r] == 1.0 for k, r in p) for p in pieces])
