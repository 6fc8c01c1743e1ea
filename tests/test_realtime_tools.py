"""Realtime function calling (GA events, beta names where they differ): session.tools and
tool_choice, function_call / function_call_output items rendered into the next prompt, a reply's
calls as function_call output items with their argument events, and bad input as `error` events.
Every event is checked against the `openai` SDK's types (test_realtime.check_event).

The random tiny model rarely writes a call by itself: the reply with a call is given to the
thinker (ThinkerStart.assistant_text) and runs through the real stack and a real ResponseRun."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from test_realtime import MANUAL, check_event, of, realtime, run, user_text
from voxpipe.gateway.config import GatewayConfig
from voxpipe.gateway.generation import Generation, run_pipeline
from voxpipe.gateway.realtime.events import Dialect, ProtocolError, ResponseOverrides, parse_client_event
from voxpipe.gateway.realtime.response import ResponseContext, ResponseRun
from voxpipe.gateway.realtime.session import Conversation, ResponseSettings, SessionConfig
from voxpipe.gateway.realtime.truncation import PromptWindow
from voxpipe.gateway.state import GatewayState
from voxpipe.gateway.tool_params import ToolOptions, tool_list
from voxpipe.client import PipelineClient
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, ToolCall, render

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
# no free strings: a constrained reply of the random model always completes within a few tokens
SHORT = {**WEATHER, "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}},
                                   "required": ["city"], "additionalProperties": False}}
CALL_ONLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL_TEXT = 'Checking.\n' + CALL_ONLY


def test_tools_and_a_function_round_trip_build_the_prompt(gateway, tokenizer, omni_config):
    async def go():
        async with realtime(gateway) as rt:
            s = await rt.update(**MANUAL, output_modalities=["text"], tools=[WEATHER], tool_choice="auto")
            await rt.send("conversation.item.create", item=user_text("Weather in Oslo?"))
            await rt.until("conversation.item.done")
            await rt.send("conversation.item.create", item={"type": "function_call", "call_id": "call_1",
                                                            "name": "get_weather", "arguments": '{"city": "Oslo"}'})
            added = (await rt.until("conversation.item.done"))[-1]["item"]
            await rt.send("conversation.item.create", item={"type": "function_call_output", "call_id": "call_1",
                                                            "output": "snow, -3 C"})
            await rt.until("conversation.item.done")
            await rt.send("response.create", response={"max_output_tokens": 2})
            return s, added, (await rt.until("response.done"))[-1]

    session, added, done = run(go())
    assert session["tools"] == [WEATHER] and session["tool_choice"] == "auto"
    assert added["type"] == "function_call" and added["call_id"] == "call_1"
    messages = [ChatMessage.text("user", "Weather in Oslo?"),
                ChatMessage("assistant", [ChatPart(text="")], tool_calls=[ToolCall("call_1", "get_weather",
                                                                                   '{"city": "Oslo"}')]),
                ChatMessage("tool", [ChatPart(text="snow, -3 C")], tool_call_id="call_1")]
    tools = tool_list([WEATHER], "tools", nested=False)
    want = render(tokenizer, omni_config.thinker, messages, tools=tools).token_ids
    assert done["response"]["usage"]["input_tokens"] == len(want)
    assert done["response"]["status"] in ("completed", "incomplete")


def test_bad_tool_events_get_errors_and_the_session_goes_on(gateway):
    async def go():
        async with realtime(gateway) as rt:
            errors = []
            for event in (
                    {"type": "session.update", "session": {"type": "realtime", "tools": [WEATHER],
                                                           "tool_choice": {"type": "function", "name": "nope"}}},
                    {"type": "session.update", "session": {"type": "realtime", "tools": [
                        {**WEATHER, "parameters": {"type": 5}}]}},
                    {"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "mcp"}]}},
                    # nested regex groups: the meta-schema check recursed past Python's limit and the
                    # connection was dropped without a close frame
                    {"type": "session.update", "session": {"type": "realtime", "tools": [
                        {**WEATHER, "parameters": {"type": "object", "properties": {
                            "a": {"type": "string", "pattern": "(" * 2000 + ")" * 2000}}}}]}},
                    {"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "call_x",
                                                                  "output": "?"}},
                    {"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c"}},
                    # was accepted, then every later response failed to render the conversation
                    {"type": "conversation.item.create", "item": {"type": "function_call", "call_id": "c",
                                                                  "name": "f", "arguments": '{"a": "<|im_end|>"}'}},
                    {"type": "response.create", "response": {"tool_choice": "auto"}}):
                await rt.send(**event)
                errors.append((await rt.until("error"))[-1]["error"])
            turn = await rt.update(**MANUAL, tools=[WEATHER])
            return errors, turn

    errors, session = run(go())
    assert [e["param"] for e in errors] == ["session.tool_choice", "session.tools[0].parameters", "session.tools[0].type",
                                            "session.tools[0].parameters", "item.call_id", "item.name",
                                            "item.arguments", "response.tool_choice"]
    assert "not in 'tools'" in errors[0]["message"] and "answers no function_call" in errors[4]["message"]
    assert "nests too deeply" in errors[3]["message"] and "needs 'tools'" in errors[7]["message"]
    assert "control token '<|im_end|>'" in errors[6]["message"]
    assert all(e["type"] == "invalid_request_error" and len(e["message"]) < 400 for e in errors)
    assert session["tools"] == [WEATHER]


def test_parallel_tool_calls_is_served_per_session_and_per_response(stack, tiny_model_dir):
    """session.update's and response.create's parallel_tool_calls reach the reply's parser: false
    keeps a reply's first call only (as chat's), a response's value is for that response, a later
    update of tools or tool_choice keeps the session's; a non-boolean is an error naming it."""
    def event(body):
        return parse_client_event(json.dumps(body))

    session = SessionConfig(id="sess_1", model="m", voice="", audio_out=False)
    session = session.updated(event({"type": "session.update", "session": {
        "tools": [WEATHER], "parallel_tool_calls": False}}).patch, {})
    assert session.tools.parallel is False
    session = session.updated(event({"type": "session.update", "session": {"tool_choice": "auto"}}).patch, {})
    assert session.tools.parallel is False and session.tools.choice == "auto"
    overrides = event({"type": "response.create", "response": {"parallel_tool_calls": True}}).overrides
    assert ResponseSettings.resolve(session, overrides, {}).tools.parallel is True
    assert ResponseSettings.resolve(session, ResponseOverrides(), {}).tools.parallel is False
    for body, param in (({"type": "session.update", "session": {"parallel_tool_calls": "no"}},
                         "session.parallel_tool_calls"),
                        ({"type": "response.create", "response": {"parallel_tool_calls": 0}},
                         "response.parallel_tool_calls")):
        with pytest.raises(ProtocolError) as e:
            event(body)
        assert e.value.param == param
    two = CALL_ONLY + "\n" + CALL_ONLY.replace("Oslo", "Rome")
    events, _ = given_run(stack, tiny_model_dir, two, parallel=False)
    assert [a["item"]["name"] for a in of(events, "response.output_item.added")] == ["get_weather"]
    assert json.loads(of(events, "response.function_call_arguments.done")[0]["arguments"]) == {"city": "Oslo"}
    events, _ = given_run(stack, tiny_model_dir, two)
    assert len(of(events, "response.function_call_arguments.done")) == 2


