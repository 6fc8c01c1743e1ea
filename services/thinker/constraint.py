"""A constrained reply's constraint (ThinkerStart.constraint) as a value: what the pipeline client
sends, what the thinker compiles (grammar.py) and caches by `key`. No tensors, no grammar
library: the gateway and the client import it too.

`tool_calls` builds the constraint of OpenAI's `tool_choice: "required"` / a named function: the
reply is one or more Hermes-style blocks (Qwen's chat template)
`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, ARGS valid for that function's
`parameters` schema, as a structural tag whose `arguments` are a oneOf over the functions.
`tool_calls_in_text` is the opt-in form for `tool_choice: "auto"`: free text, and each block the
model opens constrained the same way."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import Enum

from voxpipe.v1 import stages_pb2 as pb

MAX_CONSTRAINT_BYTES = 256 * 1024     # a constraint's text (schema, regex or tag), UTF-8


class ConstraintKind(str, Enum):
    JSON_SCHEMA = "json_schema"       # text: a JSON Schema
    JSON_OBJECT = "json_object"       # text: "" (any JSON object)
    REGEX = "regex"                   # text: the regular expression
    STRUCTURAL_TAG = "structural_tag"  # text: the structural tag, as JSON


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""

    @classmethod
    def from_proto(cls, msg: pb.Constraint) -> "Constraint":
        """ValueError naming the field for an empty or oversized constraint (whether it compiles is
        grammar.py's to say)."""
        which = msg.WhichOneof("kind")
        if which is None:
            raise ValueError("constraint: set one of json_schema, json_object, regex, structural_tag")
        kind = ConstraintKind(which)
        if kind is ConstraintKind.JSON_OBJECT:
            if not msg.json_object:
                raise ValueError("constraint.json_object must be true when set")
            return cls(kind)
        text = getattr(msg, which)
        if not text:
            raise ValueError(f"constraint.{which} is empty")
        if len(text.encode()) > MAX_CONSTRAINT_BYTES:
            raise ValueError(f"constraint.{which} has {len(text.encode())} bytes; the limit is {MAX_CONSTRAINT_BYTES}")
        return cls(kind, text)

    def to_proto(self) -> pb.Constraint:
        if self.kind is ConstraintKind.JSON_OBJECT:
            return pb.Constraint(json_object=True)
        return pb.Constraint(**{self.kind.value: self.text})

    def canonical(self) -> str:
        """The same constraint, written one way: JSON texts re-serialized without spaces, keys in
        their order (a schema's property order is the reply's), ValueError when they are not JSON;
        a regex as given."""
        if self.kind in (ConstraintKind.JSON_SCHEMA, ConstraintKind.STRUCTURAL_TAG):
            try:
                value = json.loads(self.text)
            except (json.JSONDecodeError, RecursionError) as e:
                raise ValueError(f"constraint.{self.kind.value} is not valid JSON: {str(e)[:200]}") from None
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return self.text

    def key(self) -> str:
        """The cache key of its compiled grammar: a hash of the kind and the canonical text."""
        return hashlib.sha256(f"{self.kind.value}\0{self.canonical()}".encode()).hexdigest()

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        return cls(ConstraintKind.JSON_SCHEMA, json.dumps(schema, ensure_ascii=False))


TOOL_CALL_BEGIN = "<tool_call>\n"
TOOL_CALL_END = "\n</tool_call>"


def tool_call_schema(functions: list[dict]) -> dict:
    """The JSON Schema of one call's object: {"name": one of the functions' names, "arguments":
    that function's `parameters`} (a oneOf over the functions; {} parameters: any object).
    `functions`: OpenAI's `tools[].function` objects ({"name", "parameters"?, ...})."""
    options = []
    for f in functions:
        params = f.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    return options[0] if len(options) == 1 else {"oneOf": options}


def _call_tag(functions: list[dict]) -> dict:
    if not functions:
        raise ValueError("tool calls need at least one function")
    return {"type": "tag", "begin": TOOL_CALL_BEGIN,
            "content": {"type": "json_schema", "json_schema": tool_call_schema(functions)}, "end": TOOL_CALL_END}


def _tag(fmt: dict) -> Constraint:
    return Constraint(ConstraintKind.STRUCTURAL_TAG, json.dumps({"type": "structural_tag", "format": fmt}))


def tool_calls_in_text(functions: list[dict]) -> Constraint:
    """Free text in which every `<tool_call>` the model opens must hold a call valid for
    `tool_call_schema(functions)` and be closed (`tool_choice: "auto"`, opted in)."""
    return _tag({"type": "triggered_tags", "triggers": [TOOL_CALL_BEGIN.rstrip("\n")], "tags": [_call_tag(functions)],
                 "at_least_one": False, "stop_after_first": False})


def tool_calls(functions: list[dict], parallel: bool = True) -> Constraint:
    """The reply is only tool calls (`tool_choice: "required"`, or a named function: pass that one
    function): one `<tool_call>` block, or with `parallel` one or more separated by a newline,
    each call valid for `tool_call_schema(functions)`; then the end of the turn."""
    return _tag({"type": "tags_with_separator", "tags": [_call_tag(functions)], "separator": "\n",
                 "at_least_one": True, "stop_after_first": not parallel})
