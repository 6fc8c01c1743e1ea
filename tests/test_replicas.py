"""Several replicas per stage with real processes on localhost: 2 thinkers, 2 talkers, 2 code2wavs,
in the stage-to-stage topology (a thinker picks its talker, a talker its code2wav, the caller
reads text from the thinker and audio from that code2wav: `DoneEvent.routes` says where).

    thinker 1  --talker   talker1,talker2                     (host:port entries)
    thinker 2  --talker   dns:///localhost:P1,dns:///localhost:P2
    talker 1   --code2wav code2wav1,code2wav2
    talker 2   --code2wav dns:///localhost:P1,dns:///localhost:P2
    caller     thinkers 1+2 (or one of them), code2wav dns:///localhost:P1,P2 (every address a talker
               may report: the names resolve to the plain addresses too)

Wherever a stage calls a stage (caller -> thinker, thinker -> talker, talker -> code2wav) streams
go to the replica with the fewest outstanding streams (voxpipe.services.runtime.balancer); a
stream refused before its first response (dead or draining replica) moves to another replica and
the caller's audio stream follows; a killed talker or code2wav fails only the requests that were
on it, naming that stage; a drained replica finishes its streams while new ones go elsewhere.
What a stage's balancer sees of the next stage is read from voxpipe_next_stage_replicas."""

from __future__ import annotations

import asyncio
import dataclasses
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

from conftest import GatewayProcess, free_port, stop_process
from voxpipe.bench import conversation
from voxpipe.bench.conversation import Conversation
from voxpipe.client import AudioEvent, DoneEvent, PipelineClient, PipelineError, SpeechRequest, StageEvent
from voxpipe.services.runtime.balancer import resolve
from voxpipe.services.thinker.prompt import ChatMessage, render

LONG_FRAMES = 96           # streams that are still running when a replica is killed or drained
SHORT_FRAMES = 8
NEXT = {"thinker": "talker", "talker": "code2wav"}


@dataclass
class StageProcess:
    """One replica: `voxpipe <stage>` on its own gRPC and metrics port; `args`: its next-stage flags."""
    stage: str
    model_dir: str
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    args: list[str] = field(default_factory=list)
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def dns(self) -> str:
        return f"dns:///localhost:{self.port}"

    def serves(self, address: str | None) -> bool:
        """`address` (as a route or a balancer reports it: 127.0.0.1:P, [::1]:P) is this process."""
        return address is not None and int(address.rsplit(":", 1)[1]) == self.port

    def launch(self) -> None:
        # every interface, IPv4 and IPv6: a replica is each address localhost resolves to
        cmd = [sys.executable, "-m", "voxpipe.cli", self.stage, "--model", self.model_dir, "--host", "[::]",
               "--port", str(self.port), "--metrics-port", str(self.metrics_port), "--device", "cpu", "--grace", "60",
               *self.args]
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

    def next_replicas(self, state: str) -> float:
        """How many replicas of the next stage this process's balancer sees in `state`."""
        return self.metric("voxpipe_next_stage_replicas", stage=NEXT[self.stage], state=state)

    def next_streams(self) -> float:
        return self.metric("voxpipe_next_stage_streams_total", stage=NEXT[self.stage])

    def finished_streams(self) -> float:
        """Streams this replica completed normally (stop or length)."""
        return sum(self.metric("voxpipe_streams_total", stage=self.stage, outcome=o) for o in ("stop", "length"))

    def stop(self) -> None:
        if self.alive:
            stop_process(self.proc, 30)


def start_all(procs: list[StageProcess], timeout: float = 240) -> None:
    for p in procs:
        if p.proc is not None:
            p.proc.wait()
        p.launch()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait_ready(deadline)


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


