"""EAGLE-3 heads (fx_engine.core.drafters.eagle3) against a float64 numpy reference written here
from the published equations (SafeAILab/EAGLE eagle/model/cnets.py, vLLM and SGLang's
llama_eagle3.py), never from the module's helpers; the loader on tiny heads in the published
format; chained drafting against one prefill; the draft -> target vocabulary maps."""

from __future__ import annotations

import json

import attrs
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
    earlier steps. Returns (logits, the output hidden a chained step feeds back: pre-norm, or
    normed with norm_output, (keys, values, positions))."""
    f = {n: np.asarray(a, np.float64) for n, a in w.items() if n not in ("d2t", "t2d")}
    L = "midlayer."
    H, eps, theta = cfg["hidden_size"], cfg["rms_norm_eps"], cfg["rope_theta"]
    hq, hk, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    b, t, _ = embeds.shape
    if hidden.shape[-1] != H:  # the target's states: the input norms the head has, then fc
        ht = cfg["target_hidden_size"]
        if "input_norm.weight" in f:  # norm_before_fc: one norm over the concatenation
            hidden = _rms(hidden, f["input_norm.weight"], eps)
        if "fc_norm.0.weight" in f:  # fc_norm: each state alone
            hidden = np.concatenate([_rms(hidden[..., i * ht:(i + 1) * ht], f[f"fc_norm.{i}.weight"], eps)
                                     for i in range(3)], -1)
        g = hidden @ f["fc.weight"].T
    else:
        g = hidden
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
    if cfg.get("norm_output"):  # speculators' norm_output: the normed state is fed back
        h = _rms(h, f["norm.weight"], eps)
    return logits, h, (k, v, kpos)


def _np(x):
    return np.asarray(x, np.float64)


# ---------------------------------------------------------------- (a) the forward against the reference


VARIANTS = {"eagle": {}, "norm_before_residual": {"norm_before_residual": True},
            # vLLM speculators' / NVIDIA's input norms and feedback (SGLang's Eagle3LlamaModel)
            "norm_before_fc": {"norm_before_fc": True},
            "eagle_config.norm_before_fc": {"eagle_config": {"norm_before_fc": True}},
            "fc_norm+norm_output": {"fc_norm": True, "norm_output": True, "norm_before_residual": True}}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_matches_the_reference(variant):
    cfg, w, p = _head(**VARIANTS[variant])
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
    # the input norms and the normed feedback move it too
    for flags in ({"norm_before_fc": True}, {"fc_norm": True}):
        cfg2, w2, _ = _head(**flags)
        plain = {n: t for n, t in w2.items() if n != "input_norm.weight" and not n.startswith("fc_norm.")}
        assert np.abs(reference(w2, cfg2, e, a, pos)[0] - reference(plain, cfg2, e, a, pos)[0]).max() > 1e-2
    assert np.abs(reference(w, {**cfg, "norm_output": True}, e, a, pos)[1] - right).max() > 1e-2


# ---------------------------------------------------------------- (b) the loader


def test_loader_round_trips_the_tiny_folder(tmp_path):
    folder = write_tiny_eagle3(tmp_path / "head", TARGET_H, seed=3, embed=True,
                               eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 7],
                                             "use_aux_hidden_state": True})
    d, tensors = read_eagle3_folder(folder)
    cfg = eagle3.config_from_hf(d)
    assert (cfg.draft_vocab_size, cfg.vocab_size, cfg.target_hidden_size, cfg.fc_in) == (40, 96, TARGET_H, 72)
    # pinned ids starting at 1: SpecForge's "output of layer i", the boundaries i + 1 (SGLang's reading)
    assert cfg.aux_layer_ids == (1, 4, 7) and eagle3.aux_layers(cfg, 10) == (2, 5, 8)
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


def test_config_reads_what_the_exporters_write():
    """The keys real exporters write (their config.json's, abridged): NVIDIA ModelOpt's
    eagle_config flags at the values this head runs, speculators' norm flags (always written,
    false or true), SpecForge's target_model_type / decoder_sparse_step, and the generation
    and task defaults of a full PretrainedConfig.to_dict(); a flag set otherwise is refused
    by name, and an input norm's tensor without its flag is an unexpected tensor."""
    modelopt = {"eagle_aux_hidden_state_layer_ids": [1, 10, 20], "use_aux_hidden_state": True,
                "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False,
                "next_layer_regular": True, "parallel_draft_step": 1, "parallel_draft_heads_num_layers": 1}
    cfg = eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, eagle_config=modelopt))
    assert cfg.aux_layer_ids == (1, 10, 20) and not cfg.norm_before_fc
    nvidia = tiny_eagle3_config(TARGET_H, eagle_config={**modelopt, "norm_before_fc": True})
    assert eagle3.config_from_hf(nvidia).norm_before_fc
    for key, value in (("use_last_layernorm", False), ("parallel_draft_step", 3), ("use_mtp_layernorm", True)):
        with pytest.raises(ConfigError, match=f"eagle_config.{key} = {value!r} is not supported"):
            eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, eagle_config={**modelopt, key: value}))
    with pytest.raises(ConfigError, match="disagree"):
        eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, norm_before_fc=False, eagle_config={"norm_before_fc": True}))
    extra = {"target_model_type": "gemma3", "decoder_sparse_step": 1, "output_attentions": False, "return_dict": True,
             "num_beams": 1, "id2label": {"0": "LABEL_0"}, "norm_before_fc": False, "fc_norm": False,
             "norm_output": False}
    cfg = eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, **extra))
    assert not (cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output)
    flags = eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, norm_before_fc=True, fc_norm=True, norm_output=True))
    assert flags.norm_before_fc and flags.fc_norm and flags.norm_output
    with pytest.raises(ConfigError, match="unknown EAGLE-3 config field"):
        eagle3.config_from_hf(tiny_eagle3_config(TARGET_H, eagle_fancy_new_norm=True))
    raw = tiny_eagle3_config(TARGET_H, norm_before_fc=True)
    tensors = tiny_eagle3_tensors(raw)
    with pytest.raises(WeightsError, match="'input_norm.weight'"):  # the flag without its tensor
        eagle3.eagle3_params_from_tensors({n: t for n, t in tensors.items() if n != "input_norm.weight"},
                                          eagle3.config_from_hf(raw))
    with pytest.raises(WeightsError, match="unexpected tensor.*'input_norm.weight'"):  # the tensor without its flag
        eagle3.eagle3_params_from_tensors(tensors, eagle3.config_from_hf(tiny_eagle3_config(TARGET_H)))


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
    assert not (cfg.norm_before_fc or cfg.fc_norm or cfg.norm_output)
    # since 2026-03 speculators writes its norm flags at the top level, false or true
    newer = eagle3.config_from_hf({**nested, "norm_before_fc": True, "fc_norm": False, "norm_output": True})
    assert newer.norm_before_fc and newer.norm_output and not newer.fc_norm
    # since 2026-06 its default layer config is Qwen3's (run by a Llama layer: same head)
    qwen3 = {**nested, "transformer_layer_config": {**layer, "model_type": "qwen3", "use_sliding_window": False,
                                                    "max_window_layers": 28, "attention_bias": False}}
    assert eagle3.config_from_hf(qwen3) == cfg
    assert (cfg.draft_vocab_size, cfg.target_hidden_size, cfg.hidden_size) == (40, TARGET_H, 32)
    assert eagle3.aux_layers(eagle3.config_from_hf(flat), 32) == (2, 16, 29)  # vLLM's default


