"""Mixture-of-experts decoders of the Llama shape: `qwen3_moe`, `qwen2_moe`, `mixtral`,
`olmoe` and `glm4_moe`, following mlx-lm 0.32's implementations (the parity oracle) and Hugging Face's
configs.

Attention is the Llama family's (`blocks.self_attention`: fused q|k|v, GQA, RoPE; qwen3_moe's
per-head q/k norms, qwen2_moe's q/k/v biases, OLMoE's q/k norms over whole projections);
the MLP of each MoE layer is a router over E experts, each token's top-k experts (gated
SwiGLU MLPs, stacked [E, ...] and run through `nn.routed_glu`: only the chosen experts'
weights are read) weighted by the router's probabilities:
- qwen3_moe / qwen2_moe / olmoe: softmax over all E, then the top k (renormalized to sum to
  1 where `norm_topk_prob`);
- mixtral: the top k logits, then a softmax over those k (the same weights in exact
  arithmetic as renormalized top-k probabilities; computed as mlx-lm does);
- glm4_moe: DeepSeek-V3's grouped sigmoid routing (`grouped_route`), ungated shared
  experts, dense first layers, RoPE on part of each head;
- qwen2_moe adds a shared expert to every token, gated by sigmoid(shared_expert_gate(x));
- qwen2_moe / qwen3_moe layers listed in `mlp_only_layers`, or off the `decoder_sparse_step`
  grid, have a dense SwiGLU MLP instead.
Qwen3-VL-MoE (`qwen3_vl_moe`, a multimodal wrapper) runs its Qwen3-MoE text model here with
`llama.forward`'s image inputs (interleaved M-RoPE, DeepStack; the tower: core/vision/qwen3_vl.py).
Checkpoints: Hugging Face's one tensor per expert (`mlp.experts.{e}.gate_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1/w2/w3`), its fused `mlp.experts.gate_up_proj` / `down_proj`
(Qwen3-VL-MoE; `fused_hf_experts`) or mlx-lm's stacked `switch_mlp` (mlx-community
folders, 4-/8-bit); GGUF `qwen3moe` / `qwen2moe` / `qwen3vlmoe` (llama.cpp's `ffn_*_exps`
stacks and `ffn_gate_inp` router). Quantized expert stacks stay packed on the native CPU kernels
(`kernels.gather_qmm`, every width they run, a GGUF's two-level K-quant scales included:
about the file's bytes in memory) and with keep_quantized=True (MLX's `mx.gather_qmm`);
otherwise they are dequantized at load.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, LoadOptions, Reader, TensorSource, TensorSpec,
                                       read_experts, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT_OR_ZERO, POSITIVE, ConfigError, Field, gguf_grouped_experts,
                                   gguf_hf_config, gguf_value, positive_int, read_fields)
import fx_engine.core.models.llama as llama
from fx_engine.core.models.blocks import (GGUF_GROUPED_EXPERT_NAMES, HF_EXPERT_NAMES, HF_LAYER, STACKED_EXPERT_NAMES,
                                          SWIGLU_MLP, Experts, attention_sizes, expert_stacks, grouped_route, mixture,
                                          read_shared_expert, rope_freqs, rope_in, route, self_attention, swiglu_mlp)
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.nn import Linear, rms_norm
from fx_engine.core.splits import shard_decoder

__all__ = ["FAMILY", "Experts", "GGUF_GROUPED_EXPERT_NAMES", "MoEConfig", "MoELayer", "MoEParams", "fused_hf_experts", "grouped_route",
           "route"]  # (Experts, route, grouped_route: core/models/blocks.py's, kept here too)


@attrs.frozen
class MoEConfig(LlamaConfig):
    num_experts: int = 1
    top_k: int = 1
    moe_intermediate_size: int = 0  # each expert's MLP width
    norm_topk_prob: bool = False  # renormalize the top-k probabilities to sum to 1
    softmax_then_topk: bool = True  # False: top-k logits, then a softmax over them (mixtral)
    moe_layers: tuple[bool, ...] = ()  # per layer: routed experts (True) or a dense MLP
    shared_expert_intermediate_size: int = 0  # a shared expert (qwen2_moe: gated; glm4_moe: not)
    # glm4_moe: DeepSeek's grouped sigmoid routing (see `grouped_route`) and partial RoPE
    grouped_sigmoid: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    topk_norm_eps: float = 0.0  # added to the top-k weights' sum when renormalizing (LFM2-MoE: 1e-6)
    rope_dims: int = 0  # rotated dims per head (0: all)


# model_type -> the Llama-family model_type whose attention it has
_ATTENTION = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2", "mixtral": "llama", "olmoe": "llama",
              "glm4_moe": "llama"}


# config.json's expert fields by model_type (`read_fields`, in this order), by MoEConfig's
# names; the attention's are the Llama family's (llama.config_from_hf). A missing count is
# an error naming it ("got None").
_TOP_K = Field("num_experts_per_tok", POSITIVE, None, to="top_k")
_FIELDS = {
    "mixtral": (Field("num_local_experts", POSITIVE, None, to="num_experts"), _TOP_K,
                Field("norm_topk_prob", BOOL, False)),
    "olmoe": (Field("num_experts", POSITIVE, None), _TOP_K, Field("norm_topk_prob", BOOL, False)),
    "qwen3_moe": (Field("num_experts", POSITIVE, None), _TOP_K, Field("norm_topk_prob", BOOL, False),
                  Field("moe_intermediate_size", POSITIVE, None),
                  Field("decoder_sparse_step", default=1, or_default=True)),
}
_FIELDS["qwen2_moe"] = (*_FIELDS["qwen3_moe"], Field("shared_expert_intermediate_size", POSITIVE, None))
_GLM4_FIELDS = (
    Field("n_routed_experts", to="num_experts"), Field("num_experts_per_tok", to="top_k"), Field("n_group", default=1),
    Field("topk_group", default=1), Field("partial_rotary_factor", FLOAT, 0.5),
    Field("moe_intermediate_size"), Field("first_k_dense_replace", INT_OR_ZERO, 0),
    Field("n_shared_experts", INT_OR_ZERO, 0), Field("attention_bias", BOOL, False, to="qkv_bias"),
    Field("norm_topk_prob", BOOL, True), Field("routed_scaling_factor", FLOAT, 1.0, or_default=True),
)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> MoEConfig:
    """A MoEConfig from a Hugging Face config.json dict; refuses what it cannot run."""
    mt = d["model_type"]
    layers = positive_int(d.get("num_hidden_layers"), "num_hidden_layers", source)
    if mt == "glm4_moe":
        return _glm4_moe_config(d, layers, source)
    defaults = {"mixtral": {"rope_theta": 1e6}, "qwen2_moe": {"rope_theta": 1e6}}.get(mt, {})
    base = llama.config_from_hf({**defaults, **d, "model_type": _ATTENTION[mt]}, source)
    if d.get("mlp_bias"):
        raise ConfigError(f"{source}: field 'mlp_bias' is not supported for {mt} (experts without biases)")
    if d.get("clip_qkv") is not None:
        raise ConfigError(f"{source}: field 'clip_qkv' is not supported")
    f = read_fields(d, _FIELDS[mt], source)
    if f["top_k"] > f["num_experts"]:
        e_key = "num_local_experts" if mt == "mixtral" else "num_experts"
        raise ConfigError(f"{source}: num_experts_per_tok ({f['top_k']}) exceeds {e_key} ({f['num_experts']})")
    moe_layers = (True,) * layers
    if "decoder_sparse_step" in f:  # qwen: every step-th layer routed, but mlp_only_layers
        step = f.pop("decoder_sparse_step")
        dense = d.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and 0 <= i < layers for i in dense):
            raise ConfigError(f"{source}: field 'mlp_only_layers' must list layer indices below {layers}")
        moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    # the attention's model type reads its own windows: each MoE class decides its own
    types, window = llama.layer_kinds({**defaults, **d}, layers, source)
    extra = {"layer_types": tuple(types), "sliding_window": window} if window else {"layer_types": (),
                                                                                     "sliding_window": 0}
    if mt == "qwen2_moe":  # (Qwen2MoeAttention: q/k/v biases as qkv_bias says, default true)
        extra["qkv_bias"] = bool(d.get("qkv_bias", True))
    return MoEConfig(
        **{**attrs.asdict(base, recurse=False), "model_type": mt, **extra,
           "qk_norm": base.qk_norm or mt == "olmoe"},
        **{"moe_intermediate_size": base.intermediate_size, **f}, softmax_then_topk=mt != "mixtral",
        moe_layers=moe_layers,
    )


def _glm4_moe_config(d: dict[str, Any], layers: int, source: str) -> MoEConfig:
    """GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): Llama's attention with q/k/v biases (not o), per-head
    q/k norms if `use_qk_norm`, RoPE on the first partial_rotary_factor of each head; from
    layer first_k_dense_replace on, DeepSeek-V3's routed and shared experts."""
    if (d.get("topk_method") or "noaux_tc") != "noaux_tc" or (d.get("scoring_func") or "sigmoid") != "sigmoid":
        raise ConfigError(f"{source}: topk_method / scoring_func other than noaux_tc / sigmoid is not supported")
    # (Glm4MoeAttention reads no window: a config's sliding-window keys are not GLM's)
    base = llama.config_from_hf({k: v for k, v in d.items() if k not in (
                                    "partial_rotary_factor", "layer_types", "use_sliding_window", "sliding_window")}
                                | {"model_type": "qwen3" if d.get("use_qk_norm") else "llama",
                                   "attention_bias": False}, source)
    f = read_fields(d, _GLM4_FIELDS, source)
    experts, top_k, groups, topk_group = f["num_experts"], f["top_k"], f["n_group"], f["topk_group"]
    if experts % groups or topk_group > groups or top_k > experts or (groups > 1 and experts // groups < 2):
        raise ConfigError(f"{source}: n_routed_experts ({experts}) must split into n_group ({groups}) "
                          f"groups of 2 or more, topk_group ({topk_group}) <= n_group, "
                          f"num_experts_per_tok ({top_k}) <= n_routed_experts")
    frac = f.pop("partial_rotary_factor")
    rope_dims = int(base.head_dim * frac)
    if not 0 < frac <= 1 or rope_dims % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' = {frac} must give an even number "
                          f"of rotated dims in (0, head_dim = {base.head_dim}]")
    if base.rope_scaling:
        raise ConfigError(f"{source}: field 'rope_scaling' is not supported for glm4_moe (mlx-lm ignores it)")
    first, shared = f.pop("first_k_dense_replace"), f.pop("n_shared_experts")
    return MoEConfig(
        **{**attrs.asdict(base, recurse=False), "model_type": "glm4_moe", "qkv_bias": f.pop("qkv_bias")}, **f,
        moe_layers=tuple(i >= first for i in range(layers)),
        shared_expert_intermediate_size=f["moe_intermediate_size"] * shared,
        grouped_sigmoid=True, rope_dims=rope_dims,
    )


