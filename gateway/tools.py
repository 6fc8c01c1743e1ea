"""The thinker's reply text -> content and function calls (Hermes / Qwen style markup), for every
API (chat completions, realtime, Converse).

A call is `<tool_call>` JSON `</tool_call>`, the JSON `{"name": ..., "arguments": {...}}` with a
name among the request's tools and an object of arguments. The newline the template puts between
text and a call (before `<tool_call>`, after `</tool_call>`) belongs to the markup. A block that
is not such a call (invalid JSON, an unknown name, arguments not an object) stays content, as
it was written. With `parallel=False` only the first call is kept (later ones are dropped).

Streaming (`ToolCallParser.push`): content goes out as soon as it cannot be the start of a call
(a tail that may begin "\\n<tool_call>" is held back). A call goes out whole (a CallPiece) once
its block is closed (or the reply ends), so a block that turns out not to be a call can still be
content -- unless the parser is `incremental`, for replies whose sampling is constrained to calls
(tool_choice 'required' / a named function: every block is a valid call): then a block commits as
soon as it begins `{"name": "<a known name>"` (a CallStart: index, id, name), its arguments go out
as they are written (ArgumentsDeltas: the text of the arguments' JSON value, as the model wrote
it), and the CallPiece (`streamed=True`, its arguments those deltas joined) closes it. A block
that does not begin so is read whole, as without `incremental`. The same text gives the same
pieces however it is split."""

from __future__ import annotations

import json
import re
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
    streamed: bool = False   # its CallStart and ArgumentsDeltas went out before (incremental)


@dataclass(frozen=True)
class CallStart:
    """An incremental call's head: its arguments follow as ArgumentsDeltas, then its CallPiece."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str            # a piece of the call's arguments JSON, as written


ReplyPiece = ContentPiece | CallStart | ArgumentsDelta | CallPiece

# an incremental block's beginning: the call object's "name" (a tool name: no escapes), then its
# "arguments" up to the value's opening brace
NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"')
ARGS_HEAD = re.compile(NAME_HEAD.pattern + r'\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class _Block:
    """An incremental block's state: its call (once committed) and how far its arguments are read."""
    index: int = -1              # committed: its index among the kept calls (-1: not committed)
    id: str = ""
    name: str = ""
    dropped: bool = False        # committed, but a second call with parallel=False: nothing goes out
    whole: bool = False          # not a call this parser can stream: read whole at its end
    pos: int = -1                # where the unread arguments begin in the body (-1: not found yet)
    args: str = ""               # the arguments' text read so far
    depth: int = 0               # JSON nesting within the arguments
    in_string: bool = False
    escape: bool = False
    complete: bool = False       # the arguments' value has closed

    def scan(self, text: str) -> str:
        """The part of `text` (the body after `pos`) that belongs to the arguments' value."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.complete = True
                    return text[:i + 1]
        return text


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

    def __init__(self, names: Iterable[str], parallel: bool = True, incremental: bool = False,
                 only: str | None = None) -> None:
        """`only` (incremental): the one function the constraint lets a block call (a named
        tool_choice): each block commits as it opens, its head out before the model writes the name."""
        self.names = frozenset(names)
        self.parallel = parallel
        self.incremental = incremental
        self.only = only if incremental else None
        self.calls: list[ToolCall] = []
        self._block_state = _Block()
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
                if self.incremental:
                    out += self._advance(self._pending if end < 0 else self._pending[:end])
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
            self._block_state = _Block()

    def finish(self) -> list[ReplyPiece]:
        """The rest: an unclosed block at the end is a call when its body is one."""
        if self._inside:
            body, self._pending, self._inside = self._pending, "", False
            return self._block(body, closed=False)
        rest, self._pending = self._pending, ""
        return [ContentPiece(rest)] if rest else []

    def _advance(self, body: str) -> list[ReplyPiece]:
        """An incremental block's new pieces, `body` its text so far."""
        b, out = self._block_state, []
        if b.whole:
            return out
        if b.index < 0 and not b.dropped:
            m = NAME_HEAD.match(body)
            if self.only is not None:
                b.name = self.only
            elif m is None:
                return out
            elif m.group(1) not in self.names:
                b.whole = True
                return out
            else:
                b.name = m.group(1)
            if self.calls and not self.parallel:
                b.dropped = True
            else:
                b.index, b.id = len(self.calls), new_call_id()
                out.append(CallStart(b.index, b.id, b.name))
        if b.pos < 0:
            m = ARGS_HEAD.match(body)
            if m is None:
                return out
            b.pos = m.end()
        if not b.complete:
            text = b.scan(body[b.pos:])
            b.pos += len(text)
            b.args += text
            if text and not b.dropped:
                out.append(ArgumentsDelta(b.index, text))
        return out

    def _block(self, body: str, closed: bool) -> list[ReplyPiece]:
        b = self._block_state
        if self.incremental and (b.index >= 0 or b.dropped):
            self._after_call = True
            if b.dropped:
                return []
            out: list[ReplyPiece] = []
            args = b.args
            if not args:        # no arguments came: the call's own (or none)
                parsed = parse_call(body, self.names)
                args = parsed.arguments if parsed is not None else "{}"
                out.append(ArgumentsDelta(b.index, args))
            call = ToolCall(id=b.id, name=b.name, arguments=args)
            self.calls.append(call)
            return out + [CallPiece(b.index, call, streamed=True)]
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


def parse_reply(text: str, names: Iterable[str], parallel: bool = True, incremental: bool = False) -> ParsedReply:
    """A whole reply as content (the text outside its calls) and calls."""
    parser = ToolCallParser(names, parallel, incremental)
    pieces = parser.push(text) + parser.finish()
    return ParsedReply("".join(p.text for p in pieces if isinstance(p, ContentPiece)), parser.calls)
