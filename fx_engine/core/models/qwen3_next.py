"""Qwen3-Next (`qwen3_next`): Gated DeltaNet linear attention on three of every four layers,
gated full attention on the fourth, routed experts with a gated shared expert; following
mlx-lm 0.32's qwen3_next.py + gated_delta.py (the parity oracle).

Gated DeltaNet layer (`gated_deltanet`):
    q, k, v, z (grouped per key head), b, a = in_proj_qkvz(x), in_proj_ba(x)
    q, k, v = silu(causal_conv([q; k; v]));  q, k l2-normalized (q also times dk^-0.5)
    beta = sigmoid(b);  g = exp(-exp(A_log) * softplus(a + dt_bias))
    S = g S + beta (v - g S k) k^T;  o = S q  (value head h reads key head h // (nv / nk))
    out = out_proj(rms_norm(o) * silu(z))  (per value head)
Its cache entry holds the conv window and S [nv, dv, dk] (float32); prefill runs the
blockwise delta-rule solve (`core.recurrent.gated_delta_scan`).
Attention layers: q_proj gives each head's queries and an output gate side by side; q/k
RMSNorms per head; RoPE on the first partial_rotary_factor of each head; the output times
sigmoid(gate). Norm weights: Hugging Face stores Qwen3-Next's RMSNorms as 1 + w; mlx-lm
folds the 1 in when it converts (it detects an unconverted checkpoint by its per-expert
tensors, and so does this reader).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

import fx_engine.core.models.llama as llama
from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, attend_entry, recurrent_entry, write_entry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, WeightsError, read_experts, read_tensors, renamed)
from fx_engine.core.config import (BOOL, INT, INT_OR_ZERO, ConfigError, Field, gguf_hf_config, gguf_value,
                                   read_fields)
from fx_engine.core.models.blocks import (HF_EXPERT_NAMES, HF_LAYER, STACKED_EXPERT_NAMES, SWIGLU_MLP, DenseMlp,
                                          Experts, apply_partial_rope, attention_sizes, expert_stacks, mixture,
                                          config_rope, read_shared_expert, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.moe import MoEConfig
from fx_engine.core.models.skeleton import DecoderParams, cut_layers, decoder_step, head_logits
from fx_engine.core.models.ssm import conv_weight
from fx_engine.core.nn import Linear, Quant, linear, rms_norm
from fx_engine.core.splits import head_range, split, split_cols, split_experts, split_head, split_mlp, split_rows
from fx_engine.core.recurrent import causal_conv, gated_delta_scan


@attrs.frozen
class Qwen3NextConfig(MoEConfig):
    linear_layers: tuple[bool, ...] = ()  # per layer: Gated DeltaNet (else full attention)
    lin_k_heads: int = 1
    lin_v_heads: int = 1
    lin_k_dim: int = 1
    lin_v_dim: int = 1
    conv_kernel: int = 4
    # Qwen3.5 ("qwen3_5_text" / "qwen3_5_moe_text", the text model of qwen3_5 / qwen3_5_moe):
    # the same model with separate q|k|v, z, b, a projections, MoE on every layer or none
    qwen3_5: bool = False
    # out_proj's input columns in llama.cpp's tiled value-head order (its qwen35 / qwen35moe
    # GGUFs with fewer key than value heads: column block j * nk + i is value head i * r + j,
    # for ggml's broadcast); the forward permutes the values to match (`gated_deltanet`)
    lin_out_tiled: bool = False

    @property
    def key_dim(self) -> int:
        return self.lin_k_heads * self.lin_k_dim

    @property
    def value_dim(self) -> int:
        return self.lin_v_heads * self.lin_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


# its own config.json fields (`read_fields`, in this order; the attention's:
# llama.config_from_hf), by Qwen3NextConfig's names
_FIELDS = (
    Field("num_hidden_layers"), Field("full_attention_interval", default=4),
    Field("linear_num_key_heads", to="lin_k_heads"), Field("linear_num_value_heads", to="lin_v_heads"),
    Field("linear_key_head_dim", to="lin_k_dim"), Field("linear_value_head_dim", to="lin_v_dim"),
    Field("linear_conv_kernel_dim", to="conv_kernel"), Field("num_experts", INT_OR_ZERO, 0),
    Field("decoder_sparse_step", default=1, or_default=True), Field("num_experts_per_tok", INT, 1, or_default=True,
                                                                    to="top_k"),
    # (Hugging Face: Qwen3NextConfig's default True; Qwen3.5-MoE always renormalizes and has
    # no such field: its published configs leave it out)
    Field("moe_intermediate_size", INT_OR_ZERO, 0), Field("norm_topk_prob", BOOL, True),
    Field("shared_expert_intermediate_size", INT_OR_ZERO, 0),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Qwen3NextConfig:
    f = read_fields(d, _FIELDS, source)
    layers, interval, step, experts = (f.pop(k) for k in ("num_hidden_layers", "full_attention_interval",
                                                           "decoder_sparse_step", "num_experts"))
    v35 = d["model_type"] in ("qwen3_5_text", "qwen3_5_moe_text")
    if d["model_type"] == "qwen3_5_moe_text":
        f["norm_topk_prob"] = True  # (Hugging Face's Qwen3.5-MoE router renormalizes whatever a config says)
        if d.get("intermediate_size") is None:  # (no dense MLP: its configs have no such field)
            d = {**d, "intermediate_size": f["moe_intermediate_size"] or f["shared_expert_intermediate_size"]}
    # (rope_theta / partial_rotary_factor / rope_scaling as hf_config.normalize lifts them from
    # rope_parameters; Qwen3.5's M-RoPE sections: 1-D RoPE for text, so none of them read)
    scaling = {k: v for k, v in (d.get("rope_scaling") or {}).items() if not k.startswith("mrope")}
    d = {**d, "rope_parameters": None, "rope_scaling": scaling or None,
         "head_dim": d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]}
    prf = float(d.get("partial_rotary_factor", 1.0))
    base = llama.config_from_hf({k: v for k, v in d.items() if k not in ("partial_rotary_factor", "layer_types")}
                                | {"model_type": "qwen3"}, source)
    if f["lin_v_heads"] % f["lin_k_heads"]:
        raise ConfigError(f"{source}: linear_num_value_heads ({f['lin_v_heads']}) is not a multiple of "
                          f"linear_num_key_heads ({f['lin_k_heads']})")
    if f["conv_kernel"] < 2:
        raise ConfigError(f"{source}: linear_conv_kernel_dim must be >= 2")
    # Qwen3.5: experts on every layer or none; Qwen3-Next: every step-th, but mlp_only_layers
    dense = [] if v35 else (d.get("mlp_only_layers") or [])
    return Qwen3NextConfig(
        **{**attrs.asdict(base, recurse=False), "model_type": d["model_type"]}, **f, qwen3_5=v35,
        num_experts=max(experts, 1), softmax_then_topk=True,
        moe_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(layers)),
        rope_dims=int(base.head_dim * prf), linear_layers=tuple((i + 1) % interval != 0 for i in range(layers)),
    )


@attrs.frozen
class DeltaNet:
    qkvz: Linear
    ba: Linear
    conv_w: mx.array  # [conv_dim, K]
    dt_bias: mx.array  # [nv] float32
    a: mx.array  # exp(A_log) [nv] float32
    norm: mx.array  # [dv]
    out_proj: Linear


@attrs.frozen
class GatedAttention:
    q: Linear  # [heads * 2 * head_dim, H]: each head's queries, then its gate
    kv: Linear  # fused [k; v]
    o: Linear
    q_norm: mx.array
    k_norm: mx.array


@attrs.frozen
class Qwen3NextLayer:
    attn_norm: mx.array
    mixer: Any  # DeltaNet | GatedAttention
    mlp_norm: mx.array
    mlp: Any  # blocks.Experts | blocks.DenseMlp


@attrs.frozen
class Qwen3NextParams(DecoderParams):
    """Its params (the type names the family)."""


def cache_specs(cfg: Qwen3NextConfig) -> tuple[LayerSpec, ...]:
    return tuple(
        LayerSpec(0, 0, state=((cfg.conv_kernel - 1, cfg.conv_dim), (cfg.lin_v_heads, cfg.lin_v_dim, cfg.lin_k_dim)),
                  state_dtypes=("", "float32")) if lin else LayerSpec(cfg.num_kv_heads, cfg.head_dim)
        for lin in cfg.linear_layers)


def gated_deltanet(p: Qwen3NextParams, lp: DeltaNet, x: mx.array, entry: Any, spec: LayerSpec,
                   geo: StepGeometry) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    nk, dk, nv, dv = cfg.lin_k_heads, cfg.lin_k_dim, cfg.lin_v_heads, cfg.lin_v_dim
    r = nv // nk
    qkvz = linear(x, lp.qkvz, num).reshape(b, t, nk, 2 * dk + 2 * r * dv)
    q, k = qkvz[..., :dk], qkvz[..., dk : 2 * dk]
    v = qkvz[..., 2 * dk : 2 * dk + r * dv].reshape(b, t, nv * dv)
    z = qkvz[..., 2 * dk + r * dv :].reshape(b, t, nv, dv)
    ba = linear(x, lp.ba, num).reshape(b, t, nk, 2 * r)
    beta_in, a_in = ba[..., :r].reshape(b, t, nv), ba[..., r:].reshape(b, t, nv)
    mixed = mx.concatenate([q.reshape(b, t, nk * dk), k.reshape(b, t, nk * dk), v], axis=-1)
    valid = geo.valid
    conv_state, s_state = entry.arrays
    conv, conv_new, conv_steps = causal_conv(mx.where(valid[..., None], mixed, 0.0), conv_state, lp.conv_w,
                                             geo.n_valid, geo.keep_steps)
    conv = conv * mx.sigmoid(conv)
    f32 = mx.float32
    qh = conv[..., : nk * dk].reshape(b, t, nk, dk).astype(f32)
    kh = conv[..., nk * dk : 2 * nk * dk].reshape(b, t, nk, dk).astype(f32)
    vh = conv[..., 2 * nk * dk :].reshape(b, t, nv, dv)
    qh = qh * mx.rsqrt(mx.sum(qh * qh, axis=-1, keepdims=True) + 1e-6) * dk**-0.5
    kh = kh * mx.rsqrt(mx.sum(kh * kh, axis=-1, keepdims=True) + 1e-6)
    if r > 1:
        qh, kh = mx.repeat(qh, r, axis=2), mx.repeat(kh, r, axis=2)
    beta = mx.where(valid[..., None], mx.sigmoid(beta_in.astype(f32)), 0.0)
    log_g = -lp.a * mx.logaddexp(a_in.astype(f32) + lp.dt_bias, 0.0)
    log_g = mx.where(valid[..., None], log_g, 0.0)
    o, s_new, s_steps = gated_delta_scan(qh, kh, vh, log_g, beta, s_state, geo.keep_steps)
    o = rms_norm(o.astype(x.dtype), lp.norm, cfg.rms_norm_eps)
    o = (z.astype(f32) * mx.sigmoid(z.astype(f32)) * o.astype(f32)).astype(x.dtype)
    if cfg.lin_out_tiled:  # value head i * r + j to column block j * nk + i (config field)
        o = o.reshape(b, t, nk, r, dv).swapaxes(2, 3)
    out = linear(o.reshape(b * t, nv * dv), lp.out_proj, num)
    steps = None if conv_steps is None else [conv_steps.astype(conv_state.dtype), s_steps]
    return out, recurrent_entry(spec, [conv_new.astype(conv_state.dtype), s_new], steps, geo)


def gated_attention(p: Qwen3NextParams, lp: GatedAttention, x: mx.array, entry: Any, spec: LayerSpec,
                    rope: Any, geo: StepGeometry) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    b, t = geo.positions.shape
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qg = linear(x, lp.q, num).reshape(b, t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(b * t, hq * d)
    kv = linear(x, lp.kv, num).reshape(b, t, 2 * hk, d)
    qk = mx.concatenate([rms_norm(q, lp.q_norm, cfg.rms_norm_eps), rms_norm(kv[:, :, :hk], lp.k_norm, cfg.rms_norm_eps)],
                        axis=2)
    qk = apply_partial_rope(qk, rope, d, num, False)
    entry = write_entry(entry, spec, qk[:, :, hq:].transpose(0, 2, 1, 3), kv[:, :, hk:].transpose(0, 2, 1, 3), geo, num)
    o = attend_entry(entry, spec, qk[:, :, :hq], geo, d**-0.5, num)
    return linear(o.reshape(b * t, hq * d) * mx.sigmoid(gate), lp.o, num), entry


def forward(p: Qwen3NextParams, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `skeleton.decoder_step`: per layer Gated DeltaNet or gated attention,
    then routed experts or a dense SwiGLU MLP, each a pre-norm residual branch."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = config_rope(cfg, geo.positions, getattr(mx, p.dtype), cfg.rope_dims)
        entries = []
        for lp, entry, spec in zip(p.layers, cache.layers, cache.layout):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
            if isinstance(lp.mixer, DeltaNet):
                a, entry = gated_deltanet(p, lp.mixer, x, entry, spec, geo)
            else:
                a, entry = gated_attention(p, lp.mixer, x, entry, spec, rope, geo)
            h = h + a
            x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
            if isinstance(lp.mlp, Experts):
                h = h + mixture(cfg, lp.mlp, x, num)
            else:
                h = h + swiglu_mlp(x, lp.mlp.gate_up, lp.mlp.down, num)
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


hidden_to_logits = head_logits


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): the
# norms (RMSNorms stored as w of 1 + w in an unconverted checkpoint: `norm_offset` added);
# the mixer, gated attention under self_attn. (q with its gate, q/k/v biases where the
# config says) or a gated DeltaNet under linear_attn. (Qwen3.5's four input projections
# regrouped, `_qwen3_5_qkvz` / `_qwen3_5_ba`; its conv and decay in `_delta_net`); the MLP, dense
# (`SWIGLU_MLP`) or routed (`_read_experts`). The whole model's: the head where untied and
# stored.
NORMS = (Vec("attn_norm", "input_layernorm.weight", "hidden_size", plus="norm_offset"),
         Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size", plus="norm_offset"))
ATTENTION = (
    Lin("q", "q_proj", "gated_q_width", "hidden_size", bias="qkv_bias"),
    Fused("kv", (("k_proj", "kv_width"), ("v_proj", "kv_width")), "hidden_size", bias="qkv_bias"),
    Lin("o", "o_proj", "hidden_size", "q_width"),
    Vec("q_norm", "q_norm.weight", "head_dim", plus="norm_offset"),
    Vec("k_norm", "k_norm.weight", "head_dim", plus="norm_offset"),
)
DELTA_NET = (
    Lin("qkvz", "in_proj_qkvz", "qkvz_width", "hidden_size", when="qkvz_stored"),
    Lin("ba", "in_proj_ba", "ba_width", "hidden_size", when="ba_stored"),
    Vec("dt_bias", "dt_bias", "lin_v_heads", float32=True),
    Vec("norm", "norm.weight", "lin_v_dim", plus=0.0),  # (stored as w, not 1 + w)
    Lin("out_proj", "out_proj", "hidden_size", "value_dim"),
)
TOP = (Embedding("embed", "model.embed_tokens"), Vec("norm", "model.norm.weight", "hidden_size", plus="norm_offset"),
       Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="head_stored"))


def assemble(cfg: Qwen3NextConfig, src: TensorSource, opts: LoadOptions) -> Qwen3NextParams:
    return _assemble(cfg, src, opts, _norm_offset(cfg, src))


def _assemble(cfg: Qwen3NextConfig, src: TensorSource, opts: LoadOptions, norm_offset: float) -> Qwen3NextParams:
    rd = Reader(src, opts)
    sizes = {**attention_sizes(cfg), "norm_offset": norm_offset,
             "gated_q_width": 2 * cfg.num_heads * cfg.head_dim, "qkvz_width": 2 * cfg.key_dim + 2 * cfg.value_dim,
             "ba_width": 2 * cfg.lin_v_heads, "head_stored": not cfg.tie_word_embeddings and src.has("lm_head.weight")}

    def layer(i: int, is_lin: bool) -> Qwen3NextLayer:
        p = HF_LAYER.format(i=i)
        mixer = (_delta_net(cfg, rd, p + "linear_attn.", sizes) if is_lin
                 else GatedAttention(**read_tensors(rd, ATTENTION, cfg, p + "self_attn.", sizes=sizes)))
        mlp = (_read_experts(cfg, rd, p + "mlp.") if cfg.moe_layers[i]
               else DenseMlp(**read_tensors(rd, SWIGLU_MLP, cfg, HF_LAYER, i, sizes)))
        return Qwen3NextLayer(mixer=mixer, mlp=mlp, **read_tensors(rd, NORMS, cfg, HF_LAYER, i, sizes))

    return Qwen3NextParams(
        layers=tuple(layer(i, is_lin) for i, is_lin in enumerate(cfg.linear_layers)),
        **read_tensors(rd, TOP, cfg, sizes=sizes), config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _norm_offset(cfg: Qwen3NextConfig, src: TensorSource) -> float:
    """1.0 where the RMSNorms are stored as w of 1 + w (an unconverted Hugging Face
    checkpoint): mlx-lm's sanitize folds the 1 in when it sees one (Qwen3-Next: by its
    per-expert tensors; Qwen3.5: by its [C, 1, K] conv weights), and so does this reader."""
    if cfg.qwen3_5:
        convs = [f"model.layers.{i}.linear_attn.conv1d.weight" for i, lin in enumerate(cfg.linear_layers) if lin]
        return 1.0 if any(src.get(n).shape[-1] != 1 for n in convs[:1]) else 0.0
    return 1.0 if any(src.has(f"model.layers.{i}.mlp.experts.0.up_proj.weight")
                      for i in range(cfg.num_layers)) else 0.0


def _delta_net(cfg: Qwen3NextConfig, rd: Reader, a: str, sizes: dict[str, Any]) -> DeltaNet:
    """A gated DeltaNet mixer under `a` (linear_attn.): its table; Qwen3.5's projections
    (q|k|v and z, b and a: also llama.cpp's qwen3next layout) regrouped; the conv weight
    (either axis order, or squeezed) and the decay rates exp(A_log) (llama.cpp's files
    store -exp(A_log) itself: `decay`)."""
    src, where, nv = rd.src, rd.opts.where, cfg.lin_v_heads
    stored = {"qkvz_stored": src.has(a + "in_proj_qkvz.weight"), "ba_stored": src.has(a + "in_proj_ba.weight")}
    f = read_tensors(rd, DELTA_NET, cfg, a, sizes={**sizes, **stored})
    if not stored["qkvz_stored"]:
        f["qkvz"] = _qwen3_5_qkvz(cfg, a, rd)
    if not stored["ba_stored"]:
        f["ba"] = _qwen3_5_ba(cfg, a, rd)
    decay = (-src.get(a + "decay", (nv,), where).astype(mx.float32) if src.has(a + "decay")
             else mx.exp(src.get(a + "A_log", (nv,), where).astype(mx.float32)))
    if cfg.lin_out_tiled:  # an adapter's A factor reads the checkpoint's column order: refused by name
        f["out_proj"] = attrs.evolve(f["out_proj"], origin=((
            a + "out_proj (its columns are in llama.cpp's tiled value-head order, not the order an adapter's "
                "factors read)", cfg.hidden_size),))
    return DeltaNet(**f, conv_w=conv_weight(src, a + "conv1d.weight", cfg.conv_dim, cfg.conv_kernel, where)
                    .astype(rd.opts.dtype), a=decay)


def _read_experts(cfg: Qwen3NextConfig, rd: Reader, m: str) -> Experts:
    """A routed layer's experts under `m` (mlp.): Qwen3.5-MoE's fused gate_up_proj
    [E, 2F, H] (gate rows first), or mlx-lm's stacks / one tensor per expert; the router,
    the gated shared expert."""
    src, opts, e, f, hid = rd.src, rd.opts, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if src.has(m + "experts.gate_up_proj"):
        gu = src.get(m + "experts.gate_up_proj", (e, 2 * f, hid), opts.where)
        gate, up = Linear(weight=gu[:, :f]), Linear(weight=gu[:, f:])
        down = Linear(weight=src.get(m + "experts.down_proj", (e, hid, f), opts.where))
    else:
        gate, up, down = (read_experts(src, m + stacked, m + one, e, o, n, opts.quant_for, opts.where)
                          for stacked, one, (o, n) in zip(STACKED_EXPERT_NAMES, HF_EXPERT_NAMES,
                                                          ((f, hid), (f, hid), (hid, f))))
    shared = read_shared_expert(rd, hid, cfg.shared_expert_intermediate_size, m + "shared_expert.",
                                m + "shared_expert_gate", ("gate_proj", "up_proj", "down_proj"))
    return Experts(router=rd.linear(m + "gate", e, hid), **expert_stacks(gate, up, down, opts), **shared)


def _rows(lin: Linear, lo: int, hi: int) -> Linear:
    """Output rows [lo, hi) of a (dense or quantized, not yet finished) Linear."""
    cut = lambda a: None if a is None else a[lo:hi]  # noqa: E731
    q = lin.quant
    quant = None if q is None else Quant(cut(q.scales), cut(q.biases), q.group_size, q.bits, q.mode)
    return Linear(weight=lin.weight[lo:hi], bias=cut(lin.bias), quant=quant)


def _qwen3_5_qkvz(cfg: Qwen3NextConfig, a: str, rd: Reader) -> Linear:
    """Qwen3.5's in_proj_qkv (q | k | v) and in_proj_z regrouped into Qwen3-Next's in_proj_qkvz
    layout (per key head i: q_i, k_i, its r value heads' v, then their z): one forward for
    both."""
    hid, nk, dk, dv, kd = cfg.hidden_size, cfg.lin_k_heads, cfg.lin_k_dim, cfg.lin_v_dim, cfg.key_dim
    r = cfg.lin_v_heads // nk
    qkv = rd.raw(a + "in_proj_qkv", 2 * kd + cfg.value_dim, hid)
    z = rd.raw(a + "in_proj_z", cfg.value_dim, hid)
    parts = []
    for i in range(nk):
        v0 = 2 * kd + i * r * dv
        parts += [_rows(qkv, i * dk, (i + 1) * dk), _rows(qkv, kd + i * dk, kd + (i + 1) * dk),
                  _rows(qkv, v0, v0 + r * dv), _rows(z, i * r * dv, (i + 1) * r * dv)]
    return rd.fused(parts)


def _qwen3_5_ba(cfg: Qwen3NextConfig, a: str, rd: Reader) -> Linear:
    """Qwen3.5's in_proj_b and in_proj_a regrouped into in_proj_ba's layout (per key head i:
    its r value heads' b, then their a)."""
    hid, nk, nv = cfg.hidden_size, cfg.lin_k_heads, cfg.lin_v_heads
    r = nv // nk
    b, aa = rd.raw(a + "in_proj_b", nv, hid), rd.raw(a + "in_proj_a", nv, hid)
    return rd.fused([x for i in range(nk) for x in (_rows(b, i * r, (i + 1) * r), _rows(aa, i * r, (i + 1) * r))])


# llama.cpp's qwen3next / qwen35 / qwen35moe tensor names -> Hugging Face's (its converter,
# convert_hf_to_gguf.py's Qwen3NextModel and Qwen3_5TextModel / Qwen3_5MoeTextModel, writes
# Qwen3-Next's in_proj_qkvz as attn_qkv (q | k | v) + attn_gate (z), A_log as ssm_a =
# -exp(A_log) (read as `decay`), dt_bias as ssm_dt.bias, the conv weight squeezed to
# [C, K], every RMSNorm but the DeltaNet's as 1 + w, experts stacked; MTP layers: `mtp`)
GGUF_TO_HF = (
    (r"\.post_attention_norm\.", ".post_attention_layernorm."), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.attn_qkv\.", ".linear_attn.in_proj_qkv."), (r"\.attn_gate\.", ".linear_attn.in_proj_z."),
    (r"\.ssm_ba\.", ".linear_attn.in_proj_ba."), (r"\.ssm_beta\.", ".linear_attn.in_proj_b."),
    (r"\.ssm_alpha\.", ".linear_attn.in_proj_a."), (r"\.ssm_conv1d\.", ".linear_attn.conv1d."),
    (r"\.ssm_dt\.bias$", ".linear_attn.dt_bias"), (r"\.ssm_a(\.weight)?$", ".linear_attn.decay"),
    (r"\.ssm_norm\.", ".linear_attn.norm."), (r"\.ssm_out\.", ".linear_attn.out_proj."),
    (r"\.ffn_gate_inp_shexp\.", ".mlp.shared_expert_gate."), (r"\.ffn_gate_inp\.", ".mlp.gate."),
    (r"\.ffn_(gate|up|down)_exps\.", r".mlp.switch_mlp.\1_proj."),
    (r"\.ffn_(gate|up|down)_shexp\.", r".mlp.shared_expert.\1_proj."),
) + GGUF_COMMON_NAMES

GGUF_ARCHS = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}


def config_from_gguf(md: dict[str, Any], source: str) -> Qwen3NextConfig:
    """Qwen3-Next / Qwen3.5 / Qwen3.5-MoE from llama.cpp's qwen3next / qwen35 / qwen35moe
    metadata: the gated DeltaNet's sizes under ssm.* (group_count: key heads, time_step_rank:
    value heads, state_size: the key head width, inner_size: all value channels),
    full_attention_interval (or attention.recurrent_layers, per layer), the rotated share of
    each head as rope.dimension_count, experts as qwen2moe's keys; block_count counts the MTP
    (NextN) layers, which the trunk does not run (`config.trunk_layers`)."""
    arch = md.get("general.architecture")
    mt = GGUF_ARCHS[arch]

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    d = gguf_hf_config(md, arch, source, mt, rope_theta=10000000.0, ffn=False)
    hd = d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    nv, inner = int(val("ssm.time_step_rank")), int(val("ssm.inner_size"))
    if nv < 1 or inner % nv:
        raise ConfigError(f"{source}: {arch}.ssm.inner_size ({inner}) is not a multiple of {arch}.ssm.time_step_rank "
                          f"({nv}, the value heads)")
    experts = int(val("expert_count", 0) or 0) if arch != "qwen35" else 0
    d.update(linear_num_key_heads=int(val("ssm.group_count")), linear_num_value_heads=nv,
             linear_key_head_dim=int(val("ssm.state_size")), linear_value_head_dim=inner // nv,
             linear_conv_kernel_dim=int(val("ssm.conv_kernel")),
             full_attention_interval=int(val("full_attention_interval", 4)),
             partial_rotary_factor=int(val("rope.dimension_count", hd)) / hd, tie_word_embeddings=False,
             intermediate_size=int(val("feed_forward_length", 0) or val("expert_feed_forward_length", 0) or 1))
    if experts:
        d.update(num_experts=experts, num_experts_per_tok=int(val("expert_used_count")),
                 moe_intermediate_size=int(val("expert_feed_forward_length")),
                 shared_expert_intermediate_size=int(val("expert_shared_feed_forward_length", 0) or 0),
                 norm_topk_prob=bool(val("expert_weights_norm", True)))
    cfg = config_from_hf(d, source)
    pattern = val("attention.recurrent_layers", None)
    if pattern is not None:  # per layer (the trunk's; MTP layers are attention layers)
        flags = tuple(bool(x) for x in list(pattern)[: cfg.num_layers])
        if len(flags) != cfg.num_layers:
            raise ConfigError(f"{source}: {arch}.attention.recurrent_layers has {len(flags)} entries for "
                              f"{cfg.num_layers} layers")
        cfg = attrs.evolve(cfg, linear_layers=flags)
    return attrs.evolve(cfg, lin_out_tiled=arch != "qwen3next" and cfg.lin_k_heads != cfg.lin_v_heads)


def assemble_gguf(cfg: Qwen3NextConfig, src: TensorSource, opts: LoadOptions) -> Qwen3NextParams:
    """Params from llama.cpp's tensors (`GGUF_TO_HF`): the head tied where the file has no
    output.weight; qwen35's value heads put back in Hugging Face's grouped order
    (`grouped_value_heads`) but in ssm_out's columns (`Qwen3NextConfig.lin_out_tiled`)."""
    src = gguf_source(src, GGUF_TO_HF)
    cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight"))
    if cfg.lin_out_tiled:
        src = grouped_value_heads(cfg, src, [f"model.layers.{i}.linear_attn." for i, lin in
                                             enumerate(cfg.linear_layers) if lin])
    return _assemble(cfg, src, opts, 0.0)


def gguf_source(src: TensorSource, rules: tuple[tuple[str, str], ...]) -> TensorSource:
    """A GGUF's tensors under Hugging Face's names (`rules`: GGUF_TO_HF, with the MTP
    layers' before it), the shared experts' gates as [1, H] (llama.cpp reads them as
    vectors: a converter may write them so)."""
    out = renamed(src, rules)
    for name, t in out.tensors.items():
        if name.endswith("shared_expert_gate.weight") and t.ndim == 1:
            out.tensors[name] = t.reshape(1, -1)
    return out


def grouped_value_heads(cfg: Qwen3NextConfig, src: TensorSource, prefixes: list[str]) -> TensorSource:
    """The DeltaNet tensors under `prefixes` with their value heads back in grouped order
    (head i * r + j: key head i's j-th), from llama.cpp's tiled order (j * nk + i, which its
    qwen35 converter writes where nk < nv): the rows of in_proj_qkv's v part, in_proj_z,
    in_proj_b / in_proj_a, the conv's v channels, dt_bias and the decay. Row permutations
    only (quantized rows move with their scales): ssm_out's columns stay tiled."""
    nk, nv, dv, kd = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_v_dim, cfg.key_dim
    r = nv // nk
    heads = mx.array([(h % r) * nk + h // r for h in range(nv)])  # grouped head h <- tiled position
    chans = (heads[:, None] * dv + mx.arange(dv)[None]).reshape(-1)
    with_v = mx.concatenate([mx.arange(2 * kd), 2 * kd + chans])
    perms = {"in_proj_qkv.": with_v, "conv1d.weight": with_v, "in_proj_z.": chans, "in_proj_b.": heads,
             "in_proj_a.": heads, "dt_bias": heads, "decay": heads}
    out = TensorSource()
    out.tensors, out.origin = dict(src.tensors), dict(src.origin)
    for name, t in src.tensors.items():
        for a in prefixes:
            key = name[len(a):] if name.startswith(a) else None
            perm = next((p for k, p in perms.items() if key is not None and key.startswith(k)), None)
            if perm is not None:
                if t.shape[0] != perm.size:
                    raise WeightsError(f"{src.origin[name]}: tensor '{name}' has {t.shape[0]} rows, expected "
                                       f"{perm.size}")
                out.tensors[name] = mx.take(t, perm, axis=0)
    return out


def checkpoint_layout(cfg: Qwen3NextConfig) -> dict[str, TensorSpec]:
    """Hugging Face's names (experts one tensor each; RMSNorm weights as w of 1 + w)."""
    hid, d = cfg.hidden_size, cfg.head_dim
    hq, hk = cfg.num_heads * d, cfg.num_kv_heads * d
    zero_norm = TensorSpec((hid,), center=0.0, scale=0.1)
    out = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, hid), scale=0.5), "model.norm.weight": zero_norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((cfg.vocab_size, hid))
    for i, is_lin in enumerate(cfg.linear_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = zero_norm
        if is_lin:
            a = p + "linear_attn."
            if cfg.qwen3_5:
                out.update({a + "in_proj_qkv.weight": TensorSpec((2 * cfg.key_dim + cfg.value_dim, hid)),
                            a + "in_proj_z.weight": TensorSpec((cfg.value_dim, hid)),
                            a + "in_proj_b.weight": TensorSpec((cfg.lin_v_heads, hid)),
                            a + "in_proj_a.weight": TensorSpec((cfg.lin_v_heads, hid))})
            else:
                out.update({a + "in_proj_qkvz.weight": TensorSpec((2 * cfg.key_dim + 2 * cfg.value_dim, hid)),
                            a + "in_proj_ba.weight": TensorSpec((2 * cfg.lin_v_heads, hid))})
            out.update({
                        a + "conv1d.weight": TensorSpec((cfg.conv_dim, 1, cfg.conv_kernel), scale=0.3),
                        a + "dt_bias": TensorSpec((cfg.lin_v_heads,), center=0.5, scale=0.3),
                        a + "A_log": TensorSpec((cfg.lin_v_heads,), center=0.0, scale=0.5),
                        a + "norm.weight": TensorSpec((cfg.lin_v_dim,), center=1.0, scale=0.1),
                        a + "out_proj.weight": TensorSpec((hid, cfg.value_dim))})
        else:
            a = p + "self_attn."
            out.update({a + "q_proj.weight": TensorSpec((2 * hq, hid)), a + "k_proj.weight": TensorSpec((hk, hid)),
                        a + "v_proj.weight": TensorSpec((hk, hid)), a + "o_proj.weight": TensorSpec((hid, hq)),
                        a + "q_norm.weight": TensorSpec((d,), scale=0.1), a + "k_norm.weight": TensorSpec((d,), scale=0.1)})
        m = p + "mlp."
        if cfg.moe_layers[i]:
            e, f, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            out[m + "gate.weight"] = TensorSpec((e, hid), scale=0.3)
            if cfg.qwen3_5:  # fused, stacked
                out[m + "experts.gate_up_proj"] = TensorSpec((e, 2 * f, hid))
                out[m + "experts.down_proj"] = TensorSpec((e, hid, f))
            for j in range(0 if cfg.qwen3_5 else e):
                out[m + f"experts.{j}.gate_proj.weight"] = TensorSpec((f, hid))
                out[m + f"experts.{j}.up_proj.weight"] = TensorSpec((f, hid))
                out[m + f"experts.{j}.down_proj.weight"] = TensorSpec((hid, f))
            if s:
                out[m + "shared_expert.gate_proj.weight"] = TensorSpec((s, hid))
                out[m + "shared_expert.up_proj.weight"] = TensorSpec((s, hid))
                out[m + "shared_expert.down_proj.weight"] = TensorSpec((hid, s))
                out[m + "shared_expert_gate.weight"] = TensorSpec((1, hid))
        else:
            ff = cfg.intermediate_size
            out.update({m + "gate_proj.weight": TensorSpec((ff, hid)), m + "up_proj.weight": TensorSpec((ff, hid)),
                        m + "down_proj.weight": TensorSpec((hid, ff))})
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
        moe_type = model_type == "qwen3_5_moe_text"
        return {"model_type": model_type, "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 4,
                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
                "max_position_embeddings": 2048, "tie_word_embeddings": False, "full_attention_interval": 4,
                "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000.0,
                                    "partial_rotary_factor": 0.25},
                **({"num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 64,
                    "moe_intermediate_size": 32, "norm_topk_prob": True} if moe_type else {}),
                "bos_token_id": 1, "eos_token_id": 2, **overrides}
    return {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
            "linear_key_head_dim": 32, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
            "shared_expert_intermediate_size": 64, "mlp_only_layers": [], "moe_intermediate_size": 32,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
            "max_position_embeddings": 2048, "norm_topk_prob": True, "tie_word_embeddings": False,
            "full_attention_interval": 4, "bos_token_id": 1, "eos_token_id": 2, **overrides}

def layer_range(p: Qwen3NextParams, start: int, end: int) -> Qwen3NextParams:
    """The params of layers [start, end) (`family.cut_layers`)."""
    return cut_layers(p, start, end, per_layer=("linear_layers", "moe_layers"))


def tensor_split(p: Qwen3NextParams, rank: int, size: int) -> Qwen3NextParams:
    """Rank `rank` of `size`'s shard (core/parallel.py). Gated DeltaNet layers: a run of key
    heads with their value heads (their qkvz and ba rows, which the layout groups per key
    head; their conv channels, decay and output columns, summed); gated attention: KV heads
    with their query heads (q|gate rows per head); MLP and experts' intermediate features;
    the vocabulary."""
    cfg = p.config
    if cfg.lin_out_tiled and size > 1:
        raise ConfigError(f"tensor parallelism: this {cfg.model_type} model's DeltaNet output projections are in "
                          "llama.cpp's tiled value-head order (a qwen35 GGUF), which ranks cannot split by key "
                          "head; load its Hugging Face checkpoint to split it over ranks")
    q0, q1, k0, k1 = head_range(cfg.num_heads, cfg.num_kv_heads, rank, size)
    nk, dk, dv, d, hk = cfg.lin_k_heads, cfg.lin_k_dim, cfg.lin_v_dim, cfg.head_dim, cfg.num_kv_heads
    r = cfg.lin_v_heads // nk
    a0, a1 = split(nk, size, rank)  # key heads of the linear layers
    block = 2 * dk + 2 * r * dv  # one key head's rows of qkvz: q, k, its r values, their z
    conv = [(a0 * dk, a1 * dk), (nk * dk + a0 * dk, nk * dk + a1 * dk),
            (2 * nk * dk + a0 * r * dv, 2 * nk * dk + a1 * r * dv)]
    layers = []
    for i, lp in enumerate(p.layers):
        name, m = f"layer {i}", lp.mixer
        if isinstance(m, DeltaNet):
            m = attrs.evolve(m, qkvz=split_rows(m.qkvz, [(a0 * block, a1 * block)]),
                             ba=split_rows(m.ba, [(a0 * 2 * r, a1 * 2 * r)]),
                             conv_w=mx.concatenate([m.conv_w[a:b] for a, b in conv]),
                             dt_bias=m.dt_bias[a0 * r : a1 * r], a=m.a[a0 * r : a1 * r],
                             out_proj=split_cols(m.out_proj, a0 * r * dv, a1 * r * dv, f"{name} out_proj"))
        else:
            m = attrs.evolve(m, q=split_rows(m.q, [(q0 * 2 * d, q1 * 2 * d)]),
                             kv=split_rows(m.kv, [(k0 * d, k1 * d), (hk * d + k0 * d, hk * d + k1 * d)]),
                             o=split_cols(m.o, q0 * d, q1 * d, f"{name} o_proj"))
        mlp = split_experts(lp.mlp, rank, size, i) if isinstance(lp.mlp, Experts) else split_mlp(lp.mlp, rank, size, name)
        layers.append(attrs.evolve(lp, mixer=m, mlp=mlp))
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, lin_k_heads=a1 - a0,
                         lin_v_heads=(a1 - a0) * r)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=small), rank, size)


FAMILY = Family(
    name="qwen3_next", model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"), config_type=Qwen3NextConfig,
    params_type=Qwen3NextParams, wrappers={"qwen3_5": ("qwen3_5_text", {}), "qwen3_5_moe": ("qwen3_5_moe_text", {})},
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
    gguf_architectures=tuple(GGUF_ARCHS), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
