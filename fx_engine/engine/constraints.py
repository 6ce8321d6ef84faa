"""Constrained decoding, host side: grammars compiled by llguidance, one matcher per row.

A request may constrain its output to valid JSON, a JSON Schema, a regular expression, a
Lark or GBNF grammar, or one of a list of strings (`parse_constraint`: every spelling the
Python API and the server accept comes down to one `Constraint`). llguidance (the grammar
engine vLLM, SGLang and llama.cpp use) compiles it against the model's tokenizer and keeps
one matcher per row (`RowGrammar`). Each step the engine asks every constrained row for its
allowed-token bitmask (32 tokens per int32 word, bit v % 32 of word v // 32) and passes the
[B, W] array to the compiled step (`core.sampling.apply_token_mask`): constrained rows and
free rows share one graph, and a batch with no constrained row passes no mask at all.
After the step each row's matcher consumes the token it sampled.

Speculative rows: `RowGrammar.draft_masks` walks the drafts through the matcher, keeps the
longest allowed prefix and writes the mask at every verified position, so verification
samples each position under the grammar state it would reach; the matcher is then rolled
back and consumes only the tokens actually emitted.

JSON whitespace: between tokens of the JSON grammar at most `JSON_WHITESPACE` (a newline
and a few spaces or tabs of indentation) may appear, as llama.cpp's JSON grammars and
XGrammar's `any_whitespace=False` spirit do: small models under a free-whitespace JSON
grammar tend to emit newlines forever, which is valid JSON that never ends.

Hostile grammars (engine/grammar_guard.py): limits on rules, size and schema depth are
checked before llguidance sees a grammar, every llguidance compile runs on a thread with a
large stack, and a matcher is built and its first mask computed when the request is made,
so a grammar that cannot compile, or allows no output at all, is a GrammarError naming its
field before the request is admitted (the server's 400), never a crash or a failed step.
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import Any, Callable, Sequence

import attrs
import mlx.core as mx
import numpy as np

from fx_engine.core.sampling import mask_words

from fx_engine.engine.grammar_guard import (
    GrammarError, check_grammar_text, check_schema, clean_error, on_compile_thread)

__all__ = ["Constraint", "GrammarError", "RowGrammar", "parse_constraint", "grammar_tokenizer",
           "batch_masks", "verify_masks"]

#: Whitespace allowed between JSON tokens: one optional newline and up to 16 blanks.
JSON_WHITESPACE = r"[\n]?[ \t]{0,16}"
#: Largest grammar text accepted (a JSON schema, regex or grammar), in characters.
MAX_GRAMMAR_CHARS = 256 * 1024


@attrs.frozen
class Constraint:
    """One request's output constraint. `field` is the argument it came from (errors name
    it); `kind` one of "json", "json_schema", "regex", "grammar", "choice"; `grammar` the
    llguidance grammar (a JSON document) built from it."""

    field: str
    kind: str
    grammar: str = attrs.field(repr=False)


def _llg() -> Any:
    try:
        import llguidance
    except ImportError as e:  # a dependency: only a broken install lacks it
        raise GrammarError("constrained decoding needs the llguidance package "
                           "(pip install llguidance)") from e
    return llguidance


def _compiled(field: str, fn: Any, *args: Any, **kw: Any) -> str:
    """llguidance's fn(*args, **kw) on a compile thread; its errors as GrammarErrors
    naming `field`, without llguidance's parser dump."""
    try:
        return on_compile_thread(field, lambda: fn(*args, **kw))
    except GrammarError:
        raise
    except Exception as e:  # ValueError; RecursionError from the GBNF converter
        raise GrammarError(f"{field}: {clean_error(str(e))}") from None


def _json_options() -> dict[str, Any]:
    return {"whitespace_flexible": False, "whitespace_pattern": JSON_WHITESPACE}


