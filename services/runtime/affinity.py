"""Which replica a request's prefix (or session) is likely cached on: the balancer's affinity table.

A request may carry a RouteKey: its session (a realtime conversation) and the chained hashes of
its prompt's full blocks (block_pool.prefix_hashes over the token ids, in blocks of the thinker's
default KV block size; an audio placeholder run is hashed with its clip's content digest, never a
name or an id). The table remembers, bounded and least recently used first out, which replicas
recently got each block hash and which replica got each session's last request. It is a guess of
what the replicas' prefix caches hold -- a replica evicts on its own -- so it only steers picks;
any replica computes the same answer (a miss prefills).

The table also knows the units it places: a realtime session (the key's session), or a chat
conversation it recognises without one (a prompt that holds, before its own last block, the last
block of an earlier prompt whose stream has ended continues that prompt's conversation; anything
else starts a new one). A replica's load is this client's streams in flight on it plus the units
placed there that are between turns: a session from its first turn, a conversation from its second,
each for at most `session_ttl_s` after its last stream ended (a realtime session ends at once when
its connection closes: `end`). A session between turns holds no stream -- its user is speaking --
yet its replica holds its history and will get its next turn, so counting streams alone makes its
replica look lighter than it is and pushes other sessions off their own replicas.

The choice among the usable replicas (the balancer's best tier: never an unhealthy, draining or
retired one, nor one a retry avoids) is, in order:

1. `session`: a placed unit's replica, while it carries at most ceil((load_bound + stay_margin) *
   mean load) + load_slack after the pick: a unit leaves its replica only when that replica is over
   the bound by the margin (or fails, drains or leaves);
2. `prefix`: for a unit not placed, the replica holding the longest known prefix of its prompt, if
   that prefix goes beyond the blocks that more than one unit's prompts began with (instructions
   that every session shares tell nothing of where this one belongs) and the replica carries at
   most ceil(load_bound * mean load) + load_slack after the pick (ties: least load, then round robin);
3. `least_loaded`: the least load (ties round robin): new sessions spread by how many each replica
   carries.

The mean is over the usable replicas, counting the pick. A unit that moves stays where it goes. A
replica that fails or drains drops out of the table (`forget`): its units and prefixes go elsewhere
and prefill there."""

from __future__ import annotations

import hashlib
import itertools
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .block_pool import ContentSpan, PrefixHasher, prefix_hashes
from .flags import KV_BLOCK_SIZE

OUTCOMES = ("session", "prefix", "least_loaded")


@dataclass(frozen=True)
class RouteKey:
    """What a request's replica choice may follow (neither part: plain least-loaded)."""

    session: str | None = None
    blocks: tuple[bytes, ...] = ()      # chained hashes of the prompt's full blocks, first block first
    block_size: int = KV_BLOCK_SIZE
    tokens: int = 0                     # the prompt's length in tokens


def content_digest(t) -> bytes:
    """SHA-256 of a host tensor's dtype, shape and bytes (C order): the content behind a placeholder run."""
    import torch

    t = t.detach().contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def placeholder_spans(prompt: Sequence[int], placeholder: int, digests: Sequence[bytes]) -> tuple[ContentSpan, ...]:
    """Each clip's run of `placeholder` ids in `prompt`, in order, with that clip's digest (runs and
    clips pair up in order; a clip without a run gets an empty span at the prompt's end)."""
    spans, i, n = [], 0, len(prompt)
    for digest in digests:
        while i < n and prompt[i] != placeholder:
            i += 1
        j = i
        while j < n and prompt[j] == placeholder:
            j += 1
        spans.append(ContentSpan(i, j, digest))
        i = j
    return tuple(spans)


def prompt_key(token_ids: Sequence[int], session: str | None = None, placeholder: int | None = None,
               digests: Sequence[bytes] = (), block_size: int = KV_BLOCK_SIZE,
               hasher: PrefixHasher | None = None) -> RouteKey:
    """The RouteKey of a prompt of `token_ids` whose `placeholder` runs stand for clips of `digests`
    (`hasher`: one of `block_size` that remembers earlier prompts, so that a conversation's history
    is not hashed again every turn)."""
    spans = placeholder_spans(token_ids, placeholder, digests) if digests and placeholder is not None else ()
    if hasher is not None and hasher.block_size == block_size:
        hashes = hasher(token_ids, spans)
    else:
        hashes = prefix_hashes(token_ids, block_size, spans)
    return RouteKey(session, tuple(hashes), block_size, len(token_ids))


