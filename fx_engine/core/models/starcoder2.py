"""StarCoder 2 (`starcoder2`), following mlx-lm 0.32's starcoder2.py (the parity oracle).

The attention is the Llama family's with biases on q/k/v/o; the rest is GPT-style:
LayerNorms with a bias (not RMSNorms) before each sublayer and at the end, and a plain
(not gated) MLP c_proj(gelu(c_fc(x))) with biases. The GELU is the config's `hidden_act`,
as Hugging Face reads it (the released models: gelu_pytorch_tanh, the tanh approximation);
mlx-lm always uses the exact (erf) one, so its parity tests use hidden_act "gelu". Hugging Face
applies `sliding_window` on every layer (as for Mistral: ring caches here); mlx-lm attends
over everything, the same output while a sequence fits in the window (4096 tokens in the
released models).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
import fx_engine.core.models.llama as llama
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Norm, Reader, TensorSource,
                                       TensorSpec, read_tensors, renamed)
from fx_engine.core.config import ConfigError, gguf_hf_config
from fx_engine.core.models.blocks import HF_LAYER, QKV, attention_sizes, self_attention
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.nn import Linear, gelu, gelu_tanh, layer_norm, linear
from fx_engine.core.splits import shard_decoder


@attrs.frozen
class Starcoder2Config(LlamaConfig):
    """Llama's config (q/k/v/o biases, sliding layers); rms_norm_eps is the LayerNorms' eps."""

    gelu_tanh: bool = True  # hidden_act gelu_pytorch_tanh (False: "gelu", the erf form)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Starcoder2Config:
    act = d.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu", "gelu_pytorch_tanh"):
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for starcoder2")
    if d.get("use_bias") is False:
        raise ConfigError(f"{source}: field 'use_bias' = false is not supported (mlx-lm's starcoder2 has biases)")
    hd = d["hidden_size"] // d["num_attention_heads"] if d.get("num_attention_heads") and d.get("hidden_size") else None
    # Llama's reading with StarCoder's names (norm_epsilon, no head_dim field) and windows
    # as Mistral's (Starcoder2Attention: every layer's, no layer kinds)
    base = llama.config_from_hf(
        {**{k: v for k, v in d.items() if k not in ("hidden_act", "layer_types")}, "model_type": "mistral",
         "rms_norm_eps": d.get("norm_epsilon", 1e-5), "head_dim": hd,
         "rope_theta": d.get("rope_theta", 100000.0), "attention_bias": True}, source)
    return Starcoder2Config(**{**attrs.asdict(base, recurse=False), "model_type": "starcoder2",
                               "tie_word_embeddings": bool(d.get("tie_word_embeddings", True))},
                            gelu_tanh=act == "gelu_pytorch_tanh")


@attrs.frozen
class Starcoder2Layer:
    attn_norm: tuple[mx.array, mx.array]  # LayerNorm weight, bias
    qkv: Linear
    o: Linear
    mlp_norm: tuple[mx.array, mx.array]
    fc: Linear
    proj: Linear
    q_norm: None = None
    k_norm: None = None


@attrs.frozen
class Starcoder2Params(llama.Params):
    """The Llama family's params pytree with Starcoder2Layers; norm is (weight, bias)."""


def _layer(p: Starcoder2Params, lp: Starcoder2Layer, h: mx.array, entry: Any, spec: LayerSpec,
           rope: tuple, geo: StepGeometry) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    eps = cfg.rms_norm_eps
    a, entry = self_attention(p, lp, layer_norm(h, *lp.attn_norm, eps), entry, spec, rope, geo)
    h = h + a
    act = gelu_tanh if cfg.gelu_tanh else gelu
    return h + linear(act(linear(layer_norm(h, *lp.mlp_norm, eps), lp.fc, num)), lp.proj, num), entry


