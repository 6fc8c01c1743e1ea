"""Chaos: every stage killed (SIGKILL) and drained (SIGTERM) under 16 streams of the gateway's four
APIs at once -- 4 chat completions over SSE (one through the openai SDK), 4 speech streams (one a raw
pcm body), 4 realtime responses, 4 Converse turns (voxpipe.bench.chaos) -- against a real
thinker -> talker -> code2wav chain of processes and a real gateway.

A kill: every client sees an error naming the killed stage within 1 s of the signal (a raw pcm body,
which cannot say why, is cut short), with nothing after it -- never a 200 stream that ends as a whole
reply would. A drain: every stream finishes whole, the stage exits 0. Either way no slot stays held,
and the stage is then started again on its port: once its callers have reconnected (their channels
retry every 1-3 s; a request before is a 503 naming the stage) every API serves again."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from dataclasses import replace

import httpx
import pytest

from conftest import GatewayProcess, free_port, start_chain
from voxpipe.bench import chaos
from voxpipe.client import PipelineClient, PipelineError, SpeechRequest

STAGES = ("thinker", "talker", "code2wav")
REPORT_WITHIN_S = 1.0
RECONNECT_WITHIN_S = 10.0        # the callers' reconnect backoff (at most 3 s a hop), with room for a loaded machine
ONE_EACH = {"chat": 1, "chat_sdk": 0, "speech": 1, "speech_pcm": 0, "realtime": 1, "converse": 1}


@pytest.fixture(scope="module")
def chain(tiny_model_dir):
    """One chain for every case: the stage under test is restarted on its port after each. --grace 30
    so that a drain always lets its streams finish."""
    grace = ["--grace", "30"]
    procs = start_chain(tiny_model_dir, thinker=grace, talker=grace, code2wav=grace)
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def gateway(chain, tiny_model_dir):
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, chain.address("thinker"), chain.code2wav_address,
                             "--grpc-port", str(grpc_port))
    model = httpx.get(f"{process.base_url}/v1/models").json()["data"][0]["id"]
    yield chaos.Gateway(process.base_url, f"127.0.0.1:{grpc_port}", model)
    process.stop()


def gateway_gauges(g: chaos.Gateway) -> dict[str, float]:
    text = httpx.get(f"{g.base_url}/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^(voxpipe_gateway_(?:sessions|active_streams)(?:\{.*\})?) (\S+)$", text, re.M)}


def wait_idle(chain, g: chaos.Gateway, timeout: float = 10.0) -> None:
    """Every slot of the gateway and every stage's active streams back to 0."""
    deadline = time.monotonic() + timeout
    while True:
        held = {k: v for k, v in gateway_gauges(g).items() if v}
        held.update({s: v for s in STAGES if chain.alive(s) and (v := chain.metric(s))})
        if not held:
            return
        assert time.monotonic() < deadline, f"slots still held: {held}"
        time.sleep(0.1)


def under_signal(g: chaos.Gateway, chain, stage: str, sig: int) -> tuple[list[chaos.Seen], float]:
    """The 16 streams, `sig` sent to `stage` once each has its first audio; when it was sent. (A
    stage an earlier case left dead -- it failed before its restart -- is started first.)"""
    for name in STAGES:
        if not chain.alive(name):
            chain.restart(name)
    serving(g)
    sent: dict[str, float] = {}

    async def fire() -> None:
        sent["at"] = time.monotonic()
        chain.procs[stage].send_signal(sig)

    seen = asyncio.run(chaos.streams(g, while_running=fire))
    return seen, sent["at"]


def serving(g: chaos.Gateway) -> float:
    """The seconds until a spoken reply (every stage) succeeds. The gateway's and the stages' channels
    to a stage that went away retry the connection every 1-3 s: a request before is a 503."""
    t0, deadline = time.monotonic(), time.monotonic() + RECONNECT_WITHIN_S
    body = {"model": g.model, "input": "Back.", "voice": g.voice, "response_format": "pcm", "max_audio_frames": 2}
    while (r := httpx.post(f"{g.base_url}/v1/audio/speech", json=body, timeout=60)).status_code != 200:
        assert r.status_code == 503 and time.monotonic() < deadline, (r.status_code, r.text[:300])
        time.sleep(0.1)
    return time.monotonic() - t0


