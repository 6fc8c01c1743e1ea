"""The paged attention kernel's launch tiling on the GPU, at the thinker's shapes (Hq 32 / Hkv 4 x 128,
16-position blocks, bf16): for each (rows, new tokens, context) the kernel's default launch against a
grid of (block_r, block_n, num_warps, num_stages), each output held to kernels_check's 16-bit budget,
and torch's flash attention on a gathered dense copy (`_causal_flash`, what a paged kernel replaces).

`python -m voxpipe.bench.paged_tune` (device tool, ~2 min) prints one JSON line per shape: the default's
time, the best config's time, TFLOP/s of both (4 * Hq * S * context * D per row, the causal triangle
of the new tokens counted whole), and the dense-copy path's time. Times: microseconds per call, median
of 50 eager calls between CUDA events (kernels_check.time_eager).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from voxpipe.bench.kernels_check import budget_error, time_eager
from voxpipe.kernels import paged_attention
from voxpipe.services.runtime.kv_cache import _causal_flash

HQ, HKV, D, BS = 32, 4, 128, 16
SHAPES = ((64, 1, 2048), (1, 64, 8192), (1, 256, 4096), (1, 256, 16384), (1, 256, 32768),
          (1, 512, 32768), (8, 256, 8192))
GRID = {"block_r": (16, 32, 64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (None, 2, 3)}


def inputs(n: int, s: int, ctx: int):
    dev = torch.device("cuda")
    nb = n * (-(-ctx // BS)) + 2
    kc, vc = (torch.randn(nb, HKV, BS, D, device=dev).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(nb - 2, device=dev).view(n, -1)
    start = torch.full((n,), ctx - s, dtype=torch.long, device=dev)
    q = torch.randn(n, s, HQ, D, device=dev).to(torch.bfloat16).transpose(1, 2)
    return q, kc, vc, tables, start


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="n:s:ctx,... (default: the thinker's serving classes)")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in x.split(":")) for x in args.shapes.split(",")]
    torch.manual_seed(0)
    scale = D ** -0.5
    for n, s, ctx in shapes:
        q, kc, vc, tables, start = inputs(n, s, ctx)
        ref16 = paged_attention.reference(q, kc, vc, tables, start, ctx, scale)
        ref32 = paged_attention.reference(q.float(), kc.float(), vc.float(), tables, start, ctx, scale)
        flops = 4 * n * HQ * s * ctx * D
        default_us = time_eager(lambda: paged_attention.kernel(q, kc, vc, tables, start, ctx, scale), args.iters)
        results = []
        for block_r, block_n, warps, stages in itertools.product(*GRID.values()):
            if (block_r < 64 and s > 16) or (block_r > 16 and s == 1):
                continue
            kw = dict(block_r=block_r, block_n=block_n, num_warps=warps, num_stages=stages)
            try:
                out = paged_attention.kernel(q, kc, vc, tables, start, ctx, scale, **kw)
                ok = budget_error(out, ref16, ref32)["ok"]
                us = time_eager(lambda: paged_attention.kernel(q, kc, vc, tables, start, ctx, scale, **kw),
                                args.iters)
            except Exception as e:   # noqa: BLE001 -- a tiling past the SM's shared memory or registers
                results.append({**kw, "error": type(e).__name__})
                continue
            results.append({**kw, "us": round(us, 2), "ok": ok})
        good = sorted((r for r in results if r.get("ok")), key=lambda r: r["us"])

        def dense():
            keys = kc[tables].transpose(1, 2).reshape(n, HKV, -1, D)[:, :, :ctx]
            values = vc[tables].transpose(1, 2).reshape(n, HKV, -1, D)[:, :, :ctx]
            return _causal_flash(q, keys, values, scale)

        line = {"shape": [n, s, ctx], "default_us": round(default_us, 2),
                "default_tflops": round(flops / default_us / 1e6, 1),
                "best": good[0] if good else None, "best_tflops": round(flops / good[0]["us"] / 1e6, 1) if good else None,
                "top5": good[1:5], "failed": [r for r in results if not r.get("ok")][:6],
                "dense_flash_us": round(time_eager(dense, args.iters), 2),
                "device": torch.cuda.get_device_name(), "triton": triton.__version__}
        print(json.dumps(line), flush=True)
        del q, kc, vc, ref16, ref32


if __name__ == "__main__":
    main()