class Replicas:
    def __init__(self, model_dir: str) -> None:
        self.code2wavs = [StageProcess("code2wav", model_dir) for _ in range(2)]
        c1, c2 = self.code2wavs
        self.talkers = [StageProcess("talker", model_dir, args=["--code2wav", f"{c1.address},{c2.address}"]),
                        StageProcess("talker", model_dir, args=["--code2wav", f"{c1.dns},{c2.dns}"])]
        t1, t2 = self.talkers
        self.thinkers = [StageProcess("thinker", model_dir, args=["--talker", f"{t1.address},{t2.address}"]),
                         StageProcess("thinker", model_dir, args=["--talker", f"{t1.dns},{t2.dns}"])]
        self.all = [*self.thinkers, *self.talkers, *self.code2wavs]
        self.code2wav_set = f"{c1.dns},{c2.dns}"     # what a caller reads audio from

    def revive(self) -> None:
        """(Re)start every replica that is not running (a test before may have killed one), on its
        port, then wait until every stage's balancer sees all of the next stage's replicas usable
        again (a health probe re-admits a replica that was marked down)."""
        start_all([p for p in self.all if not p.alive])
        for p in self.thinkers + self.talkers:
            wait_until(lambda: p.next_replicas("unhealthy") + p.next_replicas("draining") == 0,
                       f"{p.stage} {p.address} sees every {NEXT[p.stage]} replica usable again")

    def process(self, stage: str, address: str | None) -> StageProcess:
        procs = {"thinker": self.thinkers, "talker": self.talkers, "code2wav": self.code2wavs}[stage]
        return next(p for p in procs if p.serves(address))

    def client(self, thinkers: list[StageProcess] | None = None, **kw) -> PipelineClient:
        return PipelineClient(",".join(p.address for p in thinkers or self.thinkers), self.code2wav_set, **kw)

    def wait_idle(self) -> None:
        """Every replica has no stream left (cancelled requests are freed in every stage)."""
        for p in self.all:
            if p.alive:
                wait_until(lambda: p.metric("voxpipe_active_streams", stage=p.stage) == 0,
                           f"{p.stage} {p.address} has no active stream")

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
        start_all(rs.all)
        yield rs
    finally:
        rs.stop()


@pytest.fixture(scope="module")
def prompt_ids(tokenizer, omni_config) -> list[int]:
    return render(tokenizer, omni_config.thinker, [ChatMessage.text("user", "Say something.")]).token_ids


def request(ids: list[int], frames: int = SHORT_FRAMES, tokens: int = 4, echo: bool = False) -> SpeechRequest:
    return SpeechRequest(token_ids=ids, max_tokens=tokens, min_tokens=tokens, max_frames=frames, min_frames=frames,
                         echo_frames=echo)


def run(coro):
    return asyncio.run(coro)


def samples_for(frames: int) -> int:
    """Audio samples of a reply stopped at max_frames (max_frames - 1 frames spoken)."""
    return 1920 * (frames - 1) - 555


class Tracked:
    """A request run as a task: where its streams went (Routed), `started` once audio arrived."""

    def __init__(self, client: PipelineClient, req: SpeechRequest) -> None:
        self.started = asyncio.Event()
        self.routes: dict[str, str] = {}
        self.samples = 0
        self.done: DoneEvent | None = None
        self.task = asyncio.ensure_future(self._run(client, req))

    async def _run(self, client, req) -> None:
        async for ev in client.stream(req):
            if isinstance(ev, StageEvent) and ev.kind == "routed":
                self.routes[ev.stage] = ev.address
            elif isinstance(ev, AudioEvent):
                self.samples += ev.samples.shape[0]
                self.started.set()
            elif isinstance(ev, DoneEvent):
                self.done = ev

    async def outcome(self) -> PipelineError | None:
        try:
            await self.task
            return None
        except PipelineError as e:
            return e


async def all_started(tracked: list[Tracked], timeout: float = 120) -> None:
    await asyncio.wait_for(asyncio.gather(*(t.started.wait() for t in tracked)), timeout)