def _schema_grammar(field: str, schema: Any) -> str:
    if isinstance(schema, str):
        _text(field, schema)
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise GrammarError(f"{field}: not valid JSON ({e})") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise GrammarError(f"{field}: a JSON schema must be an object, got {type(schema).__name__}")
    check_schema(field, schema)
    return _compiled(field, _llg().LLMatcher.grammar_from_json_schema, schema,
                     overrides=_json_options())


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise GrammarError(f"{field}: expected a non-empty string, got {type(value).__name__}")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{field}: at most {MAX_GRAMMAR_CHARS} characters, got {len(value)}")
    return value


def _closed(schema: Any) -> Any:
    """OpenAI's strict mode: objects take no properties beyond those they list, unless the
    schema says otherwise (`additionalProperties` given)."""
    if isinstance(schema, list):
        return [_closed(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples") else _closed(v))
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _pydantic_schema(value: Any) -> dict[str, Any] | None:
    """A Pydantic model class's JSON schema, strict as openai's `.parse()` sends it (an
    output with extra keys would not be what the class describes), else None."""
    schema = getattr(value, "model_json_schema", None)
    return _closed(schema()) if isinstance(value, type) and callable(schema) else None


def _from_response_format(value: Any) -> Constraint | None:
    """OpenAI's `response_format` (also a Pydantic model class in the Python API), with
    llama.cpp's `{"type": "json_object", "schema": ...}` form."""
    f = "response_format"
    schema = _pydantic_schema(value)
    if schema is not None:
        return Constraint(f, "json_schema", _schema_grammar(f, schema))  # a Pydantic class
    if not isinstance(value, dict):
        raise GrammarError(f"{f}: expected an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type", "schema"},
               "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise GrammarError(f"{f}.type: must be one of 'text', 'json_object', 'json_schema', "
                           f"got {kind!r}")
    extra = sorted(set(value) - allowed[kind])
    if extra:
        raise GrammarError(f"{f}.{extra[0]}: unknown field for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        if "schema" in value:
            return Constraint(f"{f}.schema", "json_schema",
                              _schema_grammar(f"{f}.schema", value["schema"]))
        return Constraint(f, "json", _schema_grammar(f, {"type": "object"}))
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise GrammarError(f"{f}.json_schema: required, an object with 'name' and 'schema'")
    extra = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if extra:
        raise GrammarError(f"{f}.json_schema.{extra[0]}: unknown field")
    name = spec.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise GrammarError(f"{f}.json_schema.name: required, a string of 1 to 64 characters")
    strict = spec.get("strict", False)
    if not isinstance(strict, (bool, type(None))):
        raise GrammarError(f"{f}.json_schema.strict: must be a boolean")
    # Strict or not, the schema is enforced (never accepted and then ignored); strict also
    # closes objects to unlisted properties, as OpenAI's strict mode requires of schemas.
    schema = spec.get("schema", {})
    check_schema(f"{f}.json_schema.schema", schema)  # before _closed walks it
    return Constraint(f"{f}.json_schema.schema", "json_schema", _schema_grammar(
        f"{f}.json_schema.schema", _closed(schema) if strict else schema))


def _from_choice(field: str, value: Any) -> Constraint:
    if (not isinstance(value, (list, tuple)) or not value
            or not all(isinstance(c, str) and c for c in value)):
        raise GrammarError(f"{field}: expected a non-empty list of non-empty strings")
    # One terminal of alternatives: llguidance lexes it as one regex, where a rule of
    # alternatives would be one parser item per string (at most 2,000 per row).
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in dict.fromkeys(value))
    return Constraint(field, "choice", _compiled(field, _llg().grammar_from, "lark",
                                                 _text(field, lark)))


def parse_constraint(
    response_format: Any = None, json_schema: Any = None, regex: Any = None,
    grammar: Any = None, choice: Any = None, *, names: dict[str, str] | None = None,
) -> Constraint | None:
    """The one constraint these arguments ask for (None: none). At most one may be given.

    response_format: OpenAI's (`{"type": "text" | "json_object" | "json_schema", ...}`) or a
    Pydantic model class; json_schema: a schema (dict or JSON text); regex: a regular
    expression the whole output must match (Rust regex syntax); grammar: a Lark grammar or a
    llama.cpp GBNF one; choice: a list of strings, the output being exactly one of them.
    `names` maps each argument to the name the caller knows it by (the server's field
    names), for error messages. Grammar errors are `GrammarError` (a ValueError) naming it.
    """
    names = names or {}
    given = {k: v for k, v in (("response_format", response_format), ("json_schema", json_schema),
                               ("regex", regex), ("grammar", grammar), ("choice", choice))
             if v is not None}
    if len(given) > 1:
        a, b = (names.get(k, k) for k in list(given)[:2])
        raise GrammarError(f"{a}: cannot be combined with {b} (give one output constraint)")
    if not given:
        return None
    (key, value), = given.items()
    field = names.get(key, key)
    if key == "response_format":
        try:
            c = _from_response_format(value)  # its field is a path under "response_format"
        except GrammarError as e:  # named as the caller knows the field, as a result is
            msg = str(e)
            if field == key or not msg.startswith(key):
                raise
            raise GrammarError(field + msg[len(key):]) from None
        return None if c is None else attrs.evolve(c, field=field + c.field[len(key):])
    if key == "json_schema":
        return Constraint(field, "json_schema", _schema_grammar(field, value))
    if key == "choice":
        return _from_choice(field, value)
    text = _text(field, value)
    if key == "grammar":
        check_grammar_text(field, text)
    return Constraint(field, key, _compiled(field, _llg().grammar_from,
                                            "regex" if key == "regex" else "grammar", text))


# ------------------------------------------------------------------------------------------
# The tokenizer llguidance needs (built once per model tokenizer: ~0.25 s for 49k tokens)
# ------------------------------------------------------------------------------------------

_TOKENIZERS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """llguidance's view of `tokenizer` (fx_engine's Tokenizer over HF `tokenizers`) with
    the model's logits width (`vocab_size`: ids the tokenizer lacks are never allowed) and
    end-of-generation tokens (allowed once the grammar is complete)."""
    key = (vocab_size, tuple(sorted(eos_ids)))
    with _TOKENIZERS_LOCK:
        per = _TOKENIZERS.setdefault(tokenizer, {})
        if key not in per:
            try:
                per[key] = _llg().LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                              eos_token=list(key[1]))
            except Exception as e:
                raise GrammarError(f"constrained decoding: llguidance cannot use this model's "
                                   f"tokenizer ({e})") from None
        return per[key]


