"""What browsers get from the gateway (issue #12 item 6), against real gateway processes (the one
with --cors-allow-origins runs without stages: nothing here generates): `--cors-allow-origins` -- CORS preflights and response
headers per the Fetch standard for the listed origins, 403 for the others on HTTP and before the
realtime WebSocket upgrade, clients without an Origin untouched; by default same-host pages only
and no CORS headers; malformed values refused at start; the API key as a WebSocket subprotocol
(how OpenAI's browser clients send it)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from conftest import GatewayProcess, free_port
from voxpipe.gateway.cors import AllowedOrigins, Origin, OriginCheck, OriginsError

APP = "https://app.example"
DEV = "http://localhost:3000"
EVIL = "https://evil.example"
KEY = "sesame-browser"


def nowhere() -> tuple[str, str]:
    """Stage addresses nobody listens on (these tests never reach a stage)."""
    return f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def cors_gateway(tiny_model_dir):
    gw = GatewayProcess(tiny_model_dir, *nowhere(), "--cors-allow-origins", f"{APP}, {DEV}", "--api-key", KEY)
    yield gw
    gw.stop()


def preflight(gw: GatewayProcess, origin: str, method: str = "POST", headers: str = "authorization, content-type",
              path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.options(f"{gw.base_url}{path}", headers={"Origin": origin, "Access-Control-Request-Method": method,
                                                           "Access-Control-Request-Headers": headers})


def assert_refused(r: httpx.Response, origin: str) -> None:
    assert r.status_code == 403, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["code"] == "origin_not_allowed" and error["param"] == "Origin" and origin in error["message"]
    assert "--cors-allow-origins" in error["message"]
    assert "access-control-allow-origin" not in r.headers
    assert r.headers["x-request-id"].startswith("req_")


async def open_realtime(gw: GatewayProcess, origin: str | None, subprotocols: list[str] | None = None,
                        headers: dict[str, str] | None = None) -> tuple[str, str | None]:
    """(the first event's type, the subprotocol the server chose) of a realtime session."""
    async with connect(f"ws://127.0.0.1:{gw.port}/v1/realtime", origin=origin, subprotocols=subprotocols,
                       additional_headers=headers) as ws:
        return json.loads(await asyncio.wait_for(ws.recv(), 60))["type"], ws.subprotocol


def realtime_status(gw: GatewayProcess, origin: str | None, **kw) -> int:
    """101 when the session opened, else the HTTP status that refused the upgrade."""
    async def go() -> int:
        try:
            first, _ = await open_realtime(gw, origin, **kw)
        except InvalidStatus as e:
            return e.response.status_code
        assert first == "session.created"
        return 101
    return asyncio.run(go())


# ----------------------------------------------------------------------------- with --cors-allow-origins

def test_preflight_from_an_allowed_origin(cors_gateway):
    for origin in (APP, DEV):
        r = preflight(cors_gateway, origin, headers="Authorization, Content-Type, X-Stainless-OS, OpenAI-Beta")
        assert r.status_code == 204, r.text
        h = r.headers
        assert h["access-control-allow-origin"] == origin
        assert {m.strip() for m in h["access-control-allow-methods"].split(",")} >= {"GET", "POST"}
        # named one by one: a `*` there would not cover Authorization
        assert h["access-control-allow-headers"] == "authorization, content-type, x-stainless-os, openai-beta"
        assert "origin" in h["vary"].lower() and int(h["access-control-max-age"]) > 0
        assert "access-control-allow-credentials" not in h        # bearer keys, not cookies
        assert h["x-request-id"].startswith("req_")


def test_responses_to_an_allowed_origin_carry_cors_headers(cors_gateway):
    auth = {"Origin": APP, "Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=cors_gateway.base_url, timeout=60) as http:
        for r in (http.get("/v1/models", headers=auth),
                  http.post("/v1/chat/completions", headers=auth, json={"model": "nope"}),   # errors too
                  http.get("/v1/models", headers={"Origin": APP})):                          # 401 too
            assert r.status_code in (200, 401, 404), r.text
            assert r.headers["access-control-allow-origin"] == APP
            assert "x-request-id" in r.headers["access-control-expose-headers"]
            assert "Origin" in r.headers["vary"]
        plain = http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})   # no Origin: not a browser
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_a_disallowed_origin_is_refused_on_http(cors_gateway):
    for origin in (EVIL, "null", "https://app.example.evil.example", "http://app.example"):
        assert_refused(preflight(cors_gateway, origin), origin)
        assert_refused(httpx.get(f"{cors_gateway.base_url}/v1/models",
                                 headers={"Origin": origin, "Authorization": f"Bearer {KEY}"}), origin)


def test_preflight_bad_inputs(cors_gateway):
    r = preflight(cors_gateway, APP, method="PUT")
    assert r.status_code == 403 and r.json()["error"]["param"] == "Access-Control-Request-Method"
    r = preflight(cors_gateway, APP, headers="content-type, bad header")
    assert r.status_code == 400 and r.json()["error"]["param"] == "Access-Control-Request-Headers"


def test_realtime_origin_check(cors_gateway):
    key = {"Authorization": f"Bearer {KEY}"}
    assert realtime_status(cors_gateway, APP, headers=key) == 101
    assert realtime_status(cors_gateway, None, headers=key) == 101                        # not a browser
    assert realtime_status(cors_gateway, f"http://127.0.0.1:{cors_gateway.port}", headers=key) == 101  # its own page
    assert realtime_status(cors_gateway, EVIL, headers=key) == 403                       # before the key is looked at
    assert realtime_status(cors_gateway, EVIL) == 403
    assert realtime_status(cors_gateway, APP) == 401


