"""Converse with function calling: tools and a history with a call and its output rendered into
the prompt exactly as the chat template renders them (the gateway process against the real
stack), and bad tool input as INVALID_ARGUMENT. The reading of a reply's calls is the parser
chat and realtime share (tests/test_tools.py); here each call is a `tool_call` message."""

from __future__ import annotations

import json

import grpc
import pytest

from test_converse import channel, converse, converse_gateway, split, start  # noqa: F401 (fixtures)
from voxpipe.gateway.converse import tool_call_messages
from voxpipe.gateway.tools import ToolCallParser
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, Tool, ToolCall, render
from voxpipe.v1 import gateway_pb2 as gw
from voxpipe.v1 import stages_pb2 as pb

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = gw.FunctionTool(name="get_weather", description="The weather in a city.", parameters_json=json.dumps(SCHEMA))
# no free strings: a constrained reply of the random model always completes within a few tokens
BOUNDED = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
SHORT = gw.FunctionTool(name="get_weather", parameters_json=json.dumps(BOUNDED))
HISTORY = [gw.HistoryItem(user_text="Weather in Oslo?"),
           gw.HistoryItem(function_call=gw.FunctionCall(call_id="c1", name="get_weather",
                                                        arguments_json='{"city": "Oslo"}')),
           gw.HistoryItem(function_output=gw.FunctionOutput(call_id="c1", output="snow"))]


def test_tools_and_history_are_the_prompt(channel, tokenizer, omni_config):
    _, _, done = split(converse(channel, start(tools=[WEATHER], history=HISTORY, max_tokens=2,
                                               output_modalities=[gw.MODALITY_TEXT], instructions="Be brief.")))
    messages = [ChatMessage.text("system", "Be brief."), ChatMessage.text("user", "Weather in Oslo?"),
                ChatMessage("assistant", [ChatPart(text="")], tool_calls=[ToolCall("c1", "get_weather", '{"city": "Oslo"}')]),
                ChatMessage("tool", [ChatPart(text="snow")], tool_call_id="c1")]
    want = render(tokenizer, omni_config.thinker, messages,
                  tools=[Tool("get_weather", "The weather in a city.", SCHEMA)]).token_ids
    assert done.usage.prompt_tokens == len(want)
    _, _, plain = split(converse(channel, start(tools=[WEATHER], tool_choice=gw.TOOL_CHOICE_NONE, text="Hi",
                                                max_tokens=1, output_modalities=[gw.MODALITY_TEXT])))
    assert plain.usage.prompt_tokens == len(render(tokenizer, omni_config.thinker,
                                                   [ChatMessage.text("user", "Hi")]).token_ids)


def test_a_call_is_a_tool_call_message():
    p = ToolCallParser({"get_weather"})
    pieces = p.push('Ok.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>') + p.finish()
    *deltas, msg = tool_call_messages(pieces)
    assert deltas[0].tool_call_delta.name == "get_weather" and deltas[0].tool_call_delta.call_id == msg.tool_call.call.call_id
    assert "".join(d.tool_call_delta.arguments_delta for d in deltas) == msg.tool_call.call.arguments_json
    assert msg.tool_call.index == 0 and msg.tool_call.call.name == "get_weather"
    assert msg.tool_call.call.call_id.startswith("call_")
    assert json.loads(msg.tool_call.call.arguments_json) == {"city": "Oslo"}


