"""Routed MoE experts for a few tokens (decode steps) in three launches, straight from the router's
top-k: no sort, no gather, no grouped-GEMM setup. Launch 1: per (token, expert) pair the gate/up
GEMV with SwiGLU; launch 2: per pair the down GEMV; launch 3 (`moe.kernel_combine`): per token the
routing-weighted sum and the shared expert's sigmoid-gated add. Each pair reads only its expert's
rows, spread over many small programs so the reads run at memory speed -- what a grouped GEMM does
for one row per expert with far more overhead. For many tokens (pairs sharing
experts) the grouped GEMM, which reads each expert once, is the better tool: `eligible` stops at
MAX_PAIRS.

Contract (`reference`, what `voxpipe.services.runtime.layers.SparseMoE` computes):
    x: [T, H]; top_idx: [T, K] int64; top_w: [T, K]; gate_up: [E, 2I, H] (gate rows first);
    down: [E, H, I]; shared: [T, H] or None (the shared expert's output); shared_logit: [T, 1] or None
    per pair (t, k), e = top_idx[t, k]: g, u = gate_up[e] @ x[t] (rounded to the dtype);
    h = silu(g) * u (each op rounded); y = down[e] @ h (rounded)
    routed[t] = sum_k y * top_w[t, k] (products rounded, sum in float32, rounded once)
    out = routed + sigmoid(shared_logit) * shared (each op rounded) when shared is given
    returns out [T, H] in x's dtype
The kernels accumulate the dot products in float32 and round at the same points as the reference,
so they differ from it only in the order of the float32 sums.

`run` launches the kernels when `common.launchable` holds and: T * K <= MAX_PAIRS; K <= moe.MAX_K; every tensor
contiguous with one float dtype (top_idx int64); shapes as above. Otherwise it runs the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import moe
from .common import FLOAT_DTYPES, device_of, launchable, round_to, tl, triton

MAX_PAIRS = 64
BLOCK_N_GATE_UP = 4      # gate (and up) rows per program of launch 1: many programs, whole rows each
BLOCK_N_DOWN = 8         # output columns per program of launch 2
MAX_IN = 4096            # longest dot product loaded in one piece (longer ones loop)


def reference(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, shared: torch.Tensor | None = None,
              shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    t, k = top_idx.shape
    flat = top_idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)                                            # [T*K, H]
    gate, up = torch.einsum("ph,pnh->pn", xs, gate_up[flat]).chunk(2, dim=-1)
    y = torch.einsum("pi,phi->ph", F.silu(gate) * up, down[flat])                 # [T*K, H]
    out = (y * top_w.reshape(-1, 1).to(y.dtype)).view(t, k, -1).sum(1)
    if shared is not None:
        out = out + torch.sigmoid(shared_logit) * shared
    return out


def eligible(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> bool:
    if x.ndim != 2 or top_idx.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        return False
    t, h = x.shape
    e, two_i, _ = gate_up.shape
    k = top_idx.shape[1]
    floats = (x, top_w, gate_up, down) + (() if shared is None else (shared, shared_logit))
    return (t > 0 and 0 < k <= moe.MAX_K and t * k <= MAX_PAIRS and top_idx.shape[0] == t and top_w.shape == (t, k)
            and two_i % 2 == 0 and gate_up.shape[2] == h and down.shape == (e, h, two_i // 2)
            and (shared is None) == (shared_logit is None)
            and (shared is None or (shared.shape == (t, h) and shared_logit.shape == (t, 1)))
            and top_idx.dtype == torch.int64 and x.dtype in FLOAT_DTYPES and all(f.dtype == x.dtype for f in floats)
            and all(f.is_contiguous() for f in floats + (top_idx,)) and launchable(top_idx, *floats))


def run(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
        shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    if eligible(x, top_idx, top_w, gate_up, down, shared, shared_logit):
        return kernel(x, top_idx, top_w, gate_up, down, shared, shared_logit)
    return reference(x, top_idx, top_w, gate_up, down, shared, shared_logit)


def kernel(x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           shared: torch.Tensor | None = None, shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Triton; assumes `eligible(...)`."""
    t, h = x.shape
    pairs = top_idx.numel()
    inter = gate_up.shape[1] // 2
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, h, dtype=x.dtype, device=x.device)
    with device_of(x):
        _gate_up_swiglu[(pairs, triton.cdiv(inter, BLOCK_N_GATE_UP))](
            x, top_idx, gate_up, act, h, inter, K=top_idx.shape[1], BLOCK_N=BLOCK_N_GATE_UP,
            BLOCK_IN=min(MAX_IN, triton.next_power_of_2(h)), num_warps=8)
        _down[(pairs, triton.cdiv(h, BLOCK_N_DOWN))](
            act, top_idx, down, y, h, inter, BLOCK_N=BLOCK_N_DOWN,
            BLOCK_IN=min(MAX_IN, triton.next_power_of_2(inter)), num_warps=4)
    return moe.kernel_combine(y, None, top_w, shared, shared_logit)


if triton is not None:
    @triton.jit
    def _gate_up_swiglu(x_ptr, idx_ptr, w_ptr, act_ptr, hidden, inter, K: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_IN: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < inter
        dtype = x_ptr.dtype.element_ty
        expert = tl.load(idx_ptr + pair)
        token = pair // K
        gate_rows = w_ptr + (expert * 2 * inter + n)[:, None] * hidden
        up_rows = gate_rows + inter * hidden
        acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, hidden, BLOCK_IN):
            col = start + tl.arange(0, BLOCK_IN)
            c_ok = col < hidden
            xv = tl.load(x_ptr + token * hidden + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            m = n_ok[:, None] & c_ok[None, :]
            acc_g += tl.sum(tl.load(gate_rows + col[None, :], mask=m, other=0.0).to(tl.float32) * xv, axis=1)
            acc_u += tl.sum(tl.load(up_rows + col[None, :], mask=m, other=0.0).to(tl.float32) * xv, axis=1)
        g = round_to(acc_g, dtype).to(tl.float32)
        u = round_to(acc_u, dtype).to(tl.float32)
        a = round_to(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
        tl.store(act_ptr + pair * inter + n, round_to(a * u, dtype), mask=n_ok)

    @triton.jit
    def _down(act_ptr, idx_ptr, w_ptr, y_ptr, hidden, inter, BLOCK_N: tl.constexpr, BLOCK_IN: tl.constexpr):
        pair = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < hidden
        expert = tl.load(idx_ptr + pair)
        rows = w_ptr + (expert * hidden + n)[:, None] * inter
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for start in range(0, inter, BLOCK_IN):
            col = start + tl.arange(0, BLOCK_IN)
            c_ok = col < inter
            av = tl.load(act_ptr + pair * inter + col, mask=c_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.sum(tl.load(rows + col[None, :], mask=n_ok[:, None] & c_ok[None, :], other=0.0)
                          .to(tl.float32) * av, axis=1)
        tl.store(y_ptr + pair * hidden + n, round_to(acc, y_ptr.dtype.element_ty), mask=n_ok)
