"""MTP modules from checkpoints (fx_engine.core.drafters.mtp) against a float64 numpy reference
written from the published architectures (fx_engine.testing.mtp: the DeepSeek-V3 report,
Hugging Face's modeling code, vLLM's deepseek_mtp / glm4_moe_mtp / qwen3_next_mtp /
qwen3_5_mtp / mimo_mtp forwards), never from the module's helpers; the loaders on tiny
modules in each published format (safetensors names, llama.cpp's glm4moe GGUF names);
chained drafting, batching and cache rollback."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

from fx_engine.core.cache import init_cache, with_lengths
from fx_engine.core.checkpoint import LoadOptions, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import mtp
from fx_engine.core.tree import tree_leaves
from fx_engine.testing.mtp import (KINDS, mtp_prefix, reference_step, tiny_mtp_config, tiny_mtp_tensors,
                                   write_glm4moe_mtp_gguf)

TOL = dict(rtol=2e-4, atol=2e-4)


def _np(x):
    return np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, np.float64)


def _module(kind, seed=0, own_tables="copy", load_own=False, **cfg_kw):
    d = tiny_mtp_config(kind)
    w = tiny_mtp_tensors(kind, d, seed=seed, own_tables=own_tables)
    cfg = mtp.config_from_hf(d, **cfg_kw)
    return d, w, cfg, mtp.mtp_params_from_tensors(w, cfg, own_tables=load_own), mtp.tables_from_tensors(w, cfg)


def _cache(cfg, rows, capacity=32):
    return init_cache(mtp.cache_specs(cfg), rows, capacity)


def _inputs(d, rng, b, t):
    return rng.normal(size=(b, t, d["hidden_size"])), rng.integers(0, d["vocab_size"], (b, t))


def _f32(x):
    return mx.array(np.asarray(x, np.float32))


# ---------------------------------------------------------------- (a) the forward against the reference


@pytest.mark.parametrize("kind", KINDS)
def test_forward_matches_the_reference(kind):
    """Two steps (a prefill of 5 pairs from position 0, where vLLM zeroes the embedding, then
    2 more) on two rows: logits and the hidden state fed on equal the reference's."""
    d, w, cfg, p, tables = _module(kind, seed=1)
    rng = np.random.default_rng(2)
    b, t0, t1 = 2, 5, 2
    h0, x0 = _inputs(d, rng, b, t0)
    h1, x1 = _inputs(d, rng, b, t1)
    cache = _cache(cfg, b)
    lg0, f0, cache = mtp.mtp_forward(p, tables, _f32(h0), mx.array(x0), cache, mx.array([t0] * b))
    lg1, f1, cache = mtp.mtp_forward(p, tables, _f32(h1), mx.array(x1), cache, mx.array([t1] * b))
    r0 = reference_step(kind, d, w, h0, x0, np.tile(np.arange(t0), (b, 1)))
    r1 = reference_step(kind, d, w, h1, x1, np.tile(np.arange(t0, t0 + t1), (b, 1)), r0["past"])
    assert lg0.shape == (b, t0, d["vocab_size"]) and lg0.dtype == mx.float32
    for got, want in ((lg0, r0["logits"]), (f0, r0["fed"]), (lg1, r1["logits"]), (f1, r1["fed"])):
        np.testing.assert_allclose(_np(got), want, **TOL)
    assert cache.lengths.tolist() == [t0 + t1] * b


