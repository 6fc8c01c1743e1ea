"""Every request parameter of OpenAI's chat completions is either served, accepted because it
changes nothing here, or refused with a 400 that names it; a name OpenAI does not define (nor
one of our extensions) is refused too, as OpenAI does. Nothing is silently ignored. The table in
README.md ("Chat parameters") says the same for users."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from voxpipe.services.thinker.output import MAX_TOP_LOGPROBS, stop_strings_problem

from voxpipe.services.runtime.echo import clipped

from .errors import bad_request
from .params import integer, optional

# read by chat_options / generation_params (openai_chat.py, params.py)
SERVED = frozenset({
    "messages", "model", "modalities", "audio", "stream", "stream_options", "n", "max_tokens",
    "max_completion_tokens", "temperature", "top_p", "seed", "stop", "logprobs", "top_logprobs",
    "response_format",      # response_format.py
    "tools", "tool_choice", "parallel_tool_calls",     # tool_params.py
})
EXTENSIONS = frozenset({"ignore_eos", "max_audio_frames", "top_k", "min_tokens"})   # vLLM-style


@dataclass(frozen=True)
class Problem:
    message: str
    code: str = "invalid_value"


@dataclass(frozen=True)
class Accepted:
    """A parameter that changes no answer (prompt_cache_key: only the replica): taken when `problem(value)` is None."""
    problem: Callable[[Any], Problem | None]


@dataclass(frozen=True)
class Refused:
    """A parameter this server does not serve: refused unless its value asks for nothing."""
    why: str
    asks_nothing: Callable[[Any], bool] = lambda value: False


def _same(value: Any, options: tuple) -> bool:
    return any(value == o and type(value) is type(o) for o in options)


def _string(value: Any) -> Problem | None:
    return None if isinstance(value, str) else Problem("must be a string", "invalid_type")


# OpenAI's bound on prompt_cache_key; with CACHE_KEY_SESSION it stays within the thinker's session
# header (services.runtime.calls.MAX_SESSION_CHARS)
MAX_CACHE_KEY_CHARS = 64
CACHE_KEY_SESSION = "chat-key:"     # a realtime session id ("sess_...", "conv_...") never starts so


def _cache_key(value: Any) -> Problem | None:
    if not isinstance(value, str):
        return Problem("must be a string", "invalid_type")
    if len(value) > MAX_CACHE_KEY_CHARS:    # the length only: the value is never echoed
        return Problem(f"string too long. Expected a string with maximum length {MAX_CACHE_KEY_CHARS}, "
                       f"but got a string with length {len(value)} instead.", "string_above_max_length")
    return None


def cache_key_session(body: dict) -> str | None:
    """The routing session of a checked body's `prompt_cache_key` (check_parameters first): requests
    with one key go to one thinker replica while its load allows (services.runtime.affinity); None
    without a key (or an empty one): routed by the prompt's prefix."""
    key = body.get("prompt_cache_key")
    return CACHE_KEY_SESSION + key if key else None


def _object(value: Any) -> Problem | None:
    return None if isinstance(value, dict) else Problem("must be an object", "invalid_type")


def _metadata(value: Any) -> Problem | None:
    if not isinstance(value, dict) or len(value) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items()):
        return Problem("must be an object of at most 16 string values (keys up to 64, values up to 512 characters)")
    return None


def _choice(*allowed: Any, unsupported: tuple = (), why: str = "") -> Callable[[Any], Problem | None]:
    def problem(value: Any) -> Problem | None:
        if _same(value, allowed):
            return None
        if _same(value, unsupported):
            return Problem(why, "unsupported_value")
        return Problem(f"must be one of {', '.join(repr(v) for v in allowed + unsupported)}")
    return problem


