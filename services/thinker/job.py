"""A thinker request as its engine and runner see it (the scheduler reads it through its Protocol,
scheduler.Request). Its own module, so that the engine and the runner both import it and neither
imports the other."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from voxpipe.v1 import stages_pb2 as pb

from ..runtime.block_pool import BlockTable, ContentSpan
from ..runtime.engine import EngineRequest
from ..runtime.sampling import SamplingParams
from .constraint import Constraint
from .output import ReplyText, StreamText

if TYPE_CHECKING:
    from .grammar import Matcher
    from .streamed import StreamedClip


@dataclass(frozen=True)
class ForcedReply:
    """A reply given in advance (ThinkerStart.assistant_text): the thinker emits it instead of sampling."""
    token_ids: list[int]     # the text's tokens, then the end-of-turn token
    text: str                # verbatim, as the client sent it


@dataclass(frozen=True)
class ChunkAttended:
    """One chunk of a job's chunked prefill: its new tokens start .. start + length - 1 and the attention
    its first layer took ("cudnn": the two-part path planned at start; "flash"; "paged": the paged
    kernel; "extend graph"; "sdpa": off CUDA / 16 bits, or the batch-invariant mode)."""
    start: int
    length: int
    path: str


@dataclass
class ThinkerJob(EngineRequest):
    prompt: list[int] = field(default_factory=list)
    audio: list[torch.Tensor] = field(default_factory=list)   # [mel, frames] each
    audio_digests: list[bytes | None] | None = None   # each clip's audio_cache.clip_key (the runner's, at its embedding)
    audio_keys: list[Future] | None = None   # the same keys being hashed since the start arrived (the servicer's)
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 0
    min_tokens: int = 0
    talker_rows: bool = False
    speech: pb.SpeechParams | None = None   # a spoken reply continues in a talker (see relay.py)
    stops: tuple[str, ...] = ()             # stop strings (see output.py)
    unspoken: tuple[str, ...] = ()          # where the talker's text ends (tool-call markup; output.py)
    top_logprobs: int | None = None         # None: no log probabilities; else how many alternatives
    forced: ForcedReply | None = None       # the reply is given: emitted whole after the prefill
    table: BlockTable | None = None         # its KV blocks while admitted (runner.allocate)
    spans: tuple[ContentSpan, ...] = ()     # its audio clips' placeholder positions and content digests
    constraint: Constraint | None = None    # constrained decoding (ThinkerStart.constraint)
    matcher: Matcher | None = None          # its grammar state: set at admission (compiled off the engine thread)
    generated: list[int] = field(default_factory=list)
    opened: int = 0                         # reply tokens its grammar forced before any was sampled
                                            # (ThinkerEngine.open_reply): out at once, before its
                                            # admission, then prefilled with the prompt
    opening: ReplyText | None = None        # the text state that sent them (job.text from the first token)
    ahead: int = 0                          # reply tokens forced by its grammar after the last one sampled
                                            # (engine._jump): without keys, like that one, until the next
                                            # step feeds them all (runner.feed)
    draft: list[int] = field(default_factory=list)   # tokens drafted after the last one (engine._draft:
                                            # the grammar's forced text as the tokenizer spells it), fed
                                            # with the next step and accepted while the model's own
                                            # choice equals them; no keys, never part of `generated`
    generator: torch.Generator | None = None
    text: ReplyText | None = None           # its tokens on their way out (the engine's; made at the first token)
    stream_text: StreamText | None = None   # the text the engine left out (the servicer's, on the event loop)
    prefilled: int = 0                          # context tokens in the KV cache (the scheduler reads it)
    prefill_target: int = 0                     # context tokens its prefill must reach before it decodes:
                                                # the prompt; after a preemption the prompt and the reply
                                                # but its last token (recomputed, not sampled again)
    cached_tokens: int = 0                      # of the prompt, taken from the prefix cache at admission
    kept_from: int = 0                          # the first position whose hidden layer `kept` holds
    prompt_sent: bool = False                   # its TalkerPromptOut went out at admission (a text prompt)
    audio_follow: bool = False                  # ... without its audio rows (audio_rows_follow): they go after the prefill
    embeds: torch.Tensor | None = None          # [P - embeds_from, H] while a chunked prefill runs
    embeds_from: int = 0                        # the first position `embeds` holds (a text prompt's cached prefix is skipped)
    kept: list[torch.Tensor] = field(default_factory=list)   # per chunk: the talker's hidden layer
    # the talker's hidden rows of its prompt's cached audio blocks (runner.AudioRowCache), by block index
    cached_rows: dict[int, torch.Tensor] = field(default_factory=dict)
    # rows its prefill made for blocks not yet published: (block index, rows), cached once published
    pending_rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    chunks: list[ChunkAttended] = field(default_factory=list)   # its chunked prefill's chunks, in order
    kv_trusted: bool = True                     # False once its numbers went non-finite (its blocks unpublished)
    # a turn whose last clip is streamed (ThinkerStart.stream_audio; streaming.py)
    pending: bool = False                       # before its commit: prefilled as its audio arrives, never decodes
    streamed: StreamedClip | None = None        # that clip: its frames and encoded windows (the engine thread's)
    heard: list[torch.Tensor] = field(default_factory=list)   # frames received, not yet in `streamed` (engine lock)
    stream_start: int = 0                       # where the clip's placeholders begin in the prompt
    adopts: ThinkerJob | None = None            # a committed turn: the pending job whose KV and state it takes
    streamed_tokens: int = 0                    # of the prompt, positions with keys when the commit came
    session: str | None = None                  # the caller's session (calls.SESSION_METADATA): its talker pick
    # its repetition penalty's ids (runner.seen_ids): [V] bool on the device, for the prompt list it was
    # made of, with the first `seen_upto` reply tokens marked
    seen: tuple[list[int], torch.Tensor] | None = field(default=None, repr=False, compare=False)
    seen_upto: int = 0
    # the prompt as int64 ids, and the prompt list they were made of (prompt_ids)
    ids_cache: tuple[list[int], np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.prefill_target:
            self.prefill_target = len(self.prompt)

    def prompt_ids(self) -> np.ndarray:
        """The prompt as an int64 array [P], made once per prompt (`prompt` is replaced, never changed
        in place: a streamed turn's grows into a new list); never written by its users."""
        cache = self.ids_cache
        if cache is None or cache[0] is not self.prompt:
            cache = self.ids_cache = (self.prompt, np.fromiter(self.prompt, dtype=np.int64, count=len(self.prompt)))
        return cache[1]

    def context_ids(self) -> np.ndarray:
        """context() as an int64 array (the prompt's own, without a reply to recompute)."""
        reply = self.generated[:self.prefill_target - len(self.prompt)]
        if not reply:
            return self.prompt_ids()
        return np.concatenate((self.prompt_ids(), np.asarray(reply, dtype=np.int64)))

    def context(self) -> list[int]:
        """The token ids its prefill covers: the prompt, and after a preemption the reply so far but
        its last token."""
        return self.prompt + self.generated[:self.prefill_target - len(self.prompt)]

    @property
    def kv_tokens(self) -> int:
        """Positions whose keys are in its blocks: what its prefill wrote, then one per decode step,
        and a forced run's once fed (a given reply is emitted whole after the prefill: none of its
        tokens has keys)."""
        if self.prefilled < self.prefill_target or self.forced is not None:
            return self.prefilled
        return len(self.prompt) + max(len(self.generated) - 1 - self.ahead, 0)
