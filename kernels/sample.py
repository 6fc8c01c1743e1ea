"""Per-row token choice fused: temperature, top-k, top-p, then a draw with given exponential noise
(or argmax for greedy rows) over [B, V] logits, one program per row.

Contract (`reference`, what voxpipe.services.runtime.sampling.sample_rows runs):
    logits: [B, V] float32; greedy: [B] bool; temperature: [B] float32 (1 for greedy rows);
    top_k: [B] int64 in [1, V] (V: off); drop_below: [B] float32, 1 - top_p (0: off);
    noise: [B, V] float32 Exp(1) draws, rows may be strided (a view of a wider buffer)
    scores = logits / temperature; ok = the max of scores is finite (no NaN, no +inf, not all -inf)
    top-k: scores below the k-th largest -> -inf (ties at the k-th value all stay)
    top-p: sort ascending (stable), cumulative softmax; positions with cumsum <= drop_below, never
           the last, -> -inf (at a tie the earlier indices go first, as the stable sort orders them)
    sampled row: argmax(softmax(scores) / noise), or 0 when not ok; greedy row: argmax(logits)
    returns (ids [B] int64, ok [B] bool)
torch.multinomial draws one sample exactly so (argmax(p / q), q ~ Exp(1)), which makes a row with
noise from its own generator a transformers sample. The kernel sorts and sums in another order than
PyTorch: softmax and cumulative sums may differ in the last bits, so a top-p boundary that falls
within a rounding error of a cumulative sum, or two near-equal p / q, may choose differently; the
checks report how often (never in practice), while top-k, ok and greedy rows are exact.

`run` launches the kernel when `common.launchable` holds (CUDA, or CPU under TRITON_INTERPRET=1;
no autograd; kernels ENABLED), logits is float32 contiguous [B, V] with 1 <= V <= MAX_V, the
per-row tensors are contiguous [B] of the dtypes above, and noise is float32 [B, V] with unit
stride along V; otherwise it returns the reference. A CUDA graph captures it as one launch.
"""

from __future__ import annotations

import torch

from .common import device_of, launchable, tl, triton

MAX_V = 8192          # the whole row sits in one program's registers (the talker: 3,072; the predictor: 2,048)


def reference(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
              drop_below: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inf = float("-inf")
    scores = logits / temperature[:, None]
    ok = torch.isfinite(scores.amax(-1))                          # NaN if any score is
    kth = scores.sort(-1, descending=True).values.gather(1, (top_k - 1)[:, None])
    scores = scores.masked_fill(scores < kth, inf)                # top-k (k = V: nothing below the min)
    ascending, order = scores.sort(dim=-1, stable=True)
    cum = ascending.softmax(-1).cumsum(-1)
    drop = (cum <= drop_below[:, None]) & (drop_below > 0)[:, None]
    drop[:, -1] = False
    scores = scores.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), inf)   # top-p
    probs = scores.softmax(-1)
    stand_in = torch.zeros_like(probs)
    stand_in[:, 0] = 1.0
    probs = torch.where(ok[:, None], probs, stand_in)
    ids = torch.where(greedy, logits.argmax(-1), (probs / noise).argmax(-1))
    return ids, ok


def eligible(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
             drop_below: torch.Tensor, noise: torch.Tensor) -> bool:
    if logits.ndim != 2 or logits.dtype != torch.float32 or not logits.is_contiguous():
        return False
    b, v = logits.shape
    rows = ((greedy, torch.bool), (temperature, torch.float32), (top_k, torch.int64), (drop_below, torch.float32))
    return (b >= 1 and 1 <= v <= MAX_V
            and all(t.shape == (b,) and t.dtype == dt and t.is_contiguous() for t, dt in rows)
            and noise.dtype == torch.float32 and noise.shape == (b, v) and noise.stride(1) == 1
            and launchable(logits, greedy, temperature, top_k, drop_below, noise))


