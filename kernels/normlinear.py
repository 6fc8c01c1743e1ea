"""Residual add + RMSNorm + the linear projection that reads the norm, in one launch, for the few
rows of a decode step: the decoder's pre-norm pattern (`norm -> q/k/v projection`, `norm -> gate/up
projection -> SwiGLU`) without the normed rows' round trip through memory and without two or three
of the step's launches. Built for the code predictor (15 passes of 5 layers per frame, B rows).

Contract (`reference`, as `voxpipe.services.runtime.layers.DecoderLayer` computes it):
    x: [M, K] or None, residual: [M, K]  float32 / bfloat16 / float16, one dtype
    norm_weight: [K] (that dtype), eps: float; weight: [N, K] (that dtype, a Linear's weight, no bias)
    new_residual = residual + x (rounded, as torch's add), or residual itself when x is None
    normed = rmsnorm.reference(new_residual, norm_weight, eps)
    y = F.linear(normed, weight)                    -> [M, N]
    glu=True: weight holds gate rows then up rows (N = 2I): y = glu.reference(y) -> [M, I]
    returns (y, new_residual)
The kernel rounds where the reference does (the sum, the normalised row, the norm's product, each
projection output, silu's result and the SwiGLU product): it differs from the reference only by
the float32 accumulation order of the dot products. (16-bit operands go to tl.dot as they are on the
GPU -- their products are exact in its float32 accumulator -- and as float32 under Triton's CPU
interpreter, whose 16-bit dot is wrong.)

`run` launches the kernel when `common.launchable` holds and: every tensor contiguous, one float
dtype, shapes as above, 1 <= M <= MAX_M, K <= MAX_K and a multiple of 16, and N (or I) a multiple
of 16. Otherwise it returns the reference. Programs: (BLOCK_N output columns) x (BLOCK_M rows);
each computes its rows' norm statistics itself (K is short) and program column 0 writes the sum.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import glu as glu_kernel
from . import rmsnorm
from .common import FLOAT_DTYPES, INTERPRET, device_of, launchable, round_to, tl, triton

MAX_M = 128         # rows of a decode step (the code predictor's first pass has two a sequence)
MAX_K = 8192


def reference(x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
              weight: torch.Tensor, glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual if x is None else residual + x
    y = F.linear(rmsnorm.reference(new_residual, norm_weight, eps), weight)
    return (glu_kernel.reference(y) if glu else y), new_residual


def eligible(x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
             glu: bool = False) -> bool:
    if residual.ndim != 2 or weight.ndim != 2:
        return False
    m, k = residual.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    tensors = (residual, norm_weight, weight) + (() if x is None else (x,))
    return (1 <= m <= MAX_M and 16 <= k <= MAX_K and k % 16 == 0 and n >= 16 and n % 16 == 0
            and (not glu or weight.shape[0] % 2 == 0)
            and weight.shape[1] == k and norm_weight.shape == (k,) and (x is None or x.shape == residual.shape)
            and residual.dtype in FLOAT_DTYPES and all(t.dtype == residual.dtype for t in tensors)
            and all(t.is_contiguous() for t in tensors) and launchable(*tensors))


def run(x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
        glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if eligible(x, residual, norm_weight, weight, glu):
        return kernel(x, residual, norm_weight, eps, weight, glu)
    return reference(x, residual, norm_weight, eps, weight, glu)


class Config(NamedTuple):
    """Launch shape: output columns and K chunk per program, warps, software-pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def config_for(m: int, n: int, k: int, glu: bool) -> Config:
    """The launch shape for [m, k] rows against n output columns (tl.dot needs 16 at least). Narrow
    column blocks keep enough programs streaming the weight when M is small."""
    return Config(32 if n >= 2048 else 16, 128)


