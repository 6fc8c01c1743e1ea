"""KV caches. A cache decides what each new query attends to; attention layers call
`cache.attend(layer, q, k, v, scale)` with q: [B, Hq, S, D] and k, v: [B, Hkv, S, D] (already
rotated) and get [B, Hq, S, D] back.

- `SlotKVCache`: one preallocated slot per running sequence (the talker; the thinker's KV is paged:
  paged_kv.py). A step is described by a `SlotStep` (which slots, where each sequence's new tokens
  start), or by the graph-friendly views `prefill_view` (whole prompts from position 0) and `decode_view`.
- `GrowingCache`: a throwaway cache for short self-contained sequences (tests).
- `ShortCache`: preallocated keys for short self-contained sequences that advance together (the code
  predictor's 16-position frame); also offers the token-major `attend_tokens` (fused kernel).
- `SlidingWindowCache`: a per-slot ring of the last `window` keys (code2wav's pre-transformer).
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from voxpipe import kernels

from . import determinism

_FUSED: tuple | None = None


def _fused() -> tuple:
    """(flash_first, causal_lower_right): `flash_first()` is sdpa_kernel with flash attention first --
    cuDNN's kernel builds an execution plan for every new shape (45 ms on the H200, a first-sight stall
    for each new prompt length) and is slower past ~8k positions; flash has no plan and reads the
    grouped key heads in place (enable_gqa); bench/RESULTS.md, paged_tune. torch.nn.attention.bias
    imports torch._dynamo (seconds of CPU): done at import where CUDA is (below), else on first use
    (only tests run this path off CUDA)."""
    global _FUSED
    if _FUSED is None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        order = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH]
        if "set_priority" in inspect.signature(sdpa_kernel).parameters:
            def flash_first():
                return sdpa_kernel(order, set_priority=True)
        else:   # a torch without backend priorities: flash, else cuDNN (never the math path's [S, L] scores)
            def flash_first():
                return sdpa_kernel(order[:2])
        _FUSED = (flash_first, causal_lower_right)
    return _FUSED


if torch.cuda.is_available():
    _fused()


class AttentionCache(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor: ...


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Grouped-query attention without materialising repeated K/V: the `rep` query heads sharing a
    KV head attend as `rep * S` queries of that head. q [B, Hq, S, D], k/v [B, Hkv, L, D],
    mask [B, 1, S, L] bool or None. Inside `determinism.scope()`: `determinism.attention`."""
    if determinism.in_scope():
        return determinism.attention(q, k, v, mask, scale)
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    if hq == hkv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    rep = hq // hkv
    qg = q.reshape(b, hkv, rep * s, d)
    if mask is not None:
        mask = mask.unsqueeze(2).expand(b, 1, rep, s, mask.shape[-1]).reshape(b, 1, rep * s, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale)
    return out.reshape(b, hq, s, d)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The S new queries (the last S of the L key positions) attend causally: q [B, Hq, S, D],
    k/v [B, Hkv, L, D]."""
    s, total = q.shape[2], k.shape[2]
    if s == 1:
        return _sdpa(q, k, v, None, scale)
    q_pos = torch.arange(total - s, total, device=q.device)
    mask = (torch.arange(total, device=q.device)[None, :] <= q_pos[:, None])[None, None]
    return _sdpa(q, k, v, mask.expand(q.shape[0], 1, s, total), scale)


# Long prompts' chunks that attend through cuDNN: what `plan_chunk` planned, per thread. cuDNN builds an
# execution plan for every new (shapes, strides, causal) of q, k and v (45 ms on the H200, 1 s for its
# first) and keeps it in a *thread-local* cache (torch's cudnn/MHA.cpp), so a plan made on one thread is
# built again on another's first sight: plans are made on the thread that serves (the engine thread,
# StageEngine.prepare) and only the keys this thread planned take cuDNN; every other chunk goes to flash.
_PLANNED = threading.local()


def fast_attention(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a long prompt's chunks attend through the fused kernels (flash, cuDNN): CUDA in 16 bits.
    (Tests force it to run those paths' dispatch on the CPU.)"""
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention (equal head counts; causal: square, aligned) -> out [B, H, S, D] and the
    log-sum-exp of each query's scores [B, H, S] (float32). Off CUDA its reference: the same
    contract in float32 (the scores materialised: small shapes only)."""
    if not q.is_cuda:
        scores = (q.float() @ k.float().transpose(-1, -2)) * scale
        if causal:
            s = q.shape[2]
            scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool, device=q.device).tril(), float("-inf"))
        lse = torch.logsumexp(scores, -1)
        return (torch.exp(scores - lse[..., None]) @ v.float()).to(q.dtype), lse
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False,
                                                                 scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def _cudnn_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """`_causal_flash` for a chunk at the end of its keys through cuDNN, in two parts merged by their
    log-sum-exps: the chunk's queries over its own keys (square, causal: cuDNN's fast causal case,
    the key heads repeated), and over the cached prefix before it (no mask: the `rep` query heads
    sharing a key head attend as rep * S rows of it, reading it in place). q is made contiguous first
    (a projection's view otherwise; the prefix part copied it anyway), so cuDNN's plans depend on q's
    shape alone, as `chunk_key` assumes. On the H200 a 32k-token prompt's attention in 4,096-token
    chunks: 16.8 ms a layer against 26.0 with flash attention and its lower-right causal mask
    (bench/RESULTS.md)."""
    q = q.contiguous()
    b, hq, s, d = q.shape
    hkv, total = k.shape[1], k.shape[2]
    rep, p = hq // hkv, total - s
    own_k, own_v = k[:, :, p:], v[:, :, p:]
    if rep > 1:
        own_k, own_v = own_k.repeat_interleave(rep, dim=1), own_v.repeat_interleave(rep, dim=1)
    own, own_lse = _cudnn(q, own_k, own_v, True, scale)
    if p == 0:
        return own
    pre, pre_lse = _cudnn(q.reshape(b, hkv, rep * s, d), k[:, :, :p], v[:, :, :p], False, scale)
    return merge_parts(own, own_lse, pre.reshape(b, hq, s, d), pre_lse.reshape(b, hq, s))


def merge_parts(a: torch.Tensor, a_lse: torch.Tensor, b: torch.Tensor, b_lse: torch.Tensor) -> torch.Tensor:
    """Attention over two disjoint sets of keys, a and b ([..., S, D], each softmax-normalised over its
    own keys, with their log-sum-exps [..., S]) -> attention over both, in a's dtype (float32 inside)."""
    lse = torch.logaddexp(a_lse, b_lse)
    out = a.float() * torch.exp(a_lse - lse)[..., None] + b.float() * torch.exp(b_lse - lse)[..., None]
    return out.to(a.dtype)


def chunk_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """What cuDNN's plans for `_cudnn_chunk(q, k, v)` are keyed by: q's shape (made contiguous there),
    k's and v's shapes and strides (the prefix part reads them in place), dtype and device."""
    return (tuple(q.shape), tuple(k.shape), k.stride(), v.stride(), q.dtype, q.device)


def planned_here() -> frozenset:
    """The chunk keys planned on the calling thread."""
    return getattr(_PLANNED, "keys", frozenset())


def plan_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Run `_cudnn_chunk` once on these shapes and layouts (cuDNN builds its plans now, on this thread)
    and let this thread's `_causal_flash` send chunks with the same key there. RuntimeError where
    cuDNN attention does not run them (nothing is planned then)."""
    _cudnn_chunk(q, k, v, q.shape[-1] ** -0.5)
    _PLANNED.keys = planned_here() | {chunk_key(q, k, v)}


def forget_plans() -> None:
    """Forget this thread's planned chunk keys (they take flash attention again)."""
    _PLANNED.keys = frozenset()


def chunk_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """Which attention `_causal_flash(q, k, v)` takes on this thread: "sdpa" (one query, off CUDA /
    16 bits, or the batch-invariant mode), "cudnn" (the two-part path: its key planned on this
    thread), else "flash"."""
    if q.shape[2] == 1 or not fast_attention(q.device, q.dtype) or determinism.in_scope():
        return "sdpa"
    return "cudnn" if chunk_key(q, k, v) in planned_here() else "flash"


def _causal_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  path: str | None = None) -> torch.Tensor:
    """`_causal_sdpa` for long prompts' chunks (`path`: `chunk_path(q, k, v)`, when the caller has it):
    planned chunk shapes through `_cudnn_chunk`; others on CUDA in bf16 / fp16 flash attention with
    the causal mask aligned to the last key (`causal_lower_right`) and the grouped key heads read in
    place (`enable_gqa`), so no mask is built -- `_sdpa`'s grouped-query regrouping would make it
    [Hq / Hkv * S, L], 268 MB a layer for a 4,096-token chunk -- and no key head is copied;
    elsewhere `_causal_sdpa` itself. On the H200 a 4,096-token chunk at the end of 32,768 positions
    takes 6.0 ms a layer this way, 6.6 ms with repeated heads through cuDNN (bench/RESULTS.md)."""
    path = path or chunk_path(q, k, v)
    if path == "sdpa":
        return _causal_sdpa(q, k, v, scale)
    if path == "cudnn":
        return _cudnn_chunk(q, k, v, scale)
    s, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    flash_first, causal_lower_right = _fused()
    with flash_first():
        if s == total:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(s, total), scale=scale,
                                              enable_gqa=gqa)


