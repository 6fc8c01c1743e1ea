"""Which replica a request's prefix (or session) is likely cached on: the balancer's affinity table.

A request may carry a RouteKey: its session (a realtime conversation) and the chained hashes of
its prompt's full blocks (block_pool.prefix_hashes over the token ids, in blocks of the thinker's
default KV block size; an audio placeholder run is hashed with its clip's content digest, never a
name or an id). The table remembers, bounded and least recently used first out, which replicas
recently got each block hash and which replica got each session's last request. It is a guess of
what the replicas' prefix caches hold -- a replica evicts on its own -- so it only steers picks;
any replica computes the same answer (a miss prefills).

The choice among the usable replicas (the balancer's best tier: never an unhealthy, draining or
retired one, nor one a retry avoids) is, in order:

1. `session`: the replica of the session's previous request;
2. `prefix`: the replica holding the longest known prefix of the prompt (at least one block; ties:
   fewer streams in flight, then round robin);
3. `least_loaded`: the fewest streams in flight (ties round robin), as without affinity.

A replica is chosen by 1 or 2 only while it is within its share -- bounded loads: after taking
the stream it holds at most ceil(load_bound * (streams in flight + 1) / replicas) + load_slack of
this client's streams, counted over the usable replicas (the least loaded one always fits). So no
replica takes more than load_bound times the mean plus the slack (which keeps a few sessions
apiece from bouncing at low load); a session whose replica is full moves (and stays) where it
goes. A replica that fails or drains drops out of the table (`forget`): its sessions and prefixes
go elsewhere and prefill there."""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
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


class AffinityTable:
    """Block hash -> the replicas that recently got it (most recent first), session -> replica;
    at most `max_blocks` / `max_sessions` entries each, least recently used dropped first."""

    def __init__(self, max_blocks: int = 65536, max_sessions: int = 16384, load_bound: float = 1.1,
                 load_slack: int = 1) -> None:
        if load_bound < 1.0 or load_slack < 0:
            raise ValueError(f"the load bound must be at least 1 and the slack 0 or more, got {load_bound}, {load_slack}")
        self.max_blocks, self.max_sessions = max_blocks, max_sessions
        self.load_bound, self.load_slack = load_bound, load_slack
        self.blocks: OrderedDict[bytes, list[str]] = OrderedDict()     # LRU first
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.stats = RouteStats()

    def capacity(self, replicas: Sequence[Loaded]) -> int:
        """The most streams a replica may hold after an affinity pick adds one (bounded loads)."""
        total = sum(r.in_flight for r in replicas) + 1
        return math.ceil(self.load_bound * total / len(replicas)) + self.load_slack

    def depths(self, key: RouteKey) -> dict[str, int]:
        """How many of the key's first blocks each replica is known to hold (a run from block 0)."""
        depth: dict[str, int] = {}
        for i, h in enumerate(key.blocks):
            holders = self.blocks.get(h)
            if not holders:
                break
            grew = False
            for address in holders:
                if depth.get(address, 0) == i:
                    depth[address] = i + 1
                    grew = True
            if not grew:
                break
        return depth

    def choose(self, replicas: Sequence[Loaded], key: RouteKey, turn: int) -> Choice:
        """The replica for a stream with `key` among `replicas` (non-empty, all usable); `turn`
        breaks ties round robin."""
        cap = self.capacity(replicas)
        fits = [r for r in replicas if r.in_flight + 1 <= cap]
        depth = self.depths(key) if key.blocks else {}
        if key.session is not None:
            address = self.sessions.get(key.session)
            for r in fits:
                if r.address == address:
                    return Choice(r, "session", depth.get(address, 0))
        deepest = max((depth.get(r.address, 0) for r in fits), default=0)
        if deepest > 0:
            best = [r for r in fits if depth.get(r.address, 0) == deepest]
            return Choice(_least_loaded(best, turn), "prefix", deepest)
        r = _least_loaded(replicas, turn)
        return Choice(r, "least_loaded", depth.get(r.address, 0))

    def record(self, address: str, key: RouteKey) -> None:
        """`address` got a stream with `key`: its session is there now, and so are its blocks (touched
        last block first, so a prompt's head outlives its tail in the LRU order)."""
        if key.session is not None:
            self.sessions[key.session] = address
            self.sessions.move_to_end(key.session)
            while len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)
        for h in reversed(key.blocks):
            holders = self.blocks.get(h)
            if holders is None:
                self.blocks[h] = [address]
            else:
                if holders[0] != address:
                    if address in holders:
                        holders.remove(address)
                    holders.insert(0, address)
                self.blocks.move_to_end(h)
        while len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def count(self, choice: Choice, key: RouteKey | None) -> None:
        self.stats.outcomes[choice.outcome] += 1
        if key is not None:
            self.stats.queried_tokens += key.tokens
            self.stats.matched_tokens += choice.matched_blocks * key.block_size

    def forget(self, address: str) -> None:
        """Drop every entry that points at `address` (it failed, drains or left): its sessions and
        prefixes are placed afresh."""
        for session in [s for s, a in self.sessions.items() if a == address]:
            del self.sessions[session]
        for h in [h for h, holders in self.blocks.items() if address in holders]:
            holders = self.blocks[h]
            holders.remove(address)
            if not holders:
                del self.blocks[h]


def _least_loaded(replicas: Sequence[Loaded], turn: int) -> Loaded:
    low = min(r.in_flight for r in replicas)
    tied = [r for r in replicas if r.in_flight == low]
    return tied[turn % len(tied)]
