"""The code2wav, talker and thinker schedulers on their own: synthetic requests, no model, no tensors, no
torch import. Each test steps a scheduler as its engine does (admitted requests start running,
finished ones leave, a decoded step's frames are consumed and counted) and checks its decisions
step by step."""

from __future__ import annotations

from dataclasses import dataclass, field

from voxpipe.services.code2wav.scheduler import MAX_FRAMES_PER_STEP, Code2WavScheduler
from voxpipe.services.runtime.playback import PlaybackClock
from voxpipe.services.talker.scheduler import PROMPT_TAIL, TalkerScheduler, TextRow, text_row
from voxpipe.services.thinker.scheduler import ThinkerScheduler


@dataclass(eq=False)
class Reader:
    saturated: bool = False


# ---------------------------------------------------------------------------------------------- code2wav


@dataclass(eq=False)
class Utterance:
    name: str
    first_chunk_frames: int = 1
    chunk_frames: int = 1
    frames: list[int] = field(default_factory=list)
    frames_end: bool = False
    frames_decoded: int = 0
    owed: int = 0
    outbox: Reader = field(default_factory=Reader)
    playback: PlaybackClock = field(default_factory=PlaybackClock)
    skips: int = 0

    def add(self, n: int, end: bool = False) -> None:
        self.frames.extend(range(len(self.frames), len(self.frames) + n))
        self.frames_end = self.frames_end or end


class Code2WavStage:
    """The engine's bookkeeping around Code2WavScheduler, with `slots` decoder slots."""

    def __init__(self, slots: int) -> None:
        self.scheduler = Code2WavScheduler()
        self.now = 0.0          # the fake clock the playback clocks run on
        self.slots = slots
        self.waiting: list[Utterance] = []
        self.running: list[Utterance] = []
        self.finished: list[str] = []

    def submit(self, *utterances: Utterance) -> None:
        self.waiting.extend(utterances)

    def has_work(self) -> bool:
        return self.scheduler.has_work(self.waiting, self.running, self.slots - len(self.running))

    def step(self) -> dict[str, int]:
        """One step; the frames each utterance decoded, by name (in the schedule's order)."""
        plan = self.scheduler.schedule(self.waiting, self.running, self.slots - len(self.running), self.now)
        for u in plan.admitted:
            self.waiting.remove(u)
            self.running.append(u)
        for u in plan.finished:
            self.running.remove(u)
            self.finished.append(u.name)
        decoded = {}
        for u, n in plan.decode:
            del u.frames[:n]
            u.frames_decoded += n
            decoded[u.name] = n
        return decoded


def test_code2wav_admits_in_arrival_order_as_slots_allow_and_admitted_ones_step_at_once():
    stage = Code2WavStage(slots=2)
    a, b, c = Utterance("a"), Utterance("b"), Utterance("c")
    for u in (a, b, c):
        u.add(1)
    stage.submit(a, b, c)
    assert stage.has_work()
    assert stage.step() == {"a": 1, "b": 1}
    assert [u.name for u in stage.running] == ["a", "b"] and stage.waiting == [c]
    assert not stage.has_work()                      # no slot for c, nothing left for a and b
    a.add(1, end=True)
    assert stage.step() == {"a": 1}
    assert stage.step() == {} and stage.finished == ["a"]
    assert stage.step() == {"c": 1}                  # a's slot went to c


def test_code2wav_chunk_sizes_first_then_later():
    stage = Code2WavStage(slots=1)
    u = Utterance("u", first_chunk_frames=2, chunk_frames=3)
    stage.submit(u)
    sizes = []
    for arrive in (1, 1, 1, 1, 1, 1, 1):
        u.add(arrive)
        sizes.append(stage.step().get("u", 0))
    assert sizes == [0, 2, 0, 0, 3, 0, 0]
    u.add(0, end=True)                               # the end makes the rest due, short of a chunk
    assert stage.step() == {"u": 2}
    assert stage.step() == {} and stage.finished == ["u"]


