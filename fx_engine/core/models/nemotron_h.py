"""Nemotron-H (`nemotron_h`): a hybrid of Mamba-2 mixers, attention, MLP and mixture-of-
experts layers, following mlx-lm 0.32's nemotron_h.py (the parity oracle).

The layer pattern (`hybrid_override_pattern`, or `layers_block_type` / `layer_types`) names
one block per layer: M (the Mamba-2 mixer, with its gated norm per group of n_groups:
`mamba2.mixer`), * (attention without RoPE or q/k norms), - (a relu^2 MLP without a gate),
E (relu^2 experts routed by sigmoid scores plus a correction bias, DeepSeek-style groups,
and shared experts). Every layer is `h + block(rms_norm(h))` with one norm. Only M and *
layers have cache entries: a recurrent state, or K/V. The output head is never tied.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (Embedding, Fused, Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec,
                                       finish_experts, read_experts, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, BaseConfig, ConfigError, Field, gguf_hf_config, gguf_ints,
                                   gguf_value, listed_eos, positive_int, read_fields, trunk_layers)
from fx_engine.core.models.blocks import Attention, attention_sizes, grouped_route, self_attention
from fx_engine.core.models.family import Family
from fx_engine.core.models.skeleton import DecoderParams, cut_layers, decoder_step, head_logits
from fx_engine.core.models.llama import unpermuted_qk
from fx_engine.core.models.ssm import (MixerDims, MixerParams, gguf_mixer_names, gguf_mixer_source, mixer, mixer_layout,
                                       read_mixer)
from fx_engine.core.nn import Linear, Numerics, linear, rms_norm, routed_mixture
from fx_engine.core.splits import (head_range, split, split_attention, split_cols, split_head, split_mixer, split_mlp,
                                    split_rows)

_KINDS = {"full_attention": "*", "attention": "*", "linear_attention": "M", "mamba": "M", "conv": "M",
          "moe": "E", "mlp": "-"}


@attrs.frozen
class NemotronHConfig(BaseConfig):
    pattern: str = ""  # one of M * - E per layer
    mixer: MixerDims = None  # type: ignore[assignment]
    attention_bias: bool = False
    mlp_bias: bool = False
    mamba_bias: bool = False
    conv_bias: bool = True
    # experts (E layers)
    num_experts: int = 0
    top_k: int = 1
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # 0: no shared expert
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # the attention helpers (blocks.self_attention) read these
    rope_traditional: bool = False
    tie_word_embeddings: bool = False


def _pattern(d: dict[str, Any], source: str) -> str:
    pat = d.get("hybrid_override_pattern")
    if pat is None:
        types = d.get("layers_block_type") or d.get("layer_types")
        if not isinstance(types, list):
            raise ConfigError(f"{source}: 'hybrid_override_pattern' (or 'layers_block_type') is required")
        bad = [t for t in types if t not in _KINDS]
        if bad:
            raise ConfigError(f"{source}: unknown layer type {bad[0]!r} (known: {sorted(_KINDS)})")
        pat = "".join(_KINDS[t] for t in types)
    pat = "".join(pat)
    if not pat or set(pat) - set("M*-E"):
        raise ConfigError(f"{source}: hybrid_override_pattern must be made of M, *, - and E, got {pat!r}")
    return pat


# config.json's fields (read in this order; `read_fields`): required sizes, then optional ones
_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads"), Field("n_groups"), Field("mamba_num_heads"),
    Field("mamba_head_dim"), Field("ssm_state_size"), Field("conv_kernel"), Field("vocab_size"),
    Field("layer_norm_epsilon", FLOAT, 1e-5), Field("n_routed_experts", INT, 0, or_default=True),
    Field("intermediate_size", INT, 0, or_default=True), Field("attention_bias", BOOL, False),
    Field("mlp_bias", BOOL, False), Field("use_bias", BOOL, False), Field("use_conv_bias", BOOL, True),
    Field("num_experts_per_tok", INT, 1, or_default=True), Field("moe_intermediate_size", INT, 0, or_default=True),
    Field("moe_shared_expert_intermediate_size", INT, 0, or_default=True), Field("n_group", INT, 1, or_default=True),
    Field("topk_group", INT, 1, or_default=True), Field("norm_topk_prob", BOOL, True),
    Field("routed_scaling_factor", FLOAT, 1.0, or_default=True), Field("max_position_embeddings", INT, 4096),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> NemotronHConfig:
    pat = _pattern(d, source)
    if d.get("moe_latent_size"):
        raise ConfigError(f"{source}: field 'moe_latent_size' is not supported")
    f = read_fields(d, _FIELDS, source)
    hidden, heads, groups, eps = f["hidden_size"], f["num_attention_heads"], f["n_groups"], f["layer_norm_epsilon"]
    kv = positive_int(d.get("num_key_value_heads") or heads, "num_key_value_heads", source)
    lim = d.get("time_step_limit") or (0.0, math.inf)
    mix = MixerDims(hidden=hidden, heads=f["mamba_num_heads"], head_dim=f["mamba_head_dim"], groups=groups,
                    state=f["ssm_state_size"], kernel=f["conv_kernel"], dt_min=float(lim[0]), dt_max=float(lim[1]),
                    norm_eps=eps, norm_groups=groups)
    experts = f["n_routed_experts"]
    if "E" in pat and not experts:
        raise ConfigError(f"{source}: E (mixture-of-experts) layers need 'n_routed_experts'")
    return NemotronHConfig(
        model_type="nemotron_h", vocab_size=f["vocab_size"], hidden_size=hidden, num_layers=len(pat),
        num_heads=heads, num_kv_heads=kv, head_dim=int(d.get("head_dim") or hidden // heads),
        intermediate_size=f["intermediate_size"], rms_norm_eps=eps, pattern=pat, mixer=mix,
        attention_bias=f["attention_bias"], mlp_bias=f["mlp_bias"], mamba_bias=f["use_bias"],
        conv_bias=f["use_conv_bias"], num_experts=experts, top_k=f["num_experts_per_tok"],
        moe_intermediate_size=f["moe_intermediate_size"],
        shared_intermediate_size=f["moe_shared_expert_intermediate_size"] if d.get("n_shared_experts") else 0,
        n_group=f["n_group"], topk_group=f["topk_group"], norm_topk_prob=f["norm_topk_prob"],
        routed_scaling_factor=f["routed_scaling_factor"], max_position_embeddings=f["max_position_embeddings"],
        bos_token_id=d.get("bos_token_id"), eos_token_ids=listed_eos(d),
    )


@attrs.frozen
class Relu2Mlp:
    up: Linear
    down: Linear


@attrs.frozen
class ExpertsParams:
    router: Linear  # [E, H]
    correction_bias: mx.array  # [E] float32
    fc1: Linear  # stacked [E, F, H]
    fc2: Linear  # stacked [E, H, F]
    shared: Relu2Mlp | None


@attrs.frozen
class NemotronHLayer:
    norm: mx.array
    block: Any  # MixerParams | Attention | Relu2Mlp | ExpertsParams


@attrs.frozen
class NemotronHParams(DecoderParams):
    """Its params (the type names the family)."""


def cache_specs(cfg: NemotronHConfig) -> tuple[LayerSpec, ...]:
    """One entry per M layer (a recurrent state) and * layer (K/V), in layer order."""
    return tuple(cfg.mixer.state_spec() if k == "M" else LayerSpec(cfg.num_kv_heads, cfg.head_dim)
                 for k in cfg.pattern if k in "M*")


def _relu2(x: mx.array) -> mx.array:
    return mx.square(mx.maximum(x, 0.0))


def _mlp(m: Relu2Mlp, x: mx.array, num: Numerics) -> mx.array:
    return linear(_relu2(linear(x, m.up, num)), m.down, num)


def _experts(cfg: NemotronHConfig, ex: ExpertsParams, x: mx.array, num: Numerics) -> mx.array:
    idx, w = grouped_route(linear(x, ex.router, num), ex.correction_bias, cfg.top_k, cfg.n_group,
                           cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)
    y = routed_mixture(x, ex.fc1, ex.fc2, idx, w, _relu2, num)  # [N, H]
    return y if ex.shared is None else y + _mlp(ex.shared, x, num)


def forward(p: NemotronHParams, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `skeleton.decoder_step`: per layer, by the pattern, a Mamba-2 mixer
    (M), attention (*), a ReLU^2 MLP (-) or routed experts (E), each a pre-norm residual
    branch."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        entries, at = list(cache.layers), 0
        for kind, lp in zip(cfg.pattern, p.layers):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            x = rms_norm(h, lp.norm, cfg.rms_norm_eps, num)
            if kind == "M":
                out, entries[at] = mixer(lp.block, cfg.mixer, x, entries[at], cache.layout[at], geo, num)
                at += 1
            elif kind == "*":
                out, entries[at] = self_attention(p, lp.block, x, entries[at], cache.layout[at], None, geo)
                at += 1
            elif kind == "-":
                out = _mlp(lp.block, x, num)
            else:
                out = _experts(cfg, lp.block, x, num)
            h = h + out
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


hidden_to_logits = head_logits


# Each layer's params from its tensors under backbone.layers.{i}. (`read_tensors`): its
# norm, then one block under mixer.: a Mamba-2 mixer (`read_mixer`), attention, a ReLU^2
# MLP (`mlp_width` wide: the layer's, or the shared experts' beside routed ones), or
# routed experts (`_read_experts`). The whole model's: the head is its own.
LAYER = "backbone.layers.{i}."
ATTENTION = (Fused("qkv", (("q_proj", "q_width"), ("k_proj", "kv_width"), ("v_proj", "kv_width")), "hidden_size",
                   bias="attention_bias"),
             Lin("o", "o_proj", "hidden_size", "q_width", bias="attention_bias"))
RELU2 = (Lin("up", "up_proj", "mlp_width", "hidden_size", bias="mlp_bias"),
         Lin("down", "down_proj", "hidden_size", "mlp_width", bias="mlp_bias"))
TOP = (Embedding("embed", "backbone.embeddings"), Vec("norm", "backbone.norm_f.weight", "hidden_size"),
       Lin("lm_head", "lm_head", "vocab_size", "hidden_size"))


def assemble(cfg: NemotronHConfig, src: TensorSource, opts: LoadOptions) -> NemotronHParams:
    rd, sizes = Reader(src, opts), {**attention_sizes(cfg), "mlp_width": cfg.intermediate_size}

    def block(p: str, kind: str) -> Any:
        if kind == "M":
            return read_mixer(src, p, cfg.mixer, opts, cfg.mamba_bias, cfg.conv_bias)
        if kind == "*":
            return Attention(**read_tensors(rd, ATTENTION, cfg, p, sizes=sizes))
        if kind == "-":
            return Relu2Mlp(**read_tensors(rd, RELU2, cfg, p, sizes=sizes))
        return _read_experts(cfg, rd, p)

    layers = tuple(NemotronHLayer(norm=rd.vec(LAYER.format(i=i) + "norm.weight", cfg.hidden_size),
                                  block=block(LAYER.format(i=i) + "mixer.", kind))
                   for i, kind in enumerate(cfg.pattern))
    return NemotronHParams(layers=layers, **read_tensors(rd, TOP, cfg), config=cfg, numerics=opts.numerics,
                           dtype=opts.dtype_name)


def _read_experts(cfg: NemotronHConfig, rd: Reader, p: str) -> ExpertsParams:
    """A routed layer's experts under `p`: the router and its selection bias, the fc1 / fc2
    stacks (mlx-lm's) or one tensor per expert (Hugging Face's), the shared ReLU^2 MLP."""
    src, opts, hid, e, f = rd.src, rd.opts, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    stack = lambda lin: finish_experts(lin, opts.dtype, opts.keep_quantized)  # noqa: E731
    s = cfg.shared_intermediate_size
    return ExpertsParams(
        router=rd.linear(p + "gate", e, hid),
        correction_bias=src.get(p + "gate.e_score_correction_bias", (e,), opts.where).astype(mx.float32),
        fc1=stack(read_experts(src, p + "switch_mlp.fc1", p + "experts.{e}.up_proj", e, f, hid, opts.quant_for,
                               opts.where)),
        fc2=stack(read_experts(src, p + "switch_mlp.fc2", p + "experts.{e}.down_proj", e, hid, f, opts.quant_for,
                               opts.where)),
        shared=Relu2Mlp(**read_tensors(rd, RELU2, cfg, p + "shared_experts.", sizes={"mlp_width": s})) if s else None)


# llama.cpp's names (convert_hf_to_gguf.py's NemotronHModel over GraniteHybridModel: Mamba2Model's
# mixers, LlamaModel's q/k row permutation, experts stacked; nemotron_h_moe for the routed
# models) -> Hugging Face's (the experts as mlx-lm's fc1 / fc2 stacks)
GGUF_ARCHS = ("nemotron_h", "nemotron_h_moe")
GGUF_TO_HF = (
    (r"^blk\.(\d+)\.attn_norm\.", r"backbone.layers.\1.norm."), *gguf_mixer_names("mixer"),
    (r"\.attn_(q|k|v)\.", r".mixer.\1_proj."), (r"\.attn_output\.", ".mixer.o_proj."),
    (r"\.ffn_up_exps\.", ".mixer.switch_mlp.fc1."), (r"\.ffn_down_exps\.", ".mixer.switch_mlp.fc2."),
    (r"\.ffn_(up|down)_shexp\.", r".mixer.shared_experts.\1_proj."), (r"\.ffn_gate_inp\.", ".mixer.gate."),
    (r"\.exp_probs_b(\.bias)?$", ".mixer.gate.e_score_correction_bias"), (r"\.ffn_(up|down)\.", r".mixer.\1_proj."),
    (r"^blk\.(\d+)\.", r"backbone.layers.\1."), (r"^token_embd\.", "backbone.embeddings."),
    (r"^output_norm\.", "backbone.norm_f."), (r"^output\.", "lm_head."),
)


def _per_layer(md: dict[str, Any], key: str, n: int, source: str) -> list[int]:
    """A per-layer metadata array (one value repeated where the file stores a scalar), its
    first n entries (the trunk's: llama.cpp counts an MTP block after them)."""
    values = gguf_ints(md, key)
    if values is None:
        raise ConfigError(f"{source}: GGUF metadata '{key}' is missing")
    values = values * n if len(values) == 1 else values
    if len(values) < n:
        raise ConfigError(f"{source}: GGUF metadata '{key}' has {len(values)} entries for {n} layers")
    return values[:n]


def config_from_gguf(md: dict[str, Any], source: str) -> NemotronHConfig:
    """Nemotron-H from llama.cpp's nemotron_h / nemotron_h_moe metadata: the layer pattern
    from the per-layer arrays (attention.head_count_kv > 0: attention; feed_forward_length >
    0: the MLP, or the routed experts in nemotron_h_moe; else a Mamba-2 mixer), the mixers'
    ssm.* sizes, the experts' keys; an MTP block after the trunk (nextn_predict_layers) is
    not run."""
    arch = md.get("general.architecture")

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    n = trunk_layers(md, arch, source)
    kv = _per_layer(md, f"{arch}.attention.head_count_kv", n, source)
    ff = _per_layer(md, f"{arch}.feed_forward_length", n, source)
    if len({x for x in kv if x}) > 1:
        raise ConfigError(f"{source}: {arch}.attention.head_count_kv {kv}: expected one KV head count on the "
                          "attention layers")
    routed = arch == "nemotron_h_moe"
    pattern = "".join("*" if k else ("E" if routed else "-") if f else "M" for k, f in zip(kv, ff))
    d = gguf_hf_config({k: v for k, v in md.items() if k not in (f"{arch}.attention.head_count_kv",)}, arch, source,
                       "nemotron_h", ffn=False)
    inner, heads = int(val("ssm.inner_size")), int(val("ssm.time_step_rank"))
    if heads < 1 or inner % heads:
        raise ConfigError(f"{source}: {arch}.ssm.inner_size ({inner}) is not a multiple of {arch}.ssm.time_step_rank "
                          f"({heads}, the mixers' heads)")
    d.update(hybrid_override_pattern=pattern, num_key_value_heads=max(kv) or d["num_attention_heads"],
             layer_norm_epsilon=d.pop("rms_norm_eps"), n_groups=int(val("ssm.group_count")), mamba_num_heads=heads,
             mamba_head_dim=inner // heads, ssm_state_size=int(val("ssm.state_size")),
             conv_kernel=int(val("ssm.conv_kernel")), intermediate_size=0 if routed else max(ff),
             time_step_limit=(0.0, float("inf")))
    if routed:
        d.update(n_routed_experts=int(val("expert_count")), num_experts_per_tok=int(val("expert_used_count")),
                 moe_intermediate_size=int(val("expert_feed_forward_length")),
                 moe_shared_expert_intermediate_size=int(val("expert_shared_feed_forward_length", 0) or 0),
                 n_shared_experts=int(val("expert_shared_count", 0) or 0),
                 n_group=int(val("expert_group_count", 1) or 1), topk_group=int(val("expert_group_used_count", 1) or 1),
                 norm_topk_prob=bool(val("expert_weights_norm", True)),
                 routed_scaling_factor=float(val("expert_weights_scale", 1.0) or 1.0))
        if val("moe_latent_size", None):
            raise ConfigError(f"{source}: {arch}.moe_latent_size is not supported")
    return config_from_hf(d, source)


def assemble_gguf(cfg: NemotronHConfig, src: TensorSource, opts: LoadOptions) -> NemotronHParams:
    """Params from llama.cpp's tensors: q/k rows un-permuted (the converter permutes them
    though no RoPE runs), the mixers' vectors reshaped (`ssm.gguf_mixer_source`), the biases
    as the tensors say."""
    src = gguf_mixer_source(renamed(unpermuted_qk(cfg, src), GGUF_TO_HF))
    first = {k: next((i for i, c in enumerate(cfg.pattern) if c == k), None) for k in "M*-E"}
    layer = lambda k: f"backbone.layers.{first[k]}.mixer." if first[k] is not None else None  # noqa: E731
    has = lambda k, name: layer(k) is not None and src.has(layer(k) + name)  # noqa: E731
    cfg = attrs.evolve(cfg, mamba_bias=has("M", "in_proj.bias"), conv_bias=has("M", "conv1d.bias"),
                       attention_bias=has("*", "q_proj.bias"), mlp_bias=has("-", "up_proj.bias"),
                       vocab_size=int(src.get("backbone.embeddings.weight").shape[0]))
    return assemble(cfg, src, opts)


def checkpoint_layout(cfg: NemotronHConfig) -> dict[str, TensorSpec]:
    """Hugging Face's names (experts one tensor each, conv weights [C, 1, K])."""
    hid, hd = cfg.hidden_size, cfg.head_dim
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    out = {"backbone.embeddings.weight": TensorSpec((cfg.vocab_size, hid), scale=0.5),
           "backbone.norm_f.weight": TensorSpec((hid,), center=1.0, scale=0.1),
           "lm_head.weight": TensorSpec((cfg.vocab_size, hid))}
    for i, kind in enumerate(cfg.pattern):
        p = f"backbone.layers.{i}.mixer."
        out[f"backbone.layers.{i}.norm.weight"] = TensorSpec((hid,), center=1.0, scale=0.1)
        if kind == "M":
            out.update(mixer_layout(p, cfg.mixer, cfg.mamba_bias, cfg.conv_bias))
        elif kind == "*":
            for n, shape in (("q_proj", (hq, hid)), ("k_proj", (hk, hid)), ("v_proj", (hk, hid)),
                             ("o_proj", (hid, hq))):
                out[p + n + ".weight"] = TensorSpec(shape)
        elif kind == "-":
            out[p + "up_proj.weight"] = TensorSpec((cfg.intermediate_size, hid))
            out[p + "down_proj.weight"] = TensorSpec((hid, cfg.intermediate_size))
        else:
            e, f = cfg.num_experts, cfg.moe_intermediate_size
            out[p + "gate.weight"] = TensorSpec((e, hid), scale=0.3)
            out[p + "gate.e_score_correction_bias"] = TensorSpec((e,), scale=0.05)
            for j in range(e):
                out[p + f"experts.{j}.up_proj.weight"] = TensorSpec((f, hid))
                out[p + f"experts.{j}.down_proj.weight"] = TensorSpec((hid, f))
            if cfg.shared_intermediate_size:
                out[p + "shared_experts.up_proj.weight"] = TensorSpec((cfg.shared_intermediate_size, hid))
                out[p + "shared_experts.down_proj.weight"] = TensorSpec((hid, cfg.shared_intermediate_size))
    return out


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 2048,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "attention_bias": False,
            "mamba_num_heads": 8, "mamba_head_dim": 8, "mamba_proj_bias": False, "ssm_state_size": 16,
            "conv_kernel": 4, "n_groups": 2, "mlp_bias": False, "layer_norm_epsilon": 1e-5,
            "use_bias": False, "use_conv_bias": True, "hybrid_override_pattern": "M-M*E",
            "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 64, "n_shared_experts": 1, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
            "time_step_limit": [0.0, 100.0], "bos_token_id": 1, "eos_token_id": 2, **overrides}

