"""Input audio transcription in a realtime session, by the served model itself.

With `audio.input.transcription` (GA) / `input_audio_transcription` (beta) set, every committed
user audio item (server VAD or input_audio_buffer.commit) is transcribed by a text-only request
to the thinker: one user turn holding the item's audio (its stored features) and an instruction
(speech_to_text.TRANSCRIBE_INSTRUCTION, with the configured language and prompt), greedy, no talker. Its text
comes back as `conversation.item.input_audio_transcription.delta` events and one `.completed`
(with the request's token usage; `.failed` when it fails), and becomes the item's `transcript`.

It runs beside the session's responses and a response never waits for it (after a server VAD
commit the response is started first; both are requests in the thinker's batch). A session's
transcriptions run one at a time, in commit order. Each is
one more thinker request (counted in voxpipe_gateway_active_streams and the thinker's own
gauges, and by outcome in voxpipe_gateway_transcriptions_total); it holds no --max-sessions slot
of its own (the session's covers it), its tokens are not in any response's usage, and it is
cancelled when the session ends.

What the transcriber uses of its session is all in the TranscriptionContext it is given (the
connection makes it): `generation` (the gateway's rendering and pipeline), `emit` (send a server
event, server_events.Emit), `set_transcript(item_id, content_index, text)` (a no-op for an item no
longer in the conversation) and `count(outcome)` (voxpipe_gateway_transcriptions_total)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

import torch

from voxpipe.client import PipelineError
from voxpipe.services.thinker.prompt import ChatMessage

from .. import speech_to_text
from ..errors import APIError, from_pipeline_error
from ..generation import Generation
from ..speech_to_text import Transcript
from .events import INPUT_SAMPLE_RATE
from .server_events import (Emit, InputTranscriptionCompleted, InputTranscriptionDelta, InputTranscriptionFailed,
                            TranscriptionError, TranscriptionUsage)
from .session import TranscriptionSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TranscriptionJob:
    item_id: str
    content_index: int
    features: torch.Tensor            # the committed audio's log-mel features, as the item stores them
    audio_samples: int                # at 24 kHz
    settings: TranscriptionSettings


def transcription_messages(job: TranscriptionJob) -> list[ChatMessage]:
    """The transcription request's conversation: one user turn, the audio then the instruction."""
    return speech_to_text.messages(job.features, speech_to_text.instruction(job.settings.language,
                                                                            job.settings.prompt))


def max_tokens(audio_samples: int) -> int:
    """The transcript's token bound for `audio_samples` at the realtime input rate (24 kHz)."""
    return speech_to_text.max_tokens(audio_samples, INPUT_SAMPLE_RATE)


@dataclass(frozen=True)
class TranscriptionContext:
    """What the transcriber uses of its session (see the module's docstring)."""

    generation: Generation
    emit: Emit
    set_transcript: Callable[[str, int, str], None]
    count: Callable[[str], None]


class Transcriber:
    """One session's transcriptions: submitted jobs run one at a time, in order, on their own task."""

    def __init__(self, ctx: TranscriptionContext) -> None:
        self.ctx = ctx
        self.jobs: asyncio.Queue[TranscriptionJob] = asyncio.Queue()
        self.task: asyncio.Task | None = None

    def submit(self, job: TranscriptionJob) -> None:
        self.jobs.put_nowait(job)
        if self.task is None:
            self.task = asyncio.ensure_future(self._work())

    async def close(self) -> None:
        """Cancel what runs (its thinker request is freed) and what waits."""
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _work(self) -> None:
        while True:
            job = await self.jobs.get()
            try:
                await self._transcribe(job)
            except asyncio.CancelledError:
                self.ctx.count("cancelled")
                raise

    async def _transcribe(self, job: TranscriptionJob) -> None:
        emit = self.ctx.emit
        arrived = time.perf_counter()
        done: Transcript | None = None
        try:
            pieces = speech_to_text.transcribe(self.ctx.generation, transcription_messages(job),
                                               max_new_tokens=max_tokens(job.audio_samples),
                                               request_id=f"{job.item_id}-transcription", arrived=arrived)
            async with aclosing(pieces):
                async for piece in pieces:
                    if isinstance(piece, Transcript):
                        done = piece
                    else:
                        await emit(InputTranscriptionDelta(job.item_id, job.content_index, piece))
        except PipelineError as e:
            await self._failed(job, from_pipeline_error(e))
            return
        except APIError as e:
            await self._failed(job, e)
            return
        except Exception:
            log.exception("transcribing realtime item %s failed", job.item_id)
            await self._failed(job, APIError(500, "the server failed while transcribing this audio",
                                             type="server_error", code="server_error"))
            return
        self.ctx.set_transcript(job.item_id, job.content_index, done.text)
        self.ctx.count("completed")
        await emit(InputTranscriptionCompleted(job.item_id, job.content_index, done.text,
                                               TranscriptionUsage(done.prompt_tokens, done.output_tokens,
                                                                  done.audio_tokens)))

    async def _failed(self, job: TranscriptionJob, e: APIError) -> None:
        log.info("transcribing realtime item %s failed: %s", job.item_id, e.message)
        self.ctx.count("failed")
        await self.ctx.emit(InputTranscriptionFailed(job.item_id, job.content_index,
                                                     TranscriptionError(e.type, e.code, e.message, e.param)))
