"""Per-stage step profile on one GPU, each stage alone in this process (no gRPC, no other stage
competing for the GPU): the real engine step paths (`step()` with real jobs and outboxes), full-size
dummy weights. `python -m voxpipe.bench.profile_stages [--batches 1,16,64] [--temperatures 0,0.9]`.
Prints JSON lines: mean step time per batch size per stage (and per temperature: 0 is greedy, else
every request samples, seeded by its index), then a torch.profiler summary of one step at the first
and the last batch size."""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from voxpipe.services.code2wav.engine import Code2WavEngine, Code2WavJob
from voxpipe.services.code2wav.model import Code2WavModel
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


def timed_steps(engine, steps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1000.0


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
    serving_layout(model, dev)
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
    serving_layout(model, dev)
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
    serving_layout(model, dev)
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
        for _ in range(3):
            feed_and_step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            feed_and_step()
        torch.cuda.synchronize()
        report("code2wav frame (1 new frame each)", b, (time.perf_counter() - t0) / 20 * 1000.0)
        if b == batches[0]:
            for j in jobs:
                eng.add_frames(j, torch.randint(0, 2048, (1, q)))
            profile_one(eng, f"code2wav frame batch {b}")
        drop_all(eng)
    del eng, model
    torch.cuda.empty_cache()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64")
    p.add_argument("--stages", default="thinker,talker,code2wav")
    p.add_argument("--temperatures", default="0", help="comma list; 0: greedy (code2wav does not sample)")
    args = p.parse_args()
    dev = torch.device("cuda")
    cfg = OmniConfig.load(released_config_path())
    batches = [int(x) for x in args.batches.split(",")]
    for stage in args.stages.split(","):
        {"thinker": thinker, "talker": talker, "code2wav": code2wav}[stage](
            cfg, batches, dev, [float(t) for t in args.temperatures.split(",")])


if __name__ == "__main__":
    main()
