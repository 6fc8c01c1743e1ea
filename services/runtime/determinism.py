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
  the same idea at GPU_ROWS rows (`rows_linear`): every call of a layer is cuBLAS at one shape
  [GPU_ROWS, K] x [K, N] (zero-padded, 256-byte aligned, contiguous, into a preallocated output), so
  a decode step of any batch bucket, a prefill, an extend or a recompute give a row one computation.
  A GEMM has no data-dependent control flow: a row's bits depend on the algorithm cuBLAS picks for
  the shape, alignment and workspace (all fixed here) and on the row's position in the call; `apply`
  checks the position (`rows_invariant`: each layer shape's rows at every position of two calls,
  beside random rows, eagerly and replayed in a CUDA graph, against the row alone) and keeps
  `kernels.invariant.matmul` (one fixed tile shape and a fixed K order, no split-K) for a shape that
  fails it, or for every layer with VOXPIPE_INVARIANT_MATMUL=triton. A prefill's many GPU_ROWS-row
  blocks go several to a launch (one GEMM of their rows, or a strided-batched GEMM) wherever
  `batches_invariant` found, per layer shape and per block count, that every row keeps the bits of
  its GPU_ROWS-row call; elsewhere one call a block; inside a CUDA graph capture only the launches
  `batches_graphed` also proved replayed in a graph;
- convolutions (`InvariantConv1d` / `InvariantConvTranspose1d`): depthwise ones as ordered taps, the
  others on CUDA as cuDNN calls of exactly GPU_SAMPLES samples (`sample_blocks`: zero-padded,
  aligned; cudnn.deterministic, no benchmarking, so one algorithm per shape), each (layer, input)
  shape checked at its first call (`samples_invariant`: a sample at every position of two calls
  among random ones, and in a CUDA graph), then one call of 64 or 32 samples where `samples_spans`
  proved it gives every sample its 16-sample call's bits (eager and in a CUDA graph; fewer launches
  for a large batch) -- or as im2col rows through the invariant matmul, all samples at once, where
  that fails or with VOXPIPE_INVARIANT_CONV=triton; elsewhere one sample at a time;
- silu and sigmoid take `silu` / `sigmoid` below (one formula for every element); on the kernel path
  a fused gate/up projection's SwiGLU is kernels.glu (one program per row and column block, the
  same instructions for every element);
- attention layers and MoE layers get `invariant = True`: attention runs inside `scope()`, where the
  KV caches call `attention` below instead of SDPA; the MoE experts take `experts` below.
Outputs in this mode are the reference model's up to float rounding order (not its exact bits: the
reference itself is not batch-invariant); greedy ids agree with it wherever the margin exceeds that.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

from voxpipe import kernels

ROWS = 4           # CPU: rows per matmul call (one GEMM shape; M >= 4 avoids MKL's small-M paths)
KEY_BLOCK = 16     # attention: keys per block of the fixed-order online softmax
GPU_ROWS = 64      # CUDA: rows per cuBLAS call of an nn.Linear (a c = 64 decode step: one call)
ALIGN = 256        # CUDA: bytes the rows of a call start on (cuBLAS picks kernels by pointer alignment)
# the mode's nn.Linear layers on CUDA: "cublas" (`rows_linear`, each layer shape checked by
# `rows_invariant` at `apply`) or "triton" (kernels.invariant.matmul for every layer)
GPU_MATMUL = os.environ.get("VOXPIPE_INVARIANT_MATMUL", "cublas")
GPU_MATMULS = ("cublas", "triton")
GPU_SAMPLES = 16   # CUDA: samples per cuDNN call of a dense convolution (code2wav's default --max-batch)
# the mode's dense convolutions on CUDA: "cudnn" (`sample_blocks`, each layer and input shape checked
# by `samples_invariant` at its first call) or "triton" (im2col rows through kernels.invariant.matmul)
GPU_CONV = os.environ.get("VOXPIPE_INVARIANT_CONV", "cudnn")
GPU_CONVS = ("cudnn", "triton")

