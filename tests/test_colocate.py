"""`--colocate`: the three stage services in one process (services/runtime/colocate.py), each still
its own gRPC service. On the CPU: one colocated `voxpipe up` (gateway in front) serves the same bytes
as the separate processes (`stack`, `gateway`), every stage answers health and serves its own
/metrics on its own port, `up --colocate --say` writes the wav the separate stack speaks, SIGTERM
drains all three; bad priorities and stage flags are refused; a stage whose server cannot start
stops the others, named."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import socket
import subprocess
import sys
import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from openai import OpenAI

from conftest import STAGES, free_port, free_ports, stop_process
from voxpipe.bench.trace_path import CLIENT, SERVER, SpanReceiver
from voxpipe import cli
from voxpipe.errors import ConfigError
from voxpipe.services.runtime import colocate

SERVICES = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}


class ColocatedUp:
    """`voxpipe up --colocate` (CPU, gateway on) as a real process, its output read as it comes,
    its spans exported to `spans` (OTEL_SERVICE_NAME unset: each stage names its own service)."""

    def __init__(self, model_dir, spans: SpanReceiver) -> None:
        env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{spans.port}",
               "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100",
               "OTEL_TRACES_SAMPLER": "always_on"}
        env.pop("OTEL_SERVICE_NAME", None)
        first = free_ports(7)
        self.base, self.metrics, self.http_port = first, first + 3, first + 6
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "voxpipe.cli", "up", "--colocate", "--model", str(model_dir), "--device", "cpu",
             "--base-port", str(self.base), "--metrics-base-port", str(self.metrics),
             "--http-port", str(self.http_port)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.err: list[str] = []
        self.reader = threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)
        self.reader.start()
        self.out: list[str] = []
        deadline = time.monotonic() + 240
        while not any("all services up" in line for line in self.out):
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"voxpipe up --colocate did not come up:\n{''.join(self.err)[-3000:]}")
            self.out.append(line)

    def address(self, stage: str) -> str:
        return f"127.0.0.1:{self.base + STAGES.index(stage)}"

    def stop(self) -> int:
        code = stop_process(self.proc, 60)
        self.reader.join(timeout=10)
        return code


@pytest.fixture(scope="module")
def spans():
    receiver = SpanReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def colocated(tiny_model_dir, spans):
    up = ColocatedUp(tiny_model_dir, spans)
    yield up
    up.stop()


def test_one_process_serves_each_stage_on_its_own_port_with_its_own_health_and_metrics(colocated):
    pids = {re.search(r"\(pid (\d+)", line).group(1) for line in colocated.out if line.split()[:1] in
            ([s] for s in STAGES)}
    assert len(pids) == 1, colocated.out                        # the three stages: one process
    for stage in STAGES:
        with grpc.insecure_channel(colocated.address(stage)) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", SERVICES[stage]):
                assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status == \
                    health_pb2.HealthCheckResponse.SERVING
        text = httpx.get(f"http://127.0.0.1:{colocated.metrics + STAGES.index(stage)}/metrics", timeout=10).text
        assert f'voxpipe_stage_capacity{{stage="{stage}"}} 16.0' in text
        labelled = set(re.findall(r'^voxpipe_(?!next_stage)\w+\{stage="(\w+)"', text, re.M))
        assert labelled == {stage}, (stage, labelled)            # its own series only, as a process of its own
    assert "priorities (thinker=low, talker=high, code2wav=high) apply on CUDA only" in "".join(colocated.err)


def _chat(base_url: str, model: str) -> tuple[str, bytes]:
    client = OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=model, max_tokens=4, seed=11, modalities=["text", "audio"], audio={"voice": "ethan", "format": "wav"},
        messages=[{"role": "user", "content": "Say something short."}])
    audio = reply.choices[0].message.audio
    return audio.transcript, base64.b64decode(audio.data)


def test_the_colocated_gateway_answers_with_the_bytes_of_the_separate_processes(colocated, gateway, tiny_model_dir,
                                                                                spans):
    model = tiny_model_dir.name        # the talker samples (its defaults), seeded
    here = _chat(f"http://127.0.0.1:{colocated.http_port}", model)
    apart = _chat(gateway.base_url, model)
    assert len(here[1]) > 44 and here == apart
    # each stage's spans under its own service, in the gateway's trace: the servers' and the calls between them
    want = {("voxpipe-thinker", "voxpipe.v1.Thinker/Generate", SERVER), ("voxpipe-talker", "voxpipe.v1.Talker/Generate",
            SERVER), ("voxpipe-code2wav", "voxpipe.v1.Code2Wav/Decode", SERVER),
            ("voxpipe-thinker", "voxpipe.v1.Talker/Generate", CLIENT), ("voxpipe-talker", "voxpipe.v1.Code2Wav/Decode",
                                                                        CLIENT)}
    deadline = time.monotonic() + 20
    while True:
        got = spans.snapshot()
        traces = {s.trace_id for s in got if (s.service, s.name, s.kind) == ("voxpipe-gateway", "POST /v1/chat/completions",
                                                                             SERVER)}
        found = {(s.service, s.name, s.kind) for s in got if s.trace_id in traces}
        if want <= found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(traces) == 1 and want <= found, (traces, sorted(found))
    # the thinker called the talker and the talker code2wav over gRPC: each counts its own next-stage streams
    for stage, nxt in (("thinker", "talker"), ("talker", "code2wav")):
        text = httpx.get(f"http://127.0.0.1:{colocated.metrics + STAGES.index(stage)}/metrics", timeout=10).text
        assert re.search(rf'^voxpipe_next_stage_streams_total{{stage="{nxt}"}} [1-9]', text, re.M), stage


def test_up_colocate_say_writes_the_wav_the_separate_stack_speaks(stack, tiny_model_dir, tmp_path):
    words = ["--voice", "ethan", "--max-tokens", "5", "--max-frames", "24", "--seed", "3", "--temperature", "0.8"]
    base = free_ports(3)
    together = tmp_path / "colocated.wav"
    run = subprocess.run([sys.executable, "-m", "voxpipe.cli", "up", "--colocate", "--model", str(tiny_model_dir),
                          "--device", "cpu", "--base-port", str(base), "--colocate-priority", "thinker=low",
                          "--say", "Hello there.", "-o", str(together), *words],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    apart = tmp_path / "apart.wav"
    say = cli.build_parser("say").parse_args(["say", "Hello there.", "--thinker", stack.address("thinker"),
                                              "--code2wav", stack.address("code2wav"), "-o", str(apart), *words])
    assert cli.cmd_say(say) == 0
    assert together.read_bytes() == apart.read_bytes() and len(together.read_bytes()) > 44


def test_sigterm_drains_and_stops_all_three(colocated):
    assert colocated.stop() == 0
    err = "".join(colocated.err)
    for service in SERVICES.values():
        assert f"{service} draining" in err and f"{service} stopped" in err, service
    assert "CRITICAL" not in err and "Traceback" not in err


def _up_args(*flags: str):
    return cli.build_parser("up").parse_args(["up", "--device", "cpu", *flags])


@pytest.mark.parametrize("flags, message", [
    (("--colocate", "--colocate-priority", "thinker=urgent"), "thinker: 'urgent' is not one of low, high"),
    (("--colocate", "--colocate-priority", "talker"), "expected STAGE=PRIORITY"),
    (("--colocate", "--colocate-priority", "vocoder=high"), "expected STAGE=PRIORITY"),
    (("--colocate", "--colocate-priority", "talker=high,talker=low"), "talker named twice"),
    (("--colocate-priority", "thinker=low"), "add --colocate"),
    (("--colocate", "--mps-priority", "thinker=below_normal"), "use --colocate-priority"),
    (("--colocate", "--devices", "talker=cpu*2"), "one replica of each stage, all on one device"),
])
def test_bad_colocate_flags_are_refused_before_anything_starts(flags, message, tiny_model_dir):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cli.cmd_up(_up_args("--model", str(tiny_model_dir), *flags))


@pytest.mark.parametrize("flags, message", [
    ({"colocate_priority": "code2wav=highest"}, "code2wav: 'highest' is not one of low, high"),
    ({"talker_flags": "--max-batch 4 --no-such-flag"}, "--talker-flags: not a flag of `voxpipe talker`: --no-such-flag"),
    ({"thinker_flags": "--max-batch four"}, "--thinker-flags: argument --max-batch"),
    ({"code2wav_flags": "--port '50053"}, "--code2wav-flags: No closing quotation"),
])
def test_voxpipe_colocate_refuses_bad_priorities_and_stage_flags(flags, message):
    args = cli.build_parser("colocate").parse_args(["colocate"])
    for key, value in flags.items():
        setattr(args, key, value)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cli.parse_colocated(args)


def _stage_args(tiny_model_dir, ports: dict[str, int], metrics: dict[str, int] | None = None):
    args = cli.build_parser("colocate").parse_args(["colocate"])
    for stage in STAGES:
        flags = f"--model {tiny_model_dir} --device cpu --port {ports[stage]}"
        if metrics and stage in metrics:
            flags += f" --metrics-port {metrics[stage]}"
        nxt = {"thinker": "talker", "talker": "code2wav"}.get(stage)
        flags += f" --{nxt} 127.0.0.1:{ports[nxt]}" if nxt else ""
        setattr(args, f"{stage}_flags", flags)
    return cli.parse_colocated(args)


def test_voxpipe_colocate_alone_chains_its_own_stages():
    stage_args, priorities = cli.parse_colocated(cli.build_parser("colocate").parse_args(
        ["colocate", "--talker-flags=--port 50062 --host 0.0.0.0", "--code2wav-flags=--port=50063 --max-batch 4"]))
    assert [stage_args[s].port for s in STAGES] == [50051, 50062, 50063]     # `voxpipe STAGE`'s defaults otherwise
    assert stage_args["thinker"].talker == "127.0.0.1:50062" and stage_args["talker"].code2wav == "127.0.0.1:50063"
    assert stage_args["code2wav"].max_batch == 4 and priorities == {"thinker": "low", "talker": "high", "code2wav": "high"}


@pytest.mark.parametrize("flags, message", [
    (["--talker-flags=--port 0"], "--talker-flags: --port 0"),
    (["--code2wav-flags=--port=0"], "--code2wav-flags: --port 0"),
])
def test_a_next_stage_on_any_free_port_needs_its_address_given(flags, message):
    """The thinker dials the talker in the process (and the talker code2wav) at its --port: with
    --port 0 (any free port, known only once bound) that would be port 0; refused, naming the flag,
    unless the caller's --talker / --code2wav says where the next stage is."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        cli.parse_colocated(cli.build_parser("colocate").parse_args(["colocate", *flags]))
    nxt = "talker" if "talker" in flags[0] else "code2wav"
    caller = {"talker": "thinker", "code2wav": "talker"}[nxt]
    stage_args, _ = cli.parse_colocated(cli.build_parser("colocate").parse_args(
        ["colocate", *flags, f"--{caller}-flags=--{nxt} 127.0.0.1:50099"]))
    assert getattr(stage_args[caller], nxt) == "127.0.0.1:50099" and stage_args[nxt].port == 0


