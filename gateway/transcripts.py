"""Assistant audio ids -> their transcripts, so a later turn can refer to an earlier spoken reply
by `{"role": "assistant", "audio": {"id": ...}}` (in memory, with expiry, oldest dropped first)."""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StoredAudio:
    transcript: str
    expires_at: int


class TranscriptStore:
    def __init__(self, expiry_s: int, max_entries: int) -> None:
        self.expiry_s, self.max_entries = expiry_s, max_entries
        self._items: OrderedDict[str, StoredAudio] = OrderedDict()

    def new_id(self) -> tuple[str, int]:
        """An id for a reply being made, and when it will expire."""
        return f"audio_{uuid.uuid4().hex}", int(time.time()) + self.expiry_s

    def put(self, audio_id: str, transcript: str, expires_at: int) -> None:
        self._items[audio_id] = StoredAudio(transcript, expires_at)
        self._items.move_to_end(audio_id)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def get(self, audio_id: str) -> str | None:
        item = self._items.get(audio_id)
        if item is None:
            return None
        if item.expires_at < time.time():
            del self._items[audio_id]
            return None
        return item.transcript
