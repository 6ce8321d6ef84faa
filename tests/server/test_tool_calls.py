"""Tool calling on the server: parsing the formats models write, streaming around calls,
tools reaching the chat template, tool results in the history; and 429 with Retry-After."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from hypothesis import given, settings, strategies as st

import fx_engine
from fx_engine.server.app import create_app
from fx_engine.server.tools import ToolCallStream, parse_tool_calls
from fx_engine.testing import write_tiny_model

NAMES = {"get_weather", "add"}


@pytest.mark.parametrize("text, content, calls", [
    ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me check.", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
     '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}</tool_call>',
     "", [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})]),
    ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 3, "b": 4}}]', "", [("add", {"a": 3, "b": 4})]),
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}', "",
     [("get_weather", {"city": "Rome"})]),
    ('{"name": "get_weather", "parameters": {"city": "Lima"}}', "", [("get_weather", {"city": "Lima"})]),
    ('{"name": "not_a_tool", "parameters": {}}', '{"name": "not_a_tool", "parameters": {}}', []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', '<tool_call>{"name": "get_weather", '
     '"arguments": {"city": "Pa', []),  # cut off by max_tokens: kept as content
    ("Plain answer, no tools.", "Plain answer, no tools.", []),
    ('\n{"name": "add", "arguments": {"a": 1}}', "", [("add", {"a": 1})]),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', []),  # not an offered tool
    ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
     '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', []),  # arguments must be an object
])
def test_parse_tool_calls(text, content, calls):
    got_content, got = parse_tool_calls(text, NAMES)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == calls
    assert all(c["type"] == "function" and (c["id"].startswith("call_") or len(c["id"]) == 9) for c in got)


def test_mistral_ids_fit_its_templates_and_model_ids_are_kept():
    _, [c] = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {}}]', NAMES)
    assert len(c["id"]) == 9 and c["id"].isalnum()
    _, [c] = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {}, "id": "abcDEF123"}]', NAMES)
    assert c["id"] == "abcDEF123"


_TEXTS = st.sampled_from([
    'Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> done',
    '\n\n{"name": "add", "arguments": {"a": 1}}',
    ' <tool_call>{"name": "add", "arguments": {}}</tool_call>',
    'Calling.<|python_tag|>{"name": "get_weather", "parameters": {"city": "Y"}}',
    '[1] is a citation, not a call',
    'Hello <tool_ca and more text < tool',
    '[TOOL_CALLS][{"name": "add", "arguments": {}}]',
    '{"name": "get_weather", "parameters": {"city": "X"}}',
    "no calls at all, just <b>text</b> [TOOL",
    # arguments re-written as they come: whitespace, numbers, escapes, nesting, several calls
    'OK.<tool_call>\n{"name":"get_weather","arguments":{ "city" :"Pa\\u00e9ris \\ud83d\\ude00\\n\\"q\\"",'
    '"n":1.50,"l":[1 ,2,{"x":null,"y":true}],"e":{},"z":1E2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": -0, "b": [], "c": "\\/"}}\n</tool_call>',
    '[TOOL_CALLS][{"name": "add", "arguments": {"a": 3}, "id": "abcDEF123"}, '
    '{"id": "z9", "name": "add", "arguments": {}}]',
    '<tool_call>{"function": {"name": "add", "arguments": {"a": [1, {"b": 2}]}}}</tool_call>',
    # only known at the end: arguments before the name, arguments as a string
    '{"parameters": {"city": "Lima"}, "name": "get_weather"}',
    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"a": 1}<|call|>',
    '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a":[1, 2]}<|call|>'
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"X"}',
    '<tool_call>{"name": "rm_rf", "arguments": {"a": 1}}</tool_call>',  # not offered: content
])


def _replay(pieces):
    """(content, [(id, name, arguments)], number of arguments pieces) of streamed pieces."""
    content, calls, n_args = "", {}, 0
    for p in pieces:
        if p[0] == "content":
            content += p[1]
        elif p[0] == "call":
            assert p[1] == len(calls)  # calls are announced in order, once
            calls[p[1]] = [p[2], p[3], ""]
        else:
            calls[p[1]][2] += p[2]
            n_args += 1
    return content, [tuple(c) for c in calls.values()], n_args


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(0, 300), max_size=12), one=st.booleans())
def test_streamed_parse_equals_whole_parse(text, cuts, one):
    s = ToolCallStream(NAMES, 1 if one else None)
    pieces, prev = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces += s.feed(text[prev:c])
        prev = c
    before_finish = list(pieces)
    more, calls = s.finish()
    content, got, _ = _replay(pieces + more)
    want_content, whole = parse_tool_calls(text, NAMES)
    whole = whole[:1] if one else whole
    # whitespace-only content beside calls is none (the non-streamed reply's null)
    assert content == (want_content if want_content.strip() or not whole else "")
    # the arguments streamed are the final ones, which are the non-streamed answer's
    assert [(n, a) for _, n, a in got] == [(c["function"]["name"], c["function"]["arguments"]) for c in calls] \
        == [(c["function"]["name"], c["function"]["arguments"]) for c in whole]
    assert [i for i, _, _ in got] == [c["id"] for c in calls]
    sent = _replay(before_finish)[0]
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"'):
        if whole:
            assert marker not in sent


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>',
    '\n<tool_call>{"name": "add", "arguments": {}}</tool_call>\n',
    '\n\n[TOOL_CALLS][{"name": "add", "arguments": {}}]',
])
def test_whitespace_beside_calls_is_not_streamed_as_content(text):
    for step in (1, 7, len(text)):
        s = ToolCallStream(NAMES)
        pieces = [p for k in range(0, len(text), step) for p in s.feed(text[k : k + step])]
        more, calls = s.finish()
        assert calls and not parse_tool_calls(text, NAMES)[0].strip()
        assert [p for p in pieces + more if p[0] == "content"] == []
    s = ToolCallStream(NAMES)  # whitespace held before a call is sent when content follows
    pieces = s.feed("\n<tool_call>") + s.feed('{"name": "add", "arguments": {}}</tool_call> ok')
    more, _ = s.finish()
    assert "".join(p[1] for p in pieces + more if p[0] == "content") == "\n ok"


def test_arguments_stream_as_they_are_written():
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"days": 3, "note": "caf\\u00e9"}}\n</tool_call>')
    s = ToolCallStream(NAMES)
    pieces, seen = [], []  # seen[k]: what had been sent once character k was generated
    for ch in text:
        pieces += s.feed(ch)
        seen.append(_replay(pieces))
    more, [call] = s.finish()
    content, [(cid, name, args)], n_args = _replay(pieces + more)
    whole = json.loads(text[text.index("{") : text.index("\n</")])["arguments"]
    assert content == "Let me check." and name == "get_weather" and cid == call["id"]
    assert args == call["function"]["arguments"] == json.dumps(whole, ensure_ascii=False)
    assert n_args > 10 and not more  # piece by piece, nothing left for the end
    # the call was announced, and the city sent, before the rest of the arguments was written
    at = text.index('"Paris"') + len('"Paris"')
    assert seen[at][1] and seen[at][1][0][2].startswith('{"city": "Paris"')
    # a cut-off call stays as streamed (as OpenAI's stream does); the whole parse keeps it as content
    s = ToolCallStream(NAMES)
    early = s.feed(text[: text.index("Paris") + 2])
    more, calls = s.finish()
    assert _replay(early + more)[1] == [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert calls[0]["function"]["arguments"] == '{"city": "Pa'


TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters | tojson }}) {% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{{ tc.function.name }}"
    "{{ tc.function.arguments | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SCRIPT = 'OK.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


class ScriptedEngine(fx_engine.Engine):
    """The real Engine, with the model's choices forced to a scripted text (a logits
    processor), so that the server's handling of a model that calls a tool can be tested."""

    script: list[int] = []

    def submit_many(self, prompt, kwargs_list):  # what the server (and submit) call
        return [self._submit_one(prompt, dict(kw)) for kw in kwargs_list]

    def _submit_one(self, prompt, kw):
        n_prompt = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
        script, eos = self.script, self.model.eos_ids[0]

        def force(tokens, logits):
            k = tokens.shape[0] - n_prompt
            want = script[k] if k < len(script) else eos
            return mx.where(mx.arange(logits.shape[-1]) == want, 0.0, -1e9).reshape(logits.shape)

        if n_prompt is not None and self.script:
            kw["logits_processors"] = [force]
        return super().submit_many(prompt, [kw])[0]


