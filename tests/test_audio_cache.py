"""The audio encoder cache (services/thinker/audio_cache.py) and the gateway's clip cache
(gateway/clip_cache.py): a clip a conversation sends again is neither decoded, featurized nor
encoded again, and every output is the one without the caches -- and transformers' -- for a miss,
a hit, a partial hit and after eviction."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from oracle import audio_features, reference_thinker
from voxpipe.cli import build_parser
from voxpipe.services.runtime import metrics
from voxpipe.services.runtime.engine import Outbox
from voxpipe.services.runtime.outputs import Finished, TalkerPromptOut, TextOut
from voxpipe.services.thinker import server as thinker_server
from voxpipe.services.thinker.job import ThinkerJob
from voxpipe.services.thinker.model import audio_output_length
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render

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
    ns = build_parser().parse_args(["thinker", "--model", str(model_dir), "--device", "cpu", "--max-batch", "4",
                                    *flags])
    return thinker_server.build(ns)[0].engine


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
    assert counters() == before and engine.runner.audio.bytes == 0 and not engine.runner.audio.entries
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
        before, gauge, held = counters(), cache_sample("voxpipe_audio_cache_bytes"), engine.runner.audio.bytes
        assert_same(run_turn(engine, turn), want[turn])
        after = counters()
        assert (after["hits_total"] - before["hits_total"], after["misses_total"] - before["misses_total"]) == \
            (hits, misses), turn
        assert after["evictions_total"] == before["evictions_total"]
        assert cache_sample("voxpipe_audio_cache_bytes") - gauge == engine.runner.audio.bytes - held
    sizes = encoded_bytes(engine, CLIP_A) + 2 * encoded_bytes(engine, CLIP_B)
    assert engine.runner.audio.bytes == sizes and len(engine.runner.audio.entries) == 3


def test_after_eviction_outputs_are_unchanged(tiny_model_dir, uncached):
    """A cache with room for one clip but not both: the partial-hit turn evicts A for B, the next
    turn with A evicts B; every output still equals the uncached thinker's."""
    probe = thinker_engine(tiny_model_dir, "--audio-cache-mb", "0")
    a, b = encoded_bytes(probe, CLIP_A), encoded_bytes(probe, CLIP_B)
    room = max(a, b) + min(a, b) // 2
    engine = thinker_engine(tiny_model_dir, "--audio-cache-mb", repr(room / 2**20))
    cache = engine.runner.audio
    assert cache.max_bytes in range(room - 1, room + 1)
    start = counters()
    for turn in ("miss", "partial", "hit", "hit"):
        assert_same(run_turn(engine, turn), uncached[turn])
        assert cache.bytes <= cache.max_bytes
    got = {k: v - start[k] for k, v in counters().items()}
    # miss: A in; partial: A hit, B miss evicts A; hit: A miss evicts B; hit: A hit
    assert got == {"hits_total": 2, "misses_total": 3, "evictions_total": 2}
    assert cache.bytes == a and len(cache.entries) == 1
