"""The engines' CUDA-graph step plans, run on the CPU: with graph emulation on
(services.runtime.cuda_graphs.EMULATE) every stage builds its GraphedSteps and each "replay" runs
the captured function eagerly on the static, padded, bucketed inputs -- the thinker's prefill
(batch x length buckets) and decode (batch x KV-length buckets, padding rows), the talker's prefill,
step and 15-pass predictor, code2wav's first-frame and one-frame steps (padding rows on the scratch
slot). Only the capture itself is left to the GPU checks (bench/gpu_check.py). Each request must get
what the plain eager engines give it, alone and when requests share steps."""

from __future__ import annotations

import asyncio

import pytest
import torch

from test_batching import PROMPTS, _collect, _request
from voxpipe.bench.inprocess import InProcessPipeline
from voxpipe.services.runtime import cuda_graphs


def _pipeline(tiny_model_dir, emulate: bool, monkeypatch) -> InProcessPipeline:
    monkeypatch.setattr(cuda_graphs, "EMULATE", emulate)
    return InProcessPipeline.from_argv(["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"],
                                       stage_argv={"thinker": ["--prefill-chunk", "24"]})


def test_graph_plans_equal_eager_engines(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    eager = _pipeline(tiny_model_dir, False, monkeypatch)
    graphed = _pipeline(tiny_model_dir, True, monkeypatch)
    try:
        assert eager.thinker.engine.runner.graphs is None and eager.code2wav.engine.runner.graphs is None
        assert graphed.thinker.engine.runner.graphs and graphed.talker.engine.runner.step_graphs
        assert graphed.code2wav.engine.runner.graphs
        assert graphed.thinker.engine.runner.prefill_graphs.emulated
        assert graphed.talker.engine.runner.predictor_graphs.emulated
        # different prompt lengths; one longer than --prefill-chunk (chunked, then decoded in the graphs)
        texts = PROMPTS + ["Please describe, in some detail, how a lighthouse lens focuses its light at night."]
        reqs = [_request(tokenizer, omni_config, t, i) for i, t in enumerate(texts)]
        assert max(len(r.token_ids) for r in reqs) > 24 >= min(len(r.token_ids) for r in reqs)

        async def run(pipe):
            alone = [await _collect(pipe, r) for r in reqs]
            together = await asyncio.gather(*(_collect(pipe, r) for r in reqs))
            return alone, together

        want, _ = asyncio.run(run(eager))
        alone, together = asyncio.run(run(graphed))
    finally:
        eager.close()
        graphed.close()
    for got in (alone, together):
        for (ids_w, codes_w, audio_w), (ids_g, codes_g, audio_g) in zip(want, got):
            assert ids_g == ids_w
            assert torch.equal(codes_g, codes_w)
            assert audio_g.shape == audio_w.shape and (audio_g - audio_w).abs().max() <= 1e-4


@pytest.mark.parametrize("n", [1, 3, 4])
def test_graphed_step_pads_and_buckets(n):
    """GraphedStep's own plan: inputs copied into the leading corner of the static tensors, rows past
    the batch set to the pad value, the smallest bucket that fits chosen, outputs cut back to n."""
    seen = []

    def fn(nb, kb, x, slots):
        seen.append((nb, kb, slots.clone()))
        return (x[:, :kb].sum(-1) + slots,)

    step = cuda_graphs.GraphedStep(fn, (torch.zeros(4, 8), torch.zeros(4, dtype=torch.long)), [1, 2, 4], [4, 8],
                                   "test", pad=(None, 99))
    assert step.emulated
    x = torch.arange(n * 3, dtype=torch.float).view(n, 3)
    (out,) = step(n, 3, x, torch.arange(n))
    nb = 1 if n == 1 else 4
    assert seen[-1][:2] == (nb, 4)
    assert seen[-1][2][n:].tolist() == [99] * (nb - n)
    assert torch.equal(out, x.sum(-1) + torch.arange(n))


def test_fine_buckets_pad_by_less_than_a_step_of_the_octave():
    """The extend graphs' buckets: a 258-token turn replays the 320 bucket (powers of two: 512),
    every length up to the limit fits one, and no replay pads by a quarter of its bucket or more
    past the first steps."""
    b = cuda_graphs.fine_buckets(512, 32)
    assert b == [32, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert cuda_graphs.fine_buckets(8, 1, 2) == [1, 2, 3, 4, 6, 8]
    assert cuda_graphs.fine_buckets(40, 32) == [32, 40] and cuda_graphs.fine_buckets(16, 16) == [16]
    assert min(x for x in b if x >= 258) == 320
    for n in range(129, 513):
        fit = min(x for x in b if x >= n)
        assert (fit - n) / fit < 0.2
    step = cuda_graphs.GraphedStep(lambda nb, kb, x: (x[:, :kb].sum(-1),), (torch.zeros(1, 512),), [1], b, "test")
    assert step.fits(1, 258) and not step.fits(1, 513)


def test_padded_prefill_rows_write_only_the_scratch_block(tiny_model_dir, monkeypatch):
    """A graphed prefill of 3 prompts runs the 4-row bucket: the padding row and the positions past
    each prompt's blocks write the scratch block and no sequence's block (the null block stays zero),
    and the 3 prompts' logits and kept hidden layers (the talker's rows of an audio prompt) equal one
    eager prefill each."""
    pipe = _pipeline(tiny_model_dir, True, monkeypatch)
    try:
        eng = pipe.thinker.engine.runner     # its KV cache, graphs and step functions
        cache, bs = eng.cache, eng.blocks.block_size
        lens = (19, 7, 12)
        tables = [eng.blocks.pool.allocate(-(-n // bs)) for n in lens]
        used = {b for t in tables for b in t}
        others = [b for b in range(cache.num_blocks) if b not in used]
        before = cache.k[0][others].clone()                          # blocks nobody holds must stay untouched
        cache.k[0][cache.scratch].fill_(7.0)                         # the padding must overwrite this
        gen = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            embeds = [eng.model.model.embed_tokens(torch.randint(0, eng.cfg.text.vocab_size, (n,), generator=gen))
                      for n in lens]
            x = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)
            last = torch.tensor([n - 1 for n in lens])
            got, kept = eng.prefill_graphs(3, max(lens), x, last, cache.table_tensor(tables, eng.prefill_width))
            assert eng.prefill_graphs.static[2][3].eq(cache.null).all()
            assert torch.equal(cache.k[0][others], before)
            assert not cache.k[0][cache.null].any()
            assert not (cache.k[0][cache.scratch, :, :max(lens) % bs] == 7.0).all()
            layer = eng.cfg.accept_hidden_layer
            want = [eng._prefill_fn(1, n, e[None], torch.tensor([n - 1]), cache.table_tensor([t], -(-n // bs)), layer)
                    for n, e, t in zip(lens, embeds, tables)]
        assert torch.allclose(got, torch.cat([w[0] for w in want]), atol=1e-5, rtol=1e-5)
        for b, (n, w) in enumerate(zip(lens, want)):
            assert torch.allclose(kept[b, :n], w[1][0], atol=1e-5, rtol=1e-5)
        for t in tables:
            eng.blocks.pool.release(t)
    finally:
        pipe.close()
