"""Batched prefill: requests that arrive together are prefilled in one forward per stage (right-padded
prompts of different lengths) and each gets exactly what it gets alone. The three real engines run
in one process (bench/inprocess.py, no gRPC) so that the test controls arrival; the split services
are covered against transformers in test_e2e.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from voxpipe.bench.inprocess import InProcessPipeline
from voxpipe.cli import build_parser
from voxpipe.client import AudioEvent, FramesEvent, SpeechRequest, TextEvent
from voxpipe.services.runtime import metrics
from voxpipe.services.thinker.engine import IncrementalDetokenizer
from voxpipe.services.thinker.prompt import ChatMessage, render
from test_isolation import GRAPHS, _build

PROMPTS = ["Hi.", "Tell me a long story about a lighthouse keeper.", "What is two plus two, exactly?"]


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir):
    # the prefix cache off: a repeated prompt would skip its prefill (tests/test_prefix_cache.py)
    pipe = InProcessPipeline.from_argv(["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"],
                                       stage_argv={"thinker": ["--no-prefix-cache"]})
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


async def _delivered(job) -> list:
    """The items a job's outbox holds, once the event loop ran the engine's deliveries."""
    await asyncio.sleep(0)
    items = []
    while (got := job.outbox.poll_timed()) is not None:
        items.append(got[0])
    return items


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


@pytest.fixture(scope="module")
def chunked_pipeline(tiny_model_dir):
    pipe = InProcessPipeline.from_argv(["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"],
                                       stage_argv={"thinker": ["--prefill-chunk", "7"]})
    yield pipe
    pipe.close()


@pytest.fixture(scope="module")
def packed_pipeline(tiny_model_dir):
    """Prompts over 7 tokens are long; a step packs up to 40 of their tokens (several prompts' chunks
    in one row: what --prefill-chunk does with prompts over 512 tokens at full size)."""
    pipe = InProcessPipeline.from_argv(["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"],
                                       stage_argv={"thinker": ["--prefill-chunk", "40"]})
    pipe.thinker.engine.scheduler.long_prompt = 7
    runner = pipe.thinker.engine.runner
    packed = runner.packed_rows = []
    original = runner.prefill_chunks

    def recording(chunks):
        packed.append([(job.request_id, start, length) for job, start, length in chunks])
        return original(chunks)

    runner.prefill_chunks = recording
    yield pipe
    pipe.close()


@pytest.mark.parametrize("chunked", ["chunked_pipeline", "packed_pipeline"])
def test_chunked_prefill_equals_whole_prefill(pipeline, chunked, request, tokenizer, omni_config):
    """Prompts longer than --prefill-chunk (7 tokens here) are prefilled 7 tokens per step while the
    other requests keep decoding; with a larger step budget several prompts' chunks are packed into
    one row. Every request, text or audio prompt, alone or concurrent, gets what the unchunked
    engine gives it."""
    chunked_pipeline = request.getfixturevalue(chunked)
    from oracle import audio_features
    from voxpipe.services.thinker.prompt import ChatPart

    t = np.arange(int(0.9 * 16000)) / 16000.0
    wav = (0.4 * np.sin(2 * np.pi * 330 * t) * np.exp(-t)).astype(np.float32)
    audio = render(tokenizer, omni_config.thinker, [ChatMessage("user", [ChatPart(features=audio_features(wav)),
                                                                          ChatPart(text="What is this?")])])
    reqs = [_request(tokenizer, omni_config, text, i) for i, text in enumerate(PROMPTS)]
    reqs.append(SpeechRequest(token_ids=audio.token_ids, audio_features=audio.audio_features, max_tokens=6, min_tokens=6,
                              max_frames=9, min_frames=9, request_id="batch-audio"))
    assert all(len(r.token_ids) > 7 for r in reqs)

    async def run():
        want = [await _collect(pipeline, r) for r in reqs]
        alone = [await _collect(chunked_pipeline, r) for r in reqs]
        together = await asyncio.gather(*(_collect(chunked_pipeline, r) for r in reqs))
        return want, alone, together

    want, alone, together = asyncio.run(run())
    for got in (alone, together):
        for (ids_w, codes_w, audio_w), (ids_g, codes_g, audio_g) in zip(want, got):
            assert ids_g == ids_w
            assert torch.equal(codes_g, codes_w)
            assert audio_g.shape == audio_w.shape and (audio_g - audio_w).abs().max() <= 1e-4
    packed = getattr(chunked_pipeline.thinker.engine.runner, "packed_rows", None)
    if packed is not None:   # the concurrent run packed several prompts, chunks split across steps among them
        assert max(len(step) for step in packed) >= 3, packed
        assert any(start > 0 for step in packed for _, start, _ in step), packed


def test_short_prompts_pass_long_ones_waiting_for_the_chunked_prefill(tiny_model_dir, tokenizer, omni_config):
    """Two long prompts (chunked 16 tokens per step) then a short one: the first long prompt is
    being prefilled, the second waits for it, and the short one does not wait behind the second:
    its first token comes before either long prompt's."""
    pipe = InProcessPipeline.from_argv(["--model", str(tiny_model_dir), "--device", "cpu", "--max-batch", "4"],
                                       stage_argv={"thinker": ["--prefill-chunk", "16"]})
    order: list[str] = []

    async def first_text(req: SpeechRequest) -> None:
        async for ev in pipe.stream(req):
            if isinstance(ev, TextEvent) and req.request_id not in order:
                order.append(req.request_id)

    long_text = "tell me everything about " + "lighthouses and keepers " * 12
    reqs = [_request(tokenizer, omni_config, long_text, 10), _request(tokenizer, omni_config, long_text + "again", 11),
            _request(tokenizer, omni_config, "Hi.", 12)]
    assert len(reqs[0].token_ids) > 6 * 16 and len(reqs[2].token_ids) <= 16

    async def run():
        tasks = [asyncio.ensure_future(first_text(r)) for r in reqs]
        await asyncio.gather(*tasks)

    try:
        asyncio.run(run())
    finally:
        pipe.close()
    assert order[0] == "batch-12", order


