"""config.json read as Hugging Face's configuration classes read it (transformers >= 5 as the
oracle, torch-free): every field a config may leave out gets the class's default, and a
config re-saved by transformers 5 (RoPE under rope_parameters, renamed fields and layer
kinds, encoded infinities) reads as the original does. Every model type that both
fx-engine and transformers know is checked, field by field."""

from __future__ import annotations

import copy
import json
import math

import attrs
import pytest

from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf
from fx_engine.core.models.hf_config import ALIASES, decode_floats, normalize
from fx_engine.core.models.registry import _BY_MODEL_TYPE
from fx_engine.testing.tiny import tiny_config

transformers = pytest.importorskip("transformers", minversion="5")
pytestmark = pytest.mark.oracle

CLASSES = transformers.CONFIG_MAPPING
TYPES = sorted(mt for mt in _BY_MODEL_TYPE if mt in CLASSES)

#: fields whose absence fx-engine reads its own way, on purpose
WAIVED = {
    # the stop and start tokens: the classes' defaults are other checkpoints' ids; fx-engine
    # takes them from generation_config.json and the tokenizer
    "bos_token_id", "eos_token_id",
    # unsaid: tied exactly when the checkpoint has no lm_head (a class default of False would
    # leave Hugging Face a random head)
    "tie_word_embeddings",
}

#: a default config fx-engine cannot run as it stands (not a real checkpoint), made one
DEFAULT_FIXES = {
    "glm4_moe": {"head_dim": 128},
    "deepseek_v2": {"num_experts_per_tok": 6},  # (DeepseekV2Config's None routes to no expert: V2-Lite's 6)  # 4096 / 96 heads leaves 21 rotated pairs at the 0.5 rotary fraction
    # (Lfm2MoeConfig has no default layer kinds, without which its own model cannot run: LFM2-8B-A1B's spacing)
    "lfm2_moe": {"layer_types": ["full_attention" if i % 4 == 2 else "conv" for i in range(32)]},
}


def _fx(d: dict) -> dict:
    return attrs.asdict(config_from_hf(d), recurse=False)


def _hf_default(mt: str) -> dict:
    """The class's default config.json as transformers 5 writes it (every field)."""
    d = json.loads(CLASSES[mt]().to_json_string(use_diff=False))
    return {**d, **DEFAULT_FIXES.get(mt, {}), "model_type": mt}


def _resaved(d: dict) -> dict:
    """`d` loaded by its configuration class and saved again (transformers 5's dialect)."""
    cfg = CLASSES[d["model_type"]](**copy.deepcopy({k: v for k, v in d.items() if k != "model_type"}))
    return json.loads(cfg.to_json_string(use_diff=False))


@pytest.mark.parametrize("mt", TYPES)
def test_each_field_left_out_reads_as_the_class_default(mt):
    """For each field of the class's default config: the config without it reads the same
    (fx-engine's default is Hugging Face's) or is refused naming it (a size fx-engine
    requires: a clear error, never a guess)."""
    full = _hf_default(mt)
    want = _fx(full)
    wrong = {}
    for key in sorted(set(full) - WAIVED - {"model_type"}):
        try:
            got = _fx({k: v for k, v in full.items() if k != key})
        except ConfigError as e:
            named = (key, ALIASES.get(mt, {}).get(key, key))
            assert any(n in str(e) for n in named), (key, str(e))
            continue
        diff = {f: (want[f], got[f]) for f in want if want[f] != got[f]}
        if diff:
            wrong[key] = diff
    assert not wrong, f"{mt}: fields whose default differs (Hugging Face's, fx-engine's): {wrong}"


