"""Phi-3 / Phi-3.5 / Phi-4-mini (`phi3`), following mlx-lm 0.32's phi3.py (the parity oracle)
where it agrees with the model's reference (not: longrope's short factors, below).

The decoder is the Llama family's (pre-norm attention and SwiGLU MLP, GQA); what is Phi's:
checkpoints store the projections already fused (`qkv_proj`, `gate_up_proj`); RoPE may rotate
only the first `partial_rotary_factor * head_dim` dims of each head (Phi-4-mini: 0.75); and
long-context checkpoints scale RoPE with per-frequency factors (`rope_scaling` type
`longrope` / `su`): periods multiplied by `long_factor`, rotated dims multiplied by
sqrt(1 + ln(max_pos / original_max_pos) / ln(original_max_pos)). Positions below
`original_max_position_embeddings` rotate by `short_factor`, the others by `long_factor`, as
Hugging Face (its longrope update: short factors while the sequence fits the original
length), vLLM and llama.cpp (short factors for contexts up to the original length) run them;
mlx-lm uses the long factors at every length, so Phi-3.5 / Phi-4-mini prompts under 4,096
tokens rotated otherwise than their reference. The choice is per position (a cached key
keeps the rotation of its own position), which is Hugging Face's for prompts up to the
original length and for decoding past it; a prompt longer than it in one forward Hugging Face
rotates wholly by the long factors. head_dim is hidden_size / num_attention_heads.
`sliding_window` (below max_position_embeddings) is applied as a ring cache entry, with the
same semantics as Gemma's sliding layers (each query sees the last `sliding_window` keys),
as Hugging Face's Phi3 applies it; mlx-lm and llama.cpp ignore it (measured: llama.cpp
0.3.36 on a GGUF with a 24-token window diverges from position 24 on, exactly where
windowed attention starts to differ), which gives the same output within the window.
GGUF (llama.cpp's converter): attn_qkv / ffn_up hold the fused projections, RoPE factors
are tensors (rope_factors_long/short) with their scale as `phi3.rope.scaling.attn_factor`
(the same per-position choice: llama.cpp's below a context of the original length);
checked against llama.cpp's own logits on such files (max |diff| 1.4e-3 of 6.6, float32).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

import fx_engine.core.models.llama as llama
from fx_engine.core.cache import KVCache, LayerSpec
from fx_engine.core.checkpoint import Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors
from fx_engine.core.config import (FLOAT, INT, MAYBE_BOOL, ConfigError, Field, Same, gguf_value, positive_int,
                                   read_fields, refuse, token_ids)
from fx_engine.core.models.blocks import HF_LAYER, attention_sizes
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LayerParams, LlamaConfig
from fx_engine.core.nn import rope_tables
from fx_engine.core.splits import shard_decoder


@attrs.frozen
class Phi3Config(LlamaConfig):
    """The Llama decoder's config (its Llama-only choices at their defaults: no biases,
    q/k norms, multipliers or NoPE layers), with Phi's RoPE and one window for every layer."""

    rope_dims: int = 0  # the rotated dims of each head (partial rotary below head_dim)
    rope_scale: float = 1.0  # linear scaling: positions times this
    rope_long_factor: tuple[float, ...] | None = None  # longrope / su: period factors
    rope_short_factor: tuple[float, ...] | None = None  # ... below rope_original_max (None: long)
    rope_original_max: int = 4096  # original_max_position_embeddings
    rope_mscale: float = 1.0  # longrope / su: rotated dims times this
    sliding_window: int | None = None  # type: ignore[assignment]  # (every layer's; None: none)
    max_position_embeddings: int = 131072


