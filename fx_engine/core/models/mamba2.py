"""Mamba-2 (`mamba2`), following mlx-lm 0.32's mamba2.py + ssm.py (the parity oracle) where it
agrees with the model's reference.

Where mlx-lm parts from it: the gated norm runs per B/C group (n_groups
groups of intermediate_size / n_groups channels), as Hugging Face's Mamba2 (transformers 5's
Mamba2RMSNormGated), the original mamba_ssm and llama.cpp run it; mlx-lm normalizes the
whole width, which agrees only at n_groups = 1 (Mamba-Codestral-7B has 8 groups).

Every layer is `h = h + mixer(rms_norm(h))` (the block norm with layer_norm_epsilon, as
Hugging Face's Mamba2Block and llama.cpp build it; mlx-lm's is 1e-5 whatever the config
says); no attention, no MLP. The mixer, its equations and its cache (conv inputs and the SSM
state, fixed sizes) are core/models/ssm.py's, shared with the hybrid families.

GGUF: llama.cpp's mamba2 files (`config_from_gguf`, `assemble_gguf`: Mamba2Model's
conversion: ssm.* sizes, the decay stored as -exp(A_log), D and the grouped norm reshaped,
the conv squeezed, the tied head omitted or not as the tensors say).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec
from fx_engine.core.checkpoint import (Embedding, Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors,
                                       renamed)
from fx_engine.core.config import (BOOL, FLOAT, BaseConfig, ConfigError, Field, gguf_hf_config, gguf_value, listed_eos,
                                   positive_int, read_fields, required)
from fx_engine.core.models.family import Family
from fx_engine.core.models.skeleton import DecoderParams, cut_layers, decoder_step, head_logits
from fx_engine.core.models.ssm import (MixerDims, MixerParams, conv_weight, gguf_mixer_names, gguf_mixer_source, mixer,
                                       mixer_layout, read_mixer)
from fx_engine.core.nn import rms_norm
from fx_engine.core.splits import split_head, split_mixer

__all__ = ["FAMILY", "Mamba2Config", "Mamba2Params", "MixerDims", "MixerParams", "conv_weight", "mixer",
           "mixer_layout", "read_mixer"]  # (the mixer's names: core/models/ssm.py's, kept here too)


@attrs.frozen
class Mamba2Config(BaseConfig):
    mixer: MixerDims = None  # type: ignore[assignment]
    block_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20  # no positions: only the cache capacity bounds a row
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@attrs.frozen
class Mamba2Layer:
    norm: mx.array
    mixer: MixerParams


@attrs.frozen
class Mamba2Params(DecoderParams):
    """Its params (the type names the family)."""


def _limits(d: dict[str, Any], source: str) -> tuple[float, float]:
    lim = d.get("time_step_limit", (0.0, math.inf))
    try:
        lo, hi = (float(v) for v in lim)
    except (TypeError, ValueError):
        raise ConfigError(f"{source}: time_step_limit must be a pair of numbers, got {lim!r}") from None
    return lo, hi


# config.json's fields (read in this order; `read_fields`)
_FIELDS = (Field("hidden_size"), Field("num_heads"), Field("n_groups"), Field("head_dim"), Field("conv_kernel"),
           Field("vocab_size"), Field("num_hidden_layers"), Field("layer_norm_epsilon", FLOAT, 1e-5),
           Field("tie_word_embeddings", BOOL, False))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Mamba2Config:
    f = read_fields(d, _FIELDS, source)
    heads, groups, eps = f["num_heads"], f["n_groups"], f["layer_norm_epsilon"]
    if heads % groups:
        raise ConfigError(f"{source}: num_heads ({heads}) is not a multiple of n_groups ({groups})")
    lo, hi = _limits(d, source)
    state = positive_int(d.get("ssm_state_size") or required(d, "state_size", source), "state_size", source)
    mix = MixerDims(hidden=f["hidden_size"], heads=heads, head_dim=f["head_dim"], groups=groups, state=state,
                    kernel=f["conv_kernel"], dt_min=lo, dt_max=hi, norm_eps=eps, norm_groups=groups)
    if mix.kernel < 2:
        raise ConfigError(f"{source}: conv_kernel must be >= 2")
    return Mamba2Config(
        model_type="mamba2", vocab_size=f["vocab_size"], hidden_size=f["hidden_size"],
        num_layers=f["num_hidden_layers"], num_heads=heads, num_kv_heads=heads, head_dim=mix.head_dim,
        intermediate_size=mix.inner, rms_norm_eps=eps, block_norm_eps=eps, mixer=mix,
        tie_word_embeddings=f["tie_word_embeddings"],
        bos_token_id=d.get("bos_token_id"), eos_token_ids=listed_eos(d),
    )


def cache_specs(cfg: Mamba2Config) -> tuple[LayerSpec, ...]:
    return tuple(cfg.mixer.state_spec() for _ in range(cfg.num_layers))


def forward(p: Mamba2Params, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `skeleton.decoder_step` (no attention: span unused)."""
    cfg, num = p.config, p.numerics

    def layers(h: mx.array, geo: Any) -> tuple[mx.array, list[Any]]:
        entries = []
        for lp, entry, spec in zip(p.layers, cache.layers, cache.layout):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            a, entry = mixer(lp.mixer, cfg.mixer, rms_norm(h, lp.norm, cfg.block_norm_eps, num), entry, spec, geo,
                             num)
            h = h + a
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers)


