"""OpenAI's Responses API on the same Engine: POST /v1/responses (JSON, or its typed event
stream). Stateless: nothing is stored, so a conversation is sent whole in `input` (a
`previous_response_id`, `conversation`, `background` or `store: true` is a 400 that says so).

A request becomes the chat the other routes build (context.py's `chat_prompt`):
* `instructions` -> a system message; `input` a string (one user message) or items:
  messages (`role` user/assistant/system/developer, content a string or input_text /
  output_text parts), `function_call` items (earlier calls) and `function_call_output`
  items (their results); `reasoning` items from earlier turns are dropped.
* `tools` (function tools: name, description, parameters, strict), `tool_choice` (auto,
  none, required, {"type": "function", "name"}), `parallel_tool_calls`;
* `text.format` (text, json_object, json_schema with name/schema/strict) constrains the
  output (engine/constraints.py); `reasoning.effort` sets the template's switch;
* `max_output_tokens`, `temperature`, `top_p`; `metadata` and `user` are echoed/logged;
  `prompt_cache_retention` is a hint (the prefix cache keeps what its budget allows).
* `include: ["message.output_text.logprobs"]` (with `top_logprobs` 0-20 alternatives):
  the message's `output_text` carries its tokens' logprobs (streamed: each delta its own);
  `top_logprobs` alone implies that include (it is never accepted and then ignored).
* `max_tool_calls`: at most that many function calls in the reply (the first ones).
* `truncation: "auto"`: when the prompt and max_output_tokens exceed the context, the
  fewest oldest input items are dropped (a function_call_output whose call went too);
  `instructions` and the last item always stay.
The output items: a `reasoning` item (the thinking, as reasoning_text), a `message` with
`output_text`, `function_call` items; status `completed`, or `incomplete` with reason
`max_output_tokens`.
"""

from __future__ import annotations

import secrets
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from fx_engine.engine.engine import EngineClosed, QueueFull
from fx_engine.engine.request import ContextLengthExceeded, context_limit
from fx_engine.server.context import Ctx, ServerContext, prompt_length
from fx_engine.server.media import TEXT_ONLY
from fx_engine.server.protocol import (EventStream, _Body, _error, context_error, failure, request_salt, speculation,
                                      results, room_left, server_defaults, sse)
from fx_engine.server.reasoning import ReasoningStream, template_switches
from fx_engine.server.reasoning import split as split_reasoning
from fx_engine.server.tools import ToolCallStream, parse_tool_calls, reply_parts

router = APIRouter()