BAD = [
    (dict(text="hi", tools=[gw.FunctionTool(name="bad name")]), "tools[0].name"),
    (dict(text="hi", tools=[gw.FunctionTool(name="f", parameters_json="{")]), "not valid JSON"),
    (dict(text="hi", tools=[gw.FunctionTool(name="f", parameters_json='{"type": 3}')]), "not a valid JSON schema"),
    (dict(text="hi", tools=[gw.FunctionTool(name="f", parameters_json=json.dumps(   # was UNKNOWN: a RecursionError
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(" * 2000 + ")" * 2000}}}))]),
     "nests too deeply"),
    (dict(text="hi", tools=[WEATHER, WEATHER]), "used twice"),
    (dict(text="hi", tools=[WEATHER], tool_function="nope"), "is not one of tools"),
    (dict(text="hi", tools=[WEATHER], tool_function="get_weather", tool_choice=gw.TOOL_CHOICE_NONE),
     "excludes tool_choice TOOL_CHOICE_NONE"),
    (dict(text="hi", tools=[WEATHER], tool_choice=gw.TOOL_CHOICE_REQUIRED, max_tokens=4, ignore_eos=True,
          output_modalities=[gw.MODALITY_TEXT]), "excludes min_tokens / ignore_eos"),
    (dict(text="hi", tool_choice=gw.TOOL_CHOICE_REQUIRED), "needs tools"),
    (dict(history=[gw.HistoryItem(function_output=gw.FunctionOutput(call_id="zz", output="x"))]),
     "answers no function_call"),
    (dict(history=[gw.HistoryItem(user_text="hi")]), "the turn is empty"),
    (dict(text="hi", history=[gw.HistoryItem()]), "history[0] is empty"),
]


@pytest.mark.parametrize("fields,message", BAD, ids=[m for _, m in BAD])
def test_bad_tool_input_is_invalid_argument(channel, fields, message):
    with pytest.raises(grpc.RpcError) as err:
        converse(channel, start(**fields))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert message in err.value.details() and len(err.value.details()) < 400


@pytest.mark.parametrize("named", [False, True], ids=["required", "named"])
def test_a_required_call_streams_as_deltas_and_is_never_spoken(channel, named):
    """TOOL_CHOICE_REQUIRED / tool_function: the reply is a valid call (temperature 1), written out as
    ToolCallDeltas (head, then argument pieces that add up to the ToolCallOutput's arguments), with
    audio asked for and none made (no talker: audio_finish unspecified)."""
    import jsonschema

    seed = 1 if named else 0
    kw = dict(tool_function="get_weather") if named else dict(tool_choice=gw.TOOL_CHOICE_REQUIRED)
    out = converse(channel, start(text="Weather in Oslo?", tools=[SHORT], max_tokens=120, single_tool_call=True,
                                  sampling=pb.Sampling(temperature=1.0, seed=seed), **kw))
    text, audio, done = split(out)
    assert not audio and done.audio_finish == pb.FINISH_REASON_UNSPECIFIED and not "".join(t.text for t in text)
    assert done.text_finish == pb.STOP
    deltas = [r.tool_call_delta for r in out if r.WhichOneof("kind") == "tool_call_delta"]
    [call] = [r.tool_call for r in out if r.WhichOneof("kind") == "tool_call"]
    assert deltas[0].call_id == call.call.call_id and deltas[0].name == "get_weather" == call.call.name
    assert len(deltas) > 2 and "".join(d.arguments_delta for d in deltas) == call.call.arguments_json
    jsonschema.validate(json.loads(call.call.arguments_json), BOUNDED)


def test_the_gateway_flag_constrains_auto_calls_on_converse(omni_config):
    """--constrain-tool-calls (GatewayConfig.constrain_tool_calls, as on chat): TOOL_CHOICE_AUTO's
    reply carries the thinker's tool_calls_in_text constraint of the tools; without the flag none;
    with it, min_tokens / ignore_eos are refused naming the flag."""
    from voxpipe.gateway.converse import InvalidInput, parse_start
    from voxpipe.services.thinker.constraint import tool_calls_in_text

    fields = dict(text="hi", tools=[SHORT], output_modalities=[gw.MODALITY_TEXT], max_tokens=4)
    assert parse_start(start(**fields).start, omni_config).speech.constraint is None
    turn = parse_start(start(**fields).start, omni_config, constrain_tool_calls=True)
    assert turn.speech.constraint == tool_calls_in_text([{"name": "get_weather", "parameters": BOUNDED}])
    with pytest.raises(InvalidInput, match="--constrain-tool-calls"):
        parse_start(start(**fields, ignore_eos=True).start, omni_config, constrain_tool_calls=True)