def given_run(stack, tiny_model_dir, text: str, beta: bool = False, on_event=None, parallel: bool = True):
    """A ResponseRun whose reply is given to the thinker, on the real stack; its events (checked
    against the SDK's types) and the conversation after it. `on_event(body, run)`: awaited after each
    event is recorded, inside the run's task."""
    state = GatewayState.load(GatewayConfig(thinker=stack.address("thinker"), code2wav=stack.address("code2wav"),
                                            model_dir=str(tiny_model_dir)))
    dialect = Dialect.BETA if beta else Dialect.GA
    conversation, events, runs = Conversation(), [], []

    async def emit(event, **_):
        body = event.wire(dialect)
        if body is not None:
            check_event(body, beta)
            events.append(body)
            if on_event is not None:
                await on_event(body, runs[0])

    async def withdraw(_):
        return 0

    async def go():
        async with PipelineClient(state.config.thinker, state.config.code2wav) as state.pipeline:
            gen = Generation.of(state)
            given = Generation(render=gen.render, audio_token=gen.audio_token, turn_start=gen.turn_start,
                               run=lambda req, arrived: run_pipeline(state, dataclasses.replace(req, assistant_text=text),
                                                                     arrived))
            ctx = ResponseContext(generation=given, conversation_id="conv_1", emit=emit,
                                  insert_item=lambda item: conversation.insert(item), has_item=conversation.has,
                                  withdraw_audio=withdraw)
            session = SessionConfig(id="sess_1", model="m", voice="", audio_out=False,
                                    tools=ToolOptions(tools=tool_list([WEATHER], "tools", nested=False),
                                                      parallel=parallel))
            settings = ResponseSettings.resolve(session, ResponseOverrides(), {})
            r = ResponseRun(ctx, settings, PromptWindow("", (("item_1", ChatMessage.text("user", "Weather in Oslo?")),)))
            runs.append(r)
            r.start()
            await r.task
    asyncio.run(go())
    return events, conversation


