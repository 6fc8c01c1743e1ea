"""OpenAI chat `messages` -> our ChatMessage list (audio parts as their log-mel features, decoded
and featurized once per distinct clip: clip_cache.py).

Roles: system (and developer, its newer name), user, assistant, tool. Content: a string or parts
of type `text` and `input_audio` ({data: base64, format}). An assistant turn may carry
`audio: {id}` naming an earlier spoken reply (its stored transcript is that turn's text) and
`tool_calls` (function calls: id, type, function.name, function.arguments as JSON text); a tool
turn is a function's result (text) and names, in `tool_call_id`, a call of an earlier turn."""

from __future__ import annotations

from typing import Any

from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, ToolCall

from voxpipe.services.runtime.echo import clipped, quoted

from .audio_formats import decode_base64
from .clip_cache import ClipCache
from .errors import bad_request
from .transcripts import TranscriptStore

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# the fields OpenAI defines for each role's message ('name' is accepted and checked, and not rendered: the
# checkpoint's chat template has no place for a participant's name); an assistant message may be a reply
# sent back as it came (its 'annotations', its audio's data / expires_at / transcript: the id names the
# reply); anything else is a 400 naming it. The openai SDK's own helpers (chat.completions.stream /
# parse) add fields to the message they hand back -- its 'parsed', a call's 'index' (from the
# stream's deltas), its function's 'parsed_arguments' -- and that message sent back as it came is
# the SDK's documented next turn: those are accepted and not read (the content and the arguments
# are the reply's words)
FIELDS = {"system": {"role", "content", "name"}, "user": {"role", "content", "name"},
          "assistant": {"role", "content", "name", "audio", "refusal", "tool_calls", "function_call", "annotations",
                        "parsed"},
          "tool": {"role", "content", "tool_call_id"}}
CALL_FIELDS = {"id", "type", "function", "index"}
CALL_FUNCTION_FIELDS = {"name", "arguments", "parsed_arguments"}
AUDIO_REF_FIELDS = {"id", "data", "expires_at", "transcript"}
PART_FIELDS = {"text": {"type", "text"}, "refusal": {"type", "refusal"}, "input_audio": {"type", "input_audio"}}
MAX_ID_CHARS = 256
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus")


def parse_messages(raw: Any, transcripts: TranscriptStore, clips: ClipCache) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", param="messages", code="invalid_value")
    messages = [_message(m, f"messages[{i}]", transcripts, clips) for i, m in enumerate(raw)]
    calls: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "tool" and m.tool_call_id not in calls:
            raise bad_request(f"'messages[{i}].tool_call_id' {quoted(m.tool_call_id)} answers no tool call of an earlier "
                              "assistant message", param=f"messages[{i}].tool_call_id", code="invalid_value")
        calls.update(c.id for c in m.tool_calls)
    return messages


def _message(m: Any, param: str, transcripts: TranscriptStore, clips: ClipCache) -> ChatMessage:
    if not isinstance(m, dict):
        raise bad_request(f"'{param}' must be an object", param=param, code="invalid_type")
    role = ROLES.get(m.get("role"))
    if role is None:
        raise bad_request(f"'{param}.role' {quoted(m.get('role'))} is not supported; use one of: system, developer, user, "
                          "assistant, tool", param=f"{param}.role", code="invalid_value")
    if role != "assistant" and m.get("tool_calls") is not None:
        raise bad_request(f"'{param}.tool_calls' is only allowed in assistant messages", param=f"{param}.tool_calls",
                          code="invalid_value")
    _known_fields(m, FIELDS[role], param)
    name = m.get("name")
    if name is not None and (not isinstance(name, str) or not name or len(name) > 64):
        raise bad_request(f"'{param}.name' must be a string of 1 to 64 characters", param=f"{param}.name",
                          code="invalid_value")
    if role == "assistant" and m.get("annotations") is not None and not isinstance(m["annotations"], list):
        raise bad_request(f"'{param}.annotations' must be an array", param=f"{param}.annotations", code="invalid_type")
    if m.get("function_call") is not None:
        raise bad_request(f"'{param}.function_call' is the deprecated form of a call: use 'tool_calls'",
                          param=f"{param}.function_call", code="unsupported_parameter")
    parts = _content(m.get("content"), role, f"{param}.content", clips)
    refusal = m.get("refusal") if role == "assistant" else None
    if refusal is not None:
        if not isinstance(refusal, str):
            raise bad_request(f"'{param}.refusal' must be a string", param=f"{param}.refusal", code="invalid_type")
        if not any(p.text for p in parts):      # the turn's words were the refusal (as a refusal content part)
            parts = [ChatPart(text=refusal)]
    if role == "assistant" and m.get("audio") is not None:
        transcript = _referenced_transcript(m["audio"], f"{param}.audio", transcripts)
        if not any(p.text for p in parts):
            parts = [ChatPart(text=transcript)]
    calls = _tool_calls(m.get("tool_calls"), f"{param}.tool_calls") if role == "assistant" else []
    call_id = None
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_ID_CHARS:
            raise bad_request(f"'{param}.tool_call_id' must be the id of the call this message answers (a string "
                              f"of 1 to {MAX_ID_CHARS} characters)", param=f"{param}.tool_call_id", code="invalid_value")
    return ChatMessage(role, parts or [ChatPart(text="")], tool_calls=calls, tool_call_id=call_id)


