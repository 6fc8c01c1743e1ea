"""The balancer's affinity choice (services.runtime.affinity) on its own: no servers, the real
StageBalancer over plain addresses whose load and health are set as the balancer would set them
(streams in flight, a failed stream), and the table fed hand-made sequences of streams opening and
closing, on a clock the test sets (no timing). Two real thinker replicas: tests/test_replicas.py."""

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


def test_the_longest_known_prefix_wins_and_a_shared_one_does_not_attract():
    long, short = prompt_key(ids(80)), prompt_key(ids(40))

    def body(bal, r):
        bal.affinity.record(A, short)          # blocks 0, 1 on A
        bal.affinity.record(B, long)           # blocks 0 .. 4 on B (0, 1 on both, and two prompts' now)
        got = bal.pick(key=prompt_key(ids(96)))
        r[A].in_flight = r[B].in_flight = 1
        # blocks 0, 1 are all it shares with anything, and other prompts began with them: by load (C)
        other = bal.pick(key=prompt_key(ids(40) + ids(40, seed=5)))
        return got, other, bal.affinity.stats

    got, other, stats = run(body, (A, B, C))
    assert got.address == B and other.address == C
    assert dict(stats.outcomes) == {"prefix": 1, "least_loaded": 1}
    # the first pick matched blocks 0..4 on B, the second none on C
    assert stats.matched_tokens == 5 * BS and stats.queried_tokens == 96 + 80


def test_no_known_prefix_goes_to_the_least_loaded():
    def body(bal, r):
        r[A].in_flight = 2
        return bal.pick(key=prompt_key(ids(64))), bal.affinity.stats.outcomes

    got, outcomes = run(body)
    assert got.address == B and outcomes["least_loaded"] == 1


def test_the_load_bound_is_respected():
    """A holds a prompt's prefix (its own: no other prompt began so); a new request with that prompt
    goes there while A would hold at most ceil(1.1 * (streams in flight + 1) / 2) + 1 streams after it."""
    #         (A's, B's streams in flight) -> replica: A's count after, the cap
    cases = [((1, 0), A),      # 2 <= 3
             ((3, 0), A),      # 4 <= 4
             ((10, 6), A),     # 11 <= 11
             ((4, 0), B),      # 5 > 4
             ((12, 6), B)]     # 13 > 12

    def body(bal, r):
        picks = []
        for i, ((a, b), _) in enumerate(cases):
            key = prompt_key(ids(64, seed=i + 1))
            bal.affinity.record(A, key)
            r[A].in_flight, r[B].in_flight = a, b
            picks.append(bal.pick(key=key).address)
        return picks, dict(bal.affinity.stats.outcomes)

    picks, outcomes = run(body)
    assert picks == [want for _, want in cases]
    assert outcomes == {"prefix": 3, "least_loaded": 2}


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
        # it stays up to ceil(1.25 * mean) + 1 (the stay margin over the bound of 1.1)
        r[first].in_flight, r[other].in_flight = 12, 5                # 18 after: 13 <= 13, it stays
        stays = bal.pick(key=RouteKey(session="s")).address
        r[first].in_flight, r[other].in_flight = 14, 4                # 19 after: 15 > 13, it moves
        moved = bal.pick(key=RouteKey(session="s")).address
        r[first].in_flight = r[other].in_flight = 0
        back = bal.pick(key=RouteKey(session="s")).address            # it stays where it moved
        return first, again, stays, moved, back, other, dict(bal.affinity.stats.outcomes)

    first, again, stays, moved, back, other, outcomes = run(body)
    assert again == first == stays and moved == other and back == other
    assert outcomes == {"least_loaded": 2, "session": 3}