log = logging.getLogger(__name__)
# CUDA nn.Linear layers put in the mode so far in this process, by the path they take ("cublas",
# "triton"; "batched": those of the cuBLAS ones whose prefill blocks may share a launch) -- what
# bench/determinism_check.py reports beside its bits
LINEAR_PATHS: dict[str, int] = {}
# seconds the start-up checks took so far in this process ("rows": the linears' rows_invariant and
# batches_invariant)
CHECK_S: dict[str, float] = {}
# CUDA convolution (layer, input) shapes checked so far: True where `samples_invariant` held
CONV_SHAPES: dict[tuple, bool] = {}
# the same shapes -> the larger calls (`samples_spans`) proven for them where `samples_invariant` held
CONV_SPANS: dict[tuple, tuple[int, ...]] = {}
CONV_SHAPES_MAX = 512    # past this many, a new shape keeps the Triton path unchecked (eager whole-utterance
                         # decodes meet a shape per length; the frame steps a few per layer)

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
    """1 / (1 + exp(-x)) with every element's bits its own. On CUDA torch.sigmoid (one launch where the
    formula takes four: the talker's shared-expert gate, 20 a step): a CUDA elementwise kernel runs one
    functor, that formula in float, for every element, vectorized or not; on the CPU the formula itself
    (ATen's vectorized sigmoid and its scalar tail round differently)."""
    if x.is_cuda:
        return torch.sigmoid(x)
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


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                batches: tuple[tuple[int, str], ...] = (),
                graph_batches: tuple[tuple[int, str], ...] = ()) -> torch.Tensor:
    """F.linear(x, weight, bias) [..., N] as cuBLAS calls of exactly GPU_ROWS rows each: the rows
    zero-padded to a multiple of GPU_ROWS in a contiguous buffer starting on ALIGN bytes (x itself
    when it already is one), each call's [GPU_ROWS, N] written into one preallocated output. Every
    call has one shape, strides and alignment whatever the row count, so cuBLAS runs one algorithm
    for it; that a row's bits then do not depend on its position in the call is what
    `rows_invariant` checks (apply).
    `batches`: (blocks, how) pairs, largest first, that `batches_invariant` found to give every row
    the bits of its GPU_ROWS-row call (apply): a prefill's blocks go `blocks` at a time through one
    launch (`_row_batch`: "mm", one GEMM of blocks * GPU_ROWS rows; "bmm", one strided-batched GEMM
    of [blocks, GPU_ROWS, K] against the weight at batch stride 0) while that many are left,
    the rest one call each. While a CUDA graph is being captured only `graph_batches` are taken: the
    entries of `batches` that `batches_graphed` also found to hold replayed in a CUDA graph (apply)."""
    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    m, k = rows.shape
    padded = -(-m // GPU_ROWS) * GPU_ROWS
    if padded != m or not rows.is_contiguous() or rows.data_ptr() % ALIGN:
        rows = padded_rows(rows, padded)
    out = rows.new_empty(padded, weight.shape[0])
    wt = weight.t()
    i = 0
    if batches and padded > GPU_ROWS and rows.is_cuda and torch.cuda.is_current_stream_capturing():
        batches = graph_batches
    if batches and padded > GPU_ROWS:
        for blocks, how in batches:
            span = blocks * GPU_ROWS
            while padded - i >= span:
                _row_batch(rows[i:i + span], wt, bias, out[i:i + span], blocks, how)
                i += span
    for i in range(i, padded, GPU_ROWS):
        if bias is None:
            torch.mm(rows[i:i + GPU_ROWS], wt, out=out[i:i + GPU_ROWS])
        else:
            torch.addmm(bias, rows[i:i + GPU_ROWS], wt, out=out[i:i + GPU_ROWS])
    return out[:m].view(*shape[:-1], weight.shape[0])


# zero blocks (GPU_ROWS rows of a linear's input width, or GPU_SAMPLES samples of a convolution's input
# shape) per (shape, dtype, device), made outside any CUDA graph capture and never written:
# `padded_rows` copies the padding from them (one per linear input width; one per convolution shape
# that takes cuDNN sample calls, at most CONV_SHAPES_MAX)
_ZERO_ROWS: dict[tuple, torch.Tensor] = {}


def padded_rows(rows: torch.Tensor, padded: int, block: int = GPU_ROWS) -> torch.Tensor:
    """rows [m, ...] (m <= padded < m + block) followed by padded - m zero rows, in a new contiguous
    buffer (from the caching allocator: 512-byte aligned): one launch (a cat with a persistent block
    of `block` zero rows) where the zeros exist -- made at the first call outside a CUDA graph capture
    (each engine's eager warm-up runs before its capture) -- else the buffer filled in two (a copy and
    a zero fill), as before. The same bits either way."""
    m, rest = rows.shape[0], tuple(rows.shape[1:])
    if padded == m:
        buf = rows.new_empty(padded, *rest)
        buf.copy_(rows)
        return buf
    key = (rest, rows.dtype, rows.device, block)
    zeros = _ZERO_ROWS.get(key)
    if zeros is None and not (rows.is_cuda and torch.cuda.is_current_stream_capturing()):
        zeros = _ZERO_ROWS[key] = rows.new_zeros(block, *rest)
    if zeros is not None and padded - m <= block:
        return torch.cat((rows, zeros[:padded - m])).contiguous()
    buf = rows.new_empty(padded, *rest)
    buf[:m].copy_(rows)
    buf[m:].zero_()
    return buf


ROW_BATCHES = (64, 32, 16, 8, 4, 2)    # CUDA: GPU_ROWS-row blocks per launch a prefill may take (checked)
ROW_BATCH_HOWS = ("mm", "bmm")       # tried in this order: one GEMM (the faster), then strided-batched
ROW_BATCH_BYTES = 1 << 28              # a launch's output past this is neither checked nor taken (lm_head)


def _row_batch(rows: torch.Tensor, wt: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
               blocks: int, how: str) -> None:
    """rows [blocks * GPU_ROWS, K] @ wt [K, N] (+ bias) into out, in one launch (see rows_linear)."""
    if how == "mm":
        if bias is None:
            torch.mm(rows, wt, out=out)
        else:
            torch.addmm(bias, rows, wt, out=out)
        return
    k, n = wt.shape
    a, o, w = rows.view(blocks, GPU_ROWS, k), out.view(blocks, GPU_ROWS, n), wt.expand(blocks, k, n)
    if bias is None:
        torch.bmm(a, w, out=o)
    else:
        torch.baddbmm(bias.expand(blocks, GPU_ROWS, n), a, w, out=o)


def _row_check_inputs(weight: torch.Tensor, bias: torch.Tensor | None, seed: int):
    """What a row-invariance check of a linear draws from: `rand(m)` ([m, K] random rows at scales
    1e-2 .. 1e2, a new draw per call, from a generator seeded with `seed`), a target row and its
    GPU_ROWS-row call's output (`rows_linear` of the row alone)."""
    dev, k = weight.device, weight.shape[1]
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(m: int) -> torch.Tensor:
        scale = 10.0 ** (torch.arange(m, device=dev) % 5 - 2).float()
        return (torch.randn(m, k, generator=g, device=dev, dtype=torch.float32) * scale[:, None]).to(weight.dtype)

    target = rand(1)[0]
    return rand, target, rows_linear(target[None], weight, bias)[0]


def batches_invariant(weight: torch.Tensor, bias: torch.Tensor | None, seed: int = 0) -> tuple[tuple[int, str], ...]:
    """The (blocks, how) of ROW_BATCHES x ROW_BATCH_HOWS under which one `_row_batch` launch gives
    every row the bits of its GPU_ROWS-row call (`rows_linear` of the row alone), largest first, at
    most one `how` per blocks (the first that holds): a target row at every position of the launch
    (even positions, then odd ones) among random rows (scales 1e-2 .. 1e2, a new draw per launch).
    cuBLAS picks its kernel (tiles, split-K) by the batch count and the row count too, so each is
    checked on its own; what fails keeps the GPU_ROWS-row calls. Any exception: that one is left out."""
    dev, (n, k) = weight.device, weight.shape
    rand, target, alone = _row_check_inputs(weight, bias, seed)
    plan = []
    for blocks in ROW_BATCHES:
        span = blocks * GPU_ROWS
        if span * n * weight.element_size() > ROW_BATCH_BYTES:
            continue
        for how in ROW_BATCH_HOWS:
            try:
                ok = True
                for parity in (0, 1):
                    x = rand(span)
                    x[parity::2] = target
                    out = torch.empty(span, n, dtype=weight.dtype, device=dev)
                    _row_batch(x, weight.t(), bias, out, blocks, how)
                    ok = ok and torch.equal(out[parity::2], alone.expand(span // 2, n))
                    del x, out
            except Exception:
                log.exception("--deterministic: the %d-block %s check of a [%d, %d] linear failed to run",
                              blocks, how, n, k)
                ok = False
            if ok:
                plan.append((blocks, how))
                break
    return tuple(plan)


def batches_graphed(weight: torch.Tensor, bias: torch.Tensor | None, plan: tuple[tuple[int, str], ...],
                    seed: int = 2) -> tuple[tuple[int, str], ...]:
    """The entries of `plan` (`batches_invariant`'s, proven eagerly) that also give every row the bits
    of its GPU_ROWS-row call replayed in a CUDA graph (what the engines' prefill, extend and code2wav
    frame graphs run): one `_row_batch` launch captured per entry, replayed with a target row at every
    even position, then every odd one, among random rows. What fails (or raises, a capture included)
    is left out: captured calls keep GPU_ROWS-row calls for that block count. Off CUDA: ()."""
    if not plan or weight.device.type != "cuda":
        return ()
    dev, (n, k) = weight.device, weight.shape
    rand, target, alone = _row_check_inputs(weight, bias, seed)
    kept = []
    for blocks, how in plan:
        span = blocks * GPU_ROWS
        try:
            static = torch.zeros(span, k, dtype=weight.dtype, device=dev)
            out = torch.empty(span, n, dtype=weight.dtype, device=dev)

            def run(x: torch.Tensor, blocks=blocks, how=how, out=out) -> torch.Tensor:
                _row_batch(x, weight.t(), bias, out, blocks, how)
                return out

            def fill(parity: int, span=span):
                def at(x: torch.Tensor) -> None:
                    x.copy_(rand(span))
                    x[parity::2] = target
                return at

            with torch.cuda.device(dev):
                got = _graph_replays(run, static, [fill(0), fill(1)])
            ok = all(torch.equal(g[parity::2], alone.expand(span // 2, n)) for parity, g in enumerate(got))
            del static, out, got
        except Exception:
            log.exception("--deterministic: the %d-block %s graph check of a [%d, %d] linear failed to run",
                          blocks, how, n, k)
            ok = False
        if ok:
            kept.append((blocks, how))
    return tuple(kept)


def rows_invariant(weight: torch.Tensor, bias: torch.Tensor | None, graph: bool = True, seed: int = 0) -> bool:
    """Whether `rows_linear` gives a row the same bits wherever it sits: one target row alone, then
    at every position p of 2 * GPU_ROWS (both calls of a two-call batch) inside a batch of p + 1 ..
    2 * GPU_ROWS rows (so every padded tail, every bucket size) of random rows (scales 1e-2 .. 1e2),
    eagerly; with `graph`, also replayed in CUDA graphs captured on one GPU_ROWS-row batch and on a
    one-row batch (the decode graphs' shapes), the target at several positions. Any exception (a
    capture that fails): False."""
    try:
        return _rows_invariant(weight, bias, graph, seed)
    except Exception:       # the layer keeps the Triton kernel
        log.exception("--deterministic: the cuBLAS row check of a [%d, %d] linear failed to run",
                      *weight.shape)
        return False


def _rows_invariant(weight: torch.Tensor, bias: torch.Tensor | None, graph: bool, seed: int) -> bool:
    dev, k = weight.device, weight.shape[1]
    g = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev, dtype=torch.float32) * scale).to(weight.dtype)

    target = rand(k)
    alone = rows_linear(target[None], weight, bias)[0]
    span = 2 * GPU_ROWS
    for p in range(span):
        m = p + 1 + int(torch.randint(0, span - p, (1,), generator=g, device=dev))
        x = rand(m, k, scale=10.0 ** (p % 5 - 2))
        x[p] = target
        if not torch.equal(rows_linear(x, weight, bias)[p], alone):
            return False
    if not graph or dev.type != "cuda":
        return True
    with torch.cuda.device(dev):
        for m in (GPU_ROWS, 1):
            static = rand(m, k)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                rows_linear(static, weight, bias)
            torch.cuda.current_stream().wait_stream(side)
            cuda_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cuda_graph, capture_error_mode="thread_local"):
                out = rows_linear(static, weight, bias)
            for p in sorted({0, min(1, m - 1), m // 2, m - 1}):
                static.copy_(rand(m, k, scale=10.0 ** (p % 5 - 2)))
                static[p] = target
                cuda_graph.replay()
                if not torch.equal(out[p], alone):
                    return False
            del cuda_graph
    return True


class InvariantLinear(nn.Linear):
    """nn.Linear through `linear` (set by `apply` on a loaded module: same parameters); on CUDA with
    `cublas_rows` (set by `apply` where `rows_invariant` held) through `rows_linear`."""

    cublas_rows = False
    row_batches: tuple[tuple[int, str], ...] = ()     # set by `apply`: `batches_invariant`'s plan
    graph_batches: tuple[tuple[int, str], ...] = ()   # set by `apply`: those of them `batches_graphed` kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cublas_rows and x.is_cuda:
            return rows_linear(x, self.weight, self.bias, self.row_batches, self.graph_batches)
        return linear(x, self.weight, self.bias, tf32=torch.backends.cuda.matmul.allow_tf32)


def _conv_tf32() -> bool:
    """Whether the mode's float32 convolutions take TF32: as the default mode's do (cuDNN's
    `torch.backends.cudnn.allow_tf32`, on by default), so that the mode changes which bits a sample
    gets from the batch but not the precision it is computed at. (Its float32 matmuls follow
    `torch.backends.cuda.matmul.allow_tf32`, off by default: exact products.)"""
    return torch.backends.cudnn.allow_tf32


def sample_blocks(x: torch.Tensor, run, spans: tuple[int, ...] = ()) -> torch.Tensor:
    """run(block) [n, ...] -> [n, ...] over x [B, ...] in blocks of exactly GPU_SAMPLES samples: x
    zero-padded to a multiple of GPU_SAMPLES in a contiguous buffer starting on ALIGN bytes (x itself
    when it already is one); the outputs of the blocks joined, cut to B. Each call has one shape,
    strides and alignment, so cuDNN (deterministic, no benchmarking) runs one algorithm for it; that a
    sample's bits do not depend on its place in the block is what `samples_invariant` checks.
    `spans`: sample counts, largest first, that `samples_spans` found to give every sample the bits of
    its GPU_SAMPLES-sample call (eagerly and in CUDA graphs): while that many padded samples are left
    they go through one call of `span` samples (fewer launches), the rest GPU_SAMPLES at a time."""
    b = x.shape[0]
    padded = -(-b // GPU_SAMPLES) * GPU_SAMPLES
    if padded != b or not x.is_contiguous() or x.data_ptr() % ALIGN:
        x = padded_rows(x, padded, GPU_SAMPLES)
    outs, i = [], 0
    for span in spans:
        while padded - i >= span:
            outs.append(run(x[i:i + span]))
            i += span
    outs += [run(x[j:j + GPU_SAMPLES]) for j in range(i, padded, GPU_SAMPLES)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:b]


SAMPLE_SPANS = (64, 32)    # CUDA: samples one cuDNN call of a convolution may take instead of GPU_SAMPLES (checked)


def _sample_rand(g: torch.Generator, dtype: torch.dtype, device: torch.device):
    def rand(*size: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * scale).to(dtype)
    return rand


def _graph_replays(run, static: torch.Tensor, fills) -> list[torch.Tensor]:
    """run(static) captured in a CUDA graph (after an eager warm-up on a side stream, as the engines'
    GraphedSteps do); per fill: fill(static) in place, a replay, a copy of the output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static)
    torch.cuda.current_stream().wait_stream(side)
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph, capture_error_mode="thread_local"):
        out = run(static)
    got = []
    for fill in fills:
        fill(static)
        cuda_graph.replay()
        got.append(out.clone())
    del cuda_graph
    return got


def samples_invariant(run, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0,
                      graph: bool = True) -> bool:
    """Whether `sample_blocks(x, run)` gives a sample [*shape] the same bits wherever it sits: one
    target sample alone, then at every position of two calls (2 * GPU_SAMPLES samples) inside batches
    of every size past it, of random samples (scales 1e-2 .. 1e2); with `graph` on CUDA, also replayed
    in a CUDA graph of one GPU_SAMPLES-sample call (what the engines' steps replay), the target at
    several places. Any exception: False."""
    try:
        g = torch.Generator(device=device).manual_seed(seed)
        rand = _sample_rand(g, dtype, device)
        target = rand(*shape)
        alone = sample_blocks(target[None], run)[0]
        span = 2 * GPU_SAMPLES
        for p in range(span):
            b = p + 1 + int(torch.randint(0, span - p, (1,), generator=g, device=device))
            x = rand(b, *shape, scale=10.0 ** (p % 5 - 2))
            x[p] = target
            if not torch.equal(sample_blocks(x, run)[p], alone):
                return False
        if graph and device.type == "cuda":
            places = sorted({0, 1, GPU_SAMPLES // 2, GPU_SAMPLES - 1})

            def fill(p: int):
                def at(static: torch.Tensor) -> None:
                    static.copy_(rand(GPU_SAMPLES, *shape, scale=10.0 ** (p % 5 - 2)))
                    static[p] = target
                return at

            with torch.cuda.device(device):
                outs = _graph_replays(run, rand(GPU_SAMPLES, *shape), [fill(p) for p in places])
            if not all(torch.equal(out[p], alone) for p, out in zip(places, outs)):
                return False
        return True
    except Exception:
        log.exception("--deterministic: the cuDNN sample check of a convolution on %s failed to run", shape)
        return False


def samples_spans(run, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 1,
                  graph: bool = True) -> tuple[int, ...]:
    """The sample counts of SAMPLE_SPANS (largest first) for which one `run` call of that many samples
    gives every sample the bits of its GPU_SAMPLES-sample call (`sample_blocks` of the sample alone):
    a target sample at every position of the call (even positions, then odd ones) among random samples
    (scales 1e-2 .. 1e2, a new draw per call), eagerly and, with `graph` on CUDA, replayed in a CUDA
    graph of that call. cuDNN picks its kernel by the batch size too, so each count is checked on its
    own; one that fails (or raises) is left out, and its samples keep the GPU_SAMPLES-sample calls.
    Run only where `samples_invariant` held."""
    g = torch.Generator(device=device).manual_seed(seed)
    rand = _sample_rand(g, dtype, device)
    target = rand(*shape)
    try:
        alone = sample_blocks(target[None], run)[0]
    except Exception:
        log.exception("--deterministic: the cuDNN span check of a convolution on %s failed to run", shape)
        return ()
    found = []
    for span in SAMPLE_SPANS:
        if span <= GPU_SAMPLES or span % GPU_SAMPLES:
            continue
        scale = (10.0 ** (torch.arange(span, device=device) % 5 - 2)).view(span, *([1] * len(shape)))

        def fill(parity: int):
            def at(x: torch.Tensor) -> None:
                x.copy_((rand(span, *shape).float() * scale).to(dtype))
                x[parity::2] = target
            return at

        try:
            ok = True
            for parity in (0, 1):
                x = torch.empty(span, *shape, dtype=dtype, device=device)
                fill(parity)(x)
                ok = ok and torch.equal(run(x)[parity::2], alone.expand(span // 2, *alone.shape))
            if ok and graph and device.type == "cuda":
                with torch.cuda.device(device):
                    outs = _graph_replays(run, torch.zeros(span, *shape, dtype=dtype, device=device),
                                          [fill(0), fill(1)])
                ok = all(torch.equal(out[parity::2], alone.expand(span // 2, *alone.shape))
                         for parity, out in enumerate(outs))
        except Exception:
            log.exception("--deterministic: the %d-sample cuDNN check of a convolution on %s failed to run",
                          span, shape)
            ok = False
        if ok:
            found.append(span)
    return tuple(found)


def _cudnn_samples(conv: nn.Module, x: torch.Tensor, base: type) -> tuple[int, ...] | None:
    """How `conv` (in the mode) takes `sample_blocks` through cuDNN for input x: None where it does
    not (not on CUDA, GPU_CONV not "cudnn", or `samples_invariant` failed for its (layer, input)
    shape), else the spans `samples_spans` proved for the shape (empty: GPU_SAMPLES-sample calls
    only). Checked at the first such input and remembered in CONV_SHAPES / CONV_SPANS (one answer per
    shape for the process: a shape first met inside a CUDA graph capture, where nothing can be
    checked, keeps the Triton path, as every shape first met after CONV_SHAPES_MAX others)."""
    if GPU_CONV != "cudnn" or not x.is_cuda:
        return None
    key = (base.__name__, conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride, conv.dilation,
           conv.bias is not None, tuple(x.shape[1:]), x.dtype, x.device, torch.backends.cudnn.allow_tf32,
           torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    ok = CONV_SHAPES.get(key)
    if ok is None:
        if len(CONV_SHAPES) >= CONV_SHAPES_MAX:     # never recorded: the Triton path for this shape from now on
            return None
        spans: tuple[int, ...] = ()
        if torch.cuda.is_current_stream_capturing():
            ok = False
            log.warning("--deterministic: a convolution's input shape %s first met inside a CUDA graph capture: "
                        "it keeps the Triton path", tuple(x.shape[1:]))
        else:
            with torch.no_grad():
                plan = conv_plan(lambda b: base.forward(conv, b), tuple(x.shape[1:]), x.dtype, x.device)
            ok, spans = plan is not None, plan or ()
        CONV_SHAPES[key] = ok
        CONV_SPANS[key] = spans
    return CONV_SPANS.get(key, ()) if ok else None


def conv_plan(run, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[int, ...] | None:
    """What a convolution `run` takes for inputs [*shape]: None (the Triton path) where
    `samples_invariant` fails; else the spans `samples_spans` proves (empty: GPU_SAMPLES-sample calls
    only)."""
    if not samples_invariant(run, shape, dtype, device):
        log.warning("--deterministic: a convolution's samples depend on their place in cuDNN calls of %d "
                    "samples on this GPU (input %s): it keeps the Triton path", GPU_SAMPLES, shape)
        return None
    spans = samples_spans(run, shape, dtype, device) if SAMPLE_SPANS else ()
    if spans != tuple(s for s in SAMPLE_SPANS if s > GPU_SAMPLES and s % GPU_SAMPLES == 0):
        log.info("--deterministic: a convolution on %s takes cuDNN calls of %s samples", shape,
                 ", ".join(map(str, spans + (GPU_SAMPLES,))))
    return spans


def _plain(conv: nn.Module) -> bool:
    """No padding, stride (transposed: output padding, dilation) and no groups beyond what the rows
    forms below take."""
    return conv.padding_mode == "zeros" and all(p == 0 for p in conv.padding)


class InvariantConv1d(nn.Conv1d):
    """nn.Conv1d [B, Cin, L] -> [B, Cout, L'] with each sample's bits independent of the batch:
    - depthwise (groups == Cin == Cout): the taps summed in order in float32, elementwise (a product
      of two 16-bit numbers is exact in float32; each add rounds alike at any shape);
    - groups 1, stride 1, on CUDA: cuDNN calls of exactly GPU_SAMPLES samples (`sample_blocks`)
      where `samples_invariant` held for the input's shape (`_cudnn_samples`), else (or with
      VOXPIPE_INVARIANT_CONV=triton) im2col rows [B * L', Cin * K] through `linear`
      (kernels.invariant.matmul: fixed tiles, fixed K order), all samples at once;
    - else (the CPU, whose GEMMs round a row by the call's shape) one sample at a time."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, (d,) = self.kernel_size[0], self.dilation
        if _plain(self) and self.stride == (1,) and x.ndim == 3:
            if self.groups == self.in_channels == self.out_channels:
                return _depthwise(x, self.weight, self.bias, d)
            if self.groups == 1 and kernels.active(x):
                spans = _cudnn_samples(self, x, nn.Conv1d)
                if spans is not None:
                    return sample_blocks(x, lambda block: nn.Conv1d.forward(self, block), spans)
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
    (groups 1, no dilation / padding), where the Triton kernels launch: on CUDA cuDNN calls of exactly
    GPU_SAMPLES samples as InvariantConv1d's, where checked; else output block t (stride
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
            spans = _cudnn_samples(self, x, nn.ConvTranspose1d)
            if spans is not None:
                return sample_blocks(x, lambda block: nn.ConvTranspose1d.forward(self, block), spans)
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


def experts(module, x: torch.Tensor, top_idx: torch.Tensor, top_w: torch.Tensor, shared: torch.Tensor | None = None,
            shared_logit: torch.Tensor | None = None) -> torch.Tensor:
    """`layers.Experts`'s routed sum [T, H] with each token's bits independent of the others: on CUDA
    one fixed-tile grouped GEMM per projection (kernels.invariant.grouped); elsewhere each expert's
    rows through `linear`; the k weighted outputs summed in the token's own expert order; then, with a
    shared expert's rows `shared` [T, H] and gate logits [T, 1], + sigmoid(logit) * shared -- on the
    kernel path in the weighted sum's launch (one program per token and column block: the same
    computation for every token; it took 3 more launches), else as three elementwise ops."""
    t, k = top_idx.shape
    if kernels.active(x) and kernels.invariant.moe_eligible(x, top_idx, module.gate_up, module.down):
        y = kernels.invariant.moe(x, top_idx, module.gate_up, module.down)           # [T * K, H] pair order
        if kernels.invariant.weighted_sum_eligible(y, top_w, shared, shared_logit):   # one launch
            return kernels.invariant.weighted_sum(y, top_w, shared, shared_logit)
        if kernels.invariant.weighted_sum_eligible(y, top_w):     # the sum below in one launch, same bits
            out = kernels.invariant.weighted_sum(y, top_w)
            return out if shared is None else out + sigmoid(shared_logit) * shared
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
    out = ordered_sum(y.view(t, k, -1) * top_w[..., None].to(y.dtype), 1)    # top-k rank order
    return out if shared is None else out + sigmoid(shared_logit) * shared


_CLASSES = {nn.Linear: InvariantLinear, nn.Conv1d: InvariantConv1d, nn.ConvTranspose1d: InvariantConvTranspose1d}


def apply(model: nn.Module) -> nn.Module:
    """Put `model` (loaded, laid out for serving) in batch-invariant mode, in place; returns it.
    Modules with an `invariant` attribute (attention, experts, the models' fixed-order sums) get
    True. On CUDA the mode needs the Triton kernels (ValueError when VOXPIPE_KERNELS=0 or Triton is
    missing): torch's own CUDA ops choose their algorithms by shape."""
    on_cuda = any(p.is_cuda for p in model.parameters())
    if on_cuda and not (kernels.ENABLED and _triton_available()):
        raise ValueError("--deterministic on CUDA needs the Triton kernels (Triton installed, VOXPIPE_KERNELS not 0)")
    if GPU_MATMUL not in GPU_MATMULS:
        raise ValueError(f"VOXPIPE_INVARIANT_MATMUL={GPU_MATMUL!r}: expected one of {', '.join(GPU_MATMULS)}")
    if GPU_CONV not in GPU_CONVS:
        raise ValueError(f"VOXPIPE_INVARIANT_CONV={GPU_CONV!r}: expected one of {', '.join(GPU_CONVS)}")
    if on_cuda:
        torch.backends.cudnn.deterministic = True       # one convolution algorithm per shape, no atomics
        torch.backends.cudnn.benchmark = False
    checked: dict[tuple, bool] = {}
    for m in model.modules():
        swap = _CLASSES.get(type(m))
        if swap is not None:
            m.__class__ = swap
            if swap is InvariantConvTranspose1d:
                m.prepare()
            if swap is InvariantLinear and m.weight.is_cuda:
                plan = _rows_checked(m.weight, m.bias, checked) if GPU_MATMUL == "cublas" else None
                m.cublas_rows = plan is not None
                m.row_batches, m.graph_batches = plan or ((), ())
                path = "cublas" if m.cublas_rows else "triton"
                LINEAR_PATHS[path] = LINEAR_PATHS.get(path, 0) + 1
                if m.row_batches:
                    LINEAR_PATHS["batched"] = LINEAR_PATHS.get("batched", 0) + 1
                if m.graph_batches:
                    LINEAR_PATHS["graph_batched"] = LINEAR_PATHS.get("graph_batched", 0) + 1
        if hasattr(m, "invariant"):
            m.invariant = True
        if getattr(m, "act", None) is F.silu:       # GatedMLP, the talker's ResizeMLP
            m.act = silu
    return model


Plan = tuple[tuple[int, str], ...]


def _rows_checked(weight: torch.Tensor, bias: torch.Tensor | None,
                  checked: dict[tuple, tuple[Plan, Plan] | None]) -> tuple[Plan, Plan] | None:
    """`rows_invariant`, then `batches_invariant`, then `batches_graphed`, once per layer shape (what
    cuBLAS picks its algorithm by: shapes, dtypes, the weight's alignment, the math-mode flags): None
    where the rows failed (the layer keeps the Triton kernel), else the batched plans for `rows_linear`
    (eager, captured). The seconds they took add up in CHECK_S."""
    matmul = torch.backends.cuda.matmul
    key = (tuple(weight.shape), weight.stride(), weight.dtype, weight.device, weight.data_ptr() % ALIGN,
           None if bias is None else (bias.dtype, bias.stride(), bias.data_ptr() % ALIGN), matmul.allow_tf32,
           matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    if key not in checked:
        start = time.perf_counter()
        with torch.no_grad():
            if rows_invariant(weight, bias):
                plan = batches_invariant(weight, bias)
                checked[key] = (plan, batches_graphed(weight, bias, plan))
            else:
                checked[key] = None
        CHECK_S["rows"] = CHECK_S.get("rows", 0.0) + time.perf_counter() - start
        if checked[key] is None:
            log.warning("--deterministic: a [%d, %d] linear's rows depend on their position in cuBLAS calls "
                        "of %d rows on this GPU: it keeps the Triton kernel", *weight.shape, GPU_ROWS)
        else:
            plan, graphed = checked[key]
            log.info("--deterministic: a [%d, %d] linear's prefill launches: %s (in CUDA graphs: %s)", *weight.shape,
                     ", ".join(f"{b} x {GPU_ROWS} rows ({how})" for b, how in plan) or f"{GPU_ROWS} rows each",
                     ", ".join(f"{b} x {GPU_ROWS}" for b, _ in graphed) or f"{GPU_ROWS} rows each")
    return checked[key]


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
