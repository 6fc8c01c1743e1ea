"""What a talker prompt's user rows ARE, for the talker's prefix cache: a text row is the thinker's
input embedding of its token id (the id says it all); a multimodal row is the thinker's hidden layer
`accept_hidden_layer` at its prompt position, a function of the thinker's prompt up to there -- its
token ids and the content of every clip in it. The thinker names each run of multimodal user rows
by a hash of exactly that (`audio_run_keys`, TalkerPrompt.audio_keys), so that the talker hashes
its blocks by content (token ids, run keys), never by request or conversation names."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

from .block_pool import ContentSpan

KEY_BYTES = 16      # blake2b digest size of a run key


def mm_runs(mask) -> list[tuple[int, int]]:
    """The maximal runs (start, end) of True in `mask` (a talker prompt's user_mm_mask: a sequence of
    bools, a bool array or a host tensor), in order; found in numpy (a 20k-row mask: a Python loop
    took ~4 ms)."""
    m = np.asarray(mask, dtype=bool).reshape(-1)
    if not m.any():
        return []
    edges = np.diff(m.view(np.int8), prepend=np.int8(0), append=np.int8(0))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))


def audio_run_keys(ids: Sequence[int], user_positions: Sequence[int], mask: Sequence[bool],
                   spans: Sequence[ContentSpan]) -> list[bytes]:
    """One key per run of multimodal user rows (`mm_runs(mask)`): the hash of the thinker prompt's
    token ids up to the run's last position (inclusive) and of every clip span that starts before
    that end (its positions and content digest). `user_positions[i]`: the prompt position of user row
    i. Rows of a run are hidden states of positions up to its end, so equal keys mean equal rows."""
    arr = np.asarray(ids, dtype=np.int64)
    running = hashlib.blake2b(digest_size=KEY_BYTES)
    done, keys = 0, []
    for _, end_row in mm_runs(mask):
        end = int(user_positions[end_row - 1]) + 1          # exclusive, in prompt positions
        running.update(arr[done:end].tobytes())
        done = end
        h = hashlib.blake2b(struct.pack("<q", end), digest_size=KEY_BYTES)
        h.update(running.copy().digest())
        for sp in spans:
            if sp.start < end:
                h.update(struct.pack("<qq", sp.start, sp.end))
                h.update(sp.digest)
        keys.append(h.digest())
    return keys


def user_row_spans(mask: Sequence[bool], keys: Sequence[bytes]) -> tuple[ContentSpan, ...]:
    """The content spans of a talker prompt's user rows for `block_pool.prefix_hashes` (over the user
    token ids): each multimodal run with its key."""
    return tuple(ContentSpan(s, e, k) for (s, e), k in zip(mm_runs(mask), keys))
