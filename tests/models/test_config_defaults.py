"""Config fields published checkpoints leave out, read as Hugging Face's configuration
classes (transformers 5.25) read them; and configs saved by transformers 5, which keep RoPE's
settings only under rope_parameters."""

from __future__ import annotations

import pytest

from fx_engine.core.models import config_from_hf
from fx_engine.testing.tiny import tiny_config as _tiny


def test_qwen3_5_moe_without_intermediate_size_or_norm_topk_prob():
    """Qwen3.5-MoE's published text configs have neither field (all layers routed; Hugging
    Face's router always renormalizes the top-k)."""
    text = _tiny("qwen3_5_moe_text")
    for key in ("intermediate_size", "norm_topk_prob"):
        text.pop(key, None)
    cfg = config_from_hf(text)
    assert cfg.norm_topk_prob is True
    assert all(cfg.moe_layers)
    cfg = config_from_hf({**text, "norm_topk_prob": False})
    assert cfg.norm_topk_prob is True  # (Hugging Face's Qwen3.5-MoE does not read it)


def test_qwen3_next_defaults_and_rope_parameters():
    d = _tiny("qwen3_next")
    d.pop("norm_topk_prob")
    assert config_from_hf(d).norm_topk_prob is True  # Qwen3NextConfig's default
    # saved by transformers 5: rope_theta and partial_rotary_factor under rope_parameters only
    saved = {k: v for k, v in _tiny("qwen3_next").items() if k not in ("rope_theta", "partial_rotary_factor")}
    saved["rope_parameters"] = {"rope_type": "default", "rope_theta": 123456.0, "partial_rotary_factor": 0.25}
    cfg = config_from_hf(saved)
    assert cfg.rope_theta == pytest.approx(123456.0)
    assert cfg.rope_dims == cfg.head_dim // 4


def test_gemma3_text_rope_parameters_per_layer_kind():
    """Gemma 3 configs saved by transformers 5 keep each layer kind's RoPE under
    rope_parameters (the 4B-27B models' x8 linear scaling of the global layers with them)
    and write no rope_theta / rope_scaling / rope_local_base_freq: the same config as the
    old keys give."""
    old = _tiny("gemma3_text", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                rope_scaling={"rope_type": "linear", "factor": 8.0})
    saved = {k: v for k, v in old.items() if k not in ("rope_theta", "rope_scaling", "rope_local_base_freq")}
    saved["rope_parameters"] = {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
    want = config_from_hf(old)
    assert want.rope_full.scale == 1 / 8
    assert config_from_hf(saved) == want
