"""The realtime API's client events, parsed from JSON into dataclasses (every problem a
ProtocolError naming the parameter), in both dialects: OpenAI's GA Realtime API and the older
beta (`OpenAI-Beta: realtime=v1`). Server events live in server_events.py."""

from __future__ import annotations

import base64
import binascii
import enum
import json
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from voxpipe.services.runtime.echo import PARAM_CHARS, bounded_message, clipped, quoted

from voxpipe.services.thinker.prompt import Tool

from ..errors import APIError
from ..limits import UINT32_MAX
from ..speech_to_text import MAX_PROMPT_CHARS, valid_language
from ..tool_params import tool_list
from .vad import ServerVadParams

INPUT_SAMPLE_RATE = 24000      # pcm16 mono, as OpenAI's realtime API
MAX_INPUT_SECONDS = 120        # one user turn's audio: the input audio buffer's cap and an input_audio part's


class Dialect(enum.Enum):
    GA = "ga"
    BETA = "beta"


class ProtocolError(Exception):
    """A client event the server cannot act on; answered with an `error` event, the session goes on."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None,
                 type: str = "invalid_request_error", event_id: str | None = None) -> None:
        message = bounded_message(message)      # the backstop: never unbounded client input
        super().__init__(message)
        self.message, self.code, self.type, self.event_id = message, code, type, event_id
        self.param = None if param is None else clipped(param, PARAM_CHARS)


class Unset(enum.Enum):
    UNSET = "unset"


UNSET = Unset.UNSET


# ----------------------------------------------------------------------------- client events

@dataclass(frozen=True)
class TranscriptionPatch:
    """`audio.input.transcription` (GA) / `input_audio_transcription` (beta): transcribe each
    committed user audio item with the served model. `param`: where it was given (for errors)."""

    param: str
    model: str | None = None                   # the served model's id, or unset
    language: str | None = None                # e.g. "en" (ISO-639-1), put into the transcription prompt
    prompt: str | None = None                  # guidance text, put into the transcription prompt


AUTO_RETENTION_RATIO = 0.8      # "auto": see Truncation


@dataclass(frozen=True)
class Truncation:
    """`session.truncation`, OpenAI's shape: "auto" (the default), "disabled", or {"type":
    "retention_ratio", "retention_ratio": r in [0, 1], "token_limits": {"post_instructions": n}}.
    When a response's prompt (instructions, tools, the conversation) and its reply's room would
    pass the thinker's context (or the conversation after the instructions would pass
    `post_instructions`), the oldest conversation items leave the model's context until the
    conversation after the instructions is at most r times what it may hold (gateway/realtime/
    truncation.py). "auto" is r = AUTO_RETENTION_RATIO: one cut makes room for the next fifth of
    the context, so about four of every five turns after a cut append to a prefix the thinker
    has cached, while most of the conversation stays heard. "disabled": such a response fails
    with a `context_length_exceeded` error."""

    mode: Literal["auto", "disabled", "retention_ratio"] = "auto"
    retention_ratio: float = AUTO_RETENTION_RATIO
    post_instructions: int | None = None       # token_limits.post_instructions (None: the context's room)

    def wire(self) -> Any:
        if self.mode != "retention_ratio":
            return self.mode
        body: dict[str, Any] = {"type": "retention_ratio", "retention_ratio": self.retention_ratio}
        if self.post_instructions is not None:
            body["token_limits"] = {"post_instructions": self.post_instructions}
        return body


@dataclass(frozen=True)
class SessionPatch:
    """The fields a session.update sets; None (or UNSET for turn_detection, where null means
    manual turns) leaves a field as it is."""

    voice: str | None = None
    audio_out: bool | None = None              # output modalities: ["audio"] (with transcript) or ["text"]
    instructions: str | None = None
    turn_detection: ServerVadParams | None | Unset = UNSET
    transcription: TranscriptionPatch | None | Unset = UNSET   # None: transcription off
    max_output_tokens: int | None = None       # 0: no limit ("inf")
    temperature: float | None = None           # vendor fields (beta has temperature too)
    ignore_eos: bool | None = None
    max_audio_frames: int | None = None
    tools: tuple[Tool, ...] | None = None      # session.tools (flat function definitions)
    tool_choice: Any = None                    # session.tool_choice as sent (checked against the tools in effect)
    parallel_tool_calls: bool | None = None    # false: a reply's first call only
    truncation: Truncation | None = None


@dataclass(frozen=True)
class ResponseOverrides:
    """response.create's `response` object: per-response settings over the session's."""

    voice: str | None = None
    audio_out: bool | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    ignore_eos: bool | None = None
    max_audio_frames: int | None = None
    out_of_band: bool = False                  # conversation: "none" - the reply is not added to the conversation
    metadata: dict[str, str] | None = None
    tools: tuple[Tool, ...] | None = None      # response.tools
    tool_choice: Any = None                    # response.tool_choice as sent
    parallel_tool_calls: bool | None = None


PartKind = Literal["input_text", "input_audio", "output_text", "output_audio"]


@dataclass(frozen=True)
class NewPart:
    kind: PartKind
    text: str | None = None                    # input_text / output_text; the transcript of output_audio
    audio: np.ndarray | None = None            # input_audio: float32 mono at INPUT_SAMPLE_RATE


ItemType = Literal["message", "function_call", "function_call_output"]


@dataclass(frozen=True)
class NewItem:
    """A client's item: a message (role, parts), a function call the model made (call_id, name,
    arguments: JSON text) or a function's result (call_id, output)."""

    id: str | None
    role: Literal["user", "assistant", "system"]
    parts: tuple[NewPart, ...]
    type: ItemType = "message"
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


