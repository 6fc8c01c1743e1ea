"""Warm-up at start, shared by the thinker and talker runners: what their CUDA graphs do not cover
runs once before the server reports ready, so that no request pays a first-sight cost -- Triton
compiling a kernel for a new shape class (an integer argument specialises on being 1, a multiple
of 16 or neither), the caching allocator growing for a step's activations. Every write goes to the
scratch block (null tables); nothing is published or read later."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .block_pool import KVBlockManager
from .paged_kv import PagedKVCache, PagedPackedStep
from .sampling import RowSampling, SamplingParams, exponential_noise, sample_rows


def packed_shapes(long: int) -> tuple[tuple[int, ...], ...]:
    """Segment lengths of the packed steps to warm: long and short segments (past `long`, the
    graphs' longest prompt, and within it), of each class, one after an odd start."""
    return (long + 37, 45), (long + 16, 32), (1,), (17,)


def warm_packed(forward: Callable[[torch.Tensor, torch.Tensor, object, torch.Tensor], object], cache: PagedKVCache,
                blocks: KVBlockManager, hidden: int, dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...]) -> None:
    """`forward(x [1, T, H], positions [1, T], view, last [segments])` once per packed step of
    `shapes` (segment lengths; every other segment starts at position 19, the others at 0)."""
    dev, null = cache.k[0].device, cache.null
    for lengths in shapes:
        parts = [([null] * blocks.blocks_for(19 + n), 19 * (i % 2), n) for i, n in enumerate(lengths)]
        step = PagedPackedStep.pack(parts)
        x = torch.zeros(1, sum(lengths), hidden, dtype=dtype, device=dev)
        forward(x, step.positions(dev), cache.packed(step), step.ends(dev))


def warm_sampling(vocab: int, device: torch.device) -> None:
    """`sample_rows` over 1 and 3 rows (temperature, top-k and top-p rows) with their noise."""
    for n in (1, 3):
        logits = torch.zeros(n, vocab, device=device)
        gens = [torch.Generator(device).manual_seed(i) for i in range(n)]
        params = [SamplingParams(temperature=0.7, top_k=20 * i, top_p=0.8 if i else 1.0) for i in range(n)]
        sample_rows(logits, RowSampling.of(params, vocab, device), exponential_noise(gens, vocab, device))
