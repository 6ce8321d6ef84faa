"""Packed rows (fx_engine/core/packing.py): `prefill_step(..., pack=R)` runs its products on
the valid tokens alone and gives the padded step's outputs, for every family that packs;
tokens that do not fit are dropped like tokens past the capacity; what cannot pack refuses."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.core import packing
from fx_engine.core.models import FAMILIES, Capture, family_of
from fx_engine.core.nn import MatmulPlan
from fx_engine.core.steps import prefill_step, prefill_step_compiled
from fx_engine.core.tree import tree_leaves

PACKING_TYPES = [mt for fam in FAMILIES if fam.packs_rows for mt in fam.model_types]
# one model type of every family that does not pack (recurrent layers, own attention)
REFUSING_TYPES = [fam.model_types[0] for fam in FAMILIES if not fam.packs_rows]


# ------------------------------------------------------------------ the index maps


def reference_maps(n_valid: list[int], t: int, pack: int) -> tuple[list[int], list[int | None], list[int | None]]:
    """(fitted counts, packed row of each padded position, padded position of each packed
    row), by walking the rows in order (None: padding)."""
    fit, unpack, pack_of = [], [None] * (len(n_valid) * t), [None] * pack
    j = 0
    for b, n in enumerate(n_valid):
        k = max(0, min(n, pack - j))
        fit.append(k)
        for i in range(k):
            unpack[b * t + i] = j
            pack_of[j] = b * t + i
            j += 1
    return fit, unpack, pack_of


@settings(max_examples=200, deadline=None)
@given(n_valid=st.lists(st.integers(0, 9), min_size=1, max_size=6), t=st.integers(1, 9),
       pack=st.integers(1, 60))
def test_index_maps_match_walking_the_rows(n_valid, t, pack):
    n_valid = [min(n, t) for n in n_valid]
    fit, unpack, pack_of = reference_maps(n_valid, t, pack)
    got_fit = packing.fitted(mx.array(n_valid, mx.int32), pack)
    assert got_fit.tolist() == fit
    got_unpack = packing.unpack_index(got_fit, t).tolist()
    got_pack = packing.pack_index(got_fit, t, pack).tolist()
    assert len(got_unpack) == len(n_valid) * t and len(got_pack) == pack
    assert all(0 <= j < pack for j in got_unpack) and all(0 <= p < len(n_valid) * t for p in got_pack)
    assert [g for g, r in zip(got_unpack, unpack) if r is not None] == [r for r in unpack if r is not None]
    assert [g for g, r in zip(got_pack, pack_of) if r is not None] == [r for r in pack_of if r is not None]
    # the round trip: a padded position's packed row holds that position
    assert all(got_pack[got_unpack[p]] == p for p, r in enumerate(unpack) if r is not None)


@pytest.mark.parametrize("bad", [0, -3, True, 2.0, "16"])
def test_pack_values_are_checked(tiny_model, bad):
    with pytest.raises(ValueError, match="pack must be None or an int >= 1"):
        prefill_step(tiny_model.params, tiny_model.new_cache(1, 32), [[1, 2, 3]], [3], pack=bad)


# ------------------------------------------------------------------ the steps


@pytest.fixture(scope="module")
def bi_tiny(tiny_dir):
    """The tiny model in the batch-invariant mode: its float products give a row the same
    bits at any row count (MLX's matmul may not, in the last bit), so packed == padded
    holds bit for bit on every machine."""
    return fx_engine.load(tiny_dir, batch_invariant=True)


LENGTHS = [5, 0, 17, 9]  # a row with no tokens among them
CHUNK = 32


def _prefill(model, tokens, lengths, pack, capture=None):
    out = prefill_step(model.params, model.new_cache(len(lengths), 64), tokens, mx.array(lengths, mx.int32),
                       span=64, pack=pack, capture=capture)
    mx.eval(*tree_leaves(out))
    return out


def _tokens(model, rows=len(LENGTHS), seed=0):
    rng = np.random.default_rng(seed)
    return mx.array(rng.integers(0, model.config.vocab_size, size=(rows, CHUNK)).astype(np.int32))


def _written(cache, lengths):
    """Each row's written K/V slots of every attention entry (the valid positions)."""
    out = []
    for e in cache.layers:
        for a in tree_leaves(e):
            if a.ndim == 4:  # [B, heads, slots, D]
                out.append([np.array(a[b, :, :n]) for b, n in enumerate(lengths)])
    return out


@pytest.mark.parametrize("model_type", PACKING_TYPES)
def test_packed_prefill_equals_padded(family_folders, model_type):
    """Every family that packs: the logits of each row with tokens, the written K/V and the
    lengths are bitwise the padded step's, for packed rows exactly the tokens, rounded up,
    and all of the padded ones. (The batch-invariant mode: a row's float products do not
    depend on the row count there, as MLX's matmul's may in the last bit; the native
    kernels' never do: the default model's test below.)"""
    model = fx_engine.load(family_folders[model_type], batch_invariant=True)
    assert family_of(model.params).packs_rows
    tokens = _tokens(model)
    ref_logits, ref_cache = _prefill(model, tokens, LENGTHS, None)
    rows = [b for b, n in enumerate(LENGTHS) if n]
    for pack in (sum(LENGTHS), 48, len(LENGTHS) * CHUNK):
        logits, cache = _prefill(model, tokens, LENGTHS, pack)
        assert np.array_equal(np.array(logits)[rows], np.array(ref_logits)[rows]), pack
        assert cache.lengths.tolist() == ref_cache.lengths.tolist() == LENGTHS
        for got, ref in zip(_written(cache, LENGTHS), _written(ref_cache, LENGTHS)):
            assert all(np.array_equal(g, r) for g, r in zip(got, ref))


def test_packed_prefill_equals_padded_on_the_default_model(default_model):
    """The real model's quantized products (the native kernels) at different row counts.
    The kernel the machine's plan measured, pinned without a BLAS GEMM: where the plan runs
    one from some row count up (MatmulPlan.gemm_from; measured so on an Intel Xeon with MKL
    under load), 80 packed rows and 128 padded ones round differently, as the default
    numerics allow (specs/steps.md, row independence)."""
    plan = MatmulPlan(kernel=default_model.params.numerics.matmul.kernel)
    model = default_model if default_model.params.numerics.matmul == plan else fx_engine.load(matmul_plan=plan)
    tokens = _tokens(model, seed=1)
    lengths = [31, 2, 0, 32]
    ref_logits, ref_cache = _prefill(model, tokens, lengths, None)
    logits, cache = _prefill(model, tokens, lengths, 80)
    assert np.array_equal(np.array(logits)[[0, 1, 3]], np.array(ref_logits)[[0, 1, 3]])
    for got, ref in zip(_written(cache, lengths), _written(ref_cache, lengths)):
        assert all(np.array_equal(g, r) for g, r in zip(got, ref))


def test_tokens_past_the_packed_rows_are_dropped_like_past_the_capacity(bi_tiny):
    """pack < the valid tokens: rows fill in order; the row cut short keeps what fitted
    (its length stops there, its K/V those of a prefill of that many tokens) and gets NaN
    logits, as do the rows after it, which keep length 0: never silently wrong."""
    tokens = _tokens(bi_tiny)
    logits, cache = _prefill(bi_tiny, tokens, LENGTHS, 12)  # row 0: 5, row 2: 7 of 17
    assert cache.lengths.tolist() == [5, 0, 7, 0]
    lg = np.array(logits)
    assert np.isfinite(lg[0]).all() and np.isnan(lg[2]).all() and np.isnan(lg[3]).all()
    ref_logits, ref_cache = _prefill(bi_tiny, tokens, [5, 0, 7, 0], None)
    assert np.array_equal(lg[0], np.array(ref_logits)[0])
    for got, ref in zip(_written(cache, [5, 0, 7, 0]), _written(ref_cache, [5, 0, 7, 0])):
        assert all(np.array_equal(g, r) for g, r in zip(got, ref))


def test_compiled_packed_prefill_compiles_once_per_pack(bi_tiny):
    """pack is static: part of the compile key (another value traces again), the counts
    are not (the same value with other counts runs the compiled step)."""
    tokens = _tokens(bi_tiny)
    fn = prefill_step_compiled
    traces = []
    for lengths, pack in (([5, 0, 17, 9], 32), ([1, 2, 3, 4], 32), ([0, 0, 31, 0], 32), ([3, 3, 3, 3], 48)):
        before = len(fn.trace_log)
        out = fn(bi_tiny.params, bi_tiny.new_cache(4, 64), tokens, lengths, span=64, pack=pack)
        traces.append(len(fn.trace_log) - before)
        mx.eval(*tree_leaves(out))
        ref = prefill_step(bi_tiny.params, bi_tiny.new_cache(4, 64), tokens, mx.array(lengths, mx.int32),
                           span=64)
        rows = [b for b, n in enumerate(lengths) if n]
        assert np.array_equal(np.array(out[0])[rows], np.array(ref[0])[rows])
    assert traces[1:] == [0, 0, 1]  # (the first may have been traced by an earlier test)


def test_packed_capture_equals_padded(bi_tiny):
    """Captured hidden states (the drafters' seam) at every valid position are unchanged."""
    tokens = _tokens(bi_tiny)
    capture = Capture(layers=(0, 1), normed=True)
    ref = _prefill(bi_tiny, tokens, LENGTHS, None, capture)[2]
    got = _prefill(bi_tiny, tokens, LENGTHS, 32, capture)[2]
    for b, n in enumerate(LENGTHS):
        assert np.array_equal(np.array(got[b, :n]), np.array(ref[b, :n]))


@pytest.mark.parametrize("model_type", REFUSING_TYPES)
def test_families_that_cannot_pack_refuse(family_folders, model_type):
    model = fx_engine.load(family_folders[model_type])
    with pytest.raises(ValueError, match="do not run on packed rows"):
        _prefill(model, _tokens(model), LENGTHS, 32)


def test_adapters_refuse_packing(tiny_model):
    from fx_engine.core.adapters import Adapters, AdapterBank

    adapters = Adapters(AdapterBank(()), mx.zeros((len(LENGTHS),), mx.int32))
    with pytest.raises(ValueError, match="adapters does not run on packed rows"):
        prefill_step(tiny_model.params, tiny_model.new_cache(len(LENGTHS), 64), _tokens(tiny_model),
                     LENGTHS, pack=32, adapters=adapters)


def test_nan_marks_only_what_did_not_fit(tiny_model):
    """A pack that holds every token marks nothing (the fitted counts are the counts)."""
    logits, _ = _prefill(tiny_model, _tokens(tiny_model), LENGTHS, sum(LENGTHS))
    assert not any(math.isnan(x) for b, n in enumerate(LENGTHS) if n for x in np.array(logits)[b][:8])


def test_fx_engine_prefill_packs_prompts_of_different_lengths(bi_tiny, monkeypatch):
    """`fx_engine.prefill` runs a piece whose rows hold few tokens on packed rows: its logits
    and K/V are those of the same plan's padded prefill_step."""
    from fx_engine.core.buckets import prefill_plan

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, bi_tiny.config.vocab_size, size=n).tolist() for n in (3, 40, 11)]
    lengths = [len(p) for p in prompts]
    from fx_engine.engine import prefill as prefill_module

    seen = _recording(monkeypatch, prefill_module, "prefill_step_compiled")
    logits, cache, _ = fx_engine.prefill(bi_tiny, prompts, room=8, chunk=64)
    assert seen == [64]  # 54 tokens in 3 rows x 64: products on packed_rows(54) = 64
    capacity, pieces = prefill_plan(lengths, 8, 64)
    assert pieces == [(0, 40, 64)]  # one piece, 3 x 64 padded positions for 54 tokens
    tokens = mx.array([(p + [0] * 64)[:64] for p in prompts], mx.int32)
    ref_logits, ref_cache = prefill_step(bi_tiny.params, bi_tiny.new_cache(3, capacity), tokens,
                                         mx.array(lengths, mx.int32), span=capacity)
    assert np.array_equal(np.array(logits), np.array(ref_logits))
    assert cache.lengths.tolist() == lengths
    for got, ref in zip(_written(cache, lengths), _written(ref_cache, lengths)):
        assert all(np.array_equal(g, r) for g, r in zip(got, ref))


