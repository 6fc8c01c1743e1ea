"""Audio in and out of the gateway: decoding clients' clips (wav, mp3, flac, ogg ... via
libsndfile) to 16 kHz mono float32, and encoding the 24 kHz pcm16 the pipeline makes into the
format a client asked for (raw pcm16 little-endian, or wav, mp3, opus, flac, aac through PyAV's
FFmpeg encoders and muxers), as a whole file or piece by piece while the audio is being made."""

from __future__ import annotations

import base64
import binascii
import io
import struct
import threading
from dataclasses import dataclass

import numpy as np

from voxpipe.audio import read_wav, resample, wav_header

from .limits import audio_problem

INPUT_SAMPLE_RATE = 16000


@dataclass(frozen=True)
class Encoding:
    """How one output format is made: an FFmpeg muxer, an encoder and the encoder's sample format."""
    container: str
    codec: str
    sample_format: str                                   # "fltp": float32 in [-1, 1]; "s16" / "s16p": int16
    content_type: str
    options: tuple[tuple[str, str], ...] = ()            # the muxer's


ENCODINGS = {
    "wav": Encoding("wav", "pcm_s16le", "s16", "audio/wav"),
    "mp3": Encoding("mp3", "libmp3lame", "s16p", "audio/mpeg"),
    # a page per 20 ms Opus packet (the default page holds up to 1 s: the stream would wait for it)
    "opus": Encoding("ogg", "libopus", "s16", "audio/ogg", (("page_duration", "20000"),)),
    "flac": Encoding("flac", "flac", "s16", "audio/flac", (("metadata_header_padding", "0"),)),
    "aac": Encoding("adts", "aac", "fltp", "audio/aac"),   # ADTS: AAC frames that stream, no index
}
RAW_PCM = ("pcm16", "pcm")
OUTPUT_FORMATS = tuple(ENCODINGS) + RAW_PCM


def content_type(fmt: str) -> str:
    return "audio/pcm" if fmt in RAW_PCM else ENCODINGS[fmt].content_type


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


def encode(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """24 kHz pcm16 little-endian bytes -> the bytes of `fmt`, as one file with exact headers."""
    encoder = AudioEncoder(fmt, sample_rate, streaming=False)
    try:
        return encoder.push(pcm) + encoder.finish()
    finally:
        encoder.close()


class _Pieces:
    """A write-only sink: PyAV sees no seek, so the muxer never goes back to rewrite a header."""

    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, b) -> int:
        self.data += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self.data)
        self.data.clear()
        return out


class AudioEncoder:
    """pcm16 little-endian mono -> `fmt`, piece by piece: `push` returns the bytes ready so far (the
    container's header with the first push), `finish` the rest; each piece is sent as it comes.

    streaming=True: nothing already returned is rewritten, so headers hold what is known at the
    start (wav: RIFF and data sizes 0xFFFFFFFF, "until the end of the stream", as OpenAI's streamed
    wav; flac: STREAMINFO without the total length; mp3: no Xing header, so decoders also play the
    encoder's delay and padding). streaming=False: `push` returns nothing and `finish` the whole file
    with exact headers. Raw pcm ("pcm", "pcm16") passes through. Calls may come from different
    threads (a worker thread encodes while the event loop closes an abandoned reply): they take
    turns."""

    def __init__(self, fmt: str, sample_rate: int, streaming: bool = True) -> None:
        self.fmt, self.rate, self.streaming = fmt, sample_rate, streaming
        self.samples = 0
        self._lock = threading.Lock()
        self._out = None
        if fmt in RAW_PCM:
            return
        import av   # PyAV: FFmpeg's encoders and muxers

        enc = ENCODINGS[fmt]
        self._sink = _Pieces() if streaming else io.BytesIO()
        self._out = av.open(self._sink, "w", format=enc.container,
                            options={"fflags": "+bitexact", "flush_packets": "1", **dict(enc.options)})
        self._stream = self._out.add_stream(enc.codec, rate=sample_rate, layout="mono")
        self._sample_format = enc.sample_format
        self._out.start_encoding()      # the header is ready before any audio

    def push(self, pcm: bytes) -> bytes:
        with self._lock:
            return self._push(pcm)

    def _push(self, pcm: bytes) -> bytes:
        if self.fmt in RAW_PCM:
            return pcm
        if self._out is None:
            raise ValueError("the encoder is closed")
        ints = np.frombuffer(pcm, dtype="<i2")
        if ints.size:
            import av

            samples = ints.astype(np.float32)[None] / 32768.0 if self._sample_format == "fltp" else ints[None]
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format=self._sample_format,
                                               layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.samples
            self.samples += ints.size
            for packet in self._stream.encode(frame):
                self._out.mux(packet)
        return self._sink.take() if self.streaming else b""

    def finish(self) -> bytes:
        """The encoder's and muxer's last bytes (the trailer); the encoder is closed after it."""
        with self._lock:
            if self.fmt in RAW_PCM:
                return b""
            if self._out is None:
                raise ValueError("the encoder is closed")
            for packet in self._stream.encode(None):
                self._out.mux(packet)
            self._out.close()
            self._out = None
            return self._sink.take() if self.streaming else self._sink.getvalue()

    def close(self) -> None:
        """Free the encoder (a reply that ended early); a no-op after `finish`."""
        with self._lock:
            out, self._out = self._out, None
            if out is not None:
                try:
                    out.close()
                except Exception:   # noqa: BLE001 - an abandoned stream: nothing more is sent
                    pass
