"""The realtime voice API (`/v1/realtime` WebSocket, OpenAI's Realtime protocol) on the real
gateway process in front of the session's three stage processes, driven by a plain `websockets`
client. Every server event is checked against the `openai` SDK's types for its dialect; replies
are compared with what the pipeline client makes for the same prompt; spoken input is real
speech from espeak-ng."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import shutil
import subprocess
import time
import urllib.request

import numpy as np
import pytest
import typing
from contextlib import asynccontextmanager

from openai.types.beta.realtime import RealtimeServerEvent as BetaServerEvent
from openai.types.beta.realtime import SessionUpdateEvent as BetaSessionUpdateEvent
from openai.types.realtime import RealtimeServerEvent, SessionUpdateEvent
from websockets.asyncio.client import connect

from conftest import STAGES, GatewayProcess
from voxpipe.audio import read_wav, resample, resample_clip
from voxpipe.client import AudioEvent, DoneEvent, PipelineClient, SpeechRequest, TextEvent
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, render
from voxpipe.v1 import stages_pb2 as pb

RATE = 24000
MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "temperature": 0}
SERVER_VAD = {"type": "realtime", "temperature": 0,
              "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}   # OpenAI's defaults


# ----------------------------------------------------------------------------- helpers

def _event_types(union) -> dict[str, type]:
    """The SDK's server event union -> {event type: its pydantic model}."""
    members = typing.get_args(typing.get_args(union)[0] if typing.get_origin(union) is typing.Annotated else union)
    return {name: m for m in members for name in typing.get_args(m.model_fields["type"].annotation)}


GA_EVENTS, BETA_EVENTS = _event_types(RealtimeServerEvent), _event_types(BetaServerEvent)


def check_event(event: dict, beta: bool) -> None:
    """The event is one the SDK knows, in the shape its types describe."""
    table = BETA_EVENTS if beta else GA_EVENTS
    assert event["type"] in table, f"{event['type']} is not a {'beta' if beta else 'GA'} server event"
    if beta and event["type"] in ("session.created", "session.updated"):
        # the beta types list OpenAI's model names only; ours is the checkpoint's
        event = {**event, "session": {k: v for k, v in event["session"].items() if k != "model"}}
    table[event["type"]].model_validate(event)


class Realtime:
    """One WebSocket session; every event received is validated against the SDK's types."""

    def __init__(self, ws, beta: bool) -> None:
        self.ws, self.beta, self.seen = ws, beta, []

    async def send(self, type: str, **fields) -> None:
        await self.ws.send(json.dumps({"type": type, **fields}))

    async def recv(self, timeout: float = 60) -> dict:
        event = json.loads(await asyncio.wait_for(self.ws.recv(), timeout))
        check_event(event, self.beta)
        self.seen.append(event)
        return event

    async def until(self, type: str, timeout: float = 60) -> list[dict]:
        """Events up to and including the next one of `type`."""
        events = []
        deadline = time.monotonic() + timeout
        while True:
            events.append(await self.recv(max(0.1, deadline - time.monotonic())))
            if events[-1]["type"] == type:
                return events

    async def update(self, **session) -> dict:
        await self.send("session.update", session=session)
        return (await self.until("session.updated"))[-1]["session"]


@asynccontextmanager
async def realtime(gateway, beta: bool = False, headers: dict | None = None):
    """A session on the gateway's /v1/realtime (after its session.created)."""
    headers = dict(headers or {}, **({"OpenAI-Beta": "realtime=v1"} if beta else {}))
    async with connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime", additional_headers=headers, max_size=None) as ws:
        rt = Realtime(ws, beta)
        assert (await rt.recv())["type"] == "session.created"
        yield rt


def run(coro):
    return asyncio.run(coro)


def of(events: list[dict], type: str) -> list[dict]:
    return [e for e in events if e["type"] == type]


def pcm16_base64(samples: np.ndarray) -> str:
    return base64.b64encode((np.clip(samples, -1, 1) * 32767).round().astype("<i2").tobytes()).decode()


def decoded(deltas: list[dict]) -> np.ndarray:
    return np.frombuffer(b"".join(base64.b64decode(d["delta"]) for d in deltas), dtype="<i2")


def speech(text: str) -> np.ndarray:
    """Real speech from espeak-ng, as 24 kHz float32."""
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install -y espeak-ng); it makes the spoken input")
    wav = subprocess.run(["espeak-ng", "--stdout", "-s", "160", text], check=True, capture_output=True).stdout
    x, rate = read_wav(wav)
    return resample(x, rate, RATE)


async def stream_audio(rt: Realtime, audio: np.ndarray, chunk_ms: int = 40) -> None:
    step = RATE * chunk_ms // 1000
    for i in range(0, len(audio), step):
        await rt.send("input_audio_buffer.append", audio=pcm16_base64(audio[i:i + step]))


def active_streams(stack) -> dict[str, float]:
    out = {}
    for stage in STAGES:
        body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read()
        m = re.search(rf'^voxpipe_active_streams\{{stage="{stage}"\}} (\S+)$', body.decode(), re.M)
        out[stage] = float(m.group(1))
    return out


