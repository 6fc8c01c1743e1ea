"""`voxpipe` command line: the three stage services, the local stack, and a speaking client."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from voxpipe import module_command, version
from voxpipe.errors import ConfigError
from voxpipe.layout import (COLOCATE_HELP, COLOCATE_PRIORITY_HELP, MPS_PRIORITY_HELP, MPS_SM_HELP, Layout, LayoutError,
                            check_colocatable, colocate_spec, memory_shares, mps_env, parse_colocate_priorities,
                            parse_mps_priorities, parse_sm_shares)
from voxpipe.services.runtime.listen import HOST_HELP, default_host, port_number
from voxpipe.services.runtime.logs import FORMATS, LEVELS, level_name, setup_logging

DEFAULT_HOME = Path(os.environ.get("VOXPIPE_HOME", Path.home() / ".cache" / "voxpipe"))
STAGES = ("thinker", "talker", "code2wav")
STAGE_SERVICES = {"thinker": "voxpipe.v1.Thinker", "talker": "voxpipe.v1.Talker", "code2wav": "voxpipe.v1.Code2Wav"}


def default_model_dir() -> Path:
    """The tiny random-weight checkpoint, made on first use."""
    path = DEFAULT_HOME / "tiny-seed0"
    if not (path / "config.json").exists():
        from voxpipe.tiny import make_tiny

        print(f"making the tiny checkpoint in {path}", file=sys.stderr, flush=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        make_tiny(tmp, seed=0)
        tmp.rename(path)
    return path


# ----------------------------------------------------------------------------- stage services

def _stage_model(args) -> None:
    """A stage's --model resolved: the released config with --load-format dummy, the tiny checkpoint
    when none is given, a hub id fetched (or found in the cache)."""
    if args.model is None:
        if args.load_format == "dummy":
            from voxpipe.services.runtime.config import released_config_path

            args.model = str(released_config_path())
        else:
            args.model = str(default_model_dir())
    from voxpipe.services.runtime.checkpoint import resolve_model

    args.model = str(resolve_model(args.model, weights=args.load_format != "dummy"))


def _stage_main(stage: str):
    def run(args) -> None:
        gc.disable()       # the imports and the build make long-lived objects only; serve_stage freezes them
        _stage_model(args)
        if stage == "thinker":
            from voxpipe.services.thinker import server
        elif stage == "talker":
            from voxpipe.services.talker import server
        else:
            from voxpipe.services.code2wav import server
        from voxpipe.services.runtime.cuda_graphs import GraphCaptureError

        try:
            server.run(args)
        except GraphCaptureError as e:
            print(f"{stage}: {e}", file=sys.stderr, flush=True)
            return 2
    return run


def _stage_arguments(stage: str, parser: argparse.ArgumentParser) -> None:
    from voxpipe.services.runtime.flags import STAGE_ARGUMENTS     # light: no torch, no grpc

    STAGE_ARGUMENTS[stage](parser)


def _colocate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--colocate-priority", default="", metavar="PRIORITIES", help=COLOCATE_PRIORITY_HELP)
    for port, stage in enumerate(STAGES, start=50051):
        p.add_argument(f"--{stage}-flags", default="", metavar="FLAGS",
                       help=f"the {stage}'s flags, as `voxpipe {stage}` takes them, in one word (quoted: "
                            f"--{stage}-flags='--port {port} --max-batch 64')")


def parse_colocated(args) -> tuple[dict[str, argparse.Namespace], dict[str, str]]:
    """`voxpipe colocate`'s stages, each one's flags parsed as `voxpipe STAGE` parses them (but that
    the thinker's --talker and the talker's --code2wav, unset, are the stages in this process), and
    their stream priorities; ConfigError naming the stage or the flag that is wrong."""
    import shlex

    try:
        priorities = parse_colocate_priorities(args.colocate_priority)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    stage_args = {}
    for stage in STAGES:
        parser = argparse.ArgumentParser(prog=f"voxpipe colocate --{stage}-flags", exit_on_error=False)
        _stage_arguments(stage, parser)
        try:
            stage_args[stage], unknown = parser.parse_known_args(shlex.split(getattr(args, f"{stage}_flags")))
        except (ValueError, argparse.ArgumentError) as e:
            raise ConfigError(f"--{stage}-flags: {e}") from None
        if unknown:
            raise ConfigError(f"--{stage}-flags: not a flag of `voxpipe {stage}`: {' '.join(unknown)[:200]}")
        stage_args[stage].command = stage
    # a next stage not named is the one in this process (its --host as a client dials it)
    for stage, nxt in (("thinker", "talker"), ("talker", "code2wav")):
        if not getattr(stage_args[stage], nxt):
            if not stage_args[nxt].port:     # any free port: known only once bound, after the stages are built
                raise ConfigError(f"--{nxt}-flags: --port 0 leaves the {stage} no address to dial the {nxt} at; "
                                  f"give the {nxt} a port (or the {stage} its --{nxt} in --{stage}-flags)")
            from voxpipe.services.runtime.listen import socket_host

            host = socket_host(stage_args[nxt].host)      # a bind host ("[::]", "0.0.0.0") as one to dial
            host = "127.0.0.1" if host in ("", "0.0.0.0") else "::1" if host == "::" else host
            setattr(stage_args[stage], nxt, f"[{host}]:{stage_args[nxt].port}" if ":" in host
                    else f"{host}:{stage_args[nxt].port}")
    return stage_args, priorities


def cmd_colocate(args) -> int:
    """The three stage services in one process (services/runtime/colocate.py)."""
    gc.disable()       # as `voxpipe STAGE`: the builds make long-lived objects only; colocate.run freezes them
    stage_args, priorities = parse_colocated(args)
    for stage_arg in stage_args.values():
        _stage_model(stage_arg)
    from voxpipe.services.runtime import colocate
    from voxpipe.services.runtime.cuda_graphs import GraphCaptureError

    try:
        return colocate.run(stage_args, priorities)
    except GraphCaptureError as e:
        print(f"colocate: {e}", file=sys.stderr, flush=True)
        return 2


# ----------------------------------------------------------------------------- health

def _client_tls(args):
    from voxpipe.services.runtime.tls import TLSConfigError, client_tls_from_args

    try:
        return client_tls_from_args(args)
    except TLSConfigError as e:
        raise ConfigError(str(e)) from None


def cmd_health(args) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from voxpipe.services.runtime.tls import channel

    tls = _client_tls(args)
    if args.addr and args.address and args.addr != args.address:
        raise ConfigError(f"two addresses given ({args.address} and --addr {args.addr}); give one")
    addr = args.address or args.addr
    addrs = [addr] if addr else [f"localhost:{p}" for p in (50051, 50052, 50053)]
    for addr in addrs:
        try:
            with channel(addr, tls) as ch:
                resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                            timeout=args.timeout)
            if resp.status == health_pb2.HealthCheckResponse.SERVING:
                print(f"{addr}: SERVING")
                return 0
            print(f"{addr}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}")
        except grpc.RpcError as e:
            print(f"{addr}: {e.code().name}")
    return 1


# ----------------------------------------------------------------------------- up

class LocalStack:
    """The stage services as separate processes on this machine: one per stage, or the replicas of
    a `layout` (voxpipe.layout), each stage's callers given every replica of the next stage."""

    def __init__(self, model: Path, host: str, base_port: int, device: str, extra: list[str] | None = None,
                 metrics_ports: dict[str, int] | None = None, http_port: int = 0,
                 layout: Layout | None = None, gateway_extra: list[str] | None = None,
                 global_flags: list[str] | None = None, gateway_env: dict[str, str] | None = None,
                 stage_env: dict[str, dict[str, str]] | None = None, reflection: bool = True,
                 stage_extra: dict[str, list[str]] | None = None, colocate: dict[str, str] | None = None) -> None:
        """`layout`: replicas and devices per stage (default: one replica of each on `device`);
        ports are given out from `base_port` in process order. `metrics_ports`: by process name
        (a stage's name when it has one replica, see Layout.names). `extra`: flags of every stage
        (TLS ones, say); `gateway_extra`: flags of the gateway; `global_flags`: `voxpipe` flags
        before the command (--log-level, --log-format) of every process; `gateway_env`: more
        environment for the gateway (VOXPIPE_API_KEY: a key stays off the command line); `stage_env`:
        more environment per stage, for each of its processes (voxpipe.layout.sm_share_env);
        `reflection`: gRPC server reflection on every stage and the Converse port (on: local development);
        `stage_extra`: more flags per stage, after `extra`, for each of its processes; `colocate`: the
        three stages in one process instead (`voxpipe colocate`, these stream priorities; one replica
        of each on one device), each with the flags and ports it would have alone."""
        self.model, self.host, self.device = model, host, device
        self.layout = layout or Layout.parse("", device)
        self.stage_of = {name: stage for name, stage, _ in self.layout.processes()}
        self.device_of = {name: dev for name, _, dev in self.layout.processes()}
        names = [n for stage in STAGES for n in self.layout.names(stage)]
        self.ports = {name: base_port + i for i, name in enumerate(names)}
        self.metrics_ports = metrics_ports or {}
        self.extra = extra or []
        self.stage_extra = stage_extra or {}
        self.gateway_extra = gateway_extra or []
        self.global_flags = global_flags or []
        self.gateway_env = gateway_env or {}
        self.stage_env = stage_env or {}
        self.http_port = http_port          # > 0: also run the gateway (OpenAI HTTP API) on this port
        self.reflection = ["--reflection" if reflection else "--no-reflection"]
        self.colocate = colocate
        if colocate is not None:
            check_colocatable(self.layout)
        self.procs: dict[str, subprocess.Popen] = {}     # by process name ("colocated": the three stages)

    def addresses(self, stage: str) -> list[str]:
        return [f"{self.host}:{self.ports[name]}" for name in self.layout.names(stage)]

    def address(self, stage: str) -> str:
        """The stage's replicas as one comma list (a single address with one replica)."""
        return ",".join(self.addresses(stage))

    def next_stage_flags(self, stage: str) -> list[str]:
        """Where a stage sends a request on: the thinker to the talkers, the talkers to the code2wavs."""
        nxt = {"thinker": "talker", "talker": "code2wav"}.get(stage)
        return [f"--{nxt}={self.address(nxt)}"] if nxt else []

    def check_ports(self, grpc_port: int = 0) -> None:
        """PortInUse for the first of the stack's ports something already listens on (`grpc_port`:
        the gateway's Converse port, 0: none), before any process starts."""
        from voxpipe.services.runtime.listen import check_free

        for name, port in self.ports.items():
            check_free(name, self.host, port, "--base-port")
        for name, port in self.metrics_ports.items():
            check_free(f"{name} metrics", self.host, port, "--metrics-base-port")
        if self.http_port:
            check_free("gateway HTTP", self.host, self.http_port, "--http-port")
            check_free("gateway Converse gRPC", self.host, grpc_port, "--grpc-port")

    def stage_flags(self, name: str, stage: str, device: str, shares: dict[str, float]) -> list[str]:
        """The flags of one stage process (after `voxpipe STAGE`)."""
        flags = ["--model", str(self.model), "--host", self.host, "--port", str(self.ports[name]),
                 "--device", device] + self.reflection + self.extra
        if name in shares:      # a GPU shared with other stages: the thinker's KV pool is sized from it
            flags.append(f"--gpu-memory-fraction={shares[name]}")
        flags += self.stage_extra.get(stage, [])
        if self.metrics_ports.get(name):
            flags += ["--metrics-port", str(self.metrics_ports[name])]
        return flags + self.next_stage_flags(stage)

    def colocated_env(self) -> dict[str, str] | None:
        """The environment of the one colocated process: the stages' environments together (tracing's,
        say; None: none given). An OTEL_SERVICE_NAME the stages do not share is dropped: each stage
        then names its own service (voxpipe-STAGE, services/runtime/tracing.setup_stage_tracing) --
        one name would label every stage's spans with the last stage's. Other variables the stages
        set differently are a ConfigError naming them."""
        env: dict[str, str] = {}
        split: set[str] = set()
        for stage in STAGES:
            for key, value in self.stage_env.get(stage, {}).items():
                if key in env and env[key] != value:
                    split.add(key)
                env.setdefault(key, value)
        if split - {"OTEL_SERVICE_NAME"}:
            raise ConfigError(f"--colocate: the stages' environments differ in {', '.join(sorted(split))}, "
                              "which one process cannot")
        if not env:
            return None
        env = {**os.environ, **env}
        if split:
            env.pop("OTEL_SERVICE_NAME", None)
        return env

    def pid(self, name: str) -> int:
        """The process id of a stage process (colocated: the one of all three) or of the gateway."""
        return self.procs["colocated" if self.colocate is not None and name != "gateway" else name].pid

    def start(self, timeout: float = 300.0) -> None:
        given = any(f.startswith("--gpu-memory-fraction") for f in self.extra)
        shares = {} if given else memory_shares(self.layout)
        if self.colocate is not None:
            import shlex

            cmd = [*module_command("voxpipe.cli"), *self.global_flags, "colocate",
                   f"--colocate-priority={colocate_spec(self.colocate)}"]
            cmd += [f"--{stage}-flags={shlex.join(self.stage_flags(name, stage, device, shares))}"
                    for name, stage, device in self.layout.processes()]
            self.procs["colocated"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True,
                                                       env=self.colocated_env())
        else:
            for name, stage, device in self.layout.processes():
                cmd = [*module_command("voxpipe.cli"), *self.global_flags, stage,
                       *self.stage_flags(name, stage, device, shares)]
                env = {**os.environ, **self.stage_env[stage]} if self.stage_env.get(stage) else None
                self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
        deadline = time.monotonic() + timeout
        for name, proc in list(self.procs.items()):
            self._wait_ready(name, proc, deadline, timeout, count=len(STAGES) if name == "colocated" else 1)
        if self.http_port:
            cmd = [*module_command("voxpipe.cli"), *self.global_flags, "gateway", "--model", str(self.model),
                   "--host", self.host, "--http-port", str(self.http_port)] + self.reflection
            cmd += [f"--{s}={self.address(s)}" for s in ("thinker", "code2wav")] + self.gateway_extra
            env = {**os.environ, **self.gateway_env} if self.gateway_env else None
            self.procs["gateway"] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
            self._wait_ready("gateway", self.procs["gateway"], deadline, timeout)

    def _wait_ready(self, name: str, proc: subprocess.Popen, deadline: float, timeout: float,
                    count: int = 1) -> None:
        """Until `proc` printed `count` "ready on port" lines (colocated: one per stage)."""
        while True:
            line = proc.stdout.readline()
            if "ready on port" in line:
                count -= 1
                if not count:
                    return
                continue
            if not line and proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{name} exited with code {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} not ready after {timeout:.0f} s")

    def stop(self, timeout: float = 30.0) -> None:
        gateway = self.procs.get("gateway")
        if gateway is not None and gateway.poll() is None:  # the gateway first: no new requests reach the stages
            gateway.send_signal(signal.SIGTERM)
            try:
                gateway.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for stage, proc in self.procs.items():
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def cmd_up(args) -> int:
    from voxpipe.services.runtime.checkpoint import hub_name, resolve_model

    if args.model and not args.served_model_name:
        args.served_model_name = hub_name(args.model)       # a repo id: clients see it, not the cache folder
    model = resolve_model(args.model, weights=args.load_format != "dummy") if args.model else default_model_dir()
    host = "127.0.0.1" if args.host in ("localhost", "127.0.0.1") else args.host
    http_port = 0 if args.say is not None else args.http_port     # --say is one request: no gateway
    _client_tls(args)
    if args.tls_cert and not args.tls_ca:
        raise ConfigError("--tls-cert needs --tls-ca here: the stages call each other (and the gateway "
                          "calls them), so they need the CA to check the certificates")
    stage_flags, gateway_flags = _up_tls_flags(args)
    stage_flags += _up_stage_flags(args)
    gateway_flags += _up_gateway_flags(args)
    try:
        layout = Layout.parse(args.devices, args.device)
        shares = parse_sm_shares(args.mps_sm_percent)
        priorities = parse_mps_priorities(args.mps_priority)
        colocate = colocate_of(args, layout)
    except LayoutError as e:
        raise ConfigError(str(e)) from None
    if colocate is not None and (shares or priorities):
        raise ConfigError("--mps-sm-percent / --mps-priority set what CUDA MPS gives each stage process; with "
                          "--colocate the stages share one process: use --colocate-priority")
    metrics_ports = ({name: args.metrics_base_port + i for i, (name, _, _) in enumerate(layout.processes())}
                     if args.metrics_base_port else None)
    api_key = args.api_key or os.environ.get("VOXPIPE_API_KEY")
    stack = LocalStack(model, host, args.base_port, args.device, http_port=http_port, extra=stage_flags,
                       gateway_extra=gateway_flags, layout=layout, metrics_ports=metrics_ports,
                       global_flags=[f"--log-level={args.log_level}", f"--log-format={args.log_format}"],
                       gateway_env={"VOXPIPE_API_KEY": api_key} if api_key else None,
                       stage_env=mps_env(shares, priorities), reflection=args.reflection, colocate=colocate)
    stop = {"now": False}

    def on_signal(signum, frame):
        stop["now"] = True

    stack.check_ports(args.grpc_port)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        stack.start()
    except RuntimeError as e:       # a process that stopped says why on stderr
        print(f"voxpipe up: {e}; every service stopped", file=sys.stderr, flush=True)
        return 1
    for name, stage, device in stack.layout.processes():
        metrics = f", metrics http://{host}:{stack.metrics_ports[name]}/metrics" if stack.metrics_ports else ""
        print(f"{name:9s} {host}:{stack.ports[name]}  {device}  (pid {stack.pid(name)}{metrics})", flush=True)
    if http_port:
        scheme = "https" if args.ssl_certfile else "http"
        print(f"gateway   {scheme}://{host}:{http_port}/v1  (pid {stack.procs['gateway'].pid}, metrics "
              f"{scheme}://{host}:{http_port}/metrics)", flush=True)
        if args.grpc_port:
            print(f"converse  {host}:{args.grpc_port}  (voxpipe.v1.Gateway/Converse)", flush=True)
    try:
        if args.say is not None:
            args.thinker, args.code2wav = stack.address("thinker"), stack.address("code2wav")
            args.model = str(model)
            return cmd_say(args)
        print("all services up; Ctrl-C stops them", flush=True)
        while not stop["now"] and all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.2)
        dead = [s for s, p in stack.procs.items() if p.poll() is not None]
        if dead and not stop["now"]:
            print(f"stopped: {', '.join(dead)} exited" + (" (its log names the stage that stopped it)"
                                                         if "colocated" in dead else ""), file=sys.stderr)
            return 1
        return 0
    finally:
        stack.stop()


