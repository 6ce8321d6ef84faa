"""Tensor-parallel splits of the model blocks: one rank's shard of a linear, an attention
block, an MLP, routed experts, a Mamba-2 mixer, the vocabulary (pure).

Each family names its split (`Family.tensor_split`) and builds it from these (or uses
`shard_decoder` whole); core/parallel.py applies a family's split to a model
(`shard_params`) and cuts pipeline stages (`stage_params`). This module knows no family
and no registry, so the families import it without a circle through the registry. The
split itself (Megatron's: heads, MLP features, experts' features, vocabulary rows; what is
summed or gathered) is described in core/parallel.py.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.config import ConfigError
from fx_engine.core.checkpoint import expanded, two_level
from fx_engine.core.nn import Linear, Shard

__all__ = ["head_range", "shard_decoder", "split", "split_attention", "split_cols", "split_experts",
           "split_head", "split_mixer", "split_mlp", "split_rows", "split_vocab"]


def split(n: int, size: int, rank: int, unit: int = 1, kind: str = "tensor parallel") -> tuple[int, int]:
    """Rank's [start, end) of n items in units of `unit` (as even as possible, the first
    ranks taking the remainder)."""
    if n % unit:
        raise ConfigError(f"{kind}: {n} is not a multiple of {unit}")
    units = n // unit
    if units < size:
        raise ConfigError(f"{kind}: {units} parts cannot be split over {size} ranks")
    base, extra = divmod(units, size)
    start = rank * base + min(rank, extra)
    end = start + base + (1 if rank < extra else 0)
    return start * unit, end * unit


def _cut(x: mx.array | None, axis: int, ranges: list[tuple[int, int]]) -> mx.array | None:
    """x's ranges [a, b) along the (negative) axis, concatenated."""
    if x is None:
        return None
    parts = [x[(slice(None),) * (x.ndim + axis) + (slice(a, b),)] for a, b in ranges]
    return mx.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0]


def _check_mode(lin: Linear) -> None:
    """Affine (MLX's and GGUF's integer groups) and MXFP4 (4-bit floats in groups of 32
    with a shared exponent, no biases) split the same way: whole groups, whole words."""
    if lin.quantized and lin.quant.mode not in ("affine", "mxfp4"):
        raise ConfigError(f"tensor parallel: {lin.quant.mode} weights are not supported")


def split_rows(lin: Linear, ranges: list[tuple[int, int]], keep_origin: bool = False) -> Linear:
    """The output rows in `ranges` (concatenated) of a linear or of every expert of a stack,
    dense or quantized. keep_origin: one range per origin segment (a fused q|k|v), recorded as
    (module, rows kept, first row kept, the module's rows) so adapters find their slice
    (loading/adapters.py)."""
    _check_mode(lin)
    origin = ()
    if keep_origin and lin.origin and len(lin.origin) == len(ranges):
        at, parts = 0, []
        for (name, rows, *_), (a, b) in zip(lin.origin, ranges):
            parts.append((name, b - a, a - at, rows))
            at += rows
        origin = tuple(parts)
    if lin.quantized:  # [..., out, in / packing] (two-level factors: [..., out, super-blocks, 2])
        q = lin.quant
        return attrs.evolve(lin, weight=_cut(lin.weight, -2, ranges), bias=_cut(lin.bias, -1, ranges),
                            origin=origin).with_quant(scales=_cut(q.scales, -2, ranges),
                                                      biases=_cut(q.biases, -3 if two_level(lin) else -2, ranges))
    return attrs.evolve(lin, weight=_cut(lin.weight, -1 if lin.transposed else -2, ranges),
                        bias=_cut(lin.bias, -1, ranges), origin=origin)


