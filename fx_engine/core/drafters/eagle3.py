"""EAGLE-3 draft heads in their published format: config, params, the pure forward, drafting.

An EAGLE-3 head (Li et al., "EAGLE-3", 2025; checkpoints from SafeAILab/EAGLE, SpecForge,
vLLM's speculators) is one Llama decoder layer that predicts the target's next token from
the target's own hidden states. The equations, as the references compute them
(SafeAILab/EAGLE eagle/model/cnets.py `Model.forward` and `LlamaDecoderLayeremb.forward`;
vLLM vllm/model_executor/models/llama_eagle3.py `LlamaDecoderLayer.forward` and
`LlamaModel.forward`; SGLang python/sglang/srt/models/llama_eagle3.py), per position t of
the draft sequence, with the pair (g_t, x_{t+1}): g_t the hidden input, x_{t+1} the
token after it, at position t:

    g   = fc(a_t)                     if g_t is the target's, a_t = [l_lo; l_mid; l_hi] (3 H_t wide)
                                      (a_t first RMS-normed whole: norm_before_fc, tensor input_norm;
                                      or each l apart: fc_norm, tensors fc_norm.{0,1,2}: vLLM
                                      speculators' and NVIDIA's flags, SGLang's Eagle3LlamaModel)
    g   = g_t                         if g_t is the head's own previous output (H wide: no fc)
    e   = input_layernorm(embed(x_{t+1}))
    n   = hidden_norm(g)
    r   = n if norm_before_residual else g          (vLLM's speculators flag; EAGLE: g)
    h   = r + o_proj(attention(q, k, v of [e; n]))  (q/k/v take 2H inputs, embeddings first;
                                                     RoPE at position t, causal over the head's cache)
    out = h + down(silu(gate(m)) * up(m)),  m = post_attention_layernorm(h)
    logits = lm_head(norm(out))                     [draft_vocab]
    next hidden = out                               (pre-norm: fed back on chained steps;
                                                     norm(out) with speculators' norm_output)

A draft id d is target id d + d2t[d]; t2d[v] says whether target id v is in the draft vocab.

The head's attention keeps its K/V in an ordinary fx-engine `KVCache` of one dense entry
(`cache_specs`): positions are the cache's row lengths, rollback is `with_lengths`, a step
writes through the same `write_entry` / `attend_entry` as every family's attention, so the
drafter's state rolls back with the target's by length (issue 45, item 4).

Which target layers feed a_t: the residual stream *entering* layers `aux_layers(...)`
(vLLM's and EAGLE's capture point, `hidden_states + residual` before the layer; default
(2, N // 2, N - 3)), concatenated in that order; `skeleton.Capture(aux_layers(...))`
captures them inside the target's compiled steps. Layer ids a checkpoint pins
(`eagle_aux_hidden_state_layer_ids`) come in two conventions, read as SGLang reads them
(sgl-project/sglang#25454): ids starting at 1 are SpecForge's "output of layer i" (the
boundary i + 1; its default [1, N // 2 - 1, N - 4] is the same states as the unpinned
default), other ids are boundaries as they are (vLLM reads every pinned id that way; the
final boundary N, after the last layer and before the final norm, is allowed: NVIDIA's
gpt-oss heads pin it).
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Float, Int

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced, dense_layout
from fx_engine.core.checkpoint import (Fused, KeepQuantized, Lin, LoadOptions, Reader, TensorSource, Vec, WeightsError,
                                       finish, read_tensors)
from fx_engine.core.config import (BOOL, FLOAT, INT, BaseConfig, ConfigError, Field, Same, check_rope_scaling,
                                   gguf_hf_config, gguf_value, positive_int, read_fields, refuse)
from fx_engine.core.models.blocks import GATE_UP, QKV, rope_freqs, rope_type_of, scaled_rope, self_attention, swiglu_mlp
from fx_engine.core.models.llama import unpermuted_qk
from fx_engine.core.nn import Linear, Numerics, Quant, embed, linear, rms_norm
from fx_engine.core.tree import CompiledFunction, static_field

__all__ = ["Eagle3Config", "Eagle3Layer", "Eagle3Params", "aux_layers", "cache_specs", "check_target",
           "config_from_gguf", "config_from_hf", "draft_chain", "draft_logits", "draft_probs_to_target", "draft_target_ids",
           "eagle3_forward", "eagle3_params_from_gguf", "eagle3_params_from_tensors", "greedy_target_ids", "head_step", "head_step_compiled",
           "project_target_hidden", "target_logits", "target_probs", "to_target_ids"]


# ---------------------------------------------------------------- config


@attrs.frozen
class Eagle3Config(BaseConfig):
    """An EAGLE-3 head's config. `vocab_size` is the target's vocabulary (d2t maps into it),
    `draft_vocab_size` the head's lm_head rows; `target_hidden_size` the width of each of
    the three target hidden states the fc takes. num_layers is always 1."""

    draft_vocab_size: int = 0
    target_hidden_size: int = 0
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rope_traditional: bool = False  # (what blocks.scaled_rope / self_attention read; HF heads: half-split)
    max_position_embeddings: int = 2048
    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the three concatenated target states
    fc_norm: bool = False  # an RMSNorm on each of the three target states (Eagle 3.1)
    norm_output: bool = False  # chained steps feed back norm(out), not out
    aux_layer_ids: tuple[int, ...] | None = None  # None: the target's default (`aux_layers`)
    aux_are_boundaries: bool = False  # the ids are boundaries as they are (llama.cpp's extract_layers)

    @property
    def rope_type(self) -> str:
        return rope_type_of(self.rope_scaling)

    @property
    def fc_in(self) -> int:
        return 3 * self.target_hidden_size


_FIELDS = (
    Field("hidden_size"), Field("num_attention_heads", to="num_heads"),
    Field("num_key_value_heads", default=Same("num_heads"), or_default=True, to="num_kv_heads"),
    Field("vocab_size"), Field("intermediate_size"), Field("rms_norm_eps", FLOAT, 1e-6, null_default=True),
    Field("max_position_embeddings", INT, 2048, or_default=True),
    # vLLM and SGLang: a head without draft_vocab_size drafts over the whole vocabulary,
    # one without target_hidden_size serves a target as wide as itself
    Field("draft_vocab_size", default=Same("vocab_size"), null_default=True),
    Field("target_hidden_size", default=Same("hidden_size"), null_default=True),
    Field("norm_before_residual", BOOL, False, null_default=True),
    Field("norm_before_fc", BOOL, False, null_default=True),
    Field("fc_norm", BOOL, False, null_default=True),
    Field("norm_output", BOOL, False, null_default=True),
)

# Fields that would change the math if set otherwise, and what this implementation runs:
# (key, accepted values, why). A field set to anything else is an error naming it.
_REFUSED = (
    # (vLLM speculators' heads since 2026-06 carry a Qwen3 layer config, and their Qwen3
    # "first layer" is HF's LlamaDecoderLayer over it: no q/k norms, head_dim as the config
    # says; speculators models/eagle3/model_definitions_qwen3.py)
    ("model_type", lambda v: v in ("llama", "qwen3"), "EAGLE-3 heads are one Llama decoder layer"),
    ("num_hidden_layers", lambda v: v == 1,
     "one decoder layer: vLLM and SGLang run the extra layers of deeper heads differently"),
    ("hidden_act", lambda v: v in ("silu", "swish"), "the MLP is SwiGLU"),
    ("attention_bias", lambda v: not v, "the head's projections have no biases"),
    ("qkv_bias", lambda v: not v, "the head's projections have no biases"),
    ("mlp_bias", lambda v: not v, "the head's projections have no biases"),
    ("bias", lambda v: not v, "SGLang's fc bias: the published heads have none"),
    ("partial_rotary_factor", lambda v: v == 1, "RoPE over the whole head"),
    ("use_sliding_window", lambda v: not v, "full causal attention"),
    ("layer_types", lambda v: all(t == "full_attention" for t in v), "full causal attention"),
    ("logit_scale", lambda v: v == 1, "vLLM scales the draft logits by it; the published heads do not"),
)
# Fields read (`_FIELDS`, RoPE, head_dim, the aux layers) or known not to change the math
# (bookkeeping, training-only, sliding_window without use_sliding_window, tie_word_embeddings:
# every reference gives the head its own lm_head of draft_vocab_size rows, so the flag copied
# from the target is not read). Anything else is an unknown field: an error naming it, so a
# variant this module does not run cannot load silently.
_READ = frozenset({f.key for f in _FIELDS} | {k for k, _, _ in _REFUSED} | {
    "head_dim", "rope_theta", "rope_scaling", "rope_parameters", "eagle_config",
    "eagle_aux_hidden_state_layer_ids"})
_HARMLESS = frozenset({
    "architectures", "_name_or_path", "name_or_path", "transformers_version", "torch_dtype", "dtype",
    # SpecForge's note of the target's family (never read by SpecForge, vLLM or SGLang); a
    # Qwen-MoE layer config's MoE spacing (the head's one layer is dense whatever it says)
    "target_model_type", "decoder_sparse_step",
    "bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout",
    "pretraining_tp", "tie_word_embeddings", "max_window_layers", "sliding_window",
    # vLLM speculators' format (`_flattened`): its bookkeeping around the layer's config
    "speculators_model_type", "speculators_config", "speculators_version", "embed_requires_grad",
    "has_no_defaults_at_init", "transformer_layer_config"}) | frozenset(
    # transformers' PretrainedConfig attributes, which a full (not diff) to_dict() writes:
    # generation defaults and task bookkeeping, never read by a head's forward
    ("output_hidden_states", "output_attentions", "return_dict", "torchscript", "use_bfloat16",
     "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
     "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "finetuning_task",
     "id2label", "label2id", "tokenizer_class", "prefix", "sep_token_id", "decoder_start_token_id",
     "task_specific_params", "problem_type", "max_length", "min_length", "do_sample", "early_stopping",
     "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
     "repetition_penalty", "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size",
     "bad_words_ids", "num_return_sequences", "output_scores", "return_dict_in_generate",
     "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
     "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "num_labels",
     "is_causal", "attn_implementation", "_attn_implementation_autoset"))
# eagle_config (EAGLE's and NVIDIA ModelOpt's exports): the keys read, and ModelOpt's flags
# with the value this module runs (the one layer's usual norms, no parallel drafting, no
# MTP norm); another value is an error naming it. parallel_draft_heads_num_layers only
# counts the heads of a parallel draft, so it is read only with parallel_draft_step > 1.
_EAGLE_CONFIG_KEYS = frozenset({"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state", "norm_before_fc",
                                "parallel_draft_heads_num_layers"})
_EAGLE_CONFIG_FIXED = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True,
                       "use_mtp_layernorm": False, "parallel_draft_step": 1, "next_layer_regular": True}


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Eagle3Config:
    """An Eagle3Config from a head's config.json: EAGLE's / SpecForge's flat Llama config with
    draft_vocab_size (and target_hidden_size, eagle_config), or vLLM's speculators format
    (the layer's config under transformer_layer_config). Refuses what this module does not
    run and any field it does not know, naming them."""
    d = _flattened(d, source)
    unknown = sorted(set(d) - _READ - _HARMLESS)
    if unknown:
        raise ConfigError(f"{source}: unknown EAGLE-3 config field(s) {', '.join(map(repr, unknown))} "
                          "(they may change the head's math; not supported)")
    for key, ok, why in _REFUSED:
        refuse(d, source, key, ok, why)
    f = read_fields(d, _FIELDS, source)
    if f["num_heads"] % f["num_kv_heads"]:
        raise ConfigError(f"{source}: num_attention_heads ({f['num_heads']}) is not a multiple of "
                          f"num_key_value_heads ({f['num_kv_heads']})")
    if 3 * f["target_hidden_size"] == f["hidden_size"]:
        # the references tell the target's states from the head's own by their width
        raise ConfigError(f"{source}: 3 * target_hidden_size == hidden_size ({f['hidden_size']}): the "
                          "target's and the head's hidden states cannot be told apart")
    nbf = (d.get("eagle_config") or {}).get("norm_before_fc") if isinstance(d.get("eagle_config"), dict) else None
    if nbf is not None:  # (NVIDIA's heads say it inside eagle_config: vLLM #42143)
        if d.get("norm_before_fc") is not None and bool(d["norm_before_fc"]) != bool(nbf):
            raise ConfigError(f"{source}: norm_before_fc {d['norm_before_fc']!r} and eagle_config.norm_before_fc "
                              f"{nbf!r} disagree")
        f["norm_before_fc"] = bool(nbf)
    theta, scaling = _rope_settings(d)
    head_dim = positive_int(d.get("head_dim") or f["hidden_size"] // f["num_heads"], "head_dim", source)
    return Eagle3Config(model_type="llama", num_layers=1, head_dim=head_dim, rope_theta=theta,
                        rope_scaling=check_rope_scaling(scaling, source), aux_layer_ids=_aux_ids(d, source), **f)


def _flattened(d: dict[str, Any], source: str) -> dict[str, Any]:
    """vLLM's speculators format as the flat config (its Eagle3SpeculatorsConfig: the layer's
    config, plus draft_vocab_size, target_hidden_size, norm_before_residual and the aux
    layer ids from the top level); a flat config as it is."""
    layer = d.get("transformer_layer_config")
    if layer is None:
        return d
    kind = d.get("speculators_model_type")
    if kind != "eagle3":
        raise ConfigError(f"{source}: speculators_model_type {kind!r} is not supported (eagle3)")
    lifted = ("draft_vocab_size", "target_hidden_size", "norm_before_residual", "eagle_aux_hidden_state_layer_ids",
              "norm_before_fc", "fc_norm", "norm_output")
    return {**{k: v for k, v in d.items() if k not in lifted}, **layer,
            **{k: d[k] for k in lifted if d.get(k) is not None}}


def _rope_settings(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling): top level, or transformers >= 5's rope_parameters; the
    Llama default base 1e4 when unsaid."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta"))
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(10_000.0 if theta is None else theta), scaling


def _aux_ids(d: dict[str, Any], source: str) -> tuple[int, ...] | None:
    """The target layers the checkpoint pins (eagle_config's or the top level's), or None."""
    eagle = d.get("eagle_config") or {}
    if not isinstance(eagle, dict) or set(eagle) - _EAGLE_CONFIG_KEYS - set(_EAGLE_CONFIG_FIXED):
        extra = sorted(set(eagle) - _EAGLE_CONFIG_KEYS - set(_EAGLE_CONFIG_FIXED)) if isinstance(eagle, dict) else eagle
        raise ConfigError(f"{source}: eagle_config field(s) {extra!r} are not supported")
    for key, want in _EAGLE_CONFIG_FIXED.items():
        if key in eagle and eagle[key] is not None and eagle[key] != want:
            raise ConfigError(f"{source}: eagle_config.{key} = {eagle[key]!r} is not supported (this head runs "
                              f"{key} = {want!r}: one decoder layer with its usual norms, one draft a step)")
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ConfigError(f"{source}: eagle_config.use_aux_hidden_state = false is not supported "
                          "(the published heads take three target layers through fc)")
    inner, top = eagle.get("eagle_aux_hidden_state_layer_ids"), d.get("eagle_aux_hidden_state_layer_ids")
    if inner is not None and top is not None and list(inner) != list(top):
        raise ConfigError(f"{source}: eagle_config.eagle_aux_hidden_state_layer_ids {inner!r} and "
                          f"eagle_aux_hidden_state_layer_ids {top!r} disagree")
    ids = inner if inner is not None else top
    if ids is None:
        return None
    if (not isinstance(ids, list) or len(ids) != 3
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
        raise ConfigError(f"{source}: eagle_aux_hidden_state_layer_ids must list 3 layer indices >= 0, got {ids!r}")
    return tuple(ids)


def aux_layers(cfg: Eagle3Config, target_layers: int) -> tuple[int, ...]:
    """The layer boundaries of the target whose residual stream the head's fc takes, in
    concatenation order (`skeleton.Capture`'s: boundary b < N is the stream entering layer
    b, 0 the embeddings, N the stream after the last layer): vLLM's and EAGLE's default
    (2, N // 2, N - 3), or the checkpoint's pinned ids, SpecForge's "output of layer i" ids
    (first id 1) shifted to boundaries i + 1 (see the module docstring)."""
    n = target_layers
    if cfg.aux_layer_ids is None:
        ids = (2, n // 2, n - 3)
    elif cfg.aux_layer_ids[0] == 1 and not cfg.aux_are_boundaries:  # SpecForge's layer outputs (SGLang's reading)
        ids = tuple(i + 1 for i in cfg.aux_layer_ids)
    else:
        ids = cfg.aux_layer_ids
    if not all(0 <= i <= n for i in ids):
        pinned = "" if cfg.aux_layer_ids is None else f" (eagle_aux_hidden_state_layer_ids {list(cfg.aux_layer_ids)})"
        raise ConfigError(f"EAGLE-3 aux layer boundaries {ids}{pinned} are not boundaries of a {n}-layer "
                          f"target (0 .. {n})")
    return tuple(ids)


def check_target(cfg: Eagle3Config, target: Any, own_embed: bool) -> tuple[int, ...]:
    """The head against its target's config (`hidden_size`, `vocab_size`, `num_layers`):
    the fc takes the target's hidden states (target_hidden_size), d2t maps into the target's
    vocabulary (vocab_size), the aux layers lie in the target, and a head without its own
    embed_tokens reads the target's table (its hidden_size is the target's). Returns the aux
    layer boundaries; a mismatch is a ConfigError naming both fields."""
    kind = getattr(target, "model_type", "target")
    for head_field, target_field in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        mine, theirs = getattr(cfg, head_field), getattr(target, target_field)
        if mine != theirs:
            raise ConfigError(f"EAGLE-3 head: {head_field} = {mine} but the {kind} target's {target_field} is "
                              f"{theirs}: the head was trained for another model")
    if not own_embed and cfg.hidden_size != target.hidden_size:
        raise ConfigError(f"EAGLE-3 head: hidden_size = {cfg.hidden_size} differs from the {kind} target's "
                          f"hidden_size {target.hidden_size} and the head has no embed_tokens of its own "
                          "(it would read the target's embeddings)")
    return aux_layers(cfg, target.num_layers)


# ---------------------------------------------------------------- params


@attrs.frozen
class Eagle3Layer:
    """The head's decoder layer (EAGLE's `midlayer`): q/k/v over [embeddings; hidden], 2H wide."""

    input_norm: mx.array  # input_layernorm: on the token embeddings
    hidden_norm: mx.array  # on the incoming hidden state
    qkv: Linear  # fused [q; k; v] rows, 2H inputs
    o: Linear
    mlp_norm: mx.array  # post_attention_layernorm
    gate_up: Linear  # fused [gate; up] rows
    down: Linear
    q_norm: None = None  # (blocks.self_attention's optional per-head norms: none here)
    k_norm: None = None


@attrs.frozen
class Eagle3Params:
    __fx_memo_flatten__ = True  # immutable and flattened every step: memoize (fx_engine.core.tree)
    fc: Linear  # [3 H_t -> H]: the target's three hidden states to the head's width
    layer: Eagle3Layer
    norm: mx.array
    lm_head: Linear  # [draft_vocab, H]
    d2t: Int[mx.array, "Vd"]  # int64 offsets: draft id d is target id d + d2t[d]
    t2d: mx.array  # bool [vocab]: target ids in the draft vocabulary
    embed: Linear | None  # the head's own embedding table, or None: the target's is used
    fc_input_norm: mx.array | None  # norm_before_fc's weight [3 H_t], else None
    fc_norms: tuple[mx.array, ...] | None  # fc_norm's three weights [H_t] each, else None
    rope_freqs: mx.array | None  # precomputed for llama3 / yarn / longrope scaling, else None
    config: Eagle3Config = static_field()
    numerics: Numerics = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")


def quantized_head(p: Eagle3Params, bits: int, keep: KeepQuantized, numerics: Numerics,
                   group_size: int = 32) -> Eagle3Params:
    """The head with its matrices (fc, the layer's q|k|v, o, gate|up, down, the draft
    lm_head; not an embedding table) affine-quantized to `bits` in groups of `group_size`,
    kept packed where `keep` says (the native kernels' formats) and run with `numerics`:
    a head step streams a quarter of float32's bytes for its drafts (which the target's
    verify still decides: the output does not change)."""
    dt = getattr(mx, p.dtype)

    def q(lin: Linear) -> Linear:
        if lin.quantized or lin.in_features % group_size:
            return lin
        w, s, b = mx.quantize(lin.dense_out_in, group_size=group_size, bits=bits)
        return finish(Linear(weight=w, bias=lin.bias, quant=Quant(s, b, group_size, bits), origin=lin.origin), dt,
                      keep)

    layer = p.layer
    layer = attrs.evolve(layer, qkv=q(layer.qkv), o=q(layer.o), gate_up=q(layer.gate_up), down=q(layer.down))
    return attrs.evolve(p, fc=q(p.fc), layer=layer, lm_head=q(p.lm_head), numerics=numerics)


def cache_specs(cfg: Eagle3Config) -> tuple[LayerSpec, ...]:
    """The head's cache layout: one dense attention entry (`cache.init_cache(...)` builds it;
    `finish_layout` may quantize it like any full-attention entry)."""
    return dense_layout(1, cfg.num_kv_heads, cfg.head_dim)


# ---------------------------------------------------------------- the forward


def eagle3_forward(
    p: Eagle3Params, embeds: Float[mx.array, "B T H"], hidden: Float[mx.array, "B T Hin"], cache: KVCache,
    n_valid: Int[mx.array, "B"], span: int | None = None,
) -> tuple[Float[mx.array, "B T Vd"], Float[mx.array, "B T H"], KVCache]:
    """One step of the head over T pairs per row, from each row's cache length (the pairs'
    positions); lengths advance by n_valid, as `skeleton.decoder_step`'s contract says (span
    likewise). hidden: the target's three concatenated states (3 H_t wide: through fc) or the
    head's own previous outputs (H wide: as they are), the references' rule. Returns float32
    draft-vocab logits, the output hidden states a chained step feeds back (`fed_back`: the
    pre-norm ones unless the head says norm_output) and the new cache."""
    b, t, _ = embeds.shape
    h, cache = eagle3_hidden(p, embeds, hidden, cache, n_valid, span)
    return draft_logits(p, h.reshape(b * t, -1)).reshape(b, t, -1), fed_back(p, h), cache


def eagle3_hidden(
    p: Eagle3Params, embeds: Float[mx.array, "B T H"], hidden: Float[mx.array, "B T Hin"], cache: KVCache,
    n_valid: Int[mx.array, "B"], span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """`eagle3_forward` without the draft logits: the pre-norm output hidden states and the
    new cache (a step that needs the logits of one position per row takes them after)."""
    cfg = p.config
    b, t, width = embeds.shape
    if width != cfg.hidden_size:
        raise ValueError(f"eagle3_forward: embeds are {width} wide, the head's hidden_size is {cfg.hidden_size}")
    dt = getattr(mx, p.dtype)
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    g = _incoming(p, hidden.reshape(b * t, -1).astype(dt))
    h, entry = _decoder_layer(p, embeds.reshape(b * t, width).astype(dt), g, cache.layers[0], cache.layout[0], geo)
    return h.reshape(b, t, -1), advanced(cache, [entry], geo)


def project_target_hidden(p: Eagle3Params, aux: Float[mx.array, "*N Hin"]) -> Float[mx.array, "*N H"]:
    """fc over the target's three concatenated hidden states, after the checkpoint's input
    norms (per position: so projecting first and feeding H-wide states gives the same step)."""
    x = aux.astype(getattr(mx, p.dtype))
    eps, num = p.config.rms_norm_eps, p.numerics
    if p.fc_input_norm is not None:  # norm_before_fc: one norm over the 3 H_t concatenation
        x = rms_norm(x, p.fc_input_norm, eps, num)
    if p.fc_norms is not None:  # fc_norm: each target state normed alone
        w = p.config.target_hidden_size
        x = mx.concatenate([rms_norm(x[..., i * w:(i + 1) * w], n, eps, num) for i, n in enumerate(p.fc_norms)],
                           axis=-1)
    return linear(x, p.fc, p.numerics)


def fed_back(p: Eagle3Params, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N H"]:
    """The hidden state a chained step takes from the head's output h (pre-norm): h, or
    norm(h) for heads trained so (speculators' norm_output: the state the logits came from)."""
    return rms_norm(h, p.norm, p.config.rms_norm_eps, p.numerics) if p.config.norm_output else h


def _incoming(p: Eagle3Params, g: mx.array) -> mx.array:
    """The hidden input at the head's width: the target's states through fc, the head's own
    as they are (decided by the width, statically, as EAGLE and SGLang decide it)."""
    cfg = p.config
    if g.shape[-1] == cfg.hidden_size:
        return g
    if g.shape[-1] != cfg.fc_in:
        raise ValueError(f"eagle3_forward: hidden states are {g.shape[-1]} wide: expected the target's three "
                         f"({cfg.fc_in}) or the head's own ({cfg.hidden_size})")
    return project_target_hidden(p, g)


def _decoder_layer(p: Eagle3Params, e: mx.array, g: mx.array, entry: Any, spec: LayerSpec,
                   geo: StepGeometry) -> tuple[mx.array, Any]:
    """The midlayer on e (embeddings) and g (hidden) [B*T, H]: attention over the normed pair
    [e; g] (2H: embeddings first), added to the residual g (or to its norm: vLLM's
    norm_before_residual), then the usual pre-norm SwiGLU branch."""
    cfg, num, lp = p.config, p.numerics, p.layer
    eps = cfg.rms_norm_eps
    normed = rms_norm(g, lp.hidden_norm, eps, num)
    residual = normed if cfg.norm_before_residual else g
    x = mx.concatenate([rms_norm(e, lp.input_norm, eps, num), normed], axis=-1)
    # blocks.self_attention reads the Llama config fields Eagle3Config carries (heads, RoPE);
    # its linear takes the 2H input as is
    a, entry = self_attention(p, lp, x, entry, spec, scaled_rope(p, geo.positions), geo)
    h = residual + a
    return h + swiglu_mlp(rms_norm(h, lp.mlp_norm, eps, num), lp.gate_up, lp.down, num), entry


def draft_logits(p: Eagle3Params, h: Float[mx.array, "*N H"]) -> Float[mx.array, "*N Vd"]:
    """float32 draft-vocabulary logits of the head's pre-norm output."""
    return linear(rms_norm(h, p.norm, p.config.rms_norm_eps, p.numerics), p.lm_head, p.numerics).astype(mx.float32)


# ---------------------------------------------------------------- draft vocabulary -> target vocabulary


def draft_target_ids(p: Eagle3Params) -> Int[mx.array, "Vd"]:
    """The target id of every draft id: d + d2t[d] (int32)."""
    return (mx.arange(p.config.draft_vocab_size, dtype=mx.int64) + p.d2t).astype(mx.int32)


def to_target_ids(p: Eagle3Params, draft_ids: Int[mx.array, "*N"]) -> Int[mx.array, "*N"]:
    return mx.take(draft_target_ids(p), draft_ids.astype(mx.int32))


def greedy_target_ids(p: Eagle3Params, logits: Float[mx.array, "*N Vd"]) -> Int[mx.array, "*N"]:
    """The argmax over the draft vocabulary, as a target id."""
    return to_target_ids(p, mx.argmax(logits, axis=-1))


def _scattered(p: Eagle3Params, values: mx.array, fill: float) -> mx.array:
    """values [..., Vd] at their target ids of a [..., vocab] array filled with `fill`."""
    lead = values.shape[:-1]
    out = mx.full((*lead, p.config.vocab_size), fill, dtype=values.dtype)
    idx = mx.broadcast_to(draft_target_ids(p), values.shape)
    return mx.put_along_axis(out, idx, values, axis=-1)


def target_logits(p: Eagle3Params, logits: Float[mx.array, "*N Vd"]) -> Float[mx.array, "*N V"]:
    """Target-vocabulary logits: the draft logits at their target ids, -inf elsewhere (vLLM's
    compute_logits): any target-vocab sampler then draws only draft-vocab tokens."""
    return _scattered(p, logits.astype(mx.float32), float("-inf"))


def target_probs(p: Eagle3Params, logits: Float[mx.array, "*N Vd"]) -> Float[mx.array, "*N V"]:
    """The head's distribution over the target vocabulary (softmax over the draft vocab,
    scattered to target ids, zeros elsewhere): the q of exact speculative sampling
    (`speculative.verify_step`'s draft_probs [B, K, V]). Temperature: scale logits first."""
    return _scattered(p, mx.softmax(logits.astype(mx.float32), axis=-1, precise=True), 0.0)


def draft_probs_to_target(p: Eagle3Params, probs: Float[mx.array, "*N Vd"]) -> Float[mx.array, "*N V"]:
    """A distribution over the draft vocabulary (a sampled draft's q) over the target's:
    each draft id's probability at its target id, zero elsewhere."""
    return _scattered(p, probs.astype(mx.float32), 0.0)


# ---------------------------------------------------------------- chained drafting


def head_step(
    p: Eagle3Params, table: Linear | None, hidden: Float[mx.array, "B T Hin"], tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], span: int | None = None,
) -> tuple[Int[mx.array, "B"], Float[mx.array, "B Vd"], Float[mx.array, "B H"], KVCache]:
    """One head step over T pairs per row (hidden: the target's captured states, 3 H_t wide,
    or the head's own previous output, H wide; tokens: the target ids after them), the unit
    an engine drafter chains: the greedy draft (a target id) after each row's last valid pair,
    the draft-vocabulary logits it is the argmax of (a sampled row draws from them:
    `sampled.draw`), the hidden state the next chained step takes (`fed_back` of the one they
    came from) and the cache. Rows with n_valid == 0 are untouched (their outputs meaningless). `table`:
    the target's embedding table (the head's own is used when the checkpoint ships one)."""
    table = p.embed if p.embed is not None else table
    if table is None:
        raise ValueError("head_step: the head has no embedding table of its own: pass the target's")
    n_valid = n_valid.astype(mx.int32)
    h, cache = eagle3_hidden(p, embed(tokens, table).astype(getattr(mx, p.dtype)), hidden, cache, n_valid, span)
    last = mx.maximum(n_valid - 1, 0)[:, None, None]
    hl = mx.take_along_axis(h, last, axis=1)[:, 0]  # (the logits of the last valid pair only:
    lg = draft_logits(p, hl)  # a feed of T pairs pays one head)
    return greedy_target_ids(p, lg), lg, fed_back(p, hl), cache


