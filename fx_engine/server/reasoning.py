"""The thinking part of replies from models that reason before answering, kept apart from
the answer (as vLLM's reasoning parsers and llama.cpp's server do).

Formats, chosen from the chat template:
  think    `<think> ... </think>` then the answer (Qwen3, DeepSeek-R1, SmolLM3, QwQ, GLM, ...).
           When the generation prompt itself ends inside an open `<think>` (DeepSeek-R1's
           template, Qwen3 thinking templates), the reply starts in the reasoning; otherwise
           a reply that does not open `<think>` is all answer.
  harmony  gpt-oss: `<|channel|>analysis<|message|>...<|end|>` is reasoning,
           `<|channel|>final<|message|>...` the answer; a commentary message addressed to a
           function (`to=functions.NAME`) passes to the content whole, headers included, for
           the tool-call parser (server/tools.py), another commentary message (a preamble)
           is content.
The template switches (`enable_thinking`, gpt-oss's `reasoning_effort`) go to the template
as its variables (chat_template_kwargs, or the request's `reasoning_effort`).

`ReasoningStream.feed(delta) -> (reasoning, content)` splits incrementally (a suffix that
may start a tag is held back); `finish()` releases what is held; `split(text)` does a whole
reply at once, and equals feeding it in any pieces.
"""

from __future__ import annotations

from typing import Any

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
_H_ANALYSIS = "<|channel|>analysis<|message|>"
_H_FINAL = "<|channel|>final<|message|>"
_H_COMMENTARY = "<|channel|>commentary"  # a preamble, or a tool call (a `to=` recipient)
_H_MESSAGE = "<|message|>"
_H_END = ("<|end|>", "<|return|>", "<|call|>")
_H_START = "<|start|>assistant"


def reasoning_format(template: str | None) -> str | None:
    """"think", "harmony" or None (the template's model does not reason separately)."""
    t = template or ""
    if "<|channel|>" in t:
        return "harmony"
    if _THINK_OPEN in t or _THINK_CLOSE in t:
        return "think"
    return None


def starts_in_reasoning(fmt: str | None, prompt_text: str) -> bool:
    """Whether the reply begins inside a reasoning block opened by the generation prompt."""
    if fmt != "think":
        return False
    tail = prompt_text.rstrip()
    return tail.endswith(_THINK_OPEN)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    return max((n for m in markers for n in range(1, len(m)) if text.endswith(m[:n])), default=0)


class ReasoningStream:
    """Incremental split of a reply into (reasoning, content); see the module docstring."""

    def __init__(self, fmt: str | None, in_reasoning: bool = False):
        self.fmt = fmt
        self.state = "reasoning" if in_reasoning else ("start" if fmt == "think" else "content")
        if fmt == "harmony":
            self.state = "harmony"
        self.buf = ""
        self.header = ""  # harmony: the header text since the last message (a recipient)

    def feed(self, delta: str) -> tuple[str, str]:
        if self.fmt is None:
            return "", delta
        self.buf += delta
        reasoning, content = [], []
        while True:
            progressed = self._step(reasoning, content, final=False)
            if not progressed:
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        if self.fmt is None:
            return "", ""
        reasoning, content = [], []
        while self._step(reasoning, content, final=True):
            pass
        rest, self.buf = self.buf, ""
        (reasoning if self.state in ("reasoning", "analysis") else content).append(rest)
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        b = self.buf
        if self.state == "start":  # the reply may open <think> (after whitespace)
            s = b.lstrip()
            if s.startswith(_THINK_OPEN):
                self.buf, self.state = s[len(_THINK_OPEN):], "reasoning"
                return True
            if not final and (not s or _THINK_OPEN.startswith(s)):
                return False  # wait: it may still open
            self.state = "content"
            return True
        if self.state == "reasoning":
            i = b.find(_THINK_CLOSE)
            if i >= 0:
                reasoning.append(b[:i])
                self.buf, self.state = b[i + len(_THINK_CLOSE):], "lead"
                return True
            keep = 0 if final else _held(b, (_THINK_CLOSE,))
            reasoning.append(b[: len(b) - keep])
            self.buf = b[len(b) - keep:]
            return False
        if self.state == "lead":  # the newlines between the thinking and the answer
            s = b.lstrip("\n")
            if s or final:
                self.buf, self.state = s, "content"
                return True
            self.buf = ""
            return False
        if self.state == "content":
            content.append(b)
            self.buf = ""
            return False
        # harmony: between messages ("harmony"), inside analysis, inside final
        if self.state == "harmony":
            markers = ((_H_ANALYSIS, "analysis"), (_H_FINAL, "final"), (_H_COMMENTARY, "commentary"))
            found = [(b.find(m), m, nxt) for m, nxt in markers if m in b]
            if found:
                i, marker, nxt = min(found)
                # headers between messages (<|start|>assistant ...) are not shown, but a
                # recipient in them belongs to the commentary message that follows
                self.header = (self.header + b[:i]) if nxt == "commentary" else ""
                self.buf, self.state = b[i + len(marker):], nxt
                return True
            if final:
                content.append(b.replace(_H_START, ""))
                self.buf = ""
                return False
            keep = _held(b, tuple(m for m, _ in markers))
            self.header += b[: len(b) - keep]
            self.buf = b[len(b) - keep:] if keep else ""
            return False
        if self.state == "commentary":  # held whole until its end
            ends = [(b.find(m), m) for m in _H_END if m in b]
            if not ends and not final:
                return False
            i, m = min(ends) if ends else (len(b), "")
            raw = self.header + _H_COMMENTARY + b[:i]
            head, sep, body = raw.partition(_H_MESSAGE)
            content.append(raw + m if "to=" in head else (body if sep else ""))
            self.header, self.buf, self.state = "", b[i + len(m):], "harmony"
            return bool(ends)
        out = reasoning if self.state == "analysis" else content
        ends = [(b.find(m), m) for m in _H_END if m in b]
        if ends:
            i, m = min(ends)
            out.append(b[:i])
            self.buf, self.state = b[i + len(m):], "harmony"
            return True
        keep = 0 if final else _held(b, _H_END)
        out.append(b[: len(b) - keep])
        self.buf = b[len(b) - keep:]
        return False


def split(fmt: str | None, text: str, in_reasoning: bool = False) -> tuple[str, str]:
    """(reasoning, content) of a whole reply."""
    s = ReasoningStream(fmt, in_reasoning)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return r1 + r2, c1 + c2


def template_switches(template: str | None, effort: str | None,
                      field: str = "reasoning_effort") -> dict[str, Any]:
    """Template variables for OpenAI's `reasoning_effort`: gpt-oss templates read
    `reasoning_effort` itself; templates with an `enable_thinking` switch turn thinking off
    for "none"/"minimal" and on otherwise. A template with neither: ValueError."""
    if effort is None:
        return {}
    t = template or ""
    if "reasoning_effort" in t:
        return {"reasoning_effort": effort}
    if "enable_thinking" in t:
        return {"enable_thinking": effort not in ("none", "minimal")}
    raise ValueError(f"{field}: this model's chat template has no reasoning switch")
