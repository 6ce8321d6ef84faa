"""The golden-output kit (fx_engine.testing.golden): record, check, diffs, fingerprints,
case-file validation, the CLI and the pytest fixture, on tiny random models."""

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import fx_engine
from fx_engine.testing import golden as g
from fx_engine.testing import write_tiny_model
from fx_engine.core.tree import tree_replace
from fx_engine.runtime.native.build import cache_root

CASES = [
    {"name": "greedy", "model": "tiny", "prompt": "hello world", "max_tokens": 12},
    {"name": "seeded", "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
     "sampling": {"temperature": 0.9, "top_k": 20, "seed": 3}, "max_tokens": 10, "top_logprobs": 3},
    {"name": "scored", "model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 8,
     # near-uniform sampling: tokens far from the (very peaked) tiny model's argmax
     "sampling": {"temperature": 100.0, "seed": 1},
     "compare": "logprobs", "logprob_tol": 1e-4},
]


NATIVE_CACHE = cache_root().parent  # (read before pytester moves HOME)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("gk") / "llama", "llama", seed=0)


def _models(tiny_path, model=None):
    m = g.ModelCache()
    m.put("tiny", model or fx_engine.load(tiny_path))
    return m


def _cases_file(tmp_path, cases=CASES, suffix=".json"):
    p = tmp_path / f"cases{suffix}"
    if suffix == ".json":
        p.write_text(json.dumps({"cases": cases}))
    else:
        import yaml

        p.write_text(yaml.safe_dump({"cases": cases}))
    return p


def test_record_then_check_passes(tmp_path, tiny_path):
    doc = g.record(g.load_cases(_cases_file(tmp_path)), models=_models(tiny_path))
    assert doc["format"] == g.FORMAT and doc["models"]["tiny"]["fingerprint"]
    assert {"fx_engine", "mlx", "backend", "date"} <= set(doc["origin"])
    model = fx_engine.load(tiny_path)
    for e, c in zip(doc["cases"], CASES):  # the recorded tokens are what generate produces
        sampling = c.get("sampling", {})
        out = fx_engine.generate(model, e["prompt_token_ids"], max_tokens=c["max_tokens"], **sampling)
        assert e["token_ids"] == list(out.token_ids) and len(e["logprobs"]) == len(e["token_ids"]) > 0
    seeded = doc["cases"][1]
    assert len(seeded["top_logprobs"]) == len(seeded["token_ids"]) and len(seeded["top_logprobs"][0]) == 3
    # each recorded logprob is the top-k's value for that token when it is in the top-k
    for tok, lp, top in zip(seeded["token_ids"], seeded["logprobs"], seeded["top_logprobs"]):
        d = {int(i): v for i, v in top}
        if tok in d:
            assert abs(d[tok] - lp) < 1e-5
    g.save(doc, tmp_path / "golden.json")
    results = g.check(tmp_path / "golden.json", models=_models(tiny_path, model))
    assert [r.status for r in results] == ["pass"] * 3, results


def _perturbed(model):
    p = model.params
    return tree_replace(model, params=tree_replace(p, norm=-p.norm * 3.0))


def test_perturbed_model_fails_at_the_first_divergent_position(tmp_path, tiny_path):
    model = fx_engine.load(tiny_path)
    doc = g.record([g.parse_case(CASES[0], "t")], models=_models(tiny_path, model))
    bad = _perturbed(model)
    # the independent expectation: where the perturbed model's greedy tokens first differ
    actual = list(fx_engine.generate(bad, doc["cases"][0]["prompt_token_ids"], max_tokens=12).token_ids)
    exp = doc["cases"][0]["token_ids"]
    first = next(i for i, (a, b) in enumerate(zip(actual + [None] * 12, exp)) if a != b)
    [res] = g.check(doc, models=_models(tiny_path, bad))
    assert res.status == "regression" and res.position == first
    assert f"first divergence at generated position {first}" in res.message
    assert f"expected {exp[first]} " in res.message and "logprobs now:" in res.message


