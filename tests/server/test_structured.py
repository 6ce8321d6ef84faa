"""Structured output and the field policy through the server, with the official `openai`
client over real HTTP on 127.0.0.1 (the default model: real text).

Oracles: `jsonschema` and Pydantic validate the outputs; Python's `re` checks regexes;
`fields.UNSUPPORTED` / the pydantic models list the fields each test sends."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import serve

MSGS = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model):
    engine = fx_engine.Engine(default_model, max_rows=8)
    app = create_app(engine, "smollm2", defaults={"max_tokens": 96})
    with serve(app, engine) as (url, _):
        yield {"url": url, "model": default_model}


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server["url"] + "/v1", api_key="none", max_retries=0)


def _post(server, path, body):
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        return h.post(path, json=body)


def test_parse_with_a_pydantic_model(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=16)
        age: int = Field(ge=0, le=120)

    r = client.chat.completions.parse(model="smollm2", messages=MSGS, response_format=Person,
                                      temperature=0, max_tokens=80)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_on_every_sampled_choice(client, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    kw = dict(model="smollm2", messages=MSGS, response_format=rf, temperature=1.0, seed=3, n=4,
              max_tokens=80)
    if stream:
        texts = ["", "", "", ""]
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
    else:
        texts = [c.message.content for c in client.chat.completions.create(**kw).choices]
    for t in texts:
        jsonschema.validate(json.loads(t), SCHEMA)


@pytest.mark.slow
def test_constrained_beside_free_requests_with_prompt_lookup(server, client):
    """Concurrent requests: constrained (several spellings) and free ones in the same batch;
    the free one equals its solo output."""
    import concurrent.futures as cf

    free = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 20, "temperature": 0}
    want = fx_engine.generate(server["model"], free["messages"], max_tokens=20, temperature=0.0).text
    bodies = [
        ("schema", {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "p", "schema": SCHEMA}}}),
        ("schema", {"guided_json": SCHEMA}),
        ("schema", {"json_schema": SCHEMA}),  # llama.cpp's spelling
        ("schema", {"structured_outputs": {"json": SCHEMA}}),
        ("object", {"response_format": {"type": "json_object"}, "max_tokens": 200,
                    "messages": [{"role": "user", "content": 'Reply {"ok": true} as JSON.'}]}),
        ("regex", {"guided_regex": r"[A-Z][a-z]{2,9} is \d{1,2}\."}),
        ("regex", {"grammar": 'root ::= [A-Z] [a-z]{2,9} " is " [0-9] [0-9]? "."'}),
        ("choice", {"guided_choice": ["yes", "no"]}),
        ("choice", {"structured_outputs": {"choice": ["yes", "no"]}}),
    ]
    checks = {"schema": lambda t: jsonschema.validate(json.loads(t), SCHEMA),
              "object": lambda t: isinstance(json.loads(t), dict) or 1 / 0,
              "regex": lambda t: re.fullmatch(r"[A-Z][a-z]{2,9} is \d{1,2}\.", t) or 1 / 0,
              "choice": lambda t: t in ("yes", "no") or 1 / 0}
    with cf.ThreadPoolExecutor(12) as ex:
        futs = [(kind, ex.submit(_post, server, "/v1/chat/completions",
                                 {"model": "smollm2", "messages": MSGS, "temperature": 0.8,
                                  "seed": 5, "max_tokens": 80, **b}))
                for kind, b in bodies]
        f_free = ex.submit(_post, server, "/v1/chat/completions", free)
        for kind, f in futs:
            r = f.result()
            assert r.status_code == 200, r.text
            checks[kind](r.json()["choices"][0]["message"]["content"])
        assert f_free.result().json()["choices"][0]["message"]["content"] == want
    r = _post(server, "/v1/completions", {"prompt": "The answer is", "guided_regex": r" (yes|no)\.",
                                          "max_tokens": 8})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in (" yes.", " no.")


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "nonsense"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(("}, "guided_regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"guided_json": SCHEMA, "grammar": 'root ::= "x"'}, "grammar"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"temprature": 0.5}, "temprature"),
    ({"max_token": 5}, "max_token"),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"store": True}, "store"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"completely_unknown": 1}, "completely_unknown"),
])
def test_bad_or_unknown_fields_are_400_naming_them(server, body, param):
    r = _post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if param in ("temprature", "max_token"):
        assert "did you mean" in err["message"]


@pytest.mark.parametrize("body,param", [
    ({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of"), ({"grammar": "root ::= ("}, "grammar"),
    ({"temprature": 1}, "temprature"),
])
def test_completions_reject_what_they_do_not_implement(server, body, param):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_unimplemented_fields_are_accepted(server):
    r = _post(server, "/v1/chat/completions", {
        "model": "smollm2", "messages": MSGS, "max_tokens": 2, "store": False,
        "modalities": ["text"], "service_tier": "auto", "user": "u1", "metadata": {"k": "v"},
        "safety_identifier": "s", "prompt_cache_key": "k", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------ enforced tool calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"type": "string", "enum": ["c", "f"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": -999, "maximum": 999},
                                         "b": {"type": "integer", "minimum": -999, "maximum": 999}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _valid_calls(calls, names=("get_weather", "add")):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert calls
    for c in calls:
        assert c.type == "function" and c.function.name in names and c.id
        jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])


@pytest.mark.slow
def test_required_tool_choice_gives_valid_calls_on_every_choice(client):
    # (one call each: with parallel calls allowed, a sampled row of this small model may go
    # on calling until max_tokens, each call valid but the last one cut off)
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                       tool_choice="required", temperature=1.0, seed=2, n=3,
                                       max_tokens=120, parallel_tool_calls=False)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls", ch
        _valid_calls(ch.message.tool_calls)


def test_named_tool_choice_and_parallel_false_give_exactly_one_call(client):
    r = client.chat.completions.create(
        model="smollm2", messages=ASK, tools=TOOLS, temperature=0, max_tokens=120,
        tool_choice={"type": "function", "function": {"name": "add"}})
    [call] = r.choices[0].message.tool_calls
    _valid_calls([call], ("add",))
    r = client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, temperature=0,
                                       max_tokens=120, tool_choice="required",
                                       parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_required_tool_calls(client):
    calls, finish = {}, None
    for chunk in client.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS,
                                                tool_choice="required", temperature=0,
                                                max_tokens=120, stream=True):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:  # a call's first delta names it, later ones add arguments
                if d.index in calls:
                    calls[d.index].function.arguments += d.function.arguments
                else:
                    calls[d.index] = d
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    _valid_calls(list(calls.values()))


def test_tools_reach_a_template_without_a_tools_section(server):
    """The default model's template has no tools section: the default one goes into the
    system prompt (so the prompt grows), and a tool result in the history is accepted."""
    base = {"model": "smollm2", "messages": ASK, "max_tokens": 1}
    plain = _post(server, "/v1/chat/completions", base).json()["usage"]["prompt_tokens"]
    with_tools = _post(server, "/v1/chat/completions", {**base, "tools": TOOLS}).json()
    assert with_tools["usage"]["prompt_tokens"] > plain + 50
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = _post(server, "/v1/chat/completions", {**base, "messages": history, "tools": TOOLS,
                                               "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_choices_are_400(server, body, param):
    r = _post(server, "/v1/chat/completions", {"model": "smollm2", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_logprobs_of_constrained_outputs_are_json(server):
    """Alternatives the grammar rules out have logprob -inf: reported as -9999 (vLLM's
    floor), never as a non-JSON -Infinity or a 500."""
    r = _post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "guided_regex": "x",
                                               "logprobs": True, "top_logprobs": 3, "max_tokens": 4})
    assert r.status_code == 200, r.text
    tops = r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert all(t["logprob"] >= -9999.0 for t in tops)
    r = _post(server, "/v1/completions", {"prompt": "Answer:", "guided_choice": ["yes", "no"],
                                          "logprobs": 3, "max_tokens": 4})
    assert r.status_code == 200, r.text
    with httpx.Client(base_url=server["url"], timeout=60) as h:
        with h.stream("POST", "/v1/chat/completions", json={
                "model": "smollm2", "messages": MSGS, "guided_regex": "x", "logprobs": True,
                "top_logprobs": 3, "stream": True}) as s:
            body = "".join(s.iter_lines())
    assert "Infinity" not in body and "NaN" not in body


# ------------------------------------------------------------------ hostile grammars (issue 40)


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
    ({"guided_json": {"$ref": "#"}}, "guided_json"),
    ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                      "$ref": "#/$defs/a"}}, "json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format.json_schema.schema"),
])
def test_constraints_nothing_can_satisfy_are_400s_before_admission(server, body, param):
    """Streamed, so a request admitted first would answer 200 and fail in its stream: the
    400 is decided when the request is made, with a short message (no parser dump)."""
    r = _post(server, "/v1/chat/completions", {"model": "smollm2", "messages": MSGS, "max_tokens": 4,
                                               "stream": True, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert "no output satisfies" in err["message"] and len(err["message"]) < 300, err


def test_a_grammar_that_hits_a_parser_limit_mid_output_is_a_400(server):
    """Its first mask is fine; after its forced first word its parser row has 3,001 items
    (llguidance allows 2,000): the grammar's fault, a 400 naming it, not a 500."""
    lark = ('start: "Sure" r0\n' + "\n".join(f'r{i}: "t{i}" | r{i + 1}' for i in range(1500))
            + '\nr1500: "end"')
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "grammar": lark})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "grammar" and "max is 2000" in err["message"], err
    # streamed, the 200 has gone out: the error event names the field the same way
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "grammar": lark,
                                          "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    [err] = [e["error"] for e in events if "error" in e]
    assert err["param"] == "grammar" and err["type"] == "invalid_request_error", err
    assert "max is 2000" in err["message"] and "generation failed" not in err["message"], err


