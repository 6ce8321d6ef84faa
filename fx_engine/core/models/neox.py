"""The GPT-NeoX-style decoders: GPT-NeoX / Pythia (`gpt_neox`), StableLM (`stablelm`) and
Phi-1 / 1.5 / 2 (`phi`), following mlx-lm 0.32's gpt_neox.py, stablelm.py and phi.py (the
parity oracles) and Hugging Face's classes (transformers 5.25) where mlx-lm reads less.

What they share and the Llama decoder lacks: LayerNorms with a bias instead of RMSNorms,
RoPE on the first `partial_rotary_factor` of each head only (half-split pairs; the rest of
the head passes through), and in most releases a parallel block, where attention and MLP
both read the layer's input and join the residual stream together:
- gpt_neox: h + attn(ln1(h)) + mlp(ln2(h)) (use_parallel_residual, the default; else the
  sequential block), the q/k/v projections fused per head in `query_key_value` ([q_h; k_h;
  v_h] for each head h: reordered to q | k | v at load, as llama.cpp's converter does),
  biases on every projection (attention_bias), a GELU MLP (dense_h_to_4h / dense_4h_to_h:
  hidden_act "gelu" is the erf form, as Hugging Face runs Pythia; mlx-lm always runs the
  tanh form), an untied head `embed_out`. RoPE's base and fraction under their old names
  rotary_emb_base / rotary_pct.
- phi: h + attn(ln(h)) + mlp(ln(h)), one LayerNorm per layer; biases on every projection
  and on the head; the o projection is `dense`; a GELU MLP fc1 / fc2 (gelu_new: tanh).
- stablelm: sequential blocks (or parallel with one norm: use_parallel_residual, StableLM 2
  12B), a SwiGLU MLP without biases, q/k/v biases where use_qkv_bias (StableLM 2 1.6B), and
  LayerNorms over each head of q and k with a weight per head (qk_layernorm; no bias).
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

import fx_engine.core.models.llama as llama
from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry
from fx_engine.core.checkpoint import (GGUF_COMMON_NAMES, Embedding, Fused, Lin, LoadOptions, Norm, Reader,
                                       TensorSource, TensorSpec, Vec, WeightsError, read_tensors, renamed)
from fx_engine.core.config import (BOOL, FLOAT, INT, MAYBE_BOOL, ConfigError, Field, Same, check_rope_scaling,
                                   gguf_hf_config, gguf_value, positive_int, read_fields, token_ids)
from fx_engine.core.models.blocks import GATE_UP, QKV, attention_sizes, config_rope, head_norm_attention, swiglu_mlp
from fx_engine.core.models.family import Family
from fx_engine.core.models.llama import LlamaConfig
from fx_engine.core.nn import Linear, Numerics, gelu, gelu_tanh, layer_norm, linear
from fx_engine.core.splits import shard_decoder

#: Hugging Face's activations these models run: the exact GELU, or its tanh form (gelu_new,
#: gelu_pytorch_tanh and gelu_fast are the same function, written three ways)
_GELUS = {"gelu": "erf", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}


@attrs.frozen
class NeoxConfig(LlamaConfig):
    """Llama's config (rms_norm_eps is the LayerNorms' eps; q/k/v, o and MLP biases) and
    what these blocks add."""

    rope_dims: int = 0  # rotated dims at the start of each head (head_dim * partial_rotary_factor)
    # "" sequential; "one_norm": attention and MLP read one LayerNorm's output (phi,
    # stablelm); "two_norms": each its own LayerNorm of the layer input (gpt_neox)
    parallel: str = ""
    gelu: str = ""  # the MLP: "" SwiGLU (stablelm); "erf" | "tanh": fc, that GELU, proj
    head_bias: bool = False  # phi's lm_head has a bias
    qk_layernorm: bool = False  # stablelm: LayerNorms over each head of q and k, a weight per head


# Each model type's config.json fields (`read_fields`) with its configuration class's
# defaults, by NeoxConfig's names; the sizes are required
_SIZES = (
    Field("hidden_size"), Field("num_attention_heads", to="num_heads"), Field("num_hidden_layers", to="num_layers"),
    Field("vocab_size"), Field("intermediate_size"),
    Field("layer_norm_eps", FLOAT, 1e-5, null_default=True, to="rms_norm_eps"),
    Field("tie_word_embeddings", MAYBE_BOOL, None),
)
_FIELDS = {
    "phi": (Field("num_attention_heads", to="num_heads"),
            Field("num_key_value_heads", default=Same("num_heads"), null_default=True, to="num_kv_heads"),
            Field("max_position_embeddings", INT, 2048, null_default=True)),
    "stablelm": (Field("num_key_value_heads", default=32, null_default=True, to="num_kv_heads"),
                 Field("max_position_embeddings", INT, 4096, null_default=True),
                 Field("use_qkv_bias", BOOL, False, to="qkv_bias"), Field("qk_layernorm", BOOL, False),
                 Field("use_parallel_residual", BOOL, False)),
    "gpt_neox": (Field("max_position_embeddings", INT, 2048, null_default=True),
                 Field("use_parallel_residual", BOOL, True), Field("attention_bias", BOOL, True)),
}
_ACT_DEFAULT = {"phi": "gelu_new", "stablelm": "silu", "gpt_neox": "gelu"}
_ROTARY_DEFAULT = {"phi": 0.5, "stablelm": 0.25, "gpt_neox": 0.25}


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> NeoxConfig:
    """A NeoxConfig from a config.json dict (after `hf_config.normalize`); refuses what these
    blocks cannot run, naming the field."""
    mt = d["model_type"]
    f = {**read_fields(d, _SIZES, source), **read_fields(d, _FIELDS[mt], source)}
    hidden, heads = f["hidden_size"], f["num_heads"]
    kv = f.setdefault("num_kv_heads", heads)  # (GPT-NeoX has no grouped heads)
    if hidden % heads or heads % kv:
        raise ConfigError(f"{source}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}), "
                          f"and that of num_key_value_heads ({kv})")
    head_dim = hidden // heads
    act = d.get("hidden_act", _ACT_DEFAULT[mt])
    if mt == "stablelm" and act not in ("silu", "swish"):
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for stablelm (its MLP is SwiGLU)")
    if mt != "stablelm" and act not in _GELUS:
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported for {mt} (supported: {', '.join(_GELUS)})")
    if mt == "phi" and d.get("qk_layernorm"):
        raise ConfigError(f"{source}: field 'qk_layernorm' = true is not supported for phi (no released Phi "
                          "model has it; mlx-lm's phi neither)")
    frac, theta = d.get("partial_rotary_factor", _ROTARY_DEFAULT[mt]), d.get("rope_theta", 10_000.0)
    if mt == "gpt_neox":  # GPTNeoXConfig's own order: rope_parameters (rope_scaling), then the old names
        given = d.get("rope_scaling") or d.get("rope_parameters") or {}
        frac = given.get("partial_rotary_factor", d.get("rotary_pct", _ROTARY_DEFAULT[mt]))
        theta = given.get("rope_theta", d.get("rotary_emb_base", 10_000.0))
    rope_dims = int(head_dim * frac) if isinstance(frac, (int, float)) and not isinstance(frac, bool) else -1
    if not 0 < rope_dims <= head_dim or rope_dims % 2:
        raise ConfigError(f"{source}: field 'partial_rotary_factor' = {frac!r} must rotate an even, positive "
                          f"number of the head's {head_dim} dims")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ConfigError(f"{source}: field 'rope_theta' must be a positive number, got {theta!r}")
    parallel = f.pop("use_parallel_residual", mt == "phi")
    bias = f.pop("attention_bias", mt == "phi")
    bos, eos = token_ids(d)
    return NeoxConfig(
        model_type=mt, **{"qkv_bias": bias, **f}, head_dim=head_dim, rope_theta=float(theta),
        rope_scaling=check_rope_scaling(d.get("rope_scaling"), source), o_bias=bias, mlp_bias=mt != "stablelm",
        rope_dims=rope_dims, parallel=("" if not parallel else "two_norms" if mt == "gpt_neox" else "one_norm"),
        gelu="" if mt == "stablelm" else _GELUS[act], head_bias=mt == "phi", bos_token_id=bos, eos_token_ids=eos,
    )


@attrs.frozen
class NeoxLayer:
    attn_norm: tuple[mx.array, mx.array | None]  # LayerNorm weight, bias
    qkv: Linear  # q | k | v rows
    o: Linear
    mlp_norm: tuple[mx.array, mx.array | None] | None = None  # None: the one norm feeds both branches
    fc: Linear | None = None  # GELU MLP
    proj: Linear | None = None
    gate_up: Linear | None = None  # SwiGLU MLP
    down: Linear | None = None
    q_norm: mx.array | None = None  # [heads, head_dim] (stablelm's qk_layernorm)
    k_norm: mx.array | None = None  # [kv_heads, head_dim]


@attrs.frozen
class NeoxParams(llama.Params):
    """The Llama family's params pytree with NeoxLayers; norm is (weight, bias)."""


