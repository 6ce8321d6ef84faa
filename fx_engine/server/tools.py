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

`ToolCallStream` does the same incrementally for SSE: `feed(delta)` returns what can be sent
now: content before the first call (it holds back a suffix that might start a marker), then
each call as it is written: announced once its arguments object starts (its name known), then
its arguments in pieces, re-written as they come to the final parse's form (`json.dumps(...,
ensure_ascii=False)`), so the pieces concatenate to the arguments the non-streamed answer
gives. `finish()` completes them from the whole text's parse: arguments it could not follow
as they came (written before the name, given as a string) arrive there at once, as does
content after the calls. gpt-oss's calls arrive whole at the end of their commentary message
(the reasoning splitter holds those messages until they end). Whitespace around the calls
is never sent as content unless real content follows (the non-streamed reply's content is
then null). Limits: a model-supplied call
id written after the arguments is not used when streaming; a call announced that the whole
text's parse then rejects or reads otherwise (cut off by max_tokens, malformed JSON, a
duplicated key in its arguments) stays as streamed, its arguments as far as they got (as
OpenAI's stream does on a cut-off), where the non-streamed answer keeps that text as content.
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
# (gpt-oss: a call's header may start "<|start|>assistant to=functions.NAME")
_MARKERS = (_OPEN, *_TO_END, "<|channel|>commentary", "to=functions.", "<|start|>assistant")
_HARMONY_HEAD = re.compile(r"(?: ?to=functions\.(?P<a>[\w.\-]+))?<\|channel\|>commentary"
                           r"(?: to=functions\.(?P<b>[\w.\-]+))?[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")


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


class _Frame:
    """An object or list open in the JSON being walked; `role` marks a call object ("call")
    or its nested "function" object ("fn"), whose name and id are captured."""

    __slots__ = ("kind", "role", "key", "expect", "name", "id", "parent")

    def __init__(self, kind: str, role: str | None, parent: "_Frame | None"):
        self.kind, self.role, self.parent = kind, role, parent
        self.key = self.name = self.id = None
        self.expect = "key" if kind == "{" else "value"


def _safe_prefix(raw: str) -> int:
    """How much of a string's raw (escaped) text decodes on its own: not cut inside an
    escape, nor after a high surrogate whose low half is still to come."""
    i = n = 0
    while i < len(raw):
        if raw[i] != "\\":
            i += 1
            n = i
            continue
        end = i + (6 if raw[i + 1 : i + 2] == "u" else 2)
        if end - i == 6 and "\\ud800" <= raw[i:end].lower() <= "\\udbff":
            end += 6  # the pair decodes as one character
        if end > len(raw):
            break
        i = n = end
    return n


class _CallWalker:
    """Follows the JSON of tool calls (a call object, or a list of them) character by
    character as it is generated. When a call's arguments object starts (its name known
    and offered), it announces the call and re-writes the arguments as the final parse
    will (`json.dumps(..., ensure_ascii=False)`: ", " and ": " separators, no other
    whitespace, numbers and escapes normalized), so the pieces concatenate to the final
    arguments. Anything it cannot follow (arguments before the name, arguments given as a
    string, not JSON) sets `stopped`: the final parse then decides the rest."""

    def __init__(self, begin: Any, emit: Any, name: str | None = None):
        self.begin, self.emit = begin, emit  # begin(name, id) -> bool; emit(text)
        self.name = name  # the value is the arguments of a call of `name` (gpt-oss's)
        self.stack: list[_Frame] = []
        self.lex: str | None = None  # "str" or "scalar" while one is being read
        self.buf = ""  # its raw text (a string's with its opening quote)
        self.esc = False
        self.done_raw = 0  # characters of a streamed string's raw text already sent
        self.args_depth = 0  # > 0: inside the arguments being streamed (their object's depth)
        self.done = False  # the top-level value is complete
        self.stopped = False

    def feed(self, s: str) -> int:
        """Walks `s`; returns how many of its characters belong to the JSON value."""
        for k, c in enumerate(s):
            if self.done or self.stopped:
                return k
            self._char(c)
        if self.lex == "str" and self._streaming():
            self._flush_string(final=False)  # long strings arrive as they are written
        return len(s)

    def _streaming(self) -> bool:
        return bool(self.args_depth) and len(self.stack) >= self.args_depth

    def _char(self, c: str) -> None:
        if self.lex == "str":
            self.buf += c
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                self.lex = None
                self._string_end()
            return
        if self.lex == "scalar":
            if c not in " \t\r\n,:]}{[\"":
                self.buf += c
                return
            self.lex = None
            self._scalar_end()
            if self.stopped:
                return
        if c in " \t\r\n":
            return
        top = self.stack[-1] if self.stack else None
        if c in "}]":
            if top is None or top.kind != ("{" if c == "}" else "["):
                self.stopped = True
                return
            if self._streaming():
                self.emit(c)
            self.stack.pop()
            if self.args_depth and len(self.stack) < self.args_depth:
                self.args_depth = 0  # the arguments are complete
            self._value_end()
        elif c == ",":
            if top is None:
                self.stopped = True
                return
            top.expect = "key" if top.kind == "{" else "value"
            if self._streaming():
                self.emit(", ")
        elif c == ":":
            if top is None or top.expect != "colon":
                self.stopped = True
                return
            top.expect = "value"
            if self._streaming():
                self.emit(": ")
        else:
            self._value_start(c)
            if self.stopped:
                return
            if c in "{[":
                role = None
                if self.name is not None:
                    pass  # the value is the arguments: no call objects in it
                elif top is None or (top.role is None and len(self.stack) == 1 and top.kind == "["):
                    role = "call" if c == "{" else None  # the call, or a list of calls
                elif top.role == "call" and top.key == "function" and c == "{":
                    role = "fn"
                self.stack.append(_Frame(c, role, top))
                if self._streaming():
                    self.emit(c)
            elif c == '"':
                self.lex, self.buf, self.esc, self.done_raw = "str", c, False, 0
                if self._streaming():
                    self.emit('"')
            else:
                self.lex, self.buf = "scalar", c

    def _value_start(self, c: str) -> None:
        top = self.stack[-1] if self.stack else None
        if top is None and self.name is not None:  # the arguments themselves
            if c == "{" and self.begin(self.name, None):
                self.args_depth = 1
            else:
                self.stopped = True
            return
        if top is None:
            if c not in "{[":
                self.stopped = True  # not a call
            return
        if top.kind == "{" and top.expect == "key":
            if c != '"':
                self.stopped = True
            return  # a key
        if top.role is None or top.key not in ("arguments", "parameters") or self.args_depth:
            return
        call = top if top.role == "call" else top.parent
        # Stream only what follows simply: an object, its function's name already known.
        if c != "{" or not isinstance(top.name, str) or not self.begin(top.name, call.id):
            self.stopped = True
            return
        self.args_depth = len(self.stack) + 1

    def _value_end(self) -> None:
        if not self.stack:
            self.done = True
        else:
            self.stack[-1].expect = "comma"

    def _string_end(self) -> None:
        top = self.stack[-1]
        if self._streaming():
            self._flush_string(final=True)
            if not self.stopped:
                self.emit('"')
        if top.kind == "{" and top.expect == "key":
            top.key = _loads(self.buf)
            top.expect = "colon"
            return
        if top.role is not None and top.key in ("name", "id"):
            value = _loads(self.buf)
            if top.key == "name":
                top.name = value
            elif top.role == "call" and isinstance(value, str) and value:
                top.id = value
        self._value_end()

    def _flush_string(self, final: bool) -> None:
        raw = self.buf[1 + self.done_raw : len(self.buf) - 1 if final else len(self.buf)]
        n = len(raw) if final else _safe_prefix(raw)
        if n == 0:
            return
        try:
            text = json.loads('"' + raw[:n] + '"')
        except ValueError:
            self.stopped = True
            return
        self.done_raw += n
        self.emit(json.dumps(text, ensure_ascii=False)[1:-1])

    def _scalar_end(self) -> None:
        if self._streaming():
            try:
                self.emit(json.dumps(json.loads(self.buf)))  # 1.50 -> 1.5, as the final parse
            except ValueError:
                self.stopped = True
                return
        self._value_end()


class ToolCallStream:
    """Incremental `parse_tool_calls` for streaming (see the module docstring)."""

    def __init__(self, tool_names: set[str], max_calls: int | None = None):
        self.tool_names = tool_names
        self.max_calls = max_calls  # 1 for parallel_tool_calls false
        self.text = ""  # everything so far
        self.sent = 0  # characters of `text` already sent as content
        self.holding = False  # a call (or a possible bare-JSON call) has started
        self.mode: str | None = None  # how the calls are written: "hermes", "to_end", "harmony"
        self.pos = 0  # where in `text` following the calls has got to
        self.walker: _CallWalker | None = None
        self.stopped = False  # calls are no longer followed: the final parse decides
        self.short_ids = False
        self.streamed: list[list[str]] = []  # [id, name, arguments sent] of the calls announced
        self.out: list[tuple] = []

    def feed(self, delta: str) -> list[tuple]:
        """The pieces that can be sent now: ("content", text), ("call", index, id, name),
        ("args", index, text)."""
        self.text += delta
        self.out = []
        if not self.holding:
            content = self._content()
            if content:
                self.out.append(("content", content))
        if self.holding and not self.stopped:
            self._follow()
        return self.out

    def _content(self) -> str:
        if self.sent == 0:  # nothing sent yet: the reply may be a bare JSON call
            head = self.text.lstrip()
            if not head:
                return ""  # only whitespace so far: wait for the first real character
            if "[TOOL_CALLS]".startswith(head):
                return ""  # a bare list, or mistral's marker: not known yet
            if head[0] in "{[" and not head.startswith("[TOOL_CALLS]"):
                self.holding, self.mode = True, "to_end"  # decided as it goes, or at the end
                self.pos = len(self.text) - len(head)
                return ""
        pending = self.text[self.sent :]
        starts = [(k, m) for m in _MARKERS if (k := pending.find(m)) >= 0]
        if starts:
            k, m = min(starts)
            self.holding = True
            self.pos = self.sent + k + (len(m) if m in _TO_END else 0)
            self.mode = "hermes" if m == _OPEN else "to_end" if m in _TO_END else "harmony"
            self.short_ids = m == "[TOOL_CALLS]"
            out = pending[:k]
        else:  # hold back a tail that could be the beginning of a marker
            keep = max((n for m in _MARKERS for n in range(1, len(m)) if pending.endswith(m[:n])), default=0)
            out = pending[: len(pending) - keep]
        if self.sent == 0 and not out.strip():
            return ""  # whitespace before a call: content only if real content follows (finish)
        self.sent += len(out)
        return out

    def _follow(self) -> None:
        """Walks the calls' JSON written since the last feed."""
        while not self.stopped:
            if self.walker is None and self.mode == "harmony":  # a commentary message to a function
                head = _HARMONY_HEAD.search(self.text, self.pos)
                if head is None:
                    return
                if not (head.group("a") or head.group("b")):
                    self.stopped = True  # commentary to no function: decided at the end
                    return
                self.walker = _CallWalker(self._begin, self._emit, head.group("a") or head.group("b"))
                self.pos = head.end()
            elif self.walker is None:
                k = self.text.find(_OPEN, self.pos) if self.mode == "hermes" else self.pos
                if k < 0:
                    return
                self.walker = _CallWalker(self._begin, self._emit)
                self.pos = k + (len(_OPEN) if self.mode == "hermes" else 0)
            self.pos += self.walker.feed(self.text[self.pos :])
            if self.walker.stopped:
                self.stopped = True
            if not self.walker.done:
                return
            self.walker = None
            self.stopped = self.stopped or self.mode == "to_end"  # one value to the end

    def _begin(self, name: str, cid: str | None) -> bool:
        if name not in self.tool_names or (self.max_calls is not None and len(self.streamed) >= self.max_calls):
            return False
        cid = cid or _call_id(self.short_ids)
        self.streamed.append([cid, name, ""])
        self.out.append(("call", len(self.streamed) - 1, cid, name))
        return True

    def _emit(self, text: str) -> None:
        k = len(self.streamed) - 1
        self.streamed[k][2] += text
        if self.out and self.out[-1][0] == "args" and self.out[-1][1] == k:
            self.out[-1] = ("args", k, self.out[-1][2] + text)
        else:
            self.out.append(("args", k, text))

    def finish(self) -> tuple[list[tuple], list[dict[str, Any]]]:
        """(the pieces not sent yet, the tool calls). The whole text's parse decides: the
        arguments of announced calls are completed (all of them, when they could not be
        followed as they came), calls not announced yet are sent whole. A call announced
        that the parse then rejects (cut off by max_tokens, malformed) stays as streamed,
        its arguments as far as they got (as OpenAI's stream does on a cut-off), and no more
        content follows it (that text was the call's)."""
        content, calls = parse_tool_calls(self.text, self.tool_names)
        calls = calls[: self.max_calls]
        out: list[tuple] = []
        final: list[dict[str, Any]] = []
        for k, (cid, name, args) in enumerate(self.streamed):
            f = calls[k]["function"] if k < len(calls) else None
            if f is None or f["name"] != name or not f["arguments"].startswith(args):
                streamed = [{"id": c, "type": "function", "function": {"name": n, "arguments": a}}
                            for c, n, a in self.streamed]
                return out, final + streamed[k:]
            if len(f["arguments"]) > len(args):
                out.append(("args", k, f["arguments"][len(args) :]))
            final.append({**calls[k], "id": cid})
        sent = self.text[: self.sent]
        if not calls:
            rest = self.text[self.sent :]
        elif not content.strip():
            rest = ""  # whitespace around calls: the non-streamed reply's content is null
        else:  # what was sent precedes the first call, so it starts `content` (by construction)
            rest = content[self.sent :] if content.startswith(sent) else ""
        if rest:  # after the announced calls' arguments: a piece of a call follows its start
            out.append(("content", rest))
        for k in range(len(final), len(calls)):
            c = calls[k]
            out += [("call", k, c["id"], c["function"]["name"]), ("args", k, c["function"]["arguments"])]
            final.append(c)
        return out, final


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
        if m.get("role") == "tool" and isinstance(m.get("content"), list):  # (with images: parts)
            m = {"role": "user", "content": [{"type": "text", "text": "<tool_response>\n"}, *m["content"],
                                             {"type": "text", "text": "\n</tool_response>"}]}
        elif m.get("role") == "tool":
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


def chat_delta(pieces: list[tuple]) -> tuple[str, list[dict[str, Any]]]:
    """ToolCallStream pieces -> an OpenAI chat chunk's delta content and `tool_calls`: a
    call's first entry has its index, id, type, name and arguments so far, later ones only
    the index and the next arguments piece (as OpenAI and vLLM stream them)."""
    text, entries = "", {}
    for p in pieces:
        if p[0] == "content":
            text += p[1]
        elif p[0] == "call":
            entries[p[1]] = {"index": p[1], "id": p[2], "type": "function",
                             "function": {"name": p[3], "arguments": ""}}
        else:
            entries.setdefault(p[1], {"index": p[1], "function": {"arguments": ""}})["function"]["arguments"] += p[2]
    return text, list(entries.values())


async def reply_parts(request: Any, handle: Any, think: Any, tools: "ToolCallStream | None"):
    """A streamed reply as the APIs that separate its parts see it: yields ("reasoning",
    text) and ("content", text) pieces as they become safe to send (a `ReasoningStream`
    splits the thinking off), tool calls as they are written (`tools`: ("call", index, id,
    name) then ("args", index, text) pieces), then one ("end", the final delta or None, the
    parsed calls) item. Stops (yielding nothing more) when the client disconnects."""
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
        if tools is None:
            if text:
                yield "content", text
            continue
        for piece in tools.feed(text):
            yield piece
    calls: list[dict[str, Any]] = []
    if tools is not None:
        pieces, calls = tools.finish()
        for piece in pieces:
            # a call's trailing whitespace is no content of its own
            if piece[0] != "content" or piece[1].strip() or not calls:
                yield piece
    yield "end", final, calls