@pytest.mark.parametrize("text", ["plain ascii words, with punctuation!", "多字节 UTF-8 — ünïcödé 🎉 mixed"])
def test_incremental_detokenizer_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    ids = ids + [tokenizer.convert_tokens_to_ids("<|im_end|>")]   # a special token is skipped, as in a full decode
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)


def test_code2wav_frame_rounds_equal_whole_utterance_decode(tiny_model_dir):
    """The engine's step plan (first frames, then one-frame rounds batched across utterances) for
    utterances whose frames arrive unevenly equals decoding each utterance's frames in one call."""
    from voxpipe.services.code2wav import server as code2wav_server
    from voxpipe.services.code2wav.engine import Code2WavJob
    from voxpipe.services.code2wav.model import StreamStore
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import AudioOut

    ns = build_parser().parse_args(["code2wav", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "4"])
    engine = code2wav_server.build(ns).engine
    q = engine.cfg.num_quantizers
    gen = torch.Generator().manual_seed(0)
    codes = [torch.randint(0, engine.cfg.codebook_size, (7, q), generator=gen) for _ in range(3)]
    arrivals = [[1, 3, 2, 1], [4, 1, 2], [2, 0, 5]]      # frames per utterance before each step

    async def run() -> list[np.ndarray]:
        jobs = [Code2WavJob(request_id=f"c{i}", outbox=Outbox(asyncio.get_running_loop(), limit=1000))
                for i in range(3)]
        for j in jobs:
            engine.submit(j)
        sent = [0, 0, 0]
        for step in range(4):
            for i, j in enumerate(jobs):
                k = arrivals[i][step] if step < len(arrivals[i]) else 0
                if k:
                    engine.add_frames(j, codes[i][sent[i]:sent[i] + k])
                    sent[i] += k
                if sent[i] == 7 and not j.frames_end:
                    engine.end_frames(j)
            engine.step()
        while engine.has_work():
            engine.step()
        await asyncio.sleep(0)
        out = []
        for j in jobs:
            chunks = []
            while not j.outbox._queue.empty():
                _, item = j.outbox._queue.get_nowait()
                if isinstance(item, AudioOut):
                    chunks.append(item.samples)
            out.append(np.concatenate(chunks))
        return out

    got = asyncio.run(run())
    model = engine.runner.model
    store = StreamStore(model, 3, torch.float32, "cpu")
    with torch.inference_mode():
        for i, g in enumerate(got):
            slot = torch.tensor([store.allocate()])
            want = model.decode(codes[i].T[None], slot, torch.zeros(1, dtype=torch.long), store, first=True)[0]
            assert g.shape == tuple(want.shape) and g.shape[0] > 0
            assert np.abs(g - want.numpy()).max() <= 1e-5

