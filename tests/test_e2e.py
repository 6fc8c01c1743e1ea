"""End to end through three real service processes: greedy text ids, codec codes and waveform
equal transformers' `generate(..., return_audio=True)` on the same tiny checkpoint."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from oracle import audio_features, reference_generate
from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.services.thinker.prompt import ChatMessage, ChatPart, render
from voxpipe.v1 import stages_pb2 as pb


def client_for(stack) -> PipelineClient:
    return PipelineClient(stack.address("thinker"), stack.address("code2wav"))


def run(coro):
    return asyncio.run(coro)


async def _collect(stack, req: SpeechRequest):
    async with client_for(stack) as client:
        return await client.collect(req)


def assert_matches(result, ref) -> None:
    assert result.text_ids == ref.text_ids
    assert torch.equal(result.codes, ref.codes), (result.codes.shape, ref.codes.shape)
    assert result.audio.shape[0] == ref.wav.shape[0] == 1920 * ref.codes.shape[0] - 555
    err = float(np.abs(result.audio - ref.wav.numpy()).max())
    assert err < 1e-4, err


def text_prompt(tokenizer, omni_config, text: str) -> list[int]:
    return render(tokenizer, omni_config.thinker, [ChatMessage.text("user", text)]).token_ids


@pytest.mark.parametrize("text,max_tokens,max_frames,min_frames", [
    ("Hello there, how are you?", 8, 14, 6),
    ("Tell me a story.", 5, 20, 0),
])
def test_text_prompt_equals_reference(stack, tiny_model_dir, tokenizer, omni_config, text, max_tokens, max_frames,
                                      min_frames):
    ids = text_prompt(tokenizer, omni_config, text)
    ref = reference_generate(tiny_model_dir, ids, max_tokens=max_tokens, max_frames=max_frames, min_frames=min_frames)
    # the codes as code2wav received them from the talker (a debug echo on the audio stream)
    res = run(_collect(stack, SpeechRequest(token_ids=ids, max_tokens=max_tokens, max_frames=max_frames,
                                            min_frames=min_frames, encoding=pb.AUDIO_FLOAT32, echo_frames=True)))
    assert_matches(res, ref)
    assert res.done.frames == ref.codes.shape[0]


def test_audio_prompt_equals_reference(stack, tiny_model_dir, tokenizer, omni_config):
    t = np.arange(int(1.3 * 16000)) / 16000.0
    wav = (0.4 * np.sin(2 * np.pi * 440 * t) * np.exp(-t)).astype(np.float32)
    feats = audio_features(wav)
    prompt = render(tokenizer, omni_config.thinker,
                    [ChatMessage("user", [ChatPart(features=feats), ChatPart(text="What is this sound?")])])
    ref = reference_generate(tiny_model_dir, prompt.token_ids, input_features=feats, max_tokens=6, max_frames=12,
                             min_frames=4)
    res = run(_collect(stack, SpeechRequest(token_ids=prompt.token_ids, audio_features=prompt.audio_features,
                                            max_tokens=6, max_frames=12, min_frames=4, encoding=pb.AUDIO_FLOAT32,
                                            echo_frames=True)))
    assert_matches(res, ref)


def test_four_concurrent_requests_each_equal_their_reference(stack, tiny_model_dir, tokenizer, omni_config):
    cases = [("One.", 4, 10, 3, "ethan"), ("Two, please!", 7, 12, 0, "chelsie"),
             ("Three is a longer prompt than the others.", 5, 16, 8, "aiden"), ("Four?", 9, 9, 2, "ethan")]
    prompts = [text_prompt(tokenizer, omni_config, c[0]) for c in cases]
    refs = [reference_generate(tiny_model_dir, p, speaker=c[4], max_tokens=c[1], max_frames=c[2], min_frames=c[3])
            for p, c in zip(prompts, cases)]

    async def all_at_once():
        async with client_for(stack) as client:
            reqs = [SpeechRequest(token_ids=p, speaker=c[4], max_tokens=c[1], max_frames=c[2], min_frames=c[3],
                                  encoding=pb.AUDIO_FLOAT32, echo_frames=True) for p, c in zip(prompts, cases)]
            return await asyncio.gather(*(client.collect(r) for r in reqs))

    results = run(all_at_once())
    for res, ref in zip(results, refs):
        assert_matches(res, ref)


def test_ignore_eos_forces_lengths_and_pcm16(stack, tokenizer, omni_config):
    ids = text_prompt(tokenizer, omni_config, "Say something long.")
    res = run(_collect(stack, SpeechRequest(token_ids=ids, max_tokens=6, min_tokens=6, max_frames=9, min_frames=9)))
    assert len(res.text_ids) == 6
    assert res.done.frames == 8
    assert res.audio.shape[0] == 1920 * 8 - 555
    assert np.abs(res.audio).max() > 0.01


def test_text_only_request(stack, tokenizer, omni_config):
    ids = text_prompt(tokenizer, omni_config, "Just text.")
    res = run(_collect(stack, SpeechRequest(token_ids=ids, audio=False, max_tokens=5, min_tokens=5)))
    assert len(res.text_ids) == 5 and res.audio.size == 0
    assert res.done.text_finish == pb.LENGTH


def next_stage_streams(stack, stage: str, to: str) -> float:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{stack.metrics_ports[stage]}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(f'voxpipe_next_stage_streams_total{{stage="{to}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_rows_and_frames_never_reach_the_caller(stack, tokenizer, omni_config):
    """Stage to stage: the thinker streams rows to the talker and the talker frames to code2wav
    themselves; the caller's process gets text from the thinker and audio from code2wav only."""
    ids = text_prompt(tokenizer, omni_config, "Where do the frames go?")
    before = (next_stage_streams(stack, "thinker", "talker"), next_stage_streams(stack, "talker", "code2wav"))

    async def one():
        async with client_for(stack) as client:
            res = await client.collect(SpeechRequest(token_ids=ids, max_tokens=6, min_tokens=6, max_frames=9,
                                                     min_frames=9))
            return res, dict(client.received)

    res, received = run(one())
    assert res.audio.shape[0] == 1920 * 8 - 555 and len(res.text_ids) == 6
    assert res.done.routes == {"thinker": stack.address("thinker"), "talker": stack.address("talker"),
                               "code2wav": stack.address("code2wav")}
    kinds = {kind for _, kind in received}
    assert not kinds & {"talker_prompt", "rows", "frames", "chunk"}, received
    assert received["code2wav", "audio"] >= 1 and received["thinker", "text"] >= 1
    assert received[("thinker", "routed")] == 2 and received[("thinker", "talker_finished")] == 1
    # the two stage-to-stage streams existed
    assert next_stage_streams(stack, "thinker", "talker") == before[0] + 1
    assert next_stage_streams(stack, "talker", "code2wav") == before[1] + 1


