"""The realtime user audio streamed to the thinker while it is spoken (gateway/realtime/heard.py),
driven by the unmodified OpenAI SDK's realtime clients (GA and beta) on the real gateway and
stages: each reply equals the pipeline's for the same prompt sent whole (text and pcm16 at
temperature 0), for clips shorter and longer than an encoder window, several append sizes, server
VAD and manual commits, a barge-in, a conversation that changes while the user speaks; a cleared
buffer and a session closed mid-utterance free everything in the stages."""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.request

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI

from test_realtime import RATE, active_streams, assert_stages_idle, decoded, pcm16_base64, reference, speech
from voxpipe.audio import resample_clip
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor

MANUAL = {"type": "realtime", "audio": {"input": {"turn_detection": None}}, "temperature": 0}
REPLY = {"max_output_tokens": 3}
FRAMES = 6


@pytest.fixture(scope="module")
def model(gateway) -> str:
    return httpx.get(f"{gateway.base_url}/v1/models", timeout=10).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def features(tiny_model_dir):
    fe = FeatureExtractor.for_model(tiny_model_dir)
    return lambda clip_24k: fe(resample_clip(clip_24k, RATE, 16000))


def sdk(gateway) -> AsyncOpenAI:
    return AsyncOpenAI(api_key="unused", base_url=f"{gateway.base_url}/v1",
                       websocket_base_url=f"ws://127.0.0.1:{gateway.port}/v1")


def metric(gateway, name: str, **labels) -> float:
    body = urllib.request.urlopen(f"{gateway.base_url}/metrics", timeout=5).read().decode()
    sel = "".join(f'(?=[^}}]*{k}="{v}")' for k, v in labels.items())
    m = re.search(rf'^{name}(?:\{{{sel}[^}}]*\}})? (\S+)$', body, re.M)
    return float(m.group(1)) if m else 0.0


def streamed(gateway, outcome: str) -> float:
    return metric(gateway, "voxpipe_gateway_realtime_streamed_turns_total", outcome=outcome)


def noise(seconds: float, seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(int(RATE * seconds)) * 0.1).astype(np.float32)


async def collect(conn, until: str, events: list) -> list:
    async for ev in conn:
        assert ev.type != "error", ev
        events.append(ev)
        if ev.type == until:
            return events


async def append(conn, audio: np.ndarray, chunk_ms: int) -> None:
    step = RATE * chunk_ms // 1000
    for i in range(0, len(audio), step):
        await conn.input_audio_buffer.append(audio=pcm16_base64(audio[i:i + step]))


def reply(events) -> tuple[str, np.ndarray]:
    """The last response's transcript and pcm16."""
    last = [e for e in events if e.type == "response.created"][-1].response.id
    mine = [e for e in events if getattr(e, "response_id", None) == last]
    text = "".join(e.delta for e in mine if e.type in ("response.output_audio_transcript.delta",
                                                       "response.audio_transcript.delta"))
    audio = decoded([{"delta": e.delta} for e in mine if e.type in ("response.output_audio.delta",
                                                                     "response.audio.delta")])
    return text, audio


def assert_reply(events, stack, tokenizer, omni_config, messages) -> None:
    text, audio = reply(events)
    ref_text, ref_pcm, _ = reference(stack, tokenizer, omni_config, messages, max_tokens=3, max_frames=FRAMES)
    assert text == ref_text
    assert audio.size > 0 and np.array_equal(audio, ref_pcm)


def pcm16(x: np.ndarray) -> np.ndarray:
    """The samples as the gateway decodes them from the wire (pcm16)."""
    return (np.clip(x, -1, 1) * 32767).round().astype("<i2").astype(np.float32) / 32768.0


@pytest.mark.parametrize("seconds,chunk_ms,pause", [
    (1.5, 20, 0.0),         # shorter than an encoder window
    (9.0, 250, 1.5),        # longer: its first window prefilled before the commit
    (9.0, 3000, 0.0),       # large appends, committed at once
])
def test_a_manual_turn_streamed_equals_the_whole(gateway, stack, tokenizer, omni_config, model, features,
                                                 seconds, chunk_ms, pause):
    clip = noise(seconds, seed=chunk_ms)
    before = streamed(gateway, "streamed"), metric(gateway, "voxpipe_gateway_realtime_prefilled_before_commit_sum")

    async def go():
        events = []
        async with sdk(gateway).realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "max_audio_frames": FRAMES})
            await collect(conn, "session.updated", events)
            await append(conn, clip, chunk_ms)
            await asyncio.sleep(pause)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response=REPLY)
            return await collect(conn, "response.done", events)

    events = asyncio.run(go())
    assert_reply(events, stack, tokenizer, omni_config, [ChatMessage("user", [ChatPart(features=features(pcm16(clip)))])])
    assert streamed(gateway, "streamed") == before[0] + 1
    share = metric(gateway, "voxpipe_gateway_realtime_prefilled_before_commit_sum") - before[1]
    assert share > (0.6 if pause else 0.0)        # one window of 104 tokens of the prompt's ~130
    done = events[-1].response
    assert done.status in ("completed", "incomplete")
    assert_stages_idle(stack)


