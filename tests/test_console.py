"""The voice console at `/`: served from package data, self-contained (nothing fetched from
elsewhere), and working in headless Chromium (the Debian package) whose fake microphone plays
espeak-ng speech into the page, against the real gateway and stage processes: a spoken turn
goes through server VAD, the reply's audio plays in the page and the turn shows its latency.
With --api-key the page passes the key as OpenAI's browser clients do (a WebSocket subprotocol)."""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest

from cdp import Chromium, chromium_binary
from conftest import GatewayProcess
from test_realtime import RATE, speech
from voxpipe.audio import write_wav

# reply settings (text tokens, audio frames, temperature; None: the field left empty)
SHORT = (4, 8, None)  # a short reply, to wait for all of it to play
LONG = (8, 60, 0)     # 4.7 s of audio, still playing when the user speaks again (greedy: a sampled reply
                      # sometimes ends early, by itself, before the user speaks)
KEY = "sesame-console"

needs_chromium = pytest.mark.skipif(chromium_binary() is None,
                                    reason="chromium is not installed (apt-get install -y chromium; .ci/run does)")


@dataclass(frozen=True)
class TurnView:
    state: str                  # listening / waiting / replying / done / interrupted / failed
    latency_ms: float | None    # shown once the reply's first audio is scheduled
    audio_ms: int | None        # the reply audio received
    heard_ms: int | None        # how much of it had played when the user interrupted it
    text: str


@dataclass(frozen=True)
class ConsoleView:
    """What the page shows: its status line, the audio it played and the conversation."""

    status: str
    played_samples: int
    turns: list[TurnView]

    SCRIPT = """(() => ({
        status: document.getElementById("status").textContent,
        played: Number(document.getElementById("played").dataset.samples),
        turns: [...document.querySelectorAll("#turns .turn")].map((t) => ({
            state: t.dataset.state, latency: t.dataset.latencyMs ?? null, audio: t.dataset.audioMs ?? null,
            heard: t.dataset.heardMs ?? null, text: t.textContent})),
    }))()"""

    @classmethod
    def of(cls, value: dict) -> "ConsoleView":
        def number(text: str | None) -> int | None:
            return None if text is None else int(text)

        return cls(status=value["status"], played_samples=value["played"],
                   turns=[TurnView(t["state"], number(t["latency"]), number(t["audio"]), number(t["heard"]), t["text"])
                          for t in value["turns"]])


# installed before the session starts: the client events the page sends, as sent
SENT_SPY = """(() => {
    window.sentEvents = [];
    const send = WebSocket.prototype.send;
    WebSocket.prototype.send = function (data) { window.sentEvents.push(JSON.parse(data)); return send.call(this, data); };
})()"""
SENT = "window.sentEvents.filter((e) => e.type === 'session.update').map((e) => e.session)"


def turn_done(index: int) -> str:
    """The page's condition: turn `index` is over, with its latency shown, and audio has played."""
    return f"""(() => {{
        const turn = document.querySelectorAll("#turns .turn")[{index}];
        const played = Number(document.getElementById("played").dataset.samples);
        return turn !== undefined && turn.dataset.state === "done" && turn.dataset.latencyMs !== undefined
            && played > 0 && !document.getElementById("stop").disabled;
    }})()"""


def start_script(api_key: str | None, limits: tuple) -> str:
    """Fill in the form as a user would and press Start."""
    tokens, frames, temperature = limits
    return f"""(() => {{
        document.getElementById("api-key").value = {json.dumps(api_key or "")};
        document.getElementById("max-tokens").value = "{tokens}";
        document.getElementById("max-frames").value = "{frames}";
        document.getElementById("temperature").value = {json.dumps("" if temperature is None else str(temperature))};
        document.getElementById("start").click();
    }})()"""


def recording(path: Path, *parts: str | float) -> Path:
    """A wav for the fake microphone: espeak-ng saying each text part, each number seconds of silence."""
    audio = [np.zeros(round(RATE * p), np.float32) if isinstance(p, float) else speech(p) for p in parts]
    write_wav(str(path), np.concatenate(audio), RATE)
    return path


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """One question with silence around it (the fake microphone plays it once)."""
    return recording(tmp_path_factory.mktemp("microphone") / "question.wav",
                     0.5, "What is the weather like today?", 2.0)


def talk(gateway: GatewayProcess, microphone: Path, api_key: str | None = None, *, limits: tuple = SHORT,
         until: str = turn_done(0), timeout: float = 90, sent: list | None = None) -> ConsoleView:
    """Open the console in Chromium, start a session and wait for `until`; what the page shows
    (and in `sent`, the sessions of the session.update events it sent)."""
    async def go() -> ConsoleView:
        with Chromium(f"{gateway.base_url}/", microphone) as browser:
            page = await browser.page()
            try:
                await page.evaluate(SENT_SPY)
                await page.evaluate(start_script(api_key, limits), user_gesture=True)
                await page.wait_for(until, timeout, "the console did not get there")
                if sent is not None:
                    sent.extend(await page.evaluate(SENT))
                return ConsoleView.of(await page.evaluate(ConsoleView.SCRIPT))
            finally:
                await page.ws.close()
    return asyncio.run(go())


def assert_turn_played(view: ConsoleView) -> None:
    done = [t for t in view.turns if t.state == "done"]
    assert done, view
    turn = done[0]
    assert turn.text.startswith("You:") and "Model:" in turn.text, turn
    assert turn.latency_ms is not None and 0 < turn.latency_ms < 60_000, turn
    assert f"First audio {round(turn.latency_ms)} ms" in turn.text
    assert view.played_samples > 0
    assert "Error" not in view.status and "refused" not in view.status, view.status


