"""EAGLE-3 heads (fx_engine.core.drafters.eagle3) against a float64 numpy reference written here
from the published equations (SafeAILab/EAGLE eagle/model/cnets.py, vLLM and SGLang's
llama_eagle3.py), never from the module's helpers; the loader on tiny heads in the published
format; chained drafting against one prefill; the draft -> target vocabulary maps."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from fx_engine.core.cache import init_cache
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import eagle3
from fx_engine.core.nn import Linear
from fx_engine.core.tree import tree_leaves
from fx_engine.testing.eagle3 import read_eagle3_folder, tiny_eagle3_config, tiny_eagle3_tensors, write_tiny_eagle3

TARGET_H = 24  # the target's width: the fc takes 3 * 24 = 72


def _head(style="midlayer", seed=0, **config):
    cfg = tiny_eagle3_config(TARGET_H, **config)
    tensors = tiny_eagle3_tensors(cfg, seed=seed, style=style)
    return cfg, tensors, eagle3.eagle3_params_from_tensors(tensors, eagle3.config_from_hf(cfg))


def _cache(p, rows, capacity=32):
    return init_cache(eagle3.cache_specs(p.config), rows, capacity)


# ---------------------------------------------------------------- the reference (float64 numpy)


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """Half-split RoPE (HF's rotate_half) of x [B, T, heads, d] at positions [B, T]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = pos[..., None] * inv  # [B, T, d/2]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, :, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, :, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def reference(w, cfg, embeds, hidden, pos, past=None):
    """The head's step from the published equations. w: checkpoint tensors (EAGLE's names);
    embeds [B, T, H], hidden [B, T, 3Ht or H], pos [B, T]; past: (keys, values, positions) of
    earlier steps. Returns (logits, pre-norm output hidden, (keys, values, positions))."""
    f = {n: np.asarray(a, np.float64) for n, a in w.items() if n not in ("d2t", "t2d")}
    L = "midlayer."
    H, eps, theta = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b, t, _ = embeds.shape
    g = hidden @ f["fc.weight"].T if hidden.shape[-1] != H else hidden  # fc on the target's states only
    n = _rms(g, f[L + "hidden_norm.weight"], eps)
    residual = n if cfg.get("norm_before_residual") else g
    x = np.concatenate([_rms(embeds, f[L + "input_layernorm.weight"], eps), n], -1)  # [B, T, 2H]
    q = _rope((x @ f[L + "self_attn.q_proj.weight"].T).reshape(b, t, hq, d), pos, theta)
    k = _rope((x @ f[L + "self_attn.k_proj.weight"].T).reshape(b, t, hk, d), pos, theta)
    v = (x @ f[L + "self_attn.v_proj.weight"].T).reshape(b, t, hk, d)
    if past is not None:
        k, v, kpos = np.concatenate([past[0], k], 1), np.concatenate([past[1], v], 1), np.concatenate([past[2], pos], 1)
    else:
        kpos = pos
    out = np.zeros((b, t, hq, d))
    for r in range(b):
        for head in range(hq):
            kv = head // (hq // hk)  # grouped-query: consecutive query heads share a KV head
            s = q[r, :, head] @ k[r, :, kv].T / np.sqrt(d)  # [T, S]
            s = np.where(kpos[r][None, :] <= pos[r][:, None], s, -np.inf)  # causal by position
            pr = np.exp(s - s.max(-1, keepdims=True))
            out[r, :, head] = (pr / pr.sum(-1, keepdims=True)) @ v[r, :, kv]
    h = residual + out.reshape(b, t, hq * d) @ f[L + "self_attn.o_proj.weight"].T
    m = _rms(h, f[L + "post_attention_layernorm.weight"], eps)
    gate, up = m @ f[L + "mlp.gate_proj.weight"].T, m @ f[L + "mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ f[L + "mlp.down_proj.weight"].T
    logits = _rms(h, f["norm.weight"], eps) @ f["lm_head.weight"].T
    return logits, h, (k, v, kpos)


def _np(x):
    return np.asarray(x, np.float64)


# ---------------------------------------------------------------- (a) the forward against the reference


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_forward_matches_the_reference(norm_before_residual):
    cfg, w, p = _head(norm_before_residual=norm_before_residual)
    rng = np.random.default_rng(1)
    b, t0, t1, H = 2, 6, 2, cfg["hidden_size"]
    # step 1: the target's three states (through fc); step 2: the head's own states (no fc)
    e0, a0 = rng.normal(size=(b, t0, H)), rng.normal(size=(b, t0, 3 * TARGET_H))
    e1, g1 = rng.normal(size=(b, t1, H)), rng.normal(size=(b, t1, H))
    cache = _cache(p, b)
    lg0, h0, cache = eagle3.eagle3_forward(p, mx.array(e0, mx.float32), mx.array(a0, mx.float32), cache,
                                           mx.array([t0, t0]))
    lg1, h1, cache = eagle3.eagle3_forward(p, mx.array(e1, mx.float32), mx.array(g1, mx.float32), cache,
                                           mx.array([t1, t1]))
    pos0 = np.tile(np.arange(t0), (b, 1))
    pos1 = np.tile(np.arange(t0, t0 + t1), (b, 1))
    r_lg0, r_h0, past = reference(w, cfg, e0, a0, pos0)
    r_lg1, r_h1, _ = reference(w, cfg, e1, g1, pos1, past)
    assert lg0.shape == (b, t0, cfg["draft_vocab_size"]) and lg0.dtype == mx.float32
    for got, want in ((lg0, r_lg0), (h0, r_h0), (lg1, r_lg1), (h1, r_h1)):
        np.testing.assert_allclose(_np(got), want, rtol=2e-4, atol=2e-4)
    assert cache.lengths.tolist() == [t0 + t1] * b


def test_the_reference_is_not_blind():
    """A wrong residual (the normed hidden where EAGLE adds the raw one) moves the output:
    the comparison above can tell the two variants apart."""
    cfg, w, p = _head()
    rng = np.random.default_rng(2)
    e, a = rng.normal(size=(1, 4, 32)), rng.normal(size=(1, 4, 3 * TARGET_H))
    pos = np.arange(4)[None]
    right = reference(w, cfg, e, a, pos)[1]
    wrong = reference(w, {**cfg, "norm_before_residual": True}, e, a, pos)[1]
    assert np.abs(right - wrong).max() > 1e-2


# ---------------------------------------------------------------- (b) the loader


def test_loader_round_trips_the_tiny_folder(tmp_path):
    folder = write_tiny_eagle3(tmp_path / "head", TARGET_H, seed=3, embed=True,
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 7],
                                             "use_aux_hidden_state": True})
    d, tensors = read_eagle3_folder(folder)
    cfg = eagle3.config_from_hf(d)
    assert (cfg.draft_vocab_size, cfg.vocab_size, cfg.target_hidden_size, cfg.fc_in) == (40, 96, TARGET_H, 72)
    assert cfg.aux_layer_ids == (1, 4, 7) and eagle3.aux_layers(cfg, 10) == (1, 4, 7)
    p = eagle3.eagle3_params_from_tensors(tensors, cfg)
    L = "midlayer."
    qkv = np.concatenate([_np(tensors[L + f"self_attn.{x}_proj.weight"]) for x in "qkv"])
    np.testing.assert_array_equal(_np(p.layer.qkv.dense_out_in), qkv)
    np.testing.assert_array_equal(_np(p.fc.dense_out_in), _np(tensors["fc.weight"]))
    np.testing.assert_array_equal(_np(p.lm_head.dense_out_in), _np(tensors["lm_head.weight"]))
    np.testing.assert_array_equal(_np(p.layer.hidden_norm), _np(tensors[L + "hidden_norm.weight"]))
    np.testing.assert_array_equal(_np(p.embed.weight), _np(tensors["embed_tokens.weight"]))
    assert p.d2t.dtype == mx.int64 and p.t2d.dtype == mx.bool_
    np.testing.assert_array_equal(np.array(p.d2t), np.array(tensors["d2t"]))


