"""GPT-OSS (`gpt_oss`), following mlx-lm 0.32's gpt_oss.py (the parity oracle).

The attention is the Llama family's (`blocks.self_attention`) with biases on q/k/v/o and a
learned sink logit per head in every softmax's denominator (attends to nothing); layers
alternate sliding-window (a ring cache entry) and global attention, both with the same
(YaRN-scaled) RoPE. The MLP of every layer is a mixture of experts: a router with a bias,
each token's top-k logits softmaxed over those k (the MoE family's `route` in its mixtral
mode), experts with biases and GPT-OSS's clamped SwiGLU:
(clip(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7) (the config's swiglu_limit
and swiglu_alpha; mlx-lm fixes the slope).
Checkpoints: mlx-lm's sanitized names (`mlp.experts.{gate,up,down}_proj.weight/.bias`
stacked [E, out, in]; what mlx-community's affine-quantized folders hold) and Hugging
Face's dense layout (`mlp.experts.gate_up_proj` [E, H, 2F] with gate and up interleaved
along the last axis, `down_proj` [E, F, H], `*_bias`). The original checkpoint's MXFP4
expert blocks are not read: a clear error says so.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
import fx_engine.core.models.llama as llama
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Fused, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, WeightsError, finish_experts, fuse_experts, read_expert_stack,
                                       read_tensors, renamed)
from fx_engine.core.config import ConfigError, Field, gguf_hf_config, gguf_value, gguf_yarn, read_fields
from fx_engine.core.models.blocks import HF_LAYER, QKV, attention_sizes, rope_freqs, route, self_attention
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.nn import Linear, Numerics, linear, rms_norm, routed_mixture
from fx_engine.core.splits import shard_decoder


@attrs.frozen
class GptOssConfig(LlamaConfig):
    num_experts: int = 1
    top_k: int = 1
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702  # the gate's sigmoid slope (mlx-lm fixes it at 1.702)


def _limit(value: Any, key: str, source: str) -> float:
    if not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{source}: field '{key}' must be > 0, got {value!r}")
    return float(value)


# its own config.json fields (`read_fields`, in this order; the attention's: llama.config_from_hf)
_FIELDS = (Field("num_hidden_layers"), Field("num_local_experts", to="num_experts"),
           Field("num_experts_per_tok", to="top_k"), Field("swiglu_limit", _limit, 7.0),
           Field("swiglu_alpha", _limit, 1.702),
           Field("sliding_window", default=128, or_default=True))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> GptOssConfig:
    f = read_fields(d, _FIELDS, source)
    layers = f.pop("num_hidden_layers")
    # every other layer sliding, from layer 0, unless layer_types says
    types = d.get("layer_types") or ["sliding_attention", "full_attention"] * (layers // 2)
    if (len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types)):
        raise ConfigError(f"{source}: layer_types must list {layers} entries of "
                          "'sliding_attention' or 'full_attention'")
    if f["top_k"] > f["num_experts"]:
        raise ConfigError(f"{source}: num_experts_per_tok ({f['top_k']}) exceeds num_local_experts "
                          f"({f['num_experts']})")
    base = llama.config_from_hf(
        {**{k: v for k, v in d.items() if k not in ("layer_types", "sliding_window")},
         "model_type": "llama", "rope_theta": d.get("rope_theta", 150000), "hidden_act": "silu",
         # (GptOssAttention's q/k/v/o biases follow attention_bias, GptOssConfig's default True)
         "attention_bias": bool(d.get("attention_bias", True))}, source)
    return GptOssConfig(**{**attrs.asdict(base, recurse=False), "model_type": "gpt_oss",
                           "tie_word_embeddings": False, "layer_types": tuple(types), **f})


@attrs.frozen
class GptOssLayer:
    attn_norm: mx.array
    qkv: Linear  # with biases (attention_bias)
    o: Linear
    sinks: mx.array  # [heads]
    mlp_norm: mx.array
    router: Linear  # [E, H] with a bias
    gate_up: Linear  # [E, 2F, H] (gate rows first) with biases [E, 2F]
    down: Linear  # [E, H, F] with biases [E, H]
    q_norm: None = None
    k_norm: None = None


@attrs.frozen
class GptOssParams(llama.Params):
    """The Llama family's params pytree with GptOssLayers under a GptOssConfig."""


def cache_specs(cfg: GptOssConfig) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim,
                           window=cfg.sliding_window if t == "sliding_attention" else None)
                 for t in cfg.layer_types)


