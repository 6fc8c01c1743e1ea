"""SwiGLU on a fused gate/up projection output: silu(gate) * up in one launch instead of a chunk's
silu kernel and a multiply kernel (every gated MLP and every MoE expert).

Contract (`reference`, as `voxpipe.services.runtime.layers.GatedMLP` with act = silu):
    x: [..., 2 * I] float32 / bfloat16 / float16, gate = x[..., :I], up = x[..., I:]
    returns silu(gate) * up: [..., I] contiguous, dtype of x
The kernel rounds where torch does (silu's result, then the product), so it differs from the
reference only where its float32 exp does (a last-ulp flip at most).

`run` launches the kernel when `common.launchable` holds, x is contiguous, not empty and 16/32-bit
float; otherwise it returns the reference. One program per (row, BLOCK columns).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

BLOCK = 1024


def reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def eligible(x: torch.Tensor) -> bool:
    return (x.ndim >= 1 and x.numel() > 0 and x.shape[-1] % 2 == 0 and x.dtype in FLOAT_DTYPES
            and x.is_contiguous() and launchable(x))


def run(x: torch.Tensor) -> torch.Tensor:
    return kernel(x) if eligible(x) else reference(x)


def kernel(x: torch.Tensor) -> torch.Tensor:
    """Triton; assumes `eligible(x)`."""
    inner = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inner, dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    block = min(BLOCK, triton.next_power_of_2(inner))
    with device_of(x):
        _swiglu[(rows, triton.cdiv(inner, block))](x, out, inner, BLOCK=block, num_warps=4 if block >= 512 else 1)
    return out


if triton is not None:
    @triton.jit
    def _swiglu(x_ptr, out_ptr, inner, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = col < inner
        dtype = x_ptr.dtype.element_ty
        gate = tl.load(x_ptr + row * 2 * inner + col, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * inner + inner + col, mask=ok, other=0.0).to(tl.float32)
        act = round_to(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        tl.store(out_ptr + row * inner + col, round_to(act * up, dtype), mask=ok)
