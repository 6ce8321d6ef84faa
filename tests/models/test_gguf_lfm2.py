"""LFM2 and LFM2-MoE GGUF files (llama.cpp's lfm2 and lfm2moe), as its converter writes them
(`fx_engine.testing.gguf.write_lfm2_gguf`, after convert_hf_to_gguf.py's LFM2Model and
LFM2MoeModel; tensor names from gguf-py's own TensorNameMap): fx-engine's logits from the
file equal its logits from the Hugging Face folder the file was written from (that path is
checked against mlx-lm in test_parity's test_family_against_mlx_lm), Q8_0 matrices
included; and, where llama-cpp-python is installed, llama.cpp's own logits from the same
file (the independent check of the layout llama.cpp reads: per-layer KV heads, the squeezed
conv weight, the final norm's name, the expert stacks and the routing's selection bias)."""


import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, q8_0_round_trip

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_lfm2_gguf  # noqa: E402

IDS = list(range(5, 69))


def _logits(model, ids=IDS):
    return np.asarray(fx_engine.logits(model, ids, chunk=16))


@pytest.mark.parametrize("overrides", [
    {},  # conv, attention, conv, conv
    {"layer_types": ["full_attention", "conv", "conv", "full_attention"], "conv_L_cache": 4, "num_key_value_heads": 4},
    {"conv_bias": True},
])
def test_gguf_logits_equal_the_folders(tmp_path, overrides):
    folder = write_tiny_model(tmp_path / "m", "lfm2", seed=3, **overrides)
    model = fx_engine.load(write_lfm2_gguf(folder, tmp_path / "m.gguf"))
    ref = fx_engine.load(folder)
    cfg = model.config
    assert cfg.model_type == "lfm2" and cfg.conv_layers == ref.config.conv_layers
    assert (cfg.conv_kernel, cfg.num_kv_heads, cfg.intermediate_size) == (
        ref.config.conv_kernel, ref.config.num_kv_heads, ref.config.intermediate_size)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


@pytest.mark.parametrize("model_type", ["lfm2", "lfm2_moe"])
def test_q8_0_matrices(tmp_path, model_type):
    """Every projection Q8_0 (LFM2-MoE's expert stacks and router too): the logits of the
    folder holding the same values, dequantized (each expert's rows round-trip alike
    stacked or alone)."""
    folder = write_tiny_model(tmp_path / "m", model_type, seed=5)
    chosen = lambda name, x: ".layers." in name and "norm" not in name and "conv.conv" not in name \
        and x.ndim >= 2  # noqa: E731
    model = fx_engine.load(write_lfm2_gguf(folder, tmp_path / "m.gguf", q8=chosen))
    q8_0_round_trip(folder, chosen)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


def test_refusals(tmp_path):
    from fx_engine.core.models import lfm2
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "lfm2", seed=3)
    md = read_gguf_metadata(write_lfm2_gguf(folder, tmp_path / "m.gguf"))
    kv = "lfm2.attention.head_count_kv"
    for value, match in ((None, "must list each layer"), (mx.array([0, 2, 0]), "3 entries for 4 layers"),
                         (mx.array([0, 2, 0, 1]), "one KV head count"), (mx.array([0, 0, 0, 0]), "one KV head count"), (mx.array(2), "1 entries for 4 layers")):
        bad = {k: v for k, v in md.items() if k != kv} if value is None else {**md, kv: value}
        with pytest.raises(ConfigError, match=match):
            lfm2.config_from_gguf(bad, "x.gguf")
    with pytest.raises(ConfigError, match="shortconv.l_cache"):
        lfm2.config_from_gguf({k: v for k, v in md.items() if k != "lfm2.shortconv.l_cache"}, "x.gguf")


@pytest.mark.parametrize("overrides", [{}, {"layer_types": ["full_attention", "conv", "conv", "full_attention"]}])
def test_llama_cpp_logits(tmp_path, overrides):
    """llama.cpp reads the same file to the same logits (its NEOX RoPE on unpermuted q/k, the
    short convolution's state, the norm after the last layer)."""
    folder = write_tiny_model(tmp_path / "m", "lfm2", seed=3, **overrides)
    assert_llama_cpp_logits(write_lfm2_gguf(folder, tmp_path / "m.gguf"), tmp_path)


MOE_CASES = [
    {},  # a dense layer, then routed conv and attention layers, the selection bias
    {"num_dense_layers": 0, "num_experts_per_tok": 3, "layer_types": ["full_attention", "conv", "conv", "conv"]},
]


@pytest.mark.parametrize("overrides", MOE_CASES)
def test_lfm2_moe_gguf_logits_equal_the_folders(tmp_path, overrides):
    folder = write_tiny_model(tmp_path / "m", "lfm2_moe", seed=3, **overrides)
    model = fx_engine.load(write_lfm2_gguf(folder, tmp_path / "m.gguf"))
    ref = fx_engine.load(folder)
    for field in ("model_type", "conv_layers", "moe_layers", "num_experts", "top_k", "moe_intermediate_size",
                  "intermediate_size", "norm_topk_prob", "expert_bias", "topk_norm_eps"):
        assert getattr(model.config, field) == getattr(ref.config, field), field
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


def test_lfm2_moe_refusals(tmp_path):
    from fx_engine.core.models import lfm2
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "lfm2_moe", seed=3)
    md = read_gguf_metadata(write_lfm2_gguf(folder, tmp_path / "m.gguf"))
    with pytest.raises(ConfigError, match="expert_gating_func"):
        lfm2.config_from_gguf({**md, "lfm2moe.expert_gating_func": 1}, "x.gguf")
    for key in ("expert_count", "expert_used_count", "expert_feed_forward_length"):
        with pytest.raises(ConfigError, match=key):
            lfm2.config_from_gguf({k: v for k, v in md.items() if k != f"lfm2moe.{key}"}, "x.gguf")


@pytest.mark.parametrize("overrides", MOE_CASES)
def test_lfm2_moe_llama_cpp_logits(tmp_path, overrides):
    """llama.cpp's lfm2moe graph on the same file: sigmoid routing, the bias choosing the
    experts only, the top-k renormalized, the leading dense layers."""
    folder = write_tiny_model(tmp_path / "m", "lfm2_moe", seed=3, **overrides)
    assert_llama_cpp_logits(write_lfm2_gguf(folder, tmp_path / "m.gguf"), tmp_path)
