"""Load weights into the pure params pytree: GGUF, HF safetensors folders, MLX-quantized folders.

Shell-side code (files), producing core data (frozen pytrees). Every error names the file
and, where there is one, the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
from typing import Any, Callable, Union

import mlx.core as mx

from fx_engine.core.config import (MULTIMODAL_WRAPPERS, ConfigError, GemmaConfig, ModelConfig, config_from_gguf, config_from_hf)
from fx_engine.core.models.gemma import GemmaLayer, GemmaParams, MoEBlock
from fx_engine.core.models.llama import LayerParams, Params
from fx_engine.core.nn import Linear, Numerics


class WeightsError(ValueError):
    """Missing, malformed or mismatched weights; the message names file and tensor."""


# ----------------------------------------------------------------------------- reading


def _mx_load(path: Path, **kw: Any) -> Any:
    try:
        return mx.load(str(path), **kw)
    except Exception as e:  # mlx raises RuntimeError/ValueError with terse messages
        raise WeightsError(f"{path}: cannot read weights ({e}); is the file truncated or corrupt?") from e


class _TensorSource:
    """Named tensors from one or several files, remembering which file holds which."""

    def __init__(self) -> None:
        self.tensors: dict[str, mx.array] = {}
        self.origin: dict[str, str] = {}

    def add(self, path: Path, tensors: dict[str, mx.array]) -> None:
        for name, t in tensors.items():
            self.tensors[name] = t
            self.origin[name] = str(path)

    def has(self, name: str) -> bool:
        return name in self.tensors

    def get(self, name: str, shape: tuple[int, ...] | None = None, where: str = "") -> mx.array:
        if name not in self.tensors:
            raise WeightsError(f"{where or 'model'}: missing tensor '{name}'")
        t = self.tensors[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise WeightsError(
                f"{self.origin[name]}: tensor '{name}' has shape {tuple(t.shape)}, "
                f"expected {tuple(shape)}"
            )
        return t


# ------------------------------------------------------------------------- linear layers


def _read_linear(
    src: _TensorSource, prefix: str, out_f: int, in_f: int, quant: dict | None,
    bias: bool, where: str, weight_suffix: str = ".weight", bias_name: str | None = None,
) -> Linear:
    w_name = prefix + weight_suffix
    base = prefix
    if not src.has(w_name):
        raise WeightsError(f"{where}: missing tensor '{w_name}'")
    w = src.tensors[w_name]
    b = None
    if bias:
        b = src.get(bias_name or (prefix + ".bias"), (out_f,), where)
    scales_name = base + ".scales"
    if src.has(scales_name):
        if w.dtype != mx.uint32:
            raise WeightsError(f"{src.origin[w_name]}: '{w_name}' has scales but dtype {w.dtype}")
        scales = src.tensors[scales_name]
        biases = src.get(base + ".biases", tuple(scales.shape), where)
        if quant is not None:
            gs, bits = int(quant["group_size"]), int(quant["bits"])
        else:  # infer from shapes (GGUF: group 32)
            gs = in_f // scales.shape[1]
            bits = w.shape[1] * 32 // in_f
        if w.shape != (out_f, in_f * bits // 32) or scales.shape != (out_f, in_f // gs):
            raise WeightsError(
                f"{src.origin[w_name]}: quantized tensor '{w_name}' has shape {tuple(w.shape)} "
                f"(scales {tuple(scales.shape)}), expected ({out_f}, {in_f * bits // 32}) for "
                f"{bits}-bit group {gs} of a [{out_f}, {in_f}] matrix"
            )
        return Linear(weight=w, bias=b, scales=scales, biases=biases, group_size=gs, bits=bits)
    if tuple(w.shape) != (out_f, in_f):
        raise WeightsError(
            f"{src.origin[w_name]}: tensor '{w_name}' has shape {tuple(w.shape)}, "
            f"expected {(out_f, in_f)}"
        )
    return Linear(weight=w, bias=b)


def _dequantized(lin: Linear, dtype: mx.Dtype) -> Linear:
    if not lin.quantized:
        return Linear(weight=lin.weight.astype(dtype), bias=_cast(lin.bias, dtype))
    w = mx.dequantize(
        lin.weight, lin.scales.astype(dtype), lin.biases.astype(dtype),
        group_size=lin.group_size, bits=lin.bits,
    ).astype(dtype)
    return Linear(weight=w, bias=_cast(lin.bias, dtype))


KeepQuantized = Union[bool, Callable[[int, int], bool]]


def _keep(policy: KeepQuantized, lin: Linear) -> bool:
    """Whether a quantized linear stays quantized: a bool, or a predicate on (group_size,
    bits) (e.g. "the native CPU kernels support this format")."""
    if not lin.quantized:
        return False
    return bool(policy(lin.group_size, lin.bits)) if callable(policy) else bool(policy)


def _cast(x: mx.array | None, dtype: mx.Dtype) -> mx.array | None:
    return None if x is None else x.astype(dtype)


def _fuse(parts: list[Linear], dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    """Concatenate linears along the output axis (exact for dense and affine-quantized)."""
    same_q = all(p.quantized for p in parts) and len(
        {(p.group_size, p.bits) for p in parts}
    ) == 1
    if same_q and _keep(keep_quantized, parts[0]):
        cat = lambda xs: mx.concatenate(xs, axis=0)  # noqa: E731
        return Linear(
            weight=cat([p.weight for p in parts]),
            bias=None if parts[0].bias is None else cat([p.bias.astype(dtype) for p in parts]),
            scales=cat([p.scales.astype(dtype) for p in parts]),
            biases=cat([p.biases.astype(dtype) for p in parts]),
            group_size=parts[0].group_size, bits=parts[0].bits,
        )
    dense = [_dequantized(p, dtype) for p in parts]
    return _finish(Linear(
        weight=mx.concatenate([p.weight for p in dense], axis=0),
        bias=None if dense[0].bias is None else mx.concatenate([p.bias for p in dense]),
    ), dtype, keep_quantized)


def _finish(lin: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized, table: bool = False) -> Linear:
    """Final representation: quantized kept as is, or dense; dense matmul-only weights are
    stored transposed ([in, out]); embedding tables (`table`) stay [vocab, hidden]."""
    if _keep(keep_quantized, lin):
        return Linear(
            weight=lin.weight, bias=_cast(lin.bias, dtype), scales=lin.scales.astype(dtype),
            biases=lin.biases.astype(dtype), group_size=lin.group_size, bits=lin.bits,
        )
    dense = _dequantized(lin, dtype)
    if table:
        return dense
    return Linear(weight=mx.contiguous(dense.weight.T), bias=dense.bias, transposed=True)


# --------------------------------------------------------------------------- assembling


_HF_NAMES = {
    "embed": "model.embed_tokens", "norm": "model.norm.weight", "lm_head": "lm_head",
    "layer": "model.layers.{i}.",
    "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
    "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj",
    "up": "mlp.up_proj", "down": "mlp.down_proj",
}
_GGUF_NAMES = {
    "embed": "token_embd", "norm": "output_norm.weight", "lm_head": "output",
    "layer": "blk.{i}.",
    "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "attn_norm": "attn_norm.weight", "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down",
}


def _quant_for(quant: dict | None, module: str) -> dict | None:
    """mlx-community quantization config: global group_size/bits, optional per-module overrides."""
    if not quant:
        return None
    override = quant.get(module)
    if isinstance(override, dict):
        return override
    return {"group_size": quant["group_size"], "bits": quant["bits"]}


def assemble_params(
    cfg: ModelConfig, src: _TensorSource, names: dict[str, str], where: str,
    quant: dict | None, dtype: mx.Dtype, keep_quantized: KeepQuantized, numerics: Numerics,
) -> Params:
    hid, hd = cfg.hidden_size, cfg.head_dim
    hq, hk, ff = cfg.num_heads * hd, cfg.num_kv_heads * hd, cfg.intermediate_size

    def lin(name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        return _read_linear(src, name, out_f, in_f, _quant_for(quant, name), bias, where)

    def vec(name: str, n: int) -> mx.array:
        return src.get(name, (n,), where).astype(dtype)

    layers = []
    for i in range(cfg.num_layers):
        pre = names["layer"].format(i=i)
        q = lin(pre + names["q"], hq, hid, cfg.qkv_bias)
        k = lin(pre + names["k"], hk, hid, cfg.qkv_bias)
        v = lin(pre + names["v"], hk, hid, cfg.qkv_bias)
        layers.append(
            LayerParams(
                attn_norm=vec(pre + names["attn_norm"], hid),
                qkv=_fuse([q, k, v], dtype, keep_quantized),
                o=_finish(lin(pre + names["o"], hid, hq, cfg.o_bias), dtype, keep_quantized),
                mlp_norm=vec(pre + names["mlp_norm"], hid),
                gate_up=_fuse(
                    [lin(pre + names["gate"], ff, hid, cfg.mlp_bias),
                     lin(pre + names["up"], ff, hid, cfg.mlp_bias)], dtype, keep_quantized,
                ),
                down=_finish(lin(pre + names["down"], hid, ff, cfg.mlp_bias), dtype, keep_quantized),
                q_norm=vec(pre + names["q_norm"], hd) if cfg.qk_norm else None,
                k_norm=vec(pre + names["k_norm"], hd) if cfg.qk_norm else None,
            )
        )
    embed = _finish(lin(names["embed"], cfg.vocab_size, hid), dtype, keep_quantized, table=True)
    lm_head = None
    if not cfg.tie_word_embeddings:
        lm_head = _finish(lin(names["lm_head"], cfg.vocab_size, hid), dtype, keep_quantized)
    return Params(
        embed=embed, layers=tuple(layers), norm=vec(names["norm"], hid), lm_head=lm_head,
        rope_freqs=llama3_rope_freqs(cfg), config=cfg, numerics=numerics,
        dtype=str(dtype).split(".")[-1],
    )


def assemble_gemma(
    cfg: GemmaConfig, src: _TensorSource, where: str, quant: dict | None, dtype: mx.Dtype,
    keep_quantized: KeepQuantized, numerics: Numerics,
) -> GemmaParams:
    """Gemma 3 / Gemma 4 text weights under mlx-lm's (= Hugging Face's) names. Gemma 3's
    norms are stored as (1 + weight): the 1 is folded in here (in float32, as mlx-lm adds it
    to float32 weights). Projections of KV-shared layers, rotary buffers and activation
    clipping ranges in a checkpoint are unused (mlx-lm drops them too)."""
    hid = cfg.hidden_size
    offset = 0.0 if cfg.is_gemma4 else 1.0

    def lin(name: str, out_f: int, in_f: int) -> Linear:
        return _read_linear(src, name, out_f, in_f, _quant_for(quant, name), False, where)

    def norm(name: str, n: int) -> mx.array:
        return (src.get(name, (n,), where).astype(mx.float32) + offset).astype(dtype)

    def fin(x: Linear) -> Linear:
        return _finish(x, dtype, keep_quantized)

    layers = []
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        d, hk, hq = cfg.layer_head_dim(i), cfg.layer_kv_heads(i), cfg.num_heads * cfg.layer_head_dim(i)
        ff = cfg.layer_intermediate(i)
        own_kv = cfg.kv_source(i) == i
        parts = [lin(pre + "self_attn.q_proj", hq, hid)]
        if own_kv:
            parts.append(lin(pre + "self_attn.k_proj", hk * d, hid))
            if not cfg.k_eq_v(i):
                parts.append(lin(pre + "self_attn.v_proj", hk * d, hid))
        extra = {}
        if cfg.hidden_size_per_layer_input:
            hpl = cfg.hidden_size_per_layer_input
            extra = dict(
                pli_gate=fin(lin(pre + "per_layer_input_gate", hpl, hid)),
                pli_proj=fin(lin(pre + "per_layer_projection", hid, hpl)),
                pli_norm=norm(pre + "post_per_layer_input_norm.weight", hid),
            )
        if cfg.is_gemma4:
            extra["layer_scalar"] = src.get(pre + "layer_scalar", (1,), where).astype(dtype)
        if cfg.num_experts:
            extra["moe"] = _read_moe(cfg, src, pre, where, quant, dtype, keep_quantized, norm)
        layers.append(GemmaLayer(
            attn_norm=norm(pre + "input_layernorm.weight", hid),
            qkv=_fuse(parts, dtype, keep_quantized),
            q_norm=norm(pre + "self_attn.q_norm.weight", d),
            k_norm=norm(pre + "self_attn.k_norm.weight", d) if own_kv else None,
            o=fin(lin(pre + "self_attn.o_proj", hid, hq)),
            post_attn_norm=norm(pre + "post_attention_layernorm.weight", hid),
            pre_ff_norm=norm(pre + "pre_feedforward_layernorm.weight", hid),
            gate_up=_fuse([lin(pre + "mlp.gate_proj", ff, hid), lin(pre + "mlp.up_proj", ff, hid)],
                          dtype, keep_quantized),
            down=fin(lin(pre + "mlp.down_proj", hid, ff)),
            post_ff_norm=norm(pre + "post_feedforward_layernorm.weight", hid),
            **extra,
        ))
    embed = _finish(lin("model.embed_tokens", cfg.vocab_size, hid), dtype, keep_quantized, table=True)
    tied = cfg.tie_word_embeddings if cfg.is_gemma4 else not src.has("lm_head.weight")
    lm_head = None if tied else fin(lin("lm_head", cfg.vocab_size, hid))
    per_layer = {}
    if cfg.hidden_size_per_layer_input:
        width = cfg.num_layers * cfg.hidden_size_per_layer_input
        per_layer = dict(
            embed_per_layer=_finish(lin("model.embed_tokens_per_layer", cfg.vocab_size, width),
                                    dtype, keep_quantized, table=True),
            per_layer_proj=fin(lin("model.per_layer_model_projection", width, hid)),
            per_layer_proj_norm=norm("model.per_layer_projection_norm.weight",
                                     cfg.hidden_size_per_layer_input),
        )
    return GemmaParams(
        embed=embed, layers=tuple(layers), norm=norm("model.norm.weight", hid), lm_head=lm_head,
        **per_layer, config=attrs.evolve(cfg, tie_word_embeddings=tied), numerics=numerics,
        dtype=str(dtype).split(".")[-1],
    )


def _read_expert_stack(
    src: _TensorSource, name: str, e: int, out_f: int, in_f: int, quant: dict | None, where: str,
) -> Linear:
    """A stacked expert weight [E, out, in] (mlx-lm's SwitchLinear), dense or quantized."""
    w = src.get(name + ".weight", None, where)
    if src.has(name + ".scales"):
        scales = src.get(name + ".scales", None, where)
        q = quant or {}
        gs = int(q.get("group_size", in_f // scales.shape[-1]))
        bits = int(q.get("bits", w.shape[-1] * 32 // in_f))
        want = (e, out_f, in_f * bits // 32)
        if tuple(w.shape) != want or tuple(scales.shape) != (e, out_f, in_f // gs):
            raise WeightsError(f"{src.origin[name + '.weight']}: quantized expert tensor "
                               f"'{name}.weight' has shape {tuple(w.shape)}, expected {want}")
        return Linear(weight=w, scales=scales, biases=src.get(name + ".biases", tuple(scales.shape), where),
                      group_size=gs, bits=bits)
    if tuple(w.shape) != (e, out_f, in_f):
        raise WeightsError(f"{src.origin[name + '.weight']}: tensor '{name}.weight' has shape "
                           f"{tuple(w.shape)}, expected {(e, out_f, in_f)}")
    return Linear(weight=w)


def _finish_experts(lin: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    # Stacked experts run through mx.gather_qmm, which has no native CPU kernel: only an
    # explicit keep_quantized=True keeps them quantized.
    if lin.quantized and keep_quantized is True:
        return Linear(weight=lin.weight, scales=lin.scales.astype(dtype),
                      biases=lin.biases.astype(dtype), group_size=lin.group_size, bits=lin.bits)
    w = lin.weight
    if lin.quantized:
        w = mx.dequantize(w, lin.scales.astype(dtype), lin.biases.astype(dtype),
                          group_size=lin.group_size, bits=lin.bits)
    return Linear(weight=mx.contiguous(w.astype(dtype).swapaxes(-1, -2)), transposed=True)


def _read_moe(
    cfg: GemmaConfig, src: _TensorSource, pre: str, where: str, quant: dict | None,
    dtype: mx.Dtype, keep_quantized: KeepQuantized, norm: Any,
) -> MoEBlock:
    """Gemma 4 MoE weights, in Hugging Face's layout (experts.gate_up_proj [E, 2F, H],
    experts.down_proj [E, H, F]) or mlx-lm's sanitized one (experts.switch_glu.*_proj)."""
    e, f, hid = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    hf = pre + "experts.gate_up_proj"
    if src.has(hf):
        gate_up = Linear(weight=src.get(hf, (e, 2 * f, hid), where))
        down = Linear(weight=src.get(pre + "experts.down_proj", (e, hid, f), where))
    else:
        sw = pre + "experts.switch_glu."
        parts = [_read_expert_stack(src, sw + n, e, f, hid, _quant_for(quant, sw + n), where)
                 for n in ("gate_proj", "up_proj")]
        down = _read_expert_stack(src, sw + "down_proj", e, hid, f, _quant_for(quant, sw + "down_proj"), where)
        if all(p.quantized for p in parts) and keep_quantized is True:
            cat = lambda xs: mx.concatenate(xs, axis=1)  # noqa: E731
            gate_up = Linear(weight=cat([p.weight for p in parts]), scales=cat([p.scales for p in parts]),
                             biases=cat([p.biases for p in parts]), group_size=parts[0].group_size,
                             bits=parts[0].bits)
        else:
            dense = [_finish_experts(p, dtype, False).weight for p in parts]  # [E, H, F] each
            gate_up = Linear(weight=mx.concatenate(dense, axis=-1), transposed=True)
    scale = src.get(pre + "router.scale", (hid,), where).astype(mx.float32) * hid**-0.5
    return MoEBlock(
        router=_finish(_read_linear(src, pre + "router.proj", e, hid, _quant_for(quant, pre + "router.proj"),
                                    False, where), dtype, keep_quantized),
        router_scale=scale.astype(dtype),
        per_expert_scale=src.get(pre + "router.per_expert_scale", (e,), where).astype(dtype),
        gate_up=gate_up if gate_up.transposed else _finish_experts(gate_up, dtype, keep_quantized),
        down=_finish_experts(down, dtype, keep_quantized),
        pre_norm=norm(pre + "pre_feedforward_layernorm_2.weight", hid),
        post_norm=norm(pre + "post_feedforward_layernorm_2.weight", hid),
        post_mlp_norm=norm(pre + "post_feedforward_layernorm_1.weight", hid),
        top_k=cfg.top_k_experts,
    )


def llama3_rope_freqs(cfg: ModelConfig) -> mx.array | None:
    """Llama-3 frequency scaling, with the same op composition as mlx-lm (on device, f32)."""
    if cfg.rope_type != "llama3":
        return None
    s = dict(cfg.rope_scaling)
    factor = s["factor"]
    low = s.get("low_freq_factor", 1.0)
    high = s.get("high_freq_factor", 4.0)
    old = s.get("original_max_position_embeddings", 8192)
    low_wl, high_wl = old / low, old / high
    dims = cfg.head_dim
    freqs = cfg.rope_theta ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > low_wl, freqs * factor, freqs)
    medium = (wavelens > high_wl) & (wavelens < low_wl)
    smooth = (old / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return mx.where(medium, smooth_freqs, freqs)


# ------------------------------------------------------------------------------ formats


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE -> half-split RoPE).

    The converter maps HF rows with reshape(n_head, 2, hd/2).swapaxes(1, 2); we invert it.
    Whole rows move, so quantized rows (and their scales/biases) stay exact.
    """
    rows = x.shape[0]
    rest = x.shape[1:]
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def load_gguf(
    path: Path, dtype: mx.Dtype, keep_quantized: KeepQuantized, numerics: Numerics
) -> tuple[ModelConfig, Params, dict[str, Any]]:
    tensors, metadata = _mx_load(path, return_metadata=True)
    cfg = config_from_gguf(metadata, str(path))
    tied = "output.weight" not in tensors
    cfg = attrs.evolve(cfg, tie_word_embeddings=tied)
    if cfg.model_type == "llama":
        for i in range(cfg.num_layers):
            for part, heads in (("attn_q", cfg.num_heads), ("attn_k", cfg.num_kv_heads)):
                for suffix in (".weight", ".scales", ".biases", ".bias"):
                    name = f"blk.{i}.{part}{suffix}"
                    if name in tensors:
                        tensors[name] = _unpermute_rows(tensors[name], heads)
    src = _TensorSource()
    src.add(path, tensors)
    params = assemble_params(cfg, src, _GGUF_NAMES, str(path), None, dtype, keep_quantized, numerics)
    if "rope_freqs.weight" in tensors:
        # llama.cpp stores Llama-3 rope scaling as per-frequency factors: the rotation
        # period of pair i is base^(2i/d) * factor_i.
        factors = src.get("rope_freqs.weight", (cfg.head_dim // 2,), str(path)).astype(mx.float32)
        periods = cfg.rope_theta ** (mx.arange(0, cfg.head_dim, 2) / cfg.head_dim) * factors
        params = attrs.evolve(params, rope_freqs=periods)
    return cfg, params, metadata


def read_hf_config(folder: Path) -> tuple[ModelConfig, dict[str, Any]]:
    path = folder / "config.json"
    if not path.exists():
        raise ConfigError(f"{folder}: no config.json (is this a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config_from_hf(raw, str(path)), raw


_TEXT_PREFIXES = (  # multimodal checkpoints: where the text model's tensors live
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("language_model.model.", "model."),  # earlier transformers, mlx-community
    ("language_model.lm_head.", "lm_head."),
)


def _text_model_tensors(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The text model's tensors of a multimodal checkpoint, under text-model names (vision
    and audio towers and projectors are dropped)."""
    out = {}
    for name, t in tensors.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name[len(old):]] = t
                break
        else:
            if name.startswith("lm_head."):
                out[name] = t
    return out


def load_hf_folder(
    folder: Path, dtype: mx.Dtype | None, keep_quantized: KeepQuantized, numerics: Numerics
) -> tuple[ModelConfig, Params, dict[str, Any]]:
    cfg, raw = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder}: no *.safetensors files")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            wanted = set(json.loads(index.read_text())["weight_map"].values())
        except (json.JSONDecodeError, KeyError) as e:
            raise WeightsError(f"{index}: malformed index ({e})") from e
        missing = [f for f in wanted if not (folder / f).exists()]
        if missing:
            raise WeightsError(f"{index}: shard files missing: {', '.join(sorted(missing))}")
    src = _TensorSource()
    stored_dtype = None
    wrapper = isinstance(cfg, GemmaConfig) and raw.get("model_type") in MULTIMODAL_WRAPPERS
    for f in files:
        tensors = _mx_load(f)
        if wrapper:
            tensors = _text_model_tensors(tensors)
        src.add(f, tensors)
        for t in tensors.values():
            if t.dtype in (mx.float16, mx.bfloat16, mx.float32):
                stored_dtype = stored_dtype or t.dtype
    quant = raw.get("quantization") or raw.get("quantization_config")
    if quant and ("group_size" not in quant or "bits" not in quant):
        raise ConfigError(f"{folder / 'config.json'}: quantization needs group_size and bits")
    if "tie_word_embeddings" not in raw and isinstance(cfg, ModelConfig):
        # Configs that do not say: tied unless the checkpoint has its own output head.
        cfg = attrs.evolve(cfg, tie_word_embeddings=not src.has("lm_head.weight"))
    dtype = dtype or stored_dtype or mx.float32
    if isinstance(cfg, GemmaConfig):
        params = assemble_gemma(cfg, src, str(folder), quant, dtype, keep_quantized, numerics)
        return params.config, params, raw
    params = assemble_params(cfg, src, _HF_NAMES, str(folder), quant, dtype, keep_quantized, numerics)
    return cfg, params, raw
