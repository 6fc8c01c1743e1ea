"""The Triton kernels in voxpipe.kernels against their plain-PyTorch `reference()`.

On the CPU every kernel runs through Triton's interpreter, in one subprocess for them all: the
interpreter is chosen when `triton.jit` decorates (TRITON_INTERPRET=1 before Triton is imported), so
it must not leak into this pytest process. The subprocess runs this file as a script and prints one
JSON record per check, tagged with its kernel; each kernel's test asserts its records. On CUDA the same checks run in-process on the compiled kernels.

Error budgets (the same on CPU and CUDA):
- float32 (and SnakeBeta on 16-bit x with float32 parameters, whose output is float32):
  |kernel - reference| <= ATOL + RTOL * |reference| elementwise.
- bfloat16 / float16 (and RMSNorm on 16-bit x with a float32 weight, which rounds the normalised row
  to 16 bits): against a float32 reference computed on the same (already rounded) inputs, the kernel's
  max and mean absolute errors are each at most BUDGET_16 x the 16-bit reference's own (+ 1e-6).
- invariant attention in 16 bits rounds the softmax weights to 16 bits before the weighted sum (as
  flash attention does), so its budget against the 16-bit SDPA reference is BUDGET_16_P x.
- exact: the fused add's new residual equals the reference's sum bit for bit; argmax indices are equal.
- sample: ok flags, greedy rows and rows without top-p equal the reference exactly; rows with top-p
  sum and sort in another order (see kernels/sample.py), so at most SAMPLE_MISMATCH of them may
  choose another id.
- fallback: ineligible inputs (float64, non-contiguous / wrong stride, too wide, autograd needed,
  kernels disabled, CPU without the interpreter) make `eligible()` false and `run()` return exactly
  `reference()`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ATOL, RTOL = 1e-5, 1e-5
BUDGET_16 = 1.25
BUDGET_16_P = 2.0
SAMPLE_MISMATCH = 0.02
EPS = 1e-6
KERNELS = ("rmsnorm", "snakebeta", "sampling", "sample", "rope", "moe", "glu", "normlinear", "attention", "experts",
           "invariant", "layers", "paged_attention", "paged_views", "invariant_convs")

try:
    import triton  # noqa: F401  (imported only to know; no kernel runs in this process on the CPU)
    TRITON = True
except ImportError:
    TRITON = False

CUDA = torch.cuda.is_available()


# ---------------------------------------------------------------- checks (shared by CPU script and CUDA)

def _fp32_record(name: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    err = (got.double() - want.double()).abs()
    ok = got.dtype == want.dtype and got.shape == want.shape and bool((err <= ATOL + RTOL * want.double().abs()).all())
    return {"check": name, "kind": "fp32", "max_abs_err": float(err.max()), "ok": ok}


def _budget_record(name: str, got: torch.Tensor, ref16: torch.Tensor, ref32: torch.Tensor,
                   budget: float = BUDGET_16) -> dict:
    err_k = (got.double() - ref32.double()).abs()
    err_r = (ref16.double() - ref32.double()).abs()
    rec = {"check": name, "kind": "budget16", "kernel_max": float(err_k.max()), "ref16_max": float(err_r.max()),
           "kernel_mean": float(err_k.mean()), "ref16_mean": float(err_r.mean())}
    rec["ok"] = (got.dtype == ref16.dtype and got.shape == ref16.shape
                 and rec["kernel_max"] <= budget * rec["ref16_max"] + 1e-6
                 and rec["kernel_mean"] <= budget * rec["ref16_mean"] + 1e-6)
    return rec


def _exact_record(name: str, got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"check": name, "kind": "exact", "ok": got.dtype == want.dtype and torch.equal(got, want)}


def _fallback_record(name: str, eligible: bool, got, want) -> dict:
    same = all(torch.equal(g, w) for g, w in zip(got, want)) if isinstance(got, tuple) else torch.equal(got, want)
    return {"check": name, "kind": "fallback", "eligible": eligible, "ok": not eligible and same}


def _disabled():
    """Context: voxpipe.kernels.ENABLED = False."""
    import contextlib

    import voxpipe.kernels as package

    @contextlib.contextmanager
    def ctx():
        before, package.ENABLED = package.ENABLED, False
        try:
            yield
        finally:
            package.ENABLED = before
    return ctx()


def check_rmsnorm(device: str) -> list[dict]:
    from voxpipe.kernels import rmsnorm
    g = torch.Generator().manual_seed(0)
    out = []
    for shape in [(3, 5, 96), (7, 2048), (33, 128), (2, 1000)]:
        n = shape[-1]
        x32 = (torch.randn(shape, generator=g) * 2).to(device)
        r32 = torch.randn(shape, generator=g).to(device)
        w32 = (1 + 0.2 * torch.randn(n, generator=g)).to(device)
        tag = "x".join(map(str, shape))
        assert rmsnorm.eligible(x32, w32), f"rmsnorm {tag} should launch the kernel on {device}"
        out.append(_fp32_record(f"rmsnorm fp32 {tag}", rmsnorm.run(x32, w32, EPS), rmsnorm.reference(x32, w32, EPS)))
        normed, res = rmsnorm.run_add(x32, r32, w32, EPS)
        ref_normed, ref_res = rmsnorm.reference_add(x32, r32, w32, EPS)
        out.append(_fp32_record(f"add_rmsnorm fp32 {tag}", normed, ref_normed))
        out.append(_exact_record(f"add_rmsnorm fp32 residual {tag}", res, ref_res))
        for dt in (torch.bfloat16, torch.float16):
            x, r, w = x32.to(dt), r32.to(dt), w32.to(dt)
            name = f"{str(dt)[6:]} {tag}"
            out.append(_budget_record(f"rmsnorm {name}", rmsnorm.run(x, w, EPS), rmsnorm.reference(x, w, EPS),
                                      rmsnorm.reference(x.float(), w.float(), EPS)))
            normed, res = rmsnorm.run_add(x, r, w, EPS)
            ref_normed, ref_res = rmsnorm.reference_add(x, r, w, EPS)
            out.append(_budget_record(f"add_rmsnorm {name}", normed, ref_normed,
                                      rmsnorm.reference(ref_res.float(), w.float(), EPS)))
            out.append(_exact_record(f"add_rmsnorm residual {name}", res, ref_res))
            # 16-bit activations, float32 weight: float32 output, but the normalised row is still rounded
            # to 16 bits first (as the reference does), so the 16-bit budget applies
            out.append(_budget_record(f"rmsnorm {name} fp32-weight", rmsnorm.run(x, w32, EPS),
                                      rmsnorm.reference(x, w32, EPS), rmsnorm.reference(x.float(), w32, EPS)))
    x, w = (torch.randn(4, 96, generator=g) * 2).to(device), torch.ones(96).to(device)
    cases = {
        "float64": (x.double(), w.double()),
        "non-contiguous": (x.t().contiguous().t()[:, :64], w[:64]),
        f"wider than MAX_N={rmsnorm.MAX_N}": (torch.randn(2, rmsnorm.MAX_N + 1, generator=g).to(device),
                                               torch.ones(rmsnorm.MAX_N + 1).to(device)),
        "autograd": (x.clone().requires_grad_(), w),
    }
    for name, (xi, wi) in cases.items():
        out.append(_fallback_record(f"rmsnorm fallback {name}", rmsnorm.eligible(xi, wi),
                                    rmsnorm.run(xi, wi, EPS), rmsnorm.reference(xi, wi, EPS)))
    res = torch.randn(4, 96, generator=g).to(device)
    out.append(_fallback_record("add_rmsnorm fallback residual dtype differs",
                                rmsnorm.eligible(x, w, res.bfloat16()), rmsnorm.run_add(x, res.bfloat16(), w, EPS),
                                rmsnorm.reference_add(x, res.bfloat16(), w, EPS)))
    with _disabled():
        out.append(_fallback_record("rmsnorm fallback ENABLED=False", rmsnorm.eligible(x, w),
                                    rmsnorm.run(x, w, EPS), rmsnorm.reference(x, w, EPS)))
    return out


def check_snakebeta(device: str) -> list[dict]:
    from voxpipe.kernels import snakebeta
    g = torch.Generator().manual_seed(1)
    out = []
    # a program per 1,024 elements: on the CPU a shorter T than a real chunk's 1,920, still many programs
    # with a masked last one
    shapes = [(2, 96, 200), (2, 24, 1920), (3, 64, 1)] if device == "cuda" else [(2, 96, 200), (2, 24, 480), (3, 64, 1)]
    for shape in shapes:
        c = shape[1]
        x32 = (torch.randn(shape, generator=g) * 3).to(device)
        a32 = (0.5 * torch.randn(c, generator=g)).to(device)
        b32 = (0.5 * torch.randn(c, generator=g)).to(device)
        tag = "x".join(map(str, shape))
        assert snakebeta.eligible(x32, a32, b32), f"snakebeta {tag} should launch the kernel on {device}"
        out.append(_fp32_record(f"snakebeta fp32 {tag}", snakebeta.run(x32, a32, b32),
                                snakebeta.reference(x32, a32, b32)))
        for dt in (torch.bfloat16, torch.float16):
            x, a, b = x32.to(dt), a32.to(dt), b32.to(dt)
            name = f"{str(dt)[6:]} {tag}"
            out.append(_budget_record(f"snakebeta {name}", snakebeta.run(x, a, b), snakebeta.reference(x, a, b),
                                      snakebeta.reference(x.float(), a.float(), b.float())))
            out.append(_fp32_record(f"snakebeta {name} fp32-params", snakebeta.run(x, a32, b32),
                                    snakebeta.reference(x, a32, b32)))
    # strided B / C with unit stride along T (a trimmed transposed-conv output): still the kernel
    base = (torch.randn(2, 16, 60, generator=g) * 3).to(device)
    a, b = (0.5 * torch.randn(8, generator=g)).to(device), (0.5 * torch.randn(8, generator=g)).to(device)
    trimmed = base[:, ::2, 5:-5]
    assert snakebeta.eligible(trimmed, a, b), "a [B, C, T] view with unit T stride should launch the kernel"
    out.append(_fp32_record("snakebeta fp32 strided view", snakebeta.run(trimmed, a, b),
                            snakebeta.reference(trimmed, a, b)))
    x = base[:, :8]
    cases = {
        "float64": (x.double(), a.double(), b.double()),
        "T stride != 1": (base.transpose(1, 2)[:, :8, :8], a, b),   # [2, 8, 8] with stride 1 along C
        "autograd": (x.clone().requires_grad_(), a, b),
    }
    for name, (xi, ai, bi) in cases.items():
        out.append(_fallback_record(f"snakebeta fallback {name}", snakebeta.eligible(xi, ai, bi),
                                    snakebeta.run(xi, ai, bi), snakebeta.reference(xi, ai, bi)))
    two_d = snakebeta.eligible(x[0], a, b)      # the contract is [B, C, T] only
    out.append({"check": "snakebeta 2-D input not eligible", "kind": "fallback", "eligible": two_d, "ok": not two_d})
    with _disabled():
        out.append(_fallback_record("snakebeta fallback ENABLED=False", snakebeta.eligible(x, a, b),
                                    snakebeta.run(x, a, b), snakebeta.reference(x, a, b)))
    return out


def check_sampling(device: str) -> list[dict]:
    from voxpipe.kernels import sampling
    g = torch.Generator().manual_seed(2)
    out = []
    for b, v in [(5, 3000), (3, 152064), (2, 7)]:
        logits = torch.randn(b, v, generator=g)
        suppress = torch.rand(v, generator=g) < 0.1
        top = logits.argmax(-1)
        suppress[top[0]] = True                                   # row 0's best is suppressed
        if b > 2:
            j = int(top[1])
            logits[2, :] = logits[2].clamp(max=1.0)
            logits[2, [j, j + 1] if j + 1 < v else [j - 1, j]] = 5.0   # a tie: the first index wins
            suppress[j - 1:j + 2] = False
        ban_rows = torch.tensor([i % 2 == 1 for i in range(b)])
        banned_id = int(logits[1].masked_fill(suppress, float("-inf")).argmax())   # row 1's best is banned
        args = [t.to(device) for t in (logits, suppress, ban_rows)]
        assert sampling.eligible(*args), f"sampling {b}x{v} should launch the kernel on {device}"
        for dt in (torch.float32, torch.bfloat16):
            lg = args[0].to(dt)
            out.append(_exact_record(f"masked_argmax {str(dt)[6:]} {b}x{v}",
                                     sampling.run(lg, args[1], args[2], banned_id),
                                     sampling.reference(lg, args[1], args[2], banned_id)))
        everything = torch.ones(v, dtype=torch.bool, device=device)      # all -inf rows: index 0, as torch
        out.append(_exact_record(f"masked_argmax all suppressed {b}x{v}",
                                 sampling.run(args[0], everything, args[2], banned_id),
                                 sampling.reference(args[0], everything, args[2], banned_id)))
    logits = torch.randn(4, 50, generator=g).to(device)
    suppress, ban_rows = torch.zeros(50, dtype=torch.bool, device=device), torch.ones(4, dtype=torch.bool, device=device)
    cases = {"float64": (logits.double(), suppress, ban_rows),
             "non-contiguous": (logits[:, ::2], suppress[:25], ban_rows),
             "strided ban_rows": (logits, suppress, torch.ones(8, dtype=torch.bool, device=device)[::2])}
    for name, (lg, sup, ban) in cases.items():
        out.append(_fallback_record(f"masked_argmax fallback {name}", sampling.eligible(lg, sup, ban),
                                    sampling.run(lg, sup, ban, 3), sampling.reference(lg, sup, ban, 3)))
    with _disabled():
        out.append(_fallback_record("masked_argmax fallback ENABLED=False", sampling.eligible(logits, suppress, ban_rows),
                                    sampling.run(logits, suppress, ban_rows, 3),
                                    sampling.reference(logits, suppress, ban_rows, 3)))
    return out


def check_sample(device: str) -> list[dict]:
    from voxpipe.kernels import sample
    from voxpipe.services.runtime.sampling import RowSampling, SamplingParams, exponential_noise
    params = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.9, top_k=50), SamplingParams(temperature=100.0),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=0.5, top_k=40, top_p=0.9), SamplingParams(temperature=1.0, top_k=50, top_p=0.8),
              SamplingParams(temperature=1.0, top_p=1e-6)]
    out = []
    # the interpreter takes most of a second a row: a few short rows (13 wide: padded to 16) on the
    # CPU, the real widths on CUDA (and in bench/kernels_check.py)
    sizes = [(300, 6), (2048, 2), (3072, 1), (7, 2)] if device == "cuda" else [(13, 1)]
    if device != "cuda":
        params = params[::2] + [params[-3]]
    for v, seeds in sizes:
        rows, ps = [], []
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            plain = torch.randn(v, generator=g) * 3
            kinds = [plain, plain.to(torch.bfloat16).float().clamp(-2, 2)]
            kinds += [(plain * 4).to(torch.bfloat16).float()] if device == "cuda" else []
            masked = torch.full((v,), float("-inf"))
            masked[torch.randperm(v, generator=g)[:min(5, v)]] = torch.randn(min(5, v), generator=g)
            kinds.append(masked)
            if seed == 0:
                nan, pinf = plain.clone(), plain.clone()
                nan[v // 2], pinf[v - 1] = float("nan"), float("inf")
                kinds += [nan, torch.full((v,), float("-inf"))]
                kinds += [pinf, plain * 1e37] if device == "cuda" else []
            for lg in kinds:
                for p in params:
                    rows.append(lg)
                    ps.append(p)
        gens = [None if p.greedy else torch.Generator().manual_seed(i) for i, p in enumerate(ps)]
        wide = exponential_noise(gens, v + 3, "cpu")        # rows strided, as a view of a wider buffer
        args = [t.to(device) for t in (torch.stack(rows), *RowSampling.of(ps, v, "cpu").tensors())]
        noise = wide.to(device)[:, 3:]
        assert sample.eligible(*args, noise), f"sample {len(ps)}x{v} should launch the kernel on {device}"
        got, got_ok = sample.run(*args, noise)
        want, want_ok = sample.reference(*args, noise)
        top_p = torch.tensor([p.top_p < 1.0 and not p.greedy for p in ps], device=device)
        usable = want_ok
        exact = usable & ~top_p
        rec = _exact_record(f"sample {len(ps)}x{v}: ok flags", got_ok, want_ok)
        out.append(rec)
        out.append(_exact_record(f"sample {len(ps)}x{v}: ids of greedy, temperature and top-k rows",
                                 got[exact], want[exact]))
        differ = int((got[usable & top_p] != want[usable & top_p]).sum())
        total = int((usable & top_p).sum())
        out.append({"check": f"sample {len(ps)}x{v}: ids of top-p rows", "kind": "sample", "differ": differ,
                    "rows": total, "ok": differ <= SAMPLE_MISMATCH * total})
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1)).to(device)
    rows = RowSampling.of([SamplingParams(temperature=0.8, top_p=0.9)] * 4, 50, device).tensors()
    noise = torch.ones(4, 50, device=device)
    cases = {"float64 logits": (logits.double(), *rows, noise),
             "non-contiguous logits": (logits.t().contiguous().t(), *rows, noise),
             "noise strided along V": (logits, *rows, torch.ones(4, 100, device=device)[:, ::2]),
             "too wide": (torch.randn(1, sample.MAX_V + 1, device=device),
                          *RowSampling.of([SamplingParams()], sample.MAX_V + 1, device).tensors(),
                          torch.ones(1, sample.MAX_V + 1, device=device))}
    for name, a in cases.items():
        out.append(_fallback_record(f"sample fallback {name}", sample.eligible(*a), sample.run(*a), sample.reference(*a)))
    with _disabled():
        a = (logits, *rows, noise)
        out.append(_fallback_record("sample fallback ENABLED=False", sample.eligible(*a), sample.run(*a),
                                    sample.reference(*a)))
    return out


def check_rope(device: str) -> list[dict]:
    from voxpipe.kernels import rope
    g = torch.Generator().manual_seed(5)
    out = []
    # the interpreter runs a program per (token, head): fewer of them on the CPU, of the same classes
    # (grouped / not, one token / several, D 32 / 64 / 128)
    cases = [(2, 3, 4, 2, 32), (1, 1, 32, 4, 128), (3, 5, 8, 8, 64)] if device == "cuda" else \
        [(2, 3, 4, 2, 32), (1, 1, 16, 2, 128), (2, 3, 2, 2, 64)]
    for b, s, hq, hkv, d in cases:
        q32 = (torch.randn(b, s, hq, d, generator=g) * 2).to(device)
        k32 = (torch.randn(b, s, hkv, d, generator=g) * 2).to(device)
        ang = torch.randn(b, s, d // 2, generator=g) * 3
        cos32, sin32 = torch.cat((ang.cos(), ang.cos()), -1).to(device), torch.cat((ang.sin(), ang.sin()), -1).to(device)
        qw32, kw32 = (1 + 0.2 * torch.randn(d, generator=g)).to(device), (1 + 0.2 * torch.randn(d, generator=g)).to(device)
        tag = f"{b}x{s}x{hq}/{hkv}x{d}"
        for norm in (True, False):
            w = (qw32, kw32) if norm else (None, None)
            name = f"{tag}{' norm' if norm else ''}"
            assert rope.eligible(q32, k32, cos32, sin32, *w), f"rope {name} should launch the kernel on {device}"
            got = rope.run(q32.clone(), k32.clone(), cos32, sin32, *w, EPS)
            want = rope.reference(q32, k32, cos32, sin32, *w, EPS)
            out.append(_fp32_record(f"rope fp32 q {name}", got[0], want[0]))
            out.append(_fp32_record(f"rope fp32 k {name}", got[1], want[1]))
            for dt in (torch.bfloat16, torch.float16):
                q, k, cos, sin = (t.to(dt) for t in (q32, k32, cos32, sin32))
                wd = tuple(None if x is None else x.to(dt) for x in w)
                got = rope.run(q.clone(), k.clone(), cos, sin, *wd, EPS)
                ref16 = rope.reference(q, k, cos, sin, *wd, EPS)
                ref32 = rope.reference(q.float(), k.float(), cos.float(), sin.float(),
                                       *(None if x is None else x.float() for x in wd), EPS)
                for i, which in enumerate("qk"):
                    out.append(_budget_record(f"rope {str(dt)[6:]} {which} {name}", got[i], ref16[i], ref32[i]))
    q, k = torch.randn(2, 3, 4, 64, generator=g).to(device), torch.randn(2, 3, 2, 64, generator=g).to(device)
    cos, sin = torch.randn(2, 3, 64, generator=g).to(device), torch.randn(2, 3, 64, generator=g).to(device)
    w = (1 + 0.2 * torch.randn(64, generator=g)).to(device)
    # column slices of a fused q/k/v projection output: strided tokens, still the kernel
    qkv = torch.randn(2, 3, (4 + 2 + 2) * 64, generator=g).to(device)
    qs, ks = qkv[..., :256].view(2, 3, 4, 64), qkv[..., 256:384].view(2, 3, 2, 64)
    assert rope.eligible(qs, ks, cos, sin, w, w), "q/k slices of a fused projection should launch the kernel"
    want = rope.reference(qs, ks, cos, sin, w, w, EPS)
    before_v = qkv[..., 384:].clone()
    got = rope.run(qs, ks, cos, sin, w, w, EPS)
    out.append(_fp32_record("rope fp32 q fused-projection slices", got[0], want[0]))
    out.append(_fp32_record("rope fp32 k fused-projection slices", got[1], want[1]))
    out.append(_exact_record("rope leaves the v columns alone", qkv[..., 384:], before_v))
    # a decode step's slices ([B, 1, H, D]: stride(1) is not the token stride), still the kernel
    qkv = torch.randn(3, 1, (4 + 2 + 2) * 64, generator=g).to(device)
    qs, ks = qkv[..., :256].view(3, 1, 4, 64), qkv[..., 256:384].view(3, 1, 2, 64)
    c1, s1 = cos[:, :1].repeat(2, 1, 1)[:3].contiguous(), sin[:, :1].repeat(2, 1, 1)[:3].contiguous()
    assert rope.eligible(qs, ks, c1, s1, w, w), "decode-step q/k slices should launch the kernel"
    want = rope.reference(qs, ks, c1, s1, w, w, EPS)
    got = rope.run(qs, ks, c1, s1, w, w, EPS)
    out.append(_fp32_record("rope fp32 q decode-step slices", got[0], want[0]))
    out.append(_fp32_record("rope fp32 k decode-step slices", got[1], want[1]))
    cases = {
        "float64": (q.double(), k.double(), cos.double(), sin.double(), w.double(), w.double()),
        "heads not adjacent": (q.transpose(1, 2).contiguous().transpose(1, 2), k, cos, sin, w, w),
        "non-contiguous cos": (q, k, cos.transpose(0, 1).contiguous().transpose(0, 1), sin, w, w),
        "mixed dtypes": (q, k, cos.bfloat16(), sin.bfloat16(), w, w),
        "head_dim not a power of two": (q[..., :48].contiguous(), k[..., :48].contiguous(), cos[..., :48].contiguous(),
                                        sin[..., :48].contiguous(), w[:48], w[:48]),
        "autograd": (q.clone().requires_grad_(), k, cos, sin, w, w),
    }
    for name, args in cases.items():
        out.append(_fallback_record(f"rope fallback {name}", rope.eligible(*args), rope.run(*args, EPS),
                                    rope.reference(*args, EPS)))
    with _disabled():
        out.append(_fallback_record("rope fallback ENABLED=False", rope.eligible(q, k, cos, sin, w, w),
                                    rope.run(q, k, cos, sin, w, w, EPS), rope.reference(q, k, cos, sin, w, w, EPS)))
    return out


def check_moe(device: str) -> list[dict]:
    from voxpipe.kernels import moe
    g = torch.Generator().manual_seed(6)
    out = []
    routes = [(1, 128, 8), (16, 128, 6), (5, 60, 4), (3, 8, 8)] if device == "cuda" else \
        [(1, 128, 8), (6, 128, 6), (5, 60, 4), (3, 8, 8)]       # one interpreted program a token
    for t, e, k in routes:
        logits32 = (torch.randn(t, e, generator=g) * 2).to(device)
        for dt in (torch.float32, torch.bfloat16):
            logits = logits32.to(dt)
            assert moe.eligible(logits, k), f"moe route {t}x{e} k={k} should launch the kernel on {device}"
            for norm in (True, False):
                name = f"{str(dt)[6:]} {t}x{e} k={k}{' norm' if norm else ''}"
                idx, w = moe.run(logits, k, norm)
                ref_idx, ref_w = moe.reference(logits, k, norm)
                # the same experts, or (16-bit logits tie often) experts of exactly the same probability
                probs = torch.softmax(logits.float(), -1)
                distinct = all(len(set(row)) == k for row in idx.tolist())
                out.append({"check": f"moe route experts {name}", "kind": "topk", "exact": torch.equal(idx, ref_idx),
                            "ok": distinct and torch.equal(probs.gather(1, idx), probs.gather(1, ref_idx))})
                if dt == torch.float32:
                    out.append(_fp32_record(f"moe route weights {name}", w, ref_w))
                else:   # the same float32 weights rounded once: equal, or one bf16 ulp apart at a rounding edge
                    ulp = (ref_w.float().abs() * 2.0 ** -7).clamp_min(1e-30)
                    ok = w.dtype == ref_w.dtype and bool(((w.float() - ref_w.float()).abs() <= ulp).all())
                    out.append({"check": f"moe route weights {name}", "kind": "ulp", "ok": ok})
    logits = torch.randn(4, 16, generator=g).to(device)
    cases = {"float64": (logits.double(), 2), "non-contiguous": (logits.t().contiguous().t(), 2),
             "k > experts": (logits, 17), "3-D": (logits[None], 2)}
    for name, (lg, k) in cases.items():
        eligible = moe.eligible(lg, k)
        if k > lg.shape[-1]:
            out.append({"check": f"moe route fallback {name}", "kind": "fallback", "eligible": eligible,
                        "ok": not eligible})
            continue
        out.append(_fallback_record(f"moe route fallback {name}", eligible, moe.run(lg, k, True),
                                    moe.reference(lg, k, True)))
    with _disabled():
        out.append(_fallback_record("moe route fallback ENABLED=False", moe.eligible(logits, 2),
                                    moe.run(logits, 2, True), moe.reference(logits, 2, True)))
    # the interpreter's sort costs grow with the padded pairs: on the CPU 120 (padded to 128) and 128
    # pairs stand for a decode batch's 384 and 512
    aligns = [(1, 8, 128), (64, 6, 128), (64, 8, 128), (5, 4, 60), (3, 8, 8)] if device == "cuda" else \
        [(1, 8, 128), (20, 6, 128), (16, 8, 128), (5, 4, 60), (3, 8, 8)]
    for t, k, e in aligns:
        # distinct experts per token (as routed), and repeats within a token with experts 0 and E-1 unused
        for kind, top_idx in (("routed", torch.rand(t, e, generator=g).topk(k).indices),
                              ("repeats", torch.randint(1, e - 1, (t, k), generator=g))):
            top_idx = top_idx.to(device)
            assert moe.eligible_align(top_idx, e), f"moe align {t}x{k} E={e} should launch the kernel on {device}"
            got, want = moe.run_align(top_idx, e), moe.reference_align(top_idx, e)
            for what, a, b in zip(("order", "src", "inv", "offs"), got, want):
                out.append(_exact_record(f"moe align {what} {kind} {t}x{k} E={e}", a, b))
    combines = [(1, 8, 2048), (16, 6, 1024), (5, 4, 96)] if device == "cuda" else \
        [(1, 8, 2048), (4, 6, 1024), (5, 4, 96)]                 # H over 512: several column blocks
    for t, k, h in combines:
        y32 = torch.randn(t * k, h, generator=g).to(device)
        inv = moe.reference_align(torch.rand(t, 128, generator=g).topk(k).indices, 128)[2].to(device)
        w32 = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
        shared32, logit32 = torch.randn(t, h, generator=g).to(device), (2 * torch.randn(t, 1, generator=g)).to(device)
        for dt in (torch.float32, torch.bfloat16):
            y, w, shared, logit = (x.to(dt) for x in (y32, w32, shared32, logit32))
            # y in sorted pair order (after the grouped GEMMs), or in pair order (inv None)
            for rows, extra in ((inv, ()), (inv, (shared, logit)), (None, (shared, logit))):
                name = f"{str(dt)[6:]} {t}x{k}x{h}{' shared' if extra else ''}{' pair-order' if rows is None else ''}"
                assert moe.eligible_combine(y, rows, w, *extra), f"moe combine {name} should launch the kernel"
                got, want = moe.run_combine(y, rows, w, *extra), moe.reference_combine(y, rows, w, *extra)
                if dt == torch.float32:
                    out.append(_fp32_record(f"moe combine {name}", got, want))
                else:
                    out.append(_budget_record(f"moe combine {name}", got, want, moe.reference_combine(
                        y.float(), rows, w.float(), *(x.float() for x in extra))))
    top_idx = torch.randint(0, 128, (moe.MAX_PAIRS // 8 + 1, 8), generator=g).to(device)
    out.append(_fallback_record(f"moe align fallback more than MAX_PAIRS={moe.MAX_PAIRS}",
                                moe.eligible_align(top_idx, 128), moe.run_align(top_idx, 128),
                                moe.reference_align(top_idx, 128)))
    y = torch.randn(5 * 4, 96, generator=g).to(device)
    inv, w = torch.randperm(20, generator=g).to(device), torch.rand(5, 4, generator=g).to(device)
    shared, logit = torch.randn(5, 96, generator=g).to(device), torch.randn(5, 1, generator=g).to(device)
    cases = {"float64": (y.double(), inv, w, shared.double(), logit.double()),
             "non-contiguous": (y.t().contiguous().t(), inv, w, shared, logit)}
    for name, args in cases.items():
        out.append(_fallback_record(f"moe combine fallback {name}", moe.eligible_combine(*args),
                                    moe.run_combine(*args), moe.reference_combine(*args)))
    with _disabled():
        out.append(_fallback_record("moe align fallback ENABLED=False", moe.eligible_align(top_idx[:4], 128),
                                    moe.run_align(top_idx[:4], 128), moe.reference_align(top_idx[:4], 128)))
        args = (y, inv, w, shared, logit)
        out.append(_fallback_record("moe combine fallback ENABLED=False", moe.eligible_combine(*args),
                                    moe.run_combine(*args), moe.reference_combine(*args)))
    return out


def check_normlinear(device: str) -> list[dict]:
    from voxpipe.kernels import normlinear
    g = torch.Generator().manual_seed(11)
    out = []
    # (rows, K, N or I, glu, with x): one row; several; more than one block of rows and of columns
    for m, k, n, glu, with_x in [(1, 64, 48, False, True), (3, 96, 32, True, True), (5, 64, 64, False, False),
                                 (70, 32, 16, True, True)]:
        res32, x32 = torch.randn(m, k, generator=g) * 2, torch.randn(m, k, generator=g)
        nw32 = 1 + 0.2 * torch.randn(k, generator=g)
        w32 = torch.randn(2 * n if glu else n, k, generator=g) * k ** -0.5
        tag = f"{m}x{k} -> {n}{' glu' if glu else ''}{'' if with_x else ' (no add)'}"
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            res, nw, w = (t.to(device).to(dt) for t in (res32, nw32, w32))
            x = x32.to(device).to(dt) if with_x else None
            assert normlinear.eligible(x, res, nw, w, glu), f"normlinear {tag} should launch the kernel on {device}"
            (y, r), (ry, rr) = normlinear.run(x, res, nw, EPS, w, glu), normlinear.reference(x, res, nw, EPS, w, glu)
            out.append(_exact_record(f"normlinear residual {str(dt)[6:]} {tag}", r, rr))
            if dt == torch.float32:
                out.append(_fp32_record(f"normlinear {tag}", y, ry))
            else:
                ref32 = normlinear.reference(None if x is None else x.float(), res.float(), nw.float(), EPS,
                                             w.float(), glu)[0]
                out.append(_budget_record(f"normlinear {str(dt)[6:]} {tag}", y, ry, ref32))
    res, nw, w = torch.randn(4, 32, generator=g).to(device), torch.ones(32).to(device), torch.randn(16, 32).to(device)
    cases = {f"more than MAX_M={normlinear.MAX_M} rows": (None, torch.randn(normlinear.MAX_M + 1, 32).to(device), nw, w),
             "K not a multiple of 16": (None, res[:, :24].contiguous(), nw[:24], w[:, :24].contiguous()),
             "mixed dtypes": (res.half(), res, nw, w),
             "non-contiguous weight": (None, res, nw, w.t().contiguous().t()[:, :32])}
    for name, (x, r, n_w, lw) in cases.items():
        out.append(_fallback_record(f"normlinear fallback {name}", normlinear.eligible(x, r, n_w, lw),
                                    normlinear.run(x, r, n_w, EPS, lw), normlinear.reference(x, r, n_w, EPS, lw)))
    with _disabled():
        out.append(_fallback_record("normlinear fallback ENABLED=False", normlinear.eligible(None, res, nw, w),
                                    normlinear.run(None, res, nw, EPS, w), normlinear.reference(None, res, nw, EPS, w)))
    return out


def check_glu(device: str) -> list[dict]:
    from voxpipe.kernels import glu
    g = torch.Generator().manual_seed(7)
    out = []
    for shape in [(3, 2 * 96), (7, 2 * 3072), (2, 5, 2 * 384), (1, 2 * 1000)]:
        x32 = (torch.randn(shape, generator=g) * 3).to(device)
        tag = "x".join(map(str, shape))
        assert glu.eligible(x32), f"glu {tag} should launch the kernel on {device}"
        out.append(_fp32_record(f"glu fp32 {tag}", glu.run(x32), glu.reference(x32)))
        for dt in (torch.bfloat16, torch.float16):
            x = x32.to(dt)
            out.append(_budget_record(f"glu {str(dt)[6:]} {tag}", glu.run(x), glu.reference(x), glu.reference(x.float())))
    x = torch.randn(4, 64, generator=g).to(device)
    cases = {"float64": x.double(), "non-contiguous": x.t().contiguous().t(), "odd width": x[:, :63].contiguous(),
             "autograd": x.clone().requires_grad_()}
    for name, xi in cases.items():
        if name == "odd width":
            eligible = glu.eligible(xi)
            out.append({"check": f"glu fallback {name}", "kind": "fallback", "eligible": eligible, "ok": not eligible})
            continue
        out.append(_fallback_record(f"glu fallback {name}", glu.eligible(xi), glu.run(xi), glu.reference(xi)))
    with _disabled():
        out.append(_fallback_record("glu fallback ENABLED=False", glu.eligible(x), glu.run(x), glu.reference(x)))
    return out


def check_attention(device: str) -> list[dict]:
    """A whole code-predictor frame per case: a first call of S tokens, then one token per call until
    the cache is full; each call's output and the caches against the reference on its own caches."""
    from voxpipe.kernels import attention
    g = torch.Generator().manual_seed(8)
    out = []
    # on the CPU (the interpreter runs every program) fewer heads and shorter frames of the same classes:
    # grouped and not, D 128 / 64 / 32, a first call of 1-3 tokens, padded rows and positions, a full cache
    cases = [(3, 2, 16, 8, 128, 16), (2, 3, 4, 2, 32, 8), (1, 1, 8, 8, 64, 5)] if device == "cuda" else \
        [(2, 2, 4, 2, 128, 7), (2, 3, 4, 2, 32, 8), (1, 1, 4, 4, 64, 5)]
    for b, first, hq, hkv, d, length in cases:
        width = (hq + 2 * hkv) * d
        for dt in (torch.float32, torch.bfloat16):
            caches = [torch.zeros(b, hkv, length, d, dtype=dt, device=device) for _ in range(2)]
            ref_caches = [c.clone() for c in caches]
            ref32_caches = [c.float() for c in caches]
            past, ok_caches = 0, True
            while past < length:
                s = first if past == 0 else 1
                qkv = (torch.randn(b, s, width, generator=g) * 2).to(device).to(dt)   # fused-projection slices
                q = qkv[..., :hq * d].view(b, s, hq, d)
                k = qkv[..., hq * d:(hq + hkv) * d].view(b, s, hkv, d)
                v = qkv[..., (hq + hkv) * d:].view(b, s, hkv, d)
                tag = f"{str(dt)[6:]} {b}x{hq}/{hkv}x{d} past={past} S={s}"
                assert attention.eligible(q, k, v, *caches, past), f"attention {tag} should launch on {device}"
                got = attention.run(q, k, v, *caches, past, d ** -0.5)
                want = attention.reference(q, k, v, *ref_caches, past, d ** -0.5)
                if dt == torch.float32:
                    out.append(_fp32_record(f"attention {tag}", got, want))
                else:
                    want32 = attention.reference(q.float(), k.float(), v.float(), *ref32_caches, past, d ** -0.5)
                    out.append(_budget_record(f"attention {tag}", got, want, want32))
                ok_caches &= all(torch.equal(c, r) for c, r in zip(caches, ref_caches))
                past += s
            out.append({"check": f"attention caches {str(dt)[6:]} {b}x{hq}/{hkv}x{d}", "kind": "exact", "ok": ok_caches})
    q = torch.randn(2, 2, 4, 32, generator=g).to(device)
    k, v = torch.randn(2, 2, 2, 32, generator=g).to(device), torch.randn(2, 2, 2, 32, generator=g).to(device)

    def cache(length: int = 8, dim: int = 32, dtype=torch.float32):
        return torch.zeros(2, 2, length, dim, dtype=dtype, device=device)

    cases = {
        "float64": (q.double(), k.double(), v.double(), cache(dtype=torch.float64), cache(dtype=torch.float64), 3),
        "heads not adjacent": (q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cache(), cache(), 3),
        f"longer than MAX_LEN={attention.MAX_LEN}": (q, k, v, cache(attention.MAX_LEN + 1), cache(attention.MAX_LEN + 1), 3),
        "head_dim not a power of two": (q[..., :24].contiguous(), k[..., :24].contiguous(), v[..., :24].contiguous(),
                                        cache(dim=24), cache(dim=24), 3),
        f"over the register budget MAX_PRODUCT={attention.MAX_PRODUCT}": (
            torch.randn(2, 4, 8, 256).to(device), torch.randn(2, 4, 2, 256).to(device),
            torch.randn(2, 4, 2, 256).to(device), cache(64, 256), cache(64, 256), 60),
    }
    for name, (qi, ki, vi, kc, vc, past) in cases.items():
        kc2, vc2 = kc.clone(), vc.clone()
        eligible = attention.eligible(qi, ki, vi, kc, vc, past)
        got = attention.run(qi, ki, vi, kc, vc, past, 0.2)
        want = attention.reference(qi, ki, vi, kc2, vc2, past, 0.2)
        out.append(_fallback_record(f"attention fallback {name}", eligible, (got, kc, vc), (want, kc2, vc2)))
    with _disabled():
        kc, vc, kc2, vc2 = cache(), cache(), cache(), cache()
        out.append(_fallback_record("attention fallback ENABLED=False", attention.eligible(q, k, v, kc, vc, 3),
                                    (attention.run(q, k, v, kc, vc, 3, 0.2), kc, vc),
                                    (attention.reference(q, k, v, kc2, vc2, 3, 0.2), kc2, vc2)))
    return out


