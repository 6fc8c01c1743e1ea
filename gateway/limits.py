"""The gateway's bounds on what clients send, checked before any work is done for a request.

Integer parameters travel to the stages in fixed-width protobuf fields (stages.proto): a value
outside the field's range is refused here, naming the parameter, instead of failing in the
protobuf encoder. Audio is refused on its claimed duration and sample rate (from the file header)
before it is decoded; text on its length before it is tokenized."""

from __future__ import annotations

UINT32_MAX = 2**32 - 1           # max_tokens, min_tokens, max_frames, min_frames (uint32)
INT32_MAX = 2**31 - 1            # top_k (int32)
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1    # OpenAI's int64 seeds and our uint64 ones (stored mod 2^64)

MAX_AUDIO_SECONDS = 600.0        # one audio input (HTTP input_audio part, Converse audio part)
AUDIO_RATES = (1000, 384000)     # accepted input sample rates in Hz, inclusive
MAX_PROMPT_CHARS = 200_000       # text characters of one rendered conversation (default of --max-prompt-chars)
DEFAULT_AUDIO_CACHE_MB = 256.0   # chat clips' features kept by content (--audio-cache-mb): ~900 clips of 5.7 s


def out_of_range(value: int, low: int, high: int) -> bool:
    return not low <= value <= high


def audio_problem(frames: int, rate: int, channels: int = 1) -> str | None:
    """Why a clip of `frames` samples per channel at `rate` Hz is refused, or None if it is not."""
    low, high = AUDIO_RATES
    if channels < 1:
        return "the audio has no channels"
    if not low <= rate <= high:
        return f"the audio's sample rate must be {low} to {high} Hz, got {rate}"
    seconds = frames / rate
    if seconds > MAX_AUDIO_SECONDS:
        return f"the audio is {seconds:.0f} s long; the limit is {MAX_AUDIO_SECONDS:.0f} s"
    return None

DEFAULT_ADMISSION_WAIT_S = 1.0     # --admission-wait: how long a spoken request may wait for capacity (0: no waiting)
REALTIME_TURN_HOLD_S = 10.0        # --realtime-turn-hold: a committed realtime turn's thinker stream waits this long for response.create
