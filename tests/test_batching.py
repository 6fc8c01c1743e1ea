"""Batched prefill: requests that arrive together are prefilled in one forward per stage (right-padded
prompts of different lengths) and each gets exactly what it gets alone. The three real engines run
in one process (bench/inprocess.py, no gRPC) so that the test controls arrival; the split services
are covered against transformers in test_e2e.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from voxpipe.bench.inprocess import InProcessPipeline
from voxpipe.cli import build_parser
from voxpipe.client import AudioEvent, FramesEvent, SpeechRequest, TextEvent
from voxpipe.services.runtime import metrics
from voxpipe.services.thinker.engine import IncrementalDetokenizer
from voxpipe.services.thinker.prompt import ChatMessage, render

PROMPTS = ["Hi.", "Tell me a long story about a lighthouse keeper.", "What is two plus two, exactly?"]


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    ns = build_parser().parse_args(["thinker", "--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"])
    pipe = InProcessPipeline(ns)
    yield pipe
    pipe.close()


def _request(tokenizer, cfg, text: str, i: int) -> SpeechRequest:
    ids = render(tokenizer, cfg.thinker, [ChatMessage.text("user", text)]).token_ids
    return SpeechRequest(token_ids=ids, max_tokens=6, min_tokens=6, max_frames=9, min_frames=9,
                         request_id=f"batch-{i}")


async def _collect(pipe: InProcessPipeline, req: SpeechRequest) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    ids, codes, audio = [], [], []
    async for ev in pipe.stream(req):
        if isinstance(ev, TextEvent):
            ids.extend(ev.token_ids)
        elif isinstance(ev, FramesEvent):
            codes.append(ev.codes)
        elif isinstance(ev, AudioEvent):
            audio.append(ev.samples)
    return ids, torch.cat(codes), torch.from_numpy(np.concatenate(audio))


def _prefills(stage: str) -> tuple[float, float]:
    """(steps that prefilled, requests prefilled) so far."""
    get = metrics.REGISTRY.get_sample_value
    return (get("voxpipe_prefill_batch_size_count", {"stage": stage}) or 0.0,
            get("voxpipe_prefill_batch_size_sum", {"stage": stage}) or 0.0)


def test_requests_arriving_together_are_prefilled_together_and_equal_alone(pipeline, tokenizer, omni_config):
    reqs = [_request(tokenizer, omni_config, t, i) for i, t in enumerate(PROMPTS)]
    lengths = {len(r.token_ids) for r in reqs}
    assert len(lengths) == 3, "the prompts must differ in length (right padding is what is tested)"

    async def run():
        alone = [await _collect(pipeline, r) for r in reqs]
        before = {s: _prefills(s) for s in ("thinker", "talker")}
        # the engines wait on their queues; the three submissions land before the thinker's next step
        together = await asyncio.gather(*(_collect(pipeline, r) for r in reqs))
        after = {s: _prefills(s) for s in ("thinker", "talker")}
        return alone, together, before, after

    alone, together, before, after = asyncio.run(run())
    steps, requests = (after["thinker"][i] - before["thinker"][i] for i in (0, 1))
    assert requests == 3 and steps < 3, f"thinker prefilled 3 requests in {steps} steps"
    steps, requests = (after["talker"][i] - before["talker"][i] for i in (0, 1))
    assert requests == 3
    for (ids_a, codes_a, audio_a), (ids_t, codes_t, audio_t) in zip(alone, together):
        assert len(ids_a) == 6 and codes_a.shape == (9 - 1, 16)
        assert ids_t == ids_a
        assert torch.equal(codes_t, codes_a)
        assert audio_t.shape == audio_a.shape
        assert (audio_t.float() - audio_a.float()).abs().max() <= 1e-4


@pytest.mark.parametrize("text", ["plain ascii words, with punctuation!", "多字节 UTF-8 — ünïcödé 🎉 mixed"])
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]   # a special token is skipped, as in a full decode
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)