def colocate_of(args, layout: Layout) -> dict[str, str] | None:
    """`--colocate`'s stream priorities by stage (None: separate processes); LayoutError for a
    --colocate-priority without --colocate, a bad one, or a layout that is not one replica per stage
    on one device."""
    if not args.colocate:
        if args.colocate_priority:
            raise LayoutError("--colocate-priority sets the stream priorities of stages in one process: add --colocate")
        return None
    priorities = parse_colocate_priorities(args.colocate_priority)
    check_colocatable(layout)
    return priorities


def _up_stage_flags(args) -> list[str]:
    """`voxpipe up`'s flags for every stage: the engine ones given, then --stage-arg's, as written."""
    flags = [f"--max-batch={args.max_batch}"] if args.max_batch else []
    flags += [f"--load-format={args.load_format}", f"--dtype={args.dtype}"]
    flags += ["--deterministic"] if args.deterministic else []
    return flags + list(args.stage_arg or [])


def _up_gateway_flags(args) -> list[str]:
    """`voxpipe up`'s flags for the gateway besides TLS (the API key travels in its environment),
    then --gateway-arg's, as written."""
    flags = [f"--grpc-port={args.grpc_port}"] if args.grpc_port else []
    if args.served_model_name:
        flags.append(f"--served-model-name={args.served_model_name}")
    if args.max_sessions is not None:
        flags.append(f"--max-sessions={args.max_sessions}")
    if args.cors_allow_origins is not None:
        flags.append(f"--cors-allow-origins={args.cors_allow_origins.flag()}")
    return flags + list(args.gateway_arg or [])


