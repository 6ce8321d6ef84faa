"""Every field of the server's OpenAPI document has an effect (or is a 400): none is accepted
and then ignored.

For each request model (chat completions, completions, responses, embeddings) the test
lists every property of its schema in the OpenAPI document and needs an entry for each:
either a variant (a body change) whose response differs from the baseline's (status, text,
logprobs, usage, choices, items) or a documented reason why the field cannot change the
output (an identifier such as `user`). A field added to a model without an entry here fails
the test, as does a variant that changes nothing."""

from __future__ import annotations

import json

import httpx
import pytest

MSGS = [{"role": "user", "content": "Write a short poem about the sea and the sky."}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["a"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"]}}}

# No effect on the output by definition: identifiers and routing hints for the provider.
NO_EFFECT = {
    "model": "names the served model (any other name is a 404: tested in the server tests)",
    "user": "an end-user id for the provider's abuse monitoring: logged",
    "safety_identifier": "the same, OpenAI's newer name",
    "metadata": "key-value tags for the caller's bookkeeping",
    "prompt_cache_key": "a cache-routing hint; prefix caching is always on",
    "prompt_cache_retention": "a cache-retention hint; the prefix cache keeps entries while its "
                              "budget allows, whichever is asked",
    "truncation": "'auto' changes only an input that overflows the context (tested in "
                  "test_responses: test_truncation_auto_drops_the_oldest_items_to_fit)",
    "service_tier": "only 'auto' / 'default' ('standard_only' for Anthropic), the behaviour",
    "cache_control": "Anthropic's prompt-caching hint; prefix caching is always on",
    "speed": "Anthropic's speed tier: only 'standard', the behaviour",
    "user_profile_id": "Anthropic's user attribution id",
    "speculative_decoding": "false runs the request without the server's drafts: the same output by "
                            "design, only slower (its effect, no drafts counted, is tested in "
                            "test_spec_metrics: test_a_request_opts_out_of_speculation_on_every_route)",
}

# field -> (baseline additions, variant additions); `None` baseline additions: {}.
SAMPLED = {"temperature": 1.0, "seed": 11}
CHAT = {
    "messages": (None, {"messages": [{"role": "user", "content": "Name a fruit."}]}),
    "max_tokens": (None, {"max_tokens": 3}),
    "max_completion_tokens": (None, {"max_completion_tokens": 3}),
    "temperature": (None, {"temperature": 1.5, "seed": 1}),
    "top_p": (SAMPLED, {"top_p": 0.05}),
    "top_k": (SAMPLED, {"top_k": 1}),
    "min_p": (SAMPLED, {"min_p": 0.9}),
    "presence_penalty": (None, {"presence_penalty": 2.0}),
    "frequency_penalty": (None, {"frequency_penalty": 2.0}),
    "repetition_penalty": (None, {"repetition_penalty": 3.0}),
    "repetition_context_size": ({"repetition_penalty": 3.0}, {"repetition_context_size": 1}),
    "logit_bias": (None, "FIRST_TOKEN_BIAS"),
    "seed": (SAMPLED, {"seed": 12}),
    "stop": (None, "STOP_AT_SECOND_WORD"),
    "stream": (None, {"stream": True}),
    "stream_options": ({"stream": True}, {"stream_options": {"include_usage": True}}),
    "n": (None, {"n": 2}),
    "xtc_probability": (SAMPLED | {"xtc_threshold": 0.01}, {"xtc_probability": 1.0}),
    "xtc_threshold": (SAMPLED | {"xtc_probability": 1.0}, {"xtc_threshold": 0.3}),
    "cache_salt": ("REPEAT", {"cache_salt": "fresh"}),
    "response_format": (None, {"response_format": {"type": "json_schema",
                                                   "json_schema": {"name": "s", "schema": SCHEMA}}}),
    "guided_json": (None, {"guided_json": SCHEMA}),
    "guided_regex": (None, {"guided_regex": "[0-9]{3}"}),
    "guided_grammar": (None, {"guided_grammar": 'root ::= "yes" | "no"'}),
    "guided_choice": (None, {"guided_choice": ["alpha", "beta"]}),
    "structured_outputs": (None, {"structured_outputs": {"regex": "[a-c]{2}"}}),
    "grammar": (None, {"grammar": 'root ::= "ok"'}),
    "json_schema": (None, {"json_schema": SCHEMA}),
    "logprobs": (None, {"logprobs": True}),
    "top_logprobs": ({"logprobs": True}, {"top_logprobs": 3}),
    "tools": (None, {"tools": [TOOL]}),
    "tool_choice": ({"tools": [TOOL]}, {"tool_choice": "required"}),
    "parallel_tool_calls": ({"tools": [TOOL, ADD], "tool_choice": "required", "max_tokens": 120,
                             "messages": [{"role": "user", "content": "Weather in Paris, and 2 + 3?"}]},
                            {"parallel_tool_calls": False}),
    "chat_template_kwargs": (None, {"chat_template_kwargs": {"unused": 1}}),  # a 400
    "reasoning_effort": (None, {"reasoning_effort": "low"}),  # a 400: no switch in this template
}
COMPLETIONS = {
    **{k: v for k, v in CHAT.items() if k in (
        "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
        "presence_penalty", "frequency_penalty", "repetition_penalty", "repetition_context_size",
        "logit_bias", "seed", "stop", "stream", "stream_options", "n", "xtc_probability",
        "xtc_threshold", "cache_salt", "response_format", "guided_json", "guided_regex",
        "guided_grammar", "guided_choice", "structured_outputs", "grammar", "json_schema")},
    "prompt": (None, {"prompt": "Once upon a time"}),
    "logprobs": (None, {"logprobs": 2}),
    "echo": (None, {"echo": True}),
}
RESPONSES = {
    "input": (None, {"input": "Name a fruit."}),
    "instructions": (None, {"instructions": "Answer in French."}),
    "max_output_tokens": (None, {"max_output_tokens": 3}),
    "temperature": (None, {"temperature": 1.5}),
    "top_p": ({"temperature": 1.0}, {"top_p": 0.05}),
    "tools": (None, {"tools": [{"type": "function", "name": "get_weather",
                                "parameters": TOOL["function"]["parameters"]}]}),
    "tool_choice": ({"tools": [{"type": "function", "name": "get_weather",
                                "parameters": TOOL["function"]["parameters"]}]}, {"tool_choice": "required"}),
    "parallel_tool_calls": ({"tools": [{"type": "function", "name": "get_weather",
                                        "parameters": TOOL["function"]["parameters"]}],
                             "tool_choice": "required", "temperature": 1.0},
                            {"parallel_tool_calls": False}),
    "text": (None, {"text": {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}}}),
    "reasoning": (None, {"reasoning": {"effort": "low"}}),  # a 400: no switch
    "stream": (None, {"stream": True}),
    "stream_options": ({"stream": True}, {"stream_options": {"include_obfuscation": True}}),
    "include": (None, {"include": ["message.output_text.logprobs"]}),
    "top_logprobs": ({"include": ["message.output_text.logprobs"]}, {"top_logprobs": 3}),
    "max_tool_calls": ({"tools": [{"type": "function", "name": "get_weather",
                                   "parameters": TOOL["function"]["parameters"]}],
                        "tool_choice": "required", "temperature": 1.0},
                       {"max_tool_calls": 1}),
}
MESSAGES = {
    "messages": (None, {"messages": [{"role": "user", "content": "Name a fruit."}]}),
    "max_tokens": (None, {"max_tokens": 3}),
    "system": (None, {"system": "Answer in French."}),
    "stop_sequences": (None, {"stop_sequences": ["the", "The", "sea"]}),
    "stream": (None, {"stream": True}),
    "temperature": (None, {"temperature": 1.0}),
    "top_p": ({"temperature": 1.0}, {"top_p": 0.05}),
    "top_k": ({"temperature": 1.0}, {"top_k": 1}),
    "tools": (None, {"tools": [{"name": "get_weather",
                                "input_schema": TOOL["function"]["parameters"]}]}),
    "tool_choice": ({"tools": [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]},
                    {"tool_choice": {"type": "any"}}),
    "thinking": (None, {"thinking": {"type": "enabled", "budget_tokens": 1024}}),  # a 400: no switch
    "output_config": (None, {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}),
    "output_format": (None, {"output_format": {"type": "json_schema", "schema": SCHEMA}}),
    "thread": (None, {"thread": {"type": "create"}}),  # a 400 the SDK understands
}
EMBEDDINGS = {
    "input": (None, {"input": "another text"}),
    "encoding_format": (None, {"encoding_format": "base64"}),
    "dimensions": (None, {"dimensions": 3}),  # a 400: no shorter embeddings declared
}
ROUTES = {
    "/v1/chat/completions": ("ChatRequest", CHAT, {"messages": MSGS, "max_tokens": 12, "temperature": 0}),
    "/v1/completions": ("CompletionRequest", COMPLETIONS,
                        {"prompt": "The sea and the sky", "max_tokens": 12, "temperature": 0}),
    "/v1/responses": ("ResponsesRequest", RESPONSES,
                      {"input": "Write a short poem about the sea.", "max_output_tokens": 12, "temperature": 0}),
    "/v1/embeddings": ("EmbeddingRequest", EMBEDDINGS, {"input": "a text"}),
    "/v1/messages": ("MessagesRequest", MESSAGES, {"max_tokens": 12, "messages": MSGS}),
}


@pytest.fixture(scope="module")
def server(served_default):
    """The session's server (conftest): Engine(default_model, max_rows=4), create_app(engine, "smollm2")."""
    return {"url": served_default["url"], "app": served_default["app"], "model": served_default["model"]}


_VOLATILE = {"id", "created", "created_at", "system_fingerprint", "call_id", "item_id"}


def _summary(r: httpx.Response) -> str:
    """The response without ids and timestamps (streams: their data lines, the same way)."""
    def clean(x):
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items() if k not in _VOLATILE}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        return "stream:" + json.dumps(clean(events), sort_keys=True)
    return f"{r.status_code}:" + json.dumps(clean(r.json()), sort_keys=True)


