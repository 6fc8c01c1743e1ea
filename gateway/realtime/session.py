"""A realtime session's state: its settings, its conversation (the items every reply reads) and
its input audio buffer. No I/O here; connection.py drives it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch

from voxpipe.services.runtime.echo import quoted
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, Tool, ToolCall, with_instructions

from ..errors import APIError
from ..params import DEFAULT_TEMPERATURE
from ..tool_params import ToolOptions, tool_choice
from .events import (INPUT_SAMPLE_RATE, MAX_INPUT_SECONDS, UNSET, Dialect, NewItem, PartKind, ProtocolError,
                     ResponseOverrides, SessionPatch, TranscriptionPatch, Truncation)
from .vad import ServerVadParams

PCM_FORMAT = {"type": "audio/pcm", "rate": INPUT_SAMPLE_RATE}
PREFERRED_VOICE = "ethan"
MIN_COMMIT_MS = 100                # OpenAI's smallest committable buffer
# a spoken reply whose speech stopped short (max_audio_frames, cancelled, failed): its text is taken as
# spoken at most this fast (320 ms per token, about 3 tokens a second: ordinary speech)
DEFAULT_SAMPLES_PER_TOKEN = 4 * 1920


def ms_to_samples(ms: int) -> int:
    return ms * INPUT_SAMPLE_RATE // 1000


def samples_to_ms(n: int) -> int:
    return n * 1000 // INPUT_SAMPLE_RATE


def default_voice(speakers: dict[str, int]) -> str:
    return PREFERRED_VOICE if PREFERRED_VOICE in speakers or not speakers else sorted(speakers)[0]


def check_voice(voice: str, speakers: dict[str, int], param: str) -> str:
    name = voice.lower()
    if speakers and name not in speakers:
        raise ProtocolError(f"unknown voice {quoted(voice)}; valid voices: {', '.join(sorted(speakers))}", param=param)
    return name


# ----------------------------------------------------------------------------- settings

@dataclass(frozen=True)
class TranscriptionSettings:
    """Input audio transcription is on: each committed user audio item is transcribed by the
    served model (transcription.py)."""

    language: str | None = None
    prompt: str | None = None

    @classmethod
    def of(cls, patch: TranscriptionPatch, served_model: str) -> "TranscriptionSettings":
        if patch.model is not None and patch.model != served_model:
            raise ProtocolError(f"the transcription model {quoted(patch.model)} is not served here: the served model "
                                f"{served_model!r} transcribes (give its id or leave the model unset)",
                                param=f"{patch.param}.model")
        return cls(language=patch.language, prompt=patch.prompt)

    def wire(self, model: str) -> dict[str, Any]:
        return {"model": model, "language": self.language, "prompt": self.prompt}


@dataclass(frozen=True)
class SessionConfig:
    id: str
    model: str
    voice: str
    audio_out: bool = True
    instructions: str = ""
    turn_detection: ServerVadParams | None = field(default_factory=ServerVadParams)
    transcription: TranscriptionSettings | None = None     # None: committed audio is not transcribed
    max_output_tokens: int = 0                 # 0: "inf" (the thinker's default)
    temperature: float = DEFAULT_TEMPERATURE
    ignore_eos: bool = False
    max_audio_frames: int = 0                  # 0: the talker's default
    tools: ToolOptions = ToolOptions()
    truncation: Truncation = Truncation()

    def updated(self, patch: SessionPatch, speakers: dict[str, int]) -> "SessionConfig":
        changes: dict[str, Any] = {}
        if patch.tools is not None or patch.tool_choice is not None or patch.parallel_tool_calls is not None:
            changes["tools"] = realtime_tools(self.tools, patch.tools, patch.tool_choice, "session",
                                              patch.parallel_tool_calls)
        if patch.voice is not None:
            changes["voice"] = check_voice(patch.voice, speakers, "session.audio.output.voice")
        if patch.turn_detection is not UNSET:
            changes["turn_detection"] = patch.turn_detection
        if patch.transcription is not UNSET:
            changes["transcription"] = (None if patch.transcription is None
                                        else TranscriptionSettings.of(patch.transcription, self.model))
        for name in ("audio_out", "instructions", "max_output_tokens", "temperature", "ignore_eos", "max_audio_frames",
                     "truncation"):
            value = getattr(patch, name)
            if value is not None:
                changes[name] = value
        return replace(self, **changes)

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        turn = None if self.turn_detection is None else {"type": "server_vad", **vars(self.turn_detection)}
        limit = self.max_output_tokens or "inf"
        transcription = None if self.transcription is None else self.transcription.wire(self.model)
        vendor = {"temperature": self.temperature, "ignore_eos": self.ignore_eos,
                  "max_audio_frames": self.max_audio_frames or None}
        if dialect is Dialect.BETA:
            return {"id": self.id, "object": "realtime.session", "model": self.model,
                    "modalities": ["audio", "text"] if self.audio_out else ["text"], "instructions": self.instructions,
                    "voice": self.voice, "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                    "input_audio_transcription": transcription, "turn_detection": turn,
                    **tools_wire(self.tools), "max_response_output_tokens": limit,
                    "truncation": self.truncation.wire(), **vendor}
        return {"type": "realtime", "object": "realtime.session", "id": self.id, "model": self.model,
                "output_modalities": ["audio"] if self.audio_out else ["text"], "instructions": self.instructions,
                "audio": {"input": {"format": PCM_FORMAT, "transcription": transcription, "noise_reduction": None,
                                    "turn_detection": turn},
                          "output": {"format": PCM_FORMAT, "voice": self.voice, "speed": 1.0}},
                **tools_wire(self.tools), "max_output_tokens": limit, "truncation": self.truncation.wire(),
                **vendor}


def realtime_tools(current: ToolOptions, tools: tuple[Tool, ...] | None, choice: Any, path: str,
                   parallel: bool | None = None) -> ToolOptions:
    """`current` with a session.update's / response.create's tools, tool_choice and
    parallel_tool_calls on top (a tool_choice naming a function is checked against the tools in
    effect)."""
    new_tools = current.tools if tools is None else tools
    try:
        if choice is None:      # kept, unless it names a function no longer offered
            mode, function = current.choice, current.function
            if mode == "function" and function not in {t.name for t in new_tools}:
                mode, function = "auto", None
        else:
            mode, function = tool_choice(choice, new_tools, f"{path}.tool_choice", nested=False)
        opts = ToolOptions(tools=new_tools, choice=mode, function=function,
                           parallel=current.parallel if parallel is None else parallel)
    except APIError as e:
        raise ProtocolError(e.message, code=e.code or "invalid_value", param=e.param) from None
    return opts


def tools_wire(opts: ToolOptions) -> dict[str, Any]:
    tools = [{"type": "function", **{k: v for k, v in t.template_entry()["function"].items() if k != "strict"}}
             for t in opts.tools]
    choice: Any = {"type": "function", "name": opts.function} if opts.choice == "function" else opts.choice
    return {"tools": tools, "tool_choice": choice}


@dataclass(frozen=True)
class ResponseSettings:
    """One response's settings: the session's with the response.create overrides on top."""

    voice: str
    audio_out: bool
    instructions: str
    max_output_tokens: int
    temperature: float
    ignore_eos: bool
    max_audio_frames: int
    out_of_band: bool = False
    metadata: dict[str, str] | None = None
    tools: ToolOptions = ToolOptions()
    truncation: Truncation = Truncation()

    @classmethod
    def resolve(cls, session: SessionConfig, o: ResponseOverrides, speakers: dict[str, int]) -> "ResponseSettings":
        def pick(name: str):
            value = getattr(o, name)
            return getattr(session, name) if value is None else value

        voice = session.voice if o.voice is None else check_voice(o.voice, speakers, "response.audio.output.voice")
        s = cls(voice=voice, audio_out=pick("audio_out"), instructions=pick("instructions"),
                max_output_tokens=pick("max_output_tokens"), temperature=pick("temperature"),
                ignore_eos=pick("ignore_eos"), max_audio_frames=pick("max_audio_frames"),
                out_of_band=o.out_of_band, metadata=o.metadata, truncation=session.truncation,
                tools=session.tools if o.tools is None and o.tool_choice is None and o.parallel_tool_calls is None
                else realtime_tools(session.tools, o.tools, o.tool_choice, "response", o.parallel_tool_calls))
        if s.ignore_eos and not s.max_output_tokens:
            raise ProtocolError("ignore_eos needs a finite max_output_tokens", param="response.max_output_tokens")
        if s.ignore_eos and s.audio_out and not s.max_audio_frames:
            raise ProtocolError("ignore_eos needs max_audio_frames for a spoken reply",
                                param="response.max_audio_frames")
        return s


# ----------------------------------------------------------------------------- conversation

ItemStatus = Literal["completed", "incomplete", "in_progress"]


@dataclass
class ItemContent:
    kind: PartKind
    text: str = ""                             # input_text / output_text; the transcript of output_audio
    features: torch.Tensor | None = None       # input_audio: the whole clip's log-mel features [mel_bins, frames]
    audio_samples: int = 0                     # input_audio / output_audio: 24 kHz samples (after truncation)
    transcript: str | None = None              # input_audio: its transcription, once completed
    token_ends: list[int] = field(default_factory=list)   # output_audio: len(text) after each text token
    samples_per_token: float = 0.0             # output_audio: the audio time of one text token (see `align`)

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        if self.kind == "input_text":
            return {"type": "input_text", "text": self.text}
        if self.kind == "input_audio":
            return {"type": "input_audio", "transcript": self.transcript}
        beta = dialect is Dialect.BETA
        if self.kind == "output_text":
            return {"type": "text" if beta else "output_text", "text": self.text}
        return {"type": "audio" if beta else "output_audio", "transcript": self.text}

    def add_text(self, tokens: int, text: str) -> None:
        """A text delta of `tokens` tokens. The delta's text is counted as its last token's (a delta of
        several tokens cannot be split), so a cut inside it keeps none of it."""
        self.text += text
        if tokens <= 0:
            if self.token_ends:
                self.token_ends[-1] = len(self.text)
            elif text:
                self.token_ends.append(len(self.text))
            return
        before = self.token_ends[-1] if self.token_ends else 0
        self.token_ends += [before] * (tokens - 1) + [len(self.text)]

    def align(self, samples: int, complete: bool) -> None:
        """How the text maps to the audio time: the speech spends the same time on each text token,
        token k (from 1) of T counted as spoken once k * samples_per_token samples have played. A
        reply whose talker ended the speech itself (`complete`) spreads its T tokens over all of its
        audio; one whose speech stopped short (at max_audio_frames, cancelled, failed: how long the
        whole would have been is unknown) uses the larger of that and DEFAULT_SAMPLES_PER_TOKEN."""
        self.audio_samples = samples
        tokens = len(self.token_ends)
        if not tokens:
            self.samples_per_token = 0.0
            return
        spread = samples / tokens
        self.samples_per_token = spread if complete else max(spread, float(DEFAULT_SAMPLES_PER_TOKEN))

    def spoken_tokens(self, samples: int) -> int:
        """Text tokens spoken in the first `samples` of the audio (see `align`)."""
        if samples <= 0 or not self.token_ends:
            return 0
        if self.samples_per_token <= 0:
            return len(self.token_ends)
        return min(len(self.token_ends), int(samples / self.samples_per_token + 1e-9))

    def truncate_audio(self, samples: int) -> None:
        """Keep the first `samples` of the audio and the text spoken in them (`align`); what was
        cut is gone from the transcript and from every later prompt."""
        keep = self.spoken_tokens(samples)
        self.text = self.text[:self.token_ends[keep - 1]] if keep else ""
        self.token_ends = self.token_ends[:keep]
        self.audio_samples = samples


@dataclass(frozen=True)
class FunctionCall:
    """A function_call item's call (the model's, or one the client created)."""

    call_id: str
    name: str
    arguments: str          # JSON text


@dataclass
class ConversationItem:
    """A message (role, content), a function call (`call`, role assistant) or a function's result
    (`output` answering `call_id`, role user: it renders as a tool turn)."""

    id: str
    role: Literal["user", "assistant", "system"]
    content: list[ItemContent]
    status: ItemStatus = "completed"
    call: FunctionCall | None = None
    call_id: str | None = None              # function_call_output: the call it answers
    output: str | None = None

    def wire(self, dialect: Dialect) -> dict[str, Any]:
        base = {"id": self.id, "object": "realtime.item", "status": self.status}
        if self.call is not None:
            return {**base, "type": "function_call", "call_id": self.call.call_id, "name": self.call.name,
                    "arguments": self.call.arguments}
        if self.output is not None:
            return {**base, "type": "function_call_output", "call_id": self.call_id, "output": self.output}
        return {**base, "type": "message", "role": self.role, "content": [c.wire(dialect) for c in self.content]}

    def chat_message(self) -> ChatMessage | None:
        """This item as a prompt turn: user audio as its stored features; an assistant turn as
        its (possibly truncated) text; a call as an assistant turn with that call; a result as a
        tool turn; None when nothing of it is left."""
        if self.call is not None:
            c = self.call
            return ChatMessage("assistant", [ChatPart(text="")], tool_calls=[ToolCall(c.call_id, c.name, c.arguments)])
        if self.output is not None:
            return ChatMessage("tool", [ChatPart(text=self.output)], tool_call_id=self.call_id)
        if self.role == "user":
            parts = [ChatPart(features=c.features) if c.kind == "input_audio" else ChatPart(text=c.text)
                     for c in self.content]
            return ChatMessage("user", parts)
        text = "".join(c.text for c in self.content)
        return ChatMessage.text(self.role, text) if text or self.role == "system" else None


def prompt_messages(instructions: str, turns: Sequence[tuple[str, ChatMessage | None]]) -> list[ChatMessage]:
    """The prompt's turns from items' (id, turn) pairs: a call right after an assistant turn (its
    text, or other calls of the same reply) joins that turn, as the model wrote them; an assistant
    text right after a turn of calls only (a reply's text written after its calls: its message item
    comes after them) is that turn's text. An assistant reply renders as one turn, its text and its
    calls, whatever the order of its items (as chat's assistant message with `tool_calls`)."""
    out: list[ChatMessage] = []
    for _, m in turns:
        if m is None:
            continue
        if m.tool_calls and out and out[-1].role == "assistant":
            out[-1] = replace(out[-1], tool_calls=[*out[-1].tool_calls, *m.tool_calls])
            continue
        if m.role == "assistant" and not m.tool_calls and out and out[-1].role == "assistant" and out[-1].tool_calls \
                and all(not p.text and p.audio is None and p.features is None for p in out[-1].parts):
            out[-1] = replace(out[-1], parts=m.parts)
            continue
        out.append(m)
    return with_instructions(instructions, out)


class Conversation:
    """The items, in order. Items that truncation took out of the model's context (`dropped`)
    stay in the conversation (retrievable, deletable) but no prompt reads them."""

    def __init__(self) -> None:
        self.items: list[ConversationItem] = []
        self.dropped: set[str] = set()

    def find(self, item_id: str, param: str = "item_id") -> ConversationItem:
        for item in self.items:
            if item.id == item_id:
                return item
        raise ProtocolError(f"no item with id {quoted(item_id)} in the conversation", code="item_not_found", param=param)

    def has(self, item_id: str) -> bool:
        return any(item.id == item_id for item in self.items)

    def insert(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Append, or place after `previous_item_id` ("root": first). Returns the id before it."""
        if self.has(item.id):
            raise ProtocolError(f"an item with id {quoted(item.id)} already exists", code="duplicate_item_id",
                                param="item.id")
        if previous_item_id is None:
            at = len(self.items)
        elif previous_item_id == "root":
            at = 0
        else:
            at = self.items.index(self.find(previous_item_id, "previous_item_id")) + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def set_transcript(self, item_id: str, content_index: int, text: str) -> None:
        """Set a content part's transcript; a no-op when the item or the part is gone."""
        if self.has(item_id):
            item = self.find(item_id)
            if content_index < len(item.content):
                item.content[content_index].transcript = text

    def delete(self, item_id: str) -> None:
        self.items.remove(self.find(item_id))
        self.dropped.discard(item_id)

    def turns(self) -> tuple[tuple[str, ChatMessage | None], ...]:
        """(id, prompt turn) of each item in the model's context, in order (None: nothing of it left)."""
        return tuple((item.id, item.chat_message()) for item in self.items if item.id not in self.dropped)

    def drop(self, item_ids: Sequence[str]) -> None:
        """Take items out of the model's context (truncation)."""
        self.dropped.update(item_ids)

    def messages(self, instructions: str) -> list[ChatMessage]:
        return prompt_messages(instructions, self.turns())

    def has_call(self, call_id: str) -> bool:
        return any(item.call is not None and item.call.call_id == call_id for item in self.items)


def new_item_content(item: NewItem, features_of) -> list[ItemContent]:
    """A client's item parts -> stored content; `features_of(audio_24k)` encodes audio."""
    out = []
    for p in item.parts:
        if p.kind == "input_audio":
            out.append(ItemContent("input_audio", features=features_of(p.audio), audio_samples=len(p.audio)))
        elif p.kind == "output_audio":
            out.append(ItemContent("output_audio", text=p.text or ""))
        else:
            out.append(ItemContent(p.kind, text=p.text or ""))
    return out


# ----------------------------------------------------------------------------- input audio

class InputAudioBuffer:
    """The session's input audio not yet committed, on the session's timeline (samples at 24 kHz
    since the first append)."""

    def __init__(self, max_seconds: int = MAX_INPUT_SECONDS) -> None:
        self.max_samples = max_seconds * INPUT_SAMPLE_RATE
        self.chunks: list[np.ndarray] = []
        self.start = 0                # timeline index of the first buffered sample
        self.end = 0                  # timeline index after the last appended sample

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def end_ms(self) -> int:
        return samples_to_ms(self.end)

    def append(self, samples: np.ndarray) -> None:
        if self.size + len(samples) > self.max_samples:
            raise ProtocolError(f"the input audio buffer holds at most {self.max_samples // INPUT_SAMPLE_RATE} s; "
                                "commit or clear it", code="input_audio_buffer_full", param="audio")
        self.chunks.append(samples.astype(np.float32))
        self.end += len(samples)

    def _all(self) -> np.ndarray:
        if len(self.chunks) != 1:
            self.chunks = [np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.float32)]
        return self.chunks[0]

    def take(self, start: int | None = None, end: int | None = None) -> np.ndarray:
        """The samples in [start, end) of the timeline (clamped to what is buffered); everything
        before `end` leaves the buffer."""
        start = self.start if start is None else min(max(start, self.start), self.end)
        end = self.end if end is None else min(max(end, start), self.end)
        everything = self._all()
        clip = everything[start - self.start:end - self.start].copy()
        self.chunks = [everything[end - self.start:]]
        self.start = end
        return clip

    def peek(self, start: int, end: int) -> np.ndarray:
        """A copy of the samples in [start, end) of the timeline (clamped to what is buffered), left in
        the buffer; it reads only the chunks that hold them (an utterance reads its newest audio)."""
        start, end = min(max(start, self.start), self.end), min(max(end, self.start), self.end)
        pieces, hi = [], self.end            # hi: the timeline index after the chunk below
        for chunk in reversed(self.chunks):
            lo = hi - len(chunk)
            if lo < end and hi > start:
                pieces.append(chunk[max(start, lo) - lo:min(end, hi) - lo])
            if lo <= start:
                break
            hi = lo
        return np.concatenate(pieces[::-1]) if pieces else np.zeros(0, np.float32)

    def drop_before(self, position: int) -> None:
        """Forget audio older than `position` (while no speech is going on)."""
        if position > self.start:
            self.take(end=position)

    def clear(self) -> None:
        self.chunks, self.start = [], self.end