def _up_tls_flags(args) -> tuple[list[str], list[str]]:
    """`voxpipe up`'s TLS flags as the stages' flags and the gateway's: the stages serve with
    --tls-cert/--tls-key(/--tls-client-ca) and call each other with --tls-ca(/--tls-client-*), the
    gateway calls them the same way and serves HTTPS with --ssl-certfile/--ssl-keyfile."""
    client = [f"--{flag}={getattr(args, flag.replace('-', '_'))}"
              for flag in ("tls-ca", "tls-client-cert", "tls-client-key", "tls-server-name")
              if getattr(args, flag.replace("-", "_"))]
    serve = [f"--{flag}={getattr(args, flag.replace('-', '_'))}" for flag in ("tls-cert", "tls-key", "tls-client-ca")
             if getattr(args, flag.replace("-", "_"))]
    gateway = [f"--{flag}={getattr(args, flag.replace('-', '_'))}" for flag in ("ssl-certfile", "ssl-keyfile")
               if getattr(args, flag.replace("-", "_"))]
    return serve + client, gateway + client


# ----------------------------------------------------------------------------- say

def _add_say_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", default="reply.wav", help="where to write the 24 kHz mono 16-bit wav")
    p.add_argument("--voice", default="ethan", help="a checkpoint speaker (chelsie, ethan, aiden)")
    p.add_argument("--max-tokens", type=int, default=None, help="thinker max_new_tokens (default 64; not with --verbatim)")
    p.add_argument("--max-frames", type=int, default=128,
                   help="talker max_new_tokens (codec steps; at the limit max_frames - 1 frames are spoken)")
    p.add_argument("--min-tokens", type=int, default=0, help="thinker min_new_tokens (not with --verbatim)")
    p.add_argument("--min-frames", type=int, default=0, help="talker min_new_tokens (no end of speech before)")
    p.add_argument("--ignore-eos", action="store_true", help="min = max for text tokens and codec frames")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                             "holding this much probability (1: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (default: random)")
    p.add_argument("--audio", help="a wav file to include as an audio part of the user turn (its features are "
                                   "computed here from --model's config)")
    p.add_argument("--verbatim", action="store_true",
                   help="text to speech: speak TEXT itself (the thinker is given TEXT as its reply and generates "
                        "nothing), as POST /v1/audio/speech does")
    p.add_argument("--render-locally", action="store_true",
                   help="render the turn here with --model's tokenizer instead of letting the thinker render it")


