"""Chat templates: render a model's Jinja chat template the way transformers does.

A model's chat template is the only authority on how a conversation becomes a prompt, and
models are trained on prompts rendered by transformers' `apply_chat_template`. Any difference
in whitespace handling, filters or globals silently changes the prompt, so this module copies
transformers' rendering semantics (checked against it in tests/models/test_chat_template.py):

* `jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with the
  `loopcontrols` extension: templates come from model files and are untrusted code.
* globals `raise_exception(msg)` (raises `jinja2.exceptions.TemplateError`), `strftime_now(fmt)`,
  a restricted `dict` and a `namespace` that refuses underscore attributes (sandbox hardening);
* the `tojson` filter as transformers defines it (`json.dumps`, no HTML escaping, non-ASCII kept);
* a `{% generation %}...{% endgeneration %}` tag that renders its body (transformers uses it to
  track assistant tokens; some templates contain it and would not compile without it);
* variables `messages`, `add_generation_prompt`, `tools`, `documents`, the special-token strings
  (`bos_token`, `eos_token`, ... only those the model has) and any extra keyword arguments,
  which override the special tokens like in transformers.

Messages are validated before rendering (a list of dicts with a string `role` and a string or
list-of-parts `content`), so a malformed request fails with an error naming the field, e.g.
`messages[2].role`, instead of an obscure Jinja error or, worse, a silently wrong prompt.
Like transformers, keys whose value is None are dropped and reasoning text given as `thinking`
or `reasoning` is also exposed as `reasoning_content`.

When a model ships no template, `DEFAULT_CHATML_TEMPLATE` (plain ChatML) is used instead; see its
docstring-comment below.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "DEFAULT_CHATML_TEMPLATE",
    "compile_chat_template",
    "normalize_messages",
    "render_chat_template",
    "validate_messages",
]

# Fallback for models without a chat template: ChatML (`<|im_start|>role\ncontent<|im_end|>\n`),
# the most common format among open instruct models. It is a guess, not the model's own format:
# callers that care should check `Tokenizer.chat_template is None`. Content given as a list of
# parts is rendered as the concatenation of its text parts.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] is defined %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Names a message's reasoning text goes by; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


# --------------------------------------------------------------------------------------------
# Validation and normalization of the inputs
# --------------------------------------------------------------------------------------------


def validate_messages(messages: Any) -> None:
    """Raise ValueError naming the offending field if `messages` is not a valid conversation.

    Valid: a non-empty list/tuple of dicts, each with a string `role`, and a `content` that is a
    string or a list of parts (dicts with a string `type`; a `text` part needs a string `text`).
    `content` may be missing or None only on a message carrying `tool_calls` (an assistant turn
    that only calls tools). Other keys are passed to the template untouched.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages is empty: a conversation needs at least one message")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
        role = message.get("role")
        if role is None:
            raise ValueError(f"{where}.role is missing")
        if not isinstance(role, str):
            raise ValueError(f"{where}.role must be a string, got {type(role).__name__}")
        content = message.get("content")
        if content is None:
            # An assistant turn made only of tool calls legitimately has no content.
            if message.get("tool_calls") is None:
                raise ValueError(f"{where}.content is missing (only messages with tool_calls may omit it)")
            continue
        if isinstance(content, str):
            continue
        if isinstance(content, (bytes, Mapping)) or not isinstance(content, Sequence):
            raise ValueError(
                f"{where}.content must be a string or a list of content parts, got {type(content).__name__}"
            )
        for j, part in enumerate(content):
            part_where = f"{where}.content[{j}]"
            if not isinstance(part, Mapping):
                raise ValueError(f"{part_where} must be a dict with a 'type', got {type(part).__name__}")
            part_type = part.get("type")
            if not isinstance(part_type, str):
                raise ValueError(f"{part_where}.type must be a string, got {type(part_type).__name__}")
            if part_type == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"{part_where}.text must be a string for a part of type 'text'")


def _plain(value: Any) -> Any:
    """Deep-copy `value` into plain JSON-like Python types.

    Why: the sandbox only knows which methods of builtin types are unsafe; a rich object (an
    array, an image, a pydantic model) may expose methods that write files. Transformers does the
    same conversion, replacing unknown objects by a placeholder naming their type. The copy also
    guarantees that rendering never mutates the caller's messages.
    """
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic models (e.g. OpenAI SDK messages)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _drop_none(message: Mapping) -> dict:
    return {k: v for k, v in message.items() if v is not None}


def normalize_messages(messages: Any) -> list[dict]:
    """Validate, then return plain copies of the messages as the template should see them.

    Like transformers: keys whose value is None are dropped (templates test `is defined`, and a
    literal None would render as "None"), and reasoning given under any of `_REASONING_FIELDS`
    is exposed as both `reasoning_content` and `thinking`.
    """
    if isinstance(messages, (list, tuple)):
        messages = [_drop_none(m) if isinstance(m, Mapping) else m for m in messages]
    validate_messages(messages)
    normalized = []
    for message in _plain(list(messages)):
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        normalized.append(message)
    return normalized


def _validate_tools(tools: Any) -> list[dict] | None:
    """Tools must be JSON-schema dicts (we do not derive schemas from Python callables)."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of JSON-schema dicts, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValueError(f"tools[{i}] must be a JSON-schema dict, got {type(tool).__name__}")
    return _plain(list(tools))


# --------------------------------------------------------------------------------------------
# The Jinja environment (mirrors transformers' _cached_compile_jinja_template)
# --------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format (e.g. bad role order).
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # Jinja's builtin tojson HTML-escapes '<', '>', '&' and "'", which would corrupt tool schemas;
    # transformers overrides it with plain json.dumps and so must we to produce identical prompts.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    # Llama-3.x templates put today's date into the system prompt.
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the `dict` type itself (sandbox hardening)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attributes (CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, got {name!r}"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}body{% endgeneration %}` renders `body`.

    Transformers uses the tag to find assistant tokens for training masks; inference only needs
    the text, but templates that contain the tag must still compile.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile (and cache: a server renders the same template for every request) a template."""
    if not isinstance(source, str):
        raise TypeError(f"chat template must be a string, got {type(source).__name__}")
    return _environment().from_string(source)


def render_chat_template(
    messages: Any,
    template: str | None = None,
    *,
    add_generation_prompt: bool = False,
    tools: Any = None,
    documents: Any = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render `messages` with `template` (or `DEFAULT_CHATML_TEMPLATE` when None).

    `special_tokens` maps variable names like `bos_token` to token strings; None values are left
    undefined, as transformers does for tokens a model lacks. `template_kwargs` become extra
    template variables and override `special_tokens`. Raises ValueError naming the field for
    invalid messages/tools and `jinja2.exceptions.TemplateError` when the template itself calls
    `raise_exception` (or fails to compile).
    """
    chat = normalize_messages(messages)
    tool_schemas = _validate_tools(tools)
    if documents is not None:
        if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
            raise ValueError(f"documents must be a list of dicts, got {type(documents).__name__}")
        for i, doc in enumerate(documents):
            if not isinstance(doc, Mapping):
                raise ValueError(f"documents[{i}] must be a dict, got {type(doc).__name__}")
        documents = _plain(list(documents))
    variables: dict[str, Any] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
    variables.update(_plain(template_kwargs))
    compiled = compile_chat_template(DEFAULT_CHATML_TEMPLATE if template is None else template)
    return compiled.render(
        messages=chat,
        tools=tool_schemas,
        documents=documents,
        add_generation_prompt=bool(add_generation_prompt),
        **variables,
    )
