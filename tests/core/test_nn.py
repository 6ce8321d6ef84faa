"""Shared layers: fast_exp/softmax against float64 numpy (an independent oracle), and the
batch-invariant attention pieces against plain MLX."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_engine.core.nn import Numerics, _blocked_pv, attention, fast_exp, softmax, swiglu


def test_fast_exp_matches_float64_exp():
    x = mx.concatenate([mx.random.uniform(-87.0, 88.0, (200_000,), key=mx.random.key(0)),
                        mx.linspace(-1.0, 1.0, 2001)])
    got = np.array(mx.compile(fast_exp)(x), dtype=np.float64)
    x64 = np.array(x, dtype=np.float32).astype(np.float64)
    ref = np.exp(x64)
    rel = np.abs(got - ref) / ref
    # Rounding t = x * log2(e) to float32 costs up to |x| * 2**-24 relative error (2**-23
    # after the clip/round steps); the polynomial and the final product a few ulp more.
    bound = np.abs(x64) * 2.0**-23 + 5e-7
    assert (rel <= bound).all(), float((rel - bound).max())
    mlx_rel = np.abs(np.array(mx.exp(x), dtype=np.float64) - ref) / ref
    assert rel.max() <= 1.5 * mlx_rel.max()  # no worse than MLX's own exp


def test_fast_exp_edges():
    x = mx.array([float("-inf"), -1e30, -100.0, -88.0, 0.0, -0.0, 89.0, float("inf")])
    y = fast_exp(x).tolist()
    assert y[:4] == [0.0, 0.0, 0.0, 0.0]  # masked scores contribute exact zeros
    assert y[4] == 1.0 and y[5] == 1.0
    assert y[6] == float("inf") and y[7] == float("inf")


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 6), n=st.integers(1, 700), scale=st.floats(0.1, 30.0), masked=st.integers(0, 5))
def test_softmax_matches_mlx(rows, n, scale, masked):
    x = mx.random.normal((rows, n)) * scale
    if masked:
        x = mx.where(mx.arange(n) % (masked + 1) == 0, mx.finfo(mx.float32).min, x)
    a, b = softmax(x), mx.softmax(x, axis=-1, precise=True)
    assert mx.allclose(a, b, rtol=1e-5, atol=1e-7).item()
    assert mx.allclose(a.sum(axis=-1), mx.ones((rows,)), atol=1e-5).item()


def test_swiglu_matches_silu():
    g, u = mx.random.normal((4, 300)) * 8, mx.random.normal((4, 300))
    ref = g * mx.sigmoid(g) * u
    assert mx.allclose(swiglu(g, u), ref, rtol=1e-5, atol=1e-6).item()


@pytest.mark.parametrize("s, longer", [(256, 320), (320, 2048), (100, 130)])
def test_blocked_pv_is_invariant_to_trailing_zero_slots(s, longer):
    """Batch-invariant P @ V: extra all-zero slots (a longer span) change no bit."""
    p = softmax(mx.random.normal((1, 3, 2, 8, s)))
    v = mx.random.normal((1, 3, longer, 64))
    short = _blocked_pv(p, v[:, :, :s], 64)
    padded = _blocked_pv(mx.pad(p, [(0, 0)] * 4 + [(0, longer - s)]), v, 64)
    assert mx.array_equal(short, padded).item()
    assert mx.allclose(short, p @ v[:, :, None, :s], atol=1e-5).item()


def test_batch_invariant_attention_matches_plain():
    q = mx.random.normal((2, 5, 6, 16))
    k, v = mx.random.normal((2, 2, 128, 16)), mx.random.normal((2, 2, 128, 16))
    mask = (mx.arange(128)[None, None, None, :] < mx.array([70, 128])[:, None, None, None])
    mask = mx.broadcast_to(mask, (2, 1, 5, 128))
    a = attention(q, k, v, mask, 0.25, Numerics(batch_invariant=True))
    b = attention(q, k, v, mask, 0.25, Numerics())
    assert mx.allclose(a, b, atol=1e-5).item()


def test_blocked_prefill_attention_matches_one_block():
    """causal_tail: query blocks attend over a static prefix of the span; same result as
    the whole chunk at once when max(lengths) + T <= S (rows at different lengths)."""
    t, s = 300, 512
    lengths = mx.array([0, 150, 212])  # max + t == s
    q = mx.random.normal((3, t, 6, 16))
    k, v = mx.random.normal((3, 2, s, 16)), mx.random.normal((3, 2, s, 16))
    q_pos = lengths[:, None] + mx.arange(t)[None, :]
    mask = (mx.arange(s)[None, None, :] <= q_pos[:, :, None])[:, None]
    whole = attention(q, k, v, mask, 0.25, Numerics())
    blocked = attention(q, k, v, mask, 0.25, Numerics(), causal_tail=True)
    assert mx.allclose(whole, blocked, atol=1e-5).item()


def test_malloc_tuning_is_on_by_default_and_can_be_turned_off():
    import subprocess
    import sys

    code = "import fx_engine, fx_engine.runtime.malloc as m; fx_engine.setup(); print(m.active())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    env = {**__import__("os").environ, "FX_ENGINE_MALLOC": "default"}
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert off.stdout.strip() == "False"
    if sys.platform == "linux":
        assert on.stdout.strip() == "True"