def assert_stages_idle(stack, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (streams := active_streams(stack)) != {s: 0.0 for s in STAGES}:
        assert time.monotonic() < deadline, f"streams still active in the stages: {streams}"
        time.sleep(0.1)


def reference(stack, tokenizer, omni_config, messages: list[ChatMessage], **kw):
    """(text, pcm16 samples, DoneEvent) the pipeline client makes for the same prompt."""
    prompt = render(tokenizer, omni_config.thinker, messages)

    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            text, pcm, done = "", bytearray(), None
            async for ev in pc.stream(SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features,
                                                    encoding=pb.AUDIO_PCM16, **kw)):
                if isinstance(ev, TextEvent):
                    text += ev.text
                elif isinstance(ev, AudioEvent):
                    pcm += ev.data
                elif isinstance(ev, DoneEvent):
                    done = ev
            return text, np.frombuffer(bytes(pcm), dtype="<i2"), done
    return run(go())


def assert_same_audio(got: np.ndarray, want: np.ndarray) -> None:
    """Equal pcm16, give or take one step of rounding (the stages' float math is not bit-stable
    from one run to the next)."""
    assert got.shape == want.shape and got.size > 0
    assert np.abs(got.astype(np.int32) - want.astype(np.int32)).max() <= 1


def expected_status(done: DoneEvent) -> str:
    return "incomplete" if done.text_finish == pb.LENGTH else "completed"


def user_text(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def text_turn(rt: Realtime, text: str, **response) -> list[dict]:
    await rt.send("conversation.item.create", item=user_text(text))
    await rt.until("conversation.item.created" if rt.beta else "conversation.item.done")
    await rt.send("response.create", response=response)
    return await rt.until("response.done")


# ----------------------------------------------------------------------------- turns

def test_text_turn_speaks_what_the_pipeline_makes(gateway, stack, tokenizer, omni_config):
    text = "Hello there, how are you?"

    async def go():
        async with realtime(gateway) as rt:
            s = await rt.update(**MANUAL, max_audio_frames=10, voice="chelsie")
            assert s["audio"]["input"]["turn_detection"] is None and s["audio"]["output"]["voice"] == "chelsie"
            return await text_turn(rt, text, max_output_tokens=6)

    events = run(go())
    ref_text, ref_pcm, ref_done = reference(stack, tokenizer, omni_config, [ChatMessage.text("user", text)],
                                            speaker="chelsie", max_tokens=6, max_frames=10)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.output_item.added", "conversation.item.added",
                         "response.content_part.added"], kinds
    audio, transcript = of(events, "response.output_audio.delta"), of(events, "response.output_audio_transcript.delta")
    assert audio and transcript
    assert "".join(d["delta"] for d in transcript) == ref_text
    assert_same_audio(decoded(audio), ref_pcm)
    assert of(events, "response.output_audio_transcript.done")[0]["transcript"] == ref_text
    done = events[-1]["response"]
    assert done["status"] == expected_status(ref_done)
    if done["status"] == "incomplete":
        assert done["status_details"]["reason"] == "max_output_tokens"
    item = done["output"][0]
    assert item["role"] == "assistant" and item["content"][0] == {"type": "output_audio", "transcript": ref_text}
    assert done["usage"]["output_token_details"] == {"text_tokens": ref_done.completion_tokens,
                                                     "audio_tokens": ref_done.frames}
    assert done["usage"]["input_tokens"] == ref_done.prompt_tokens


def test_text_only_reply_in_the_beta_dialect(gateway, stack, tokenizer, omni_config):
    async def go():
        async with realtime(gateway, beta=True) as rt:
            s = await rt.update(modalities=["text"], turn_detection=None, temperature=0,
                                instructions="Be brief.")
            assert s["modalities"] == ["text"] and s["turn_detection"] is None
            return await text_turn(rt, "Tell me a story.", max_response_output_tokens=5)

    events = run(go())
    messages = [ChatMessage.text("system", "Be brief."), ChatMessage.text("user", "Tell me a story.")]
    ref_text, _, ref_done = reference(stack, tokenizer, omni_config, messages, audio=False, max_tokens=5)
    assert not of(events, "response.audio.delta") and not of(events, "response.output_audio.delta")
    assert "".join(d["delta"] for d in of(events, "response.text.delta")) == ref_text
    assert of(events, "response.text.done")[0]["text"] == ref_text
    assert of(events, "conversation.item.created")
    assert events[-1]["response"]["output"][0]["content"][0] == {"type": "text", "text": ref_text}


def test_audio_limit_reached_before_the_text_ends(gateway):
    """The talker stops at max_audio_frames while the thinker still writes: the reply is whole
    text with short audio, not an error."""
    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL)
            return await text_turn(rt, "Say a lot.", max_output_tokens=8, ignore_eos=True, max_audio_frames=2)

    events = run(go())
    done = events[-1]["response"]
    assert done["status"] == "incomplete", done["status_details"]
    assert done["usage"]["output_token_details"] == {"text_tokens": 8, "audio_tokens": 1}
    assert len(decoded(of(events, "response.output_audio.delta"))) == 1920 - 555


