"""HTTP conventions OpenAI clients rely on (issue #12 item 3), against the real gateway process:
404 model_not_found (the SDKs raise NotFoundError), model ids with "/" retrievable, `x-request-id`
on every response (the client's own when well-formed), `Retry-After` on 429, /openapi.json and /docs."""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from conftest import GatewayProcess


def test_an_unknown_model_is_404_model_not_found_on_every_endpoint(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.code == "model_not_found" and e.value.param == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.audio.speech.create(model="nope", input="hi", voice="ethan")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_every_response_carries_a_request_id(gateway):
    ids = set()
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        for method, path, body in (("GET", "/health", None), ("GET", "/v1/models", None),
                                   ("POST", "/v1/chat/completions", {"model": "nope"}),
                                   ("GET", "/no/such/route", None)):
            r = http.request(method, path, json=body)
            rid = r.headers.get("x-request-id", "")
            assert re.fullmatch(r"req_[0-9a-f]{32}", rid), (path, r.status_code, rid)
            ids.add(rid)
        assert len(ids) == 4
        # a well-formed id from the client is kept; anything else is replaced
        assert http.get("/health", headers={"x-request-id": "trace-42:a.b"}).headers["x-request-id"] == "trace-42:a.b"
        for bad in ("has space", "x" * 129, "semi;colon"):
            got = http.get("/health", headers={"x-request-id": bad}).headers["x-request-id"]
            assert got != bad and got.startswith("req_")


def test_the_openapi_document_and_docs_page_are_served(gateway):
    with httpx.Client(base_url=gateway.base_url, timeout=60) as http:
        doc = http.get("/openapi.json")
        assert doc.status_code == 200
        paths = doc.json()["paths"]
        assert {"/v1/chat/completions", "/v1/audio/speech", "/v1/models"} <= set(paths)
        page = http.get("/docs")
        assert page.status_code == 200 and "/openapi.json" in page.text


@pytest.fixture(scope="module")
def named_gateway(stack, tiny_model_dir):
    """A gateway serving the model under an id with "/" and one session at a time."""
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"),
                        "--served-model-name", "voxpipe/tiny-omni", "--max-sessions", "1")
    yield gw
    gw.stop()


def test_model_ids_with_a_slash_are_routed(named_gateway):
    client = openai.OpenAI(base_url=f"{named_gateway.base_url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve("voxpipe/tiny-omni").id == "voxpipe/tiny-omni"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("voxpipe/other")


def test_429_says_when_to_retry(named_gateway):
    import asyncio

    body = {"model": "voxpipe/tiny-omni", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "ignore_eos": True}

    async def burst():
        async with httpx.AsyncClient(base_url=named_gateway.base_url, timeout=120) as http:
            return await asyncio.gather(*(http.post("/v1/chat/completions", json=body) for _ in range(4)))

    responses = asyncio.run(burst())
    assert sorted(r.status_code for r in responses)[0] == 200
    limited = [r for r in responses if r.status_code == 429]
    assert limited, [r.status_code for r in responses]
    for r in limited:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "rate_limit_exceeded"