def test_a_reply_with_a_call_gives_a_function_call_item(stack, tiny_model_dir):
    events, conversation = given_run(stack, tiny_model_dir, CALL_TEXT)
    assert "".join(e["delta"] for e in of(events, "response.output_text.delta")) == "Checking."
    added = [e for e in of(events, "response.output_item.added") if e["item"]["type"] == "function_call"]
    assert len(added) == 1 and added[0]["output_index"] == 1 and added[0]["item"]["name"] == "get_weather"
    call_id = added[0]["item"]["call_id"]
    args = of(events, "response.function_call_arguments.delta")
    done = of(events, "response.function_call_arguments.done")[0]
    assert json.loads("".join(a["delta"] for a in args)) == {"city": "Oslo"} and done["call_id"] == call_id
    assert done["name"] == "get_weather" and json.loads(done["arguments"]) == {"city": "Oslo"}
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["message", "function_call"] and out[1]["status"] == "completed"
    assert out[0]["content"][0]["text"] == "Checking."
    # the next prompt has the call in the assistant turn
    msgs = conversation.messages("")
    assert msgs[-1].role == "assistant" and msgs[-1].tool_calls[0].id == call_id
    assert [p.text for p in msgs[-1].parts] == ["Checking."]
    # beta: the same events under their beta names
    beta_events, _ = given_run(stack, tiny_model_dir, CALL_TEXT, beta=True)
    assert of(beta_events, "response.function_call_arguments.done") and of(beta_events, "conversation.item.created")


def test_a_call_cut_off_by_a_cancel_is_done_as_incomplete(stack, tiny_model_dir):
    """response.cancel while a call's arguments are being written: the function_call item is done
    (response.output_item.done, conversation.item.done) with status incomplete and the arguments
    written so far, no arguments.done comes (they are not whole), and the response is cancelled."""
    async def cancel_at_arguments(body, run):
        if body["type"] == "response.function_call_arguments.delta" and run.cancel_reason is None:
            run.cancel_reason = "client_cancelled"        # what ResponseRun.cancel does, from inside the run
            run.task.cancel()
            await asyncio.sleep(0)

    long_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "' + "Oslo " * 40 + '"}}\n</tool_call>'
    events, conversation = given_run(stack, tiny_model_dir, long_call, on_event=cancel_at_arguments)
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] == "cancelled"
    assert not of(events, "response.function_call_arguments.done")
    done = of(events, "response.output_item.done")
    assert [(d["output_index"], d["item"]["type"], d["item"]["status"]) for d in done] == [
        (0, "function_call", "incomplete")]
    written = "".join(a["delta"] for a in of(events, "response.function_call_arguments.delta"))
    assert done[0]["item"]["arguments"] == written
    assert [d["item"]["status"] for d in of(events, "conversation.item.done")] == ["incomplete"]
    out = events[-1]["response"]["output"]
    assert [(o["type"], o["status"]) for o in out] == [("function_call", "incomplete")]
    assert conversation.items[0].status == "incomplete" and conversation.items[0].call.arguments == written


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_a_reply_of_calls_only_has_no_message_item(stack, tiny_model_dir, beta):
    """A reply that is only a call (as OpenAI's): its function_call item is output_index 0, no
    message item, content part or text event comes, response.output and the conversation hold the
    call alone, and the next prompt renders the call as the assistant's turn (as it did with the
    empty message item before it, which rendered as nothing)."""
    events, conversation = given_run(stack, tiny_model_dir, CALL_ONLY, beta=beta)
    added = of(events, "response.output_item.added")
    assert [(a["output_index"], a["item"]["type"]) for a in added] == [(0, "function_call")]
    assert {e["output_index"] for e in events if "output_index" in e} == {0}
    assert not [e for e in events if e["type"].startswith(("response.content_part", "response.text",
                                                           "response.output_text"))]
    created = "conversation.item.created" if beta else "conversation.item.added"
    assert [e["item"]["type"] for e in of(events, created)] == ["function_call"]
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["function_call"] and out[0]["status"] == "completed"
    assert json.loads(out[0]["arguments"]) == {"city": "Oslo"}
    assert [item.call is not None for item in conversation.items] == [True]
    assert events[-1]["response"]["usage"]["output_tokens"] > 0      # the call's tokens are the reply's
    call = conversation.items[0].call
    assert conversation.messages("") == [ChatMessage("assistant", [ChatPart(text="")], tool_calls=[
        ToolCall(call.call_id, "get_weather", call.arguments)])]


