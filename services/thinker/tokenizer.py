"""Tokenizers for the thinker.

A real checkpoint folder carries its tokenizer files and we load them with transformers. A
bare config (full-size dummy weights for benchmarks) has none; then `ChatMLByteTokenizer`
stands in: the ChatML special tokens carry the config's ids and every other byte of text is
the token with that byte's value. Benchmarks force lengths, so the text content is moot.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from ..runtime.config import ThinkerConfig
from ..runtime.logs import adopt_transformers_logging

log = logging.getLogger(__name__)

# The released Qwen3-Omni template's tool block: the instructions before and after the functions
# (one JSON a line between them).
TOOLS_HEAD = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
TOOLS_TAIL = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
              '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n')


class ChatMLByteTokenizer:
    def __init__(self, cfg: ThinkerConfig, role_ids: dict[str, int]) -> None:
        t = cfg.tokens
        self.special = {"<|im_start|>": t.im_start, "<|im_end|>": t.im_end, "<|audio_start|>": t.audio_start,
                        "<|audio_end|>": t.audio_end, "<|audio_pad|>": t.audio_token, "<|image_pad|>": t.image_token,
                        "<|video_pad|>": t.video_token, "<|tts_pad|>": t.tts_pad, "<|tts_bos|>": t.tts_bos,
                        "<|tts_eos|>": t.tts_eos}
        self.role_ids = role_ids
        self.eos_token_id = t.im_end
        self._by_id = {v: k for k, v in self.special.items()}
        self._split = re.compile("(" + "|".join(re.escape(s) for s in self.special) + ")")

    def encode(self, text: str, add_special_tokens: bool = False, split_special_tokens: bool = False) -> list[int]:
        """Bytes, except special-token strings (unless split) and a role name right after <|im_start|>."""
        if split_special_tokens:
            return list(text.encode("utf-8"))
        ids: list[int] = []
        for piece in self._split.split(text):
            if piece in self.special:
                ids.append(self.special[piece])
            elif piece:
                if ids and ids[-1] == self.special["<|im_start|>"]:
                    role = next((r for r in self.role_ids if piece.startswith(r)), None)
                    if role is not None:
                        ids.append(self.role_ids[role])
                        piece = piece[len(role):]
                ids.extend(piece.encode("utf-8"))
        return ids

    def apply_chat_template(self, conversation, add_generation_prompt: bool = True, tokenize: bool = True,
                            tools=None, **_):
        """ChatML, with tools rendered as the released Qwen3-Omni template renders them (Hermes
        style): a system turn (the first system message's text, a blank line, then) listing the
        functions between <tools> and </tools>, one JSON a line; an assistant turn's calls as
        <tool_call> blocks after its text; consecutive tool turns as <tool_response> blocks in one
        user turn."""
        text = ""
        if tools:
            first = conversation[0] if conversation and conversation[0]["role"] == "system" else None
            text += "<|im_start|>system\n" + (_content(first["content"]) + "\n\n" if first else "")
            text += TOOLS_HEAD + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools) + TOOLS_TAIL
        for i, m in enumerate(conversation):
            if tools and i == 0 and m["role"] == "system":
                continue
            content = _content(m["content"])
            if m["role"] == "tool":
                if i == 0 or conversation[i - 1]["role"] != "tool":
                    text += "<|im_start|>user"
                text += f"\n<tool_response>\n{content}\n</tool_response>"
                if i == len(conversation) - 1 or conversation[i + 1]["role"] != "tool":
                    text += "<|im_end|>\n"
                continue
            text += f"<|im_start|>{m['role']}\n{content}"
            for j, call in enumerate(m.get("tool_calls") or ()):
                f = call.get("function", call)
                args = f["arguments"] if isinstance(f["arguments"], str) else json.dumps(f["arguments"],
                                                                                        ensure_ascii=False)
                text += ("\n" if j or content else "") + f'<tool_call>\n{{"name": "{f["name"]}", "arguments": {args}}}\n</tool_call>'
            text += "<|im_end|>\n"
        if add_generation_prompt:
            text += "<|im_start|>assistant\n"
        return self.encode(text) if tokenize else text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's bytes: the byte itself, a special token's name, b"" for an unknown id."""
        return bytes([token_id]) if token_id < 256 else self._by_id.get(token_id, "").encode()

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out = bytearray()
        for i in ids:
            if i < 256:
                out.append(i)
            elif not skip_special_tokens and i in self._by_id:
                out += self._by_id[i].encode()
        return out.decode("utf-8", errors="replace")


def _content(content) -> str:
    if isinstance(content, str) or not content:
        return content or ""
    return "".join(p["text"] if p.get("type") == "text" else
                   "<|audio_start|><|audio_pad|><|audio_end|>" if p.get("type") in ("audio", "input_audio")
                   else "" for p in content)


def load_tokenizer(model: str | Path, cfg: ThinkerConfig | None = None, role_ids: dict[str, int] | None = None):
    path = Path(model)
    if path.is_dir() and any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        from transformers import AutoTokenizer

        adopt_transformers_logging()
        return AutoTokenizer.from_pretrained(str(path))
    if cfg is None:
        raise FileNotFoundError(f"no tokenizer files in {model}")
    log.warning("no tokenizer in %s: using the ChatML byte tokenizer (for dummy weights)", model)
    return ChatMLByteTokenizer(cfg, role_ids or {})
