"""The spoken user turn of the "voice-in" workload (bench/BENCHMARK.md): a 5-6 s speech clip, 16 kHz
mono. The project ships one (bench/data/voice-in.wav, made by `main` below with espeak-ng) so that
machines without espeak-ng (the GPU machine) run the same clip; `--audio FILE` picks another."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from voxpipe.audio import read_wav, resample, write_wav

CLIP_RATE = 16000
DEFAULT_CLIP = Path(__file__).resolve().parent / "data" / "voice-in.wav"
SPOKEN_TEXT = ("Hello there. I am calling to ask about the weather tomorrow in Berlin, "
               "and whether I should bring an umbrella.")
ESPEAK_WORDS_PER_MINUTE = 175        # 5.7 s for SPOKEN_TEXT


@dataclass(frozen=True)
class VoiceClip:
    path: str
    samples: np.ndarray            # [n] float32 in [-1, 1] at CLIP_RATE
    wav: bytes                     # the file as sent in a chat completion's input_audio part

    @property
    def seconds(self) -> float:
        return len(self.samples) / CLIP_RATE

    def at_rate(self, rate: int) -> np.ndarray:
        return resample(self.samples, CLIP_RATE, rate)


def load_clip(path: str | Path | None = None) -> VoiceClip:
    """A wav file (any rate, mixed to mono, resampled to 16 kHz); None: the shipped clip."""
    p = Path(path) if path else DEFAULT_CLIP
    if not p.is_file():
        raise SystemExit(f"--audio: no such file: {p}")
    raw = p.read_bytes()
    try:
        samples, rate = read_wav(raw)
    except ValueError as e:
        raise SystemExit(f"--audio: {p} is not a readable wav file ({e})") from None
    return VoiceClip(str(p), resample(samples, rate, CLIP_RATE).astype(np.float32), raw)


def speak(text: str, out: Path) -> None:
    """espeak-ng's voice for `text`, as a 16 kHz mono 16-bit wav."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(["espeak-ng", "--stdout", "-s", str(ESPEAK_WORDS_PER_MINUTE), text], check=True,
                         capture_output=True).stdout
    samples, rate = read_wav(wav)
    write_wav(str(out), resample(samples, rate, CLIP_RATE), CLIP_RATE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="make the voice-in clip with espeak-ng")
    p.add_argument("out", nargs="?", default=str(DEFAULT_CLIP))
    p.add_argument("--text", default=SPOKEN_TEXT)
    args = p.parse_args(argv)
    speak(args.text, Path(args.out))
    clip = load_clip(args.out)
    print(f"{args.out}: {clip.seconds:.2f} s at {CLIP_RATE} Hz, {len(clip.wav)} bytes")


if __name__ == "__main__":
    main()
