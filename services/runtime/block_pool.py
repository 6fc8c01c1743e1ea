"""KV blocks shared by all sequences of a stage, and the prefix cache over them. Pure Python: no
tensors (the tensors are `kv_cache.PagedKVCache`; a block id here is a block index there).

A sequence's KV lives in fixed-size blocks listed by its `BlockTable` (position p is in block
`table.blocks[p // block_size]` at offset `p % block_size`). Every block has a reference count; a
block whose count falls to 0 is free. A *full* block whose keys were all computed can be
*published* under its prefix hash: the hash of (the previous block's hash, the block's token ids,
and for positions whose token stands for content -- an audio placeholder -- that content's digest
and the offset into it). A new sequence whose prompt begins with published blocks takes them (its
count on each goes up) and skips their prefill. Published blocks stay after their sequences end
(count 0, still findable) until a new allocation needs the memory: free blocks that were never
published go first, then published ones, least recently used first.

Exactness rests on the hash: two prefixes with the same hash have the same token ids, the same
content behind every placeholder and the same positions, so their keys and values are the same
function of the same inputs (hash content, never names). A sequence only ever writes positions
past its cached prefix: a prompt whose every block is cached still recomputes its last block, so
that no shared block is written (`KVBlockManager.admit`)."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ContentSpan:
    """Prompt positions start .. end - 1 whose token ids are placeholders for content (one audio
    clip's tokens): `digest` identifies the content (a hash of its bytes)."""

    start: int
    end: int
    digest: bytes


def prefix_hashes(tokens: Sequence[int], block_size: int, spans: Sequence[ContentSpan] = (),
                  parent: bytes = b"") -> list[bytes]:
    """The hash of each full block of `tokens` (a trailing partial block has none): block i's hash
    covers blocks 0 .. i (it chains the previous one), its token ids, and for every content span
    that overlaps it the span's digest and the offset of the block's first covered position into
    the span."""
    arr = np.asarray(tokens, dtype=np.int64)
    out, prev = [], parent
    for b in range(len(tokens) // block_size):
        lo, hi = b * block_size, (b + 1) * block_size
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(arr[lo:hi].tobytes())
        for sp in spans:
            if sp.start < hi and sp.end > lo:
                first = max(sp.start, lo)
                h.update(b"|%d:%d|" % (first - lo, first - sp.start))
                h.update(sp.digest)
        prev = h.digest()
        out.append(prev)
    return out


def _span_limit(a: Sequence[ContentSpan], b: Sequence[ContentSpan]) -> float:
    """The first position where two prompts' content spans may differ: the smallest start of a span
    that is not the same (start, end, digest) at the same place in both lists (inf: none)."""
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return min((sp.start for sp in (*a[k:], *b[k:])), default=float("inf"))


@dataclass(eq=False)
class _Hashed:
    """A prompt whose block hashes are remembered: its full blocks' token ids and spans."""

    tokens: np.ndarray          # [blocks * block_size] int64
    hashes: list[bytes]
    spans: tuple[ContentSpan, ...]


class PrefixHasher:
    """`prefix_hashes` (from position 0, no parent) that remembers recent prompts' token ids and block
    hashes by content, so that a prompt sharing a prefix with one hashed before -- a conversation's
    next turn re-sends the whole history -- hashes only the blocks past that prefix: block i's hash is
    taken from the remembered prompt when blocks 0 .. i hold the same token ids there and every content
    span that reaches them is the same (start, end, digest) in both, which are all its hash covers; the
    rest is chained on from there. So a hit gives the same bytes as hashing from scratch (the shared
    prefix is found by comparing token ids, never by a name). Candidates are the remembered prompts
    with the same first block hash (at most `per_key`, most recent first); a prompt that extends a
    remembered one replaces it. Bounded by `max_tokens` remembered token ids (least recently used
    dropped first). Thread-safe."""

    def __init__(self, block_size: int, max_tokens: int = 1 << 20, per_key: int = 16) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size, self.max_tokens, self.per_key = block_size, max_tokens, per_key
        self._by_first: dict[bytes, list[_Hashed]] = {}        # most recent last
        self._lru: OrderedDict[int, tuple[bytes, _Hashed]] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.reused_blocks = 0      # blocks whose hash came from a remembered prompt
        self.hashed_blocks = 0      # blocks hashed

    @property
    def held_tokens(self) -> int:
        return self._held

    def __call__(self, tokens: Sequence[int] | np.ndarray, spans: Sequence[ContentSpan] = ()) -> list[bytes]:
        bs = self.block_size
        arr = np.asarray(tokens, dtype=np.int64)
        full = len(arr) // bs
        if full == 0 or self.max_tokens < bs:
            return prefix_hashes(arr, bs, spans)
        spans = tuple(spans)
        first = prefix_hashes(arr[:bs], bs, spans)[0]
        with self._lock:
            best, reuse = None, 0
            for c in reversed(self._by_first.get(first, ())):
                n = min(len(c.tokens), full * bs)
                diff = np.flatnonzero(c.tokens[:n] != arr[:n])
                common = int(diff[0]) if diff.size else n
                k = int(min(common, _span_limit(c.spans, spans)) // bs)
                if k > reuse:
                    best, reuse = c, k
            hashes = best.hashes[:reuse] if best is not None else []
        if reuse < full:
            lo = reuse * bs
            shifted = [ContentSpan(s.start - lo, s.end - lo, s.digest) for s in spans if s.end > lo]
            hashes = hashes + prefix_hashes(arr[lo:full * bs], bs, shifted, hashes[-1] if hashes else b"")
        self.reused_blocks += reuse
        self.hashed_blocks += full - reuse
        with self._lock:
            self._remember(first, _Hashed(arr[:full * bs].copy(), list(hashes), spans),
                           best if best is not None and reuse == len(best.hashes) else None)
        return hashes

    def _remember(self, first: bytes, entry: _Hashed, extended: _Hashed | None) -> None:
        """Keep `entry` (dropping `extended`, a prompt it extends, and the oldest past the bounds)."""
        if extended is not None and id(extended) in self._lru:
            self._drop(id(extended))
        same = self._by_first.setdefault(first, [])
        same.append(entry)
        self._lru[id(entry)] = (first, entry)
        self._held += len(entry.tokens)
        if len(same) > self.per_key:
            self._drop(id(same[0]))
        while self._held > self.max_tokens and len(self._lru) > 1:
            self._drop(next(iter(self._lru)))

    def _drop(self, key: int) -> None:
        first, entry = self._lru.pop(key)
        same = self._by_first[first]
        same.remove(entry)
        if not same:
            del self._by_first[first]
        self._held -= len(entry.tokens)


class BlockPool:
    """`num_blocks` blocks with reference counts; free ones are kept in two orders: never-published
    (taken first, last freed first) and published (least recently freed first, so that the
    longest-lived prefixes stay).

    The counts are an array, and the published free blocks a queue of chunks -- the stamps and
    blocks one release freed, oldest first -- whose entries go stale instead of being removed (an
    entry is live while its block is free, published and was freed at that stamp): taking a
    conversation's history back, or releasing it, is a few array operations over its blocks, not a
    dictionary operation per block (26k tokens: 1,600 blocks)."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks, self.enable_caching = num_blocks, enable_caching
        self.refs = np.zeros(num_blocks, dtype=np.int64)
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self._published = np.zeros(num_blocks, dtype=bool)         # hash_of[b] is not None
        self._plain: list[int] = list(range(num_blocks - 1, -1, -1))   # free, unpublished (pop from the end)
        # free published blocks: [stamps, blocks, first unread index] per release, oldest first
        self._chunks: deque[list] = deque()
        self._queued = 0            # unread entries over the chunks (live or stale)
        self._stamp = np.zeros(num_blocks, dtype=np.int64)            # when each block was last freed
        self._slot = np.zeros(num_blocks, dtype=np.int64)             # scratch of _distinct
        self._clock = 1
        self._free = num_blocks
        self.compact_slack = 1024   # stale entries beyond 2 x num_blocks queued before a compaction

    @property
    def free(self) -> int:
        """Blocks an allocation can take now (free ones, published or not)."""
        return self._free

    @property
    def used(self) -> int:
        return self.num_blocks - self.free

    @property
    def cached(self) -> int:
        """Published blocks (in use or free)."""
        return len(self.by_hash)

    def _distinct(self, idx: np.ndarray) -> bool:
        """Whether no block is twice in `idx` (each position's index survives its own write)."""
        order = np.arange(idx.size)
        self._slot[idx] = order
        return bool((self._slot[idx] == order).all())

    def _live(self, stamps: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """[len(blocks)] bool: the queue entries still standing for a free published block."""
        return (self.refs[blocks] == 0) & self._published[blocks] & (self._stamp[blocks] == stamps)

    def allocate(self, n: int) -> list[int]:
        """`n` free blocks, each with count 1; unpublished ones first, then the least recently used
        published ones, which lose their hash. ValueError when fewer than `n` are free."""
        if n > self.free:
            raise ValueError(f"{n} KV blocks asked, {self.free} free")
        k = min(n, len(self._plain))
        out = self._plain[len(self._plain) - k:][::-1]
        del self._plain[len(self._plain) - k:]
        while len(out) < n:
            chunk = self._chunks[0]
            stamps, blocks, pos = chunk
            live = np.flatnonzero(self._live(stamps[pos:], blocks[pos:]))[:n - len(out)]
            end = pos + int(live[-1]) + 1 if live.size else len(blocks)
            got = blocks[pos + live]
            for b in got.tolist():
                del self.by_hash[self.hash_of[b]]
                self.hash_of[b] = None
            self._published[got] = False
            out += got.tolist()
            self._queued -= end - pos
            chunk[2] = end
            if end == len(blocks):
                self._chunks.popleft()
        if out:
            self.refs[out] = 1
        self._free -= n
        return out

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The published blocks of the longest run of `hashes` from the first on (not taken)."""
        if not self.enable_caching:
            return []
        found = list(map(self.by_hash.get, hashes))     # (in C: a 1,600-block history ~3x faster than a loop)
        try:
            return found[:found.index(None)]
        except ValueError:
            return found

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each of `blocks` (published blocks found by `lookup`)."""
        if not len(blocks):
            return
        idx = np.asarray(blocks, dtype=np.int64)
        if not self._distinct(idx):       # a block twice: one at a time
            for b in idx.tolist():
                self.take([b])
            return
        self._free -= int(np.count_nonzero(self.refs[idx] == 0))     # (their queue entries go stale)
        self.refs[idx] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """One reference less to each of `blocks`; a block at 0 is free (still findable if published).
        Released in reverse so that a sequence's tail blocks are evicted before its head."""
        if not len(blocks):
            return
        idx = np.asarray(blocks, dtype=np.int64)[::-1]
        if not self._distinct(idx):       # a block twice: one at a time
            for b in idx.tolist():
                self.release([b])
            return
        refs = self.refs[idx] - 1
        if (refs < 0).any():
            raise RuntimeError(f"KV block {int(idx[np.argmax(refs < 0)])} released more often than taken")
        self.refs[idx] = refs
        zero = idx[refs == 0]
        if not zero.size:
            return
        self._free += zero.size
        published = self._published[zero]
        self._plain.extend(zero[~published].tolist())
        cached = zero[published]
        if cached.size:
            stamps = np.arange(self._clock, self._clock + cached.size, dtype=np.int64)
            self._clock += cached.size
            self._stamp[cached] = stamps
            self._chunks.append([stamps, cached, 0])
            self._queued += cached.size
            if self._queued > 2 * self.num_blocks + self.compact_slack:
                self._compact()

    def _compact(self) -> None:
        """The queue's live entries as one chunk (its stale ones dropped: each once)."""
        if not self._chunks:
            return
        stamps = np.concatenate([c[0][c[2]:] for c in self._chunks])
        blocks = np.concatenate([c[1][c[2]:] for c in self._chunks])
        keep = self._live(stamps, blocks)
        self._chunks = deque([[stamps[keep], blocks[keep], 0]]) if keep.any() else deque()
        self._queued = int(keep.sum())

    def publish(self, block: int, h: bytes) -> None:
        """Make a full, computed block findable under its prefix hash (a block already published, or
        a hash another block holds, is left as it is: the first copy stays the one found)."""
        if not self.enable_caching or self.hash_of[block] is not None or h in self.by_hash:
            return
        self.hash_of[block] = h
        self.by_hash[h] = block
        self._published[block] = True

    def unpublish(self, blocks: Sequence[int]) -> None:
        """Forget the hashes of `blocks` (their keys are not to be trusted: a request that failed
        non-finite). A free one moves to the unpublished blocks."""
        for b in blocks:
            h = self.hash_of[b]
            if h is None:
                continue
            del self.by_hash[h]
            self.hash_of[b] = None
            self._published[b] = False
            if self.refs[b] == 0:      # its queue entry goes stale
                self._plain.append(b)

    def reset_cache(self) -> int:
        """Forget every published hash (blocks in use keep their keys); returns how many were dropped."""
        dropped = np.flatnonzero(self._published).tolist()
        self.unpublish(dropped)
        return len(dropped)


class JoinedIds:
    """Two id lists read as one (a prompt, then its reply) without copying them: its length and
    slices (what `KVBlockManager.publish` reads: the newly filled blocks' ids)."""

    def __init__(self, head: Sequence[int], tail: Sequence[int]) -> None:
        self.head, self.tail = head, tail

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def __getitem__(self, index: slice) -> list[int]:
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("JoinedIds takes contiguous slices only")
        start, stop, _ = index.indices(len(self))
        n = len(self.head)
        return list(self.head[start:min(stop, n)]) + list(self.tail[max(start - n, 0):max(stop - n, 0)])


@dataclass
class BlockTable:
    """One sequence's blocks, in position order, and how many of its first positions came from the
    prefix cache (their blocks are shared: never written)."""

    blocks: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    published: int = 0          # its first `published` blocks are findable by hash (theirs or another's)
    hashes: list[bytes] = field(default_factory=list)   # the prompt's full blocks' hashes (admission)
    # array(): a buffer of the blocks' first `_have` entries, for the list `_of` (grown as it grows)
    _buf: np.ndarray | None = field(default=None, repr=False, compare=False)
    _have: int = field(default=0, repr=False, compare=False)
    _of: list[int] | None = field(default=None, repr=False, compare=False)

    def capacity(self, block_size: int) -> int:
        return len(self.blocks) * block_size

    def array(self) -> np.ndarray:
        """`blocks` as int64 [len(blocks)], only its new entries converted since the last call (the
        list only grows in place, or is replaced): a step's table tensor copies this, not a list of a
        long context's 1,600 ints. A view: read, never written."""
        n = len(self.blocks)
        if self._of is not self.blocks or self._have > n or self._buf is None:
            self._buf, self._have, self._of = np.empty(max(2 * n, 16), dtype=np.int64), 0, self.blocks
        if self._have < n:
            if self._buf.size < n:
                grown = np.empty(2 * n, dtype=np.int64)
                grown[:self._have] = self._buf[:self._have]
                self._buf = grown
            self._buf[self._have:n] = self.blocks[self._have:n]
            self._have = n
        return self._buf[:n]


@dataclass
class CacheStats:
    """Counters of a stage's prefix cache (the metrics read them)."""

    queried_tokens: int = 0     # prompt tokens looked up at admission
    hit_tokens: int = 0         # of those, found cached (their prefill skipped)
    preempted: int = 0          # sequences preempted for lack of blocks


class KVBlockManager:
    """A stage's blocks: admission (prefix lookup + the blocks a prompt needs), growth as a sequence
    decodes, publication of computed full blocks, release. Blocks are reserved for the positions a
    step writes before it runs."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block size must be positive, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.stats = CacheStats()
        # a conversation's next turn re-sends its history: its blocks' hashes come from the last turn's
        self.hasher = PrefixHasher(block_size, max_tokens=max(num_blocks * block_size, 1 << 16))

    @property
    def enable_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def admit(self, tokens: Sequence[int], spans: Sequence[ContentSpan] = (), reserve: int = 0,
              max_cached: int | None = None) -> BlockTable | None:
        """A table for a prompt of `tokens` with room for `reserve` more positions, taking its cached
        prefix; None when the pool cannot hold it now (nothing taken). The cached prefix ends before
        the prompt's last token (its logits must be computed) and at most at `max_cached` tokens."""
        bs = self.block_size
        hashes = self.hasher(tokens, spans) if self.enable_caching else []
        usable = (len(tokens) - 1) // bs
        if max_cached is not None:
            usable = min(usable, max_cached // bs)
        hit = self.pool.lookup(hashes[:usable])
        need = self.blocks_for(len(tokens) + reserve) - len(hit)
        # a hit block that is free counts against the free blocks too: taking it removes it from them
        free_hits = int(np.count_nonzero(self.pool.refs[hit] == 0)) if hit else 0
        if need > self.pool.free - free_hits:
            return None
        self.pool.take(hit)
        table = BlockTable(hit + self.pool.allocate(need), len(hit) * bs, len(hit), hashes)
        self.stats.queried_tokens += len(tokens)
        self.stats.hit_tokens += table.cached_tokens
        return table

    def can_grow(self, table: BlockTable, tokens: int) -> bool:
        return self.blocks_for(tokens) - len(table.blocks) <= self.pool.free

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Blocks for the table to hold `tokens` positions; False (nothing taken) if not enough are free."""
        need = self.blocks_for(tokens) - len(table.blocks)
        if need <= 0:
            return True
        if need > self.pool.free:
            return False
        table.blocks += self.pool.allocate(need)
        return True

    def publish(self, table: BlockTable, tokens: Sequence[int], computed: int,
                spans: Sequence[ContentSpan] = ()) -> None:
        """Publish the table's full blocks whose `computed` first positions hold their keys
        (`tokens`: the sequence's ids so far, prompt then reply)."""
        if not self.enable_caching:
            return
        if computed > table.capacity(self.block_size):
            raise ValueError(f"{computed} positions computed, but the table holds {table.capacity(self.block_size)}")
        full = min(computed, len(tokens)) // self.block_size
        if full <= table.published:
            return
        hashes = table.hashes
        if len(hashes) < full:
            parent = hashes[-1] if hashes else b""
            start = len(hashes) * self.block_size
            shifted = [ContentSpan(s.start - start, s.end - start, s.digest) for s in spans if s.end > start]
            hashes += prefix_hashes(tokens[start:full * self.block_size], self.block_size, shifted, parent)
        for i in range(table.published, full):
            self.pool.publish(table.blocks[i], hashes[i])
        table.published = full

    def release(self, table: BlockTable, trusted: bool = True) -> None:
        """Give the table's blocks back; `trusted=False` (its numbers went non-finite): the blocks it
        wrote are unpublished first, never found again."""
        if not trusted:
            own = table.blocks[table.cached_tokens // self.block_size:]
            self.pool.unpublish(own)
        self.pool.release(table.blocks)
        table.blocks, table.published = [], 0
