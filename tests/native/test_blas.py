"""The optimized BLAS is an implementation detail: results agree with MLX's bundled BLAS."""

import json
import os
import subprocess
import sys

import pytest

import mlx.core as mx

import fx_engine

SCRIPT = """
import json, sys
import fx_engine
m = fx_engine.load(sys.argv[1])
ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog. What is the capital of France?")
lg = fx_engine.logits(m, ids)
print(json.dumps({"blas": fx_engine.runtime.blas.active()["name"], "logits": lg.tolist(),
                  "tokens": list(fx_engine.generate(m, ids, max_tokens=8).token_ids)}))
"""


def _run(path, blas):
    env = {**os.environ, "FX_ENGINE_BLAS": blas}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


_SYSTEM_OPENBLAS = [p for p in fx_engine.runtime.blas._CANDIDATES if os.path.exists(p)][:1]


@pytest.mark.parametrize("choice", ["auto", *_SYSTEM_OPENBLAS])
@pytest.mark.slow
def test_reference_and_optimized_blas_agree(tiny_dir, choice):
    ref = _run(tiny_dir, "reference")
    fast = _run(tiny_dir, choice)
    assert ref["blas"].startswith("reference")
    assert not fast["blas"].startswith("reference")  # an optimized BLAS really loaded
    a, b = mx.array(ref["logits"]), mx.array(fast["logits"])
    assert mx.abs(a - b).max().item() < 1e-4
    assert ref["tokens"] == fast["tokens"]


def test_auto_prefers_mkl_from_pypi_when_installed():
    if not fx_engine.runtime.blas._pypi_candidates():
        pytest.skip("no MKL from PyPI in this environment (not Linux x86_64)")
    assert fx_engine.runtime.blas.active()["name"] == "MKL"


def test_info_reports_the_active_blas(capsys):
    from fx_engine.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "BLAS" in out and fx_engine.runtime.blas.active()["name"] in out