def check_experts(device: str) -> list[dict]:
    from voxpipe.kernels import experts
    g = torch.Generator().manual_seed(10)
    out = []
    # few program instances per case: Triton's CPU interpreter runs each one (the costs grow with pairs x rows),
    # so smaller widths there, of the same classes: H and I powers of two or not (masked columns), I / H
    # not multiples of the blocks (masked rows: CPU), one token with K = 8 and no shared expert, several
    # with one; the last case's H and I span 2 and 3 pieces of 16 below
    cases = [(1, 8, 16, 128, 48, False), (3, 6, 12, 160, 48, True), (4, 4, 9, 64, 24, True)] if device == "cuda" \
        else [(1, 8, 16, 32, 8, False), (2, 6, 12, 36, 10, True), (3, 4, 9, 24, 20, True)]
    for t, k, e, h, inter, with_shared in cases:
        x32 = torch.randn(t, h, generator=g).to(device)
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(device)
        w32 = torch.softmax(torch.randn(t, k, generator=g), -1).to(device)
        gu32 = (torch.randn(e, 2 * inter, h, generator=g) * h ** -0.5).to(device)
        dn32 = (torch.randn(e, h, inter, generator=g) * inter ** -0.5).to(device)
        sh32 = torch.randn(t, h, generator=g).to(device) if with_shared else None
        lg32 = torch.randn(t, 1, generator=g).to(device) if with_shared else None
        tag = f"{t}x{k} of {e}, {h}/{inter}{' shared' if with_shared else ''}"
        args32 = (x32, idx, w32, gu32, dn32, sh32, lg32)
        assert experts.eligible(*args32), f"experts {tag} should launch the kernel on {device}"
        out.append(_fp32_record(f"experts fp32 {tag}", experts.run(*args32), experts.reference(*args32)))
        for dt in (torch.bfloat16, torch.float16):
            a = tuple(None if v is None else (v if v.dtype == torch.int64 else v.to(dt)) for v in args32)
            a32 = tuple(None if v is None else (v if v.dtype == torch.int64 else v.float()) for v in a)
            out.append(_budget_record(f"experts {str(dt)[6:]} {tag}", experts.run(*a), experts.reference(*a),
                                      experts.reference(*a32)))
    # dot products longer than MAX_IN run in pieces (the real sizes never do)
    before, experts.MAX_IN = experts.MAX_IN, 16
    try:
        x2, idx2, w2, gu, dn, sh2, lg2 = args32                # the last case's first two tokens
        a = (x2[:2], idx2[:2], w2[:2], gu, dn, sh2[:2], lg2[:2])
        a = tuple(v if v.dtype == torch.int64 else v.to(torch.bfloat16) for v in a)
        a32 = tuple(None if v is None else (v if v.dtype == torch.int64 else v.float()) for v in a)
        out.append(_budget_record(f"experts bfloat16 {tag} in pieces of 16", experts.run(*a), experts.reference(*a),
                                  experts.reference(*a32)))
    finally:
        experts.MAX_IN = before
    x, idx = torch.randn(9, 32, generator=g).to(device), torch.randint(0, 4, (9, 8), generator=g).to(device)
    w, gu, dn = torch.rand(9, 8, generator=g).to(device), torch.randn(4, 16, 32, generator=g).to(device), \
        torch.randn(4, 32, 8, generator=g).to(device)
    cases = {f"more than MAX_PAIRS={experts.MAX_PAIRS} pairs": (x, idx, w, gu, dn),
             "float64": (x[:2].double(), idx[:2], w[:2].double(), gu.double(), dn.double()),
             "non-contiguous x": (x[:2].t().contiguous().t(), idx[:2], w[:2], gu, dn),
             "shared without its gate": (x[:2], idx[:2], w[:2], gu, dn, x[:2], None)}
    for name, a in cases.items():
        eligible = experts.eligible(*a)
        if name == "shared without its gate":
            out.append({"check": f"experts fallback {name}", "kind": "fallback", "eligible": eligible, "ok": not eligible})
            continue
        out.append(_fallback_record(f"experts fallback {name}", eligible, experts.run(*a), experts.reference(*a)))
    with _disabled():
        a = (x[:2], idx[:2], w[:2], gu, dn)
        out.append(_fallback_record("experts fallback ENABLED=False", experts.eligible(*a), experts.run(*a),
                                    experts.reference(*a)))
    return out


