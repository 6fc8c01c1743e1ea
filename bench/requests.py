"""What each client sends for one workload request: a SpeechRequest (the gRPC pipeline client, the
in-process engines), a ChatRequest (the gateway's OpenAI chat completions) or a RealtimeRequest (the
gateway's realtime WebSocket). A RequestMaker renders them for one workload."""

from __future__ import annotations

import base64
import random
import string
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from voxpipe.client import SpeechRequest
from voxpipe.services.runtime.config import OmniConfig
from voxpipe.services.thinker.prompt import FeatureExtractor, RenderedPrompt, render, user_turn

from .voice_clip import VoiceClip, rotated
from .workload import SYSTEM_TEXT, Workload

REALTIME_RATE = 24000        # the realtime API's pcm16


@dataclass(frozen=True)
class ChatRequest:
    """One request as an OpenAI chat completion with audio (`messages` is the API's JSON)."""

    index: int
    messages: list
    voice: str
    max_tokens: int
    max_audio_frames: int
    temperature: float = 0.0      # > 0: sampled, seeded with the index


@dataclass(frozen=True)
class RealtimeRequest:
    """One response of a realtime session: session.update (instructions = the system turn, forced
    lengths), the user turn, response.create."""

    index: int
    instructions: str
    text: str | None              # the user turn as an input_text item, or
    audio_pcm16: bytes            # the user turn as 24 kHz pcm16, appended to the input buffer and committed
    voice: str
    max_tokens: int
    max_audio_frames: int
    temperature: float = 0.0      # the session's (realtime sessions take no seed)


class RequestMaker:
    """The requests of one workload; text prompts differ per request index, the voice prompt is the
    same clip every time."""

    def __init__(self, wl: Workload, cfg: OmniConfig, tokenizer, clip: VoiceClip | None = None,
                 features: FeatureExtractor | None = None) -> None:
        if wl.voice and (clip is None or features is None):
            raise ValueError(f"workload {wl.name} needs a voice clip and a feature extractor")
        self.wl, self.cfg, self.tokenizer, self.clip, self.features = wl, cfg, tokenizer, clip, features
        self.user_text = lru_cache(maxsize=None)(self._user_text)

    # ------------------------------------------------------------------------- per client

    def turn_audio(self, session: int, turn: int) -> torch.Tensor:
        """A voice conversation's user turn (bench/conversation.py): the clip rotated by an offset of
        this session and turn, so that every turn is new audio, as its log-mel features [mel, frames]."""
        return self.features(rotated(self.clip.samples, session, turn))

    def speech(self, index: int) -> SpeechRequest:
        wl = self.wl
        if wl.voice:
            prompt = self.voice_prompt()
            ids, feats = prompt.token_ids, prompt.audio_features
        else:
            ids, feats = wl.prompt(self.cfg, index), []
        return SpeechRequest(token_ids=ids, audio_features=feats, speaker=wl.speaker, max_tokens=wl.text_tokens,
                             min_tokens=wl.text_tokens, max_frames=wl.frames + 1, min_frames=wl.frames + 1,
                             temperature=wl.temperature, seed=index if wl.temperature else None,
                             request_id=f"bench-{index}")

    def chat(self, index: int) -> ChatRequest:
        """Output forced with `ignore_eos` (greedy unless the workload samples); the gateway renders the same prompt as `speech`
        (voice) or one of exactly `prompt_tokens` ids (text)."""
        if self.wl.voice:
            audio = {"data": base64.b64encode(self.clip.wav).decode("ascii"), "format": "wav"}
            user: str | list = [{"type": "input_audio", "input_audio": audio}]
            if self.wl.voice_text:
                user.append({"type": "text", "text": self.wl.voice_text})
        else:
            user = self.user_text(index)
        return ChatRequest(index=index, messages=[{"role": "system", "content": SYSTEM_TEXT},
                                                  {"role": "user", "content": user}],
                           voice=self.wl.speaker, max_tokens=self.wl.text_tokens, max_audio_frames=self.wl.frames + 1,
                           temperature=self.wl.temperature)

    def realtime(self, index: int) -> RealtimeRequest:
        pcm = b""
        text = None
        if self.wl.voice:
            pcm = (np.clip(self.clip.at_rate(REALTIME_RATE), -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes()
        else:
            text = self.user_text(index)
        return RealtimeRequest(index=index, instructions=SYSTEM_TEXT, text=text, audio_pcm16=pcm, voice=self.wl.speaker,
                               max_tokens=self.wl.text_tokens, max_audio_frames=self.wl.frames + 1,
                               temperature=self.wl.temperature)

    # ------------------------------------------------------------------------- prompts

    def voice_prompt(self) -> RenderedPrompt:
        """System turn + user turn [the clip's features, the workload's voice text], as the gateway
        renders it."""
        if not hasattr(self, "_voice_prompt"):
            self._voice_prompt = render(self.tokenizer, self.cfg.thinker,
                                        user_turn(self.wl.voice_text or None, [self.features(self.clip.samples)],
                                                  instructions=SYSTEM_TEXT))
        return self._voice_prompt

    def _chat_length(self, user: str) -> int:
        return len(render(self.tokenizer, self.cfg.thinker, user_turn(user, instructions=SYSTEM_TEXT)).token_ids)

    def _user_text(self, index: int) -> str:
        """Random lowercase words whose chat prompt (system + user turn, rendered as the gateway does)
        has exactly `prompt_tokens` ids."""
        length, target = self._chat_length, self.wl.prompt_tokens
        if length("x") > target:
            raise ValueError(f"the chat template alone takes more than {target} tokens")
        rng = random.Random(self.wl.seed * 100003 + index)
        words: list[str] = []
        while length(" ".join(words)) < target:       # enough words, a growing batch at a time
            missing = target - length(" ".join(words))
            words += ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
                      for _ in range(max(1, missing // 3))]
        lo, hi = 0, len(words)                         # the most words that still fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if length(" ".join(words[:mid])) <= target else (lo, mid - 1)
        user = " ".join(words[:lo]) or "x"
        # then one character at a time, preferring one that lands exactly
        for _ in range(4 * target):
            if length(user) >= target:
                break
            user += next((ch for ch in string.ascii_lowercase if length(user + ch) == target), "a")
        if length(user) != target:
            raise RuntimeError(f"could not build a {target}-token chat prompt (got {length(user)})")
        return user
