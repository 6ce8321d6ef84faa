"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE GGUF files (llama.cpp's qwen3next / qwen35 / qwen35moe),
as its converter writes them (`fx_engine.testing.gguf.write_qwen3_next_gguf`, after
convert_hf_to_gguf.py's Qwen3NextModel / Qwen3_5TextModel / Qwen3_5MoeTextModel; tensor names
from gguf-py's own TensorNameMap): fx-engine's logits from the file equal its logits from the
Hugging Face folder the file was written from (that path is checked against mlx-lm in
test_family_configs / test_mtp_wrappers), Q8_0 matrices included; and, where
llama-cpp-python is installed, llama.cpp's own logits from the same file (the independent
check that the layout, the tiled value heads included, is the one llama.cpp reads). The
MTP module qwen35 files carry (blk.{N}.nextn.*, and llama.cpp's MTP-only files) drafts as
the folder's does."""

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, llama_cpp_logits

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_qwen3_next_gguf  # noqa: E402

IDS = list(range(5, 69))


def _logits(model, ids=IDS):
    return np.asarray(fx_engine.logits(model, ids, chunk=16))


@pytest.mark.parametrize("model_type,overrides,tiled", [
    ("qwen3_next", {}, False),
    ("qwen3_5_text", {}, True),  # 2 key heads, 4 value heads: the value heads tiled in the file
    ("qwen3_5_text", {"linear_num_value_heads": 2}, False),
    ("qwen3_5_text", {"tie_word_embeddings": True}, True),
    ("qwen3_5_moe_text", {}, True),
])
def test_gguf_logits_equal_the_folders(tmp_path, model_type, overrides, tiled):
    folder = write_tiny_model(tmp_path / "m", model_type, seed=3, **overrides)
    path = write_qwen3_next_gguf(folder, tmp_path / "m.gguf")
    model = fx_engine.load(path)
    cfg = model.config
    assert cfg.model_type == model_type and cfg.lin_out_tiled == tiled
    assert cfg.qwen3_5 == (model_type != "qwen3_next")
    assert (model.params.lm_head is None) == bool(overrides.get("tie_word_embeddings"))
    assert cfg.linear_layers == (True, True, True, False) and cfg.rope_dims == 4
    ref = fx_engine.load(folder)
    assert cfg.moe_layers == ref.config.moe_layers
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
def test_q8_0_matrices(tmp_path, model_type):
    """Every projection and expert stack Q8_0 (the rows llama.cpp's converter regroups and
    tiles move with their scales): the logits of the folder holding the same values,
    dequantized."""
    from gguf.quants import dequantize, quantize

    sizes = {"linear_key_head_dim": 32, "linear_value_head_dim": 32}  # (out_proj's columns: whole blocks)
    folder = write_tiny_model(tmp_path / "m", model_type, seed=5, **sizes)
    chosen = lambda name, x: any(part in name for part in (".linear_attn.", ".self_attn.", ".mlp."))  # noqa: E731
    model = fx_engine.load(write_qwen3_next_gguf(folder, tmp_path / "m.gguf", q8=chosen))
    q8 = gguf.GGMLQuantizationType.Q8_0
    weights = dict(mx.load(str(folder / "model.safetensors")))
    for name, w in weights.items():
        x = np.asarray(w.astype(mx.float32))
        if x.ndim in (2, 3) and x.shape[-1] % 32 == 0 and chosen(name, x):  # (expert stacks too)
            weights[name] = mx.array(dequantize(quantize(x, q8), q8).reshape(x.shape))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


def test_refusals(tmp_path):
    from fx_engine.core.models import qwen3_next
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "qwen3_5_text", seed=3)
    md = read_gguf_metadata(write_qwen3_next_gguf(folder, tmp_path / "m.gguf"))
    with pytest.raises(ConfigError, match=r"qwen35.ssm.inner_size \(63\) is not a multiple"):
        qwen3_next.config_from_gguf({**md, "qwen35.ssm.inner_size": 63}, "m.gguf")
    with pytest.raises(ConfigError, match="'qwen35.ssm.group_count' is missing"):
        qwen3_next.config_from_gguf({k: v for k, v in md.items() if k != "qwen35.ssm.group_count"}, "m.gguf")
    cfg = qwen3_next.config_from_gguf({**md, "qwen35.attention.recurrent_layers": [True, False, True, False]}, "m")
    assert cfg.linear_layers == (True, False, True, False)
    model = fx_engine.load(tmp_path / "m.gguf")
    with pytest.raises(ConfigError, match="tiled value-head order"):
        qwen3_next.tensor_split(model.params, 0, 2)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5", "qwen3_5_moe"])