def test_every_field_is_listed(server):
    schemas = server["app"].openapi()["components"]["schemas"]
    for route, (name, table, _) in ROUTES.items():
        fields = set(schemas[name]["properties"])
        missing = fields - set(table) - set(NO_EFFECT)
        assert not missing, f"{route}: fields without an effect check: {sorted(missing)}"
        assert not (set(table) - fields), f"{route}: stale entries {sorted(set(table) - fields)}"


def _cases():
    for route, (_, table, base) in ROUTES.items():
        for field, (extra, variant) in table.items():
            yield pytest.param(route, base, field, extra, variant,
                               id=f"{route.removeprefix('/v1/').replace('/', '_')}.{field}")


@pytest.mark.parametrize("route,base,field,extra,variant", list(_cases()))
@pytest.mark.slow
def test_the_field_changes_the_response(server, route, base, field, extra, variant):
    url, tok = server["url"], server["model"].tokenizer
    with httpx.Client(base_url=url, timeout=120) as h:
        baseline = dict(base)
        if isinstance(extra, dict):
            baseline.update(extra)
        if extra == "REPEAT":  # the baseline runs twice: its second run reads the prefix cache
            h.post(route, json=baseline)
        r0 = h.post(route, json=baseline)
        assert r0.status_code == 200, r0.text
        if variant == "FIRST_TOKEN_BIAS":
            text = r0.json()["choices"][0].get("message", {}).get("content") or r0.json()["choices"][0].get("text")
            variant = {"logit_bias": {str(tok.encode(text, add_special_tokens=False)[0]): -100}}
        elif variant == "STOP_AT_SECOND_WORD":
            text = r0.json()["choices"][0].get("message", {}).get("content") or r0.json()["choices"][0].get("text")
            variant = {"stop": [text.split()[1]]}
        r1 = h.post(route, json={**baseline, **variant})
    assert r1.status_code == 400 or _summary(r1) != _summary(r0), (
        f"{field}: {variant} changed nothing in {route}")