@pytest.mark.parametrize("style", ["layers.0", "model.midlayer"])
def test_loader_accepts_the_references_name_variants(style):
    _, _, p = _head("midlayer", seed=4)
    _, _, q = _head(style, seed=4)
    for a, b in zip(tree_leaves(p), tree_leaves(q), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_loader_rejects_a_missing_tensor():
    cfg, w, _ = _head()
    del w["midlayer.mlp.down_proj.weight"]
    with pytest.raises(WeightsError, match="missing tensor 'midlayer.mlp.down_proj.weight'"):
        eagle3.eagle3_params_from_tensors(w, eagle3.config_from_hf(cfg))
    cfg, w, _ = _head()
    del w["d2t"]  # a draft vocabulary smaller than the target's needs its map
    with pytest.raises(WeightsError, match="missing tensor 'd2t'"):
        eagle3.eagle3_params_from_tensors(w, eagle3.config_from_hf(cfg))


def test_loader_rejects_unexpected_and_inconsistent_tensors():
    cfg, w, _ = _head()
    parsed = eagle3.config_from_hf(cfg)
    extra = {**w, "midlayer.self_attn.q_norm.weight": mx.ones((8,)), "mask_hidden": mx.zeros((1, 96))}
    with pytest.raises(WeightsError, match="unexpected tensor.*'mask_hidden'.*'midlayer.self_attn.q_norm.weight'"):
        eagle3.eagle3_params_from_tensors(extra, parsed)
    bad = dict(w)
    bad["midlayer.self_attn.q_proj.weight"] = mx.zeros((32, 32))  # 1H inputs: not an EAGLE-3 layer
    with pytest.raises(WeightsError, match="q_proj.weight' has shape \\(32, 32\\), expected \\(32, 64\\)"):
        eagle3.eagle3_params_from_tensors(bad, parsed)
    flipped = dict(w, t2d=mx.logical_not(w["t2d"]))
    with pytest.raises(WeightsError, match="'t2d'"):
        eagle3.eagle3_params_from_tensors(flipped, parsed)
    both = {**w, "layers.0.hidden_norm.weight": w["midlayer.hidden_norm.weight"]}
    with pytest.raises(WeightsError, match="are both 'midlayer.hidden_norm.weight'"):
        eagle3.eagle3_params_from_tensors(both, parsed)


@pytest.mark.parametrize("field,value,message", [
    ("foo_scale", 2.0, "unknown EAGLE-3 config field.*'foo_scale'"),
    ("num_hidden_layers", 2, "'num_hidden_layers' = 2 is not supported"),
    ("attention_bias", True, "'attention_bias' = True is not supported"),
    ("hidden_act", "gelu", "'hidden_act' = 'gelu' is not supported"),
    ("eagle_config", {"use_aux_hidden_state": False}, "use_aux_hidden_state = false"),
    ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 2]}, "must list 3 layer indices"),
    ("target_hidden_size", 10, "cannot be told apart"),  # 3 * 10 == the hidden_size 30 set below
])
def test_config_refuses_what_it_does_not_run(field, value, message):
    cfg = tiny_eagle3_config(TARGET_H, **{field: value})
    if field == "target_hidden_size":
        cfg.update(hidden_size=30, num_attention_heads=3, num_key_value_heads=3, head_dim=10)
    with pytest.raises(ConfigError, match=message):
        eagle3.config_from_hf(cfg)