def test_code2wav_a_backlog_drains_in_capped_steps_without_waiting_for_more_frames():
    assert MAX_FRAMES_PER_STEP == 4
    stage = Code2WavStage(slots=2)
    burst, trickle = Utterance("burst", chunk_frames=6), Utterance("trickle", chunk_frames=6)
    burst.add(20)
    stage.submit(burst, trickle)
    burst_sizes, trickle_sizes = [], []
    for _ in range(14):
        trickle.add(1)
        decoded = stage.step()
        burst_sizes += [decoded["burst"]] if "burst" in decoded else []
        trickle_sizes += [decoded["trickle"]] if "trickle" in decoded else []
    assert burst_sizes == [4, 6, 6, 4]               # the first chunk capped at 4, then owed frames go on
    assert trickle_sizes == [1, 6, 6]                # first chunk 1 frame, then whole chunks of 6
    assert burst.owed == 0 and not burst.frames


def test_code2wav_a_saturated_outbox_pauses_only_its_utterance():
    stage = Code2WavStage(slots=2)
    slow, fast = Utterance("slow", chunk_frames=2), Utterance("fast", chunk_frames=2)
    stage.submit(slow, fast)
    slow.add(1)
    fast.add(1)
    assert stage.step() == {"slow": 1, "fast": 1}
    slow.add(5)
    fast.add(2)
    slow.outbox.saturated = True
    assert stage.step() == {"fast": 2}
    assert (len(slow.frames), slow.owed) == (5, 0)   # untouched while it sits out
    assert not stage.has_work()
    slow.outbox.saturated = False
    assert stage.has_work()
    assert stage.step() == {"slow": 4}               # due: 5 wait, capped at 4; 1 owed
    assert slow.owed == 1
    slow.outbox.saturated = True
    assert stage.step() == {}
    slow.outbox.saturated = False
    assert stage.step() == {"slow": 1}               # the owed frame, without waiting for a chunk
    assert not stage.has_work()


def test_code2wav_finishes_once_the_frames_ended_and_all_are_decoded():
    stage = Code2WavStage(slots=2)
    empty, late, slow = Utterance("empty"), Utterance("late", chunk_frames=4), Utterance("slow")
    empty.add(0, end=True)
    late.add(1)
    stage.submit(empty, late)
    assert stage.step() == {"late": 1}
    assert stage.finished == ["empty"]               # admitted and finished in one step: no frames at all
    late.add(2, end=True)
    assert stage.step() == {"late": 2}
    assert stage.finished == ["empty"]               # still running: its last frames went this step
    assert stage.has_work()
    assert stage.step() == {} and stage.finished == ["empty", "late"]
    slow.add(1, end=True)
    stage.submit(slow)
    assert stage.step() == {"slow": 1}
    slow.outbox.saturated = True                     # a saturated reader still gets its Finished
    assert stage.has_work()
    assert stage.step() == {} and stage.finished[-1] == "slow"
    assert not stage.running and not stage.has_work()


# ---------------------------------------------------------------------------------------------- talker


@dataclass(eq=False)
class Speech:
    name: str
    prompt_rows: int = 20
    rows: list[int] = field(default_factory=list)
    text_done: bool = False
    spoken: int = 0
    codes0: list[int] = field(default_factory=list)
    pending: object | None = None
    early: bool = False
    resumed: bool = False
    outbox: Reader = field(default_factory=Reader)
    playback: PlaybackClock = field(default_factory=PlaybackClock)
    skips: int = 0


class TalkerStage:
    """The engine's bookkeeping around TalkerScheduler, with `slots` KV slots; a step's output is
    one frame per prefilled or decoded request, whose next input is then pending."""

    def __init__(self, slots: int, prefill_batch: int = 8, prefill_tokens: int = 4096, early: bool = False) -> None:
        self.scheduler = TalkerScheduler(prefill_batch, prefill_tokens, early)
        self.now = 0.0          # the fake clock the playback clocks run on
        self.slots = slots
        self.waiting: list[Speech] = []
        self.running: list[Speech] = []
        self.finished: list[str] = []

    def has_work(self) -> bool:
        return self.scheduler.has_work(self.waiting, self.running, self.slots - len(self.running))

    def step(self) -> tuple[list[str], list[str]]:
        """One step: the names prefilled, the names decoded."""
        plan = self.scheduler.schedule(self.waiting, self.running, self.slots - len(self.running), self.now)
        for s in plan.unspeakable:
            (self.waiting if s in self.waiting else self.running).remove(s)
            self.finished.append(s.name)
        for s in plan.prefill:
            self.waiting.remove(s)
            self.running.append(s)
            s.early = s in plan.early
        for s in plan.prefill + plan.decode:
            if not (s.early and s in plan.prefill):      # an early prefill makes no frame
                s.codes0.append(7)
            s.pending = object()
        return [s.name for s in plan.prefill], [s.name for s in plan.decode]


