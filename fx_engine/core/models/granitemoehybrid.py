"""Granite 4.0 hybrid (`granitemoehybrid`): Mamba-2 mixers and attention layers (`layer_types`),
each followed by routed SwiGLU experts plus a shared MLP (or one dense MLP), with Granite's
embedding / attention / residual / logits multipliers; following mlx-lm 0.32's
granitemoehybrid.py (the parity oracle) where it agrees with the model's reference. Granite
3.x MoE (`granitemoe`) is the case without mixers and shared MLP: every layer attention with
RoPE, routed experts alone (mlx-lm's granitemoe.py, Hugging Face's GraniteMoe).

The mixers' gated norm runs per B/C group, as Hugging Face's GraniteMoeHybrid and Bamba
(transformers 5's GraniteMoeHybridRMSNormGated, group_size = intermediate / n_groups) and
llama.cpp run it (mlx-lm normalizes the whole width: the same at n_groups = 1, the published
checkpoints' value). It falls out of the blocks the other families
already have: `ssm.mixer`, the Llama family's attention (`attention_multiplier` as its
scale, RoPE or none), and `blocks.mixture` (top-k logits, then a softmax over them; the shared
MLP added ungated).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, read_experts, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, POSITIVE, ConfigError, Field, Same, check_rope_scaling, gguf_hf_config,
                                   gguf_ints,
                                   gguf_value, listed_eos, read_fields)
from fx_engine.core.models.blocks import (GATE_UP, HF_LAYER, QKV, STACKED_EXPERT_NAMES, Attention, DenseMlp, Experts,
                                          attention_sizes, config_rope, expert_stacks, mixture, self_attention, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.moe import MoEConfig
from fx_engine.core.models.skeleton import DecoderParams, cut_layers, decoder_step, embedded_scaled, stage_logits
from fx_engine.core.models.llama import unpermuted_qk
from fx_engine.core.models.ssm import MixerDims, gguf_mixer_names, gguf_mixer_source, mixer, mixer_layout, read_mixer
from fx_engine.core.nn import Linear, linear, rms_norm
from fx_engine.core.splits import head_range, split_attention, split_experts, split_head, split_mixer, split_mlp


@attrs.frozen
class GraniteHybridConfig(MoEConfig):
    mamba_layers: tuple[bool, ...] = ()  # per layer: a Mamba-2 mixer (else attention)
    mixer: MixerDims = None  # type: ignore[assignment]
    mamba_bias: bool = False
    conv_bias: bool = True
    use_rope: bool = True
    use_moe: bool = False


_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
# config.json's fields (read in this order; `read_fields`), and those of the Mamba-2 mixers
_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads"),
    Field("num_key_value_heads", default=Same("num_attention_heads"), or_default=True),
    Field("num_local_experts", INT, 0, or_default=True),
    Field("rms_norm_eps", FLOAT), Field("intermediate_size"), Field("vocab_size"),
    Field("max_position_embeddings", INT, 4096), Field("tie_word_embeddings", BOOL, True),
    Field("attention_bias", BOOL, False), *(Field(k, FLOAT) for k in _MULTIPLIERS),
    Field("num_experts_per_tok", INT, 1, or_default=True), Field("shared_intermediate_size", INT, 0, or_default=True),
    Field("mamba_proj_bias", BOOL, False), Field("mamba_conv_bias", BOOL, True),
)
_MAMBA_FIELDS = tuple(Field(k, POSITIVE, None) for k in ("mamba_n_heads", "mamba_d_head", "mamba_n_groups",
                                                          "mamba_d_state", "mamba_d_conv"))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> GraniteHybridConfig:
    mt = d.get("model_type", "granitemoehybrid")
    if mt == "granitemoe":  # every layer attention with RoPE, routed experts, no shared MLP
        layers = d.get("num_hidden_layers")
        if not isinstance(layers, int) or isinstance(layers, bool) or layers <= 0:
            raise ConfigError(f"{source}: field 'num_hidden_layers' must be a positive integer, got {layers!r}")
        d = {**d, "layer_types": ["attention"] * layers, "position_embedding_type": "rope",
             "shared_intermediate_size": 0}
    types = d.get("layer_types")
    if not isinstance(types, list) or not types or set(types) - {"mamba", "attention"}:
        raise ConfigError(f"{source}: layer_types must list 'mamba' / 'attention' per layer")
    pet = d.get("position_embedding_type") or "nope"  # Hugging Face's default (None): no RoPE
    if pet not in ("rope", "nope"):
        raise ConfigError(f"{source}: position_embedding_type {pet!r} is not supported (rope, nope)")
    f = read_fields(d, _FIELDS, source)
    hidden, heads, experts, eps = f["hidden_size"], f["num_attention_heads"], f["num_local_experts"], f["rms_norm_eps"]
    theta = (d.get("rope_parameters") or {}).get("rope_theta", d.get("rope_theta", 10000.0))
    lim = d.get("time_step_limit") or (0.001, 100.0)
    mix = None
    if "mamba" in types:
        m = read_fields(d, _MAMBA_FIELDS, source)
        mix = MixerDims(hidden=hidden, heads=m["mamba_n_heads"], head_dim=m["mamba_d_head"],
                        groups=m["mamba_n_groups"], state=m["mamba_d_state"], kernel=m["mamba_d_conv"],
                        dt_min=float(lim[0]), dt_max=float(lim[1]), norm_eps=eps,
                        norm_groups=m["mamba_n_groups"])
    inter = f["intermediate_size"]
    return GraniteHybridConfig(
        model_type=mt, vocab_size=f["vocab_size"], hidden_size=hidden, num_layers=len(types),
        num_heads=heads, num_kv_heads=f["num_key_value_heads"], head_dim=hidden // heads, intermediate_size=inter,
        rms_norm_eps=eps,
        rope_theta=float(theta), max_position_embeddings=f["max_position_embeddings"],
        rope_scaling=check_rope_scaling(d.get("rope_scaling"), source) if pet == "rope" else None,
        tie_word_embeddings=f["tie_word_embeddings"], qkv_bias=f["attention_bias"],
        **{k: f[k] for k in _MULTIPLIERS}, bos_token_id=d.get("bos_token_id"), eos_token_ids=listed_eos(d),
        num_experts=max(experts, 1), top_k=f["num_experts_per_tok"], moe_intermediate_size=inter,
        softmax_then_topk=False, shared_expert_intermediate_size=f["shared_intermediate_size"],
        mamba_layers=tuple(t == "mamba" for t in types), mixer=mix, mamba_bias=f["mamba_proj_bias"],
        conv_bias=f["mamba_conv_bias"], use_rope=pet == "rope", use_moe=experts > 0,
    )


@attrs.frozen
class GraniteHybridLayer:
    attn_norm: mx.array
    mixer: Any  # ssm.MixerParams | blocks.Attention
    mlp_norm: mx.array
    mlp: Any  # blocks.Experts (with the shared MLP) | blocks.DenseMlp


@attrs.frozen
class GraniteHybridParams(DecoderParams):
    """Its params (the type names the family)."""


def cache_specs(cfg: GraniteHybridConfig) -> tuple[LayerSpec, ...]:
    return tuple(cfg.mixer.state_spec() if m else LayerSpec(cfg.num_kv_heads, cfg.head_dim) for m in cfg.mamba_layers)


def forward(p: GraniteHybridParams, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `skeleton.decoder_step`: per layer a Mamba-2 mixer or attention, then
    routed experts (with a shared MLP) or a dense SwiGLU MLP, each branch times
    residual_multiplier."""
    cfg, num = p.config, p.numerics
    m = cfg.residual_multiplier

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = None
        if cfg.use_rope:
            rope = config_rope(cfg, geo.positions, getattr(mx, p.dtype))
        entries = []
        for lp, entry, spec, is_mamba in zip(p.layers, cache.layers, cache.layout, cfg.mamba_layers):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            x = rms_norm(h, lp.attn_norm, cfg.rms_norm_eps, num)
            if is_mamba:
                a, entry = mixer(lp.mixer, cfg.mixer, x, entry, spec, geo, num)
            else:
                a, entry = self_attention(p, lp.mixer, x, entry, spec, rope, geo)
            h = h + a * m
            x = rms_norm(h, lp.mlp_norm, cfg.rms_norm_eps, num)
            if isinstance(lp.mlp, Experts):
                r = mixture(cfg, lp.mlp, x, num)
            else:
                r = swiglu_mlp(x, lp.mlp.gate_up, lp.mlp.down, num)
            h = h + r * m
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers, embedded=embedded_scaled)