@dataclass(frozen=True)
class SessionUpdate:
    event_id: str | None
    patch: SessionPatch


@dataclass(frozen=True)
class InputAudioAppend:
    event_id: str | None
    audio: np.ndarray                          # float32 mono at INPUT_SAMPLE_RATE


@dataclass(frozen=True)
class InputAudioCommit:
    event_id: str | None


@dataclass(frozen=True)
class InputAudioClear:
    event_id: str | None


@dataclass(frozen=True)
class ItemCreate:
    event_id: str | None
    previous_item_id: str | None
    item: NewItem


@dataclass(frozen=True)
class ItemTruncate:
    event_id: str | None
    item_id: str
    content_index: int
    audio_end_ms: int


@dataclass(frozen=True)
class ItemDelete:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ItemRetrieve:
    event_id: str | None
    item_id: str


@dataclass(frozen=True)
class ResponseCreate:
    event_id: str | None
    overrides: ResponseOverrides = field(default_factory=ResponseOverrides)


@dataclass(frozen=True)
class ResponseCancel:
    event_id: str | None
    response_id: str | None


ClientEvent = (SessionUpdate | InputAudioAppend | InputAudioCommit | InputAudioClear | ItemCreate | ItemTruncate
               | ItemDelete | ItemRetrieve | ResponseCreate | ResponseCancel)


# ----------------------------------------------------------------------------- checked reading

def _kind_name(kinds: tuple[type, ...]) -> str:
    names = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", dict: "an object",
             list: "an array"}
    return "a number" if set(kinds) == {int, float} else " or ".join(names.get(k, k.__name__) for k in kinds)


def _get(obj: dict, key: str, kinds: type | tuple[type, ...], path: str, required: bool = False) -> Any:
    value = obj.get(key)
    name = f"{path}.{key}" if path else key
    if value is None:
        if required:
            raise ProtocolError(f"missing required parameter: '{name}'", code="missing_required_parameter",
                                param=name)
        return None
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ProtocolError(f"'{name}' must be {_kind_name(kinds)}, not {type(value).__name__}",
                            code="invalid_type", param=name)
    return value


# ----------------------------------------------------------------------------- known fields
# The fields OpenAI's realtime API defines for each object a client sends, GA and beta alike (either
# dialect may send the other's names: both are read), and this server's vendor fields. A field the
# server has nothing to do with is accepted with the values that ask nothing of it (model; tracing:
# "auto" or its config, shape-checked -- this server's traces are OpenTelemetry's; include: none;
# reasoning: no effort or effort "none"; prompt: null -- stored prompts live on OpenAI's platform) and refused,
# naming it, with any other value; a field outside these sets is an `unknown_parameter` error, as
# OpenAI's, and the event does nothing. A session object as the server sends it (id, object,
# expires_at, ...) may come back in a session.update.

