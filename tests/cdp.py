"""Headless Chromium (the Debian package) driven over the DevTools protocol with the `websockets`
library: just what the console tests need -- start it on a page with a fake microphone that plays
a wav file, evaluate JavaScript there, wait for a condition, and say what the page logged when
something fails."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

BINARIES = ("chromium", "chromium-browser", "google-chrome")


def chromium_binary() -> str | None:
    return next((path for name in BINARIES if (path := shutil.which(name))), None)


class PageError(AssertionError):
    """A script that threw in the page, or a condition the page never met (with its log)."""


@dataclass
class Page:
    """One page target's DevTools session."""

    ws: ClientConnection
    log: list[str] = field(default_factory=list)     # console messages and uncaught exceptions
    _next_id: int = 0

    async def call(self, method: str, **params: Any) -> dict:
        self._next_id += 1
        call_id = self._next_id
        await self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while True:
            message = json.loads(await self.ws.recv())
            if message.get("id") == call_id:
                if "error" in message:
                    raise PageError(f"{method}: {message['error']}")
                return message["result"]
            self._note(message)

    def _note(self, event: dict) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.log.append(f"console.{params.get('type')}: {text}")
        elif event.get("method") == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.log.append(f"exception: {details.get('exception', {}).get('description') or details.get('text')}")

    async def evaluate(self, expression: str, *, user_gesture: bool = False) -> Any:
        """The JSON value of `expression` (awaited when it is a promise)."""
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True,
                                 userGesture=user_gesture)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise PageError(f"{expression!r} threw: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float, what: str) -> Any:
        """Polls `expression` until it is truthy (an evaluation that throws counts as falsy); PageError
        with the page's log after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if value := await self.evaluate(expression):
                    return value
            except PageError as e:        # e.g. the page navigated while it ran: try again
                self.log.append(str(e))
            if time.monotonic() > deadline:
                raise PageError(f"after {timeout:.0f} s: {what}; the page logged: {self.log}")
            await asyncio.sleep(0.2)


class Chromium:
    """`chromium --headless` on `url` with its DevTools port open; the microphone is a fake device
    that plays `microphone` (a wav file) once, as soon as a page asks for it, then silence."""

    def __init__(self, url: str, microphone: Path | None = None) -> None:
        binary = chromium_binary()
        if binary is None:
            raise FileNotFoundError("chromium is not installed")
        self.profile = Path(tempfile.mkdtemp(prefix="voxpipe-chromium-"))
        args = [binary, "--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
                "--disable-sync", "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                f"--user-data-dir={self.profile}", "--autoplay-policy=no-user-gesture-required",
                "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream"]
        if microphone is not None:
            args.append(f"--use-file-for-fake-audio-capture={microphone}%noloop")
        if os.geteuid() == 0:          # Chromium's sandbox refuses to run as root
            args.append("--no-sandbox")
        self.url = url
        # its own session: close() ends chromium's helper processes too, which write into the profile
        self.proc = subprocess.Popen([*args, url], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        self.port = self._devtools_port(timeout=30)

    def _devtools_port(self, timeout: float) -> int:
        marker = self.profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with code {self.proc.returncode}")
            lines = marker.read_text().split("\n") if marker.exists() else []
            if lines and lines[0].strip().isdigit():
                return int(lines[0])
            time.sleep(0.1)
        self.close()
        raise RuntimeError(f"chromium opened no DevTools port within {timeout:.0f} s")

    async def page(self) -> Page:
        """The DevTools session of the page it was started on, once that page has loaded."""
        async with httpx.AsyncClient() as client:
            targets = (await client.get(f"http://127.0.0.1:{self.port}/json/list")).json()
        url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        page = Page(await connect(url, max_size=None))
        await page.call("Runtime.enable")
        await page.wait_for(f"location.href === {json.dumps(self.url)} && document.readyState === 'complete'", 30,
                            f"{self.url} did not load")
        return page

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        try:                            # helpers still running after the browser process
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        # a helper may still flush a file into the profile as it dies: retry for a few seconds
        for _ in range(50):
            try:
                shutil.rmtree(self.profile)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
