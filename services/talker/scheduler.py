"""Talker scheduler: which waiting requests take a KV slot and are prefilled now, and which running
requests make a frame. Pure Python (no tensors, no model); the engine applies the schedule, the
runner computes, the engine's output step decides what a frame means (EOS, min / max frames).

Text rows arrive while the talker runs. Row i of a request is the thinker embedding of the
(i+1)-th assistant text token; the very last token the thinker produces is never spoken, so a
row is usable only once a later row (or the end of text) has arrived, or once the thinker said
that the reply goes on after it (TextRows.more: `spoken` rows are sure). The prompt ends with row 0;
the step that makes frame k (k >= 1) reads text row k, then tts_eos once past the text, then
tts_pad: a request whose row is not there yet simply sits out that step.

Only the prompt's last row is the reply's (row 0); the rest (the user turns, the assistant head,
tts_pad and tts_bos) is known when the request arrives. With `early` prefill a request whose row 0
is not usable yet takes a slot and prefills all but that last row while the thinker still works;
its frame 0 is then a decode step like any later frame, which reads row 0 (TalkerJob.early).

Decode rows are picked by playback deadline (services/runtime/playback.py): while a playing stream
is nearly dry, streams seconds ahead of their listeners sit the step out (a bounded number of steps
in a row) so that the step is shorter for the others (the code predictor's 15 passes run only for
the rows that decode); otherwise every ready row steps.

KV memory: a request is admitted only once `reserve(request)` gave it the KV blocks of its prompt
(the engine's block manager); the first candidate that gets none stops admission for this step. A
request preempted for lack of blocks (`resumed`) waits again, first in line, and recomputes its
positions before it decodes on."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from collections.abc import Callable
from typing import Protocol, Sequence

from ..runtime.playback import DeadlinePolicy, PlaybackClock

PROMPT_TAIL = 9   # prompt rows after the user turns: assistant head (3), 4 x tts_pad, tts_bos, first text row


class TextRow(Enum):
    """What the text side of a talker input is."""

    ROW = "row"      # a text row, usable
    EOS = "eos"      # tts_eos: the text ended just before
    PAD = "pad"      # tts_pad: past the text
    WAIT = "wait"    # not known yet: the next row (or the end of text) has not arrived


def text_row(rows: int, text_done: bool, i: int, spoken: int = 0) -> TextRow:
    """The text side of the input that reads row `i`, for a request that has `rows` rows so far, of
    which the first `spoken` are known to be followed by more text."""
    if i < rows - 1 or i < spoken:
        return TextRow.ROW
    if not text_done:
        return TextRow.WAIT
    return TextRow.EOS if i == rows - 1 else TextRow.PAD


class Reader(Protocol):
    saturated: bool


class Speech(Protocol):
    """What the scheduler reads of a request (services.talker.job.TalkerJob)."""

    rows: Sequence[object]       # thinker text rows so far
    text_done: bool              # no more rows will come
    spoken: int                  # the first `spoken` rows are surely spoken (the reply went on after them)
    codes0: Sequence[int]        # code 0 of each frame made so far
    pending: object | None       # its next input (without the text row); None until its last step's output is in
    prompt_rows: int             # rows of its prompt
    early: bool                  # prefilled without its last row: frame 0 comes from a decode step
    resumed: bool                # preempted: it recomputes its positions when admitted again
    outbox: Reader
    playback: PlaybackClock      # its listener as this stage sees it (slack)
    skips: int                   # decode steps sat out in a row (DeadlinePolicy)


@dataclass
class TalkerSchedule:
    unspeakable: list[Speech] = field(default_factory=list)   # text ended before a usable row: finish now (STOP)
    prefill: list[Speech] = field(default_factory=list)       # take a slot and prefill now (see schedule)
    early: list[Speech] = field(default_factory=list)         # those of `prefill` that prefill without row 0
    decode: list[Speech] = field(default_factory=list)        # running requests that make their next frame now
    sat_out: list[Speech] = field(default_factory=list)       # ready, but seconds ahead while another is nearly dry


class TalkerScheduler:
    def __init__(self, prefill_batch: int, prefill_tokens: int, early: bool = True,
                 policy: DeadlinePolicy | None = None) -> None:
        """A step prefills up to `prefill_batch` requests whose padded prompts (the longest prompt
        times the requests) stay within `prefill_tokens` rows; one request always fits. `early`: a
        request may prefill before its first text row is usable (all but the prompt's last row).
        `policy`: which ready rows decode in a step, by their listeners' slack."""
        self.prefill_batch, self.prefill_tokens, self.early = prefill_batch, prefill_tokens, early
        self.policy = policy or DeadlinePolicy()

    def has_work(self, waiting: Sequence[Speech], running: Sequence[Speech], free_slots: int,
                 fits: Callable[[Speech], bool] = lambda s: True) -> bool:
        """`fits(s)`: whether the KV blocks for waiting request s are free now (nothing taken)."""
        if any(self.decode_ready(s) or self.unspeakable(s) for s in running):
            return True
        ready, unspeakable = self._candidates(waiting)
        return bool(unspeakable) or free_slots > 0 and bool(ready) and fits(ready[0][0])

    def _candidates(self, waiting: Sequence[Speech]) -> tuple[list[tuple[Speech, bool]], list[Speech]]:
        """The waiting requests that may prefill now, in admission order, each with whether it
        prefills early; and those whose text ended before a usable row."""
        ready, unspeakable = [], []
        for s in waiting:
            state = text_row(len(s.rows), s.text_done, 0, s.spoken)
            if s.resumed or state == TextRow.ROW or state == TextRow.WAIT and self.early:
                ready.append((s, state == TextRow.WAIT and not s.resumed))
            elif state != TextRow.WAIT:
                unspeakable.append(s)
        ready.sort(key=lambda r: r[1])            # stable: usable first row, then early
        return ready, unspeakable

    def schedule(self, waiting: Sequence[Speech], running: Sequence[Speech], free_slots: int, now: float,
                 reserve: Callable[[Speech], bool] = lambda s: True) -> TalkerSchedule:
        """Prefills go to the requests whose first row is usable first, then to early ones (still
        waiting for their text), each in arrival order: a free slot never goes to a request that can
        only wait in it while one that could speak now waits for a slot. Decode rows: those ready,
        picked by the policy at `now` (the playback clocks' time). `reserve(s)`: give waiting
        request s its KV blocks (True), or take nothing (False)."""
        plan = TalkerSchedule(unspeakable=[s for s in running if self.unspeakable(s)])
        decodable = [s for s in running if self.decode_ready(s) and not self.unspeakable(s)]
        plan.decode, plan.sat_out = self.policy.pick(decodable, now)
        ready, unspeakable = self._candidates(waiting)
        plan.unspeakable += unspeakable
        longest = 0
        for s, early in ready[:min(self.prefill_batch, free_slots)]:
            if plan.prefill and max(longest, s.prompt_rows) * (len(plan.prefill) + 1) > self.prefill_tokens:
                break
            if not reserve(s):
                break
            plan.prefill.append(s)
            if early:
                plan.early.append(s)
            longest = max(longest, s.prompt_rows)
        return plan

    def prefill_ready(self, s: Speech) -> bool:
        """It may prefill now: its first text row is usable, or its text ended (it finishes unspoken),
        or (early prefill) always: its prompt came with it."""
        return self.early or s.resumed or text_row(len(s.rows), s.text_done, 0, s.spoken) != TextRow.WAIT

    @staticmethod
    def unspeakable(s: Speech) -> bool:
        """An early-prefilled request whose text ended before a usable row: nothing to say."""
        return s.early and not s.codes0 and text_row(len(s.rows), s.text_done, 0, s.spoken) in (TextRow.EOS,
                                                                                                 TextRow.PAD)

    @staticmethod
    def decode_ready(s: Speech) -> bool:
        """Its next input and the text row that goes with it are there, and its reader keeps up."""
        return (s.pending is not None and not s.outbox.saturated
                and text_row(len(s.rows), s.text_done, len(s.codes0), s.spoken) != TextRow.WAIT)
