"""Chat completions beyond the basics, with the unmodified `openai` SDKs (Python here, Node in
tests/node_chat) against real gateway and stage processes: stop strings that end the text and the
speech (matched in the thinker before a token's row leaves for the talker), logprobs equal to the
log-softmax of transformers' logits, the text-derived audio cap, and every OpenAI parameter either
served, accepted as a no-op or refused with a 400 naming it."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import subprocess
from pathlib import Path

import grpc
import httpx
import numpy as np
import openai
import pytest
import soundfile
import torch

from oracle import load_reference_model
from conftest import install_node_package
from voxpipe.client import PipelineClient, SpeechRequest
from voxpipe.services.thinker.output import IncrementalDetokenizer, ReplyText, StreamText
from voxpipe.services.thinker.prompt import ChatMessage, render
from voxpipe.v1 import stages_pb2 as pb
from voxpipe.v1 import stages_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Hello there, how are you?"   # the seed-0 tiny model answers it with usable token boundaries
MESSAGES = [{"role": "user", "content": PROMPT}]
N = 16                      # text tokens of the reference run
FRAMES = 40                 # max_audio_frames of the spoken runs (39 frames at most)




def prompt_ids(tokenizer, omni_config, text: str = PROMPT) -> list[int]:
    return render(tokenizer, omni_config.thinker, [ChatMessage.text("user", text)]).token_ids


def collect(stack, req: SpeechRequest):
    async def go():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            return await pc.collect(req)
    return asyncio.run(go())


@pytest.fixture(scope="module")
def reference(stack, tokenizer, omni_config):
    """The greedy reply without stop: its token ids and each token's text as the thinker streams it."""
    res = collect(stack, SpeechRequest(token_ids=prompt_ids(tokenizer, omni_config), audio=False, max_tokens=N))
    detok = IncrementalDetokenizer(tokenizer)
    texts = [detok.push(t, k == len(res.text_ids) - 1) for k, t in enumerate(res.text_ids)]
    assert "".join(texts) == res.text == tokenizer.decode(res.text_ids, skip_special_tokens=True)
    return res.text_ids, texts


def boundary_stop(texts: list[str]) -> tuple[str, int, int]:
    """A 2-character stop string across the boundary of tokens m and m + 1 (the last character of
    token m, which has more, and the first of token m + 1), at its first occurrence in the text:
    (stop, m, where it starts). Tokens 0..m-1 lie wholly before it; token m reaches into it."""
    full = "".join(texts)
    for m in range(1, len(texts) - 1):
        a, b = texts[m], texts[m + 1]
        if len(a) < 2 or not b or not texts[m - 1]:
            continue
        stop = a[-1] + b[0]
        at = len("".join(texts[:m + 1])) - 1
        if "\ufffd" not in stop and full.find(stop) == at:
            return stop, m, at
    raise AssertionError(f"no usable token boundary in {texts}")


# ----------------------------------------------------------------------------- stop

def test_stop_text_is_the_reply_up_to_the_stop_string(client, model, reference):
    """Greedy: the text with `stop` equals the text without it, cut before the stop string's first
    occurrence (which spans a token boundary); finish_reason "stop"; whole and streamed; a string
    and a list."""
    ids, texts = reference
    full = "".join(texts)
    stop, _, at = boundary_stop(texts)
    for value in (stop, [stop, "never-in-this-text-\x01"]):
        resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0, stop=value)
        assert resp.choices[0].message.content == full[:at]
        assert resp.choices[0].finish_reason == "stop"
        assert resp.usage.completion_tokens_details.text_tokens <= N
        stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0,
                                                stop=value, stream=True)
        text, finish = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert (text, finish) == (full[:at], "stop")
    # a stop string the reply never reaches changes nothing
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=N, temperature=0,
                                          stop=["never-in-this-text-\x01"])
    assert resp.choices[0].message.content == full and resp.choices[0].finish_reason == "length"


def wav_samples(data_b64: str) -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(data_b64)), dtype="int16")
    assert rate == 24000
    return samples