@pytest.mark.parametrize("kind", ["deepseek_v3", "mimo"])
def test_the_reference_is_not_blind(kind):
    """The choices the formats differ in move the numbers: position 0's embedding zeroed or
    not (vLLM / SGLang), the pre-norm or normed state fed on, the concatenation order."""
    d, w, cfg, p, tables = _module(kind, seed=3)
    rng = np.random.default_rng(4)
    h, x = _inputs(d, rng, 1, 4)
    pos = np.arange(4)[None]
    base = reference_step(kind, d, w, h, x, pos)
    unmasked = reference_step(kind, d, w, h, x, pos, mask_first=False)
    assert np.abs(base["logits"] - unmasked["logits"]).max() > 1e-2
    assert np.abs(base["out"] - base["normed"]).max() > 1e-2
    # the implementation with SGLang's unmasked position 0 is the reference's unmasked variant
    q = mtp.mtp_params_from_tensors(w, mtp.config_from_hf(d, mask_first_position=False))
    lg, _, _ = mtp.mtp_forward(q, tables, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([4]))
    np.testing.assert_allclose(_np(lg), unmasked["logits"], **TOL)
    # swapping the halves of the projection (the other concatenation order) changes the output
    name = mtp_prefix(kind, d) + ("eh_proj.weight" if kind == "deepseek_v3" else "input_proj.weight")
    hh = d["hidden_size"]
    swapped = {**w, name: mx.concatenate([w[name][:, hh:], w[name][:, :hh]], axis=1)}
    assert np.abs(reference_step(kind, d, swapped, h, x, pos)["logits"] - base["logits"]).max() > 1e-2


def test_own_tables_are_read_only_when_asked():
    """DeepSeek-V3 ships copies of the embedding table and head in its MTP layer: skipped by
    default (the target's are read, SGLang's choice), read with own_tables (vLLM's)."""
    d, w, cfg, shared, tables = _module("deepseek_v3", seed=5, own_tables="distinct")
    own = mtp.mtp_params_from_tensors(w, cfg, own_tables=True)
    assert shared.modules[0].head is None and shared.modules[0].embed is None
    assert own.modules[0].head is not None and own.modules[0].embed is not None
    rng = np.random.default_rng(6)
    h, x = _inputs(d, rng, 1, 3)
    pos = np.arange(3)[None]
    for p, flag in ((shared, False), (own, True)):
        lg, _, _ = mtp.mtp_forward(p, tables, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([3]))
        np.testing.assert_allclose(_np(lg), reference_step("deepseek_v3", d, w, h, x, pos, own_tables=flag)["logits"],
                                   **TOL)
    lg, _, _ = mtp.mtp_forward(own, None, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([3]))  # needs no target's
    with pytest.raises(ValueError, match="no embedding table / head of its own: pass the target's tables"):
        mtp.mtp_forward(shared, None, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([3]))


def test_a_checkpoint_with_two_modules_runs_each():
    """num_nextn_predict_layers = 2: modules at model.layers.{N} and {N + 1}, one cache entry
    each; module 1 computes what the reference computes with its tensors."""
    d = tiny_mtp_config("deepseek_v3", num_nextn_predict_layers=2)
    w = tiny_mtp_tensors("deepseek_v3", d, seed=26)
    cfg = mtp.config_from_hf(d)
    p, tables = mtp.mtp_params_from_tensors(w, cfg), mtp.tables_from_tensors(w, cfg)
    assert cfg.num_modules == 2 and len(p.modules) == 2 and len(mtp.cache_specs(cfg)) == 2
    assert "model.layers.4.eh_proj.weight" in w and "2 MTP modules" in mtp.describe(d)
    rng = np.random.default_rng(27)
    h, x = _inputs(d, rng, 1, 4)
    cache = _cache(cfg, 1)
    lg, _, after = mtp.mtp_forward(p, tables, _f32(h), mx.array(x), cache, mx.array([4]), module=1)
    # the reference reads module 0's names: give it module 1's tensors there
    moved = {n.replace("model.layers.4.", "model.layers.3."): a for n, a in w.items()
             if not n.startswith("model.layers.3.")}
    want = reference_step("deepseek_v3", d, moved, h, x, np.arange(4)[None])["logits"]
    np.testing.assert_allclose(_np(lg), want, **TOL)
    np.testing.assert_array_equal(np.array(after.layers[0].keys), np.array(cache.layers[0].keys))  # module 0's
    with pytest.raises(ValueError, match="module 2 of 2"):
        mtp.mtp_forward(p, tables, _f32(h), mx.array(x), cache, mx.array([4]), module=2)