def check_layers(device: str) -> list[dict]:
    """The layers' kernel path (`voxpipe.kernels.active`) against the same modules with the kernels
    off, float32, serving layout (fused projections): a MoE decoder stack with a shared expert and
    MRoPE (prefill, then two one-token steps on a ShortCache), a code predictor frame, and the grouped
    MoE path with its align / combine kernels in bfloat16 against the plain grouped path. Every kernel
    the layers use must have launched (a silent fallback would compare the reference with itself)."""
    import contextlib

    from voxpipe.kernels import attention, experts, glu, moe, normlinear, rmsnorm, rope
    from voxpipe.services.runtime.config import DecoderConfig, RopeConfig
    from voxpipe.services.runtime.kv_cache import ShortCache
    from voxpipe.services.runtime.layers import DecoderStack, Experts, fuse_projections
    from voxpipe.services.talker.model import CodePredictor

    launched: dict[str, int] = {}
    watched = [(attention, "kernel"), (experts, "kernel"), (rope, "kernel"), (glu, "kernel"), (rmsnorm, "kernel_add"),
               (moe, "kernel"), (moe, "kernel_align"), (moe, "kernel_combine"), (normlinear, "kernel")]

    def counting(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            key = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
            launched[key] = launched.get(key, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    patches = contextlib.ExitStack()
    for module, name in watched:
        patches.callback(setattr, module, name, getattr(module, name))
        setattr(module, name, counting(module, name))

    torch.manual_seed(9)
    moe_cfg = DecoderConfig(vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                            rms_norm_eps=1e-6, rope=RopeConfig(1e4, (2, 3, 3)), num_experts=8, experts_per_token=2,
                            moe_intermediate_size=16, shared_expert_size=48)
    dense_cfg = DecoderConfig(vocab_size=50, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                              rms_norm_eps=1e-6, rope=RopeConfig(1e4), intermediate_size=96)
    out = []

    def init(module):
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.normal_(1.0, 0.1) if name.endswith("norm.weight") else p.normal_(0.0, 0.2)
        return module.to(device).requires_grad_(False)

    def both(fn):
        """fn() with the kernels on, then off."""
        on = fn()
        with _disabled():
            off = fn()
        return on, off

    stack = init(DecoderStack(moe_cfg))
    fuse_projections(stack)
    x = torch.randn(2, 3, 64).to(device)     # few tokens: the interpreter runs each expert pair's programs

    def run_stack():
        cache = ShortCache(2, 2, 8, 2, 16, torch.float32, device)
        outs = [stack(x, torch.arange(3).expand(2, 3).to(device), cache, keep_hidden=1)]
        for pos in (3, 4):
            outs.append(stack(x[:, :1] * 0.5, torch.full((2, 1), pos).to(device), cache, keep_hidden=2))
        return outs

    stack_on, run_stack_off = both(run_stack)
    for i, ((h_on, kept_on), (h_off, kept_off)) in enumerate(zip(stack_on, run_stack_off)):
        out.append(_fp32_record(f"layers MoE stack call {i} output", h_on, h_off))
        out.append(_fp32_record(f"layers MoE stack call {i} kept hidden", kept_on, kept_off))
    predictor = init(CodePredictor(dense_cfg, num_code_groups=5))
    fuse_projections(predictor)
    hidden, code0 = torch.randn(2, 64).to(device), torch.randn(2, 64).to(device)
    (codes_on, emb_on), (codes_off, emb_off) = both(
        lambda: predictor.predict(hidden, code0, lambda logits, group: logits.argmax(-1)))
    out.append(_exact_record("layers code predictor codes", codes_on, codes_off))
    out.append(_fp32_record("layers code predictor embeddings", torch.stack(emb_on), torch.stack(emb_off)))
    # VOXPIPE_NORM_LINEAR: the same layers with norm + projection (+ SwiGLU) in one kernel
    from voxpipe.services.runtime import layers
    patches.callback(setattr, layers, "NORM_LINEAR", layers.NORM_LINEAR)
    layers.NORM_LINEAR = True
    before = launched.get("normlinear.kernel", 0)
    codes_nl, emb_nl = predictor.predict(hidden, code0, lambda logits, group: logits.argmax(-1))
    out.append(_exact_record("layers code predictor codes, normlinear", codes_nl, codes_off))
    out.append(_fp32_record("layers code predictor embeddings, normlinear", torch.stack(emb_nl), torch.stack(emb_off)))
    # 4 passes (5 code groups) x 2 layers x (q/k/v, gate/up)
    out.append({"check": "layers normlinear launched for every dense layer", "kind": "launch",
                "launched": launched.get("normlinear.kernel", 0) - before,
                "ok": launched.get("normlinear.kernel", 0) - before == 16})
    before = launched.get("normlinear.kernel", 0)
    for i, ((h_nl, kept_nl), (h_off, kept_off)) in enumerate(zip(run_stack(), run_stack_off)):
        out.append(_fp32_record(f"layers MoE stack call {i} output, normlinear", h_nl, h_off))
        out.append(_fp32_record(f"layers MoE stack call {i} kept hidden, normlinear", kept_nl, kept_off))
    # the MoE layers' q/k/v projections only (their MLP is routed experts): 3 calls x 2 layers
    out.append({"check": "layers normlinear launched for every MoE attention", "kind": "launch",
                "launched": launched.get("normlinear.kernel", 0) - before,
                "ok": launched.get("normlinear.kernel", 0) - before == 6})
    layers.NORM_LINEAR = False
    # the grouped path (many pairs: prefills, large decode batches) needs bfloat16 for torch._grouped_mm
    ex = init(Experts(8, 64, 32)).bfloat16()
    xb, shared, logit = (torch.randn(*n).to(device).bfloat16() for n in ((40, 64), (40, 64), (40, 1)))
    idx = torch.stack([torch.randperm(8)[:2] for _ in range(40)]).to(device)
    w = torch.softmax(torch.randn(40, 2), -1).to(device).bfloat16()
    got = ex.grouped_fused(xb, idx, w, shared, logit)
    want = ex.grouped(xb, idx, w) + torch.sigmoid(logit) * shared
    want32 = experts.reference(xb.float(), idx, w.float(), ex.gate_up.float(), ex.down.float(), shared.float(),
                               logit.float())
    out.append(_budget_record("layers grouped MoE, align + combine kernels vs plain grouped", got, want, want32))
    patches.close()
    missing = [f"{m.__name__.rsplit('.', 1)[-1]}.{n}" for m, n in watched
               if not launched.get(f"{m.__name__.rsplit('.', 1)[-1]}.{n}")]
    out.append({"check": "layers launched every kernel", "kind": "launch", "launched": launched, "missing": missing,
                "ok": not missing})
    return out


def check_invariant(device: str) -> list[dict]:
    """kernels.invariant against its references, and its contract: a row's bits are the same
    whatever else shares the launch (row count, position, other tokens' experts, padded keys)."""
    from voxpipe.kernels import invariant
    g = torch.Generator().manual_seed(0)
    out = []
    x32, w32, b32 = (torch.randn(*n, generator=g).to(device) for n in ((70, 96), (80, 96), (80,)))
    for dt in (torch.float32, torch.bfloat16):
        x, w, b = x32.to(dt), w32.to(dt), b32.to(dt)
        name = str(dt)[6:]
        assert invariant.eligible(x, w, b), f"invariant matmul should launch on {device}"
        got = invariant.run(x, w, b)
        if dt == torch.float32:
            out.append(_fp32_record(f"invariant matmul {name}", got, invariant.reference(x, w, b)))
        else:
            out.append(_budget_record(f"invariant matmul {name}", got, invariant.reference(x, w, b),
                                      invariant.reference(x.float(), w.float(), b.float())))
        alone = torch.cat([invariant.run(x[i:i + 1], w, b) for i in (0, 33, 69)])
        out.append(_exact_record(f"invariant matmul {name}: rows alone = rows among 70", alone, got[[0, 33, 69]]))
        perm = torch.randperm(70, generator=g).to(device)
        out.append(_exact_record(f"invariant matmul {name}: rows moved", invariant.run(x[perm], w, None),
                                 invariant.run(x, w, None)[perm]))
    e, h, inter, k = 8, 64, 32, 2
    gate_up32 = (torch.randn(e, 2 * inter, h, generator=g) / 8).to(device)
    down32 = (torch.randn(e, h, inter, generator=g) / 6).to(device)
    xs32 = torch.randn(40, h, generator=g).to(device)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(40)]).to(device)
    for dt in (torch.float32, torch.bfloat16):
        xs, gu, dn = xs32.to(dt), gate_up32.to(dt), down32.to(dt)
        name = str(dt)[6:]
        assert invariant.moe_eligible(xs, idx, gu, dn)
        got = invariant.run_moe(xs, idx, gu, dn)
        if dt == torch.float32:
            out.append(_fp32_record(f"invariant moe {name}", got, invariant.reference_moe(xs, idx, gu, dn)))
        else:
            out.append(_budget_record(f"invariant moe {name}", got, invariant.reference_moe(xs, idx, gu, dn),
                                      invariant.reference_moe(xs.float(), idx, gu.float(), dn.float())))
        one = invariant.run_moe(xs[:1], idx[:1], gu, dn)
        out.append(_exact_record(f"invariant moe {name}: a token alone = among 40", one, got[:k]))
        flipped = invariant.run_moe(xs.flip(0), idx.flip(0), gu, dn)
        out.append(_exact_record(f"invariant moe {name}: tokens reordered", flipped[-k:], got[:k]))
        tw = torch.softmax(torch.randn(40, k, generator=g), -1).to(device)
        assert invariant.weighted_sum_eligible(got, tw) == (dt == torch.bfloat16)
        summed = invariant.run_weighted_sum(got, tw)
        out.append(_exact_record(f"invariant weighted sum {name} = the ordered sum's bits", summed,
                                 invariant.reference_weighted_sum(got, tw)))
        out.append(_exact_record(f"invariant weighted sum {name}: a token alone = among 40",
                                 invariant.run_weighted_sum(got[:k], tw[:1]), summed[:1]))
        # with a shared expert (the talker's): its gated add in the same launch
        sh = torch.randn(40, h, generator=g).to(device, dt)
        lg = (torch.randn(40, 1, generator=g) * 3).to(device, dt)
        assert invariant.weighted_sum_eligible(got, tw, sh, lg) == (dt == torch.bfloat16)
        fused = invariant.run_weighted_sum(got, tw, sh, lg)
        if dt == torch.bfloat16:
            ref32 = invariant.reference_weighted_sum(got.float(), tw.float(), sh.float(), lg.float())
            out.append(_budget_record(f"invariant weighted sum + shared {name}", fused,
                                      invariant.reference_weighted_sum(got, tw, sh, lg), ref32))
        else:
            out.append(_exact_record(f"invariant weighted sum + shared {name} = the reference", fused,
                                     invariant.reference_weighted_sum(got, tw, sh, lg)))
        out.append(_exact_record(f"invariant weighted sum + shared {name}: a token alone = among 40",
                                 invariant.run_weighted_sum(got[7 * k:8 * k], tw[7:8], sh[7:8], lg[7:8]), fused[7:8]))
        out.append(_exact_record(f"invariant weighted sum + shared {name}: tokens reordered",
                                 invariant.run_weighted_sum(got.view(40, k, -1).flip(0).reshape(40 * k, -1),
                                                            tw.flip(0), sh.flip(0), lg.flip(0)), fused.flip(0)))
    # the experts' pair order (by_expert): counting in one program = the stable sort's integers, for
    # spread, skewed, single-expert and one-pair routes up to COUNT_MAX pairs, and so is the tile
    # table built in the same launch, so that which path a step's pair count picks changes no bit
    routes = [torch.randint(0, 128, (64 * 6,), generator=g), torch.randint(0, 3, (41,), generator=g) * 40,
              torch.full((17,), 5), torch.randint(0, 8, (1,), generator=g),
              torch.randint(0, 3, (304,), generator=g) * 3 + 121,      # experts of several tiles, the last one
              torch.randint(0, 128, (invariant.COUNT_MAX,), generator=g)]
    count_max = invariant.COUNT_MAX
    for flat in (r.to(device) for r in routes):
        counted = invariant.by_expert(flat, 128)
        invariant.COUNT_MAX = 0
        try:
            sorted_ = invariant.by_expert(flat, 128)
        finally:
            invariant.COUNT_MAX = count_max
        same = all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(counted, sorted_))
        same &= torch.equal(flat[counted[0]], torch.sort(flat, stable=True).values)
        out.append({"check": f"invariant by_expert: {flat.numel()} pairs counted = stably sorted", "kind": "exact",
                    "ok": bool(same)})
        for k in [k for k in (1, 8) if flat.numel() % k == 0]:     # the tile table too (K pairs a token)
            table = invariant.tiles(flat.view(-1, k), 128)
            invariant.COUNT_MAX = 0
            try:
                want = invariant.tiles(flat.view(-1, k), 128)
            finally:
                invariant.COUNT_MAX = count_max
            same = all(torch.equal(a, b) and a.dtype == torch.int64 for a, b in zip(table, want))
            out.append({"check": f"invariant tiles: {flat.numel()} pairs / top-{k} counted = sorted", "kind": "exact",
                        "ok": bool(same)})
    q32 = torch.randn(2, 4, 5, 32, generator=g).to(device)
    kv32 = [torch.randn(2, 2, 40, 32, generator=g).to(device) for _ in range(2)]
    lengths = torch.tensor([[23], [40]]).to(device)
    mask = (torch.arange(40).to(device)[None, None, :] < lengths[:, :, None] - torch.arange(5).to(device)[None, :, None].flip(1))
    mask = mask[:, None]                                                        # [2, 1, 5, 40]
    for dt in (torch.float32, torch.bfloat16):
        q, kk, vv = q32.to(dt), kv32[0].to(dt), kv32[1].to(dt)
        name = str(dt)[6:]
        assert invariant.attention_eligible(q, kk, vv, mask)
        got = invariant.run_attention(q, kk, vv, mask, 0.2)
        if dt == torch.float32:
            out.append(_fp32_record(f"invariant attention {name}",
                                    got, invariant.reference_attention(q, kk, vv, mask, 0.2)))
        else:
            out.append(_budget_record(f"invariant attention {name}", got,
                                      invariant.reference_attention(q, kk, vv, mask, 0.2),
                                      invariant.reference_attention(q.float(), kk.float(), vv.float(), mask, 0.2),
                                      BUDGET_16_P))
        # sequence 0 alone, its keys cut to its 23 positions, its first 3 queries only
        alone = invariant.run_attention(q[:1, :, :3], kk[:1, :, :23], vv[:1, :, :23], mask[:1, :, :3, :23], 0.2)
        out.append(_exact_record(f"invariant attention {name}: alone, unpadded = in the batch", alone, got[:1, :, :3]))
        # padded to 100 keys (non-finite-free garbage past the mask) and 9 queries
        pad_k = torch.cat((kk, torch.randn(2, 2, 60, 32, generator=g).to(device, dt)), dim=2)
        pad_v = torch.cat((vv, torch.randn(2, 2, 60, 32, generator=g).to(device, dt)), dim=2)
        pad_q = torch.cat((q, torch.randn(2, 4, 4, 32, generator=g).to(device, dt)), dim=2)
        pad_mask = torch.nn.functional.pad(mask, (0, 60, 0, 4), value=False)
        padded = invariant.run_attention(pad_q, pad_k, pad_v, pad_mask, 0.2)
        out.append(_exact_record(f"invariant attention {name}: padded keys and queries", padded[:, :, :5], got))
    cases = {"float64": (x32.double(), w32.double()), "weight not contiguous": (x32, w32.t().contiguous().t())}
    for name, (xi, wi) in cases.items():
        out.append(_fallback_record(f"invariant matmul fallback {name}", invariant.eligible(xi, wi),
                                    invariant.run(xi, wi), invariant.reference(xi, wi)))
    with _disabled():
        out.append(_fallback_record("invariant attention fallback ENABLED=False",
                                    invariant.attention_eligible(q32, kv32[0], kv32[1], mask),
                                    invariant.run_attention(q32, kv32[0], kv32[1], mask, 0.2),
                                    invariant.reference_attention(q32, kv32[0], kv32[1], mask, 0.2)))
    return out


