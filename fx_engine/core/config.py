"""What every family's config reading shares: the error type and field checks.

Each family module (fx_engine/core/models/<family>.py) holds its own frozen config class
and how it is read from `config.json` and GGUF metadata; these helpers make every refusal
name the file and the field.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs


@attrs.frozen
class BaseConfig:
    """The fields every family's frozen config starts with (what the shell may read without
    knowing the family; each family adds its own after them). Hashable: it is static
    metadata of the params pytree, part of every compile key."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float


class ConfigError(ValueError):
    """A model configuration that fx-engine cannot run; the message names file and field."""


def required(d: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is ...:
        raise ConfigError(f"{source}: required field '{key}' is missing")
    return default


def positive_int(value: Any, key: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive integer, got {value!r}")
    return value


def listed_eos(d: dict[str, Any]) -> tuple[Any, ...]:
    """eos_token_id as a tuple, whatever it holds (one id or a list; () when absent)."""
    eos = d.get("eos_token_id")
    return tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()


# ---------------------------------------------------------------- config fields as tables


def _positive(value: Any, key: str, source: str) -> int:
    return positive_int(value, key, source)


def _number(kind: Callable[[Any], Any]) -> Callable[[Any, str, str], Any]:
    return lambda value, key, source: kind(value)


def _positive_number(value: Any, key: str, source: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise ConfigError(f"{source}: field '{key}' must be a positive number, got {value!r}")
    return float(value)


def _maybe_bool(value: Any, key: str, source: str) -> bool | None:
    return None if value is None else bool(value)


def _maybe_positive(value: Any, key: str, source: str) -> int | None:
    return None if value is None else positive_int(value, key, source)


POSITIVE = _positive  # a positive integer (an error names the field and the value)
POSITIVE_FLOAT = _positive_number  # a positive int or float, as a float (an error names it)
FLOAT, INT, BOOL = _number(float), _number(int), _number(bool)  # converted as is
MAYBE_BOOL = _maybe_bool  # None stays None ("the checkpoint decides"), else bool
MAYBE_FLOAT = _number(lambda v: None if v is None else float(v))  # None stays None ("off"), else float
INT_OR_ZERO = _number(lambda v: int(v or 0))  # a count whose null (or 0) means none
MAYBE_POSITIVE = _maybe_positive  # None stays None (the feature is off), else POSITIVE


@attrs.frozen
class Same:
    """A default that is another field's value, read earlier in the same table and named
    as `read_fields` names it (`to`, else `key`): a missing num_key_value_heads is
    num_attention_heads."""

    key: str


@attrs.frozen
class Field:
    """One config.json field a family reads, as data: its `key`, how its value is checked
    and converted (`kind`: POSITIVE, FLOAT, INT, BOOL, the others above, or any
    (value, key, source) -> value), and its `default` (`...`: required; a missing or null
    required field is an error that names it; `Same(key)`: an earlier field's value).
    How a present value falls back to the
    default: `or_default`, a false-y one (0, "", None) does, as `d.get(key) or default`
    reads it; `null_default`, a null one does, as `required(d, key, source, default)`
    reads it; otherwise only a missing key does (`d.get(key, default)`). `to`: the name
    its value goes by in `read_fields`' result (the config's attribute), if not `key`."""

    key: str
    kind: Callable[[Any, str, str], Any] = POSITIVE
    default: Any = ...
    or_default: bool = False
    null_default: bool = False
    to: str | None = None


def read_fields(d: dict[str, Any], fields: tuple[Field, ...], source: str) -> dict[str, Any]:
    """The fields' checked values by name (`to`, else `key`), read in table order (the first
    bad field's error is the one raised), so a family declares what it reads instead of
    spelling out each check."""
    out: dict[str, Any] = {}
    for f in fields:
        default = out[f.default.key] if isinstance(f.default, Same) else f.default
        if default is ...:
            value = required(d, f.key, source)
        elif f.or_default:
            value = d.get(f.key) or default
        elif f.null_default:
            value = required(d, f.key, source, default)
        else:
            value = d.get(f.key, default)
        out[f.to or f.key] = f.kind(value, f.key, source)
    return out


def read_field(d: dict[str, Any], field: Field, source: str) -> Any:
    """One field's checked value (`read_fields` of a table of one): for a field read only
    in some configs (a window only when some layer slides)."""
    return read_fields(d, (field,), source)[field.to or field.key]


def check_rope_scaling(scaling: dict[str, Any] | None, source: str) -> tuple | None:
    if not scaling:
        return None
    kind = scaling.get("type") or scaling.get("rope_type") or "default"
    supported = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
    if kind not in supported:
        raise ConfigError(
            f"{source}: rope_scaling type '{kind}' is not supported "
            f"(supported: {', '.join(supported)})"
        )
    if kind in ("linear", "llama3", "yarn", "dynamic"):
        factor = scaling.get("factor")
        if not isinstance(factor, (int, float)) or not factor > 0:
            raise ConfigError(f"{source}: rope_scaling.factor must be > 0, got {factor!r}")
    for key in ("original_max_position_embeddings", "beta_fast", "beta_slow"):
        v = scaling.get(key)
        if kind in ("yarn", "longrope") and v is not None and not (isinstance(v, (int, float)) and v > 0):
            raise ConfigError(f"{source}: rope_scaling.{key} must be > 0, got {v!r}")
    if kind == "longrope":
        long = scaling.get("long_factor")
        if not isinstance(long, list) or not long or not all(isinstance(x, (int, float)) and x > 0 for x in long):
            raise ConfigError(f"{source}: rope_scaling.long_factor must list positive numbers")
        if scaling.get("original_max_position_embeddings") is None:
            raise ConfigError(f"{source}: rope_scaling.original_max_position_embeddings is required for longrope")
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


def refuse(d: dict[str, Any], source: str, key: str, ok: Any, why: str) -> None:
    if key in d and d[key] is not None and not ok(d[key]):
        raise ConfigError(f"{source}: field '{key}' = {d[key]!r} is not supported ({why})")


def token_ids(d: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(bos_token_id, eos_token_ids) of a config.json (eos may be an int or a list)."""
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
    bos = d.get("bos_token_id") if isinstance(d.get("bos_token_id"), int) else None
    return bos, eos_ids


def gguf_value(md: dict[str, Any], arch: str, key: str, source: str, default: Any = ...) -> Any:
    """GGUF metadata `<arch>.<key>` as a Python value (mx.load returns 0-d arrays)."""
    full = f"{arch}.{key}"
    if full not in md:
        if default is ...:
            raise ConfigError(f"{source}: GGUF metadata '{full}' is missing")
        return default
    v = md[full]
    return v.item() if hasattr(v, "item") else v


def gguf_ints(md: dict[str, Any], key: str) -> list[int] | None:
    """GGUF metadata `key` as a list of ints (a scalar as one entry; None where missing):
    llama.cpp's per-layer arrays (attention.head_count_kv, feed_forward_length)."""
    v = md.get(key)
    if v is None:
        return None
    raw = v.tolist() if hasattr(v, "tolist") else v
    return [int(x) for x in (raw if isinstance(raw, (list, tuple)) else [raw])]


def trunk_layers(md: dict[str, Any], arch: str, source: str) -> int:
    """The decoder layers a GGUF file's trunk runs: llama.cpp counts the NextN (MTP)
    modules it keeps (`<arch>.nextn_predict_layers`, the last blocks: GLM-4.5's glm4moe,
    GLM-4.7-Flash's and DeepSeek's deepseek2, ...) in block_count; run as ordinary layers
    they would silently change every output. Drafters read them (core/drafters/mtp.py)."""
    blocks = int(gguf_value(md, arch, "block_count", source))
    nextn = int(gguf_value(md, arch, "nextn_predict_layers", source, 0) or 0)
    if not 0 <= nextn < blocks:
        raise ConfigError(f"{source}: {arch}.nextn_predict_layers {nextn} with block_count {blocks}: "
                          "the NextN layers must be fewer than the blocks")
    return blocks - nextn


def gguf_hf_config(md: dict[str, Any], arch: str, source: str, model_type: str, *,
                   rope_theta: float = 10000.0, context: int = 4096, ffn: bool = True) -> dict[str, Any]:
    """The config.json fields every llama.cpp architecture writes the same way, from its
    `<arch>.*` metadata: sizes, heads (and head_dim when key_length says), the norm's eps
    (RMSNorm's or LayerNorm's key), RoPE base, context, vocabulary and BOS/EOS ids. A
    family's `config_from_gguf` adds its own keys and calls its `config_from_hf`."""
    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    heads, hidden = int(val("attention.head_count")), int(val("embedding_length"))
    eps = val("attention.layer_norm_rms_epsilon", None)
    eos, bos = md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.bos_token_id")
    d: dict[str, Any] = {
        "model_type": model_type, "hidden_size": hidden, "num_hidden_layers": trunk_layers(md, arch, source),
        "num_attention_heads": heads, "num_key_value_heads": int(val("attention.head_count_kv", heads)),
        "rms_norm_eps": float(eps if eps is not None else val("attention.layer_norm_epsilon")),
        "rope_theta": float(val("rope.freq_base", rope_theta)),
        "max_position_embeddings": int(val("context_length", context)),
        "vocab_size": int(val("vocab_size", None) or len(md.get("tokenizer.ggml.tokens", []))),
        "bos_token_id": int(bos.item() if hasattr(bos, "item") else bos) if bos is not None else None,
        "eos_token_id": int(eos.item() if hasattr(eos, "item") else eos) if eos is not None else None,
    }
    if val("attention.key_length", None) is not None:
        d["head_dim"] = int(val("attention.key_length"))
    if ffn:
        d["intermediate_size"] = int(val("feed_forward_length"))
    return d


def gguf_grouped_experts(md: dict[str, Any], arch: str, source: str, softmax: bool = False) -> dict[str, Any]:
    """DeepSeek-V3-style routed experts from llama.cpp's keys (deepseek2, glm4moe), as
    config.json fields: sigmoid routing (expert_gating_func 2); with `softmax`, DeepSeek-V2's
    softmax routing too (1, which a file without the key means, as llama.cpp reads deepseek2),
    given as its topk_method (group-limited where the file has groups)."""
    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    gating = int(val("expert_gating_func", 1 if softmax else 2))
    if gating not in ((1, 2) if softmax else (2,)):
        raise ConfigError(f"{source}: {arch}.expert_gating_func {gating!r}: only "
                          + ("softmax (1) or sigmoid (2)" if softmax else "sigmoid") + " routing is supported")
    groups = int(val("expert_group_count", 1) or 1)
    v2 = {"topk_method": "group_limited_greedy" if groups > 1 else "greedy",
          "norm_topk_prob": bool(val("expert_weights_norm", False))} if gating == 1 else {}
    return {"n_routed_experts": int(val("expert_count")), "num_experts_per_tok": int(val("expert_used_count")),
            "n_shared_experts": int(val("expert_shared_count", 0)),
            "moe_intermediate_size": int(val("expert_feed_forward_length")),
            "first_k_dense_replace": int(val("leading_dense_block_count", 0)),
            "routed_scaling_factor": float(val("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(val("expert_weights_norm", True)),
            "n_group": groups, "topk_group": int(val("expert_group_used_count", 1) or 1), **v2}


def gguf_yarn(md: dict[str, Any], arch: str, source: str, **extra: Any) -> dict[str, Any] | None:
    """config.json's rope_scaling from llama.cpp's rope.scaling keys: None, or YaRN (its only
    supported kind here) with the given extra fields (mscale conventions differ by family)."""
    kind = gguf_value(md, arch, "rope.scaling.type", source, None)
    if kind in (None, "none"):
        return None
    if kind != "yarn":
        raise ConfigError(f"{source}: {arch}.rope.scaling.type {kind!r} is not supported (yarn)")
    return {"type": "yarn", "factor": float(gguf_value(md, arch, "rope.scaling.factor", source)),
            "original_max_position_embeddings": int(gguf_value(md, arch, "rope.scaling.original_context_length", source)),
            "beta_fast": 32.0, "beta_slow": 1.0, **extra}
