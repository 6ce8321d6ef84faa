"""The web chat page: GET / (and HEAD) of `fx-engine serve`, one static HTML file
(server/static/chat.html: its CSS and script inline, no build step, nothing fetched from
elsewhere) that talks to this server's own API: GET /v1/models (the models and LoRA
adapters to choose from), POST /v1/chat/completions streamed (reasoning shown apart from
the answer, a stop button that aborts the request: the server frees its rows when the
client goes away).

The page holds no data, so with API keys it is served without one (server/gate.py's
PAGE_PATHS, GET and HEAD only); the page asks for the key and sends it with each API call.
"""

from __future__ import annotations

from functools import lru_cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

router = APIRouter()

# The page runs only its own inline script and talks only to this server; no framing
# (the page keeps an API key in localStorage: no clickjacking of its settings).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@lru_cache(maxsize=1)
def page() -> str:
    """The page's HTML (package data: ships in the wheel)."""
    return resources.files("fx_engine.server").joinpath("static/chat.html").read_text(encoding="utf-8")


@router.head("/", include_in_schema=False)
@router.get("/", include_in_schema=False)
async def chat_page() -> HTMLResponse:
    return HTMLResponse(page(), headers=HEADERS)
