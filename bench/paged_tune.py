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
SHAPES = ((1, 256, 4096), (1, 256, 16384), (1, 256, 32768),
          (1, 512, 32768), (8, 256, 8192))
GRID = {"block_r": (16, 32, 64, 128), "block_n": (32, 64, 128), "num_warps": (4, 8), "num_stages": (None, 3)}


def inputs(n: int, s: int, ctx: int):
    dev = torch.device("cuda")
    nb = n * (-(-ctx // BS)) + 2
    kc, vc = (torch.randn(nb, HKV, BS, D, device=dev).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(nb - 2, device=dev).view(n, -1)
    start = torch.full((n,), ctx - s, dtype=torch.long, device=dev)
    q = torch.randn(n, s, HQ, D, device=dev).to(torch.bfloat16).transpose(1, 2)
    return q, kc, vc, tables, start


def prefill_backends(iters: int) -> None:
    """A long prompt's chunks (the path `_causal_flash` serves): a chunk of S new tokens at the end of
    `total` positions, one layer, for each SDPA backend torch offers here, with the key heads repeated
    (today's path) and with `enable_gqa` (no copy); one JSON line per (S, total)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    import torch.nn.functional as F
    dev = torch.device("cuda")
    for s, total in ((4096, 4096), (4096, 32768), (8192, 8192), (8192, 32768), (512, 32768)):
        q = torch.randn(1, HQ, s, D, device=dev, dtype=torch.bfloat16)
        k, v = (torch.randn(1, HKV, total, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
        flops = 4 * HQ * D * s * (total - s / 2)
        mask = None if s == total else causal_lower_right(s, total)
        line = {"prefill_chunk": s, "total": total, "today_us": round(time_eager(
            lambda: _causal_flash(q, k, v, D ** -0.5), iters), 1)}
        line["today_tflops"] = round(flops / line["today_us"] / 1e6, 1)
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                              ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            for gqa in (False, True):
                kk, vv = (k, v) if gqa else (k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1))
                kw = {"is_causal": True} if mask is None else {"attn_mask": mask}

                def call():
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q, kk, vv, scale=D ** -0.5, enable_gqa=gqa, **kw)
                key = f"{name}{'_gqa' if gqa else '_repeated'}"
                try:
                    us = time_eager(call, iters)
                    line[key + "_us"], line[key + "_tflops"] = round(us, 1), round(flops / us / 1e6, 1)
                except Exception as e:   # noqa: BLE001 -- a backend that does not take this shape / mask
                    line[key + "_us"] = type(e).__name__
        print(json.dumps(line), flush=True)
        del q, k, v
    # first sight of a new length: cuDNN builds an execution plan per shape, flash attention has none
    import time
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                          ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        times = []
        for s, total in ((611, 711), (611, 711), (1377, 1577), (1377, 1577)):
            q = torch.randn(1, HQ, s, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(1, HQ, total, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                with sdpa_kernel(backend):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, total))
                torch.cuda.synchronize()
                times.append(round((time.perf_counter() - t0) * 1e3, 2))
            except Exception as e:   # noqa: BLE001
                times.append(type(e).__name__)
        print(json.dumps({"first_sight": name, "ms_new_then_repeat_shapes": times}), flush=True)


VARIANT_SHAPES = ((1, 320, 26037, 65536), (1, 320, 4096, 65536), (1, 32, 26037, 65536), (8, 320, 8192, 65536))


@torch.inference_mode()
def variants(iters: int, shapes=VARIANT_SHAPES) -> None:
    """Extend rows as the thinker's extend graphs launch them (n rows of s new tokens, the last at
    `ctx`, the graph's static `kv_bound` = the context the tables span): the default launch against
    the unmasked tiles first (`open_first`), larger tiles, and fixed splits; one JSON line a shape,
    microseconds per call and whether each is within the 16-bit budget."""
    scale = D ** -0.5
    torch.manual_seed(0)
    for n, s, ctx, bound in shapes:
        q, kc, vc, tables, start = inputs(n, s, ctx)
        width = -(-bound // BS)
        tables = torch.cat([tables, tables[:, :1].expand(n, width - tables.shape[1])], 1)   # stale columns
        ref16 = paged_attention.reference(q, kc, vc, tables, start, ctx, scale)
        ref32 = paged_attention.reference(q.float(), kc.float(), vc.float(), tables, start, ctx, scale)
        flops = 4 * n * HQ * s * ctx * D
        line = {"shape": [n, s, ctx, bound]}
        for name, kw in (("default", {}), ("open_first", {"open_first": True}),
                         ("r128_n128_w8", {"block_r": 128, "block_n": 128, "num_warps": 8}),
                         ("open_first_r128_n128_w8", {"open_first": True, "block_r": 128, "block_n": 128, "num_warps": 8}),
                         ("open_first_split2048", {"open_first": True, "split": 2048}),
                         ("open_first_split4096", {"open_first": True, "split": 4096}),
                         ("open_first_r128_n128_w8_split4096", {"open_first": True, "split": 4096, "block_r": 128,
                                                                "block_n": 128, "num_warps": 8})):
            try:
                out = paged_attention.kernel(q, kc, vc, tables, start, bound, scale, **kw)
                ok = budget_error(out, ref16, ref32)["ok"]
                us = time_eager(lambda: paged_attention.kernel(q, kc, vc, tables, start, bound, scale, **kw), iters)
            except Exception as e:   # noqa: BLE001 -- a tiling past the SM's shared memory or registers
                line[name] = type(e).__name__
                continue
            line[name] = {"us": round(us, 1), "tflops": round(flops / us / 1e6, 1), "ok": ok}
        print(json.dumps(line), flush=True)
        del q, kc, vc, ref16, ref32


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="n:s:ctx,... (default: the thinker's serving classes)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--prefill", action="store_true", help="also the long prompts' chunk attention by SDPA backend")
    ap.add_argument("--variants", action="store_true", help="only the extend-graph shapes' kernel variants (`variants`)")
    args = ap.parse_args()
    if args.variants:
        variants(args.iters)
        return
    if args.prefill:
        prefill_backends(args.iters)
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