async def health(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        try:
            resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.aio.AioRpcError:
            return -1
        return resp.status


def per_process(rs: Replicas, stage: str, routes: list[dict[str, str]]) -> list[int]:
    """How many of the requests `stage` served on each replica process."""
    procs = {"thinker": rs.thinkers, "talker": rs.talkers, "code2wav": rs.code2wavs}[stage]
    return [sum(p.serves(r.get(stage)) for r in routes) for p in procs]


# ----------------------------------------------------------------------------- spreading

def test_concurrent_streams_spread_over_every_replica_of_every_stage(replicas, prompt_ids):
    replicas.revive()
    before = {p.address: p.finished_streams() for p in replicas.all}
    opened = {p.address: p.next_streams() for p in replicas.thinkers + replicas.talkers}

    async def go():
        async with replicas.client() as client:
            results = await asyncio.gather(*(client.collect(request(prompt_ids, echo=True)) for _ in range(8)))
            return results, dict(client.received)

    results, received = run(go())
    routes = [r.done.routes for r in results]
    # the caller spreads over the thinkers, each thinker over the talkers, each talker over the code2wavs
    assert per_process(replicas, "thinker", routes) == [4, 4], routes
    for stage in ("talker", "code2wav"):
        counts = per_process(replicas, stage, routes)
        assert sum(counts) == 8 and min(counts) >= 2, (stage, routes)
    for caller, callee in (("thinker", "talker"), ("talker", "code2wav")):
        for p in getattr(replicas, caller + "s"):
            mine = [r for r in routes if p.serves(r[caller])]
            assert mine and all(per_process(replicas, callee, mine)), \
                f"{caller} {p.address} sent its {len(mine)} streams to one {callee}: {mine}"
    # what the routes say is what the processes did: each served (and each caller opened) those streams
    delta = {p.address: p.finished_streams() - before[p.address] for p in replicas.all}
    for stage in ("thinker", "talker", "code2wav"):
        procs = {"thinker": replicas.thinkers, "talker": replicas.talkers, "code2wav": replicas.code2wavs}[stage]
        assert [delta[p.address] for p in procs] == per_process(replicas, stage, routes), (stage, delta)
    for p in replicas.thinkers + replicas.talkers:
        mine = sum(p.serves(r[p.stage]) for r in routes)
        assert p.next_streams() - opened[p.address] == mine, f"{p.stage} {p.address}"
    # rows and frames went stage to stage: the caller got text, routes, audio and the frames' echo only
    assert ("thinker", "rows") not in received and received["code2wav", "frames"] > 0
    # greedy: every replica computes the same thing
    assert all(r.text_ids == results[0].text_ids for r in results)
    assert all(r.codes.shape[0] == SHORT_FRAMES - 1 and (r.codes == results[0].codes).all() for r in results)
    assert all(r.audio.shape[0] == samples_for(SHORT_FRAMES) for r in results)


def test_a_stage_sends_a_new_stream_to_the_replica_with_the_fewest_outstanding(replicas, prompt_ids):
    """One long stream held on a talker: thinker 1's next stream goes to the other talker; then each
    talker holds one code2wav stream: its next short stream goes to the other code2wav (round
    robin alone would not do either)."""
    replicas.revive()
    thinker = replicas.thinkers[0]

    async def go():
        async with replicas.client([thinker]) as client:
            first = Tracked(client, request(prompt_ids, LONG_FRAMES))
            await all_started([first])
            second = Tracked(client, request(prompt_ids, LONG_FRAMES))
            await all_started([second])
            shorts = [await client.collect(request(prompt_ids)) for _ in range(4)]
            for t in (first, second):
                t.task.cancel()
            await asyncio.gather(first.task, second.task, return_exceptions=True)
            return first.routes, second.routes, [r.done.routes for r in shorts]

    first, second, shorts = run(go())
    replicas.wait_idle()
    assert not replicas.process("talker", second["talker"]).serves(first["talker"]), (first, second)
    held = {replicas.process("talker", r["talker"]).port: r["code2wav"] for r in (first, second)}
    assert per_process(replicas, "talker", shorts) == [2, 2], shorts     # 1 + 1 held: ties, round robin
    for r in shorts:
        busy = held[replicas.process("talker", r["talker"]).port]
        assert not replicas.process("code2wav", r["code2wav"]).serves(busy), (r, held)


def test_dns_names_resolve_to_every_address_of_the_name(replicas, prompt_ids):
    """Thinker 2 and talker 2 know the next stage only by dns:/// names (so does the caller): their
    balancers hold every A/AAAA record of the names and the streams land on those addresses."""
    replicas.revive()
    thinker, talker = replicas.thinkers[1], replicas.talkers[1]

    async def go():
        async with PipelineClient(thinker.dns, replicas.code2wav_set) as client:
            return await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(8)))

    results = run(go())
    routes = [r.done.routes for r in results]
    talker_addrs = {a for p in replicas.talkers for a in resolve("localhost", p.port)}
    code2wav_addrs = {a for p in replicas.code2wavs for a in resolve("localhost", p.port)}
    # every A/AAAA record of localhost is a replica (127.0.0.1 and maybe [::1]: one process each port)
    assert thinker.next_replicas("usable") == len(talker_addrs)
    assert talker.next_replicas("usable") == len(code2wav_addrs)
    assert all(r["thinker"] in resolve("localhost", thinker.port) for r in routes), routes
    assert {r["talker"] for r in routes} <= talker_addrs and all(per_process(replicas, "talker", routes)), routes
    via_dns = [r for r in routes if talker.serves(r["talker"])]
    assert {r["code2wav"] for r in via_dns} <= code2wav_addrs and all(per_process(replicas, "code2wav", via_dns)), \
        via_dns
    assert all(r.codes.shape[0] == 0 and r.audio.shape[0] == samples_for(SHORT_FRAMES) for r in results)