class ResponsesRequest(_Body):
    """POST /v1/responses (see the module docstring)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None  # include_obfuscation (default off here)
    metadata: dict[str, str] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    # a hint: the prefix cache keeps entries while its budget allows, whichever is asked
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    include: list[Literal["reasoning.encrypted_content", "message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_tool_calls: int | None = Field(default=None, ge=1)
    service_tier: Literal["auto", "default"] | None = None

    # fx-engine's field: false runs this request without the server's speculative decoding
    # (the same output, at plain decoding's speed)
    speculative_decoding: bool | None = None

    @property
    def logprobs(self) -> bool:  # asked for, or implied by top_logprobs (as OpenAI takes it)
        return "message.output_text.logprobs" in (self.include or ()) or self.top_logprobs is not None

    @property
    def call_limit(self) -> int | None:
        """How many function calls a reply may carry (None: any)."""
        return 1 if self.parallel_tool_calls is False else self.max_tool_calls


def _content_text(content: Any, where: str, images: bool = False, vision: bool = False) -> str | list[dict[str, Any]]:
    """A message's content: a string, or text parts joined; with `images` (a message's
    content, not a tool output's), input_image parts too, kept as a list of parts then
    (server/context.py's `chat_prompt` makes the image prompt); vision: whether the model
    takes images (else such a part is a 400 naming it)."""
    if isinstance(content, str):
        return content
    out, has_image = [], False
    for j, part in enumerate(content or ()):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            if not vision:
                raise ValueError(f"{where}[{j}].type: 'input_image': {TEXT_ONLY}")
            if part.get("file_id") is not None:
                raise ValueError(f"{where}[{j}].file_id: files are not supported (give image_url: a data "
                                 "URL or an http(s) URL)")
            out.append(part)
            has_image = True
            continue
        if kind not in ("input_text", "output_text", "text"):
            allowed = "text and input_image parts" if images else "text parts only"
            raise ValueError(f"{where}[{j}].type: {kind!r} is not supported ({allowed})")
        out.append({"type": "text", "text": str(part.get("text", ""))})
    return out if has_image else "".join(p["text"] for p in out)


def to_chat(body: ResponsesRequest, vision: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None,
                                                                   Any]:
    """(OpenAI chat messages, function tools, tool_choice) of a Responses request. vision:
    whether the model takes images."""
    msgs: list[dict[str, Any]] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(
        body.input, str) else body.input
    for i, it in enumerate(items):
        kind = it.get("type", "message") if isinstance(it, dict) else None
        where = f"input[{i}]"
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ValueError(f"{where}.role: must be user, assistant, system or developer")
            msgs.append({"role": "system" if role == "developer" else role,
                         "content": _content_text(it.get("content"), f"{where}.content", images=True, vision=vision)})
        elif kind == "function_call":
            call = {"id": str(it.get("call_id") or it.get("id") or f"call_{uuid.uuid4().hex[:24]}"),
                    "type": "function", "function": {"name": it.get("name"),
                                                     "arguments": it.get("arguments", "{}")}}
            if msgs and msgs[-1]["role"] == "assistant" and "tool_calls" in msgs[-1]:
                msgs[-1]["tool_calls"].append(call)
            else:
                msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out = it.get("output")
            msgs.append({"role": "tool", "tool_call_id": str(it.get("call_id", "")),
                         "content": out if isinstance(out, str) else _content_text(out, f"{where}.output")})
        elif kind == "reasoning":
            continue  # earlier turns' thinking is not sent back to the model
        else:
            raise ValueError(f"{where}.type: {kind!r} is not supported (message, function_call, "
                             "function_call_output, reasoning)")
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise ValueError(f"tools[{i}]: only function tools are supported (got "
                                 f"{t.get('type')!r})")
            params = t.get("parameters") or {"type": "object", "properties": {}}
            if t.get("strict"):
                from fx_engine.engine.constraints import _closed
                from fx_engine.engine.grammar_guard import check_schema

                check_schema(f"tools.{i}.parameters", params)  # before _closed walks it
                params = _closed(params)
            tools.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "", "parameters": params}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ValueError('tool_choice: expected "auto", "none", "required" or '
                             '{"type": "function", "name": ...}')
        if choice["name"] not in {t["function"]["name"] for t in tools or ()}:
            raise ValueError(f"tool_choice.name: no tool named {choice['name']!r} in tools")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "auto", "none", "required"):
        raise ValueError(f"tool_choice: must be auto, none, required or a function, got {choice!r}")
    if choice not in (None, "auto", "none") and not tools:
        raise ValueError("tool_choice: requires tools")
    if choice == "none":
        tools = None
    return msgs, tools, choice


def _truncated(items: list[dict[str, Any]], fits: Any) -> list[dict[str, Any]]:
    """truncation "auto": the input without its fewest oldest items (never the last) for
    `fits(items)` to hold, found by bisection (a prompt is no longer with fewer items); a
    function_call_output whose call was dropped goes too. Nothing fits: the input as is (the
    request's own 400 then says why)."""
    def cut(k: int) -> list[dict[str, Any]]:
        rest = items[k:]
        while len(rest) > 1 and isinstance(rest[0], dict) and rest[0].get("type") == "function_call_output":
            rest = rest[1:]
        return rest

    if fits(items):
        return items
    lo, hi = 1, len(items) - 1  # the answer is in [lo, hi], if hi fits
    if hi < 1 or not fits(cut(hi)):
        return items
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(cut(mid)):
            hi = mid
        else:
            lo = mid + 1
    return cut(hi)


def _logprob_record(lp: Any, top: int) -> dict[str, Any]:
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                             for _, t, v in lp.top[:top]]}


def _text_logprobs(lps: Any, whole: str, text: str, top: int) -> list[dict[str, Any]]:
    """The logprob records of the tokens that wrote `text`, the message part of the
    generated `whole` (the thinking and tool calls split off): the tokens whose text starts
    inside it, by their offsets in `whole`."""
    lps = list(lps or ())
    start = whole.find(text) if text else -1
    if start < 0:
        return [] if not text else [_logprob_record(lp, top) for lp in lps]
    out, at = [], 0
    for lp in lps:
        if start <= at < start + len(text):
            out.append(_logprob_record(lp, top))
        at += len(lp.token)
    return out


