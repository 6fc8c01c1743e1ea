"""Code2Wav model runner: the decoder on its device, the per-slot stream state, and a step's decode.

A step runs frame by frame, batched across utterances: one first-frame decode for the utterances
starting now, then rounds of the one-frame decode, round r over the utterances with more than r new
frames -- CUDA-graph replays on the GPU, the same functions eagerly elsewhere. The streaming decoder
is exact, so this equals decoding any chunking at once; decoding one frame at a time also makes an
utterance's samples independent of how its frames happened to arrive."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..runtime.config import Code2WavConfig
from ..runtime.cuda_graphs import GraphedStep, buckets, captured, graphs_available
from ..runtime.sampling import finite_rows
from .model import Code2WavModel, StreamStore


class FrameWork(NamedTuple):
    """One utterance's share of a step."""

    slot: int
    start: int                       # frames it decoded before this step (0: its first frame is here)
    frames: list[torch.Tensor]       # [Q] int64 codes each, in order


def _checked(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unclamped samples [n, S] -> (samples clamped to [-1, 1] [n, S], the row was finite [n] bool);
    inside the captured step, so the flag costs no host sync of its own."""
    return raw.clamp(-1.0, 1.0), finite_rows(raw)


class Code2WavRunner:
    def __init__(self, model: Code2WavModel, cfg: Code2WavConfig, *, device: torch.device, max_active: int,
                 cuda_graphs: bool = True, eager_fallback: bool = False) -> None:
        self.model, self.cfg, self.device = model, cfg, device
        dtype = next(model.parameters()).dtype
        self.store = StreamStore(model, max_active, dtype, device)
        self.graphs = self.first_graphs = None
        if cuda_graphs and graphs_available(device):
            q = cfg.num_quantizers
            example = (torch.zeros(max_active, q, 1, dtype=torch.long, device=device),
                       torch.full((max_active,), self.store.scratch, dtype=torch.long, device=device),
                       torch.zeros(max_active, dtype=torch.long, device=device))
            pad = (None, self.store.scratch, None)
            with torch.inference_mode():
                self.graphs = captured("code2wav one-frame step", lambda: GraphedStep(
                    self._frame_fn, example, buckets(max_active), [1], "code2wav one-frame step", pad=pad),
                    eager_fallback)
                self.first_graphs = captured("code2wav first frame", lambda: GraphedStep(
                    self._first_fn, example, buckets(max_active), [1], "code2wav first frame", pad=pad),
                    eager_fallback)

    def _frame_fn(self, n: int, _kv: int, codes: torch.Tensor, slots: torch.Tensor,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One new frame for each of n utterances past their first chunk: codes [n, Q, 1]."""
        return _checked(self.model.decode_unclamped(codes, slots, start, self.store, first=False))

    def _first_fn(self, n: int, _kv: int, codes: torch.Tensor, slots: torch.Tensor,
                  start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The first frame of n new utterances: codes [n, Q, 1]."""
        return _checked(self.model.decode_unclamped(codes, slots, start, self.store, first=True))

    # ---- slots
    @property
    def free_slots(self) -> int:
        return self.store.free_slots

    def allocate(self) -> int:
        return self.store.allocate()

    def release(self, slot: int) -> None:
        self.store.release(slot)

    def scrub(self, slot: int) -> None:
        """Zero the slot's state: an utterance's non-finite numbers must not reach the slot's next one."""
        self.store.scrub(slot)

    # ---- a step
    def decode(self, work: list[FrameWork]) -> tuple[list[np.ndarray], list[bool]]:
        """Frame by frame (first frames, then rounds); one copy to the host. Per utterance: its new
        samples [n] float32, and whether all of them were finite."""
        dev = self.device
        done = [0] * len(work)
        outputs: list[torch.Tensor] = []                   # one [rows, samples] per replay
        finite: list[torch.Tensor] = []                    # one [rows] float32 (1.0: finite) per replay
        pieces: list[list[tuple[int, int]]] = [[] for _ in work]   # per utterance: (replay, row)
        first = [i for i, u in enumerate(work) if u.start == 0]
        first_fn = self.first_graphs if self.first_graphs is not None else self._first_fn
        frame_fn = self.graphs if self.graphs is not None else self._frame_fn
        batch = (first_fn, first) if first else None
        while True:
            if batch is None:
                rows = [i for i, u in enumerate(work) if done[i] < len(u.frames)]
                if not rows:
                    break
                batch = (frame_fn, rows)
            step, rows = batch
            batch = None
            codes = torch.stack([work[i].frames[done[i]] for i in rows])[:, :, None].to(dev, non_blocking=True)
            slots = torch.tensor([work[i].slot for i in rows]).to(dev, non_blocking=True)
            start = torch.tensor([work[i].start + done[i] for i in rows]).to(dev, non_blocking=True)
            wav, ok = step(len(rows), 1, codes, slots, start)
            outputs.append(wav.to(torch.float32, copy=True))   # a graph's next replay overwrites `wav`
            finite.append(ok.to(torch.float32))                # a copy too
            for r, i in enumerate(rows):
                pieces[i].append((len(outputs) - 1, r))
                done[i] += 1
        flat = torch.cat([o.flatten() for o in outputs + finite]).cpu()
        host = [h.numpy() for h in flat.split([o.numel() for o in outputs + finite])]
        host, ok = [h.reshape(o.shape) for h, o in zip(host, outputs)], host[len(outputs):]
        return ([np.concatenate([host[k][r] for k, r in p]) for p in pieces],
                [all(ok[k][r] == 1.0 for k, r in p) for p in pieces])
