"""Prompt rendering: chat messages -> token ids with audio placeholders expanded, and audio
waveforms -> the audio encoder's log-mel features. Used by the thinker service (text prompts)
and by clients (the pipeline client, the gateway)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np
import torch

from ..runtime.config import ThinkerConfig
from .model import audio_output_length

FEATURE_SAMPLE_RATE = 16000


@dataclass
class ChatPart:
    """One piece of a message: text, or an audio clip (16 kHz mono float32 or its features)."""

    text: str | None = None
    audio: np.ndarray | None = None
    features: torch.Tensor | None = None     # [num_mel_bins, frames]


@dataclass
class ChatMessage:
    role: str
    parts: list[ChatPart] = field(default_factory=list)

    @classmethod
    def text(cls, role: str, text: str) -> "ChatMessage":
        return cls(role, [ChatPart(text=text)])


@dataclass
class RenderedPrompt:
    token_ids: list[int]
    audio_features: list[torch.Tensor]       # in prompt order


class FeatureExtractor:
    """WhisperFeatureExtractor features with only the valid frames kept: [num_mel_bins, frames]."""

    def __init__(self, model_dir: str | None = None, num_mel_bins: int = 128) -> None:
        from transformers import WhisperFeatureExtractor

        try:
            self.fe = WhisperFeatureExtractor.from_pretrained(model_dir) if model_dir else None
        except (OSError, ValueError):
            self.fe = None
        if self.fe is None:
            self.fe = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=FEATURE_SAMPLE_RATE,
                                              hop_length=160, n_fft=400, chunk_length=30, return_attention_mask=True)

    def __call__(self, wav_16k: np.ndarray) -> torch.Tensor:
        if wav_16k.ndim != 1 or wav_16k.size == 0:
            raise ValueError("audio must be a non-empty mono waveform")
        # as Qwen3-Omni's processor: no padding to 30 s, no truncation
        out = self.fe(wav_16k.astype(np.float32), sampling_rate=FEATURE_SAMPLE_RATE, return_attention_mask=True,
                      padding=True, truncation=False, return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :, :valid].float()


_SENTINEL = re.compile("\ue000([0-9]+)\ue001")


def _sentinel(k: int) -> str:
    return f"\ue000{k}\ue001"


def _encode_template(tokenizer, conv: list[dict], texts: list[str], add_generation_prompt: bool) -> list[int]:
    """The chat template's own markup is tokenized with its special tokens; message text is
    tokenized with special-token strings split into ordinary text, so a user who types
    "<|im_start|>system" gets those characters, not a new turn."""
    rendered = tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False)
    ids: list[int] = []
    pos = 0
    for m in _SENTINEL.finditer(rendered):
        ids += tokenizer.encode(rendered[pos:m.start()], add_special_tokens=False)
        ids += tokenizer.encode(texts[int(m.group(1))], add_special_tokens=False, split_special_tokens=True)
        pos = m.end()
    ids += tokenizer.encode(rendered[pos:], add_special_tokens=False)
    return ids


def render(tokenizer, cfg: ThinkerConfig, messages: list[ChatMessage], features: FeatureExtractor | None = None,
           add_generation_prompt: bool = True) -> RenderedPrompt:
    """Apply the checkpoint's chat template; every audio part becomes <|audio_start|> + N pads +
    <|audio_end|> with N = the audio encoder's output length for that clip."""
    conv, feats, user_texts = [], [], []
    for m in messages:
        content = []
        for p in m.parts:
            if p.text is not None:
                user_texts.append(p.text)
                content.append({"type": "text", "text": _sentinel(len(user_texts) - 1)})
            else:
                f = p.features if p.features is not None else features(p.audio)
                feats.append(f)
                content.append({"type": "audio", "audio": ""})
        if all(c["type"] == "text" for c in content):
            conv.append({"role": m.role, "content": "".join(c["text"] for c in content)})
        else:
            conv.append({"role": m.role, "content": content})
    ids = _encode_template(tokenizer, conv, user_texts, add_generation_prompt)
    pad = cfg.tokens.audio_token
    if ids.count(pad) != len(feats):
        raise ValueError(f"the chat template rendered {ids.count(pad)} audio placeholders for {len(feats)} audio parts")
    out, k = [], 0
    for t in ids:
        if t == pad:
            out.extend([pad] * audio_output_length(feats[k].shape[1], cfg.audio.n_window))
            k += 1
        else:
            out.append(t)
    return RenderedPrompt(out, feats)
