"""Attention of a few new tokens over a short cache, with the cache append fused in: one launch
instead of two cache copies, the GQA regrouping copy, the attention kernel and the output transpose
copy. Built for the code predictor, whose 15 passes per frame each attend over at most 16 positions.

Contract (`reference`):
    q: [B, S, Hq, D], k, v: [B, S, Hkv, D]  (the rotated projections, token-major: contiguous, or
        column slices of a fused q/k/v projection output); Hq a multiple of Hkv
    k_cache, v_cache: [B, Hkv, L, D] contiguous, same dtype; positions < past hold earlier tokens
    past: int, the same for every sequence; past + S <= L; scale: float
    writes k, v into the caches at positions past .. past + S - 1; query s of a sequence attends to
    positions 0 .. past + s of its own sequence (causal); query head h reads KV head h // (Hq / Hkv)
    returns out [B, S, Hq * D] (token-major, ready for the output projection), dtype of q.
The reference is `torch.nn.functional.scaled_dot_product_attention` on the cache prefix. The kernel
computes scores, softmax and the weighted sum in float32 and rounds once.

`run` launches the kernel when `common.launchable` holds and: q, k, v token-major (as kernels.rope
requires) with contiguous heads; caches contiguous; one float dtype; D a power of two <= MAX_D;
past + S <= L <= MAX_LEN; (Hq / Hkv) * S <= MAX_ROWS; the padded rows x positions x D product within
MAX_PRODUCT (registers). Otherwise it runs the reference.
One program per (sequence, KV head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton
from .rope import token_stride

MAX_D = 256
MAX_LEN = 64
MAX_ROWS = 16
MAX_PRODUCT = 16384   # the [rows, positions, D] float32 product a program holds in registers


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              past: int, scale: float) -> torch.Tensor:
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    total = past + s
    k_cache[:, :, past:total] = k.transpose(1, 2)
    v_cache[:, :, past:total] = v.transpose(1, 2)
    rep = hq // hkv
    qg = q.transpose(1, 2).reshape(b, hkv, rep * s, d)        # the rep query heads of a KV head as rows
    mask = None
    if s > 1:
        q_pos = torch.arange(past, total, device=q.device)
        mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]          # [S, total]
        mask = mask.repeat(rep, 1)[None, None]                                           # rows (rep, s)
    out = F.scaled_dot_product_attention(qg, k_cache[:, :, :total], v_cache[:, :, :total], attn_mask=mask,
                                         scale=scale)
    return out.reshape(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             past: int) -> bool:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k_cache.ndim != 4:
        return False
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    tensors = (q, k, v, k_cache, v_cache)
    return (2 <= d <= MAX_D and d & (d - 1) == 0 and q.numel() > 0 and hkv > 0 and hq % hkv == 0
            and k.shape == v.shape == (b, s, hkv, d) and k_cache.shape == v_cache.shape
            and k_cache.shape[:2] == (b, hkv) and k_cache.shape[3] == d
            and 0 <= past and past + s <= k_cache.shape[2] <= MAX_LEN and (hq // hkv) * s <= MAX_ROWS
            and _pow2(max(2, (hq // hkv) * s)) * _pow2(max(2, past + s)) * d <= MAX_PRODUCT
            and q.dtype in FLOAT_DTYPES and all(t.dtype == q.dtype for t in tensors)
            and k_cache.is_contiguous() and v_cache.is_contiguous()
            and all(token_stride(t) is not None for t in (q, k, v)) and launchable(*tensors))


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        past: int, scale: float) -> torch.Tensor:
    if eligible(q, k, v, k_cache, v_cache, past):
        return kernel(q, k, v, k_cache, v_cache, past, scale)
    return reference(q, k, v, k_cache, v_cache, past, scale)


def kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           past: int, scale: float) -> torch.Tensor:
    """Triton; assumes `eligible(...)`. Writes the caches in place."""
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    out = torch.empty(b, s, hq * d, dtype=q.dtype, device=q.device)
    rows = (hq // hkv) * s
    with device_of(q):
        _attend[(b, hkv)](q, k, v, k_cache, v_cache, out, token_stride(q), token_stride(k), token_stride(v),
                          past, k_cache.shape[2], scale, S=s, HQ=hq, HKV=hkv, D=d,
                          BLOCK_R=max(2, triton.next_power_of_2(rows)),
                          BLOCK_T=max(2, triton.next_power_of_2(past + s)), num_warps=4 if d >= 128 else 2)
    return out


if triton is not None:
    @triton.jit
    def _attend(q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, out_ptr, q_token_stride, k_token_stride, v_token_stride,
                past, cache_len, scale, S: tl.constexpr, HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        REP: tl.constexpr = HQ // HKV
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, D)
        # query rows: (head within the group, new token)
        r = tl.arange(0, BLOCK_R)
        rep, s = r // S, r % S
        row_ok = r < REP * S
        head = g * REP + rep
        tok = b * S + s
        q = tl.load(q_ptr + tok[:, None] * q_token_stride + head[:, None] * D + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(tl.float32)
        # key positions: the cache below `past`, this call's tokens at past .. past + S - 1
        t = tl.arange(0, BLOCK_T)
        cached = t < past
        new = (t >= past) & (t < past + S)
        cache_at = ((b * HKV + g) * cache_len + t)[:, None] * D + d[None, :]
        new_tok = b * S + tl.where(new, t - past, 0)
        k_new = tl.load(k_ptr + new_tok[:, None] * k_token_stride + g * D + d[None, :], mask=new[:, None], other=0.0)
        v_new = tl.load(v_ptr + new_tok[:, None] * v_token_stride + g * D + d[None, :], mask=new[:, None], other=0.0)
        keys = tl.where(cached[:, None], tl.load(kc_ptr + cache_at, mask=cached[:, None], other=0.0), k_new)
        vals = tl.where(cached[:, None], tl.load(vc_ptr + cache_at, mask=cached[:, None], other=0.0), v_new)
        scores = tl.sum(q[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2) * scale      # [R, T]
        allowed = (t[None, :] <= past + s[:, None]) & (t[None, :] < past + S)
        scores = tl.where(allowed, scores, float("-inf"))
        p = tl.exp(scores - tl.max(scores, axis=1)[:, None])
        p = p / tl.sum(p, axis=1)[:, None]
        out = tl.sum(p[:, :, None] * vals.to(tl.float32)[None, :, :], axis=1)                  # [R, D]
        tl.store(out_ptr + tok[:, None] * (HQ * D) + head[:, None] * D + d[None, :], round_to(out, dtype),
                 mask=row_ok[:, None])
        tl.store(kc_ptr + cache_at, k_new, mask=new[:, None])
        tl.store(vc_ptr + cache_at, v_new, mask=new[:, None])
