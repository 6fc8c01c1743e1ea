"""Streamed turns on the thinker's engine (ThinkerStart.stream_audio): the user's last clip arrives
while it is spoken, and the turn is prefilled as far as its audio allows before its commit.

A *pending* turn is a ThinkerJob with `pending` set: its prompt is the conversation before the clip
(the servicer's start), then the placeholders of every encoder window encoded so far. It waits in
`held` until its chunk padding is decided (model.chunk_pad: a full chunk once any of its clips, the
streamed one included, reaches one; a prompt without earlier audio needs none), then is admitted as
any request (it takes its conversation's cached prefix, earlier clips included; a pending turn may
be spoken, so, as for a spoken audio prompt, not past a cached audio block whose talker rows the
AudioRowCache lacks -- the rows it holds go to the committed job) and is prefilled in chunks as windows complete; it
never decodes and publishes no block (the clip's digest, part of the prefix hashes, is known only at
the commit). At the commit the servicer submits the committed job (`adopts`: the pending one); the
next step hands it the pending job's blocks, the positions whose keys stay valid (the conversation
and the windows `StreamedClip.finish` kept) and the hidden rows kept for the talker; the rest of the
clip and the turn's tail are prefilled as for any prompt with a cached part. A pending turn that is
cancelled (Cancel, the stream's end, a disconnect) is released as any request: its blocks return to
the pool.

The committed job's prompt, clips and digests are those of the same turn sent whole (the servicer
builds it so), and each position's keys are computed from the same embeddings, so its outputs are
the whole turn's (tests/test_streamed_turns.py)."""

from __future__ import annotations

import logging

import grpc
import torch

from ..runtime import metrics
from ..runtime.engine import StageError
from ..runtime.tensors import ids_tensor
from .job import ThinkerJob
from .model import chunk_pad
from .runner import audio_spans

log = logging.getLogger(__name__)

STREAMED_TOKENS = metrics.Counter(
    "voxpipe_streamed_prompt_tokens", "Prompt tokens of streamed turns (ThinkerStart.stream_audio), by when their "
    "keys were computed: before the commit (prefix-cache hits included) or after it", ["stage", "when"],
    registry=metrics.REGISTRY)
STREAMED_AUDIO_TOKENS = metrics.Counter(
    "voxpipe_streamed_audio_tokens", "The streamed clips' audio placeholder tokens (ThinkerStart.stream_audio), by "
    "when their keys were computed: before the commit (its complete encoder windows, prefilled) or after it",
    ["stage", "when"], registry=metrics.REGISTRY)


