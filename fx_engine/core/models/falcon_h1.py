"""Falcon-H1 (`falcon_h1`): every layer runs a Mamba-2 mixer and attention side by side on the
same normalized input (their outputs added to the residual), then a SwiGLU MLP; following
mlx-lm 0.32's falcon_h1.py (the parity oracle). Each layer has two cache entries: the
mixer's recurrent state and the attention's K/V.

muP multipliers: Hugging Face checkpoints keep them apart from the weights; mlx-lm folds
them into the weights when it converts one (it detects an unconverted checkpoint by its
[C, 1, K] conv weights), and so does this reader: the embedding, q/k/o, the mixer's in_proj
(per block of rows: z, x, B, C, dt) and out_proj, the MLP's gate and down projections. The
tied output head is then scaled by lm_head_multiplier / embedding_multiplier.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced
from fx_engine.core.checkpoint import LoadOptions, TensorSource, TensorSpec, finish, fuse, read_linear
from fx_engine.core.config import ConfigError, positive_int, required
from fx_engine.core.models.family import DecoderParams, Family, cut_layers, stage_input, stage_logits, stage_output
from fx_engine.core.models.llama import LlamaConfig, self_attention
from fx_engine.core.models.mamba2 import MixerDims, MixerParams, mixer, mixer_layout, read_mixer
from fx_engine.core.models.nemotron_h import Attention
from fx_engine.core.models.qwen3_next import DenseMlp
from fx_engine.core.nn import Linear, embed, linear, rms_norm, rope_tables, swiglu_fused
from fx_engine.core.parallel import head_range, split_attention, split_head, split_mixer, split_mlp


@attrs.frozen
class FalconH1Config(LlamaConfig):
    mixer: MixerDims = None  # type: ignore[assignment]
    mamba_bias: bool = False
    conv_bias: bool = True
    # muP multipliers (folded into an unconverted checkpoint's weights at load)
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> FalconH1Config:
    hidden = positive_int(required(d, "hidden_size", source), "hidden_size", source)
    heads = positive_int(required(d, "num_attention_heads", source), "num_attention_heads", source)
    mheads = positive_int(required(d, "mamba_n_heads", source), "mamba_n_heads", source)
    mhd = positive_int(required(d, "mamba_d_head", source), "mamba_d_head", source)
    if int(d.get("mamba_d_ssm") or mheads * mhd) != mheads * mhd:
        raise ConfigError(f"{source}: mamba_d_ssm must equal mamba_n_heads * mamba_d_head")
    if bool(d.get("mamba_proj_bias", False)) != bool(d.get("projectors_bias", False)):
        raise ConfigError(f"{source}: mamba_proj_bias != projectors_bias is not supported")
    if d.get("key_multiplier") not in (None,) and d.get("key_proj") is not None:
        raise ConfigError(f"{source}: a separate key_proj is not supported")
    eps = float(d.get("rms_norm_eps", 1e-5))
    mode = "gate" if not d.get("mamba_rms_norm", False) else (
        "norm_gate" if d.get("mamba_norm_before_gate", False) else "gate_norm")
    mix = MixerDims(hidden=hidden, heads=mheads, head_dim=mhd,
                    groups=positive_int(d.get("mamba_n_groups", 1), "mamba_n_groups", source),
                    state=positive_int(required(d, "mamba_d_state", source), "mamba_d_state", source),
                    kernel=positive_int(d.get("mamba_d_conv", 4), "mamba_d_conv", source), norm_eps=eps,
                    norm_mode=mode)
    sm, mm = tuple(d.get("ssm_multipliers") or (1.0,) * 5), tuple(d.get("mlp_multipliers") or (1.0, 1.0))
    if len(sm) != 5 or len(mm) != 2:
        raise ConfigError(f"{source}: ssm_multipliers must have 5 entries and mlp_multipliers 2")
    eos = d.get("eos_token_id")
    return FalconH1Config(
        model_type="falcon_h1", vocab_size=positive_int(required(d, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden, num_layers=positive_int(required(d, "num_hidden_layers", source), "num_hidden_layers", source),
        num_heads=heads, num_kv_heads=positive_int(d.get("num_key_value_heads") or heads, "num_key_value_heads", source),
        head_dim=int(d.get("head_dim") or hidden // heads),
        intermediate_size=positive_int(required(d, "intermediate_size", source), "intermediate_size", source),
        rms_norm_eps=eps, rope_theta=float(d.get("rope_theta", 1e11)),
        rope_traditional=bool(d.get("rope_traditional", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)), qkv_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)), bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else (),
        mixer=mix, mamba_bias=bool(d.get("mamba_proj_bias", False)), conv_bias=bool(d.get("mamba_conv_bias", True)),
        embedding_multiplier=float(d.get("embedding_multiplier", 1.0)),
        lm_head_multiplier=float(d.get("lm_head_multiplier", 1.0)),
        attention_in_multiplier=float(d.get("attention_in_multiplier", 1.0)),
        attention_out_multiplier=float(d.get("attention_out_multiplier", 1.0)),
        ssm_in_multiplier=float(d.get("ssm_in_multiplier", 1.0)),
        ssm_out_multiplier=float(d.get("ssm_out_multiplier", 1.0)), ssm_multipliers=sm, mlp_multipliers=mm,
    )


@attrs.frozen
class FalconH1Layer:
    attn_norm: mx.array
    mamba: MixerParams
    attn: Attention
    mlp_norm: mx.array
    mlp: DenseMlp


@attrs.frozen
class FalconH1Params(DecoderParams):
    """Its params (the type names the family)."""


def cache_specs(cfg: FalconH1Config) -> tuple[LayerSpec, ...]:
    """Two entries per layer: the mixer's state, then the attention's K/V."""
    out: list[LayerSpec] = []
    for _ in range(cfg.num_layers):
        out += [cfg.mixer.state_spec(), LayerSpec(cfg.num_kv_heads, cfg.head_dim)]
    return tuple(out)


def forward(p: FalconH1Params, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `fx_engine.core.models.llama.forward`."""
    cfg, num = p.config, p.numerics
    b, t = tokens.shape
    dt = getattr(mx, p.dtype)
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    h = stage_input(p, b * t, lambda: embed(tokens.reshape(-1), p.embed).astype(dt))
    cos, sin, perm = rope_tables(geo.positions, cfg.head_dim, base=cfg.rope_theta, scale=1.0, freqs=None,
                                 traditional=cfg.rope_traditional)
    rope = (cos.astype(dt), sin.astype(dt), perm.astype(dt))
    entries = list(cache.layers)
    for i, lp in enumerate(p.layers):
        x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
        m, entries[2 * i] = mixer(lp.mamba, cfg.mixer, x, entries[2 * i], cache.layout[2 * i], geo, num)
        a, entries[2 * i + 1] = self_attention(p, lp.attn, x, entries[2 * i + 1], cache.layout[2 * i + 1], rope, geo)
        h = h + m + a
        x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
        h = h + linear(swiglu_fused(linear(x, lp.mlp.gate_up, num), num), lp.mlp.down, num)
    handed = stage_output(p, h)
    if handed is not None:  # a pipeline stage before the last
        return handed.reshape(b, t, -1), advanced(cache, entries, geo)
    h = rms_norm(h, p.norm, cfg.rms_norm_eps, num)
    return h.reshape(b, t, -1), advanced(cache, entries, geo)


