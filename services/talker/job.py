"""A talker request as its engine and runner see it (the scheduler reads it through its Protocol,
scheduler.Speech). Its own module, so that the engine and the runner both import it and neither
imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.block_pool import BlockTable, ContentSpan
from ..runtime.engine import EngineRequest
from ..runtime.playback import PlaybackClock
from ..runtime.sampling import SamplingParams
from .scheduler import PROMPT_TAIL, TextRow, text_row

# The default bound on a spoken reply from its text (TalkerStart.text_cap unset): 10 frames
# (0.8 s) per text row plus 25 (2 s). Speech takes about 3 to 5 frames per token, so this ends
# only a reply that would not end by itself (a talker that never emits its codec EOS).
DEFAULT_TEXT_CAP = (10, 25)


@dataclass
class TalkerJob(EngineRequest):
    user_rows: torch.Tensor | None = None       # [U, thinker_hidden]; None: looked up from user_ids
    user_mm_mask: torch.Tensor | None = None    # [U] bool
    user_ids: torch.Tensor | None = None        # [U] int64: the user turns' token ids (their rows when user_rows is None)
    audio_rows: torch.Tensor | None = None      # [M, thinker_hidden]: the multimodal user rows when user_rows is None
    audio_keys: tuple[bytes, ...] = ()          # one per run of multimodal user rows (runtime/row_keys.py)
    audio_follow: bool = False  # its audio_rows come after the start (TalkerPrompt.audio_rows_follow)
    held_rows: int = 0          # leading user rows it holds from the prefix cache (answered in Held)
    held_audio: int = 0         # of those, multimodal: the audio rows it was not sent
    pinned: list[int] = field(default_factory=list)   # the held rows' blocks, referenced until it ends
    head: torch.Tensor | None = None            # [3, thinker_hidden]
    special: torch.Tensor | None = None         # [3, thinker_hidden]: tts_bos, tts_eos, tts_pad
    speaker_id: int = 0
    params: SamplingParams = field(default_factory=SamplingParams)
    max_frames: int = 0
    min_frames: int = 0
    text_cap: tuple[int, int] = DEFAULT_TEXT_CAP   # (frames per text row, base frames): see frame_cap
    code2wav: pb.Code2WavParams | None = None   # frames continue in a code2wav (see relay.py)
    # thinker-space text rows in order: [H], or a 0-dim int64 token id whose row the runner looks up
    # in the thinker's embedding table (TextRows sent as ids)
    rows: list[torch.Tensor] = field(default_factory=list)
    text_done: bool = False
    spoken: int = 0     # rows known to be spoken (TextRows.more): the reply went on after them
    slot: int | None = None     # its row of the runner's per-request state (the codec-0 ids it has made)
    table: BlockTable | None = None   # its KV blocks (runtime/block_pool.py) while admitted
    kv_trusted: bool = True     # False once its numbers went non-finite (its blocks are never published)
    keys: np.ndarray | None = None    # [prompt rows] int64: per prompt row, what it is for the prefix hashes (user token ids, then -1)
    spans: tuple[ContentSpan, ...] = ()   # its multimodal user rows' runs, keyed (row_keys.user_row_spans)
    cacheable: int = 0          # its first user rows whose content the keys name (the prefix cache covers no more)
    cached_tokens: int = 0      # prompt rows taken from the prefix cache at its first admission
    inputs: list[torch.Tensor] = field(default_factory=list)   # each decode step's input [Hk] (a recompute replays them)
    resumed: bool = False       # preempted for lack of KV blocks: waits to recompute its positions, then decodes on
    prompt_len: int = 0         # rows of its whole prompt (with the last row, also when `early`)
    early: bool = False         # prefilled without the prompt's last row (row 0's): frame 0 is a decode step
    codes0: list[int] = field(default_factory=list)
    pending: torch.Tensor | None = None         # next input without its text row [Hk]
    generator: torch.Generator | None = None
    frames_sent: int = 0
    playback: PlaybackClock = field(default_factory=PlaybackClock)   # its listener (code2wav's reports, or 1x)
    skips: int = 0              # decode steps sat out in a row (scheduler: DeadlinePolicy)

    def frame_cap(self) -> int:
        """The most frames to speak by the text (TalkerStart.text_cap) once it has ended, never below
        min_frames; while text still comes, no bound of its own (the talker trails the text rows then)."""
        if not self.text_done:
            return self.max_frames
        per_token, base = self.text_cap
        return max(per_token * len(self.rows) + base, self.min_frames)

    @property
    def prompt_rows(self) -> int:
        """Rows of its talker prompt: the user turns, then PROMPT_TAIL."""
        return self.user_mm_mask.shape[0] + PROMPT_TAIL

    @property
    def prompt_complete(self) -> bool:
        """Every prompt row it needs is here (a prompt with audio_rows_follow: once they came)."""
        return not self.audio_follow or self.audio_rows is not None

    @property
    def prefill_rows(self) -> int:
        """Prompt rows its prefill writes: all of them, or all but the last when `early`."""
        return self.prompt_rows - 1 if self.early else self.prompt_rows

    def next_position(self) -> int:
        """Where its next input goes in its KV blocks (the positions before it hold keys): frame k's input sits at prompt_len - 1 + k (frame
        0's is the prompt's last row). Just prefilled whole (frame 0 made, not yet counted), frame 1's."""
        if self.codes0 or self.early:
            return self.prompt_len - 1 + len(self.codes0)
        return self.prompt_len

    def next_text_row(self) -> torch.Tensor:
        """The thinker-space text row of its next step (the step that makes frame len(codes0))."""
        state = text_row(len(self.rows), self.text_done, len(self.codes0), self.spoken)
        if state == TextRow.ROW:
            return self.rows[len(self.codes0)]
        return self.special[1] if state == TextRow.EOS else self.special[2]