@attrs.frozen
class MoELayer:
    attn_norm: mx.array
    qkv: Linear
    o: Linear
    mlp_norm: mx.array
    experts: Experts | None = None  # None: a dense MLP layer
    gate_up: Linear | None = None
    down: Linear | None = None
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None


@attrs.frozen
class MoEParams(llama.Params):
    """The Llama family's params pytree with MoELayers under a MoEConfig."""


def cache_specs(cfg: MoEConfig) -> tuple[LayerSpec, ...]:
    return llama.cache_specs(cfg)


def _layer(
    p: MoEParams, lp: MoELayer, h: mx.array, entry: Any, spec: LayerSpec,
    rope: tuple[mx.array, mx.array, mx.array], geo: StepGeometry,
) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    eps = cfg.rms_norm_eps
    a, entry = self_attention(p, lp, rms_norm(h, lp.attn_norm, eps, num), entry, spec, rope, geo)
    h = h + a
    x = rms_norm(h, lp.mlp_norm, eps, num)
    if lp.experts is None:
        return h + swiglu_mlp(x, lp.gate_up, lp.down, num), entry
    return h + mixture(cfg, lp.experts, x, num), entry


def forward(
    p: MoEParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, images: Any = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder, routed MLPs). images:
    `llama.forward`'s (Qwen3-VL-MoE's text model: image rows, M-RoPE offsets, DeepStack)."""
    return llama.forward(p, cache, tokens, n_valid, span, layer_fn=_layer,
                         rope_fn=_partial_rope if p.config.rope_dims else None, images=images)


def _partial_rope(p: MoEParams, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE tables over the first rope_dims of each head (glm4_moe; half-split pairs)."""
    cfg = p.config
    return rope_in(positions, cfg.rope_dims, getattr(mx, p.dtype), base=cfg.rope_theta,
                   traditional=cfg.rope_traditional)