def test_spoken_turn_with_server_vad(gateway, stack, tokenizer, omni_config, tiny_model_dir):
    words = speech("What is the weather like today?")
    lead = np.zeros(RATE * 3 // 10, np.float32)
    stream = np.concatenate([lead, words, np.zeros(RATE, np.float32)])

    async def go():
        async with realtime(gateway) as rt:
            s = await rt.update(**SERVER_VAD, max_output_tokens=4, max_audio_frames=8)
            assert s["audio"]["input"]["turn_detection"] == {
                "type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500,
                "create_response": True, "interrupt_response": True}
            await stream_audio(rt, stream, chunk_ms=40)
            return await rt.until("response.done")

    events = run(go())
    kinds = [e["type"] for e in events]
    order = ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
             "input_audio_buffer.committed", "conversation.item.added", "response.created", "response.done"]
    assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order), kinds
    started = of(events, "input_audio_buffer.speech_started")[0]
    stopped = of(events, "input_audio_buffer.speech_stopped")[0]
    voiced = np.flatnonzero(np.abs(stream) > 0.02)            # espeak pads its output with some silence
    onset_ms, speech_end_ms = voiced[0] * 1000 // RATE, voiced[-1] * 1000 // RATE
    assert onset_ms - 300 - 64 <= started["audio_start_ms"] <= onset_ms   # 300 ms of padding before the speech
    assert speech_end_ms + 400 <= stopped["audio_end_ms"] <= speech_end_ms + 800   # after 500 ms of silence
    assert of(events, "input_audio_buffer.committed")[0]["item_id"] == started["item_id"] == stopped["item_id"]
    user = of(events, "conversation.item.added")[0]["item"]
    assert user["role"] == "user" and user["content"] == [{"type": "input_audio", "transcript": None}]
    assert of(events, "response.output_audio.delta")

    # the thinker heard exactly the utterance: the same reply as the pipeline for those samples
    clip = stream[started["audio_start_ms"] * RATE // 1000:stopped["audio_end_ms"] * RATE // 1000]
    features = FeatureExtractor.for_model(tiny_model_dir)(resample_clip(clip, RATE, 16000))
    heard = [ChatMessage("user", [ChatPart(features=features)])]
    ref_text, ref_pcm, _ = reference(stack, tokenizer, omni_config, heard, max_tokens=4, max_frames=8)
    assert "".join(d["delta"] for d in of(events, "response.output_audio_transcript.delta")) == ref_text
    assert_same_audio(decoded(of(events, "response.output_audio.delta")), ref_pcm)
    # the reply's first audio is timed from the end of speech (a person hears that delay)
    body = urllib.request.urlopen(f"{gateway.base_url}/metrics", timeout=5).read().decode()
    timed = re.search(r'^voxpipe_gateway_realtime_ttfp_seconds_count\{since="speech_stopped"\} (\S+)$', body, re.M)
    assert timed and float(timed.group(1)) >= 1


def test_manual_commit_then_multi_turn(gateway, stack, tokenizer, omni_config, tiny_model_dir):
    """Without VAD: commit, reply, then a second text turn whose prompt holds the first turn's
    audio (re-encoded from stored features) and the assistant's reply text."""
    words = speech("Good morning.")

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, max_audio_frames=6)
            noise = np.random.default_rng(0).normal(0, 0.1, RATE // 2).astype(np.float32)
            await stream_audio(rt, noise, chunk_ms=100)
            await rt.send("input_audio_buffer.clear")             # the noise never reaches the model
            await rt.until("input_audio_buffer.cleared")
            await stream_audio(rt, words, chunk_ms=100)
            await rt.send("input_audio_buffer.commit")
            committed = await rt.until("conversation.item.done")
            assert of(committed, "input_audio_buffer.committed")
            await rt.send("input_audio_buffer.commit")          # nothing left
            error = (await rt.until("error"))[-1]["error"]
            assert error["code"] == "input_audio_buffer_commit_empty"
            await rt.send("response.create", response={"max_output_tokens": 3})
            first = await rt.until("response.done")
            second = await text_turn(rt, "And then?", max_output_tokens=4)
            return first, second

    first, second = run(go())
    first_text = first[-1]["response"]["output"][0]["content"][0]["transcript"]
    features = FeatureExtractor.for_model(tiny_model_dir)(resample_clip(words, RATE, 16000))
    messages = [ChatMessage("user", [ChatPart(features=features)]), ChatMessage.text("assistant", first_text),
                ChatMessage.text("user", "And then?")]
    if not first_text:
        messages.pop(1)
    ref_text, _, _ = reference(stack, tokenizer, omni_config, messages, max_tokens=4, max_frames=6)
    assert second[-1]["response"]["output"][0]["content"][0]["transcript"] == ref_text


def test_created_items_build_the_prompt(gateway, stack, tokenizer, omni_config, tiny_model_dir):
    """Instructions, a user item with audio and text, an assistant item placed after it, a deleted
    item: the reply is the pipeline's for exactly that conversation. Then the client truncates
    the reply's audio."""
    hello = speech("Hello.")

    def message(item_id: str, role: str, *content) -> dict:
        return {"id": item_id, "type": "message", "role": role, "content": list(content)}

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, instructions="You are terse.", max_audio_frames=6)
            await rt.send("conversation.item.create", item=message(
                "u1", "user", {"type": "input_audio", "audio": pcm16_base64(hello)},
                {"type": "input_text", "text": "What did I say?"}))
            await rt.send("conversation.item.create", item=message("gone", "user", {"type": "input_text", "text": "x"}))
            await rt.send("conversation.item.create", previous_item_id="u1",
                          item=message("a1", "assistant", {"type": "output_text", "text": "You said hello."}))
            await rt.send("conversation.item.create",
                          item=message("u2", "user", {"type": "input_text", "text": "And?"}))
            await rt.send("conversation.item.delete", item_id="gone")
            events = await rt.until("conversation.item.deleted")
            await rt.send("response.create", response={"max_output_tokens": 4})
            events += await rt.until("response.done")
            reply = events[-1]["response"]["output"][0]
            await rt.send("conversation.item.truncate", item_id=reply["id"], content_index=0, audio_end_ms=100)
            events += await rt.until("conversation.item.truncated")
            await rt.send("conversation.item.truncate", item_id=reply["id"], content_index=0, audio_end_ms=10 ** 6)
            events += await rt.until("error")
            await rt.send("conversation.item.retrieve", item_id=reply["id"])
            events += await rt.until("conversation.item.retrieved")
            return events

    events = run(go())
    added = {e["item"]["id"]: e for e in of(events, "conversation.item.added")}
    assert added["a1"]["previous_item_id"] == "u1" and added["u2"]["previous_item_id"] == "gone"
    assert added["u1"]["item"]["content"] == [{"type": "input_audio", "transcript": None},
                                              {"type": "input_text", "text": "What did I say?"}]
    features = FeatureExtractor.for_model(tiny_model_dir)(resample_clip(hello, RATE, 16000))
    ref_text, ref_pcm, _ = reference(stack, tokenizer, omni_config, [
        ChatMessage.text("system", "You are terse."),
        ChatMessage("user", [ChatPart(features=features), ChatPart(text="What did I say?")]),
        ChatMessage.text("assistant", "You said hello."), ChatMessage.text("user", "And?")], max_tokens=4, max_frames=6)
    transcript = of(events, "response.output_audio_transcript.done")[0]["transcript"]
    assert transcript == ref_text
    assert_same_audio(decoded(of(events, "response.output_audio.delta")), ref_pcm)
    assert of(events, "conversation.item.truncated")[0]["audio_end_ms"] == 100
    assert of(events, "error")[0]["error"]["param"] == "audio_end_ms"
    kept = of(events, "conversation.item.retrieved")[0]["item"]["content"][0]["transcript"]
    assert transcript.startswith(kept) and len(kept) <= len(transcript)


