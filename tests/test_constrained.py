"""Grammar-constrained decoding (services/thinker/grammar.py) through a real thinker process and the
real gateway: constrained greedy replies equal transformers' greedy with the same grammar's mask as
a logits processor, free rows beside constrained ones equal their solo runs, sampled replies always
validate against their schemas, tool-call constraints, bad constraints refused naming them, the
grammar cache, and the unmodified OpenAI SDK's `chat.completions.parse`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from typing import Literal

import grpc
import jsonschema
import openai
import pytest
import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

from voxpipe.client import DoneEvent, PipelineClient, PipelineError, SpeechRequest, TextEvent
from voxpipe.services.thinker.constraint import (Constraint, ConstraintKind, tool_call_schema, tool_calls,
                                                 tool_calls_in_text)
from voxpipe.services.thinker.grammar import Grammars, allowed, check, vocabulary_bytes
from voxpipe.services.thinker.prompt import encode_text, render, user_turn
from voxpipe.services.thinker.tokenizer import ChatMLByteTokenizer
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

from conftest import StageProcesses
from oracle import load_reference_model

MAX_TOKENS = 160

PROFILE = {"type": "object", "properties": {
    "color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
    "name": {"type": "string", "maxLength": 8}},
    "required": ["color", "ok", "name"], "additionalProperties": False}
ORDER = {"type": "object", "properties": {
    "item": {"type": "string", "enum": ["tea", "coffee"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "notes": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    "ship": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "express": {"type": "boolean"}},
             "required": ["city", "express"], "additionalProperties": False}},
    "required": ["item", "count", "notes", "ship"], "additionalProperties": False}
FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "set_light", "parameters": {"type": "object", "properties": {
        "room": {"type": "string", "maxLength": 8}, "on": {"type": "boolean"}},
        "required": ["room", "on"], "additionalProperties": False}},
]
TOOL_CALL = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def thinker(tiny_model_dir):
    """A text-only thinker process of its own (no talker)."""
    procs = StageProcesses(tiny_model_dir)
    procs.start("thinker", "thinker")
    procs.wait_ready()
    yield procs.address("thinker")
    procs.stop()


async def generate(address: str, text: str, constraint: Constraint | None, temperature: float = 0.0,
                   seed: int | None = None, max_tokens: int = MAX_TOKENS, pc: PipelineClient | None = None
                   ) -> tuple[list[int], str, int]:
    """(token ids, text, finish reason) of one text-only reply."""
    async def run(client: PipelineClient):
        req = SpeechRequest(text=text, audio=False, max_tokens=max_tokens, temperature=temperature, seed=seed,
                            constraint=constraint)
        ids, out, done = [], [], None
        async for ev in client.stream(req):
            if isinstance(ev, TextEvent):
                ids += ev.token_ids
                out.append(ev.text)
            elif isinstance(ev, DoneEvent):
                done = ev
        return ids, "".join(out), done.text_finish
    if pc is not None:
        return await run(pc)
    async with PipelineClient(address) as client:
        return await run(client)


def reference_constrained(model_dir, tokenizer, cfg, text: str, constraint: Constraint, max_tokens: int) -> list[int]:
    """transformers' greedy thinker generate with the constraint's mask as a logits processor: the
    library's own matcher over our vocabulary (test_the_vocabulary_as_the_library_sees_it checks it
    against xgrammar's reading of the HF tokenizer; special tokens are never text here)."""
    from transformers import LogitsProcessorList

    th = cfg.thinker
    info = xgr.TokenizerInfo(vocabulary_bytes(tokenizer, th.text.vocab_size), xgr.VocabType.RAW,
                             vocab_size=th.text.vocab_size, stop_token_ids=[th.tokens.im_end])
    compiled = xgr.GrammarCompiler(info).compile_grammar(check(constraint))
    ids = render(tokenizer, th, user_turn(text)).token_ids

    class Mask:
        def __init__(self) -> None:
            self.matcher = xgr.GrammarMatcher(compiled)
            self.bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            if input_ids.shape[1] > len(ids):
                assert self.matcher.accept_token(int(input_ids[0, -1]))
            self.matcher.fill_next_token_bitmask(self.bitmask)
            xgr.apply_token_bitmask_inplace(scores, self.bitmask)
            return scores

    model = load_reference_model(model_dir)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model.thinker.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens,
                                     do_sample=False, eos_token_id=th.tokens.im_end,
                                     logits_processor=LogitsProcessorList([Mask()]))
    return out[0, len(ids):].tolist()


CONSTRAINTS = {
    "json_schema": Constraint.json_schema(ORDER),
    "json_object": Constraint(ConstraintKind.JSON_OBJECT),
    "regex": Constraint(ConstraintKind.REGEX, r"(yes|no), because [a-z ]{1,20}\."),
    "tool_calls": tool_calls(FUNCTIONS),
    "tool_calls_in_text": tool_calls_in_text(FUNCTIONS),
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_constrained_greedy_equals_transformers_with_the_same_mask(thinker, tiny_model_dir, tokenizer, omni_config,
                                                                   kind):
    text, c = "Answer in the form asked.", CONSTRAINTS[kind]
    max_tokens = 48 if kind in ("json_object", "tool_calls_in_text") else MAX_TOKENS   # free forms: a random model goes on
    ids, _, _ = asyncio.run(generate(thinker, text, c, max_tokens=max_tokens))
    assert ids == reference_constrained(tiny_model_dir, tokenizer, omni_config, text, c, max_tokens)


def test_free_rows_in_a_mixed_batch_equal_their_solo_runs(thinker):
    jobs = [("Tell me a story.", None, 0.0, None), ("What is the weather?", None, 1.0, 7),
            ("Give me an order.", Constraint.json_schema(ORDER), 0.0, None),
            ("Who are you?", Constraint.json_schema(PROFILE), 1.0, 11), ("Call a tool.", tool_calls(FUNCTIONS), 0.0, None)]

    async def main():
        async with PipelineClient(thinker) as pc:
            solo = [await generate(thinker, t, c, temp, seed, max_tokens=64, pc=pc) for t, c, temp, seed in jobs]
            together = await asyncio.gather(*[generate(thinker, t, c, temp, seed, max_tokens=64, pc=pc)
                                              for t, c, temp, seed in jobs])
        return solo, together

    solo, together = asyncio.run(main())
    assert together == solo
    assert solo[0][1] != solo[2][1]


def _validate(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def test_sampled_replies_always_validate_against_their_schema(thinker):
    """100 replies at temperature 1 (schemas of enums, bounded strings and arrays, integer ranges,
    nested objects): every one complete (STOP) and valid."""
    schemas = [PROFILE, ORDER]

    async def main():
        async with PipelineClient(thinker) as pc:
            out = []
            for base in range(0, 100, 20):
                out += await asyncio.gather(*[
                    generate(thinker, f"Reply {i}.", Constraint.json_schema(schemas[i % 2]), 1.0, seed=i, pc=pc)
                    for i in range(base, base + 20)])
            return out

    for i, (_, text, finish) in enumerate(asyncio.run(main())):
        assert finish == pb.STOP, (i, text)
        _validate(text, [PROFILE, ORDER][i % 2])


def _calls(text: str) -> list[dict]:
    """The reply is nothing but tool-call blocks, separated by newlines; their JSON objects."""
    blocks = TOOL_CALL.findall(text)
    assert "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks) == text, text
    return [json.loads(b) for b in blocks]


@pytest.mark.parametrize("named", [False, True])
def test_tool_call_constraint_replies_are_calls_valid_for_their_function(thinker, named):
    functions = FUNCTIONS[1:] if named else FUNCTIONS      # a named function: the one function
    by_name = {f["name"]: f["parameters"] for f in functions}
    c = tool_calls(functions, parallel=not named)

    async def main():
        async with PipelineClient(thinker) as pc:
            return await asyncio.gather(*[generate(thinker, "Turn on the light.", c, 1.0 if i else 0.0, seed=i, pc=pc)
                                          for i in range(12)])

    for _, text, finish in asyncio.run(main()):
        if finish != pb.STOP:     # parallel calls: a random model may go on calling until max_tokens
            assert not named and finish == pb.LENGTH and text.count("<tool_call>") > 1, text
            text = text[:text.rindex("\n<tool_call>")]     # the complete calls before the cut one
        calls = _calls(text)
        assert calls and (len(calls) == 1 or not named)
        for call in calls:
            assert set(call) == {"name", "arguments"} and call["name"] in by_name
            jsonschema.validate(call["arguments"], by_name[call["name"]])


def test_the_tool_call_schema_is_a_oneof_over_the_functions():
    schema = tool_call_schema(FUNCTIONS)
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}, schema)
    for bad in ({"name": "get_weather", "arguments": {"room": "x", "on": True}}, {"name": "nope", "arguments": {}},
                {"name": "set_light"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(ValueError):
        tool_calls([])


def test_tool_calls_in_text_constrain_only_the_blocks_the_model_opens(tokenizer, omni_config):
    th = omni_config.thinker
    grammars = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,))
    compiled = grammars.compile(tool_calls_in_text(FUNCTIONS))
    call = '<tool_call>\n{"name": "set_light", "arguments": {"room": "hall", "on": true}}\n</tool_call>'
    for text, ok, complete in (("Just text.", True, True), (f"On it. {call} Done.", True, True),
                               ('x <tool_call>\n{"name": "nope", "arguments": {}}', False, None),
                               ('x <tool_call>\n{"name": "set_light", "arguments": {"room": "hall", "on": 1}}', False, None),
                               (f"x {call[:-3]}", True, False)):
        m = xgr.GrammarMatcher(compiled)
        assert m.accept_string(text) == ok, text
        if ok:
            assert m.is_completed() == complete, text