def forward(
    p: Starcoder2Params, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder, GPT-style blocks)."""
    return llama.forward(p, cache, tokens, n_valid, span, layer_fn=_layer,
                         final_norm=lambda h: layer_norm(h, *p.norm, p.config.rms_norm_eps))


hidden_to_logits = llama.hidden_to_logits


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): Llama's
# attention with biases, LayerNorms with biases, the GPT MLP; the whole model's likewise
LAYER = (
    Norm("attn_norm", "input_layernorm"),
    Fused("qkv", QKV, "hidden_size", bias=True),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width", bias=True),
    Norm("mlp_norm", "post_attention_layernorm"),
    Lin("fc", "mlp.c_fc", "intermediate_size", "hidden_size", bias=True),
    Lin("proj", "mlp.c_proj", "hidden_size", "intermediate_size", bias=True),
)
TOP = (
    Embedding("embed", "model.embed_tokens", lookup_only="untied"),
    Norm("norm", "model.norm"),
    Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"),
)


def assemble(cfg: Starcoder2Config, src: TensorSource, opts: LoadOptions) -> Starcoder2Params:
    rd, sizes = Reader(src, opts), attention_sizes(cfg)
    layers = tuple(Starcoder2Layer(**read_tensors(rd, LAYER, cfg, HF_LAYER, i, sizes))
                   for i in range(cfg.num_layers))
    return Starcoder2Params(layers=layers, **read_tensors(rd, TOP, cfg, sizes=sizes), rope_freqs=None, config=cfg,
                            numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: Starcoder2Config) -> dict[str, TensorSpec]:
    h, hd, ff, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": TensorSpec((v, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n, rows, cols in (("self_attn.q_proj", hq, h), ("self_attn.k_proj", hk, h), ("self_attn.v_proj", hk, h),
                              ("self_attn.o_proj", h, hq), ("mlp.c_fc", ff, h), ("mlp.c_proj", h, ff)):
            out[p + n + ".weight"] = TensorSpec((rows, cols))
            out[p + n + ".bias"] = TensorSpec((rows,), scale=0.05)
        for n in ("input_layernorm", "post_attention_layernorm"):
            out[p + n + ".weight"] = TensorSpec((h,), center=1.0, scale=0.1)
            out[p + n + ".bias"] = TensorSpec((h,), scale=0.05)
    out["model.norm.weight"] = TensorSpec((h,), center=1.0, scale=0.1)
    out["model.norm.bias"] = TensorSpec((h,), scale=0.05)
    if cfg.tie_word_embeddings is False:
        out["lm_head.weight"] = TensorSpec((v, h), scale=0.2)
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "architectures": ["Starcoder2ForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
            "num_key_value_heads": 2, "norm_epsilon": 1e-5, "vocab_size": 384, "rope_theta": 100000.0,
            "max_position_embeddings": 2048, "sliding_window": None, "hidden_act": "gelu",
            "use_bias": True, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
            **overrides}


# llama.cpp's starcoder2 names beyond the common ones: LayerNorms with biases, the GPT MLP
_GGUF_TO_HF = (
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.ffn_up\.", ".mlp.c_fc."), (r"\.ffn_down\.", ".mlp.c_proj."),
) + GGUF_COMMON_NAMES


def assemble_gguf(cfg: Starcoder2Config, src: TensorSource, opts: LoadOptions) -> Starcoder2Params:
    """StarCoder 2 from llama.cpp's names (renamed only: no permutation). Tied unless the
    file has its own output.weight."""
    src = renamed(src, _GGUF_TO_HF)
    return assemble(attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight")), src, opts)


def config_from_gguf(md: dict[str, Any], source: str) -> Starcoder2Config:
    """A StarCoder 2 config from llama.cpp's starcoder2 metadata. llama.cpp runs the tanh
    GELU and full attention on every layer (its converter writes no window)."""
    d = gguf_hf_config(md, "starcoder2", source, "starcoder2")
    d.update(norm_epsilon=d.pop("rms_norm_eps"), sliding_window=None, hidden_act="gelu_pytorch_tanh",
             tie_word_embeddings=True)
    d.pop("head_dim", None)  # hidden / heads in starcoder2
    return config_from_hf(d, source)

FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="starcoder2", model_types=("starcoder2",), config_type=Starcoder2Config,
    params_type=Starcoder2Params, config_from_hf=config_from_hf, assemble=assemble,
    cache_specs=llama.cache_specs, forward=forward, hidden_to_logits=hidden_to_logits,
    checkpoint_layout=checkpoint_layout, tensor_split=shard_decoder, layer_range=llama.layer_range,
    tiny_config=tiny_config,
    gguf_architectures=("starcoder2",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