# ----------------------------------------------------------------------------- the page itself

def test_console_is_served_self_contained(gateway):
    page = httpx.get(f"{gateway.base_url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
    for label in ('for="api-key"', 'for="max-tokens"', 'for="max-frames"'):
        assert label in page.text                      # every field has its label
    assets = re.findall(r'(?:src|href)="(console/[^"]+)"', page.text)
    assert sorted(assets) == ["console/console.css", "console/console.js"]
    bodies = {"index.html": page.text}
    for asset in [*assets, "console/capture-worklet.js"]:
        r = httpx.get(f"{gateway.base_url}/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in ("text/css", "text/javascript")
        bodies[asset.removeprefix("console/")] = r.text
    for body in bodies.values():                       # nothing from elsewhere (no CDN)
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", body), body[:200]
    js = bodies["console.js"]
    for event in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                  "response.output_audio.delta", "response.output_audio_transcript.delta",
                  "conversation.item.input_audio_transcription.completed", "conversation.item.truncate"):
        assert event in js                             # GA event names
    assert httpx.get(f"{gateway.base_url}/console/nope.js").status_code == 404
    assert httpx.get(f"{gateway.base_url}/console/index.html").status_code == 404


# ----------------------------------------------------------------------------- in Chromium

@needs_chromium
def test_a_spoken_turn_in_chromium(gateway, microphone):
    assert_turn_played(talk(gateway, microphone))


@needs_chromium
def test_the_microphone_resampler_in_the_page(gateway):
    """The page's stream resampler (the microphone's rate -> 24 kHz), fed in uneven blocks, equals
    linear interpolation of the whole signal."""
    x = np.sin(np.arange(4410) / 7.0).astype(np.float32)
    script = f"""(() => {{
        const x = Float32Array.from({json.dumps(x.tolist())});
        const chunked = new Resampler(44100, {RATE});
        const sizes = [1, 128, 777, 2048], out = [];
        for (let at = 0, i = 0; at < x.length; at += sizes[i++ % sizes.length]) {{
            out.push(...chunked.push(x.subarray(at, at + sizes[i % sizes.length])));
        }}
        return out;
    }})()"""

    async def go() -> list[float]:
        with Chromium(f"{gateway.base_url}/") as browser:
            page = await browser.page()
            try:
                return await page.evaluate(script)
            finally:
                await page.ws.close()

    got = np.array(asyncio.run(go()))
    step = 44100 / RATE
    want = np.interp(np.arange(int((len(x) - 1) / step) + 1) * step, np.arange(len(x)), x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-5)


@needs_chromium
def test_speaking_over_the_reply_stops_it(gateway, tmp_path):
    """Barge-in: the second question starts while the first reply plays; the page stops that
    audio at once (the server cancels the reply, the page cuts the item to what was heard) and the
    second question gets its own reply."""
    microphone = recording(tmp_path / "interruption.wav", 0.5, "What is the weather like today?", 2.5,
                           "Wait, stop, I have a question.", 2.0)
    sent = []
    view = talk(gateway, microphone, limits=LONG, until=turn_done(1), sent=sent)
    assert {"type": "realtime", "max_output_tokens": 8, "max_audio_frames": 60, "temperature": 0} == {
        k: v for k, v in sent[0].items() if k != "audio"}, sent
    first, second = view.turns[:2]
    assert first.state == "interrupted" and first.heard_ms is not None and first.audio_ms is not None, first
    assert first.heard_ms <= first.audio_ms
    # nothing of the first reply played after the interruption
    assert view.played_samples * 1000 / RATE <= first.heard_ms + second.audio_ms + 50, view
    assert second.state == "done" and second.latency_ms is not None, second
    assert "Error" not in view.status, view.status        # the truncate the page sent was accepted


@pytest.fixture(scope="module")
def keyed_gateway(stack, tiny_model_dir):
    gw = GatewayProcess(tiny_model_dir, stack.address("thinker"), stack.address("code2wav"), "--api-key", KEY)
    yield gw
    gw.stop()


@needs_chromium
def test_with_an_api_key(keyed_gateway, microphone):
    refused = talk(keyed_gateway, microphone, "wrong", timeout=30,
                   until="document.getElementById('status').classList.contains('error')")
    assert refused.status == "The gateway refused the connection (is the API key right?).", refused
    assert not refused.turns
    assert_turn_played(talk(keyed_gateway, microphone, KEY))


@needs_chromium
def test_settings_out_of_range_do_not_start_a_session(gateway):
    """A temperature the gateway would refuse (above 2) keeps the form from submitting: the browser
    flags the field and no session opens (the page would otherwise start without its settings)."""
    async def go() -> dict:
        with Chromium(f"{gateway.base_url}/") as browser:
            page = await browser.page()
            try:
                await page.evaluate(SENT_SPY)
                await page.evaluate(start_script(None, (4, 8, 5)), user_gesture=True)
                return await page.evaluate("""(() => ({
                    overflow: document.getElementById("temperature").validity.rangeOverflow,
                    started: !document.getElementById("stop").disabled,
                    sent: window.sentEvents.length}))()""")
            finally:
                await page.ws.close()

    assert asyncio.run(go()) == {"overflow": True, "started": False, "sent": 0}