def test_text_rows_usable_only_once_a_later_row_or_the_end_arrived():
    assert [text_row(3, False, i) for i in range(4)] == [TextRow.ROW, TextRow.ROW, TextRow.WAIT, TextRow.WAIT]
    assert [text_row(3, True, i) for i in range(5)] == [TextRow.ROW, TextRow.ROW, TextRow.EOS, TextRow.PAD,
                                                       TextRow.PAD]
    assert text_row(0, True, 0) == TextRow.PAD and text_row(0, False, 0) == TextRow.WAIT
    # rows the thinker said the reply goes on after (TextRows.more) are usable at once
    assert [text_row(3, False, i, spoken=3) for i in range(4)] == [TextRow.ROW] * 3 + [TextRow.WAIT]
    assert text_row(4, True, 2, spoken=3) == TextRow.ROW and text_row(4, True, 3, spoken=3) == TextRow.EOS


def test_talker_starts_on_a_row_known_to_be_spoken():
    """With TextRows.more the first row is usable before the second arrives: the prefill (and frame
    0) one thinker step earlier; frame 1 then waits for row 1 as usual."""
    stage = TalkerStage(slots=4)
    sure, unsure = Speech("sure", rows=[0], spoken=1), Speech("unsure", rows=[0])
    stage.waiting += [sure, unsure]
    assert stage.step() == (["sure"], [])
    assert not stage.has_work()
    sure.rows.append(1)                              # sent without more: usable once row 2 or the end is in
    assert not stage.has_work()
    sure.spoken = 2
    assert stage.step() == ([], ["sure"])


def test_talker_early_prefill_takes_a_slot_before_any_row_and_frame_0_is_a_decode_step():
    """With early prefill a request prefills (all but its prompt's last row) on arrival; frame 0 is
    then a decode step once row 0 is usable, in the same step as the other rows' frames."""
    stage = TalkerStage(slots=2, early=True)
    a, b, c = Speech("a"), Speech("b", rows=[0, 1]), Speech("c")
    stage.waiting += [a, b, c]
    assert stage.has_work()
    assert stage.step() == (["b", "a"], [])          # b can speak: it goes first; c waits for a slot
    assert a.early and not b.early and a.codes0 == [] and b.codes0 == [7]
    assert not stage.has_work()                      # a's row 0 is not usable, b's row 1 neither
    a.rows += [0, 1]
    b.rows.append(2)
    assert stage.step() == ([], ["b", "a"])          # a's frame 0 and b's frame 1, one decode step
    assert a.codes0 == [7] and b.codes0 == [7, 7]
    a.rows.append(2)
    assert stage.step() == ([], ["a"])


def test_talker_slot_goes_to_a_request_that_can_speak_before_an_early_one():
    """One free slot, an early request (no text yet) ahead of one whose first row is usable: the
    slot goes to the one that can speak; the early one takes the next free slot."""
    stage = TalkerStage(slots=1, early=True)
    a, b = Speech("a"), Speech("b", rows=[0, 1])
    stage.waiting += [a, b]
    assert stage.step() == (["b"], [])
    assert stage.waiting == [a] and not b.early
    b.text_done = True
    stage.running.remove(b)                          # b finished: its slot is free
    assert stage.step() == (["a"], []) and a.early


