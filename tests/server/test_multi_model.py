"""Several models in one server (server/pool.py): two tiny models and the default one behind
one endpoint, routed by the request's `model`; loaded on demand within a memory budget, the
least recently used idle one unloaded; a 503 with Retry-After while the budget is held by a
model serving a request; unloading after --idle-unload; /v1/models and /metrics per model;
and `fx-engine serve --model NAME=PATH ...` building the same pool."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref

import httpx
import pytest

import fx_engine
from fx_engine.server.app import create_app
from fx_engine.server.pool import ModelPool, ModelSpec

from tests.conftest import serve

MSGS = [{"role": "user", "content": "What is the capital of France?"}]
ENGINE = dict(max_rows=4, prefill_chunk=64, prefix_cache_bytes=1 << 20)


@pytest.fixture(scope="module")
def tiny_pair(tiny_folder):
    """Two tiny models of other families and weights: {"a": folder, "b": folder}."""
    return {"a": tiny_folder("llama", seed=1), "b": tiny_folder("qwen3", seed=2)}


def _loader(folder, **extra):
    return lambda: fx_engine.Engine(fx_engine.load(folder), **ENGINE, **extra)


@contextlib.contextmanager
def _served(pool, **kw):
    """A live server for `pool` (its preloaded first engine, if any, started here)."""
    app = create_app(pool, defaults={"max_tokens": 16}, **kw)
    first = pool.default.engine

    class _NoEngine:  # conftest.serve starts and closes an engine: the pool owns them
        def start(self):
            if first is not None:
                first.start()

        def close(self, wait=True):
            pool.close()

    with serve(app, _NoEngine()) as (url, _):
        yield url


def _chat(url, model, max_tokens=8, **kw):
    body = {"messages": MSGS, "max_tokens": max_tokens, "temperature": 0, **kw}
    if model is not None:
        body["model"] = model
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


PROMPT = "The capital of France is"


def _want(model):
    """A model's own greedy continuation of PROMPT: (text, rounded logprobs)."""
    out = fx_engine.generate(model, PROMPT, max_tokens=6, temperature=0.0, logprobs=1)
    return out.text, [round(lp.logprob, 3) for lp in out.logprobs]


def _out(url, model):
    """What the server answers for PROMPT (greedy, as `_want`)."""
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 1}
    if model is not None:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["text"], [round(x, 3) for x in c["logprobs"]["token_logprobs"]]


def _status(url):
    return {m["id"]: m["status"] for m in httpx.get(url + "/v1/models").json()["data"]}


def _metric(url, name, model):
    text = httpx.get(url + "/metrics").text
    line = next(ln for ln in text.splitlines() if ln.startswith(f'{name}{{model="{model}"}} '))
    return float(line.split()[-1])


