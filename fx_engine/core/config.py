"""Model configuration: frozen, hashable (it is static metadata of the params pytree)."""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm2")
GEMMA_MODEL_TYPES = ("gemma3_text", "gemma4_text")
# Multimodal checkpoints whose text model fx-engine runs (the vision/audio towers are
# ignored): model_type -> (text model_type, defaults mlx-lm's wrapper applies).
MULTIMODAL_WRAPPERS = {
    "gemma3": ("gemma3_text", {"vocab_size": 262208, "num_attention_heads": 8, "num_key_value_heads": 4}),
    "gemma4": ("gemma4_text", {"vocab_size": 262144, "num_attention_heads": 8, "num_key_value_heads": 1}),
}


def text_config_of(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal wrapper config, as mlx-lm builds it (the
    top-level vocab_size wins; head counts default as in its wrapper)."""
    text_type, defaults = MULTIMODAL_WRAPPERS[d["model_type"]]
    out = {**{k: v for k, v in defaults.items() if k != "vocab_size"}, **d["text_config"]}
    out["vocab_size"] = d.get("vocab_size", defaults["vocab_size"])
    out["model_type"] = text_type
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in out and key in d:
            out[key] = d[key]
    return out


class ConfigError(ValueError):
    """A model configuration that fx-engine cannot run; the message names file and field."""


@attrs.frozen
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_traditional: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # qwen2
    o_bias: bool = False  # llama attention_bias=True puts a bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        d = dict(self.rope_scaling)
        return str(d.get("type") or d.get("rope_type") or "default")


def _get(d: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is ...:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return default


def _positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
    return value


def _check_rope_scaling(scaling: dict[str, Any] | None, source: str) -> tuple | None:
    if not scaling:
        return None
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ConfigError(
            f"{source}: rope_scaling type '{kind}' is not supported "
            "(supported: default, linear, llama3)"
        )
    if kind in ("linear", "llama3"):
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"{source}: rope_scaling.factor must be > 0, got {factor!r}")
    if kind == "llama3":
        low = scaling.get("low_freq_factor", 1.0)
        high = scaling.get("high_freq_factor", 4.0)
        orig = scaling.get("original_max_position_embeddings", 8192)
        if not (isinstance(low, (int, float)) and isinstance(high, (int, float)) and 0 < low < high):
            raise ConfigError(
                f"{source}: rope_scaling needs 0 < low_freq_factor < high_freq_factor, "
                f"got {low!r}, {high!r}"
            )
        if not isinstance(orig, (int, float)) or orig <= 0:
            raise ConfigError(
                f"{source}: rope_scaling.original_max_position_embeddings must be > 0, got {orig!r}"
            )
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> "ModelConfig | GemmaConfig":
    """Build a ModelConfig (or GemmaConfig) from a Hugging Face config.json dict."""
    model_type = d.get("model_type")
    if model_type in MULTIMODAL_WRAPPERS and isinstance(d.get("text_config"), dict):
        return gemma_config_from_hf(text_config_of(d), source)
    if model_type in GEMMA_MODEL_TYPES:
        return gemma_config_from_hf(d, source)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES + GEMMA_MODEL_TYPES)}, and the text "
            f"models of {', '.join(MULTIMODAL_WRAPPERS)} checkpoints)"
        )
    # transformers >= 5 nests rope settings under rope_parameters.
    rope_params = d.get("rope_parameters") or {}
    rope_theta = d.get("rope_theta", rope_params.get("rope_theta"))
    if rope_theta is None:
        rope_theta = 1_000_000.0 if model_type == "qwen2" else 10_000.0
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}

    # Fields that change the computation and that this implementation does not do: refuse.
    if d.get("use_sliding_window") or (
        model_type == "mistral" and d.get("sliding_window") not in (None, 0)
        and d.get("sliding_window", 0) < d.get("max_position_embeddings", 0)
    ):
        raise ConfigError(f"{source}: sliding-window attention is not supported yet")
    layer_types = d.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{source}: layer_types other than full_attention are not supported")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported")
    for key in ("partial_rotary_factor",):
        if d.get(key, 1.0) != 1.0:
            raise ConfigError(f"{source}: field '{key}' != 1 is not supported")

    hidden = _positive_int(_get(d, "hidden_size", source), "hidden_size", source)
    heads = _positive_int(_get(d, "num_attention_heads", source), "num_attention_heads", source)
    kv_heads = _positive_int(d.get("num_key_value_heads") or heads, "num_key_value_heads", source)
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    head_dim = d.get("head_dim") or hidden // heads
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    tie_default = model_type in ("qwen2", "qwen3", "llama", "smollm2")
    attention_bias = bool(d.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        vocab_size=_positive_int(_get(d, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden,
        num_layers=_positive_int(_get(d, "num_hidden_layers", source), "num_hidden_layers", source),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=_positive_int(head_dim, "head_dim", source),
        intermediate_size=_positive_int(
            _get(d, "intermediate_size", source), "intermediate_size", source
        ),
        rms_norm_eps=float(_get(d, "rms_norm_eps", source, 1e-6)),
        rope_theta=float(rope_theta),
        rope_scaling=_check_rope_scaling(scaling, source),
        rope_traditional=bool(d.get("rope_traditional", False)),
        max_position_embeddings=int(d.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", tie_default)),
        qkv_bias=model_type == "qwen2" or attention_bias,
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(d.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        bos_token_id=d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None,
        eos_token_ids=eos_ids,
    )


def config_from_gguf(md: dict[str, Any], source: str) -> ModelConfig:
    """Build a ModelConfig from GGUF metadata (as returned by mx.load)."""
    arch = md.get("general.architecture")
    if arch not in ("llama", "qwen2", "qwen3"):
        raise ConfigError(
            f"{source}: GGUF architecture {arch!r} is not supported (supported: llama, qwen2, qwen3)"
        )

    def val(key: str, default: Any = ...) -> Any:
        full = f"{arch}.{key}"
        if full not in md:
            if default is ...:
                raise ConfigError(f"{source}: GGUF metadata '{full}' is missing")
            return default
        v = md[full]
        return v.item() if hasattr(v, "item") else v

    heads = int(val("attention.head_count"))
    hidden = int(val("embedding_length"))
    vocab = val("vocab_size", None)
    if vocab is None:
        vocab = len(md.get("tokenizer.ggml.tokens", []))
    scaling = None
    kind = val("rope.scaling.type", None)
    if kind and kind != "none":
        if kind != "linear":
            raise ConfigError(f"{source}: GGUF rope scaling type {kind!r} is not supported")
        scaling = (("factor", float(val("rope.scaling.factor"))), ("type", "linear"))
    eos = md.get("tokenizer.ggml.eos_token_id")
    bos = md.get("tokenizer.ggml.bos_token_id")
    head_dim = int(val("attention.key_length", hidden // heads))
    rope_dims = int(val("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ConfigError(f"{source}: partial rotary embeddings (rope.dimension_count) unsupported")
    return ModelConfig(
        model_type={"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(val("block_count")),
        num_heads=heads,
        num_kv_heads=int(val("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(val("feed_forward_length")),
        rms_norm_eps=float(val("attention.layer_norm_rms_epsilon")),
        rope_theta=float(val("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(val("context_length", 4096)),
        tie_word_embeddings=False,  # decided by the loader from the presence of output.weight
        qkv_bias=arch == "qwen2",
        qk_norm=arch == "qwen3",
        bos_token_id=int(bos.item()) if bos is not None else None,
        eos_token_ids=(int(eos.item()),) if eos is not None else (),
    )


# ------------------------------------------------------------------------------ Gemma


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
class GemmaConfig:
    """Gemma 3 (`gemma3_text`) and Gemma 4 (`gemma4_text`) text models, as mlx-lm 0.32
    implements them. Common fields have the same names as ModelConfig's."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    layer_types: tuple[str, ...]  # "sliding_attention" | "full_attention" per layer
    sliding_window: int
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    attn_scale: float
    embed_scale: float
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    rope_traditional: bool = False
    # Gemma 4
    global_head_dim: int = 0  # full-attention layers' head_dim (0: head_dim)
    num_global_kv_heads: int = 0  # full-attention layers' KV heads with k_eq_v (0: num_kv_heads)
    attention_k_eq_v: bool = False  # full-attention layers use their keys as values
    num_kv_shared_layers: int = 0  # the last layers reuse earlier layers' K/V
    hidden_size_per_layer_input: int = 0  # per-layer input embeddings (0: none)
    final_logit_softcapping: float | None = None
    use_double_wide_mlp: bool = False
    v_norm: bool = False  # RMSNorm (no scale) on values
    num_experts: int = 0  # > 0: each layer adds a routed mixture of experts (Gemma 4 MoE)
    top_k_experts: int = 0
    moe_intermediate_size: int = 0

    @property
    def is_gemma4(self) -> bool:
        return self.model_type == "gemma4_text"

    def is_sliding(self, i: int) -> bool:
        return self.layer_types[i] == "sliding_attention"

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def layer_head_dim(self, i: int) -> int:
        if not self.is_sliding(i) and self.global_head_dim:
            return self.global_head_dim
        return self.head_dim

    def layer_kv_heads(self, i: int) -> int:
        if not self.is_sliding(i) and self.attention_k_eq_v and self.num_global_kv_heads:
            return self.num_global_kv_heads
        return self.num_kv_heads

    def k_eq_v(self, i: int) -> bool:
        return self.attention_k_eq_v and not self.is_sliding(i)

    def kv_source(self, i: int) -> int:
        """The layer whose cache entry layer i attends over (itself unless KV-shared)."""
        m = self.first_shared_layer
        if i < m or self.num_kv_shared_layers == 0:
            return i
        return max(j for j in range(m) if self.layer_types[j] == self.layer_types[i])

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


def _refuse(d: dict[str, Any], source: str, key: str, ok: Any, why: str) -> None:
    if key in d and d[key] is not None and not ok(d[key]):
        raise ConfigError(f"{source}: field '{key}' = {d[key]!r} is not supported ({why})")


def gemma_config_from_hf(d: dict[str, Any], source: str) -> GemmaConfig:
    model_type = d["model_type"]
    g4 = model_type == "gemma4_text"
    hidden = _positive_int(_get(d, "hidden_size", source), "hidden_size", source)
    layers = _positive_int(_get(d, "num_hidden_layers", source), "num_hidden_layers", source)
    heads = _positive_int(_get(d, "num_attention_heads", source), "num_attention_heads", source)
    kv_heads = _positive_int(d.get("num_key_value_heads") or 1, "num_key_value_heads", source)
    head_dim = _positive_int(d.get("head_dim") or 256, "head_dim", source)
    window = _positive_int(d.get("sliding_window") or 512, "sliding_window", source)
    pattern = d.get("sliding_window_pattern") or (5 if g4 else 6)
    pattern = _positive_int(pattern, "sliding_window_pattern", source)
    types = d.get("layer_types")
    if types is None:
        if g4:  # mlx-lm's gemma4: (pattern - 1) sliding then one full, repeated
            unit = ["sliding_attention"] * (pattern - 1) + ["full_attention"]
            types = (unit * (layers // len(unit) + 1))[:layers]
        else:  # mlx-lm's gemma3: layer i is global iff (i + 1) % pattern == 0
            types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                     for i in range(layers)]
    elif not g4:
        # mlx-lm's gemma3_text ignores layer_types and follows the pattern: so do we, but a
        # config whose list disagrees with its pattern would silently change the model.
        want = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(layers)]
        if list(types) != want:
            raise ConfigError(f"{source}: layer_types disagrees with sliding_window_pattern {pattern}")
    if len(types) != layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ConfigError(
            f"{source}: layer_types must list {layers} entries of 'sliding_attention' or "
            "'full_attention'")
    act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(f"{source}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    _refuse(d, source, "attn_logit_softcapping", lambda v: False, "mlx-lm does not apply it")
    # "vision": image tokens attend bidirectionally (multimodal); text-only runs are causal
    _refuse(d, source, "use_bidirectional_attention", lambda v: v in (False, "vision"),
            "bidirectional text attention (embedding models)")
    _refuse(d, source, "attention_bias", lambda v: not v, "Gemma attention has no biases")
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    bos = d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None
    common = dict(
        model_type=model_type,
        vocab_size=_positive_int(_get(d, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive_int(_get(d, "intermediate_size", source), "intermediate_size", source),
        rms_norm_eps=float(d.get("rms_norm_eps") or 1e-6),
        layer_types=tuple(types), sliding_window=window,
        max_position_embeddings=int(d.get("max_position_embeddings") or 131072),
        bos_token_id=bos, eos_token_ids=eos_ids,
    )
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_attention_heads ({heads}) is not a multiple of "
                          f"num_key_value_heads ({kv_heads})")
    if not g4:
        _refuse(d, source, "final_logit_softcapping", lambda v: False, "mlx-lm's gemma3_text does not apply it")
        scaling = d.get("rope_scaling")
        qpas = float(d.get("query_pre_attn_scalar") or 256)
        import mlx.core as mx  # the embedding scale is rounded to bfloat16, as mlx-lm does

        embed_scale = float(mx.array(hidden**0.5, mx.bfloat16).astype(mx.float32).item())
        return GemmaConfig(
            **common,
            rope_sliding=RopeSpec(theta=float(d.get("rope_local_base_freq") or 10_000.0)),
            rope_full=_rope_spec(scaling, float(d.get("rope_theta") or 1_000_000.0), source, "rope_scaling"),
            attn_scale=qpas**-0.5, embed_scale=embed_scale,
            tie_word_embeddings=True,  # decided by the loader (lm_head.weight present or not)
        )
    # Gemma 4
    moe = {}
    if d.get("enable_moe_block"):
        moe = {k: _positive_int(d.get(k), k, source)
               for k in ("num_experts", "top_k_experts", "moe_intermediate_size")}
        if moe["top_k_experts"] > moe["num_experts"]:
            raise ConfigError(f"{source}: top_k_experts ({moe['top_k_experts']}) exceeds "
                              f"num_experts ({moe['num_experts']})")
    rp = d.get("rope_parameters") or {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6, "rope_type": "proportional"},
        "sliding_attention": {"partial_rotary_factor": 1.0, "rope_theta": 1e4, "rope_type": "default"},
    }
    hpl = int(d.get("hidden_size_per_layer_input", 256) or 0)
    if hpl and int(d.get("vocab_size_per_layer_input", common["vocab_size"])) != common["vocab_size"]:
        raise ConfigError(f"{source}: vocab_size_per_layer_input != vocab_size is not supported")
    shared = int(d.get("num_kv_shared_layers", 20) or 0)
    if not 0 <= shared < layers:
        raise ConfigError(f"{source}: num_kv_shared_layers must be in [0, {layers}), got {shared}")
    m = layers - shared
    for i in range(m, layers):
        if types[i] not in types[:m]:
            raise ConfigError(f"{source}: KV-shared layer {i} ({types[i]}) has no earlier "
                              "layer of its type to share with")
    cap = d.get("final_logit_softcapping", 30.0)
    gh = d.get("global_head_dim", 512)
    return GemmaConfig(
        **common,
        rope_sliding=_rope_spec(rp.get("sliding_attention"), 10_000.0, source,
                                "rope_parameters.sliding_attention"),
        rope_full=_rope_spec(rp.get("full_attention"), 1_000_000.0, source,
                             "rope_parameters.full_attention"),
        attn_scale=1.0, embed_scale=hidden**0.5,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        rope_traditional=bool(d.get("rope_traditional", False)),
        global_head_dim=int(gh or 0),
        num_global_kv_heads=int(d.get("num_global_key_value_heads") or 0),
        attention_k_eq_v=bool(d.get("attention_k_eq_v", False)),
        num_kv_shared_layers=shared, hidden_size_per_layer_input=hpl,
        final_logit_softcapping=None if cap is None else float(cap),
        use_double_wide_mlp=bool(d.get("use_double_wide_mlp", True)), v_norm=True, **moe,
    )
