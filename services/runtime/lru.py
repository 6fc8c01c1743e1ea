"""BytesLRU: tensors by key, bounded by their bytes, the least recently used dropped first (the
thinker's audio encoder cache, the gateway's clip features). Not thread-safe: a caller shared by
threads holds its own lock."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class BytesLRU:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: OrderedDict[Hashable, torch.Tensor] = OrderedDict()   # oldest use first
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, key: Hashable) -> torch.Tensor | None:
        """The entry (now the most recently used), or None."""
        got = self.entries.get(key)
        if got is not None:
            self.entries.move_to_end(key)
        return got

    def put(self, key: Hashable, value: torch.Tensor) -> int:
        """Store `value` under `key`, dropping the least recently used entries for room; how many
        were dropped. A value larger than the whole bound, or a key already held, is not stored."""
        size = tensor_bytes(value)
        if size > self.max_bytes or key in self.entries:
            return 0
        dropped = 0
        while self.bytes + size > self.max_bytes:
            self.pop(next(iter(self.entries)))
            dropped += 1
        self.entries[key] = value
        self.bytes += size
        return dropped

    def pop(self, key: Hashable) -> None:
        """Drop the entry if held."""
        value = self.entries.pop(key, None)
        if value is not None:
            self.bytes -= tensor_bytes(value)