def swiglu_oai(gu: mx.array, limit: float, alpha: float = 1.702) -> mx.array:
    """GPT-OSS's clamped SwiGLU of a fused gate|up [..., 2F] -> [..., F]."""
    f = gu.shape[-1] // 2
    g, u = mx.minimum(gu[..., :f], limit), mx.clip(gu[..., f:], -limit, limit)
    return (u + 1.0) * (g * mx.sigmoid(alpha * g))


def _layer(
    p: GptOssParams, lp: GptOssLayer, h: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array], geo: StepGeometry,
) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    a, entry = self_attention(p, lp, rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num), entry, spec, rope, geo)
    h = h + a
    x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
    return h + _experts(cfg, lp, x, num), entry


def _experts(cfg: GptOssConfig, lp: GptOssLayer, x: mx.array, num: Numerics) -> mx.array:
    idx, w = route(linear(x, lp.router, num), cfg.top_k, softmax_then_topk=False)
    return routed_mixture(x, lp.gate_up, lp.down, idx, w,
                          lambda gu: swiglu_oai(gu, cfg.swiglu_limit, cfg.swiglu_alpha), num)


def forward(
    p: GptOssParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder, GPT-OSS's experts)."""
    return llama.forward(p, cache, tokens, n_valid, span, layer_fn=_layer)


hidden_to_logits = llama.hidden_to_logits


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): Llama's
# attention with biases and sinks, the router; the experts' stacks are `_expert_stacks`'.
# The whole model's: Llama's (`llama.TOP`; untied: the head is its own).
LAYER = (
    Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
    Fused("qkv", QKV, "hidden_size", bias="qkv_bias"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width", bias="o_bias"),
    Vec("sinks", "self_attn.sinks", "num_heads", float32=True),
    Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"),
    Lin("router", "mlp.router", "num_experts", "hidden_size", bias=True),
)


def assemble(cfg: GptOssConfig, src: TensorSource, opts: LoadOptions) -> GptOssParams:
    """Params from mlx-lm's sanitized names or Hugging Face's dense expert layout."""
    rd, dtype, keep, sizes = Reader(src, opts), opts.dtype, opts.keep_quantized, attention_sizes(cfg)

    def layer(i: int) -> GptOssLayer:
        gate, up, down = _expert_stacks(src, HF_LAYER.format(i=i) + "mlp.experts.", cfg.num_experts,
                                        cfg.intermediate_size, cfg.hidden_size, opts)
        return GptOssLayer(**read_tensors(rd, LAYER, cfg, HF_LAYER, i, sizes),
                           gate_up=fuse_experts(gate, up, dtype, keep), down=finish_experts(down, dtype, keep))

    return GptOssParams(layers=tuple(layer(i) for i in range(cfg.num_layers)),
                        **read_tensors(rd, llama.TOP, cfg, sizes=sizes),
                        rope_freqs=rope_freqs(cfg), config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _expert_stacks(src: TensorSource, pre: str, e: int, f: int, h: int,
                   opts: LoadOptions) -> tuple[Linear, Linear, Linear]:
    """gate, up [E, F, H] and down [E, H, F] stacks with their biases."""
    if src.has(pre + "gate_up_proj_blocks"):
        raise WeightsError(f"{opts.where}: '{pre}gate_up_proj_blocks' holds MXFP4 expert blocks "
                           "(the original GPT-OSS checkpoint), which fx-engine does not read yet; "
                           "convert the model with mlx_lm.convert (affine 4-/8-bit) or use a "
                           "bfloat16 checkpoint")
    if src.has(pre + "gate_up_proj"):  # Hugging Face's dense layout: x @ W, gate/up interleaved
        gu = src.get(pre + "gate_up_proj", (e, h, 2 * f), opts.where).swapaxes(-1, -2)  # [E, 2F, H]
        gub = src.get(pre + "gate_up_proj_bias", (e, 2 * f), opts.where)
        down = src.get(pre + "down_proj", (e, f, h), opts.where).swapaxes(-1, -2)  # [E, H, F]
        return (Linear(weight=gu[:, ::2], bias=gub[:, ::2]), Linear(weight=gu[:, 1::2], bias=gub[:, 1::2]),
                Linear(weight=down, bias=src.get(pre + "down_proj_bias", (e, h), opts.where)))
    return tuple(read_expert_stack(src, pre + n, e, o, i, opts.quant_for(pre + n), opts.where, bias=True)
                 for n, (o, i) in (("gate_proj", (f, h)), ("up_proj", (f, h)), ("down_proj", (h, f))))


def checkpoint_layout(cfg: GptOssConfig) -> dict[str, TensorSpec]:
    """mlx-lm's sanitized tensors (its model class loads these as they are)."""
    h, hd, e, f, v = cfg.hidden_size, cfg.head_dim, cfg.num_experts, cfg.intermediate_size, cfg.vocab_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": TensorSpec((v, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        for n, rows, cols in (("q_proj", hq, h), ("k_proj", hk, h), ("v_proj", hk, h), ("o_proj", h, hq)):
            out[a + n + ".weight"] = TensorSpec((rows, cols))
            if cfg.qkv_bias:
                out[a + n + ".bias"] = TensorSpec((rows,), scale=0.05)
        out[a + "sinks"] = TensorSpec((cfg.num_heads,), scale=1.0)
        out[m + "router.weight"] = TensorSpec((e, h), scale=0.5)
        out[m + "router.bias"] = TensorSpec((e,), scale=0.1)
        for n, shape in (("gate_proj", (e, f, h)), ("up_proj", (e, f, h)), ("down_proj", (e, h, f))):
            out[m + "experts." + n + ".weight"] = TensorSpec(shape, scale=0.15)
            out[m + "experts." + n + ".bias"] = TensorSpec(shape[:2], scale=0.05)
        out[p + "input_layernorm.weight"] = TensorSpec((h,), center=1.0)
        out[p + "post_attention_layernorm.weight"] = TensorSpec((h,), center=1.0)
    out["model.norm.weight"] = TensorSpec((h,), center=1.0)
    out["lm_head.weight"] = TensorSpec((v, h), scale=0.2)
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": ["GptOssForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 4, "intermediate_size": 32, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "vocab_size": 384,
            "rope_theta": 150000.0, "max_position_embeddings": 4096, "sliding_window": 16,
            "num_local_experts": 8, "num_experts_per_tok": 2, "swiglu_limit": 7.0,
            "rope_scaling": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                             # (published: "truncate": false, which mlx-lm, the registry's parity
                             # oracle, does not read; tests/models/test_rope_reference.py checks it)
                             "original_max_position_embeddings": 256, "truncate": True},
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **overrides}