def test_stop_ends_the_speech_with_the_text(client, model, reference):
    """The voice says only what the text keeps: the talker got the rows of the tokens wholly before
    the stop string (and the next one as its last, unspoken row), exactly as in a run that ends
    by length one token later -- so the audio equals that run's, whole (wav) and streamed (pcm16)."""
    _, texts = reference
    full = "".join(texts)
    stop, m, at = boundary_stop(texts)
    spoken = dict(model=model, messages=MESSAGES, temperature=0, modalities=["text", "audio"],
                  extra_body={"max_audio_frames": FRAMES})
    ref = client.chat.completions.create(max_tokens=m + 1, audio={"voice": "ethan", "format": "wav"}, **spoken)
    assert ref.choices[0].message.audio.transcript == full[:len("".join(texts[:m + 1]))]
    ref_audio = wav_samples(ref.choices[0].message.audio.data)
    assert ref_audio.size > 0

    resp = client.chat.completions.create(max_tokens=N, stop=stop, audio={"voice": "ethan", "format": "wav"}, **spoken)
    audio = resp.choices[0].message.audio
    assert audio.transcript == full[:at]
    got = wav_samples(audio.data)
    assert got.shape == ref_audio.shape and np.abs(got.astype(int) - ref_audio).max() <= 1
    assert resp.usage.completion_tokens_details.audio_tokens == ref.usage.completion_tokens_details.audio_tokens

    stream = client.chat.completions.create(max_tokens=N, stop=[stop], audio={"voice": "ethan", "format": "pcm16"},
                                            stream=True, logprobs=True, stream_options={"include_usage": True},
                                            **spoken)
    pcm, transcript, entries, usage = bytearray(), "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.logprobs is not None:
                entries += choice.logprobs.content
            if choice.delta.audio is not None:
                pcm += base64.b64decode(choice.delta.audio.data or "")
                transcript += choice.delta.audio.transcript or ""
    assert transcript == full[:at]
    streamed = np.frombuffer(bytes(pcm), dtype="<i2")
    assert streamed.shape == ref_audio.shape and np.abs(streamed.astype(int) - ref_audio).max() <= 1
    assert len(entries) == usage.completion_tokens_details.text_tokens    # the stop string's tokens included


def test_thinker_rows_stop_before_the_stop_string(stack, tokenizer, omni_config, reference):
    """Over the stage API (talker_rows: the rows come back on the stream): rows for the tokens wholly
    before the stop string plus one (the talker's unspoken last row), none after; every generated
    token still reported, the text cut exactly."""
    ids, texts = reference
    stop, m, at = boundary_stop(texts)
    start = pb.ThinkerStart(token_ids=pb.TokenIds(ids=prompt_ids(tokenizer, omni_config)), max_tokens=N,
                            talker_rows=True, stop=[stop])
    with grpc.insecure_channel(stack.address("thinker")) as ch:
        responses = list(pb_grpc.ThinkerStub(ch).Generate(iter([pb.ThinkerRequest(start=start)]), timeout=60))
    deltas = [r.text for r in responses if r.WhichOneof("kind") == "text"]
    rows = sum(d.embeddings.shape[0] if d.HasField("embeddings") else 0 for d in deltas)
    token_ids = [t for d in deltas for t in d.token_ids]
    assert rows == m + 1
    assert not any(d.more for d in deltas)      # with stop strings the reply's end is known only later
    assert token_ids == ids[:m + 2]
    assert "".join(d.text for d in deltas) == "".join(texts)[:at]
    assert responses[-1].finished.reason == pb.STOP and responses[-1].finished.completion_tokens == m + 2


def test_thinker_rows_say_the_reply_goes_on_after_every_token_but_the_last(stack, tokenizer, omni_config, reference):
    """Without stop strings each delta's rows are known to be spoken when it leaves (TextDelta.more)
    except the reply's last token's, which the talker never speaks."""
    ids, _ = reference
    start = pb.ThinkerStart(token_ids=pb.TokenIds(ids=prompt_ids(tokenizer, omni_config)), max_tokens=N,
                            talker_rows=True)
    with grpc.insecure_channel(stack.address("thinker")) as ch:
        responses = list(pb_grpc.ThinkerStub(ch).Generate(iter([pb.ThinkerRequest(start=start)]), timeout=60))
    deltas = [r.text for r in responses if r.WhichOneof("kind") == "text"]
    assert [t for d in deltas for t in d.token_ids] == ids[:N]
    assert all(d.HasField("embeddings") for d in deltas)
    assert [d.more for d in deltas] == [True] * (len(deltas) - 1) + [False]


