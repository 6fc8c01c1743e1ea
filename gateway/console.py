"""The voice console: one page at `/` that talks to the realtime API from the browser (microphone
-> /v1/realtime with server VAD -> speakers, both sides' transcripts, barge-in, per-turn latency).
Plain HTML, JS and CSS from the package's `static/` folder: no build step, nothing fetched from
anywhere else (the Content-Security-Policy says so to the browser too)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import Response

from .errors import APIError

MEDIA_TYPES = {"index.html": "text/html; charset=utf-8", "console.js": "text/javascript; charset=utf-8",
               "capture-worklet.js": "text/javascript; charset=utf-8", "console.css": "text/css; charset=utf-8"}
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "Content-Security-Policy": "default-src 'self'; connect-src 'self'; img-src 'self' data:; "
                                      "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str

    def response(self) -> Response:
        return Response(self.body, media_type=self.media_type, headers=HEADERS)


def load_assets() -> dict[str, Asset]:
    """The console's files, read once (a build without the package data fails at start, not at `/`)."""
    folder = files(__package__).joinpath("static")
    return {name: Asset(folder.joinpath(name).read_bytes(), media) for name, media in MEDIA_TYPES.items()}


def add_console(app: FastAPI) -> None:
    assets = load_assets()

    @app.get("/", include_in_schema=False)
    async def console() -> Response:
        return assets["index.html"].response()

    @app.get("/console/{name}", include_in_schema=False)
    async def console_asset(name: str) -> Response:
        asset = assets.get(name)
        if asset is None or name == "index.html":
            raise APIError(404, f"GET /console/{name}: not found", type="not_found_error")
        return asset.response()
