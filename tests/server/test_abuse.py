"""Faults found by using fx-engine as a hostile or careless client would (issue 19): exit
codes of processes that use the engine, leaked rows, one client stalling the others, the
prefix cache as a side channel between tenants, authentication gaps, invalid text, and a
caller's closed event loop. The servers here run on 127.0.0.1 with the tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import LONG_TEXT, free_port, serve, wait_healthy


def _running_rows(url: str, headers: dict | None = None) -> int:
    text = httpx.get(url + "/metrics", headers=headers or {}).text
    return int(float(next(ln.split()[1] for ln in text.splitlines()
                          if ln.startswith("fx_running_rows "))))


def _wait_rows(url: str, want: int, timeout: float = 30.0, headers: dict | None = None) -> int:
    deadline = time.time() + timeout
    n = _running_rows(url, headers)
    while n != want and time.time() < deadline:
        time.sleep(0.1)
        n = _running_rows(url, headers)
    return n


def _post_raw(port: int, path: str, body: bytes, rcvbuf: int | None = None,
              headers: str = "Content-Type: application/json\r\n") -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Length: {len(body)}\r\n\r\n"
              .encode() + body)
    return s


def _response(s: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    length = next((int(ln.split(b":")[1]) for ln in head.split(b"\r\n")
                   if ln.lower().startswith(b"content-length:")), None)
    while length is not None and len(rest) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, json.loads(rest) if rest else {}


@pytest.fixture(scope="module")
def tiny(tiny_folder):
    path = tiny_folder()
    return path, fx_engine.load(path)


@pytest.fixture(scope="module")
def open_server(tiny):
    """No API keys; a small stream buffer so that a slow reader falls behind quickly."""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=16, prefill_chunk=64, max_queue=64)
    app = create_app(engine, "tiny", defaults={"max_tokens": 16}, stream_buffer=8,
                     max_request_bytes=1 << 20)
    with serve(app, engine) as (url, port):
        yield {"url": url, "port": port, "engine": engine, "model": model}


# ------------------------------------------------------------------------ 1. exit codes

_ENGINE_SCRIPT = """
import sys, fx_engine
m = fx_engine.load(sys.argv[1])
with fx_engine.Engine(m, prefill_chunk=64) as e:
    e.start(); print(e.submit("Hi", max_tokens=4).result().text)
