"""What the stage engines put in a request's outbox: small dataclasses holding host arrays.
Protobuf is built from them only in the servicers (`StageServicer.to_proto`), on the event loop.

A request's outbox carries its outputs in order, then exactly one last item: a `Finished`, or a
`services.runtime.engine.StageError`. This module imports neither torch nor protobuf."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch


class FinishReason(IntEnum):
    """Why a request ended; the values are voxpipe.v1.FinishReason's."""

    UNSPECIFIED = 0
    STOP = 1         # end-of-sequence (text EOS, codec EOS) or end of input
    LENGTH = 2       # max_tokens / max_frames reached
    CANCELLED = 3    # the client cancelled


@dataclass(frozen=True)
class Finished:
    """A request's last output. completion_tokens: thinker text tokens, talker codec frames,
    code2wav frames decoded."""

    reason: FinishReason
    prompt_tokens: int = 0
    completion_tokens: int = 0
    samples: int = 0                 # code2wav: audio samples sent
    cached_tokens: int = 0           # prompt tokens (thinker) / rows (talker) whose prefill the prefix cache skipped
    streamed_tokens: int = 0         # thinker, a streamed turn: prompt tokens with keys at its commit


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log probability and its most likely alternatives, most likely first (the
    servicer adds each id's bytes)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()     # (token id, log probability)


@dataclass(frozen=True)
class TextOut:
    """Consecutive generated tokens of one reply (the thinker's output): ids, text, talker rows."""

    index: int                       # the first token's index among the reply's tokens
    token_ids: tuple[int, ...]
    # the text that became final with them; None: not made on the engine thread (a reply without stop
    # strings): the servicer detokenizes the stream's tokens in order (services/thinker/output.py)
    text: str | None
    rows: "torch.Tensor | None" = None   # [n, H] on the host: their talker rows (talker_rows)
    logprobs: tuple[TokenLogprob, ...] = ()   # one per token, when asked
    more: bool = False   # the reply surely goes on after these tokens (TextRows.more: their last row is spoken)
    last: bool = False   # the reply ends with these tokens: text held back (a split character) goes out now
    # the talker's text ends with these tokens (a tool call begins: ThinkerStart.unspoken_tool_calls):
    # their last row is the talker's last (unspoken) row; later outputs carry no rows
    talker_end: bool = False

    @property
    def count(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class TalkerPromptOut:
    """What the talker needs from the prompt (the thinker's first output with talker rows; the
    fields of voxpipe.v1.TalkerPrompt), on the host."""

    # [U, H] text tokens' input embeddings; audio: the accept_hidden_layer rows. None: every user row is a
    # text token's embedding, which the talker looks up from user_token_ids itself (a text prompt's, sent
    # to a talker: ids instead of 10 MB of rows for a long conversation)
    user_rows: "torch.Tensor | None"
    user_mm_mask: "torch.Tensor"     # [U] bool, true where the row is a multimodal hidden state
    user_token_ids: "torch.Tensor"   # [U] int64
    assistant_head: "torch.Tensor"   # [3, H] "<|im_start|>", "assistant", "\n"
    assistant_prefix: "torch.Tensor"   # [A, H] prompt tokens after the head (usually A = 0)
    tts_special: "torch.Tensor"      # [3, H] tts_bos, tts_eos, tts_pad
    audio_rows: "torch.Tensor | None" = None   # [M, H] with user_rows None: the multimodal user rows alone
    audio_keys: tuple[bytes, ...] = ()         # per run of multimodal user rows: its content key (row_keys.py)
    audio_rows_follow: bool = False            # audio_rows come later (TalkerAudioRowsOut), once the talker said what it holds


@dataclass(frozen=True)
class TalkerAudioRowsOut:
    """A prompt's multimodal user rows [M, H] (on the host), after its prefill, for a talker prompt
    sent with audio_rows_follow: the relay sends the talker those past the prefix it holds."""

    rows: "torch.Tensor"


@dataclass(frozen=True)
class HeldOut:
    """The talker's answer to a prompt with audio_rows_follow (voxpipe.v1.Held): the leading user rows
    whose KV it holds for the request, and how many of them are multimodal."""

    user_rows: int
    audio_rows: int


@dataclass(frozen=True)
class FramesOut:
    """Consecutive codec frames of one utterance (the talker's output; code2wav's debug echo of
    the frames it received)."""

    index: int                       # the first frame's index in the utterance
    codes: "torch.Tensor"            # [n, num_code_groups] on the host: uint16 (an echo: as received)

    @property
    def count(self) -> int:
        return self.codes.shape[0]


@dataclass(frozen=True)
class AudioOut:
    """Consecutive samples of one utterance (code2wav's output), before their wire encoding."""

    sample_offset: int               # the first sample's index in the utterance
    samples: "np.ndarray"            # [n] float32 in [-1, 1]


@dataclass(frozen=True)
class Routed:
    """The next stage holds the request on `address` (a relay's report for the caller)."""

    stage: str
    address: str
    listen_token: str = ""           # code2wav: the one-use token of its Listen stream


@dataclass(frozen=True)
class FirstOutput:
    """`stage` made its first output (a relay's report for the caller)."""

    stage: str


@dataclass(frozen=True)
class StageFinished:
    """The next stage finished its part of the request (a relay's report for the caller)."""

    stage: str
    finished: Finished