def hidden_to_logits(p: FalconH1Params, h: mx.array) -> mx.array:
    cfg = p.config

    def logits() -> mx.array:
        if p.lm_head is not None:
            return linear(h, p.lm_head, p.numerics).astype(mx.float32)
        out = linear(h, p.embed, p.numerics)
        return (out * (cfg.lm_head_multiplier / cfg.embedding_multiplier)).astype(mx.float32)

    return stage_logits(p, h, logits)


def _scaled(lin: Linear, s: Any) -> Linear:
    """A dense Linear's rows times s (a number, or one per output row)."""
    if lin.quantized:
        raise ConfigError("falcon_h1: an unconverted checkpoint (multipliers not folded in) must be dense")
    s = mx.array(s, mx.float32) if not isinstance(s, mx.array) else s
    w = lin.weight.astype(mx.float32) * (s[:, None] if s.ndim else s)
    return attrs.evolve(lin, weight=w.astype(lin.weight.dtype), origin=())  # no adapter may target it


def assemble(cfg: FalconH1Config, src: TensorSource, opts: LoadOptions) -> FalconH1Params:
    dtype, keep, where = opts.dtype, opts.keep_quantized, opts.where
    hid, d, mix = cfg.hidden_size, cfg.head_dim, cfg.mixer
    hq, hk = cfg.num_heads * d, cfg.num_kv_heads * d
    conv = src.get("model.layers.0.mamba.conv1d.weight")
    fold = conv.shape[-1] > conv.shape[1]  # Hugging Face's [C, 1, K]: the multipliers are not in the weights

    def lin(name: str, out_f: int, in_f: int, b: bool = False, mult: Any = None) -> Linear:
        raw = read_linear(src, name, out_f, in_f, opts.quant_for(name), b, where)
        return _scaled(raw, mult) if fold and mult is not None else raw

    if fold:  # the mixer's in_proj rows: z, x, B, C, dt blocks, each with its multiplier
        sizes = (mix.inner, mix.inner, mix.groups * mix.state, mix.groups * mix.state, mix.heads)
        mup = mx.concatenate([mx.full((n,), m * cfg.ssm_in_multiplier) for n, m in zip(sizes, cfg.ssm_multipliers)])
        src = _folded_mixers(src, mup, cfg.ssm_out_multiplier)
    layers = []
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, f, ab = p + "self_attn.", p + "feed_forward.", cfg.qkv_bias
        ai, ff = cfg.attention_in_multiplier, cfg.intermediate_size
        layers.append(FalconH1Layer(
            attn_norm=src.get(p + "input_layernorm.weight", (hid,), where).astype(dtype),
            mamba=read_mixer(src, p + "mamba.", mix, opts, cfg.mamba_bias, cfg.conv_bias),
            attn=Attention(qkv=fuse([lin(a + "q_proj", hq, hid, ab, ai), lin(a + "k_proj", hk, hid, ab, ai),
                                     lin(a + "v_proj", hk, hid, ab)], dtype, keep),
                           o=finish(lin(a + "o_proj", hid, hq, ab, cfg.attention_out_multiplier), dtype, keep)),
            mlp_norm=src.get(p + "pre_ff_layernorm.weight", (hid,), where).astype(dtype),
            mlp=DenseMlp(gate_up=fuse([lin(f + "gate_proj", ff, hid, cfg.mlp_bias, cfg.mlp_multipliers[0]),
                                       lin(f + "up_proj", ff, hid, cfg.mlp_bias)], dtype, keep),
                         down=finish(lin(f + "down_proj", hid, ff, cfg.mlp_bias, cfg.mlp_multipliers[1]), dtype, keep))))
    head = None
    if not cfg.tie_word_embeddings:
        head = finish(lin("lm_head", cfg.vocab_size, hid, False, cfg.lm_head_multiplier), dtype, keep)
    return FalconH1Params(
        embed=finish(lin("model.embed_tokens", cfg.vocab_size, hid, False, cfg.embedding_multiplier), dtype, keep,
                     table=True),
        layers=tuple(layers), norm=src.get("model.final_layernorm.weight", (hid,), where).astype(dtype),
        lm_head=head, config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _folded_mixers(src: TensorSource, mup: mx.array, out_mult: float) -> TensorSource:
    """A copy of `src` (the same arrays) whose mixers' in_proj rows and out_proj carry
    their multipliers (an unconverted checkpoint, dense)."""
    out = TensorSource()
    out.tensors, out.origin = dict(src.tensors), src.origin
    for name, w in src.tensors.items():
        if name.endswith("mamba.in_proj.weight") or name.endswith("mamba.out_proj.weight"):
            if w.dtype == mx.uint32:
                raise ConfigError("falcon_h1: an unconverted checkpoint (multipliers not folded in) must be dense")
            s = mup[:, None] if name.endswith("in_proj.weight") else out_mult
            out.tensors[name] = (w.astype(mx.float32) * s).astype(w.dtype)
    return out


def checkpoint_layout(cfg: FalconH1Config) -> dict[str, TensorSpec]:
    hid, d = cfg.hidden_size, cfg.head_dim
    hq, hk, ff = cfg.num_heads * d, cfg.num_kv_heads * d, cfg.intermediate_size
    norm = TensorSpec((hid,), center=1.0, scale=0.1)
    out = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, hid), scale=0.5), "model.final_layernorm.weight": norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((cfg.vocab_size, hid))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "pre_ff_layernorm.weight"] = norm
        out.update(mixer_layout(p + "mamba.", cfg.mixer, cfg.mamba_bias, cfg.conv_bias))
        for n, shape in (("q_proj", (hq, hid)), ("k_proj", (hk, hid)), ("v_proj", (hk, hid)), ("o_proj", (hid, hq))):
            out[p + "self_attn." + n + ".weight"] = TensorSpec(shape)
        for n, shape in (("gate_proj", (ff, hid)), ("up_proj", (ff, hid)), ("down_proj", (hid, ff))):
            out[p + "feed_forward." + n + ".weight"] = TensorSpec(shape)
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "falcon_h1", "architectures": ["FalconH1ForCausalLM"], "vocab_size": 384, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_d_state": 16,
            "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_rms_norm": True, "mamba_norm_before_gate": False,
            "mamba_conv_bias": True, "mamba_proj_bias": False, "projectors_bias": False, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": True,
            "embedding_multiplier": 2.0, "lm_head_multiplier": 0.5, "attention_in_multiplier": 1.0,
            "attention_out_multiplier": 0.9375, "ssm_in_multiplier": 1.25,
            "ssm_multipliers": [0.35, 0.25, 0.35, 0.5, 0.35], "ssm_out_multiplier": 0.24,
            "mlp_multipliers": [0.88, 0.59], "key_multiplier": 0.39, "bos_token_id": 1, "eos_token_id": 2,
            **overrides}

def layer_range(p: FalconH1Params, start: int, end: int) -> FalconH1Params:
    """The params of layers [start, end) (`family.cut_layers`)."""
    return cut_layers(p, start, end)


def tensor_split(p: FalconH1Params, rank: int, size: int) -> FalconH1Params:
    """Rank `rank` of `size`'s shard (core/parallel.py): each layer's mixer and attention
    heads (their outputs summed over the ranks, each), MLP features, the vocabulary."""
    cfg = p.config
    q0, q1, k0, k1 = head_range(cfg.num_heads, cfg.num_kv_heads, rank, size)
    layers, dims = [], cfg.mixer
    for i, lp in enumerate(p.layers):
        name = f"layer {i}"
        m, dims = split_mixer(lp.mamba, cfg.mixer, rank, size, name)
        layers.append(attrs.evolve(lp, mamba=m, mlp=split_mlp(lp.mlp, rank, size, name),
                                   attn=split_attention(lp.attn, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                        rank, size, name)))
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, mixer=dims)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=small), rank, size)


FAMILY = Family(
    name="falcon_h1", model_types=("falcon_h1",), config_type=FalconH1Config, params_type=FalconH1Params,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
)