def test_logprob_mode_detects_small_changes(tmp_path, tiny_path):
    model = fx_engine.load(tiny_path)
    doc = g.record([g.parse_case(CASES[2], "t")], models=_models(tiny_path, model))
    [ok] = g.check(doc, models=_models(tiny_path, model))
    assert ok.status == "pass"
    p = model.params
    nudged = tree_replace(model, params=tree_replace(p, norm=p.norm * 1.01))
    [res] = g.check(doc, models=_models(tiny_path, nudged))
    assert res.status == "regression" and res.position is not None
    assert "recorded" in res.message and "tol" in res.message


def test_different_model_is_a_fingerprint_mismatch_not_a_regression(tmp_path, tiny_path):
    doc = g.record([g.parse_case(CASES[0], "t")], models=_models(tiny_path))
    other = write_tiny_model(tmp_path / "other", "llama", seed=1)
    [res] = g.check(doc, model=str(other))
    assert res.status == "fingerprint_mismatch" and "not a regression" in res.message
    # on purpose: compare anyway
    [res2] = g.check(doc, model=str(other), ignore_fingerprint=True)
    assert res2.status in ("regression", "pass")


def test_malformed_golden_documents_are_errors(tmp_path, tiny_path):
    doc = g.record([g.parse_case(CASES[0], "t")], models=_models(tiny_path))
    for mutate, field in [
        (lambda d: d.update(cases=[]), "cases"),
        (lambda d: d["cases"][0].update(logprobs=[]), "logprobs"),
        (lambda d: d.update(models={}), "fingerprint"),
        (lambda d: d["cases"][0].pop("token_ids"), "token_ids"),
        (lambda d: d["cases"][0]["case"].update(max_tokens=0), "max_tokens"),
    ]:
        bad = json.loads(json.dumps(doc))
        mutate(bad)
        with pytest.raises(g.GoldenError, match=field):
            g.check(bad, models=_models(tiny_path))
        g.save(bad, tmp_path / "bad.json")
        with pytest.raises(g.GoldenError, match="bad.json"):
            g.load_golden(tmp_path / "bad.json")


@pytest.mark.parametrize("case, field", [
    ({"name": "x", "prompt": "a"}, "max_tokens"),
    ({"name": "x", "max_tokens": 3}, "exactly one of prompt and messages"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "compare": "text"}, "compare"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "logprob_tol": -1}, "logprob_tol"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "temperature": 1}, "unknown field"),
    ({"prompt": "a", "max_tokens": 3}, "name"),
])
def test_bad_case_files_name_the_field(tmp_path, case, field):
    with pytest.raises(g.GoldenError, match=field):
        g.load_cases(_cases_file(tmp_path, [case]))


def test_yaml_cases_and_cli_record_check(tmp_path, tiny_path, capsys):
    from fx_engine.cli import main

    cases = [dict(c, model=str(tiny_path)) for c in CASES[:2]]
    path = _cases_file(tmp_path, cases, ".yaml")
    assert main(["golden", "record", str(path), "-o", str(tmp_path / "g.json")]) == 0
    assert main(["golden", "check", str(tmp_path / "g.json")]) == 0
    other = write_tiny_model(tmp_path / "other", "llama", seed=2)
    assert main(["golden", "check", str(tmp_path / "g.json"), "--model", str(other)]) == 3
    out = capsys.readouterr().out
    assert "2 passed" in out and "FINGERPRINT_MISMATCH" in out


def test_pytest_fixture_reports_the_diff(pytester, tmp_path, tiny_path, monkeypatch):
    # pytester gives the subprocess a HOME of its own: point it at the built native kernels
    # (else it compiles them again, ~35 s)
    monkeypatch.setenv("FX_ENGINE_CACHE", str(NATIVE_CACHE))
    model = fx_engine.load(tiny_path)
    doc = g.record([g.parse_case(dict(CASES[0], model=str(tiny_path)), "t")])
    doc["cases"][0]["token_ids"][2] = (doc["cases"][0]["token_ids"][2] + 1) % model.config.vocab_size
    gpath = tmp_path / "g.json"
    g.save(doc, gpath)
    pytester.makepyfile(f"""
def test_pinned(golden):
    golden.check({str(gpath)!r}, "greedy")
""")
    res = pytester.runpytest_subprocess("-p", "fx_engine.testing.pytest_plugin", "-p", "no:cacheprovider")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*GoldenMismatch*", "*first divergence at generated position 2*"])