# ---------------------------------------------------------------- (c) chained drafting = one prefill


@pytest.mark.parametrize("variant", ["eagle", "fc_norm+norm_output"])
def test_chained_drafts_equal_one_prefill_and_token_by_token(variant):
    cfg, w, p = _head(seed=5, **VARIANTS[variant])
    rng = np.random.default_rng(6)
    b, t0, k, H = 2, 5, 3, cfg["hidden_size"]
    table = Linear(weight=mx.array(rng.normal(size=(cfg["vocab_size"], H)).astype(np.float32)))  # the target's
    tokens = mx.array(rng.integers(0, cfg["vocab_size"], size=(b, t0)))
    aux = mx.array(rng.normal(size=(b, t0, 3 * TARGET_H)).astype(np.float32))
    ids, logits, hiddens, chained = eagle3.draft_chain(p, table, aux, tokens, _cache(p, b), mx.array([t0, t0]), k)
    assert ids.shape == (b, k) and logits.shape == (b, k, cfg["draft_vocab_size"]) and hiddens.shape == (b, k, H)
    np.testing.assert_array_equal(np.array(ids), np.array(eagle3.greedy_target_ids(p, logits)))
    assert chained.lengths.tolist() == [t0 + k - 1] * b
    # the reference's chain: each step fed the hidden state the last one gave back
    emb = np.asarray(table.weight, np.float64)
    pos = np.tile(np.arange(t0), (b, 1))
    r_lg, r_h, past = reference(w, cfg, emb[np.array(tokens)], _np(aux), pos)
    for j in range(k):
        np.testing.assert_allclose(_np(logits[:, j]), r_lg[:, -1], rtol=2e-4, atol=2e-4)
        np.testing.assert_allclose(_np(hiddens[:, j]), r_h[:, -1], rtol=2e-4, atol=2e-4)
        if j < k - 1:
            r_lg, r_h, past = reference(w, cfg, emb[np.array(ids[:, j: j + 1])], r_h[:, -1:],
                                        np.full((b, 1), t0 + j), past)

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