class _Tap:
    """A handle whose events' logprob records are kept as they pass (`seen`): a streamed
    message's logprobs."""

    def __init__(self, handle: Any):
        self._handle, self.seen = handle, []

    async def aiter(self):
        async for ev in self._handle.aiter():
            self.seen.extend(ev.logprobs or ())
            yield ev

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def _format_constraint(text: dict[str, Any] | None) -> Any:
    fmt = (text or {}).get("format")
    extra = sorted(set(text or {}) - {"format", "verbosity"})
    if extra:
        raise ValueError(f"text.{extra[0]}: unknown field")
    if (text or {}).get("verbosity") not in (None, "medium"):
        raise ValueError("text.verbosity: not supported")
    if fmt is None or fmt.get("type") == "text":
        return None
    from fx_engine.engine.constraints import parse_constraint

    if fmt.get("type") == "json_object":
        return parse_constraint({"type": "json_object"}, names={"response_format": "text.format"})
    if fmt.get("type") == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return parse_constraint({"type": "json_schema", "json_schema": spec},
                                names={"response_format": "text.format"})
    raise ValueError(f"text.format.type: must be text, json_object or json_schema, got {fmt.get('type')!r}")


def _work(ctx: ServerContext, request: Request, body: ResponsesRequest) -> list[Any]:
    defaults = ctx.defaults
    kw: dict[str, Any] = {"max_tokens": body.max_output_tokens or defaults.get("max_tokens", 512)}
    if body.logprobs:  # the engine reports the chosen token with >= 1 alternative
        kw["logprobs"] = max(1, body.top_logprobs or 0)
    for name, value in (("temperature", body.temperature), ("top_p", body.top_p)):
        value = defaults.get(name) if value is None else value
        if value is not None:
            kw[name] = value
    speculation(kw, defaults, body.speculative_decoding)
    server_defaults(kw, defaults)
    constraint = _format_constraint(body.text)
    if constraint is not None:
        kw["constraint"] = constraint
    extra = sorted(set(body.reasoning or {}) - {"effort", "summary"})
    if extra:
        raise ValueError(f"reasoning.{extra[0]}: unknown field")
    effort = (body.reasoning or {}).get("effort")
    if (body.reasoning or {}).get("summary") not in (None, "auto", "concise", "detailed"):
        raise ValueError("reasoning.summary: must be auto, concise or detailed")
    if effort not in (None, "none", "minimal", "low", "medium", "high"):
        raise ValueError(f"reasoning.effort: must be none, minimal, low, medium or high, got {effort!r}")
    bad = sorted(set(body.stream_options or {}) - {"include_obfuscation"})
    if bad:
        raise ValueError(f"stream_options.{bad[0]}: unknown field")
    targs = template_switches(ctx.template, effort, "reasoning.effort")

    vision = ctx.model.vision is not None

    def prompt(items: Any) -> list[int]:
        msgs, tools, choice = to_chat(body.model_copy(update={"input": items}), vision)
        return ctx.chat_prompt(msgs, tools, choice, body.parallel_tool_calls, targs, dict(kw))

    limit = context_limit(ctx.model)[0]  # the model's, or serve's --max-kv-size
    # no max_output_tokens: the server's default, trimmed to the room the prompt leaves
    # (one the client chose that does not fit is a 400, or truncates with "auto")
    chosen = body.max_output_tokens is not None
    if body.truncation == "auto" and isinstance(body.input, list):
        need = kw["max_tokens"] if chosen else 1

        def fits(items: list[dict[str, Any]]) -> bool:
            try:
                return prompt_length(prompt(items)) + need <= limit + 1
            except ValueError:  # e.g. text that cannot fit the context at all
                return False

        body = body.model_copy(update={"input": _truncated(body.input, fits)})
    msgs, tools, choice = to_chat(body, vision)
    ids = ctx.chat_prompt(msgs, tools, choice, body.parallel_tool_calls, targs, kw)
    if not chosen:
        kw["max_tokens"] = room_left(kw["max_tokens"], prompt_length(ids), limit)
    kw["cache_salt"] = request_salt(request, None)  # the tenant's scope
    kw["adapter"] = ctx.adapter_of(body.model)
    return ctx.engine.submit_many(ids, [kw])


