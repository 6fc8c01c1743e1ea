import os
import sys
from pathlib import Path

import pytest

# The repository root must not be on sys.path (`python -m pytest` run from it puts it there): its
# top-level kernels/ folder (installed as voxpipe.kernels) would shadow Hugging Face's `kernels`
# package, which transformers imports. Off here for this process, and PYTHONSAFEPATH keeps the working
# directory (and a script's folder) off the path of every Python process the tests start.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random Qwen3-Omni checkpoint (seed 0), built once per test session."""
    from voxpipe.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-omni"), seed=0)


# ---------------------------------------------------------------- the three services as processes

import random  # noqa: E402
import socket  # noqa: E402

STAGES = ("thinker", "talker", "code2wav")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (Linux: 32768 by default)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(count: int, tries: int = 200) -> int:
    """The first of `count` consecutive free localhost ports, below the kernel's ephemeral range: a
    port free when probed there cannot be taken later by some connection's local end (a bench's
    fixed --base-port block in that range once met one: its gateway exited with PortInUse)."""
    top = min(_ephemeral_start(), 60000)
    low = 10000 if top - count > 10000 else 1024
    for _ in range(tries):
        first = random.randint(low, top - count)
        socks = []
        try:
            for port in range(first, first + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


@pytest.fixture(scope="session")
def stack(tiny_model_dir):
    """Thinker, Talker and Code2Wav as three real processes on localhost ports. The talker gets an
    SM share as `voxpipe up --mps-sm-percent talker=40` gives it and the thinker the client priority of
    `--mps-priority thinker=below_normal` (environment variables, ignored without CUDA MPS; test_bench
    checks that they arrive)."""
    from voxpipe.cli import LocalStack
    from voxpipe.layout import mps_env, parse_mps_priorities, parse_sm_shares

    ports = [free_port() for _ in STAGES]
    st = LocalStack(tiny_model_dir, "127.0.0.1", ports[0], "cpu",
                    metrics_ports={s: free_port() for s in STAGES},
                    stage_env=mps_env(parse_sm_shares("talker=40"), parse_mps_priorities("thinker=below_normal")))
    st.ports = dict(zip(STAGES, ports))
    st.start(timeout=240)
    yield st
    st.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from voxpipe.services.thinker.prompt import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="session")
def omni_config(tiny_model_dir):
    from voxpipe.services.runtime.config import OmniConfig

    return OmniConfig.load(tiny_model_dir)


# ---------------------------------------------------------------- the gateway as a process

class GatewayProcess:
    """`voxpipe gateway` as a real subprocess on a free localhost port."""

    def __init__(self, model_dir, thinker: str, code2wav: str, *extra: str, timeout: float = 120) -> None:
        import subprocess
        import sys
        import time

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "voxpipe.cli", "gateway", "--model", str(model_dir), "--host", "127.0.0.1",
               "--http-port", str(self.port), "--thinker", thinker, "--code2wav", code2wav,
               *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
        deadline = time.monotonic() + timeout
        while True:
            line = self.proc.stdout.readline()
            if "ready on port" in line:
                return
            if (not line and self.proc.poll() is not None) or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway did not start (exit code {self.proc.returncode})")

    def stop(self) -> None:
        stop_process(self.proc, 15)


def stop_process(proc, timeout: float) -> int:
    """SIGTERM a process still running, wait up to `timeout` s for it, SIGKILL it past that; its exit code."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="session")
def gateway(stack, tiny_model_dir):
    """The gateway (OpenAI HTTP API) in front of `stack`, no API key."""
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"))
    yield gw
    gw.stop()


# ---------------------------------------------------------------- dedicated stage processes

class StageProcesses:
    """Stage services as real processes on free localhost ports, each with /metrics, for tests that
    need their own (a chain to kill, a stage started with other flags). `start` launches one
    (`name`: how the test refers to it, `stage`: thinker / talker / code2wav); `wait_ready` waits
    for all those launched, so they start in parallel."""

    def __init__(self, model_dir) -> None:
        self.model_dir = model_dir
        self.procs: dict = {}
        self.stages: dict[str, str] = {}
        self.ports: dict[str, int] = {}
        self.metrics_ports: dict[str, int] = {}
        self.flags: dict[str, tuple[str, ...]] = {}
        self._ready: set[str] = set()

    def start(self, name: str, stage: str, *extra: str, port: int | None = None) -> str:
        import subprocess
        import sys

        self.ports[name], self.metrics_ports[name], self.stages[name] = port or free_port(), free_port(), stage
        self.flags[name] = extra
        cmd = [sys.executable, "-m", "voxpipe.cli", stage, "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--port", str(self.ports[name]), "--device", "cpu", "--grace", "2",
               "--metrics-port", str(self.metrics_ports[name]), *extra]
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True)
        return self.address(name)

    def wait_ready(self, timeout: float = 240) -> "StageProcesses":
        import time

        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            while name not in self._ready:
                line = proc.stdout.readline()
                if "ready on port" in line:
                    self._ready.add(name)
                elif (not line and proc.poll() is not None) or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{name} did not start (exit code {proc.returncode})")
        return self

    def restart(self, name: str, timeout: float = 240) -> str:
        """Start `name` again as it was started (stage, flags, port) once its process has ended; ready."""
        assert self.procs[name].poll() is not None, f"{name} is still running"
        self._ready.discard(name)
        self.start(name, self.stages[name], *self.flags[name], port=self.ports[name])
        self.wait_ready(timeout)
        return self.address(name)

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    def metric(self, name: str, metric: str = "voxpipe_active_streams", labels: str = "") -> float:
        """A sample of `name`'s /metrics (`labels`: the labels before `stage`, e.g. 'outcome="ok",')."""
        import re

        import httpx

        text = httpx.get(f"http://127.0.0.1:{self.metrics_ports[name]}/metrics").text
        m = re.search(rf'^{metric}{{{labels}stage="{self.stages[name]}"}} (\S+)$', text, re.M)
        return float(m.group(1)) if m else 0.0

    def alive(self, name: str) -> bool:
        return self.procs[name].poll() is None

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def stop(self) -> None:
        import subprocess

        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_chain(model_dir, *, talkers: int = 1, code2wav_port: int | None = None, with_code2wav: bool = True,
                **extra: list[str]) -> StageProcesses:
    """A thinker -> talker(s) -> code2wav chain of its own: names "thinker", "talker" (or "talker0",
    "talker1", ...), "code2wav". `code2wav_port`: where the talkers send frames (with_code2wav=False:
    nobody listens there). `extra[name]`: more flags for that process. Started and ready."""
    procs = StageProcesses(model_dir)
    c2w_port = code2wav_port or free_port()
    c2w = f"127.0.0.1:{c2w_port}"
    if with_code2wav:
        procs.start("code2wav", "code2wav", *extra.get("code2wav", []), port=c2w_port)
    names = ["talker"] if talkers == 1 else [f"talker{i}" for i in range(talkers)]
    addresses = [procs.start(n, "talker", "--code2wav", c2w, *extra.get(n, [])) for n in names]
    procs.start("thinker", "thinker", "--talker", ",".join(addresses), *extra.get("thinker", []))
    procs.code2wav_address = c2w
    return procs.wait_ready()


