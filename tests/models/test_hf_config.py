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
    "glm4_moe": {"head_dim": 128},  # 4096 / 96 heads leaves 21 rotated pairs at the 0.5 rotary fraction
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