def test_a_server_vad_turn_streamed_equals_the_whole_in_the_beta_dialect(gateway, stack, tokenizer, omni_config,
                                                                          model, features):
    words = speech("What is the weather like today?")
    audio = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), words, np.zeros(RATE, np.float32)])
    before = streamed(gateway, "streamed"), metric(gateway, "voxpipe_gateway_realtime_ttfp_seconds_count",
                                                   since="speech_stopped")

    async def go():
        events = []
        async with sdk(gateway).beta.realtime.connect(model=model) as conn:
            await conn.session.update(session={"turn_detection": {"type": "server_vad"}, "temperature": 0,
                                               "max_response_output_tokens": 3, "max_audio_frames": FRAMES})
            await collect(conn, "session.updated", events)
            await append(conn, audio, 40)
            return await collect(conn, "response.done", events)

    events = asyncio.run(go())
    started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    clip = pcm16(audio)[started.audio_start_ms * RATE // 1000:stopped.audio_end_ms * RATE // 1000]
    assert_reply(events, stack, tokenizer, omni_config, [ChatMessage("user", [ChatPart(features=features(clip))])])
    assert streamed(gateway, "streamed") == before[0] + 1
    assert metric(gateway, "voxpipe_gateway_realtime_ttfp_seconds_count", since="speech_stopped") == before[1] + 1
    assert_stages_idle(stack)


def test_a_streamed_third_turn_takes_the_cached_conversation_with_its_audio(gateway, stack, tokenizer, omni_config,
                                                                            model, features, tiny_model_dir):
    """Three voice turns streamed in one session: turn 3's streamed request takes the prefix cache
    past the earlier turns' clips (as the whole-clip path would: their talker rows from the
    AudioRowCache), and its reply is the whole prompt's -- the pipeline's sent whole, and
    transformers' (uncached) text."""
    from oracle import reference_thinker
    from voxpipe.services.runtime.affinity import placeholder_spans
    from voxpipe.services.runtime.flags import KV_BLOCK_SIZE
    from voxpipe.services.thinker.prompt import render

    clips = [noise(1.2, seed=30 + i) for i in range(3)]

    async def go():
        events, replies = [], []
        async with sdk(gateway).realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "max_audio_frames": FRAMES})
            await collect(conn, "session.updated", events)
            for clip in clips:
                await append(conn, clip, 200)
                await conn.input_audio_buffer.commit()
                await conn.response.create(response=REPLY)
                await collect(conn, "response.done", events)
                replies.append(reply(events))
            return events, replies

    events, replies = asyncio.run(go())
    messages = []
    for clip, (text, _) in zip(clips, replies):
        messages += [ChatMessage("user", [ChatPart(features=features(pcm16(clip)))]),
                     *([ChatMessage.text("assistant", text)] if text else [])]
    if replies[-1][0]:
        messages.pop()
    assert_reply(events, stack, tokenizer, omni_config, messages)
    prompt = render(tokenizer, omni_config.thinker, messages)
    ref = reference_thinker(tiny_model_dir, prompt.token_ids, prompt.audio_features, max_tokens=3)
    assert replies[-1][0] == tokenizer.decode(ref.text_ids)
    # the earlier clips' blocks are hits: up to the last full block of the second clip at least (the
    # blocks after it hold turn 2's tail, published only up to its reply's last full block)
    second = placeholder_spans(prompt.token_ids, omni_config.thinker.tokens.audio_token, [b""] * 3)[1]
    cached = events[-1].response.usage.input_token_details.cached_tokens
    assert cached >= second.end // KV_BLOCK_SIZE * KV_BLOCK_SIZE > second.start, (cached, second)
    assert_stages_idle(stack)