def test_a_reply_ending_inside_a_character_keeps_its_last_bytes(tokenizer):
    """A reply whose last token splits a UTF-8 character (max_tokens cut it there): its deltas add up
    to the full decode, U+FFFD at the end as transformers' decode gives it, with stop strings and
    without; a split character before the end waits for the token that completes it."""
    ids = tokenizer.encode("caf\u00e9 na\u00efve", add_special_tokens=False)
    cuts = [k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith("\ufffd")]
    assert cuts, "the tokenizer splits no character in this text"
    for k in (cuts[0], len(ids)):
        part = ids[:k]
        want = tokenizer.decode(part, skip_special_tokens=True)
        stream_text = StreamText(tokenizer)
        reply = ReplyText(tokenizer)
        plain = [d for i, t in enumerate(part) for d in reply.push(t, last=i == k - 1)[0]]
        assert all(d.text is None for d in plain) and "".join(stream_text(d) for d in plain) == want, k
        matched = ReplyText(tokenizer, ("zzz",))
        got = [d for i, t in enumerate(part) for d in matched.push(t, last=i == k - 1)[0]]
        assert "".join(d.text for d in got) == want and [t for d in got for t in d.token_ids] == part, k
    assert tokenizer.decode(ids[:cuts[0]]).endswith("\ufffd")      # the case above did end inside one


def test_reply_text_holds_back_what_may_begin_a_stop_string(tokenizer):
    """The matcher alone: a stop string inside one token, across three tokens, and past min_tokens."""
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)

    def run(stops, min_tokens=0):
        r = ReplyText(tokenizer, tuple(stops), min_tokens)
        out, stopped = [], False
        for k, t in enumerate(ids):
            deltas, stopped = r.push(t, row=torch.full((2,), float(k)), last=k == len(ids) - 1)
            out += deltas
            if stopped:
                break
        return out, stopped

    plain, stopped = run([])          # no stop strings: one output a token, its text made off the engine thread
    stream_text = StreamText(tokenizer)
    assert not stopped and len(plain) == len(ids) and all(d.text is None for d in plain)
    assert "".join(stream_text(d) for d in plain) == "Hello world, this is a test."
    assert [t for d in plain for t in d.token_ids] == ids
    for stop in ("world", "lo wor", "o", "is a t", "."):
        out, stopped = run([stop, "zzz"])
        text = "".join(d.text for d in out)
        assert stopped and text == "Hello world, this is a test."[:"Hello world, this is a test.".find(stop)], stop
        assert [t for d in out for t in d.token_ids] == ids[:len([t for d in out for t in d.token_ids])]
        rows = [float(x) for d in out if d.rows is not None for x in d.rows[:, 0]]
        assert rows == [float(k) for k in range(len(rows))]          # rows in order, a prefix
        spoken = len(rows) - 1                                       # the last row is never spoken
        assert len(tokenizer.decode(ids[:spoken])) <= len(text)
    # before min_tokens nothing is matched (as vLLM): "l" is first seen in the text after token 1
    out, stopped = run(["l"], min_tokens=3)
    assert stopped and "".join(d.text for d in out).startswith("He")


# ----------------------------------------------------------------------------- logprobs

def test_logprobs_equal_log_softmax_of_the_transformers_logits(client, model, tokenizer, omni_config, tiny_model_dir):
    ids = prompt_ids(tokenizer, omni_config)
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                          top_logprobs=5)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens_details.text_tokens
    thinker = load_reference_model(tiny_model_dir).thinker
    seq = list(ids)
    with torch.no_grad():
        for e in entries:
            logprobs = thinker(input_ids=torch.tensor([seq])).logits[0, -1].float().log_softmax(-1)
            token = int(logprobs.argmax())          # greedy, as transformers' generate
            seq.append(token)
            assert e.token == tokenizer.decode([token]) and bytes(e.bytes).decode(errors="replace") == e.token
            assert abs(e.logprob - float(logprobs[token])) < 1e-4, (e.logprob, float(logprobs[token]))
            top = torch.topk(logprobs, 5)
            values = [t.logprob for t in e.top_logprobs]
            assert values == sorted(values, reverse=True) and len(values) == 5
            assert np.allclose(values, top.values.tolist(), atol=1e-4)
            assert [t.token for t in e.top_logprobs] == [tokenizer.decode([int(i)]) for i in top.indices]
            assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
    assert "".join(e.token for e in entries if e.token not in tokenizer.all_special_tokens) == \
        resp.choices[0].message.content

    stream = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
                                            top_logprobs=5, stream=True)
    streamed = [e for chunk in stream for c in chunk.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob, e.bytes) for e in streamed] == [(e.token, e.logprob, e.bytes) for e in entries]
    # logprobs without alternatives; and none asked, none given
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True)
    assert [e.top_logprobs for e in resp.choices[0].logprobs.content] == [[]] * 3
    resp = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, temperature=0)
    assert resp.choices[0].logprobs is None


