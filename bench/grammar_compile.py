"""Constraint compile time as the thinker pays it (services/thinker/grammar.Grammars): the
vocabulary's TokenizerInfo once per process, then per constraint a cold compile (its grammar
built from the constraint, `check`, then the library's compile over the vocabulary) and the cached
path (the LRU by content), for each thread count of the library's compiler.

    python -m voxpipe.bench.grammar_compile                      # a 74k byte-level BPE trained here
    python -m voxpipe.bench.grammar_compile --tokenizer DIR --threads 1,2,4,8 --repeats 5

Constraints: issue #22's typical tool schema (bench/grammar_libs.TOOLS: 5 functions, nested
objects) as tool_choice "required" and as one named function, and a json_schema response format.
Prints one JSON line per (constraint, threads): cold wall and CPU milliseconds (median and min of
`--repeats` cold compiles, each on a fresh cache), the part of it that builds the grammar
(`check`), and the cached lookup. Wall time on a loaded machine is mostly waiting: the CPU time is
the cost. Results: bench/RESULTS.md ("constraint compile time")."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def timed(fn) -> tuple[float, float]:
    """(wall ms, process CPU ms) of fn()."""
    w, c = time.perf_counter(), time.process_time()
    fn()
    return (time.perf_counter() - w) * 1e3, (time.process_time() - c) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", help="a checkpoint folder with an HF tokenizer (default: a BPE trained here)")
    p.add_argument("--vocab", type=int, default=151643, help="the trained BPE's target size (without --tokenizer)")
    p.add_argument("--threads", default="1,2,8", help="the compiler's thread counts to try, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="cold compiles per (constraint, threads)")
    args = p.parse_args(argv)

    from voxpipe.bench.grammar_libs import RESPONSE, TOOLS, trained_tokenizer
    from voxpipe.services.thinker.constraint import Constraint, tool_calls
    from voxpipe.services.thinker.grammar import Grammars, check

    if args.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        tok = trained_tokenizer(args.vocab)
    vocab = len(tok)
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    wall, cpu = timed(lambda: Grammars(tok, vocab, (stop,)))
    print(json.dumps({"tokenizer_info_ms": round(wall, 1), "tokenizer_info_cpu_ms": round(cpu, 1), "vocab": vocab}),
          flush=True)
    info = Grammars(tok, vocab, (stop,)).info
    constraints = {"tools_required": tool_calls(TOOLS, parallel=True),
                   "tools_named": tool_calls([TOOLS[4]], parallel=False),
                   "response_format": Constraint.json_schema(RESPONSE)}
    for name, constraint in constraints.items():
        for threads in (int(t) for t in args.threads.split(",")):
            colds, cpus, checks = [], [], []
            for _ in range(args.repeats):
                grammars = Grammars(tok, vocab, (stop,), threads=threads, info=info)
                checks.append(timed(lambda: check(constraint))[1])
                w, c = timed(lambda: grammars.compile(constraint))
                colds.append(w)
                cpus.append(c)
            cached = timed(lambda: grammars.compile(constraint))[0]
            print(json.dumps({"constraint": name, "threads": threads, "cold_ms_median": round(statistics.median(colds), 1),
                              "cold_ms_min": round(min(colds), 1), "cold_cpu_ms_median": round(statistics.median(cpus), 1),
                              "check_cpu_ms_median": round(statistics.median(checks), 1), "cached_ms": round(cached, 3),
                              "repeats": args.repeats}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
