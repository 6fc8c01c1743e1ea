"""Talker engine: codec-0 steps batched across requests, then the code predictor batched across
them, then each frame out as soon as it exists (a FramesOut).

    step: scheduler (slots, KV blocks, prefill budget, early prefills, rows ready: scheduler.py) ->
          blocks for the decode step (the newest running request preempted when the pool has none) ->
          runner (forwards, sampling: runner.py) -> output step here (EOS, min / max frames,
          non-finite rows fail alone; frames out; the prompt's user-row blocks published; finish)"""

from __future__ import annotations

import logging
import time

import torch

from ..runtime import metrics
from ..runtime.config import TalkerConfig
from ..runtime.engine import StageEngine
from ..runtime.kv_plan import KVPlan
from ..runtime.outputs import Finished, FinishReason, FramesOut
from .job import DEFAULT_TEXT_CAP, TalkerJob
from .model import TalkerModel, ThinkerTextEmbedding
from .runner import Frames, TalkerRunner
from .scheduler import TalkerScheduler

__all__ = ["DEFAULT_TEXT_CAP", "TalkerEngine", "TalkerJob"]   # the job and its default cap: job.py

log = logging.getLogger(__name__)


def all_audio_rows(first: int, rows: torch.Tensor) -> torch.Tensor:
    """A prompt's multimodal rows [first + n, H] from those past its held prefix (`rows` [n, H]):
    `rows` itself when nothing is held (no copy), else zeros before them (rows never read)."""
    if not first:
        return rows
    full = rows.new_zeros(first + rows.shape[0], rows.shape[1])
    full[first:] = rows
    return full