"""

_NEVER_CLOSED_SCRIPT = """
import sys, fx_engine
m = fx_engine.load(sys.argv[1])
e = fx_engine.Engine(m, prefill_chunk=64).start()
e.submit("Hi", max_tokens=4).result()
h = e.submit("Once upon a time", max_tokens=1000)   # still decoding at exit
next(iter(h))
print("exiting")
"""


def _run(args, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "FX_ENGINE_OFFLINE": "1"}
    return subprocess.run(args, capture_output=True, text=True, timeout=300, env=env, **kw)


@pytest.mark.parametrize("script", [_ENGINE_SCRIPT, _NEVER_CLOSED_SCRIPT], ids=["closed", "never-closed"])
@pytest.mark.slow
def test_a_script_using_the_engine_thread_exits_cleanly(tiny, script):
    """The engine thread's MLX compile cache used to be destroyed by C++ thread-local
    destructors after interpreter finalization began: abort, exit code 134."""
    for _ in range(2):  # it was a race (it lost every time here); twice for good measure
        r = _run([sys.executable, "-c", script, str(tiny[0])])
        assert r.returncode == 0, r.stderr[-2000:]
        assert "terminate called" not in r.stderr


def test_the_cli_exits_cleanly(tiny):
    exe = os.path.join(os.path.dirname(sys.executable), "fx-engine")
    r = _run([exe, "generate", "Hi", "--model", str(tiny[0]), "--max-tokens", "4"])
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_the_server_shuts_down_cleanly_on_a_signal(tiny, sig):
    exe = os.path.join(os.path.dirname(sys.executable), "fx-engine")
    port = free_port()
    env = {**os.environ, "FX_ENGINE_OFFLINE": "1"}
    p = subprocess.Popen([exe, "serve", "--model", str(tiny[0]), "--port", str(port),
                          "--shutdown-timeout", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    stuck = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [p])
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokns": 4}, timeout=60)
        assert r.status_code == 400
        # a client that never reads its stream must not hold the shutdown for long
        stuck = _post_raw(port, "/v1/completions", json.dumps({
            "prompt": "hi", "max_tokens": 1900, "stream": True, "n": 4, "logprobs": 5}).encode(),
            rcvbuf=4096)
        time.sleep(1.0)
        t0 = time.perf_counter()
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        assert time.perf_counter() - t0 < 30
    finally:
        if stuck is not None:
            stuck.close()
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err[-2000:]
    assert "terminate called" not in err
    # the server's log (stderr): a start-up line, access lines, the 400 with its reason
    assert f"on http://127.0.0.1:{port}" in err and "serving" in err, err[-2000:]
    assert '"POST /v1/completions" 200' in err and '"POST /v1/completions" 400' in err
    assert "400 invalid_request_error: max_tokns: unknown field (did you mean 'max_tokens'?)" in err


# ------------------------------------------------------------------------ 2. leaked rows


def test_a_rejected_n_request_starts_nothing(open_server):
    url = open_server["url"]
    before = httpx.get(url + "/metrics").text
    r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "n": 16, "seed": 2**64, "max_tokens": 500})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text
    assert _running_rows(url) == 0
    after = httpx.get(url + "/metrics").text
    total = [ln for ln in before.splitlines() if ln.startswith("fx_requests_total")]
    assert total == [ln for ln in after.splitlines() if ln.startswith("fx_requests_total")]
    # seeds are OpenAI's int64: -2 is the engine's 2**64 - 2, and choice i draws with
    # seed + i, which wraps around past 2**64 - 1 instead of failing the request
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": "hi", "n": 3, "seed": -2, "max_tokens": 2, "temperature": 1.0})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3


def test_submit_many_is_all_or_nothing(tiny):
    _, model = tiny
    engine = fx_engine.Engine(model, max_queue=3)  # not started: nothing runs by itself
    with pytest.raises(ValueError, match="seed"):
        engine.submit_many("hi", [{"seed": 1}, {"seed": 2**64}])
    assert engine.stats()["queued"] == 0
    with pytest.raises(ValueError, match="queue"):  # could never fit: not "retry later"
        engine.submit_many("hi", [{"max_tokens": 2}] * 4)
    first = engine.submit_many("hi", [{"max_tokens": 2}] * 2)
    with pytest.raises(fx_engine.engine.engine.QueueFull):
        engine.submit_many("hi", [{"max_tokens": 2}] * 2)
    assert engine.stats()["queued"] == 2
    assert [h.result().finish_reason for h in first] == ["length"] * 2
    hs = engine.submit_many("hi", [{"max_tokens": 2, "temperature": 1.0, "seed": s} for s in (1, 2, 3)])
    assert [h.result().finish_reason for h in hs] == ["length"] * 3


class _Errors(logging.Handler):
    """The ERROR records of the server's and uvicorn's loggers (a traceback per client)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records = []

    def emit(self, record):
        self.records.append(record)

    def __enter__(self):
        for name in ("uvicorn.error", "fx_engine.server"):
            logging.getLogger(name).addHandler(self)
        return self.records

    def __exit__(self, *exc):
        for name in ("uvicorn.error", "fx_engine.server"):
            logging.getLogger(name).removeHandler(self)


def test_a_non_streaming_client_that_disconnects_frees_its_rows(open_server):
    """... at once, and a client leaving is no error of the server's (no traceback)."""
    url, port = open_server["url"], open_server["port"]
    body = json.dumps({"prompt": "hello", "max_tokens": 1900, "temperature": 0.8, "n": 2}).encode()
    with _Errors() as errors:
        s = _post_raw(port, "/v1/completions", body)
        try:
            assert _wait_rows(url, 2, timeout=30) == 2  # decoding
        finally:
            s.close()
        assert _wait_rows(url, 0, timeout=10) == 0
        time.sleep(0.3)  # (the handler's own end comes after the rows')
    trace = [e for e in open_server["engine"].trace_events if e["kind"] == "retire"]
    assert [e["reason"] for e in trace[-2:]] == ["cancelled", "cancelled"]
    assert not errors, [r.getMessage() for r in errors]


# ------------------------------------------------------------------------ 3. stalls


def _latency(url: str) -> float:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Write a poem about the sea."}],
        "max_tokens": 17, "temperature": 0})
    assert r.status_code == 200
    return time.perf_counter() - t0


