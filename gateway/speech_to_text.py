"""Speech to text by the served model itself: the one transcriber that realtime input transcription
(realtime/transcription.py) and POST /v1/audio/transcriptions and /translations (transcriptions.py)
share.

A transcription is a text-only thinker request: one user turn holding the audio (a 16 kHz
waveform or its features) and then an instruction -- TRANSCRIBE_INSTRUCTION, or TRANSLATE_INSTRUCTION
for a translation into English, with the caller's language and prompt -- at most
`max_tokens(seconds)` tokens, no talker. `transcribe` yields the text as it comes (str pieces) and
then one Transcript: the whole text and the request's token usage."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from voxpipe.client import DoneEvent, TextEvent
from voxpipe.services.runtime.logs import REQUEST_ID
from voxpipe.services.thinker.prompt import AudioInput, ChatMessage, user_turn

from .generation import Generation, speech_request
from .params import GenerationParams

TRANSCRIBE_INSTRUCTION = "Transcribe the audio into text. Reply with the transcript only."
TRANSLATE_INSTRUCTION = "Translate the audio into English. Reply with the English translation only."
# a transcript's length bound: 16 tokens plus 8 a second of audio (ordinary speech is ~3 a second)
MAX_TOKENS_BASE, MAX_TOKENS_PER_SECOND = 16, 8
MAX_PROMPT_CHARS = 4000          # the caller's `prompt` (context for the transcript)
MAX_LANGUAGE_CHARS = 16


def valid_language(code: str) -> bool:
    """A language code such as "en" or "zh-Hans": letters, and hyphens between them."""
    return 0 < len(code) <= MAX_LANGUAGE_CHARS and code.replace("-", "").isalpha()


def instruction(language: str | None = None, prompt: str | None = None, *, translate: bool = False) -> str:
    text = TRANSLATE_INSTRUCTION if translate else TRANSCRIBE_INSTRUCTION
    if language:
        text += f" The speech is in the language with the ISO-639-1 code {language!r}."
    if prompt:
        text += f" Context for the transcript: {prompt}"
    return text


def messages(audio: AudioInput, instruction_text: str) -> list[ChatMessage]:
    """The request's conversation: one user turn, the audio then the instruction."""
    return user_turn(instruction_text, [audio])


def max_tokens(audio_samples: int, sample_rate: int) -> int:
    return MAX_TOKENS_BASE + MAX_TOKENS_PER_SECOND * math.ceil(audio_samples / sample_rate)


@dataclass(frozen=True)
class Transcript:
    text: str
    prompt_tokens: int
    output_tokens: int
    audio_tokens: int               # of prompt_tokens, the audio's placeholders

    def usage(self) -> dict:
        """OpenAI's `tokens` usage object."""
        return {"type": "tokens", "input_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.prompt_tokens + self.output_tokens,
                "input_token_details": {"text_tokens": self.prompt_tokens - self.audio_tokens,
                                        "audio_tokens": self.audio_tokens}}


async def transcribe(gen: Generation, conversation: list[ChatMessage], *, max_new_tokens: int,
                     temperature: float = 0.0, request_id: str | None = None,
                     arrived: float | None = None) -> AsyncIterator[str | Transcript]:
    """Run one transcription: its text pieces (non-empty str) as the thinker makes them, then the
    Transcript. Raises what `gen.render` and `gen.run` raise (APIError, PipelineError)."""
    arrived = time.perf_counter() if arrived is None else arrived
    prompt = await gen.render(conversation)
    req = speech_request(prompt, GenerationParams(max_tokens=max_new_tokens, temperature=temperature),
                         voice="", audio=False)
    if request_id is not None:
        req.request_id = request_id
        REQUEST_ID.set(request_id)
    text, output_tokens = "", 0
    async with aclosing(gen.run(req, arrived)) as events:
        async for ev in events:
            if isinstance(ev, TextEvent):
                output_tokens += len(ev.token_ids)
                if ev.text:
                    text += ev.text
                    yield ev.text
            elif isinstance(ev, DoneEvent):
                output_tokens = ev.completion_tokens or output_tokens
    yield Transcript(text, len(prompt.token_ids), output_tokens, prompt.token_ids.count(gen.audio_token))
