"""LFM2-MoE (`lfm2_moe`) beyond the family checks (test_parity's mlx-lm comparison, which
covers mlx-lm's own 4-bit conversion, and test_gguf_lfm2's llama.cpp comparison): the
checkpoint layouts transformers 5 writes, what the config says, and refusals."""

import json

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf
from fx_engine.testing import write_tiny_model
from fx_engine.testing.tiny import tiny_config

IDS = list(range(5, 61))


def _logits(path):
    return np.asarray(fx_engine.logits(fx_engine.load(path), IDS, chunk=16))


def test_fused_expert_tensors_as_transformers_5_saves_them(tmp_path):
    """transformers 5 keeps each routed layer's experts as gate_up_proj [E, 2I, H] (gate rows
    first) and down_proj [E, H, I]: the same model as one tensor per expert."""
    folder = write_tiny_model(tmp_path / "m", "lfm2_moe", seed=4)
    w = dict(mx.load(str(folder / "model.safetensors")))
    cfg = json.loads((folder / "config.json").read_text())
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fused / name).write_text((folder / name).read_text())
    for i in range(cfg["num_dense_layers"], cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.feed_forward.experts."
        take = lambda n: [w.pop(f"{pre}{e}.{n}.weight") for e in range(cfg["num_experts"])]  # noqa: E731
        gate, up, down = take("w1"), take("w3"), take("w2")
        w[pre + "gate_up_proj"] = mx.concatenate([mx.stack(gate), mx.stack(up)], axis=1)
        w[pre + "down_proj"] = mx.stack(down)
    mx.save_safetensors(str(fused / "model.safetensors"), w)
    np.testing.assert_array_equal(_logits(fused), _logits(folder))


def test_the_selection_bias_is_read(tmp_path):
    """use_expert_bias: the bias changes which experts run (the tiny bias is large enough to);
    without it the tensor is not read (Hugging Face's block has no such buffer)."""
    folder = write_tiny_model(tmp_path / "m", "lfm2_moe", seed=4)
    w = dict(mx.load(str(folder / "model.safetensors")))
    for name in [n for n in w if n.endswith("expert_bias")]:
        w[name] = mx.zeros_like(w[name])
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    zero = _logits(folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "use_expert_bias": False}))
    np.testing.assert_array_equal(_logits(folder), zero)
    other = write_tiny_model(tmp_path / "b", "lfm2_moe", seed=4)
    assert np.abs(_logits(other) - zero).max() > 1e-3


def test_config_reads_as_hugging_face():
    """The dense layers are intermediate_size wide as written (no 2/3 adjustment: that is
    dense LFM2's block_ff_dim), the first num_dense_layers are dense, routing fields mapped."""
    cfg = config_from_hf(tiny_config("lfm2_moe", num_dense_layers=2, intermediate_size=100))
    assert cfg.intermediate_size == 100 and cfg.moe_layers == (False, False, True, True)
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size, cfg.norm_topk_prob, cfg.expert_bias) == (
        8, 2, 32, True, True)
    assert cfg.grouped_sigmoid and (cfg.n_group, cfg.topk_group, cfg.topk_norm_eps) == (1, 1, 1e-6)
    assert cfg.conv_layers == (True, False, True, False)
    assert config_from_hf(tiny_config("lfm2_moe", head_dim=32)).head_dim == 32  # (Hugging Face reads it)


@pytest.mark.parametrize("overrides,match", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"num_dense_layers": 5}, "num_dense_layers"),
    ({"layer_types": ["conv", "sliding_attention", "conv", "conv"]}, "layer_types"),
])
def test_refusals(overrides, match):
    with pytest.raises(ConfigError, match=match):
        config_from_hf(tiny_config("lfm2_moe", **overrides))