VENDOR_FIELDS = frozenset({"temperature", "ignore_eos", "max_audio_frames"})
SESSION_FIELDS = frozenset({
    # GA (RealtimeSessionCreateRequest, and the session object sent back)
    "type", "audio", "include", "instructions", "max_output_tokens", "model", "output_modalities",
    "parallel_tool_calls", "prompt", "reasoning", "tool_choice", "tools", "tracing", "truncation",
    "id", "object", "expires_at",
    # beta
    "client_secret", "input_audio_format", "input_audio_noise_reduction", "input_audio_transcription",
    "max_response_output_tokens", "modalities", "output_audio_format", "speed", "turn_detection", "voice",
}) | VENDOR_FIELDS
SESSION_AUDIO_FIELDS = frozenset({"input", "output"})
SESSION_AUDIO_INPUT_FIELDS = frozenset({"format", "noise_reduction", "transcription", "turn_detection"})
SESSION_AUDIO_OUTPUT_FIELDS = frozenset({"format", "speed", "voice"})
RESPONSE_FIELDS = frozenset({
    # GA (RealtimeResponseCreateParams)
    "audio", "conversation", "input", "instructions", "max_output_tokens", "metadata", "output_modalities",
    "parallel_tool_calls", "prompt", "reasoning", "tool_choice", "tools",
    # beta
    "max_response_output_tokens", "modalities", "output_audio_format", "voice",
}) | VENDOR_FIELDS
RESPONSE_AUDIO_FIELDS = frozenset({"output"})
RESPONSE_AUDIO_OUTPUT_FIELDS = frozenset({"format", "voice"})
# an item: message, function_call and function_call_output (GA and beta share these)
ITEM_FIELDS = frozenset({"id", "object", "type", "status", "role", "content", "call_id", "name", "arguments",
                         "output"})
PART_FIELDS = frozenset({"type", "text", "audio", "transcript", "id", "detail", "image_url"})
# turn_detection: GA server_vad / semantic_vad and beta's one flat object (idle_timeout_ms and
# eagerness are accepted and not acted on; semantic_vad itself is refused by its type)
TURN_DETECTION_FIELDS = frozenset({"type", "create_response", "interrupt_response", "idle_timeout_ms",
                                   "prefix_padding_ms", "silence_duration_ms", "threshold", "eagerness"})
# audio.input.transcription (GA) / input_audio_transcription (beta); delay, keywords and languages
# are known but not served (refused when set, by _transcription)
TRANSCRIPTION_KNOWN_FIELDS = frozenset({"model", "language", "prompt", "delay", "keywords", "languages"})
NOISE_REDUCTION_FIELDS = frozenset({"type", "strength"})    # refused unless null: not served
TOOL_FIELDS = frozenset({"type", "name", "description", "parameters"})     # a realtime function tool
TOOL_CHOICE_FIELDS = frozenset({"type", "name", "server_label"})            # function or mcp tool_choice
TRACING_FIELDS = frozenset({"workflow_name", "group_id", "metadata"})


def _known(obj: dict, fields: frozenset[str], path: str) -> None:
    """An `unknown_parameter` error naming the first key of `obj` outside `fields` (the key cut to
    ECHO_CHARS in the message and the param)."""
    for key in obj:
        if key not in fields:
            name = f"{path}.{clipped(str(key))}"
            raise ProtocolError(f"unknown parameter: '{name}'", code="unknown_parameter", param=name)


MAX_OUTPUT_TOKENS = 4096          # OpenAI's range for max_output_tokens: 1 to 4096, or "inf"
MAX_INSTRUCTIONS_CHARS = 16_384   # a session's (or response's) instructions: a system turn of about 4k tokens


def _positive_int(obj: dict, key: str, path: str) -> int | None:
    value = _get(obj, key, int, path)
    if value is not None and not 1 <= value <= UINT32_MAX:
        raise ProtocolError(f"'{path}.{key}' must be an integer from 1 to {UINT32_MAX}, got {value}",
                            param=f"{path}.{key}")
    return value


def _max_tokens(obj: dict, key: str, path: str) -> int | None:
    """An integer in [1, MAX_OUTPUT_TOKENS] or "inf" (-> 0: no limit)."""
    value = obj.get(key)
    if value == "inf":
        return 0
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                              or not 1 <= value <= MAX_OUTPUT_TOKENS):
        raise ProtocolError(f"'{path}.{key}' must be an integer from 1 to {MAX_OUTPUT_TOKENS} or \"inf\", "
                            f"got {quoted(value)}", param=f"{path}.{key}")
    return value


def _instructions(obj: dict, path: str) -> str | None:
    value = _get(obj, "instructions", str, path)
    if value is not None and len(value) > MAX_INSTRUCTIONS_CHARS:
        raise ProtocolError(f"'{path}.instructions' has {len(value)} characters; the limit is {MAX_INSTRUCTIONS_CHARS}",
                            param=f"{path}.instructions")
    return value


