"""Batch-invariant kernels for `--deterministic` (services/runtime/determinism.py): each output row's
bits depend only on that row's inputs, never on how many rows share the launch, where the row sits,
or (attention) how far the batch's key length was padded. Every launch shape is a constant: fixed
tiles, one program per output tile, the reduction dimension walked in one fixed order, no split-K,
no autotuning. (cuBLAS / SDPA choose their algorithm, split-K and tiles by shape.)

Matmul, `reference` / `matmul`:
    x: [M, K]; weight: [N, K]; bias: [N] or None; one float dtype
    returns F.linear(x, weight, bias) [M, N] in x.dtype (float32 accumulation, rounded once; the bias
    added in float32 before that rounding)

Routed experts, `reference_moe` / `moe`:
    x: [T, H]; top_idx: [T, K] int64; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I]
    per pair p = t * K + k, e = top_idx[t, k]: g, u = gate_up[e] @ x[t] (each rounded);
    a = silu(g) (rounded) * u (rounded); y[p] = down[e] @ a (rounded)
    returns y [T * K, H] in pair order (the caller weights and sums each token's K rows)
The pairs are sorted by expert (stable; `by_expert`: by counting in one program for a step's few hundred pairs) and
cut into tiles of BLOCK_M rows of one expert; a tile's rows go through tl.dot against that expert's
weights in the fixed tile shape, so a pair's bits do not depend on how many other pairs chose its
expert. The tile table is built on the device with static shapes (no host sync): safe inside CUDA
graphs.

Weighted sum of a token's expert rows, `reference_weighted_sum` / `weighted_sum` (bfloat16):
    y: [T * K, H] (pair order); top_w: [T, K]
    returns sum_k round(y[t * K + k] * round(top_w[t, k])) left to right, each partial sum rounded
    ([T, H]): the same bits as the reference's K elementwise launches, in one

Attention, `reference_attention` / `attention`:
    q: [B, Hq, S, D]; k, v: [B, Hkv, L, D] (Hq a multiple of Hkv); mask: [B, 1, S, L] bool or None
    softmax(q k^T * scale, masked) v per query row, float32 inside, [B, Hq, S, D] in q.dtype;
    a row with no key attended gets zeros
One program per (sequence, query head, BLOCK_Q queries); keys in blocks of BLOCK_KV from position
0, an online softmax in that order. A key block past a row's mask adds exact zeros (scale 1, sum +0),
so the batch's padded L and S change nothing. (Decode attention over the paged cache is the paged
kernel's: there the split size must be a fixed number of positions for the same property.)

Under Triton's CPU interpreter 16-bit tl.dot is wrong, so operands go to it as float32 there (on the
GPU 16-bit operands' products are exact in the float32 accumulator either way).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, INTERPRET, device_of, launchable, round_to, tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64      # matmul / MoE tiles: constants, whatever M is
NUM_WARPS, NUM_STAGES = 4, 3
BLOCK_Q, BLOCK_KV = 16, 32                  # attention: queries per program, keys per block
MAX_D = 256


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def eligible(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    tensors = (x, weight) + (() if bias is None else (bias,))
    return (x.ndim == 2 and weight.ndim == 2 and x.shape[1] == weight.shape[1] and x.shape[0] > 0
            and (bias is None or bias.shape == (weight.shape[0],))
            and x.dtype in FLOAT_DTYPES and all(t.dtype == x.dtype for t in tensors)
            and x.stride(1) == 1 and weight.is_contiguous() and launchable(*tensors))


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           tiles: tuple[int, ...] | None = None, tf32: bool = False) -> torch.Tensor:
    """Triton; assumes `eligible(...)`. `tiles`: (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages[, splits])
    instead of the constants (bench/invariant_tune.py; a serving path must keep one shape for every
    call). `splits` > 1: K cut into that many fixed chunks (a fixed split-K: each chunk's float32
    partial in its own program, the partials then added in chunk order, the bias last, one rounding),
    still a row's arithmetic alone: more programs for few rows. `tf32` (bench/invariant_tune.py):
    float32 operands through the tensor cores as TF32 instead of exact float32 products (still one
    fixed computation per row; TF32's rounding, as cuDNN's default float32 convolutions)."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk, warps, stages, splits = (*(tiles or (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS, NUM_STAGES)), 1)[:6]
    chunk = -(-k // (splits * bk)) * bk
    splits = -(-k // chunk)
    partial = splits > 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    parts = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else out
    with device_of(x):
        _matmul[(triton.cdiv(m, bm), triton.cdiv(n, bn), splits)](
            x, weight, weight if bias is None else bias, parts, m, n, k, x.stride(0), chunk,
            HAS_BIAS=bias is not None and not partial, PARTIAL=partial,
            DOT_F32=(x.dtype == torch.float32 and not tf32) or INTERPRET,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    if not partial:
        return out
    acc = parts[0]
    for part in parts[1:]:
        acc = acc + part
    if bias is not None:
        acc = acc + bias.float()
    return out.copy_(acc)


def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return matmul(x, weight, bias) if eligible(x, weight, bias) else reference(x, weight, bias)


# ---------------------------------------------------------------------------------------- experts

def reference_moe(x: torch.Tensor, top_idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    k = top_idx.shape[1]
    flat = top_idx.reshape(-1)
    xs = x.repeat_interleave(k, dim=0)                                               # [T*K, H]
    gate, up = torch.einsum("ph,pnh->pn", xs, gate_up[flat]).chunk(2, dim=-1)
    return torch.einsum("pi,phi->ph", F.silu(gate) * up, down[flat])


def moe_eligible(x: torch.Tensor, top_idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    if x.ndim != 2 or top_idx.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        return False
    e, two_i, h = gate_up.shape
    return (x.shape[0] > 0 and x.shape[1] == h and top_idx.shape[0] == x.shape[0] and two_i % 2 == 0
            and down.shape == (e, h, two_i // 2) and top_idx.dtype == torch.int64
            and x.dtype in FLOAT_DTYPES and gate_up.dtype == x.dtype and down.dtype == x.dtype
            and x.is_contiguous() and gate_up.is_contiguous() and down.is_contiguous()
            and launchable(x, top_idx, gate_up, down))


COUNT_MAX = 1024    # pairs up to which `by_expert` counts in one Triton program (a decode step's 64 x top-k)
COUNT_ROWS = 64     # pairs a step of that program's loops takes


def by_expert(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs' expert ids [P] stably sorted, without a host sync: (order [P]: the pair at each sorted
    position, counts [E]: pairs per expert, ends [E]: their cumulative sum), all int64. Up to
    COUNT_MAX pairs (where Triton can launch) by counting in one program (`_by_expert`: a pair's place
    = the pairs of lower experts + the earlier pairs of its own), else torch.sort(stable) and two
    binary searches. The same integers either way (a stable sort's order is unique), so which one runs
    never changes a bit. (det4 counted with torch ops over a [P, E] one-hot, whose cumulative sum
    along dim 0 took 66 us a layer at P = 384 on the H100, where the sort took ~26 us.)"""
    if _countable(flat):
        return _counted(flat, num_experts, 0)[:3]
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_experts, device=flat.device)
    ends = torch.searchsorted(sorted_ids, bounds, right=True)                        # [E] (no host sync)
    return order, ends - torch.searchsorted(sorted_ids, bounds, right=False), ends


def _countable(flat: torch.Tensor) -> bool:
    return 0 < flat.numel() <= COUNT_MAX and triton is not None and launchable(flat) and flat.is_contiguous()


def _counted(flat: torch.Tensor, num_experts: int, slots: int) -> tuple[torch.Tensor, ...]:
    """`_by_expert` (Triton, one program): (order, counts, ends) as `by_expert`, and with slots > 0
    `tiles`' (expert, start, end) over that many tile slots (else three empty tensors)."""
    order = torch.empty_like(flat)
    counts = torch.empty(num_experts, dtype=torch.int64, device=flat.device)
    ends = torch.empty_like(counts)
    expert, start, end = (torch.empty(slots, dtype=torch.int64, device=flat.device) for _ in range(3))
    with device_of(flat):
        _by_expert[(1,)](flat, order, counts, ends, expert, start, end, flat.numel(), slots, E=num_experts,
                         BLOCK_E=triton.next_power_of_2(num_experts), ROWS=COUNT_ROWS, BLOCK_M=BLOCK_M,
                         TILES=slots > 0, num_warps=4)
    return order, counts, ends, expert, start, end


def tiles(top_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """The pairs sorted by expert and the tile table, static shapes only: (order [P]: the pair of each
    sorted row, tile_expert / tile_start / tile_end [P // BLOCK_M + E]: a tile's expert and sorted rows;
    tiles past the real ones have start == end). Up to COUNT_MAX pairs all in `_by_expert`'s one
    launch, else `by_expert` and the torch ops below: the same integers."""
    flat = top_idx.reshape(-1)
    pairs = flat.numel()
    slots = pairs // BLOCK_M + num_experts                                            # >= the real tile count
    if _countable(flat):    # the order and the table in one launch (below: ~25 small ones a MoE layer)
        order, _, _, expert, start, end = _counted(flat, num_experts, slots)
        return order, expert, start, end
    order, counts, ends = by_expert(flat, num_experts)
    per = (counts + BLOCK_M - 1) // BLOCK_M
    tile_ends = torch.cumsum(per, 0)
    i = torch.arange(slots, device=flat.device)
    expert = torch.searchsorted(tile_ends, i, right=True).clamp_max(num_experts - 1)
    first = tile_ends[expert] - per[expert]                                           # the expert's first tile
    start = ends[expert] - counts[expert] + (i - first) * BLOCK_M
    end = torch.minimum(start + BLOCK_M, ends[expert])
    real = i < tile_ends[-1]
    start = torch.where(real, start, torch.zeros_like(start))
    end = torch.where(real, end, torch.zeros_like(end))
    return order, expert, start, end


def moe(x: torch.Tensor, top_idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Triton; assumes `moe_eligible(...)`."""
    t, h = x.shape
    k = top_idx.shape[1]
    e, two_i, _ = gate_up.shape
    inter = two_i // 2
    order, expert, start, end = tiles(top_idx, e)
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)                   # sorted row order
    y = torch.empty(t * k, h, dtype=x.dtype, device=x.device)                         # pair order
    dot32 = x.dtype == torch.float32 or INTERPRET
    with device_of(x):
        grid = (expert.numel(), triton.cdiv(inter, BLOCK_N))
        _experts[grid](x, order, expert, start, end, gate_up, act, inter, h, K=k, GATE_UP=True, DOT_F32=dot32,
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
        grid = (expert.numel(), triton.cdiv(h, BLOCK_N))
        _experts[grid](act, order, expert, start, end, down, y, h, inter, K=k, GATE_UP=False, DOT_F32=dot32,
                       BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y


def reference_weighted_sum(y: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
                           shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """A token's K expert rows y [T * K, H] (pair order) weighted by top_w [T, K] and summed left to
    right, each product and each partial sum rounded to y's dtype (determinism.ordered_sum's
    arithmetic): [T, H]; with a shared expert's rows `shared` [T, H] and gate logits `shared_logit`
    [T, 1], then + sigmoid(logit) * shared (the gate, the product and the sum each rounded)."""
    t, k = top_w.shape
    parts = (y.view(t, k, -1) * top_w[..., None].to(y.dtype)).unbind(1)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    if shared is not None:
        out = out + torch.sigmoid(shared_logit.float()).to(y.dtype) * shared
    return out


def weighted_sum_eligible(y: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
                          shared_logit: torch.Tensor | None = None) -> bool:
    """bfloat16 rows only: every step rounds through bits there, so nothing can fuse into an FMA (in
    float32 a multiply-add could, and the bits would leave the reference's). A shared expert: its
    rows [T, H] in y's dtype and its logits [T, 1] (a float dtype), contiguous, or neither."""
    ok = (y.ndim == 2 and top_w.ndim == 2 and top_w.shape[0] > 0 and y.shape[0] == top_w.numel()
          and y.dtype == torch.bfloat16 and top_w.dtype in FLOAT_DTYPES and y.is_contiguous()
          and top_w.is_contiguous() and launchable(y, top_w) and (shared is None) == (shared_logit is None))
    if ok and shared is not None:
        t, h = top_w.shape[0], y.shape[1]
        ok = (shared.shape == (t, h) and shared.dtype == y.dtype and shared.is_contiguous()
              and shared_logit.shape == (t, 1) and shared_logit.dtype in FLOAT_DTYPES
              and shared_logit.is_contiguous() and launchable(shared, shared_logit))
    return ok


def weighted_sum(y: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
                 shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """Triton; assumes `weighted_sum_eligible(...)`. `reference_weighted_sum`'s bits in one launch (it
    took K launches), one program per (token, BLOCK_H columns): a token's sum is its own. With a
    shared expert, its gated add in the same launch (the gate's sigmoid through Triton's exp: not
    necessarily torch's last bit, but one computation per token wherever it sits)."""
    t, k = top_w.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=y.dtype, device=y.device)
    block = min(1024, triton.next_power_of_2(h))
    has_shared = shared is not None
    with device_of(y):
        _weighted_sum[(t, triton.cdiv(h, block))](y, top_w, shared if has_shared else y,
                                                  shared_logit if has_shared else top_w, out, h, K=k,
                                                  SHARED=has_shared, BLOCK=block,
                                                  num_warps=4 if block >= 512 else 1)
    return out


def run_weighted_sum(y: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
                     shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    if weighted_sum_eligible(y, top_w, shared, shared_logit):
        return weighted_sum(y, top_w, shared, shared_logit)
    return reference_weighted_sum(y, top_w, shared, shared_logit)


def run_moe(x: torch.Tensor, top_idx: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    if moe_eligible(x, top_idx, gate_up, down):
        return moe(x, top_idx, gate_up, down)
    return reference_moe(x, top_idx, gate_up, down)


# -------------------------------------------------------------------------------------- attention

def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mask is not None:                                                                # no key: zeros
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out


def attention_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    tensors = (q, k, v) + (() if mask is None else (mask,))
    return (q.numel() > 0 and length > 0 and hkv > 0 and hq % hkv == 0 and 16 <= d <= MAX_D and d & (d - 1) == 0
            and k.shape == v.shape == (b, hkv, length, d) and q.dtype in FLOAT_DTYPES
            and k.dtype == q.dtype and v.dtype == q.dtype
            and all(t.stride(-1) == 1 for t in (q, k, v))
            and (mask is None or (mask.dtype == torch.bool and mask.shape[0] in (1, b) and mask.shape[1] == 1
                                  and mask.shape[2] in (1, s) and mask.shape[3] == length))
            and launchable(*tensors))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Triton; assumes `attention_eligible(...)`. Strided q / k / v (views) are read as they are."""
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    out = torch.empty(b, hq, s, d, dtype=q.dtype, device=q.device)
    has_mask = mask is not None
    m = mask if has_mask else q
    ms = (m.stride(0) if has_mask and m.shape[0] > 1 else 0, m.stride(2) if has_mask and m.shape[2] > 1 else 0,
          m.stride(3) if has_mask else 0)
    with device_of(q):
        _attention[(b * hq, triton.cdiv(s, BLOCK_Q))](
            q, k, v, m.view(torch.uint8) if has_mask else m, out, s, length, scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), *ms, HQ=hq, REP=hq // hkv, D=d, HAS_MASK=has_mask,
            DOT_F32=q.dtype == torch.float32 or INTERPRET, BLOCK_Q=BLOCK_Q, BLOCK_KV=BLOCK_KV,
            num_warps=4 if d >= 128 else 2)
    return out


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    if attention_eligible(q, k, v, mask):
        return attention(q, k, v, mask, scale)
    return reference_attention(q, k, v, mask, scale)


if triton is not None:
    INTERP = tl.constexpr(INTERPRET)

    @triton.jit
    def _dot(a, b, DOT_F32: tl.constexpr):
        """a @ b in float32. The interpreter's tl.dot is numpy's BLAS, whose rounding of a row depends on
        the other rows' values: there the products are summed per output over K (one fixed order),
        which is what the GPU's MMA does per output row."""
        if INTERP:
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        if DOT_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit(do_not_specialize=["m"])
    def _matmul(x_ptr, w_ptr, b_ptr, out_ptr, m, n, k, x_stride, chunk, HAS_BIAS: tl.constexpr,
                PARTIAL: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok, col_ok = rows < m, cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        lo = tl.program_id(2) * chunk
        for start in range(lo, tl.minimum(lo + chunk, k), BLOCK_K):
            kk = start + tl.arange(0, BLOCK_K)
            k_ok = kk < k
            a = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + kk[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr + cols[None, :].to(tl.int64) * k + kk[:, None], mask=col_ok[None, :] & k_ok[:, None],
                        other=0.0)
            acc += _dot(a, w, DOT_F32)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        at = rows[:, None].to(tl.int64) * n + cols[None, :]
        if PARTIAL:     # chunk program_id(2)'s float32 partial: out_ptr is [splits, m, n]
            tl.store(out_ptr + tl.program_id(2).to(tl.int64) * m * n + at, acc, mask=row_ok[:, None] & col_ok[None, :])
        else:
            tl.store(out_ptr + at, round_to(acc, out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _experts(a_ptr, order_ptr, expert_ptr, start_ptr, end_ptr, w_ptr, out_ptr, n, k, K: tl.constexpr,
                 GATE_UP: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
        """One tile of one expert's sorted rows against BLOCK_N output columns. GATE_UP: the rows are
        tokens (x[order // K]), the weight [E, 2n, k] gives gate and up columns, the output is the
        SwiGLU in sorted row order; else the rows are those outputs, the weight [E, n, k], the output
        goes to each row's pair (order)."""
        tile = tl.program_id(0)
        start = tl.load(start_ptr + tile)
        end = tl.load(end_ptr + tile)
        if start < end:
            expert = tl.load(expert_ptr + tile).to(tl.int64)
            rows = start + tl.arange(0, BLOCK_M)
            row_ok = rows < end
            pair = tl.load(order_ptr + rows, mask=row_ok, other=0)
            src = pair // K if GATE_UP else rows.to(tl.int64)
            cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            width = 2 * n if GATE_UP else n
            w_rows = w_ptr + expert * width * k + cols[None, :].to(tl.int64) * k
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in range(0, k, BLOCK_K):
                kk = s + tl.arange(0, BLOCK_K)
                k_ok = kk < k
                a = tl.load(a_ptr + src[:, None] * k + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w_ok = col_ok[None, :] & k_ok[:, None]
                acc += _dot(a, tl.load(w_rows + kk[:, None], mask=w_ok, other=0.0), DOT_F32)
                if GATE_UP:
                    acc_up += _dot(a, tl.load(w_rows + n * k + kk[:, None], mask=w_ok, other=0.0), DOT_F32)
            dtype = out_ptr.dtype.element_ty
            ok = row_ok[:, None] & col_ok[None, :]
            if GATE_UP:
                g = round_to(acc, dtype).to(tl.float32)
                u = round_to(acc_up, dtype).to(tl.float32)
                a = round_to(g / (1.0 + tl.exp(-g)), dtype).to(tl.float32)
                tl.store(out_ptr + rows[:, None].to(tl.int64) * n + cols[None, :], round_to(a * u, dtype), mask=ok)
            else:
                tl.store(out_ptr + pair[:, None] * n + cols[None, :], round_to(acc, dtype), mask=ok)

    @triton.jit(do_not_specialize=["p", "slots"])
    def _by_expert(ids_ptr, order_ptr, counts_ptr, ends_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr, p,
                   slots, E: tl.constexpr, BLOCK_E: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                   TILES: tl.constexpr):
        """One program: the pairs' counts per expert (a first pass over the ids, ROWS at a time), then
        each pair's sorted place = its expert's first place + the earlier pairs of its expert (the
        second pass: a cumulative one-hot count over the ROWS pairs of a step, plus the steps before).
        TILES: also `tiles`' table over `slots` tile slots, the same integers as its torch ops (an
        expert's value gathered by a one-hot sum)."""
        experts = tl.arange(0, BLOCK_E)
        rows = tl.arange(0, ROWS)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for start in range(0, p, ROWS):
            i = start + rows
            ids = tl.load(ids_ptr + i, mask=i < p, other=-1).to(tl.int32)
            counts += tl.sum((experts[:, None] == ids[None, :]).to(tl.int32), axis=1)
        ends = tl.cumsum(counts, axis=0)
        tl.store(counts_ptr + experts, counts.to(tl.int64), mask=experts < E)
        tl.store(ends_ptr + experts, ends.to(tl.int64), mask=experts < E)
        nxt = ends - counts                                     # each expert's next free place
        for start in range(0, p, ROWS):
            i = start + rows
            ids = tl.load(ids_ptr + i, mask=i < p, other=-1).to(tl.int32)
            # [BLOCK_E, ROWS] one-hot, the pairs along the last axis (the scan runs along it)
            hit = (experts[:, None] == ids[None, :]).to(tl.int32)
            place = tl.sum(hit * (tl.cumsum(hit, axis=1) - hit + nxt[:, None]), axis=0)
            tl.store(order_ptr + place, i.to(tl.int64), mask=i < p)
            nxt += tl.sum(hit, axis=1)
        if TILES:
            real_e = experts < E
            per = (counts + BLOCK_M - 1) // BLOCK_M
            tile_ends = tl.cumsum(per, axis=0)
            tiles_total = tl.sum(per, axis=0)
            firsts = ends - counts
            for base in range(0, slots, ROWS):
                i = base + rows
                below = (tile_ends[None, :] <= i[:, None]) & real_e[None, :]        # searchsorted(right)
                expert = tl.minimum(tl.sum(below.to(tl.int32), axis=1), E - 1)
                pick = experts[None, :] == expert[:, None]
                first = tl.sum(tl.where(pick, (tile_ends - per)[None, :], 0), axis=1)   # its first tile
                row0 = tl.sum(tl.where(pick, firsts[None, :], 0), axis=1) + (i - first) * BLOCK_M
                row1 = tl.minimum(row0 + BLOCK_M, tl.sum(tl.where(pick, ends[None, :], 0), axis=1))
                real = i < tiles_total
                ok = i < slots
                tl.store(tile_expert_ptr + i, expert.to(tl.int64), mask=ok)
                tl.store(tile_start_ptr + i, tl.where(real, row0, 0).to(tl.int64), mask=ok)
                tl.store(tile_end_ptr + i, tl.where(real, row1, 0).to(tl.int64), mask=ok)

    @triton.jit
    def _weighted_sum(y_ptr, w_ptr, s_ptr, l_ptr, out_ptr, h, K: tl.constexpr, SHARED: tl.constexpr,
                      BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < h
        dtype = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            w = round_to(tl.load(w_ptr + t * K + j).to(tl.float32), dtype).to(tl.float32)
            y = tl.load(y_ptr + (t * K + j) * h + cols, mask=ok, other=0.0).to(tl.float32)
            p = round_to(y * w, dtype).to(tl.float32)
            if j == 0:
                acc = p
            else:
                acc = round_to(acc + p, dtype).to(tl.float32)
        if SHARED:      # + sigmoid(logit) * shared: the gate, the product and the sum each rounded
            gate = round_to(1.0 / (1.0 + tl.exp(-tl.load(l_ptr + t).to(tl.float32))), dtype).to(tl.float32)
            s = tl.load(s_ptr + t * h + cols, mask=ok, other=0.0).to(tl.float32)
            acc = round_to(acc + round_to(gate * s, dtype).to(tl.float32), dtype).to(tl.float32)
        tl.store(out_ptr + t * h + cols, round_to(acc, dtype), mask=ok)

    # the batch's own integers never specialise the compiled kernel: the mask's batch stride is 0 for
    # one sequence (a broadcast mask) and S * L for several, and a stride's divisibility can change
    # the layouts Triton picks -- and with them a row's reduction order (code2wav's window attention
    # alone and inside a batch differed in the last bit on the H200, bench/code2wav_locate.py)
    @triton.jit(do_not_specialize=["s", "length", "qs0", "ks0", "vs0", "ms0", "ms2", "ms3"])
    def _attention(q_ptr, k_ptr, v_ptr, m_ptr, out_ptr, s, length, scale, qs0, qs1, qs2, ks0, ks1, ks2,
                   vs0, vs1, vs2, ms0, ms2, ms3, HQ: tl.constexpr, REP: tl.constexpr, D: tl.constexpr,
                   HAS_MASK: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KV: tl.constexpr):
        bh = tl.program_id(0)
        b = (bh // HQ).to(tl.int64)
        h = bh % HQ
        kvh = (h // REP).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        row_ok = rows < s
        d = tl.arange(0, D)
        q = tl.load(q_ptr + b * qs0 + h * qs1 + rows[:, None].to(tl.int64) * qs2 + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        top = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_Q], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q, D], dtype=tl.float32)
        for j in range(0, length, BLOCK_KV):
            keys = j + tl.arange(0, BLOCK_KV)
            key_ok = keys < length
            kt = tl.load(k_ptr + b * ks0 + kvh * ks1 + keys[None, :].to(tl.int64) * ks2 + d[:, None],
                         mask=key_ok[None, :], other=0.0)                                       # [D, BLOCK_KV]
            scores = _dot(q, kt, DOT_F32) * scale
            ok = row_ok[:, None] & key_ok[None, :]
            if HAS_MASK:
                mv = tl.load(m_ptr + b * ms0 + rows[:, None].to(tl.int64) * ms2 + keys[None, :] * ms3, mask=ok,
                             other=0)
                ok = ok & (mv != 0)
            scores = tl.where(ok, scores, float("-inf"))
            new_top = tl.maximum(top, tl.max(scores, axis=1))
            base = tl.where(new_top == float("-inf"), 0.0, new_top)
            p = tl.exp(scores - base[:, None])
            keep = tl.exp(top - base)
            total = total * keep + tl.sum(p, axis=1)
            vals = tl.load(v_ptr + b * vs0 + kvh * vs1 + keys[:, None].to(tl.int64) * vs2 + d[None, :],
                           mask=key_ok[:, None], other=0.0)                                     # [BLOCK_KV, D]
            acc = acc * keep[:, None] + _dot(p.to(vals.dtype), vals, DOT_F32)
            top = new_top
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        tl.store(out_ptr + ((b * HQ + h) * s + rows[:, None].to(tl.int64)) * D + d[None, :],
                 round_to(out, out_ptr.dtype.element_ty), mask=row_ok[:, None])