def test_talker_early_prefilled_request_whose_text_ends_unspoken_finishes():
    stage = TalkerStage(slots=2, early=True)
    a, b = Speech("a"), Speech("b")
    stage.waiting += [a, b]
    assert stage.step() == (["a", "b"], [])
    a.rows.append(0)
    a.text_done = True                               # its only row is the last token: nothing to say
    b.text_done = True                               # no row at all
    assert stage.has_work()
    assert stage.step() == ([], []) and stage.finished == ["a", "b"] and not stage.running
    assert not stage.has_work()


def test_talker_rows_not_ready_sit_out():
    stage = TalkerStage(slots=4)
    a, b = Speech("a", rows=[0, 1]), Speech("b", rows=[0])
    stage.waiting += [a, b]
    assert stage.step() == (["a"], [])               # b's row 0 is not usable yet (no later row, no end)
    assert stage.step() == ([], [])                  # a made frame 0; frame 1 needs row 1, usable once row 2 is in
    assert not stage.has_work()
    a.rows.append(2)
    b.rows.append(1)
    assert stage.has_work()
    assert stage.step() == (["b"], ["a"])
    a.text_done = True                               # a's row 2 is its last token (never spoken): tts_eos, then tts_pad
    assert stage.step() == ([], ["a"])
    assert stage.step() == ([], ["a"])
    assert stage.step() == ([], ["a"])
    assert len(a.codes0) == 5 and len(b.codes0) == 1   # b waits for row 1's successor
    a.pending = None                                 # a's next input is not back yet: it sits out too
    assert stage.step() == ([], []) and not stage.has_work()


def test_talker_a_saturated_outbox_sits_out():
    stage = TalkerStage(slots=2)
    a, b = Speech("a", rows=[0, 1, 2], text_done=True), Speech("b", rows=[0, 1, 2], text_done=True)
    stage.waiting += [a, b]
    assert stage.step() == (["a", "b"], [])
    a.outbox.saturated = True
    assert stage.step() == ([], ["b"])
    b.outbox.saturated = True
    assert not stage.has_work()
    a.outbox.saturated = False
    assert stage.step() == ([], ["a"])


def test_talker_admits_ready_requests_in_arrival_order_within_batch_and_slots():
    stage = TalkerStage(slots=3, prefill_batch=2)
    speeches = [Speech(n, rows=[0, 1], text_done=True) for n in "abcdef"]
    speeches[1] = Speech("b", rows=[0])              # not ready: passed over, not waited for
    stage.waiting += speeches
    assert stage.step() == (["a", "c"], [])          # the batch limit
    assert stage.step() == (["d"], ["a", "c"])       # the last free slot
    assert stage.step() == ([], ["a", "c", "d"])
    assert [s.name for s in stage.waiting] == ["b", "e", "f"]
    stage.running.remove(speeches[0])                # a's slot is free again
    assert stage.step() == (["e"], ["c", "d"])


def test_talker_prefill_keeps_the_padded_rows_within_the_budget():
    budget = 3 * (40 + PROMPT_TAIL)
    stage = TalkerStage(slots=8, prefill_tokens=budget)
    stage.waiting += [Speech(f"p{users}", prompt_rows=users + PROMPT_TAIL, rows=[0, 1])
                      for users in (10, 40, 20, 5, 30)]
    # 10, 40, 20 fit (3 x 49 rows); adding 5 would make 4 x 49 > the budget; then 5 and 30 fit together
    assert stage.step()[0] == ["p10", "p40", "p20"]
    assert stage.step()[0] == ["p5", "p30"]
    huge = Speech("huge", prompt_rows=2 * budget, rows=[0, 1])
    small = Speech("small", prompt_rows=10, rows=[0, 1])
    stage.waiting += [huge, small]
    assert stage.step()[0] == ["huge"]               # one request always fits, alone
    assert stage.step()[0] == ["small"]


def test_talker_text_that_ended_before_a_usable_row_finishes_at_once():
    stage = TalkerStage(slots=1)
    nothing = Speech("nothing", rows=[], text_done=True)
    one = Speech("one", rows=[0], text_done=True)      # its only row is the unspoken last token
    speaks = Speech("speaks", rows=[0, 1])
    stage.running.append(Speech("busy"))               # holds the only slot
    stage.waiting += [nothing, one, speaks]
    assert stage.step() == ([], [])
    assert stage.finished == ["nothing", "one"] and stage.waiting == [speaks]


