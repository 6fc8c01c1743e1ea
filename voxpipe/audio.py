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