def _served_only(obj: dict, key: str, path: str, served: tuple, why: str) -> None:
    """A field this server does not serve: absent or null, or one of the `served` values."""
    value = obj.get(key)
    if value is not None and not any(value == v and type(value) is type(v) for v in served):
        raise ProtocolError(f"'{path}.{key}' {quoted(value)} is not supported: {why}", param=f"{path}.{key}")


def _asks_nothing(obj: dict, path: str) -> None:
    """The fields the API defines for OpenAI's own platform: accepted only with values that ask
    nothing of this server."""
    _served_only(obj, "prompt", path, (), "stored prompts are not served (send 'instructions')")
    # {}: the SDK's RealtimeReasoningParam with no effort (its efforts, minimal to xhigh, all ask for some)
    _served_only(obj, "reasoning", path, ({"effort": "none"}, {}), "the model does not reason first")
    _served_only(obj, "include", path, ([],), "transcription log probabilities are not served")
    tracing = obj.get("tracing")
    if isinstance(tracing, dict):
        _known(tracing, TRACING_FIELDS, f"{path}.tracing")
        for key, kind in (("workflow_name", str), ("group_id", str), ("metadata", dict)):
            _get(tracing, key, kind, f"{path}.tracing")
    elif tracing not in (None, "auto"):
        raise ProtocolError(f"'{path}.tracing' must be \"auto\", null or a tracing configuration object, got "
                            f"{quoted(tracing)}", param=f"{path}.tracing")


def _temperature(obj: dict, path: str) -> float | None:
    value = _get(obj, "temperature", (int, float), path)
    if value is not None and not 0.0 <= value <= 2.0:
        raise ProtocolError(f"'{path}.temperature' must be between 0 and 2, got {value}", param=f"{path}.temperature")
    return None if value is None else float(value)


def _modalities(obj: dict, path: str) -> bool | None:
    """GA `output_modalities` or beta `modalities` -> whether the reply is spoken."""
    for key in ("output_modalities", "modalities"):
        value = _get(obj, key, list, path)
        if value is None:
            continue
        if not value or any(m not in ("text", "audio") for m in value):
            raise ProtocolError(f"'{path}.{key}' must be [\"audio\"] or [\"text\"], got {quoted(value)}",
                                param=f"{path}.{key}")
        return "audio" in value
    return None


def _audio_format(value: Any, param: str) -> None:
    """Only 24 kHz pcm16 is spoken here: GA {"type": "audio/pcm", "rate": 24000} or beta "pcm16"."""
    if value is None or value == "pcm16":
        return
    if isinstance(value, dict) and value.get("type", "audio/pcm") == "audio/pcm" \
            and value.get("rate", INPUT_SAMPLE_RATE) == INPUT_SAMPLE_RATE:
        return
    raise ProtocolError(f"'{param}' {quoted(value)} is not supported; use {{\"type\": \"audio/pcm\", \"rate\": 24000}} "
                        "(beta: \"pcm16\")", param=param)


def _turn_detection(value: Any, param: str) -> ServerVadParams | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be an object or null", code="invalid_type", param=param)
    _known(value, TURN_DETECTION_FIELDS, param)
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise ProtocolError(f"'{param}.type' {quoted(kind)} is not supported; use \"server_vad\" or null",
                            param=f"{param}.type")
    d = ServerVadParams()
    threshold = _get(value, "threshold", (int, float), param)
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ProtocolError(f"'{param}.threshold' must be between 0 and 1, got {threshold}", param=f"{param}.threshold")
    prefix = _get(value, "prefix_padding_ms", int, param)
    silence = _get(value, "silence_duration_ms", int, param)
    for key, ms in (("prefix_padding_ms", prefix), ("silence_duration_ms", silence)):
        if ms is not None and not 0 <= ms <= 10000:
            raise ProtocolError(f"'{param}.{key}' must be between 0 and 10000, got {ms}", param=f"{param}.{key}")
    create = _get(value, "create_response", bool, param)
    interrupt = _get(value, "interrupt_response", bool, param)
    return ServerVadParams(threshold=d.threshold if threshold is None else float(threshold),
                           prefix_padding_ms=d.prefix_padding_ms if prefix is None else prefix,
                           silence_duration_ms=d.silence_duration_ms if silence is None else silence,
                           create_response=d.create_response if create is None else create,
                           interrupt_response=d.interrupt_response if interrupt is None else interrupt)


