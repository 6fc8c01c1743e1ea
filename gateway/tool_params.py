"""Checked reading of the tool parameters of a request: the function definitions (chat's nested
`{"type": "function", "function": {...}}` and realtime's flat `{"type": "function", "name": ...}`),
`tool_choice` and `parallel_tool_calls`. Every problem is a 400 naming the parameter; an error
never echoes more than a bounded piece of the input.

`tool_choice`: "none" (the tools are left out of the prompt and the reply is plain text), "auto"
(the default with tools: the model may call; with the gateway's --constrain-tool-calls each call it
opens is constrained to a valid one), "required" or a named function (a call must come: the
thinker's grammar constraint, `tool_call_constraint`, makes the reply only valid calls, on every
API: chat completions, realtime, Converse)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import jsonschema

from voxpipe.services.thinker.constraint import Constraint, tool_calls, tool_calls_in_text
from voxpipe.services.thinker.grammar import check, check_remembered, checked_before
from voxpipe.services.thinker.prompt import Tool

from .errors import bad_request
from .tools import ToolCallParser

MAX_TOOLS = 128
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_DESCRIPTION_CHARS = 8192
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolOptions:
    tools: tuple[Tool, ...] = ()
    choice: str = "auto"            # none / auto / required / function
    function: str | None = None     # choice "function": the function that must be called
    parallel: bool = True           # more than one call in a reply

    @property
    def parses_calls(self) -> bool:
        """Whether the reply is read for calls (tools offered and not tool_choice 'none')."""
        return bool(self.tools) and self.choice != "none"

    @property
    def prompt_tools(self) -> tuple[Tool, ...]:
        return self.tools if self.choice != "none" else ()

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tools)

    @property
    def calls_only(self) -> bool:
        """The reply is only calls ('required' / a named function: its sampling is constrained to
        them): nothing in it is spoken, and it asks nothing of the talker."""
        return self.choice in ("required", "function")

    def parser(self, whole: bool = False, constrained_blocks: bool = False) -> ToolCallParser | None:
        """The reader of a reply for calls (None: tools not offered or 'none': all of it is content);
        where the constraint allows one function only, a call's head goes out with the reply's
        first token; with 'required', once the name being written begins one tool's name only.
        `whole`: a reply delivered at once (tools.py: a block the sampling left free is a call only
        when all of its JSON is one); `constrained_blocks`: 'auto' with each block the model opens
        held to a valid call (--constrain-tool-calls: tool_call_constraint)."""
        if not self.parses_calls:
            return None
        only = self.function if self.choice == "function" else None
        if self.choice == "required" and len(self.tools) == 1:
            only = self.tools[0].name
        return ToolCallParser(self.names, self.parallel, only=only, constrained=self.calls_only,
                              constrained_blocks=constrained_blocks, whole=whole)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


CHECKED_SCHEMAS = 1024     # schemas whose meta-schema check's outcome is remembered (LRU, by content)
_schemas: OrderedDict[str, str | None] = OrderedDict()    # content hash -> None (valid) / what is wrong
_schemas_lock = threading.Lock()


def check_schema(schema: Any, param: str) -> dict:
    """A JSON schema (an object valid against its draft's meta-schema; the latest draft without
    `$schema`). The check's outcome is remembered by the schema's content (its JSON text, keys in
    their order: the same text, the same outcome and message), up to CHECKED_SCHEMAS of them: the
    check costs ~2 ms a schema on the event loop (10 ms for bench/constrained_check.py's 5 tools
    on the CPU), and an agent sends the same tools with every request."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param=param, code="invalid_type")
    try:
        key = hashlib.sha256(json.dumps(schema, ensure_ascii=False).encode("utf-8", "surrogatepass")).hexdigest()
    except (TypeError, ValueError, RecursionError):      # not JSON text (parsed JSON always is): unremembered
        key = None
    with _schemas_lock:
        known = key is not None and key in _schemas
        if known:
            _schemas.move_to_end(key)
            problem = _schemas[key]
    if not known:
        problem = _schema_problem(schema)
        if key is not None:
            with _schemas_lock:
                _schemas[key] = problem
                while len(_schemas) > CHECKED_SCHEMAS:
                    _schemas.popitem(last=False)
    if problem is not None:
        raise bad_request(f"'{param}' is not a valid JSON schema{problem}", param=param, code="invalid_value")
    return schema


