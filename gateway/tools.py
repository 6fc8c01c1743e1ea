"""The thinker's reply text -> content and function calls (Hermes / Qwen style markup), for every
API (chat completions, realtime, Converse).

A call is `<tool_call>` JSON `</tool_call>`, the JSON `{"name": ..., "arguments": {...}}` with a
name among the request's tools and an object of arguments. The newline the template puts between
text and a call (before `<tool_call>`, after `</tool_call>`) belongs to the markup. A block that
is not such a call (invalid JSON, an unknown name, arguments not an object) stays content, as
it was written. With `parallel=False` only the first call is kept (later ones are dropped).

Streaming (`ToolCallParser.push`): content goes out as soon as it cannot be the start of a call
(a tail that may begin "\\n<tool_call>" is held back); a call goes out whole once its block is
closed (or the reply ends), so a block that turns out not to be a call can still be content."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from voxpipe.services.thinker.prompt import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
LEAD = "\n"          # the template's separator between text and a call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ContentPiece:
    text: str


@dataclass(frozen=True)
class CallPiece:
    index: int           # among the reply's kept calls, from 0
    call: ToolCall


ReplyPiece = ContentPiece | CallPiece


def _held_tail(text: str) -> int:
    """Length of the longest tail of `text` that may begin LEAD + OPEN (what must wait for more)."""
    marker = LEAD + OPEN
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        tail = text[-n:]
        if marker.startswith(tail) or OPEN.startswith(tail):
            return n
    return 0


def parse_call(body: str, names: Iterable[str]) -> ToolCall | None:
    """The call written in one block's body, or None when it is not a call to one of `names`."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in names:
        return None
    arguments = value.get("arguments")
    if not isinstance(arguments, dict):
        return None
    return ToolCall(id=new_call_id(), name=value["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Incremental: `push(text)` and at the end `finish()` give the reply as ContentPieces and
    CallPieces in order; `calls` are the calls kept so far."""

    def __init__(self, names: Iterable[str], parallel: bool = True) -> None:
        self.names = frozenset(names)
        self.parallel = parallel
        self.calls: list[ToolCall] = []
        self._pending = ""        # text not yet given out
        self._inside = False      # within a <tool_call> block (its body is in _pending)
        self._lead = ""           # the separator dropped before the open block
        self._after_call = False  # a call just ended: a separator right after it is markup

    def push(self, text: str) -> list[ReplyPiece]:
        self._pending += text
        out: list[ReplyPiece] = []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._inside = False
                out += self._block(body, closed=True)
                continue
            if self._after_call:
                if not self._pending:
                    return out
                if self._pending.startswith(LEAD):
                    self._pending = self._pending[len(LEAD):]
                self._after_call = False
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _held_tail(self._pending)
                text_out, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
                if text_out:
                    out.append(ContentPiece(text_out))
                return out
            before = self._pending[:start]
            self._lead = LEAD if before.endswith(LEAD) else ""
            before = before[:len(before) - len(self._lead)]
            if before:
                out.append(ContentPiece(before))
            self._pending = self._pending[start + len(OPEN):]
            self._inside = True

    def finish(self) -> list[ReplyPiece]:
        """The rest: an unclosed block at the end is a call when its body is one."""
        if self._inside:
            body, self._pending, self._inside = self._pending, "", False
            return self._block(body, closed=False)
        rest, self._pending = self._pending, ""
        return [ContentPiece(rest)] if rest else []

    def _block(self, body: str, closed: bool) -> list[ReplyPiece]:
        call = parse_call(body, self.names)
        if call is None:
            self._after_call = False
            return [ContentPiece(self._lead + OPEN + body + (CLOSE if closed else ""))]
        self._after_call = True
        if self.calls and not self.parallel:
            return []
        self.calls.append(call)
        return [CallPiece(len(self.calls) - 1, call)]


@dataclass(frozen=True)
class ParsedReply:
    content: str
    calls: list[ToolCall]


def parse_reply(text: str, names: Iterable[str], parallel: bool = True) -> ParsedReply:
    """A whole reply as content (the text outside its calls) and calls."""
    parser = ToolCallParser(names, parallel)
    pieces = parser.push(text) + parser.finish()
    return ParsedReply("".join(p.text for p in pieces if isinstance(p, ContentPiece)), parser.calls)