hidden_to_logits = llama.hidden_to_logits

# names other modules and tests imported before the blocks moved out (core/models/blocks.py)
_mixture, _STACKED = mixture, STACKED_EXPERT_NAMES


# ------------------------------------------------------------------ checkpoints

# Where each family keeps its MoE block (Hugging Face names): the block, the router, the
# per-expert projections (gate, up, down) and the stacked ones (mlx-lm's sanitized names).
_HF_MOE = {
    "mixtral": ("block_sparse_moe.", "gate", ("experts.{e}.w1", "experts.{e}.w3", "experts.{e}.w2")),
}
_HF_MOE_DEFAULT = ("mlp.", "gate", HF_EXPERT_NAMES)


def assemble(cfg: MoEConfig, src: TensorSource, opts: LoadOptions) -> MoEParams:
    """Params from Hugging Face / mlx-community tensor names."""
    block, router, per_expert = _HF_MOE.get(cfg.model_type, _HF_MOE_DEFAULT)
    rd = Reader(src, opts)

    def experts(layer: int) -> Experts:
        e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        b = HF_LAYER.format(i=layer) + block
        if src.has(b + "experts.gate_up_proj"):
            gate, up, down = fused_hf_experts(src, b + "experts.", e, f, h, opts.where)
        else:
            gate, up, down = (
                read_experts(src, b + stacked, b + one, e, o, i, opts.quant_for, opts.where)
                for stacked, one, (o, i) in zip(STACKED_EXPERT_NAMES, per_expert, ((f, h), (f, h), (h, f))))
        shared: dict[str, Any] = {}
        s = cfg.shared_expert_intermediate_size
        if cfg.grouped_sigmoid:  # glm4_moe: ungated shared experts, the selection bias
            shared = read_shared_expert(rd, h, s, b + "shared_experts.", None, ("gate_proj", "up_proj", "down_proj"))
            shared["correction_bias"] = src.get(b + router + ".e_score_correction_bias", (e,),
                                                opts.where).astype(mx.float32)
        elif s:
            shared = read_shared_expert(rd, h, s, b + "shared_expert.", b + "shared_expert_gate",
                                        ("gate_proj", "up_proj", "down_proj"))
        return Experts(router=rd.linear(b + router, e, h), **expert_stacks(gate, up, down, opts), **shared)

    return _assemble(cfg, src, opts, experts)


