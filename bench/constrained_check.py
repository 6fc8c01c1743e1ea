"""Every constrained reply is valid: chat completions with `tool_choice` "required", a named
function, or a `json_schema` response format (strict), sampled at temperature 1 with a seed each,
through the gateway and the unmodified openai SDK; each reply must parse (the call's arguments,
or the content, as JSON) and validate against its schema (jsonschema), and end by itself (a reply
cut at max_tokens counts as a failure). The schemas bound every string (enum / maxLength / pattern)
and number (integer ranges), as issue #22's goal asks, so that a valid reply is always finite.

    python -m voxpipe.bench.constrained_check --n 1000            # the tiny checkpoint, on the CPU
    python -m voxpipe.bench.constrained_check --base-url http://127.0.0.1:8000 --n 1000

Without --base-url it builds the tiny checkpoint (`voxpipe make-tiny`, seed 0) in a temporary
folder and serves it (the three stages and the gateway as processes, `--device`). Prints one JSON
line: requests, valid, and each failure kind with a few examples; exits 1 on any failure. Results:
bench/RESULTS.md ("every constrained reply validates").

    python -m voxpipe.bench.constrained_check --first-delta 20       # tiny checkpoint, CPU
    python -m voxpipe.bench.constrained_check --dummy --device cuda --first-delta 30   # full size, dummy weights

instead times the first delta of streamed replies, one request at a time, the kinds interleaved:
"plain" (no tools: the first content), "auto" (the tools in the prompt, tool_choice auto: the first
content or tool_calls delta), "required" and "named" (the first `delta.tool_calls`: the call's head),
each user message numbered (the tools' prefix stays cached, as for an agent), and "plain-1": the
plain request with max_tokens 1, not streamed, whose whole time is its time to the first token
(the plain kind's first content can come late where the reply is random bytes: full-size dummy
weights); "tools-1" is that with the tools in the prompt and tool_choice "auto" (the constrained
kinds' own prompt, unconstrained: the time to its first token; tool_choice "none" would not do:
the gateway leaves the tools out of a "none" prompt). Each request starts once the one before
has ended in the thinker (--settle seconds after it: a stream closed after its first delta is
cancelled, and its last decode steps would delay the next request's prefill). A first round (the
grammars' compiles) is reported apart. Prints one JSON line: medians and p90 per kind, and the ratios
of required / named to plain and to tools-1 (issue #22: the first tool_calls delta within noise of
the TTFT of the same prompt).

    python -m voxpipe.bench.constrained_check --forwards 15          # in process, tiny checkpoint, CPU

instead drives a thinker engine in this process (the tiny checkpoint; --device) one request at a
time and counts, per kind, the model forwards from its admission to its first delta as the gateway
would send it (its ToolCallParser fed with the reply's text: the first `tool_calls` head; the first
content for "plain" and "json_schema"; "tools-1": its first token), and the milliseconds to it (median, p90), under
three settings: "off" (--no-draft-forced: jump-forward only), "draft" (drafts of forced text after
the prefill's first token: --no-draft-prefill) and "prefill-draft" (the default: the text forced
before any choice drafted in the prefill itself). Seeds 1..ROUNDS at temperature 1, each reply run
to its end: a digest of each setting's replies (token ids) says whether the settings gave the same
replies. "required-1" is "required" with the first tool alone.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

_CONTACT = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                             "phone": {"type": "string", "pattern": "^[0-9]{6,10}$"}},
            "required": ["name"], "additionalProperties": False}
# a tool set like bench/grammar_libs.py's (5 functions, nested objects, arrays, enums), every value bounded
TOOLS = [{"type": "function", "function": f} for f in (
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}},
    {"name": "book_table", "parameters": {"type": "object", "properties": {
        "restaurant": {"type": "string", "maxLength": 16}, "party": {"type": "integer", "minimum": 1, "maximum": 20},
        "contact": _CONTACT}, "required": ["restaurant", "party"], "additionalProperties": False}},
    {"name": "look_up_order", "parameters": {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"},
        "include": {"type": "array", "items": {"enum": ["items", "shipping", "payment"]}, "maxItems": 3}},
        "required": ["order_id"], "additionalProperties": False}},
    {"name": "set_light", "parameters": {"type": "object", "properties": {
        "room": {"enum": ["hall", "kitchen", "bedroom"]}, "on": {"type": "boolean"},
        "level": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["room", "on"], "additionalProperties": False}},
    {"name": "ship_parcel", "parameters": {"type": "object", "properties": {
        "to": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
               "required": ["city", "zip"], "additionalProperties": False},
        "express": {"type": "boolean"}}, "required": ["to"], "additionalProperties": False}},
)]
RESPONSE = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 24}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "gift"]}, "maxItems": 3},
    "author": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
               "additionalProperties": False},
    "status": {"enum": ["draft", "published", "archived"]}},
    "required": ["title", "rating", "tags", "author", "status"], "additionalProperties": False}
KINDS = ("required", "named", "json_schema")
MESSAGES = [{"role": "user", "content": "Book a table for two at Luigi's, then tell me the weather."}]


def request(kind: str, seed: int, model: str, max_tokens: int) -> dict:
    kw = dict(model=model, messages=MESSAGES, temperature=1.0, seed=seed, max_tokens=max_tokens)
    if kind == "json_schema":
        return {**kw, "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "review", "schema": RESPONSE, "strict": True}}}
    choice = "required" if kind == "required" else {"type": "function", "function": {"name": "book_table"}}
    return {**kw, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}


def verdict(kind: str, reply) -> str | None:
    """None when the reply is valid, else what is wrong (one short line)."""
    import jsonschema

    choice = reply.choices[0]
    if choice.finish_reason == "length":
        return "cut at max_tokens"
    if kind == "json_schema":
        if choice.finish_reason != "stop":
            return f"finish_reason {choice.finish_reason}"
        value, schema = choice.message.content, RESPONSE
    else:
        calls = choice.message.tool_calls or []
        if choice.finish_reason != "tool_calls" or len(calls) != 1 or choice.message.content:
            return f"finish_reason {choice.finish_reason}, {len(calls)} calls, content {choice.message.content!r:.40}"
        name = calls[0].function.name
        if kind == "named" and name != "book_table":
            return f"called {name}, not the named book_table"
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        if name not in params:
            return f"unknown function {name!r:.40}"
        value, schema = calls[0].function.arguments, params[name]
    try:
        jsonschema.validate(json.loads(value), schema)
    except (ValueError, jsonschema.ValidationError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return None


async def check(base_url: str, n: int, concurrency: int, max_tokens: int) -> dict:
    """`n` requests (the kinds in turn, seed = the request's number), `concurrency` at a time."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    failures: Counter[str] = Counter()
    examples: dict[str, list] = {}
    tokens: list[int] = []
    replies: dict[int, str] = {}
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        kind = KINDS[i % len(KINDS)]
        async with gate:
            try:
                reply = await client.chat.completions.create(**request(kind, i, model, max_tokens))
                problem = verdict(kind, reply)
                tokens.append(reply.usage.completion_tokens)
                replies[i] = reply.choices[0].message.model_dump_json(exclude={"tool_calls": {"__all__": {"id"}}})
            except openai.APIError as e:
                problem = f"API error: {str(e)[:120]}"
        if problem is not None:
            failures[kind] += 1
            examples.setdefault(kind, [])
            if len(examples[kind]) < 3:
                examples[kind].append({"seed": i, "problem": problem})

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return {"requests": n, "valid": n - sum(failures.values()), "failures": dict(failures), "examples": examples,
            "kinds": list(KINDS), "temperature": 1.0, "max_tokens": max_tokens,
            "completion_tokens_max": max(tokens, default=0),
            "completion_tokens_mean": round(sum(tokens) / max(len(tokens), 1), 1),
            # the replies themselves (each message, its calls' ids left out: random), by seed: the same
            # digest is the same 1,000 replies (a change that must not alter them, compared by it)
            "replies_sha256": hashlib.sha256(json.dumps([replies.get(i) for i in range(n)]).encode()).hexdigest(),
            "seconds": round(time.perf_counter() - t0, 1)}


FIRST_DELTA_KINDS = ("plain", "auto", "required", "named")
# "plain-1": the plain request with max_tokens 1, not streamed: the whole request's time is the time
# to its first token, whatever that token's text is (with full-size dummy weights a plain reply is
# random bytes: its first content may come late, as UTF-8 and the tool-markup hold-back wait)
TTFT_KIND = "plain-1"
# "tools-1": the same with the tools in the prompt and tool_choice "auto": the time to the first token
# of the very prompt the constrained kinds send (their tools' text rendered, the grammar not asked for;
# tool_choice "none" leaves the tools out of the prompt)
TTFT_KINDS = (TTFT_KIND, "tools-1")


def first_delta_request(kind: str, i: int, model: str) -> dict:
    messages = [{"role": "user", "content": f"{MESSAGES[0]['content']} (request {i})"}]
    kw = dict(model=model, messages=messages, temperature=1.0, seed=i, max_tokens=256, stream=True)
    if kind == "plain":
        return kw
    choice = {"tools-1": "auto", "auto": "auto", "required": "required", "named": {"type": "function", "function": {"name": "book_table"}}}[kind]
    return {**kw, "tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": False}


async def first_deltas(base_url: str, rounds: int, settle: float = 0.25) -> dict:
    """Milliseconds from sending each streamed request to its first delta of text or a call (see
    the module docstring), `rounds` per kind after a first, uncounted round; `settle` seconds
    between requests (the one before, cancelled, ends in the thinker meanwhile)."""
    import openai

    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
    model = (await client.models.list()).data[0].id
    times: dict[str, list[float]] = {k: [] for k in (*FIRST_DELTA_KINDS, *TTFT_KINDS)}
    first_round: dict[str, float | None] = {}
    for r in range(rounds + 1):
        for kind, like in zip(TTFT_KINDS, ("plain", "tools-1")):
            t0 = time.perf_counter()
            await client.chat.completions.create(**{**first_delta_request(like, r, model), "stream": False,
                                                    "max_tokens": 1})
            got = (time.perf_counter() - t0) * 1e3
            await asyncio.sleep(settle)
            if r == 0:
                first_round[kind] = round(got, 1)
            else:
                times[kind].append(got)
        for kind in FIRST_DELTA_KINDS:
            t0 = time.perf_counter()
            got = None
            stream = await client.chat.completions.create(**first_delta_request(kind, r, model))
            async for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                calls = delta is not None and bool(delta.tool_calls)
                if calls or (delta is not None and delta.content and kind in ("plain", "auto")):
                    got = (time.perf_counter() - t0) * 1e3
                    break
            await stream.close()       # the rest of the reply is not timed: cancelled
            await asyncio.sleep(settle)
            if r == 0:
                first_round[kind] = None if got is None else round(got, 1)
            elif got is not None:
                times[kind].append(got)
    await client.close()

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"n": len(xs), "median_ms": round(statistics.median(xs), 1) if xs else None,
                "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 1) if xs else None}
    out = {k: stats(v) for k, v in times.items()}
    med = {k: v["median_ms"] for k, v in out.items()}
    ratios = {f"{k}/{base}": round(med[k] / med[base], 3) for k in ("required", "named")
              for base in ("plain", "auto", *TTFT_KINDS) if med[k] and med[base]}
    return {"first_delta": out, "ratios": ratios, "first_round_ms": first_round, "rounds": rounds, "settle_s": settle}


FORWARD_KINDS = ("plain", "tools-1", "required", "required-1", "named", "json_schema")
DRAFT_SETTINGS = {"off": dict(draft_forced=False, draft_prefill=False), "draft": dict(draft_forced=True, draft_prefill=False),
                  "prefill-draft": dict(draft_forced=True, draft_prefill=True)}


def forward_request(kind: str, i: int) -> dict:
    """The chat request of `kind` (the first-delta prompts; "required-1": the first tool alone)."""
    if kind == "json_schema":
        return {**request(kind, i, "m", 256), "messages": first_delta_request("plain", i, "m")["messages"]}
    if kind == "required-1":
        return {**first_delta_request("required", i, "m"), "tools": TOOLS[:1]}
    return first_delta_request("auto" if kind == "tools-1" else kind, i, "m")


def forwards(rounds: int, device: str = "cpu", max_tokens: int = 96) -> dict:
    """The in-process count of forwards (and ms) to each kind's first delta, per draft setting (see
    the module docstring)."""
    import torch

    from voxpipe.gateway.response_format import reply_constraint, response_format
    from voxpipe.gateway.tool_params import tool_options
    from voxpipe.services.runtime.config import OmniConfig
    from voxpipe.services.runtime.engine import Outbox
    from voxpipe.services.runtime.sampling import SamplingParams
    from voxpipe.services.runtime.weights import load_module
    from voxpipe.services.thinker.engine import ThinkerEngine, ThinkerJob
    from voxpipe.services.thinker.model import ThinkerModel
    from voxpipe.services.thinker.prompt import load_tokenizer, render, user_turn
    from voxpipe.tiny import make_tiny

    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="voxpipe-forwards-") as tmp:
        model_dir = make_tiny(Path(tmp), seed=0)
        cfg = OmniConfig.load(model_dir)
        th, tokenizer = cfg.thinker, load_tokenizer(str(model_dir), cfg)
        model = load_module(lambda: ThinkerModel(th), str(model_dir), "thinker.", device=dev, dtype=torch.float32,
                            load_format="auto", ignore=("visual.",))
    events: list[tuple[float, int]] = []        # (time, reply tokens made) at each forward's start and each step's end
    current: list[ThinkerJob] = []
    model.register_forward_pre_hook(lambda m, a: events.append((time.perf_counter(), -1 - len(current[0].generated))))
    loop = asyncio.new_event_loop()

    def first_delta_at(kind: str, opts, ids: list[int]) -> int:
        """Reply tokens needed for the kind's first delta (the gateway's parser on their text)."""
        if kind == "tools-1":       # its first token (the time to it: TTFT)
            return 1
        parser = opts.parser() if kind in ("required", "required-1", "named") else None
        for n in range(len(ids) + 1):
            text = tokenizer.decode(ids[:n])
            if parser is None:
                if text and not text.endswith("\ufffd"):
                    return n
            elif any(type(p).__name__ == "CallStart" for p in opts.parser().push(text)):
                return n
        return len(ids) + 1

    # an engine a setting (each its own prefix cache: the tools' prefix is cached by round 0's requests),
    # the settings alternated request by request (a load that drifts weighs on each alike)
    engines = {setting: ThinkerEngine(model, th, tokenizer, device=dev, max_active=8, max_len=2048,
                                      eos_ids=(th.tokens.im_end,), cuda_graphs=dev.type == "cuda", **flags)
               for setting, flags in DRAFT_SETTINGS.items()}
    counts = {s: {k: [] for k in FORWARD_KINDS} for s in engines}
    ms: dict[str, dict[str, list[float]]] = {s: {k: [] for k in FORWARD_KINDS} for s in engines}
    replies: dict[str, list[list[int]]] = {s: [] for s in engines}
    for i in range(rounds + 1):          # round 0: the grammars' compiles, not counted
        for kind in FORWARD_KINDS:
            body = forward_request(kind, i)
            opts = tool_options(body)
            constraint = reply_constraint(response_format(body), opts, False)
            prompt = render(tokenizer, th, user_turn(body["messages"][0]["content"]), tools=opts.prompt_tools).token_ids
            for setting, engine in engines.items():
                job = ThinkerJob(request_id=f"{kind}-{i}", outbox=Outbox(loop, limit=10 ** 6), prompt=prompt,
                                 max_tokens=max_tokens, params=SamplingParams(temperature=1.0, seed=i))
                if constraint is not None:
                    job.matcher = engine.grammars.matcher(engine.grammars.compile(constraint))
                t0 = time.perf_counter()
                engine.open_reply(job)        # as the server does (compile pool), before the job is submitted
                events[:] = [(t0, len(job.generated))]
                current[:] = [job]
                engine.submit(job)
                while engine.has_work():
                    engine.step()
                    events.append((time.perf_counter(), len(job.generated)))
                    with engine.lock:
                        engine._reap_and_check()
                while job.outbox.poll_timed() is not None:
                    pass
                need = first_delta_at(kind, opts, job.generated)
                # forwards begun before the reply held `need` tokens; the time it first held them
                made = [(t, n if n >= 0 else -1 - n, n < 0) for t, n in events]
                reached = next((t for t, n, _ in made if n >= need), None)
                replies[setting].append(job.generated)
                if i:
                    counts[setting][kind].append(sum(1 for t, n, fwd in made if fwd and n < need))
                    if reached is not None:
                        ms[setting][kind].append((reached - t0) * 1e3)

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {"median_ms": round(statistics.median(xs), 1) if xs else None,
                "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 1) if xs else None}
    out: dict = {}
    for setting, engine in engines.items():
        out[setting] = {k: {"forwards": counts[setting][k], "mean_forwards": round(statistics.mean(counts[setting][k]), 2),
                            **stats(ms[setting][k])} for k in FORWARD_KINDS}
        out[setting]["replies_sha256"] = hashlib.sha256(json.dumps(replies[setting]).encode()).hexdigest()
        out[setting]["drafts"] = dataclasses.asdict(engine.drafts)
    loop.close()
    return {"forwards": out, "rounds": rounds, "device": device, "max_tokens": max_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000, help="requests (the three kinds in turn)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=512, help="a valid reply of these schemas is shorter")
    p.add_argument("--base-url", help="a running gateway (default: serve the tiny checkpoint here)")
    p.add_argument("--device", default="cpu", help="the stages' device (without --base-url)")
    p.add_argument("--base-port", type=int, default=55051, help="first stage port (the gateway: +99)")
    p.add_argument("--dummy", action="store_true",
                   help="serve the released config with full-size dummy weights (without --base-url; a GPU)")
    p.add_argument("--first-delta", type=int, metavar="ROUNDS",
                   help="time the first delta of each kind instead (ROUNDS requests a kind, one at a time)")
    p.add_argument("--forwards", type=int, metavar="ROUNDS",
                   help="count forwards (and ms) to each kind's first delta in process, per draft setting instead")
    p.add_argument("--thinker-arg", action="append", default=[], metavar="FLAG",
                   help="a flag for the served thinker (without --base-url; repeatable), e.g. "
                        "--thinker-arg=--no-draft-forced")
    for stage in ("talker", "code2wav"):
        p.add_argument(f"--{stage}-arg", action="append", default=[], metavar="FLAG",
                       help=f"a flag for the served {stage} (without --base-url; repeatable), e.g. "
                            f"--{stage}-arg=--kv-cache-tokens=8192 to size a stack that shares a smaller GPU")
    p.add_argument("--settle", type=float, default=0.25, metavar="SECONDS",
                   help="--first-delta: the pause after each request (the cancelled one before ends meanwhile)")
    args = p.parse_args(argv)
    if args.forwards:
        print(json.dumps(forwards(args.forwards, args.device)), flush=True)
        return 0

    def run(base_url: str) -> dict:
        if args.first_delta:
            return asyncio.run(first_deltas(base_url, args.first_delta, args.settle))
        return asyncio.run(check(base_url, args.n, args.concurrency, args.max_tokens))
    if args.base_url:
        result = run(args.base_url)
    else:
        from voxpipe.cli import LocalStack
        from voxpipe.tiny import make_tiny

        with tempfile.TemporaryDirectory(prefix="voxpipe-constrained-") as tmp:
            if args.dummy:
                from voxpipe.services.runtime.config import released_config_path
                model, extra = released_config_path(), ["--load-format", "dummy"]
            else:
                model, extra = make_tiny(Path(tmp), seed=0), []
            http_port = args.base_port + 99
            stack = LocalStack(model, "127.0.0.1", args.base_port, args.device, http_port=http_port, extra=extra,
                               stage_extra={"thinker": args.thinker_arg, "talker": args.talker_arg,
                                            "code2wav": args.code2wav_arg})
            stack.start(timeout=400)
            try:
                result = run(f"http://127.0.0.1:{http_port}")
            finally:
                stack.stop()
    print(json.dumps(result), flush=True)
    return 0 if args.first_delta or result["valid"] == result["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
