"""Nemotron-H GGUF files (llama.cpp's nemotron_h, and nemotron_h_moe for the routed models),
as its converter writes them (`fx_engine.testing.gguf.write_nemotron_h_gguf`, after
convert_hf_to_gguf.py's NemotronHModel; tensor names from gguf-py's own TensorNameMap):
fx-engine's logits from the file equal its logits from the Hugging Face folder the file was
written from (that path is checked against mlx-lm in test_family_configs), Q8_0 matrices
and expert stacks included; and, where llama-cpp-python is installed, llama.cpp's own
logits from the same file (the layer pattern from the per-layer arrays, the mixers, the
permuted q/k rows, the routed ReLU^2 experts with their correction bias)."""


import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, q8_0_round_trip

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_nemotron_h_gguf  # noqa: E402

IDS = list(range(5, 69))
DENSE = {"hybrid_override_pattern": "M-M*-"}  # Nemotron-H 8B / Nano 9B v2's kinds of layer
ROUTED = {"hybrid_override_pattern": "MEM*E"}  # Nemotron 3 Nano's: routed experts with a shared one


def _logits(model, ids=IDS):
    return np.asarray(fx_engine.logits(model, ids, chunk=16))


@pytest.mark.parametrize("overrides,arch", [
    (ROUTED, "nemotron_h_moe"),
    (DENSE, "nemotron_h"),
    ({**DENSE, "mamba_proj_bias": True, "use_conv_bias": False}, "nemotron_h"),
])
def test_gguf_logits_equal_the_folders(tmp_path, overrides, arch):
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "nemotron_h", seed=3, **overrides)
    path = write_nemotron_h_gguf(folder, tmp_path / "m.gguf")
    assert read_gguf_metadata(path)["general.architecture"] == arch
    model, ref = fx_engine.load(path), fx_engine.load(folder)
    routed = ("num_experts", "top_k", "shared_intermediate_size", "n_group", "routed_scaling_factor")
    for field in ("pattern", "attention_bias", "mamba_bias", "conv_bias", "num_kv_heads", "head_dim",
                  *(routed if arch == "nemotron_h_moe" else ("intermediate_size",))):
        assert getattr(model.config, field) == getattr(ref.config, field), field
    mix, want = model.config.mixer, ref.config.mixer
    assert (mix.heads, mix.head_dim, mix.groups, mix.state, mix.kernel, mix.norm_groups) == (
        want.heads, want.head_dim, want.groups, want.state, want.kernel, want.norm_groups)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


def test_q8_0_matrices(tmp_path):
    """Every projection and expert stack Q8_0: the logits of the folder holding the same
    values, dequantized."""
    folder = write_tiny_model(tmp_path / "m", "nemotron_h", seed=5, **ROUTED)
    chosen = lambda name, x: ".layers." in name and "norm" not in name and "conv1d" not in name  # noqa: E731
    model = fx_engine.load(write_nemotron_h_gguf(folder, tmp_path / "m.gguf", q8=chosen))
    q8_0_round_trip(folder, chosen)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


def test_refusals(tmp_path):
    from fx_engine.core.models import nemotron_h
    from fx_engine.loading.gguf import read_gguf_metadata

    md = read_gguf_metadata(write_nemotron_h_gguf(write_tiny_model(tmp_path / "m", "nemotron_h", seed=3, **ROUTED),
                                                  tmp_path / "m.gguf"))
    a = "nemotron_h_moe"
    for change, match in (({f"{a}.attention.head_count_kv": mx.array([0, 0, 0])}, "3 entries for 5 layers"),
                          ({f"{a}.attention.head_count_kv": mx.array([0, 0, 2, 4, 0])}, "one KV head count"),
                          ({f"{a}.ssm.time_step_rank": mx.array(7)}, "time_step_rank"),
                          ({f"{a}.moe_latent_size": mx.array(16)}, "moe_latent_size")):
        with pytest.raises(ConfigError, match=match):
            nemotron_h.config_from_gguf({**md, **change}, "x.gguf")
    with pytest.raises(ConfigError, match="feed_forward_length' is missing"):
        nemotron_h.config_from_gguf({k: v for k, v in md.items() if k != f"{a}.feed_forward_length"}, "x.gguf")


@pytest.mark.parametrize("overrides", [ROUTED, DENSE])
def test_llama_cpp_logits(tmp_path, overrides):
    """llama.cpp reads the same file to the same logits."""
    folder = write_tiny_model(tmp_path / "m", "nemotron_h", seed=3, **overrides)
    assert_llama_cpp_logits(write_nemotron_h_gguf(folder, tmp_path / "m.gguf"), tmp_path)