def test_text_after_a_call_is_a_message_item_after_it(stack, tiny_model_dir):
    """A reply whose text comes after its call: the function_call item is output_index 0, the message
    (opened at its first text) 1; the next prompt has one assistant turn, its text and its call (as
    the chat API's assistant message with content and tool_calls)."""
    events, conversation = given_run(stack, tiny_model_dir, CALL_ONLY + "\nDone.")
    added = of(events, "response.output_item.added")
    assert [(a["output_index"], a["item"]["type"]) for a in added] == [(0, "function_call"), (1, "message")]
    deltas = of(events, "response.output_text.delta")
    assert deltas and {d["output_index"] for d in deltas} == {1}
    text = "".join(d["delta"] for d in deltas)
    assert text.strip() == "Done." and of(events, "response.output_text.done")[0]["output_index"] == 1
    out = events[-1]["response"]["output"]
    assert [o["type"] for o in out] == ["function_call", "message"] and out[1]["content"][0]["text"] == text
    call = conversation.items[0].call
    assert conversation.messages("") == [ChatMessage("assistant", [ChatPart(text=text)], tool_calls=[
        ToolCall(call.call_id, "get_weather", call.arguments)])]


def test_a_required_call_is_constrained_streamed_and_never_spoken(gateway):
    """tool_choice 'required' (and a named function, per response): the reply is a valid call, sampled
    at temperature 1; its arguments come in several deltas as they are written, which add up to the
    `.done` arguments; with audio output nothing is spoken (no audio deltas). ignore_eos with a
    required call: the response fails naming tool_choice."""
    import jsonschema

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**{**MANUAL, "temperature": 1.0}, tools=[SHORT], tool_choice="required",
                            max_output_tokens=120)
            await rt.send("conversation.item.create", item=user_text("Weather in Oslo?"))
            await rt.until("conversation.item.done")
            runs = []
            for choice in ("required", {"type": "function", "name": "get_weather"}):
                await rt.send("response.create", response={"tool_choice": choice})
                runs.append(await rt.until("response.done", timeout=120))
            await rt.update(type="realtime", ignore_eos=True, max_audio_frames=8)
            await rt.send("response.create", response={})
            runs.append(await rt.until("response.done", timeout=60))
            return runs

    *calls, forced = run(go())
    checked = 0
    for events in calls:
        assert not of(events, "response.output_audio.delta")
        # calls only (audio output): no message item, the calls at output_index 0, 1, ...
        added = of(events, "response.output_item.added")
        assert [a["item"]["type"] for a in added] == ["function_call"] * len(added)
        assert [a["output_index"] for a in added] == list(range(len(added)))
        assert not [e for e in events if e["type"].startswith(("response.content_part", "response.output_audio"))]
        response = events[-1]["response"]
        assert [o["type"] for o in response["output"]] == ["function_call"] * len(added)
        assert response["status"] in ("completed", "incomplete"), response    # more calls may follow, to the limit
        done = of(events, "response.function_call_arguments.done")
        deltas = of(events, "response.function_call_arguments.delta")
        assert done and all(d["name"] == "get_weather" for d in done)
        for d in done[:-1] if response["status"] == "incomplete" else done:     # the last one may be cut
            pieces = [x["delta"] for x in deltas if x["item_id"] == d["item_id"]]
            assert len(pieces) > 1 and "".join(pieces) == d["arguments"]
            jsonschema.validate(json.loads(d["arguments"]), SHORT["parameters"])
            checked += 1
    assert checked
    details = forced[-1]["response"]["status_details"]
    assert forced[-1]["response"]["status"] == "failed" and "ignore_eos" in details["error"]["message"]