@pytest.mark.parametrize("host,dialled", [("0.0.0.0", "127.0.0.1:50098"), ("[::]", "[::1]:50098"),
                                          ("::", "[::1]:50098"), ("10.1.2.3", "10.1.2.3:50098")])
def test_a_next_stage_in_the_process_is_dialled_where_it_listens(host, dialled):
    """The thinker's --talker, unset, is the talker in the process at its --host and --port: a bind-all
    host (gRPC's "[::]" form included) dialled on the loopback of its family."""
    stage_args, _ = cli.parse_colocated(cli.build_parser("colocate").parse_args(
        ["colocate", f"--talker-flags=--host {host} --port 50098"]))
    assert stage_args["thinker"].talker == dialled


def test_a_taken_port_is_refused_naming_the_stage_before_any_build(tiny_model_dir):
    ports = {s: free_port() for s in STAGES}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports["talker"]))
        taken.listen()
        stage_args, _ = _stage_args(tiny_model_dir, ports)
        with pytest.raises(ConfigError, match=f"talker gRPC port {ports['talker']}"):
            colocate.check_stages(stage_args)
    stage_args, _ = _stage_args(tiny_model_dir, {**ports, "code2wav": ports["thinker"]})
    with pytest.raises(ConfigError, match=f"code2wav --port {ports['thinker']} is also thinker --port's"):
        colocate.check_stages(stage_args)


