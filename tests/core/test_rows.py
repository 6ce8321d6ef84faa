"""Row operations (fx_engine.take_rows / repeat_rows / concat_rows) on every cache kind and
on DecodeState.

Oracle: each row run alone. Prompts of different lengths are prefilled together, rows are
then reordered, forked and dropped (`take_rows`), and a few steps run on the moved batch
(the forward with `logits_step`, sampling with `sample_step`, greedy and seeded rows);
each moved row's logits and tokens must equal, bitwise, those of its prompt prefilled and
stepped alone in a cache of the same capacity. Cache kinds: dense (llama), ring (Gemma 3
sliding-window layers; the ring wraps), quantized KV (8-bit, with and without a float
head), latent (DeepSeek's MLA entries), recurrent (LFM2's short convolutions, Mamba-2's
SSM states)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.cache import LayerKV, QuantKV, RecState

KINDS = {
    "dense": ("llama", {}, None),
    "ring": ("gemma3_text", {"sliding_window": 16}, None),
    "quantized": ("llama", {"head_dim": 32}, (8, 32, 0)),
    "quantized_head": ("llama", {"head_dim": 32}, (8, 32, 12)),  # float below 12, then 8-bit
    "latent": ("deepseek_v3", {}, None),
    "recurrent_conv": ("lfm2", {"conv_bias": True, "conv_L_cache": 4}, None),
    "recurrent_ssm": ("mamba2", {}, None),
}
CFGS = [fx_engine.SamplingConfig(), fx_engine.SamplingConfig(temperature=0.9, seed=5),
        fx_engine.SamplingConfig(temperature=0.7, top_k=20, seed=9)]
LENGTHS = (5, 23, 41)  # shorter than, about, and past the 16-token window / 32-slot ring
CAPACITY = 128
STEPS = 5


@pytest.fixture(scope="module", params=list(KINDS))
def kind_models(request, tiny_folder):
    """(kind, the model in the default numerics, the same in batch-invariant numerics)."""
    model_type, cfg, kv = KINDS[request.param]
    path = tiny_folder(model_type, **cfg)
    ms = [fx_engine.load(path), fx_engine.load(path, batch_invariant=True)]
    if kv is not None:
        ms = [m.with_kv_cache(*kv) for m in ms]
    return (request.param, *ms)


@pytest.fixture
def kind_model(kind_models):
    return kind_models[:2]


def _prompts(model):
    v = model.config.vocab_size
    return [[3 + (11 * j + 7 * r) % (v - 3) for j in range(n)] for r, n in enumerate(LENGTHS)]


def _prefill(model, prompts, cfgs):
    """Prompts in one cache of CAPACITY slots, fed in 16-token pieces (a 32-slot ring)."""
    longest = max(len(p) for p in prompts)
    return fx_engine.prefill(model, prompts, room=CAPACITY - longest, chunk=16, headroom=16,
                             configs=cfgs)


def _run(model, state, cache, steps=STEPS):
    """`steps` forwards of each row's last token and samplings: logits [S, B, V], tokens."""
    lgs, toks = [], []
    for _ in range(steps):
        lg, cache = fx_engine.logits_step(model.params, cache, state.tokens, state.active)
        state = fx_engine.sample_step(state, lg)
        mx.eval(lg, fx_engine.tree_leaves(state), fx_engine.tree_leaves(cache))
        lgs.append(lg)
        toks.append(state.tokens)
    return mx.stack(lgs), mx.stack(toks), cache


def _same(a, b) -> bool:
    la, lb = fx_engine.tree_leaves(a), fx_engine.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.shape == y.shape and x.dtype == y.dtype and np.array_equal(np.array(x), np.array(y))
        for x, y in zip(la, lb))