def split_cols(lin: Linear, start: int, end: int, name: str) -> Linear:
    """The input features [start, end) of a linear (or of every expert of a stack) whose
    partial products are summed over the ranks."""
    _check_mode(lin)
    shard = Shard("sum", first=start, end=end, width=lin.in_features)
    if lin.bias is not None and lin.weight.ndim > 2 and start > 0:
        # an expert stack's biases are added per expert, before the mixture is summed over
        # the ranks (a dense linear adds its bias after the sum): the first rank's only
        lin = attrs.evolve(lin, bias=None)
    if lin.quantized:
        # a row is one bit stream: whole 32-bit words at every multiple of 32 values (of 8
        # or 4 values for 4 and 8 bits)
        bits, gs = lin.quant.bits, lin.quant.group_size
        unit = 32 // bits if 32 % bits == 0 else 32
        if start % gs or end % gs or start % unit or end % unit:
            raise ConfigError(f"tensor parallel: {name} ({bits}-bit, groups of {gs}) cannot be "
                              f"split at input feature {start}..{end}")
        word = lambda i: i * bits // 32  # noqa: E731  (the word where value i starts)
        weight, groups = _cut(lin.weight, -1, [(word(start), word(end))]), [(start // gs, end // gs)]
        if two_level(lin):  # the super-blocks' factors split whole, or the float32 form
            sb = lin.in_features // lin.quant.biases.shape[-2]
            if start % sb or end % sb:
                lin = expanded(lin)
            else:
                return attrs.evolve(lin, weight=weight, shard=shard).with_quant(
                    scales=_cut(lin.quant.scales, -1, groups), biases=_cut(lin.quant.biases, -2, [(start // sb, end // sb)]))
        return attrs.evolve(lin, weight=weight, shard=shard).with_quant(
            scales=_cut(lin.quant.scales, -1, groups), biases=_cut(lin.quant.biases, -1, groups))
    return attrs.evolve(lin, weight=_cut(lin.weight, -2 if lin.transposed else -1, [(start, end)]), shard=shard)


def split_vocab(lin: Linear, rank: int, size: int) -> Linear:
    """Rows [start, start + per) of a vocabulary-sized table (zero rows pad the last ranks
    so every rank holds `per` rows: all_gather needs equal parts)."""
    total = lin.out_features
    per = -(-total // size)
    start = min(rank * per, total)
    end = min(start + per, total)
    part = split_rows(lin, [(start, end)])
    pad = per - (end - start)
    if pad:
        def padded(x: mx.array | None, axis: int = 0) -> mx.array | None:
            if x is None:
                return None
            shape = list(x.shape)
            shape[axis] = pad
            return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)

        if part.quantized:
            part = attrs.evolve(part, weight=padded(part.weight), bias=padded(part.bias)).with_quant(
                scales=padded(part.quant.scales), biases=padded(part.quant.biases))
        else:
            part = attrs.evolve(part, weight=padded(part.weight, 1 if part.transposed else 0),
                                bias=padded(part.bias))
    # (a bias is added after the ranks' rows are gathered: the whole one, not this rank's rows)
    return attrs.evolve(part, bias=lin.bias, shard=Shard("vocab", first=start, width=total))






def shard_decoder(params: Any, rank: int, size: int) -> Any:
    """The split of the decoders whose layers hold a fused q|k|v, o and an MLP (gate_up/down
    or fc/proj) or routed experts: the Llama decoder's families (llama, mistral, qwen2/3,
    SmolLM, granite, phi3, starcoder2, OLMo 2/3 and the other post-norm ones, the
    mixture-of-experts family, GPT-OSS) and Cohere."""
    cfg = params.config
    hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q0, q1, k0, k1 = head_range(hq, hk, rank, size)
    mlps = [_mlp_fields(lp, i) for i, lp in enumerate(params.layers)]
    layers, whole_norms, width = [], False, cfg.intermediate_size
    for i, (lp, mlp) in enumerate(zip(params.layers, mlps)):
        if getattr(lp, "q_norm", None) is not None and lp.q_norm.ndim == 2:  # Cohere: a weight per head
            lp = attrs.evolve(lp, q_norm=lp.q_norm[q0:q1], k_norm=lp.k_norm[k0:k1])
        elif getattr(lp, "q_norm", None) is not None and lp.q_norm.shape[-1] != d:
            # OLMo's norms over every head's q (k): each rank its heads' weights, the mean
            # square summed over the ranks (config.qk_norm_width)
            lp = attrs.evolve(lp, q_norm=lp.q_norm[q0 * d : q1 * d], k_norm=lp.k_norm[k0 * d : k1 * d])
            whole_norms = True
        lp = split_attention(lp, hq, hk, d, rank, size, f"layer {i}")
        if getattr(lp, "sinks", None) is not None:  # GPT-OSS: one attention sink per query head
            lp = attrs.evolve(lp, sinks=lp.sinks[q0:q1])
        if mlp is None:
            layers.append(attrs.evolve(lp, experts=split_experts(lp.experts, rank, size, i)))
            continue
        up, down = mlp
        fused = getattr(lp, up).out_features == 2 * getattr(lp, down).in_features  # gate|up, or one fc
        lp = split_mlp(lp, rank, size, f"layer {i}", up=up, down=down, fused=fused)
        width = getattr(lp, down).in_features
        layers.append(lp)
    small = attrs.evolve(cfg, num_heads=q1 - q0, num_kv_heads=k1 - k0, intermediate_size=width,
                         **({"qk_norm_width": (hq * d, hk * d)} if whole_norms else {}))
    return split_head(attrs.evolve(params, layers=tuple(layers), config=small), rank, size)


def split_experts(ex: Any, rank: int, size: int, i: int) -> Any:
    """A layer's routed experts (gate_up [E, 2F, H], down [E, H, F]) split like dense MLPs,
    each expert's intermediate features over the ranks (the router replicated; the
    family's mixture sums its weighted sum over the ranks), and a shared expert
    (shared_gate_up / shared_down) like a dense MLP."""
    f = ex.gate_up.out_features // 2
    unit = ex.down.quant.group_size if ex.down.quantized else 1
    f0, f1 = split(f, size, rank, unit)
    out = attrs.evolve(ex, gate_up=split_rows(ex.gate_up, [(f0, f1), (f + f0, f + f1)]),
                       down=split_cols(ex.down, f0, f1, f"layer {i} experts' down_proj"))
    if getattr(ex, "shared_gate_up", None) is not None:
        fs = ex.shared_gate_up.out_features // 2
        unit = ex.shared_down.quant.group_size if ex.shared_down.quantized else 1
        s0, s1 = split(fs, size, rank, unit)
        out = attrs.evolve(out, shared_gate_up=split_rows(ex.shared_gate_up, [(s0, s1), (fs + s0, fs + s1)]),
                           shared_down=split_cols(ex.shared_down, s0, s1, f"layer {i} shared expert's down_proj"))
    return out


def head_range(hq: int, hk: int, rank: int, size: int) -> tuple[int, int, int, int]:
    """This rank's (q0, q1, k0, k1): a contiguous group of KV heads with their query heads."""
    k0, k1 = split(hk, size, rank)
    return k0 * (hq // hk), k1 * (hq // hk), k0, k1


def split_attention(at: Any, hq: int, hk: int, d: int, rank: int, size: int, name: str) -> Any:
    """An attention record's fused q|k|v rows and o_proj columns (its fields `qkv`, `o`) for
    this rank's heads."""
    q0, q1, k0, k1 = head_range(hq, hk, rank, size)
    if at.qkv.out_features != (hq + 2 * hk) * d:
        raise ConfigError(f"tensor parallel: {name}'s attention is not q|k|v of {hq}/{hk} heads of {d}")
    return attrs.evolve(at, qkv=split_rows(at.qkv, [(q0 * d, q1 * d), ((hq + k0) * d, (hq + k1) * d),
                                                   ((hq + hk + k0) * d, (hq + hk + k1) * d)], keep_origin=True),
                        o=split_cols(at.o, q0 * d, q1 * d, f"{name} o_proj"))


def split_mlp(mlp: Any, rank: int, size: int, name: str, up: str = "gate_up", down: str = "down",
              fused: bool = True) -> Any:
    """A dense MLP record's column-parallel `up` rows (fused: gate|up halves) and row-parallel
    `down` columns: this rank's slice of the intermediate features."""
    lin = getattr(mlp, down)
    f = lin.in_features
    f0, f1 = split(f, size, rank, lin.quant.group_size if lin.quantized else 1)
    cut = [(f0, f1), (f + f0, f + f1)] if fused else [(f0, f1)]
    return attrs.evolve(mlp, **{up: split_rows(getattr(mlp, up), cut, keep_origin=True),
                                down: split_cols(lin, f0, f1, f"{name} {down}")})


def split_mixer(mp: Any, dims: Any, rank: int, size: int, name: str) -> tuple[Any, Any]:
    """A Mamba-2 mixer's (params, dims) for this rank's heads (models/mamba2.py's layout:
    in_proj rows z | x | B | C | dt, conv channels x | B | C). Its B/C groups split with
    their heads (groups a multiple of the ranks), or each rank's heads lie in one group,
    which the ranks sharing it replicate (one group: every rank); the gated norm stays per
    rank where its groups fall on whole heads, or is taken over every rank's channels
    (`norm_width`); out_proj's columns are summed."""
    h, p, g, n = dims.heads, dims.head_dim, dims.groups, dims.state
    i = h * p
    if g % size == 0:  # whole groups with their heads
        g0, g1 = split(g, size, rank)
        h0, h1 = g0 * (h // g), g1 * (h // g)
    else:  # heads within one group, which every rank holding some of them replicates
        h0, h1 = split(h, size, rank)
        g0, g1 = h0 // (h // g), (h1 - 1) // (h // g) + 1
        if g1 - g0 > 1:
            raise ConfigError(f"tensor parallel: {name}'s heads {h0}..{h1 - 1} span {g1 - g0} of its B/C "
                              f"groups ({g} groups of {h // g} heads cannot be split over {size} ranks)")
    bc = [(i + g0 * n, i + g1 * n), (i + g * n + g0 * n, i + g * n + g1 * n)]  # within x | B | C
    xbc = [(h0 * p, h1 * p)] + bc
    dt = 2 * i + 2 * g * n  # in_proj: z (i rows), x | B | C (i + 2 g n), dt (h)
    rows = [(h0 * p, h1 * p)] + [(i + a, i + b) for a, b in xbc] + [(dt + h0, dt + h1)]
    norm_groups, norm_width = dims.norm_groups, 0
    if mp.norm is not None:
        width = i // dims.norm_groups
        if dims.norm_groups == 1:
            norm_width = i  # one norm over every rank's channels
        elif (h0 * p) % width or (h1 * p) % width:
            raise ConfigError(f"tensor parallel: {name}'s norm groups of {width} channels fall across ranks")
        else:
            norm_groups = (h1 - h0) * p // width
    params = attrs.evolve(mp, in_proj=split_rows(mp.in_proj, rows), conv_w=_cut(mp.conv_w, -2, xbc),
                          conv_b=_cut(mp.conv_b, -1, xbc),  # (conv channels: [C, K], [C])
                          dt_bias=mp.dt_bias[h0:h1], a=mp.a[h0:h1], d=mp.d[h0:h1],
                          norm=None if mp.norm is None else mp.norm[h0 * p : h1 * p],
                          out_proj=split_cols(mp.out_proj, h0 * p, h1 * p, f"{name} out_proj"))
    return params, attrs.evolve(dims, heads=h1 - h0, groups=g1 - g0, norm_groups=norm_groups, norm_width=norm_width)


def split_head(params: Any, rank: int, size: int) -> Any:
    """The embedding table's and the output head's vocabulary rows (a tied head: the table)."""
    head = getattr(params, "lm_head", None)
    if head is not None:
        params = attrs.evolve(params, lm_head=split_vocab(head, rank, size))
    return attrs.evolve(params, embed=split_vocab(params.embed, rank, size))


def _mlp_fields(lp: Any, i: int) -> tuple[str, str]:
    """The (column-parallel, row-parallel) linears of a layer's MLP (None: routed experts)."""
    if getattr(lp, "experts", None) is not None:
        return None  # type: ignore[return-value]
    for up, down in (("gate_up", "down"), ("fc", "proj")):
        if getattr(lp, up, None) is not None and getattr(lp, down, None) is not None:
            return up, down
    raise ConfigError(f"tensor parallel: layer {i} has no MLP this split knows")



