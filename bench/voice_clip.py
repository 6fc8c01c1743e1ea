"""The spoken user turn of the "voice-in" workload (bench/BENCHMARK.md): a 5-6 s speech clip, 16 kHz
mono. The project ships one (bench/data/voice-in.wav, made by `main` below with espeak-ng) so that
machines without espeak-ng (the GPU machine) run the same clip; `--audio FILE` picks another.

It also ships a 10 s utterance (bench/data/voice-in-10s.wav: LONG_TEXT, 9.2 s of speech, then
silence to 10.00 s), the length of the realtime goal "before the commit, >= 90 % of a 10 s
utterance's audio tokens are encoded and prefilled":

    python -m voxpipe.bench.voice_clip bench/data/voice-in-10s.wav --long --seconds 10"""

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
LONG_TEXT = SPOKEN_TEXT + " I also want to know if the trains run on time in the morning."
ESPEAK_WORDS_PER_MINUTE = 175        # 5.7 s for SPOKEN_TEXT, 9.2 s for LONG_TEXT
LONG_CLIP = DEFAULT_CLIP.with_name("voice-in-10s.wav")


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


def rotated(samples: np.ndarray, session: int, turn: int) -> np.ndarray:
    """A multi-turn workload's user turn: the clip rotated by an offset of this session and turn, so
    that every turn is new audio (a miss for the audio encoder caches, as a new utterance is) of the
    clip's length and sound."""
    return np.roll(samples, (session * 7919 + turn * 997) % max(len(samples), 1))


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


def speak(text: str, out: Path, seconds: float | None = None) -> None:
    """espeak-ng's voice for `text`, as a 16 kHz mono 16-bit wav; `seconds`: exactly that long, the
    speech followed by silence (SystemExit when the speech is longer)."""
    if shutil.which("espeak-ng") is None:
        raise SystemExit("espeak-ng is not installed (apt-get install -y espeak-ng)")
    wav = subprocess.run(["espeak-ng", "--stdout", "-s", str(ESPEAK_WORDS_PER_MINUTE), text], check=True,
                         capture_output=True).stdout
    samples, rate = read_wav(wav)
    clip = resample(samples, rate, CLIP_RATE)
    if seconds is not None:
        n = round(seconds * CLIP_RATE)
        if len(clip) > n:
            raise SystemExit(f"--seconds {seconds:g}: the speech alone takes {len(clip) / CLIP_RATE:.2f} s")
        clip = np.concatenate([clip, np.zeros(n - len(clip), clip.dtype)])
    write_wav(str(out), clip, CLIP_RATE)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="make the voice-in clip with espeak-ng")
    p.add_argument("out", nargs="?", default=str(DEFAULT_CLIP))
    p.add_argument("--text", default=None, help="what is said (default: SPOKEN_TEXT; --long: LONG_TEXT)")
    p.add_argument("--long", action="store_true", help="LONG_TEXT (the 10 s utterance's)")
    p.add_argument("--seconds", type=float, default=None, help="pad the speech with silence to this length")
    args = p.parse_args(argv)
    if args.seconds is not None and not 0 < args.seconds <= 600:
        p.error(f"--seconds: must be in (0, 600], got {args.seconds:g}")
    speak(args.text or (LONG_TEXT if args.long else SPOKEN_TEXT), Path(args.out), args.seconds)
    clip = load_clip(args.out)
    print(f"{args.out}: {clip.seconds:.2f} s at {CLIP_RATE} Hz, {len(clip.wav)} bytes")


if __name__ == "__main__":
    main()