def _schema_problem(schema: dict) -> str | None:
    """None for a valid schema, else the tail of the 400's message: where and what is wrong."""
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        return f"{f' at {where!r}' if where else ''}: {e.message[:200]}"
    except RecursionError:    # a `pattern` of ~1,000 nested groups: Python's regex parser recurses per group
        return ": it nests too deeply to check (a regular expression in it, or the schema itself)"
    return None


def function_tool(spec: Any, param: str) -> Tool:
    """One function definition: name, optional description, parameters (a JSON schema), strict."""
    if not isinstance(spec, dict):
        raise bad_request(f"'{param}' must be an object", param=param, code="invalid_type")
    unknown = sorted(set(spec) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise bad_request(f"'{param}': unknown field {_short(unknown[0])}", param=f"{param}.{unknown[0]}"[:200],
                          code="unknown_parameter")
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise bad_request(f"'{param}.name' must be 1 to 64 letters, digits, '_' or '-', got {_short(name)}",
                          param=f"{param}.name", code="invalid_value")
    description = spec.get("description")
    if description is not None and (not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS):
        raise bad_request(f"'{param}.description' must be a string of at most {MAX_DESCRIPTION_CHARS} characters",
                          param=f"{param}.description", code="invalid_value")
    parameters = spec.get("parameters")
    if parameters is not None:
        parameters = check_schema(parameters, f"{param}.parameters")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"'{param}.strict' must be a boolean", param=f"{param}.strict", code="invalid_type")
    return Tool(name=name, description=description, parameters=parameters, strict=strict)