def test_gateway_with_dns_replica_lists(replicas, tiny_model_dir):
    replicas.revive()
    dns = lambda ps: ",".join(p.dns for p in ps)   # noqa: E731
    gw = GatewayProcess(tiny_model_dir, dns(replicas.thinkers), replicas.code2wav_set, "--served-model-name", "tiny")
    try:
        before = sum(p.finished_streams() for p in replicas.code2wavs)
        body = {"model": "tiny", "voice": "ethan", "input": "Hello.", "response_format": "pcm",
                "max_audio_frames": 6, "ignore_eos": True, "temperature": 0}
        for _ in range(2):
            resp = httpx.post(f"{gw.base_url}/v1/audio/speech", json=body, timeout=60)
            assert resp.status_code == 200, resp.text
            assert len(resp.content) == 2 * samples_for(6)
        assert sum(p.finished_streams() for p in replicas.code2wavs) - before == 2
        # how the gateway chose its thinkers (two replicas: keyed by the rendered prompts' blocks)
        text = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(text) for s in fam.samples}
        routed = {dict(k)["outcome"]: v for (name, k), v in samples.items() if name == "voxpipe_gateway_routed_total"}
        assert sum(routed.values()) == 2 and set(routed) == {"session", "prefix", "least_loaded"}, routed
        tokens = {dict(k)["kind"]: v for (name, k), v in samples.items()
                  if name == "voxpipe_gateway_routed_prefix_tokens_total"}
        assert tokens["queried"] > 0 and 0 <= tokens["matched"] <= tokens["queried"], tokens
    finally:
        gw.stop()


def test_chat_prompt_cache_key_keeps_a_keys_requests_on_one_thinker_replica(replicas, tiny_model_dir):
    """Through the gateway and the openai SDK, one request at a time: a prompt_cache_key's requests
    all go to one thinker replica whatever their prompts (its routing session, "chat-key:" + key);
    requests of different keys spread over both; a key over 64 characters or not a string is a 400
    naming the field (the value is never echoed)."""
    import openai

    replicas.revive()
    gw = GatewayProcess(tiny_model_dir, ",".join(p.address for p in replicas.thinkers), replicas.code2wav_set,
                        "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="none", max_retries=0, timeout=60)

        def ask(text: str, **kw) -> int:
            """The index of the thinker replica that served one chat completion."""
            before = [p.finished_streams() for p in replicas.thinkers]
            out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                                 max_tokens=2, temperature=0, **kw)
            assert out.choices[0].message.content is not None
            wait_until(lambda: sum(p.finished_streams() for p in replicas.thinkers) - sum(before) == 1,
                       "the thinker replica that served it counts it")
            return next(i for i, (p, b) in enumerate(zip(replicas.thinkers, before)) if p.finished_streams() > b)

        texts = ["Tell me about cats.", "What is the capital of France?", "Count to three.", "Hello there!",
                 "Why is the sky blue?"]
        same = [ask(t, prompt_cache_key="team-a") for t in texts]
        assert len(set(same)) == 1, same
        keys = ["k" * 64, "user-1", "user-2", "user-3", "user-4"]     # 64 characters: OpenAI's bound, taken
        spread = [ask(f"{t} Again, please.", extra_body={"prompt_cache_key": k}) for t, k in zip(texts, keys)]
        assert sorted(set(spread)) == [0, 1], spread

        text = httpx.get(f"{gw.base_url}/metrics", timeout=10).text
        routed = {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == "voxpipe_gateway_routed_total"}
        assert routed["session"] >= len(texts) - 1, routed      # the key's turns after its first followed it

        long_key = "x" * 64 + "y"
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi."}],
                                           max_tokens=2, prompt_cache_key=long_key)
        assert e.value.param == "prompt_cache_key" and e.value.code == "string_above_max_length", e.value.body
        assert "maximum length 64" in e.value.message and "length 65" in e.value.message, e.value.message
        assert long_key not in e.value.response.text
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi."}],
                                           max_tokens=2, extra_body={"prompt_cache_key": 7})
        assert e.value.param == "prompt_cache_key" and e.value.code == "invalid_type", e.value.body
    finally:
        gw.stop()


