"""Hostile grammars: whatever a client sends as a Lark or GBNF grammar, a regex, a JSON
schema or a list of choices either compiles or is a GrammarError (a ValueError naming its
field) when the request is made; nothing kills the process or fails a step.

Compiles run in a child process (`_Child`), from a thread with a 512 KiB stack (what
macOS gives a secondary thread, and about what a server's worker thread may have): a
crash shows as the child's exit code (SIGSEGV: -11) failing the test, never as pytest
dying. Oracles: the child's exit code and the exception type; llguidance's own validation
(a matcher that computes its first mask) for "compiles"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fx_engine.engine import grammar_guard as guard

pytestmark = pytest.mark.real_model

# The child: one JSON case a line on stdin, one JSON answer a line on stdout.
_CHILD = r"""
import json, sys, threading
import fx_engine
fx_engine.setup()
from fx_engine.engine.constraints import GrammarError, RowGrammar, grammar_tokenizer, parse_constraint, Constraint
m = fx_engine.load()
tok = grammar_tokenizer(m.tokenizer, m.config.vocab_size, m.eos_ids)

def compile_(case):
    if case["arg"] == "raw_lark":  # straight to the matcher, past parse_constraint's limits
        import llguidance
        c = Constraint("grammar", "grammar", llguidance.grammar_from("lark", case["value"]))
    else:
        c = parse_constraint(**{case["arg"]: case["value"]})
    if c is not None:  # json_schema=None: no constraint
        RowGrammar(c, tok)

def answer(case):
    try:
        compile_(case)
        return {"ok": True}
    except GrammarError as e:
        return {"ok": False, "error": str(e)}
    except BaseException as e:
        return {"ok": False, "other": f"{type(e).__name__}: {str(e)[:500]}"}

threading.stack_size(512 * 1024)
for line in sys.stdin:
    box = []
    t = threading.Thread(target=lambda: box.append(answer(json.loads(line))))
    t.start()
    t.join()
    print(json.dumps(box[0]), flush=True)
