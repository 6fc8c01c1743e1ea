"""Multi-host: the thinker, the talker and code2wav each on its own "host" (a network namespace,
joined to the others by veth pairs on a bridge), a client host running the gateway, and this
test process in the root namespace reaching them over a veth of its own. Addresses are in a
private subnet (10.77.N.0/24) that exists only inside the namespaces this test makes; names
(thinker.vp.test, ...) come from each host's own hosts file (/etc/netns/NS/hosts, which
`ip netns exec` mounts over /etc/hosts), so dns:/// entries resolve through the real resolver.

The data path runs host to host, each stage dialling the next by its configured name: the
thinker host streams to `dns:///talker.vp.test` (--talker), the talker host to
`dns:///code2wav.vp.test` (--code2wav); a caller (the gateway on the client host, or a pipeline
client in the root namespace) reads text from the thinker host and audio from the code2wav host.

Needs root and iproute2 (Debian package `iproute2`); skipped where the sandbox refuses
network namespaces."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from voxpipe.client import PipelineClient, SpeechRequest
from conftest import stop_process

TAG = f"vm{os.getpid() % 100000}"                   # namespace / interface prefix (names <= 15 chars)
NET = f"10.77.{os.getpid() % 200 + 20}"              # this run's /24
HOSTS = {"thinker": 1, "talker": 2, "code2wav": 3, "client": 4}
TALKER_EXTRA = 12                                    # a second talker address ("a new pod") for the DNS test
ROOT = 254
PORTS = {"thinker": 50051, "talker": 50052, "code2wav": 50053}
METRICS_PORT = 9090
HTTP_PORT = 8000
DOMAIN = "vp.test"


def ip_of(host_octet: int) -> str:
    return f"{NET}.{host_octet}"


def ns(host: str) -> str:
    return f"{TAG}{host[:2]}"


class TestNetwork:
    """The namespaces, bridge, veths and addresses; `destroy()` removes all of it."""

    __test__ = False

    def __init__(self) -> None:
        self.namespaces: list[str] = []
        self.root_link = f"{TAG}rt0"
        self.root_link_made = False
        self.etcs = [Path("/etc/netns") / ns(host) for host in HOSTS]     # each host's /etc overlay

    @staticmethod
    def ip(*args: str) -> None:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if res.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")

    def add_namespace(self, name: str) -> None:
        self.ip("netns", "add", name)
        self.namespaces.append(name)
        self.ip("-n", name, "link", "set", "lo", "up")

    def create(self) -> None:
        switch = f"{TAG}sw"
        self.add_namespace(switch)
        self.ip("-n", switch, "link", "add", "br0", "type", "bridge")
        self.ip("-n", switch, "link", "set", "br0", "up")
        for host, octet in HOSTS.items():
            self.add_namespace(ns(host))
            self.add_interface(host, 0, octet)
        # this test process (root namespace) joins the bridge too
        self.ip("link", "add", self.root_link, "type", "veth", "peer", "name", f"{TAG}rt1")
        self.root_link_made = True
        self.ip("link", "set", f"{TAG}rt1", "netns", switch)
        self.ip("-n", switch, "link", "set", f"{TAG}rt1", "master", "br0")
        self.ip("-n", switch, "link", "set", f"{TAG}rt1", "up")
        self.ip("addr", "add", f"{ip_of(ROOT)}/24", "dev", self.root_link)
        self.ip("link", "set", self.root_link, "up")
        for etc in self.etcs:
            etc.mkdir(parents=True, exist_ok=True)
        self.write_hosts({"thinker": [HOSTS["thinker"]], "talker": [HOSTS["talker"]],
                          "code2wav": [HOSTS["code2wav"]]})

    def add_interface(self, host: str, index: int, octet: int) -> str:
        """A veth from `host` to the bridge with address NET.octet/24; returns the host-side name."""
        name, switch = ns(host), f"{TAG}sw"
        inner, outer = f"{name}{index}", f"{name}{index}s"
        self.ip("link", "add", inner, "type", "veth", "peer", "name", outer)
        self.ip("link", "set", inner, "netns", name)
        self.ip("link", "set", outer, "netns", switch)
        self.ip("-n", switch, "link", "set", outer, "master", "br0")
        self.ip("-n", switch, "link", "set", outer, "up")
        self.ip("-n", name, "addr", "add", f"{ip_of(octet)}/24", "dev", inner)
        self.ip("-n", name, "link", "set", inner, "up")
        return inner

    def write_hosts(self, names: dict[str, list[int]]) -> None:
        """Every host's /etc/hosts: `<stage>.vp.test` -> these addresses (the DNS they all share).
        Rewritten in place (a namespace's bind mount keeps pointing at its file)."""
        lines = ["127.0.0.1 localhost"] + [f"{ip_of(o)} {stage}.{DOMAIN}" for stage, octets in names.items()
                                           for o in octets]
        for etc in self.etcs:
            with open(etc / "hosts", "w") as f:
                f.write("\n".join(lines) + "\n")

    def exec(self, host: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns(host), *cmd]

    def destroy(self) -> None:
        if self.root_link_made:
            subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for etc in self.etcs:
            shutil.rmtree(etc, ignore_errors=True)


def _refusal(network: TestNetwork) -> str | None:
    """Why this sandbox cannot run the test (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs iproute2 (`apt-get install -y iproute2`)"
    probe = f"{TAG}pr"
    try:
        network.add_namespace(probe)
        network.ip("-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
    except RuntimeError as e:
        return f"this sandbox refuses network namespaces / veth pairs: {e}"
    finally:
        network.destroy()
        network.namespaces.clear()
    return None


class HostProcess:
    def __init__(self, network: TestNetwork, host: str, *args: str, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(network.exec(host, sys.executable, "-m", "voxpipe.cli", *args),
                                     stdout=subprocess.PIPE, stderr=None, text=True)

    def wait_ready(self, deadline: float) -> None:
        while True:
            line = self.proc.stdout.readline()
            if "ready on port" in line:
                return
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start (exit code {self.proc.poll()})")

    def stop(self) -> None:
        stop_process(self.proc, 20)


@pytest.fixture(scope="module")
def network():
    net = TestNetwork()
    reason = _refusal(net)
    if reason:
        pytest.skip(reason)
    try:
        net.create()
        yield net
    finally:
        net.destroy()


NEXT = {"thinker": "talker", "talker": "code2wav"}


def address_of(stage: str, octet: int | None = None) -> str:
    return f"{ip_of(octet or HOSTS[stage])}:{PORTS[stage]}"


@pytest.fixture(scope="module")
def hosts(network, tiny_model_dir):
    """One stage service per host, each bound to its host's address and dialling the next stage by
    its dns:/// name; the gateway on the client host dialling the thinker and code2wav by name."""
    procs: list[HostProcess] = []
    try:
        for stage in PORTS:
            nxt = [f"--{NEXT[stage]}=dns:///{NEXT[stage]}.{DOMAIN}:{PORTS[NEXT[stage]]}"] if stage in NEXT else []
            procs.append(HostProcess(network, stage, stage, "--model", str(tiny_model_dir), "--device", "cpu",
                                     "--host", ip_of(HOSTS[stage]) if stage != "talker" else "[::]",
                                     "--port", str(PORTS[stage]), "--metrics-port", str(METRICS_PORT), "--grace", "5",
                                     *nxt, name=stage))
        procs.append(HostProcess(network, "client", "gateway", "--model", str(tiny_model_dir),
                                 "--host", ip_of(HOSTS["client"]), "--http-port", str(HTTP_PORT),
                                 "--served-model-name", "tiny",
                                 *(f"--{s}=dns:///{s}.{DOMAIN}:{PORTS[s]}" for s in ("thinker", "code2wav")),
                                 name="gateway"))
        deadline = time.monotonic() + 240
        for p in procs:
            p.wait_ready(deadline)
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
        for p in procs:
            p.stop()


def metric(host: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples on `host` whose labels include `labels` (0 if none)."""
    text = httpx.get(f"http://{ip_of(HOSTS[host])}:{METRICS_PORT}/metrics", timeout=10).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def finished_streams(stage: str) -> float:
    return sum(metric(stage, "voxpipe_streams_total", stage=stage, outcome=o)
               for o in ("stop", "length"))


def next_streams(stage: str) -> float:
    """Streams `stage`'s host opened to the next stage's host."""
    return metric(stage, "voxpipe_next_stage_streams_total", stage=NEXT[stage])


def talkers_seen(state: str = "usable") -> float:
    """The talker replicas the thinker's balancer holds in `state`."""
    return metric("thinker", "voxpipe_next_stage_replicas", stage="talker", state=state)


def wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.1)


def speak(n: int, frames: int) -> tuple[list, dict]:
    """`n` concurrent requests from the root namespace (its own PipelineClient, dialling the thinker
    and code2wav hosts by address); their results and what crossed into this process."""
    import asyncio

    async def go():
        async with PipelineClient(address_of("thinker"), address_of("code2wav")) as client:
            results = await asyncio.gather(*(client.collect(SpeechRequest(
                text="Hello over the wire.", max_tokens=4, min_tokens=4, max_frames=frames, min_frames=frames))
                for _ in range(n)))
            return results, dict(client.received)

    return asyncio.run(go())


def test_stages_stream_host_to_host(hosts):
    before = {s: finished_streams(s) for s in PORTS}
    opened = {s: next_streams(s) for s in NEXT}
    (res,), received = speak(1, 8)
    assert len(res.text_ids) == 4 and res.audio.shape[0] == 1920 * 7 - 555
    # the thinker host picked the talker host by name, the talker host the code2wav host; the audio
    # came from where the talker sent the frames
    assert res.done.routes == {s: address_of(s) for s in PORTS}
    assert res.done.frames == 7
    assert {s: finished_streams(s) - before[s] for s in PORTS} == {s: 1 for s in PORTS}
    assert {s: next_streams(s) - opened[s] for s in NEXT} == {"thinker": 1, "talker": 1}
    # no row and no codec frame crossed into the caller's process
    assert ("thinker", "rows") not in received and ("code2wav", "frames") not in received
    assert received["code2wav", "audio"] > 0


def test_gateway_on_its_own_host_reaches_the_stages_by_name(hosts):
    body = {"model": "tiny", "voice": "ethan", "input": "Across three hosts.", "response_format": "pcm",
            "max_audio_frames": 6, "ignore_eos": True, "temperature": 0}
    before = {s: finished_streams(s) for s in PORTS}
    resp = httpx.post(f"http://{ip_of(HOSTS['client'])}:{HTTP_PORT}/v1/audio/speech", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(resp.content) == 2 * (1920 * 5 - 555)
    assert {s: finished_streams(s) - before[s] for s in PORTS} == {s: 1 for s in PORTS}
    ready = httpx.get(f"http://{ip_of(HOSTS['client'])}:{HTTP_PORT}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["ready"] is True


def test_the_thinker_follows_dns_as_talker_pods_come_and_go(network, hosts):
    """The thinker re-resolves its talker name: a new talker address in DNS gets streams; an address
    that leaves DNS gets none, and its going away (removed from the host) fails no request."""
    first, second = address_of("talker"), address_of("talker", TALKER_EXTRA)
    results, _ = speak(2, 6)
    assert [r.done.routes["talker"] for r in results] == [first, first]
    assert talkers_seen() == 1

    # scale up: a second talker address (its own interface) appears on the host, then in DNS
    network.add_interface("talker", 1, TALKER_EXTRA)
    network.write_hosts({"thinker": [HOSTS["thinker"]], "talker": [HOSTS["talker"], TALKER_EXTRA],
                         "code2wav": [HOSTS["code2wav"]]})
    wait_until(lambda: talkers_seen() == 2, "the thinker resolved the new talker address")
    results, _ = speak(4, 12)
    assert [r.codes.shape[0] for r in results] == [0] * 4 and all(r.done.frames == 11 for r in results)
    assert {r.done.routes["talker"] for r in results} == {first, second}

    # scale down: the second address leaves DNS, then the host. (It is the second that goes: the talker
    # process, which plays both pods, dials code2wav from its first address, which must stay.)
    network.write_hosts({"thinker": [HOSTS["thinker"]], "talker": [HOSTS["talker"]],
                         "code2wav": [HOSTS["code2wav"]]})
    wait_until(lambda: (talkers_seen(), talkers_seen("unhealthy"), talkers_seen("draining")) == (1, 0, 0),
               "the thinker dropped the talker address that left DNS")
    network.ip("-n", ns("talker"), "addr", "del", f"{ip_of(TALKER_EXTRA)}/24", "dev", f"{ns('talker')}1")
    results, _ = speak(3, 6)
    assert [r.done.routes["talker"] for r in results] == [first] * 3
    assert all(r.done.frames == 5 and r.audio.shape[0] == 1920 * 5 - 555 for r in results)