def run(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
        drop_below: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if eligible(logits, greedy, temperature, top_k, drop_below, noise):
        return kernel(logits, greedy, temperature, top_k, drop_below, noise)
    return reference(logits, greedy, temperature, top_k, drop_below, noise)


def kernel(logits: torch.Tensor, greedy: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           drop_below: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton; assumes `eligible(...)`."""
    b, v = logits.shape
    ids = torch.empty(b, dtype=torch.int64, device=logits.device)
    ok = torch.empty(b, dtype=torch.bool, device=logits.device)
    block = triton.next_power_of_2(v)
    with device_of(logits):
        _sample[(b,)](logits, greedy.view(torch.uint8), temperature, top_k, drop_below, noise, noise.stride(0),
                      ids, ok.view(torch.uint8), V=v, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return ids, ok


if triton is not None:
    @triton.jit
    def _softmax(x):
        """Softmax of a row whose padding and masked ids are -inf; its max must be finite."""
        e = tl.exp(x - tl.max(x, axis=0))
        return tl.math.div_rn(e, tl.zeros_like(e) + tl.sum(e, axis=0))

    @triton.jit
    def _sample(logits_ptr, greedy_ptr, temperature_ptr, top_k_ptr, drop_below_ptr, noise_ptr, noise_stride,
                ids_ptr, ok_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        col = tl.arange(0, BLOCK)
        inside = col < V
        neg = float("-inf")
        x = tl.load(logits_ptr + row.to(tl.int64) * V + col, mask=inside, other=neg)
        greedy = tl.load(greedy_ptr + row) != 0
        temperature = tl.load(temperature_ptr + row)
        s = tl.math.div_rn(x, tl.zeros_like(x) + temperature)     # IEEE division, as PyTorch's
        # ok: no NaN, no +inf, not all -inf (the max of the scores is finite)
        bad = tl.sum(((s != s) | (s == float("inf"))).to(tl.int32), axis=0)
        top = tl.max(tl.where(s == s, s, neg), axis=0)
        ok = (bad == 0) & (top > neg)
        s = tl.where(s == s, s, neg)                       # a NaN row draws nothing (not ok: id 0)
        # top-k: scores below the k-th largest go (padding sorts last)
        k = tl.load(top_k_ptr + row).to(tl.int32)
        desc = tl.sort(s, descending=True)
        kth = tl.max(tl.where(col == k - 1, desc, neg), axis=0)
        s = tl.where(s < kth, neg, s)
        # top-p: the positions of the ascending sort dropped are a prefix, m long (padding, -inf,
        # sorts first with zero mass, like masked ids); the first kept value is the threshold, and of
        # the ids equal to it the earliest `ties` go (the stable sort puts them first)
        drop_below = tl.load(drop_below_ptr + row)
        asc = tl.sort(s)
        cum = tl.cumsum(_softmax(asc), axis=0)
        dropped = (cum <= drop_below) & (col < BLOCK - 1)
        m = tl.sum(dropped.to(tl.int32), axis=0)
        first_kept = tl.max(tl.where(col == m, asc, neg), axis=0)
        ties = m - tl.sum((asc < first_kept).to(tl.int32), axis=0)
        equal = (s == first_kept) & inside
        rank = tl.cumsum(equal.to(tl.int32), axis=0)
        drop = (s < first_kept) | (equal & (rank <= ties))
        s = tl.where(drop & (tl.zeros_like(col) + (drop_below > 0).to(tl.int32) != 0), neg, s)
        probs = _softmax(s)
        q = tl.load(noise_ptr + row.to(tl.int64) * noise_stride + col, mask=inside, other=1.0)
        drawn = tl.argmax(tl.where(inside & ok, tl.math.div_rn(probs, q), -1.0), axis=0)   # not ok: 0
        best = tl.argmax(tl.where(inside & (x == x), x, neg), axis=0)   # (a NaN row is not ok anyway)
        tl.store(ids_ptr + row, tl.where(greedy, best, drawn).to(tl.int64))
        tl.store(ok_ptr + row, ok.to(tl.uint8))