# ----------------------------------------------------------------------------- interruptions

def test_barge_in_cancels_and_truncates_to_what_was_sent(gateway, stack):
    words = speech("Wait, stop, I have a question.")

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**SERVER_VAD, max_output_tokens=8, max_audio_frames=8)
            await rt.send("conversation.item.create", item=user_text("Talk a while."))
            await rt.send("response.create", response={"max_output_tokens": 8, "ignore_eos": True,
                                                        "max_audio_frames": 60})
            before = await rt.until("response.output_audio.delta")
            await stream_audio(rt, np.concatenate([words, np.zeros(RATE, np.float32)]), chunk_ms=20)
            events = before + await rt.until("conversation.item.truncated")
            events += await rt.until("response.done")          # the reply to the interruption
            item_id = of(events, "response.output_item.added")[0]["item"]["id"]
            await rt.send("conversation.item.retrieve", item_id=item_id)
            events += await rt.until("conversation.item.retrieved")
            return events

    events = run(go())
    first_id = of(events, "response.created")[0]["response"]["id"]
    kinds = [e["type"] for e in events]
    cancelled = next(e["response"] for e in events if e["type"] == "response.done")
    assert cancelled["id"] == first_id and cancelled["status"] == "cancelled"
    assert cancelled["status_details"]["reason"] == "turn_detected"
    assert kinds.index("input_audio_buffer.speech_started") < kinds.index("response.done")
    mine = [e for e in events if e.get("response_id") == first_id]
    heard = decoded(of(mine, "response.output_audio.delta"))
    assert 0 < len(heard) < 1920 * 59 - 555                     # cut short of the 59 frames asked for
    truncated = of(events, "conversation.item.truncated")[0]
    assert truncated["item_id"] == cancelled["output"][0]["id"]
    assert truncated["audio_end_ms"] == len(heard) * 1000 // RATE
    said = "".join(d["delta"] for d in of(mine, "response.output_audio_transcript.delta"))
    assert cancelled["output"][0]["content"][0]["transcript"] == said          # all the text made, as streamed
    kept = of(events, "conversation.item.retrieved")[0]["item"]["content"][0]["transcript"]
    assert said.startswith(kept)        # the item keeps the text spoken in the audio heard (ItemContent.align)
    # the interruption was committed and answered
    replies = [e["response"] for e in of(events, "response.done") if e["response"]["id"] != first_id]
    assert replies and replies[0]["status"] in ("completed", "incomplete")
    assert_stages_idle(stack)


