"""Tests for fx_engine.core.sampling, with mlx-lm's sample_utils as the oracle.

Every public sampling function is called through jaxtyping's `jaxtyped(typechecker=beartype)`
wrapper, so shapes and dtypes are checked on every call in this file.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from beartype import beartype
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from jaxtyping import jaxtyped
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    apply_xtc,
    make_logits_processors,
    make_sampler,
)

from fx_engine.core import sampling as S
from fx_engine.core.tree import jit

pytestmark = pytest.mark.oracle


def checked(fn):
    return jaxtyped(typechecker=beartype)(fn)


process_logits = checked(S.process_logits)
apply_filters = checked(S.apply_filters)
sample = checked(S.sample)
top_logprobs = checked(S.top_logprobs)
push_history = checked(S.push_history)
init_history = checked(S.init_history)
init_keys = checked(S.init_keys)

Config = S.SamplingConfig
SPECIAL = (1, 2)
HYP = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def np32(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype != mx.float32 else x)


def rand_logits(B: int, V: int, seed: int, scale: float = 3.0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array((rng.standard_normal((B, V)) * scale).astype(np.float32))


def to_logprobs(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def assert_same_support_close(ours: np.ndarray, ref: np.ndarray) -> None:
    np.testing.assert_array_equal(np.isneginf(ours), np.isneginf(ref))
    finite = ~np.isneginf(ref)
    np.testing.assert_allclose(ours[finite], ref[finite], rtol=1e-6, atol=1e-6)


def mlx_sampler(c: Config, special=SPECIAL):
    return make_sampler(
        temp=c.temperature,
        top_p=c.top_p,
        min_p=c.min_p,
        top_k=c.top_k,
        xtc_probability=c.xtc_probability,
        xtc_threshold=c.xtc_threshold,
        xtc_special_tokens=list(special),
    )


def mlx_processors(c: Config):
    return make_logits_processors(
        logit_bias=c.logit_bias,
        repetition_penalty=c.repetition_penalty,
        repetition_context_size=c.repetition_context_size,
        presence_penalty=c.presence_penalty,
        presence_context_size=c.presence_context_size,
        frequency_penalty=c.frequency_penalty,
        frequency_context_size=c.frequency_context_size,
    )


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------

INVALID = [
    (dict(temperature=-0.5), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.01), "min_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(xtc_probability=1.5), "xtc_probability"),
    (dict(xtc_threshold=0.6), "xtc_threshold"),
    (dict(xtc_threshold=float("nan")), "xtc_threshold"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(repetition_context_size=0), "repetition_context_size"),
    (dict(presence_context_size=0), "presence_context_size"),
    (dict(frequency_context_size=-3), "frequency_context_size"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=float("inf")), "frequency_penalty"),
    (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[(1, 2.0)]), "logit_bias"),
    (dict(seed=-1), "seed"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
]


@pytest.mark.parametrize("kwargs,name", INVALID, ids=[f"{n}-{i}" for i, (_, n) in enumerate(INVALID)])
def test_invalid_config_names_parameter(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        Config(**kwargs)


def test_logit_bias_outside_vocab_names_parameter():
    c = Config(logit_bias={5: 1.0, 99: 2.0})
    c.validate(100)  # fine
    with pytest.raises(ValueError, match=r"^logit_bias"):
        c.validate(99)
    with pytest.raises(ValueError, match=r"^logit_bias"):
        S.make_sampling_params([Config(), c], vocab_size=50)


def test_valid_edge_values_accepted():
    c = Config(
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        xtc_probability=1,
        xtc_threshold=0.5,
        repetition_penalty=1.3,
        repetition_context_size=1,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias={0: -5, 7: 2.5},
        seed=2**64 - 1,
        logprobs=20,
    )
    assert c.temperature == 0.7 and c.xtc_probability == 1.0 and c.logit_bias == {0: -5.0, 7: 2.5}
    assert c.features(100) == {"random", "min_p", "xtc", "penalties", "bias"}
    with pytest.raises(ValueError, match=r"^special_token_ids"):
        S.make_sampling_params([c], 10, special_token_ids=[10])


def test_params_hold_mlx_lm_host_arithmetic():
    # mlx-lm computes 1.0 / temp and math.log(min_p) on Python floats (float64) and the
    # result is rounded to float32 when it meets the array; doing it in float32 on device
    # differs in the last bit for some values, so the params carry the host results.
    temps = [0.7, 0.3, 1.1, 1.7, 0.9, 0.6]
    mins = [0.05, 0.3, 0.7, 0.01, 0.11, 0.9]
    p = S.make_sampling_params([Config(temperature=t, min_p=m) for t, m in zip(temps, mins)], 16)
    want_inv = np.array([1.0 / t for t in temps], dtype=np.float32)
    want_log = np.array([math.log(m) for m in mins], dtype=np.float32)
    np.testing.assert_array_equal(np.array(p.inv_temperature), want_inv)
    np.testing.assert_array_equal(np.array(p.log_min_p), want_log)
    f32_inv = np.float32(1.0) / np.array(temps, dtype=np.float32)
    assert (f32_inv != want_inv).any()  # the float32 route would really differ
    g = S.make_sampling_params([Config()], 16)
    assert np.array(g.inv_temperature).tolist() == [1.0] and np.isneginf(np.array(g.log_min_p)).all()


def test_features_union_and_greedy_only():
    V = 64
    p = S.make_sampling_params([Config(), Config(top_p=0.5, top_k=3, min_p=0.1)], V)
    assert p.features == frozenset()  # filters are ignored for greedy rows, as in mlx-lm
    p = S.make_sampling_params(
        [Config(temperature=1.0, top_k=V), Config(repetition_penalty=1.1), Config(temperature=0.5, top_p=0.9)], V
    )
    assert p.features == {"random", "penalties", "top_p"}  # top_k >= V is a no-op
    assert p.logit_bias.shape == (3, 0) and p.xtc_special.shape == (3, 0)
    p = S.make_sampling_params([Config(logit_bias={1: 1.0}), Config(temperature=1, xtc_probability=0.1)], V)
    assert p.features == {"bias", "random", "xtc"}
    assert p.logit_bias.shape == (2, V) and p.xtc_special.shape == (2, V)


# --------------------------------------------------------------------------------------
# History helpers
# --------------------------------------------------------------------------------------


def test_history_right_aligned_and_push():
    h = init_history([[1, 2, 3], [], list(range(10, 30))], 8)
    assert h.dtype == mx.int32
    assert h.tolist() == [
        [-1, -1, -1, -1, -1, 1, 2, 3],
        [-1] * 8,
        list(range(22, 30)),
    ]
    h2 = push_history(h, mx.array([7, 8, 9], dtype=mx.int32))
    assert h2.tolist() == [
        [-1, -1, -1, -1, 1, 2, 3, 7],
        [-1] * 7 + [8],
        list(range(23, 30)) + [9],
    ]
    assert S.history_width([Config(repetition_penalty=1.1, repetition_context_size=40)]) == 64
    with pytest.raises(ValueError, match="prompt_ids_per_row"):
        init_history([[1, 2], [3, 100]], 4, vocab_size=100)
    assert S.history_width([Config()]) == 16


# --------------------------------------------------------------------------------------
# Parity with mlx-lm, per filter, per row
# --------------------------------------------------------------------------------------


def test_filters_match_mlx_lm_per_row():
    V = 300
    rows = [
        Config(),  # greedy: untouched
        Config(temperature=1.0, top_p=0.9),
        Config(temperature=0.7, top_p=0.3),
        Config(temperature=1.0, min_p=0.05),
        Config(temperature=1.0, min_p=0.5),
        Config(temperature=1.0, top_k=1),
        Config(temperature=1.0, top_k=17),
        Config(temperature=1.0, xtc_probability=1.0, xtc_threshold=0.02, seed=3),
        Config(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.01, seed=4),
        Config(temperature=1.0, xtc_probability=0.5, xtc_threshold=0.01, seed=5),
        Config(temperature=0.8, top_p=0.95, min_p=0.01, xtc_probability=0.7, xtc_threshold=0.01, top_k=20, seed=6),
        Config(temperature=0.9, top_p=0.8, top_k=5),
    ]
    params = S.make_sampling_params(rows, V, special_token_ids=SPECIAL)
    raw = np32(rand_logits(len(rows), V, seed=0))
    raw[:, 1] = raw.max(axis=1) + 0.5  # special token 1 is every row's top token: XTC must spare it
    logits = mx.array(raw)
    lp = to_logprobs(logits)
    keys = init_keys(rows)
    ours, keys_after = apply_filters(lp, params, keys)
    ours, keys_after = np32(ours), np.array(keys_after)

    xtc_removed_any = False
    for r, c in enumerate(rows):
        x = mx.array(np.array(lp[r : r + 1]))
        if c.temperature > 0:
            if c.seed is not None:
                mx.random.seed(c.seed)
            if c.top_p < 1:
                x = apply_top_p(x, c.top_p)
            if c.min_p > 0:
                x = apply_min_p(x, c.min_p)
            if c.xtc_probability > 0:
                before = np32(x)
                x = apply_xtc(x, c.xtc_probability, c.xtc_threshold, list(SPECIAL))
                xtc_removed_any |= bool((np.isneginf(np32(x)) != np.isneginf(before)).any())
                # the row's key advanced exactly like mlx-lm's global state
                np.testing.assert_array_equal(keys_after[r], np.array(mx.random.state[0]))
            if c.top_k > 0:
                x = apply_top_k(x, c.top_k)
        if not (c.temperature > 0 and c.xtc_probability > 0):
            np.testing.assert_array_equal(keys_after[r], np.array(keys[r]))
        assert_same_support_close(ours[r], np32(x)[0])
    assert xtc_removed_any  # the XTC rows exercised the removal branch
    assert not np.isneginf(ours[7, 1])  # ... and kept the special token
    assert np.isinf(ours[1]).any() and np.isinf(ours[6]).sum() == V - 17


def test_penalties_and_bias_match_mlx_lm_per_row():
    V, W = 200, 32
    rng = np.random.default_rng(1)
    rows = [
        (Config(repetition_penalty=1.3, repetition_context_size=5), 12),
        (Config(repetition_penalty=0.7, repetition_context_size=20), 40),  # longer than W
        (Config(presence_penalty=0.7, presence_context_size=8), 15),
        (Config(frequency_penalty=0.4, frequency_context_size=12), 25),
        (Config(frequency_penalty=-0.3, frequency_context_size=30), 30),
        (
            Config(
                repetition_penalty=1.2,
                repetition_context_size=3,
                presence_penalty=0.5,
                presence_context_size=6,
                frequency_penalty=0.25,
                frequency_context_size=20,
                logit_bias={0: 3.0, 5: -2.5, 199: 1.0},
            ),
            18,
        ),
        (Config(logit_bias={7: 10.0}), 6),
        (Config(), 9),
        (Config(presence_penalty=1.0, repetition_penalty=1.5), 0),  # empty history
    ]
    configs = [c for c, _ in rows]
    # small token range => many repeats inside each window
    seqs = [rng.integers(0, 12, size=n).tolist() for _, n in rows]
    params = S.make_sampling_params(configs, V)
    assert params.features == {"penalties", "bias"}
    logits = rand_logits(len(rows), V, seed=2)
    logits = mx.where(mx.arange(V)[None, :] % 3 == 0, -mx.abs(logits), mx.abs(logits))  # both signs
    history = init_history(seqs, W)
    ours = np32(process_logits(logits, history, params))
    for r, (c, seq) in enumerate(zip(configs, seqs)):
        x = mx.array(np.array(logits[r : r + 1]))
        if seq:
            tokens = mx.array(seq)
            for proc in mlx_processors(c):
                x = proc(tokens, x)
        else:
            for proc in mlx_processors(c)[:1] if c.logit_bias else []:
                x = proc(mx.array([], dtype=mx.int32), x)
        ref = np32(x)[0]
        assert_same_support_close(ours[r], ref)
        if not c.features(V):
            np.testing.assert_array_equal(ours[r], np32(logits)[r])
    # the frequency row really counts occurrences (not just presence)
    seq = seqs[3][-12:]
    tok = max(set(seq), key=seq.count)
    assert seq.count(tok) >= 2
    np.testing.assert_allclose(ours[3, tok], np32(logits)[3, tok] - 0.4 * seq.count(tok), rtol=1e-6)


# --------------------------------------------------------------------------------------
# The categorical draw and seeded generation vs mlx-lm's global PRNG state
# --------------------------------------------------------------------------------------


def test_categorical_rows_matches_mlx_categorical_on_1xV():
    # mlx-lm samples categorical on [1, V]. In this MLX build that is an inverse-CDF draw,
    # while a [V]-shaped call uses Gumbel-max, so the two are NOT interchangeable; our
    # per-row formulation must equal the [1, V] call for every row and key.
    V, B = 257, 6
    x = rand_logits(B, V, seed=3)
    x = mx.where(mx.array(np.random.default_rng(4).random((B, V)) < 0.5), -mx.inf, x)  # filtered
    edge = np.full((3, V), -np.inf, dtype=np.float32)
    edge[0, 17] = 0.0  # one finite token
    edge[1, [3, 9]] = np.inf  # +inf entries: mass concentrated there
    edge[2, :] = -1.0  # uniform
    x = mx.concatenate([x, mx.array(edge)])
    mismatches_1d = 0
    for s in range(40):
        keys = mx.stack([mx.random.key(1000 * s + b) for b in range(x.shape[0])])
        ours = S._categorical_rows(x, keys).tolist()
        ref = [mx.random.categorical(x[b : b + 1], key=keys[b]).item() for b in range(x.shape[0])]
        assert ours == ref
        mismatches_1d += sum(
            mx.random.categorical(x[b], key=keys[b]).item() != ref[b] for b in range(B)
        )
        assert ours[B] == 17 and ours[B + 1] in (3, 9)  # single finite token; +inf entries
    print(f"[V]-shaped categorical disagreed with [1,V] on {mismatches_1d}/{40 * B} draws")


SEEDED_ROWS = [
    Config(temperature=0.7, seed=11),
    Config(temperature=1.3, top_p=0.9, seed=12),
    Config(temperature=1.0, xtc_probability=0.6, xtc_threshold=0.02, seed=13),
    Config(temperature=0.9, min_p=0.02, top_k=30, xtc_probability=1.0, xtc_threshold=0.03, seed=14),
    Config(),  # greedy
    Config(
        temperature=1.1,
        top_p=0.95,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        frequency_context_size=7,
        logit_bias={4: 2.0, 8: -1.0},
        seed=15,
    ),
    Config(repetition_penalty=1.5, repetition_context_size=4),  # greedy + penalty
]


def _mlx_lm_generate(c: Config, prompt: list[int], step_logits: list[mx.array], row: int) -> list[int]:
    """mlx-lm's generate_step loop for one row, with fixed per-step logits."""
    sampler = mlx_sampler(c)
    procs = mlx_processors(c)
    mx.random.seed(c.seed if c.seed is not None else 0)
    tokens = list(prompt)
    out = []
    for lg in step_logits:
        x = mx.array(np.array(lg[row : row + 1]))
        t = mx.array(tokens)
        for p in procs:
            x = p(t, x)
        lp = x - mx.logsumexp(x, keepdims=True)
        y = sampler(lp).item()
        out.append(y)
        tokens.append(y)
    return out