def check_paged_attention(device: str) -> list[dict]:
    """Decode (S=1) and extend (S>1) rows of mixed lengths over shuffled block tables, split and
    unsplit, narrow and wide tiles (kernels.paged_attention.WIDE_TILE: more than 64 rows in 16 bits);
    a row alone equals the row inside a batch bit for bit when the split is fixed; the unmasked tiles
    walked first or not, the same bits in the interpreter; and the fallbacks."""
    from voxpipe.kernels import paged_attention as pa
    g = torch.Generator().manual_seed(12)
    out = []
    blocks = 48
    for n, hq, hkv, s, d, bs, bound, split in [(3, 8, 2, 1, 32, 16, 100, None), (4, 4, 4, 1, 16, 8, 300, 64),
                                              (2, 8, 2, 5, 32, 16, 90, 64), (2, 8, 2, 20, 32, 16, 70, None),
                                              (1, 8, 2, 1, 32, 16, 600, None), (2, 8, 2, 24, 32, 16, 400, 256)]:
        width = -(-bound // bs) + 1
        tables = torch.stack([torch.randperm(blocks, generator=g)[:width] for _ in range(n)]).to(device)
        start = torch.randint(0, bound - s + 1, (n,), generator=g)
        start[0] = bound - s                                           # one row reaches the bound
        start = start.to(device)
        for dt in (torch.float32, torch.bfloat16):
            kc, vc = (torch.randn(blocks, hkv, bs, d, generator=g).to(device).to(dt) for _ in range(2))
            q = torch.randn(n, s, hq, d, generator=g).to(device).to(dt).transpose(1, 2)   # head-strided
            tag = f"{str(dt)[6:]} n={n} {hq}/{hkv}x{d} S={s} bs={bs} bound={bound} split={split}"
            assert pa.eligible(q, kc, vc, tables, start), f"paged attention {tag} should launch on {device}"
            got = pa.run(q, kc, vc, tables, start, bound, d ** -0.5, split)
            want = pa.reference(q, kc, vc, tables, start, bound, d ** -0.5)
            if dt == torch.float32:
                out.append(_fp32_record(f"paged attention {tag}", got, want))
            else:
                want32 = pa.reference(q.float(), kc.float(), vc.float(), tables, start, bound, d ** -0.5)
                out.append(_budget_record(f"paged attention {tag}", got, want, want32))
            # the whole tiles walked first unmasked, or every tile masked, at the same tiles: the same
            # arithmetic (bits equal where nothing contracts a multiply-add differently: the interpreter)
            opened, closed = (pa.kernel(q, kc, vc, tables, start, bound, d ** -0.5, split, open_first=o)
                              for o in (True, False))
            if device == "cpu":
                out.append(_exact_record(f"paged attention open_first {tag}", opened, closed))
            elif dt == torch.float32:
                out.append(_fp32_record(f"paged attention open_first {tag}", opened, want))
            else:
                out.append(_budget_record(f"paged attention open_first {tag}", opened, want, want32))
            if split is not None:
                alone = [pa.run(q[i:i + 1], kc, vc, tables[i:i + 1], start[i:i + 1], int(start[i]) + s, d ** -0.5,
                                split) for i in range(n)]
                out.append(_exact_record(f"paged attention batch-invariant {tag}", torch.cat(alone), got))
    q = torch.randn(2, 4, 1, 32, generator=g).to(device)
    kc, vc = torch.randn(8, 2, 4, 32, generator=g).to(device), torch.randn(8, 2, 4, 32, generator=g).to(device)
    tables, start = torch.arange(8, device=device).view(2, 4), torch.tensor([5, 9], device=device)
    cases = {
        "float64": (q.double(), kc.double(), vc.double(), tables, start),
        "head_dim not a power of two": (q[..., :24], kc[..., :24].contiguous(), vc[..., :24].contiguous(), tables, start),
        "cache not contiguous": (q, kc.transpose(2, 3).contiguous().transpose(2, 3), vc, tables, start),
        "int32 tables": (q, kc, vc, tables.int(), start),
    }
    for name, args in cases.items():
        eligible = pa.eligible(*args)
        out.append(_fallback_record(f"paged attention fallback {name}", eligible, pa.run(*args, 10, 0.2),
                                    pa.reference(*args, 10, 0.2)))
    with _disabled():
        out.append(_fallback_record("paged attention fallback ENABLED=False", pa.eligible(q, kc, vc, tables, start),
                                    pa.run(q, kc, vc, tables, start, 10, 0.2),
                                    pa.reference(q, kc, vc, tables, start, 10, 0.2)))
    return out


def invariant_convs() -> dict[str, torch.nn.Module]:
    """code2wav's convolution shapes in the batch-invariant mode (determinism.apply): a dense causal
    conv (kernel 7, dilation 3), a pointwise one, a depthwise one, the upsampler (kernel = stride) and
    the decoder's transposed conv (kernel 2 * stride)."""
    from torch import nn

    from voxpipe.services.runtime import determinism

    torch.manual_seed(5)
    convs = {"conv k7 d3": nn.Conv1d(8, 12, 7, dilation=3), "conv k1": nn.Conv1d(8, 12, 1),
             "depthwise k7": nn.Conv1d(8, 8, 7, groups=8), "transposed k=s=2": nn.ConvTranspose1d(8, 12, 2, stride=2),
             "transposed k=2s=6": nn.ConvTranspose1d(8, 12, 6, stride=3)}
    return {name: determinism.apply(c.requires_grad_(False)) for name, c in convs.items()}


def _tf32_conv_record(name: str, conv, base, x: torch.Tensor, got: torch.Tensor) -> dict:
    """A float32 convolution through TF32 operands: within TF32's rounding of both operands (2^-11
    relative each) of the float64 result, per output, bounded by the conv of |x| and |w|."""
    import copy

    c64 = copy.deepcopy(conv).double()
    want = base.forward(c64, x.double())
    c64.weight.abs_()
    if c64.bias is not None:
        c64.bias.zero_()
    bound = base.forward(c64, x.double().abs()) * 2.0 ** -9 + 1e-6
    err = (got.double() - want).abs()
    return {"check": name, "kind": "tf32", "max_abs_err": float(err.max()),
            "ok": got.dtype == torch.float32 and got.shape == want.shape and bool((err <= bound).all())}


def check_invariant_convs(device: str) -> list[dict]:
    """`invariant_convs` on the kernel path: close to the plain convolution, and each sample's bits
    the same alone as inside a batch of 3 (and at another row)."""
    from torch import nn

    g = torch.Generator().manual_seed(6)
    out = []
    x32 = torch.randn(3, 8, 25, generator=g).to(device)
    for name, conv in invariant_convs().items():
        for dt in (torch.float32, torch.bfloat16):
            c = conv.to(device, dt)           # the transposed convs' row weights are buffers: moved too
            x = x32.to(dt)
            base = nn.ConvTranspose1d if isinstance(c, nn.ConvTranspose1d) else nn.Conv1d
            want = base.forward(c, x)
            got = c(x)
            tag = f"invariant {name} {str(dt)[6:]}"
            if dt == torch.float32 and x.is_cuda and torch.backends.cudnn.allow_tf32 and c.groups == 1:
                out.append(_tf32_conv_record(tag, c, base, x, got))     # the mode's convolutions take TF32 there
            elif dt == torch.float32:
                out.append(_fp32_record(tag, got, want))
            else:
                w32 = conv.to(torch.float32)
                want32 = base.forward(w32, x.float())
                out.append(_budget_record(tag, got, want, want32))
                conv.to(dt)
            alone = torch.cat([c(x[i:i + 1]) for i in range(3)])
            out.append(_exact_record(f"{tag}: samples alone = in a batch", alone, got))
            out.append(_exact_record(f"{tag}: samples moved", c(x.flip(0)), got.flip(0)))
            if x.is_cuda:   # past GPU_SAMPLES: the larger cuDNN calls where proven (determinism.SAMPLE_SPANS)
                big = torch.randn(70, 8, 25, generator=g).to(device, dt)
                picks = [0, 17, 33, 63, 64, 69]
                alone = torch.cat([c(big[i:i + 1]) for i in picks])
                out.append(_exact_record(f"{tag}: 70 samples: alone = in the batch", alone, c(big)[picks]))
    return out


def paged_views_rows(device: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One sequence's 40 query rows [Hq, 40, D] through every paged view in the batch-invariant mode
    (inside determinism.scope()), each beside another sequence and into blocks of its own: a whole
    prefill from position 0 (right-padded to 64 rows, tables narrower than 64 positions), packed
    segments (0-17, then 18-39 from the cached prefix), an extend from 0 (30 rows padded to 32 in a
    graph-wide kv bound) and then decode steps 30-39 (kv bound 64). On the kernel (CUDA or the
    interpreter) and on the CPU's reference path alike, every view must give the same bits."""
    from voxpipe.services.runtime import determinism
    from voxpipe.services.runtime.paged_kv import PagedKVCache, PagedPackedStep

    g = torch.Generator().manual_seed(21)
    hq, hkv, d, bs, length = 8, 2, 32, 16, 40

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    q, k, v = rand(1, hq, length, d), rand(1, hkv, length, d), rand(1, hkv, length, d)
    oq, ok, ov = rand(1, hq, 64, d), rand(1, hkv, 64, d), rand(1, hkv, 64, d)       # the other sequence
    cache = PagedKVCache(1, 24, bs, hkv, d, dtype, device)
    scale = d ** -0.5
    rows = {}

    def pad(t, n):
        return torch.cat((t, rand(1, t.shape[1], n - t.shape[2], d)), 2)

    with torch.no_grad(), determinism.scope():
        tables = cache.table_tensor([[3, 7, 1], [5, 0, 9]], 3, device)
        view = cache.prefill_view(tables, 64)
        both = [torch.cat((pad(t, 64), o[:, :, :64]), 0) for t, o in ((q, oq), (k, ok), (v, ov))]
        rows["whole prefill"] = view.attend(0, *both, scale)[0, :, :length]
        parts = []
        for lo, hi in ((0, 18), (18, length)):
            step = PagedPackedStep.pack([([10, 2, 8], 0, 7), ([4, 12, 6], lo, hi - lo)])
            qs, ks, vs = (torch.cat((o[:, :, :7], t[:, :, lo:hi]), 2) for t, o in ((q, oq), (k, ok), (v, ov)))
            parts.append(cache.packed(step).attend(0, qs, ks, vs, scale)[0, :, 7:])
        rows["packed segments"] = torch.cat(parts, 1)
        tables = cache.table_tensor([[11, 13, 14, 15], [16, 17]], 4, device)
        start, n = torch.tensor([0, 0], device=device), torch.tensor([30, 20], device=device)
        view = cache.extend_view(tables, start, n, 32, 64)
        both = [torch.cat((pad(t[:, :, :30], 32), o[:, :, :32]), 0) for t, o in ((q, oq), (k, ok), (v, ov))]
        parts = [view.attend(0, *both, scale)[0, :, :30]]
        for p in range(30, length):
            start = torch.tensor([p, 20 + p - 30], device=device)
            view = cache.decode_view(2, 64, tables, start)
            parts.append(view.attend(0, *(torch.cat((t[:, :, p:p + 1], o[:, :, p:p + 1]), 0)
                                         for t, o in ((q, oq), (k, ok), (v, ov))), scale)[0])
        rows["extend, then decode"] = torch.cat(parts, 1)
    return rows


def check_paged_views(device: str) -> list[dict]:
    """`paged_views_rows` on the kernel: one computation per query row, whatever the view."""
    out = []
    for dt in (torch.float32, torch.bfloat16):
        rows = paged_views_rows(device, dt)
        want = rows.pop("whole prefill")
        for name, got in rows.items():
            out.append(_exact_record(f"paged views {str(dt)[6:]}: {name} = whole prefill", got, want))
    return out


CHECKS = {"rmsnorm": check_rmsnorm, "snakebeta": check_snakebeta, "sampling": check_sampling, "sample": check_sample,
          "rope": check_rope,
          "moe": check_moe, "glu": check_glu, "normlinear": check_normlinear, "attention": check_attention,
          "experts": check_experts, "invariant": check_invariant, "layers": check_layers,
          "paged_attention": check_paged_attention, "paged_views": check_paged_views,
          "invariant_convs": check_invariant_convs}


def assert_records(records: list[dict]) -> None:
    assert records, "no checks ran"
    bad = [r for r in records if not r["ok"]]
    assert not bad, "outside the error budget / contract:\n" + "\n".join(json.dumps(r) for r in bad)


# ---------------------------------------------------------------- tests

# the interpreter checks in two processes at once (one core each: the interpreter is single-threaded),
# of about equal CPU time
INTERPRETER_GROUPS = (("layers", "attention", "rope", "sampling", "rmsnorm", "glu", "normlinear", "paged_views"),
                      ("experts", "paged_attention", "moe", "sample", "invariant", "snakebeta", "invariant_convs"))


def interpreter_runs() -> dict | None:
    """INTERPRETER_GROUPS' subprocesses (none without Triton), started in the background
    (conftest.BackgroundRun) once the session's tests are collected: they need nothing from the
    tests that run before them."""
    from conftest import BackgroundRun

    if not TRITON:
        return None
    env = dict(os.environ, TRITON_INTERPRET="1", VOXPIPE_KERNELS="1")
    return {group: BackgroundRun([sys.executable, str(Path(__file__).resolve()), *group], env=env)
            for group in INTERPRETER_GROUPS}


BACKGROUND = {"interpreted": interpreter_runs}


@pytest.fixture(scope="module")
def interpreted() -> dict[str, tuple[subprocess.CompletedProcess, list[dict]]]:
    """Every kernel's checks under Triton's interpreter, in INTERPRETER_GROUPS' subprocesses (torch and
    Triton imported once a process, not once a kernel): each kernel's records and its process; a
    check that raises is a failed record."""
    from conftest import background

    assert sorted(k for group in INTERPRETER_GROUPS for k in group) == sorted(KERNELS)
    runs = background("interpreted", interpreter_runs)
    procs = [runs[group].result(timeout=900) for group in INTERPRETER_GROUPS]
    out = {k: (proc, []) for group, proc in zip(INTERPRETER_GROUPS, procs) for k in group}
    for proc in procs:
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                record = json.loads(line)
                out[record.pop("kernel")][1].append(record)
    return out


@pytest.mark.skipif(not TRITON, reason="triton is not installed (it is in the `test` extras): "
                                       "the interpreter checks need it")
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_in_triton_interpreter(kernel: str, interpreted) -> None:
    proc, records = interpreted[kernel]
    assert records, f"no records for {kernel} (exit code {proc.returncode}):\n{proc.stderr[-4000:]}"
    assert_records(records)
    assert any(r["kind"] != "fallback" for r in records)


def test_cpu_without_interpreter_uses_reference() -> None:
    from voxpipe.kernels import common, rmsnorm, sampling, snakebeta
    if common.INTERPRET:
        pytest.skip("this pytest process itself runs with TRITON_INTERPRET=1")
    x, w = torch.randn(4, 96), torch.ones(96)
    assert not rmsnorm.eligible(x, w)
    assert torch.equal(rmsnorm.run(x, w, EPS), rmsnorm.reference(x, w, EPS))
    xs, a = torch.randn(2, 8, 30), torch.zeros(8)
    assert not snakebeta.eligible(xs, a, a)
    assert torch.equal(snakebeta.run(xs, a, a), snakebeta.reference(xs, a, a))
    sup, ban = torch.zeros(96, dtype=torch.bool), torch.ones(4, dtype=torch.bool)
    assert not sampling.eligible(x, sup, ban)
    assert torch.equal(sampling.run(x, sup, ban, 1), sampling.reference(x, sup, ban, 1))


def test_switch_reads_environment() -> None:
    code = "import voxpipe.kernels as k; print(k.ENABLED)"
    for value, expected in (("0", "False"), ("1", "True")):
        proc = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, VOXPIPE_KERNELS=value),
                              capture_output=True, text=True, timeout=60)
        assert proc.stdout.strip() == expected, (value, proc.stdout, proc.stderr)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_on_cuda(kernel: str) -> None:
    assert_records(CHECKS[kernel]("cuda"))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_invariant_rows_on_cuda(capsys) -> None:
    """The batch-invariant mode's cuBLAS row calls (determinism.rows_linear) at every nn.Linear shape of
    the released config: a row's bits the same alone and at every position of batches of every size,
    eager, replayed at every decode graph bucket, and in prefill-sized batches (bench/invariant_rows.py)."""
    from voxpipe.bench import invariant_rows

    code = invariant_rows.main(["--no-time"])
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert code == 0, [x for x in lines if not x.get("check", True) or not x.get("buckets", True)
                       or not x.get("prefill", True)]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
