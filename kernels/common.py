"""What every kernel's `run()` checks before launching Triton.

A kernel is launched only when Triton imports, `voxpipe.kernels.ENABLED` is true, no autograd is
needed, and the tensors are all on one CUDA device -- or on the CPU when Triton's interpreter is on
(`TRITON_INTERPRET=1` in the environment before Triton was imported; used by the CPU tests).
Layout (contiguity), dtype and shape rules are each kernel's own `eligible()`.
"""

from __future__ import annotations

import contextlib
import os

import torch

import voxpipe.kernels as package

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs need not have Triton: every run() then uses the reference
    triton = tl = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"   # as triton.jit read it at decoration time
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def launchable(*tensors: torch.Tensor) -> bool:
    """True if Triton can run on these tensors (see the module docstring)."""
    if triton is None or not package.ENABLED:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    device = tensors[0].device
    if device.type != "cuda" and not (INTERPRET and device.type == "cpu"):
        return False
    return all(t.device == device for t in tensors)


def device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device: make it t's (a stage may run on cuda:N)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


round_to = None   # a Triton function when Triton is installed (below)

if triton is not None:
    @triton.jit
    def round_to(x, dtype: tl.constexpr):
        """float32 -> dtype with round-to-nearest-even. For bfloat16 the rounding is done on the bits:
        the GPU's own conversion is RNE too, but Triton's CPU interpreter truncates, and the tests
        must check on the CPU exactly what runs on the GPU."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            rounded = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            return tl.where(x != x, x.to(tl.bfloat16), rounded)   # NaN stays NaN
        else:
            return x.to(dtype)
