"""Thinker scheduler: which waiting requests take a KV slot and are prefilled now, which long prompt
prefills its next chunk, and which running requests decode. Pure Python (no tensors, no model); the
engine applies the schedule, the runner computes, the engine's output step decides what a token
means (EOS, min / max tokens, stop strings).

Short prompts (at most `long_prompt` tokens) are prefilled together, right-padded, in arrival
order: up to `prefill_batch` of them while the padded batch (the longest prompt times the prompts)
stays within `prefill_tokens` tokens (one prompt always fits) and a slot is free for each. A longer
prompt takes a slot and is prefilled in chunks: a step packs up to `prefill_chunk` tokens of long
prompts into one row (no padding), the running ones first, in the order they were admitted, then
waiting long prompts while tokens of the step are left (at most `prefill_batch` prompts in chunked
prefill at once, and at most that many chunks a step: the thinker's extend graphs take that many
rows); long prompts that wait do not hold up the short ones behind them. A chunk that does not end
its prefill ends at a multiple of `prefill_chunk` positions at most: a cold prompt's chunks are
`prefill_chunk` tokens after 0, 1, 2, ... chunks (the shapes whose attention the thinker plans at
start), and a prefill that began elsewhere (after a cached prefix, or with a share of a step) is back
on those boundaries after one chunk. Every running request
with a token to feed decodes in every step -- those whose prefill ends in this step too, once the
prefill made their first token -- except one whose reader is behind (its outbox saturated): it sits
out, its state unchanged.

KV memory: a request is admitted only once `reserve(request)` gave it the KV blocks its prompt
needs (the engine's block manager; it may find a cached prefix, which sets `prefilled` and sends
the rest of the prompt down the chunked path, whatever its length); the first waiting request that
gets none stops admission for this step (arrival order). A request preempted for lack of blocks
waits again with `prefill_target` covering its reply but the last token, and decodes once that much
is prefilled again."""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol, Sequence


class Reader(Protocol):
    saturated: bool


class Request(Protocol):
    """What the scheduler reads of a request (services.thinker.job.ThinkerJob)."""

    prompt: Sequence[int]
    generated: Sequence[int]     # tokens made so far: a request decodes once it has one
    prefilled: int               # context tokens in the KV cache (a long prompt: chunk by chunk)
    prefill_target: int          # context tokens to prefill before it decodes (len(prompt) unless preempted)
    pending: bool                # a streamed turn before its commit: prefilled in chunks, never decodes
    outbox: Reader


@dataclass(frozen=True)
class Chunk:
    """The part of a long prompt that a step prefills: tokens start .. start + length - 1."""

    request: Request
    start: int
    length: int

    @property
    def last(self) -> bool:
        """The prefill's last chunk: the request makes its first token (or, resumed after a
        preemption, decodes again) in this step (a pending turn's never is: it waits for more)."""
        return self.start + self.length >= self.request.prefill_target and not self.request.pending


@dataclass
class ThinkerSchedule:
    admitted: list[Request] = field(default_factory=list)   # take a slot now, in this order (long prompts first)
    chunks: list[Chunk] = field(default_factory=list)        # long prompts' next chunks, packed into one row
    prefill: list[Request] = field(default_factory=list)    # short prompts prefilled together now, in arrival order
    # requests that decode now: running ones with a token to feed, then those whose prefill ends in this
    # step (the engine leaves out any that the prefill's first token finished)
    decode: list[Request] = field(default_factory=list)


class ThinkerScheduler:
    def __init__(self, prefill_batch: int, prefill_tokens: int, prefill_chunk: int, long_prompt: int | None = None) -> None:
        """`long_prompt`: prompts longer than this are prefilled in chunks (default: `prefill_chunk`)."""
        self.prefill_batch, self.prefill_tokens, self.prefill_chunk = prefill_batch, prefill_tokens, prefill_chunk
        self.long_prompt = prefill_chunk if long_prompt is None else long_prompt

    def has_work(self, waiting: Sequence[Request], running: Sequence[Request], free_slots: int,
                 fits: Callable[[Request], bool] = lambda r: True) -> bool:
        """`fits(r)`: whether the KV blocks for waiting request r are free now (nothing taken)."""
        return (any(not r.outbox.saturated and (r.generated or r.prefilled < r.prefill_target) for r in running)
                or (bool(waiting) and free_slots > 0 and fits(waiting[0])))

    def schedule(self, waiting: Sequence[Request], running: Sequence[Request], free_slots: int,
                 reserve: Callable[[Request], bool] = lambda r: True) -> ThinkerSchedule:
        """`reserve(r)`: give waiting request r its KV blocks (True), or take nothing (False)."""
        plan = ThinkerSchedule(decode=[r for r in running if r.generated and r.prefilled >= r.prefill_target
                                       and not r.outbox.saturated])
        chunking = self.chunking(running)
        budget = self.prefill_chunk
        for r in chunking:
            if budget <= 0 or len(plan.chunks) >= self.prefill_batch:
                break
            plan.chunks.append(self._chunk(r, budget))
            budget -= plan.chunks[-1].length
        in_prefill = len(chunking)
        free, longest = free_slots, 0
        for r in waiting:
            if len(plan.prefill) >= min(self.prefill_batch, free):
                break
            if r.prefill_target > self.long_prompt:    # a long prompt: chunked, packed with the others
                if budget > 0 and in_prefill < self.prefill_batch and free > len(plan.prefill):
                    if not reserve(r):
                        break
                    plan.admitted.append(r)
                    plan.chunks.append(self._chunk(r, budget))
                    budget -= plan.chunks[-1].length
                    in_prefill += 1
                    free -= 1
                continue
            longest_next = max(longest, r.prefill_target)
            if plan.prefill and longest_next * (len(plan.prefill) + 1) > self.prefill_tokens:
                break
            if in_prefill >= self.prefill_batch:   # it may find a cached prefix: it would be one more
                break
            if not reserve(r):
                break
            if r.prefilled or r.generated or r.pending:   # a cached prefix, resumed, or streamed: chunked
                plan.admitted.append(r)
                free -= 1
                in_prefill += 1
                if budget > 0:
                    plan.chunks.append(self._chunk(r, budget))
                    budget -= plan.chunks[-1].length
                continue
            plan.prefill.append(r)
            longest = longest_next
        plan.admitted += plan.prefill
        plan.decode += [c.request for c in plan.chunks if c.last and not c.request.outbox.saturated]
        plan.decode += [r for r in plan.prefill if not r.outbox.saturated]
        return plan

    def _chunk(self, r: Request, budget: int) -> Chunk:
        """Request r's next chunk within `budget` tokens: the rest of its prefill where that fits, else
        up to the next multiple of `prefill_chunk` at most, so that after a cached prefix or a share
        of a packed step its chunks are `prefill_chunk` tokens at multiples of it again -- the shapes
        the thinker planned its long-chunk attention for (ThinkerEngine.prepare). A prefill that
        ends in this step is never split (a conversation's next turn stays one chunk)."""
        rest = r.prefill_target - r.prefilled
        if rest <= budget:
            return Chunk(r, r.prefilled, rest)
        return Chunk(r, r.prefilled, min(budget, self.prefill_chunk - r.prefilled % self.prefill_chunk))

    @staticmethod
    def chunking(running: Sequence[Request]) -> list[Request]:
        """The running requests whose prompts are still being prefilled (in chunks), in admission order."""
        return [r for r in running if r.prefilled < r.prefill_target]