def test_a_slow_reader_is_cut_off_and_never_stalls_others(open_server):
    url, port = open_server["url"], open_server["port"]
    _latency(url)
    alone = sorted(_latency(url) for _ in range(3))[1]
    # ~1.5 KB per event (20 top logprobs) x 16 choices x 1900 tokens: ~45 MB, far more than
    # kernel socket buffers (4 MB here) and the server's transport buffer hold
    body = json.dumps({"messages": [{"role": "user", "content": "Tell me a long story"}],
                       "max_tokens": 1900, "temperature": 0.8, "stream": True, "n": 16,
                       "logprobs": True, "top_logprobs": 20}).encode()
    t_start = time.perf_counter()
    slow = _post_raw(port, "/v1/chat/completions", body, rcvbuf=4096)  # and never reads
    try:
        assert _wait_rows(url, 16, timeout=30) == 16
        # the slow reader falls behind by the buffer and is cut off: its rows are freed
        # long before its 1900 tokens, while its connection is still open ...
        assert _wait_rows(url, 0, timeout=60) == 0
        retired = [e for e in open_server["engine"].trace_events if e["kind"] == "retire"
                   and e["t"] > t_start]
        assert len(retired) == 16, retired
        # ... and costs the others nothing from then on
        beside = sorted(_latency(url) for _ in range(3))[1]
        assert all(e["reason"] == "cancelled" and e["generated"] < 1900 for e in retired), retired
        slow.settimeout(10)
        data = b""
        with contextlib.suppress(socket.timeout):
            while b"client_too_slow" not in data and b"[DONE]" not in data:
                chunk = slow.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        assert b"client_too_slow" in data and b"[DONE]" not in data
    finally:
        slow.close()
    assert beside <= 2 * alone + 0.25, (alone, beside)


@pytest.mark.slow
def test_a_socket_that_accepts_nothing_is_closed(tiny):
    """After send_timeout seconds in which the client's socket took no byte, the server
    closes the connection: a cut-off reader cannot hold it (nor a shutdown) forever."""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=16, prefill_chunk=64)
    app = create_app(engine, "tiny", stream_buffer=8, send_timeout=1.0)
    with serve(app, engine) as (url, port):
        body = json.dumps({"prompt": "hi", "max_tokens": 1900, "stream": True, "n": 16,
                           "logprobs": 5}).encode()
        s = _post_raw(port, "/v1/completions", body, rcvbuf=4096)
        try:
            assert _wait_rows(url, 0, timeout=60) == 0  # cut off, rows freed
            time.sleep(3)  # more than send_timeout without reading
            s.settimeout(30)
            closed = False
            try:
                while not closed:
                    closed = not s.recv(1 << 20)  # what was buffered, then end of stream
            except ConnectionResetError:
                closed = True
            assert closed
        finally:
            s.close()