class TurnStreams:
    """The engine's pending turns. `open`, `hear` and `commit` are called from the servicer (event
    loop) and take the engine's lock; `has_work` runs under it; `advance` on the engine thread at the
    start of a step."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.held: list[ThinkerJob] = []       # pending turns whose chunk padding is not decided yet
        self.live: list[ThinkerJob] = []       # every pending turn not yet committed or ended
        self.commits: list[ThinkerJob] = []    # committed turns whose pending job the next step hands over

    # ---- the servicer's side
    def open(self, job: ThinkerJob) -> None:
        job.outbox.on_drain = self.engine.notify
        with self.engine.lock:
            self.held.append(job)
            self.live.append(job)
            self.engine.lock.notify_all()

    def hear(self, job: ThinkerJob, raw: torch.Tensor) -> None:
        with self.engine.lock:
            job.heard.append(raw)
            self.engine.lock.notify_all()

    def commit(self, job: ThinkerJob) -> None:
        with self.engine.lock:
            self.commits.append(job)
            self.engine.lock.notify_all()

    # ---- the engine's side
    def has_work(self) -> bool:
        """Under the engine's lock: drops the pending turns that ended (a cancelled held one is counted
        here: it was never in the engine's lists)."""
        for job in [j for j in self.held if j.cancelled]:
            self.held.remove(job)
            if not job.done:
                job.done = True
                metrics.STREAMS.labels(self.engine.name, "cancelled").inc()
        self.live = [j for j in self.live if not j.done and not j.cancelled]
        return bool(self.commits) or any(j.heard or j.streamed.pending_windows() > 0 and j.streamed.pad
                                         for j in self.live) or any(self._decided(j) for j in self.held)

    def _decided(self, job: ThinkerJob) -> int | None:
        """The turn's chunk padding once no frame to come can change it (None: not yet)."""
        chunk = job.streamed.chunk_frames
        frames = [f.shape[1] for f in job.audio]
        if job.streamed.frames >= chunk or any(n >= chunk for n in frames):
            return chunk
        return None if frames else chunk          # no earlier clip: nothing of the conversation depends on it

    def advance(self) -> None:
        """Frames heard go into their clips, turns whose padding is decided wait for admission, complete
        windows are encoded and their placeholders join their turns' prompts, and committed turns take
        over their pending jobs."""
        runner = self.engine.runner
        with self.engine.lock:
            commits, self.commits = self.commits, []
            for job in self.live:
                for raw in job.heard:
                    job.streamed.append(raw)
                job.heard = []
            for job in [j for j in self.held if self._decided(j)]:
                job.streamed.pad = self._decided(job)
                job.audio_digests = runner.audio.keys(job.audio, job.streamed.pad)
                self.held.remove(job)
                self.engine.waiting.append(job)
            live = [j for j in self.live if j.streamed.pad is not None and not j.done]
        for job in live:
            self._encode_windows(job)
        for job in commits:
            self._adopt(job)

    def _encode_windows(self, job: ThinkerJob) -> None:
        runner = self.engine.runner
        rows = job.streamed.encode_windows(runner.model.audio_tower, runner.audio.dtype, runner.device)
        if rows.shape[0] == 0:
            return
        job.prompt = job.prompt + [self.engine.cfg.tokens.audio_token] * rows.shape[0]
        job.prefill_target = len(job.prompt)
        if job.embeds is not None:
            job.embeds = torch.cat((job.embeds, rows.to(job.embeds.dtype)))
        if job.table is not None and not runner.blocks.grow(job.table, len(job.prompt) + 1):
            with self.engine.lock:             # no room for its new windows now: it waits, admitted again later
                if job in self.engine.running:
                    self.engine.running.remove(job)
                    self.engine.waiting.append(job)
            runner.release(job)
            job.prefilled = 0

    def _adopt(self, job: ThinkerJob) -> None:
        """The committed `job` takes its pending job's place, its blocks and the keys that stay valid."""
        engine, runner = self.engine, self.engine.runner
        pending = job.adopts
        job.adopts = None
        with engine.lock:
            gone = pending.done or pending.cancelled
            if pending in self.live:
                self.live.remove(pending)
        if gone:
            engine.finish(job, StageError(grpc.StatusCode.UNAVAILABLE, f"thinker: request {job.request_id}: "
                                          "the streamed turn failed before its commit"))
            return
        clip = job.streamed = pending.streamed
        frames = [f.shape[1] for f in pending.audio] + [clip.frames]
        clip.pad = chunk_pad(frames, clip.n_window)
        kept = clip.finish(runner.model.audio_tower, clip.pad, runner.audio.dtype, runner.device)
        job.audio = pending.audio + [clip.features]
        job.audio_digests = runner.audio.keys(job.audio, clip.pad)
        valid = pending.stream_start + kept * clip.window_tokens     # positions whose keys stay valid
        with engine.lock:
            pending.done = True                # its place, blocks and state are the committed job's now
            if pending in self.held:
                self.held.remove(pending)
            if pending in engine.running and pending.table is not None:
                engine.running[engine.running.index(pending)] = job
                self._take_over(job, pending, min(pending.prefilled, valid))
            else:                              # never admitted, or preempted: admitted as any request
                where = engine.waiting.index(pending) if pending in engine.waiting else len(engine.waiting)
                if pending in engine.waiting:
                    engine.waiting.remove(pending)
                engine.waiting.insert(where, job)
            engine.lock.notify_all()
        job.streamed_tokens = job.prefilled
        STREAMED_TOKENS.labels(engine.name, "before_commit").inc(job.prefilled)
        STREAMED_TOKENS.labels(engine.name, "after_commit").inc(len(job.prompt) - job.prefilled)
        audio = clip.rows.shape[0]
        heard = min(max(job.prefilled - pending.stream_start, 0), audio)
        STREAMED_AUDIO_TOKENS.labels(engine.name, "before_commit").inc(heard)
        STREAMED_AUDIO_TOKENS.labels(engine.name, "after_commit").inc(audio - heard)
        log.debug("request %s committed: %d of %d prompt tokens prefilled before (%d windows of %d kept)",
                  job.request_id, job.prefilled, len(job.prompt), kept, len(clip.windows))

    def _take_over(self, job: ThinkerJob, pending: ThinkerJob, valid: int) -> None:
        """Under the engine's lock: `pending`'s blocks and its first `valid` positions' keys, embeddings
        and kept hidden rows become `job`'s; a table the pool cannot grow to the whole turn is given
        back (the turn is admitted again, from its cached prefix)."""
        runner = self.engine.runner
        table, pending.table = pending.table, None
        bs = runner.blocks.block_size
        del table.hashes[pending.stream_start // bs:]     # hashed without the clip's digest: hashed again
        job.started = pending.started
        if not runner.blocks.grow(table, len(job.prompt) + 1):
            runner.blocks.release(table)
            self.engine.running.remove(job)
            self.engine.waiting.insert(0, job)
            return
        job.table, job.cached_tokens, job.prefilled = table, pending.cached_tokens, valid
        job.cached_rows, pending.cached_rows = pending.cached_rows, {}    # the talker rows of its cached audio blocks
        if job.spans == () and runner.blocks.enable_caching:
            job.spans = audio_spans(runner.cfg, job.prompt, job.audio_digests)
        if pending.kept:
            rows = torch.cat(pending.kept)[:valid - pending.kept_from]
            job.kept, job.kept_from = [rows], pending.kept_from
        else:
            job.kept, job.kept_from = [], valid
        if pending.embeds is not None and valid >= pending.stream_start:
            ids = ids_tensor(job.prompt[valid:], runner.device)
            rest = runner.model.embed(ids, encoded=job.streamed.rows[valid - pending.stream_start:])
            job.embeds = torch.cat((pending.embeds[:valid], rest.to(pending.embeds.dtype)))
            job.embeds_from = 0
        else:
            job.embeds = runner._context_embeds(job)