class TalkerEngine(StageEngine):
    name = "talker"

    def __init__(self, model: TalkerModel, cfg: TalkerConfig, *, device: torch.device, max_active: int,
                 max_len: int, kv: KVPlan | None = None, cuda_graphs: bool = True, prefill_batch: int = 8,
                 prefill_tokens: int = 4096, prefill_graph_len: int = 512, eager_fallback: bool = False,
                 early_prefill: bool = True, text_table: ThinkerTextEmbedding | None = None,
                 frame_seconds: float = 0.08) -> None:
        """A step prefills up to `prefill_batch` ready requests with at most `prefill_tokens` padded
        rows together (right-padded); prompts up to `prefill_graph_len` rows replay CUDA graphs.
        `early_prefill`: a request prefills all but its prompt's last row as soon as it arrives, and
        makes frame 0 with a decode step once its first text row is usable (scheduler.py). `kv`: the
        KV pool (default: room for `max_active` sequences of `max_len` positions). `frame_seconds`:
        the audio one frame makes (code2wav's samples per frame / sample rate; the released codec's
        is 80 ms), for the streams' playback clocks."""
        super().__init__(max_active)
        if kv is None:
            kv = KVPlan(blocks=-(-max_active * max_len // KVPlan.block_size))
        self.cfg, self.device, self.max_len = cfg, device, max_len
        self.frame_seconds = frame_seconds
        self.slack_gauges = metrics.SlackGauges(self.name)
        metrics.PLAYBACK_REPORTS.labels(self.name)
        self.scheduler = TalkerScheduler(prefill_batch, prefill_tokens, early=early_prefill)
        self.runner = TalkerRunner(model, cfg, device=device, max_active=max_active, max_len=max_len, kv=kv,
                                   cuda_graphs=cuda_graphs, prefill_batch=prefill_batch,
                                   prefill_graph_len=prefill_graph_len, eager_fallback=eager_fallback,
                                   text_table=text_table, prefill_tokens=prefill_tokens)

    # ---- inputs from the handler
    def prepare(self) -> None:
        """On the engine thread, before serving: the runner's warm-up again (it ran at build, on the
        thread that built it). The eager paths it covers are served from this thread, and what a
        library keeps per thread (cuBLAS / cuBLASLt handles and their workspaces, cuDNN handles) is
        made here, at start, not by a request's first eager prefill."""
        if self.runner.warmed:
            self.runner.warm_up(self.runner.warm_len)

    def hold(self, job: TalkerJob) -> None:
        """A prompt whose audio rows follow: keep its cached prefix now (TalkerRunner.hold)."""
        with self.lock:
            self.runner.hold(job)
        log.info("request %s: holds %d of %d user rows (%d audio rows not sent); %d cacheable", job.request_id,
                 job.held_rows, job.user_mm_mask.shape[0], job.held_audio, job.cacheable)

    def add_audio_rows(self, job: TalkerJob, first: int, rows: torch.Tensor) -> None:
        """The multimodal user rows from index `first` (= job.held_audio) on; those before are in the
        blocks it holds (their rows are never read: zeros)."""
        full = all_audio_rows(first, rows)
        with self.lock:
            job.audio_rows = full
            self.lock.notify_all()

    def add_rows(self, job: TalkerJob, rows: torch.Tensor, more: bool = False) -> None:
        """`rows`: [n, H] thinker-space rows, or [n] int64 token ids (TextRows without rows: the runner
        looks them up). `more`: the reply surely goes on after these rows (TextRows.more): all of them
        are spoken."""
        with self.lock:
            job.rows.extend(rows.unbind(0))
            if more:
                job.spoken = len(job.rows)
            self.lock.notify_all()

    def end_text(self, job: TalkerJob) -> None:
        with self.lock:
            job.text_done = True
            self.lock.notify_all()

    def report_playback(self, job: TalkerJob, played: float, delivered: float) -> None:
        """Where the request's listener is, as its code2wav reports (Code2WavResponse.playback)."""
        with self.lock:
            job.playback.report(played, delivered, time.monotonic())
        metrics.PLAYBACK_REPORTS.labels(self.name).inc()

    # ---- the loop's hooks
    def has_work(self) -> bool:
        headroom = self.runner.blocks_needed(self.running)
        return self.scheduler.has_work(self._complete(), self.running, self.runner.free_slots,
                                       lambda s: self.runner.fits(s, headroom))

    def _complete(self) -> list[TalkerJob]:
        """The waiting requests whose prompts are whole (audio_rows_follow: once the rows came)."""
        return [j for j in self.waiting if j.prompt_complete]

    def release(self, req: TalkerJob) -> None:
        self.runner.release(req)
        self.runner.observe_kv()    # a request cancelled while nothing else runs: no step follows to say so

    def _set_gauges(self) -> None:
        super()._set_gauges()
        self.slack_gauges.update((*self.waiting, *self.running), time.monotonic())

    @torch.inference_mode()
    def step(self) -> None:
        with self.lock:
            # admissions leave free the blocks the running requests' next decode step takes
            headroom = self.runner.blocks_needed(self.running)
            plan = self.scheduler.schedule(self._complete(), self.running, self.runner.free_slots, time.monotonic(),
                                           lambda s: self.runner.allocate(s, headroom))
            for job in plan.unspeakable:     # the thinker gave it nothing to say
                self.finish(job, Finished(FinishReason.STOP))
            for job in plan.prefill:
                if not job.resumed:
                    job.early = any(job is e for e in plan.early)
                if job.started is None:
                    job.mark_started()
                self.running.append(job)
                self.waiting.remove(job)
            decode = self._with_blocks(plan.decode, plan.prefill)   # a victim admitted now leaves the prefill
            text_rows = [job.next_text_row() for job in decode]
        if not plan.prefill and not decode:
            return
        if plan.prefill:
            metrics.PREFILL_BATCH.labels(self.name).observe(len(plan.prefill))
        jobs, logits, hidden = self.runner.forward(plan.prefill, decode, text_rows)
        if jobs:
            self._output(jobs, logits, hidden)
        self.runner.observe_kv()

    def _progress(self, req: TalkerJob) -> str:
        return f"{len(req.codes0)} frames"

    # ---- the output step
    def _output(self, jobs: list[TalkerJob], logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Code 0 and then the whole frame of each row; stop checks; each frame that goes on out."""
        ban = [len(j.codes0) < j.min_frames for j in jobs]   # EOS not allowed yet
        frames = self.runner.frames(jobs, logits, hidden, ban)
        going = []
        for i in self._advance(jobs, frames.codes[:, 0].tolist(), frames.code0_usable):
            if frames.usable[i]:
                going.append(i)
            else:
                self._fail_nonfinite(jobs[i], "code predictor logits")
        self._emit(jobs, going, frames)

    def _emit(self, jobs: list[TalkerJob], going: list[int], frames: Frames) -> None:
        """Each jobs[i] for i in `going` gets row i of `frames`: its next input, and the frame out."""
        now = time.monotonic()
        with self.lock:
            for i in going:
                jobs[i].pending = frames.next_inputs[i]
                clock = jobs[i].playback
                before = clock.underruns
                clock.emit(self.frame_seconds, now)
                metrics.count_underruns(self.name, clock, before)
        for i in going:       # a finite frame: its prompt's keys are finite, their user-row blocks findable
            self.runner.publish(jobs[i])
        for i in going:
            job = jobs[i]
            job.mark_output()
            job.outbox.put(FramesOut(job.frames_sent, frames.codes[i:i + 1]))
            job.frames_sent += 1

    def _fail_nonfinite(self, job: TalkerJob, what: str) -> None:
        """Finish `job` alone with a clear error; nothing it left on the device reaches a later
        request (TalkerRunner.scrub)."""
        self.runner.scrub(job)
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
                self.finish(job, Finished(FinishReason.STOP, completion_tokens=job.frames_sent,
                                          cached_tokens=job.cached_tokens))
            elif len(job.codes0) >= job.max_frames or job.frames_sent >= job.frame_cap():
                self.finish(job, Finished(FinishReason.LENGTH, completion_tokens=job.frames_sent,
                                          cached_tokens=job.cached_tokens))
            else:
                framing.append(i)
        return framing
