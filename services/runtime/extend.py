"""Prompts that go on from their blocks (a prefix cache hit, a recompute after a preemption, a long
prompt's next chunk), one right-padded row each: the forward both runners' extend graphs capture
(under cuda_graphs.EMULATE a replay runs it eagerly on the graph's padded inputs, as on the CPU).

Row b carries length[b] new rows at positions start[b] .. start[b] + length[b] - 1 of its block
table (`PagedKVCache.extend_view`); its positions past length[b] are padding (their keys go to the
scratch block, their outputs are never read). Graphs: one per (rows bucket, new-rows bucket), the
tables as wide as the context; a padding row has length 0 and the null table. The buckets are
finer than powers of two (`fine_buckets`): a padding query does as much work as a real one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cuda_graphs import GraphedStep, captured, fine_buckets
from .paged_kv import PagedKVCache


def extend_forward(model: Callable[..., tuple[torch.Tensor, ...]], cache: PagedKVCache, s: int, x: torch.Tensor,
                   start: torch.Tensor, length: torch.Tensor, tables: torch.Tensor, kv_bound: int,
                   **kwargs) -> tuple[torch.Tensor, ...]:
    """`model(x [n, s, H], positions [n, s], view, **kwargs)` over the first s columns of x ([n, >= s,
    H]) at positions start[b] ..., into the blocks of tables [n, M] (M * block_size >= kv_bound);
    `kv_bound`: how far any row may reach (static in a graph)."""
    positions = start[:, None] + torch.arange(s, device=x.device)[None]
    return model(x[:, :s], positions, cache.extend_view(tables, start, length, s, kv_bound), **kwargs)


def capture_extend(name: str, fn: Callable[..., tuple[torch.Tensor, ...]], rows: int, new_rows: int, hidden: int,
                   dtype: torch.dtype, cache: PagedKVCache, width: int, eager_fallback: bool) -> GraphedStep | None:
    """`fn(n, s, x [n, s, H], start [n], length [n], last [n], tables [n, width])` captured for up to
    `rows` rows of up to `new_rows` new rows each (cuda_graphs.captured: None with `eager_fallback`
    when capture fails). Padding rows: length 0, last 0, the null table."""
    dev = cache.k[0].device
    index = [torch.zeros(rows, dtype=torch.long, device=dev) for _ in range(3)]
    return captured(name, lambda: GraphedStep(
        fn, (torch.zeros(rows, new_rows, hidden, dtype=dtype, device=dev), *index,
             torch.full((rows, width), cache.null, dtype=torch.long, device=dev)),
        fine_buckets(rows, 1, 2), fine_buckets(new_rows, min(32, new_rows)), name, pad=(None, 0, 0, 0, cache.null)),
        eager_fallback)


@dataclass
class ExtendRows:
    """A step's rows, right-padded: x [n, longest, H], start / length / last [n] on the device."""

    x: torch.Tensor
    start: torch.Tensor
    length: torch.Tensor
    last: torch.Tensor
    longest: int          # the most new rows of a row
    reach: int            # the most positions a row reaches (start + length)

    @classmethod
    def of(cls, parts: list[tuple[torch.Tensor, int]], device: torch.device) -> "ExtendRows":
        """`parts`: per row, its new rows [L, H] (on the device) and its first new position."""
        lengths = [r.shape[0] for r, _ in parts]
        starts = [s for _, s in parts]
        start, length = (torch.tensor(v).to(device, non_blocking=True) for v in (starts, lengths))
        x = torch.nn.utils.rnn.pad_sequence([r for r, _ in parts], batch_first=True)
        return cls(x, start, length, length - 1, max(lengths), max(s + n for s, n in zip(starts, lengths)))

