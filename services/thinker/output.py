"""What leaves the thinker for each generated token: its text (detokenized incrementally), its
talker row, its log probabilities, and -- for a request with stop strings -- the decision whether
the token is part of the reply at all.

Stop strings are matched on the detokenized text before a token's text or row is sent: a token
whose text could still begin a stop string is held back (text, row and log probabilities
together) until the following tokens decide it. When a stop string is found, the text ends just
before it; the tokens wholly before it go out as usual and the talker gets, as its last row, the
row of the first token that reaches into the stop string: the talker never speaks its last row
(it stands where an EOS would), so the voice ends with the last token wholly before the stop
string and never says what the text leaves out. The stopping tokens are still reported (their
ids and log probabilities; they were generated), without text.

Where the text is made. A reply without stop strings needs no text to decide anything: the engine
sends each token at once (ReplyText: a TextOut whose text is None) and the servicer detokenizes
the stream's tokens on the event loop, in order, as they leave (StreamText) -- off the engine
thread. A reply with stop strings is detokenized on the engine thread (ReplyText), because its
text decides, in the step that made the token, whether the token's row may leave (held back, or
never sent after a stop), and whether the request ends there: the engine finishes it with STOP in
that step, generates nothing past the stop and reports exactly the tokens up to it. On the event
loop the match would come steps late: the engine would go on generating, filling the outbox and
the KV cache, for a request the handler would then have to end from outside with the right counts.
The servicer adds the log probabilities' token bytes (TokenBytes) in both cases.

Unspoken markers (ThinkerStart.unspoken_tool_calls: "<tool_call>"). The talker's text ends where
a marker begins, as at a stop string (held back while the text may begin one; the first token
reaching into it gives the talker its last, unspoken row, with `talker_end`), but the reply goes
on: every later token goes to the caller with its text and without a row. So a function call
is never spoken, and a reply that is only a call gives the talker one unspoken row."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..runtime.outputs import TextOut, TokenLogprob

MAX_STOP_STRINGS = 4          # as OpenAI
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20         # as OpenAI


def stop_strings_problem(stops: list[str] | tuple[str, ...]) -> str | None:
    """Why a list of stop strings is refused (a message naming the rule), or None."""
    if len(stops) > MAX_STOP_STRINGS:
        return f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
    for i, s in enumerate(stops):
        if not s:
            return f"stop string {i} is empty"
        if len(s) > MAX_STOP_CHARS:
            return f"stop string {i} has {len(s)} characters; the limit is {MAX_STOP_CHARS}"
    return None


def top_logprobs_problem(logprobs: bool, top: int) -> str | None:
    if top > MAX_TOP_LOGPROBS:
        return f"top_logprobs must be from 0 to {MAX_TOP_LOGPROBS}, got {top}"
    if top and not logprobs:
        return "top_logprobs needs logprobs"
    return None


class IncrementalDetokenizer:
    """Text deltas for a growing token list at O(1) cost per token: decodes only the tokens since
    the last emitted boundary, with a few tokens of context before it (so spacing and merges come
    out as a full decode would), and holds back an incomplete UTF-8 sequence until the next token
    or the last one: the deltas of a whole reply add up to its full decode, a character split at the
    end included (as U+FFFD, as transformers' decode gives it)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0      # context starts here
        self.read = 0        # tokens before this are emitted

    def push(self, token: int, last: bool = False) -> str:
        """The text `token` makes final; `last`: no token follows, so nothing is held back."""
        self.ids.append(token)
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        text = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if len(text) <= len(before) or text.endswith("\ufffd") and not last:
            return ""   # nothing visible yet, or an incomplete UTF-8 sequence: wait for the next token
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's bytes_to_unicode) mapped back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """A token id's bytes (for log probabilities): the byte-level BPE piece mapped back to bytes,
    an added / special token's own text, the byte itself for the ChatML byte tokenizer; b"" for an
    id the tokenizer does not know (the padding rows of the embedding table). Cached per id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "token_bytes", None)      # the ChatML byte tokenizer knows its bytes
        self._own = own
        self._added = set(tokenizer.get_added_vocab()) if own is None and hasattr(tokenizer, "get_added_vocab") else set()
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._lookup(token_id)
        return got

    def _lookup(self, token_id: int) -> bytes:
        if self._own is not None:
            return self._own(token_id)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if piece in self._added:
            return piece.encode()
        decoder = _byte_decoder()
        if all(c in decoder for c in piece):
            return bytes(decoder[c] for c in piece)
        return self.tokenizer.decode([token_id]).encode()     # not a byte-level vocabulary


@dataclass
class Piece:
    """One generated token on its way out."""
    token: int
    text: str                                   # the text that became final with it ("" : none yet)
    row: torch.Tensor | None = None             # [H] its talker row (talker_rows)
    logprob: TokenLogprob | None = None
    end: int | None = None                      # held: where its text ends in the held text


