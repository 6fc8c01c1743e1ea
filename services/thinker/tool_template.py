"""What the chat template is given about tools, besides the message text: each assistant turn's
`tool_calls` (OpenAI's shape: id, type, function.name, function.arguments as JSON text) and each
tool turn's `tool_call_id`. The template renders names and arguments as JSON text among its own
markup (Hermes / Qwen style), so that text must not hold a control token: it would be tokenized
as one (message text is tokenized with control-token strings split, see prompt._encode_template)."""

from __future__ import annotations

from collections.abc import Iterable
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
