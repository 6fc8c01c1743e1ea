"""`voxpipe colocate`: the thinker, talker and code2wav in one process, on one device.

Each stage is still its own gRPC service: its own server on its own port, its own health service,
its /metrics port (its own series only), its spans (service voxpipe-STAGE), its flags parsed as
`voxpipe STAGE` parses them; the stages still call each other over gRPC on localhost. What one
process changes is the GPU: one CUDA context instead of three (no MPS), and each stage's engine
thread runs its steps -- eager kernels and graph replays -- on a CUDA stream of its own priority
(`--colocate-priority`: talker and code2wav high, thinker low by default), so that the GPU schedules
a talker step's kernels ahead of a thinker prefill's waiting ones. A graph replays on the stream it
is launched on (and is captured on its stage's stream too: `cuda_graphs.capture_stream`).

Memory: the caching allocator's cap is per process, so it is set once, to the sum of the stages'
--gpu-memory-fraction (stages without one get their `voxpipe up` share, voxpipe.layout.memory_shares);
the stages are built one after the other, and each sizes its KV pool from its own share less what
it reserved itself (`Colocation.memory_baseline`: what the stages built before it hold is not counted
again). On the CPU there are no streams: three servers in one process, which the log says.

Failure: a stage that stops (a device error, a server that cannot start) stops the process, the
others drained, with a CRITICAL log line naming it and exit status 1; SIGTERM / SIGINT drain all
three at once."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from voxpipe.errors import ConfigError
from voxpipe.layout import STAGES, Layout, memory_shares

from . import metrics, tracing
from .listen import check_free
from .server import StageServicer, run_async, run_server, server_options
from .weights import resolve_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Colocation:
    """What a stage built beside the others in one process is given (its args' `colocation`)."""

    stage: str
    stream: "torch.cuda.Stream | None"   # its engine's stream on CUDA (its priority); None off CUDA
    memory_baseline: int                 # bytes the caching allocator held on its device before its build


def stream_priority(level: str) -> int:
    """The CUDA stream priority of a --colocate-priority level (lower numbers run first)."""
    least, greatest = torch.cuda.Stream.priority_range()
    return greatest if level == "high" else least


@dataclass
class _Stage:
    name: str
    args: Any
    servicer: StageServicer | None = None
    add_to_server: Callable[[Any, grpc.aio.Server], None] | None = None
    service_name: str = ""


def _parts(stage: str) -> tuple[Callable[[Any], StageServicer], Callable[[Any, grpc.aio.Server], None], str]:
    """A stage's build, its servicer's add-to-server and its gRPC service name."""
    if stage == "thinker":
        from voxpipe.services.thinker import server
        from voxpipe.v1 import stages_pb2_grpc as pb_grpc

        return (lambda a: server.build(a)[0]), pb_grpc.add_ThinkerServicer_to_server, "voxpipe.v1.Thinker"
    if stage == "talker":
        from voxpipe.services.talker import server
        from voxpipe.v1 import stages_pb2_grpc as pb_grpc

        return server.build, pb_grpc.add_TalkerServicer_to_server, "voxpipe.v1.Talker"
    from voxpipe.services.code2wav import server
    from voxpipe.v1 import stages_pb2_grpc as pb_grpc

    return server.build, pb_grpc.add_Code2WavServicer_to_server, "voxpipe.v1.Code2Wav"


def check_stages(stage_args: dict[str, Any]) -> None:
    """Before anything is built: every stage given, each port (gRPC, health, metrics) used once and
    free; ConfigError naming the stage otherwise."""
    missing = [s for s in STAGES if s not in stage_args]
    if missing:
        raise ConfigError(f"colocate: no flags for {', '.join(missing)} (--{missing[0]}-flags)")
    seen: dict[int, str] = {}
    for stage, args in stage_args.items():
        opts = server_options(args)
        for what, port, flag in (("gRPC", opts.port, "--port"), ("health", opts.health_port, "--health-port"),
                                 ("metrics", opts.metrics_port, "--metrics-port")):
            if not port:
                continue
            if port in seen:
                raise ConfigError(f"colocate: {stage} {flag} {port} is also {seen[port]}'s")
            seen[port] = f"{stage} {flag}"
            check_free(f"{stage} {what}", opts.host, port, f"--{stage}-flags' {flag}")


def memory_fractions(stage_args: dict[str, Any]) -> dict[str, float]:
    """Per stage on CUDA, its share of its GPU (--gpu-memory-fraction, else `voxpipe up`'s share for
    the three on one GPU); ConfigError when the shares of one GPU add up to more than 1."""
    devices = {s: resolve_device(a.device) for s, a in stage_args.items()}
    on_cuda = {s: d for s, d in devices.items() if d.type == "cuda"}
    if not on_cuda:
        return {}
    key = {s: d.index if d.index is not None else torch.cuda.current_device() for s, d in on_cuda.items()}
    shares = memory_shares(Layout({s: (f"cuda:{key[s]}",) if s in key else ("cpu",) for s in STAGES}))
    out = {s: stage_args[s].gpu_memory_fraction or shares.get(s, 0.9) for s in on_cuda}
    for index in set(key.values()):
        total = sum(f for s, f in out.items() if key[s] == index)
        if total > 1.0 + 1e-6:
            raise ConfigError(f"colocate: the stages' --gpu-memory-fraction on cuda:{index} add up to {total:.2f} "
                              f"(more than the GPU): {', '.join(f'{s} {f:g}' for s, f in out.items())}")
    return out


def build_stages(stage_args: dict[str, Any], priorities: dict[str, str]) -> list[_Stage]:
    """The three servicers, built one after the other (thinker, talker, code2wav), each on its own
    stream on CUDA, each sizing its memory from its own share (module docstring)."""
    check_stages(stage_args)
    fractions = memory_fractions(stage_args)
    caps: dict[int, float] = {}
    stages = []
    for name in STAGES:
        args = stage_args[name]
        device = resolve_device(args.device)
        stream, baseline = None, 0
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            args.gpu_memory_fraction = fractions[name]
            caps[index] = caps.get(index, 0.0) + fractions[name]
            torch.cuda.set_per_process_memory_fraction(min(1.0, caps[index]), index)
            with torch.cuda.device(index):
                stream = torch.cuda.Stream(priority=stream_priority(priorities[name]))
            # the earlier stages' cached free blocks go back first: an empty_cache during this build (each
            # graph capture's, the allocator's before an OOM) would otherwise take them out of the
            # baseline and so out of what this stage counts as its own (kv_plan: too large a KV pool)
            torch.cuda.empty_cache()
            baseline = torch.cuda.memory_reserved(index)
        args.colocation = Colocation(name, stream, baseline)
        build, add_to_server, service_name = _parts(name)
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                servicer = build(args)
        except Exception as e:
            log.critical("colocate: building the %s failed (%s); nothing serves", name, e)
            for built in stages:
                built.servicer.engine.stop()
            raise
        if stream is not None:
            used = torch.cuda.memory_reserved(stream.device) - baseline
            log.info("colocate: %s built on %s, stream priority %d (%s), %.2f GiB reserved by it, share %.3f",
                     name, device, stream.priority, priorities[name], used / 2**30, fractions[name])
        else:
            log.info("colocate: %s built on %s", name, device)
        servicer.engine.stream = stream
        stages.append(_Stage(name, args, servicer, add_to_server, service_name))
    if all(s.servicer.engine.stream is None for s in stages):
        log.info("colocate: thinker, talker and code2wav in one process, no CUDA device: the stream "
                 "priorities (%s) apply on CUDA only", ", ".join(f"{s}={priorities[s]}" for s in STAGES))
    return stages


class StageFailed(Exception):
    """A colocated stage stopped (its server could not start, or its engine hit a device error)."""


async def serve_stages(stages: list[_Stage], ready: Callable[[str, int], None] | None = None) -> None:
    """Serve every stage until SIGTERM / SIGINT, then drain all of them together. A stage that stops
    on its own stops the others (drained) and raises StageFailed naming it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass

    def serve(stage: _Stage) -> asyncio.Future:
        return asyncio.ensure_future(run_server(
            stage.servicer, stage.add_to_server, stage.service_name, stage.servicer.opts,
            ready=None if ready is None else (lambda port, name=stage.name: ready(name, port)),
            stop=stop, metrics_registry=metrics.stage_registry(stage.name)))

    tasks = {serve(s): s.name for s in stages}
    failed: list[tuple[str, BaseException | None]] = []
    pending = set(tasks)
    while pending:
        done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            exc = task.exception()
            if exc is None and stop.is_set():
                continue
            name = tasks[task]
            others = [tasks[t] for t in pending]
            log.critical("colocate: the %s stage stopped (%s); %s", name, exc or "its server ended",
                         f"stopping {' and '.join(others)}" if others else "stopping")
            failed.append((name, exc))
            stop.set()
    if failed:
        name, exc = failed[0]
        raise StageFailed(f"the {name} stage stopped: {exc or 'its server ended'}")


def run(stage_args: dict[str, Any], priorities: dict[str, str]) -> int:
    """Build the three stages, serve them until SIGTERM; 1 when a stage stopped on its own."""
    for stage in STAGES:
        tracing.setup_stage_tracing(stage)
    stages = build_stages(stage_args, priorities)
    gc.freeze()      # what the imports and the builds made lives as long as the process (serve_stage)
    gc.enable()

    def ready(stage: str, port: int) -> None:
        print(f"{stage} ready on port {port}", flush=True)

    try:
        run_async(serve_stages(stages, ready))
    except StageFailed as e:
        log.critical("colocate: %s; the process exits", e)
        return 1
    return 0