# ------------------------------------------------------------------ custom producers (issue 42)
REPO = Path(__file__).resolve().parents[2]
FIRST = 504  # the token force_first starts with (not what generate starts with: checked)
LOOP_CASE = {"name": "forced", "model": "default", "prompt": "The capital of France is",
             "max_tokens": 5, "params": {"first": FIRST}}


def force_first(model, case):
    """A custom loop: generate with a twist, its first token forced to case.params["first"].
    GOLDEN_TWIST_AT=i (environment) changes its token i: the loop changed."""
    import os

    import fx_engine

    first = case.params["first"]
    rest = fx_engine.generate(model, case.prompt_ids(model) + [first],
                              **dict(case.generate_kwargs(), max_tokens=case.max_tokens - 1))
    out = [first, *rest.token_ids]
    at = os.environ.get("GOLDEN_TWIST_AT")
    if at is not None:
        out[int(at)] = (out[int(at)] + 1) % model.config.vocab_size
    return out


GUIDED = {"calls": 0, "scale": 1.0}


def guided(model, case):
    """Classifier-free guidance, greedy, over fx_engine.logits: conditional on the prompt,
    unconditional on its last token; each token's logprob under the guided distribution."""
    import mlx.core as mx

    GUIDED["calls"] += 1
    ids, w = case.prompt_ids(model), case.params["guidance"]
    toks, lps = [], []
    for _ in range(case.max_tokens):
        cond = fx_engine.logits(model, ids + toks)[-1].astype(mx.float32)
        uncond = fx_engine.logits(model, ids[-1:] + toks)[-1].astype(mx.float32)
        lg = GUIDED["scale"] * (uncond + w * (cond - uncond))
        lp = lg - mx.logsumexp(lg)
        t = int(mx.argmax(lp).item())
        if t in model.eos_ids:
            break
        toks.append(t)
        lps.append(lp[t].item())
    return g.Produced(token_ids=toks, logprobs=lps)


@pytest.fixture
def default_models(default_model):
    m = g.ModelCache()
    m.put("default", default_model)
    return m


def test_a_custom_producer_is_recorded_and_checked(default_model, default_models):
    case = g.parse_case(LOOP_CASE, "t")
    doc = g.record([case], producer=force_first, models=default_models)
    name = f"{force_first.__module__}:force_first"
    assert doc["origin"]["producer"] == doc["origin"]["check_producer"] == name
    ids = doc["cases"][0]["prompt_token_ids"]
    plain = list(fx_engine.generate(default_model, ids, max_tokens=5).token_ids)
    rest = list(fx_engine.generate(default_model, ids + [FIRST], max_tokens=4).token_ids)
    assert doc["cases"][0]["token_ids"] == [FIRST, *rest] and plain[0] != FIRST
    assert doc["cases"][0]["case"]["params"] == {"first": FIRST}
    [res] = g.check(doc, producer=force_first, models=default_models)
    assert res.status == "pass", res
    # checking with fx_engine.generate (the false regression before): a clear error naming the producer
    with pytest.raises(g.GoldenError, match=r"recorded to be checked with the producer .*force_first.*--producer"):
        g.check(doc, models=default_models)
    with pytest.raises(g.GoldenError, match="guided"):
        g.check(doc, producer=guided, models=default_models)
    # compared anyway on request: generate's output differs at once
    [res] = g.check(doc, models=default_models, allow_producer_mismatch=True)
    assert res.status == "regression" and res.position == 0
    # params are for a custom producer: fx_engine.generate refuses them
    with pytest.raises(g.GoldenError, match=r"'forced'.*params \['first'\].*--producer"):
        g.record([case], models=default_models)


