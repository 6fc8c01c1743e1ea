"""The batch-invariant mode's costs on the GPU, piece by piece, at the released config's decode shapes:
kernels.invariant.matmul in its serving tiles and in other fixed tiles (and fixed split-K) against
F.linear (cuBLAS), and
the routed experts (kernels.invariant.moe + the ordered sum) against the default grouped path, and
code2wav's float32 convolutions as the mode runs them (im2col rows through the serving tiles, exact
float32 products and as TF32) against the default mode's cuDNN convolution.

`python -m voxpipe.bench.invariant_tune` (device tool, ~2 min) prints one JSON line per (shape, rows):
F.linear's time, the serving tiles' time, and the best tiles of the grid with their times -- each
also checked batch-invariant (row r of an M-row call = the same row alone, bit for bit). A tile
shape faster at every M and invariant is a candidate for kernels/invariant.py's constants (they must
stay one shape for every call). Then one line per token count for the experts, then one per
code2wav convolution at `--code2wav-batch` utterances (one frame each; `--code2wav-batch 0`: none).

Times are microseconds per call inside one CUDA graph of CALLS calls (as the decode graphs see them),
median of normlinear_tune's replays; each call reads another copy of the weight (COPIES_MB in all) so that it
comes from HBM as in a step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from voxpipe.bench.normlinear_tune import graphed
from voxpipe.kernels import invariant

CALLS, COPIES_MB = 24, 160

# (name, K, N): the thinker's and talker's decode projections (released config)
SHAPES = (("thinker q/k/v", 2048, 5120), ("thinker o_proj", 4096, 2048), ("talker q/k/v", 1024, 2560))
# (name, Cin, Cout, samples a frame at its input): code2wav's dense kernel-7 convolutions (released config)
CONVS = (("code2wav decoder in", 1024, 1536, 4), ("code2wav block 1 residual", 768, 768, 32),
         ("code2wav block 2 residual", 384, 384, 160), ("code2wav block 3 residual", 192, 192, 640),
         ("code2wav block 4 residual", 96, 96, 1920))
SERVING = (invariant.BLOCK_M, invariant.BLOCK_N, invariant.BLOCK_K, invariant.NUM_WARPS, invariant.NUM_STAGES)


def invariant_rows(x: torch.Tensor, w: torch.Tensor, tiles) -> bool:
    """Rows 0, M // 2, M - 1 of the M-row call equal each row alone and the rows of a 2M-row call."""
    full = invariant.matmul(x, w, None, tiles)
    double = invariant.matmul(torch.cat((x.flip(0), x)), w, None, tiles)[x.shape[0]:]
    picks = sorted({0, x.shape[0] // 2, x.shape[0] - 1})
    alone = torch.cat([invariant.matmul(x[i:i + 1], w, None, tiles) for i in picks])
    return torch.equal(alone, full[picks]) and torch.equal(double, full)


def experts_lines(tokens: list[int]) -> list[dict]:
    from voxpipe.services.runtime.layers import Experts

    e, h, inter, k = 128, 2048, 768, 8
    ex = Experts(e, h, inter).cuda().to(torch.bfloat16).requires_grad_(False)
    ex.gate_up.normal_(0, 0.02)
    ex.down.normal_(0, 0.02)
    out = []
    for t in tokens:
        x = torch.randn(t, h, device="cuda").to(torch.bfloat16)
        idx = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, device="cuda"), -1).to(torch.bfloat16)
        times = {}
        for mode in (False, True):
            ex.invariant = mode
            times["invariant_us" if mode else "default_us"] = round(graphed([lambda: ex(x, idx, w)] * 8), 2)
        ex.invariant = True
        one = ex(x[:1], idx[:1], w[:1])
        times["invariant_rows"] = bool(torch.equal(one, ex(x, idx, w)[:1]))
        out.append({"case": "thinker experts (128 x 768, top 8)", "tokens": t, **times})
    return out


