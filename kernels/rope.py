"""Fused per-head q/k RMSNorm + rotary embedding, in place: one launch instead of two norms and the
~10 elementwise kernels of `x * cos + rotate_half(x) * sin` for q and for k.

Contract (`reference`, as `voxpipe.services.runtime.layers.Attention` computes it):
    q: [B, S, Hq, D], k: [B, S, Hkv, D]  float32 / bfloat16 / float16 (the projections' outputs)
    cos, sin: [B, S, D]  same dtype (RotaryEmbedding's output; MRoPE sections already merged)
    q_weight, k_weight: [D] same dtype, or both None (no q/k norm); eps: float
    with the norm: x = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype)  (per head)
    then: x = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[D/2:], x[:D/2])
    returns (q, k) of the input shapes and dtype.
The reference rounds after every elementwise op (as torch does in 16-bit); the kernel rounds the
norm exactly as the reference (so its input to the rotation is bit-identical) and then computes the
rotation in float32 with one final rounding -- within the 16-bit budget, closer to float32.

`run` launches the kernel when `common.launchable` holds and: cos, sin contiguous; q and k with
contiguous heads and one stride between consecutive tokens (contiguous, or column slices of a fused
q/k/v projection output); one dtype for all tensors; D a power of two <= MAX_D; shapes as above.
Otherwise it returns the reference.
The kernel overwrites q and k (and returns them): callers pass fresh projection outputs.
One program per (token, head) row.
"""

from __future__ import annotations

import torch

from . import rmsnorm
from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

MAX_D = 256


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
              k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if q_weight is not None:
        q, k = rmsnorm.reference(q, q_weight, eps), rmsnorm.reference(k, k_weight, eps)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def token_stride(x: torch.Tensor) -> int | None:
    """For [B, S, H, D] with unit stride along D and D along H: the one stride between consecutive
    tokens of the flattened B x S (None if there is none). Size-1 dimensions' strides do not count:
    a decode step's [B, 1, H, D] column slice of a fused projection has stride(1) == H * D."""
    b, s, h, d = x.shape
    if x.stride(3) != 1 or (h > 1 and x.stride(2) != d):
        return None
    if s == 1:
        stride = x.stride(0) if b > 1 else h * d
    elif b == 1 or x.stride(0) == s * x.stride(1):
        stride = x.stride(1)
    else:
        return None
    return stride if stride >= h * d else None


def eligible(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
             k_weight: torch.Tensor | None) -> bool:
    if q.ndim != 4 or k.ndim != 4:
        return False
    b, s, _, d = q.shape
    weights = () if q_weight is None else (q_weight, k_weight)
    tensors = (q, k, cos, sin) + weights
    return (d <= MAX_D and d >= 2 and d & (d - 1) == 0 and q.numel() > 0
            and k.shape[:2] == (b, s) and k.shape[3] == d and cos.shape == (b, s, d) and sin.shape == (b, s, d)
            and (q_weight is None) == (k_weight is None) and all(w.shape == (d,) for w in weights)
            and q.dtype in FLOAT_DTYPES and all(t.dtype == q.dtype for t in tensors)
            and all(t.is_contiguous() for t in (cos, sin) + weights) and token_stride(q) is not None
            and token_stride(k) is not None
            and launchable(*tensors))


def run(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if eligible(q, k, cos, sin, q_weight, k_weight):
        return kernel(q, k, cos, sin, q_weight, k_weight, eps)
    return reference(q, k, cos, sin, q_weight, k_weight, eps)


def kernel(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight: torch.Tensor | None,
           k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton, in place; assumes `eligible(...)`."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    norm = q_weight is not None
    with device_of(q):
        _qk_rope[(b * s, hq + hkv)](q, k, cos, sin, q_weight if norm else cos, k_weight if norm else cos,
                                    hq, token_stride(q), token_stride(k), eps, D=d, HAS_NORM=norm,
                                    num_warps=1 if d <= 128 else 2)
    return q, k


if triton is not None:
    @triton.jit
    def _qk_rope(q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, hq, q_token_stride, k_token_stride, eps,
                 D: tl.constexpr, HAS_NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.arange(0, D)
        rot = (d + D // 2) % D                       # rotate_half reads the other half
        if h < hq:
            row = q_ptr + t * q_token_stride + h * D
            w_ptr = qw_ptr
        else:
            row = k_ptr + t * k_token_stride + (h - hq) * D
            w_ptr = kw_ptr
        dtype = q_ptr.dtype.element_ty
        x = tl.load(row + d).to(tl.float32)
        xr = tl.load(row + rot).to(tl.float32)
        if HAS_NORM:
            rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
            w = tl.load(w_ptr + d).to(tl.float32)
            wr = tl.load(w_ptr + rot).to(tl.float32)
            x = round_to(w * round_to(x * rstd, dtype).to(tl.float32), dtype).to(tl.float32)
            xr = round_to(wr * round_to(xr * rstd, dtype).to(tl.float32), dtype).to(tl.float32)
        c = tl.load(cos_ptr + t * D + d).to(tl.float32)
        s = tl.load(sin_ptr + t * D + d).to(tl.float32)
        sign = tl.where(d < D // 2, -1.0, 1.0)
        tl.store(row + d, round_to(x * c + sign * xr * s, dtype))