# config.json's fields read as they are (`read_fields`, in this order), by Phi3Config's names
_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads", to="num_heads"),
    Field("num_key_value_heads", default=Same("num_heads"), or_default=True, to="num_kv_heads"),
    Field("vocab_size"), Field("num_hidden_layers", to="num_layers"), Field("intermediate_size"),
    Field("rms_norm_eps", FLOAT, 1e-5, null_default=True),
    Field("max_position_embeddings", INT, 131072, or_default=True),
    Field("tie_word_embeddings", MAYBE_BOOL, None),  # None: decided by the checkpoint
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Phi3Config:
    f = read_fields(d, _FIELDS, source)
    hidden, heads, kv_heads, max_pos = f["hidden_size"], f["num_heads"], f["num_kv_heads"], f["max_position_embeddings"]
    if heads % kv_heads or hidden % heads:
        raise ConfigError(f"{source}: num_attention_heads ({heads}) must divide hidden_size "
                          f"({hidden}) and be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = hidden // heads
    if d.get("head_dim") not in (None, head_dim):
        raise ConfigError(f"{source}: field 'head_dim' = {d['head_dim']!r} is not supported "
                          f"(phi3's head_dim is hidden_size / num_attention_heads = {head_dim})")
    refuse(d, source, "hidden_act", lambda v: v in ("silu", "swish"), "phi3 runs SwiGLU")
    refuse(d, source, "attention_bias", lambda v: not v, "mlx-lm's phi3 has no attention biases")
    rope = _rope_settings(d, head_dim, max_pos, source)
    window = d.get("sliding_window")
    window = positive_int(window, "sliding_window", source) if window else None
    bos, eos_ids = token_ids(d)
    return Phi3Config(
        model_type=d["model_type"], **f, head_dim=head_dim, **rope,
        # mlx-lm's SuScaledRoPE rotates the two halves whatever rope_traditional says
        rope_traditional=bool(d.get("rope_traditional", False)) and rope.get("rope_long_factor") is None,
        sliding_window=window if window and window < max_pos else None, bos_token_id=bos, eos_token_ids=eos_ids,
    )


def _rope_settings(d: dict[str, Any], head_dim: int, max_pos: int, source: str) -> dict[str, Any]:
    """Phi3Config's RoPE fields: the rotated dims (partial_rotary_factor), base, and linear
    or longrope / su scaling, wherever the config keeps them (transformers >= 5 nests them
    under rope_parameters)."""
    rp = d.get("rope_parameters") or {}
    frac = float(d.get("partial_rotary_factor") or rp.get("partial_rotary_factor") or 1.0)
    rope_dims = int(head_dim * frac)
    if not 0 < frac <= 1 or rope_dims % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' = {frac} must give an even "
                          f"number of rotated dims in (0, head_dim = {head_dim}]")
    orig = int(d.get("original_max_position_embeddings") or rp.get("original_max_position_embeddings")
               or (d.get("rope_scaling") or {}).get("original_max_position_embeddings") or 4096)
    rope: dict[str, Any] = dict(rope_theta=float(d.get("rope_theta") or rp.get("rope_theta") or 10000.0),
                                rope_dims=rope_dims)
    scaling = d.get("rope_scaling")
    if scaling is None and (rp.get("rope_type") or rp.get("type") or "default") != "default":
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
    if not scaling:
        return rope
    kind = scaling.get("type") or scaling.get("rope_type")
    if kind == "linear":
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"{source}: rope_scaling.factor must be > 0, got {factor!r}")
        return {**rope, "rope_scale": 1.0 / float(factor)}
    if kind not in ("longrope", "su"):
        raise ConfigError(f"{source}: rope_scaling type {kind!r} is not supported by phi3 "
                          "(supported: linear, longrope, su)")
    factors = {}
    for key in ("long_factor", "short_factor"):
        v = scaling.get(key)
        if v is None and key == "short_factor":
            continue
        if (not isinstance(v, list) or len(v) != rope_dims // 2
                or not all(isinstance(x, (int, float)) and x > 0 for x in v)):
            raise ConfigError(f"{source}: rope_scaling.{key} must list {rope_dims // 2} "
                              "positive numbers (one per rotated frequency)")
        factors[key] = tuple(float(x) for x in v)
    for key in ("long_mscale", "short_mscale", "attention_factor"):
        if scaling.get(key) is not None:
            raise ConfigError(f"{source}: rope_scaling.{key} is not supported "
                              "(mlx-lm's phi3 derives the scale from the lengths)")
    factor = max_pos / orig
    return {**rope, "rope_long_factor": factors["long_factor"], "rope_short_factor": factors.get("short_factor"),
            "rope_original_max": orig,
            "rope_mscale": 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))}


@attrs.frozen
class Phi3Params(llama.Params):
    """The Llama family's params pytree (fused qkv and gate_up, as Phi stores them) under
    a Phi3Config; rope_freqs is unused (always None)."""


def cache_specs(cfg: Phi3Config) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim, window=cfg.sliding_window)
                 for _ in range(cfg.num_layers))


