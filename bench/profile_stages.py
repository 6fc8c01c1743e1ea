"""Per-stage step profile on one GPU, each stage alone in this process (no gRPC, no other stage
competing for the GPU): the real engine step paths (`step()` with real jobs and outboxes), full-size
dummy weights. `python -m voxpipe.bench.profile_stages [--batches 1,16,64] [--temperatures 0,0.9]
[--deterministic]` (--deterministic: every model in batch-invariant mode, as the stages run it).
Prints JSON lines: mean step time per batch size per stage (and per temperature: 0 is greedy, else
every request samples, seeded by its index), then a torch.profiler summary of one step at the first
and the last batch size.

Two more stages profile what a request's first token waits for in the thinker:
- `long-prompt`: 2,500-token prompts (bench/BENCHMARK.md's long-prompt workload; `--prompt-tokens`), 1 and 4
  at once, for each `--prefill-chunks` step budget (the thinker's --prefill-chunk), served by the engine's
  own thread as a server runs it (the two-part cuDNN attention is planned there, for the default
  --prefill-chunk): the time to each first token, the steps taken, each chunk's attention path, and a
  kernel table of one packed step; and the attention of one 512-token chunk over 2,500 cached positions,
  masked SDPA against the flash path.
- `voice-in`: the shipped 5.7 s clip's features through the audio encoder, and the 139-token prompt's
  prefill that keeps the talker's hidden layer, as a CUDA graph and eagerly.
- `conversation-turn`: a long conversation's next turn (a `--prompt-tokens` history cached, 258 new
  tokens), timed from submission to its first token, and one profiled (kernel time against wall)."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from voxpipe.services.code2wav.engine import Code2WavEngine, Code2WavJob
from voxpipe.services.code2wav.model import Code2WavModel
from voxpipe.services.runtime import determinism
from voxpipe.services.runtime.config import OmniConfig, released_config_path
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.sampling import SamplingParams
from voxpipe.services.runtime.layers import serving_layout
from voxpipe.services.runtime.weights import load_module
from voxpipe.services.talker.engine import TalkerEngine, TalkerJob
from voxpipe.services.talker.model import TalkerModel
from voxpipe.services.thinker.engine import ThinkerEngine, ThinkerJob
from voxpipe.services.thinker.model import ThinkerModel
from voxpipe.services.thinker.tokenizer import ChatMLByteTokenizer

LOOP = asyncio.new_event_loop()  # outboxes queue callbacks on it; nobody needs to read them here
DETERMINISTIC = False            # --deterministic: every model in batch-invariant mode (determinism.apply)


def laid_out(model, dev: torch.device):
    """The model as a stage server lays it out: serving_layout, then batch-invariant mode with
    --deterministic."""
    serving_layout(model, dev)
    if DETERMINISTIC:
        determinism.apply(model)
    return model


def timed_ms(fn, reps: int = 20, warm: int = 0) -> float:
    """Mean ms of `fn()` over `reps` calls (after `warm` untimed ones), the GPU synchronized around."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000.0


def timed_steps(engine, steps: int) -> float:
    return timed_ms(engine.step, steps)


def drop_all(engine) -> None:
    """Cancel every request and free its slot, as the engine does for a cancelled stream."""
    with engine.lock:
        for j in engine.running + engine.waiting:
            j.cancelled = True
        engine._reap_and_check()


def report(stage: str, batch: int, ms: float, **extra) -> None:
    print(json.dumps({"stage": stage, "batch": batch, "step_ms": round(ms, 3), **extra}), flush=True)


def profile_one(engine, label: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        torch.cuda.synchronize()
    print(f"--- {label}: one step, top ops by CPU time", flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=48), flush=True)
    print(f"--- {label}: top ops by CUDA time", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=72), flush=True)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels)
    print(json.dumps({"profile": label, "kernels": len(kernels), "kernel_us": round(busy, 1)}), flush=True)