def test_response_cancel(gateway, stack):
    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, max_audio_frames=12)
            await rt.send("conversation.item.create", item=user_text("Hi."))
            await rt.send("response.create", response={"max_output_tokens": 8, "ignore_eos": True})
            await rt.send("response.cancel")
            events = await rt.until("response.done")
            await rt.send("response.cancel")                    # nothing in progress any more
            events += await rt.until("error")
            return events

    events = run(go())
    done = of(events, "response.done")[0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "client_cancelled"
    assert done["output"][0]["status"] == "incomplete"
    assert events[-1]["error"]["code"] == "response_cancel_not_active"
    assert_stages_idle(stack)


def streams_total(stack, stage: str, outcome: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()
    m = re.search(rf'^voxpipe_streams_total\{{(?=[^}}]*stage="{stage}")(?=[^}}]*outcome="{outcome}")[^}}]*\}} (\S+)$',
                  body, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_reply_frees_the_stages(gateway, stack):
    """Hanging up after the first audio of a long reply cancels its talker and code2wav streams."""
    before = {s: streams_total(stack, s, "cancelled") for s in ("talker", "code2wav")}

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL)
            await rt.send("conversation.item.create", item=user_text("Go on."))
            await rt.send("response.create", response={"max_output_tokens": 8, "ignore_eos": True,
                                                        "max_audio_frames": 60})
            await rt.until("response.output_audio.delta")

    run(go())
    assert_stages_idle(stack)
    assert all(streams_total(stack, s, "cancelled") > before[s] for s in before)


def test_a_client_that_does_not_read_stalls_only_itself(gateway):
    async def go():
        async with realtime(gateway) as idle, realtime(gateway) as busy:
            await idle.update(**MANUAL, max_audio_frames=12)
            await idle.send("conversation.item.create", item=user_text("Hi."))
            await idle.send("response.create", response={"max_output_tokens": 8, "ignore_eos": True})
            await busy.update(**MANUAL, max_audio_frames=12)      # `idle` is not read from here on
            turn = await text_turn(busy, "Hello?", max_output_tokens=8, ignore_eos=True)
            late = await idle.until("response.done")             # and then catches up
            return turn, late

    turn, late = run(go())
    assert turn[-1]["response"]["status"] == "incomplete" and of(turn, "response.output_audio.delta")
    assert late[-1]["response"]["status"] == "incomplete" and of(late, "response.output_audio.delta")


# ----------------------------------------------------------------------------- bad input

def test_bad_events_get_errors_and_the_session_goes_on(gateway):
    async def go():
        async with realtime(gateway) as rt:
            errors = []
            await rt.ws.send("{not json")
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("no.such.event", event_id="evt_1")
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("input_audio_buffer.append", audio="@@not base64@@", event_id="evt_2")
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("session.update", session={"type": "realtime", "audio": {"output": {"voice": "nobody"}}})
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("conversation.item.create", item={"type": "message", "role": "user", "content": []})
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("conversation.item.truncate", item_id="item_missing", content_index=0, audio_end_ms=0)
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.ws.send("[" * 2000 + "]" * 2000)       # deeper than the JSON parser recurses
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("session.update", session={"type": "realtime", "max_audio_frames": 2**32})
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("response.create", response={"max_output_tokens": 2**32})
            errors.append((await rt.until("error"))[-1]["error"])
            await rt.update(**MANUAL, max_audio_frames=4)
            turn = await text_turn(rt, "Still there?", max_output_tokens=2)
            return errors, turn

    errors, turn = run(go())
    assert [e["code"] for e in errors] == ["invalid_json", "unknown_event_type", "invalid_base64", "invalid_value",
                                           "invalid_value", "item_not_found", "invalid_json", "invalid_value",
                                           "invalid_value"]
    assert "nested too deeply" in errors[6]["message"]
    assert [e["param"] for e in errors[7:]] == ["session.max_audio_frames", "response.max_output_tokens"]
    assert "4294967295" in errors[7]["message"] and "from 1 to 4096" in errors[8]["message"]
    assert errors[1]["event_id"] == "evt_1" and errors[2]["event_id"] == "evt_2"
    assert all(e["type"] == "invalid_request_error" and e["message"] for e in errors)
    assert turn[-1]["response"]["status"] in ("completed", "incomplete")
    assert of(turn, "response.output_audio.delta")


REFUSED_UPDATES = [
    ({"instructions": "x" * 1_000_000}, "session.instructions"),
    ({"instructions": "Changed.", "max_output_tokens": 4097}, "session.max_output_tokens"),
    ({"max_response_output_tokens": 0}, "session.max_response_output_tokens"),
    ({"max_output_tokens": "infinite"}, "session.max_output_tokens"),
    ({"instructions": "Changed.", "audio": {"output": {"voice": "nobody"}}}, "session.audio.output.voice"),
    ({"audio": {"output": {"format": {"type": "audio/pcmu"}}}}, "session.audio.output.format"),
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}, "session.audio.input.format"),
    ({"audio": {"input": {"turn_detection": {"type": "semantic_vad"}}}}, "session.audio.input.turn_detection.type"),
    ({"audio": {"input": {"turn_detection": {"threshold": 2}}}}, "session.audio.input.turn_detection.threshold"),
    ({"audio": {"input": {"transcription": {"language": "x" * 10_000}}}},
     "session.audio.input.transcription.language"),
    ({"audio": {"input": {"noise_reduction": {"type": "near_field"}}}}, "session.audio.input.noise_reduction"),
    ({"audio": {"output": {"speed": 1.5}}}, "session.audio.output.speed"),
    ({"temperature": 2.5, "instructions": "Changed."}, "session.temperature"),
    ({"output_modalities": ["video"]}, "session.output_modalities"),
    ({"instructions": 5}, "session.instructions"),
    ({"max_audio_frames": 0}, "session.max_audio_frames"),
    ({"ignore_eos": "yes"}, "session.ignore_eos"),
    ({"truncation": "sometimes"}, "session.truncation"),
    ({"truncation": 0.5}, "session.truncation"),
    ({"truncation": {"type": "tokens"}}, "session.truncation.type"),
    ({"truncation": {"type": "retention_ratio"}}, "session.truncation.retention_ratio"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 1.5}}, "session.truncation.retention_ratio"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": "half"}}, "session.truncation.retention_ratio"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "keep": "x" * 10_000}}, "session.truncation.keep"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": 5}},
     "session.truncation.token_limits"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"post_instructions": 0}}},
     "session.truncation.token_limits.post_instructions"),
    ({"truncation": {"type": "retention_ratio", "retention_ratio": 0.5, "token_limits": {"pre_instructions": 9}}},
     "session.truncation.token_limits.pre_instructions"),
]


