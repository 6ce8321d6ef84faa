"""OLMo 2 (`olmo2`) and OLMo 3 (`olmo3`), following mlx-lm 0.32's olmo2.py / olmo3.py (the
parity oracle).

The attention is the Llama family's with RMSNorms on q and k over the whole projections
(before the heads are split); the block is post-norm: h = h + norm(attn(h)),
h = h + norm(mlp(h)), with no norm on a sublayer's input. OLMo 3 adds sliding-window layers
(`layer_types`; by default three sliding layers, then a global one), whose RoPE is the plain
one while global layers use the configured scaling (YaRN in the long-context models). A
sliding layer is a ring cache entry, as for Gemma.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced
from fx_engine.core.checkpoint import LoadOptions, TensorSource, TensorSpec, finish, fuse, read_linear
from fx_engine.core.config import ConfigError, positive_int
from fx_engine.core.models import llama
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.nn import Linear, embed, linear, rms_norm, swiglu_fused


@attrs.frozen
class OlmoConfig(LlamaConfig):
    layer_types: tuple[str, ...] = ()  # "sliding_attention" | "full_attention" per layer
    sliding_window: int = 0


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> OlmoConfig:
    mt = d["model_type"]
    layers = positive_int(d.get("num_hidden_layers"), "num_hidden_layers", source)
    types = d.get("layer_types")
    window = 0
    if mt == "olmo3":
        if types is None:
            types = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
        if (not isinstance(types, list) or len(types) != layers
                or any(t not in ("sliding_attention", "full_attention") for t in types)):
            raise ConfigError(f"{source}: layer_types must list {layers} entries of "
                              "'sliding_attention' or 'full_attention'")
        if "sliding_attention" in types:
            window = positive_int(d.get("sliding_window"), "sliding_window", source)
    elif types is not None and any(t != "full_attention" for t in types):
        raise ConfigError(f"{source}: layer_types other than full_attention are not supported for olmo2")
    types = tuple(types or ("full_attention",) * layers)
    # the attention, RoPE and MLP fields are Llama's (layer_types checked here)
    base = llama.config_from_hf({k: v for k, v in d.items() if k not in ("layer_types", "sliding_window")}
                                | {"model_type": "llama"}, source)
    return OlmoConfig(**{**attrs.asdict(base, recurse=False), "model_type": mt, "qk_norm": True},
                      layer_types=types, sliding_window=window)


@attrs.frozen
class OlmoLayer:
    qkv: Linear
    o: Linear
    q_norm: mx.array  # [heads * head_dim]
    k_norm: mx.array  # [kv_heads * head_dim]
    post_attn_norm: mx.array
    gate_up: Linear
    down: Linear
    post_ff_norm: mx.array


@attrs.frozen
class OlmoParams(llama.Params):
    """The Llama family's params pytree with post-norm OlmoLayers under an OlmoConfig."""


def cache_specs(cfg: OlmoConfig) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim,
                           window=cfg.sliding_window if t == "sliding_attention" else None)
                 for t in cfg.layer_types)