# ---------------------------------------------------------------------------------------------- thinker


@dataclass(eq=False)
class Reply:
    name: str
    prompt_tokens: int = 10
    max_tokens: int = 100
    prompt: list[int] = field(init=False)
    generated: list[int] = field(default_factory=list)
    prefilled: int = 0
    prefill_target: int = 0
    pending: bool = False                # a streamed turn before its commit (prefilled in chunks, never decodes)
    outbox: Reader = field(default_factory=Reader)

    def __post_init__(self) -> None:
        self.prompt = list(range(self.prompt_tokens))
        self.prefill_target = self.prompt_tokens


class ThinkerStage:
    """The engine's bookkeeping around ThinkerScheduler, with `slots` KV slots: admitted requests
    start running, a chunk advances `prefilled`, a prefill that ends makes the first token, each
    decoded request makes its next token, a request that reached max_tokens finishes."""

    def __init__(self, slots: int, prefill_batch: int = 8, prefill_tokens: int = 4096, prefill_chunk: int = 16,
                 long_prompt: int | None = None) -> None:
        self.scheduler = ThinkerScheduler(prefill_batch, prefill_tokens, prefill_chunk, long_prompt)
        self.slots = slots
        self.waiting: list[Reply] = []
        self.running: list[Reply] = []
        self.finished: list[str] = []

    def has_work(self) -> bool:
        return self.scheduler.has_work(self.waiting, self.running, self.slots - len(self.running))

    def step(self) -> dict[str, object]:
        """One step: the names admitted, the chunks run packed (name, start, length), the names
        prefilled together and the names decoded (in the schedule's order)."""
        plan = self.scheduler.schedule(self.waiting, self.running, self.slots - len(self.running))
        for r in plan.admitted:
            self.waiting.remove(r)
            self.running.append(r)
        chunks = []
        for c in plan.chunks:
            chunks.append((c.request.name, c.start, c.length))
            c.request.prefilled = c.start + c.length
            if c.last:
                self._token(c.request)
        for r in plan.prefill:
            r.prefilled = len(r.prompt)
            self._token(r)
        decoded = [r for r in plan.decode if r in self.running]   # the engine leaves out the finished
        for r in decoded:
            self._token(r)
        return {"admitted": [r.name for r in plan.admitted], "chunks": chunks,
                "prefill": [r.name for r in plan.prefill], "decode": [r.name for r in decoded]}

    def _token(self, r: Reply) -> None:
        r.generated.append(7)
        if len(r.generated) >= r.max_tokens:
            self.running.remove(r)
            self.finished.append(r.name)


def test_thinker_admits_in_arrival_order_within_the_batch_and_the_free_slots():
    stage = ThinkerStage(slots=3, prefill_batch=2)
    stage.waiting += [Reply(n) for n in "abcde"]
    assert stage.step() == {"admitted": ["a", "b"], "chunks": [], "prefill": ["a", "b"], "decode": ["a", "b"]}
    # prefilled and decoded in one step: a first token from the prefill, the second from the decode
    assert [len(r.generated) for r in stage.running] == [2, 2]
    assert stage.step() == {"admitted": ["c"], "chunks": [], "prefill": ["c"], "decode": ["a", "b", "c"]}
    assert stage.step()["admitted"] == [] and [r.name for r in stage.waiting] == ["d", "e"]
    stage.running.remove(stage.running[1])           # b leaves: its slot goes to d, the first waiting
    assert stage.step() == {"admitted": ["d"], "chunks": [], "prefill": ["d"], "decode": ["a", "c", "d"]}