def _ours_generate(configs, prompts, step_logits, rows=None, fn=None):
    rows = list(range(len(configs))) if rows is None else rows
    cfgs = [configs[r] for r in rows]
    V = step_logits[0].shape[1]
    params = S.make_sampling_params(cfgs, V, special_token_ids=SPECIAL)
    W = S.history_width(cfgs)
    history = init_history([prompts[r] for r in rows], W)
    keys = init_keys(cfgs)
    out = []
    for lg in step_logits:
        lg = lg[mx.array(rows)]
        if fn is None:
            x = process_logits(lg, history, params)
            toks, _, keys = sample(x, params, keys)
            history = push_history(history, toks)
        else:
            toks, _, keys, history = fn(lg, history, params, keys)
        out.append(toks.tolist())
    return np.array(out).T.tolist()  # [rows, steps]


def _step_logits(B, V, steps, seed):
    return [rand_logits(B, V, seed=seed + i, scale=2.5) for i in range(steps)]


def test_seeded_generation_reproduces_mlx_lm_bitwise():
    V, steps = 256, 10
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, 16, size=int(rng.integers(1, 12))).tolist() for _ in SEEDED_ROWS]
    step_logits = _step_logits(len(SEEDED_ROWS), V, steps, seed=100)
    ours = _ours_generate(SEEDED_ROWS, prompts, step_logits)
    for r, c in enumerate(SEEDED_ROWS):
        assert ours[r] == _mlx_lm_generate(c, prompts[r], step_logits, r), f"row {r}: {c}"
    assert len({tuple(t) for t in ours}) == len(ours)