def tool_list(raw: Any, param: str, nested: bool) -> tuple[Tool, ...]:
    """`tools`: chat's `{"type": "function", "function": {...}}` entries (`nested`) or realtime's
    flat `{"type": "function", "name": ...}` ones; names unique."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad_request(f"'{param}' must be an array", param=param, code="invalid_type")
    if len(raw) > MAX_TOOLS:
        raise bad_request(f"'{param}' has {len(raw)} tools; the limit is {MAX_TOOLS}", param=param,
                          code="invalid_value")
    tools: list[Tool] = []
    for i, entry in enumerate(raw):
        p = f"{param}[{i}]"
        if not isinstance(entry, dict):
            raise bad_request(f"'{p}' must be an object", param=p, code="invalid_type")
        if entry.get("type") != "function":
            raise bad_request(f"'{p}.type' must be 'function' (only function tools are served), got "
                              f"{_short(entry.get('type'))}", param=f"{p}.type", code="invalid_value")
        if nested:
            unknown = sorted(set(entry) - {"type", "function"})
            if unknown:
                raise bad_request(f"'{p}': unknown field {_short(unknown[0])}", param=p, code="unknown_parameter")
            if "function" not in entry:
                raise bad_request(f"'{p}.function' is required", param=f"{p}.function",
                                  code="missing_required_parameter")
            tool = function_tool(entry["function"], f"{p}.function")
        else:
            tool = function_tool({k: v for k, v in entry.items() if k != "type"}, p)
        if any(t.name == tool.name for t in tools):
            raise bad_request(f"'{p}': the function name {tool.name!r} is used twice", param=p, code="invalid_value")
        tools.append(tool)
    return tuple(tools)


def tool_choice(raw: Any, tools: tuple[Tool, ...], param: str, nested: bool) -> tuple[str, str | None]:
    """(choice, function name): 'none' / 'auto' / 'required', or a named function (chat's
    `{"type": "function", "function": {"name": ...}}`, realtime's `{"type": "function", "name": ...}`)."""
    if raw is None:
        return "auto", None
    if isinstance(raw, str):
        if raw not in CHOICES:
            raise bad_request(f"'{param}' must be one of 'none', 'auto', 'required' or a named function, got "
                              f"{_short(raw)}", param=param, code="invalid_value")
        if raw != "none" and not tools:
            raise bad_request(f"'{param}' {raw!r} needs 'tools'", param=param, code="invalid_value")
        return raw, None
    if not isinstance(raw, dict) or raw.get("type") != "function":
        raise bad_request(f"'{param}' must be a string or {{'type': 'function', ...}} naming a function", param=param,
                          code="invalid_value")
    named = raw.get("function") if nested else raw
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise bad_request(f"'{param}' must name the function to call", param=param, code="invalid_value")
    if name not in {t.name for t in tools}:
        raise bad_request(f"'{param}' names the function {_short(name)}, which is not in 'tools'", param=param,
                          code="invalid_value")
    return "function", name


def tool_options(body: dict) -> ToolOptions:
    """Chat completions' `tools`, `tool_choice`, `parallel_tool_calls`."""
    tools = tool_list(body.get("tools"), "tools", nested=True)
    choice, function = tool_choice(body.get("tool_choice"), tools, "tool_choice", nested=True)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise bad_request("'parallel_tool_calls' must be a boolean", param="parallel_tool_calls",
                              code="invalid_type")
        if not tools:
            raise bad_request("'parallel_tool_calls' is only allowed with 'tools'", param="parallel_tool_calls",
                              code="invalid_value")
    return ToolOptions(tools=tools, choice=choice, function=function, parallel=parallel is not False)


def tool_call_constraint(opts: ToolOptions, constrain_auto: bool = False) -> Constraint | None:
    """The thinker's grammar constraint of a reply read for calls: with a call that must come
    (`tool_choice` 'required' or a named function), `<tool_call>` blocks of one of `opts.tools` (or
    of the named function alone), one or, with parallel calls, more (constraint.tool_calls); with
    'auto' and `constrain_auto` (the gateway's --constrain-tool-calls), free text in which each
    block the model opens is a valid call of one of them (constraint.tool_calls_in_text); else None."""
    if opts.calls_only:
        return tool_calls(_functions(opts), parallel=opts.parallel)
    if constrain_auto and opts.parses_calls:
        return tool_calls_in_text(_functions(opts))
    return None


def _functions(opts: ToolOptions) -> list[dict]:
    """The functions a call may name: `tools[].function`'s name and parameters (a named choice: that one)."""
    return [{"name": t.name, "parameters": t.parameters} for t in opts.tools
            if opts.choice != "function" or t.name == opts.function]


async def check_tool_constraint(opts: ToolOptions, constraint: Constraint, param: str = "tools",
                                schema_field: str = "function.parameters") -> None:
    """A 400 naming the function (`{param}[i].{schema_field}`) whose parameters the grammar library
    cannot enforce, when the calls' constraint does not compile (checked in a worker thread)."""
    if checked_before(constraint):
        return
    try:
        await asyncio.to_thread(check_remembered, constraint)
        return
    except ValueError as e:
        problem = str(e)
    for i, t in enumerate(opts.tools):
        if opts.choice == "function" and t.name != opts.function:
            continue
        try:
            await asyncio.to_thread(check, Constraint.json_schema(t.parameters or {"type": "object"}))
        except ValueError as e:
            where = f"{param}[{i}].{schema_field}"
            raise bad_request(f"'{where}' is not a schema this server can enforce in a call: {e}", param=where,
                              code="invalid_value") from None
    raise bad_request(f"'{param}': the calls' constraint does not compile: {problem}", param=param,
                      code="invalid_value")