# the engine's compiled form (keyed on the hidden width, T and span: a few shapes)
head_step_compiled = CompiledFunction(head_step, name="eagle3_head_step")


def draft_chain(
    p: Eagle3Params, table: Linear | None, hidden: Float[mx.array, "B T Hin"], tokens: Int[mx.array, "B T"],
    cache: KVCache, n_valid: Int[mx.array, "B"], k: int, span: int | None = None,
) -> tuple[Int[mx.array, "B K"], Float[mx.array, "B K Vd"], Float[mx.array, "B K H"], KVCache]:
    """K greedy drafts per row: one step over the T new pairs (hidden [B, T, 3 H_t or H] with
    the tokens after them, target ids), then K - 1 chained steps, each feeding the head's own
    output hidden state and its drafted token back (EAGLE's chain: no fc on them). Rows with
    n_valid == 0 stay idle. `table`: the target's embedding table (the head's own is used
    when the checkpoint ships one). span must cover max(lengths) + T + K - 1.

    Returns the drafts as target ids [B, K], the draft-vocab logits each was drawn from
    [B, K, Vd] (for `target_probs`), the hidden states fed back after each [B, K, H] and
    the cache (K - 1 pairs past the new ones: roll it back by length after verification)."""
    table = p.embed if p.embed is not None else table
    if table is None:
        raise ValueError("draft_chain: the head has no embedding table of its own: pass the target's")
    dt = getattr(mx, p.dtype)
    n_valid = n_valid.astype(mx.int32)
    logits, h, cache = eagle3_forward(p, embed(tokens, table).astype(dt), hidden, cache, n_valid, span)
    last = mx.maximum(n_valid - 1, 0)[:, None, None]  # each row's last valid pair
    lg, hl = mx.take_along_axis(logits, last, axis=1)[:, 0], mx.take_along_axis(h, last, axis=1)[:, 0]
    active = (n_valid > 0).astype(mx.int32)
    ids, lgs, hs = [], [], []
    for j in range(k):
        tok = greedy_target_ids(p, lg)
        ids.append(tok)
        lgs.append(lg)
        hs.append(hl)
        if j == k - 1:
            break
        logits, h, cache = eagle3_forward(p, embed(tok[:, None], table).astype(dt), hl[:, None], cache, active, span)
        lg, hl = logits[:, 0], h[:, 0]
    return mx.stack(ids, axis=1), mx.stack(lgs, axis=1), mx.stack(hs, axis=1), cache


