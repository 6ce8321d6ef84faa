"""Tool (function) calls in generated text: find them, parse them, stream around them.

Models write tool calls in a few formats; those handled here:
  hermes   `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen 2.5/3, Hermes,
           SmolLM3, many fine-tunes), one block per call;
  mistral  `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` (to the end of the text);
  llama    `<|python_tag|>{"name": ..., "parameters": {...}}` (Llama 3.1+), or the whole
           reply being such a JSON object (or list).
A call's JSON may name its arguments "arguments" or "parameters" and give them as an object
or a JSON string holding one. Text outside the calls stays the message's content. Text that
is not a valid call of one of the request's tools (cut off by max_tokens, an unknown
function, non-object arguments) is kept as content rather than lost. A model-supplied call
id is kept; otherwise ids are `call_...`, or 9 alphanumerics for the mistral format (its
templates require them when the call comes back in the history).

`ToolCallStream` does the same incrementally for SSE: `feed(delta)` returns the content that
can be sent now (it holds back a suffix that might start a marker, and everything once a
call has started), `finish()` returns the held content and the parsed calls.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TO_END = ("[TOOL_CALLS]", "<|python_tag|>")  # a call (or a list of calls) to the end
# gpt-oss (harmony): `[<|start|>assistant to=functions.NAME]<|channel|>commentary
# [to=functions.NAME] [<|constrain|>json]<|message|>{arguments}[<|call|>]`
_HARMONY = re.compile(r"(?:<\|start\|>assistant)?(?: ?to=functions\.(?P<a>[\w.\-]+))?<\|channel\|>commentary"
                      r"(?: to=functions\.(?P<b>[\w.\-]+))?[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>"
                      r"(?P<args>.*?)(?:<\|call\|>|<\|end\|>|$)", re.S)
_MARKERS = (_OPEN, *_TO_END, "<|channel|>commentary", "to=functions.")


def _call_id(short: bool) -> str:
    # Mistral's templates require 9 alphanumeric characters when the id comes back in history.
    return uuid.uuid4().hex[:9] if short else f"call_{uuid.uuid4().hex[:24]}"


def _as_calls(obj: Any, tool_names: set[str] | None, short_ids: bool = False) -> list[dict[str, Any]] | None:
    """{"name", "arguments"|"parameters"} or a list of them -> OpenAI tool_calls; None when
    it is not one (or names a function the request did not offer, or has non-object
    arguments): the text then stays content."""
    items = obj if isinstance(obj, list) else [obj]
    calls = []
    for it in items:
        if not isinstance(it, dict):
            return None
        fn = it.get("function") if isinstance(it.get("function"), dict) else it
        name = fn.get("name")
        if not isinstance(name, str) or not name or (tool_names is not None and name not in tool_names):
            return None
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        cid = it.get("id") if isinstance(it.get("id"), str) and it.get("id") else _call_id(short_ids)
        calls.append({"id": cid, "type": "function",
                      "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
    return calls or None


def _loads(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except ValueError:
        return None


def _harmony_calls(text: str, tool_names: set[str] | None) -> tuple[str, list[dict[str, Any]]] | None:
    """gpt-oss's calls (harmony commentary messages to functions.NAME), or None if none."""
    calls, content, at = [], [], 0
    for m in _HARMONY.finditer(text):
        name = m.group("a") or m.group("b")
        parsed = _as_calls({"name": name, "arguments": _loads(m.group("args"))}, tool_names) if name else None
        if parsed is None:
            continue
        content.append(text[at : m.start()])
        calls += parsed
        at = m.end()
    if not calls:
        return None
    content.append(text[at:])
    return "".join(content), calls


