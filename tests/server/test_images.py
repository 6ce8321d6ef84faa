"""Images through every chat route (issue 46, item 4): OpenAI's `image_url` parts, Anthropic's
`image` blocks (base64 and url sources), Responses' `input_image`, several images per
message, http(s) images fetched by the server within its limits (or not at all with
--no-image-urls), /tokenize and count_tokens counting the image tokens, and the 400s that
name the part.

Oracle: the Python API on the same tiny random Gemma 3 folder (`fx_engine.generate(model,
messages_with_images)`, itself checked against mlx-vlm and transformers' masks in
tests/models/test_vision_engine.py): a route's greedy reply is the same tokens.
"""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time

import httpx
import numpy as np
import pytest

import fx_engine
from fx_engine.engine.image_prompt import image_prompt
from fx_engine.loading.images import ImageError
from fx_engine.server import media
from fx_engine.testing.vision import write_tiny_gemma3_vlm
from tests.conftest import serve


def _png(seed: int, size=(40, 28)) -> bytes:
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64," + base64.b64encode(data).decode()


class _Files(http.server.BaseHTTPRequestHandler):
    """A local image host: /N.png (image N), /page.html (not an image), /big.png (more than
    the test server's byte limit), /slow.png (answers after the test server's timeout),
    /missing.png (404)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        path = self.path.lstrip("/")
        if path == "page.html":
            body, kind = b"<html>hi</html>", "text/html"
        elif path == "big.png":
            body, kind = _png(1, (600, 600)), "image/png"
        elif path == "slow.png":
            time.sleep(2.0)
            body, kind = _png(1), "image/png"
        elif path.endswith(".png") and path[:-4].isdigit():
            body, kind = _png(int(path[:-4])), "image/png"
        else:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:  # the client gave up (the timeout test)
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def host():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return fx_engine.load(str(write_tiny_gemma3_vlm(tmp_path_factory.mktemp("vlm") / "m")))


@pytest.fixture(scope="module")
def server(model):
    from fx_engine.server.app import create_app

    engine = fx_engine.Engine(model, max_rows=4)
    # limits the test host's big / slow images exceed
    app = create_app(engine, "tiny-vlm", image_url_bytes=64 << 10, image_url_timeout=0.5)
    with serve(app, engine) as (url, _):
        yield {"url": url, "engine": engine}


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


def _image_url(url):
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": "describe the picture"}


def _want(model, messages, n=6):
    """The Python API's greedy reply (token ids) to the same chat."""
    out = fx_engine.generate(model, messages, max_tokens=n, temperature=0)
    return list(out.token_ids), out.text, len(out.prompt_token_ids)


def _chat(server, messages, **kw):
    r = httpx.post(server["url"] + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "max_tokens": 6, "temperature": 0, **kw})
    return r


def test_chat_image_url_data_urls_answer_as_the_python_api(server, model):
    msgs = _user(TEXT, _image_url(_data_url(_png(3))), {"type": "text", "text": "and this"},
                 _image_url(_data_url(_png(4))))
    _, text, prompt_tokens = _want(model, msgs)
    r = _chat(server, msgs)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == prompt_tokens  # the image tokens counted


