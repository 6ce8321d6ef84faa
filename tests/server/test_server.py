"""The OpenAI-compatible server, end to end on 127.0.0.1: the official `openai` client and
raw HTTP (httpx) against a live uvicorn server started by the tests."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import LONG_TEXT, serve


@pytest.fixture(scope="module")
def server(tiny_folder):
    model = fx_engine.load(tiny_folder())
    engine = fx_engine.Engine(model, max_rows=16, prefill_chunk=64)
    app = create_app(engine, "tiny", defaults={"max_tokens": 32})
    with serve(app, engine) as (url, _):
        yield {"url": url, "model": model, "engine": engine}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="none")


MSGS = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_non_streaming_equals_generate(server, client):
    r = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=12, temperature=0)
    want = fx_engine.generate(server["model"], MSGS, max_tokens=12, temperature=0.0)
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.prompt_tokens == want.usage.prompt_tokens
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


def test_chat_streaming_concatenates_to_the_same_text(server, client):
    want = fx_engine.generate(server["model"], MSGS, max_tokens=12, temperature=0.0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MSGS, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == want.finish_reason


def test_completions_logprobs_stop_seed(server, client):
    prompt = LONG_TEXT[:60]
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=2)
    want = fx_engine.generate(server["model"], prompt, max_tokens=8, temperature=0.0, logprobs=2)
    assert r.choices[0].text == want.text
    assert r.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs])
    s1 = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=4)
    s2 = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0.9, seed=4)
    assert s1.choices[0].text == s2.choices[0].text
    stop = want.text[2:4] if len(want.text) > 4 else None
    if stop:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0, stop=[stop])
        assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    lp = client.chat.completions.create(model="tiny", messages=MSGS, max_tokens=4, temperature=0,
                                        logprobs=True, top_logprobs=3)
    assert len(lp.choices[0].logprobs.content[0].top_logprobs) == 3


def test_sixteen_concurrent_streams_equal_generate(server, client):
    prompts = [[{"role": "user", "content": f"Tell me about number {i}."}] for i in range(16)]
    want = [fx_engine.generate(server["model"], p, max_tokens=10, temperature=0.0).text for p in prompts]
    got = [None] * 16

    def run(i):
        chunks = client.chat.completions.create(model="tiny", messages=prompts[i], max_tokens=10,
                                                temperature=0, stream=True)
        got[i] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert got == want


def test_models_health_metrics(server):
    with httpx.Client(base_url=server["url"]) as h:
        assert h.get("/health").json() == {"status": "ok"}
        assert h.get("/v1/models").json()["data"][0]["id"] == "tiny"
        m = h.get("/metrics").text
        assert "fx_requests_total" in m and "fx_running_rows 0" in m
        assert "fx_time_to_first_token_seconds_bucket" in m


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 2}, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, None),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": "hello"}, "messages"),
])
def test_bad_requests_are_400_json(server, body, param):
    with httpx.Client(base_url=server["url"]) as h:
        r = h.post("/v1/chat/completions", json={"model": "tiny", **body})
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["message"]
        if param:
            assert param in err["message"]
        r = h.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()


def test_sse_framing_and_disconnects_free_rows(server):
    body = {"model": "tiny", "messages": MSGS, "max_tokens": 32, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server["url"], timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [ln for ln in r.iter_lines() if ln]
        assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
        json.loads(lines[0][6:])
        # A bounded load test: 32 concurrent streaming clients (16 rows), 8 of them
        # disconnect after their first chunk; the 24 others complete with generate's text.
        long_body = {**body, "max_tokens": 2000}
        prompts = [[{"role": "user", "content": f"Count to {i}."}] for i in range(24)]
        want = [fx_engine.generate(server["model"], p, max_tokens=12, temperature=0.0).text
                for p in prompts]
        got = [None] * 24

        def quitter():
            with httpx.Client(base_url=server["url"], timeout=60) as c:
                with c.stream("POST", "/v1/chat/completions", json=long_body) as r:
                    for ln in r.iter_lines():
                        if ln:
                            break

        def finisher(i):
            b = {**body, "messages": prompts[i], "max_tokens": 12}
            with httpx.Client(base_url=server["url"], timeout=120) as c:
                with c.stream("POST", "/v1/chat/completions", json=b) as r:
                    text = ""
                    for ln in r.iter_lines():
                        if ln.startswith("data: {"):
                            ch = json.loads(ln[6:])["choices"]
                            text += (ch[0]["delta"].get("content") or "") if ch else ""
                    got[i] = text

        ts = [threading.Thread(target=quitter) for _ in range(8)]
        ts += [threading.Thread(target=finisher, args=(i,)) for i in range(24)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert got == want
        deadline = time.time() + 30
        while time.time() < deadline:
            if "fx_running_rows 0" in h.get("/metrics").text:
                break
            time.sleep(0.2)
        assert "fx_running_rows 0" in h.get("/metrics").text
        assert h.get("/health").status_code == 200


def test_api_key(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = fx_engine.Engine(model, max_rows=1)
    app = create_app(engine, "tiny", api_key="sekret")
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 200


_ANY = __import__("hypothesis").strategies


def _value():
    st = _ANY
    return st.one_of(st.none(), st.booleans(), st.integers(-5, 5000),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
                     st.lists(st.integers(-2, 500), max_size=4),
                     st.dictionaries(st.text(max_size=4), st.floats(-200, 200), max_size=2))


_FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
           "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
           "logit_bias", "seed", "stop", "stream", "n", "logprobs", "top_logprobs",
           "xtc_probability", "xtc_threshold", "stream_options"]


@__import__("hypothesis").settings(max_examples=60, deadline=None,
                                   suppress_health_check=list(__import__("hypothesis").HealthCheck))
@__import__("hypothesis").given(
    fields=_ANY.dictionaries(_ANY.sampled_from(_FIELDS), _value(), max_size=5),
    messages=_ANY.one_of(_value(), _ANY.just([{"role": "user", "content": "hi"}])),
    endpoint=_ANY.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
@pytest.mark.slow
def test_fuzzed_requests_never_500(server, fields, messages, endpoint):
    """Random (mostly invalid) request bodies: always a 2xx or a 4xx with a JSON error."""
    body = dict(fields)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 64:
        body["max_tokens"] = 64  # keep valid requests short
    body.pop("max_completion_tokens", None) if isinstance(body.get("max_completion_tokens"), int) and body["max_completion_tokens"] > 64 else None
    if isinstance(body.get("n"), int) and body["n"] > 2:
        body["n"] = 2
    body["messages" if "chat" in endpoint else "prompt"] = messages if "chat" in endpoint else (
        messages if messages is not None else "hi")
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        r = h.post(endpoint, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert "error" in r.json()


def test_chat_template_override(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = fx_engine.Engine(model, max_rows=1)
    tmpl = "{% for m in messages %}[{{ m['role'] }}|{{ shout }}] {{ m['content'] }}\n{% endfor %}"
    app = create_app(engine, "tiny", chat_template=tmpl, chat_template_args={"shout": "HEY"})
    with engine, TestClient(app) as c:  # the engine runs in its background thread
        r = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    ids = model.tokenizer.encode("[user|HEY] What is the capital of France?\n")
    assert r.json()["usage"]["prompt_tokens"] == len(ids)
    want = fx_engine.generate(model, ids, max_tokens=3, temperature=0.0)
    assert r.json()["choices"][0]["message"]["content"] == want.text


def _openapi_strategy(doc: dict, path: str):
    """Request bodies valid by the server's own OpenAPI document, with generation lengths
    capped so that an accepted request stays short."""
    import copy

    from tests.openapi_strategy import from_schema

    doc = copy.deepcopy(doc)
    for schema in doc["components"]["schemas"].values():
        props = schema.get("properties", {})
        for name, cap in (("max_tokens", 8), ("max_completion_tokens", 8)):
            if name in props:
                props[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": cap}, {"type": "null"}]}
        if "n" in props:
            props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
    body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return from_schema(body, doc)


def test_openapi_document_describes_both_endpoints(server):
    doc = httpx.get(server["url"] + "/openapi.json").json()
    for path, needed in (("/v1/chat/completions", {"messages", "temperature", "logprobs", "stream"}),
                         ("/v1/completions", {"prompt", "max_tokens", "echo", "stop"})):
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert needed <= set(doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"])


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.slow
def test_schema_fuzz_from_the_openapi_document_never_500(server, path):
    """Every body the OpenAPI document admits (types, ranges, unions, nesting, odd strings and
    floats) gets a 2xx or a 4xx with an OpenAI-style JSON error, never a 500; the server then
    still answers a plain request."""
    from hypothesis import HealthCheck, given, settings

    doc = httpx.get(server["url"] + "/openapi.json").json()
    statuses = []

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck),
              database=None, derandomize=True)
    @given(body=_openapi_strategy(doc, path))
    def run(body):
        with httpx.Client(base_url=server["url"], timeout=120) as h:
            r = h.post(path, json=body)
        statuses.append(r.status_code)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            assert "error" in r.json() and r.json()["error"]["message"]
        elif not body.get("stream"):
            assert r.json()["choices"], r.text

    run()
    assert any(s == 200 for s in statuses), statuses  # the generator reaches the engine
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        ok = h.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200


# ---- issue 40: client fields and routes real SDKs use; /tokenize's bodies


def test_models_retrieve(server, client):
    import openai

    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_served_id_is_the_documented_name_and_the_file_name_is_accepted(default_model):
    """The default model's file is SmolLM2-135M-Instruct.Q4_1.gguf; the docs call it
    SmolLM2-135M-Instruct: that is the id listed, and the file's names are accepted too."""
    from fastapi.testclient import TestClient

    from fx_engine.cli import _model_id
    from fx_engine.loading.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME

    engine = fx_engine.Engine(default_model, max_rows=2, prefill_chunk=64).start()
    try:
        c = TestClient(create_app(engine, _model_id(default_model)))
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [DEFAULT_MODEL_NAME]
        for name in (DEFAULT_MODEL_NAME, DEFAULT_MODEL_FILE, DEFAULT_MODEL_FILE.removesuffix(".gguf")):
            assert c.get(f"/v1/models/{name}").json()["id"] == DEFAULT_MODEL_NAME
            r = c.post("/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == DEFAULT_MODEL_NAME, r.text
    finally:
        engine.close(wait=False)


def test_seed_is_a_signed_64_bit_integer(server):
    """-1 is "random" (llama.cpp's server), other negatives are their 64 bits read
    unsigned (the same draws as that seed), beyond int64 is a 400 naming the field."""
    prompt = LONG_TEXT[:40]
    with httpx.Client(base_url=server["url"], timeout=60) as h:
        def text(seed):
            r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8,
                                                "temperature": 1.0, "seed": seed})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]

        want = fx_engine.generate(server["model"], prompt, max_tokens=8, temperature=1.0,
                                  seed=2**64 - 5).text
        assert text(-5) == want == text(-5)
        assert text(-1) is not None  # accepted: a fresh seed
        for bad in (2**63, -2**63 - 1):
            r = h.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "seed": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("kwargs", [{"tokenize": False}, {"chat_template": "x"}, {"messages": []},
                                    {"add_generation_prompt": False}, {"special_tokens": {}}])
