"""A thinker request as its engine and runner see it (the scheduler reads it through its Protocol,
scheduler.Request). Its own module, so that the engine and the runner both import it and neither
imports the other."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.engine import EngineRequest
from ..runtime.sampling import SamplingParams
from .output import ReplyText, StreamText


@dataclass(frozen=True)
class ForcedReply:
    """A reply given in advance (ThinkerStart.assistant_text): the thinker emits it instead of sampling."""
    token_ids: list[int]     # the text's tokens, then the end-of-turn token
    text: str                # verbatim, as the client sent it


@dataclass
class ThinkerJob(EngineRequest):
    prompt: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)   # [mel, frames] each
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 0
    min_tokens: int = 0
    talker_rows: bool = False
    speech: pb.SpeechParams | None = None   # a spoken reply continues in a talker (see relay.py)
    stops: tuple[str, ...] = ()             # stop strings (see output.py)
    unspoken: tuple[str, ...] = ()          # where the talker's text ends (tool-call markup; output.py)
    top_logprobs: int | None = None         # None: no log probabilities; else how many alternatives
    forced: ForcedReply | None = None       # the reply is given: emitted whole after the prefill
    slot: int | None = None
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    text: ReplyText | None = None           # its tokens on their way out (the engine's; made at the first token)
    stream_text: StreamText | None = None   # the text the engine left out (the servicer's, on the event loop)
    prefilled: int = 0                          # prompt tokens in the KV cache (the scheduler reads it)
    prompt_sent: bool = False                   # its TalkerPromptOut went out at admission (a text prompt)
    embeds: torch.Tensor | None = None          # [P, H] while a chunked prefill runs
    kept: list[torch.Tensor] = field(default_factory=list)   # per chunk: the talker's hidden layer