def test_gguf_matches_llama_cpp(tmp_path, kind):
    """The same files (float32) through llama.cpp itself, where llama-cpp-python is installed
    (an optional peer, in its own process): its logits equal fx-engine's up to float32
    summation order. Qwen3.5's files carry their MTP module (llama.cpp reads the nextn
    tensors and runs the trunk alone). llama.cpp takes the value heads as wide as the key
    heads (ssm.state_size). Measured with llama-cpp-python 0.3.36: max |diff| 2e-4 of
    logits up to 2.7."""
    sizes = {"linear_key_head_dim": 16, "linear_value_head_dim": 16}
    if kind == "qwen3_next":
        folder = write_tiny_model(tmp_path / "m", "qwen3_next", seed=3, **sizes)
    else:
        from tests.engine.mtp_targets import write_qwen3_5_wrapper_target

        folder = write_qwen3_5_wrapper_target(tmp_path / "m", kind, seed=3, **sizes)
    assert_llama_cpp_logits(write_qwen3_next_gguf(folder, tmp_path / "m.gguf"), tmp_path)


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe_text"])
def test_llama_cpp_k_quants(tmp_path, model_type):
    """A file llama.cpp's own quantizer made Q4_K_M (Q4_K / Q6_K matrices, Q6_K head; the
    rows fx-engine regroups and un-tiles in its compact K-quant form): fx-engine's logits
    equal llama.cpp's from the same weights dequantized to F32 (llama.cpp's own Q4_K
    products round the activations to 8 bits, which these random models amplify)."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (an optional peer) is not installed")
    import llama_cpp

    from tests.gguf_tokenizer import dequantized_copy

    sizes = dict(hidden_size=256, intermediate_size=512, linear_key_head_dim=64, linear_value_head_dim=64,
                 head_dim=64, moe_intermediate_size=256, shared_expert_intermediate_size=256)
    if model_type == "qwen3_next":
        sizes["linear_num_value_heads"] = 2  # (the other case tiles 2 key heads over 4 value heads)
    folder = write_tiny_model(tmp_path / "m", model_type, seed=7, **sizes)
    f32, q4 = write_qwen3_next_gguf(folder, tmp_path / "f32.gguf"), tmp_path / "q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q4).encode(), params) == 0
    model = fx_engine.load(q4)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    theirs = llama_cpp_logits(dequantized_copy(q4, tmp_path / "deq.gguf"), ids, tmp_path / "l.npy")
    np.testing.assert_allclose(np.asarray(fx_engine.logits(model, ids)), theirs, rtol=0,
                               atol=1e-3 * np.abs(theirs).max())


def test_adapters_on_a_tiled_file(tmp_path):
    """An adapter (mlx-lm's format) on a qwen35 file: on the attention projections it applies;
    on a DeltaNet out_proj, whose columns the file keeps in llama.cpp's tiled order (an
    adapter's A factor reads the checkpoint's), it is refused by name, never applied to the
    wrong columns."""
    from fx_engine.loading.adapters import AdapterError

    folder = write_tiny_model(tmp_path / "m", "qwen3_5_text", seed=3)
    model = fx_engine.load(write_qwen3_next_gguf(folder, tmp_path / "m.gguf"))

    def adapter(out, key, fan_in, fan_out, layer):
        out.mkdir()
        base = f"model.layers.{layer}.{key}"
        mx.save_safetensors(str(out / "adapters.safetensors"), {
            base + ".lora_a": 0.3 * mx.random.normal((fan_in, 4), key=mx.random.key(1)),
            base + ".lora_b": 0.3 * mx.random.normal((4, fan_out), key=mx.random.key(2))})
        (out / "adapter_config.json").write_text(json.dumps({
            "fine_tune_type": "lora", "num_layers": 4,
            "lora_parameters": {"rank": 4, "scale": 2.0, "dropout": 0.0, "keys": [key]}}))
        return out

    fx_engine.load_adapter(model, adapter(tmp_path / "q", "self_attn.o_proj", 64, 64, 3), name="q")
    assert np.abs(np.asarray(fx_engine.logits(model, IDS, adapter="q")) - _logits(model)).max() > 1e-3
    with pytest.raises(AdapterError, match="out_proj' cannot be adapted: its columns are in llama.cpp's tiled"):
        fx_engine.load_adapter(model, adapter(tmp_path / "o", "linear_attn.out_proj", 64, 64, 0), name="o")
