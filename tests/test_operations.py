"""Operations: the CLI (help on every flag, `voxpipe health ADDR`, `voxpipe up` passing its flags
on), the one log format (plain / JSON, request and trace ids, access lines), the gateway's gRPC
health following /ready, and the session and capacity gauges -- on real processes."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import logging
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent import futures

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from websockets.asyncio.client import connect

from conftest import STAGES, GatewayProcess, free_port, free_ports
from voxpipe.cli import build_parser
from voxpipe.errors import ConfigError
from voxpipe.services.runtime import logs
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import gateway_pb2_grpc as gw_grpc
from voxpipe.v1 import stages_pb2 as pb

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "voxpipe.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# ----------------------------------------------------------------------------- the command line

def _flags_without_help(parser: argparse.ArgumentParser, path: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags_without_help(sub, f"{path} {name}")
        elif isinstance(action, argparse._HelpAction):
            continue
        elif not (action.help or "").strip() or action.help == argparse.SUPPRESS:
            yield f"{path}: {'/'.join(action.option_strings) or action.dest}"


def test_every_flag_of_every_command_has_help():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert {"thinker", "talker", "code2wav", "gateway", "up", "say", "health", "bench", "make-tiny"} <= \
        set(commands.choices)
    assert all(a.help for a in commands._choices_actions), "a command without help"
    assert list(_flags_without_help(parser, "voxpipe")) == []


@pytest.mark.parametrize("args,message", [
    (["--log-format", "xml", "health"], "argument --log-format: invalid choice: 'xml'"),
    (["--log-level", "LOUD", "health"], "unknown log level 'LOUD'"),
    (["health", "127.0.0.1:1", "--addr", "127.0.0.1:2"], "two addresses given"),
])
def test_bad_logging_and_health_flags_are_refused(args, message, capsys):
    with pytest.raises((SystemExit, ConfigError)) as stop:      # argparse's, or the command's one line
        parsed = build_parser().parse_args(args)
        parsed.func(parsed)
    assert isinstance(stop.value, ConfigError) or stop.value.code != 0
    assert message in capsys.readouterr().err + str(getattr(stop.value, "code", stop.value))


# ----------------------------------------------------------------------------- the log format

@pytest.fixture
def root_logging():
    """The root logger's handlers and level put back after the test (setup_logging replaces them)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.captureWarnings(False)


def _log_once(fmt: str, request_id: str | None, span_context: trace.SpanContext | None, **extra) -> str:
    out = io.StringIO()
    logs.setup_logging("INFO", fmt, stream=out)
    token = logs.REQUEST_ID.set(request_id)
    ctx = otel_context.attach(trace.set_span_in_context(trace.NonRecordingSpan(span_context))) \
        if span_context is not None else None
    try:
        logging.getLogger("voxpipe.test").info("hello %s", "there", **extra)
    finally:
        if ctx is not None:
            otel_context.detach(ctx)
        logs.REQUEST_ID.reset(token)
    return out.getvalue().strip()


def test_plain_and_json_lines_carry_the_request_and_trace_ids(root_logging):
    span = trace.SpanContext(trace_id=0x4BF92F3577B34DA6A3CE929D0E0E4736, span_id=0x00F067AA0BA902B7,
                             is_remote=True, trace_flags=trace.TraceFlags(1))
    plain = _log_once("plain", "req_1", span)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO voxpipe\.test: hello there "
                        r"\[request_id=req_1 trace_id=4bf92f3577b34da6a3ce929d0e0e4736\]", plain), plain
    assert _log_once("plain", None, None).endswith("INFO voxpipe.test: hello there")
    record = json.loads(_log_once("json", "req_2", span))
    assert record["level"] == "INFO" and record["logger"] == "voxpipe.test" and record["message"] == "hello there"
    assert record["request_id"] == "req_2" and record["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert record["span_id"] == "00f067aa0ba902b7" and record["time"].endswith("+00:00")
    access = logs.AccessRecord("POST", "/v1/x", "200", 0.5, "127.0.0.1:1")
    record = json.loads(_log_once("json", None, None, extra={"access": access}))
    assert "request_id" not in record and "trace_id" not in record
    assert record["access"] == {"method": "POST", "path": "/v1/x", "status": "200", "duration_s": 0.5,
                                "client": "127.0.0.1:1"}


# ----------------------------------------------------------------------------- health follows /ready

class FakeStage:
    """A grpc.health.v1 server alone, on a port fixed in advance (a stand-in stage for /ready)."""

    def __init__(self, port: int) -> None:
        self.port, self.server, self.health = port, None, health.HealthServicer()

    def start(self) -> None:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        assert self.server.add_insecure_port(f"127.0.0.1:{self.port}") == self.port
        self.health.set("", SERVING)
        self.server.start()

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(None)


def converse_health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service="voxpipe.v1.Gateway"), timeout=5).status