def layer_range(p: NemotronHParams, start: int, end: int) -> NemotronHParams:
    """The params of layers [start, end) (`family.cut_layers`; the layer pattern cut, so a
    stage's cache holds its own M and * layers' entries)."""
    return cut_layers(p, start, end, per_layer=("pattern",))


def tensor_split(p: NemotronHParams, rank: int, size: int) -> NemotronHParams:
    """Rank `rank` of `size`'s shard (core/parallel.py): mixers' heads, attention heads, MLP
    and experts' intermediate features (the router replicated), the vocabulary."""
    cfg = p.config
    q0, q1, k0, k1 = head_range(cfg.num_heads, cfg.num_kv_heads, rank, size)
    layers, dims = [], cfg.mixer
    for i, (kind, lp) in enumerate(zip(cfg.pattern, p.layers)):
        name, b = f"layer {i}", lp.block
        if kind == "M":
            b, dims = split_mixer(b, cfg.mixer, rank, size, name)
        elif kind == "*":
            b = split_attention(b, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, rank, size, name)
        elif kind == "-":
            b = split_mlp(b, rank, size, name, up="up", fused=False)
        else:
            f = b.fc2.in_features
            f0, f1 = split(f, size, rank, b.fc2.quant.group_size if b.fc2.quantized else 1)
            b = attrs.evolve(b, fc1=split_rows(b.fc1, [(f0, f1)]), fc2=split_cols(b.fc2, f0, f1, f"{name} experts' down"),
                             shared=None if b.shared is None else split_mlp(b.shared, rank, size, name, up="up",
                                                                            fused=False))
        layers.append(attrs.evolve(lp, block=b))
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, mixer=dims)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=small), rank, size)


FAMILY = Family(
    name="nemotron_h", model_types=("nemotron_h",), config_type=NemotronHConfig,
    params_type=NemotronHParams, config_from_hf=config_from_hf, assemble=assemble,
    cache_specs=cache_specs, forward=forward, hidden_to_logits=hidden_to_logits,
    checkpoint_layout=checkpoint_layout, tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
    gguf_architectures=GGUF_ARCHS, config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)

__all__ = ["FAMILY", "NemotronHConfig", "NemotronHParams", "MixerParams", "Attention"]
