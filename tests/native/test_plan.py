"""fx_engine.runtime.native.plan: the measured choice of the float32 quantized-matmul path.

`decide` is a pure function of measured times (property-tested with made-up ones);
`choose` measures real kernels on a model's shapes once and caches the result; `load`
puts the plan into the params' static numerics, and `fx-engine info` prints it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.runtime import native

pytestmark = pytest.mark.skipif(native.ensure(quiet=True) is None,
                                reason=f"native kernels unavailable: {native.status()['error']}")

from fx_engine.runtime.native import plan  # noqa: E402  (after ensure: the ops need the extension)

ROWS = sorted(set(plan.KERNEL_ROWS) | set(plan.GEMM_ROWS))
times = st.floats(min_value=1e-6, max_value=1.0, allow_nan=False)


def _seconds(q: dict[int, float], f: dict[int, float], g: dict[int, float]) -> dict:
    return {"qgemm": q, "qmm": f, "gemm": {m: g[m] for m in plan.GEMM_ROWS}}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({m: times for m in ROWS}), st.fixed_dictionaries({m: times for m in ROWS}),
       st.fixed_dictionaries({m: times for m in ROWS}))
def test_decide_never_keeps_a_path_that_is_clearly_slower(q, f, g) -> None:
    sec = _seconds(q, f, g)
    p, why = plan.decide(sec)
    # the kernel: qmm only when clearly faster over a request's products (its calls at
    # the kernel row counts, summed here independently of plan.request_seconds)
    assert set(plan.REQUEST) == set(plan.KERNEL_ROWS)
    tq = math.fsum(plan.REQUEST[m] * q[m] for m in plan.KERNEL_ROWS)
    tf = math.fsum(plan.REQUEST[m] * f[m] for m in plan.KERNEL_ROWS)
    clear = tf * plan.MARGIN < tq or tq * plan.MARGIN < tf
    if clear:
        assert p.kernel == ("qmm" if tf < tq else "qgemm")
    else:  # a near-tie: qmm only when clearly faster at a decode step's one row
        assert p.kernel == ("qmm" if f[1] * plan.MARGIN < q[1] else "qgemm")
    kern = f if p.kernel == "qmm" else q
    # the GEMM from gemm_from on: clearly faster at every measured count from there ...
    assert p.gemm_from == 0 or (p.gemm_from in plan.GEMM_ROWS and p.gemm_from > native.FEW_GEMM_ROWS)
    for m in plan.GEMM_ROWS:
        if p.gemm_from and m >= p.gemm_from:
            assert g[m] * plan.MARGIN < kern[m]
    # ... and the suffix is the longest one: the next smaller count is not clearly faster
    below = [m for m in plan.GEMM_ROWS if m < (p.gemm_from or math.inf)]
    if below:
        assert not g[below[-1]] * plan.MARGIN < kern[below[-1]]
    assert p.kernel in why


def test_decide_on_the_measured_shapes_of_avx512_and_avx2_builds() -> None:
    """Times of the default model's gate|up (3072 x 576, 4-bit) measured here on the two
    builds (fx-engine info; qmm's 32/128/256-row times interpolated): AVX-512 keeps qgemm
    everywhere; an AVX2 build whose qgemm still ran the spilling tiles above 16 rows took
    the GEMM from 32 rows."""
    avx512 = {"qgemm": {1: 108e-6, 8: 133e-6, 32: 315e-6, 64: 557e-6, 128: 1057e-6, 256: 2091e-6, 512: 4310e-6},
              "qmm": {1: 103e-6, 8: 251e-6, 32: 700e-6, 64: 1321e-6, 128: 2600e-6, 256: 5100e-6, 512: 10067e-6},
              "gemm": {32: 1023e-6, 64: 1718e-6, 128: 2690e-6, 256: 4935e-6, 512: 10268e-6}}
    assert plan.decide(avx512)[0] == fx_engine.core.nn.MatmulPlan("qgemm", 0)
    old_avx2 = {"qgemm": {1: 202e-6, 8: 257e-6, 32: 3385e-6, 64: 7059e-6, 128: 13199e-6, 256: 25972e-6, 512: 54212e-6},
                "qmm": {1: 353e-6, 8: 1203e-6, 32: 5000e-6, 64: 9837e-6, 128: 17000e-6, 256: 34000e-6, 512: 67051e-6},
                "gemm": {32: 2429e-6, 64: 3098e-6, 128: 2940e-6, 256: 5063e-6, 512: 10777e-6}}
    p, why = plan.decide(old_avx2)
    assert p == fx_engine.core.nn.MatmulPlan("qgemm", 32) and "BLAS GEMM from 32 rows" in why


def test_decide_weighs_a_request_not_each_row_count_alike() -> None:
    """plan.measure's times (cold weights, float16 scales; 2026-12-06, AMD Zen 4, AVX-512
    build, microseconds). The 1B shape's gate (16384 x 2048): qmm's one-row product is 1.5x
    faster, its 8-row one 1.2x slower: over a request (mostly decode steps) qmm. A geometric
    mean over the row counts would call it a near-tie."""
    us = lambda d: {m: t * 1e-6 for m, t in d.items()}  # noqa: E731
    gemm = us({32: 89829, 64: 92043, 128: 129982, 256: 219234, 512: 372692})
    big = {"qgemm": us({1: 2064, 8: 4084, 32: 15396, 64: 28039, 128: 45403, 256: 92292, 512: 233816}),
           "qmm": us({1: 1371, 8: 5042, 32: 14313, 64: 22354, 128: 43319, 256: 87802, 512: 203624}),
           "gemm": gemm}
    p, why = plan.decide(big)
    assert p.kernel == "qmm" and "1.23x" in why and "128 x 1" in why


def test_a_near_tie_goes_to_the_faster_decode_step() -> None:
    """The default model's gate|up (3072 x 576; 2026-12-06, AMD Zen 4, microseconds): qmm
    1.24x faster at one row, 1.33x slower at 512, 1.03x qgemm's time over a request: a
    near-tie, which the one-row product decides (qmm). Where qmm is not MARGIN faster at one
    row, qgemm stays; a clear loss over the request keeps qgemm whatever one row says."""
    us = lambda d: {m: t * 1e-6 for m, t in d.items()}  # noqa: E731
    small = {"qgemm": us({1: 136, 8: 247, 32: 767, 64: 1326, 128: 2467, 256: 4762, 512: 9462}),
             "qmm": us({1: 110, 8: 306, 32: 945, 64: 1729, 128: 3332, 256: 6289, 512: 12573}),
             "gemm": us({32: 1802, 64: 2493, 128: 4117, 256: 7740, 512: 16184})}
    p, why = plan.decide(small)
    assert p.kernel == "qmm" and "near-tie" in why and "0.81x" in why
    assert plan.decide({**small, "qmm": {**small["qmm"], 1: 130e-6}})[0].kernel == "qgemm"
    slow = {**small, "qmm": {**small["qmm"], 512: 3 * small["qgemm"][512]}}
    assert plan.request_seconds(slow["qmm"]) > plan.MARGIN * plan.request_seconds(slow["qgemm"])
    assert plan.decide(slow)[0].kernel == "qgemm"
    # decode-heavy: the same 512-row times, qmm 2x faster at one row: clearly faster
    small["qmm"] = {**small["qmm"], 1: small["qgemm"][1] / 2}
    p, why = plan.decide(small)
    assert p.kernel == "qmm" and "near-tie" not in why


def test_measure_times_cold_weights_with_float16_scales(monkeypatch) -> None:
    """Each timed call gets the next copy of the weights (a decode step reads them from
    memory), and the copies carry float16 scales and biases (the files' storage)."""
    seen = []

    def spy(real):
        def call(*args):
            wq, s, b = args[-5:-2]  # (x,) wq, scales, biases, group size, bits
            seen.append((id(wq), s.dtype, b.dtype))
            return real(*args)
        return call

    for name in ("qmm", "qgemm", "dequantize"):
        monkeypatch.setattr(plan, name, spy(getattr(plan, name)))
    monkeypatch.setattr(plan, "COLD_BYTES", 5 * 64 * 64 // 2)  # five copies of 64 x 64 4-bit
    plan.measure(64, 64, 4, 32)
    assert {d for _, d, _ in seen} == {plan.mx.float16} and {d for _, _, d in seen} == {plan.mx.float16}
    assert len({w for w, _, _ in seen}) == 5 and len(seen) > 100
    # in turn, whichever candidate calls: the next call always reads another copy
    assert all(a != b for (a, _, _), (b, _, _) in zip(seen, seen[1:]))


def test_time_all_alternates_the_candidates_and_evaluates_a_round_as_one_graph(monkeypatch) -> None:
    """The candidates' rounds alternate (a burst of load hits both), each round one
    mx.eval of all its calls (a separate evaluation a call adds MLX's per-eval cost to
    each, diluting the kernels' ratio), and the best round is the figure."""
    order, evals = [], []
    real_eval = plan.mx.eval
    monkeypatch.setattr(plan.mx, "eval", lambda *a: evals.append(a) or real_eval(*a))

    def fn(name):
        return lambda: order.append(name) or plan.mx.array([1.0])

    got = plan._time_all({"a": fn("a"), "b": fn("b")}, rounds=3, budget=1e-9)
    assert set(got) == {"a", "b"} and all(0 < t < 1 for t in got.values())
    timed = order[4:]  # after two warm-up calls each
    assert timed == ["a", "b"] * 3
    assert len(evals) == 4 + 6 and all(isinstance(e[0], list) for e in evals[4:])


def test_choose_measures_once_and_caches(tmp_path, monkeypatch) -> None:
    from fx_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "q", quantize={"group_size": 32, "bits": 4})
    monkeypatch.setattr(plan, "_cache_file", lambda: tmp_path / "plans.json")
    calls = []
    real = plan.measure
    monkeypatch.setattr(plan, "measure", lambda *a: calls.append(a) or real(*a))
    m1 = fx_engine.load(path)
    r1 = m1.matmul_report
    assert r1 is not None and not r1.cached and len(calls) == 1
    n, k, bits, gs = calls[0]
    assert (bits, gs) == (4, 32) and f"{n} x {k}" in r1.shape
    assert m1.params.numerics.matmul == r1.plan  # static numerics: in the compile key
    m2 = fx_engine.load(path)
    assert m2.matmul_report.cached and len(calls) == 1 and m2.matmul_report.plan == r1.plan
    assert set(r1.seconds) == {"qgemm", "qmm", "gemm"} and all(t > 0 for v in r1.seconds.values() for t in v.values())
    text = "\n".join(r1.lines())
    assert "why:" in text and r1.plan.kernel in text
    # the 8-bit mode and dense models have nothing to choose
    assert fx_engine.load(path, activation_bits=8).matmul_report is None
    dense = write_tiny_model(tmp_path / "d")
    assert fx_engine.load(dense).matmul_report is None


def test_info_says_what_it_chose_and_why(tmp_path, monkeypatch, capsys) -> None:
    from fx_engine.cli import main
    from fx_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "q", quantize={"group_size": 32, "bits": 8})
    monkeypatch.setattr(plan, "_cache_file", lambda: tmp_path / "plans.json")
    assert main(["info", "--model", str(path)]) == 0
    out = capsys.readouterr().out
    assert "matmul path chosen at load" in out and "why:" in out and "8-bit, group 32" in out
    assert "8-bit activations" in out