def test_config_reads_the_speculators_format():
    """vLLM's speculators layout: the layer's config nested, the EAGLE-3 fields at the top."""
    flat = tiny_eagle3_config(TARGET_H)
    layer = {k: v for k, v in flat.items() if k not in ("draft_vocab_size", "target_hidden_size", "architectures")}
    nested = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "transformer_layer_config": layer, "draft_vocab_size": 40, "target_hidden_size": TARGET_H,
              "norm_before_residual": True, "eagle_aux_hidden_state_layer_ids": [2, 5, 9],
              "speculators_config": {"algorithm": "eagle3"}}
    cfg = eagle3.config_from_hf(json.loads(json.dumps(nested)))
    assert cfg.norm_before_residual and cfg.aux_layer_ids == (2, 5, 9)
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.hidden_size) == (40, TARGET_H, 32)
    assert eagle3.aux_layers(eagle3.config_from_hf(flat), 32) == (2, 16, 29)  # vLLM's default


# ---------------------------------------------------------------- (c) chained drafting = one prefill


def test_chained_drafts_equal_one_prefill_and_token_by_token():
    cfg, _, p = _head(seed=5)
    rng = np.random.default_rng(6)
    b, t0, k, H = 2, 5, 3, cfg["hidden_size"]
    table = Linear(weight=mx.array(rng.normal(size=(cfg["vocab_size"], H)).astype(np.float32)))  # the target's
    tokens = mx.array(rng.integers(0, cfg["vocab_size"], size=(b, t0)))
    aux = mx.array(rng.normal(size=(b, t0, 3 * TARGET_H)).astype(np.float32))
    ids, logits, hiddens, chained = eagle3.draft_chain(p, table, aux, tokens, _cache(p, b), mx.array([t0, t0]), k)
    assert ids.shape == (b, k) and logits.shape == (b, k, cfg["draft_vocab_size"]) and hiddens.shape == (b, k, H)
    np.testing.assert_array_equal(np.array(ids), np.array(eagle3.greedy_target_ids(p, logits)))
    assert chained.lengths.tolist() == [t0 + k - 1] * b

    # the same pairs in one prefill: the target's states projected first (fc is per position),
    # then the head's own states with the tokens it drafted
    all_tokens = mx.concatenate([tokens, ids[:, : k - 1]], axis=1)
    all_hidden = mx.concatenate([eagle3.project_target_hidden(p, aux), hiddens[:, : k - 1]], axis=1)
    embeds = table.weight[all_tokens]
    n = t0 + k - 1
    one_lg, one_h, one = eagle3.eagle3_forward(p, embeds, all_hidden, _cache(p, b), mx.array([n, n]))
    np.testing.assert_allclose(_np(one_lg[:, t0 - 1:]), _np(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(one_h[:, t0 - 1:]), _np(hiddens), rtol=1e-5, atol=1e-5)
    assert one.lengths.tolist() == chained.lengths.tolist()
    for a, c in ((one.keys[0], chained.keys[0]), (one.values[0], chained.values[0])):
        np.testing.assert_allclose(_np(a[:, :, :n]), _np(c[:, :, :n]), rtol=1e-5, atol=1e-5)

    # token by token with a growing cache (the target's states through fc inside the step)
    cache = _cache(p, b)
    steps = []
    for j in range(n):
        hid = aux[:, j: j + 1] if j < t0 else hiddens[:, j - t0: j - t0 + 1]
        lg, _, cache = eagle3.eagle3_forward(p, embeds[:, j: j + 1], hid, cache, mx.array([1, 1]))
        steps.append(lg)
    np.testing.assert_allclose(_np(mx.concatenate(steps, axis=1)), _np(one_lg), rtol=1e-5, atol=1e-5)


def test_chained_drafting_keeps_idle_rows_idle_and_rolls_back_by_length():
    cfg, _, p = _head(seed=7)
    rng = np.random.default_rng(8)
    table = Linear(weight=mx.array(rng.normal(size=(cfg["vocab_size"], cfg["hidden_size"])).astype(np.float32)))
    tokens = mx.array(rng.integers(0, cfg["vocab_size"], size=(2, 4)))
    aux = mx.array(rng.normal(size=(2, 4, 3 * TARGET_H)).astype(np.float32))
    ids, _, _, cache = eagle3.draft_chain(p, table, aux, tokens, _cache(p, 2), mx.array([3, 0]), 3)
    assert cache.lengths.tolist() == [3 + 2, 0]
    # row 0 with 3 valid pairs drafts what a 3-pair prompt alone drafts
    solo, _, _, _ = eagle3.draft_chain(p, table, aux[:1, :3], tokens[:1, :3], _cache(p, 1), mx.array([3]), 3)
    np.testing.assert_array_equal(np.array(ids[:1]), np.array(solo))


# ---------------------------------------------------------------- (d) draft vocabulary -> target vocabulary


def test_draft_ids_map_through_d2t_and_the_distribution_is_scattered():
    cfg, w, p = _head(seed=9)
    d2t, t2d = np.array(w["d2t"]), np.array(w["t2d"])
    dv, v = cfg["draft_vocab_size"], cfg["vocab_size"]
    rng = np.random.default_rng(10)
    logits = mx.array(rng.normal(size=(3, 2, dv)).astype(np.float32) * 3)
    best = np.array(logits).argmax(-1)
    np.testing.assert_array_equal(np.array(eagle3.greedy_target_ids(p, logits)), best + d2t[best])
    np.testing.assert_array_equal(np.array(eagle3.draft_target_ids(p)), np.flatnonzero(t2d))

    probs = np.array(eagle3.target_probs(p, logits))
    assert probs.shape == (3, 2, v)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-6)
    assert (probs[..., ~t2d] == 0).all()
    ids = np.arange(dv) + d2t
    soft = np.exp(np.array(logits, np.float64))
    np.testing.assert_allclose(probs[..., ids], soft / soft.sum(-1, keepdims=True), rtol=1e-5)

    full = np.array(eagle3.target_logits(p, logits))
    assert np.isneginf(full[..., ~t2d]).all()
    np.testing.assert_array_equal(full[..., ids], np.array(logits))
    np.testing.assert_array_equal(full.argmax(-1), best + d2t[best])