# llama.cpp's gpt-oss names -> mlx-lm's sanitized ones (its converter splits gate_up into
# stacked gate and up experts [E, F, H] with their biases; MXFP4 expert stacks stay packed)
_GGUF_TO_HF = (
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.post_attention_norm\.", ".post_attention_layernorm."),
    (r"\.attn_sinks\.weight$", ".self_attn.sinks"), (r"\.ffn_gate_inp\.", ".mlp.router."),
    (r"\.ffn_gate_exps\.", ".mlp.experts.gate_proj."), (r"\.ffn_up_exps\.", ".mlp.experts.up_proj."),
    (r"\.ffn_down_exps\.", ".mlp.experts.down_proj."),
) + GGUF_COMMON_NAMES


def assemble_gguf(cfg: GptOssConfig, src: TensorSource, opts: LoadOptions) -> GptOssParams:
    """GPT-OSS from llama.cpp's names (renamed only: NEOX RoPE, no permutation)."""
    return assemble(cfg, renamed(src, _GGUF_TO_HF), opts)


def config_from_gguf(md: dict[str, Any], source: str) -> GptOssConfig:
    """From llama.cpp's gpt-oss metadata (every other layer sliding, from layer 0, as
    llama.cpp and Hugging Face run it; YaRN from its rope.scaling keys)."""
    d = gguf_hf_config(md, "gpt-oss", source, "gpt_oss", rope_theta=150000.0, context=131072, ffn=False)
    d.update(intermediate_size=int(gguf_value(md, "gpt-oss", "expert_feed_forward_length", source)),
             num_local_experts=int(gguf_value(md, "gpt-oss", "expert_count", source)),
             num_experts_per_tok=int(gguf_value(md, "gpt-oss", "expert_used_count", source)),
             sliding_window=int(gguf_value(md, "gpt-oss", "attention.sliding_window", source, 128)),
             rope_scaling=gguf_yarn(md, "gpt-oss", source))
    return config_from_hf(d, source)

FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="gpt_oss", model_types=("gpt_oss",), config_type=GptOssConfig, params_type=GptOssParams,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=shard_decoder, layer_range=llama.layer_range, tiny_config=tiny_config,
    gguf_architectures=("gpt-oss",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
