"""Tiny random MTP modules in each published format, and an independent float64 reference of
their forward, for tests of fx_engine.core.drafters.mtp (and users' own).

Formats (the target checkpoint's config.json and the modules' tensors under the names the
checkpoints store them; see the core module's docstring for the table):

  deepseek_v3  model.layers.{N}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
               embed_tokens} and a DeepSeek-V3 decoder layer (MLA, routed experts) there
  glm4_moe     the same names, a GLM-4.5 decoder layer (q/k/v biases, q/k norms, partial
               RoPE, grouped sigmoid routing)
  qwen3_next   mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm} and mtp.layers.0.*, a
               gated full-attention layer with routed experts (RMSNorms stored as w of 1 + w);
               qwen3_5_text / qwen3_5_moe_text: Qwen3.5's, the same with a dense MLP / with
               its experts fused (experts.gate_up_proj [E, 2F, H], experts.down_proj)
  mimo         model.mtp_layers.0.{token_layernorm, hidden_layernorm, input_proj,
               final_layernorm} and a Qwen2 decoder layer there

The reference (`reference_step`) is written from the published equations (the DeepSeek-V3
report, Hugging Face's modeling code of each family, vLLM's *_mtp.py forwards) in numpy
float64, reading the tensors by their checkpoint names: MLA in its plain (non-absorbed)
form, YaRN from DeepSeek's formulas, each router written out per token. It shares no code
with the module it checks.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

KINDS = ("deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "mimo")
_QWEN = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


# ---------------------------------------------------------------- tiny configs and tensors


def tiny_mtp_config(kind: str, **overrides: Any) -> dict[str, Any]:
    """A tiny target's config.json that ships MTP modules of format `kind` (KINDS)."""
    from fx_engine.testing.tiny import tiny_config

    if kind == "deepseek_v3":
        cfg = tiny_config("deepseek_v3", num_nextn_predict_layers=1)
    elif kind == "glm4_moe":
        cfg = tiny_config("glm4_moe", num_nextn_predict_layers=1)
    elif kind == "qwen3_next":
        cfg = tiny_config("qwen3_next")  # (its configs do not say: one module, vLLM's default)
    elif kind in ("qwen3_5_text", "qwen3_5_moe_text"):
        cfg = tiny_config(kind, mtp_num_hidden_layers=1)
    elif kind == "mimo":
        cfg = {"model_type": "mimo", "architectures": ["MiMoForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
               "vocab_size": 384, "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
               "tie_word_embeddings": False, "attention_bias": True, "use_sliding_window": False,
               "num_nextn_predict_layers": 1, "bos_token_id": 1, "eos_token_id": 2}
    else:
        raise ValueError(f"tiny_mtp_config: unknown kind {kind!r} (one of {KINDS})")
    return {**cfg, **overrides}


def _layer_layout(kind: str, cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """The family's checkpoint layout of n decoder layers shaped like the modules' (routed
    experts; Qwen3-Next's full attention), under model.layers.{k}."""
    from fx_engine.core.models import config_from_hf, hf_family

    d = {**cfg, "num_hidden_layers": n}
    if kind in ("deepseek_v3", "glm4_moe"):
        d["first_k_dense_replace"] = 0
    elif kind in _QWEN:
        d["full_attention_interval"] = 1
    elif kind == "mimo":
        d["model_type"] = "qwen2"
    layout = hf_family(d).checkpoint_layout(config_from_hf(d, "tiny"))
    return {name: spec for name, spec in layout.items() if name.startswith("model.layers.")}


def mtp_prefix(kind: str, cfg: dict[str, Any], k: int = 0) -> str:
    """Where module k's decoder layer sits in the checkpoint."""
    if kind in ("deepseek_v3", "glm4_moe"):
        return f"model.layers.{cfg['num_hidden_layers'] + k}."
    if kind in _QWEN:
        return f"mtp.layers.{k}."
    return f"model.mtp_layers.{k}."


def tiny_mtp_tensors(kind: str, cfg: dict[str, Any], *, seed: int = 0, own_tables: str | None = "copy",
                     dtype: str = "float32") -> dict[str, mx.array]:
    """Random tensors of the checkpoint's MTP modules (as many as the config says) under
    their published names, with the target's embedding table and output head
    (model.embed_tokens.weight, lm_head.weight). own_tables (DeepSeek-V3 / GLM-4.5): the
    modules' embed_tokens and shared_head.head as copies of the target's ("copy", what
    DeepSeek-V3 ships), other random values ("distinct") or absent (None)."""
    from fx_engine.core.drafters.mtp import mtp_layers_in

    n = mtp_layers_in(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    one_plus = kind in _QWEN  # RMSNorms stored as w of 1 + w

    def norm() -> np.ndarray:
        return (0.0 if one_plus else 1.0) + rng.normal(0.0, 0.1, (h,))

    layout = _layer_layout(kind, cfg, n)
    for k in range(n):
        pre = mtp_prefix(kind, cfg, k)
        for name, spec in layout.items():
            rest = name.split(".", 3)
            if int(rest[2]) == k:
                out[pre + rest[3]] = spec.center + max(spec.scale, 0.1) * rng.normal(size=spec.shape)
    out["model.embed_tokens.weight"] = rng.normal(0.0, 0.5, (v, h))
    out["lm_head.weight"] = rng.normal(0.0, 0.2, (v, h))
    if kind in ("deepseek_v3", "glm4_moe"):
        for k in range(n):
            pre = mtp_prefix(kind, cfg, k)
            out.update({pre + "enorm.weight": norm(), pre + "hnorm.weight": norm(),
                        pre + "eh_proj.weight": rng.normal(0.0, 0.1, (h, 2 * h)),
                        pre + "shared_head.norm.weight": norm()})
            if own_tables == "copy":
                out[pre + "embed_tokens.weight"] = out["model.embed_tokens.weight"].copy()
                out[pre + "shared_head.head.weight"] = out["lm_head.weight"].copy()
            elif own_tables == "distinct":
                out[pre + "embed_tokens.weight"] = rng.normal(0.0, 0.5, (v, h))
                out[pre + "shared_head.head.weight"] = rng.normal(0.0, 0.2, (v, h))
    elif one_plus:
        out.update({"mtp.fc.weight": rng.normal(0.0, 0.1, (h, 2 * h)), "mtp.pre_fc_norm_embedding.weight": norm(),
                    "mtp.pre_fc_norm_hidden.weight": norm(), "mtp.norm.weight": norm()})
    else:
        for k in range(n):
            pre = mtp_prefix(kind, cfg, k)
            out.update({pre + "token_layernorm.weight": norm(), pre + "hidden_layernorm.weight": norm(),
                        pre + "input_proj.weight": rng.normal(0.0, 0.1, (h, 2 * h)),
                        pre + "final_layernorm.weight": norm()})
    return {name: mx.array(a.astype(np.float32)).astype(getattr(mx, dtype)) for name, a in out.items()}


# ---------------------------------------------------------------- the reference (float64 numpy)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _swiglu(x: np.ndarray, w: dict[str, np.ndarray], pre: str) -> np.ndarray:
    """down(silu(gate(x)) * up(x)) of the MLP under `pre` (pre + "gate_proj.weight", ...)."""
    gate, up = x @ w[pre + "gate_proj.weight"].T, x @ w[pre + "up_proj.weight"].T
    return (_silu(gate) * up) @ w[pre + "down_proj.weight"].T


def _rope_halves(x: np.ndarray, pos: np.ndarray, dims: int, theta: float) -> np.ndarray:
    """GPT-NeoX RoPE (Hugging Face's rotate_half) over the first `dims` dims of each head of
    x [B, T, heads, D] at positions [B, T]; the rest pass through."""
    inv = theta ** (-np.arange(0, dims, 2) / dims)
    ang = pos[..., None] * inv  # [B, T, dims/2]
    cos, sin = np.cos(ang)[:, :, None], np.sin(ang)[:, :, None]
    a, b = x[..., : dims // 2], x[..., dims // 2 : dims]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x[..., dims:]], -1)


def _rope_pairs(x: np.ndarray, pos: np.ndarray, inv: np.ndarray, mscale: float) -> np.ndarray:
    """RoPE rotating adjacent pairs (x_2i, x_2i+1) by pos * inv[i] (DeepSeek's), cos and sin
    times YaRN's mscale; x [B, T, heads, D]."""
    ang = pos[..., None] * inv
    cos, sin = (np.cos(ang) * mscale)[:, :, None], (np.sin(ang) * mscale)[:, :, None]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
    return out


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, qpos: np.ndarray, kpos: np.ndarray,
            scale: float) -> np.ndarray:
    """Causal (by position) grouped-query attention: q [B, T, Hq, D], k [B, S, Hk, D],
    v [B, S, Hk, Dv] -> [B, T, Hq, Dv]; query head j reads KV head j // (Hq / Hk)."""
    b, t, hq, _ = q.shape
    hk = k.shape[2]
    out = np.zeros((b, t, hq, v.shape[-1]))
    for r in range(b):
        for j in range(hq):
            kv = j // (hq // hk)
            s = q[r, :, j] @ k[r, :, kv].T * scale
            s = np.where(kpos[r][None, :] <= qpos[r][:, None], s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[r, :, j] = (p / p.sum(-1, keepdims=True)) @ v[r, :, kv]
    return out


def _cached(past: tuple | None, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> tuple:
    if past is None:
        return k, v, pos
    return np.concatenate([past[0], k], 1), np.concatenate([past[1], v], 1), np.concatenate([past[2], pos], 1)


def _yarn(d: dict[str, Any], dims: int) -> tuple[np.ndarray, float, float]:
    """DeepSeek-V3's RoPE (Hugging Face's DeepseekV3YarnRotaryEmbedding): the inverse
    frequencies, the mscale on cos / sin, and the factor on the attention scale."""
    theta = float(d.get("rope_theta", 10000.0))
    base = 1.0 / theta ** (np.arange(0, dims, 2) / dims)
    rs = d.get("rope_scaling") or {}
    if (rs.get("type") or rs.get("rope_type")) != "yarn":
        return base, 1.0, 1.0
    factor, orig = float(rs["factor"]), float(rs["original_max_position_embeddings"])
    fast, slow = float(rs.get("beta_fast", 32)), float(rs.get("beta_slow", 1))

    def corr(rotations: float) -> float:
        return dims * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dims - 1)
    ramp = np.clip((np.arange(dims // 2) - low) / ((high - low) or 0.001), 0, 1)
    keep = 1.0 - ramp  # 1: extrapolate (the base frequency), 0: interpolate (divided by factor)
    inv = base / factor * (1 - keep) + base * keep

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    all_dim = float(rs.get("mscale_all_dim", 0) or 0)
    attn = mscale(all_dim) ** 2 if all_dim else 1.0
    return inv, mscale(float(rs.get("mscale", 1))) / mscale(all_dim), attn


def _grouped_moe(d: dict[str, Any], w: dict[str, np.ndarray], m: str, x: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's routed MLP (also GLM-4.5's) under `m`, token by token: sigmoid scores;
    score + correction bias chooses; groups ranked by their two best, the topk_group best
    kept; the top k experts among them, weighted by their scores (renormalized if
    norm_topk_prob) times routed_scaling_factor; plus the shared experts."""
    e, k = d["n_routed_experts"], d["num_experts_per_tok"]
    groups, keep_groups = d.get("n_group") or 1, d.get("topk_group") or 1
    flat = x.reshape(-1, x.shape[-1])
    scores = _sigmoid(flat @ w[m + "gate.weight"].T)
    choice = scores + w[m + "gate.e_score_correction_bias"]
    out = np.zeros_like(flat)
    per = e // groups
    for i, row in enumerate(flat):
        best = np.sort(choice[i].reshape(groups, per), -1)[:, -2:].sum(-1)
        allowed = np.zeros(e, bool)
        for g in np.argsort(-best, kind="stable")[:keep_groups]:
            allowed[g * per:(g + 1) * per] = True
        idx = np.argsort(-np.where(allowed, choice[i], -np.inf), kind="stable")[:k]
        wt = scores[i, idx]
        if d.get("norm_topk_prob", True):
            wt = wt / wt.sum()
        wt = wt * float(d.get("routed_scaling_factor", 1.0))
        out[i] = sum(c * _swiglu(row, w, m + f"experts.{j}.") for c, j in zip(wt, idx))
    if d.get("n_shared_experts"):
        out = out + _swiglu(flat, w, m + "shared_experts.")
    return out.reshape(x.shape)


def _expert(w: dict[str, np.ndarray], m: str, j: int, x: np.ndarray) -> np.ndarray:
    """Expert j of the routed MLP under `m`: one tensor per projection (experts.{j}.*), or
    Qwen3.5's fused stacks (experts.gate_up_proj [E, 2F, H], gate rows first; down_proj)."""
    if m + "experts.gate_up_proj" not in w:
        return _swiglu(x, w, m + f"experts.{j}.")
    gu, f = w[m + "experts.gate_up_proj"][j], w[m + "experts.gate_up_proj"].shape[1] // 2
    return (_silu(x @ gu[:f].T) * (x @ gu[f:].T)) @ w[m + "experts.down_proj"][j].T


def _softmax_moe(d: dict[str, Any], w: dict[str, np.ndarray], m: str, x: np.ndarray) -> np.ndarray:
    """Qwen3-Next's routed MLP under `m`: softmax over the experts, the top k (renormalized if
    norm_topk_prob), plus the shared expert gated by sigmoid(shared_expert_gate(x))."""
    k = d["num_experts_per_tok"]
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ w[m + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(flat)
    for i, row in enumerate(flat):
        idx = np.argsort(-probs[i], kind="stable")[:k]
        wt = probs[i, idx]
        if d.get("norm_topk_prob"):
            wt = wt / wt.sum()
        out[i] = sum(c * _expert(w, m, j, row) for c, j in zip(wt, idx))
    if d.get("shared_expert_intermediate_size"):
        out = out + _sigmoid(flat @ w[m + "shared_expert_gate.weight"].T) * _swiglu(flat, w, m + "shared_expert.")
    return out.reshape(x.shape)


def _deepseek_layer(d: dict[str, Any], w: dict[str, np.ndarray], pre: str, x: np.ndarray, pos: np.ndarray,
                    past: tuple | None) -> tuple[np.ndarray, tuple]:
    """A DeepSeek-V3 decoder layer: MLA with keys and values expanded per head from the
    latent (kv_b_proj), the shared RoPE key broadcast to every head; then the MLP."""
    eps, heads = d["rms_norm_eps"], d["num_attention_heads"]
    dn, dr, dv, r = d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"], d["kv_lora_rank"]
    b, t, _ = x.shape
    a = pre + "self_attn."
    hx = _rms(x, w[pre + "input_layernorm.weight"], eps)
    if d.get("q_lora_rank"):
        q = _rms(hx @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps) @ w[a + "q_b_proj.weight"].T
    else:
        q = hx @ w[a + "q_proj.weight"].T
    q = q.reshape(b, t, heads, dn + dr)
    ckv = hx @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent = _rms(ckv[..., :r], w[a + "kv_a_layernorm.weight"], eps)
    kv = (latent @ w[a + "kv_b_proj.weight"].T).reshape(b, t, heads, dn + dv)
    inv, mscale, attn_factor = _yarn(d, dr)
    k_pe = _rope_pairs(ckv[..., None, r:], pos, inv, mscale)
    q = np.concatenate([q[..., :dn], _rope_pairs(q[..., dn:], pos, inv, mscale)], -1)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_pe, (b, t, heads, dr))], -1)
    keys, values, kpos = _cached(past, k, kv[..., dn:], pos)
    o = _attend(q, keys, values, pos, kpos, (dn + dr) ** -0.5 * attn_factor)
    h = x + o.reshape(b, t, heads * dv) @ w[a + "o_proj.weight"].T
    m = _rms(h, w[pre + "post_attention_layernorm.weight"], eps)
    layer = int(pre.split(".")[2])
    routed = (d.get("n_routed_experts") is not None and layer >= (d.get("first_k_dense_replace") or 0)
              and layer % (d.get("moe_layer_freq") or 1) == 0)
    return h + (_grouped_moe(d, w, pre + "mlp.", m) if routed else _swiglu(m, w, pre + "mlp.")), (keys, values, kpos)


def _gqa_layer(d: dict[str, Any], w: dict[str, np.ndarray], pre: str, x: np.ndarray, pos: np.ndarray,
               past: tuple | None, *, kind: str) -> tuple[np.ndarray, tuple]:
    """The GQA decoder layers: GLM-4.5's (q/k/v biases, per-head q/k RMSNorms, RoPE on the
    first partial_rotary_factor of each head), Qwen3-Next / Qwen3.5's gated attention (each
    head's query followed by its output gate in q_proj; q/k norms; partial RoPE; the output
    times sigmoid(gate); RMSNorms as 1 + w) and Qwen2's (MiMo: q/k/v biases, whole RoPE);
    then the layer's MLP."""
    eps, heads, kvh = d["rms_norm_eps"], d["num_attention_heads"], d["num_key_value_heads"]
    hd = d.get("head_dim") or d["hidden_size"] // heads
    b, t, _ = x.shape
    qwen = kind in _QWEN

    def norm(v: np.ndarray, name: str) -> np.ndarray:
        return _rms(v, (1.0 + w[name]) if qwen else w[name], eps)

    a = pre + "self_attn."

    def proj(name: str, v: np.ndarray) -> np.ndarray:
        y = v @ w[a + name + ".weight"].T
        return y + w[a + name + ".bias"] if a + name + ".bias" in w else y

    hx = norm(x, pre + "input_layernorm.weight")
    q = proj("q_proj", hx)
    gate = None
    if qwen:
        q = q.reshape(b, t, heads, 2 * hd)
        q, gate = q[..., :hd], q[..., hd:].reshape(b, t, heads * hd)
    q = q.reshape(b, t, heads, hd)
    k, v = proj("k_proj", hx).reshape(b, t, kvh, hd), proj("v_proj", hx).reshape(b, t, kvh, hd)
    if a + "q_norm.weight" in w:
        q, k = norm(q, a + "q_norm.weight"), norm(k, a + "k_norm.weight")
    if kind in ("qwen3_5_text", "qwen3_5_moe_text"):
        rp = d["rope_parameters"]
        theta, frac = rp["rope_theta"], rp["partial_rotary_factor"]
    else:
        theta, frac = d["rope_theta"], (d.get("partial_rotary_factor", 1.0) if kind != "mimo" else 1.0)
    dims = int(hd * frac)
    q, k = _rope_halves(q, pos, dims, theta), _rope_halves(k, pos, dims, theta)
    keys, values, kpos = _cached(past, k, v, pos)
    o = _attend(q, keys, values, pos, kpos, hd ** -0.5).reshape(b, t, heads * hd)
    if gate is not None:
        o = o * _sigmoid(gate)
    h = x + proj("o_proj", o)
    m = norm(h, pre + "post_attention_layernorm.weight")
    if pre + "mlp.gate.weight" not in w:
        y = _swiglu(m, w, pre + "mlp.")
    elif kind == "glm4_moe":
        y = _grouped_moe(d, w, pre + "mlp.", m)
    else:
        y = _softmax_moe(d, w, pre + "mlp.", m)
    return h + y, (keys, values, kpos)


def reference_step(kind: str, d: dict[str, Any], tensors: dict[str, Any], hidden: np.ndarray, tokens: np.ndarray,
                   pos: np.ndarray, past: tuple | None = None, *, own_tables: bool = False,
                   mask_first: bool | None = None) -> dict[str, Any]:
    """Module 0's step from the published equations. d: the target's config.json (for
    qwen3_5_text its text config); tensors: checkpoint tensors by published name; hidden
    [B, T, H] (the target's state at each position, or a chained step's own), tokens
    [B, T] (the token after each), pos [B, T] (the positions: the hidden's); past: the K/V
    of earlier steps (`past` of the previous result). own_tables: the module's own
    embed_tokens / shared_head.head (DeepSeek / GLM) instead of the target's. mask_first:
    zero the embedding at position 0 (None: as vLLM, all but Qwen3-Next; False: SGLang's).

    Returns logits [B, T, V], out (the layer's output, before the output norm), normed
    (after it), fed (what vLLM feeds a chained step: out for DeepSeek / GLM, normed for
    Qwen3-Next / MiMo) and past."""
    w = {n: np.asarray(a.astype(mx.float32) if isinstance(a, mx.array) else a, np.float64) for n, a in tensors.items()}
    eps = d["rms_norm_eps"]
    pre = mtp_prefix(kind, d)
    nextn = kind in ("deepseek_v3", "glm4_moe")
    table = w[pre + "embed_tokens.weight"] if nextn and own_tables else w["model.embed_tokens.weight"]
    head = w[pre + "shared_head.head.weight"] if nextn and own_tables else w["lm_head.weight"]
    e = table[tokens]
    if mask_first if mask_first is not None else kind not in _QWEN:
        # vLLM's deepseek_mtp / glm4_moe_mtp / mimo_mtp: inputs_embeds[positions == 0] = 0
        e = np.where((pos == 0)[..., None], 0.0, e)
    if nextn:  # DeepSeek-V3 / GLM-4.5: eh_proj([enorm(e); hnorm(h)])
        x = np.concatenate([_rms(e, w[pre + "enorm.weight"], eps), _rms(hidden, w[pre + "hnorm.weight"], eps)], -1)
        x = x @ w[pre + "eh_proj.weight"].T
        out_norm = w[pre + "shared_head.norm.weight"]
    elif kind == "mimo":  # input_proj([hidden_layernorm(h); token_layernorm(e)]): hidden first
        x = np.concatenate([_rms(hidden, w[pre + "hidden_layernorm.weight"], eps),
                            _rms(e, w[pre + "token_layernorm.weight"], eps)], -1) @ w[pre + "input_proj.weight"].T
        out_norm = w[pre + "final_layernorm.weight"]
    else:  # Qwen3-Next / Qwen3.5: fc([pre_fc_norm_embedding(e); pre_fc_norm_hidden(h)]), norms 1 + w
        x = np.concatenate([_rms(e, 1.0 + w["mtp.pre_fc_norm_embedding.weight"], eps),
                            _rms(hidden, 1.0 + w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].T
        out_norm = 1.0 + w["mtp.norm.weight"]
    if kind == "deepseek_v3":
        out, past = _deepseek_layer(d, w, pre, x, pos, past)
    else:
        out, past = _gqa_layer(d, w, pre, x, pos, past, kind=kind)
    normed = _rms(out, out_norm, eps)
    return {"logits": normed @ head.T, "out": out, "normed": normed, "fed": out if nextn else normed, "past": past}


# ---------------------------------------------------------------- GGUF (llama.cpp's glm4moe NextN layers)


def _finish(w: Any, names: Any, arrays: dict[str, np.ndarray], path: Any) -> Any:
    """The remaining tensors under gguf-py's names for the architecture, then the file."""
    for name, x in sorted(arrays.items()):
        w.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_expert_stacks(w: Any, arrays: dict[str, np.ndarray], i: int, experts: int) -> None:
    """Layer i's routed experts (taken out of `arrays`) as llama.cpp writes them: each
    projection stacked as blk.{i}.ffn_{gate,up,down}_exps, the selection bias as
    blk.{i}.exp_probs_b.bias."""
    m = f"model.layers.{i}.mlp."
    for proj in ("gate_proj", "up_proj", "down_proj"):
        keys = [f"{m}experts.{j}.{proj}.weight" for j in range(experts)]
        if keys[0] in arrays:
            w.add_tensor(f"blk.{i}.ffn_{proj.split('_')[0]}_exps.weight", np.stack([arrays.pop(k) for k in keys]))
    bias = arrays.pop(m + "gate.e_score_correction_bias", None)
    if bias is not None:
        w.add_tensor(f"blk.{i}.exp_probs_b.bias", bias)


def write_glm4moe_mtp_gguf(path: Any, cfg: dict[str, Any], tensors: dict[str, mx.array]) -> Any:
    """A GGUF of a tiny GLM-4.5 (`tiny_mtp_config("glm4_moe")`) holding its MTP layers as
    llama.cpp's converter writes them: architecture glm4moe, block_count counting the NextN
    layers, `glm4moe.nextn_predict_layers`, the layer's tensors under gguf-py's names
    (blk.{N}.nextn.eh_proj / enorm / hnorm / shared_head_norm / shared_head_head /
    embed_tokens, the usual attention names, experts stacked as ffn_*_exps, the selection
    bias as exp_probs_b.bias). Only the MTP layers and the target's tables are written (the
    trunk is not needed to read them). float32 tensors; returns the path."""
    import gguf

    n_main = cfg["num_hidden_layers"]
    n = cfg.get("num_nextn_predict_layers", 1)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n_main + n)
    w = gguf.GGUFWriter(str(path), "glm4moe")
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    ints = {"context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
            "block_count": n_main + n, "feed_forward_length": cfg["intermediate_size"],
            "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
            "attention.key_length": hd, "attention.value_length": hd,
            "rope.dimension_count": int(hd * cfg["partial_rotary_factor"]), "expert_count": cfg["n_routed_experts"],
            "expert_used_count": cfg["num_experts_per_tok"], "expert_shared_count": cfg["n_shared_experts"],
            "expert_feed_forward_length": cfg["moe_intermediate_size"],
            "leading_dense_block_count": cfg["first_k_dense_replace"], "expert_gating_func": 2,
            "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
            "nextn_predict_layers": n, "vocab_size": cfg["vocab_size"]}
    for key, value in ints.items():
        w.add_uint32(f"glm4moe.{key}", value)
    w.add_float32("glm4moe.attention.layer_norm_rms_epsilon", float(cfg["rms_norm_eps"]))
    w.add_float32("glm4moe.rope.freq_base", float(cfg["rope_theta"]))
    w.add_float32("glm4moe.expert_weights_scale", float(cfg["routed_scaling_factor"]))
    w.add_bool("glm4moe.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    arrays = {k: np.asarray(v.astype(mx.float32)) for k, v in tensors.items()}
    for i in range(n_main, n_main + n):
        _add_expert_stacks(w, arrays, i, cfg["n_routed_experts"])
    return _finish(w, names, arrays, path)


def write_deepseek2_mtp_gguf(path: Any, cfg: dict[str, Any], tensors: dict[str, mx.array], *,
                             split_kv_b: bool = True) -> Any:
    """A GGUF of a tiny DeepSeek-V3 (`tiny_mtp_config("deepseek_v3")`) holding its MTP layer as
    newer llama.cpp converters write deepseek2 (GLM-4.7-Flash, DeepSeek V3.2, and their
    MTP-only files): block_count counting the NextN layers, `deepseek2.nextn_predict_layers`,
    the layer's MLA tensors under deepseek2's names (kv_b split into attn_k_b [H, r, dn] and
    attn_v_b [H, dv, r] with the MLA key/value lengths, or kept whole), experts stacked as
    ffn_*_exps, shared experts as ffn_*_shexp, the selection bias as exp_probs_b.bias, and
    blk.{N}.nextn.{eh_proj, enorm, hnorm, shared_head_norm, shared_head_head, embed_tokens}.
    `tensors`: Hugging Face names (the module's layer and whatever else to write: the
    tables, trunk layers). float32 tensors; returns the path."""
    import gguf

    n_main, n = cfg["num_hidden_layers"], cfg.get("num_nextn_predict_layers", 1)
    h, e = cfg["num_attention_heads"], cfg["n_routed_experts"]
    dn, dr, dv, r = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, n_main + n)
    w = gguf.GGUFWriter(str(path), "deepseek2")
    ys = cfg["rope_scaling"]
    md: dict[str, Any] = {
        "context_length": cfg["max_position_embeddings"], "embedding_length": cfg["hidden_size"],
        "block_count": n_main + n, "feed_forward_length": cfg["intermediate_size"], "attention.head_count": h,
        "attention.layer_norm_rms_epsilon": float(cfg["rms_norm_eps"]), "rope.freq_base": float(cfg["rope_theta"]),
        "attention.q_lora_rank": cfg["q_lora_rank"], "attention.kv_lora_rank": r, "rope.dimension_count": dr,
        "expert_count": e, "expert_used_count": cfg["num_experts_per_tok"],
        "expert_shared_count": cfg["n_shared_experts"], "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "leading_dense_block_count": cfg["first_k_dense_replace"],
        "expert_weights_scale": float(cfg["routed_scaling_factor"]), "expert_gating_func": 2,
        "expert_group_count": cfg["n_group"], "expert_group_used_count": cfg["topk_group"],
        "rope.scaling.factor": float(ys["factor"]),
        "rope.scaling.original_context_length": ys["original_max_position_embeddings"],
        "rope.scaling.yarn_log_multiplier": 0.1 * float(ys["mscale_all_dim"]), "nextn_predict_layers": n,
        "vocab_size": cfg["vocab_size"]}
    if split_kv_b:  # MLA as one shared KV head over the latent
        md.update({"attention.head_count_kv": 1, "attention.key_length": r + dr, "attention.value_length": r,
                   "attention.key_length_mla": dn + dr, "attention.value_length_mla": dv})
    else:
        md.update({"attention.head_count_kv": h, "attention.key_length": dn + dr, "attention.value_length": dv})
    for key, value in md.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"deepseek2.{key}", value)
    w.add_bool("deepseek2.expert_weights_norm", bool(cfg["norm_topk_prob"]))
    w.add_string("deepseek2.rope.scaling.type", "yarn")
    arrays = {k: np.asarray(v.astype(mx.float32)) for k, v in tensors.items()}
    nextn = {"eh_proj.weight": "eh_proj", "enorm.weight": "enorm", "hnorm.weight": "hnorm",
             "shared_head.norm.weight": "shared_head_norm", "shared_head.head.weight": "shared_head_head",
             "embed_tokens.weight": "embed_tokens"}
    for i in range(n_main + n):
        m = f"model.layers.{i}."
        _add_expert_stacks(w, arrays, i, e)
        kv_b = arrays.pop(m + "self_attn.kv_b_proj.weight", None)
        if kv_b is not None and split_kv_b:
            x = kv_b.reshape(h, dn + dv, r)
            w.add_tensor(f"blk.{i}.attn_k_b.weight", np.ascontiguousarray(x[:, :dn].transpose(0, 2, 1)))
            w.add_tensor(f"blk.{i}.attn_v_b.weight", np.ascontiguousarray(x[:, dn:]))
        elif kv_b is not None:
            w.add_tensor(f"blk.{i}.attn_kv_b.weight", kv_b)
        for hf, gg in nextn.items():  # (gguf-py's deepseek2 map may lack the NextN names)
            if m + hf in arrays:
                w.add_tensor(f"blk.{i}.nextn.{gg}.weight", arrays.pop(m + hf))
    return _finish(w, names, arrays, path)


# ---------------------------------------------------------------- target checkpoints that ship their modules


def write_mtp_target(folder: Any, kind: str = "deepseek_v3", *, seed: int = 0, module_seed: int | None = None,
                     **config: Any) -> Any:
    """A tiny target folder of format `kind`'s family (deepseek_v3, glm4_moe, qwen3_next) whose
    checkpoint also holds its MTP module under the published names, as the real checkpoints
    store it (DeepSeek-V3 / GLM-4.5: model.layers.{N}.* with the copies of the tables;
    Qwen3-Next: mtp.*): random module weights. `config` overrides config.json fields.
    Returns the folder."""
    import json
    from pathlib import Path

    from fx_engine.testing.tiny import write_tiny_model

    extra = {"num_nextn_predict_layers": 1} if kind in ("deepseek_v3", "glm4_moe") else {}
    folder = write_tiny_model(Path(folder), kind, seed=seed, **{**extra, **config})
    d = json.loads((folder / "config.json").read_text())
    trunk = dict(mx.load(str(folder / "model.safetensors")))
    module = tiny_mtp_tensors(kind, d, seed=seed + 1 if module_seed is None else module_seed)
    for k in range(max(1, int(d.get("num_nextn_predict_layers") or 1))):
        pre = mtp_prefix(kind, d, k)
        if kind in ("deepseek_v3", "glm4_moe"):  # the copies of the target's own tables
            module[pre + "embed_tokens.weight"] = trunk["model.embed_tokens.weight"]
            module[pre + "shared_head.head.weight"] = trunk.get("lm_head.weight", trunk["model.embed_tokens.weight"])
    own = {n: a for n, a in module.items() if n not in ("model.embed_tokens.weight", "lm_head.weight")}
    mx.save_safetensors(str(folder / "model.safetensors"), {**trunk, **own}, metadata={"format": "mlx"})
    return folder


def write_nextn_export(target: Any, folder: Any) -> Any:
    """SGLang's NextN export of a DeepSeek-V3 target folder (its scripts/export_deepseek_nextn.py's
    layout): the target's other files copied, config.json with num_hidden_layers 1 and
    architectures ["DeepseekV3ForCausalLMNextN"], the MTP layer's tensors renamed from
    model.layers.{N}.* to model.layers.0.* without its copies of the tables (embed_tokens,
    shared_head.head) in nextn_layer_parameters.safetensors, and an index naming them.
    Returns the folder."""
    import json
    import shutil
    from pathlib import Path

    target, folder = Path(target), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy2(f, folder / f.name)
    d = json.loads((target / "config.json").read_text())
    pre = f"model.layers.{d['num_hidden_layers']}."
    tensors = {}
    for f in sorted(target.glob("*.safetensors")):
        for name, a in mx.load(str(f)).items():
            if name.startswith(pre) and "embed_tokens" not in name and "shared_head.head" not in name:
                tensors["model.layers.0." + name[len(pre):]] = a
    mx.save_safetensors(str(folder / "nextn_layer_parameters.safetensors"), tensors, metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "nextn_layer_parameters.safetensors" for n in tensors}}))
    (folder / "config.json").write_text(json.dumps({**d, "num_hidden_layers": 1,
                                                    "architectures": ["DeepseekV3ForCausalLMNextN"]}, indent=2))
    return folder


def write_mtp_echo_target(folder: Any, *, seed: int = 0, scale: float = 1e-5) -> Any:
    """A tiny DeepSeek-V3 target with an MTP module whose first draft is always right and whose
    chained drafts are wrong: for tests that need both accepted and rejected drafts.

    The embedding table pairs tokens 2i and 2i + 1 through R (e(2i + 1) = R e(2i), R flipping
    the sign of the second half of the features: an involution, so e(pi(x)) = R e(x) with pi
    swapping 2i and 2i + 1). The target's layers add nothing (o_proj, down_proj zero), its
    final norm is 1 and its head maps x to pi(x): greedy output alternates x, pi(x), x, ...
    The module's layer adds nothing too and its eh_proj is scale * [R, 3 R]: the first step
    over the target's pair (h_t = norm(e(x_t)), x_{t+1}) is dominated by 3 R norm(h_t) ~
    e(x_{t+1}), so it drafts pi(x_{t+1}) = x_{t+2} (right). A chained step's hidden state is
    the module's own pre-norm output, `scale` small: far below sqrt(rms_norm_eps), hnorm
    leaves it near zero, the embedding path R e(d) of its previous draft d = x_{t+2} = x_t
    dominates and it drafts pi(pi(x_t)) = x_t again, where x_{t+3} = pi(x_t) (wrong).
    Returns the folder."""
    import json
    from pathlib import Path

    from fx_engine.testing.tiny import write_tiny_model

    folder = write_tiny_model(Path(folder), "deepseek_v3", seed=seed, num_nextn_predict_layers=1,
                              tie_word_embeddings=False)
    d = json.loads((folder / "config.json").read_text())
    h, v, n = d["hidden_size"], d["vocab_size"], d["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    flip = np.concatenate([np.ones(h // 2), -np.ones(h - h // 2)])
    base = rng.normal(0.0, 1.0, (v // 2, h))
    table = np.empty((v, h))
    table[0::2], table[1::2] = base, base * flip
    swap = np.arange(v).reshape(-1, 2)[:, ::-1].reshape(-1)
    w = dict(mx.load(str(folder / "model.safetensors")))
    w["model.embed_tokens.weight"] = mx.array(table.astype(np.float32))
    w["lm_head.weight"] = mx.array(table[swap].astype(np.float32))
    w["model.norm.weight"] = mx.ones((h,))
    pre = f"model.layers.{n}."
    module = {k: a for k, a in tiny_mtp_tensors("deepseek_v3", d, seed=seed + 1).items() if k.startswith(pre)}
    r = np.diag(flip)
    module.update({pre + "enorm.weight": mx.ones((h,)), pre + "hnorm.weight": mx.ones((h,)),
                   pre + "shared_head.norm.weight": mx.full((h,), 100.0),
                   pre + "eh_proj.weight": mx.array((scale * np.concatenate([r, 3 * r], axis=1)).astype(np.float32)),
                   pre + "embed_tokens.weight": w["model.embed_tokens.weight"],
                   pre + "shared_head.head.weight": w["lm_head.weight"]})
    w.update(module)
    for name in list(w):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            w[name] = mx.zeros_like(w[name])
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "mlx"})
    return folder
