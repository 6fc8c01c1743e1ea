"""Batched token choice: `sample_rows` (what the thinker's step and the talker's code 0 and code
predictor run, the predictor inside its CUDA graph) equals `pick` -- transformers' processors then
torch.multinomial -- row by row, for every mix of greedy and sampled rows, and a row's choice never
depends on the rows beside it. Exactness against transformers' own sampling through real
processes is in test_tts.py (seeded speech)."""

from __future__ import annotations

import torch

from voxpipe.services.runtime.sampling import (RowSampling, SamplingParams, apply_repetition_penalty, exponential_noise,
                                              penalize_seen, pick, sample_rows)

V = 300
PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.5, top_k=40, top_p=0.9),
    SamplingParams(temperature=100.0),
    SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=0.9, top_k=10 * V),          # k beyond the vocabulary: no top-k
    SamplingParams(temperature=1.0, top_p=1e-6),           # top-p keeps the best id only
]


def _logits(seed: int) -> list[torch.Tensor]:
    """Rows of every kind a step meets: plain, bfloat16-rounded (ties, also at the k-th value),
    mostly masked, and non-finite ones."""
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(V, generator=g) * 3
    ties = plain.to(torch.bfloat16).float().clamp(-2, 2)
    masked = torch.full((V,), float("-inf"))
    masked[torch.randperm(V, generator=g)[:7]] = torch.randn(7, generator=g)
    nan, pos_inf = plain.clone(), plain.clone()
    nan[3], pos_inf[5] = float("nan"), float("inf")
    huge = plain * 1e37          # finite, but / temperature overflows for small temperatures
    return [plain, ties, masked, nan, pos_inf, torch.full((V,), float("-inf")), huge]


def test_sample_rows_equals_pick_row_by_row():
    rows, params, seeds = [], [], []
    for s in range(3):
        for logits in _logits(s):
            for p in PARAMS:
                rows.append(logits)
                params.append(p)
                seeds.append(len(seeds))
    logits = torch.stack(rows)
    noise = exponential_noise([None if p.greedy else torch.Generator().manual_seed(k) for p, k in zip(params, seeds)],
                              V, "cpu")
    ids, ok = sample_rows(logits.clone(), RowSampling.of(params, V, "cpu"), noise)
    for b, (row, p, k) in enumerate(zip(rows, params, seeds)):
        want, want_ok = pick(row.clone(), p, None if p.greedy else torch.Generator().manual_seed(k))
        assert bool(ok[b]) == bool(want_ok), (b, p)
        if want_ok:
            assert int(ids[b]) == int(want), (b, p)
    assert 0 < int(ok.sum()) < len(rows)
    # a row's choice is its own: any sub-batch, in any order, chooses the same
    sub = torch.tensor([40, 3, 17, 99, 0, 150])
    sub_ids, sub_ok = sample_rows(logits[sub], RowSampling.of([params[i] for i in sub], V, "cpu"), noise[sub])
    assert torch.equal(sub_ids, ids[sub]) and torch.equal(sub_ok, ok[sub])


def test_sampled_rows_follow_their_distribution():
    """Many draws of one sampled row against the probabilities top-k / top-p leave it."""
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0, -3.0])
    p = SamplingParams(temperature=0.8, top_k=4, top_p=0.9)
    n = 20000
    gens = [torch.Generator().manual_seed(k) for k in range(n)]
    ids, ok = sample_rows(logits.expand(n, -1).clone(), RowSampling.of([p] * n, 6, "cpu"),
                          exponential_noise(gens, 6, "cpu"))
    assert bool(ok.all())
    probs = (logits / 0.8)[:4].softmax(-1)
    keep = probs.cumsum(-1) - probs < 0.9            # top-p after top-k: the smallest set reaching 0.9
    probs = torch.where(keep, probs, 0.0)
    probs = probs / probs.sum()
    counts = torch.bincount(ids, minlength=6).float() / n
    assert torch.allclose(counts[:4], probs, atol=0.015), (counts, probs)
    assert counts[4:].sum() == 0


def test_exponential_noise_is_each_generators_own_draw():
    gens = [None, torch.Generator().manual_seed(5), None, torch.Generator().manual_seed(6)]
    noise = exponential_noise(gens, 50, "cpu")
    assert torch.equal(noise[0], torch.ones(50)) and torch.equal(noise[2], torch.ones(50))
    for row, seed in ((1, 5), (3, 6)):
        assert torch.equal(noise[row], torch.empty(50).exponential_(1, generator=torch.Generator().manual_seed(seed)))


def test_a_penalty_over_a_mask_of_seen_ids_equals_the_gather_over_every_id():
    """penalize_seen (a request's seen ids kept as a mask) gives apply_repetition_penalty's values
    (the ids gathered from the whole context, repeats among them), bit for bit, non-finite scores too."""
    g = torch.Generator().manual_seed(5)
    for seed, penalty in ((0, 1.3), (1, 0.7), (2, 1.0), (3, 100.0)):
        logits = torch.randn(V, generator=g) * 4
        logits[:3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
        logits[3] = 0.0
        previous = torch.randint(0, V, (seed * 40 + 1,), generator=g)
        previous = torch.cat((previous, previous[:5], torch.tensor([0, 1, 2, 3])))
        seen = torch.zeros(V, dtype=torch.bool)
        seen[previous] = True
        want = apply_repetition_penalty(logits.clone(), previous, penalty)
        torch.testing.assert_close(penalize_seen(logits.clone(), seen, penalty), want, rtol=0, atol=0, equal_nan=True)
    none = torch.zeros(V, dtype=torch.bool)
    torch.testing.assert_close(penalize_seen(logits, none, 1.5), logits, rtol=0, atol=0, equal_nan=True)