# ------------------------------------------------------------------------------------------
# One row's matcher
# ------------------------------------------------------------------------------------------


class RowGrammar:
    """A request's grammar state: the allowed tokens now, and the tokens it consumed."""

    def __init__(self, constraint: Constraint, tokenizer: Any):
        self.constraint = constraint
        self.words = (tokenizer.vocab_size + 31) // 32
        self.eos = frozenset(int(t) for t in tokenizer.eos_tokens)
        self.matcher = on_compile_thread(constraint.field, lambda: self._matcher(tokenizer))

    def _matcher(self, tokenizer: Any) -> Any:
        """The compiled matcher, its first mask computed: a grammar that cannot start (no
        token begins an output it allows, a parser limit hit at once) fails here, when
        the request is made, not at its first step."""
        llg = _llg()
        err = llg.LLMatcher.validate_grammar(self.constraint.grammar, tokenizer)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"{self.constraint.field}: {clean_error(err)}")
        self.matcher = llg.LLMatcher(tokenizer, self.constraint.grammar, log_level=0)
        self._check()
        self.fill(np.zeros(self.words, np.int32))
        return self.matcher

    def _check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"{self.constraint.field}: "
                               f"{clean_error(self.matcher.get_error())}")

    def fill(self, out: np.ndarray) -> None:
        """Write the allowed-token bitmask (int32 [W], C-contiguous) for the next token."""
        if out.dtype != np.int32 or out.shape != (self.words,) or not out.flags["C_CONTIGUOUS"]:
            raise ValueError(f"mask buffer must be C-contiguous int32 [{self.words}]")
        self.matcher.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check()

    def consume(self, token: int) -> None:
        """Advance past a sampled token (always allowed: it was sampled under the mask)."""
        if not self.matcher.consume_token(int(token)):
            self._check()
            raise GrammarError(f"{self.constraint.field}: token {token} is not allowed here")

    def draft_masks(self, drafts: Sequence[int], out: np.ndarray) -> int:
        """Masks for a verify step: out[0] for the next position, out[j + 1] after drafts
        0..j; returns how many leading drafts the grammar allows (the rest must not be
        verified: their masks are left as they are). The matcher's state is unchanged.
        An allowed end-of-generation draft counts but is not consumed (it ends the row; the
        matcher does not count it as a token it could roll back) and ends the walk."""
        self.fill(out[0])
        n = consumed = 0
        for j, t in enumerate(drafts):
            w, bit = divmod(int(t), 32)
            if w >= self.words or not (int(out[j][w]) >> bit) & 1:
                break
            if int(t) in self.eos:
                n += 1
                break
            if not self.matcher.consume_token(int(t)):
                break
            n += 1
            consumed += 1
            self.fill(out[j + 1])
        if consumed and not self.matcher.rollback(consumed):
            self._check()
            raise GrammarError(f"{self.constraint.field}: grammar rollback failed")
        return n

    @property
    def stopped(self) -> bool:
        """The grammar is complete and allows nothing more (only end of generation)."""
        return self.matcher.is_stopped()


