"""The Llama family, everything about it in one module: llama (2/3, rope scaling linear/llama3), mistral,
qwen2 (q/k/v bias), qwen3 (q/k RMSNorm), SmolLM2, MiMo (a Qwen2 trunk), ERNIE 4.5 and Helium (interleaved
RoPE), Seed-OSS, InternLM3, EXAONE 3 (Llama under its own tensor names), MiniCPM 1 / 2 (muP scales as
granite's multipliers), Hunyuan dense (q/k RMSNorms after RoPE, NTK-alpha RoPE); tied or untied embeddings.
Its config (from config.json and GGUF metadata), its checkpoint names (Hugging Face / mlx-community and
llama.cpp's, with the converter's q/k permutation undone), its cache layout, its pure
forward and output head; the decoder is shared with families of the same shape (phi3).

Projections are fused at load time (q|k|v into one matrix, gate|up into one): fewer graph
nodes, and on CPU each node costs ~10 us to evaluate whatever its size.

MiMo checkpoints (model_type "mimo") also hold MTP modules under model.mtp_layers.*, left
unread here: the drafter's loader reads them (fx_engine.core.drafters.mtp).

Qwen2-VL / Qwen2.5-VL checkpoints (model_types "qwen2_vl", "qwen2_5_vl") run their Qwen2
text model here; a prefill step of an image prompt rotates with M-RoPE over 3-D position
ids (core/models/mrope.py; the prompt side: core/vision/qwen2_vl.py), every other step
with plain RoPE. Qwen3-VL ("qwen3_vl") runs its Qwen3 text model likewise, with the
M-RoPE frequencies interleaved and its DeepStack rows (`ImageInput.deepstack`) added at
the image tokens after the first layers (core/vision/qwen3_vl.py).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, dense_layout
from fx_engine.core.checkpoint import (Embedding, Fused, Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec,
                                       WeightsError, read_tensors, renamed, renamed_name)
from fx_engine.core.config import (BOOL, FLOAT, INT, MAYBE_BOOL, POSITIVE_FLOAT, BaseConfig, ConfigError, Field, Same,
                                   check_rope_scaling, gguf_hf_config, gguf_value, positive_int, read_fields, token_ids)
from fx_engine.core.models.blocks import (GATE_UP, HF_LAYER, QKV, apply_partial_rope, attention_sizes, decoder_layer,
                                          rope_freqs, rope_mscale, rope_type_of, scaled_rope, self_attention)
from fx_engine.core.models.family import Family
from fx_engine.core.models.mrope import mrope_tables
from fx_engine.core.models.skeleton import (PipelineStage, cut_layers, decoder_step, embedded_tokens, final_rms_norm,
                                            stage_logits)
from fx_engine.core.nn import Linear, Numerics, linear
from fx_engine.core.splits import shard_decoder
from fx_engine.core.tree import static_field
from fx_engine.core.vision.splice import check_image_input, deepstack_adder, splice_images, step_positions


@attrs.frozen
class LlamaConfig(BaseConfig):
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_traditional: bool = False
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool | None = False  # None: decided by the checkpoint (lm_head present or not)
    qkv_bias: bool = False  # qwen2
    o_bias: bool = False  # llama attention_bias=True puts a bias on o_proj too
    mlp_bias: bool = False
    qk_norm: bool = False  # qwen3
    qk_norm_after_rope: bool = False  # hunyuan_v1_dense: its q/k norms normalize the rotated heads
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    no_rope_layers: tuple[int, ...] = ()  # smollm3: layers whose attention has no RoPE (NoPE)
    # granite: the embedding times embedding_multiplier, attention scale attention_multiplier
    # (instead of head_dim^-0.5), each residual branch times residual_multiplier, the logits
    # divided by logits_scaling
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # sliding-window layers ("sliding_attention" per layer; () = all full attention)
    layer_types: tuple[str, ...] = ()
    sliding_window: int = 0
    # ministral3: queries times 1 + beta * ln(1 + floor(position / attn_temp_max_pos))
    attn_temp_beta: float = 0.0
    attn_temp_max_pos: int = 0
    # tensor parallelism (core/parallel.py): the whole q and k projections' widths when
    # their norms (OLMo's, over every head) are split over the ranks; () not split
    qk_norm_width: tuple[int, ...] = ()
    # Qwen2(.5)-VL's M-RoPE (rope_scaling.mrope_section): how many of the head_dim / 2
    # frequencies take their angle from the temporal, height and width position ids
    # (core/models/mrope.py; only steps with image positions use it: text is plain RoPE)
    mrope_section: tuple[int, ...] = ()
    # Qwen3-VL's M-RoPE layout: the sections' frequencies interleaved (t h w t h w ...)
    # instead of consecutive (core/models/mrope.py); Qwen3-VL's alone, so it also says the
    # image steps carry DeepStack rows (`forward` refuses images without them)
    mrope_interleaved: bool = False

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.rope_scaling)



# config.json's fields read as they are (`read_fields`, in this order), by LlamaConfig's names
_FIELDS = (
    Field("num_hidden_layers", to="num_layers"), Field("hidden_size"), Field("num_attention_heads", to="num_heads"),
    Field("num_key_value_heads", default=Same("num_heads"), or_default=True, to="num_kv_heads"),
    Field("vocab_size"), Field("intermediate_size"), Field("rms_norm_eps", FLOAT, 1e-6, null_default=True),
    Field("rope_traditional", BOOL, False), Field("max_position_embeddings", INT, 4096, or_default=True),
    # a config that does not say: tied unless the checkpoint has its own output head
    Field("tie_word_embeddings", MAYBE_BOOL, None), Field("mlp_bias", BOOL, False),
)
# granite: the four multipliers, each a positive number
_GRANITE_FIELDS = tuple(Field(k, POSITIVE_FLOAT) for k in (
    "embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"))


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> LlamaConfig:
    """A LlamaConfig from a Hugging Face config.json dict; refuses what this family cannot
    run (other activations, partial rotary), naming the field."""
    model_type = d["model_type"]
    f = read_fields(d, _FIELDS, source)
    layers, hidden, heads, kv_heads = f["num_layers"], f["hidden_size"], f["num_heads"], f["num_kv_heads"]
    types, window = layer_kinds(d, layers, source)
    # Fields that change the computation and that this implementation does not do: refuse.
    if d.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' != 1 is not supported")
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads ({heads}) is not a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    theta, scaling = _rope_settings(d, model_type)
    head_dim = positive_int(d.get("head_dim") or hidden // heads, "head_dim", source)
    scaling, mrope = _mrope_section(scaling, d.get("rope_parameters") or {}, head_dim, source)
    extra: dict[str, Any] = {"mrope_section": mrope} if mrope else {}
    if mrope and _mrope_interleaved(d):
        extra["mrope_interleaved"] = True
    if "sliding_attention" in types:
        extra.update(layer_types=tuple(types), sliding_window=window)
    if model_type == "ministral3":
        extra.update(_query_temperature(d.get("rope_parameters") or {}, source))
    if model_type == "smollm3":
        extra["no_rope_layers"] = _nope_layers(d, layers, source)
    if model_type == "granite":
        extra.update(read_fields(d, _GRANITE_FIELDS, source))
    if model_type == "minicpm":
        extra.update(_minicpm_scales(d, layers, hidden, source))
    if model_type == "hunyuan_v1_dense":
        if d.get("use_qk_norm") is False:  # (Hugging Face's class always normalizes q and k)
            raise ConfigError(f"{source}: field 'use_qk_norm' = false is not supported for hunyuan_v1_dense")
        theta, scaling = _ntk_alpha(theta, scaling, head_dim, source)
        extra["qk_norm_after_rope"] = True
    qkv_bias, o_bias = _attention_biases(d, model_type)
    if model_type == "ernie4_5":  # one switch for every projection's bias
        f["mlp_bias"] = bool(d.get("use_bias", False))
    if model_type in INTERLEAVED_ROPE:
        f["rope_traditional"] = True
    bos, eos_ids = token_ids(d)
    return LlamaConfig(
        model_type=model_type, **f, head_dim=head_dim,
        rope_theta=theta, rope_scaling=check_rope_scaling(scaling, source),
        qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=model_type in ("qwen3", "hunyuan_v1_dense"), bos_token_id=bos, eos_token_ids=eos_ids, **extra,
    )


def _ntk_alpha(theta: float, scaling: dict[str, Any] | None, head_dim: int, source: str
               ) -> tuple[float, dict[str, Any] | None]:
    """Hunyuan's RoPE as Hugging Face's HunYuanDenseV1 runs it: a "dynamic" scaling with an
    `alpha` is a fixed NTK stretch of the base, rope_theta * alpha^(d / (d - 2)), and no other
    scaling (its "ntk_alpha")."""
    if scaling and rope_type_of(scaling) == "dynamic" and scaling.get("alpha"):
        alpha = scaling["alpha"]
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
            raise ConfigError(f"{source}: rope_scaling.alpha must be a positive number, got {alpha!r}")
        return theta * float(alpha) ** (head_dim / (head_dim - 2)), None
    return theta, scaling


_MINICPM_FIELDS = (Field("scale_emb", POSITIVE_FLOAT), Field("scale_depth", POSITIVE_FLOAT),
                   Field("dim_model_base", POSITIVE_FLOAT))


def _minicpm_scales(d: dict[str, Any], layers: int, hidden: int, source: str) -> dict[str, float]:
    """MiniCPM's muP scales as granite's multipliers (its remote code and llama.cpp's
    minicpm): the embeddings times scale_emb, each residual branch times scale_depth /
    sqrt(layers), the final hidden state divided by hidden_size / dim_model_base before the
    head, tied or not (mlx-lm's minicpm.py leaves that out of a tied head). MiniCPM 4's
    LongRoPE (a factor list per context length) is refused: this family would apply the
    long factors at every length."""
    if rope_type_of(d.get("rope_scaling")) == "longrope":
        raise ConfigError(f"{source}: rope_scaling 'longrope' is not supported for minicpm")
    f = read_fields(d, _MINICPM_FIELDS, source)
    return {"embedding_multiplier": f["scale_emb"], "residual_multiplier": f["scale_depth"] / layers**0.5,
            "logits_scaling": hidden / f["dim_model_base"]}


#: llama.cpp architectures of Llama-shaped model types written under their own names (its
#: converter permutes nothing for them; ERNIE 4.5 rotates interleaved pairs, llama.cpp's
#: LLAMA_ROPE_TYPE_NORM, the others half-split ones)
OWN_GGUF_ARCHS = ("ernie4_5", "exaone", "seed_oss")

#: model types whose Hugging Face attention rotates interleaved pairs (its rotate_half takes
#: x[..., 0::2] and x[..., 1::2]): mlx-lm's traditional RoPE, whatever the config says
INTERLEAVED_ROPE = ("ernie4_5", "helium")


def _attention_biases(d: dict[str, Any], model_type: str) -> tuple[bool, bool]:
    """(q/k/v biases, o_proj bias) as each model class reads its config: Llama's (and
    InternLM3's, EXAONE 3's: Hugging Face runs them as Llama) attention_bias puts both;
    Qwen2's and MiMo's q/k/v always have one, o_proj never; ERNIE 4.5's use_bias is every
    projection's; Helium's attention_bias is q/k/v's alone; Seed-OSS's o_proj has its own
    switch, attention_out_bias."""
    bias = bool(d.get("attention_bias", False))
    if model_type in ("qwen2", "mimo"):
        return True, False
    if model_type == "ernie4_5":
        return bool(d.get("use_bias", False)), bool(d.get("use_bias", False))
    if model_type == "helium":
        return bias, False
    if model_type == "seed_oss":
        return bias, bool(d.get("attention_out_bias", False))
    return bias, bias


def _rope_settings(d: dict[str, Any], model_type: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) wherever the config keeps them: transformers >= 5 nests
    them under rope_parameters (its rope_type "default": no scaling); qwen2's base is 1e6
    when unsaid, everyone else's 1e4 (MiMo's too: Hugging Face's MiMoConfig and mlx-lm)."""
    rope_params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", rope_params.get("rope_theta"))
    if theta is None:
        theta = 1_000_000.0 if model_type == "qwen2" else 10_000.0
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    return float(theta), scaling


