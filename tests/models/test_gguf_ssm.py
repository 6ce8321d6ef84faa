"""Mamba-2 and Falcon-H1 GGUF files (llama.cpp's mamba2 and falcon-h1), as its converter
writes them (`fx_engine.testing.gguf.write_mamba2_gguf` / `write_falcon_h1_gguf`, after
convert_hf_to_gguf.py's Mamba2Model and FalconH1Model; tensor names from gguf-py's own
TensorNameMap): fx-engine's logits from the file equal its logits from the Hugging Face
folder the file was written from (that path is checked against references written from
Hugging Face's model code in test_ssm_reference.py), Q8_0 matrices included; and, where
llama-cpp-python is installed, llama.cpp's own logits from the same file (the independent
check of the layout and of the multipliers' folding: the decay stored as -exp(A_log), D and
the grouped norm's shapes, Falcon-H1's muP multipliers in the tensors, key_multiplier on k)."""

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, q8_0_round_trip

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_falcon_h1_gguf, write_mamba2_gguf  # noqa: E402

IDS = list(range(5, 69))
# Falcon-H1 with its multipliers away from 1 (key_multiplier, attention_in_multiplier too)
MUP = {"key_multiplier": 0.39, "attention_in_multiplier": 1.3, "tie_word_embeddings": False}
FALCON = {
    "grouped-norm": {**MUP, "mamba_n_groups": 2, "mamba_rms_norm": True, "mamba_norm_before_gate": False},
    "no-norm": {**MUP, "mamba_rms_norm": False},
    "biases": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
}
MAMBA2 = {"one-group": {}, "two-groups-tied": {"n_groups": 2, "tie_word_embeddings": True},
          "four-groups": {"n_groups": 4, "layer_norm_epsilon": 1e-3}}


def _logits(model, ids=IDS):
    return np.asarray(fx_engine.logits(model, ids, chunk=16))


@pytest.mark.parametrize("variant", list(MAMBA2))
def test_mamba2_gguf_logits_equal_the_folders(tmp_path, variant):
    folder = write_tiny_model(tmp_path / "m", "mamba2", seed=3, **MAMBA2[variant])
    model = fx_engine.load(write_mamba2_gguf(folder, tmp_path / "m.gguf"))
    ref = fx_engine.load(folder)
    cfg, want = model.config, ref.config
    assert _mixer_shape(cfg.mixer) == _mixer_shape(want.mixer)
    assert (cfg.tie_word_embeddings, cfg.vocab_size) == (want.tie_word_embeddings, want.vocab_size)
    assert cfg.block_norm_eps == pytest.approx(want.block_norm_eps, rel=1e-6)  # (stored as float32)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


@pytest.mark.parametrize("variant", list(FALCON))
def test_falcon_h1_gguf_logits_equal_the_folders(tmp_path, variant):
    """The multipliers folded by the converter (the file's config says 1 for each) give
    the folder's logits, where fx-engine folds them at load."""
    folder = write_tiny_model(tmp_path / "m", "falcon_h1", seed=3, **FALCON[variant])
    model = fx_engine.load(write_falcon_h1_gguf(folder, tmp_path / "m.gguf"))
    ref = fx_engine.load(folder)
    cfg, want = model.config, ref.config
    for field in ("tie_word_embeddings", "qkv_bias", "mlp_bias", "num_kv_heads", "head_dim", "rope_theta",
                  "vocab_size", "mamba_bias", "conv_bias"):
        assert getattr(cfg, field) == getattr(want, field), field
    assert _mixer_shape(cfg.mixer) == _mixer_shape(want.mixer)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=5e-5 * np.abs(_logits(ref)).max())


def _mixer_shape(m):
    """A mixer's sizes and norm (the file has no time-step clamp: llama.cpp runs none)."""
    return m.heads, m.head_dim, m.groups, m.state, m.kernel, m.norm_groups, m.norm_mode


def _q8(name, x):
    return ".layers." in name and x.ndim == 2 and "norm" not in name and x.shape[-1] % 32 == 0


def test_mamba2_q8_0_matrices(tmp_path):
    """Every mixer projection Q8_0: the logits of the folder holding the same values."""
    folder = write_tiny_model(tmp_path / "m", "mamba2", seed=5, n_groups=2)
    model = fx_engine.load(write_mamba2_gguf(folder, tmp_path / "m.gguf", q8=_q8))
    q8_0_round_trip(folder, _q8)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


def test_falcon_h1_q8_0_matrices(tmp_path):
    """Every projection Q8_0 (the file holds the multipliers' products, so the folder cannot
    hold the same values): within Q8_0's rounding of the float file's logits (llama.cpp
    multiplies Q8_0 weights by 8-bit activations: not compared here)."""
    folder = write_tiny_model(tmp_path / "m", "falcon_h1", seed=5, **FALCON["grouped-norm"])
    q8 = write_falcon_h1_gguf(folder, tmp_path / "q8.gguf", q8=_q8)
    model = fx_engine.load(q8)
    assert model.params.layers[0].mamba.in_proj.quant is not None  # (kept as 8-bit)
    a, b = _logits(model), _logits(fx_engine.load(write_falcon_h1_gguf(folder, tmp_path / "f.gguf")))
    np.testing.assert_allclose(a, b, rtol=0, atol=0.02 * np.abs(b).max())


def test_refusals(tmp_path):
    from fx_engine.core.models import falcon_h1, mamba2
    from fx_engine.loading.gguf import read_gguf_metadata

    for kind, writer, module, arch in (("mamba2", write_mamba2_gguf, mamba2, "mamba2"),
                                       ("falcon_h1", write_falcon_h1_gguf, falcon_h1, "falcon-h1")):
        folder = write_tiny_model(tmp_path / kind, kind, seed=3)
        md = read_gguf_metadata(writer(folder, tmp_path / f"{kind}.gguf"))
        with pytest.raises(ConfigError, match="ssm.time_step_rank"):
            module.config_from_gguf({**md, f"{arch}.ssm.time_step_rank": mx.array(7)}, "x.gguf")
        with pytest.raises(ConfigError, match="ssm.state_size"):
            module.config_from_gguf({k: v for k, v in md.items() if k != f"{arch}.ssm.state_size"}, "x.gguf")


@pytest.mark.parametrize("variant", list(MAMBA2))
def test_mamba2_llama_cpp_logits(tmp_path, variant):
    """llama.cpp reads the same file to the same logits (its graph asks for mixers twice as
    wide as the model: 8 heads of 16 over 64); its gated norm runs per group, as fx-engine's."""
    folder = write_tiny_model(tmp_path / "m", "mamba2", seed=3, **MAMBA2[variant])
    assert_llama_cpp_logits(write_mamba2_gguf(folder, tmp_path / "m.gguf"), tmp_path)


LLAMA_CPP_FALCON = {**FALCON, "tied": {**MUP, "tie_word_embeddings": True},
                    # (llama.cpp's falcon-h1 graph drops o_proj's bias: the MLP's biases only)
                    "biases": {**MUP, "mlp_bias": True}}


@pytest.mark.parametrize("variant", list(LLAMA_CPP_FALCON))
def test_falcon_h1_llama_cpp_logits(tmp_path, variant):
    """llama.cpp reads the same file to the same logits; also a tied head, where the file
    has no output tensor and both run the embedding as stored (times embedding_multiplier)."""
    folder = write_tiny_model(tmp_path / "m", "falcon_h1", seed=3, **LLAMA_CPP_FALCON[variant])
    assert_llama_cpp_logits(write_falcon_h1_gguf(folder, tmp_path / "m.gguf"), tmp_path)