@pytest.mark.parametrize("numerics", ["default", "batch_invariant"])
def test_moved_rows_step_as_they_would_alone(kind_models, numerics):
    """Bitwise in the batch-invariant numerics (a row's bits do not depend on the batch);
    in the default numerics BLAS may round a 4-row product differently from a 1-row one
    (specs/steps.md, row independence): the same tokens, logits within 1e-4."""
    name, m = kind_models[0], kind_models[1 if numerics == "default" else 2]
    exact = numerics == "batch_invariant"
    prompts = _prompts(m)
    _, cache, state = _prefill(m, prompts, CFGS)
    kinds = {type(e) for e in cache.layers}
    expect = {"quantized": QuantKV, "quantized_head": QuantKV, "recurrent_conv": RecState,
              "recurrent_ssm": RecState}.get(name, LayerKV)
    assert expect in kinds
    if name == "ring":
        assert any(s.ring == 32 for s in cache.layout) and max(LENGTHS) > 32  # it wraps
    idx = [2, 0, 0, 1]  # reorder, fork row 0 into two
    state_m, cache_m = fx_engine.take_rows((state, cache), idx)
    assert fx_engine.num_rows((state_m, cache_m)) == 4
    assert cache_m.lengths.tolist() == [LENGTHS[i] for i in idx]
    lg_m, tok_m, _ = _run(m, state_m, cache_m)
    for i, r in enumerate(idx):
        _, c1, s1 = _prefill(m, [prompts[r]], CFGS[r])
        assert c1.capacity == cache.capacity
        lg1, tok1, _ = _run(m, s1, c1)
        assert tok_m[:, i].tolist() == tok1[:, 0].tolist(), (name, r)
        diff = mx.abs(lg_m[:, i] - lg1[:, 0]).max().item()
        assert (mx.array_equal(lg_m[:, i], lg1[:, 0]).item() if exact else diff < 1e-4), (name, r, diff)


def test_take_repeat_concat_round_trip(kind_model):
    """Pure data movement, exact on every leaf of the cache and the state."""
    _, m = kind_model
    _, cache, state = _prefill(m, _prompts(m), CFGS)
    tree = (state, cache)
    perm, inv = [2, 0, 1], [1, 2, 0]
    assert _same(fx_engine.take_rows(fx_engine.take_rows(tree, perm), mx.array(inv, mx.int32)), tree)
    assert _same(fx_engine.repeat_rows(tree, 2), fx_engine.take_rows(tree, [0, 0, 1, 1, 2, 2]))
    parts = [fx_engine.take_rows(tree, [0]), fx_engine.take_rows(tree, [1, 2])]
    assert _same(fx_engine.concat_rows(parts), tree)
    one = fx_engine.take_rows(cache, [1])
    assert one.rows == 1 and one.capacity == cache.capacity and one.layout == cache.layout


def test_a_snapshot_is_not_changed_by_later_steps(tiny_model):
    """A row taken out keeps its contents while the source decodes on (in place)."""
    _, cache, state = fx_engine.prefill(tiny_model, [[3, 4, 5], [6, 7, 8, 9]], room=8)
    snap = fx_engine.take_rows((state, cache), [1])
    mx.eval(fx_engine.tree_leaves(snap))
    copy = fx_engine.tree_map(lambda a: mx.array(np.array(a)), snap)
    for _ in range(3):
        state, cache = fx_engine.decode_step_compiled(tiny_model.params, cache, state)
        mx.eval(fx_engine.tree_leaves(state), fx_engine.tree_leaves(cache))
    assert _same(snap, copy) and cache.lengths.tolist() == [6, 7]


def test_row_operations_reject_what_they_cannot_move(tiny_model):
    _, cache, state = fx_engine.prefill(tiny_model, [[3, 4, 5], [6, 7, 8, 9]], room=8)
    with pytest.raises(ValueError, match=r"idx \[2\] outside the tree's rows \[0, 2\)"):
        fx_engine.take_rows(cache, [0, 2])
    with pytest.raises(ValueError, match=r"idx must be int32\[N\]"):
        fx_engine.take_rows(cache, mx.array([[0]]))
    with pytest.raises(TypeError, match=r"row operations take a KVCache"):
        fx_engine.take_rows(tiny_model.params, [0])
    with pytest.raises(ValueError, match="n must be an int >= 1"):
        fx_engine.repeat_rows(state, 0)
    other = tiny_model.new_cache(1, 64)
    with pytest.raises(ValueError, match="another structure"):
        fx_engine.concat_rows([cache, other])
    v = tiny_model.config.vocab_size
    narrow, wide = (fx_engine.init_state(fx_engine.SamplingConfig(repetition_penalty=1.1, repetition_context_size=n),
                                         [[1]], v) for n in (20, 40))  # history width 32 vs 64
    with pytest.raises(ValueError, match="differ past the row axis"):
        fx_engine.concat_rows([narrow, wide])
