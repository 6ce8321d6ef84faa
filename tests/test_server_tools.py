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
])


@settings(max_examples=200, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(0, 80), max_size=8))
def test_streamed_parse_equals_whole_parse(text, cuts):
    s = ToolCallStream(NAMES)
    pieces, prev = [], 0
    for c in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    sent = "".join(s.feed(p) for p in pieces)
    rest, calls = s.finish()
    content, whole = parse_tool_calls(text, NAMES)
    assert sent + rest == content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]
    for marker in ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"'):
        if whole:
            assert marker not in sent


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
def tool_app(tmp_path_factory):
    from fastapi.testclient import TestClient

    model = fx_engine.load(write_tiny_model(tmp_path_factory.mktemp("tools") / "m"))
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
    calls = [tc for ch in chunks if ch["choices"] for tc in ch["choices"][0]["delta"].get("tool_calls", [])]
    assert content == "OK."
    assert [(tc["index"], tc["function"]["name"], json.loads(tc["function"]["arguments"])) for tc in calls] == [
        (0, "get_weather", {"city": "Paris"})]
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


def test_full_queue_is_429_with_retry_after(tmp_path):
    from fastapi.testclient import TestClient

    model = fx_engine.load(write_tiny_model(tmp_path / "m"))
    engine = fx_engine.Engine(model, max_rows=1, max_queue=1)  # not started: the queue stays full
    waiting = engine.submit([5, 6, 7], max_tokens=2)
    app = create_app(engine, "tiny")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["type"] == "rate_limit_error"
    waiting.cancel()
    engine.close(wait=False)