# ---------------------------------------------------------------- (e) the target's states, captured in its steps


def _mlx_lm_boundaries(path, tokens):
    """Every layer boundary of the target on `tokens`, from an independent uncompiled forward:
    mlx-lm's Llama run layer by layer (boundary b < N: the stream entering layer b, as vLLM's
    `hidden_states + residual` before layer b; N: after the last layer)."""
    from pathlib import Path

    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(path))
    ref.set_dtype(mx.float32)
    h = ref.model.embed_tokens(mx.array([tokens]))
    out = []
    for layer in ref.model.layers:
        out.append(h)
        h = layer(h, "causal", None)
    out.append(h)
    return [np.array(x[0], np.float64) for x in out]


@pytest.fixture(scope="module")
def target6(tiny_folder):
    import fx_engine

    path = tiny_folder("llama", num_hidden_layers=6)
    return path, fx_engine.load(path)


@pytest.mark.oracle
def test_steps_capture_the_layer_boundaries_of_every_position(target6):
    """prefill (two rows, one padded), decode and verify return, from their own forward, the
    stream entering the chosen layers (and after the last, and the final norm's output) at
    every position they processed: equal to mlx-lm's layer-by-layer forward; the steps'
    other outputs are bitwise those of the same steps without a capture."""
    from fx_engine.core.models import Capture
    from fx_engine.core.sampling import SamplingConfig
    from fx_engine.core.state import init_state
    from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled, verify_step_compiled

    path, m = target6
    n, H = m.config.num_layers, m.config.hidden_size
    cap = Capture((2, 3, 0, n), normed=True)
    rows = [[5, 9, 17, 40, 3, 77, 12], [101, 7, 64]]
    toks = mx.array([r + [0] * (7 - len(r)) for r in rows], mx.int32)
    nv = mx.array([len(r) for r in rows], mx.int32)
    plain_lg, plain_cache = prefill_step_compiled(m.params, m.new_cache(2, 64), toks, nv, span=64)
    lg, cache, got = prefill_step_compiled(m.params, m.new_cache(2, 64), toks, nv, span=64, capture=cap)
    assert got.shape == (2, 7, 5 * H) and got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(lg), np.array(plain_lg))
    for a, b in zip(tree_leaves(cache), tree_leaves(plain_cache), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))

    def check(row, tokens, got_row, first):
        ref = _mlx_lm_boundaries(path, tokens)
        m_ref = np.array(mx.fast.rms_norm(mx.array(ref[n].astype(np.float32)), m.params.norm, m.config.rms_norm_eps),
                         np.float64)
        for j, b in enumerate(cap.layers):
            np.testing.assert_allclose(_np(got_row[:, j * H:(j + 1) * H]), ref[b][first:], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(_np(got_row[:, 4 * H:]), m_ref[first:], rtol=1e-4, atol=1e-4)

    for i, r in enumerate(rows):
        check(i, r, got[i, : len(r)], 0)

    # decode: one position per row (the last sampled token)
    state = init_state([SamplingConfig(), SamplingConfig()], rows, m.config.vocab_size)
    state = attrs.evolve(state, tokens=mx.array([33, 44], mx.int32))
    plain_state, _ = decode_step_compiled(m.params, plain_cache, state, span=64)
    new_state, cache, got = decode_step_compiled(m.params, cache, state, span=64, capture=cap)
    np.testing.assert_array_equal(np.array(new_state.tokens), np.array(plain_state.tokens))
    assert got.shape == (2, 1, 5 * H)
    for i, (r, t) in enumerate(zip(rows, (33, 44))):
        check(i, r + [t], got[i], len(r))

    # verify: the last token and 3 drafts per row (row 1 drafts 1): K + 1 positions
    seqs = [r + [t] for r, t in zip(rows, (33, 44))]
    state = attrs.evolve(new_state, tokens=mx.array([8, 9], mx.int32))
    drafts = mx.array([[70, 71, 72], [90, 0, 0]], mx.int32)
    out = verify_step_compiled(m.params, cache, state, drafts, mx.array([3, 1], mx.int32), span=64, capture=cap)
    assert len(out) == 4 and out[3].shape == (2, 4, 5 * H)
    check(0, seqs[0] + [8, 70, 71, 72], out[3][0], len(seqs[0]))
    check(1, seqs[1] + [9, 90], out[3][1, :2], len(seqs[1]))


def test_every_family_through_the_decoder_skeleton_captures(tiny_folder):
    """Each family's layer loop reports one stream per layer: a capture of every boundary
    and the final norm's output runs, its normed part is the step's own hidden states, and
    its logits are bitwise those of the step without it. Gemma's forward (written out, not
    through skeleton.decoder_step) refuses, naming the model type."""
    import fx_engine
    from fx_engine.core.models import FAMILIES, Capture, CaptureError
    from fx_engine.core.steps import hidden_step, logits_step

    toks = mx.array([[5, 9, 17, 40, 3], [101, 7, 64, 2, 0]], mx.int32)
    nv = mx.array([5, 4], mx.int32)
    for fam in FAMILIES:
        mt = fam.model_types[0]
        m = fx_engine.load(tiny_folder(mt))
        n, H = m.config.num_layers, m.config.hidden_size
        cap = Capture(tuple(range(n + 1)), normed=True)
        if fam.name == "gemma":
            with pytest.raises(CaptureError, match=f"not supported for {mt} models"):
                logits_step(m.params, m.new_cache(2, 16), toks, nv, capture=cap)
            continue
        lg, _, got = logits_step(m.params, m.new_cache(2, 16), toks, nv, capture=cap)
        plain, _ = logits_step(m.params, m.new_cache(2, 16), toks, nv)
        hid, _ = hidden_step(m.params, m.new_cache(2, 16), toks, nv)
        assert got.shape == (2, 5, (n + 2) * H), mt
        np.testing.assert_array_equal(np.array(lg), np.array(plain), err_msg=mt)
        np.testing.assert_allclose(_np(got[..., (n + 1) * H:]), _np(hid), rtol=1e-5, atol=1e-5, err_msg=mt)


def test_capture_refusals_name_what_is_wrong(target6):
    from fx_engine.core.models import Capture, CaptureError, forward
    from fx_engine.core.models.skeleton import PipelineStage

    _, m = target6
    toks, nv = mx.zeros((1, 2), mx.int32), mx.array([2], mx.int32)
    with pytest.raises(CaptureError, match="not boundaries of a 6-layer llama model"):
        forward(m.params, m.new_cache(1, 8), toks, nv, None, Capture((2, 7)))
    staged = attrs.evolve(m.params, pipeline=PipelineStage(1, 2, 3, 6))
    with pytest.raises(CaptureError, match="pipeline parallelism"):
        forward(staged, m.new_cache(1, 8), toks, nv, None, Capture((2,)))
    with pytest.raises(CaptureError, match="at least one"):
        Capture(())
    with pytest.raises(CaptureError, match="integers >= 0"):
        Capture((-1,))


def test_capture_is_its_own_compiled_entry_and_the_plain_step_is_unchanged(target6):
    """A capturing step compiles once per capture (a static key); the plain step keeps its
    own entry: alternating them recompiles neither."""
    from fx_engine.core.models import Capture
    from fx_engine.core.steps import prefill_step_compiled

    _, m = target6
    toks, nv = mx.array([[5, 9, 17, 40]], mx.int32), mx.array([4], mx.int32)
    before = prefill_step_compiled.traces
    for _ in range(2):
        for cap in (None, Capture((2, 3, 3)), None, Capture((2, 3, 3))):
            out = prefill_step_compiled(m.params, m.new_cache(1, 32), toks, nv, span=32, capture=cap)
            assert len(out) == (2 if cap is None else 3)
    assert prefill_step_compiled.traces - before <= 2


# ---------------------------------------------------------------- (f) which layers, and the head against its target


def test_aux_layer_conventions():
    """Unpinned: vLLM's / EAGLE's (2, N // 2, N - 3). Pinned ids starting at 1 are
    SpecForge's layer outputs (boundaries i + 1, SGLang's reading); others are boundaries as
    they are (vLLM's reading), N included (after the last layer)."""
    base = tiny_eagle3_config(TARGET_H)
    cfg = eagle3.config_from_hf(base)
    assert eagle3.aux_layers(cfg, 32) == (2, 16, 29) and eagle3.aux_layers(cfg, 6) == (2, 3, 3)
    def pinned(ids):
        return eagle3.config_from_hf({**base, "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids}})

    assert eagle3.aux_layers(pinned([1, 15, 28]), 32) == (2, 16, 29)  # SpecForge's default, the same states
    assert eagle3.aux_layers(pinned([2, 16, 29]), 32) == (2, 16, 29)
    assert eagle3.aux_layers(pinned([24, 30, 36]), 36) == (24, 30, 36)  # NVIDIA's gpt-oss head: 36 = after the last
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids \[24, 30, 37\].*36-layer target"):
        eagle3.aux_layers(pinned([24, 30, 37]), 36)


def test_check_target_names_the_mismatched_field():
    import types

    cfg = eagle3.config_from_hf(tiny_eagle3_config(TARGET_H))  # hidden 32, vocab 96, target hidden 24
    ok = types.SimpleNamespace(model_type="llama", hidden_size=TARGET_H, vocab_size=96, num_layers=8)
    assert eagle3.check_target(cfg, ok, own_embed=True) == (2, 4, 5)
    with pytest.raises(ConfigError, match="target_hidden_size = 24 but the llama target's hidden_size is 40"):
        eagle3.check_target(cfg, types.SimpleNamespace(**{**vars(ok), "hidden_size": 40}), own_embed=True)
    with pytest.raises(ConfigError, match="vocab_size = 96 but the llama target's vocab_size is 100"):
        eagle3.check_target(cfg, types.SimpleNamespace(**{**vars(ok), "vocab_size": 100}), own_embed=True)
    with pytest.raises(ConfigError, match="hidden_size = 32 differs .* no embed_tokens of its own"):
        eagle3.check_target(cfg, ok, own_embed=False)
    with pytest.raises(ConfigError, match="not boundaries of a 2-layer target"):
        eagle3.check_target(cfg, types.SimpleNamespace(**{**vars(ok), "num_layers": 2}), own_embed=True)


def test_folder_loader_checks_the_head_against_its_target(tmp_path, target6):
    from fx_engine.loading.drafter import load_eagle3_head

    _, m = target6  # hidden 64, vocab 384, 6 layers
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
              draft_vocab_size=128, intermediate_size=96)
    folder = write_tiny_eagle3(tmp_path / "head", 64, seed=14, **kw)
    p = load_eagle3_head(folder, m)
    assert p.config.draft_vocab_size == 128 and p.dtype == "float32" and p.embed is None
    assert load_eagle3_head(folder, m, dtype="bfloat16").lm_head.weight.dtype == mx.bfloat16
    # shards with their index, as larger heads ship
    cfg, tensors = read_eagle3_folder(folder)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, part in halves.items():
        mx.save_safetensors(str(sharded / f), {n: tensors[n] for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: f for f, part in halves.items() for n in part}}))
    (sharded / "config.json").write_text(json.dumps(cfg))
    q = load_eagle3_head(sharded, m)
    for a, b in zip(tree_leaves(p), tree_leaves(q), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))

    wrong = write_tiny_eagle3(tmp_path / "wrong", 48, seed=14, **kw)
    with pytest.raises(ConfigError, match="target_hidden_size = 48 but the llama target's hidden_size is 64"):
        load_eagle3_head(wrong, m)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(cfg))
    (pickled / "pytorch_model.bin").write_bytes(b"\0")  # (heads in torch's zip format: test_torch_pickle.py)
    with pytest.raises(WeightsError, match="pytorch_model.bin: not a zip archive"):
        load_eagle3_head(pickled, m)
    (pickled / "pytorch_model.bin").unlink()
    (pickled / "weights.pt").write_bytes(b"\0")
    with pytest.raises(WeightsError, match="no weights .* it has weights.pt"):
        load_eagle3_head(pickled, m)


