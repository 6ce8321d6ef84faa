"""Mamba-2 (`mamba2`), following mlx-lm 0.32's mamba2.py + ssm.py (the parity oracle).

Every layer is `h = h + mixer(rms_norm(h))` (the block norm with eps 1e-5, as mlx-lm and
Hugging Face's Mamba2 build it, whatever layer_norm_epsilon says); no attention, no MLP.
The mixer (`mixer`, shared with Nemotron-H's Mamba layers):

    z, xBC, dt = split(in_proj(u), [I, I + conv_dim])
    xBC = silu(causal_conv(xBC) + conv_bias);  x, B, C = split(xBC, [I, I + G*N])
    dt = clip(softplus(dt + dt_bias), time_step_limit);  A = -exp(A_log)
    S_t = exp(dt A) S_{t-1} + dt x B^T;  y = S C + D x   (per head; heads share B, C by group)
    out = out_proj(rms_norm(y * silu(z)) * norm)   (per group of I / norm_groups channels)

The cache holds, per layer and row, the conv's last K - 1 inputs (activation dtype) and the
SSM state [H, P, N] (float32): fixed sizes, whatever the context. Prefill runs the chunked
scan (`core.recurrent.ssd_scan`), not a loop over tokens.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, LayerSpec, StepGeometry, advanced, recurrent_entry
from fx_engine.core.checkpoint import LoadOptions, TensorSource, TensorSpec, finish, read_linear
from fx_engine.core.config import BaseConfig, ConfigError, positive_int, required
from fx_engine.core.models.family import DecoderParams, Family, cut_layers, head_logits, stage_input, stage_output
from fx_engine.core.nn import Linear, Numerics, embed, linear, rms_norm
from fx_engine.core.parallel import split_head, split_mixer
from fx_engine.core.recurrent import causal_conv, ssd_scan


@attrs.frozen
class MixerDims:
    """A Mamba-2 mixer's sizes (hashable: static)."""

    hidden: int
    heads: int  # H
    head_dim: int  # P
    groups: int  # G (B and C groups)
    state: int  # N
    kernel: int  # K (conv taps)
    dt_min: float = 0.0
    dt_max: float = math.inf
    norm_eps: float = 1e-5
    norm_groups: int = 1  # the gated norm's groups (Nemotron-H: n_groups; Mamba-2: 1)
    # the output's gate and norm: "gate_norm" (silu(z) then RMSNorm: Mamba-2), "norm_gate"
    # (RMSNorm then silu(z)), "gate" (no norm) (Falcon-H1's options)
    norm_mode: str = "gate_norm"
    # tensor parallelism (core/parallel.split_mixer): the whole mixer's channels when one
    # norm spans them all and this rank holds some (the mean square summed over the ranks)
    norm_width: int = 0

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.groups * self.state

    def state_spec(self) -> LayerSpec:
        return LayerSpec(0, 0, state=((self.kernel - 1, self.conv_dim), (self.heads, self.head_dim, self.state)),
                         state_dtypes=("", "float32"))


@attrs.frozen
class Mamba2Config(BaseConfig):
    mixer: MixerDims = None  # type: ignore[assignment]
    block_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1 << 20  # no positions: only the cache capacity bounds a row
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()


@attrs.frozen
class MixerParams:
    in_proj: Linear
    conv_w: mx.array  # [conv_dim, K]
    conv_b: mx.array | None
    dt_bias: mx.array  # [H]
    a: mx.array  # -exp(A_log) [H], float32
    d: mx.array  # [H]
    norm: mx.array | None  # [I] (None: no norm, norm_mode "gate")
    out_proj: Linear


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


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Mamba2Config:
    hidden = positive_int(required(d, "hidden_size", source), "hidden_size", source)
    heads = positive_int(required(d, "num_heads", source), "num_heads", source)
    groups = positive_int(required(d, "n_groups", source), "n_groups", source)
    if heads % groups:
        raise ConfigError(f"{source}: num_heads ({heads}) is not a multiple of n_groups ({groups})")
    lo, hi = _limits(d, source)
    eps = float(d.get("layer_norm_epsilon", 1e-5))
    mix = MixerDims(hidden=hidden, heads=heads,
                    head_dim=positive_int(required(d, "head_dim", source), "head_dim", source),
                    groups=groups, state=positive_int(d.get("ssm_state_size") or required(d, "state_size", source),
                                                      "state_size", source),
                    kernel=positive_int(required(d, "conv_kernel", source), "conv_kernel", source),
                    dt_min=lo, dt_max=hi, norm_eps=eps)
    if mix.kernel < 2:
        raise ConfigError(f"{source}: conv_kernel must be >= 2")
    eos = d.get("eos_token_id")
    return Mamba2Config(
        model_type="mamba2", vocab_size=positive_int(required(d, "vocab_size", source), "vocab_size", source),
        hidden_size=hidden, num_layers=positive_int(required(d, "num_hidden_layers", source), "num_hidden_layers", source),
        num_heads=heads, num_kv_heads=heads, head_dim=mix.head_dim, intermediate_size=mix.inner,
        rms_norm_eps=eps, mixer=mix, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else (),
    )