def _mrope_section(scaling: dict[str, Any] | None, rope_params: dict[str, Any], head_dim: int,
                   source: str) -> tuple[dict[str, Any] | None, tuple[int, ...]]:
    """(rope_scaling without its M-RoPE keys, mrope_section) of a Qwen2(.5)-VL text config:
    its rope_scaling {"type": "mrope" (older) or "default", "mrope_section": [t, h, w]} is
    no scaling at all, only the sections (which must cover the head_dim / 2 frequencies)."""
    section = (scaling or {}).get("mrope_section", rope_params.get("mrope_section"))
    if section is None:
        return scaling, ()
    if (not isinstance(section, (list, tuple)) or len(section) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in section)
            or sum(section) != head_dim // 2):
        raise ConfigError(f"{source}: rope_scaling.mrope_section must be 3 integers >= 0 summing to head_dim / 2 "
                          f"({head_dim // 2}), got {section!r}")
    kind = rope_type_of(scaling)
    if kind not in ("default", "mrope"):
        raise ConfigError(f"{source}: rope_scaling type {kind!r} with mrope_section is not supported (M-RoPE "
                          "takes no scaling)")
    return None, tuple(section)


def _mrope_interleaved(d: dict[str, Any]) -> bool:
    """Whether a text config's M-RoPE is interleaved: Qwen3-VL's always is (its wrapper
    sets `mrope_interleaved`; checkpoints also write it in rope_scaling / rope_parameters)."""
    return bool(d.get("mrope_interleaved") or (d.get("rope_scaling") or {}).get("mrope_interleaved")
                or (d.get("rope_parameters") or {}).get("mrope_interleaved"))


