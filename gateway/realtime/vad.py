"""Server VAD for the realtime API: Silero VAD (the TorchScript model shipped inside the
silero-vad wheel, on the CPU) on 16 kHz frames of 512 samples, with OpenAI's `server_vad` turn
rules: speech starts at the first frame whose speech probability reaches `threshold`; it stops
once `silence_duration_ms` of frames fall below `threshold - 0.15` (Silero's own hysteresis).

One model is loaded per process; each stream keeps its own recurrent state and 64-sample
context, so sessions share the weights but never each other's state."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

VAD_SAMPLE_RATE = 16000
FRAME_SAMPLES = 512                 # Silero's frame at 16 kHz (32 ms)
CONTEXT_SAMPLES = 64                # the previous frame's tail Silero prepends at 16 kHz
STATE_SHAPE = (2, 1, 128)           # Silero's LSTM state [h/c, batch, hidden]
HYSTERESIS = 0.15
FRAME_MS = FRAME_SAMPLES * 1000 // VAD_SAMPLE_RATE


@dataclass(frozen=True)
class ServerVadParams:
    """OpenAI's `turn_detection: {"type": "server_vad", ...}` with its defaults."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


class SileroModel:
    """The process-wide Silero network, called statelessly: (frame with context, state) ->
    (speech probability, new state). Thread-safe: the network itself keeps no state."""

    _shared: "SileroModel | None" = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        from silero_vad import load_silero_vad   # sets torch's intra-op threads to 1 (its import side effect)

        self.jit = load_silero_vad()
        self.net = self.jit._model                # the 16 kHz network under the stateful wrapper

    @classmethod
    def shared(cls) -> "SileroModel":
        with cls._lock:
            if cls._shared is None:
                cls._shared = SileroModel()
            return cls._shared

    @torch.inference_mode()
    def step(self, frame_with_context: torch.Tensor, state: torch.Tensor) -> tuple[float, torch.Tensor]:
        """frame_with_context: [1, 64 + 512] float32; state: [2, 1, 128]."""
        prob, state = self.net(frame_with_context, state)
        return float(prob), state


class StreamResampler:
    """Linear-interpolation resampling of a stream that arrives in pieces (good enough for VAD;
    the model input is resampled separately, whole, with voxpipe.audio.resample). Output sample
    j sits at input position j * src / dst on the stream's timeline."""

    def __init__(self, src: int, dst: int) -> None:
        self.src, self.dst = src, dst
        self.pending = np.zeros(0, np.float32)   # input not yet fully used
        self.pending_start = 0                   # timeline index of pending[0]
        self.produced = 0                        # output samples made so far

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.src == self.dst:
            return x.astype(np.float32)
        self.pending = np.concatenate([self.pending, x.astype(np.float32)])
        end = self.pending_start + len(self.pending)             # input samples seen
        # output j is computable while floor(j * src / dst) + 1 < end
        last = ((end - 1) * self.dst - 1) // self.src                # largest j with j*src < (end-1)*dst
        j = np.arange(self.produced, last + 1, dtype=np.int64)
        if j.size == 0:
            return np.zeros(0, np.float32)
        pos = j * self.src
        left = pos // self.dst - self.pending_start
        frac = (pos % self.dst).astype(np.float32) / self.dst
        y = self.pending[left] * (1.0 - frac) + self.pending[left + 1] * frac
        self.produced = int(j[-1]) + 1
        keep_from = (self.produced * self.src) // self.dst - self.pending_start
        self.pending = self.pending[keep_from:]
        self.pending_start += keep_from
        return y.astype(np.float32)


@dataclass(frozen=True)
class SpeechStarted:
    onset_ms: int          # start of the first frame at or above the threshold (session timeline)


@dataclass(frozen=True)
class SpeechStopped:
    end_ms: int            # end of the frame that completed silence_duration_ms of silence


class ServerVad:
    """Feed it the session's input audio as it arrives; it answers speech start/stop events on
    the session's audio timeline (milliseconds since the first sample appended)."""

    def __init__(self, params: ServerVadParams, input_rate: int, origin_ms: int = 0,
                 model: SileroModel | None = None) -> None:
        self.params = params
        self.origin_ms = origin_ms                  # the timeline position of the first sample fed
        self.model = model or SileroModel.shared()
        self.resampler = StreamResampler(input_rate, VAD_SAMPLE_RATE)
        self.buffer = np.zeros(0, np.float32)       # 16 kHz samples not yet in a frame
        self.context = torch.zeros(1, CONTEXT_SAMPLES)
        self.state = torch.zeros(*STATE_SHAPE)
        self.frames = 0                             # frames processed
        self.speaking = False
        self.silent_frames = 0

    @property
    def silence_frames_needed(self) -> int:
        return max(1, -(-self.params.silence_duration_ms // FRAME_MS))

    def feed(self, samples: np.ndarray) -> list[SpeechStarted | SpeechStopped]:
        """samples: float32 mono at the input rate. Runs the model (call it off the event loop)."""
        self.buffer = np.concatenate([self.buffer, self.resampler(samples)])
        n = len(self.buffer) // FRAME_SAMPLES
        events: list[SpeechStarted | SpeechStopped] = []
        for i in range(n):
            frame = torch.from_numpy(self.buffer[i * FRAME_SAMPLES:(i + 1) * FRAME_SAMPLES].copy())[None]
            x = torch.cat([self.context, frame], dim=1)
            prob, self.state = self.model.step(x, self.state)
            self.context = x[:, -CONTEXT_SAMPLES:]
            ev = self._decide(prob)
            self.frames += 1
            if ev is not None:
                events.append(ev)
        self.buffer = self.buffer[n * FRAME_SAMPLES:]
        return events

    def _decide(self, prob: float) -> SpeechStarted | SpeechStopped | None:
        p = self.params
        if not self.speaking:
            if prob >= p.threshold:
                self.speaking, self.silent_frames = True, 0
                return SpeechStarted(onset_ms=self.origin_ms + self.frames * FRAME_MS)
            return None
        if prob < p.threshold - HYSTERESIS:
            self.silent_frames += 1
            if self.silent_frames >= self.silence_frames_needed:
                self.speaking, self.silent_frames = False, 0
                return SpeechStopped(end_ms=self.origin_ms + (self.frames + 1) * FRAME_MS)
        else:
            self.silent_frames = 0
        return None
