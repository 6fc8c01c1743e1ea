"""Code2Wav scheduler: which utterances take a decoder slot, and how many of its waiting frames each
running utterance decodes in the next step. Pure Python (no tensors, no model); the engine applies
the schedule, the runner decodes.

An utterance's chunk is due once `need` frames wait (first_chunk_frames before its first audio,
chunk_frames after) or its frames ended. A step decodes at most max(MAX_FRAMES_PER_STEP, need)
frames of it; what a due chunk still holds after such a capped step is owed, and the next steps
decode it without waiting for `need` more frames. An utterance whose outbox is saturated (a slow
reader) sits out, its state unchanged, and so does one seconds ahead of its listener while another
is nearly dry (services/runtime/playback.py: a bounded number of steps in a row)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ..runtime.playback import DeadlinePolicy, PlaybackClock

# frames per utterance per step (or the utterance's chunk size, if larger): bounds the rounds of a step,
# so an utterance that starts now gets its first chunk after a few rounds even while others work off a
# backlog (a step sends at its end)
MAX_FRAMES_PER_STEP = 4


class Reader(Protocol):
    saturated: bool


class Utterance(Protocol):
    """What the scheduler reads of a request (services.code2wav.engine.Code2WavJob)."""

    first_chunk_frames: int
    chunk_frames: int
    frames: Sequence[object]     # frames received and not yet decoded, oldest first
    frames_end: bool             # no more frames will come
    frames_decoded: int
    owed: int                    # frames of a due chunk not decoded yet (the scheduler's own count)
    outbox: Reader
    playback: PlaybackClock      # its listener as this stage sees it (slack)
    skips: int                   # steps sat out in a row (DeadlinePolicy)


@dataclass
class Code2WavSchedule:
    admitted: list[Utterance] = field(default_factory=list)   # take a slot now, in arrival order; they step too
    decode: list[tuple[Utterance, int]] = field(default_factory=list)   # (utterance, frames it decodes now)
    finished: list[Utterance] = field(default_factory=list)   # frames ended, every one decoded: finish now


class Code2WavScheduler:
    def __init__(self, max_frames_per_step: int = MAX_FRAMES_PER_STEP, policy: DeadlinePolicy | None = None) -> None:
        self.max_frames_per_step, self.policy = max_frames_per_step, policy or DeadlinePolicy()

    def has_work(self, waiting: Sequence[Utterance], running: Sequence[Utterance], free_slots: int) -> bool:
        if waiting and free_slots > 0:
            return True
        return any((self.ready_frames(u) and not u.outbox.saturated) or self._ended(u) for u in running)

    def schedule(self, waiting: Sequence[Utterance], running: Sequence[Utterance], free_slots: int,
                 now: float) -> Code2WavSchedule:
        """The next step, with the policy's pick at `now` (the playback clocks' time). It commits:
        the engine takes each scheduled utterance's frames at once (`owed` already counts them as
        taken); an utterance that sits out keeps its state."""
        plan = Code2WavSchedule(admitted=list(waiting[:max(free_slots, 0)]))
        ready: dict[int, int] = {}
        candidates = []
        for u in [*running, *plan.admitted]:
            n = 0 if u.outbox.saturated else self.ready_frames(u)
            if n:
                ready[id(u)] = n
                candidates.append(u)
            elif self._ended(u):
                plan.finished.append(u)
        for u in self.policy.pick(candidates, now)[0]:
            n = ready[id(u)]
            u.owed = (len(u.frames) if self._due(u) else u.owed) - n
            plan.decode.append((u, n))
        return plan

    def ready_frames(self, u: Utterance) -> int:
        """Frames the next step decodes for `u` (0: it waits for more): all that wait when a chunk
        is due, else what is still owed of one; at most max(MAX_FRAMES_PER_STEP, need)."""
        return min(len(u.frames) if self._due(u) else u.owed, max(self.max_frames_per_step, self._need(u)))

    @staticmethod
    def _need(u: Utterance) -> int:
        return u.first_chunk_frames if u.frames_decoded == 0 else u.chunk_frames

    def _due(self, u: Utterance) -> bool:
        n = len(u.frames)
        return n >= self._need(u) or (u.frames_end and n > 0)

    @staticmethod
    def _ended(u: Utterance) -> bool:
        return u.frames_end and not u.frames