def parse_tool_calls(text: str, tool_names: set[str] | None = None) -> tuple[str, list[dict[str, Any]]]:
    """(content without the calls, OpenAI-style tool_calls) of a complete reply."""
    if "<|channel|>commentary" in text:
        harmony = _harmony_calls(text, tool_names)
        if harmony is not None:
            return harmony
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    rest = text
    while True:
        i = rest.find(_OPEN)
        if i < 0:
            break
        j = rest.find(_CLOSE, i + len(_OPEN))
        body = rest[i + len(_OPEN) : j if j >= 0 else len(rest)]
        parsed = _as_calls(_loads(body), tool_names)
        if parsed is None:  # keep what we cannot parse
            content.append(rest[: j + len(_CLOSE)] if j >= 0 else rest)
        else:
            content.append(rest[:i])
            calls += parsed
        rest = rest[j + len(_CLOSE) :] if j >= 0 else ""
    for marker in _TO_END:
        k = rest.find(marker)
        if k >= 0:
            parsed = _as_calls(_loads(rest[k + len(marker) :]), tool_names, marker == "[TOOL_CALLS]")
            if parsed is not None:
                content.append(rest[:k])
                calls += parsed
                rest = ""
            break
    if rest and not calls and tool_names is not None and rest.lstrip()[:1] in ("{", "["):
        parsed = _as_calls(_loads(rest), tool_names)  # a bare JSON call (Llama 3 without python_tag)
        if parsed is not None:
            return "".join(content), parsed
    content.append(rest)
    return "".join(content), calls


class ToolCallStream:
    """Incremental `parse_tool_calls` for streaming (see the module docstring)."""

    def __init__(self, tool_names: set[str]):
        self.tool_names = tool_names
        self.text = ""  # everything so far
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a call (or a possible bare-JSON call) has started

    def feed(self, delta: str) -> str:
        self.text += delta
        if self.holding:
            return ""
        if self.sent == 0:  # nothing sent yet: the reply may be a bare JSON call
            head = self.text.lstrip()
            if not head:
                return ""  # only whitespace so far: wait for the first real character
            if head[0] in "{[":
                self.holding = True  # decide at the end
                return ""
        pending = self.text[self.sent :]
        starts = [k for k in (pending.find(m) for m in _MARKERS) if k >= 0]
        if starts:
            self.holding = True
            out = pending[: min(starts)]
        else:  # hold back a tail that could be the beginning of a marker
            keep = max((n for m in _MARKERS for n in range(1, len(m)) if pending.endswith(m[:n])), default=0)
            out = pending[: len(pending) - keep]
        self.sent += len(out)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not sent yet, tool calls)."""
        content, calls = parse_tool_calls(self.text, self.tool_names)
        if not calls:
            return self.text[self.sent :], []
        sent = self.text[: self.sent]
        # What was sent precedes the first call, so it starts `content`; if not (it cannot
        # happen by construction), send no more content rather than repeat any.
        return (content[self.sent :] if content.startswith(sent) else ""), calls


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages -> what chat templates expect: tool-call arguments as objects."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                tc = dict(tc)
                fn = dict(tc.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
                    except ValueError:
                        raise ValueError("messages: tool_calls[].function.arguments must be a JSON "
                                         "object or a string holding one") from None
                tc["function"] = fn
                calls.append(tc)
            m["tool_calls"] = calls
        out.append(m)
    return out


# ------------------------------------------------------------------------------------------
# Tools in the prompt and in the output: formats, the default rendering, enforced calls
# ------------------------------------------------------------------------------------------

#: The default tools section, for chat templates that have none (the Hermes / Qwen wording
#: and format, which `parse_tool_calls` reads back): appended to the system message.
DEFAULT_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def tool_format(template: str | None) -> tuple[str, bool]:
    """(the call format a chat template's model writes, whether the template renders a
    `tools` section itself). Formats: "hermes" (`<tool_call>` blocks, also the default for
    templates without tools), "mistral" (`[TOOL_CALLS][...]`), "llama" (a bare JSON object
    with "parameters", Llama 3.1+)."""
    t = template or ""
    renders = "tools" in t
    if "<|channel|>" in t:
        return "harmony", renders
    if "<tool_call>" in t:
        return "hermes", renders
    if "[TOOL_CALLS]" in t:
        return "mistral", renders
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama", renders
    return "hermes", renders


def render_tools_in_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template without a tools section: the tools in the system message
    (DEFAULT_TOOLS_PROMPT), earlier calls as `<tool_call>` blocks in the assistant's content,
    tool results as `<tool_response>` blocks in a user turn (the Hermes convention)."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    section = DEFAULT_TOOLS_PROMPT.format(tools=listing)
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [f'{_OPEN}\n{json.dumps({"name": tc["function"].get("name"), "arguments": tc["function"].get("arguments", {})}, ensure_ascii=False)}\n{_CLOSE}'
                      for tc in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": section})
    return out


def _call_schema(tool: dict[str, Any], args_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def _marker(tokenizer: Any, text: str) -> str:
    """A Lark item producing `text`: the special token when the vocabulary has it as one
    (grammars cannot spell a special token with ordinary text), else the literal."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1 and ids[0] in tokenizer.special_ids:
        return f"<[{ids[0]}]>"
    return json.dumps(text)