def test_row_tokens_independent_of_batch():
    V, steps = 256, 8
    prompts = [[1, 2, 3, 4, 5, 3, 3]] * len(SEEDED_ROWS)
    step_logits = _step_logits(len(SEEDED_ROWS), V, steps, seed=200)
    full = _ours_generate(SEEDED_ROWS, prompts, step_logits)
    for r in range(len(SEEDED_ROWS)):
        alone = _ours_generate(SEEDED_ROWS, prompts, step_logits, rows=[r])
        assert alone[0] == full[r]
    perm = [3, 0, 6, 5, 2, 1, 4]
    permuted = _ours_generate(SEEDED_ROWS, prompts, step_logits, rows=perm)
    assert permuted == [full[r] for r in perm]
    # a different neighbour (other seed, other settings) does not change row 1
    mixed = [SEEDED_ROWS[1], Config(temperature=2.0, top_k=3, seed=999)]
    two = _ours_generate(mixed, [prompts[1]] * 2, [s[mx.array([1, 0])] for s in step_logits])
    assert two[0] == full[1]


def test_seed_changes_tokens_and_keys():
    V = 128
    cfgs = [Config(temperature=1.0, seed=1), Config(temperature=1.0, seed=2)]
    np.testing.assert_array_equal(np.array(init_keys(cfgs)[0]), np.array(mx.random.key(1)))
    logits = mx.zeros((2, V))  # identical rows: only the keys differ
    p = S.make_sampling_params(cfgs, V)
    toks, keys = [], init_keys(cfgs)
    for _ in range(5):
        t, _, keys = sample(logits, p, keys)
        toks.append(t.tolist())
    a, b = zip(*toks)
    assert a != b


