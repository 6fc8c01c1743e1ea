"""The talker's paged KV and prefix cache (tiny checkpoint, float32, CPU): conversations whose talker
prompts (every user turn's rows) hit, partly hit and miss the talker's cache, text and audio turns,
after eviction, under preemption, and on a fresh talker replica behind a thinker hit. The talker
prompts come from the thinker engine as a routed spoken reply's do (user turns as token ids, audio
rows alone with their content keys) and reach the talker through its servicer's parsing of the
TalkerStart; every frame equals the talker with the prefix cache off, and transformers."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from oracle import reference_generate
from voxpipe.cli import build_parser
from voxpipe.services.runtime import cuda_graphs, metrics
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.kv_plan import KVPlan
from voxpipe.services.runtime.row_keys import mm_runs
from voxpipe.services.runtime.outputs import Finished, FramesOut, TalkerAudioRowsOut, TalkerPromptOut, TextOut
from voxpipe.services.runtime.server import Abort, talker_prompt_proto
from voxpipe.services.thinker.job import ThinkerJob
from voxpipe.services.talker.scheduler import PROMPT_TAIL
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render
from voxpipe.v1 import stages_pb2 as pb

BS = 16
FRAMES = 4          # talker steps (FRAMES - 1 frames out)
TOKENS = 5          # thinker tokens a turn


def test_mm_runs_finds_every_run_of_a_mask_in_any_form():
    """The multimodal runs of a talker prompt's mask (found in numpy), against a walk over the mask."""
    def walked(mask: list[bool]) -> list[tuple[int, int]]:
        runs, start = [], None
        for i, m in enumerate(mask + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                runs.append((start, i))
                start = None
        return runs

    gen = torch.Generator().manual_seed(0)
    masks = [[], [True], [False], [True, True], [False, True]]
    masks += [(torch.rand(n, generator=gen) < q).tolist() for n, q in ((1, 0.5), (7, 0.5), (300, 0.1), (300, 0.9))]
    for mask in masks:
        want = walked(mask)
        assert mm_runs(mask) == want
        assert mm_runs(torch.tensor(mask, dtype=torch.bool)) == want
        assert all(type(x) is int for run in mm_runs(mask) for x in run)


def _build(stage: str, model_dir, *flags: str, graphs: bool = False):
    """The stage's servicer as its service builds it (`graphs`: CUDA-graph plans emulated on the CPU)."""
    from voxpipe.services.talker import server as talker_server
    from voxpipe.services.thinker import server as thinker_server

    ns = build_parser().parse_args([stage, "--model", str(model_dir), "--device", "cpu", "--max-batch", "4", *flags])
    emulate, cuda_graphs.EMULATE = cuda_graphs.EMULATE, graphs
    try:
        return thinker_server.build(ns)[0] if stage == "thinker" else talker_server.build(ns)
    finally:
        cuda_graphs.EMULATE = emulate


@pytest.fixture(scope="module")
def thinker(tiny_model_dir):
    return _build("thinker", tiny_model_dir).engine


@pytest.fixture(scope="module")
def cached(tiny_model_dir):
    servicer = _build("talker", tiny_model_dir, graphs=True)
    runner = servicer.engine.runner
    assert runner.step_graphs is not None      # block tables as graph inputs (emulated)
    assert runner.extend_graphs is not None and runner.extend_graphs.emulated
    return servicer


@pytest.fixture(scope="module")
def uncached(tiny_model_dir):
    return _build("talker", tiny_model_dir, "--no-prefix-cache")


def _drain(job) -> list:
    asyncio.get_event_loop().run_until_complete(asyncio.sleep(0))
    items = []
    while (got := job.outbox.poll_timed()) is not None:
        items.append(got[0])
    return items


def _thinker_turn(thinker, rid: str, messages: list[ChatMessage]) -> tuple[list[int], TalkerPromptOut, torch.Tensor, int]:
    """A spoken reply's thinker side: its prompt ids, the talker prompt it sends (an audio prompt's
    with its audio rows, which follow the start: TalkerAudioRowsOut), its text rows and the
    thinker's cached prompt tokens."""
    rendered = render(thinker.tokenizer, thinker.cfg, messages)
    job = ThinkerJob(request_id=rid, outbox=Outbox(asyncio.get_event_loop(), limit=10_000), prompt=rendered.token_ids,
                     audio=list(rendered.audio_features), max_tokens=TOKENS, min_tokens=TOKENS, talker_rows=True,
                     speech=pb.SpeechParams())
    thinker.submit(job)
    while thinker.has_work():
        thinker.step()
    items = _drain(job)
    assert isinstance(items[0], TalkerPromptOut) and isinstance(items[-1], Finished), items[-1]
    rows = torch.cat([i.rows for i in items if isinstance(i, TextOut) and i.rows is not None])
    prompt = items[0]
    if prompt.audio_rows_follow:
        assert prompt.audio_rows is None and isinstance(items[1], TalkerAudioRowsOut)
        prompt = dataclasses.replace(prompt, audio_rows=items[1].rows)
    return job.prompt, prompt, rows, items[-1].cached_tokens


def _start(rid: str, prompt: TalkerPromptOut, frames: int = FRAMES, follow: bool = False) -> pb.TalkerStart:
    """The TalkerStart of `prompt` (its audio rows in it; `follow`: left out, to follow the talker's Held)."""
    sent = dataclasses.replace(prompt, audio_rows=None) if follow else dataclasses.replace(prompt, audio_rows_follow=False)
    return pb.TalkerStart(request_id=rid, prompt=talker_prompt_proto(sent), max_frames=frames, min_frames=frames)


def _jobs(servicer, starts: list[pb.TalkerStart]):
    async def make():
        return [servicer.make_job(s) for s in starts]
    return asyncio.get_event_loop().run_until_complete(make())


def _speak(servicer, starts: list[pb.TalkerStart], rows: list[torch.Tensor],
           audio: list[torch.Tensor] | None = None) -> list[tuple[torch.Tensor, Finished]]:
    """The talker requests together (their text rows all there): each one's codes [n, G] and Finished.
    `audio`: each start's audio rows, for a start whose audio rows follow."""
    engine = servicer.engine
    jobs = _jobs(servicer, starts)
    for job, r, a in zip(jobs, rows, audio or [None] * len(jobs)):
        engine.submit(job)
        if job.audio_follow:           # as the servicer and the thinker's relay do: Held, then the rest
            engine.hold(job)
            engine.add_audio_rows(job, job.held_audio, a[job.held_audio:])
        engine.add_rows(job, r)
        engine.end_text(job)
    while engine.has_work():
        engine.step()
    out = []
    for job in jobs:
        items = _drain(job)
        assert isinstance(items[-1], Finished), items[-1]
        out.append((torch.cat([i.codes for i in items if isinstance(i, FramesOut)]).long(), items[-1]))
    return out


def _both(cached, uncached, rid, prompt, rows) -> tuple[torch.Tensor, int]:
    """Frames and the cached rows of the cached talker, checked equal to the uncached talker's (an
    audio prompt goes to the cached one as the thinker sends it: its audio rows past the held prefix)."""
    follow = prompt.audio_rows_follow
    (got, done), = _speak(cached, [_start(rid, prompt, follow=follow)], [rows], [prompt.audio_rows] if follow else None)
    (want, _), = _speak(uncached, [_start(rid, prompt)], [rows])
    assert torch.equal(got, want), rid
    assert got.shape[0] == FRAMES - 1
    return got, done.cached_tokens


def test_a_conversation_hits_partly_hits_and_misses_the_talkers_cache(thinker, cached, uncached, tiny_model_dir,
                                                                        loop):
    system = ChatMessage.text("system", "You are a lighthouse keeper who answers in long careful sentences.")
    turn1 = [system, ChatMessage.text("user", "Tell me about the sea at night, and the ships that pass by the rocks.")]
    extend = cached.engine.runner.extend_graphs
    replays = extend.replays
    ids1, prompt1, rows1, _ = _thinker_turn(thinker, "t1", turn1)
    assert prompt1.user_rows is None and prompt1.audio_rows is None and not prompt1.audio_keys
    users1 = prompt1.user_token_ids.shape[0]
    assert users1 > 2 * BS
    _, hit = _both(cached, uncached, "t1", prompt1, rows1)
    assert hit == 0                                                       # a miss: nothing cached yet
    reply = thinker.tokenizer.decode(thinker.tokenizer.encode("The sea is calm and dark."))
    turn2 = turn1 + [ChatMessage.text("assistant", reply), ChatMessage.text("user", "And in a storm, what then?")]
    ids2, prompt2, rows2, _ = _thinker_turn(thinker, "t2", turn2)
    users2 = prompt2.user_token_ids.shape[0]
    codes2, hit = _both(cached, uncached, "t2", prompt2, rows2)
    assert hit == (users1 // BS) * BS                                      # a partial hit: turn 1's user rows
    _, hit = _both(cached, uncached, "t2-again", prompt2, rows2)
    assert hit == (users2 // BS) * BS                                      # a hit: every full block of user rows
    # another system prompt, the same user turns: text rows are their token ids' embeddings, a hit
    _, prompt3, rows3, _ = _thinker_turn(thinker, "t3", [ChatMessage.text("system", "Be brief.")] + turn2[1:])
    _, hit = _both(cached, uncached, "t3", prompt3, rows3)
    assert hit == (users2 // BS) * BS
    assert extend.replays - replays == 3              # each hit went on from its blocks in the extend graph
    ref = reference_generate(tiny_model_dir, ids2, max_tokens=TOKENS, min_tokens=TOKENS, max_frames=FRAMES,
                             min_frames=FRAMES)
    assert torch.equal(codes2, ref.codes)
    get = metrics.REGISTRY.get_sample_value
    assert get("voxpipe_prefix_cache_tokens_total", {"stage": "talker", "kind": "hit"}) >= 3 * BS
    assert get("voxpipe_kv_capacity_tokens", {"stage": "talker"}) == cached.engine.runner.blocks.capacity_tokens
    assert cached.engine.runner.blocks.pool.used == 0


def _clip(thinker, seed: int, frames: int = 120) -> torch.Tensor:
    return torch.randn(thinker.cfg.audio.num_mel_bins, frames, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_audio_turns_hit_by_content_keys(thinker, cached, uncached, tiny_model_dir, loop):
    """Audio rows are the thinker's hidden layer: keyed by the thinker's prompt up to them and the
    clips' content, sent alone (text rows as ids). The same clip after the same words hits; another
    clip with the same placeholder ids misses from its run on; so does the same clip after other words."""
    clip, other = _clip(thinker, 1), _clip(thinker, 2)
    system = ChatMessage.text("system", "You listen to recordings and describe each one in careful detail.")

    def turn(c, text, rid, sys=system):
        msgs = [sys, ChatMessage("user", [ChatPart(text=text), ChatPart(features=c)])]
        ids, prompt, rows, _ = _thinker_turn(thinker, rid, msgs)
        return ids, prompt, rows

    ids, prompt, rows = turn(clip, "Please listen to this sound and tell me what it is:", "a1")
    mm = prompt.user_mm_mask
    first_mm = int(mm.nonzero()[0])
    assert prompt.user_rows is None and prompt.audio_rows.shape[0] == int(mm.sum()) and len(prompt.audio_keys) == 1
    assert prompt.audio_rows_follow
    assert first_mm > BS
    codes, hit = _both(cached, uncached, "a1", prompt, rows)
    assert hit == 0
    _, again, rows_again = turn(clip, "Please listen to this sound and tell me what it is:", "a1-again")
    assert again.audio_keys == prompt.audio_keys
    _, hit = _both(cached, uncached, "a1-again", again, rows_again)
    assert hit == (mm.shape[0] // BS) * BS                                  # past the audio rows
    probe, = _jobs(cached, [_start("probe", again, follow=True)])
    cached.engine.hold(probe)                       # what its Held says: the audio rows it need not be sent
    assert probe.held_rows == hit and probe.held_audio == int(mm[:hit].sum()) > 0
    cached.engine.runner.release(probe)
    _, moved, rows_moved = turn(other, "Please listen to this sound and tell me what it is:", "a2")
    assert moved.audio_keys != prompt.audio_keys
    _, hit = _both(cached, uncached, "a2", moved, rows_moved)
    assert (first_mm // BS) * BS == hit                                    # other content: a miss from its run
    _, ctx, rows_ctx = turn(clip, "Please listen to this sound and tell me what it is:", "a3",
                            sys=ChatMessage.text("system", "Another persona."))
    assert ctx.audio_keys != prompt.audio_keys      # the hidden rows depend on the thinker prompt before them
    _, hit = _both(cached, uncached, "a3", ctx, rows_ctx)
    assert hit <= first_mm
    ref = reference_generate(tiny_model_dir, ids, input_features=clip, max_tokens=TOKENS, min_tokens=TOKENS,
                             max_frames=FRAMES, min_frames=FRAMES)
    assert torch.equal(codes, ref.codes)


def test_a_fresh_talker_replica_behind_a_thinker_hit(thinker, uncached, tiny_model_dir, loop):
    """The thinker's cache hit (a conversation it has seen) and a talker replica that never saw it: the
    talker prompt carries every row the talker needs, so the replica misses and speaks the same."""
    fresh = _build("talker", tiny_model_dir)
    msgs = [ChatMessage.text("system", "A long system prompt that fills more than one block of tokens, surely."),
            ChatMessage.text("user", "What is the weather like on the coast today?")]
    _thinker_turn(thinker, "seen", msgs)
    _, prompt, rows, thinker_hit = _thinker_turn(thinker, "seen-again", msgs)
    assert thinker_hit > 0
    _, hit = _both(fresh, uncached, "fresh", prompt, rows)
    assert hit == 0
    _, hit = _both(fresh, uncached, "fresh-again", prompt, rows)
    assert hit > 0


def _text_prompt(thinker, text: str | list[ChatMessage]) -> tuple[TalkerPromptOut, torch.Tensor]:
    """A text prompt's talker prompt (as the thinker sends it before its prefill) and text rows of
    given tokens (no thinker forward). `text`: one user turn's, or the messages."""
    messages = [ChatMessage.text("user", text)] if isinstance(text, str) else text
    ids = render(thinker.tokenizer, thinker.cfg, messages).token_ids
    job = ThinkerJob(request_id="p", outbox=Outbox(asyncio.get_event_loop()), prompt=ids, talker_rows=True)
    prompt = thinker.runner.early_talker_prompt(job, ids_only=True)
    return prompt, thinker.runner.forced_rows(thinker.tokenizer.encode("Yes, of course, gladly."))


def test_eviction_under_a_small_pool_keeps_frames(thinker, uncached, tiny_model_dir, loop):
    small = _build("talker", tiny_model_dir, "--kv-cache-tokens", "96", "--max-len", "96", graphs=True)  # 6 blocks
    prompts = [_text_prompt(thinker, f"Question {i}: what colour is the sky over the harbour at {i} o'clock?")
               for i in range(4)]
    first, rows = prompts[0]
    _both(small, uncached, "first", first, rows)
    assert small.engine.runner.blocks.pool.cached > 0
    for i, (p, r) in enumerate(prompts[1:]):          # each takes blocks the earlier ones published
        _speak(small, [_start(f"p{i}", p)], [r])
    _, hit = _both(small, uncached, "again", first, rows)
    assert hit < (first.user_token_ids.shape[0] // BS) * BS                 # evicted, at least partly
    extend = small.engine.runner.extend_graphs
    replays = extend.replays
    _, hit = _both(small, uncached, "again-hit", first, rows)               # its blocks published again
    assert hit > 0 and extend.replays == replays + 1                       # a hit goes on in the extend graph
    assert small.engine.runner.blocks.pool.used == 0


def test_preemption_under_a_pool_too_small_for_the_batch_keeps_frames(thinker, uncached, tiny_model_dir, loop):
    small = _build("talker", tiny_model_dir, "--kv-cache-tokens", "64", "--max-len", "64", graphs=True)  # 4 blocks
    texts = ("Count to twenty.", "Name the planets.", "Sing me a song.")
    prompts = [_text_prompt(thinker, t) for t in texts]
    frames = 8
    need = [p.user_token_ids.shape[0] + 9 + frames for p, _ in prompts]
    assert max(need) <= 64 < sum(need)      # each one fits alone, not all three
    before = metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "talker"}) or 0
    got = _speak(small, [_start(f"j{i}", p, frames) for i, (p, _) in enumerate(prompts)], [r for _, r in prompts])
    after = metrics.REGISTRY.get_sample_value("voxpipe_preemptions_total", {"stage": "talker"})
    assert after > before, "the pool should have run out during decode"
    assert small.engine.runner.extend_graphs.replays > 0                   # the recomputes, in the extend graph
    for i, ((p, r), (codes, _)) in enumerate(zip(prompts, got)):
        (want, _), = _speak(uncached, [_start(f"solo{i}", p, frames)], [r])
        assert torch.equal(codes, want), i
    assert small.engine.runner.blocks.pool.used == 0


def test_one_step_with_a_hit_in_the_extend_graph_and_one_past_it_keeps_frames(thinker, cached, uncached, loop):
    """Extend graphs of at most 32 new rows (emulated): in one step a hit whose new rows fit goes on
    in the graph, a partial hit with more new rows goes on in the eager packed forward; the hit speaks
    as its miss did, the partial hit as the talker without the cache."""
    from voxpipe.services.talker.engine import TalkerEngine
    from voxpipe.services.talker.server import TalkerServicer

    runner = cached.engine.runner
    emulate, cuda_graphs.EMULATE = cuda_graphs.EMULATE, True
    try:
        engine = TalkerEngine(runner.model, runner.cfg, device=runner.device, max_active=4, max_len=cached.engine.max_len,
                              kv=KVPlan(blocks=64), prefill_graph_len=32, text_table=runner.text_table)
    finally:
        cuda_graphs.EMULATE = emulate
    narrow = TalkerServicer(engine, cached.opts, cached.cfg)
    short = _text_prompt(thinker, [ChatMessage.text("user", "Which bird sings first when the night is over?")])
    turn1 = [ChatMessage.text("user", "Describe the harbour at dawn for me.")]
    turn2 = turn1 + [ChatMessage.text("assistant", "Grey water, gulls."),
                     ChatMessage.text("user", "Now describe it at noon, with the fishing boats coming back in.")]
    long1, long2 = _text_prompt(thinker, turn1), _text_prompt(thinker, turn2)
    (miss, _), _ = _speak(narrow, [_start("m0", short[0], 2), _start("m1", long1[0], 2)], [short[1], long1[1]])
    replays = engine.runner.extend_graphs.replays
    got = _speak(narrow, [_start("hit", short[0], 2), _start("partial", long2[0], 2)], [short[1], long2[1]])
    assert engine.runner.extend_graphs.replays == replays + 1        # one step, one replay: the hit alone
    (want, _), = _speak(uncached, [_start("partial", long2[0], 2)], [long2[1]])
    for rid, p, (codes, done), ref in zip(("hit", "partial"), (short[0], long2[0]), got, (miss, want)):
        new_rows = p.user_token_ids.shape[0] + PROMPT_TAIL - done.cached_tokens
        assert done.cached_tokens > 0 and (new_rows <= 32) == (rid == "hit"), (rid, new_rows)
        assert torch.equal(codes, ref), rid                           # the hit as its miss; the partial as no cache
    assert engine.runner.blocks.pool.used == 0


def test_bad_audio_rows_and_keys_are_invalid_argument(thinker, cached, loop):
    clip = _clip(thinker, 3)
    msgs = [ChatMessage("user", [ChatPart(features=clip), ChatPart(text="What is it?")])]
    _, prompt, _, _ = _thinker_turn(thinker, "bad", msgs)
    cases = []
    s = _start("no-rows", prompt)
    s.prompt.ClearField("audio_rows")
    cases.append((s, "audio_rows (or prompt.user_rows) is required"))
    s = _start("short", prompt)
    s.prompt.audio_rows.CopyFrom(talker_prompt_proto(prompt).audio_rows)
    s.prompt.audio_rows.shape[0] = 1
    cases.append((s, "prompt.audio_rows"))
    s = _start("keys", prompt)
    s.prompt.audio_keys.append(b"k" * 16)
    cases.append((s, "2 keys for 1 runs"))
    s = _start("long-key", prompt)
    s.prompt.audio_keys[0] = b"k" * 65
    cases.append((s, "each key has 1 to 64 bytes"))
    s = _start("both", prompt)
    s.prompt.user_rows.CopyFrom(talker_prompt_proto(prompt).assistant_head)
    cases.append((s, "prompt."))
    for start, message in cases:
        with pytest.raises(Abort) as e:
            _jobs(cached, [start])
        assert e.value.code.name == "INVALID_ARGUMENT" and message in e.value.message, (start.request_id, e.value.message)


def talker_user_rows(cfg, ids: list[int]) -> int:
    """How many rows of the talker's prompt are user rows (tokens of user turns)."""
    from voxpipe.services.thinker.runner import talker_prompt

    t = torch.tensor(ids)
    return int(talker_prompt(cfg, t, torch.zeros(len(ids), 1), torch.zeros(len(ids), 1), torch.zeros(3, 1))
               .user_token_ids.shape[0])


def _talker_hits(stack) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['talker']}/metrics").text
    line = next((l for l in text.splitlines()
                 if l.startswith("voxpipe_prefix_cache_tokens_total") and 'stage="talker"' in l and 'kind="hit"' in l),
                None)
    return 0.0 if line is None else float(line.rsplit(" ", 1)[1])      # no sample before the first admission


def test_a_voice_turn_again_through_the_services_sends_only_new_rows_and_equals_transformers(stack, tiny_model_dir,
                                                                                             tokenizer, omni_config):
    """Thinker and talker as processes: an audio prompt's start goes without its audio rows, the talker
    answers what it holds (nothing the first time), the thinker's relay sends the rest; the same voice
    turn again is a talker hit. Both equal transformers."""
    from voxpipe.client import PipelineClient, SpeechRequest

    clip = torch.randn(omni_config.thinker.audio.num_mel_bins, 160, generator=torch.Generator().manual_seed(7)) * 0.5
    prompt = render(tokenizer, omni_config.thinker, [
        ChatMessage.text("system", "You listen to a recording and answer in a few words, carefully."),
        ChatMessage("user", [ChatPart(text="What do you hear in this recording?"), ChatPart(features=clip)])])
    ref = reference_generate(tiny_model_dir, prompt.token_ids, input_features=clip, max_tokens=TOKENS,
                             min_tokens=TOKENS, max_frames=FRAMES, min_frames=FRAMES)

    async def speak():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as client:
            return await client.collect(SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features,
                                                      max_tokens=TOKENS, min_tokens=TOKENS, max_frames=FRAMES,
                                                      min_frames=FRAMES, encoding=pb.AUDIO_FLOAT32, echo_frames=True))

    before = _talker_hits(stack)
    first = asyncio.run(speak())
    between = _talker_hits(stack)
    again = asyncio.run(speak())
    for res in (first, again):
        assert res.text_ids == ref.text_ids and torch.equal(res.codes, ref.codes)
    users = talker_user_rows(omni_config.thinker, prompt.token_ids)
    assert between == before and _talker_hits(stack) - between == (users // BS) * BS   # the audio rows held