def test_logprobs_rows_batch_with_plain_rows(stack, tokenizer, omni_config):
    """Requests with and without logprobs decode in one batch and each equals its run alone (the
    values up to the float differences of batched arithmetic)."""
    reqs = [SpeechRequest(token_ids=prompt_ids(tokenizer, omni_config, t), audio=False, max_tokens=8, min_tokens=8,
                          top_logprobs=k) for t, k in (("One.", None), ("Two, please!", 20), ("Three.", 0))]

    async def together():
        async with PipelineClient(stack.address("thinker"), stack.address("code2wav")) as pc:
            return await asyncio.gather(*(pc.collect(r) for r in reqs))

    alone = [collect(stack, r) for r in reqs]
    for a, b, r in zip(alone, asyncio.run(together()), reqs):
        assert a.text_ids == b.text_ids
        assert [e.token_id for e in b.logprobs] == (b.text_ids if r.top_logprobs is not None else [])
        assert len(b.logprobs) == (0 if r.top_logprobs is None else 8)
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4 and len(x.top) == len(y.top) == r.top_logprobs
            assert np.allclose([t.logprob for t in x.top], [t.logprob for t in y.top], atol=1e-4)


# ----------------------------------------------------------------------------- the audio cap

def test_audio_is_capped_by_the_text_by_default(client, model, stack, tokenizer, omni_config):
    """No max_audio_frames: at most 10 frames per text token + 25 (the random talker never stops by
    itself, so it reaches the cap: 2 tokens, 45 frames, finish_reason "length"); max_audio_frames
    still bounds it further; a TextFrameCap from a gRPC caller replaces the default."""
    spoken = dict(model=model, messages=MESSAGES, temperature=0, modalities=["text", "audio"],
                  audio={"voice": "ethan", "format": "wav"})
    resp = client.chat.completions.create(max_tokens=2, extra_body={"ignore_eos": True}, **spoken)
    assert resp.usage.completion_tokens_details.text_tokens == 2
    assert resp.usage.completion_tokens_details.audio_tokens == 10 * 2 + 25
    assert resp.choices[0].finish_reason == "length"
    assert wav_samples(resp.choices[0].message.audio.data).shape[0] == 1920 * 45 - 555
    resp = client.chat.completions.create(max_tokens=2, extra_body={"ignore_eos": True, "max_audio_frames": 10},
                                          **spoken)
    assert resp.usage.completion_tokens_details.audio_tokens == 9
    res = collect(stack, SpeechRequest(token_ids=prompt_ids(tokenizer, omni_config), max_tokens=4, min_tokens=4,
                                       max_frames=50, text_cap=(1, 3)))
    assert res.done.frames == 1 * 4 + 3 and res.done.audio_finish == pb.LENGTH


# ----------------------------------------------------------------------------- refusals and bad inputs

def post(gateway, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=body, timeout=120)