# ---------------------------------------------------------------- (b) chaining, batching, rollback


@pytest.mark.parametrize("kind", KINDS)
def test_chained_drafts_equal_the_reference_step_by_step(kind):
    """K = 3: one step over the new pairs, then the module fed its own output (vLLM's choice
    per format: pre-norm for DeepSeek / GLM, normed for Qwen3-Next / MiMo) and its argmax
    token at the next position; the reference chained by hand agrees, and so does the
    module's own forward step by step."""
    d, w, cfg, p, tables = _module(kind, seed=7)
    rng = np.random.default_rng(8)
    b, t, k = 2, 4, 3
    h, x = _inputs(d, rng, b, t)
    ids, lgs, hs, cache = mtp.draft_chain(p, tables, _f32(h), mx.array(x), _cache(cfg, b), mx.array([t] * b), k)
    assert ids.shape == (b, k) and lgs.shape == (b, k, d["vocab_size"]) and hs.shape == (b, k, d["hidden_size"])
    assert cache.lengths.tolist() == [t + k - 1] * b

    r = reference_step(kind, d, w, h, x, np.tile(np.arange(t), (b, 1)))
    lg, fed, past = r["logits"][:, -1], r["fed"][:, -1], r["past"]
    for j in range(k):
        np.testing.assert_allclose(_np(lgs[:, j]), lg, **TOL)
        np.testing.assert_allclose(_np(hs[:, j]), fed, **TOL)
        tok = lg.argmax(-1)
        np.testing.assert_array_equal(np.array(ids[:, j]), tok)
        r = reference_step(kind, d, w, fed[:, None], tok[:, None], np.full((b, 1), t + j), past)
        lg, fed, past = r["logits"][:, 0], r["fed"][:, 0], r["past"]

    lg, hid, c = mtp.mtp_forward(p, tables, _f32(h), mx.array(x), _cache(cfg, b), mx.array([t] * b))
    lg, hid = lg[:, -1], hid[:, -1]
    for j in range(k):
        tok = mx.argmax(lg, axis=-1)
        np.testing.assert_array_equal(np.array(tok), np.array(ids[:, j]))
        lg, hid, c = mtp.mtp_forward(p, tables, hid[:, None], tok[:, None], c, mx.array([1] * b))
        lg, hid = lg[:, 0], hid[:, 0]


def test_sglang_chaining_feeds_the_normed_state():
    """chain_normed=True (SGLang's DeepSeek NextN) feeds the shared head's normed state."""
    d, w, cfg, p, tables = _module("deepseek_v3", seed=9, chain_normed=True)
    rng = np.random.default_rng(10)
    h, x = _inputs(d, rng, 1, 3)
    _, fed, _ = mtp.mtp_forward(p, tables, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([3]))
    np.testing.assert_allclose(_np(fed), reference_step("deepseek_v3", d, w, h, x, np.arange(3)[None])["normed"],
                               **TOL)


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next"])
def test_batched_rows_draft_what_each_row_drafts_alone(kind):
    """Three rows with 5, 3 and 0 new pairs (padded): each row's drafts and logits are those
    of the row alone; the idle row's length stays."""
    d, w, cfg, p, tables = _module(kind, seed=11)
    rng = np.random.default_rng(12)
    h, x = _inputs(d, rng, 3, 5)
    nv = [5, 3, 0]
    ids, lgs, _, cache = mtp.draft_chain(p, tables, _f32(h), mx.array(x), _cache(cfg, 3), mx.array(nv), 3)
    assert cache.lengths.tolist() == [5 + 2, 3 + 2, 0]
    for r in (0, 1):
        n = nv[r]
        solo_ids, solo_lgs, _, _ = mtp.draft_chain(p, tables, _f32(h[r:r + 1, :n]), mx.array(x[r:r + 1, :n]),
                                                   _cache(cfg, 1), mx.array([n]), 3)
        np.testing.assert_array_equal(np.array(ids[r:r + 1]), np.array(solo_ids))
        np.testing.assert_allclose(_np(lgs[r:r + 1]), _np(solo_lgs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "mimo"])