TRANSCRIPTION_FIELDS = ("model", "language", "prompt")


def _transcription(value: Any, param: str) -> TranscriptionPatch | None:
    """The transcription object (null: off). Fields other than model, language and prompt are
    refused when set: they are not served."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be an object or null", code="invalid_type", param=param)
    _known(value, TRANSCRIPTION_KNOWN_FIELDS, param)
    for key, v in value.items():
        if key not in TRANSCRIPTION_FIELDS and v is not None:
            raise ProtocolError(f"'{param}.{clipped(key)}' is not supported; set only {', '.join(TRANSCRIPTION_FIELDS)}",
                                param=f"{param}.{key}")
    language = _get(value, "language", str, param)
    if language is not None and not valid_language(language):
        raise ProtocolError(f"'{param}.language' must be a language code such as \"en\", got {quoted(language)}",
                            param=f"{param}.language")
    prompt = _get(value, "prompt", str, param)
    if prompt is not None and len(prompt) > MAX_PROMPT_CHARS:
        raise ProtocolError(f"'{param}.prompt' has {len(prompt)} characters; the limit is "
                            f"{MAX_PROMPT_CHARS}", param=f"{param}.prompt")
    return TranscriptionPatch(param=param, model=_get(value, "model", str, param), language=language,
                              prompt=prompt or None)


def _truncation(value: Any, param: str) -> Truncation | None:
    """session.truncation (None: unchanged)."""
    if value is None:
        return None
    if value in ("auto", "disabled"):
        return Truncation(mode=value)
    if isinstance(value, str):
        raise ProtocolError(f"'{param}' must be \"auto\", \"disabled\" or a retention_ratio object, got "
                            f"{quoted(value)}", param=param)
    if not isinstance(value, dict):
        raise ProtocolError(f"'{param}' must be a string or an object", code="invalid_type", param=param)
    for key in value:
        if key not in ("type", "retention_ratio", "token_limits"):
            raise ProtocolError(f"'{param}.{clipped(key)}' is not a truncation field; set type, retention_ratio "
                                "and token_limits", param=f"{param}.{key}")
    if value.get("type") != "retention_ratio":
        raise ProtocolError(f"'{param}.type' must be \"retention_ratio\", got {quoted(value.get('type'))}",
                            param=f"{param}.type")
    ratio = _get(value, "retention_ratio", (int, float), param, required=True)
    if not 0.0 <= ratio <= 1.0:
        raise ProtocolError(f"'{param}.retention_ratio' must be between 0 and 1, got {ratio}",
                            param=f"{param}.retention_ratio")
    limits = _get(value, "token_limits", dict, param) or {}
    for key in limits:
        if key != "post_instructions":
            raise ProtocolError(f"'{param}.token_limits.{clipped(key)}' is not a token limit; set post_instructions",
                                param=f"{param}.token_limits.{key}")
    post = _positive_int(limits, "post_instructions", f"{param}.token_limits")
    return Truncation(mode="retention_ratio", retention_ratio=float(ratio), post_instructions=post)


def _voice(value: Any, param: str) -> str | None:
    if isinstance(value, dict):                 # GA custom voice form {"id": name}
        value = value.get("id")
        param = f"{param}.id"
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ProtocolError(f"'{param}' must be a voice name", code="invalid_type", param=param)
    return value


def decode_pcm16(data: Any, param: str) -> np.ndarray:
    """base64 pcm16 little-endian mono -> float32 in [-1, 1]."""
    if not isinstance(data, str):
        raise ProtocolError(f"'{param}' must be a base64 string", code="invalid_type", param=param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ProtocolError(f"'{param}' is not valid base64 ({e})", code="invalid_base64", param=param) from None
    if len(raw) % 2:
        raise ProtocolError(f"'{param}' has an odd number of bytes; pcm16 samples are 2 bytes each",
                            param=param)
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


def _session_patch(s: Any) -> SessionPatch:
    if not isinstance(s, dict):
        raise ProtocolError("'session' must be an object", code="invalid_type", param="session")
    _known(s, SESSION_FIELDS, "session")
    if s.get("type", "realtime") != "realtime":
        raise ProtocolError(f"'session.type' {quoted(s.get('type'))} is not supported; use \"realtime\"",
                            param="session.type")
    _asks_nothing(s, "session")
    audio = _get(s, "audio", dict, "session") or {}
    _known(audio, SESSION_AUDIO_FIELDS, "session.audio")
    audio_in = _get(audio, "input", dict, "session.audio") or {}
    audio_out = _get(audio, "output", dict, "session.audio") or {}
    _known(audio_in, SESSION_AUDIO_INPUT_FIELDS, "session.audio.input")
    _known(audio_out, SESSION_AUDIO_OUTPUT_FIELDS, "session.audio.output")
    _audio_format(audio_in.get("format"), "session.audio.input.format")
    _audio_format(audio_out.get("format"), "session.audio.output.format")
    _audio_format(s.get("input_audio_format"), "session.input_audio_format")
    _audio_format(s.get("output_audio_format"), "session.output_audio_format")
    _served_only(audio_out, "speed", "session.audio.output", (1, 1.0), "replies are spoken at speed 1.0")
    _served_only(s, "speed", "session", (1, 1.0), "replies are spoken at speed 1.0")
    for obj, key, path in ((audio_in, "noise_reduction", "session.audio.input"),
                           (s, "input_audio_noise_reduction", "session")):
        if isinstance(obj.get(key), dict):
            _known(obj[key], NOISE_REDUCTION_FIELDS, f"{path}.{key}")
    _served_only(audio_in, "noise_reduction", "session.audio.input", (), "input audio is not noise-reduced (null)")
    _served_only(s, "input_audio_noise_reduction", "session", (), "input audio is not noise-reduced (null)")
    if "turn_detection" in audio_in:
        turn: ServerVadParams | None | Unset = _turn_detection(audio_in["turn_detection"],
                                                                "session.audio.input.turn_detection")
    elif "turn_detection" in s:
        turn = _turn_detection(s["turn_detection"], "session.turn_detection")
    else:
        turn = UNSET
    if "transcription" in audio_in:
        transcription: TranscriptionPatch | None | Unset = _transcription(
            audio_in["transcription"], "session.audio.input.transcription")
    elif "input_audio_transcription" in s:
        transcription = _transcription(s["input_audio_transcription"], "session.input_audio_transcription")
    else:
        transcription = UNSET
    voice = _voice(audio_out.get("voice"), "session.audio.output.voice") or _voice(s.get("voice"), "session.voice")
    max_tokens = _max_tokens(s, "max_output_tokens", "session")
    if max_tokens is None:
        max_tokens = _max_tokens(s, "max_response_output_tokens", "session")
    ignore_eos = _get(s, "ignore_eos", bool, "session")
    return SessionPatch(voice=voice, audio_out=_modalities(s, "session"),
                        instructions=_instructions(s, "session"), turn_detection=turn,
                        transcription=transcription, max_output_tokens=max_tokens,
                        temperature=_temperature(s, "session"), ignore_eos=ignore_eos,
                        max_audio_frames=_positive_int(s, "max_audio_frames", "session"),
                        tools=_tools(s, "session"), tool_choice=_tool_choice(s, "session"),
                        parallel_tool_calls=_get(s, "parallel_tool_calls", bool, "session"),
                        truncation=_truncation(s.get("truncation"), "session.truncation"))


def _response_overrides(r: Any) -> ResponseOverrides:
    if r is None:
        return ResponseOverrides()
    if not isinstance(r, dict):
        raise ProtocolError("'response' must be an object", code="invalid_type", param="response")
    _known(r, RESPONSE_FIELDS, "response")
    _asks_nothing(r, "response")
    if r.get("input") is not None:
        raise ProtocolError("'response.input' is not supported; the reply always reads the conversation",
                            param="response.input")
    conversation = r.get("conversation", "auto")
    if conversation not in ("auto", "none", None):
        raise ProtocolError(f"'response.conversation' must be \"auto\" or \"none\", got {quoted(conversation)}",
                            param="response.conversation")
    audio = _get(r, "audio", dict, "response") or {}
    _known(audio, RESPONSE_AUDIO_FIELDS, "response.audio")
    audio_out = _get(audio, "output", dict, "response.audio") or {}
    _known(audio_out, RESPONSE_AUDIO_OUTPUT_FIELDS, "response.audio.output")
    _audio_format(audio_out.get("format"), "response.audio.output.format")
    _audio_format(r.get("output_audio_format"), "response.output_audio_format")
    voice = _voice(audio_out.get("voice"), "response.audio.output.voice") or _voice(r.get("voice"), "response.voice")
    max_tokens = _max_tokens(r, "max_output_tokens", "response")
    if max_tokens is None:
        max_tokens = _max_tokens(r, "max_response_output_tokens", "response")
    metadata = _get(r, "metadata", dict, "response")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ProtocolError("'response.metadata' must map strings to strings", code="invalid_type",
                            param="response.metadata")
    # OpenAI's bounds (as chat's): response.created and response.done echo the metadata back
    if metadata is not None and (len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items())):
        raise ProtocolError("'response.metadata' must have at most 16 pairs, keys up to 64 and values up to 512 "
                            "characters", param="response.metadata")
    return ResponseOverrides(voice=voice, audio_out=_modalities(r, "response"),
                             instructions=_instructions(r, "response"), max_output_tokens=max_tokens,
                             temperature=_temperature(r, "response"),
                             ignore_eos=_get(r, "ignore_eos", bool, "response"),
                             max_audio_frames=_positive_int(r, "max_audio_frames", "response"),
                             out_of_band=conversation == "none", metadata=metadata,
                             tools=_tools(r, "response"), tool_choice=_tool_choice(r, "response"),
                             parallel_tool_calls=_get(r, "parallel_tool_calls", bool, "response"))


def _tools(obj: dict, path: str) -> tuple[Tool, ...] | None:
    """`tools`: flat function definitions ({"type": "function", "name", "description", "parameters"})."""
    if obj.get("tools") is None:
        return None
    if isinstance(obj["tools"], list):
        for i, entry in enumerate(obj["tools"]):
            if isinstance(entry, dict):
                _known(entry, TOOL_FIELDS, f"{path}.tools[{i}]")
    try:
        return tool_list(obj["tools"], f"{path}.tools", nested=False)
    except APIError as e:
        raise ProtocolError(e.message, code=e.code or "invalid_value", param=e.param) from None


def _tool_choice(obj: dict, path: str) -> Any:
    """`tool_choice` as sent (checked against the tools in effect when applied); an object's keys
    are OpenAI's function / mcp choice fields."""
    value = obj.get("tool_choice")
    if isinstance(value, dict):
        _known(value, TOOL_CHOICE_FIELDS, f"{path}.tool_choice")
    return value


