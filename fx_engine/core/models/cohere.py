"""Command R (`cohere`) and Command R7B / Command A (`cohere2`), following mlx-lm 0.32's
cohere.py / cohere2.py (the parity oracle).

A parallel block: one LayerNorm (no bias unless `layer_norm_bias`) feeds both the
attention and the SwiGLU MLP, and both outputs join the residual stream together,
h = h + attn(n) + mlp(n). RoPE rotates interleaved pairs ("traditional"); the logits are
the tied embedding's times `logit_scale` (an own lm_head's with tie_word_embeddings false,
as Hugging Face's CohereForCausalLM; mlx-lm always ties). cohere may normalize q and k per head with a
LayerNorm whose weight is per head ([heads, head_dim]; `use_qk_norm`). cohere2 has
sliding-window layers (every `sliding_window_pattern`-th layer global) where only the
sliding layers rotate: global layers have no positional encoding (NoPE).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Norm, Reader, TensorSource,
                                       TensorSpec, Vec, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, MAYBE_BOOL, BaseConfig, ConfigError, Field, Same, gguf_hf_config,
                                   gguf_value, read_field, read_fields, token_ids)
from fx_engine.core.models.blocks import (HF_LAYER, QKV, SWIGLU_MLP, attention_sizes, head_norm_attention, rope_in,
                                          swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import with_tied
from fx_engine.core.models.skeleton import PipelineStage, cut_layers, decoder_step, stage_logits
from fx_engine.core.nn import Linear, Numerics, layer_norm, linear
from fx_engine.core.splits import shard_decoder
from fx_engine.core.tree import static_field


@attrs.frozen
class CohereConfig(BaseConfig):
    rope_theta: float
    logit_scale: float
    layer_types: tuple[str, ...]  # "sliding_attention" (with RoPE) | "full_attention"
    global_rope: bool = True  # cohere: every layer rotates; cohere2: global layers are NoPE
    sliding_window: int = 0
    attention_bias: bool = False
    layer_norm_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 8192
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Hugging Face's CohereForCausalLM: tied unless the config says false (then lm_head);
    # unsaid, the checkpoint decides (its own lm_head or none)
    tie_word_embeddings: bool | None = None


def _number(value: Any, key: str, source: str) -> float:
    if not isinstance(value, (int, float)):
        raise ConfigError(f"{source}: field '{key}' must be a number, got {value!r}")
    return float(value)


# config.json's fields read as they are (`read_fields`, in this order), by CohereConfig's names
_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads", to="num_heads"), Field("num_hidden_layers", to="num_layers"),
    Field("num_key_value_heads", default=Same("num_heads"), null_default=True, to="num_kv_heads"),
    Field("vocab_size"), Field("intermediate_size"), Field("logit_scale", _number, 0.0625),
    Field("layer_norm_eps", FLOAT, 1e-5, or_default=True, to="rms_norm_eps"),
    Field("rope_theta", FLOAT, 10000.0, or_default=True), Field("attention_bias", BOOL, False),
    Field("layer_norm_bias", BOOL, False), Field("max_position_embeddings", INT, 8192, or_default=True),
    Field("tie_word_embeddings", MAYBE_BOOL, None),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> CohereConfig:
    mt = d["model_type"]
    f = read_fields(d, _FIELDS, source)
    hidden, heads, layers, kv = f["hidden_size"], f["num_heads"], f["num_layers"], f["num_kv_heads"]
    head_dim = hidden // heads
    if mt == "cohere2":  # (cohere's is always hidden_size / num_attention_heads)
        head_dim = read_field(d, Field("head_dim", default=head_dim, null_default=True), source)
    if heads % kv or head_dim * heads != hidden:
        raise ConfigError(f"{source}: num_attention_heads ({heads}) x head_dim must equal hidden_size "
                          f"({hidden}) and be a multiple of num_key_value_heads ({kv})")
    if d.get("rope_scaling"):
        raise ConfigError(f"{source}: field 'rope_scaling' is not supported for {mt}")
    types, window = ["full_attention"] * layers, 0
    if mt == "cohere2":
        types, window = _cohere2_layers(d, layers, source)
    elif d.get("use_qk_norm") and d.get("layer_norm_bias"):
        raise ConfigError(f"{source}: use_qk_norm with layer_norm_bias is not supported")
    bos, eos = token_ids(d)
    return CohereConfig(
        model_type=mt, **f, head_dim=head_dim, layer_types=tuple(types), global_rope=mt == "cohere",
        sliding_window=window, qk_norm=bool(d.get("use_qk_norm", False)) and mt == "cohere", bos_token_id=bos,
        eos_token_ids=eos,
    )


def _cohere2_layers(d: dict[str, Any], layers: int, source: str) -> tuple[list[str], int]:
    """Command R7B's layer kinds (every sliding_window_pattern-th layer global, unless
    layer_types says) and its window (0 when no layer slides)."""
    pattern = read_field(d, Field("sliding_window_pattern", default=4, null_default=True), source)
    types = d.get("layer_types") or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                     for i in range(layers)]
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(f"{source}: layer_types must list {layers} entries of 'sliding_attention' "
                          "or 'full_attention'")
    if "sliding_attention" not in types:
        return types, 0
    return types, read_field(d, Field("sliding_window", default=4096, null_default=True), source)


@attrs.frozen
class CohereLayer:
    norm: tuple[mx.array, mx.array | None]  # LayerNorm weight, bias
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    q_norm: mx.array | None = None  # [heads, head_dim]
    k_norm: mx.array | None = None  # [kv_heads, head_dim]


@attrs.frozen
class CohereParams:
    __fx_memo_flatten__ = True
    embed: Linear
    layers: tuple[CohereLayer, ...]
    norm: tuple[mx.array, mx.array | None]
    lm_head: Linear | None  # None: the embedding (tied)
    config: CohereConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")
    pipeline: PipelineStage | None = static_field(default=None)  # a stage's (core/parallel.stage_params)


def cache_specs(cfg: CohereConfig) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim,
                           window=cfg.sliding_window if t == "sliding_attention" else None)
                 for t in cfg.layer_types)


def forward(
    p: CohereParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step`: per layer one LayerNorm, then attention
    and a SwiGLU MLP in parallel on its output."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = rope_in(geo.positions, cfg.head_dim, getattr(mx, p.dtype), base=cfg.rope_theta, traditional=True)
        entries = []
        for lp, entry, spec, kind in zip(p.layers, cache.layers, cache.layout, cfg.layer_types):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            x = layer_norm(h, *lp.norm, cfg.rms_norm_eps)
            use_rope = kind == "sliding_attention" or cfg.global_rope
            a, entry = head_norm_attention(p, lp, x, entry, spec, rope if use_rope else None, geo, traditional=True)
            h = h + a + swiglu_mlp(x, lp.gate_up, lp.down, num)
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers,
                        final_norm=lambda p, h: layer_norm(h, *p.norm, p.config.rms_norm_eps))


def hidden_to_logits(p: CohereParams, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    head = p.lm_head if p.lm_head is not None else p.embed
    return stage_logits(p, h, lambda: (linear(h, head, p.numerics) * p.config.logit_scale).astype(mx.float32))


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): one
# LayerNorm before both branches, Llama's projections, per-head q/k LayerNorm weights
# [heads, head_dim] (Command R+); the whole model's (the head is the embedding)
LAYER = (
    Norm("norm", "input_layernorm", bias="layer_norm_bias"),
    Fused("qkv", QKV, "hidden_size", bias="attention_bias"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width", bias="attention_bias"),
    *SWIGLU_MLP,
    Vec("q_norm", "self_attn.q_norm.weight", ("num_heads", "head_dim"), when="qk_norm"),
    Vec("k_norm", "self_attn.k_norm.weight", ("num_kv_heads", "head_dim"), when="qk_norm"),
)
TOP = (Embedding("embed", "model.embed_tokens"), Norm("norm", "model.norm", bias="layer_norm_bias"),
       Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"))


def assemble(cfg: CohereConfig, src: TensorSource, opts: LoadOptions) -> CohereParams:
    cfg = with_tied(cfg, src)
    rd, sizes = Reader(src, opts), attention_sizes(cfg)
    layers = tuple(CohereLayer(**read_tensors(rd, LAYER, cfg, HF_LAYER, i, sizes)) for i in range(cfg.num_layers))
    return CohereParams(layers=layers, **read_tensors(rd, TOP, cfg, sizes=sizes), config=cfg,
                        numerics=opts.numerics, dtype=opts.dtype_name)


def checkpoint_layout(cfg: CohereConfig) -> dict[str, TensorSpec]:
    h, hd, ff, v = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"model.embed_tokens.weight": TensorSpec((v, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for n, rows, cols in (("self_attn.q_proj", hq, h), ("self_attn.k_proj", hk, h), ("self_attn.v_proj", hk, h),
                              ("self_attn.o_proj", h, hq), ("mlp.gate_proj", ff, h), ("mlp.up_proj", ff, h),
                              ("mlp.down_proj", h, ff)):
            out[p + n + ".weight"] = TensorSpec((rows, cols))
            if cfg.attention_bias and n.startswith("self_attn"):
                out[p + n + ".bias"] = TensorSpec((rows,), scale=0.05)
        if cfg.qk_norm:
            out[p + "self_attn.q_norm.weight"] = TensorSpec((cfg.num_heads, hd), center=1.0, scale=0.1)
            out[p + "self_attn.k_norm.weight"] = TensorSpec((cfg.num_kv_heads, hd), center=1.0, scale=0.1)
    for n in [f"model.layers.{i}.input_layernorm" for i in range(cfg.num_layers)] + ["model.norm"]:
        out[n + ".weight"] = TensorSpec((h,), center=1.0, scale=0.1)
        if cfg.layer_norm_bias:
            out[n + ".bias"] = TensorSpec((h,), scale=0.05)
    if cfg.tie_word_embeddings is False:
        out["lm_head.weight"] = TensorSpec((v, h), scale=0.2)
    return out


def layer_range(p: CohereParams, start: int, end: int) -> CohereParams:
    return cut_layers(p, start, end, per_layer=("layer_types",))


_TINY = {
    "cohere": {"architectures": ["CohereForCausalLM"], "use_qk_norm": False},
    "cohere2": {"architectures": ["Cohere2ForCausalLM"], "head_dim": 16, "sliding_window": 16,
                "sliding_window_pattern": 4, "num_hidden_layers": 4},
}


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "layer_norm_eps": 1e-5, "vocab_size": 384,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "logit_scale": 0.25,
            "attention_bias": False, "layer_norm_bias": False, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2, **_TINY[model_type], **overrides}


# llama.cpp's command-r / cohere2 names beyond the common ones
_GGUF_TO_HF = ((r"\.attn_norm\.", ".input_layernorm."),) + GGUF_COMMON_NAMES


def assemble_gguf(cfg: CohereConfig, src: TensorSource, opts: LoadOptions) -> CohereParams:
    """Command R / R7B from llama.cpp's names (renamed only: no permutation); per-head q/k
    norms when the file has them (Command R+: llama.cpp decides by the tensors too)."""
    src = renamed(src, _GGUF_TO_HF)
    qk = cfg.model_type == "cohere" and src.has("model.layers.0.self_attn.q_norm.weight")
    return assemble(attrs.evolve(cfg, qk_norm=qk), src, opts)


def config_from_gguf(md: dict[str, Any], source: str) -> CohereConfig:
    """From llama.cpp's command-r / cohere2 metadata; cohere2 with llama.cpp's fixed choice
    of every 4th layer global."""
    arch = md.get("general.architecture")
    d = gguf_hf_config(md, arch, source, "cohere" if arch == "command-r" else "cohere2", context=8192)
    d.update(layer_norm_eps=d.pop("rms_norm_eps"), logit_scale=float(gguf_value(md, arch, "logit_scale", source)))
    if arch == "cohere2":
        d.update(sliding_window=int(gguf_value(md, arch, "attention.sliding_window", source)), sliding_window_pattern=4)
    return config_from_hf(d, source)

FAMILY = Family(
    name="cohere", model_types=("cohere", "cohere2"), config_type=CohereConfig, params_type=CohereParams,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout, tensor_split=shard_decoder,
    layer_range=layer_range,
    tiny_config=tiny_config, gguf_architectures=("command-r", "cohere2"), config_from_gguf=config_from_gguf,
    assemble_gguf=assemble_gguf,
)