@pytest.mark.slow
def test_a_huge_body_is_refused_unread_and_health_stays_fast(open_server):
    url, port = open_server["url"], open_server["port"]
    # Content-Length over the limit: 413 at once, without the body
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100000000\r\n\r\n{\"prompt\": \"")
    status, err = _response(s)
    s.close()
    assert status == 413 and err["error"]["type"] == "invalid_request_error"
    # a chunked body (no Content-Length) is counted as it arrives: 413 once past the limit
    import select

    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    sent = 0
    with contextlib.suppress(OSError):  # the server may close while we still send
        while sent < 4 << 20 and not select.select([s], [], [], 0)[0]:
            s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
    status, err = _response(s)
    s.close()
    assert status == 413, (status, sent)
    # bodies just under the limit, valid JSON the server must parse and check, one after
    # another: /health answers meanwhile (the text checks are C-speed on number lists)
    big = json.dumps({"prompt": [7] * 330_000, "max_tokens": 1}).encode()
    assert len(big) < 1 << 20
    done, statuses = threading.Event(), []

    def flood():
        with httpx.Client(timeout=60) as c:
            while not done.is_set():
                statuses.append(c.post(url + "/v1/completions", content=big,
                                       headers={"content-type": "application/json"}).status_code)

    floods = [threading.Thread(target=flood) for _ in range(2)]
    for f in floods:
        f.start()
    health = []
    for _ in range(15):
        t0 = time.perf_counter()
        assert httpx.get(url + "/health", timeout=10).status_code == 200
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    done.set()
    for f in floods:
        f.join(timeout=60)
    assert statuses and set(statuses) == {400}  # more ids than the context: refused
    assert sorted(health)[len(health) // 2] < 0.25 and max(health) < 1.0, health


def test_a_prompt_too_big_for_the_context_is_refused_before_tokenizing(open_server):
    url, model = open_server["url"], open_server["model"]
    text = "word " * 180_000  # 900 KB: under the body limit, over what the context can hold
    assert len(text) > 2 * model.tokenizer.max_token_bytes * (model.config.max_position_embeddings + 1)
    for path, body in (("/v1/completions", {"prompt": text}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
        t0 = time.perf_counter()
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 400 and "cannot fit the model's context" in r.json()["error"]["message"]
        assert time.perf_counter() - t0 < 5
    # under the byte bound but over the context in tokens: tokenized (off the event loop),
    # then refused naming the context
    r = httpx.post(url + "/v1/completions", json={"prompt": "word " * 5000}, timeout=60)
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]


@pytest.mark.parametrize("field,value", [
    ("repetition_context_size", 16_777_216),
    ("presence_context_size", 1 << 21),
    ("stop", ["s%d" % i for i in range(65)]),
    ("stop", ["x" * 1025]),
    ("cache_salt", ""),
])
def test_costly_parameters_have_documented_limits(open_server, field, value):
    body = {"prompt": "hi", "max_tokens": 2, field: value}
    if field == "presence_context_size":  # not an OpenAI field: the Python API's
        with pytest.raises(ValueError, match=field):
            fx_engine.generate(open_server["model"], "hi", max_tokens=2, **{field: value})
        return
    r = httpx.post(open_server["url"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


def test_a_long_penalty_window_costs_only_what_the_row_can_hold(tiny):
    """repetition_context_size beyond prompt + max_tokens is that length: the same
    output, and a history no wider than the row can ever fill."""
    from fx_engine.engine.request import parse_request
    from fx_engine.core.sampling import history_width

    _, model = tiny
    r = parse_request(model, "hello there", max_tokens=8, repetition_penalty=1.3,
                      repetition_context_size=1 << 20)
    assert r.sampling.repetition_context_size == len(r.ids) + 8
    assert history_width([r.sampling]) <= 32
    a = fx_engine.generate(model, LONG_TEXT[:80], max_tokens=12, repetition_penalty=1.3,
                           repetition_context_size=1 << 20)
    b = fx_engine.generate(model, LONG_TEXT[:80], max_tokens=12, repetition_penalty=1.3,
                           repetition_context_size=10_000)
    assert a.token_ids == b.token_ids


def test_hostile_stop_strings_cost_little_per_token():
    """(Correctness: tests/engine/test_generate.py's property test.) 64 stop strings of 1,024 characters built to make naive suffix checks quadratic:
    ~1 ms per token here before (every row, every token, on the engine thread); the
    incremental matcher is amortized O(1) per character and stop it touches."""
    from fx_engine.engine.stops import StopMatcher

    m = StopMatcher(["a" * 1023 + "b"] + ["a" + "b" * 1023] * 63)
    t0 = time.perf_counter()
    out = "".join(m.feed("aaaa") for _ in range(2000))
    assert time.perf_counter() - t0 < 2.0  # 8,000 characters; the old code took ~50 s
    assert not m.stopped and out == "a" * (8000 - 1023)  # the possible start is held back


# ------------------------------------------------------------------------ 4. tenants


@pytest.fixture(scope="module")
def keyed_server(tiny):
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=64)
    app = create_app(engine, "tiny", api_key=["key-a", "key-b"], defaults={"max_tokens": 4})
    with serve(app, engine) as (url, port):
        yield {"url": url, "port": port, "app": app}


def _cached(url: str, key: str, prompt: str, **extra) -> int:
    r = httpx.post(url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {key}"},
                   json={"prompt": prompt, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_two_api_keys_never_share_a_cache_entry(keyed_server):
    url = keyed_server["url"]
    secret = "System: the PIN is 4821. Never tell it. " * 3 + "User: "
    assert _cached(url, "key-a", secret + "hello") == 0
    assert _cached(url, "key-a", secret + "hi") > 20  # the tenant's own prefix is reused
    # another tenant learns nothing from the cache, not even with the same prompt ...
    assert _cached(url, "key-b", secret + "hello") == 0
    assert _cached(url, "key-b", secret + "howdy") > 20  # ... but reuses its own
    # a cache_salt narrows the scope further, within one key
    assert _cached(url, "key-a", secret + "yo", cache_salt="conversation-1") == 0
    assert _cached(url, "key-a", secret + "ya", cache_salt="conversation-1") > 20
    assert _cached(url, "key-a", secret + "ye", cache_salt="conversation-2") == 0
    assert _cached(url, "key-a", "hi", cache_salt="s" * 1024) == 0  # the longest salt


def test_salts_scope_the_disk_tier_too(tiny, tmp_path):
    _, model = tiny
    prompt = LONG_TEXT[:120]
    e1 = fx_engine.Engine(model, prefill_chunk=64, prefix_cache_dir=str(tmp_path))
    e1.submit(prompt, max_tokens=2, cache_salt="alice").result()
    e1.close()
    e2 = fx_engine.Engine(model, prefill_chunk=64, prefix_cache_dir=str(tmp_path))  # a new process
    assert e2.submit(prompt + " more", max_tokens=2).result().usage.cached_tokens == 0
    assert e2.submit(prompt + " more", max_tokens=2, cache_salt="bob").result().usage.cached_tokens == 0
    assert e2.submit(prompt + " more", max_tokens=2, cache_salt="alice").result().usage.cached_tokens > 20
    e2.close()
    assert not any("alice" in f.read_text() for f in tmp_path.glob("*.json"))  # digests only


# ------------------------------------------------------------------------ 5. authentication


def test_every_route_but_health_needs_a_key(keyed_server):
    url, app = keyed_server["url"], keyed_server["app"]
    routes = {r.path: sorted(r.methods - {"HEAD"}) for r in app.routes if hasattr(r, "methods")}
    assert {"/metrics", "/docs", "/openapi.json", "/redoc", "/v1/models"} <= set(routes)
    for path, methods in routes.items():
        for method in methods:
            r = httpx.request(method, url + path, json={} if method == "POST" else None)
            if path == "/health":
                assert r.status_code == 200
                assert httpx.head(url + path).status_code == 200  # load balancers' probe
                continue
            if path == "/":  # the web chat page (server/webchat.py): static, it asks for the key
                assert r.status_code == 200 and httpx.head(url + path).status_code == 200
                continue
            assert r.status_code == 401, (method, path, r.status_code)
            assert r.json()["error"]["type"] == "authentication_error"
            wrong = httpx.request(method, url + path, headers={"Authorization": "Bearer nope"},
                                  json={} if method == "POST" else None)
            assert wrong.status_code == 401
            ok = httpx.request(method, url + path, headers={"Authorization": "Bearer key-b"},
                               json={} if method == "POST" else None)
            assert ok.status_code != 401, (method, path)
    assert httpx.get(url + "/v1/models", headers={"x-api-key": "key-a"}).status_code == 200
    assert httpx.get(url + "/nowhere").status_code == 401  # unknown paths tell nothing either


def test_errors_are_openai_shaped_json(open_server):
    url = open_server["url"]
    for r, status in ((httpx.get(url + "/nowhere"), 404),
                      (httpx.get(url + "/v1/completions"), 405),
                      (httpx.post(url + "/v1/completions", content=b"\xff\xfe{", timeout=30), 400)):
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # curl -d '{...}' labels JSON as a form: it is read as the JSON it is
    r = httpx.post(url + "/v1/completions", content=b'{"prompt": "hi", "max_tokens": 2}',
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", '
                             '"text": "\\udfff"}]}]}', "messages"),
    ("/v1/completions", '{"prompt": "a\\udc80b"}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud83d"]}', "stop"),
])
def test_lone_surrogates_are_a_400(open_server, path, body, param):
    r = httpx.post(open_server["url"] + path, content=body.encode(), timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"]
    ok = httpx.post(open_server["url"] + "/v1/completions", json={"prompt": "hi \U0001F600", "max_tokens": 2})
    assert ok.status_code == 200


# ------------------------------------------------------------------------ 6. delivery channels


def test_a_closed_event_loop_ends_only_its_own_request(tiny):
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=8, prefill_chunk=64).start()
    try:
        others = [engine.submit(f"Story number {i}:", max_tokens=300, temperature=0.7, seed=i)
                  for i in range(3)]
        victim = engine.submit("Once upon a time", max_tokens=1000, temperature=0.7, seed=9)

        def consume_then_close():
            loop = asyncio.new_event_loop()
            agen = victim.aiter()
            loop.run_until_complete(agen.__anext__())  # its first delta arrived...
            loop.close()  # ... then the caller's loop is gone, mid-stream

        t = threading.Thread(target=consume_then_close)
        t.start()
        t.join(timeout=60)
        for h in others:
            out = h.result(timeout=120)
            assert out.finish_reason in ("length", "stop") and out.token_ids
        deadline = time.time() + 30
        while not victim.done and time.time() < deadline:
            time.sleep(0.05)
        assert victim.done and victim.cancelled  # freed, not failed, not left running
        assert engine.submit("hi", max_tokens=2).result(timeout=60).finish_reason == "length"
    finally:
        engine.close(wait=False)


# ------------------------------------------------------------------------ 7. engine-side work (issue 40)


def test_an_embeddings_client_that_leaves_frees_the_engine(tiny):
    """/v1/embeddings runs one bounded call per engine step; a client that gives up
    cancels the rest (before: the whole request ran on the engine thread to its end)."""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=16)  # 16-token embedding calls
    app = create_app(engine, "tiny")
    body = {"input": [[(7 * i + j) % 300 + 3 for j in range(2000)] for i in range(64)]}
    with serve(app, engine) as (url, _):
        with pytest.raises(httpx.TimeoutException):  # ~8,000 calls of work
            httpx.post(url + "/v1/embeddings", json=body, timeout=1.0)
        deadline = time.time() + 60
        while engine.stats()["jobs"] and time.time() < deadline:
            time.sleep(0.05)
        assert engine.stats()["jobs"] == 0
        assert any(e["kind"] == "job_cancelled" for e in engine.trace_events)
        assert sum(e["kind"] == "job_step" for e in engine.trace_events) < 64 * 2000 // 16
        r = httpx.post(url + "/v1/embeddings", json={"input": "still serving"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 64


_FORK_CHILD = r"""
import os, sys
import fx_engine
from fx_engine.engine.engine import EngineForked

model = fx_engine.load(sys.argv[1])
engine = fx_engine.Engine(model, max_rows=2)
engine.start()
assert engine.submit("hi", max_tokens=2).result(timeout=60).token_ids
waiting = engine.submit("a handle made before the fork", max_tokens=500)
pid = os.fork()
if pid == 0:
    codes = []
    for use in (lambda: engine.submit("hello", max_tokens=2),
                lambda: waiting.result(timeout=30)):
        try:
            use()
            codes.append("no error")
        except EngineForked as e:
            codes.append("forked" if "fork" in str(e) else str(e))
        except Exception as e:
            codes.append(repr(e))
    print("child:", codes, flush=True)
    sys.exit(0 if codes == ["forked", "forked"] else 1)  # (exit handlers must not hang)
_, status = os.waitpid(pid, 0)
assert engine.submit("still works", max_tokens=2).result(timeout=60).token_ids
engine.close()
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_an_engine_used_in_a_forked_child_raises_instead_of_hanging(tiny):
    """Submitting to, or waiting on, an Engine of the parent process in a fork()ed child is
    an EngineForked error (before: a hang); the child exits, the parent's engine serves on."""
    path, _ = tiny
    proc = subprocess.Popen([sys.executable, "-c", _FORK_CHILD, str(path)], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the parent and its hung child
        out, err = proc.communicate()
        pytest.fail(f"the forked child hung: {out}")
    assert proc.returncode == 0, out + err[-3000:]
    assert "child: ['forked', 'forked']" in out


# ------------------------------------------------------------------------ 7. connections
# (served as `fx-engine serve` serves: server/connections.py's limits)


def _closed_within(s: socket.socket, timeout: float) -> tuple[bool, bytes]:
    """Whether the server closed `s` within `timeout` seconds, and what it sent first."""
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return True, data
            data += chunk
    except ConnectionResetError:
        return True, data
    except socket.timeout:
        return False, data


@pytest.mark.slow
def test_idle_and_slow_header_connections_are_closed(tiny):
    """A socket that sends nothing, one that sends a request head a line at a time
    (slowloris) and an idle keep-alive one are closed within the timeouts; /health is
    answered meanwhile. (Plain uvicorn held all of them for good.)"""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=64)
    app = create_app(engine, "tiny")
    with serve(app, engine, header_timeout=1.5, timeout_keep_alive=1) as (url, port):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for s in slow:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        kept = socket.create_connection(("127.0.0.1", port))
        kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(kept)[0] == 200
        t0 = time.monotonic()
        for _ in range(4):  # a header line every 0.5 s: each byte resets no deadline
            time.sleep(0.5)
            for s in slow:
                with contextlib.suppress(OSError):
                    s.sendall(b"X-Slow: 1\r\n")
            assert httpx.get(url + "/health", timeout=5).status_code == 200
        try:
            for s in idle + slow + [kept]:
                closed, data = _closed_within(s, max(0.1, t0 + 20 - time.monotonic()))
                assert closed, "a connection is still open after 20 s"
                if s in slow:  # part of a head came: told why before the close
                    assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data, data
        finally:
            for s in idle + slow + [kept]:
                s.close()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
@pytest.mark.slow
def test_a_body_that_never_arrives_is_a_408_and_the_connection_closes(tiny, path):
    """A whole head, then a body that stalls (one byte of 1,000, or none): the body has
    its own deadline (body_timeout), on any server, or such sockets would hold their
    connections (and --max-connections slots) forever."""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=64)
    app = create_app(engine, "tiny", body_timeout=1.0)
    with serve(app, engine) as (url, port):
        socks = []
        for part in (b"", b"{"):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 1000\r\n\r\n%s" % (path.encode(), part))
            socks.append(s)
        try:
            for s in socks:
                s.settimeout(20)
                status, err = _response(s)
                assert status == 408, err
                message = err["error"]["message"]
                assert "did not arrive within 1 s" in message, err
                assert ("type" in err) == (path == "/v1/messages"), err  # the route's shape
                assert _closed_within(s, 10)[0]
        finally:
            for s in socks:
                s.close()
        assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_connections_beyond_the_limit_get_a_503(tiny):
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=64)
    app = create_app(engine, "tiny")
    with serve(app, engine, max_connections=4) as (url, port):
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            time.sleep(0.2)  # accepted
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            status, err = _response(s)
            s.close()
            assert status == 503 and err["error"]["code"] == "too_many_connections", err
            # a health probe is answered all the same (a full server is not a dead one)
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            status, ok = _response(s)
            s.close()
            assert status == 200 and ok == {"status": "ok"}, ok
        finally:
            for h in held:
                h.close()
        time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200


_STORY = [{"role": "user", "content": "Tell me a long story"}]


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": _STORY, "max_tokens": 1900}),
    ("/v1/messages", {"messages": _STORY, "max_tokens": 1900}),
    ("/v1/responses", {"input": "Tell me a long story", "max_output_tokens": 1900}),
])
@pytest.mark.slow
def test_streams_that_are_never_read_are_cut_off_however_much_the_kernel_buffers(tiny, path, body):
    """Clients that start streams and never read: the kernel's socket buffers absorb
    whole generations (~4 MB here), so neither `send` nor the event backlog ever blocks;
    the unread bytes the kernel holds, with nothing read for a second, cut them off, and
    their rows are freed long before max_tokens, while another client is served. On every
    streaming route: the route's event generator must be closed when sending fails (the
    garbage collector would do it only when it happens to run: collection is off here)."""
    _, model = tiny
    engine = fx_engine.Engine(model, max_rows=16, prefill_chunk=64, max_queue=64)
    app = create_app(engine, "tiny", stream_unread_bytes=16 << 10)
    gc.disable()
    with serve(app, engine, header_timeout=30) as (url, port):
        body = json.dumps({**body, "temperature": 0.8, "stream": True}).encode()
        t_start = time.perf_counter()
        idle = [_post_raw(port, path, body, rcvbuf=4096) for _ in range(8)]
        try:
            assert _wait_rows(url, 8, timeout=30) == 8
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
            assert _wait_rows(url, 0, timeout=90) == 0
            retired = [e for e in engine.trace_events if e["kind"] == "retire"
                       and e["t"] > t_start and e["reason"] == "cancelled"]
            assert len(retired) == 8, retired
            assert all(e["generated"] < 1900 for e in retired), retired
            for s in idle:  # the connection is dropped, not left holding its buffers
                assert _closed_within(s, 30)[0]
        finally:
            gc.enable()
            for s in idle:
                s.close()
