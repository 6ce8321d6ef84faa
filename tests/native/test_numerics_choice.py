"""`load(numerics=...)`: "exact" (float32 activations, the Python default), "int8" (8-bit
activations into the quantized matmuls) and "auto" (the CLI's and server's default: int8
where the native build has an int8 dot product and the model has quantized matmuls), the
older `activation_bits=8` spelling, switching a loaded model's numerics, and what the
surfaces report (issue 41, item 4; docs/numerics.md)."""

from __future__ import annotations

import numpy as np
import pytest

import fx_engine
from fx_engine.core.nn import linears
from fx_engine.engine import scoring
from fx_engine.runtime import native
from fx_engine.testing.tiny import write_tiny_model

needs_native = pytest.mark.skipif(native.ensure(quiet=True) is None, reason="native kernels unavailable")


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("q") / "m", "llama", quantize={"group_size": 32, "bits": 4})


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("f") / "m", "llama")


def _logits(model, ids=tuple(range(5, 37))) -> np.ndarray:
    return np.asarray(scoring.logits(model, list(ids)))


def test_bad_numerics_are_refused_by_name(quantized) -> None:
    with pytest.raises(ValueError, match="numerics must be one of 'auto', 'exact', 'int8', got 'fast'"):
        fx_engine.load(quantized, numerics="fast")
    with pytest.raises(ValueError, match="activation_bits must be None or 8"):
        fx_engine.load(quantized, activation_bits=4)
    with pytest.raises(ValueError, match="numerics='exact' was given"):
        fx_engine.load(quantized, numerics="exact", activation_bits=8)
    with pytest.raises(ValueError, match="numerics='int8' needs fx-engine's native CPU kernels"):
        fx_engine.load(quantized, numerics="int8", native=False)
    m = fx_engine.load(quantized, native=False)
    with pytest.raises(ValueError, match="numerics must be 'exact', 'int8' or a Numerics"):
        m.with_numerics("auto")


@needs_native
def test_exact_is_the_python_default_and_int8_its_spelled_out_form(quantized) -> None:
    default, exact = fx_engine.load(quantized), fx_engine.load(quantized, numerics="exact")
    int8, old = fx_engine.load(quantized, numerics="int8"), fx_engine.load(quantized, activation_bits=8)
    assert (default.numerics, exact.numerics, int8.numerics, old.numerics) == ("exact", "exact", "int8", "int8")
    assert np.array_equal(_logits(default), _logits(exact))
    assert np.array_equal(_logits(int8), _logits(old))
    assert not np.array_equal(_logits(int8), _logits(exact))  # other numerics, not ignored
    # a disk prefix cache (keyed by the fingerprint) never mixes KV of the two numerics
    assert int8.fingerprint == exact.fingerprint + "-int8"


@needs_native
def test_auto_takes_int8_only_where_it_runs_fast(quantized, dense, monkeypatch) -> None:
    want = "int8" if native.int8_dot() else "exact"
    assert fx_engine.load(quantized, numerics="auto").numerics == want
    # nothing quantized: nothing to round for
    assert fx_engine.load(dense, numerics="auto").numerics == "exact"
    assert fx_engine.load(quantized, numerics="auto", native=False).numerics == "exact"
    # a build without an int8 dot product (qmm_a8's scalar loop) keeps exact under auto
    monkeypatch.setattr(native, "int8_dot", lambda: False)
    assert fx_engine.load(quantized, numerics="auto").numerics == "exact"
    with pytest.warns(UserWarning, match="no int8 dot-product kernel"):
        fx_engine.load(quantized, numerics="int8")


@needs_native
def test_with_numerics_switches_layouts_bit_for_bit(quantized) -> None:
    """A loaded model moves between the numerics: the 8-bit mode's interleaved matrices go
    back to rows for exact (and the other way), giving the very logits of a fresh load."""
    exact, int8 = fx_engine.load(quantized, numerics="exact"), fx_engine.load(quantized, numerics="int8")
    to_exact, to_int8 = int8.with_numerics("exact"), exact.with_numerics("int8")
    assert not any(lin.interleaved for lin in linears(to_exact.params))
    assert any(lin.interleaved for lin in linears(to_int8.params))
    assert np.array_equal(_logits(to_exact), _logits(exact))
    assert np.array_equal(_logits(to_int8), _logits(int8))
    assert (to_exact.fingerprint, to_int8.fingerprint) == (exact.fingerprint, int8.fingerprint)


@needs_native
def test_cli_defaults_to_auto_and_passes_the_choice(quantized, monkeypatch) -> None:
    from fx_engine import cli

    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi", "--model", str(quantized)])
    assert args.numerics == "auto"
    seen = {}
    real = fx_engine.load

    def spy(*a, **kw):
        seen.update(kw)
        return real(*a, **kw)

    monkeypatch.setattr(fx_engine, "load", spy)
    for flag, want in (([], "auto"), (["--numerics", "exact"], "exact"), (["--numerics", "int8"], "int8")):
        model = cli._load(parser.parse_args(["generate", "hi", "--model", str(quantized), *flag]))
        assert seen["numerics"] == want
        assert model.numerics == (("int8" if native.int8_dot() else "exact") if want == "auto" else want)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--numerics", "fast"])
