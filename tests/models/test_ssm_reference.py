"""Mamba-2 and Falcon-H1 against references written from Hugging Face's model code
(transformers 5.25: modeling_mamba2.py's and modeling_falcon_h1.py's slow paths), in float64
numpy, one token at a time (the recurrence's definition), on tiny random folders.

These check what mlx-lm, the registry's parity oracle (tests/models/test_parity.py), does
not run as the models' reference does, so the tiny registry configs avoid it: the mixers'
gated norm per B/C group (n_groups > 1: Mamba-Codestral-7B has 8 groups), Falcon-H1's
key_multiplier on k and attention_in_multiplier on v, Hugging Face's default
mamba_norm_before_gate, time_step_limit, and the multipliers on biases. llama.cpp, run on
the same folders converted to GGUF, is the other oracle (tests/models/test_gguf_ssm.py).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.testing import write_tiny_model

pytestmark = pytest.mark.oracle


def _tensors(folder) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: np.asarray(v.astype(mx.float32), np.float64) for k, v in mx.load(str(f)).items()})
    return out


def _rms(x, w, eps):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _silu(x):
    return x / (1.0 + np.exp(-x))


def mixer_reference(t, pre, x, *, inner, groups, state, heads, kernel, eps, in_mult=1.0, mup=None,
                    norm=True, norm_before_gate=False, limit=(0.0, math.inf)):
    """A Mamba-2 mixer over x [T, hidden], token by token (Hugging Face's torch_forward with
    a cache: the conv over the last `kernel` inputs, the state update, the gated norm per
    group of inner / groups channels)."""
    n_t, gn, hd = x.shape[0], groups * state, inner // heads
    proj = (x * in_mult) @ t[pre + "in_proj.weight"].T + t.get(pre + "in_proj.bias", 0.0)
    if mup is not None:
        proj = proj * mup
    z, xbc, dt = proj[:, :inner], proj[:, inner : 2 * inner + 2 * gn], proj[:, 2 * inner + 2 * gn :]
    w = t[pre + "conv1d.weight"][:, 0, :]  # [C, K]
    past = np.concatenate([np.zeros((kernel - 1, xbc.shape[1])), xbc])
    conv = np.stack([(past[s : s + kernel] * w.T).sum(0) for s in range(n_t)]) + t.get(pre + "conv1d.bias", 0.0)
    conv = _silu(conv)
    xs = conv[:, :inner].reshape(n_t, heads, hd)
    b, c = conv[:, inner : inner + gn].reshape(n_t, groups, state), conv[:, inner + gn :].reshape(n_t, groups, state)
    dt = np.clip(np.logaddexp(dt + t[pre + "dt_bias"], 0.0), *limit)
    a = -np.exp(t[pre + "A_log"])
    g = np.arange(heads) // (heads // groups)  # each head's B/C group
    s_t, ys = np.zeros((heads, hd, state)), []
    for s in range(n_t):
        s_t = s_t * np.exp(dt[s] * a)[:, None, None] + dt[s][:, None, None] * xs[s][:, :, None] * b[s][g][:, None, :]
        ys.append(((s_t * c[s][g][:, None, :]).sum(-1) + t[pre + "D"][:, None] * xs[s]).reshape(inner))
    y, gate = np.stack(ys), _silu(z)
    if norm:
        if not norm_before_gate:
            y = y * gate
        y = _rms(y.reshape(n_t, groups, inner // groups), None, eps).reshape(n_t, inner) * t[pre + "norm.weight"]
        if norm_before_gate:
            y = y * gate
    else:
        y = y * gate
    return y @ t[pre + "out_proj.weight"].T + t.get(pre + "out_proj.bias", 0.0)


def mamba2_reference(folder, cfg, ids):
    t = _tensors(folder)
    eps = cfg["layer_norm_epsilon"]
    dims = dict(inner=cfg["num_heads"] * cfg["head_dim"], groups=cfg["n_groups"], state=cfg["state_size"],
                heads=cfg["num_heads"], kernel=cfg["conv_kernel"], eps=eps, limit=tuple(cfg["time_step_limit"]))
    h = t["backbone.embeddings.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"backbone.layers.{i}."
        h = h + mixer_reference(t, p + "mixer.", _rms(h, t[p + "norm.weight"], eps), **dims)
    h = _rms(h, t["backbone.norm_f.weight"], eps)
    return h @ t.get("lm_head.weight", t["backbone.embeddings.weight"]).T


def _rope(x, theta):
    """Hugging Face's rotate_half RoPE over x [T, heads, d] at positions 0..T-1."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = np.arange(x.shape[0])[:, None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _attention(t, pre, x, cfg, key_mult):
    heads, kv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n_t = x.shape[0]

    def proj(name):
        return x @ t[pre + name + ".weight"].T + t.get(pre + name + ".bias", 0.0)

    q = _rope(proj("q_proj").reshape(n_t, heads, d), cfg["rope_theta"])
    k = _rope((proj("k_proj") * key_mult).reshape(n_t, kv, d), cfg["rope_theta"])
    v = proj("v_proj").reshape(n_t, kv, d)
    k, v = np.repeat(k, heads // kv, 1), np.repeat(v, heads // kv, 1)
    scores = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
    scores = np.where(np.tril(np.ones((n_t, n_t), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("hqk,khd->qhd", p, v).reshape(n_t, heads * d)
    return out @ t[pre + "o_proj.weight"].T + t.get(pre + "o_proj.bias", 0.0)


def falcon_h1_reference(folder, cfg, ids):
    t = _tensors(folder)
    eps, inner = cfg["rms_norm_eps"], cfg["mamba_n_heads"] * cfg["mamba_d_head"]
    groups, state, heads = cfg["mamba_n_groups"], cfg["mamba_d_state"], cfg["mamba_n_heads"]
    sizes = (inner, inner, groups * state, groups * state, heads)
    mup = np.concatenate([np.full(n, m) for n, m in zip(sizes, cfg["ssm_multipliers"])])
    gm, dm = cfg["mlp_multipliers"]
    h = t["model.embed_tokens.weight"][ids] * cfg["embedding_multiplier"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        x = _rms(h, t[p + "input_layernorm.weight"], eps)
        m = mixer_reference(t, p + "mamba.", x, inner=inner, groups=groups, state=state, heads=heads,
                            kernel=cfg["mamba_d_conv"], eps=eps, in_mult=cfg["ssm_in_multiplier"], mup=mup,
                            norm=cfg["mamba_rms_norm"], norm_before_gate=cfg.get("mamba_norm_before_gate", True),
                            limit=tuple(cfg.get("time_step_limit", (0.0, math.inf))))
        a = _attention(t, p + "self_attn.", x * cfg["attention_in_multiplier"], cfg, cfg["key_multiplier"])
        h = h + m * cfg["ssm_out_multiplier"] + a * cfg["attention_out_multiplier"]
        y = _rms(h, t[p + "pre_ff_layernorm.weight"], eps)
        f = p + "feed_forward."

        def lin(name, v):
            return v @ t[f + name + ".weight"].T + t.get(f + name + ".bias", 0.0)

        h = h + lin("down_proj", lin("up_proj", y) * _silu(lin("gate_proj", y) * gm)) * dm
    h = _rms(h, t["model.final_layernorm.weight"], eps)
    return h @ t.get("lm_head.weight", t["model.embed_tokens.weight"]).T * cfg["lm_head_multiplier"]


IDS = [5, 17, 9, 200, 33, 71, 2, 140, 12, 8, 301, 44, 19, 27, 90, 6, 250, 3, 77, 11]


def _check(model, want, ids=IDS):
    got = np.asarray(fx_engine.logits(model, ids).astype(mx.float32), np.float64)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * scale)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.95


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_mamba2_matches_reference(tmp_path, groups):
    folder = write_tiny_model(tmp_path / "m", "mamba2", seed=4, n_groups=groups, time_step_limit=[0.01, 2.0])
    cfg = fx_engine.load(folder).config
    import json

    raw = json.loads((folder / "config.json").read_text())
    assert cfg.mixer.norm_groups == groups
    _check(fx_engine.load(folder), mamba2_reference(folder, raw, IDS))


FALCON_VARIANTS = {
    "grouped-norm-after-gate": dict(mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=False),
    "norm-before-gate": dict(mamba_n_groups=2, mamba_rms_norm=True, mamba_norm_before_gate=True),
    "no-norm-untied": dict(mamba_rms_norm=False, tie_word_embeddings=False, time_step_limit=[0.05, 1.5]),
    "biases": dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True, projectors_bias=True),
}


@pytest.mark.parametrize("variant", list(FALCON_VARIANTS))
def test_falcon_h1_matches_reference(tmp_path, variant):
    """key_multiplier and attention_in_multiplier away from 1 in every variant (mlx-lm
    leaves k unscaled and v without the attention's input multiplier)."""
    import json

    folder = write_tiny_model(tmp_path / "m", "falcon_h1", seed=5, key_multiplier=0.39, attention_in_multiplier=1.3,
                              **FALCON_VARIANTS[variant])
    raw = json.loads((folder / "config.json").read_text())
    _check(fx_engine.load(folder), falcon_h1_reference(folder, raw, IDS))


def test_falcon_h1_default_norm_before_gate_is_hugging_faces(tmp_path):
    """A config without mamba_norm_before_gate normalizes before the gate (Hugging Face's
    FalconH1Config default)."""
    import json

    folder = write_tiny_model(tmp_path / "m", "falcon_h1", seed=6, mamba_rms_norm=True)
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("mamba_norm_before_gate")
    (folder / "config.json").write_text(json.dumps(raw))
    model = fx_engine.load(folder)
    assert model.config.mixer.norm_mode == "norm_gate"
    _check(model, falcon_h1_reference(folder, raw, IDS))
