"""The paged KV cache: per layer, K and V as [num_blocks + 1, Hkv, block_size, D]; a sequence's
positions live in the blocks its block table lists (`block_pool.BlockTable`; position p in
table[p // block_size] at offset p % block_size). Block `scratch` (= num_blocks, one past the
blocks the pool hands out) takes the writes of padding (a CUDA-graph batch's rows past the real
ones, a right-padded prompt's positions past its blocks); nothing reads it.

Views, each an `AttentionCache` for one forward (layers call `attend(layer, q, k, v, scale)` with
q [B, Hq, S, D], k / v [B, Hkv, S, D], rotated):
- `packed(step)`: several sequences' new tokens packed into one row [1, T], each segment written at
  its own positions start .. start + length - 1 and attending to its earlier positions (a cached
  prefix included) and causally to itself: chunked prefill, and any prompt whose prefix was cached.
- `prefill_view(tables, s)`: whole prompts from position 0, right-padded to S: graph-friendly.
- `decode_view(n, kv_len, tables, start)`: one new token per sequence: graph-friendly (the tables
  [N, M] and positions [N] are tensors; shapes depend only on (n, kv_len)).
- `extend_view(tables, start, length, s, kv_bound)`: prompts that go on from a cached prefix, one
  per row, right-padded to S new tokens: graph-friendly (start, length [N] tensors; shapes depend
  only on (N, S)).
Decode and short packed segments read the blocks in place (kernels/paged_attention.py) where the
kernel launches (CUDA, or the CPU under Triton's interpreter); elsewhere, and for long packed
segments (flash attention over a gathered copy is faster there), attention reads a sequence's
blocks gathered into one dense [Hkv, L, D] run, positions past a sequence's length masked."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from voxpipe import kernels

from . import determinism, kv_cache
from .kv_cache import _causal_flash, _sdpa, chunk_path, plan_chunk

PACKED_KERNEL_MAX = 512    # packed segments up to this many new tokens attend with the paged kernel
# the batch-invariant mode (runtime/determinism.py, inside its scope): every view -- decode, extend,
# packed segments, whole prompts from position 0 -- writes its keys into the blocks and attends from
# them with the paged kernel where it launches, with one split a row (its arithmetic alone, no partial
# results), p.v in float32 for any number of new tokens and INVARIANT_BLOCK_R query rows a program: a
# query row's bits are the same on every path (a prefix-cache hit, a miss, a recompute after
# preemption, any batch). Where the kernel does not launch, every view attends through
# determinism.attention (`_sdpa`), keys in fixed blocks from position 0: one computation there too.
INVARIANT_SPLIT = 1 << 30
INVARIANT_BLOCK_R = 16


def _kernel(cache: "PagedKVCache", q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
            start: torch.Tensor, bound: int, scale: float) -> torch.Tensor:
    if determinism.in_scope():
        # fixed tiles, every tile masked: one compiled loop for every row, whichever path it takes
        return kernels.paged_attention.kernel(q, kc, vc, tables, start, bound, scale, INVARIANT_SPLIT, pv_fp32=True,
                                              block_r=INVARIANT_BLOCK_R, block_n=kernels.paged_attention.BLOCK_N,
                                              num_warps=4, open_first=False)
    return kernels.paged_attention.kernel(q, kc, vc, tables, start, bound, scale, cache.split)


def _gathered(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, start: torch.Tensor,
              bound: int, scale: float) -> torch.Tensor:
    """The kernel's reference; in the batch-invariant mode its mask through `_sdpa` (determinism.attention)."""
    if not determinism.in_scope():
        return kernels.paged_attention.reference(q, kc, vc, tables, start, bound, scale)
    n, _, s, d = q.shape
    hkv, bs = kc.shape[1], kc.shape[2]
    nb = -(-bound // bs)
    keys = kc[tables[:, :nb]].transpose(1, 2).reshape(n, hkv, nb * bs, d)[:, :, :bound]
    values = vc[tables[:, :nb]].transpose(1, 2).reshape(n, hkv, nb * bs, d)[:, :, :bound]
    seen = (torch.arange(bound, device=q.device)[None, :] < (start + s)[:, None])[:, None, :, None]
    keys, values = keys.masked_fill(~seen, 0), values.masked_fill(~seen, 0)
    q_pos = start[:, None] + torch.arange(s, device=q.device)[None, :]
    mask = torch.arange(bound, device=q.device)[None, None, :] <= q_pos[:, :, None]              # [N, S, L]
    return _sdpa(q, keys, values, mask[:, None], scale)


@dataclass(frozen=True)
class PagedSegment:
    """One sequence's part of a packed row: its `length` new tokens sit at `offset` .. offset +
    length - 1 of the row and go to positions `start` .. start + length - 1 of its blocks."""

    blocks: tuple[int, ...]
    start: int
    length: int
    offset: int


@dataclass
class PagedPackedStep:
    segments: list[PagedSegment]

    @classmethod
    def pack(cls, parts: list[tuple[list[int], int, int]]) -> "PagedPackedStep":
        """`parts`: (block ids, start, length) per sequence, in row order."""
        segments, offset = [], 0
        for blocks, start, length in parts:
            segments.append(PagedSegment(tuple(blocks), start, length, offset))
            offset += length
        return cls(segments)

    def positions(self, device: torch.device) -> torch.Tensor:
        """[1, T]: each token's position in its own sequence."""
        return torch.cat([torch.arange(s.start, s.start + s.length, device=device) for s in self.segments])[None]

    def ends(self, device: torch.device) -> torch.Tensor:
        """[segments]: the row index of each segment's last token."""
        return torch.tensor([s.offset + s.length - 1 for s in self.segments], device=device)


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch, self.null = num_blocks, num_blocks + 1
        self.split: int | None = None      # the paged kernel's split (fixed: batch-invariant attention)
        shape = (num_blocks + 2, num_kv_heads, block_size, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def scrub(self, blocks: list[int]) -> None:
        """Zero these blocks' keys and values (a sequence whose numbers went non-finite wrote them):
        attention reads a block's unwritten positions under a False mask, and 0 * NaN is NaN."""
        if not blocks:
            return
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for kc, vc in zip(self.k, self.v):
            kc.index_fill_(0, idx, 0)
            vc.index_fill_(0, idx, 0)

    def table_tensor(self, tables: list, width: int, device: torch.device | None = None) -> torch.Tensor:
        """[len(tables), width] int64: each table's blocks (a list, or BlockTable.array()), padded with
        the null block. Filled in numpy
        (a row's slice from its list: 64 rows ~0.2 ms on the CPU, a tensor per row ~1.5 ms), one copy."""
        out = np.full((len(tables), width), self.null, dtype=np.int64)
        for i, t in enumerate(tables):
            k = min(len(t), width)
            out[i, :k] = t[:k]
        host = torch.from_numpy(out)
        return host if device is None else host.to(device, non_blocking=True)

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [B, Hkv, length, D] of positions 0 .. length - 1 of each table row ([B, >= blocks])."""
        nb = -(-length // self.block_size)
        kc, vc = self.k[layer], self.v[layer]
        b, (_, hkv, bs, d) = table.shape[0], kc.shape
        idx = table[:, :nb]
        keys = kc[idx].transpose(1, 2).reshape(b, hkv, nb * bs, d)[:, :, :length]
        values = vc[idx].transpose(1, 2).reshape(b, hkv, nb * bs, d)[:, :, :length]
        return keys, values

    def write(self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write k / v [..., Hkv, D] at (blocks, offsets) (same leading shape); writes aimed at the
        null block (a table's padding) go to the scratch block."""
        blocks = torch.where(blocks == self.null, self.scratch, blocks)
        self.k[layer][blocks, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def packed(self, step: PagedPackedStep) -> "_PagedPacked":
        return _PagedPacked(self, step)

    def plan_chunks(self, chunk: int, max_len: int, num_heads: int) -> int:
        """On the thread that will serve them (cuDNN's plans are thread-local): plan the two-part cuDNN
        attention (kv_cache.plan_chunk) for a cold long prompt's packed chunks -- `chunk` new tokens
        after 0, chunk, 2 * chunk, ... cached positions, up to `max_len` -- with their keys laid out
        as `_PagedPacked` gathers them. Returns how many shapes were planned (0 where the fused
        kernels do not run, or cuDNN attention does not run these shapes: flash serves them)."""
        kc = self.k[0]
        if not kv_cache.fast_attention(kc.device, kc.dtype) or chunk <= PACKED_KERNEL_MAX or chunk > max_len:
            return 0
        q = torch.zeros(1, num_heads, chunk, kc.shape[-1], dtype=kc.dtype, device=kc.device)
        planned = 0
        try:
            for p in range(0, max_len - chunk + 1, chunk):
                table = torch.full((1, -(-(p + chunk) // self.block_size)), self.null, dtype=torch.long,
                                   device=kc.device)
                plan_chunk(q, *self.gather(0, table, p + chunk))
                planned += 1
            if kc.is_cuda:
                torch.cuda.synchronize(kc.device)
        except RuntimeError:     # no cuDNN attention for these shapes here: flash attention serves them
            kv_cache.forget_plans()
            return 0
        return planned

    def prefill_view(self, tables: torch.Tensor, new_tokens: int) -> "_PagedPrefill":
        """Whole prompts from position 0: row b's S tokens go to positions 0 .. S-1 of table row b
        ([B, M] int64, padded with the null block). Shapes depend only on (B, S)."""
        return _PagedPrefill(self, tables, new_tokens)

    def extend_view(self, tables: torch.Tensor, start: torch.Tensor, length: torch.Tensor, new_tokens: int,
                    kv_bound: int) -> "_PagedExtend":
        """Row b's `length[b]` new tokens (of S, right-padded) go to positions start[b] .. start[b] +
        length[b] - 1 of table row b ([B, M], M * block_size >= kv_bound, padded with the null
        block) and attend to its positions before them and causally to each other; the padding's
        keys go to the scratch block. kv_bound: how far any row may reach (static)."""
        return _PagedExtend(self, tables, start, length, new_tokens, kv_bound)

    def decode_view(self, n: int, kv_len: int, tables: torch.Tensor, start: torch.Tensor) -> "_PagedDecode":
        """One new token for each of n sequences: tables [n, M] (each sequence's blocks), start [n]
        its position; it attends to positions 0 .. start. Shapes depend only on (n, kv_len)."""
        return _PagedDecode(self, n, kv_len, tables, start)


class _PagedPacked:
    def __init__(self, cache: PagedKVCache, step: PagedPackedStep) -> None:
        self.cache, self.step = cache, step
        self.paths: list[str] = []     # per segment, the attention its first layer took ("paged" or chunk_path's)
        dev, bs = cache.k[0].device, cache.block_size
        self.where = []
        self.tables = []
        self.starts = []
        for sg in step.segments:
            pos = torch.arange(sg.start, sg.start + sg.length)
            table = torch.tensor(sg.blocks, dtype=torch.long)
            self.where.append((table[pos // bs].to(dev), (pos % bs).to(dev)))
            self.tables.append(table[None].to(dev))
            self.starts.append(torch.tensor([sg.start], device=dev))

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [1, Hq, T, D], k / v [1, Hkv, T, D]: segment by segment, its keys into its blocks, then its
        queries over its positions 0 .. start + length - 1."""
        outs = []
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        for i, (sg, (blocks, offsets), table, start) in enumerate(zip(self.step.segments, self.where, self.tables,
                                                                       self.starts)):
            rows = slice(sg.offset, sg.offset + sg.length)
            self.cache.write(layer, blocks, offsets, k[0, :, rows].transpose(0, 1), v[0, :, rows].transpose(0, 1))
            qs = q[:, :, rows]
            # every layer's segment has the same shapes and layouts: its path is decided once
            if i == len(self.paths) and ((sg.length <= PACKED_KERNEL_MAX or determinism.in_scope())
                                         and kernels.paged_attention.eligible(qs, kc, vc, table, start)):
                self.paths.append("paged")
            if i < len(self.paths) and self.paths[i] == "paged":
                outs.append(_kernel(self.cache, qs, kc, vc, table, start, sg.start + sg.length, scale))
                continue
            keys, values = self.cache.gather(layer, table, sg.start + sg.length)
            if i == len(self.paths):
                self.paths.append(chunk_path(qs, keys, values))
            outs.append(_causal_flash(qs, keys, values, scale, self.paths[i]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


class _PagedPrefill:
    def __init__(self, cache: PagedKVCache, tables: torch.Tensor, s: int) -> None:
        self.cache = cache
        pos = torch.arange(s, device=tables.device)
        bs = cache.block_size
        width = tables.shape[1]
        col = (pos // bs).clamp_max(width - 1)
        inside = (pos // bs) < width
        blocks = tables[:, col]                                                           # [B, S]
        self.blocks = torch.where(inside[None], blocks, torch.full_like(blocks, cache.null))
        self.offsets = (pos % bs)[None].expand_as(self.blocks)
        causal = pos[None, :] <= pos[:, None]                                             # [S, S]
        self.mask = causal[None, None].expand(tables.shape[0], 1, s, s)
        # the batch-invariant mode's kernel reads positions 0 .. S - 1 through the tables: [B, >= S / bs]
        need = -(-s // bs)
        extra = need - width
        self.tables = tables if extra <= 0 else torch.cat((tables, tables.new_full((tables.shape[0], extra), cache.null)), 1)
        self.start = torch.zeros(tables.shape[0], dtype=torch.long, device=tables.device)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal over the right-padded rows (a real query never sees a padded key): on CUDA in 16
        bits flash attention with no mask at all -- the [B, 1, rep * S, S] mask `_sdpa` builds is
        8 GiB for a 32k-row prompt (the talker prefills a whole prompt in one forward) --, elsewhere
        the same causal mask as before; in the batch-invariant mode the paged kernel from the blocks
        just written (a padded row's keys beyond its table went to the scratch block, and a real
        query never reaches them)."""
        self.cache.write(layer, self.blocks, self.offsets, k.transpose(1, 2), v.transpose(1, 2))
        if determinism.in_scope():
            kc, vc = self.cache.k[layer], self.cache.v[layer]
            if kernels.paged_attention.eligible(q, kc, vc, self.tables, self.start):
                return _kernel(self.cache, q, kc, vc, self.tables, self.start, q.shape[2], scale)
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            return _causal_flash(q, k, v, scale)
        return _sdpa(q, k, v, self.mask, scale)


class _PagedExtend:
    def __init__(self, cache: PagedKVCache, tables: torch.Tensor, start: torch.Tensor, length: torch.Tensor, s: int,
                 kv_bound: int) -> None:
        bs, width = cache.block_size, tables.shape[1]
        self.cache, self.tables, self.start, self.kv_bound = cache, tables, start, kv_bound
        step = torch.arange(s, device=start.device)
        pos = start[:, None] + step[None, :]                                              # [B, S]
        col = pos // bs
        blocks = tables.gather(1, col.clamp_max(width - 1))
        real = (step[None, :] < length[:, None]) & (col < width)
        self.blocks = torch.where(real, blocks, torch.full_like(blocks, cache.null))
        self.offsets = pos % bs

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.blocks, self.offsets, k.transpose(1, 2), v.transpose(1, 2))
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if kernels.paged_attention.eligible(q, kc, vc, self.tables, self.start):
            return _kernel(self.cache, q, kc, vc, self.tables, self.start, self.kv_bound, scale)
        # eager (no graph): only as far as the rows reach
        bound = min(self.kv_bound, int(self.start.max()) + q.shape[2])
        return _gathered(q, kc, vc, self.tables, self.start, bound, scale)


class _PagedDecode:
    def __init__(self, cache: PagedKVCache, n: int, kv_len: int, tables: torch.Tensor, start: torch.Tensor) -> None:
        bs = cache.block_size
        self.cache, self.kv_len, self.tables, self.start = cache, kv_len, tables[:n], start[:n]
        rows = torch.arange(n, device=start.device)
        col = (start // bs).clamp_max(tables.shape[1] - 1)
        self.blocks, self.offsets = self.tables[rows, col], start % bs

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.cache.write(layer, self.blocks, self.offsets, k[:, :, 0], v[:, :, 0])
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if kernels.paged_attention.eligible(q, kc, vc, self.tables, self.start):
            return _kernel(self.cache, q, kc, vc, self.tables, self.start, self.kv_len, scale)
        return _gathered(q, kc, vc, self.tables, self.start, self.kv_len, scale)
