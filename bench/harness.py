"""`voxpipe bench`: bench/BENCHMARK.md's workloads against voxpipe end to end (the gateway's OpenAI chat API
streamed with the `openai` SDK, or its realtime WebSocket; services behind it over loopback gRPC),
split (the same three services driven by the gRPC pipeline client) and in-process (the same engines
in one process, no gRPC), with transformers' reference measured in the same run. Several workloads
run against one start of the services. Prints, per workload, one table of client-side metrics and
one of server-side means per stage (from the services' Prometheus metrics), and writes JSON +
markdown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from . import conversation, live, live_plot, realtime_session, server_stats, trace_path
from .flags import MODES, add_arguments  # noqa: F401  (add_arguments: `voxpipe bench`'s flags)
from .report import ReferenceRun, section
from .requests import RequestMaker
from .workload import WORKLOADS, LevelResult, Workload, run_level
from voxpipe import module_command
from voxpipe.layout import (MPS_PRIORITIES, Layout, LayoutError, colocate_spec, mps_env, parse_mps_priorities,
                            parse_sm_shares)

PRIORITY_NAMES = {level: name for name, level in MPS_PRIORITIES.items()}

STAGES = ("thinker", "talker", "code2wav")


def workloads_from(args) -> list[Workload]:
    """The named workloads with any of --prompt-tokens / --text-tokens / --frames / --realtime-audio applied."""
    return [WORKLOADS[n].with_overrides(args.prompt_tokens, args.text_tokens, args.frames, args.realtime_audio,
                                        args.temperature, realtime_pace=args.realtime_pace) for n in args.workload]


def levels_of(args, wl: Workload) -> list[int]:
    return list(args.concurrency) or list(wl.levels)


@dataclass(frozen=True)
class Plan:
    """What one run does: each workload with the client modes it runs in, and a note for every asked
    mode it skips."""

    workloads: list[Workload]
    modes: dict[str, list[str]]        # workload name -> modes
    notes: dict[str, list[str]]        # workload name -> lines for the report
    layout: Layout                     # replicas and devices per stage (--devices, --device)
    sm_shares: dict[str, int]          # stage -> percent of the SMs under MPS (--mps-sm-percent)
    mps_priorities: dict[str, int]     # stage -> client priority under MPS (--mps-priority; 1: below normal)
    trace: bool = False                # --trace: the services' spans, each level's request path
    thinker_replicas: tuple[int, ...] = ()    # --thinker-replicas: one start of the services per count
    colocate: dict[str, str] | None = None    # --colocate: stage -> stream priority (None: separate processes)

    @classmethod
    def of(cls, args) -> "Plan":
        wls = workloads_from(args)
        modes, notes = {}, {}
        for wl in wls:
            modes[wl.name] = wl.modes(args.modes)
            skipped = [m for m in args.modes if m not in modes[wl.name]]
            whose = "the live sessions' clients are" if wl.live else "the realtime WebSocket is"
            only = "split" if wl.conversation else "gateway"
            why = ("its history travels as token ids through the pipeline client" if wl.conversation
                   else f"{whose} the gateway's")
            notes[wl.name] = [f"not run in mode {', '.join(skipped)}: {why}"] if skipped else []
            if not modes[wl.name]:
                raise SystemExit(f"--workload {wl.name} runs only in {only} mode; add {only} to --modes")
            if wl.temperature:
                notes[wl.name].append("the transformers reference runs greedy (its cost per token and frame is "
                                      "that of sampling but for the draws)")
        from voxpipe.cli import colocate_of

        try:
            layout = Layout.parse(args.devices, args.device)
            shares = parse_sm_shares(args.mps_sm_percent)
            priorities = parse_mps_priorities(args.mps_priority)
            colocate = colocate_of(args, layout)
        except LayoutError as e:
            raise SystemExit(str(e)) from None
        if colocate is not None and (args.mps or args.ablation or args.thinker_replicas):
            raise SystemExit("--colocate runs the three stages in one process: not with --mps (one process needs "
                             "no MPS), --ablation or --thinker-replicas")
        if shares and not args.mps:
            raise SystemExit("--mps-sm-percent limits the stages' share of the SMs under CUDA MPS: add --mps")
        if priorities and not args.mps:
            raise SystemExit("--mps-priority sets the stages' client priority under CUDA MPS: add --mps")
        if args.trace and "gateway" not in args.modes:
            raise SystemExit("--trace follows requests from the gateway's spans: add gateway to --modes")
        if not layout.single and "inprocess" in args.modes:
            raise SystemExit(f"--devices {args.devices}: replicas need separate processes (modes split, gateway); "
                             f"inprocess runs one engine per stage: leave it out of --modes")
        if any(w.sessions for w in wls) and args.turns < 1:
            raise SystemExit(f"--turns must be at least 1, got {args.turns}")
        counts = tuple(dict.fromkeys(args.thinker_replicas))
        if counts:
            if "inprocess" in args.modes or args.ablation:
                raise SystemExit("--thinker-replicas starts the services once per count (modes split, gateway): "
                                 "leave inprocess out of --modes and --ablation off")
            if any(w.live for w in wls):
                raise SystemExit("--thinker-replicas compares conversation workloads; the live workload searches "
                                 "a capacity: run it on its own --devices")
            try:
                for n in counts:
                    layout.with_replicas("thinker", n)
            except LayoutError as e:
                raise SystemExit(f"--thinker-replicas: {e}") from None
        return cls(wls, modes, notes, layout, shares, priorities, args.trace, counts, colocate)

    def split_only(self, wl: Workload) -> "Plan":
        """This plan's layout and MPS settings for one workload in split mode alone (--ablation's levels)."""
        return replace(self, workloads=[wl], modes={wl.name: ["split"]}, notes={wl.name: []}, thinker_replicas=())

    def per_thinker_count(self) -> list["Plan"]:
        """The plan once per --thinker-replicas count (its layout with that many thinkers), or itself."""
        return [replace(self, layout=self.layout.with_replicas("thinker", n)) for n in self.thinker_replicas] or [self]

    def wants(self, mode: str) -> bool:
        return any(mode in m for m in self.modes.values())

    def needs_sdk(self) -> bool:
        return any("gateway" in self.modes[w.name] and (not w.realtime or w.live) for w in self.workloads)

    def needs_websockets(self) -> bool:
        return any("gateway" in self.modes[w.name] and (w.realtime or w.live) for w in self.workloads)


def check_packages(plan: Plan) -> None:
    """The packages the asked gateway workloads need in this process (the clients) and in the gateway
    it starts (same environment): on the GPU machine they come as wheels (bench/device.sh)."""
    need = ["fastapi", "uvicorn"] if plan.wants("gateway") else []
    need += ["openai"] if plan.needs_sdk() else []
    need += ["websockets", "silero_vad"] if plan.needs_websockets() else []
    need += ["soundfile"] if any(w.voice and "gateway" in plan.modes[w.name] for w in plan.workloads) else []
    need += ["opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc"] if plan.trace else []
    missing = [name for name in need if _missing(name)]
    if missing:
        raise SystemExit(f"gateway mode of {', '.join(w.name for w in plan.workloads)} needs the Python packages "
                         f"{', '.join(missing)}: pip install them (on the GPU machine: carry their wheels in .whl/, "
                         f"see bench/device.sh)")


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except ModuleNotFoundError:      # a dotted name whose parent package is missing
        return True


def copy_bandwidth(device: str) -> float:
    import torch

    if not device.startswith("cuda"):
        return float("nan")
    n = 1 << 30  # 1 GiB x 2 bytes
    a = torch.empty(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    torch.cuda.synchronize()
    bw = 10 * 2 * a.numel() * a.element_size() / (time.perf_counter() - t)
    del a, b
    torch.cuda.empty_cache()
    return bw


def active_bytes(cfg) -> dict[str, float]:
    """Bytes of weights read per thinker token and per talker frame at batch 1 (bf16)."""
    def attn(d):
        return d.hidden_size * d.head_dim * (2 * d.num_heads + 2 * d.num_kv_heads)

    def moe(d):
        routed = d.experts_per_token * 3 * d.hidden_size * d.moe_intermediate_size
        shared = 3 * d.hidden_size * d.shared_expert_size + d.hidden_size if d.shared_expert_size else 0
        return routed + shared + d.num_experts * d.hidden_size

    th = cfg.thinker.text
    thinker = th.num_layers * (attn(th) + moe(th)) + th.vocab_size * th.hidden_size
    tk, cp = cfg.talker.text, cfg.talker.code_predictor
    talker_step = tk.num_layers * (attn(tk) + moe(tk)) + tk.vocab_size * tk.hidden_size
    pred_pass = cp.num_layers * (attn(cp) + 3 * cp.hidden_size * cp.intermediate_size) + cp.vocab_size * cp.hidden_size
    return {"thinker_token": 2.0 * thinker, "talker_frame": 2.0 * (talker_step + (cfg.talker.num_code_groups - 1) * pred_pass)}


def gpu_memory_by_pid() -> dict[int, float]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    mem = {}
    for line in out.strip().splitlines():
        pid, used = (x.strip() for x in line.split(","))
        mem[int(pid)] = float(used) / 1024.0
    return mem


async def _levels(stream_fn, make_request, args, wl: Workload, mode: str, scrape,
                  spans=None) -> list[LevelResult]:
    """Run each concurrency level; the server columns come from `scrape` plus this process's own
    metrics, where the "client" row's event-loop lag is this driver's loop (in split mode: the
    pipeline client relaying every row, frame and audio chunk; in-process: all three engines'
    handlers) and the "gateway" row's the gateway's (the relay in gateway mode)."""
    from voxpipe.services.runtime.metrics import LOOP_LAG, watch_loop_lag

    out = []
    lag = asyncio.ensure_future(watch_loop_lag(LOOP_LAG.labels("client").observe))
    try:
        for c in levels_of(args, wl):
            out.append(await _level(stream_fn, make_request, args, wl, mode, scrape, c, spans))
    finally:
        lag.cancel()
    return out


async def _level(stream_fn, make_request, args, wl: Workload, mode: str, scrape, c: int,
                 spans=None) -> LevelResult:
    """`spans`: the bench's SpanReceiver (--trace): the level's measured requests' path through the services."""
    n = args.requests or (max(8, 2 * c) if args.quick else max(20, 5 * c))
    warm = min(args.warmup, 2) if args.quick else args.warmup
    marks = {}

    async def warmed() -> None:     # the server columns count the measured requests only, not the warm-ups
        marks["before"] = server_stats.parse(await asyncio.to_thread(scrape))
        marks["since_ns"] = time.time_ns()

    records, wall = await run_level(stream_fn, make_request, c, n, warm if c == 1 else min(warm, c), warmed)
    until_ns = time.time_ns()
    before = marks["before"]
    after = server_stats.parse(await asyncio.to_thread(scrape))
    res = LevelResult.of(mode, c, records, wall, workload=wl.name)
    res.server = server_stats.level_stats(before, after, STAGES + ("gateway", "client"))
    if spans is not None and mode == "gateway":
        await asyncio.sleep(1.0)      # the services export their spans in batches (OTEL_BSP_SCHEDULE_DELAY)
        res.path = trace_path.path(spans.snapshot(), marks["since_ns"], until_ns)
    print(f"[{wl.name} / {mode}] c={c}: {res.req_per_s:.2f} req/s, TTFP p50 / p90 / p99 {res.ttfp_ms['p50']:.1f} / "
          f"{res.ttfp_ms['p90']:.1f} / {res.ttfp_ms['p99']:.1f} ms, RTF p50 {res.rtf['p50']:.3f}, "
          f"prompt {res.prompt_tokens:.0f} tokens, failed {res.failed}" + _streamed(res.server.get("thinker", {})) +
          (f" ({res.errors[0]})" if res.errors else ""), flush=True)
    return res


