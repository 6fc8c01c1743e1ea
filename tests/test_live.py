"""The live workload's arithmetic against hand-made timelines (bench/playback.py, bench/live.py):
underruns and the silence they insert, the slack series, the capacity search over scripted levels,
the TTFP percentiles and a level's verdict. No services: bench's end-to-end run is in test_bench.py."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import pytest

from voxpipe.bench.live import LiveLevel, Settings, Turn
from voxpipe.bench.playback import bounds, capacity, percentiles_ms, play, search, slack_series
from voxpipe.bench.workload import SAMPLE_RATE, RequestRecord

J = 0.2     # the default jitter buffer


def test_packets_on_time_never_underrun():
    # 0.5 s of audio every 0.4 s from t = 1.0: each arrives before the one before it has played out
    p = play([(1.0, 0.5), (1.4, 0.5), (1.8, 0.5), (2.2, 0.5)], J)
    assert p.start == pytest.approx(1.2) and p.end == pytest.approx(3.2)
    assert p.starts == pytest.approx((1.2, 1.7, 2.2, 2.7))
    assert p.underruns == 0 and p.silence_s == 0.0
    assert p.margin_s == pytest.approx(0.3)           # packet 1: 1.7 - 1.4


def test_one_late_packet_inserts_its_lateness_as_silence_and_shifts_the_rest():
    p = play([(0.0, 0.3), (0.1, 0.3), (1.0, 0.3), (1.1, 0.3)], J)
    # play from 0.2: packet 0 to 0.5, packet 1 to 0.8; packet 2 due at 0.8 arrives at 1.0
    assert p.underruns == 1 and p.silence_s == pytest.approx(0.2)
    assert p.starts == pytest.approx((0.2, 0.5, 1.0, 1.3)) and p.end == pytest.approx(1.6)
    assert p.margin_s == pytest.approx(-0.2)


def test_a_gap_counts_every_packet_that_found_the_buffer_dry():
    p = play([(0.0, 0.2), (1.0, 0.2), (2.0, 0.2)], J)
    # dry at 0.4 until 1.0, then at 1.2 until 2.0
    assert p.underruns == 2 and p.silence_s == pytest.approx(0.6 + 0.8) and p.end == pytest.approx(2.2)


def test_a_slow_start_underruns_unless_the_jitter_buffer_covers_it():
    slow = play([(0.0, 0.08), (0.5, 1.0)], J)         # 80 ms played out at 0.28; the next comes at 0.5
    assert slow.underruns == 1 and slow.silence_s == pytest.approx(0.22) and slow.end == pytest.approx(1.5)
    covered = play([(0.0, 0.08), (0.25, 1.0)], J)
    assert covered.underruns == 0 and covered.end == pytest.approx(1.28)
    assert play([(0.0, 0.25), (0.5, 1.0)], 0.25).underruns == 0    # arriving at its play time is on time
    assert play([(0.0, 0.08), (0.25, 1.0)], 0.0).underruns == 1    # no jitter buffer
    assert play([(3.0, 1.0)], J).margin_s == math.inf and play([(3.0, 1.0)], J).end == pytest.approx(4.2)
    with pytest.raises(ValueError, match="without audio"):
        play([], J)


def test_slack_is_delivered_minus_played_and_zero_between_replies():
    p = play([(0.0, 0.3), (0.1, 0.3), (1.0, 0.3), (1.1, 0.3)], J)
    want = {0.0: 0.3, 0.15: 0.6, 0.3: 0.5, 0.9: 0.0, 1.05: 0.25, 1.2: 0.4, 1.6: 0.0}
    for t, slack in want.items():
        assert p.slack(t) == pytest.approx(slack), t
    assert p.delivered(1.05) == pytest.approx(0.9) and p.played(1.05) == pytest.approx(0.65)
    second = play([(3.0, 0.5)], J)                     # the next turn: asked after a think time
    times = [-1.0, 0.0, 0.9, 2.0, 3.0, 3.3, 3.5, 3.7, 4.0]
    assert slack_series([p, second], times) == pytest.approx([0.0, 0.3, 0.0, 0.0, 0.5, 0.4, 0.2, 0.0, 0.0])


def test_ttfp_percentiles_interpolate_between_order_statistics():
    q = percentiles_ms([i / 100 for i in range(10, 0, -1)])        # 10 .. 100 ms, unordered
    assert q == pytest.approx({"p50": 55.0, "p90": 91.0, "p99": 99.1, "mean": 55.0})
    assert math.isnan(percentiles_ms([])["p90"])


def _record(start: float, ttfp: float, packets: list[tuple[float, float]], error: str | None = None,
            refused: bool = False) -> RequestRecord:
    """A request as run_one records it: packets (arrival after start, audio seconds)."""
    rec = RequestRecord(start=start, error=error, refused=refused)
    if packets:
        rec.packets = [(start + a, round(d * SAMPLE_RATE)) for a, d in packets]
        rec.first_audio, rec.last_audio = rec.packets[0][0], rec.packets[-1][0]
        rec.samples = sum(n for _, n in rec.packets)
        assert rec.first_audio - start == pytest.approx(ttfp)
    return rec


def _turn(session: int, rec: RequestRecord) -> Turn:
    packets = [(a, n / SAMPLE_RATE) for a, n in rec.packets]
    return Turn(session, rec, play(packets, J) if packets and rec.error is None else None)


SETTINGS = Settings(first=(1,), most=4, resolution=1, duration_s=10.0, reply_s=1.0, think_s=2.0, jitter_s=J,
                    ttfp_budget_ms=300.0, clients=("chat",), warmup=0)


def test_a_level_counts_underruns_refusals_and_failures_apart_and_holds_only_when_clean():
    on_time = [_turn(0, _record(0.0, 0.1, [(0.1, 0.5), (0.3, 0.5)])), _turn(1, _record(1.0, 0.2, [(0.2, 1.0)]))]
    lv = LiveLevel.of("chat", 2, SETTINGS, on_time, wall=3.0)
    assert lv.holds and (lv.underruns, lv.refusals, lv.failed, lv.completed, lv.requests) == (0, 0, 0, 2, 2)
    assert lv.ttfp_ms["p50"] == pytest.approx(150.0) and lv.ttfp_ms["p90"] == pytest.approx(190.0)
    assert lv.audio_s == pytest.approx(1.0) and lv.packets == 1.5 and lv.req_per_s == pytest.approx(2 / 3)
    assert lv.margin_ms["min"] == pytest.approx(500.0)     # packet 0 plays 0.3 .. 0.8; packet 1 came at 0.3

    late = _turn(1, _record(5.0, 0.1, [(0.1, 0.1), (0.9, 0.5), (2.0, 0.1)]))   # dry 0.4 .. 0.9 and 1.4 .. 2.0
    refused = _turn(0, _record(6.0, 0.0, [], error="RateLimitError(429)", refused=True))
    broken = _turn(0, _record(7.0, 0.0, [], error="RealtimeError('internal_error: boom')"))
    lv = LiveLevel.of("chat", 2, SETTINGS, on_time + [late, refused, broken], wall=9.0)
    assert not lv.holds
    assert (lv.requests, lv.completed, lv.refusals, lv.failed) == (5, 3, 1, 1)
    assert lv.underruns == 2 and lv.underrun_ms == pytest.approx(500.0 + 600.0) and lv.sessions_with_underruns == 1
    assert lv.errors == ["RealtimeError('internal_error: boom')"]       # refusals are counted, not listed
    assert "turns" not in lv.as_dict() and lv.as_dict()["refusals"] == 1

    slow = [_turn(0, _record(0.0, 0.35, [(0.35, 1.0)])), _turn(1, _record(0.0, 0.31, [(0.31, 1.0)]))]
    assert not LiveLevel.of("chat", 2, SETTINGS, slow, wall=2.0).holds          # TTFP p90 346 ms > 300
    assert LiveLevel.of("chat", 2, Settings(**{**SETTINGS.as_dict(), "ttfp_budget_ms": 400.0}), slow, 2.0).holds
    assert not LiveLevel.of("chat", 2, SETTINGS, [], wall=0.0).holds            # no reply: nothing shown
    only_refused = LiveLevel.of("chat", 1, SETTINGS, [refused], wall=1.0)
    assert not only_refused.holds and only_refused.refusals == 1 and only_refused.failed == 0


@dataclass(frozen=True)
class Scripted:
    sessions: int
    holds: bool


def _search(holds, first, most=1024, resolution=8) -> tuple[list[int], int]:
    tried = asyncio.run(search(lambda n: _level(n, holds), first, most, resolution))
    return [v.sessions for v in tried], capacity(tried)


async def _level(n: int, holds) -> Scripted:
    return Scripted(n, holds(n))


def test_the_capacity_search_doubles_then_bisects():
    order, cap = _search(lambda n: n <= 96, [16])
    assert order == [16, 32, 64, 128, 96, 112, 104] and cap == 96
    assert _search(lambda n: n <= 96, [32, 64, 96, 128], resolution=32) == ([32, 64, 96, 128], 96)
    assert _search(lambda n: n <= 96, [16], resolution=32) == ([16, 32, 64, 128, 96], 96)
    assert _search(lambda n: True, [16], most=100) == ([16, 32, 64, 100], 100)   # held at the most tried
    assert _search(lambda n: n <= 5, [16], resolution=1) == ([16, 8, 4, 6, 5], 5)  # the first level failed
    assert _search(lambda n: False, [16], resolution=1) == ([16, 8, 4, 2, 1], 0)
    assert _search(lambda n: n <= 2, [1, 2], most=2, resolution=1) == ([1, 2], 2)   # --quick
    assert _search(lambda n: n <= 96, [512, 16], most=256) == ([16, 256, 136, 76, 106, 91, 98], 91)
    for bad in ([], [0]):
        with pytest.raises(ValueError):
            _search(lambda n: True, bad)


def test_non_monotone_levels_never_raise_the_capacity_above_a_failure():
    # 32 failed though 64 held (noise, or a level the gateway refused): the capacity stays below 32
    order, cap = _search(lambda n: n != 32, [16, 32, 64])
    assert order == [16, 32, 64, 24] and cap == 24
    order, cap = _search(lambda n: n != 48, [48, 64, 96], most=96)
    assert order == [48, 64, 96, 24, 36, 42] and cap == 42
    tried = [Scripted(64, True), Scripted(48, False), Scripted(96, True)]
    assert bounds(tried) == (0, 48) and capacity(tried) == 0
    assert bounds([Scripted(8, True), Scripted(16, True)]) == (16, None)
