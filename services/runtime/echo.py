"""Client values in error messages, bounded: a refusal quotes what it refuses, but never more than
ECHO_CHARS characters of it (a 10,000-character voice name echoed whole would make the status
bigger than gRPC's metadata limit, and an error should not carry the client's payload back).

`quoted(value)`: its repr, cut; `clipped(text)`: a string as is (a JSON key, a `param` path),
cut; `bounded_message(text)`: a whole message cut to MAX_MESSAGE_CHARS -- the backstop every
error path applies (HTTP APIError, realtime `error` events, gRPC statuses)."""

from __future__ import annotations

ECHO_CHARS = 64             # of one quoted client value
MAX_MESSAGE_CHARS = 1024    # of a whole error message
PARAM_CHARS = 256           # of an error's `param` (a path that may hold a client's JSON key)


def clipped(text: str, limit: int = ECHO_CHARS) -> str:
    """`text` itself when it has at most `limit` characters, else its start and its length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: object, limit: int = ECHO_CHARS) -> str:
    """repr(value) for a message, cut to `limit` characters (with the length it had)."""
    try:
        text = repr(value)
    except ValueError:          # an int past Python's digit limit for str()
        return f"an integer of {value.bit_length()} bits" if isinstance(value, int) else "a value"
    return clipped(text, limit)


def bounded_message(text: str) -> str:
    return clipped(text, MAX_MESSAGE_CHARS)
