"""Constrained decoding: the mask in the pure steps, grammars in the engine (JSON, JSON
Schema, regex, Lark/GBNF, choice), per row of a batch, with speculation and sampling.

Oracles: numpy's bit unpacking for the mask layout, `jsonschema` for schema validity,
Python's `re` for regexes and for the languages of the test grammars, plain decoding for
identity (free rows beside constrained ones, speculative vs not, the reference loop)."""

from __future__ import annotations

import json
import re

import attrs
import jsonschema
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.core.sampling import SamplingConfig, apply_token_mask, mask_words
from fx_engine.core.state import init_state, sample_step
from fx_engine.core.steps import decode_step_compiled, prefill_step, sample_step_compiled, verify_step
from fx_engine.engine.constraints import GrammarError, parse_constraint
from fx_engine.engine.generate import reference_generate

from tests.engine.test_speculative import _chi2_sf_even, _prompt, bi  # noqa: F401  (fixture)


def _mask(allowed_ids, vocab, rows=1) -> np.ndarray:
    bits = np.zeros((rows, mask_words(vocab) * 32), np.uint8)
    for r in range(rows):
        bits[r, list(allowed_ids[r] if rows > 1 else allowed_ids)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


# ------------------------------------------------------------------ the pure part


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 200), st.integers(1, 3), st.data())
def test_mask_layout_is_llguidances(vocab, rows, data):
    """Token v is bit v % 32 of word v // 32 (little-endian bits, as llguidance fills)."""
    words = data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=rows * mask_words(vocab),
                               max_size=rows * mask_words(vocab)))
    m = np.array(words, np.int32).reshape(rows, -1)
    logits = mx.arange(rows * vocab, dtype=mx.float32).reshape(rows, vocab)
    got = np.array(apply_token_mask(logits, mx.array(m)))
    allowed = np.unpackbits(m.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    expect = np.where(allowed, np.array(logits), -np.inf)
    assert np.array_equal(got, expect)


def test_masked_tokens_are_never_sampled_and_logprobs_are_the_constrained_ones(tiny_model):
    v = tiny_model.config.vocab_size
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(1, v)).astype(np.float32) * 3)
    allowed = sorted(rng.choice(v, size=7, replace=False).tolist())
    n = 400
    cfgs = [SamplingConfig(temperature=1.5, seed=i, logprobs=2) for i in range(n - 1)]
    cfgs.append(SamplingConfig(temperature=0.0, logprobs=2))  # and one greedy row
    state = init_state(cfgs, [[1]] * n, v)
    out = sample_step(state, mx.broadcast_to(logits, (n, v)), mx.array(_mask(allowed, v).repeat(n, 0)))
    toks = out.tokens.tolist()
    assert set(toks) <= set(allowed) and len(set(toks)) > 3
    lg = np.array(logits[0], np.float64)
    assert toks[-1] == allowed[int(np.argmax(lg[allowed]))]  # greedy: the best allowed token
    lse = np.log(np.exp(lg[allowed] - lg[allowed].max()).sum()) + lg[allowed].max()
    for t, lp in zip(toks, out.logprob.tolist()):
        assert lp == pytest.approx(lg[t] - lse, abs=1e-5)
    assert set(np.array(out.top_ids).ravel().tolist()) <= set(allowed)


def test_masks_are_step_inputs_not_recompiles(tiny_model):
    m = tiny_model
    v = m.config.vocab_size
    cache = m.new_cache(2, 64)
    logits, cache = prefill_step(m.params, cache, mx.array([[1, 2, 3], [4, 5, 6]]), mx.array([3, 3]))
    state = sample_step_compiled(init_state([SamplingConfig(), SamplingConfig()], [[1], [4]], v), logits)
    rng = np.random.default_rng(1)
    traces = None
    for step in range(6):
        allowed = [rng.choice(v, size=3, replace=False).tolist() for _ in range(2)]
        state, cache = decode_step_compiled(m.params, cache, state, mask=mx.array(_mask(allowed, v, 2)))
        assert all(t in a for t, a in zip(state.tokens.tolist(), allowed))
        if step == 1:
            traces = decode_step_compiled.traces
    assert decode_step_compiled.traces == traces


