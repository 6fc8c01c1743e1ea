"""Multi-host: the thinker, the talker and code2wav each on its own "host" (a network namespace,
joined to the others by veth pairs on a bridge), a client host running the gateway, and this
test process in the root namespace reaching them over a veth of its own. Addresses are in a
private subnet (10.77.N.0/24) that exists only inside the namespaces this test makes; names
(thinker.vp.test, ...) come from the client host's own hosts file (/etc/netns/NS/hosts, which
`ip netns exec` mounts over /etc/hosts), so dns:/// entries resolve through the real resolver.

Needs root and iproute2 (Debian package `iproute2`); skipped where the sandbox refuses
network namespaces."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from voxpipe.client import PipelineClient, SpeechRequest

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
        self.etc = Path("/etc/netns") / ns("client")

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
        self.etc.mkdir(parents=True, exist_ok=True)
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
        """The client host's /etc/hosts: `<stage>.vp.test` -> these addresses. Rewritten in place
        (the namespace's bind mount keeps pointing at this file)."""
        lines = ["127.0.0.1 localhost"] + [f"{ip_of(o)} {stage}.{DOMAIN}" for stage, octets in names.items()
                                           for o in octets]
        with open(self.etc / "hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def exec(self, host: str, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", ns(host), *cmd]

    def destroy(self) -> None:
        if self.root_link_made:
            subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(self.etc, ignore_errors=True)


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
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


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


@pytest.fixture(scope="module")
def hosts(network, tiny_model_dir):
    """One stage service per host, each bound to its host's address; the gateway on the client host
    dialling dns:///<stage>.vp.test names."""
    procs: list[HostProcess] = []
    try:
        for stage in PORTS:
            procs.append(HostProcess(network, stage, stage, "--model", str(tiny_model_dir), "--device", "cpu",
                                     "--host", ip_of(HOSTS[stage]) if stage != "talker" else "[::]",
                                     "--port", str(PORTS[stage]), "--metrics-port", str(METRICS_PORT), "--grace", "5",
                                     name=stage))
        procs.append(HostProcess(network, "client", "gateway", "--model", str(tiny_model_dir),
                                 "--host", ip_of(HOSTS["client"]), "--http-port", str(HTTP_PORT),
                                 "--served-model-name", "tiny",
                                 *(f"--{s}=dns:///{s}.{DOMAIN}:{p}" for s, p in PORTS.items()), name="gateway"))
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


def finished_streams(stage: str) -> float:
    text = httpx.get(f"http://{ip_of(HOSTS[stage])}:{METRICS_PORT}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("voxpipe_streams_total{") and f'stage="{stage}"' in line and \
                ('outcome="length"' in line or 'outcome="stop"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_pipeline_client_from_the_root_namespace(hosts):
    import asyncio

    async def go():
        async with PipelineClient(*(f"{ip_of(HOSTS[s])}:{p}" for s, p in PORTS.items())) as client:
            return await client.collect(SpeechRequest(text="Hello over the wire.", max_tokens=4, min_tokens=4,
                                                      max_frames=8, min_frames=8))

    before = {s: finished_streams(s) for s in PORTS}
    res = asyncio.run(go())
    assert len(res.text_ids) == 4 and res.codes.shape[0] == 7
    assert res.audio.shape[0] == 1920 * 7 - 555
    assert {s: finished_streams(s) - before[s] for s in PORTS} == {s: 1 for s in PORTS}


def test_gateway_on_its_own_host_reaches_the_stages_by_name(hosts):
    body = {"model": "tiny", "voice": "ethan", "input": "Across three hosts.", "response_format": "pcm",
            "max_tokens": 3, "max_audio_frames": 6, "ignore_eos": True, "temperature": 0}
    before = {s: finished_streams(s) for s in PORTS}
    resp = httpx.post(f"http://{ip_of(HOSTS['client'])}:{HTTP_PORT}/v1/audio/speech", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert len(resp.content) == 2 * (1920 * 5 - 555)
    assert {s: finished_streams(s) - before[s] for s in PORTS} == {s: 1 for s in PORTS}
    ready = httpx.get(f"http://{ip_of(HOSTS['client'])}:{HTTP_PORT}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json()["ready"] is True


# A long-lived PipelineClient on the client host, driven over stdin/stdout (one JSON line each way),
# so the test can change DNS (the hosts file) and the talker host's addresses between its steps.
DNS_CLIENT = r"""
import asyncio, json, sys, logging
logging.basicConfig(level=logging.INFO)
from voxpipe.services.runtime.balancer import BalancerOptions
from voxpipe.client import PipelineClient, SpeechRequest

async def main(thinker, talker, code2wav):
    opts = BalancerOptions(resolve_interval_s=0.3, min_resolve_gap_s=0.1, cooldown_s=0.5)
    async with PipelineClient(thinker, talker, code2wav, balancing=opts) as client:
        await client.talker.start()                # resolve now (else: on the first stream)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            cmd = json.loads(line)
            if cmd["op"] == "replicas":             # wait until the talker replicas are `want`
                want = set(cmd["want"])
                for _ in range(150):
                    if {r.address for r in client.talker.replicas} == want:
                        break
                    await asyncio.sleep(0.1)
                answer = {"replicas": sorted(r.address for r in client.talker.replicas)}
            else:                                  # run n requests at once; which talkers they used
                used, running = set(), True
                async def watch():
                    while running:
                        used.update(r.address for r in client.talker.replicas if r.in_flight)
                        await asyncio.sleep(0.005)
                watcher = asyncio.ensure_future(watch())
                req = lambda: SpeechRequest(text="Hi.", max_tokens=3, min_tokens=3, max_frames=cmd["frames"],
                                            min_frames=cmd["frames"])
                results = await asyncio.wait_for(asyncio.gather(
                    *(client.collect(req()) for _ in range(cmd["n"])), return_exceptions=True), 60)
                running = False
                await watcher
                answer = {"frames": [r.codes.shape[0] if not isinstance(r, BaseException) else repr(r)
                                     for r in results], "used": sorted(used)}
            print("@@" + json.dumps(answer), flush=True)

asyncio.run(main(*sys.argv[1:4]))
"""


class DnsClient:
    def __init__(self, network: TestNetwork) -> None:
        self.proc = subprocess.Popen(network.exec("client", sys.executable, "-c", DNS_CLIENT,
                                                  *(f"dns:///{s}.{DOMAIN}:{p}" for s, p in PORTS.items())),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the DNS client exited (code {self.proc.wait()})")
            if line.startswith("@@"):
                return json.loads(line[2:])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def test_replicas_follow_dns_as_talker_pods_come_and_go(network, hosts):
    """A new talker address in DNS gets streams; an address that leaves DNS gets none, and its
    going away (the address removed from the host) does not fail a request."""
    first, second = (f"{ip_of(o)}:{PORTS['talker']}" for o in (HOSTS["talker"], TALKER_EXTRA))
    client = DnsClient(network)
    try:
        assert client.ask(op="replicas", want=[first]) == {"replicas": [first]}
        got = client.ask(op="run", n=2, frames=6)
        assert got == {"frames": [5, 5], "used": [first]}

        # scale up: a second talker address (its own interface) appears on the host, then in DNS
        network.add_interface("talker", 1, TALKER_EXTRA)
        network.write_hosts({"thinker": [HOSTS["thinker"]], "talker": [HOSTS["talker"], TALKER_EXTRA],
                             "code2wav": [HOSTS["code2wav"]]})
        assert client.ask(op="replicas", want=[first, second]) == {"replicas": sorted([first, second])}
        got = client.ask(op="run", n=4, frames=12)
        assert got == {"frames": [11] * 4, "used": sorted([first, second])}

        # scale down: the first address leaves DNS, then the host
        network.write_hosts({"thinker": [HOSTS["thinker"]], "talker": [TALKER_EXTRA],
                             "code2wav": [HOSTS["code2wav"]]})
        assert client.ask(op="replicas", want=[second]) == {"replicas": [second]}
        network.ip("-n", ns("talker"), "addr", "del", f"{ip_of(HOSTS['talker'])}/24", "dev", f"{ns('talker')}0")
        got = client.ask(op="run", n=3, frames=6)
        assert got == {"frames": [5, 5, 5], "used": [second]}
    finally:
        client.close()
