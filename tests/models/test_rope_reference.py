"""Scaled RoPE against references written from Hugging Face's rope code (transformers 5.25
modeling_rope_utils.py), in float64 numpy, where mlx-lm (the registry's parity oracle) runs
otherwise: YaRN's `truncate` (gpt-oss's published configs say false: the correction range
is not rounded to whole dims, as OpenAI's reference code runs it) and a given
`attention_factor`."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.nn import scaled_rope_freqs, scaled_rope_mscale
from fx_engine.testing import write_tiny_model


def yarn_inv_freq(scaling: dict, dim: int, base: float) -> np.ndarray:
    """Hugging Face's _compute_yarn_parameters' inverse frequencies."""
    factor, orig = scaling["factor"], scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    pos = base ** (np.arange(0, dim, 2) / dim)
    return (1 / (factor * pos)) * (1 - extra_factor) + (1 / pos) * extra_factor


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("dim,base,orig,factor", [(64, 150000.0, 4096, 32.0), (16, 150000.0, 256, 8.0),
                                                  (128, 10000.0, 4096, 4.0)])
def test_yarn_frequencies(truncate, dim, base, orig, factor):
    scaling = {"rope_type": "yarn", "factor": factor, "beta_fast": 32.0, "beta_slow": 1.0,
               "original_max_position_embeddings": orig, "truncate": truncate}
    got = 1.0 / np.asarray(scaled_rope_freqs(scaling, dim, base), np.float64)
    np.testing.assert_allclose(got, yarn_inv_freq(scaling, dim, base), rtol=2e-6)


def test_gpt_oss_reads_truncate_false(tmp_path):
    """gpt-oss's published rope_scaling (truncate false) reaches the model's rotation: its
    periods are Hugging Face's, and differ from the truncated ones (mlx-lm's)."""
    from fx_engine.core.models.gpt_oss import tiny_config

    scaling = {**tiny_config("gpt_oss", {})["rope_scaling"], "truncate": False}
    model = fx_engine.load(write_tiny_model(tmp_path / "m", "gpt_oss", rope_scaling=scaling))
    got = 1.0 / np.asarray(model.params.rope_freqs, np.float64)
    np.testing.assert_allclose(got, yarn_inv_freq(scaling, 16, 150000.0), rtol=2e-6)
    assert not np.allclose(got, yarn_inv_freq({**scaling, "truncate": True}, 16, 150000.0), rtol=1e-3)


def test_yarn_attention_factor():
    """A given attention_factor is the scale (Hugging Face); else 0.1 ln(factor) + 1, or the
    ratio of the two mscales where both are given."""
    base = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}
    assert scaled_rope_mscale({**base, "attention_factor": 1.25}, 131072) == 1.25
    assert scaled_rope_mscale(base, 131072) == pytest.approx(0.1 * math.log(32) + 1)
    both = {**base, "mscale": 0.707, "mscale_all_dim": 0.707}
    assert scaled_rope_mscale(both, 131072) == pytest.approx(1.0)


def _yarn_mscale(factor: float) -> float:
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_text", "falcon_h1", "granitemoehybrid", "lfm2"])
def test_yarn_reaches_the_families_that_build_rope_in_their_forward(tmp_path, model_type):
    """Families whose forward builds its RoPE tables itself (Qwen3-Next / Qwen3.5 over a
    partial rotary, Falcon-H1, Granite 4.0 hybrid, LFM2) apply a configured YaRN: the
    tables are Hugging Face's (frequencies over the rotated dims, cos / sin times the
    attention factor), and the logits move with it. Before, the scaling was read and
    dropped."""
    from fx_engine.core.models import config_from_hf
    from fx_engine.core.models.blocks import config_rope
    from fx_engine.testing.tiny import tiny_config

    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    extra = {"position_embedding_type": "rope"} if model_type == "granitemoehybrid" else {}
    cfg = config_from_hf({**tiny_config(model_type), **extra, "rope_scaling": scaling})
    dims = getattr(cfg, "rope_dims", 0) or cfg.head_dim
    pos = np.arange(300)
    cos = np.asarray(config_rope(cfg, mx.array(pos)[None], mx.float32, dims)[0], np.float64)[0, :, 0]
    want = np.cos(pos[:, None] * yarn_inv_freq(scaling, dims, cfg.rope_theta)[None]) * _yarn_mscale(4.0)
    np.testing.assert_allclose(cos[:, : dims // 2], want, atol=2e-5)  # (cos repeats over the two halves)

    plain = fx_engine.load(write_tiny_model(tmp_path / "a", model_type, **extra))
    scaled = fx_engine.load(write_tiny_model(tmp_path / "b", model_type, **extra, rope_scaling=scaling))
    ids = list(range(3, 200))
    a, b = (np.asarray(fx_engine.logits(m, ids, chunk=64), np.float64) for m in (plain, scaled))
    assert not np.allclose(a, b, atol=1e-4)


def test_deepseek_rope_interleave_false(tmp_path):
    """DeepSeek-V3's rope_interleave (Hugging Face, default true): false rotates the two
    halves of the rope dims instead of adjacent pairs. Hugging Face's interleaved path is its
    half-rotation on de-interleaved dims, so a checkpoint whose q and k rope rows are
    de-interleaved (x0, x2, ..., x1, x3, ...) and says false computes the same logits as the
    original saying true; and differs from the original saying false (the flag is read)."""
    import json

    src = write_tiny_model(tmp_path / "a", "deepseek_v3")
    cfg = json.loads((src / "config.json").read_text())
    dn, dr, hq = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["num_attention_heads"]
    perm = np.concatenate([np.arange(0, dr, 2), np.arange(1, dr, 2)])
    w = {k: np.asarray(v) for k, v in mx.load(str(src / "model.safetensors")).items()}
    for name in list(w):
        if name.endswith("self_attn.q_b_proj.weight"):
            rows = w[name].reshape(hq, dn + dr, -1).copy()
            rows[:, dn:] = rows[:, dn:][:, perm]
            w[name] = rows.reshape(hq * (dn + dr), -1)
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            rope_rows = w[name][-dr:][perm]
            w[name] = np.concatenate([w[name][:-dr], rope_rows])
    out = tmp_path / "b"
    out.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in w.items()},
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
    ids = list(range(3, 40))
    want = np.asarray(fx_engine.logits(fx_engine.load(src), ids, chunk=16), np.float64)
    got = np.asarray(fx_engine.logits(fx_engine.load(out), ids, chunk=16), np.float64)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=2e-4)
    (src / "config.json").write_text(json.dumps({**cfg, "rope_interleave": False}))
    other = np.asarray(fx_engine.logits(fx_engine.load(src), ids, chunk=16), np.float64)
    assert not np.allclose(other, want, atol=1e-3)
