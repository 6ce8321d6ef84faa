"""`fx-engine serve --max-kv-size N` (issue 44): every route holds requests to the capped
context (the OpenAI routes' 400 in OpenAI's and vLLM's words, code context_length_exceeded;
/tokenize's max_model_len; /v1/models; Anthropic's clamp and "prompt is too long";
Responses; embeddings), and `serve` logs a line once it is ready for requests."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import fx_engine
from fx_engine.engine.request import ContextLengthExceeded
from tests.conftest import LONG_TEXT

CAP = 64


def _start_serve(argv: list[str], timeout: float = 240.0):
    """`python -m fx_engine serve ARGV --port 0` in a process of its own: (process, url, the
    stderr lines so far, a list the reader thread keeps filling), once its ready line came."""
    env = {**os.environ, "FX_ENGINE_OFFLINE": "1", "FX_ENGINE_PROGRESS": "0"}
    p = subprocess.Popen([sys.executable, "-m", "fx_engine", "serve", "--port", "0", *argv],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []

    def read() -> None:
        for line in p.stderr:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            m = re.search(r"fx-engine ready: serving (.+) at (http://\S+)$", line.strip())
            if m:
                return p, m.group(2), lines
        if p.poll() is not None:
            time.sleep(0.2)  # the reader's last lines
            pytest.fail(f"serve exited ({p.returncode}) before it was ready:\n{''.join(lines)[-3000:]}")
        time.sleep(0.05)
    p.kill()
    pytest.fail(f"no ready line in {timeout:.0f} s:\n{''.join(lines)[-3000:]}")


def _stop(p: subprocess.Popen) -> int:
    p.send_signal(signal.SIGTERM)
    try:
        return p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        return p.wait()


def _context_error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "context_length_exceeded", err
    assert err["param"] == param, err
    # OpenAI's and vLLM's wording, which LiteLLM and LangChain look for
    assert err["message"].startswith(f"This model's maximum context length is {CAP} tokens"), err
    assert "--max-kv-size" in err["message"] and "the model's own is 2048" in err["message"], err
    return err["message"]


def test_serve_logs_ready_and_holds_every_route_to_max_kv_size(tiny_dir):
    # (--temp/--seed: serve's request defaults, checked below; no prefix cache, so that two
    # requests compute alike)
    p, url, lines = _start_serve(["--model", str(tiny_dir), "--max-kv-size", str(CAP),
                                  "--model-id", "tiny", "--temp", "5.0", "--seed", "7",
                                  "--prompt-cache-bytes", "0"])
    try:
        log = "".join(lines)
        # the ready line comes after the model was loaded and warmed, and names the real port
        assert log.index("warm-up and compile") < log.index("fx-engine ready: serving tiny at")
        assert re.search(rf"context {CAP} tokens \(--max-kv-size\)", log), log
        assert not url.endswith(":0")
        with httpx.Client(base_url=url, timeout=120) as c:
            [listed] = c.get("/v1/models").json()["data"]
            assert listed["id"] == "tiny" and listed["max_model_len"] == CAP
            # which numerics serve chose (--numerics auto): listed and in the start-up line
            assert listed["numerics"] in ("exact", "int8") and f"{listed['numerics']} numerics" in log
            assert c.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == CAP
            assert c.get("/tokenizer_info").json()["model_max_length"] == CAP

            # within the cap: served; no max_tokens: the server's default (512) trimmed to
            # the room the prompt leaves, as vLLM does
            ask = [{"role": "user", "content": "hi"}]
            r = c.post("/v1/chat/completions", json={"messages": ask})
            assert r.status_code == 200, r.text
            u = r.json()["usage"]
            assert u["total_tokens"] <= CAP + 1 and u["completion_tokens"] >= 1, u
            r = c.post("/v1/chat/completions", json={"messages": ask, "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3, r.text
            r = c.post("/v1/completions", json={"prompt": "hello"})
            assert r.status_code == 200, r.text
            # serve --seed is the default of a request that gives none: the same sample again
            again = c.post("/v1/completions", json={"prompt": "hello"})
            assert again.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]

            # beyond it: 400s naming the limit
            long = [{"role": "user", "content": LONG_TEXT}]
            msg = _context_error(c.post("/v1/chat/completions", json={"messages": long}), "messages")
            assert "However, your messages resulted in" in msg and "completion" not in msg
            n = len(c.post("/tokenize", json={"prompt": "hello"}).json()["tokens"])
            msg = _context_error(c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 100}),
                                 "prompt")
            assert f"you requested {n + 100} tokens ({n} in the prompt, 100 in the completion)" in msg
            _context_error(c.post("/v1/responses", json={"input": LONG_TEXT}), "input")
            r = c.post("/v1/embeddings", json={"input": LONG_TEXT})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert f"exceed the context size of {CAP} tokens" in r.json()["error"]["message"]
            assert c.post("/v1/embeddings", json={"input": "hello"}).status_code == 200
    finally:
        code = _stop(p)
    assert code == 0, "".join(lines)[-3000:]


def _capped_client(model, cap):
    from fastapi.testclient import TestClient

    from fx_engine.server.app import create_app

    engine = fx_engine.Engine(model.with_max_context(cap), max_rows=2, prefill_chunk=64)
    return engine, TestClient(create_app(engine, "tiny", defaults={"max_tokens": 512}))


def test_anthropic_and_responses_routes_use_the_cap(tiny_model):
    engine, tc = _capped_client(tiny_model, CAP)
    engine.start()
    try:
        with tc:
            ask = [{"role": "user", "content": "hi"}]
            prompt = tc.post("/v1/messages/count_tokens", json={"model": "x", "messages": ask}
                             ).json()["input_tokens"]
            r = tc.post("/v1/messages", json={"model": "claude-x", "max_tokens": 32000, "messages": ask})
            assert r.status_code == 200, r.text
            # clamped to the capped context's room (the model's own is 2048)
            assert r.json()["usage"]["output_tokens"] <= CAP + 1 - prompt
            r = tc.post("/v1/messages", json={"model": "claude-x", "max_tokens": 8,
                                              "messages": [{"role": "user", "content": LONG_TEXT}]})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            # Anthropic's own words (Claude Code compacts on "prompt is too long")
            assert err["type"] == "invalid_request_error"
            assert re.match(rf"prompt is too long: \d+ tokens > {CAP} maximum", err["message"]), err

            r = tc.post("/v1/responses", json={"input": "hi"})  # no max_output_tokens: trimmed
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["total_tokens"] <= CAP + 1
            r = tc.post("/v1/responses", json={"input": "hi", "max_output_tokens": 500})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    finally:
        engine.close()


def test_embed_honours_the_cap(tiny_model):
    ids = list(range(5, 25))  # 20 tokens
    capped = tiny_model.with_max_context(16)
    with pytest.raises(ContextLengthExceeded,
                       match=r"input\[0\]: 20 tokens exceed the context size of 16 tokens"):
        fx_engine.embed(capped, [ids])
    assert isinstance(ContextLengthExceeded("x"), ValueError)  # callers catching ValueError still do
    # at the cap, and uncapped, the same input embeds as before
    assert fx_engine.embed(capped, [ids[:16]]).shape == (1, tiny_model.config.hidden_size)
    np.testing.assert_allclose(fx_engine.embed(capped, [ids[:16]]), fx_engine.embed(tiny_model, [ids[:16]]))
    assert fx_engine.embed(tiny_model, [ids]).shape[0] == 1


@pytest.mark.parametrize("flag", ["--max-kv-size", "--ctx-size", "-c"])
def test_serve_takes_the_context_flags(flag):
    from fx_engine.cli import build_parser

    a = build_parser().parse_args(["serve", flag, "128"])
    assert a.max_kv_size == 128 and a.no_warmup is False


def test_a_bad_serve_context_size_is_named_before_the_model_loads(monkeypatch, capsys):
    import fx_engine.cli as cli

    monkeypatch.setattr(cli, "_load", lambda a: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "--max-kv-size", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --max-kv-size/--ctx-size/-c: expected an integer >= 1" in err, err