def cmd_say(args) -> int:
    """Text goes to the thinker as text: it renders the turn with its own checkpoint's chat template,
    so `voxpipe say` needs no local checkpoint. With --audio (features are computed here, from
    --model's config) or --render-locally, the turn is rendered here with --model's tokenizer. With
    --verbatim TEXT is also the reply, given to the thinker (ThinkerStart.assistant_text)."""
    from voxpipe.audio import read_wav, resample, write_wav
    from voxpipe.client import AudioEvent, DoneEvent, PipelineClient, PipelineError, SpeechRequest, TextEvent

    text = args.text if getattr(args, "text", None) is not None else args.say
    if args.verbatim and (args.max_tokens is not None or args.min_tokens):
        print("error: --max-tokens / --min-tokens do not apply with --verbatim (the reply is TEXT)", file=sys.stderr)
        return 2
    max_tokens = 0 if args.verbatim else 64 if args.max_tokens is None else args.max_tokens
    sampling = dict(speaker=args.voice, max_tokens=max_tokens,
                    min_tokens=max_tokens if args.ignore_eos else args.min_tokens, max_frames=args.max_frames,
                    min_frames=args.max_frames if args.ignore_eos else args.min_frames, temperature=args.temperature,
                    top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    assistant_text=text if args.verbatim else None)
    if args.audio or args.render_locally:
        from voxpipe.services.runtime.config import OmniConfig
        from voxpipe.services.thinker.prompt import FeatureExtractor, load_tokenizer, render, user_turn

        from voxpipe.services.runtime.checkpoint import resolve_model

        model = resolve_model(args.model, weights=False) if args.model else default_model_dir()
        cfg = OmniConfig.load(model)
        features = FeatureExtractor.for_model(model, cfg.thinker)
        audio_features = []
        if args.audio:
            try:
                wav, rate = read_wav(Path(args.audio).read_bytes())
            except (OSError, ValueError) as e:
                print(f"error: --audio {args.audio}: {e}", file=sys.stderr)
                return 2
            audio_features.append(features(resample(wav, rate, 16000)))
        if args.render_locally:
            prompt = render(load_tokenizer(str(model)), cfg.thinker, user_turn(text, audio_features), features)
            req = SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features, **sampling)
        else:     # the thinker renders the audio part(s) and the text with its own template (user_turn)
            req = SpeechRequest(text=text, audio_features=audio_features, **sampling)
    else:
        req = SpeechRequest(text=text, **sampling)

    async def go():
        async with PipelineClient(args.thinker, args.code2wav, tls=_client_tls(args)) as client:
            t0 = time.perf_counter()
            first, said, chunks, done, rate = None, "", [], None, 0
            async for ev in client.stream(req):
                if isinstance(ev, AudioEvent):
                    first = first or time.perf_counter() - t0
                    chunks.append(ev.samples)
                    rate = ev.sample_rate
                elif isinstance(ev, TextEvent):
                    said += ev.text
                elif isinstance(ev, DoneEvent):
                    done = ev
            return said, chunks, done, first, time.perf_counter() - t0, rate

    try:
        said, chunks, done, first, total, rate = asyncio.run(go())
    except PipelineError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import numpy as np

    audio = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    rate = rate or 24000
    write_wav(args.output, audio, rate)
    print(f"text: {said!r}")
    print(f"wrote {args.output}: {done.frames} frames, {audio.shape[0]} samples, {audio.shape[0] / rate:.2f} s "
          f"(first audio after {first or 0:.3f} s, total {total:.2f} s)")
    return 0