def test_a_refused_session_update_changes_nothing(gateway):
    """Every session field is checked at session.update: a refused one gets an `error` naming it
    (`param`, the value quoted cut short), nothing of that update applies, and the next response
    runs with the session as it was. response.create's instructions and max_output_tokens have the
    same bounds."""
    async def go():
        async with realtime(gateway) as rt:
            before = await rt.update(**MANUAL, instructions="Be brief.", max_output_tokens=3)
            errors = []
            for session, _ in REFUSED_UPDATES:
                await rt.send("session.update", session={"type": "realtime", **session})
                errors.append((await rt.until("error"))[-1]["error"])
            # metadata: was echoed back twice (response.created, response.done) however large
            for response in ({"instructions": "x" * 20_000}, {"max_output_tokens": 4097},
                             {"metadata": {"k": "v" * 513}}, {"metadata": {f"k{i}": "v" for i in range(17)}}):
                await rt.send("response.create", response=response)
                errors.append((await rt.until("error"))[-1]["error"])
            after = await rt.update()
            widest = await rt.update(max_output_tokens=4096)
            await rt.update(max_output_tokens=3)
            turn = await text_turn(rt, "Still there?")
            return before, errors, after, widest, turn

    before, errors, after, widest, turn = run(go())
    assert [e["param"] for e in errors] == [param for _, param in REFUSED_UPDATES] + \
        ["response.instructions", "response.max_output_tokens", "response.metadata", "response.metadata"]
    assert all(e["type"] == "invalid_request_error" and len(e["message"]) < 300 for e in errors), errors
    assert "1000000 characters; the limit is 16384" in errors[0]["message"]
    assert "from 1 to 4096 or \"inf\"" in errors[1]["message"]
    assert after == before and after["instructions"] == "Be brief." and after["max_output_tokens"] == 3
    assert before["truncation"] == "auto"
    assert widest["max_output_tokens"] == 4096
    done = turn[-1]["response"]
    assert done["status"] in ("completed", "incomplete") and done["usage"]["output_token_details"]["text_tokens"] <= 3


LONG_KEY = "k" * 10_000
UNKNOWN_FIELDS = [        # (a client event with a field OpenAI's API does not define, the param its error names)
    ({"type": "session.update", "session": {"type": "realtime", "instructions": "Changed.", "tool_choise": "none"}},
     "session.tool_choise"),
    ({"type": "session.update", "session": {"type": "realtime", LONG_KEY: 1}},
     f"session.{LONG_KEY[:64]}... (10000 characters)"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"inputs": {}}}}, "session.audio.inputs"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"vad": None}}}},
     "session.audio.input.vad"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"output": {"voice": "aiden", "volume": 2}}}},
     "session.audio.output.volume"),
    ({"type": "response.create", "response": {"max_output_tokens": 2, "modality": ["text"]}}, "response.modality"),
    ({"type": "response.create", "response": {"audio": {"output": {"voice": "aiden", "speed": 1.0}}}},
     "response.audio.output.speed"),
    ({"type": "response.create", "response": {"audio": {"input": {}}}}, "response.audio.input"),
    ({"type": "conversation.item.create", "item": {**user_text("Hi."), "speaker": "me"}}, "item.speaker"),
    ({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                   "content": [{"type": "input_text", "text": "Hi.", "lang": "en"}]}},
     "item.content[0].lang"),
    ({"type": "conversation.item.create", "item": {"type": "function_call_output", "call_id": "c", "output": "x",
                                                   "result": 1}}, "item.result"),
    # nested objects: turn_detection, transcription, noise_reduction, tools[i], tool_choice (GA and beta paths)
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.5, "silence_ms": 200}}}}}, "session.audio.input.turn_detection.silence_ms"),
    ({"type": "session.update", "session": {"turn_detection": {"type": "server_vad", LONG_KEY: 1}}},
     f"session.turn_detection.{LONG_KEY[:64]}... (10000 characters)"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"transcription": {
        "language": "en", "lang": "en"}}}}}, "session.audio.input.transcription.lang"),
    ({"type": "session.update", "session": {"input_audio_transcription": {"language": "en", "temperature": 0}}},
     "session.input_audio_transcription.temperature"),
    ({"type": "session.update", "session": {"type": "realtime", "audio": {"input": {"noise_reduction": {
        "type": "near_field", "level": 1}}}}}, "session.audio.input.noise_reduction.level"),
    ({"type": "session.update", "session": {"input_audio_noise_reduction": {"kind": "far_field"}}},
     "session.input_audio_noise_reduction.kind"),
    ({"type": "session.update", "session": {"type": "realtime", "tools": [
        {"type": "function", "name": "f"}, {"type": "function", "name": "g", "strict": True}]}}, "session.tools[1].strict"),
    ({"type": "session.update", "session": {"type": "realtime", "tools": [{"type": "function", "name": "f"}],
                                            "tool_choice": {"type": "function", "function": {"name": "f"}}}},
     "session.tool_choice.function"),
    ({"type": "response.create", "response": {"tools": [{"type": "function", "name": "f", "params": {}}]}},
     "response.tools[0].params"),
    ({"type": "response.create", "response": {"tools": [{"type": "function", "name": "f"}],
                                              "tool_choice": {"type": "function", "name": "f", "id": "x"}}},
     "response.tool_choice.id"),
]


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_unknown_fields_are_refused_and_change_nothing(gateway, beta):
    """A field OpenAI's realtime API does not define, in session.update's `session`, response.create's
    `response` or conversation.item.create's `item` (at any depth read): an `error` naming it
    (unknown_parameter, the key cut short in param and message), and the event does nothing: the
    session is as it was, no response starts, no item is added; later responses still run. Fields
    the API defines but this server does not act on are accepted (as the SDK may send them)."""
    async def go():
        async with realtime(gateway, beta=beta) as rt:
            manual = {"turn_detection": None, "temperature": 0, "max_response_output_tokens": 3} if beta else \
                {**MANUAL, "max_output_tokens": 3}
            before = await rt.update(**manual, instructions="Be brief.")
            errors = []
            for event, _ in UNKNOWN_FIELDS:
                await rt.send(**event)
                errors.append((await rt.until("error"))[-1]["error"])
            after = await rt.update()
            # defined by the API (GA or beta) for OpenAI's platform: accepted with values that ask nothing
            accepted = await rt.update(tracing={"workflow_name": "w", "group_id": "g", "metadata": {"k": "v"}},
                                       include=[], prompt=None, reasoning={"effort": "none"},
                                       parallel_tool_calls=True, model=before["model"])
            await rt.update(tracing="auto")
            await rt.update(reasoning={})      # the SDK's RealtimeReasoningParam with no effort: asks nothing
            turn = await text_turn(rt, "Still there?", max_output_tokens=2, parallel_tool_calls=True,
                                   metadata={"k": "v"})
            return before, errors, after, accepted, turn, rt.seen

    before, errors, after, accepted, turn, seen = run(go())
    assert [e["param"] for e in errors] == [param for _, param in UNKNOWN_FIELDS]
    assert all(e["type"] == "invalid_request_error" and e["code"] == "unknown_parameter" for e in errors), errors
    assert all(len(e["message"]) < 200 and e["param"] in e["message"] for e in errors), errors
    assert after == before == accepted and after["instructions"] == "Be brief."
    # nothing of the refused events happened: no response, one item (the turn's own)
    assert len(of(seen, "response.created")) == 1
    assert len(of(seen, "conversation.item.created" if beta else "conversation.item.added")) == 2   # the turn's 2
    assert turn[-1]["response"]["status"] in ("completed", "incomplete")