# ---------------------------------------------------------------- llama.cpp's eagle3 GGUF


@pytest.mark.parametrize("rope", ["none", "llama3"])
def test_llama_cpp_gguf_head_reads_as_its_folder(tmp_path, target6, rope):
    """A head converted by llama.cpp (architecture eagle3: the layer as blk.0 with q / k rows
    permuted, hidden_norm as attn_norm_2, d2t as absolute ids, extract_layers the target's
    boundaries, a llama3 RoPE as rope_freqs factors) loads as the folder it came from: every
    param equal, the same target boundaries; with Q8_0 matrices, the same drafts."""
    from fx_engine.loading.drafter import is_eagle3_head, is_mtp_checkpoint, load_eagle3_head
    from fx_engine.testing.eagle3 import write_eagle3_gguf

    _, m = target6  # hidden 64, vocab 384, 6 layers
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
              draft_vocab_size=128, intermediate_size=96)
    if rope == "llama3":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    folder = write_tiny_eagle3(tmp_path / "head", 64, seed=21, embed=True, **kw)
    path = write_eagle3_gguf(folder, tmp_path / "head.gguf", m.config.num_layers)
    assert is_eagle3_head(path) and not is_mtp_checkpoint(path)
    want, got = load_eagle3_head(folder, m), load_eagle3_head(path, m)
    assert eagle3.aux_layers(got.config, 6) == eagle3.aux_layers(want.config, 6) == (2, 3, 3)
    for a, b in zip(tree_leaves(want), tree_leaves(got), strict=True):
        if rope == "llama3" and a.dtype == mx.float32 and a.shape == (8,):  # (rope periods: float math)
            np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6)
        else:
            np.testing.assert_array_equal(np.array(a), np.array(b))
    q8 = load_eagle3_head(write_eagle3_gguf(folder, tmp_path / "q8.gguf", 6, quant="Q8_0"), m)
    rng = np.random.default_rng(5)
    hidden = mx.array(rng.normal(size=(1, 5, 3 * 64)).astype(np.float32))
    toks = mx.array(rng.integers(0, 384, (1, 5)))
    cache = lambda: init_cache(eagle3.cache_specs(want.config), 1, 16)  # noqa: E731
    drafts = [eagle3.draft_chain(p, None, hidden, toks, cache(), mx.array([5]), 3)[0].tolist() for p in (want, q8)]
    assert drafts[0] == drafts[1]
    from fx_engine.engine.eagle3_drafter import Eagle3Drafter

    assert Eagle3Drafter.load(path, m, bits=8).head.config.aux_are_boundaries  # (the CLI's and server's way)


