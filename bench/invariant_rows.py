"""The batch-invariant mode's cuBLAS row calls (`determinism.rows_linear`, --deterministic on CUDA) at
every nn.Linear shape the three stages serve (the released config, built on the meta device and laid
out for serving; thinker and talker in bfloat16, code2wav in float32): a row's bits must not depend
on what else is in its batch. Per shape, random weights (and bias where the layer has one):
    check        `determinism.rows_invariant`, what `apply` runs before it lets a shape serve: a
                 target row alone, then at every position of two calls (128 rows) inside batches of
                 every size up to 128 of random rows (scales 1e-2 .. 1e2), eagerly, and replayed in
                 CUDA graphs of 64 rows and of 1 row
    batches      `determinism.batches_invariant`, what `apply` runs next: the block counts (and launch
                 kind, "mm" one GEMM / "bmm" strided-batched) a prefill may put in one launch, each
                 found to keep every row's 64-row-call bits
    graph_batches `determinism.batches_graphed`, what `apply` runs last: those of `batches` that also
                 hold replayed in a CUDA graph (the only ones a captured call takes); `check_s`: the
                 three checks' seconds
    buckets      the target at a random position of a batch of every size n = 1 .. 64 of random rows,
                 through a GraphedStep captured at the decode buckets 1, 2, 4, .. 64 (a replay pads n to
                 its bucket, as the engines' decode steps do) = the target alone, eager
    prefill      the target at a random position of eager batches of 65, 100, 128, 200, 2,437 and 4,096
                 rows (several calls: prefills, extends, code2wav's frames), with the shape's batched
                 plan as `apply` sets it = alone; and of batches of 128, 256 and 2,437 rows captured in
                 CUDA graphs with both plans (the prefill / extend / code2wav frame graphs) = alone
    us           per call at 64 rows inside one CUDA graph, each call another copy of the weight (from
                 HBM as in a step): F.linear (the default mode), rows_linear (the mode) and
                 kernels.invariant.matmul (the mode's Triton kernel, VOXPIPE_INVARIANT_MATMUL=triton);
                 `f_linear_rows_us`: F.linear at 128 and 256 rows a call, the same way (what one larger
                 fixed call would cost against 2 or 4 of 64 rows)
    prefill_us   per eager call at PREFILL_TIME_ROWS rows (one weight, as in a prefill): F.linear, the
                 64-row calls one by one (det4), and rows_linear with the batched plan

    python -m voxpipe.bench.invariant_rows [--stages thinker,talker,code2wav] [--no-time]   (device tool)

One JSON line per shape, then a summary line; exits 1 if any check fails."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe.services.runtime import determinism

STAGES = ("thinker", "talker", "code2wav")
PREFILL_ROWS = (65, 100, 128, 200, 2437, 4096)
PREFILL_TIME_ROWS, PREFILL_REPS = 4096, 5
CALLS, COPIES_MB = 16, 160
WIDE_ROWS = (128, 256)


def stage_linears(stages: tuple[str, ...]) -> dict[tuple[int, int, bool, torch.dtype], list[str]]:
    """(in, out, bias, dtype) of every nn.Linear the stages serve -> the stages that have it."""
    from voxpipe.services.code2wav.model import Code2WavModel
    from voxpipe.services.runtime.config import OmniConfig, released_config_path
    from voxpipe.services.runtime.layers import fuse_projections
    from voxpipe.services.talker.model import TalkerModel
    from voxpipe.services.thinker.model import ThinkerModel

    cfg = OmniConfig.load(released_config_path())
    factories = {"thinker": (lambda: ThinkerModel(cfg.thinker), torch.bfloat16),
                 "talker": (lambda: TalkerModel(cfg.talker), torch.bfloat16),
                 "code2wav": (lambda: Code2WavModel(cfg.code2wav), torch.float32)}
    out: dict[tuple[int, int, bool, torch.dtype], list[str]] = {}
    with torch.device("meta"):
        for stage in stages:
            factory, dtype = factories[stage]
            model = factory()
            fuse_projections(model)         # serving_layout on CUDA
            for m in model.modules():
                if type(m) is nn.Linear:
                    stages_of = out.setdefault((m.in_features, m.out_features, m.bias is not None, dtype), [])
                    if stage not in stages_of:
                        stages_of.append(stage)
    return out


GRAPH_PREFILL_ROWS = (128, 256, 2437)


def bucket_check(weight: torch.Tensor, bias: torch.Tensor | None, g: torch.Generator,
                 plan: tuple[tuple[int, str], ...] = (),
                 graph_plan: tuple[tuple[int, str], ...] = ()) -> tuple[bool, bool]:
    """(buckets, prefill) as the module docstring says."""
    from voxpipe.services.runtime.cuda_graphs import GraphedStep, buckets

    dev, k = weight.device, weight.shape[1]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=dev).to(weight.dtype)

    target = rand(k)
    alone = determinism.rows_linear(target[None], weight, bias)[0]
    limit = determinism.GPU_ROWS
    step = GraphedStep(lambda n, kv, x: (determinism.rows_linear(x, weight, bias),), (rand(limit, k),),
                       buckets(limit), [1], "invariant rows")
    ok_buckets = True
    for n in range(1, limit + 1):
        x = rand(n, k)
        at = int(torch.randint(0, n, (1,), generator=g, device=dev))
        x[at] = target
        (out,) = step(n, 1, x)
        ok_buckets &= bool(torch.equal(out[at], alone))
    ok_prefill = True
    for n in PREFILL_ROWS:
        x = rand(n, k)
        at = int(torch.randint(0, n, (1,), generator=g, device=dev))
        x[at] = target
        ok_prefill &= bool(torch.equal(determinism.rows_linear(x, weight, bias, plan)[at], alone))
    for n in GRAPH_PREFILL_ROWS:
        static = rand(n, k)
        run = lambda: determinism.rows_linear(static, weight, bias, plan, graph_plan)  # noqa: E731
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        for _ in range(2):
            static.copy_(rand(n, k))
            at = int(torch.randint(0, n, (1,), generator=g, device=dev))
            static[at] = target
            graph.replay()
            ok_prefill &= bool(torch.equal(out[at], alone))
        del graph
    return ok_buckets, ok_prefill


def times(k: int, n: int, has_bias: bool, dtype: torch.dtype) -> dict[str, float]:
    from voxpipe.bench.normlinear_tune import graphed
    from voxpipe.kernels import invariant

    dev = torch.device("cuda")
    copies = max(2, math.ceil(COPIES_MB * 2**20 / (n * k * dtype.itemsize)))
    copies = min(copies, CALLS)
    weights = [(torch.randn(n, k, device=dev) / math.sqrt(k)).to(dtype) for _ in range(copies)]
    bias = torch.randn(n, device=dev).to(dtype) if has_bias else None
    x = torch.randn(determinism.GPU_ROWS, k, device=dev).to(dtype)
    ws = [weights[i % copies] for i in range(CALLS)]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    wide = {}
    for rows in WIDE_ROWS:      # F.linear at more rows a call: what a larger fixed call would cost
        xw = torch.randn(rows, k, device=dev).to(dtype)
        wide[str(rows)] = round(graphed([lambda w=w, xw=xw: F.linear(xw, w, bias) for w in ws]), 2)
    return {"f_linear_us": round(graphed([lambda w=w: F.linear(x, w, bias) for w in ws]), 2),
            "f_linear_rows_us": wide,
            "rows_linear_us": round(graphed([lambda w=w: determinism.rows_linear(x, w, bias) for w in ws]), 2),
            "triton_us": round(graphed([lambda w=w: invariant.matmul(x, w, bias, tf32=tf32) for w in ws]), 2)}


def prefill_times(weight: torch.Tensor, bias: torch.Tensor | None, plan: tuple[tuple[int, str], ...]) -> dict:
    x = torch.randn(PREFILL_TIME_ROWS, weight.shape[1], device=weight.device).to(weight.dtype)
    runs = {"f_linear": lambda: F.linear(x, weight, bias), "rows_64": lambda: determinism.rows_linear(x, weight, bias),
            "rows_batched": lambda: determinism.rows_linear(x, weight, bias, plan)}
    out = {}
    for name, fn in runs.items():
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(PREFILL_REPS):
            fn()
        end.record()
        end.synchronize()
        out[name] = round(start.elapsed_time(end) * 1000 / PREFILL_REPS, 1)
    return out


@torch.inference_mode()
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--no-time", dest="time", action="store_false", help="the checks only")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    shapes = stage_linears(tuple(args.stages.split(",")))
    failed = []
    check_s = 0.0
    for (k, n, has_bias, dtype), stages in shapes.items():
        g = torch.Generator(device=dev).manual_seed(k * 7919 + n)
        weight = (torch.randn(n, k, generator=g, device=dev) / math.sqrt(k)).to(dtype)
        bias = torch.randn(n, generator=g, device=dev).to(dtype) if has_bias else None
        start = time.perf_counter()
        line = {"shape": [k, n], "bias": has_bias, "dtype": str(dtype)[6:], "stages": stages,
                "check": determinism.rows_invariant(weight, bias)}
        plan = determinism.batches_invariant(weight, bias) if line["check"] else ()
        graph_plan = determinism.batches_graphed(weight, bias, plan)
        line["check_s"] = round(time.perf_counter() - start, 3)
        check_s += line["check_s"]
        line["batches"] = [f"{b}:{how}" for b, how in plan]
        line["graph_batches"] = [f"{b}:{how}" for b, how in graph_plan]
        line["buckets"], line["prefill"] = bucket_check(weight, bias, g, plan, graph_plan)
        if args.time:
            line.update(times(k, n, has_bias, dtype))
            line["prefill_us"] = prefill_times(weight, bias, plan)
        if not (line["check"] and line["buckets"] and line["prefill"]):
            failed.append([k, n])
        print(json.dumps(line), flush=True)
        del weight, bias
        torch.cuda.empty_cache()
    print(json.dumps({"summary": "invariant_rows", "shapes": len(shapes), "failed": failed,
                      "rows": determinism.GPU_ROWS, "check_s": round(check_s, 2), "device": torch.cuda.get_device_name()}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
