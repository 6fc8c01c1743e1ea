"""Code2Wav engine: every step decodes the frames that arrived for each running utterance,
batched across utterances that are at the same phase (first chunk or not) and have the same
number of new frames, and sends their new samples at once."""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.config import Code2WavConfig
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.kv_cache import SlidingWindowCache
from .model import Code2WavModel, StreamState

log = logging.getLogger(__name__)

MAX_FRAMES_PER_DECODE = 64


@dataclass
class Code2WavJob(EngineRequest):
    encoding: int = pb.AUDIO_PCM16
    first_chunk_frames: int = 1
    chunk_frames: int = 1
    frames: list[torch.Tensor] = field(default_factory=list)   # pending [G] int64 codes
    frames_end: bool = False
    state: StreamState | None = None
    frames_decoded: int = 0
    samples_sent: int = 0

    def ready_frames(self) -> int:
        need = self.first_chunk_frames if self.frames_decoded == 0 else self.chunk_frames
        n = len(self.frames)
        if n >= need or (self.frames_end and n > 0):
            return min(n, MAX_FRAMES_PER_DECODE)
        return 0


def encode_samples(samples: np.ndarray, encoding: int) -> bytes:
    if encoding == pb.AUDIO_FLOAT32:
        return samples.astype("<f4").tobytes()
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()


class Code2WavEngine(StageEngine):
    name = "code2wav"

    def __init__(self, model: Code2WavModel, cfg: Code2WavConfig, *, device: torch.device, max_active: int) -> None:
        super().__init__(max_active)
        self.model, self.cfg, self.device = model, cfg, device
        t = cfg.transformer
        dtype = next(model.parameters()).dtype
        self.cache = SlidingWindowCache(t.num_layers, max_active, t.sliding_window, t.num_kv_heads, t.head_dim,
                                        dtype, device)

    def add_frames(self, job: Code2WavJob, codes: torch.Tensor) -> None:
        with self.lock:
            job.frames.extend(codes.to(torch.int64).unbind(0))
            self.lock.notify_all()

    def end_frames(self, job: Code2WavJob) -> None:
        with self.lock:
            job.frames_end = True
            self.lock.notify_all()

    def has_work(self) -> bool:
        if self.waiting and self.cache.free_slots > 0:
            return True
        return any(j.ready_frames() or (j.frames_end and not j.frames) for j in self.running)

    def release(self, req: Code2WavJob) -> None:
        if req.state is not None:
            self.cache.release(req.state.slot)
            req.state = None

    @torch.inference_mode()
    def step(self) -> None:
        groups: dict[tuple[bool, int], list[tuple[Code2WavJob, list[torch.Tensor]]]] = defaultdict(list)
        with self.lock:
            while self.waiting and self.cache.free_slots > 0:
                job = self.waiting[0]
                job.state = StreamState(slot=self.cache.allocate())
                job.mark_started()
                self.running.append(job)
                self.waiting.pop(0)
            for job in list(self.running):
                n = job.ready_frames()
                if n:
                    take, job.frames = job.frames[:n], job.frames[n:]
                    groups[(job.frames_decoded == 0, n)].append((job, take))
                elif job.frames_end and not job.frames:
                    self.finish(job, pb.Code2WavResponse(finished=pb.Finished(
                        reason=pb.STOP, completion_tokens=job.frames_decoded, samples=job.samples_sent)))
        for (first, n), members in groups.items():
            jobs = [m[0] for m in members]
            codes = torch.stack([torch.stack(m[1], dim=1) for m in members]).to(self.device)   # [B, G, n]
            wav = self.model.decode(codes, [j.state for j in jobs], self.cache, first).float().cpu().numpy()
            for job, samples in zip(jobs, wav):
                job.frames_decoded += n
                job.mark_output()
                job.outbox.put(pb.Code2WavResponse(audio=pb.AudioChunk(
                    sample_offset=job.samples_sent, sample_rate=self.cfg.sample_rate, encoding=job.encoding,
                    data=encode_samples(samples, job.encoding), num_samples=samples.shape[0])))
                job.samples_sent += samples.shape[0]
