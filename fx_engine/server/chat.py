"""OpenAI's chat completions: POST /v1/chat/completions (JSON, or SSE chunks ending in
`data: [DONE]`): the model's chat template (context.py's `chat_prompt`), tools and
tool_choice (server/tools.py), the reply's thinking apart (server/reasoning.py), logprobs,
n choices, every sampling field and output constraint (generation.py)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, field_validator

from fx_engine.server.context import Ctx
from fx_engine.server.media import TEXT_ONLY
from fx_engine.server.generation import _sampling_kwargs, _Sampling, run
from fx_engine.server.protocol import _Base, _error
from fx_engine.server.reasoning import template_switches

router = APIRouter()


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v: Any) -> Any:
        """A text part's text is a string (not rendered as the repr of whatever came)."""
        for i, part in enumerate(v if isinstance(v, list) else ()):
            if part.get("type") == "text" and not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string `text`")
        return v


class FunctionSpec(_Base):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Base):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # mlx_lm.server's per-request variables
    # a template switch (gpt-oss's reasoning_effort; enable_thinking elsewhere); see reasoning.py
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None


def _openai_messages(messages: list[ChatMessage], vision: bool = False) -> list[dict[str, Any]]:
    """Chat messages as the template gets them (OpenAI's developer role is a system one).
    vision: whether the model takes images (else an image part is a 400 naming it)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role if m.role != "developer" else "system",
                               "content": _content(m, f"messages[{i}].content", vision)}
        for extra in ("name", "tool_calls", "tool_call_id"):
            if getattr(m, extra) is not None:
                msg[extra] = getattr(m, extra)
        out.append(msg)
    return out


def _content(m: ChatMessage, where: str, vision: bool) -> str | list[dict[str, Any]]:
    """A message's content for the template: a string, or (with image parts) its text and
    image parts as a list (server/context.py's `chat_prompt` makes the image prompt)."""
    if m.content is None or isinstance(m.content, str):
        return m.content or ""
    parts, images = [], False
    for i, p in enumerate(m.content):  # OpenAI content parts: text and image_url
        kind = p.get("type")
        if kind == "image_url":
            if not vision:
                raise ValueError(f"{where}[{i}].type: {kind!r}: {TEXT_ONLY}")
            images = True
        elif kind != "text":
            raise ValueError(f"{where}[{i}].type: {kind!r} is not supported (text, image_url)")
        parts.append(p)
    if images:
        return parts
    return "".join(str(p.get("text", "")) for p in parts)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatRequest, ctx: Ctx):
    use_tools = bool(body.tools) and body.tool_choice != "none"
    if body.top_logprobs and not body.logprobs:
        return _error(400, "top_logprobs: requires logprobs: true", "top_logprobs")
    names = {t.function.name for t in body.tools} if use_tools else None
    choice = body.tool_choice
    if choice not in (None, "none", "auto") and not body.tools:
        return _error(400, "tool_choice: requires tools", "tool_choice")
    if isinstance(choice, dict):
        fn = choice.get("function")
        if (choice.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or set(choice) - {"type", "function"}):
            return _error(400, 'tool_choice: expected "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if fn["name"] not in (names or ()):
            return _error(400, f"tool_choice.function.name: no tool named {fn['name']!r} "
                          "in tools", "tool_choice.function.name")

    def build() -> tuple[Any, dict[str, Any]]:  # on a worker thread
        messages = _openai_messages(body.messages, ctx.model.vision is not None)
        kw = _sampling_kwargs(body, ctx.defaults)
        if body.logprobs:  # the engine reports the chosen token with >= 1 alternative
            kw["logprobs"] = max(1, body.top_logprobs or 0)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if use_tools else None
        ctx.check_template_kwargs(body.chat_template_kwargs)
        targs = {**template_switches(ctx.template, body.reasoning_effort),
                 **(body.chat_template_kwargs or {})}
        return ctx.chat_prompt(messages, tools, choice, body.parallel_tool_calls, targs, kw), kw

    return await run(ctx, request, body, build, chat=True, tool_names=names)

