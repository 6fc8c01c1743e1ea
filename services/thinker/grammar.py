"""Grammar-constrained decoding with xgrammar (chosen by measurement: bench/RESULTS.md, "Constrained
decoding"): the vocabulary as the library sees it, constraints compiled and cached by content, and a
matcher per constrained row.

- `vocabulary_bytes`: each token id's bytes, from our tokenizer (an HF byte-level BPE, or the ChatML
  byte tokenizer of bare configs). Special tokens and ids the tokenizer does not know are b"": the
  library never lets them into constrained text; the end-of-turn tokens are its stop tokens, allowed
  only once the reply is complete.
- `Grammars.compile`: thread-safe, for the server's compile pool (never the engine thread); a
  bounded LRU keyed by `Constraint.key()` (the hash of the canonical constraint). A constraint that
  does not compile raises GrammarError (a ValueError) naming it. A compile's cost is the library's
  pass over the vocabulary for each grammar position; its compiler keeps the token masks of rules it
  has seen (bounded: RULE_CACHE_BYTES), so the rules every JSON grammar shares (strings, numbers,
  objects, the tool-call markup) are computed once a process, by `warm` at start-up, and a new
  constraint pays only for its own positions (bench/grammar_compile.py).
- `Matcher`: one request's state; `fill` writes its row of a step's bitmask [n, words] int32 (bit t
  of word t // 32: token t allowed), `accept` advances by the sampled token, `done` once it accepted
  a stop token, `forced` the one token the grammar allows next (jump-forward decoding: engine.py). Whitespace in JSON is bounded, so that a weak model cannot loop on spaces or newlines
  until max_tokens: JSON (a json_schema / json_object reply, a structural tag's json_schema parts)
  has none but one space after ':' and ',' (json.dumps' form); see `_compact` for the rest."""

from __future__ import annotations

import json
import os
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np
import torch
import xgrammar as xgr

from .constraint import Constraint, ConstraintKind, tool_calls
from .output import TokenBytes

CACHE_SIZE = 256           # compiled grammars kept (LRU)
COMPILE_THREADS = min(8, os.cpu_count() or 1)    # the library's own threads per compile
RULE_CACHE_BYTES = 256 << 20   # the library compiler's cache (its rules' token masks and grammars)
MAX_TAG_WHITESPACE = 1     # consecutive whitespace characters in a structural tag's JSON


class GrammarError(ValueError):
    """A constraint that does not compile (the message names it: bounded, never the whole input)."""