def _known_fields(obj: dict, fields: set[str], param: str) -> None:
    """A 400 naming the first key of `obj` outside `fields` (OpenAI's answer to an unknown field)."""
    for key in obj:
        if key not in fields:
            name = key if isinstance(key, str) else repr(key)
            raise bad_request(f"'{param}': unknown field '{clipped(name)}'", param=f"{param}.{name}",
                              code="unknown_parameter")


def _tool_calls(raw: Any, param: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"'{param}' must be an array", param=param, code="invalid_type")
    calls = []
    for j, c in enumerate(raw):
        p = f"{param}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(c, dict) or c.get("type") != "function" or not isinstance(f, dict):
            raise bad_request(f"'{p}' must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}",
                              param=p, code="invalid_value")
        _known_fields(c, CALL_FIELDS, p)
        _known_fields(f, CALL_FUNCTION_FIELDS, f"{p}.function")
        call_id, name, arguments = c.get("id"), f.get("name"), f.get("arguments")
        if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_ID_CHARS:
            raise bad_request(f"'{p}.id' must be a string of 1 to {MAX_ID_CHARS} characters", param=f"{p}.id",
                              code="invalid_value")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad_request(f"'{p}.function.name' must be a string of 1 to 64 characters", param=f"{p}.function.name",
                              code="invalid_value")
        if not isinstance(arguments, str):
            raise bad_request(f"'{p}.function.arguments' must be a string (the arguments as JSON)",
                              param=f"{p}.function.arguments", code="invalid_type")
        calls.append(ToolCall(id=call_id, name=name, arguments=arguments))
    return calls


def _content(content: Any, role: str, param: str, clips: ClipCache) -> list[ChatPart]:
    if content is None:
        return []
    if isinstance(content, str):
        return [ChatPart(text=content)]
    if not isinstance(content, list):
        raise bad_request(f"'{param}' must be a string or an array of content parts", param=param,
                          code="invalid_type")
    parts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in PART_FIELDS:
            _known_fields(part, PART_FIELDS[kind], p)
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(ChatPart(text=part["text"]))
        elif kind == "refusal" and role == "assistant" and isinstance(part.get("refusal"), str):
            parts.append(ChatPart(text=part["refusal"]))
        elif kind == "input_audio" and role == "user":
            parts.append(ChatPart(features=_input_audio(part.get("input_audio"), f"{p}.input_audio", clips)))
        elif kind in ("text", "refusal"):
            raise bad_request(f"'{p}' needs a string '{kind}'", param=p, code="invalid_value")
        elif kind == "input_audio":
            raise bad_request(f"'{p}': input_audio parts are only allowed in user messages", param=p,
                              code="invalid_value")
        else:
            raise bad_request(f"'{p}': content part type {quoted(kind)} is not supported (use text or input_audio)",
                              param=p, code="invalid_value")
    return parts


def _input_audio(spec: Any, param: str, clips: ClipCache):
    if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
        raise bad_request(f"'{param}' must be an object with base64 'data' and a 'format'", param=param,
                          code="invalid_value")
    _known_fields(spec, {"data", "format"}, param)
    fmt = spec.get("format")
    if fmt not in INPUT_AUDIO_FORMATS:
        raise bad_request(f"'{param}.format' must be one of {', '.join(INPUT_AUDIO_FORMATS)}, got {quoted(fmt)}",
                          param=f"{param}.format", code="invalid_value")
    try:
        return clips.features(decode_base64(spec["data"]), fmt)
    except ValueError as e:
        raise bad_request(f"'{param}.data': {e}", param=f"{param}.data", code="invalid_value") from None


def _referenced_transcript(audio: Any, param: str, transcripts: TranscriptStore) -> str:
    audio_id = audio.get("id") if isinstance(audio, dict) else None
    if isinstance(audio, dict):
        _known_fields(audio, AUDIO_REF_FIELDS, param)
    if not isinstance(audio_id, str):
        raise bad_request(f"'{param}' must be an object with the 'id' of an earlier audio reply", param=param,
                          code="invalid_value")
    transcript = transcripts.get(audio_id)
    if transcript is None:
        raise bad_request(f"audio {quoted(audio_id)} is unknown or has expired", param=f"{param}.id",
                          code="invalid_value")
    return transcript
