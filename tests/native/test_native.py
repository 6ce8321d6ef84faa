"""fx_engine.runtime.native: the CPU kernels against independent references (numpy in float64,
MLX's own ops), their batch invariance, their errors, and the engine with and without them."""

from __future__ import annotations

import numpy as np
import pytest

import fx_engine
import mlx.core as mx
from fx_engine.runtime import native
from fx_engine.engine import scoring
from fx_engine.core.nn import softmax

pytestmark = pytest.mark.skipif(native.ensure(quiet=True) is None,
                                reason=f"native kernels unavailable: {native.status()['error']}")

RNG = np.random.default_rng(1234)


def _quantized(n: int, k: int, gs: int, bits: int):
    w = mx.array(RNG.standard_normal((n, k)).astype(np.float32))
    return mx.quantize(w, group_size=gs, bits=bits)


def _reference(x: mx.array, wq, s, b, gs: int, bits: int) -> np.ndarray:
    w = np.asarray(mx.dequantize(wq, s, b, group_size=gs, bits=bits)).astype(np.float64)
    return np.asarray(x).astype(np.float64) @ w.T


# qmm and qgemm compute the same product with different kernels (and summation orders).
PRODUCTS = [pytest.param(lambda *a: native.qmm(*a), id="qmm"),
            pytest.param(lambda *a: native.qgemm(*a), id="qgemm")]