# ----------------------------------------------------------------------------- main

class HelpFormatter(argparse.HelpFormatter):
    """`--help` shows each flag's default, unless its help already says it (or it has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text or action.default in (None, False, "", [])
                or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


GLOBAL_VALUE_FLAGS = ("--log-level", "--log-format")


def command_of(argv: list[str]) -> str:
    """The command `argv` names ("" when none): the first word that is neither a global flag nor
    a global flag's value."""
    words = iter(argv)
    for word in words:
        if word in GLOBAL_VALUE_FLAGS:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


def _bench_run(args) -> int:
    from voxpipe.bench.harness import run

    return run(args)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The `voxpipe` parser; `only`: build the flags of that command alone (`main`: the command
    given, so `--help` imports nothing heavy), None: of every command."""
    from voxpipe.services.runtime.tls import add_client_tls_arguments, add_server_tls_arguments

    parser = argparse.ArgumentParser(prog="voxpipe", description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"voxpipe {version()}",
                        help="print the version and exit")
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get("VOXPIPE_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (env VOXPIPE_LOG_LEVEL; default INFO)")
    parser.add_argument("--log-format", choices=FORMATS, default=os.environ.get("VOXPIPE_LOG_FORMAT", "plain"),
                        help="plain: one text line per record; json: one JSON object per line; both carry the "
                             "request and trace ids where known (env VOXPIPE_LOG_FORMAT; default plain)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser = functools.partial(sub.add_parser, formatter_class=HelpFormatter)
    for stage in STAGES:
        p = sub.add_parser(stage, help=f"run the {stage} gRPC service")
        _stage_arguments(stage, p)
        p.set_defaults(func=_stage_main(stage))

    p = sub.add_parser("colocate", help="run the thinker, talker and code2wav gRPC services in one process "
                                        "(each on its own port, its GPU work on a stream of its priority)")
    _colocate_arguments(p)
    p.set_defaults(func=cmd_colocate)

    p = sub.add_parser("make-tiny", help="write a tiny random-weight checkpoint in the released format")
    from voxpipe.tiny import add_arguments as tiny_args, run as tiny_run

    tiny_args(p)
    p.set_defaults(func=tiny_run)

    p = sub.add_parser("up", help="start the three services and the gateway locally (tiny checkpoint by default)")
    p.add_argument("--model", help="checkpoint folder or Hugging Face repo id (Org/Name[@REV]: fetched once, "
                                   "HF_HUB_OFFLINE=1: from the cache only; default: the tiny checkpoint, made on "
                                   "first use)")
    p.add_argument("--host", default=default_host(), help=HOST_HELP + " -- every service of the stack")
    p.add_argument("--base-port", type=port_number, default=50051,
                   help="thinker port; the next processes (talker, code2wav, or their replicas) count up from it")
    p.add_argument("--device", default="auto", help="the device of stages --devices does not name (auto: cuda if present)")
    p.add_argument("--devices", default="", metavar="LAYOUT",
                   help="replicas and devices per stage, e.g. thinker=cuda:0,talker=cuda:1+cuda:2,code2wav=cuda:1*2 "
                        "(DEV*N: N replicas sharing DEV; +: one device per replica)")
    p.add_argument("--mps-sm-percent", default="", metavar="SHARES", help=MPS_SM_HELP)
    p.add_argument("--mps-priority", default="", metavar="PRIORITIES", help=MPS_PRIORITY_HELP)
    p.add_argument("--colocate", action="store_true", help=COLOCATE_HELP + " (`voxpipe colocate`)")
    p.add_argument("--colocate-priority", default="", metavar="PRIORITIES", help=COLOCATE_PRIORITY_HELP)
    p.add_argument("--http-port", type=port_number, default=8000,
                   help="the gateway's OpenAI HTTP API port (0: no gateway; none with --say)")
    g = p.add_argument_group("passed on to the gateway")
    g.add_argument("--api-key", default=None,
                   help="the gateway requires 'Authorization: Bearer KEY' (HTTP, WebSocket, Converse); handed over "
                        "in its environment, not on its command line (default: $VOXPIPE_API_KEY; unset: no auth)")
    g.add_argument("--grpc-port", type=port_number, default=0, help="the gateway serves the Converse gRPC API here (0: off)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: --model's repo id, or the checkpoint folder name)")
    g.add_argument("--max-sessions", type=int, default=None,
                   help="concurrent generations, realtime and Converse sessions before 429 (default: the gateway's)")
    g.add_argument("--gateway-arg", action="append", metavar="FLAG",
                   help="one more gateway flag, as written (repeatable; e.g. --gateway-arg=--max-body-mb=64)")
    g = p.add_argument_group("passed on to every stage")
    g.add_argument("--metrics-base-port", type=port_number, default=0,
                   help="the stages serve Prometheus /metrics: the thinker on this port, the next processes "
                        "(talker, code2wav, or their replicas) counting up from it (0: off; the gateway's is its "
                        "HTTP port's /metrics)")
    g.add_argument("--max-batch", type=int, default=0, help="streams each stage engine runs at once "
                                                            "(default: the stages' own)")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: full-size random weights built on the device from config.json")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the stages' weight and activation dtype (auto: bfloat16 on CUDA, float32 on CPU)")
    g.add_argument("--deterministic", action="store_true",
                   help="every stage in batch-invariant mode: a request's output bits do not depend on its batch")
    g.add_argument("--stage-arg", action="append", metavar="FLAG",
                   help="one more flag of every stage, as written (repeatable; e.g. --stage-arg=--max-len=8192)")
    p.add_argument("--reflection", action=argparse.BooleanOptionalAction, default=True,
                   help="gRPC server reflection on every stage and the Converse port (the commands' own default is off)")
    p.add_argument("--say", metavar="TEXT", help="speak TEXT through the stack, write -o, then stop everything")
    _add_say_options(p)
    add_server_tls_arguments(p)
    add_client_tls_arguments(p, who="the stages (by each other, the gateway and --say)")
    g = p.add_argument_group("TLS (the gateway)")
    g.add_argument("--ssl-certfile", default=None, help="PEM certificate chain: the gateway serves HTTPS, WSS")
    g.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    from voxpipe.gateway.server import add_cors_argument

    add_cors_argument(p)
    p.set_defaults(func=cmd_up)

    p = sub.add_parser("say", help="speak a reply to TEXT (with --verbatim: TEXT itself) through running "
                                        "services into a wav")
    p.add_argument("text", help="the user's turn (with --verbatim: what is spoken)")
    p.add_argument("--model", help="checkpoint folder, only for --audio / --render-locally (default: the tiny "
                                   "checkpoint); otherwise the thinker renders the text with its own")
    p.add_argument("--thinker", default="127.0.0.1:50051", help="the thinker replicas (it picks the talker)")
    p.add_argument("--code2wav", default="127.0.0.1:50053",
                   help="the code2wav replicas audio is read from (the talkers' --code2wav set)")
    _add_say_options(p)
    add_client_tls_arguments(p, who="the thinker and code2wav")
    p.set_defaults(func=cmd_say)

    p = sub.add_parser("bench", help="benchmark split / in-process voxpipe against transformers (bench/BENCHMARK.md)")
    if only in (None, "bench"):       # the flags alone: the harness (client, torch) loads when the bench runs
        from voxpipe.bench.flags import add_arguments as bench_args

        bench_args(p)
        p.set_defaults(func=_bench_run)

    p = sub.add_parser("gateway", help="run the OpenAI-compatible gateway in front of the three services")
    from voxpipe.gateway.server import add_arguments as gateway_args, run as gateway_run

    gateway_args(p)
    p.set_defaults(func=gateway_run)

    p = sub.add_parser("health", help="check a service's grpc.health.v1 status (exit 0 when SERVING)")
    p.add_argument("address", nargs="?", metavar="ADDR",
                   help="host:port of a stage or of the gateway's Converse port (default: try localhost:50051..50053)")
    p.add_argument("--addr", help="the same as ADDR")
    p.add_argument("--service", default="", help="the service name to ask about (default: the server as a whole)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    add_client_tls_arguments(p, who="the service")
    p.set_defaults(func=cmd_health)
    return parser


def _log_level(value: str) -> str:
    try:
        return level_name(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{e}; use one of {', '.join(LEVELS)}") from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(command_of(argv)).parse_args(argv)
    setup_logging(args.log_level, args.log_format)
    try:
        rc = args.func(args)
    except ConfigError as e:      # one line, in the log format; the traceback only at --log-level debug
        logging.getLogger("voxpipe").error("voxpipe %s: error: %s", args.command, e,
                                           exc_info=e if args.log_level == "DEBUG" else None)
        return e.exit_code
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