def test_routes_by_model_to_each_models_own_output(default_model, tiny_pair):
    """The default model (loaded first, the answer to requests naming none) and two tiny
    ones loaded on first use: each request gets its own model's greedy output."""
    want = {name: _want(fx_engine.load(folder)) for name, folder in tiny_pair.items()}
    want["smollm2"] = _want(default_model)
    assert len({str(w) for w in want.values()}) == 3  # (the models differ)
    chat_want = fx_engine.generate(default_model, MSGS, max_tokens=8, temperature=0.0).text
    pool = ModelPool([ModelSpec("smollm2", engine=fx_engine.Engine(default_model, **ENGINE)),
                      ModelSpec("a", load=_loader(tiny_pair["a"]), path=str(tiny_pair["a"])),
                      ModelSpec("b", load=_loader(tiny_pair["b"]), path=str(tiny_pair["b"]))])
    with _served(pool) as url:
        assert _status(url) == {"smollm2": "loaded", "a": "unloaded", "b": "unloaded"}
        assert _out(url, None) == want["smollm2"]
        assert _out(url, "a") == want["a"]
        assert _out(url, "b") == want["b"]
        assert _out(url, "smollm2") == want["smollm2"]
        assert _chat(url, None).json()["choices"][0]["message"]["content"] == chat_want
        r = _chat(url, "a").json()
        assert r["model"] == "a" and r["choices"][0]["finish_reason"] in ("stop", "length")
        # the folder's path routes too; streamed alike
        stream = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": str(tiny_pair["b"]), "messages": MSGS, "max_tokens": 8, "temperature": 0,
            "stream": True}).text
        assert '"model": "b"' in stream and stream.rstrip().endswith("data: [DONE]")
        assert _status(url) == {"smollm2": "loaded", "a": "loaded", "b": "loaded"}
        one = httpx.get(url + "/v1/models/b").json()
        assert one["id"] == "b" and one["status"] == "loaded"
        # an unknown name: 404 naming what is served; Anthropic's route: the first model
        bad = _chat(url, "gpt-4")
        assert bad.status_code == 404
        err = bad.json()["error"]
        assert err["code"] == "model_not_found" and all(f"'{m}'" in err["message"] for m in ("smollm2", "a", "b"))
        assert httpx.get(url + "/v1/models/gpt-4").status_code == 404
        msg = httpx.post(url + "/v1/messages", timeout=60, json={
            "model": "claude-sonnet-4-5", "max_tokens": 8, "messages": MSGS}).json()
        assert msg["content"][0]["text"] == chat_want
        # /metrics: each model's samples under its label
        assert _metric(url, "fx_requests_total", "a") == 2
        assert _metric(url, "fx_requests_total", "b") == 2
        assert _metric(url, "fx_requests_total", "smollm2") == 4
        assert _metric(url, "fx_model_loaded", "b") == 1
        assert _metric(url, "fx_running_rows", "a") == 0


def test_budget_for_one_model_unloads_the_least_recent_and_503s_while_busy(tiny_pair):
    """A budget that holds one tiny model at a time: alternating requests load one and
    unload the other; a request for the other while one is generating gets a 503 with
    Retry-After (nothing loaded past the budget), and is served once that one is done."""
    sizer = ModelPool([ModelSpec(n, engine=fx_engine.Engine(fx_engine.load(f), **ENGINE))
                       for n, f in tiny_pair.items()])
    sizes = [sizer.model_bytes(n) for n in tiny_pair]
    sizer.close()
    budget = int(max(sizes) * 1.5)
    assert budget < sum(sizes)
    gate = threading.Event()
    gate.set()
    hook = lambda stage, handle: gate.wait(30)  # noqa: E731 - holds b's engine mid-request
    pool = ModelPool([ModelSpec("a", load=_loader(tiny_pair["a"]), path=str(tiny_pair["a"])),
                      ModelSpec("b", load=_loader(tiny_pair["b"], fault_hook=hook), path=str(tiny_pair["b"]))],
                     memory_budget=budget)
    with _served(pool) as url:
        want_a, want_b = (_want(fx_engine.load(tiny_pair[n])) for n in "ab")
        assert _out(url, "a") == want_a
        assert _status(url) == {"a": "loaded", "b": "unloaded"}
        assert _out(url, "b") == want_b
        assert _status(url) == {"a": "unloaded", "b": "loaded"}  # a: least recently used
        assert _out(url, "a") == want_a
        assert _status(url) == {"a": "loaded", "b": "unloaded"}
        assert _out(url, "b") == want_b
        assert pool.resident_bytes() <= budget
        # b busy (its engine held inside a request): a cannot be loaded
        gate.clear()
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("r", _chat(url, "b", max_tokens=4)))
        t.start()
        deadline = time.time() + 30
        while _metric(url, "fx_running_rows", "b") + _metric(url, "fx_queued_requests", "b") == 0:
            assert time.time() < deadline
            time.sleep(0.05)
        busy = _chat(url, "a")
        assert busy.status_code == 503 and int(busy.headers["Retry-After"]) > 0
        assert busy.json()["error"]["code"] == "insufficient_memory"
        assert _status(url) == {"a": "unloaded", "b": "loaded"}
        gate.set()
        t.join(60)
        assert out["r"].status_code == 200
        assert _out(url, "a") == want_a
        assert _metric(url, "fx_model_rejected_total", "a") == 1
        assert _metric(url, "fx_model_loads_total", "a") == 3
        assert _metric(url, "fx_model_unloads_total", "b") == 2
        assert f"fx_memory_budget_bytes {budget}" in httpx.get(url + "/metrics").text


