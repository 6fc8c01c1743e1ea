"""Talker engine: codec-0 steps batched across requests, then the code predictor batched across
the requests that produced a frame, then each frame out as soon as it exists.

Text rows arrive while the talker runs. Row i of a request is the thinker embedding of the
(i+1)-th assistant text token; the very last token the thinker produces is never spoken, so a
row is usable only once a later row (or the end of text) has arrived. Step k's input needs
trailing row k + 1 (then tts_eos once, then tts_pad): a request whose row is not there yet
simply sits out that step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.config import TalkerConfig
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.kv_cache import SlotKVCache, SlotStep
from ..runtime.sampling import SamplingParams, apply_repetition_penalty, choose
from ..runtime.tensors import to_proto
from .model import TalkerModel

log = logging.getLogger(__name__)

# transformers samples the code predictor with these whenever the talker samples
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


@dataclass
class TalkerJob(EngineRequest):
    user_rows: torch.Tensor | None = None       # [U, thinker_hidden]
    user_mm_mask: torch.Tensor | None = None    # [U] bool
    head: torch.Tensor | None = None            # [3, thinker_hidden]
    special: torch.Tensor | None = None         # [3, thinker_hidden]: tts_bos, tts_eos, tts_pad
    speaker_id: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int = 0
    min_frames: int = 0
    rows: list[torch.Tensor] = field(default_factory=list)   # thinker-space text rows [H] in order
    text_done: bool = False
    slot: int | None = None
    prompt_len: int = 0
    codes0: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None         # next input without its text row [Hk]
    generator: torch.Generator | None = None
    frames_sent: int = 0

    def row_state(self, i: int) -> str:
        """'row' if text row i is usable, 'eos' / 'pad' past the text, 'wait' if not known yet."""
        if i < len(self.rows) - 1:
            return "row"
        if not self.text_done:
            return "wait"
        return "eos" if i == len(self.rows) - 1 else "pad"


class TalkerEngine(StageEngine):
    name = "talker"

    def __init__(self, model: TalkerModel, cfg: TalkerConfig, *, device: torch.device, max_active: int,
                 max_len: int) -> None:
        super().__init__(max_active)
        self.model, self.cfg, self.device = model, cfg, device
        self.dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = SlotKVCache(t.num_layers, max_active, max_len, t.num_kv_heads, t.head_dim, self.dtype, device)
        self.max_len = max_len
        suppress = torch.zeros(t.vocab_size, dtype=torch.bool, device=device)
        suppress[list(cfg.suppressed_tokens)] = True
        suppress[cfg.codec.eos] = False
        self.suppress = suppress

    # ---- inputs from the handler
    def add_rows(self, job: TalkerJob, rows: torch.Tensor) -> None:
        with self.lock:
            job.rows.extend(rows.unbind(0))
            self.lock.notify_all()

    def end_text(self, job: TalkerJob) -> None:
        with self.lock:
            job.text_done = True
            self.lock.notify_all()

    # ---- scheduling
    def _prefill_ready(self, job: TalkerJob) -> bool:
        return job.row_state(0) != "wait"

    def _decode_ready(self, job: TalkerJob) -> bool:
        return job.pending is not None and job.row_state(len(job.codes0)) != "wait"

    def has_work(self) -> bool:
        if any(self._decode_ready(j) for j in self.running):
            return True
        return self.cache.free_slots > 0 and any(self._prefill_ready(j) for j in self.waiting)

    def release(self, req: TalkerJob) -> None:
        if req.slot is not None:
            self.cache.release(req.slot)
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            job = None
            if self.cache.free_slots > 0:
                job = next((j for j in self.waiting if self._prefill_ready(j)), None)
                if job is not None:
                    self.waiting.remove(job)
                    if job.row_state(0) != "row":      # the thinker said nothing speakable
                        self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.STOP)))
                        job = None
                    else:
                        job.slot = self.cache.allocate()
                        job.mark_started()
                        self.running.append(job)
            decoding = [j for j in self.running if j is not job and self._decode_ready(j)]
            trailing = [self._trailing(j) for j in decoding]
        results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]] = []
        if job is not None:
            logits, hidden = self._prefill(job)
            results.append((job, logits[0], hidden[0]))
        if decoding:
            x = torch.stack([j.pending for j in decoding]) + self._project(trailing)
            start = [j.prompt_len + len(j.codes0) - 1 for j in decoding]
            step = SlotStep.build([j.slot for j in decoding], start, 1, self.device)
            positions = torch.tensor(start, device=self.device)[:, None]
            for j in decoding:
                j.pending = None
            logits, hidden = self.model(x[:, None], positions, self.cache.bind(step))
            results.extend(zip(decoding, logits, hidden))
        if results:
            self._sample(results)

    def _trailing(self, job: TalkerJob) -> torch.Tensor:
        """The thinker-space text row for the step about to run (trailing index = frames made)."""
        state = job.row_state(len(job.codes0))
        if state == "row":
            return job.rows[len(job.codes0)]
        return job.special[1] if state == "eos" else job.special[2]

    def _project(self, rows: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(rows).to(self.device, self.dtype)
        return self.model.text_projection(x)

    def _prefill(self, job: TalkerJob) -> tuple[torch.Tensor, torch.Tensor]:
        m, c = self.model, self.cfg.codec
        dev, dt = self.device, self.dtype
        user = job.user_rows.to(dev, dt)
        mm = job.user_mm_mask.to(dev)
        user_part = torch.empty(user.shape[0], self.cfg.text.hidden_size, device=dev, dtype=dt)
        if bool(mm.any()):
            user_part[mm] = m.hidden_projection(user[mm])
        if bool((~mm).any()):
            user_part[~mm] = m.text_projection(user[~mm])
        head = m.text_projection(job.head.to(dev, dt))                                    # [3, Hk]
        bos, _eos, pad = m.text_projection(job.special.to(dev, dt)).unbind(0)
        first = m.text_projection(job.rows[0].to(dev, dt)[None])[0]
        text_side = torch.cat((head, pad.expand(4, -1), bos[None], first[None]))          # [9, Hk]
        codec_ids = torch.tensor([c.nothink, c.think_bos, c.think_eos, job.speaker_id, c.pad, c.bos], device=dev)
        codec_side = torch.cat((torch.zeros(3, text_side.shape[1], device=dev, dtype=dt),
                                m.model.codec_embedding(codec_ids)))
        x = torch.cat((user_part, text_side + codec_side))[None]                           # [1, L, Hk]
        job.prompt_len = x.shape[1]
        step = SlotStep.build([job.slot], [0], job.prompt_len, dev)
        positions = torch.arange(job.prompt_len, device=dev)[None]
        job.generator = job.params.generator(dev)
        return self.model(x, positions, self.cache.bind(step))

    def _sample(self, results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]]) -> None:
        eos = self.cfg.codec.eos
        framing: list[tuple[TalkerJob, int, torch.Tensor]] = []
        for job, logits, hidden in results:
            row = logits.float()
            if job.codes0:
                row = apply_repetition_penalty(row, torch.tensor(job.codes0, device=row.device),
                                               job.params.repetition_penalty)
            row = row.masked_fill(self.suppress, float("-inf"))
            if len(job.codes0) < job.min_frames:
                row[eos] = float("-inf")
            code0 = choose(row, job.params, job.generator)
            job.codes0.append(code0)
            if code0 == eos:
                self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.STOP, completion_tokens=job.frames_sent)))
            elif len(job.codes0) >= job.max_frames:
                self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.LENGTH, completion_tokens=job.frames_sent)))
            else:
                framing.append((job, code0, hidden))
        if not framing:
            return
        jobs = [f[0] for f in framing]
        code0 = torch.tensor([f[1] for f in framing], device=self.device)
        hidden = torch.stack([f[2] for f in framing])
        code0_embed = self.model.model.codec_embedding(code0)
        residual, embeds = self.model.code_predictor.predict(hidden, code0_embed, self._picker(jobs))
        frames = torch.cat((code0[:, None], residual), dim=1).to(torch.int64)            # [B, G]
        nxt = torch.stack([code0_embed] + embeds, dim=1).sum(1)                           # [B, Hk]
        frames_cpu = frames.cpu().to(torch.uint16)
        with self.lock:
            for i, job in enumerate(jobs):
                job.pending = nxt[i]
        for i, job in enumerate(jobs):
            job.mark_output()
            job.outbox.put(pb.TalkerResponse(frames=pb.CodecFrames(index=job.frames_sent,
                                                                    codes=to_proto(frames_cpu[i:i + 1]))))
            job.frames_sent += 1

    def _picker(self, jobs: list[TalkerJob]):
        greedy = all(j.params.greedy for j in jobs)

        def pick(logits: torch.Tensor, group: int) -> torch.Tensor:
            if greedy:
                return logits.argmax(-1)
            out = []
            for j, row in zip(jobs, logits.float()):
                p = PREDICTOR_SAMPLING if not j.params.greedy else SamplingParams()
                out.append(choose(row, p, j.generator))
            return torch.tensor(out, device=logits.device)

        return pick