def _mlp(cfg: NeoxConfig, lp: NeoxLayer, x: mx.array, num: Numerics) -> mx.array:
    if not cfg.gelu:
        return swiglu_mlp(x, lp.gate_up, lp.down, num)
    act = gelu_tanh if cfg.gelu == "tanh" else gelu
    return linear(act(linear(x, lp.fc, num)), lp.proj, num)


def _layer(p: NeoxParams, lp: NeoxLayer, h: mx.array, entry: Any, spec: LayerSpec, rope: tuple,
           geo: StepGeometry) -> tuple[mx.array, Any]:
    cfg, num = p.config, p.numerics
    eps = cfg.rms_norm_eps
    x = layer_norm(h, *lp.attn_norm, eps)
    a, entry = head_norm_attention(p, lp, x, entry, spec, rope, geo, traditional=False)
    if cfg.parallel:  # both branches read the layer's input
        m = x if lp.mlp_norm is None else layer_norm(h, *lp.mlp_norm, eps)
        return h + a + _mlp(cfg, lp, m, num), entry
    h = h + a
    return h + _mlp(cfg, lp, layer_norm(h, *lp.mlp_norm, eps), num), entry


def _rope(p: NeoxParams, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """RoPE tables over the rotated dims (scaled as the config says)."""
    return config_rope(p.config, positions, getattr(mx, p.dtype), dims=p.config.rope_dims)


def forward(
    p: NeoxParams, cache: KVCache, tokens: Int[mx.array, "B T"], n_valid: Int[mx.array, "B"],
    span: int | None = None,
) -> tuple[Float[mx.array, "B T H"], KVCache]:
    """Same contract as `skeleton.decoder_step` (the Llama decoder with these blocks)."""
    return llama.forward(p, cache, tokens, n_valid, span, rope_fn=_rope, layer_fn=_layer,
                         final_norm=lambda h: layer_norm(h, *p.norm, p.config.rms_norm_eps))


hidden_to_logits = llama.hidden_to_logits


# ------------------------------------------------------------------ checkpoints

# Each model type's tensors, as `read_tensors` tables: a layer's under `_PREFIX`, then the
# whole model's. gpt_neox's are read under mlx-lm's names (its sanitize: model.h.{i}.,
# model.embed_in / embed_out / final_layer_norm), Hugging Face's renamed to them at load,
# and its query_key_value split into the q/k/v parts named here
_NEOX_QKV = (("attention.q_part", "q_width"), ("attention.k_part", "kv_width"), ("attention.v_part", "kv_width"))
_PREFIX = {"phi": "model.layers.{i}.", "stablelm": "model.layers.{i}.", "gpt_neox": "model.h.{i}."}
_LAYER = {
    "phi": (Norm("attn_norm", "input_layernorm"), Fused("qkv", QKV, "hidden_size", bias=True),
            Lin("o", "self_attn.dense", "hidden_size", "q_width", bias=True),
            Lin("fc", "mlp.fc1", "intermediate_size", "hidden_size", bias=True),
            Lin("proj", "mlp.fc2", "hidden_size", "intermediate_size", bias=True)),
    "stablelm": (Norm("attn_norm", "input_layernorm"), Fused("qkv", QKV, "hidden_size", bias="qkv_bias"),
                 Lin("o", "self_attn.o_proj", "hidden_size", "q_width"),
                 Norm("mlp_norm", "post_attention_layernorm", when="sequential"),
                 Fused("gate_up", GATE_UP, "hidden_size"),
                 Lin("down", "mlp.down_proj", "hidden_size", "intermediate_size"),
                 Vec("q_norm", "self_attn.q_layernorm.weight", ("num_heads", "head_dim"), when="qk_layernorm"),
                 Vec("k_norm", "self_attn.k_layernorm.weight", ("num_kv_heads", "head_dim"), when="qk_layernorm")),
    "gpt_neox": (Norm("attn_norm", "input_layernorm"), Fused("qkv", _NEOX_QKV, "hidden_size", bias="qkv_bias"),
                 Lin("o", "attention.dense", "hidden_size", "q_width", bias="o_bias"),
                 Norm("mlp_norm", "post_attention_layernorm"),
                 Lin("fc", "mlp.dense_h_to_4h", "intermediate_size", "hidden_size", bias=True),
                 Lin("proj", "mlp.dense_4h_to_h", "hidden_size", "intermediate_size", bias=True)),
}
_TOP = {
    "phi": (Embedding("embed", "model.embed_tokens", lookup_only="untied"), Norm("norm", "model.final_layernorm"),
            Lin("lm_head", "lm_head", "vocab_size", "hidden_size", bias="head_bias", when="untied")),
    "stablelm": (Embedding("embed", "model.embed_tokens", lookup_only="untied"), Norm("norm", "model.norm"),
                 Lin("lm_head", "lm_head", "vocab_size", "hidden_size", when="untied")),
    "gpt_neox": (Embedding("embed", "model.embed_in", lookup_only="untied"), Norm("norm", "model.final_layer_norm"),
                 Lin("lm_head", "model.embed_out", "vocab_size", "hidden_size", when="untied")),
}
_FUSED_QKV = {"phi": "self_attn.qkv", "stablelm": "self_attn.qkv", "gpt_neox": "attention.query_key_value"}
_HEAD = {"phi": "lm_head", "stablelm": "lm_head", "gpt_neox": "model.embed_out"}
# Hugging Face's GPT-NeoX names -> mlx-lm's
_NEOX_HF = ((r"^gpt_neox\.layers\.", "model.h."), (r"^gpt_neox\.", "model."), (r"^embed_out\.", "model.embed_out."))
_QUANT_PARTS = (".weight", ".bias", ".scales", ".biases")


def _qkv_parts(cfg: NeoxConfig, i: int) -> tuple[tuple[str, int], ...]:
    """Layer i's q, k and v tensor names (as `_LAYER` reads them) and rows."""
    sizes, pre = attention_sizes(cfg), _PREFIX[cfg.model_type].format(i=i)
    return tuple((pre + n, sizes[rows]) for n, rows in (_NEOX_QKV if cfg.model_type == "gpt_neox" else QKV))


def _copy(src: TensorSource) -> TensorSource:
    out = TensorSource()
    out.tensors, out.origin = dict(src.tensors), dict(src.origin)
    return out


def split_qkv(src: TensorSource, name: str, parts: tuple[tuple[str, int], ...], per_head: int = 0) -> TensorSource:
    """`name`'s fused q/k/v rows (weight, bias, quantized scales / biases: whole rows move,
    so quantized rows stay exact) as the tensors `parts` (name, rows), in order: stored
    q | k | v (llama.cpp's attn_qkv), or per head [q_h; k_h; v_h] for each of `per_head`
    heads (GPT-NeoX's query_key_value; its parts are equal)."""
    out = _copy(src)
    total = sum(rows for _, rows in parts)
    for suffix in _QUANT_PARTS:
        if name + suffix not in src.tensors:
            continue
        t, origin = out.tensors.pop(name + suffix), out.origin.pop(name + suffix)
        if t.shape[0] != total:
            raise WeightsError(f"{origin}: '{name}{suffix}' has {t.shape[0]} rows, expected {total} (q, k and v)")
        if per_head:
            rest = t.shape[1:]
            t = t.reshape(per_head, len(parts), total // (per_head * len(parts)), *rest).swapaxes(0, 1)
            t = t.reshape(total, *rest)
        start = 0
        for part, rows in parts:
            out.tensors[part + suffix], out.origin[part + suffix] = t[start : start + rows], origin
            start += rows
    return out


def _stacked_head_norms(src: TensorSource, prefix: str, layers: int, heads: dict[str, int]) -> TensorSource:
    """StableLM's per-head LayerNorm weights (Hugging Face: one module per head,
    `<which>.norms.<h>.weight`) stacked into `<which>.weight` [heads, head_dim], as llama.cpp's
    converter stores them."""
    out = _copy(src)
    for i in range(layers):
        for which, n in heads.items():
            base = prefix.format(i=i) + which
            names = [f"{base}.norms.{h}.weight" for h in range(n)]
            if names[0] in src.tensors:
                out.tensors[base + ".weight"] = mx.stack([src.get(x, None, base) for x in names])
                out.origin[base + ".weight"] = src.origin[names[0]]
    return out


def _read(cfg: NeoxConfig, src: TensorSource, opts: LoadOptions) -> NeoxParams:
    mt = cfg.model_type
    if cfg.tie_word_embeddings is None:  # unsaid: tied exactly when the checkpoint has no head
        cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has(_HEAD[mt] + ".weight"))
    if mt == "phi":  # (tied: Hugging Face's head shares the table, its bias stays a head's)
        cfg = attrs.evolve(cfg, head_bias=src.has("lm_head.bias"))
        if cfg.tie_word_embeddings and cfg.head_bias:
            raise WeightsError(f"{opts.where}: a tied phi head with its own bias (lm_head.bias) is not supported")
    rd, sizes = Reader(src, opts), {**attention_sizes(cfg), "sequential": not cfg.parallel}
    layers = tuple(NeoxLayer(**read_tensors(rd, _LAYER[mt], cfg, _PREFIX[mt], i, sizes))
                   for i in range(cfg.num_layers))
    if mt == "gpt_neox":  # its q/k/v rows were reordered: an adapter's factors read the stored order
        layers = tuple(attrs.evolve(lp, qkv=attrs.evolve(lp.qkv, origin=((
            f"model.h.{i}.attention.query_key_value (its rows are stored per head; fx-engine reorders them)",
            lp.qkv.out_features),))) for i, lp in enumerate(layers))
    return NeoxParams(layers=layers, **read_tensors(rd, _TOP[mt], cfg, sizes=sizes), rope_freqs=None, config=cfg,
                      numerics=opts.numerics, dtype=opts.dtype_name)


def assemble(cfg: NeoxConfig, src: TensorSource, opts: LoadOptions) -> NeoxParams:
    """Params from Hugging Face / mlx-community tensor names."""
    if cfg.model_type == "gpt_neox":
        src = renamed(src, _NEOX_HF)
        for i in range(cfg.num_layers):
            src = split_qkv(src, f"model.h.{i}.attention.query_key_value", _qkv_parts(cfg, i), per_head=cfg.num_heads)
    if cfg.model_type == "stablelm" and cfg.qk_layernorm:
        src = _stacked_head_norms(src, "model.layers.{i}.self_attn.", cfg.num_layers,
                                  {"q_layernorm": cfg.num_heads, "k_layernorm": cfg.num_kv_heads})
    return _read(cfg, src, opts)


def checkpoint_layout(cfg: NeoxConfig) -> dict[str, TensorSpec]:
    """The Hugging Face checkpoint's tensors (LayerNorm weights near 1)."""
    h, hd, ff, v, mt = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.model_type
    hq, hk = cfg.num_heads * hd, cfg.num_kv_heads * hd
    pre, embed, final, head = {
        "phi": ("model.layers.{i}.", "model.embed_tokens", "model.final_layernorm", "lm_head"),
        "stablelm": ("model.layers.{i}.", "model.embed_tokens", "model.norm", "lm_head"),
        "gpt_neox": ("gpt_neox.layers.{i}.", "gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out"),
    }[mt]
    if mt == "gpt_neox":
        lins = [("attention.query_key_value", hq + 2 * hk, h, cfg.qkv_bias), ("attention.dense", h, hq, cfg.o_bias),
                ("mlp.dense_h_to_4h", ff, h, True), ("mlp.dense_4h_to_h", h, ff, True)]
    else:
        o = "self_attn.dense" if mt == "phi" else "self_attn.o_proj"
        lins = [("self_attn.q_proj", hq, h, cfg.qkv_bias), ("self_attn.k_proj", hk, h, cfg.qkv_bias),
                ("self_attn.v_proj", hk, h, cfg.qkv_bias), (o, h, hq, cfg.o_bias)]
        lins += ([("mlp.fc1", ff, h, True), ("mlp.fc2", h, ff, True)] if mt == "phi" else
                 [("mlp.gate_proj", ff, h, False), ("mlp.up_proj", ff, h, False), ("mlp.down_proj", h, ff, False)])
    norms = ["input_layernorm"] + ([] if cfg.parallel == "one_norm" else ["post_attention_layernorm"])
    out = {embed + ".weight": TensorSpec((v, h), scale=0.5)}
    for i in range(cfg.num_layers):
        p = pre.format(i=i)
        for n, rows, cols, bias in lins:
            out[p + n + ".weight"] = TensorSpec((rows, cols))
            if bias:
                out[p + n + ".bias"] = TensorSpec((rows,), scale=0.05)
        for n in norms:
            out[p + n + ".weight"] = TensorSpec((h,), center=1.0, scale=0.1)
            out[p + n + ".bias"] = TensorSpec((h,), scale=0.05)
        if cfg.qk_layernorm:
            for which, heads in (("q_layernorm", cfg.num_heads), ("k_layernorm", cfg.num_kv_heads)):
                for j in range(heads):
                    out[f"{p}self_attn.{which}.norms.{j}.weight"] = TensorSpec((hd,), center=1.0, scale=0.1)
    out[final + ".weight"] = TensorSpec((h,), center=1.0, scale=0.1)
    out[final + ".bias"] = TensorSpec((h,), scale=0.05)
    if cfg.tie_word_embeddings is False:
        out[head + ".weight"] = TensorSpec((v, h), scale=0.2)
        if cfg.head_bias:
            out[head + ".bias"] = TensorSpec((v,), scale=0.05)
    return out


_TINY = {
    "phi": {"architectures": ["PhiForCausalLM"], "num_key_value_heads": 2, "partial_rotary_factor": 0.5,
            "rope_theta": 10000.0, "hidden_act": "gelu_new"},
    "stablelm": {"architectures": ["StableLmForCausalLM"], "num_key_value_heads": 2, "partial_rotary_factor": 0.25,
                 "rope_theta": 10000.0, "use_qkv_bias": True, "qk_layernorm": False, "use_parallel_residual": False,
                 "hidden_act": "silu"},
    # (RoPE's settings under their old names alone: GPTNeoXConfig reads no top-level
    # rope_theta. mlx-lm's gpt_neox runs the tanh GELU and a 4 x hidden MLP whatever the
    # config says; Pythia's hidden_act "gelu" is the erf form: tests/models/test_neox.py)
    "gpt_neox": {"architectures": ["GPTNeoXForCausalLM"], "intermediate_size": 256, "rotary_pct": 0.25,
                 "rotary_emb_base": 10000, "use_parallel_residual": True, "hidden_act": "gelu_new"},
}


def tiny_config(model_type: str, overrides: dict[str, Any]) -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
            "num_attention_heads": 4, "layer_norm_eps": 1e-5, "vocab_size": 384, "max_position_embeddings": 2048,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **_TINY[model_type], **overrides}


