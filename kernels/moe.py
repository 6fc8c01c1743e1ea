"""The MoE layer's small kernels around the grouped expert GEMMs, one launch each.

Routing, `reference` / `run` (as `voxpipe.services.runtime.layers.SparseMoE.route`): float32 softmax over
the experts, top-k, optional renormalisation of the k weights, cast back -- instead of softmax, topk,
sum, div and a cast (five kernels per MoE layer).
    logits: [T, E] float32 / bfloat16 / float16 (the router's output); k: 1 <= k <= E; norm: bool
    probs = softmax(logits.float(), -1); top_w, top_idx = topk(probs, k)  (descending)
    if norm: top_w = top_w / top_w.sum(-1)
    returns (top_idx [T, k] int64, top_w [T, k] in logits.dtype)
The kernel computes in float32 like the reference (its exp may differ in the last bits, so weights
agree to float32 rounding and the chosen experts agree except at exact ties, where the kernel takes
the lowest expert index). `run` launches it when `common.launchable` holds, logits is contiguous 2-D
with 1 <= E <= MAX_E and k <= MAX_K. One program per token.

Alignment, `reference_align` / `run_align` (the grouped GEMMs' input: the (token, expert) pairs sorted
by expert) -- instead of sort, searchsorted, a division and an index scatter:
    top_idx: [T, K] int64 in [0, E); num_experts: E
    sorted_ids, order = sort(top_idx.reshape(-1), stable=True)
    offs = searchsorted(sorted_ids, arange(E), right=True) as int32  (end row of each expert's group)
    src = order // K  (the token of each sorted pair); inv[order] = arange(T * K)  (sorted row of pair i)
    returns (order, src, inv: [T * K] int64, offs: [E] int32)
The kernel is exact: it sorts the unique keys id * NPAD + pair (hence stable) with `tl.sort` and takes
offs as the cumulative `tl.histogram` of the ids. `run_align` launches it when `common.launchable` holds,
top_idx is contiguous 2-D int64 with 1 <= T * K <= MAX_PAIRS and 1 <= E <= MAX_E. One program.

Combination, `reference_combine` / `run_combine` (as `layers.Experts.grouped` and `SparseMoE.forward`
after the second grouped GEMM) -- instead of a gather, cast, multiply, scatter, sum and the shared
expert's sigmoid, multiply and add:
    y: [T * K, H] float32 / bfloat16 / float16 in sorted pair order; inv: [T * K] int64 (from align), or
    None when y is in pair order (row t * K + k); top_w: [T, K] any of those dtypes;
    shared: [T, H] and shared_logit: [T, 1] in y.dtype, or both None
    out[t] = sum_k y[inv[t * K + k]] * top_w[t, k].to(y.dtype)   (products in y.dtype, summed in float32)
    if shared is not None: out = out + sigmoid(shared_logit) * shared
    returns out [T, H] in y.dtype
The kernel computes in float32 and rounds where torch does (each product, the sum, the sigmoid, the
shared product, the final add), so it differs only by the summation order and the sigmoid's last bits.
`run_combine` launches it when `common.launchable` holds, every tensor is contiguous with the shapes
and dtypes above and K <= MAX_K. One program per (token, BLOCK_H columns).
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

MAX_E = 1024
MAX_K = 32
MAX_PAIRS = 2048   # align sorts all T * K pairs in one program's registers


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


def reference_align(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    sorted_ids, order = torch.sort(top_idx.reshape(-1), stable=True)
    offs = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=top_idx.device), right=True,
                              out_int32=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, order // top_idx.shape[1], inv, offs


def eligible_align(top_idx: torch.Tensor, num_experts: int) -> bool:
    return (top_idx.ndim == 2 and 1 <= top_idx.numel() <= MAX_PAIRS and 1 <= num_experts <= MAX_E
            and top_idx.dtype == torch.int64 and top_idx.is_contiguous() and launchable(top_idx))


def run_align(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    if eligible_align(top_idx, num_experts):
        return kernel_align(top_idx, num_experts)
    return reference_align(top_idx, num_experts)


def kernel_align(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """Triton; assumes `eligible_align(top_idx, num_experts)`."""
    n = top_idx.numel()
    order, src, inv = (torch.empty(n, dtype=torch.int64, device=top_idx.device) for _ in range(3))
    offs = torch.empty(num_experts, dtype=torch.int32, device=top_idx.device)
    npad = max(16, triton.next_power_of_2(n))
    with device_of(top_idx):
        _align[(1,)](top_idx, order, src, inv, offs, n, num_experts, K=top_idx.shape[1], NPAD=npad,
                     BLOCK_E=triton.next_power_of_2(num_experts), num_warps=min(16, max(1, npad // 64)))
    return order, src, inv, offs


def reference_combine(y: torch.Tensor, inv: torch.Tensor | None, top_w: torch.Tensor,
                      shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    t, k = top_w.shape
    pairs = y if inv is None else y[inv]
    out = (pairs.view(t, k, -1) * top_w[..., None].to(y.dtype)).sum(1)
    if shared is not None:
        out = out + torch.sigmoid(shared_logit) * shared
    return out


def eligible_combine(y: torch.Tensor, inv: torch.Tensor | None, top_w: torch.Tensor,
                     shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> bool:
    if y.ndim != 2 or top_w.ndim != 2 or (shared is None) != (shared_logit is None):
        return False
    (t, k), h = top_w.shape, y.shape[1]
    tensors = (y, top_w) + (() if inv is None else (inv,)) + (() if shared is None else (shared, shared_logit))
    return (y.numel() > 0 and 1 <= k <= MAX_K and y.shape[0] == t * k
            and (inv is None or (inv.shape == (t * k,) and inv.dtype == torch.int64))
            and y.dtype in FLOAT_DTYPES and top_w.dtype in FLOAT_DTYPES
            and (shared is None or (shared.shape == (t, h) and shared_logit.shape == (t, 1)
                                    and shared.dtype == y.dtype and shared_logit.dtype == y.dtype))
            and all(x.is_contiguous() for x in tensors) and launchable(*tensors))


def run_combine(y: torch.Tensor, inv: torch.Tensor | None, top_w: torch.Tensor,
                shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    if eligible_combine(y, inv, top_w, shared, shared_logit):
        return kernel_combine(y, inv, top_w, shared, shared_logit)
    return reference_combine(y, inv, top_w, shared, shared_logit)


def kernel_combine(y: torch.Tensor, inv: torch.Tensor | None, top_w: torch.Tensor,
                   shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Triton; assumes `eligible_combine(...)`."""
    (t, k), h = top_w.shape, y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    has_shared = shared is not None
    block_h = min(512, triton.next_power_of_2(h))
    with device_of(y):
        _combine[(t, triton.cdiv(h, block_h))](
            y, y if inv is None else inv, top_w, shared if has_shared else y, shared_logit if has_shared else y,
            out, h, K=k, BLOCK_H=block_h, HAS_INV=inv is not None, HAS_SHARED=has_shared,
            num_warps=max(1, block_h // 256))
    return out


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

    @triton.jit
    def _align(idx_ptr, order_ptr, src_ptr, inv_ptr, offs_ptr, n_pairs, n_experts, K: tl.constexpr,
               NPAD: tl.constexpr, BLOCK_E: tl.constexpr):
        i = tl.arange(0, NPAD)
        valid = i < n_pairs
        ids = tl.load(idx_ptr + i, mask=valid, other=0).to(tl.int32)
        # unique keys: sorting them is a stable sort by expert; padding lanes sort last
        keys = tl.sort(tl.where(valid, ids * NPAD + i, 2**31 - 1))
        order = keys % NPAD
        tl.store(order_ptr + i, order.to(tl.int64), mask=valid)
        tl.store(src_ptr + i, (order // K).to(tl.int64), mask=valid)
        tl.store(inv_ptr + order, i.to(tl.int64), mask=valid)
        e = tl.arange(0, BLOCK_E)
        tl.store(offs_ptr + e, tl.cumsum(tl.histogram(ids, BLOCK_E, mask=valid), 0), mask=e < n_experts)

    @triton.jit
    def _combine(y_ptr, inv_ptr, w_ptr, shared_ptr, logit_ptr, out_ptr, h, K: tl.constexpr,
                 BLOCK_H: tl.constexpr, HAS_INV: tl.constexpr, HAS_SHARED: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        col = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = col < h
        dtype = y_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(inv_ptr + t * K + j) if HAS_INV else t * K + j
            w = round_to(tl.load(w_ptr + t * K + j).to(tl.float32), dtype).to(tl.float32)
            y = tl.load(y_ptr + row * h + col, mask=mask, other=0.0).to(tl.float32)
            acc += round_to(y * w, dtype).to(tl.float32)      # each product rounded, as torch's multiply
        out = round_to(acc, dtype)
        if HAS_SHARED:
            gate = round_to(tl.sigmoid(tl.load(logit_ptr + t).to(tl.float32)), dtype).to(tl.float32)
            shared = tl.load(shared_ptr + t * h + col, mask=mask, other=0.0).to(tl.float32)
            out = round_to(out.to(tl.float32) + round_to(gate * shared, dtype).to(tl.float32), dtype)
        tl.store(out_ptr + t * h + col, out, mask=mask)