def cache_specs(cfg: Mamba2Config) -> tuple[LayerSpec, ...]:
    return tuple(cfg.mixer.state_spec() for _ in range(cfg.num_layers))


def mixer(mp: MixerParams, dims: MixerDims, x: mx.array, entry: Any, spec: LayerSpec, geo: StepGeometry,
          num: Numerics) -> tuple[mx.array, Any]:
    """The Mamba-2 mixer on normalized x [B*T, hidden] -> (out_proj output, entry)."""
    b, t = geo.positions.shape
    i, cd, h = dims.inner, dims.conv_dim, dims.heads
    zxd = linear(x, mp.in_proj, num).reshape(b, t, i + cd + h)
    z, xbc, dt = zxd[..., :i], zxd[..., i : i + cd], zxd[..., i + cd :]
    valid = geo.valid[..., None]
    conv_state, ssm_state = entry.arrays
    conv, conv_new, conv_steps = causal_conv(mx.where(valid, xbc, 0.0), conv_state, mp.conv_w,
                                             geo.n_valid, geo.keep_steps)
    if mp.conv_b is not None:
        conv = conv + mp.conv_b.astype(conv.dtype)
    xbc = conv * mx.sigmoid(conv)  # silu
    gn = dims.groups * dims.state
    xs = xbc[..., :i].reshape(b, t, h, dims.head_dim)
    bm = xbc[..., i : i + gn].reshape(b, t, dims.groups, dims.state)
    cm = xbc[..., i + gn :].reshape(b, t, dims.groups, dims.state)
    dt = mx.logaddexp(dt.astype(mx.float32) + mp.dt_bias.astype(mx.float32), 0.0)  # softplus
    dt = mx.clip(dt, dims.dt_min, dims.dt_max)
    dt = mx.where(geo.valid[..., None], dt, 0.0)  # padding: no decay, no input
    y, ssm_new, ssm_steps = ssd_scan(xs, dt, mp.a, bm, cm, ssm_state, geo.keep_steps)
    y = (y + mp.d.astype(mx.float32)[:, None] * xs.astype(mx.float32)).astype(x.dtype).reshape(b, t, i)
    gate = z * mx.sigmoid(z)
    if dims.norm_mode != "norm_gate":
        y = y * gate  # the gate before the norm
    if dims.norm_mode == "gate":
        pass
    elif dims.norm_groups > 1:  # a norm per group of channels
        y = rms_norm(y.reshape(b, t, dims.norm_groups, i // dims.norm_groups), None, dims.norm_eps)
        y = y.reshape(b, t, i) * mp.norm
    else:
        y = rms_norm(y, mp.norm, dims.norm_eps, width=dims.norm_width or None,
                     group=mp.out_proj.group)
    if dims.norm_mode == "norm_gate":
        y = y * gate
    out = linear(y.reshape(b * t, i), mp.out_proj, num)
    steps = None if conv_steps is None else [conv_steps.astype(conv_state.dtype), ssm_steps]
    return out, recurrent_entry(spec, [conv_new.astype(conv_state.dtype), ssm_new], steps, geo)


def forward(p: Mamba2Params, cache: KVCache, tokens: mx.array, n_valid: mx.array,
            span: int | None = None) -> tuple[mx.array, KVCache]:
    """Same contract as `fx_engine.core.models.llama.forward` (no attention: span unused)."""
    cfg, num = p.config, p.numerics
    b, t = tokens.shape
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    h = stage_input(p, b * t, lambda: embed(tokens.reshape(-1), p.embed).astype(getattr(mx, p.dtype)))
    entries = []
    for lp, entry, spec in zip(p.layers, cache.layers, cache.layout):
        a, entry = mixer(lp.mixer, cfg.mixer, rms_norm(h, lp.norm, cfg.block_norm_eps, num), entry, spec, geo, num)
        h = h + a
        entries.append(entry)
    handed = stage_output(p, h)
    if handed is not None:  # a pipeline stage before the last
        return handed.reshape(b, t, -1), advanced(cache, entries, geo)
    h = rms_norm(h, p.norm, cfg.rms_norm_eps, num)
    return h.reshape(b, t, -1), advanced(cache, entries, geo)


hidden_to_logits = head_logits


def conv_weight(src: TensorSource, name: str, channels: int, k: int, where: str) -> mx.array:
    """A depthwise conv weight as [channels, K]: Hugging Face stores [C, 1, K], mlx-lm [C, K, 1]."""
    w = src.get(name, None, where)
    if tuple(w.shape) == (channels, 1, k):
        return w[:, 0, :]
    if tuple(w.shape) == (channels, k, 1):
        return w[:, :, 0]
    raise ConfigError(f"{where}: {name} has shape {tuple(w.shape)}, expected ({channels}, 1, {k}) "
                      f"or ({channels}, {k}, 1)")


def read_mixer(src: TensorSource, prefix: str, dims: MixerDims, opts: LoadOptions, bias: bool,
               conv_bias: bool) -> MixerParams:
    """A mixer's params under `prefix` (`...mixer.`)."""
    dtype, keep, where = opts.dtype, opts.keep_quantized, opts.where
    i, cd, h = dims.inner, dims.conv_dim, dims.heads

    def lin(name: str, out_f: int, in_f: int) -> Linear:
        return read_linear(src, prefix + name, out_f, in_f, opts.quant_for(prefix + name), bias, where)

    return MixerParams(
        in_proj=finish(lin("in_proj", i + cd + h, dims.hidden), dtype, keep),
        conv_w=conv_weight(src, prefix + "conv1d.weight", cd, dims.kernel, where).astype(dtype),
        conv_b=src.get(prefix + "conv1d.bias", (cd,), where).astype(dtype) if conv_bias else None,
        dt_bias=src.get(prefix + "dt_bias", (h,), where).astype(mx.float32),
        a=-mx.exp(src.get(prefix + "A_log", (h,), where).astype(mx.float32)),
        d=src.get(prefix + "D", (h,), where).astype(mx.float32),
        norm=None if dims.norm_mode == "gate" else src.get(prefix + "norm.weight", (i,), where).astype(dtype),
        out_proj=finish(lin("out_proj", dims.hidden, i), dtype, keep),
    )


def mixer_layout(prefix: str, dims: MixerDims, bias: bool, conv_bias: bool) -> dict[str, TensorSpec]:
    i, cd, h = dims.inner, dims.conv_dim, dims.heads
    out = {prefix + "in_proj.weight": TensorSpec((i + cd + h, dims.hidden)),
           prefix + "conv1d.weight": TensorSpec((cd, 1, dims.kernel), scale=0.3),
           prefix + "dt_bias": TensorSpec((h,), center=0.5, scale=0.3),
           prefix + "A_log": TensorSpec((h,), center=0.5, scale=0.5),
           prefix + "D": TensorSpec((h,), center=1.0, scale=0.2)}
    if dims.norm_mode != "gate":  # (this order: the random weights of tiny models depend on it)
        out[prefix + "norm.weight"] = TensorSpec((i,), center=1.0, scale=0.1)
    out[prefix + "out_proj.weight"] = TensorSpec((dims.hidden, i))
    if conv_bias:
        out[prefix + "conv1d.bias"] = TensorSpec((cd,), scale=0.05)
    if bias:
        out[prefix + "in_proj.bias"] = TensorSpec((i + cd + h,), scale=0.05)
        out[prefix + "out_proj.bias"] = TensorSpec((dims.hidden,), scale=0.05)
    return out


def assemble(cfg: Mamba2Config, src: TensorSource, opts: LoadOptions) -> Mamba2Params:
    dtype, keep, where = opts.dtype, opts.keep_quantized, opts.where
    h = cfg.hidden_size
    bias, conv_bias = src.has("backbone.layers.0.mixer.in_proj.bias"), src.has("backbone.layers.0.mixer.conv1d.bias")
    layers = tuple(Mamba2Layer(
        norm=src.get(f"backbone.layers.{i}.norm.weight", (h,), where).astype(dtype),
        mixer=read_mixer(src, f"backbone.layers.{i}.mixer.", cfg.mixer, opts, bias, conv_bias))
        for i in range(cfg.num_layers))
    emb = finish(read_linear(src, "backbone.embeddings", cfg.vocab_size, h, opts.quant_for("backbone.embeddings"),
                             False, where), dtype, keep, table=True)
    head = None
    if not cfg.tie_word_embeddings:
        head = finish(read_linear(src, "lm_head", cfg.vocab_size, h, opts.quant_for("lm_head"), False, where),
                      dtype, keep)
    return Mamba2Params(embed=emb, layers=layers, norm=src.get("backbone.norm_f.weight", (h,), where).astype(dtype),
                        lm_head=head, config=cfg, numerics=opts.numerics, dtype=opts.dtype_name)


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
            "intermediate_size": 128, "state_size": 16, "n_groups": 2, "conv_kernel": 4,
            "layer_norm_epsilon": 1e-5, "use_bias": False, "use_conv_bias": True,
            "tie_word_embeddings": False, "time_step_limit": [0.0, 100.0], "time_step_rank": "auto",
            "bos_token_id": 1, "eos_token_id": 2, **overrides}


def tensor_split(p: Mamba2Params, rank: int, size: int) -> Mamba2Params:
    """Rank `rank` of `size`'s shard: every mixer's heads split (core/parallel.split_mixer),
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
)
