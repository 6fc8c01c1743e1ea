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
The state lives in slot-indexed tensors (`StreamStore`), so a batch of utterances is a gather /
scatter by slot and the steady-state one-frame step can be a CUDA graph.
Parameter names follow the checkpoint below `code2wav.`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe import kernels

from ..runtime import determinism
from ..runtime.config import Code2WavConfig, DecoderConfig
from ..runtime.kv_cache import AttentionCache, SlidingWindowCache
from ..runtime.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding


class StreamStore:
    """Per-slot decoder state for up to `num_slots` utterances (plus one scratch slot that padded
    rows of a CUDA-graph batch write into): one tensor per causal conv [slots, C, context], one per
    decoder transposed conv [slots, C, 1], and the pre-transformer's sliding-window KV ring."""

    def __init__(self, model: "Code2WavModel", num_slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        t = model.cfg.transformer
        total = num_slots + 1
        self.window = SlidingWindowCache(t.num_layers, total, t.sliding_window, t.num_kv_heads, t.head_dim, dtype, device)
        self.conv = [torch.zeros(total, m.conv.in_channels, m.context, dtype=dtype, device=device)
                     for m in model.modules() if isinstance(m, CausalConv) and m.context]
        self.trans = [torch.zeros(total, m.conv.in_channels, 1, dtype=dtype, device=device)
                      for m in model.modules() if isinstance(m, CausalTransConv)]
        self.scratch = self.window.allocate()   # never given to an utterance

    @property
    def free_slots(self) -> int:
        return self.window.free_slots

    def allocate(self) -> int:
        slot = self.window.allocate()
        for t in self.conv:
            t[slot].zero_()
        return slot

    def release(self, slot: int) -> None:
        self.window.release(slot)

    def scrub(self, slot: int) -> None:
        """Zero `slot`'s state (before releasing an utterance whose numbers went non-finite): the
        window's stale keys are read under a False mask, and 0 * NaN is NaN."""
        for t in (*self.window.k, *self.window.v, *self.conv, *self.trans):
            t[slot].zero_()


class _SlotCtx:
    """The state rows of this call's utterances (`slots` [B]); each streaming module takes the next
    conv / trans state in module order."""

    def __init__(self, store: StreamStore, slots: torch.Tensor, first: bool) -> None:
        self.store, self.slots, self.first = store, slots, first
        self.conv_i = 0
        self.trans_i = 0

    def conv_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        t = self.store.conv[self.conv_i]
        self.conv_i += 1
        return t, t.index_select(0, self.slots)

    def trans_state(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = self.store.trans[self.trans_i]
        self.trans_i += 1
        return t, (None if self.first else t.index_select(0, self.slots))


class CausalConv(nn.Module):
    """Stride-1 Conv1d left-padded by (kernel - 1) * dilation zeros."""

    def __init__(self, cin: int, cout: int, kernel: int, dilation: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.conv = nn.Conv1d(cin, cout, kernel, dilation=dilation, groups=groups)
        self.context = (kernel - 1) * dilation

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
        if self.context == 0:
            return self.conv(x)
        store, state = ctx.conv_state()
        full = torch.cat((state, x), dim=-1)
        store.index_copy_(0, ctx.slots, full[..., -self.context:])
        return self.conv(full)


class UpsampleTransConv(nn.Module):
    """ConvTranspose1d with kernel == stride: every input column makes its own output block."""

    def __init__(self, channels: int, factor: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(channels, channels, factor, stride=factor)

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
        return self.conv(x)


class CausalTransConv(nn.Module):
    """ConvTranspose1d(kernel 2r, stride r) trimmed by r on each side: block j depends on inputs
    j and j+1, so a chunk of T new inputs completes T blocks (T - 1 on the first chunk)."""

    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(cin, cout, 2 * rate, stride=rate)
        self.trim = rate

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
        store, prev = ctx.trans_state()
        full = x if prev is None else torch.cat((prev, x), dim=-1)
        store.index_copy_(0, ctx.slots, x[..., -1:])
        y = self.conv(full)
        return y[..., self.trim: y.shape[-1] - self.trim]


class SnakeBeta(nn.Module):
    """x + 1 / exp(beta) * sin(x * exp(alpha))^2, per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels))
        self.beta = nn.Parameter(torch.zeros(channels))

    def forward(self, x: torch.Tensor, ctx: _SlotCtx | None = None) -> torch.Tensor:
        if kernels.active(x):
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

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
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

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
        h = self.conv1(self.act1(x), ctx)
        return x + self.conv2(self.act2(h), ctx)


class DecoderBlock(nn.Module):
    def __init__(self, cin: int, cout: int, rate: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [SnakeBeta(cin), CausalTransConv(cin, cout, rate)] + [ResidualUnit(cout, d) for d in (1, 3, 9)])

    def forward(self, x: torch.Tensor, ctx: _SlotCtx) -> torch.Tensor:
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
        self.invariant = False      # batch-invariant mode (determinism.apply): the code embeddings summed in order

    def decode(self, codes: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, store: StreamStore,
               first: bool) -> torch.Tensor:
        """`decode_unclamped` clamped to [-1, 1]."""
        return self.decode_unclamped(codes, slots, start, store, first).clamp(-1.0, 1.0)

    def decode_unclamped(self, codes: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, store: StreamStore,
                         first: bool) -> torch.Tensor:
        """codes [B, Q, T]: T new frames for the utterances in `slots` [B] whose next frame positions
        are `start` [B]; all at their first chunk (first=True) or all past it. Returns the new samples
        [B, n] with n = samples_per_frame * T (minus the reference's fixed delay on the first chunk).
        Shapes depend only on (B, T, first): the call can be captured in a CUDA graph."""
        b, q, t = codes.shape
        offsets = torch.arange(q, device=codes.device)[None, :, None] * self.cfg.codebook_size
        embeds = self.code_embedding(codes + offsets)                                  # [B, Q, T, H]
        x = determinism.ordered_sum(embeds, 1) / q if self.invariant else embeds.mean(1)  # [B, T, H]
        positions = start[:, None] + torch.arange(t, device=codes.device)
        bound = store.window.bind(slots, start, t)
        x = self.pre_transformer(x, positions, bound).permute(0, 2, 1)                 # [B, H, T]
        ctx = _SlotCtx(store, slots, first)
        for stage in self.upsample:
            for m in stage:
                x = m(x, ctx)
        for m in self.decoder:
            x = m(x, ctx)
        return x[:, 0]
