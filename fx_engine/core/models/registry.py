"""The registry of model families: every `model_type` (and multimodal wrapper) and GGUF
`general.architecture` mapped to its family's `Family` record, and the functions that
dispatch on a config's (or params') type at trace time.

It is its own module, imported by the package (`fx_engine.core.models` re-exports every
name here) and by core/parallel.py, and importing no one but the family modules: a family
never imports the registry, so there is no circle between them. A new architecture is one
new family module plus one entry in FAMILIES; `MODEL_TYPE_MODULES` (generated from
FAMILIES) says which module file runs each model_type.
"""

from __future__ import annotations

import difflib
from typing import Any, Union

from fx_engine.core.cache import LayerSpec, finish_layout
from fx_engine.core.config import ConfigError
from fx_engine.core.models import (cohere, deepseek, falcon_h1, gemma, gpt_oss, granitemoehybrid, hf_config, lfm2, llama,
                                   mamba2, moe, nemotron_h, neox, phi3, postnorm, qwen3_next, starcoder2)
from fx_engine.core.models.family import Family
from fx_engine.core.models.skeleton import Capture, CaptureError
from fx_engine.core.tree import tree_replace

_MODULES = (llama, gemma, phi3, moe, postnorm, gpt_oss, deepseek, starcoder2, cohere, lfm2, mamba2, nemotron_h,
            qwen3_next, granitemoehybrid, falcon_h1, neox)
FAMILIES: tuple[Family, ...] = tuple(m.FAMILY for m in _MODULES)

#: family name -> the module that defines it (dotted name)
FAMILY_MODULES: dict[str, str] = {m.FAMILY.name: m.__name__ for m in _MODULES}
#: every supported config.json model_type (wrappers included) -> the module that runs it
MODEL_TYPE_MODULES: dict[str, str] = {mt: m.__name__ for m in _MODULES
                                      for mt in (*m.FAMILY.model_types, *m.FAMILY.wrappers)}

#: wrappers whose config.json may keep the text model's fields at the top level, without a
#: text_config (Qwen2(.5)-VL's as published before transformers 4.52; mlx-vlm reads both)
TOP_LEVEL_TEXT = ("qwen2_5_vl", "qwen2_vl")
_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
_BY_WRAPPER = {mt: f for f in FAMILIES for mt in f.wrappers}
_BY_GGUF: dict[str, list[Family]] = {}
for _f in FAMILIES:
    for _a in _f.gguf_architectures:
        _BY_GGUF.setdefault(_a, []).append(_f)
_BY_TYPE = {t: f for f in FAMILIES for t in (f.config_type, f.params_type)}

#: the params pytree of any registered family: each family's `params_type`, spelled out so
#: that type checkers read it (beartype checks it at run time); `FAMILIES` must list the
#: same types (tests/models/test_every_family.py checks it)
AnyParams = Union[
    llama.Params, gemma.GemmaParams, phi3.Phi3Params, moe.MoEParams, postnorm.PostNormParams, gpt_oss.GptOssParams,
    deepseek.DeepseekParams, starcoder2.Starcoder2Params, cohere.CohereParams, lfm2.Lfm2Params, mamba2.Mamba2Params,
    nemotron_h.NemotronHParams, qwen3_next.Qwen3NextParams, granitemoehybrid.GraniteHybridParams,
    falcon_h1.FalconH1Params, neox.NeoxParams,
]

__all__ = [
    "AnyParams", "Capture", "CaptureError", "FAMILIES", "FAMILY_MODULES", "Family", "MODEL_TYPE_MODULES",
    "cache_layout", "config_from_gguf", "config_from_hf", "family_of", "forward", "gguf_family", "hf_family",
    "hidden_to_logits", "model_type_modules", "model_types", "module_file", "text_config_of",
]


def model_types() -> dict[str, str]:
    """Every supported config.json model_type -> its family's name."""
    return {**{mt: f.name for mt, f in _BY_MODEL_TYPE.items()},
            **{mt: f"{f.name} (text model)" for mt, f in _BY_WRAPPER.items()}}


def model_type_modules() -> dict[str, str]:
    """Every supported model_type (wrappers included) -> the dotted name of the module that
    runs it (its family's module): where to read or change a model."""
    return dict(MODEL_TYPE_MODULES)


