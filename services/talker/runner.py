"""Talker model runner: the talker on its device, its KV slots, CUDA graphs and sampling.

A step: one right-padded prefill of the requests admitted now (an early one without its prompt's
last row: see scheduler.py), one codec-0 forward over every slot
0..n-1 (dense, graph-friendly), then code 0 and the code predictor's residual codes for every row
that made logits (`frames`), and one host read of the whole step: the frames of rows that stop are
dropped. Greedy batches pick code 0 with one Triton kernel and replay the greedy predictor graphs.
A batch with a sampled row draws each sampled row's noise for the whole frame from its own
generator (one launch a row), picks code 0 for all rows at once and replays the sampled predictor
graphs, which sample inside the graph (runtime/sampling.py: `sample_rows`); greedy rows in it get
exactly their greedy codes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voxpipe import kernels

from ..runtime.config import TalkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.kv_cache import SlotKVCache
from ..runtime.sampling import RowSampling, SamplingParams, exponential_noise, finite_rows, sample_rows
from .job import TalkerJob
from .model import TalkerModel, ThinkerTextEmbedding

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
class Frames:
    """Whole frames of a step's rows."""

    codes: torch.Tensor        # [rows, G] uint16 on the host: code 0, then the G - 1 residual codes
    code0_usable: list[int]    # per row: 1 if its codec-0 logits (penalised, scaled) were finite
    usable: list[int]          # per row: 1 if every code predictor logit of its frame was finite too
    next_inputs: torch.Tensor  # [rows, Hk] on the device: each row's next input (its G code embeddings summed)


