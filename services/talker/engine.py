"""Talker engine: codec-0 steps batched across requests, then the code predictor batched across
them (greedy: every row of the step, before the host reads code 0; the frames of rows that stop are
dropped; sampling: the rows that go on), then each frame out as soon as it exists.

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

from voxpipe import kernels
from voxpipe.v1 import stages_pb2 as pb

from ..runtime import metrics
from ..runtime.config import TalkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.kv_cache import SlotKVCache
from ..runtime.sampling import SamplingParams, finite_rows, pick
from ..runtime.tensors import to_proto
from .model import TalkerModel

log = logging.getLogger(__name__)

PROMPT_TAIL = 9   # prompt rows after the user turns: assistant head (3), 4 x tts_pad, tts_bos, first text row

# The default bound on a spoken reply from its text (TalkerStart.text_cap unset): 10 frames
# (0.8 s) per text row plus 25 (2 s). Speech takes about 3 to 5 frames per token, so this ends
# only a reply that would not end by itself (a talker that never emits its codec EOS).
DEFAULT_TEXT_CAP = (10, 25)

# transformers samples the code predictor with these whenever the talker samples
PREDICTOR_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.8)


def greedy_codes(usable: list[torch.Tensor]):
    """The code predictor's greedy `pick`: argmax per row; appends each pass's per-row finite flags
    [B] bool to `usable` (static shapes, no host sync: it runs inside the predictor's CUDA graph)."""

    def pick_codes(logits: torch.Tensor, group: int) -> torch.Tensor:
        usable.append(finite_rows(logits))
        return logits.argmax(-1)

    return pick_codes


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
    text_cap: tuple[int, int] = DEFAULT_TEXT_CAP   # (frames per text row, base frames): see frame_cap
    code2wav: pb.Code2WavParams | None = None   # frames continue in a code2wav (see relay.py)
    rows: list[torch.Tensor] = field(default_factory=list)   # thinker-space text rows [H] in order
    text_done: bool = False
    slot: int | None = None
    prompt_len: int = 0
    codes0: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None         # next input without its text row [Hk]
    generator: torch.Generator | None = None
    frames_sent: int = 0

    def frame_cap(self) -> int:
        """The most frames to speak by the text (TalkerStart.text_cap) once it has ended, never below
        min_frames; while text still comes, no bound of its own (the talker trails the text rows then)."""
        if not self.text_done:
            return self.max_frames
        per_token, base = self.text_cap
        return max(per_token * len(self.rows) + base, self.min_frames)

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
                 max_len: int, cuda_graphs: bool = True, prefill_batch: int = 8, prefill_tokens: int = 4096,
                 prefill_graph_len: int = 512, eager_fallback: bool = False) -> None:
        """A step prefills up to `prefill_batch` ready requests with at most `prefill_tokens` padded
        rows together (right-padded); prompts up to `prefill_graph_len` rows replay CUDA graphs."""
        super().__init__(max_active)
        self.prefill_batch, self.prefill_tokens = prefill_batch, prefill_tokens
        self.model, self.cfg, self.device = model, cfg, device
        self.dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = SlotKVCache(t.num_layers, max_active, max_len, t.num_kv_heads, t.head_dim, self.dtype, device)
        self.max_len = max_len
        suppress = torch.zeros(t.vocab_size, dtype=torch.bool, device=device)
        suppress[list(cfg.suppressed_tokens)] = True
        suppress[cfg.codec.eos] = False
        self.suppress = suppress
        self.seen = torch.zeros(max_active, t.vocab_size, dtype=torch.bool, device=device)  # codec-0 ids per slot
        self.step_graphs = self.predictor_graphs = self.prefill_graphs = None
        if cuda_graphs and graphs_available(device):
            self._capture(max_active, max_len, min(prefill_graph_len, max_len), eager_fallback)

    @torch.inference_mode()
    def _capture(self, max_active: int, max_len: int, prefill_len: int, eager_fallback: bool) -> None:
        """Each step's graphs, or GraphCaptureError (with `eager_fallback`: that step runs eagerly)."""
        h, dev = self.cfg.text.hidden_size, self.device
        n = min(self.prefill_batch, max_active)
        self.prefill_graphs = captured("talker prefill", lambda: GraphedStep(
            self._prefill_fn, (torch.zeros(n, prefill_len, h, dtype=self.dtype, device=dev),
                               torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev)),
            buckets(n), buckets(prefill_len, min(32, prefill_len)), "talker prefill",
            pad=(None, 0, self.cache.scratch)), eager_fallback)   # padding rows write the scratch KV row
        self.step_graphs = captured("talker step", lambda: GraphedStep(
            self._step_fn, (torch.zeros(max_active, 1, h, dtype=self.dtype, device=dev),
                            torch.zeros(max_active, dtype=torch.long, device=dev)),
            buckets(max_active), buckets(max_len, min(256, max_len)), "talker step"), eager_fallback)
        self.predictor_graphs = captured("code predictor", lambda: GraphedStep(
            self._predict_fn, (torch.zeros(max_active, h, dtype=self.dtype, device=dev),
                               torch.zeros(max_active, dtype=torch.long, device=dev)),
            buckets(max_active), [1], "code predictor (15 steps)"), eager_fallback)

    def _prefill_fn(self, n: int, s: int, x: torch.Tensor, last: torch.Tensor,
                    slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Prompts [n, >= s, H] (right-padded to s) from position 0 into KV slots [n]: codec-0
        logits [n, V] and final hidden [n, H] at each prompt's `last` position."""
        positions = torch.arange(s, device=x.device)[None].expand(n, s)
        return self.model(x[:, :s], positions, self.cache.prefill_view(slots, s), last=last)

    def _step_fn(self, n: int, kv_len: int, x: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One codec step for the sequences in slots 0..n-1: x [n, 1, H] inputs, start [n] positions."""
        return self.model(x, start[:, None], self.cache.decode_view(n, kv_len, start))

    def _predict_fn(self, n: int, _kv: int, hidden: torch.Tensor,
                    code0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Greedy residual codes [n, G-1], the next input's codec part (sum of all G embeddings)
        [n, H], and whether every pass's logits were finite [n] bool."""
        code0_embed = self.model.model.codec_embedding(code0)
        usable: list[torch.Tensor] = []
        residual, embeds = self.model.code_predictor.predict(hidden, code0_embed, greedy_codes(usable))
        return residual, torch.stack([code0_embed] + embeds, dim=1).sum(1), torch.stack(usable, 1).all(1)

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
        return (job.pending is not None and not job.outbox.saturated
                and job.row_state(len(job.codes0)) != "wait")

    def has_work(self) -> bool:
        if any(self._decode_ready(j) for j in self.running):
            return True
        return self.cache.free_slots > 0 and any(self._prefill_ready(j) for j in self.waiting)

    def release(self, req: TalkerJob) -> None:
        if req.slot is not None:
            last = self.cache.used - 1
            moved = self.cache.release(req.slot)
            if moved is not None:
                self.seen[req.slot] = self.seen[last]
                moved.slot = req.slot
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            jobs = self._admit()
            owners = [self.cache.owners[i] for i in range(self.cache.used)]
            admitted = {id(j) for j in jobs}
            ready = [id(j) not in admitted and self._decode_ready(j) for j in owners]
            trailing = [self._trailing(j) if r else None for j, r in zip(owners, ready)]
        results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]] = []
        if jobs:
            logits, hidden = self._prefill(jobs)
            results.extend((j, logits[b], hidden[b]) for b, j in enumerate(jobs))
        if any(ready):
            results.extend(self._decode(owners, ready, trailing))
        if results:
            self._sample(results)

    def _admit(self) -> list[TalkerJob]:
        """Requests whose first text row is usable, in arrival order, as many as the batch and the
        free slots and the padded-row budget allow. A request the thinker gave
        nothing speakable finishes at once. Each leaves `waiting` only once it holds a slot and
        sits in `running`."""
        for job in [j for j in self.waiting if self._prefill_ready(j) and j.row_state(0) != "row"]:
            self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.STOP)))
        ready = [j for j in self.waiting if self._prefill_ready(j)]
        jobs: list[TalkerJob] = []
        longest = 0
        for job in ready[:min(self.prefill_batch, self.cache.free_slots)]:
            rows = job.user_rows.shape[0] + PROMPT_TAIL
            if jobs and max(longest, rows) * (len(jobs) + 1) > self.prefill_tokens:
                break
            jobs.append(job)
            longest = max(longest, rows)
        for job in jobs:
            job.slot = self.cache.allocate(job)
            self.seen[job.slot] = False
            job.mark_started()
            self.running.append(job)
            self.waiting.remove(job)
        return jobs

    def _decode(self, owners: list[TalkerJob], ready: list[bool], trailing: list) -> list:
        """One step over every slot 0..n-1 (dense, graph-friendly); rows not ready compute garbage
        at a position they will overwrite later, and their results are dropped."""
        n, h = len(owners), self.cfg.text.hidden_size
        x = torch.zeros(n, h, device=self.device, dtype=self.dtype)
        idx = [i for i, r in enumerate(ready) if r]
        rows = torch.tensor(idx, device=self.device)
        x[rows] = torch.stack([owners[i].pending for i in idx]) + self._project([trailing[i] for i in idx])
        start_list = [j.prompt_len + max(len(j.codes0) - 1, 0) for j in owners]
        start = torch.tensor(start_list).to(self.device, non_blocking=True)
        kv_len = max(start_list) + 1
        for i in idx:
            owners[i].pending = None
        if self.step_graphs is not None and self.step_graphs.fits(n, kv_len):
            logits, hidden = self.step_graphs(n, kv_len, x[:, None], start)
        else:
            logits, hidden = self._step_fn(n, kv_len, x[:, None], start)
        return [(owners[i], logits[i], hidden[i]) for i in idx]

    def _trailing(self, job: TalkerJob) -> torch.Tensor:
        """The thinker-space text row for the step about to run (trailing index = frames made)."""
        state = job.row_state(len(job.codes0))
        if state == "row":
            return job.rows[len(job.codes0)]
        return job.special[1] if state == "eos" else job.special[2]

    def _project(self, rows: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(rows).to(self.device, self.dtype)
        return self.model.text_projection(x)

    def _prompt(self, job: TalkerJob) -> torch.Tensor:
        """The talker's prompt rows [L, Hk]: the user turns (text rows projected, audio rows through
        the hidden projection), the assistant head, four tts_pad, tts_bos and the first text row,
        each with its codec-side embedding (nothink, think_bos, think_eos, speaker, pad, bos)."""
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
        text_side = torch.cat((head, pad.expand(4, -1), bos[None], first[None]))          # [PROMPT_TAIL, Hk]
        codec_ids = torch.tensor([c.nothink, c.think_bos, c.think_eos, job.speaker_id, c.pad, c.bos], device=dev)
        codec_side = torch.cat((torch.zeros(3, text_side.shape[1], device=dev, dtype=dt),
                                m.model.codec_embedding(codec_ids)))
        return torch.cat((user_part, text_side + codec_side))

    def _prefill(self, jobs: list[TalkerJob]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the jobs' prompts (right-padded): codec-0 logits [n, V], hidden [n, Hk]."""
        dev = self.device
        prompts = [self._prompt(j) for j in jobs]
        for j, p in zip(jobs, prompts):
            j.prompt_len = p.shape[0]
            j.generator = j.params.generator(dev)
        n, s = len(jobs), max(j.prompt_len for j in jobs)
        metrics.PREFILL_BATCH.labels(self.name).observe(n)
        x = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)                   # [n, s, Hk]
        last = torch.tensor([j.prompt_len - 1 for j in jobs]).to(dev, non_blocking=True)
        slots = torch.tensor([j.slot for j in jobs]).to(dev, non_blocking=True)
        g = self.prefill_graphs
        if g is not None and g.fits(n, s):   # padding rows go to the scratch KV row
            return g(n, s, x, last, slots)
        return self._prefill_fn(n, s, x, last, slots)

    def _sample(self, results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]]) -> None:
        eos = self.cfg.codec.eos
        jobs = [r[0] for r in results]
        logits = torch.stack([r[1] for r in results]).float()
        hidden = torch.stack([r[2] for r in results])
        slots = torch.tensor([j.slot for j in jobs], device=self.device)
        penalty = torch.tensor([j.params.repetition_penalty for j in jobs], device=self.device)[:, None]
        seen = self.seen[slots]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        finite = finite_rows(logits)    # [n] bool: code-0 logits usable (after the penalty, before masks)
        ban = [len(j.codes0) < j.min_frames for j in jobs]   # EOS not allowed yet
        if all(j.params.greedy for j in jobs):
            # suppress mask + EOS ban + argmax (one Triton kernel on CUDA), then the code predictor for
            # every row straight away: the host reads code 0 and the residual codes in one sync, and
            # drops the frames of rows that stop here
            ban_rows = torch.tensor(ban).to(self.device, non_blocking=True)
            code0 = kernels.sampling.run(logits, self.suppress, ban_rows, eos)
            self.seen[slots, code0] = True
            n = len(jobs)
            if self.predictor_graphs is not None and self.predictor_graphs.fits(n, 1):
                residual, nxt, predicted = self.predictor_graphs(n, 1, hidden, code0)
            else:
                residual, nxt, predicted = self._predict_fn(n, 1, hidden, code0)
            # [n, G + 1]: the frame, then its usable flag (one host read)
            usable = (finite & predicted).long()[:, None]
            host = torch.cat((code0[:, None], residual, usable), dim=1).to(torch.int64).cpu()
            frames_cpu = host[:, :-1].to(torch.uint16)
            framing = [(i, i) for i in self._advance(jobs, frames_cpu[:, 0].tolist(), host[:, -1].tolist())]
            nxt = nxt.clone()   # graph outputs are overwritten by the next replay
        else:
            logits = logits.masked_fill(self.suppress, float("-inf"))
            if any(ban):
                logits[torch.tensor(ban, device=self.device), eos] = float("-inf")
            picks = [pick(row, j.params, j.generator) for j, row in zip(jobs, logits)]
            code0 = torch.stack([token for token, _ in picks])
            self.seen[slots, code0] = True
            codes0, usable = torch.stack((code0, (finite & torch.stack([ok for _, ok in picks])).long())).tolist()
            going = self._advance(jobs, codes0, usable)
            if not going:
                return
            rows = torch.tensor(going, device=self.device)
            code0, hidden = code0[rows], hidden[rows]
            code0_embed = self.model.model.codec_embedding(code0)
            passes: list[torch.Tensor] = []     # per predictor pass: [len(going)] bool usable
            residual, embeds = self.model.code_predictor.predict(hidden, code0_embed,
                                                                 self._picker([jobs[i] for i in going], passes))
            nxt = torch.stack([code0_embed] + embeds, dim=1).sum(1)
            host = torch.cat((code0[:, None], residual, torch.stack(passes, 1).all(1).long()[:, None]),
                             dim=1).to(torch.int64).cpu()
            frames_cpu = host[:, :-1].to(torch.uint16)
            framing = []
            for row, (i, ok) in enumerate(zip(going, host[:, -1].tolist())):
                if ok:
                    framing.append((i, row))
                else:
                    self._fail_nonfinite(jobs[i], "code predictor logits")
        with self.lock:
            for i, row in framing:
                jobs[i].pending = nxt[row]
        for i, row in framing:
            job = jobs[i]
            job.mark_output()
            job.outbox.put(pb.TalkerResponse(frames=pb.CodecFrames(index=job.frames_sent,
                                                                    codes=to_proto(frames_cpu[row:row + 1]))))
            job.frames_sent += 1

    def _fail_nonfinite(self, job: TalkerJob, what: str) -> None:
        """Finish `job` alone with a clear error; its KV slot and the graphs' float inputs are zeroed
        first, so nothing it left on the device reaches a later request (SlotKVCache.scrub)."""
        if job.slot is not None:
            self.cache.scrub(job.slot)
        for graphs in (self.step_graphs, self.predictor_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.scrub()
        self.finish(job, self.nonfinite(job, what))

    def _advance(self, jobs: list[TalkerJob], codes0: list[int], usable: list[int]) -> list[int]:
        """Append each job's code 0; finish those that stop (EOS, frame limit) and those whose codec
        logits were not finite (`usable` 0). Returns the indices of the jobs that go on and get
        this frame."""
        eos = self.cfg.codec.eos
        framing = []
        for i, (job, c0, ok) in enumerate(zip(jobs, codes0, usable)):
            if not ok:
                self._fail_nonfinite(job, "codec logits")
                continue
            job.codes0.append(c0)
            if c0 == eos:
                self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.STOP, completion_tokens=job.frames_sent)))
            elif len(job.codes0) >= job.max_frames or job.frames_sent >= job.frame_cap():
                self.finish(job, pb.TalkerResponse(finished=pb.Finished(reason=pb.LENGTH, completion_tokens=job.frames_sent)))
            else:
                framing.append(i)
        return framing

    def _picker(self, jobs: list[TalkerJob], usable: list[torch.Tensor]):
        """The code predictor's `pick` for these jobs (each samples unless greedy); appends each
        pass's per-row usable flags [B] bool to `usable`. No host sync."""
        if all(j.params.greedy for j in jobs):
            return greedy_codes(usable)

        def pick_codes(logits: torch.Tensor, group: int) -> torch.Tensor:
            picks = [pick(row, PREDICTOR_SAMPLING if not j.params.greedy else SamplingParams(), j.generator)
                     for j, row in zip(jobs, logits.float())]
            usable.append(finite_rows(logits) & torch.stack([ok for _, ok in picks]))
            return torch.stack([token for token, _ in picks])

        return pick_codes