def test_verify_under_a_mask_has_the_constrained_distribution(bi):
    """verify_step with a mask: the first emitted token (accepted draft or residual draw) is
    distributed as the target restricted to the allowed tokens (chi-square, 4000 rows), even
    when the drafter proposes tokens the mask forbids (they are always rejected)."""
    model, vocab, n = bi, bi.config.vocab_size, 4000
    prompt = _prompt(model, 20)
    cache = model.new_cache(1, 64)
    logits, _ = prefill_step(model.params, cache, mx.array([prompt]), mx.array([20]))
    last = int(mx.argmax(logits[0]).item())
    lg = fx_engine.logits(model, prompt + [last])[-1]
    top = mx.argsort(-lg)[:9].tolist()
    allowed = sorted(top[::2])  # 5 of the 9 most likely tokens
    temp = 4.0
    sub = mx.softmax(lg[mx.array(allowed)] / temp)
    target = {t: float(p) for t, p in zip(allowed, sub.tolist())}
    qv = mx.zeros((vocab,)).at[mx.array(top)].add(1 / 9)  # drafts over all 9, allowed or not
    cfgs = [SamplingConfig(temperature=temp, seed=i) for i in range(n)]
    state = attrs.evolve(init_state(cfgs, [prompt + [last]] * n, vocab),
                         tokens=mx.full((n,), last, mx.int32))
    c = model.new_cache(n, 64)
    _, c = prefill_step(model.params, c, mx.array([prompt] * n), mx.array([20] * n))
    drafts = mx.random.categorical(mx.log(qv)[None], num_samples=n, key=mx.random.key(3)).reshape(n, 1)
    mask = mx.array(np.broadcast_to(_mask(allowed, vocab)[:, None], (n, 2, mask_words(vocab))).copy())
    _, _, res = verify_step(model.params, c, state, drafts.astype(mx.int32), mx.ones((n,), mx.int32),
                            mx.broadcast_to(qv[None, None], (n, 1, vocab)), mask=mask)
    toks = res.tokens[:, 0].tolist()
    counts = {t: toks.count(t) for t in allowed}
    assert sum(counts.values()) == n  # never a forbidden token
    stat = sum((counts[t] - n * target[t]) ** 2 / (n * target[t]) for t in allowed)
    assert _chi2_sf_even(stat, 4) > 1e-3


# ------------------------------------------------------------------ arguments


@pytest.mark.parametrize("kw,match", [
    ({"response_format": {"type": "nonsense"}}, r"response_format\.type"),
    ({"response_format": {"type": "json_schema"}}, r"response_format\.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     r"response_format\.json_schema\.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schemma": {}}}},
     r"response_format\.json_schema\.schemma"),
    ({"response_format": {"type": "json_object", "extra": 1}}, r"response_format\.extra"),
    ({"response_format": "json"}, "response_format"),
    ({"json_schema": {"type": "strnig"}}, "json_schema"),
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": {"type": "string", "pattern": "(?=x)"}}, "json_schema"),
    ({"regex": "(("}, "regex"),
    ({"regex": ""}, "regex"),
    ({"grammar": "start: x\nx: /[a-z]+"}, "grammar"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"regex": "a", "grammar": 'root ::= "a"'}, "regex: cannot be combined with grammar"),
])
def test_bad_constraints_are_errors_naming_the_field(default_model, kw, match):
    with pytest.raises(ValueError, match=match):
        fx_engine.generate(default_model, "hi", max_tokens=2, **kw)


def test_text_response_format_is_no_constraint():
    assert parse_constraint({"type": "text"}) is None
    with pytest.raises(GrammarError):
        parse_constraint({"type": "text", "json_schema": {}})


# ------------------------------------------------------------------ in the engine

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": "string", "format": "email", "maxLength": 30},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]},
             "minItems": 1, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}

SHAPES = {
    "person": PERSON,
    "refs": {"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10},
        "y": {"type": "number", "exclusiveMinimum": 0, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}},
        "type": "object", "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/pt"},
                                                    "maxItems": 2}},
        "required": ["points"], "additionalProperties": False},
    "anyof": {"anyOf": [{"type": "integer", "minimum": 3, "maximum": 9},
                        {"type": "string", "enum": ["yes", "no"]},
                        {"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                         "required": ["d"], "additionalProperties": False}]},
    "list": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 4},
}

ARITH = r'root ::= "(" num ("+" num)* ")"' + "\n" + r'num ::= [1-9] [0-9]{0,2}'
ARITH_RE = r"\(\d{1,3}(\+\d{1,3})*\)"
LARK = 'start: WORD ("," WORD)*\nWORD: /[a-z]{1,8}/'
LARK_RE = r"[a-z]{1,8}(,[a-z]{1,8})*"


def _check(kind, spec, text):
    if kind == "schema":
        jsonschema.validate(json.loads(text), spec, format_checker=jsonschema.FormatChecker())
    elif kind == "object":
        assert isinstance(json.loads(text), dict)
    else:
        assert re.fullmatch(spec, text), text


def _cases():
    msgs = lambda q: [{"role": "user", "content": q}]  # noqa: E731
    out = [(f"schema:{k}", "schema", s, msgs(f"Reply with JSON ({k})."),
            {"response_format": {"type": "json_schema", "json_schema": {"name": k, "schema": s}}})
           for k, s in SHAPES.items()]
    out += [
        ("object", "object", None, msgs('Reply with the JSON object {"answer": "Paris"}.'),
         {"response_format": {"type": "json_object"}}),
        ("regex", "regex", r"(yes|no): [a-z ]{1,24}\.", msgs("Is water wet?"),
         {"regex": r"(yes|no): [a-z ]{1,24}\."}),
        ("gbnf", "regex", ARITH_RE, msgs("Write a sum."), {"grammar": ARITH}),
        ("lark", "regex", LARK_RE, msgs("List some fruits."), {"grammar": LARK}),
        ("choice", "regex", "Paris|London|Rome", msgs("Capital of Italy?"),
         {"choice": ["Paris", "London", "Rome"]}),
    ]
    return out


@pytest.mark.slow
def test_constrained_rows_beside_free_rows_in_one_batch(default_model):
    """Every constrained row's output validates (greedy and sampled rows, with and without
    prompt lookup), and the free rows of the same batch give exactly what they give alone."""
    m = default_model
    free = [("free", [{"role": "user", "content": q}]) for q in ("Name a color.", "Say hi.")]
    solo = [fx_engine.generate(m, p, max_tokens=24, temperature=0.0) for _, p in free]
    engine = fx_engine.Engine(m, max_rows=8)
    handles = []
    for name, kind, spec, prompt, kw in _cases():
        for extra in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 7},
                      {"temperature": 0.7, "seed": 1, "prompt_lookup": True}):
            handles.append((name, kind, spec, extra,
                            engine.submit(prompt, max_tokens=160, **kw, **extra)))
    free_handles = [engine.submit(p, max_tokens=24, temperature=0.0) for _, p in free]
    engine.close()  # runs everything on this thread
    for name, kind, spec, extra, h in handles:
        out = h.result()
        if kind == "object" and extra["temperature"] and out.finish_reason == "length":
            continue  # "any JSON object" has no size bound: a sampled row may run long
        assert out.finish_reason == "stop", (name, extra, out.text)
        _check(kind, spec, out.text)
    for s, h in zip(solo, free_handles):
        assert h.result().token_ids == s.token_ids


