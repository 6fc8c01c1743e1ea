"""Batch-invariant mode (`--deterministic` on every stage): a request's output bits do not depend on
what else is in its batch -- how many rows, their lengths, its row index, the padding of a batch
bucket, how a prompt was chunked -- only on the request itself.

A default forward is not: on the CPU a matmul's rounding depends on its row count M (MKL takes a
GEMV for M = 1, other blockings for M = 2, 3); vectorized silu / sigmoid round differently from the
scalar loop that takes a tensor's tail, so a row's bits depend on where it sits; attention reduces
over the batch's padded key length; code2wav's convolutions over the batch. On the GPU cuBLAS picks
its algorithm (and split-K) by shape, the grouped MoE GEMMs by how many tokens reach each expert,
and the decode path between per-pair GEMVs and grouped GEMMs by the batch's token count.

`apply(model)` puts a stage's model in the mode, module by module (another model in the same
process keeps the default path, exactly as fast as before):
- every nn.Linear becomes an `InvariantLinear`: on the CPU the rows go through F.linear in blocks
  of exactly ROWS rows (the last one zero-padded), so each row sees one fixed GEMM shape; on CUDA
  `kernels.invariant.matmul`, one fixed tile shape and a fixed K order (no split-K);
- convolutions (`InvariantConv1d` / `InvariantConvTranspose1d`): depthwise ones as ordered taps, the
  others on CUDA as im2col rows through the invariant matmul, all samples at once; elsewhere one
  sample at a time;
- silu and sigmoid take `silu` / `sigmoid` below (one formula for every element);
- attention layers and MoE layers get `invariant = True`: attention runs inside `scope()`, where the
  KV caches call `attention` below instead of SDPA; the MoE experts take `experts` below.
Outputs in this mode are the reference model's up to float rounding order (not its exact bits: the
reference itself is not batch-invariant); greedy ids agree with it wherever the margin exceeds that.
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe import kernels

ROWS = 4           # CPU: rows per matmul call (one GEMM shape; M >= 4 avoids MKL's small-M paths)
KEY_BLOCK = 16     # attention: keys per block of the fixed-order online softmax

_local = threading.local()


def in_scope() -> bool:
    """Whether the calling thread is inside an invariant layer's attention (`scope`)."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def scope():
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) as x / (1 + exp(-x)): exp and division round alike in the vectorized body and
    the scalar tail of a CPU loop (F.silu's do not)."""
    return x / (1.0 + torch.exp(-x))


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, tf32: bool = False) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., N] whose every row's bits depend only on that row. `tf32`:
    float32 operands through the tensor cores as TF32 (CUDA; still one fixed computation per row)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if kernels.active(rows) and rows.stride(-1) != 1:      # a transposed view: the kernel reads rows
        rows = rows.contiguous()
    if kernels.active(rows) and kernels.invariant.eligible(rows, weight, bias):
        out = kernels.invariant.matmul(rows, weight, bias, tf32=tf32)
    else:
        out = _blocked_linear(rows, weight, bias)
    return out.view(*shape[:-1], weight.shape[0])


