"""Thinker engine: prefill new requests (one per step), then one batched decode step over
every running request. Emits text deltas, and for audio output the talker's rows."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.config import ThinkerConfig
from ..runtime.cuda_graphs import GraphedStep, buckets
from ..runtime.engine import EngineRequest, StageEngine
from ..runtime.kv_cache import SlotKVCache, SlotStep
from ..runtime.sampling import SamplingParams, apply_repetition_penalty, choose
from ..runtime.tensors import to_proto
from .model import ThinkerModel

log = logging.getLogger(__name__)


@dataclass
class ThinkerJob(EngineRequest):
    prompt: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)   # [mel, frames] each
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 0
    min_tokens: int = 0
    talker_rows: bool = False
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    text_sent: str = ""


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
                 max_active: int, max_len: int, eos_ids: tuple[int, ...], cuda_graphs: bool = True) -> None:
        super().__init__(max_active)
        self.model, self.cfg, self.tokenizer, self.device = model, cfg, tokenizer, device
        dtype = next(model.parameters()).dtype
        t = cfg.text
        self.cache = SlotKVCache(t.num_layers, max_active, max_len, t.num_kv_heads, t.head_dim, dtype, device)
        self.max_len = max_len
        self.eos_ids = eos_ids
        special = torch.tensor([cfg.tokens.tts_bos, cfg.tokens.tts_eos, cfg.tokens.tts_pad], device=device)
        self.eos = torch.tensor(eos_ids, device=device)
        with torch.inference_mode():
            self.tts_special = model.model.embed_tokens(special).cpu()
            self.graphs = None
            if cuda_graphs and device.type == "cuda":
                example = (torch.zeros(max_active, 1, dtype=torch.long, device=device),
                           torch.zeros(max_active, dtype=torch.long, device=device))
                try:
                    self.graphs = GraphedStep(self._decode_fn, example, buckets(max_active),
                                              buckets(max_len, min(256, max_len)), "thinker decode")
                except Exception:  # capture problems must not take the service down: run eagerly
                    log.exception("thinker: CUDA graph capture failed; decoding eagerly")

    def _decode_fn(self, n: int, kv_len: int, ids: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor]:
        """One token for each sequence in slots 0..n-1: ids [n, 1], start [n] (their positions)."""
        view = self.cache.decode_view(n, kv_len, start)
        logits, _ = self.model(self.model.model.embed_tokens(ids), start[:, None], view)
        return (logits,)

    def has_work(self) -> bool:
        return (any(not r.outbox.saturated for r in self.running)
                or (bool(self.waiting) and self.cache.free_slots > 0))

    def release(self, req: ThinkerJob) -> None:
        if req.slot is not None:
            moved = self.cache.release(req.slot)
            if moved is not None:
                moved.slot = req.slot
            req.slot = None

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            job = self.waiting[0] if self.waiting and self.cache.free_slots > 0 else None
            if job is not None:  # leaves `waiting` only once it holds a slot and sits in `running`
                job.slot = self.cache.allocate(job)
                job.mark_started()
                self.running.append(job)
                self.waiting.pop(0)
        if job is not None:
            self._prefill(job)
        if self.cache.used:
            self._decode([self.cache.owners[i] for i in range(self.cache.used)])

    def _prefill(self, job: ThinkerJob) -> None:
        ids = torch.tensor(job.prompt, device=self.device)
        audio = [a.to(self.device, torch.float32) for a in job.audio]
        embeds = self.model.embed(ids, audio)
        mm = (ids == self.cfg.tokens.audio_token)
        keep = self.cfg.accept_hidden_layer if job.talker_rows and bool(mm.any()) else None
        step = SlotStep.build([job.slot], [0], len(job.prompt), self.device)
        positions = torch.arange(len(job.prompt), device=self.device)[None]
        logits, hidden = self.model(embeds[None], positions, self.cache.bind(step), keep_hidden=keep)
        job.generator = job.params.generator(self.device)
        if job.talker_rows:
            prompt = talker_prompt(self.cfg, ids.cpu(), embeds.cpu(), None if hidden is None else hidden[0].cpu(),
                                   self.tts_special)
            job.outbox.put(pb.ThinkerResponse(talker_prompt=prompt))
        self._emit([job], logits)

    def _decode(self, jobs: list[ThinkerJob]) -> None:
        """Jobs are the owners of slots 0..n-1, in slot order. A saturated job (its client reads too
        slowly) is computed with the rest (rewriting the same KV entry) but emits nothing."""
        ready = [not j.outbox.saturated for j in jobs]
        if not any(ready):
            return
        n = len(jobs)
        ids = torch.tensor([[j.generated[-1]] for j in jobs]).to(self.device, non_blocking=True)
        start_list = [len(j.prompt) + len(j.generated) - 1 for j in jobs]
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
        if all(j.params.greedy and j.params.repetition_penalty == 1.0 for j in jobs):
            ban = [i for i, j in enumerate(jobs) if len(j.generated) < j.min_tokens]
            if ban:
                rows = torch.tensor(ban, device=logits.device)
                logits[rows[:, None], self.eos[None, :]] = float("-inf")
            return logits.argmax(-1).tolist()
        tokens = []
        for j, row in zip(jobs, logits):
            if len(j.generated) < j.min_tokens:
                row = row.clone()
                row[list(self.eos_ids)] = float("-inf")
            if j.params.repetition_penalty != 1.0:
                seen = torch.tensor(j.prompt + j.generated, device=row.device)
                row = apply_repetition_penalty(row, seen, j.params.repetition_penalty)
            tokens.append(choose(row, j.params, j.generator))
        return tokens

    def _emit(self, jobs: list[ThinkerJob], logits: torch.Tensor) -> None:
        tokens = self._choose(jobs, logits.float())
        embeds = None
        if any(j.talker_rows for j in jobs):
            embeds = self.model.model.embed_tokens(torch.tensor(tokens, device=self.device)).cpu()
        for i, (j, tok) in enumerate(zip(jobs, tokens)):
            index = len(j.generated)
            j.generated.append(tok)
            delta = pb.TextDelta(index=index, token_ids=[tok], text=self._detokenize(j))
            if j.talker_rows:
                delta.embeddings.CopyFrom(to_proto(embeds[i:i + 1]))
            j.mark_output()
            j.outbox.put(pb.ThinkerResponse(text=delta))
            if tok in self.eos_ids and len(j.generated) >= j.min_tokens:
                reason = pb.STOP
            elif len(j.generated) >= j.max_tokens:
                reason = pb.LENGTH
            else:
                continue
            self.finish(j, pb.ThinkerResponse(finished=pb.Finished(
                reason=reason, prompt_tokens=len(j.prompt), completion_tokens=len(j.generated))))

    def _detokenize(self, job: ThinkerJob) -> str:
        text = self.tokenizer.decode(job.generated, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""  # an incomplete UTF-8 sequence: wait for the next token
        delta = text[len(job.text_sent):] if text.startswith(job.text_sent) else text
        job.text_sent = text
        return delta
