"""Golden-output regression kit: pin a model's behaviour, then check it after any change.

Cases are data (JSON or YAML): a list, or {"cases": [...]}, each

    name: paris                      # unique
    model: default                   # "default", a GGUF/HF path, or "tiny:<type>" (tests)
    messages: [{role: user, content: "What is the capital of France?"}]   # or prompt: "..."
    sampling: {temperature: 0.8, seed: 42}      # any fx_engine.generate sampling argument
    max_tokens: 24
    top_logprobs: 5                  # optional: also record the top-5 logprobs per position
    compare: tokens                  # tokens (exact, default) | logprobs (within logprob_tol)
    logprob_tol: 0.001

`record(cases)` runs them (fx-engine by default; any producer, e.g. an independent oracle)
and returns a golden document: per case the prompt's token ids, the expected token ids,
text, each expected token's logprob under the model (teacher-forced, raw distribution) and
optionally the top-k; plus the origin (fx-engine and MLX versions, backend, BLAS, date,
producer) and each model's fingerprint. `check(golden)` runs the cases again and returns
one `CaseResult` per case: "pass", "regression" (with the first divergent position:
expected vs actual token and text, and both logprobs), "fingerprint_mismatch" (the model
is not the one the golden was recorded with: not a regression) or "error".

Command line: `fx-engine golden record CASES -o GOLDEN`, `fx-engine golden check GOLDEN`.
pytest: the `golden` fixture (opt-in: `pytest_plugins = ["fx_engine.testing.pytest_plugin"]`):
`golden.check("golden.json")` fails with the readable diff.
"""

from __future__ import annotations

import datetime
import json
import math
import platform
from pathlib import Path
from typing import Any, Callable, Sequence

import attrs

FORMAT = "fx-engine-golden/1"
COMPARE_MODES = ("tokens", "logprobs")
_CASE_FIELDS = {"name", "model", "prompt", "messages", "sampling", "max_tokens", "top_logprobs",
                "compare", "logprob_tol", "about"}


class GoldenError(ValueError):
    """A malformed case file or golden document (the message names the file and field)."""


@attrs.frozen
class GoldenCase:
    name: str
    max_tokens: int
    model: str = "default"
    prompt: Any = None  # str or token ids
    messages: Any = None
    sampling: dict = attrs.field(factory=dict)
    top_logprobs: int = 0
    compare: str = "tokens"
    logprob_tol: float = 1e-3

    def to_json(self) -> dict[str, Any]:
        d = attrs.asdict(self)
        return {k: v for k, v in d.items() if v is not None and not (k == "top_logprobs" and v == 0)}


def parse_case(raw: Any, where: str) -> GoldenCase:
    if not isinstance(raw, dict):
        raise GoldenError(f"{where}: a case must be an object, got {type(raw).__name__}")
    unknown = set(raw) - _CASE_FIELDS
    if unknown:
        raise GoldenError(f"{where}: unknown field(s) {sorted(unknown)} (known: {sorted(_CASE_FIELDS)})")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise GoldenError(f"{where}.name: a non-empty string is required")
    where = f"{where} ({name})"
    if (raw.get("prompt") is None) == (raw.get("messages") is None):
        raise GoldenError(f"{where}: exactly one of prompt and messages is required")
    mt = raw.get("max_tokens")
    if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
        raise GoldenError(f"{where}.max_tokens: a positive integer is required, got {mt!r}")
    sampling = raw.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise GoldenError(f"{where}.sampling: an object is required")
    compare = raw.get("compare", "tokens")
    if compare not in COMPARE_MODES:
        raise GoldenError(f"{where}.compare: {compare!r} is not one of {COMPARE_MODES}")
    tol = raw.get("logprob_tol", 1e-3)
    if not isinstance(tol, (int, float)) or isinstance(tol, bool) or not tol >= 0:
        raise GoldenError(f"{where}.logprob_tol: a non-negative number is required, got {tol!r}")
    k = raw.get("top_logprobs", 0)
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 20:
        raise GoldenError(f"{where}.top_logprobs: an integer in [0, 20] is required, got {k!r}")
    model = raw.get("model", "default")
    if not isinstance(model, str):
        raise GoldenError(f"{where}.model: a string is required")
    return GoldenCase(name=name, max_tokens=mt, model=model, prompt=raw.get("prompt"),
                      messages=raw.get("messages"), sampling=dict(sampling), top_logprobs=k,
                      compare=compare, logprob_tol=float(tol))


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


# A producer generates a case's tokens; a scorer gives each token's logprob under the model
# (teacher forced, the raw distribution) and optionally the top-k per position.
Producer = Callable[[Any, GoldenCase, list[int]], list[int]]
Scorer = Callable[[Any, list[int], list[int], int], tuple[list[float], list[list[list[float]]]]]