def test_the_api_key_as_a_websocket_subprotocol(cors_gateway):
    """OpenAI's browser clients offer `realtime` and `openai-insecure-api-key.<key>`; the server
    answers with `realtime` (never echoing the key)."""
    async def go() -> tuple[str, str | None]:
        return await open_realtime(cors_gateway, APP, ["realtime", f"openai-insecure-api-key.{KEY}"])

    assert asyncio.run(go()) == ("session.created", "realtime")
    for bad in (["realtime", "openai-insecure-api-key.wrong"], ["realtime", "openai-insecure-api-key."],
                ["realtime"], [f"openai-insecure-api-key{KEY}"], ["realtime", f"OPENAI-INSECURE-API-KEY.{KEY}"]):
        assert realtime_status(cors_gateway, APP, subprotocols=bad) == 401, bad


# ----------------------------------------------------------------------------- the default

def test_by_default_only_the_gateways_own_pages(gateway):   # the suite's gateway: no --cors-allow-origins
    own = f"http://127.0.0.1:{gateway.port}"
    assert realtime_status(gateway, own) == 101
    assert realtime_status(gateway, None) == 101
    for origin in (EVIL, f"http://127.0.0.1:{gateway.port + 1}", f"http://localhost:{gateway.port}"):
        assert realtime_status(gateway, origin) == 403, origin
    assert_refused(preflight(gateway, EVIL), EVIL)
    assert_refused(httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Origin": EVIL},
                              content=b'{"model": "x"}'), EVIL)
    same = httpx.get(f"{gateway.base_url}/v1/models", headers={"Origin": own})
    assert same.status_code == 200
    assert not [h for h in same.headers if h.startswith("access-control-")]          # no CORS headers at all


# ----------------------------------------------------------------------------- malformed values

BAD_VALUES = {
    "https://app.example/": "no path",
    "app.example": "not an http or https origin",
    "ftp://app.example": "not an http or https origin",
    "https://*.example": "wildcards are not supported",
    "*,https://app.example": "cannot be combined",
    "https://app.example,,http://b.example": "empty entry",
    "https://app.example:99999": "Port out of range",
    "https://user@app.example": "no user name",
}


@pytest.mark.parametrize("value,reason", BAD_VALUES.items())
def test_malformed_values_are_refused(value, reason):
    with pytest.raises(OriginsError, match=reason):
        AllowedOrigins.parse(value)


@pytest.mark.parametrize("command", ["gateway", "up"])
def test_a_malformed_flag_stops_the_command_at_start(command, capsys):
    from voxpipe.cli import main

    with pytest.raises(SystemExit) as stopped:       # argparse, before anything starts
        main([command, "--cors-allow-origins", "https://app.example/v1"])
    assert stopped.value.code == 2
    assert "argument --cors-allow-origins: 'https://app.example/v1': an origin has no path" in capsys.readouterr().err


def test_a_malformed_environment_value_stops_the_gateway(tmp_path, monkeypatch):
    from voxpipe.cli import build_parser
    from voxpipe.errors import ConfigError
    from voxpipe.gateway.server import serve

    monkeypatch.setenv("VOXPIPE_CORS_ALLOW_ORIGINS", "https://*.example")
    args = build_parser().parse_args(["gateway", "--model", str(tmp_path)])
    with pytest.raises(ConfigError) as stopped:     # before it loads anything or listens
        asyncio.run(serve(args))
    assert str(stopped.value).startswith("$VOXPIPE_CORS_ALLOW_ORIGINS: 'https://*.example': "
                                         "wildcards are not supported")


def test_voxpipe_up_passes_the_origins_on():
    from voxpipe.cli import _up_gateway_flags, build_parser

    args = build_parser().parse_args(["up", "--cors-allow-origins", f"{DEV},{APP}"])
    assert _up_gateway_flags(args) == [f"--cors-allow-origins={DEV},{APP}"]
    assert _up_gateway_flags(build_parser().parse_args(["up"])) == []


# ----------------------------------------------------------------------------- the middleware on its own

def client(allowed: AllowedOrigins) -> TestClient:
    async def hello(request):
        return PlainTextResponse("hello")

    return TestClient(OriginCheck(Starlette(routes=[Route("/", hello, methods=["GET", "POST"])]), allowed),
                      base_url="http://gateway.test")


def test_any_origin():
    http = client(AllowedOrigins.parse("*"))
    for origin in (EVIL, "null"):
        r = http.get("/", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert "vary" not in r.headers                  # the same answer for every origin
        r = http.options("/", headers={"Origin": origin, "Access-Control-Request-Method": "POST"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
        assert "access-control-allow-headers" not in r.headers     # none asked for


def test_same_host_rules():
    served = Origin.parse("http://gateway.test")
    assert served.served_at("gateway.test") and served.served_at("gateway.test:80") and served.served_at("GATEWAY.test")
    assert not served.served_at("gateway.test:8000") and not served.served_at("other.test")
    tls = Origin.parse("https://gateway.test")       # behind a TLS proxy the Host has no port
    assert tls.served_at("gateway.test") and tls.served_at("gateway.test:443") and not tls.served_at("gateway.test:80")
    assert Origin.parse("http://[::1]:8000").served_at("[::1]:8000")
    default = client(AllowedOrigins())
    assert default.get("/", headers={"Origin": "http://gateway.test"}).status_code == 200
    assert default.get("/", headers={"Origin": "http://gateway.test:81"}).status_code == 403
    assert default.get("/", headers={"Origin": "http://gateway.test", "Host": "evil.test"}).status_code == 403
