"""The realtime API's server events. Each is a dataclass with its GA and beta type names; a
field that is an object with `wire(dialect)` (an item, a response, the session) is rendered in
the connection's dialect when the event is queued, so the JSON is a snapshot of that moment."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol

from .events import Dialect, ProtocolError


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ServerEvent:
    GA: ClassVar[str]
    BETA: ClassVar[str | None] = None       # None: the beta API has no such event

    def wire(self, dialect: Dialect) -> dict[str, Any] | None:
        name = self.GA if dialect is Dialect.GA else self.BETA
        if name is None:
            return None
        body: dict[str, Any] = {"type": name, "event_id": new_id("event")}
        for f in fields(self):
            value = getattr(self, f.name)
            body[f.name] = value.wire(dialect) if hasattr(value, "wire") else value
        return body


class Emit(Protocol):
    """How the session's producers (the event handlers, a response run, the transcriber) send a
    server event: rendered in the session's dialect and queued in its outbox (RealtimeConnection.
    emit). An audio delta names its response and its samples; `on_sent(samples)` is called once
    it is written to the socket."""

    async def __call__(self, event: ServerEvent, *, response_id: str | None = None, audio_samples: int = 0,
                       on_sent: Callable[[int], None] | None = None) -> None: ...


def _same(cls):
    cls.BETA = cls.GA
    return cls


@_same
@dataclass
class SessionCreated(ServerEvent):
    GA = "session.created"
    session: Any


@_same
@dataclass
class SessionUpdated(ServerEvent):
    GA = "session.updated"
    session: Any


@dataclass
class ErrorDetails:
    type: str
    code: str | None
    message: str
    param: str | None
    event_id: str | None

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message, "param": self.param,
                "event_id": self.event_id}


@_same
@dataclass
class Error(ServerEvent):
    GA = "error"
    error: ErrorDetails

    @classmethod
    def of(cls, e: ProtocolError) -> "Error":
        return cls(ErrorDetails(e.type, e.code, e.message, e.param, e.event_id))


@_same
@dataclass
class InputAudioCommitted(ServerEvent):
    GA = "input_audio_buffer.committed"
    previous_item_id: str | None
    item_id: str


@_same
@dataclass
class InputAudioCleared(ServerEvent):
    GA = "input_audio_buffer.cleared"


@_same
@dataclass
class SpeechStartedEvent(ServerEvent):
    GA = "input_audio_buffer.speech_started"
    audio_start_ms: int
    item_id: str


@_same
@dataclass
class SpeechStoppedEvent(ServerEvent):
    GA = "input_audio_buffer.speech_stopped"
    audio_end_ms: int
    item_id: str


@dataclass
class ItemAdded(ServerEvent):
    GA, BETA = "conversation.item.added", "conversation.item.created"
    previous_item_id: str | None
    item: Any


@dataclass
class ItemDone(ServerEvent):
    GA = "conversation.item.done"
    previous_item_id: str | None
    item: Any


@_same
@dataclass
class ItemTruncated(ServerEvent):
    GA = "conversation.item.truncated"
    item_id: str
    content_index: int
    audio_end_ms: int


@_same
@dataclass
class ItemDeleted(ServerEvent):
    GA = "conversation.item.deleted"
    item_id: str


@_same
@dataclass
class ItemRetrieved(ServerEvent):
    GA = "conversation.item.retrieved"
    item: Any


@_same
@dataclass
class ResponseCreated(ServerEvent):
    GA = "response.created"
    response: Any


@_same
@dataclass
class ResponseDone(ServerEvent):
    GA = "response.done"
    response: Any


@_same
@dataclass
class OutputItemAdded(ServerEvent):
    GA = "response.output_item.added"
    response_id: str
    output_index: int
    item: Any


@_same
@dataclass
class OutputItemDone(ServerEvent):
    GA = "response.output_item.done"
    response_id: str
    output_index: int
    item: Any


@dataclass
class ContentPart:
    audio: bool                    # "audio" (with transcript) or "text"
    text: str = ""

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        return {"type": "audio", "transcript": self.text} if self.audio else {"type": "text", "text": self.text}


@dataclass
class _PartEvent(ServerEvent):
    response_id: str
    item_id: str
    output_index: int
    content_index: int


@_same
@dataclass
class ContentPartAdded(_PartEvent):
    GA = "response.content_part.added"
    part: ContentPart


@_same
@dataclass
class ContentPartDone(_PartEvent):
    GA = "response.content_part.done"
    part: ContentPart


@dataclass
class AudioDelta(_PartEvent):
    GA, BETA = "response.output_audio.delta", "response.audio.delta"
    delta: str                     # base64 pcm16 24 kHz mono


@dataclass
class AudioDone(_PartEvent):
    GA, BETA = "response.output_audio.done", "response.audio.done"


@dataclass
class TranscriptDelta(_PartEvent):
    GA, BETA = "response.output_audio_transcript.delta", "response.audio_transcript.delta"
    delta: str


@dataclass
class TranscriptDone(_PartEvent):
    GA, BETA = "response.output_audio_transcript.done", "response.audio_transcript.done"
    transcript: str


@dataclass
class TextDelta(_PartEvent):
    GA, BETA = "response.output_text.delta", "response.text.delta"
    delta: str


@dataclass
class TextDone(_PartEvent):
    GA, BETA = "response.output_text.done", "response.text.done"
    text: str


# ----------------------------------------------------------------------------- input audio transcription

@dataclass
class TranscriptionUsage:
    """The transcription request's tokens (the `tokens` form of OpenAI's usage)."""

    input_tokens: int
    output_tokens: int
    input_audio_tokens: int

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        return {"type": "tokens", "input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,
                "input_token_details": {"text_tokens": self.input_tokens - self.input_audio_tokens,
                                        "audio_tokens": self.input_audio_tokens}}


@dataclass
class TranscriptionError:
    type: str
    code: str | None
    message: str
    param: str | None = None

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        return {"type": self.type, "code": self.code, "message": self.message, "param": self.param}


@_same
@dataclass
class InputTranscriptionDelta(ServerEvent):
    GA = "conversation.item.input_audio_transcription.delta"
    item_id: str
    content_index: int
    delta: str


@_same
@dataclass
class InputTranscriptionCompleted(ServerEvent):
    GA = "conversation.item.input_audio_transcription.completed"
    item_id: str
    content_index: int
    transcript: str
    usage: TranscriptionUsage


@_same
@dataclass
class InputTranscriptionFailed(ServerEvent):
    GA = "conversation.item.input_audio_transcription.failed"
    item_id: str
    content_index: int
    error: TranscriptionError


@_same
@dataclass
class FunctionCallArgumentsDelta(ServerEvent):
    GA = "response.function_call_arguments.delta"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    delta: str


@_same
@dataclass
class FunctionCallArgumentsDone(ServerEvent):
    GA = "response.function_call_arguments.done"
    response_id: str
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: str