def test_rollback_by_length_reruns_the_same(kind):
    """Truncating the module's cache (`with_lengths`) and running again gives the same
    result: positions 5..7 re-run after a rollback to 5 equal the first run's, and a
    chain drafted, rolled back and drafted again is the same chain."""
    d, w, cfg, p, tables = _module(kind, seed=13)
    rng = np.random.default_rng(14)
    h, x = _inputs(d, rng, 2, 8)
    lg, fed, cache = mtp.mtp_forward(p, tables, _f32(h), mx.array(x), _cache(cfg, 2), mx.array([8, 8]))
    back = with_lengths(cache, mx.array([5, 5]))
    lg2, fed2, again = mtp.mtp_forward(p, tables, _f32(h[:, 5:]), mx.array(x[:, 5:]), back, mx.array([3, 3]))
    np.testing.assert_allclose(_np(lg2), _np(lg[:, 5:]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_np(fed2), _np(fed[:, 5:]), rtol=1e-5, atol=1e-5)
    assert again.lengths.tolist() == [8, 8]

    hn, xn = _inputs(d, rng, 2, 2)
    first = mtp.draft_chain(p, tables, _f32(hn), mx.array(xn), cache, mx.array([2, 2]), 4)
    rolled = with_lengths(first[3], mx.array([8, 8]))
    second = mtp.draft_chain(p, tables, _f32(hn), mx.array(xn), rolled, mx.array([2, 2]), 4)
    np.testing.assert_array_equal(np.array(first[0]), np.array(second[0]))
    np.testing.assert_allclose(_np(first[1]), _np(second[1]), rtol=1e-5, atol=1e-5)


def test_the_compiled_step_traces_once_for_steady_state_decode():
    from fx_engine.core.tree import CompiledFunction

    d, w, cfg, p, tables = _module("glm4_moe", seed=15)
    step = CompiledFunction(mtp.mtp_step, name="mtp_step_test")
    rng = np.random.default_rng(16)
    cache = plain_cache = _cache(cfg, 2)
    for _ in range(3):
        h, x = _inputs(d, rng, 2, 1)
        tok, lg, hid, cache = step(p, tables, _f32(h), mx.array(x), cache, mx.array([1, 1]), 32)
        want = mtp.mtp_step(p, tables, _f32(h), mx.array(x), plain_cache, mx.array([1, 1]), 32)
        plain_cache = want[3]
        np.testing.assert_array_equal(np.array(tok), np.array(want[0]))
        np.testing.assert_allclose(_np(lg), _np(want[1]), rtol=1e-5, atol=1e-5)
    assert cache.lengths.tolist() == [3, 3] and step.traces == 1


# ---------------------------------------------------------------- (c) the loaders


@pytest.mark.parametrize("kind", KINDS)
def test_loader_reads_every_published_name(kind):
    """Every tensor the tiny module ships under its published names is read (the loader
    reports any it does not), alongside the trunk's, which it leaves alone; the config
    says where the modules sit."""
    d, w, cfg, p, _ = _module(kind, seed=17)
    pre = mtp_prefix(kind, d)
    assert mtp.module_prefix(cfg, 0) == pre
    assert cfg.num_modules == 1 and len(p.modules) == 1
    assert cfg.first_layer == (d["num_hidden_layers"] if kind in ("deepseek_v3", "glm4_moe") else 0)
    trunk = {"model.layers.0.self_attn.o_proj.weight": mx.zeros((4, 4)), "model.norm.weight": mx.zeros((4,))}
    mtp.mtp_params_from_tensors({**w, **trunk}, cfg)
    if kind in ("deepseek_v3", "glm4_moe"):
        m = p.modules[0]
        np.testing.assert_array_equal(_np(m.proj.dense_out_in), _np(w[pre + "eh_proj.weight"]))
        np.testing.assert_array_equal(_np(m.embed_norm), _np(w[pre + "enorm.weight"]))
        np.testing.assert_array_equal(_np(m.hidden_norm), _np(w[pre + "hnorm.weight"]))
        np.testing.assert_array_equal(_np(m.norm), _np(w[pre + "shared_head.norm.weight"]))
    elif kind == "mimo":
        np.testing.assert_array_equal(_np(p.modules[0].proj.dense_out_in), _np(w[pre + "input_proj.weight"]))
        np.testing.assert_array_equal(_np(p.modules[0].hidden_norm), _np(w[pre + "hidden_layernorm.weight"]))
    else:  # RMSNorms stored as w of 1 + w: the 1 added at load
        np.testing.assert_allclose(_np(p.modules[0].norm), 1 + _np(w["mtp.norm.weight"]), rtol=1e-6)
        np.testing.assert_array_equal(_np(p.modules[0].proj.dense_out_in), _np(w["mtp.fc.weight"]))


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_next", "mimo"])
def test_loader_names_missing_and_unexpected_tensors(kind):
    d, w, cfg, _, _ = _module(kind, seed=18)
    pre = mtp_prefix(kind, d)
    proj = {"deepseek_v3": pre + "eh_proj.weight", "qwen3_next": "mtp.fc.weight",
            "mimo": pre + "input_proj.weight"}[kind]
    with pytest.raises(WeightsError, match=f"missing tensor '{proj}'"):
        mtp.mtp_params_from_tensors({n: a for n, a in w.items() if n != proj}, cfg)
    extra = pre + "self_attn.o_proj.weight_scale_inv"  # an FP8 checkpoint's scales: not read
    with pytest.raises(WeightsError, match=f"unexpected tensor.*MTP module: '{extra}'"):
        mtp.mtp_params_from_tensors({**w, extra: mx.ones((1, 1))}, cfg)
    bad = {**w, proj: mx.zeros((d["hidden_size"], d["hidden_size"]))}
    with pytest.raises(WeightsError, match=rf"'{proj}' has shape \(64, 64\), expected \(64, 128\)"):
        mtp.mtp_params_from_tensors(bad, cfg)


def test_a_quantized_module_loads_and_runs_as_its_dequantized_weights():
    """MLX affine-quantized linears (`.scales` / `.biases`, the checkpoint's quantization
    config) load through the same names and compute what their dequantized weights do."""
    d, w, cfg, _, tables = _module("mimo", seed=19)
    q, deq = dict(w), dict(w)
    for name, a in w.items():
        if name.startswith("model.mtp_layers.") and name.endswith("proj.weight"):
            packed = mx.quantize(a, group_size=32, bits=8)
            q[name], q[name[:-6] + "scales"], q[name[:-6] + "biases"] = packed
            deq[name] = mx.dequantize(*packed, group_size=32, bits=8)
    pq = mtp.mtp_params_from_tensors(q, cfg, LoadOptions(dtype=mx.float32, quant={"group_size": 32, "bits": 8}))
    pd = mtp.mtp_params_from_tensors(deq, cfg)
    rng = np.random.default_rng(20)
    h, x = _inputs(d, rng, 1, 4)
    want, _, _ = mtp.mtp_forward(pd, tables, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([4]))
    got, _, _ = mtp.mtp_forward(pq, tables, _f32(h), mx.array(x), _cache(cfg, 1), mx.array([4]))
    np.testing.assert_allclose(_np(got), _np(want), rtol=1e-4, atol=1e-4)


def test_qwen_norm_offset_can_be_given():
    """A checkpoint whose converter already folded the 1 into the RMSNorms loads with
    norm_offset=0 to the same params."""
    d, w, cfg, p, _ = _module("qwen3_next", seed=21)
    norms = [n for n in w if n.startswith("mtp.") and n.endswith(("norm.weight", "layernorm.weight",
                                                                   "pre_fc_norm_embedding.weight",
                                                                   "pre_fc_norm_hidden.weight"))]
    assert "mtp.layers.0.self_attn.q_norm.weight" in norms and "mtp.pre_fc_norm_hidden.weight" in norms
    folded = {**w, **{n: w[n] + 1 for n in norms}}
    q = mtp.mtp_params_from_tensors(folded, cfg, norm_offset=0.0)
    for a, b in zip(tree_leaves(p), tree_leaves(q), strict=True):
        np.testing.assert_allclose(_np(a), _np(b), rtol=1e-6, atol=1e-6)


def test_glm4moe_gguf_nextn_layer_reads_as_the_safetensors_one(tmp_path):
    """llama.cpp's glm4moe NextN layer (blk.{N}.nextn.* next to the layer's usual tensors)
    loads to the same params as the Hugging Face names, q/k norms and biases from the file."""
    from fx_engine.loading.gguf import read_gguf

    d, w, cfg, _, _ = _module("glm4_moe", seed=22)
    path = write_glm4moe_mtp_gguf(tmp_path / "m.gguf", d, w)
    tensors, md = read_gguf(path)
    assert any(n.startswith("blk.3.nextn.") for n in tensors)
    assert mtp.mtp_layers_in_gguf(md) == 1
    gcfg = mtp.config_from_gguf(md, str(path))
    assert (gcfg.kind, gcfg.first_layer, gcfg.num_modules) == ("glm4_moe", 3, 1)
    assert gcfg.layer.qk_norm and gcfg.layer.qkv_bias and gcfg.layer.moe_layers == (True,)
    for own in (False, True):
        g = mtp.mtp_params_from_gguf(tensors, gcfg, own_tables=own)
        s = mtp.mtp_params_from_tensors(w, cfg, own_tables=own)
        for a, b in zip(tree_leaves(g), tree_leaves(s), strict=True):
            np.testing.assert_array_equal(_np(a), _np(b))
    with pytest.raises(ConfigError, match="'glm4moe.nextn_predict_layers' = 0"):
        mtp.config_from_gguf({**md, "glm4moe.nextn_predict_layers": 0}, "m.gguf")
    with pytest.raises(ConfigError, match="architecture 'llama'"):  # (llama.cpp writes no NextN layers for it)
        mtp.config_from_gguf({"general.architecture": "llama"}, "m.gguf")
    with pytest.raises(ConfigError, match="'qwen35.nextn_predict_layers' = 0"):
        mtp.config_from_gguf({"general.architecture": "qwen35"}, "m.gguf")
    with pytest.raises(ConfigError, match="'deepseek2.nextn_predict_layers' = 0"):
        mtp.config_from_gguf({"general.architecture": "deepseek2"}, "m.gguf")


# ---------------------------------------------------------------- (d) configs, refusals, what the target gives


def test_what_each_config_ships_and_where_the_target_state_is_taken():
    from fx_engine.core.models import Capture

    for kind in KINDS:
        d = tiny_mtp_config(kind)
        assert mtp.mtp_layers_in(d) == 1, kind
        cfg = mtp.config_from_hf(d)
        want = Capture((d["num_hidden_layers"],)) if kind == "mimo" else Capture((), normed=True)
        assert mtp.target_capture(cfg, d["num_hidden_layers"]) == want, kind
        assert "1 MTP module" in mtp.describe(d)
    assert mtp.mtp_layers_in({"model_type": "llama"}) == 0 and mtp.describe({"model_type": "llama"}) is None
    assert mtp.mtp_layers_in(tiny_mtp_config("deepseek_v3", num_nextn_predict_layers=0)) == 0
    # the Qwen3.5 wrapper: its text model's mtp_num_hidden_layers
    text = tiny_mtp_config("qwen3_5_text", mtp_num_hidden_layers=2)
    wrapped = {"model_type": "qwen3_5", "text_config": {k: v for k, v in text.items() if k != "model_type"}}
    assert mtp.mtp_layers_in(wrapped) == 2
    assert mtp.config_from_hf(wrapped).layer.qwen3_5
    assert "model.layers.3" in mtp.describe(tiny_mtp_config("deepseek_v3"))
    # defaults follow vLLM: position 0 masked but for Qwen3-Next, the pre-norm state fed on for DeepSeek / GLM
    defaults = {k: (mtp.config_from_hf(tiny_mtp_config(k)).mask_first_position,
                    mtp.config_from_hf(tiny_mtp_config(k)).chain_normed) for k in KINDS}
    assert defaults == {"deepseek_v3": (True, False), "glm4_moe": (True, False), "qwen3_next": (False, True),
                        "qwen3_5_text": (False, True), "qwen3_5_moe_text": (False, True), "mimo": (True, True)}


def test_sglang_nextn_checkpoints_put_the_layer_at_zero():
    """SGLang's extracted DeepSeek NextN checkpoints hold the MTP layer alone, as layer 0."""
    d = tiny_mtp_config("deepseek_v3", architectures=["DeepseekV3ForCausalLMNextN"], num_hidden_layers=1)
    cfg = mtp.config_from_hf(d)
    assert cfg.first_layer == 0 and mtp.module_prefix(cfg, 0) == "model.layers.0." and cfg.layer.moe_layers == (True,)


def test_refusals_name_the_field():
    with pytest.raises(ConfigError, match="model_type 'llama' has no MTP modules"):
        mtp.config_from_hf({"model_type": "llama"}, "c.json")
    with pytest.raises(ConfigError, match="field 'num_nextn_predict_layers' = 0: the checkpoint ships no MTP"):
        mtp.config_from_hf(tiny_mtp_config("deepseek_v3", num_nextn_predict_layers=0), "c.json")
    with pytest.raises(ConfigError, match="field 'mtp_num_hidden_layers' = 0"):
        mtp.config_from_hf(tiny_mtp_config("qwen3_5_text", mtp_num_hidden_layers=0), "c.json")
    with pytest.raises(ConfigError, match="sliding-window"):
        mtp.config_from_hf(tiny_mtp_config("mimo", use_sliding_window=True, sliding_window=8, max_window_layers=0))

    from fx_engine.core.models import config_from_hf as target_config

    d = tiny_mtp_config("deepseek_v3")
    cfg = mtp.config_from_hf(d)
    target = target_config(d)
    mtp.check_target(cfg, target)
    with pytest.raises(ConfigError, match="hidden_size = 64 but the deepseek_v3 target's hidden_size is 96"):
        mtp.check_target(cfg, attrs.evolve(target, hidden_size=96))
    with pytest.raises(ConfigError, match="vocab_size = 384 but the deepseek_v3 target's vocab_size is 500"):
        mtp.check_target(cfg, attrs.evolve(target, vocab_size=500))
    with pytest.raises(ConfigError, match="sits at layer 3 .* target has 5 layers"):
        mtp.check_target(cfg, attrs.evolve(target, num_layers=5))
    with pytest.raises(ConfigError, match="DeepSeek-V3 format cannot draft for a glm4_moe target"):
        mtp.check_target(cfg, target_config(tiny_mtp_config("glm4_moe")))

    _, _, cfg, p, tables = _module("mimo", seed=23)
    with pytest.raises(ValueError, match=r"hidden states are \(1, 2, 32\), expected \(1, 2, 64\)"):
        mtp.mtp_forward(p, tables, mx.zeros((1, 2, 32)), mx.zeros((1, 2), mx.int32), _cache(cfg, 1), mx.array([2]))


# ---------------------------------------------------------------- (e) fed by the target's compiled steps


def test_a_loaded_target_feeds_the_module_through_the_capture_seam(tmp_path):
    """A tiny DeepSeek-V3 folder whose checkpoint holds its MTP layer: the target loads (its
    MTP tensors unread), its compiled prefill returns the state the module takes
    (`target_capture`: the final norm's output, equal to the step's own hidden states) and
    the module's first draft is the reference's on it, with the target's own tables."""
    import fx_engine
    from fx_engine.core.steps import hidden_step, logits_step
    from fx_engine.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "ds", "deepseek_v3", seed=24, num_nextn_predict_layers=1)
    d = __import__("json").loads((folder / "config.json").read_text())
    trunk = dict(mx.load(str(folder / "model.safetensors")))
    w = {**trunk, **{n: a for n, a in tiny_mtp_tensors("deepseek_v3", d, seed=25).items()
                     if n.startswith(mtp_prefix("deepseek_v3", d))}}
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "mlx"})
    m = fx_engine.load(folder)
    cfg = mtp.config_from_hf(d)
    mtp.check_target(cfg, m.config)
    p = mtp.mtp_params_from_tensors(w, cfg)
    toks = mx.array([[5, 9, 17, 40, 3, 77]], mx.int32)
    nv = mx.array([6], mx.int32)
    _, _, captured = logits_step(m.params, m.new_cache(1, 16), toks, nv, capture=mtp.target_capture(cfg, 3))
    hid, _ = hidden_step(m.params, m.new_cache(1, 16), toks, nv)
    np.testing.assert_allclose(_np(captured), _np(hid), rtol=1e-5, atol=1e-5)
    # pairs (h_t, x_{t+1}) for t = 0 .. 4; the last pair's logits predict x_7
    hidden, nxt = captured[:, :5], toks[:, 1:]
    ids, lgs, _, _ = mtp.draft_chain(p, mtp.target_tables(m.params), hidden, nxt, _cache(cfg, 1), mx.array([5]), 1)
    ref = reference_step("deepseek_v3", d, w, _np(hidden), np.array(nxt), np.arange(5)[None])
    np.testing.assert_allclose(_np(lgs[:, 0]), ref["logits"][:, -1], **TOL)


