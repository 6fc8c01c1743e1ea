"""Attention over a paged KV cache, read in place: each sequence's keys and values stay in the blocks
its table lists (no gather into a dense copy). One kernel serves a decode step (one new token per
sequence) and a prefill that extends a cached prefix (S new tokens per sequence).

Contract (`reference`):
    q: [N, Hq, S, D]  the rotated queries (unit stride along D; other strides free)
    k_cache, v_cache: [B, Hkv, bs, D] contiguous, one float dtype with q (runtime/paged_kv.py's
        layout: block b holds positions b_off .. b_off + bs - 1 of whichever sequence owns it)
    tables: [N, M] int64, sequence n's position p in block tables[n, p // bs] at offset p % bs
        (entries past a row's reach are never read: they may name any block)
    start: [N] int64, sequence n's new tokens sit at positions start[n] .. start[n] + S - 1 (their
        keys already written); query s attends to positions 0 .. start[n] + s (causal)
    kv_bound: int >= max(start) + S, static: how far any row may reach (sets the split grid)
    returns out [N, Hq, S, D], dtype of q. Query head h reads KV head h // (Hq / Hkv).
The kernel computes scores, softmax and the weighted sum in float32 (q.k as a 16-bit dot with a
float32 accumulator; p.v with float32 inputs up to PV_FP32_MAX_S new tokens, past that with p
rounded to 16 bits for the tensor cores, as flash attention does) and rounds once. Triton's CPU
interpreter gets 16-bit dots wrong and its tl.dot (numpy's BLAS) rounds a row by the other rows of
its tile, so there (EMULATE) each output is a float32 sum of products in one fixed order: the
products are the same (a 16-bit product is exact in float32), the sums' order may differ.

Splits (flash decoding): a row's positions are cut into splits of `split` positions (a multiple of
BLOCK_N), each a program computing a partial softmax; a second launch merges a row's splits in
order. A split past a row's length does nothing. With a fixed `split` the arithmetic of a row does
not depend on the other rows, on N or on kv_bound (programs only skip work they do not have):
the result is batch-invariant. `split=None` picks one for parallelism (then it may depend on N).

One computation per query row (the batch-invariant mode: one split, `pv_fp32=True` and a fixed
`block_r`): a row's program walks the key tiles 0, BLOCK_N, ... up to the last position any row of
its tile sees; a tile past the row's own position adds exact zeros (every score -inf: scale 1, p 0)
and a position masked inside a tile an exact 0 to its sums, and with BLOCK_R fixed the row goes
through the same compiled dot whether it is a decode step (S=1), a token of an extend / packed
segment or of a whole prompt from position 0: the same bits in each (tests/test_kernels.py).

`run` launches the kernel when `common.launchable` holds and: D a power of two in 16 .. MAX_D; Hq a
multiple of Hkv; caches contiguous; one float dtype; tables / start int64. Otherwise the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import FLOAT_DTYPES, INTERPRET, device_of, launchable, round_to, tl, triton

MAX_D = 256
BLOCK_N = 64          # key positions per inner tile
TARGET_PROGRAMS = 256  # `split=None`: rows that make this many programs run unsplit
SPLIT = 256            # `split=None`: else positions per split ...
PARTIAL_BYTES = 64 << 20   # ... unless the partial results of all splits would pass this
PV_FP32_MAX_S = 16    # up to this many new tokens p.v runs with float32 inputs; more: p in 16 bits
# more than 64 query rows a (sequence, KV head) in 16 bits with p rounded for the tensor cores (extend
# rows, packed segments): (BLOCK_R, BLOCK_N, num_warps) = WIDE_TILE and the unmasked tiles walked
# first (`open_first`). H200, bench/paged_tune.py --variants (RESULTS.md 2026-12-04): 1 x 320 new
# tokens over 26k positions 704 -> 478 us, over 4k 157 -> 110, 8 x 320 over 8k 1,584 -> 1,268; 1 x 32
# over 26k 109 -> 98. Fewer rows (decode) keep the narrow tiles; the batch-invariant mode passes its own.
WIDE_TILE = (128, 128, 8)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
              start: torch.Tensor, kv_bound: int, scale: float) -> torch.Tensor:
    n, hq, s, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    nb = -(-kv_bound // bs)
    idx = tables[:, :nb]
    keys = k_cache[idx].transpose(1, 2).reshape(n, hkv, nb * bs, d)[:, :, :kv_bound]
    values = v_cache[idx].transpose(1, 2).reshape(n, hkv, nb * bs, d)[:, :, :kv_bound]
    # positions past a row's reach may name any block (a graph's stale table columns): zeros there,
    # so that nothing non-finite is multiplied by their zero weights
    seen = (torch.arange(kv_bound, device=q.device)[None, :] < (start + s)[:, None])[:, None, :, None]
    keys, values = keys.masked_fill(~seen, 0), values.masked_fill(~seen, 0)
    q_pos = start[:, None] + torch.arange(s, device=q.device)[None, :]                         # [N, S]
    mask = torch.arange(kv_bound, device=q.device)[None, None, :] <= q_pos[:, :, None]          # [N, S, L]
    rep = hq // hkv
    qg = q.reshape(n, hkv, rep * s, d)
    mask = mask[:, None, None].expand(n, 1, rep, s, kv_bound).reshape(n, 1, rep * s, kv_bound)
    out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(n, hq, s, d)


def eligible(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
             start: torch.Tensor) -> bool:
    if q.ndim != 4 or k_cache.ndim != 4 or tables.ndim != 2 or start.ndim != 1:
        return False
    n, hq, s, d = q.shape
    hkv = k_cache.shape[1]
    return (16 <= d <= MAX_D and d & (d - 1) == 0 and q.numel() > 0 and hkv > 0 and hq % hkv == 0
            and k_cache.shape == v_cache.shape and k_cache.shape[3] == d
            and k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(3) == 1
            and tables.shape[0] == n and start.shape[0] == n
            and tables.dtype == torch.long and start.dtype == torch.long
            and q.dtype in FLOAT_DTYPES and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and launchable(q, k_cache, v_cache, tables, start))


def run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, start: torch.Tensor,
        kv_bound: int, scale: float, split: int | None = None) -> torch.Tensor:
    if eligible(q, k_cache, v_cache, tables, start):
        return kernel(q, k_cache, v_cache, tables, start, kv_bound, scale, split)
    return reference(q, k_cache, v_cache, tables, start, kv_bound, scale)


def _split_len(programs: int, partial_row_bytes: int, kv_bound: int, split: int | None,
               block_n: int = BLOCK_N) -> int:
    """Positions per split. Given: `split` (rounded up to BLOCK_N). Else one split when the rows
    alone fill the GPU (TARGET_PROGRAMS), or SPLIT positions -- fewer, longer splits where the
    partial results would pass PARTIAL_BYTES. So for a given batch shape the split does not depend on
    kv_bound below SPLIT * PARTIAL_BYTES / partial_row_bytes positions: a decode graph's bucket and
    the same step run eagerly at its exact length do the same arithmetic."""
    if split is not None:
        return max(block_n, -(-split // block_n) * block_n)
    if programs >= TARGET_PROGRAMS:
        return max(block_n, -(-kv_bound // block_n) * block_n)
    most = max(1, PARTIAL_BYTES // max(partial_row_bytes, 1))
    per = max(SPLIT, -(-kv_bound // most))
    return -(-per // block_n) * block_n


def kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, start: torch.Tensor,
           kv_bound: int, scale: float, split: int | None = None, pv_fp32: bool | None = None,
           block_r: int | None = None, block_n: int | None = None, num_warps: int | None = None,
           num_stages: int | None = None, open_first: bool | None = None) -> torch.Tensor:
    """Triton; assumes `eligible(...)`. `pv_fp32`: p.v with float32 inputs whatever S (None: up to
    PV_FP32_MAX_S new tokens). `block_r`: query rows per program (16, 32, 64 or 128; None: by Hq / Hkv
    * S). `block_n` (key positions per inner tile), `num_warps`, `num_stages`: the launch's tiling
    (bench/paged_tune.py sweeps them); none changes what a row computes beyond its sums' tiling.
    `open_first`: a program first walks the key tiles every row of its tile sees whole (below its
    tile's first query position) without the causal mask and the bounds checks, then the rest masked:
    the same arithmetic (a mask that allows a score leaves it as it is), less work a tile. None for
    any of these: WIDE_TILE and open_first for more than 64 rows in 16 bits (not `pv_fp32`), else
    BLOCK_N, 4 warps and every tile masked."""
    n, hq, s, d = q.shape
    _, hkv, bs, _ = k_cache.shape
    rep = hq // hkv
    rows = rep * s
    pv32 = q.dtype == torch.float32 or (s <= PV_FP32_MAX_S if pv_fp32 is None else pv_fp32)
    wide = block_r is None and rows > 64 and not pv32      # extend rows / packed segments in 16 bits
    if block_r is None:
        block_r = WIDE_TILE[0] if wide else 16 if rows <= 16 else (32 if rows <= 32 else 64)
    if block_n is None:
        block_n = WIDE_TILE[1] if wide else BLOCK_N
    if num_warps is None:
        num_warps = WIDE_TILE[2] if wide else 4
    if open_first is None:
        open_first = wide
    row_tiles = -(-rows // block_r)
    split_len = _split_len(n * hkv * row_tiles, n * hq * s * (d + 2) * 4, kv_bound, split, block_n)
    splits = -(-kv_bound // split_len)
    out = torch.empty(n, hq, s, d, dtype=q.dtype, device=q.device)
    m_part = l_part = acc = out
    if splits > 1:
        m_part = torch.empty(n, hq * s, splits, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc = torch.empty(n, hq * s, splits, d, dtype=torch.float32, device=q.device)
    with device_of(q):
        _partial[(n * row_tiles, hkv, splits)](
            q, k_cache, v_cache, tables, start, out, m_part, l_part, acc,
            q.stride(0), q.stride(1), q.stride(2), tables.stride(0), splits, split_len, row_tiles, scale,
            S=s, HQ=hq, HKV=hkv, BS=bs, D=d, BLOCK_R=block_r, BLOCK_N=block_n, DIRECT=splits == 1,
            PV_FP32=pv32, OPEN_FIRST=open_first, EMULATE=INTERPRET, num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}))
        if splits > 1:
            _merge[(n, hq * s)](m_part, l_part, acc, out, start, splits, split_len, S=s, D=d, num_warps=4)
    return out


if triton is not None:
    # S (new tokens a row) and the grid's integers are plain arguments, never specialised: a prompt
    # of a new length must not compile a kernel on the request path (~0.7 s on the H200 each time)
    @triton.jit(do_not_specialize=["q_sn", "q_sh", "tab_sn", "splits", "split_len", "row_tiles", "S"])
    def _partial(q_ptr, kc_ptr, vc_ptr, tab_ptr, start_ptr, out_ptr, m_ptr, l_ptr, acc_ptr,
                 q_sn, q_sh, q_ss, tab_sn, splits, split_len, row_tiles, scale,
                 S, HQ: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, PV_FP32: tl.constexpr,
                 OPEN_FIRST: tl.constexpr, EMULATE: tl.constexpr):
        pid = tl.program_id(0)
        nrow = (pid // row_tiles).to(tl.int64)
        tile = pid % row_tiles
        g = tl.program_id(1)
        sp = tl.program_id(2)
        REP: tl.constexpr = HQ // HKV
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, D)
        # query rows of this tile: (head within the group, new token), head-major
        r = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = r < REP * S
        rr = tl.where(row_ok, r, 0)
        head = g * REP + rr // S
        tok = rr % S
        first = tl.load(start_ptr + nrow).to(tl.int32)
        q_pos = first + tok                                                    # [R]
        reach = tl.max(tl.where(row_ok, q_pos, 0)) + 1                         # positions any row sees
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, reach)
        q = tl.load(q_ptr + nrow * q_sn + head[:, None] * q_sh + tok[:, None] * q_ss + d[None, :],
                    mask=row_ok[:, None], other=0.0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        masked_from = lo
        if OPEN_FIRST:
            # whole tiles below the tile's first query position: every row sees every key there
            # (and every key is one of the row's blocks): no mask, no bounds checks
            open_hi = tl.minimum(hi, tl.min(tl.where(row_ok, q_pos, hi)) + 1)
            masked_from = lo + tl.maximum(open_hi - lo, 0) // BLOCK_N * BLOCK_N
            for kv in range(lo, masked_from, BLOCK_N):
                pos = kv + tl.arange(0, BLOCK_N)
                blk = tl.load(tab_ptr + nrow * tab_sn + pos // BS)
                at = ((blk * HKV + g) * BS + pos % BS)[:, None] * D + d[None, :]
                keys = tl.load(kc_ptr + at)
                vals = tl.load(vc_ptr + at)
                if EMULATE:
                    sc = tl.sum(q.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2)
                elif dtype == tl.float32:
                    sc = tl.dot(q, tl.trans(keys), input_precision="ieee")
                else:
                    sc = tl.dot(q, tl.trans(keys))
                sc = sc * scale
                m_new = tl.maximum(m, tl.max(sc, axis=1))
                shift = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m - shift)
                p = tl.exp(sc - shift[:, None])
                l = l * alpha + tl.sum(p, axis=1)
                if EMULATE:
                    pe = p if PV_FP32 else round_to(p, dtype).to(tl.float32)
                    pv = tl.sum(pe[:, :, None] * vals.to(tl.float32)[None, :, :], axis=1)
                elif PV_FP32:
                    pv = tl.dot(p, vals.to(tl.float32), input_precision="ieee")
                else:
                    pv = tl.dot(p.to(dtype), vals)
                acc = acc * alpha[:, None] + pv
                m = m_new
        for kv in range(masked_from, hi, BLOCK_N):
            pos = kv + tl.arange(0, BLOCK_N)
            ok = pos < hi
            blk = tl.load(tab_ptr + nrow * tab_sn + pos // BS, mask=ok, other=0)
            at = ((blk * HKV + g) * BS + pos % BS)[:, None] * D + d[None, :]  # [N, D]
            keys = tl.load(kc_ptr + at, mask=ok[:, None], other=0.0)
            vals = tl.load(vc_ptr + at, mask=ok[:, None], other=0.0)
            if EMULATE:     # per output a fixed-order sum: the interpreter's tl.dot rounds a row by its tile
                sc = tl.sum(q.to(tl.float32)[:, None, :] * keys.to(tl.float32)[None, :, :], axis=2)
            elif dtype == tl.float32:
                sc = tl.dot(q, tl.trans(keys), input_precision="ieee")
            else:
                sc = tl.dot(q, tl.trans(keys))
            sc = sc * scale
            allowed = ok[None, :] & (pos[None, :] <= q_pos[:, None])
            sc = tl.where(allowed, sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, axis=1))
            # rows with nothing allowed yet keep m = -inf: shift by 0 there (their p are all 0)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            p = tl.exp(sc - shift[:, None])
            l = l * alpha + tl.sum(p, axis=1)
            if EMULATE:
                pe = p if PV_FP32 else round_to(p, dtype).to(tl.float32)
                pv = tl.sum(pe[:, :, None] * vals.to(tl.float32)[None, :, :], axis=1)
            elif PV_FP32:
                pv = tl.dot(p, vals.to(tl.float32), input_precision="ieee")
            else:   # a long prefill: p rounded to 16 bits for the tensor cores, as flash attention does
                pv = tl.dot(p.to(dtype), vals)
            acc = acc * alpha[:, None] + pv
            m = m_new
        if DIRECT:
            res = acc / tl.where(l == 0.0, 1.0, l)[:, None]
            dst = ((nrow * HQ + head) * S + tok)[:, None] * D + d[None, :]
            tl.store(out_ptr + dst, round_to(res, dtype), mask=row_ok[:, None])
        else:   # a split past every row's reach stores nothing: the merge reads none of it
            prow = (nrow * HQ + head) * S + tok                                 # [R] row of [N, Hq * S]
            keep = row_ok & (r * 0 + lo < reach)
            tl.store(m_ptr + prow * splits + sp, m, mask=keep)
            tl.store(l_ptr + prow * splits + sp, l, mask=keep)
            tl.store(acc_ptr + (prow * splits + sp)[:, None] * D + d[None, :], acc, mask=keep[:, None])

    @triton.jit(do_not_specialize=["splits", "split_len", "S"])
    def _merge(m_ptr, l_ptr, acc_ptr, out_ptr, start_ptr, splits, split_len, S, D: tl.constexpr):
        """One (sequence, head x token) row: its splits merged in order, up to the last one it reaches."""
        nrow = tl.program_id(0).to(tl.int64)
        hr = tl.program_id(1)
        HS = tl.num_programs(1)
        prow = nrow * HS + hr
        d = tl.arange(0, D)
        tok = hr % S
        reach = tl.load(start_ptr + nrow).to(tl.int32) + tok + 1
        used = tl.minimum((reach + split_len - 1) // split_len, splits)
        m = tl.full([D], float("-inf"), tl.float32)     # the same value in every lane (typed loop state)
        l = tl.zeros([D], tl.float32)
        acc = tl.zeros([D], tl.float32)
        for sp in range(0, used):
            m_s = tl.load(m_ptr + prow * splits + sp)
            l_s = tl.load(l_ptr + prow * splits + sp)
            a_s = tl.load(acc_ptr + (prow * splits + sp) * D + d)
            m_new = tl.maximum(m, m_s)
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            beta = tl.exp(m_s - shift)
            l = l * alpha + l_s * beta
            acc = acc * alpha + a_s * beta
            m = m_new
        res = acc / tl.where(l == 0.0, 1.0, l)
        tl.store(out_ptr + prow * D + d, round_to(res, out_ptr.dtype.element_ty))
