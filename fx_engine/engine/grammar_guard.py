"""What a grammar may cost, and the threads llguidance compiles grammars on.

A grammar is hostile input run through native code: llguidance (Rust) walks chains of rule
references recursively, so a long enough chain overflows the calling thread's stack and the
process dies of SIGSEGV (a 66 KB Lark grammar of 3,000 rules `r{i}: "t{i}" | r{i+1}` needs
more than the 8 MiB of a main thread, and far more than a small worker thread has); and
llguidance's GBNF-to-Lark converter is pure Python whose cost grows with rules x size (a
75 KB grammar: 16 s of CPU holding the GIL). Two defences, both here:

1. Limits checked before anything is converted or compiled (a `GrammarError`, the server's
   400, naming the field): Lark grammars at most `MAX_GRAMMAR_RULES` rules; GBNF grammars
   at most `MAX_GBNF_RULES` rules, `MAX_GBNF_CHARS` characters and rules x characters at
   most `MAX_GBNF_COST` (each pass of the converter's fixpoint walks the whole grammar, and
   it may take one pass per rule); JSON schemas at most `MAX_SCHEMA_NODES` objects and
   arrays nested at most `MAX_SCHEMA_DEPTH` deep. (Every grammar text is also at most
   `constraints.MAX_GRAMMAR_CHARS`; llguidance bounds nesting inside a rule, regexes and
   its own compile work with its parser limits, as errors.)
2. Every llguidance conversion, compile and matcher creation runs on `compile_threads()`:
   threads of `COMPILE_STACK_BYTES` of stack (reserved address space: only the pages a
   compile touches are ever resident): a chain of rules or `$ref`s takes about 4-8 KiB of
   stack a link, so what passes the limits cannot overflow it, with a wide margin (a
   30,000-rule Lark chain and a 9,000-link `$ref` chain compile in it), whichever thread
   submitted the request (a server's worker threads, the engine's thread). A compile that takes
   longer than `COMPILE_TIMEOUT_S` is a GrammarError for its request (the thread finishes
   it in the background: native code cannot be interrupted).
"""

from __future__ import annotations

import os
import queue
import re
import threading
from concurrent.futures import Future, TimeoutError as FutureTimeout
from typing import Any, Callable

#: Rules (and terminals) in a Lark grammar.
MAX_GRAMMAR_RULES = 2000
#: Rules in a GBNF grammar, its size in characters, and rules x characters.
MAX_GBNF_RULES = 1000
MAX_GBNF_CHARS = 64 * 1024
MAX_GBNF_COST = 10_000_000
#: Objects and arrays in a JSON schema, and how deep they nest.
MAX_SCHEMA_NODES = 10_000
MAX_SCHEMA_DEPTH = 100
#: Stack of each compile thread, how many there are, and how long a request waits for one.
COMPILE_STACK_BYTES = 256 * 1024 * 1024
COMPILE_THREADS = 2
COMPILE_TIMEOUT_S = 30.0
#: Longest grammar error message passed on (llguidance appends its parser state).
MAX_ERROR_CHARS = 400


class GrammarError(ValueError):
    """A grammar that cannot be compiled, or a matcher that went wrong mid-generation."""


# ------------------------------------------------------------------ limits, before compiling

# A Lark rule or terminal definition: `name:` / `?name:` / `NAME.2:` at the start of a line
# (alternatives continue on lines that start with `|`; `%` lines are directives).
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z_0-9]*(?:\.-?[0-9]+)?[ \t]*:", re.M)


def check_grammar_text(field: str, text: str) -> None:
    """The limits of a `grammar` (Lark or GBNF, told apart as llguidance does)."""
    from llguidance.gbnf_to_lark import is_lark_syntax

    if is_lark_syntax(text):
        check_lark(field, text)
        return
    rules = text.count("::=")  # an upper bound: every rule has one (a literal may add more)
    if len(text) > MAX_GBNF_CHARS:
        raise GrammarError(f"{field}: a GBNF grammar may have at most {MAX_GBNF_CHARS} "
                           f"characters, got {len(text)}")
    if rules > MAX_GBNF_RULES:
        raise GrammarError(f"{field}: a GBNF grammar may have at most {MAX_GBNF_RULES} rules, "
                           f"got {rules}")
    if rules * len(text) > MAX_GBNF_COST:
        raise GrammarError(f"{field}: GBNF grammar too large to convert: {rules} rules x "
                           f"{len(text)} characters is more than {MAX_GBNF_COST} (use fewer "
                           f"rules, a smaller grammar, or Lark syntax)")


def check_lark(field: str, text: str) -> None:
    rules = len(_LARK_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise GrammarError(f"{field}: a Lark grammar may have at most {MAX_GRAMMAR_RULES} "
                           f"rules, got {rules}")


def check_schema(field: str, schema: Any) -> None:
    """Objects and arrays in a JSON schema, and their depth (walked without recursion: a
    deep schema must not be a RecursionError here either)."""
    nodes, stack = 0, [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            items = value.values()
        elif isinstance(value, (list, tuple)):
            items = value
        else:
            continue
        nodes += 1
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"{field}: a JSON schema may nest objects and arrays at most "
                               f"{MAX_SCHEMA_DEPTH} deep")
        if nodes > MAX_SCHEMA_NODES:
            raise GrammarError(f"{field}: a JSON schema may have at most {MAX_SCHEMA_NODES} "
                               f"objects and arrays")
        stack.extend((v, depth + 1) for v in items)


def clean_error(text: str) -> str:
    """llguidance's message without the parser-state dump it appends (kilobytes of
    internals), on one line, at most MAX_ERROR_CHARS characters."""
    text = text.split("\n<state>", 1)[0].strip()
    if text.startswith("NoExtensionBias"):
        return "no output satisfies this constraint (no token of the model can start one)"
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


# ------------------------------------------------------------------ the compile threads


class _CompileThreads:
    """A few daemon threads with large stacks running grammar work for any caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = -1  # threads do not survive fork(): a child starts its own
        self._mine = threading.local()  # set on these threads: a nested call runs inline

    def _start(self) -> None:
        with self._lock:
            if self._pid == os.getpid():
                return
            self._jobs = queue.SimpleQueue()
            # threading.stack_size is process-wide: set only while these threads start
            old = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                for i in range(COMPILE_THREADS):
                    threading.Thread(target=self._work, name=f"fx-grammar-{i}",
                                     daemon=True).start()
            finally:
                threading.stack_size(old)
            self._pid = os.getpid()

    def _work(self) -> None:
        self._mine.on = True
        jobs = self._jobs
        while True:
            fut, fn = jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # the caller's to handle, never this thread's end
                fut.set_exception(e)

    def call(self, field: str, fn: Callable[[], Any]) -> Any:
        if getattr(self._mine, "on", False):
            return fn()
        self._start()
        fut: Future = Future()
        self._jobs.put((fut, fn))
        try:
            return fut.result(COMPILE_TIMEOUT_S)
        except FutureTimeout:
            fut.cancel()  # not started yet: never runs; running: finishes unobserved
            raise GrammarError(f"{field}: the grammar did not compile within "
                               f"{COMPILE_TIMEOUT_S:.0f} s") from None


_THREADS = _CompileThreads()


def on_compile_thread(field: str, fn: Callable[[], Any]) -> Any:
    """fn() run on a compile thread (large stack); its result, or its exception re-raised
    here. `field` names the constraint in the timeout's error."""
    return _THREADS.call(field, fn)