def profile_served_step(engine, jobs: list, label: str) -> None:
    """`profile_one` for an engine whose thread is running (the thread that holds its per-thread plans):
    the jobs submitted, the profiler on until that thread has ended one step (the engine lock held from
    then on, so its next step cannot begin before the device is synchronized), then the jobs cancelled."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        steps = engine.steps
        for j in jobs:
            engine.submit(j)
        while True:
            with engine.lock:
                if engine.steps > steps:
                    torch.cuda.synchronize()
                    break
            time.sleep(0.0002)
    for j in jobs:
        engine.cancel(j)
    print(f"--- {label}: top ops by CUDA time", flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=72), flush=True)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(e.device_time for e in kernels)
    print(json.dumps({"profile": label, "kernels": len(kernels), "kernel_us": round(busy, 1),
                      "chunks": {j.request_id: [[c.start, c.length, c.path] for c in j.chunks] for j in jobs}}),
          flush=True)
    while engine.active:
        time.sleep(0.001)


def admit_and_measure(eng, label: str, b: int, first: bool, last: bool = False) -> None:
    """Step until the b submitted requests all hold a slot (prefills in batches, plus a decode of
    everyone admitted so far), then time 20 steps of all b; profile one step for the first batch
    and the last batch sizes; then drop them."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while eng.waiting:
        eng.step()
    torch.cuda.synchronize()
    prefill_ms = (time.perf_counter() - t0) / b * 1000.0
    for _ in range(3):
        eng.step()
    report(label, b, timed_steps(eng, 20), prefill_plus_decode_ms_per_admission=round(prefill_ms, 1))
    if first or last:
        profile_one(eng, f"{label}, batch {b}")
    drop_all(eng)


@torch.inference_mode()
def sampling(temperature: float, index: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=index if temperature else None, **kw)


def label_of(what: str, temperature: float) -> str:
    return f"{what}, sampled at {temperature:g}" if temperature else what


def thinker(cfg: OmniConfig, batches: list[int], dev: torch.device, temperatures: list[float]) -> None:
    model = load_module(lambda: ThinkerModel(cfg.thinker), "", "thinker.", device=dev, dtype=torch.bfloat16,
                        load_format="dummy")
    laid_out(model, dev)
    eng = ThinkerEngine(model, cfg.thinker, ChatMLByteTokenizer(cfg.thinker, cfg.role_ids), device=dev,
                        max_active=max(batches), max_len=1024, eos_ids=(cfg.thinker.tokens.im_end,))
    gen = torch.Generator().manual_seed(0)
    for temperature, b in ((t, b) for t in temperatures for b in batches):
        jobs = [ThinkerJob(request_id=f"t{i}", outbox=Outbox(LOOP), max_tokens=10_000, min_tokens=10_000,
                           talker_rows=True, params=sampling(temperature, i),
                           prompt=[cfg.thinker.tokens.im_start] + torch.randint(1000, 100000, (98,), generator=gen).tolist()
                           + [cfg.thinker.tokens.assistant, 198])
                for i in range(b)]
        # the prompt needs an assistant head for talker rows
        for j in jobs:
            j.prompt[-3:] = [cfg.thinker.tokens.im_start, cfg.thinker.tokens.assistant, 198]
            eng.submit(j)
        admit_and_measure(eng, label_of("thinker decode", temperature), b, first=b == batches[0],
                          last=b == batches[-1])
    del eng, model
    torch.cuda.empty_cache()


@torch.inference_mode()
def talker(cfg: OmniConfig, batches: list[int], dev: torch.device, temperatures: list[float]) -> None:
    model = load_module(lambda: TalkerModel(cfg.talker), "", "talker.", device=dev, dtype=torch.bfloat16,
                        load_format="dummy")
    laid_out(model, dev)
    eng = TalkerEngine(model, cfg.talker, device=dev, max_active=max(batches), max_len=2048)
    h = cfg.talker.thinker_hidden_size
    for temperature, b in ((t, b) for t in temperatures for b in batches):
        for i in range(b):
            job = TalkerJob(request_id=f"k{i}", outbox=Outbox(LOOP), user_rows=torch.randn(20, h).bfloat16(),
                            user_mm_mask=torch.zeros(20, dtype=torch.bool), head=torch.randn(3, h).bfloat16(),
                            special=torch.randn(3, h).bfloat16(), speaker_id=cfg.talker.speakers["ethan"],
                            params=sampling(temperature, i, top_k=50, repetition_penalty=1.05), max_frames=10_000,
                            min_frames=10_000)
            job.rows.extend(torch.randn(1500, h).bfloat16().unbind(0))
            eng.submit(job)
        admit_and_measure(eng, label_of("talker step + code predictor (one frame each)", temperature), b,
                          first=b == batches[0], last=b == batches[-1])
    del eng, model
    torch.cuda.empty_cache()