class TalkerRunner:
    def __init__(self, model: TalkerModel, cfg: TalkerConfig, *, device: torch.device, max_active: int,
                 max_len: int, cuda_graphs: bool = True, prefill_batch: int = 8, prefill_graph_len: int = 512,
                 eager_fallback: bool = False, text_table: ThinkerTextEmbedding | None = None) -> None:
        """Prompts up to `prefill_graph_len` rows, `prefill_batch` at a time, replay CUDA graphs.
        `text_table`: the thinker's embedding table, for prompts whose user turns come as token ids."""
        self.model, self.cfg, self.device = model, cfg, device
        self.text_table = text_table
        self.dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = SlotKVCache(t.num_layers, max_active, max_len, t.num_kv_heads, t.head_dim, self.dtype, device)
        suppress = torch.zeros(t.vocab_size, dtype=torch.bool, device=device)
        suppress[list(cfg.suppressed_tokens)] = True
        suppress[cfg.codec.eos] = False
        self.suppress = suppress
        self.seen = torch.zeros(max_active, t.vocab_size, dtype=torch.bool, device=device)  # codec-0 ids per slot
        self.predictor_vocab = cfg.code_predictor.vocab_size
        self.step_graphs = self.predictor_graphs = self.sampled_predictor_graphs = self.prefill_graphs = None
        if cuda_graphs and graphs_available(device):
            self._capture(max_active, max_len, min(prefill_batch, max_active), min(prefill_graph_len, max_len),
                          eager_fallback)

    @torch.inference_mode()
    def _capture(self, max_active: int, max_len: int, n: int, prefill_len: int, eager_fallback: bool) -> None:
        """Each step's graphs, or GraphCaptureError (with `eager_fallback`: that step runs eagerly)."""
        h, dev = self.cfg.text.hidden_size, self.device
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
        g, vp = self.cfg.num_code_groups - 1, self.predictor_vocab
        self.sampled_predictor_graphs = captured("sampled code predictor", lambda: GraphedStep(
            self._predict_sampled_fn, (torch.zeros(max_active, h, dtype=self.dtype, device=dev),
                                       torch.zeros(max_active, dtype=torch.long, device=dev),
                                       *RowSampling.empty(max_active, dev).tensors(),
                                       torch.ones(max_active, g, vp, device=dev)),
            buckets(max_active), [1], "sampled code predictor (15 steps)"), eager_fallback)

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

    def _predict_sampled_fn(self, n: int, _kv: int, hidden: torch.Tensor, code0: torch.Tensor,
                            greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                            drop_below: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`_predict_fn` with each row's codes sampled (RowSampling's tensors) with its noise
        [n, G-1, Vp]: pass g reads noise[:, g - 1]."""
        rows = RowSampling(greedy, temperature, top_k, drop_below)
        code0_embed = self.model.model.codec_embedding(code0)
        usable: list[torch.Tensor] = []

        def pick_codes(logits: torch.Tensor, group: int) -> torch.Tensor:
            ids, ok = sample_rows(logits.float(), rows, noise[:, group - 1])
            usable.append(finite_rows(logits) & ok)
            return ids

        residual, embeds = self.model.code_predictor.predict(hidden, code0_embed, pick_codes)
        return residual, torch.stack([code0_embed] + embeds, dim=1).sum(1), torch.stack(usable, 1).all(1)

    # ---- slots (dense: the requests hold slots 0..used-1)
    @property
    def free_slots(self) -> int:
        return self.cache.free_slots

    def allocate(self, job: TalkerJob) -> None:
        job.slot = self.cache.allocate(job)
        self.seen[job.slot] = False

    def release(self, job: TalkerJob) -> None:
        """Free the job's slot; the request in the last slot moves into it."""
        if job.slot is not None:
            last = self.cache.used - 1
            moved = self.cache.release(job.slot)
            if moved is not None:
                self.seen[job.slot] = self.seen[last]
                moved.slot = job.slot
            job.slot = None

    def scrub(self, job: TalkerJob) -> None:
        """Zero the job's KV slot and the graphs' float inputs, so that nothing its non-finite numbers
        left on the device reaches a later request (SlotKVCache.scrub)."""
        if job.slot is not None:
            self.cache.scrub(job.slot)
        for graphs in (self.step_graphs, self.predictor_graphs, self.sampled_predictor_graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.scrub()

    # ---- forwards
    def forward(self, prefill: list[TalkerJob], decode: list[TalkerJob],
                text_rows: list[torch.Tensor]) -> tuple[list[TalkerJob], torch.Tensor, torch.Tensor]:
        """The step's forwards: the prefill of the `prefill` jobs, then the codec step of the `decode`
        jobs (each with its text row). The jobs that made logits (prefilled first, then decoded in
        slot order), their codec-0 logits [n, V] float32 and final hidden rows [n, Hk]."""
        results: list[tuple[TalkerJob, torch.Tensor, torch.Tensor]] = []
        if prefill:
            logits, hidden = self._prefill(prefill)
            results.extend((j, logits[b], hidden[b]) for b, j in enumerate(prefill) if not j.early)
        if decode:
            results.extend(self._decode(decode, text_rows))
        if not results:       # early prefills only: no frame this step
            return [], torch.empty(0), torch.empty(0)
        return ([r[0] for r in results], torch.stack([r[1] for r in results]).float(),
                torch.stack([r[2] for r in results]))

    def _prefill(self, jobs: list[TalkerJob]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over the jobs' prompts (right-padded): codec-0 logits [n, V], hidden [n, Hk].
        An `early` job's prompt goes without its last row (its logits here mean nothing); its next
        input is that row's codec part, which its frame-0 decode step adds to text row 0's projection."""
        dev = self.device
        prompts = [self._prompt(j, last_row=not j.early) for j in jobs]
        for j, p in zip(jobs, prompts):
            j.prompt_len = p.shape[0] + (1 if j.early else 0)
            j.generator = j.params.generator(dev)
        bos = self.model.model.codec_embedding.weight[self.cfg.codec.bos]           # a view: no lookup
        for j in jobs:
            if j.early:
                j.pending = bos
        lengths = [p.shape[0] for p in prompts]
        n, s = len(jobs), max(lengths)
        x = torch.nn.utils.rnn.pad_sequence(prompts, batch_first=True)                   # [n, s, Hk]
        last = torch.tensor([k - 1 for k in lengths]).to(dev, non_blocking=True)
        slots = torch.tensor([j.slot for j in jobs]).to(dev, non_blocking=True)
        g = self.prefill_graphs
        if g is not None and g.fits(n, s):   # padding rows go to the scratch KV row
            return g(n, s, x, last, slots)
        return self._prefill_fn(n, s, x, last, slots)

    def _decode(self, jobs: list[TalkerJob],
                text_rows: list[torch.Tensor]) -> list[tuple[TalkerJob, torch.Tensor, torch.Tensor]]:
        """One step over every slot 0..n-1 for `jobs` (each with its text row): rows of the other
        slots compute garbage at a position they will overwrite later, and their results are
        dropped. (job, codec-0 logits [V], hidden [Hk]) per job, in slot order."""
        owners = self.cache.owners[:self.cache.used]
        n, h = len(owners), self.cfg.text.hidden_size
        x = torch.zeros(n, h, device=self.device, dtype=self.dtype)
        order = sorted(range(len(jobs)), key=lambda k: jobs[k].slot)
        idx = [jobs[k].slot for k in order]
        rows = torch.tensor(idx, device=self.device)
        x[rows] = torch.stack([owners[i].pending for i in idx]) + self._project([text_rows[k] for k in order])
        start_list = [j.next_position() for j in owners]
        start = torch.tensor(start_list).to(self.device, non_blocking=True)
        kv_len = max(start_list) + 1
        for i in idx:
            owners[i].pending = None
        if self.step_graphs is not None and self.step_graphs.fits(n, kv_len):
            logits, hidden = self.step_graphs(n, kv_len, x[:, None], start)
        else:
            logits, hidden = self._step_fn(n, kv_len, x[:, None], start)
        return [(owners[i], logits[i], hidden[i]) for i in idx]

    def _project(self, rows: list[torch.Tensor]) -> torch.Tensor:
        x = torch.stack(rows).to(self.device, self.dtype)
        return self.model.text_projection(x)

    def _prompt(self, job: TalkerJob, last_row: bool = True) -> torch.Tensor:
        """The talker's prompt rows [L, Hk]: the user turns (text rows projected, audio rows through
        the hidden projection), the assistant head, four tts_pad, tts_bos and the first text row,
        each with its codec-side embedding (nothink, think_bos, think_eos, speaker, pad, bos).
        Without `last_row`: all but the last ([L - 1, Hk]; the first text row need not be there)."""
        m, c = self.model, self.cfg.codec
        dev, dt = self.device, self.dtype
        if job.user_rows is not None:
            user = job.user_rows.to(dev, dt)
        else:           # a text prompt's user turns as token ids (the server checked: no multimodal rows)
            user = self.text_table(job.user_ids.to(dev)).to(dt)
        mm = job.user_mm_mask.to(dev)
        user_part = torch.empty(user.shape[0], self.cfg.text.hidden_size, device=dev, dtype=dt)
        if bool(mm.any()):
            user_part[mm] = m.hidden_projection(user[mm])
        if bool((~mm).any()):
            user_part[~mm] = m.text_projection(user[~mm])
        head = m.text_projection(job.head.to(dev, dt))                                    # [3, Hk]
        bos, _eos, pad = m.text_projection(job.special.to(dev, dt)).unbind(0)
        text_side = [head, pad.expand(4, -1), bos[None]]
        codec_ids = [c.nothink, c.think_bos, c.think_eos, job.speaker_id, c.pad]
        if last_row:
            text_side.append(m.text_projection(job.rows[0].to(dev, dt)[None]))
            codec_ids.append(c.bos)
        text_side = torch.cat(text_side)                                           # [PROMPT_TAIL (- 1), Hk]
        codec_side = torch.cat((torch.zeros(3, text_side.shape[1], device=dev, dtype=dt),
                                m.model.codec_embedding(torch.tensor(codec_ids, device=dev))))
        return torch.cat((user_part, text_side + codec_side))

    # ---- sampling
    def _penalized(self, jobs: list[TalkerJob],
                   logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codec-0 logits with each row's repetition penalty on the ids its slot has seen; the rows'
        slots [n]; whether each row is finite [n] bool (after the penalty, before any mask)."""
        slots = torch.tensor([j.slot for j in jobs], device=self.device)
        penalty = torch.tensor([j.params.repetition_penalty for j in jobs], device=self.device)[:, None]
        seen = self.seen[slots]
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
        return logits, slots, finite_rows(logits)

    def frames(self, jobs: list[TalkerJob], logits: torch.Tensor, hidden: torch.Tensor, ban: list[bool]) -> Frames:
        """Every row's whole frame: the repetition penalty, the suppress mask and the EOS ban (`ban`:
        per row), code 0, then the code predictor for every row straight away; the host reads code 0,
        the residual codes and the usable flags in one sync."""
        eos, dev, n = self.cfg.codec.eos, self.device, len(jobs)
        logits, slots, finite = self._penalized(jobs, logits)
        ban_rows = torch.tensor(ban).to(dev, non_blocking=True)
        if all(j.params.greedy for j in jobs):
            code0 = kernels.sampling.run(logits, self.suppress, ban_rows, eos)   # one Triton kernel on CUDA
            code0_ok = finite
            graphs, fn, extra = self.predictor_graphs, self._predict_fn, ()
        else:
            v, g, vp = logits.shape[1], self.cfg.num_code_groups - 1, self.predictor_vocab
            noise = exponential_noise([j.generator for j in jobs], v + g * vp, dev)   # code 0, then each pass
            masked = logits.masked_fill(self.suppress, float("-inf"))
            masked = masked.masked_fill(ban_rows[:, None] & (torch.arange(v, device=dev) == eos), float("-inf"))
            code0, ok = sample_rows(masked, RowSampling.of([j.params for j in jobs], v, dev), noise[:, :v])
            code0_ok = finite & ok
            predictor = RowSampling.of([SamplingParams() if j.params.greedy else PREDICTOR_SAMPLING for j in jobs],
                                       vp, dev)
            graphs, fn = self.sampled_predictor_graphs, self._predict_sampled_fn
            extra = (*predictor.tensors(), noise[:, v:].view(n, g, vp))
        self.seen[slots, code0] = True
        if graphs is not None and graphs.fits(n, 1):
            residual, nxt, predicted = graphs(n, 1, hidden, code0, *extra)
        else:
            residual, nxt, predicted = fn(n, 1, hidden, code0, *extra)
        # [n, G + 2]: the frame, then its two usable flags (one host read)
        host = torch.cat((code0[:, None], residual, code0_ok.long()[:, None], (code0_ok & predicted).long()[:, None]),
                         dim=1).to(torch.int64).cpu()
        # graph outputs are overwritten by the next replay
        return Frames(host[:, :-2].to(torch.uint16), host[:, -2].tolist(), host[:, -1].tolist(), nxt.clone())