hidden_to_logits = head_logits


# The whole model's params from its tensors (`read_tensors`); each layer's are its norm
# and its mixer (`ssm.read_mixer`) under backbone.layers.{i}.
TOP = (Embedding("embed", "backbone.embeddings"), Vec("norm", "backbone.norm_f.weight", "hidden_size"),
       Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"))


def assemble(cfg: Mamba2Config, src: TensorSource, opts: LoadOptions) -> Mamba2Params:
    rd, h = Reader(src, opts), cfg.hidden_size
    # (biases as the checkpoint has them)
    bias, conv_bias = src.has("backbone.layers.0.mixer.in_proj.bias"), src.has("backbone.layers.0.mixer.conv1d.bias")
    layers = tuple(Mamba2Layer(
        norm=rd.vec(f"backbone.layers.{i}.norm.weight", h),
        mixer=read_mixer(src, f"backbone.layers.{i}.mixer.", cfg.mixer, opts, bias, conv_bias))
        for i in range(cfg.num_layers))
    return Mamba2Params(layers=layers, **read_tensors(rd, TOP, cfg, sizes={"untied": not cfg.tie_word_embeddings}),
                        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


# llama.cpp's names (convert_hf_to_gguf.py's Mamba2Model) -> Hugging Face's
GGUF_TO_HF = (
    (r"^blk\.(\d+)\.attn_norm\.", r"backbone.layers.\1.norm."), *gguf_mixer_names("mixer"),
    (r"^blk\.(\d+)\.", r"backbone.layers.\1."), (r"^token_embd\.", "backbone.embeddings."),
    (r"^output_norm\.", "backbone.norm_f."), (r"^output\.", "lm_head."),
)


def config_from_gguf(md: dict[str, Any], source: str) -> Mamba2Config:
    """Mamba-2 from llama.cpp's mamba2 metadata: the mixers' ssm.* sizes (time_step_rank: the
    heads), one norm eps for the blocks, the mixers and the final norm (as llama.cpp runs
    them); no time-step clamp (llama.cpp's scan has none)."""
    arch = "mamba2"

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

    inner, heads = int(val("ssm.inner_size")), int(val("ssm.time_step_rank"))
    if not heads or inner % heads:
        raise ConfigError(f"{source}: {arch}.ssm.inner_size ({inner}) is not a multiple of "
                          f"{arch}.ssm.time_step_rank ({heads}, the mixers' heads)")
    d = gguf_hf_config(md, arch, source, "mamba2", ffn=False)  # (head_count: 0, unused)
    return config_from_hf({
        "model_type": "mamba2", "hidden_size": d["hidden_size"], "num_hidden_layers": d["num_hidden_layers"],
        "num_heads": heads, "head_dim": inner // heads, "n_groups": int(val("ssm.group_count", 1) or 1),
        "state_size": int(val("ssm.state_size")), "conv_kernel": int(val("ssm.conv_kernel")),
        "vocab_size": d["vocab_size"] or 1, "layer_norm_epsilon": d["rms_norm_eps"],
        "bos_token_id": d["bos_token_id"], "eos_token_id": d["eos_token_id"],
    }, source)


def assemble_gguf(cfg: Mamba2Config, src: TensorSource, opts: LoadOptions) -> Mamba2Params:
    """Params from llama.cpp's tensors: the mixers' vectors reshaped (`ssm.gguf_mixer_source`),
    the head tied where the file has no output tensor, the vocabulary the embedding's rows
    (the converter pads the token list)."""
    src = gguf_mixer_source(renamed(src, GGUF_TO_HF))
    cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight"),
                       vocab_size=int(src.get("backbone.embeddings.weight").shape[0]))
    return assemble(cfg, src, opts)


def checkpoint_layout(cfg: Mamba2Config) -> dict[str, TensorSpec]:
    h = cfg.hidden_size
    out = {"backbone.embeddings.weight": TensorSpec((cfg.vocab_size, h), scale=0.5),
           "backbone.norm_f.weight": TensorSpec((h,), center=1.0, scale=0.1)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = TensorSpec((cfg.vocab_size, h))
    for i in range(cfg.num_layers):
        out[f"backbone.layers.{i}.norm.weight"] = TensorSpec((h,), center=1.0, scale=0.1)
        out.update(mixer_layout(f"backbone.layers.{i}.mixer.", cfg.mixer, False, True))
    return out


def layer_range(p: Mamba2Params, start: int, end: int) -> Mamba2Params:
    return cut_layers(p, start, end)


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": "mamba2", "architectures": ["Mamba2ForCausalLM"], "vocab_size": 384,
            "hidden_size": 64, "num_hidden_layers": 3, "num_heads": 8, "head_dim": 16,
            "intermediate_size": 128, "state_size": 16, "conv_kernel": 4,
            # one group: mlx-lm (the registry's parity oracle) normalizes the whole width;
            # grouped norms are checked against a reference in tests/models/test_ssm_reference.py
            "n_groups": 1,
            "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
            "tie_word_embeddings": False, "time_step_limit": [0.0, 100.0], "time_step_rank": "auto",
            "bos_token_id": 1, "eos_token_id": 2, **overrides}


def tensor_split(p: Mamba2Params, rank: int, size: int) -> Mamba2Params:
    """Rank `rank` of `size`'s shard: every mixer's heads split (core/splits.split_mixer),
    the vocabulary split."""
    layers, dims = [], p.config.mixer
    for i, lp in enumerate(p.layers):
        mp, dims = split_mixer(lp.mixer, p.config.mixer, rank, size, f"layer {i}")
        layers.append(attrs.evolve(lp, mixer=mp))
    cfg = attrs.evolve(p.config, mixer=dims, num_heads=dims.heads, num_kv_heads=dims.heads,
                       intermediate_size=dims.inner)
    return split_head(attrs.evolve(p, layers=tuple(layers), config=cfg), rank, size)


FAMILY = Family(
    name="mamba2", model_types=("mamba2",), config_type=Mamba2Config, params_type=Mamba2Params,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    tensor_split=tensor_split, layer_range=layer_range, tiny_config=tiny_config,
    gguf_architectures=("mamba2",), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