@pytest.mark.slow
def test_constrained_greedy_is_the_same_with_speculation_and_in_the_reference_loop(default_model_bi):
    m = default_model_bi
    prompt = [{"role": "user", "content": "Give a JSON person named Ann with tags a and b."}]
    kw = {"json_schema": PERSON, "max_tokens": 80, "temperature": 0.0}
    ref = reference_generate(m, prompt, **kw)
    _check("schema", PERSON, ref.text)
    got = fx_engine.generate(m, prompt, **kw)
    spec = fx_engine.generate(m, prompt, prompt_lookup=True, num_draft_tokens=8, **kw)
    assert got.token_ids == ref.token_ids == spec.token_ids
    assert spec.usage.accepted_tokens > 0  # drafts were verified under the grammar


def test_pydantic_model_as_response_format(default_model):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**9)

    out = fx_engine.generate(default_model, [{"role": "user", "content": "Describe Paris."}],
                             response_format=City, max_tokens=60, temperature=0.0)
    City.model_validate_json(out.text)


def test_logits_processors_and_stops_compose_with_a_grammar(default_model):
    seen = []

    def proc(tokens, logits):
        seen.append(int(tokens.shape[0]))
        return logits

    out = fx_engine.generate(default_model, [{"role": "user", "content": "Count."}],
                             regex=r"[0-9]( [0-9]){9}", logits_processors=[proc],
                             max_tokens=40, temperature=0.0, stop=[" 5"])
    assert re.fullmatch(r"[0-9]( [0-9])*", out.text) and seen
    assert out.finish_reason == "stop"


def test_an_end_of_generation_draft_keeps_the_grammar_in_step(default_model):
    """Drafts that end with EOS (a draft model proposes it once the grammar is complete):
    the matcher is walked and rolled back without counting EOS as a consumed token, so the
    speculative run equals the plain one (the matcher used to lose a real token)."""
    from fx_engine.engine.constraints import RowGrammar, grammar_tokenizer

    m = default_model
    lt = grammar_tokenizer(m.tokenizer, m.config.vocab_size, m.eos_ids)
    g = RowGrammar(parse_constraint(regex="[0-9]{2}"), lt)
    for t in m.tokenizer.encode("12", add_special_tokens=False):
        g.consume(t)
    out = np.zeros((3, g.words), np.int32)
    eos = m.eos_ids[0]
    assert g.draft_masks([eos], out) == 1
    after = np.zeros((g.words,), np.int32)
    g.fill(after)  # unchanged: still complete, only end of generation allowed
    assert (after[eos // 32] >> (eos % 32)) & 1
    digit = m.tokenizer.encode("3", add_special_tokens=False)[0]
    assert not (after[digit // 32] >> (digit % 32)) & 1
    prompt = [{"role": "user", "content": "Yes or no?"}]
    for kw in ({"choice": ["yes", "no"]}, {"response_format": {"type": "json_object"}}):
        plain = fx_engine.generate(m, prompt, max_tokens=30, temperature=0.0, **kw)
        spec = fx_engine.generate(m, prompt, max_tokens=30, temperature=0.0, draft_model=m, **kw)
        assert spec.token_ids == plain.token_ids
