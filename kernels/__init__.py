"""Triton kernels for the hot elementwise / reduction paths, each beside a plain-PyTorch `reference()`
with the same contract (see each module's docstring):

- `rmsnorm`: RMSNorm and fused "residual add + RMSNorm" (decoder pre-norm pattern)
- `snakebeta`: Code2Wav's SnakeBeta activation over [B, C, T]
- `sampling`: greedy "suppress mask + banned id + argmax" over [B, V] logits
- `sample`: per-row temperature / top-k / top-p and a draw with given noise (or argmax), over [B, V]
- `rope`: per-head q/k RMSNorm + rotary embedding, fused and in place
- `moe`: MoE routing (float32 softmax + top-k + renormalisation) in one launch
- `glu`: SwiGLU (silu(gate) * up) on a fused gate/up projection output
- `normlinear`: residual add + RMSNorm + the projection that reads it (+ SwiGLU) for a decode
  step's few rows, in one launch (`VOXPIPE_NORM_LINEAR=1`: the layers use it; see runtime/layers.py)
- `attention`: a few new tokens over a short cache (the code predictor), cache append fused in
- `paged_attention`: attention over the paged KV cache read in place through block tables (decode,
  and prefill extending a cached prefix), split over positions with an in-order merge
- `experts`: routed MoE experts for a few tokens (gate/up GEMV + SwiGLU, down GEMV + weighted sum +
  shared expert) in three launches straight from the router's top-k
- `invariant`: batch-invariant matmul, routed experts and masked attention (fixed tiles, fixed
  reduction order) for `--deterministic` (services/runtime/determinism.py)

Every module has `reference(...)`, `kernel(...)` (Triton) and `run(...)` which launches the kernel
for eligible inputs and falls back to `reference` otherwise. Importing this package does not import
Triton; a submodule is loaded on first attribute access (`voxpipe.kernels.rmsnorm`).

`ENABLED` is the module-level switch the layers check (through `active(t)`) before dispatching CUDA
tensors here (default True; environment `VOXPIPE_KERNELS=0` turns it off). `run()` honours it too.
"""

from __future__ import annotations

import importlib
import os

ENABLED: bool = os.environ.get("VOXPIPE_KERNELS", "1") != "0"
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"   # Triton's CPU interpreter (tests)


def active(t) -> bool:
    """Whether the layers send tensor `t`'s work to these kernels: ENABLED, and `t` on a CUDA device
    (or on the CPU under Triton's interpreter, so the CPU tests can run the layers' kernel path)."""
    return ENABLED and (t.is_cuda or (INTERPRET and t.device.type == "cpu"))

KERNEL_MODULES = ("rmsnorm", "snakebeta", "sampling", "sample", "rope", "moe", "glu", "normlinear", "attention",
                  "experts", "invariant", "paged_attention")


def __getattr__(name: str):
    if name in KERNEL_MODULES:
        return importlib.import_module(f"{__name__}.{name}")  # importing sets the attribute for next time
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
