"""The native stacked-experts product (`gather_qmm`): each (token, expert) pair gives the
bits of the 2-D product on that expert's matrix, whatever the other pairs; the float64
definition; MLX's own gather_qmm; the argument checks."""

from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx
from fx_engine.core.checkpoint import pack_stream
from fx_engine.runtime import native

pytestmark = pytest.mark.skipif(native.ensure(quiet=True) is None,
                                reason=f"native kernels unavailable: {native.status()['error']}")

RNG = np.random.default_rng(4321)
TWO_D = {"qmm": lambda *a: native.qmm(*a), "qgemm": lambda *a: native.qgemm(*a),
         "qmm_a8": lambda *a: native.qmm_a8(*a)}


def _stack(e: int, n: int, k: int, gs: int, bits: int, fmt: str):
    """A random stacked expert tensor [E, N, K] packed in `bits`, its scales and biases in
    `fmt` (float32, float16, or GGUF's two-level form in super-blocks of 256), and the
    float64 weights it stands for."""
    q = RNG.integers(0, 1 << bits, (e * n, k), dtype=np.uint32)
    w = mx.array(pack_stream(q, bits).reshape(e, n, -1))
    g = k // gs
    if fmt in ("kq", "kq1"):  # kq1: every bias code equal to its scale code (a Q6_K's)
        sb = 256 // gs
        a = RNG.integers(-128, 128, (e * n, g)).astype(np.int8)
        c = a if fmt == "kq1" else RNG.integers(-128, 128, (e * n, g)).astype(np.int8)
        de = RNG.uniform(1e-4, 2e-3, (e * n, g // sb, 2)).astype(np.float16)
        codes = (a.astype(np.uint8).astype(np.uint16) | (c.astype(np.uint8).astype(np.uint16) << 8)).view(np.int16)
        d, f = (np.repeat(de[..., i].astype(np.float32), sb, axis=1) for i in (0, 1))
        fs, fb = d * a.astype(np.float32), -(f * c.astype(np.float32))
        s, b = mx.array(codes.reshape(e, n, g)), mx.array(de.reshape(e, n, g // sb, 2))
    else:
        dt = np.float16 if fmt == "float16" else np.float32
        fs = RNG.uniform(0.001, 0.05, (e * n, g)).astype(dt).astype(np.float32)
        fb = RNG.uniform(-0.5, 0.5, (e * n, g)).astype(dt).astype(np.float32)
        s, b = mx.array(fs.astype(dt).reshape(e, n, g)), mx.array(fb.astype(dt).reshape(e, n, g))
    dense = q.astype(np.float64) * np.repeat(fs, gs, 1) + np.repeat(fb, gs, 1)
    return (w, s, b), dense.reshape(e, n, k)


@pytest.mark.parametrize("kind", ["qmm", "qgemm", "qmm_a8"])
@pytest.mark.parametrize("bits,gs,fmt", [(4, 32, "float32"), (4, 32, "kq"), (6, 16, "kq"),
                                         (5, 32, "kq"), (8, 64, "float16"), (8, 32, "float32")])
@pytest.mark.parametrize("t,k,shared", [(1, 4, True), (3, 2, False), (20, 3, True), (9, 3, False)])
def test_each_pair_gives_its_experts_two_d_bits(kind: str, bits: int, gs: int, fmt: str,
                                                 t: int, k: int, shared: bool) -> None:
    """out[t, j] is, bit for bit, the 2-D kernel's product of the pair's row with its
    expert's matrix (so batching pairs by expert changes nothing), and close to the float64
    definition."""
    if kind == "qmm_a8" and gs < 32:
        pytest.skip("(8-bit activations in groups of 16 are qmm_a8's own test)")
    e, n, kk = 6, 40, 512
    (w, s, b), dense = _stack(e, n, kk, gs, bits, fmt)
    x = mx.array(RNG.standard_normal((t, 1 if shared else k, kk)).astype(np.float32))
    idx = mx.array(RNG.integers(0, e, (t, k)).astype(np.int32))
    y = native.gather_qmm(x, idx, w, s, b, gs, bits, kind)
    assert y.shape == (t, k, n) and y.dtype == mx.float32
    got = np.asarray(y)
    for ti in range(t):
        for j in range(k):
            ex = int(idx[ti, j])
            row = x[ti, 0 if shared else j][None]
            want = np.asarray(TWO_D[kind](row, w[ex], s[ex], b[ex], gs, bits))[0]
            assert np.array_equal(got[ti, j], want), (ti, j)
            if kind != "qmm_a8":  # (8-bit activations: other numerics by design)
                ref = np.asarray(row[0]).astype(np.float64) @ dense[ex].T
                np.testing.assert_allclose(got[ti, j], ref, rtol=1e-4, atol=1e-3)


def test_agrees_with_mlx_gather_qmm() -> None:
    """MLX's own stacked product on the same packed stack (float32 scales, 4 bits)."""
    e, n, kk, t, k = 8, 64, 256, 5, 2
    wf = mx.array(RNG.standard_normal((e, n, kk)).astype(np.float32))
    w, s, b = mx.quantize(wf, group_size=32, bits=4)
    x = mx.array(RNG.standard_normal((t, 1, kk)).astype(np.float32))
    idx = mx.array(RNG.integers(0, e, (t, k)).astype(np.uint32))
    ours = native.gather_qmm(x, idx, w, s, b, 32, 4, "qmm")
    theirs = mx.gather_qmm(x[:, :, None, :], w, s, b, rhs_indices=idx, transpose=True,
                           group_size=32, bits=4)[:, :, 0]
    np.testing.assert_allclose(np.asarray(ours), np.asarray(theirs), rtol=1e-4, atol=1e-4)


def test_inside_compile_and_other_dtypes() -> None:
    (w, s, b), _ = _stack(4, 32, 256, 32, 4, "float32")
    x = mx.array(RNG.standard_normal((3, 1, 256)).astype(np.float32))
    idx = mx.array([[0, 3], [3, 3], [1, 2]])
    want = np.asarray(native.gather_qmm(x, idx, w, s, b, 32, 4, "qmm"))
    f = mx.compile(lambda x, i: native.gather_qmm(x, i, w, s, b, 32, 4, "qmm"))
    assert np.array_equal(np.asarray(f(x, idx)), want)
    y16 = native.gather_qmm(x.astype(mx.float16), idx, w, s, b, 32, 4, "qmm")
    assert y16.dtype == mx.float16


@pytest.mark.parametrize("bits,gs,fmt", [(4, 32, "float32"), (4, 32, "kq"), (8, 32, "float16"),
                                         (6, 16, "kq"), (5, 32, "kq"), (6, 16, "kq1")])
@pytest.mark.parametrize("t,k", [(1, 4), (20, 3)])
def test_interleaved_stack_gives_the_rows_bits(bits: int, gs: int, fmt: str, t: int, k: int) -> None:
    """A stack in the 8-bit mode's layout (nn.interleave_for_a8: each expert's matrix
    interleaved, 5-/6-bit ones as planes where the build reads them) through "qmm_a8_il"
    gives the rows stack's "qmm_a8" bits (decode's one row per expert and prefill's many);
    nn.row_major gives the rows back; MLX's gather path refuses it."""
    from fx_engine.core import kernels
    from fx_engine.core.nn import Linear, Quant, expert_linear, interleave_for_a8, row_major

    e, n, kk = 5, 48, 512
    (w, s, b), _ = _stack(e, n, kk, gs, bits, fmt)
    lin = Linear(weight=w, quant=Quant(scales=s, biases=b, group_size=gs, bits=bits))
    il = interleave_for_a8(lin)
    if bits in (5, 6) and not kernels.il_planes():
        assert il is lin
        return
    assert il.interleaved and il.weight.shape == w.shape and not mx.array_equal(il.weight, w).item()
    assert il.quant.scales.dtype == (mx.int8 if fmt == "kq1" else s.dtype)  # (nn.one_code)
    back = row_major(il)
    for a, c in ((back.weight, w), (back.quant.scales, s), (back.quant.biases, b)):
        assert mx.array_equal(a, c).item()
    x = mx.array(RNG.standard_normal((t, 1, kk)).astype(np.float32))
    idx = mx.array(RNG.integers(0, e, (t, k)).astype(np.int32))
    q = il.quant
    got = native.gather_qmm(x, idx, il.weight, q.scales, q.biases, gs, bits, "qmm_a8_il")
    assert np.array_equal(np.asarray(got), np.asarray(native.gather_qmm(x, idx, w, s, b, gs, bits, "qmm_a8")))
    with pytest.raises(ValueError, match="interleaved layout"):
        expert_linear(x[:, :, None], il, idx)
    with pytest.raises(ValueError, match="multiple of 16 rows per expert"):
        native.gather_qmm(x, idx, w[:, :40], s[:, :40], b[:, :40], gs, bits, "qmm_a8_il")


@pytest.mark.parametrize("bits", [4, 8])
def test_a_stack_with_implied_biases_gives_the_stored_biases_bits(bits: int) -> None:
    """An expert stack of GGUF Q4_0 / Q8_0 matrices (float16 scales, biases -2^(bits-1) times
    them): interleave_for_a8 records the multiplier (nn.implied_bias) and "qmm_a8_il" with
    the one multiplier as its biases (nn._product_biases) gives the stored biases' bits, for
    every expert, at decode and prefill row counts."""
    from fx_engine.core.nn import Linear, Quant, _product_biases, interleave_for_a8

    e, n, kk, gs = 5, 48, 512, 32
    (w, s, _), _ = _stack(e, n, kk, gs, bits, "float16")
    b = (s.astype(mx.float32) * -(2 ** (bits - 1))).astype(mx.float16)
    il = interleave_for_a8(Linear(weight=w, quant=Quant(scales=s, biases=b, group_size=gs, bits=bits)))
    assert il.quant.bias_multiplier == -(2 ** (bits - 1))
    for t, k in ((1, 4), (20, 3)):
        x = mx.array(RNG.standard_normal((t, 1, kk)).astype(np.float32))
        idx = mx.array(RNG.integers(0, e, (t, k)).astype(np.int32))
        got = native.gather_qmm(x, idx, il.weight, il.quant.scales, _product_biases(il.quant), gs, bits, "qmm_a8_il")
        assert np.array_equal(np.asarray(got), np.asarray(native.gather_qmm(x, idx, w, s, b, gs, bits, "qmm_a8")))


def test_arguments_are_checked() -> None:
    (w, s, b), _ = _stack(4, 32, 256, 32, 4, "float32")
    x = mx.ones((2, 1, 256))
    idx = mx.zeros((2, 2), mx.int32)
    with pytest.raises(ValueError, match="x must be"):
        native.gather_qmm(mx.ones((2, 1, 128)), idx, w, s, b, 32, 4, "qmm")
    with pytest.raises(ValueError, match="indices must be"):
        native.gather_qmm(x, mx.zeros((3, 2), mx.int32), w, s, b, 32, 4, "qmm")
    with pytest.raises(ValueError, match="indices must be"):
        native.gather_qmm(mx.ones((2, 3, 256)), idx, w, s, b, 32, 4, "qmm")
    with pytest.raises(ValueError, match="stacked"):
        native.gather_qmm(x, idx, w[0], s[0], b[0], 32, 4, "qmm")
    with pytest.raises(ValueError, match="group_size"):
        native.gather_qmm(x, idx, w, s, b, 48, 4, "qmm")
    with pytest.raises(KeyError):
        native.gather_qmm(x, idx, w, s, b, 32, 4, "gemv")
