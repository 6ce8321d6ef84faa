"""Config flags Hugging Face's model classes read and mlx-lm fixes: a model without the
biases a flag turns off runs as the same model with those biases zero (an independent
identity: no reference implementation of the flag needed), and GPT-OSS's gate slope
(`swiglu_alpha`) is Hugging Face's GptOssExperts formula."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.models.gpt_oss import swiglu_oai
from fx_engine.testing.tiny import write_tiny_model

IDS = [1, 5, 9, 17, 33, 65, 100, 200, 7, 3, 250, 11]

#: (model type, the flag, its value with biases, the tensors it governs)
CASES = [
    ("qwen2_moe", "qkv_bias", True, r"self_attn\.[qkv]_proj\.bias$"),
    ("gpt_oss", "attention_bias", True, r"self_attn\.[qkvo]_proj\.bias$"),
    ("nemotron_h", "use_bias", True, r"mixer\.(in|out)_proj\.bias$"),
]


def _logits(path) -> np.ndarray:
    model = fx_engine.load(path)
    return np.array(fx_engine.logits(model, IDS, chunk=5))


@pytest.mark.parametrize("mt,flag,on,pattern", CASES, ids=[c[0] for c in CASES])
def test_a_flag_off_is_the_model_with_those_biases_zero(tmp_path, mt, flag, on, pattern):
    with_biases = write_tiny_model(tmp_path / "on", mt, **{flag: on})
    weights = mx.load(str(with_biases / "model.safetensors"))
    mx.eval(weights)  # (read now: the file is rewritten below)
    governed = [k for k in weights if re.search(pattern, k)]
    assert governed, f"{mt}: the tiny checkpoint has no tensor matching {pattern}"
    mx.save_safetensors(str(with_biases / "model.safetensors"),
                        {k: mx.zeros_like(v) if k in governed else v for k, v in weights.items()})
    without = tmp_path / "off"
    without.mkdir()
    for f in with_biases.iterdir():
        if f.name != "model.safetensors":
            (without / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((with_biases / "config.json").read_text())
    (without / "config.json").write_text(json.dumps({**cfg, flag: not on}))
    mx.save_safetensors(str(without / "model.safetensors"),
                        {k: v for k, v in weights.items() if k not in governed})
    a, b = _logits(with_biases), _logits(without)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # and the flag is not ignored: the biases, when not zero, move the logits
    mx.save_safetensors(str(with_biases / "model.safetensors"), weights)
    assert np.abs(_logits(with_biases) - b).max() > 1e-3


def test_gpt_oss_gate_slope_is_hugging_faces_formula():
    """GptOssExperts._apply_gate: gate.clamp(max=limit), up.clamp(-limit, limit),
    (up + 1) * gate * sigmoid(gate * alpha), on gate|up halves (fx-engine's fused layout)."""
    rng = np.random.default_rng(0)
    gu = rng.normal(scale=4.0, size=(3, 16)).astype(np.float32)
    for limit, alpha in ((7.0, 1.702), (5.0, 1.0), (9.0, 2.5)):
        gate, up = np.minimum(gu[:, :8], limit), np.clip(gu[:, 8:], -limit, limit)
        want = (up + 1) * gate / (1 + np.exp(-gate * alpha))
        got = np.array(swiglu_oai(mx.array(gu), limit, alpha))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_gpt_oss_reads_swiglu_alpha(tmp_path):
    base = _logits(write_tiny_model(tmp_path / "a", "gpt_oss"))
    assert np.abs(_logits(write_tiny_model(tmp_path / "b", "gpt_oss", swiglu_alpha=1.0)) - base).max() > 1e-4
    np.testing.assert_array_equal(_logits(write_tiny_model(tmp_path / "c", "gpt_oss", swiglu_alpha=1.702)), base)


@pytest.mark.parametrize("mt", ["cohere", "cohere2"])
def test_cohere_untied_head_is_read(tmp_path, mt):
    """tie_word_embeddings false: Hugging Face's CohereForCausalLM multiplies by its own
    lm_head (times logit_scale). The same model with lm_head = the embedding gives the tied
    model's logits; another lm_head moves them (mlx-lm always tied: lm_head ignored)."""
    tied = write_tiny_model(tmp_path / "tied", mt, tie_word_embeddings=True)
    base = _logits(tied)
    weights = mx.load(str(tied / "model.safetensors"))
    mx.eval(weights)
    cfg = json.loads((tied / "config.json").read_text())
    for name, head in (("same", weights["model.embed_tokens.weight"]),
                       ("other", weights["model.embed_tokens.weight"][::-1])):
        path = tmp_path / name
        path.mkdir()
        for f in tied.iterdir():
            if f.name not in ("model.safetensors", "config.json"):
                (path / f.name).write_bytes(f.read_bytes())
        (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": False}))
        mx.save_safetensors(str(path / "model.safetensors"), {**weights, "lm_head.weight": head})
        got = _logits(path)
        if name == "same":
            np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_allclose(got, base[:, ::-1], rtol=1e-4, atol=1e-4)