# ----------------------------------------------------------------------------- affinity

@dataclass
class Turn:
    thinker: str
    prompt_tokens: int
    cached_tokens: int
    reply: list[int]


async def converse(client: PipelineClient, cfg, session: int, level: int, turns: int, keyed: bool = False,
                   before_turn=None) -> list[Turn]:
    """One text conversation (voxpipe.bench.conversation: each turn re-sends the history as token
    ids), greedy, 4 tokens a reply; `keyed`: with a session key (as realtime sends); `before_turn(i,
    turns so far)` runs before turn i."""
    conv = Conversation(cfg, conversation.Settings(turns, 24, 4, 0, 0), session, level)
    out: list[Turn] = []
    for i in range(turns):
        if before_turn is not None:
            before_turn(i, out)
        prompt = conv.ask()
        res = await client.collect(SpeechRequest(token_ids=prompt, audio=False, max_tokens=4, min_tokens=4,
                                                 session=f"conv-{level}-{session}" if keyed else None))
        out.append(Turn(res.done.routes["thinker"], res.done.prompt_tokens, res.done.cached_tokens, res.text_ids))
        conv.answered(prompt, res.text_ids)
    return out


def hits(rs: Replicas) -> list[float]:
    return [p.metric("voxpipe_prefix_cache_tokens_total", stage="thinker", kind="hit") for p in rs.thinkers]


@pytest.mark.parametrize("keyed", [False, True], ids=["chat-prefix", "realtime-session"])
def test_a_conversations_turns_all_hit_on_one_replica(replicas, omni_config, keyed):
    replicas.revive()
    before = hits(replicas)

    async def go():
        async with replicas.client() as client:
            turns = await converse(client, omni_config, 0, 100 + keyed, 4, keyed)
            return turns, dict(client.thinker.affinity.stats.outcomes), client.thinker.affinity.stats

    turns, outcomes, stats = run(go())
    assert len({t.thinker for t in turns}) == 1, [t.thinker for t in turns]
    cached = [t.cached_tokens for t in turns]
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    # keyed or not, its turns 2 .. 4 follow it: a chat conversation is recognised by its prompts
    assert outcomes == {"least_loaded": 1, "session": 3}
    assert stats.queried_tokens == sum(t.prompt_tokens for t in turns) and 0 < stats.matched_tokens
    # the replica that served them found them in its cache; the other found nothing
    served = [p.serves(turns[0].thinker) for p in replicas.thinkers]
    delta = [h - b for h, b in zip(hits(replicas), before)]
    assert delta == [sum(cached) if s else 0 for s in served], (delta, served)


def test_many_sessions_spread_within_the_bound_and_hit_as_on_one_replica(replicas, omni_config):
    """The bench's conversation workload (8 sessions of 3 turns) on two replicas, then on one: the
    same cached share within 5 % (each session stays where its cache is), and the turns split
    evenly (least-loaded first turns, 4 / 4, then each session's turns follow it)."""
    replicas.revive()
    settings = conversation.Settings(turns=3, turn_tokens=24, text_tokens=4, frames=2, context_tokens=0)

    async def go(thinkers, sessions):
        async with replicas.client(thinkers) as client:
            return await conversation.run_level(client.stream, omni_config, settings, sessions)

    two = run(go(None, 8))
    one = run(go(replicas.thinkers[:1], 9))      # 9 sessions: other words than the 8's (the level seeds them)
    assert two.failed == one.failed == 0
    assert two.cached_fraction >= one.cached_fraction - 0.05, (two.cached_fraction, one.cached_fraction)
    assert sorted(d["turns"] for d in two.replicas.values()) == [12, 12] and two.load_spread == 0, two.replicas
    assert len(one.replicas) == 1 and one.load_spread == 0