@pytest.mark.parametrize("op", PRODUCTS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 3, 4, 7, 16, 33, 70])
def test_quantized_products_match_float64_reference(op, bits: int, gs: int, m: int) -> None:
    # n = 37: not a multiple of qmm's 4-feature blocks nor of qgemm's 12; m = 33, 70: a
    # partial second vector of qgemm's 32-row tiles, and several tiles.
    n, k = 37, 256
    wq, s, b = _quantized(n, k, gs, bits)
    x = mx.array(RNG.standard_normal((m, k)).astype(np.float32))
    got = np.asarray(op(x, wq, s, b, gs, bits))
    ref = _reference(x, wq, s, b, gs, bits)
    assert got.shape == (m, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def _group16(n: int, k: int):
    """8-bit weights in groups of 16 (the form a GGUF's Q6_K is widened to; mx.quantize has
    no group 16): random stored integers, packed 4 per uint32 little-endian, and random
    float32 scales and biases; plus the float64 weights they stand for (numpy)."""
    q = RNG.integers(0, 256, (n, k), dtype=np.uint32)
    s = RNG.uniform(0.001, 0.02, (n, k // 16)).astype(np.float32)
    b = RNG.uniform(-1, 1, (n, k // 16)).astype(np.float32)
    packed = (q.reshape(n, k // 4, 4) << np.array([0, 8, 16, 24], np.uint32)).sum(axis=-1, dtype=np.uint32)
    w = q.astype(np.float64) * np.repeat(s, 16, axis=1) + np.repeat(b, 16, axis=1)
    return (mx.array(packed), mx.array(s), mx.array(b)), w


@pytest.mark.parametrize("name", ["qmm", "qgemm"])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16, 17, 33, 70])
def test_8bit_group16_products_match_float64_reference(name: str, m: int) -> None:
    """8 bits in groups of 16 (GGUF Q6_K widened exactly) run natively: every row count
    (the few-row paths' per-half group scales, the tiles), a partial feature block (n=37)."""
    (wq, s, b), w = _group16(37, 256)
    x = mx.array(RNG.standard_normal((m, 256)).astype(np.float32))
    got = np.asarray(getattr(native, name)(x, wq, s, b, 16, 8))
    ref = np.asarray(x).astype(np.float64) @ w.T
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_allclose(np.asarray(native.dequantize(wq, s, b, 16, 8)), w, rtol=1e-6, atol=1e-6)
    if name == "qgemm" and m <= 16:  # the few-row path gives the tiles' bits
        tiles = np.asarray(native.qgemm(mx.concatenate([x] * (17 // m + 1)), wq, s, b, 16, 8))[:m]
        assert np.array_equal(got, tiles)
    # 8-bit activations in groups of 16 too (a Q6_K head in the 8-bit mode): rounded per 16
    got8 = np.asarray(native.qmm_a8(x, wq, s, b, 16, 8))
    np.testing.assert_allclose(got8, _a8_reference(x, wq, s, b, 16, 8), rtol=1e-5, atol=1e-4)
    if m <= 16:  # the few-row path gives the tiles' bits
        tiles = np.asarray(native.qmm_a8(mx.concatenate([x] * (17 // m + 1)), wq, s, b, 16, 8))[:m]
        assert np.array_equal(got8, tiles)
    assert native.supports(16, 8) and native.supports(16, 8, activation_bits=8)
    assert not native.supports(16, 4)


@pytest.mark.parametrize("op", PRODUCTS)
def test_quantized_products_leading_dims_strided_input_and_dtype(op) -> None:
    wq, s, b = _quantized(64, 128, 32, 4)
    x = mx.array(RNG.standard_normal((2, 3, 256)).astype(np.float32))
    xs = x[:, :, ::2]  # not contiguous: the kernel copies it
    got = np.asarray(op(xs, wq, s, b, 32, 4))
    ref = _reference(xs.reshape(-1, 128), wq, s, b, 32, 4).reshape(2, 3, 64)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=1e-4)
    h = op(xs.astype(mx.float16), wq, s, b, 32, 4)
    assert h.dtype == mx.float16 and h.shape == (2, 3, 64)


@pytest.mark.parametrize("op", PRODUCTS)
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (8, 32), (8, 16)])
def test_quantized_products_are_batch_invariant(op, bits: int, gs: int) -> None:
    """A row's output is bitwise the same alone, in any batch, at any position, and with
    any thread count: the property the batch-invariant mode relies on (for qgemm: also at
    any position inside its 32-row tiles, and in a partial tile; for qmm: its fused path
    up to 16 rows in passes of 8, its 4-row tiles on a dequantized copy above, n = 200
    not a multiple of the 6 or 12 features either runs at once)."""
    if gs == 16:
        (wq, s, b), _ = _group16(200, 576)
    else:
        wq, s, b = _quantized(200, 576, gs, bits)
    x = mx.array(RNG.standard_normal((70, 576)).astype(np.float32))
    full = np.asarray(op(x, wq, s, b, gs, bits))
    for i, rows in [(0, slice(0, 1)), (5, slice(5, 6)), (5, slice(3, 10)), (39, slice(30, 40)),
                    (45, slice(17, 70)), (69, slice(0, 70, 3)), (20, slice(20, 36)),
                    (36, slice(20, 37)), (2, slice(0, 4)), (3, slice(0, 5)), (8, slice(1, 10))]:
        part = np.asarray(op(x[rows], wq, s, b, gs, bits))
        assert np.array_equal(part[(i - rows.start) // (rows.step or 1)], full[i])
    mod = native._module()
    threads = mod.num_threads()
    try:
        mod.set_num_threads(1)
        single = np.asarray(op(x, wq, s, b, gs, bits))
    finally:
        mod.set_num_threads(threads)
    assert np.array_equal(single, full)


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 32), (8, 64)])
@pytest.mark.parametrize("n", [50, 200])
def test_qgemm_few_row_path_gives_the_tiles_bits(bits: int, gs: int, n: int) -> None:
    """Up to 16 rows qgemm runs another kernel (vectors along the features, weights
    dequantized in registers; for 1-2 rows several 16-feature blocks at once); every row
    count 1..16 gives the bits of the many-row tiles (n = 50: a partial block of 16
    features; n = 200: 13 blocks, so whole groups of 4 or 2 blocks and a single one, over
    several pool chunks; 40 rows: the tile path)."""
    wq, s, b = _quantized(n, 384, gs, bits)
    x = mx.array(RNG.standard_normal((40, 384)).astype(np.float32))
    tiles = np.asarray(native.qgemm(x, wq, s, b, gs, bits))
    for m in range(1, 17):
        few = np.asarray(native.qgemm(x[40 - m:], wq, s, b, gs, bits))
        assert np.array_equal(few, tiles[40 - m:]), m


@pytest.mark.parametrize("kernel", ["qgemm", "qmm"])
@pytest.mark.parametrize("gemm_from", [0, 32])
def test_linears_run_the_planned_kernel(kernel: str, gemm_from: int) -> None:
    """A quantized linear runs `Numerics.matmul`'s kernel at every row count in
    batch-invariant mode, and in the default mode below `gemm_from` (so decode and verify
    steps share one kernel); from `gemm_from` rows up the default mode runs a BLAS GEMM on
    the natively dequantized weight: the same product to float32 accuracy."""
    from fx_engine.core.nn import Linear, MatmulPlan, Numerics, Quant, linear

    wq, s, b = _quantized(40, 256, 32, 4)
    lin = Linear(weight=wq, quant=Quant(scales=s, biases=b, group_size=32, bits=4))
    kern = native.qgemm if kernel == "qgemm" else native.qmm
    plan = MatmulPlan(kernel=kernel, gemm_from=gemm_from)
    for bi in (False, True):
        for m in (1, 8, 17, 31, 32, 64):
            x = mx.array(RNG.standard_normal((m, 256)).astype(np.float32))
            got = np.asarray(linear(x, lin, Numerics(native=True, batch_invariant=bi, matmul=plan)))
            if bi or not gemm_from or m < gemm_from:
                assert np.array_equal(got, np.asarray(kern(x, wq, s, b, 32, 4))), (bi, m)
            else:
                ref = _reference(x, wq, s, b, 32, 4)
                np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())
                w = native.dequantize(wq, s, b, 32, 4)
                assert np.array_equal(got, np.asarray(x @ w.T)), m


def test_matmul_plan_rejects_what_it_cannot_run() -> None:
    from fx_engine.core.nn import MatmulPlan

    with pytest.raises(ValueError, match="kernel"):
        MatmulPlan(kernel="blas")
    with pytest.raises(ValueError, match="gemm_from"):
        MatmulPlan(gemm_from=8)  # inside the few-row path: decode and verify would differ


def test_qgemm_and_qmm_differ_by_rounding_only() -> None:
    """Not the same bits (each output is a sequential float32 sum over K in qgemm, 16 lane
    sums then a fixed tree in qmm), but the same product to float32 accuracy: which kernel
    runs depends on the build (fx_engine.core.nn: qgemm where its tiles fit, else qmm)."""
    wq, s, b = _quantized(96, 1536, 32, 4)
    x = mx.array(RNG.standard_normal((32, 1536)).astype(np.float32))
    g, q = np.asarray(native.qgemm(x, wq, s, b, 32, 4)), np.asarray(native.qmm(x, wq, s, b, 32, 4))
    ref = _reference(x, wq, s, b, 32, 4)
    scale = np.abs(ref).max()
    assert np.abs(g - ref).max() < 1e-5 * scale and np.abs(q - ref).max() < 1e-5 * scale
    assert not np.array_equal(g, q)  # two kernels, really


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantize_equals_mlx(bits: int) -> None:
    wq, s, b = _quantized(70, 192, 64, bits)
    assert np.array_equal(np.asarray(native.dequantize(wq, s, b, 64, bits)),
                          np.asarray(mx.dequantize(wq, s, b, group_size=64, bits=bits)))


def test_quantized_argument_errors_name_the_problem() -> None:
    wq, s, b = _quantized(8, 64, 32, 4)
    x = mx.zeros((1, 64))
    with pytest.raises(ValueError, match="bits must be 4, 5, 6 or 8"):
        native.qmm(x, wq, s, b, 32, 3)
    with pytest.raises(ValueError, match="group_size"):
        native.qmm(x, wq, s, b, 48, 4)
    with pytest.raises(ValueError, match="last axis"):
        native.qmm(mx.zeros((1, 32)), wq, s, b, 32, 4)
    with pytest.raises(ValueError, match="scales/biases"):
        native.qmm(x, wq, s[:, :1], b[:, :1], 32, 4)
    with pytest.raises(ValueError, match="uint32"):
        native.dequantize(wq.astype(mx.int32), s, b, 32, 4)
    with pytest.raises(ValueError, match="qgemm: x's last axis"):
        native.qgemm(mx.zeros((1, 32)), wq, s, b, 32, 4)
    with pytest.raises(ValueError, match="qgemm: bits must be 4, 5, 6 or 8"):
        native.qgemm(x, wq, s, b, 32, 3)
    # groups of 16 still need whole 32-value steps (the kernels read K 32 at a time)
    w48, s48 = mx.zeros((4, 12), mx.uint32), mx.ones((4, 3))
    with pytest.raises(ValueError, match="multiple of 32"):
        native.qgemm(mx.ones((1, 48)), w48, s48, s48, 16, 8)


@pytest.mark.parametrize("shape", [(2, 3, 5, 37), (1, 9, 1, 257), (2, 9, 64, 512), (1, 2, 3, 16), (1, 1, 2, 5)])
def test_masked_softmax_matches_reference(shape: tuple[int, int, int, int]) -> None:
    b, h, t, s = shape
    x = mx.array((RNG.standard_normal(shape) * 8).astype(np.float32))
    m = RNG.random((b, t, s)) > 0.4
    m[0, 0] = False  # a fully masked row: uniform, like softmax(where(mask, x, finfo.min))
    mask = mx.array(m)
    x64 = np.where(m[:, None], np.asarray(x).astype(np.float64), -np.inf)
    with np.errstate(invalid="ignore"):  # the fully masked row: -inf - -inf, replaced below
        e = np.exp(x64 - x64.max(-1, keepdims=True, initial=-np.inf, where=m[:, None]))
    ref = np.where(m[:, None], e, 0.0) / np.where(m[:, None], e, 0.0).sum(-1, keepdims=True).clip(1e-300)
    ref[0, :, 0] = 1.0 / s
    got = np.asarray(native.masked_softmax(x, mask))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    fully = np.zeros((b, 1, t, 1), bool)
    fully[0, 0, 0] = True
    assert np.all(got[np.broadcast_to(~m[:, None] & ~fully, got.shape)] == 0.0)  # exact zeros
    mlx_ref = np.asarray(softmax(mx.where(mask[:, None], x, mx.finfo(mx.float32).min)))
    np.testing.assert_allclose(got, mlx_ref, rtol=1e-5, atol=1e-7)


def test_masked_softmax_strided_inputs_and_errors() -> None:
    x = mx.array(RNG.standard_normal((1, 2, 4, 64)).astype(np.float32))
    mask = mx.array(RNG.random((1, 4, 64)) > 0.5)
    got = native.masked_softmax(x[:, :, :, :40], mask[:, :, :40])
    ref = native.masked_softmax(mx.array(np.asarray(x)[:, :, :, :40]), mx.array(np.asarray(mask)[:, :, :40]))
    assert np.array_equal(np.asarray(got), np.asarray(ref))
    with pytest.raises(ValueError, match="mask must be bool"):
        native.masked_softmax(x, mask.astype(mx.int32))
    with pytest.raises(ValueError, match="scores must be float32"):
        native.masked_softmax(x[0], mask)


def test_rms_norm_matches_mlx() -> None:
    x = mx.array(RNG.standard_normal((5, 3, 576)).astype(np.float32) * 3)
    w = mx.array(RNG.standard_normal(576).astype(np.float32))
    np.testing.assert_allclose(np.asarray(native.rms_norm(x, w, 1e-5)),
                               np.asarray(mx.fast.rms_norm(x, w, 1e-5)), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        native.rms_norm(x, w[:10], 1e-5)


@pytest.mark.parametrize("shape", [(8, 2 * 1536), (3, 5, 2 * 37), (1, 2)])
def test_swiglu_is_the_mlx_expression_in_one_node(shape: tuple[int, ...]) -> None:
    """native.swiglu(gu) gives fx_engine.core.nn.swiglu(gate, up)'s bits (the same fast_exp
    arithmetic), close to float64 silu(g) * u; F = 37: a partial vector."""
    from fx_engine.core.nn import Numerics, swiglu, swiglu_fused

    gu = mx.array(RNG.standard_normal(shape).astype(np.float32) * 6)
    f = shape[-1] // 2
    got = native.swiglu(gu)
    assert got.shape == (*shape[:-1], f) and got.dtype == mx.float32
    assert np.array_equal(np.asarray(got), np.asarray(swiglu(gu[..., :f], gu[..., f:])))
    assert np.array_equal(np.asarray(swiglu_fused(gu, Numerics(native=True))), np.asarray(got))
    g, u = (np.asarray(a).astype(np.float64) for a in (gu[..., :f], gu[..., f:]))
    np.testing.assert_allclose(np.asarray(got), g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=1e-6)


def test_swiglu_special_values_dtypes_and_errors() -> None:
    from fx_engine.core.nn import swiglu

    gu = mx.array([[-200.0, -88.0, -87.0, 0.0, 80.0, 100.0, 1.0, 2.0, 3.0, -1.0, 7.0, 0.5],
                   [np.inf, -np.inf, np.nan, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, np.inf, 1.0]],
                  mx.float32)
    got = np.asarray(native.swiglu(gu))
    ref = np.asarray(swiglu(gu[:, :6], gu[:, 6:]))
    assert np.array_equal(got, ref, equal_nan=True)
    assert got[0, 0] == 0.0 and got[0, 4] == 80.0 * 7.0  # silu(-200) = -0, silu(80) = 80
    assert np.isfinite(got[0]).all() and np.isnan(got[1, 2])
    h = native.swiglu(gu.astype(mx.float16))
    assert h.dtype == mx.float16 and h.shape == (2, 6)
    with pytest.raises(ValueError, match="swiglu: gu must be"):
        native.swiglu(mx.zeros((2, 5)))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_kv_put_is_put_along_axis(dtype) -> None:  # noqa: ANN001
    """native.kv_put(cache, new, slots) == mx.put_along_axis(cache, slots[:, None, :, None],
    new, axis=2), with new a strided view (as the models pass it); a cache array the caller
    still holds is never modified (no donation), and out-of-range slots are skipped."""
    cache = mx.array(RNG.standard_normal((3, 2, 9, 16)).astype(np.float32)).astype(dtype)
    before = np.asarray(cache.astype(mx.float32))
    new = mx.array(RNG.standard_normal((3, 4, 2, 16)).astype(np.float32)).transpose(0, 2, 1, 3)
    slots = mx.array([[0, 1, 2, 8], [5, 6, 7, 8], [3, 4, 5, 6]], mx.int32)
    got = native.kv_put(cache, new, slots)
    ref = mx.put_along_axis(cache, slots[:, None, :, None], new.astype(dtype), axis=2)
    assert got.dtype == dtype and got.shape == cache.shape
    assert np.array_equal(np.asarray(got.astype(mx.float32)), np.asarray(ref.astype(mx.float32)))
    assert np.array_equal(np.asarray(cache.astype(mx.float32)), before)  # untouched
    skipped = native.kv_put(cache, new, mx.array([[0, -1, 9, 100]] * 3, mx.int32))
    want = before.copy()
    want[:, :, 0] = np.asarray(new[:, :, 0].astype(dtype).astype(mx.float32))
    assert np.array_equal(np.asarray(skipped.astype(mx.float32)), want)


def test_kv_put_in_a_compiled_step_updates_in_place_and_errors() -> None:
    """Inside mx.compile with the only reference given away, the result reuses the cache's
    buffer (peak memory does not grow by a cache copy per call); bad shapes are errors."""
    cache = mx.zeros((4, 3, 4096, 64))  # 12 MB
    step = mx.compile(lambda c, n, s: native.kv_put(c, n, s))
    new = mx.ones((4, 3, 1, 64))
    for i in range(3):
        cache = step(cache, new, mx.full((4, 1), i, mx.int32))
        mx.eval(cache)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for i in range(3, 8):
        cache = step(cache, new * i, mx.full((4, 1), i, mx.int32))
        mx.eval(cache)
    assert mx.get_peak_memory() - base < 6 * 2**20  # a copy would add 12 MB
    got = np.asarray(cache)
    assert (got[:, :, :8] == np.array([1, 1, 1, 3, 4, 5, 6, 7])[None, None, :, None]).all()
    assert (got[:, :, 8:] == 0).all()
    with pytest.raises(ValueError, match="kv_put: cache must be"):
        native.kv_put(mx.zeros((2, 3, 4)), new, mx.zeros((4, 1), mx.int32))
    with pytest.raises(ValueError, match="kv_put: new must be"):
        native.kv_put(mx.zeros((4, 3, 8, 64)), mx.zeros((4, 2, 1, 64)), mx.zeros((4, 1), mx.int32))
    with pytest.raises(ValueError, match="kv_put: slots must be"):
        native.kv_put(mx.zeros((4, 3, 8, 64)), new, mx.zeros((4, 2), mx.int32))


def test_kernels_inside_compile_do_not_retrace() -> None:
    wq, s, b = _quantized(32, 64, 32, 8)
    traces = []

    def f(x, mask):
        traces.append(1)
        y = native.qmm(native.rms_norm(x, mx.ones((64,)), 1e-6), wq, s, b, 32, 8)
        return native.masked_softmax(y.reshape(1, 1, -1, 32), mask)

    g = mx.compile(f)
    for i in range(4):
        x = mx.array(RNG.standard_normal((3, 64)).astype(np.float32))
        mask = mx.array(RNG.random((1, 3, 32)) > 0.2)
        np.testing.assert_allclose(np.asarray(g(x, mask)), np.asarray(f(x, mask)), rtol=1e-6, atol=1e-7)
    assert len(traces) == 1 + 4  # one trace by compile, four direct calls


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
def test_attend_reads_the_first_mask_slots_of_a_whole_cache(kv_dtype) -> None:  # noqa: ANN001
    """k / v holding more slots than the mask (the whole cache, no span slice in the graph)
    give the bits of the span slices; for one token (decode) and a prefill chunk; flat
    output alike."""
    for t in (1, 20):
        q = mx.array(RNG.standard_normal((2, t, 6, 32)).astype(np.float32))
        kc = mx.array(RNG.standard_normal((2, 3, 90, 32)).astype(np.float32)).astype(kv_dtype)
        vc = mx.array(RNG.standard_normal((2, 3, 90, 32)).astype(np.float32)).astype(kv_dtype)
        mask = mx.array(np.tril(np.ones((t, 50), bool), k=50 - t)[None].repeat(2, 0))
        whole = np.asarray(native.attend(q, kc, vc, mask, 0.2))
        sliced = np.asarray(native.attend(q, kc[:, :, :50], vc[:, :, :50], mask, 0.2))
        assert np.array_equal(whole, sliced)
        flat = native.attend(q, kc, vc, mask, 0.2, flat=True)  # [B*T, Hq*D]: no reshape node
        assert flat.shape == (2 * t, 6 * 32) and np.array_equal(np.asarray(flat), whole.reshape(2 * t, -1))


def _unfused_qkv(qkv, cos, sin, trad, hq, keys, values, slots):  # noqa: ANN001, ANN202
    """qkv_rope_put's definition from the separate ops (as self_attention composed them)."""
    b, t = slots.shape
    hk, d = keys.shape[1], keys.shape[3]
    x = qkv.reshape(b, t, hq + 2 * hk, d)
    qk = native.rope(x[:, :, : hq + hk], cos, sin, trad)
    k = qk[:, :, hq:].transpose(0, 2, 1, 3)
    v = x[:, :, hq + hk:].transpose(0, 2, 1, 3)
    return (qk[:, :, :hq], native.kv_put(keys, k, slots), native.kv_put(values, v, slots))


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("traditional", [False, True])
@pytest.mark.parametrize("b,t,hq,hk,d", [(1, 1, 9, 3, 64), (3, 4, 4, 2, 32), (2, 7, 8, 8, 16)])
def test_qkv_rope_put_is_the_separate_ops(b, t, hq, hk, d, traditional, kv_dtype) -> None:  # noqa: ANN001
    """native.qkv_rope_put gives the bits of reshape + slices + rope + transposes + kv_put
    (float16 caches: astype's rounding), skips out-of-range slots, leaves caches the caller
    holds untouched; float16 conversion edge cases ride in v (not rotated): ties, the
    overflow threshold, subnormals, infinities, NaN."""
    from fx_engine.core.nn import rope_tables

    s_cap = 12
    pos = mx.array(RNG.integers(0, 3000, (b, t)).astype(np.int32))
    cos, sin, _ = rope_tables(pos, d, base=10000.0, scale=1.0, freqs=None, traditional=traditional)
    x = RNG.standard_normal((b * t, (hq + 2 * hk) * d)).astype(np.float32) * 4
    edge = np.array([65519.0, 65520.0, 65535.9, 65536.0, 1e6, -65520.0, 2.0**-25, 2.0**-24 * 1.5,
                     2.0**-24 * 2.5, 2.0**-14 * (1 - 2.0**-11), 2.0**-15 * 3, 1e-9, -3e-8, 6.1e-5,
                     np.inf, -np.inf, np.nan, -0.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, 2049.0, 4097.0],
                    np.float32)
    vals = np.concatenate([edge, (RNG.standard_normal(4096) * 10.0 ** RNG.integers(-9, 6, 4096))
                           .astype(np.float32)])
    v_at = (hq + hk) * d
    x[:, v_at:] = np.resize(vals, (b * t, hk * d))
    qkv = mx.array(x)
    keys = mx.array(RNG.standard_normal((b, hk, s_cap, d)).astype(np.float32)).astype(kv_dtype)
    values = mx.array(RNG.standard_normal((b, hk, s_cap, d)).astype(np.float32)).astype(kv_dtype)
    before = (np.asarray(keys.astype(mx.float32)), np.asarray(values.astype(mx.float32)))
    slots = np.stack([RNG.permutation(s_cap)[:t] for _ in range(b)]).astype(np.int32)
    slots[0, 0] = -1 if t > 1 else slots[0, 0]
    slots[-1, -1] = s_cap if b > 1 else slots[-1, -1]  # both skipped
    slots = mx.array(slots)
    got = native.qkv_rope_put(qkv, cos, sin, traditional, hq, keys, values, slots)
    want = _unfused_qkv(qkv, cos, sin, traditional, hq, keys, values, slots)
    assert [a.shape for a in got] == [(b, t, hq, d), keys.shape, values.shape]
    assert [a.dtype for a in got] == [mx.float32, kv_dtype, kv_dtype]
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert np.array_equal(g.view(np.uint8), w.view(np.uint8))  # bit for bit, NaNs included
    assert np.array_equal(np.asarray(keys.astype(mx.float32)), before[0])  # untouched
    assert np.array_equal(np.asarray(values.astype(mx.float32)), before[1])


def test_qkv_rope_put_in_a_compiled_step_writes_in_place_and_errors() -> None:
    """Inside mx.compile with the caches given away, both results reuse the caches' buffers
    (no cache copy a call); wrong shapes name the argument."""
    from fx_engine.core.nn import rope_tables

    keys, values = mx.zeros((2, 4, 4096, 64)), mx.zeros((2, 4, 4096, 64))  # 8 MB each

    def step(k, v, qkv, pos):  # noqa: ANN001, ANN202
        cos, sin, _ = rope_tables(pos, 64, base=10000.0, scale=1.0, freqs=None, traditional=False)
        return native.qkv_rope_put(qkv, cos, sin, False, 8, k, v, pos)[1:]

    step = mx.compile(step)
    qkv = mx.ones((2, 16 * 64))
    for i in range(3):
        keys, values = step(keys, values, qkv, mx.full((2, 1), i, mx.int32))
        mx.eval(keys, values)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for i in range(3, 8):
        keys, values = step(keys, values, qkv * i, mx.full((2, 1), i, mx.int32))
        mx.eval(keys, values)
    assert mx.get_peak_memory() - base < 4 * 2**20  # a copy would add 8 MB
    v = np.asarray(values)
    assert (v[:, :, :8, 0] == np.array([1, 1, 1, 3, 4, 5, 6, 7])).all() and (v[:, :, 8:] == 0).all()
    cos = sin = mx.zeros((2, 1, 1, 64))
    sl = mx.zeros((2, 1), mx.int32)
    k16 = mx.zeros((2, 4, 8, 64))
    with pytest.raises(ValueError, match="qkv must be"):
        native.qkv_rope_put(mx.zeros((2, 15 * 64)), cos, sin, False, 8, k16, k16, sl)
    with pytest.raises(ValueError, match="q_heads must be"):
        native.qkv_rope_put(qkv, cos, sin, False, 6, k16, k16, sl)
    with pytest.raises(ValueError, match="keys and values must be"):
        native.qkv_rope_put(qkv, cos, sin, False, 8, k16, k16.astype(mx.float16), sl)
    with pytest.raises(ValueError, match="cos and sin must be"):
        native.qkv_rope_put(qkv, cos[:, :, :, :32], sin, False, 8, k16, k16, sl)
    with pytest.raises(ValueError, match="slots must be"):
        native.qkv_rope_put(qkv, cos, sin, False, 8, k16, k16, mx.zeros((3, 1), mx.int32))


@pytest.mark.parametrize("bits", [4, 8])
def test_products_with_an_addend_are_the_separate_add(bits: int) -> None:
    """qmm / qgemm / qmm_a8 (also interleaved) with add=c give c + the product bit for bit,
    for one row, a few and many, leading dims and a strided addend; nn.linear's residual
    takes that path where it can and is the same sum elsewhere; bad addends are errors."""
    from fx_engine.core.kernels import interleave16, interleave16_groups

    wq, s, b = _quantized(48, 128, 32, bits)
    for m in (1, 5, 40):
        x = mx.array(RNG.standard_normal((m, 128)).astype(np.float32))
        c = mx.array(RNG.standard_normal((m, 96)).astype(np.float32))[:, ::2]  # strided
        for op in (native.qmm, native.qgemm, native.qmm_a8):
            assert np.array_equal(np.asarray(op(x, wq, s, b, 32, bits, add=c)), np.asarray(c + op(x, wq, s, b, 32, bits)))
        il = (interleave16(wq), interleave16_groups(s), interleave16_groups(b))
        assert np.array_equal(np.asarray(native.qmm_a8(x, *il, 32, bits, interleaved=True, add=c)),
                              np.asarray(c + native.qmm_a8(x, wq, s, b, 32, bits)))
    x3 = mx.array(RNG.standard_normal((2, 3, 128)).astype(np.float32))
    c3 = mx.array(RNG.standard_normal((2, 3, 48)).astype(np.float32))
    assert np.array_equal(np.asarray(native.qmm(x3, wq, s, b, 32, bits, add=c3)), np.asarray(c3 + native.qmm(x3, wq, s, b, 32, bits)))
    with pytest.raises(ValueError, match="add must be float32 of the product's shape"):
        native.qmm(x3, wq, s, b, 32, bits, add=c3[:, :2])
    with pytest.raises(ValueError, match="add must be float32"):
        native.qmm(x3, wq, s, b, 32, bits, add=c3.astype(mx.float16))


def test_linear_residual_is_residual_plus_linear() -> None:
    from fx_engine.core.nn import Numerics, linear

    m = fx_engine.load()
    lin = m.params.layers[0].down
    x = mx.array(RNG.standard_normal((3, lin.weight.shape[1] * 32 // lin.quant.bits)).astype(np.float32))
    h = mx.array(RNG.standard_normal((3, lin.weight.shape[0])).astype(np.float32))
    for num in (m.params.numerics, Numerics()):  # the native kernels' node, and MLX's ops
        assert np.array_equal(np.asarray(linear(x, lin, num, residual=h)), np.asarray(h + linear(x, lin, num)))


def test_add_rms_norm_is_the_add_and_the_norm() -> None:
    from fx_engine.core.nn import Numerics, add_rms_norm

    h = mx.array(RNG.standard_normal((3, 2, 576)).astype(np.float32) * 3)
    a = mx.array(RNG.standard_normal((3, 2, 576)).astype(np.float32))
    w = mx.array(RNG.standard_normal(576).astype(np.float32))
    s, y = native.add_rms_norm(h, a, w, 1e-5)
    assert np.array_equal(np.asarray(s), np.asarray(h + a))
    assert np.array_equal(np.asarray(y), np.asarray(native.rms_norm(h + a, w, 1e-5)))
    s2, y2 = add_rms_norm(h, a, w, 1e-5, Numerics(native=True))  # the model-facing op
    assert np.array_equal(np.asarray(s2), np.asarray(s)) and np.array_equal(np.asarray(y2), np.asarray(y))
    with pytest.raises(ValueError, match="one shape"):
        native.add_rms_norm(h, a[:1], w, 1e-5)
    with pytest.raises(ValueError, match="weight must be"):
        native.add_rms_norm(h, a, w[:5], 1e-5)


@pytest.mark.parametrize("numerics,kv_dtype", [("exact", "float32"), ("int8", "float16")])
def test_fused_layer_nodes_give_the_separate_ops_bits(numerics, kv_dtype, monkeypatch) -> None:  # noqa: ANN001
    """The default model's prefill and decode steps with the fused attention-input, add +
    norm and product + residual nodes against the same steps traced with the separate ops:
    the same logits, tokens and cache bit for bit."""
    from fx_engine.core import nn
    from fx_engine.core.models import blocks
    from fx_engine.core.steps import decode_step, prefill_step
    from fx_engine.core.tree import CompiledFunction

    m = fx_engine.load(numerics=numerics, kv_dtype=kv_dtype)
    ids = [list(range(100, 140)), list(range(300, 340))]

    def run():  # noqa: ANN202
        pre, dec = CompiledFunction(prefill_step), CompiledFunction(decode_step)
        logits, cache, state = fx_engine.prefill(m, ids, room=64)
        out = [logits]
        for _ in range(4):
            state, cache = dec(m.params, cache, state)
            out.append(state.tokens)
        more, cache = pre(m.params, cache, mx.array([[5, 6, 7]] * 2), mx.array([3, 2]))
        out += [more, cache.layers[3].keys, cache.layers[3].values]
        mx.eval(out)
        return [np.asarray(a) for a in out]

    calls: list[int] = []
    write = blocks.write_rotated_entry
    monkeypatch.setattr(blocks, "write_rotated_entry", lambda *a: calls.append(1) or write(*a))
    fused = run()
    assert calls  # the fused path ran
    monkeypatch.setattr(blocks, "fused_write", lambda *a: False)
    monkeypatch.setattr(blocks, "add_rms_norm",
                        lambda h, a, w, eps, num=None: (h + a, nn.rms_norm(h + a, w, eps, num)))
    mlp = blocks.swiglu_mlp
    monkeypatch.setattr(blocks, "swiglu_mlp", lambda x, gu, down, num, residual=None: (
        mlp(x, gu, down, num) if residual is None else residual + mlp(x, gu, down, num)))
    separate = run()
    for f, s in zip(fused, separate):
        assert np.array_equal(f.view(np.uint8), s.view(np.uint8))


def test_default_model_native_and_mlx_paths_agree() -> None:
    """The default model (Q4_1/Q8_0 GGUF) kept quantized with the native kernels against
    the same weights dequantized to float32 on MLX's own ops: same greedy answer, logits
    within float32 noise of two summation orders."""
    nat = fx_engine.load(native=True)
    ref = fx_engine.load(native=False)
    assert nat.params.numerics.native and not ref.params.numerics.native
    assert "4-bit" in nat.weight_format and "float32" in ref.weight_format
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    a = fx_engine.generate(nat, msgs, max_tokens=12)
    b = fx_engine.generate(ref, msgs, max_tokens=12)
    assert a.token_ids == b.token_ids
    assert "Paris" in a.text
    ids = list(nat.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8))
    la = np.asarray(scoring.logits(nat, ids))
    lb = np.asarray(scoring.logits(ref, ids))
    assert la.shape == lb.shape == (len(ids), nat.config.vocab_size)
    assert np.array_equal(la.argmax(-1), lb.argmax(-1))
    assert np.abs(la - lb).max() < 2e-3 * np.abs(lb).max()


def test_native_off_by_environment(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FX_ENGINE_NATIVE", "0")
    assert native.ensure() is None
    monkeypatch.setenv("FX_ENGINE_NATIVE", "auto")
    assert native.ensure() is not None


def test_ops_never_build_and_say_what_to_do(monkeypatch) -> None:  # noqa: ANN001
    """The pure core calls the ops; they never build or load the extension themselves."""
    from fx_engine.core import kernels

    monkeypatch.setattr(kernels, "_EXTENSION", [])
    with pytest.raises(RuntimeError, match=r"native.ensure\(\) first"):
        native.rms_norm(mx.ones((2, 16)), mx.ones((16,)), 1e-5)


def _attention_reference(q, k, v, mask, scale):  # float64 numpy GQA attention
    q, k, v = (np.asarray(a).astype(np.float64) for a in (q, k, v))
    m = np.asarray(mask)
    b, t, hq, d = q.shape
    hk = k.shape[1]
    rep = hq // hk
    out = np.zeros((b, t, hq, d))
    for bi in range(b):
        for h in range(hq):
            s = (q[bi, :, h] * scale) @ k[bi, h // rep].T  # [T, S]
            s = np.where(m[bi], s, -np.inf)
            for ti in range(t):
                if not m[bi, ti].any():
                    p = np.full(s.shape[1], 1.0 / s.shape[1])
                else:
                    p = np.exp(s[ti] - s[ti].max())
                    p /= p.sum()
                out[bi, ti, h] = p @ v[bi, h // rep]
    return out.reshape(b, t, hq * d)


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("b,t,hq,hk,s,d", [(1, 1, 9, 3, 300, 64), (3, 2, 4, 4, 64, 32),
                                           (2, 5, 8, 2, 37, 16), (1, 3, 6, 3, 130, 128),
                                           # > 16 query tokens: the prefill kernel (blocks
                                           # of 16 tokens, partial tiles of rows and keys)
                                           (1, 17, 9, 3, 300, 64), (2, 40, 4, 2, 64, 32),
                                           (1, 100, 6, 3, 130, 128), (3, 33, 8, 8, 70, 16)])
def test_attend_matches_float64_reference(b, t, hq, hk, s, d, kv_dtype) -> None:  # noqa: ANN001
    # A float16 cache (Model.kv_dtype): the reference runs on the same float16 values.
    cap = s + 20  # k/v as span slices of a larger cache: strided views, read in place
    q = mx.array(RNG.standard_normal((b, t, hq, d)).astype(np.float32))
    kc = mx.array(RNG.standard_normal((b, hk, cap, d)).astype(np.float32)).astype(kv_dtype)
    vc = mx.array(RNG.standard_normal((b, hk, cap, d)).astype(np.float32)).astype(kv_dtype)
    lengths = RNG.integers(1, s - t + 1, b)
    mask = np.zeros((b, t, s), bool)
    for bi in range(b):
        for ti in range(t):
            mask[bi, ti, : lengths[bi] + ti + 1] = True
    mask[0, 0, 0] = False  # a hole inside the visible range
    if b > 1:
        mask[1, :] = False  # a fully masked row (inactive): uniform, as the MLX path gives
    got = np.asarray(native.attend(q, kc[:, :, :s], vc[:, :, :s], mx.array(mask), d**-0.5))
    ref = _attention_reference(q, kc[:, :, :s], vc[:, :, :s], mask, d**-0.5)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)


def test_attend_row_is_independent_of_span_and_batch() -> None:
    """Bitwise: a row's output does not depend on the span (slots past its mask are not
    read) or on the other rows of the batch."""
    q = mx.array(RNG.standard_normal((3, 1, 9, 64)).astype(np.float32))
    kc = mx.array(RNG.standard_normal((3, 3, 600, 64)).astype(np.float32))
    vc = mx.array(RNG.standard_normal((3, 3, 600, 64)).astype(np.float32))
    lengths = [100, 257, 513]

    def run(rows, span):
        m = np.zeros((len(rows), 1, span), bool)
        for i, r in enumerate(rows):
            m[i, 0, : lengths[r] + 1] = True
        return np.asarray(native.attend(q[rows], kc[rows][:, :, :span], vc[rows][:, :, :span],
                                        mx.array(m), 0.125))

    alone = run([0], 256)
    assert np.array_equal(alone[0], run([0], 512)[0])
    assert np.array_equal(alone[0], run([0, 1, 2], 576)[0])
    assert np.array_equal(run([1], 512)[0], run([2, 1], 576)[1])


@pytest.mark.parametrize("kv_dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("t,hq,hk", [(1, 9, 3), (3, 10, 2), (2, 5, 1), (1, 16, 2)])
def test_attend_row_alone_gives_its_bits_among_others(t, hq, hk, kv_dtype) -> None:  # noqa: ANN001
    """A row alone (a model with few KV heads: fewer work items than threads) gives the bits
    it gets among other rows, for decode and verify-sized steps, with rows that end inside a
    block of keys and a hole in a mask."""
    b, s, d = 4, 700, 64
    q = mx.array(RNG.standard_normal((b, t, hq, d)).astype(np.float32))
    kc = mx.array(RNG.standard_normal((b, hk, s, d)).astype(np.float32)).astype(kv_dtype)
    vc = mx.array(RNG.standard_normal((b, hk, s, d)).astype(np.float32)).astype(kv_dtype)
    m = np.zeros((b, t, s), bool)
    for i, n in enumerate([300, 641, 257, 600]):
        for ti in range(t):
            m[i, ti, : n + ti] = True
    m[3, 0, 5] = False  # a hole
    whole = np.asarray(native.attend(q, kc, vc, mx.array(m), 0.125))
    for i in range(b):
        alone = np.asarray(native.attend(q[i:i + 1], kc[i:i + 1], vc[i:i + 1], mx.array(m[i:i + 1]), 0.125))
        assert np.array_equal(alone[0], whole[i]), i


def test_attend_prefill_rows_are_independent_of_the_chunk() -> None:
    """Bitwise, for chunks of more than 16 tokens (the prefill kernel): a query row's output
    is the same in a chunk of 48 tokens as in the two chunks of 24 that cover it (same
    cache, the mask moved along), at a larger span, and with another thread count."""
    b, hq, hk, d, cap = 2, 9, 3, 64, 200
    q = mx.array(RNG.standard_normal((b, 48, hq, d)).astype(np.float32))
    kc = mx.array(RNG.standard_normal((b, hk, cap, d)).astype(np.float32))
    vc = mx.array(RNG.standard_normal((b, hk, cap, d)).astype(np.float32))
    start = [10, 57]

    def run(t0, t1, span):
        m = np.zeros((b, t1 - t0, span), bool)
        for bi in range(b):
            for t in range(t0, t1):
                m[bi, t - t0, : start[bi] + t + 1] = True
        return np.asarray(native.attend(q[:, t0:t1], kc[:, :, :span], vc[:, :, :span],
                                        mx.array(m), d**-0.5))

    whole = run(0, 48, 128)
    halves = np.concatenate([run(0, 24, 128), run(24, 48, 128)], axis=1)
    assert np.array_equal(whole, halves)
    assert np.array_equal(whole, run(0, 48, 200))
    mod = native._module()
    threads = mod.num_threads()
    try:
        mod.set_num_threads(1)
        assert np.array_equal(whole, run(0, 48, 128))
    finally:
        mod.set_num_threads(threads)
    # A few tokens go through the decode kernel: the same values, another summation order.
    np.testing.assert_allclose(run(0, 8, 128), whole[:, :8], rtol=1e-5, atol=1e-6)


def test_attend_argument_errors() -> None:
    q = mx.zeros((1, 1, 4, 64))
    k = mx.zeros((1, 2, 8, 64))
    m = mx.ones((1, 1, 8), mx.bool_)
    with pytest.raises(ValueError, match="mask must be bool"):
        native.attend(q, k, k, mx.ones((1, 1, 9), mx.bool_), 1.0)  # more slots than k holds
    with pytest.raises(ValueError, match="multiple of Hk"):
        native.attend(mx.zeros((1, 1, 3, 64)), k, k, m, 1.0)
    with pytest.raises(ValueError, match="head_dim"):
        native.attend(mx.zeros((1, 1, 4, 8)), mx.zeros((1, 2, 8, 8)), mx.zeros((1, 2, 8, 8)), m, 1.0)
    with pytest.raises(ValueError, match="float32"):
        native.attend(q.astype(mx.float16), k, k, m, 1.0)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        native.attend(q, k.astype(mx.float16), k, m, 1.0)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        native.attend(q, k.astype(mx.bfloat16), k.astype(mx.bfloat16), m, 1.0)


def test_attend_reads_float16_special_values_exactly() -> None:
    """float16 K/V are converted exactly: subnormals, zeros of both signs, the extremes
    (checked against numpy's own float16 -> float64 conversion), through a one-key row
    whose output is V itself."""
    vals = np.array([0.0, -0.0, 6e-8, -6e-8, 3e-5, 1e-4, 65504.0, -65504.0, 1.0, -2.5, 0.1,
                     5.96e-8, 6.1e-5, 1234.5, -0.333, 7.0], np.float16)
    v = np.tile(vals, 4).reshape(1, 1, 1, 64)
    q = mx.zeros((1, 1, 1, 64))
    out = np.asarray(native.attend(q, mx.array(v), mx.array(v), mx.ones((1, 1, 1), mx.bool_), 1.0))
    assert np.array_equal(out.reshape(64), v.reshape(64).astype(np.float32))


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_the_permutation_form(traditional: bool) -> None:
    from fx_engine.core.nn import apply_rope, rope_tables

    pos = mx.array(RNG.integers(0, 5000, (2, 3)).astype(np.int32))
    cos, sin, perm = rope_tables(pos, 64, base=10000.0, scale=1.0, freqs=None, traditional=traditional)
    x = mx.array(RNG.standard_normal((2, 3, 12, 64)).astype(np.float32))[:, :, :7]  # strided
    ref = np.asarray(apply_rope(x, cos, sin, perm))
    got = np.asarray(native.rope(x, cos, sin, traditional))
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="cos and sin"):
        native.rope(x, cos[:, :1], sin, traditional)


def test_edge_cases_empty_inputs_and_all_minus_inf_rows() -> None:
    wq, s, b = _quantized(8, 64, 32, 4)
    assert native.qmm(mx.zeros((0, 64)), wq, s, b, 32, 4).shape == (0, 8)
    assert native.qgemm(mx.zeros((0, 64)), wq, s, b, 32, 4).shape == (0, 8)
    assert native.rms_norm(mx.zeros((0, 16)), mx.ones((16,)), 1e-5).shape == (0, 16)
    with pytest.raises(ValueError, match="D > 0"):
        native.rms_norm(mx.zeros((2, 0)), mx.zeros((0,)), 1e-5)
    with pytest.raises(ValueError, match="multiple of Hk"):
        native.attend(mx.zeros((1, 1, 4, 16)), mx.zeros((1, 0, 8, 16)), mx.zeros((1, 0, 8, 16)),
                      mx.ones((1, 1, 8), mx.bool_), 1.0)
    # Rows whose visible scores are all -inf: as softmax(where(mask, x, finfo.min)).
    for x, m in [([-np.inf] * 20, [0, 0, 0, 1] + [0] * 16), ([-np.inf] + [1.0] * 19, [1] + [0] * 19)]:
        xa = mx.array(np.array(x, np.float32).reshape(1, 1, 1, 20))
        ma = mx.array(np.array(m, bool).reshape(1, 1, 20))
        ref = softmax(mx.where(ma[:, None], xa, mx.finfo(mx.float32).min))
        np.testing.assert_allclose(np.asarray(native.masked_softmax(xa, ma)), np.asarray(ref), atol=1e-7)


# ---------------------------------------------------------------- 8-bit activations
def _a8_reference(x: mx.array, wq, s, b, gs: int, bits: int) -> np.ndarray:
    """qmm_a8's definition in numpy: each row of x rounded per group of gs values
    (d = amax / 127 and xq = rint(x * (127 / amax)), both in float32, as llama.cpp's Q8
    blocks), then the exact product of the rounded values with the dequantized weight."""
    w = np.asarray(mx.dequantize(wq, s, b, group_size=gs, bits=bits)).astype(np.float64)
    x = np.asarray(x, np.float32)
    m, k = x.shape
    xg = x.reshape(m, k // gs, gs)
    amax = np.abs(xg).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)),
                   np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(xg * inv), -127, 127)
    d = (amax / np.float32(127)).astype(np.float32)
    return (q * d.astype(np.float64)).reshape(m, k) @ w.T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 17, 40])
def test_qmm_a8_matches_its_float64_definition(bits: int, gs: int, m: int) -> None:
    # m <= 8: the few-row path (VNNI builds; else 8-row tiles); more: 16-row tiles
    # (partial ones at 9, 17, 40); n = 37: not a
    # multiple of the 12-feature tile.
    n, k = 37, 256
    wq, s, b = _quantized(n, k, gs, bits)
    x = mx.array(RNG.standard_normal((m, k)).astype(np.float32) * 3)
    x[0, :gs] = 0.0  # a group of zeros (amax 0): contributes exactly nothing
    got = np.asarray(native.qmm_a8(x, wq, s, b, gs, bits))
    ref = _a8_reference(x, wq, s, b, gs, bits)
    assert got.shape == (m, n) and got.dtype == np.float32
    # Only the per-group float32 combination rounds (the integer dot products are exact).
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # ... and that really is another product than the float32 one (8-bit rounding of x).
    assert np.abs(got - _reference(x, wq, s, b, gs, bits)).max() > 1e-4 * np.abs(ref).max()


def test_qmm_a8_is_batch_and_tile_invariant() -> None:
    """Integer sums are exact and each lane runs the same float32 operations, so a row's
    output is bitwise the same alone (the few-row path), in any batch (16-row tiles), at any
    position, and with any thread count."""
    wq, s, b = _quantized(200, 576, 32, 4)
    x = mx.array(RNG.standard_normal((70, 576)).astype(np.float32))
    full = np.asarray(native.qmm_a8(x, wq, s, b, 32, 4))
    for i, rows in [(0, slice(0, 1)), (5, slice(5, 6)), (5, slice(3, 10)), (39, slice(30, 40)),
                    (45, slice(17, 70)), (69, slice(0, 70, 3)), (7, slice(0, 8))]:
        part = np.asarray(native.qmm_a8(x[rows], wq, s, b, 32, 4))
        assert np.array_equal(part[(i - rows.start) // (rows.step or 1)], full[i])
    mod = native._module()
    threads = mod.num_threads()
    try:
        mod.set_num_threads(1)
        single = np.asarray(native.qmm_a8(x, wq, s, b, 32, 4))
    finally:
        mod.set_num_threads(threads)
    assert np.array_equal(single, full)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("n", [37, 200])
def test_qmm_a8_few_rows_give_the_tiles_bits(bits: int, gs: int, n: int) -> None:
    """Up to 32 rows run the few-row path on AVX-512 VNNI builds (vectors along 16
    features, a dot product per row against each weight quad; in passes of 8 rows over each
    block, the last pass partial), more rows the 16-row tiles: every row count from 1 to 32
    gives the tiles' bits. n = 37 and 200: partial last feature blocks; 200 x 640 also
    splits over several pool chunks; gs = 64, 128: several 32-k steps per group; 20, 10 or
    5 groups: every branch of the scale transposition."""
    if not native.int8_dot():
        pytest.skip("no AVX-512 VNNI: qmm_a8 has no few-row path on this build")
    wq, s, b = _quantized(n, 640, gs, bits)
    x = mx.array(RNG.standard_normal((48, 640)).astype(np.float32) * 2)
    full = np.asarray(native.qmm_a8(x, wq, s, b, gs, bits))
    for m in range(1, 33):
        part = np.asarray(native.qmm_a8(x[5 : 5 + m], wq, s, b, gs, bits))
        assert np.array_equal(part, full[5 : 5 + m]), m


@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 32), (8, 16), (5, 32), (6, 16), (6, 32)])
def test_qmm_a8_few_row_passes_give_the_tiles_bits_interleaved(bits: int, gs: int) -> None:
    """The 8-bit mode's layouts (interleaved 4-/8-bit blocks, 5-/6-bit planes with their
    interleaved scales): every row count the few-row passes take (1-32, 8 rows a pass)
    gives the bits of the 16-row tiles (48 rows), float16 scales as GGUF files store them."""
    from fx_engine.core import kernels

    if not native.int8_dot():
        pytest.skip("no AVX-512 VNNI: qmm_a8 has no few-row path on this build")
    if bits in (5, 6) and not kernels.il_planes():
        pytest.skip("no planes layout on this build")
    n, k = 64, 512
    q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
    wq = _stream(q, bits)
    il = kernels.interleave16_planes(wq, bits) if bits in (5, 6) else kernels.interleave16(wq)
    s = kernels.interleave16_groups(mx.array(RNG.uniform(0.001, 0.02, (n, k // gs)).astype(np.float16)))
    b = kernels.interleave16_groups(mx.array(RNG.uniform(-1, 1, (n, k // gs)).astype(np.float16)))
    x = mx.array(RNG.standard_normal((48, k)).astype(np.float32))
    full = np.asarray(native.qmm_a8(x, il, s, b, gs, bits, interleaved=True))
    for m in range(1, 33):
        part = np.asarray(native.qmm_a8(x[7 : 7 + m], il, s, b, gs, bits, interleaved=True))
        assert np.array_equal(part, full[7 : 7 + m]), m


def test_qmm_a8_inputs_and_errors() -> None:
    wq, s, b = _quantized(64, 128, 32, 8)
    x = mx.array(RNG.standard_normal((2, 3, 256)).astype(np.float32))
    xs = x[:, :, ::2]  # not contiguous
    got = np.asarray(native.qmm_a8(xs, wq, s, b, 32, 8))
    ref = _a8_reference(xs.reshape(-1, 128), wq, s, b, 32, 8).reshape(2, 3, 64)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)
    assert native.qmm_a8(mx.zeros((0, 128)), wq, s, b, 32, 8).shape == (0, 64)
    assert isinstance(native.int8_dot(), bool)
    with pytest.raises(ValueError, match="qmm_a8: x's last axis"):
        native.qmm_a8(mx.zeros((1, 32)), wq, s, b, 32, 8)
    with pytest.raises(ValueError, match="qmm_a8: bits must be 4, 5, 6 or 8"):
        native.qmm_a8(mx.zeros((1, 128)), wq, s, b, 32, 3)


def test_activation_bits_run_six_bit_weights_packed(tmp_path) -> None:
    """In the 8-bit mode a Q4_K_M file's 6-bit tensors (Q6_K: attn_v, ffn_down, the tied
    head: ~30% of a 1B decode step) stay packed and run qmm_a8 too, unpacked to bytes a block
    of rows at a time, activations rounded per group of 16. Oracle: the same integers stored
    as 8 bits (a format qmm_a8 always ran), whose exact integer sums give the same bits; the
    8-bit mode's logits are also close to the float32 numerics'."""
    import sys
    from pathlib import Path

    import attrs

    from fx_engine.core.adapters import map_linears
    from fx_engine.core.nn import linears, row_major

    tools = Path(__file__).resolve().parents[2] / "tools"
    sys.path.insert(0, str(tools))
    try:
        import synth_gguf as sg
    finally:
        sys.path.pop(0)
    shape = sg.Shape("tiny", 256, 2, 512, 4, 2, 49152, tied=True, arch="llama")
    path = sg.write_file(tmp_path / "q4km.gguf", shape, "Q4_K_M")
    a8 = fx_engine.load(path, activation_bits=8)
    six = [lin for lin in linears(a8.params) if lin.quantized and lin.quant.bits == 6]
    assert six and {lin.quant.group_size for lin in six} == {16}, [(lin.quant.bits, lin.quant.group_size) for lin in six]

    def widen(_: int, lin):  # noqa: ANN001
        if not (lin.quantized and lin.quant.bits == 6):
            return lin
        lin = row_major(lin)  # (the planes layout, where the build reads 6-bit weights so)
        raw = np.asarray(lin.weight).view(np.uint8)
        q = np.packbits(np.unpackbits(raw, axis=-1, bitorder="little").reshape(*raw.shape[:-1], -1, 6),
                        axis=-1, bitorder="little")[..., 0].astype(np.uint32)  # MLX's LSB-first stream
        return attrs.evolve(lin, weight=_stream(q, 8)).with_quant(bits=8)

    wide = attrs.evolve(a8, params=map_linears(a8.params, widen))
    assert 6 not in {lin.quant.bits for lin in linears(wide.params) if lin.quantized}
    ids = list(range(5, 40))
    for chunk in (1, 16):
        assert np.array_equal(np.asarray(scoring.logits(a8, ids, chunk=chunk)),
                              np.asarray(scoring.logits(wide, ids, chunk=chunk)))
    f32 = np.asarray(scoring.logits(fx_engine.load(path), ids))
    la = np.asarray(scoring.logits(a8, ids))
    assert np.abs(la - f32).max() <= 0.05 * np.abs(f32).max(), np.abs(la - f32).max()


@pytest.mark.real_model
@pytest.mark.slow
def test_activation_bits_model_option() -> None:
    """load(activation_bits=8): every 4-/8-bit matmul of the default model runs qmm_a8;
    its next-token distributions stay close to the float32 mode's (rounding x to 8 bits
    per 32 values: KL ~2e-3 on this text, logits off by ~0.2 on average) and the argmax is
    the same wherever the float32 mode's top two logits are clearly apart."""
    a8 = fx_engine.load(activation_bits=8)
    f32 = fx_engine.load()
    assert a8.params.numerics.activation_bits == 8 and f32.params.numerics.activation_bits is None
    ids = list(a8.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8))
    la, lf = np.asarray(scoring.logits(a8, ids)), np.asarray(scoring.logits(f32, ids))
    assert not np.array_equal(la, lf)

    def log_softmax(z: np.ndarray) -> np.ndarray:
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    pf = log_softmax(lf)
    kl = (np.exp(pf) * (pf - log_softmax(la))).sum(-1)
    assert kl.mean() < 1e-2 and kl.max() < 0.1, (kl.mean(), kl.max())
    top = np.sort(lf, -1)
    clear = (top[:, -1] - top[:, -2]) > 1.0
    assert clear.sum() > len(ids) // 2
    assert np.array_equal(la.argmax(-1)[clear], lf.argmax(-1)[clear])
    # (Not "Paris" here: the first answer token of this chat is a near tie, 0.08 apart in
    # float32, which 8-bit activations flip to "L'Étoile", llama.cpp's answer too.)
    msgs = [{"role": "user", "content": "Name the largest planet of the solar system."}]
    out = fx_engine.generate(a8, msgs, max_tokens=12)
    assert out.text.startswith("The largest planet") and len(out.token_ids) == 12
    with pytest.raises(ValueError, match="activation_bits must be None or 8"):
        fx_engine.load(activation_bits=4)
    with pytest.raises(ValueError, match="numerics=.int8. needs"):
        fx_engine.load(activation_bits=8, native=False)


_PORTABLE_RUN = r"""
import sys, importlib.util
import numpy as np
import mlx.core as mx
spec = importlib.util.spec_from_file_location("_fx_native", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
d = np.load(sys.argv[2])
outs = {}
for bits in (4, 8):
    wq, s, b = (mx.array(d[f"{n}{bits}"]) for n in ("w", "s", "b"))
    x = mx.array(d["x"])
    outs[f"a8_{bits}"] = np.asarray(mod.qmm_a8(x, wq, s, b, 32, bits))
    for m in range(1, 11):  # every row count of one 8-row pass (and of a second one)
        outs[f"a8_{m}_{bits}"] = np.asarray(mod.qmm_a8(x[1 : 1 + m], wq, s, b, 32, bits))
    outs[f"qmm_{bits}"] = np.asarray(mod.qmm(x, wq, s, b, 32, bits))
    x40 = mx.concatenate([x] * 4)[:40]  # qgemm's many-row tiles
    outs[f"qgemm40_{bits}"] = np.asarray(mod.qgemm(x40, wq, s, b, 32, bits))
    outs[f"qmm40_{bits}"] = np.asarray(mod.qmm(x40, wq, s, b, 32, bits))
    for m in range(1, 17):  # its few-row path, 8 rows per pass over the weights
        outs[f"qgemm{m}_{bits}"] = np.asarray(mod.qgemm(x40[:m], wq, s, b, 32, bits))
        outs[f"qmm{m}_{bits}"] = np.asarray(mod.qmm(x40[:m], wq, s, b, 32, bits))
wq, s, b = (mx.array(d[n]) for n in ("w16", "s16", "b16"))  # 8 bits in groups of 16
x40 = mx.concatenate([mx.array(d["x"])] * 4)[:40]
outs["qgemm40_g16"] = np.asarray(mod.qgemm(x40, wq, s, b, 16, 8))
outs["qmm_g16"] = np.asarray(mod.qmm(x40, wq, s, b, 16, 8))
for m in range(1, 17):
    outs[f"qgemm{m}_g16"] = np.asarray(mod.qgemm(x40[:m], wq, s, b, 16, 8))
    outs[f"qmm{m}_g16"] = np.asarray(mod.qmm(x40[:m], wq, s, b, 16, 8))
for bits in (4, 8):  # the interleaved layout: the row-major weight's bits, every row count
    wi, si, bi, ii, isi, ibi = (mx.array(d[f"{n}{bits}"]) for n in ("wi", "si", "bi", "ii", "isi", "ibi"))
    xi = mx.concatenate([mx.array(d["x"])] * 4)[:40]
    for m in (1, 2, 3, 5, 8, 9, 40):
        outs[f"il{m}_{bits}"] = np.asarray(mod.qmm_a8(xi[:m], ii, isi, ibi, 32, bits, interleaved=True))
        outs[f"ro{m}_{bits}"] = np.asarray(mod.qmm_a8(xi[:m], wi, si, bi, 32, bits))
        for dt in ("float16", "bfloat16"):  # stored scales, converted as the kernel reads them
            t = getattr(mx, dt)
            outs[f"il{m}_{bits}_{dt}"] = np.asarray(mod.qmm_a8(xi[:m], ii, isi.astype(t), ibi.astype(t), 32,
                                                               bits, interleaved=True))
            outs[f"ro{m}_{bits}_{dt}"] = np.asarray(mod.qmm_a8(xi[:m], wi, si.astype(t), bi.astype(t), 32, bits))
x512 = mx.array(d["x512"])
for key in d["il_forms"]:  # compact scales; planes; other group sizes (IL_FORMS)
    bits, gs = int(d[f"{key}_bits"]), int(d[f"{key}_gs"])
    w, s_, b_, iw, is_, ib_ = (mx.array(d[f"{key}_{n}"]) for n in ("w", "s", "b", "iw", "is", "ib"))
    outs[f"planes_{key}"] = bool(getattr(mod, "il_planes", False)) or bits in (4, 8)
    for m in (1, 2, 3, 5, 8, 9, 40):
        outs[f"ro_{key}_{m}"] = np.asarray(mod.qmm_a8(x512[:m], w, s_, b_, gs, bits))
        if outs[f"planes_{key}"]:
            outs[f"il_{key}_{m}"] = np.asarray(mod.qmm_a8(x512[:m], iw, is_, ib_, gs, bits, interleaved=True))
for m in (1, 3, 9, 40):  # 8-bit activations rounded per group of 16 (a Q6_K head)
    outs[f"a8_{m}_g16"] = np.asarray(mod.qmm_a8(x40[:m], wq, s, b, 16, 8))
same = []  # compact scales (float16, two-level) against their float32 values: the same bits
for fmt in ("h", "kq"):
    cs, cb = mx.array(d[f"{fmt}_s"]), mx.array(d[f"{fmt}_b"])
    fs, fb = mx.array(d[f"{fmt}_fs"]), mx.array(d[f"{fmt}_fb"])
    wq = mx.array(d["w512"])  # 29 rows of 512: 16 groups, super-blocks of 8 (the vector decode)
    for m in (1, 3, 9, 40):
        xm = mx.array(d["x512"])[:m]
        for op in (mod.qmm, mod.qgemm, mod.qmm_a8):
            same.append(np.array_equal(np.asarray(op(xm, wq, cs, cb, 32, 4)), np.asarray(op(xm, wq, fs, fb, 32, 4))))
    same.append(np.array_equal(np.asarray(mod.dequantize(wq, cs, cb, 32, 4)), np.asarray(mod.dequantize(wq, fs, fb, 32, 4))))
for bits in (5, 6):  # unpacked to bytes (AVX2 shuffles / a loop), against the 8-bit bits
    wp, w8 = mx.array(d[f"p{bits}"]), mx.array(d[f"p{bits}_8"])
    s32, b32 = mx.array(d["kq_fs"]), mx.array(d["kq_fb"])
    ks, kb = mx.array(d["kq_s"]), mx.array(d["kq_b"])
    for m in (1, 3, 9, 40):
        xm = mx.array(d["x512"])[:m]
        for op in (mod.qmm, mod.qgemm, mod.qmm_a8):
            same.append(np.array_equal(np.asarray(op(xm, wp, s32, b32, 32, bits)), np.asarray(op(xm, w8, s32, b32, 32, 8))))
            # two-level scales on 5-/6-bit values (the float kernels dequantize with one FMA:
            # Quant::fma_exact) against their float32 values on the 8-bit bytes (a multiply
            # and an add)
            same.append(np.array_equal(np.asarray(op(xm, wp, ks, kb, 32, bits)), np.asarray(op(xm, w8, s32, b32, 32, 8))))
    same.append(np.array_equal(np.asarray(mod.dequantize(wp, s32, b32, 32, bits)), np.asarray(mod.dequantize(w8, s32, b32, 32, 8))))
w8 = mx.array(d["p6_8"])  # 8-bit weights with float16 scales (one FMA) against float32 ones
hs, hb, hfs, hfb = (mx.array(d[k]) for k in ("h_s", "h_b", "h_fs", "h_fb"))
for m in (1, 3, 9, 40):
    xm = mx.array(d["x512"])[:m]
    for op in (mod.qmm, mod.qgemm, mod.qmm_a8):
        same.append(np.array_equal(np.asarray(op(xm, w8, hs, hb, 32, 8)), np.asarray(op(xm, w8, hfs, hfb, 32, 8))))
same.append(np.array_equal(np.asarray(mod.dequantize(w8, hs, hb, 32, 8)), np.asarray(mod.dequantize(w8, hfs, hfb, 32, 8))))
outs["compact_same"] = np.array(same)
outs["isa"] = np.array(mod.isa)
outs["few_gemm"] = np.array(mod.few_gemm)
q, kv = mx.array(d["q"]), mx.array(d["kv"]).astype(mx.float16)
outs["attend16"] = np.asarray(mod.attend(q, kv, kv, mx.ones((1, 1, 40), mx.bool_), 0.125))
outs["softmax"] = np.asarray(mod.masked_softmax(mx.array(d["sm_x"]), mx.array(d["sm_m"])))
causal = mx.array(np.tril(np.ones((40, 40), bool))[None])  # 40 query tokens: the prefill kernel
for name, cache in (("attend_pre", mx.array(d["kv"])), ("attend_pre16", kv)):
    outs[name] = np.asarray(mod.attend(mx.array(d["qp"]), cache, cache, causal, 0.125))
cache = mx.zeros((1, 2, 5, 16), mx.float16)  # the fused attention inputs (its float16 rounding)
for i, a in enumerate(mod.qkv_rope_put(mx.array(d["qkv"]), mx.array(d["cos"]), mx.array(d["sin"]), False, 4,
                                       cache, cache, mx.array([[0, 4, 2]]))):
    outs[f"qkv_put{i}"] = np.asarray(a.astype(mx.float32))
outs["int8_dot"] = np.array(mod.int8_dot)
outs["int8_dot_isa"] = np.array(mod.int8_dot_isa)
np.savez(sys.argv[3], **outs)
"""


def _cpu_has(flag: str) -> bool:
    try:
        return flag in open("/proc/cpuinfo").read().split()
    except OSError:
        return False


# Interleaved weights the portable builds run against their rows layout, (key, bits, group
# size, scales form): each AVX2 path's formats and group sizes (the one-row kernels take
# the scales' format as a template constant, 4-bit in groups of 32 and 6-bit in groups of 16
# their own kernels, other group sizes the general ones; bfloat16 scales: the il{m}_{bits}
# runs, numpy holds no bfloat16).
IL_FORMS = (("k4", 4, 32, "kq"), ("p6g16", 6, 16, "kq"), ("p6g32", 6, 32, "float16"), ("p5g32", 5, 32, "kq"),
            ("p6g16h", 6, 16, "float16"), ("p5g16", 5, 16, "kq"),
            ("p5g64", 5, 64, "float16"), ("h4g64", 4, 64, "float16"), ("h4g128", 4, 128, "float16"),
            ("h8g16", 8, 16, "float16"), ("k8g32", 8, 32, "kq"),
            # float16 scales with the biases implied (one multiplier, scales.h's SF_F16M):
            # interleaved with the multiplier, against the rows layout's stored biases
            ("m4g32", 4, 32, "implied"), ("m4g64", 4, 64, "implied"), ("m8g32", 8, 32, "implied"),
            ("m8g16", 8, 16, "implied"), ("m5g32", 5, 32, "implied"),
            # one int8 code a group (scales.h's SF_KQ1): interleaved, against the rows' int16 codes
            ("o6g16", 6, 16, "kq1"), ("o6g32", 6, 32, "kq1"), ("o4g32", 4, 32, "kq1"), ("o8g32", 8, 32, "kq1"))
PORTABLE = ["x86-64-v3", "x86-64"] + ["x86-64-v3 -mavxvnni"] * _cpu_has("avx_vnni")


@pytest.fixture(scope="module")
def portable_builds(tmp_path_factory):  # noqa: ANN001, ANN201
    """Every build of PORTABLE, compiled at once on first use (each is one compiler's work
    for most of its time: together they take about one build's time on two cores), then
    checked; arch -> a future of the extension's path."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    from fx_engine.runtime.native import build

    cxx = build._compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    paths = build._paths()

    # (the folders made here, one at a time: pytest's mktemp is not thread-safe, and two
    # threads numbering "portable" folders at once failed now and then with "portable is
    # not a normalized and relative path")
    dirs = {arch: tmp_path_factory.mktemp("portable") for arch in PORTABLE}

    def one(arch: str) -> Path:
        so = dirs[arch] / ("_fx_native" + paths["ext_suffix"])
        march, *extra = arch.split()
        build._compile(cxx, paths, [f"-march={march}", *extra], so)
        build._check(so)  # the build's own smoke check passes too
        return so

    with ThreadPoolExecutor(len(PORTABLE)) as pool:
        yield {arch: pool.submit(one, arch) for arch in PORTABLE}


@pytest.mark.slow
@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="x86-64 build flags")
@pytest.mark.parametrize("arch", ["x86-64-v3", "x86-64", pytest.param(
    "x86-64-v3 -mavxvnni", marks=pytest.mark.skipif(not _cpu_has("avx_vnni"), reason="no AVX-VNNI"))])
def test_portable_build_runs_the_same_products(tmp_path, arch: str, portable_builds) -> None:  # noqa: ANN001
    """The kernels built for plain AVX2 (-march=x86-64-v3: no AVX-512, no VNNI), as on
    older CPUs, and for baseline x86-64 (SSE2: the generic vector code and scalar loops,
    as on a CPU fx-engine has no intrinsics for), and AVX2 + AVX-VNNI (Intel client CPUs):
    qmm_a8's AVX2 path (vpmaddubsw, or the VEX vpdpbusd) and its scalar loop give the
    AVX-512 VNNI kernel's bits exactly at every row count (exact integer
    sums, the same two float32 roundings per group), the float kernels the same product,
    and attend its float16 cache values (converted without F16C/AVX-512 instructions);
    compact scales (float16, the two-level K-quant form) give their float32 values' bits,
    and 5-/6-bit weights (unpacked with AVX2 shuffles, or a loop) the 8-bit form's.
    qgemm's AVX2 few-row path gives its many-row tiles' bits at every row count 1..16,
    and both give this machine's qgemm bits (the same arithmetic on every path); so does
    qmm's fused few-row path its dequantized copy's, and the AVX2 build this machine's qmm.
    Prefill attention (the AVX2 build's own tiles) matches float64 and, on FMA builds,
    this machine's bits; the masked softmax (no FMA in it) gives this machine's bits on
    every build."""
    import subprocess
    import sys

    so = portable_builds[arch].result()
    march, *extra = arch.split()
    data = {"x": RNG.standard_normal((11, 192)).astype(np.float32),
            "q": RNG.standard_normal((1, 1, 4, 32)).astype(np.float32),
            "kv": RNG.standard_normal((1, 2, 40, 32)).astype(np.float32),
            "qp": RNG.standard_normal((1, 40, 4, 32)).astype(np.float32),
            # masked softmax: magnitudes up to the exp clamps, rows of 53 (a 16-lane tail),
            # a fully masked row
            "sm_x": (RNG.standard_normal((1, 2, 4, 53)) * 10.0 ** RNG.integers(-2, 3, (1, 2, 4, 53))).astype(np.float32),
            "sm_m": np.concatenate([RNG.random((1, 3, 53)) < 0.8, np.zeros((1, 1, 53), bool)], axis=1)}
    from fx_engine.core.nn import rope_tables

    cos, sin, _ = rope_tables(mx.array([[3, 70, 1000]]), 16, base=10000.0, scale=1.0, freqs=None,
                              traditional=False)
    data.update(qkv=(RNG.standard_normal((3, 8 * 16)) * 10.0 ** RNG.integers(-8, 6, (3, 128))).astype(np.float32),
                cos=np.asarray(cos), sin=np.asarray(sin))
    for bits in (4, 8):
        wq, s, b = _quantized(29, 192, 32, bits)
        data.update({f"w{bits}": np.asarray(wq), f"s{bits}": np.asarray(s), f"b{bits}": np.asarray(b)})
    from fx_engine.core import kernels as core_kernels
    from fx_engine.core.nn import one_code

    for bits in (4, 8):
        wi, si, bi = _quantized(32, 192, 32, bits)
        data.update({f"wi{bits}": np.asarray(wi), f"si{bits}": np.asarray(si), f"bi{bits}": np.asarray(bi),
                     f"ii{bits}": np.asarray(core_kernels.interleave16(wi)),
                     f"isi{bits}": np.asarray(core_kernels.interleave16_groups(si)),
                     f"ibi{bits}": np.asarray(core_kernels.interleave16_groups(bi))})
    (w16, s16, b16), w16_float = _group16(29, 192)
    data.update(w16=np.asarray(w16), s16=np.asarray(s16), b16=np.asarray(b16))
    data.update(w512=np.asarray(_quantized(29, 512, 32, 4)[0]),
                x512=RNG.standard_normal((40, 512)).astype(np.float32))
    for bits in (5, 6):
        q = RNG.integers(0, 1 << bits, (29, 512)).astype(np.uint32)
        data.update({f"p{bits}": np.asarray(_stream(q, bits)), f"p{bits}_8": np.asarray(_stream(q, 8))})
    for key, bits, gs, kind in IL_FORMS:
        q = RNG.integers(0, 1 << bits, (32, 512)).astype(np.uint32)
        w = _stream(q, bits)
        iw = core_kernels.interleave16_planes(w, bits) if bits in (5, 6) else core_kernels.interleave16(w)
        if kind == "implied":
            mult = -float(2 ** (bits - 1))
            cs = mx.array(RNG.uniform(-0.05, 0.05, (32, 512 // gs)).astype(np.float16))
            cb, ib = (cs.astype(mx.float32) * mult).astype(mx.float16), mx.array([mult], dtype=mx.float32)
        else:
            (cs, cb), _ = _compact_scales(32, 512 // gs, kind, 256 // gs)
            ib = (core_kernels.interleave16_factors if kind in ("kq", "kq1") else core_kernels.interleave16_groups)(cb)
        data.update({f"{key}_bits": np.array(bits), f"{key}_gs": np.array(gs)})
        ics = core_kernels.interleave16_groups(one_code(cs) if kind == "kq1" else cs)
        data.update({f"{key}_w": np.asarray(w), f"{key}_s": np.asarray(cs), f"{key}_b": np.asarray(cb),
                     f"{key}_iw": np.asarray(iw), f"{key}_is": np.asarray(ics),
                     f"{key}_ib": np.asarray(ib)})
    for fmt, kind in (("h", "float16"), ("kq", "kq")):  # 29 rows of 512 / 32 = 16 groups
        (cs, cb), (fs, fb) = _compact_scales(29, 16, kind, 8)
        data.update({f"{fmt}_s": np.asarray(cs), f"{fmt}_b": np.asarray(cb), f"{fmt}_fs": fs, f"{fmt}_fb": fb})
    data["il_forms"] = np.array([key for key, _, _, _ in IL_FORMS])
    np.savez(tmp_path / "in.npz", **data)
    r = subprocess.run([sys.executable, "-c", _PORTABLE_RUN, str(so), str(tmp_path / "in.npz"),
                        str(tmp_path / "out.npz")], capture_output=True, text=True, timeout=300,
                       env={**__import__("os").environ, "FX_ENGINE_NATIVE": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    avx2 = march == "x86-64-v3"
    assert bool(got["int8_dot"]) == avx2  # vpmaddubsw on AVX2, a scalar loop on baseline
    assert str(got["int8_dot_isa"]).startswith("AVX-VNNI" if extra else "AVX2" if avx2 else "a scalar")
    assert str(got["isa"]) == ("avx2" if avx2 else "generic") and bool(got["few_gemm"]) == avx2
    assert got["compact_same"].all() and got["compact_same"].size == 26 + 26 + 24 + 13
    for bits in (4, 8):
        many = got[f"qgemm40_{bits}"]
        for m in range(1, 17):
            assert np.array_equal(got[f"qgemm{m}_{bits}"], many[:m]), (bits, m)
            # qmm's fused few-row path (dequantized in registers) gives its copy's bits
            assert np.array_equal(got[f"qmm{m}_{bits}"], got[f"qmm40_{bits}"][:m]), (bits, m)
        if avx2:  # and this machine's qmm (the same FMAs and horizontal-sum tree)
            wq, s, b = (mx.array(data[f"{n}{bits}"]) for n in ("w", "s", "b"))
            x40 = mx.concatenate([mx.array(data["x"])] * 4)[:40]
            assert np.array_equal(got[f"qmm40_{bits}"], np.asarray(native.qmm(x40, wq, s, b, 32, bits)))
        # this machine's own qgemm (AVX-512): the same bits where both fuse their FMAs
        # (baseline x86-64 has no FMA instruction: a product and a sum, other bits)
        if native.tiled_gemm() and avx2:
            wq, s, b = (mx.array(data[f"{n}{bits}"]) for n in ("w", "s", "b"))
            x40 = mx.concatenate([mx.array(data["x"])] * 4)[:40]
            assert np.array_equal(many, np.asarray(native.qgemm(x40, wq, s, b, 32, bits)))
    x40 = np.concatenate([data["x"]] * 4)[:40].astype(np.float64)
    ref16 = x40 @ w16_float.T  # 8 bits in groups of 16: every path, the float64 product
    for key in ["qgemm40_g16", "qmm_g16"]:
        np.testing.assert_allclose(got[key], ref16, rtol=2e-5, atol=2e-5 * np.abs(ref16).max())
    for m in range(1, 17):
        assert np.array_equal(got[f"qgemm{m}_g16"], got["qgemm40_g16"][:m]), m
        assert np.array_equal(got[f"qmm{m}_g16"], got["qmm_g16"][:m]), m
    for bits in (4, 8):
        for m in (1, 2, 3, 5, 8, 9, 40):
            assert np.array_equal(got[f"il{m}_{bits}"], got[f"ro{m}_{bits}"]), (bits, m)
            for dt in ("float16", "bfloat16"):
                assert np.array_equal(got[f"il{m}_{bits}_{dt}"], got[f"ro{m}_{bits}_{dt}"]), (bits, m, dt)
    for key, bits, _, _ in IL_FORMS:  # the interleaved forms (5-/6-bit planes: AVX2 builds read them)
        assert bool(got[f"planes_{key}"]) == (avx2 or bits in (4, 8)), key
        for m in (1, 2, 3, 5, 8, 9, 40):
            if bool(got[f"planes_{key}"]):
                assert np.array_equal(got[f"il_{key}_{m}"], got[f"ro_{key}_{m}"]), (key, m)
    w16a, s16a, b16a = (mx.array(data[n]) for n in ("w16", "s16", "b16"))
    for m in (1, 3, 9, 40):  # qmm_a8 in groups of 16: this machine's bits (exact sums)
        assert np.array_equal(got[f"a8_{m}_g16"], np.asarray(native.qmm_a8(
            mx.array(x40[:m].astype(np.float32)), w16a, s16a, b16a, 16, 8))), m
    cache = mx.zeros((1, 2, 5, 16), mx.float16)
    for i, a in enumerate(native.qkv_rope_put(mx.array(data["qkv"]), mx.array(data["cos"]), mx.array(data["sin"]),
                                              False, 4, cache, cache, mx.array([[0, 4, 2]]))):
        assert np.array_equal(got[f"qkv_put{i}"], np.asarray(a.astype(mx.float32))), i
    kv = mx.array(data["kv"]).astype(mx.float16)  # its portable float16 conversion
    np.testing.assert_allclose(got["attend16"], np.asarray(native.attend(
        mx.array(data["q"]), kv, kv, mx.ones((1, 1, 40), mx.bool_), 0.125)), rtol=1e-5, atol=1e-6)
    # masked softmax (AVX2: on 8-float halves; no FMA anywhere): every build, the same bits
    assert np.array_equal(got["softmax"], np.asarray(native.masked_softmax(
        mx.array(data["sm_x"]), mx.array(data["sm_m"])))), arch
    # prefill attention (40 query tokens, causal; AVX2 builds: their own tiles of 8-float
    # halves): the float64 softmax(q k^T / 8) v, and on FMA builds this machine's bits
    causal = np.tril(np.ones((40, 40), bool))
    for name, cache in (("attend_pre", data["kv"]), ("attend_pre16", data["kv"].astype(np.float16))):
        k64 = cache.astype(np.float64)[0]  # [Hk, S, D]
        ref = np.empty((40, 4, 32))
        for h in range(4):
            sc = data["qp"][0, :, h].astype(np.float64) @ k64[h // 2].T * 0.125
            sc = np.where(causal, sc, -np.inf)
            p = np.exp(sc - sc.max(axis=1, keepdims=True))
            ref[:, h] = (p / p.sum(axis=1, keepdims=True)) @ k64[h // 2]
        np.testing.assert_allclose(got[name].reshape(40, 4, 32), ref, rtol=1e-5, atol=1e-5)
        if avx2:
            mine = native.attend(mx.array(data["qp"]), mx.array(cache), mx.array(cache), mx.array(causal[None]), 0.125)
            assert np.array_equal(got[name], np.asarray(mine)), name
    x = mx.array(data["x"])
    for bits in (4, 8):
        wq, s, b = (mx.array(data[f"{n}{bits}"]) for n in ("w", "s", "b"))
        a8 = np.asarray(native.qmm_a8(x, wq, s, b, 32, bits))
        assert np.array_equal(got[f"a8_{bits}"], a8)
        for m in range(1, 11):
            assert np.array_equal(got[f"a8_{m}_{bits}"], a8[1 : 1 + m]), (bits, m)
        ref = _reference(x, wq, s, b, 32, bits)
        np.testing.assert_allclose(got[f"qmm_{bits}"], ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_build_key_covers_every_source_file(tmp_path, monkeypatch) -> None:
    """kernels.cpp includes one header per kernel family: a change to any of them must
    rebuild (a new cache key), or a stale binary would keep running old kernels."""
    import shutil

    from fx_engine.runtime.native import build

    src = tmp_path / "native"
    shutil.copytree(build.SOURCE.parent, src, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(build, "SOURCE", src / "kernels.cpp")
    names = {p.name for p in build.sources()}
    assert {"kernels.cpp", "simd.h", "pool.h", "qmatmul.h", "qmm_a8.h", "attention.h",
            "pointwise.h"} <= names
    cxx = build._compiler() or "c++"
    key = build.build_key(cxx)
    assert build.build_key(cxx) == key
    for name in names:
        f = src / name
        old = f.read_text()
        f.write_text(old + "\n// edited\n")
        assert build.build_key(cxx) != key, name
        f.write_text(old)
    assert build.build_key(cxx) == key


def _compact_scales(n: int, g: int, fmt: str, sb: int):
    """Random group scales and biases stored compactly (`fmt`: float16, bfloat16, or the
    two-level int16 codes + float16 (d, e) factors per super-block of `sb` groups; "kq1":
    the same with every bias code equal to its scale code, as a Q6_K's), and the float32
    values they stand for (numpy, exact: s = d * a, b = -(e * c))."""
    if fmt in ("float16", "bfloat16"):
        dt = mx.float16 if fmt == "float16" else mx.bfloat16
        s = mx.array(RNG.uniform(0.001, 0.05, (n, g)).astype(np.float32)).astype(dt)
        b = mx.array(RNG.uniform(-0.5, 0.5, (n, g)).astype(np.float32)).astype(dt)
        return (s, b), (np.asarray(s.astype(mx.float32)), np.asarray(b.astype(mx.float32)))
    a = RNG.integers(-128, 128, (n, g)).astype(np.int8)
    c = a if fmt == "kq1" else RNG.integers(-128, 128, (n, g)).astype(np.int8)  # kq1: one code (Q6_K's)
    de = RNG.uniform(1e-5, 2e-3, (n, g // sb, 2)).astype(np.float16)
    codes = (a.astype(np.uint8).astype(np.uint16) | (c.astype(np.uint8).astype(np.uint16) << 8)).view(np.int16)
    d, e = (np.repeat(de[..., i].astype(np.float32), sb, axis=1) for i in (0, 1))
    return (mx.array(codes), mx.array(de)), (d * a.astype(np.float32), -(e * c.astype(np.float32)))


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "kq"])
@pytest.mark.parametrize("bits,gs", [(4, 32), (8, 32), (8, 16), (4, 64)])
def test_compact_scales_give_the_float32_bits(fmt: str, bits: int, gs: int) -> None:
    """Scales and biases stored as float16, bfloat16 or GGUF's two-level K-quant form (int8
    codes per group times a float16 factor per super-block) decode, inside the kernels, to
    exactly the float32 values: every product (qmm, qgemm at every row-count path, qmm_a8)
    and dequantize give the float32 form's bits."""
    n, k = 45, 512
    g = k // gs
    sb = 256 // gs  # a K-quant super-block: 256 weights
    q = RNG.integers(0, 1 << bits, (n, k), dtype=np.uint32)
    per = 32 // bits
    wq = mx.array((q.reshape(n, k // per, per) << (bits * np.arange(per, dtype=np.uint32))).sum(
        axis=-1, dtype=np.uint32))
    (cs, cb), (fs, fb) = _compact_scales(n, g, fmt, sb)
    fs, fb = mx.array(fs), mx.array(fb)
    for m in (1, 2, 5, 8, 16, 17, 40):
        x = mx.array(RNG.standard_normal((m, k)).astype(np.float32))
        for op in (native.qmm, native.qgemm) + ((native.qmm_a8,) if gs >= 32 else ()):
            want = np.asarray(op(x, wq, fs, fb, gs, bits))
            assert np.array_equal(np.asarray(op(x, wq, cs, cb, gs, bits)), want), (op, m)
    assert np.array_equal(np.asarray(native.dequantize(wq, cs, cb, gs, bits)),
                          np.asarray(native.dequantize(wq, fs, fb, gs, bits)))
    # and those are the stored integers' affine map (float32: a product, then a sum)
    w = q.astype(np.float32) * np.repeat(np.asarray(fs), gs, 1) + np.repeat(np.asarray(fb), gs, 1)
    np.testing.assert_array_equal(np.asarray(native.dequantize(wq, cs, cb, gs, bits)), w)


def test_compact_scale_arguments_are_checked() -> None:
    wq, s, b = _quantized(8, 256, 32, 4)
    x = mx.ones((1, 256))
    (cs, cb), _ = _compact_scales(8, 8, "kq", 8)
    with pytest.raises(ValueError, match="two-level"):
        native.qmm(x, wq, cs, cb[:, :, :1], 32, 4)
    with pytest.raises(ValueError, match="two-level"):
        native.qmm(x, wq, cs, b, 32, 4)
    with pytest.raises(ValueError, match="floating point"):
        native.qmm(x, wq, s.astype(mx.int32), b.astype(mx.int32), 32, 4)
    # a float16 / float32 mix is converted, not refused: the float32 bits
    want = np.asarray(native.qmm(x, wq, s, b, 32, 4))
    s16 = s.astype(mx.float16)
    assert np.array_equal(np.asarray(native.qmm(x, wq, s16, b, 32, 4)),
                          np.asarray(native.qmm(x, wq, s16.astype(mx.float32), b, 32, 4)))
    assert want.shape == (1, 8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mlx_checkpoint_scales_stay_as_stored_and_give_the_float32_bits(tmp_path, dtype: str) -> None:
    """An mlx-community style 4-bit folder saved in float16 / bfloat16 keeps its scales and
    biases in that dtype on the native kernels (half the bytes of float32), and the model's
    logits equal those of the same params with float32 scales, bit for bit."""
    import attrs

    from fx_engine.core.adapters import map_linears
    from fx_engine.core.nn import linears
    from fx_engine.testing.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", dtype=dtype, quantize={"group_size": 32, "bits": 4})
    model = fx_engine.load(folder)
    kept = [lin for lin in linears(model.params) if lin.quantized]
    assert kept and all(lin.quant.scales.dtype == getattr(mx, dtype) for lin in kept if lin is not model.params.embed)

    def wide(_: int, lin):  # noqa: ANN001
        if not lin.quantized:
            return lin
        return lin.with_quant(scales=lin.quant.scales.astype(mx.float32), biases=lin.quant.biases.astype(mx.float32))

    ref = attrs.evolve(model, params=map_linears(model.params, wide))
    ids = list(range(5, 40))
    for chunk in (1, 16):
        assert np.array_equal(np.asarray(fx_engine.logits(model, ids, chunk=chunk)),
                              np.asarray(fx_engine.logits(ref, ids, chunk=chunk)))


def _stream(q: np.ndarray, bits: int) -> mx.array:
    from fx_engine.core.checkpoint import pack_stream as _pack  # MLX's bit-stream packing (tested against mx.quantize)

    return mx.array(_pack(q, bits))


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("gs", [16, 32, 64])
def test_5_and_6_bit_weights_give_the_8_bit_bits(bits: int, gs: int) -> None:
    """5- and 6-bit weights (GGUF's Q5_0/Q5_K, Q6_K as stored) are unpacked to bytes a block
    of rows at a time and run on the 8-bit code: every product and row count, and
    dequantize, give exactly the bits of the same integers stored as 8 bits, with float32
    or two-level scales; K = 1056 / 1088 leave a tail after the 64-value vector steps."""
    n = 29
    for k in (1024, 1088 if gs == 64 else 1056):
        q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
        packed, wide = _stream(q, bits), _stream(q, 8)
        assert packed.shape == (n, k * bits // 32)
        s = mx.array(RNG.uniform(0.001, 0.02, (n, k // gs)).astype(np.float32))
        b = mx.array(RNG.uniform(-0.5, 0.5, (n, k // gs)).astype(np.float32))
        forms = [(s, b)]
        if k % 256 == 0 and gs <= 32:
            forms.append(_compact_scales(n, k // gs, "kq", 256 // gs)[0])
        for cs, cb in forms:
            for m in (1, 2, 7, 16, 17, 40):
                x = mx.array(RNG.standard_normal((m, k)).astype(np.float32))
                # (qmm_a8 unpacks them too: exact integer sums, the 8-bit form's bits)
                for op in (native.qmm, native.qgemm, native.qmm_a8):
                    assert np.array_equal(np.asarray(op(x, packed, cs, cb, gs, bits)),
                                          np.asarray(op(x, wide, cs, cb, gs, 8))), (op, m, k)
            assert np.array_equal(np.asarray(native.dequantize(packed, cs, cb, gs, bits)),
                                  np.asarray(native.dequantize(wide, cs, cb, gs, 8)))
        w = q.astype(np.float32) * np.repeat(np.asarray(s), gs, 1) + np.repeat(np.asarray(b), gs, 1)
        np.testing.assert_array_equal(np.asarray(native.dequantize(packed, s, b, gs, bits)), w)
    assert native.supports(gs, bits) and native.supports(32, bits, activation_bits=8)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
def test_interleaved_weights_give_the_row_major_bits(bits: int, gs: int) -> None:
    """qmm_a8 on a weight in its interleaved layout (kernels.interleave16: 16-row blocks, word
    by word, read as one contiguous stream per block by the few-row paths and quad-major by
    the many-row tiles) gives the row-major weight's bits at every row count, with
    float32, float16, bfloat16 and two-level scales (stored interleaved, the K-quant factors
    too, converted as the kernels read them); interleave16 is a permutation that deinterleave16
    undoes; wrong shapes are clear errors."""
    from fx_engine.core import kernels

    n, k = 48, 512
    wq, s, b = _quantized(n, k, gs, bits)
    il = kernels.interleave16(wq)
    assert il.shape == wq.shape and not np.array_equal(np.asarray(il), np.asarray(wq))
    assert np.array_equal(np.asarray(kernels.deinterleave16(il)), np.asarray(wq))
    assert sorted(np.asarray(il).ravel()) == sorted(np.asarray(wq).ravel())
    forms = [(s, b), (s.astype(mx.float16), b.astype(mx.float16)), (s.astype(mx.bfloat16), b.astype(mx.bfloat16))]
    if gs == 32:
        forms.append(_compact_scales(n, k // gs, "kq", 8)[0])
    for cs, cb in forms:
        kq = cs.dtype == mx.int16  # (the K-quant form: codes as groups, (d, e) factors per super-block)
        back = kernels.interleave16_factors if kq else kernels.interleave16_groups
        ics, icb = kernels.interleave16_groups(cs), back(cb)
        assert mx.array_equal(kernels.interleave16_groups(ics, inverse=True), cs).item()
        assert mx.array_equal(back(icb, inverse=True), cb).item()
        for m in (1, 2, 5, 8, 9, 16, 17, 40):
            x = mx.array(RNG.standard_normal((m, k)).astype(np.float32))
            assert np.array_equal(np.asarray(native.qmm_a8(x, il, ics, icb, gs, bits, interleaved=True)),
                                  np.asarray(native.qmm_a8(x, wq, cs, cb, gs, bits))), (m, cs.dtype)
    with pytest.raises(ValueError, match="multiple of 16 rows"):
        native.qmm_a8(mx.ones((1, k)), wq[:40], s[:40], b[:40], gs, bits, interleaved=True)
    with pytest.raises(ValueError, match="interleave16"):
        kernels.interleave16(wq[:40])


@pytest.mark.parametrize("bits,gs,k", [(4, 32, 352), (4, 64, 512), (4, 128, 768), (8, 32, 512), (8, 16, 416),
                                       (5, 32, 544), (6, 16, 512), (6, 16, 480), (6, 32, 256)])
def test_amx_tiles_give_the_vnni_tiles_bits(bits: int, gs: int, k: int) -> None:
    """On a CPU with AMX (and a kernel that grants it), qmm_a8's many-row tiles on
    interleaved weights take their integer sums from tile multiplies (amx.h); each group's
    float step is the VNNI tiles' (a8_step, in group order), so the bits are the same:
    4-/8-bit interleaved blocks and 5-/6-bit planes, groups of 16 to 128 (one multiply a
    group, or several summed in the tile), group counts that leave 1-3 groups after the
    rounds of four (k = 352: 11 groups; 416 and 480: 26 and 30 of 16), partial row tiles (33, 40, 100 rows),
    float16 and two-level scales. Turned off (set_amx), the VNNI tiles run: the reference."""
    from fx_engine.core import kernels

    mod = native._module()
    if not native.amx():
        pytest.skip("no AMX here (CPU, build or kernel): the VNNI tiles are the only ones")
    if bits in (5, 6) and not kernels.il_planes():
        pytest.skip("no planes layout on this build")
    n = 48
    q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
    wq = _stream(q, bits)
    il = kernels.interleave16_planes(wq, bits) if bits in (5, 6) else kernels.interleave16(wq)
    forms = [_compact_scales(n, k // gs, "float16", 1)[0]]
    if gs in (16, 32) and (k // gs) % (256 // gs) == 0:
        forms.append(_compact_scales(n, k // gs, "kq1" if gs == 16 else "kq", 256 // gs)[0])
    for cs, cb in forms:
        back = kernels.interleave16_factors if cs.dtype == mx.int16 else kernels.interleave16_groups
        ics, icb = kernels.interleave16_groups(cs), back(cb)
        for m in (33, 40, 100):
            x = mx.array(RNG.standard_normal((m, k)).astype(np.float32) * 2)
            on = np.asarray(native.qmm_a8(x, il, ics, icb, gs, bits, interleaved=True))
            try:
                mod.set_amx(False)
                assert not native.amx()
                off = np.asarray(native.qmm_a8(x, il, ics, icb, gs, bits, interleaved=True))
            finally:
                mod.set_amx(True)
            assert np.array_equal(on, off), (m, cs.dtype)
            assert np.array_equal(on[5:6], np.asarray(native.qmm_a8(x[5:6], il, ics, icb, gs, bits,
                                                                     interleaved=True)))  # the few-row path


def _same_products(wq, form, stored, gs: int, bits: int) -> None:
    """Every rows-layout product (qmm, qgemm, qmm_a8) at 1-40 rows, and dequantize, give the
    same bits with the scales and biases `form` as with `stored`."""
    k = wq.shape[1] * 32 // bits
    for x_rows in (1, 2, 5, 8, 9, 16, 17, 40):
        x = mx.array(RNG.standard_normal((x_rows, k)).astype(np.float32))
        for op in (native.qmm, native.qgemm, native.qmm_a8):
            assert np.array_equal(np.asarray(op(x, wq, *form, gs, bits)), np.asarray(op(x, wq, *stored, gs, bits))), \
                (op, x_rows)
    assert np.array_equal(np.asarray(native.dequantize(wq, *form, gs, bits)),
                          np.asarray(native.dequantize(wq, *stored, gs, bits)))


@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 64), (5, 32), (8, 32), (8, 16)])
def test_biases_implied_by_the_scales_give_the_stored_biases_bits(bits: int, gs: int) -> None:
    """GGUF's Q4_0 / Q5_0 / Q8_0 store only d per group (w = d (q - 2^(bits-1))). A product
    may take, as its biases, the one float32 multiplier m of float16 scales (scales.h's
    SF_F16M: each bias formed as m * s; the 8-bit mode's interleaved matrices, so a decode
    step streams half the parameter bytes). Every kernel, layout and row count gives the
    bits of the stored biases; nn.implied_bias finds m from the values alone (not from a
    type name), interleave_for_a8 and with_implied_bias record it and row_major keeps it;
    malformed forms are clear errors."""
    from fx_engine.core.nn import (Linear, Quant, _product_biases, implied_bias, interleave_for_a8, row_major,
                                   with_implied_bias)

    n, k, m = 48, 512, -float(2 ** (bits - 1))
    q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
    wq = _stream(q, bits)
    d = RNG.uniform(-0.05, 0.05, (n, k // gs)).astype(np.float16)
    d[0, :3] = (0, 6e-8, -65504 / 256)  # a zero, a subnormal half, a large one (m * d still a half)
    s = mx.array(d)
    b = mx.array((d.astype(np.float32) * np.float32(m)).astype(np.float16))
    assert np.array_equal(np.asarray(b).astype(np.float32), d.astype(np.float32) * np.float32(m))
    mult = mx.array([m], dtype=mx.float32)
    _same_products(wq, (s, mult), (s, b), gs, bits)
    lin = Linear(weight=wq, quant=Quant(scales=s, biases=b, group_size=gs, bits=bits))
    assert implied_bias(lin.quant) == m
    assert with_implied_bias(lin).quant.bias_multiplier == m and _product_biases(with_implied_bias(lin).quant).tolist() == [m]
    il = interleave_for_a8(lin)
    if il is not lin:  # (a build without the planes path keeps 5-bit weights in rows)
        assert il.quant.bias_multiplier == m and _product_biases(il.quant).tolist() == [m]
        back = row_major(il).quant
        assert back.bias_multiplier == m and _product_biases(back).tolist() == [m]  # (the same values)
        ilq = il.quant
        for x_rows in (1, 2, 5, 8, 9, 16, 17, 40):
            x = mx.array(RNG.standard_normal((x_rows, k)).astype(np.float32))
            want = np.asarray(native.qmm_a8(x, wq, s, b, gs, bits))
            for biases in (ilq.biases, mult):
                got = native.qmm_a8(x, il.weight, ilq.scales, biases, gs, bits, interleaved=True)
                assert np.array_equal(np.asarray(got), want), x_rows
    # found from the values: one bias off, float32 parameters, another multiple: no m
    off = np.asarray(b).copy()
    off[n - 1, k // gs - 1] = np.nextafter(off[n - 1, k // gs - 1], np.float16(np.inf))  # one half's ulp
    assert implied_bias(Quant(scales=s, biases=mx.array(off), group_size=gs, bits=bits)) is None
    assert implied_bias(Quant(scales=s.astype(mx.float32), biases=b.astype(mx.float32), group_size=gs,
                              bits=bits)) is None
    assert implied_bias(Quant(scales=s, biases=(s * 2 * m).astype(mx.float16), group_size=gs, bits=bits)) is None
    x = mx.ones((1, k))
    with pytest.raises(ValueError, match="one float32 multiplier"):
        native.qmm(x, wq, s.astype(mx.float32), mult, gs, bits)  # (float32 scales: no such form)
    with pytest.raises(ValueError, match="one float32 multiplier"):
        native.qmm_a8(x, wq, s, mx.array([m, m]), gs, bits)


@pytest.mark.parametrize("bits,gs", [(6, 16), (6, 32), (5, 32), (4, 32), (8, 32)])
def test_one_code_two_level_form_gives_the_int16_codes_bits(bits: int, gs: int) -> None:
    """GGUF's Q6_K (and Q3_K) store one scale code per group, used for the bias too: the
    8-bit mode keeps it as one int8 code (scales.h's SF_KQ1, nn.one_code: 1 byte of codes
    a group, not 2). Every kernel, layout and row count gives the int16 codes' bits, and
    nn.group_params the same floats; interleave_for_a8 stores the int8 codes only where
    every pair agrees (checked on the values) and row_major gives the int16 codes back."""
    from fx_engine.core.nn import Linear, Quant, group_params, interleave_for_a8, one_code, row_major, two_codes

    n, k, sb = 48, 512, 256 // gs
    q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
    wq = _stream(q, bits)
    (codes, de), (fs, fb) = _compact_scales(n, k // gs, "kq1", sb)
    one = one_code(codes)
    assert one is not None and one.dtype == mx.int8 and mx.array_equal(two_codes(one), codes).item()
    for got, want in zip(group_params(one, de), (fs, fb)):
        assert np.array_equal(np.asarray(got), want)
    _same_products(wq, (one, de), (codes, de), gs, bits)
    lin = Linear(weight=wq, quant=Quant(scales=codes, biases=de, group_size=gs, bits=bits))
    il = interleave_for_a8(lin)
    if il is not lin:  # (a build without the planes path keeps 5-/6-bit weights in rows)
        assert il.quant.scales.dtype == mx.int8
        back = row_major(il)
        assert back.quant.scales.dtype == mx.int16 and mx.array_equal(back.quant.scales, codes).item()
        for x_rows in (1, 2, 5, 8, 9, 16, 17, 40):
            x = mx.array(RNG.standard_normal((x_rows, k)).astype(np.float32))
            got = native.qmm_a8(x, il.weight, il.quant.scales, il.quant.biases, gs, bits, interleaved=True)
            assert np.array_equal(np.asarray(got), np.asarray(native.qmm_a8(x, wq, codes, de, gs, bits))), x_rows
    (two, _), _ = _compact_scales(n, k // gs, "kq", sb)  # (random bias codes: kept as int16)
    assert one_code(two) is None
    assert interleave_for_a8(Linear(weight=wq, quant=Quant(scales=two, biases=de, group_size=gs, bits=bits))
                             ).quant.scales.dtype == mx.int16
    with pytest.raises(ValueError, match="two-level"):
        native.qmm(mx.ones((1, k)), wq, one, de.astype(mx.float32), gs, bits)


def test_relayout_by_row_chunks_keeps_the_whole_matrix_form(monkeypatch) -> None:
    """The loader interleaves a large matrix a few thousand rows at a time
    (loading.model._by_row_chunks): the pieces take the whole matrix's compact form, so a
    matrix fused from rows whose bias codes equal their scale codes (a Q6_K v) and rows whose
    do not (Q4_K q, k) keeps int16 codes throughout, and its products and rows are the
    whole relayout's."""
    from fx_engine.core.nn import Linear, Quant, interleave_for_a8, row_major
    from fx_engine.loading import model as loading

    monkeypatch.setattr(loading, "RELAYOUT_ROWS", 32)
    n, k, gs = 96, 512, 32
    wq = _stream(RNG.integers(0, 16, (n, k)).astype(np.uint32), 4)
    (same, de), _ = _compact_scales(n, k // gs, "kq1", 8)
    (mixed, _), _ = _compact_scales(n, k // gs, "kq", 8)
    codes = mx.concatenate([mixed[:32], same[32:]])  # rows 32..95 agree, rows 0..31 do not
    for c, dtype in ((codes, mx.int16), (same, mx.int8)):
        lin = Linear(weight=wq, quant=Quant(scales=c, biases=de, group_size=gs, bits=4))
        whole, chunked = interleave_for_a8(lin), loading._by_row_chunks(interleave_for_a8, lin)
        assert whole.quant.scales.dtype == chunked.quant.scales.dtype == dtype
        for a, b in ((whole.weight, chunked.weight), (whole.quant.scales, chunked.quant.scales),
                     (whole.quant.biases, chunked.quant.biases), (row_major(chunked).quant.scales, c)):
            assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("bits", [5, 6])
@pytest.mark.parametrize("gs", [16, 32, 64])
def test_5_and_6_bit_planes_give_the_rows_bits(gs: int, bits: int) -> None:
    """5- and 6-bit weights in qmm_a8's planes layout (kernels.interleave16_planes: per
    16-row block and 32-k step, the low nibbles as 4-bit interleaved words, then the high
    bits in bits - 4 words per row) give the rows layout's bits at every row count, with
    float32, float16, bfloat16 and two-level scales; the layout is the documented one
    (checked entry by entry from its definition with numpy), deinterleave16_planes undoes
    it, and a build without the planes path refuses such a weight."""
    from fx_engine.core import kernels

    n, k = 48, 512
    q = RNG.integers(0, 1 << bits, (n, k)).astype(np.uint32)
    wq = _stream(q, bits)
    il = kernels.interleave16_planes(wq, bits)
    assert il.shape == wq.shape and mx.array_equal(kernels.deinterleave16_planes(il, bits), wq).item()
    words, step = np.asarray(il), 16 * bits  # words per block per 32-k step
    for r in (0, 7, 16, 47):
        blk = words.reshape(n // 16, k // 32 * step)[r // 16]
        for st in range(k // 32):
            base = st * step + r % 16
            for i in range(4):
                for j in range(8):
                    lo = (blk[base + 16 * i] >> (4 * j)) & 15
                    b, p = j >> 1, j & 1  # value 8i + 2b + p
                    hi = ((blk[base + 64 + 16 * p] >> (8 * b + 2 * i)) & 3 if bits == 6
                          else (blk[base + 64] >> (8 * b + 4 * p + i)) & 1)
                    assert lo + 16 * hi == q[r, 32 * st + 8 * i + j], (r, st, i, j)
    if not kernels.il_planes():  # (portable builds keep 5-/6-bit weights in rows)
        s, b = (mx.ones((n, k // gs)),) * 2
        with pytest.raises(ValueError, match="planes"):
            native.qmm_a8(mx.ones((1, k)), il, s, b, gs, bits, interleaved=True)
        return
    s = mx.array(RNG.uniform(0.001, 0.02, (n, k // gs)).astype(np.float32))
    b = mx.array(RNG.uniform(-1, 1, (n, k // gs)).astype(np.float32))
    forms = [(s, b), (s.astype(mx.float16), b.astype(mx.float16)), (s.astype(mx.bfloat16), b.astype(mx.bfloat16))]
    if gs in (16, 32):
        forms.append(_compact_scales(n, k // gs, "kq", 16 if gs == 16 else 8)[0])
    for cs, cb in forms:
        kq = cs.dtype == mx.int16  # (the K-quant form: codes as groups, (d, e) factors per super-block)
        ics = kernels.interleave16_groups(cs)
        icb = (kernels.interleave16_factors if kq else kernels.interleave16_groups)(cb)
        for m in (1, 2, 5, 8, 9, 16, 17, 40):
            x = mx.array(RNG.standard_normal((m, k)).astype(np.float32))
            assert np.array_equal(np.asarray(native.qmm_a8(x, il, ics, icb, gs, bits, interleaved=True)),
                                  np.asarray(native.qmm_a8(x, wq, cs, cb, gs, bits))), (m, cs.dtype)
    with pytest.raises(ValueError, match="interleave16_planes"):
        kernels.interleave16_planes(wq[:40], bits)


@pytest.mark.parametrize("bits", [4, 5, 6])
def test_activation_bits_model_runs_interleaved_weights(tmp_path, bits: int) -> None:
    """In the 8-bit mode the loader puts the 4-/8-bit matrices (5-/6-bit ones as planes where
    the build reads them) in qmm_a8's interleaved layout, a head tied to the embeddings
    included (its lookups gather the interleaved blocks): the logits equal those of the
    same params in rows, bit for bit, at decode and chunked prefill; the embeddings looked
    up are the rows layout's; code that reads the weight itself gets rows back
    (nn.row_major), and MLX's kernels refuse an interleaved one."""
    from fx_engine.core import kernels
    from fx_engine.core.adapters import map_linears
    from fx_engine.core.nn import Numerics, embed, linear, linears, row_major
    from fx_engine.testing.tiny import write_tiny_model

    folder = write_tiny_model(tmp_path / "m", "llama", quantize={"group_size": 32, "bits": bits},
                              tie_word_embeddings=True)
    a8 = fx_engine.load(folder, activation_bits=8)
    il = [lin for lin in linears(a8.params) if lin.interleaved]
    planes = bits in (5, 6) and kernels.il_planes()
    assert a8.params.lm_head is None and bool(il) == (bits == 4 or planes)
    assert a8.params.embed.interleaved == (bits == 4 or planes)
    rows = __import__("attrs").evolve(a8, params=map_linears(a8.params, lambda _, lin: row_major(lin)))
    assert not any(lin.interleaved for lin in linears(rows.params))
    toks = mx.array([[0, 5, 17, 31], [a8.params.embed.weight.shape[0] - 1, 16, 15, 2]])
    assert mx.array_equal(embed(toks, a8.params.embed), embed(toks, rows.params.embed)).item()
    ids = list(range(5, 40))
    for chunk in (1, 16):
        assert np.array_equal(np.asarray(scoring.logits(a8, ids, chunk=chunk)),
                              np.asarray(scoring.logits(rows, ids, chunk=chunk)))
    for lin in il[:1]:  # (none: a build without the planes path keeps 6-bit weights in rows)
        with pytest.raises(ValueError, match="interleaved layout"):
            linear(mx.ones((1, lin.in_features)), lin, Numerics())