def module_file(model_type: str) -> str:
    """The file of the module that runs `model_type`, relative to the fx_engine package
    (e.g. "core/models/llama.py" for qwen3); KeyError for an unsupported one."""
    return MODEL_TYPE_MODULES[model_type].removeprefix("fx_engine.").replace(".", "/") + ".py"


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
    if fam is None and mt in _BY_WRAPPER and (isinstance(d.get("text_config"), dict) or mt in TOP_LEVEL_TEXT):
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
    text = d.get("text_config")
    if not isinstance(text, dict):  # (TOP_LEVEL_TEXT: the top level is the text config)
        text = {k: v for k, v in d.items() if k not in ("vision_config", "model_type")}
    out = {**{k: v for k, v in defaults.items() if k != "vocab_size"}, **text}
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
    model's, for a multimodal wrapper), read as Hugging Face's configuration class reads it
    (`hf_config.normalize`: either dialect, its defaults for what the config leaves out)."""
    fam = hf_family(d, source)
    if d.get("model_type") in fam.wrappers:
        d = text_config_of(hf_config.decode_floats(d))
    return fam.config_from_hf(hf_config.normalize(d), source)


def gguf_family(md: dict[str, Any], source: str) -> Family:
    """The family that reads a GGUF file's metadata (its general.architecture; where two
    families share one, the one whose `gguf_accepts` takes it)."""
    arch = md.get("general.architecture")
    fams = [f for f in _BY_GGUF.get(arch, []) if f.gguf_accepts is None or f.gguf_accepts(md)]
    if not fams:
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not supported "
                          f"(supported: {', '.join(_BY_GGUF)})")
    return fams[0]


def config_from_gguf(md: dict[str, Any], source: str) -> Any:
    return gguf_family(md, source).config_from_gguf(md, source)


def forward(params: Any, cache: Any, tokens: Any, n_valid: Any, span: int | None = None,
            capture: Capture | None = None, images: Any = None, pack: int | None = None) -> Any:
    """The family's forward: (final hidden [B, T, H], cache); with a `skeleton.Capture`,
    (hidden, cache, captured [B, T, points * H]), the captured states of every position
    from the same forward. A family whose forward does not go through
    `skeleton.decoder_step` refuses capture (CaptureError naming its model type).
    images: a `vision.splice.ImageInput` (the step's image rows; Gemma 3 text models, the
    Llama family's: Idefics3 / SmolVLM, Qwen-VL, Mistral 3, and the MoE family's Qwen3-VL-MoE);
    None: text only. With both, the
    captured states are those of the forward with the image rows spliced in.
    pack: the row-wise work on this many rows holding the valid tokens (core/packing.py;
    None: on all B*T); a ValueError for families that cannot (`Family.packs_rows`) and
    with images."""
    family = family_of(params)
    kw = {}
    if pack is not None:
        if not family.packs_rows:
            kind = getattr(params.config, "model_type", family.name)
            raise ValueError(f"pack: {kind} models do not run on packed rows (their layers read the "
                             "padded [B, T] layout); pass pack=None")
        if images is not None:
            raise ValueError("pack: a step with image rows does not run on packed rows; pass pack=None")
        cache = tree_replace(cache, packed=pack)
    if images is not None:
        if family.name not in ("gemma", "llama", "moe"):
            kind = getattr(params.config, "model_type", family.name)
            raise ValueError(f"images: {kind} models take no image rows")
        kw = {"images": images}
    if capture is None:
        return family.forward(params, cache, tokens, n_valid, span, **kw)
    if not isinstance(capture, Capture):
        raise TypeError(f"capture must be a fx_engine.core.models.skeleton.Capture, got {type(capture).__name__}")
    out = family.forward(params, tree_replace(cache, capture=capture), tokens, n_valid, span, **kw)
    if len(out) != 3:
        kind = getattr(params.config, "model_type", family.name)
        raise CaptureError(f"capturing hidden states is not supported for {kind} models (the {family.name} "
                           "forward does not go through skeleton.decoder_step)")
    return out


def packs_rows(params: Any) -> bool:
    """Whether steps of these params may run on packed rows (core/packing.py; the steps'
    `pack`): the family's layers allow it (`Family.packs_rows`) and they are not a
    pipeline stage."""
    return family_of(params).packs_rows and getattr(params, "pipeline", None) is None


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