def wait_health(address: str, want: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (got := converse_health(address)) != want:
        assert time.monotonic() < deadline, f"Converse health stayed {got}, expected {want}"
        time.sleep(0.2)


def test_converse_health_follows_ready_and_voxpipe_health_reads_it(tiny_model_dir):
    thinker, code2wav = FakeStage(free_port()), FakeStage(free_port())
    grpc_port = free_port()
    gateway = GatewayProcess(tiny_model_dir, f"127.0.0.1:{thinker.port}", f"127.0.0.1:{code2wav.port}",
                             "--grpc-port", str(grpc_port))
    address = f"127.0.0.1:{grpc_port}"
    try:
        assert httpx.get(f"{gateway.base_url}/ready", timeout=10).status_code == 503
        wait_health(address, NOT_SERVING, timeout=1)                    # from the start: nobody is there
        down = cli("health", address)
        assert down.returncode == 1 and f"{address}: NOT_SERVING" in down.stdout
        thinker.start()
        code2wav.start()
        wait_health(address, SERVING)
        assert httpx.get(f"{gateway.base_url}/ready", timeout=10).status_code == 200
        for args in (["health", address], ["health", "--addr", address]):
            up = cli(*args)
            assert up.returncode == 0 and f"{address}: SERVING" in up.stdout, (args, up.stdout, up.stderr)
        code2wav.health.set("", NOT_SERVING)                             # one stage says it is not ready
        wait_health(address, NOT_SERVING)
        assert httpx.get(f"{gateway.base_url}/ready", timeout=10).status_code == 503
        code2wav.health.set("", SERVING)
        wait_health(address, SERVING)
        thinker.stop()                                                   # one stage goes away
        wait_health(address, NOT_SERVING)
    finally:
        gateway.stop()
        thinker.stop()
        code2wav.stop()


# ----------------------------------------------------------------------------- what --max-sessions counts

def gateway_sessions(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {api: float(v) for api, v in re.findall(r'^voxpipe_gateway_sessions\{api="(\w+)"\} (\S+)$', text, re.M)}


@pytest.fixture(scope="module")
def counted_gateway(stack, tiny_model_dir):
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"),
                             "--grpc-port", str(grpc_port), "--max-sessions", "3")
    yield process, f"127.0.0.1:{grpc_port}"
    process.stop()


def test_the_sessions_gauge_counts_what_max_sessions_counts(counted_gateway, stack):
    """An idle realtime session, an HTTP stream being read and a Converse call in progress each
    hold a slot, shown by api in voxpipe_gateway_sessions; with --max-sessions 3 a fourth session
    is refused; every slot comes back."""
    process, address = counted_gateway
    model = httpx.get(f"{process.base_url}/v1/models", timeout=5).json()["data"][0]["id"]
    assert gateway_sessions(process.base_url) == {"http": 0, "realtime": 0, "converse": 0}

    async def go():
        async with connect(f"ws://127.0.0.1:{process.port}/v1/realtime") as idle:
            assert json.loads(await idle.recv())["type"] == "session.created"
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"model": model, "stream": True, "max_tokens": 1000, "ignore_eos": True,
                        "messages": [{"role": "user", "content": "Talk."}]}
                async with client.stream("POST", f"{process.base_url}/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    await lines.__anext__()                        # the stream has begun: its slot is held
                    async with grpc.aio.insecure_channel(address) as ch:
                        call = gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=gw.ConverseStart(
                            text="Talk.", max_tokens=8, max_frames=200, ignore_eos=True,
                            sampling=pb.Sampling(temperature=0.0)))]))
                        await call.read()                          # output flows: the call holds its slot
                        held = gateway_sessions(process.base_url)
                        async with connect(f"ws://127.0.0.1:{process.port}/v1/realtime") as fourth:
                            refused = json.loads(await fourth.recv())
                            await fourth.wait_closed()
                        call.cancel()
                    await resp.aclose()
        return held, refused, fourth.close_code

    held, refused, code = asyncio.run(go())
    assert held == {"http": 1, "realtime": 1, "converse": 1}
    assert refused["type"] == "error" and refused["error"]["code"] == "session_limit_reached" and code == 1013
    deadline = time.monotonic() + 15
    while any(gateway_sessions(process.base_url).values()):
        assert time.monotonic() < deadline, gateway_sessions(process.base_url)
        time.sleep(0.1)