"""


class _Child:
    """The compile process, started again after a crash (hypothesis shrinks a failure)."""

    def __init__(self):
        self.p = None

    def compile(self, arg: str, value) -> dict:
        if self.p is None or self.p.poll() is not None:
            self.p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        self.p.stdin.write(json.dumps({"arg": arg, "value": value}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        if not line:
            rc = self.p.wait(timeout=60)
            pytest.fail(f"the compile process died with exit code {rc} on {arg}="
                        f"{str(value)[:200]!r}")
        return json.loads(line)

    def close(self) -> int:
        if self.p is None:
            return 0
        self.p.stdin.close()
        return self.p.wait(timeout=60)


@pytest.fixture(scope="module")
def child():
    c = _Child()
    yield c
    assert c.close() == 0


def _assert_compiles_or_grammar_error(child, arg, value) -> dict:
    got = child.compile(arg, value)
    assert "other" not in got, got["other"]
    if not got["ok"]:
        assert len(got["error"]) <= guard.MAX_ERROR_CHARS + 100, got["error"]
        assert "<state>" not in got["error"]
    return got


# ------------------------------------------------------------------ the crash, at the matcher

CHAIN_3000 = ("start: r0\n" + "\n".join(f'r{i}: "t{i}" | r{i+1}' for i in range(3000))
              + '\nr3000: "end"')


def _chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "t{i}" | r{i+1}' for i in range(n)) + f'\nr{n}: "end"'


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


@pytest.mark.slow
def test_the_3000_rule_grammar_is_refused_and_deeper_chains_cannot_crash(child):
    """Issue 40's grammar (SIGSEGV in llguidance's recursion on the caller's stack): over
    the rule limit; past the limit, straight to the matcher, chains of 3,000 and 20,000
    rules and a 3,000-link `$ref` chain compile on the large-stack threads (or fail
    cleanly) from a 512 KiB thread."""
    got = _assert_compiles_or_grammar_error(child, "grammar", CHAIN_3000)
    assert not got["ok"] and f"at most {guard.MAX_GRAMMAR_RULES} rules" in got["error"]
    for n in (3000, 20000):
        _assert_compiles_or_grammar_error(child, "raw_lark", _chain(n))
    _assert_compiles_or_grammar_error(child, "json_schema", _ref_chain(3000))


# ------------------------------------------------------------------ fuzzing every kind

_SIZES = st.one_of(st.integers(0, 40), st.sampled_from([200, 1000, 1999, 2001, 3000, 5000]))


@st.composite
def _lark(draw):
    n = draw(_SIZES)
    shape = draw(st.sampled_from(["alt", "seq", "terminals", "nested", "wide", "repeat", "text"]))
    if shape == "alt":
        return _chain(n)
    if shape == "seq":  # right recursion through a chain: deep rows after a few tokens
        return "start: r0\n" + "\n".join(f'r{i}: "t" r{i+1}?' for i in range(n)) + f'\nr{n}: "e"'
    if shape == "terminals":  # a chain of terminals: one lexeme built recursively
        return "start: T0\n" + "\n".join(f'T{i}: "t{i}" | T{i+1}' for i in range(n)) + f'\nT{n}: "e"'
    if shape == "nested":
        return "start: " + "(" * n + '"a"' + ")" * n
    if shape == "wide":
        return "start: " + " | ".join(f'"w{i}"' for i in range(n + 1))
    if shape == "repeat":
        return 'start: "a"{0,%d} /[a-z]{1,%d}/' % (n, n + 1)
    return "start: " + draw(st.text("ab()|*+?{}[]/\"'%: \n0123456789", max_size=40))


@st.composite
def _gbnf(draw):
    n = draw(_SIZES)
    shape = draw(st.sampled_from(["alt", "seq", "nested", "wide", "text"]))
    if shape == "alt":
        return "root ::= r0\n" + "\n".join(f'r{i} ::= "t{i}" | r{i+1}' for i in range(n)) + f'\nr{n} ::= "e"'
    if shape == "seq":  # the converter's worst order: one rule becomes terminal a pass
        return "root ::= r0\n" + "\n".join(f'r{i} ::= "a" "b" r{i+1}' for i in range(n)) + f'\nr{n} ::= "e"'
    if shape == "nested":
        return "root ::= " + "(" * n + '"a"' + ")" * n
    if shape == "wide":
        return "root ::= " + " | ".join(f'"w{i}" [a-z]*' for i in range(n + 1))
    return "root ::= " + draw(st.text("ab()|*+?{}[]\"\\:=- \n019", max_size=40))


@st.composite
def _regex(draw):
    n = draw(_SIZES)
    shape = draw(st.sampled_from(["nested", "repeat", "wide", "class", "text"]))
    if shape == "nested":
        return "(" * n + "a" + ")" * n
    if shape == "repeat":
        return "a{0,%d}b{%d}" % (n * 20, n)
    if shape == "wide":
        return "|".join(f"w{i}" for i in range(n + 1))
    if shape == "class":
        return r"[^\x00-\U0010FFFF]" + "a" * n
    return draw(st.text("ab()[]{}|*+?^$.\\,-019dswU", min_size=1, max_size=40))


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 3) | st.sampled_from(
    ["string", "integer", "object", "array", "#", "#/$defs/a", "$ref", "type", "items"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["type", "items", "properties", "$ref", "$defs", "anyOf", "allOf", "required", "a",
         "minItems", "maxItems", "enum", "additionalProperties"]), inner, max_size=4),
    max_leaves=20)


@st.composite
def _schema(draw):
    n = draw(_SIZES)
    depth = min(n, 300)  # nested deeper, it could not reach the child as JSON (the deep
    # schemas' own test is test_deep_or_huge_schemas_are_refused_before_their_compile)
    shape = draw(st.sampled_from(["arrays", "objects", "refs", "anyof", "cycle", "wide", "any"]))
    if shape == "arrays":
        s: dict = {"type": "string"}
        for _ in range(depth):
            s = {"type": "array", "items": s}
        return s
    if shape == "objects":
        s = {"type": "integer"}
        for _ in range(depth):
            s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
        return s
    if shape == "refs":
        return _ref_chain(n)
    if shape == "anyof":
        s = {"type": "string"}
        for _ in range(depth):
            s = {"anyOf": [s, {"type": "integer"}]}
        return s
    if shape == "cycle":
        return {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "$ref": draw(st.sampled_from(["#", "#/$defs/a"]))}
    if shape == "wide":
        return {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(n)},
                "required": [f"p{i}" for i in range(0, n, 2)]}
    return draw(_JSON)


_CASES = st.one_of(
    st.tuples(st.just("grammar"), _lark()), st.tuples(st.just("grammar"), _gbnf()),
    st.tuples(st.just("regex"), _regex()), st.tuples(st.just("json_schema"), _schema()),
    st.tuples(st.just("choice"), _SIZES.map(lambda n: [f"c{i}" for i in range(n)])))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(_CASES)
def test_every_grammar_input_compiles_or_is_a_grammar_error(child, case):
    arg, value = case
    _assert_compiles_or_grammar_error(child, arg, value)


# ------------------------------------------------------------------ limits, before the compile


def test_oversized_gbnf_is_refused_before_its_conversion():
    """A 75 KB GBNF grammar (16 s of the converter's CPU before): refused by its size; one
    within the size but over rules x size: refused by the product. Both before llguidance's
    converter runs (it is replaced by one that fails the test)."""
    import llguidance.gbnf_to_lark as conv

    from fx_engine.engine.constraints import parse_constraint

    big = "root ::= r0\n" + "\n".join(f'r{i} ::= "ab" "cd" r{i + 1}' for i in range(3000)) + '\nr3000 ::= "e"'
    assert len(big) > 75_000
    costly = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" "b" "c" r{i + 1}' for i in range(900)) + '\nr900 ::= "e"'
    assert 900 * len(costly) > guard.MAX_GBNF_COST and len(costly) < guard.MAX_GBNF_CHARS
    real = conv.gbnf_to_lark
    try:
        conv.gbnf_to_lark = lambda text: pytest.fail("the GBNF converter ran")
        with pytest.raises(ValueError, match=r"^grammar: a GBNF grammar may have at most 65536 characters"):
            parse_constraint(grammar=big)
        with pytest.raises(ValueError, match=r"^grammar: GBNF grammar too large to convert"):
            parse_constraint(grammar=costly)
    finally:
        conv.gbnf_to_lark = real


def test_deep_or_huge_schemas_are_refused_before_their_compile():
    from fx_engine.engine.constraints import parse_constraint

    deep: dict = {"type": "string"}
    for _ in range(2000):  # deeper than Python's recursion limit: no RecursionError either
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match=r"^json_schema: a JSON schema may nest"):
        parse_constraint(json_schema=deep)
    with pytest.raises(ValueError, match=r"^response_format\.json_schema\.schema: a JSON schema may nest"):
        parse_constraint({"type": "json_schema", "json_schema": {"name": "x", "schema": deep,
                                                                  "strict": True}})
    with pytest.raises(ValueError, match=r"^json_schema: a JSON schema may have at most"):
        parse_constraint(json_schema=_ref_chain(guard.MAX_SCHEMA_NODES + 10))
