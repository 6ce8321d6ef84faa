"""serve's --seed, --repetition-penalty and --stop are the defaults of every API surface
(chat completions, Anthropic messages, Responses): a flag the server accepted is never
ignored by a route whose request format has no such field."""

from __future__ import annotations

import fx_engine


def _client(model, defaults):
    from fastapi.testclient import TestClient

    from fx_engine.server.app import create_app

    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=64, prefix_cache_bytes=0)
    return engine, TestClient(create_app(engine, "tiny", defaults=defaults))


def _texts(tc, route, body):
    out = []
    for _ in range(2):
        r = tc.post(route, json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        out.append(j["content"][0]["text"] if route == "/v1/messages" else j["output"][-1]["content"][0]["text"])
    return out


def test_seed_default_makes_hot_sampling_repeatable_on_every_route(tiny_model):
    engine, tc = _client(tiny_model, {"max_tokens": 12, "temperature": 5.0, "seed": 7})
    engine.start()
    try:
        with tc:
            ask = [{"role": "user", "content": "hi"}]
            a, b = _texts(tc, "/v1/messages", {"model": "tiny", "max_tokens": 12, "messages": ask})
            assert a == b
            a, b = _texts(tc, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 12})
            assert a == b
    finally:
        engine.close()


def test_server_defaults_fill_only_what_the_request_left_unset() -> None:
    from fx_engine.server.protocol import server_defaults

    d = {"seed": 7, "repetition_penalty": 1.3, "stop": ["\n\n"], "temperature": 0.5}
    assert server_defaults({}, d) == {"seed": 7, "repetition_penalty": 1.3, "stop": ["\n\n"]}
    assert server_defaults({"seed": 1, "stop": ["x"]}, d) == {"seed": 1, "stop": ["x"], "repetition_penalty": 1.3}
    assert server_defaults({}, {}) == {}