BAD_CONSTRAINTS = [   # (constraint message, extra start fields, what the status names)
    (pb.Constraint(json_schema='{"type": "nope"}'), {}, 'constraint.json_schema does not compile: Unsupported type "nope"'),
    (pb.Constraint(json_schema="{not json"), {}, "constraint.json_schema is not valid JSON"),
    (pb.Constraint(json_schema='{"properties": {"a": {"$ref": "#/missing"}}}'), {}, "constraint.json_schema does not compile"),
    (pb.Constraint(regex="a(b"), {}, "constraint.regex does not compile"),
    (pb.Constraint(structural_tag='{"type": "structural_tag", "format": {"type": "nope"}}'), {},
     "constraint.structural_tag does not compile"),
    (pb.Constraint(structural_tag='{"format": {}}'), {}, "constraint.structural_tag must be an object"),
    (pb.Constraint(), {}, "constraint: set one of"),
    (pb.Constraint(json_object=False), {}, "constraint.json_object must be true"),
    (pb.Constraint(json_schema=""), {}, "constraint.json_schema is empty"),
    (pb.Constraint(regex="a" * (256 * 1024 + 1)), {}, "constraint.regex has 262145 bytes; the limit is 262144"),
    (pb.Constraint(json_object=True), {"min_tokens": 2}, "constraint excludes min_tokens"),
    (pb.Constraint(json_object=True), {"assistant_text": "hi"}, "assistant_text excludes constraint"),
]


@pytest.mark.parametrize("constraint,extra,names", BAD_CONSTRAINTS, ids=[b[2][:40] for b in BAD_CONSTRAINTS])
def test_bad_constraints_are_invalid_argument_naming_them(thinker, constraint, extra, names):
    async def main():
        async with grpc.aio.insecure_channel(thinker, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
            start = pb.ThinkerStart(text="hi", **({} if "assistant_text" in extra else {"max_tokens": 4}), **extra)
            start.constraint.SetInParent()
            start.constraint.CopyFrom(constraint)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in pb_grpc.ThinkerStub(ch).Generate(iter([pb.ThinkerRequest(start=start)])):
                    pass
            return e.value
    err = asyncio.run(main())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and names in err.details(), err.details()
    assert len(err.details()) < 1000
    # the thinker serves the next request as before
    assert asyncio.run(generate(thinker, "hi", Constraint.json_schema(PROFILE)))[2] == pb.STOP


def test_pipeline_client_reports_an_invalid_schema(thinker):
    with pytest.raises(PipelineError) as e:
        asyncio.run(generate(thinker, "hi", Constraint.json_schema({"type": "object", "required": "x"})))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "constraint.json_schema" in e.value.details


def _walk(grammars: Grammars, compiled, steps: int = 30) -> list[list[int]]:
    """The allowed token sets along a walk that always takes the smallest allowed token."""
    m = grammars.matcher(compiled)
    mask = torch.empty(1, grammars.words, dtype=torch.int32)
    seen = []
    for _ in range(steps):
        if m.done:
            break
        m.fill(mask, 0)
        ok = allowed(mask, grammars.vocab_size)[0].nonzero().flatten().tolist()
        seen.append(ok)
        assert m.accept(ok[0])
    return seen


def test_the_grammar_cache_gives_the_uncached_grammar_on_hit_and_after_eviction(tokenizer, omni_config):
    th = omni_config.thinker
    a, b, c = (Constraint.json_schema(PROFILE), Constraint.json_schema(ORDER), tool_calls(FUNCTIONS))
    fresh = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,), cache_size=0, rule_cache_bytes=0)
    grammars = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,), cache_size=2)
    grammars.warm()        # the library's cache of rules' masks: b and c then partly hit what a computed
    want = {k: _walk(fresh, fresh.compile(x)) for k, x in (("a", a), ("b", b), ("c", c))}
    # a library cache too small for a grammar (every entry evicted): the same masks again
    tiny = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,), cache_size=0, rule_cache_bytes=1, info=fresh.info)
    assert all(_walk(tiny, tiny.compile(x)) == want[k] for k, x in (("a", a), ("c", c), ("a", a)))
    first = grammars.compile(a)                                               # miss
    assert grammars.compile(Constraint(a.kind, json.dumps(PROFILE, indent=2))) is first   # same content: hit
    assert _walk(grammars, first) == want["a"]
    grammars.compile(b), grammars.compile(c)                                  # a evicted (LRU of 2)
    assert (grammars.hits, grammars.misses) == (1, 3) and len(grammars.cache) == 2
    again = grammars.compile(a)                                               # miss after eviction
    assert again is not first and grammars.misses == 4
    assert _walk(grammars, again) == want["a"] and _walk(grammars, grammars.compile(c)) == want["c"]
    reordered = dict(reversed(list(PROFILE["properties"].items())))           # property order is content
    assert Constraint.json_schema({**PROFILE, "properties": reordered}).key() != a.key()


def _json_gaps(text: str) -> list[int]:
    """The places outside the strings of JSON `text` (whitespace may go between its tokens)."""
    gaps, in_string, escape = [], False, False
    for i, ch in enumerate(text):
        if in_string:
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
            elif ch == '"':
                in_string = False
                gaps.append(i + 1)
            continue
        gaps.append(i)
        if ch == '"':
            in_string = True
        elif ch != " ":
            gaps.append(i + 1)
    return sorted(set(gaps))


def test_constrained_json_has_bounded_whitespace(tokenizer, omni_config):
    """Issue 22: whitespace inside constrained JSON is bounded, so that a weak model cannot loop on
    spaces or newlines until max_tokens. A json_object, json_schema, tool_calls or tool_calls_in_text
    grammar takes the reply's compact JSON (json.dumps' form: one space after ':' and ',') and
    refuses it with one more space, newline or tab anywhere JSON allows whitespace (each variant
    still valid JSON)."""
    th = omni_config.thinker
    grammars = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,))
    order = json.dumps({"item": "tea", "count": 2, "notes": ["a", "b"], "ship": {"city": "Oslo", "express": True}})
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}})
    cases = [(Constraint(ConstraintKind.JSON_OBJECT), "", order, ""), (Constraint.json_schema(ORDER), "", order, ""),
             (tool_calls(FUNCTIONS), "<tool_call>\n", call, "\n</tool_call>"),
             (tool_calls_in_text(FUNCTIONS), "Sure. <tool_call>\n", call, "\n</tool_call>")]
    refused = 0
    for constraint, head, body, tail in cases:
        compiled = grammars.compile(constraint)
        assert grammars.matcher(compiled).m.accept_string(head + body + tail), constraint.kind
        for gap in _json_gaps(body):
            for ws in (" ", "\n", "\t"):
                wider = body[:gap] + ws + body[gap:]
                try:
                    assert json.loads(wider) == json.loads(body)
                except ValueError:      # inside a literal (tr ue, 2 3): not JSON, not a case
                    continue
                assert not grammars.matcher(compiled).m.accept_string(head + wider + tail), (constraint.kind, wider)
                refused += 1
    assert refused > 300