class Loaded(Protocol):
    """What the table reads of a replica (balancer.Replica)."""

    address: str
    in_flight: int


@dataclass
class RouteStats:
    """Picks by outcome (a stream replayed on another replica is picked again), and the prompt tokens
    of keyed picks: `queried` (all) and `matched` (the prefix the table knew on the replica chosen)."""

    outcomes: Counter = field(default_factory=Counter)
    queried_tokens: int = 0
    matched_tokens: int = 0


@dataclass(frozen=True)
class Choice:
    replica: Loaded
    outcome: str                        # one of OUTCOMES
    matched_blocks: int                 # of the key's blocks, those known on `replica`
    unit: str | None = None             # the session or chat conversation the stream belongs to (None: neither)


@dataclass
class Resident:
    """A unit the table places (a session, or a chat conversation it recognised by its prompts): its
    replica (None once that replica failed or drained), its streams open now, its last activity."""

    address: str | None
    open: int = 0
    turns: int = 0
    last: float = 0.0
    counted: bool = False               # counted as resident-but-idle on `address` (in `idle`)
    tail: bytes | None = None           # a chat conversation's last prompt's last block hash
    ended: bool = False                 # its session ended: dropped at its last stream's close
    chat: bool = False                  # a chat conversation (recognised by its prompts), not a session


@dataclass
class Held:
    """A block hash's entry: the replicas that recently got it (most recent first), and whether more
    than one unit's prompts contained it (a shared prefix, such as common instructions)."""

    holders: list[str]
    unit: str | None
    shared: bool = False