def _streamed(thinker: dict) -> str:
    """Streamed realtime turns: the share of their prompts, and of their clips' audio tokens, prefilled
    before the commit (server_stats.STREAMED)."""
    if "prefilled_before_commit" not in thinker:
        return ""
    return (f", prefilled before the commit {thinker['prefilled_before_commit']:.1%} of the prompt, "
            f"{thinker.get('audio_prefilled_before_commit', 0.0):.1%} of the clip's audio tokens")


def run_split(args, cfg, plan: Plan, makers: dict[str, RequestMaker], model: str) -> tuple[list[LevelResult], dict]:
    if args.mps:
        with mps_daemon():
            return _run_split(args, cfg, plan, makers, model)
    return _run_split(args, cfg, plan, makers, model)


@contextlib.contextmanager
def mps_daemon():
    """A private CUDA MPS control daemon (pipe/log dirs in a temp folder) for the services we start."""
    import tempfile

    tmp = tempfile.mkdtemp(prefix="voxpipe-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(tmp, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(tmp, "log")}
    for d in env.values():
        os.makedirs(d)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    subprocess.run(["nvidia-cuda-mps-control", "-d"], check=True)
    print("split: CUDA MPS daemon started", flush=True)
    try:
        yield
    finally:
        subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=30)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        print("split: CUDA MPS daemon stopped", flush=True)


