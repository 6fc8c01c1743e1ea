"""Thinker: the audio encoder and the MoE text decoder.

Parameter names follow the checkpoint below `thinker.` (`model.*`, `lm_head.*`, `audio_tower.*`);
the vision tower is not implemented (image/video input is refused by the service).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..runtime.config import AudioEncoderConfig, ThinkerConfig
from ..runtime.kv_cache import AttentionCache
from ..runtime.layers import DecoderStack


def audio_output_length(frames: int, n_window: int) -> int:
    """Tokens the audio encoder makes from `frames` mel frames (chunks of 2 * n_window frames,
    three stride-2 convolutions each)."""
    chunk = 2 * n_window
    rest = frames % chunk
    after = (rest - 1) // 2 + 1
    return ((after - 1) // 2 + 1 - 1) // 2 + 1 + (frames // chunk) * 13 if rest else (frames // chunk) * 13


def _conv_out_len(n: int) -> int:
    for _ in range(3):
        n = (n - 1) // 2 + 1
    return n


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    inc = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-inc * torch.arange(channels // 2, dtype=torch.float, device="cpu"))
    t = torch.arange(length, dtype=torch.float, device="cpu")[:, None] * inv[None, :]
    return torch.cat((torch.sin(t), torch.cos(t)), dim=1)


class AudioEncoderLayer(nn.Module):
    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.num_heads = cfg.num_heads
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, nn.Linear(d, d, bias=True))
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.ffn_dim)
        self.fc2 = nn.Linear(cfg.ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, windows: list[int]) -> torch.Tensor:
        """x: [N, d]; `windows`: the attention windows' lengths in order (sum N). Each window attends
        only to itself and is computed on its own, as transformers' sdpa path does (a window's outputs
        are the same bits whatever precedes or follows it: streamed.py encodes windows one by one)."""
        n, d = x.shape
        a = self.self_attn
        h = self.self_attn_layer_norm(x)
        q, k, v = (p(h).view(n, self.num_heads, -1).transpose(0, 1).unsqueeze(0) for p in (a.q_proj, a.k_proj, a.v_proj))
        scale = (d // self.num_heads) ** -0.5
        o = torch.cat([F.scaled_dot_product_attention(qw, kw, vw, scale=scale)
                       for qw, kw, vw in zip(q.split(windows, 2), k.split(windows, 2), v.split(windows, 2))], dim=2)
        x = x + a.out_proj(o[0].transpose(0, 1).reshape(n, d))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioEncoder(nn.Module):
    """Whisper-style encoder: per 2*n_window-frame chunk, three stride-2 convs + sinusoid positions;
    then transformer layers attending within windows of n_window_infer frames; then projection
    to the thinker's hidden size. Every step but attention is per chunk or per row, and attention is
    per window, so a window's outputs are a function of its own frames (and the chunk padding)
    alone: a clip encoded window by window gives the bits of the whole clip encoded at once."""

    def __init__(self, cfg: AudioEncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c = cfg.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        freq = ((((cfg.num_mel_bins + 1) // 2 + 1) // 2 + 1) // 2)
        self.conv_out = nn.Linear(c * freq, cfg.d_model, bias=False)
        self.layers = nn.ModuleList(AudioEncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.ln_post = nn.LayerNorm(cfg.d_model)
        self.proj1 = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj2 = nn.Linear(cfg.d_model, cfg.output_dim)
        self._positions = sinusoids(cfg.max_source_positions, cfg.d_model)

    def forward(self, features: torch.Tensor, pad_to: int | None = None) -> torch.Tensor:
        """features: [num_mel_bins, frames] (one audio) -> [audio_output_length(frames), output_dim].
        Each chunk is zero-padded to `pad_to` frames (default: the clip's longest chunk) before the
        convolutions. The padding is part of the input (`chunk_pad`): past a short chunk's end the
        first convolution's outputs read its last frames (not zero), and the next convolution
        carries them into the chunk's last outputs."""
        cfg = self.cfg
        chunks = features.split(2 * cfg.n_window, dim=1)
        lengths = [ch.shape[1] for ch in chunks]
        longest = max(lengths) if pad_to is None else pad_to
        padded = features.new_zeros(len(chunks), 1, features.shape[0], longest)
        for i, ch in enumerate(chunks):
            padded[i, 0, :, : ch.shape[1]] = ch
        padded = padded.to(self.conv2d1.weight.dtype)
        outs = []
        for part in padded.split(cfg.conv_chunksize, dim=0):
            h = F.gelu(self.conv2d1(part))
            h = F.gelu(self.conv2d2(h))
            outs.append(F.gelu(self.conv2d3(h)))
        h = torch.cat(outs, dim=0)
        b, c, f, t = h.shape
        # contiguous first: for one chunk the reshape would be a strided view, and the projection's
        # bits depend on its input's layout (transformers' order)
        h = self.conv_out(h.permute(0, 3, 1, 2).contiguous().view(b, t, c * f))
        h = h + self._positions[:t].to(h.device, h.dtype)
        valid = [_conv_out_len(n) for n in lengths]
        x = torch.cat([h[i, :n] for i, n in enumerate(valid)], dim=0)               # [N, d]
        window = max(valid) * (cfg.n_window_infer // (2 * cfg.n_window))
        n = x.shape[0]
        windows = [window] * (n // window) + ([n % window] if n % window else [])
        for layer in self.layers:
            x = layer(x, windows)
        x = self.proj1(self.ln_post(x))
        return self.proj2(F.gelu(x))


def chunk_pad(frames: list[int], n_window: int) -> int:
    """The frames every chunk of a prompt's clips is padded to: the longest chunk among them, as
    transformers pads all of a prompt's clips together (a clip under 2 * n_window frames in a prompt
    with a longer one is padded to the longer one's chunk)."""
    return max(min(n, 2 * n_window) for n in frames)


class ThinkerTextModel(DecoderStack):
    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)


class ThinkerModel(nn.Module):
    def __init__(self, cfg: ThinkerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = ThinkerTextModel(cfg.text)
        self.lm_head = nn.Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.audio_tower = AudioEncoder(cfg.audio)

    def embed(self, token_ids: torch.Tensor, audio_features: list[torch.Tensor] = (),
              encoded: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings [S, H]; audio placeholder positions take the audio encoder's outputs
        in order: of `audio_features` ([mel, frames] each), or `encoded` [placeholders, H], the
        clips' outputs already made (audio_cache.py). The caller checked the counts."""
        x = self.model.embed_tokens(token_ids)
        if audio_features or encoded is not None:
            if encoded is None:
                pad = chunk_pad([f.shape[1] for f in audio_features], self.cfg.audio.n_window)
                encoded = torch.cat([self.audio_tower(f, pad) for f in audio_features], dim=0)
            audio = encoded.to(x.dtype)
            mask = token_ids == self.cfg.tokens.audio_token
            x = x.clone()
            x[mask] = audio
        return x

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, cache: AttentionCache,
                keep_hidden: int | None = None, last: torch.Tensor | None = None,
                head: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """embeds [B, S, H] -> (logits [B, V] at each sequence's last position, kept hidden state
        [B, S, H] or None). `last` [B]: those positions in a right-padded batch (default S - 1);
        [B, K]: K positions of each sequence, logits [B, K, V] (a draft's verify: runner.feed).
        Without `head`: the final hidden states at those positions [.., H], not their logits."""
        h, kept = self.model(embeds, positions, cache, keep_hidden=keep_hidden)
        if last is None:
            h = h[:, -1]
        else:
            rows = torch.arange(h.shape[0], device=h.device)
            h = h[rows if last.dim() == 1 else rows[:, None], last]
        return (self.lm_head(h) if head else h), kept
