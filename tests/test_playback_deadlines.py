"""Playback deadlines end to end (the scheduling itself: test_schedulers.py, on a fake clock): code2wav's
Playback reports reach the talker and both stages' slack gauges count the stream while it plays, as the
gateway's does; the gateway's admission by capacity (admission.py) on a fake clock."""

from __future__ import annotations

import asyncio
import re
import threading
import urllib.request

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.gateway.admission import SERVED_S, AtCapacity, Capacity
from voxpipe.services.runtime.playback import BANDS, DRY_S
from voxpipe.services.thinker.prompt import ChatMessage, render

BAND_NAMES = [b for b, _ in BANDS]


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    out = {}
    for m in re.finditer(rf"^{name}\{{(.*)\}} (\S+)$", text, re.M):
        out[tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(1))))] = float(m.group(2))
    return out


def scrape(stack, stage: str) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()


def in_bands(text: str, stage: str) -> float:
    got = samples(text, "voxpipe_streams_by_slack")
    return sum(got.get((("band", b), ("stage", stage)), 0.0) for b in BAND_NAMES)


def reports(text: str) -> float:
    return samples(text, "voxpipe_playback_reports_total").get((("stage", "talker"),), 0.0)


def test_playback_reports_reach_the_talker_and_the_slack_gauges_count_the_stream(stack, tokenizer, omni_config):
    before = reports(scrape(stack, "talker"))
    for stage in ("talker", "code2wav"):
        text = scrape(stack, stage)
        assert all((("band", b), ("stage", stage)) in samples(text, "voxpipe_streams_by_slack") for b in BAND_NAMES)
        assert (("stage", stage),) in samples(text, "voxpipe_underruns_total")
        assert (("stage", stage),) in samples(text, "voxpipe_streams_under_500ms_slack")    # the autoscalers' signal
    seen = {"talker": 0.0, "code2wav": 0.0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            for stage in seen:
                seen[stage] = max(seen[stage], in_bands(scrape(stack, stage), stage))
            stop.wait(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    ids = render(tokenizer, omni_config.thinker, [ChatMessage.text("user", "Say something long.")]).token_ids

    async def speak():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
            return await client.collect(SpeechRequest(token_ids=ids, max_tokens=4, min_frames=80, max_frames=81))

    try:
        res = asyncio.run(speak())
    finally:
        stop.set()
        sampler.join()
    assert res.done.frames == 80
    assert reports(scrape(stack, "talker")) > before          # code2wav told the talker where the listener is
    assert seen["talker"] >= 1 and seen["code2wav"] >= 1, seen


def gateway_bands(gateway) -> float:
    got = samples(httpx.get(f"{gateway.base_url}/metrics", timeout=5).text, "voxpipe_gateway_streams_by_slack")
    assert {k[0][1] for k in got} == set(BAND_NAMES)
    return sum(got.values())


def test_the_gateway_counts_a_spoken_stream_by_slack_while_it_plays(gateway, model):
    body = {"model": model, "messages": [{"role": "user", "content": "Talk for a while."}],
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}, "stream": True,
            "max_tokens": 4, "max_audio_frames": 12, "ignore_eos": True}
    assert gateway_bands(gateway) == 0
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for line in lines:
            if '"audio":' in line and '"data":' in line:      # the first audio chunk: the stream is playing
                break
        assert gateway_bands(gateway) == 1
        for line in lines:           # the rest, to the end
            pass
    assert gateway_bands(gateway) == 0
    assert "voxpipe_gateway_capacity_refusals_total" in httpx.get(f"{gateway.base_url}/metrics", timeout=5).text


# ---------------------------------------------------------------------------------------------- admission

class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def capacity(wait_s: float = 0.2) -> tuple[Capacity, FakeClock, CollectorRegistry]:
    registry = CollectorRegistry()
    refused = Counter("refused", "", registry=registry)
    clock = FakeClock()
    return Capacity(wait_s, Gauge("bands", "", ["band"], registry=registry), refused, clock=clock), clock, registry


def play(cap: Capacity, clock: FakeClock, slack: float, played: float = 1.0):
    """A stream whose listener has played `played` s and that is `slack` s ahead, audio just received."""
    s = asyncio.run(cap.admit())
    start = clock.t - played
    s.received(played + slack, start)
    s.taken(played + slack, start)
    s.received(0.0, clock.t)
    return s


def test_admission_takes_streams_while_none_is_dry_and_refuses_after_the_wait():
    cap, clock, registry = capacity(wait_s=0.2)
    play(cap, clock, slack=3.0)
    assert cap.shortfall() is None
    dry = play(cap, clock, slack=0.1)
    assert "100 ms of audio left" in cap.shortfall()

    async def late() -> None:         # the wait passes in real time; the fake clock too
        async def tick():
            for _ in range(20):
                await asyncio.sleep(0.02)
                clock.t += 0.02
        ticking = asyncio.ensure_future(tick())
        try:
            await cap.admit()
        finally:
            ticking.cancel()

    with pytest.raises(AtCapacity) as e:
        asyncio.run(late())
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded" and registry.get_sample_value("refused_total") == 1

    # the dry stream ends (or catches up) within the wait: the waiting request is admitted
    async def recovers() -> None:
        waiting = asyncio.ensure_future(cap.admit())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        cap.done(dry)
        await asyncio.wait_for(waiting, 1)

    asyncio.run(recovers())


def test_admission_a_slow_reader_or_a_stuck_stream_holds_nobody_up():
    cap, clock, _ = capacity()
    slow = asyncio.run(cap.admit())          # 3 s received, its client took 1 s of it: 2 s ahead
    slow.received(3.0, clock.t - 2.0)
    slow.taken(1.0, clock.t - 2.0)
    slow.received(0.0, clock.t)
    assert cap.shortfall() is None
    stuck = play(cap, clock, slack=0.05)
    assert cap.shortfall() is not None
    clock.t += SERVED_S + DRY_S              # nothing came for it since: not a measure of the stages
    assert stuck.clock.slack(clock.t) <= 0 and cap.shortfall() is None


def test_admission_wait_flag_refuses_bad_values(capsys):
    from voxpipe.cli import build_parser

    assert build_parser().parse_args(["gateway", "--admission-wait", "0.5"]).admission_wait == 0.5
    for bad in ("-1", "soon", "inf", "x" * 10_000):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["gateway", "--admission-wait", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--admission-wait: must be a number of seconds, at least 0" in err, err
        assert len(err) < 2000        # a long value is not echoed whole
