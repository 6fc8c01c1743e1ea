"""Prompt rendering, the one place where a thinker prompt is made: the prompt shapes (`user_turn`:
an optional system turn of instructions, then one user turn of audio and text; `speech_turn`: the
text-to-speech prompt; `with_instructions`), chat messages -> token ids with audio placeholders
expanded (`render`, the checkpoint's chat template), audio waveforms -> the audio encoder's log-mel
features (`FeatureExtractor`, `with_features`), and the tokenizer (`load_tokenizer`). Used by the
thinker service (text prompts), the gateway (each API turns its own messages into ChatMessages,
then renders here), `voxpipe say` and the bench."""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from ..runtime.config import OmniConfig, ThinkerConfig
from ..runtime.logs import adopt_transformers_logging
from .model import audio_output_length
from .tool_template import apply_template, check_template_renders_tools, check_tool_text, template_conversation

# the audio encoder's front end (STAGES.md); the mel bins come from config.json
FEATURE_SAMPLE_RATE = 16000
FEATURE_HOP_LENGTH = 160
FEATURE_N_FFT = 400
PREPROCESSOR_CONFIG = "preprocessor_config.json"


@dataclass
class ChatPart:
    """One piece of a message: text, or an audio clip (16 kHz mono float32 or its features)."""

    text: str | None = None
    audio: np.ndarray | None = None
    features: torch.Tensor | None = None     # [num_mel_bins, frames]


@dataclass(frozen=True)
class ToolCall:
    """A function call in an assistant turn: `arguments` is JSON text as the model wrote it."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tool:
    """A function the model may call: `parameters` is its JSON schema (None: no parameters given)."""

    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def template_entry(self) -> dict:
        """The entry of the chat template's `tools=` list, in OpenAI's shape (the template renders it
        as one JSON line); only the fields given are present."""
        function: dict = {"name": self.name}
        for key in ("description", "parameters", "strict"):
            if getattr(self, key) is not None:
                function[key] = getattr(self, key)
        return {"type": "function", "function": function}


@dataclass
class ChatMessage:
    """role: system / user / assistant / tool. An assistant turn may carry `tool_calls`; a tool
    turn (a function's result, its text in `parts`) names the call it answers in `tool_call_id`."""

    role: str
    parts: list[ChatPart] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_id: str | None = None

    @classmethod
    def text(cls, role: str, text: str) -> "ChatMessage":
        return cls(role, [ChatPart(text=text)])


AudioInput = np.ndarray | torch.Tensor    # a 16 kHz mono float32 waveform, or its features [num_mel_bins, frames]


def audio_part(audio: AudioInput) -> ChatPart:
    """The part of a waveform (np.ndarray) or of its features (torch.Tensor)."""
    return ChatPart(features=audio) if isinstance(audio, torch.Tensor) else ChatPart(audio=audio)


def with_instructions(instructions: str | None, messages: list[ChatMessage]) -> list[ChatMessage]:
    """`messages` after a system turn of `instructions`; without one when they are None or ""."""
    return ([ChatMessage.text("system", instructions)] if instructions else []) + messages


def user_turn(text: str | None = None, audio: Sequence[AudioInput] = (),
              instructions: str | None = None) -> list[ChatMessage]:
    """One user turn -- its audio parts in order, then the text (no text part when `text` is None;
    "" is a part) -- after a system turn of `instructions` when given (see `with_instructions`)."""
    parts = [audio_part(a) for a in audio] + ([ChatPart(text=text)] if text is not None else [])
    return with_instructions(instructions, [ChatMessage("user", parts)])


def speech_turn(text: str, instructions: str | None = None) -> list[ChatMessage]:
    """The prompt of a spoken `text` (POST /v1/audio/speech): one user turn, the instructions (if
    any), a blank line, the text."""
    return user_turn(f"{instructions}\n\n{text}" if instructions else text)


@dataclass
class RenderedPrompt:
    token_ids: list[int]
    audio_features: list[torch.Tensor]       # in prompt order


class FeatureConfigError(ValueError):
    """A checkpoint's preprocessor_config.json disagrees with its config.json or with the audio front
    end the encoder is built for."""


class FeatureExtractor:
    """WhisperFeatureExtractor features with only the valid frames kept: [num_mel_bins, frames].

    The front end is fixed by the audio encoder (16 kHz, hop 160, window 400, STAGES.md); only the
    number of mel bins varies, and it comes from the model's config.json
    (thinker_config.audio_config.num_mel_bins). Build it with `for_model`."""

    def __init__(self, num_mel_bins: int, preprocessor_dir: str | Path | None = None) -> None:
        """`preprocessor_dir`: a folder whose preprocessor_config.json is loaded and checked against
        `num_mel_bins` and the fixed front end (FeatureConfigError when they disagree); None: built
        from `num_mel_bins` alone."""
        from transformers import WhisperFeatureExtractor

        adopt_transformers_logging()
        self.num_mel_bins = num_mel_bins
        if preprocessor_dir is None:
            self.fe = WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=FEATURE_SAMPLE_RATE,
                                              hop_length=FEATURE_HOP_LENGTH, n_fft=FEATURE_N_FFT, chunk_length=30,
                                              padding_value=0.0, return_attention_mask=True)
            return
        self.fe = WhisperFeatureExtractor.from_pretrained(str(preprocessor_dir))
        path = Path(preprocessor_dir) / PREPROCESSOR_CONFIG
        expected = {"feature_size": (num_mel_bins, "config.json's thinker_config.audio_config.num_mel_bins"),
                    "sampling_rate": (FEATURE_SAMPLE_RATE, "the audio encoder's input rate"),
                    "hop_length": (FEATURE_HOP_LENGTH, "the audio encoder's hop"),
                    "n_fft": (FEATURE_N_FFT, "the audio encoder's window")}
        wrong = [f"{key} {getattr(self.fe, key)} (expected {want}: {why})" for key, (want, why) in expected.items()
                 if getattr(self.fe, key) != want]
        if wrong:
            raise FeatureConfigError(f"{path} disagrees with the model: " + "; ".join(wrong) +
                                     ". Fix or remove it (without it the features are built from config.json)")

    @classmethod
    def for_model(cls, model: str | Path, cfg: ThinkerConfig | None = None) -> "FeatureExtractor":
        """`model`: a checkpoint folder or a bare config .json file (dummy weights). A folder with a
        preprocessor_config.json is loaded from it (and must agree with the config); otherwise the
        features are built from the config's mel bins."""
        path = Path(model)
        cfg = cfg or OmniConfig.load(path).thinker
        folder = path if path.is_dir() and (path / PREPROCESSOR_CONFIG).is_file() else None
        return cls(cfg.audio.num_mel_bins, folder)

    def __call__(self, wav_16k: np.ndarray) -> torch.Tensor:
        if wav_16k.ndim != 1 or wav_16k.size == 0:
            raise ValueError("audio must be a non-empty mono waveform")
        shortest = self.fe.n_fft // 2 + 1      # the STFT's reflect padding needs more samples than its pad
        if wav_16k.size < shortest:
            raise ValueError(f"audio of {wav_16k.size} samples at 16 kHz is too short; at least {shortest} are needed")
        # as Qwen3-Omni's processor: no padding to 30 s, no truncation
        out = self.fe(wav_16k.astype(np.float32), sampling_rate=FEATURE_SAMPLE_RATE, return_attention_mask=True,
                      padding=True, truncation=False, return_tensors="pt")
        valid = int(out["attention_mask"][0].sum())
        return out["input_features"][0, :, :valid].float()