@torch.inference_mode()
def code2wav(cfg: OmniConfig, batches: list[int], dev: torch.device, temperatures: list[float]) -> None:
    model = load_module(lambda: Code2WavModel(cfg.code2wav), "", "code2wav.", device=dev, dtype=torch.float32,
                        load_format="dummy")
    laid_out(model, dev)
    eng = Code2WavEngine(model, cfg.code2wav, device=dev, max_active=max(batches))
    q = cfg.code2wav.num_quantizers
    for b in batches:
        jobs = [Code2WavJob(request_id=f"c{i}", outbox=Outbox(LOOP)) for i in range(b)]
        for j in jobs:
            eng.submit(j)
            eng.add_frames(j, torch.randint(0, 2048, (1, q)))
        eng.step()                  # admission + first chunk
        def feed_and_step():
            for j in jobs:
                eng.add_frames(j, torch.randint(0, 2048, (1, q)))
            eng.step()
        report("code2wav frame (1 new frame each)", b, timed_ms(feed_and_step, 20, warm=3))
        if b == batches[0]:
            for j in jobs:
                eng.add_frames(j, torch.randint(0, 2048, (1, q)))
            profile_one(eng, f"code2wav frame batch {b}")
        drop_all(eng)
    del eng, model
    torch.cuda.empty_cache()


def _long_jobs(cfg: OmniConfig, n: int, length: int, gen: torch.Generator) -> list[ThinkerJob]:
    """n text prompts of `length` tokens; no talker rows (a served text prompt's talker prompt leaves at
    admission as token ids: its prefill copies nothing to the host, as these do not)."""
    tok = cfg.thinker.tokens
    vocab = cfg.thinker.text.vocab_size
    return [ThinkerJob(request_id=f"L{i}", outbox=Outbox(LOOP), max_tokens=4, min_tokens=4,
                       params=sampling(0.0, i),
                       prompt=[tok.im_start] + torch.randint(vocab // 8, min(100000, vocab // 2), (length - 4,),
                                                            generator=gen).tolist() + [tok.im_start, tok.assistant, 198])
            for i in range(n)]


def served_first_tokens(eng: ThinkerEngine, jobs: list[ThinkerJob]) -> tuple[dict[str, float], int]:
    """Submit the jobs to the running engine thread (as the server does); each one's ms to its first
    token from submission, and the engine steps taken until the last; then they are cancelled."""
    torch.cuda.synchronize()
    steps0 = eng.steps
    t0 = time.perf_counter()
    for j in jobs:
        eng.submit(j)
    first: dict[str, float] = {}
    while len(first) < len(jobs):
        for j in jobs:
            if j.generated and j.request_id not in first:
                first[j.request_id] = (time.perf_counter() - t0) * 1000.0
        time.sleep(0.0002)
    steps = eng.steps - steps0
    for j in jobs:
        eng.cancel(j)
    while eng.active:
        time.sleep(0.001)
    return first, steps


