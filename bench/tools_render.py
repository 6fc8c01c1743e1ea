"""Host time of the gateway's rendering of a long agent conversation with tools, and of the check
that the chat template renders the tools and the calls (a template that drops them is a 400): on
the CPU, with the tiny checkpoint's tokenizer and chat template. A CPU host-time figure: the
rendering runs on the gateway's host on any machine, no model forward is involved.

    python -m voxpipe.bench.tools_render [--tokens 26000] [--reps 15] [--model DIR]

The conversation is turn_host's (bench/conversation.py's ~200-token user turns and ~55-token
replies) with an agent's round trip every third exchange (an assistant turn that calls one of
bench/constrained_check.py's 5 tools, then the tool's result), grown to ~`--tokens` rendered
tokens; the request offers the 5 tools. Rows (median ms of `--reps`, JSON, then a table):

- render, tools: `render(tools=...)` as a request runs it (chat template, the tools check,
  tokenization with the conversation but its last message rendered before: its segments' ids
  remembered, as a gateway serving the conversation has them)
- render, no tools: the same conversation without `tools=` (its calls still checked)
- check, per conversation: the comparison of whole-conversation renders the check did per request
  before it was remembered (tool_template.conversation_tool_problem: rendered with tools vs
  without, with calls vs without; the template's conversation as render gives it, message text
  as placeholders)
- check, remembered: the check as a request runs it now (a hash of the template and tools, a hit)

Run from another tree's voxpipe (`python bench/tools_render.py`) the check rows that need
functions it lacks are left out: the render rows compare trees."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import OrderedDict
from pathlib import Path

import torch

# bench/constrained_check.py's 5 tools (nested objects, arrays, enums)
from voxpipe.bench.constrained_check import TOOLS
from voxpipe.bench.turn_host import conversation, median_ms
from voxpipe.tiny import model_or_tiny


def agent_messages(tok, cfg, tokens: int, seed: int = 0):
    """(`cfg`: the OmniConfig) ChatMessages of a conversation of ~`tokens` tokens with a tool round trip every third exchange."""
    from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, ToolCall

    rng = random.Random(seed)
    _, _, turns = conversation(cfg, int(tokens * 0.527), seed)     # BPE text renders to more tokens than its ids
    out = [ChatMessage.text("system", "You are a helpful agent. Call a tool when it helps.")]
    calls = 0
    for i, (role, ids) in enumerate(turns):
        if role == "assistant" and i % 6 == 1:
            f = TOOLS[calls % len(TOOLS)]["function"]
            call = ToolCall(f"call_{calls}", f["name"], json.dumps({"q": rng.randrange(10**6)}))
            out.append(ChatMessage("assistant", [ChatPart(text="")], tool_calls=[call]))
            out.append(ChatMessage("tool", [ChatPart(text=tok.decode(ids[:40]))], tool_call_id=call.id))
            calls += 1
        out.append(ChatMessage.text(role, tok.decode(ids)))
    return out, calls


def rendered_ms(tok, cfg, messages, tools, reps: int) -> float:
    """Median ms of rendering `messages` after the same conversation but its last message was
    rendered (each rep with a fresh copy of those segments' SegmentTokens)."""
    from voxpipe.services.thinker.prompt import SegmentTokens, render

    warm = SegmentTokens()
    render(tok, cfg, messages[:-1], tools=tools, segments=warm)
    times = []
    for _ in range(reps):
        cache = SegmentTokens()
        cache.entries, cache.chars = OrderedDict(warm.entries), warm.chars
        t0 = time.perf_counter()
        render(tok, cfg, messages, tools=tools, segments=cache)
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def measure(model: Path, tokens: int, reps: int) -> dict:
    from voxpipe.services.runtime.config import OmniConfig
    from voxpipe.services.thinker.prompt import Tool, load_tokenizer, render

    cfg = OmniConfig.load(model)
    tok = load_tokenizer(model, cfg)
    messages, calls = agent_messages(tok, cfg, tokens)
    tools = [Tool(t["function"]["name"], t["function"].get("description"), t["function"]["parameters"]) for t in TOOLS]
    n = len(render(tok, cfg.thinker, messages, tools=tools, segments=False).token_ids)
    ms = {"render, tools": rendered_ms(tok, cfg.thinker, messages, tools, reps),
          "render, no tools": rendered_ms(tok, cfg.thinker, messages, (), reps)}
    try:
        from voxpipe.services.thinker.tool_template import (TemplateToolChecks, check_template_renders_tools,
                                                            conversation_tool_problem)
    except ImportError:         # another tree's voxpipe: its render rows only
        return {"tokens": n, "messages": len(messages), "calls": calls, "ms": ms}
    conv = template_entries(tok, messages)
    entries = [t.template_entry() for t in tools]
    ms["check, per conversation"] = median_ms(lambda: conversation_tool_problem(tok, conv, entries), reps)
    checks = TemplateToolChecks()
    ms["check, remembered"] = median_ms(lambda: check_template_renders_tools(tok, conv, entries, checks), reps)
    return {"tokens": n, "messages": len(messages), "calls": calls, "ms": ms}


def template_entries(tok, messages) -> list[dict]:
    """The chat template's conversation of `messages` as render gives it the template: each text
    part a placeholder (its text is tokenized apart), the calls and call ids added."""
    from voxpipe.services.thinker.prompt import _sentinel, special_token_strings
    from voxpipe.services.thinker.tool_template import template_conversation

    conv, k = [], 0
    for m in messages:
        content = ""
        for p in m.parts:
            if p.text:
                content += _sentinel(k)
                k += 1
        conv.append({"role": m.role, "content": content})
    return template_conversation(messages, conv, special_token_strings(tok))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=26000, help="the conversation's rendered tokens, about")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--model", default=None, help="checkpoint folder (default: the tiny checkpoint, made now)")
    args = p.parse_args()
    torch.set_num_threads(1)
    model = model_or_tiny(args.model, "tools-render-")
    row = measure(model, args.tokens, args.reps)
    row["ms"] = {k: round(v, 3) for k, v in row["ms"].items()}
    print(json.dumps(row), flush=True)
    print(f"| piece ({row['tokens']:,} tokens, {row['messages']} messages, {row['calls']} calls, 5 tools) | ms |")
    print("|---|---|")
    for k, v in row["ms"].items():
        print(f"| {k} | {v:.3f} |")


if __name__ == "__main__":
    main()
