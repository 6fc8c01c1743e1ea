"""Constrained against free rows: the thinker's decode step time (the real engine step, jobs as the
server makes them, outboxes nobody reads) for a batch of B requests of which K are constrained,
against the same batch with none constrained. The constrained rows follow a JSON schema that never
completes within the run (an array of at least 10^6 objects {"name": string, "n": integer}), so
every step fills and applies their bitmasks, and no row ends.

    python -m voxpipe.bench.grammar_step --model DIR --device cpu --batches 1:1,8:1 --steps 10   # tiny checkpoint, CPU
    python -m voxpipe.bench.grammar_step --device cuda                                          # full size, dummy weights

Without --model: the released config with dummy bf16 weights and the ChatML byte tokenizer (as
`voxpipe bench` runs the GPU), CUDA graphs on. Prints one JSON line per (B, K): free and
constrained step ms and the ratio (medians of --repeats interleaved runs); then, with the pairs 1:1
and 64:8 (the default), the goal's line (issue #22: a constrained row costs <= 5 % more per step
than a free one, 1:1; a batch of 64 with 8 constrained rows within 3 % of 64 free, 64:8).

    python -m voxpipe.bench.grammar_step --choice-only --device cpu --batches 8:1,64:8,64:64

times the token choice alone (ThinkerRunner._choose: bitmask fill, its copy and application, argmax
or sampling) on random logits of the released vocabulary (152,064 ids) over a byte-level BPE
vocabulary (bench/grammar_libs.py's trained one, or --tokenizer DIR): the only part of a step that
a constraint changes, without a model (a CPU cannot run the full-size one)."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import torch

from voxpipe.services.runtime.config import OmniConfig, released_config_path
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.layers import serving_layout
from voxpipe.services.runtime.sampling import SamplingParams
from voxpipe.services.runtime.weights import load_module
from voxpipe.services.thinker.constraint import Constraint
from voxpipe.services.thinker.engine import ThinkerEngine, ThinkerJob
from voxpipe.services.thinker.model import ThinkerModel
from voxpipe.services.thinker.prompt import load_tokenizer

LOOP = asyncio.new_event_loop()     # outboxes queue callbacks on it; nobody reads them here
ENDLESS = {"type": "array", "minItems": 1_000_000, "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}}, "required": ["name", "n"]}}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


TOKENS_PER_STEP: dict[tuple[int, int], float] = {}   # the last measure's tokens a step, all rows, by (b, k)


def measure(eng: ThinkerEngine, cfg: OmniConfig, dev: torch.device, b: int, k: int, steps: int,
            temperature: float) -> float:
    """Mean decode step ms of b requests, the first k constrained (jump-forward decoding takes a
    constrained row's forced tokens several a step while at most engine.JUMP_FEED_ROWS run:
    TOKENS_PER_STEP says how many)."""
    compiled = eng.grammars.compile(Constraint.json_schema(ENDLESS))
    tok = cfg.thinker.tokens
    gen = torch.Generator().manual_seed(0)
    jobs = []
    for i in range(b):
        prompt = [tok.im_start] + torch.randint(0, 256, (96,), generator=gen).tolist() + [tok.im_start, tok.assistant, 10]
        job = ThinkerJob(request_id=f"g{i}", outbox=Outbox(LOOP), prompt=prompt, max_tokens=steps + 64,
                         min_tokens=0 if i < k else steps + 64,
                         params=SamplingParams(temperature=temperature, seed=i if temperature else None))
        if i < k:
            job.matcher = eng.grammars.matcher(compiled)
        jobs.append(job)
        eng.submit(job)
    while eng.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    sync(dev)
    made = sum(len(j.generated) for j in jobs)
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    sync(dev)
    ms = (time.perf_counter() - t0) / steps * 1e3
    TOKENS_PER_STEP[(b, k)] = (sum(len(j.generated) for j in jobs) - made) / steps
    with eng.lock:
        for j in eng.running + eng.waiting:
            j.cancelled = True
        eng._reap_and_check()
    return ms


def choice_only(args, pairs: list[tuple[int, int]], dev: torch.device) -> None:
    from voxpipe.bench.grammar_libs import trained_tokenizer
    from voxpipe.services.thinker.grammar import Grammars
    from voxpipe.services.thinker.runner import ThinkerRunner

    if dev.type == "cpu":
        torch.set_num_threads(1)      # a shared CPU: one thread's timings are the steadier
    cfg = OmniConfig.load(released_config_path())
    vocab, eos = cfg.thinker.text.vocab_size, cfg.thinker.tokens.im_end
    if args.tokenizer:
        from transformers import AutoTokenizer
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tokenizer = trained_tokenizer(151643)
    grammars = Grammars(tokenizer, vocab, (eos,))
    compiled = grammars.compile(Constraint.json_schema(ENDLESS))
    runner = ThinkerRunner.__new__(ThinkerRunner)     # the token choice needs no model
    runner.cfg, runner.device, runner.eos = cfg.thinker, dev, torch.tensor([eos], device=dev)
    runner._mask_host = runner._rows_host = None
    gen = torch.Generator(device=dev).manual_seed(0)
    for b, k in pairs:
        def run(constrained: int) -> float:
            jobs = [ThinkerJob(request_id=f"c{i}", outbox=None, prompt=[0],
                               params=SamplingParams(temperature=args.temperature, seed=i if args.temperature else None))
                    for i in range(b)]
            for i, j in enumerate(jobs):
                j.generator = j.params.generator(dev)
                if i < constrained:
                    j.matcher = grammars.matcher(compiled)
            times = []
            for _ in range(args.steps):
                logits = torch.randn(b, vocab, device=dev, generator=gen)
                sync(dev)
                t0 = time.perf_counter()
                tokens = runner._choose(jobs, logits)
                for j, t in zip(jobs, tokens):
                    if j.matcher is not None:
                        assert j.matcher.accept(t)
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times)
        runs = [(run(0), run(k)) for _ in range(args.repeats)]
        free, constrained = (statistics.median(r[i] for r in runs) for i in (0, 1))
        print(json.dumps({"choice_only": True, "batch": b, "constrained": k, "free_choice_ms": round(free, 3),
                          "constrained_choice_ms": round(constrained, 3), "extra_ms": round(constrained - free, 3),
                          "device": str(dev), "vocab": vocab, "bpe_tokens": len(tokenizer)}), flush=True)


@torch.inference_mode()
def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", help="a checkpoint folder (default: the released config, dummy weights)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batches", default="1:1,64:8", help="B:K pairs (batch, constrained rows)")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=3, help="free / constrained runs interleaved; medians reported")
    p.add_argument("--choice-only", action="store_true", help="time the token choice alone (no model)")
    p.add_argument("--tokenizer", help="--choice-only: an HF tokenizer folder for the vocabulary")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.batches.split(",")]
    if args.choice_only:
        choice_only(args, pairs, dev)
        return
    path = args.model or released_config_path()
    cfg = OmniConfig.load(path)
    weights = "auto" if args.model else "dummy"
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load_module(lambda: ThinkerModel(cfg.thinker), args.model or "", "thinker.", device=dev, dtype=dtype,
                        load_format=weights, ignore=("visual.",))
    serving_layout(model, dev)
    eng = ThinkerEngine(model, cfg.thinker, load_tokenizer(path, cfg), device=dev,
                        max_active=max(b for b, _ in pairs), max_len=1024, eos_ids=(cfg.thinker.tokens.im_end,),
                        cuda_graphs=dev.type == "cuda")
    ratios = {}
    for b, k in pairs:
        runs = [(measure(eng, cfg, dev, b, 0, args.steps, args.temperature),
                 measure(eng, cfg, dev, b, k, args.steps, args.temperature)) for _ in range(args.repeats)]
        free, constrained = (statistics.median(r[i] for r in runs) for i in (0, 1))
        ratios[(b, k)] = constrained / free
        print(json.dumps({"batch": b, "constrained": k, "repeats": args.repeats, "free_step_ms": round(free, 3),
                          "constrained_step_ms": round(constrained, 3), "ratio": round(constrained / free, 4),
                          "tokens_per_step": {"free": TOKENS_PER_STEP[(b, 0)], "constrained": TOKENS_PER_STEP[(b, k)]},
                          "device": str(dev), "vocab": cfg.thinker.text.vocab_size}), flush=True)
    if (1, 1) in ratios and (64, 8) in ratios:
        print(json.dumps({"goal": "a constrained row <= 5 % more per step (1:1); 64 rows with 8 constrained within 3 % "
                                  "of 64 free (64:8)", "ratio_1_1": round(ratios[(1, 1)], 4),
                          "ratio_64_8": round(ratios[(64, 8)], 4),
                          "met": ratios[(1, 1)] <= 1.05 and ratios[(64, 8)] <= 1.03, "device": str(dev)}), flush=True)


if __name__ == "__main__":
    main()