def test_twenty_thousand_choices(server):
    """llguidance allows 2,000 alternatives in a parser row: the choices are one lexeme."""
    choices = [f"c{i}" for i in range(20_000)]
    r = _post(server, "/v1/completions", {"prompt": "Pick one:", "max_tokens": 8,
                                          "guided_choice": choices})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in set(choices)


@pytest.mark.slow
def test_the_3000_rule_grammar_is_a_400_and_the_server_lives_on():
    """Issue 40's reproduction (SIGSEGV: the server exited with -11) on a server process of
    its own, and a 3,000-link `$ref` chain within the limits (it too overflowed a worker
    thread's stack): 400 or 200, and the server answers afterwards."""
    import os
    import subprocess
    import sys

    from tests.conftest import free_port, wait_healthy

    lark = "start: r0\n" + "\n".join(f'r{i}: "t{i}" | r{i+1}' for i in range(3000)) + '\nr3000: "end"'
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(3000)}
    chain = {"$defs": {**defs, "d3000": {"type": "string"}}, "$ref": "#/$defs/d0"}
    exe = os.path.join(os.path.dirname(sys.executable), "fx-engine")
    port = free_port()
    p = subprocess.Popen([exe, "serve", "--port", str(port), "--max-tokens", "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "FX_ENGINE_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [p])
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "grammar": lark},
                       timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == "grammar", r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, "guided_json": chain},
                       timeout=120)
        assert r.status_code in (200, 400), r.text
        assert p.poll() is None
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 4}, timeout=120)
        assert r.status_code == 200, r.text
    finally:
        p.terminate()
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
    assert p.returncode == 0, p.returncode
