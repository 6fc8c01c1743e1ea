"""WAV files and resampling (numpy only)."""

from __future__ import annotations

import struct
import wave
from dataclasses import dataclass

import numpy as np


def write_wav(path_or_file, samples: np.ndarray, sample_rate: int) -> None:
    """Mono 16-bit PCM."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(path_or_file, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())


@dataclass(frozen=True)
class WavHeader:
    tag: int            # 1: integer PCM, 3: IEEE float (WAVE_FORMAT_EXTENSIBLE resolved)
    channels: int
    rate: int
    bits: int
    data_offset: int    # where the data chunk's bytes start
    data_bytes: int     # its length, clipped to the bytes present

    @property
    def frames(self) -> int:
        """Samples per channel that the data chunk holds."""
        width = self.channels * max(1, self.bits // 8)
        return self.data_bytes // width if width else 0


def wav_header(data: bytes) -> WavHeader:
    """The fmt and data chunk facts of a RIFF/WAVE file, without decoding its samples."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise ValueError("not a RIFF/WAVE file")
    pos, fmt, payload = 12, None, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if cid == b"fmt ":
            body = data[pos + 8:pos + 8 + size]
            if len(body) < 16:
                raise ValueError("wav file with a short fmt chunk")
            fmt = struct.unpack("<HHIIHH", body[:16])
        elif cid == b"data":
            payload = (pos + 8, max(0, min(size, len(data) - pos - 8)))
        pos += 8 + size + (size & 1)
    if fmt is None or payload is None:
        raise ValueError("wav file without fmt or data chunk")
    tag, channels, rate, _, _, bits = fmt
    if tag == 0xFFFE:  # WAVE_FORMAT_EXTENSIBLE: the sub-format decides
        tag = 3 if bits in (32, 64) and _is_float_extensible(data) else 1
    if channels < 1 or rate < 1:
        raise ValueError("wav file with no channels or sample rate")
    return WavHeader(tag, channels, rate, bits, *payload)