def test_thinker_prefill_keeps_the_padded_tokens_within_the_budget():
    stage = ThinkerStage(slots=8, prefill_tokens=3 * 12, prefill_chunk=64)
    stage.waiting += [Reply(f"p{n}", prompt_tokens=n) for n in (4, 12, 9, 2, 10)]
    # 4, 12, 9 fit (3 x 12 tokens padded); adding 2 would make 4 x 12; then 2 and 10 fit together
    assert stage.step()["prefill"] == ["p4", "p12", "p9"]
    assert stage.step()["prefill"] == ["p2", "p10"]
    stage.waiting += [Reply("huge", prompt_tokens=50), Reply("small", prompt_tokens=3)]
    assert stage.step()["prefill"] == ["huge"]       # one prompt always fits, alone
    assert stage.step()["prefill"] == ["small"]


def test_thinker_chunks_long_prompts_within_the_step_budget_without_holding_up_short_ones():
    stage = ThinkerStage(slots=4, prefill_chunk=16)
    long1, long2 = Reply("long1", prompt_tokens=40), Reply("long2", prompt_tokens=20)
    short1, short2 = Reply("short1", prompt_tokens=16), Reply("short2", prompt_tokens=5)
    stage.waiting += [long1, long2, short1, short2]
    # long1 takes a slot before the short ones and the step's 16 chunk tokens; long2 waits for
    # tokens, the short prompts behind it do not (16 tokens is not long: prefilled whole)
    assert stage.step() == {"admitted": ["long1", "short1", "short2"], "chunks": [("long1", 0, 16)],
                            "prefill": ["short1", "short2"], "decode": ["short1", "short2"]}
    assert stage.step() == {"admitted": [], "chunks": [("long1", 16, 16)], "prefill": [], "decode": ["short1", "short2"]}
    assert not long1.generated and [r.name for r in stage.waiting] == ["long2"]
    # long1's last chunk (8 tokens) makes its first token, and it decodes in the same step; the 8
    # tokens left in the step go to long2, admitted now and packed beside it
    assert stage.step() == {"admitted": ["long2"], "chunks": [("long1", 32, 8), ("long2", 0, 8)], "prefill": [],
                            "decode": ["short1", "short2", "long1"]}
    assert len(long1.generated) == 2 and long1.prefilled == 40
    # running requests decode in the order they were admitted
    assert stage.step() == {"admitted": [], "chunks": [("long2", 8, 12)], "prefill": [],
                            "decode": ["long1", "short1", "short2", "long2"]}
    assert stage.step()["chunks"] == [] and not stage.waiting


def test_thinker_packs_several_long_prompts_in_admission_order_up_to_the_batch():
    stage = ThinkerStage(slots=8, prefill_batch=3, prefill_chunk=100, long_prompt=10)
    longs = [Reply(f"L{i}", prompt_tokens=n) for i, n in enumerate((30, 50, 40, 20))]
    stage.waiting += longs
    # every long prompt that fits the step's 100 tokens is admitted, at most 3 in prefill at once
    assert stage.step()["chunks"] == [("L0", 0, 30), ("L1", 0, 50), ("L2", 0, 20)]
    # running ones first, in admission order; L3 waits for a place among the 3 in prefill
    assert stage.step() == {"admitted": ["L3"], "chunks": [("L2", 20, 20), ("L3", 0, 20)], "prefill": [],
                            "decode": ["L0", "L1", "L2", "L3"]}
    assert all(r.prefilled == len(r.prompt) for r in longs)


def test_thinker_a_long_prompt_takes_a_free_slot_in_arrival_order():
    stage = ThinkerStage(slots=2, prefill_chunk=8)
    busy = Reply("busy", prompt_tokens=5)
    stage.waiting.append(busy)
    stage.step()
    stage.waiting += [Reply("long", prompt_tokens=20), Reply("short", prompt_tokens=5)]
    assert stage.step() == {"admitted": ["long"], "chunks": [("long", 0, 8)], "prefill": [], "decode": ["busy"]}
    assert stage.step() == {"admitted": [], "chunks": [("long", 8, 8)], "prefill": [], "decode": ["busy"]}
    stage.running.remove(busy)                       # a slot for short: prefilled beside long's last chunk
    assert stage.step() == {"admitted": ["short"], "chunks": [("long", 16, 4)], "prefill": ["short"],
                            "decode": ["long", "short"]}


