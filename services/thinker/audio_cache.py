"""The audio encoder's outputs cached by the content of the clip's log-mel features, so that a
clip a conversation sends again (every turn re-sends its history) is not encoded again.

The key is `clip_key`: SHA-256 of what the encoder receives for the clip -- its features (dtype,
shape, bytes) and the length its chunks are padded to (model.chunk_pad: the prompt's longest chunk)
-- never a name. The encoder runs per clip and is deterministic for a given input, so a hit returns
the bits encoding again would. Entries are the encoder's output in the embedding dtype on
the model's device, [audio_output_length(frames), H]; they never leave this class (`encode`
hands out copies), bounded by bytes, least recently used evicted first."""

from __future__ import annotations

import hashlib
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..runtime import metrics
from ..runtime.lru import BytesLRU
from .model import AudioEncoder, chunk_pad

from ..runtime.flags import DEFAULT_AUDIO_CACHE_MB  # noqa: F401  (--audio-cache-mb)
# hashlib releases the GIL over large buffers: a 40-turn conversation's clips (~12 MB of features)
# are hashed here, beside the event loop and the engine thread, between its start and its prefill
_HASHING = ThreadPoolExecutor(max_workers=4, thread_name_prefix="clip-keys")


def clip_key(features: torch.Tensor, pad_to: int) -> bytes:
    """SHA-256 of one clip's encoder input: the chunk padding, the features' dtype and shape, then
    their bytes in C order (a host tensor)."""
    t = features.detach().contiguous()
    h = hashlib.sha256(f"{pad_to}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


class AudioEncoderCache:
    """`encode(clips, keys)`: a prompt's clips' encoder outputs, concatenated [N, H] in `dtype` on
    `device` (a new tensor), looked up by content first; at most `max_bytes` of outputs held (0:
    off, every clip is encoded). Used by the engine thread alone."""

    def __init__(self, tower: AudioEncoder, max_bytes: int, dtype: torch.dtype, device: torch.device,
                 stage: str = "thinker", keyed: bool = False) -> None:
        """`keyed`: compute every clip's key even with the cache off (the prefix cache hashes them)."""
        self.tower, self.dtype, self.device = tower, dtype, device
        self.keyed = keyed
        self.n_window = tower.cfg.n_window
        self.lru = BytesLRU(max_bytes)
        self.hits = metrics.AUDIO_CACHE_HITS.labels(stage)
        self.misses = metrics.AUDIO_CACHE_MISSES.labels(stage)
        self.evictions = metrics.AUDIO_CACHE_EVICTIONS.labels(stage)
        self.held = metrics.AUDIO_CACHE_BYTES.labels(stage)

    def pad(self, clips: list[torch.Tensor]) -> int:
        return chunk_pad([f.shape[1] for f in clips], self.n_window)

    def keys(self, clips: list[torch.Tensor], pad_to: int | None = None) -> list[bytes | None]:
        """A prompt's clips' keys, in order (None each when the cache is off and nothing else needs them);
        `pad_to`: the prompt's chunk padding when other clips count too (default: these clips')."""
        pad = self.pad(clips) if pad_to is None else pad_to
        return [clip_key(f, pad) if self.lru.max_bytes or self.keyed else None for f in clips]

    def keys_soon(self, clips: list[torch.Tensor]) -> list[Future] | None:
        """`keys`, each hashed in a worker thread from now on (None when the cache is off or there
        are no clips); the runner waits for them when it embeds the prompt. Thread-safe."""
        if not clips or not (self.lru.max_bytes or self.keyed):
            return None
        pad = self.pad(clips)
        return [_HASHING.submit(clip_key, f, pad) for f in clips]

    def encode(self, clips: list[torch.Tensor], keys: list[bytes | None], pad_to: int | None = None) -> torch.Tensor:
        """A prompt's clips' encoder outputs in order, concatenated: a new tensor [sum n, H]
        (torch.cat copies), so no caller writes into a cached entry. `pad_to` as for `keys`."""
        pad = self.pad(clips) if pad_to is None else pad_to
        return torch.cat([self._one(f, pad, k) for f, k in zip(clips, keys)])

    def forget(self, keys: list[bytes | None]) -> None:
        """Drop these clips' entries (a request that failed on non-finite values: nothing it
        made stays on the device for the next request)."""
        held = self.lru.bytes
        for k in keys:
            if k is not None:
                self.lru.pop(k)
        self.held.dec(held - self.lru.bytes)

    def _one(self, features: torch.Tensor, pad_to: int, key: bytes | None) -> torch.Tensor:
        """One clip's encoder output [n, H]: the cached tensor itself (`encode` copies it)."""
        if not self.lru.max_bytes:
            key = None            # keyed for the prefix cache alone: nothing is kept here
        if key is not None:
            got = self.lru.get(key)
            if got is not None:
                self.hits.inc()
                return got
            self.misses.inc()
        out = self.tower(features.to(self.device, torch.float32), pad_to).to(self.dtype)
        if key is not None:
            held = self.lru.bytes
            self.evictions.inc(self.lru.put(key, out))
            self.held.inc(self.lru.bytes - held)
        return out
