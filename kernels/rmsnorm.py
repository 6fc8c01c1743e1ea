"""Fused RMSNorm, and fused "residual add + RMSNorm" for the decoder's pre-norm pattern.

Contract (`reference`, as `voxpipe.services.runtime.layers.RMSNorm`):
    x: [..., N] float32 / bfloat16 / float16; weight: [N] any of those; eps: float
    out = weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)
    dtype of out = torch.promote_types(weight.dtype, x.dtype)
Statistics are float32; the normalised row is rounded to x.dtype before the weight multiply,
and the product is rounded once to the output dtype -- the same roundings as the reference, so
results differ only by the float32 reduction order / rsqrt (a last-ulp flip at most).

`reference_add(x, residual, weight, eps) -> (normed, new_residual)` with
new_residual = residual + x (rounded to the input dtype, as torch's add) and
normed = reference(new_residual, weight, eps). x and residual: same shape and dtype.

`run` / `run_add` launch the kernel when `common.launchable` holds (CUDA, or CPU under
TRITON_INTERPRET=1; contiguous; no autograd; kernels ENABLED) and x, residual, weight are float32 /
bfloat16 / float16, weight is [N], 1 <= N <= MAX_N and x is not empty; otherwise they return the
reference. One program normalises BLOCK_M rows of BLOCK_N = next_pow2(N) columns.
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

MAX_N = 16384   # one row lives in registers; wider rows use the reference


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def reference_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual + x
    return reference(new_residual, weight, eps), new_residual


def eligible(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> bool:
    tensors = (x, weight) if residual is None else (x, weight, residual)
    n = x.shape[-1] if x.ndim else 0
    return (x.numel() > 0 and 1 <= n <= MAX_N and weight.shape == (n,)
            and all(t.is_contiguous() for t in tensors)
            and all(t.dtype in FLOAT_DTYPES for t in tensors)
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype))
            and launchable(*tensors))


def run(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernel(x, weight, eps) if eligible(x, weight) else reference(x, weight, eps)


def run_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if eligible(x, weight, residual):
        return kernel_add(x, residual, weight, eps)
    return reference_add(x, residual, weight, eps)


def kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton; assumes `eligible(x, weight)`."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch(x, None, weight, out, None, eps)
    return out


def kernel_add(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton; assumes `eligible(x, weight, residual)`."""
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    new_residual = torch.empty_like(x)
    _launch(x, residual, weight, out, new_residual, eps)
    return out, new_residual


def _launch(x, residual, weight, out, new_residual, eps: float) -> None:
    n = x.shape[-1]
    rows = x.numel() // n
    block_n = triton.next_power_of_2(n)
    block_m = min(64, max(1, 2048 // block_n))          # ~2k elements per program for narrow rows
    warps = min(16, max(1, block_m * block_n // 512))
    has_residual = residual is not None
    with device_of(x):
        _rmsnorm_rows[(triton.cdiv(rows, block_m),)](
            x, residual if has_residual else x, weight, out, new_residual if has_residual else out,
            rows, n, eps, HAS_RESIDUAL=has_residual, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)


if triton is not None:
    @triton.jit(do_not_specialize=["rows"])
    def _rmsnorm_rows(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rows, n, eps,
                      HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        col = tl.arange(0, BLOCK_N)
        mask = (row[:, None] < rows) & (col[None, :] < n)
        offs = row[:, None].to(tl.int64) * n + col[None, :]
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs, mask=mask, other=0.0)
            x = round_to(r.to(tl.float32) + x.to(tl.float32), x_ptr.dtype.element_ty)  # as torch's add
            tl.store(res_out_ptr + offs, x, mask=mask)
        h = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / n + eps)
        h = round_to(h * rstd[:, None], x_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + col, mask=col < n, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, round_to(w[None, :] * h, out_ptr.dtype.element_ty), mask=mask)
