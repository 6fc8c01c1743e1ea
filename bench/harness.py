"""`voxpipe bench`: the BENCHMARK.md workload against voxpipe end to end (the gateway's OpenAI chat
API streamed with the `openai` SDK, services behind it over loopback gRPC), split (the same three
services driven by the gRPC pipeline client) and in-process (the same engines in one process, no
gRPC), with transformers' reference measured in the same run. Prints one table of client-side
metrics and one of server-side means per stage (from the services' Prometheus metrics), and writes
JSON + markdown."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from . import server_stats
from .workload import WORKLOADS, LevelResult, Workload, run_level

STAGES = ("thinker", "talker", "code2wav")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint folder or config.json (default: the released config, dummy weights)")
    p.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="gateway,split,inprocess",
                   help="comma list of gateway (OpenAI SDK -> gateway -> services), split (gRPC pipeline client "
                        "-> services), inprocess (engines in one process)")
    p.add_argument("--concurrency", default="1,16,32,64")
    p.add_argument("--requests", type=int, default=0, help="per level (default max(20, 5 x c); --quick: max(8, 2 x c))")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer requests, fits one 10-minute device call")
    p.add_argument("--reference", action=argparse.BooleanOptionalAction, default=True,
                   help="also time transformers' generate at c=1 in a separate process")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--extra", default="", help="extra flags for every stage service (split and in-process)")
    p.add_argument("--out", default="bench/out")
    p.add_argument("--base-port", type=int, default=52051)
    p.add_argument("--mps", action="store_true",
                   help="split mode: run the three services under a CUDA MPS daemon started (and quit) by the bench")
    p.add_argument("--ablation", action="store_true",
                   help="split mode at the first concurrency level once per optimization layer, adding one at a time")
    p.add_argument("--devices", default="",
                   help="a device per stage, e.g. thinker=cuda:0,talker=cuda:1,code2wav=cuda:1 (the two-GPU layout); "
                        "stages not named use --device")
    p.add_argument("--workload", default="seedtts-like", choices=sorted(WORKLOADS),
                   help="BENCHMARK.md workload: seedtts-like (100-token prompt, 48 tokens, 125 frames) or "
                        "long-prompt (2,500-token prompt, 900 tokens, proportional audio: 2,344 frames)")
    p.add_argument("--prompt-tokens", type=int, default=0, help="override the workload's prompt length")
    p.add_argument("--text-tokens", type=int, default=0, help="override the workload's forced text tokens")
    p.add_argument("--frames", type=int, default=0, help="override the workload's forced codec frames")


def workload_from(args) -> Workload:
    """The named workload with any of --prompt-tokens / --text-tokens / --frames overriding it."""
    base = WORKLOADS[args.workload]
    return dataclasses.replace(base, prompt_tokens=args.prompt_tokens or base.prompt_tokens,
                               text_tokens=args.text_tokens or base.text_tokens, frames=args.frames or base.frames)


def stage_devices(spec: str) -> dict[str, str]:
    """'thinker=cuda:0,talker=cuda:1' -> {'thinker': 'cuda:0', 'talker': 'cuda:1'}."""
    out = {}
    for part in filter(None, spec.split(",")):
        stage, _, device = part.partition("=")
        if stage not in STAGES or not device:
            raise SystemExit(f"--devices: expected STAGE=DEVICE with STAGE in {', '.join(STAGES)}, got {part!r}")
        out[stage] = device
    return out


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


async def _levels(stream_fn, make_request, args, mode: str, scrape) -> list[LevelResult]:
    """Run each concurrency level; the server columns come from `scrape` plus this process's own
    metrics, where the "client" row's event-loop lag is this driver's loop (in split mode: the
    pipeline client relaying every row, frame and audio chunk; in-process: all three engines'
    handlers) and the "gateway" row's the gateway's (the relay in gateway mode)."""
    from voxpipe.services.runtime.metrics import LOOP_LAG, watch_loop_lag

    out = []
    lag = asyncio.ensure_future(watch_loop_lag(LOOP_LAG.labels("client").observe))
    try:
        for c in [int(x) for x in args.concurrency.split(",") if x]:
            out.append(await _level(stream_fn, make_request, args, mode, scrape, c))
    finally:
        lag.cancel()
    return out


async def _level(stream_fn, make_request, args, mode: str, scrape, c: int) -> LevelResult:
    n = args.requests or (max(8, 2 * c) if args.quick else max(20, 5 * c))
    warm = min(args.warmup, 2) if args.quick else args.warmup
    before = server_stats.parse(await asyncio.to_thread(scrape))
    records, wall = await run_level(stream_fn, make_request, c, n, warm if c == 1 else min(warm, c))
    after = server_stats.parse(await asyncio.to_thread(scrape))
    res = LevelResult.of(mode, c, records, wall)
    res.server = server_stats.level_stats(before, after, STAGES + ("gateway", "client"))
    errors = [r.error for r in records if r.error]
    print(f"[{mode}] c={c}: {res.req_per_s:.2f} req/s, TTFP p50 {res.ttfp_ms['p50']:.1f} ms, "
          f"RTF p50 {res.rtf['p50']:.3f}, failed {res.failed}" + (f" ({errors[0]})" if errors else ""), flush=True)
    return res


def run_split(args, cfg, wl: Workload, model: str) -> tuple[list[LevelResult], dict]:
    if args.mps:
        with mps_daemon():
            return _run_split(args, cfg, wl, model)
    return _run_split(args, cfg, wl, model)


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


def run_ablation(args, cfg, wl: Workload, model: str) -> list[LevelResult]:
    """One split-mode level (pipeline client) per row of LAYERS (the environment is inherited by the
    services)."""
    out = []
    level = args.concurrency.split(",")[0]
    for label, flags, env, mps in LAYERS:
        if mps and not args.device.startswith("cuda"):
            continue
        layer_args = argparse.Namespace(**{**vars(args), "extra": (args.extra + " " + flags).strip(), "mps": mps,
                                           "concurrency": level, "modes": "split"})
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            res, _ = run_split(layer_args, cfg, wl, model)
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


def _run_split(args, cfg, wl: Workload, model: str) -> tuple[list[LevelResult], dict]:
    """The three services (and the gateway for mode `gateway`) started once; each client mode in
    `args.modes` runs its levels against them in turn."""
    from voxpipe.cli import LocalStack
    from voxpipe.client import PipelineClient

    from .gateway_client import GatewayStream

    modes = [m for m in args.modes.split(",") if m in ("gateway", "split")]
    extra = ["--load-format", args.load_format, "--max-batch", str(args.max_batch)] + args.extra.split()
    metrics_ports = {s: args.base_port + 10 + i for i, s in enumerate(STAGES)}
    http_port = args.base_port + 20 if "gateway" in modes else 0
    stack = LocalStack(Path(model), "127.0.0.1", args.base_port, args.device, extra=extra,
                       metrics_ports=metrics_ports, http_port=http_port, devices=stage_devices(args.devices))
    pages = dict(metrics_ports, **({"gateway": http_port} if http_port else {}))   # the gateway's GET /metrics too
    scrape = server_stats.combined(server_stats.http_source(pages), server_stats.registry_source())
    t0 = time.perf_counter()
    print("split: starting the three services", flush=True)
    stack.start(timeout=300)
    print(f"split: services ready after {time.perf_counter() - t0:.1f} s", flush=True)
    info = {"startup_s": time.perf_counter() - t0}
    mem = gpu_memory_by_pid()
    info["gpu_mem_gb"] = {s: mem.get(stack.procs[s].pid) for s in STAGES}
    try:
        async def go():
            out = []
            for mode in modes:
                if mode == "gateway":
                    tokenizer = load_tokenizer(model, cfg)
                    client = GatewayStream(f"http://127.0.0.1:{http_port}/v1", _served_model(http_port))
                    try:
                        out += await _levels(client, lambda i: wl.chat(cfg, tokenizer, i), args, mode, scrape)
                    finally:
                        await client.close()
                else:
                    async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
                        out += await _levels(client.stream, lambda i: wl.request(cfg, i), args, mode, scrape)
            return out
        return asyncio.run(go()), info
    finally:
        stack.stop()


def _served_model(http_port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def load_tokenizer(model: str, cfg):
    from voxpipe.services.thinker.server import load_tokenizer as load

    return load(model, cfg)


def run_inprocess(args, cfg, wl: Workload, model: str) -> list[LevelResult]:
    from .inprocess import InProcessPipeline

    argv = ["--model", model, "--device", args.device, "--load-format", args.load_format,
            "--max-batch", str(args.max_batch)] + args.extra.split()

    async def go():
        print("inprocess: building the engines", flush=True)
        pipe = InProcessPipeline.from_argv(argv, stage_devices(args.devices))
        try:
            return await _levels(pipe.stream, lambda i: wl.request(cfg, i), args, "inprocess",
                                 server_stats.registry_source())
        finally:
            pipe.close()
    return asyncio.run(go())


def table(results: list[LevelResult], ref: dict | None, bw: float, nbytes: dict[str, float]) -> str:
    rows = ["| mode | c | req/s | TTFP p50 / p90 / p99 ms | RTF p50 / p90 | E2EL p50 s | TTFT p50 ms | thinker tok/s | "
            "talker frames/s | thinker BW | talker BW | failed |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def text_cols(r: LevelResult) -> str:
        # the gateway streams text, not token ids: with dummy weights the random ids decode to no
        # visible text, so there is no first-text time and no per-token rate to report there
        if r.thinker_tok_s <= 0 or math.isnan(r.ttft_ms["p50"]):
            return "n/a | n/a | n/a"
        tbw = nbytes["thinker_token"] * r.thinker_tok_s
        return f"{r.ttft_ms['p50']:.1f} | {r.thinker_tok_s:.1f} | {tbw / 1e12:.2f} TB/s ({tbw / bw:.0%})"

    for r in results:
        fbw = nbytes["talker_frame"] * r.talker_frames_s
        ttft, tok_s, tbw = text_cols(r).split(" | ")
        rows.append(f"| {r.mode} | {r.concurrency} | {r.req_per_s:.2f} | {r.ttfp_ms['p50']:.1f} / {r.ttfp_ms['p90']:.1f} / "
                    f"{r.ttfp_ms['p99']:.1f} | {r.rtf['p50']:.3f} / {r.rtf['p90']:.3f} | {r.e2el_s['p50']:.2f} | "
                    f"{ttft} | {tok_s} | {r.talker_frames_s:.1f} | "
                    f"{tbw} | {fbw / 1e12:.2f} TB/s ({fbw / bw:.0%}) | {r.failed} |")
    if ref:
        rows.append(f"| transformers | 1 | {1 / ref['ttfp_s']:.3f} | {ref['ttfp_s'] * 1000:.0f} | {ref['rtf']:.3f} | "
                    f"{ref['ttfp_s']:.2f} | {ref['prefill_plus_1_ms']:.1f} (prefill+1) | {ref['thinker_tok_s']:.1f} | | | | 0 |")
    return "\n".join(rows)


def server_table(results: list[LevelResult]) -> str:
    """Server-side means per stage and level (from the services' Prometheus histograms; the "client"
    row is the benchmark driver's own event loop)."""
    rows = ["| mode | c | stage | queue wait ms | first output ms (from arrival) | step ms | steps | prefill batch | "
            "outbox wait ms | loop lag ms |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for stage, st in (r.server or {}).items():
            def f(key, fmt="{:.1f}"):
                return fmt.format(st[key]) if key in st else ""
            if not st:
                continue
            rows.append(f"| {r.mode} | {r.concurrency} | {stage} | {f('queue_wait_ms')} | {f('first_output_ms')} | "
                        f"{f('step_ms', '{:.2f}')} | {f('steps', '{:.0f}')} | {f('prefill_batch', '{:.2f}')} | "
                        f"{f('outbox_wait_ms', '{:.2f}')} | {f('loop_lag_ms', '{:.2f}')} |")
    return "\n".join(rows)


def ratios(results: list[LevelResult], ref: dict | None) -> list[str]:
    lines = []
    c1 = {r.mode: r for r in results if r.concurrency == 1}
    for mode in ("gateway", "split"):
        if ref and mode in c1:
            s = c1[mode]
            tok = f", thinker {s.thinker_tok_s / ref['thinker_tok_s']:.1f}x tok/s" if s.thinker_tok_s > 0 else ""
            lines.append(f"- {mode} vs transformers at c=1: TTFP {ref['ttfp_s'] * 1000 / s.ttfp_ms['p50']:.0f}x lower, "
                         f"RTF {ref['rtf'] / s.rtf['p50']:.1f}x lower{tok}")
    for c in sorted({r.concurrency for r in results}):
        pair = {r.mode: r for r in results if r.concurrency == c}
        for mode in ("split", "gateway"):
            if mode in pair and "inprocess" in pair:
                a, b = pair[mode], pair["inprocess"]
                lines.append(f"- c={c}: {mode} / in-process TTFP p50 = {a.ttfp_ms['p50'] / b.ttfp_ms['p50']:.3f}, "
                             f"req/s = {a.req_per_s / max(b.req_per_s, 1e-9):.3f}")
    return lines


def run(args) -> int:
    from voxpipe.services.runtime.config import OmniConfig, released_config_path

    if "gateway" in args.modes.split(",") and not args.ablation:
        import openai  # noqa: F401  (fail now, not after the reference and the service start-up)
    model = args.model or str(released_config_path())
    cfg = OmniConfig.load(model)
    wl = workload_from(args)
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
    ref = None
    if args.reference:
        cfg_path = model if model.endswith(".json") else str(Path(model) / "config.json")
        print("transformers reference: starting", flush=True)
        proc = subprocess.run([sys.executable, "-m", "voxpipe.bench.reference", "--config", cfg_path,
                               "--device", args.device, "--prompt-tokens", str(wl.prompt_tokens),
                               "--text-tokens", str(wl.text_tokens), "--frames", str(wl.frames)],
                              capture_output=True, text=True, timeout=420)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
        if proc.returncode == 0 and lines:
            ref = json.loads(lines[-1])
            print(f"transformers reference: {ref}", flush=True)
        else:
            print(f"transformers reference failed: {proc.stderr[-2000:]}", flush=True)
    results: list[LevelResult] = []
    info = {}
    modes = [m for m in args.modes.split(",") if m]
    if args.ablation:
        results += run_ablation(args, cfg, wl, model)
        modes = []
    if "split" in modes or "gateway" in modes:
        res, info = run_split(args, cfg, wl, model)
        results += res
        print(f"split startup {info['startup_s']:.1f} s, GPU memory per service (GB): {info['gpu_mem_gb']}", flush=True)
    if "inprocess" in modes:
        results += run_inprocess(args, cfg, wl, model)
    nbytes = active_bytes(cfg)
    md = table(results, ref, bw, nbytes) + "\n\nServer side (means over each level, from the services' metrics):\n\n" + \
        server_table(results)
    summary = "\n".join(ratios(results, ref))
    argv = sys.argv[sys.argv.index("bench") + 1:] if "bench" in sys.argv else sys.argv[1:]
    cmd = "voxpipe bench " + " ".join(argv)
    header = (f"### {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} · commit {commit} · {device_name or args.device}\n\n"
              f"`{cmd}` — workload {wl.name}: {wl.prompt_tokens}-token prompt, {wl.text_tokens} text tokens, "
              f"{wl.frames} frames forced, greedy, speaker {wl.speaker}; copy bandwidth {bw / 1e12:.2f} TB/s; "
              f"TTFP measured at the client: gateway = the openai SDK streaming chat completions (SSE) from the "
              f"gateway; split = the gRPC pipeline client calling the three services; inprocess = the driver "
              f"calling the engines.\n")
    text = header + "\n" + md + "\n\n" + summary + "\n"
    print("\n" + text, flush=True)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"commit": commit, "device": device_name, "command": cmd,
                                                   "copy_bandwidth": bw, "reference": ref, "split_info": info,
                                                   "levels": [r.as_dict() for r in results]}, indent=1))
    return 0