def test_the_gateway_flag_constrains_auto_calls_on_realtime(stack, tiny_model_dir):
    """--constrain-tool-calls (GatewayConfig.constrain_tool_calls, as on chat): a tool_choice 'auto'
    response is sampled under the thinker's tool_calls_in_text constraint of the session's tools,
    through the real stack; with ignore_eos the response fails naming 'tools'."""
    from voxpipe.services.thinker.constraint import tool_calls_in_text

    state = GatewayState.load(GatewayConfig(thinker=stack.address("thinker"), code2wav=stack.address("code2wav"),
                                            model_dir=str(tiny_model_dir), constrain_tool_calls=True))
    sent, events = [], []

    async def emit(event, **_):
        events.append(event.wire(Dialect.GA))

    async def withdraw(_):
        return 0

    def sending(req, arrived):
        sent.append(req.constraint)
        return run_pipeline(state, req, arrived)

    async def go(ignore_eos: bool):
        async with PipelineClient(state.config.thinker, state.config.code2wav) as state.pipeline:
            gen = dataclasses.replace(Generation.of(state), run=sending)
            ctx = ResponseContext(generation=gen, conversation_id="conv_1", emit=emit,
                                  insert_item=lambda item: Conversation().insert(item), has_item=lambda _: False,
                                  withdraw_audio=withdraw)
            session = SessionConfig(id="sess_1", model="m", voice="", audio_out=False, max_output_tokens=6,
                                    temperature=1.0, ignore_eos=ignore_eos,
                                    tools=ToolOptions(tools=tool_list([SHORT], "tools", nested=False)))
            r = ResponseRun(ctx, ResponseSettings.resolve(session, ResponseOverrides(), {}),
                            PromptWindow("", (("item_1", ChatMessage.text("user", "Weather?")),)))
            r.start()
            await r.task
    asyncio.run(go(False))
    assert sent == [tool_calls_in_text([{"name": "get_weather", "parameters": SHORT["parameters"]}])]
    assert events[-1]["type"] == "response.done" and events[-1]["response"]["status"] in ("completed", "incomplete")
    events.clear()
    asyncio.run(go(True))
    done = events[-1]["response"]
    assert done["status"] == "failed" and "--constrain-tool-calls" in done["status_details"]["error"]["message"]


