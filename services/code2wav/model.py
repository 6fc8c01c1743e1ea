"""Code2Wav: a streaming, stateful vocoder that is exact with respect to the reference forward.

The reference `forward(codes[:, :, :F])` returns 1920*F - 555 samples and is causal: the
pre-transformer is causal with a sliding window, every convolution is left-padded, and each
decoder transposed conv (kernel 2r, stride r, trimmed r on both sides) makes output block j
from inputs j and j+1. So instead of re-decoding windows with left context (approximate and
twice the work), each request keeps
  - a sliding-window KV ring per transformer layer (`SlidingWindowCache`),
  - the last (kernel - 1) * dilation input columns of every causal conv,
  - the last input column of every decoder transposed conv,
and decoding F new frames costs O(F) and yields exactly the samples the full forward would add.
Parameter names follow the checkpoint below `code2wav.`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe import kernels

from ..runtime.config import Code2WavConfig, DecoderConfig
from ..runtime.kv_cache import AttentionCache
from ..runtime.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding


@dataclass
class StreamState:
    """Everything one utterance's decoder remembers between chunks."""

    slot: int
    frames_done: int = 0                                        # frames decoded so far (= next position)
    conv: list[torch.Tensor] = field(default_factory=list)      # per causal conv: [C, context]
    trans: list[torch.Tensor] = field(default_factory=list)     # per decoder transposed conv: [C, 1]


class _StreamCtx:
    """Batched states for one decode call: reads and writes the per-request lists in order."""

    def __init__(self, states: list[StreamState], first: bool) -> None:
        self.states, self.first = states, first
        self.conv_i = 0
        self.trans_i = 0

    def next_conv(self, channels: int, context: int, like: torch.Tensor) -> torch.Tensor:
        i = self.conv_i
        if self.first:
            return like.new_zeros(len(self.states), channels, context)
        return torch.stack([s.conv[i] for s in self.states])

    def put_conv(self, new: torch.Tensor) -> None:
        for s, row in zip(self.states, new):
            if self.first:
                s.conv.append(row)
            else:
                s.conv[self.conv_i] = row
        self.conv_i += 1

    def next_trans(self) -> torch.Tensor | None:
        if self.first:
            return None
        return torch.stack([s.trans[self.trans_i] for s in self.states])

    def put_trans(self, last: torch.Tensor) -> None:
        for s, row in zip(self.states, last):
            if self.first:
                s.trans.append(row)
            else:
                s.trans[self.trans_i] = row
        self.trans_i += 1


class CausalConv(nn.Module):
    """Stride-1 Conv1d left-padded by (kernel - 1) * dilation zeros."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        if self.context == 0:
            return self.conv(x)
        state = ctx.next_conv(x.shape[1], self.context, x)
        full = torch.cat((state, x), dim=-1)
        ctx.put_conv(full[..., -self.context:].clone())
        return self.conv(full)


class UpsampleTransConv(nn.Module):
    """ConvTranspose1d with kernel == stride: every input column makes its own output block."""

    def __init__(self, channels: int, factor: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels, channels, factor, stride=factor)

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        return self.conv(x)


class CausalTransConv(nn.Module):
    """ConvTranspose1d(kernel 2r, stride r) trimmed by r on each side: block j depends on inputs
    j and j+1, so a chunk of T new inputs completes T blocks (T - 1 on the first chunk)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, 2 * rate, stride=rate)
        self.trim = rate

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        prev = ctx.next_trans()
        full = x if prev is None else torch.cat((prev, x), dim=-1)
        ctx.put_trans(x[..., -1:].clone())
        y = self.conv(full)
        return y[..., self.trim: y.shape[-1] - self.trim]