def _rope(p: Phi3Params, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    cfg = p.config
    rd = cfg.rope_dims

    def tables(factors: tuple[float, ...] | None) -> tuple[mx.array, mx.array, mx.array]:
        freqs = None if factors is None else mx.array(factors, mx.float32) * (
            cfg.rope_theta ** (mx.arange(0, rd, 2, dtype=mx.float32) / rd))  # periods times the factors
        return rope_tables(positions, rd, base=cfg.rope_theta, scale=cfg.rope_scale, freqs=freqs,
                           traditional=cfg.rope_traditional)

    cos, sin, perm = tables(cfg.rope_long_factor)
    if cfg.rope_short_factor is not None and cfg.rope_short_factor != cfg.rope_long_factor:
        short_cos, short_sin, _ = tables(cfg.rope_short_factor)
        short = (positions < cfg.rope_original_max)[:, :, None, None]  # [B, T, 1, 1]
        cos, sin = mx.where(short, short_cos, cos), mx.where(short, short_sin, sin)
    if cfg.rope_mscale != 1.0:  # rotation is linear: scaling the tables scales the rotated dims
        cos, sin = cos * cfg.rope_mscale, sin * cfg.rope_mscale
    dt = getattr(mx, p.dtype)
    return cos.astype(dt), sin.astype(dt), perm.astype(dt)


def forward(
    p: Phi3Params, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder, Phi's RoPE)."""
    return llama.forward(p, cache, tokens, n_valid, span, rope_fn=_rope)


hidden_to_logits = llama.hidden_to_logits


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`; Llama's
# with the projections stored fused), and the whole model's: Llama's `TOP`
LAYER = (
    Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
    Lin("qkv", "self_attn.qkv_proj", "qkv_width", "hidden_size"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width"),
    Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"),
    Lin("gate_up", "mlp.gate_up_proj", "gate_up_width", "hidden_size"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size"),
)
# llama.cpp's names (its converter keeps phi3's fused projections and half-split RoPE)
_GGUF_NAMES = {
    HF_LAYER: "blk.{i}.", "model.embed_tokens": "token_embd", "model.norm.weight": "output_norm.weight",
    "lm_head": "output", "input_layernorm.weight": "attn_norm.weight", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _assemble(cfg: Phi3Config, src: TensorSource, opts: LoadOptions,
              rename: dict[str, str] | None = None) -> Phi3Params:
    rd, cfg = Reader(src, opts), llama.with_tied(cfg, src, rename)
    sizes = attention_sizes(cfg)
    sizes.update(qkv_width=sizes["q_width"] + 2 * sizes["kv_width"], gate_up_width=2 * cfg.intermediate_size)
    layers = tuple(LayerParams(**read_tensors(rd, LAYER, cfg, HF_LAYER, i, sizes, rename))
                   for i in range(cfg.num_layers))
    return Phi3Params(layers=layers, **read_tensors(rd, llama.TOP, cfg, sizes=sizes, rename=rename),
                      rope_freqs=None, config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def assemble(cfg: Phi3Config, src: TensorSource, opts: LoadOptions) -> Phi3Params:
    """Params from Hugging Face / mlx-community names (projections already fused)."""
    return _assemble(cfg, src, opts)


def assemble_gguf(cfg: Phi3Config, src: TensorSource, opts: LoadOptions) -> Phi3Params:
    """Params from llama.cpp's names. Long-context files carry the RoPE factors as tensors
    (rope_factors_long/short.weight): the short ones below the original length (llama.cpp
    uses them when its context is at most the original one), the long ones from there."""
    if src.has("rope_factors_long.weight"):
        def factors(name: str) -> tuple[float, ...] | None:
            if not src.has(name):
                return None
            t = src.get(name, (cfg.rope_dims // 2,), opts.where)
            return tuple(float(x) for x in t.astype(mx.float32).tolist())

        cfg = attrs.evolve(cfg, rope_long_factor=factors("rope_factors_long.weight"),
                           rope_short_factor=factors("rope_factors_short.weight"))
    else:  # no longrope: no scale either
        cfg = attrs.evolve(cfg, rope_mscale=1.0)
    return _assemble(cfg, src, opts, _GGUF_NAMES)


def config_from_gguf(md: dict[str, Any], source: str) -> Phi3Config:
    """A Phi3Config from llama.cpp's phi3 metadata (what its converter writes)."""
    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, "phi3", key, source, default)

    hidden, heads = int(val("embedding_length")), int(val("attention.head_count"))
    kv_heads = int(val("attention.head_count_kv", heads))
    head_dim = hidden // heads
    rope_dims = int(val("rope.dimension_count", head_dim))
    max_pos = int(val("context_length", 4096))
    orig = int(val("rope.scaling.original_context_length", max_pos))
    factor = max_pos / orig
    default_mscale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    window = int(val("attention.sliding_window", 0) or 0)
    vocab = val("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", []))
    eos, bos = md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.bos_token_id")
    return Phi3Config(
        model_type="phi3", vocab_size=int(vocab), hidden_size=hidden,
        num_layers=int(val("block_count")), num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, intermediate_size=int(val("feed_forward_length")),
        rms_norm_eps=float(val("attention.layer_norm_rms_epsilon")),
        rope_theta=float(val("rope.freq_base", 10000.0)), rope_dims=rope_dims,
        # the long factors come with the tensors (assemble_gguf); their scale is metadata
        rope_mscale=float(val("rope.scaling.attn_factor", default_mscale)), rope_original_max=orig,
        sliding_window=window if 0 < window < max_pos else None,
        max_position_embeddings=max_pos, tie_word_embeddings=None,
        bos_token_id=int(bos.item()) if bos is not None else None,
        eos_token_ids=(int(eos.item()),) if eos is not None else (),
    )


def checkpoint_layout(cfg: Phi3Config) -> dict[str, TensorSpec]:
    return llama.checkpoint_layout(cfg, fused=True)


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": ["Phi3ForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 384,
            "rope_theta": 10000.0, "max_position_embeddings": 4096,
            "original_max_position_embeddings": 4096, "sliding_window": 2047,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **overrides}


FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="phi3", model_types=("phi3",), config_type=Phi3Config, params_type=Phi3Params,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs,
    forward=forward, hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=shard_decoder, layer_range=llama.layer_range, tiny_config=tiny_config,
    gguf_architectures=("phi3",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