def test_say_lets_the_thinker_render_the_text_without_a_local_checkpoint(stack, tiny_model_dir, tmp_path):
    """`voxpipe say TEXT` sends text: the thinker renders it with its own checkpoint's template, so the
    command needs no --model (with an empty VOXPIPE_HOME it must not even make the default one)."""
    import os
    import subprocess
    import sys

    from voxpipe.audio import read_wav

    home, out = tmp_path / "home", tmp_path / "reply.wav"
    env = {**os.environ, "VOXPIPE_HOME": str(home)}
    cmd = [sys.executable, "-m", "voxpipe.cli", "say", "Hello from the command line.", "-o", str(out),
           "--thinker", stack.address("thinker"), "--code2wav", stack.address("code2wav"),
           "--max-tokens", "5", "--max-frames", "7", "--ignore-eos"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wav, rate = read_wav(out.read_bytes())
    assert rate == 24000 and wav.shape[0] == 1920 * 6 - 555
    assert not (home / "tiny-seed0").exists()
    # the same request through the client gives the same text
    ref = run(_collect(stack, SpeechRequest(text="Hello from the command line.", max_tokens=5, min_tokens=5,
                                            max_frames=7, min_frames=7)))
    assert f"text: {ref.text!r}" in proc.stdout

    bad = tmp_path / "not.wav"
    bad.write_bytes(b"RIFF but not a wave file")
    # --audio renders the turn here, with --model's config (given: without it the command would first make
    # the default tiny checkpoint in the empty VOXPIPE_HOME, a few seconds before the same refusal)
    proc = subprocess.run(cmd[:-7] + ["--audio", str(bad), "--max-tokens", "2", "--model", str(tiny_model_dir)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and f"error: --audio {bad}: not a RIFF/WAVE file" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_reply_of_zero_frames_ends_at_once(stack, tokenizer, omni_config):
    """max_frames 1: the talker's only step has no residual codes, so it speaks 0 frames. The talker
    ends before code2wav's listen token reached the caller; the reply still completes (no frame, no
    audio) instead of waiting for code2wav's listen timeout (regression: the RELIABILITY.md hang)."""
    # before the fix this raised PipelineError(code2wav, DEADLINE_EXCEEDED, "no listener attached")
    ids = text_prompt(tokenizer, omni_config, "Zero frames, please.")
    res = run(_collect(stack, SpeechRequest(token_ids=ids, max_tokens=3, max_frames=1)))
    assert res.done.frames == 0 and res.audio.size == 0 and res.done.audio_finish in (pb.LENGTH, pb.STOP)
    assert len(res.text_ids) >= 1
