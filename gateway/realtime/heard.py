"""A user turn heard while it is spoken: from the first audio of an utterance (server VAD's speech
start, or the first append without VAD) its samples are resampled and featurized as they come
(voxpipe.audio.ClipResampler, services/thinker/log_mel.py: both equal the whole clip's, bit for
bit, however the clip is cut) and streamed to a thinker request opened with the conversation so
far (PipelineClient.open_turn: ThinkerStart.stream_audio), which prefills it before the commit.

The response that answers the turn uses the stream only when the prompt it renders is, up to the
clip, exactly the prompt the stream was opened with (`take`): the same token ids before the clip,
the same earlier clips, and this clip last. Otherwise (the conversation or the settings changed
since: an item created, deleted or truncated, other instructions or tools, truncation) the stream
is cancelled and the turn is sent whole -- a streamed turn never answers another prompt. The
connection re-opens the stream with the new conversation when it learns of a change while the user
still speaks (`stale`). A committed turn waits for its response a bounded time (`hold`, the
gateway's --realtime-turn-hold) and no longer once the conversation before it changed: then its
stream is cancelled (the thinker frees what it held) and a later response sends the turn whole."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np
import torch

from voxpipe.audio import ClipResampler
from voxpipe.client import AudioTurn
from voxpipe.services.thinker.log_mel import LogMelStream, scale
from voxpipe.services.thinker.prompt import FEATURE_SAMPLE_RATE, ChatMessage, ChatPart, RenderedPrompt
from voxpipe.services.thinker.streamed import around_last_clip

from .events import INPUT_SAMPLE_RATE

STAND_IN_FRAMES = 100      # the clip rendered in its place: what comes before it does not depend on its length


@dataclass(frozen=True)
class TurnPrefix:
    """The rendered conversation before the clip: its token ids and its clips."""

    token_ids: list[int]
    clips: list[torch.Tensor]


async def render_prefix(render: Callable[[list[ChatMessage]], Awaitable[RenderedPrompt]],
                        messages: Callable[[ChatMessage], list[ChatMessage]], audio_token: int,
                        mel_bins: int) -> TurnPrefix:
    """`messages(user_turn)`: the prompt's messages with `user_turn` (the clip's) last, as the
    response will render them; `render`: the response's rendering."""
    stand_in = ChatMessage("user", [ChatPart(features=torch.zeros(mel_bins, STAND_IN_FRAMES))])
    rendered = await render(messages(stand_in))
    head, _ = around_last_clip(rendered.token_ids, audio_token)
    return TurnPrefix(head, list(rendered.audio_features[:-1]))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))


class HeardTurn:
    """One utterance's audio as it arrives, from timeline sample `start` (24 kHz), and its thinker
    stream. Fed in order by one task (the connection's); `finish` once the utterance is complete."""

    def __init__(self, start: int, mel_filters: np.ndarray) -> None:
        self.start = self.fed = start      # timeline samples: where the clip begins, what was fed so far
        self.resampler = ClipResampler(INPUT_SAMPLE_RATE, FEATURE_SAMPLE_RATE)
        self.mel = LogMelStream(mel_filters)
        self.raw: list[torch.Tensor] = []  # the clip's raw log-mel frames so far [mel, k] each
        self.prefix: TurnPrefix | None = None
        self.turn: AudioTurn | None = None
        self.features: torch.Tensor | None = None     # once finished: the clip's features [mel, frames]
        self.stale = False                 # the conversation may have changed since `prefix` was rendered
        self.item_id: str | None = None    # once committed: its conversation item
        self.hold: asyncio.TimerHandle | None = None    # once committed: when its stream is released unanswered

    def open(self, open_turn: Callable[..., AudioTurn], prefix: TurnPrefix, session: str | None) -> None:
        """(Re)open the thinker stream after `prefix`; the frames heard so far go first."""
        self.prefix, self.stale = prefix, False
        self.turn = open_turn(prefix.token_ids, prefix.clips, session=session)
        for raw in self.raw:
            self.turn.hear(raw)

    def _frames(self, samples: np.ndarray, last: bool) -> list[torch.Tensor]:
        pcm = self.resampler.push(samples)
        out = [self.mel.push(pcm)]
        if last:
            out += [self.mel.push(self.resampler.finish()), self.mel.finish()]
        return [f for f in out if f.shape[1]]

    async def feed(self, samples: np.ndarray, last: bool = False) -> None:
        """The clip's next samples (24 kHz float32); `last`: they end it (the features are then made)."""
        self.fed += len(samples)
        frames = await asyncio.to_thread(self._frames, samples, last)
        self.raw += frames
        if self.turn is not None:
            for raw in frames:
                self.turn.hear(raw)
        if last:
            self.features = await asyncio.to_thread(lambda: scale(torch.cat(self.raw, dim=1)))

    def take(self, prompt: RenderedPrompt, audio_token: int) -> AudioTurn | None:
        """The stream, handed over, when `prompt` is its prefix, then this clip, then the rest (see
        the module's docstring); None otherwise (the turn keeps it: `close` cancels it)."""
        turn, p = self.turn, self.prefix
        if turn is None or p is None or self.features is None or not turn.usable or not prompt.audio_features:
            return None
        clips = prompt.audio_features
        if not _same(clips[-1], self.features) or len(clips) != len(p.clips) + 1 \
                or not all(_same(a, b) for a, b in zip(clips, p.clips)):
            return None
        if around_last_clip(prompt.token_ids, audio_token)[0] != p.token_ids:
            return None
        self.turn = None
        return turn

    async def close(self) -> None:
        """Cancel the stream, if it still holds one."""
        if self.hold is not None:
            self.hold.cancel()
            self.hold = None
        turn, self.turn = self.turn, None
        if turn is not None:
            await turn.close()


def same_prefix(a: TurnPrefix | None, b: TurnPrefix) -> bool:
    return a is not None and a.token_ids == b.token_ids and len(a.clips) == len(b.clips) \
        and all(_same(x, y) for x, y in zip(a.clips, b.clips))