# ------------------------------------------------------------------------------------------
# A batch's masks (the engine's rows: objects with a `grammar`, RowGrammar or None)
# ------------------------------------------------------------------------------------------


def batch_masks(rows: Sequence[Any], vocab_size: int,
                on_error: Callable[[Any, BaseException], None] | None = None) -> mx.array | None:
    """The allowed-token bitmask [B, W] of every row of a decode step (constrained rows
    from their grammar, the others all ones), or None when no row is constrained (the
    step then takes no mask). A row whose grammar fails is left all ones and handed to
    `on_error(row, error)` (it fails that request only; the row is inactive by the time
    the step runs); without on_error the error propagates (a first token: the caller
    fails its prefill row)."""
    if not any(r is not None and r.grammar is not None for r in rows):
        return None
    m = np.full((len(rows), mask_words(vocab_size)), -1, np.int32)
    for i, r in enumerate(rows):
        if r is not None and r.grammar is not None:
            try:
                r.grammar.fill(m[i])
            except Exception as e:
                if on_error is None:
                    raise
                m[i] = -1
                on_error(r, e)
    return mx.array(m)


def verify_masks(rows: Sequence[Any], drafts: dict[Any, Any], k: int, vocab_size: int,
                 on_error: Callable[[Any, BaseException], None]) -> mx.array | None:
    """A verify step's masks [B, K+1, W] (None: no constrained row): each constrained row's
    mask at every verified position, the state its grammar would reach after each draft
    (`RowGrammar.draft_masks`). Cuts each constrained row's drafts (in `drafts`: row ->
    (tokens, probs)) to the prefix its grammar allows, since a disallowed draft could
    otherwise be accepted; a row whose grammar fails loses its drafts and goes to
    on_error."""
    if not any(r is not None and r.grammar is not None for r in rows):
        return None
    m = np.full((len(rows), k + 1, mask_words(vocab_size)), -1, np.int32)
    for i, r in enumerate(rows):
        if r is None or r.grammar is None:
            continue
        toks, probs = drafts.get(r, ((), None))
        try:
            ok = r.grammar.draft_masks(toks, m[i])
        except Exception as e:
            m[i] = -1
            drafts.pop(r, None)
            on_error(r, e)
            continue
        if ok < len(toks):
            if ok:
                drafts[r] = (toks[:ok], None if probs is None else probs[:ok])
            else:
                drafts.pop(r, None)
    return mx.array(m)
