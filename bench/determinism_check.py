"""Batch invariance (`--deterministic`): each stage's engine, built as its service builds it, runs two
target requests (one greedy, one sampled with a seed) alone and inside a batch of c requests of other
lengths (a third of them sampled); the target's output bits (thinker: token ids, log probabilities,
talker rows; talker: codes; code2wav: the float32 samples) must be the same every time. Per target:
    cold       alone, the prefix cache emptied first (a miss: the whole prompt prefilled from 0)
    hit_miss   alone again, its prompt now in the prefix cache = cold (thinker, talker: a stage with one)
    repeatable alone, the cache emptied again = cold
    equal      inside the batch (the cache emptied first) = cold
and where a run differs, `differs` names the part and its first differing index (a token, a row, a
frame, a sample). Before any timing each engine runs the batch once untimed (first-sight kernel
compiles, allocator growth), so `batch_s` is a warm batch in either mode; per stage each mode's cost
at c is its batched wall time over the default mode's, minus 1. One JSON line per stage and mode (on
CUDA with `linears`: how many of the stage's nn.Linear layers took cuBLAS row calls and how many
the Triton kernel, determinism.LINEAR_PATHS, "batched": how many of the cuBLAS ones may put several
blocks of a prefill in one launch, "graph_batched": how many may also inside CUDA graphs;
`rows_check_s`: the seconds their start-up checks took; `conv_shapes`: how many of its convolutions' (layer,
input) shapes took cuDNN sample calls and how many the Triton path, determinism.CONV_SHAPES, and of
the cuDNN ones "spans_N": how many take calls of up to N samples, determinism.CONV_SPANS).
`--modes` may add `deterministic-triton`: the mode with every CUDA linear and convolution through the
Triton kernels (VOXPIPE_INVARIANT_MATMUL=triton VOXPIPE_INVARIANT_CONV=triton), as before.

    python -m voxpipe.bench.determinism_check --device cuda --load-format dummy --concurrency 64
    python -m voxpipe.bench.determinism_check --device cpu --concurrency 4      # the tiny checkpoint

Exits 1 if a deterministic run differs. The default mode's lines say how batch-dependent it is."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import struct
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from voxpipe.services.runtime import determinism
from voxpipe.services.runtime.engine import EngineRequest, Outbox, StageEngine
from voxpipe.services.runtime.outputs import AudioOut, Finished, FramesOut, TextOut
from voxpipe.services.runtime.sampling import SamplingParams
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.v1 import stages_pb2 as pb

STAGES = ("thinker", "talker", "code2wav")
MODES = ("default", "deterministic", "deterministic-triton")
GREEDY = SamplingParams()


def build_engine(stage: str, argv: list[str]) -> StageEngine:
    """The stage's engine as `voxpipe STAGE *argv` builds it (not started: callers step it; it serves
    nothing, so no port of its own is checked: --port 0 unless argv names one)."""
    from voxpipe.cli import build_parser
    from voxpipe.services.code2wav import server as code2wav_server
    from voxpipe.services.talker import server as talker_server
    from voxpipe.services.thinker import server as thinker_server

    ns = build_parser().parse_args([stage, "--port", "0", *argv])
    built = {"thinker": thinker_server, "talker": talker_server, "code2wav": code2wav_server}[stage].build(ns)
    return (built[0] if stage == "thinker" else built).engine


def run_together(engine: StageEngine, jobs: list[EngineRequest]) -> float:
    """Submit `jobs` at once and step the engine until none has work; the wall seconds it took."""
    for j in jobs:
        engine.submit(j)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def drained(job: EngineRequest) -> list:
    out = []
    while (entry := job.outbox.poll_timed()) is not None:
        out.append(entry[0])
    if not out or not isinstance(out[-1], Finished):
        raise RuntimeError(f"{job.request_id} did not finish: {out[-1] if out else 'no output'}")
    return out


Parts = dict[str, list[bytes]]   # an output's parts, each as its units' bytes (a token, a row, a frame, a sample)


@dataclass
class Probe:
    """How one stage's requests are made and their outputs read as bytes."""

    make: Callable[[asyncio.AbstractEventLoop, int, SamplingParams], EngineRequest]   # request k
    bits: Callable[[EngineRequest, list], Parts]                                      # its outputs' parts
    feed: Callable[[StageEngine, EngineRequest], None] = lambda engine, job: None    # code2wav: its frames


def differs(got: Parts, want: Parts) -> dict[str, int]:
    """Per part that differs, the index of its first differing unit (or the shorter one's length)."""
    out = {}
    for name, units in want.items():
        other = got.get(name, [])
        first = next((i for i, (a, b) in enumerate(zip(other, units)) if a != b), min(len(other), len(units)))
        if first < max(len(other), len(units)):
            out[name] = first
    return out


def forget_prefixes(engine: StageEngine) -> bool:
    """Empty the stage's prefix cache, so that the next request is a miss; False: it has none (code2wav)."""
    blocks = getattr(getattr(engine, "runner", None), "blocks", None)
    if blocks is None:
        return False
    blocks.pool.reset_cache()
    return True