def read_wav(data: bytes) -> tuple[np.ndarray, int]:
    """PCM 8/16/24/32-bit or IEEE float 32/64 -> (mono float32 in [-1, 1], sample rate)."""
    h = wav_header(data)
    tag, channels, rate, bits = h.tag, h.channels, h.rate, h.bits
    payload = data[h.data_offset:h.data_offset + h.data_bytes]
    if tag == 3:
        x = np.frombuffer(payload[: len(payload) // (bits // 8) * (bits // 8)], dtype="<f4" if bits == 32 else "<f8")
    elif tag == 1 and bits == 16:
        x = np.frombuffer(payload[: len(payload) // 2 * 2], dtype="<i2") / 32768.0
    elif tag == 1 and bits == 8:
        x = (np.frombuffer(payload, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0
    elif tag == 1 and bits == 32:
        x = np.frombuffer(payload[: len(payload) // 4 * 4], dtype="<i4") / 2147483648.0
    elif tag == 1 and bits == 24:
        b = np.frombuffer(payload[: len(payload) // 3 * 3], dtype=np.uint8).reshape(-1, 3)
        v = (b[:, 0].astype(np.int32) | (b[:, 1].astype(np.int32) << 8) | (b[:, 2].astype(np.int32) << 16))
        x = np.where(v >= 1 << 23, v - (1 << 24), v) / float(1 << 23)
    else:
        raise ValueError(f"unsupported wav encoding (format {tag}, {bits} bits)")
    x = np.asarray(x, dtype=np.float32)
    x = x[: len(x) // channels * channels].reshape(-1, channels).mean(axis=1)
    if x.size == 0:
        raise ValueError("wav file has no samples")
    return x.astype(np.float32), rate


def _is_float_extensible(data: bytes) -> bool:
    i = data.find(b"fmt ")
    sub = data[i + 8 + 24:i + 8 + 26]
    return struct.unpack("<H", sub)[0] == 3 if len(sub) == 2 else False


def resample(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """Band-limited resampling of a whole clip (FFT method)."""
    if src == dst:
        return x.astype(np.float32)
    n = int(round(len(x) * dst / src))
    if n == 0 or len(x) == 0:           # too short to keep a sample at the new rate
        return np.zeros(0, np.float32)
    spec = np.fft.rfft(x.astype(np.float64))
    m = n // 2 + 1
    out = np.zeros(m, dtype=np.complex128)
    k = min(m, spec.shape[0])
    out[:k] = spec[:k]
    y = np.fft.irfft(out, n=n) * (n / len(x))
    return y.astype(np.float32)


SINC_ZEROS = 16          # zero crossings of the low-pass kernel on each side (ClipResampler)
KAISER_BETA = 8.6        # its window: ~90 dB stop band
ROLLOFF = 0.94           # its cutoff, as a share of the lower rate's Nyquist frequency


class ClipResampler:
    """Band-limited resampling by a rational ratio, made as the clip arrives: `push(x)` returns the
    output samples that became final, `finish()` the rest once the clip is complete; concatenated
    they equal `resample_clip` of the whole clip, bit for bit, however the clip was cut.

    Output sample m sits at input time t = m * src / dst and is sum_k x[k] h(t - k) over the
    kernel's 2 * J + 2 taps (a Kaiser-windowed sinc at ROLLOFF of the lower Nyquist frequency),
    the clip taken as zero outside itself. Each output is one fixed sequence of float64 products
    and sums, whatever else is computed with it, so the pieces' sums are the whole clip's. The
    output has round(n * dst / src) samples for n input samples (as `resample`)."""

    def __init__(self, src: int, dst: int) -> None:
        if src < 1 or dst < 1:
            raise ValueError(f"sample rates must be positive, got {src} and {dst}")
        g = np.gcd(src, dst)
        self.up, self.down = dst // g, src // g        # t(m) = m * down / up
        cutoff = ROLLOFF * min(1.0, dst / src)         # in cycles per input sample, times 2
        self.half = int(np.ceil(SINC_ZEROS / cutoff))  # J: taps base - J + 1 .. base + J (+ 1)
        j = np.arange(-self.half + 1, self.half + 1)   # k - floor(t)
        phase = np.arange(self.up)[:, None] / self.up  # frac(t) = (m * down mod up) / up
        tau = phase - j[None, :]                       # t - k
        window = np.kaiser(2 * self.half + 1, KAISER_BETA)
        w = np.interp(tau, np.arange(-self.half, self.half + 1), window, left=0.0, right=0.0)
        taps = cutoff * np.sinc(cutoff * tau) * w
        self.taps = taps / taps.sum(axis=1, keepdims=True)      # [up, 2J] float64, each phase's gain 1 at DC
        self.offsets = j
        self.x = np.zeros(0, np.float64)               # input from sample `self.x_start` on
        self.x_start = 0
        self.received = 0
        self.made = 0                                  # outputs returned
        self.finished = False

    def push(self, x: np.ndarray) -> np.ndarray:
        if self.finished:
            raise ValueError("the clip is complete")
        x = np.asarray(x, dtype=np.float64).reshape(-1)
        self.x = np.concatenate((self.x, x))
        self.received += x.size
        # output m is final once its last tap, floor(t) + J, has arrived
        last = (self.received - self.half) * self.up // self.down   # m with floor(t(m)) + J < received
        ready = max(0, min(last, self.total(self.received)) - self.made)
        return self._make(ready)

    def finish(self) -> np.ndarray:
        if self.finished:
            raise ValueError("the clip is complete")
        self.finished = True
        return self._make(self.total(self.received) - self.made)

    def total(self, n: int) -> int:
        """Output samples of a clip of `n` input samples."""
        return int(round(n * self.up / self.down))

    def _make(self, count: int) -> np.ndarray:
        if count <= 0:
            return np.zeros(0, np.float32)
        m0, m1 = self.made, self.made + count
        lo = m0 * self.down // self.up + self.offsets[0]             # the first output's first tap
        hi = (m1 - 1) * self.down // self.up + self.offsets[-1] + 1  # past the last output's last tap
        w = np.zeros(hi - lo)                                        # the clip is zero outside itself
        a, b = max(lo, self.x_start), min(hi, self.x_start + self.x.size)
        if b > a:
            w[a - lo:b - lo] = self.x[a - self.x_start:b - self.x_start]
        out = np.zeros(count)
        for first in range(m0, min(m0 + self.up, m1)):   # outputs `up` apart share their taps' phase,
            n = len(range(first, m1, self.up))             # and their inputs are strided slices of w
            base = first * self.down // self.up - lo
            taps = self.taps[first * self.down % self.up]
            acc = np.zeros(n)
            for j, off in enumerate(self.offsets):   # one fixed order of sums per output sample
                s = base + off
                acc = acc + w[s:s + self.down * (n - 1) + 1:self.down] * taps[j]
            out[first - m0::self.up] = acc
        self.made = m1
        keep_from = max(0, m1 * self.down // self.up + self.offsets[0] - self.x_start)   # the next output's first tap
        self.x, self.x_start = self.x[keep_from:], self.x_start + keep_from
        return out.astype(np.float32)


def resample_clip(x: np.ndarray, src: int, dst: int) -> np.ndarray:
    """The whole clip through ClipResampler (what a stream of its pieces makes)."""
    r = ClipResampler(src, dst)
    return np.concatenate((r.push(x), r.finish()))