def _query_temperature(rope_params: dict[str, Any], source: str) -> dict[str, Any]:
    """ministral3's Llama-4 query temperature over long positions (its two rope_parameters)."""
    beta = rope_params.get("llama_4_scaling_beta")
    orig = rope_params.get("original_max_position_embeddings")
    if not isinstance(beta, (int, float)) or not isinstance(orig, int) or orig <= 0:
        raise ConfigError(f"{source}: rope_parameters must give llama_4_scaling_beta and "
                          "original_max_position_embeddings for ministral3")
    return {"attn_temp_beta": float(beta), "attn_temp_max_pos": orig}


def _nope_layers(d: dict[str, Any], layers: int, source: str) -> tuple[int, ...]:
    """smollm3's layers without RoPE: mlx-lm's no_rope_layers[i] == 0, or every
    no_rope_layer_interval-th layer when the list is not given."""
    flags = d.get("no_rope_layers")
    if flags is None:
        every = positive_int(d.get("no_rope_layer_interval") or 4, "no_rope_layer_interval", source)
        flags = [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ConfigError(f"{source}: field 'no_rope_layers' must list {layers} flags of 0 or 1")
    return tuple(i for i, f in enumerate(flags) if not f)


def layer_kinds(d: dict[str, Any], layers: int, source: str) -> tuple[list[str], int]:
    """Each layer's attention kind and the window, as Hugging Face's configuration and model
    classes (transformers 5.25) decide them for `d["model_type"]`. mlx-lm follows only
    `layer_types` (it runs Mistral's and Qwen's windows as full attention: the same output
    while a sequence fits its window):
    - mistral, mixtral, ministral: `sliding_window` on every layer (a mistral config with
      layer_types is read by AutoConfig as Ministral's, which runs the list);
    - qwen2 / qwen3 / mimo (Qwen2's): `use_sliding_window`, then the layers from
      `max_window_layers` (28) on, unless `layer_types` says; a layer listed as sliding
      without use_sliding_window has no window (Qwen2Config sets sliding_window None);
    - qwen2_moe: its class's own default: the even layers below max_window_layers;
    - qwen3_moe: every layer when use_sliding_window (Qwen3MoeConfig has no layer kinds);
    - smollm3: only the NoPE layers (no_rope_layers) slide, and only with use_sliding_window;
    - others: `layer_types` when given, else full attention."""
    mt, types, window = d["model_type"], d.get("layer_types"), d.get("sliding_window")
    max_pos = d.get("max_position_embeddings") or 0
    use = bool(d.get("use_sliding_window")) and window is not None
    full = ["full_attention"] * layers
    if mt == "mixtral" or (mt in ("mistral", "ministral") and types is None):
        types = ["sliding_attention"] * layers if window else full
    elif mt == "qwen3_moe":
        types = ["sliding_attention"] * layers if use else full
    elif mt in ("qwen2", "qwen3", "mimo", "qwen2_moe", "smollm3") and types is None:
        first = d.get("max_window_layers")
        first = 28 if first is None else int(first)
        if mt == "smollm3":
            nope = set(_nope_layers(d, layers, source))
            types = ["sliding_attention" if use and i in nope else "full_attention" for i in range(layers)]
        elif mt == "qwen2_moe":
            types = ["sliding_attention" if use and i % 2 == 0 and i < first else "full_attention"
                     for i in range(layers)]
        else:
            types = ["sliding_attention" if use and i >= first else "full_attention" for i in range(layers)]
    elif types is None:
        types = full
    if (not isinstance(types, list) or len(types) != layers
            or any(t not in ("full_attention", "sliding_attention") for t in types)):
        raise ConfigError(f"{source}: layer_types must list {layers} entries of 'full_attention' "
                          "or 'sliding_attention'")
    if mt in ("qwen2", "qwen3", "mimo", "qwen2_moe", "smollm3") and not use:
        types = full  # (listed as sliding, but the class leaves such layers without a window)
    if window and max_pos and window >= max_pos:
        types = full  # (a window as long as the context: the same attention, kept dense)
    if "sliding_attention" in types:
        return types, positive_int(window, "sliding_window", source)
    return types, 0


def config_from_gguf(md: dict[str, Any], source: str, attention: str | None = None,
                     ff_default: Any = ...) -> LlamaConfig:
    """A LlamaConfig from GGUF metadata. attention: the model_type whose attention another
    architecture has (the MoE family's qwen3moe is qwen3's); ff_default: the dense MLP width
    when the metadata has none (MoE files whose layers are all experts)."""
    arch = md.get("general.architecture")
    if arch == "mistral3":
        return _ministral3_from_gguf(md, source)
    attention = attention or {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "granite": "llama",
                              "smollm3": "llama", "minicpm": "llama", "qwen2vl": "qwen2",
                              "qwen3vl": "qwen3"}.get(arch, arch)
    extra: dict[str, Any] = {}
    if arch in ("granite", "minicpm"):  # llama.cpp's keys for the multipliers (MiniCPM's: all but attention's)
        extra = {f: float(gguf_value(md, arch, key, source)) for f, key in (
            ("embedding_multiplier", "embedding_scale"), ("attention_multiplier", "attention.scale"),
            ("residual_multiplier", "residual_scale"), ("logits_scaling", "logit_scale"))
            if arch == "granite" or f != "attention_multiplier"}
    if arch == "smollm3":  # llama.cpp runs every 4th layer without RoPE (its fixed step)
        extra = {"no_rope_layers": tuple(i for i in range(int(gguf_value(md, arch, "block_count", source)))
                                         if (i + 1) % 4 == 0)}

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, arch, key, source, default)

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
    if arch in ("qwen2vl", "qwen3vl", "qwen3vlmoe"):  # Qwen-VL text models: M-RoPE (Qwen3-VL's interleaved)
        extra = _mrope_from_gguf(md, arch, head_dim, source)
    if arch in OWN_GGUF_ARCHS:  # (their biases: as the file's tensors say, `assemble_gguf`)
        extra["rope_traditional"] = arch in INTERLEAVED_ROPE
    return LlamaConfig(
        model_type=arch if arch in ("granite", "smollm3", "minicpm") else attention,
        **extra,
        vocab_size=int(vocab),
        hidden_size=hidden,
        num_layers=int(val("block_count")),
        num_heads=heads,
        num_kv_heads=int(val("attention.head_count_kv", heads)),
        head_dim=head_dim,
        intermediate_size=int(val("feed_forward_length", ff_default)),
        rms_norm_eps=float(val("attention.layer_norm_rms_epsilon")),
        rope_theta=float(val("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(val("context_length", 4096)),
        tie_word_embeddings=None,  # decided by the checkpoint: output.weight present or not
        qkv_bias=attention == "qwen2",
        qk_norm=attention == "qwen3",
        bos_token_id=int(bos.item()) if bos is not None else None,
        eos_token_ids=(int(eos.item()),) if eos is not None else (),
    )


def _mrope_from_gguf(md: dict[str, Any], arch: str, head_dim: int, source: str) -> dict[str, Any]:
    """The M-RoPE fields of llama.cpp's qwen2vl / qwen3vl / qwen3vlmoe text files: its converters write
    the text config's mrope_section [t, h, w] padded with zeros to 4 entries as
    rope.dimension_sections (a non-zero fourth section is another model's layout: refused);
    qwen3vl's and qwen3vlmoe's rotation is interleaved (llama.cpp's IMROPE, Qwen3-VL's own),
    which the architecture alone says."""
    key = f"{arch}.rope.dimension_sections"
    raw = md.get(key)
    if raw is None:
        raise ConfigError(f"{source}: {key} is missing (the M-RoPE sections of a {arch} text model)")
    sections = [int(x) for x in (raw.tolist() if hasattr(raw, "tolist") else raw)]
    if len(sections) not in (3, 4) or sum(sections[3:]) != 0:
        raise ConfigError(f"{source}: {key} must be 3 sections [t, h, w] (padded with a zero to 4), got {sections}")
    _, mrope = _mrope_section({"type": "default", "mrope_section": sections[:3]}, {}, head_dim, f"{source}: {key}")
    return {"mrope_section": mrope, **({"mrope_interleaved": True} if arch in ("qwen3vl", "qwen3vlmoe") else {})}


def _ministral3_from_gguf(md: dict[str, Any], source: str) -> LlamaConfig:
    """Ministral 3 / Mistral Small 3.x text models as llama.cpp's Ministral3Model converter
    writes them (architecture mistral3): the Hugging Face rope_parameters rebuilt from its
    keys (YaRN's factor and original context; rope.scaling.yarn_log_multiplier is
    mscale_all_dim, written as is, with mscale 1 as llama.cpp assumes;
    attention.temperature_scale is llama_4_scaling_beta, whose position floor llama.cpp
    takes from the original context), then the Hugging Face path."""
    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, "mistral3", key, source, default)

    d = gguf_hf_config(md, "mistral3", source, "ministral3", rope_theta=1_000_000.0)
    kind = val("rope.scaling.type", None)
    orig = int(val("rope.scaling.original_context_length", d["max_position_embeddings"]))
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": d.pop("rope_theta")}
    if kind not in (None, "none"):
        if kind != "yarn":
            raise ConfigError(f"{source}: mistral3.rope.scaling.type {kind!r} is not supported (yarn)")
        rope.update(rope_type="yarn", factor=float(val("rope.scaling.factor")),
                    beta_fast=float(val("rope.scaling.yarn_beta_fast", 32.0)),
                    beta_slow=float(val("rope.scaling.yarn_beta_slow", 1.0)), mscale=1.0,
                    mscale_all_dim=float(val("rope.scaling.yarn_log_multiplier", 0.0)))
    rope.update(original_max_position_embeddings=orig,
                llama_4_scaling_beta=float(val("attention.temperature_scale", 0.0)))
    return config_from_hf({**d, "rope_parameters": rope}, source)


@attrs.frozen
class LayerParams:
    attn_norm: mx.array
    qkv: Linear  # fused [q; k; v] rows
    o: Linear
    mlp_norm: mx.array
    gate_up: Linear  # fused [gate; up] rows
    down: Linear
    q_norm: mx.array | None = None
    k_norm: mx.array | None = None


@attrs.frozen
class Params:
    __fx_memo_flatten__ = True  # immutable and flattened every step: memoize (fx_engine.core.tree)
    embed: Linear
    layers: tuple[LayerParams, ...]
    norm: mx.array
    lm_head: Linear | None  # None: tied to the embedding
    rope_freqs: mx.array | None  # precomputed for llama3 scaling, else None
    config: LlamaConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")  # activation/cache dtype name
    # pipeline parallelism (core/parallel.py): the stage these params hold; None the whole model
    pipeline: PipelineStage | None = static_field(default=None)


def cache_specs(cfg: LlamaConfig) -> tuple[LayerSpec, ...]:
    """One cache entry per layer: full attention, or a window (a ring) for sliding layers."""
    if not cfg.layer_types:
        return dense_layout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    return tuple(LayerSpec(cfg.num_kv_heads, cfg.head_dim,
                           window=cfg.sliding_window if t == "sliding_attention" else None)
                 for t in cfg.layer_types)


def forward(
    p: Any, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None, rope_fn: Any = None, layer_fn: Any = None, final_norm: Any = None,
    images: Any = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """The Llama decoder's step (`skeleton.decoder_step`'s contract): per layer attention
    then a SwiGLU MLP, each a pre-norm residual branch.

    Families that share this decoder pass their own rope_fn(params, positions [B, T]) ->
    (cos, sin, perm) tables over the rotated dims (fewer than head_dim: partial rotary),
    layer_fn(params, layer params, h, entry, spec, rope, geo) -> (h, entry) (mixture-of-
    experts MLPs) and final_norm(h) (LayerNorm families).

    images: a `vision.splice.ImageInput` (Idefics3 / SmolVLM's and Qwen2(.5)-VL's text
    models: the step's image rows replace the embeddings at the image token positions;
    attention stays causal, its `bidirectional` is not read; with `positions`, Qwen2(.5)-VL's
    M-RoPE over the 3-D position ids instead of RoPE; with `deepstack` (Qwen3-VL), feature
    i added at the image tokens after layer i); None: text only, the graph unchanged. A
    ValueError naming the field where a Qwen-VL model's images lack `positions` (any config
    with mrope_section) or Qwen3-VL's lack `deepstack` (`_check_vl_images`).
    """
    if images is not None:
        _check_vl_images(p.config, images)
    embedded = _embedded if images is None else _spliced(p, tokens, images)
    if images is not None and images.positions is not None:  # Qwen2(.5)-VL: M-RoPE over 3-D ids
        rope_fn = _mrope(p, images)
    deep = None if images is None or images.deepstack is None else deepstack_adder(tokens, images)
    first = p.pipeline.first_layer if getattr(p, "pipeline", None) is not None else 0  # (DeepStack: global layers)

    def layers(h: mx.array, geo: StepGeometry) -> tuple[mx.array, list[Any]]:
        rope = (rope_fn or scaled_rope)(p, geo.positions)  # shared by every layer
        nope = p.config.no_rope_layers
        entries = []
        for i, (lp, entry, spec) in enumerate(zip(p.layers, cache.layers, cache.layout)):
            geo.layer_input(h)  # the stream entering this layer (skeleton.Capture)
            h, entry = (layer_fn or decoder_layer)(p, lp, h, entry, spec, None if i in nope else rope, geo)
            if deep is not None and first + i < deep.layers:  # Qwen3-VL's DeepStack features at the image tokens
                h = deep(first + i, h)
            entries.append(entry)
        return h, entries

    return decoder_step(p, cache, tokens, n_valid, span, layers, embedded=embedded,
                        final_norm=(lambda _, h: final_norm(h)) if final_norm else final_rms_norm)


def _check_vl_images(cfg: Any, images: Any) -> None:
    """Refuse a step's images that the model would read wrong without a word: a Qwen-VL text
    model (rope_scaling.mrope_section) places its image tokens at M-RoPE positions, so its
    image steps carry them (`ImageInput.positions`; without them plain RoPE would run); and
    Qwen3-VL's (its text config's M-RoPE interleaved: that layout is Qwen3-VL's, the
    wrapper sets it) adds DeepStack features at the image tokens (`ImageInput.deepstack`,
    [0, M, H] where its tower has none)."""
    if getattr(cfg, "mrope_section", ()) and images.positions is None:
        raise ValueError(f"images.positions: this {cfg.model_type} text model uses M-RoPE (rope_scaling."
                         "mrope_section): its image steps need the prompt's 3-D position offsets "
                         "(ImageInput.positions / position_start, from vision.qwen2_vl.rope_offsets)")
    if getattr(cfg, "mrope_interleaved", False) and images.deepstack is None:
        raise ValueError("images.deepstack: this Qwen3-VL text model (interleaved M-RoPE) adds DeepStack "
                         "features at the image tokens: its image steps need them (ImageInput.deepstack, "
                         "the second result of vision.qwen3_vl.encode_images)")


def _mrope(p: Any, images: Any) -> Any:
    """The rope_fn of a step with M-RoPE offsets (`ImageInput.positions`): tables over the
    step's 3-D ids (its cache positions plus the offsets) instead of plain RoPE's."""
    if not p.config.mrope_section:
        raise ValueError(f"images: 3-D (M-RoPE) positions given to a {p.config.model_type} model without "
                         "rope_scaling.mrope_section")

    def rope(p: Any, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        return mrope_tables(p, step_positions(images, positions))

    return rope


def _spliced(p: Any, tokens: mx.array, images: Any) -> Any:
    """`_embedded` with a step's image rows spliced in at the image token positions (on a
    pipeline, the first stage's: the later ones receive its stream, never embed)."""
    b, t = tokens.shape
    images = check_image_input(images, b, p.config.hidden_size)

    def embedded(p: Any, tokens: mx.array) -> mx.array:
        e = _embedded(p, tokens).reshape(b, t, -1)
        return splice_images(e, tokens, images.rows, images.token_index, images.start).reshape(b * t, -1)

    return embedded


def _embedded(p: Any, tokens: mx.array) -> mx.array:
    """The embeddings, times granite's embedding_multiplier."""
    x = embedded_tokens(p, tokens)
    m = p.config.embedding_multiplier
    return x if m == 1.0 else x * m


def hidden_to_logits(p: Any, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N V"]:
    def logits() -> mx.array:
        head = p.lm_head if p.lm_head is not None else p.embed
        out = linear(h, head, p.numerics)
        scale = p.config.logits_scaling
        return (out if scale == 1.0 else out / scale).astype(mx.float32)

    return stage_logits(p, h, logits)  # (a pipeline stage: the last stage's logits)


# ------------------------------------------------------------------ checkpoints


# Each layer's params from its tensors under model.layers.{i}. (Hugging Face / mlx-community
# names; `read_tensors`): q|k|v and gate|up each read apart and fused into one matrix.
# Sizes not in the config: `attention_sizes`.
ATTENTION = (
    Vec("attn_norm", "input_layernorm.weight", "hidden_size"),
    Fused("qkv", QKV, "hidden_size", bias="qkv_bias"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width", bias="o_bias"),
    Vec("q_norm", "self_attn.q_norm.weight", "q_norm_width", when="qk_norm"),  # qwen3
    Vec("k_norm", "self_attn.k_norm.weight", "k_norm_width", when="qk_norm"),
)
MLP = (
    Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"),
    Fused("gate_up", GATE_UP, "hidden_size", bias="mlp_bias"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size", bias="mlp_bias"),
)
# the whole model's (the output head only where untied)
TOP = (
    Embedding("embed", "model.embed_tokens", lookup_only="untied"),
    Vec("norm", "model.norm.weight", "hidden_size"),
    Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied"),
)
# llama.cpp's names for the same tensors, read as they are (errors name the file's tensors)
GGUF_NAMES = {
    HF_LAYER: "blk.{i}.", "model.embed_tokens": "token_embd", "model.norm.weight": "output_norm.weight",
    "lm_head": "output", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# EXAONE 3's own names (its remote code's, which mlx-lm keeps) -> Llama's: Hugging Face's
# WeightRenaming rules for model_type exaone (transformers 5's conversion_mapping.py), which
# runs it as LlamaForCausalLM
EXAONE_TO_HF = (
    (r"^transformer\.wte\.", "model.embed_tokens."), (r"^transformer\.h\.", "model.layers."),
    (r"^transformer\.ln_f\.", "model.norm."), (r"\.attn\.attention\.", ".self_attn."),
    (r"\.self_attn\.out_proj\.", ".self_attn.o_proj."), (r"\.ln_1\.", ".input_layernorm."),
    (r"\.ln_2\.", ".post_attention_layernorm."), (r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
    (r"\.mlp\.c_fc_1\.", ".mlp.up_proj."), (r"\.mlp\.c_proj\.", ".mlp.down_proj."),
)
# the other way, for the test checkpoints (`checkpoint_layout`)
_HF_TO_EXAONE = (
    (r"^model\.embed_tokens\.", "transformer.wte."), (r"^model\.layers\.", "transformer.h."),
    (r"^model\.norm\.", "transformer.ln_f."), (r"\.self_attn\.o_proj\.", ".attn.attention.out_proj."),
    (r"\.self_attn\.", ".attn.attention."), (r"\.input_layernorm\.", ".ln_1."),
    (r"\.post_attention_layernorm\.", ".ln_2."), (r"\.mlp\.gate_proj\.", ".mlp.c_fc_0."),
    (r"\.mlp\.up_proj\.", ".mlp.c_fc_1."), (r"\.mlp\.down_proj\.", ".mlp.c_proj."),
)


# Hunyuan's q/k norms' names
_HUNYUAN_TO_HF = ((r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
                  (r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."))
_OWN_NAMES = {"exaone": EXAONE_TO_HF, "hunyuan_v1_dense": _HUNYUAN_TO_HF}


def assemble(cfg: LlamaConfig, src: TensorSource, opts: LoadOptions) -> Params:
    """Params from Hugging Face / mlx-community tensor names (EXAONE 3's and Hunyuan's own
    renamed)."""
    rules = _OWN_NAMES.get(cfg.model_type)
    return _assemble(cfg, renamed(src, rules) if rules else src, opts)


def assemble_gguf(cfg: LlamaConfig, src: TensorSource, opts: LoadOptions) -> Params:
    """Params from llama.cpp's tensor names, undoing what its converter did: llama's q/k
    rows were permuted for interleaved RoPE, and Llama-3 rope scaling is stored as
    per-frequency factors (rope_freqs.weight)."""
    if src.has("rope_factors_long.weight"):  # (MiniCPM 4's LongRoPE: see _minicpm_scales)
        raise WeightsError(f"{opts.where}: LongRoPE factors (rope_factors_long) are not supported for "
                           f"{cfg.model_type}")
    fixed = (unpermuted_qk(cfg, src) if cfg.model_type in ("llama", "granite", "smollm3", "ministral3", "minicpm")
             else src)
    if cfg.model_type in OWN_GGUF_ARCHS:  # each projection's bias where the converter wrote one
        cfg = attrs.evolve(cfg, qkv_bias=src.has("blk.0.attn_q.bias"), o_bias=src.has("blk.0.attn_output.bias"),
                           mlp_bias=src.has("blk.0.ffn_up.bias"))
    if cfg.model_type == "seed_oss":  # (llama.cpp names its pre-MLP norm attn_post_norm)
        fixed = renamed(fixed, ((r"\.post_attention_norm\.", ".ffn_norm."),))
    params = _assemble(cfg, fixed, opts, GGUF_NAMES)
    if fixed.has("rope_freqs.weight"):
        # the rotation period of pair i is base^(2i/d) * factor_i
        factors = fixed.get("rope_freqs.weight", (cfg.head_dim // 2,), opts.where).astype(mx.float32)
        periods = cfg.rope_theta ** (mx.arange(0, cfg.head_dim, 2) / cfg.head_dim) * factors
        params = attrs.evolve(params, rope_freqs=periods)
    return params


def unpermuted_qk(cfg: Any, src: TensorSource) -> TensorSource:
    """The tensors with llama.cpp's q/k row permutation undone (files its LlamaModel
    converter wrote: llama, mistral, mixtral, granite, smollm3)."""
    out = TensorSource()
    for name, t in src.tensors.items():
        out.tensors[name], out.origin[name] = t, src.origin[name]
    for i in range(cfg.num_layers):
        for part, heads in (("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads)):
            for suffix in (".weight", ".scales", ".biases", ".bias"):
                name = f"blk.{i}.{part}{suffix}"
                if name in out.tensors:
                    out.tensors[name] = unpermute_rows(out.tensors[name], heads)
    return out


def with_tied(cfg: Any, src: TensorSource, rename: dict[str, str] | None = None) -> Any:
    """`cfg` with tie_word_embeddings decided where the config leaves it to the checkpoint
    (None): tied unless the checkpoint has its own output head."""
    if cfg.tie_word_embeddings is not None:
        return cfg
    head = rename["lm_head"] if rename else "lm_head"
    return attrs.evolve(cfg, tie_word_embeddings=not src.has(head + ".weight"))


def _assemble(cfg: LlamaConfig, src: TensorSource, opts: LoadOptions, rename: dict[str, str] | None = None) -> Params:
    rd, cfg = Reader(src, opts), with_tied(cfg, src, rename)
    sizes = attention_sizes(cfg)
    layers = tuple(LayerParams(**read_tensors(rd, ATTENTION + MLP, cfg, HF_LAYER, i, sizes, rename))
                   for i in range(cfg.num_layers))
    return Params(layers=layers, **read_tensors(rd, TOP, cfg, sizes=sizes, rename=rename), rope_freqs=rope_freqs(cfg),
                  config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


def unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> half-split RoPE).

    The converter maps HF rows with reshape(n_head, 2, hd/2).swapaxes(1, 2); we invert it.
    Whole rows move, so quantized rows (and their scales/biases) stay exact.
    """
    rows = x.shape[0]
    rest = x.shape[1:]
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def checkpoint_layout(cfg: LlamaConfig, fused: bool = False) -> dict[str, TensorSpec]:
    """The Hugging Face checkpoint's tensors (norms near 1). fused: the projections stored
    fused, as Phi-3 does (self_attn.qkv_proj, mlp.gate_up_proj)."""
    h, hd, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    hq, hk, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size
    qkv_bias, o_bias, mlp_bias, qk_norm = cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm
    out = {"model.embed_tokens.weight": TensorSpec((v, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        if fused:
            out[a + "qkv_proj.weight"] = TensorSpec((hq + 2 * hk, h))
        else:
            out.update({a + "q_proj.weight": TensorSpec((hq, h)), a + "k_proj.weight": TensorSpec((hk, h)),
                        a + "v_proj.weight": TensorSpec((hk, h))})
        out[a + "o_proj.weight"] = TensorSpec((h, hq))
        if qkv_bias:
            out.update({a + "q_proj.bias": TensorSpec((hq,)), a + "k_proj.bias": TensorSpec((hk,)),
                        a + "v_proj.bias": TensorSpec((hk,))})
        if o_bias:
            out[a + "o_proj.bias"] = TensorSpec((h,))
        if qk_norm:
            out[a + "q_norm.weight"] = TensorSpec((hd,), center=1.0)
            out[a + "k_norm.weight"] = TensorSpec((hd,), center=1.0)
        if fused:
            out[m + "gate_up_proj.weight"] = TensorSpec((2 * ff, h))
        else:
            out.update({m + "gate_proj.weight": TensorSpec((ff, h)), m + "up_proj.weight": TensorSpec((ff, h))})
        out[m + "down_proj.weight"] = TensorSpec((h, ff))
        if mlp_bias:
            out.update({m + "gate_proj.bias": TensorSpec((ff,)), m + "up_proj.bias": TensorSpec((ff,)),
                        m + "down_proj.bias": TensorSpec((h,))})
        out[p + "input_layernorm.weight"] = TensorSpec((h,), center=1.0)
        out[p + "post_attention_layernorm.weight"] = TensorSpec((h,), center=1.0)
    out["model.norm.weight"] = TensorSpec((h,), center=1.0)
    if cfg.tie_word_embeddings is False:
        out["lm_head.weight"] = TensorSpec((v, h), scale=0.2)
    if cfg.model_type == "exaone":  # published under EXAONE's own names
        return {renamed_name(name, _HF_TO_EXAONE): spec for name, spec in out.items()}
    if cfg.model_type == "hunyuan_v1_dense":
        return {name.replace(".q_norm.", ".query_layernorm.").replace(".k_norm.", ".key_layernorm."): spec
                for name, spec in out.items()}
    return out


def layer_range(p: Params, start: int, end: int) -> Params:
    """The params of layers [start, end) (`family.cut_layers`) of the families that run this
    decoder (their per-layer fields: layer kinds, routed layers, post-norm RoPE kinds, NoPE
    layer numbers)."""
    return cut_layers(p, start, end, per_layer=("layer_types", "moe_layers", "layer_rope"),
                      indices=("no_rope_layers",))


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json of a tiny random test model (fx_engine.testing.tiny)."""
    cfg = {"model_type": model_type, **_TINY, **overrides}
    if model_type == "mimo":  # (the trunk alone: MiMo's MTP modules are fx_engine.testing.mtp's)
        cfg["architectures"] = ["MiMoForCausalLM"]
    if model_type == "qwen3":  # Qwen3 configs always state head_dim
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if model_type == "smollm3":  # every 4th layer without RoPE (SmolLM3-3B's interval)
        cfg.setdefault("no_rope_layer_interval", 4)
        cfg["num_hidden_layers"] = overrides.get("num_hidden_layers", 4)
    if model_type == "ministral3":  # transformers-5 style rope_parameters with YaRN
        cfg.pop("rope_theta", None)
        cfg.setdefault("rope_parameters", {
            "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 24, "llama_4_scaling_beta": 0.1})
        cfg.setdefault("head_dim", 16)
    if model_type in _TINY_OWN:
        cfg.update(_TINY_OWN[model_type])
        cfg.update(overrides)
    if model_type == "exaone":  # EXAONE 3's config.json names (its class's attribute_map)
        for hf, own in (("num_hidden_layers", "num_layers"), ("rms_norm_eps", "layer_norm_epsilon")):
            cfg[own] = cfg.pop(hf)
        cfg["activation_function"] = "silu"
    if model_type == "granite":  # Granite 3's constants, scaled to the tiny width
        for k, v in (("embedding_multiplier", 12.0), ("attention_multiplier", 0.0625),
                     ("residual_multiplier", 0.22), ("logits_scaling", 8.0),
                     ("attention_bias", False), ("mlp_bias", False)):
            cfg.setdefault(k, v)
    return cfg


# names other modules and tests imported before the blocks moved out (core/models/blocks.py)
_rope, _apply_rope, _layer = scaled_rope, apply_partial_rope, decoder_layer
__all__ = ["ATTENTION", "FAMILY", "GGUF_NAMES", "LayerParams", "LlamaConfig", "MLP", "Params", "TOP", "assemble",
           "assemble_gguf", "checkpoint_layout", "config_from_gguf", "config_from_hf", "decoder_layer", "forward",
           "hidden_to_logits", "layer_range", "rope_freqs", "rope_mscale", "self_attention", "unpermute_rows",
           "unpermuted_qk", "with_tied"]

_TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-5, "vocab_size": 384, "rope_theta": 10000.0,
         "max_position_embeddings": 2048, "tie_word_embeddings": True, "bos_token_id": 1,
         "eos_token_id": 2}

# each model type's own fields in its tiny test config (as its published configs state them)
_TINY_OWN = {
    "ernie4_5": {"architectures": ["Ernie4_5ForCausalLM"], "use_bias": False, "head_dim": 32},  # (0.3B: 2 x the width)
    "helium": {"architectures": ["HeliumForCausalLM"], "attention_bias": False, "mlp_bias": False, "head_dim": 16,
               "rms_norm_eps": 1e-8, "tie_word_embeddings": False},
    "seed_oss": {"architectures": ["SeedOssForCausalLM"], "attention_bias": True, "attention_out_bias": False,
                 "mlp_bias": False, "head_dim": 16, "tie_word_embeddings": False},
    "internlm3": {"architectures": ["InternLM3ForCausalLM"], "qkv_bias": False, "bias": False, "head_dim": 16,
                  "tie_word_embeddings": False},
    "exaone": {"architectures": ["ExaoneForCausalLM"], "rope_theta": 500000.0, "tie_word_embeddings": True},
    "hunyuan_v1_dense": {"architectures": ["HunYuanDenseV1ForCausalLM"], "use_qk_norm": True, "head_dim": 16,
                         "attention_bias": False, "tie_word_embeddings": True,
                         "rope_scaling": {"type": "dynamic", "alpha": 1000.0, "factor": 1.0}},
    # (MiniCPM-2B's scales; untied: mlx-lm's tied head leaves the logit scale out)
    "minicpm": {"architectures": ["MiniCPMForCausalLM"], "scale_emb": 12, "scale_depth": 1.4, "dim_model_base": 16,
                "tie_word_embeddings": False},
}

FAMILY = Family(
    packs_rows=True,  # row-wise layers around blocks.self_attention (core/packing.py)
    name="llama", model_types=("llama", "mistral", "ministral", "qwen2", "qwen3", "smollm2", "smollm3",
                               "granite", "ministral3", "mimo", "ernie4_5", "helium", "seed_oss", "internlm3",
                               "exaone", "minicpm", "hunyuan_v1_dense"),
    wrappers={"mistral3": ("ministral3", {"vocab_size": 131072, "tie_word_embeddings": False}),
              # Idefics3 / SmolVLM(2): a Llama text model (images: core/vision/idefics3.py)
              "idefics3": ("llama", {}), "smolvlm": ("llama", {}),
              # Qwen2(.5)-VL: a Qwen2 text model with M-RoPE (images: core/vision/qwen2_vl.py)
              "qwen2_5_vl": ("qwen2", {}), "qwen2_vl": ("qwen2", {}),
              # Qwen3-VL: a Qwen3 text model with interleaved M-RoPE and DeepStack (images:
              # core/vision/qwen3_vl.py)
              "qwen3_vl": ("qwen3", {"mrope_interleaved": True})},
    config_type=LlamaConfig, params_type=Params, config_from_hf=config_from_hf,
    assemble=assemble, cache_specs=cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout,
    gguf_architectures=("llama", "qwen2", "qwen3", "granite", "smollm3", "minicpm", "mistral3", "qwen2vl", "qwen3vl",
                        *OWN_GGUF_ARCHS), config_from_gguf=config_from_gguf,
    gguf_accepts=lambda md: not md.get(f"{md.get('general.architecture')}.expert_count"),
    assemble_gguf=assemble_gguf, tensor_split=shard_decoder, layer_range=layer_range,
    tiny_config=tiny_config,
)
