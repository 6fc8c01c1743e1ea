"""Thinker engine: each step runs the next chunk of a long prompt, prefills a batch of waiting
requests (right-padded prompts, one forward), then one batched decode step over every running
request. Emits typed outputs (runtime/outputs.py; the servicer builds the messages): with talker
rows a TalkerPromptOut first (a text prompt's at admission, before its prefill; one with audio
after its prefill, which makes its audio rows), then TextOuts (token ids, talker rows, log probabilities, and the text
only for a reply with stop strings: the servicer detokenizes the others, see output.py), then the
Finished. A request whose reply is given (ThinkerStart.assistant_text) is prefilled only: its
reply goes out whole, as if generated, right after its prefill.

    step: scheduler (slots, prefill batch and budget, the chunk of a long prompt, rows that decode:
          scheduler.py) -> runner (forwards, CUDA graphs, sampling: runner.py) -> output step here
          (first tokens, a given reply, EOS / min / max tokens, stop strings through output.py,
          non-finite rows fail alone; outputs out; finish)"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import grpc
import torch

from ..runtime.flags import PREFILL_CHUNK
from ..runtime import metrics
from ..runtime.config import ThinkerConfig
from ..runtime.engine import StageEngine, StageError, deliver_now
from ..runtime.outputs import Finished, FinishReason, TextOut, TokenLogprob
from .grammar import Grammars
from .job import ForcedReply, ThinkerJob
from .model import ThinkerModel
from .output import IncrementalDetokenizer, ReplyText
from .runner import DRAFT_TOKENS, KVPlan, Prefilled, ThinkerRunner, talker_prompt
from .scheduler import ThinkerScheduler
from .streaming import TurnStreams

__all__ = ["ThinkerEngine", "ThinkerJob", "ForcedReply", "IncrementalDetokenizer", "talker_prompt",
           "assistant_head_index"]

log = logging.getLogger(__name__)
_ENDED = object()            # _take / _verify: the job failed there (finished with an error)

FORCED_DELTA_TOKENS = 64     # a forced reply's tokens per TextOut (its rows: a bounded message each)
JUMP_TOKENS = 64             # a grammar's forced tokens taken at once at most (one extend forward feeds them)
JUMP_FEED_ROWS = 8           # decode rows of a step up to which forced runs are fed by a forward of their own


def assistant_head_index(cfg: ThinkerConfig, ids: list[int]) -> int | None:
    """Index of the last '<|im_start|>assistant' that still has its newline inside the prompt."""
    tok = cfg.tokens
    for i in range(len(ids) - 3, -1, -1):
        if ids[i] == tok.im_start and ids[i + 1] == tok.assistant:
            return i
    return None




@dataclass
class DraftCounts:
    """Drafts of grammar-forced text (engine._draft) since start: verifies run, tokens drafted, and
    drafted tokens the model's own choice accepted."""
    verified: int = 0
    drafted: int = 0
    accepted: int = 0


