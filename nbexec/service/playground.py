"""The playground page at `/`: paste code, run it in a session, watch outputs stream in.

Three static files shipped inside the package (no build step, nothing from a CDN), read once when the app is made.
The page and its assets are public; everything it does goes through the API with the token the person types,
sent as ``Authorization: Bearer`` and kept in the page's memory only. The Content-Security-Policy allows scripts,
styles and connections to this origin only (no inline script), and images from blobs the page makes itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from importlib import resources

from fastapi import FastAPI, Response

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' blob:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
ASSETS = {  # URL path -> (file in nbexec/service/playground/, media type)
    "/": ("index.html", "text/html; charset=utf-8"),
    "/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "/playground.css": ("playground.css", "text/css; charset=utf-8"),
}
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


def add_routes(app: FastAPI) -> None:
    folder = resources.files(__package__) / "playground"
    for path, (name, media) in ASSETS.items():
        app.add_api_route(path, _answer((folder / name).read_bytes(), media), methods=["GET"],
                          include_in_schema=False)


def _answer(content: bytes, media: str) -> Callable[[], Awaitable[Response]]:
    async def answer() -> Response:
        return Response(content, media_type=media, headers=HEADERS)

    return answer
