"""The layer library every stage is built from.

Shapes use B = sequences in the step, S = new tokens per sequence, H = hidden size,
Hq / Hkv = query / key-value heads, D = head_dim, E = experts.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe import kernels

from . import determinism
from .config import DecoderConfig, RopeConfig
from .kv_cache import AttentionCache

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}
# grouped-GEMM MoE on CUDA bf16 (VOXPIPE_GROUPED_MOE=0: the per-expert loop, for ablations)
GROUPED_MM = hasattr(torch, "_grouped_mm") and os.environ.get("VOXPIPE_GROUPED_MOE", "1") != "0"
# the kernel path's decode steps with kernels.normlinear: residual add + norm + q/k/v projection, and
# residual add + norm + gate/up projection + SwiGLU, one launch each (VOXPIPE_NORM_LINEAR=1; off
# until measured on the GPU)
NORM_LINEAR = os.environ.get("VOXPIPE_NORM_LINEAR", "0") == "1"


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back before the weight (as the reference)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.active(x):
            return kernels.rmsnorm.run(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class RotaryEmbedding(nn.Module):
    """RoPE, optionally 3-D interleaved MRoPE (t, h, w position ids per token).

    With `mrope_section` (t, h, w) the frequency slots are assigned round-robin t, h, w, t, h, w, ...
    for the first 3 * min(sections) slots and to t for the rest, exactly as Qwen3-Omni does.
    Positions: [B, S] (1-D) or [3, B, S] (MRoPE). Returns cos, sin of shape [B, S, D].
    """

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        # a plain CPU tensor (not a buffer) so modules can be built on the meta device
        self._inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device="cpu") / head_dim))
        self._inv_on: dict[torch.device, torch.Tensor] = {}
        self.mrope_section = rope.mrope_section

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_on.get(positions.device)
        if inv is None:
            inv = self._inv_on[positions.device] = self._inv_freq.to(positions.device)
        if self.mrope_section is None:
            freqs = positions[..., None].float() * inv                      # [B, S, D/2]
        else:
            if positions.ndim == 2:
                positions = positions.unsqueeze(0).expand(3, -1, -1)
            axes = positions[..., None].float() * inv                       # [3, B, S, D/2]
            freqs = axes[0].clone()
            for axis in (1, 2):
                idx = slice(axis, self.mrope_section[axis] * 3, 3)
                freqs[..., idx] = axes[axis][..., idx]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, S, D]; cos/sin: [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """GQA self-attention with optional per-head q/k RMSNorm; the cache decides what is attended."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int, bias: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj: nn.Linear | None = None     # set by fuse_projections()
        self.invariant = False                      # batch-invariant attention (determinism.apply)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache) -> torch.Tensor:
        b, s, _ = x.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None:
            return self.from_qkv(self.qkv_proj(x), rope, cache)
        q = self.q_proj(x).view(b, s, hq, d)
        k = self.k_proj(x).view(b, s, hkv, d)
        v = self.v_proj(x).view(b, s, hkv, d)
        return self._attend(q, k, v, rope, cache)

    def from_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache) -> torch.Tensor:
        """`forward` from the fused projection's output qkv [B, S, (Hq + 2 Hkv) * D]."""
        b, s, _ = qkv.shape
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
        return self._attend(q.view(b, s, hq, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d), rope, cache)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                cache: AttentionCache) -> torch.Tensor:
        """q [B, S, Hq, D], k / v [B, S, Hkv, D] (the projections) -> the output projection [B, S, H]."""
        b, s = q.shape[:2]
        cos, sin = rope
        if kernels.active(q):  # q/k norm and rotation fused, in place
            norm = self.q_norm is not None
            q, k = kernels.rope.run(q, k, cos, sin, self.q_norm.weight if norm else None,
                                    self.k_norm.weight if norm else None, self.q_norm.eps if norm else 0.0)
            attend_tokens = getattr(cache, "attend_tokens", None)
            if attend_tokens is not None:   # token-major in and out: cache append + attention in one kernel
                # (one program per sequence and KV head, all at one length: batch-invariant as it is)
                return self.o_proj(attend_tokens(self.layer_idx, q, k, v, self.scale))
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)   # [B, heads, S, D]
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.invariant:
            with determinism.scope():       # the cache's attention: determinism.attention
                out = cache.attend(self.layer_idx, q, k, v, self.scale)
        else:
            out = cache.attend(self.layer_idx, q, k, v, self.scale)          # [B, Hq, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act = ACTIVATIONS[act]

        self.gate_up_proj: nn.Linear | None = None  # set by fuse_projections()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            # (the batch-invariant mode's silu too: the kernel computes every element alike)
            if kernels.active(gate_up) and (self.act is F.silu or self.act is determinism.silu):
                return self.down_proj(kernels.glu.run(gate_up))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _concat_linear(parts: list[nn.Linear]) -> nn.Linear:
    w = parts[0].weight
    fused = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=parts[0].bias is not None,
                      device="meta")
    fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
    if parts[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


@torch.no_grad()
def fuse_projections(model: nn.Module) -> int:
    """Serving-time layout: one GEMM for each attention's q/k/v and each gated MLP's gate/up (fewer,
    larger kernels per step). The separate projections are dropped; returns how many were fused.
    Loading and the CPU equality tests use the checkpoint's separate projections."""
    n = 0
    for m in model.modules():
        if isinstance(m, Attention) and m.qkv_proj is None:
            m.qkv_proj = _concat_linear([m.q_proj, m.k_proj, m.v_proj])
            m.q_proj = m.k_proj = m.v_proj = None
            n += 1
        elif isinstance(m, GatedMLP) and m.gate_up_proj is None:
            m.gate_up_proj = _concat_linear([m.gate_proj, m.up_proj])
            m.gate_proj = m.up_proj = None
            n += 1
    return n


class Experts(nn.Module):
    """E gated experts stored fused: gate_up [E, 2I, H] (gate rows first), down [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self._bounds: dict[torch.device, torch.Tensor] = {}   # 0 .. E-1 per device (grouped path)
        self.invariant = False                                # determinism.experts (determinism.apply)

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
                shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, H]; top_idx, top_w: [T, K]. Sum over each token's experts of w * expert(x), plus
        sigmoid(shared_logit) * shared when a shared expert's output [T, H] and gate logit [T, 1] are given."""
        if self.invariant:
            return determinism.experts(self, x, top_idx, top_w, shared, shared_logit)
        if x.is_cuda and x.dtype == torch.bfloat16 and GROUPED_MM:
            if kernels.active(x):
                return self.grouped_fused(x, top_idx, top_w, shared, shared_logit)
            out = self.grouped(x, top_idx, top_w)
        else:
            out = self.looped(x, top_idx, top_w)
        return out if shared is None else out + torch.sigmoid(shared_logit) * shared

    def grouped(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection over the (token, expert) pairs sorted by expert. No host
        sync, static shapes: safe inside CUDA graphs. Reads only the routed experts' weights."""
        t, k = top_idx.shape
        experts = self.gate_up.shape[0]
        sorted_ids, order = torch.sort(top_idx.reshape(-1), stable=True)
        bounds = self._bounds.get(x.device)
        if bounds is None:
            bounds = self._bounds[x.device] = torch.arange(experts, device=x.device)
        # end offset of each expert's rows (a cumulative bincount without a host sync)
        offs = torch.searchsorted(sorted_ids, bounds, right=True, out_int32=True)
        xs = x[order // k]
        gate, up = torch._grouped_mm(xs, self.gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.down.transpose(1, 2), offs=offs)
        y = y * top_w.reshape(-1)[order, None].to(y.dtype)
        pairs = torch.empty_like(y)
        pairs[order] = y
        return pairs.view(t, k, -1).sum(1)

    def grouped_fused(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor,
                      shared: torch.Tensor | None, shared_logit: torch.Tensor | None) -> torch.Tensor:
        """`grouped` with the kernels around the two GEMMs (kernels.moe: the pairs' sort order, group
        offsets and inverse in one launch; the weighted sum and shared add in one; kernels.glu)."""
        _order, src, inv, offs = kernels.moe.run_align(top_idx, self.gate_up.shape[0])
        gate_up = torch._grouped_mm(x[src], self.gate_up.transpose(1, 2), offs=offs)
        y = torch._grouped_mm(kernels.glu.run(gate_up), self.down.transpose(1, 2), offs=offs)
        return kernels.moe.run_combine(y, inv, top_w, shared, shared_logit)

    def looped(self, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        token_of = order // top_idx.shape[1]
        weight_of = top_w.reshape(-1)[order]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            gate, up = F.linear(x[tok], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert]) * weight_of[start:start + n, None]
            out.index_add_(0, tok, y.to(out.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    """Top-k routed experts (softmax in float32, optional renormalisation) plus an optional
    sigmoid-gated shared expert."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.experts_per_token, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        if cfg.shared_expert_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, cfg.shared_expert_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        if kernels.active(logits):
            return kernels.moe.run(logits, self.top_k, self.norm_topk)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_w, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return top_idx, top_w.to(logits.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        top_idx, top_w = self.route(flat)
        shared = logit = None
        if self.shared_expert is not None:
            shared, logit = self.shared_expert(flat), self.shared_expert_gate(flat)
        ex = self.experts
        if kernels.active(flat) and not ex.invariant and kernels.experts.eligible(flat, top_idx, top_w, ex.gate_up, ex.down, shared, logit):
            # a few tokens: per-pair GEMVs, then weighted sum + shared add: three launches
            return kernels.experts.kernel(flat, top_idx, top_w, ex.gate_up, ex.down, shared, logit).view(shape)
        return ex(flat, top_idx, top_w, shared, logit).view(shape)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)); x + mlp(norm(x)). MLP is MoE when the config has experts."""

    def __init__(self, cfg: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = SparseMoE(cfg) if cfg.num_experts else GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: AttentionCache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fused(self, residual: torch.Tensor, delta: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
              cache: AttentionCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel path of `forward`, with both residual adds fused into the following norms: the
        layer's output is `residual + delta` (returned unsummed); `delta` coming in is the previous
        layer's MLP output, added into `residual` by this layer's input norm."""
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        attn, mlp = self.self_attn, self.mlp
        qkv = self._norm_linear(delta, residual, norm_in, attn.qkv_proj) if NORM_LINEAR else None
        if qkv is not None:
            (qkv, rows), shape = qkv, residual.shape
            residual = rows.view(shape)
            a = attn.from_qkv(qkv.view(*shape[:-1], -1), rope, cache)
        else:
            if delta is None:
                normed = norm_in(residual)
            else:
                normed, residual = kernels.rmsnorm.run_add(delta, residual, norm_in.weight, norm_in.eps)
            a = attn(normed, rope, cache)
        if NORM_LINEAR and isinstance(mlp, GatedMLP) and mlp.act is F.silu:
            fused = self._norm_linear(a, residual, norm_post, mlp.gate_up_proj, glu=True)
            if fused is not None:
                act, rows = fused
                return rows.view(residual.shape), mlp.down_proj(act.view(*residual.shape[:-1], -1))
        normed, residual = kernels.rmsnorm.run_add(a, residual, norm_post.weight, norm_post.eps)
        return residual, mlp(normed)

    @staticmethod
    def _norm_linear(x: torch.Tensor | None, residual: torch.Tensor, norm: RMSNorm, proj: nn.Linear | None,
                     glu: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """kernels.normlinear on the rows of [B, S, H] tensors (output rows, new residual rows), or
        None where it does not apply (no fused bias-free projection, a layout or size it refuses)."""
        if proj is None or isinstance(proj, determinism.InvariantLinear) or proj.bias is not None or (
                not residual.is_contiguous()) or (
                x is not None and not x.is_contiguous()):
            return None
        h = residual.shape[-1]
        rows, x_rows = residual.view(-1, h), None if x is None else x.view(-1, h)
        if not kernels.normlinear.eligible(x_rows, rows, norm.weight, proj.weight, glu):
            return None
        return kernels.normlinear.kernel(x_rows, rows, norm.weight, norm.eps, proj.weight, glu)


class DecoderStack(nn.Module):
    """Layers + final norm + rotary; `forward` can also return chosen intermediate hidden states
    (index 0 = the input embeddings, i = output of layer i - 1), as transformers numbers them."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None, cache: AttentionCache,
                keep_hidden: int | None = None,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`rope`: this step's (cos, sin) [B, S, D] when the caller computed them ahead (then
        `positions` is not used)."""
        if rope is None:
            rope = self.rotary(positions, x.dtype)
        kept = x if keep_hidden == 0 else None
        if kernels.active(x):   # residual adds fused into the next norm (DecoderLayer.fused)
            residual, delta = x, None
            for i, layer in enumerate(self.layers):
                residual, delta = layer.fused(residual, delta, rope, cache)
                if keep_hidden == i + 1 and i + 1 < len(self.layers):
                    kept = residual + delta
            x, _ = kernels.rmsnorm.run_add(delta, residual, self.norm.weight, self.norm.eps)
            return x, x if keep_hidden == len(self.layers) else kept
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, cache)
            if keep_hidden == i + 1:
                kept = x
        x = self.norm(x)
        if keep_hidden == len(self.layers):
            kept = x  # transformers reports the normed output as the last hidden state
        return x, kept


def serving_layout(model: nn.Module, device: torch.device) -> nn.Module:
    """What the stage servers apply after loading: fused projections on CUDA when the fused-kernel
    path is on (`VOXPIPE_KERNELS`, the ablation's "Triton kernels" layer)."""
    if device.type == "cuda" and kernels.ENABLED:
        fuse_projections(model)
    return model