def test_layers_dispatch_on_cuda(monkeypatch) -> None:
    """RMSNorm / SnakeBeta / DecoderLayer on CUDA with the kernels on match them with the switch off."""
    import voxpipe.kernels as package
    from voxpipe.services.code2wav.model import SnakeBeta
    from voxpipe.services.runtime.layers import RMSNorm

    torch.manual_seed(3)
    norm = RMSNorm(1024, EPS).cuda().to(torch.bfloat16).requires_grad_(False)
    norm.weight.normal_(1.0, 0.2)
    snake = SnakeBeta(96).cuda().requires_grad_(False)
    snake.alpha.normal_(0, 0.5)
    snake.beta.normal_(0, 0.5)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16) * 2
    xs = torch.randn(2, 96, 300, device="cuda") * 3
    with torch.inference_mode():
        on = norm(x), snake(xs)
        monkeypatch.setattr(package, "ENABLED", False)
        off = norm(x), snake(xs)
    assert_records([_budget_record("RMSNorm module bf16", on[0], off[0], norm.weight.float() * (
        x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS))),
        _fp32_record("SnakeBeta module fp32", on[1], off[1])])


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.skipif(not TRITON, reason="triton is not installed")
def test_decoder_stack_fused_norms_on_cuda(omni_config, monkeypatch) -> None:
    """The talker's decoder (MoE) in bfloat16 on CUDA: with the kernels (RMSNorm, and the residual add
    fused into the post-attention norm) its error against the float32 stack stays within STACK_BUDGET
    of the same bfloat16 stack with the kernels off (errors compound over the layers, so the margin
    is wider than a single kernel's)."""
    import copy

    import voxpipe.kernels as package
    from voxpipe.services.runtime.kv_cache import GrowingCache
    from voxpipe.services.runtime.layers import DecoderStack

    stack_budget = 1.5
    cfg = omni_config.talker.text
    torch.manual_seed(4)
    stack32 = DecoderStack(cfg)
    with torch.no_grad():
        for name, p in stack32.named_parameters():
            p.normal_(1.0, 0.2) if name.endswith("norm.weight") else p.normal_(0.0, 0.05)
    stack32 = stack32.cuda().requires_grad_(False)
    stack16 = copy.deepcopy(stack32).to(torch.bfloat16)
    x = torch.randn(2, 6, cfg.hidden_size, device="cuda")
    positions = torch.arange(6, device="cuda").expand(2, 6)
    with torch.inference_mode():
        on16 = stack16(x.bfloat16(), positions, GrowingCache())[0]
        monkeypatch.setattr(package, "ENABLED", False)
        off16 = stack16(x.bfloat16(), positions, GrowingCache())[0]
        off32 = stack32(x, positions, GrowingCache())[0]
    rec = _budget_record("talker DecoderStack bf16", on16, off16, off32)
    rec["ok"] = (on16.dtype == torch.bfloat16 and rec["kernel_max"] <= stack_budget * rec["ref16_max"] + 1e-6
                 and rec["kernel_mean"] <= stack_budget * rec["ref16_mean"] + 1e-6)
    assert_records([rec])


if __name__ == "__main__":   # the interpreter subprocess: python tests/test_kernels.py KERNEL...
    import traceback

    device = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
    for kernel in sys.argv[1:]:
        try:
            for record in CHECKS[kernel](device):
                print(json.dumps({"kernel": kernel, **record}), flush=True)
        except Exception:   # this kernel fails; the others still run
            print(json.dumps({"kernel": kernel, "check": f"{kernel} raised", "kind": "error", "ok": False,
                              "traceback": traceback.format_exc()[-4000:]}), flush=True)
