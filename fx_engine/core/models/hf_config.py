"""A Hugging Face config.json as its configuration class reads it, before a family parses it.

A checkpoint's config comes in one of two dialects: as its authors wrote it (the keys of the
transformers version they trained with), or re-saved by transformers 5 (every fine-tune,
merge and quantization made with it), which
- keeps RoPE's settings only under `rope_parameters` ({"rope_type", "rope_theta", the
  scaling's keys, "partial_rotary_factor"}) and writes no `rope_theta` / `rope_scaling`;
- writes a field under the name its class stores it by (Qwen3-MoE's `num_experts` as
  `num_local_experts`: the class's `attribute_map`) and layer kinds by their new names
  ("mamba" as "linear_attention", "attention" as "full_attention");
- encodes an infinity as {"__float__": "Infinity"} (Mamba-2's time_step_limit).
And a config may leave a field out, which the configuration class then fills with its
default: the value the checkpoint runs with. `HF_DEFAULTS` holds, per model type, those
defaults of fields that change the computation where fx-engine's own differed
(transformers 5.25's configuration classes; tests/models/test_hf_config.py checks every
field of every class against them). `normalize` turns either dialect into the old keys
with the defaults filled in, so each family reads one form.
"""

from __future__ import annotations

import math
from typing import Any

#: per model type: fields a configuration class stores (and transformers 5 saves) under
#: another name -> the name the family reads (the classes' `attribute_map`)
ALIASES: dict[str, dict[str, str]] = {
    "qwen3_moe": {"num_local_experts": "num_experts"},
    "mixtral": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"},
    "olmoe": {"num_local_experts": "num_experts"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "glm4_moe": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "nemotron_h": {"num_local_experts": "n_routed_experts"},
    # EXAONE 3's published configs use its remote code's names; Hugging Face's ExaoneConfig
    # maps them (and transformers 5 saves the Llama names)
    "exaone": {"num_layers": "num_hidden_layers", "layer_norm_epsilon": "rms_norm_eps",
               "activation_function": "hidden_act"},
    # InternLM3's remote-code names (InternLM3Config's attribute_map)
    "internlm3": {"qkv_bias": "attention_bias", "bias": "mlp_bias"},
}

#: transformers 5's names of layer kinds -> the names before it (what granitemoehybrid's
#: `layer_types` and the families reading them use)
_LEGACY_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}

# Qwen3-Next's and Qwen3.5's attention: a quarter of each head rotated, 256-wide heads
_QWEN3_NEXT = {"head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10_000.0,
               "max_position_embeddings": 32768}