def test_a_stage_that_cannot_serve_stops_the_others_and_is_named(tiny_model_dir, caplog):
    """Built, then code2wav's metrics port is taken before it serves: the thinker and the talker,
    already serving, drain and stop; StageFailed names code2wav; a CRITICAL line says so."""
    ports = {s: free_port() for s in STAGES}
    metrics_port = free_port()
    stage_args, priorities = _stage_args(tiny_model_dir, ports, {"code2wav": metrics_port})
    stages = colocate.build_stages(stage_args, priorities)
    ready: list[str] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics_port))
        taken.listen()
        with pytest.raises(colocate.StageFailed, match="the code2wav stage stopped: .*metrics port"):
            asyncio.run(colocate.serve_stages(stages, lambda stage, port: ready.append(stage)))
    assert "code2wav" not in ready
    assert any(r.levelname == "CRITICAL" and "the code2wav stage stopped" in r.getMessage()
               for r in caplog.records), caplog.text
    assert all(s.servicer.engine._thread is None or not s.servicer.engine._thread.is_alive() for s in stages)


def test_one_process_gets_the_stages_environments_and_each_stage_its_own_service_name(tiny_model_dir):
    """`bench --trace` gives each stage OTEL_SERVICE_NAME=STAGE (trace_path.SpanReceiver.env): in one
    process one name would make every stage's spans "code2wav-STAGE" (the last stage's name, with
    the stage appended); the stages' differing names are dropped, each stage names its own
    (voxpipe-STAGE), and the variables they agree on are kept. Other variables that differ cannot
    be one process's: refused, naming them."""
    from voxpipe.layout import COLOCATE_DEFAULT

    receiver = SpanReceiver()
    try:
        stack = cli.LocalStack(tiny_model_dir, "127.0.0.1", free_port(), "cpu", colocate=COLOCATE_DEFAULT,
                               stage_env={s: receiver.env(s) for s in STAGES})
        env = stack.colocated_env()
        assert "OTEL_SERVICE_NAME" not in env and env["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(str(receiver.port))
    finally:
        receiver.close()
    stack = cli.LocalStack(tiny_model_dir, "127.0.0.1", free_port(), "cpu", colocate=COLOCATE_DEFAULT,
                           stage_env={"talker": {"SOME_SETTING": "1"}, "code2wav": {"SOME_SETTING": "2"}})
    with pytest.raises(ConfigError, match="SOME_SETTING"):
        stack.colocated_env()


def test_the_bench_takes_colocate_as_the_lead_runs_it():
    from voxpipe.bench.harness import Plan

    parser = cli.build_parser("bench")
    argv = ["--log-level", "WARNING", "bench", "--workload", "seedtts-like", "--concurrency", "1,64", "--modes",
            "gateway", "--no-reference", "--quick"]
    plan = Plan.of(parser.parse_args(argv + ["--colocate"]))
    assert plan.colocate == {"thinker": "low", "talker": "high", "code2wav": "high"}
    assert Plan.of(parser.parse_args(argv + ["--mps"])).colocate is None
    with pytest.raises(SystemExit, match="not with --mps"):
        Plan.of(parser.parse_args(argv + ["--colocate", "--mps"]))
    with pytest.raises(SystemExit, match="'urgent' is not one of low, high"):
        Plan.of(parser.parse_args(argv + ["--colocate", "--colocate-priority", "talker=urgent"]))
