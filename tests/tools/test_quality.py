"""tools/quality.py: its KL / top-1 / perplexity math against an independent computation, and
a short end-to-end run on the default model (docs/numerics.md)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import quality  # noqa: E402


def _softmax_row(row: np.ndarray) -> list[float]:
    """Probabilities of one row, the textbook way (Python floats, math.fsum)."""
    m = max(float(v) for v in row)
    e = [math.exp(float(v) - m) for v in row]
    s = math.fsum(e)
    return [v / s for v in e]


def test_token_stats_match_an_independent_computation() -> None:
    rng = np.random.default_rng(0)
    T, V = 7, 50
    ref = rng.normal(0, 3, (T, V)).astype(np.float32)
    cand = (ref + rng.normal(0, 0.5, (T, V))).astype(np.float32)
    targets = rng.integers(0, V, T)
    st = quality.token_stats(ref, cand, targets)
    for t in range(T):
        p, q = _softmax_row(ref[t]), _softmax_row(cand[t])
        kl = math.fsum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
        assert st["kl"][t] == pytest.approx(kl, rel=1e-9, abs=1e-12)
        assert st["nll_ref"][t] == pytest.approx(-math.log(p[targets[t]]), rel=1e-9)
        assert st["nll"][t] == pytest.approx(-math.log(q[targets[t]]), rel=1e-9)
        assert st["top1"][t] == (int(np.argmax(p)) == int(np.argmax(q)))
    s = quality.summarize(st["kl"], st["top1"], st["nll"], st["nll_ref"])
    assert s["tokens"] == T
    assert s["kl_mean"] == pytest.approx(float(np.mean(st["kl"])))
    assert s["kl_p99"] <= s["kl_max"] == pytest.approx(float(np.max(st["kl"])))
    assert s["ppl"] == pytest.approx(math.exp(math.fsum(st["nll"]) / T), rel=1e-12)
    assert s["ppl_ref"] == pytest.approx(math.exp(math.fsum(st["nll_ref"]) / T), rel=1e-12)
    assert s["top1"] == pytest.approx(float(np.mean(st["top1"])))


def test_kl_and_perplexity_edge_cases() -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(0, 4, (5, 32))
    t = rng.integers(0, 32, 5)
    same = quality.token_stats(x, x + 7.0, t)  # a constant shift is the same distribution
    assert np.all(same["kl"] < 1e-12) and same["top1"].all()
    assert np.allclose(same["nll"], same["nll_ref"])
    # uniform logits: perplexity is the vocabulary size
    u = quality.token_stats(np.zeros((4, 10)), np.zeros((4, 10)), np.arange(4))
    assert quality.summarize(u["kl"], u["top1"], u["nll"], u["nll_ref"])["ppl"] == pytest.approx(10.0)
    # two outcomes, analytic KL(Bern(0.9) || Bern(0.6))
    p, q = 0.9, 0.6
    b = quality.token_stats(np.log([[p, 1 - p]]), np.log([[q, 1 - q]]), np.array([0]))
    want = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert b["kl"][0] == pytest.approx(want, rel=1e-12)
    # KL is not symmetric and is what the tool reports: KL(ref || cand)
    r = quality.token_stats(np.log([[q, 1 - q]]), np.log([[p, 1 - p]]), np.array([0]))
    assert r["kl"][0] != pytest.approx(want)


def test_windows() -> None:
    ids = list(range(10))
    assert quality.windows(ids, 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert quality.windows(ids, 16) == [ids]
    with pytest.raises(ValueError):
        quality.windows([1], 4)


@pytest.mark.slow
@pytest.mark.real_model
def test_quality_smoke(tmp_path: Path) -> None:
    """The tool end to end on the default model, a few windows of its default text (or a
    short English text where that file is missing)."""
    text = Path(quality.DEFAULT_TEXT)
    if not text.exists():
        text = tmp_path / "text.txt"
        text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    engines = "fx-a8,llama.cpp" if quality.llama_cpp_available() else "fx-a8"
    out_json, out_md = tmp_path / "q.json", tmp_path / "q.md"
    report = quality.main(["--text", str(text), "--tokens", "64", "--window", "32",
                           "--engines", engines, "--json", str(out_json), "--markdown", str(out_md)])
    assert json.loads(out_json.read_text())["rows"] == report["rows"]
    assert report["text"]["windows"] == 2 and report["text"]["scored_tokens"] == 62
    rows = {r["engine"]: r for r in report["rows"]}
    assert set(rows) == set(engines.split(","))
    for r in rows.values():
        assert r["tokens"] == 62
        assert 0 <= r["kl_mean"] < 0.2  # a numerics change, not another model
        assert r["top1"] > 0.7
        assert 1 < r["ppl"] < 1e4 and 1 < r["ppl_ref"] < 1e4
    (model,) = report["models"].values()
    assert model["ppl_fx_float32"] == pytest.approx(rows["fx-a8"]["ppl_ref"])
    assert "| fx-a8 |" in out_md.read_text()
