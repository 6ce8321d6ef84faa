"""Gemma (`gemma`: Gemma 1, CodeGemma), Gemma 2 (`gemma2`), Gemma 3 (`gemma3_text`) and Gemma 4
(`gemma4_text`) text models as one pure forward, following mlx-lm 0.32's implementations (the
parity oracle).

Gemma 1 is the plain case: every layer global, one RoPE, no q/k norms, no soft-capping, and
pre-norms only (its post_attention_layernorm is the MLP's input norm: no "sandwich"); its
GELU is the tanh one, as Hugging Face reads the released configs' "gelu" and llama.cpp and
Google's reference run it (mlx-lm's gemma.py uses the erf GELU).

Shared by both: sliding-window layers (a ring cache entry each) interleaved with global
layers, each kind with its own RoPE; per-head RMSNorm on q and k; "sandwich" norms around
attention and MLP; a GELU-tanh gated MLP; the embedding scaled by sqrt(hidden).
Gemma 3 stores its norms as (1 + weight): the loader folds the 1 in, so every norm here is a
plain RMSNorm. Gemma 4 adds: global layers with their own head_dim, KV heads and partial
("proportional") RoPE, keys reused as values (k_eq_v), an unscaled RMSNorm on values,
attention scale 1, the last `num_kv_shared_layers` layers attending over an earlier layer's
cache entry instead of their own, per-layer input embeddings, a per-layer output scalar,
double-wide MLPs in KV-shared layers, tanh soft-capped logits, and (the MoE variant)
routed experts beside the dense MLP. Gemma 2 is Gemma 3 without the q/k norms, with tanh
soft-capping of the attention scores and of the final logits, one RoPE base for every
layer, and sliding layers alternating with global ones (layer 0 sliding). mlx-lm's gemma2
attends over every key in every layer (it has no window); Hugging Face and llama.cpp use
the window, and so does fx-engine: the two agree while a sequence fits in the window
(4096 tokens in every released Gemma 2).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced, attend_entry, write_entry, write_positions
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Reader, TensorSource,
                                       TensorSpec, Vec, WeightsError, finish_experts, fuse_experts, read_expert_stack,
                                       read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, INT_OR_ZERO, MAYBE_BOOL, MAYBE_FLOAT, POSITIVE, BaseConfig,
                                   ConfigError, Field, gguf_ints, gguf_value, positive_int, read_fields, refuse,
                                   token_ids)
from fx_engine.core.models.blocks import GATE_UP, HF_LAYER
from fx_engine.core.models.family import Family
from fx_engine.core.models.skeleton import (PipelineStage, cut_layers, hands_on, later_stage, stage_input, stage_logits,
                                            stage_output)
from fx_engine.core.nn import (Linear, Numerics, apply_rope, capped, embed, gelu_tanh, linear, rms_norm, rope_tables, routed_mixture)
from fx_engine.core.splits import split, split_cols, split_experts, split_head, split_mlp, split_rows, split_vocab
from fx_engine.core.tree import static_field
from fx_engine.core.vision.gemma3 import ImageInput, check_image_input, image_horizon, splice_images


# Multimodal checkpoints whose text model fx-engine runs (the vision/audio towers are
# ignored): model_type -> (text model_type, defaults mlx-lm's wrapper applies).
MULTIMODAL_WRAPPERS = {
    "gemma3": ("gemma3_text", {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4}),
    "gemma4": ("gemma4_text", {"vocab_size": 262144, "num_attention_heads": 8, "num_key_value_heads": 1}),
}


@attrs.frozen
class RopeSpec:
    """RoPE of one attention kind: base, position scale, rotated fraction ("proportional":
    the first fraction * head_dim / 2 frequencies rotate, the rest are identity; the
    exponent still divides by the full head_dim, as mlx-lm's ProportionalRoPE does)."""

    theta: float
    scale: float = 1.0  # positions are multiplied by this (linear scaling: 1 / factor)
    rotary_fraction: float = 1.0
    freq_factor: float = 1.0  # proportional: periods multiplied by this


@attrs.frozen
class GemmaConfig(BaseConfig):
    """Gemma 3 (`gemma3_text`) and Gemma 4 (`gemma4_text`) text models, as mlx-lm 0.32
    implements them."""

    layer_types: tuple[str, ...]  # "sliding_attention" | "full_attention" per layer
    sliding_window: int
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    attn_scale: float
    embed_scale: float
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool | None = True  # Gemma 3: as stated (None: not); the loader decides
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_traditional: bool = False
    qk_norm: bool = True  # per-head RMSNorm on q and k (Gemma 3 and 4; not Gemma 1 / 2)
    sandwich_norms: bool = True  # norms on the attention's and MLP's outputs (not Gemma 1)
    attn_softcap: float | None = None  # Gemma 2: tanh soft-capping of the attention scores
    final_logit_softcapping: float | None = None  # Gemma 2 and 4
    # Gemma 4
    global_head_dim: int = 0  # full-attention layers' head_dim (0: head_dim)
    num_global_kv_heads: int = 0  # full-attention layers' KV heads with k_eq_v (0: num_kv_heads)
    attention_k_eq_v: bool = False  # full-attention layers use their keys as values
    num_kv_shared_layers: int = 0  # the last layers reuse earlier layers' K/V
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings (0: none)
    use_double_wide_mlp: bool = False
    v_norm: bool = False  # RMSNorm (no scale) on values
    num_experts: int = 0  # > 0: each layer adds a routed mixture of experts (Gemma 4 MoE)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0
    # use_bidirectional_attention "vision": with images, an image's tokens see each other on
    # sliding layers during prefill (Hugging Face's create_masks_for_vision_model)
    vision_bidirectional: bool = False
    pad_token_id: int = 0  # the per-layer inputs' id for image tokens (Hugging Face's Gemma4Model)
    # A pipeline stage of a model with KV-shared layers (`layer_range`): the layer kinds
    # whose source layer (an earlier stage's) hands its new K/V on to this stage each step,
    # in the stream's order, and what this stage hands on: (kind, the layer here that
    # computes it, or -1: handed through). Shared layers here of a kind handed in attend
    # over a copy of the source's cache entry, kept after this stage's own entries.
    stage_kv_in: tuple[str, ...] = ()
    stage_kv_out: tuple[tuple[str, int], ...] = ()

    @property
    def is_gemma4(self) -> bool:
        return self.model_type == "gemma4_text"

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def kind_head_dim(self, kind: str) -> int:
        if kind != "sliding_attention" and self.global_head_dim:
            return self.global_head_dim
        return self.head_dim

    def kind_kv_heads(self, kind: str) -> int:
        if kind != "sliding_attention" and self.attention_k_eq_v and self.num_global_kv_heads:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def layer_head_dim(self, i: int) -> int:
        return self.kind_head_dim(self.layer_types[i])

    def layer_kv_heads(self, i: int) -> int:
        return self.kind_kv_heads(self.layer_types[i])

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    @property
    def borrowed_kv(self) -> tuple[str, ...]:
        """The kinds handed in that this stage's shared layers attend over (their cache
        entries follow the stage's own)."""
        shared = set(self.layer_types[self.first_shared_layer:])
        return tuple(kind for kind in self.stage_kv_in if kind in shared)

    def computes_kv(self, i: int) -> bool:
        """Whether layer i computes (and stores) its own K/V: not a KV-shared layer."""
        return i < self.first_shared_layer

    def kv_source(self, i: int) -> int:
        """The cache entry layer i attends over: its own (entry i) unless KV-shared, then the
        last earlier non-shared layer's of its kind, or the copy of an earlier stage's."""
        m, kind = self.first_shared_layer, self.layer_types[i]
        if self.computes_kv(i):
            return i
        if kind in self.borrowed_kv:
            return m + self.borrowed_kv.index(kind)
        return max(j for j in range(m) if self.layer_types[j] == kind)

    def handed_kv_width(self, kind: str) -> int:
        """Features per row of one kind's new K and V in a stage's stream."""
        return 2 * self.kind_kv_heads(kind) * self.kind_head_dim(kind)

    def layer_intermediate(self, i: int) -> int:
        shared = i >= self.first_shared_layer > 0
        return self.intermediate_size * (2 if self.use_double_wide_mlp and shared else 1)


def _rope_spec(params: dict[str, Any] | None, theta: float, source: str, where: str) -> RopeSpec:
    params = dict(params or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", theta))
    if kind == "default":
        return RopeSpec(theta=theta)
    if kind == "linear":
        factor = params.get("factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"{source}: {where}.factor must be > 0, got {factor!r}")
        return RopeSpec(theta=theta, scale=1.0 / float(factor))
    if kind == "proportional":
        frac = float(params.get("partial_rotary_factor", 1.0))
        if not 0 < frac <= 1:
            raise ConfigError(f"{source}: {where}.partial_rotary_factor must be in (0, 1], got {frac}")
        return RopeSpec(theta=theta, rotary_fraction=frac, freq_factor=float(params.get("factor", 1.0)))
    raise ConfigError(
        f"{source}: {where} rope type {kind!r} is not supported (supported: default, linear"
        f"{', proportional' if where.startswith('rope_parameters') else ''})"
    )


# config.json's fields every Gemma reads as they are (`read_fields`, in this order), by
# GemmaConfig's names
_FIELDS = (
    Field("hidden_size"), Field("num_hidden_layers", to="num_layers"), Field("num_attention_heads", to="num_heads"),
    Field("num_key_value_heads", default=1, or_default=True, to="num_kv_heads"),
    Field("head_dim", default=256, or_default=True), Field("vocab_size"), Field("intermediate_size"),
    Field("rms_norm_eps", FLOAT, 1e-6, or_default=True), Field("max_position_embeddings", INT, 131072, or_default=True),
)


def _softcap(value: Any, key: str, source: str) -> float | None:
    if value is not None and not (isinstance(value, (int, float)) and value > 0):
        raise ConfigError(f"{source}: field '{key}' must be a positive number or null, got {value!r}")
    return None if value is None else float(value)


# Gemma 2's: tanh soft-capping of the attention scores and of the logits (null: none)
_GEMMA2_FIELDS = (Field("attn_logit_softcapping", _softcap, 50.0, to="attn_softcap"),
                  Field("final_logit_softcapping", _softcap, 30.0), Field("rope_traditional", BOOL, False),
                  Field("tie_word_embeddings", MAYBE_BOOL, None))
# Gemma 1's: mlx-lm's rope_traditional, the head as Gemma 3's
_GEMMA1_FIELDS = (Field("rope_traditional", BOOL, False), Field("tie_word_embeddings", MAYBE_BOOL, None))
# Gemma 3's: as stated (None: not stated; the loader decides: lm_head.weight present or not)
_GEMMA3_FIELDS = (Field("tie_word_embeddings", MAYBE_BOOL, None),)
# Gemma 4's (its routed experts: `_EXPERT_FIELDS`, when enable_moe_block)
_GEMMA4_FIELDS = (
    Field("tie_word_embeddings", BOOL, True), Field("rope_traditional", BOOL, False),
    Field("global_head_dim", INT_OR_ZERO, 512), Field("num_global_key_value_heads", INT_OR_ZERO, 0,
                                                      to="num_global_kv_heads"),
    Field("attention_k_eq_v", BOOL, False), Field("final_logit_softcapping", MAYBE_FLOAT, 30.0),
    Field("use_double_wide_mlp", BOOL, True),
)
_EXPERT_FIELDS = tuple(Field(k, POSITIVE, None) for k in ("num_experts", "top_k_experts", "moe_intermediate_size"))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> GemmaConfig:
    """A GemmaConfig from a Hugging Face config.json dict (gemma2 / gemma3_text / gemma4_text)."""
    model_type = d["model_type"]
    f = read_fields(d, _FIELDS, source)
    types = _layer_kinds(d, model_type, f["num_layers"], source)
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if model_type == "gemma" and act == "gelu":  # (GemmaConfig: the releases' legacy name for the tanh GELU)
        act = "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    if model_type != "gemma2":
        refuse(d, source, "attn_logit_softcapping", lambda v: False, "mlx-lm does not apply it")
    # "vision": image tokens attend bidirectionally (multimodal); text-only runs are causal
    refuse(d, source, "use_bidirectional_attention", lambda v: v in (False, "vision"),
           "bidirectional text attention (embedding models)")
    refuse(d, source, "attention_bias", lambda v: not v, "Gemma attention has no biases")
    if f["num_heads"] % f["num_kv_heads"]:
        raise ConfigError(f"{source}: num_attention_heads ({f['num_heads']}) is not a multiple of "
                          f"num_key_value_heads ({f['num_kv_heads']})")
    # Gemma 2's window is 4096 when unsaid, the others' 512
    window = positive_int(d.get("sliding_window") or (4096 if model_type == "gemma2" else 512), "sliding_window",
                          source)
    bos, eos_ids = token_ids(d)
    common = dict(model_type=model_type, **f, layer_types=tuple(types), sliding_window=window, bos_token_id=bos,
                  eos_token_ids=eos_ids)
    variant = {"gemma": _gemma1, "gemma2": _gemma2, "gemma4_text": _gemma4}.get(model_type, _gemma3)
    return variant(d, common, source)


def _layer_kinds(d: dict[str, Any], model_type: str, layers: int, source: str) -> list[str]:
    """Each layer's attention kind: the config's `layer_types` (Hugging Face's model classes
    run what it lists; mlx-lm's gemma2 / gemma3_text ignore it, the same wherever a list
    agrees with the pattern, as published ones do). Without one, as Hugging Face's
    configuration classes derive it: Gemma 2 even layers sliding, odd global; Gemma 3 and 4
    layer i global iff (i + 1) % sliding_window_pattern == 0, default 6 (mlx-lm's Gemma 4
    default is 5). (Hugging Face also turns a Gemma 4 list's last layer global; published
    configs end global, and a list ending sliding is kept as mlx-lm keeps it: a
    self-draft's first layers are such a model.)"""
    pattern = positive_int(d.get("sliding_window_pattern") or 6, "sliding_window_pattern", source)
    types = d.get("layer_types")
    if model_type == "gemma":  # (GemmaConfig has no layer kinds: every layer global)
        types = ["full_attention"] * layers
    elif types is None and model_type == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif types is None:
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list):
        types = None
    if types is None or len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(
            f"{source}: layer_types must list {layers} entries of 'sliding_attention' or "
            "'full_attention'")
    return types


def _gemma1(d: dict[str, Any], common: dict[str, Any], source: str) -> GemmaConfig:
    """Gemma 1: Llama's block with Gemma's norms (1 + w), scaled embeddings and tanh GELU."""
    theta = float(d.get("rope_theta") or 10_000.0)
    if d.get("rope_scaling"):
        raise ConfigError(f"{source}: field 'rope_scaling' is not supported for gemma")
    refuse(d, source, "final_logit_softcapping", lambda v: v is None, "Gemma 1 has no soft-capping")
    return GemmaConfig(
        **common, **read_fields(d, _GEMMA1_FIELDS, source), rope_sliding=RopeSpec(theta=theta),
        rope_full=RopeSpec(theta=theta), attn_scale=common["head_dim"] ** -0.5,
        embed_scale=common["hidden_size"]**0.5, qk_norm=False, sandwich_norms=False,
    )


def _gemma2(d: dict[str, Any], common: dict[str, Any], source: str) -> GemmaConfig:
    """Gemma 2: one RoPE for every layer (no scaling), no q/k norms, soft-capping."""
    theta = float(d.get("rope_theta") or 10_000.0)
    if d.get("rope_scaling"):
        raise ConfigError(f"{source}: field 'rope_scaling' is not supported for gemma2")
    return GemmaConfig(
        **common, **read_fields(d, _GEMMA2_FIELDS, source), rope_sliding=RopeSpec(theta=theta),
        rope_full=RopeSpec(theta=theta), attn_scale=float(d.get("query_pre_attn_scalar") or 144.0) ** -0.5,
        embed_scale=common["hidden_size"]**0.5, qk_norm=False,
    )


def _gemma3(d: dict[str, Any], common: dict[str, Any], source: str) -> GemmaConfig:
    """Gemma 3: a local RoPE base for sliding layers, the global one (maybe scaled) for full."""
    refuse(d, source, "final_logit_softcapping", lambda v: False, "mlx-lm's gemma3_text does not apply it")
    qpas = float(d.get("query_pre_attn_scalar") or 256)
    # the embedding scale is rounded to bfloat16, as mlx-lm does
    embed_scale = float(mx.array(common["hidden_size"]**0.5, mx.bfloat16).astype(mx.float32).item())
    rp = d.get("rope_parameters") or {}
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        # saved by transformers 5: each layer kind's RoPE under rope_parameters (rope_theta,
        # rope_scaling and rope_local_base_freq are then not written)
        ropes = dict(rope_sliding=_rope_spec(rp.get("sliding_attention"), 10_000.0, source,
                                             "rope_parameters.sliding_attention"),
                     rope_full=_rope_spec(rp.get("full_attention"), 1_000_000.0, source,
                                          "rope_parameters.full_attention"))
    else:
        ropes = dict(rope_sliding=RopeSpec(theta=float(d.get("rope_local_base_freq") or 10_000.0)),
                     rope_full=_rope_spec(d.get("rope_scaling"), float(d.get("rope_theta") or 1_000_000.0), source,
                                          "rope_scaling"))
    return GemmaConfig(
        **common, **ropes, attn_scale=qpas**-0.5, embed_scale=embed_scale,
        **read_fields(d, _GEMMA3_FIELDS, source),
    )


def _per_layer_config(d: dict[str, Any], types: tuple[str, ...], source: str) -> dict[str, Any]:
    """`d` with Gemma 4's global-layer sizes as global_head_dim / num_global_key_value_heads:
    transformers 5.25 saves them as per_layer_config {layer index: {"head_dim",
    "num_key_value_heads"}} on the full-attention layers. Any other per-layer setting, or
    one on other layers, would change the model in ways fx-engine does not run: refused."""
    plc = d.get("per_layer_config")
    if not plc:
        return d
    if not isinstance(plc, dict) or not all(isinstance(v, dict) for v in plc.values()):
        raise ConfigError(f"{source}: per_layer_config must map layer indices to objects")
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    try:  # (keys are zero-padded indices: "05")
        plc = {int(i): v for i, v in plc.items()}
    except ValueError:
        raise ConfigError(f"{source}: per_layer_config's keys must be layer indices") from None
    out = dict(d)
    for key, field in (("head_dim", "global_head_dim"), ("num_key_value_heads", "num_global_key_value_heads")):
        values = {v[key] for v in plc.values() if key in v}
        if not values:
            continue
        if len(values) > 1 or {i for i, v in plc.items() if key in v} != full:
            raise ConfigError(f"{source}: per_layer_config: one {key} on every full-attention layer ({sorted(full)}) "
                              "is supported, no other per-layer sizes")
        out[field] = values.pop()
    other = {k for v in plc.values() for k in v} - {"head_dim", "num_key_value_heads"}
    if other:
        raise ConfigError(f"{source}: per_layer_config: {sorted(other)} per layer is not supported")
    return out


def _gemma4(d: dict[str, Any], common: dict[str, Any], source: str) -> GemmaConfig:
    """Gemma 4: a RoPE per kind (proportional on full layers), KV-shared last layers,
    per-layer input embeddings, maybe routed experts beside each MLP."""
    layers, types, vocab = common["num_layers"], common["layer_types"], common["vocab_size"]
    for key in ("rope_theta", "rope_scaling"):  # (what Hugging Face would make of them is not Gemma 4's RoPE)
        if d.get(key) is not None:
            raise ConfigError(f"{source}: field {key!r} is not read for gemma4_text: its RoPE is given per layer "
                              "kind under rope_parameters")
    moe = {}
    if d.get("enable_moe_block"):
        moe = read_fields(d, _EXPERT_FIELDS, source)
        if moe["top_k_experts"] > moe["num_experts"]:
            raise ConfigError(f"{source}: top_k_experts ({moe['top_k_experts']}) exceeds "
                              f"num_experts ({moe['num_experts']})")
    rp = d.get("rope_parameters") or {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
    }
    hpl = int(d.get("hidden_size_per_layer_input", 256) or 0)
    if hpl and int(d.get("vocab_size_per_layer_input", vocab)) != vocab:
        raise ConfigError(f"{source}: vocab_size_per_layer_input != vocab_size is not supported")
    shared = int(d.get("num_kv_shared_layers", 20) or 0)
    if not 0 <= shared < layers:
        raise ConfigError(f"{source}: num_kv_shared_layers must be in [0, {layers}), got {shared}")
    m = layers - shared
    for i in range(m, layers):
        if types[i] not in types[:m]:
            raise ConfigError(f"{source}: KV-shared layer {i} ({types[i]}) has no earlier "
                              "layer of its type to share with")
    return GemmaConfig(
        **common,
        rope_sliding=_rope_spec(rp.get("sliding_attention"), 10_000.0, source, "rope_parameters.sliding_attention"),
        rope_full=_rope_spec(rp.get("full_attention"), 1_000_000.0, source, "rope_parameters.full_attention"),
        attn_scale=1.0, embed_scale=common["hidden_size"]**0.5, **read_fields(_per_layer_config(d, types, source), _GEMMA4_FIELDS, source),
        num_kv_shared_layers=shared, hidden_size_per_layer_input=hpl, v_norm=True, **moe,
        vision_bidirectional=d.get("use_bidirectional_attention") == "vision",
        pad_token_id=_pad_id(d, source),
    )


def _pad_id(d: dict[str, Any], source: str) -> int:
    v = d.get("pad_token_id")
    if v is None:
        return 0
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < d.get("vocab_size", v + 1):
        raise ConfigError(f"{source}: field 'pad_token_id' must be a token id, got {v!r}")
    return v


@attrs.frozen
class MoEBlock:
    """Gemma 4's routed experts beside the dense MLP (mlx-lm's Router + SwitchGLU).

    Expert stacks are `Linear`s with a leading expert axis: gate_up [E, 2F, H] (fused),
    down [E, H, F] (dense ones stored transposed for `gather_mm`, quantized ones as packed
    rows for `gather_qmm`)."""

    router: Linear  # [E, H]
    router_scale: mx.array  # [H], already multiplied by H ** -0.5
    per_expert_scale: mx.array  # [E]
    gate_up: Linear
    down: Linear
    pre_norm: mx.array  # pre_feedforward_layernorm_2
    post_norm: mx.array  # post_feedforward_layernorm_2
    post_mlp_norm: mx.array  # post_feedforward_layernorm_1 (the dense MLP's output)
    top_k: int = static_field(default=1)


@attrs.frozen
class GemmaLayer:
    attn_norm: mx.array
    qkv: Linear  # fused [q; k; v] rows ([q; k] with k_eq_v; [q] in KV-shared layers)
    q_norm: mx.array | None  # None: no q/k norms (Gemma 2)
    k_norm: mx.array | None  # None in KV-shared layers and Gemma 2
    o: Linear
    post_attn_norm: mx.array | None  # None: no sandwich norms (Gemma 1)
    pre_ff_norm: mx.array
    gate_up: Linear  # fused [gate; up] rows
    down: Linear
    post_ff_norm: mx.array | None
    # Gemma 4 per-layer inputs and output scalar
    pli_gate: Linear | None = None
    pli_proj: Linear | None = None
    pli_norm: mx.array | None = None
    layer_scalar: mx.array | None = None
    moe: MoEBlock | None = None


@attrs.frozen
class GemmaParams:
    __fx_memo_flatten__ = True  # immutable and flattened every step (fx_engine.core.tree)
    embed: Linear
    layers: tuple[GemmaLayer, ...]
    norm: mx.array
    lm_head: Linear | None  # None: tied to the embedding
    embed_per_layer: Linear | None = None  # Gemma 4: [vocab, layers * hidden_per_layer]
    per_layer_proj: Linear | None = None
    per_layer_proj_norm: mx.array | None = None
    config: GemmaConfig = static_field(default=None)
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")
    pipeline: PipelineStage | None = static_field(default=None)  # a stage's (core/parallel.stage_params)


def cache_specs(cfg: GemmaConfig) -> tuple[LayerSpec, ...]:
    """One entry per layer that computes K/V (KV-shared layers have none), then (a pipeline
    stage) one per kind of an earlier stage's K/V its shared layers attend over: sliding
    layers get a window (a ring once `finish_layout` adds the headroom), global layers none."""
    kinds = [cfg.layer_types[i] for i in range(cfg.first_shared_layer)] + list(cfg.borrowed_kv)
    return tuple(
        LayerSpec(cfg.kind_kv_heads(kind), cfg.kind_head_dim(kind),
                  window=cfg.sliding_window if kind == "sliding_attention" else None)
        for kind in kinds
    )


def _rope(cfg: GemmaConfig, spec: RopeSpec, head_dim: int, positions: mx.array, dt: mx.Dtype):
    freqs = None
    if spec.rotary_fraction < 1.0 or spec.freq_factor != 1.0:
        # mlx-lm's ProportionalRoPE: periods factor * theta^(2i / head_dim) for the rotated
        # pairs, infinite (no rotation) for the rest.
        rotated = int(head_dim * spec.rotary_fraction)
        exps = mx.arange(0, rotated, 2, dtype=mx.float32) / head_dim
        freqs = mx.concatenate([
            spec.freq_factor * (spec.theta ** exps),
            mx.full(((head_dim - rotated) // 2,), mx.inf),
        ])
    cos, sin, perm = rope_tables(positions, head_dim, base=spec.theta, scale=spec.scale,
                                 freqs=freqs, traditional=cfg.rope_traditional)
    return cos.astype(dt), sin.astype(dt), perm.astype(dt)


def _add(h: mx.array, r: mx.array, clip: bool) -> mx.array:
    """Residual add; Gemma 3 clips float16 sums to the finite range (mlx-lm's clip_residual)."""
    if not clip or h.dtype != mx.float16:
        return h + r
    bound = float(mx.finfo(mx.float16).max)
    return mx.clip(h.astype(mx.float32) + r.astype(mx.float32), -bound, bound).astype(mx.float16)


def _geglu(gu: mx.array) -> mx.array:
    """gelu_tanh(gate) * up of a fused gate|up projection [..., 2F] -> [..., F]."""
    f = gu.shape[-1] // 2
    return gelu_tanh(gu[..., :f]) * gu[..., f:]


def _mlp(gate_up: Linear, down: Linear, x: mx.array, num: Numerics) -> mx.array:
    return linear(_geglu(linear(x, gate_up, num)), down, num)


def _experts(moe: MoEBlock, h: mx.array, eps: float, num: Numerics) -> mx.array:
    """Route each token [N, H] to its top-k experts (softmax over the k router scores, times
    a per-expert scale) and sum their GELU-gated MLPs; the router reads the residual stream,
    the experts its pre_feedforward_layernorm_2 normalisation (mlx-lm's gemma4_text)."""
    k = moe.top_k
    scores = linear(rms_norm(h, moe.router_scale, eps, num), moe.router, num)  # [N, E]
    idx = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]  # [N, k]
    w = mx.softmax(mx.take_along_axis(scores, idx, axis=-1), axis=-1) * moe.per_expert_scale[idx]
    y = routed_mixture(rms_norm(h, moe.pre_norm, eps, num), moe.gate_up, moe.down, idx, w, _geglu, num)
    return rms_norm(y, moe.post_norm, eps, num)


def forward(
    p: GemmaParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, images: ImageInput | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step`, written out: a pipeline stage hands on the
    per-layer inputs' source and shared layers' K/V with the stream.

    images (Gemma 3 and 4): the step's image embedding rows, spliced in place of the image
    tokens' embeddings after the sqrt(hidden) scaling, and (`images.bidirectional`) the
    tokens of each image attending to the whole image (`vision.gemma3.image_horizon`):
    Gemma 3 on every layer, Gemma 4 on sliding layers where its config says "vision"
    (core/vision/gemma4.py). Gemma 4's per-layer inputs look image tokens up as the pad
    token."""
    cfg, num = p.config, p.numerics
    b, t = tokens.shape
    dt = getattr(mx, p.dtype)
    eps = cfg.rms_norm_eps
    clip = cfg.model_type == "gemma3_text"  # mlx-lm's clip_residual
    horizon = None
    if images is not None:
        if cfg.model_type not in ("gemma3_text", "gemma4_text") or cfg.stage_kv_in or cfg.stage_kv_out:
            raise ValueError(f"images: a {cfg.model_type} text model takes no image rows (Gemma 3's and 4's do)")
        images = check_image_input(images, b, cfg.hidden_size)
        if images.bidirectional and (not cfg.is_gemma4 or cfg.vision_bidirectional):
            horizon = image_horizon(tokens, write_positions(cache.lengths, t), images.token_index)
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span, None if cfg.is_gemma4 else horizon)
    # (Gemma 4: full-attention layers stay causal; its sliding layers read with the horizon)
    geo_sliding = geo if horizon is None or not cfg.is_gemma4 else StepGeometry(
        cache, n_valid.astype(mx.int32), t, span, horizon)
    flat = tokens.reshape(-1)
    hid, pli_on = cfg.hidden_size, p.embed_per_layer is not None
    kv_widths = [cfg.handed_kv_width(kind) for kind in cfg.stage_kv_in]

    def embeddings() -> mx.array:
        e = embed(flat, p.embed).astype(dt) * mx.array(cfg.embed_scale, dt)
        if images is None:
            return e
        return splice_images(e.reshape(b, t, hid), tokens, images.rows, images.token_index,
                             images.start).reshape(b * t, hid)

    h = stage_input(p, b * t, embeddings, width=hid * (2 if pli_on else 1) + sum(kv_widths))
    h0, handed_kv = h, {}  # the embeddings (per-layer inputs' source); K/V handed in
    if later_stage(p):  # a pipeline stage's stream: [h | embeddings | K, V per kind handed in]
        widths = [hid] + [hid] * pli_on + kv_widths
        parts = mx.split(h, list(itertools.accumulate(widths))[:-1], axis=1)
        h, h0 = parts[0], parts[1] if pli_on else None
        for kind, kv in zip(cfg.stage_kv_in, parts[1 + pli_on:]):
            k, v = mx.split(kv.reshape(b, t, 2, cfg.kind_kv_heads(kind), -1), 2, axis=2)
            handed_kv[kind] = (k.squeeze(2), v.squeeze(2))
    ropes = {}
    for kind, spec in (("sliding", cfg.rope_sliding), ("full", cfg.rope_full)):
        dims = {cfg.layer_head_dim(i) for i in range(cfg.num_layers)
                if cfg.is_sliding(i) == (kind == "sliding")}
        for d in dims:
            ropes[kind, d] = _rope(cfg, spec, d, geo.positions, dt)
    pli = None
    if p.embed_per_layer is not None:  # Gemma 4 per-layer inputs [B*T, L, hidden_per_layer]
        n_l, hpl = cfg.num_layers, cfg.hidden_size_per_layer_input
        ids = flat if images is None else mx.where(flat == images.token_index, cfg.pad_token_id, flat)
        tok_part = embed(ids, p.embed_per_layer).astype(dt) * (hpl**0.5)
        proj = linear(h0, p.per_layer_proj, num) * (cfg.hidden_size**-0.5)
        proj = rms_norm(proj.reshape(-1, n_l, hpl), p.per_layer_proj_norm, eps, num)
        pli = (proj + tok_part.reshape(-1, n_l, hpl)) * (2.0**-0.5)

    entries = list(cache.layers)
    m = cfg.first_shared_layer
    for j, kind in enumerate(cfg.borrowed_kv):  # copies of earlier stages' source entries
        k, v = handed_kv[kind]
        entries[m + j] = write_entry(entries[m + j], cache.layout[m + j], k.transpose(0, 2, 1, 3),
                                     v.transpose(0, 2, 1, 3), geo, num)
    sources = {i: kind for kind, i in cfg.stage_kv_out if i >= 0}  # layers whose K/V go on
    for i, lp in enumerate(p.layers):
        src = cfg.kv_source(i)
        spec = cache.layout[src]
        hq, d = cfg.num_heads, cfg.layer_head_dim(i)
        hk = cfg.layer_kv_heads(i)
        x = rms_norm(h, lp.attn_norm, eps, num)
        qkv = linear(x, lp.qkv, num).reshape(b, t, -1, d)
        rope = ropes["sliding" if cfg.is_sliding(i) else "full", d]
        q = qkv[:, :, :hq] if lp.q_norm is None else rms_norm(qkv[:, :, :hq], lp.q_norm, eps, num)
        if cfg.computes_kv(i):
            k_raw = qkv[:, :, hq : hq + hk]
            v_raw = k_raw if cfg.k_eq_v(i) else qkv[:, :, hq + hk :]
            k = k_raw if lp.k_norm is None else rms_norm(k_raw, lp.k_norm, eps, num)
            v = mx.fast.rms_norm(v_raw, None, eps) if cfg.v_norm else v_raw
            qk = apply_rope(mx.concatenate([q, k], axis=2), *rope, num, cfg.rope_traditional)
            q, k = qk[:, :, :hq], qk[:, :, hq:]
            if i in sources:
                handed_kv[sources[i]] = (k, v)
            entries[i] = write_entry(entries[i], spec, k.transpose(0, 2, 1, 3),
                                     v.transpose(0, 2, 1, 3), geo, num)
        else:
            q = apply_rope(q, *rope, num, cfg.rope_traditional)
        o = attend_entry(entries[src], spec, q, geo_sliding if cfg.is_sliding(i) else geo, cfg.attn_scale, num,
                         softcap=cfg.attn_softcap).reshape(b * t, hq * d)
        h = _add(h, _post_norm(linear(o, lp.o, num), lp.post_attn_norm, eps, num), clip)
        r = _mlp(lp.gate_up, lp.down, rms_norm(h, lp.pre_ff_norm, eps, num), num)
        if lp.moe is not None:
            r = rms_norm(r, lp.moe.post_mlp_norm, eps, num) + _experts(lp.moe, h, eps, num)
        h = _add(h, _post_norm(r, lp.post_ff_norm, eps, num), clip)
        if pli is not None and lp.pli_gate is not None:
            g = gelu_tanh(linear(h, lp.pli_gate, num)) * pli[:, i]
            h = h + rms_norm(linear(g, lp.pli_proj, num), lp.pli_norm, eps, num)
        if lp.layer_scalar is not None:
            h = h * lp.layer_scalar
    if hands_on(p) and (pli_on or cfg.stage_kv_out):
        h = mx.concatenate([h] + [h0] * pli_on + [x.reshape(b * t, -1).astype(h.dtype) for kind, _ in
                                                  cfg.stage_kv_out for x in handed_kv[kind]], axis=1)
    handed = stage_output(p, h)
    if handed is not None:  # a pipeline stage before the last
        return handed.reshape(b, t, -1), advanced(cache, entries, geo)
    h = rms_norm(h, p.norm, eps, num).reshape(b, t, -1)
    return h, advanced(cache, entries, geo)


def _post_norm(x: mx.array, w: mx.array | None, eps: float, num: Numerics) -> mx.array:
    """A sublayer's output norm (Gemma 2-4's sandwich; Gemma 1 has none)."""
    return x if w is None else rms_norm(x, w, eps, num)


def hidden_to_logits(p: GemmaParams, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    def logits() -> mx.array:
        head = p.lm_head if p.lm_head is not None else p.embed
        out = linear(h, head, p.numerics).astype(mx.float32)
        cap = p.config.final_logit_softcapping
        return out if cap is None else capped(out, cap)

    return stage_logits(p, h, logits)  # (a pipeline stage: the last stage's logits)


# ------------------------------------------------------------------ checkpoints


# Each layer's params from its tensors under model.layers.{i}. (`read_tensors`, with the
# layer's own sizes: Gemma 4's vary by layer; q|k|v is `_qkv`'s, Gemma 4's routed experts
# `_read_moe`'s). Norms are read plus `norm_offset` (Gemma 3's files store 1 + w). The whole
# model's: the head where untied, Gemma 4's per-layer input embeddings.
_PLI = "hidden_size_per_layer_input"  # (0: none)
LAYER = (
    Vec("attn_norm", "input_layernorm.weight", "hidden_size", plus="norm_offset"),
    Vec("q_norm", "self_attn.q_norm.weight", "head_dim", plus="norm_offset", when="qk_norm"),
    Vec("k_norm", "self_attn.k_norm.weight", "head_dim", plus="norm_offset", when="own_k_norm"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width"),
    Vec("post_attn_norm", "post_attention_layernorm.weight", "hidden_size", plus="norm_offset", when="sandwich_norms"),
    Vec("pre_ff_norm", "pre_feedforward_layernorm.weight", "hidden_size", plus="norm_offset"),
    Fused("gate_up", GATE_UP, "hidden_size"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size"),
    Vec("post_ff_norm", "post_feedforward_layernorm.weight", "hidden_size", plus="norm_offset",
        when="sandwich_norms"),
    Lin("pli_gate", "per_layer_input_gate", _PLI, "hidden_size", when=_PLI),
    Lin("pli_proj", "per_layer_projection", "hidden_size", _PLI, when=_PLI),
    Vec("pli_norm", "post_per_layer_input_norm.weight", "hidden_size", plus="norm_offset", when=_PLI),
    Vec("layer_scalar", "layer_scalar", 1, when="is_gemma4"),
)
TOP = (
    Embedding("embed", "model.embed_tokens", lookup_only="untied"),
    Vec("norm", "model.norm.weight", "hidden_size", plus="norm_offset"),
    Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"),
    Embedding("embed_per_layer", "model.embed_tokens_per_layer", cols="per_layer_width", lookup_only=True, when=_PLI),
    Lin("per_layer_proj", "model.per_layer_model_projection", "per_layer_width", "hidden_size", when=_PLI),
    Vec("per_layer_proj_norm", "model.per_layer_projection_norm.weight", _PLI, plus="norm_offset", when=_PLI),
)
MOE = (
    Lin("router", "router.proj", "num_experts", "hidden_size"),
    Vec("per_expert_scale", "router.per_expert_scale", "num_experts"),
    Vec("pre_norm", "pre_feedforward_layernorm_2.weight", "hidden_size", plus="norm_offset"),
    Vec("post_norm", "post_feedforward_layernorm_2.weight", "hidden_size", plus="norm_offset"),
    Vec("post_mlp_norm", "post_feedforward_layernorm_1.weight", "hidden_size", plus="norm_offset"),  # the dense MLP's
)


def assemble(cfg: GemmaConfig, src: TensorSource, opts: LoadOptions,
             norm_offset: float | None = None) -> GemmaParams:
    """Gemma 3 / Gemma 4 text weights under mlx-lm's (= Hugging Face's) names. Gemma 3's
    norms are stored as (1 + weight): the 1 is folded in here (in float32, as mlx-lm adds it
    to float32 weights; `norm_offset` 0 for files that store the scale itself). Projections
    of KV-shared layers, rotary buffers and activation clipping ranges in a checkpoint are
    unused (mlx-lm drops them too)."""
    if not cfg.sandwich_norms:  # Gemma 1: its post_attention_layernorm is the MLP's input norm
        src = renamed(src, ((r"\.post_attention_layernorm\.", ".pre_feedforward_layernorm."),))
    rd = Reader(src, opts)
    offset = (0.0 if cfg.is_gemma4 else 1.0) if norm_offset is None else norm_offset
    tied = cfg.tie_word_embeddings if cfg.is_gemma4 else not src.has("lm_head.weight")
    sizes = {"norm_offset": offset, "untied": not tied,
             "per_layer_width": cfg.num_layers * cfg.hidden_size_per_layer_input}

    def layer(i: int) -> GemmaLayer:
        d = cfg.layer_head_dim(i)
        own = {**sizes, "head_dim": d, "q_width": cfg.num_heads * d, "intermediate_size": cfg.layer_intermediate(i),
               "own_k_norm": cfg.qk_norm and cfg.computes_kv(i)}
        moe = _read_moe(cfg, rd, HF_LAYER.format(i=i), own) if cfg.num_experts else None
        return GemmaLayer(**read_tensors(rd, LAYER, cfg, HF_LAYER, i, own), qkv=_qkv(cfg, rd, i), moe=moe)

    return GemmaParams(layers=tuple(layer(i) for i in range(cfg.num_layers)), **read_tensors(rd, TOP, cfg, sizes=sizes),
                       config=attrs.evolve(cfg, tie_word_embeddings=tied), numerics=opts.numerics,
                       dtype=opts.dtype_name)


def _qkv(cfg: GemmaConfig, rd: Reader, i: int) -> Linear:
    """Layer i's q|k|v fused: [q] in a KV-shared layer (its K/V are an earlier layer's),
    [q; k] where k doubles as v (Gemma 4's k_eq_v)."""
    pre, d, hid = HF_LAYER.format(i=i) + "self_attn.", cfg.layer_head_dim(i), cfg.hidden_size
    kv = cfg.layer_kv_heads(i) * d
    parts = [rd.raw(pre + "q_proj", cfg.num_heads * d, hid)]
    if cfg.computes_kv(i):
        parts.append(rd.raw(pre + "k_proj", kv, hid))
        if not cfg.k_eq_v(i):
            parts.append(rd.raw(pre + "v_proj", kv, hid))
    return rd.fused(parts)


# llama.cpp's Gemma names that are not the common ones (the converter adds 1 to every norm
# weight, so they hold the scale itself: read with norm_offset 0)
_GGUF_TO_HF = (
    (r"\.attn_norm\.", ".input_layernorm."),
    (r"\.post_attention_norm\.", ".post_attention_layernorm."),
    (r"\.ffn_norm\.", ".pre_feedforward_layernorm."),
    (r"\.post_ffw_norm\.", ".post_feedforward_layernorm."),
) + GGUF_COMMON_NAMES


# Gemma 4's own (convert_hf_to_gguf.py's Gemma4Model; gguf-py's names): the per-layer
# inputs, the layer's output scalar, the routed experts beside the MLP and their router
_GEMMA4_GGUF_TO_HF = (
    (r"^per_layer_token_embd\.", "model.embed_tokens_per_layer."),
    (r"^per_layer_model_proj\.", "model.per_layer_model_projection."),
    (r"^per_layer_proj_norm\.", "model.per_layer_projection_norm."),
    (r"\.inp_gate\.", ".per_layer_input_gate."), (r"\.proj\.", ".per_layer_projection."),
    (r"\.post_norm\.", ".post_per_layer_input_norm."), (r"\.layer_output_scale\.weight$", ".layer_scalar"),
    (r"\.ffn_gate_inp\.scale$", ".router.scale"), (r"\.ffn_gate_inp\.", ".router.proj."),
    (r"\.ffn_down_exps\.scale$", ".router.per_expert_scale"),
    (r"\.ffn_gate_up_exps\.", ".experts.gate_up."), (r"\.ffn_down_exps\.", ".experts.down."),
    (r"\.pre_ffw_norm_2\.", ".pre_feedforward_layernorm_2."), (r"\.post_ffw_norm_1\.", ".post_feedforward_layernorm_1."),
    (r"\.post_ffw_norm_2\.", ".post_feedforward_layernorm_2."),
)


def assemble_gguf(cfg: GemmaConfig, src: TensorSource, opts: LoadOptions) -> GemmaParams:
    """Gemma 2 / 3 / 4 from llama.cpp's names (no row permutation: Gemma rotates halves).
    Gemma 4's global layers' rotated fraction is the file's rope_freqs tensor (1 on the
    rotated pairs, 1e30 on the identity ones: llama.cpp's form of the proportional RoPE),
    and k_eq_v is a global layer computing K/V without attn_v."""
    if not cfg.is_gemma4:
        return assemble(cfg, renamed(src, _GGUF_TO_HF), opts, norm_offset=0.0)
    cfg = attrs.evolve(cfg, rope_full=attrs.evolve(cfg.rope_full, rotary_fraction=_gguf_rotary_fraction(cfg, src, opts)))
    full = [i for i in range(cfg.first_shared_layer) if not cfg.is_sliding(i)]
    no_v = {i for i in full if not src.has(f"blk.{i}.attn_v.weight")}
    if no_v and no_v != set(full):
        raise WeightsError(f"{opts.where}: global layers {sorted(no_v)} have no attn_v but layers "
                           f"{sorted(set(full) - no_v)} do (k_eq_v is all global layers or none)")
    if no_v:  # (their KV heads: the file's per-layer head_count_kv, already in num_global_kv_heads)
        cfg = attrs.evolve(cfg, attention_k_eq_v=True)
    return assemble(cfg, renamed(src, _GEMMA4_GGUF_TO_HF + _GGUF_TO_HF), opts, norm_offset=0.0)


def _gguf_rotary_fraction(cfg: GemmaConfig, src: TensorSource, opts: LoadOptions) -> float:
    """The global layers' rotated fraction from rope_freqs [global_head_dim / 2]: its leading
    1s rotate, the 1e30s (a period too long to turn) do not; no tensor: every pair rotates
    (llama.cpp then uses no frequency factors)."""
    half = cfg.kind_head_dim("full_attention") // 2
    if not src.has("rope_freqs.weight"):
        return 1.0
    f = src.get("rope_freqs.weight", (half,), opts.where).astype(mx.float32).tolist()
    ones = next((i for i, x in enumerate(f) if x != 1.0), half)
    if any(x < 1e20 for x in f[ones:]):
        raise WeightsError(f"{opts.where}: rope_freqs.weight holds frequency factors other than 1 (rotated) and "
                           "1e30 (not rotated): not Gemma 4's proportional RoPE, which is all fx-engine runs")
    return 2 * ones / (2 * half)


def config_from_gguf(md: dict[str, Any], source: str) -> GemmaConfig:
    """A Gemma 2 / Gemma 3 config from llama.cpp's gemma2 / gemma3 metadata, with llama.cpp's
    fixed choices: Gemma 3 every 6th layer global, its sliding layers' RoPE base 10000;
    Gemma 2 every other layer global (layer 0 sliding); the attention scale 1/sqrt(head_dim)
    except for the 27B models (Gemma 3: 62 layers, Gemma 2: 46), 1/sqrt(hidden / heads).
    Checked against llama.cpp's own logits on converted tiny models (Gemma 3: max |diff|
    6.7e-3 of 30)."""
    arch = md.get("general.architecture")
    if arch == "gemma4":
        return _gemma4_from_gguf(md, source)
    if arch not in ("gemma", "gemma2", "gemma3"):
        raise ConfigError(f"{source}: GGUF architecture {arch!r}: only gemma, gemma2, gemma3 and gemma4 are "
                          "supported here")

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    hidden, heads, layers = int(val("embedding_length")), int(val("attention.head_count")), int(val("block_count"))
    head_dim = int(val("attention.key_length", 256))
    if int(val("attention.value_length", head_dim)) != head_dim:
        raise ConfigError(f"{source}: gemma3.attention.value_length != key_length is not supported")
    if arch == "gemma3" and (val("final_logit_softcapping", None) is not None
                             or val("attn_logit_softcapping", None) is not None):
        raise ConfigError(f"{source}: soft-capping metadata is not Gemma 3's (is this Gemma 2?)")
    scaling = None
    kind = val("rope.scaling.type", None)
    if kind not in (None, "none"):
        if kind != "linear":
            raise ConfigError(f"{source}: gemma3.rope.scaling.type {kind!r} is not supported (linear)")
        scaling = {"rope_type": "linear", "factor": float(val("rope.scaling.factor"))}
    eos, bos = md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.bos_token_id")
    big = layers == (46 if arch == "gemma2" else 62)  # the 27B models
    d = {
        "model_type": {"gemma3": "gemma3_text"}.get(arch, arch), "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": int(val("attention.head_count_kv", heads)),
        "head_dim": head_dim, "intermediate_size": int(val("feed_forward_length")),
        "rms_norm_eps": float(val("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(val("attention.sliding_window", 512 if arch == "gemma3" else 4096)),
        "rope_theta": float(val("rope.freq_base", 1_000_000.0 if arch == "gemma3" else 10_000.0)),
        "query_pre_attn_scalar": hidden / heads if big else head_dim,
        "vocab_size": int(val("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", []))),
        "max_position_embeddings": int(val("context_length", 131072)),
        "bos_token_id": int(bos.item()) if bos is not None else None,
        "eos_token_id": int(eos.item()) if eos is not None else None,
    }
    if arch == "gemma3":
        d.update(sliding_window_pattern=6, rope_local_base_freq=10_000.0, rope_scaling=scaling)
    elif arch == "gemma":  # (Gemma 1: every layer global, no soft-capping)
        d["rope_scaling"] = scaling
    else:
        if scaling:
            raise ConfigError(f"{source}: gemma2.rope.scaling.type is not supported")
        # llama.cpp's defaults when the converter wrote none
        d["attn_logit_softcapping"] = float(val("attn_logit_softcapping", 50.0))
        d["final_logit_softcapping"] = float(val("final_logit_softcapping", 30.0))
    return config_from_hf(d, source)


def _gemma4_from_gguf(md: dict[str, Any], source: str) -> GemmaConfig:
    """Gemma 4 from llama.cpp's gemma4 metadata (convert_hf_to_gguf.py's Gemma4Model), as the
    config.json it came from: key_length / key_length_swa as global_head_dim / head_dim,
    head_count_kv per layer (the global layers' own count) or one, feed_forward_length per
    layer (twice as wide on the KV-shared layers: use_double_wide_mlp) or one, the layer
    kinds from sliding_window_pattern (true: sliding), the RoPE base per kind. The global
    layers' rotated fraction is in the rope_freqs tensor (`assemble_gguf`), k_eq_v is read
    from which tensors the global layers have."""
    a = "gemma4"

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, a, key, source, default)

    layers = int(val("block_count"))
    sliding = md.get(f"{a}.attention.sliding_window_pattern")
    sliding = sliding.tolist() if hasattr(sliding, "tolist") else sliding
    if not isinstance(sliding, list) or len(sliding) != layers:
        raise ConfigError(f"{source}: GGUF metadata '{a}.attention.sliding_window_pattern' must list {layers} "
                          "flags (true: a sliding layer)")
    types = ["sliding_attention" if x else "full_attention" for x in sliding]
    shared = int(val("attention.shared_kv_layers", 0))
    per_layer = {}
    for key in ("attention.head_count_kv", "feed_forward_length"):
        v = gguf_ints(md, f"{a}.{key}")
        if v is None:
            raise ConfigError(f"{source}: GGUF metadata '{a}.{key}' is required")
        if len(v) not in (1, layers):
            raise ConfigError(f"{source}: GGUF metadata '{a}.{key}' has {len(v)} entries for {layers} layers")
        per_layer[key] = v * layers if len(v) == 1 else v
    kv_by_kind: dict[str, set[int]] = {}
    for t, k in zip(types, per_layer["attention.head_count_kv"]):
        kv_by_kind.setdefault(t, set()).add(k)
    if any(len(v) > 1 for v in kv_by_kind.values()):
        raise ConfigError(f"{source}: {a}.attention.head_count_kv {per_layer['attention.head_count_kv']}: one count "
                          "per layer kind is supported")
    ff = per_layer["feed_forward_length"]
    m = layers - shared
    double = any(x != ff[0] for x in ff)
    if double and (ff[:m] != [ff[0]] * m or ff[m:] != [2 * ff[0]] * shared):
        raise ConfigError(f"{source}: {a}.feed_forward_length {ff}: per-layer widths other than Gemma 4's "
                          "double-wide KV-shared layers are not supported")
    gd, hd = int(val("attention.key_length")), int(val("attention.key_length_swa"))
    if int(val("attention.value_length", gd)) != gd or int(val("attention.value_length_swa", hd)) != hd:
        raise ConfigError(f"{source}: {a}.attention.value_length(_swa) != key_length(_swa) is not supported")
    rot_swa = int(val("rope.dimension_count_swa", hd))
    if rot_swa <= 0 or rot_swa > hd or rot_swa % 2:
        raise ConfigError(f"{source}: {a}.rope.dimension_count_swa {rot_swa} must be even, in (0, {hd}]")
    kv = {kind: next(iter(counts)) for kind, counts in kv_by_kind.items()}  # (one count per kind, checked above)
    sliding_kv = kv.get("sliding_attention", kv.get("full_attention"))
    full_kv = kv.get("full_attention", sliding_kv)
    eos, bos = md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.bos_token_id")
    pad = md.get("tokenizer.ggml.padding_token_id")
    ple = int(val("embedding_length_per_layer_input", 0))
    d: dict[str, Any] = {
        "model_type": "gemma4_text", "hidden_size": int(val("embedding_length")), "num_hidden_layers": layers,
        "num_attention_heads": int(val("attention.head_count")), "num_key_value_heads": sliding_kv,
        "num_global_key_value_heads": full_kv if full_kv != sliding_kv else None,
        "head_dim": hd, "global_head_dim": gd, "intermediate_size": ff[0], "use_double_wide_mlp": double,
        "rms_norm_eps": float(val("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(val("attention.sliding_window")), "layer_types": types,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": ple,
        # (the file does not say: the published configs give "vision" to the models without
        # per-layer inputs (26B-A4B, 31B) and nothing to those with them (E2B, E4B))
        "use_bidirectional_attention": None if ple else "vision",
        "pad_token_id": int(pad.item()) if pad is not None else 0,
        "final_logit_softcapping": float(val("final_logit_softcapping")) if val("final_logit_softcapping", None)
        is not None else None,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": float(val("rope.freq_base", 1_000_000.0)),
                               "partial_rotary_factor": 1.0},  # (the file's rope_freqs says: assemble_gguf)
            "sliding_attention": {"rope_type": "default", "rope_theta": float(val("rope.freq_base_swa", 10_000.0)),
                                  "partial_rotary_factor": rot_swa / hd},
        },
        "vocab_size": int(val("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", []))),
        "max_position_embeddings": int(val("context_length", 131072)),
        "bos_token_id": int(bos.item()) if bos is not None else None,
        "eos_token_id": int(eos.item()) if eos is not None else None,
    }
    if val("expert_count", None) is not None:
        d.update(enable_moe_block=True, num_experts=int(val("expert_count")), top_k_experts=int(val("expert_used_count")),
                 moe_intermediate_size=int(val("expert_feed_forward_length")))
    return config_from_hf(d, source)


def _read_moe(cfg: GemmaConfig, rd: Reader, pre: str, sizes: dict[str, Any]) -> MoEBlock:
    """Gemma 4 MoE weights: `MOE`'s, the router's scale, and the experts in Hugging Face's
    layout (experts.gate_up_proj [E, 2F, H], experts.down_proj [E, H, F]) or mlx-lm's
    sanitized one (experts.switch_glu.*_proj)."""
    src, opts = rd.src, rd.opts
    dtype, keep_quantized, where = opts.dtype, opts.keep_quantized, opts.where
    e, f, hid = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    hf = pre + "experts.gate_up_proj"
    if src.has(pre + "experts.gate_up.weight"):  # a GGUF's fused stack (ffn_gate_up_exps), maybe quantized
        gu = pre + "experts.gate_up"
        gate_up = finish_experts(read_expert_stack(src, gu, e, 2 * f, hid, opts.quant_for(gu), where), dtype,
                                 keep_quantized)
        dn = pre + "experts.down"
        down = read_expert_stack(src, dn, e, hid, f, opts.quant_for(dn), where)
    elif src.has(hf):
        gate_up = Linear(weight=src.get(hf, (e, 2 * f, hid), where))
        down = Linear(weight=src.get(pre + "experts.down_proj", (e, hid, f), where))
    else:
        sw = pre + "experts.switch_glu."
        parts = [read_expert_stack(src, sw + n, e, f, hid, opts.quant_for(sw + n), where)
                 for n in ("gate_proj", "up_proj")]
        down = read_expert_stack(src, sw + "down_proj", e, hid, f, opts.quant_for(sw + "down_proj"), where)
        gate_up = fuse_experts(*parts, dtype, keep_quantized)
    scale = src.get(pre + "router.scale", (hid,), where).astype(mx.float32) * hid**-0.5
    return MoEBlock(
        **read_tensors(rd, MOE, cfg, pre, sizes=sizes), router_scale=scale.astype(dtype),
        gate_up=gate_up if gate_up.transposed or gate_up.quantized else finish_experts(gate_up, dtype, keep_quantized),
        down=finish_experts(down, dtype, keep_quantized), top_k=cfg.top_k_experts,
    )


def checkpoint_layout(c: GemmaConfig) -> dict[str, TensorSpec]:
    """The Hugging Face checkpoint's tensors. Gemma 3 stores norms as (1 + w): small w;
    Gemma 4 stores the scale itself: near 1."""
    ncenter = 1.0 if c.is_gemma4 else 0.0

    def S(*shape: int, scale: float = 0.08, center: float = 0.0) -> TensorSpec:
        return TensorSpec(tuple(shape), center=center, scale=scale)

    def N(n: int) -> TensorSpec:
        return TensorSpec((n,), center=ncenter, scale=0.1)

    h, v = c.hidden_size, c.vocab_size
    out: dict[str, TensorSpec] = {"model.embed_tokens.weight": S(v, h, scale=0.5)}
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        d, hk, hq, ff = c.layer_head_dim(i), c.layer_kv_heads(i), c.num_heads, c.layer_intermediate(i)
        out[p + "self_attn.q_proj.weight"] = S(hq * d, h)
        out[p + "self_attn.o_proj.weight"] = S(h, hq * d)
        if c.qk_norm:
            out[p + "self_attn.q_norm.weight"] = N(d)
        if c.computes_kv(i):
            out[p + "self_attn.k_proj.weight"] = S(hk * d, h)
            if c.qk_norm:
                out[p + "self_attn.k_norm.weight"] = N(d)
            if not c.k_eq_v(i):
                out[p + "self_attn.v_proj.weight"] = S(hk * d, h)
        out[p + "mlp.gate_proj.weight"] = S(ff, h)
        out[p + "mlp.up_proj.weight"] = S(ff, h)
        out[p + "mlp.down_proj.weight"] = S(h, ff)
        for n in (("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                   "post_feedforward_layernorm") if c.sandwich_norms else ("input_layernorm", "post_attention_layernorm")):
            out[p + n + ".weight"] = N(h)
        if c.hidden_size_per_layer_input:
            hpl = c.hidden_size_per_layer_input
            out[p + "per_layer_input_gate.weight"] = S(hpl, h, scale=0.3)
            out[p + "per_layer_projection.weight"] = S(h, hpl, scale=0.3)
            out[p + "post_per_layer_input_norm.weight"] = N(h)
        if c.is_gemma4:
            out[p + "layer_scalar"] = S(1, scale=0.1, center=1.0)
        if c.num_experts:  # Hugging Face's layout: fused gate|up stacks
            e, fm = c.num_experts, c.moe_intermediate_size
            out[p + "router.proj.weight"] = S(e, h, scale=0.5)
            out[p + "router.scale"] = N(h)
            out[p + "router.per_expert_scale"] = S(e, scale=0.1, center=1.0)
            out[p + "experts.gate_up_proj"] = S(e, 2 * fm, h)
            out[p + "experts.down_proj"] = S(e, h, fm)
            for n in ("post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                      "pre_feedforward_layernorm_2"):
                out[p + n + ".weight"] = N(h)
    if c.hidden_size_per_layer_input:
        width = c.num_layers * c.hidden_size_per_layer_input
        out["model.embed_tokens_per_layer.weight"] = S(v, width, scale=0.5)
        out["model.per_layer_model_projection.weight"] = S(width, h, scale=0.3)
        out["model.per_layer_projection_norm.weight"] = N(c.hidden_size_per_layer_input)
    out["model.norm.weight"] = N(h)
    if c.tie_word_embeddings is False:
        out["lm_head.weight"] = S(v, h, scale=0.2)
    return out


_TINY = {
    "gemma": {"architectures": ["GemmaForCausalLM"], "num_hidden_layers": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
              "hidden_act": "gelu", "hidden_activation": None},  # (as released: "gelu" meaning the tanh one)
    "gemma3_text": {
        "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": 4, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 16, "sliding_window_pattern": 3,
        "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma2": {
        "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": 4, "head_dim": 16,
        "query_pre_attn_scalar": 16, "sliding_window": 4096, "rms_norm_eps": 1e-6,
        "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
    },
    "gemma4_text": {
        "architectures": ["Gemma4ForCausalLM"], "num_hidden_layers": 6, "head_dim": 16,
        "global_head_dim": 32, "sliding_window": 16, "sliding_window_pattern": 3,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 384, "final_logit_softcapping": 30.0,
        "use_double_wide_mlp": True, "attention_k_eq_v": False, "rms_norm_eps": 1e-6,
        "hidden_activation": "gelu_pytorch_tanh", "enable_moe_block": False,
        "rope_parameters": {
            "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "rope_type": "proportional"},
            "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
        },
    },
}

def _handed_kv(cfg: GemmaConfig, start: int, end: int) -> tuple[tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(stage_kv_in, stage_kv_out) of the stage of layers [start, end) (GemmaConfig): a
    kind's source K/V travel from the stage computing them to the last stage holding
    shared layers of that kind, in the order of the source layers."""
    if not cfg.num_kv_shared_layers:
        return (), ()
    m = cfg.first_shared_layer
    source: dict[str, int] = {}
    for i in range(m, cfg.num_layers):
        source.setdefault(cfg.layer_types[i], cfg.kv_source(i))
    kinds = sorted(source, key=source.__getitem__)

    def wanted(at: int) -> set[str]:  # kinds of the shared layers from layer `at` on
        return set(cfg.layer_types[max(at, m):])

    kv_in = tuple(k for k in kinds if source[k] < start and k in wanted(start))
    kv_out = tuple((k, source[k] - start if source[k] >= start else -1)
                   for k in kinds if source[k] < end and k in wanted(end))
    return kv_in, kv_out


def layer_range(p: GemmaParams, start: int, end: int) -> GemmaParams:
    """The params of layers [start, end) (`family.cut_layers`): the first layers for a
    self-draft, a run of layers for a pipeline stage. Gemma 4's KV-shared layers attend
    over earlier layers' caches: where the source layer lies on an earlier stage, its new
    K/V travel with the stream (`_handed_kv`) into a copy of its cache entry. Per-layer
    inputs: the range's columns of the per-layer table and rows of its projection (whose
    input, the token embeddings, later stages receive with the stream)."""
    cfg = p.config
    if cfg.stage_kv_in or cfg.stage_kv_out:
        raise ConfigError("layers cut from a Gemma 4 model with KV-shared layers (a pipeline stage, a "
                          "self-draft) cannot be cut again")
    shared = max(0, end - max(start, cfg.first_shared_layer)) if cfg.num_kv_shared_layers else 0
    kv_in, kv_out = _handed_kv(cfg, start, end)
    cut = cut_layers(p, start, end, per_layer=("layer_types",))
    if p.embed_per_layer is not None:
        hpl = cfg.hidden_size_per_layer_input
        a, b = start * hpl, end * hpl  # the range's layers' inputs
        table = split_cols(p.embed_per_layer, a, b, "the per-layer input table")
        cut = attrs.evolve(cut, embed_per_layer=attrs.evolve(table, shard=p.embed_per_layer.shard),
                           per_layer_proj=split_rows(p.per_layer_proj, [(a, b)]))
    return attrs.evolve(cut, config=attrs.evolve(cut.config, num_kv_shared_layers=shared,
                                                  stage_kv_in=kv_in, stage_kv_out=kv_out))


def tensor_split(p: GemmaParams, rank: int, size: int) -> GemmaParams:
    """Rank `rank` of `size`'s shard (core/parallel.py). The heads split in units that hold
    whole KV groups of every layer kind (Gemma 4's global layers may have fewer KV heads,
    keys as values): each unit hq/u query heads, hk/u sliding and hk_g/u global KV heads;
    KV-shared layers hold only their query rows. MLPs (double-wide ones too) and experts
    split by features; the vocabulary rows of the embedding, the head and Gemma 4's
    per-layer input table (its projections replicated)."""
    cfg = p.config
    hq, hk = cfg.num_heads, cfg.num_kv_heads
    hkg = cfg.num_global_kv_heads if cfg.attention_k_eq_v and cfg.num_global_kv_heads else hk
    u = math.gcd(hk, hkg)
    u0, u1 = split(u, size, rank)
    layers = []
    for i, lp in enumerate(p.layers):
        name, d, kv = f"layer {i}", cfg.layer_head_dim(i), cfg.layer_kv_heads(i)
        qa, qb, ka, kb = u0 * hq // u, u1 * hq // u, u0 * kv // u, u1 * kv // u
        rows = [(qa * d, qb * d)]
        if cfg.computes_kv(i):
            rows.append(((hq + ka) * d, (hq + kb) * d))
            if not cfg.k_eq_v(i):
                rows.append(((hq + kv + ka) * d, (hq + kv + kb) * d))
        whole = (hq + (0 if not cfg.computes_kv(i) else kv if cfg.k_eq_v(i) else 2 * kv)) * d
        if lp.qkv.out_features != whole:
            raise ConfigError(f"tensor parallel: {name}'s attention is not {whole} rows of q, k, v")
        lp = attrs.evolve(lp, qkv=split_rows(lp.qkv, rows, keep_origin=True),
                          o=split_cols(lp.o, qa * d, qb * d, f"{name} o_proj"))
        lp = split_mlp(lp, rank, size, name)
        if lp.moe is not None:
            lp = attrs.evolve(lp, moe=split_experts(lp.moe, rank, size, i))
        layers.append(lp)
    n = u1 - u0
    small = attrs.evolve(cfg, num_heads=n * hq // u, num_kv_heads=n * hk // u,
                         # (global layers' own KV heads count only with keys as values)
                         num_global_kv_heads=n * hkg // u if cfg.attention_k_eq_v and cfg.num_global_kv_heads
                         else cfg.num_global_kv_heads)
    out = attrs.evolve(p, layers=tuple(layers), config=small)
    if p.embed_per_layer is not None:
        out = attrs.evolve(out, embed_per_layer=split_vocab(p.embed_per_layer, rank, size))
    return split_head(out, rank, size)


FAMILY = Family(
    name="gemma", model_types=("gemma", "gemma2", "gemma3_text", "gemma4_text"), config_type=GemmaConfig,
    params_type=GemmaParams, config_from_hf=config_from_hf, assemble=assemble,
    cache_specs=cache_specs, forward=forward, hidden_to_logits=hidden_to_logits,
    checkpoint_layout=checkpoint_layout, wrappers=MULTIMODAL_WRAPPERS,
    gguf_architectures=("gemma", "gemma2", "gemma3", "gemma4"), config_from_gguf=config_from_gguf,
    assemble_gguf=assemble_gguf,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=lambda model_type, overrides: {
        "model_type": model_type, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 384,
        "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
        **({} if model_type == "gemma4_text" else {"rope_theta": 10000.0}),  # (Gemma 4's: rope_parameters)
        **_TINY[model_type], **overrides},
)