# Optimization layers, added one at a time: (row label, service flags, environment, MPS)
LAYERS = (
    ("eager: continuous batching + streaming code2wav", "--no-cuda-graphs", {"VOXPIPE_GROUPED_MOE": "0", "VOXPIPE_KERNELS": "0"}, False),
    ("+ grouped-GEMM MoE", "--no-cuda-graphs", {"VOXPIPE_GROUPED_MOE": "1", "VOXPIPE_KERNELS": "0"}, False),
    ("+ CUDA graphs (prefills, decode, talker step, predictor loop, code2wav frames)", "", {"VOXPIPE_GROUPED_MOE": "1", "VOXPIPE_KERNELS": "0"}, False),
    ("+ Triton kernels (RMSNorm, add+RMSNorm, q/k norm + RoPE, MoE routing, SnakeBeta) + fused q/k/v and gate/up GEMMs", "", {"VOXPIPE_GROUPED_MOE": "1", "VOXPIPE_KERNELS": "1"}, False),
    ("+ CUDA MPS for the three processes", "", {"VOXPIPE_GROUPED_MOE": "1", "VOXPIPE_KERNELS": "1"}, True),
)


def run_ablation(args, cfg, plan: Plan, makers: dict[str, RequestMaker], model: str) -> list[LevelResult]:
    """One split-mode level (pipeline client) of the first workload per row of LAYERS (the environment
    is inherited by the services)."""
    out = []
    wl = plan.workloads[0]
    if "split" not in wl.modes(["split"]):
        raise SystemExit(f"--ablation runs in split mode, which workload {wl.name} has not")
    level = levels_of(args, wl)[:1]
    one = plan.split_only(wl)
    for label, flags, env, mps in LAYERS:
        if mps and not args.device.startswith("cuda"):
            continue
        layer_args = argparse.Namespace(**{**vars(args), "extra": (args.extra + " " + flags).strip(), "mps": mps,
                                           "concurrency": level})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            res, _ = run_split(layer_args, cfg, one, makers, model)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        for r in res:
            r.mode = label
        out += res
    return out