def _rope_variants(mt: str) -> list[dict]:
    """RoPE settings each model type takes: a non-default base, and YaRN where it scales."""
    # (transformers 5.25 loads an old OLMo 3 config's rope_theta into the global layers only,
    # the sliding ones taking the class default 5e5: a re-save changes such a model; the
    # published ones use 5e5)
    theta = 500_000.0 if mt == "olmo3" else 123456.0
    out = [{"rope_theta": theta} if mt == "olmo3" else {}]  # (the tiny config's own)
    for rope in ({"rope_theta": theta}, {"rope_theta": theta, "rope_scaling": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
                 # (no original length: Hugging Face's is max_position_embeddings)
                 {"rope_theta": theta, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}):
        try:
            config_from_hf({**tiny_config(mt), **copy.deepcopy(rope)})
            _resaved({**tiny_config(mt), **copy.deepcopy(rope), **TINY_FIXES.get(mt, {})})
            out.append(rope)
        except (ConfigError, AttributeError):  # a family that runs no such RoPE refuses it, clearly
            pass  # (Hugging Face's Mamba2Config has no max_position_embeddings for YaRN)
    return out


#: tiny configs whose example sizes the configuration class's own checks refuse, adjusted
TINY_FIXES = {
    "granitemoehybrid": {"mamba_expand": 1},  # (its mamba_n_heads x mamba_d_head = hidden_size)
    "exaone4": {"sliding_window_pattern": 4},
    # (Gemma4TextConfig reads no sliding_window_pattern: the tiny config's pattern of 3 as a list)
    "gemma4_text": {"layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2},
}


@pytest.mark.parametrize("mt", TYPES)
def test_resaved_by_transformers_5_reads_the_same(mt):
    """A config loaded and saved by transformers 5 (RoPE only under rope_parameters, the
    class's names for renamed fields and layer kinds, infinities as objects) gives the same
    fx-engine config as the original."""
    for rope in _rope_variants(mt):
        original = {**tiny_config(mt), **TINY_FIXES.get(mt, {})}
        rp = original.get("rope_parameters")
        if not rope:
            pass
        elif isinstance(rp, dict) and "rope_theta" in rp:  # a transformers-5 era model: its settings there
            scaling = rope.get("rope_scaling") or {}
            original["rope_parameters"] = {**rp, "rope_theta": rope["rope_theta"], **scaling}
        else:
            original.update(copy.deepcopy(rope))
        want = _fx(original)
        saved = _resaved(original)
        got = _fx(saved)
        diff = {f: (want[f], got[f]) for f in want if want[f] != got[f]}
        assert not diff, f"{mt} {rope}: re-saved config reads differently (original, re-saved): {diff}"


def test_encoded_infinity_and_layer_kind_names():
    assert decode_floats({"a": [0.0, {"__float__": "Infinity"}], "b": {"__float__": "-Infinity"}}) == {
        "a": [0.0, math.inf], "b": -math.inf}
    assert math.isnan(decode_floats({"__float__": "NaN"}))
    d = normalize({"model_type": "granitemoehybrid", "layer_types": ["linear_attention", "full_attention"]})
    assert d["layer_types"] == ["mamba", "attention"]


def test_rope_parameters_lifted_to_the_old_keys():
    d = normalize({"model_type": "starcoder2", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5e5, "factor": 2.0, "partial_rotary_factor": 0.5}})
    assert d["rope_theta"] == 5e5 and d["partial_rotary_factor"] == 0.5
    assert d["rope_scaling"] == {"rope_type": "yarn", "factor": 2.0}
    # Hugging Face's priority: rope_parameters over the top level, a rope_scaling given over
    # both; "default" is no scaling; nested per layer kind is the family's to read
    d = normalize({"model_type": "llama", "rope_theta": 1.0, "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 2.0}})
    assert d["rope_theta"] == 2.0 and "rope_scaling" not in d
    d = normalize({"model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0, "rope_theta": 3.0},
                   "rope_parameters": {"rope_type": "default", "rope_theta": 2.0}})
    assert d["rope_theta"] == 3.0 and d["rope_scaling"]["rope_type"] == "linear"
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 3.0}}
    assert "rope_theta" not in normalize({"model_type": "llama", "rope_parameters": nested})


#: fields no model class reads at inference (training, initialization, bookkeeping, kernels)
NOT_INFERENCE = {
    "initializer_range", "use_cache", "attention_dropout", "hidden_dropout", "embedding_dropout",
    "residual_dropout", "mlp_dropout", "embd_pdrop", "resid_pdrop", "output_router_logits",
    "router_aux_loss_coef", "router_jitter_noise", "router_z_loss_coef", "aux_loss_coef",
    "pretraining_tp", "rescale_prenorm_residual", "time_step_floor", "time_step_max", "time_step_min",
    "time_step_rank", "use_mamba_kernels", "mamba_chunk_size", "chunk_size", "moe_shared_expert_overlap",
    "chunk_size_feed_forward", "num_logits_to_keep", "pad_token_id", "return_dict",
    "output_hidden_states", "output_attentions", "tie_encoder_decoder", "is_encoder_decoder",
    "is_decoder", "add_cross_attention", "tf_legacy_loss", "use_bfloat16",
    "classifier_dropout",  # (GPT-NeoX's sequence / token classification heads')
    "eod_token_id",  # (HunYuan's end-of-document token: its tokenizer's and generation's)
}
#: fields a model type's class reads that leave fx-engine's config as it is, each for a reason
READ_ELSEWHERE = {
    # MLA: head sizes come from the nope / rope / v dims (head_dim is the rotary width Hugging
    # Face derives, qk_head_dim their sum, KV heads the query heads'); the MTP layers are the
    # drafter's (core/drafters/mtp.py)
    "deepseek_v3": {"head_dim", "num_key_value_heads", "qk_head_dim", "num_nextn_predict_layers"},
    "deepseek_v2": {"head_dim", "num_key_value_heads", "qk_head_dim"},
    "glm4_moe": {"num_nextn_predict_layers"},
    # the pattern builds layer_types, which the default config lists
    "exaone4": {"sliding_window_pattern"},
    # the mixer's widths are given (mamba_d_ssm, num_heads x head_dim); the gated norm's order
    # only matters with mamba_rms_norm, off by default; biases are read from the weights
    "falcon_h1": {"mamba_expand", "mamba_norm_before_gate"},
    "granitemoehybrid": {"mamba_expand", "num_hidden_layers"},  # (layer_types lists the layers)
    "mamba2": {"expand", "use_bias", "use_conv_bias", "residual_in_fp32"},
    # Hugging Face's NemotronH reads neither mamba_proj_bias (its mixer's biases are use_bias)
    # nor n_shared_experts (the shared expert's width is moe_shared_expert_intermediate_size);
    # residual_in_fp32 is a numerics choice (fx-engine's activations are float32 by default)
    "nemotron_h": {"expand", "mamba_proj_bias", "n_shared_experts", "residual_in_fp32",
                   "num_nextn_predict_layers"},
    "phi3": {"original_max_position_embeddings"},  # (read with longrope scaling alone)
    # the default config has no window, so use_sliding_window / max_window_layers switch
    # nothing (tests/models/test_layer_kinds.py moves them with a window)
    "qwen2": {"use_sliding_window", "max_window_layers"}, "qwen3": {"use_sliding_window", "max_window_layers"},
    "qwen3_moe": {"use_sliding_window"}, "smollm3": {"use_sliding_window", "no_rope_layer_interval"},
    "qwen2_moe": {"use_sliding_window", "sliding_window", "max_window_layers"},
}


def _moved(v):
    """Another value of the same kind (None: a kind this test does not move)."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v * 2 + 1
    if isinstance(v, float):
        return v * 1.5 + 0.25
    return None


@pytest.mark.parametrize("mt", TYPES)
def test_each_field_the_class_reads_changes_the_config_or_is_refused(mt):
    """Nothing accepted and then ignored: for each scalar field of the class's default config,
    another value changes fx-engine's config or is refused (a ConfigError): a field Hugging
    Face's model class reads but fx-engine's model does not would silently run another
    model. Exceptions are listed above with their reasons."""
    full = _hf_default(mt)
    want = _fx(full)
    skip = NOT_INFERENCE | WAIVED | READ_ELSEWHERE.get(mt, set()) | {"model_type"}
    ignored = []
    for key, value in sorted(full.items()):
        moved = _moved(value)
        if key in skip or key.startswith("_") or moved is None:
            continue
        try:
            got = _fx({**full, key: moved})
        except ConfigError:
            continue
        if got == want:
            ignored.append(f"{key}={value!r}")
    assert not ignored, f"{mt}: fields read by Hugging Face's class that change nothing here: {ignored}"


def test_lfm2_mlp_width_rounds_only_with_a_multiplier():
    """Hugging Face's Lfm2MLP: int(2F/3), then scaled and rounded up to block_multiple_of only
    when block_ffn_dim_multiplier is set (mlx-lm rounded either way)."""
    base = {**tiny_config("lfm2"), "block_auto_adjust_ff_dim": True, "block_multiple_of": 96}
    for ff, mult in ((200, None), (200, 1.0), (300, 1.5), (1000, None)):
        d = {**base, "block_ff_dim": ff, "intermediate_size": ff, "block_ffn_dim_multiplier": mult}
        width = int(2 * ff / 3)
        if mult is not None:
            width = 96 * ((int(mult * width) + 95) // 96)
        assert config_from_hf(d).intermediate_size == width, (ff, mult)
