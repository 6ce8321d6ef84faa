"""Multi-token-prediction (MTP) modules shipped inside target checkpoints, as drafters:
config, params from checkpoint tensors (safetensors names per family, GGUF names where
llama.cpp writes them), the pure forward over an fx-engine KV cache, greedy chained drafting.

An MTP module (DeepSeek-V3 technical report, section 2.2; its "NextN" layer) is one more
decoder layer of the target's own architecture that predicts the token after next from the
target's hidden state and the embedding of the next token. Per position t of the module's
sequence (its RoPE position, the cache slot it writes), with the pair (h_t, x_{t+1}):

    e   = embed(x_{t+1})                  (the target's table; DeepSeek-V3 ships a copy)
    e   = 0 where t == 0                  (vLLM's "masking inputs at position 0": DeepSeek,
                                           GLM-4.5, MiMo; not Qwen3-Next, nor SGLang)
    x   = proj([norm_e(e); norm_h(h_t)])  (2H -> H; MiMo concatenates [norm_h(h_t); norm_e(e)])
    out = layer(x)                        (the target family's decoder layer: attention over
                                           the module's cache, causal by position, then its MLP)
    n   = norm_out(out)
    logits = head(n)                      [vocab]: the prediction of x_{t+2}
    hidden fed to a chained step: out (DeepSeek, GLM-4.5: vLLM's forward returns the
                                  pre-norm stream) or n (Qwen3-Next, MiMo: theirs return n)

The four published formats, as vLLM (vllm/model_executor/models/deepseek_mtp.py,
glm4_moe_mtp.py, qwen3_next_mtp.py / qwen3_5_mtp.py, mimo_mtp.py) and SGLang
(python/sglang/srt/models/deepseek_nextn.py) read them:

  deepseek_v3  module k at model.layers.{N + k}.* (num_nextn_predict_layers of them): enorm
               (norm_e), hnorm (norm_h), eh_proj (proj), shared_head.norm (norm_out), and
               shared_head.head / embed_tokens, copies of the target's; a DeepSeek decoder
               layer (MLA, routed experts). Takes the target's final-norm output. GGUF
               (deepseek2: GLM-4.7-Flash, DeepSeek V3.2): blk.{N + k}.nextn.* and the
               layer's deepseek2 names; SGLang's NextN export: the layer as model.layers.0.*.
  glm4_moe     the same names (GGUF: blk.{N + k}.nextn.*); a GLM-4.5 decoder layer (moe.py's).
               Takes the target's final-norm output.
  qwen3_next   mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden, mtp.fc, mtp.norm (shared by
               the modules; RMSNorms stored as w of 1 + w) and mtp.layers.{k}.* (Qwen3.5:
               mtp_num_hidden_layers of them): a gated full-attention layer, routed or dense
               MLP. Takes the target's final-norm output.
  mimo         model.mtp_layers.{k}.{token_layernorm, hidden_layernorm, input_proj,
               final_layernorm} and a Qwen2 decoder layer there (the target itself, model_type
               "mimo", loads in the llama family as Qwen2, leaving these unread). Takes the
               stream after the target's last layer, before its final norm.

(N: the target's num_hidden_layers.) "final-norm output" is what the target's output head
reads (vLLM's DeepseekV2Model / Glm4MoeModel / Qwen3NextModel return it, and the drafter
takes the model's returned hidden states); MiMo's MiMoModel returns `hidden_states +
residual` before its norm, which MiMoForCausalLM.compute_logits applies itself.
`target_capture` names that state for `skeleton.Capture` in the target's compiled steps.

Where the references differ, this module follows vLLM and says so in the config:
`mask_first_position` (SGLang does not zero position 0's embedding) and `chain_normed`
(SGLang's NextN returns the shared head's normed state, so its chained DeepSeek steps feed
that back; vLLM feeds the pre-norm one).

K > 1 drafts chain module 0 on its own output, one position further each step: what vLLM's
v1 proposer runs (it calls the model with `spec_step_idx` 0: module 0 throughout) and,
for the published checkpoints, the only choice there is: DeepSeek-V3 / R1, GLM-4.5, the
Qwen3-Next / Qwen3.5 releases and MiMo-7B (its report: one MTP layer for speculative
decoding) all ship one module. The other modules of a checkpoint with several (a config's
num_nextn_predict_layers / mtp_num_hidden_layers > 1: tiny tests, future checkpoints) are
loaded, counted by `fx-engine info` and run by `mtp_forward(..., module=k)`, but drafts do
not chain through them. Doing so as the modules were trained (the DeepSeek-V3 report's
sequential MTP: module k at position i reads module k - 1's output at i and the embedding
of x_{i+k+1}, attending over its own K/V of every earlier position) would give each module
k > 0 its own stream to feed, lagging module k - 1's by one token: the engine's row
(engine/captured_drafter.py's `CapturedRow`) feeds one stream of target states, and a
second, lagged one per module (with its own rollback) is more than a local change there.
vLLM v0's `spec_step_idx` alternative (module j at draft step j, at position t + j, its
cache holding only the chain's own steps) is not what the modules were trained on either,
so it is not offered in its place.

The module's attention keeps its K/V in an ordinary `KVCache` (`cache_specs`: one entry per
module, the family's own kind: DeepSeek's latent entry, dense for the others); positions are
the cache's row lengths, a step writes through the family's attention, rollback is
`with_lengths`: the drafter's state rolls back with the target's by length.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

import fx_engine.core.models.deepseek as deepseek
import fx_engine.core.models.llama as llama
import fx_engine.core.models.moe as moe
import fx_engine.core.models.qwen3_next as qwen3_next
from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced
from fx_engine.core.checkpoint import (Lin, LoadOptions, Reader, TensorSource, Vec, WeightsError,
                                       read_experts, read_tensors, renamed)
from fx_engine.core.config import ConfigError, gguf_value
from fx_engine.core.models.blocks import (HF_EXPERT_NAMES, STACKED_EXPERT_NAMES, SWIGLU_MLP, DenseMlp, Experts,
                                          attention_sizes, decoder_layer, expert_stacks, mixture,
                                          config_rope, read_shared_expert, rope_freqs, scaled_rope, swiglu_mlp)
from fx_engine.core.models import hf_config
from fx_engine.core.models.registry import family_of
from fx_engine.core.models.skeleton import Capture
from fx_engine.core.nn import Linear, Numerics, embed, linear, rms_norm, scaled_rope_freqs
from fx_engine.core.tree import CompiledFunction, static_field

__all__ = ["KINDS", "MtpConfig", "MtpModule", "MtpParams", "MtpTables", "cache_specs", "check_target",
           "config_from_gguf", "config_from_hf", "describe", "draft_chain", "greedy_ids", "is_nextn_export",
           "module_prefix", "mtp_forward", "mtp_layers_in", "mtp_layers_in_gguf", "mtp_params_from_gguf", "mtp_params_from_tensors",
           "mtp_step", "mtp_step_compiled", "tables_from_tensors", "target_capture", "target_tables"]

KINDS = ("deepseek_v3", "glm4_moe", "qwen3_next", "mimo")

# config.json model_type -> the MTP format its checkpoints ship (the Qwen3.5 wrappers'
# text models read through `_text_config`)
_KIND = {"deepseek_v3": "deepseek_v3", "kimi_k2": "deepseek_v3", "glm4_moe": "glm4_moe",
         "qwen3_next": "qwen3_next", "qwen3_5_text": "qwen3_next", "qwen3_5_moe_text": "qwen3_next",
         "mimo": "mimo"}
_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
# the target family each format's modules belong to (the registry's names; MiMo's layers are
# Qwen2's, the llama family's)
_FAMILY = {"deepseek_v3": "deepseek", "glm4_moe": "moe", "qwen3_next": "qwen3_next", "mimo": "llama"}
_NAMES = {"deepseek_v3": "DeepSeek-V3", "glm4_moe": "GLM-4.5", "qwen3_next": "Qwen3-Next / Qwen3.5",
          "mimo": "MiMo"}


# ---------------------------------------------------------------- config


@attrs.frozen
class MtpConfig:
    """A checkpoint's MTP modules. `layer`: the target family's config of the modules'
    decoder layers (the deepseek, moe (GLM-4.5), qwen3_next or llama (Qwen2) family's), its
    num_layers the number of modules and its per-layer fields (routed or dense MLP) the
    modules'; every other field is the target's (the modules are layers of the target's
    architecture). `first_layer`: where module 0 sits among the checkpoint's layers
    (`module_prefix`). `mask_first_position` / `chain_normed`: see the module docstring."""

    kind: str
    num_modules: int
    layer: Any
    first_layer: int
    mask_first_position: bool
    chain_normed: bool

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.layer.vocab_size

    @property
    def rms_norm_eps(self) -> float:
        return self.layer.rms_norm_eps

    @property
    def hidden_first(self) -> bool:
        """MiMo's concatenation order: [norm_h(h); norm_e(e)] (the others: embeddings first)."""
        return self.kind == "mimo"

    @property
    def target_normed(self) -> bool:
        """Whether the module takes the target's final-norm output (else the stream after
        its last layer, before the final norm: MiMo)."""
        return self.kind != "mimo"


def _text_config(d: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a Qwen3.5 wrapper (its text_config, typed), else d."""
    if d.get("model_type") in _WRAPPERS and isinstance(d.get("text_config"), dict):
        t = {**d["text_config"]}
        if t.get("model_type") not in _KIND:
            t["model_type"] = _WRAPPERS[d["model_type"]]
        for key in ("vocab_size", "tie_word_embeddings"):
            if key not in t and key in d:
                t[key] = d[key]
        return t
    return d


def mtp_layers_in(d: dict[str, Any]) -> int:
    """How many MTP modules a checkpoint's config.json says it ships (for `fx-engine info`):
    DeepSeek-V3 / GLM-4.5 / MiMo's num_nextn_predict_layers, Qwen3.5's mtp_num_hidden_layers,
    Qwen3-Next's num_nextn_predict_layers or 1 (vLLM's default: its checkpoints ship one and
    their config does not say); 0 for a model type without MTP modules here."""
    d = _text_config(d)
    kind = _KIND.get(d.get("model_type"))
    if kind is None:
        return 0
    if d.get("model_type") in ("qwen3_5_text", "qwen3_5_moe_text"):
        value = d.get("mtp_num_hidden_layers", d.get("num_nextn_predict_layers", 1))
    elif kind == "qwen3_next":
        value = d.get("num_nextn_predict_layers", 1)
    else:
        value = d.get("num_nextn_predict_layers", 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def mtp_layers_in_gguf(md: dict[str, Any]) -> int:
    """How many MTP (NextN) layers a GGUF's metadata says it ships: llama.cpp's
    `<arch>.nextn_predict_layers` (its block_count includes them)."""
    arch = md.get("general.architecture")
    return int(gguf_value(md, str(arch), "nextn_predict_layers", "GGUF", 0) or 0) if arch else 0


def is_nextn_export(d: dict[str, Any]) -> bool:
    """Whether a config.json is SGLang's NextN export of a checkpoint's MTP module (an
    architecture ...NextN, e.g. DeepseekV3ForCausalLMNextN: the module alone, as layer 0)."""
    return any("NextN" in str(a) for a in d.get("architectures") or ())


def describe(d: dict[str, Any]) -> str | None:
    """A line for `fx-engine info`: the MTP modules a config.json ships, or None."""
    n = mtp_layers_in(d)
    if not n:
        return None
    t = _text_config(d)
    kind = _KIND[t["model_type"]]
    nextn = is_nextn_export(d)  # (the layer at 0)
    where = {"qwen3_next": "mtp.layers.0", "mimo": "model.mtp_layers.0"}.get(
        kind, f"model.layers.{0 if nextn else t.get('num_hidden_layers', '?')}")
    return f"{n} MTP module{'s' if n > 1 else ''} ({_NAMES[kind]} format, from {where}.*)"


def config_from_hf(d: dict[str, Any], source: str = "config.json", *, mask_first_position: bool | None = None,
                   chain_normed: bool | None = None) -> MtpConfig:
    """The MTP modules of a checkpoint from its (the target's) config.json. The two reference
    choices default to vLLM's (module docstring); `chain_normed=True` is SGLang's chaining of
    DeepSeek's NextN, `mask_first_position=False` SGLang's unmasked position 0. A model type
    without MTP modules, or a config that ships none, is a ConfigError naming the field."""
    d = hf_config.normalize(_text_config(hf_config.decode_floats(d)))  # (as the target's config is read)
    mt = d.get("model_type")
    kind = _KIND.get(mt)
    if kind is None:
        raise ConfigError(f"{source}: model_type {mt!r} has no MTP modules fx-engine reads "
                          f"(supported: {', '.join(sorted(_KIND))} and the qwen3_5 / qwen3_5_moe wrappers)")
    n = mtp_layers_in(d)
    if n < 1:
        key = "mtp_num_hidden_layers" if mt in ("qwen3_5_text", "qwen3_5_moe_text") else "num_nextn_predict_layers"
        raise ConfigError(f"{source}: field '{key}' = {d.get(key, 0)!r}: the checkpoint ships no MTP modules")
    layer, first = _LAYER_CONFIG[kind](d, n, source)
    return MtpConfig(kind=kind, num_modules=n, layer=layer, first_layer=first,
                     mask_first_position=(kind != "qwen3_next") if mask_first_position is None else mask_first_position,
                     chain_normed=(kind in ("qwen3_next", "mimo")) if chain_normed is None else chain_normed)


def _routed(index: int, first_dense: int, freq: int) -> bool:
    """vLLM's rule for a DeepSeek / GLM decoder layer: routed experts from layer
    first_k_dense_replace on, every moe_layer_freq-th."""
    return index >= first_dense and index % max(freq, 1) == 0


def _deepseek_layer_config(d: dict[str, Any], n: int, source: str) -> tuple[Any, int]:
    target = deepseek.config_from_hf(d, source)
    # SGLang's NextN checkpoints (the MTP layer alone, as layer 0; its decoder layer is always
    # a routed one there)
    nextn = is_nextn_export(d)
    first = 0 if nextn else target.num_layers
    experts = d.get("n_routed_experts") is not None
    flags = tuple(experts and (nextn or _routed(first + k, int(d.get("first_k_dense_replace") or 0),
                                                int(d.get("moe_layer_freq") or 1))) for k in range(n))
    return attrs.evolve(target, num_layers=n, moe_layers=flags), first


def _glm_layer_config(d: dict[str, Any], n: int, source: str) -> tuple[Any, int]:
    target = moe.config_from_hf(d, source)
    first = target.num_layers
    flags = tuple(_routed(first + k, int(d.get("first_k_dense_replace") or 0), 1) for k in range(n))
    return attrs.evolve(target, num_layers=n, moe_layers=flags), first


def _qwen3_next_layer_config(d: dict[str, Any], n: int, source: str) -> tuple[Any, int]:
    target = qwen3_next.config_from_hf(d, source)
    # vLLM builds mtp.layers.{k} with layer index k: routed where the target's rule says so
    # for index k (Qwen3.5: experts on every layer or none)
    experts = int(d.get("num_experts") or 0)
    dense = [] if target.qwen3_5 else (d.get("mlp_only_layers") or [])
    step = 1 if target.qwen3_5 else int(d.get("decoder_sparse_step") or 1)
    flags = tuple(experts > 0 and k not in dense and (k + 1) % step == 0 for k in range(n))
    return attrs.evolve(target, num_layers=n, linear_layers=(False,) * n, moe_layers=flags), 0


def _mimo_layer_config(d: dict[str, Any], n: int, source: str) -> tuple[Any, int]:
    # MiMo is Qwen2's decoder (vLLM's Qwen2DecoderLayer: q/k/v biases, none on o_proj); the
    # llama family reads model_type "mimo" as Qwen2 (its RoPE base 1e4 when unsaid, as
    # Hugging Face's MiMoConfig)
    target = llama.config_from_hf({**d, "model_type": "mimo"}, source)
    if target.layer_types:
        raise ConfigError(f"{source}: sliding-window layers (use_sliding_window / layer_types) are not "
                          "supported for MiMo's MTP modules")
    return attrs.evolve(target, num_layers=n), 0


_LAYER_CONFIG = {"deepseek_v3": _deepseek_layer_config, "glm4_moe": _glm_layer_config,
                 "qwen3_next": _qwen3_next_layer_config, "mimo": _mimo_layer_config}


def config_from_gguf(md: dict[str, Any], source: str = "GGUF", *, mask_first_position: bool | None = None,
                     chain_normed: bool | None = None) -> MtpConfig:
    """The MTP (NextN) layers of a GGUF, where llama.cpp writes them: glm4moe (GLM-4.5 /
    4.6), deepseek2 (GLM-4.7-Flash, DeepSeek V3.2, and MTP-only files) and qwen35 /
    qwen35moe (Qwen3.5 / 3.6, and their mtp-*.gguf files; qwen3next too, should a converter
    write them): `blk.{N + k}.nextn.*` next to the layer's usual tensors; block_count
    includes them. The two reference choices default as `config_from_hf`'s for the format."""
    arch = md.get("general.architecture")
    if arch not in ("glm4moe", "deepseek2", *qwen3_next.GGUF_ARCHS):
        raise ConfigError(f"{source}: GGUF architecture {arch!r}: llama.cpp writes no MTP (NextN) tensors "
                          "fx-engine reads for it (glm4moe, deepseek2, qwen35, qwen35moe and qwen3next only)")
    n = mtp_layers_in_gguf(md)
    if n < 1:
        raise ConfigError(f"{source}: GGUF metadata '{arch}.nextn_predict_layers' = {n}: the file ships no "
                          "MTP (NextN) layers")
    if arch in qwen3_next.GGUF_ARCHS:  # one full-attention layer each, routed where the trunk's are
        target = qwen3_next.config_from_gguf(md, source)
        layer = attrs.evolve(target, num_layers=n, linear_layers=(False,) * n, lin_out_tiled=False,
                             moe_layers=(any(target.moe_layers),) * n)
        return MtpConfig(kind="qwen3_next", num_modules=n, layer=layer, first_layer=target.num_layers,
                         mask_first_position=bool(mask_first_position),
                         chain_normed=True if chain_normed is None else chain_normed)
    # (the target's num_layers: block_count - nextn_predict_layers)
    target = moe.config_from_gguf(md, source) if arch == "glm4moe" else deepseek.config_from_gguf(md, source)
    first = target.num_layers
    dense = int(gguf_value(md, arch, "leading_dense_block_count", source, 0) or 0)
    experts = int(gguf_value(md, arch, "expert_count", source, 0) or 0) > 0
    layer = attrs.evolve(target, num_layers=n, moe_layers=tuple(experts and _routed(first + k, dense, 1)
                                                                for k in range(n)))
    return MtpConfig(kind="glm4_moe" if arch == "glm4moe" else "deepseek_v3", num_modules=n, layer=layer,
                     first_layer=first, mask_first_position=True if mask_first_position is None else mask_first_position,
                     chain_normed=False if chain_normed is None else chain_normed)


def check_target(cfg: MtpConfig, target: Any) -> None:
    """The modules against the target they draft for (its family config): the modules read
    the target's embeddings and output head and its hidden states (hidden_size,
    vocab_size), and sit after its layers (num_layers). A mismatch is a ConfigError naming
    both fields."""
    mt = getattr(target, "model_type", "target")
    try:
        family = family_of(target).name
    except TypeError:
        family = None
    if family != _FAMILY[cfg.kind] or (cfg.kind in ("glm4_moe", "mimo") and mt != cfg.kind):
        raise ConfigError(f"MTP modules of the {_NAMES[cfg.kind]} format cannot draft for a {mt} target")
    for field in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(cfg.layer, field), getattr(target, field)
        if mine != theirs:
            raise ConfigError(f"MTP module: {field} = {mine} but the {mt} target's {field} is {theirs}")
    if cfg.kind in ("deepseek_v3", "glm4_moe") and cfg.first_layer and cfg.first_layer != target.num_layers:
        raise ConfigError(f"MTP module: it sits at layer {cfg.first_layer} (num_hidden_layers) but the {mt} "
                          f"target has {target.num_layers} layers")


def target_capture(cfg: MtpConfig, target_layers: int) -> Capture:
    """The target state the modules take, as a `skeleton.Capture` for the target's compiled
    steps: the final norm's output (DeepSeek-V3, GLM-4.5, Qwen3-Next: `normed`), or the
    stream after the last layer before the final norm (MiMo: boundary N)."""
    return Capture((), normed=True) if cfg.target_normed else Capture((target_layers,))


# ---------------------------------------------------------------- params


@attrs.frozen
class MtpModule:
    """One MTP module: the two input norms, the projection of the concatenated pair, the
    target family's decoder-layer record, the output norm, and the module's own copies of
    the embedding table and head where loaded (None: the target's, `MtpTables`)."""

    embed_norm: mx.array  # enorm / pre_fc_norm_embedding / token_layernorm
    hidden_norm: mx.array  # hnorm / pre_fc_norm_hidden / hidden_layernorm
    proj: Linear  # eh_proj / fc / input_proj: [2H -> H]
    layer: Any  # DeepseekLayer | MoELayer | Qwen3NextLayer | llama.LayerParams
    norm: mx.array  # shared_head.norm / mtp.norm / final_layernorm
    head: Linear | None = None  # shared_head.head (DeepSeek / GLM checkpoints ship a copy)
    embed: Linear | None = None  # embed_tokens (likewise)


@attrs.frozen
class MtpParams:
    __fx_memo_flatten__ = True  # immutable and flattened every step (fx_engine.core.tree)
    modules: tuple[MtpModule, ...]
    rope_freqs: mx.array | None  # the layer's scaled RoPE periods (YaRN, llama3), else None
    config: MtpConfig = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


@attrs.frozen
class MtpTables:
    """The target's embedding table and output head (the head: its lm_head, or the tied
    embedding), which the modules read unless they carry their own."""

    embed: Linear
    head: Linear


def target_tables(target_params: Any) -> MtpTables:
    """The tables of a loaded target (any family's params with `embed` and `lm_head`, None
    when tied)."""
    head = getattr(target_params, "lm_head", None)
    return MtpTables(embed=target_params.embed, head=head if head is not None else target_params.embed)


def tables_from_tensors(tensors: Mapping[str, mx.array], cfg: MtpConfig, opts: LoadOptions | None = None,
                        tied: bool | None = None) -> MtpTables:
    """The target's tables from its checkpoint tensors (model.embed_tokens, lm_head; tied
    when `tied` or, None, when the checkpoint has no lm_head): for modules tested or run
    without their loaded target (the engine's drafter takes a loaded target's:
    `target_tables`)."""
    opts = opts or LoadOptions(dtype=mx.float32, where="MTP target tables")
    src = TensorSource()
    src.add(opts.where, dict(tensors))
    rd = Reader(src, opts)
    tied = not src.has("lm_head.weight") if tied is None else tied
    table = rd.table("model.embed_tokens", cfg.vocab_size, cfg.hidden_size, lookup_only=not tied)
    return MtpTables(embed=table, head=table if tied else rd.linear("lm_head", cfg.vocab_size, cfg.hidden_size))


def cache_specs(cfg: MtpConfig) -> tuple[LayerSpec, ...]:
    """The modules' cache layout: one entry per module, the family's own (DeepSeek's latent
    entry, dense attention for the others); `cache.init_cache(...)` builds it."""
    if cfg.kind == "deepseek_v3":
        return deepseek.cache_specs(cfg.layer)
    if cfg.kind == "qwen3_next":
        return qwen3_next.cache_specs(cfg.layer)
    return llama.cache_specs(cfg.layer)


def module_prefix(cfg: MtpConfig, k: int) -> str:
    """Where module k's decoder layer sits in a (Hugging Face) checkpoint."""
    return {"deepseek_v3": f"model.layers.{cfg.first_layer + k}.", "glm4_moe": f"model.layers.{cfg.first_layer + k}.",
            "qwen3_next": f"mtp.layers.{k}.", "mimo": f"model.mtp_layers.{k}."}[cfg.kind]


# The modules' own tensors besides the decoder layer, per format (under `module_prefix` for
# DeepSeek / GLM / MiMo; Qwen3-Next's are shared by its layers, under "mtp.")
_NEXTN = (
    Vec("embed_norm", "enorm.weight", "hidden_size"), Vec("hidden_norm", "hnorm.weight", "hidden_size"),
    Lin("proj", "eh_proj", "hidden_size", "proj_in"), Vec("norm", "shared_head.norm.weight", "hidden_size"),
)
_QWEN_MTP = (
    Vec("embed_norm", "mtp.pre_fc_norm_embedding.weight", "hidden_size", plus="norm_offset"),
    Vec("hidden_norm", "mtp.pre_fc_norm_hidden.weight", "hidden_size", plus="norm_offset"),
    Lin("proj", "mtp.fc", "hidden_size", "proj_in"), Vec("norm", "mtp.norm.weight", "hidden_size", plus="norm_offset"),
)
_MIMO_MTP = (
    Vec("embed_norm", "token_layernorm.weight", "hidden_size"),
    Vec("hidden_norm", "hidden_layernorm.weight", "hidden_size"),
    Lin("proj", "input_proj", "hidden_size", "proj_in"), Vec("norm", "final_layernorm.weight", "hidden_size"),
)


class _Reads(dict):
    """A TensorSource's tensors that remember which were read (every read goes through
    `tensors[name]`): what the loader did not read under a module's prefix is reported."""

    def __init__(self, items: Mapping[str, mx.array]) -> None:
        super().__init__(items)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> mx.array:
        self.read.add(name)
        return super().__getitem__(name)


def mtp_params_from_tensors(tensors: Mapping[str, mx.array], cfg: MtpConfig, opts: LoadOptions | None = None, *,
                            own_tables: bool = False, norm_offset: float | None = None) -> MtpParams:
    """MtpParams from a checkpoint's tensors under its published names (the whole checkpoint
    or its MTP tensors alone; the trunk's are not read). Linears dense or MLX-quantized
    (`.scales` / `.biases`, with `opts.quant`); experts one tensor each or stacked.

    own_tables: read the modules' own copies of the embedding table and head where the
    checkpoint ships them (DeepSeek-V3 / GLM-4.5's embed_tokens and shared_head.head, as vLLM
    does); False (SGLang's choice, the default): skip them and read the target's
    (`MtpTables`), the same values in DeepSeek-V3 without a second copy in memory.
    norm_offset (Qwen3-Next / Qwen3.5): added to its RMSNorm weights, stored as w of 1 + w in
    Hugging Face checkpoints (None: 1, or 0 where the module's experts are in mlx-lm's
    stacked layout, whose converter folds the 1 in).
    A missing or misshapen tensor is a WeightsError naming it, and so is any tensor under a
    module's prefix that this loader does not read (another variant's; FP8 scales are
    `loading.fp8`'s to apply before)."""
    opts = opts or LoadOptions(dtype=mx.float32, where="MTP module")
    src = TensorSource()
    src.add(opts.where, dict(tensors))
    return _assemble(cfg, src, opts, own_tables, norm_offset)


def _assemble(cfg: MtpConfig, src: TensorSource, opts: LoadOptions, own_tables: bool,
              norm_offset: float | None) -> MtpParams:
    reads = _Reads(src.tensors)
    src.tensors = reads
    rd = Reader(src, opts)
    lc = cfg.layer
    sizes: dict[str, Any] = {"proj_in": 2 * cfg.hidden_size}
    modules = []
    routed = getattr(lc, "moe_layers", ()) or (False,) * cfg.num_modules  # (MiMo's layers: dense)
    if cfg.kind == "qwen3_next":
        sizes["norm_offset"] = _qwen_norm_offset(cfg, src) if norm_offset is None else float(norm_offset)
        top = read_tensors(rd, _QWEN_MTP, lc, sizes=sizes)
    for k in range(cfg.num_modules):
        pre = module_prefix(cfg, k)
        if cfg.kind in ("deepseek_v3", "glm4_moe"):
            top = read_tensors(rd, _NEXTN, lc, pre, sizes=sizes)
            if own_tables:  # the copies of the target's tables, where the checkpoint ships them
                v, h = cfg.vocab_size, cfg.hidden_size
                top["embed"] = (rd.table(pre + "embed_tokens", v, h, lookup_only=True)
                                if rd.has(pre + "embed_tokens.weight") else None)
                top["head"] = (rd.linear(pre + "shared_head.head", v, h)
                               if rd.has(pre + "shared_head.head.weight") else None)
        elif cfg.kind == "mimo":
            top = read_tensors(rd, _MIMO_MTP, lc, pre, sizes=sizes)
        layer = _LAYER_READERS[cfg.kind](lc, rd, pre, bool(routed[k]), sizes)
        modules.append(MtpModule(layer=layer, **top))
    _check_read(cfg, reads, opts.where)
    freqs = (scaled_rope_freqs(dict(lc.rope_scaling or ()), lc.qk_rope_head_dim, lc.rope_theta)
             if cfg.kind == "deepseek_v3" else rope_freqs(lc) if cfg.kind in ("glm4_moe", "mimo") else None)
    return MtpParams(modules=tuple(modules), rope_freqs=freqs, config=cfg, numerics=opts.numerics,
                     dtype=opts.dtype_name)


def _qwen_norm_offset(cfg: MtpConfig, src: TensorSource) -> float:
    """1.0 (Hugging Face's 1 + w storage) unless module 0's experts are stacked as mlx-lm
    writes them (its converter folds the 1 into every RMSNorm it keeps)."""
    return 0.0 if src.has("mtp.layers.0.mlp.switch_mlp.gate_proj.weight") else 1.0


def _deepseek_layer(lc: Any, rd: Reader, pre: str, routed: bool, sizes: dict[str, Any]) -> Any:
    """A DeepSeek decoder layer under `pre` (deepseek.py's tables and readers)."""
    hq, dn, dr, dv = lc.num_heads, lc.qk_nope_head_dim, lc.qk_rope_head_dim, lc.v_head_dim
    s = {**sizes, "q_width": hq * (dn + dr), "kv_a_width": lc.kv_lora_rank + dr, "o_width": hq * dv,
         "q_whole": not lc.q_lora_rank}
    a = pre + "self_attn."
    w_uk, w_uv = deepseek._head_maps(lc, rd.src, a, rd.opts)
    attn = deepseek.MLA(**read_tensors(rd, deepseek.ATTENTION, lc, a, sizes=s), w_uk=w_uk, w_uv=w_uv)
    mlp = (dict(experts=deepseek._routed_experts(lc, rd, pre + "mlp.")) if routed
           else read_tensors(rd, SWIGLU_MLP, lc, pre, sizes=s))
    return deepseek.DeepseekLayer(**read_tensors(rd, deepseek.NORMS, lc, pre, sizes=s), attn=attn, **mlp)


def _glm_layer(lc: Any, rd: Reader, pre: str, routed: bool, sizes: dict[str, Any]) -> Any:
    """A GLM-4.5 decoder layer under `pre` (moe.py's tables; its routed experts, the
    selection bias and the ungated shared experts, read as moe.assemble reads them)."""
    s = {**sizes, **attention_sizes(lc)}
    f = read_tensors(rd, moe._LAYER, lc, pre, sizes=s)
    if not routed:
        return moe.MoELayer(**f, **read_tensors(rd, SWIGLU_MLP, lc, pre, sizes=s))
    src, opts = rd.src, rd.opts
    e, ff, h, b = lc.num_experts, lc.moe_intermediate_size, lc.hidden_size, pre + "mlp."
    shapes = ((ff, h), (ff, h), (h, ff))
    gate, up, down = (read_experts(src, b + stacked, b + one, e, o, i, opts.quant_for, opts.where)
                      for stacked, one, (o, i) in zip(STACKED_EXPERT_NAMES, HF_EXPERT_NAMES, shapes))
    shared = read_shared_expert(rd, h, lc.shared_expert_intermediate_size, b + "shared_experts.", None,
                                ("gate_proj", "up_proj", "down_proj"))
    bias = src.get(b + "gate.e_score_correction_bias", (e,), opts.where).astype(mx.float32)
    return moe.MoELayer(**f, experts=Experts(router=rd.linear(b + "gate", e, h), **expert_stacks(gate, up, down, opts),
                                             **shared, correction_bias=bias))


def _qwen_layer(lc: Any, rd: Reader, pre: str, routed: bool, sizes: dict[str, Any]) -> Any:
    """A Qwen3-Next / Qwen3.5 full-attention layer under `pre` (qwen3_next.py's tables)."""
    s = {**sizes, **attention_sizes(lc), "gated_q_width": 2 * lc.num_heads * lc.head_dim}
    mixer = qwen3_next.GatedAttention(**read_tensors(rd, qwen3_next.ATTENTION, lc, pre + "self_attn.", sizes=s))
    mlp = (qwen3_next._read_experts(lc, rd, pre + "mlp.") if routed
           else DenseMlp(**read_tensors(rd, SWIGLU_MLP, lc, pre, sizes=s)))
    return qwen3_next.Qwen3NextLayer(mixer=mixer, mlp=mlp, **read_tensors(rd, qwen3_next.NORMS, lc, pre, sizes=s))


def _mimo_layer(lc: Any, rd: Reader, pre: str, routed: bool, sizes: dict[str, Any]) -> Any:
    """A Qwen2 decoder layer under `pre` (llama.py's tables)."""
    return llama.LayerParams(**read_tensors(rd, llama.ATTENTION + llama.MLP, lc, pre,
                                            sizes={**sizes, **attention_sizes(lc)}))


_LAYER_READERS = {"deepseek_v3": _deepseek_layer, "glm4_moe": _glm_layer, "qwen3_next": _qwen_layer,
                  "mimo": _mimo_layer}


def _check_read(cfg: MtpConfig, reads: _Reads, where: str) -> None:
    """Every tensor under the modules' prefixes was read, but the tables the modules share
    with the target (skipped unless own_tables) and RoPE buffers: anything else belongs to
    a variant this loader does not run, an error naming it."""
    if cfg.kind == "qwen3_next":
        prefixes: tuple[str, ...] = ("mtp.",)
    else:
        prefixes = tuple(module_prefix(cfg, k) for k in range(cfg.num_modules))
    skipped = tuple(p + n for p in prefixes for n in ("embed_tokens.", "shared_head.head."))
    left = sorted(n for n in reads if n.startswith(prefixes) and n not in reads.read
                  and not n.startswith(skipped) and not n.endswith("rotary_emb.inv_freq"))
    if left:
        shown = ", ".join(map(repr, left[:8])) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise WeightsError(f"{where}: unexpected tensor(s) for a {_NAMES[cfg.kind]} MTP module: {shown}")


# llama.cpp's NextN tensor names (gguf-py's NEXTN_*: blk.{bid}.nextn.*) -> the Hugging Face
# ones under the layer (model.layers.{bid}.eh_proj, ...); the decoder layer's own tensors are
# glm4moe's usual names (moe.py's table, after these)
_GGUF_NEXTN_NAMES = (
    (r"\.nextn\.eh_proj\.", ".eh_proj."), (r"\.nextn\.enorm\.", ".enorm."), (r"\.nextn\.hnorm\.", ".hnorm."),
    (r"\.nextn\.shared_head_head\.", ".shared_head.head."), (r"\.nextn\.shared_head_norm\.", ".shared_head.norm."),
    (r"\.nextn\.embed_tokens\.", ".embed_tokens."),
)


def mtp_params_from_gguf(tensors: Mapping[str, mx.array], cfg: MtpConfig, opts: LoadOptions | None = None, *,
                         own_tables: bool = False) -> MtpParams:
    """MtpParams from a GGUF's tensors (`loading.gguf.read_gguf`'s, under llama.cpp's names):
    glm4moe's, deepseek2's and qwen35's NextN layers, blk.{N + k}.nextn.{eh_proj, enorm,
    hnorm, shared_head_norm, shared_head_head, embed_tokens} and the layer's usual attention /
    expert tensors under the family's names (glm4moe: q/k norms and q/k/v biases as the
    file has them; deepseek2: kv_b whole or split into k_b / v_b; qwen35: Qwen3.5's module,
    its pair's tensors at blk.{N}.nextn.*)."""
    opts = opts or LoadOptions(dtype=mx.float32, where="MTP module (GGUF)")
    raw = TensorSource()
    raw.add(opts.where, dict(tensors))
    if cfg.kind == "qwen3_next":  # blk.{N}.nextn.* -> mtp.*, blk.{N + k}.* -> mtp.layers.{k}.*
        n0 = cfg.first_layer
        top = tuple((rf"^blk\.{n0}\.nextn\.{gg}\.", f"mtp.{hf}.") for gg, hf in (
            ("eh_proj", "fc"), ("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
            ("shared_head_norm", "norm"), ("shared_head_head", "shared_head.head"), ("embed_tokens", "embed_tokens")))
        layers = tuple((rf"^blk\.{n0 + k}\.", f"mtp.layers.{k}.") for k in range(cfg.num_modules))
        src = qwen3_next.gguf_source(raw, top + layers + qwen3_next.GGUF_TO_HF)
        return _assemble(cfg, src, opts, own_tables, 0.0)  # (its converter stores the norms as 1 + w)
    if cfg.kind == "deepseek_v3":
        return _assemble(cfg, renamed(raw, _GGUF_NEXTN_NAMES + deepseek._GGUF_TO_HF), opts, own_tables, None)
    blk = f"blk.{cfg.first_layer}."
    layer = attrs.evolve(cfg.layer, qk_norm=raw.has(blk + "attn_q_norm.weight"), qkv_bias=raw.has(blk + "attn_q.bias"))
    cfg = attrs.evolve(cfg, layer=layer)
    src = renamed(raw, _GGUF_NEXTN_NAMES + moe._GLM4_MOE_GGUF_TO_HF)
    return _assemble(cfg, src, opts, own_tables, None)


# ---------------------------------------------------------------- the forward


class _View:
    """What a family's layer functions read of its params: config, numerics, dtype and the
    RoPE periods (built per trace; not a pytree)."""

    def __init__(self, p: MtpParams) -> None:
        self.config, self.numerics, self.dtype, self.rope_freqs = p.config.layer, p.numerics, p.dtype, p.rope_freqs


def _decoder_layer(p: MtpParams, lp: Any, h: mx.array, entry: Any, spec: LayerSpec,
                   geo: StepGeometry) -> tuple[mx.array, Any]:
    """The target family's decoder layer on the projected stream h [B*T, H]: its attention
    (writing the module's cache entry) and its MLP, each a pre-norm residual branch."""
    cfg, view, num = p.config, _View(p), p.numerics
    lc = cfg.layer
    eps = lc.rms_norm_eps
    if cfg.kind == "deepseek_v3":  # deepseek.forward's layer: MLA, then routed or dense MLP
        a, entry = deepseek._attention(view, lp.attn, rms_norm(h, lp.attn_norm, eps, num), entry, spec,
                                       deepseek._rope(view, geo.positions), geo)
        h = h + a
        return h + deepseek._mlp(lc, lp, rms_norm(h, lp.mlp_norm, eps, num), num), entry
    if cfg.kind == "glm4_moe":  # moe.forward's layer and RoPE tables
        rope = moe._partial_rope(view, geo.positions) if lc.rope_dims else scaled_rope(view, geo.positions)
        return moe._layer(view, lp, h, entry, spec, rope, geo)
    if cfg.kind == "qwen3_next":  # qwen3_next.forward's full-attention layer
        rope = config_rope(lc, geo.positions, getattr(mx, p.dtype), lc.rope_dims)
        a, entry = qwen3_next.gated_attention(view, lp.mixer, rms_norm(h, lp.attn_norm, eps, num), entry, spec,
                                              rope, geo)
        h = h + a
        x = rms_norm(h, lp.mlp_norm, eps, num)
        return h + (mixture(lc, lp.mlp, x, num) if isinstance(lp.mlp, Experts)
                    else swiglu_mlp(x, lp.mlp.gate_up, lp.mlp.down, num)), entry
    return decoder_layer(view, lp, h, entry, spec, scaled_rope(view, geo.positions), geo)  # MiMo: Qwen2's


def mtp_forward(
    p: MtpParams, tables: MtpTables | None, hidden: Float[mx.array, "B T H"], next_tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], span: int | None = None, module: int = 0,
) -> tuple[Float[mx.array, "B T V"], Float[mx.array, "B T H"], KVCache]:
    """One step of MTP module `module` over T pairs per row, from each row's cache length
    (the pairs' positions); lengths advance by n_valid, as `skeleton.decoder_step`'s
    contract says (span likewise). Pair t of a row is (hidden[t], next_tokens[t]): the
    target's state at position p (`target_capture`'s; or a chained step's own output) and
    the token after it, x_{p+1}. tables: the target's (None only if the module carries its
    own). Returns float32 logits predicting x_{p+2}, the hidden states a chained step
    feeds back (`MtpConfig.chain_normed`) and the new cache (the module's entry written)."""
    b, t = next_tokens.shape
    normed, fed, cache = _mtp_hidden(p, tables, hidden, next_tokens, cache, n_valid, span, module)
    logits = _mtp_logits(p, tables, module, normed.reshape(b * t, -1))
    return logits.reshape(b, t, -1), fed, cache


def _mtp_tables(p: MtpParams, tables: MtpTables | None, module: int) -> tuple[Any, Any]:
    """(embedding table, head) of module `module`: its own, else the target's."""
    m = p.modules[module]
    table = m.embed if m.embed is not None else (tables.embed if tables is not None else None)
    head = m.head if m.head is not None else (tables.head if tables is not None else None)
    if table is None or head is None:
        raise ValueError("mtp_forward: the module has no embedding table / head of its own: pass the target's tables")
    return table, head


def _mtp_logits(p: MtpParams, tables: MtpTables | None, module: int, normed: mx.array) -> mx.array:
    return linear(normed, _mtp_tables(p, tables, module)[1], p.numerics).astype(mx.float32)


def _mtp_hidden(
    p: MtpParams, tables: MtpTables | None, hidden: Float[mx.array, "B T H"], next_tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], span: int | None, module: int,
) -> tuple[Float[mx.array, "B T H"], Float[mx.array, "B T H"], KVCache]:
    """`mtp_forward` without the logits: (the final-normed states the head reads, the states
    a chained step feeds back, the new cache)."""
    cfg, num = p.config, p.numerics
    b, t = next_tokens.shape
    width = cfg.hidden_size
    if tuple(hidden.shape) != (b, t, width):
        raise ValueError(f"mtp_forward: hidden states are {tuple(hidden.shape)}, expected ({b}, {t}, {width}) "
                         "(the target's, hidden_size wide)")
    if not 0 <= module < cfg.num_modules:
        raise ValueError(f"mtp_forward: module {module} of {cfg.num_modules}")
    m = p.modules[module]
    table, _ = _mtp_tables(p, tables, module)
    dt, eps = getattr(mx, p.dtype), cfg.rms_norm_eps
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    e = embed(next_tokens.reshape(-1), table).astype(dt)
    if cfg.mask_first_position:  # vLLM: inputs_embeds[positions == 0] = 0
        e = mx.where((geo.positions.reshape(-1) == 0)[:, None], mx.zeros_like(e), e)
    en = rms_norm(e, m.embed_norm, eps, num)
    hn = rms_norm(hidden.reshape(b * t, width).astype(dt), m.hidden_norm, eps, num)
    x = linear(mx.concatenate([hn, en] if cfg.hidden_first else [en, hn], axis=-1), m.proj, num)
    out, entry = _decoder_layer(p, m.layer, x, cache.layers[module], cache.layout[module], geo)
    normed = rms_norm(out, m.norm, eps, num)
    layers = list(cache.layers)
    layers[module] = entry
    fed = normed if cfg.chain_normed else out
    return normed.reshape(b, t, -1), fed.reshape(b, t, -1), advanced(cache, layers, geo)


def greedy_ids(logits: Float[mx.array, "*N V"]) -> Int[mx.array, "*N"]:
    return mx.argmax(logits, axis=-1).astype(mx.int32)


def mtp_step(
    p: MtpParams, tables: MtpTables | None, hidden: Float[mx.array, "B T H"], next_tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], span: int | None = None,
) -> tuple[Int[mx.array, "B"], Float[mx.array, "B V"], Float[mx.array, "B H"], KVCache]:
    """One step of module 0 over T pairs per row, the unit an engine drafter chains: the
    greedy draft after each row's last valid pair, its logits, the hidden state a chained
    step feeds back, and the cache. Rows with n_valid == 0 are untouched (outputs
    meaningless)."""
    n_valid = n_valid.astype(mx.int32)
    normed, fed, cache = _mtp_hidden(p, tables, hidden, next_tokens, cache, n_valid, span, 0)
    last = mx.maximum(n_valid - 1, 0)[:, None, None]
    # the head on the last valid pair only (a feed of T pairs pays one head, not T)
    lg = _mtp_logits(p, tables, 0, mx.take_along_axis(normed, last, axis=1)[:, 0])
    return greedy_ids(lg), lg, mx.take_along_axis(fed, last, axis=1)[:, 0], cache