ASKING_FIELDS = [
    ({"type": "session.update", "session": {"prompt": {"id": "pmpt_1"}}}, "session.prompt", "stored prompts"),
    ({"type": "session.update", "session": {"include": ["item.input_audio_transcription.logprobs"]}},
     "session.include", "log probabilities"),
    ({"type": "session.update", "session": {"reasoning": {"effort": "high"}}}, "session.reasoning", "reason"),
    ({"type": "session.update", "session": {"tracing": "on"}}, "session.tracing", "tracing"),
    ({"type": "session.update", "session": {"tracing": {"workflow_name": 3}}}, "session.tracing.workflow_name",
     "workflow_name"),
    ({"type": "session.update", "session": {"tracing": {"sample_rate": 1}}}, "session.tracing.sample_rate",
     "unknown parameter"),
    ({"type": "response.create", "response": {"prompt": {"id": "pmpt_1"}}}, "response.prompt", "stored prompts"),
    ({"type": "response.create", "response": {"reasoning": {"effort": "low"}}}, "response.reasoning", "reason"),
]


def test_platform_fields_that_ask_for_something_are_refused(gateway):
    """prompt, include, reasoning and tracing are OpenAI platform features: a value that asks this
    server for one (a stored prompt, transcription logprobs, reasoning effort, an unknown tracing
    mode) is an error naming the field, never silently dropped; the session goes on unchanged."""
    async def go():
        async with realtime(gateway) as rt:
            before = await rt.update(**MANUAL)
            errors = []
            for event, _, _ in ASKING_FIELDS:
                await rt.send(**event)
                errors.append((await rt.until("error"))[-1]["error"])
            return before, errors, await rt.update(), rt.seen

    before, errors, after, seen = run(go())
    assert [e["param"] for e in errors] == [param for _, param, _ in ASKING_FIELDS]
    assert all(words in e["message"] for e, (_, _, words) in zip(errors, ASKING_FIELDS)), errors
    assert all(e["type"] == "invalid_request_error" and len(e["message"]) < 300 for e in errors), errors
    assert after == before and not of(seen, "response.created")