# ---------------------------------------------------------------- checkpoints


# The published tensor names (EAGLE's cnets.Model state dict, as SpecForge writes it too):
# the layer under `midlayer.`, fc, norm and lm_head at the top level. q|k|v and gate|up are
# read apart and fused (`checkpoint.read_tensors`).
LAYER = "midlayer."
_LAYER_TABLE = (
    Vec("input_norm", "input_layernorm.weight", "hidden_size"),
    Vec("hidden_norm", "hidden_norm.weight", "hidden_size"),
    Fused("qkv", QKV, "attn_in"),
    Lin("o", "self_attn.o_proj", "hidden_size", "q_width"),
    Vec("mlp_norm", "post_attention_layernorm.weight", "hidden_size"),
    Fused("gate_up", GATE_UP, "hidden_size"),
    Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size"),
)
_TOP_TABLE = (
    Lin("fc", "fc", "hidden_size", "fc_in"),
    Vec("norm", "norm.weight", "hidden_size"),
    Lin("lm_head", "lm_head", "draft_vocab_size", "hidden_size"),
)
# optional: EAGLE trains a frozen copy of the target's and saves none; vLLM loads one when present
_EMBED = "embed_tokens"
_MAPS = ("d2t", "t2d")
# the input norms of heads that set norm_before_fc / fc_norm (speculators' names; SGLang's)
_FC_INPUT_NORM = "input_norm.weight"
_FC_NORMS = tuple(f"fc_norm.{i}.weight" for i in range(3))