# ------------------------------------------------------------------ GGUF

# llama.cpp's architectures -> the model types, and each one's names -> the names read above
_ARCHS = {"phi2": "phi", "stablelm": "stablelm", "gptneox": "gpt_neox"}
_GGUF_TO_HF = {
    "phi": ((r"\.attn_norm\.", ".input_layernorm."), (r"\.attn_qkv\.", ".self_attn.qkv."),
            (r"\.attn_output\.", ".self_attn.dense."),
            (r"\.ffn_up\.", ".mlp.fc1."), (r"\.ffn_down\.", ".mlp.fc2."), (r"^output_norm\.", "model.final_layernorm."),
            ) + GGUF_COMMON_NAMES,
    "stablelm": ((r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
                 (r"\.attn_qkv\.", ".self_attn.qkv."), (r"\.attn_q_norm\.", ".self_attn.q_layernorm."),
                 (r"\.attn_k_norm\.", ".self_attn.k_layernorm."),
                 ) + GGUF_COMMON_NAMES,
    "gpt_neox": ((r"^blk\.(\d+)\.", r"model.h.\1."), (r"\.attn_norm\.", ".input_layernorm."),
                 (r"\.attn_qkv\.", ".attention.query_key_value."),
                 (r"\.attn_output\.", ".attention.dense."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
                 (r"\.ffn_up\.", ".mlp.dense_h_to_4h."), (r"\.ffn_down\.", ".mlp.dense_4h_to_h."),
                 (r"^token_embd\.", "model.embed_in."), (r"^output_norm\.", "model.final_layer_norm."),
                 (r"^output\.", "model.embed_out.")),
}


def assemble_gguf(cfg: NeoxConfig, src: TensorSource, opts: LoadOptions) -> NeoxParams:
    """From llama.cpp's names: its attn_qkv is q | k | v already (the converter reordered
    GPT-NeoX's heads); biases, StableLM's second norm (a sequential block) and its q/k
    norms where the file has them, as llama.cpp decides by the tensors."""
    mt = cfg.model_type
    fixed = renamed(src, _GGUF_TO_HF[mt])
    for i in range(cfg.num_layers):  # (phi2 files may hold q, k and v apart: then nothing to split)
        fixed = split_qkv(fixed, _PREFIX[mt].format(i=i) + _FUSED_QKV[mt], _qkv_parts(cfg, i))
    if mt == "stablelm":
        cfg = attrs.evolve(cfg, qkv_bias=src.has("blk.0.attn_q.bias"), qk_layernorm=src.has("blk.0.attn_q_norm.weight"),
                           parallel="" if src.has("blk.0.ffn_norm.weight") else "one_norm")
    if mt == "gpt_neox":
        cfg = attrs.evolve(cfg, qkv_bias=src.has("blk.0.attn_qkv.bias"), o_bias=src.has("blk.0.attn_output.bias"))
    return _read(cfg, fixed, opts)


def config_from_gguf(md: dict[str, Any], source: str) -> NeoxConfig:
    """From llama.cpp's phi2 / stablelm / gptneox metadata (LayerNorm eps, the rotated dims;
    GPT-NeoX's parallel residual). llama.cpp runs phi2's GELU in the tanh form, as Phi's
    gelu_new; Pythia's is read as its config's exact GELU (llama.cpp's tanh form differs by
    < 1e-3 per activation)."""
    arch = md.get("general.architecture")
    mt = _ARCHS[arch]
    d = gguf_hf_config(md, arch, source, mt, context=2048)
    hd = d.pop("head_dim", None) or d["hidden_size"] // d["num_attention_heads"]
    rot = positive_int(int(gguf_value(md, arch, "rope.dimension_count", source, hd)), f"{arch}.rope.dimension_count",
                       source)
    d.update(layer_norm_eps=d.pop("rms_norm_eps"), partial_rotary_factor=rot / hd, tie_word_embeddings=None)
    if mt == "gpt_neox":  # (its config's own names for RoPE's settings)
        d.update(use_parallel_residual=bool(gguf_value(md, arch, "use_parallel_residual", source, True)),
                 hidden_act="gelu", rotary_emb_base=d.pop("rope_theta"), rotary_pct=d.pop("partial_rotary_factor"))
        d.pop("num_key_value_heads")
    if mt == "phi":
        d["hidden_act"] = "gelu_new"
    return config_from_hf(d, source)


FAMILY = Family(
    name="neox", model_types=("gpt_neox", "stablelm", "phi"), config_type=NeoxConfig, params_type=NeoxParams,
    config_from_hf=config_from_hf, assemble=assemble, cache_specs=llama.cache_specs, forward=forward,
    hidden_to_logits=hidden_to_logits, checkpoint_layout=checkpoint_layout, tensor_split=shard_decoder,
    layer_range=llama.layer_range, tiny_config=tiny_config,
    gguf_architectures=tuple(_ARCHS), config_from_gguf=config_from_gguf, assemble_gguf=assemble_gguf,
)