_USER_KINDS = {"input_text": "input_text", "input_audio": "input_audio"}
_SYSTEM_KINDS = {"input_text": "input_text"}
_ASSISTANT_KINDS = {"output_text": "output_text", "text": "output_text", "output_audio": "output_audio",
                    "audio": "output_audio"}


def _part(p: Any, role: str, path: str) -> NewPart:
    if not isinstance(p, dict):
        raise ProtocolError(f"'{path}' must be an object", code="invalid_type", param=path)
    _known(p, PART_FIELDS, path)
    kind = p.get("type")
    allowed = {"user": _USER_KINDS, "assistant": _ASSISTANT_KINDS}.get(role, _SYSTEM_KINDS)
    if kind not in allowed:
        raise ProtocolError(f"'{path}.type' {quoted(kind)} is not supported for a {role} message; use one of: "
                            f"{', '.join(allowed)}", param=f"{path}.type")
    norm = allowed[kind]
    if norm == "input_audio":
        audio = decode_pcm16(p.get("audio"), f"{path}.audio")
        if audio.size == 0:
            raise ProtocolError(f"'{path}.audio' is empty", param=f"{path}.audio")
        if audio.size > MAX_INPUT_SECONDS * INPUT_SAMPLE_RATE:
            raise ProtocolError(f"'{path}.audio' is {audio.size / INPUT_SAMPLE_RATE:.0f} s long; the limit is "
                                f"{MAX_INPUT_SECONDS} s", param=f"{path}.audio")
        return NewPart("input_audio", audio=audio)
    if norm == "output_audio":
        return NewPart("output_audio", text=_get(p, "transcript", str, path) or "")
    return NewPart(norm, text=_get(p, "text", str, path, required=True))


