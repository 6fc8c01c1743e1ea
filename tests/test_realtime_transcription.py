"""Realtime input audio transcription (by the served model) and `conversation.item.truncate`, on
the real gateway process in front of the session's stage processes: the openai SDK's realtime
client (GA) and a plain WebSocket client whose every event is checked against the SDK's types
(beta). Transcripts are compared with what the pipeline makes for the transcription prompt."""

from __future__ import annotations

import asyncio
import re

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from conftest import GatewayProcess, free_port
from test_realtime import (MANUAL, RATE, decoded, of, pcm16_base64, realtime, run, speech, stream_audio,
                           text_turn, user_text)
from voxpipe.audio import resample, resample_clip
from voxpipe.client import DoneEvent, PipelineClient, SpeechRequest, TextEvent
from voxpipe.gateway.realtime.session import DEFAULT_SAMPLES_PER_TOKEN, ItemContent, TranscriptionSettings
from voxpipe.gateway.realtime.transcription import TranscriptionJob, max_tokens, transcription_messages
from voxpipe.services.thinker.engine import IncrementalDetokenizer
from voxpipe.services.thinker.prompt import ChatMessage, FeatureExtractor, render


def quantized(x: np.ndarray) -> np.ndarray:
    """The samples as the gateway decodes them from the pcm16 the client sends."""
    return (np.clip(x, -1, 1) * 32767).round().astype("<i2").astype(np.float32) / 32768.0


def pipeline_text(stack, prompt, max_new: int, min_new: int = 0) -> tuple[str, list[int], DoneEvent]:
    """(text, token ids, DoneEvent) of a text-only request for `prompt` (greedy)."""
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            text, ids, done = "", [], None
            async for ev in pc.stream(SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features,
                                                    audio=False, max_tokens=max_new, min_tokens=min_new)):
                if isinstance(ev, TextEvent):
                    text, ids = text + ev.text, ids + ev.token_ids
                elif isinstance(ev, DoneEvent):
                    done = ev
            return text, ids, done
    return run(go())


def reference_transcript(stack, tokenizer, omni_config, tiny_model_dir, clip_24k: np.ndarray,
                         settings: TranscriptionSettings) -> tuple[str, int, int]:
    """(transcript, prompt tokens, completion tokens) the pipeline makes for the transcription request."""
    features = FeatureExtractor.for_model(tiny_model_dir)(resample_clip(clip_24k, RATE, 16000))
    job = TranscriptionJob("item", 0, features, len(clip_24k), settings)
    prompt = render(tokenizer, omni_config.thinker, transcription_messages(job))
    text, ids, done = pipeline_text(stack, prompt, max_tokens(len(clip_24k)))
    return text, len(prompt.token_ids), done.completion_tokens


TRANSCRIBED = {**MANUAL, "audio": {"input": {"turn_detection": None, "transcription": {}}}}   # model unset


