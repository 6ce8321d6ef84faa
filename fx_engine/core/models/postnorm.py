"""Post-norm decoders: OLMo 2 (`olmo2`), OLMo 3 (`olmo3`), EXAONE 4 (`exaone4`) and GLM-4
(`glm4`), following mlx-lm 0.32's olmo2.py / olmo3.py / exaone4.py / glm4.py (the parity
oracle).

The attention is the Llama family's (`llama.self_attention`); what these share is the
block: each sublayer's output is normalized before it joins the residual stream,
h = h + norm(attn(h)), h = h + norm(mlp(h)). Per model type:
- olmo2 / olmo3: no norm on a sublayer's input; RMSNorms on q and k over the whole
  projections; OLMo 3 adds sliding-window layers (`layer_types`, by default three sliding
  then one global), which rotate with the plain RoPE while global layers use the
  configured scaling (YaRN in the long-context models).
- exaone4: per-head q/k norms; with a `sliding_window` (Hugging Face's default 4096) and
  `sliding_window_pattern` ("LLLG", or every n-th layer global; default 4) or `layer_types`,
  local layers are sliding-window layers with RoPE and global layers have no positional
  encoding (NoPE); without a window every layer is global with RoPE.
- glm4: "sandwich" norms (on each sublayer's input too), q/k/v biases, the fused
  gate_up_proj, RoPE on the first partial_rotary_factor of each head with interleaved
  pairs.
Sliding layers are ring cache entries, as for Gemma.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

import fx_engine.core.models.llama as llama
from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Fused, Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec,
                                       read_tensors, renamed)
from fx_engine.core.config import ConfigError, gguf_hf_config, gguf_value, gguf_yarn, positive_int
from fx_engine.core.models.blocks import (GATE_UP, HF_LAYER, attention_sizes, rope_freqs, rope_in, scaled_rope,
                                          self_attention, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.models.skeleton import decoder_step
from fx_engine.core.nn import Linear, rms_norm
from fx_engine.core.splits import shard_decoder

SLIDING, FULL = "sliding_attention", "full_attention"


@attrs.frozen
class PostNormConfig(LlamaConfig):
    # (layer_types: SLIDING | FULL per layer, and sliding_window, are Llama's fields)
    # per layer: "scaled" (the configured RoPE), "plain" (unscaled), "none" (NoPE)
    layer_rope: tuple[str, ...] = ()
    pre_norms: bool = False  # GLM-4: the sublayers' inputs are normalized too
    rope_dims: int = 0  # rotated dims per head (0: all; GLM-4: partial)
    plain_rope_theta: float | None = None  # OLMo 3's sliding layers' own base (None: rope_theta)


def _types(d: dict[str, Any], layers: int, default: list[str], source: str) -> list[str]:
    types = d.get("layer_types") or default
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in (SLIDING, FULL) for t in types)):
        raise ConfigError(f"{source}: layer_types must list {layers} entries of "
                          f"'{SLIDING}' or '{FULL}'")
    return types


def _olmo3_rope(d: dict[str, Any], source: str) -> tuple[dict[str, Any], float | None]:
    """(config with the global layers' RoPE as rope_theta / rope_scaling, the sliding
    layers' base) of an OLMo 3 config. transformers 5 saves RoPE per layer kind under
    rope_parameters; the scaling (YaRN in the long-context models) is the global layers'
    only, as Hugging Face's Olmo3Config puts a top-level rope_scaling."""
    rp = d.get("rope_parameters")
    if not isinstance(rp, dict) or not {FULL, SLIDING} & set(rp):
        return d, None
    full, sliding = rp.get(FULL) or {}, rp.get(SLIDING) or {}
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise ConfigError(f"{source}: rope_parameters.{SLIDING}: only the default RoPE is supported on "
                          "OLMo 3's sliding layers")
    theta = full.get("rope_theta", d.get("rope_theta", 10_000.0))
    scaling = None
    if full.get("rope_type", full.get("type", "default")) != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    out = {**{k: v for k, v in d.items() if k != "rope_parameters"}, "rope_theta": theta, "rope_scaling": scaling}
    plain = float(sliding.get("rope_theta", theta))
    return out, None if plain == float(theta) else plain


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> PostNormConfig:
    mt = d["model_type"]
    layers = positive_int(d.get("num_hidden_layers"), "num_hidden_layers", source)
    extra: dict[str, Any] = {}
    if mt == "olmo3":
        types = _types(d, layers, [FULL if (i + 1) % 4 == 0 else SLIDING for i in range(layers)], source)
        rope = ["plain" if t == SLIDING else "scaled" for t in types]
        d, plain_theta = _olmo3_rope(d, source)
        extra["plain_rope_theta"] = plain_theta
    elif mt == "exaone4":
        pattern = d.get("sliding_window_pattern")
        if isinstance(pattern, int) and not isinstance(pattern, bool):  # Hugging Face: every n-th global
            pattern = "L" * (pattern - 1) + "G" if pattern > 1 else None
        if pattern is not None and (not isinstance(pattern, str) or not pattern or set(pattern) - {"L", "G"}
                                    or "G" not in pattern):
            raise ConfigError(f"{source}: field 'sliding_window_pattern' must be a string of L and G "
                              f"(with a G) or a layer count, got {pattern!r}")
        # a window runs where the layer kinds come from layer_types or the pattern (a null
        # pattern without layer_types, which Hugging Face cannot load, reads as mlx-lm's: no
        # window, RoPE everywhere)
        windowed = d.get("sliding_window") is not None and (pattern or d.get("layer_types") is not None)
        if pattern and windowed and d.get("layer_types") is None:
            types = [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(layers)]
        else:
            types = _types(d, layers, [FULL] * layers, source)
        # Hugging Face's Exaone4Attention: with a sliding_window, global layers have no RoPE
        # (NoPE), whether or not any layer slides (mlx-lm: only when some layer does)
        rope = ["scaled" if t == SLIDING or not windowed else "none" for t in types]
    else:  # olmo2, glm4: every layer global with the configured RoPE
        types = _types(d, layers, [FULL] * layers, source)
        if SLIDING in types:
            raise ConfigError(f"{source}: layer_types other than {FULL} are not supported for {mt}")
        rope = ["scaled"] * layers
    window = positive_int(d.get("sliding_window"), "sliding_window", source) if SLIDING in types else 0
    base_d = {k: v for k, v in d.items() if k not in ("layer_types", "sliding_window", "partial_rotary_factor")}
    if mt == "glm4":
        base_d.update(rope_traditional=d.get("rope_traditional", True), attention_bias=False)
        frac = float(d.get("partial_rotary_factor", 0.5))
        hd = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        if not 0 < frac <= 1 or int(hd * frac) % 2:
            raise ConfigError(f"{source}: field 'partial_rotary_factor' = {frac} must give an even "
                              f"number of rotated dims in (0, head_dim = {hd}]")
        if d.get("rope_scaling"):
            raise ConfigError(f"{source}: field 'rope_scaling' is not supported for glm4 (mlx-lm ignores it)")
        extra = dict(pre_norms=True, rope_dims=int(hd * frac), qkv_bias=bool(d.get("attention_bias", False)))
    base = llama.config_from_hf({**base_d, "model_type": "llama"}, source)
    return PostNormConfig(**{**attrs.asdict(base, recurse=False), "model_type": mt,
                             "qk_norm": mt != "glm4", "layer_types": tuple(types),
                             "sliding_window": window, **extra},
                          layer_rope=tuple(rope))


@attrs.frozen
class PostNormLayer:
    qkv: Linear
    o: Linear
    post_attn_norm: mx.array
    gate_up: Linear
    down: Linear
    post_ff_norm: mx.array
    q_norm: mx.array | None = None  # per head (exaone4) or over the projection (olmo)
    k_norm: mx.array | None = None
    attn_norm: mx.array | None = None  # glm4's input norms
    mlp_norm: mx.array | None = None


@attrs.frozen
class PostNormParams(llama.Params):
    """The Llama family's params pytree with PostNormLayers under a PostNormConfig."""


def cache_specs(cfg: PostNormConfig) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim, window=cfg.sliding_window if t == SLIDING else None)
                 for t in cfg.layer_types)


