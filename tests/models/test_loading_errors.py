"""Bad model inputs give clear errors naming the file and the tensor or field."""

import json

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.loading.weights import WeightsError
from fx_engine.testing import write_tiny_model


def test_unknown_architecture(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama")
    cfg = json.loads((p / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json.*model_type 'mamba' is not supported"):
        fx_engine.load(p)


def test_unsupported_rope_scaling_and_sliding_window(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama", rope_scaling={"type": "ntk-by-parts", "factor": 2.0})
    with pytest.raises(ConfigError, match="rope_scaling type 'ntk-by-parts'"):
        fx_engine.load(p)
    p2 = write_tiny_model(tmp_path / "m2", "qwen2", layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        fx_engine.load(p2)
    p3 = write_tiny_model(tmp_path / "m3", "llama", layer_types=["sliding_attention"] * 2)
    with pytest.raises(ConfigError, match="sliding_window"):
        fx_engine.load(p3)


def test_missing_tensor_names_it(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama")
    w = mx.load(str(p / "model.safetensors"))
    del w["model.layers.1.mlp.down_proj.weight"]
    mx.save_safetensors(str(p / "model.safetensors"), w)
    with pytest.raises(WeightsError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj\.weight'"):
        fx_engine.load(p)


def test_shape_mismatch_names_file_and_tensor(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama")
    w = mx.load(str(p / "model.safetensors"))
    w["model.layers.0.self_attn.k_proj.weight"] = mx.zeros((7, 64))
    mx.save_safetensors(str(p / "model.safetensors"), w)
    with pytest.raises(WeightsError, match=r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(7, 64\)"):
        fx_engine.load(p)


def test_truncated_safetensors(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama")
    f = p / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match=r"model\.safetensors: cannot read weights"):
        fx_engine.load(p)


def test_truncated_gguf(tmp_path, default_model):
    src = open(default_model.path, "rb").read(3_000_000)
    f = tmp_path / "cut.gguf"
    f.write_bytes(src)
    with pytest.raises(WeightsError, match=r"cut\.gguf: cannot read weights"):
        fx_engine.load(f)


def test_missing_config_and_bad_json(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no config.json"):
        fx_engine.load(tmp_path / "empty")
    p = write_tiny_model(tmp_path / "m", "llama")
    (p / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: invalid JSON"):
        fx_engine.load(p)


def test_missing_shard_named(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama", shards=2)
    (p / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors"):
        fx_engine.load(p)


def test_bad_config_fields(tmp_path):
    p = write_tiny_model(tmp_path / "m", "llama", num_attention_heads=4, num_key_value_heads=3)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        fx_engine.load(p)
    p = write_tiny_model(tmp_path / "m2", "llama")
    cfg = json.loads((p / "config.json").read_text())
    del cfg["hidden_size"]
    (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'hidden_size' is missing"):
        fx_engine.load(p)


def test_nonexistent_path_and_wrong_file_type(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        fx_engine.load(tmp_path / "nope")
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    with pytest.raises(WeightsError, match="unsupported model file"):
        fx_engine.load(f)


def test_default_model_missing_message(monkeypatch, tmp_path):
    from fx_engine.loading import default_model as dm

    monkeypatch.setattr(dm, "_installed", lambda: None)
    monkeypatch.setenv("FX_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv("FX_ENGINE_OFFLINE", "1")
    with pytest.raises(dm.ModelNotFound, match="--model PATH"):
        dm.default_model_path()
