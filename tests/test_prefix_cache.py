"""Paged KV and the prefix cache: the block pool's bookkeeping, the paged attention views against
dense attention, and the thinker engine (tiny checkpoint, float32, CPU) on conversations whose
turns hit, partly hit and miss the cache, after eviction and under preemption: every output equals
the same request with the prefix cache off and transformers' greedy generate."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from voxpipe.cli import build_parser
from voxpipe.services.runtime import metrics
from voxpipe.services.runtime.block_pool import (BlockPool, BlockTable, ContentSpan, JoinedIds, KVBlockManager, PrefixHasher,
                                                   prefix_hashes)
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.kv_cache import _causal_sdpa, _sdpa
from voxpipe.services.runtime.outputs import Finished, TalkerPromptOut, TextOut
from voxpipe.services.runtime.paged_kv import PagedKVCache, PagedPackedStep
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.services.thinker.job import ThinkerJob
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render
from voxpipe.services.thinker.runner import audio_blocks, audio_offsets, audio_spans
from oracle import num_audio_tokens, reference_generate, reference_thinker

BS = 16


# ---------------------------------------------------------------------------------------------- block pool


def test_prefix_hashes_chain_tokens_and_content():
    a = prefix_hashes(list(range(40)), BS)
    assert len(a) == 2                                          # the trailing 8 tokens make no full block
    assert prefix_hashes(list(range(32)), BS) == a               # a block's hash covers only its prefix
    b = prefix_hashes([99] + list(range(1, 40)), BS)
    assert b[0] != a[0] and b[1] != a[1]                         # a change in block 0 changes every later hash
    # placeholders: the same ids, other content -> other hashes from the block holding the content on
    spans1, spans2 = [ContentSpan(20, 36, b"clip-one")], [ContentSpan(20, 36, b"clip-two")]
    h1, h2 = prefix_hashes(list(range(40)), BS, spans1), prefix_hashes(list(range(40)), BS, spans2)
    assert h1[0] == h2[0] == a[0] and h1[1] != h2[1] and h1[1] != a[1]
    assert prefix_hashes(list(range(40)), BS, spans1) == h1      # content hashes are stable


def test_prefix_hasher_remembers_a_history_and_equals_hashing_from_scratch():
    """A conversation's next turn: its history's blocks come from the last turn's hashes (hit), a
    prompt that leaves it inside a block recomputes from that block (partial hit), an unrelated one
    hashes everything (miss); every answer is prefix_hashes' own, lists and arrays alike."""
    rng = np.random.default_rng(0)
    hasher = PrefixHasher(BS)
    history = rng.integers(0, 400, 1000).tolist()
    assert hasher(history) == prefix_hashes(history, BS) and hasher.reused_blocks == 0
    turn = history + rng.integers(0, 400, 300).tolist()                        # hit: the history's 62 blocks
    assert hasher(np.asarray(turn)) == prefix_hashes(turn, BS) and hasher.reused_blocks == 1000 // BS
    assert hasher.held_tokens == len(turn) // BS * BS                          # the turn replaced the history
    forked = turn[:500] + [399 - t for t in turn[500:]]                        # partial: differs from 500 on
    before = hasher.reused_blocks
    assert hasher(forked) == prefix_hashes(forked, BS) and hasher.reused_blocks - before == 500 // BS
    other = rng.integers(0, 400, 700).tolist()                                 # miss: another first block
    before = hasher.reused_blocks
    assert hasher(other) == prefix_hashes(other, BS) and hasher.reused_blocks == before
    assert hasher(turn) == prefix_hashes(turn, BS)                             # both branches remembered
    assert hasher(turn[:10]) == [] and hasher(turn[:BS]) == prefix_hashes(turn[:BS], BS)


def test_prefix_hasher_reuses_no_block_whose_content_spans_differ():
    """Same token ids, other content behind a placeholder run (or a run moved): hashes from the first
    block the spans reach are computed again, and equal hashing from scratch."""
    hasher = PrefixHasher(BS)
    tokens = list(range(200))
    clip = [ContentSpan(100, 140, b"clip-one")]
    assert hasher(tokens, clip) == prefix_hashes(tokens, BS, clip)
    for spans in ([ContentSpan(100, 140, b"clip-two")], [ContentSpan(104, 140, b"clip-one")], [],
                  clip + [ContentSpan(150, 160, b"clip-three")]):
        before = hasher.reused_blocks
        assert hasher(tokens, spans) == prefix_hashes(tokens, BS, spans)
        first_diff = 150 if len(spans) == 2 else 100
        assert hasher.reused_blocks - before == first_diff // BS
    before = hasher.reused_blocks
    longer = tokens + list(range(64))                                          # same clip, more turns: a hit
    assert hasher(longer, clip) == prefix_hashes(longer, BS, clip) and hasher.reused_blocks - before == 200 // BS


