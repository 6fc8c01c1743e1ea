"""xgrammar against llguidance on this machine's CPU: compile time of a tool schema (5 functions,
nested objects) and of a json_schema response format, cold and again, and the per-step cost of
filling a batch's token bitmasks while each row walks the tool grammar with random allowed tokens.

    python -m voxpipe.bench.grammar_libs [--tokenizer DIR] [--vocab 151643] [--batch 8] [--steps 200]

Without --tokenizer the vocabulary is a byte-level BPE of up to --vocab tokens trained here on the
installed Python sources (cached under /tmp; the merges it finds decide its final size). Results:
bench/RESULTS.md ("constrained decoding")."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from voxpipe.services.thinker.constraint import tool_call_schema
from voxpipe.services.thinker.grammar import vocabulary_bytes

_ADDRESS = {"type": "object", "properties": {"street": {"type": "string", "maxLength": 80},
                                             "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"], "additionalProperties": False}
# a typical tool set: 5 functions, nested objects, arrays, enums
TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["location"]}},
    {"name": "book_table", "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string"}, "time": {"type": "string"}, "party": {"type": "integer", "minimum": 1, "maximum": 20},
        "contact": {"type": "object", "properties": {"name": {"type": "string"}, "phone": {"type": "string"}},
                    "required": ["name"]}}, "required": ["restaurant", "time", "party"]}},
    {"name": "look_up_order", "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string"}, "include": {"type": "array", "items": {"enum": ["items", "shipping", "payment"]}}},
        "required": ["order_id"]}},
    {"name": "set_light", "parameters": {"type": "object", "properties": {
        "room": {"type": "string"}, "on": {"type": "boolean"}, "brightness": {"type": "number"},
        "color": {"type": "object", "properties": {"r": {"type": "integer"}, "g": {"type": "integer"}, "b": {"type": "integer"}}}},
        "required": ["room", "on"]}},
    {"name": "ship_parcel", "parameters": {"type": "object", "properties": {
        "from": _ADDRESS, "to": _ADDRESS, "weight_kg": {"type": "number"},
        "options": {"type": "array", "items": {"type": "object", "properties": {"kind": {"type": "string"}, "value": {"type": "string"}}}}},
        "required": ["from", "to"]}},
]
# a json_schema response format as the SDK's `parse` sends it (a pydantic model's schema)
RESPONSE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 100}, "rating": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "author": {"type": "object", "properties": {"name": {"type": "string"}, "email": {"type": "string"}},
               "required": ["name", "email"], "additionalProperties": False},
    "status": {"type": "string", "enum": ["draft", "published", "archived"]}},
    "required": ["title", "rating", "tags", "author", "status"], "additionalProperties": False}


def trained_tokenizer(vocab: int):
    """A byte-level BPE of `vocab` tokens trained on the interpreter's own library sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = Path(f"/tmp/voxpipe-bench-bpe-{vocab}.json")
    if not path.exists():
        files = sorted(Path(sys.prefix).rglob("*.py"))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<|im_end|>"])
        tok.train([str(f) for f in files], trainer)
        tok.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def bench_xgrammar(vocab: list[bytes], eos: int, schemas: dict[str, str], batch: int, steps: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    out = {"tokenizer_info_ms": ms(t0)}
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
    grammars = {}
    for name, schema in schemas.items():
        t0 = time.perf_counter()
        grammars[name] = compiler.compile_json_schema(schema, any_whitespace=False)
        out[f"{name}_compile_ms"] = ms(t0)
        t0 = time.perf_counter()
        compiler.compile_json_schema(schema, any_whitespace=False)
        out[f"{name}_cached_ms"] = ms(t0)
    matchers = [xgr.GrammarMatcher(grammars["tools"]) for _ in range(batch)]

    def fill(mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    out.update(fill_times(matchers, fill, lambda m: m.is_terminated(), lambda m, t: m.accept_token(t),
                          xgr.allocate_token_bitmask(batch, len(vocab)), len(vocab), eos, steps))
    return out


def bench_llguidance(vocab: list[bytes], eos: int, schemas: dict[str, str], batch: int, steps: int) -> dict:
    import llguidance as llg
    import llguidance.torch as llt

    class Words:
        eos_token_id, bos_token_id, tokens, special_token_ids = eos, None, vocab, [eos]

        def __call__(self, s):
            return []

    t0 = time.perf_counter()
    tok = llg.LLTokenizer(llg.TokenizerWrapper(Words()))
    out = {"tokenizer_info_ms": ms(t0)}
    grammars = {}
    for name, schema in schemas.items():
        t0 = time.perf_counter()
        grammars[name] = llg.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        m = llg.LLMatcher(tok, grammars[name])
        assert not m.is_error(), m.get_error()
        out[f"{name}_compile_ms"] = ms(t0)
        out[f"{name}_cached_ms"] = out[f"{name}_compile_ms"]   # no compiled form to cache: a matcher parses anew
    executor = llg.LLExecutor()
    matchers = [llg.LLMatcher(tok, grammars["tools"]) for _ in range(batch)]

    def fill(mask: torch.Tensor) -> None:
        llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], mask)

    out.update(fill_times(matchers, fill, lambda m: m.is_stopped(), lambda m, t: m.consume_token(t),
                          llt.allocate_token_bitmask(batch, len(vocab)), len(vocab), eos, steps))
    return out


def fill_times(matchers: list, fill, finished, accept, mask: torch.Tensor, vocab: int, eos: int, steps: int) -> dict:
    """Per step: restart finished matchers, time `fill(mask)` (the whole batch), then each row takes
    a random allowed token. The median and p90 fill times."""
    rng = random.Random(0)
    fills = []
    for _ in range(steps):
        for m in matchers:
            if finished(m):
                m.reset()
        t0 = time.perf_counter()
        fill(mask)
        fills.append(ms(t0))
        for i, m in enumerate(matchers):
            accept(m, pick(mask[i], vocab, rng, eos))
    return {"fill_batch_ms_median": statistics.median(fills), "fill_batch_ms_p90": sorted(fills)[int(0.9 * len(fills))]}


def pick(row: torch.Tensor, vocab: int, rng: random.Random, eos: int) -> int:
    """A random token the bitmask row allows (EOS only when nothing else is)."""
    bits = ((row[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab].nonzero().flatten().tolist()
    allowed = [t for t in bits if t != eos] or bits
    return rng.choice(allowed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", help="a tokenizer folder (HF); default: a trained BPE of --vocab tokens")
    ap.add_argument("--vocab", type=int, default=151643)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.tokenizer:
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(args.tokenizer)
    else:
        hf = trained_tokenizer(args.vocab)
    vocab = vocabulary_bytes(hf, len(hf))
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    schemas = {"tools": json.dumps(tool_call_schema(TOOLS)),
               "response": json.dumps(RESPONSE)}
    report = {"vocab": len(vocab), "batch": args.batch, "steps": args.steps}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        report[name] = fn(vocab, eos, schemas, args.batch, args.steps)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