def fused_hf_experts(src: TensorSource, pre: str, e: int, f: int, h: int, where: str) -> tuple[Linear, Linear, Linear]:
    """The gate, up and down stacks [E, F, H], [E, F, H], [E, H, F] of Hugging Face's fused
    expert tensors: `gate_up_proj` with gate then up along its 2F axis and `down_proj`,
    either as x @ W ([E, H, 2F] and [E, F, H]: Qwen3-VL-MoE's released checkpoints,
    transformers' Qwen3VLMoeTextExperts; mlx-vlm's sanitize transposes them) or as rows
    ([E, 2F, H] and [E, H, F]: transformers 5's fused experts). Which one: the shapes (where
    H == 2F, down_proj's, whose F != H then)."""
    gu_shape, down_shape = (tuple(src.get(pre + n, None, where).shape) for n in ("gate_up_proj", "down_proj"))
    by_x = gu_shape == (e, h, 2 * f) if h != 2 * f else down_shape == (e, f, h)
    want = ((e, h, 2 * f), (e, f, h)) if by_x else ((e, 2 * f, h), (e, h, f))
    gu = src.get(pre + "gate_up_proj", want[0], where)
    down = src.get(pre + "down_proj", want[1], where)
    if by_x:
        gu, down = gu.swapaxes(-1, -2), down.swapaxes(-1, -2)
    return Linear(weight=gu[:, :f]), Linear(weight=gu[:, f:]), Linear(weight=down)