def _run_split(args, cfg, plan: Plan, makers: dict[str, RequestMaker], model: str) -> tuple[list[LevelResult], dict]:
    """The three services (and the gateway for mode `gateway`) started once; each workload runs its
    levels in each of its client modes against them in turn."""
    from voxpipe.cli import LocalStack
    from voxpipe.client import PipelineClient

    from .gateway_client import GatewayStream
    from .realtime_client import RealtimeStream

    extra = ["--load-format", args.load_format, "--max-batch", str(args.max_batch)] + args.extra.split()
    names = [name for name, _, _ in plan.layout.processes()]
    metrics_ports = {name: args.base_port + 100 + i for i, name in enumerate(names)}
    http_port = args.base_port + 99 if plan.wants("gateway") else 0
    spans = trace_path.SpanReceiver() if plan.trace else None
    stage_env = mps_env(plan.sm_shares, plan.mps_priorities)
    if spans is not None:
        stage_env = {stage: {**stage_env.get(stage, {}), **spans.env(stage)} for stage in STAGES}
    stack = LocalStack(Path(model), "127.0.0.1", args.base_port, args.device, extra=extra,
                       metrics_ports=metrics_ports, http_port=http_port, layout=plan.layout,
                       stage_env=stage_env, gateway_env=spans.env("gateway") if spans is not None else None,
                       gateway_extra=list(args.gateway_arg), stage_extra=stage_args(args), colocate=plan.colocate)
    pages = dict(metrics_ports, **({"gateway": http_port} if http_port else {}))   # the gateway's GET /metrics too
    scrape = server_stats.combined(server_stats.http_source(pages), server_stats.registry_source())

    def thinker_counts() -> dict[str, dict]:     # per thinker replica: streams, prefix tokens looked up and found
        return {name: server_stats.thinker_counts(server_stats.http_source({name: port})())
                for name, port in metrics_ports.items() if stack.stage_of[name] == "thinker"}
    t0 = time.perf_counter()
    print(f"split: starting the stage services ({plan.layout.describe()}"
          + (f"; in one process, stream priorities {colocate_spec(plan.colocate)})" if plan.colocate else ")")
          + (" and the gateway" if http_port else ""),
          flush=True)
    stack.start(timeout=300)
    print(f"split: services ready after {time.perf_counter() - t0:.1f} s", flush=True)
    info = {"startup_s": time.perf_counter() - t0}
    mem = gpu_memory_by_pid()
    info["gpu_mem_gb"] = {name: mem.get(stack.pid(name)) for name in names}     # colocated: one process's, each
    base_url = f"http://127.0.0.1:{http_port}"
    try:
        async def go():
            out = []
            for wl in plan.workloads:
                maker = makers[wl.name]
                for mode in plan.modes[wl.name]:
                    if wl.live:
                        info["live"] = await run_live(args, wl, maker, base_url, _served_model(http_port), plan)
                    elif mode == "gateway" and wl.sessions:
                        info["realtime_conversation"] = await realtime_session.run(
                            base_url, _served_model(http_port), maker.realtime(0).audio_pcm16,
                            realtime_session.Settings(args.turns, wl.realtime_pace, wl.text_tokens, wl.frames,
                                                      wl.speaker, warmup=args.warmup > 0),
                            levels_of(args, wl), scrape, thinker_counts)
                    elif mode == "gateway" and wl.realtime:
                        client = RealtimeStream(base_url, _served_model(http_port), pace=wl.realtime_pace)
                        out += await _levels(client, maker.realtime, args, wl, mode, scrape, spans)
                    elif mode == "gateway":
                        client = GatewayStream(base_url + "/v1", _served_model(http_port))
                        try:
                            out += await _levels(client, maker.chat, args, wl, mode, scrape, spans)
                        finally:
                            await client.close()
                    elif mode == "split" and wl.conversation:
                        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
                            info["conversation"] = await conversation.run(
                                client.stream, cfg, conversation.Settings.of(args, wl.text_tokens, wl.frames),
                                levels_of(args, wl), maker.turn_audio if wl.voice else None, scrape)
                    elif mode == "split":
                        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
                            out += await _levels(client.stream, maker.speech, args, wl, mode, scrape)
            return out
        results = asyncio.run(go())
        # how the balancers spread the work: streams each process finished (the replicas of a stage)
        info["streams_by_process"] = {name: server_stats.streams_finished(
            server_stats.http_source({name: port})(), stack.stage_of[name]) for name, port in metrics_ports.items()}
        return results, info
    finally:
        stack.stop()
        if spans is not None:
            spans.close()


