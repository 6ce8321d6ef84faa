"""Falcon-H1 (`falcon_h1`): every layer runs a Mamba-2 mixer and attention side by side on the
same normalized input (their outputs added to the residual), then a SwiGLU MLP; following
mlx-lm 0.32's falcon_h1.py (the parity oracle) where it agrees with the model's reference
(below). Each layer has two cache entries: the
mixer's recurrent state and the attention's K/V.

muP multipliers: Hugging Face checkpoints keep them apart from the weights; mlx-lm folds
them into the weights when it converts one (it detects an unconverted checkpoint by its
[C, 1, K] conv weights), and so does this reader: the embedding, q/k/v/o, the mixer's in_proj
(per block of rows: z, x, B, C, dt) and out_proj, the MLP's gate and down projections. The
tied output head is then scaled by lm_head_multiplier / embedding_multiplier.

Where mlx-lm parts from the model's reference (Hugging Face's FalconH1, which llama.cpp's
converter and graph follow too), this reader follows the reference: k is scaled by
key_multiplier (mlx-lm folds it into a `key_proj` tensor no checkpoint has, so its k runs
unscaled), v by attention_in_multiplier (Hugging Face scales the attention's input), the
mixer's gated norm runs per B/C group, and a config without mamba_norm_before_gate
normalizes before the gate (Hugging Face's default). An already converted (mlx-lm) folder is
read as its weights stand.

GGUF: llama.cpp's falcon-h1 files (`config_from_gguf`, `assemble_gguf`), whose converter
(FalconH1Model) folds the multipliers into the tensors as Hugging Face runs them (except a
tied head: without an output tensor llama.cpp's logits are the scaled embedding's, and so
are fx-engine's from the file), and runs the mixers' gated norm after the gate whatever
mamba_norm_before_gate said (its graph has no other order; the file does not say).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors,
                                       renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, POSITIVE, ConfigError, Field, check_rope_scaling, gguf_hf_config,
                                   gguf_value, listed_eos,
                                   positive_int, read_fields)
from fx_engine.core.models.blocks import HF_LAYER, Attention, DenseMlp, config_rope, self_attention, swiglu_mlp
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.models.skeleton import DecoderParams, cut_layers, decoder_step, stage_logits
from fx_engine.core.models.ssm import (MixerDims, MixerParams, gguf_mixer_names, gguf_mixer_source, mixer, mixer_layout,
                                       read_mixer)
from fx_engine.core.nn import Linear, linear, rms_norm
from fx_engine.core.splits import head_range, split_attention, split_head, split_mixer, split_mlp


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
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5
    mlp_multipliers: tuple[float, ...] = (1.0, 1.0)


_MULTIPLIERS = ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier", "attention_out_multiplier",
                "key_multiplier", "ssm_in_multiplier", "ssm_out_multiplier")
# config.json's fields (read in this order; `read_fields`)
_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads"), Field("mamba_n_heads"), Field("mamba_d_head"),
    Field("rms_norm_eps", FLOAT, 1e-5), Field("mamba_n_groups", POSITIVE, 1), Field("mamba_d_state"),
    Field("mamba_d_conv", POSITIVE, 4), Field("vocab_size"), Field("num_hidden_layers"), Field("intermediate_size"),
    Field("rope_theta", FLOAT, 1e11), Field("rope_traditional", BOOL, False),
    Field("max_position_embeddings", INT, 131072), Field("tie_word_embeddings", BOOL, True),
    Field("attention_bias", BOOL, False), Field("mlp_bias", BOOL, False), Field("mamba_proj_bias", BOOL, False),
    Field("mamba_conv_bias", BOOL, True), *(Field(k, FLOAT, 1.0) for k in _MULTIPLIERS),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> FalconH1Config:
    f = read_fields(d, _FIELDS, source)
    hidden, heads, mheads, mhd = f["hidden_size"], f["num_attention_heads"], f["mamba_n_heads"], f["mamba_d_head"]
    if int(d.get("mamba_d_ssm") or mheads * mhd) != mheads * mhd:
        raise ConfigError(f"{source}: mamba_d_ssm must equal mamba_n_heads * mamba_d_head")
    if bool(d.get("mamba_proj_bias", False)) != bool(d.get("projectors_bias", False)):
        raise ConfigError(f"{source}: mamba_proj_bias != projectors_bias is not supported")
    eps = f["rms_norm_eps"]
    mode = "gate" if not d.get("mamba_rms_norm", False) else (
        "norm_gate" if bool(d.get("mamba_norm_before_gate", True)) else "gate_norm")
    lim = d.get("time_step_limit") or (0.0, math.inf)  # (Hugging Face's clamp of the time step)
    try:
        lo, hi = (float(v) for v in lim)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: time_step_limit must be a pair of numbers, got {lim!r}") from None
    mix = MixerDims(hidden=hidden, heads=mheads, head_dim=mhd, groups=f["mamba_n_groups"], state=f["mamba_d_state"],
                    kernel=f["mamba_d_conv"], norm_eps=eps, norm_mode=mode, norm_groups=f["mamba_n_groups"],
                    dt_min=lo, dt_max=hi)
    sm, mm = tuple(d.get("ssm_multipliers") or (1.0,) * 5), tuple(d.get("mlp_multipliers") or (1.0, 1.0))
    if len(sm) != 5 or len(mm) != 2:
        raise ConfigError(f"{source}: ssm_multipliers must have 5 entries and mlp_multipliers 2")
    return FalconH1Config(
        model_type="falcon_h1", vocab_size=f["vocab_size"], hidden_size=hidden, num_layers=f["num_hidden_layers"],
        num_heads=heads, num_kv_heads=positive_int(d.get("num_key_value_heads") or heads, "num_key_value_heads", source),
        head_dim=int(d.get("head_dim") or hidden // heads), intermediate_size=f["intermediate_size"],
        rms_norm_eps=eps, rope_theta=f["rope_theta"], rope_traditional=f["rope_traditional"],
        rope_scaling=check_rope_scaling(d.get("rope_scaling"), source),
        max_position_embeddings=f["max_position_embeddings"], tie_word_embeddings=f["tie_word_embeddings"],
        qkv_bias=f["attention_bias"], mlp_bias=f["mlp_bias"], bos_token_id=d.get("bos_token_id"),
        eos_token_ids=listed_eos(d), mixer=mix, mamba_bias=f["mamba_proj_bias"], conv_bias=f["mamba_conv_bias"],
        ssm_multipliers=sm, mlp_multipliers=mm, **{k: f[k] for k in _MULTIPLIERS},
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
    """Same contract as `skeleton.decoder_step`: per layer the mixer and attention side by
    side on one normalized input, then a SwiGLU MLP."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = config_rope(cfg, geo.positions, getattr(mx, p.dtype))
        entries = list(cache.layers)
        for i, lp in enumerate(p.layers):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
            m, entries[2 * i] = mixer(lp.mamba, cfg.mixer, x, entries[2 * i], cache.layout[2 * i], geo, num)
            a, entries[2 * i + 1] = self_attention(p, lp.attn, x, entries[2 * i + 1], cache.layout[2 * i + 1], rope,
                                                   geo)
            h = h + m + a
            h = h + swiglu_mlp(rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num), lp.mlp.gate_up, lp.mlp.down, num)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


