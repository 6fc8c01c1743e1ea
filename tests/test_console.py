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

MAX_TOKENS, MAX_FRAMES = 4, 8           # a short reply: the test waits for all of it to play
KEY = "sesame-console"

needs_chromium = pytest.mark.skipif(chromium_binary() is None,
                                    reason="chromium is not installed (apt-get install -y chromium; .ci/run does)")


@dataclass(frozen=True)
class TurnView:
    state: str                  # listening / waiting / replying / done / interrupted / failed
    latency_ms: float | None    # shown once the reply's first audio is scheduled
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
            state: t.dataset.state, latency: t.dataset.latencyMs ?? null, text: t.textContent})),
    }))()"""

    @classmethod
    def of(cls, value: dict) -> "ConsoleView":
        return cls(status=value["status"], played_samples=value["played"],
                   turns=[TurnView(t["state"], None if t["latency"] is None else float(t["latency"]), t["text"])
                          for t in value["turns"]])


# a turn is over, its audio played and its latency shown
TURN_DONE = """(() => {
    const done = [...document.querySelectorAll("#turns .turn")]
        .some((t) => t.dataset.state === "done" && t.dataset.latencyMs !== undefined);
    const player = document.getElementById("played");
    return done && Number(player.dataset.samples) > 0 && !document.getElementById("stop").disabled;
})()"""


def start_script(api_key: str | None) -> str:
    """Fill in the form as a user would and press Start."""
    return f"""(() => {{
        document.getElementById("api-key").value = {json.dumps(api_key or "")};
        document.getElementById("max-tokens").value = "{MAX_TOKENS}";
        document.getElementById("max-frames").value = "{MAX_FRAMES}";
        document.getElementById("start").click();
    }})()"""


@pytest.fixture(scope="module")
def microphone(tmp_path_factory) -> Path:
    """One utterance with silence around it (the fake microphone plays it once)."""
    silence = np.zeros(RATE // 2, np.float32)
    path = tmp_path_factory.mktemp("microphone") / "question.wav"
    write_wav(str(path), np.concatenate([silence, speech("What is the weather like today?"), silence, silence,
                                         silence]), RATE)
    return path


def talk(gateway: GatewayProcess, microphone: Path, api_key: str | None = None, *,
         until: str = TURN_DONE, timeout: float = 90) -> ConsoleView:
    """Open the console in Chromium, start a session and wait for `until`; what the page shows."""
    async def go() -> ConsoleView:
        with Chromium(f"{gateway.base_url}/", microphone) as browser:
            page = await browser.page()
            try:
                await page.evaluate(start_script(api_key), user_gesture=True)
                await page.wait_for(until, timeout, "the console did not get there")
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
    bodies = [page.text]
    for asset in [*assets, "console/capture-worklet.js"]:
        r = httpx.get(f"{gateway.base_url}/{asset}")
        assert r.status_code == 200 and r.headers["content-type"].split(";")[0] in ("text/css", "text/javascript")
        bodies.append(r.text)
    for body in bodies:                                # nothing from elsewhere (no CDN)
        assert not re.search(r"(?:https?:)?//[a-z0-9.-]+\.[a-z]{2,}/", body), body[:200]
    js = bodies[2]
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
