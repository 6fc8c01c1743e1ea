"""Token choice: logits processors (as transformers applies them) then argmax or sampling; and the
limits on the values a request brings to a stage (every stage checks its own requests: the gRPC
stage API is public).

Batched choice: `RowSampling` carries each row's values as tensors and `sample_rows` applies them to
[B, V] logits in one set of kernels whatever the mix of greedy and sampled rows, so that it can run
inside a CUDA graph. Randomness comes in as exponential noise drawn from each row's own generator
(`exponential_noise`): torch.multinomial draws one sample as argmax(probs / q) with q ~ Exp(1), so
a row sampled with noise drawn from its generator equals `pick` with that generator, and a row's
draws never depend on the rows beside it.

Per-row guards: `finite_rows` and `pick` compute, on the device and without a host sync, whether a
row's numbers are usable, so that an engine reads that flag together with the ids it already copies
to the host and finishes only the row that went non-finite."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from voxpipe import kernels
from voxpipe.v1 import stages_pb2 as pb

from .tensors import TensorError

MAX_TEMPERATURE = 100.0
# Temperatures in (0, GREEDY_BELOW) choose by argmax, as temperature 0 does: logits / T could
# overflow float32 to inf for them (then softmax is NaN), and sampling at such a temperature is
# argmax anyway but for exact ties. Above it, |logits| up to 3e33 divide without overflow (the
# final RMSNorm keeps a model's logits many orders of magnitude below that).
GREEDY_BELOW = 1e-5
# Dividing (or multiplying) seen logits by a penalty outside this range is no longer a penalty but
# a way to overflow them.
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# |value| bounds on the float tensors a request brings in. Model-made values are far below them:
# Whisper log-mel features lie in about [-1.5, 1.5]; the thinker's embeddings and hidden rows are
# at most in the thousands. Beyond them a model's first layers can overflow (bfloat16 and float32
# end at ~3.4e38, float16 at 65504).
MAX_AUDIO_FEATURE = 1e3
MAX_ROW_VALUE = 1e5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0          # below GREEDY_BELOW (0 included): greedy
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_proto(cls, msg: pb.Sampling, *, default_repetition_penalty: float = 1.0) -> "SamplingParams":
        """The request's sampling values, validated (ValueError naming the field)."""
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
        """ValueError naming the field for a value out of range (NaN fails every comparison)."""
        if not (0.0 <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not (lo <= self.repetition_penalty <= hi):
            raise ValueError(f"repetition_penalty must be in [{lo:g}, {hi:g}], got {self.repetition_penalty}")

    def generator(self, device: torch.device | str) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator(device=device)
        if self.seed is not None:
            g.manual_seed(self.seed)
        else:
            g.seed()
        return g


def check_features(x: torch.Tensor, name: str, bound: float) -> None:
    """TensorError (a ValueError) naming `name` unless every value of the float tensor `x` is
    finite with |value| <= bound."""
    if x.numel() == 0:
        return
    lo, hi = torch.aminmax(x.detach())             # one pass, no |x| copy; NaN if any value is
    top = float(torch.maximum(-lo, hi))            # max |value| (maximum keeps a NaN)
    if not math.isfinite(top):
        raise TensorError(f"{name} contains NaN or infinity")
    if top > bound:
        raise TensorError(f"{name} has values of magnitude {top:.3g}, beyond the limit of {bound:g}")


def check_audio_features(audio: list[torch.Tensor]) -> None:
    """Every audio feature tensor finite within MAX_AUDIO_FEATURE (TensorError naming audio_features[i])."""
    for i, a in enumerate(audio):
        check_features(a, f"audio_features[{i}]", MAX_AUDIO_FEATURE)


def finite_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, ...] -> [B] bool: the row holds no NaN or infinity. On the device, no host sync."""
    return torch.isfinite(x).flatten(1).all(1)


def apply_repetition_penalty(logits: torch.Tensor, previous: torch.Tensor, penalty: float) -> torch.Tensor:
    """logits [V], previous [n] ids: divide positive / multiply negative scores of seen ids."""
    if penalty == 1.0 or previous.numel() == 0:
        return logits
    seen = logits.gather(0, previous)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(0, previous, seen)


def penalize_seen(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """apply_repetition_penalty with the seen ids as a mask (seen [V] bool): each seen score divided /
    multiplied once, the same values; a request keeps its mask and marks new ids in it, instead of
    gathering over its whole context at every step."""
    if penalty == 1.0:
        return logits
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def pick(logits: torch.Tensor, params: SamplingParams,
         generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token from processed logits [V] (float32; -inf marks an id masked out) and whether the
    choice is meaningful: (token [] int64, ok [] bool), both on the device, no host sync.
    `ok` is False when the scores hold NaN or +inf or nothing but -inf (a non-finite row, or
    logits / T overflowing); such a row draws from a stand-in distribution (all mass on id 0)
    rather than raising, so that its batch goes on, and its caller drops the token."""
    if params.greedy:
        return torch.argmax(logits), torch.isfinite(logits.max())
    scores = logits / params.temperature
    ok = torch.isfinite(scores.max())           # max is NaN if any score is
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, stable=True)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        drop = cum <= (1 - params.top_p)
        drop[-1] = False
        scores = scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    stand_in = torch.zeros_like(probs)
    stand_in[0] = 1.0
    probs = torch.where(ok, probs, stand_in)
    return torch.multinomial(probs, 1, generator=generator)[0], ok


