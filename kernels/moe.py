"""MoE routing in one launch: float32 softmax over the experts, top-k, optional renormalisation of the
k weights, cast back -- instead of softmax, topk, sum, div and a cast (five kernels per MoE layer).

Contract (`reference`, as `voxpipe.services.runtime.layers.SparseMoE.route`):
    logits: [T, E] float32 / bfloat16 / float16 (the router's output); k: 1 <= k <= E; norm: bool
    probs = softmax(logits.float(), -1); top_w, top_idx = topk(probs, k)  (descending)
    if norm: top_w = top_w / top_w.sum(-1)
    returns (top_idx [T, k] int64, top_w [T, k] in logits.dtype)
The kernel computes in float32 like the reference (its exp may differ in the last bits, so weights
agree to float32 rounding and the chosen experts agree except at exact ties, where the kernel takes
the lowest expert index).

`run` launches the kernel when `common.launchable` holds, logits is contiguous 2-D with
1 <= E <= MAX_E and k <= MAX_K; otherwise it returns the reference. One program per token.
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

MAX_E = 1024
MAX_K = 32


def reference(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_w, top_idx = torch.topk(probs, k, dim=-1)
    if norm:
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
    return top_idx, top_w.to(logits.dtype)


def eligible(logits: torch.Tensor, k: int) -> bool:
    return (logits.ndim == 2 and logits.shape[0] > 0 and 1 <= logits.shape[1] <= MAX_E
            and 1 <= k <= min(MAX_K, logits.shape[1]) and logits.dtype in FLOAT_DTYPES
            and logits.is_contiguous() and launchable(logits))


def run(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return kernel(logits, k, norm) if eligible(logits, k) else reference(logits, k, norm)


def kernel(logits: torch.Tensor, k: int, norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton; assumes `eligible(logits, k)`."""
    t, e = logits.shape
    top_idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
    top_w = torch.empty(t, k, dtype=logits.dtype, device=logits.device)
    with device_of(logits):
        _route[(t,)](logits, top_idx, top_w, e, K=k, BLOCK_K=triton.next_power_of_2(k),
                     BLOCK_E=triton.next_power_of_2(e), NORM=norm, num_warps=1 if e <= 256 else 4)
    return top_idx, top_w


if triton is not None:
    @triton.jit
    def _route(logits_ptr, idx_ptr, w_ptr, n_experts, K: tl.constexpr, BLOCK_K: tl.constexpr,
               BLOCK_E: tl.constexpr, NORM: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        valid = e < n_experts
        x = tl.load(logits_ptr + t * n_experts + e, mask=valid, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        p = p / tl.sum(p, axis=0)
        work = tl.where(valid, p, -1.0)                 # probabilities are >= 0: -1 marks "taken / none"
        kk = tl.arange(0, BLOCK_K)
        top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
        top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.max(work, axis=0)
            at = tl.min(tl.where(work == best, e, BLOCK_E), axis=0)   # lowest index among ties
            at = tl.minimum(at, n_experts - 1)           # NaN logits match nothing: stay in range
            top_w = tl.where(kk == j, best, top_w)
            top_i = tl.where(kk == j, at, top_i)
            work = tl.where(e == at, -1.0, work)
        if NORM:
            top_w = top_w / tl.sum(tl.where(kk < K, top_w, 0.0), axis=0)
        out = t * K + kk
        tl.store(idx_ptr + out, top_i.to(tl.int64), mask=kk < K)
        tl.store(w_ptr + out, round_to(top_w, w_ptr.dtype.element_ty), mask=kk < K)