def test_the_compile_bench_reports_the_goal(tiny_model_dir, capsys):
    """bench/grammar_compile over the tiny checkpoint's tokenizer, one repeat: a row per constraint
    and the goal's line (the tool schema's first compile, warmed, and its cached lookup)."""
    from voxpipe.bench.grammar_compile import main

    assert main(["--tokenizer", str(tiny_model_dir), "--repeats", "1", "--threads", "1"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    goal = lines[-1]
    assert {r["constraint"] for r in lines[1:-1]} == {"tools_required", "tools_named", "response_format"}
    assert goal["first_compile_ms"] > 0 and goal["cached_ms"] < goal["first_compile_ms"] and goal["cores"] >= 1


def test_concurrent_compiles_of_one_constraint_compile_once(tokenizer, omni_config):
    from concurrent.futures import ThreadPoolExecutor

    th = omni_config.thinker
    grammars = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,))
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(grammars.compile, [tool_calls(FUNCTIONS)] * 8))
        assert all(g is got[0] for g in got) and (grammars.misses, grammars.hits) == (1, 7)
        bad = [pool.submit(grammars.compile, Constraint.json_schema({"type": "nope"})) for _ in range(4)]
    for f in bad:
        with pytest.raises(ValueError, match="constraint.json_schema does not compile"):
            f.result()
    assert not grammars.running and len(grammars.cache) == 1


def test_the_vocabulary_as_the_library_sees_it(tokenizer, omni_config):
    """Byte-level BPE pieces as bytes (xgrammar's own reading of the HF tokenizer agrees), special
    tokens and padding ids empty; the ChatML byte tokenizer: byte ids as themselves."""
    th = omni_config.thinker
    vocab = vocabulary_bytes(tokenizer, th.text.vocab_size)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=th.text.vocab_size)
    for i, piece in enumerate(vocab):
        if piece:
            assert piece == info.decoded_vocab[i], i
    assert vocab[th.tokens.im_end] == vocab[th.tokens.im_start] == b"" and vocab[-1] == b""
    assert b"".join(vocab[t] for t in tokenizer.encode('{"a": 1}')) == b'{"a": 1}'
    vocab = vocabulary_bytes(ChatMLByteTokenizer(th, {}), th.text.vocab_size)
    assert vocab[:256] == [bytes([b]) for b in range(256)] and not any(vocab[256:])


def test_a_constraint_over_the_chatml_byte_tokenizer_generates_valid_json():
    """Bare configs (full-size dummy weights: the released config) use the ChatML byte tokenizer:
    the walk that takes the largest allowed byte each step ends in a reply valid for the schema."""
    from importlib.resources import files

    from voxpipe.services.runtime.config import OmniConfig

    cfg = OmniConfig.load(files("voxpipe.configs") / "qwen3-omni-30b-a3b-instruct.json")
    th = cfg.thinker
    grammars = Grammars(ChatMLByteTokenizer(th, {}), th.text.vocab_size, (th.tokens.im_end,))
    m = grammars.matcher(grammars.compile(Constraint.json_schema(PROFILE)))
    mask = torch.empty(1, grammars.words, dtype=torch.int32)
    out = bytearray()
    while not m.done:
        m.fill(mask, 0)
        tok = allowed(mask, grammars.vocab_size)[0].nonzero().flatten().tolist()[-1]
        assert m.accept(tok)
        if tok != th.tokens.im_end:
            out.append(tok)
        assert len(out) < 400
    _validate(out.decode(), PROFILE)


# ---------------------------------------------------------------- the gateway, the unmodified OpenAI SDK

class Light(BaseModel):
    room: str = Field(max_length=8)
    on: bool
    level: Literal["low", "mid", "high"]


def test_sdk_parse_with_a_pydantic_model(client, model):
    for temperature, seed in ((0, None), (1, 3), (1, 4)):
        done = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Light?"}],
                                             response_format=Light, max_tokens=MAX_TOKENS, temperature=temperature,
                                             seed=seed)
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Light)
        jsonschema.validate(json.loads(choice.message.content), Light.model_json_schema())


def test_json_object_and_streamed_json_schema(client, model):
    done = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "JSON please"}],
                                          response_format={"type": "json_object"}, max_tokens=48, temperature=0)
    text = done.choices[0].message.content
    assert text.startswith("{")
    if done.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Order"}], stream=True,
                                            response_format=fmt, max_tokens=MAX_TOKENS, temperature=1, seed=5)
    chunks = list(stream)
    _validate("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), ORDER)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_sdk_gets_a_400_naming_an_invalid_schema(client, model):
    """Twice: the second answer comes from the remembered check (grammar.check_remembered), the same."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/no"}}}}}
    messages = []
    for _ in range(2):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], response_format=fmt,
                                           max_tokens=4)
        assert e.value.param == "response_format.json_schema.schema" and "#/no" in e.value.message
        messages.append(e.value.message)
    assert messages[0] == messages[1]


def test_a_checked_constraint_is_remembered_by_its_content(monkeypatch):
    """The gateway's check of a constraint (does it compile?) runs once per content: a pass is
    remembered (checked_before), a failure raises the same error again without being taken for a
    pass; the memory is bounded (LRU), keyed by the content hash, so an equal constraint built anew hits."""
    from voxpipe.services.thinker import grammar

    monkeypatch.setattr(grammar, "_checked", type(grammar._checked)())
    monkeypatch.setattr(grammar, "CHECKED_KEYS", 2)
    calls = []
    real = grammar.check
    monkeypatch.setattr(grammar, "check", lambda c: calls.append(c.key()) or real(c))
    good = [Constraint.json_schema({"type": "object", "properties": {"n": {"type": "integer", "maximum": i}}})
            for i in range(3)]
    bad = Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/no"}}})
    assert not grammar.checked_before(good[0])
    grammar.check_remembered(good[0])
    assert grammar.checked_before(Constraint.json_schema(json.loads(good[0].text)))     # equal content, a new object
    grammar.check_remembered(good[0])
    assert calls == [good[0].key()]
    errors = []
    for _ in range(2):
        with pytest.raises(grammar.GrammarError) as e:
            grammar.check_remembered(bad)
        errors.append(str(e.value))
        assert not grammar.checked_before(bad)
    assert errors[0] == errors[1] and "#/no" in errors[0] and calls.count(bad.key()) == 1
    grammar.check_remembered(good[1])           # the bound is 2: good[0], the least recently used, goes
    assert not grammar.checked_before(good[0]) and grammar.checked_before(good[1])
    grammar.check_remembered(good[0])
    assert calls.count(good[0].key()) == 2


# ---------------------------------------------------------------- jump-forward decoding, in process

@pytest.fixture(scope="module")
def engine(tiny_model_dir, tokenizer, omni_config):
    """A thinker engine in this process on the tiny checkpoint (its steps driven by the test)."""
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker.engine import ThinkerEngine
    from voxpipe.services.thinker.model import ThinkerModel

    th = omni_config.thinker
    model = load_module(lambda: ThinkerModel(th), str(tiny_model_dir), "thinker.", device=torch.device("cpu"),
                        dtype=torch.float32, load_format="auto", ignore=("visual.",))
    return ThinkerEngine(model, th, tokenizer, device=torch.device("cpu"), max_active=8, max_len=1024,
                         eos_ids=(th.tokens.im_end,), cuda_graphs=False)


def run_jobs(engine, specs: list[dict], jump: bool, monkeypatch, cancel_after: int | None = None,
             catch_up: bool = False, draft: bool = False, ended: list[int] | None = None,
             prefill_draft: bool = True, streams: list | None = None) -> list:
    """Each spec's job (prompt, constraint, opened: text its reply already began with, talker_rows,
    top_logprobs, ...) run to its end, jump-forward on or off (`catch_up`: engine.JUMP_FEED_ROWS 0
    after the first step), the drafts of forced text on or off (`draft`; `prefill_draft`: the text
    forced before any choice drafted in the prefill); a spec without a constraint is a free row: per
    job (generated ids, finish reason or None), and the steps taken. `cancel_after`: the first job is
    cancelled after that many steps. `ended`: filled with the step each job's reply ended in.
    `streams`: filled with each job's TextOuts as sent (token ids, talker rows [n, H] or None, log
    probabilities), joined."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import Finished, TextOut
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.thinker import engine as thinker_engine
    from voxpipe.services.thinker.engine import ThinkerJob
    from voxpipe.services.thinker.prompt import encode_text

    monkeypatch.setattr(thinker_engine, "JUMP_TOKENS", 64 if jump else 0)
    monkeypatch.setattr(thinker_engine, "JUMP_FEED_ROWS", 8)
    monkeypatch.setattr(engine, "draft_forced", draft)
    monkeypatch.setattr(engine, "draft_prefill", prefill_draft)
    loop = asyncio.new_event_loop()
    jobs = []
    for i, s in enumerate(specs):
        opened = encode_text(engine.tokenizer, s.get("opened", ""))
        job = ThinkerJob(request_id=f"j{i}", outbox=Outbox(loop, limit=10 ** 6), prompt=s["prompt"] + opened,
                         max_tokens=s.get("max_tokens", 120), stops=s.get("stops", ()),
                         params=SamplingParams(temperature=s.get("temperature", 1.0), seed=i),
                         talker_rows=s.get("talker_rows", False), top_logprobs=s.get("top_logprobs"))
        if s["constraint"] is not None:
            job.matcher = engine.grammars.matcher(engine.grammars.compile(s["constraint"]))
        for t in opened:         # the reply began with `opened` (a prompt that ends inside it)
            assert job.matcher.accept(t)
        engine.open_reply(job)   # as the server does once the grammar is compiled
        jobs.append(job)
        engine.submit(job)
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
        if catch_up:       # the runs of the first step meet steps "too large" to feed them at once
            monkeypatch.setattr(thinker_engine, "JUMP_FEED_ROWS", 0)
        if steps == cancel_after:
            jobs[0].cancelled = True
            assert jobs[0].ahead or jobs[0].done, "no forced run in flight to cancel"
        with engine.lock:
            engine._reap_and_check()
        if ended is not None:
            ended[:] = [e or (steps if job.done else 0) for e, job in zip(ended or [0] * len(jobs), jobs)]
    loop.run_until_complete(asyncio.sleep(0))      # the outboxes' deliveries
    out = []
    if streams is not None:
        streams.clear()
    for job in jobs:
        items = []
        while (got := job.outbox.poll_timed()) is not None:
            items.append(got[0])
        finals = [x.reason for x in items if isinstance(x, Finished)]
        out.append((list(job.generated), finals[0] if finals else None))
        if streams is not None:
            texts = [x for x in items if isinstance(x, TextOut)]
            rows = [x.rows for x in texts if x.rows is not None]
            streams.append(([t for x in texts for t in x.token_ids], torch.cat(rows) if rows else None,
                            [lp for x in texts for lp in x.logprobs]))
    loop.close()
    return out, steps