def kernel(x: torch.Tensor | None, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
           weight: torch.Tensor, glu: bool = False, config: Config | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton; assumes `eligible(...)`. `config` overrides `config_for` (bench/normlinear_tune.py)."""
    m, k = residual.shape
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    out = torch.empty(m, n, dtype=residual.dtype, device=residual.device)
    new_residual = residual if x is None else torch.empty_like(residual)
    block_m = max(16, min(64, triton.next_power_of_2(m)))
    cfg = config or config_for(m, n, k, glu)
    with device_of(residual):
        _norm_linear[(triton.cdiv(n, cfg.block_n), triton.cdiv(m, block_m))](
            residual if x is None else x, residual, new_residual, norm_weight, weight, out, m, n, k, eps,
            HAS_X=x is not None, GLU=glu, DOT_F32=residual.dtype == torch.float32 or INTERPRET, BLOCK_M=block_m,
            BLOCK_N=cfg.block_n, BLOCK_K=min(cfg.block_k, triton.next_power_of_2(k)), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    return out, new_residual


if triton is not None:
    @triton.jit
    def _summed(x_ptr, res_ptr, rows, row_ok, start, k, HAS_X: tl.constexpr, BLOCK_K: tl.constexpr):
        """Columns start .. start + BLOCK_K of the rows' residual (+ x, rounded as torch's add)."""
        kk = start + tl.arange(0, BLOCK_K)
        offs = rows[:, None].to(tl.int64) * k + kk[None, :]
        ok = row_ok[:, None] & (kk[None, :] < k)
        h = tl.load(res_ptr + offs, mask=ok, other=0.0)
        if HAS_X:
            h = round_to(h.to(tl.float32) + tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32),
                         res_ptr.dtype.element_ty)
        return kk, h

    @triton.jit(do_not_specialize=["m"])
    def _norm_linear(x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, out_ptr, m, n, k, eps, HAS_X: tl.constexpr,
                     GLU: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < m
        dtype = res_ptr.dtype.element_ty
        # pass 1: the rows' sum (stored once) and its mean square
        sq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in range(0, k, BLOCK_K):
            kk, h = _summed(x_ptr, res_ptr, rows, row_ok, start, k, HAS_X, BLOCK_K)
            if HAS_X and pid_n == 0:
                tl.store(res_out_ptr + rows[:, None].to(tl.int64) * k + kk[None, :], h,
                         mask=row_ok[:, None] & (kk[None, :] < k))
            h = h.to(tl.float32)
            sq += tl.sum(h * h, axis=1)
        rstd = tl.rsqrt(sq / k + eps)
        # pass 2: the normed rows times the weight's columns (gate and up columns for GLU)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        col_ok = cols < n
        for start in range(0, k, BLOCK_K):
            kk, h = _summed(x_ptr, res_ptr, rows, row_ok, start, k, HAS_X, BLOCK_K)
            h = round_to(h.to(tl.float32) * rstd[:, None], dtype).to(tl.float32)
            nw = tl.load(nw_ptr + kk, mask=kk < k, other=0.0).to(tl.float32)
            a = round_to(nw[None, :] * h, dtype)                                   # [BLOCK_M, BLOCK_K]
            w_offs = cols[None, :].to(tl.int64) * k + kk[:, None]                   # [BLOCK_K, BLOCK_N]
            w_ok = col_ok[None, :] & (kk[:, None] < k)
            if DOT_F32:     # float32 operands, exact products (not TF32); 16-bit operands are exact in it too
                a = a.to(tl.float32)
            w = tl.load(w_ptr + w_offs, mask=w_ok, other=0.0)
            if DOT_F32:
                acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
            else:
                acc += tl.dot(a, w)
            if GLU:
                w = tl.load(w_ptr + n.to(tl.int64) * k + w_offs, mask=w_ok, other=0.0)
                if DOT_F32:
                    acc_up += tl.dot(a, w.to(tl.float32), input_precision="ieee")
                else:
                    acc_up += tl.dot(a, w)
        y = round_to(acc, dtype)
        if GLU:
            gate = y.to(tl.float32)
            act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
            y = round_to(act * round_to(acc_up, dtype).to(tl.float32), dtype)
        out_offs = rows[:, None].to(tl.int64) * n + cols[None, :]
        tl.store(out_ptr + out_offs, y, mask=row_ok[:, None] & col_ok[None, :])
