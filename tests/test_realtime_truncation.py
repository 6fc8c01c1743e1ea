"""Realtime `session.truncation` on the real gateway in front of a real thinker whose context is
a few turns long (--max-len 320): a session longer than the context goes on with the oldest
turns cut (auto, retention_ratio, token_limits.post_instructions) and its later turns hit the
thinker's prefix cache; "disabled" and a prompt that cannot fit are `context_length_exceeded`
error events with the session kept. Replies are text only (no talker is needed). Bad
truncation shapes are in test_realtime's REFUSED_UPDATES."""

from __future__ import annotations

import math

import pytest

from conftest import GatewayProcess, StageProcesses, free_port
from test_realtime import MANUAL, of, realtime, run, text_turn, user_text
from voxpipe.gateway.realtime.events import AUTO_RETENTION_RATIO
from voxpipe.services.runtime.flags import KV_BLOCK_SIZE
from voxpipe.services.thinker.prompt import ChatMessage, render

CONTEXT = 320
TURNS = 14
REPLY = 8                      # max_output_tokens of every reply: the prompt may hold CONTEXT - REPLY tokens
BLOCK = KV_BLOCK_SIZE          # the thinker's KV block (its prefix cache hits whole blocks)
INSTRUCTIONS = "You keep the lighthouse and answer briefly."
TEXT = {**MANUAL, "output_modalities": ["text"], "instructions": INSTRUCTIONS, "max_output_tokens": REPLY}


def question(i: int) -> str:
    return f"Question {i}: what did you see?"


@pytest.fixture(scope="module")
def short_gateway(tiny_model_dir):
    """A thinker with a CONTEXT-token context (a pool that keeps earlier turns' blocks) and a gateway in
    front of it; no talker (text replies), so the gateway's code2wav address is never dialled."""
    procs = StageProcesses(tiny_model_dir)
    thinker = procs.start("thinker", "thinker", "--max-len", str(CONTEXT), "--kv-cache-tokens", "4096")
    gw = GatewayProcess(tiny_model_dir, thinker, f"127.0.0.1:{free_port()}")    # starting beside the thinker
    procs.wait_ready()
    yield gw
    gw.stop()
    procs.stop()


@pytest.fixture(scope="module")
def system_tokens(tokenizer, omni_config) -> int:
    """The tokens of the instructions' system turn (the part truncation never cuts)."""
    ids = render(tokenizer, omni_config.thinker, [ChatMessage.text("system", INSTRUCTIONS),
                                                   ChatMessage.text("user", "x")]).token_ids
    return [i for i, t in enumerate(ids) if t == omni_config.thinker.tokens.im_start][1]


async def long_session(gateway, truncation, count: int) -> tuple[dict, list[dict], dict, list[dict]]:
    """`count` user turns, each answered, in a session with `truncation`; the first user item's id
    is "item_first". (session.updated's session, the response.done of each turn, the first item
    retrieved at the end, every event seen)."""
    async with realtime(gateway) as rt:
        session = await rt.update(**TEXT, truncation=truncation)
        done = []
        for i in range(count):
            item = {**user_text(question(i)), **({"id": "item_first"} if i == 0 else {})}
            await rt.send("conversation.item.create", item=item)
            await rt.until("conversation.item.done")
            await rt.send("response.create", response={})
            done.append((await rt.until("response.done"))[-1]["response"])
        await rt.send("conversation.item.retrieve", item_id="item_first")
        retrieved = (await rt.until("conversation.item.retrieved"))[-1]["item"]
        return session, done, retrieved, rt.seen


TRUNCATIONS = [
    ("auto", None, AUTO_RETENTION_RATIO),
    ({"type": "retention_ratio", "retention_ratio": 0.5}, None, 0.5),
    ({"type": "retention_ratio", "retention_ratio": 1.0, "token_limits": {"post_instructions": 100}}, 100, 1.0),
]


@pytest.mark.parametrize("truncation, post_limit, ratio", TRUNCATIONS, ids=["auto", "ratio-0.5", "post-instructions"])
def test_a_session_longer_than_the_context_goes_on_and_keeps_its_cache(short_gateway, tokenizer, omni_config,
                                                                        system_tokens, truncation, post_limit, ratio):
    """Every turn is answered. Each prompt is the instructions and the conversation from some item
    on, rebuilt here from the turns' texts: the same as the last turn's plus the new turns while
    they fit (and then the whole previous prompt is in the thinker's prefix cache, whole blocks),
    else cut at the first item that leaves at most `ratio` of the room after the instructions (the
    context less the reply's room, or post_instructions). The cut items stay in the conversation:
    retrievable, with no conversation.item.deleted."""
    session, done, retrieved, seen = run(long_session(short_gateway, truncation, TURNS))
    assert session["truncation"] == truncation
    assert all(d["status"] in ("completed", "incomplete") for d in done), [d["status_details"] for d in done]
    room = min(CONTEXT - REPLY - system_tokens, post_limit or math.inf)
    system = ChatMessage.text("system", INSTRUCTIONS)

    def prompt_tokens(turns: list[ChatMessage | None]) -> int:
        return len(render(tokenizer, omni_config.thinker, [system, *(m for m in turns if m is not None)]).token_ids)

    turns: list[ChatMessage | None] = []      # user, assistant (None: an empty reply), user, ...
    start, cuts = 0, []
    for t, d in enumerate(done):
        turns.append(ChatMessage.text("user", question(t)))
        usage = d["usage"]
        n, cached = usage["input_tokens"], usage["input_token_details"]["cached_tokens"]
        if n == prompt_tokens(turns[start:]):
            assert n - system_tokens <= room and n + REPLY <= CONTEXT, (t, n)
            if t:
                assert cached >= done[t - 1]["usage"]["input_tokens"] // BLOCK * BLOCK, (t, n, cached)
        else:
            target = math.floor(ratio * room)
            starts = [k for k in range(start + 1, len(turns)) if turns[k] is not None]
            fitting = [k for k in starts if prompt_tokens(turns[k:]) - system_tokens <= target]
            start = fitting[0] if fitting else starts[-1]
            assert n == prompt_tokens(turns[start:]), (t, n, start)
            assert cached >= system_tokens // BLOCK * BLOCK, (t, cached)      # the instructions' blocks
            cuts.append(t)
        text = d["output"][0]["content"][0]["text"]
        turns.append(ChatMessage.text("assistant", text) if text else None)
    assert len(cuts) >= 2, cuts
    if ratio < 1.0:         # a cut leaves room for more than one turn: never two cuts in a row
        assert not any(t - 1 in cuts for t in cuts), cuts
    assert retrieved["id"] == "item_first" and retrieved["content"][0]["text"] == question(0)
    assert not of(seen, "conversation.item.deleted") and not of(seen, "error")