def test_logprobs_output_and_greedy():
    V = 100
    cfgs = [Config(), Config(temperature=0.8, top_k=3, seed=1)]
    p = S.make_sampling_params(cfgs, V)
    logits = rand_logits(2, V, seed=9)
    keys = init_keys(cfgs)
    toks, lp, new_keys = sample(logits, p, keys)
    np.testing.assert_allclose(np32(lp), np32(to_logprobs(logits)), rtol=0, atol=1e-6)
    assert toks.dtype == mx.int32 and toks[0].item() == int(np.argmax(np32(logits)[0]))
    assert int(toks[1].item()) in np.argsort(-np32(logits)[1])[:3].tolist()
    np.testing.assert_array_equal(np.array(new_keys[0]), np.array(keys[0]))  # greedy: untouched
    assert not np.array_equal(np.array(new_keys[1]), np.array(keys[1]))


def test_top_logprobs():
    lp = to_logprobs(rand_logits(3, 50, seed=5))
    ids, vals = top_logprobs(lp, 4)
    ref = np.argsort(-np32(lp), axis=-1)[:, :4]
    np.testing.assert_array_equal(np.array(ids), ref)
    np.testing.assert_array_equal(np32(vals), np.take_along_axis(np32(lp), ref, axis=-1))
    assert ids.dtype == mx.int32
    ids0, vals0 = top_logprobs(lp, 0)
    assert ids0.shape == (3, 0) and vals0.shape == (3, 0)
    assert S.num_top_logprobs([Config(logprobs=3), Config(logprobs=7)]) == 7