def stage_gauge(port: int, name: str, stage: str) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    m = re.search(rf'^{name}{{stage="{stage}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else None


def test_every_stage_exports_its_capacity(stack):
    for stage in STAGES:
        assert stage_gauge(stack.metrics_ports[stage], "voxpipe_stage_capacity", stage) == 16   # --max-batch


# ----------------------------------------------------------------------------- voxpipe up

def test_voxpipe_up_passes_its_flags_on_and_every_process_logs_json(tiny_model_dir):
    """`voxpipe --log-format json up` with the gateway's key, Converse port, model name, session cap
    and the stages' metrics ports and batch: each reaches its process; every process logs JSON;
    the POST and the Converse call have access lines with their request and trace ids."""
    first = free_ports(9)
    base, metrics, http_port, grpc_port = first, first + 3, first + 6, first + 7
    proc = subprocess.Popen([sys.executable, "-m", "voxpipe.cli", "--log-format", "json", "up",
                             "--model", str(tiny_model_dir), "--device", "cpu", "--base-port", str(base),
                             "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--api-key", "sesame",
                             "--served-model-name", "org/voice-1", "--max-sessions", "1", "--metrics-base-port",
                             str(metrics), "--max-batch", "4", "--gateway-arg=--max-prompt-chars=5000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_lines: list[str] = []
    reader = threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True)
    reader.start()
    key = {"Authorization": "Bearer sesame"}
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        out = []
        deadline = time.monotonic() + 300
        while not any("all services up" in line for line in out):
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"voxpipe up exited {proc.returncode}:\n{''.join(err_lines)[-3000:]}"
            out.append(line)
            assert time.monotonic() < deadline, "voxpipe up did not come up"
        assert any(f"converse  127.0.0.1:{grpc_port}" in line for line in out), out
        url = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=key, timeout=10).json()["data"][0]["id"] == "org/voice-1"
        body = {"model": "org/voice-1", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi."}]}
        resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60,
                          headers={**key, "x-request-id": "ops-chat-1", "traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
        assert resp.status_code == 200 and resp.headers["x-request-id"] == "ops-chat-1"
        too_long = {**body, "messages": [{"role": "user", "content": "x" * 5001}]}       # --gateway-arg
        assert httpx.post(f"{url}/v1/chat/completions", json=too_long, headers=key, timeout=30).status_code == 400
        for i, stage in enumerate(STAGES):
            assert stage_gauge(metrics + i, "voxpipe_stage_capacity", stage) == 4
        address = f"127.0.0.1:{grpc_port}"
        wait_health(address, SERVING)
        with grpc.insecure_channel(address) as ch:
            start = gw.ConverseStart(text="Hi.", max_tokens=2, output_modalities=[gw.MODALITY_TEXT],
                                     request_id="ops-converse-1")
            done = list(gw_grpc.GatewayStub(ch).Converse(iter([gw.ConverseRequest(start=start)]),
                                                         metadata=(("authorization", "Bearer sesame"),),
                                                         timeout=60))[-1].done
            assert done.request_id == "ops-converse-1"

        async def one_session_is_the_cap():
            async with connect(f"ws://127.0.0.1:{http_port}/v1/realtime", additional_headers=key) as ws:
                assert json.loads(await ws.recv())["type"] == "session.created"
                return httpx.post(f"{url}/v1/chat/completions", json=body, headers=key, timeout=30).status_code

        assert asyncio.run(one_session_is_the_cap()) == 429                               # --max-sessions 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    assert not any(line.startswith("[transformers]") for line in err_lines)      # its records are ours too
    records = [json.loads(line) for line in err_lines if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    for service in ("voxpipe.v1.Thinker", "voxpipe.v1.Talker", "voxpipe.v1.Code2Wav"):
        assert any(r["message"].startswith(f"{service} serving on port") for r in records), service
    assert any(r["logger"].startswith("uvicorn") for r in records)
    access = [r for r in records if r["logger"] == "voxpipe.access"]
    chat = [r for r in access if r.get("request_id") == "ops-chat-1"]
    assert len(chat) == 1 and chat[0]["trace_id"] == trace_id, access
    assert chat[0]["access"]["method"] == "POST" and chat[0]["access"]["path"] == "/v1/chat/completions"
    assert chat[0]["access"]["status"] == "200" and chat[0]["message"].startswith("POST /v1/chat/completions 200 ")
    assert any(r["access"]["status"] == "400" and r["access"]["method"] == "POST" for r in access)
    assert any(r["access"]["status"] == "429" for r in access)
    conv = [r for r in access if r.get("request_id") == "ops-converse-1"]
    assert len(conv) == 1 and conv[0]["access"]["method"] == "GRPC" and conv[0]["access"]["status"] == "OK"
    assert conv[0]["access"]["path"] == "/voxpipe.v1.Gateway/Converse"
    assert not any(r["access"]["method"] == "GET" for r in access)        # probes and scrapes make no lines
