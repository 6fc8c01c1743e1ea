"""OpenAI chat `messages` -> our ChatMessage list (audio parts as their log-mel features, decoded
and featurized once per distinct clip: clip_cache.py).

Roles: system (and developer, its newer name), user, assistant. Content: a string or parts of
type `text` and `input_audio` ({data: base64, format}). An assistant turn may carry
`audio: {id}` naming an earlier spoken reply; its stored transcript is that turn's text."""

from __future__ import annotations

from typing import Any

from voxpipe.services.thinker.prompt import ChatMessage, ChatPart

from voxpipe.services.runtime.echo import quoted

from .audio_formats import decode_base64
from .clip_cache import ClipCache
from .errors import bad_request
from .transcripts import TranscriptStore

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus")


def parse_messages(raw: Any, transcripts: TranscriptStore, clips: ClipCache) -> list[ChatMessage]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty array", param="messages", code="invalid_value")
    return [_message(m, f"messages[{i}]", transcripts, clips) for i, m in enumerate(raw)]


def _message(m: Any, param: str, transcripts: TranscriptStore, clips: ClipCache) -> ChatMessage:
    if not isinstance(m, dict):
        raise bad_request(f"'{param}' must be an object", param=param, code="invalid_type")
    role = ROLES.get(m.get("role"))
    if role is None:
        raise bad_request(f"'{param}.role' {quoted(m.get('role'))} is not supported; use one of: system, developer, user, "
                          "assistant", param=f"{param}.role", code="invalid_value")
    parts = _content(m.get("content"), role, f"{param}.content", clips)
    if role == "assistant" and m.get("audio") is not None:
        transcript = _referenced_transcript(m["audio"], f"{param}.audio", transcripts)
        if not any(p.text for p in parts):
            parts = [ChatPart(text=transcript)]
    return ChatMessage(role, parts or [ChatPart(text="")])


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
    if not isinstance(audio_id, str):
        raise bad_request(f"'{param}' must be an object with the 'id' of an earlier audio reply", param=param,
                          code="invalid_value")
    transcript = transcripts.get(audio_id)
    if transcript is None:
        raise bad_request(f"audio {quoted(audio_id)} is unknown or has expired", param=f"{param}.id",
                          code="invalid_value")
    return transcript