def test_a_head_over_the_whole_vocabulary_needs_no_maps():
    cfg = tiny_eagle3_config(TARGET_H, draft_vocab_size=None)
    w = tiny_eagle3_tensors({**cfg, "draft_vocab_size": cfg["vocab_size"]}, seed=11)
    w = {n: a for n, a in w.items() if n not in ("d2t", "t2d")}
    p = eagle3.eagle3_params_from_tensors(w, eagle3.config_from_hf(cfg))
    assert p.config.draft_vocab_size == 96 and not np.array(p.d2t).any() and np.array(p.t2d).all()


def test_the_step_compiles_once_for_steady_state_decode():
    """Under the core's compile wrapper, chained single-pair steps share one trace and give
    the uncompiled step's numbers."""
    from fx_engine.core.tree import jit

    cfg, _, p = _head(seed=12)
    step = jit(eagle3.eagle3_forward, static_argnames="span")
    rng = np.random.default_rng(13)
    cache = _cache(p, 2)
    for _ in range(3):
        e, g = (mx.array(rng.normal(size=(2, 1, cfg["hidden_size"])).astype(np.float32)) for _ in range(2))
        lg, _, nxt = step(p, e, g, cache, mx.array([1, 1]), span=32)
        want, _, _ = eagle3.eagle3_forward(p, e, g, cache, mx.array([1, 1]), span=32)
        np.testing.assert_allclose(_np(lg), _np(want), rtol=1e-6, atol=1e-6)
        cache = nxt
    assert cache.lengths.tolist() == [3, 3] and step.traces == 1