def test_a_pinned_plan_skips_the_measurement(tmp_path, monkeypatch) -> None:
    from fx_engine.core.nn import MatmulPlan
    from fx_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "q", quantize={"group_size": 32, "bits": 4})
    monkeypatch.setattr(plan, "measure", lambda *a: pytest.fail("measured despite a pinned plan"))
    pinned = MatmulPlan(kernel="qmm", gemm_from=64)
    m = fx_engine.load(path, matmul_plan=pinned)
    assert m.params.numerics.matmul == pinned and m.matmul_report is None
    with pytest.raises(ValueError, match="matmul_plan must be"):
        fx_engine.load(path, matmul_plan="qmm")
    with pytest.raises(ValueError, match="needs numerics='exact'"):
        fx_engine.load(path, matmul_plan=pinned, activation_bits=8)
    with pytest.raises(ValueError, match="needs numerics='exact'"):
        fx_engine.load(path, matmul_plan=pinned, numerics="int8")
    # "auto" with a pinned float32 plan: the plan's numerics
    assert fx_engine.load(path, matmul_plan=pinned, numerics="auto").numerics == "exact"
    with pytest.raises(ValueError, match="needs native=True"):
        fx_engine.load(path, matmul_plan=pinned, native=False)


def test_each_kernel_layout_is_timed_and_weighed_by_its_weights(tmp_path, monkeypatch) -> None:
    """A model with 4-bit layers and an 8-bit head: both layouts are measured (the head on
    at most MEASURED_ROWS features), and the plan decides on their times scaled to the
    weights each stands for, summed (checked here against an independent sum)."""
    from fx_engine.core.nn import linears

    from fx_engine.testing import write_tiny_model

    path = write_tiny_model(tmp_path / "q", quantize={"group_size": 32, "bits": 4})
    model = fx_engine.load(path, matmul_plan=fx_engine.core.nn.MatmulPlan("qgemm", 0))
    lins = [lin for lin in linears(model.params) if lin.quantized and lin.weight.ndim == 2]
    assert lins
    shapes = {}
    for lin in lins:
        n, k = int(lin.weight.shape[0]), int(lin.weight.shape[1]) * 32 // lin.quant.bits
        shapes[(n, k, lin.quant.bits, lin.quant.group_size)] = shapes.get((n, k, lin.quant.bits, lin.quant.group_size), 0) + n * k
    reps = plan._representatives(model.params)
    assert [r for r, _ in reps] == [max(shapes, key=shapes.get)] and reps[0][1] == sum(shapes.values())
    # a (made-up) 8-bit layout next to the 4-bit one: two representatives, largest first
    monkeypatch.setattr(plan, "MEASURED_ROWS", 48)
    seen = []

    def fake_measure(n, k, bits, gs):
        seen.append((n, k, bits, gs))
        t = 1e-6 * (2.0 if bits == 8 else 1.0)
        return {"qgemm": {m: t * m for m in ROWS}, "qmm": {m: t * m * (0.5 if bits == 8 else 1.5) for m in ROWS},
                "gemm": {m: t * m * 9 for m in plan.GEMM_ROWS}}

    monkeypatch.setattr(plan, "_representatives", lambda params: [((40, 64, 4, 32), 3 * 40 * 64), ((96, 64, 8, 32), 96 * 64)])
    monkeypatch.setattr(plan, "measure", fake_measure)
    monkeypatch.setattr(plan, "_cache_file", lambda: tmp_path / "plans.json")
    report = plan.choose(model.params)
    assert seen == [(40, 64, 4, 32), (48, 64, 8, 32)] and "(of 96)" in report.shape and "% of the weights" in report.shape
    # 4-bit: 3 products' worth of its measured shape; 8-bit: 96 / 48 = 2 of its measured one
    for c in ("qgemm", "qmm"):
        for m in ROWS:
            want = 3 * fake_measure(40, 64, 4, 32)[c][m] + 2 * fake_measure(48, 64, 8, 32)[c][m]
            assert math.isclose(report.seconds[c][m], want, rel_tol=1e-12)
    # qmm 1.5x slower on the 4-bit layout and 2x faster on the 8-bit one: weighed, 3 x 1.5 +
    # 2 x 2 x 0.5 = 6.5 against 3 + 4 = 7, within the margin: qgemm
    assert report.plan.kernel == "qgemm"