def code2wav_lines(batch: int, dev: str = "cuda") -> list[dict]:
    """Per convolution: the default mode's cuDNN conv1d over [batch, Cin, 6 + L] (TF32 as
    torch.backends.cudnn.allow_tf32 says), and the mode's im2col rows [batch * L, Cin * 7] through the
    serving tiles with exact float32 products and as TF32 (each checked batch-invariant), in us."""
    out = []
    for name, cin, cout, length in CONVS:
        x = torch.randn(batch, cin, 6 + length, device=dev)
        w = torch.randn(cout, cin, 7, device=dev) / math.sqrt(cin * 7)
        rows = x.unfold(2, 7, 1).permute(0, 2, 1, 3).reshape(batch * length, cin * 7).contiguous()
        w_rows = w.reshape(cout, cin * 7)
        line = {"case": name, "batch": batch, "rows": rows.shape[0], "k": cin * 7, "n": cout,
                "cudnn_us": round(graphed([lambda: F.conv1d(x, w)] * 8), 2),
                "cudnn_tf32": torch.backends.cudnn.allow_tf32}
        for tag, tf32 in (("ieee", False), ("tf32", True)):
            line[f"serving_{tag}_us"] = round(graphed([lambda: invariant.matmul(rows, w_rows, None, None, tf32)] * 8), 2)
            full = invariant.matmul(rows, w_rows, None, None, tf32)
            picks = [0, rows.shape[0] // 2, rows.shape[0] - 1]
            alone = torch.cat([invariant.matmul(rows[i:i + 1], w_rows, None, None, tf32) for i in picks])
            line[f"serving_{tag}_invariant"] = bool(torch.equal(alone, full[picks]))
            want = F.conv1d(x.double(), w.double()).permute(0, 2, 1).reshape(batch * length, cout)
            line[f"serving_{tag}_max_rel"] = float(((full.double() - want).abs().max() / want.abs().max()))
        out.append(line)
    return out


@torch.inference_mode()
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64", help="comma list of M (decode rows)")
    ap.add_argument("--top", type=int, default=3, help="tiles printed per case")
    ap.add_argument("--code2wav-batch", type=int, default=64, help="utterances of the code2wav lines (0: none)")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, fixed K splits)
    grid = [t for t in itertools.product((16, 64), (16, 32, 64), (64, 128), (4,), (3,), (1, 2, 4))
            if t[:5] != SERVING or t[5] > 1]
    rows = [int(r) for r in args.rows.split(",")]
    for name, k, n in SHAPES:
        copies = max(2, math.ceil(COPIES_MB * 2**20 / (n * k * 2)))
        weights = [(torch.randn(n, k, device=dev) / math.sqrt(k)).to(dt) for _ in range(copies)]
        for m in rows:
            x = torch.randn(m, k, device=dev).to(dt)
            ws = [weights[i % copies] for i in range(CALLS)]
            results = []
            for tiles in [SERVING] + grid:
                try:
                    us = graphed([lambda w=w: invariant.matmul(x, w, None, tiles) for w in ws])
                    ok = invariant_rows(x, weights[0], tiles)
                except Exception as exc:     # a shape Triton cannot build
                    results.append({"tiles": list(tiles), "error": type(exc).__name__})
                    continue
                results.append({"tiles": list(tiles), "us": round(us, 2), "invariant": ok})
            timed = sorted((r for r in results if "us" in r and r["invariant"]), key=lambda r: r["us"])
            print(json.dumps({"case": name, "rows": m, "k": k, "n": n,
                              "cublas_us": round(graphed([lambda w=w: F.linear(x, w) for w in ws]), 2),
                              "serving": results[0], "best": timed[:args.top],
                              "not_invariant": [r["tiles"] for r in results if r.get("invariant") is False]}),
                  flush=True)
    for line in experts_lines(rows):
        print(json.dumps(line), flush=True)
    for line in code2wav_lines(args.code2wav_batch) if args.code2wav_batch > 0 else []:
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
