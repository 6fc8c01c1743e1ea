"""`response_format` of chat completions, as OpenAI defines it, served by constrained decoding in
the thinker (services/thinker/grammar.py): `{"type": "text"}` (free text), `{"type":
"json_object"}` (any JSON object), `{"type": "json_schema", "json_schema": {"name", "schema",
"strict", "description"}}` (a reply valid for the schema, with or without `strict`: it is always
enforced). A schema the grammar library cannot compile is a 400 naming
`response_format.json_schema.schema`, checked here before the request reaches the thinker (and
again by the thinker, whose own refusal is INVALID_ARGUMENT). Converse's ResponseFormat
(gateway/converse.py) is read into the same constraint by `schema_constraint`, `reply_constraint`
and `check_response_format`."""

from __future__ import annotations

import asyncio
import re

from voxpipe.services.thinker.constraint import MAX_CONSTRAINT_BYTES, Constraint, ConstraintKind
from voxpipe.services.thinker.grammar import check_remembered, checked_before

from .errors import bad_request
from .tool_params import ToolOptions, tool_call_constraint

PARAM = "response_format"
SCHEMA_PARAM = f"{PARAM}.json_schema.schema"
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")     # OpenAI's rule for json_schema.name
JSON_SCHEMA_KEYS = frozenset({"name", "schema", "strict", "description"})


def response_format(body: dict) -> Constraint | None:
    """The constraint of the request's `response_format` (None: free text); a 400 naming the part
    that is wrong. Whether the schema compiles is `check_response_format`'s."""
    value = body.get(PARAM)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"'{PARAM}' must be an object", param=PARAM, code="invalid_type")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema"})
    if extra:
        raise bad_request(f"unrecognized key in '{PARAM}': {extra[0][:64]!r}", param=f"{PARAM}.{extra[0][:64]}",
                          code="unknown_parameter")
    if kind == "text" or kind == "json_object":
        if "json_schema" in value:
            raise bad_request(f"'{PARAM}.json_schema' goes with type 'json_schema'", param=f"{PARAM}.json_schema",
                              code="invalid_value")
        return None if kind == "text" else Constraint(ConstraintKind.JSON_OBJECT)
    if kind != "json_schema":
        raise bad_request(f"'{PARAM}.type' must be 'text', 'json_object' or 'json_schema'", param=f"{PARAM}.type",
                          code="invalid_value")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request(f"'{PARAM}.json_schema' must be an object with 'name' and 'schema'",
                          param=f"{PARAM}.json_schema", code="missing_required_parameter" if spec is None else "invalid_type")
    extra = sorted(set(spec) - JSON_SCHEMA_KEYS)
    if extra:
        raise bad_request(f"unrecognized key in '{PARAM}.json_schema': {extra[0][:64]!r}",
                          param=f"{PARAM}.json_schema.{extra[0][:64]}", code="unknown_parameter")
    for key, kinds in (("strict", bool), ("description", str)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad_request(f"'{PARAM}.json_schema.{key}' must be a {'boolean' if kinds is bool else 'string'}",
                              param=f"{PARAM}.json_schema.{key}", code="invalid_type")
    return schema_constraint(spec.get("name"), spec.get("schema", {}),     # OpenAI: absent means any JSON
                             f"{PARAM}.json_schema.name", SCHEMA_PARAM)


def schema_constraint(name: object, schema: object, name_param: str, schema_param: str) -> Constraint:
    """The constraint of a `json_schema` response format (chat's, Converse's ResponseFormat): its
    name and its schema checked, a 400 naming `name_param` / `schema_param`, never echoing them."""
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise bad_request(f"'{name_param}' must be 1 to 64 letters, digits, '_' or '-'", param=name_param,
                          code="invalid_value")
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"'{schema_param}' must be a JSON Schema object", param=schema_param, code="invalid_type")
    constraint = Constraint.json_schema(schema)
    if len(constraint.text.encode()) > MAX_CONSTRAINT_BYTES:
        raise bad_request(f"'{schema_param}' exceeds {MAX_CONSTRAINT_BYTES // 1024} KiB", param=schema_param,
                          code="invalid_value")
    return constraint


def reply_constraint(structured: Constraint | None, tools: ToolOptions, constrain_tool_calls: bool,
                     param: str = PARAM) -> Constraint | None:
    """The reply's constraint: a JSON response format's (`structured`), else the tools'
    (tool_params.tool_call_constraint; --constrain-tool-calls: `constrain_tool_calls`). A JSON
    response format leaves no room for a call: it excludes a tool choice that requires one (a 400
    naming `param`), and is the reply's constraint even with --constrain-tool-calls."""
    if structured is None:
        return tool_call_constraint(tools, constrain_tool_calls)
    if tools.calls_only:
        raise bad_request(f"'{param}' excludes a 'tool_choice' that requires a call: the reply is one or the other",
                          param=param, code="invalid_value")
    return structured


async def check_response_format(constraint: Constraint | None, param: str = SCHEMA_PARAM) -> None:
    """A 400 naming the schema (`param`) when the grammar library refuses it (in a worker thread)."""
    if constraint is None or checked_before(constraint):
        return
    try:
        await asyncio.to_thread(check_remembered, constraint)
    except ValueError as e:
        raise bad_request(f"'{param}' is not a schema this server can enforce: {e}", param=param,
                          code="invalid_value") from None