def _prompt(tokenizer, omni_config, text: str) -> list[int]:
    return render(tokenizer, omni_config.thinker, user_turn(text)).token_ids


def test_jump_forward_gives_the_tokens_of_decoding_in_fewer_steps(engine, tokenizer, omni_config, monkeypatch):
    """Forced tokens taken without a decode step: the same ids as decoding them one by one (greedy
    and sampled rows: a sampled row's noise advances as if each were drawn), in a mixed batch with a
    free row, in fewer steps (or, runs caught up in the decode forward, in about as many); max_tokens
    and a stop string that land inside a forced run end the reply where decoding ends it."""
    from voxpipe.services.runtime.outputs import FinishReason

    p = _prompt(tokenizer, omni_config, "Book a table.")
    specs = [dict(prompt=p, constraint=tool_calls(FUNCTIONS, parallel=False), temperature=0.0, max_tokens=100),
             dict(prompt=p, constraint=Constraint.json_schema(PROFILE), max_tokens=40),
             dict(prompt=p, constraint=tool_calls(FUNCTIONS), max_tokens=5),          # '<' then 'tool' of a run
             dict(prompt=p, constraint=tool_calls(FUNCTIONS), stops=("call>",)),
             dict(prompt=p, constraint=Constraint(ConstraintKind.REGEX, r"[a-z]{1,30}"), max_tokens=12)]
    decoded, decode_steps = run_jobs(engine, specs, False, monkeypatch)
    jumped, jump_steps = run_jobs(engine, specs, True, monkeypatch)
    assert jumped == decoded and jump_steps < decode_steps / 2, (jump_steps, decode_steps)
    # runs met by steps of more rows than JUMP_FEED_ROWS: each catches up a token a step in the decode forward
    caught_up, steps = run_jobs(engine, specs, True, monkeypatch, catch_up=True)
    assert caught_up == decoded and jump_steps < steps <= decode_steps
    (ids, reason), (cut, cut_reason), (stopped, stop_reason) = decoded[0], decoded[2], decoded[3]
    assert reason == FinishReason.STOP and _calls(tokenizer.decode(ids[:-1]))
    assert cut_reason == FinishReason.LENGTH and len(cut) == 5 and tokenizer.decode(cut) == "<tool"
    assert stop_reason == FinishReason.STOP and tokenizer.decode(stopped).endswith("<tool_call>")


def _draft_specs(tokenizer, omni_config) -> list[dict]:
    """Required, named and json_schema replies, greedy and sampled (seeded), beside free rows."""
    p = _prompt(tokenizer, omni_config, "Book a table, then the weather.")
    named = tool_calls(FUNCTIONS[1:], parallel=False)
    return [dict(prompt=p, constraint=tool_calls(FUNCTIONS, parallel=False), temperature=0.0, max_tokens=80),
            dict(prompt=p, constraint=tool_calls(FUNCTIONS), max_tokens=80),
            dict(prompt=p, constraint=named, temperature=0.0, max_tokens=60),
            dict(prompt=p, constraint=named, max_tokens=60),
            dict(prompt=p, constraint=Constraint.json_schema(ORDER), temperature=0.0, max_tokens=80),
            dict(prompt=p, constraint=Constraint.json_schema(PROFILE), max_tokens=60),
            dict(prompt=p, constraint=None, temperature=0.0, max_tokens=30),
            dict(prompt=p, constraint=None, max_tokens=30)]


def test_drafts_of_forced_text_give_the_tokens_of_decoding_in_fewer_steps(engine, tokenizer, omni_config,
                                                                          monkeypatch):
    """Draft-and-verify (engine._draft): where a grammar forces a text the tiny vocabulary spells
    several ways (`<tool_call>`'s `al` or `a` + `l`, `"name"`'s `me` or `m` + `e`), the tokenizer's
    spelling is fed with the next step and the model's own choices taken while they equal it: the
    same ids as sequential decoding (greedy and sampled rows, required / named / json_schema, free
    rows beside them), with and without jump-forward, in fewer steps; drafts were both accepted and
    rejected (the model's choice differed) along the way."""
    from voxpipe.services.runtime import metrics

    specs = _draft_specs(tokenizer, omni_config)
    decoded, _ = run_jobs(engine, specs, False, monkeypatch)
    jumped, _ = run_jobs(engine, specs, True, monkeypatch)
    before = dataclasses.replace(engine.drafts)
    drafted, _ = run_jobs(engine, specs, True, monkeypatch, draft=True)
    counts = engine.drafts
    assert jumped == decoded and drafted == decoded
    accepted, offered = counts.accepted - before.accepted, counts.drafted - before.drafted
    assert 0 < accepted < offered, (accepted, offered)
    assert metrics.REGISTRY.get_sample_value("voxpipe_draft_tokens_total",
                                             {"stage": "thinker", "kind": "accepted"}) >= accepted
    # the calls end sooner (the json_schema replies' strings and numbers are the model's choices)
    jump_ended, draft_ended = [], []
    run_jobs(engine, specs, True, monkeypatch, ended=jump_ended)
    run_jobs(engine, specs, True, monkeypatch, draft=True, ended=draft_ended)
    assert all(d < j for d, j in zip(draft_ended[:4], jump_ended[:4])), (draft_ended, jump_ended)
    assert all(d <= j for d, j in zip(draft_ended, jump_ended)), (draft_ended, jump_ended)
    # drafts without jump-forward: the forced tokens are drafted and verified too
    alone, _ = run_jobs(engine, specs, False, monkeypatch, draft=True)
    assert alone == decoded


def test_a_rejected_draft_gives_the_tokens_of_decoding(engine, tokenizer, omni_config, monkeypatch):
    """Drafts that are deliberately not the model's choice (a test-only spelling): rejected at the
    first token (none accepted) or after one, the rest of the draft discarded (its keys overwritten
    by the next forward, no noise drawn for it, the grammar's state the accepted one): the replies
    are those of sequential decoding."""
    from voxpipe.services.thinker.engine import ThinkerEngine

    specs = _draft_specs(tokenizer, omni_config)
    decoded, _ = run_jobs(engine, specs, True, monkeypatch)
    spell = ThinkerEngine._spell
    for keep in (0, 1):
        def wrong(self, job, text, keep=keep):
            right = spell(self, job, text)
            # a token the grammar allows there no spelling of the text begins with: '~' is in no JSON of these schemas
            return right[:keep] + encode_text(tokenizer, "~") + right[keep:]
        monkeypatch.setattr(ThinkerEngine, "_spell", wrong)
        before = dataclasses.replace(engine.drafts)
        rejected, _ = run_jobs(engine, specs, True, monkeypatch, draft=True)
        counts = engine.drafts
        assert rejected == decoded, keep
        verifies, accepted = counts.verified - before.verified, counts.accepted - before.accepted
        assert verifies and accepted <= keep * verifies, (keep, verifies, accepted)