def hidden_to_logits(p: FalconH1Params, h: mx.array) -> mx.array:
    cfg = p.config

    def logits() -> mx.array:
        if p.lm_head is not None:
            return linear(h, p.lm_head, p.numerics).astype(mx.float32)
        out = linear(h, p.embed, p.numerics)
        return (out * (cfg.lm_head_multiplier / cfg.embedding_multiplier)).astype(mx.float32)

    return stage_logits(p, h, logits)


def _scaled(lin: Linear, inp: float = 1.0, out: float = 1.0) -> Linear:
    """A dense Linear for Hugging Face's `layer(x * inp) * out`: the weight times inp * out,
    the bias times out."""
    if lin.quantized:
        raise ConfigError("falcon_h1: an unconverted checkpoint (multipliers not folded in) must be dense")
    w = (lin.weight.astype(mx.float32) * (inp * out)).astype(lin.weight.dtype)
    b = None if lin.bias is None else (lin.bias.astype(mx.float32) * out).astype(lin.bias.dtype)
    return attrs.evolve(lin, weight=w, bias=b, origin=())  # no adapter may target it


# Each layer's norms from its tensors under model.layers.{i}. (`read_tensors`); its linears
# are read in `assemble`, each times its muP multiplier where the checkpoint has not folded
# it in (`_scaled`), its mixer by `read_mixer`
NORMS = (Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
         Vec("mlp_norm", "pre_ff_layernorm.weight", "hidden_size"))


