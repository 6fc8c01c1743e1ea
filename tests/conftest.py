import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The tiny random Qwen3-Omni checkpoint (seed 0), built once per test session."""
    from voxpipe.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-qwen3-omni"), seed=0)


# ---------------------------------------------------------------- the three services as processes

import socket  # noqa: E402

STAGES = ("thinker", "talker", "code2wav")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def stack(tiny_model_dir):
    """Thinker, Talker and Code2Wav as three real processes on localhost ports."""
    from voxpipe.cli import LocalStack

    ports = [free_port() for _ in STAGES]
    st = LocalStack(tiny_model_dir, "127.0.0.1", ports[0], "cpu",
                    metrics_ports={s: free_port() for s in STAGES})
    st.ports = dict(zip(STAGES, ports))
    st.start(timeout=240)
    yield st
    st.stop()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from voxpipe.services.thinker.server import load_tokenizer

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
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def gateway(stack, tiny_model_dir):
    """The gateway (OpenAI HTTP API) in front of `stack`, no API key."""
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"))
    yield gw
    gw.stop()