@pytest.fixture(scope="module")
def tool_app(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=4, prefill_chunk=64)
    engine.script = model.tokenizer.encode(SCRIPT, add_special_tokens=False)
    assert model.tokenizer.decode(engine.script) == SCRIPT
    app = create_app(engine, "tiny", defaults={"max_tokens": 256}, chat_template=TEMPLATE)
    engine.start()
    with TestClient(app) as c:
        yield c, model, engine
    engine.close()


MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def test_tools_reach_the_template_and_calls_come_back(tool_app):
    c, model, _ = tool_app
    r = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS})
    assert r.status_code == 200, r.text
    want = model.tokenizer.apply_chat_template(MSGS, add_generation_prompt=True, tools=TOOLS,
                                               chat_template=TEMPLATE)
    body = r.json()
    assert body["usage"]["prompt_tokens"] == len(want)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "OK."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # tool_choice "none": no tools in the prompt, the text is returned as it is
    r2 = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "tool_choice": "none"}).json()
    assert r2["usage"]["prompt_tokens"] < len(want)
    assert r2["choices"][0]["message"]["content"] == SCRIPT and "tool_calls" not in r2["choices"][0]["message"]


def test_streamed_tool_calls(tool_app):
    c, _, _ = tool_app
    with c.stream("POST", "/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
    deltas = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert content == "OK."
    # the first delta of a call names it, later ones carry only the next arguments piece
    first, *rest = deltas
    assert first["index"] == 0 and first["type"] == "function" and first["function"]["name"] == "get_weather"
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    args = "".join(d["function"]["arguments"] for d in deltas)
    whole = c.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS}).json()
    assert args == whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"city": "Paris"}
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "tool_calls"


