"""The GPT-NeoX-style decoders (core/models/neox.py: gpt_neox, stablelm, phi) beyond what
every registry test runs on each model type (tests/models/test_parity.py against mlx-lm's
classes, test_every_family.py, test_hf_config.py): their variants against mlx-lm, Pythia's
exact GELU, GPT-NeoX's RoPE settings under either name, adapters, and the refusals."""

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf
from fx_engine.loading.adapters import AdapterError
from fx_engine.testing.tiny import tiny_config
from tools.oracle import write_mlx_lm_adapter

from tests.conftest import LONG_TEXT
from tests.models.test_parity import _compare

pytestmark = pytest.mark.oracle


def _mlx_lm_logits(path, ids):
    from mlx_lm.utils import load_model

    ref, _ = load_model(path)
    ref.set_dtype(mx.float32)
    return ref(mx.array([ids]))[0]


@pytest.mark.parametrize("model_type,overrides", [
    ("phi", {"num_key_value_heads": 4, "partial_rotary_factor": 0.4, "hidden_size": 80, "num_attention_heads": 4}),
    ("stablelm", {"use_qkv_bias": False}),  # StableLM 3B 4E1T
    ("stablelm", {"qk_layernorm": True, "use_parallel_residual": True, "use_qkv_bias": False}),  # StableLM 2 12B
    ("gpt_neox", {"use_parallel_residual": False, "rotary_pct": 1.0}),
    ("gpt_neox", {"rotary_emb_base": 500, "rotary_pct": 0.5}),
], ids=lambda x: str(x)[:60])
def test_variants_match_mlx_lm(tiny_folder, model_type, overrides):
    """Teacher-forced logits against mlx-lm's own class, chunked: Phi-2's 0.4 rotary fraction
    (32 of 80 dims), StableLM without q/k/v biases and with per-head q/k LayerNorms in a
    parallel block, GPT-NeoX's sequential block and its own RoPE names."""
    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    ids = model.tokenizer.encode(LONG_TEXT)[:96]
    want = _mlx_lm_logits(path, ids)
    for chunk in (7, 40):
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


def test_pythia_gelu_is_the_exact_one(tiny_folder, monkeypatch):
    """Pythia's hidden_act "gelu" is the erf GELU in Hugging Face's class (mlx-lm's gpt_neox
    always runs the tanh form): against mlx-lm with its GELU made the exact one, at least 10x
    closer than the tanh form's model is (the two forms differ by < 1e-3 per activation)."""
    import mlx.nn as nn
    from mlx_lm.models import gpt_neox

    exact, tanh = tiny_folder("gpt_neox", hidden_act="gelu"), tiny_folder("gpt_neox")
    model = fx_engine.load(exact)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    ours = fx_engine.logits(model, ids)
    monkeypatch.setattr(gpt_neox.nn, "gelu_approx", nn.gelu)
    want = _mlx_lm_logits(exact, ids)
    exact_diff = _compare(ours, want)
    tanh_diff = mx.abs(fx_engine.logits(fx_engine.load(tanh), ids) - want).max().item()
    assert exact_diff * 10 < tanh_diff, (exact_diff, tanh_diff)


def test_gpt_neox_rope_settings_as_its_config_class_reads_them():
    """GPTNeoXConfig reads RoPE from rope_parameters (transformers 5's saves), else from
    rotary_emb_base / rotary_pct; never from a top-level rope_theta."""
    base = {k: v for k, v in tiny_config("gpt_neox").items() if k not in ("rotary_emb_base", "rotary_pct")}
    old = config_from_hf({**base, "rotary_emb_base": 5000, "rotary_pct": 0.5})
    new = config_from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                                                      "partial_rotary_factor": 0.5}})
    assert (old.rope_theta, old.rope_dims) == (new.rope_theta, new.rope_dims) == (5000.0, 8)
    ignored = config_from_hf({**base, "rope_theta": 5000.0})
    assert (ignored.rope_theta, ignored.rope_dims) == (10000.0, 4)  # (the class's defaults)


@pytest.mark.parametrize("model_type,overrides,field", [
    ("phi", {"qk_layernorm": True}, "qk_layernorm"),
    ("phi", {"hidden_act": "relu"}, "hidden_act"),
    ("stablelm", {"hidden_act": "gelu"}, "hidden_act"),
    ("gpt_neox", {"hidden_act": "quick_gelu"}, "hidden_act"),
    ("gpt_neox", {"rotary_pct": 0.1}, "partial_rotary_factor"),  # 1.6 of 16 dims
    ("stablelm", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("phi", {"rope_scaling": {"rope_type": "su", "factor": 2.0}}, "rope_scaling"),
])
def test_refusals_name_the_field(model_type, overrides, field):
    with pytest.raises(ConfigError, match=field):
        config_from_hf({**tiny_config(model_type), **overrides})


def test_gpt_neox_fused_qkv_adapter_is_refused_by_name(tmp_path, tiny_folder):
    """GPT-NeoX's query_key_value rows are stored per head and reordered at load: an adapter
    on it is refused naming the module (the other projections take adapters)."""
    path = tiny_folder("gpt_neox")
    model = fx_engine.load(path)
    ad = write_mlx_lm_adapter(path, tmp_path / "ad", rank=4, scale=2.0, num_layers=2, seed=3, init_scale=0.1)
    with pytest.raises(AdapterError, match=r"attention\.query_key_value.*stored per head"):
        fx_engine.load_adapter(model, ad, name="a")
    dense = write_mlx_lm_adapter(path, tmp_path / "dense", rank=4, scale=2.0, num_layers=2, seed=3, init_scale=0.1,
                                 keys=["attention.dense", "mlp.dense_h_to_4h"])
    fx_engine.load_adapter(model, dense, name="d")
    ids = list(range(3, 30))
    assert mx.abs(fx_engine.logits(model, ids, adapter="d") - fx_engine.logits(model, ids)).max().item() > 1e-4