def test_the_table_is_bounded_least_recently_used_first():
    t = AffinityTable(max_blocks=6, max_sessions=2)
    old, new = prompt_key(ids(64, seed=1)), prompt_key(ids(64, seed=2))     # 4 blocks each
    t.closed(t.record(A, old))
    t.closed(t.record(B, new))
    assert len(t.blocks) == 6
    # the older prompt lost its tail first: its head is still known
    assert t.depths(old) == {A: 2} and t.depths(new) == {B: 4}
    for s in ("x", "y", "z"):
        t.closed(t.record(A, RouteKey(session=s)))
    assert list(t.units) == ["y", "z"]
    # a unit with a stream open is never dropped
    t.record(B, RouteKey(session="open"))
    t.closed(t.record(A, RouteKey(session="w")))
    assert list(t.units) == ["open", "w"]


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
    with pytest.raises(ValueError):
        AffinityTable(stay_margin=-0.1)
    with pytest.raises(ValueError):
        AffinityTable(session_ttl_s=-1)


class Clock:
    """The table's clock, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def session_turn(bal, session: str, key: RouteKey | None = None):
    """One turn of `session` through the balancer: its stream opens (lease) and closes (release)."""
    async def go():
        replica, unit = await bal.lease(key=key or RouteKey(session=session))
        bal.release(replica, unit)
        return replica.address
    return go()


def test_sessions_between_turns_count_as_their_replicas_load():
    """Three sessions idle on A, one on B: a new session goes to B though no stream is in flight."""
    def body(bal, r):
        t = bal.affinity
        for s, at in (("s1", A), ("s2", A), ("s3", A), ("s4", B)):
            t.closed(t.record(at, RouteKey(session=s)))
        return t.loads(bal.replicas), bal.pick(key=RouteKey(session="s5")).address

    loads, got = run(body)
    assert loads == {A: 3, B: 1} and got == B


def test_a_session_keeps_its_replica_while_the_others_sessions_are_between_turns():
    """Issue 23's CPU finding: 8 sessions a replica; 7 of A's are in flight, B's 8 between turns. A's
    8th session's next turn stays on A (A carries 8, B 8). Counting streams alone (A 7, B 0) it
    would have moved to B and lost its cached history."""
    def body(bal, r):
        t = bal.affinity
        for i in range(8):
            t.closed(t.record(A, RouteKey(session=f"a{i}")))
            t.closed(t.record(B, RouteKey(session=f"b{i}")))
        for i in range(7):
            t.record(A, RouteKey(session=f"a{i}"))
        r[A].in_flight = 7
        loads = t.loads(bal.replicas)
        return loads, bal.pick(key=RouteKey(session="a7")).address, dict(t.stats.outcomes)

    loads, got, outcomes = run(body)
    assert loads == {A: 8, B: 8} and got == A and outcomes == {"session": 1}


def test_new_sessions_spread_by_load_not_by_the_instructions_everyone_shares():
    """A warm-up session put the instructions' blocks on A and ended; 32 new sessions whose first turn
    is those instructions alone: the first goes to A (the blocks are still its alone); from then on
    the instructions are shared, so they attract nobody: the sessions go by load (ties round robin), 16 each."""
    instructions = ids(40, seed=9)

    async def go():
        bal = StageBalancer("thinker", [A, B], channel_options=[], options=BalancerOptions())
        try:
            t = bal.affinity
            assert await session_turn(bal, "warm", prompt_key(instructions, "warm")) == A
            bal.end_session("warm")
            held = []
            for i in range(32):      # every first turn opens before any ends (they arrive together)
                held.append(await bal.lease(key=prompt_key(instructions, f"s{i}")))
            placed = [r.address for r, _ in held]
            for r, unit in held:
                bal.release(r, unit)
            return placed, dict(t.stats.outcomes), t.loads(bal.replicas), t.shared_depth(prompt_key(instructions))
        finally:
            await bal.close()

    placed, outcomes, loads, shared = asyncio.run(go())
    assert placed[:2] == [A, B] and placed.count(A) == placed.count(B) == 16
    assert outcomes == {"least_loaded": 32, "prefix": 1} and loads == {A: 16, B: 16} and shared == 2


def test_an_idle_session_stops_counting_after_the_ttl_and_an_ended_one_at_once():
    clock = Clock()
    t = AffinityTable(session_ttl_s=60, clock=clock)

    def body(bal, r):
        bal.affinity = t
        t.closed(t.record(A, RouteKey(session="old")))
        clock.now = 30
        t.closed(t.record(A, RouteKey(session="new")))
        t.record(B, RouteKey(session="talking"))
        seen = [t.loads(bal.replicas)]
        clock.now = 60
        seen.append(t.loads(bal.replicas))
        clock.now = 61                      # "old" idle 61 s: no longer counted (still placed)
        seen.append(t.loads(bal.replicas))
        t.end("new")
        t.end("never")                      # a session the table never saw: nothing to do
        t.closed("never")
        t.closed(None)
        t.end("talking")                    # ended with its stream open: dropped at its close
        seen.append(t.loads(bal.replicas))
        t.closed("talking")
        return seen, t.sessions, bal.pick(key=RouteKey(session="old")).address

    seen, sessions, old = run(body)
    assert seen == [{A: 2, B: 0}, {A: 2, B: 0}, {A: 1, B: 0}, {A: 0, B: 0}]
    assert sessions == {"old": A} and old == A


def test_a_chat_conversation_is_recognised_by_its_prompts():
    """No session: a prompt that continues an earlier prompt (holds its last block before its own
    last) is the same conversation, placed like a session; one that repeats it, or continues one
    whose stream is open, is another."""
    turn1 = ids(40, seed=3)                       # blocks 0, 1
    turn2 = turn1 + ids(30, seed=4)               # blocks 0 .. 3
    turn3 = turn2 + ids(40, seed=5)               # blocks 0 .. 5

    async def go():
        bal = StageBalancer("thinker", [A, B], channel_options=[], options=BalancerOptions())
        try:
            t = bal.affinity
            r1, u1 = await bal.lease(key=prompt_key(turn1))
            again, u_again = await bal.lease(key=prompt_key(turn2))   # turn 1 still open: not its next turn
            bal.release(r1, u1)
            bal.release(again, u_again)
            after_turn1 = t.loads(bal.replicas)   # a conversation counts between turns from its second turn
            r2, u2 = await bal.lease(key=prompt_key(turn2))
            bal.release(r2, u2)
            r3, u3 = await bal.lease(key=prompt_key(turn3))
            bal.release(r3, u3)
            repeat = t.unit_of(prompt_key(turn3))
            return (u1, u_again, u2, u3, repeat), (r1.address, r2.address, r3.address), after_turn1, \
                t.loads(bal.replicas), dict(t.stats.outcomes)
        finally:
            await bal.close()

    (u1, u_again, u2, u3, repeat), (r1, r2, r3), after_turn1, loads, outcomes = asyncio.run(go())
    assert u_again != u1 and u2 == u3 == u1 and repeat not in (u1, u_again)
    assert r1 == r2 == r3
    assert after_turn1 == {A: 0, B: 0} and loads == {A: 1, B: 0} and r1 == A
    # u_again: its own blocks 2, 3 were A's alone (prefix); turns 2 and 3: the conversation's replica
    assert outcomes == {"least_loaded": 1, "prefix": 1, "session": 2}


def test_a_replayed_stream_keeps_its_unit_and_a_failed_replicas_sessions_count_elsewhere():
    key = RouteKey(session="s")

    async def go():
        bal = StageBalancer("thinker", [A, B], channel_options=[], options=BalancerOptions(cooldown_s=30))
        try:
            t = bal.affinity
            r = {x.address: x for x in bal.replicas}
            first, unit = await bal.lease(key=key)                    # A (round robin)
            bal.report_failure(first, grpc.StatusCode.UNAVAILABLE, "connection refused")
            moved, unit2 = await bal.lease(avoid=[first], key=key, unit=unit)
            bal.release(first, unit)                                  # the refused stream's close
            during = (t.sessions, t.loads(bal.replicas))
            bal.release(moved, unit2)
            r[A].healthy = True
            return first.address, moved.address, unit, unit2, during, t.loads(bal.replicas)
        finally:
            await bal.close()

    first, moved, unit, unit2, during, loads = asyncio.run(go())
    assert (first, moved, unit, unit2) == (A, B, "s", "s")
    assert during == ({"s": B}, {A: 0, B: 1}) and loads == {A: 0, B: 1}
