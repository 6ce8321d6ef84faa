"""Model families and their registry.

One module per family (llama.py, gemma.py, phi3.py, moe.py, postnorm.py, gpt_oss.py,
deepseek.py, starcoder2.py, cohere.py, and the recurrent / hybrid lfm2.py, mamba2.py,
nemotron_h.py, qwen3_next.py, granitemoehybrid.py, falcon_h1.py) holds everything about it as pure
functions over frozen pytrees: its config and how it is read from config.json / GGUF
metadata, how checkpoint tensors become its params, its cache layout, its forward and
output head, collected in its `FAMILY` record (family.py). This registry maps every
`model_type` and GGUF `general.architecture` to a family; the functions here dispatch on a
config's (or params') type at trace time. A new architecture is one new module plus one
entry in FAMILIES.
"""

from __future__ import annotations

import difflib
from typing import Any

from fx_engine.core.cache import LayerSpec, finish_layout
from fx_engine.core.config import ConfigError
from fx_engine.core.models import (cohere, deepseek, falcon_h1, gemma, gpt_oss, granitemoehybrid, lfm2, llama, mamba2, moe, nemotron_h, phi3, postnorm, qwen3_next, starcoder2)
from fx_engine.core.models.family import Family
from fx_engine.core.models.gemma import GemmaConfig, GemmaLayer, GemmaParams
from fx_engine.core.models.llama import LayerParams, LlamaConfig, Params

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gemma.FAMILY, phi3.FAMILY, moe.FAMILY, postnorm.FAMILY, gpt_oss.FAMILY,
                                 deepseek.FAMILY, starcoder2.FAMILY, cohere.FAMILY, lfm2.FAMILY, mamba2.FAMILY,
                                 nemotron_h.FAMILY, qwen3_next.FAMILY, granitemoehybrid.FAMILY, falcon_h1.FAMILY)

_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
_BY_WRAPPER = {mt: f for f in FAMILIES for mt in f.wrappers}
_BY_GGUF: dict[str, list[Family]] = {}
for _f in FAMILIES:
    for _a in _f.gguf_architectures:
        _BY_GGUF.setdefault(_a, []).append(_f)
_BY_TYPE = {t: f for f in FAMILIES for t in (f.config_type, f.params_type)}

AnyParams = Any  # the params pytree of any registered family (each family's params_type)

__all__ = [
    "AnyParams", "FAMILIES", "Family", "GemmaConfig", "GemmaLayer", "GemmaParams", "LayerParams",
    "LlamaConfig", "Params", "cache_layout", "config_from_gguf", "config_from_hf", "family_of",
    "forward", "gguf_family", "hf_family", "hidden_to_logits", "model_types", "text_config_of",
]


def model_types() -> dict[str, str]:
    """Every supported config.json model_type -> its family's name."""
    return {**{mt: f.name for mt, f in _BY_MODEL_TYPE.items()},
            **{mt: f"{f.name} (text model)" for mt, f in _BY_WRAPPER.items()}}


def family_of(x: Any) -> Family:
    """The family of a config or params pytree."""
    fam = _BY_TYPE.get(type(x)) or _BY_TYPE.get(type(getattr(x, "config", None)))
    if fam is None:
        raise TypeError(f"{type(x).__name__} is not the config or params of a registered model family")
    return fam


def hf_family(d: dict[str, Any], source: str = "config.json") -> Family:
    """The family that reads a config.json dict (its model_type), or a ConfigError naming
    what is supported."""
    mt = d.get("model_type")
    fam = _BY_MODEL_TYPE.get(mt)
    if fam is None and mt in _BY_WRAPPER and isinstance(d.get("text_config"), dict):
        fam = _BY_WRAPPER[mt]
    if fam is None:
        near = difflib.get_close_matches(str(mt), [*_BY_MODEL_TYPE, *_BY_WRAPPER], n=3, cutoff=0.5)
        hint = (f"nearest supported: {', '.join(f'{n} ({(_BY_MODEL_TYPE.get(n) or _BY_WRAPPER[n]).name} family)' for n in near)}; "
                if near else "")
        raise ConfigError(
            f"{source}: model_type {mt!r} is not supported ({hint}all supported: "
            f"{', '.join(_BY_MODEL_TYPE)}, and the text models of {', '.join(_BY_WRAPPER)} "
            "checkpoints; `fx-engine info` lists them by family)")
    return fam


def text_config_of(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal wrapper config, as mlx-lm builds it (the
    top-level vocab_size wins; head counts default as in its wrapper)."""
    fam = _BY_WRAPPER[d["model_type"]]
    text_type, defaults = fam.wrappers[d["model_type"]]
    out = {**{k: v for k, v in defaults.items() if k != "vocab_size"}, **d["text_config"]}
    vocab = d.get("vocab_size", out.get("vocab_size", defaults.get("vocab_size")))
    if vocab is not None:
        out["vocab_size"] = vocab
    # the text model's own type when the wrapper's family runs it (mistral3 wraps ministral3
    # or mistral), else the wrapper's usual one
    if out.get("model_type") not in fam.model_types:
        out["model_type"] = text_type
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in out and key in d:
            out[key] = d[key]
    return out


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Any:
    """The config of any registered family from a Hugging Face config.json dict (the text
    model's, for a multimodal wrapper)."""
    fam = hf_family(d, source)
    if d.get("model_type") in fam.wrappers:
        d = text_config_of(d)
    return fam.config_from_hf(d, source)


def gguf_family(md: dict[str, Any], source: str) -> Family:
    arch = md.get("general.architecture")
    fams = [f for f in _BY_GGUF.get(arch, []) if f.gguf_accepts is None or f.gguf_accepts(md)]
    if not fams:
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported "
                          f"(supported: {', '.join(_BY_GGUF)})")
    return fams[0]


def config_from_gguf(md: dict[str, Any], source: str) -> Any:
    return gguf_family(md, source).config_from_gguf(md, source)


def forward(params: Any, cache: Any, tokens: Any, n_valid: Any, span: int | None = None) -> Any:
    return family_of(params).forward(params, cache, tokens, n_valid, span)


def hidden_to_logits(params: Any, h: Any) -> Any:
    return family_of(params).hidden_to_logits(params, h)


def cache_layout(
    config: Any, *, headroom: int = 512, kv_bits: int | None = None, kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> tuple[LayerSpec, ...]:
    """The cache layout a model needs: one `LayerSpec` per cache entry.

    headroom: extra ring slots of sliding-window entries; must be >= the longest step (prefill
    chunk, verify length) minus one. kv_bits (4 or 8) / kv_group_size / quantized_kv_start:
    quantize full-attention entries as mlx-lm's QuantizedKVCache does, positions below
    quantized_kv_start kept in float.
    """
    return finish_layout(
        family_of(config).cache_specs(config), headroom=headroom, kv_bits=kv_bits or 0,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )
