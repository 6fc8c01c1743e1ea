"""Whisper's log-mel features made as the audio arrives, equal bit for bit to the whole clip's.

WhisperFeatureExtractor (transformers' torch path, what `prompt.FeatureExtractor` calls) computes,
for a clip of n samples at 16 kHz: a centred STFT (window 400, hop 160, the clip reflect-padded by
200 samples at each end), drops the last frame (n // 160 frames remain), the power spectrum through
the mel filters, `log10(max(mel, 1e-10))` -- the *raw* log-mel -- and then, over the whole clip,
`max(raw, raw.max() - 8)` and `(x + 4) / 4` (`scale`). Frame t reads padded samples
t * 160 .. t * 160 + 399, i.e. clip samples t * 160 - 200 .. t * 160 + 199: a frame is final as soon
as those samples are in (the start's reflect padding needs the first 201 samples), except the last
frames, which read the end's reflect padding and are made once the clip is complete (`finish`).
Only the clamp needs the whole clip: it is applied once the clip is complete (`scale`), so a
stream's raw frames, scaled at the end, are the whole clip's features.

The STFT's frames are the same bits however many are computed at once; the mel projection (a
matrix product over the frames) is not: BLAS takes another kernel for a product of few columns
(under 12 on the CI machine). So frames are projected at least MIN_COLUMNS at a time (padded with
zero columns, whose results are dropped: a column's result depends only on its own values and on
the kernel), as the whole clip's product is; a clip of fewer than MIN_COLUMNS frames is projected
whole, in `finish`, exactly as the extractor does.

Checked against WhisperFeatureExtractor in tests/test_streamed_audio.py (several piece sizes,
clips shorter than a frame's reach and longer than an encoder window)."""

from __future__ import annotations

import numpy as np
import torch

HOP = 160
N_FFT = 400
HALF = N_FFT // 2            # the centred STFT's padding at each end
CLAMP_RANGE = 8.0            # Whisper keeps 8 decades (80 dB) below the clip's maximum
LOG_FLOOR = 1e-10
MIN_COLUMNS = 64             # frames per mel projection, at least (see above)


def frames_of(samples: int) -> int:
    """Feature frames of a clip of `samples` samples (WhisperFeatureExtractor's valid frames)."""
    return samples // HOP


def scale(raw: torch.Tensor, top: float | torch.Tensor | None = None) -> torch.Tensor:
    """Whisper's features from raw log-mel frames [mel, T]: clamped to `top` - 8 (default: the
    frames' own maximum, as for a whole clip), then (x + 4) / 4. float32, as the extractor's."""
    top = raw.max() if top is None else torch.as_tensor(top, dtype=raw.dtype)
    return (torch.maximum(raw, top - CLAMP_RANGE) + 4.0) / 4.0


class LogMelStream:
    """`push(samples)` -> the raw log-mel frames [mel, k] float32 that became final (k may be 0);
    `finish()` -> the rest, once the clip is complete. Concatenated, they are the clip's raw
    frames; `scale` of them is `FeatureExtractor(clip)`. `mel_filters`: the extractor's
    [n_fft // 2 + 1, mel] matrix (FeatureExtractor.fe.mel_filters)."""

    def __init__(self, mel_filters: np.ndarray) -> None:
        # [mel, bins]: the transposed view, as the extractor multiplies (the layout picks the BLAS kernel)
        self.filters = torch.from_numpy(np.asarray(mel_filters)).to(torch.float32).T
        self.window = torch.hann_window(N_FFT)
        self.head: np.ndarray | None = None      # the clip's first HALF + 1 samples, until the padding is known
        self.buf = np.zeros(0, np.float32)       # padded samples from frame `self.done`'s first one on
        self.samples = 0                         # clip samples received
        self.done = 0                            # frames made
        self.finished = False

    @property
    def mel_bins(self) -> int:
        return self.filters.shape[0]

    def push(self, samples: np.ndarray) -> torch.Tensor:
        if self.finished:
            raise ValueError("the clip is complete")
        x = np.asarray(samples, dtype=np.float32).reshape(-1)
        self.samples += x.size
        if self.head is None or self.head.size <= HALF:
            self.head = x if self.head is None else np.concatenate((self.head, x))
            if self.head.size <= HALF:
                return self._empty()
            x, self.head = self.head, self.head[:HALF + 1]
            x = np.concatenate((x[HALF:0:-1], x))      # the start's reflect padding
        self.buf = np.concatenate((self.buf, x))
        ready = (self.buf.size - N_FFT) // HOP + 1 if self.buf.size >= N_FFT else 0
        # frames past the clip's last valid one (n // HOP) read the end's padding: only in finish
        ready = min(ready, max(frames_of(self.samples) - self.done, 0))
        if self.done + ready < MIN_COLUMNS:       # a clip this short may end so: projected whole, in finish
            return self._empty()
        return self._frames(ready)

    def finish(self) -> torch.Tensor:
        """The last frames (the end's reflect padding); ValueError when the clip is shorter than the
        extractor takes (HALF + 1 samples)."""
        if self.finished:
            raise ValueError("the clip is complete")
        self.finished = True
        if self.head is None or self.head.size <= HALF:
            raise ValueError(f"audio of {self.samples} samples at 16 kHz is too short; at least {HALF + 1} are needed")
        tail = self.buf[-(HALF + 1):-1][::-1]                 # reflect: the clip's last HALF samples but its end
        self.buf = np.concatenate((self.buf, tail))
        return self._frames(frames_of(self.samples) - self.done)

    def _empty(self) -> torch.Tensor:
        return torch.zeros(self.mel_bins, 0)

    def _frames(self, k: int) -> torch.Tensor:
        if k <= 0:
            return self._empty()
        seg = torch.from_numpy(np.ascontiguousarray(self.buf[:(k - 1) * HOP + N_FFT]))
        st = torch.stft(seg, N_FFT, HOP, window=self.window, center=False, return_complex=True)
        power = st.abs() ** 2
        if self.done + k >= MIN_COLUMNS and k < MIN_COLUMNS:   # see the module's docstring
            power = torch.cat((power, power.new_zeros(power.shape[0], MIN_COLUMNS - k)), dim=1)
        raw = torch.clamp(self.filters @ power.contiguous(), min=LOG_FLOOR).log10()[:, :k]
        self.buf = self.buf[k * HOP:]
        self.done += k
        return raw