# --------------------------------------------------------------------------------------
# Hypothesis properties
# --------------------------------------------------------------------------------------


def _distinct_logits(seed: int, B: int, V: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    perm = np.stack([rng.permutation(V) for _ in range(B)]).astype(np.float32)
    return (perm * 0.25 - V / 8.0).astype(np.float32)


@HYP
@given(seed=st.integers(0, 2**31 - 1), ks=st.lists(st.integers(0, 70), min_size=1, max_size=5))
def test_property_top_k_keeps_exactly_top_k(seed, ks):
    V = 64
    x = _distinct_logits(seed, len(ks), V)
    params = S.make_sampling_params([Config(temperature=1.0, top_k=k) for k in ks], V)
    lp = to_logprobs(mx.array(x))
    out, _ = apply_filters(lp, params, init_keys([Config()] * len(ks)))
    kept = ~np.isneginf(np32(out))
    for r, k in enumerate(ks):
        want = np.zeros(V, bool)
        want[np.argsort(-x[r])[: (k if 0 < k < V else V)]] = True
        np.testing.assert_array_equal(kept[r], want)


@HYP
@given(seed=st.integers(0, 2**31 - 1), ps=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4))
def test_property_top_p_keeps_smallest_prefix_reaching_p(seed, ps):
    V = 48
    x = rand_logits(len(ps), V, seed=seed, scale=2.0)
    lp = to_logprobs(x)
    params = S.make_sampling_params([Config(temperature=1.0, top_p=p) for p in ps], V)
    out, _ = apply_filters(lp, params, init_keys([Config()] * len(ps)))
    kept = ~np.isneginf(np32(out))
    probs = np.exp(np32(lp).astype(np.float64))
    for r, p in enumerate(ps):
        order = np.argsort(-probs[r], kind="stable")
        mass_before = np.concatenate([[0.0], np.cumsum(probs[r][order])[:-1]]) / probs[r].sum()
        assume(np.min(np.abs(mass_before - p)) > 1e-5)  # not on a rounding boundary
        n = int((mass_before < p).sum())  # smallest prefix whose mass reaches p
        want = np.zeros(V, bool)
        want[order[:n]] = True
        np.testing.assert_array_equal(kept[r], want)