def test_code2wav_due_chunk_drains_over_capped_steps(tiny_model_dir):
    """A step decodes at most max(MAX_FRAMES_PER_STEP, chunk) frames of an utterance, but a chunk that
    became due is drained by the following steps without waiting for `chunk` more frames; frames
    that arrive one at a time go out in chunks of `chunk_frames` (the first chunk: 1 frame)."""
    from voxpipe.services.code2wav import server as code2wav_server
    from voxpipe.services.code2wav.engine import Code2WavJob
    from voxpipe.services.code2wav.scheduler import MAX_FRAMES_PER_STEP
    from voxpipe.services.runtime.engine import Outbox

    ns = build_parser().parse_args(["code2wav", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "2"])
    engine = code2wav_server.build(ns).engine
    q = engine.cfg.num_quantizers
    assert MAX_FRAMES_PER_STEP == 4

    async def run() -> tuple[list[int], list[int]]:
        loop = asyncio.get_running_loop()
        burst = Code2WavJob(request_id="burst", outbox=Outbox(loop, limit=1000), chunk_frames=6)
        trickle = Code2WavJob(request_id="trickle", outbox=Outbox(loop, limit=1000), chunk_frames=6)
        for j in (burst, trickle):
            engine.submit(j)
        engine.add_frames(burst, torch.zeros(20, q, dtype=torch.long))
        sizes = {"burst": [], "trickle": []}
        for step in range(14):
            engine.add_frames(trickle, torch.zeros(1, q, dtype=torch.long))
            before = {j.request_id: j.frames_decoded for j in (burst, trickle)}
            engine.step()
            for j in (burst, trickle):
                if j.frames_decoded > before[j.request_id]:
                    sizes[j.request_id].append(j.frames_decoded - before[j.request_id])
        return sizes["burst"], sizes["trickle"]

    burst, trickle = asyncio.run(run())
    assert burst == [4, 6, 6, 4]           # due at once: drained in capped steps, nothing left waiting
    assert trickle == [1, 6, 6]            # first chunk 1 frame, then whole chunks of 6


def test_talker_prefill_batch_respects_the_padded_row_budget(tiny_model_dir):
    """The talker admits ready requests in arrival order while the padded batch (longest prompt x
    requests) stays within prefill_tokens; the rest wait for the next step. (The service's engine and
    its TalkerJobs here; tests/test_schedulers.py holds the scheduler's own cases.)"""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.talker import server as talker_server
    from voxpipe.services.talker.engine import TalkerJob
    from voxpipe.services.talker.scheduler import PROMPT_TAIL

    ns = build_parser().parse_args(["talker", "--model", str(tiny_model_dir), "--device", "cpu", "--port", "0", "--max-batch", "8"])
    engine = talker_server.build(ns).engine
    engine.scheduler.prefill_tokens = 3 * (40 + PROMPT_TAIL)
    h = engine.cfg.thinker_hidden_size

    async def admit() -> list[int]:
        loop = asyncio.get_running_loop()
        for i, users in enumerate((10, 40, 20, 5, 30)):
            job = TalkerJob(request_id=f"t{i}", outbox=Outbox(loop), user_rows=torch.zeros(users, h),
                            user_mm_mask=torch.zeros(users, dtype=torch.bool), rows=[torch.zeros(h)] * 2)
            engine.submit(job)
        free = engine.runner.free_slots
        with engine.lock:
            first = engine.scheduler.schedule(engine.waiting, engine.running, free, time.monotonic()).prefill
            rest = [j for j in engine.waiting if all(j is not f for f in first)]
            second = engine.scheduler.schedule(rest, engine.running, free - len(first), time.monotonic()).prefill
        return [len(first), len(second)]

    # 10, 40, 20 fit (3 x 49 rows); adding 5 would make 4 x 49 > budget; then 5 and 30 fit together
    assert asyncio.run(admit()) == [3, 2]