class SnakeBeta(nn.Module):
    """x + 1 / exp(beta) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, ctx: _StreamCtx | None = None) -> torch.Tensor:
        if x.is_cuda and kernels.ENABLED:
            return kernels.snakebeta.run(x, self.alpha, self.beta)
        alpha = torch.exp(self.alpha)[None, :, None]
        beta = torch.exp(self.beta)[None, :, None]
        return x + (1.0 / (beta + 1e-9)) * torch.sin(x * alpha).pow(2)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = CausalConv(dim, dim, 7, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        h = self.dwconv(x, ctx).permute(0, 2, 1)
        h = self.pwconv2(F.gelu(self.pwconv1(self.norm(h))))
        return x + (self.gamma * h).permute(0, 2, 1)


class ResidualUnit(nn.Module):
    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.act1 = SnakeBeta(dim)
        self.conv1 = CausalConv(dim, dim, 7, dilation=dilation)
        self.act2 = SnakeBeta(dim)
        self.conv2 = CausalConv(dim, dim, 1)

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        h = self.conv1(self.act1(x), ctx)
        return x + self.conv2(self.act2(h), ctx)


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransConv(cin, cout, rate)] + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, ctx: _StreamCtx) -> torch.Tensor:
        for m in self.block:
            x = m(x, ctx)
        return x


class LayerScale(nn.Module):
    def __init__(self, dim: int, init: float) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((dim,), init))


class Code2WavLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, idx: int, layer_scale: float) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, idx)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn_layer_scale = LayerScale(cfg.hidden_size, layer_scale)
        self.mlp_layer_scale = LayerScale(cfg.hidden_size, layer_scale)

    def forward(self, x, rope, cache: AttentionCache) -> torch.Tensor:
        x = x + self.self_attn_layer_scale.scale * self.self_attn(self.input_layernorm(x), rope, cache)
        return x + self.mlp_layer_scale.scale * self.mlp(self.post_attention_layernorm(x))


class PreTransformer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer_scale: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Code2WavLayer(cfg, i, layer_scale) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        rope = self.rotary(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, cache)
        return self.norm(x)


class Code2WavModel(nn.Module):
    def __init__(self, cfg: Code2WavConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.transformer.hidden_size
        self.code_embedding = nn.Embedding(cfg.codebook_size * cfg.num_quantizers, h)
        self.pre_transformer = PreTransformer(cfg.transformer, cfg.layer_scale)
        self.upsample = nn.ModuleList(
            nn.ModuleList([UpsampleTransConv(h, f), ConvNeXtBlock(h)]) for f in cfg.upsampling_ratios)
        dims = [cfg.decoder_dim // 2 ** i for i in range(len(cfg.upsample_rates) + 1)]
        self.decoder = nn.ModuleList(
            [CausalConv(h, cfg.decoder_dim, 7)]
            + [DecoderBlock(dims[i], dims[i + 1], r) for i, r in enumerate(cfg.upsample_rates)]
            + [SnakeBeta(dims[-1]), CausalConv(dims[-1], 1, 7)])

    def decode(self, codes: torch.Tensor, states: list[StreamState], cache, first: bool) -> torch.Tensor:
        """codes: [B, Q, T] new frames of B utterances that are all at their first chunk (first=True)
        or all past it. `cache` is a SlidingWindowCache. Returns the new samples [B, n] with
        n = samples_per_frame * T, minus the reference's fixed delay on the first chunk."""
        b, q, t = codes.shape
        offsets = torch.arange(q, device=codes.device)[None, :, None] * self.cfg.codebook_size
        x = self.code_embedding(codes + offsets).mean(1)                               # [B, T, H]
        start = [s.frames_done for s in states]
        positions = torch.tensor(start, device=codes.device)[:, None] + torch.arange(t, device=codes.device)
        bound = cache.bind([s.slot for s in states], start, t)
        x = self.pre_transformer(x, positions, bound).permute(0, 2, 1)                 # [B, H, T]
        ctx = _StreamCtx(states, first)
        for stage in self.upsample:
            for m in stage:
                x = m(x, ctx)
        for m in self.decoder:
            x = m(x, ctx)
        for s in states:
            s.frames_done += t
        return x[:, 0].clamp(-1.0, 1.0)
