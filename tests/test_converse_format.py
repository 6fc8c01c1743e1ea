"""Converse with a structured-output constraint (ConverseStart.response_format): the reply's text is
a JSON object or JSON valid for a schema, by the thinker's constrained decoding -- the same
constraint chat completions make of their `response_format` (gateway/response_format.py), so a
greedy reply equals chat's, word for word and, with audio, sample for sample (the JSON is what is
spoken). One gateway process serves both APIs in front of the session's stack. Bad input is
INVALID_ARGUMENT naming the field, never echoing more than a bounded piece of it."""

from __future__ import annotations

import base64
import io
import json
import wave

import grpc
import jsonschema
import numpy as np
import openai
import pytest

from conftest import GatewayProcess, free_port
from test_converse import check_audio_chunks, converse, split, start
from voxpipe.gateway.errors import APIError
from voxpipe.gateway.response_format import reply_constraint, response_format
from voxpipe.gateway.tool_params import tool_options
from voxpipe.services.thinker.constraint import Constraint, ConstraintKind
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import stages_pb2 as pb

# strings bounded (enums, maxLength): a constrained reply of the random model completes
ORDER = {"type": "object", "properties": {
    "item": {"type": "string", "enum": ["tea", "coffee"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9},
    "ship": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "express": {"type": "boolean"}},
             "required": ["city", "express"], "additionalProperties": False}},
    "required": ["item", "count", "ship"], "additionalProperties": False}
MAX_TOKENS = 120
PROMPT = "Order, please."
JSON_OBJECT = gw.ResponseFormat(type=gw.RESPONSE_FORMAT_JSON_OBJECT)
JSON_SCHEMA = gw.ResponseFormat(type=gw.RESPONSE_FORMAT_JSON_SCHEMA, name="order", schema_json=json.dumps(ORDER),
                                strict=True)
CHAT_JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
UNCOMPILABLE = {"type": "object", "properties": {"a": {"$ref": "#/no"}}}


@pytest.fixture(scope="module")
def both(stack, tiny_model_dir):
    """One gateway process with HTTP (chat completions) and the Converse port; yields (openai
    client, model id, Converse channel)."""
    grpc_port = free_port()
    process = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"),
                             "--grpc-port", str(grpc_port))
    try:
        client = openai.OpenAI(base_url=f"{process.base_url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
            grpc.channel_ready_future(ch).result(timeout=30)
            yield client, model, ch
    finally:
        process.stop()


def _text(responses) -> tuple[str, list[int], gw.ConverseDone]:
    text, _, done = split(responses)
    return "".join(t.text for t in text), [i for t in text for i in t.token_ids], done


def _chat(client, model, fmt, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}],
                                          response_format=fmt, **kw)


def test_json_object_equals_chat(both):
    client, model, ch = both
    got, _, done = _text(converse(ch, start(text=PROMPT, response_format=JSON_OBJECT, max_tokens=48,
                                            output_modalities=[gw.MODALITY_TEXT])))
    ref = _chat(client, model, {"type": "json_object"}, max_tokens=48, temperature=0)
    assert got == ref.choices[0].message.content and got.startswith("{")
    assert done.usage.prompt_tokens == ref.usage.prompt_tokens
    assert done.usage.completion_tokens == ref.usage.completion_tokens
    if done.text_finish == pb.STOP:
        assert isinstance(json.loads(got), dict)


def test_json_schema_replies_validate_and_equal_chat(both):
    """Greedy and sampled (temperature 1, seeded): the reply validates against the schema, and
    equals chat completions' for the same request."""
    client, model, ch = both
    for temperature, seed in ((0.0, None), (1.0, 3), (1.0, 4)):
        sampling = pb.Sampling(temperature=temperature, **({} if seed is None else {"seed": seed}))
        got, _, done = _text(converse(ch, start(text=PROMPT, response_format=JSON_SCHEMA, max_tokens=MAX_TOKENS,
                                                sampling=sampling, output_modalities=[gw.MODALITY_TEXT])))
        assert done.text_finish == pb.STOP
        jsonschema.validate(json.loads(got), ORDER)
        ref = _chat(client, model, CHAT_JSON_SCHEMA, max_tokens=MAX_TOKENS, temperature=temperature, seed=seed)
        assert got == ref.choices[0].message.content and ref.choices[0].finish_reason == "stop"


def test_with_audio_the_json_is_spoken_as_on_chat(both):
    """Audio output: the text is the same JSON as without audio, and the speech is chat's for the
    same request (its transcript is the JSON), sample for sample."""
    client, model, ch = both
    out = converse(ch, start(text=PROMPT, response_format=JSON_SCHEMA, max_tokens=MAX_TOKENS, max_frames=40,
                             voice="ethan"))
    text, audio, done = split(out)
    got = "".join(t.text for t in text)
    alone, _, _ = _text(converse(ch, start(text=PROMPT, response_format=JSON_SCHEMA, max_tokens=MAX_TOKENS,
                                           output_modalities=[gw.MODALITY_TEXT])))
    assert got == alone
    jsonschema.validate(json.loads(got), ORDER)
    samples = check_audio_chunks(audio, pb.AUDIO_PCM16)
    assert samples > 0 and done.audio_finish in (pb.STOP, pb.LENGTH)
    ref = _chat(client, model, CHAT_JSON_SCHEMA, max_tokens=MAX_TOKENS, temperature=0, modalities=["text", "audio"],
                audio={"voice": "ethan", "format": "wav"}, extra_body={"max_audio_frames": 40})
    assert ref.choices[0].message.audio.transcript == got
    with wave.open(io.BytesIO(base64.b64decode(ref.choices[0].message.audio.data))) as w:
        want = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(int)
    pcm = np.frombuffer(b"".join(a.data for a in audio), dtype="<i2").astype(int)
    assert pcm.shape == want.shape and np.abs(pcm - want).max() <= 1


