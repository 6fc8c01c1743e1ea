"""A clip heard while it is spoken: raw log-mel frames arrive (log_mel.py), each audio encoder
attention window is encoded as soon as its frames are in, and once the clip is complete the rest
is encoded -- the result equal, bit for bit, to the whole clip's features encoded at once.

Why it is exact: the encoder's output for a window is a function of that window's frames and of
the chunk padding alone (model.AudioEncoder: per chunk convolutions and positions, attention per
window, per row the rest), and a complete window (n_window_infer frames) implies the prompt's chunk
padding is a full chunk (2 * n_window frames; model.chunk_pad). The one input that needs the whole
clip is Whisper's clamp, max(raw, clip max - 8): a window is encoded with the maximum of the frames
heard so far, and once the clip is complete, every window whose scaled input the final maximum
changes is encoded again (`finish`: usually none, since speech reaches its loudest early; the first
changed window and all after it otherwise). Used by the engine thread alone, except `append`
(under the engine's lock)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .audio_cache import AudioEncoderCache
from .log_mel import scale
from .model import AudioEncoder, audio_output_length

if TYPE_CHECKING:
    from .job import ThinkerJob


@dataclass
class EncodedWindow:
    rows: torch.Tensor          # [tokens, H]: the encoder's output for the window, in the embedding dtype
    top: torch.Tensor           # the clamp maximum its input was scaled with (the frames' maximum then)


@dataclass
class StreamedClip:
    """One clip's raw log-mel frames so far and its encoded windows. `window_frames`: frames per
    attention window (n_window_infer); `chunk_frames`: per convolution chunk (2 * n_window)."""

    mel_bins: int
    window_frames: int
    chunk_frames: int
    n_window: int
    pieces: list[torch.Tensor] = field(default_factory=list)    # raw frames [mel, k] each, in order
    frames: int = 0
    top: torch.Tensor | None = None      # the maximum raw value so far
    windows: list[EncodedWindow] = field(default_factory=list)
    complete: bool = False
    features: torch.Tensor | None = None     # once complete: the clip's features [mel, frames] (scaled)
    rows: torch.Tensor | None = None         # once complete: the clip's encoder output [tokens, H]
    pad: int | None = None                   # the prompt's chunk padding, once decided (streaming.py)

    @classmethod
    def for_tower(cls, tower: AudioEncoder) -> "StreamedClip":
        cfg = tower.cfg
        return cls(cfg.num_mel_bins, cfg.n_window_infer, 2 * cfg.n_window, cfg.n_window)

    def append(self, raw: torch.Tensor) -> None:
        """More raw frames [mel, k] (the caller checked shape and values)."""
        if self.complete:
            raise ValueError("the clip is complete")
        if raw.shape[1] == 0:
            return
        self.pieces.append(raw)
        self.frames += raw.shape[1]
        m = raw.max()
        self.top = m if self.top is None else torch.maximum(self.top, m)

    def raw(self) -> torch.Tensor:
        """All raw frames [mel, frames] (the pieces joined once)."""
        if len(self.pieces) != 1:
            self.pieces = [torch.cat(self.pieces, dim=1) if self.pieces else torch.zeros(self.mel_bins, 0)]
        return self.pieces[0]

    @property
    def window_tokens(self) -> int:
        return audio_output_length(self.window_frames, self.n_window)

    def pending_windows(self) -> int:
        """Complete windows not yet encoded."""
        return self.frames // self.window_frames - len(self.windows)

    def tokens(self) -> int:
        """Placeholder tokens of the encoded windows (of the whole clip once complete)."""
        if self.rows is not None:
            return self.rows.shape[0]
        return len(self.windows) * self.window_tokens

    def encode_windows(self, tower: AudioEncoder, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Encode every complete window not yet encoded, scaled with the maximum so far; their rows
        [new tokens, H] (also kept in `windows`)."""
        n = self.pending_windows()
        if n <= 0:
            return torch.zeros(0, tower.cfg.output_dim, dtype=dtype, device=device)
        raw, top = self.raw(), self.top
        w = self.window_frames
        lo, hi = len(self.windows) * w, (len(self.windows) + n) * w
        rows = tower(scale(raw[:, lo:hi], top).to(device), self.chunk_frames).to(dtype)
        per = self.window_tokens
        for i in range(n):
            self.windows.append(EncodedWindow(rows[i * per:(i + 1) * per], top))
        return rows

    def finish(self, tower: AudioEncoder, pad_to: int, dtype: torch.dtype, device: torch.device) -> int:
        """The clip is complete: its features scaled with the whole clip's maximum, every window the
        final maximum changes and the rest encoded again (`rows`: the whole clip's output, `pad_to`
        the prompt's chunk padding). Returns the windows kept, whose tokens need no new prefill."""
        if self.frames == 0:
            raise ValueError("a streamed clip with no frames")
        raw = self.raw()
        self.complete = True
        self.top = raw.max()
        self.features = scale(raw, self.top)
        w = self.window_frames
        kept = 0
        for i, win in enumerate(self.windows):
            part = raw[:, i * w:(i + 1) * w]
            if not (torch.equal(win.top, self.top) or torch.equal(scale(part, win.top), scale(part, self.top))):
                break
            kept += 1
        del self.windows[kept:]
        rest = self.features[:, kept * w:]
        parts = [win.rows for win in self.windows]
        if rest.shape[1]:
            parts.append(tower(rest.to(device), pad_to).to(dtype))
        self.rows = torch.cat(parts) if parts else torch.zeros(0, tower.cfg.output_dim, dtype=dtype, device=device)
        return kept


def streamed_rows(cache: AudioEncoderCache, job: "ThinkerJob", digests: list[bytes | None]) -> torch.Tensor:
    """The encoder rows of a streamed job's clips in prompt order: the clips heard whole (through the
    audio cache, at the prompt's chunk padding), then the streamed clip's (its windows so far, or all
    of it once complete). `digests`: the whole clips' keys."""
    clip = job.streamed
    whole = job.audio[:len(job.audio) - 1] if clip.complete else job.audio
    parts = [cache.encode(whole, digests[:len(whole)], pad_to=clip.pad)] if whole else []
    if clip.complete:
        parts.append(clip.rows)
    else:
        parts += [w.rows for w in clip.windows]
    if not parts:
        return torch.zeros(0, cache.tower.cfg.output_dim, dtype=cache.dtype, device=cache.device)
    return torch.cat(parts)


def around_last_clip(ids: list[int], audio_token: int) -> tuple[list[int], list[int]]:
    """A rendered turn's token ids before and after its last clip's placeholders: a streamed turn's
    start (the conversation before the clip) and its commit's token ids."""
    end = len(ids) - ids[::-1].index(audio_token)
    start = end
    while start > 0 and ids[start - 1] == audio_token:
        start -= 1
    return ids[:start], ids[end:]
