"""The thinker's reply text -> content and function calls (Hermes / Qwen style markup), for every
API (chat completions, realtime, Converse), streamed or whole.

A call is a `<tool_call>` block: `<tool_call>` JSON `</tool_call>`, the JSON `{"name": ...,
"arguments": {...}}`. The newline the template puts between text and a call (before `<tool_call>`,
after `</tool_call>`) belongs to the markup. With `parallel=False` only the first call is kept
(later ones are dropped: nothing of them goes out).

A streamed reply judges a block by its head, the way a stream must (ToolCallParser.push):
- Content goes out as soon as it cannot be the start of a call (a tail that may begin
  "\\n<tool_call>" is held back).
- Once a block begins `{"name": "<one of the tools>"`, it is a call (`CallStart`: index, id,
  name go out then). Its arguments are the text of the `"arguments"` value as the model writes it,
  out as it comes (ArgumentsDeltas), up to the value's closing brace; a tail that may begin the
  closing markup ("\\n</tool_call>") is held back, so no markup is ever in them. The CallPiece
  (`streamed=True`, its arguments those deltas joined) closes the call with its block.
  A call whose JSON goes wrong after its head (the model wrote invalid JSON, or max_tokens cut it)
  keeps its arguments as written up to the block's end: the stream has already sent them
  (OpenAI's contract: arguments are the model's text, not always valid JSON; the client validates
  them). A head without an `"arguments": {` after the name (the members in another order) takes
  the arguments of the whole block once it closes, if it is a valid call; otherwise they are "".
- A block whose head is not such a name (not JSON, another first member, a name that is not a
  tool) is read whole at its end: a call when its JSON is one (any member order), otherwise
  content, as it was written (vLLM's hermes parser: invalid JSON is content), never an error.
- `constrained` (sampling constrained to calls of the tools: tool_choice 'required'): the head goes
  out once the name being written begins one tool's name only. A reply cut by max_tokens before
  that (in the markup, or in a name that begins several tools') ends with no call and no content:
  what it wrote is markup.
- `only` (sampling constrained to one function's calls): every block is that function's call from
  its first character on (its head out with the reply's first token, before the model writes
  the markup or the name).

A whole reply (`whole=True`: chat completions with `stream` false, the one API that delivers a
reply at once; realtime and Converse send a call's head and arguments as they are written, so they
read as a stream) has sent nothing before it is read, so a block the sampling left free (tool_choice
'auto' without `constrained_blocks`) is judged by all of its text, as vLLM's parsers judge a whole
reply: a call when its JSON is a valid call object of a tool (its arguments the same text a stream
gives), otherwise content, exactly as written (invalid JSON, or a block cut by max_tokens), however
its head began. A block the sampling held to a valid call (`only`, `constrained`, or
`constrained_blocks`: tool_choice 'auto' with the gateway's --constrain-tool-calls) can only be
wrong by being cut at max_tokens: it stays a call with its arguments as written, as in a stream
(OpenAI's answer to a cut call: finish_reason "length", the call as far as it was written). A whole
reply's pieces are ContentPieces and CallPieces (`streamed=False`) only."""

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
    streamed: bool = False   # its CallStart and ArgumentsDeltas went out before


@dataclass(frozen=True)
class CallStart:
    """A call's head, once its block is known to be a call: its arguments follow as ArgumentsDeltas,
    then its CallPiece."""
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str            # a piece of the call's arguments JSON, as written


ReplyPiece = ContentPiece | CallStart | ArgumentsDelta | CallPiece

