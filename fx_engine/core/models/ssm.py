"""Selective state-space mixers: Mamba-2's (`mixer`), shared by the Mamba-2, Nemotron-H,
Granite-4 hybrid and Falcon-H1 families, with its sizes (`MixerDims`), params
(`MixerParams`) and checkpoint reading (`read_mixer`, `conv_weight`, `mixer_layout`).

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

from fx_engine.core.cache import LayerSpec, StepGeometry, recurrent_entry
from fx_engine.core.checkpoint import Lin, LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Linear, Numerics, linear, rms_norm, shard_group
from fx_engine.core.recurrent import causal_conv, ssd_scan

__all__ = ["MixerDims", "MixerParams", "conv_weight", "gguf_mixer_names", "gguf_mixer_source", "mixer", "mixer_layout",
           "read_mixer"]


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
class MixerParams:
    in_proj: Linear
    conv_w: mx.array  # [conv_dim, K]
    conv_b: mx.array | None
    dt_bias: mx.array  # [H]
    a: mx.array  # -exp(A_log) [H], float32
    d: mx.array  # [H]
    norm: mx.array | None  # [I] (None: no norm, norm_mode "gate")
    out_proj: Linear


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
                     group=shard_group(mp.out_proj))
    if dims.norm_mode == "norm_gate":
        y = y * gate
    out = linear(y.reshape(b * t, i), mp.out_proj, num)
    steps = None if conv_steps is None else [conv_steps.astype(conv_state.dtype), ssm_steps]
    return out, recurrent_entry(spec, [conv_new.astype(conv_state.dtype), ssm_new], steps, geo)


def conv_weight(src: TensorSource, name: str, channels: int, k: int, where: str) -> mx.array:
    """A depthwise conv weight as [channels, K]: Hugging Face stores [C, 1, K], mlx-lm [C, K, 1],
    llama.cpp's converters [C, K] (squeezed)."""
    w = src.get(name, None, where)
    if tuple(w.shape) == (channels, k):
        return w
    if tuple(w.shape) == (channels, 1, k):
        return w[:, 0, :]
    if tuple(w.shape) == (channels, k, 1):
        return w[:, :, 0]
    raise ConfigError(f"{where}: {name} has shape {tuple(w.shape)}, expected ({channels}, 1, {k}), "
                      f"({channels}, {k}, 1) or ({channels}, {k})")


# A mixer's params from its tensors under the mixer's prefix (`read_tensors`, sizes the
# MixerDims' and `read_mixer`'s); the conv weight (either axis order) and the decay rates
# -exp(A_log) are read in `read_mixer`
MIXER = (
    Lin("in_proj", "in_proj", "in_width", "hidden", bias="bias"),
    Vec("conv_b", "conv1d.bias", "conv_dim", when="conv_bias"),
    Vec("dt_bias", "dt_bias", "heads", float32=True),
    Vec("d", "D", "heads", float32=True),
    Vec("norm", "norm.weight", "inner", when="norm_weight"),
    Lin("out_proj", "out_proj", "hidden", "inner", bias="bias"),
)


def read_mixer(src: TensorSource, prefix: str, dims: MixerDims, opts: LoadOptions, bias: bool,
               conv_bias: bool) -> MixerParams:
    """A mixer's params under `prefix` (`...mixer.`); bias: in_proj and out_proj have
    biases, conv_bias: the conv has one."""
    rd, where = Reader(src, opts), opts.where
    sizes = {"in_width": dims.inner + dims.conv_dim + dims.heads, "bias": bias, "conv_bias": conv_bias,
             "norm_weight": dims.norm_mode != "gate"}
    return MixerParams(
        **read_tensors(rd, MIXER, dims, prefix, sizes=sizes),
        conv_w=conv_weight(src, prefix + "conv1d.weight", dims.conv_dim, dims.kernel, where).astype(opts.dtype),
        a=(src.get(prefix + "decay", (dims.heads,), where).astype(mx.float32) if src.has(prefix + "decay")
           else -mx.exp(src.get(prefix + "A_log", (dims.heads,), where).astype(mx.float32))),
    )


def gguf_mixer_names(mixer: str) -> tuple[tuple[str, str], ...]:
    """llama.cpp's Mamba-2 mixer tensor names (blk.N.ssm_*) -> Hugging Face's under each
    layer's `mixer` module (`renamed` rules, before GGUF_COMMON_NAMES); ssm_a, which holds
    -exp(A_log), as `decay` (`read_mixer` takes it as the decay itself)."""
    return ((r"\.ssm_in\.", f".{mixer}.in_proj."), (r"\.ssm_conv1d\.", f".{mixer}.conv1d."),
            (r"\.ssm_dt\.bias$", f".{mixer}.dt_bias"), (r"\.ssm_a(\.weight)?$", f".{mixer}.decay"),
            (r"\.ssm_d(\.weight)?$", f".{mixer}.D"), (r"\.ssm_norm\.", f".{mixer}.norm."),
            (r"\.ssm_out\.", f".{mixer}.out_proj."))


def gguf_mixer_source(src: TensorSource) -> TensorSource:
    """The renamed tensors with the mixers' vectors back in Hugging Face's shapes: llama.cpp's
    Mamba2Model converter stores the decay and D as [H, 1] and the gated norm's weight as
    [groups, inner / groups] (the conv weight's [C, K] `conv_weight` reads)."""
    out = TensorSource()
    out.tensors, out.origin = dict(src.tensors), dict(src.origin)
    for name, t in src.tensors.items():
        if name.endswith((".decay", ".D", ".norm.weight")) and t.ndim == 2 and ".layers." in name:
            out.tensors[name] = t.reshape(-1)
    return out


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