def test_template_kwargs_that_collide_with_the_servers_arguments_are_400_on_both_routes(server, kwargs):
    (name,) = kwargs
    with httpx.Client(base_url=server["url"], timeout=60) as h:
        for path, extra in (("/tokenize", {}), ("/v1/chat/completions", {"max_tokens": 1})):
            r = h.post(path, json={"messages": MSG, "chat_template_kwargs": kwargs, **extra})
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["param"] == f"chat_template_kwargs.{name}", (path, r.text)


@pytest.mark.parametrize("body,param", [
    ({"messages": MSG, "chat_template_kwargs": {"no_such_variable": 1}},  # as on the chat route
     "chat_template_kwargs.no_such_variable"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ({"messages": MSG, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": "hi", "messages": MSG}, "prompt"),
])
def test_malformed_tokenize_bodies_are_400_naming_the_field(server, body, param):
    r = httpx.post(server["url"] + "/tokenize", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_tokenize_token_strs_are_the_vocabulary_tokens(server):
    """vLLM's token_strs: transformers' convert_ids_to_tokens (the vocabulary's tokens,
    e.g. byte-level BPE's 'Ċ' for a newline), not each token decoded on its own."""
    tok = server["model"].tokenizer
    for body in ({"prompt": "Hello\nworld", "add_special_tokens": True},
                 {"messages": [{"role": "user", "content": "Hi\nthere"}]}):
        r = httpx.post(server["url"] + "/tokenize", json={**body, "return_token_strs": True}, timeout=60)
        out = r.json()
        assert out["token_strs"] == [tok.backend.id_to_token(i) for i in out["tokens"]]