@HYP
@given(seed=st.integers(0, 2**31 - 1), ms=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4))
def test_property_min_p_keeps_tokens_above_scaled_max(seed, ms):
    V = 48
    x = rand_logits(len(ms), V, seed=seed, scale=2.0)
    lp = to_logprobs(x)
    params = S.make_sampling_params([Config(temperature=1.0, min_p=m) for m in ms], V)
    out, _ = apply_filters(lp, params, init_keys([Config()] * len(ms)))
    kept = ~np.isneginf(np32(out))
    probs = np.exp(np32(lp).astype(np.float64))
    for r, m in enumerate(ms):
        ratio = probs[r] / probs[r].max()
        assume(m == 0.0 or np.min(np.abs(ratio - m)) > 1e-5)
        np.testing.assert_array_equal(kept[r], ratio >= m)


@HYP
@given(
    seed=st.integers(0, 2**31 - 1),
    rep=st.one_of(st.none(), st.floats(0.5, 2.0)),
    pres=st.floats(-1.0, 1.0),
    freq=st.floats(-1.0, 1.0),
    ctx=st.tuples(st.integers(1, 20), st.integers(1, 20), st.integers(1, 20)),
    n=st.integers(0, 30),
)
def test_property_penalties_only_touch_window(seed, rep, pres, freq, ctx, n):
    V, W = 40, 16
    rng = np.random.default_rng(seed)
    seq = rng.integers(0, V, size=n).tolist()
    c = Config(
        repetition_penalty=rep,
        repetition_context_size=ctx[0],
        presence_penalty=pres,
        presence_context_size=ctx[1],
        frequency_penalty=freq,
        frequency_context_size=ctx[2],
    )
    x = rand_logits(1, V, seed=seed)
    params = S.make_sampling_params([c, Config(presence_penalty=0.5)], V)
    history = init_history([seq, seq], W)
    out = np32(process_logits(mx.concatenate([x, x]), history, params))
    tail = seq[-W:]
    window = set()
    for size, on in zip(ctx, (rep is not None, pres != 0, freq != 0)):
        if on:
            window |= set(tail[-size:])
    outside = np.array([t not in window for t in range(V)])
    np.testing.assert_array_equal(out[0][outside], np32(x)[0][outside])
    # the second row (presence 0.5, window 20 capped at W): exactly -0.5 once per distinct token
    pres_window = sorted(set(tail[-20:]))
    ref = np32(x)[0].copy()
    ref[pres_window] = ref[pres_window] - np.float32(0.5)
    np.testing.assert_array_equal(out[1], ref)