def with_features(messages: list[ChatMessage], features: "FeatureExtractor") -> list[ChatMessage]:
    """`messages` with every waveform part replaced by a part of its features (`features(audio)`),
    so that a later `render` needs no FeatureExtractor; the other parts are kept."""
    return [replace(m, parts=[p if p.audio is None else ChatPart(features=features(p.audio)) for p in m.parts])
            for m in messages]


def load_tokenizer(model: str | Path, cfg: OmniConfig | None = None):
    """The checkpoint's tokenizer, or the ChatML byte tokenizer for a bare config (dummy weights)."""
    from .tokenizer import load_tokenizer as load

    cfg = cfg or OmniConfig.load(model)
    return load(model, cfg.thinker, cfg.role_ids)


_SENTINEL = re.compile("\ue000([0-9]+)\ue001")


def _sentinel(k: int) -> str:
    return f"\ue000{k}\ue001"


def encode_text(tokenizer, text: str) -> list[int]:
    """Message text as tokens: special-token strings ("<|im_end|>") stay ordinary text. An assistant
    reply given verbatim (ThinkerStart.assistant_text) is these tokens, then <|im_end|>."""
    return tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)


SEGMENT_CACHE_CHARS = 4 << 20     # characters of rendered segments whose token ids are kept, per tokenizer


class SegmentTokens:
    """The token ids of a rendered conversation's segments (the template's markup between two message
    texts, tokenized with its special tokens; a message's text, with them split into ordinary text)
    by their exact text, for one tokenizer: a conversation's next turn re-renders every earlier
    message, whose segments tokenize as before (tokenization is a function of the segment's text
    alone: each segment is tokenized on its own, cached or not). Bounded by `max_chars` characters
    of keys, least recently used dropped first; thread-safe."""

    def __init__(self, max_chars: int = SEGMENT_CACHE_CHARS) -> None:
        self.max_chars = max_chars
        self.entries: OrderedDict[tuple[bool, str], tuple[int, ...]] = OrderedDict()
        self.chars = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    def encode(self, tokenizer, text: str, message_text: bool) -> tuple[int, ...]:
        key = (message_text, text)
        with self._lock:
            got = self.entries.get(key)
            if got is not None:
                self.entries.move_to_end(key)
                self.hits += 1
                return got
        ids = tuple(encode_text(tokenizer, text) if message_text else tokenizer.encode(text, add_special_tokens=False))
        with self._lock:
            self.misses += 1
            if len(text) <= self.max_chars and key not in self.entries:
                self.entries[key] = ids
                self.chars += len(text)
                while self.chars > self.max_chars:
                    (_, old), _ = self.entries.popitem(last=False)
                    self.chars -= len(old)
        return ids