def test_thinker_a_saturated_outbox_sits_out_of_decode():
    stage = ThinkerStage(slots=4)
    a, b = Reply("a"), Reply("b")
    stage.waiting += [a, b]
    stage.step()
    a.outbox.saturated = True
    assert stage.step()["decode"] == ["b"]
    assert len(a.generated) == 2 and len(b.generated) == 3   # a's state unchanged while it sits out
    b.outbox.saturated = True
    assert not stage.has_work()                      # no reader keeps up, nothing waits
    stage.waiting.append(Reply("c"))
    assert stage.has_work()                          # a waiting request and a free slot
    assert stage.step() == {"admitted": ["c"], "chunks": [], "prefill": ["c"], "decode": ["c"]}
    a.outbox.saturated = False
    assert stage.step()["decode"] == ["a", "c"]


def test_thinker_a_request_finished_by_its_first_token_does_not_decode():
    stage = ThinkerStage(slots=2)
    one, more = Reply("one", max_tokens=1), Reply("more")
    stage.waiting += [one, more]
    assert stage.step() == {"admitted": ["one", "more"], "chunks": [], "prefill": ["one", "more"],
                            "decode": ["more"]}
    assert stage.finished == ["one"] and len(more.generated) == 2


# ---------------------------------------------------------------------------------------------- deadlines

FRAME_S = 0.08


def playing(stage, s, frames: int, for_s: float) -> None:
    """`s` made `frames` frames, the first `for_s` seconds before the stage's fake clock: its listener
    has played for_s of them (1x) and its slack is frames x 80 ms - for_s."""
    s.playback = PlaybackClock()
    s.playback.emit(FRAME_S, stage.now - for_s)
    s.playback.emit((frames - 1) * FRAME_S, stage.now - for_s)


def talker_running(stage: TalkerStage, *names: str) -> list[Speech]:
    out = []
    for name in names:
        s = Speech(name, rows=[0] * 200, spoken=200, codes0=[7] * 10, pending=object())
        stage.running.append(s)
        out.append(s)
    return out


def test_deadlines_a_nearly_dry_stream_steps_and_one_seconds_ahead_sits_out():
    stage = TalkerStage(slots=8)
    stage.now = 100.0
    ahead, dry, middle = talker_running(stage, "ahead", "dry", "middle")
    playing(stage, ahead, frames=100, for_s=3.0)      # 8 s made, 3 s played: 5 s ahead
    playing(stage, dry, frames=20, for_s=1.5)         # 1.6 s made, 1.5 s played: 0.1 s left
    playing(stage, middle, frames=30, for_s=1.0)      # 1.4 s of slack
    # the dry one first, then by slack; the one 5 s ahead sits out
    assert stage.step() == ([], ["dry", "middle"])
    assert ahead.skips == 1 and dry.skips == 0


def test_deadlines_nothing_changes_while_no_stream_is_dry():
    stage = TalkerStage(slots=8)
    stage.now = 50.0
    a, b, c = talker_running(stage, "a", "b", "c")
    playing(stage, a, frames=200, for_s=2.0)          # 14 s ahead
    playing(stage, b, frames=20, for_s=0.2)           # fresh: 1.4 s of slack
    playing(stage, c, frames=12, for_s=0.3)           # young (under 0.5 s of playback): not dry yet
    assert stage.step() == ([], ["a", "b", "c"])      # arrival order, nobody sits out
    assert a.skips == 0


def test_deadlines_no_stream_starves():
    """A stream far ahead sits out at most MAX_SKIPS steps in a row, however long another stays dry."""
    from voxpipe.services.runtime.playback import MAX_SKIPS

    stage = TalkerStage(slots=8)
    stage.now = 10.0
    ahead, dry = talker_running(stage, "ahead", "dry")
    playing(stage, ahead, frames=400, for_s=5.0)      # 27 s ahead
    playing(stage, dry, frames=13, for_s=1.0)         # 0.04 s
    stepped = []
    for _ in range(3 * (MAX_SKIPS + 1)):
        stage.now += 0.001                          # the dry one stays dry: its frames keep it at the edge
        dry.playback.emit(0.001, stage.now)
        stepped.append("ahead" in stage.step()[1])
    runs, run = [], 0
    for s in stepped:
        run = 0 if s else run + 1
        runs.append(run)
    assert max(runs) == MAX_SKIPS and stepped.count(True) == 3