@pytest.mark.parametrize("graphs", GRAPHS["params"], ids=GRAPHS["ids"])
def test_talker_early_prefill_equals_the_whole_prefill(tiny_model_dir, graphs):
    """A request whose prompt comes before its text (the thinker sends a text prompt's talker prompt
    at admission) prefills all but the prompt's last row at once, and its frame 0 is a decode step
    that reads text row 0 there: the same frames as one whole prefill once the rows are in, and the
    same as with early prefill off."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import Finished, FramesOut
    from voxpipe.services.talker.engine import TalkerJob

    engine = _build("talker", tiny_model_dir, graphs)     # graphs: the prefill and step graph plans, emulated
    h = engine.cfg.thinker_hidden_size
    g = torch.Generator().manual_seed(3)
    user, head, special, rows = (torch.randn(n, h, generator=g) * 0.05 for n in (37, 3, 3, 5))

    async def speak(rows_first: bool, early: bool) -> tuple[bool, torch.Tensor]:
        engine.scheduler.early = early
        job = TalkerJob(request_id=f"early-{rows_first}-{early}", outbox=Outbox(asyncio.get_running_loop()),
                        user_rows=user, user_mm_mask=torch.zeros(37, dtype=torch.bool), head=head, special=special,
                        speaker_id=next(iter(engine.cfg.speakers.values())), max_frames=9, min_frames=9)
        engine.submit(job)
        if rows_first:
            engine.add_rows(job, rows)
            engine.end_text(job)
        engine.step()
        went_early = job.early
        if not rows_first:
            engine.add_rows(job, rows)
            engine.end_text(job)
        for _ in range(40):
            if job.done:
                break
            engine.step()
        items = await _delivered(job)
        assert isinstance(items[-1], Finished), items[-1]
        return went_early, torch.cat([i.codes for i in items if isinstance(i, FramesOut)]).long()

    async def go():
        return [await speak(*case) for case in ((False, True), (True, True), (False, False))]

    (early, codes), (whole, ref), (off, ref_off) = asyncio.run(go())
    assert early and not whole and not off          # only a request without its rows prefilled early
    assert codes.shape == ref.shape == (8, engine.cfg.num_code_groups)
    assert torch.equal(codes, ref) and torch.equal(codes, ref_off)


def test_thinker_sends_a_text_prompts_talker_prompt_before_its_prefill(tiny_model_dir):
    """A text prompt's TalkerPrompt (embedding lookups only) leaves at admission, before the prefill
    runs, equal to the one made from the prefill's embeddings; an audio prompt's after its prefill
    (its audio rows are the prefill's hidden layer). Either comes before the first text."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import TalkerPromptOut, TextOut
    from voxpipe.services.thinker.engine import ThinkerJob, talker_prompt
    from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render

    engine = _build("thinker", tiny_model_dir, graphs=False)
    runner = engine.runner
    waiting_at_prefill = []
    prefill = runner.prefill

    def watched(jobs):
        waiting_at_prefill.extend(j.outbox.backlog for j in jobs)
        return prefill(jobs)

    runner.prefill = watched
    mel = engine.cfg.audio.num_mel_bins

    async def first_items(parts: list[ChatPart]) -> tuple[ThinkerJob, list]:
        rendered = render(engine.tokenizer, engine.cfg, [ChatMessage("user", parts)])
        job = ThinkerJob(request_id=f"p{len(parts)}", outbox=Outbox(asyncio.get_running_loop()),
                         prompt=rendered.token_ids, audio=list(rendered.audio_features), max_tokens=4,
                         talker_rows=True)
        engine.submit(job)
        engine.step()
        items = await _delivered(job)
        return job, items

    async def go():
        return (await first_items([ChatPart(text="Tell me about lighthouses.")]),
                await first_items([ChatPart(features=torch.zeros(mel, 60)), ChatPart(text="And this?")]))

    (text_job, text_items), (audio_job, audio_items) = asyncio.run(go())
    assert waiting_at_prefill == [1, 0]      # the text prompt's TalkerPrompt was out when its prefill ran
    assert text_job.prompt_sent and not audio_job.prompt_sent
    for items in (text_items, audio_items):
        assert isinstance(items[0], TalkerPromptOut) and isinstance(items[1], TextOut)
    got = text_items[0]
    ids = torch.tensor(text_job.prompt)
    with torch.inference_mode():
        want = talker_prompt(engine.cfg, ids, runner.model.embed(ids).cpu(), None, runner.tts_special)
    for name in ("user_rows", "user_mm_mask", "user_token_ids", "assistant_head", "assistant_prefix", "tts_special"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert bool(audio_items[0].user_mm_mask.any())


def test_talker_prompt_as_token_ids_for_a_routed_text_prompt(tiny_model_dir):
    """A routed spoken reply's text prompt goes to the talker as token ids (TalkerPrompt.user_rows unset);
    the talker's lookup in the thinker's table (read from the checkpoint) gives the rows the thinker
    would have sent, so the frames equal those of the prompt with rows. A caller's talker_rows stream,
    and --talker-prompt-rows, still get the rows."""
    from safetensors import safe_open

    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import Finished, FramesOut, TalkerPromptOut
    from voxpipe.services.talker.engine import TalkerJob
    from voxpipe.services.thinker.engine import ThinkerJob
    from voxpipe.services.thinker.prompt import ChatMessage
    from voxpipe.v1 import stages_pb2 as pb

    thinker = _build("thinker", tiny_model_dir, graphs=False)
    talker = _build("talker", tiny_model_dir, graphs=False)
    with safe_open(str(tiny_model_dir / "model.safetensors"), framework="pt") as f:
        table = f.get_tensor("thinker.model.embed_tokens.weight").float()
    ids = render(thinker.tokenizer, thinker.cfg, [ChatMessage.text("user", "Tell me about the sea.")]).token_ids

    async def prompt_of(speech: bool, ids_flag: bool) -> TalkerPromptOut:
        thinker.talker_prompt_ids = ids_flag
        job = ThinkerJob(request_id=f"p-{speech}-{ids_flag}", outbox=Outbox(asyncio.get_running_loop()), prompt=ids,
                         max_tokens=2, talker_rows=True, speech=pb.SpeechParams() if speech else None)
        thinker.submit(job)
        thinker.step()
        await asyncio.sleep(0)
        first = job.outbox.poll_timed()[0]
        thinker.cancel(job)
        assert isinstance(first, TalkerPromptOut)
        return first

    async def frames(prompt: TalkerPromptOut, rows: torch.Tensor | None, name: str) -> torch.Tensor:
        job = TalkerJob(request_id=name, outbox=Outbox(asyncio.get_running_loop()), user_rows=rows,
                        user_mm_mask=prompt.user_mm_mask, user_ids=prompt.user_token_ids, head=prompt.assistant_head,
                        special=prompt.tts_special, speaker_id=next(iter(talker.cfg.speakers.values())),
                        max_frames=6, min_frames=6)
        talker.submit(job)
        talker.add_rows(job, table[torch.tensor([11, 12, 13])])
        talker.end_text(job)
        while not job.done:
            talker.step()
        items = await _delivered(job)
        assert isinstance(items[-1], Finished), items[-1]
        return torch.cat([i.codes for i in items if isinstance(i, FramesOut)]).long()

    async def go():
        routed, rows_flag, caller = (await prompt_of(True, True), await prompt_of(True, False),
                                     await prompt_of(False, True))
        by_ids = await frames(routed, None, "by-ids")
        by_rows = await frames(rows_flag, rows_flag.user_rows, "by-rows")
        return routed, rows_flag, caller, by_ids, by_rows

    routed, rows_flag, caller, by_ids, by_rows = asyncio.run(go())
    assert routed.user_rows is None and rows_flag.user_rows is not None and caller.user_rows is not None
    assert torch.equal(routed.user_token_ids, caller.user_token_ids)
    assert torch.equal(caller.user_rows, table[caller.user_token_ids].to(caller.user_rows.dtype))
    for name in ("assistant_head", "assistant_prefix", "tts_special", "user_mm_mask"):
        assert torch.equal(getattr(routed, name), getattr(caller, name)), name
    assert by_ids.shape == (5, talker.cfg.num_code_groups) and torch.equal(by_ids, by_rows)


def test_thinker_first_tokens_leave_before_the_steps_decode_forward(tiny_model_dir):
    """A step that prefills also decodes (the new tokens' next ones): the prefill's first tokens, and
    a text prompt's TalkerPrompt before them, are handed to the event loop before that decode forward
    runs, not with the step's other outputs at its end."""
    from voxpipe.services.runtime.engine import Outbox, StepDelivery
    from voxpipe.services.runtime.outputs import TextOut
    from voxpipe.services.thinker.engine import ThinkerJob
    from voxpipe.services.thinker.prompt import ChatMessage

    engine = _build("thinker", tiny_model_dir, graphs=False)
    held_at_decode = []
    decode = engine.runner.decode

    def watched(jobs):
        held_at_decode.append([type(item).__name__ for _, (_, item) in StepDelivery.active().entries])
        return decode(jobs)

    engine.runner.decode = watched

    async def go():
        ids = render(engine.tokenizer, engine.cfg, [ChatMessage.text("user", "Hello there.")]).token_ids
        job = ThinkerJob(request_id="first", outbox=Outbox(asyncio.get_running_loop()), prompt=ids, max_tokens=4,
                         talker_rows=True)
        engine.submit(job)
        with StepDelivery():
            engine.step()
        items = await _delivered(job)
        return items

    items = asyncio.run(go())
    assert held_at_decode == [[]]                    # nothing of the prefill waited for the decode forward
    assert [type(i).__name__ for i in items] == ["TalkerPromptOut", "TextOut", "TextOut"]
    assert all(isinstance(i, TextOut) and i.rows is not None for i in items[1:])


def test_thinker_refuses_a_prefill_chunk_below_one(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "voxpipe.cli", "thinker", "--model", str(tiny_model_dir),
                           "--device", "cpu", "--prefill-chunk", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "--prefill-chunk must be at least 1, got 0" in proc.stderr