def served_model(gateway) -> str:
    return httpx.get(f"{gateway.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


# ----------------------------------------------------------------------------- transcription

def test_committed_audio_is_transcribed_beside_the_reply_with_the_openai_sdk(gateway, stack, tokenizer, omni_config,
                                                                                tiny_model_dir):
    """GA, through the openai SDK's realtime client: a manual commit with transcription on gives
    delta(s) and one completed event equal to the pipeline's text for the transcription prompt,
    with its usage, beside a reply; the item's transcript is the transcription."""
    words = speech("Good morning, how are you?")
    model = served_model(gateway)

    async def go():
        client = AsyncOpenAI(api_key="unused", base_url=f"{gateway.base_url}/v1",
                             websocket_base_url=f"ws://127.0.0.1:{gateway.port}/v1")
        events = []

        async def until(conn, done) -> None:
            async for ev in conn:
                events.append(ev)
                if done():
                    return

        async with client.realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "output_modalities": ["text"],
                                               "audio": {"input": {"turn_detection": None,
                                                                   "transcription": {"model": model,
                                                                                     "language": "en"}}}})
            await until(conn, lambda: events[-1].type == "session.updated")
            for i in range(0, len(words), RATE // 10):
                await conn.input_audio_buffer.append(audio=pcm16_base64(words[i:i + RATE // 10]))
            await conn.input_audio_buffer.commit()
            await conn.response.create(response={"max_output_tokens": 3})
            types = lambda: [e.type for e in events]                     # noqa: E731
            await until(conn, lambda: "response.done" in types()
                        and "conversation.item.input_audio_transcription.completed" in types())
            item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
            await conn.conversation.item.retrieve(item_id=item_id)
            await until(conn, lambda: events[-1].type == "conversation.item.retrieved")
        return events

    events = run(go())
    kinds = [e.type for e in events]
    assert "error" not in kinds, [e for e in events if e.type == "error"]
    session = next(e for e in events if e.type == "session.updated").session
    assert session.audio.input.transcription.model == model and session.audio.input.transcription.language == "en"
    deltas = [e for e in events if e.type == "conversation.item.input_audio_transcription.delta"]
    completed = next(e for e in events if e.type == "conversation.item.input_audio_transcription.completed")
    item_id = next(e.item_id for e in events if e.type == "input_audio_buffer.committed")
    assert completed.item_id == item_id and completed.content_index == 0
    assert all(d.item_id == item_id and d.content_index == 0 for d in deltas)
    want, prompt_tokens, completion_tokens = reference_transcript(
        stack, tokenizer, omni_config, tiny_model_dir, quantized(words), TranscriptionSettings(language="en"))
    assert want and completed.transcript == want == "".join(d.delta for d in deltas)
    usage = completed.usage
    assert usage.type == "tokens" and usage.input_tokens == prompt_tokens and usage.output_tokens == completion_tokens
    assert usage.total_tokens == prompt_tokens + completion_tokens
    assert usage.input_token_details.audio_tokens > 0
    assert usage.input_token_details.text_tokens + usage.input_token_details.audio_tokens == prompt_tokens
    assert next(e for e in events if e.type == "response.done").response.status in ("completed", "incomplete")
    retrieved = next(e for e in events if e.type == "conversation.item.retrieved").item
    assert retrieved.content[0].type == "input_audio" and retrieved.content[0].transcript == want


def test_server_vad_turns_are_transcribed_in_the_beta_dialect(gateway, stack, tokenizer, omni_config,
                                                              tiny_model_dir):
    """Beta names (`input_audio_transcription`), server VAD: the utterance VAD committed is
    transcribed (the prompt asks for it with the configured prompt) and answered; the reply is
    started before the transcription."""
    words = speech("What is the weather like today?")
    stream = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), words, np.zeros(RATE, np.float32)])
    model = served_model(gateway)

    async def go():
        async with realtime(gateway, beta=True) as rt:
            s = await rt.update(modalities=["text"], temperature=0, turn_detection={"type": "server_vad"},
                                max_response_output_tokens=2,
                                input_audio_transcription={"model": model, "prompt": "a question about weather"})
            assert s["input_audio_transcription"] == {"model": model, "language": None,
                                                      "prompt": "a question about weather"}
            await stream_audio(rt, stream, chunk_ms=40)
            events = await rt.until("conversation.item.input_audio_transcription.completed", timeout=120)
            if not of(events, "response.done"):
                events += await rt.until("response.done")
            return events

    events = run(go())
    started = of(events, "input_audio_buffer.speech_started")[0]
    stopped = of(events, "input_audio_buffer.speech_stopped")[0]
    clip = quantized(stream)[started["audio_start_ms"] * RATE // 1000:stopped["audio_end_ms"] * RATE // 1000]
    want, _, _ = reference_transcript(stack, tokenizer, omni_config, tiny_model_dir, clip,
                                      TranscriptionSettings(prompt="a question about weather"))
    completed = of(events, "conversation.item.input_audio_transcription.completed")[0]
    assert completed["item_id"] == started["item_id"]
    assert completed["transcript"] == want
    assert "".join(d["delta"] for d in of(events, "conversation.item.input_audio_transcription.delta")) == want
    assert of(events, "response.done")[0]["response"]["status"] in ("completed", "incomplete")
    kinds = [e["type"] for e in events]
    first = min(i for i, k in enumerate(kinds) if k.startswith("conversation.item.input_audio_transcription."))
    assert kinds.index("response.created") < first


def test_bad_transcription_settings_are_refused_naming_the_param(gateway):
    model = served_model(gateway)

    async def go():
        errors = []
        async with realtime(gateway) as rt:
            for transcription in ({"model": "whisper-1"}, {"model": model, "delay": "low"}, {"language": 5},
                                  {"language": "not a language"}, "on"):
                await rt.send("session.update", session={"type": "realtime",
                                                         "audio": {"input": {"transcription": transcription}}})
                errors.append((await rt.until("error"))[-1]["error"])
            unchanged = await rt.update(type="realtime")
            on = await rt.update(type="realtime", audio={"input": {"transcription": {"model": model}}})
            unset_model = await rt.update(type="realtime", audio={"input": {"transcription": {"language": "de"}}})
            off = await rt.update(type="realtime", audio={"input": {"transcription": None}})
        async with realtime(gateway, beta=True) as rt:
            await rt.send("session.update", session={"input_audio_transcription": {"model": "gpt-4o-transcribe"}})
            errors.append((await rt.until("error"))[-1]["error"])
        return errors, unchanged, on, unset_model, off

    errors, unchanged, on, unset_model, off = run(go())
    param = "session.audio.input.transcription"
    assert [e["param"] for e in errors] == [f"{param}.model", f"{param}.delay", f"{param}.language",
                                            f"{param}.language", param, "session.input_audio_transcription.model"]
    assert "'whisper-1' is not served here" in errors[0]["message"] and model in errors[0]["message"]
    assert all(e["type"] == "invalid_request_error" for e in errors)
    assert unchanged["audio"]["input"]["transcription"] is None
    assert on["audio"]["input"]["transcription"] == {"model": model, "language": None, "prompt": None}
    assert unset_model["audio"]["input"]["transcription"] == {"model": model, "language": "de", "prompt": None}
    assert off["audio"]["input"]["transcription"] is None


@pytest.fixture(scope="module")
def stageless_gateway(tiny_model_dir):
    """A gateway whose thinker and code2wav addresses have nobody listening."""
    gw = GatewayProcess(tiny_model_dir, f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}")
    yield gw
    gw.stop()


def transcriptions_total(gateway, outcome: str) -> float:
    text = httpx.get(f"{gateway.base_url}/metrics", timeout=5).text
    m = re.search(rf'^voxpipe_gateway_transcriptions_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_a_transcription_that_cannot_run_is_failed(stageless_gateway):
    noise = np.random.default_rng(1).normal(0, 0.1, RATE // 2).astype(np.float32)
    before = transcriptions_total(stageless_gateway, "failed")

    async def go():
        async with realtime(stageless_gateway) as rt:
            await rt.update(**TRANSCRIBED)
            await stream_audio(rt, noise, chunk_ms=100)
            await rt.send("input_audio_buffer.commit")
            return await rt.until("conversation.item.input_audio_transcription.failed", timeout=60)

    events = run(go())
    failed = events[-1]
    assert failed["item_id"] == of(events, "input_audio_buffer.committed")[0]["item_id"]
    assert failed["content_index"] == 0
    assert failed["error"]["code"] == "service_unavailable" and "thinker" in failed["error"]["message"]
    assert not of(events, "conversation.item.input_audio_transcription.completed")
    assert transcriptions_total(stageless_gateway, "failed") == before + 1


# ----------------------------------------------------------------------------- truncation

def test_alignment_of_text_and_audio():
    c = ItemContent("output_audio")
    for piece in ("Hel", "lo", " wor", "ld", "!"):
        c.add_text(1, piece)
    c.add_text(2, " ok")              # a delta of two tokens: kept or cut whole
    c.align(7000, complete=True)      # 7 tokens over 7000 samples: 1000 each
    assert [c.spoken_tokens(s) for s in (0, 999, 1000, 3500, 5999, 6000, 7000)] == [0, 0, 1, 3, 5, 6, 7]
    c.truncate_audio(6500)
    assert c.text == "Hello world!" and c.audio_samples == 6500
    c.truncate_audio(3500)
    assert c.text == "Hello wor"
    c.truncate_audio(0)
    assert c.text == "" and c.token_ends == []
    early = ItemContent("output_audio")          # stopped before the talker finished: the default rate
    for piece in ("a", "b", "c", "d"):
        early.add_text(1, piece)
    early.align(2 * DEFAULT_SAMPLES_PER_TOKEN, complete=False)
    early.truncate_audio(2 * DEFAULT_SAMPLES_PER_TOKEN - 1)
    assert early.text == "a"


def test_truncate_keeps_the_text_spoken_up_to_the_cut(gateway, stack, tokenizer, omni_config):
    """A spoken reply of T tokens over N samples, its speech stopped at max_audio_frames, truncated at
    half its audio: the item keeps the text of the first floor(cut / max(N / T, 320 ms)) tokens (at
    a delta's boundary), and the next reply's prompt holds exactly that text."""
    question, follow_up = "Tell me something.", "Go on."

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, max_audio_frames=30)
            first = await text_turn(rt, question, max_output_tokens=8, ignore_eos=True)
            reply = first[-1]["response"]["output"][0]
            audio = decoded(of(first, "response.output_audio.delta"))
            cut_ms = len(audio) * 1000 // RATE // 2
            await rt.send("conversation.item.truncate", item_id=reply["id"], content_index=0, audio_end_ms=cut_ms)
            truncated = await rt.until("conversation.item.truncated")
            await rt.send("conversation.item.retrieve", item_id=reply["id"])
            kept = (await rt.until("conversation.item.retrieved"))[-1]["item"]["content"][0]["transcript"]
            await rt.send("conversation.item.truncate", item_id=reply["id"], content_index=0, audio_end_ms=cut_ms + 1)
            beyond = (await rt.until("error"))[-1]["error"]
            second = await text_turn(rt, follow_up, max_output_tokens=3, output_modalities=["text"])
            return first, audio, cut_ms, truncated, kept, beyond, second

    first, audio, cut_ms, truncated, kept, beyond, second = run(go())
    transcript = first[-1]["response"]["output"][0]["content"][0]["transcript"]
    assert truncated[-1]["audio_end_ms"] == cut_ms and truncated[-1]["content_index"] == 0
    assert beyond["param"] == "audio_end_ms"
    # the reply's tokens, each one's text as the thinker's detokenizer emits it
    prompt = render(tokenizer, omni_config.thinker, [ChatMessage.text("user", question)])
    text, ids, _ = pipeline_text(stack, prompt, 8, 8)
    assert text == transcript and len(ids) == first[-1]["response"]["usage"]["output_token_details"]["text_tokens"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(t) for t in ids]
    assert first[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 29   # stopped at the cap
    per_token = max(len(audio) / len(ids), DEFAULT_SAMPLES_PER_TOKEN)
    spoken = min(len(ids), int((cut_ms * RATE // 1000) / per_token))
    assert 0 < spoken < len(ids)
    # cut at the last boundary of the deltas the gateway got at or before token `spoken`
    ends, boundaries = 0, {0}
    for d in of(first, "response.output_audio_transcript.delta"):
        ends += len(d["delta"])
        boundaries.add(ends)
    want_kept = max(("".join(pieces[:j]) for j in range(spoken + 1) if len("".join(pieces[:j])) in boundaries),
                    key=len)
    assert kept == want_kept and transcript.startswith(kept), (kept, pieces, spoken)
    assert len(kept) < len(transcript) or not "".join(pieces[spoken:])
    # what was cut is not in the conversation any more
    messages = [ChatMessage.text("user", question)] + ([ChatMessage.text("assistant", kept)] if kept else []) + \
        [ChatMessage.text("user", follow_up)]
    want, _, _ = pipeline_text(stack, render(tokenizer, omni_config.thinker, messages), 3)
    assert second[-1]["response"]["output"][0]["content"][0]["text"] == want


def test_bad_truncate_events_get_errors_naming_the_param(gateway):
    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, max_audio_frames=4)
            await rt.send("conversation.item.create", item=user_text("Hi."))
            user_id = (await rt.until("conversation.item.done"))[-1]["item"]["id"]
            turn = await text_turn(rt, "Hello?", max_output_tokens=2)
            reply_id = turn[-1]["response"]["output"][0]["id"]
            errors = []
            for fields in ({"item_id": reply_id, "content_index": 0, "audio_end_ms": -1},
                           {"item_id": reply_id, "content_index": 0, "audio_end_ms": "10"},
                           {"item_id": reply_id, "content_index": 0, "audio_end_ms": 1.5},
                           {"item_id": reply_id, "content_index": 0},
                           {"item_id": reply_id, "content_index": 0, "audio_end_ms": 10 ** 7},
                           {"item_id": reply_id, "content_index": 1, "audio_end_ms": 0},
                           {"item_id": user_id, "content_index": 0, "audio_end_ms": 0},
                           {"content_index": 0, "audio_end_ms": 0}):
                await rt.send("conversation.item.truncate", **fields)
                errors.append((await rt.until("error"))[-1]["error"])
            await rt.send("conversation.item.truncate", item_id=reply_id, content_index=0, audio_end_ms=0)
            ok = await rt.until("conversation.item.truncated")
            return errors, ok

    errors, ok = run(go())
    assert [e["param"] for e in errors] == ["audio_end_ms", "audio_end_ms", "audio_end_ms", "audio_end_ms",
                                            "audio_end_ms", "content_index", "item_id", "item_id"]
    assert [e["code"] for e in errors[:4]] == ["invalid_value", "invalid_type", "invalid_type",
                                               "missing_required_parameter"]
    assert ok[-1]["audio_end_ms"] == 0


def test_transcriptions_end_with_the_session(gateway, stack):
    """Hanging up while a transcription runs cancels it: no stage keeps the request."""
    from test_realtime import assert_stages_idle

    noise = np.random.default_rng(2).normal(0, 0.1, RATE * 2).astype(np.float32)

    async def go():
        async with realtime(gateway) as rt:
            await rt.update(**TRANSCRIBED)
            await stream_audio(rt, noise, chunk_ms=200)
            await rt.send("input_audio_buffer.commit")
            await rt.until("input_audio_buffer.committed")
            await asyncio.sleep(0.05)

    run(go())
    assert_stages_idle(stack)