def hidden_to_logits(p: GraniteHybridParams, h: mx.array) -> mx.array:
    def logits() -> mx.array:
        out = linear(h, p.lm_head if p.lm_head is not None else p.embed, p.numerics)
        return (out / p.config.logits_scaling).astype(mx.float32)

    return stage_logits(p, h, logits)


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`): the
# norms; an attention layer's projections (a Mamba-2 layer's mixer is `read_mixer`'s); a
# dense MLP stored as Hugging Face does (gate|up fused: shared_mlp.input_linear) or apart
# (mlx-lm's), or a routed layer's shared MLP beside its experts (read in `assemble`). The
# whole model's: the head where untied.
NORMS = (Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
         Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"))
ATTENTION = (Fused("qkv", QKV, "hidden_size", bias="qkv_bias"),
             Lin("o", "self_attn.o_proj", "hidden_size", "q_width", bias="qkv_bias"))
DENSE = (
    Lin("gate_up", "shared_mlp.input_linear", "gate_up_width", "hidden_size", when="gate_up_stored"),
    Lin("down", "shared_mlp.output_linear", "hidden_size", "intermediate_size", when="gate_up_stored"),
    Fused("gate_up", GATE_UP, "hidden_size", bias="mlp_bias", when="gate_up_apart"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size", bias="mlp_bias", when="gate_up_apart"),
)
SHARED = (
    Lin("shared_gate_up", "shared_mlp.input_linear", "shared_gate_up_width", "hidden_size", when="shared_stored"),
    Lin("shared_down", "shared_mlp.output_linear", "hidden_size", "shared_expert_intermediate_size",
        when="shared_stored"),
    # (llama.cpp's converter splits input_linear into ffn_gate_shexp / ffn_up_shexp)
    Fused("shared_gate_up", (("shared_mlp.gate_proj", "shared_expert_intermediate_size"),
                             ("shared_mlp.up_proj", "shared_expert_intermediate_size")), "hidden_size",
          when="shared_apart"),
    Lin("shared_down", "shared_mlp.down_proj", "hidden_size", "shared_expert_intermediate_size", when="shared_apart"),
)
TOP = (Embedding("embed", "model.embed_tokens"), Vec("norm", "model.norm.weight", "hidden_size"),
       Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"))


def assemble(cfg: GraniteHybridConfig, src: TensorSource, opts: LoadOptions) -> GraniteHybridParams:
    rd = Reader(src, opts)
    sizes = {**attention_sizes(cfg), "gate_up_width": 2 * cfg.intermediate_size,
             "shared_gate_up_width": 2 * cfg.shared_expert_intermediate_size}

    def layer(i: int, is_mamba: bool) -> GraniteHybridLayer:
        p = HF_LAYER.format(i=i)
        mix = (read_mixer(src, p + "mamba.", cfg.mixer, opts, cfg.mamba_bias, cfg.conv_bias) if is_mamba
               else Attention(**read_tensors(rd, ATTENTION, cfg, HF_LAYER, i, sizes)))
        if cfg.use_moe:
            shared, stored = cfg.shared_expert_intermediate_size > 0, rd.has(p + "shared_mlp.input_linear.weight")
            flags = {"shared_stored": shared and stored, "shared_apart": shared and not stored}
            mlp: Any = Experts(router=rd.linear(p + "block_sparse_moe.router.layer", cfg.num_experts, cfg.hidden_size),
                               **_expert_stacks(cfg, rd, p + "block_sparse_moe."),
                               **read_tensors(rd, SHARED, cfg, HF_LAYER, i, {**sizes, **flags}))
        else:
            stored = rd.has(p + "shared_mlp.input_linear.weight")
            flags = {"gate_up_stored": stored, "gate_up_apart": not stored}
            mlp = DenseMlp(**read_tensors(rd, DENSE, cfg, HF_LAYER, i, {**sizes, **flags}))
        return GraniteHybridLayer(**read_tensors(rd, NORMS, cfg, HF_LAYER, i), mixer=mix, mlp=mlp)

    return GraniteHybridParams(
        layers=tuple(layer(i, m) for i, m in enumerate(cfg.mamba_layers)), **read_tensors(rd, TOP, cfg, sizes=sizes),
        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def _expert_stacks(cfg: GraniteHybridConfig, rd: Reader, m: str) -> dict[str, Linear]:
    """The experts' gate_up and down under `m` (block_sparse_moe.): Hugging Face's fused
    input_linear [E, 2F, H] (gate rows first) and output_linear, or mlx-lm's stacks."""
    src, opts, e, f, hid = rd.src, rd.opts, cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if src.has(m + "input_linear.weight"):
        gu = src.get(m + "input_linear.weight", (e, 2 * f, hid), opts.where)
        gate, up = Linear(weight=gu[:, :f]), Linear(weight=gu[:, f:])
        down = Linear(weight=src.get(m + "output_linear.weight", (e, hid, f), opts.where))
    else:
        gate, up, down = (read_experts(src, m + st, "", e, o, n, opts.quant_for, opts.where) for st, (o, n) in
                          zip(STACKED_EXPERT_NAMES, ((f, hid), (f, hid), (hid, f))))
    return expert_stacks(gate, up, down, opts)


# llama.cpp's names (convert_hf_to_gguf.py's GraniteHybridModel: Mamba2Model's mixers,
# GraniteMoeModel's attention with LlamaModel's q/k row permutation, experts stacked, the
# shared MLP's input split in two) -> Hugging Face's (the experts as mlx-lm's stacks)
GGUF_TO_HF = gguf_mixer_names("mamba") + (
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.ffn_gate_inp\.", ".block_sparse_moe.router.layer."),
    (r"\.ffn_(gate|up|down)_exps\.", r".block_sparse_moe.switch_mlp.\1_proj."),
    (r"\.ffn_(gate|up|down)_shexp\.", r".shared_mlp.\1_proj."),
) + GGUF_COMMON_NAMES


def config_from_gguf(md: dict[str, Any], source: str) -> GraniteHybridConfig:
    """Granite 4.0 hybrid (and Bamba) from llama.cpp's granitehybrid metadata: the layer kinds
    from attention.head_count_kv per layer (0 on Mamba-2 layers), Granite's multipliers as
    its *_scale keys, the mixers' ssm.* sizes (time_step_rank: the mixer's heads), RoPE only
    where rope.scaling.finetuned says (the converter's flag for it: Granite 4.0's hybrids run
    without). The time step is not clamped (llama.cpp's scan; the file carries no limit)."""
    arch = "granitehybrid"

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    per_layer = gguf_ints(md, f"{arch}.attention.head_count_kv") or []
    d = gguf_hf_config({k: v for k, v in md.items() if k != f"{arch}.attention.head_count_kv"}, arch, source,
                       "granitemoehybrid")
    n = d.pop("num_hidden_layers")
    if len(per_layer) == 1:  # one count for every layer: all attention
        per_layer = per_layer * n
    if len(per_layer) != n or len({x for x in per_layer if x}) > 1:
        raise ConfigError(f"{source}: {arch}.attention.head_count_kv {per_layer}: expected one KV head count on the "
                          f"attention layers and 0 on the Mamba-2 layers, {n} entries")
    inner, heads = int(val("ssm.inner_size", 0) or 0), int(val("ssm.time_step_rank", 0) or 0)
    experts = int(val("expert_count", 0) or 0)
    d.update(
        layer_types=["attention" if x else "mamba" for x in per_layer],
        num_key_value_heads=max(per_layer) or d["num_attention_heads"],
        num_local_experts=experts, num_experts_per_tok=int(val("expert_used_count", 1) or 1),
        shared_intermediate_size=int(val("expert_shared_feed_forward_length", 0) or 0),
        attention_multiplier=float(val("attention.scale")), embedding_multiplier=float(val("embedding_scale")),
        residual_multiplier=float(val("residual_scale")), logits_scaling=float(val("logit_scale")),
        position_embedding_type="rope" if val("rope.scaling.finetuned", False) else "nope",
        time_step_limit=(0.0, float("inf")))
    if 0 in per_layer:
        if not heads or inner % heads:
            raise ConfigError(f"{source}: {arch}.ssm.inner_size ({inner}) is not a multiple of "
                              f"{arch}.ssm.time_step_rank ({heads}, the mixers' heads)")
        d.update(mamba_n_heads=heads, mamba_d_head=inner // heads, mamba_n_groups=int(val("ssm.group_count")),
                 mamba_d_state=int(val("ssm.state_size")), mamba_d_conv=int(val("ssm.conv_kernel")))
    return config_from_hf(d, source)


def assemble_gguf(cfg: GraniteHybridConfig, src: TensorSource, opts: LoadOptions) -> GraniteHybridParams:
    """Params from llama.cpp's tensors: q/k rows un-permuted (the converter permutes them for
    interleaved RoPE, even where the model runs none), the mixers' vectors reshaped
    (`ssm.gguf_mixer_source`); the biases, the tied head and the vocabulary's rows (the
    converter pads the vocabulary list) as the tensors say."""
    src = gguf_mixer_source(renamed(unpermuted_qk(cfg, src), GGUF_TO_HF))
    first = next((i for i, m in enumerate(cfg.mamba_layers) if m), None)
    mamba = f"model.layers.{first}.mamba." if first is not None else None
    cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight"),
                       vocab_size=int(src.get("model.embed_tokens.weight").shape[0]),
                       mamba_bias=bool(mamba and src.has(mamba + "in_proj.bias")),
                       conv_bias=bool(mamba and src.has(mamba + "conv1d.bias")))
    return assemble(cfg, src, opts)


def checkpoint_layout(cfg: GraniteHybridConfig) -> dict[str, TensorSpec]:
    """Hugging Face's names (fused expert and shared-MLP input projections)."""
    hid, d = cfg.hidden_size, cfg.head_dim
    hq, hk = cfg.num_heads * d, cfg.num_kv_heads * d
    norm = TensorSpec((hid,), center=1.0, scale=0.1)
    out = {"model.embed_tokens.weight": TensorSpec((cfg.vocab_size, hid), scale=0.5), "model.norm.weight": norm}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((cfg.vocab_size, hid))
    for i, is_mamba in enumerate(cfg.mamba_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = out[p + "post_attention_layernorm.weight"] = norm
        if is_mamba:
            out.update(mixer_layout(p + "mamba.", cfg.mixer, cfg.mamba_bias, cfg.conv_bias))
        else:
            for n, shape in (("q_proj", (hq, hid)), ("k_proj", (hk, hid)), ("v_proj", (hk, hid)), ("o_proj", (hid, hq))):
                out[p + "self_attn." + n + ".weight"] = TensorSpec(shape)
        if cfg.use_moe:
            e, f, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            out[p + "block_sparse_moe.router.layer.weight"] = TensorSpec((e, hid), scale=0.3)
            out[p + "block_sparse_moe.input_linear.weight"] = TensorSpec((e, 2 * f, hid))
            out[p + "block_sparse_moe.output_linear.weight"] = TensorSpec((e, hid, f))
            if s:
                out[p + "shared_mlp.input_linear.weight"] = TensorSpec((2 * s, hid))
                out[p + "shared_mlp.output_linear.weight"] = TensorSpec((hid, s))
        else:
            ff = cfg.intermediate_size
            out[p + "shared_mlp.input_linear.weight"] = TensorSpec((2 * ff, hid))
            out[p + "shared_mlp.output_linear.weight"] = TensorSpec((hid, ff))
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    if model_type == "granitemoe":  # (Granite 3.x MoE's own fields: no layer kinds, mixers or shared MLP)
        return {"model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"], "vocab_size": 384,
                "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 2048,
                "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
                "embedding_multiplier": 12.0, "attention_multiplier": 0.125, "logits_scaling": 4.0,
                "residual_multiplier": 0.25, "rms_norm_eps": 1e-6, "num_local_experts": 4, "num_experts_per_tok": 2,
                "tie_word_embeddings": True, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
                **overrides}
    return {"model_type": "granitemoehybrid", "architectures": ["GraniteMoeHybridForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 4, "max_position_embeddings": 2048,
            "num_attention_heads": 4, "num_key_value_heads": 2, "attention_bias": False,
            "embedding_multiplier": 12.0, "attention_multiplier": 0.125, "logits_scaling": 4.0,
            "residual_multiplier": 0.25, "layer_types": ["mamba", "attention", "mamba", "mamba"],
            "rms_norm_eps": 1e-5, "num_local_experts": 4, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
            "mamba_n_heads": 8, "mamba_d_head": 8, "mamba_proj_bias": False, "mamba_d_state": 16,
            "mamba_d_conv": 4, "mamba_conv_bias": True, "position_embedding_type": "rope",
            # one group: mlx-lm (the registry's parity oracle) normalizes the whole width
            # (tests/models/test_ssm_reference.py checks grouped norms)
            "mamba_n_groups": 1,
            "tie_word_embeddings": True, "rope_theta": 10000.0, "time_step_limit": [0.001, 100.0],
            "bos_token_id": 1, "eos_token_id": 2, **overrides}

def layer_range(p: GraniteHybridParams, start: int, end: int) -> GraniteHybridParams:
    """The params of layers [start, end) (`family.cut_layers`)."""
    return cut_layers(p, start, end, per_layer=("mamba_layers", "moe_layers"))


def tensor_split(p: GraniteHybridParams, rank: int, size: int) -> GraniteHybridParams:
    """Rank `rank` of `size`'s shard (core/parallel.py): mixers' and attention heads, MLP and
    experts' intermediate features (the router replicated), the vocabulary."""
    cfg = p.config
    q0, q1, k0, k1 = head_range(cfg.num_heads, cfg.num_kv_heads, rank, size)
    layers, dims = [], cfg.mixer
    for i, (lp, is_mamba) in enumerate(zip(p.layers, cfg.mamba_layers)):
        name = f"layer {i}"
        if is_mamba:
            m, dims = split_mixer(lp.mixer, cfg.mixer, rank, size, name)
        else:
            m = split_attention(lp.mixer, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rank, size, name)
        mlp = split_experts(lp.mlp, rank, size, i) if isinstance(lp.mlp, Experts) else split_mlp(lp.mlp, rank, size, name)
        layers.append(attrs.evolve(lp, mixer=m, mlp=mlp))
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, mixer=dims)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=small), rank, size)


FAMILY = Family(
    name="granitemoehybrid", model_types=("granitemoehybrid", "granitemoe"), config_type=GraniteHybridConfig,
    params_type=GraniteHybridParams, config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs,
    forward=forward, hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
    gguf_architectures=("granitehybrid",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