def test_an_fp8_original_checkpoint_reads_its_module_dequantized(tmp_path):
    """DeepSeek-V3's original (the copy that keeps its MTP layer) stores FP8 blocks with
    weight_scale_inv: the module's tensors are dequantized as read (loading.fp8) and equal
    the module loaded from the same exact values stored as floats; a quantization scheme
    not read (AWQ / GPTQ: they carry bits and group_size too) is refused by name."""
    import json

    import numpy as np

    from fx_engine.loading.drafter import load_mtp_module
    from fx_engine.testing.fp8 import write_fp8_folder
    from fx_engine.testing.mtp import write_mtp_target

    folder = write_mtp_target(tmp_path / "ds", "deepseek_v3")
    raw0 = json.loads((folder / "config.json").read_text())
    exact = write_fp8_folder(folder, tmp_path / "ds-fp8", (32, 32))
    assert any(n.startswith(mtp_prefix("deepseek_v3", raw0)) for n in exact)  # (the module's own linears too)
    w = dict(mx.load(str(folder / "model.safetensors")))
    w.update({n: mx.array(v.astype(np.float32)) for n, v in exact.items()})
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    got, want = load_mtp_module(tmp_path / "ds-fp8"), load_mtp_module(folder)
    for a, b in zip(tree_leaves(got), tree_leaves(want), strict=True):
        np.testing.assert_array_equal(_np(a), _np(b))
    raw = json.loads((folder / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="quant_method 'awq' is not read"):
        load_mtp_module(folder)