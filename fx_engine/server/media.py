"""Images a request names by an http(s) URL, fetched by the server (issue 46): OpenAI's
`image_url` parts, Responses' `input_image` and Anthropic's `{"source": {"type": "url"}}`
image blocks. Data URLs and base64 sources pass through untouched (engine/image_prompt.py
reads them); the Python API never touches the network.

Each fetch is bounded (ServerSettings: `image_url_bytes` per image, `image_url_timeout`
seconds per image, at most engine/image_prompt.MAX_IMAGES per request) and only speaks
http(s), redirects included (no file:, ftp:, data: through a redirect). `--no-image-urls`
turns fetching off (a 400 naming the part): a server exposed to untrusted clients may not
want to make requests on their behalf to whatever host they name (its own network
included), as vLLM's --allowed-media-domains and llama.cpp's defaults acknowledge.

Failures are ImageErrors naming the part (`messages[0].content[1]: ...`): the routes answer
them with a 400.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from fx_engine.engine.image_prompt import IMAGE_TYPES, MAX_IMAGES
from fx_engine.loading.images import ImageError

__all__ = ["TEXT_ONLY", "fetch_image_urls", "image_url_of", "remote_url"]

#: what a route answers an image part sent to a model without a vision tower
TEXT_ONLY = "images are not supported by this model (text only: it has no vision tower)"

_CHUNK = 64 << 10


def image_url_of(part: Any) -> str | None:
    """The URL an image part names, if it names one by URL (any scheme)."""
    if not isinstance(part, dict) or part.get("type") not in IMAGE_TYPES:
        return None
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if url is None:
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "url":
            url = source.get("url")
        elif "url" in part and "image" not in part:
            url = part.get("url")
    return url if isinstance(url, str) else None


def remote_url(url: str | None) -> bool:
    return isinstance(url, str) and url[:8].lower().startswith(("http://", "https://"))


def _opener() -> urllib.request.OpenerDirector:
    """http(s) only, redirects followed (urllib's limit: 10) but never to another scheme."""
    op = urllib.request.OpenerDirector()
    for h in (urllib.request.HTTPHandler(), urllib.request.HTTPSHandler(), urllib.request.HTTPRedirectHandler(),
              urllib.request.HTTPErrorProcessor(), urllib.request.HTTPDefaultErrorHandler()):
        op.add_handler(h)
    return op


def fetch_image(url: str, what: str, max_bytes: int, timeout: float) -> bytes:
    """The bytes at an http(s) URL: at most `max_bytes`, within `timeout` seconds in all
    (ImageError naming `what` otherwise, or for an HTTP error or a non-image media type)."""
    deadline = time.monotonic() + timeout
    req = urllib.request.Request(url, headers={"User-Agent": "fx-engine", "Accept": "image/*"})
    try:
        with _opener().open(req, timeout=timeout) as resp:
            media = (resp.headers.get_content_type() or "").lower()
            if resp.headers.get("Content-Type") and not (media.startswith("image/")
                                                         or media == "application/octet-stream"):
                raise ImageError(f"{what}: {url} is {media!r}, not an image")
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise ImageError(f"{what}: the image at {url} is {int(declared)} bytes, more than the "
                                 f"{max_bytes} this server fetches")
            out = bytearray()
            while True:
                if time.monotonic() > deadline:
                    raise ImageError(f"{what}: fetching {url} took more than {timeout:g} s")
                chunk = resp.read(_CHUNK)
                if not chunk:
                    break
                out += chunk
                if len(out) > max_bytes:
                    raise ImageError(f"{what}: the image at {url} is more than the {max_bytes} bytes this "
                                     "server fetches")
            return bytes(out)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"{what}: fetching {url} failed: HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:  # (socket timeouts are OSErrors)
        reason = getattr(e, "reason", e)
        raise ImageError(f"{what}: fetching {url} failed: {reason}") from None


def fetch_image_urls(messages: Sequence[dict[str, Any]], *, enabled: bool, max_bytes: int,
                     timeout: float, max_images: int = MAX_IMAGES) -> list[dict[str, Any]]:
    """`messages` with each http(s) image part replaced by {"type": "image", "image": bytes}
    (fetched as `fetch_image` says); other parts as they were. ImageError when fetching is
    off (`enabled` False) and a part needs it, or for more than `max_images` images."""
    out: list[dict[str, Any]] = []
    count = 0
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, (list, tuple)):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            url = image_url_of(part)
            if isinstance(part, dict) and part.get("type") in IMAGE_TYPES:
                count += 1
                if count > max_images:
                    raise ImageError(f"messages[{i}].content[{j}]: more than {max_images} images in one request")
            if remote_url(url):
                what = f"messages[{i}].content[{j}]"
                if not enabled:
                    raise ImageError(f"{what}: this server does not fetch image URLs (--no-image-urls); send "
                                     "the image inline as a data URL (data:image/png;base64,...)")
                part = {"type": "image", "image": fetch_image(url, what, max_bytes, timeout)}
            parts.append(part)
        out.append({**m, "content": parts})
    return out