def _new_item(item: Any) -> NewItem:
    if not isinstance(item, dict):
        raise ProtocolError("'item' must be an object", code="invalid_type", param="item")
    _known(item, ITEM_FIELDS, "item")
    kind = item.get("type", "message")
    item_id = _get(item, "id", str, "item")
    if item_id is not None and not 0 < len(item_id) <= 64:
        raise ProtocolError("'item.id' must be 1 to 64 characters", param="item.id")
    if kind in ("function_call", "function_call_output"):
        return _function_item(item, kind, item_id)
    if kind != "message":
        raise ProtocolError(f"'item.type' {quoted(kind)} is not supported; use \"message\", \"function_call\" or "
                            "\"function_call_output\"", param="item.type")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError(f"'item.role' must be user, assistant or system, got {quoted(role)}", param="item.role")
    content = _get(item, "content", list, "item", required=True)
    if not content:
        raise ProtocolError("'item.content' must not be empty", param="item.content")
    parts = tuple(_part(p, role, f"item.content[{i}]") for i, p in enumerate(content))
    return NewItem(item_id, role, parts)


MAX_CALL_ID_CHARS = 64


def _function_item(item: dict, kind: str, item_id: str | None) -> NewItem:
    call_id = _get(item, "call_id", str, "item", required=True)
    if not 0 < len(call_id) <= MAX_CALL_ID_CHARS:
        raise ProtocolError(f"'item.call_id' must be 1 to {MAX_CALL_ID_CHARS} characters", param="item.call_id")
    if kind == "function_call_output":
        return NewItem(item_id, "user", (), type="function_call_output", call_id=call_id,
                       output=_get(item, "output", str, "item", required=True))
    name = _get(item, "name", str, "item", required=True)
    if not 0 < len(name) <= 64:
        raise ProtocolError("'item.name' must be 1 to 64 characters", param="item.name")
    return NewItem(item_id, "assistant", (), type="function_call", call_id=call_id, name=name,
                   arguments=_get(item, "arguments", str, "item") or "{}")