def wait_for(predicate, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_cleared_buffer_and_a_session_closed_mid_utterance_free_the_thinker(gateway, stack, tokenizer, omni_config,
                                                                              model, features):
    """The stream opens with the first append; `input_audio_buffer.clear` cancels it (the next audio
    is a new turn, answered as the whole clip is), and so does closing the session mid-utterance."""
    first, second = noise(2.0, seed=1), noise(1.2, seed=2)
    cancelled = streamed(gateway, "cancelled")

    async def go():
        events = []
        async with sdk(gateway).realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "max_audio_frames": FRAMES})
            await collect(conn, "session.updated", events)
            await append(conn, first, 100)
            await asyncio.to_thread(wait_for, lambda: active_streams(stack)["thinker"] == 1)   # the pending turn
            await conn.input_audio_buffer.clear()
            await collect(conn, "input_audio_buffer.cleared", events)
            await asyncio.to_thread(wait_for, lambda: active_streams(stack)["thinker"] == 0)
            await append(conn, second, 100)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response=REPLY)
            await collect(conn, "response.done", events)
        async with sdk(gateway).realtime.connect(model=model) as conn:     # closed mid-utterance
            await conn.session.update(session=MANUAL)
            await append(conn, first, 500)
            await asyncio.to_thread(wait_for, lambda: active_streams(stack)["thinker"] == 1)
        return events

    events = asyncio.run(go())
    assert_reply(events, stack, tokenizer, omni_config, [ChatMessage("user", [ChatPart(features=features(pcm16(second)))])])
    assert_stages_idle(stack)
    wait_for(lambda: streamed(gateway, "cancelled") == cancelled + 2)


