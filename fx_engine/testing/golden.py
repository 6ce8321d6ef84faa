"""Golden-output regression kit: pin a model's behaviour, then check it after any change.

Cases are data (JSON or YAML): a list, or {"cases": [...]}, each

    name: paris                      # unique
    model: default                   # "default", a GGUF/HF path, or "tiny:<type>" (tests)
    messages: [{role: user, content: "What is the capital of France?"}]   # or prompt: "..." / [ids]
    sampling: {temperature: 0.8, seed: 42}      # fx_engine.generate sampling arguments only
    max_tokens: 24
    top_logprobs: 5                  # optional: also record the top-5 logprobs per position
    compare: tokens                  # tokens (exact, default) | logprobs (within logprob_tol)
    logprob_tol: 0.001
    params: {guidance: 1.5}          # optional: a custom producer's own settings (case.params)

An unknown key (in the case, or in `sampling`: see `sampling_keys()`) is a `GoldenError`
naming the case and the key; settings that only a custom loop understands go under `params`.

`record(cases)` runs them and returns a golden document: per case the prompt's token ids,
the expected token ids, text, each expected token's logprob (teacher-forced under the
model, raw distribution, or the producer's own: see below) and optionally the top-k; plus
the origin (fx-engine and MLX versions, backend, BLAS, date, producer) and each model's
fingerprint. `check(golden)` runs the cases again and returns one `CaseResult` per case:
"pass", "regression" (with the first divergent position: expected vs actual token and
text, and both logprobs), "fingerprint_mismatch" (the model is not the one the golden was
recorded with: not a regression) or "error".

Producers (pinning a custom decoding loop). By default the tokens come from
`fx_engine.generate`. `producer=fn` (Python, the pytest fixture) or `--producer
pkg.mod:fn` / `--producer path/to/loops.py:fn` (command line) runs your own loop instead,
for record and for check:

    def cfg(model, case: GoldenCase) -> Produced:      # called once per case
        ids = case.prompt_ids(model)                    # prompt (chat template applied)
        scale = case.params["guidance"]                 # the case's own settings
        ...                                             # case.sampling, case.max_tokens
        return Produced(token_ids=toks, logprobs=lps)   # or a list of ids, or a Completion

A producer returns a `Produced` (token ids; optionally each token's logprob under the
producer's own distribution, and the top-k per position), a list of token ids, or an
`fx_engine.Completion`; anything else, ids outside the vocabulary, more than max_tokens
tokens or logprobs of the wrong length are a `GoldenError` naming the case and the
producer, and an exception inside it a `ProducerError` (a GoldenError; the original
exception is its __cause__). When it returns logprobs those are recorded (the entry's
"logprobs_from": "producer"), else the model's teacher-forced ones. `compare: logprobs`
with a producer runs it and compares its logprobs along its tokens (it must return them);
with fx_engine.generate it scores the expected tokens teacher-forced instead (the model's
numerics, tolerant of a sampled token flipping at a near tie).

The producer's name ("module:qualname", or the --producer spec) is written to the
document's origin ("producer"), with the producer `check` must run ("check_producer": the
same one; fx_engine.generate for an independent oracle's recording, tools/make_golden.py;
documents without it: fx_engine.generate). Checking with another producer is a
`GoldenError` telling which one to pass, unless `allow_producer_mismatch=True`
(`--allow-producer-mismatch`): then the outputs are compared anyway. Two names are the same
producer when their function names and their modules' last components (a file's stem)
agree: `tests/loops.py:cfg` and `tests.loops:cfg` are one producer.

Command line: `fx-engine golden record CASES -o GOLDEN [--producer P]`, `fx-engine golden
check GOLDEN [--producer P]`. pytest: the `golden` fixture (opt-in: `pytest_plugins =
["fx_engine.testing.pytest_plugin"]`): `golden.check("golden.json", producer=fn)` fails
with the readable diff.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

FORMAT = "fx-engine-golden/1"
COMPARE_MODES = ("tokens", "logprobs")
DEFAULT_PRODUCER = "fx_engine.generate"
_CASE_FIELDS = {"name", "model", "prompt", "messages", "sampling", "max_tokens", "top_logprobs",
                "compare", "logprob_tol", "about", "params"}
# generate's keyword arguments that a case's `sampling` may not hold: set by the kit itself
# (max_tokens is the case's own field; the prompt / messages fields decide chat), or not data
_NOT_SAMPLING = frozenset({"max_tokens", "chat", "logits_processors", "draft_model", "constraint"})


class GoldenError(ValueError):
    """A malformed case file or golden document, or a producer that cannot be used or gave a
    malformed result (the message names the file or case and the field)."""


class ProducerError(GoldenError):
    """A producer raised while running a case (the original exception is the __cause__)."""


@functools.cache
def sampling_keys() -> frozenset[str]:
    """The keys a case's `sampling` may hold: fx_engine.generate's keyword arguments, less
    max_tokens (the case's own field), chat (the prompt / messages fields decide it) and
    those that are not data (logits_processors, draft_model, constraint)."""
    from fx_engine.engine.request import parse_request

    params = inspect.signature(parse_request).parameters.values()
    return frozenset(p.name for p in params if p.kind is p.KEYWORD_ONLY) - _NOT_SAMPLING


@attrs.frozen
class GoldenCase:
    """One case's inputs, as a producer receives it: name, model, prompt or messages,
    sampling (fx_engine.generate's arguments), max_tokens, top_logprobs, compare,
    logprob_tol, params (a custom producer's own settings, e.g. {"guidance": 1.5})."""

    name: str
    max_tokens: int
    model: str = "default"
    prompt: Any = None  # str or token ids
    messages: Any = None
    sampling: dict = attrs.field(factory=dict)
    top_logprobs: int = 0
    compare: str = "tokens"
    logprob_tol: float = 1e-3
    params: dict = attrs.field(factory=dict)

    def prompt_ids(self, model: Any) -> list[int]:
        """The prompt's token ids on `model` (messages: its chat template with the generation
        prompt; text: encoded raw; ids: as given), the ones the kit records and checks."""
        return prompt_ids(model, self)

    def generate_kwargs(self) -> dict[str, Any]:
        """max_tokens and the sampling arguments as `fx_engine.generate` takes them."""
        return {"max_tokens": self.max_tokens, **_sampling(self)}

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        return {k: v for k, v in d.items() if v is not None and not (k == "top_logprobs" and v == 0)
                and not (k == "params" and not v)}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_sampling(sampling: dict, where: str) -> None:
    unknown = sorted(str(k) for k in set(sampling) - sampling_keys())
    if unknown:
        hint = " (max_tokens is a field of the case)" if unknown == ["max_tokens"] else (
            "; a custom producer's own settings go under params:, e.g. params: {"
            f"{unknown[0]}: ...}}")
        raise GoldenError(f"{where}.sampling: unknown key(s) {unknown}: not fx_engine.generate sampling "
                          f"arguments{hint} (known: {', '.join(sorted(sampling_keys()))})")
    bias = sampling.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise GoldenError(f"{where}.sampling.logit_bias: an object {{token id: bias}} is required")
        for k, v in bias.items():
            if not (_is_int(k) or (isinstance(k, str) and re.fullmatch(r"\d+", k))):
                raise GoldenError(f"{where}.sampling.logit_bias: key {k!r} is not a token id")
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise GoldenError(f"{where}.sampling.logit_bias[{k!r}]: a number is required, got {v!r}")


def parse_case(raw: Any, where: str) -> GoldenCase:
    if not isinstance(raw, dict):
        raise GoldenError(f"{where}: a case must be an object, got {type(raw).__name__}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise GoldenError(f"{where}.name: a non-empty string is required")
    where = f"{where} ({name})"
    unknown = set(raw) - _CASE_FIELDS
    if unknown:
        raise GoldenError(f"{where}: unknown field(s) {sorted(map(str, unknown))} (known: {sorted(_CASE_FIELDS)}; "
                          "sampling arguments go under sampling:, a custom producer's settings under params:)")
    prompt, messages = raw.get("prompt"), raw.get("messages")
    if (prompt is None) == (messages is None):
        raise GoldenError(f"{where}: exactly one of prompt and messages is required")
    if prompt is not None and not (isinstance(prompt, str) or (
            isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt))):
        raise GoldenError(f"{where}.prompt: a string or a non-empty list of token ids is required")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise GoldenError(f"{where}.messages: a non-empty list of {{role, content}} objects is required")
    mt = raw.get("max_tokens")
    if not _is_int(mt) or mt < 1:
        raise GoldenError(f"{where}.max_tokens: a positive integer is required, got {mt!r}")
    sampling = raw.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise GoldenError(f"{where}.sampling: an object is required")
    _check_sampling(sampling, where)
    params = raw.get("params") or {}
    if not isinstance(params, dict) or not all(isinstance(k, str) for k in params):
        raise GoldenError(f"{where}.params: an object (the producer's settings by name) is required")
    compare = raw.get("compare", "tokens")
    if compare not in COMPARE_MODES:
        raise GoldenError(f"{where}.compare: {compare!r} is not one of {COMPARE_MODES}")
    tol = raw.get("logprob_tol", 1e-3)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0:
        raise GoldenError(f"{where}.logprob_tol: a non-negative number is required, got {tol!r}")
    k = raw.get("top_logprobs", 0)
    if not _is_int(k) or not 0 <= k <= 20:
        raise GoldenError(f"{where}.top_logprobs: an integer in [0, 20] is required, got {k!r}")
    model = raw.get("model", "default")
    if not isinstance(model, str):
        raise GoldenError(f"{where}.model: a string is required")
    return GoldenCase(name=name, max_tokens=mt, model=model, prompt=prompt, messages=messages,
                      sampling=dict(sampling), top_logprobs=k, compare=compare, logprob_tol=float(tol),
                      params=dict(params))


def _read_structured(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise GoldenError(f"{path}: cannot read ({e.strerror or e})") from None
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise GoldenError(f"{path}: YAML cases need PyYAML (pip install pyyaml), or use JSON") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise GoldenError(f"{path}: not valid YAML ({e})") from None
    try:
        return json.loads(text)
    except ValueError as e:
        raise GoldenError(f"{path}: not valid JSON ({e})") from None


def load_cases(path: str | Path) -> list[GoldenCase]:
    """Cases from a JSON or YAML file (a list, or an object with a "cases" list)."""
    path = Path(path)
    doc = _read_structured(path)
    raw = doc.get("cases") if isinstance(doc, dict) else doc
    if not isinstance(raw, list) or not raw:
        raise GoldenError(f"{path}: expected a non-empty list of cases (or {{\"cases\": [...]}})")
    cases = [parse_case(c, f"{path}: cases[{i}]") for i, c in enumerate(raw)]
    names = [c.name for c in cases]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise GoldenError(f"{path}: duplicate case name(s) {dup}")
    return cases


# ---------------------------------------------------------------------------- models
class ModelCache:
    """Resolves model specs ("default", a path, "tiny:<type>") once each."""

    def __init__(self, override: str | None = None):
        self.override = override
        self._models: dict[str, Any] = {}

    def put(self, spec: str, model: Any) -> None:
        """Use this loaded model for `spec` (e.g. a model modified in memory)."""
        self._models[spec] = model

    def spec(self, case: GoldenCase) -> str:
        return self.override or case.model

    def get(self, spec: str) -> Any:
        if spec not in self._models:
            import fx_engine

            if spec == "default":
                self._models[spec] = fx_engine.load()
            elif spec.startswith("tiny:"):
                import tempfile

                from fx_engine.testing.tiny import write_tiny_model

                kind = spec.split(":", 1)[1]
                self._models[spec] = fx_engine.load(
                    write_tiny_model(Path(tempfile.mkdtemp(prefix="fx-golden-")) / kind, kind, seed=0))
            else:
                self._models[spec] = fx_engine.load(spec)
        return self._models[spec]


def prompt_ids(model: Any, case: GoldenCase) -> list[int]:
    if case.messages is not None:
        return list(model.tokenizer.apply_chat_template(case.messages, add_generation_prompt=True))
    if isinstance(case.prompt, list):
        return [int(t) for t in case.prompt]
    return list(model.tokenizer.encode(case.prompt))


def _sampling(case: GoldenCase) -> dict[str, Any]:
    s = dict(case.sampling)
    if "logit_bias" in s:  # JSON object keys are strings
        s["logit_bias"] = {int(k): float(v) for k, v in s["logit_bias"].items()}
    return s


# ---------------------------------------------------------------------------- producers
@attrs.frozen
class Produced:
    """What a producer returns for one case.

    token_ids: the generated token ids (at most case.max_tokens; without the end-of-generation
        token, as fx_engine.generate reports them).
    logprobs: optional, each token's logprob under the producer's own distribution (e.g. a
        guided one); recorded instead of the model's teacher-forced logprobs, and what
        `compare: logprobs` compares. One per token.
    top_logprobs: optional, per position the most likely [(token id, logprob), ...], best
        first (at least the case's top_logprobs); needed with logprobs when the case asks
        for top_logprobs.
    """

    token_ids: Sequence[int]
    logprobs: Sequence[float] | None = None
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None


# A producer runs one case: fn(model, case) -> Produced | a list of token ids | Completion.
# A scorer gives each token's logprob under the model (teacher forced, the raw distribution)
# and optionally the top-k per position.
Producer = Callable[[Any, GoldenCase], Any]
Scorer = Callable[[Any, list[int], list[int], int], tuple[list[float], list[list[list[float]]]]]


def fx_producer(model: Any, case: GoldenCase) -> list[int]:
    """The default producer: `fx_engine.generate` with the case's sampling arguments."""
    import fx_engine

    return list(fx_engine.generate(model, case.prompt_ids(model), **case.generate_kwargs()).token_ids)


def producer_name_of(fn: Any) -> str:
    """"module:qualname" of a producer (the name recorded in a golden document's origin)."""
    if fn is None or fn is fx_producer:
        return DEFAULT_PRODUCER
    mod = getattr(fn, "__module__", None) or type(fn).__module__
    qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{mod}:{qual}"


def _producer_key(name: str) -> tuple[str, ...]:
    mod, sep, qual = name.rpartition(":")
    if not sep or not mod or " " in mod or not re.fullmatch(r"[\w.<>]+", qual):
        return (name,)  # "fx_engine.generate", or an oracle's description
    if mod.endswith(".py") or "/" in mod or "\\" in mod:
        return (Path(mod.replace("\\", "/")).stem, qual)
    return (mod.rsplit(".", 1)[-1], qual)


def same_producer(a: str, b: str) -> bool:
    """Whether two producer names name the same producer: equal, or the same function name
    in modules whose last components (a file's stem) agree (`tests/loops.py:cfg` is
    `tests.loops:cfg`, and `loops:cfg` run from tests/)."""
    return a == b or _producer_key(a) == _producer_key(b)


def _where(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    return f" (at {tb[-1].filename}:{tb[-1].lineno} in {tb[-1].name})" if tb else ""


def _check_callable(fn: Any, label: str) -> None:
    if not callable(fn):
        raise GoldenError(f"{label}: a {type(fn).__name__} is not a producer; a producer is a "
                          "callable fn(model, case)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # (a builtin without a signature: find out when it runs)
    try:
        sig.bind(None, None)
    except TypeError:
        raise GoldenError(f"{label}: {producer_name_of(fn)}{sig} cannot be called as fn(model, case)") from None


_FILE_MODULES = "fx_golden_producer"  # file-form producers' modules: fx_golden_producer.<stem>


def resolve_producer(spec: str) -> tuple[Producer, str]:
    """A producer from `MODULE:FUNCTION` (imported; the current directory is on the import
    path) or `path/to/file.py:FUNCTION` (the file run afresh each call, its directory on
    the import path); FUNCTION may be dotted (Class.method). Returns (callable, spec): the
    spec is the name recorded. A spec that cannot be resolved is a GoldenError saying why."""
    label = f"producer {spec!r}"
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise GoldenError(f"{label}: expected MODULE:FUNCTION (e.g. mypkg.loops:cfg) or FILE.py:FUNCTION")
    if target.endswith(".py") or "/" in target or os.sep in target:
        path = Path(target)
        if not path.is_file():
            raise GoldenError(f"{label}: no such file {target!r}")
        name = f"{_FILE_MODULES}.{path.stem}"
        mspec = importlib.util.spec_from_file_location(name, path)
        if mspec is None or mspec.loader is None:
            raise GoldenError(f"{label}: {target!r} is not a Python file")
        mod = importlib.util.module_from_spec(mspec)
        folder = str(path.resolve().parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        sys.modules[name] = mod  # (dataclasses, attrs and pickle look modules up by name)
        try:
            mspec.loader.exec_module(mod)
        except Exception as e:  # noqa: BLE001  whatever the file raises: one clear line
            sys.modules.pop(name, None)
            raise GoldenError(f"{label}: running {target} failed: {type(e).__name__}: {e}{_where(e)}") from e
    else:
        if os.getcwd() not in sys.path:  # (as `python -m` and uvicorn: the current directory)
            sys.path.insert(0, os.getcwd())
        try:
            mod = importlib.import_module(target)
        except ModuleNotFoundError as e:
            if e.name and (target == e.name or target.startswith(e.name + ".")):
                raise GoldenError(f"{label}: no module named {e.name!r} (looked in the current directory "
                                  "and sys.path; or name a file: path/to/loops.py:FUNCTION)") from None
            raise GoldenError(f"{label}: importing {target} failed: {type(e).__name__}: {e}") from e
        except Exception as e:  # noqa: BLE001
            raise GoldenError(f"{label}: importing {target} failed: {type(e).__name__}: {e}{_where(e)}") from e
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise GoldenError(f"{label}: {target} has no attribute {attr!r}")
        obj = getattr(obj, part)
    _check_callable(obj, label)
    return obj, spec


def _int_list(x: Any) -> list[int] | None:
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        x = x.tolist()  # an mx / numpy array
    if not isinstance(x, (list, tuple)):
        return None
    out = []
    for t in x:
        if isinstance(t, bool):
            return None
        try:
            out.append(int(t.__index__()))
        except (AttributeError, TypeError):
            return None
    return out


def _float_list(x: Any) -> list[float] | None:
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        x = x.tolist()
    if not isinstance(x, (list, tuple)):
        return None
    try:
        return [float(v) for v in x]
    except (TypeError, ValueError):
        return None


def _as_produced(out: Any, model: Any, case: GoldenCase, pname: str) -> Produced:
    """A producer's result, checked and normalized (lists of ints and floats)."""
    at = f"case {case.name!r}: producer {pname}"
    if isinstance(out, Produced):
        toks, lps, top = out.token_ids, out.logprobs, out.top_logprobs
    elif hasattr(out, "token_ids") and not isinstance(out, (list, tuple)):  # a Completion
        toks, tl, top = out.token_ids, getattr(out, "logprobs", None), None
        lps = None if tl is None else [x.logprob for x in tl]
        if tl is not None and any(getattr(x, "top", ()) for x in tl):
            top = [[(t[0], t[-1]) for t in x.top] for x in tl]
    else:
        toks, lps, top = out, None, None
    ids = _int_list(toks)
    if ids is None:
        raise GoldenError(f"{at} returned {type(out).__name__}"
                          + ("" if toks is out else f" with token_ids of type {type(toks).__name__}")
                          + "; expected Produced(token_ids, logprobs=None, top_logprobs=None), a list of "
                          "token ids, or a Completion")
    v = getattr(getattr(model, "config", None), "vocab_size", None)
    bad = next(((i, t) for i, t in enumerate(ids) if t < 0 or (v is not None and t >= v)), None)
    if bad is not None:
        raise GoldenError(f"{at} returned token id {bad[1]} at position {bad[0]}, outside the vocabulary [0, {v})")
    if len(ids) > case.max_tokens:
        raise GoldenError(f"{at} returned {len(ids)} tokens; the case allows max_tokens {case.max_tokens}")
    flps = None
    if lps is not None:
        flps = _float_list(lps)
        if flps is None or len(flps) != len(ids):
            n = "?" if flps is None else len(flps)
            raise GoldenError(f"{at} returned logprobs that are not one number per token ({n} for {len(ids)} tokens)")
        odd = next(((i, x) for i, x in enumerate(flps) if math.isnan(x) or x > 1e-4), None)
        if odd is not None:
            raise GoldenError(f"{at} returned logprob {odd[1]} at position {odd[0]}: not a log-probability "
                              "(<= 0; logits need a log_softmax)")
    ftop = None
    if top is not None:
        rows = top.tolist() if hasattr(top, "tolist") and not isinstance(top, (list, tuple)) else top
        try:
            ftop = [[[int(i), float(x)] for i, x in row] for row in rows]
        except (TypeError, ValueError):
            ftop = None
        if ftop is None or len(ftop) != len(ids):
            raise GoldenError(f"{at} returned top_logprobs that are not one list of (token id, logprob) "
                              "pairs per token")
    return Produced(token_ids=ids, logprobs=flps, top_logprobs=ftop)


def _produce(producer: Producer, pname: str, model: Any, case: GoldenCase) -> Produced:
    """Run a producer on one case: its checked result, or a GoldenError naming the case."""
    try:
        out = producer(model, case)
    except GoldenError:
        raise
    except Exception as e:  # noqa: BLE001  reported with the case and the producer
        raise ProducerError(f"case {case.name!r}: producer {pname} raised {type(e).__name__}: {e}{_where(e)}") from e
    return _as_produced(out, model, case, pname)


def fx_scorer(model: Any, prompt: list[int], tokens: list[int], top_k: int) -> tuple[list[float], list[list[list[float]]]]:
    """Teacher-forced log_softmax of fx-engine's logits at each generated position."""
    from fx_engine.engine.scoring import logits

    if not tokens:
        return [], []
    return token_logprobs(logits(model, prompt + tokens[:-1])[len(prompt) - 1 :], tokens, top_k)


def token_logprobs(lg: Any, tokens: list[int], top_k: int) -> tuple[list[float], list[list[list[float]]]]:
    """From logits [T, V] at the positions that predicted `tokens`: each token's logprob
    (log_softmax) and, if top_k, the top-k [[id, logprob], ...] per position. Shared by
    fx-engine's scorer and an oracle's (tools/make_golden.py), so both record the same thing."""
    import mlx.core as mx

    lg = lg.astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(tokens)[:, None], axis=-1)[:, 0].tolist()
    top: list[list[list[float]]] = []
    if top_k:
        idx = mx.argsort(-lp, axis=-1)[:, :top_k]
        vals = mx.take_along_axis(lp, idx, axis=-1)
        top = [[[int(i), float(v)] for i, v in zip(ri, rv)] for ri, rv in zip(idx.tolist(), vals.tolist())]
    return [float(x) for x in chosen], top


def _versions() -> dict[str, str]:
    import mlx.core as mx

    from fx_engine import __version__
    from fx_engine.runtime import blas

    return {"fx_engine": __version__, "mlx": mx.__version__, "backend": str(mx.default_device()),
            "blas": blas.active()["name"], "platform": f"{platform.system()} {platform.machine()}",
            "python": platform.python_version()}


def record(cases: Sequence[GoldenCase], *, model: str | None = None, producer: Producer | None = None,
           scorer: Scorer | None = None, producer_name: str | None = None,
           check_producer: str | None = None, models: ModelCache | None = None) -> dict[str, Any]:
    """Run the cases and return the golden document (see the module docstring).

    producer: your decoding loop, fn(model, case) -> Produced | token ids | Completion
    (None: fx_engine.generate); producer_name: the name recorded (default "module:qualname");
    check_producer: the producer `check` must run, when not this one (an independent
    oracle's recording checked with fx_engine.generate: tools/make_golden.py).
    scorer: the teacher-forced logprobs when the producer gives none (default: fx-engine's)."""
    models = models or ModelCache(model)
    producer = None if producer is fx_producer else producer
    if producer is not None:
        _check_callable(producer, "producer")
    pname = producer_name or producer_name_of(producer)
    checked_with = check_producer or pname
    scorer = scorer or fx_scorer
    out_cases, model_info = [], {}
    for case in cases:
        if producer is None and case.params:
            raise GoldenError(f"case {case.name!r}: params {sorted(case.params)} are settings for a custom "
                              f"producer, and {DEFAULT_PRODUCER} takes none: record with your producer "
                              "(--producer MODULE:FUNCTION, or producer=)")
        spec = models.spec(case)
        m = models.get(spec)
        model_info[spec] = {"fingerprint": m.fingerprint, "path": str(m.path)}
        ids = prompt_ids(m, case)
        out = _produce(producer or fx_producer, pname, m, case)
        tokens = list(out.token_ids)
        entry = {"case": case.to_json(), "model": spec, "prompt_token_ids": ids, "token_ids": tokens,
                 "text": m.tokenizer.decode(tokens)}
        if out.logprobs is not None:
            lps = list(out.logprobs)
            top: list = []
            if case.top_logprobs:
                rows = out.top_logprobs
                if rows is None:
                    raise GoldenError(f"case {case.name!r}: top_logprobs {case.top_logprobs}: producer {pname} "
                                      "returned logprobs but no top_logprobs; return Produced(..., "
                                      "top_logprobs=[[(id, logprob), ...] per token]) or drop top_logprobs")
                short = next((i for i, r in enumerate(rows) if len(r) < case.top_logprobs), None)
                if short is not None:
                    raise GoldenError(f"case {case.name!r}: top_logprobs {case.top_logprobs}: producer {pname} "
                                      f"returned {len(rows[short])} at position {short}")
                top = [r[: case.top_logprobs] for r in rows]
            entry["logprobs_from"] = "producer"
        else:
            if producer is not None and case.compare == "logprobs" and same_producer(checked_with, pname):
                raise GoldenError(f"case {case.name!r}: compare: logprobs compares the producer's own logprobs, "
                                  f"and producer {pname} returned none: return Produced(token_ids, "
                                  "logprobs=[...]) (or use compare: tokens)")
            lps, top = scorer(m, ids, tokens, case.top_logprobs)
        entry["logprobs"] = lps
        if case.top_logprobs:
            entry["top_logprobs"] = top
        out_cases.append(entry)
    return {"format": FORMAT,
            "origin": {"recorded_by": "fx_engine.testing.golden.record", "producer": pname,
                       "check_producer": checked_with, **_versions(), "date": datetime.date.today().isoformat()},
            "models": model_info, "cases": out_cases}


def save(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")


def validate_golden(doc: Any, where: str = "golden document") -> dict[str, Any]:
    """Check a golden document's structure; returns it. Errors name the field."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise GoldenError(f"{where}: not a golden document (format {FORMAT!r}); record one with "
                          "`fx-engine golden record`")
    cases = doc.get("cases")
    if not isinstance(cases, list) or not cases:
        raise GoldenError(f"{where}: cases must be a non-empty list")
    models = doc.get("models")
    if not isinstance(models, dict):
        raise GoldenError(f"{where}: models (each model's fingerprint) is missing")
    origin = doc.get("origin", {})
    if not isinstance(origin, dict) or not all(
            isinstance(origin.get(f, ""), str) for f in ("producer", "check_producer")):
        raise GoldenError(f"{where}: origin must be an object whose producer and check_producer are strings")
    for i, c in enumerate(cases):
        at = f"{where}: cases[{i}]"
        if not isinstance(c, dict):
            raise GoldenError(f"{at} must be an object")
        for f in ("case", "model", "prompt_token_ids", "token_ids", "logprobs"):
            if f not in c:
                raise GoldenError(f"{at}.{f} is missing")
        parse_case(c["case"], f"{at}.case")
        if not isinstance(models.get(c["model"]), dict) or not models[c["model"]].get("fingerprint"):
            raise GoldenError(f"{at}.model: {c['model']!r} has no recorded fingerprint in models")
        for f in ("prompt_token_ids", "token_ids"):
            if not isinstance(c[f], list) or not all(_is_int(t) for t in c[f]):
                raise GoldenError(f"{at}.{f} must be a list of token ids")
        if not isinstance(c["logprobs"], list) or len(c["logprobs"]) != len(c["token_ids"]):
            raise GoldenError(f"{at}.logprobs must hold one logprob per expected token "
                              f"({len(c['token_ids'])})")
        if c.get("logprobs_from", "model") not in ("model", "producer"):
            raise GoldenError(f"{at}.logprobs_from: {c['logprobs_from']!r} is not model or producer")
    return doc


def load_golden(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return validate_golden(_read_structured(path), str(path))


def expected_producer(doc: dict[str, Any]) -> str:
    """The producer a golden document must be checked with (origin.check_producer; documents
    recorded before it existed: fx_engine.generate)."""
    return doc.get("origin", {}).get("check_producer") or DEFAULT_PRODUCER


def recorded_producer(doc: dict[str, Any]) -> str:
    """The producer that made a golden document's outputs (origin.producer)."""
    return doc.get("origin", {}).get("producer") or DEFAULT_PRODUCER


# ---------------------------------------------------------------------------- check
@attrs.frozen
class CaseResult:
    name: str
    status: str  # pass | regression | fingerprint_mismatch | error
    message: str = ""
    position: int | None = None
    exc: BaseException | None = attrs.field(default=None, eq=False, repr=False)  # an error's cause

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def _tok(model: Any, t: int | None) -> str:
    return "<end>" if t is None else f"{t} {model.tokenizer.decode([t])!r}"


def _divergence_message(model: Any, entry: dict[str, Any], actual: list[int], pos: int,
                        scorer: Scorer, actual_lps: list[float] | None = None, pname: str = "") -> str:
    exp = entry["token_ids"]
    e_t = exp[pos] if pos < len(exp) else None
    a_t = actual[pos] if pos < len(actual) else None
    prompt = entry["prompt_token_ids"]
    # Both tokens' logprobs at this position, under the current model, after the common prefix.
    lines = [f"first divergence at generated position {pos} (of {len(exp)} expected, {len(actual)} actual):",
             f"  expected {_tok(model, e_t)}" + (f"  recorded logprob {entry['logprobs'][pos]:.4f}"
                                                 if e_t is not None and pos < len(entry["logprobs"]) else ""),
             f"  actual   {_tok(model, a_t)}" + (f"  logprob {actual_lps[pos]:.4f} (producer {pname})"
                                                 if a_t is not None and actual_lps is not None else "")]
    probe = [t for t in (e_t, a_t) if t is not None]
    if probe:
        now = {t: scorer(model, prompt, exp[:pos] + [t], 0)[0][-1] for t in probe}
        lines.append("  logprobs now: " + ", ".join(f"{_tok(model, t)}: {v:.4f}" for t, v in now.items())
                     + ("  (the model's, teacher forced)" if pname != DEFAULT_PRODUCER else ""))
    ctx = model.tokenizer.decode(exp[:pos])
    lines.append(f"  after: {ctx[-60:]!r}")
    lines.append(f"  expected text: {model.tokenizer.decode(exp)!r}")
    lines.append(f"  actual text:   {model.tokenizer.decode(actual)!r}")
    return "\n".join(lines)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def check_entry(entry: dict[str, Any], golden: dict[str, Any], *, models: ModelCache,
                producer: Producer | None = None, scorer: Scorer | None = None,
                ignore_fingerprint: bool = False, producer_name: str | None = None) -> CaseResult:
    producer = None if producer is fx_producer else producer
    pname = producer_name or producer_name_of(producer)
    scorer = scorer or fx_scorer
    case = parse_case(entry["case"], "golden case")
    spec = models.override or entry["model"]
    try:
        m = models.get(spec)
    except Exception as e:  # noqa: BLE001  reported per case
        return CaseResult(case.name, "error", f"cannot load model {spec!r}: {e}", exc=e)
    want = golden["models"][entry["model"]]["fingerprint"]
    if m.fingerprint != want and not ignore_fingerprint:
        return CaseResult(case.name, "fingerprint_mismatch",
                          f"model {spec!r} has fingerprint {m.fingerprint}, the golden output was recorded "
                          f"with {want}: a different model, not a regression (re-record to pin this one)")
    ids = prompt_ids(m, case)
    if ids != entry["prompt_token_ids"]:
        pos = _first_difference(ids, entry["prompt_token_ids"])
        return CaseResult(case.name, "regression",
                          f"the prompt tokenizes differently from the recording, first at prompt position "
                          f"{pos}: expected {entry['prompt_token_ids'][pos:pos + 3]}..., actual {ids[pos:pos + 3]}...",
                          position=pos)
    exp = entry["token_ids"]
    if case.compare == "logprobs" and producer is None:
        # fx_engine.generate: the expected tokens scored teacher forced (the model's numerics)
        lps, _ = scorer(m, entry["prompt_token_ids"], exp, 0)
        for i, (a, b) in enumerate(zip(entry["logprobs"], lps)):
            if not math.isclose(a, b, rel_tol=0.0, abs_tol=case.logprob_tol):
                lp_all, top = scorer(m, entry["prompt_token_ids"], exp[: i + 1], 1)
                best = int(top[-1][0][0]) if top else None
                return CaseResult(case.name, "regression",
                                  f"logprob of expected token {_tok(m, exp[i])} at generated position {i}: "
                                  f"recorded {a:.5f}, now {b:.5f} (|diff| {abs(a - b):.2e} > tol {case.logprob_tol:g}); "
                                  f"the model's top token there is now {_tok(m, best)}\n"
                                  f"  after: {m.tokenizer.decode(exp[:i])[-60:]!r}", position=i)
        return CaseResult(case.name, "pass", f"{len(exp)} token logprobs within {case.logprob_tol:g}")
    try:
        out = _produce(producer or fx_producer, pname, m, case)
    except GoldenError as e:
        return CaseResult(case.name, "error", str(e), exc=e)
    actual = list(out.token_ids)
    pos = _first_difference(actual, exp)
    if case.compare == "logprobs":  # a custom producer: its own logprobs, along its tokens
        if out.logprobs is None:
            return CaseResult(case.name, "error",
                              f"case {case.name!r}: compare: logprobs compares the producer's logprobs, and "
                              f"producer {pname} returned none: return Produced(token_ids, logprobs=[...])")
        for i, (a, b) in enumerate(zip(entry["logprobs"], out.logprobs)):
            if pos is not None and i >= pos:
                break
            if not math.isclose(a, b, rel_tol=0.0, abs_tol=case.logprob_tol):
                return CaseResult(case.name, "regression",
                                  f"logprob of token {_tok(m, exp[i])} at generated position {i} (producer "
                                  f"{pname}): recorded {a:.5f}, now {b:.5f} (|diff| {abs(a - b):.2e} > tol "
                                  f"{case.logprob_tol:g})\n  after: {m.tokenizer.decode(exp[:i])[-60:]!r}",
                                  position=i)
        if pos is None:
            return CaseResult(case.name, "pass", f"{len(exp)} token logprobs within {case.logprob_tol:g} "
                                                 f"(producer {pname})")
        return CaseResult(case.name, "regression", "the tokens differ (compare: logprobs compares the logprobs "
                          "of the same tokens); " + _divergence_message(m, entry, actual, pos, scorer,
                                                                        out.logprobs, pname), position=pos)
    if pos is None:
        return CaseResult(case.name, "pass", f"{len(exp)} tokens identical")
    return CaseResult(case.name, "regression",
                      _divergence_message(m, entry, actual, pos, scorer, out.logprobs, pname), position=pos)


def producer_mismatch(doc: dict[str, Any], used: str, where: str = "golden document") -> str | None:
    """Why checking `doc` with the producer named `used` is refused (None: it is the one)."""
    want = expected_producer(doc)
    if same_producer(used, want):
        return None
    how = ("pass it: `fx-engine golden check --producer " + want + "`, or producer= in Python and the "
           "pytest fixture" if want != DEFAULT_PRODUCER else
           "check without a producer (fx_engine.generate)")
    return (f"{where}: recorded to be checked with the producer {want!r}, but this check runs {used!r}; "
            f"{how} (allow_producer_mismatch / --allow-producer-mismatch compares them anyway)")


def check(golden: dict[str, Any] | str | Path, *, model: str | None = None, names: Sequence[str] | None = None,
          producer: Producer | None = None, scorer: Scorer | None = None,
          ignore_fingerprint: bool = False, models: ModelCache | None = None,
          producer_name: str | None = None, allow_producer_mismatch: bool = False) -> list[CaseResult]:
    """Check every case (or those named) of a golden document; one CaseResult each.

    producer: the decoding loop to run (None: fx_engine.generate); it must be the one the
    document records in origin.check_producer (see `same_producer`), else a GoldenError,
    unless allow_producer_mismatch. producer_name: its name when not "module:qualname"."""
    doc = validate_golden(golden) if isinstance(golden, dict) else load_golden(golden)
    where = "golden document" if isinstance(golden, dict) else str(golden)
    producer = None if producer is fx_producer else producer
    if producer is not None:
        _check_callable(producer, "producer")
    pname = producer_name or producer_name_of(producer)
    why = producer_mismatch(doc, pname, where)
    if why and not allow_producer_mismatch:
        raise GoldenError(why)
    models = models or ModelCache(model)
    entries = doc["cases"]
    if names is not None:
        known = {e["case"]["name"] for e in entries}
        missing = [n for n in names if n not in known]
        if missing:
            raise GoldenError(f"names: no case named {missing} in the golden document")
        entries = [e for e in entries if e["case"]["name"] in set(names)]
    return [check_entry(e, doc, models=models, producer=producer, scorer=scorer,
                        ignore_fingerprint=ignore_fingerprint, producer_name=pname) for e in entries]
