"""The Anthropic Messages API (/v1/messages, its event stream, count_tokens) with the
official `anthropic` SDK over real HTTP on 127.0.0.1 (the default model), and thinking
blocks on a model scripted to think (test_tool_calls.ScriptedEngine).

Oracles: the OpenAI chat route on the same engine (the same prompt must give the same
greedy text), jsonschema for tool inputs and structured output, the tokenizer for counts."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

import fx_engine
from fx_engine.server.app import create_app
from fx_engine.testing import write_tiny_model

from tests.conftest import serve
from tests.server.test_tool_calls import ScriptedEngine

anthropic = pytest.importorskip("anthropic")

ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}]
GREEDY = {"extra_body": {"temperature": 0}}  # (this SDK no longer sends temperature itself)


@pytest.fixture(scope="module")
def server(served_default):
    url = served_default["url"]  # the session's server (conftest): Engine(max_rows=4), create_app(engine, "smollm2")
    return {"url": url, "client": anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)}


def _openai_text(url, messages, **kw):
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "temperature": 0, **kw}).json()
    return r["choices"][0]["message"], r["usage"]


def test_a_message_equals_the_chat_route(server):
    c = server["client"]
    r = c.messages.create(model="smollm2", max_tokens=24, system="Be brief.", messages=ASK, **GREEDY)
    want, usage = _openai_text(server["url"], [{"role": "system", "content": "Be brief."}, *ASK],
                               max_tokens=24)
    assert r.content[0].type == "text" and r.content[0].text == want["content"]
    assert r.stop_reason == "end_turn" and r.role == "assistant" and r.id.startswith("msg_")
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == usage["prompt_tokens"]
    assert r.usage.output_tokens == usage["completion_tokens"]
    n = c.messages.count_tokens(model="smollm2", system="Be brief.", messages=ASK)
    assert n.input_tokens == usage["prompt_tokens"]


def test_the_event_stream_carries_the_same_text(server):
    c = server["client"]
    whole = c.messages.create(model="smollm2", max_tokens=30, messages=ASK, **GREEDY)
    with c.messages.stream(model="smollm2", max_tokens=30, messages=ASK, **GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_report_the_one_that_matched(server):
    r = server["client"].messages.create(model="smollm2", max_tokens=30, messages=ASK,
                                         stop_sequences=["Nowhere", "Paris"], **GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    assert "Paris" not in r.content[0].text
    r = server["client"].messages.create(model="smollm2", max_tokens=2, messages=ASK, **GREEDY)
    assert r.stop_reason == "max_tokens"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_enforced_tool_use_and_a_tool_result_turn(server, stream):
    c = server["client"]
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    kw = dict(model="smollm2", max_tokens=80, tools=TOOLS, messages=ask,
              tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    if stream:
        with c.messages.stream(**kw) as s:
            r = s.get_final_message()
    else:
        r = c.messages.create(**kw)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1 and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, TOOLS[0]["input_schema"])
    follow = c.messages.create(model="smollm2", max_tokens=20, tools=TOOLS, messages=[
        *ask, {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "21 C and sunny"}]}], **GREEDY)
    assert follow.usage.cache_read_input_tokens > 0  # the earlier turn's prefix was reused
    r = c.messages.create(model="smollm2", max_tokens=120, tools=TOOLS, messages=ask,
                          tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY)
    assert len([b for b in r.content if b.type == "tool_use"]) == 1


def test_structured_output(server):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20}},
              "required": ["city", "country"], "additionalProperties": False}
    r = server["client"].messages.create(
        model="smollm2", max_tokens=60, messages=ASK, **GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(r.content[0].text), schema)


@pytest.mark.parametrize("body,where", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "content[0].type"),
    ({"temprature": 1}, "temprature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "tool_choice.name"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"output_config": {"format": {"type": "regex"}}}, "output_config.format"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_requests_are_anthropic_shaped_400s(server, body, where):
    payload = {"model": "smollm2", "max_tokens": 8, "messages": ASK, **body}
    r = httpx.post(server["url"] + "/v1/messages", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert where in err["error"]["message"], err


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")


def test_thinking_blocks(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode("Paris is the capital.</think>\n\nParis.", add_special_tokens=False)
    app = create_app(engine, "tiny", chat_template=TEMPLATE)
    engine.start()
    try:
        with TestClient(app) as tc:
            c = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc)
            r = c.messages.create(model="tiny", max_tokens=64, messages=ASK)
            assert [b.type for b in r.content] == ["thinking", "text"]
            assert r.content[0].thinking == "Paris is the capital." and r.content[1].text == "Paris."
            with c.messages.stream(model="tiny", max_tokens=64, messages=ASK) as s:
                final = s.get_final_message()
            assert [b.type for b in final.content] == ["thinking", "text"]
            assert final.content[0].thinking == "Paris is the capital."
    finally:
        engine.close()


CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}


def test_output_format_is_the_beta_spelling_of_output_config_format(server):
    # litellm sends structured outputs as the beta's top-level `output_format`
    c = server["client"]
    r = c.messages.create(model="smollm2", max_tokens=40, messages=ASK, extra_body={
        "temperature": 0, "output_format": {"type": "json_schema", "schema": CITY}})
    jsonschema.validate(json.loads(r.content[0].text), CITY)
    with pytest.raises(anthropic.BadRequestError, match="output_format"):
        c.messages.create(model="smollm2", max_tokens=8, messages=ASK,
                          output_config={"format": {"type": "json_schema", "schema": CITY}},
                          extra_body={"output_format": {"type": "json_schema", "schema": CITY}})


@pytest.mark.slow
def test_the_sdk_tool_runner_drops_the_thread_it_cannot_have(server):
    """The SDK's tool_runner asks for a server-side thread; the 400 carries the error code
    on which the SDK sends the turn again without one, and the run goes on."""
    sent = []
    http = anthropic.DefaultHttpxClient(event_hooks={"request": [lambda req: sent.append(json.loads(req.content))]})
    c = anthropic.Anthropic(base_url=server["url"], api_key="x", max_retries=0, http_client=http)
    cities = []

    @anthropic.beta_tool
    def get_weather(city: str) -> str:
        """Weather in a city."""
        cities.append(city)
        return "21 C and sunny"

    runner = c.beta.messages.tool_runner(
        model="smollm2", max_tokens=200, tools=[get_weather], max_iterations=2,
        messages=[{"role": "user", "content": "What is the weather in Oslo?"}],
        tool_choice={"type": "any"}, extra_body={"temperature": 0})
    replies = list(runner)
    assert replies and cities  # the model's call ran, and the run continued after it
    assert sent[0]["thread"] == {"type": "create"} and all("thread" not in b for b in sent[1:])
    assert len(sent) == 1 + len(replies)  # one refused request, then one per reply


def test_context_management_is_a_400_that_says_why(server):
    r = httpx.post(server["url"] + "/v1/messages", timeout=60, json={
        "model": "smollm2", "max_tokens": 8, "messages": ASK,
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "context_management: context editing" in r.json()["error"]["message"]


def test_the_streamed_usage_reports_the_cached_prefix(server):
    c = server["client"]
    msgs = [{"role": "user", "content": "Name three rivers of Europe, and say where each flows."}]
    c.messages.create(model="smollm2", max_tokens=4, messages=msgs, **GREEDY)  # fills the cache
    twin = c.messages.create(model="smollm2", max_tokens=4, messages=msgs, **GREEDY)
    assert twin.usage.cache_read_input_tokens > 0
    events = list(c.messages.create(model="smollm2", max_tokens=4, messages=msgs, stream=True, **GREEDY))
    start, delta = events[0], next(e for e in events if e.type == "message_delta")
    assert start.type == "message_start"
    for usage in (start.message.usage, delta.usage):
        assert usage.cache_read_input_tokens == twin.usage.cache_read_input_tokens
        assert usage.input_tokens == twin.usage.input_tokens
    with c.messages.stream(model="smollm2", max_tokens=4, messages=msgs, **GREEDY) as s:
        final = s.get_final_message()
    assert final.usage == twin.usage


def _tiny_client(tmp_path, **app_kw):
    from fastapi.testclient import TestClient

    model = fx_engine.load(write_tiny_model(tmp_path / "m", max_position_embeddings=128))
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode("ab " * 200, add_special_tokens=False)
    return model, engine, TestClient(create_app(engine, "tiny", **app_kw))


def test_max_tokens_beyond_the_context_is_clamped_to_the_room_left(tmp_path):
    model, engine, tc = _tiny_client(tmp_path)
    engine.start()
    try:
        with tc:
            c = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc)
            r = c.messages.create(model="claude-sonnet-4-5", max_tokens=32000, messages=ASK, timeout=60)
            prompt = c.messages.count_tokens(model="tiny", messages=ASK).input_tokens
            assert r.stop_reason == "max_tokens"
            context = model.config.max_position_embeddings
            assert r.usage.output_tokens == context + 1 - prompt  # the engine's own bound
            with c.messages.stream(model="x", max_tokens=32000, messages=ASK) as s:
                assert s.get_final_message().stop_reason == "max_tokens"
            # within the room, max_tokens is the client's
            assert c.messages.create(model="x", max_tokens=5, messages=ASK).usage.output_tokens == 5
    finally:
        engine.close()


def test_a_prompt_longer_than_the_context_is_blamed_not_max_tokens(tmp_path):
    model, engine, tc = _tiny_client(tmp_path)
    engine.start()
    try:
        with tc:
            c = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=tc, max_retries=0)
            long = [{"role": "user", "content": "The capital of France is Paris. " * 40}]
            n = c.messages.count_tokens(model="x", messages=long).input_tokens
            assert n > model.config.max_position_embeddings
            with pytest.raises(anthropic.BadRequestError) as e:
                c.messages.create(model="x", max_tokens=32000, messages=long, timeout=60)
            msg = e.value.body["error"]["message"]
            assert f"prompt ({n} tokens) alone exceeds the model's context of 128 tokens" in msg, msg
            assert "max_tokens" not in msg
    finally:
        engine.close()


def test_gate_and_routing_errors_are_anthropic_shaped(tmp_path):
    _, engine, tc = _tiny_client(tmp_path, api_key="k", max_request_bytes=4096)
    engine.start()
    try:
        with tc:
            def check(r, status, kind):
                assert r.status_code == status, r.text
                assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}

            body = {"model": "x", "max_tokens": 4, "messages": ASK}
            check(tc.post("/v1/messages", json=body), 401, "authentication_error")
            check(tc.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "no"}),
                  401, "authentication_error")
            key = {"x-api-key": "k"}
            check(tc.post("/v1/messages/nope", json=body, headers=key), 404, "not_found_error")
            big = {**body, "system": "x" * 5000}
            check(tc.post("/v1/messages", json=big, headers=key), 413, "request_too_large")
            with pytest.raises(anthropic.AuthenticationError) as e:
                anthropic.Anthropic(base_url="http://testserver", api_key="no", http_client=tc
                                    ).messages.create(**body)
            assert e.value.body["error"]["type"] == "authentication_error"
            # the other routes keep OpenAI's shape
            r = tc.post("/v1/chat/completions", json={"messages": ASK})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert "type" not in r.json()
    finally:
        engine.close()


def test_a_non_streaming_client_that_leaves_frees_its_row(tiny_model):
    from tests.server.test_abuse import _post_raw, _wait_rows

    engine = fx_engine.Engine(tiny_model, max_rows=4, prefill_chunk=64)
    with serve(create_app(engine, "tiny"), engine) as (url, port):
        body = json.dumps({"model": "x", "max_tokens": 1900, "temperature": 0.8, "messages": ASK})
        s = _post_raw(port, "/v1/messages", body.encode())
        try:
            assert _wait_rows(url, 1, timeout=30) == 1  # decoding
        finally:
            s.close()
        assert _wait_rows(url, 0, timeout=10) == 0  # long before its 1900 tokens
        retired = [e for e in engine.trace_events if e["kind"] == "retire"]
        assert [e["reason"] for e in retired] == ["cancelled"] and retired[0]["generated"] < 1900