def test_a_barge_in_cancels_the_reply_and_the_new_turn_is_streamed(gateway, stack, tokenizer, omni_config, model,
                                                                   features):
    words = speech("Wait, stop, I have a question.")
    audio = np.concatenate([words, np.zeros(RATE, np.float32)])
    before = streamed(gateway, "streamed")

    async def go():
        events = []
        async with sdk(gateway).realtime.connect(model=model) as conn:
            await conn.session.update(session={"type": "realtime", "temperature": 0, "max_audio_frames": FRAMES,
                                               "max_output_tokens": 3,
                                               "audio": {"input": {"turn_detection": {"type": "server_vad"}}}})
            await collect(conn, "session.updated", events)
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "Talk a while."}]})
            await conn.response.create(response={"max_output_tokens": 8, "ignore_eos": True, "max_audio_frames": 60})
            await collect(conn, "response.output_audio.delta", events)
            await append(conn, audio, 20)
            await collect(conn, "conversation.item.truncated", events)     # after the cancelled reply's done
            await collect(conn, "response.done", events)      # the reply to the interruption
            reply_id = next(e for e in events if e.type == "response.created").response.id
            first = next(e for e in events if e.type == "response.output_item.added" and e.response_id == reply_id)
            await conn.conversation.item.retrieve(item_id=first.item.id)
            await collect(conn, "conversation.item.retrieved", events)
            return events

    events = asyncio.run(go())
    done = [e.response for e in events if e.type == "response.done"]
    assert done[0].status == "cancelled" and done[0].status_details.reason == "turn_detected"
    kept = events[-1].item.content[0].transcript
    started = next(e for e in events if e.type == "input_audio_buffer.speech_started")
    stopped = next(e for e in events if e.type == "input_audio_buffer.speech_stopped")
    clip = pcm16(audio)[started.audio_start_ms * RATE // 1000:stopped.audio_end_ms * RATE // 1000]
    messages = [ChatMessage.text("user", "Talk a while."), *([ChatMessage.text("assistant", kept)] if kept else []),
                ChatMessage("user", [ChatPart(features=features(clip))])]
    assert_reply(events[:-1], stack, tokenizer, omni_config, messages)
    assert streamed(gateway, "streamed") == before + 1
    assert_stages_idle(stack)


def test_a_conversation_changed_mid_utterance_is_streamed_again_or_sent_whole(gateway, stack, tokenizer, omni_config,
                                                                             model, features):
    """An item created while the user speaks: the stream is opened again after it at the next append
    (streamed); one created after the last append: the turn is sent whole (redone). Both replies are
    the whole prompt's."""
    one, two = noise(1.6, seed=3), noise(1.4, seed=4)
    before = streamed(gateway, "streamed"), streamed(gateway, "redone")

    def text_item(text: str) -> dict:
        return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}

    async def go():
        events = []
        async with sdk(gateway).realtime.connect(model=model) as conn:
            await conn.session.update(session={**MANUAL, "max_audio_frames": FRAMES})
            await collect(conn, "session.updated", events)
            await append(conn, one[:RATE // 2], 100)
            await conn.conversation.item.create(item=text_item("Listen."))
            await collect(conn, "conversation.item.done", events)
            await append(conn, one[RATE // 2:], 100)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response=REPLY)
            await collect(conn, "response.done", events)
            first = reply(events)
            await append(conn, two, 200)
            await conn.conversation.item.create(item=text_item("And this?"))
            await collect(conn, "conversation.item.done", events)
            await conn.input_audio_buffer.commit()
            await conn.response.create(response=REPLY)
            await collect(conn, "response.done", events)
            return first, events

    first, events = asyncio.run(go())
    turn1 = [ChatMessage.text("user", "Listen."), ChatMessage("user", [ChatPart(features=features(pcm16(one)))])]
    ref_text, ref_pcm, _ = reference(stack, tokenizer, omni_config, turn1, max_tokens=3, max_frames=FRAMES)
    assert first[0] == ref_text and np.array_equal(first[1], ref_pcm)
    turn2 = turn1 + [*([ChatMessage.text("assistant", first[0])] if first[0] else []), ChatMessage.text("user", "And this?"),
                     ChatMessage("user", [ChatPart(features=features(pcm16(two)))])]
    assert_reply(events, stack, tokenizer, omni_config, turn2)
    assert (streamed(gateway, "streamed"), streamed(gateway, "redone")) == (before[0] + 1, before[1] + 1)
    assert_stages_idle(stack)


def thinker_kv_used(stack) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports['thinker']}/metrics", timeout=5).read()
    m = re.search(r'^voxpipe_kv_blocks\{stage="thinker",state="used"\} (\S+)$', body.decode(), re.M)
    return float(m.group(1))


def thinker_idle(stack) -> bool:
    return active_streams(stack)["thinker"] == 0 and thinker_kv_used(stack) == 0


async def committed_unanswered(gateway, stack, model, clip, then=None) -> list:
    """A manual turn streamed, committed, and left without response.create until the thinker is idle
    (after `then(conn)`, if given); then answered."""
    events = []
    async with sdk(gateway).realtime.connect(model=model) as conn:
        await conn.session.update(session={**MANUAL, "max_audio_frames": FRAMES})
        await collect(conn, "session.updated", events)
        await append(conn, clip, 200)
        await asyncio.to_thread(wait_for, lambda: active_streams(stack)["thinker"] == 1)     # the pending turn
        await conn.input_audio_buffer.commit()
        await collect(conn, "conversation.item.done", events)
        if then is not None:
            await then(conn, events)
        await asyncio.to_thread(wait_for, lambda: thinker_idle(stack), 5)
        await conn.response.create(response=REPLY)
        return await collect(conn, "response.done", events)


def test_a_committed_turn_whose_conversation_changed_releases_its_stream(gateway, stack, tokenizer, omni_config,
                                                                          model, features):
    """An item created after the commit: the streamed request is released at once (well before the
    hold, 10 s by default), and the response sends the turn whole with the item."""
    clip = noise(1.5, seed=40)
    before = streamed(gateway, "streamed"), streamed(gateway, "cancelled")

    async def then(conn, events):
        await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                  "content": [{"type": "input_text", "text": "Then this."}]})
        await collect(conn, "conversation.item.done", events)

    events = asyncio.run(committed_unanswered(gateway, stack, model, clip, then))
    assert_reply(events, stack, tokenizer, omni_config, [ChatMessage("user", [ChatPart(features=features(pcm16(clip)))]),
                                                         ChatMessage.text("user", "Then this.")])
    assert (streamed(gateway, "streamed"), streamed(gateway, "cancelled")) == (before[0], before[1] + 1)
    assert_stages_idle(stack)


@pytest.fixture(scope="module")
def held_gateway(stack, tiny_model_dir):
    from conftest import GatewayProcess

    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"),
                        "--realtime-turn-hold", "0.5")
    yield gw
    gw.stop()


