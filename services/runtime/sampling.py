"""Token choice: logits processors (as transformers applies them) then argmax or sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from voxpipe.v1 import stages_pb2 as pb


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # 0: greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @classmethod
    def from_proto(cls, msg: pb.Sampling, *, default_repetition_penalty: float = 1.0) -> "SamplingParams":
        p = cls(
            temperature=msg.temperature if msg.HasField("temperature") else 0.0,
            top_k=msg.top_k if msg.HasField("top_k") else 0,
            top_p=msg.top_p if msg.HasField("top_p") else 1.0,
            seed=msg.seed if msg.HasField("seed") else None,
            repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else default_repetition_penalty,
        )
        p.validate()
        return p

    def validate(self) -> None:
        if not (self.temperature >= 0.0) or self.temperature > 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.repetition_penalty > 0.0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def apply_repetition_penalty(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V], previous [n] ids: divide positive / multiply negative scores of seen ids."""
    if penalty == 1.0 or previous.numel() == 0:
        return logits
    seen = logits.gather(0, previous)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(0, previous, seen)


def choose(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token from processed logits [V] (float32)."""
    if params.greedy:
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - params.top_p)
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