@dataclass
class RowSampling:
    """Per-row sampling values as tensors on one device, [B] each (`of` builds them)."""

    greedy: torch.Tensor        # bool: argmax of the logits (temperature below GREEDY_BELOW)
    temperature: torch.Tensor   # float32: the divisor of the logits (1 for greedy rows)
    top_k: torch.Tensor         # int64 in [1, V]: V where top-k is off
    drop_below: torch.Tensor    # float32: 1 - top_p, computed in double as `pick` does (0: top-p off)

    @classmethod
    def of(cls, params: list[SamplingParams], vocab: int, device: torch.device | str) -> "RowSampling":
        host = torch.tensor([[p.greedy, p.temperature if not p.greedy else 1.0,
                              min(p.top_k, vocab) if p.top_k > 0 else vocab,
                              1 - p.top_p if p.top_p < 1.0 else 0.0] for p in params], dtype=torch.float64)
        host = host.to(device, non_blocking=True)
        return cls(host[:, 0] != 0, host[:, 1].float(), host[:, 2].long(), host[:, 3].float())

    @classmethod
    def empty(cls, n: int, device: torch.device | str) -> "RowSampling":
        """Greedy rows: a CUDA graph's static inputs."""
        return cls(torch.ones(n, dtype=torch.bool, device=device), torch.ones(n, device=device),
                   torch.ones(n, dtype=torch.long, device=device), torch.zeros(n, device=device))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.greedy, self.temperature, self.top_k, self.drop_below


def exponential_noise(generators: list[torch.Generator | None], width: int,
                      device: torch.device | str) -> torch.Tensor:
    """[B, width] float32: row b drawn from Exp(1) with generators[b] (one launch a row); rows
    without a generator (greedy) are 1."""
    noise = torch.ones(len(generators), width, device=device)
    for row, g in zip(noise, generators):
        if g is not None:
            row.exponential_(1, generator=g)
    return noise


def sample_rows(logits: torch.Tensor, rows: RowSampling, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pick` for every row of logits [B, V] float32 at once, with static shapes and no host sync
    (CUDA-graph safe): (ids [B] int64, ok [B] bool). A sampled row takes its randomness from
    noise [B, V] (Exp(1) draws, `exponential_noise`): it equals `pick` whose generator would have
    drawn that noise. Greedy rows take the argmax of their logits and ignore the noise. One Triton
    launch on CUDA (kernels/sample.py, whose `reference` is the PyTorch form)."""
    return kernels.sample.run(logits, *rows.tensors(), noise)
