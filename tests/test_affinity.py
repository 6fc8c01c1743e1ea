"""The balancer's affinity choice (services.runtime.affinity) on its own: no servers, the real
StageBalancer over plain addresses whose load and health are set as the balancer would set them
(streams in flight, a failed stream). Two real thinker replicas: tests/test_replicas.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.services.runtime.affinity import AffinityTable, RouteKey, content_digest, prompt_key
from voxpipe.services.runtime.balancer import BalancerOptions, StageBalancer
from voxpipe.services.runtime.block_pool import PrefixHasher

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"
BS = 16
AUDIO = 7                         # a placeholder id for these tests


def ids(n: int, seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i) % 1000 + 10 for i in range(n)]


def run(body, addresses=(A, B), **options):
    """`body(balancer)` inside an event loop (grpc.aio channels belong to one), then closed."""
    async def go():
        balancer = StageBalancer("thinker", list(addresses), channel_options=[],
                                 options=BalancerOptions(**options))
        try:
            return body(balancer, {r.address: r for r in balancer.replicas})
        finally:
            await balancer.close()
    return asyncio.run(go())


def test_a_route_key_with_a_remembering_hasher_is_the_key_from_scratch():
    """The client's route keys hash a conversation's history once (PrefixHasher): each turn's key --
    the history re-sent (hit), another branch (partial), another conversation (miss), a clip whose
    content changed under the same placeholders -- is the key computed from scratch."""
    hasher = PrefixHasher(16)
    pad, clip_a, clip_b = 5, b"a" * 32, b"b" * 32
    history = ids(100)
    turns = [(history, ()), (history + ids(60, seed=2), ()), (history[:50] + ids(90, seed=3), ()),
             (ids(70, seed=4), ()), (history + [pad] * 20 + ids(30, seed=5), (clip_a,)),
             (history + [pad] * 20 + ids(30, seed=5), (clip_b,)), (history + [pad] * 20 + ids(50, seed=5), (clip_b,))]
    for prompt, digests in turns + turns:
        want = prompt_key(prompt, "s", pad, digests)
        assert prompt_key(prompt, "s", pad, digests, hasher=hasher) == want
    assert hasher.reused_blocks > 0
    assert prompt_key(history, hasher=PrefixHasher(32)) == prompt_key(history)     # another block size: not used


def test_the_longest_known_prefix_wins():
    long, short = prompt_key(ids(80)), prompt_key(ids(40))

    def body(bal, r):
        bal.affinity.record(A, short)          # blocks 0, 1 on A
        bal.affinity.record(B, long)           # blocks 0 .. 4 on B (0, 1 on both)
        got = bal.pick(key=prompt_key(ids(96)))
        other = bal.pick(key=prompt_key(ids(40) + ids(40, seed=5)))   # blocks 0, 1 on both: ties by load
        return got, other, bal.affinity.stats

    got, other, stats = run(body, (A, B, C))
    assert got.address == B
    assert other.address in (A, B)
    assert stats.outcomes["prefix"] == 2
    # the first pick matched blocks 0..4 on B, the second blocks 0..1
    assert stats.matched_tokens == 5 * BS + 2 * BS and stats.queried_tokens == 96 + 80


def test_no_known_prefix_goes_to_the_least_loaded():
    def body(bal, r):
        r[A].in_flight = 2
        return bal.pick(key=prompt_key(ids(64))), bal.affinity.stats.outcomes

    got, outcomes = run(body)
    assert got.address == B and outcomes["least_loaded"] == 1


def test_the_load_bound_is_respected():
    """A holds the prefix; it takes the pick while it would hold at most
    ceil(1.1 * (streams in flight + 1) / 2) + 1 streams after it."""
    key = prompt_key(ids(64))
    #         (A's, B's streams in flight) -> replica: A's count after, the cap
    cases = [((1, 0), A),      # 2 <= 3
             ((3, 0), A),      # 4 <= 4
             ((10, 6), A),     # 11 <= 11
             ((4, 0), B),      # 5 > 4
             ((12, 6), B)]     # 13 > 12

    def body(bal, r):
        bal.affinity.record(A, key)
        picks = []
        for (a, b), _ in cases:
            r[A].in_flight, r[B].in_flight = a, b
            picks.append(bal.pick(key=key).address)
            bal.affinity.record(A, key)     # A again holds it first (a pick records where it went)
        return picks, dict(bal.affinity.stats.outcomes)

    picks, outcomes = run(body)
    assert picks == [want for _, want in cases]
    # the first pick B got was least loaded; from then on B holds the prefix too (the second pick is B's by prefix)
    assert outcomes == {"prefix": 4, "least_loaded": 1}


def test_unhealthy_draining_and_avoided_replicas_are_never_chosen_by_affinity():
    key = prompt_key(ids(64), session="s1")

    def body(bal, r):
        picks = []
        for state in ("healthy", "draining", "avoid", "unhealthy"):
            bal.affinity.record(A, key)        # the session and the prefix are A's
            r[A].healthy, r[A].draining = state != "unhealthy", state == "draining"
            picks.append(bal.pick(avoid=[r[A]] if state == "avoid" else (), key=key).address)
        return picks

    assert run(body) == [A, B, B, B]


def test_a_failed_or_draining_replica_drops_out_of_the_table():
    key = prompt_key(ids(64), session="s1")

    async def go():
        bal = StageBalancer("thinker", [A, B], channel_options=[],
                            options=BalancerOptions(cooldown_s=30))
        try:
            r = {x.address: x for x in bal.replicas}
            assert bal.pick(key=key).address == A           # round robin starts at A; recorded there
            assert bal.affinity.sessions == {"s1": A} and bal.affinity.depths(key) == {A: 4}
            bal.report_failure(r[A], grpc.StatusCode.UNAVAILABLE, "connection refused")
            assert bal.affinity.sessions == {} and bal.affinity.depths(key) == {}
            moved = bal.pick(key=key)                       # the session moves to B and stays there
            r[A].healthy = True
            stays = bal.pick(key=key)
            bal.report_failure(r[B], grpc.StatusCode.UNAVAILABLE, "shutting down: draining")
            return moved.address, stays.address, dict(bal.affinity.sessions), r[B].draining
        finally:
            await bal.close()

    assert asyncio.run(go()) == (B, B, {}, True)


def test_a_session_prefers_its_replica_and_moves_when_it_is_full():
    def body(bal, r):
        first = bal.pick(key=RouteKey(session="s")).address
        other = B if first == A else A
        r[first].in_flight = 1
        again = bal.pick(key=RouteKey(session="s")).address           # cap 3: it fits
        r[first].in_flight, r[other].in_flight = 10, 5                # cap 10: it would hold 11
        moved = bal.pick(key=RouteKey(session="s")).address
        r[first].in_flight = r[other].in_flight = 0
        back = bal.pick(key=RouteKey(session="s")).address            # it stays where it moved
        return first, again, moved, back, other, dict(bal.affinity.stats.outcomes)

    first, again, moved, back, other, outcomes = run(body)
    assert again == first and moved == other and back == other
    assert outcomes == {"least_loaded": 2, "session": 2}


def test_the_table_is_bounded_least_recently_used_first():
    t = AffinityTable(max_blocks=6, max_sessions=2)
    old, new = prompt_key(ids(64, seed=1)), prompt_key(ids(64, seed=2))     # 4 blocks each
    t.record(A, old)
    t.record(B, new)
    assert len(t.blocks) == 6
    # the older prompt lost its tail first: its head is still known
    assert t.depths(old) == {A: 2} and t.depths(new) == {B: 4}
    for s in ("x", "y", "z"):
        t.record(A, RouteKey(session=s))
    assert list(t.sessions) == ["y", "z"]


def test_block_hashes_follow_content_not_names():
    feats = torch.arange(2 * 50, dtype=torch.float32).reshape(2, 50)
    prompt = ids(20) + [AUDIO] * 30 + ids(30, seed=3)
    same = prompt_key(prompt, placeholder=AUDIO, digests=[content_digest(feats.clone())])
    key = prompt_key(prompt, placeholder=AUDIO, digests=[content_digest(feats)])
    other = prompt_key(prompt, placeholder=AUDIO, digests=[content_digest(feats + 1)])
    assert same.blocks == key.blocks and len(key.blocks) == 5
    # block 0 has no audio; from block 1 (the clip begins at 20) the content differs
    assert other.blocks[0] == key.blocks[0] and all(a != b for a, b in zip(other.blocks[1:], key.blocks[1:]))


def test_the_client_hashes_nothing_with_one_replica_and_keys_with_two():
    feats = [torch.ones(2, 40)]
    req = SpeechRequest(token_ids=ids(20) + [AUDIO] * 10 + ids(20), audio_features=feats, session="conv")

    async def go():
        async with PipelineClient(A) as one, PipelineClient([A, B], audio_token=AUDIO) as two, \
                PipelineClient([A, B]) as blind:
            return await one.route_key(req), await two.route_key(req), await blind.route_key(req)

    one, two, blind = asyncio.run(go())
    assert one is None
    assert two == prompt_key(req.token_ids, "conv", AUDIO, [content_digest(feats[0])])
    assert blind == RouteKey(session="conv")        # the clips' places unknown: the session alone


def test_bad_load_bounds_are_refused():
    with pytest.raises(ValueError):
        AffinityTable(load_bound=0.5)
    with pytest.raises(ValueError):
        AffinityTable(load_slack=-1)
