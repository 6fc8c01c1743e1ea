"""kernels.normlinear's launch shapes against the unfused path, at the model's decode shapes, on the GPU.

`python -m voxpipe.bench.normlinear_tune` (device tool) prints one JSON line per (projection, rows)
with the unfused path's time (rmsnorm.run_add + F.linear [+ glu.run], what DecoderLayer.fused
launches without VOXPIPE_NORM_LINEAR) and the best few launch configs' times, then a summary line.

Times are microseconds per call inside one CUDA graph of `CALLS` calls (as the decode-step graphs see
them), median of `ITERS` replays. Each call reads another copy of the weight, `COPIES_MB` of copies
in all, so that the weight comes from HBM as in a step (one copy would sit in the 50 MB L2).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from voxpipe.bench.kernels_check import time_eager
from voxpipe.kernels import glu as glu_kernel
from voxpipe.kernels import normlinear, rmsnorm

CALLS, ITERS, COPIES_MB, EPS = 24, 30, 160, 1e-6

# (name, K, N or 2I for glu, glu): the released config's decode projections
SHAPES = (("code predictor q/k/v", 1024, 4096, False),
          ("code predictor gate/up + SwiGLU", 1024, 6144, True),
          ("talker q/k/v", 1024, 2560, False),
          ("thinker q/k/v", 2048, 5120, False))


def graphed(fns) -> float:
    """Per-call microseconds of the calls `fns` captured back to back in one graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return time_eager(graph.replay, ITERS) / len(fns)


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,16,64", help="comma list of M (decode rows)")
    ap.add_argument("--top", type=int, default=3, help="configs printed per case")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    grid = [normlinear.Config(bn, bk, w, st) for bn, bk, w, st in
            itertools.product((16, 32, 64), (128, 256), (4, 8), (3,))]   # each config compiles ~2 s a variant
    summary = []
    for name, k, n_out, glu in SHAPES:
        copies = max(2, math.ceil(COPIES_MB * 2**20 / (n_out * k * 2)))
        weights = [(torch.randn(n_out, k, device=dev) / math.sqrt(k)).to(dt) for _ in range(copies)]
        nw = (1 + 0.1 * torch.randn(k, device=dev)).to(dt)
        for m in (int(r) for r in args.rows.split(",")):
            x, res = torch.randn(m, k, device=dev).to(dt), torch.randn(m, k, device=dev).to(dt)
            ws = [weights[i % copies] for i in range(CALLS)]

            def unfused(w):
                normed, _ = rmsnorm.run_add(x, res, nw, EPS)
                y = F.linear(normed, w)
                return glu_kernel.run(y) if glu else y

            base = graphed([lambda w=w: unfused(w) for w in ws])
            want = normlinear.reference(x, res, nw, EPS, weights[0], glu)[0].float()
            scale = float(want.abs().max())
            default = normlinear.config_for(m, n_out // 2 if glu else n_out, k, glu)
            results = []
            for cfg in grid + ([] if default in grid else [default]):
                try:
                    got = normlinear.kernel(x, res, nw, EPS, weights[0], glu, cfg)[0].float()
                    err = float((got - want).abs().max())
                    us = graphed([lambda w=w: normlinear.kernel(x, res, nw, EPS, w, glu, cfg) for w in ws])
                except Exception as exc:      # a shape Triton cannot build (shared memory, registers)
                    results.append({"config": list(cfg), "error": type(exc).__name__})
                    continue
                results.append({"config": list(cfg), "us": round(us, 2), "max_abs_err": err})
            timed = sorted((r for r in results if "us" in r), key=lambda r: r["us"])
            line = {"case": name, "rows": m, "k": k, "n": n_out, "glu": glu, "ref_abs_max": scale,
                    "unfused_us": round(base, 2), "weight_mb": round(n_out * k * 2 / 2**20, 2),
                    "default": next(r for r in results if r["config"] == list(default)),
                    "best": timed[:args.top], "failed": sum("error" in r for r in results)}
            print(json.dumps(line), flush=True)
            summary.append({"case": name, "rows": m, "unfused_us": line["unfused_us"],
                            "best_us": timed[0]["us"] if timed else None,
                            "best_config": timed[0]["config"] if timed else None})
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