BAD = [   # (extra body, param, message pattern)
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 stop strings, got 5"),
    ({"stop": ""}, "stop", "stop string 0 is empty"),
    ({"stop": ["ok", ""]}, "stop", "stop string 1 is empty"),
    ({"stop": "x" * 257}, "stop", "257 characters; the limit is 256"),
    ({"stop": 7}, "stop", "must be a string or an array of strings"),
    ({"stop": ["a", 1]}, "stop", "must be a string or an array of strings"),
    ({"stop": {"a": 1}}, "stop", "must be a string or an array of strings"),
    ({"logprobs": "yes"}, "logprobs", "must be a boolean"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "from 0 to 20, got 21"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "from 0 to 20, got -1"),
    ({"logprobs": True, "top_logprobs": 2.5}, "top_logprobs", "must be an integer"),
    ({"top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", "needs 'logprobs': true"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools[0].function.parameters",
     "JSON schema"),     # more in test_tools.py
    ({"functions": [{"name": "f"}]}, "functions", "function calling"),
    ({"function_call": "auto"}, "function_call", "function calling"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "with 'name' and 'schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name",
     "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "1 to 64 letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON Schema object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema", 'Unsupported type "nope"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict", "must be a boolean"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "bogus": 1}}},
     "response_format.json_schema.bogus", "unrecognized key"),
    ({"response_format": {"type": "json_object", "bogus": 1}}, "response_format.bogus", "unrecognized key"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format", "excludes 'min_tokens'"),
    ({"logit_bias": {"50": 10}}, "logit_bias", "not supported"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "only 0"),
    ({"presence_penalty": -1}, "presence_penalty", "only 0"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction", "predicted outputs"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "does not reason"),
    ({"verbosity": "low"}, "verbosity", "not supported"),
    ({"web_search_options": {}}, "web_search_options", "web search"),
    ({"moderation": {"model": "x"}}, "moderation", "moderation"),
    ({"store": True}, "store", "not stored"),
    ({"service_tier": "flex"}, "service_tier", "one tier"),
    ({"service_tier": "bogus"}, "service_tier", "must be one of"),
    ({"metadata": {"k": 1}}, "metadata", "string values"),
    ({"user": 5}, "user", "must be a string"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with 'stream': true"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation",
     "not obfuscated"),
    ({"stream": True, "stream_options": {"bogus": True}}, "stream_options.bogus", "unrecognized stream option"),
    ({"best_of": 2}, "best_of", "unrecognized request argument supplied: 'best_of'"),
    ({"n": 2}, "n", "only n=1"),
]


@pytest.mark.parametrize("extra,param,pattern", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_unserved_and_bad_parameters_are_400_naming_them(gateway, model, extra, param, pattern):
    resp = post(gateway, {"model": model, "messages": MESSAGES, "max_tokens": 2, **extra})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and pattern in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_the_sdk_raises_bad_request_naming_the_parameter(client, model):
    for kw, param in ((dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
                            tool_choice={"type": "function", "function": {"name": "g"}}), "tool_choice"),
                      (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 1}}}),
                       "response_format.json_schema.schema"),
                      (dict(stop=["a"] * 5), "stop"), (dict(logprobs=True, top_logprobs=30), "top_logprobs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2, **kw)
        assert e.value.param == param


def test_no_op_values_and_irrelevant_parameters_are_accepted(client, model):
    resp = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, temperature=0, tools=[], tool_choice="none",
        response_format={"type": "text"}, frequency_penalty=0, presence_penalty=0.0, logit_bias={}, store=False,
        service_tier="auto", user="u-1", safety_identifier="s-1", prompt_cache_key="k", metadata={"team": "a"},
        reasoning_effort="none", seed=3, stop=None, logprobs=False)
    assert resp.choices[0].message.content is not None and resp.choices[0].logprobs is None


def test_every_sdk_parameter_is_served_accepted_or_refused():
    """Each parameter the installed SDK can send is in the gateway's table (a new one fails here,
    and until it is classified the gateway refuses it as unrecognized)."""
    from openai.types.chat.completion_create_params import CompletionCreateParamsBase

    from voxpipe.gateway.chat_parameters import ACCEPTED, KNOWN, REFUSED, SERVED

    assert set(CompletionCreateParamsBase.__annotations__) <= KNOWN
    assert not (SERVED & set(ACCEPTED)) and not (SERVED & set(REFUSED)) and not (set(ACCEPTED) & set(REFUSED))
    readme = (ROOT / "README.md").read_text()
    for name in sorted(KNOWN):
        assert f"`{name}`" in readme, f"README's parameter table lacks {name}"


# ----------------------------------------------------------------------------- the Node SDK

@pytest.fixture(scope="module")
def node_chat(tmp_path_factory) -> Path:
    return install_node_package(tmp_path_factory, "node_chat", "chat.mjs")


def test_node_sdk_stop_logprobs_and_refusals(gateway, model, node_chat, reference):
    _, texts = reference
    full = "".join(texts)
    stop, _, at = boundary_stop(texts)
    proc = subprocess.run(["node", "chat.mjs", f"{gateway.base_url}/v1", model, PROMPT, str(N), stop],
                          cwd=node_chat, capture_output=True, text=True, timeout=180,
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "OPENAI_API_KEY": "unused"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["text"] == full[:at] and out["finish"] == "stop"
    assert out["stream_text"] == full[:at] and out["stream_finish"] == "stop"
    assert out["logprobs"] == out["text_tokens"] >= 1 and out["top"] == [2] * out["logprobs"]
    assert out["stream_logprobs"] == out["logprobs"] and out["sorted"]
    assert out["tools_stream_finish"] in ("stop", "length", "tool_calls")      # tools served, streamed
    call = out["call"]       # the Node SDK's stream accumulation of a call is the completion's call
    assert call["whole_finish"] == call["streamed_finish"] == "tool_calls" and call["streamed"] == call["whole"]
    assert call["whole"][0][0] == "city" and json.loads(call["whole"][0][1])["name"] in ("Oslo", "Rome")
    assert call["heads"] == 1 and call["first_has_name"] and call["pieces"] > 1
    assert out["refused"] == [{"status": 400, "param": "tool_choice"}, {"status": 400, "param": "response_format.json_schema.schema"},
                              {"status": 400, "param": "stop"}]