def test_drafts_verified_in_graph_plans_give_the_tokens_of_decoding(tiny_model_dir, tokenizer, omni_config,
                                                                    monkeypatch):
    """With the CUDA-graph plans (emulated on the CPU: cuda_graphs.EMULATE), drafts are verified by
    the verify graphs (rows padded to their bucket, a draft's logits at positions [n, 1 +
    DRAFT_TOKENS]): the replies of sequential decoding."""
    from voxpipe.services.runtime import cuda_graphs
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker.engine import ThinkerEngine
    from voxpipe.services.thinker.model import ThinkerModel

    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    th = omni_config.thinker
    model = load_module(lambda: ThinkerModel(th), str(tiny_model_dir), "thinker.", device=torch.device("cpu"),
                        dtype=torch.float32, load_format="auto", ignore=("visual.",))
    graphed = ThinkerEngine(model, th, tokenizer, device=torch.device("cpu"), max_active=8, max_len=1024,
                            eos_ids=(th.tokens.im_end,), cuda_graphs=True)
    assert graphed.runner.verify_graphs is not None
    specs = _draft_specs(tokenizer, omni_config)[:4] + _draft_specs(tokenizer, omni_config)[6:]
    decoded, _ = run_jobs(graphed, specs, False, monkeypatch)
    replays = graphed.runner.verify_graphs.replays
    drafted, _ = run_jobs(graphed, specs, True, monkeypatch, draft=True)
    assert drafted == decoded and graphed.runner.verify_graphs.replays > replays


# ---------------------------------------------------------------- drafts in the prefill

def _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache: bool = True, cuda_graphs: bool = False,
                  deterministic: bool = False, blocks: int = 8 * 1024 // 16):
    """A thinker engine of its own (its KV pool and prefix cache) on the tiny checkpoint
    (`deterministic`: its model in the batch-invariant mode, as --deterministic serves it)."""
    from voxpipe.services.runtime import determinism
    from voxpipe.services.runtime.kv_plan import KVPlan
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker.engine import ThinkerEngine
    from voxpipe.services.thinker.model import ThinkerModel

    th = omni_config.thinker
    model = load_module(lambda: ThinkerModel(th), str(tiny_model_dir), "thinker.", device=torch.device("cpu"),
                        dtype=torch.float32, load_format="auto", ignore=("visual.",))
    if deterministic:
        determinism.apply(model)
    return ThinkerEngine(model, th, tokenizer, device=torch.device("cpu"), max_active=8, max_len=1024,
                         kv=KVPlan(blocks=blocks, prefix_cache=prefix_cache), eos_ids=(th.tokens.im_end,),
                         cuda_graphs=cuda_graphs)


def _prefill_draft_specs(tokenizer, omni_config, text: str = "Book a table, then the weather.") -> list[dict]:
    """`_draft_specs` (required with two tools, named, json_schema, greedy and sampled, two free rows),
    a spoken reply (talker rows: no opening goes out before its prefill, so its whole forced head
    is drafted) and stop strings among the first 8 (one step's admissions: the rows without an
    opening share the padded prefill with the free rows; those with one are chunked), then required
    with one tool, log probabilities (never drafted), and max_tokens that end the reply at its first
    token or inside the draft."""
    p = _prompt(tokenizer, omni_config, text)
    base = [dict(s, prompt=p) for s in _draft_specs(tokenizer, omni_config)]
    return base[:3] + base[4:5] + [
        dict(prompt=p, constraint=tool_calls(FUNCTIONS), talker_rows=True, max_tokens=40),
        dict(prompt=p, constraint=Constraint.json_schema(PROFILE), stops=('"ok"',), max_tokens=60)] + base[6:8] + [
        base[3], base[5], dict(prompt=p, constraint=tool_calls(FUNCTIONS[:1]), max_tokens=60),
        dict(prompt=p, constraint=tool_calls(FUNCTIONS), top_logprobs=2, max_tokens=30),
        dict(prompt=p, constraint=tool_calls(FUNCTIONS), max_tokens=1),
        dict(prompt=p, constraint=tool_calls(FUNCTIONS), temperature=0.0, max_tokens=9)]


def _spy_prefills(engine, monkeypatch) -> list[tuple[str, int, int, int]]:
    """Each prefill forward of the engine's runner as it runs: (path, jobs, free rows, drafted tokens
    it verified)."""
    seen = []
    runner = engine.runner
    prefill, chunks = runner.prefill, runner.prefill_chunks

    def drafted(out) -> int:
        return 0 if out.drafts is None else out.drafts.shape[0]

    def spy_prefill(jobs):
        free = sum(j.matcher is None for j in jobs)
        out = prefill(jobs)
        seen.append(("prefill", len(jobs), free, drafted(out)))
        return out

    def spy_chunks(parts):
        free = sum(j.matcher is None for j, _, _ in parts)
        out = chunks(parts)
        seen.append(("chunks", len(parts), free, drafted(out.prefilled)))
        return out
    monkeypatch.setattr(runner, "prefill", spy_prefill)
    monkeypatch.setattr(runner, "prefill_chunks", spy_chunks)
    return seen


def _same_streams(got: list, want: list, exact: bool = True) -> None:
    """The jobs' TextOuts carry the same token ids and talker rows, bit for bit, and the same log
    probabilities: bit for bit (`exact`), else the same tokens with values within float rounding
    (in the default mode a row's numbers depend on the shape of the forwards it shares: the other
    rows, as jump-forward and drafts take theirs out of the decode forward; --deterministic is the
    mode where they do not)."""
    assert len(got) == len(want)
    for (ids, rows, logprobs), (ids0, rows0, logprobs0) in zip(got, want):
        assert ids == ids0
        assert (rows is None) == (rows0 is None) and (rows is None or torch.equal(rows, rows0))
        if exact:
            assert logprobs == logprobs0
            continue
        assert [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs] == \
            [(lp.token_id, [t for t, _ in lp.top]) for lp in logprobs0]
        values = [[lp.logprob, *(v for _, v in lp.top)] for lp in logprobs]
        torch.testing.assert_close(values, [[lp.logprob, *(v for _, v in lp.top)] for lp in logprobs0],
                                   rtol=1e-5, atol=1e-5)


def _wrong_spelling(tokenizer, keep: int):
    """A test-only `_spell`: the right spelling with '~' (allowed by no schema here) after its first
    `keep` tokens, so that the model's choice differs from the draft there."""
    from voxpipe.services.thinker.engine import ThinkerEngine

    spell = ThinkerEngine._spell

    def wrong(self, job, text):
        right = spell(self, job, text)
        return right[:keep] + encode_text(tokenizer, "~") + right[keep:]
    return wrong


def test_prefill_drafts_give_the_replies_of_decoding(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """The text a grammar forces before any choice is drafted in the prompt's prefill (engine.open_reply,
    runner.prefill): its last positions verify the draft, so a required call's name is chosen from
    the prefill's logits. The replies are those of --no-draft-forced decoding, token for token, with
    the same talker rows and log probabilities (greedy and seeded sampled rows; required with one or
    two tools, named, json_schema, spoken, stop strings, max_tokens at the first token and inside the
    draft), in one padded prefill beside free rows (log probabilities within float rounding: the
    default mode's numbers depend on the forwards' shapes; bit for bit in the deterministic mode's
    test); a draft the model's choice rejects at its first token or after one (a spelling it would
    not choose) gives them too."""
    from voxpipe.services.thinker.engine import ThinkerEngine

    eng = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False)
    specs = _prefill_draft_specs(tokenizer, omni_config)
    want, streams = [], []
    decoded, decode_steps = run_jobs(eng, specs, True, monkeypatch, draft=False, streams=want)
    seen = _spy_prefills(eng, monkeypatch)
    before = dataclasses.replace(eng.drafts)
    drafted, steps = run_jobs(eng, specs, True, monkeypatch, draft=True, streams=streams)
    assert drafted == decoded
    _same_streams(streams, want, exact=False)
    # the first step: the opened rows chunked with their drafts, the others padded, the free ones among them
    assert seen[0][0] == "chunks" and seen[0][3] > 0, seen
    assert seen[1][:3] == ("prefill", 4, 2) and seen[1][3] > 0, seen
    assert eng.drafts.accepted > before.accepted and steps <= decode_steps
    for keep in (0, 1):
        monkeypatch.setattr(ThinkerEngine, "_spell", _wrong_spelling(tokenizer, keep))
        before = dataclasses.replace(eng.drafts)
        seen.clear()
        rejected, _ = run_jobs(eng, specs, True, monkeypatch, draft=True, streams=streams)
        assert rejected == decoded, keep
        _same_streams(streams, want, exact=False)
        assert seen[0][3] > 0, seen
        verifies, accepted = eng.drafts.verified - before.verified, eng.drafts.accepted - before.accepted
        assert verifies and accepted <= keep * verifies, (keep, verifies, accepted)