def eagle3_params_from_tensors(tensors: Mapping[str, mx.array], cfg: Eagle3Config,
                               opts: LoadOptions | None = None) -> Eagle3Params:
    """Eagle3Params from a head's checkpoint tensors. Accepts the names the references accept:
    EAGLE's (`midlayer.*`), vLLM's (`layers.0.*`) and SGLang's (`model.`-prefixed); an MLX
    quantized linear's `.scales` / `.biases` (with `opts.quant`). d2t may be absent only
    when the draft vocabulary is the target's, t2d always (it follows from d2t).
    A missing, misshapen or unexpected tensor is an error naming it."""
    opts = opts or LoadOptions(dtype=mx.float32, where="EAGLE-3 head")
    named = _canonical_names(tensors, opts.where)
    _check_expected(named, cfg, opts.where)
    src = TensorSource()
    src.add(opts.where, named)
    rd = Reader(src, opts)
    sizes = {"q_width": cfg.num_heads * cfg.head_dim, "kv_width": cfg.num_kv_heads * cfg.head_dim,
             "attn_in": 2 * cfg.hidden_size, "fc_in": cfg.fc_in}
    layer = Eagle3Layer(**read_tensors(rd, _LAYER_TABLE, cfg, LAYER, sizes=sizes))
    top = read_tensors(rd, _TOP_TABLE, cfg, sizes=sizes)
    own = rd.table(_EMBED, cfg.vocab_size, cfg.hidden_size, lookup_only=True) if rd.has(_EMBED + ".weight") else None
    d2t, t2d = _vocab_maps(named, cfg, opts.where)
    fc_input_norm = rd.vec(_FC_INPUT_NORM, cfg.fc_in) if cfg.norm_before_fc else None
    fc_norms = tuple(rd.vec(n, cfg.target_hidden_size) for n in _FC_NORMS) if cfg.fc_norm else None
    return Eagle3Params(layer=layer, **top, d2t=d2t, t2d=t2d, embed=own, fc_input_norm=fc_input_norm,
                        fc_norms=fc_norms, rope_freqs=rope_freqs(cfg),
                        config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


# ---------------------------------------------------------------- llama.cpp's eagle3 GGUF


def config_from_gguf(md: Mapping[str, Any], draft_vocab_size: int, source: str = "GGUF") -> Eagle3Config:
    """An Eagle3Config from the metadata of a head llama.cpp's converter wrote (architecture
    eagle3: the head's one Llama layer under eagle3.*, `eagle3.target_hidden_size`,
    `eagle3.extract_layers` the target layers it reads, `eagle3.norm_before_residual`).
    draft_vocab_size: the output head's rows (the file says it by that tensor's shape)."""
    md = dict(md)
    arch = md.get("general.architecture")
    if arch != "eagle3":
        raise ConfigError(f"{source}: GGUF architecture {arch!r} is not an EAGLE-3 head (eagle3)")

    def val(key: str, default: Any = ...) -> Any:
        return gguf_value(md, "eagle3", key, source, default)

    if "eagle3.extract_layers" not in md:
        raise ConfigError(f"{source}: GGUF metadata 'eagle3.extract_layers' is missing (the target layers the "
                          "head reads)")
    d = gguf_hf_config(md, "eagle3", source, "llama")
    # extract_layers: the boundaries whose stream llama.cpp's graph takes (the input of layer
    # il), written as the target's (2, N // 2, N - 3)
    d.update(draft_vocab_size=int(draft_vocab_size), target_hidden_size=int(val("target_hidden_size")),
             norm_before_residual=bool(val("norm_before_residual", False)),
             eagle_aux_hidden_state_layer_ids=[int(i) for i in md["eagle3.extract_layers"]])
    kind = val("rope.scaling.type", None)
    if kind not in (None, "none"):
        if kind != "linear":  # (llama3's factors travel as the rope_freqs tensor)
            raise ConfigError(f"{source}: eagle3.rope.scaling.type {kind!r} is not supported (linear, or none)")
        d["rope_scaling"] = {"rope_type": "linear", "factor": float(val("rope.scaling.factor"))}
    return attrs.evolve(config_from_hf(d, source), aux_are_boundaries=True)


# llama.cpp's names -> EAGLE's (its LlamaModel converter on a head: the layer as blk.0 with
# hidden_norm as attn_norm_2, q / k rows permuted as for any llama, d2t as absolute target ids)
_GGUF_VECS = {"output_norm.weight": "norm.weight", "blk.0.attn_norm_2.weight": LAYER + "hidden_norm.weight",
              "blk.0.attn_norm.weight": LAYER + "input_layernorm.weight",
              "blk.0.ffn_norm.weight": LAYER + "post_attention_layernorm.weight"}
_GGUF_LINEARS = {"token_embd": _EMBED, "output": "lm_head", "fc": "fc", "blk.0.attn_q": LAYER + "self_attn.q_proj",
                 "blk.0.attn_k": LAYER + "self_attn.k_proj", "blk.0.attn_v": LAYER + "self_attn.v_proj",
                 "blk.0.attn_output": LAYER + "self_attn.o_proj", "blk.0.ffn_gate": LAYER + "mlp.gate_proj",
                 "blk.0.ffn_up": LAYER + "mlp.up_proj", "blk.0.ffn_down": LAYER + "mlp.down_proj"}


def eagle3_params_from_gguf(tensors: Mapping[str, mx.array], cfg: Eagle3Config,
                            opts: LoadOptions | None = None) -> Eagle3Params:
    """Eagle3Params from a head's GGUF tensors (`loading.gguf.read_gguf`'s, llama.cpp's
    names): renamed to EAGLE's, q / k rows unpermuted, d2t's absolute ids back to offsets,
    a llama3 RoPE's rope_freqs factors applied; then read as `eagle3_params_from_tensors`
    reads a folder's. A tensor of another name is an error naming it."""
    opts = opts or LoadOptions(dtype=mx.float32, where="EAGLE-3 head (GGUF)")
    src = TensorSource()
    src.add(opts.where, dict(tensors))
    src = unpermuted_qk(cfg, src)
    named: dict[str, mx.array] = {}
    for name, t in src.tensors.items():
        base, dot, suffix = name.rpartition(".")
        if name in _GGUF_VECS:
            named[_GGUF_VECS[name]] = t
        elif name == "d2t":  # (absolute ids; the checkpoints' d2t is the offset from each draft id)
            named["d2t"] = t.astype(mx.int64) - mx.arange(t.shape[0], dtype=mx.int64)
        elif base in _GGUF_LINEARS and suffix in ("weight", "scales", "biases"):
            named[f"{_GGUF_LINEARS[base]}.{suffix}"] = t
        elif name != "rope_freqs.weight":
            raise WeightsError(f"{opts.where}: unexpected tensor '{name}' for an EAGLE-3 head (llama.cpp's eagle3 "
                               f"names: {', '.join(sorted([*_GGUF_VECS, *(b + '.weight' for b in _GGUF_LINEARS), 'd2t']))})")
    params = eagle3_params_from_tensors(named, cfg, opts)
    if src.has("rope_freqs.weight"):  # the rotation period of pair i is base^(2i/d) * factor_i
        hd = cfg.head_dim
        factors = src.get("rope_freqs.weight", (hd // 2,), opts.where).astype(mx.float32)
        params = attrs.evolve(params, rope_freqs=cfg.rope_theta ** (mx.arange(0, hd, 2) / hd) * factors)
    return params


def _canonical_names(tensors: Mapping[str, mx.array], where: str) -> dict[str, mx.array]:
    """The tensors under EAGLE's names: SGLang's `model.` prefix dropped, vLLM's `layers.0.`
    read as `midlayer.`; RoPE inverse-frequency buffers (derived from the config) dropped.
    Two names for one tensor are an error."""
    out: dict[str, mx.array] = {}
    seen: dict[str, str] = {}
    for name, t in tensors.items():
        new = name[len("model."):] if name.startswith("model.") else name
        if new.startswith("layers.0."):
            new = LAYER + new[len("layers.0."):]
        if new.endswith("rotary_emb.inv_freq"):
            continue
        if new in out:
            raise WeightsError(f"{where}: tensors '{seen[new]}' and '{name}' are both '{new}'")
        out[new], seen[new] = t, name
    return out


def _expected_names() -> tuple[set[str], set[str]]:
    """(every tensor name the tables read, the linears' base names among them)."""
    names, bases = set(), set()
    for prefix, table in ((LAYER, _LAYER_TABLE), ("", _TOP_TABLE)):
        for e in table:
            if isinstance(e, Vec):
                names.add(prefix + e.name)
            else:
                parts = [n for n, _ in e.parts] if isinstance(e, Fused) else [e.name]
                bases.update(prefix + n for n in parts)
    return names | {b + ".weight" for b in bases}, bases | {_EMBED}


def _check_expected(named: dict[str, mx.array], cfg: Eagle3Config, where: str) -> None:
    """Unexpected tensors (another layer, q/k norms, biases, a parallel-drafting mask_hidden,
    input norms the config does not turn on) are an error naming them: the head they belong
    to computes something else."""
    names, bases = _expected_names()
    allowed = names | {_EMBED + ".weight", *_MAPS} | {b + s for b in bases for s in (".scales", ".biases")}
    allowed |= ({_FC_INPUT_NORM} if cfg.norm_before_fc else set()) | (set(_FC_NORMS) if cfg.fc_norm else set())
    unexpected = sorted(set(named) - allowed)
    if unexpected:
        raise WeightsError(f"{where}: unexpected tensor(s) for an EAGLE-3 head: {', '.join(map(repr, unexpected))}")


def _vocab_maps(named: dict[str, mx.array], cfg: Eagle3Config, where: str) -> tuple[mx.array, mx.array]:
    """(d2t int64 [Vd], t2d bool [V]), checked against each other: every draft id maps to a
    distinct target id, and t2d marks exactly those."""
    dv, v = cfg.draft_vocab_size, cfg.vocab_size
    if "d2t" not in named and dv != v:
        raise WeightsError(f"{where}: missing tensor 'd2t' (draft_vocab_size {dv} != vocab_size {v})")
    d2t = named.get("d2t", mx.zeros((dv,), mx.int64))
    if tuple(d2t.shape) != (dv,) or not mx.issubdtype(d2t.dtype, mx.integer):
        raise WeightsError(f"{where}: tensor 'd2t' is {d2t.dtype} {tuple(d2t.shape)}, expected integers ({dv},)")
    ids = np.arange(dv, dtype=np.int64) + np.array(d2t).astype(np.int64)
    if ids.min() < 0 or ids.max() >= v or len(np.unique(ids)) != dv:
        raise WeightsError(f"{where}: tensor 'd2t' does not map the {dv} draft ids to distinct ids of a "
                           f"{v}-token target vocabulary")
    mask = np.zeros(v, dtype=bool)
    mask[ids] = True
    if "t2d" in named:
        t2d = named["t2d"]
        if tuple(t2d.shape) != (v,) or not np.array_equal(np.array(t2d).astype(bool), mask):
            raise WeightsError(f"{where}: tensor 't2d' ({t2d.dtype} {tuple(t2d.shape)}) does not mark exactly "
                               "the target ids d2t maps to")
    return mx.array(ids - np.arange(dv, dtype=np.int64)), mx.array(mask)