@router.post("/v1/responses")
async def responses(request: Request, body: ResponsesRequest, ctx: Ctx):
    bad = ctx.unknown_model(body.model)
    if bad is not None:
        return bad
    try:
        [h] = await run_in_threadpool(_work, ctx, request, body)
    except QueueFull as e:
        return _error(429, str(e), kind="rate_limit_error", headers={"Retry-After": "1"})
    except EngineClosed as e:
        return _error(503, str(e), kind="server_error")
    except ContextLengthExceeded as e:
        return context_error(e, ctx.model, "input", "max_output_tokens")
    except ValueError as e:
        msg = str(e)
        return _error(400, msg, msg.split(":")[0].split(" ")[0])
    except Exception as e:
        return _error(400, f"input: the chat template failed: {e}", "input")
    ctx.metrics.requests += 1
    names = {t["name"] for t in body.tools} if body.tools and body.tool_choice != "none" else None
    rid = f"resp_{uuid.uuid4().hex[:24]}"
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": ctx.shown_model(body.model),
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning, "store": False, "truncation": body.truncation or "disabled",
            "error": None, "top_logprobs": body.top_logprobs, "max_tool_calls": body.max_tool_calls,
            "user": body.user, "previous_response_id": None}
    inside = ctx.in_reasoning(h.prompt_token_ids)
    if body.stream:
        return EventStream(_events(ctx, request, h, base, names, inside, body.stream_options,
                                   _summarize(body), body.call_limit,
                                   (body.top_logprobs or 0) if body.logprobs else None),
                           media_type="text/event-stream",
                           background=BackgroundTask(lambda: h.done or h.cancel()))
    try:
        outs = await results(request, [h])  # None: the client left
    except Exception as e:
        status, msg, param = failure(e)
        return _error(status, msg, param, kind="server_error" if status >= 500 else
                      "invalid_request_error")
    finally:
        if not h.done:
            h.cancel()
    if outs is None:
        return _error(499, "client disconnected", kind="cancelled")
    out = outs[0]
    ctx.metrics.observe(out)
    reasoning, text = split_reasoning(ctx.think_fmt, out.text, inside)
    content, calls = parse_tool_calls(text, names) if names is not None else (text, [])
    if body.call_limit is not None:
        calls = calls[: body.call_limit]
    items = _items(reasoning, content, calls, _summarize(body))
    if body.logprobs:
        for item in items:
            if item["type"] == "message":
                item["content"][0]["logprobs"] = _text_logprobs(out.logprobs, out.text, content,
                                                                body.top_logprobs or 0)
    return _final(base, items, out.finish_reason, out.usage)


def _summarize(body: ResponsesRequest) -> bool:
    """reasoning.summary asked for: the reasoning item's summary carries the thinking
    itself (the models served here write no separate summary)."""
    return (body.reasoning or {}).get("summary") is not None


def _items(reasoning: str, text: str, calls: list[dict[str, Any]], summarize: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(_reasoning_item(reasoning, summarize))
    if text.strip() or not (calls or reasoning):
        items.append(_message_item(text))
    items += [_call_item(c) for c in calls]
    return items


def _final(base: dict[str, Any], items: list[dict[str, Any]], reason: str, usage: Any) -> dict[str, Any]:
    done = reason != "length"
    return {**base, "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "output": items, "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.prompt_tokens + usage.completion_tokens}}