class ThinkerEngine(StageEngine):
    name = "thinker"

    def __init__(self, model: ThinkerModel, cfg: ThinkerConfig, tokenizer, *, device: torch.device,
                 max_active: int, max_len: int, eos_ids: tuple[int, ...], kv: KVPlan | None = None,
                 cuda_graphs: bool = True,
                 prefill_batch: int = 8, prefill_tokens: int = 4096, prefill_graph_len: int = 512,
                 prefill_chunk: int = PREFILL_CHUNK, eager_fallback: bool = False,
                 talker_prompt_ids: bool = True, audio_cache_bytes: int = 0, draft_forced: bool = True,
                 draft_prefill: bool = True) -> None:
        """A step prefills up to `prefill_batch` prompts with at most `prefill_tokens` padded tokens
        together; prompts up to `prefill_graph_len` tokens replay CUDA graphs. Longer prompts (and
        any longer than `prefill_chunk`) are prefilled in chunks packed into one row, at most
        `prefill_chunk` tokens per step (ThinkerScheduler). `talker_prompt_ids`: a text prompt's user
        turns go to a routed talker as token ids, which it looks up itself (TalkerPrompt.user_rows unset);
        off: as rows (for talkers older than that). `kv`: the KV pool (default: room for `max_active`
        sequences of `max_len` positions). `audio_cache_bytes`: audio encoder outputs kept by clip
        content (audio_cache.py; 0: none). `draft_forced`: draft a grammar's forced text where more
        than one spelling can write it (`_draft`); with `draft_prefill`, the text forced before any
        choice rides in the prompt's prefill (`open_reply`)."""
        super().__init__(max_active)
        if kv is None:
            kv = KVPlan(blocks=-(-max_active * max_len // KVPlan.block_size))
        self.cfg, self.tokenizer, self.device, self.max_len = cfg, tokenizer, device, max_len
        self.eos_ids = eos_ids
        self.scheduler = ThinkerScheduler(prefill_batch, prefill_tokens, prefill_chunk,
                                          long_prompt=min(prefill_chunk, prefill_graph_len))
        self._grammars: Grammars | None = None
        self._grammars_lock = threading.Lock()
        self.runner = ThinkerRunner(model, cfg, device=device, max_active=max_active, max_len=max_len,
                                    eos_ids=eos_ids, kv=kv, cuda_graphs=cuda_graphs, prefill_batch=prefill_batch,
                                    prefill_graph_len=prefill_graph_len, eager_fallback=eager_fallback,
                                    audio_cache_bytes=audio_cache_bytes)
        self.planned_chunks = 0        # chunk shapes the engine thread planned for cuDNN (prepare)
        self.streams = TurnStreams(self)     # turns whose audio is streamed (streaming.py)
        self.talker_prompt_ids = talker_prompt_ids
        # on CUDA only through the verify graphs (an eager extend forward there costs more than the forwards it
        # saves: with --no-cuda-graphs too); off CUDA (tests, CPU serving) eagerly
        on_cuda = torch.device(device).type == "cuda"
        self.draft_forced = draft_forced and (self.runner.verify_graphs is not None
                                              or (self.runner.graphs is None and not on_cuda))
        if draft_forced and not self.draft_forced:
            log.warning("thinker: no verify graphs were captured (or CUDA graphs are off): drafts of forced text are off")
        self.draft_prefill = draft_prefill
        self.drafts = DraftCounts()

    def prepare(self) -> None:
        """On the engine thread, before serving: a cold long prompt's chunks attend through cuDNN's
        two-part path (runtime/kv_cache.py), whose plans cuDNN keeps per thread: planned here, for the
        chunks the scheduler cuts (`prefill_chunk` tokens at multiples of it), not on first sight."""
        if self.runner.graphs is None:     # no graphs (--no-cuda-graphs, a CPU): no start-up work either
            return
        if self.runner.warmed:
            # the runner's warm-up again, on this thread: its eager paths are served from here, and
            # what a library keeps per thread (cuBLAS / cuBLASLt handles and workspaces, cuDNN
            # handles) is made at start, not by a request's first eager prefill
            self.runner.warm_up()
        self.planned_chunks = self.runner.cache.plan_chunks(self.scheduler.prefill_chunk, self.max_len,
                                                            self.cfg.text.num_heads)
        log.info("thinker: cuDNN attention planned on the engine thread for %d long-prompt chunk shapes "
                 "(%d tokens each)", self.planned_chunks, self.scheduler.prefill_chunk)

    @property
    def talker_prompt_ids(self) -> bool:
        """A routed talker's prompts send the user turns as token ids (the runner builds them)."""
        return self.runner.talker_prompt_ids

    @talker_prompt_ids.setter
    def talker_prompt_ids(self, value: bool) -> None:
        self.runner.talker_prompt_ids = value

    @property
    def grammars(self) -> Grammars:
        """The grammar compiler over this thinker's vocabulary (built on first use: the vocabulary's
        bytes take a moment at full size; thread-safe, for the server's compile pool)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.cfg.text.vocab_size, self.eos_ids)
            return self._grammars

    # ---- the loop's hooks
    @property
    def free_slots(self) -> int:
        """Sequences the engine can still take (--max-batch); KV blocks are the other limit."""
        return self.max_active - len(self.running)

    def has_work(self) -> bool:
        return (self.streams.has_work()
                or self.scheduler.has_work(self.waiting, self.running, self.free_slots, self.runner.fits))

    def submit(self, req: ThinkerJob) -> None:
        """A committed streamed turn takes its pending job's place at the next step (streaming.py)."""
        if req.adopts is None:
            super().submit(req)
            return
        req.outbox.on_drain = self.notify
        self.streams.commit(req)

    def open_reply(self, job: ThinkerJob) -> None:
        """Jump-forward decoding of the reply's opening (a constrained job before its admission, off
        the engine thread: the server's compile pool): the tokens its grammar forces before any
        choice (a call's `<tool_call>\n{"name": "`, a named function's whole head) are taken now and
        prefilled with the prompt (`prefill_target`), so that its first sampled token comes from the
        prefill's logits. They go out now: whatever the model computes, the reply begins with them
        (a named call's first `tool_calls` delta needs no forward; sent after the prefill it waited
        for those tokens' own prefill, +11.6 ms on the H200). Not for replies with stop strings,
        talker rows or log probabilities (their first outputs are the prompt's).

        Then the prefill's draft (`draft_prefill`): where the grammar goes on forcing a text that
        more than one spelling can write (or, without an opening, forces any text), its spelling
        (`_draft`) rides after the context in the prefill (runner.allocate keeps it where the blocks
        and the forward take it), whose last positions verify it in the output step (`_verify`): a
        required call's name chosen from the prefill's logits. Not for rows with log probabilities
        (as `_jump`: each token's need its own decode step's logits)."""
        if (job.matcher is None or job.generated or job.forced is not None or job.pending or job.adopts is not None):
            return
        if not (job.stops or job.talker_rows or job.top_logprobs is not None):
            self._open(job)
        if self.draft_forced and self.draft_prefill and job.top_logprobs is None:
            self._draft(job)

    def _open(self, job: ThinkerJob) -> None:
        """open_reply's forced opening: taken, out at once, prefilled with the prompt."""
        run: list[int] = []
        while len(run) < min(JUMP_TOKENS, job.max_tokens - 1):
            tok = job.matcher.forced()
            if tok is None or not job.matcher.accept(tok):
                break
            run.append(tok)
        if run:
            job.generated, job.opened = run, len(run)
            job.prefill_target = len(job.prompt) + len(run)
            # (its first output in the metrics and traces stays the first sampled token's: the model's)
            job.opening = ReplyText(self.tokenizer, job.stops, job.min_tokens, job.unspoken)
            for tok in run:
                for delta in job.opening.push(tok, None, None, last=False)[0]:
                    job.outbox.put(delta)

    def release(self, req: ThinkerJob) -> None:
        self.runner.release(req)
        req.matcher = None      # its grammar state goes with the request (finished, failed or cancelled)
        self.runner.observe_kv()    # a request cancelled while nothing else runs: no step follows to say so

    @torch.inference_mode()
    def step(self) -> None:
        self.streams.advance()
        with self.lock:
            plan = self.scheduler.schedule(self.waiting, self.running, self.free_slots, self.runner.allocate)
            for job in plan.admitted:
                if job.started is None:
                    job.mark_started()
                self.running.append(job)
                self.waiting.remove(job)
        early = False
        for job in plan.admitted:     # a text prompt's talker prompt leaves before its prefill runs
            if job.talker_rows and not job.prompt_sent and not job.generated:
                # a routed talker looks the user rows up itself; a caller that asked for talker_rows gets them
                prompt = self.runner.early_talker_prompt(job, ids_only=self.talker_prompt_ids and job.speech is not None)
                if prompt is not None:
                    job.prompt_sent = early = True
                    job.outbox.put(prompt)
        if early:
            deliver_now()
        if plan.chunks:
            chunked = self.runner.prefill_chunks([(c.request, c.start, c.length) for c in plan.chunks])
            for c in plan.chunks:
                c.request.prefilled = c.start + c.length
            for job in chunked.broken:
                log.warning("request %s: non-finite values in its prompt's chunk (%d of %d tokens prefilled)",
                            job.request_id, job.prefilled, job.prefill_target)
                self._fail_nonfinite(job, "prompt's hidden states")
            if chunked.done:
                self._first_outputs(chunked.done, chunked.prefilled,
                                    f"packed chunks of {len(plan.chunks)} prompts")
        if plan.prefill:
            metrics.PREFILL_BATCH.labels(self.name).observe(len(plan.prefill))
            prefilled = self.runner.prefill(plan.prefill)
            for job in plan.prefill:
                job.prefilled = len(job.prompt)
            self._first_outputs(plan.prefill, prefilled, f"prefill of {len(plan.prefill)} prompts")
        if plan.chunks or plan.prefill:
            deliver_now()     # first tokens (and their talker rows) leave now, not after this step's decode forward
        decode = self._with_blocks([job for job in plan.decode if not job.done])   # a first token may have finished it
        if decode:
            self._decode(decode)
        for job in self.running:      # this step's outputs were finite: its full blocks can be found
            self.runner.publish(job)
        self.runner.observe_kv()

    def _decode(self, decode: list[ThinkerJob]) -> None:
        """The step's decode forward and its outputs. Forced runs (`ahead`, engine._jump, which
        makes them while at most JUMP_FEED_ROWS requests run): in a step of at most that many rows,
        fed at once by one extend forward beside the decode forward (runner.feed), their logits
        those after the run; a run that meets a larger step (where a second forward would cost
        every row) catches up one token a step in the decode forward, its logits -- of a token
        already known -- not sampled, as decoding the run would go. Drafts (`_draft`) are fed the
        same way, after the run if any, and verified in the output step; a larger step drops them."""
        feed = len(decode) <= JUMP_FEED_ROWS     # (a run made in a smaller step may meet a larger one)
        for job in decode:      # every row has its next position's block (_with_blocks): drafts take what is left
            if not feed:
                job.draft = []
            elif job.draft:
                self.runner.grow_draft(job)
        runs = [job for job in decode if job.ahead or job.draft] if feed else []
        steps = [job for job in decode if not (feed and (job.ahead or job.draft))]
        outs, drafts = [], None
        if steps:
            jobs, logits = self.runner.decode(steps)
            catching = [i for i, job in enumerate(jobs) if job.ahead]
            for i in catching:
                jobs[i].ahead -= 1
            if catching:
                skip = set(catching)
                kept = [i for i in range(len(jobs)) if i not in skip]
                jobs, logits = [jobs[i] for i in kept], logits[torch.tensor(kept, dtype=torch.long, device=logits.device)]
            if jobs:
                outs.append((jobs, logits))
        if runs:
            fed, fed_logits, drafts = self.runner.feed(runs)
            outs.append((fed, fed_logits))
        if not outs:
            return
        jobs = [job for part, _ in outs for job in part]
        logits = outs[0][1] if len(outs) == 1 else torch.cat([lg for _, lg in outs])
        self._output(jobs, logits, f"decode of {len(steps)} rows and {len(runs)} forced runs", drafts)

    def _progress(self, req: ThinkerJob) -> str:
        return f"{len(req.generated)} generated"

    # ---- the output step
    def _first_outputs(self, jobs: list[ThinkerJob], prefilled: Prefilled, step: str) -> None:
        """Prefilled jobs' first outputs: the talker prompt, then a given reply whole (its request
        ends here) or the first sampled token from the prefill's logits."""
        for job, prompt in zip(jobs, prefilled.prompts):
            job.text = job.opening or ReplyText(self.tokenizer, job.stops, job.min_tokens, job.unspoken)
            job.opening = None
            if prompt is not None:
                job.outbox.put(prompt)
            if job.opened:
                job.mark_output()
                self._opened_noise(job, prefilled.logits.shape[1])
        sampled = [i for i, j in enumerate(jobs) if j.forced is None]
        for job in jobs:
            if job.forced is not None:
                self._emit_forced(job)
        logits = prefilled.logits
        if len(sampled) < len(jobs):
            if not sampled:
                return
            jobs, logits = [jobs[i] for i in sampled], logits[torch.tensor(sampled, device=logits.device)]
        # the prefill's drafts (a given reply has none): verified as a decode step's drafts
        self._output(jobs, logits, step, prefilled.drafts)

    def _opened_noise(self, job: ThinkerJob, width: int) -> None:
        """The reply's forced opening (open_reply, already out) as if each token were decoded: a
        sampled row's generator draws each one's noise, as in `_jump`."""
        if job.generator is not None:
            noise = torch.empty(width, device=self.device)
            for _ in range(job.opened):
                noise.exponential_(1, generator=job.generator)

    def _emit_forced(self, job: ThinkerJob) -> None:
        """The given reply as if generated: its tokens (end of turn included) in deltas of
        FORCED_DELTA_TOKENS with their talker rows (lookups in the embedding table, as for sampled
        tokens), the whole text in the first delta; then STOP."""
        ids = job.forced.token_ids
        rows = self.runner.forced_rows(ids) if job.talker_rows else None
        job.mark_output()
        if job.unspoken and rows is not None and any(m in job.forced.text for m in job.unspoken):
            self._emit_forced_unspoken(job, rows)
            return
        for start in range(0, len(ids), FORCED_DELTA_TOKENS):
            piece = ids[start:start + FORCED_DELTA_TOKENS]
            job.outbox.put(TextOut(start, tuple(piece), job.forced.text if start == 0 else "",
                                   None if rows is None else rows[start:start + len(piece)],
                                   more=start + len(piece) < len(ids)))
        job.generated.extend(ids)
        self.finish(job, Finished(FinishReason.STOP, prompt_tokens=len(job.prompt), completion_tokens=len(ids),
                                     cached_tokens=job.cached_tokens))

    def _emit_forced_unspoken(self, job: ThinkerJob, rows: torch.Tensor) -> None:
        """A given reply with tool-call markup: its tokens through the reply's text as if sampled
        one by one, so that the talker's rows end where the markup begins (output.py)."""
        ids = job.forced.token_ids
        for i, tok in enumerate(ids):
            deltas, _ = job.text.push(tok, rows[i], None, last=i == len(ids) - 1)
            for delta in deltas:
                job.outbox.put(delta)
        job.generated.extend(ids)
        self.finish(job, Finished(FinishReason.STOP, prompt_tokens=len(job.prompt), completion_tokens=len(ids)))

    def _output(self, jobs: list[ThinkerJob], logits: torch.Tensor, step: str,
                drafts: torch.Tensor | None = None) -> None:
        """Each job's next token from its logits row [n, V]: stop checks, its outputs, finishing.
        `step`: what made the logits, for the log of a row that is not finite. `drafts`: the logits
        [.., V] at the drafted tokens of the jobs with a draft (runner.feed), in the jobs' order: a
        drafted job's choices go on from them while each equals its draft (`_verify`)."""
        sampled = self.runner.sample(jobs, logits)
        # forced runs only where the next step feeds them at once (in a larger one decoding them costs the same)
        jump = len(self.running) <= JUMP_FEED_ROWS
        for job, tok in zip(jobs, sampled.tokens):
            if tok < 0:
                log.warning("request %s: logits not finite in a %s (prompt %d tokens, %d generated)",
                            job.request_id, step, len(job.prompt), len(job.generated))
                self._fail_nonfinite(job, "logits")
        at = 0
        for i, (job, tok) in enumerate(zip(jobs, sampled.tokens)):
            draft = []
            if drafts is not None:      # the drafts fed in this step (a job's later draft is made below)
                draft, job.draft = job.draft, []
            rows = drafts[at:at + len(draft)] if draft else None
            at += len(draft)
            if tok < 0:
                continue
            # drafted: the grammar's state is needed at once, for the next position's mask
            reason, out = self._take(job, tok, sampled.rows[i], sampled.logprobs.get(i), jump or bool(draft))
            if reason is None and draft:
                deliver_now()     # the rows before it (free ones among them) do not wait for its verify
                reason, more = self._verify(job, tok, draft, rows, step)
                out = out or more
            if reason is _ENDED:
                continue
            if reason is None and jump and job.matcher is not None and job.top_logprobs is None:
                if out:         # the sampled token's text leaves before the forced run is worked out (a
                    deliver_now()     # required call's head goes out once the name's first token picks it)
                reason = self._jump(job, logits.shape[1])
                if reason is None and self.draft_forced:
                    self._draft(job)
            if reason is not None:
                self.finish(job, Finished(reason, prompt_tokens=len(job.prompt), completion_tokens=len(job.generated),
                                          cached_tokens=job.cached_tokens, streamed_tokens=job.streamed_tokens))

    def _take(self, job: ThinkerJob, tok: int, row: torch.Tensor | None, logprob: TokenLogprob | None,
              accept: bool) -> tuple[FinishReason | object | None, bool]:
        """The job's next token `tok` (its talker row and log probability if asked): the grammar's
        state (`accept`: advanced now; else at the next fill, beside the forward), the reply's
        outputs, its end: (a FinishReason, _ENDED when it failed here, or None; whether outputs left)."""
        # with jump-forward the grammar's state is needed now; without, its accept is deferred to
        # the next step's fill, which runs beside the forward (Matcher.defer): a refusal shows then
        refused = job.matcher is not None and (job.matcher.refused or accept and not job.matcher.accept(tok))
        if refused:
            log.warning("request %s: its grammar refused a sampled token", job.request_id)
            self.finish(job, StageError(grpc.StatusCode.INTERNAL, f"thinker: request {job.request_id}: "
                                                                  "the constraint refused a sampled token"))
            return _ENDED, False
        if job.matcher is not None and not accept:
            job.matcher.defer(tok)
        job.generated.append(tok)
        # a constrained reply's grammar allows an end-of-turn token only once it is complete
        if tok in self.eos_ids and len(job.generated) >= job.min_tokens:
            reason = FinishReason.STOP
        elif len(job.generated) >= job.max_tokens:
            reason = FinishReason.LENGTH
        else:
            reason = None
        deltas, stopped = job.text.push(tok, row, logprob, last=reason is not None)
        if deltas:
            job.mark_output()
        for delta in deltas:
            job.outbox.put(delta)
        if stopped:
            reason = FinishReason.STOP
        return reason, bool(deltas)

    def _verify(self, job: ThinkerJob, tok: int, draft: list[int], rows: torch.Tensor, step: str
                ) -> tuple[FinishReason | object | None, bool]:
        """A draft's verify: `tok`, the job's choice at its last token (taken), then, while the
        latest choice equals the drafted token at its position, the choice after that token from its
        logits (rows [len(draft), V]) -- each made as a decode step makes it (the grammar's mask, the
        EOS ban, the generator's next draw, one position at a time), so the reply is the one
        decoding gives. The first choice that differs (or the one after the last drafted token) is
        the job's last token; the keys of the drafted tokens after it are never read (runner.feed).
        Its end and whether outputs left, as `_take`."""
        self.drafts.verified += 1
        self.drafts.drafted += len(draft)
        metrics.DRAFT_TOKENS.labels(self.name, "drafted").inc(len(draft))
        reason, out, k = None, False, 0
        while reason is None and k < len(draft) and tok == draft[k]:
            sampled = self.runner.sample([job], rows[k:k + 1])
            k += 1
            self.drafts.accepted += 1
            metrics.DRAFT_TOKENS.labels(self.name, "accepted").inc()
            tok = sampled.tokens[0]
            if tok < 0:
                log.warning("request %s: logits not finite in a %s (a drafted token's verify)", job.request_id, step)
                self._fail_nonfinite(job, "logits")
                return _ENDED, out
            reason, more = self._take(job, tok, sampled.rows[0], None, True)
            out = out or more
        return reason, out

    def _draft(self, job: ThinkerJob) -> None:
        """Draft-and-verify of a grammar's forced text: where the grammar forces a text that more
        than one spelling can write (no single forced token: `_jump` took those), the tokenizer's own
        spelling of it (`_spell`) waits in `job.draft`, fed with the next step after the job's last
        token; the output step then takes the model's own choices while they equal the drafted
        tokens (`_verify`): a call's `<tool_call>\n{"name": "` in one forward where each token
        the model chooses in it would take one. Up to DRAFT_TOKENS, and one fewer than max_tokens
        leaves."""
        budget = min(DRAFT_TOKENS, job.max_tokens - len(job.generated) - 1)
        if budget < 1:
            return
        text = job.matcher.forced_string()
        if text:
            job.draft = self._spell(job, text)[:budget]

    def _spell(self, job: ThinkerJob, text: str) -> list[int]:
        """The tokenizer's spelling of `text` after the reply's last token: its encoding of that
        token's text and `text` together where it begins with that token (the boundary as the
        tokenizer draws it), else of `text` alone."""
        last = job.generated[-1:]
        if last:
            both = self.tokenizer.encode(self.tokenizer.decode(last) + text, add_special_tokens=False)
            if both[:1] == last:
                return both[1:]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _jump(self, job: ThinkerJob, width: int) -> FinishReason | None:
        """Jump-forward decoding: while its grammar allows one token only (Matcher.forced), the
        reply takes it now, without a decode step -- the token any choice would make, so the reply
        is the one decoding gives, token for token -- out with the token just sampled, up to
        max_tokens (LENGTH) or a stop string (STOP); the next step feeds the run to the model at
        once (runner.feed) for the logits after it. A sampled row's generator draws the noise each
        skipped step would have drawn (`width`: the logits' width), so its later tokens are the same
        too. Not for rows that asked for log probabilities (each token's needs its own logits)."""
        run: list[int] = []
        while len(run) < JUMP_TOKENS and len(job.generated) + len(run) < job.max_tokens:
            tok = job.matcher.forced()
            if tok is None or not job.matcher.accept(tok):
                break
            run.append(tok)
        if not run:
            return None
        if job.generator is not None:
            noise = torch.empty(width, device=self.device)
            for _ in run:
                noise.exponential_(1, generator=job.generator)
        rows = self.runner.forced_rows(run) if job.talker_rows else None
        reason = None
        for i, tok in enumerate(run):
            job.generated.append(tok)
            job.ahead += 1
            if len(job.generated) >= job.max_tokens:
                reason = FinishReason.LENGTH
            deltas, stopped = job.text.push(tok, None if rows is None else rows[i], None, last=reason is not None)
            if deltas:
                job.mark_output()
            for delta in deltas:
                job.outbox.put(delta)
            if stopped:
                return FinishReason.STOP
        return reason

    def _fail_nonfinite(self, job: ThinkerJob, what: str) -> None:
        """Finish `job` alone with a clear error; nothing it left on the device reaches a later
        request (ThinkerRunner.scrub)."""
        self.runner.scrub(job)
        self.finish(job, self.nonfinite(job, what))