#: per model type: transformers 5.25's default of each field whose absence fx-engine read
#: otherwise (a config that leaves the field out runs with these in Hugging Face)
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "granite": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "ministral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "ministral3": {"max_position_embeddings": 262144, "num_key_value_heads": 8, "rms_norm_eps": 1e-5},
    "mixtral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                "rope_theta": 1_000_000.0},
    "qwen2": {"max_position_embeddings": 32768, "rope_theta": 10_000.0},
    "qwen2_moe": {"max_position_embeddings": 32768, "rope_theta": 10_000.0},
    "qwen3": {"max_position_embeddings": 32768},
    "qwen3_moe": {"max_position_embeddings": 32768, "num_key_value_heads": 4},
    "smollm3": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "rope_theta": 2_000_000.0},
    "phi3": {"max_position_embeddings": 4096},
    "olmo2": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "olmo3": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0},
    "olmoe": {"rms_norm_eps": 1e-5},
    # (Exaone4Config: a 4096 window on three of every four layers unless the config says)
    "exaone4": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "sliding_window": 4096,
                "sliding_window_pattern": 4},
    "glm4": {"max_position_embeddings": 131072, "num_key_value_heads": 2, "rms_norm_eps": 1.5625e-07,
             "attention_bias": True},
    "gemma": {"max_position_embeddings": 8192, "num_key_value_heads": 16},
    "gemma2": {"max_position_embeddings": 8192, "num_key_value_heads": 4, "query_pre_attn_scalar": 256},
    "gemma3_text": {"num_key_value_heads": 4, "sliding_window": 4096},
    "gemma4_text": {"num_key_value_heads": 4, "final_logit_softcapping": None, "num_kv_shared_layers": 0,
                    "use_double_wide_mlp": False},
    "gpt_oss": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5, "head_dim": 64,
                "rope_theta": 150_000.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "original_max_position_embeddings": 4096, "truncate": False}},
    "lfm2": {"num_key_value_heads": 8},
    "lfm2_moe": {"num_key_value_heads": 8},
    "cohere": {"rope_theta": 500_000.0},
    "ernie4_5": {"head_dim": 128, "max_position_embeddings": 131072, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
                 "rope_theta": 500_000.0},
    "exaone": {"num_key_value_heads": 8, "rms_norm_eps": 1e-5, "rope_theta": 500_000.0},
    "helium": {"rms_norm_eps": 1e-8, "rope_theta": 100_000.0},
    "hunyuan_v1_dense": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    # (InternLM3 runs as Llama, whose head_dim is the config's: the class's 128 when unsaid)
    "internlm3": {"head_dim": 128, "max_position_embeddings": 32768, "num_key_value_heads": 2, "rms_norm_eps": 1e-5},
    "seed_oss": {"attention_bias": True, "head_dim": 128, "max_position_embeddings": 524288, "num_key_value_heads": 8},
    "falcon_h1": {"max_position_embeddings": 8192, "num_key_value_heads": 8, "rope_theta": 10_000.0},
    "granitemoe": {"max_position_embeddings": 2048, "num_local_experts": 8, "num_experts_per_tok": 2},
    "granitemoehybrid": {"max_position_embeddings": 2048, "num_local_experts": 8, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 1024, "time_step_limit": [0.0, math.inf]},
    "glm4_moe": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
                 "first_k_dense_replace": 1, "n_shared_experts": 1},
    "nemotron_h": {"num_key_value_heads": 8, "intermediate_size": 21504, "moe_intermediate_size": 7688,
                   "moe_shared_expert_intermediate_size": 7688, "n_shared_experts": 1, "num_experts_per_tok": 2},
    "starcoder2": {"num_key_value_heads": 2, "rope_theta": 10_000.0},
    "deepseek_v2": {"max_position_embeddings": 2048, "q_lora_rank": 1536, "n_routed_experts": 64, "n_shared_experts": 2},
    "deepseek_v3": {"first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1, "q_lora_rank": 1536,
                    "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4},
    "qwen3_next": {**_QWEN3_NEXT, "num_key_value_heads": 2, "num_experts": 512, "num_experts_per_tok": 10,
                   "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
    "qwen3_5_text": {**_QWEN3_NEXT, "num_key_value_heads": 4},
    "qwen3_5_moe_text": {**_QWEN3_NEXT, "num_key_value_heads": 2, "num_experts": 256, "num_experts_per_tok": 8,
                         "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512},
}

_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}
# keys of a flat rope_parameters that are not the scaling's
_NOT_SCALING = ("rope_theta", "partial_rotary_factor")


def decode_floats(obj: Any) -> Any:
    """`obj` with transformers 5's {"__float__": "Infinity" | "-Infinity" | "NaN"} objects
    read as the floats they stand for (JSON has no infinity)."""
    if isinstance(obj, dict):
        if len(obj) == 1 and obj.get("__float__") in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_floats(v) for v in obj]
    return obj


def rope_from_parameters(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with its RoPE settings in the keys before transformers 5 (rope_theta,
    partial_rotary_factor, rope_scaling: None for rope_type "default"), taken as Hugging
    Face's classes take them: a rope_scaling given wins over rope_parameters, whose values
    win over the top-level keys. A rope_parameters nested per layer kind (Gemma 3 / 4,
    OLMo 3) is left to its family. A scaling named by "type" only also gets "rope_type"."""
    rp = d.get("rope_parameters")
    out = dict(d)
    if isinstance(rp, dict) and {"rope_type", "type", "rope_theta"} & set(rp):
        given = d.get("rope_scaling") or rp
        for key in _NOT_SCALING:
            if key in given:
                out[key] = given[key]
        if not d.get("rope_scaling") and rp.get("rope_type", rp.get("type", "default")) != "default":
            out["rope_scaling"] = {k: v for k, v in rp.items() if k not in _NOT_SCALING}
    scaling = out.get("rope_scaling")
    if isinstance(scaling, dict) and scaling.get("type") and "rope_type" not in scaling:
        out["rope_scaling"] = {**scaling, "rope_type": scaling["type"]}
    return out


def normalize(d: dict[str, Any]) -> dict[str, Any]:
    """A (text) model's config.json dict in the old keys, with Hugging Face's defaults for
    what it leaves out (module docstring)."""
    mt = d.get("model_type")
    d = rope_from_parameters(decode_floats(d))
    for saved, read in ALIASES.get(mt, {}).items():
        if saved in d and read not in d:
            d = {**d, read: d[saved]}
    if mt == "granitemoehybrid" and isinstance(d.get("layer_types"), list):
        d = {**d, "layer_types": [_LEGACY_LAYER_TYPES.get(t, t) for t in d["layer_types"]]}
    d = {**HF_DEFAULTS.get(mt, {}), **d}
    scaling = d.get("rope_scaling")
    if (isinstance(scaling, dict) and scaling.get("rope_type") in ("yarn", "llama3")
            and scaling.get("original_max_position_embeddings") is None and d.get("max_position_embeddings")):
        # the pretraining length these scalings stretch: Hugging Face's standardize_rope_params
        # takes max_position_embeddings when unsaid (mlx-lm: 4096 for YaRN, 8192 for llama3)
        d["rope_scaling"] = {**scaling, "original_max_position_embeddings": d["max_position_embeddings"]}
    return d