def context_error(events: list[dict]) -> dict:
    """The `error` event of a response that did not fit, before its failed response.done."""
    errors = of(events, "error")
    assert len(errors) == 1 and events[-1]["type"] == "response.done", [e["type"] for e in events]
    done = events[-1]["response"]
    assert done["status"] == "failed" and done["status_details"]["error"]["code"] == "context_length_exceeded"
    error = errors[0]["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    return error


def test_disabled_truncation_fails_the_response_and_the_session_goes_on(short_gateway):
    """With "disabled" the turn that would pass the context fails (`error` then a failed
    response.done, naming the numbers); nothing was cut, and once the client deletes the old items
    a short turn is answered."""
    async def go():
        async with realtime(short_gateway) as rt:
            await rt.update(**TEXT, truncation="disabled")
            for i in range(TURNS):
                events = await text_turn(rt, question(i))
                if events[-1]["response"]["status"] == "failed":
                    break
            items = [e["item"]["id"] for e in of(rt.seen, "conversation.item.done")]
            for item_id in items:
                await rt.send("conversation.item.delete", item_id=item_id)
                await rt.until("conversation.item.deleted")
            after = await text_turn(rt, "Still there?")
            return i, events, after

    turn, events, after = run(go())
    assert turn >= 2
    error = context_error(events)
    assert f"{CONTEXT - REPLY} tokens with room for the reply" in error["message"], error
    assert '"disabled"' in error["message"]
    assert after[-1]["response"]["status"] in ("completed", "incomplete")
    assert not of(after, "error")


def test_a_prompt_past_the_context_alone_is_an_error_and_the_session_goes_on(short_gateway):
    """A newest item that cannot fit however much is cut (truncation auto): the thinker's refusal
    (the session has not learned the context yet) then the error event; the item is deleted and the
    next turn is answered."""
    long_text = " ".join(question(i) for i in range(20))     # about 380 tokens

    async def go():
        async with realtime(short_gateway) as rt:
            await rt.update(**TEXT)
            first = await text_turn(rt, "Hello.")
            await rt.send("conversation.item.create", item={**user_text(long_text), "id": "item_long"})
            await rt.until("conversation.item.done")
            await rt.send("response.create", response={})
            too_long = await rt.until("response.done")
            await rt.send("conversation.item.delete", item_id="item_long")
            await rt.until("conversation.item.deleted")
            after = await text_turn(rt, "Still there?")
            return first, too_long, after

    first, too_long, after = run(go())
    assert first[-1]["response"]["status"] in ("completed", "incomplete")
    error = context_error(too_long)
    assert "the newest item alone" in error["message"] and "tokens of conversation" in error["message"], error
    assert after[-1]["response"]["status"] in ("completed", "incomplete") and not of(after, "error")


def test_a_reply_without_a_limit_gets_what_the_context_leaves(short_gateway):
    """No max_tokens (chat) / max_output_tokens "inf" (realtime): the reply may take up to the
    thinker's default, as far as the context leaves room (vLLM's and OpenAI's default), so a context
    under that default still serves such requests (they were all refused: prompt + the default's
    1,024 passed 320); a prompt that leaves no room at all is a 400 that names no max_tokens the
    client never sent. Realtime with "inf" goes on past the context by truncation."""
    import httpx

    url = f"{short_gateway.base_url}/v1/chat/completions"
    body = {"model": httpx.get(f"{short_gateway.base_url}/v1/models").json()["data"][0]["id"], "temperature": 0}
    ok = httpx.post(url, json={**body, "messages": [{"role": "user", "content": "Hello."}]}, timeout=120)
    assert ok.status_code == 200, ok.text
    usage = ok.json()["usage"]
    assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] + usage["completion_tokens"] <= CONTEXT, usage
    full = httpx.post(url, json={**body, "messages": [{"role": "user", "content": " ".join(question(i) for i in range(20))}]},
                      timeout=120)
    assert full.status_code == 400, full.text
    error = full.json()["error"]
    assert error["code"] == "context_length_exceeded" and "max_tokens" not in error["message"], error
    assert f"a reply of at least 1 token exceeds the context of {CONTEXT}" in error["message"], error

    async def go():
        async with realtime(short_gateway) as rt:
            await rt.update(**{**TEXT, "max_output_tokens": "inf"})
            return [(await text_turn(rt, question(i)))[-1]["response"] for i in range(3)], rt.seen

    done, seen = run(go())
    assert all(d["status"] in ("completed", "incomplete") for d in done), [d["status_details"] for d in done]
    assert all(d["usage"]["input_tokens"] + d["usage"]["output_tokens"] <= CONTEXT for d in done)
    assert not of(seen, "error")