def test_a_changed_producer_is_a_regression_at_its_position(default_models, monkeypatch):
    doc = g.record([g.parse_case(LOOP_CASE, "t")], producer=force_first, models=default_models)
    monkeypatch.setenv("GOLDEN_TWIST_AT", "2")
    exp = doc["cases"][0]["token_ids"]
    actual = force_first(default_models.get("default"), g.parse_case(LOOP_CASE, "t"))
    first = next(i for i, (a, b) in enumerate(zip(actual, exp)) if a != b)
    assert first == 2
    [res] = g.check(doc, producer=force_first, models=default_models)
    assert res.status == "regression" and res.position == first
    assert f"first divergence at generated position {first}" in res.message
    assert f"expected {exp[first]} " in res.message and f"actual   {actual[first]} " in res.message


@pytest.mark.slow
def test_logprob_comparisons_run_the_producer(default_models, monkeypatch):
    monkeypatch.setitem(GUIDED, "calls", 0)
    case = g.parse_case({"name": "cfg", "model": "default", "prompt": "The capital of France is",
                         "max_tokens": 4, "params": {"guidance": 1.5}, "compare": "logprobs",
                         "logprob_tol": 1e-4, "top_logprobs": 0}, "t")
    doc = g.record([case], producer=guided, models=default_models)
    assert GUIDED["calls"] == 1
    entry = doc["cases"][0]
    produced = guided(default_models.get("default"), case)
    assert entry["logprobs_from"] == "producer" and entry["logprobs"] == list(produced.logprobs)
    assert entry["token_ids"] == list(produced.token_ids) and len(entry["token_ids"]) == 4
    GUIDED["calls"] = 0
    [res] = g.check(doc, producer=guided, models=default_models)
    assert res.status == "pass" and GUIDED["calls"] == 1, res
    # the loop changed: a sharper guided distribution (same argmax tokens, other logprobs)
    monkeypatch.setitem(GUIDED, "scale", 1.01)
    changed = guided(default_models.get("default"), case)
    assert list(changed.token_ids) == entry["token_ids"]
    first = next(i for i, (a, b) in enumerate(zip(entry["logprobs"], changed.logprobs)) if abs(a - b) > 1e-4)
    [res] = g.check(doc, producer=guided, models=default_models)
    assert res.status == "regression" and res.position == first and GUIDED["calls"] == 3
    assert "recorded" in res.message and "tol" in res.message and "guided" in res.message

    # compare: logprobs needs the producer's own logprobs
    def tokens_only(model, c):
        return list(guided(model, c).token_ids)

    with pytest.raises(g.GoldenError, match=r"'cfg'.*compare: logprobs.*returned none"):
        g.record([case], producer=tokens_only, models=default_models)
    [res] = g.check(doc, producer=tokens_only, models=default_models, allow_producer_mismatch=True)
    assert res.status == "error" and "returned none" in res.message


def test_producer_results_are_checked(default_model, default_models):
    case = g.parse_case({"name": "c", "model": "default", "prompt": "Hi", "max_tokens": 3}, "t")
    v = default_model.config.vocab_size
    for result, match in [
        ("hello", r"'c': producer .*returned str; expected Produced"),
        ([1, 2, 3, 4], "returned 4 tokens; the case allows max_tokens 3"),
        ([1, v], f"token id {v} at position 1, outside the vocabulary"),
        ([1, True], "returned list"),
        (g.Produced([1, 2], logprobs=[-0.5]), r"not one number per token \(1 for 2 tokens\)"),
        (g.Produced([1, 2], logprobs=[-0.5, 3.0]), "logprob 3.0 at position 1: not a log-probability"),
        (g.Produced([1], logprobs=[-0.5], top_logprobs=[[1, 2]]), "top_logprobs"),
    ]:
        with pytest.raises(g.GoldenError, match=match):
            g.record([case], producer=lambda m, c, r=result: r, models=default_models)

    def broken(model, c):
        return 1 // 0

    with pytest.raises(g.ProducerError, match=r"'c': producer .*broken raised ZeroDivisionError") as ei:
        g.record([case], producer=broken, models=default_models)
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    with pytest.raises(g.GoldenError, match=r"cannot be called as fn\(model, case\)"):
        g.record([case], producer=lambda model: [1], models=default_models)

    # a Completion is a result too, with its logprobs (top-k as asked)
    def with_logprobs(model, c):
        return fx_engine.generate(model, c.prompt_ids(model), logprobs=2, **c.generate_kwargs())

    k2 = g.parse_case({"name": "c", "model": "default", "prompt": "Hi", "max_tokens": 3, "top_logprobs": 2}, "t")
    doc = g.record([k2], producer=with_logprobs, models=default_models)
    out = with_logprobs(default_model, k2)
    e = doc["cases"][0]
    assert e["token_ids"] == list(out.token_ids) and e["logprobs_from"] == "producer"
    assert e["logprobs"] == [x.logprob for x in out.logprobs] and [len(t) for t in e["top_logprobs"]] == [2] * 3
    assert [g.check(doc, producer=with_logprobs, models=default_models)[0].status] == ["pass"]