# ---------------------------------------------------------------- CPU-heavy jobs started at collection

class BackgroundRun:
    """A self-contained subprocess started before the tests run, at nice 19, so that it takes the CPU the
    I/O-bound tests leave idle. A test module names its jobs in BACKGROUND = {fixture name: factory}:
    the factory (no arguments) starts its BackgroundRuns and returns what the fixture needs; it is called
    once the session's tests are collected, when a selected test uses that fixture (an exception it
    raises is raised again where the fixture asks for it), and the fixture collects it (`background`).
    Output goes to files (no pipe to fill); a run nobody collected has its process group killed at the
    end of the session. A process group, not a session: the kernel's autogroup scheduling would give a
    session of its own an equal share of the CPU, whatever its nice value."""

    started: list["BackgroundRun"] = []

    def __init__(self, args: list[str], *, env: dict | None = None, cwd=None) -> None:
        import subprocess
        import tempfile

        self.args = args
        self._out, self._err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._out, stderr=self._err, text=True,
                                     process_group=0, preexec_fn=lambda: os.nice(19))
        BackgroundRun.started.append(self)

    def result(self, timeout: float) -> "subprocess.CompletedProcess":
        """The finished process, as subprocess.run(capture_output=True, text=True, timeout=timeout) returns
        it; `timeout` counts from now (once the tests that need it wait, the job runs at normal priority
        where the user may raise it again: root, as in CI)."""
        import subprocess

        try:
            os.setpriority(os.PRIO_PGRP, self.proc.pid, 0)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise subprocess.TimeoutExpired(self.args, timeout, *self._read()) from None
        return subprocess.CompletedProcess(self.args, self.proc.returncode, *self._read())

    def _read(self) -> tuple[str, str]:
        for f in (self._out, self._err):
            f.flush()
            f.seek(0)
        return self._out.read(), self._err.read()

    def kill(self) -> None:
        import signal

        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()


_BACKGROUND: dict[str, tuple] = {}     # fixture name: (what its factory returned, what it raised)


def _start_background(factory) -> tuple:
    try:
        return factory(), None
    except Exception as e:
        return None, e


def pytest_collection_finish(session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        for name, factory in getattr(getattr(item, "module", None), "BACKGROUND", {}).items():
            if name in item.fixturenames and name not in _BACKGROUND:
                _BACKGROUND[name] = _start_background(factory)


def pytest_sessionfinish(session) -> None:
    for run in BackgroundRun.started:
        run.kill()


def background(name: str, factory):
    """What `factory` returned when the session's tests were collected (called now if it was not)."""
    if name not in _BACKGROUND:
        _BACKGROUND[name] = _start_background(factory)
    started, error = _BACKGROUND[name]
    if error is not None:
        raise error
    return started


# ---------------------------------------------------------------- Node.js clients (npm packages pinned in tests/node*)

def install_node_package(tmp_path_factory, folder: str, *files: str):
    """tests/<folder> (its package.json pins the npm packages) with `files`, installed by npm into a
    temporary folder; node and npm are required (.ci/run installs them): Node tests never skip."""
    import shutil
    import subprocess
    from pathlib import Path

    node, npm = shutil.which("node"), shutil.which("npm")
    assert node and npm, "node and npm are needed (.ci/run installs them: apt-get install nodejs npm)"
    source = Path(__file__).resolve().parent / folder
    workdir = tmp_path_factory.mktemp(folder.replace("_", "-"))
    for name in ("package.json", *files):
        shutil.copy(source / name, workdir / name)
    proc = subprocess.run([npm, "install", "--no-audit", "--no-fund", "--loglevel=error"], cwd=workdir,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"npm install in {folder} failed:\n{proc.stdout}{proc.stderr}"
    return workdir


# ---------------------------------------------------------------- engines stepped in the test's thread

@pytest.fixture(scope="module")
def loop():
    """An event loop for a module's engine outboxes (set as the thread's current loop)."""
    import asyncio

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    yield loop
    loop.close()


# ---------------------------------------------------------------- the openai SDK against the session's gateway

@pytest.fixture(scope="module")
def client(gateway):
    import openai

    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(gateway) -> str:
    import httpx

    return httpx.get(f"{gateway.base_url}/v1/models").json()["data"][0]["id"]
