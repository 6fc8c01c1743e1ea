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