def test_chat_streams_and_n_choices_with_images(server, model):
    msgs = _user(TEXT, _image_url(_data_url(_png(5))))
    _, text, _ = _want(model, msgs)
    with httpx.stream("POST", server["url"] + "/v1/chat/completions", timeout=120,
                      json={"messages": msgs, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    import json

    streamed = "".join(json.loads(c)["choices"][0]["delta"].get("content") or "" for c in chunks
                       if json.loads(c)["choices"])
    assert streamed == text
    r = _chat(server, msgs, n=2)
    assert [c["message"]["content"] for c in r.json()["choices"]] == [text, text]


def test_http_image_urls_are_fetched(server, model, host):
    want = _want(model, _user(TEXT, _image_url(_data_url(_png(7)))))[1]
    r = _chat(server, _user(TEXT, _image_url(f"{host}/7.png")))
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want


@pytest.mark.parametrize("path,match", [
    ("page.html", "not an image"),
    ("big.png", "bytes"),
    ("slow.png", "fetching"),
    ("missing.png", "HTTP 404"),
])
def test_http_image_url_limits_are_400s(server, host, path, match):
    r = _chat(server, _user(TEXT, _image_url(f"{host}/{path}")))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and match in err["message"], err


@pytest.mark.parametrize("part,match", [
    (_image_url("data:image/png;base64,@@@"), "invalid base64"),
    (_image_url("data:application/pdf;base64,AAAA"), "unsupported media type"),
    (_image_url(_data_url(b"not a png")), "not a readable image"),
    (_image_url("ftp://example.com/a.png"), "only data URLs"),
    ({"type": "image_url", "image_url": {}}, "image url must be a string"),
])
def test_bad_images_are_400s_naming_the_part(server, part, match):
    r = _chat(server, _user(TEXT, part))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages[0].content[1]" and match in err["message"], err


def test_too_many_images_is_a_400(server):
    png = _image_url(_data_url(_png(1, (8, 8))))
    r = _chat(server, _user(TEXT, *[png] * 17))
    assert r.status_code == 400 and "more than 16 images" in r.json()["error"]["message"], r.text


def test_anthropic_image_blocks(server, model, host):
    png = _png(8)
    want = _want(model, _user(TEXT, _image_url(_data_url(png))))[1]
    for source in ({"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()},
                   {"type": "url", "url": f"{host}/8.png"}):
        body = {"model": "tiny-vlm", "max_tokens": 6, "temperature": 0, "messages": [
            {"role": "user", "content": [TEXT, {"type": "image", "source": source}]}]}
        r = httpx.post(server["url"] + "/v1/messages", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert "".join(b.get("text", "") for b in r.json()["content"]) == want
    count = httpx.post(server["url"] + "/v1/messages/count_tokens", timeout=120, json={
        "model": "tiny-vlm", "messages": [{"role": "user", "content": [TEXT, {"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}}]}]})
    assert count.json()["input_tokens"] == _want(model, _user(TEXT, _image_url(_data_url(png))))[2]
    bad = {"model": "tiny-vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml", "data": "AAAA"}}]}]}
    r = httpx.post(server["url"] + "/v1/messages", json=bad, timeout=120)
    assert r.status_code == 400 and "unsupported media type" in r.json()["error"]["message"], r.text


def test_responses_input_image(server, model):
    png = _png(9)
    want = _want(model, _user(TEXT, _image_url(_data_url(png))))[1]
    body = {"model": "tiny-vlm", "max_output_tokens": 6, "temperature": 0, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": TEXT["text"]},
                                     {"type": "input_image", "image_url": _data_url(png)}]}]}
    r = httpx.post(server["url"] + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == want
    r = httpx.post(server["url"] + "/v1/responses", timeout=120, json={**body, "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].file_id", r.text


def test_tokenize_counts_the_image_tokens(server, model):
    msgs = _user(TEXT, _image_url(_data_url(_png(2))))
    r = httpx.post(server["url"] + "/tokenize", json={"messages": msgs}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == list(image_prompt(model, msgs).ids)


# ---------------------------------------------------------------- server/media.py on its own


def test_fetching_off_asks_for_a_data_url(host):
    msgs = _user(TEXT, _image_url(f"{host}/1.png"))
    with pytest.raises(ImageError, match=r"messages\[0\].content\[1\]: this server does not fetch"):
        media.fetch_image_urls(msgs, enabled=False, max_bytes=1 << 20, timeout=5)
    # data URLs need no fetching: untouched either way
    inline = _user(TEXT, _image_url(_data_url(_png(1))))
    assert media.fetch_image_urls(inline, enabled=False, max_bytes=1 << 20, timeout=5) == inline


def test_fetched_parts_become_bytes(host):
    [m] = media.fetch_image_urls(_user(TEXT, _image_url(f"{host}/3.png"),
                                       {"type": "input_image", "image_url": f"{host}/4.png"},
                                       {"type": "image", "source": {"type": "url", "url": f"{host}/5.png"}}),
                                 enabled=True, max_bytes=1 << 20, timeout=5)
    assert m["content"][0] == TEXT
    assert [p["image"] for p in m["content"][1:]] == [_png(3), _png(4), _png(5)]


def test_redirects_to_other_schemes_are_not_followed():
    class Redirect(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Redirect)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ImageError, match="fetching"):
            media.fetch_image(f"http://127.0.0.1:{srv.server_address[1]}/x.png", "part", 1 << 20, 5)
    finally:
        srv.shutdown()


def test_serve_flags_reach_the_settings():
    from fx_engine.cli import build_parser

    a = build_parser().parse_args(["serve", "--no-image-urls", "--image-url-max-bytes", "1000",
                                   "--image-url-timeout", "2.5"])
    assert (a.no_image_urls, a.image_url_max_bytes, a.image_url_timeout) == (True, 1000, 2.5)


def test_anthropic_tool_results_may_carry_images(server, model):
    """A tool that returns a screenshot (what coding agents send): the tool_result's image
    block reaches the prompt as the image, not a 400."""
    png = base64.b64encode(_png(11)).decode()
    body = {"model": "tiny-vlm", "max_tokens": 4, "temperature": 0, "messages": [
        {"role": "user", "content": "take a screenshot"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "text", "text": "here it is"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}]}]}],
        "tools": [{"name": "shot", "description": "a screenshot", "input_schema": {"type": "object"}}]}
    r = httpx.post(server["url"] + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    count = httpx.post(server["url"] + "/v1/messages/count_tokens", json={
        k: v for k, v in body.items() if k not in ("max_tokens", "temperature")}, timeout=120).json()
    without = httpx.post(server["url"] + "/v1/messages/count_tokens", json={
        **{k: v for k, v in body.items() if k not in ("max_tokens", "temperature")},
        "messages": body["messages"][:2] + [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "here it is"}]}]}, timeout=120).json()
    assert count["input_tokens"] > without["input_tokens"] + 16  # the image's tokens are in the prompt


def test_an_idefics3_model_serves_images(tmp_path):
    """The routes are family-neutral: a SmolVLM / Idefics3 model (placeholder `<image>`,
    tiles) answers a chat with an image as the Python API does, and /tokenize counts its
    tiles' tokens."""
    from fx_engine.server.app import create_app
    from fx_engine.testing.vision import write_tiny_idefics3

    model = fx_engine.load(str(write_tiny_idefics3(tmp_path / "smolvlm", "smolvlm")))
    msgs = _user(TEXT, _image_url(_data_url(_png(12, (60, 40)))))
    want = fx_engine.generate(model, msgs, max_tokens=6, temperature=0)
    engine = fx_engine.Engine(model, max_rows=2)
    with serve(create_app(engine, "tiny-smolvlm"), engine) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=120,
                       json={"messages": msgs, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want.text
        assert r.json()["usage"]["prompt_tokens"] == len(want.prompt_token_ids)
        tok = httpx.post(url + "/tokenize", json={"messages": msgs}, timeout=120).json()
        assert tok["tokens"] == list(want.prompt_token_ids)