def test_a_committed_turn_left_unanswered_is_released_after_its_hold(held_gateway, stack, tokenizer, omni_config,
                                                                     model, features):
    """--realtime-turn-hold 0.5: the thinker request, its KV blocks and streams are freed half a
    second after the commit; the response.create that comes later sends the turn whole, exactly."""
    clip = noise(2.0, seed=41)
    events = asyncio.run(committed_unanswered(held_gateway, stack, model, clip))
    assert_reply(events, stack, tokenizer, omni_config, [ChatMessage("user", [ChatPart(features=features(pcm16(clip)))])])
    assert streamed(held_gateway, "streamed") == 0 and streamed(held_gateway, "cancelled") == 1
    assert_stages_idle(stack)


def test_the_realtime_turn_hold_flag_refuses_bad_values(capsys):
    from voxpipe.cli import build_parser

    assert build_parser().parse_args(["gateway", "--realtime-turn-hold", "2.5"]).realtime_turn_hold == 2.5
    for bad in ("-1", "later", "nan", "x" * 10_000):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["gateway", "--realtime-turn-hold", bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--realtime-turn-hold: must be a number of seconds, at least 0" in err, err
        assert len(err) < 2000


def test_the_buffer_peeks_any_span_of_its_chunks_without_taking_it():
    from voxpipe.gateway.realtime.session import InputAudioBuffer

    buf, parts = InputAudioBuffer(), [noise(n / RATE, seed=n) for n in (5, 0, 7, 3, 11)]
    for p in parts:
        buf.append(p)
    whole = np.concatenate(parts)
    buf.take(end=4)
    for start in range(-2, 29):
        for end in range(-2, 29):
            lo, hi = min(max(start, 4), 26), min(max(end, 4), 26)
            assert np.array_equal(buf.peek(start, end), whole[lo:max(lo, hi)]), (start, end)
    assert buf.size == 22


def test_a_commit_whose_prompt_does_not_continue_the_turn_is_refused_and_frees_it(stack, tokenizer, omni_config,
                                                                                  tiny_model_dir, features):
    """PipelineClient.stream(req, turn=...) with a prompt that does not begin with the turn's
    conversation fails that request (nothing is generated) and the thinker frees the turn."""
    from voxpipe.client import PipelineClient, PipelineError, SpeechRequest
    from voxpipe.services.thinker.log_mel import LogMelStream
    from voxpipe.services.thinker.prompt import render
    from voxpipe.services.thinker.streamed import around_last_clip

    clip = features(noise(1.0, seed=9))
    prompt = render(tokenizer, omni_config.thinker, [ChatMessage("user", [ChatPart(features=clip)])])
    head, _ = around_last_clip(prompt.token_ids, omni_config.thinker.tokens.audio_token)
    other = render(tokenizer, omni_config.thinker, [ChatMessage.text("system", "Other."),
                                                    ChatMessage("user", [ChatPart(features=clip)])])
    mel = LogMelStream(FeatureExtractor.for_model(tiny_model_dir).fe.mel_filters)

    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav"),
                                  audio_token=omni_config.thinker.tokens.audio_token) as pc:
            turn = pc.open_turn(head, [])
            turn.hear(mel.push(noise(1.0, seed=9)[:16000]))
            await asyncio.to_thread(wait_for, lambda: active_streams(stack)["thinker"] == 1)
            req = SpeechRequest(token_ids=other.token_ids, audio_features=other.audio_features, audio=False,
                                max_tokens=2)
            with pytest.raises(PipelineError) as e:
                async for _ in pc.stream(req, turn=turn):
                    pass
            await turn.close()
            return e.value

    error = asyncio.run(go())
    assert error.stage == "thinker" and "does not continue the streamed turn's conversation" in error.details
    assert_stages_idle(stack)


def test_a_turn_the_thinker_refused_before_its_commit_is_sent_whole(stack, tokenizer, omni_config, features):
    """A turn whose call ended before its commit (here: its start refused) is not committed: the
    request goes whole and answers as it would have without the turn."""
    from voxpipe.client import PipelineClient, SpeechRequest
    from voxpipe.services.thinker.prompt import render

    prompt = render(tokenizer, omni_config.thinker, [ChatMessage("user", [ChatPart(features=features(noise(1.0, 8)))])])
    req = SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features, audio=False, max_tokens=2)

    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav"),
                                  audio_token=omni_config.thinker.tokens.audio_token) as pc:
            turn = pc.open_turn([omni_config.thinker.text.vocab_size + 5], [])     # refused: not a token id
            await asyncio.to_thread(wait_for, lambda: not turn.usable)
            plain = await pc.collect(req)
            got = [ev async for ev in pc.stream(req, turn=turn)]
            await turn.close()
            return plain, got

    plain, got = asyncio.run(go())
    assert [i for ev in got if hasattr(ev, "token_ids") for i in ev.token_ids] == plain.text_ids
    assert_stages_idle(stack)


