"""The Anthropic Messages API (/v1/messages, its event stream, count_tokens) with the
official `anthropic` SDK over real HTTP on 127.0.0.1 (the default model), and thinking
blocks on a model scripted to think (test_server_tools.ScriptedEngine).

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

from .conftest import serve
from .test_server_tools import ScriptedEngine

anthropic = pytest.importorskip("anthropic")

ASK = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
    "required": ["city"], "additionalProperties": False}}]
GREEDY = {"extra_body": {"temperature": 0}}  # (this SDK no longer sends temperature itself)


@pytest.fixture(scope="module")
def server(default_model):
    engine = fx_engine.Engine(default_model, max_rows=4)
    app = create_app(engine, "smollm2")
    with serve(app, engine) as (url, _):
        yield {"url": url, "client": anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)}


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


def test_thinking_blocks(tmp_path):
    from fastapi.testclient import TestClient

    model = fx_engine.load(write_tiny_model(tmp_path / "m"))
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
