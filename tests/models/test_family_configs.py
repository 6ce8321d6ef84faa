"""Families added as one module each over the Llama family's blocks: the post-norm decoders
(OLMo 2 / 3, EXAONE 4, GLM-4), GPT-OSS, DeepSeek-V3 / Kimi K2 (MLA). Parity with mlx-lm's own
classes on tiny random models, greedy generation against mlx-lm's generate_step, the engine
on them; and the registry's answer to a model_type it does not know."""

from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf
from fx_engine.engine.generate import reference_generate
from fx_engine.testing import write_tiny_model
from fx_engine.testing.tiny import tiny_config

from tests.conftest import LONG_TEXT
from tests.models.test_parity import _compare, assert_batch_equals_solo, assert_greedy_matches_mlx_lm, mlx_community

pytestmark = pytest.mark.oracle

CASES = [
    ("olmo2", {}),
    ("olmo2", {"tie_word_embeddings": True, "num_key_value_heads": 4,
               "rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("olmo3", {}),  # 3 sliding layers (window 16 < the 96-token sequence), then a global one
    ("olmo3", {"layer_types": ["sliding_attention", "full_attention"] * 2, "num_key_value_heads": 1,
               "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
    ("exaone4", {}),  # LLLG: sliding local layers with RoPE, a NoPE global layer
    ("exaone4", {"sliding_window_pattern": None, "num_hidden_layers": 2, "tie_word_embeddings": False,
                 "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("glm4", {}),  # sandwich norms, q/k/v biases, fused gate_up, half the head rotated, interleaved
    ("glm4", {"partial_rotary_factor": 1.0, "attention_bias": False, "num_key_value_heads": 1}),
]


def _mlx_lm(path: Path):
    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(path))
    ref.set_dtype(mx.float32)
    return ref


def _matches_mlx_lm(path: Path, n: int = 96, chunks: tuple[int, ...] = (8, 40)) -> None:
    """fx-engine's teacher-forced logits equal mlx-lm's, chunked below and above windows."""
    model = fx_engine.load(path)
    ids = model.tokenizer.encode(LONG_TEXT)[:n]
    want = _mlx_lm(path)(mx.array([ids]))[0]
    for chunk in chunks:
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


@pytest.mark.parametrize("model_type,overrides", CASES, ids=lambda x: str(x)[:60])
def test_teacher_forced_logits_match_mlx_lm(model_type, overrides, tiny_folder):
    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    ids = model.tokenizer.encode(LONG_TEXT)[:96]
    want = _mlx_lm(path)(mx.array([ids]))[0]
    for chunk in (8, 40):  # chunks shorter and longer than the window
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3", "exaone4", "glm4", "cohere2", "starcoder2"])
def test_greedy_generation_matches_mlx_lm_generate_step(model_type, tiny_folder):
    """mlx-lm's generate_step with its rotating caches for sliding layers, same prefill step."""
    path = tiny_folder(model_type)
    model = fx_engine.load(path)
    prompt = model.tokenizer.encode(LONG_TEXT)[:53]
    assert_greedy_matches_mlx_lm(path, model, prompt)


@pytest.mark.parametrize("model_type", ["olmo3", "exaone4"])
def test_sliding_postnorm_models_in_the_engine(model_type, tiny_folder):
    """Batch-invariant rows joining at different steps equal each request alone (rings in
    the sliding layers; EXAONE 4's NoPE global layer); self-draft speculation (the
    family's layer_range) stays exact."""
    from fx_engine.engine.drafters import self_draft_model

    path = tiny_folder(model_type)
    model = fx_engine.load(path, batch_invariant=True)
    ids = model.tokenizer.encode(LONG_TEXT)
    prompts = [ids[:n] for n in (5, 40, 23)]
    assert_batch_equals_solo(model, prompts, max_tokens=20, chunk=8)
    fast = fx_engine.load(path)
    refs = [reference_generate(fast, p, max_tokens=24, temperature=0.0).token_ids for p in prompts]
    with fx_engine.Engine(fast, max_rows=4, prefill_chunk=8) as eng:
        draft = [eng.submit(p, max_tokens=24, draft_model=self_draft_model(fast, 2)) for p in prompts]
        assert [h.result().token_ids for h in draft] == refs


@pytest.mark.parametrize("model_type,extra", [
    ("gemma3_text", {}), ("gemma4_text", {"hidden_size_per_layer_input": 0}), ("gemma4_text", {}), ("nemotron_h", {}),
    ("qwen3_next", {}), ("granitemoehybrid", {}), ("falcon_h1", {}), ("cohere2", {})])
def test_self_drafts_of_every_layered_family_are_exact(model_type, extra, tiny_folder):
    """A draft of the target's first layers (`Family.layer_range`: per-layer kinds cut,
    Gemma 4's KV-shared layers kept where their source layers are) leaves greedy tokens
    unchanged (what the draft computes: tests/models/test_gemma.py's truncated-checkpoint test,
    and the pipeline stages in tests/distributed/test_parallel.py)."""
    from fx_engine.engine.drafters import self_draft_model

    fast = fx_engine.load(tiny_folder(model_type, **extra))
    ids = fast.tokenizer.encode(LONG_TEXT)
    prompts = [ids[:n] for n in (5, 30, 17)]
    refs = [reference_generate(fast, p, max_tokens=16, temperature=0.0).token_ids for p in prompts]
    draft = self_draft_model(fast, fast.config.num_layers - 1)
    assert draft.config.num_layers == fast.config.num_layers - 1
    with fx_engine.Engine(fast, max_rows=4, prefill_chunk=8) as eng:
        assert [eng.submit(p, max_tokens=16, draft_model=draft).result().token_ids for p in prompts] == refs
    if model_type == "gemma4_text":
        assert draft.config.num_kv_shared_layers == fast.config.num_kv_shared_layers - 1


def test_postnorm_config_refusals():
    cases = [
        ("olmo3", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("olmo3", {"sliding_window": None}, "sliding_window"),
        ("olmo2", {"layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        ("olmo2", {"rope_scaling": {"type": "su", "factor": 2.0}}, "rope_scaling"),
        ("exaone4", {"sliding_window_pattern": "LLXG"}, "sliding_window_pattern"),
        ("exaone4", {"sliding_window_pattern": "LLL"}, "sliding_window_pattern"),
        ("glm4", {"partial_rotary_factor": 0.1875}, "partial_rotary_factor"),  # 3 dims: odd
        ("glm4", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ]
    for mt, overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**tiny_config(mt), **overrides}, "config.json")


def test_config_fields_read_as_declared():
    """`read_fields` (core/config.py): how each Field falls back to its default, `Same`
    defaults, `to` names, and errors that name the field."""
    from fx_engine.core.config import FLOAT, Field, Same, read_fields

    table = (Field("heads"), Field("kv", default=Same("heads"), or_default=True, to="kv_heads"),
             Field("eps", FLOAT, 1e-6, null_default=True), Field("theta", FLOAT, 1e4))
    assert read_fields({"heads": 4, "kv": 0, "eps": None}, table, "c") == {
        "heads": 4, "kv_heads": 4, "eps": 1e-6, "theta": 1e4}
    assert read_fields({"heads": 4, "kv": 2, "eps": 1e-5, "theta": 5}, table, "c") == {
        "heads": 4, "kv_heads": 2, "eps": 1e-5, "theta": 5.0}
    with pytest.raises(ConfigError, match="c: required field 'heads' is missing"):
        read_fields({"heads": None}, table, "c")
    with pytest.raises(ConfigError, match="c: field 'kv' must be a positive integer, got -1"):
        read_fields({"heads": 4, "kv": -1}, table, "c")


def test_any_params_names_every_family():
    """`AnyParams` (the steps' params annotation) is the union of the registry's params types."""
    from typing import get_args

    from fx_engine.core.models import FAMILIES, AnyParams

    assert set(get_args(AnyParams)) == {f.params_type for f in FAMILIES}


def test_unknown_model_type_names_the_nearest_supported_ones():
    with pytest.raises(ConfigError) as e:
        config_from_hf({**tiny_config("qwen3_moe"), "model_type": "qwen3_moe_x"}, "config.json")
    assert "model_type 'qwen3_moe_x' is not supported" in str(e.value)
    assert "nearest supported: qwen3_moe (moe family)" in str(e.value)
    with pytest.raises(ConfigError, match="model_type 'rwkv9' is not supported"):
        config_from_hf({"model_type": "rwkv9"}, "config.json")


# ------------------------------------------------------------------ gpt_oss

GPT_OSS = [
    {},  # alternating sliding (window 16) / global, YaRN RoPE
    {"layer_types": ["full_attention", "sliding_attention", "full_attention", "full_attention"],
     "rope_scaling": None, "num_experts_per_tok": 1},
    {"num_key_value_heads": 4, "num_hidden_layers": 2},  # expert weights x8: the clamp bites
]


@pytest.mark.parametrize("overrides", GPT_OSS, ids=lambda x: str(x)[:60])
def test_gpt_oss_matches_mlx_lm(tmp_path, overrides):
    """Attention sinks, q/k/v/o biases, sliding layers, router and expert biases, the
    clamped SwiGLU: mlx-lm's logits, with chunks below and above the window. (mlx-lm's
    SwiGLU always clamps at 7, ignoring swiglu_limit; fx-engine reads it as Hugging Face
    does: every released config says 7.)"""
    path = write_tiny_model(tmp_path / "m", "gpt_oss", **overrides)
    if overrides.get("num_hidden_layers") == 2:
        w = mx.load(str(path / "model.safetensors"))
        big = {k: v * 8 for k, v in w.items() if ".experts.gate_proj." in k or ".experts.up_proj." in k}
        mx.save_safetensors(str(path / "model.safetensors"), {**w, **big})
    _matches_mlx_lm(path)


def test_gpt_oss_quantized_folder_and_hf_layout(tmp_path, tiny_folder):
    """An mlx-community style folder (mlx-lm's quantize_model: 4-bit experts and attention,
    its 8-bit router) matches mlx-lm, experts dequantized or kept packed; the Hugging Face
    dense layout (gate_up_proj [E, H, 2F], gate/up interleaved) of the same float weights
    gives the same logits as mlx-lm's sanitized one; MXFP4 blocks are a clear error."""
    import json

    from fx_engine.core.checkpoint import WeightsError

    path = tiny_folder("gpt_oss")
    q = mlx_community(path, tmp_path / "q")
    want = _mlx_lm(q)
    model = fx_engine.load(q)
    ids = model.tokenizer.encode(LONG_TEXT)[:72]
    ref = want(mx.array([ids]))[0]
    _compare(fx_engine.logits(model, ids, chunk=36), ref)
    kept = fx_engine.load(q, keep_quantized=True)
    assert kept.params.layers[0].down.quantized and kept.params.layers[0].down.bias is not None
    _compare(fx_engine.logits(kept, ids, chunk=36), ref)

    w = mx.load(str(path / "model.safetensors"))
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts."
        g, u = w.pop(p + "gate_proj.weight"), w.pop(p + "up_proj.weight")  # [E, F, H]
        gb, ub = w.pop(p + "gate_proj.bias"), w.pop(p + "up_proj.bias")
        gu = mx.stack([g, u], axis=2).reshape(g.shape[0], -1, g.shape[-1])  # rows g0 u0 g1 u1 ...
        w[p + "gate_up_proj"] = mx.contiguous(gu.swapaxes(-1, -2))  # [E, H, 2F]
        w[p + "gate_up_proj_bias"] = mx.stack([gb, ub], axis=-1).reshape(gb.shape[0], -1)
        w[p + "down_proj"] = mx.contiguous(w.pop(p + "down_proj.weight").swapaxes(-1, -2))
        w[p + "down_proj_bias"] = w.pop(p + "down_proj.bias")
    hf = tmp_path / "hf"
    hf.mkdir()
    mx.save_safetensors(str(hf / "model.safetensors"), w)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (hf / name).write_bytes((path / name).read_bytes())
    a = fx_engine.logits(fx_engine.load(hf), ids)
    b = fx_engine.logits(fx_engine.load(path), ids)
    assert mx.allclose(a, b, atol=1e-5).item()
    blocks = {k: v for k, v in w.items() if "gate_up_proj" not in k}
    blocks["model.layers.0.mlp.experts.gate_up_proj_blocks"] = mx.zeros((8, 64, 2, 16), mx.uint8)
    mx.save_safetensors(str(hf / "model.safetensors"), blocks)
    with pytest.raises(WeightsError, match="MXFP4"):
        fx_engine.load(hf)


def test_gpt_oss_generation_and_engine(tiny_folder):
    """Greedy tokens equal mlx-lm's generate_step (rotating caches for the sliding layers);
    batch-invariant rows equal each request alone; prompt lookup stays exact; an 8-bit KV
    cache (sinks over quantized global layers) runs its own reference loop."""
    path = tiny_folder("gpt_oss")
    model = fx_engine.load(path)
    prompt = model.tokenizer.encode(LONG_TEXT)[:45]
    assert_greedy_matches_mlx_lm(path, model, prompt)
    bi = fx_engine.load(path, batch_invariant=True)
    prompts = [prompt[:n] for n in (5, 40, 23)]
    alone = [reference_generate(bi, p, max_tokens=16, temperature=0.0, prefill_chunk=8) for p in prompts]
    with fx_engine.Engine(bi, max_rows=4, prefill_chunk=8) as engine:
        handles = [engine.submit(p, max_tokens=16, temperature=0.0) for p in prompts]
        assert [h.result().token_ids for h in handles] == [a.token_ids for a in alone]
    refs = [reference_generate(model, p, max_tokens=20, temperature=0.0).token_ids for p in prompts]
    with fx_engine.Engine(model, max_rows=4, prefill_chunk=8) as engine:
        spec = [engine.submit(p, max_tokens=20, prompt_lookup=True) for p in prompts]
        assert [h.result().token_ids for h in spec] == refs
    q8 = fx_engine.load(tiny_folder("gpt_oss", head_dim=32), kv_bits=8,
                        kv_group_size=32)
    ref8 = reference_generate(q8, prompt, max_tokens=12, temperature=0.0).token_ids
    assert fx_engine.generate(q8, prompt, max_tokens=12, temperature=0.0).token_ids == ref8


# ------------------------------------------------------------------ deepseek_v3 / kimi_k2 (MLA)

DEEPSEEK = [
    ("deepseek_v3", {}),  # q LoRA, YaRN (mscale_all_dim), 4 groups of 2, a shared expert, a dense layer 0
    ("kimi_k2", {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "n_shared_experts": None,
                 "first_k_dense_replace": 0, "rope_scaling": None, "norm_topk_prob": False,
                 "num_experts_per_tok": 3}),
    ("deepseek_v3", {"attention_bias": True, "moe_layer_freq": 2, "n_group": 2, "topk_group": 1,
                     "qk_rope_head_dim": 16, "v_head_dim": 24}),
    # DeepSeek-V2-Lite's shape (one q_proj, softmax routing over every expert, two shared
    # experts), and DeepSeek-V2's (q LoRA, group-limited routing: 2 of 4 groups, scaled)
    ("deepseek_v2", {}),
    ("deepseek_v2", {"q_lora_rank": 48, "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 16.0, "num_experts_per_tok": 3}),
]


@pytest.mark.parametrize("model_type,overrides", DEEPSEEK, ids=lambda x: str(x)[:60])
def test_deepseek_mla_matches_mlx_lm(model_type, overrides, tiny_folder):
    """Multi-head latent attention in the absorbed form (one token at a time and in chunks),
    grouped sigmoid routing with the correction bias (DeepSeek-V2: softmax routing, greedy or
    group-limited): mlx-lm's logits."""
    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    want = _mlx_lm(path)(mx.array([ids]))[0]
    for chunk in (1, 8, 40):
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


def test_deepseek_v2_group_limited_routing_is_hugging_faces():
    """DeepSeek-V2's router against Hugging Face's DeepseekV2TopkRouter written out in numpy:
    softmax scores, the topk_group groups with the best single score kept, the top-k of
    those (as a set: both sides leave the order unsorted), the weights the scores x scale."""
    import numpy as np

    from fx_engine.core.models.deepseek import softmax_route

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 16)).astype(np.float32) * 3
    for groups, keep, k in ((4, 2, 3), (8, 3, 6), (1, 1, 4)):
        idx, w = softmax_route(mx.array(logits), k, groups, keep, 2.5)
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
        best = scores.reshape(64, groups, -1).max(-1)
        kept = np.argsort(-best, axis=-1)[:, :keep]
        mask = np.zeros_like(best, dtype=bool)
        np.put_along_axis(mask, kept, True, axis=-1)
        masked = np.where(np.repeat(mask, 16 // groups, axis=-1), scores, 0.0)
        want = np.argsort(-masked, axis=-1)[:, :k]
        got = np.array(idx)
        assert all(set(a) == set(b) for a, b in zip(got, want)), (groups, keep, k)
        np.testing.assert_allclose(np.array(w), np.take_along_axis(scores, got, -1) * 2.5, rtol=1e-6)


def test_deepseek_v2_refusals():
    for overrides, field in (({"norm_topk_prob": True}, "norm_topk_prob"), ({"topk_method": "noaux_tc"}, "topk_method"),
                             ({"mlp_bias": True}, "mlp_bias")):
        with pytest.raises(ConfigError, match=field):
            config_from_hf({**tiny_config("deepseek_v2"), **overrides})


def test_deepseek_cache_holds_the_latent_only(tiny_folder):
    """Per token and layer the cache holds kv_lora_rank + qk_rope_head_dim numbers (32 + 8
    here), not heads x (k + v) head dims (4 x 40); kv_bits leaves latent entries float."""
    model = fx_engine.load(tiny_folder("deepseek_v3"))
    layout = model.cache_layout(headroom=16)
    assert all((s.kv_heads, s.head_dim, s.v_dim, s.bits) == (1, 32, 8, 0) for s in layout)
    from fx_engine.core.cache import init_cache

    cache = init_cache(layout, rows=1, capacity=64)
    assert cache.layers[0].keys.shape == (1, 1, 65, 32) and cache.layers[0].values.shape == (1, 1, 65, 8)
    q8 = fx_engine.load(tiny_folder("deepseek_v3"), kv_bits=8, kv_group_size=32)
    assert all(s.bits == 0 for s in q8.cache_layout(headroom=16))


def test_deepseek_mlx_community_folder_and_engine(tmp_path, tiny_folder):
    """mlx-lm's own conversion (sanitized embed_q / unembed_out and switch_mlp stacks,
    quantized by quantize_model) matches mlx-lm; in the engine, batch-invariant rows equal
    each request alone, speculative decoding and the prefix cache stay exact."""
    # per-head maps wide enough for mlx-lm to quantize them (dims that are multiples of 32)
    path = tiny_folder("deepseek_v3", qk_nope_head_dim=32, kv_lora_rank=64,
                       v_head_dim=32)
    q = mlx_community(path, tmp_path / "q", bits=8)
    assert any(k.endswith("embed_q.scales") for k in mx.load(str(q / "model.safetensors")))
    model = fx_engine.load(q)
    ids = model.tokenizer.encode(LONG_TEXT)[:72]
    _compare(fx_engine.logits(model, ids, chunk=24), _mlx_lm(q)(mx.array([ids]))[0])

    bi = fx_engine.load(path, batch_invariant=True)
    prompts = [ids[:n] for n in (5, 40, 23)]
    assert_batch_equals_solo(bi, prompts, max_tokens=16, chunk=8)
    fast = fx_engine.load(path)
    refs = [reference_generate(fast, p, max_tokens=20, temperature=0.0).token_ids for p in prompts]
    from fx_engine.engine.drafters import self_draft_model

    with fx_engine.Engine(fast, max_rows=4, prefill_chunk=8) as eng:
        spec = [eng.submit(p, max_tokens=20, prompt_lookup=True) for p in prompts]
        draft = [eng.submit(p, max_tokens=20, draft_model=self_draft_model(fast, 1)) for p in prompts]
        assert [h.result().token_ids for h in spec] == refs
        assert [h.result().token_ids for h in draft] == refs
        again = eng.submit(prompts[1], max_tokens=20).result()
        assert again.token_ids == refs[1] and again.usage.cached_tokens >= 16


# ------------------------------------------------------------------ minicpm


def test_minicpm_tied_head_divides_by_the_width_ratio(tmp_path, tiny_folder):
    """MiniCPM's head reads the final state divided by hidden_size / dim_model_base whether
    or not it is tied (its remote code and llama.cpp; mlx-lm's tied branch leaves the
    division out): a tied folder's logits equal those of the untied folder whose lm_head is
    a copy of the embedding (that one checked against mlx-lm in test_parity)."""
    import json
    import shutil

    untied = tiny_folder("minicpm")
    tied = tmp_path / "tied"
    shutil.copytree(untied, tied)
    w = dict(mx.load(str(tied / "model.safetensors")))
    w["lm_head.weight"] = w["model.embed_tokens.weight"]
    mx.save_safetensors(str(untied.parent / "copy.safetensors"), w)
    copy = tmp_path / "copy"
    shutil.copytree(untied, copy)
    shutil.move(str(untied.parent / "copy.safetensors"), copy / "model.safetensors")
    del w["lm_head.weight"]
    mx.save_safetensors(str(tied / "model.safetensors"), w)
    cfg = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    a, b = fx_engine.load(tied), fx_engine.load(copy)
    assert a.params.lm_head is None and b.params.lm_head is not None
    ids = a.tokenizer.encode(LONG_TEXT)[:40]
    _compare(fx_engine.logits(a, ids), fx_engine.logits(b, ids), min_positions=40)
    assert a.config.logits_scaling == 64 / 16


def test_minicpm_refusals():
    with pytest.raises(ConfigError, match="dim_model_base"):
        config_from_hf({k: v for k, v in tiny_config("minicpm").items() if k != "dim_model_base"})
    with pytest.raises(ConfigError, match="longrope"):
        config_from_hf({**tiny_config("minicpm"), "rope_scaling": {
            "rope_type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8,
            "original_max_position_embeddings": 64}})


def test_hunyuan_rope_alpha_and_refusals():
    """Hunyuan's "dynamic" scaling with an alpha is a fixed base, rope_theta * alpha^(d/(d-2))
    (Hugging Face's ntk_alpha), no scaling left; its q/k norms cannot be switched off."""
    base = {k: v for k, v in tiny_config("hunyuan_v1_dense").items() if k != "rope_scaling"}
    cfg = config_from_hf({**base, "rope_theta": 10000.0,
                          "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}})
    assert cfg.rope_scaling is None and abs(cfg.rope_theta - 10000.0 * 1000.0 ** (16 / 14)) < 1e-3 * cfg.rope_theta
    assert cfg.qk_norm and cfg.qk_norm_after_rope
    with pytest.raises(ConfigError, match="use_qk_norm"):
        config_from_hf({**base, "use_qk_norm": False})
    with pytest.raises(ConfigError, match="alpha"):
        config_from_hf({**base, "rope_scaling": {"type": "dynamic", "alpha": -1.0, "factor": 1.0}})


# ------------------------------------------------------------------ Llama-family windows, mistral3


def test_mistral_sliding_window_as_hugging_face_runs_it(tiny_folder):
    """Mistral's sliding_window applies to every layer (Hugging Face); mlx-lm attends over
    everything, so the two agree while the sequence fits in the window and differ after;
    batched rows equal each request alone with the ring caches."""
    path = tiny_folder("mistral", sliding_window=16, max_position_embeddings=2048)
    model = fx_engine.load(path)
    assert [s.window for s in model.cache_layout(headroom=8)] == [16, 16]
    ids = model.tokenizer.encode(LONG_TEXT)[:64]
    ours, ref = fx_engine.logits(model, ids, chunk=8), _mlx_lm(path)(mx.array([ids]))[0]
    assert mx.allclose(ours[:16], ref[:16], atol=2e-3).item()
    assert not mx.allclose(ours[16:], ref[16:], atol=1e-2).item()
    prompts = [ids[:n] for n in (5, 40, 23)]
    alone = [reference_generate(model, p, max_tokens=16, temperature=0.0, prefill_chunk=8).token_ids
             for p in prompts]
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=8)
    handles = [engine.submit(p, max_tokens=16, temperature=0.0) for p in prompts]
    assert [h.result().token_ids for h in handles] == alone
    engine.close()
    qwen = config_from_hf({**tiny_config("qwen2"), "use_sliding_window": True, "sliding_window": 32,
                           "max_window_layers": 1})
    assert qwen.layer_types == ("full_attention", "sliding_attention") and qwen.sliding_window == 32


def test_mistral3_checkpoint_runs_its_text_model(tmp_path, tiny_folder):
    """A multimodal mistral3 checkpoint (text_config of type ministral3, weights under
    language_model.model.) gives the logits of the same text model stored alone."""
    import json

    text = tiny_folder("ministral3")
    wrapped = tmp_path / "w"
    wrapped.mkdir()
    cfg = json.loads((text / "config.json").read_text())
    (wrapped / "config.json").write_text(json.dumps({
        "model_type": "mistral3", "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": cfg, "vision_config": {"model_type": "pixtral"}}))
    w = {("language_model." + k if k.startswith("model.") else "language_model." + k): v
         for k, v in mx.load(str(text / "model.safetensors")).items()}
    w["vision_tower.patch_conv.weight"] = mx.zeros((4, 3, 2, 2))
    mx.save_safetensors(str(wrapped / "model.safetensors"), w)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (wrapped / name).write_bytes((text / name).read_bytes())
    a, b = fx_engine.load(wrapped), fx_engine.load(text)
    assert a.config.model_type == "ministral3"
    ids = b.tokenizer.encode(LONG_TEXT)[:40]
    assert mx.array_equal(fx_engine.logits(a, ids), fx_engine.logits(b, ids)).item()


# ------------------------------------------------------------------ starcoder2, cohere, cohere2

GPT_STYLE = [
    ("starcoder2", {}),
    ("starcoder2", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
    ("cohere", {}),
    ("cohere", {"use_qk_norm": True, "num_key_value_heads": 4}),
    ("cohere", {"layer_norm_bias": True, "attention_bias": True}),
    ("cohere2", {}),  # 3 sliding layers with RoPE, then a NoPE global one
    ("cohere2", {"sliding_window_pattern": 2, "logit_scale": 1.0}),
]


@pytest.mark.parametrize("model_type,overrides", GPT_STYLE, ids=lambda x: str(x)[:60])
def test_layernorm_families_match_mlx_lm(model_type, overrides, tiny_folder):
    """LayerNorm families: StarCoder 2 (GPT-style MLP, biases), Command R (parallel blocks,
    per-head q/k LayerNorms), Command R7B (sliding layers, NoPE global ones)."""
    path = tiny_folder(model_type, **overrides)
    _matches_mlx_lm(path)


def test_starcoder2_gelu_follows_hidden_act_and_refusals(tiny_folder):
    """hidden_act gelu_pytorch_tanh (the released configs) runs the tanh GELU, as Hugging
    Face does: close to, not equal to, the exact one mlx-lm always uses."""
    exact = tiny_folder("starcoder2")
    approx = tiny_folder("starcoder2", hidden_act="gelu_pytorch_tanh")
    ids = list(range(3, 40))
    a, b = fx_engine.logits(fx_engine.load(exact), ids), fx_engine.logits(fx_engine.load(approx), ids)
    assert 0 < mx.abs(a - b).max().item() < 0.05
    cases = [("starcoder2", {"hidden_act": "relu"}, "hidden_act"),
             ("starcoder2", {"use_bias": False}, "use_bias"),
             ("cohere", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
             ("cohere2", {"layer_types": ["full_attention"]}, "layer_types")]
    for mt, overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**tiny_config(mt), **overrides}, "config.json")