def assemble(cfg: FalconH1Config, src: TensorSource, opts: LoadOptions) -> FalconH1Params:
    hid, d, mix = cfg.hidden_size, cfg.head_dim, cfg.mixer
    hq, hk = cfg.num_heads * d, cfg.num_kv_heads * d
    conv = src.get("model.layers.0.mamba.conv1d.weight")
    fold = conv.shape[-1] > conv.shape[1]  # Hugging Face's [C, 1, K]: the multipliers are not in the weights
    if fold:  # the mixer's in_proj rows: z, x, B, C, dt blocks, each with its multiplier
        sizes = (mix.inner, mix.inner, mix.groups * mix.state, mix.groups * mix.state, mix.heads)
        mup = mx.concatenate([mx.full((n,), m) for n, m in zip(sizes, cfg.ssm_multipliers)])
        src = _folded_mixers(src, mup, cfg.ssm_in_multiplier, cfg.ssm_out_multiplier)
    rd = Reader(src, opts)

    def lin(name: str, out_f: int, in_f: int, b: bool = False, inp: float = 1.0, out: float = 1.0) -> Linear:
        """A linear as stored, with its muP multipliers (on its input, on its output) where
        the checkpoint has not folded them in."""
        raw = rd.raw(name, out_f, in_f, b)
        return _scaled(raw, inp, out) if fold and (inp, out) != (1.0, 1.0) else raw

    def layer(i: int) -> FalconH1Layer:
        p = HF_LAYER.format(i=i)
        a, f, ab = p + "self_attn.", p + "feed_forward.", cfg.qkv_bias
        ai, ff = cfg.attention_in_multiplier, cfg.intermediate_size
        return FalconH1Layer(
            **read_tensors(rd, NORMS, cfg, HF_LAYER, i),
            mamba=read_mixer(src, p + "mamba.", mix, opts, cfg.mamba_bias, cfg.conv_bias),
            # (Hugging Face: the attention's input times attention_in_multiplier, k times
            # key_multiplier, its output times attention_out_multiplier)
            attn=Attention(qkv=rd.fused([lin(a + "q_proj", hq, hid, ab, inp=ai),
                                         lin(a + "k_proj", hk, hid, ab, inp=ai, out=cfg.key_multiplier),
                                         lin(a + "v_proj", hk, hid, ab, inp=ai)]),
                           o=rd.finish(lin(a + "o_proj", hid, hq, ab, out=cfg.attention_out_multiplier))),
            mlp=DenseMlp(gate_up=rd.fused([lin(f + "gate_proj", ff, hid, cfg.mlp_bias, out=cfg.mlp_multipliers[0]),
                                           lin(f + "up_proj", ff, hid, cfg.mlp_bias)]),
                         down=rd.finish(lin(f + "down_proj", hid, ff, cfg.mlp_bias, out=cfg.mlp_multipliers[1]))))

    head = None
    if not cfg.tie_word_embeddings:
        head = rd.finish(lin("lm_head", cfg.vocab_size, hid, False, out=cfg.lm_head_multiplier))
    return FalconH1Params(
        embed=rd.finish(lin("model.embed_tokens", cfg.vocab_size, hid, False, out=cfg.embedding_multiplier),
                        table=True),
        layers=tuple(layer(i) for i in range(cfg.num_layers)), norm=rd.vec("model.final_layernorm.weight", hid),
        lm_head=head, config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _folded_mixers(src: TensorSource, mup: mx.array, ssm_in: float, ssm_out: float) -> TensorSource:
    """A copy of `src` (the same arrays) whose mixers carry their multipliers (an unconverted
    checkpoint, dense), as Hugging Face runs them: in_proj(x * ssm_in) * mup (per row: the z,
    x, B, C, dt blocks), out_proj(y) * ssm_out."""
    out = TensorSource()
    out.tensors, out.origin = dict(src.tensors), src.origin
    for name, w in src.tensors.items():
        kind = next((k for k in ("in_proj", "out_proj") if name.endswith(f"mamba.{k}.weight")
                     or name.endswith(f"mamba.{k}.bias")), None)
        if kind is None:
            continue
        if w.dtype == mx.uint32:
            raise ConfigError("falcon_h1: an unconverted checkpoint (multipliers not folded in) must be dense")
        weight = name.endswith(".weight")
        if kind == "in_proj":
            s = mup * (ssm_in if weight else 1.0)
            s = s[:, None] if weight else s
        else:
            s = ssm_out
        out.tensors[name] = (w.astype(mx.float32) * s).astype(w.dtype)
    return out


# llama.cpp's names (convert_hf_to_gguf.py's FalconH1Model: Mamba2Model's mixers, q/k not
# permuted: Falcon-H1 rotates halves) -> Hugging Face's. The MLP's norm is blk.N.ffn_norm
# with no .weight (gguf-py maps the whole name pre_ff_layernorm.weight; llama.cpp's loader
# asks for it so)
GGUF_TO_HF = (
    *gguf_mixer_names("mamba"), (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.ffn_norm(\.weight)?$", ".pre_ff_layernorm.weight"),
    (r"\.ffn_(gate|up|down)\.", r".feed_forward.\1_proj."), (r"^output_norm\.", "model.final_layernorm."),
    *GGUF_COMMON_NAMES,
)


def config_from_gguf(md: dict[str, Any], source: str) -> FalconH1Config:
    """Falcon-H1 from llama.cpp's falcon-h1 metadata: the attention's sizes, the mixers'
    ssm.* sizes (time_step_rank: the mixers' heads); the multipliers are in the tensors
    (1 here), the time step unclamped (llama.cpp's scan)."""
    arch = "falcon-h1"

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    d = gguf_hf_config(md, arch, source, "falcon_h1", rope_theta=1e11)
    inner, heads = int(val("ssm.inner_size")), int(val("ssm.time_step_rank"))
    if not heads or inner % heads:
        raise ConfigError(f"{source}: {arch}.ssm.inner_size ({inner}) is not a multiple of "
                          f"{arch}.ssm.time_step_rank ({heads}, the mixers' heads)")
    d.update(mamba_d_ssm=inner, mamba_n_heads=heads, mamba_d_head=inner // heads,
             mamba_n_groups=int(val("ssm.group_count", 1) or 1), mamba_d_state=int(val("ssm.state_size")),
             mamba_d_conv=int(val("ssm.conv_kernel")), mamba_rms_norm=True, mamba_norm_before_gate=False)
    return config_from_hf(d, source)


def assemble_gguf(cfg: FalconH1Config, src: TensorSource, opts: LoadOptions) -> FalconH1Params:
    """Params from llama.cpp's tensors (the multipliers already in them): the mixers' vectors
    reshaped (`ssm.gguf_mixer_source`); the gated norm, the biases and the tied head as the
    tensors say; the vocabulary the embedding's rows."""
    src = gguf_mixer_source(renamed(src, GGUF_TO_HF))
    p = "model.layers.0."
    mix = attrs.evolve(cfg.mixer, norm_mode="gate_norm" if src.has(p + "mamba.norm.weight") else "gate")
    cfg = attrs.evolve(cfg, mixer=mix, tie_word_embeddings=not src.has("lm_head.weight"),
                       vocab_size=int(src.get("model.embed_tokens.weight").shape[0]),
                       qkv_bias=src.has(p + "self_attn.q_proj.bias"), mlp_bias=src.has(p + "feed_forward.gate_proj.bias"),
                       mamba_bias=src.has(p + "mamba.in_proj.bias"), conv_bias=src.has(p + "mamba.conv1d.bias"))
    return assemble(cfg, src, opts)


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
            if cfg.qkv_bias:
                out[p + "self_attn." + n + ".bias"] = TensorSpec(shape[:1], scale=0.05)
        for n, shape in (("gate_proj", (ff, hid)), ("up_proj", (ff, hid)), ("down_proj", (hid, ff))):
            out[p + "feed_forward." + n + ".weight"] = TensorSpec(shape)
            if cfg.mlp_bias:
                out[p + "feed_forward." + n + ".bias"] = TensorSpec(shape[:1], scale=0.05)
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
            "mlp_multipliers": [0.88, 0.59], "bos_token_id": 1, "eos_token_id": 2,
            # key_multiplier 1, one group: where mlx-lm (the registry's parity oracle) parts from
            # Hugging Face (tests/models/test_ssm_reference.py checks other values)
            "key_multiplier": 1.0,
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
    gguf_architectures=("falcon-h1",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