@HYP
@given(
    seed=st.integers(0, 2**31 - 1),
    bias=st.dictionaries(st.integers(0, 39), st.floats(-50, 50, width=32), max_size=8),
)
def test_property_logit_bias_adds_exactly(seed, bias):
    V = 40
    x = rand_logits(2, V, seed=seed)
    params = S.make_sampling_params([Config(logit_bias=bias), Config(logit_bias={0: 1.0})], V)
    out = np32(process_logits(x, init_history([[], []], 4), params))
    ref = np32(x).copy()
    for t, v in bias.items():
        ref[0, t] = ref[0, t] + np.float32(v)
    ref[1, 0] += np.float32(1.0)
    np.testing.assert_array_equal(out, ref)


# --------------------------------------------------------------------------------------
# Compilation: bitwise equal to eager, no retrace across settings, greedy = argmax only
# --------------------------------------------------------------------------------------


def _step(logits, history, params, keys):
    x = S.process_logits(logits, history, params)
    toks, lp, keys = S.sample(x, params, keys)
    return toks, lp, keys, S.push_history(history, toks)


def test_compiled_equals_eager_and_does_not_retrace():
    V, steps = 256, 6
    step_fn = jit(_step)
    cfgs = SEEDED_ROWS
    prompts = [[1, 2, 3, 2, 1]] * len(cfgs)
    step_logits = _step_logits(len(cfgs), V, steps, seed=300)
    params = S.make_sampling_params(cfgs, V, special_token_ids=SPECIAL)
    history = init_history(prompts, S.history_width(cfgs))
    k_eager = k_jit = init_keys(cfgs)
    h_eager = h_jit = history
    for lg in step_logits:
        te, le, k_eager, h_eager = _step(lg, h_eager, params, k_eager)
        tj, lj, k_jit, h_jit = step_fn(lg, h_jit, params, k_jit)
        for a, b in ((te, tj), (le, lj), (k_eager, k_jit), (h_eager, h_jit)):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert step_fn.traces == 1
    # same features, different values (other temperatures, seeds, penalties, biases)
    other = [
        Config(temperature=0.3, seed=1),
        Config(temperature=2.0, top_p=0.5, seed=2),
        Config(temperature=0.5, xtc_probability=0.1, xtc_threshold=0.3, seed=3),
        Config(temperature=0.6, min_p=0.2, top_k=2, xtc_probability=0.2, seed=4),
        Config(temperature=0.4, seed=9),
        Config(temperature=1.0, repetition_penalty=2.0, logit_bias={9: -3.0}, seed=5),
        Config(presence_penalty=0.9),
    ]
    p2 = S.make_sampling_params(other, V, special_token_ids=SPECIAL)
    assert p2.features == params.features
    step_fn(step_logits[0], history, p2, init_keys(other))
    assert step_fn.traces == 1
    # a batch with other features is a new structure (so the counter does count)
    p3 = S.make_sampling_params([Config()] * len(cfgs), V)
    step_fn(step_logits[0], history, p3, init_keys([Config()] * len(cfgs)))
    assert step_fn.traces == 2