# Each layer's attention and norms are Llama's (`llama.ATTENTION` and the MLP's norm; q/k
# norms per head, or OLMoE's over the whole projections); a dense layer's MLP is Llama's
# without biases (`SWIGLU_MLP`); a routed layer's experts come from the family's hook
_LAYER = llama.ATTENTION + llama.MLP[:1]


def _assemble(cfg: MoEConfig, src: TensorSource, opts: LoadOptions, experts: Callable[[int], Experts],
              rename: dict[str, str] | None = None) -> MoEParams:
    """The attention, norms, dense MLPs and head from the tables above (under `rename`:
    llama.cpp's names); each MoE layer's experts from `experts(layer)`."""
    rd, cfg = Reader(src, opts), llama.with_tied(cfg, src, rename)
    sizes = attention_sizes(cfg, whole_qk_norms=cfg.model_type == "olmoe")

    def layer(i: int) -> MoELayer:
        f = read_tensors(rd, _LAYER, cfg, HF_LAYER, i, sizes, rename)
        if cfg.moe_layers[i]:
            return MoELayer(**f, experts=experts(i))
        return MoELayer(**f, **read_tensors(rd, SWIGLU_MLP, cfg, HF_LAYER, i, sizes, rename))

    layers = tuple(layer(i) for i in range(cfg.num_layers))
    return MoEParams(layers=layers, **read_tensors(rd, llama.TOP, cfg, sizes=sizes, rename=rename),
                     rope_freqs=rope_freqs(cfg), config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


# glm4moe's (MTP / NextN layers past the decoder unused)
_GLM4_MOE_GGUF_TO_HF = (
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.post_attention_norm\.", ".post_attention_layernorm."),
) + GGUF_GROUPED_EXPERT_NAMES + GGUF_COMMON_NAMES


# llama.cpp's qwen3moe / qwen2moe / olmoe / Mixtral names: the router ffn_gate_inp, the
# stacks ffn_{gate,up,down}_exps [E, out, in], qwen2moe's shared expert ffn_*_shexp and its
# gate ffn_gate_inp_shexp (read by `assemble_gguf` below with llama's names)


def assemble_gguf(cfg: MoEConfig, src: TensorSource, opts: LoadOptions) -> MoEParams:
    """Params from llama.cpp's qwen3moe / qwen2moe tensors, and Mixtral's (the "llama"
    architecture with experts: q/k rows permuted as for llama, undone here; experts stacked
    as ffn_*_exps, or one tensor per expert, ffn_gate.{e}, in older files)."""
    if cfg.model_type == "mixtral":
        src = llama.unpermuted_qk(cfg, src)
    if cfg.model_type == "glm4_moe":  # q/k norms and q/k/v biases as the file has them
        cfg = attrs.evolve(cfg, qk_norm=src.has("blk.0.attn_q_norm.weight"), qkv_bias=src.has("blk.0.attn_q.bias"))
        return assemble(cfg, renamed(src, _GLM4_MOE_GGUF_TO_HF), opts)

    rd = Reader(src, opts)

    def experts(layer: int) -> Experts:
        e, f, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        pre = f"blk.{layer}."
        gate, up, down = (read_experts(src, pre + n + "_exps", pre + n + ".{e}", e, o, i, opts.quant_for, opts.where)
                          for n, (o, i) in (("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))))
        shared = read_shared_expert(rd, h, cfg.shared_expert_intermediate_size, pre, pre + "ffn_gate_inp_shexp",
                                    ("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"))
        return Experts(router=rd.linear(pre + "ffn_gate_inp", e, h), **expert_stacks(gate, up, down, opts), **shared)

    return _assemble(cfg, src, opts, experts, llama.GGUF_NAMES)


def config_from_gguf(md: dict[str, Any], source: str) -> MoEConfig:
    """A MoEConfig from llama.cpp's qwen3moe / qwen2moe / olmoe metadata, or llama with
    expert_count (Mixtral). llama.cpp renormalizes the top-k weights for qwen3moe
    (Qwen3-MoE's norm_topk_prob is true) and not for qwen2moe / olmoe; every layer is a MoE
    layer there."""
    arch = md.get("general.architecture")
    if arch == "glm4moe":
        return _glm4_moe_from_gguf(md, source)
    base = llama.config_from_gguf(md, source, attention={"qwen3moe": "qwen3", "qwen2moe": "qwen2", "qwen3vlmoe": "qwen3",
                                                         "llama": "llama", "olmoe": "llama"}[arch], ff_default=0)

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    experts, top_k = int(val("expert_count")), int(val("expert_used_count"))
    shared = int(val("expert_shared_feed_forward_length", 0) or 0) if arch == "qwen2moe" else 0
    mixtral = arch == "llama"  # llama.cpp writes Mixtral as llama with experts of the ffn width
    width = val("expert_feed_forward_length", None) if not mixtral else None
    return MoEConfig(
        **{**attrs.asdict(base, recurse=False),
           "model_type": {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "llama": "mixtral",
                          "olmoe": "olmoe", "qwen3vlmoe": "qwen3_moe"}[arch],
           "qk_norm": base.qk_norm or arch == "olmoe"},  # OLMoE: norms over whole projections
        num_experts=experts, top_k=top_k,
        moe_intermediate_size=int(width if width is not None else val("feed_forward_length")),
        norm_topk_prob=arch in ("qwen3moe", "qwen3vlmoe"), softmax_then_topk=not mixtral,
        moe_layers=(True,) * base.num_layers, shared_expert_intermediate_size=shared,
    )


def _glm4_moe_from_gguf(md: dict[str, Any], source: str) -> MoEConfig:
    """GLM-4.5 from llama.cpp's glm4moe metadata (its block_count includes the NextN / MTP
    layers, which the trunk does not run: gguf_hf_config; sigmoid routing only)."""
    d = gguf_hf_config(md, "glm4moe", source, "glm4_moe")
    d.update(gguf_grouped_experts(md, "glm4moe", source))
    hd = d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    d.update(partial_rotary_factor=int(gguf_value(md, "glm4moe", "rope.dimension_count", source, hd // 2)) / hd,
             tie_word_embeddings=False, use_qk_norm=True, attention_bias=True)  # the file decides these two
    return config_from_hf(d, source)

def checkpoint_layout(cfg: MoEConfig) -> dict[str, TensorSpec]:
    """The Hugging Face checkpoint's tensors: Llama's attention and norms, then per MoE
    layer the router and one tensor per expert (dense layers keep Llama's MLP)."""
    per_head_qk = cfg.model_type == "qwen3_moe" or (cfg.model_type == "glm4_moe" and cfg.qk_norm)
    base = llama.checkpoint_layout(attrs.evolve(cfg, qk_norm=per_head_qk))
    block, router, per_expert = _HF_MOE.get(cfg.model_type, _HF_MOE_DEFAULT)
    h, hd, f = cfg.hidden_size, cfg.head_dim, cfg.moe_intermediate_size
    out: dict[str, TensorSpec] = {}
    for name, spec in base.items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if layer is not None and cfg.moe_layers[int(layer)] and ".mlp." in name:
            continue  # a MoE layer: no dense MLP
        out[name] = spec
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if cfg.model_type == "olmoe":
            out[p + "self_attn.q_norm.weight"] = TensorSpec((cfg.num_heads * hd,), center=1.0)
            out[p + "self_attn.k_norm.weight"] = TensorSpec((cfg.num_kv_heads * hd,), center=1.0)
        if not cfg.moe_layers[i]:
            continue
        b = p + block
        out[b + router + ".weight"] = TensorSpec((cfg.num_experts, h), scale=0.5)
        for e in range(cfg.num_experts):
            for one, shape in zip(per_expert, ((f, h), (f, h), (h, f))):
                out[b + one.format(e=e) + ".weight"] = TensorSpec(shape)
        s = cfg.shared_expert_intermediate_size
        shared = "shared_experts." if cfg.grouped_sigmoid else "shared_expert."
        if s:
            for n, shape in (("gate_proj", (s, h)), ("up_proj", (s, h)), ("down_proj", (h, s))):
                out[b + shared + n + ".weight"] = TensorSpec(shape)
            if not cfg.grouped_sigmoid:
                out[b + "shared_expert_gate.weight"] = TensorSpec((1, h), scale=0.3)
        if cfg.grouped_sigmoid:
            # (centred at 1: every biased score positive, where mlx-lm's routing, which lets
            # dropped groups' experts in at 0, agrees with Hugging Face's, the parity oracle's)
            out[b + router + ".e_score_correction_bias"] = TensorSpec((cfg.num_experts,), center=1.0, scale=0.1)
    return out


_TINY = {
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [],
                  "norm_topk_prob": True, "head_dim": 16},
    "qwen2_moe": {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
                  "norm_topk_prob": False, "tie_word_embeddings": False},
    "mixtral": {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64, "tie_word_embeddings": False},
    "olmoe": {"architectures": ["OlmoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
              "intermediate_size": 32, "norm_topk_prob": False},
    "glm4_moe": {"architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
                 "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1,
                 "num_hidden_layers": 3, "head_dim": 16, "partial_rotary_factor": 0.5, "use_qk_norm": True,
                 "attention_bias": True, "tie_word_embeddings": False, "topk_method": "noaux_tc",
                 "scoring_func": "sigmoid", "rope_scaling": None},
}


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2,
            "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "vocab_size": 384, "rope_theta": 10000.0,
            "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": 1,
            "eos_token_id": 2, **_TINY[model_type], **overrides}


FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="moe", model_types=tuple(_ATTENTION), config_type=MoEConfig, params_type=MoEParams,
    # Qwen3-VL-MoE (Qwen3-VL-30B-A3B, -235B-A22B): a Qwen3-MoE text model with interleaved
    # M-RoPE and DeepStack (images: core/vision/qwen3_vl.py); its router always renormalizes
    # the top k (transformers' Qwen3VLMoeTextSparseMoeBlock; mlx-vlm's default)
    wrappers={"qwen3_vl_moe": ("qwen3_moe", {"mrope_interleaved": True, "norm_topk_prob": True})},
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    gguf_architectures=("qwen3moe", "qwen2moe", "olmoe", "glm4moe", "llama", "qwen3vlmoe"),
    config_from_gguf=config_from_gguf,
    gguf_accepts=lambda md: bool(md.get(f"{md.get('general.architecture')}.expert_count")),
    assemble_gguf=assemble_gguf, tensor_split=shard_decoder, layer_range=llama.layer_range, tiny_config=tiny_config,
)