def test_tool_results_in_the_history(tool_app):
    c, model, _ = tool_app
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}]
    r = c.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    rendered = model.tokenizer.apply_chat_template(
        [MSGS[0], {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'}],
        add_generation_prompt=True, tools=TOOLS, chat_template=TEMPLATE, tokenize=False)
    assert '<tool_call>get_weather{"city": "Paris"}</tool_call>' in rendered  # arguments as an object
    assert r.json()["usage"]["prompt_tokens"] == len(model.tokenizer.encode(rendered, add_special_tokens=False))


@pytest.mark.parametrize("body, param", [
    ({"messages": MSGS, "tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"messages": MSGS, "tools": [{"type": "retrieval"}]}, "tools"),
    ({"messages": MSGS, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"messages": MSGS[:0] + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400(tool_app, body, param):
    c, _, _ = tool_app
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert param in r.json()["error"]["message"]


def _nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "auto", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": _nested(120)}}]},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": MSGS, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": _nested(120)}}]},
     "tools.0.function.parameters"),
    ("/v1/responses", {"input": "hi", "tools": [
        {"type": "function", "name": "f", "strict": True, "parameters": _nested(120)}]},
     "tools.0.parameters"),
    ("/v1/messages", {"messages": MSGS, "max_tokens": 4, "tool_choice": {"type": "any"},
                      "tools": [{"name": "f", "input_schema": _nested(120)}]}, "tools.0.input_schema"),
])
def test_tool_schemas_are_held_to_the_schema_limits(tool_app, route, body, param):
    """A tool's schema costs what a response_format schema does: beyond the documented
    depth (grammar_guard.MAX_SCHEMA_DEPTH) it is a 400 naming the tool, on every route and
    whatever tool_choice is (with "auto" nothing compiles it, the limit still holds)."""
    c, _, _ = tool_app
    r = c.post(route, json=body)
    assert r.status_code == 400, r.text
    assert param in r.text and "deep" in r.text


def test_a_template_that_raises_is_a_400_not_a_500(tmp_path):
    from fastapi.testclient import TestClient

    folder = write_tiny_model(tmp_path / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% for m in messages %}{% if m.tool_calls %}"
                            "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
                            "{% endif %}{{ m.content }}{% endfor %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = fx_engine.Engine(fx_engine.load(folder), max_rows=1)
    engine.start()
    with TestClient(create_app(engine, "tiny")) as c:
        bad = c.post("/v1/chat/completions", json={"messages": [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "x", "type": "function",
             "function": {"name": "f", "arguments": "{}"}}]}], "max_tokens": 2})
        ok = c.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 2})
    engine.close()
    assert bad.status_code == 400 and "length 9" in bad.json()["error"]["message"]
    assert ok.status_code == 200


