"""Checked reading of request bodies: sampling parameters (OpenAI's plus vLLM-style extensions
`ignore_eos`, `max_audio_frames`, `top_k`, `min_tokens`), voices and the model id. Every
problem is a 400 that names the parameter."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from voxpipe.services.runtime.echo import quoted
from voxpipe.services.thinker.constraint import Constraint

from .errors import APIError, bad_request
from .limits import INT32_MAX, SEED_MAX, SEED_MIN, UINT32_MAX, out_of_range

DEFAULT_TEMPERATURE = 1.0   # as OpenAI's API; 0 is greedy


@dataclass(frozen=True)
class GenerationParams:
    max_tokens: int = 0          # 0: the thinker's default
    min_tokens: int = 0
    max_frames: int = 0          # 0: the talker's default
    min_frames: int = 0
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()          # chat: stop strings (the thinker ends the text before them)
    top_logprobs: int | None = None     # chat: None, or log probabilities with this many alternatives
    constraint: Constraint | None = None   # chat: response_format json_schema / json_object (None: free text)


_TYPE_NAMES = {str: "a string", int: "an integer", float: "a number", dict: "an object", list: "an array",
               bool: "a boolean"}


def _describe(kinds: tuple[type, ...]) -> str:
    return "a number" if kinds == (int, float) else " or ".join(_TYPE_NAMES.get(k, k.__name__) for k in kinds)


def optional(body: dict, key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"'{key}' must be {_describe(kinds)}, not {type(value).__name__}", param=key,
                          code="invalid_type")
    return value


def required(body: dict, key: str, kind: type | tuple[type, ...]) -> Any:
    if body.get(key) is None:
        raise bad_request(f"missing required parameter: '{key}'", param=key, code="missing_required_parameter")
    return optional(body, key, kind)


def integer(body: dict, key: str, low: int, high: int, default: int | None = None) -> int | None:
    """An optional integer in [low, high] (a 400 naming `key` otherwise)."""
    value = optional(body, key, int)
    if value is None:
        return default
    if out_of_range(value, low, high):
        raise bad_request(f"'{key}' must be an integer from {low} to {high}, got {quoted(value)}", param=key,
                          code="invalid_value")
    return value


def _positive(body: dict, key: str) -> int:
    return integer(body, key, 1, UINT32_MAX, 0)


def generation_params(body: dict) -> GenerationParams:
    if optional(body, "n", int, 1) != 1:
        raise bad_request("only n=1 is supported", param="n", code="invalid_value")
    max_tokens = _positive(body, "max_completion_tokens") or _positive(body, "max_tokens")
    max_frames = _positive(body, "max_audio_frames")
    min_tokens = integer(body, "min_tokens", 0, UINT32_MAX, 0)
    if max_tokens and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' must be between 0 and max_tokens, got {min_tokens}", param="min_tokens",
                          code="invalid_value")
    ignore_eos = optional(body, "ignore_eos", bool, False)
    temperature = float(optional(body, "temperature", (int, float), DEFAULT_TEMPERATURE))
    if not 0.0 <= temperature <= 2.0:
        raise bad_request(f"'temperature' must be between 0 and 2, got {temperature}", param="temperature",
                          code="invalid_value")
    top_p = float(optional(body, "top_p", (int, float), 1.0))
    if not 0.0 < top_p <= 1.0:
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p}", param="top_p", code="invalid_value")
    top_k = integer(body, "top_k", -1, INT32_MAX, 0)    # -1 and 0: off
    seed = integer(body, "seed", SEED_MIN, SEED_MAX)
    return GenerationParams(max_tokens=max_tokens, min_tokens=max_tokens if ignore_eos else min_tokens,
                            max_frames=max_frames, min_frames=max_frames if ignore_eos else 0,
                            temperature=temperature, top_p=top_p, top_k=max(top_k, 0),
                            seed=None if seed is None else seed & 0xFFFFFFFFFFFFFFFF)


def resolve_voice(voice: Any, speakers: dict[str, int], param: str) -> str:
    """A checkpoint speaker, case-insensitive; `{"id": name}` (OpenAI's custom voice form) too."""
    if isinstance(voice, dict):
        voice = voice.get("id")
    if not isinstance(voice, str) or not voice:
        raise bad_request(f"'{param}' must be a voice name; valid voices: {', '.join(sorted(speakers))}",
                          param=param, code="invalid_value")
    name = voice.lower()
    if name not in {s.lower() for s in speakers}:
        raise bad_request(f"unknown voice {quoted(voice)}; valid voices: {', '.join(sorted(speakers))}", param=param,
                          code="invalid_value")
    return name


def check_model(body: dict, model_id: str) -> None:
    model = required(body, "model", str)
    if model != model_id:
        raise APIError(404, f"the model {quoted(model)} does not exist; this server serves {model_id!r}", param="model",
                       code="model_not_found")


async def bounded_body(request, max_bytes: int) -> AsyncIterator[bytes]:
    """The request body's chunks as they arrive: a 413 APIError once it exceeds `max_bytes`
    (before reading when its Content-Length says so)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(max_bytes)
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        yield chunk


async def read_json(request, max_bytes: int) -> dict:
    """The request body as a JSON object: 413 over `max_bytes` (checked before and while reading),
    400 when it is not JSON or not an object."""
    chunks = [chunk async for chunk in bounded_body(request, max_bytes)]
    try:
        body = json.loads(b"".join(chunks))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON ({e})", code="invalid_json") from None
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


def _too_large(max_bytes: int) -> APIError:
    return APIError(413, f"the request body exceeds the limit of {max_bytes / 1024 / 1024:g} MB",
                    code="request_too_large")