def _nested_fields(model: str, beta: bool) -> dict:
    """A session.update setting every field the SDK's types define in turn_detection, transcription,
    noise_reduction, tools[i] and tool_choice (those this server serves given values, the rest null)."""
    tool = {"type": "function", "name": "lookup", "description": "Looks a word up.",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}
    transcription = {"model": model, "language": "en", "prompt": "Names: Oslo.", "delay": None, "keywords": None,
                     "languages": None}
    if beta:
        return {"turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200,
                                   "silence_duration_ms": 400, "create_response": False, "interrupt_response": True,
                                   "eagerness": "auto"},
                "input_audio_transcription": {k: transcription[k] for k in ("model", "language", "prompt")},
                "input_audio_noise_reduction": None, "tools": [tool], "tool_choice": "auto"}
    return {"type": "realtime", "audio": {"input": {
        "turn_detection": {"type": "server_vad", "threshold": 0.6, "prefix_padding_ms": 200, "silence_duration_ms": 400,
                           "create_response": False, "interrupt_response": True, "idle_timeout_ms": None},
        "transcription": transcription, "noise_reduction": None}},
        "tools": [tool], "tool_choice": {"type": "function", "name": "lookup"}}


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_sdk_typed_nested_fields_are_accepted(gateway, beta):
    """The nested objects checked for unknown keys still take every field the SDK's types define:
    the update (validated against the SDK's own SessionUpdateEvent, GA or beta) is applied."""
    async def go():
        async with realtime(gateway, beta=beta) as rt:
            model = rt.seen[0]["session"]["model"]
            event = {"type": "session.update", "session": _nested_fields(model, beta)}
            (BetaSessionUpdateEvent if beta else SessionUpdateEvent).model_validate(event)
            await rt.send(**event)
            return await rt.until("session.updated")

    events = run(go())
    assert not of(events, "error"), events
    session = events[-1]["session"]
    turn = session["turn_detection"] if beta else session["audio"]["input"]["turn_detection"]
    assert turn["threshold"] == 0.6 and turn["silence_duration_ms"] == 400 and turn["create_response"] is False
    assert [t["name"] for t in session["tools"]] == ["lookup"]
    assert session["tool_choice"] == ("auto" if beta else {"type": "function", "name": "lookup"})


def test_unknown_model_is_refused(gateway):
    async def go():
        async with connect(f"ws://127.0.0.1:{gateway.port}/v1/realtime?model=gpt-nope") as ws:
            event = json.loads(await ws.recv())
            check_event(event, beta=False)
            await ws.wait_closed()
            return event, ws.close_code

    event, code = run(go())
    assert event["type"] == "error" and event["error"]["code"] == "model_not_found"
    assert code == 1008


@pytest.fixture(scope="module")
def capped_gateway(stack, tiny_model_dir):
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"), "--max-sessions", "1",
                        "--api-key", "sesame")
    yield gw
    gw.stop()


def test_session_cap_and_api_key(capped_gateway):
    from websockets.exceptions import InvalidStatus

    key = {"Authorization": "Bearer sesame"}

    async def go():
        with pytest.raises(InvalidStatus) as refused:
            async with realtime(capped_gateway, headers={"Authorization": "Bearer wrong"}):
                pass
        async with realtime(capped_gateway, headers=key):
            async with connect(f"ws://127.0.0.1:{capped_gateway.port}/v1/realtime", additional_headers=key) as second:
                event = json.loads(await second.recv())
                await second.wait_closed()
        for attempt in range(50):       # the slot is free again once the server has seen the hang-up
            try:
                async with realtime(capped_gateway, headers=key) as again:
                    await again.update(**MANUAL)
                break
            except AssertionError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError("the session's slot was not given back")
        return refused.value.response.status_code, event, second.close_code

    status, event, code = run(go())
    assert status == 401
    assert event["type"] == "error" and event["error"]["type"] == "rate_limit_error"
    assert code == 1013


# ----------------------------------------------------------------------------- the parts on their own

def test_server_vad_finds_the_utterance_in_real_speech():
    from voxpipe.gateway.realtime.vad import ServerVad, ServerVadParams, SpeechStarted, SpeechStopped

    words = speech("Good evening, everybody.")
    stream = np.concatenate([np.zeros(RATE // 2, np.float32), words, np.zeros(RATE, np.float32)])
    voiced = np.flatnonzero(np.abs(stream) > 0.02) * 1000 // RATE
    vad = ServerVad(ServerVadParams(silence_duration_ms=300), RATE)
    events = [e for i in range(0, len(stream), 480) for e in vad.feed(stream[i:i + 480])]   # 20 ms pieces
    assert [type(e) for e in events] == [SpeechStarted, SpeechStopped]
    assert voiced[0] - 64 <= events[0].onset_ms <= voiced[0] + 100
    assert voiced[-1] + 250 <= events[1].end_ms <= voiced[-1] + 500


def test_stream_resampler_matches_linear_interpolation_of_the_whole():
    from voxpipe.gateway.realtime.vad import StreamResampler

    x = np.random.default_rng(1).normal(size=RATE).astype(np.float32)
    r = StreamResampler(RATE, 16000)
    cuts = [0, 1, 7, 480, 481, 5000, 12345, RATE]
    y = np.concatenate([r(x[a:b]) for a, b in zip(cuts, cuts[1:])])
    want = np.interp(np.arange(len(y)) * 1.5, np.arange(len(x)), x)
    assert len(y) == 16000 and np.abs(y - want).max() < 1e-5


def test_outbox_is_bounded_and_drops_a_cancelled_replys_audio():
    from voxpipe.gateway.realtime.outbox import Outbox, Outgoing

    async def go():
        box = Outbox(max_events=2)
        await box.put(Outgoing("a1", "r1", audio_samples=10))
        await box.put(Outgoing("t1", "r1"))
        third = asyncio.ensure_future(box.put(Outgoing("a2", "r1", audio_samples=20)))
        await asyncio.sleep(0.05)
        assert not third.done()                       # full: the producer waits
        first = await box.get()
        await asyncio.wait_for(third, 1)
        assert first.text == "a1" and box.in_flight_audio("r1") == 10
        assert await box.drop_audio("r1") == 20       # the queued audio delta, not the transcript
        assert (await box.get()).text == "t1"
        await box.close()
        await box.put(Outgoing("late"))               # dropped, never blocks
        return await box.get()

    assert run(go()) is None