def test_the_sdk_runs_a_function_call_round_trip(gateway, model, tokenizer, omni_config):
    """The unmodified `openai` SDK's realtime client (client.realtime.connect, GA): session.tools with
    tool_choice 'required' (the tiny random model's reply is then valid calls), each call as the SDK's
    typed events (response.output_item.added with a function_call item: call_id and name, its
    arguments' deltas adding up to .done, response.output_item.done); then the client's
    function_call_output for the first call and a response.create continue the turn: the prompt of
    that response is the conversation with the calls and the output rendered (its input_tokens)."""
    from openai import AsyncOpenAI

    async def go():
        sdk = AsyncOpenAI(api_key="unused", base_url=f"{gateway.base_url}/v1",
                          websocket_base_url=f"ws://127.0.0.1:{gateway.port}/v1")
        async with sdk.realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "output_modalities": ["text"], "tools": [SHORT],
                                               "tool_choice": "required", "max_output_tokens": 400})
            await conn.conversation.item.create(item=user_text("Weather in Oslo?"))
            await conn.response.create()
            first = [event async for event in until(conn, "response.done")]
            calls = [o for o in first[-1].response.output if o.type == "function_call"]
            await conn.conversation.item.create(item={"type": "function_call_output", "call_id": calls[0].call_id,
                                                      "output": "snow, -3 C"})
            await conn.response.create(response={"tool_choice": "auto", "max_output_tokens": 2})
            second = [event async for event in until(conn, "response.done")]
        # the same history through chat completions: the assistant turn of calls only, then the result
        calls = [o for o in first[-1].response.output if o.type == "function_call"]
        chat = await sdk.chat.completions.create(model=model, max_tokens=1, messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in calls]},
            {"role": "tool", "tool_call_id": calls[0].call_id, "content": "snow, -3 C"}],
            tools=[{"type": "function", "function": {k: v for k, v in SHORT.items() if k != "type"}}])
        return first, second, chat

    async def until(conn, last: str):
        async for event in conn:
            assert event.type != "error", event
            yield event
            if event.type == last:
                return

    first, second, chat = run(go())
    response = first[-1].response
    assert response.status == "completed", response.status_details
    calls = [o for o in response.output if o.type == "function_call"]
    assert [o.type for o in response.output] == ["function_call"] * len(calls)     # no empty message item
    assert [e.output_index for e in first if e.type == "response.output_item.added"] == list(range(len(calls)))
    added = [e.item for e in first if e.type == "response.output_item.added" and e.item.type == "function_call"]
    finished = [e.item for e in first if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert calls and [(a.call_id, a.name) for a in added] == [(c.call_id, "get_weather") for c in calls]
    assert [(f.call_id, f.arguments, f.status) for f in finished] == [(c.call_id, c.arguments, "completed") for c in calls]
    for c in calls:
        deltas = [e.delta for e in first if e.type == "response.function_call_arguments.delta" and e.item_id == c.id]
        done = [e for e in first if e.type == "response.function_call_arguments.done" and e.item_id == c.id]
        assert deltas and "".join(deltas) == done[0].arguments == c.arguments and done[0].call_id == c.call_id
        assert json.loads(c.arguments)["city"] in ("Oslo", "Rome")
    assert not [e for e in first if e.type == "response.output_text.delta"]     # nothing of a call is text
    messages = [ChatMessage.text("user", "Weather in Oslo?"),
                ChatMessage("assistant", [ChatPart(text="")],
                            tool_calls=[ToolCall(c.call_id, c.name, c.arguments) for c in calls]),
                ChatMessage("tool", [ChatPart(text="snow, -3 C")], tool_call_id=calls[0].call_id)]
    want = render(tokenizer, omni_config.thinker, messages, tools=tool_list([SHORT], "tools", nested=False)).token_ids
    assert second[-1].response.status in ("completed", "incomplete")
    assert second[-1].response.usage.input_tokens == len(want) == chat.usage.prompt_tokens


def test_response_tools_apply_to_their_response_only(gateway, model, tokenizer, omni_config):
    """`response.tools` with its `tool_choice` (OpenAI's per-response override) through the SDK's
    realtime client: a session without tools, one response given tools and tool_choice 'required':
    its reply is calls of that tool, and its prompt has the tools; the next response (no override)
    has the session's: no tools in its prompt, the calls still in the conversation."""
    from openai import AsyncOpenAI

    async def go():
        sdk = AsyncOpenAI(api_key="unused", base_url=f"{gateway.base_url}/v1",
                          websocket_base_url=f"ws://127.0.0.1:{gateway.port}/v1")
        async with sdk.realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "output_modalities": ["text"], "max_output_tokens": 400})
            await conn.conversation.item.create(item=user_text("Weather in Oslo?"))
            done = []
            for response in ({"tools": [SHORT], "tool_choice": "required"}, {"max_output_tokens": 1}):
                await conn.response.create(response=response)
                async for event in conn:
                    assert event.type != "error", event
                    if event.type == "response.done":
                        done.append(event.response)
                        break
            return done

    called, after = run(go())
    assert called.status == "completed", called.status_details
    calls = [o for o in called.output if o.type == "function_call"]
    assert [o.type for o in called.output] == ["function_call"] * len(calls)     # calls only: no message item
    assert calls and all(c.name == "get_weather" and json.loads(c.arguments)["city"] in ("Oslo", "Rome") for c in calls)
    user = ChatMessage.text("user", "Weather in Oslo?")
    tools = tool_list([SHORT], "tools", nested=False)
    assert called.usage.input_tokens == len(render(tokenizer, omni_config.thinker, [user], tools=tools).token_ids)
    history = [user, ChatMessage("assistant", [ChatPart(text="")],
                                 tool_calls=[ToolCall(c.call_id, c.name, c.arguments) for c in calls])]
    assert after.usage.input_tokens == len(render(tokenizer, omni_config.thinker, history).token_ids)