# ------------------------------------------------------------------ decode


def _decode_setup(model, active):
    import attrs

    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9], [10]]
    _, cache, state = fx_engine.prefill(model, prompts, room=16)
    return cache, attrs.evolve(state, active=mx.array(active))


@pytest.mark.parametrize("fixture", ["tiny_bi_model", "default_model"])
def test_packed_decode_equals_padded(request, tiny_dir, fixture):
    """A batch with free rows decodes its active rows on packed rows (the output head too):
    the same tokens, logprobs and cache; inactive rows untouched. (The tiny float model in
    the batch-invariant mode, see above; the default model's native kernels as it runs.)"""
    from fx_engine.core.steps import decode_step

    model = fx_engine.load(tiny_dir, batch_invariant=True) if fixture == "tiny_bi_model" else request.getfixturevalue(fixture)
    cache, state = _decode_setup(model, [True, False, True, True])
    ref_state, ref_cache = decode_step(model.params, cache, state)
    mx.eval(*tree_leaves(ref_state), *tree_leaves(ref_cache))
    for pack in (3, 4):
        got_state, got_cache = decode_step(model.params, cache, state, pack=pack)
        mx.eval(*tree_leaves(got_state), *tree_leaves(got_cache))
        assert got_state.tokens.tolist() == ref_state.tokens.tolist()
        assert np.array_equal(np.array(got_state.logprob), np.array(ref_state.logprob))
        assert got_state.active.tolist() == [True, False, True, True] and not any(got_state.full.tolist())
        lengths = got_cache.lengths.tolist()
        assert lengths == ref_cache.lengths.tolist()
        for got, ref in zip(_written(got_cache, lengths), _written(ref_cache, lengths)):
            assert all(np.array_equal(g, r) for g, r in zip(got, ref))