def test_deadlines_first_frames_come_first():
    """Under pressure a stream without output yet (its first frame is a decode step) goes ahead of
    playing ones."""
    stage = TalkerStage(slots=8)
    stage.now = 20.0
    dry, new = talker_running(stage, "dry", "new")
    playing(stage, dry, frames=8, for_s=0.6)
    new.codes0, new.early = [], True
    assert stage.step() == ([], ["new", "dry"])


def test_deadlines_a_slow_reader_has_more_slack():
    """The listener plays only what reached it: a client that takes its audio slowly (delivered less)
    is further from dry than one assumed to play at 1x from its first packet."""
    fast, slow = PlaybackClock(), PlaybackClock(measured=True)
    t = 0.0
    for _ in range(50):                # 4 s of audio made in 4 s
        fast.emit(FRAME_S, t)
        slow.emit(FRAME_S, t)
        t += FRAME_S
    for i in range(25):                # the slow client took half of it, at half speed
        slow.deliver(FRAME_S, 2 * i * FRAME_S)
    assert fast.slack(t) < 0.1
    assert slow.slack(t) > 1.9
    assert slow.underruns > 0          # and its listener stalled waiting for it
    # a downstream report (code2wav -> talker) moves the stage's view to the listener's
    told = PlaybackClock()
    told.emit(4.0, 0.0)
    told.report(played=1.0, delivered=2.0, now=4.0)
    assert abs(told.slack(4.5) - 2.5) < 1e-6 and abs(told.slack(9.0) - 2.0) < 1e-6   # plays up to delivered
    told.report(played=float("nan"), delivered=1.0, now=5.0)                          # not a position: ignored
    assert abs(told.slack(4.5) - 2.5) < 1e-6


def test_deadlines_code2wav_dry_utterance_decodes_and_one_ahead_keeps_its_frames():
    stage = Code2WavStage(slots=4)
    stage.now = 30.0
    dry, ahead = Utterance("dry"), Utterance("ahead")
    stage.submit(dry, ahead)
    stage.step()                                      # both admitted
    stage.now += 0.1                                  # past the calm verdict of that step (RECHECK_S)
    dry.playback = PlaybackClock(measured=True)
    dry.playback.emit(1.0, stage.now - 1.0)
    dry.playback.deliver(1.0, stage.now - 1.0)        # 1 s played of 1 s: dry
    ahead.playback.emit(10.0, stage.now - 1.0)        # 9 s ahead
    dry.add(1), ahead.add(1)
    assert stage.step() == {"dry": 1}
    assert ahead.frames == [0] and ahead.skips == 1   # untouched, decoded once nobody is dry
    dry.playback.emit(5.0, stage.now)
    assert stage.step() == {"ahead": 1}

def test_thinker_a_pending_streamed_turn_is_prefilled_in_chunks_and_never_decodes():
    s = ThinkerScheduler(prefill_batch=4, prefill_tokens=4096, prefill_chunk=64)
    turn, other = Reply("turn", prompt_tokens=20), Reply("other", prompt_tokens=20)
    turn.pending = True
    plan = s.schedule([turn, other], [], free_slots=4)
    assert plan.admitted == [turn, other] and plan.prefill == [other]      # short, yet chunked: it waits for more
    assert [(c.request, c.start, c.length, c.last) for c in plan.chunks] == [(turn, 0, 20, False)]
    assert plan.decode == [other]
    turn.prefilled = 20
    assert not s.has_work([], [turn], free_slots=3)          # all it has is prefilled: nothing to do until more
    turn.prompt += [0] * 13                                   # a window's placeholders join it
    turn.prefill_target = 33
    assert s.has_work([], [turn], free_slots=3)
    plan = s.schedule([], [turn], free_slots=3)
    assert [(c.start, c.length, c.last) for c in plan.chunks] == [(20, 13, False)] and plan.decode == []