def test_the_constraint_is_chats(omni_config):
    """parse_start makes the constraint chat's response_format makes of the same request: text is
    none, json_object any object, json_schema the schema (empty schema_json: any JSON, as chat's
    json_schema without `schema`); a JSON format is the reply's constraint even where the gateway
    constrains TOOL_CHOICE_AUTO's calls (--constrain-tool-calls)."""
    from voxpipe.gateway.converse import parse_start

    def made(fmt: gw.ResponseFormat, **kw) -> Constraint | None:
        return parse_start(start(text="hi", response_format=fmt, output_modalities=[gw.MODALITY_TEXT]).start,
                           omni_config, **kw).speech.constraint

    assert made(gw.ResponseFormat()) is None
    assert made(gw.ResponseFormat(type=gw.RESPONSE_FORMAT_TEXT)) is None
    assert response_format({"response_format": {"type": "text"}}) is None
    assert made(JSON_OBJECT) == Constraint(ConstraintKind.JSON_OBJECT) == \
        response_format({"response_format": {"type": "json_object"}})
    assert made(JSON_SCHEMA) == response_format({"response_format": CHAT_JSON_SCHEMA})
    assert made(gw.ResponseFormat(type=gw.RESPONSE_FORMAT_JSON_SCHEMA, name="any")) == \
        response_format({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}})
    tool = gw.FunctionTool(name="f", parameters_json=json.dumps({"type": "object"}))
    turn = parse_start(start(text="hi", response_format=JSON_SCHEMA, tools=[tool]).start, omni_config,
                       constrain_tool_calls=True)
    assert turn.speech.constraint == Constraint.json_schema(ORDER) and turn.response_format is not None
    chat = {"response_format": CHAT_JSON_SCHEMA, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    with pytest.raises(APIError, match="'response_format' excludes a 'tool_choice'"):      # chat refuses it alike
        reply_constraint(response_format(chat), tool_options(chat), False)

def _schema(schema_json: str, name: str = "x") -> gw.ResponseFormat:
    return gw.ResponseFormat(type=gw.RESPONSE_FORMAT_JSON_SCHEMA, name=name, schema_json=schema_json)


TOOL = gw.FunctionTool(name="f", parameters_json=json.dumps({"type": "object"}))
BAD = [
    ("malformed", dict(response_format=_schema('{"type": ')), "'response_format.schema_json' is not valid JSON"),
    ("nested too deep", dict(response_format=_schema("[" * 200_000)), "'response_format.schema_json' is not valid JSON"),
    ("not an object", dict(response_format=_schema("[1, 2]")), "'response_format.schema_json' must be a JSON Schema"),
    ("uncompilable", dict(response_format=_schema(json.dumps(UNCOMPILABLE))),
     "'response_format.schema_json' is not a schema this server can enforce"),
    ("too large", dict(response_format=_schema(json.dumps({"description": "x" * 300_000}))),
     "'response_format.schema_json' exceeds 256 KiB"),
    ("no name", dict(response_format=_schema("{}", name="")), "'response_format.name' must be 1 to 64"),
    ("bad name", dict(response_format=_schema("{}", name="a b" * 5000)), "'response_format.name' must be 1 to 64"),
    ("unknown type", dict(response_format=gw.ResponseFormat(type=7)), "response_format.type 7 is not"),
    ("schema with json_object", dict(response_format=gw.ResponseFormat(type=gw.RESPONSE_FORMAT_JSON_OBJECT,
                                                                       schema_json="{}")),
     "go with type RESPONSE_FORMAT_JSON_SCHEMA"),
    ("strict with text", dict(response_format=gw.ResponseFormat(strict=True)),
     "go with type RESPONSE_FORMAT_JSON_SCHEMA"),
    ("with a required call", dict(response_format=JSON_OBJECT, tools=[TOOL], tool_choice=gw.TOOL_CHOICE_REQUIRED),
     "'response_format' excludes a 'tool_choice' that requires a call"),
    ("with a named function", dict(response_format=JSON_SCHEMA, tools=[TOOL], tool_function="f"),
     "'response_format' excludes a 'tool_choice' that requires a call"),
    ("with min_tokens", dict(response_format=JSON_OBJECT, min_tokens=2), "response_format excludes min_tokens"),
    ("with ignore_eos", dict(response_format=JSON_SCHEMA, max_tokens=4, ignore_eos=True,
                             output_modalities=[gw.MODALITY_TEXT]), "response_format excludes min_tokens"),
    ("a required call's uncompilable parameters",
     dict(tools=[gw.FunctionTool(name="f", parameters_json=json.dumps(UNCOMPILABLE))],
          tool_choice=gw.TOOL_CHOICE_REQUIRED), "'tools[0].parameters_json' is not a schema this server can enforce"),
]


@pytest.mark.parametrize("fields,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_response_format_is_invalid_argument(both, fields, message):
    _, _, ch = both
    for _ in range(2):          # the second from the remembered check (grammar.check_remembered), the same
        with pytest.raises(grpc.RpcError) as err:
            converse(ch, start(text="hi", **fields))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
        assert message in err.value.details() and len(err.value.details()) < 400, err.value.details()[:400]