def thinker_probe(engine, tokens: int) -> Probe:
    from voxpipe.services.thinker.engine import ThinkerJob
    from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render

    def make(loop, k: int, params: SamplingParams) -> ThinkerJob:
        text = "Tell me about the sea and the lighthouse. " + "More words here. " * (k * 7 % 23)
        rendered = render(engine.tokenizer, engine.cfg, [ChatMessage("user", [ChatPart(text=text)])])
        n = tokens if k == 0 else max(1, tokens // 2 + k * 5 % tokens)
        return ThinkerJob(request_id=f"r{k}", outbox=Outbox(loop, limit=100000), prompt=rendered.token_ids,
                          params=params, max_tokens=n, min_tokens=n, talker_rows=True, top_logprobs=3)

    def bits(job, items) -> Parts:
        outs = [i for i in items if isinstance(i, TextOut)]
        ids = [struct.pack("q", t) for o in outs for t in o.token_ids]
        lps = [json.dumps((e.token_id, e.logprob, *[x for alt in e.top for x in alt])).encode()
               for o in outs for e in (o.logprobs or ())]
        rows = [to_proto(r).data for o in outs if o.rows is not None for r in o.rows.unbind(0)]
        return {"token_ids": ids, "logprobs": lps, "talker_rows": rows}

    return Probe(make, bits)


def talker_probe(engine, frames: int) -> Probe:
    from voxpipe.services.talker.engine import TalkerJob

    h = engine.cfg.thinker_hidden_size

    def make(loop, k: int, params: SamplingParams) -> TalkerJob:
        g = torch.Generator().manual_seed(k)
        users = 4 + k * 3 % 17
        n = frames if k == 0 else max(1, frames // 2 + k * 3 % frames)
        return TalkerJob(request_id=f"r{k}", outbox=Outbox(loop, limit=100000),
                         user_rows=torch.randn(users, h, generator=g), user_mm_mask=torch.zeros(users, dtype=torch.bool),
                         head=torch.randn(3, h, generator=g), special=torch.randn(3, h, generator=g), params=params,
                         max_frames=n, min_frames=n, rows=list(torch.randn(3 + k % 5, h, generator=g).unbind(0)),
                         text_done=True)

    def bits(job, items) -> Parts:
        return {"codes": [to_proto(f).data for i in items if isinstance(i, FramesOut) for f in i.codes.unbind(0)]}

    return Probe(make, bits)


def code2wav_probe(engine, frames: int) -> Probe:
    from voxpipe.services.code2wav.engine import Code2WavJob

    q, size = engine.cfg.num_quantizers, engine.cfg.codebook_size

    def make(loop, k: int, params: SamplingParams) -> Code2WavJob:
        return Code2WavJob(request_id=f"r{k}", outbox=Outbox(loop, limit=100000), encoding=pb.AUDIO_FLOAT32)

    def feed(engine, job) -> None:
        k = int(job.request_id[1:])
        n = frames if k == 0 else max(1, frames // 2 + k * 3 % frames)
        engine.add_frames(job, torch.randint(0, size, (n, q), generator=torch.Generator().manual_seed(k)))
        engine.end_frames(job)

    def bits(job, items) -> Parts:
        samples = b"".join(i.samples.tobytes() for i in items if isinstance(i, AudioOut))
        return {"samples": [samples[i:i + 4] for i in range(0, len(samples), 4)]}

    return Probe(make, bits, feed)


PROBES = {"thinker": thinker_probe, "talker": talker_probe, "code2wav": code2wav_probe}


SAMPLED = SamplingParams(temperature=0.9, top_k=50, seed=11)


async def check_stage(engine: StageEngine, probe: Probe, concurrency: int, targets: tuple[str, ...],
                      warm: bool = True) -> dict:
    """The batch once untimed (`warm`), then per target (greedy, sampled): cold, cached and cold again
    alone, and inside `concurrency` requests (see the module docstring)."""
    loop = asyncio.get_running_loop()

    def request(k: int, params: SamplingParams) -> EngineRequest:
        job = probe.make(loop, k, params)
        probe.feed(engine, job)
        return job

    async def run(jobs: list[EngineRequest], cold: bool) -> tuple[dict[str, list], float]:
        if cold:
            forget_prefixes(engine)
        seconds = run_together(engine, jobs)
        await asyncio.sleep(0)
        return {j.request_id: drained(j) for j in jobs}, seconds

    def batch(params: SamplingParams) -> tuple[list[EngineRequest], EngineRequest]:
        jobs = [request(k, GREEDY if k % 3 else SAMPLED) for k in range(1, concurrency)]
        target = request(0, params)
        jobs.insert(len(jobs) // 2, target)
        return jobs, target

    if warm:
        await run(batch(GREEDY)[0], cold=True)                      # untimed
    out: dict = {}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED)):
        if name not in targets:
            continue
        runs = {}
        cached = (("hit_miss", False),) if forget_prefixes(engine) else ()
        for run_name, cold in (("cold", True), *cached, ("repeatable", True)):
            job = request(0, params)
            results, _ = await run([job], cold)
            runs[run_name] = probe.bits(job, results[job.request_id])
        jobs, target = batch(params)
        results, seconds = await run(jobs, cold=True)
        runs["equal"] = probe.bits(target, results[target.request_id])
        cold = runs.pop("cold")
        diff = {run_name: differs(parts, cold) for run_name, parts in runs.items()}
        out[name] = {**{run_name: not d for run_name, d in diff.items()},
                     "differs": {run_name: d for run_name, d in diff.items() if d},
                     "units": {part: len(units) for part, units in cold.items()}, "batch_s": round(seconds, 3)}
    return out


def checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """--model, --load-format, --device (see `resolve_model`)."""
    p.add_argument("--model", help="checkpoint folder (default: the tiny checkpoint; with --load-format dummy: "
                                   "the released config)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")


def resolve_model(args: argparse.Namespace) -> None:
    """args.model when not given: the tiny checkpoint, or with --load-format dummy the released config."""
    if args.model is None:
        if args.load_format == "dummy":
            from voxpipe.services.runtime.config import released_config_path
            args.model = str(released_config_path())
        else:
            from voxpipe.cli import default_model_dir
            args.model = str(default_model_dir())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    checkpoint_flags(p)
    p.add_argument("--concurrency", type=int, default=4, help="requests in the batch, the target among them")
    p.add_argument("--tokens", type=int, default=8, help="the target's thinker tokens (others: other counts)")
    p.add_argument("--frames", type=int, default=6, help="the target's talker / code2wav frames")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--modes", default="default,deterministic",
                   help="comma list of: default, deterministic, deterministic-triton (the mode with every CUDA linear "
                        "and convolution through the Triton kernels)")
    p.add_argument("--extra", default="", help="more flags for every stage")
    p.add_argument("--no-warm", dest="warm", action="store_false",
                   help="skip the untimed batch (a check of the bits only: batch_s then includes first-sight work)")
    p.add_argument("--targets", default="greedy,sampled",
                   help="which targets: greedy, sampled (code2wav, which does not sample: greedy only)")
    args = p.parse_args(argv)
    resolve_model(args)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"--modes: unknown {', '.join(sorted(unknown))} (expected of {', '.join(MODES)})")
    matmul, conv = determinism.GPU_MATMUL, determinism.GPU_CONV
    failed = False
    for stage in args.stages.split(","):
        seconds = {}
        for mode in args.modes.split(","):
            argv_stage = ["--model", args.model, "--device", args.device, "--load-format", args.load_format,
                          "--max-batch", str(args.concurrency), *args.extra.split()]
            if mode.startswith("deterministic"):
                argv_stage.append("--deterministic")
            # deterministic-triton: the mode with every CUDA linear through kernels.invariant.matmul (the
            # path before the cuBLAS row calls; VOXPIPE_INVARIANT_MATMUL=triton)
            determinism.GPU_MATMUL = "triton" if mode == "deterministic-triton" else matmul
            determinism.GPU_CONV = "triton" if mode == "deterministic-triton" else conv
            paths, conv_keys = dict(determinism.LINEAR_PATHS), set(determinism.CONV_SHAPES)
            check_s = determinism.CHECK_S.get("rows", 0.0)
            engine = build_engine(stage, argv_stage)
            linears = {k: v - paths.get(k, 0) for k, v in determinism.LINEAR_PATHS.items() if v > paths.get(k, 0)}
            check_s = determinism.CHECK_S.get("rows", 0.0) - check_s
            size = args.tokens if stage == "thinker" else args.frames
            targets = ("greedy",) if stage == "code2wav" else tuple(args.targets.split(","))
            result = asyncio.run(check_stage(engine, PROBES[stage](engine, size), args.concurrency, targets,
                                                 args.warm))
            checked = [ok for key, ok in determinism.CONV_SHAPES.items() if key not in conv_keys]
            convs = {"cudnn": sum(checked), "triton": len(checked) - sum(checked)} if checked else {}
            for key, spans in determinism.CONV_SPANS.items():     # the cuDNN shapes' larger calls
                if key not in conv_keys and determinism.CONV_SHAPES.get(key):
                    name = f"spans_{max(spans)}" if spans else f"spans_{determinism.GPU_SAMPLES}"
                    convs[name] = convs.get(name, 0) + 1
            line = {"stage": stage, "mode": mode, "concurrency": args.concurrency, "device": args.device,
                    **({"linears": linears} if linears else {}), **({"conv_shapes": convs} if convs else {}),
                    **({"rows_check_s": round(check_s, 2)} if check_s else {}),
                    **result}
            print(json.dumps(line), flush=True)
            if mode.startswith("deterministic") and not all(r["equal"] and r["repeatable"] and r.get("hit_miss", True)
                                                   for r in result.values()):
                failed = True
            seconds[mode] = sum(r["batch_s"] for r in result.values())
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if "default" in seconds and len(seconds) > 1:   # the batched runs' wall time, each mode over default
            print(json.dumps({"stage": stage, "concurrency": args.concurrency, "batch_s": seconds,
                              "cost": {mode: round(s / seconds["default"] - 1, 3) for mode, s in seconds.items()
                                       if mode != "default"}}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