def _blocked_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    m = rows.shape[0]
    padded = -(-m // ROWS) * ROWS
    if padded != m:
        rows = torch.cat((rows, rows.new_zeros(padded - m, rows.shape[1])))
    out = torch.cat([F.linear(block, weight, bias) for block in rows.split(ROWS)]) if padded > ROWS else \
        F.linear(rows, weight, bias)
    return out[:m]


class InvariantLinear(nn.Linear):
    """nn.Linear through `linear` (set by `apply` on a loaded module: same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, tf32=torch.backends.cuda.matmul.allow_tf32)


def _conv_tf32() -> bool:
    """Whether the mode's float32 convolutions take TF32: as the default mode's do (cuDNN's
    `torch.backends.cudnn.allow_tf32`, on by default), so that the mode changes which bits a sample
    gets from the batch but not the precision it is computed at. (Its float32 matmuls follow
    `torch.backends.cuda.matmul.allow_tf32`, off by default: exact products.)"""
    return torch.backends.cudnn.allow_tf32


def _plain(conv: nn.Module) -> bool:
    """No padding, stride (transposed: output padding, dilation) and no groups beyond what the rows
    forms below take."""
    return conv.padding_mode == "zeros" and all(p == 0 for p in conv.padding)


class InvariantConv1d(nn.Conv1d):
    """nn.Conv1d [B, Cin, L] -> [B, Cout, L'] with each sample's bits independent of the batch:
    - depthwise (groups == Cin == Cout): the taps summed in order in float32, elementwise (a product
      of two 16-bit numbers is exact in float32; each add rounds alike at any shape);
    - groups 1, stride 1, where the Triton kernels launch (CUDA): im2col rows [B * L', Cin * K]
      through `linear` (kernels.invariant.matmul: fixed tiles, fixed K order), all samples at once;
    - else (the CPU, whose GEMMs round a row by the call's shape) one sample at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, (d,) = self.kernel_size[0], self.dilation
        if _plain(self) and self.stride == (1,) and x.ndim == 3:
            if self.groups == self.in_channels == self.out_channels:
                return _depthwise(x, self.weight, self.bias, d)
            if self.groups == 1 and kernels.active(x):
                span = (k - 1) * d + 1
                cols = x.unfold(2, span, 1)[..., ::d] if k > 1 else x[..., None]             # [B, Cin, L', K]
                b, cin, length = cols.shape[:3]
                rows = cols.permute(0, 2, 1, 3).reshape(b * length, cin * k)
                out = linear(rows, self.weight.reshape(self.out_channels, cin * k), self.bias,  # [B * L', Cout]
                             tf32=_conv_tf32())
                return out.view(b, length, -1).transpose(1, 2).contiguous()
        return torch.cat([super(InvariantConv1d, self).forward(s) for s in x.split(1)])


def _depthwise(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """Depthwise conv1d x [B, C, L], weight [C, 1, K]: bias + sum_k w[:, k] * x[:, t + k * dilation],
    left to right in float32."""
    k = weight.shape[-1]
    length = x.shape[-1] - (k - 1) * dilation
    w = weight[:, 0].float()
    acc = x[..., :length].float() * w[:, :1]
    for j in range(1, k):
        acc = acc + x[..., j * dilation: j * dilation + length].float() * w[:, j:j + 1]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    return acc.to(x.dtype)


class InvariantConvTranspose1d(nn.ConvTranspose1d):
    """nn.ConvTranspose1d with each sample's bits independent of the batch. With kernel K = m * stride
    (groups 1, no dilation / padding), where the Triton kernels launch: output block t (stride
    positions) is sum_i x[t - i] @ W[:, :, i * stride: (i + 1) * stride], one matmul row of the m input
    columns t - m + 1 .. t (zero past the ends) against `rows_weight` [Cout * stride, Cin * m] (made
    by `apply`), all samples at once; else one sample at a time."""

    def prepare(self) -> None:
        """Buffers `rows_weight` / `rows_bias` (None: not of that form) from the weight [Cin, Cout, K]
        (at `apply`: before any graph capture; buffers, so that `.to()` moves them)."""
        s, k = self.stride[0], self.kernel_size[0]
        weight = bias = None
        if (_plain(self) and self.groups == 1 and self.dilation == (1,) and self.output_padding == (0,)
                and k % s == 0):
            cin, cout, m = self.in_channels, self.out_channels, k // s
            with torch.no_grad():
                w = self.weight.view(cin, cout, m, s).flip(2)                             # [ci, co, j, r]
                weight = w.permute(1, 3, 0, 2).reshape(cout * s, cin * m).contiguous()
                bias = None if self.bias is None else self.bias.repeat_interleave(s)
        for name, t in (("rows_weight", weight), ("rows_bias", bias)):
            if name in self._buffers:
                self._buffers[name] = t
            else:
                self.register_buffer(name, t, persistent=False)

    def forward(self, x: torch.Tensor, output_size=None) -> torch.Tensor:
        if (getattr(self, "rows_weight", None) is not None and output_size is None and x.ndim == 3
                and kernels.active(x)):
            s, m = self.stride[0], self.kernel_size[0] // self.stride[0]
            cols = F.pad(x, (m - 1, m - 1)).unfold(2, m, 1) if m > 1 else x[..., None]    # [B, Cin, L + m - 1, m]
            b, cin, blocks = cols.shape[:3]
            rows = cols.permute(0, 2, 1, 3).reshape(b * blocks, cin * m)
            out = linear(rows, self.rows_weight, self.rows_bias, tf32=_conv_tf32())          # [B * blocks, Cout * s]
            return out.view(b, blocks, self.out_channels, s).permute(0, 2, 1, 3).reshape(b, self.out_channels, -1)
        return torch.cat([super(InvariantConvTranspose1d, self).forward(s) for s in x.split(1)])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """Softmax attention q [B, Hq, S, D] over k / v [B, Hkv, L, D] (grouped-query: Hq a multiple of
    Hkv), mask [B, 1, S, L] bool (True: attend) or None -> [B, Hq, S, D], each query row computed
    alone: keys in blocks of KEY_BLOCK from position 0, an online softmax in that fixed order, every
    reduction per row of a fixed size. Keys past a row's mask add exact zeros, so padding the batch's
    key length, the query count and the batch size change no bits. A row with no key gets zeros."""
    if kernels.active(q) and kernels.invariant.attention_eligible(q, k, v, mask):
        return kernels.invariant.attention(q, k, v, mask, scale)
    return reference_attention(q, k, v, mask, scale)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        scale: float) -> torch.Tensor:
    b, hq, s, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    rep = hq // hkv
    qg = q.reshape(b, hkv, rep * s, 1, d).float()                                   # query rows by KV head
    if mask is None:
        mask = torch.ones(b, 1, s, length, dtype=torch.bool, device=q.device)
    mask = mask.expand(b, 1, s, length)[:, :, None].expand(b, 1, rep, s, length).reshape(b, 1, rep * s, length)
    top = torch.full((b, hkv, rep * s, 1), float("-inf"), device=q.device)
    total = torch.zeros(b, hkv, rep * s, 1, device=q.device)
    acc = torch.zeros(b, hkv, rep * s, d, device=q.device)
    for j in range(0, length, KEY_BLOCK):
        kj, vj, mj = k[:, :, j:j + KEY_BLOCK].float(), v[:, :, j:j + KEY_BLOCK].float(), mask[..., j:j + KEY_BLOCK]
        if kj.shape[2] < KEY_BLOCK:     # the last block, zero-padded to the fixed size
            pad = KEY_BLOCK - kj.shape[2]
            kj, vj = F.pad(kj, (0, 0, 0, pad)), F.pad(vj, (0, 0, 0, pad))
            mj = F.pad(mj, (0, pad), value=False)
        scores = (qg * kj[:, :, None]).sum(-1) * scale                               # [B, Hkv, R, KB]
        scores = scores.masked_fill(~mj, float("-inf"))
        new_top = torch.maximum(top, scores.amax(-1, keepdim=True))
        base = torch.where(torch.isinf(new_top), torch.zeros_like(new_top), new_top)
        p = torch.exp(scores - base)
        keep = torch.exp(top - base)
        total = total * keep + p.sum(-1, keepdim=True)
        acc = acc * keep + (p[..., None] * vj[:, :, None]).sum(-2)
        top = new_top
    out = acc / torch.where(total == 0, torch.ones_like(total), total)
    return out.to(q.dtype).reshape(b, hq, s, d)


def experts(module, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
    """`layers.Experts`'s routed sum [T, H] with each token's bits independent of the others: on CUDA
    one fixed-tile grouped GEMM per projection (kernels.invariant.grouped); elsewhere each expert's
    rows through `linear`; the k weighted outputs summed in the token's own expert order."""
    t, k = top_idx.shape
    if kernels.active(x) and kernels.invariant.moe_eligible(x, top_idx, module.gate_up, module.down):
        y = kernels.invariant.moe(x, top_idx, module.gate_up, module.down)           # [T * K, H] pair order
    else:
        y = x.new_empty(t * k, x.shape[1])
        flat = top_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=module.gate_up.shape[0]).tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n:
                pairs = order[start:start + n]
                gate, up = linear(x[pairs // k], module.gate_up[expert]).chunk(2, dim=-1)
                y[pairs] = linear(silu(gate) * up, module.down[expert])
                start += n
    return ordered_sum(y.view(t, k, -1) * top_w[..., None].to(y.dtype), 1)    # top-k rank order


_CLASSES = {nn.Linear: InvariantLinear, nn.Conv1d: InvariantConv1d, nn.ConvTranspose1d: InvariantConvTranspose1d}


def apply(model: nn.Module) -> nn.Module:
    """Put `model` (loaded, laid out for serving) in batch-invariant mode, in place; returns it.
    Modules with an `invariant` attribute (attention, experts, the models' fixed-order sums) get
    True. On CUDA the mode needs the Triton kernels (ValueError when VOXPIPE_KERNELS=0 or Triton is
    missing): torch's own CUDA ops choose their algorithms by shape."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda and not (kernels.ENABLED and _triton_available()):
        raise ValueError("--deterministic on CUDA needs the Triton kernels (Triton installed, VOXPIPE_KERNELS not 0)")
    if on_cuda:
        torch.backends.cudnn.deterministic = True       # one convolution algorithm per shape, no atomics
        torch.backends.cudnn.benchmark = False
    for m in model.modules():
        swap = _CLASSES.get(type(m))
        if swap is not None:
            m.__class__ = swap
            if swap is InvariantConvTranspose1d:
                m.prepare()
        if hasattr(m, "invariant"):
            m.invariant = True
        if getattr(m, "act", None) is F.silu:       # GatedMLP, the talker's ResizeMLP
            m.act = silu
    return model


def _triton_available() -> bool:
    from voxpipe.kernels import common

    return common.triton is not None


def ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x.sum(dim) as x[0] + x[1] + ... along `dim`, left to right: the same order for any batch
    (a CUDA reduction's tree depends on the tensor's shape)."""
    parts = x.unbind(dim)
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out