def test_prefill_drafts_in_a_pool_too_small_for_them(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """A KV pool with room for a few of the step's sequences: prefill drafts that find no free blocks
    are dropped at admission, rows are preempted and prefilled again (their drafts dropped), cached
    blocks are evicted for newer ones -- and the replies stay those of --no-draft-forced decoding on
    an engine whose pool holds everything."""
    specs = _prefill_draft_specs(tokenizer, omni_config)
    roomy = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False)
    decoded, _ = run_jobs(roomy, specs, True, monkeypatch, draft=False)
    longest = max(len(s["prompt"]) + s.get("max_tokens", 60) for s in specs)
    small = _fresh_engine(tiny_model_dir, tokenizer, omni_config, blocks=3 * -(-longest // 16))
    stats = small.runner.blocks.stats
    for _ in range(2):           # the second time over blocks the first left cached
        drafted, _ = run_jobs(small, specs, True, monkeypatch, draft=True)
        assert drafted == decoded
    assert stats.preempted > 0, "the pool was not small enough to preempt"


def test_prefill_drafts_keep_the_deterministic_modes_bits(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """In the batch-invariant mode (--deterministic) drafts stay on, in the prefill and after it: a
    row's bits do not depend on the forwards' shapes, so the replies -- with a row's log
    probabilities beside drafted rows -- are those of --no-draft-forced bit for bit."""
    eng = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False, deterministic=True)
    specs = _prefill_draft_specs(tokenizer, omni_config)
    specs = specs[:2] + specs[4:8] + specs[11:]
    want, streams = [], []
    decoded, _ = run_jobs(eng, specs, True, monkeypatch, draft=False, streams=want)
    seen = _spy_prefills(eng, monkeypatch)
    drafted, _ = run_jobs(eng, specs, True, monkeypatch, draft=True, streams=streams)
    assert drafted == decoded
    _same_streams(streams, want)
    assert any(d for *_, d in seen), seen


def test_prefill_drafts_ride_on_a_chunked_prompts_last_chunk(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """A prompt longer than the prefill chunk: its draft rides after its last chunk in the packed
    forward (runner.prefill_chunks), beside free rows' chunks: the replies of --no-draft-forced."""
    eng = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False)
    monkeypatch.setattr(eng.scheduler, "prefill_chunk", 8)
    monkeypatch.setattr(eng.scheduler, "long_prompt", 8)
    specs = _prefill_draft_specs(tokenizer, omni_config)
    assert all(len(s["prompt"]) > 2 * 8 for s in specs)
    want, streams = [], []
    decoded, _ = run_jobs(eng, specs, True, monkeypatch, draft=False, streams=want)
    seen = _spy_prefills(eng, monkeypatch)
    drafted, _ = run_jobs(eng, specs, True, monkeypatch, draft=True, streams=streams)
    assert drafted == decoded
    _same_streams(streams, want, exact=False)
    assert {path for path, *_ in seen} == {"chunks"} and any(d for *_, d in seen), seen
    assert any(free and d for _, _, free, d in seen), seen      # free rows' chunks in a forward that verified drafts


def _published_kv(engine) -> dict[bytes, list[torch.Tensor]]:
    """The prefix cache's blocks by hash: each layer's keys and values [heads, block, dim]."""
    pool, cache = engine.runner.blocks.pool, engine.runner.cache
    return {h: [t[b].clone() for layer in range(len(cache.k)) for t in (cache.k[layer], cache.v[layer])]
            for h, b in pool.by_hash.items()}


def _prefilled_kv(engine, tokens: list[int]) -> dict[bytes, list[torch.Tensor]]:
    """The keys and values of `tokens`' full blocks as a prefill of them all computes them (an engine
    without a prefix cache), by the prefix hash of each block."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.thinker.engine import ThinkerJob

    loop = asyncio.new_event_loop()
    job = ThinkerJob(request_id="kv", outbox=Outbox(loop, limit=10 ** 6), prompt=list(tokens), max_tokens=1)
    runner = engine.runner
    assert runner.allocate(job)
    runner.prefill([job])
    cache = runner.cache
    out = {h: [t[job.table.blocks[i]].clone() for layer in range(len(cache.k)) for t in (cache.k[layer], cache.v[layer])]
           for i, h in enumerate(runner.blocks.hasher(job.prompt_ids(), ()))}
    runner.release(job)
    loop.close()
    return out


_PREFIX_REFERENCE: dict[str, list] = {}


def _prefix_reference(tiny_model_dir, tokenizer, omni_config, monkeypatch) -> tuple[list, list, dict]:
    """The prefix-cache test's phases (a miss, the same prompts again, a prompt sharing their first
    blocks), each phase's --no-draft-forced replies on an engine without a prefix cache, and the keys
    and values a prefill of every reply's sequence computes for its full blocks: the same whichever
    draft is rejected, so made once for the module's three cases."""
    if not _PREFIX_REFERENCE:
        phases = [_prefill_draft_specs(tokenizer, omni_config)[:8]] * 2 + [
            _prefill_draft_specs(tokenizer, omni_config, "Book a table, then the weather, then a taxi.")[:8]]
        plain = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False)
        decoded = [run_jobs(plain, specs, True, monkeypatch, draft=False)[0] for specs in phases]
        want: dict[bytes, list[torch.Tensor]] = {}
        for specs, replies in zip(phases, decoded):
            for spec, (ids, _) in zip(specs, replies):
                want.update(_prefilled_kv(plain, (spec["prompt"] + ids)[:-1]))     # the last token has no keys
        monkeypatch.undo()
        _PREFIX_REFERENCE.update(phases=phases, decoded=decoded, want=[want])
    return _PREFIX_REFERENCE["phases"], _PREFIX_REFERENCE["decoded"], _PREFIX_REFERENCE["want"][0]