@dataclass
class ReplyText:
    """A request's generated tokens turned into TextOuts, stop strings applied (see the module
    docstring). `push` each token; it returns the outputs to send now and whether a stop string
    ended the text. Without stop strings every token goes out at once, as its own output, and
    without its text (None: StreamText makes it off the engine thread)."""

    tokenizer: object
    stops: tuple[str, ...] = ()
    min_tokens: int = 0
    unspoken: tuple[str, ...] = ()      # markers where the talker's text ends (see the module docstring)
    detok: IncrementalDetokenizer = field(init=False)
    held: list[Piece] = field(default_factory=list)
    held_text: str = ""
    count: int = 0          # tokens pushed
    sent: int = 0           # tokens sent (the next delta's index)
    muted: bool = False     # an unspoken marker began: no more rows

    def __post_init__(self) -> None:
        self.detok = IncrementalDetokenizer(self.tokenizer)

    def push(self, token: int, row: torch.Tensor | None = None, logprob: TokenLogprob | None = None,
             last: bool = False) -> tuple[list[TextOut], bool]:
        """`last`: the generation ends with this token (EOS or max_tokens): nothing is held back."""
        self.count += 1
        if self.muted:
            row = None
        if not self.stops and not self.unspoken:   # nothing to match: out at once, the text left to the servicer
            out = TextOut(self.sent, (token,), None, None if row is None else row[None],
                          () if logprob is None else (logprob,), more=not last, last=last)
            self.sent += 1
            return [out], False
        text = self.detok.push(token, last)
        piece = Piece(token, text, row, logprob)
        self.held.append(piece)
        self.held_text += text
        if text:     # tokens that showed no text yet (a split character) end where this one does
            for p in reversed(self.held):
                if p.end is not None:
                    break
                p.end = len(self.held_text)
        if self.count < self.min_tokens or last and not text:
            return self._release(len(self.held), len(self.held_text)), False
        if text:
            at, mark = self._find_stop(), self._find_marker()
            if at is not None and (mark is None or at <= mark):
                return self._stop(at), True
            if mark is not None:
                deltas = self._mute(mark)
                if last:
                    deltas += self._release(len(self.held), len(self.held_text))
                return deltas, False
        if last:
            return self._release(len(self.held), len(self.held_text)), False
        safe = len(self.held_text) - self._open_prefix()
        n = 0
        while n < len(self.held) and self.held[n].end is not None and self.held[n].end <= safe:
            n += 1
        if n == 0:
            return [], False
        return self._release(n, self.held[n - 1].end), False

    def _find_stop(self) -> int | None:
        found = [i for i in (self.held_text.find(s) for s in self.stops) if i >= 0]
        return min(found) if found else None

    def _find_marker(self) -> int | None:
        if self.muted:
            return None
        found = [i for i in (self.held_text.find(s) for s in self.unspoken) if i >= 0]
        return min(found) if found else None

    def _mute(self, at: int) -> list[TextOut]:
        """The talker's text ends at `at` (an unspoken marker): the tokens wholly before it go out
        with their rows, the first reaching into it with its row as the talker's last and its text
        before `at`; the later tokens and the text from `at` stay held, without rows (stop strings
        are still matched on them)."""
        deltas, rest = self._cut(at)
        deltas[-1] = dataclasses.replace(deltas[-1], talker_end=True)
        self.muted = True
        self.held, self.held_text = rest, self.held_text[at:]
        for p in self.held:
            p.row = None
            if p.end is not None:
                p.end -= at
        return deltas

    def _open_prefix(self) -> int:
        """The length of the longest end of the held text that begins a stop string or (before one
        began) an unspoken marker: it must wait."""
        text, longest = self.held_text, 0
        for s in self.stops + (() if self.muted else self.unspoken):
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _release(self, n: int, chars: int) -> list[TextOut]:
        pieces, self.held = self.held[:n], self.held[n:]
        text, self.held_text = self.held_text[:chars], self.held_text[chars:]
        for p in self.held:
            if p.end is not None:
                p.end -= chars
        return [self._delta(pieces, text)] if pieces or text else []

    def _cut(self, at: int) -> tuple[list[TextOut], list[Piece]]:
        """The held tokens wholly before `at` as one delta (with their rows), then the first token
        reaching into `at`: its text's part before it, and its row as the talker's last (unspoken)
        row. Returns those deltas and the held pieces after that token."""
        n = 0
        while self.held[n].end is not None and self.held[n].end <= at:
            n += 1
        before = self.held[n - 1].end if n else 0
        spoken, rest = self.held[:n], self.held[n:]
        deltas = [self._delta(spoken, self.held_text[:before])] if spoken else []
        deltas.append(self._delta(rest[:1], self.held_text[before:at]))
        return deltas, rest[1:]

    def _stop(self, at: int) -> list[TextOut]:
        # the tokens after the first one reaching into the stop string: ids and log probabilities only
        deltas, rest = self._cut(at)
        if rest:
            deltas.append(self._delta(rest, "", rows=False))
        self.held, self.held_text = [], ""
        return deltas

    def _delta(self, pieces: list[Piece], text: str, rows: bool = True) -> TextOut:
        out = TextOut(self.sent, tuple(p.token for p in pieces), text,
                      torch.stack([p.row for p in pieces]) if rows and pieces and pieces[0].row is not None else None,
                      tuple(p.logprob for p in pieces if p.logprob is not None))
        self.sent += len(pieces)
        return out


class StreamText:
    """The servicer's side of a stream's text (see the module docstring): the text of the TextOuts
    the engine left without one, its tokens detokenized incrementally, in the stream's order, on the
    event loop. Each output once, in order."""

    def __init__(self, tokenizer) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)

    def __call__(self, out: TextOut) -> str:
        if out.text is not None:
            return out.text
        n = len(out.token_ids)
        return "".join(self.detok.push(t, out.last and i == n - 1) for i, t in enumerate(out.token_ids))