def test_a_sessions_talker_streams_stay_on_its_talker_replica(replicas, prompt_ids):
    """Through one thinker, one after another: a session's spoken turns (its SpeechRequest.session,
    sent to the thinker as the voxpipe-session header) all go to one talker replica, which holds its
    talker prefix; requests without a session spread over both. An over-long session is refused."""
    replicas.revive()

    async def go():
        async with replicas.client(replicas.thinkers[:1]) as client:
            keyed = [await client.collect(dataclasses.replace(request(prompt_ids), session="conv-talker"))
                     for _ in range(3)]
            plain = [await client.collect(request(prompt_ids)) for _ in range(4)]
            with pytest.raises(PipelineError) as e:
                await client.collect(dataclasses.replace(request(prompt_ids), session="s" * 129))
            return keyed, plain, e.value

    keyed, plain, refused = run(go())
    assert len({r.done.routes["talker"] for r in keyed}) == 1, [r.done.routes for r in keyed]
    assert all(per_process(replicas, "talker", [r.done.routes for r in plain])), [r.done.routes for r in plain]
    assert all(r.text_ids == keyed[0].text_ids and (r.codes == keyed[0].codes).all() for r in keyed + plain)
    assert refused.stage == "thinker" and refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "voxpipe-session metadata: expected one value of 1 to 128 characters" in refused.details
    replicas.wait_idle()


def test_a_killed_replicas_sessions_continue_on_the_other_with_the_same_output(replicas, omni_config):
    replicas.revive()
    killed: list[StageProcess] = []

    def kill_after_two(i: int, done: list[Turn]) -> None:
        if i == 2:
            victim = replicas.process("thinker", done[-1].thinker)
            victim.proc.kill()
            victim.proc.wait()
            killed.append(victim)

    async def go(before_turn):
        async with replicas.client() as client:
            turns = await converse(client, omni_config, 0, 300, 4, keyed=True, before_turn=before_turn)
            return turns, dict(client.thinker.affinity.sessions)

    reference, _ = run(go(None))
    turns, sessions = run(go(kill_after_two))
    assert [t.reply for t in turns] == [t.reply for t in reference]     # greedy: the same answers
    victim, = killed
    survivor = next(p for p in replicas.thinkers if p is not victim)
    assert [victim.serves(t.thinker) for t in turns] == [True, True, False, False], [t.thinker for t in turns]
    assert survivor.serves(turns[3].thinker) and turns[3].cached_tokens > 0    # it went on caching there
    assert [survivor.serves(a) for a in sessions.values()] == [True]


# ----------------------------------------------------------------------------- failures

def test_refused_streams_move_to_a_live_replica_and_the_audio_follows(replicas, tiny_model_dir, prompt_ids):
    """A thinker whose talker set starts with a dead address, in front of a talker whose code2wav set
    starts with a dead address: the first request is refused by both dead ones (round robin starts
    on them), moves on at both hops, and the caller's audio stream goes where the talker's went."""
    code2wav = replicas.code2wavs[0]
    dead_talker, dead_code2wav = (f"127.0.0.1:{free_port()}" for _ in range(2))    # nobody listens there
    talker = StageProcess("talker", str(tiny_model_dir), args=["--code2wav", f"{dead_code2wav},{code2wav.address}"])
    thinker = StageProcess("thinker", str(tiny_model_dir), args=["--talker", f"{dead_talker},{talker.address}"])
    try:
        for p in (talker, thinker):     # starting while the replicas a test before killed start again
            p.launch()
        replicas.revive()
        deadline = time.monotonic() + 240
        for p in (talker, thinker):
            p.wait_ready(deadline)
        before = {p.address: p.finished_streams() for p in (talker, code2wav)}

        async def go():
            async with PipelineClient(thinker.address, replicas.code2wav_set) as client:
                first = await client.collect(request(prompt_ids))
                marked = (thinker.next_replicas("unhealthy"), talker.next_replicas("unhealthy"))
                rest = await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(3)))
                return [first, *rest], marked

        results, marked = run(go())
        assert results[0].done.routes == {"thinker": thinker.address, "talker": talker.address,
                                          "code2wav": code2wav.address}
        assert marked == (1, 1), "the first request did not meet both dead replicas"
        assert all(r.done.routes == results[0].done.routes for r in results)
        assert all(r.audio.shape[0] == samples_for(SHORT_FRAMES) for r in results)
        assert {p.address: p.finished_streams() - before[p.address] for p in (talker, code2wav)} == \
            {talker.address: 4, code2wav.address: 4}
        assert thinker.next_streams() == 4 and talker.next_streams() == 4   # retries are not new streams
        assert (thinker.next_replicas("usable"), talker.next_replicas("usable")) == (1, 1)
    finally:
        thinker.stop()
        talker.stop()