@pytest.mark.parametrize("keep", [None, 0, 1], ids=["accepted", "rejected-first", "rejected-second"])
def test_prefill_drafts_and_the_prefix_cache(tiny_model_dir, tokenizer, omni_config, monkeypatch, keep):
    """Prefill drafts on a miss (the padded prefill), a hit (the same prompts again: their cached
    prefix, the rest and the draft chunked) and a partial hit (a prompt sharing their first blocks):
    the replies of --no-draft-forced decoding on an engine without a prefix cache; the drafted
    positions' keys reach the prefix cache only as far as the model's choices accepted them: every
    published block holds the keys and values a prefill of its sequence's tokens computes (a
    rejected draft's -- '~', a spelling the model would not choose -- never)."""
    from voxpipe.services.thinker.engine import ThinkerEngine

    phases, reference, want = _prefix_reference(tiny_model_dir, tokenizer, omni_config, monkeypatch)
    cached = _fresh_engine(tiny_model_dir, tokenizer, omni_config)
    hits = []
    for specs, decoded in zip(phases, reference):
        hit = cached.runner.blocks.stats.hit_tokens
        seen = _spy_prefills(cached, monkeypatch)
        if keep is not None:
            monkeypatch.setattr(ThinkerEngine, "_spell", _wrong_spelling(tokenizer, keep))
        drafted, _ = run_jobs(cached, specs, True, monkeypatch, draft=True)
        monkeypatch.undo()      # the spies and the spelling
        assert drafted == decoded
        assert any(d for *_, d in seen), seen
        hits.append(cached.runner.blocks.stats.hit_tokens - hit)
    p, q = phases[0][0]["prompt"], phases[2][0]["prompt"]
    shared = next(i for i, (a, b) in enumerate(zip(p, q)) if a != b) // 16 * 16     # whole blocks
    assert hits[0] == 0 and hits[1] >= 8 * ((len(p) - 1) // 16 * 16) and 8 * shared <= hits[2] < hits[1], hits
    assert shared > 0
    got = _published_kv(cached)
    assert got and set(got) <= set(want), len(set(got) - set(want))
    for h, tensors in got.items():
        for a, b in zip(tensors, want[h]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_prefill_drafts_in_graph_plans(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """With the CUDA-graph plans (emulated on the CPU: cuda_graphs.EMULATE) a prompt prefilled from
    position 0 replays a prefill graph and takes no draft (an eager forward would cost more than
    the forward a draft saves); one going on from a cached prefix, its new tokens and draft within
    a verify graph's rows, is prefilled and verified by the verify graphs: the replies of
    --no-draft-forced decoding either way."""
    from voxpipe.services.runtime import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    graphed = _fresh_engine(tiny_model_dir, tokenizer, omni_config, cuda_graphs=True)
    assert graphed.runner.verify_graphs is not None
    plain = _fresh_engine(tiny_model_dir, tokenizer, omni_config, prefix_cache=False)
    specs = _prefill_draft_specs(tokenizer, omni_config)[:8]
    decoded, _ = run_jobs(plain, specs, True, monkeypatch, draft=False)
    seen = _spy_prefills(graphed, monkeypatch)
    assert run_jobs(graphed, specs, True, monkeypatch, draft=True)[0] == decoded      # a miss: from position 0
    assert seen and not any(d for *_, d in seen), seen
    seen.clear()
    replays = graphed.runner.verify_graphs.replays
    assert run_jobs(graphed, specs, True, monkeypatch, draft=True)[0] == decoded      # a hit: chunked, verified
    assert any(path == "chunks" and d for path, _, _, d in seen), seen
    assert graphed.runner.verify_graphs.replays > replays


def test_a_draft_takes_only_blocks_the_step_leaves_free(tiny_model_dir, tokenizer, omni_config, monkeypatch):
    """A draft never preempts: its blocks come from what the step's rows leave free once each has
    the block for its next position. An older row drafts (a block's worth of tokens) in a step where
    the pool holds exactly the block a newer row's next position needs: no row is preempted, the
    draft is dropped, both rows decode on (before, the older row's draft took that block first and
    the newer row was preempted for it)."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.kv_plan import KVPlan
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker import engine as thinker_engine
    from voxpipe.services.thinker.engine import ThinkerEngine, ThinkerJob
    from voxpipe.services.thinker.model import ThinkerModel

    monkeypatch.setattr(thinker_engine, "JUMP_FEED_ROWS", 8)
    th = omni_config.thinker
    model = load_module(lambda: ThinkerModel(th), str(tiny_model_dir), "thinker.", device=torch.device("cpu"),
                        dtype=torch.float32, load_format="auto", ignore=("visual.",))
    eng = ThinkerEngine(model, th, tokenizer, device=torch.device("cpu"), max_active=8, max_len=1024,
                        kv=KVPlan(blocks=64, prefix_cache=False), eos_ids=(th.tokens.im_end,), cuda_graphs=False)
    loop = asyncio.new_event_loop()
    p = _prompt(tokenizer, omni_config, "Book a table.")
    older, newer = (ThinkerJob(request_id=f"d{i}", outbox=Outbox(loop, limit=10 ** 6), prompt=p + [p[-1]] * i,
                               max_tokens=200, min_tokens=150, params=SamplingParams(temperature=0.0))
                    for i in range(2))
    for job in (older, newer):
        eng.submit(job)
    runner, blocks = eng.runner, eng.runner.blocks

    def need(job) -> int:
        return blocks.blocks_for(job.kv_tokens + job.ahead + 1) - len(job.table.blocks)

    for _ in range(3 * blocks.block_size):      # to a step where the newer row's next position needs a new block
        eng.step()
        assert older.table is not None and newer.table is not None and not older.done and not newer.done
        if need(newer) == 1 and need(older) == 0:
            break
    else:
        pytest.fail("no step where only the newer row needs a block")
    older.draft = [older.generated[-1]] * blocks.block_size       # a block's worth past its next position
    held = blocks.pool.allocate(blocks.pool.free - 1)             # the pool leaves the newer row's block only
    preempted = blocks.stats.preempted
    eng.step()
    assert blocks.stats.preempted == preempted, "a draft preempted a row"
    assert older in eng.running and newer in eng.running and newer.table is not None
    assert older.draft == [] and blocks.pool.free == 0
    blocks.pool.release(held)
    loop.close()


def test_a_draft_beside_a_run_the_verify_graphs_cannot_take_is_dropped(tiny_model_dir, tokenizer, omni_config,
                                                                        monkeypatch):
    """With verify graphs (emulated on the CPU), a step where one row drafts and another feeds a forced
    run longer than a verify graph's rows (VERIFY_TOKENS) drops the draft: the runs take the extend
    graphs, as without drafts (before, the whole step fell to the eager packed forward)."""
    from voxpipe.services.runtime import cuda_graphs
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker import engine as thinker_engine
    from voxpipe.services.thinker.engine import ThinkerEngine, ThinkerJob
    from voxpipe.services.thinker.model import ThinkerModel
    from voxpipe.services.thinker.runner import VERIFY_TOKENS

    monkeypatch.setattr(cuda_graphs, "EMULATE", True)
    monkeypatch.setattr(thinker_engine, "JUMP_FEED_ROWS", 8)
    th = omni_config.thinker
    model = load_module(lambda: ThinkerModel(th), str(tiny_model_dir), "thinker.", device=torch.device("cpu"),
                        dtype=torch.float32, load_format="auto", ignore=("visual.",))
    eng = ThinkerEngine(model, th, tokenizer, device=torch.device("cpu"), max_active=8, max_len=1024,
                        eos_ids=(th.tokens.im_end,), cuda_graphs=True)
    runner = eng.runner
    assert runner.verify_graphs is not None and runner.extend_graphs is not None
    loop = asyncio.new_event_loop()
    p = _prompt(tokenizer, omni_config, "Book a table.")
    drafting, running = (ThinkerJob(request_id=f"v{i}", outbox=Outbox(loop, limit=10 ** 6), prompt=p, max_tokens=200,
                                    min_tokens=150, params=SamplingParams(temperature=0.0)) for i in range(2))
    for job in (drafting, running):
        eng.submit(job)
    eng.step()
    assert drafting.generated and running.generated and not drafting.done and not running.done
    drafting.draft = [drafting.generated[-1]] * 4
    run = VERIFY_TOKENS + 8           # tokens after the last one whose keys the next step computes (a forced run's)
    running.generated += [running.generated[-1]] * run
    running.ahead = run
    extend, verify = runner.extend_graphs.replays, runner.verify_graphs.replays
    eng.step()
    assert runner.verify_graphs.replays == verify and runner.extend_graphs.replays == extend + 1
    assert drafting.draft == [] and running.ahead == 0 and not drafting.done and not running.done
    loop.close()


def test_a_forced_opening_is_out_before_the_prefill(engine, tokenizer, omni_config, monkeypatch):
    """A named function's reply: the tokens its grammar forces first (`<tool_call>\n{"name": "NAME",
    "arguments": {...`) are in its outbox once open_reply took them, before the job is admitted or
    any forward runs (its first `tool_calls` delta waits for no prefill); then the reply's outputs,
    in order, are its generated tokens, as with the opening sent after the prefill; a sampled reply's
    tokens are those of a reply decoded without jump-forward (the noise of the forced tokens drawn)."""
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.outputs import Finished, TextOut
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.thinker import engine as thinker_engine
    from voxpipe.services.thinker.engine import ThinkerJob

    monkeypatch.setattr(thinker_engine, "JUMP_TOKENS", 64)
    p = _prompt(tokenizer, omni_config, "Turn on the light.")
    loop = asyncio.new_event_loop()
    job = ThinkerJob(request_id="opening", outbox=Outbox(loop, limit=10 ** 6), prompt=p, max_tokens=60,
                     params=SamplingParams(temperature=1.0, seed=0))      # run_jobs' first job's seed
    job.matcher = engine.grammars.matcher(engine.grammars.compile(tool_calls(FUNCTIONS[1:], parallel=False)))
    engine.open_reply(job)
    loop.run_until_complete(asyncio.sleep(0))      # the puts from "the compile pool" delivered
    early = []
    while (got := job.outbox.poll_timed()) is not None:
        early.append(got[0])
    assert job.opened and all(isinstance(x, TextOut) for x in early)
    head = [t for x in early for t in x.token_ids]
    assert head == job.generated[:job.opened]
    text, call = tokenizer.decode(head), '<tool_call>\n{"name": "set_light", "arguments": {'
    assert text and (call.startswith(text) or text.startswith(call)), text   # the tiny vocabulary forces less
    engine.submit(job)
    while engine.has_work():
        engine.step()
        with engine.lock:
            engine._reap_and_check()
    loop.run_until_complete(asyncio.sleep(0))
    rest = []
    while (got := job.outbox.poll_timed()) is not None:
        rest.append(got[0])
    loop.close()
    sent = head + [t for x in rest if isinstance(x, TextOut) for t in x.token_ids]
    assert sent == job.generated and isinstance(rest[-1], Finished)
    spec = dict(prompt=p, constraint=tool_calls(FUNCTIONS[1:], parallel=False), max_tokens=60)
    (decoded, _), = run_jobs(engine, [dict(spec, temperature=1.0)], False, monkeypatch)[0]
    assert job.generated == decoded


def test_a_call_the_model_opens_in_auto_mode_is_valid(engine, tokenizer, omni_config, monkeypatch):
    """The constraint of `tool_choice: "auto"` with --constrain-tool-calls (tool_calls_in_text): a
    reply that has opened `<tool_call>` (the random model rarely does: its prompt ends inside the
    reply) goes on as a valid call of one of the functions, closes it, then is free again; greedy
    and sampled."""
    import jsonschema

    by_name = {f["name"]: f["parameters"] for f in FUNCTIONS}
    p = _prompt(tokenizer, omni_config, "Turn on the light.")
    specs = [dict(prompt=p, constraint=tool_calls_in_text(FUNCTIONS), opened="Sure. <tool_call>\n",
                  temperature=0.0 if i == 0 else 1.0, max_tokens=90) for i in range(3)]
    replies, _ = run_jobs(engine, specs, True, monkeypatch)
    closed = 0
    for ids, _ in replies:
        text = tokenizer.decode(ids)
        body, sep, _ = text.partition("\n</tool_call>")
        if not sep:      # cut by max_tokens inside a long argument
            continue
        call = json.loads(body)
        assert set(call) == {"name", "arguments"} and call["name"] in by_name
        jsonschema.validate(call["arguments"], by_name[call["name"]])
        closed += 1
    assert closed, [tokenizer.decode(ids) for ids, _ in replies]


def test_a_sampled_token_is_delivered_before_its_forced_run_is_worked_out(engine, tokenizer, omni_config,
                                                                         monkeypatch):
    """A required call's reply, its steps run as the engine's loop runs them (one StepDelivery a
    step): whenever the engine works out a forced run after a sampled token (Matcher.forced, in
    engine._jump), that token's outputs have already left the step (deliver_now): nothing of the
    job waits in the step's delivery, so a call's head, complete once the name's first token picks
    the name, never waits for the run's mask fills. The reply is the one decoded without a spy."""
    from voxpipe.services.runtime.engine import Outbox, StepDelivery
    from voxpipe.services.runtime.outputs import TextOut
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.thinker import engine as thinker_engine
    from voxpipe.services.thinker.engine import ThinkerJob

    monkeypatch.setattr(thinker_engine, "JUMP_TOKENS", 64)
    monkeypatch.setattr(thinker_engine, "JUMP_FEED_ROWS", 8)
    p = _prompt(tokenizer, omni_config, "Weather in Oslo, then the light.")
    constraint = tool_calls(FUNCTIONS, parallel=False)
    loop = asyncio.new_event_loop()
    job = ThinkerJob(request_id="delivered", outbox=Outbox(loop, limit=10 ** 6), prompt=p, max_tokens=60,
                     params=SamplingParams(temperature=1.0, seed=0))      # run_jobs' first job's seed
    job.matcher = engine.grammars.matcher(engine.grammars.compile(constraint))
    engine.open_reply(job)
    waiting: list[int] = []         # at each in-step forced(): the job's outputs still held by the step
    real = job.matcher.forced

    def forced():
        delivery = StepDelivery.active()
        if delivery is not None:
            waiting.append(sum(1 for o, (_, item) in delivery.entries if o is job.outbox and isinstance(item, TextOut)))
        return real()

    job.matcher.forced = forced
    engine.submit(job)
    while engine.has_work():
        with StepDelivery():
            engine.step()
        with engine.lock:
            engine._reap_and_check()
    loop.close()
    assert len(waiting) > 3 and not any(waiting), waiting
    (decoded, _), = run_jobs(engine, [dict(prompt=p, constraint=constraint, max_tokens=60)], True, monkeypatch)[0]
    assert job.generated == decoded


def test_a_cancel_during_a_forced_run_frees_the_request(engine, tokenizer, omni_config, monkeypatch):
    """A request cancelled while its forced run waits to be fed is dropped at the next step, its
    blocks given back; the request beside it ends as it would alone."""
    p = _prompt(tokenizer, omni_config, "Book a table.")
    specs = [dict(prompt=p, constraint=tool_calls(FUNCTIONS), temperature=0.0),
             dict(prompt=p, constraint=Constraint.json_schema(PROFILE), temperature=0.0)]
    alone, _ = run_jobs(engine, specs[1:], True, monkeypatch)
    free_before = engine.runner.blocks.pool.free
    out, _ = run_jobs(engine, specs, True, monkeypatch, cancel_after=1)
    assert out[0][1] is None and len(out[0][0]) < 40 and out[1] == alone[0]
    assert engine.runner.blocks.pool.free == free_before and not engine.running


def test_a_deferred_accept_advances_the_matcher_at_its_next_use(tokenizer, omni_config):
    """Matcher.defer (large batches: the library's accept moves to the next step's fill, beside the
    forward): the masks along a walk are those of accepting at once; a token the state does not
    allow shows as `refused` at the next fill."""
    th = omni_config.thinker
    grammars = Grammars(tokenizer, th.text.vocab_size, (th.tokens.im_end,))
    compiled = grammars.compile(Constraint.json_schema(PROFILE))
    now, later = grammars.matcher(compiled), grammars.matcher(compiled)
    a, b = (torch.empty(1, grammars.words, dtype=torch.int32) for _ in range(2))
    for _ in range(12):
        now.fill(a, 0)
        assert later.fill(b, 0) and torch.equal(a, b)
        tok = allowed(a, grammars.vocab_size)[0].nonzero().flatten().tolist()[-1]
        assert now.accept(tok)
        later.defer(tok)
    banned = (~allowed(b, grammars.vocab_size)[0]).nonzero().flatten().tolist()[0]
    later.defer(banned)
    assert not later.fill(b, 0) and later.refused and not later.accept(tok)


def test_the_forwards_bench_counts_each_kinds_forwards_to_its_first_delta():
    """bench/constrained_check --forwards at one round (its runs are a bench: bench/RESULTS.md): per
    draft setting, each kind's forwards to its first delta; the three settings give the same replies,
    a plain prompt's first token takes its prefill, a named call's head none (its opening is out
    before the prefill), and a required call's head no more forwards with drafts than without, nor
    with them in the prefill than after it."""
    from voxpipe.bench.constrained_check import DRAFT_SETTINGS, FORWARD_KINDS, forwards

    result = forwards(1, max_tokens=48)["forwards"]
    assert set(result) == set(DRAFT_SETTINGS)
    assert len({r["replies_sha256"] for r in result.values()}) == 1, result
    for r in result.values():
        assert all(len(r[k]["forwards"]) == 1 for k in FORWARD_KINDS), r
        assert r["tools-1"]["forwards"] == [1] and r["named"]["forwards"] == [0], r
    need = [result[s]["required"]["forwards"][0] for s in ("off", "draft", "prefill-draft")]
    assert need[0] >= need[1] >= need[2] >= 1, need
    assert result["prefill-draft"]["drafts"]["verified"] > 0 and result["off"]["drafts"]["verified"] == 0


def test_the_draft_prefill_flag_parses_and_refuses_a_value(capsys):
    """`voxpipe thinker --no-draft-prefill` (drafts after the first token only) and its default (on);
    a value given to the switch is a usage error naming it."""
    from voxpipe.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["thinker"]).draft_prefill is True
    assert parser.parse_args(["thinker", "--no-draft-prefill"]).draft_prefill is False
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["thinker", "--draft-prefill=no"])
    assert exc.value.code == 2 and "--draft-prefill" in capsys.readouterr().err
