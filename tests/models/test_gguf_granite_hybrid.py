"""Granite 4.0 hybrid GGUF files (llama.cpp's granitehybrid), as its converter writes them
(`fx_engine.testing.gguf.write_granite_hybrid_gguf`, after convert_hf_to_gguf.py's
GraniteHybridModel and Mamba2Model; tensor names from gguf-py's own TensorNameMap):
fx-engine's logits from the file equal its logits from the Hugging Face folder the file was
written from (that path is checked against mlx-lm in test_family_configs), Q8_0 matrices
and expert stacks included; and, where llama-cpp-python is installed, llama.cpp's own
logits from the same file (the independent check of the layout: per-layer KV heads, the
permuted q/k rows, the mixers' decay / D / grouped norm shapes, the split expert and shared
inputs, Granite's multipliers)."""


import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, q8_0_round_trip

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_granite_hybrid_gguf  # noqa: E402

IDS = list(range(5, 69))
NOPE = {"position_embedding_type": "nope"}  # Granite 4.0's hybrids


def _logits(model, ids=IDS):
    return np.asarray(fx_engine.logits(model, ids, chunk=16))


@pytest.mark.parametrize("overrides", [
    NOPE,  # routed experts with a shared MLP
    {},  # RoPE (Bamba-style), the q/k rows un-permuted
    {**NOPE, "num_local_experts": 0, "tie_word_embeddings": False},  # one dense MLP, its own head
    {**NOPE, "mamba_proj_bias": True, "mamba_conv_bias": False},
])
def test_gguf_logits_equal_the_folders(tmp_path, overrides):
    folder = write_tiny_model(tmp_path / "m", "granitemoehybrid", seed=3, **overrides)
    model = fx_engine.load(write_granite_hybrid_gguf(folder, tmp_path / "m.gguf"))
    ref = fx_engine.load(folder)
    cfg, want = model.config, ref.config
    for field in ("mamba_layers", "use_moe", "use_rope", "mamba_bias", "conv_bias", "tie_word_embeddings",
                  "num_kv_heads", "embedding_multiplier", "attention_multiplier", "residual_multiplier",
                  "logits_scaling", "shared_expert_intermediate_size"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert (cfg.mixer.heads, cfg.mixer.head_dim, cfg.mixer.groups, cfg.mixer.state) == (
        want.mixer.heads, want.mixer.head_dim, want.mixer.groups, want.mixer.state)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


def test_q8_0_matrices(tmp_path):
    """Every projection and expert stack Q8_0 (the permuted q/k rows move with their
    scales): the logits of the folder holding the same values, dequantized."""
    folder = write_tiny_model(tmp_path / "m", "granitemoehybrid", seed=5, **NOPE)
    chosen = lambda name, x: ".layers." in name and "norm" not in name and x.shape[-1] % 32 == 0  # noqa: E731
    model = fx_engine.load(write_granite_hybrid_gguf(folder, tmp_path / "m.gguf", q8=chosen))
    q8_0_round_trip(folder, chosen)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


def test_refusals(tmp_path):
    from fx_engine.core.models import granitemoehybrid as gmh
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "granitemoehybrid", seed=3, **NOPE)
    md = read_gguf_metadata(write_granite_hybrid_gguf(folder, tmp_path / "m.gguf"))
    kv = "granitehybrid.attention.head_count_kv"
    for value, match in ((mx.array([0, 2, 0]), "4 entries"), (mx.array([0, 2, 0, 1]), "one KV head count")):
        with pytest.raises(ConfigError, match=match):
            gmh.config_from_gguf({**md, kv: value}, "x.gguf")
    with pytest.raises(ConfigError, match="ssm.time_step_rank"):
        gmh.config_from_gguf({**md, "granitehybrid.ssm.time_step_rank": mx.array(7)}, "x.gguf")
    with pytest.raises(ConfigError, match="logit_scale"):
        gmh.config_from_gguf({k: v for k, v in md.items() if k != "granitehybrid.logit_scale"}, "x.gguf")


@pytest.mark.parametrize("overrides", [NOPE, {}, {**NOPE, "num_local_experts": 0}])
def test_llama_cpp_logits(tmp_path, overrides):
    """llama.cpp reads the same file to the same logits. Its graph asks for mixers twice as
    wide as the model, as Granite 4.0's and Bamba's are (16 heads of 8 over a width of 64);
    two B/C groups, whose gated norm llama.cpp, Hugging Face and fx-engine run per group
    (mlx-lm over the whole width)."""
    folder = write_tiny_model(tmp_path / "m", "granitemoehybrid", seed=3, mamba_n_heads=16, mamba_n_groups=2,
                              **overrides)
    assert_llama_cpp_logits(write_granite_hybrid_gguf(folder, tmp_path / "m.gguf"), tmp_path)