def forward(
    p: OlmoParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `fx_engine.core.models.llama.forward`."""
    cfg, num = p.config, p.numerics
    b, t = tokens.shape
    eps = cfg.rms_norm_eps
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    h = embed(tokens.reshape(-1), p.embed).astype(getattr(mx, p.dtype))
    full = llama._rope(p, geo.positions)  # the configured scaling
    # sliding layers rotate with the plain RoPE (mlx-lm's olmo3)
    plain = full if cfg.rope_scaling is None else llama._rope(
        attrs.evolve(p, config=attrs.evolve(cfg, rope_scaling=None), rope_freqs=None), geo.positions)
    entries = []
    for lp, entry, spec, kind in zip(p.layers, cache.layers, cache.layout, cfg.layer_types):
        rope = plain if kind == "sliding_attention" else full
        a, entry = llama.self_attention(p, lp, h, entry, spec, rope, geo)
        h = h + rms_norm(a, lp.post_attn_norm, eps, num)
        r = linear(swiglu_fused(linear(h, lp.gate_up, num), num), lp.down, num)
        h = h + rms_norm(r, lp.post_ff_norm, eps, num)
        entries.append(entry)
    h = rms_norm(h, p.norm, eps, num).reshape(b, t, -1)
    return h, advanced(cache, entries, geo)


hidden_to_logits = llama.hidden_to_logits


def assemble(cfg: OlmoConfig, src: TensorSource, opts: LoadOptions) -> OlmoParams:
    """Params from Hugging Face / mlx-community tensor names."""
    dtype, keep, where = opts.dtype, opts.keep_quantized, opts.where
    if cfg.tie_word_embeddings is None:
        cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight"))
    h, hd, ff = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd

    def lin(name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        return read_linear(src, name, out_f, in_f, opts.quant_for(name), bias, where)

    def vec(name: str, n: int) -> mx.array:
        return src.get(name, (n,), where).astype(dtype)

    layers = []
    for i in range(cfg.num_layers):
        a, m, p = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        layers.append(OlmoLayer(
            qkv=fuse([lin(a + n, rows, h, cfg.qkv_bias) for n, rows in
                      (("q_proj", hq), ("k_proj", hk), ("v_proj", hk))], dtype, keep),
            o=finish(lin(a + "o_proj", h, hq, cfg.o_bias), dtype, keep),
            q_norm=vec(a + "q_norm.weight", hq), k_norm=vec(a + "k_norm.weight", hk),
            post_attn_norm=vec(p + "post_attention_layernorm.weight", h),
            gate_up=fuse([lin(m + "gate_proj", ff, h, cfg.mlp_bias), lin(m + "up_proj", ff, h, cfg.mlp_bias)],
                         dtype, keep),
            down=finish(lin(m + "down_proj", h, ff, cfg.mlp_bias), dtype, keep),
            post_ff_norm=vec(p + "post_feedforward_layernorm.weight", h),
        ))
    embed_t = finish(lin("model.embed_tokens", cfg.vocab_size, h), dtype, keep, table=True,
                     lookup_only=not cfg.tie_word_embeddings)
    head = None if cfg.tie_word_embeddings else finish(lin("lm_head", cfg.vocab_size, h), dtype, keep)
    return OlmoParams(embed=embed_t, layers=tuple(layers), norm=vec("model.norm.weight", h), lm_head=head,
                      rope_freqs=llama.rope_freqs(cfg), config=cfg, numerics=opts.numerics,
                      dtype=opts.dtype_name)


def checkpoint_layout(cfg: OlmoConfig) -> dict[str, TensorSpec]:
    """Llama's tensors with post-norms instead of pre-norms and whole-projection q/k norms."""
    out = {}
    for name, spec in llama.checkpoint_layout(attrs.evolve(cfg, qk_norm=False)).items():
        if name.endswith("input_layernorm.weight"):
            name = name.replace("input_layernorm", "post_feedforward_layernorm")
        out[name] = spec
    for i in range(cfg.num_layers):
        a = f"model.layers.{i}.self_attn."
        out[a + "q_norm.weight"] = TensorSpec((cfg.num_heads * cfg.head_dim,), center=1.0)
        out[a + "k_norm.weight"] = TensorSpec((cfg.num_kv_heads * cfg.head_dim,), center=1.0)
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    extra = ({"architectures": ["Olmo3ForCausalLM"], "sliding_window": 16, "num_hidden_layers": 4}
             if model_type == "olmo3" else {"architectures": ["Olmo2ForCausalLM"]})
    return {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 384, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "attention_bias": False, **extra, **overrides}


def first_layers(p: OlmoParams, n: int) -> OlmoParams:
    """The params of the first n layers (self-speculative drafts), their layer types too."""
    small = attrs.evolve(p.config, num_layers=n, layer_types=p.config.layer_types[:n])
    return attrs.evolve(p, layers=p.layers[:n], config=small)


FAMILY = Family(
    name="olmo", model_types=("olmo2", "olmo3"), config_type=OlmoConfig, params_type=OlmoParams,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    first_layers=first_layers, tiny_config=tiny_config,
)