def fx_producer(model: Any, case: GoldenCase, ids: list[int]) -> list[int]:
    import fx_engine

    return list(fx_engine.generate(model, ids, max_tokens=case.max_tokens, **_sampling(case)).token_ids)


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
           scorer: Scorer | None = None, producer_name: str = "fx_engine.generate",
           models: ModelCache | None = None) -> dict[str, Any]:
    """Run the cases and return the golden document (see the module docstring)."""
    models = models or ModelCache(model)
    producer = producer or fx_producer
    scorer = scorer or fx_scorer
    out_cases, model_info = [], {}
    for case in cases:
        spec = models.spec(case)
        m = models.get(spec)
        model_info[spec] = {"fingerprint": m.fingerprint, "path": str(m.path)}
        ids = prompt_ids(m, case)
        tokens = producer(m, case, ids)
        lps, top = scorer(m, ids, tokens, case.top_logprobs)
        entry = {"case": case.to_json(), "model": spec, "prompt_token_ids": ids, "token_ids": tokens,
                 "text": m.tokenizer.decode(tokens), "logprobs": lps}
        if case.top_logprobs:
            entry["top_logprobs"] = top
        out_cases.append(entry)
    return {"format": FORMAT,
            "origin": {"recorded_by": "fx_engine.testing.golden.record", "producer": producer_name,
                       **_versions(), "date": datetime.date.today().isoformat()},
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
            if not isinstance(c[f], list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in c[f]):
                raise GoldenError(f"{at}.{f} must be a list of token ids")
        if not isinstance(c["logprobs"], list) or len(c["logprobs"]) != len(c["token_ids"]):
            raise GoldenError(f"{at}.logprobs must hold one logprob per expected token "
                              f"({len(c['token_ids'])})")
    return doc


def load_golden(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    return validate_golden(_read_structured(path), str(path))


# ---------------------------------------------------------------------------- check
@attrs.frozen
class CaseResult:
    name: str
    status: str  # pass | regression | fingerprint_mismatch | error
    message: str = ""
    position: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "pass"


def _tok(model: Any, t: int | None) -> str:
    return "<end>" if t is None else f"{t} {model.tokenizer.decode([t])!r}"


def _divergence_message(model: Any, entry: dict[str, Any], actual: list[int], pos: int,
                        scorer: Scorer) -> str:
    exp = entry["token_ids"]
    e_t = exp[pos] if pos < len(exp) else None
    a_t = actual[pos] if pos < len(actual) else None
    prompt = entry["prompt_token_ids"]
    # Both tokens' logprobs at this position, under the current model, after the common prefix.
    lines = [f"first divergence at generated position {pos} (of {len(exp)} expected, {len(actual)} actual):",
             f"  expected {_tok(model, e_t)}" + (f"  recorded logprob {entry['logprobs'][pos]:.4f}"
                                                 if e_t is not None and pos < len(entry["logprobs"]) else ""),
             f"  actual   {_tok(model, a_t)}"]
    probe = [t for t in (e_t, a_t) if t is not None]
    if probe:
        now = {t: scorer(model, prompt, exp[:pos] + [t], 0)[0][-1] for t in probe}
        lines.append("  logprobs now: " + ", ".join(f"{_tok(model, t)}: {v:.4f}" for t, v in now.items()))
    ctx = model.tokenizer.decode(exp[:pos])
    lines.append(f"  after: {ctx[-60:]!r}")
    lines.append(f"  expected text: {model.tokenizer.decode(exp)!r}")
    lines.append(f"  actual text:   {model.tokenizer.decode(actual)!r}")
    return "\n".join(lines)


def check_entry(entry: dict[str, Any], golden: dict[str, Any], *, models: ModelCache,
                producer: Producer | None = None, scorer: Scorer | None = None,
                ignore_fingerprint: bool = False) -> CaseResult:
    producer = producer or fx_producer
    scorer = scorer or fx_scorer
    case = parse_case(entry["case"], "golden case")
    spec = models.override or entry["model"]
    try:
        m = models.get(spec)
    except Exception as e:  # noqa: BLE001  reported per case
        return CaseResult(case.name, "error", f"cannot load model {spec!r}: {e}")
    want = golden["models"][entry["model"]]["fingerprint"]
    if m.fingerprint != want and not ignore_fingerprint:
        return CaseResult(case.name, "fingerprint_mismatch",
                          f"model {spec!r} has fingerprint {m.fingerprint}, the golden output was recorded "
                          f"with {want}: a different model, not a regression (re-record to pin this one)")
    ids = prompt_ids(m, case)
    if ids != entry["prompt_token_ids"]:
        pos = next((i for i, (a, b) in enumerate(zip(ids, entry["prompt_token_ids"])) if a != b),
                   min(len(ids), len(entry["prompt_token_ids"])))
        return CaseResult(case.name, "regression",
                          f"the prompt tokenizes differently from the recording, first at prompt position "
                          f"{pos}: expected {entry['prompt_token_ids'][pos:pos + 3]}..., actual {ids[pos:pos + 3]}...",
                          position=pos)
    exp = entry["token_ids"]
    if case.compare == "logprobs":
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
    actual = producer(m, case, entry["prompt_token_ids"])
    if actual == exp:
        return CaseResult(case.name, "pass", f"{len(exp)} tokens identical")
    pos = next((i for i, (a, b) in enumerate(zip(actual, exp)) if a != b), min(len(actual), len(exp)))
    return CaseResult(case.name, "regression", _divergence_message(m, entry, actual, pos, scorer), position=pos)


def check(golden: dict[str, Any] | str | Path, *, model: str | None = None, names: Sequence[str] | None = None,
          producer: Producer | None = None, scorer: Scorer | None = None,
          ignore_fingerprint: bool = False, models: ModelCache | None = None) -> list[CaseResult]:
    """Check every case (or those named) of a golden document; one CaseResult each."""
    doc = validate_golden(golden) if isinstance(golden, dict) else load_golden(golden)
    models = models or ModelCache(model)
    entries = doc["cases"]
    if names is not None:
        known = {e["case"]["name"] for e in entries}
        missing = [n for n in names if n not in known]
        if missing:
            raise GoldenError(f"names: no case named {missing} in the golden document")
        entries = [e for e in entries if e["case"]["name"] in set(names)]
    return [check_entry(e, doc, models=models, producer=producer, scorer=scorer,
                        ignore_fingerprint=ignore_fingerprint) for e in entries]