def test_an_active_row_past_the_packed_rows_stops(bi_tiny):
    """pack below the active rows: the rows that fit decode as without it; the next active
    row is not run (its length and token stay) and stops, as a full row does."""
    from fx_engine.core.steps import decode_step

    cache, state = _decode_setup(bi_tiny, [True, False, True, True])
    ref_state, _ = decode_step(bi_tiny.params, cache, state)
    got_state, got_cache = decode_step(bi_tiny.params, cache, state, pack=2)
    assert got_state.tokens.tolist()[:3] == ref_state.tokens.tolist()[:3]
    assert got_state.tokens.tolist()[3] == state.tokens.tolist()[3]
    assert got_state.active.tolist() == [True, False, True, False] and got_state.full.tolist()[3]
    assert got_cache.lengths.tolist() == [5, 2, 4, 1]


@pytest.mark.parametrize("step_name", ["score_step", "hidden_step"])
def test_packed_score_and_hidden_steps_equal_padded(bi_tiny, step_name):
    """The steps that return every position (scoring, embeddings' hidden states) take
    `pack` too: the valid positions bitwise the padded step's, NaN past the packed rows."""
    from fx_engine.core import steps

    step = getattr(steps, step_name)
    tokens = _tokens(bi_tiny)

    def run(pack):
        out = step(bi_tiny.params, bi_tiny.new_cache(len(LENGTHS), 64), tokens, mx.array(LENGTHS, mx.int32),
                   span=64, pack=pack)
        mx.eval(*tree_leaves(out))
        return np.array(out[0]), out[1]

    ref, ref_cache = run(None)
    got, cache = run(sum(LENGTHS))
    for b, n in enumerate(LENGTHS):
        assert np.array_equal(got[b, :n], ref[b, :n])
    assert cache.lengths.tolist() == ref_cache.lengths.tolist()
    cut, cut_cache = run(12)  # row 0: 5 tokens, row 2: 7 of 17
    assert cut_cache.lengths.tolist() == [5, 0, 7, 0]
    assert np.array_equal(cut[0, :5], ref[0, :5]) and np.isnan(cut[2, 7:17]).all() and np.isnan(cut[3, :9]).all()
    assert np.isfinite(cut[2, :7]).all()