def _parse(e: dict, kind: str, event_id: str | None) -> ClientEvent:
    if kind == "session.update":
        return SessionUpdate(event_id, _session_patch(e.get("session")))
    if kind == "input_audio_buffer.append":
        if e.get("audio") is None:
            raise ProtocolError("missing required parameter: 'audio'", code="missing_required_parameter", param="audio")
        return InputAudioAppend(event_id, decode_pcm16(e["audio"], "audio"))
    if kind == "input_audio_buffer.commit":
        return InputAudioCommit(event_id)
    if kind == "input_audio_buffer.clear":
        return InputAudioClear(event_id)
    if kind == "conversation.item.create":
        return ItemCreate(event_id, _get(e, "previous_item_id", str, ""), _new_item(e.get("item")))
    if kind == "conversation.item.truncate":
        content_index = _get(e, "content_index", int, "", required=True)
        audio_end_ms = _get(e, "audio_end_ms", int, "", required=True)
        if audio_end_ms < 0:
            raise ProtocolError(f"'audio_end_ms' must be >= 0, got {audio_end_ms}", param="audio_end_ms")
        return ItemTruncate(event_id, _get(e, "item_id", str, "", required=True), content_index, audio_end_ms)
    if kind == "conversation.item.delete":
        return ItemDelete(event_id, _get(e, "item_id", str, "", required=True))
    if kind == "conversation.item.retrieve":
        return ItemRetrieve(event_id, _get(e, "item_id", str, "", required=True))
    if kind == "response.create":
        return ResponseCreate(event_id, _response_overrides(e.get("response")))
    if kind == "response.cancel":
        return ResponseCancel(event_id, _get(e, "response_id", str, ""))
    raise ProtocolError(f"unknown event type {quoted(kind)}", code="invalid_value", param="type")


CLIENT_EVENT_TYPES = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                      "input_audio_buffer.clear", "conversation.item.create", "conversation.item.truncate",
                      "conversation.item.delete", "conversation.item.retrieve", "response.create", "response.cancel")


def parse_client_event(text: str) -> ClientEvent:
    try:
        e = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProtocolError(f"the message is not valid JSON ({err})", code="invalid_json") from None
    except RecursionError:
        raise ProtocolError("the message is nested too deeply", code="invalid_json") from None
    if not isinstance(e, dict):
        raise ProtocolError("an event must be a JSON object", code="invalid_json")
    event_id = e.get("event_id") if isinstance(e.get("event_id"), str) else None
    kind = e.get("type")
    if not isinstance(kind, str):
        raise ProtocolError("missing required parameter: 'type'", code="missing_required_parameter", param="type",
                            event_id=event_id)
    if kind not in CLIENT_EVENT_TYPES:
        raise ProtocolError(f"unknown event type {quoted(kind)}; supported: {', '.join(CLIENT_EVENT_TYPES)}",
                            code="unknown_event_type", param="type", event_id=event_id)
    try:
        return _parse(e, kind, event_id)
    except ProtocolError as err:
        err.event_id = event_id
        raise
