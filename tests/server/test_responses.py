"""OpenAI's Responses API (/v1/responses), plain and streamed, with tools, structured output
and reasoning items, through the official `openai` SDK over real HTTP on 127.0.0.1.

Oracles: the chat completions route on the same engine (the same prompt gives the same
greedy text), jsonschema / Pydantic for structured outputs and tool arguments."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import serve
from tests.server.test_tool_calls import ScriptedEngine

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                         "required": ["city"], "additionalProperties": False}, "strict": True}]


@pytest.fixture(scope="module")
def server(served_default):
    from openai import OpenAI

    url = served_default["url"]  # the session's server (conftest): Engine(max_rows=4), create_app(engine, "smollm2")
    return {"url": url, "client": OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)}


def _chat(url, messages, **kw):
    return httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "messages": messages, "temperature": 0, **kw}).json()


def test_a_response_equals_the_chat_route(server):
    c = server["client"]
    r = c.responses.create(model="smollm2", input="What is the capital of France?",
                           instructions="Be brief.", temperature=0, max_output_tokens=30)
    want = _chat(server["url"], [{"role": "system", "content": "Be brief."},
                                 {"role": "user", "content": "What is the capital of France?"}],
                 max_tokens=30)
    assert r.output_text == want["choices"][0]["message"]["content"] and r.status == "completed"
    assert r.usage.input_tokens == want["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == want["usage"]["completion_tokens"]
    with c.responses.stream(model="smollm2", input="What is the capital of France?",
                            instructions="Be brief.", temperature=0, max_output_tokens=30) as s:
        deltas = [e.delta for e in s if e.type == "response.output_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text


def test_max_output_tokens_makes_it_incomplete(server):
    c = server["client"]
    r = c.responses.create(model="smollm2", input="Tell me a long story.", temperature=0,
                           max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    events = [e.type for e in c.responses.create(model="smollm2", input="Tell me a long story.",
                                                  temperature=0, max_output_tokens=5, stream=True)]
    assert events[0] == "response.created" and events[-1] == "response.incomplete"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_required_function_calls_and_their_outputs(server, stream):
    c = server["client"]
    kw = dict(model="smollm2", input="What is the weather in Paris?", tools=TOOLS,
              tool_choice="required", parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    if stream:
        with c.responses.stream(**kw) as s:
            r = s.get_final_response()
    else:
        r = c.responses.create(**kw)
    [call] = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), TOOLS[0]["parameters"])
    r2 = c.responses.create(model="smollm2", tools=TOOLS, temperature=0, max_output_tokens=20, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}])
    assert r2.status in ("completed", "incomplete") and r2.output


def test_parse_with_a_pydantic_model(server):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    r = server["client"].responses.parse(model="smollm2", input="Describe Paris.", text_format=City,
                                         temperature=0, max_output_tokens=60)
    assert isinstance(r.output_parsed, City)


@pytest.mark.parametrize("body,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0].type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice.name"),
    ({"text": {"format": {"type": "regex"}}}, "text.format.type"),
    ({"max_output_token": 3}, "max_output_token"),
    ({"reasoning": {"summary": "long"}}, "reasoning.summary"),
    ({"stream_options": {"bogus": True}}, "stream_options.bogus"),
])
def test_bad_requests_are_400_naming_the_field(server, body, param):
    r = httpx.post(server["url"] + "/v1/responses", json={"input": "hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("fmt,param", [
    ({"type": "json_schema", "name": "x", "schema": {"items": {"items": {}}}}, "text.format.json_schema.schema"),
    ({"type": "json_schema", "name": "", "schema": {}}, "text.format.json_schema.name"),
])
def test_text_format_errors_name_text_format_not_response_format(fmt, param, monkeypatch):
    from fx_engine.engine import constraints, grammar_guard
    from fx_engine.server.responses import _format_constraint

    monkeypatch.setattr(grammar_guard, "MAX_SCHEMA_DEPTH", 2)  # the schema above is 3 deep
    with pytest.raises(constraints.GrammarError) as e:
        _format_constraint({"format": fmt})
    assert str(e.value).split(":")[0] == param, str(e.value)


def test_reasoning_items(tiny_folder):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}")
    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode("Sum it.</think>\n\nFour.", add_special_tokens=False)
    app = create_app(engine, "tiny", chat_template=template)
    engine.start()
    try:
        with TestClient(app) as tc:
            c = OpenAI(base_url="http://testserver/v1", api_key="x", http_client=tc)
            r = c.responses.create(model="tiny", input="2 + 2?", max_output_tokens=64)
            assert [o.type for o in r.output] == ["reasoning", "message"]
            assert r.output[0].content[0].text == "Sum it." and r.output_text == "Four."
            assert r.output[0].summary == []
            r = c.responses.create(model="tiny", input="2 + 2?", max_output_tokens=64,
                                   reasoning={"summary": "auto"})
            assert r.output[0].summary[0].text == "Sum it."
            with c.responses.stream(model="tiny", input="2 + 2?", max_output_tokens=64,
                                    reasoning={"summary": "detailed"}) as s:
                final = s.get_final_response()
            assert [o.type for o in final.output] == ["reasoning", "message"]
            assert final.output[0].summary[0].text == "Sum it."
            assert final.output_text == "Four."
    finally:
        engine.close()


@pytest.mark.parametrize("stream", [False, True])
def test_output_text_logprobs_equal_the_chat_routes(server, stream):
    c = server["client"]
    kw = dict(model="smollm2", input="What is the capital of France?", temperature=0,
              max_output_tokens=12, top_logprobs=3, include=["message.output_text.logprobs"])
    if stream:
        with c.responses.stream(**kw) as s:
            deltas = [lp for e in s if e.type == "response.output_text.delta" for lp in e.logprobs]
            r = s.get_final_response()
    else:
        r = c.responses.create(**kw)
    chat = _chat(server["url"], [{"role": "user", "content": kw["input"]}], max_tokens=12,
                 logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    got = [lp.model_dump() for lp in r.output[0].content[0].logprobs]
    assert [g["token"] for g in got] == [w["token"] for w in chat] and got
    for g, w in zip(got, chat):
        assert g["logprob"] == pytest.approx(w["logprob"], abs=1e-3)
        assert [t["token"] for t in g["top_logprobs"]] == [t["token"] for t in w["top_logprobs"]]
    if stream:  # the deltas carried the same records as they went
        assert [lp.model_dump() for lp in deltas] == got
    # top_logprobs alone implies the include (as OpenAI takes it): never accepted and ignored
    kw.pop("include")
    if stream:
        with c.responses.stream(**kw) as s:
            alone = s.get_final_response()
    else:
        alone = c.responses.create(**kw)
    again = [lp.model_dump() for lp in alone.output[0].content[0].logprobs]
    assert [g["token"] for g in again] == [g["token"] for g in got]
    for a, g in zip(again, got):  # (the prefix cache may hold the prompt this time)
        assert a["logprob"] == pytest.approx(g["logprob"], abs=1e-3)
        assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in g["top_logprobs"]]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.slow
def test_max_tool_calls_caps_the_calls_returned(server, stream):
    c = server["client"]
    kw = dict(model="smollm2", input="What is the weather in Paris and in Oslo?", tools=TOOLS,
              tool_choice="required", temperature=0, max_output_tokens=200)

    def calls(**more):
        if stream:
            with c.responses.stream(**kw, **more) as s:
                r = s.get_final_response()
        else:
            r = c.responses.create(**kw, **more)
        assert r.max_tool_calls == more.get("max_tool_calls")
        return [o for o in r.output if o.type == "function_call"]

    assert len(calls()) > 1  # the model calls twice when it may
    [one] = calls(max_tool_calls=1)
    jsonschema.validate(json.loads(one.arguments), TOOLS[0]["parameters"])


def test_prompt_cache_retention_is_a_hint_both_routes_accept(server):
    for value in ("in_memory", "24h"):
        r = httpx.post(server["url"] + "/v1/responses", timeout=60, json={
            "input": "hi", "max_output_tokens": 2, "prompt_cache_retention": value})
        assert r.status_code == 200, r.text
        r = httpx.post(server["url"] + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_cache_retention": value})
        assert r.status_code == 200, r.text
    r = httpx.post(server["url"] + "/v1/responses", timeout=60, json={
        "input": "hi", "prompt_cache_retention": "forever"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention"


def test_truncation_auto_drops_the_oldest_items_to_fit(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder(max_position_embeddings=128))
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=64)
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message number {i} " * 3}
             for i in range(15)]
    engine.start()
    try:
        with TestClient(create_app(engine, "tiny")) as tc:
            body = {"input": items, "max_output_tokens": 8}
            r = tc.post("/v1/responses", json=body)
            assert r.status_code == 400 and "context" in r.json()["error"]["message"]
            r = tc.post("/v1/responses", json={**body, "truncation": "auto"})
            assert r.status_code == 200, r.text
            assert r.json()["truncation"] == "auto"
            # the oracle: the longest suffix of the input whose prompt leaves room for the reply
            context = model.config.max_position_embeddings + 1
            counts = [tc.post("/tokenize", json={"messages": items[k:]}).json()["count"]
                      for k in range(len(items))]
            want = next(n for n in counts if n + 8 <= context)
            assert r.json()["usage"]["input_tokens"] == want
    finally:
        engine.close()


def test_a_non_streaming_client_that_leaves_frees_its_row(tiny_model):
    from tests.server.test_abuse import _post_raw, _wait_rows

    engine = fx_engine.Engine(tiny_model, max_rows=4, prefill_chunk=64)
    with serve(create_app(engine, "tiny"), engine) as (url, port):
        body = json.dumps({"max_output_tokens": 1900, "temperature": 0.8, "input": "Tell me a story"})
        s = _post_raw(port, "/v1/responses", body.encode())
        try:
            assert _wait_rows(url, 1, timeout=30) == 1  # decoding
        finally:
            s.close()
        assert _wait_rows(url, 0, timeout=10) == 0
        retired = [e for e in engine.trace_events if e["kind"] == "retire"]
        assert [e["reason"] for e in retired] == ["cancelled"] and retired[0]["generated"] < 1900
