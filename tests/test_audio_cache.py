"""The audio encoder cache (services/thinker/audio_cache.py) and the gateway's clip cache
(gateway/clip_cache.py): a clip a conversation sends again is neither decoded, featurized nor
encoded again, and every output is the one without the caches -- and transformers' -- for a miss,
a hit, a partial hit and after eviction."""

from __future__ import annotations

import asyncio
import base64
import io
import re

import numpy as np
import pytest
import soundfile
import torch

from oracle import audio_features, reference_thinker
from voxpipe.cli import build_parser
from voxpipe.services.runtime import metrics
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.outputs import Finished, TalkerPromptOut, TextOut
from voxpipe.services.thinker import server as thinker_server
from voxpipe.services.thinker.job import ThinkerJob
from voxpipe.services.thinker.model import audio_output_length
from voxpipe.audio import resample
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, FeatureExtractor, render

MAX_TOKENS = 4
PROMPT_FIELDS = ("user_rows", "user_mm_mask", "user_token_ids", "assistant_head", "assistant_prefix", "tts_special")


def tone(seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000.0
    return (0.4 * np.sin(2 * np.pi * hz * t) * np.exp(-t)).astype(np.float32)


CLIP_A, CLIP_B = audio_features(tone(1.3, 440)), audio_features(tone(0.9, 330))


TURNS = ("miss", "hit", "partial", "short")


def conversation(turn: str) -> list[ChatMessage]:
    """miss: clip A alone; hit: A in the history, a text question now; partial: A in the history,
    clip B now; short: clip B (under one 2 * n_window chunk) alone, so its chunk is padded to its own
    length, not to A's chunk as in `partial`: another encoder input."""
    if turn == "short":
        return [ChatMessage("user", [ChatPart(features=CLIP_B), ChatPart(text="What is this sound?")])]
    first = ChatMessage("user", [ChatPart(features=CLIP_A), ChatPart(text="What is this sound?")])
    if turn == "miss":
        return [first]
    later = [ChatPart(text="Again?")] if turn == "hit" else [ChatPart(features=CLIP_B), ChatPart(text="And this?")]
    return [first, ChatMessage.text("assistant", "It is a tone."), ChatMessage("user", later)]


def cache_sample(name: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, {"stage": "thinker"}) or 0.0


def counters() -> dict[str, float]:
    return {k: cache_sample(f"voxpipe_audio_cache_{k}") for k in ("hits_total", "misses_total", "evictions_total")}


def thinker_engine(model_dir, *flags: str):
    """A CPU thinker. Its AudioRowCache (talker rows of cached audio blocks, tests/test_prefix_cache.py)
    is off, so that each turn prefills from the same position as the uncached engine's and what is
    compared here is the audio encoder cache alone, bit for bit."""
    from voxpipe.services.thinker.runner import AudioRowCache

    ns = build_parser().parse_args(["thinker", "--model", str(model_dir), "--device", "cpu", "--port", "0", "--max-batch", "4",
                                    *flags])
    engine = thinker_server.build(ns)[0].engine
    engine.runner.audio_rows = AudioRowCache(0)
    return engine


def run_turn(engine, turn: str) -> tuple[list[int], TalkerPromptOut, torch.Tensor]:
    """The thinker's outputs for one turn: generated ids, the talker prompt, the generated tokens' talker rows."""
    rendered = render(engine.tokenizer, engine.cfg, conversation(turn))

    async def go():
        job = ThinkerJob(request_id=turn, outbox=Outbox(asyncio.get_running_loop()), prompt=rendered.token_ids,
                         audio=[f.clone() for f in rendered.audio_features], max_tokens=MAX_TOKENS, talker_rows=True)
        engine.submit(job)
        while engine.has_work():
            engine.step()
        await asyncio.sleep(0)
        items = []
        while (got := job.outbox.poll_timed()) is not None:
            items.append(got[0])
        return items

    items = asyncio.run(go())
    assert isinstance(items[0], TalkerPromptOut) and isinstance(items[-1], Finished), items
    texts = [i for i in items if isinstance(i, TextOut)]
    return [t for o in texts for t in o.token_ids], items[0], torch.cat([o.rows for o in texts])


def assert_same(got, want) -> None:
    assert got[0] == want[0]
    for name in PROMPT_FIELDS:
        assert torch.equal(getattr(got[1], name), getattr(want[1], name)), name
    assert torch.equal(got[2], want[2])


def encoded_bytes(engine, clip: torch.Tensor) -> int:
    rows = audio_output_length(clip.shape[1], engine.cfg.audio.n_window)
    return rows * engine.cfg.text.hidden_size * engine.runner.audio.dtype.itemsize


@pytest.fixture(scope="module")
def uncached(tiny_model_dir):
    """Every turn's outputs from a thinker without the cache (--audio-cache-mb 0)."""
    engine = thinker_engine(tiny_model_dir, "--audio-cache-mb", "0")
    before = counters()
    outs = {turn: run_turn(engine, turn) for turn in TURNS}
    assert counters() == before and engine.runner.audio.lru.bytes == 0 and not engine.runner.audio.lru.entries
    return outs


@pytest.mark.parametrize("turn", TURNS)
def test_uncached_thinker_equals_transformers(tiny_model_dir, uncached, tokenizer, omni_config, turn):
    """The reference the cached runs are held to is transformers' thinker: its greedy ids, and the
    talker's user rows (embeddings; each clip's placeholders: the accept_hidden_layer states)."""
    rendered = render(tokenizer, omni_config.thinker, conversation(turn))
    ref = reference_thinker(tiny_model_dir, rendered.token_ids, rendered.audio_features, max_tokens=MAX_TOKENS)
    ids, prompt, _ = uncached[turn]
    assert ids == ref.text_ids
    tok, p = omni_config.thinker.tokens, rendered.token_ids
    user, latest = [], 0
    for i, t in enumerate(p):      # a position's role: the token after the latest <|im_start|> (itself included)
        latest = i if t == tok.im_start else latest
        user.append(p[min(latest + 1, len(p) - 1)] == tok.user)
    user = torch.tensor(user)
    audio = torch.tensor(p) == tok.audio_token
    want = torch.where(audio[:, None], ref.hidden, ref.embeds)[user]
    assert int(audio.sum()) > 0 and torch.equal(prompt.user_mm_mask, audio[user])
    assert torch.allclose(prompt.user_rows, want, atol=1e-5, rtol=1e-4), float((prompt.user_rows - want).abs().max())


@pytest.mark.parametrize("prefill", ["whole", "chunked"])
def test_cached_thinker_equals_uncached_for_miss_hit_partial_hit(tiny_model_dir, uncached, prefill):
    """Turn 1 encodes clip A (miss); turn 2 re-sends it (hit); turn 3 re-sends it with a new clip B
    (partial hit); clip B alone is another input (a miss). Each turn's ids, talker prompt and rows equal the uncached thinker's bit for bit;
    the counters and the bytes held say what happened. Chunked: the prompt's embeddings are made
    for its first chunk (--prefill-chunk 7), through the same cache."""
    flags = ["--prefill-chunk", "7"] if prefill == "chunked" else []
    engine = thinker_engine(tiny_model_dir, *flags)
    want = uncached if prefill == "whole" else {
        t: run_turn(thinker_engine(tiny_model_dir, "--audio-cache-mb", "0", *flags), t) for t in uncached}
    expect = [("miss", 0, 1), ("hit", 1, 0), ("partial", 1, 1), ("partial", 2, 0), ("short", 0, 1)]
    for turn, hits, misses in expect:
        before, gauge, held = counters(), cache_sample("voxpipe_audio_cache_bytes"), engine.runner.audio.lru.bytes
        assert_same(run_turn(engine, turn), want[turn])
        after = counters()
        assert (after["hits_total"] - before["hits_total"], after["misses_total"] - before["misses_total"]) == \
            (hits, misses), turn
        assert after["evictions_total"] == before["evictions_total"]
        assert cache_sample("voxpipe_audio_cache_bytes") - gauge == engine.runner.audio.lru.bytes - held
    sizes = encoded_bytes(engine, CLIP_A) + 2 * encoded_bytes(engine, CLIP_B)
    assert engine.runner.audio.lru.bytes == sizes and len(engine.runner.audio.lru.entries) == 3


def test_after_eviction_outputs_are_unchanged(tiny_model_dir, uncached):
    """A cache with room for one clip but not both: the partial-hit turn evicts A for B, the next
    turn with A evicts B; every output still equals the uncached thinker's."""
    probe = thinker_engine(tiny_model_dir, "--audio-cache-mb", "0")
    a, b = encoded_bytes(probe, CLIP_A), encoded_bytes(probe, CLIP_B)
    room = max(a, b) + min(a, b) // 2
    engine = thinker_engine(tiny_model_dir, "--audio-cache-mb", repr(room / 2**20))
    cache = engine.runner.audio
    assert cache.lru.max_bytes in range(room - 1, room + 1)
    start = counters()
    for turn in ("miss", "partial", "hit", "hit"):
        assert_same(run_turn(engine, turn), uncached[turn])
        assert cache.lru.bytes <= cache.lru.max_bytes
    got = {k: v - start[k] for k, v in counters().items()}
    # miss: A in; partial: A hit, B miss evicts A; hit: A miss evicts B; hit: A hit
    assert got == {"hits_total": 2, "misses_total": 3, "evictions_total": 2}
    assert cache.lru.bytes == a and len(cache.lru.entries) == 1


# ----------------------------------------------------------------------------- the gateway's clip cache

def gateway_sample(gateway, name: str) -> float:
    import httpx

    text = httpx.get(f"{gateway.base_url}/metrics").text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def stack_sample(stack, name: str) -> float:
    import httpx

    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['thinker']}/metrics").text
    m = re.search(rf'^{name}{{stage="thinker"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def cache_counts(gateway, stack) -> dict[str, float]:
    """The gateway's clip cache and the thinker's encoder cache counters."""
    out = {f"gateway_{k}": gateway_sample(gateway, f"voxpipe_gateway_audio_cache_{k}_total") for k in ("hits", "misses")}
    out.update({f"thinker_{k}": stack_sample(stack, f"voxpipe_audio_cache_{k}_total") for k in ("hits", "misses")})
    return out


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in before}