def test_resolve_producer(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)
    fn, name = g.resolve_producer("tests.core.test_golden_kit:force_first")
    assert fn is force_first and name == "tests.core.test_golden_kit:force_first"
    fn, name = g.resolve_producer("tests/core/test_golden_kit.py:force_first")
    assert fn.__name__ == "force_first" and g.same_producer(name, "tests.core.test_golden_kit:force_first")
    assert g.same_producer(g.producer_name_of(fn), name) and not g.same_producer(name, "tests.loops:guided")
    (tmp_path / "loops.py").write_text("class Loops:\n    @staticmethod\n    def cfg(model, case):\n"
                                       "        return [1]\n\nNOT_CALLABLE = 3\n")
    (tmp_path / "bad.py").write_text("import no_such_module_xyz\n")
    fn, _ = g.resolve_producer(f"{tmp_path}/loops.py:Loops.cfg")
    assert fn(None, None) == [1]
    for spec, match in [
        ("tests.core.test_golden_kit", "expected MODULE:FUNCTION"),
        ("no_such_pkg_xyz.loops:cfg", "no module named 'no_such_pkg_xyz'"),
        (f"{tmp_path}/nope.py:cfg", "no such file"),
        (f"{tmp_path}/loops.py:missing", "has no attribute 'missing'"),
        (f"{tmp_path}/loops.py:NOT_CALLABLE", "a int is not a producer"),
        (f"{tmp_path}/bad.py:cfg", "running .*bad.py failed: ModuleNotFoundError"),
    ]:
        with pytest.raises(g.GoldenError, match=match):
            g.resolve_producer(spec)


@pytest.mark.parametrize("case, field", [
    ({"name": "x", "prompt": "a", "max_tokens": 3, "sampling": {"guidance": 1.5}},
     r"cases\[0\] \(x\)\.sampling: unknown key\(s\) \['guidance'\].*params"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "sampling": {"max_tokens": 5}}, "max_tokens is a field"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "sampling": {"logit_bias": {"a": 1}}}, "logit_bias"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "params": [1]}, r"\(x\)\.params"),
    ({"name": "x", "prompt": 5, "max_tokens": 3}, r"\(x\)\.prompt"),
    ({"name": "x", "messages": "hi", "max_tokens": 3}, r"\(x\)\.messages"),
    ({"name": "x", "prompt": "a", "max_tokens": 3, "guidance": 1.5}, r"\(x\): unknown field.*'guidance'"),
])
def test_bad_keys_name_the_case_and_the_key(tmp_path, case, field):
    with pytest.raises(g.GoldenError, match=field):
        g.load_cases(_cases_file(tmp_path, [case]))


