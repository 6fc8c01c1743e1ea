"""Batch invariance (`--deterministic`): each stage's engine, built as its service builds it, runs two
target requests (one greedy, one sampled with a seed) alone, then each inside a batch of c requests
of other lengths (a third of them sampled); the target's output bits (thinker: token ids, log
probabilities, talker rows; talker: codes; code2wav: the float32 samples) must be equal alone and
batched. Per stage and mode it prints one JSON line: equal or not, repeatable (alone twice: the
thinker's second run finds its prompt in the prefix cache), and the wall time of the batched runs;
then per stage the mode's cost at c (deterministic over default batched wall time, minus 1).

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

from voxpipe.services.runtime.engine import EngineRequest, Outbox, StageEngine
from voxpipe.services.runtime.outputs import AudioOut, Finished, FramesOut, TextOut
from voxpipe.services.runtime.sampling import SamplingParams
from voxpipe.services.runtime.tensors import to_proto
from voxpipe.v1 import stages_pb2 as pb

STAGES = ("thinker", "talker", "code2wav")
GREEDY = SamplingParams()


def build_engine(stage: str, argv: list[str]) -> StageEngine:
    """The stage's engine as `voxpipe STAGE *argv` builds it (not started: callers step it)."""
    from voxpipe.cli import build_parser
    from voxpipe.services.code2wav import server as code2wav_server
    from voxpipe.services.talker import server as talker_server
    from voxpipe.services.thinker import server as thinker_server

    ns = build_parser().parse_args([stage, *argv])
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


@dataclass
class Probe:
    """How one stage's requests are made and their outputs read as bytes."""

    make: Callable[[asyncio.AbstractEventLoop, int, SamplingParams], EngineRequest]   # request k
    bits: Callable[[EngineRequest, list], bytes]                                      # its outputs' bytes
    feed: Callable[[StageEngine, EngineRequest], None] = lambda engine, job: None    # code2wav: its frames


def thinker_probe(engine, tokens: int) -> Probe:
    from voxpipe.services.thinker.engine import ThinkerJob
    from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render

    def make(loop, k: int, params: SamplingParams) -> ThinkerJob:
        text = "Tell me about the sea and the lighthouse. " + "More words here. " * (k * 7 % 23)
        rendered = render(engine.tokenizer, engine.cfg, [ChatMessage("user", [ChatPart(text=text)])])
        n = tokens if k == 0 else max(1, tokens // 2 + k * 5 % tokens)
        return ThinkerJob(request_id=f"r{k}", outbox=Outbox(loop, limit=100000), prompt=rendered.token_ids,
                          params=params, max_tokens=n, min_tokens=n, talker_rows=True, top_logprobs=3)

    def bits(job, items) -> bytes:
        outs = [i for i in items if isinstance(i, TextOut)]
        ids = [t for o in outs for t in o.token_ids]
        lps = [(e.token_id, e.logprob, *[x for alt in e.top for x in alt]) for o in outs for e in (o.logprobs or ())]
        rows = b"".join(to_proto(o.rows).data for o in outs if o.rows is not None)
        return struct.pack(f"{len(ids)}q", *ids) + json.dumps(lps).encode() + rows

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

    def bits(job, items) -> bytes:
        return b"".join(to_proto(i.codes).data for i in items if isinstance(i, FramesOut))

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

    def bits(job, items) -> bytes:
        return b"".join(i.samples.tobytes() for i in items if isinstance(i, AudioOut))

    return Probe(make, bits, feed)


PROBES = {"thinker": thinker_probe, "talker": talker_probe, "code2wav": code2wav_probe}


SAMPLED = SamplingParams(temperature=0.9, top_k=50, seed=11)


async def check_stage(engine: StageEngine, probe: Probe, concurrency: int, targets: tuple[str, ...]) -> dict:
    """Each target (greedy, sampled) alone (twice), then inside `concurrency` requests."""
    loop = asyncio.get_running_loop()
    sampled = SAMPLED

    def request(k: int, params: SamplingParams) -> EngineRequest:
        job = probe.make(loop, k, params)
        probe.feed(engine, job)
        return job

    async def alone(params: SamplingParams) -> bytes:
        job = request(0, params)
        run_together(engine, [job])
        await asyncio.sleep(0)
        return probe.bits(job, drained(job))

    out: dict = {}
    for name, params in (("greedy", GREEDY), ("sampled", sampled)):
        if name not in targets:
            continue
        solo, again = await alone(params), await alone(params)
        jobs = [request(k, GREEDY if k % 3 else sampled) for k in range(1, concurrency)]
        target = request(0, params)
        jobs.insert(len(jobs) // 2, target)
        seconds = run_together(engine, jobs)
        await asyncio.sleep(0)
        results = {j.request_id: drained(j) for j in jobs}
        out[name] = {"equal": probe.bits(target, results[target.request_id]) == solo, "repeatable": again == solo,
                     "bytes": len(solo), "batch_s": round(seconds, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="checkpoint folder (default: the tiny checkpoint; with --load-format dummy: "
                                   "the released config)")
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--concurrency", type=int, default=4, help="requests in the batch, the target among them")
    p.add_argument("--tokens", type=int, default=8, help="the target's thinker tokens (others: other counts)")
    p.add_argument("--frames", type=int, default=6, help="the target's talker / code2wav frames")
    p.add_argument("--stages", default=",".join(STAGES))
    p.add_argument("--modes", default="default,deterministic")
    p.add_argument("--extra", default="", help="more flags for every stage")
    p.add_argument("--targets", default="greedy,sampled",
                   help="which targets: greedy, sampled (code2wav, which does not sample: greedy only)")
    args = p.parse_args(argv)
    if args.model is None:
        if args.load_format == "dummy":
            from voxpipe.services.runtime.config import released_config_path
            args.model = str(released_config_path())
        else:
            from voxpipe.cli import default_model_dir
            args.model = str(default_model_dir())
    failed = False
    for stage in args.stages.split(","):
        seconds = {}
        for mode in args.modes.split(","):
            argv_stage = ["--model", args.model, "--device", args.device, "--load-format", args.load_format,
                          "--max-batch", str(args.concurrency), *args.extra.split()]
            if mode == "deterministic":
                argv_stage.append("--deterministic")
            engine = build_engine(stage, argv_stage)
            size = args.tokens if stage == "thinker" else args.frames
            targets = ("greedy",) if stage == "code2wav" else tuple(args.targets.split(","))
            result = asyncio.run(check_stage(engine, PROBES[stage](engine, size), args.concurrency, targets))
            line = {"stage": stage, "mode": mode, "concurrency": args.concurrency, "device": args.device, **result}
            print(json.dumps(line), flush=True)
            if mode == "deterministic" and not all(r["equal"] and r["repeatable"] for r in result.values()):
                failed = True
            seconds[mode] = sum(r["batch_s"] for r in result.values())
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if len(seconds) == 2:   # the batched runs' wall time, deterministic over default
            print(json.dumps({"stage": stage, "concurrency": args.concurrency, "batch_s": seconds,
                              "cost": round(seconds["deterministic"] / seconds["default"] - 1, 3)}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
