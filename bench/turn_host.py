"""Host time of one conversation turn, piece by piece, against the context it carries: what a turn
costs on the request path besides the model's forwards (the thinker, the talker, the pipeline client's
encoding, the gateway's rendering), at contexts of ~1k, 8k and 25k tokens, on the CPU with the tiny
checkpoint. The point is the pieces that grow with the whole context instead of the new tokens; the
forwards are not timed (on the CPU they are not the GPU's).

    python -m voxpipe.bench.turn_host [--contexts 1024,8192,25779] [--reps 15] [--model DIR]

Each context is a conversation as bench/conversation.py sends it (~200-token user turns, replies of
~55 tokens, history re-sent as token ids). The turn before the last is served once through the real
thinker engine, so its blocks are published; then each piece of the last turn runs `--reps` times
and its median is reported (JSON lines, then a table):

- client: the ThinkerStart with the prompt's TokenIds (pipeline client), serialized
- thinker: the start parsed, `make_job` (ids, check_prompt, the assistant head, the job), admission
  (`runner.allocate`: prefix hashes, lookup, the table; then released), the early talker prompt, its
  TalkerPrompt message serialized, a decode step's block tables, a block's publication
- talker: the TalkerStart parsed, `make_job`, admission (`allocate`: the keys, prefix hashes, lookup;
  the previous turn's prompt published before), the prompt rows (tensor work on the CPU: labelled)
- gateway: a chat of that many tokens rendered (chat template, tokenization, placeholders), the
  conversation but its last message rendered before (its segments' ids remembered)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from voxpipe.tiny import model_or_tiny


def median_ms(fn: Callable[[], object], reps: int) -> float:
    fn()        # once untimed: first-call costs are not per-turn costs
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def conversation(cfg, context: int, seed: int = 0) -> tuple[list[int], list[int], list[tuple[str, list[int]]]]:
    """(the turn before the last's prompt, the last turn's prompt, the turns as (role, token ids)):
    a conversation as bench/conversation.py builds it, grown until the last prompt has ~`context` tokens."""
    from voxpipe.bench.conversation import Conversation, Settings

    rng = random.Random(seed)
    conv = Conversation(cfg, Settings(10**6, 200, 55, 0, 0, seed=seed), 0)
    prev = conv.ask()
    turns = [("user", conv.ids[-203:-2])]
    while True:
        reply = [rng.randrange(0, conv.high) for _ in range(55)]
        turns.append(("assistant", reply))
        conv.answered(prev, reply)
        prompt = conv.ask()
        turns.append(("user", prompt[-206:-5]))
        if len(prompt) >= context:
            return prev + reply + [cfg.thinker.tokens.im_end, conv.nl], prompt, turns
        prev = prompt


def parse(command: str, model: Path, *extra: str):
    from voxpipe.cli import build_parser

    return build_parser().parse_args([command, "--model", str(model), "--device", "cpu", "--port", "0",
                                      "--max-batch", "4", *extra])


def served(engine, job) -> None:
    """Run `job` through the engine to its end (its full blocks published)."""
    engine.submit(job)
    while not job.done:
        engine.step()


async def measure(model: Path, contexts: list[int], reps: int) -> list[dict]:
    from voxpipe.services.runtime.config import OmniConfig
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.server import talker_prompt_proto
    from voxpipe.services.runtime.tensors import ids_proto
    from voxpipe.services.talker import server as talker_server
    from voxpipe.services.thinker import server as thinker_server
    from voxpipe.services.thinker.prompt import ChatMessage, render
    from voxpipe.v1 import stages_pb2 as pb

    cfg = OmniConfig.load(model)
    top = max(contexts)
    th_args = parse("thinker", model, "--max-len", str(top + 2048), "--kv-cache-tokens", str(4 * (top + 2048)),
                    "--talker", "127.0.0.1:1")
    thinker, _ = thinker_server.build(th_args)
    talker = talker_server.build(parse("talker", model, "--kv-cache-tokens", str(4 * (top + 2048))))
    eng, teng = thinker.engine, talker.engine
    speech = pb.SpeechParams(speaker="ethan", max_frames=8)
    rows = []
    for context in contexts:
        before, prompt, turns = conversation(cfg, context)
        tokens = len(prompt)
        # the turn before: served, its blocks published (the last turn's prefix hit)
        warm = thinker.job_of(pb.ThinkerStart(max_tokens=1, sampling=pb.Sampling()), before, [])
        served(eng, warm)
        out: dict[str, float] = {}

        def start_msg() -> pb.ThinkerStart:
            s = pb.ThinkerStart(request_id="turn", max_tokens=1, min_tokens=1, sampling=pb.Sampling(), speech=speech)
            ids_proto(prompt, s.token_ids)
            return s

        out["client: ThinkerStart (TokenIds.packed) + serialize"] = median_ms(
            lambda: pb.ThinkerRequest(start=start_msg()).SerializeToString(), reps)
        wire = pb.ThinkerRequest(start=start_msg()).SerializeToString()
        out["thinker: parse the start"] = median_ms(lambda: pb.ThinkerRequest.FromString(wire), reps)
        start = pb.ThinkerRequest.FromString(wire).start
        out["thinker: make_job (ids, check_prompt, job)"] = median_ms(lambda: thinker.make_job(start), reps)
        ids, array = list(prompt), np.asarray(prompt, dtype=np.int64)
        out["  of which check_prompt"] = median_ms(lambda: thinker.check_prompt(ids, [], array=array), reps)

        def admit():
            job = thinker.make_job(start)
            assert eng.runner.allocate(job)
            hit = job.cached_tokens
            eng.runner.release(job)
            return hit

        hit = admit()
        job = thinker.make_job(start)
        make = median_ms(lambda: thinker.make_job(start), reps)
        out["thinker: admission (allocate + release)"] = median_ms(admit, reps) - make
        assert eng.runner.allocate(job)
        out["thinker: early talker prompt"] = median_ms(lambda: eng.runner.early_talker_prompt(job, ids_only=True),
                                                        reps)
        tp = eng.runner.early_talker_prompt(job, ids_only=True)
        tstart = pb.TalkerStart(request_id="turn", speaker="ethan", max_frames=8, prompt=talker_prompt_proto(tp))
        out["thinker: TalkerPrompt message + serialize"] = median_ms(
            lambda: pb.TalkerRequest(start=pb.TalkerStart(request_id="turn", speaker="ethan", max_frames=8,
                                                          prompt=talker_prompt_proto(tp))).SerializeToString(), reps)
        width = eng.runner.blocks.blocks_for(tokens + 1)
        out["thinker: a decode step's block tables"] = median_ms(lambda: eng.runner._tables([job], width), reps)
        job.prefilled = job.prefill_target
        job.generated = [1]
        table = job.table

        def publish():
            table.published = hit // eng.runner.blocks.block_size     # as if its prompt's blocks just filled
            eng.runner.publish(job)

        out["thinker: publish a filled block"] = median_ms(publish, reps)
        eng.runner.release(job)
        # the talker: the previous turn's prompt admitted and published, then this turn's
        twire = pb.TalkerRequest(start=tstart).SerializeToString()
        out["talker: parse the start"] = median_ms(lambda: pb.TalkerRequest.FromString(twire), reps)
        ts = pb.TalkerRequest.FromString(twire).start
        out["talker: make_job"] = median_ms(lambda: talker.make_job(ts), reps)
        tr = teng.runner
        prev_tp = eng.runner.early_talker_prompt(warm_job(thinker, before, speech), ids_only=True)
        pj = talker.make_job(pb.TalkerStart(request_id="prev", speaker="ethan", max_frames=8,
                                            prompt=talker_prompt_proto(prev_tp)))
        pj.rows.append(torch.tensor(1))
        assert tr.allocate(pj)
        tr.blocks.publish(pj.table, pj.keys, pj.cacheable, pj.spans)
        tr.release(pj)

        def talker_admit():
            j = talker.make_job(ts)
            assert tr.allocate(j)
            cached = j.table.cached_tokens
            tr.release(j)
            return cached

        thit = talker_admit()
        tmake = median_ms(lambda: talker.make_job(ts), reps)
        out["talker: admission (allocate + release)"] = median_ms(talker_admit, reps) - tmake
        tj = talker.make_job(ts)
        tj.rows.append(torch.tensor(1))
        out["talker: prompt rows, all (tensor work, CPU)"] = median_ms(lambda: tr._prompt(tj), reps)
        out["talker: prompt rows past its hit (tensor work, CPU)"] = median_ms(lambda: tr._prompt(tj, start=thit), reps)
        # the gateway: the same conversation as chat messages, the turn before rendered first (its
        # segments remembered, as a gateway serving the conversation has them)
        tok = eng.tokenizer
        messages = [ChatMessage.text(role, tok.decode(t)) for role, t in turns]
        out["gateway: render the chat"] = rendered_ms(tok, cfg.thinker, messages, max(3, reps // 3))
        rendered = len(render(tok, cfg.thinker, messages, segments=False).token_ids)
        row = {"context": tokens, "thinker_hit": hit, "talker_rows": int(tj.user_mm_mask.shape[0]),
               "talker_hit": thit, "gateway_tokens": rendered, "ms": {k: round(v, 3) for k, v in out.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def rendered_ms(tok, cfg, messages, reps: int) -> float:
    """Median ms of rendering `messages` after the same conversation but its last message was
    rendered (each rep with a fresh copy of those segments' SegmentTokens)."""
    from voxpipe.services.thinker.prompt import SegmentTokens, render

    warm = SegmentTokens()
    render(tok, cfg, messages[:-1], segments=warm)
    times = []
    for _ in range(reps):
        cache = SegmentTokens()
        cache.entries, cache.chars = OrderedDict(warm.entries), warm.chars
        t0 = time.perf_counter()
        render(tok, cfg, messages, segments=cache)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def warm_job(thinker, prompt: list[int], speech):
    from voxpipe.v1 import stages_pb2 as pb

    return thinker.job_of(pb.ThinkerStart(max_tokens=1, sampling=pb.Sampling(), speech=speech), prompt, [])


def table(rows: list[dict]) -> str:
    head = "| piece | " + " | ".join(f"{r['context']:,} tokens" for r in rows) + " |"
    lines = [head, "|---" * (len(rows) + 1) + "|"]
    for k in rows[0]["ms"]:
        lines.append(f"| {k} | " + " | ".join(f"{r['ms'][k]:.3f}" for r in rows) + " |")
    total = [sum(v for k, v in r["ms"].items() if not k.startswith(" ") and "tensor work" not in k
                 and not k.startswith("gateway")) for r in rows]
    lines.append("| **sum, client + thinker + talker (host)** | " + " | ".join(f"**{t:.2f}**" for t in total) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="1024,8192,25779", help="comma list of the last turn's prompt tokens")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny checkpoint, made now)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = model_or_tiny(args.model, "turn-host-")
    rows = asyncio.run(measure(model, [int(x) for x in args.contexts.split(",")], args.reps))
    print(table(rows))


if __name__ == "__main__":
    main()
