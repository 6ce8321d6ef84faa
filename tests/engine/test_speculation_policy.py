"""The speculation policy (fx_engine/engine/speculation.py), pure Python: the step-cost
model, the choice of K, and each row's adaptive draft length and back-off."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_engine.engine.speculation import (GAIN_MARGIN, MAX_SKIP, DraftState, SpeculationPolicy,
                                          expected_accepted)

seconds = st.floats(1e-4, 1.0, allow_nan=False)
alphas = st.floats(0.0, 1.0, allow_nan=False)
drafts_st = st.lists(st.tuples(alphas, st.integers(1, 16)), min_size=1, max_size=8)


def rate(policy, rows, drafts, live, k, extra=0.0):
    """Expected tokens per second of a step with K = k (what choose_k maximises)."""
    if k == 0:
        return live / policy.step_cost(rows, 0)
    gain = live + sum(expected_accepted(a, min(k, n)) for a, n in drafts)
    return gain / (policy.step_cost(rows, k) + extra)


def candidates(drafts):
    longest = max(n for _, n in drafts)
    out, k = [0], 1
    while k < 2 * longest:
        out.append(k)
        k *= 2
    return [k for k in out if k == 0 or k <= 1 << (longest - 1).bit_length()]


@st.composite
def policies(draw, rows=4):
    """A policy with a measured decode cost and some measured verify costs."""
    p = SpeculationPolicy()
    p.observe(rows, 0, draw(seconds))
    for k in draw(st.lists(st.sampled_from([1, 2, 4, 8, 16]), max_size=5)):
        for s in draw(st.lists(seconds, min_size=1, max_size=3)):
            p.observe(rows, k, s)
    return p


def test_no_speculation_until_a_decode_step_was_timed():
    p = SpeculationPolicy()
    assert p.choose_k(4, [(1.0, 16)], 4) == 0
    p.observe(2, 0, 0.01)  # another row bucket
    assert p.choose_k(4, [(1.0, 16)], 4) == 0
    assert p.step_cost(4, 4) is None and p.step_cost(2, 4) == pytest.approx(0.02)


@settings(max_examples=300, deadline=None)
@given(policy=policies(), drafts=drafts_st, extra_live=st.integers(0, 8),
       extra=st.floats(0.0, 0.1, allow_nan=False))
def test_choose_k_maximises_expected_tokens_per_second(policy, drafts, extra_live, extra):
    """K is 0 or a power of two up to the bucket of the longest draft; every candidate K'
    (0 included) has rate(K') <= GAIN_MARGIN x rate(K); a K > 0 beats decoding by the margin."""
    live = len(drafts) + extra_live
    k = policy.choose_k(4, drafts, live, extra)
    longest = max(n for _, n in drafts)
    assert k == 0 or (k & (k - 1) == 0 and k < 2 * longest)
    chosen = rate(policy, 4, drafts, live, k, extra)
    for c in candidates(drafts):
        assert rate(policy, 4, drafts, live, c, extra) <= GAIN_MARGIN * chosen * (1 + 1e-12)
    if k:
        assert chosen > GAIN_MARGIN * rate(policy, 4, drafts, live, 0)


@settings(max_examples=200, deadline=None)
@given(base=seconds, drafts=st.lists(st.integers(1, 16), min_size=1, max_size=8),
       extra_live=st.integers(0, 8), extra=st.floats(0.0, 0.1, allow_nan=False))
def test_drafts_that_are_never_accepted_never_pay(base, drafts, extra_live, extra):
    """With the estimated verify costs (decode x (1 + K/4)), zero acceptance never verifies."""
    p = SpeculationPolicy()
    p.observe(2, 0, base)
    assert p.choose_k(2, [(0.0, n) for n in drafts], len(drafts) + extra_live, extra) == 0


@settings(max_examples=200, deadline=None)
@given(base=seconds, drafts=st.lists(st.integers(1, 16), min_size=1, max_size=8))
def test_drafts_that_are_always_accepted_pay_when_every_row_drafts(base, drafts):
    p = SpeculationPolicy()
    p.observe(8, 0, base)
    assert p.choose_k(8, [(1.0, n) for n in drafts], len(drafts)) > 0


@given(costs=st.lists(seconds, min_size=1, max_size=10))
def test_observe_is_an_ema_per_row_bucket_and_k(costs):
    p = SpeculationPolicy()
    ema = None
    for c in costs:
        p.observe(2, 4, c)
        ema = c if ema is None else 0.7 * ema + 0.3 * c
    assert p.step_cost(2, 4) == pytest.approx(ema)
    assert p.step_cost(4, 4) is None and p.step_cost(2, 0) is None


@settings(max_examples=300, deadline=None)
@given(k_max=st.integers(1, 16), steps=st.lists(st.tuples(st.integers(1, 16), st.floats(0, 1)),
                                                max_size=40))
def test_adapt_keeps_k_in_range_and_backs_off(k_max, steps):
    """Drafts are at most the row's k (plan caps them): k stays in [1, k_max], doubles after
    a fully accepted draft, becomes accepted + 1 after a partial one; fully rejected drafts
    in a row back off 2, 4, ... up to 64 steps; any accepted token resets the misses."""
    d = DraftState(k_max)
    misses = drafted = accepted = 0
    for n, frac in steps:
        n = min(n, d.k)
        a = math.floor(frac * n)
        old_k = d.k
        d.adapt(n, a)
        drafted, accepted = drafted + n, accepted + a
        assert 1 <= d.k <= k_max
        assert 0.0 <= d.alpha <= 1.0
        if a == n:
            assert d.k == min(k_max, 2 * old_k)  # fully accepted: doubles
        else:
            assert d.k == a + 1  # just past what was accepted
        misses = 0 if a else misses + 1
        assert d.misses == misses
        if a == 0 and misses >= 2:
            assert d.skip == min(MAX_SKIP, 2 ** (misses - 1))  # 2, 4, ... up to 64
        assert 0 <= d.skip <= MAX_SKIP
    assert (d.drafted, d.accepted) == (drafted, accepted)


@given(k_max=st.integers(1, 16), skip=st.integers(0, MAX_SKIP), left=st.integers(0, 100))
def test_plan_skips_while_backing_off_and_caps_by_what_is_left(k_max, skip, left):
    d = DraftState(k_max)
    d.skip = skip
    for _ in range(skip):
        assert d.plan(left) == 0
    assert d.skip == 0
    assert d.plan(left) == max(0, min(k_max, left - 1))


@settings(max_examples=200, deadline=None)
@given(policy=policies(), rows=st.lists(st.tuples(st.integers(1, 16), st.integers(0, 4),
                                                  st.integers(0, 40), alphas),
                                        min_size=1, max_size=8),
       extra_live=st.integers(0, 4))
def test_plan_drafts(policy, rows, extra_live):
    """Only candidate rows draft, each at most its k and what it may still generate minus
    one; nothing is drafted unless choose_k (with the drafters' time) expects it to pay."""
    cands = {}
    for i, (k_max, skip, left, alpha) in enumerate(rows):
        d = DraftState(k_max)
        d.skip, d.alpha = skip, alpha
        cands[i] = (d, left)
    skips = {i: d.skip for i, (d, _) in cands.items()}
    live = len(rows) + extra_live
    plan = policy.plan_drafts(4, cands, live)
    for i, n in plan.items():
        d, left = cands[i]
        assert skips[i] == 0 and 1 <= n <= min(d.k, left - 1)
    for i, (d, _) in cands.items():  # backing off rows count one step down
        assert d.skip == max(0, skips[i] - 1)
    if plan:
        assert policy.choose_k(4, [(cands[i][0].alpha, n) for i, n in plan.items()], live,
                               policy.draft_seconds) > 0


@settings(max_examples=50, deadline=None)
@given(base=st.floats(1e-3, 0.1), spike=st.floats(20.0, 1000.0))
def test_one_slow_drafting_step_does_not_switch_drafting_off_for_good(base, spike):
    """A drafting time measured once at a spike (a loaded machine) makes drafting look too
    dear; each step that skips drafting for it decays the estimate, so a row whose drafts
    are always accepted drafts again within a bounded number of steps."""
    policy = SpeculationPolicy()
    policy.observe(4, 0, base)
    for k in (1, 2, 4):
        policy.observe(4, k, base * 1.2)
    policy.observe_drafting(spike * base)
    ds = DraftState(4)
    ds.alpha = 1.0
    for step in range(200):
        if policy.plan_drafts(4, {"row": (ds, 100)}, 4):
            break
    else:
        pytest.fail("drafting never resumed")
    assert step > 0  # (the spike did hold it off at first)