def test_prefix_hasher_is_bounded_and_exact_after_eviction():
    rng = np.random.default_rng(1)
    hasher = PrefixHasher(BS, max_tokens=2048, per_key=2)
    prompts = [rng.integers(0, 400, int(n)).tolist() for n in rng.integers(100, 900, 12)]
    shared = prompts[0][:64]
    prompts += [shared + rng.integers(0, 400, 300).tolist() for _ in range(4)]   # one first block, 4 prompts
    for _ in range(3):
        for p in prompts:
            assert hasher(p) == prefix_hashes(p, BS)
            assert hasher.held_tokens <= 2048 or len(hasher._lru) == 1
            assert all(len(same) <= 2 for same in hasher._by_first.values())
    for p in prompts:                                                           # random extensions and forks
        q = p[:int(rng.integers(0, len(p)))] + rng.integers(0, 400, int(rng.integers(0, 200))).tolist()
        assert hasher(q) == prefix_hashes(q, BS)
    big = rng.integers(0, 400, 5000).tolist()                                  # longer than the bound: kept alone
    assert hasher(big) == prefix_hashes(big, BS) and len(hasher._lru) == 1
    off = PrefixHasher(BS, max_tokens=0)                                        # remembers nothing
    assert off(prompts[0]) == prefix_hashes(prompts[0], BS) and off.held_tokens == 0


def test_audio_blocks_are_the_blocks_with_placeholders():
    """Per span (not per block): the blocks a walk over every block finds audio placeholders in."""
    spans = (ContentSpan(3, 3, b"empty"), ContentSpan(10, 40, b"a"), ContentSpan(40, 41, b"b"), ContentSpan(95, 130, b"c"))
    for blocks in (0, 2, 6, 8, 20):
        assert audio_blocks(spans, blocks, BS) == [b for b in range(blocks) if audio_offsets(spans, b, BS)]
    assert audio_blocks((), 10, BS) == []


def test_a_tables_array_follows_its_blocks():
    """BlockTable.array (what a step's table tensor copies) equals its block list as it grows a block
    at a time and in bulk, after a release empties it, and when the list is replaced."""
    table = BlockTable([5, 3])
    assert table.array().tolist() == [5, 3]
    for more in ([7], list(range(100, 140)), [], [9]):
        table.blocks += more
        assert table.array().tolist() == table.blocks
    table.blocks = []
    assert table.array().tolist() == []
    table.blocks += [1, 2]
    assert table.array().tolist() == [1, 2]
    table.blocks = [8, 8, 4]
    assert table.array().tolist() == [8, 8, 4]


def test_joined_ids_slice_as_the_concatenation():
    head, tail = list(range(40)), list(range(100, 120))
    joined, whole = JoinedIds(head, tail), head + tail
    assert len(joined) == 60
    for start, stop in ((0, 60), (16, 48), (40, 60), (32, 40), (45, 50), (0, 0), (50, 100)):
        assert joined[start:stop] == whole[start:stop]
    with pytest.raises(TypeError):
        joined[3]


def test_block_pool_reuses_unpublished_blocks_first_and_evicts_the_least_recently_used():
    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.free == 0 and sorted(a + b) == [0, 1, 2, 3]
    pool.publish(a[0], b"ha")
    pool.publish(b[0], b"hb")
    pool.release(a)          # a[0] published (findable), a[1] plain
    pool.release(b)
    assert pool.free == 4 and pool.lookup([b"ha"]) == [a[0]] and pool.lookup([b"hb"]) == [b[0]]
    taken = pool.allocate(2)          # the two plain blocks first: both hashes survive
    assert sorted(taken) == sorted([a[1], b[1]]) and pool.cached == 2
    pool.take(pool.lookup([b"hb"]))   # hb used again: ha is now the least recently used
    pool.release([b[0]])
    assert pool.allocate(1) == [a[0]] and pool.lookup([b"ha"]) == [] and pool.lookup([b"hb"]) == [b[0]]
    with pytest.raises(ValueError):
        pool.allocate(2)