def tool_call_grammar(tools: list[dict[str, Any]], choice: Any, parallel: bool | None,
                      fmt: str, tokenizer: Any) -> str | None:
    """A Lark grammar (llguidance's, with inline JSON schemas) whose language is the valid
    calls `tool_choice` demands, in the model's format: "required" one or more calls of the
    offered tools (exactly one when parallel_tool_calls is false), a named function exactly
    one call of it; None for "auto"/"none" (the model chooses; calls are parsed after)."""
    if choice in (None, "auto", "none"):
        return None
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tools = [t for t in tools if t["function"]["name"] == name]
        parallel = False
    if fmt == "harmony":  # one call: a commentary message to functions.NAME, then <|call|> (EOS)
        calls = [f"c{i}: {_marker(tokenizer, '<|channel|>')} "
                 f"{json.dumps('commentary to=functions.' + t['function']['name'] + ' ')} "
                 f"{_marker(tokenizer, '<|constrain|>')} \"json\" {_marker(tokenizer, '<|message|>')} "
                 f"%json {json.dumps(t['function'].get('parameters') or {'type': 'object'})}"
                 for i, t in enumerate(tools)]
        return "start: " + " | ".join(f"c{i}" for i in range(len(tools))) + "\n" + "\n".join(calls)
    args_key = "parameters" if fmt == "llama" else "arguments"
    one = {"anyOf": [_call_schema(t, args_key) for t in tools]}
    if fmt == "mistral":
        arr = {"type": "array", "items": one, "minItems": 1}
        if parallel is False:
            arr["maxItems"] = 1
        return f"start: {_marker(tokenizer, '[TOOL_CALLS]')} calls\ncalls: %json {json.dumps(arr)}"
    if fmt == "llama":  # one bare JSON call (the format has no parallel calls)
        return f"start: call\ncall: %json {json.dumps(one)}"
    more = "" if parallel is False else ' ("\\n" call)*'
    return (f"start: call{more}\n"
            f"call: {_marker(tokenizer, _OPEN)} \"\\n\" body \"\\n\" {_marker(tokenizer, _CLOSE)}\n"
            f"body: %json {json.dumps(one)}")


async def reply_parts(request: Any, handle: Any, think: Any, tools: "ToolCallStream | None",
                      one_call: bool = False):
    """A streamed reply as the APIs that separate its parts see it: yields ("reasoning",
    text) and ("content", text) pieces as they become safe to send (a `ReasoningStream`
    splits the thinking off, `tools` holds back tool-call text), then one ("end", the final
    delta or None, the parsed calls) item. Stops (yielding nothing more) when the client
    disconnects."""
    final = None
    async for d in handle.aiter():
        if await request.is_disconnected():
            return
        reasoning, text = think.feed(d.text)
        if d.finish_reason:
            r2, t2 = think.finish()
            reasoning, text = reasoning + r2, text + t2
            final = d
        if reasoning:
            yield "reasoning", reasoning
        if tools is not None:
            text = tools.feed(text)
        if text:
            yield "content", text
    calls: list[dict[str, Any]] = []
    if tools is not None:
        rest, calls = tools.finish()
        if rest.strip() or (rest and not calls):
            yield "content", rest
    yield "end", final, calls[:1] if one_call else calls