def test_full_queue_is_429_with_retry_after(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = fx_engine.Engine(model, max_rows=1, max_queue=1)  # not started: the queue stays full
    waiting = engine.submit([5, 6, 7], max_tokens=2)
    app = create_app(engine, "tiny")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    waiting.cancel()
    engine.close(wait=False)


# ------------------------------------------------------------------------------------------
# Tool-call arguments streamed as they are generated, through the official SDKs' stream
# helpers on every route; the oracle is the same route's non-streamed answer
# ------------------------------------------------------------------------------------------

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                           "note": {"type": "string"}}, "required": ["city"]}
TWO_CALLS = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3, '
             '"note": "caf\\u00e9 \\"au lait\\""}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')


@pytest.fixture(scope="module")
def two_calls(tiny_folder):
    """An in-process server whose model writes some text, then two calls of get_weather."""
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=4, prefill_chunk=64)
    engine.script = model.tokenizer.encode(TWO_CALLS, add_special_tokens=False)
    assert model.tokenizer.decode(engine.script) == TWO_CALLS
    app = create_app(engine, "tiny", defaults={"max_tokens": 256}, chat_template=TEMPLATE)
    engine.start()
    with TestClient(app) as c:
        yield c
    engine.close()


def test_openai_sdk_streams_tool_call_arguments(two_calls):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=two_calls, max_retries=0)
    kw = dict(model="tiny", messages=MSGS, tools=[{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}}])
    whole = client.chat.completions.create(**kw).choices[0]
    want = [(tc.function.name, tc.function.arguments) for tc in whole.message.tool_calls]
    assert len(want) == 2 and json.loads(want[0][1])["note"] == 'café "au lait"'
    with client.chat.completions.stream(**kw) as s:
        events = list(s)
        final = s.get_final_completion().choices[0]
    kinds = [e.type for e in events]
    pieces = [[e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"
               and e.index == k] for k in range(2)]
    assert len(pieces[0]) > 1  # arguments several tokens long arrive in several deltas
    assert ["".join(p) for p in pieces] == [a for _, a in want]
    assert [(e.name, e.arguments) for e in events if e.type == "tool_calls.function.arguments.done"] == want
    # the text before the calls streamed as content, ahead of them
    first_call = kinds.index("tool_calls.function.arguments.delta")
    assert "".join(e.delta for e in events[:first_call] if e.type == "content.delta") == "Let me check."
    assert final.message.content == whole.message.content
    assert [(tc.function.name, tc.function.arguments) for tc in final.message.tool_calls] == want
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    with client.chat.completions.stream(**kw, parallel_tool_calls=False) as s:
        one = s.get_final_completion().choices[0].message.tool_calls
    assert [(tc.function.name, tc.function.arguments) for tc in one] == want[:1]


def test_anthropic_sdk_streams_tool_use_input(two_calls):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=two_calls, max_retries=0)
    kw = dict(model="tiny", max_tokens=256, messages=MSGS, tools=[
        {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}])
    whole = client.messages.create(**kw)
    chat = two_calls.post("/v1/chat/completions", json={"messages": MSGS, "tools": TOOLS}).json()
    want_args = [tc["function"]["arguments"] for tc in chat["choices"][0]["message"]["tool_calls"]]
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    starts = [e.content_block for e in events if e.type == "content_block_start"]
    assert [b.type for b in starts] == ["text", "tool_use", "tool_use"]
    assert all(b.input == {} for b in starts[1:])
    pieces = [[e.delta.partial_json for e in events if e.type == "content_block_delta"
               and e.index == k and e.delta.type == "input_json_delta"] for k in (1, 2)]
    assert len(pieces[0]) > 1
    assert ["".join(p) for p in pieces] == want_args  # the chat route's final arguments
    def blocks(m):  # (the whitespace between calls is no text block of the stream's own)
        return [(b.type, getattr(b, "text", "").strip(), getattr(b, "name", None), getattr(b, "input", None))
                for b in m.content]

    assert blocks(final) == blocks(whole)
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert all(b.id.startswith("toolu_") for b in final.content[1:])