def wav_base64(seconds: float, hz: float, rate: int = 22050) -> str:
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    soundfile.write(buf, (0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32), rate, format="WAV", subtype="PCM_16")
    return base64.b64encode(buf.getvalue()).decode()


def chat_reference(stack, tokenizer, omni_config, model_dir, messages: list[dict]) -> str:
    """The pipeline's greedy 4-token reply to chat `messages` whose clips are decoded and featurized
    here (soundfile, resampled to 16 kHz), without the gateway."""
    from test_gateway_http import pipeline_result

    features = FeatureExtractor.for_model(model_dir)
    conv = []
    for m in messages:
        if isinstance(m["content"], str):
            conv.append(ChatMessage.text(m["role"], m["content"]))
            continue
        parts = []
        for p in m["content"]:
            if p["type"] == "text":
                parts.append(ChatPart(text=p["text"]))
            else:
                samples, rate = soundfile.read(io.BytesIO(base64.b64decode(p["input_audio"]["data"])), dtype="float32")
                parts.append(ChatPart(features=features(resample(samples, rate, 16000))))
        conv.append(ChatMessage(m["role"], parts))
    text, _ = pipeline_result(stack, render(tokenizer, omni_config.thinker, conv), audio=False, max_tokens=4)
    return text


def test_chat_clip_is_decoded_once_and_encoded_once(client, model, gateway, stack, tokenizer, omni_config,
                                                     tiny_model_dir):
    """A conversation that re-sends its clip: the gateway decodes and featurizes it once (its clip
    cache's counters), the thinker encodes it once (its encoder cache's), and every reply is the
    pipeline's for the prompt made from the clip decoded here."""
    data = wav_base64(0.8, 523.0)
    clip = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    first = [{"role": "user", "content": [clip, {"type": "text", "text": "What is this sound?"}]}]

    def ask(messages):
        before = cache_counts(gateway, stack)
        resp = client.chat.completions.create(model=model, max_tokens=4, temperature=0, messages=messages)
        return resp.choices[0].message.content, delta(before, cache_counts(gateway, stack))

    reply, counted = ask(first)
    assert counted == {"gateway_hits": 0, "gateway_misses": 1, "thinker_hits": 0, "thinker_misses": 1}
    assert reply == chat_reference(stack, tokenizer, omni_config, tiny_model_dir, first)
    again, counted = ask(first)
    assert counted == {"gateway_hits": 1, "gateway_misses": 0, "thinker_hits": 1, "thinker_misses": 0}
    assert again == reply
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}]
    later, counted = ask(second)
    assert counted == {"gateway_hits": 1, "gateway_misses": 0, "thinker_hits": 1, "thinker_misses": 0}
    assert later == chat_reference(stack, tokenizer, omni_config, tiny_model_dir, second)
    assert gateway_sample(gateway, "voxpipe_gateway_audio_cache_bytes") > 0