def _recording(monkeypatch, module, name):
    """Replace module.name (a compiled step) by a wrapper recording each call's `pack`."""
    seen, real = [], getattr(module, name)

    def step(*args, **kwargs):
        seen.append(kwargs.get("pack"))
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, step)
    return seen


def test_embeddings_run_on_packed_rows(tiny_dir, monkeypatch):
    """`embed` packs a call's rows (five prompts: a row bucket of 8, three empty) and gives
    each prompt the vector it gets alone, in the batch-invariant mode bit for bit."""
    from fx_engine.engine import embeddings

    model = fx_engine.load(tiny_dir, batch_invariant=True)
    rng = np.random.default_rng(5)
    inputs = [rng.integers(3, 200, size=n).tolist() for n in (9, 30, 17, 4, 25)]
    seen = _recording(monkeypatch, embeddings, "hidden_step_compiled")
    together = embeddings.embed(model, inputs, pooling="mean", normalize=False)
    assert seen == [96]  # 85 tokens in 8 rows x 32 positions: products on packed_rows(85) = 96 rows
    for i, ids in enumerate(inputs):
        assert np.array_equal(together[i], embeddings.embed(model, [ids], pooling="mean", normalize=False)[0])


# ------------------------------------------------------------------ verify


VERIFY_DRAFTS = [[100, 5, 7, 9], [1, 2, 3, 4], [11, 12, 0, 0], [13, 0, 0, 0]]
VERIFY_N = [4, 4, 2, 1]  # row 1 inactive: 2 + 3 + 2 = 12 positions of 16 to verify (5 + 0 + 3 + 2)