class AffinityTable:
    """Block hash -> the replicas that recently got it, unit (session or chat conversation) ->
    its replica and activity; at most `max_blocks` / `max_sessions` entries each, least recently
    used dropped first (a unit with a stream open is never dropped). `clock`: seconds, monotonic."""

    def __init__(self, max_blocks: int = 65536, max_sessions: int = 16384, load_bound: float = 1.1,
                 load_slack: int = 1, stay_margin: float = 0.15, session_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if load_bound < 1.0 or load_slack < 0 or stay_margin < 0 or session_ttl_s < 0:
            raise ValueError(f"the load bound must be at least 1 and the slack, the stay margin and the session "
                             f"TTL 0 or more, got {load_bound}, {load_slack}, {stay_margin}, {session_ttl_s}")
        self.max_blocks, self.max_sessions = max_blocks, max_sessions
        self.load_bound, self.load_slack, self.stay_margin = load_bound, load_slack, stay_margin
        self.session_ttl_s, self.clock = session_ttl_s, clock
        self.blocks: OrderedDict[bytes, Held] = OrderedDict()          # LRU first
        self.units: OrderedDict[str, Resident] = OrderedDict()         # LRU first
        self.idle: OrderedDict[str, float] = OrderedDict()             # unit -> its last close, oldest first
        self.idle_on: Counter = Counter()                              # address -> units counted idle there
        self.tails: dict[bytes, str] = {}                              # chat conversation unit by its tail
        self._ids = itertools.count(1)
        self.stats = RouteStats()

    @property
    def sessions(self) -> dict[str, str]:
        """Unit -> the replica it is placed on (units whose replica failed left out)."""
        return {u: e.address for u, e in self.units.items() if e.address is not None}

    # ------------------------------------------------------------------ load

    def _expire(self, now: float) -> None:
        while self.idle:
            unit, last = next(iter(self.idle.items()))
            if now - last <= self.session_ttl_s:
                break
            self._uncount(unit, self.units[unit])

    def _uncount(self, unit: str, entry: Resident) -> None:
        if entry.counted:
            del self.idle[unit]
            self.idle_on[entry.address] -= 1
            entry.counted = False

    def loads(self, replicas: Sequence[Loaded]) -> dict[str, int]:
        """Each replica's load: this client's streams in flight on it plus the units placed there
        that are between turns (idle for at most the session TTL) -- a session's replica stays busy
        with it while its user speaks, though it holds no stream then."""
        self._expire(self.clock())
        return {r.address: r.in_flight + self.idle_on[r.address] for r in replicas}

    def capacity(self, replicas: Sequence[Loaded], unit: str | None = None, margin: float = 0.0) -> int:
        """The most load a replica may carry after a pick adds `unit`'s stream (bounded loads):
        ceil((load_bound + margin) * mean load after it) + load_slack."""
        loads = self.loads(replicas)
        entry = self.units.get(unit) if unit is not None else None
        adds = 0 if entry is not None and entry.counted and entry.address in loads else 1
        total = sum(loads.values()) + adds
        return math.ceil((self.load_bound + margin) * total / len(replicas)) + self.load_slack

    # ------------------------------------------------------------------ prefixes

    def depths(self, key: RouteKey) -> dict[str, int]:
        """How many of the key's first blocks each replica is known to hold (a run from block 0)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(key.blocks):
            held = self.blocks.get(h)
            if not held:
                break
            grew = False
            for address in held.holders:
                if depth.get(address, 0) == i:
                    depth[address] = i + 1
                    grew = True
            if not grew:
                break
        return depth

    def shared_depth(self, key: RouteKey) -> int:
        """How many of the key's first blocks more than one unit's prompts began with (common
        instructions, say): a match that goes no deeper tells nothing of where this unit belongs."""
        n = 0
        for h in key.blocks:
            held = self.blocks.get(h)
            if held is None or not held.shared:
                break
            n += 1
        return n

    def conversation(self, key: RouteKey) -> str | None:
        """The chat conversation a session-less prompt continues: the unit whose last prompt's last
        block this prompt holds before its own last block, while no stream of it is open (a
        conversation's turns come one after the other); None: a new one."""
        for h in reversed(key.blocks[:-1]):
            unit = self.tails.get(h)
            if unit is not None:
                entry = self.units.get(unit)
                return unit if entry is not None and entry.open == 0 else None
        return None

    def unit_of(self, key: RouteKey) -> str | None:
        """The unit a stream with `key` belongs to: its session, the chat conversation it continues,
        or (a prompt of blocks) a new conversation; None for a key of neither."""
        if key.session is not None:
            return key.session
        if not key.blocks:
            return None
        return self.conversation(key) or f"~{next(self._ids)}"

    # ------------------------------------------------------------------ choosing

    def choose(self, replicas: Sequence[Loaded], key: RouteKey, turn: int, unit: str | None = None) -> Choice:
        """The replica for a stream with `key` among `replicas` (non-empty, all usable); `unit`: the
        stream's unit when known (a replay), else found from the key; `turn` breaks ties round robin.

        1. `session`: a placed unit stays on its replica while that carries at most
           ceil((load_bound + stay_margin) * mean) + slack after the pick;
        2. `prefix`: a unit not placed goes where the longest known prefix of its prompt is, if that
           goes beyond the blocks other units share and the replica is within ceil(load_bound *
           mean) + slack;
        3. `least_loaded`: else the replica of the least load (streams and idle units; ties round robin)."""
        unit = unit if unit is not None else self.unit_of(key)
        loads = self.loads(replicas)
        entry = self.units.get(unit) if unit is not None else None

        def after(r: Loaded) -> int:
            return loads[r.address] + (0 if entry is not None and entry.counted and entry.address == r.address else 1)

        depth = self.depths(key) if key.blocks else {}
        if entry is not None and entry.address is not None:
            stay = self.capacity(replicas, unit, self.stay_margin)
            for r in replicas:
                if r.address == entry.address and after(r) <= stay:
                    return Choice(r, "session", depth.get(r.address, 0), unit)
        cap = self.capacity(replicas, unit)
        fits = [r for r in replicas if after(r) <= cap]
        deepest = max((depth.get(r.address, 0) for r in fits), default=0)
        if deepest > self.shared_depth(key):
            best = [r for r in fits if depth.get(r.address, 0) == deepest]
            return Choice(_least_loaded(best, loads, turn), "prefix", deepest, unit)
        r = _least_loaded(replicas, loads, turn)
        return Choice(r, "least_loaded", depth.get(r.address, 0), unit)

    # ------------------------------------------------------------------ recording

    def record(self, address: str, key: RouteKey, unit: str | None = None) -> str | None:
        """`address` got a stream with `key` (of `unit`; None: the key's, as unit_of finds it): the
        unit is placed there with one more stream open, and its blocks are there (touched last
        block first, so a prompt's head outlives its tail in the LRU order). Returns the unit: give
        it to `closed` when the stream ends."""
        unit = unit if unit is not None else self.unit_of(key)
        now = self.clock()
        if unit is not None:
            entry = self.units.get(unit)
            if entry is None:
                entry = self.units[unit] = Resident(address, chat=key.session is None)
            self._uncount(unit, entry)
            entry.turns += entry.open == 0          # a new turn (not a replay of an open one)
            entry.address, entry.last = address, now
            entry.open += 1
            self.units.move_to_end(unit)
            if key.session is None and key.blocks:
                if entry.tail is not None and self.tails.get(entry.tail) == unit:
                    del self.tails[entry.tail]
                entry.tail = key.blocks[-1]
                self.tails[entry.tail] = unit
            self._evict_units()
        for h in reversed(key.blocks):
            held = self.blocks.get(h)
            if held is None:
                self.blocks[h] = Held([address], unit)
            else:
                if held.holders[0] != address:
                    if address in held.holders:
                        held.holders.remove(address)
                    held.holders.insert(0, address)
                if held.unit != unit:
                    held.shared = True
                self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)
        return unit

    def closed(self, unit: str | None) -> None:
        """A stream of `unit` (record's answer) ended: with none left open the unit is idle on its
        replica and counts there (a session's, and a conversation's from its second turn) until the
        session TTL passes or it is placed again."""
        entry = self.units.get(unit) if unit is not None else None
        if entry is None or entry.open == 0:
            return
        entry.open -= 1
        entry.last = self.clock()
        if entry.open:
            return
        if entry.ended:
            self._drop(unit)
        elif entry.address is not None and (not entry.chat or entry.turns >= 2):
            entry.counted = True
            self.idle[unit] = entry.last
            self.idle_on[entry.address] += 1

    def end(self, session: str) -> None:
        """The session is over (its realtime connection closed): it no longer counts, nor steers."""
        entry = self.units.get(session)
        if entry is None:
            return
        if entry.open:
            entry.ended = True
        else:
            self._drop(session)

    def _drop(self, unit: str) -> None:
        entry = self.units.pop(unit)
        self._uncount(unit, entry)
        if entry.tail is not None and self.tails.get(entry.tail) == unit:
            del self.tails[entry.tail]

    def _evict_units(self) -> None:
        while len(self.units) > self.max_sessions:
            victim = next((u for u, e in self.units.items() if e.open == 0), None)
            if victim is None:
                return
            self._drop(victim)

    def count(self, choice: Choice, key: RouteKey | None) -> None:
        self.stats.outcomes[choice.outcome] += 1
        if key is not None:
            self.stats.queried_tokens += key.tokens
            self.stats.matched_tokens += choice.matched_blocks * key.block_size

    def forget(self, address: str) -> None:
        """Drop every entry that points at `address` (it failed, drains or left): its units and
        prefixes are placed afresh (a unit with a stream open keeps its entry, unplaced, so that
        its close is counted)."""
        for unit, entry in list(self.units.items()):
            if entry.address == address:
                self._uncount(unit, entry)
                entry.address = None
                if entry.open == 0:
                    self._drop(unit)
        for h in [h for h, held in self.blocks.items() if address in held.holders]:
            held = self.blocks[h]
            held.holders.remove(address)
            if not held.holders:
                del self.blocks[h]


def _least_loaded(replicas: Sequence[Loaded], loads: dict[str, int], turn: int) -> Loaded:
    low = min(loads[r.address] for r in replicas)
    tied = [r for r in replicas if loads[r.address] == low]
    return tied[turn % len(tied)]