async def _events(ctx: ServerContext, request: Request, h: Any, base: dict[str, Any],
                  names: set[str] | None, inside: bool, body_stream_options: Any = None,
                  summarize: bool = False, call_limit: int | None = None, lp_top: int | None = None):
    """The typed event stream: response.created / in_progress, per output item
    output_item.added, content deltas (reasoning_text / output_text / function call
    arguments), output_item.done, then response.completed with the whole response.
    lp_top (None: no logprobs): alternatives per token in the message's logprobs; each
    output_text delta carries the records of the tokens since the previous one."""
    seq = [0]
    pad = bool((body_stream_options or {}).get("include_obfuscation"))

    def ev(kind: str, **data: Any) -> str:
        seq[0] += 1
        if pad and "delta" in data:  # OpenAI's padding, so that sizes do not reveal deltas
            data["obfuscation"] = secrets.token_urlsafe(12)[: 16 - min(len(str(data["delta"])), 15)]
        return sse({'type': kind, 'sequence_number': seq[0], **data}, kind)

    think = ReasoningStream(ctx.think_fmt, inside)
    tools = ToolCallStream(names, call_limit) if names is not None else None
    tap, taken = _Tap(h), [0]  # the logprob records seen, and how many were sent
    items: list[dict[str, Any]] = []
    open_kind: list[str | None] = [None]

    def close() -> list[str]:
        if open_kind[0] is None:
            return []
        item, idx = items[-1], len(items) - 1
        out = []
        if open_kind[0] == "message":
            part = item["content"][0]
            if lp_top is not None:
                whole = "".join(lp.token for lp in tap.seen)
                part["logprobs"] = _text_logprobs(tap.seen, whole, part["text"], lp_top)
            out += [ev("response.output_text.done", item_id=item["id"], output_index=idx,
                       content_index=0, text=part["text"], logprobs=part.get("logprobs", [])),
                    ev("response.content_part.done", item_id=item["id"], output_index=idx,
                       content_index=0, part=part)]
        elif open_kind[0] == "function_call":
            out.append(ev("response.function_call_arguments.done", item_id=item["id"], output_index=idx,
                          arguments=item["arguments"], name=item["name"]))
        else:
            part = item["content"][0]
            if summarize:
                item["summary"] = [{"type": "summary_text", "text": part["text"]}]
            out += [ev("response.reasoning_text.done", item_id=item["id"], output_index=idx,
                       content_index=0, text=part["text"]),
                    ev("response.content_part.done", item_id=item["id"], output_index=idx,
                       content_index=0, part=part)]
        item["status"] = "completed"
        out.append(ev("response.output_item.done", output_index=idx, item=item))
        open_kind[0] = None
        return out

    def piece(kind: str, text: str) -> list[str]:
        if not text:
            return []
        out = []
        if open_kind[0] != kind:
            out += close()
            item = _reasoning_item("") if kind == "reasoning" else _message_item("")
            item["status"] = "in_progress"
            items.append(item)
            idx = len(items) - 1
            out.append(ev("response.output_item.added", output_index=idx,
                          item={**item, "content": []}))
            out.append(ev("response.content_part.added", item_id=item["id"], output_index=idx,
                          content_index=0, part=dict(item["content"][0])))
            open_kind[0] = kind
        item, idx = items[-1], len(items) - 1
        item["content"][0]["text"] += text
        name = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        if lp_top is not None:
            if kind == "message":
                extra["logprobs"] = [_logprob_record(lp, lp_top) for lp in tap.seen[taken[0]:]]
            taken[0] = len(tap.seen)
        out.append(ev(name, item_id=item["id"], output_index=idx, content_index=0, delta=text, **extra))
        return out

    def call_piece(part: tuple) -> list[str]:
        """("call", index, id, name) opens a function_call item; ("args", index, text)
        adds to its arguments."""
        out = []
        if part[0] == "call":
            out += close()
            item = _call_item({"id": part[2], "function": {"name": part[3], "arguments": ""}})
            item["status"] = "in_progress"
            items.append(item)
            out.append(ev("response.output_item.added", output_index=len(items) - 1, item=dict(item)))
            open_kind[0] = "function_call"
        else:
            item = items[-1]
            item["arguments"] += part[2]
            out.append(ev("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=len(items) - 1, delta=part[2]))
        return out

    yield ev("response.created", response={**base, "status": "in_progress", "output": [],
                                            "usage": None, "incomplete_details": None})
    yield ev("response.in_progress", response={**base, "status": "in_progress", "output": [],
                                                "usage": None, "incomplete_details": None})
    try:
        final, calls, ended = None, [], False
        async for part in reply_parts(request, tap, think, tools):
            if part[0] == "end":
                _, final, calls = part
                ended = True
            elif part[0] in ("call", "args"):  # function calls, arguments streamed as written
                for line in call_piece(part):
                    yield line
            else:
                for line in piece("reasoning" if part[0] == "reasoning" else "message", part[1]):
                    yield line
        if not ended:
            return  # the client went away
        for line in close():
            yield line
        whole = _final(base, items, final.finish_reason if final is not None else "stop", final.usage)
        yield ev("response.completed" if whole["status"] == "completed" else "response.incomplete",
                 response=whole)
    except Exception as e:
        status, msg, param = failure(e)
        yield ev("error", code="server_error" if status >= 500 else "invalid_request_error",
                 message=msg, param=param)
    finally:
        if not h.done:
            h.cancel()


def _message_item(text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{uuid.uuid4().hex[:24]}", "status": "completed",
            "role": "assistant", "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _reasoning_item(text: str, summarize: bool = False) -> dict[str, Any]:
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex[:24]}",
            "summary": [{"type": "summary_text", "text": text}] if summarize else [],
            "status": "completed", "content": [{"type": "reasoning_text", "text": text}]}


def _call_item(c: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex[:24]}", "call_id": c["id"],
            "name": c["function"]["name"], "arguments": c["function"]["arguments"],
            "status": "completed"}
