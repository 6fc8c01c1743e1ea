"""The Triton kernels (voxpipe.kernels) on the GPU at realistic shapes: error against `reference()`
within the budgets of tests/test_kernels.py, and time of kernel vs reference.
`python -m voxpipe.bench.kernels_check` (device tool); prints one JSON line per kernel and shape and
exits 1 if any is outside its budget.

Budgets: float32 outputs |kernel - reference| <= 1e-5 + 1e-5 |reference|; 16-bit outputs: max and
mean abs error against a float32 reference on the same inputs <= 1.25x the 16-bit reference's own;
residual sums and argmax indices exact; MoE routing: the same experts up to exact 16-bit ties, weights
within one 16-bit ulp. Times (microseconds, median of 100): `eager_us` one call
between two CUDA events (launch overhead included, as an eager step sees it), `graphed_us` per call
of 20 calls captured in one CUDA graph (as the decode-step graphs see it).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable

import torch
import triton

from voxpipe.kernels import attention, experts, glu, moe, paged_attention, rmsnorm, rope, sample, sampling, snakebeta
from voxpipe.services.runtime.kv_cache import _causal_flash

ATOL, RTOL, BUDGET_16 = 1e-5, 1e-5, 1.25
EPS = 1e-6


def time_eager(fn: Callable[[], object], iters: int = 100) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events) * 1000


def time_graphed(fn: Callable[[], object], calls: int = 20, iters: int = 100) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_eager(graph.replay, iters) / calls


def fp32_error(got: torch.Tensor, want: torch.Tensor) -> dict:
    err = (got.double() - want.double()).abs()
    return {"max_abs_err": float(err.max()),
            "ok": got.dtype == want.dtype and bool((err <= ATOL + RTOL * want.double().abs()).all())}


def budget_error(got: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor) -> dict:
    err_k, err_r = (got.double() - ref32.double()).abs(), (ref16.double() - ref32.double()).abs()
    out = {"kernel_max": float(err_k.max()), "ref16_max": float(err_r.max()),
           "kernel_mean": float(err_k.mean()), "ref16_mean": float(err_r.mean())}
    out["ok"] = (got.dtype == ref16.dtype and out["kernel_max"] <= BUDGET_16 * out["ref16_max"] + 1e-6
                 and out["kernel_mean"] <= BUDGET_16 * out["ref16_mean"] + 1e-6)
    return out


def report(name: str, shape, dtype: torch.dtype, error: dict, kernel_fn, reference_fn) -> dict:
    line = {"kernel": name, "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), **error,
            "kernel_eager_us": round(time_eager(kernel_fn), 2), "reference_eager_us": round(time_eager(reference_fn), 2),
            "kernel_graphed_us": round(time_graphed(kernel_fn), 2),
            "reference_graphed_us": round(time_graphed(reference_fn), 2),
            "device": torch.cuda.get_device_name(), "triton": triton.__version__}
    print(json.dumps(line), flush=True)
    return line


@torch.inference_mode()
def main(only: str | None = None) -> int:
    """`only="paged_attention"`: that kernel alone."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    lines = []
    check_paged(lines)
    if only == "paged_attention":
        return 0 if all(line["ok"] for line in lines) else 1
    for rows, n in ((64, 2048), (64, 1024)):
        dt = torch.bfloat16
        x = (torch.randn(rows, n, device=dev) * 2).to(dt)
        r = torch.randn(rows, n, device=dev).to(dt)
        w = (1 + 0.2 * torch.randn(n, device=dev)).to(dt)
        assert rmsnorm.eligible(x, w, r)
        err = budget_error(rmsnorm.kernel(x, w, EPS), rmsnorm.reference(x, w, EPS),
                           rmsnorm.reference(x.float(), w.float(), EPS))
        lines.append(report("rmsnorm", x.shape, dt, err, lambda: rmsnorm.kernel(x, w, EPS),
                            lambda: rmsnorm.reference(x, w, EPS)))
        normed, res = rmsnorm.kernel_add(x, r, w, EPS)
        ref_normed, ref_res = rmsnorm.reference_add(x, r, w, EPS)
        err = budget_error(normed, ref_normed, rmsnorm.reference(ref_res.float(), w.float(), EPS))
        err["residual_exact"] = torch.equal(res, ref_res)
        err["ok"] = err["ok"] and err["residual_exact"]
        lines.append(report("add_rmsnorm", x.shape, dt, err, lambda: rmsnorm.kernel_add(x, r, w, EPS),
                            lambda: rmsnorm.reference_add(x, r, w, EPS)))
    for shape in ((16, 1536, 32), (16, 96, 1920)):
        x = torch.randn(shape, device=dev) * 3
        a, b = 0.5 * torch.randn(shape[1], device=dev), 0.5 * torch.randn(shape[1], device=dev)
        assert snakebeta.eligible(x, a, b)
        err = fp32_error(snakebeta.kernel(x, a, b), snakebeta.reference(x, a, b))
        lines.append(report("snakebeta", shape, x.dtype, err, lambda: snakebeta.kernel(x, a, b),
                            lambda: snakebeta.reference(x, a, b)))
    for rows, v in ((8, 3072), (8, 152064)):
        logits = torch.randn(rows, v, device=dev)
        suppress = torch.rand(v, device=dev) < 0.05
        ban_rows = torch.arange(rows, device=dev) % 2 == 1
        banned = int(logits[1].masked_fill(suppress, float("-inf")).argmax())
        assert sampling.eligible(logits, suppress, ban_rows)
        got = sampling.kernel(logits, suppress, ban_rows, banned)
        want = sampling.reference(logits, suppress, ban_rows, banned)
        err = {"ok": torch.equal(got, want)}
        lines.append(report("masked_argmax", logits.shape, logits.dtype, err,
                            lambda: sampling.kernel(logits, suppress, ban_rows, banned),
                            lambda: sampling.reference(logits, suppress, ban_rows, banned)))
    from voxpipe.services.runtime.sampling import RowSampling, SamplingParams, exponential_noise
    for rows, v in ((1, 2048), (64, 2048), (64, 3072)):
        # the code predictor's sampling (top-k 50, top-p 0.8), the talker's (top-k 50), and greedy rows
        settings = [SamplingParams(temperature=1.0, top_k=50, top_p=0.8, seed=1),
                    SamplingParams(temperature=0.9, top_k=50, seed=2), SamplingParams()]
        params = [settings[i % 3] for i in range(rows)]
        logits = (torch.randn(rows, v, device=dev) * 3).to(torch.bfloat16).float()     # bf16 ties, as served
        args = (logits, *RowSampling.of(params, v, dev).tensors(),
                exponential_noise([p.generator(dev) for p in params], v, dev))
        assert sample.eligible(*args)
        got, got_ok = sample.kernel(*args)
        want, want_ok = sample.reference(*args)
        top_p = torch.tensor([p.top_p < 1.0 for p in params], device=dev)
        err = {"ok_flags_exact": torch.equal(got_ok, want_ok), "other_rows_exact": torch.equal(got[~top_p], want[~top_p]),
               "top_p_rows_equal_fraction": float((got[top_p] == want[top_p]).float().mean()) if bool(top_p.any()) else 1.0}
        err["ok"] = err["ok_flags_exact"] and err["other_rows_exact"] and err["top_p_rows_equal_fraction"] >= 0.98
        lines.append(report("sample_rows", logits.shape, logits.dtype, err, lambda: sample.kernel(*args),
                            lambda: sample.reference(*args)))
    for b, hq, hkv, d in ((1, 32, 4, 128), (64, 32, 4, 128), (64, 16, 2, 128)):
        dt = torch.bfloat16
        q, k = torch.randn(b, 1, hq, d, device=dev).to(dt), torch.randn(b, 1, hkv, d, device=dev).to(dt)
        ang = torch.randn(b, 1, d // 2, device=dev) * 3
        cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
        qw, kw = (1 + 0.2 * torch.randn(d, device=dev)).to(dt), (1 + 0.2 * torch.randn(d, device=dev)).to(dt)
        assert rope.eligible(q, k, cos, sin, qw, kw)
        got = rope.kernel(q.clone(), k.clone(), cos, sin, qw, kw, EPS)
        ref16 = rope.reference(q, k, cos, sin, qw, kw, EPS)
        ref32 = rope.reference(q.float(), k.float(), cos.float(), sin.float(), qw.float(), kw.float(), EPS)
        err = budget_error(torch.cat((got[0].flatten(), got[1].flatten())), torch.cat((ref16[0].flatten(), ref16[1].flatten())),
                           torch.cat((ref32[0].flatten(), ref32[1].flatten())))
        qc, kc = q.clone(), k.clone()
        lines.append(report("qk_norm_rope", q.shape, dt, err, lambda: rope.kernel(qc, kc, cos, sin, qw, kw, EPS),
                            lambda: rope.reference(q, k, cos, sin, qw, kw, EPS)))
    for t, e, k in ((1, 128, 8), (64, 128, 8), (64, 128, 6), (4096, 128, 8)):
        logits = torch.randn(t, e, device=dev).to(torch.bfloat16)
        idx, w = moe.kernel(logits, k, True)
        ref_idx, ref_w = moe.reference(logits, k, True)
        probs = torch.softmax(logits.float(), -1)
        err = {"experts_equal": torch.equal(idx, ref_idx),
               "same_probabilities": torch.equal(probs.gather(1, idx), probs.gather(1, ref_idx)),
               "weights_max_abs_err": float((w.float() - ref_w.float()).abs().max())}
        err["ok"] = err["same_probabilities"] and err["weights_max_abs_err"] <= 2 ** -7 * float(ref_w.float().abs().max())
        lines.append(report("moe_route", logits.shape, logits.dtype, err, lambda: moe.kernel(logits, k, True),
                            lambda: moe.reference(logits, k, True)))
    for rows, width in ((1, 2 * 3072), (64, 2 * 3072), (512, 2 * 768)):
        x = (torch.randn(rows, width, device=dev) * 3).to(torch.bfloat16)
        assert glu.eligible(x)
        err = budget_error(glu.kernel(x), glu.reference(x), glu.reference(x.float()))
        lines.append(report("swiglu", x.shape, x.dtype, err, lambda: glu.kernel(x), lambda: glu.reference(x)))
    for b, past, s in ((1, 0, 2), (1, 8, 1), (64, 15, 1)):   # code predictor: 16 / 8 heads of 128, 16 positions
        hq, hkv, d, length, dt = 16, 8, 128, 16, torch.bfloat16
        qkv = torch.randn(b, s, (hq + 2 * hkv) * d, device=dev).to(dt)
        q, k, v = (qkv[..., :hq * d].view(b, s, hq, d), qkv[..., hq * d:(hq + hkv) * d].view(b, s, hkv, d),
                   qkv[..., (hq + hkv) * d:].view(b, s, hkv, d))
        kc, vc = (torch.randn(b, hkv, length, d, device=dev).to(dt) for _ in range(2))
        assert attention.eligible(q, k, v, kc, vc, past)
        got = attention.kernel(q, k, v, kc.clone(), vc.clone(), past, d ** -0.5)
        ref16 = attention.reference(q, k, v, kc.clone(), vc.clone(), past, d ** -0.5)
        ref32 = attention.reference(q.float(), k.float(), v.float(), kc.float(), vc.float(), past, d ** -0.5)
        lines.append(report("short_attention", (b, past, s, hq, hkv, d), dt, budget_error(got, ref16, ref32),
                            lambda: attention.kernel(q, k, v, kc, vc, past, d ** -0.5),
                            lambda: attention.reference(q, k, v, kc, vc, past, d ** -0.5)))
    for t, k in ((1, 8), (64, 8), (64, 6), (256, 8)):   # MoE alignment + combination around the grouped GEMMs
        e, h, dt = 128, 2048, torch.bfloat16
        idx = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        got, want = moe.kernel_align(idx, e), moe.reference_align(idx, e)
        lines.append(report("moe_align", (t, k, e), idx.dtype, {"ok": all(torch.equal(a, b) for a, b in zip(got, want))},
                            lambda: moe.kernel_align(idx, e), lambda: moe.reference_align(idx, e)))
        y, inv = torch.randn(t * k, h, device=dev).to(dt), want[2]
        w = torch.softmax(torch.randn(t, k, device=dev), -1).to(dt)
        err = budget_error(moe.kernel_combine(y, inv, w), moe.reference_combine(y, inv, w),
                           moe.reference_combine(y.float(), inv, w.float()))
        lines.append(report("moe_combine", (t, k, h), dt, err, lambda: moe.kernel_combine(y, inv, w),
                            lambda: moe.reference_combine(y, inv, w)))
    # routed experts of a decode step: the three-launch GEMV path vs the grouped-GEMM path it replaces
    # (sort, offsets, gather, two grouped GEMMs, SwiGLU, weighting, scatter, sum, shared add)
    from voxpipe.services.runtime.layers import Experts
    for t, k, h, inter, with_shared in ((1, 8, 2048, 768, False), (8, 8, 2048, 768, False), (1, 6, 1024, 384, True),
                                        (8, 6, 1024, 384, True)):
        dt, e = torch.bfloat16, 128
        ex = Experts(e, h, inter).to(dev, dt).requires_grad_(False)
        ex.gate_up.normal_(0, h ** -0.5)
        ex.down.normal_(0, inter ** -0.5)
        x = torch.randn(t, h, device=dev).to(dt)
        idx = torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(t)])
        w = torch.softmax(torch.randn(t, k, device=dev), -1).to(dt)
        sh = torch.randn(t, h, device=dev).to(dt) if with_shared else None
        lg = torch.randn(t, 1, device=dev).to(dt) if with_shared else None

        def grouped():
            out = ex.grouped(x, idx, w)
            return out + torch.sigmoid(lg) * sh if with_shared else out

        args = (x, idx, w, ex.gate_up, ex.down, sh, lg)
        assert experts.eligible(*args)
        a32 = tuple(None if v is None else (v if v.dtype == torch.int64 else v.float()) for v in args)
        err = budget_error(experts.kernel(*args), experts.reference(*args), experts.reference(*a32))
        err["max_abs_vs_grouped"] = float((experts.kernel(*args).float() - grouped().float()).abs().max())
        lines.append(report("moe_experts_gemv (reference column: the grouped-GEMM path)", (t, k, e, h, inter), dt, err,
                            lambda: experts.kernel(*args), grouped))
    return 0 if all(line["ok"] for line in lines) else 1