def test_idle_unload_and_reload(tiny_pair):
    pool = ModelPool([ModelSpec("a", load=_loader(tiny_pair["a"]), path=str(tiny_pair["a"]))],
                     idle_unload=0.5)
    with _served(pool) as url:
        first = _out(url, "a")
        assert _status(url) == {"a": "loaded"}
        engine = weakref.ref(pool.entries[0].engine)
        model = weakref.ref(pool.entries[0].engine.model.params)
        deadline = time.time() + 20
        while _status(url)["a"] != "unloaded":
            assert time.time() < deadline, "not unloaded after --idle-unload"
            time.sleep(0.1)
        assert _metric(url, "fx_model_unloads_total", "a") == 1
        gc.collect()
        assert engine() is None and model() is None  # nothing holds the engine or the weights
        assert _out(url, None) == first  # reloaded
        assert _metric(url, "fx_model_loads_total", "a") == 2
        assert _metric(url, "fx_requests_total", "a") == 2  # counters carry over


def test_a_model_larger_than_the_budget_is_refused(tiny_pair):
    pool = ModelPool([ModelSpec("a", load=_loader(tiny_pair["a"]), path=str(tiny_pair["a"]))],
                     memory_budget=1024)
    with _served(pool) as url:
        r = _chat(url, "a")
        assert r.status_code == 503 and r.json()["error"]["code"] == "insufficient_memory"
        assert "memory budget" in r.json()["error"]["message"]
        assert _status(url) == {"a": "unloaded"}


def test_serve_cli_builds_the_pool(tiny_pair):
    """`fx-engine serve --model a=PATH --model PATH2 --memory-budget GB --idle-unload S`:
    the first model loaded as serve loads one, the others named and loaded on demand."""
    from fx_engine.cli import _serve_engine, _serve_pool, _served_models, build_parser

    a = build_parser().parse_args(["serve", "--model", f"first={tiny_pair['a']}", "--model",
                                   str(tiny_pair["b"]), "--memory-budget", "2", "--idle-unload", "60",
                                   "--prompt-cache-bytes", str(1 << 20)])
    served = _served_models(a)
    assert served == [("first", str(tiny_pair["a"])), (None, str(tiny_pair["b"]))]
    _, engine, own = _serve_engine(a, served, 0)
    pool = _serve_pool(a, served, "first", engine, own)
    try:
        assert [e.name for e in pool.entries] == ["first", tiny_pair["b"].name]
        assert [e.state for e in pool.entries] == ["loaded", "unloaded"]
        assert pool.budget == 2 << 30 and pool.idle_unload == 60
        eng, _ = pool.entries[1].spec.load()  # as serve would load it
        assert eng.max_rows == a.decode_concurrency
        eng.close()
    finally:
        pool.close()
    one = build_parser().parse_args(["serve", "--model", str(tiny_pair["a"])])
    assert _served_models(one) == [(None, str(tiny_pair["a"]))]
    assert _served_models(build_parser().parse_args(["serve"])) == [(None, None)]


def test_serve_runs_with_several_models(tiny_pair, monkeypatch):
    """`fx-engine serve` with two --model entries up to the HTTP server (which returns at
    once here): the app it would serve routes over the pool; the pool closed after."""
    import uvicorn

    from fx_engine.cli import build_parser, cmd_serve, main

    seen = {}

    def run(self, sockets=None):
        seen["app"] = self.config.app
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", run)
    assert main(["serve", "--model", f"a={tiny_pair['a']}", "--model", f"b={tiny_pair['b']}",
                 "--prompt-cache-bytes", str(1 << 20)]) == 0
    pool = seen["app"].state.pool
    assert [(e.name, e.state) for e in pool.entries] == [("a", "unloaded"), ("b", "unloaded")]  # closed
    assert pool.entries[0].loads == 0 and pool.budget > 0
    with pytest.raises(ValueError, match="--model-id"):  # (before any load)
        cmd_serve(build_parser().parse_args(["serve", "--model", f"a={tiny_pair['a']}", "--model",
                                             f"b={tiny_pair['b']}", "--model-id", "x"]))
