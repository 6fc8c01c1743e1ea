"""CUDA graphs for engine steps: one graph per (batch bucket, length bucket), captured at start into
one shared memory pool, largest first; a step replays the smallest bucket that fits (padding rows
compute garbage that nobody reads). Decode steps bucket the attended KV length; prefills bucket
the padded prompt length.

Graph plans off the GPU: with `VOXPIPE_EMULATE_GRAPHS=1` (read at import; tests set `EMULATE`) the
engines build their GraphedSteps on any device, and a "replay" runs the captured function eagerly
on the same static, padded, bucketed inputs. Everything about a step's plan -- buckets, padding
rows, pad values, the corner copies -- then runs on the CPU exactly as it does on the GPU; only the
capture itself is not exercised."""

from __future__ import annotations

import bisect
import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)


EMULATE = os.environ.get("VOXPIPE_EMULATE_GRAPHS", "0") == "1"


class GraphCaptureError(RuntimeError):
    """A step's CUDA graphs could not be captured and eager fallback was not asked for."""


def captured(what: str, capture: Callable[[], object], eager_fallback: bool) -> object | None:
    """`capture()`, or -- when it fails -- GraphCaptureError (a service should not start slower than
    it was sized for without saying so), or None with `eager_fallback` (the step then runs eagerly)."""
    try:
        return capture()
    except Exception as e:
        if not eager_fallback:
            raise GraphCaptureError(f"{what}: CUDA graph capture failed: {e!r}; start with --eager-fallback "
                                    "to run it eagerly instead") from e
        log.exception("%s: CUDA graph capture failed; running it eagerly (--eager-fallback)", what)
        return None


def capture_stream() -> "torch.cuda.Stream | None":
    """The stream graphs are captured on: the thread's current stream when it is not the default one
    (a colocated stage builds on its own stream of its priority, services/runtime/colocate.py), else
    None (torch's own capture stream). A graph replays on the stream it is launched on, with that
    stream's priority, wherever it was captured; capturing on the stage's stream keeps every kernel
    of the stage on it."""
    current = torch.cuda.current_stream()
    return None if current == torch.cuda.default_stream(current.device) else current


def graphs_available(device: torch.device) -> bool:
    """Whether engines on `device` build GraphedSteps (CUDA, or anywhere under EMULATE)."""
    return device.type == "cuda" or EMULATE


def buckets(limit: int, first: int = 1) -> list[int]:
    """first, 2*first, 4*first, ... up to and including `limit`."""
    out, b = [], first
    while b < limit:
        out.append(b)
        b *= 2
    out.append(limit)
    return out


def fine_buckets(limit: int, first: int = 1, per_octave: int = 4) -> list[int]:
    """Buckets with `per_octave` steps in each doubling, so that a replay pads by less than
    1 / per_octave of what it holds: steps of `first` up to 2 * per_octave * first, then steps that
    double with each octave (first 32: 32, 64, ..., 256, 320, 384, 448, 512, 640, ...; first 1, two
    per octave: 1, 2, 3, 4, 6, 8), up to and including `limit`. For steps whose cost grows with the
    padding (a prompt's new tokens: every padding query attends the whole context), where powers of
    two would pad a 258-token turn to 512."""
    out, b, step = [], first, first
    while b < limit:
        out.append(b)
        if b >= 2 * per_octave * step:
            step *= 2
        b += step
    out.append(limit)
    return out


class GraphedStep:
    """`fn(n, kv_len, *inputs) -> tuple of tensors` captured for each n in `batch_sizes` and each
    kv_len in `kv_lens`. `inputs` are tensors whose first dimension is the batch; a call may pass
    smaller ones in any dimension (they are copied into the leading corner of the captured inputs,
    e.g. a prompt batch [n, s, H] into [N, S_max, H])."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], example: tuple[torch.Tensor, ...],
                 batch_sizes: list[int], kv_lens: list[int], name: str, pad: tuple | None = None,
                 pool: tuple | None = None) -> None:
        """`pad`: per input, a value the rows past the real batch are set to before a replay (None:
        leave whatever the last replay left there). `pool`: the memory pool of another GraphedStep
        (its `pool`) whose replays never overlap these (one engine thread, one stream): the graphs'
        working memory is shared, their outputs stay their own; None: a pool of its own."""
        self.fn, self.name = fn, name
        self.pad = pad or (None,) * len(example)
        self.batch_sizes, self.kv_lens = sorted(batch_sizes), sorted(kv_lens)
        self.static = tuple(t.clone() for t in example)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool = pool
        self.emulated = self.static[0].device.type != "cuda"
        self.replays = 0          # calls so far (emulated ones too)
        if self.emulated:
            return
        t0 = time.perf_counter()
        with torch.cuda.device(self.static[0].device):   # streams and the pool on the inputs' GPU
            self._capture(fn)
        log.info("%s: captured %d CUDA graphs in %.1f s", name, len(self.graphs), time.perf_counter() - t0)

    def _capture(self, fn: Callable[..., tuple[torch.Tensor, ...]]) -> None:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        pool, stream = self.pool, capture_stream()
        for n in reversed(self.batch_sizes):
            for kv in reversed(self.kv_lens):
                ins = tuple(t[:n] for t in self.static)
                side = torch.cuda.Stream(priority=torch.cuda.current_stream().priority)   # the warm-up run
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn(n, kv, *ins)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = fn(n, kv, *ins)
                self.graphs[(n, kv)] = (graph, out)
        torch.cuda.synchronize()

    def scrub(self) -> None:
        """Zero the float static inputs (after a request's numbers went non-finite): a replay's
        padding (rows past the batch, positions past a prompt) computes on what earlier replays
        left there, and huge or non-finite leftovers would write NaN where a later request's
        attention reads under a False mask. Index inputs keep their valid ids and slots."""
        for t in self.static:
            if t.is_floating_point():
                t.zero_()

    def fits(self, n: int, kv_len: int) -> bool:
        return n <= self.batch_sizes[-1] and kv_len <= self.kv_lens[-1]

    def __call__(self, n: int, kv_len: int, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        nb = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        kb = self.kv_lens[bisect.bisect_left(self.kv_lens, kv_len)]
        self.replays += 1
        for dst, src, fill in zip(self.static, inputs, self.pad):
            dst[tuple(slice(0, d) for d in src.shape)].copy_(src, non_blocking=True)
            if fill is not None and nb > n:
                dst[n:nb].fill_(fill)
        if self.emulated:
            out = self.fn(nb, kb, *(t[:nb] for t in self.static))
        else:
            graph, out = self.graphs[(nb, kb)]
            graph.replay()
        return tuple(o[:n] for o in out)