def _verify(model, pack):
    from fx_engine.core.speculative import verify_step

    cache, state = _decode_setup(model, [True, False, True, True])
    out = verify_step(model.params, cache, state, mx.array(VERIFY_DRAFTS, mx.int32), mx.array(VERIFY_N, mx.int32),
                      pack=pack)
    mx.eval(*tree_leaves(out))
    return state, out


@pytest.mark.parametrize("fixture", ["tiny_bi_model", "default_model"])
def test_packed_verify_equals_padded(request, tiny_dir, fixture):
    """Rows verifying different numbers of drafts (and a free row) on packed rows: the
    same accepted tokens, logprobs, state and cache."""
    model = fx_engine.load(tiny_dir, batch_invariant=True) if fixture == "tiny_bi_model" else request.getfixturevalue(fixture)
    _, (ref_state, ref_cache, ref) = _verify(model, None)
    for pack in (10, 16):
        _, (state, cache, res) = _verify(model, pack)
        assert res.count.tolist() == ref.count.tolist()
        for b, c in enumerate(ref.count.tolist()):
            assert res.tokens[b, :c].tolist() == ref.tokens[b, :c].tolist()
            assert np.array_equal(np.array(res.logprobs[b, :c]), np.array(ref.logprobs[b, :c]))
        assert state.tokens.tolist() == ref_state.tokens.tolist() and not any(state.full.tolist())
        lengths = cache.lengths.tolist()
        assert lengths == ref_cache.lengths.tolist()
        for got, want in zip(_written(cache, lengths), _written(ref_cache, lengths)):
            assert all(np.array_equal(g, r) for g, r in zip(got, want))


def test_verify_drafts_past_the_packed_rows_are_not_verified(bi_tiny):
    """pack below the positions: the rows that fit verify as without it; the row cut short
    verifies the drafts that fit (as drafts past the capacity are cut); a row with no room
    at all stops as a full row does (nothing written, its token kept)."""
    start, (_, ref_cache, ref) = _verify(bi_tiny, None)
    state, (cut_state, cut_cache, cut) = _verify(bi_tiny, 6)  # row 0: 5 positions, row 2: 1 of 3, row 3: none
    assert cut.count.tolist()[:2] == ref.count.tolist()[:2] and cut.count.tolist()[3] == 0
    assert cut.count.tolist()[2] == 1 and cut.accepted.tolist()[2] == 0  # its drafts not verified: one token
    assert cut_state.active.tolist() == [True, False, True, False] and cut_state.full.tolist()[3]
    assert cut_state.tokens.tolist()[3] == start.tokens.tolist()[3]
    assert cut_cache.lengths.tolist() == [ref_cache.lengths.tolist()[0], 2, 4, 1]
