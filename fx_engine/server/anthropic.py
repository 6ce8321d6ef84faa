"""The Anthropic Messages API on the same Engine: POST /v1/messages (JSON or its SSE event
stream), POST /v1/messages/count_tokens. What coding agents that run local models speak.

A request becomes the chat the OpenAI routes build (context.py's `chat_prompt`: the model's
chat template, tools in its format or the default tools section, enforced calls for
`tool_choice` any/tool), so both APIs answer the same prompt the same way:
* `system` (a string or text blocks) -> a system message; user text blocks -> user content;
  `tool_result` blocks -> tool messages (before the user's text of that turn); assistant
  `tool_use` blocks -> tool calls; assistant `thinking` blocks are dropped (as Anthropic's
  own API drops earlier turns' thinking); other block types (images, documents) are a 400.
* `tools` [{name, description, input_schema}] -> functions; `tool_choice` auto / any (=
  required) / tool (= a named function) / none, `disable_parallel_tool_use`.
* `thinking` {"type": "enabled"} turns the template's thinking switch on ("disabled" off);
  the reply's reasoning comes back as `thinking` blocks (server/reasoning.py).
* `stop_sequences`, `temperature`, `top_p`, `top_k`, `max_tokens` (required), `metadata`.
  `max_tokens` beyond the context is clamped to the room the prompt leaves (Claude Code
  asks for 32,000 whatever the model); the reply then ends with stop_reason "max_tokens".
* `output_config.format` (json_schema) or its beta spelling `output_format` constrains the
  output. `thread` (server-side threads) is a 400 carrying `error.details.error_code:
  "thread_unsupported_request"`, on which the SDK's tool_runner goes on without a thread;
  `context_management` (context editing) is a 400 that says why.
The reply: `content` blocks (thinking, text, tool_use), `stop_reason` end_turn / max_tokens
/ stop_sequence (with `stop_sequence`) / tool_use, `usage` (input_tokens counts what was not
read from the prefix cache, cache_read_input_tokens what was; the stream's message_start,
sent at the first token, reports them too). A client that leaves frees its row at once.
Errors use Anthropic's shape (`{"type": "error", "error": {"type", "message"}}`), naming
the field; so do the 401, 404 and 413 of every /v1/messages route.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from fx_engine.engine.engine import EngineClosed, QueueFull
from fx_engine.engine.grammar_guard import check_schema
from fx_engine.engine.request import ContextLengthExceeded, context_limit
from fx_engine.server.context import Ctx, ServerContext, prompt_length
from fx_engine.server.media import TEXT_ONLY
from fx_engine.server.protocol import ANTHROPIC_KINDS as _KINDS
from fx_engine.server.protocol import (EventStream, _Body, anthropic_error, failure, request_salt, results,
                                      speculation,
                                      room_left, server_defaults, sse)
from fx_engine.server.reasoning import ReasoningStream, template_switches
from fx_engine.server.reasoning import split as split_reasoning
from fx_engine.server.tools import ToolCallStream, parse_tool_calls, reply_parts

router = APIRouter()


class AnthropicMessage(BaseModel):
    """One turn: a string or content blocks (checked by `to_chat`). Lenient about extra
    keys, as clients send back what the API returned (e.g. `cache_control` on blocks)."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(_Body):
    """POST /v1/messages (see the module docstring)."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    # the structured-outputs beta's spelling of output_config.format (litellm sends it)
    output_format: dict[str, Any] | None = None
    # Anthropic's server-side threads: a 400 the SDK understands (see `unsupported_thread`)
    thread: Any = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Prompt caching is automatic here (the prefix cache): the hint asks for nothing more.
    cache_control: dict[str, Any] | None = None
    speed: Literal["standard"] | None = None
    user_profile_id: str | None = Field(default=None, max_length=256)
    # fx-engine's field: false runs this request without the server's speculative decoding
    # (the same output, at plain decoding's speed)
    speculative_decoding: bool | None = None

class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


def unsupported_thread(thread: Any) -> JSONResponse | None:
    """Server-side threads (the SDK's tool_runner and `beta.messages.thread` send `thread`)
    are not kept here: a 400 with the error code on which the SDK resends the turn with the
    whole history and no thread (its lib/threads/_thread_state.py). None: no thread asked."""
    if thread is None or thread is False:
        return None
    return anthropic_error(400, "thread: server-side threads are not supported (nothing is stored): "
                           "send the whole conversation in messages",
                           details={"error_code": "thread_unsupported_request", "unsupported": ["thread"]})


def _output_format(body: Any) -> Any:
    """The requested JSON output format: output_config.format, or its beta spelling
    `output_format` (the same object); both at once is a 400."""
    fmt = (body.output_config or {}).get("format")
    if body.output_format is not None:
        if fmt is not None:
            raise ValueError("output_format: give output_config.format or output_format, not both")
        return body.output_format
    return fmt


class _Started:
    """A handle whose first event was awaited (the request was admitted: its cached prefix
    is known); `aiter()` replays that event, then the rest."""

    def __init__(self, handle: Any):
        self._handle, self._events, self._first = handle, handle.aiter(), []

    async def start(self) -> None:
        async for ev in self._events:
            self._first.append(ev)
            return

    async def aiter(self):
        for ev in self._first:
            yield ev
        async for ev in self._events:
            yield ev

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or text blocks joined (other block types: ValueError naming them)."""
    if isinstance(blocks, str):
        return blocks
    out = []
    for j, b in enumerate(blocks or ()):
        if not isinstance(b, dict) or b.get("type") != "text":
            kind = b.get("type") if isinstance(b, dict) else type(b).__name__
            raise ValueError(f"{where}[{j}].type: {kind!r} is not supported here (text only)")
        out.append(str(b.get("text", "")))
    return "".join(out)


def _result_content(blocks: Any, where: str, vision: bool) -> str | list[dict[str, Any]]:
    """A tool_result's content: a string, text blocks joined, or (with image blocks: a
    screenshot a tool returned) its text and image parts as a list."""
    if isinstance(blocks, str) or not any(isinstance(b, dict) and b.get("type") == "image" for b in blocks or ()):
        return _text_of(blocks, where)
    parts = []
    for j, b in enumerate(blocks):
        kind = b.get("type") if isinstance(b, dict) else type(b).__name__
        if kind == "image":
            if not vision:
                raise ValueError(f"{where}[{j}].type: 'image': {TEXT_ONLY}")
            parts.append(b)
        elif kind == "text":
            parts.append({"type": "text", "text": str(b.get("text", ""))})
        else:
            raise ValueError(f"{where}[{j}].type: {kind!r} is not supported here (text, image)")
    return parts


def to_chat(body: Any, vision: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, Any,
                                                     bool | None]:
    """(OpenAI-shaped messages, tools, tool_choice, parallel_tool_calls) of a request.
    vision: whether the model takes images (else an image block is a 400 naming it)."""
    msgs: list[dict[str, Any]] = []
    if body.system:
        msgs.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for j, b in enumerate(m.content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append({"type": "text", "text": str(b.get("text", ""))})
            elif kind == "image" and m.role == "user":  # (base64 or url source: read in chat_prompt)
                if not vision:
                    raise ValueError(f"{where}[{j}].type: 'image': {TEXT_ONLY}")
                text.append(b)
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                    raise ValueError(f"{where}[{j}]: a tool_use block needs a name and an object input")
                calls.append({"id": str(b.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                              "type": "function",
                              "function": {"name": b["name"], "arguments": b.get("input", {})}})
            elif kind == "tool_result" and m.role == "user":
                content = _result_content(b.get("content", ""), f"{where}[{j}].content", vision)
                if b.get("is_error"):
                    content = (f"Error: {content}" if isinstance(content, str)
                               else [{"type": "text", "text": "Error: "}, *content])
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                                "content": content})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier turns' thinking does not go back into the prompt
            else:
                raise ValueError(f"{where}[{j}].type: {kind!r} is not supported in a "
                                 f"{m.role} message")
        msgs += results
        if text or calls or not results:
            images = any(p["type"] == "image" for p in text)
            msg: dict[str, Any] = {"role": m.role,
                                   "content": text if images else "".join(p["text"] for p in text)}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
                raise ValueError(f"tools[{i}]: only custom tools with a name and an input_schema "
                                 f"are supported (got type {t.get('type')!r})")
            # its cost, under this route's name for it (chat_prompt checks it again, cheaply)
            check_schema(f"tools.{i}.input_schema", t.get("input_schema"))
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    choice, parallel = None, None
    tc = body.tool_choice
    if tc is not None:
        kind = tc.get("type")
        if kind not in ("auto", "any", "tool", "none"):
            raise ValueError(f"tool_choice.type: must be auto, any, tool or none, got {kind!r}")
        if kind != "none" and not tools:
            raise ValueError("tool_choice: requires tools")
        parallel = False if tc.get("disable_parallel_tool_use") else None
        if kind == "tool":
            name = tc.get("name")
            if name not in {t["function"]["name"] for t in tools or ()}:
                raise ValueError(f"tool_choice.name: no tool named {name!r} in tools")
            choice = {"type": "function", "function": {"name": name}}
        else:
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    if choice == "none":
        tools = None
    return msgs, tools, choice, parallel


def _blocks(reasoning: str, text: str, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reasoning:
        out.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text.strip() or not (calls or reasoning):
        out.append({"type": "text", "text": text})
    for c in calls:
        out.append({"type": "tool_use", "id": "toolu_" + c["id"].removeprefix("call_"),
                    "name": c["function"]["name"], "input": json.loads(c["function"]["arguments"])})
    return out


def _stop(reason: str, stop_string: str | None, calls: bool) -> tuple[str, str | None]:
    if calls and reason == "stop":
        return "tool_use", None
    if reason == "length":
        return "max_tokens", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": output}


def _sse(event: str, data: dict[str, Any]) -> str:
    return sse(data, event)


def _prompt_of(ctx: ServerContext, body: Any, kw: dict[str, Any]) -> list[int]:
    """The prompt ids of a request (of /v1/messages or its count_tokens); adds its output
    constraint to `kw`."""
    msgs, tools, choice, parallel = to_chat(body, ctx.model.vision is not None)
    targs: dict[str, Any] = {}
    th = body.thinking
    if th is not None:
        kind = th.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ValueError(f"thinking.type: must be enabled, disabled or adaptive, got {kind!r}")
        if ctx.think_fmt is None and kind == "enabled":
            raise ValueError("thinking: this model's chat template has no thinking switch")
        if kind != "adaptive":  # adaptive: the model's (template's) own default
            targs["enable_thinking"] = kind == "enabled"
    oc = body.output_config or {}
    extra = sorted(set(oc) - {"effort", "format"})
    if extra:
        raise ValueError(f"output_config.{extra[0]}: unknown field")
    if oc.get("effort") is not None:
        if oc["effort"] not in ("low", "medium", "high", "xhigh", "max"):
            raise ValueError(f"output_config.effort: must be low, medium, high, xhigh or max, "
                             f"got {oc['effort']!r}")
        effort = {"xhigh": "high", "max": "high"}.get(oc["effort"], oc["effort"])
        targs.update(template_switches(ctx.template, effort, "output_config.effort"))
    fmt = _output_format(body)
    if fmt is not None:
        field = "output_format" if body.output_format is not None else "output_config.format"
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or "schema" not in fmt:
            raise ValueError(f'{field}: expected {{"type": "json_schema", "schema": {{...}}}}')
        from fx_engine.engine.constraints import parse_constraint

        if choice not in (None, "auto", "none"):
            raise ValueError(f"{field}: cannot be combined with tool_choice "
                             "any/tool (give one output constraint)")
        kw["constraint"] = parse_constraint(json_schema=fmt["schema"],
                                            names={"json_schema": f"{field}.schema"})
    return ctx.chat_prompt(msgs, tools, choice, parallel, targs, kw)


async def _submit(ctx: ServerContext, request: Request, body: Any) -> tuple[list[Any], set[str] | None]:
    defaults = ctx.defaults

    def work() -> list[Any]:
        kw: dict[str, Any] = {"max_tokens": body.max_tokens}
        for name, value in (("temperature", body.temperature), ("top_p", body.top_p),
                            ("top_k", body.top_k)):
            value = defaults.get(name) if value is None else value
            if value is not None:
                kw[name] = value
        if body.stop_sequences:
            kw["stop"] = body.stop_sequences
        speculation(kw, defaults, body.speculative_decoding)
        server_defaults(kw, defaults)
        ids = _prompt_of(ctx, body, kw)
        # the context the engine enforces: the model's, or serve's --max-kv-size
        kw["max_tokens"] = room_left(body.max_tokens, prompt_length(ids), context_limit(ctx.model)[0])
        kw["cache_salt"] = request_salt(request, None)  # the tenant's scope
        kw["adapter"] = ctx.adapter_of(body.model)  # other names: the base
        return ctx.engine.submit_many(ids, [kw])

    handles = await run_in_threadpool(work)
    names = {t["name"] for t in body.tools} if body.tools and (
        body.tool_choice or {}).get("type") != "none" else None
    return handles, names


async def _guarded(ctx: ServerContext, request: Request, body: Any):
    try:
        return await _submit(ctx, request, body), None
    except QueueFull as e:
        return None, anthropic_error(429, str(e), {"Retry-After": "1"})
    except EngineClosed as e:
        return None, anthropic_error(503, str(e))
    except ContextLengthExceeded as e:
        if e.prompt_tokens is None or e.prompt_tokens <= e.limit:
            return None, anthropic_error(400, str(e))
        # Anthropic's wording, which Claude Code reads as "compact the conversation"
        return None, anthropic_error(400, f"prompt is too long: {e.prompt_tokens} tokens > "
                                          f"{e.limit} maximum ({e})")
    except ValueError as e:
        return None, anthropic_error(400, str(e))
    except Exception as e:  # a template that cannot render these messages
        return None, anthropic_error(400, f"messages: the chat template failed: {e}")


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, ctx: Ctx):
    try:
        ids = await run_in_threadpool(_prompt_of, ctx, body, {})
    except Exception as e:
        return anthropic_error(400, str(e))
    return {"input_tokens": prompt_length(ids)}


@router.post("/v1/messages")
async def messages(request: Request, body: MessagesRequest, ctx: Ctx):
    refused = unsupported_thread(body.thread)
    if refused is not None:
        return refused
    got, err = await _guarded(ctx, request, body)
    if err is not None:
        return err
    (handles, names) = got
    h = handles[0]
    ctx.metrics.requests += 1
    mid = f"msg_{uuid.uuid4().hex[:24]}"
    inside = ctx.in_reasoning(h.prompt_token_ids)
    one_call = bool((body.tool_choice or {}).get("disable_parallel_tool_use"))
    if body.stream:
        return EventStream(_events(ctx, request, h, mid, names, inside, one_call,
                                   ctx.shown_model(body.model)),
                           media_type="text/event-stream",
                           background=BackgroundTask(lambda: h.done or h.cancel()))
    try:
        outs = await results(request, [h])  # None: the client left
    except Exception as e:
        return anthropic_error(*failure(e)[:2])
    finally:
        if not h.done:
            h.cancel()
    if outs is None:
        return anthropic_error(499, "client disconnected")
    out = outs[0]
    ctx.metrics.observe(out)
    reasoning, text = split_reasoning(ctx.think_fmt, out.text, inside)
    content, calls = parse_tool_calls(text, names) if names is not None else (text, [])
    if one_call:
        calls = calls[:1]
    stop_reason, stop_seq = _stop(out.finish_reason, out.stop_string, bool(calls))
    return {"id": mid, "type": "message", "role": "assistant", "model": ctx.shown_model(body.model),
            "content": _blocks(reasoning, content, calls), "stop_reason": stop_reason,
            "stop_sequence": stop_seq,
            "usage": _usage(out.usage.prompt_tokens, out.usage.cached_tokens,
                            out.usage.completion_tokens)}


async def _events(ctx: ServerContext, request: Request, h: Any, mid: str, names: set[str] | None,
                  inside: bool, one_call: bool, shown: str):
    """Anthropic's event stream: message_start, per block content_block_start / deltas
    / content_block_stop, message_delta (stop_reason, usage), message_stop."""
    think = ReasoningStream(ctx.think_fmt, inside)
    tools = ToolCallStream(names, 1 if one_call else None) if names is not None else None
    block = {"index": -1, "type": None}

    def open_block(kind: str, extra: dict[str, Any]) -> list[str]:
        out = []
        if block["type"] is not None:
            out.append(_sse("content_block_stop", {"type": "content_block_stop",
                                                   "index": block["index"]}))
        block["index"] += 1
        block["type"] = kind
        out.append(_sse("content_block_start", {"type": "content_block_start",
                                                "index": block["index"],
                                                "content_block": {"type": kind, **extra}}))
        return out

    def piece(kind: str, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if block["type"] != kind:
            out += open_block(kind, {"thinking": "", "signature": ""} if kind == "thinking"
                              else {"text": ""})
        key, dtype = ("thinking", "thinking_delta") if kind == "thinking" else ("text", "text_delta")
        out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": block["index"],
                                                "delta": {"type": dtype, key: text}}))
        return out

    try:
        # message_start waits for the first token: the request is admitted by then, so
        # its usage can say how much of the prompt the prefix cache held
        started = _Started(h)
        await started.start()
        yield _sse("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": shown, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": _usage(len(h.prompt_token_ids), h.cached_tokens, 0)}})
        final, calls, ended = None, [], False
        async for part in reply_parts(request, started, think, tools):
            if part[0] == "end":
                _, final, calls = part
                ended = True
            elif part[0] == "call":  # a tool_use block, its input streamed as written
                for line in open_block("tool_use", {"id": "toolu_" + part[2].removeprefix("call_"),
                                                    "name": part[3], "input": {}}):
                    yield line
            elif part[0] == "args":
                yield _sse("content_block_delta", {"type": "content_block_delta", "index": block["index"],
                                                   "delta": {"type": "input_json_delta", "partial_json": part[2]}})
            else:
                for line in piece("thinking" if part[0] == "reasoning" else "text", part[1]):
                    yield line
        if not ended:
            return  # the client went away
        if block["type"] is not None:
            yield _sse("content_block_stop", {"type": "content_block_stop", "index": block["index"]})
        usage = final.usage if final is not None else None
        stop_reason, stop_seq = _stop(final.finish_reason if final is not None else "stop",
                                      getattr(final, "stop_string", None), bool(calls))
        yield _sse("message_delta", {"type": "message_delta",
                                     "delta": {"stop_reason": stop_reason, "stop_sequence": stop_seq},
                                     "usage": _usage(len(h.prompt_token_ids), h.cached_tokens,
                                                     usage.completion_tokens if usage else 0)})
        yield _sse("message_stop", {"type": "message_stop"})
    except asyncio.CancelledError:
        raise
    except Exception as e:
        status, msg, _ = failure(e)
        yield _sse("error", {"type": "error", "error": {
            "type": _KINDS.get(status, "api_error"), "message": msg}})
    finally:
        if not h.done:
            h.cancel()

