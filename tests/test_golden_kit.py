"""The golden-output kit (fx_engine.testing.golden): record, check, diffs, fingerprints,
case-file validation, the CLI and the pytest fixture, on tiny random models."""

import json

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
