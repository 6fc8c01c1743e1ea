"""Thinker engine: each step prefills a batch of waiting requests (right-padded prompts, one
forward, a CUDA graph per (batch, length) bucket), then runs one batched decode step over every
running request. A prompt longer than `prefill_chunk` is prefilled in chunks, one per step, so
that the running requests keep decoding meanwhile. Emits text deltas, and for audio output the
talker's rows. A request whose reply is given (ThinkerStart.assistant_text) is prefilled only: its
reply goes out whole, as if generated, right after its prefill."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime import metrics
from ..runtime.config import ThinkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.kv_cache import SlotKVCache, SlotStep
from ..runtime.outputs import Finished, FinishReason
from ..runtime.sampling import (RowSampling, SamplingParams, apply_repetition_penalty, exponential_noise,
                                finite_rows, sample_rows)
from ..runtime.tensors import to_proto
from .model import ThinkerModel
from .output import IncrementalDetokenizer, ReplyText, TokenBytes

__all__ = ["ThinkerEngine", "ThinkerJob", "IncrementalDetokenizer", "talker_prompt", "assistant_head_index"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ForcedReply:
    """A reply given in advance (ThinkerStart.assistant_text): the thinker emits it instead of sampling."""
    token_ids: list[int]     # the text's tokens, then the end-of-turn token
    text: str                # verbatim, as the client sent it


FORCED_DELTA_TOKENS = 64     # a forced reply's tokens per TextDelta (its rows: a bounded message each)


@dataclass
class ThinkerJob(EngineRequest):
    prompt: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)   # [mel, frames] each
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 0
    min_tokens: int = 0
    talker_rows: bool = False
    speech: pb.SpeechParams | None = None   # a spoken reply continues in a talker (see relay.py)
    stops: tuple[str, ...] = ()             # stop strings (see output.py)
    top_logprobs: int | None = None         # None: no log probabilities; else how many alternatives
    forced: ForcedReply | None = None       # the reply is given: emitted whole after the prefill
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    text: ReplyText | None = None           # the text deltas (made at the first token)
    prefilled: int = 0                          # prompt tokens in the KV cache (chunked prefill)
    embeds: torch.Tensor | None = None          # [P, H] while a chunked prefill runs
    kept: list[torch.Tensor] = field(default_factory=list)   # per chunk: the talker's hidden layer


def talker_prompt(cfg: ThinkerConfig, ids: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor | None,
                  special: torch.Tensor) -> pb.TalkerPrompt:
    """What the talker needs from a prompt (transformers' `_get_talker_user_parts` / assistant parts):
    rows of user turns (role = the token after the latest <|im_start|>), the assistant head, any
    prompt tokens after the head, and the tts special embeddings. ids [P], embeds [P, H], hidden [P, H]."""
    tok = cfg.tokens
    p = ids.shape[0]
    pos = torch.arange(p)
    starts = torch.where(ids == tok.im_start, pos, torch.full_like(pos, -1))
    prev_start = torch.cummax(starts, 0).values.clamp_min(0)
    role = ids[(prev_start + 1).clamp_max(p - 1)]
    user = role == tok.user
    mm = (ids == tok.audio_token) | (ids == tok.image_token) | (ids == tok.video_token)
    rows = embeds[user]
    user_mm = mm[user]
    if bool(user_mm.any()):
        rows = rows.clone()
        rows[user_mm] = hidden[user][user_mm]
    head = torch.nonzero((ids[:-1] == tok.im_start) & (ids[1:] == tok.assistant)).flatten()
    start = int(head[-1])
    return pb.TalkerPrompt(
        user_rows=to_proto(rows), user_mm_mask=to_proto(user_mm), user_token_ids=to_proto(ids[user]),
        assistant_head=to_proto(embeds[start:start + 3]), assistant_prefix=to_proto(embeds[start + 3:]),
        tts_special=to_proto(special))


def assistant_head_index(cfg: ThinkerConfig, ids: list[int]) -> int | None:
    """Index of the last '<|im_start|>assistant' that still has its newline inside the prompt."""
    tok = cfg.tokens
    for i in range(len(ids) - 3, -1, -1):
        if ids[i] == tok.im_start and ids[i + 1] == tok.assistant:
            return i
    return None


class ThinkerEngine(StageEngine):
    name = "thinker"

    def __init__(self, model: ThinkerModel, cfg: ThinkerConfig, tokenizer, *, device: torch.device,
                 max_active: int, max_len: int, eos_ids: tuple[int, ...], cuda_graphs: bool = True,
                 prefill_batch: int = 8, prefill_tokens: int = 4096, prefill_graph_len: int = 512,
                 prefill_chunk: int = 512, eager_fallback: bool = False) -> None:
        """A step prefills up to `prefill_batch` prompts with at most `prefill_tokens` padded tokens
        together; prompts up to `prefill_graph_len` tokens replay CUDA graphs; longer than
        `prefill_chunk` tokens are prefilled `prefill_chunk` tokens per step."""
        super().__init__(max_active)
        self.prefill_batch, self.prefill_tokens, self.prefill_chunk = prefill_batch, prefill_tokens, prefill_chunk
        self.chunking: ThinkerJob | None = None     # the request whose prompt is being prefilled in chunks
        self.model, self.cfg, self.tokenizer, self.device = model, cfg, tokenizer, device
        self.token_bytes = TokenBytes(tokenizer)
        dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = SlotKVCache(t.num_layers, max_active, max_len, t.num_kv_heads, t.head_dim, dtype, device)
        self.max_len = max_len
        self.eos_ids = eos_ids
        special = torch.tensor([cfg.tokens.tts_bos, cfg.tokens.tts_eos, cfg.tokens.tts_pad], device=device)
        self.eos = torch.tensor(eos_ids, device=device)
        with torch.inference_mode():
            self.tts_special = model.model.embed_tokens(special).cpu()
            self.graphs = self.prefill_graphs = None
            if cuda_graphs and graphs_available(device):
                self._capture(max_active, max_len, min(prefill_graph_len, max_len), eager_fallback)

    def _capture(self, max_active: int, max_len: int, prefill_len: int, eager_fallback: bool) -> None:
        """Each step's graphs, or GraphCaptureError (with `eager_fallback`: that step runs eagerly)."""
        dev, h = self.device, self.cfg.text.hidden_size
        dtype = self.tts_special.dtype
        self.graphs = captured("thinker decode", lambda: GraphedStep(
            self._decode_fn, (torch.zeros(max_active, 1, dtype=torch.long, device=dev),
                              torch.zeros(max_active, dtype=torch.long, device=dev)),
            buckets(max_active), buckets(max_len, min(256, max_len)), "thinker decode"), eager_fallback)
        n = min(self.prefill_batch, max_active)
        self.prefill_graphs = captured("thinker prefill", lambda: GraphedStep(
            lambda *args: self._prefill_fn(*args)[:1],
            (torch.zeros(n, prefill_len, h, dtype=dtype, device=dev), torch.zeros(n, dtype=torch.long, device=dev),
             torch.arange(n, dtype=torch.long, device=dev)),
            buckets(n), buckets(prefill_len, min(32, prefill_len)), "thinker prefill",
            pad=(None, 0, self.cache.scratch)), eager_fallback)   # padding rows write the scratch KV row

    def _prefill_fn(self, n: int, s: int, embeds: torch.Tensor, last: torch.Tensor, slots: torch.Tensor,
                    keep: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts [n, >= s, H] (right-padded to s), from position 0, into KV slots [n];
        logits [n, V] at each prompt's `last` position, and the `keep` hidden layer if asked."""
        positions = torch.arange(s, device=embeds.device)[None].expand(n, s)
        return self.model(embeds[:, :s], positions, self.cache.prefill_view(slots, s), keep_hidden=keep, last=last)

    def _decode_fn(self, n: int, kv_len: int, ids: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor]:
        """One token for each sequence in slots 0..n-1: ids [n, 1], start [n] (their positions)."""
        view = self.cache.decode_view(n, kv_len, start)
        logits, _ = self.model(self.model.model.embed_tokens(ids), start[:, None], view)
        return (logits,)

    def has_work(self) -> bool:
        return (any(not r.outbox.saturated for r in self.running)
                or (bool(self.waiting) and self.cache.free_slots > 0))

    def release(self, req: ThinkerJob) -> None:
        if self.chunking is req:
            self.chunking = None
        req.embeds, req.kept = None, []
        if req.slot is not None:
            moved = self.cache.release(req.slot)
            if moved is not None:
                moved.slot = req.slot
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            jobs = self._admit()
            chunking = self.chunking
        if chunking is not None:
            self._prefill_chunk(chunking)
        if jobs:
            self._prefill(jobs)
        if self.cache.used:
            self._decode([self.cache.owners[i] for i in range(self.cache.used)])

    def _admit(self) -> list[ThinkerJob]:
        """Waiting requests to prefill now, in arrival order: as many short prompts as fit the batch,
        the padded token budget and the free slots, and
        the first long prompt when no chunked prefill is running. Long prompts that must wait for the
        running chunked prefill do not hold up the short ones behind them. Each request leaves
        `waiting` only once it holds a slot and sits in `running`."""
        free = self.cache.free_slots
        jobs: list[ThinkerJob] = []
        longest = 0
        for job in self.waiting:
            if len(jobs) >= min(self.prefill_batch, free):
                break
            if len(job.prompt) > self.prefill_chunk:   # a long prompt: chunked, one at a time
                if self.chunking is None and free > len(jobs):
                    job.slot = self.cache.allocate(job)
                    job.mark_started()
                    self.running.append(job)
                    self.chunking = job
                    free -= 1
                continue
            longest_next = max(longest, len(job.prompt))
            if jobs and longest_next * (len(jobs) + 1) > self.prefill_tokens:
                break
            jobs.append(job)
            longest = longest_next
        for job in jobs:
            job.slot = self.cache.allocate(job)
            job.mark_started()
            self.running.append(job)
        taken = {id(j) for j in jobs} | {id(self.chunking)}
        self.waiting = [w for w in self.waiting if id(w) not in taken]
        return jobs

    def _prefill(self, jobs: list[ThinkerJob]) -> None:
        dev = self.device
        ids = [torch.tensor(j.prompt, device=dev) for j in jobs]
        embeds = [self.model.embed(i, [a.to(dev, torch.float32) for a in j.audio]) for i, j in zip(ids, jobs)]
        audio = [bool(j.audio) for j in jobs]   # the server checked: features <=> audio placeholders
        keep = self.cfg.accept_hidden_layer if any(j.talker_rows and a for j, a in zip(jobs, audio)) else None
        n, s = len(jobs), max(len(j.prompt) for j in jobs)
        metrics.PREFILL_BATCH.labels(self.name).observe(n)
        x = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)                   # [n, s, H]
        last = torch.tensor([len(j.prompt) - 1 for j in jobs]).to(dev, non_blocking=True)
        slots = torch.tensor([j.slot for j in jobs]).to(dev, non_blocking=True)
        g = self.prefill_graphs
        if keep is None and g is not None and g.fits(n, s):   # padding rows go to the scratch KV row
            (logits,), hidden = g(n, s, x, last, slots), None
        else:
            logits, hidden = self._prefill_fn(n, s, x, last, slots, keep)
        for b, j in enumerate(jobs):
            j.generator = j.params.generator(dev)
            j.text = ReplyText(self.tokenizer, j.stops, j.min_tokens)
            if j.talker_rows:
                p = len(j.prompt)
                kept = hidden[b, :p].cpu() if hidden is not None and audio[b] else None
                prompt = talker_prompt(self.cfg, torch.tensor(j.prompt), embeds[b].cpu(), kept, self.tts_special)
                j.outbox.put(pb.ThinkerResponse(talker_prompt=prompt))
        self._after_prefill(jobs, logits)

    def _prefill_chunk(self, job: ThinkerJob) -> None:
        """The next `prefill_chunk` tokens of a long prompt (eager), attending to the cached part;
        after the last chunk the request emits its first token like any prefill."""
        dev = self.device
        if job.embeds is None:   # first chunk: the whole prompt's embeddings, kept until the last chunk
            ids = torch.tensor(job.prompt, device=dev)
            job.embeds = self.model.embed(ids, [a.to(dev, torch.float32) for a in job.audio])
        keep = self.cfg.accept_hidden_layer if job.talker_rows and job.audio else None
        p0 = job.prefilled
        c = min(self.prefill_chunk, len(job.prompt) - p0)
        step = SlotStep.build([job.slot], [p0], c, dev)
        positions = torch.arange(p0, p0 + c, device=dev)[None]
        logits, hidden = self.model(job.embeds[None, p0:p0 + c], positions, self.cache.bind(step), keep_hidden=keep)
        if hidden is not None:
            job.kept.append(hidden[0])
        job.prefilled += c
        if job.prefilled < len(job.prompt):
            return
        with self.lock:
            self.chunking = None
        job.generator = job.params.generator(dev)
        job.text = ReplyText(self.tokenizer, job.stops, job.min_tokens)
        if job.talker_rows:
            kept = torch.cat(job.kept).cpu() if job.kept else None
            prompt = talker_prompt(self.cfg, torch.tensor(job.prompt), job.embeds.cpu(), kept, self.tts_special)
            job.outbox.put(pb.ThinkerResponse(talker_prompt=prompt))
        job.embeds, job.kept = None, []
        self._after_prefill([job], logits)

    def _after_prefill(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> None:
        """Prefilled jobs' first outputs: a forced reply whole (its request ends here), the others'
        first sampled token from logits [n, V]."""
        sampled = [i for i, j in enumerate(jobs) if j.forced is None]
        for j in jobs:
            if j.forced is not None:
                self._emit_forced(j)
        if len(sampled) < len(jobs):
            if not sampled:
                return
            jobs, logits = [jobs[i] for i in sampled], logits[torch.tensor(sampled, device=logits.device)]
        self._emit(jobs, logits)

    def _emit_forced(self, job: ThinkerJob) -> None:
        """The given reply as if generated: its tokens (end of turn included) in deltas of
        FORCED_DELTA_TOKENS with their talker rows (lookups in the embedding table, as for sampled
        tokens), the whole text in the first delta; then STOP."""
        ids = job.forced.token_ids
        rows = (self.model.model.embed_tokens(torch.tensor(ids, device=self.device)).cpu()
                if job.talker_rows else None)
        job.mark_output()
        for start in range(0, len(ids), FORCED_DELTA_TOKENS):
            piece = ids[start:start + FORCED_DELTA_TOKENS]
            delta = pb.TextDelta(index=start, token_ids=piece, text=job.forced.text if start == 0 else "")
            if rows is not None:
                delta.embeddings.CopyFrom(to_proto(rows[start:start + len(piece)]))
            job.outbox.put(pb.ThinkerResponse(text=delta))
        job.generated.extend(ids)
        self.finish(job, Finished(FinishReason.STOP, prompt_tokens=len(job.prompt), completion_tokens=len(ids)))

    def _decode(self, jobs: list[ThinkerJob]) -> None:
        """Jobs are the owners of slots 0..n-1, in slot order. A saturated job (its client reads too
        slowly) and a job whose prompt is still being prefilled in chunks are computed with the rest
        (writing a KV entry that is rewritten before anything attends to it) but emit nothing."""
        ready = [bool(j.generated) and not j.outbox.saturated for j in jobs]
        if not any(ready):
            return
        n = len(jobs)
        ids = torch.tensor([[j.generated[-1] if j.generated else 0] for j in jobs]).to(self.device, non_blocking=True)
        # a row still in chunked prefill writes where its next chunk starts (that chunk rewrites it)
        start_list = [len(j.prompt) + len(j.generated) - 1 if j.generated else j.prefilled for j in jobs]
        start = torch.tensor(start_list).to(self.device, non_blocking=True)
        kv_len = max(start_list) + 1
        if self.graphs is not None and self.graphs.fits(n, kv_len):
            (logits,) = self.graphs(n, kv_len, ids, start)
        else:
            (logits,) = self._decode_fn(n, kv_len, ids, start)
        if not all(ready):
            keep = [i for i, r in enumerate(ready) if r]
            jobs, logits = [jobs[i] for i in keep], logits[torch.tensor(keep, device=logits.device)]
        self._emit(jobs, logits)

    def _choose(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> list[int]:
        """Each row's token from logits [n, V] float32, or -1 for a row whose logits are not finite
        (or overflow once penalised / scaled): the flags ride in the one host read of the ids."""
        finite = finite_rows(logits)       # [n] bool, before the EOS ban writes -inf
        ban = [i for i, j in enumerate(jobs) if len(j.generated) < j.min_tokens]
        if ban:
            rows = torch.tensor(ban, device=logits.device)
            logits[rows[:, None], self.eos[None, :]] = float("-inf")
        if all(j.params.greedy and j.params.repetition_penalty == 1.0 for j in jobs):
            return torch.where(finite, logits.argmax(-1), -1).tolist()
        # every row at once (`sample_rows`); a sampled row draws its noise from its own generator
        for i, j in enumerate(jobs):
            if j.params.repetition_penalty != 1.0:
                seen = torch.tensor(j.prompt + j.generated, device=logits.device)
                logits[i] = apply_repetition_penalty(logits[i], seen, j.params.repetition_penalty)
        v = logits.shape[1]
        tokens, ok = sample_rows(logits, RowSampling.of([j.params for j in jobs], v, logits.device),
                                 exponential_noise([j.generator for j in jobs], v, logits.device))
        return torch.where(finite & ok, tokens, -1).tolist()

    def _fail_nonfinite(self, job: ThinkerJob, what: str) -> None:
        """Finish `job` alone with a clear error; its KV slot and the graphs' float inputs are zeroed
        first, so nothing it left on the device reaches a later request (SlotKVCache.scrub)."""
        if job.slot is not None:
            self.cache.scrub(job.slot)
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.scrub()
        self.finish(job, self.nonfinite(job, what))

    def _emit(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> None:
        logits = logits.float()
        asked = [i for i, j in enumerate(jobs) if j.top_logprobs is not None]
        # before _choose, which may mask EOS in place; only the rows that asked (none: no cost)
        logprobs = logits[torch.tensor(asked, device=logits.device)].log_softmax(-1) if asked else None
        tokens = self._choose(jobs, logits)
        entries = self._logprobs(jobs, tokens, asked, logprobs) if asked else {}
        for j, tok in zip(jobs, tokens):
            if tok < 0:
                self._fail_nonfinite(j, "logits")
        kept = [i for i, t in enumerate(tokens) if t >= 0]
        embeds = None
        if any(jobs[i].talker_rows for i in kept):
            embeds = self.model.model.embed_tokens(torch.tensor([tokens[i] for i in kept], device=self.device)).cpu()
        for row, i in enumerate(kept):
            j, tok = jobs[i], tokens[i]
            j.generated.append(tok)
            if tok in self.eos_ids and len(j.generated) >= j.min_tokens:
                reason = pb.STOP
            elif len(j.generated) >= j.max_tokens:
                reason = pb.LENGTH
            else:
                reason = None
            deltas, stopped = j.text.push(tok, embeds[row] if j.talker_rows else None, entries.get(i),
                                          last=reason is not None)
            if deltas:
                j.mark_output()
            for delta in deltas:
                j.outbox.put(pb.ThinkerResponse(text=delta))
            if stopped:
                reason = pb.STOP
            if reason is not None:
                self.finish(j, Finished(FinishReason(reason), prompt_tokens=len(j.prompt),
                                        completion_tokens=len(j.generated)))

    def _logprobs(self, jobs: list[ThinkerJob], tokens: list[int], asked: list[int],
                  logprobs: torch.Tensor) -> dict[int, pb.TokenLogprob]:
        """Each asking row's chosen token's log probability and its top alternatives (log-softmax of
        the raw logits, `logprobs` [len(asked), V]), by row index; rows whose token failed get none.
        One host read for all of them."""
        k = max(jobs[i].top_logprobs for i in asked)
        chosen = torch.tensor([max(tokens[i], 0) for i in asked], device=logprobs.device)
        values = logprobs.gather(1, chosen[:, None])
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            values = torch.cat((values, top.values), dim=1)
            top_ids = top.indices.cpu().tolist()
        values = values.cpu().tolist()
        out = {}
        for r, i in enumerate(asked):
            if tokens[i] < 0:
                continue
            entry = pb.TokenLogprob(token_id=tokens[i], logprob=values[r][0], token=self.token_bytes(tokens[i]))
            for t, v in zip(top_ids[r][:jobs[i].top_logprobs] if k else [], values[r][1:]):
                entry.top.add(token_id=t, logprob=v, token=self.token_bytes(t))
            out[i] = entry
        return out