@pytest.mark.slow
def test_cli_pins_a_custom_loop(tmp_path, capsys, monkeypatch):
    from fx_engine.cli import main

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("GOLDEN_TWIST_AT", raising=False)
    cases, gpath = _cases_file(tmp_path, [LOOP_CASE]), str(tmp_path / "g.json")
    file_spec, mod_spec = "tests/core/test_golden_kit.py:force_first", "tests.core.test_golden_kit:force_first"
    assert main(["golden", "record", str(cases), "-o", gpath, "--producer", file_spec]) == 0
    doc = g.load_golden(gpath)
    assert doc["origin"]["producer"] == doc["origin"]["check_producer"] == file_spec
    assert doc["cases"][0]["token_ids"][0] == FIRST
    assert main(["golden", "check", gpath, "--producer", file_spec]) == 0
    assert main(["golden", "check", gpath, "--producer", mod_spec]) == 0  # the same producer
    out = " ".join(capsys.readouterr().out.split())
    assert out.count("1 passed, 0 regressions") == 2 and f"(producer {mod_spec})" in out
    assert f"wrote {gpath} (1 cases; producer {file_spec};" in out
    # without it (generate) or with another loop: one clear line, exit 2
    other = tmp_path / "loops.py"
    other.write_text("import fx_engine\n\n\n" + inspect.getsource(force_first).replace("force_first", "other"))
    for extra in ([], ["--producer", f"{other}:other"]):
        assert main(["golden", "check", gpath, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"recorded to be checked with the producer '{file_spec}'" in err
        assert f"--producer {file_spec}" in err
    assert main(["golden", "check", gpath, "--producer", f"{other}:other", "--allow-producer-mismatch"]) == 0
    # the loop changed: a regression at its position, exit 1
    monkeypatch.setenv("GOLDEN_TWIST_AT", "3")
    assert main(["golden", "check", gpath, "--producer", file_spec]) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "REGRESSION forced: first divergence at generated position 3" in out and "1 regressions" in out


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "fx_engine.cli", "golden", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_cli_bad_case_or_producer_is_one_line_not_a_traceback(tmp_path):
    bad = _cases_file(tmp_path, [dict(LOOP_CASE, name="cfg", sampling={"temperature": 0.5, "guidance": 1.5})])
    r = _cli("record", str(bad), "-o", str(tmp_path / "g.json"), cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and "(cfg).sampling: unknown key(s) ['guidance']" in r.stderr
    assert "params:" in r.stderr
    ok = _cases_file(tmp_path, [LOOP_CASE])
    r = _cli("record", str(ok), "-o", str(tmp_path / "g.json"), "--producer", "no_such_pkg_xyz:loop", cwd=REPO)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "no module named 'no_such_pkg_xyz'" in r.stderr
    # a producer that fails, or returns the wrong thing: one line naming the case and the producer
    (tmp_path / "loops.py").write_text("def boom(model, case):\n    raise RuntimeError('no luck')\n\n"
                                       "def wrong(model, case):\n    return {'tokens': [1]}\n")
    for fn, why in [("boom", "raised RuntimeError: no luck"), ("wrong", "returned dict")]:
        r = _cli("record", str(ok), "-o", str(tmp_path / "g.json"), "--producer", f"{tmp_path}/loops.py:{fn}",
                 cwd=tmp_path)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
        assert f"case 'forced': producer {tmp_path}/loops.py:{fn} {why}" in r.stderr
    assert not (tmp_path / "g.json").exists()


@pytest.mark.slow
def test_pytest_fixture_pins_a_custom_loop(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("FX_ENGINE_CACHE", str(NATIVE_CACHE))
    monkeypatch.delenv("GOLDEN_TWIST_AT", raising=False)
    cases, gpath = _cases_file(tmp_path, [LOOP_CASE]), tmp_path / "g.json"
    pytester.makepyfile(test_loop=f"""
import pytest
from fx_engine.testing import GoldenError

{inspect.getsource(force_first)}

def test_loop(golden):
    golden.check({str(gpath)!r}, producer=force_first, cases={str(cases)!r})

def test_not_generate(golden):
    with pytest.raises(GoldenError, match="recorded to be checked with the producer 'test_loop:force_first'"):
        golden.check({str(gpath)!r})
""")
    args = ("-p", "fx_engine.testing.pytest_plugin", "-p", "no:cacheprovider")
    res = pytester.runpytest_subprocess(*args, "--golden-record", "test_loop.py::test_loop")
    res.assert_outcomes(skipped=1)
    doc = g.load_golden(gpath)
    assert doc["origin"]["producer"] == "test_loop:force_first" and doc["cases"][0]["token_ids"][0] == FIRST
    pytester.runpytest_subprocess(*args).assert_outcomes(passed=2)
    monkeypatch.setenv("GOLDEN_TWIST_AT", "2")
    res = pytester.runpytest_subprocess(*args, "test_loop.py::test_loop")
    res.assert_outcomes(failed=1)
    res.stdout.fnmatch_lines(["*GoldenMismatch*", "*first divergence at generated position 2*"])
