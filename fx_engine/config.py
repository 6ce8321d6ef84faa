"""Model configuration: frozen, hashable (it is static metadata of the params pytree)."""

from __future__ import annotations

from typing import Any

import attrs

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "smollm2")


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


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    model_type = d.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
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