def test_responses_stream_function_call_arguments(two_calls):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=two_calls, max_retries=0)
    kw = dict(model="tiny", input="Weather in Paris?", tools=[
        {"type": "function", "name": "get_weather", "description": "Weather in a city", "parameters": PARAMS}])
    whole = client.responses.create(**kw)
    want = [(o.name, o.arguments) for o in whole.output if o.type == "function_call"]
    assert len(want) == 2
    with client.responses.stream(**kw) as s:
        events = list(s)
        final = s.get_final_response()
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert [(e.item.name, e.item.arguments) for e in added] == [(n, "") for n, _ in want]
    pieces = [[e.delta for e in events if e.type == "response.function_call_arguments.delta"
               and e.item_id == a.item.id] for a in added]
    assert len(pieces[0]) > 1
    assert ["".join(p) for p in pieces] == [a for _, a in want]
    assert [(e.name, e.arguments) for e in events if e.type == "response.function_call_arguments.done"] == want
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert [(i.id, i.name, i.arguments) for i in done] == [(a.item.id, n, x) for a, (n, x) in zip(added, want)]
    assert [(o.type, o.name, o.arguments) for o in final.output if o.type == "function_call"] == [
        ("function_call", n, a) for n, a in want]
    with client.responses.stream(**kw, parallel_tool_calls=False) as s:
        one = [(o.name, o.arguments) for o in s.get_final_response().output if o.type == "function_call"]
    assert one == want[:1]


def test_calls_apart_by_a_newline_stream_no_content_on_any_route(tiny_folder):
    """Two calls with "\n" between them: the non-streamed content is null (no text block,
    no message item), and so is every stream's."""
    from fastapi.testclient import TestClient

    text = TWO_CALLS.removeprefix("Let me check.")
    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode(text, add_special_tokens=False)
    app = create_app(engine, "tiny", defaults={"max_tokens": 256}, chat_template=TEMPLATE)
    engine.start()
    try:
        with TestClient(app) as c:
            body = {"messages": MSGS, "tools": TOOLS}
            whole = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
            assert whole["content"] is None and len(whole["tool_calls"]) == 2
            lines = c.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines()
            deltas = [json.loads(x[6:])["choices"][0]["delta"] for x in lines
                      if x.startswith("data: {") and json.loads(x[6:])["choices"]]
            assert [d["content"] for d in deltas if d.get("content")] == []  # (the role's "" aside)
            assert sum(len(d.get("tool_calls") or []) for d in deltas) > 2
            ab = {"model": "tiny", "max_tokens": 256, "messages": MSGS, "tools": [
                {"name": "get_weather", "description": "Weather in a city", "input_schema": PARAMS}]}
            assert [b["type"] for b in c.post("/v1/messages", json=ab).json()["content"]] == ["tool_use"] * 2
            events = c.post("/v1/messages", json={**ab, "stream": True}).text
            assert '"type": "text"' not in events and '"type":"text"' not in events
            rb = {"model": "tiny", "input": "Weather in Paris?", "tools": [
                {"type": "function", "name": "get_weather", "parameters": PARAMS}]}
            assert [o["type"] for o in c.post("/v1/responses", json=rb).json()["output"]] == ["function_call"] * 2
            done = [json.loads(x[6:]) for x in c.post("/v1/responses", json={**rb, "stream": True}).text.splitlines()
                    if x.startswith("data: ")]
            assert [o["type"] for o in done[-1]["response"]["output"]] == ["function_call"] * 2
            assert not any(e["type"] == "response.output_text.delta" for e in done)
    finally:
        engine.close()