def test_info_names_a_head_and_loads_no_model(tmp_path, capsys):
    from fx_engine.cli import main
    from fx_engine.testing.eagle3 import write_eagle3_gguf

    folder = write_tiny_eagle3(tmp_path / "head", 64, seed=23, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=384, draft_vocab_size=128)
    for path in (folder, write_eagle3_gguf(folder, tmp_path / "h.gguf", 6)):
        assert main(["info", "--model", str(path)]) == 0
        out = capsys.readouterr().out
        assert f"speculative modules: an EAGLE-3 head: --draft-model {path} drafts with it" in out
        assert "matmul path chosen" not in out


def test_gguf_head_refusals_name_what_is_wrong(tmp_path, target6):
    import gguf

    from fx_engine.loading.drafter import load_eagle3_head
    from fx_engine.testing.eagle3 import write_eagle3_gguf

    _, m = target6
    kw = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
              draft_vocab_size=128, intermediate_size=96)
    path = write_eagle3_gguf(write_tiny_eagle3(tmp_path / "head", 64, seed=22, **kw), tmp_path / "h.gguf", 6)
    r = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "extra.gguf"), "eagle3")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        t = f.types[0]
        w.add_key_value(f.name, f.contents(), t, sub_type=f.types[-1] if t == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.add_tensor("blk.0.attn_q_norm.weight", np.ones(16, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(WeightsError, match="unexpected tensor 'blk.0.attn_q_norm.weight' for an EAGLE-3 head"):
        load_eagle3_head(tmp_path / "extra.gguf", m)
    with pytest.raises(ConfigError, match="is not an EAGLE-3 head"):
        eagle3.config_from_gguf({"general.architecture": "llama"}, 128, "m.gguf")
    with pytest.raises(ConfigError, match="'eagle3.extract_layers' is missing"):
        eagle3.config_from_gguf({"general.architecture": "eagle3"}, 128, "m.gguf")