@torch.inference_mode()
def long_prompt(cfg: OmniConfig, budgets: list[int], dev: torch.device, length: int = 2500) -> None:
    """Each budget: n prompts of `length` tokens submitted at once to the engine thread (as served: the
    thinker plans its long-chunk attention there, for its default --prefill-chunk); each one's time to
    its first token (from submission), the steps, and each chunk's attention path (job.chunks: cudnn
    = the two-part path planned at start, flash, paged, extend graph)."""
    from voxpipe.services.runtime.kv_cache import _causal_flash, _sdpa

    model = load_module(lambda: ThinkerModel(cfg.thinker), "", "thinker.", device=dev, dtype=torch.bfloat16,
                        load_format="dummy")
    laid_out(model, dev)
    eng = ThinkerEngine(model, cfg.thinker, ChatMLByteTokenizer(cfg.thinker, cfg.role_ids), device=dev,
                        max_active=8, max_len=max(4096, length + 64), eos_ids=(cfg.thinker.tokens.im_end,))
    planned_for = eng.scheduler.prefill_chunk
    t0 = time.perf_counter()
    eng.start()
    print(json.dumps({"stage": "thinker", "cudnn_planned_chunk_shapes": eng.planned_chunks, "prefill_chunk": planned_for,
                      "plan_s": round(time.perf_counter() - t0, 2)}), flush=True)
    gen = torch.Generator().manual_seed(0)
    for budget in budgets:
        eng.scheduler.prefill_chunk = budget     # the engine thread is idle between measurements
        for n in (1, 4, 1):     # the first n = 1 warms up this budget's shapes
            jobs = _long_jobs(cfg, n, length, gen)
            first, steps = served_first_tokens(eng, jobs)
            print(json.dumps({"stage": "thinker long-prompt prefill", "prompt_tokens": length, "prompts": n,
                              "prefill_chunk": budget, "planned_for": planned_for, "steps": steps,
                              "first_token_ms": sorted(round(v, 1) for v in first.values()),
                              "chunks": {j.request_id: [[c.start, c.length, c.path] for c in j.chunks] for j in jobs}}),
                  flush=True)
    # one packed step of the largest budget, profiled as the engine thread serves it
    eng.scheduler.prefill_chunk = budgets[-1]
    profile_served_step(eng, _long_jobs(cfg, 2, length, gen),
                        f"thinker: one packed long-prompt step ({budgets[-1]} tokens of 2 {length}-token prompts)")
    eng.stop()
    # one layer's attention of a 512-token chunk over 2,500 positions: masked SDPA vs the flash path
    t = cfg.thinker.text
    q = torch.randn(1, t.num_heads, 512, t.head_dim, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, t.num_kv_heads, length, t.head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q_pos = torch.arange(length - 512, length, device=dev)
    mask = (torch.arange(length, device=dev)[None, :] <= q_pos[:, None])[None, None]
    scale = t.head_dim ** -0.5
    masked = _sdpa(q, k, v, mask, scale)
    flash = _causal_flash(q, k, v, scale)
    for name, fn in (("masked SDPA (before)", lambda: _sdpa(q, k, v, mask, scale)),
                     ("repeated heads + flash, causal_lower_right", lambda: _causal_flash(q, k, v, scale))):
        print(json.dumps({"stage": f"attention of a 512-token chunk over {length} positions, one layer", "path": name,
                          "ms": round(timed_ms(fn, 20, warm=3), 3)}), flush=True)
    print(json.dumps({"check": "flash vs masked SDPA", "max_abs": float((flash.float() - masked.float()).abs().max())}),
          flush=True)
    del eng, model
    torch.cuda.empty_cache()
    # the talker's prompt for such a request: the 2,500 user rows + its head, one eager prefill
    talker_model = load_module(lambda: TalkerModel(cfg.talker), "", "talker.", device=dev, dtype=torch.bfloat16,
                               load_format="dummy")
    laid_out(talker_model, dev)
    te = TalkerEngine(talker_model, cfg.talker, device=dev, max_active=8, max_len=max(4096, length + 64)).runner
    h = cfg.talker.text.hidden_size
    x = torch.randn(1, length + 9, h, device=dev, dtype=torch.bfloat16)
    last = torch.tensor([length + 8], device=dev)
    # the null table: the keys go to the scratch block (the prefill attends from its own k / v)
    tables = torch.full((1, te.blocks.blocks_for(length + 9)), te.cache.null, dtype=torch.long, device=dev)
    ms = timed_ms(lambda: te._prefill_fn(1, length + 9, x, last, tables), 5, warm=2)
    print(json.dumps({"stage": "talker prefill of a long prompt (eager)", "rows": length + 9, "ms": round(ms, 2)}),
          flush=True)
    del te, talker_model
    torch.cuda.empty_cache()


@torch.inference_mode()
def voice_in(cfg: OmniConfig, dev: torch.device) -> None:
    """The audio encoder over the shipped clip's features, then the voice-in prompt's prefill keeping
    the talker's hidden layer: the CUDA graph (what the runner replays) and eagerly."""
    from pathlib import Path

    from voxpipe.audio import read_wav, resample
    from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, render

    model = load_module(lambda: ThinkerModel(cfg.thinker), "", "thinker.", device=dev, dtype=torch.bfloat16,
                        load_format="dummy")
    laid_out(model, dev)
    tokenizer = ChatMLByteTokenizer(cfg.thinker, cfg.role_ids)
    eng = ThinkerEngine(model, cfg.thinker, tokenizer, device=dev, max_active=8, max_len=1024,
                        eos_ids=(cfg.thinker.tokens.im_end,))
    wav, rate = read_wav((Path(__file__).parent / "data" / "voice-in.wav").read_bytes())
    wav = resample(wav, rate, 16000)
    fe = FeatureExtractor(cfg.thinker.audio.num_mel_bins)
    t0 = time.perf_counter()
    feats = fe(wav)
    fe_ms = (time.perf_counter() - t0) * 1000.0
    prompt = render(tokenizer, cfg.thinker, [ChatMessage("user", [ChatPart(features=feats), ChatPart(text="Answer.")])])
    runner = eng.runner

    def timed(fn) -> float:
        return timed_ms(fn, 10, warm=3)

    f = feats.to(dev, torch.float32)
    enc_ms = timed(lambda: model.audio_tower(f))
    ids = torch.tensor(prompt.token_ids, device=dev)
    x = model.embed(ids, [f])[None]
    s = x.shape[1]
    last, slots = torch.tensor([s - 1], device=dev), torch.tensor([0], device=dev)
    keep = cfg.thinker.accept_hidden_layer
    eager_ms = timed(lambda: runner._prefill_fn(1, s, x, last, slots, keep))
    graphs = runner.prefill_graphs
    graph_ms = timed(lambda: graphs(1, s, x, last, slots)) if graphs is not None else None
    e_logits, e_hidden = runner._prefill_fn(1, s, x, last, slots, keep)
    g_logits, g_hidden = graphs(1, s, x, last, slots) if graphs is not None else (e_logits, e_hidden)
    print(json.dumps({"stage": "thinker voice-in", "clip_s": round(len(wav) / 16000, 2), "mel_frames": feats.shape[1],
                      "prompt_tokens": s, "features_ms_cpu": round(fe_ms, 2), "audio_encoder_ms": round(enc_ms, 2),
                      "prefill_keep_hidden_eager_ms": round(eager_ms, 2),
                      "prefill_keep_hidden_graph_ms": None if graph_ms is None else round(graph_ms, 2),
                      "graph_vs_eager_hidden_max_abs": float((g_hidden[0, :s].float() - e_hidden[0].float()).abs().max()),
                      "graph_vs_eager_logits_max_abs": float((g_logits.float() - e_logits.float()).abs().max())}),
          flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.audio_tower(f)
        torch.cuda.synchronize()
    kernels_ = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print(json.dumps({"profile": "audio encoder, one clip", "kernels": len(kernels_),
                      "kernel_us": round(sum(e.device_time for e in kernels_), 1)}), flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60), flush=True)
    del eng, model
    torch.cuda.empty_cache()


@torch.inference_mode()
def conversation_turn(cfg: OmniConfig, dev: torch.device, context: int = 25779, new: int = 258) -> None:
    """A long conversation's next turn at the thinker alone, as the conversation workload's turn 100
    sends it: a `context`-token history prefilled once (its full blocks then cached), then turns of
    the history plus `new` tokens, each timed from submission (admission, the prefix lookup) to its
    first token, and one more profiled: its kernel time against its wall time."""
    from torch.profiler import ProfilerActivity, profile

    model = load_module(lambda: ThinkerModel(cfg.thinker), "", "thinker.", device=dev, dtype=torch.bfloat16,
                        load_format="dummy")
    laid_out(model, dev)
    tok, vocab = cfg.thinker.tokens, cfg.thinker.text.vocab_size
    eng = ThinkerEngine(model, cfg.thinker, ChatMLByteTokenizer(cfg.thinker, cfg.role_ids), device=dev,
                        max_active=8, max_len=context + 8 * new + 64, eos_ids=(tok.im_end,))
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(vocab // 8, min(100000, vocab // 2), (n,), generator=gen).tolist()

    history = [tok.im_start] + ids(context - 1)
    head = [tok.im_start, tok.assistant, 198]

    def job_of(prompt: list[int], rid: str) -> ThinkerJob:
        # a spoken reply, as served: a routed talker is sent a text prompt's user turns as token ids and
        # looks their rows up itself (every row of a 26k-token prompt copied to the host: 3 x 25 ms on the H200)
        from voxpipe.v1 import stages_pb2 as pb

        return ThinkerJob(request_id=rid, outbox=Outbox(LOOP), max_tokens=1, min_tokens=1, talker_rows=True,
                          speech=pb.SpeechParams(), params=sampling(0.0, 0), prompt=prompt)

    def turn(job: ThinkerJob) -> tuple[float, int]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.submit(job)
        steps = 0
        while not job.generated:
            eng.step()
            steps += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1000.0, steps

    def settle() -> None:
        while eng.running or eng.waiting:
            eng.step()

    ms, steps = turn(job_of(history + head, "history"))
    settle()
    print(json.dumps({"stage": "thinker conversation turn", "what": "the history, cold", "prompt_tokens": context + 3,
                      "first_token_ms": round(ms, 1), "steps": steps}), flush=True)
    for i in range(4):
        ms, steps = turn(job_of(history + ids(new - 3) + head, f"turn{i}"))
        settle()
        print(json.dumps({"stage": "thinker conversation turn", "what": "history cached + new tokens",
                          "prompt_tokens": context + new, "first_token_ms": round(ms, 1), "steps": steps}),
              flush=True)
    job = job_of(history + ids(new - 3) + head, "profiled")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, _ = turn(job)
    settle()
    kernels_ = [e for e in prof.events() if e.device_type.name == "CUDA"]
    print(json.dumps({"profile": "thinker conversation turn (profiled)", "wall_ms": round(wall, 1),
                      "kernels": len(kernels_), "kernel_ms": round(sum(e.device_time for e in kernels_) / 1000, 2)}),
          flush=True)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60), flush=True)
    del eng, model
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--stages", default="thinker,talker,code2wav")
    p.add_argument("--temperatures", default="0", help="comma list; 0: greedy (code2wav does not sample)")
    p.add_argument("--prefill-chunks", default="512,2048,4096",
                   help="long-prompt: the thinker's --prefill-chunk values to measure (comma list)")
    p.add_argument("--prompt-tokens", type=int, default=2500, help="long-prompt: each prompt's length")
    p.add_argument("--deterministic", action="store_true",
                   help="every stage in batch-invariant mode, as `voxpipe STAGE --deterministic` runs it")
    args = p.parse_args()
    global DETERMINISTIC
    DETERMINISTIC = args.deterministic
    dev = torch.device("cuda")
    cfg = OmniConfig.load(released_config_path())
    batches = [int(x) for x in args.batches.split(",")]
    for stage in args.stages.split(","):
        if stage == "long-prompt":
            long_prompt(cfg, [int(x) for x in args.prefill_chunks.split(",")], dev, args.prompt_tokens)
        elif stage == "voice-in":
            voice_in(cfg, dev)
        elif stage == "conversation-turn":
            conversation_turn(cfg, dev, max(args.prompt_tokens, 1024))
        else:
            {"thinker": thinker, "talker": talker, "code2wav": code2wav}[stage](
                cfg, batches, dev, [float(t) for t in args.temperatures.split(",")])


if __name__ == "__main__":
    main()
