"""Several replicas per stage (voxpipe.services.runtime.balancer) with real processes: 1 thinker, 2 talkers and
2 code2wavs on localhost. Streams spread over the replicas; a killed replica fails only the
requests that were on it; a drained replica finishes its streams while new ones go elsewhere;
dns:/// entries resolve to every address of the name."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from conftest import GatewayProcess, free_port
from voxpipe.services.runtime.balancer import BalancerOptions, resolve
from voxpipe.client import AudioEvent, FramesEvent, PipelineClient, PipelineError, SpeechRequest
from voxpipe.services.thinker.prompt import ChatMessage, render

FAST = BalancerOptions(resolve_interval_s=1.0, min_resolve_gap_s=0.2, cooldown_s=0.5, probe_timeout_s=1.0)
LONG_FRAMES = 96           # streams that are still running when a replica is killed or drained


@dataclass
class StageProcess:
    """One replica: `voxpipe <stage>` on its own gRPC and metrics port."""
    stage: str
    model_dir: str
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> None:
        cmd = [sys.executable, "-m", "voxpipe.cli", self.stage, "--model", self.model_dir, "--port", str(self.port),
               "--metrics-port", str(self.metrics_port), "--device", "cpu", "--grace", "60"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)

    def wait_ready(self, deadline: float) -> None:
        while True:
            line = self.proc.stdout.readline()
            if "ready on port" in line:
                return
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"{self.stage} replica on port {self.port} did not start "
                                   f"(exit code {self.proc.poll()})")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels` (0 if none)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                   if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

    def finished_streams(self) -> float:
        """Streams this replica completed normally (stop or length)."""
        return sum(self.metric("voxpipe_streams_total", stage=self.stage, outcome=o) for o in ("stop", "length"))

    def stop(self) -> None:
        if self.alive:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Replicas:
    def __init__(self, model_dir: str) -> None:
        self.thinker = StageProcess("thinker", model_dir)
        self.talkers = [StageProcess("talker", model_dir) for _ in range(2)]
        self.code2wavs = [StageProcess("code2wav", model_dir) for _ in range(2)]
        self.all = [self.thinker, *self.talkers, *self.code2wavs]

    def revive(self, timeout: float = 240) -> None:
        """(Re)start every replica that is not running (a test before may have killed one), on its port."""
        dead = [p for p in self.all if not p.alive]
        for p in dead:
            if p.proc is not None:
                p.proc.wait()
            p.launch()
        deadline = time.monotonic() + timeout
        for p in dead:
            p.wait_ready(deadline)

    def client(self, **kw) -> PipelineClient:
        return PipelineClient(self.thinker.address, ",".join(p.address for p in self.talkers),
                              ",".join(p.address for p in self.code2wavs), **kw)

    def stop(self) -> None:
        for p in self.all:
            if p.alive:
                p.proc.send_signal(signal.SIGTERM)
        for p in self.all:
            p.stop()


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    rs = Replicas(str(tiny_model_dir))
    try:
        rs.revive()
        yield rs
    finally:
        rs.stop()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer, omni_config) -> list[int]:
    return render(tokenizer, omni_config.thinker, [ChatMessage.text("user", "Say something.")]).token_ids


def request(ids: list[int], frames: int = 8, tokens: int = 4) -> SpeechRequest:
    return SpeechRequest(token_ids=ids, max_tokens=tokens, min_tokens=tokens, max_frames=frames, min_frames=frames)


def run(coro):
    return asyncio.run(coro)


class Tracked:
    """A request run as a task, with an event set once its stream reached `stage_output`."""

    def __init__(self, client: PipelineClient, req: SpeechRequest, stage_output: type) -> None:
        self.started = asyncio.Event()
        self.frames = 0
        self.samples = 0
        self.task = asyncio.ensure_future(self._run(client, req, stage_output))

    async def _run(self, client, req, stage_output) -> None:
        async for ev in client.stream(req):
            if isinstance(ev, FramesEvent):
                self.frames += ev.codes.shape[0]
            elif isinstance(ev, AudioEvent):
                self.samples += ev.samples.shape[0]
            if isinstance(ev, stage_output):
                self.started.set()

    async def outcome(self) -> PipelineError | None:
        try:
            await self.task
            return None
        except PipelineError as e:
            return e


async def all_started(tracked: list[Tracked], timeout: float = 60) -> None:
    await asyncio.wait_for(asyncio.gather(*(t.started.wait() for t in tracked)), timeout)


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.aio.AioRpcError:
            return -1
        return resp.status


# ----------------------------------------------------------------------------- spreading

def test_concurrent_streams_spread_over_every_replica(replicas, prompt_ids):
    replicas.revive()
    before = {p.address: p.finished_streams() for p in replicas.all}

    async def go():
        async with replicas.client() as client:
            return await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(8)))

    results = run(go())
    delta = {p.address: p.finished_streams() - before[p.address] for p in replicas.all}
    assert delta[replicas.thinker.address] == 8
    for stage in (replicas.talkers, replicas.code2wavs):
        counts = [delta[p.address] for p in stage]
        assert sum(counts) == 8 and min(counts) >= 2, counts     # least-outstanding + round-robin ties
    # greedy: every replica computes the same thing
    assert all(r.text_ids == results[0].text_ids for r in results)
    assert all(r.codes.shape[0] == 7 and (r.codes == results[0].codes).all() for r in results)
    assert all(r.audio.shape[0] == results[0].audio.shape[0] > 0 for r in results)


def test_dns_entries_resolve_to_every_address_of_the_name(replicas, prompt_ids):
    replicas.revive()
    dns = [f"dns:///localhost:{p.port}" for p in replicas.all]
    before = {p.address: p.finished_streams() for p in replicas.all}

    async def go():
        async with PipelineClient(dns[0], ",".join(dns[1:3]), ",".join(dns[3:5])) as client:
            results = await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(4)))
            return results, {r.address for r in client.talker.replicas}, {r.address for r in client.code2wav.replicas}

    results, talker_addrs, code2wav_addrs = run(go())
    # every A/AAAA record of localhost is a replica address (127.0.0.1 and maybe [::1]: one process each port)
    assert talker_addrs == {a for p in replicas.talkers for a in resolve("localhost", p.port)}
    assert code2wav_addrs == {a for p in replicas.code2wavs for a in resolve("localhost", p.port)}
    assert all(r.codes.shape[0] == 7 for r in results)
    delta = {p.address: p.finished_streams() - before[p.address] for p in replicas.all}
    assert delta[replicas.thinker.address] == 4             # per process, not per address
    assert sum(delta[p.address] for p in replicas.talkers) == 4
    assert sum(delta[p.address] for p in replicas.code2wavs) == 4
    assert all(delta[p.address] >= 1 for p in replicas.talkers + replicas.code2wavs)


def test_gateway_with_dns_replica_lists(replicas, tiny_model_dir):
    replicas.revive()
    dns = lambda ps: ",".join(f"dns:///localhost:{p.port}" for p in ps)   # noqa: E731
    gw = GatewayProcess(tiny_model_dir, dns([replicas.thinker]), dns(replicas.talkers), dns(replicas.code2wavs),
                        "--served-model-name", "tiny")
    try:
        before = sum(p.finished_streams() for p in replicas.code2wavs)
        body = {"model": "tiny", "voice": "ethan", "input": "Hello.", "response_format": "pcm", "max_tokens": 3,
                "max_audio_frames": 6, "ignore_eos": True, "temperature": 0}
        for _ in range(2):
            resp = httpx.post(f"{gw.base_url}/v1/audio/speech", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            assert len(resp.content) == 2 * (1920 * 5 - 555)
        assert sum(p.finished_streams() for p in replicas.code2wavs) - before == 2
    finally:
        gw.stop()


# ----------------------------------------------------------------------------- failures

def test_refused_stream_is_retried_on_another_replica(replicas, prompt_ids):
    """A replica that is down before the stream starts costs nothing: the stream moves."""
    replicas.revive()
    dead = f"127.0.0.1:{free_port()}"               # nobody listens here
    talkers = replicas.talkers[:1]
    before = talkers[0].finished_streams()

    async def go():
        async with PipelineClient(replicas.thinker.address, f"{dead},{talkers[0].address}",
                                  replicas.code2wavs[0].address, balancing=FAST) as client:
            first = await client.collect(request(prompt_ids))     # round-robin starts on the dead one
            marked = [r.address for r in client.talker.replicas if not r.usable]
            rest = await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(3)))
            return [first, *rest], marked

    results, marked = run(go())
    assert all(r.codes.shape[0] == 7 for r in results)
    assert marked == [dead]
    assert talkers[0].finished_streams() - before == 4


def test_killed_talker_fails_only_its_requests(replicas, prompt_ids):
    replicas.revive()
    victim, survivor = replicas.talkers
    survivor_before = survivor.finished_streams()

    async def go():
        async with replicas.client(balancing=FAST) as client:
            tracked = [Tracked(client, request(prompt_ids, LONG_FRAMES), FramesEvent) for _ in range(8)]
            await all_started(tracked)                      # every talker stream has produced frames
            on_victim = victim.metric("voxpipe_active_streams", stage="talker")
            victim.proc.kill()
            outcomes = [await t.outcome() for t in tracked]
            victim_replica = next(r for r in client.talker.replicas if r.address == victim.address)
            marked = not victim_replica.usable
            after = await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(4)))
            return on_victim, tracked, outcomes, marked, after

    on_victim, tracked, outcomes, marked, after = run(go())
    failed = [e for e in outcomes if e is not None]
    assert 1 <= on_victim <= 7 and len(failed) == on_victim, (on_victim, outcomes)
    for e in failed:
        assert e.stage == "talker" and e.code == grpc.StatusCode.UNAVAILABLE, e
        assert e.replica == victim.address
    completed = [t for t, e in zip(tracked, outcomes) if e is None]
    assert all(t.frames == LONG_FRAMES - 1 for t in completed)
    assert survivor.finished_streams() - survivor_before == len(completed) + len(after)
    assert marked, "the dead replica is still picked"
    assert all(r.codes.shape[0] == 7 for r in after)


def test_drained_code2wav_finishes_its_streams_and_takes_no_new_ones(replicas, prompt_ids):
    replicas.revive()
    victim, survivor = replicas.code2wavs
    survivor_before = survivor.finished_streams()

    async def go():
        async with replicas.client(balancing=FAST) as client:
            tracked = [Tracked(client, request(prompt_ids, LONG_FRAMES), AudioEvent) for _ in range(6)]
            await all_started(tracked)                      # every code2wav stream has produced audio
            on_victim = victim.metric("voxpipe_active_streams", stage="code2wav")
            victim.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            while await health(victim.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.monotonic() - t0 < 10, "the drained replica never reported NOT_SERVING"
                await asyncio.sleep(0.05)
            # a fresh client (no streams in flight) picks both replicas round-robin: some streams
            # are refused by the draining one and move to the survivor
            async with replicas.client(balancing=FAST) as fresh:
                after = await asyncio.gather(*(fresh.collect(request(prompt_ids)) for _ in range(4)))
                drained = next(r for r in fresh.code2wav.replicas if r.address == victim.address)
                assert drained.draining and not drained.usable
            outcomes = [await t.outcome() for t in tracked]
            return on_victim, tracked, outcomes, after

    on_victim, tracked, outcomes, after = run(go())
    assert 1 <= on_victim <= 5
    assert outcomes == [None] * 6                           # in-flight streams on the drained replica completed
    full = 1920 * (LONG_FRAMES - 1) - 555
    assert all(t.frames == LONG_FRAMES - 1 and t.samples == full for t in tracked)
    assert all(r.codes.shape[0] == 7 for r in after)
    assert survivor.finished_streams() - survivor_before == (6 - on_victim) + 4
    assert victim.proc.wait(timeout=60) == 0
