"""Audio in and out of the gateway: decoding clients' clips (wav, mp3, flac, ogg ... via
libsndfile) to 16 kHz mono float32, and encoding the 24 kHz pcm16 the pipeline makes into the
format a client asked for (raw pcm16 little-endian, wav, mp3, opus, flac)."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import wave

import numpy as np

from voxpipe.audio import read_wav, resample, wav_header

from .limits import audio_problem

INPUT_SAMPLE_RATE = 16000

# name -> (libsndfile format, subtype, content type); "pcm16" / "pcm" is raw int16 little-endian
ENCODINGS = {
    "wav": ("WAV", "PCM_16", "audio/wav"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
    "flac": ("FLAC", "PCM_16", "audio/flac"),
}
RAW_PCM = ("pcm16", "pcm")
OUTPUT_FORMATS = tuple(ENCODINGS) + RAW_PCM


def content_type(fmt: str) -> str:
    return "audio/pcm" if fmt in RAW_PCM else ENCODINGS[fmt][2]


def decode_base64(data: str) -> bytes:
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError, TypeError) as e:
        raise ValueError(f"the audio data is not valid base64 ({e})") from None
    if not raw:
        raise ValueError("the audio data is empty")
    return raw


def _claimed(raw: bytes) -> tuple[int, int, int] | None:
    """(frames, sample rate, channels) as the file's header states them, or None if no reader
    recognises the header (then decoding fails too)."""
    import soundfile

    try:
        info = soundfile.info(io.BytesIO(raw))
        return info.frames, info.samplerate, info.channels
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError):
        pass
    try:
        h = wav_header(raw)
    except (ValueError, struct.error):
        return None
    return h.frames, h.rate, h.channels


def decode_clip(raw: bytes) -> np.ndarray:
    """Any libsndfile-readable file (wav, mp3, flac, ogg/opus ...) -> 16 kHz mono float32. The
    duration and sample rate its header claims are checked (limits.audio_problem) before any
    sample is decoded: a small file claiming hours of audio, or 1 Hz, costs nothing."""
    import soundfile   # libsndfile is needed only for compressed formats, not for pcm streaming

    claimed = _claimed(raw)
    if claimed is not None and (problem := audio_problem(*claimed)) is not None:
        raise ValueError(problem)
    try:
        samples, rate = soundfile.read(io.BytesIO(raw), dtype="float32", always_2d=True)
        samples = samples.mean(axis=1)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as sf_error:
        try:  # formats libsndfile rejects but our reader knows (e.g. odd wav chunk layouts)
            samples, rate = read_wav(raw)
        except ValueError:
            reason = str(sf_error).rsplit(": ", 1)[-1].rstrip(".") or "unknown format"
            raise ValueError(f"could not decode the audio ({reason}); send wav, mp3, flac or ogg") from None
    if samples.size == 0:
        raise ValueError("the audio has no samples")
    if not np.all(np.isfinite(samples)):
        raise ValueError("the audio has non-finite samples")
    if (problem := audio_problem(samples.size, int(rate))) is not None:   # what was decoded, whatever was claimed
        raise ValueError(problem)
    return resample(samples.astype(np.float32), int(rate), INPUT_SAMPLE_RATE)


def pcm16_samples(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, dtype="<i2")


def encode(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """24 kHz pcm16 little-endian bytes -> the bytes of `fmt`."""
    if fmt in RAW_PCM:
        return pcm
    ints = pcm16_samples(pcm)
    if fmt == "wav":  # exact: the pcm16 samples as they came
        return _wav(ints, sample_rate)
    import soundfile

    container, subtype, _ = ENCODINGS[fmt]
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", samplerate=sample_rate, channels=1, format=container, subtype=subtype) as f:
        f.write(ints.astype(np.int16))
    return buf.getvalue()


def _wav(ints: np.ndarray, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(ints.astype("<i2").tobytes())
    return buf.getvalue()