ACCEPTED: dict[str, Accepted] = {
    "user": Accepted(_string),                      # an end-user id: no per-user state here
    "safety_identifier": Accepted(_string),
    "prompt_cache_key": Accepted(_cache_key),       # routing only (cache_key_session): served in openai_chat.py
    "prompt_cache_retention": Accepted(_choice("in_memory", "24h")),
    "prompt_cache_options": Accepted(_object),
    "metadata": Accepted(_metadata),                # kept with stored completions; nothing is stored
    "store": Accepted(_choice(False, unsupported=(True,), why="is not served: completions are not stored")),
    "service_tier": Accepted(_choice("auto", "default", unsupported=("flex", "scale", "priority", "fast"),
                                     why="is not served: this server has one tier ('auto' or 'default')")),
}


def _empty(value: Any) -> bool:
    return value in ([], {})


REFUSED: dict[str, Refused] = {
    "functions": Refused("the deprecated function calling is not served; use 'tools'", _empty),
    "function_call": Refused("the deprecated function calling is not served; use 'tool_choice'",
                             lambda v: v == "none"),
    "logit_bias": Refused("logit_bias is not supported", _empty),
    "frequency_penalty": Refused("only 0 is supported",
                                 lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0),
    "presence_penalty": Refused("only 0 is supported",
                                lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0),
    "prediction": Refused("predicted outputs are not supported"),
    "reasoning_effort": Refused("the model does not reason before it answers; only 'none' is accepted",
                                lambda v: v == "none"),
    "verbosity": Refused("verbosity is not supported"),
    "web_search_options": Refused("web search is not supported"),
    "moderation": Refused("moderation is not supported"),
}

KNOWN = SERVED | EXTENSIONS | set(ACCEPTED) | set(REFUSED)


def check_parameters(body: dict) -> None:
    """A 400 naming the first parameter that is unknown, refused, or accepted with a bad value."""
    for key, value in body.items():
        if key not in KNOWN:
            raise bad_request(f"unrecognized request argument supplied: '{clipped(key)}'", param=key,
                              code="unknown_parameter")
        if value is None:
            continue
        if key in REFUSED:
            rule = REFUSED[key]
            if not rule.asks_nothing(value):
                raise bad_request(f"'{key}' is not supported: {rule.why}", param=key, code="unsupported_parameter")
        elif key in ACCEPTED:
            problem = ACCEPTED[key].problem(value)
            if problem is not None:
                raise bad_request(f"Invalid '{key}': {problem.message}" if problem.code == "string_above_max_length"
                                  else f"'{key}' {problem.message}", param=key, code=problem.code)


def stop_strings(body: dict) -> tuple[str, ...]:
    """`stop`: a string or an array of up to 4 strings (OpenAI's form), each 1 to 256 characters."""
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or an array of strings", param="stop", code="invalid_type")
    problem = stop_strings_problem(stops)
    if problem is not None:
        raise bad_request(f"'stop': {problem}", param="stop", code="invalid_value")
    return tuple(dict.fromkeys(stops))


def top_logprobs(body: dict) -> int | None:
    """None without `logprobs`; else how many alternatives per token (`top_logprobs`, 0 to 20)."""
    wanted = optional(body, "logprobs", bool, False)
    top = integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value")
    return (top or 0) if wanted else None


def stream_options(body: dict, stream: bool) -> bool:
    """Whether the stream ends with a usage chunk (`stream_options.include_usage`)."""
    opts = optional(body, "stream_options", dict)
    if opts is None:
        return False
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", param="stream_options",
                          code="invalid_value")
    for key in opts:
        if key not in ("include_usage", "include_obfuscation"):
            raise bad_request(f"unrecognized stream option: '{clipped(key)}'", param=f"stream_options.{key}",
                              code="unknown_parameter")
        if opts[key] is not None and not isinstance(opts[key], bool):
            raise bad_request(f"'stream_options.{key}' must be a boolean", param=f"stream_options.{key}",
                              code="invalid_type")
    if opts.get("include_obfuscation"):
        raise bad_request("'stream_options.include_obfuscation' is not served: streams are not obfuscated "
                          "(it must be false)", param="stream_options.include_obfuscation", code="unsupported_value")
    return bool(opts.get("include_usage"))