def check_paged(lines: list[dict]) -> None:
    """The thinker's paged attention at full size."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    # the thinker's paged attention at full size (Hq 32 / Hkv 4 x 128, 16-position blocks): decode rows
    # and extends of a cached prefix, against the gather-into-a-dense-copy path it replaces
    hq, hkv, d, bs = 32, 4, 128, 16
    for n, s, ctx in ((1, 1, 512), (64, 1, 512), (64, 1, 2048), (16, 1, 8192), (1, 1, 32768),
                      (1, 128, 4096), (1, 512, 4096), (1, 512, 32768)):
        dt = torch.bfloat16
        nb = n * (-(-ctx // bs)) + 2
        kc, vc = (torch.randn(nb, hkv, bs, d, device=dev).to(dt) for _ in range(2))
        tables = torch.randperm(nb - 2, device=dev).view(n, -1)
        start = torch.full((n,), ctx - s, dtype=torch.long, device=dev)
        q = torch.randn(n, s, hq, d, device=dev).to(dt).transpose(1, 2)
        scale = d ** -0.5
        err = budget_error(paged_attention.kernel(q, kc, vc, tables, start, ctx, scale),
                           paged_attention.reference(q, kc, vc, tables, start, ctx, scale),
                           paged_attention.reference(q.float(), kc.float(), vc.float(), tables, start, ctx, scale))

        def gathered():
            keys = kc[tables].transpose(1, 2).reshape(n, hkv, -1, d)[:, :, :ctx]
            values = vc[tables].transpose(1, 2).reshape(n, hkv, -1, d)[:, :, :ctx]
            return _causal_flash(q, keys, values, scale)

        lines.append(report("paged_attention (reference column: gather + sdpa)", (n, s, ctx), dt, err,
                            lambda: paged_attention.kernel(q, kc, vc, tables, start, ctx, scale), gathered))
        del kc, vc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