def _ropes(p: PostNormParams, positions: mx.array) -> dict[str, Any]:
    cfg = p.config
    out: dict[str, Any] = {"none": None}
    if cfg.rope_dims:  # partial rotary (glm4): tables over the rotated dims only
        out["scaled"] = out["plain"] = rope_in(positions, cfg.rope_dims, getattr(mx, p.dtype), base=cfg.rope_theta,
                                               traditional=cfg.rope_traditional)
        return out
    out["scaled"] = scaled_rope(p, positions)
    plain_theta = cfg.rope_theta if cfg.plain_rope_theta is None else cfg.plain_rope_theta
    out["plain"] = out["scaled"] if cfg.rope_scaling is None and plain_theta == cfg.rope_theta else scaled_rope(
        attrs.evolve(p, config=attrs.evolve(cfg, rope_scaling=None, rope_theta=plain_theta), rope_freqs=None),
        positions)
    return out


def forward(
    p: PostNormParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step`."""
    cfg, num = p.config, p.numerics
    eps = cfg.rms_norm_eps

    def pre(x: mx.array, w: mx.array | None) -> mx.array:
        return x if w is None else rms_norm(x, w, eps, num)

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        ropes = _ropes(p, geo.positions)
        entries = []
        for lp, entry, spec, kind in zip(p.layers, cache.layers, cache.layout, cfg.layer_rope):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            a, entry = self_attention(p, lp, pre(h, lp.attn_norm), entry, spec, ropes[kind], geo)
            h = h + rms_norm(a, lp.post_attn_norm, eps, num)
            h = h + rms_norm(swiglu_mlp(pre(h, lp.mlp_norm), lp.gate_up, lp.down, num), lp.post_ff_norm, eps, num)
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


hidden_to_logits = llama.hidden_to_logits

# the norms' names: (pre-attention, post-attention, pre-MLP, post-MLP); None: none
_NORMS = {
    "glm4": ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm"),
}
_NORMS_DEFAULT = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


# the MLP: Llama's, its gate|up stored apart or fused (glm4), as each layer's tensors are
_MLP = (
    Lin("gate_up", "mlp.gate_up_proj", "gate_up_width", "hidden_size", bias="mlp_bias", when="gate_up_stored"),
    Fused("gate_up", GATE_UP, "hidden_size", bias="mlp_bias", when="gate_up_apart"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size", bias="mlp_bias"),
)


def _layer_table(model_type: str) -> tuple:
    """Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): Llama's
    attention projections and q/k norms, this model type's norms, the MLP."""
    names = _NORMS.get(model_type, _NORMS_DEFAULT)
    norms = tuple(Vec(to, f"{n}.weight", "hidden_size", when=n is not None)
                  for to, n in zip(("attn_norm", "post_attn_norm", "mlp_norm", "post_ff_norm"), names))
    return llama.ATTENTION[1:] + norms + _MLP


def assemble(cfg: PostNormConfig, src: TensorSource, opts: LoadOptions) -> PostNormParams:
    """Params from Hugging Face / mlx-community tensor names."""
    rd, cfg = Reader(src, opts), llama.with_tied(cfg, src)
    # q/k norms per head (exaone4) or over the whole projections (olmo)
    sizes = attention_sizes(cfg, whole_qk_norms=cfg.model_type != "exaone4")
    sizes["gate_up_width"] = 2 * cfg.intermediate_size
    table = _layer_table(cfg.model_type)

    def layer(i: int) -> PostNormLayer:
        stored = rd.has(HF_LAYER.format(i=i) + "mlp.gate_up_proj.weight")
        flags = {"gate_up_stored": stored, "gate_up_apart": not stored}
        return PostNormLayer(**read_tensors(rd, table, cfg, HF_LAYER, i, {**sizes, **flags}))

    return PostNormParams(layers=tuple(layer(i) for i in range(cfg.num_layers)),
                          **read_tensors(rd, llama.TOP, cfg, sizes=sizes), rope_freqs=rope_freqs(cfg), config=cfg,
                          numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: PostNormConfig) -> dict[str, TensorSpec]:
    """Llama's tensors under this model type's norm names (and q/k norm shapes)."""
    glm = cfg.model_type == "glm4"
    pre_attn, post_attn, pre_mlp, post_mlp = _NORMS.get(cfg.model_type, _NORMS_DEFAULT)
    out = {}
    base = llama.checkpoint_layout(attrs.evolve(cfg, qk_norm=False, o_bias=False), fused=False)
    for name, spec in base.items():
        if glm and (".mlp.gate_proj." in name or ".mlp.up_proj." in name):
            if ".gate_proj.weight" in name:  # stored fused
                out[name.replace("gate_proj", "gate_up_proj")] = TensorSpec((2 * spec.shape[0], spec.shape[1]))
            continue
        if name.endswith("input_layernorm.weight") or name.endswith("post_attention_layernorm.weight"):
            continue
        out[name] = spec
    h, hd = cfg.hidden_size, cfg.head_dim
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        for n in (pre_attn, post_attn, pre_mlp, post_mlp):
            if n:
                out[p + n + ".weight"] = TensorSpec((h,), center=1.0)
        if cfg.qk_norm:
            per_head = cfg.model_type == "exaone4"
            out[a + "q_norm.weight"] = TensorSpec((hd if per_head else cfg.num_heads * hd,), center=1.0)
            out[a + "k_norm.weight"] = TensorSpec((hd if per_head else cfg.num_kv_heads * hd,), center=1.0)
    return out


_TINY = {
    "olmo2": {"architectures": ["Olmo2ForCausalLM"]},
    "olmo3": {"architectures": ["Olmo3ForCausalLM"], "sliding_window": 16, "num_hidden_layers": 4},
    "exaone4": {"architectures": ["Exaone4ForCausalLM"], "sliding_window": 16, "num_hidden_layers": 4,
                "sliding_window_pattern": "LLLG", "head_dim": 16, "rope_scaling": None,
                "tie_word_embeddings": True},
    "glm4": {"architectures": ["Glm4ForCausalLM"], "head_dim": 16, "partial_rotary_factor": 0.5,
             "attention_bias": True},
}


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "vocab_size": 384, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": False, "bos_token_id": 1,
            "eos_token_id": 2, "attention_bias": False, **_TINY[model_type], **overrides}


# llama.cpp's olmo2 names beyond the common ones (its converter renames only: no
# permutation, norms stored as they are)
_GGUF_TO_HF = (
    (r"\.post_attention_norm\.", ".post_attention_layernorm."),
    (r"\.post_ffw_norm\.", ".post_feedforward_layernorm."),
) + GGUF_COMMON_NAMES


# GLM-4's: sandwich norms, the fused gate|up as ffn_up
_GLM4_GGUF_TO_HF = (
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.post_attention_norm\.", ".post_self_attn_layernorm."),
    (r"\.ffn_norm\.", ".post_attention_layernorm."), (r"\.post_ffw_norm\.", ".post_mlp_layernorm."),
    (r"\.ffn_up\.", ".mlp.gate_up_proj."),
) + GGUF_COMMON_NAMES


def assemble_gguf(cfg: PostNormConfig, src: TensorSource, opts: LoadOptions) -> PostNormParams:
    """OLMo 2 / EXAONE 4 from llama.cpp's names (renamed to Hugging Face's, then
    `assemble`). Llama-3-style RoPE scaling comes as per-frequency factors
    (rope_freqs.weight), as for llama."""
    if cfg.model_type == "glm4":  # q/k/v biases as the file has them
        cfg = attrs.evolve(cfg, qkv_bias=src.has("blk.0.attn_q.bias"))
    rules = _GLM4_GGUF_TO_HF if cfg.model_type == "glm4" else _GGUF_TO_HF
    params = assemble(attrs.evolve(cfg, tie_word_embeddings=None), renamed(src, rules), opts)
    if src.has("rope_freqs.weight"):  # the rotation period of pair i: base^(2i/d) * factor_i
        d = cfg.head_dim
        factors = src.get("rope_freqs.weight", (d // 2,), opts.where).astype(mx.float32)
        params = attrs.evolve(params, rope_freqs=cfg.rope_theta ** (mx.arange(0, d, 2) / d) * factors)
    return params


def olmo3_from_gguf(md: dict[str, Any], source: str, layers: int) -> dict[str, Any]:
    """OLMo 3's config.json fields from the olmo2.* keys llama.cpp's converter writes for it:
    the window, the per-layer pattern (true: sliding; without one, every 4th layer global as
    in Hugging Face's default) and YaRN on the global layers, whose attention factor
    (rope.scaling.attn_factor) is expressed as mlx-lm's mscale (0.1 mscale ln(factor) + 1)."""
    import math

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, "olmo2", key, source, default)

    pattern = md.get("olmo2.attention.sliding_window_pattern")  # an array (gguf_value reads scalars)
    if pattern is None:
        sliding = [(i + 1) % 4 != 0 for i in range(layers)]
    else:
        sliding = [bool(x) for x in (pattern.tolist() if hasattr(pattern, "tolist") else pattern)]
        if len(sliding) != layers:
            raise ConfigError(f"{source}: olmo2.attention.sliding_window_pattern has {len(sliding)} "
                              f"entries for {layers} layers")
    d: dict[str, Any] = {"model_type": "olmo3", "sliding_window": int(val("attention.sliding_window")),
                         "layer_types": [SLIDING if x else FULL for x in sliding]}
    yarn = gguf_yarn(md, "olmo2", source)
    if yarn is not None:
        f, attn = yarn["factor"], val("rope.scaling.attn_factor", None)
        if attn is not None and f > 1:
            yarn["mscale"] = (float(attn) - 1.0) / (0.1 * math.log(f))
        d["rope_scaling"] = yarn
    return d


def config_from_gguf(md: dict[str, Any], source: str) -> PostNormConfig:
    """An OLMo 2 / EXAONE 4 / GLM-4 config from llama.cpp's metadata (EXAONE 4: every
    `sliding_window_pattern`-th layer global, with NoPE, as mlx-lm and llama.cpp run it;
    GLM-4: RoPE over rope.dimension_count of each head)."""
    arch = md.get("general.architecture")

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    d = gguf_hf_config(md, arch, source, arch)
    hd = d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    if arch == "olmo2":
        d.pop("head_dim")
        if val("attention.sliding_window", None) is not None:  # OLMo 3: llama.cpp writes it as olmo2
            d.update(olmo3_from_gguf(md, source, d["num_hidden_layers"]))
    if arch == "glm4":  # partial RoPE over rope.dimension_count of each head
        d["partial_rotary_factor"] = int(val("rope.dimension_count", hd // 2)) / hd
    if arch == "exaone4" and val("attention.sliding_window", None):
        d.update(sliding_window=int(val("attention.sliding_window")),
                 sliding_window_pattern=int(val("attention.sliding_window_pattern", 4)))
    return config_from_hf(d, source)

FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="postnorm", model_types=("olmo2", "olmo3", "exaone4", "glm4"), config_type=PostNormConfig,
    params_type=PostNormParams, config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs,
    forward=forward, hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=shard_decoder, layer_range=llama.layer_range, tiny_config=tiny_config,
    gguf_architectures=("olmo2", "exaone4", "glm4"), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
