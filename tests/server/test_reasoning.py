"""Reasoning apart from the answer: the parser (whole vs streamed in any pieces), and the
server's `reasoning_content` (chat completions, streamed and not) on a model scripted to
think first (test_tool_calls.ScriptedEngine), the template switches."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.server.app import create_app
from fx_engine.server.reasoning import ReasoningStream, reasoning_format, split, template_switches

from tests.server.test_tool_calls import ScriptedEngine

CASES = [
    ("think", False, "<think>Two and two.</think>\n\nIt is 4.", ("Two and two.", "It is 4.")),
    ("think", False, "  <think>a</think>b", ("a", "b")),
    ("think", False, "No thinking here.", ("", "No thinking here.")),
    ("think", False, "<think>cut off", ("cut off", "")),
    ("think", True, "Already thinking.</think>Answer.", ("Already thinking.", "Answer.")),
    ("think", True, "Never closed", ("Never closed", "")),
    ("harmony", False, "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Done.<|return|>", ("Think.", "Done.")),
    ("harmony", False, "<|channel|>final<|message|>Only the answer.", ("", "Only the answer.")),
    (None, False, "<think>x</think>y", ("", "<think>x</think>y")),
    ("harmony", False, "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant"
     "<|channel|>final<|message|>Done.", ("", "Let me check.Done.")),
    ("harmony", False, "<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary"
     ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     ("Weather.", '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
      '<|message|>{"city": "Paris"}<|call|>')),
]


@pytest.mark.parametrize("fmt,inside,text,want", CASES)
def test_split(fmt, inside, text, want):
    assert split(fmt, text, inside) == want


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(0, 80), max_size=8))
def test_streamed_split_equals_whole(case, cuts):
    fmt, inside, text, want = case
    s = ReasoningStream(fmt, inside)
    r, c, at = [], [], 0
    for cut in sorted(cuts) + [len(text)]:
        a, b = s.feed(text[at:max(at, cut)])
        r.append(a)
        c.append(b)
        at = max(at, cut)
    a, b = s.finish()
    assert ("".join(r) + a, "".join(c) + b) == want


def test_template_detection_and_switches():
    assert reasoning_format("{{ '<think>' }}") == "think"
    assert reasoning_format("<|channel|>final") == "harmony"
    assert reasoning_format("{{ messages }}") is None
    assert template_switches("{% if enable_thinking %}", "none") == {"enable_thinking": False}
    assert template_switches("{% if enable_thinking %}", "high") == {"enable_thinking": True}
    assert template_switches("{{ reasoning_effort }}", "low") == {"reasoning_effort": "low"}
    with pytest.raises(ValueError, match="reasoning_effort"):
        template_switches("{{ messages }}", "low")


TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
            "{% else %}<think>\n{% endif %}{% endif %}")
SCRIPT = "The user asks for a sum.</think>\n\nIt is 4."


@pytest.fixture(scope="module")
def app(tiny_folder):
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode(SCRIPT, add_special_tokens=False)
    app = create_app(engine, "tiny", defaults={"max_tokens": 64}, chat_template=TEMPLATE)
    engine.start()
    with TestClient(app) as c:
        yield c
    engine.close()


MSGS = [{"role": "user", "content": "2 + 2?"}]


def test_reasoning_content_apart_from_the_answer(app):
    r = app.post("/v1/chat/completions", json={"messages": MSGS}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user asks for a sum." and msg["content"] == "It is 4."


def test_streamed_reasoning_content(app):
    with app.stream("POST", "/v1/chat/completions", json={"messages": MSGS, "stream": True}) as r:
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user asks for a sum."
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


def test_reasoning_effort_switches_thinking_off(app):
    """With thinking off the prompt holds an empty think block: the reply is all answer."""
    r = app.post("/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": "none"}).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] is None and msg["content"] == SCRIPT
    r = app.post("/v1/chat/completions", json={"messages": MSGS, "reasoning_effort": "huge"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


HARMONY = ("{# channels: <|channel|>analysis, commentary, final #}"
           "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
           "{% if tools %}tools{% endif %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_SCRIPT = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant'
                  '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}')
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_gpt_oss_harmony_tool_calls(stream, tiny_folder):
    """A gpt-oss (harmony) reply: the analysis comes back as reasoning_content and the
    commentary message to functions.get_weather as a tool call."""
    from fastapi.testclient import TestClient

    model = fx_engine.load(tiny_folder())
    engine = ScriptedEngine(model, max_rows=2, prefill_chunk=64)
    engine.script = model.tokenizer.encode(HARMONY_SCRIPT, add_special_tokens=False)
    app = create_app(engine, "tiny", defaults={"max_tokens": 512}, chat_template=HARMONY)
    engine.start()
    try:
        with TestClient(app) as c:
            body = {"messages": MSGS, "tools": WEATHER, "stream": stream}
            if not stream:
                ch = c.post("/v1/chat/completions", json=body).json()["choices"][0]
                msg, finish, calls = ch["message"], ch["finish_reason"], ch["message"]["tool_calls"]
                reasoning = msg["reasoning_content"]
            else:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
                deltas = [ch["choices"][0] for ch in chunks if ch["choices"]]
                reasoning = "".join(d["delta"].get("reasoning_content", "") for d in deltas)
                calls = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
                finish = deltas[-1]["finish_reason"]
        assert reasoning == "Need the weather." and finish == "tool_calls"
        [call] = calls
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    finally:
        engine.close()


def test_harmony_required_tool_grammar_compiles():
    import llguidance as llg

    from fx_engine.server.tools import tool_call_grammar

    class Tok:  # no special tokens: the markers are literal text
        special_ids = frozenset()

        @staticmethod
        def encode(text, add_special_tokens=False):
            return list(text.encode())

    g = tool_call_grammar(WEATHER, "required", None, "harmony", Tok)
    assert llg.LLMatcher.validate_grammar(llg.grammar_from("lark", g)) == ""
