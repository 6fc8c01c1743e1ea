"""SnakeBeta activation (Code2Wav), fused into one elementwise pass.

Contract (`reference`, as `voxpipe.services.code2wav.model.SnakeBeta`):
    x: [B, C, T] float32 / bfloat16 / float16; alpha, beta: [C] (log-scale parameters), same dtypes
    out = x + 1 / (exp(beta) + 1e-9) * sin(x * exp(alpha))^2      (alpha, beta broadcast over B, T)
    dtype of out = torch.promote_types(x.dtype, alpha.dtype, beta.dtype); out is contiguous
The kernel computes everything in float32 and rounds once to the output dtype (the reference
rounds every intermediate when the parameters are 16-bit, so there the kernel is the more exact).

`run` launches the kernel when `common.launchable` holds (CUDA, or CPU under TRITON_INTERPRET=1;
no autograd; kernels ENABLED), x is 3-D and non-empty with unit stride along T (B and C may be
strided, e.g. the trimmed output of a transposed conv), x's elements and span are below 2^31,
alpha and beta are contiguous [C], and all dtypes are float32 / bfloat16 / float16; otherwise it
returns the reference. The grid is 1-D over the flattened output, BLOCK elements per program.
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

BLOCK = 1024


def reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    a = torch.exp(alpha)[None, :, None]
    b = torch.exp(beta)[None, :, None]
    return x + (1.0 / (b + 1e-9)) * torch.sin(x * a).pow(2)


def eligible(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> bool:
    if x.ndim != 3 or x.numel() == 0 or x.stride(2) != 1:
        return False
    b, c, t = x.shape
    span = (b - 1) * x.stride(0) + (c - 1) * x.stride(1) + t
    return (x.numel() < 2 ** 31 and span < 2 ** 31
            and alpha.shape == beta.shape == (c,) and alpha.is_contiguous() and beta.is_contiguous()
            and all(t.dtype in FLOAT_DTYPES for t in (x, alpha, beta))
            and launchable(x, alpha, beta))


def run(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    return kernel(x, alpha, beta) if eligible(x, alpha, beta) else reference(x, alpha, beta)


def kernel(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Triton; assumes `eligible(x, alpha, beta)`."""
    dtype = torch.promote_types(torch.promote_types(x.dtype, alpha.dtype), beta.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    n = x.numel()
    with device_of(x):
        _snakebeta[(triton.cdiv(n, BLOCK),)](x, alpha, beta, out, n, x.shape[1], x.shape[2], x.stride(0),
                                             x.stride(1), BLOCK=BLOCK, num_warps=4)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["n", "length", "stride_b", "stride_c"])
    def _snakebeta(x_ptr, alpha_ptr, beta_ptr, out_ptr, n, channels, length, stride_b, stride_c,
                   BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        row = offs // length                        # b * channels + c
        c = row % channels
        src = (row // channels) * stride_b + c * stride_c + (offs - row * length)
        x = tl.load(x_ptr + src, mask=mask, other=0.0).to(tl.float32)
        a = tl.exp(tl.load(alpha_ptr + c, mask=mask, other=0.0).to(tl.float32))
        b = tl.exp(tl.load(beta_ptr + c, mask=mask, other=0.0).to(tl.float32))
        s = tl.sin(x * a)
        y = x + (1.0 / (b + 1e-9)) * (s * s)
        tl.store(out_ptr + offs, round_to(y, out_ptr.dtype.element_ty), mask=mask)
