"""Chat completions' `input_audio` clips, decoded, resampled and featurized once per distinct
clip: a conversation re-sends its whole history every turn, and each earlier clip's log-mel
features come from here instead of the decoder.

Keyed by SHA-256 of the clip's format and its bytes as sent (base64-decoded); the value is its
features [num_mel_bins, frames] float32 on the host, which the thinker's own cache then finds by
content. Bounded by the features' bytes (--audio-cache-mb; 0: off), least recently used dropped
first. A clip that fails to decode or featurize is never stored (the ValueError goes to the
caller as before). Shared by the worker threads that parse requests: a lock guards the table;
decoding runs outside it."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable

import numpy as np
import torch

from voxpipe.services.runtime.lru import BytesLRU

from .audio_formats import decode_clip
from .metrics import GatewayMetrics

class ClipCache:
    """`features(raw, fmt)`: the clip's features, decoded and featurized on a miss; a new tensor
    each call (callers may keep or change it)."""

    def __init__(self, max_bytes: int, featurize: Callable[[np.ndarray], torch.Tensor], metrics: GatewayMetrics) -> None:
        self.featurize, self.metrics = featurize, metrics
        self.lru = BytesLRU(max_bytes)
        self.lock = threading.Lock()

    def features(self, raw: bytes, fmt: str) -> torch.Tensor:
        """ValueError (nothing stored) for a clip that does not decode or is too short to featurize."""
        m = self.metrics
        key = hashlib.sha256(fmt.encode() + b"|" + raw).digest() if self.lru.max_bytes else None
        if key is not None:
            with self.lock:
                got = self.lru.get(key)
            if got is not None:
                m.audio_cache_hits.inc()
                return got.clone()
        m.audio_cache_misses.inc()
        feats = self.featurize(decode_clip(raw))
        if key is not None:
            with self.lock:
                m.audio_cache_evictions.inc(self.lru.put(key, feats.clone()))
                m.audio_cache_bytes.set(self.lru.bytes)
        return feats