class _ListPool:
    """The block pool's contract walked block by block (a dict of free published blocks in LRU order):
    what BlockPool's arrays and queue must give, allocation order included."""

    def __init__(self, n: int) -> None:
        from collections import OrderedDict

        self.refs, self.hash_of, self.by_hash = [0] * n, [None] * n, {}
        self.plain, self.lru = list(range(n - 1, -1, -1)), OrderedDict()

    @property
    def free(self) -> int:
        return len(self.plain) + len(self.lru)

    def allocate(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.plain:
                b = self.plain.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.by_hash[self.hash_of[b]]
                self.hash_of[b] = None
            self.refs[b] = 1
            out.append(b)
        return out

    def lookup(self, hashes):
        out = []
        for h in hashes:
            if h not in self.by_hash:
                break
            out.append(self.by_hash[h])
        return out

    def take(self, blocks):
        for b in blocks:
            if self.refs[b] == 0:
                del self.lru[b]
            self.refs[b] += 1

    def release(self, blocks):
        for b in reversed(blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if self.hash_of[b] is not None:
                    self.lru[b] = None
                else:
                    self.plain.append(b)

    def publish(self, b, h):
        if self.hash_of[b] is None and h not in self.by_hash:
            self.hash_of[b], self.by_hash[h] = h, b

    def unpublish(self, blocks):
        for b in blocks:
            if self.hash_of[b] is not None:
                del self.by_hash[self.hash_of[b]]
                self.hash_of[b] = None
                if self.refs[b] == 0:
                    del self.lru[b]
                    self.plain.append(b)


@pytest.mark.parametrize("compact_slack", [1024, 0])
def test_block_pool_keeps_the_block_by_block_contract_under_random_traffic(compact_slack):
    """Sequences taking cached prefixes, growing, publishing, ending, being poisoned, and the cache
    reset: every allocation (its order too), lookup and count as the block-by-block walk gives them,
    through many evictions (the queue's stale entries compacted on the way: often with no slack)."""
    import random

    rnd = random.Random(3)
    n = 48
    pool, ref = BlockPool(n), _ListPool(n)
    pool.compact_slack = compact_slack
    live: list[list[int]] = []
    hashes = [b"h%d" % i for i in range(40)]
    for step in range(4000):
        op = rnd.random()
        if op < 0.4 and pool.free:
            prefix = hashes[:rnd.randrange(0, 12)]
            hit = pool.lookup(prefix)
            assert hit == ref.lookup(prefix)
            want = rnd.randrange(1, 6)
            free_hits = sum(1 for b in hit if ref.refs[b] == 0)
            if want <= pool.free - free_hits:
                pool.take(hit)
                ref.take(hit)
                got = pool.allocate(want)
                assert got == ref.allocate(want)
                table = hit + got
                for i, b in enumerate(table):
                    if rnd.random() < 0.5:
                        h = hashes[rnd.randrange(len(hashes))] if rnd.random() < 0.3 else hashes[min(i, 39)]
                        pool.publish(b, h)
                        ref.publish(b, h)
                live.append(table)
        elif op < 0.8 and live:
            table = live.pop(rnd.randrange(len(live)))
            if rnd.random() < 0.1:
                pool.unpublish(table)
                ref.unpublish(table)
            pool.release(table)
            ref.release(table)
        elif op < 0.81:
            assert pool.reset_cache() == sum(h is not None for h in ref.hash_of)
            ref.unpublish([b for b in range(n) if ref.hash_of[b] is not None])
        assert pool.free == ref.free and pool.cached == len(ref.by_hash)
        assert pool.refs.tolist() == ref.refs and pool.hash_of == ref.hash_of
    with pytest.raises(RuntimeError, match="released more often than taken"):
        pool.release([pool.allocate(1)[0]] * 2 if pool.free else live[0] * 2)


def test_block_manager_hit_partial_hit_miss_and_the_last_block_rule():
    m = KVBlockManager(num_blocks=32, block_size=BS)
    prompt = list(range(50))                    # 3 full blocks + 2
    t1 = m.admit(prompt, reserve=1)
    assert t1.cached_tokens == 0 and len(t1.blocks) == 4
    m.publish(t1, prompt, 50)
    assert t1.published == 3
    # the same prompt: its 3 full blocks are cached
    t2 = m.admit(prompt, reserve=1)
    assert t2.cached_tokens == 48 and t2.blocks[:3] == t1.blocks[:3] and t2.blocks[3] != t1.blocks[3]
    # exactly 48 tokens: the last block is recomputed (its logits), never written shared
    t3 = m.admit(prompt[:48], reserve=1)
    assert t3.cached_tokens == 32
    # a partial hit: the first 2 blocks shared, then it differs
    other = prompt[:40] + [7] * 30
    t4 = m.admit(other, reserve=1)
    assert t4.cached_tokens == 32
    assert m.admit([5] + prompt[1:], reserve=1).cached_tokens == 0           # a miss
    assert m.stats.hit_tokens == 48 + 32 + 32
    # max_cached caps the hit (a talker prompt's audio rows need their hidden layer)
    assert m.admit(prompt, reserve=1, max_cached=20).cached_tokens == 16


def test_block_manager_refuses_what_does_not_fit_and_untrusted_blocks_are_never_found():
    m = KVBlockManager(num_blocks=4, block_size=BS)
    t = m.admit(list(range(40)), reserve=1)            # 3 blocks
    assert m.admit(list(range(100, 140)), reserve=1) is None and m.pool.free == 1   # nothing taken
    assert m.grow(t, 48) and len(t.blocks) == 3 and m.grow(t, 49) and not m.grow(t, 80) and len(t.blocks) == 4
    m.publish(t, list(range(48)), 48)
    m.release(t, trusted=False)                         # its numbers went non-finite
    assert m.pool.cached == 0 and m.pool.free == 4
    assert m.admit(list(range(48)), reserve=1).cached_tokens == 0


# ---------------------------------------------------------------------------------------------- paged views


def _filled_cache(lengths, hkv=2, d=8, blocks=32):
    """A paged cache holding random keys / values for sequences of `lengths` (blocks handed out
    shuffled), and the same as dense [Hkv, L, D] tensors."""
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(2, blocks, BS, hkv, d, torch.float32, "cpu")
    order = torch.randperm(blocks, generator=g).tolist()
    tables, dense = [], []
    for n in lengths:
        nb = -(-n // BS)
        table, order = order[:nb], order[nb:]
        k, v = torch.randn(2, hkv, n, d, generator=g), torch.randn(2, hkv, n, d, generator=g)
        pos = torch.arange(n)
        for layer in range(2):
            cache.write(layer, torch.tensor(table)[pos // BS], pos % BS, k[layer].transpose(0, 1), v[layer].transpose(0, 1))
        tables.append(table)
        dense.append((k, v))
    return cache, tables, dense


def test_paged_decode_and_packed_views_equal_dense_attention():
    hq, hkv, d = 4, 2, 8
    lengths = [5, 37, 16]
    cache, tables, dense = _filled_cache(lengths, hkv, d)
    g = torch.Generator().manual_seed(1)
    # decode: one new token per sequence at position len
    q, k, v = (torch.randn(3, h, 1, d, generator=g) for h in (hq, hkv, hkv))
    start = torch.tensor(lengths)
    unused = sorted(set(range(32)) - {b for t in tables for b in t})
    for t, n in zip(tables, lengths):
        while len(t) * BS < n + 1:
            t.append(unused.pop())
    kv_len = max(lengths) + 1
    view = cache.decode_view(3, kv_len, cache.table_tensor(tables, 8), start)
    out = view.attend(0, q, k, v, 0.5)
    for b, n in enumerate(lengths):
        keys = torch.cat((dense[b][0][0], k[b]), dim=1)[None]
        values = torch.cat((dense[b][1][0], v[b]), dim=1)[None]
        want = _sdpa(q[b:b + 1], keys, values, None, 0.5)
        assert torch.allclose(out[b:b + 1], want, atol=1e-6)
    # packed: 4 new tokens after sequence 1's 37 cached ones, then 3 from position 0 of a new sequence
    cache2, tables2, dense2 = _filled_cache([37], hkv, d)
    unused = sorted(set(range(32)) - set(tables2[0]))
    tables2[0].append(unused.pop())
    fresh = [unused.pop()]
    step = PagedPackedStep.pack([(tables2[0], 37, 4), (fresh, 0, 3)])
    q, k, v = (torch.randn(1, h, 7, d, generator=g) for h in (hq, hkv, hkv))
    out = cache2.packed(step).attend(0, q, k, v, 0.5)
    keys = torch.cat((dense2[0][0][0], k[0, :, :4]), dim=1)[None]
    values = torch.cat((dense2[0][1][0], v[0, :, :4]), dim=1)[None]
    assert torch.allclose(out[:, :, :4], _causal_sdpa(q[:, :, :4], keys, values, 0.5), atol=1e-6)
    assert torch.allclose(out[:, :, 4:], _causal_sdpa(q[:, :, 4:], k[:, :, 4:], v[:, :, 4:], 0.5), atol=1e-6)
    # the null block stays zero whatever a padding row writes, and scratch takes the writes
    cache2.write(0, torch.tensor([cache2.null]), torch.tensor([0]), torch.ones(1, hkv, d), torch.ones(1, hkv, d))
    assert not cache2.k[0][cache2.null].any() and cache2.k[0][cache2.scratch, :, 0].eq(1).all()


# ---------------------------------------------------------------------------------------------- the engine


def _engine(model_dir, *flags: str):
    from voxpipe.services.thinker import server as thinker_server

    ns = build_parser().parse_args(["thinker", "--model", str(model_dir), "--device", "cpu", "--port", "0", "--max-batch", "4", *flags])
    return thinker_server.build(ns)[0].engine


@pytest.fixture(scope="module")
def cached(tiny_model_dir):
    return _engine(tiny_model_dir)


@pytest.fixture(scope="module")
def uncached(tiny_model_dir):
    return _engine(tiny_model_dir, "--no-prefix-cache")


@pytest.fixture(scope="module")
def graphed(tiny_model_dir):
    """The cached engine with its CUDA-graph plans emulated on the CPU (cuda_graphs.EMULATE): a
    prompt with a cached prefix replays the extend graph (right-padded rows from their cached
    prefixes), a short prompt without one the prefill graph, decode the decode graph."""
    from voxpipe.services.runtime import cuda_graphs
    before = cuda_graphs.EMULATE
    cuda_graphs.EMULATE = True
    try:
        engine = _engine(tiny_model_dir)
    finally:
        cuda_graphs.EMULATE = before
    g = engine.runner.extend_graphs
    assert g is not None and g.emulated and g.replays == 0
    return engine


def _job(engine, rid: str, messages: list[ChatMessage], max_tokens: int = 6, talker_rows: bool = True):
    rendered = render(engine.tokenizer, engine.cfg, messages)
    return ThinkerJob(request_id=rid, outbox=Outbox(asyncio.get_event_loop(), limit=10_000), prompt=rendered.token_ids,
                      audio=list(rendered.audio_features), max_tokens=max_tokens, min_tokens=max_tokens,
                      talker_rows=talker_rows)


def _run(engine, jobs) -> None:
    for j in jobs:
        engine.submit(j)
    while engine.has_work():
        engine.step()


def _output(job) -> tuple[list[int], list[bytes], Finished, list[bytes]]:
    """The job's token ids, its talker rows (bytes), its Finished, and its talker prompt's user rows
    and assistant head (bytes; none when it sent no talker prompt)."""
    asyncio.get_event_loop().run_until_complete(asyncio.sleep(0))
    items = []
    while (got := job.outbox.poll_timed()) is not None:
        items.append(got[0])
    assert isinstance(items[-1], Finished), items[-1]
    outs = [i for i in items if isinstance(i, TextOut)]
    prompts = [to_proto(t).data for p in items if isinstance(p, TalkerPromptOut)
               for t in (p.user_rows, p.assistant_head) if t is not None]
    return ([t for o in outs for t in o.token_ids], [to_proto(o.rows).data for o in outs if o.rows is not None],
            items[-1], prompts)


_UNCACHED: dict[tuple[int, ...], tuple] = {}   # prompt -> the uncached engine's (ids, rows)


@pytest.mark.parametrize("which", ["cached", "graphed"])
def test_a_conversation_hits_partly_hits_and_misses_with_the_outputs_of_no_cache_and_transformers(
        which, uncached, tiny_model_dir, loop, request):
    cached = request.getfixturevalue(which)
    system = ChatMessage.text("system", "You are a lighthouse keeper who answers in long careful sentences.")
    turn1 = [system, ChatMessage.text("user", "Tell me about the sea at night, and the ships that pass.")]
    hits = []

    def both(rid, messages):
        a = _job(cached, rid, messages)
        _run(cached, [a])
        got = _output(a)
        key = tuple(a.prompt)
        if key not in _UNCACHED:       # the same prompts in both parametrizations: run the uncached engine once
            b = _job(uncached, rid, messages)
            _run(uncached, [b])
            _UNCACHED[key] = _output(b)[:2]
        assert got[:2] == _UNCACHED[key], rid
        hits.append(got[2].cached_tokens)
        return a.prompt, got[0]

    prompt1, reply1 = both("turn1", turn1)
    assert hits[-1] == 0                                          # a miss: nothing cached yet
    text1 = cached.tokenizer.decode(reply1[:-1] if reply1[-1] == cached.eos_ids[0] else reply1)
    turn2 = turn1 + [ChatMessage.text("assistant", text1), ChatMessage.text("user", "And in a storm?")]
    prompt2, reply2 = both("turn2", turn2)
    # a partial hit: turn 1's prompt blocks (its reply's blocks too where the tokens agree)
    assert BS <= hits[-1] < len(prompt2) and hits[-1] % BS == 0 and hits[-1] >= (len(prompt1) // BS) * BS
    both("turn2-again", turn2)
    assert hits[-1] == ((len(prompt2) - 1) // BS) * BS              # a hit: all but the last block
    both("other", [ChatMessage.text("system", "Another persona."), ChatMessage.text("user", "Hi!")])
    assert hits[-1] == 0                                          # a miss
    for prompt, reply in ((prompt1, reply1), (prompt2, reply2)) if which == "cached" else ():   # equal replies: once
        ref = reference_generate(tiny_model_dir, prompt, max_tokens=6, min_tokens=6, max_frames=2, min_frames=2)
        assert reply == ref.text_ids
    get = metrics.REGISTRY.get_sample_value
    assert get("voxpipe_prefix_cache_tokens_total", {"stage": "thinker", "kind": "hit"}) >= sum(hits)
    if which == "graphed":
        assert cached.runner.extend_graphs.replays >= 2           # the two hits went on in the extend graph


def test_a_repetition_penalty_reads_the_prompt_and_reply_as_transformers_does(cached, tiny_model_dir, loop):
    """A reply with a repetition penalty (its seen ids kept as a mask, marked as it grows: runner.
    seen_ids) is transformers' greedy generate with that penalty over prompt + reply, token for
    token -- and not the reply without it (the penalty decides)."""
    from voxpipe.services.runtime.sampling import SamplingParams

    messages = [ChatMessage.text("user", "say it again and again: again and again and again")]
    replies = []
    for penalty in (1.0, 1.8):
        job = _job(cached, f"penalty-{penalty}", messages, max_tokens=12, talker_rows=False)
        job.params, job.min_tokens = SamplingParams(repetition_penalty=penalty), 0
        _run(cached, [job])
        want = reference_thinker(tiny_model_dir, job.prompt, [], max_tokens=12, repetition_penalty=penalty).text_ids
        assert job.generated == want
        replies.append(job.generated)
    assert replies[0] != replies[1]
    # the mask as the last token was sampled: the prompt and every reply token before it
    assert job.seen_upto == len(job.generated) - 1
    assert job.seen[1].nonzero().flatten().tolist() == sorted(set(job.prompt + job.generated[:-1]))


def test_eviction_under_a_small_pool_keeps_outputs(tiny_model_dir, uncached, loop):
    engine = _engine(tiny_model_dir, "--kv-cache-tokens", "128", "--max-len", "96")   # 8 blocks
    prompts = [[ChatMessage.text("user", f"Question number {i}: what is the colour of the sky at {i} o'clock?")]
               for i in range(4)]
    first = _job(engine, "first", prompts[0])
    _run(engine, [first])
    assert engine.runner.blocks.pool.cached > 0
    for i, p in enumerate(prompts[1:]):       # each takes blocks the earlier ones published
        _run(engine, [_job(engine, f"p{i}", p)])
    again = _job(engine, "again", prompts[0])
    _run(engine, [again])
    ref = _job(uncached, "ref", prompts[0])
    _run(uncached, [ref])
    got, want = _output(again), _output(ref)
    assert got[:2] == want[:2]
    assert got[2].cached_tokens < ((len(again.prompt) - 1) // BS) * BS      # evicted, at least partly
    assert engine.runner.blocks.pool.used == 0


def test_preemption_under_a_pool_too_small_for_the_batch_keeps_outputs(tiny_model_dir, uncached, loop):
    engine = _engine(tiny_model_dir, "--kv-cache-tokens", "96", "--max-len", "96")    # 6 blocks for 3 sequences
    prompts = [[ChatMessage.text("user", t)] for t in ("Count to twenty.", "Name the planets.", "Sing a song.")]
    before = metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "thinker"}) or 0
    jobs = [_job(engine, f"j{i}", p, max_tokens=40, talker_rows=False) for i, p in enumerate(prompts)]
    _run(engine, jobs)
    after = metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "thinker"})
    assert after > before, "the pool should have run out during decode"
    for i, (job, p) in enumerate(zip(jobs, prompts)):
        ref = _job(uncached, f"solo{i}", p, max_tokens=40, talker_rows=False)
        _run(uncached, [ref])
        assert _output(job)[0] == _output(ref)[0]
    assert engine.runner.blocks.pool.used == 0


def _clip(engine, seed: int, frames: int = 120) -> torch.Tensor:
    return torch.randn(engine.cfg.audio.num_mel_bins, frames, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_audio_turns_hit_by_content_and_a_talker_prompt_keeps_its_audio_rows(cached, uncached, tiny_model_dir, loop):
    clip, other = _clip(cached, 1), _clip(cached, 2)
    system = ChatMessage.text("system", "You listen to recordings and describe them in detail, one by one.")

    def turn(c, rid, talker_rows):
        msgs = [system, ChatMessage("user", [ChatPart(features=c), ChatPart(text="What is this sound?")])]
        a, b = _job(cached, rid, msgs, talker_rows=talker_rows), _job(uncached, rid, msgs, talker_rows=talker_rows)
        _run(cached, [a])
        _run(uncached, [b])
        got, want = _output(a), _output(b)
        assert got[:2] == want[:2], rid
        for g, w in zip(got[3], want[3]):   # hidden rows: chunked after a prefix vs one prefill, fp32 order
            assert torch.allclose(_rows(g), _rows(w), atol=1e-5, rtol=1e-5), rid
        return a, got

    job, _ = turn(clip, "clip", False)
    first_audio = job.prompt.index(cached.cfg.tokens.audio_token)
    again, got = turn(clip, "clip-again", False)
    assert got[2].cached_tokens > first_audio + BS                 # the same clip: its blocks are found
    _, got = turn(other, "other-clip", False)
    assert got[2].cached_tokens <= first_audio                     # other content, same ids: a miss from there
    # a talker prompt needs the audio rows' hidden layer: no cached prefix past the first placeholder
    # until a talker prompt of this prefix made them (then they are cached with its blocks)
    _, miss = turn(clip, "clip-talker", True)
    assert 0 < miss[2].cached_tokens <= first_audio and miss[3]
    _, hit = turn(clip, "clip-talker-again", True)
    assert hit[2].cached_tokens > first_audio + BS
    assert hit[3] == miss[3]              # the audio rows from the cache: the miss's bits, exactly
    ref = reference_generate(tiny_model_dir, again.prompt, input_features=clip, max_tokens=6, min_tokens=6,
                             max_frames=2, min_frames=2)
    assert _output_ids_of(cached, again.prompt, clip) == ref.text_ids
    assert num_audio_tokens(clip.shape[1]) == again.prompt.count(cached.cfg.tokens.audio_token)


def _rows(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.float32)


def _output_ids_of(engine, prompt, clip) -> list[int]:
    job = ThinkerJob(request_id="ids", outbox=Outbox(asyncio.get_event_loop(), limit=10_000), prompt=list(prompt),
                     audio=[clip], max_tokens=6, min_tokens=6)
    _run(engine, [job])
    ids, _, done, _ = _output(job)
    assert done.cached_tokens > 0
    return ids


def test_a_poisoned_request_publishes_nothing(cached, loop):
    huge = torch.full((cached.cfg.audio.num_mel_bins, 120), 3e38)
    msgs = [ChatMessage.text("system", "A long system prompt that fills more than one block of tokens."),
            ChatMessage("user", [ChatPart(features=huge), ChatPart(text="What is this?")])]
    bad = _job(cached, "bad", msgs, talker_rows=False)
    _run(cached, [bad])
    asyncio.get_event_loop().run_until_complete(asyncio.sleep(0))
    items = []
    while (got := bad.outbox.poll_timed()) is not None:
        items.append(got[0])
    assert not isinstance(items[-1], Finished)
    again = _job(cached, "bad-again", msgs, talker_rows=False)
    table = cached.runner.blocks.admit(again.prompt, audio_spans(cached.cfg, again.prompt,
                                                                 cached.runner.audio.keys(again.audio)), reserve=1)
    assert table.cached_tokens == 0                 # the failed request's blocks were never published
    cached.runner.blocks.release(table)


# ---------------------------------------------------------------------------------------------- the clients


LONG_SYSTEM = ("You are the keeper of a lighthouse on a rocky coast. You answer every question about the sea, "
               "the weather and the ships with patience and in full sentences.")


def test_cached_tokens_reach_the_openai_sdk_in_chat_and_realtime(client, model, gateway):
    """The unmodified SDK: a repeated conversation's usage counts its cached prompt tokens (chat:
    prompt_tokens_details.cached_tokens; realtime response.done: input_token_details.cached_tokens)."""
    from openai import AsyncOpenAI

    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "What is a lighthouse?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0)
    second = client.chat.completions.create(model=model, messages=messages, max_completion_tokens=3, temperature=0)
    prompt = second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == ((prompt - 1) // BS) * BS > 0
    assert first.usage.prompt_tokens_details.cached_tokens <= second.usage.prompt_tokens_details.cached_tokens
    assert second.choices[0].message.content == first.choices[0].message.content

    async def turns() -> list:
        sdk = AsyncOpenAI(api_key="unused", base_url=f"{gateway.base_url}/v1",
                          websocket_base_url=f"ws://127.0.0.1:{gateway.port}/v1")
        done = []
        async with sdk.realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "instructions": LONG_SYSTEM,
                                               "audio": {"input": {"turn_detection": None}}})
            for text in ("What is a lighthouse?", "And who keeps it?"):
                await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                          "content": [{"type": "input_text", "text": text}]})
                await conn.response.create(response={"max_output_tokens": 3})
                async for ev in conn:
                    assert ev.type != "error", ev
                    if ev.type == "response.done":
                        done.append(ev.response.usage)
                        break
        return done

    usage = asyncio.run(turns())
    # turn 2's prompt begins with turn 1's (instructions, first question, first answer)
    assert usage[1].input_token_details.cached_tokens >= BS
    assert usage[1].input_token_details.cached_tokens < usage[1].input_tokens


def test_a_prompt_past_the_context_is_400_context_length_exceeded(client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi."}],
                                       max_completion_tokens=70_000)
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert "max_tokens 70000 exceeds the context of 65536" in err["message"]


def test_the_conversation_workload_reports_each_turns_cached_fraction(stack, omni_config):
    """bench/conversation.py through the real stage services: turn 2 re-sends turn 1 and its reply as
    token ids, and the thinker's prefix cache holds them; the long-context probe's repeat is cached."""
    from voxpipe.bench import conversation
    from voxpipe.client import PipelineClient

    settings = conversation.Settings(turns=2, turn_tokens=40, text_tokens=4, frames=3, context_tokens=120)

    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
            return await conversation.run(client.stream, omni_config, settings, [1])

    report = asyncio.run(go())
    turns = report["levels"][0]["turns"]
    assert report["levels"][0]["failed"] == 0 and [t["turn"] for t in turns] == [1, 2]
    assert turns[0]["cached_fraction"] < 0.5 < turns[1]["cached_fraction"] < 1
    assert all(t["ttfp_p50_ms"] > 0 for t in turns)
    level = report["levels"][0]
    # one replica: both turns on it, its cached share the level's
    assert list(level["replicas"]) == [stack.address("thinker")] and level["load_spread"] == 0
    assert level["replicas"][stack.address("thinker")]["cached_fraction"] == level["cached_fraction"] > 0
    lc = report["long_context"]
    assert lc["cold"]["error"] is None and lc["repeated"]["cached_tokens"] >= lc["prompt_tokens"] - BS
    assert "conversation: 40-token user turns" in conversation.section(report)


def test_the_voice_conversation_workload_hits_earlier_clips(stack, omni_config, tiny_model_dir):
    """bench's voice-conversation: each user turn a new clip (the voice clip rotated per turn); turn 2
    re-sends turn 1's clip, which the prefix cache (keyed by the clip's content) holds."""
    from voxpipe.bench import conversation
    from voxpipe.bench.requests import RequestMaker
    from voxpipe.bench.voice_clip import load_clip
    from voxpipe.bench.workload import WORKLOADS
    from voxpipe.client import PipelineClient
    from voxpipe.services.thinker.prompt import FeatureExtractor

    wl = WORKLOADS["voice-conversation"]
    maker = RequestMaker(wl, omni_config, None, load_clip(None), FeatureExtractor.for_model(tiny_model_dir,
                                                                                           omni_config.thinker))
    assert not torch.equal(maker.turn_audio(0, 1), maker.turn_audio(0, 2))     # every turn is new audio
    settings = conversation.Settings(turns=2, turn_tokens=1, text_tokens=4, frames=3, context_tokens=0)

    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
            return await conversation.run(client.stream, omni_config, settings, [1], maker.turn_audio)

    report = asyncio.run(go())
    turns = report["levels"][0]["turns"]
    assert report["levels"][0]["failed"] == 0 and [t["turn"] for t in turns] == [1, 2]
    assert turns[0]["cached_fraction"] < 0.5 < turns[1]["cached_fraction"] < 1
    assert "conversation: a voice clip (rotated per turn) user turns" in conversation.section(report)