# a call's head: the call object's "name" (a tool name: no escapes), then its
# "arguments" up to the value's opening brace
NAME_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"')
NAME_SO_FAR = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})$')    # the name being written
ARGS_HEAD = re.compile(NAME_HEAD.pattern + r'\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass
class _Block:
    """A block's state: its call (once committed) and how far its arguments are read."""
    index: int = -1              # committed: its index among the kept calls (-1: not committed)
    id: str = ""
    name: str = ""
    dropped: bool = False        # committed, but a second call with parallel=False: nothing goes out
    whole: bool = False          # its head is not a tool's name: read whole at its end
    pos: int = -1                # where the unread arguments begin in the body (-1: not found yet)
    args: str = ""               # the arguments' text read so far
    depth: int = 0               # JSON nesting within the arguments
    in_string: bool = False
    escape: bool = False
    complete: bool = False       # the arguments' value has closed

    @property
    def committed(self) -> bool:
        return self.index >= 0 or self.dropped

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
                if self.depth <= 0:
                    self.complete = True
                    return text[:i + 1]
        return text


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that may begin LEAD + tag or tag (what must wait for more)."""
    marker = LEAD + tag
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        tail = text[-n:]
        if marker.startswith(tail) or tag.startswith(tail):
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
    """`push(text)` as the reply comes and at the end `finish()` give the reply as ContentPieces and
    call pieces (CallStart, ArgumentsDelta, CallPiece) in order; `calls` are the calls kept so far."""

    def __init__(self, names: Iterable[str], parallel: bool = True, only: str | None = None,
                 constrained: bool = False, constrained_blocks: bool = False, whole: bool = False) -> None:
        """`only`: the one function the constraint lets a block call (a named tool_choice): each
        block commits as it opens, its head out before the model writes the name. `constrained`:
        the sampling allows only calls of `names` (tool_choice 'required'): a block commits as soon
        as the name written so far begins one name only. `constrained_blocks`: free text, but each
        block the model opens is held to a valid call (--constrain-tool-calls). `whole`: the reply
        is delivered at once (nothing of it went out before): a free block is a call only when all
        of its JSON is one, else content as written; only ContentPieces and CallPieces come out."""
        self.names = frozenset(names)
        self.parallel = parallel
        self.only = only
        self.constrained = constrained
        self.whole = whole
        # a block the sampling left free: in a whole reply, judged by all of its text
        self._free_blocks = only is None and not constrained and not constrained_blocks
        self.calls: list[ToolCall] = []
        self._block_state = _Block()
        self._pending = ""        # text not yet given out
        self._inside = False      # within a <tool_call> block (its body is in _pending)
        self._lead = ""           # the separator dropped before the open block
        self._after_call = False  # a call just ended: a separator right after it is markup
        self._early = False       # `only`: the next block's head went out with its first character

    def push(self, text: str) -> list[ReplyPiece]:
        return self._given(self._push(text))

    def _given(self, pieces: list[ReplyPiece]) -> list[ReplyPiece]:
        """What goes out: a whole reply's content and calls only (no call was begun before its end)."""
        if not self.whole:
            return pieces
        return [p for p in pieces if isinstance(p, (ContentPiece, CallPiece))]

    def _push(self, text: str) -> list[ReplyPiece]:
        self._pending += text
        out: list[ReplyPiece] = []
        while True:
            if self._inside:
                end = self._pending.find(CLOSE)
                if end < 0:
                    body = self._pending
                    return out + self._advance(body[:len(body) - _held_tail(body, CLOSE)])
                body, self._pending = self._pending[:end], self._pending[end + len(CLOSE):]
                self._inside = False
                out += self._advance(body.removesuffix(LEAD))
                out += self._block(body, closed=True)
                continue
            if self._after_call:
                if not self._pending:
                    return out
                if self._pending.startswith(LEAD):
                    self._pending = self._pending[len(LEAD):]
                self._after_call = False
            start = self._pending.find(OPEN)
            if start < 0 and self.only is not None and not self._early and self._pending \
                    and (OPEN.startswith(self._pending) or (LEAD + OPEN).startswith(self._pending)):
                # the grammar makes every block that function's call: the head goes out with the
                # block's first character (a reply's first token), not once its markup is complete
                self._block_state, self._early = _Block(), True
                out += self._commit(self.only)
            if start < 0:
                keep = _held_tail(self._pending, OPEN)
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
            if self._early:
                self._early = False
            else:
                self._block_state = _Block()
                if self.only is not None:
                    out += self._commit(self.only)

    def finish(self) -> list[ReplyPiece]:
        """The rest: a block still open when the reply ends (max_tokens) ends there; a tail that
        may begin its closing markup is markup (of a call; a free block of a whole reply that is
        not a call is content, all of it as written)."""
        if self._inside:
            body, self._pending, self._inside = self._pending, "", False
            return self._given(self._advance(body[:len(body) - _held_tail(body, CLOSE)])
                               + self._block(body, closed=False))
        rest, self._pending = self._pending, ""
        if self._early:             # the reply ended in the markup of a call already begun
            self._early = False
            return self._given(self._block("", closed=False))
        if self.constrained:        # the reply ended in the opening markup of a required call: no call
            return []
        return [ContentPiece(rest)] if rest else []

    def _commit(self, name: str) -> list[ReplyPiece]:
        b = self._block_state
        b.name = name
        if self.calls and not self.parallel:
            b.dropped = True
            return []
        b.index, b.id = len(self.calls), new_call_id()
        return [CallStart(b.index, b.id, b.name)]

    def _advance(self, body: str) -> list[ReplyPiece]:
        """The block's new pieces, `body` its text so far (never shorter than the last time)."""
        b, out = self._block_state, []
        if b.whole:
            return out
        if not b.committed:
            m = NAME_HEAD.match(body)
            if m is None:
                name = self._only_name(body) if self.constrained else None
                if name is None:
                    return out
                out += self._commit(name)
            elif m.group(1) not in self.names:
                b.whole = True
                return out
            else:
                out += self._commit(m.group(1))
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

    def _only_name(self, body: str) -> str | None:
        """The tool whose name alone begins with the name `body` is writing (None: none yet, or more than one)."""
        m = NAME_SO_FAR.match(body)
        if m is None:
            return None
        begun = [n for n in self.names if n.startswith(m.group(1))]
        return begun[0] if len(begun) == 1 else None

    def _block(self, body: str, closed: bool) -> list[ReplyPiece]:
        """The block's last pieces, at its end (`body`: all of it, as written). The JSON of a block
        the reply ends in (not `closed`) is read without a tail that may begin its closing markup."""
        b = self._block_state
        json_text = body if closed else body[:len(body) - _held_tail(body, CLOSE)]
        if b.committed and self.whole and self._free_blocks and not _complete_call(b, json_text):
            return self._content(body, closed)      # a whole reply's free block that is no call
        if b.committed:
            self._after_call = True
            if b.dropped:
                return []
            out: list[ReplyPiece] = []
            args = b.args
            if b.pos < 0:       # no "arguments" right after the name: the whole block's, when it is a call
                parsed = parse_call(json_text, {b.name})
                args = parsed.arguments if parsed is not None else ""
                if args:
                    out.append(ArgumentsDelta(b.index, args))
            call = ToolCall(id=b.id, name=b.name, arguments=args)
            self.calls.append(call)
            return out + [CallPiece(b.index, call, streamed=not self.whole)]
        call = parse_call(json_text, self.names)
        if call is None and self.constrained and not closed:
            return []       # a required call cut by max_tokens before its name: markup, and no call
        if call is None:
            return self._content(body, closed)
        self._after_call = True
        if self.calls and not self.parallel:
            return []
        self.calls.append(call)
        return [CallPiece(len(self.calls) - 1, call)]

    def _content(self, body: str, closed: bool) -> list[ReplyPiece]:
        """A block that is not a call: content, its markup and separator as written."""
        self._after_call = False
        return [ContentPiece(self._lead + OPEN + body + (CLOSE if closed else ""))]


def _complete_call(b: _Block, json_text: str) -> bool:
    """Whether a committed block's JSON is all one valid call of its function (its arguments, where
    read as they came, the complete value: the text a stream gives)."""
    return parse_call(json_text, {b.name}) is not None and (b.pos < 0 or b.complete)


@dataclass(frozen=True)
class ParsedReply:
    content: str
    calls: list[ToolCall]


def parse_reply(text: str, names: Iterable[str], parallel: bool = True, **kw) -> ParsedReply:
    """A whole reply as content (the text outside its calls, and blocks that are not calls) and
    calls; `kw`: ToolCallParser's `only`, `constrained`, `constrained_blocks`."""
    parser = ToolCallParser(names, parallel, whole=True, **kw)
    pieces = parser.push(text) + parser.finish()
    return ParsedReply("".join(p.text for p in pieces if isinstance(p, ContentPiece)), parser.calls)
