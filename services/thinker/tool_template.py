"""What the chat template is given about tools, besides the message text: each assistant turn's
`tool_calls` (OpenAI's shape: id, type, function.name, function.arguments as JSON text) and each
tool turn's `tool_call_id`. The template renders names and arguments as JSON text among its own
markup (Hermes / Qwen style), so that text must not hold a control token: it would be tokenized
as one (message text is tokenized with control-token strings split, see prompt._encode_template).

A template that ignores `tools=` or an assistant turn's `tool_calls` must not silently serve a
request that has them (`check_template_renders_tools`). Whether it renders them is a property of
the template and of the tools, not of the conversation: a Jinja chat template (Qwen's, Hermes')
renders the tools list and each call whatever the turns around them are. So it is decided once
per (template, tools) content, on a small fixed conversation (PROBE_*: a user turn; a user turn,
an assistant call and its result), by the comparison a request's own conversation would need
(rendered with them == without them: dropped), and remembered by a hash of that content
(TemplateToolChecks, LRU): a request pays a hash of the tools' JSON, not 2-4 extra renders of its
whole history. A template that cannot render the probe is judged on each request's conversation
itself (conversation_tool_problem, the uncached check; that its probe fails is remembered)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .prompt import ChatMessage


class TemplateToolError(ValueError):
    """A conversation with tools that cannot be rendered; `param`: the request parameter to name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_tool_text(text: str, specials: Iterable[str], where: str, param: str) -> None:
    found = sorted(s for s in specials if s in text)
    if found:
        raise TemplateToolError(f"{where} contains the model's control token {found[0]!r}, which tool "
                                "definitions and calls may not hold", param=param)


def template_conversation(messages: list["ChatMessage"], conv: list[dict], specials: frozenset[str]) -> list[dict]:
    """`conv` (one template entry per message, its content already set) with the assistant turns'
    tool_calls and the tool turns' tool_call_id added."""
    out = []
    for i, (m, entry) in enumerate(zip(messages, conv)):
        entry = dict(entry)
        if m.tool_calls:
            calls = []
            for j, c in enumerate(m.tool_calls):
                check_tool_text(c.name + c.arguments, specials, f"messages[{i}].tool_calls[{j}]", "messages")
                calls.append({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}})
            entry["tool_calls"] = calls
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def apply_template(tokenizer, conv: list[dict], add_generation_prompt: bool, tools: list[dict] | None) -> str:
    """The chat template's text of `conv` (with `tools=` when given)."""
    if tools is None:
        return tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt, tokenize=False,
                                         tools=tools)


def tools_dropped() -> TemplateToolError:
    return TemplateToolError("the checkpoint's chat template does not render tools (it ignores `tools=`), "
                             "so tool calling is not served with this model", param="tools")


def calls_dropped() -> TemplateToolError:
    return TemplateToolError("the checkpoint's chat template does not render an assistant turn's "
                             "tool_calls, so they cannot be part of the conversation", param="messages")


def has_calls(conv: list[dict]) -> bool:
    return any(m.get("tool_calls") for m in conv)


def conversation_tool_problem(tokenizer, conv: list[dict], tools: list[dict] | None) -> TemplateToolError | None:
    """What the template drops of this conversation's tools (None: nothing): the `tools` (rendered
    with them == without them), or the calls of assistant turns (rendered with them == without
    them). Up to four renders of the whole conversation: the uncached check."""
    if tools and apply_template(tokenizer, conv, True, tools) == apply_template(tokenizer, conv, True, None):
        return tools_dropped()
    if has_calls(conv):
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conv]
        if apply_template(tokenizer, conv, True, tools) == apply_template(tokenizer, bare, True, tools):
            return calls_dropped()
    return None


PROBE_TOOLS = [{"role": "user", "content": "?"}]


def probe_calls(tools: list[dict] | None) -> list[dict]:
    """A user turn, an assistant turn that is one call (of the first tool, when there are tools) and
    its result."""
    name = tools[0]["function"]["name"] if tools else "f"
    call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": "{}"}}
    return [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"}]


@dataclass(frozen=True)
class TemplateToolSupport:
    """What a template renders with these tools (probed): the tools list, an assistant turn's calls."""
    tools: bool
    calls: bool

    @classmethod
    def probe(cls, tokenizer, tools: list[dict] | None) -> "TemplateToolSupport":
        """The uncached check's comparisons on the fixed probe conversations; an exception of the
        template's (it cannot render them) goes to the caller."""
        renders_tools = not tools or (apply_template(tokenizer, PROBE_TOOLS, True, tools)
                                      != apply_template(tokenizer, PROBE_TOOLS, True, None))
        conv = probe_calls(tools)
        bare = [{k: v for k, v in m.items() if k != "tool_calls"} for m in conv]
        renders_calls = apply_template(tokenizer, conv, True, tools) != apply_template(tokenizer, bare, True, tools)
        return cls(renders_tools, renders_calls)


TEMPLATE_TOOL_CHECKS = 256     # (template, tools) contents whose probed support is remembered


class TemplateToolChecks:
    """TemplateToolSupport by a hash of (the tokenizer's class, its chat template and special
    tokens, the tools' JSON): the content, never a name; None where the template cannot render the
    probe. Bounded (`max_entries`, least recently used dropped first); thread-safe (renders run in
    worker threads)."""

    def __init__(self, max_entries: int = TEMPLATE_TOOL_CHECKS) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[str, TemplateToolSupport | None] = OrderedDict()
        self.hits = self.misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def key(tokenizer, tools: list[dict] | None) -> str:
        kind = type(tokenizer)
        template = getattr(tokenizer, "chat_template", None)       # None: the class renders (ChatML bytes)
        specials = getattr(tokenizer, "special_tokens_map", None)
        text = json.dumps([f"{kind.__module__}.{kind.__qualname__}", template, specials, tools],
                          ensure_ascii=False, sort_keys=True, default=str)
        return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()

    def support(self, tokenizer, tools: list[dict] | None) -> TemplateToolSupport | None:
        key = self.key(tokenizer, tools)
        with self._lock:
            if key in self.entries:
                self.entries.move_to_end(key)
                self.hits += 1
                return self.entries[key]
        try:
            got = TemplateToolSupport.probe(tokenizer, tools)
        except Exception:       # noqa: BLE001 -- any template error: judged on each conversation instead
            got = None
        with self._lock:
            self.misses += 1
            self.entries[key] = got
            while len(self.entries) > self.max_entries:
                self.entries.popitem(last=False)
        return got


_CHECKS = TemplateToolChecks()


def check_template_renders_tools(tokenizer, conv: list[dict], tools: list[dict] | None,
                                 checks: TemplateToolChecks | None = _CHECKS) -> None:
    """TemplateToolError when the chat template drops what the conversation says about tools: the
    `tools`, or the calls of assistant turns (param "messages"). A template that ignores them must
    not silently serve a request. `checks`: where the probed support is remembered (None: the
    uncached check, on this conversation)."""
    calls = has_calls(conv)
    if not tools and not calls:
        return
    support = checks.support(tokenizer, tools) if checks is not None else None
    if support is None:
        problem = conversation_tool_problem(tokenizer, conv, tools)
    else:
        problem = tools_dropped() if not support.tools else calls_dropped() if calls and not support.calls else None
    if problem is not None:
        raise problem