@dataclass
class SlotStep:
    """Where one engine step's tokens go: sequence b writes S tokens at positions
    start[b] .. start[b] + S - 1 of cache slot slots[b] and attends to everything before."""

    slots: torch.Tensor   # [B] int64
    start: torch.Tensor   # [B] int64
    new_tokens: int       # S
    kv_len: int           # max(start) + S: the attended prefix length
    mask: torch.Tensor    # [B, 1, S, kv_len] bool, True = attend

    @classmethod
    def build(cls, slots: list[int], start: list[int], new_tokens: int, device: torch.device) -> "SlotStep":
        kv_len = max(start) + new_tokens
        st = torch.tensor(start, dtype=torch.long, device=device)
        q_pos = st[:, None] + torch.arange(new_tokens, device=device)[None, :]          # [B, S]
        k_pos = torch.arange(kv_len, device=device)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]).unsqueeze(1)                # [B, 1, S, L]
        return cls(torch.tensor(slots, dtype=torch.long, device=device), st, new_tokens, kv_len, mask)


class SlotKVCache:
    """Per-layer K/V tensors [slots, Hkv, max_len, D]; `bind(step)` returns the view layers use.
    Row `scratch` (= num_slots, one past the slots sequences get) takes the writes of a CUDA-graph
    batch's padding rows; nothing reads it."""

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.scratch = num_slots
        shape = (num_slots + 1, num_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len = num_slots, max_len
        self.used = 0                      # slots 0 .. used-1 are taken: running sequences stay compact
        self.owners: list[object | None] = [None] * num_slots

    @property
    def free_slots(self) -> int:
        return self.num_slots - self.used

    def allocate(self, owner: object) -> int:
        if self.used >= self.num_slots:
            raise RuntimeError("no free KV slot")
        slot = self.used
        self.owners[slot] = owner
        self.used += 1
        return slot

    def release(self, slot: int) -> object | None:
        """Free `slot`, moving the highest taken slot into it so that 0 .. used-1 stay taken.
        Returns the owner whose slot changed (now `slot`), or None."""
        last = self.used - 1
        self.used -= 1
        moved = None
        if slot != last:
            for kc, vc in zip(self.k, self.v):
                kc[slot].copy_(kc[last])
                vc[slot].copy_(vc[last])
            moved = self.owners[last]
            self.owners[slot] = moved
        self.owners[last] = None
        return moved

    def scrub(self, slot: int) -> None:
        """Zero `slot`'s keys and values (before releasing a sequence whose numbers went non-finite):
        attention reads a slot's stale positions under a False mask, and 0 * NaN is NaN, so a NaN
        left behind would reach the slot's next owner."""
        for kc, vc in zip(self.k, self.v):
            kc[slot].zero_()
            vc[slot].zero_()

    def decode_view(self, n: int, kv_len: int, start: torch.Tensor) -> "_DenseDecode":
        """One new token for each of the sequences in slots 0 .. n-1; start [n] = their positions.
        Shapes depend only on (n, kv_len): the view can be captured in a CUDA graph."""
        return _DenseDecode(self, n, kv_len, start)

    def prefill_view(self, slots: torch.Tensor, new_tokens: int) -> "_DensePrefill":
        """Whole prompts from position 0: sequence b's S tokens go to positions 0 .. S-1 of slot
        slots[b] ([B] int64 tensor) and attend causally among themselves. Shapes depend only on
        (B, S): the view can be captured in a CUDA graph. In a right-padded batch the padding writes
        past a prompt's end; decode overwrites each such entry before its mask reaches it."""
        return _DensePrefill(self, slots, new_tokens)

    def bind(self, step: SlotStep) -> "_BoundSlotCache":
        return _BoundSlotCache(self, step)


class _BoundSlotCache:
    def __init__(self, cache: SlotKVCache, step: SlotStep) -> None:
        self.cache, self.step = cache, step

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        st = self.step
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        if st.new_tokens == 1:
            kc[st.slots, :, st.start] = k[:, :, 0]
            vc[st.slots, :, st.start] = v[:, :, 0]
        else:
            for b, (slot, start) in enumerate(zip(st.slots.tolist(), st.start.tolist())):
                kc[slot, :, start:start + st.new_tokens] = k[b]
                vc[slot, :, start:start + st.new_tokens] = v[b]
        if st.slots.numel() == 1:
            slot = int(st.slots[0])
            keys, values = kc[slot:slot + 1, :, :st.kv_len], vc[slot:slot + 1, :, :st.kv_len]
        else:
            keys, values = kc[st.slots, :, :st.kv_len], vc[st.slots, :, :st.kv_len]
        return _sdpa(q, keys, values, st.mask, scale)


class _DensePrefill:
    def __init__(self, cache: SlotKVCache, slots: torch.Tensor, s: int) -> None:
        self.cache, self.slots = cache, slots[:, None]
        self.pos = torch.arange(s, device=slots.device)
        causal = self.pos[None, :] <= self.pos[:, None]                                   # [S, S]
        self.mask = causal[None, None].expand(slots.shape[0], 1, s, s)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        # advanced indices around a slice: the indexed view is [B, S, Hkv, D]
        self.cache.k[layer][self.slots, :, self.pos] = k.transpose(1, 2)
        self.cache.v[layer][self.slots, :, self.pos] = v.transpose(1, 2)
        return _sdpa(q, k, v, self.mask, scale)


class _DenseDecode:
    def __init__(self, cache: SlotKVCache, n: int, kv_len: int, start: torch.Tensor) -> None:
        self.cache, self.n, self.kv_len, self.start = cache, n, kv_len, start
        self.rows = torch.arange(n, device=start.device)
        k_pos = torch.arange(kv_len, device=start.device)
        self.mask = (k_pos[None, :] <= start[:, None])[:, None, None, :]               # [n, 1, 1, L]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kc, vc = self.cache.k[layer], self.cache.v[layer]
        kc[self.rows, :, self.start] = k[:, :, 0]
        vc[self.rows, :, self.start] = v[:, :, 0]
        return _sdpa(q, kc[: self.n, :, : self.kv_len], vc[: self.n, :, : self.kv_len], self.mask, scale)


class GrowingCache:
    """Appends every call's keys; new queries attend causally to all earlier keys."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if layer in self.k:
            k = torch.cat((self.k[layer], k), dim=2)
            v = torch.cat((self.v[layer], v), dim=2)
        self.k[layer], self.v[layer] = k, v
        return _causal_sdpa(q, k, v, scale)


class ShortCache:
    """Keys/values of B sequences of at most `max_len` positions that advance together: each call
    appends S positions to every sequence (one `past` for all) and attends causally. Preallocated,
    with static shapes. Its position count is Python state: inside a CUDA graph, create it inside the
    captured function (as `CodePredictor.predict` does), so capture and every replay see the same
    sequence of `past` values; never keep one across replays. Besides `attend` it has
    `attend_tokens`, which takes q/k/v token-major ([B, S, heads, D]) and returns [B, S, Hq * D]
    through the fused append + attention kernel (`voxpipe.kernels.attention`)."""

    def __init__(self, num_layers: int, batch: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = [0] * num_layers

    def _advance(self, layer: int, s: int) -> int:
        past = self.length[layer]
        if past + s > self.k.shape[3]:
            raise ValueError(f"ShortCache holds {self.k.shape[3]} positions; {past} + {s} asked")
        self.length[layer] = past + s
        return past

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        s = q.shape[2]
        past = self._advance(layer, s)
        total = past + s
        kc, vc = self.k[layer], self.v[layer]
        kc[:, :, past:total] = k
        vc[:, :, past:total] = v
        return _causal_sdpa(q, kc[:, :, :total], vc[:, :, :total], scale)

    def attend_tokens(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      scale: float) -> torch.Tensor:
        past = self._advance(layer, q.shape[1])
        return kernels.attention.run(q, k, v, self.k[layer], self.v[layer], past, scale)


class SlidingWindowCache:
    """Per slot, the keys/values of the last `window` positions in a ring (index = pos % window).

    A query at position p attends keys at positions p - window < pos <= p. A step appends S
    frames to each of B slots (all at their own positions)."""

    def __init__(self, num_layers: int, num_slots: int, window: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_slots, num_kv_heads, window, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pos = torch.full((num_slots, window), -1, dtype=torch.long, device=device)  # -1: empty
        self.window = window
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free code2wav slot")
        slot = self._free.pop()
        self.pos[slot] = -1
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._free:
            self._free.append(slot)

    def bind(self, slots: torch.Tensor, start: torch.Tensor, new_tokens: int) -> "_BoundWindowCache":
        """`slots` [B] and `start` [B] (int64 tensors on the cache's device)."""
        return _BoundWindowCache(self, slots, start, new_tokens)


class _BoundWindowCache:
    def __init__(self, cache: SlidingWindowCache, slots: torch.Tensor, start: torch.Tensor, s: int) -> None:
        dev = cache.pos.device
        self.cache, self.s = cache, s
        self.slots = slots
        self.new_pos = start[:, None] + torch.arange(s, device=dev)[None, :]               # [B, S]
        old_pos = cache.pos[self.slots]                                                   # [B, W]
        key_pos = torch.cat((old_pos, self.new_pos), dim=1)                               # [B, W + S]
        q = self.new_pos[:, :, None]
        kp = key_pos[:, None, :]
        self.mask = ((kp >= 0) & (kp <= q) & (kp > q - cache.window)).unsqueeze(1)       # [B, 1, S, W + S]
        self.ring_idx = self.new_pos % cache.window                                       # [B, S]
        self._committed = False

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        c = self.cache
        keys = torch.cat((c.k[layer][self.slots], k), dim=2)
        values = torch.cat((c.v[layer][self.slots], v), dim=2)
        out = _sdpa(q, keys, values, self.mask, scale)
        # keep only the last `window` new entries (earlier ones would be overwritten anyway)
        keep = slice(max(0, self.s - c.window), self.s)
        rows = self.slots[:, None].expand(-1, self.s)[:, keep]
        ring = self.ring_idx[:, keep]
        c.k[layer][rows, :, ring] = k[:, :, keep].transpose(1, 2)
        c.v[layer][rows, :, ring] = v[:, :, keep].transpose(1, 2)
        if not self._committed and layer == len(c.k) - 1:
            c.pos[rows, ring] = self.new_pos[:, keep]
            self._committed = True
        return out