def _graph_ops(tmp_path, name, *outputs) -> str:
    path = tmp_path / f"{name}.dot"
    mx.export_to_dot(str(path), *outputs)
    return path.read_text()


def test_greedy_only_batch_compiles_to_argmax(tmp_path):
    V = 128
    logits = rand_logits(3, V, seed=1)
    greedy = S.make_sampling_params([Config(), Config(top_p=0.5), Config()], V)
    toks, _, _ = sample(logits, greedy, init_keys([Config()] * 3))
    g = _graph_ops(tmp_path, "greedy", toks)
    for op in ("Sort", "CumSum", "RandomBits"):
        assert op not in g
    assert "ArgReduce" in g
    mixed = S.make_sampling_params([Config(), Config(temperature=1.0, top_p=0.5), Config()], V)
    toks, _, _ = sample(logits, mixed, init_keys([Config()] * 3))
    g = _graph_ops(tmp_path, "mixed", toks)
    for op in ("Sort", "CumSum", "RandomBits"):
        assert op in g
    nosort = S.make_sampling_params([Config(temperature=1.0, min_p=0.1)], V)
    toks, _, _ = sample(logits[:1], nosort, init_keys([Config()]))
    assert "Sort" not in _graph_ops(tmp_path, "nosort", toks)


# --------------------------------------------------------------------------------------
# Shape/dtype checking
# --------------------------------------------------------------------------------------


def test_shape_checking_catches_wrong_shapes():
    from jaxtyping import TypeCheckError

    V = 32
    cfgs = [Config(temperature=1.0, seed=1), Config()]
    p = S.make_sampling_params(cfgs, V)
    logits = rand_logits(2, V, seed=0)
    keys = init_keys(cfgs)
    sample(logits, p, keys)  # fine
    with pytest.raises(TypeCheckError):
        sample(logits, p, keys[:1])  # B mismatch between logits and keys
    with pytest.raises(TypeCheckError):
        sample(logits.astype(mx.float16), p, keys)  # dtype
    with pytest.raises(TypeCheckError):
        sample(logits, p, keys.astype(mx.int32))
    with pytest.raises(TypeCheckError):
        process_logits(logits, mx.zeros((3, 8), dtype=mx.int32), p)  # history batch
    with pytest.raises(TypeCheckError):
        push_history(mx.zeros((2, 8), dtype=mx.int32), mx.zeros((3,), dtype=mx.int32))
    with pytest.raises(TypeCheckError):
        top_logprobs(logits[0], 3)  # rank
    # params is not shape-annotated per field; the functions check it themselves
    with pytest.raises(ValueError, match="batch"):
        S.sample(rand_logits(3, V, seed=0), p, init_keys(cfgs + [Config()]))
    with pytest.raises(ValueError, match="vocab"):
        S.sample(rand_logits(2, V + 1, seed=0), p, keys)


def test_fast_logsumexp_compiled_equals_the_plain_formula():
    """_fast_logsumexp is shaped so that mx.compile does not fuse its log into every logit;
    the values must stay those of the plain keepdims formula, compiled or not, bit for bit."""
    from fx_engine.core.nn import fast_exp

    def plain(x):
        m = mx.max(x, axis=-1, keepdims=True)
        m = mx.where(mx.isinf(m), 0.0, m)
        return x - (m + mx.log(mx.sum(fast_exp(x - m), axis=-1, keepdims=True)))

    rng = np.random.default_rng(7)
    x = mx.array((rng.standard_normal((5, 3000)) * 6).astype(np.float32))
    x = mx.concatenate([x, mx.full((1, 3000), -mx.inf)])  # an all -inf row, as mx.logsumexp
    want = plain(x)
    for f in (lambda v: v - S._fast_logsumexp(v), mx.compile(lambda v: v - S._fast_logsumexp(v))):
        got = f(x)
        assert mx.array_equal(got, want, equal_nan=True).item()
