"""Greedy token choice fused: suppress mask + per-row banned id + argmax over [B, V] logits.

Contract (`reference`):
    logits: [B, V] float32 / bfloat16 / float16; suppress: [V] bool; ban_rows: [B] bool; banned_id: int
    masked[b, v] = -inf where suppress[v] or (ban_rows[b] and v == banned_id), else logits[b, v]
    returns masked.argmax(-1) as int64 [B] (first index among equal maxima; 0 for an all -inf row)
This is the talker's greedy step (suppressed special codes, EOS banned below min_frames). Logits must
be NaN-free: torch.argmax picks a NaN, the kernel ignores it. The talker's greedy step calls `run`
(after its repetition penalty).

`run` launches the kernel when `common.launchable` holds (CUDA, or CPU under TRITON_INTERPRET=1;
no autograd; kernels ENABLED), logits, suppress and ban_rows are contiguous, logits is 2-D float32 /
bfloat16 / float16 with B >= 1 and 1 <= V < 2^31, suppress is bool [V] and ban_rows bool [B];
otherwise it returns the reference.
One program scans one row in BLOCK-wide chunks, each lane keeping a running (max, first index).
V is a compile-time constant (one compile per vocabulary size).
"""

from __future__ import annotations

import torch

from .common import FLOAT_DTYPES, device_of, launchable, tl, triton

BLOCK = 2048


def reference(logits: torch.Tensor, suppress: torch.Tensor, ban_rows: torch.Tensor,
              banned_id: int) -> torch.Tensor:
    masked = logits.masked_fill(suppress, float("-inf"))
    banned = ban_rows[:, None] & (torch.arange(logits.shape[-1], device=logits.device) == banned_id)
    return masked.masked_fill(banned, float("-inf")).argmax(-1)


def eligible(logits: torch.Tensor, suppress: torch.Tensor, ban_rows: torch.Tensor) -> bool:
    return (logits.ndim == 2 and logits.shape[0] >= 1 and 1 <= logits.shape[1] < 2 ** 31
            and logits.dtype in FLOAT_DTYPES and all(t.is_contiguous() for t in (logits, suppress, ban_rows))
            and suppress.dtype == ban_rows.dtype == torch.bool
            and suppress.shape == (logits.shape[1],) and ban_rows.shape == (logits.shape[0],)
            and launchable(logits, suppress, ban_rows))


def run(logits: torch.Tensor, suppress: torch.Tensor, ban_rows: torch.Tensor, banned_id: int) -> torch.Tensor:
    if eligible(logits, suppress, ban_rows):
        return kernel(logits, suppress, ban_rows, banned_id)
    return reference(logits, suppress, ban_rows, banned_id)


def kernel(logits: torch.Tensor, suppress: torch.Tensor, ban_rows: torch.Tensor, banned_id: int) -> torch.Tensor:
    """Triton; assumes `eligible(logits, suppress, ban_rows)`."""
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    block = min(BLOCK, triton.next_power_of_2(v))
    with device_of(logits):
        _masked_argmax[(b,)](logits, suppress.view(torch.uint8), ban_rows.view(torch.uint8), out, banned_id,
                             V=v, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return out


if triton is not None:
    @triton.jit(do_not_specialize=["banned_id"])
    def _masked_argmax(logits_ptr, suppress_ptr, ban_rows_ptr, out_ptr, banned_id,
                       V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        banned = tl.load(ban_rows_ptr + row) != 0
        base = logits_ptr + row.to(tl.int64) * V
        lane_max = tl.full([BLOCK], float("-inf"), tl.float32)     # per lane: running max, first index
        lane_idx = tl.zeros([BLOCK], tl.int32)
        for start in range(0, V, BLOCK):
            col = start + tl.arange(0, BLOCK)
            inside = col < V
            drop = (tl.load(suppress_ptr + col, mask=inside, other=1) != 0) | (banned & (col == banned_id))
            x = tl.load(base + col, mask=inside, other=float("-inf")).to(tl.float32)
            x = tl.where(drop, float("-inf"), x)
            take = x > lane_max
            lane_max = tl.where(take, x, lane_max)
            lane_idx = tl.where(take, col, lane_idx)
        best = tl.max(lane_max, axis=0)
        first = tl.min(tl.where(lane_max == best, lane_idx, V), axis=0)   # V: no lane (cannot win)
        tl.store(out_ptr + row, first.to(tl.int64))