async def run_live(args, wl: Workload, maker: RequestMaker, base_url: str, model: str, plan: Plan) -> dict:
    """The live workload's capacity search through each of --live-clients, one after the other."""
    from .gateway_client import GatewayStream
    from .realtime_client import RealtimeStream

    settings = live.Settings.of(args, wl)
    runs = []
    for client in settings.clients:
        if client == "realtime":
            runs.append(await live.run_client(client, RealtimeStream(base_url, model, pace=wl.realtime_pace),
                                              maker.realtime, settings))
            continue
        sse = GatewayStream(base_url + "/v1", model)
        try:
            runs.append(await live.run_client(client, sse, maker.chat, settings))
        finally:
            await sse.close()
    return live.report(runs, settings, plan.layout.describe(), wl)


def write_live(out: Path, report: dict) -> None:
    """The live workload's JSON report and its plot under --out (live.json, live.png)."""
    (out / "live.json").write_text(json.dumps(report, indent=1))
    print(live_plot.draw_or_say([report], out / "live.png"), flush=True)


def _served_model(http_port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def stage_args(args) -> dict[str, list[str]]:
    """The flags given for one stage alone (--thinker-arg, --talker-arg, --code2wav-arg), by stage: after
    every other flag of that stage, so they win over the bench's own (e.g. its memory shares)."""
    return {"thinker": list(args.thinker_arg), "talker": list(args.talker_arg), "code2wav": list(args.code2wav_arg)}


def inprocess_memory_flags(layout, argv: list[str]) -> dict[str, list[str]]:
    """The stages' memory flags in one process: the caching allocator's cap is per process (each stage
    sets it as it is built, the thinker first: the talker and code2wav lift it to SHARED_GPU_MEMORY),
    while the thinker sizes its KV pool from its own share of a GPU it shares with the others
    (voxpipe.layout.memory_shares); none when a flag says otherwise."""
    from voxpipe.layout import SHARED_GPU_MEMORY, memory_shares

    if any(a.startswith(("--gpu-memory-fraction", "--kv-cache-tokens")) for a in argv):
        return {}
    shares = memory_shares(layout)
    if "thinker" not in shares:
        return {}
    rest = [f"--gpu-memory-fraction={SHARED_GPU_MEMORY}"]
    return {"thinker": [f"--gpu-memory-fraction={shares['thinker']}"], "talker": rest, "code2wav": rest}


def run_inprocess(args, plan: Plan, makers: dict[str, RequestMaker], model: str) -> list[LevelResult]:
    from .inprocess import InProcessPipeline

    argv = ["--model", model, "--device", args.device, "--load-format", args.load_format,
            "--max-batch", str(args.max_batch)] + args.extra.split()

    async def go():
        print("inprocess: building the engines", flush=True)
        devices = {s: ds[0] for s, ds in plan.layout.devices.items()}
        stage_argv = inprocess_memory_flags(plan.layout, argv)
        for stage, flags in stage_args(args).items():
            stage_argv[stage] = stage_argv.get(stage, []) + flags
        pipe = InProcessPipeline.from_argv(argv, devices, stage_argv=stage_argv)
        out = []
        try:
            for wl in plan.workloads:
                if "inprocess" in plan.modes[wl.name]:
                    out += await _levels(pipe.stream, makers[wl.name].speech, args, wl, "inprocess",
                                         server_stats.registry_source())
            return out
        finally:
            pipe.close()
    return asyncio.run(go())


def _reference_key(wl: Workload) -> tuple:
    """Workloads with the same model work share one reference run (the transport is not its business)."""
    return (wl.voice, wl.voice_text, 0 if wl.voice else wl.prompt_tokens, wl.text_tokens, wl.frames, wl.speaker)


def run_references(args, plan: Plan, model: str) -> dict[str, ReferenceRun]:
    """transformers' generate at c=1 for each workload, in its own process, before voxpipe starts;
    workloads with the same model work share one run."""
    out: dict[str, ReferenceRun] = {}
    done: dict[tuple, str] = {}
    for wl in plan.workloads:
        if wl.live:
            out[wl.name] = ReferenceRun(None, "the live workload measures the served stack's capacity")
            continue
        if wl.sessions:
            out[wl.name] = ReferenceRun(None, "realtime sessions measure served turns from the end of speech; a "
                                        "first turn's model work is realtime --realtime-audio's")
            continue
        transport = "; no realtime transport in it" if wl.realtime else ""
        first = done.get(_reference_key(wl))
        if first is not None:
            ref = out[first]
            out[wl.name] = ReferenceRun(ref.result, f"the same model work as {first}'s (run once){transport}"
                                        if ref.result else ref.note)
            continue
        print(f"transformers reference ({wl.name}): starting", flush=True)
        cmd = [*module_command("voxpipe.bench.reference"), "--model", model, "--device", args.device,
               "--workload", wl.name, "--prompt-tokens", str(wl.prompt_tokens), "--text-tokens", str(wl.text_tokens),
               "--frames", str(wl.frames)]
        cmd += (["--audio", args.audio] if args.audio else []) + (["--realtime-audio"] if args.realtime_audio else [])
        ref = _reference_process(cmd)
        if ref.result:
            ref = ReferenceRun(ref.result, transport[2:])
        print(f"transformers reference ({wl.name}): {ref.result or ref.note}", flush=True)
        out[wl.name] = ref
        done[_reference_key(wl)] = wl.name
    return out


def _reference_process(cmd: list[str], timeout: float = 420) -> ReferenceRun:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return ReferenceRun(None, f"did not finish in {timeout:.0f} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return ReferenceRun(json.loads(lines[-1]))
    print(proc.stderr[-2000:], flush=True)
    last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return ReferenceRun(None, f"failed (exit {proc.returncode}): {last}")


def make_requests(args, cfg, plan: Plan, model: str) -> dict[str, RequestMaker]:
    """One RequestMaker per workload (the tokenizer, and for voice workloads the clip and the
    model's feature extractor, loaded once)."""
    from voxpipe.services.thinker.prompt import FeatureExtractor

    from .voice_clip import load_clip

    tokenizer = load_tokenizer(model, cfg)
    voice = any(w.voice for w in plan.workloads)
    clip = load_clip(args.audio) if voice else None
    features = FeatureExtractor.for_model(model, cfg.thinker) if voice else None
    if clip is not None:
        print(f"voice clip: {clip.path}, {clip.seconds:.2f} s", flush=True)
    return {w.name: RequestMaker(w, cfg, tokenizer, clip, features) for w in plan.workloads}


def load_tokenizer(model: str, cfg):
    from voxpipe.services.thinker.prompt import load_tokenizer as load

    return load(model, cfg)


def prepare(args) -> tuple[Plan, "OmniConfig", str, dict[str, RequestMaker]]:
    """Everything checked and loaded before anything starts: the plan, the model's config and path,
    each workload's request maker. A bad flag or file raises SystemExit naming it."""
    from voxpipe.services.runtime.config import OmniConfig, released_config_path

    plan = Plan.of(args)
    if args.ablation and any(w.live for w in plan.workloads):
        raise SystemExit("--ablation runs closed-loop split levels; the live workload runs through the gateway")
    if not args.ablation:      # fail now, not after the reference and the service start-up
        check_packages(plan)
    model = args.model or str(released_config_path())
    cfg = OmniConfig.load(model)
    plan = replace(plan, workloads=[live.reply_sized(w, cfg, args.reply_seconds, args.frames, args.text_tokens)
                                    if w.live else w for w in plan.workloads])
    return plan, cfg, model, make_requests(args, cfg, plan, model)


def run(args) -> int:
    if args.deterministic and "--deterministic" not in args.extra.split():
        args.extra = (args.extra + " --deterministic").strip()      # every stage, split and in-process
    plan, cfg, model, makers = prepare(args)
    # the services and the gateway log at the bench's level (`voxpipe --log-level WARNING bench ...`)
    os.environ.setdefault("VOXPIPE_LOG_LEVEL", getattr(args, "log_level", None) or "INFO")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[1]
    commit = os.environ.get("VOXPIPE_COMMIT") or subprocess.run(
        ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    device_name = ""
    if args.device.startswith("cuda"):
        import torch

        device_name = torch.cuda.get_device_name(0)
    bw = copy_bandwidth(args.device)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    refs = run_references(args, plan, model) if args.reference else {}
    results: list[LevelResult] = []
    runs: list[dict] = []        # per start of the services: its thinker count, layout, and run_split's info
    if args.ablation:
        results += run_ablation(args, cfg, plan, makers, model)
    else:
        if plan.wants("split") or plan.wants("gateway"):
            for each in plan.per_thinker_count():
                res, info = run_split(args, cfg, each, makers, model)
                n = each.layout.replicas("thinker")
                if plan.thinker_replicas:        # each start's levels apart in the tables
                    for r in res:
                        r.mode = f"{r.mode}, {n} thinker{'s' if n > 1 else ''}"
                results += res
                runs.append({"thinker_replicas": n, "layout": each.layout.describe(), **info})
                print(f"split startup {info['startup_s']:.1f} s, GPU memory per service (GB): {info['gpu_mem_gb']}",
                      flush=True)
        if plan.wants("inprocess"):
            results += run_inprocess(args, plan, makers, model)
    nbytes = active_bytes(cfg)
    argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else sys.argv[1:]
    cmd = "voxpipe bench " + " ".join(argv)
    gpus = len(plan.layout.gpus)
    header = (f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · commit {commit} · {device_name or args.device}\n\n"
              f"`{cmd}` — layout: {plan.layout.describe()}"
              + (f" ({gpus} GPUs: req/s per GPU = req/s / {gpus})" if gpus > 1 else "")
              + (f"; started once per thinker count ({', '.join(map(str, plan.thinker_replicas))}): "
                 + "; ".join(p.layout.describe() for p in plan.per_thinker_count()) if plan.thinker_replicas else "")
              + (f"; SM shares under MPS: {', '.join(f'{s} {p}%' for s, p in plan.sm_shares.items())}"
                 if plan.sm_shares else "")
              + (f"; MPS client priority: {', '.join(f'{s} {PRIORITY_NAMES[p]}' for s, p in plan.mps_priorities.items())}"
                 if plan.mps_priorities else "")
              + (f"; colocated in one process, CUDA stream priorities {colocate_spec(plan.colocate)}"
                 if plan.colocate else "")
              + (f"; sampled at temperature {args.temperature:g}; " if args.temperature else "; greedy; ")
              + f"copy bandwidth {bw / 1e12:.2f} TB/s; "
              f"TTFP measured at the client: gateway = the openai SDK streaming chat completions (SSE) from the "
              f"gateway, or for realtime a WebSocket client from response.create to the first "
              f"response.output_audio.delta; split = the gRPC pipeline client calling the three services; "
              f"inprocess = the driver calling the engines. Voice prompts: the driver computes the clip's features "
              f"once for split / inprocess; the gateway decodes the wav and computes them per request.\n")
    live_report = runs[0].pop("live", None) if runs else None
    for r in runs:       # conversation.json, realtime_conversation.json (with --thinker-replicas: one per count)
        for key in SESSION_REPORTS:
            if r.get(key) is not None:
                tail = f"-{r['thinker_replicas']}-thinkers" if plan.thinker_replicas else ""
                (out / f"{key}{tail}.json").write_text(json.dumps(r[key], indent=1))
    sections = [live.section(live_report) if wl.live else
                session_sections(wl, runs) if wl.conversation or wl.sessions else
                section(wl, results, refs.get(wl.name) if args.reference else None, bw, nbytes, plan.notes[wl.name])
                for wl in plan.workloads]
    if plan.thinker_replicas:
        sections.append(replicas_section(runs))
    if live_report is not None:
        live_report.update(commit=commit, device=device_name or args.device, command=cmd)
        write_live(out, live_report)
    text = header + "\n" + "\n\n".join(sections) + "\n"
    print("\n" + text, flush=True)
    (out / "results.md").write_text(text)
    first = refs.get(plan.workloads[0].name)
    (out / "results.json").write_text(json.dumps({
        "commit": commit, "device": device_name, "command": cmd, "copy_bandwidth": bw,
        "layout": {stage: list(ds) for stage, ds in plan.layout.devices.items()}, "gpus": len(plan.layout.gpus),
        "sm_shares": plan.sm_shares, "mps_priorities": plan.mps_priorities, "colocate": plan.colocate,
        "reference": first.result if first else None,
        "references": {name: r.as_dict() for name, r in refs.items()},
        "workloads": {w.name: w.describe() for w in plan.workloads},
        "notes": plan.notes, "levels": [r.as_dict() for r in results], "live": live_report,
        # the first (or only) start of the services; with --thinker-replicas every start's in replica_runs
        "split_info": {k: v for k, v in (runs[0] if runs else {}).items() if k not in SESSION_REPORTS},
        **{key: runs[0].get(key) if runs else None for key in SESSION_REPORTS},
        "thinker_replicas": list(plan.thinker_replicas), "replica_runs": runs if plan.thinker_replicas else []},
        indent=1))
    return 0


# run_split's info keys of the multi-turn workloads' reports (bench/conversation.py, bench/realtime_session.py)
SESSION_REPORTS = ("conversation", "realtime_conversation")


def session_sections(wl: Workload, runs: list[dict]) -> str:
    """A multi-turn workload's report from each start of the services (one per --thinker-replicas count)."""
    key, render = (("conversation", conversation.section) if wl.conversation
                   else ("realtime_conversation", realtime_session.section))
    parts = [(f"With {r['thinker_replicas']} thinker replica{'s' if r['thinker_replicas'] > 1 else ''} "
              f"({r['layout']}):\n\n" if len(runs) > 1 else "") + render(r[key]) for r in runs if r.get(key)]
    return "\n\n".join(parts)


def replica_loads(replicas: dict[str, dict]) -> list[float]:
    """Turns per thinker replica: the conversation workload counts them from each turn's route, the
    realtime one from each replica's finished streams."""
    return [d["turns"] if "turns" in d else d["streams"] for _, d in sorted(replicas.items())]


def replicas_section(runs: list[dict]) -> str:
    """--thinker-replicas: each multi-turn workload's prefix hit rate (cached / prompt tokens over its
    finished turns) per thinker count, against the first count's at the same number of sessions, and
    how evenly the turns spread over the replicas ((max - min) / mean)."""
    lines = ["#### thinker replicas compared (--thinker-replicas): prefix hit rate = cached / prompt tokens of the "
             "finished turns; load spread = (max - min) / mean of the replicas' turns", "",
             "| workload | sessions | thinker replicas | prefix hit rate | against the first count | turns per replica "
             "| load spread | failed |", "|---|---|---|---|---|---|---|---|"]
    for key in SESSION_REPORTS:
        first: dict[int, float] = {}
        for r in runs:
            for lvl in (r.get(key) or {}).get("levels", []):
                rate = lvl["cached_fraction"]
                base = first.setdefault(lvl["sessions"], rate)
                loads = replica_loads(lvl["replicas"])
                lines.append(f"| {key.replace('_', '-')} | {lvl['sessions']} | {r['thinker_replicas']} | {rate:.1%} | "
                             f"{(rate - base) * 100:+.1f} points | {' / '.join(f'{x:.0f}' for x in loads)} | "
                             f"{lvl['load_spread']:.1%} | {lvl['failed']} |")
    return "\n".join(lines)