# the engine's compiled form (keyed on T and span: a few shapes)
mtp_step_compiled = CompiledFunction(mtp_step, name="mtp_step")


def draft_chain(
    p: MtpParams, tables: MtpTables | None, hidden: Float[mx.array, "B T H"], next_tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], k: int, span: int | None = None,
) -> tuple[Int[mx.array, "B K"], Float[mx.array, "B K V"], Float[mx.array, "B K H"], KVCache]:
    """K greedy drafts per row: one step of module 0 over the T new pairs (the target's
    hidden states with the tokens after them), then K - 1 chained steps, each feeding the
    module its own output hidden state (`chain_normed`) and its drafted token at the next
    position. Rows with n_valid == 0 stay idle. span must cover max(lengths) + T + K - 1.

    Returns the drafts [B, K], the logits each was drawn from [B, K, V] (the q of exact
    speculative sampling, after a softmax), the hidden states fed on [B, K, H] and the cache
    (K - 1 pairs past the new ones: roll it back by length after verification, then re-run
    the module on the target's states of the accepted positions)."""
    n_valid = n_valid.astype(mx.int32)
    tok, lg, hl, cache = mtp_step(p, tables, hidden, next_tokens, cache, n_valid, span)
    active = (n_valid > 0).astype(mx.int32)
    ids, lgs, hs = [tok], [lg], [hl]
    for _ in range(k - 1):
        logits, h, cache = mtp_forward(p, tables, hl[:, None], tok[:, None], cache, active, span)
        lg, hl = logits[:, 0], h[:, 0]
        tok = greedy_ids(lg)
        ids.append(tok)
        lgs.append(lg)
        hs.append(hl)
    return mx.stack(ids, axis=1), mx.stack(lgs, axis=1), mx.stack(hs, axis=1), cache