_SEGMENTS: "weakref.WeakKeyDictionary[object, SegmentTokens]" = weakref.WeakKeyDictionary()
_SEGMENTS_LOCK = threading.Lock()


def segment_tokens(tokenizer) -> SegmentTokens | None:
    """The tokenizer's SegmentTokens (made on first use; None for a tokenizer that takes no weak
    reference: its segments are tokenized each time)."""
    with _SEGMENTS_LOCK:
        try:
            cache = _SEGMENTS.get(tokenizer)
            if cache is None:
                cache = _SEGMENTS[tokenizer] = SegmentTokens()
        except TypeError:
            return None
        return cache


def _encode_template(tokenizer, conv: list[dict], texts: list[str], add_generation_prompt: bool,
                     tools: list[dict] | None = None, segments: SegmentTokens | bool = True) -> list[int]:
    """The chat template's own markup is tokenized with its special tokens; message text is
    tokenized with special-token strings split into ordinary text, so a user who types
    "<|im_start|>system" gets those characters, not a new turn. (Tool definitions and call
    arguments are rendered by the template as JSON; check_tool_text keeps control tokens out.)
    Each segment's ids come from `segments` when it saw that text before (True: the tokenizer's
    SegmentTokens; False: none)."""
    rendered = apply_template(tokenizer, conv, add_generation_prompt, tools)
    cache = segment_tokens(tokenizer) if segments is True else segments or None
    if cache is None:
        def encode(text: str, message_text: bool):
            return encode_text(tokenizer, text) if message_text else tokenizer.encode(text, add_special_tokens=False)
    else:
        def encode(text: str, message_text: bool):
            return cache.encode(tokenizer, text, message_text)
    ids: list[int] = []
    pos = 0
    for m in _SENTINEL.finditer(rendered):
        ids += encode(rendered[pos:m.start()], False)
        ids += encode(texts[int(m.group(1))], True)
        pos = m.end()
    ids += encode(rendered[pos:], False)
    return ids


def render(tokenizer, cfg: ThinkerConfig, messages: list[ChatMessage], features: FeatureExtractor | None = None,
           add_generation_prompt: bool = True, tools: Sequence[Tool] = (),
           segments: SegmentTokens | bool = True) -> RenderedPrompt:
    """Apply the checkpoint's chat template (with `tools=` when `tools` are given); every audio part
    becomes <|audio_start|> + N pads + <|audio_end|> with N = the audio encoder's output length for
    that clip. ValueError for what cannot be rendered (TemplateToolError, naming the request
    parameter, for tools the template drops or tool text holding control tokens). `segments`: where
    the ids of segments tokenized before come from (SegmentTokens; True: the tokenizer's, False:
    tokenize every segment)."""
    conv, feats, user_texts = [], [], []
    for m in messages:
        content = []
        for p in m.parts:
            if p.text == "":
                content.append({"type": "text", "text": ""})     # empty: falsy in the template, as it is
            elif p.text is not None:
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
    tool_entries = [t.template_entry() for t in tools] or None
    specials = special_token_strings(tokenizer)
    conv = template_conversation(messages, conv, specials)
    for i, t in enumerate(tool_entries or ()):
        check_tool_text(json.dumps(t, ensure_ascii=False), specials, f"tools[{i}]", "tools")
    check_template_renders_tools(tokenizer, conv, tool_entries)
    ids = _encode_template(tokenizer, conv, user_texts, add_generation_prompt, tool_entries, segments)
    pad = cfg.tokens.audio_token
    if ids.count(pad) != len(feats):
        raise ValueError(f"the chat template rendered {ids.count(pad)} audio placeholders for {len(feats)} audio parts")
    if not feats:
        return RenderedPrompt(ids, feats)
    out, k = [], 0
    for t in ids:
        if t == pad:
            out.extend([pad] * audio_output_length(feats[k].shape[1], cfg.audio.n_window))
            k += 1
        else:
            out.append(t)
    return RenderedPrompt(out, feats)


def special_token_strings(tokenizer) -> frozenset[str]:
    """The control tokens' strings of a transformers tokenizer or of the ChatML byte tokenizer."""
    special = getattr(tokenizer, "special", None)
    if isinstance(special, dict):
        return frozenset(special)
    return frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)