def vocabulary_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """[vocab_size] each id's bytes (the embedding table's size: ids past the tokenizer are b"").
    Special tokens are b"" too, so that no constrained text contains them."""
    token_bytes = TokenBytes(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    special |= set(getattr(tokenizer, "special", {}).values())      # the ChatML byte tokenizer's
    known = len(tokenizer) if hasattr(tokenizer, "__len__") else vocab_size
    return [b"" if i in special or i >= known else token_bytes(i) for i in range(vocab_size)]


class Grammars:
    """The thinker's grammar compiler over its vocabulary, with a bounded cache of compiled grammars."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: tuple[int, ...], cache_size: int = CACHE_SIZE,
                 threads: int = COMPILE_THREADS, info: xgr.TokenizerInfo | None = None,
                 rule_cache_bytes: int | None = None) -> None:
        """`threads`: the library's threads per compile. `info`: the vocabulary as the library sees
        it, when already made for this tokenizer (`self.info` of another Grammars: it takes seconds).
        `rule_cache_bytes`: the library compiler's cache bound (None: RULE_CACHE_BYTES; 0: no
        cache, every rule computed anew)."""
        if rule_cache_bytes is None:
            rule_cache_bytes = RULE_CACHE_BYTES
        self.vocab_size, self.stop_ids = vocab_size, stop_ids
        self.info = info or xgr.TokenizerInfo(vocabulary_bytes(tokenizer, vocab_size), xgr.VocabType.RAW,
                                              vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=rule_cache_bytes > 0,
                                            cache_limit_bytes=rule_cache_bytes if rule_cache_bytes > 0 else -1)
        self.cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.running: dict[str, Future] = {}     # compiles under way, by key
        self.hits = self.misses = 0

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, constraint: Constraint) -> xgr.CompiledGrammar:
        """The compiled grammar: from the cache, from a compile of the same constraint already
        running in another thread (it is waited for, not repeated), or compiled now."""
        key = constraint.key()      # ValueError for a JSON text that is not JSON
        with self.lock:
            got = self.cache.get(key)
            if got is not None:
                self.cache.move_to_end(key)
                self.hits += 1
                return got
            running = self.running.get(key)
            if running is None:
                self.running[key] = mine = Future()
                self.misses += 1
            else:
                self.hits += 1
        if running is not None:
            return running.result()     # its GrammarError too
        try:
            compiled = self._compile(constraint)
        except BaseException as e:
            mine.set_exception(e)
            raise
        finally:
            with self.lock:
                del self.running[key]
                if not mine.done():
                    self.cache[key] = compiled
                    while len(self.cache) > self.cache_size:
                        self.cache.popitem(last=False)
        mine.set_result(compiled)
        return compiled

    def _compile(self, c: Constraint) -> xgr.CompiledGrammar:
        grammar = check(c)
        try:
            return self.compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as e:
            raise GrammarError(f"constraint.{c.kind.value} does not compile: {_first_line(e)}") from None

    def warm(self) -> None:
        """Compile what every JSON constraint shares, so that its rules' masks are in the library's
        cache before a first request (start-up, in the compile pool): JSON of every type, and a
        tool-call block over it. Not put in the LRU (no request's constraint)."""
        for c in WARM_CONSTRAINTS:
            self.compiler.compile_grammar(check(c))

    def matcher(self, compiled: xgr.CompiledGrammar) -> "Matcher":
        return Matcher(xgr.GrammarMatcher(compiled), self.words)


class Matcher:
    """One constrained request's grammar state (the engine thread's, once it runs)."""

    def __init__(self, matcher: xgr.GrammarMatcher, words: int) -> None:
        self.m = matcher
        self.words = words
        self._next: torch.Tensor | None = None   # [1, words]: the mask of the current state, once `forced` filled it
        self._deferred: int | None = None        # a token to accept before the next use (`defer`)
        self._string: str | None = None          # the current state's forced string, once `forced` asked
        self.refused = False                     # a deferred token was not allowed: the reply is broken

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Row `row` of bitmask [n, words] int32 (host): the tokens allowed next; False when a
        deferred token was refused (the row is then the state before it)."""
        self._settle()
        if self._next is not None:
            bitmask[row] = self._next[0]
        else:
            self.m.fill_next_token_bitmask(bitmask, row)
        return not self.refused

    def accept(self, token: int) -> bool:
        """Advance by `token`; False when the grammar does not allow it (the state is unchanged)."""
        self._settle()
        ok = not self.refused and self.m.accept_token(token)
        if ok:
            self._next = self._string = None
        return ok

    def defer(self, token: int) -> None:
        """Advance by `token` at the next fill (or accept, forced): in a step, the fill runs while the
        device computes the forward, so the library's accept leaves the step's critical path. A
        sampled token came from this state's mask: it is allowed unless the state is broken (a
        refusal shows as `refused`, and fill's False)."""
        self._settle()
        self._deferred = token

    def _settle(self) -> None:
        if self._deferred is not None:
            token, self._deferred = self._deferred, None
            if self.m.accept_token(token):
                self._next = self._string = None
            else:
                self.refused = True

    def forced(self) -> int | None:
        """The one token the grammar allows next, or None (more than one; or none that is text: a
        stop token, or a forced part of a character). Any choice among the allowed tokens takes
        it, whatever the logits. The library's forced string (cheap) rules most states out before
        the mask is filled; a filled mask is kept for the next `fill` of this state."""
        self._settle()
        if self.refused:
            return None
        if self._string is None:
            self._string = self.m.find_jump_forward_string()
        if not self._string:
            return None
        if self._next is None:
            self._next = torch.empty(1, self.words, dtype=torch.int32)
            self.m.fill_next_token_bitmask(self._next, 0)
        row = self._next[0].numpy()
        words = np.flatnonzero(row)
        if len(words) != 1:
            return None
        bits = int(row[words[0]]) & 0xFFFFFFFF
        if bits & (bits - 1):
            return None
        return int(words[0]) * 32 + bits.bit_length() - 1

    def forced_string(self) -> str:
        """The text the grammar forces next whatever the choice ("" when the next character is a
        choice): after `forced` gave None, a text that more than one spelling can write (engine._draft
        drafts the tokenizer's own)."""
        self._settle()
        if self.refused:
            return ""
        if self._string is None:
            self._string = self.m.find_jump_forward_string()
        return self._string

    @property
    def done(self) -> bool:
        """A stop token was accepted: the reply is complete."""
        self._settle()
        return self.m.is_terminated()


CHECKED_KEYS = 1024        # constraints whose check's outcome is remembered (LRU, by content)
_checked: OrderedDict[str, str | None] = OrderedDict()   # Constraint.key() -> None (it compiles) / the error
_checked_lock = threading.Lock()


def checked_before(c: Constraint) -> bool:
    """`check(c)` passed for this constraint's content before (`check_remembered`): the gateway
    skips the check's thread hop and its ~3 ms (an agent sends the same tools every turn)."""
    key = c.key()
    with _checked_lock:
        if key in _checked and _checked[key] is None:
            _checked.move_to_end(key)
            return True
    return False


def check_remembered(c: Constraint) -> None:
    """`check(c)` (GrammarError naming the constraint), its outcome remembered by the constraint's
    content hash for the next request with the same constraint, up to CHECKED_KEYS of them."""
    key = c.key()
    with _checked_lock:
        if key in _checked:
            _checked.move_to_end(key)
            problem = _checked[key]
            if problem is None:
                return
            raise GrammarError(problem)
    try:
        check(c)
        problem = None
    except GrammarError as e:
        problem = str(e)
    with _checked_lock:
        _checked[key] = problem
        while len(_checked) > CHECKED_KEYS:
            _checked.popitem(last=False)
    if problem is not None:
        raise GrammarError(problem)


def check(c: Constraint) -> xgr.Grammar:
    """The constraint's grammar (no vocabulary needed: the gateway checks a request with it), or
    GrammarError naming the constraint."""
    name = f"constraint.{c.kind.value}"
    try:
        if c.kind is ConstraintKind.JSON_OBJECT:
            return xgr.Grammar.from_ebnf(json_ebnf('{"type": "object"}'))
        if c.kind is ConstraintKind.JSON_SCHEMA:
            return xgr.Grammar.from_ebnf(json_ebnf(c.canonical()))
        if c.kind is ConstraintKind.REGEX:
            return xgr.Grammar.from_ebnf(_narrowed(str(xgr.Grammar.from_regex(c.text)), SURROGATES))
        tag = json.loads(c.text)
        if not isinstance(tag, dict) or tag.get("type") != "structural_tag":
            raise GrammarError(f'{name} must be an object {{"type": "structural_tag", "format": ...}}')
        return xgr.Grammar.from_structural_tag(json.dumps(_compact(tag)))
    except GrammarError:
        raise
    except (json.JSONDecodeError, RecursionError) as e:
        raise GrammarError(f"{name} is not valid JSON: {_first_line(e)}") from None
    except (RuntimeError, ValueError, TypeError, xgr.InvalidJSONError, xgr.InvalidStructuralTagError) as e:
        raise GrammarError(f"{name} does not compile: {_first_line(e)}") from None


_ANY_JSON = {"type": "object", "properties": {
    "s": {"type": "string"}, "n": {"type": "number"}, "i": {"type": "integer"}, "b": {"type": "boolean"},
    "z": {"type": "null"}, "a": {"type": "array", "items": {"type": "string"}}, "o": {"type": "object"}}}
WARM_CONSTRAINTS = (Constraint(ConstraintKind.JSON_OBJECT), Constraint.json_schema(_ANY_JSON),
                    tool_calls([{"name": "f", "parameters": _ANY_JSON}]))


_BITS = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).bool()    # [256, 8]: a byte's bits, lowest first
_BITS_ON: dict[torch.device, torch.Tensor] = {}


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bitmask [n, words] int32 -> [n, vocab] bool, on the bitmask's device (no host sync): each
    little-endian byte of the words looks its 8 bits up (token t is bit t % 8 of byte t // 8)."""
    bits = _BITS_ON.get(bitmask.device)
    if bits is None:
        bits = _BITS_ON[bitmask.device] = _BITS.to(bitmask.device)
    return bits[bitmask.view(torch.uint8).long()].flatten(1)[:, :vocab]


def json_ebnf(schema: str) -> str:
    """The EBNF of compact JSON valid for `schema`, its strings valid JSON and UTF-8: the library's
    own grammar (any_whitespace=False, strict_mode) lets a string hold raw control characters where
    it bounds the length, and the 3-byte forms of UTF-16 surrogates everywhere (not UTF-8: a
    decoder makes U+FFFD of each byte); its negated character classes here exclude both."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    return _narrowed(str(grammar), CONTROL + SURROGATES)


CONTROL, SURROGATES = r"\0-\x1f", r"\uD800-\uDFFF"


def _narrowed(ebnf: str, ranges: str) -> str:
    """`ebnf` with `ranges` added to every negated character class ("[^...]" outside string
    literals, which may hold "[^" themselves)."""
    out, i, n = [], 0, len(ebnf)
    quoted = in_class = False
    while i < n:
        ch = ebnf[i]
        out.append(ch)
        if ch == "\\" and (quoted or in_class) and i + 1 < n:
            out.append(ebnf[i + 1])
            i += 2
            continue
        if quoted:
            quoted = ch != '"'
        elif in_class:
            in_class = ch != "]"
        elif ch == '"':
            quoted = True
        elif ch == "[":
            in_class = True
            if ebnf.startswith("^", i + 1):
                out.append("^" + ranges)
                i += 1
        i += 1
    return "".join(out)


def _compact(tag: dict) -> dict:
    """A structural tag whose JSON parts have a json_schema reply's whitespace: each plain
    json_schema part (JSON style, declared order) becomes the grammar that json_schema compiles to;
    any other keeps the library's form with at most MAX_TAG_WHITESPACE whitespace characters in a row
    (unless the tag sets its own bound)."""
    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: walk(v) for k, v in node.items()}
        if out.get("type") == "json_schema" and "json_schema" in out:
            if set(out) <= {"type", "json_schema", "style"} and out.get("style", "json") == "json":
                return {"type": "grammar", "grammar": json_ebnf(json.dumps(out["json_schema"], ensure_ascii=False))}
            if out.get("max_whitespace_cnt") is None:
                out["max_whitespace_cnt"] = MAX_TAG_WHITESPACE
        return out
    return walk(tag)


_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _first_line(e: BaseException, limit: int = 300) -> str:
    """The library's message, first line, without its source-location prefix, bounded."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = _NATIVE_PREFIX.sub("", text)
    return text if len(text) <= limit else text[:limit] + "..."