def serves_again(chain, g: chaos.Gateway, stage: str) -> float:
    """Restart `stage`; the seconds until it serves (`serving`), then one stream of each API must complete."""
    chain.restart(stage)
    back = serving(g)
    seen = asyncio.run(chaos.streams(replace(g, tokens=4, frames=6), ONE_EACH))
    assert [s.outcome for s in seen] == ["complete"] * len(seen), chaos.summary(seen)
    wait_idle(chain, g)
    return back


def a_later_stages_failure_leaves_the_thinker_healthy(chain, dead: str) -> None:
    """With `dead` (talker or code2wav) gone, a spoken request fails naming it -- and the caller's
    balancer keeps the thinker replica that passed the failure on healthy and not draining (a
    replica is judged by its own failures, not by those its status names in `voxpipe-stage`)."""
    async def go():
        async with PipelineClient(chain.address("thinker"), chain.code2wav_address) as client:
            with pytest.raises(PipelineError) as e:
                async for _ in client.stream(SpeechRequest(text="Hi", max_tokens=2, max_frames=2)):
                    pass
            (replica,) = client.thinker.replicas
            return e.value, replica.healthy, replica.draining

    error, healthy, draining = asyncio.run(go())
    assert error.stage == dead, error
    assert healthy and not draining, error


def running_when_signalled(seen: list[chaos.Seen], at: float) -> None:
    early = [(s.kind, s.events) for s in seen if s.running_at is None or (s.ended_at or at) < at]
    assert not early, f"streams not running at the signal (lengths too short for this machine?): {early}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_drained_stage_finishes_every_stream(chain, gateway, stage):
    seen, at = under_signal(gateway, chain, stage, signal.SIGTERM)
    running_when_signalled(seen, at)
    assert chain.procs[stage].wait(timeout=60) == 0
    report = chaos.summary(seen)
    print(f"SIGTERM {stage}: {report}")
    assert all(s.outcome == "complete" for s in seen), report
    assert all(s.status in ("200", "open", "OK") for s in seen), report
    wait_idle(chain, gateway)
    print(f"{stage} restarted: serving again after {serves_again(chain, gateway, stage):.2f} s")


@pytest.mark.parametrize("stage", STAGES)
def test_a_killed_stage_is_reported_to_every_client_within_a_second(chain, gateway, stage):
    seen, at = under_signal(gateway, chain, stage, signal.SIGKILL)
    running_when_signalled(seen, at)
    assert chain.procs[stage].wait(timeout=30) == -signal.SIGKILL
    report = chaos.summary(seen, at, stage)
    print(f"SIGKILL {stage}: {report}")
    # an error, and nothing after it: no `[DONE]`, no finish_reason, no done -- nothing that reads as a whole reply
    assert not [(s.kind, s.events) for s in seen if s.outcome != "error"], report
    late = [(s.kind, round(s.error_at - at, 3)) for s in seen if s.error_at - at > REPORT_WITHIN_S]
    assert not late, late
    assert not [(s.kind, s.error) for s in seen if s.kind not in chaos.NAMES_NO_STAGE and not s.names(stage)]
    # the HTTP streams had started (200) before the kill; Converse ends UNAVAILABLE
    assert not [(s.kind, s.status) for s in seen if s.kind.startswith(("chat", "speech")) and s.status != "200"]
    assert {s.status for s in seen if s.kind == "converse"} == {"UNAVAILABLE"}, report
    wait_idle(chain, gateway)
    if stage != "thinker":
        a_later_stages_failure_leaves_the_thinker_healthy(chain, stage)
    print(f"{stage} restarted: serving again after {serves_again(chain, gateway, stage):.2f} s")