@pytest.mark.parametrize("stage", ["talker", "code2wav"])
def test_a_killed_replica_fails_only_the_requests_on_it(replicas, prompt_ids, stage):
    replicas.revive()
    procs = replicas.talkers if stage == "talker" else replicas.code2wavs
    victim, survivor = procs
    thinker = replicas.thinkers[0]
    survivor_before = survivor.finished_streams()

    async def go():
        async with replicas.client([thinker]) as client:
            tracked = [Tracked(client, request(prompt_ids, LONG_FRAMES)) for _ in range(8)]
            await all_started(tracked)                      # every stream has produced audio
            victim.proc.kill()
            outcomes = [await t.outcome() for t in tracked]
            after = await asyncio.gather(*(client.collect(request(prompt_ids)) for _ in range(4)))
            return tracked, outcomes, after

    tracked, outcomes, after = run(go())
    on_victim = [victim.serves(t.routes[stage]) for t in tracked]
    assert 1 <= sum(on_victim) <= 7, [t.routes for t in tracked]
    for t, hit, e in zip(tracked, on_victim, outcomes):
        if hit:
            assert e is not None, f"a request on the killed {stage} did not fail: {t.routes}"
            assert e.stage == stage and e.code == grpc.StatusCode.UNAVAILABLE, e
            assert victim.serves(e.replica), (e.replica, victim.address)
        else:
            assert e is None, f"a request not on the killed {stage} failed ({t.routes}): {e}"
            assert t.done.frames == LONG_FRAMES - 1 and t.samples == samples_for(LONG_FRAMES)
    assert survivor.finished_streams() - survivor_before == on_victim.count(False) + len(after)
    # the callers of the killed replica took it out of their picks: later requests avoid it
    callers = [thinker] if stage == "talker" else [replicas.process("talker", t.routes["talker"])
                                                   for t, hit in zip(tracked, on_victim) if hit]
    for p in callers:
        assert p.next_replicas("unhealthy") == 1, f"{p.stage} {p.address} still picks the killed {stage}"
    assert all(survivor.serves(r.done.routes[stage]) and r.audio.shape[0] == samples_for(SHORT_FRAMES)
               for r in after)


def test_a_drained_code2wav_finishes_its_streams_and_takes_no_new_ones(replicas, prompt_ids):
    """SIGTERM a code2wav while it holds streams: it reports NOT_SERVING, finishes them and exits 0.
    New long streams, 3 per talker: least outstanding sends one of each talker's to the draining
    replica, which refuses it; the stream moves to the other code2wav and the audio follows."""
    replicas.revive()
    victim, survivor = replicas.code2wavs
    thinker = replicas.thinkers[0]
    survivor_before = survivor.finished_streams()

    async def go():
        async with replicas.client([thinker]) as client:
            tracked = [Tracked(client, request(prompt_ids, LONG_FRAMES)) for _ in range(6)]
            await all_started(tracked)                      # every code2wav stream has produced audio
            victim.proc.send_signal(signal.SIGTERM)
            while await health(victim.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
                await asyncio.sleep(0.05)
            fresh = [Tracked(client, request(prompt_ids, LONG_FRAMES)) for _ in range(6)]
            await all_started(fresh)
            draining = [p.next_replicas("draining") for p in replicas.talkers]
            for t in fresh:
                t.task.cancel()
            outcomes = [await t.outcome() for t in tracked]
            await asyncio.gather(*(t.task for t in fresh), return_exceptions=True)
            return tracked, outcomes, fresh, draining

    tracked, outcomes, fresh, draining = run(go())
    on_victim = sum(victim.serves(t.routes["code2wav"]) for t in tracked)
    assert 2 <= on_victim <= 4, [t.routes for t in tracked]     # 3 per talker, least outstanding
    assert outcomes == [None] * 6                           # in-flight streams on the drained replica completed
    assert all(t.done.frames == LONG_FRAMES - 1 and t.samples == samples_for(LONG_FRAMES) for t in tracked)
    assert all(survivor.serves(t.routes["code2wav"]) for t in fresh), [t.routes for t in fresh]
    assert draining == [1, 1], "a talker never met the draining replica (no stream was refused and moved)"
    assert survivor.finished_streams() - survivor_before == 6 - on_victim
    assert victim.proc.wait(timeout=60) == 0
    replicas.wait_idle()