def test_a_corrupt_clip_is_never_cached_and_fails_the_same_each_time(gateway, model):
    """A clip that does not decode is tried again each time (a miss, nothing stored) and gets the same 400."""
    import httpx

    bad = base64.b64encode(b"RIFF\x10\x00\x00\x00WAVEfmt not really a wav file").decode()
    part = {"type": "input_audio", "input_audio": {"data": bad, "format": "wav"}}
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": [part]}]}
    held = gateway_sample(gateway, "voxpipe_gateway_audio_cache_bytes")
    errors = []
    for _ in range(2):
        before = gateway_sample(gateway, "voxpipe_gateway_audio_cache_misses_total")
        hits = gateway_sample(gateway, "voxpipe_gateway_audio_cache_hits_total")
        resp = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 400, resp.text
        errors.append(resp.json()["error"])
        assert gateway_sample(gateway, "voxpipe_gateway_audio_cache_misses_total") == before + 1
        assert gateway_sample(gateway, "voxpipe_gateway_audio_cache_hits_total") == hits
    assert errors[0] == errors[1]
    assert errors[0]["param"] == "messages[0].content[0].input_audio.data" and "could not decode" in errors[0]["message"]
    assert gateway_sample(gateway, "voxpipe_gateway_audio_cache_bytes") == held


def test_realtime_turns_hit_the_thinker_cache(gateway, stack):
    """Realtime keeps each item's features; every later turn sends the same bytes, so the thinker
    encodes the item's clip once."""
    from test_realtime import MANUAL, of, pcm16_base64, realtime

    t = np.arange(int(0.7 * 24000)) / 24000.0
    audio = (0.3 * np.sin(2 * np.pi * 611 * t)).astype(np.float32)

    async def go():
        counts = []
        async with realtime(gateway) as rt:
            await rt.update(**MANUAL, max_audio_frames=4)
            await rt.send("conversation.item.create", item={
                "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": pcm16_base64(audio)}]})
            await rt.until("conversation.item.done")
            for _ in range(2):
                before = cache_counts(gateway, stack)
                await rt.send("response.create", response={"max_output_tokens": 2})
                done = of(await rt.until("response.done", timeout=120), "response.done")[0]
                assert done["response"]["status"] in ("completed", "incomplete"), done   # incomplete: max_output_tokens
                counts.append(delta(before, cache_counts(gateway, stack)))
        return counts

    first, second = asyncio.run(go())
    assert (first["thinker_hits"], first["thinker_misses"]) == (0, 1)
    assert (second["thinker_hits"], second["thinker_misses"]) == (1, 0)