def test_the_realtime_session_bench_times_each_turn_from_the_commit(gateway, capsys):
    """bench/realtime_session.py (the 40-turn voice goal's measurement) at small size."""
    from voxpipe.bench import realtime_session

    args = realtime_session.parse_args(["--gateway", gateway.base_url, "--turns", "2", "--pace", "0",
                                        "--text-tokens", "2", "--frames", "4", "--no-warmup"])
    summary = asyncio.run(realtime_session.main(args))
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["turn"] for r in rows] == [1, 2] and rows[1]["input_tokens"] > rows[0]["input_tokens"]
    assert all(r["error"] is None and r["ttfp_ms"] > 0 for r in rows)
    assert summary["streamed_turns"] == 2 and 0 < summary["prefilled_before_commit"] <= 1
    assert summary["without_audio"] == 0 and 0 < summary["ttfp_ms"]["p50"] <= summary["ttfp_ms"]["max"]
    assert summary["failed"] == 0 and [t["turn"] for t in summary["turns"]] == [1, 2]


def test_the_realtime_conversation_bench_starts_its_stack_and_times_every_turn(tiny_model_dir, tmp_path):
    """`voxpipe bench --workload realtime-conversation` (the 40-turn and 16-session goals' measurement,
    one command) at small size: the bench starts the services and the gateway, runs a warm-up session,
    then 1 and then 2 sessions of 3 spoken turns each (the clip appended faster than real time, each
    turn committed by hand); per turn the TTFP across sessions, the cached share and the share
    prefilled before the commit, as JSON under --out and as markdown."""
    from test_bench import _bench

    proc, res, md = _bench(tmp_path, tiny_model_dir, "--workload", "realtime-conversation", "--modes", "gateway",
                           "--no-reference", "--concurrency", "1,2", "--turns", "3", "--realtime-pace", "8",
                           "--text-tokens", "2", "--frames", "4")
    report = res["realtime_conversation"]
    assert report == json.loads((tmp_path / "bench" / "realtime_conversation.json").read_text())
    assert report["settings"]["turns"] == 3 and report["settings"]["pace"] == 8 and report["warmup_errors"] == []
    assert res["levels"] == [] and res["references"] == {}      # no single-request levels, --no-reference
    assert [lvl["sessions"] for lvl in report["levels"]] == [1, 2]
    for lvl in report["levels"]:
        c = lvl["sessions"]
        assert lvl["failed"] == 0 and lvl["without_audio"] == 0 and not lvl["errors"], lvl["errors"]
        assert [(t["turn"], t["n"]) for t in lvl["turns"]] == [(1, c), (2, c), (3, c)]
        tokens = [t["input_tokens"] for t in lvl["turns"]]
        assert tokens[0] < tokens[1] < tokens[2], tokens          # the conversation grows, a clip a turn
        assert lvl["turns"][2]["cached_fraction"] > lvl["turns"][0]["cached_fraction"] > 0     # the history hits
        assert 0 < lvl["ttfp_ms"]["p50"] <= lvl["ttfp_ms"]["p90"] <= lvl["ttfp_ms"]["max"]
        assert lvl["ttfp_ms"]["max"] == max(t["ttfp_max_ms"] for t in lvl["turns"])
        assert lvl["worst_turn_p90_ms"] == max(t["ttfp_p90_ms"] for t in lvl["turns"])
        # every turn streamed to the thinker as it was appended; a 5.7 s clip is under one encoder
        # window, so what was prefilled before the commit is the conversation before the clip
        assert lvl["streamed_turns"] == 3 * c and 0 < lvl["prefilled_before_commit"] < 1
        assert list(lvl["replicas"]) == ["thinker"] and lvl["replicas"]["thinker"]["streams"] == 3 * c
        assert lvl["server"]["thinker"]["prefilled_before_commit"] > 0
    assert "#### realtime-conversation: a 5.7 s voice clip a turn (rotated per session and turn), appended at 8x " \
           "real time, manual commit, 2 text tokens and 4 frames a reply, 3 turns a session" in md
    assert "2 sessions (0 failed, 0 without audio" in md and "| 3 |" in md
    assert "realtime-conversation: 2 sessions x 3 turns" in proc.stdout
