"""Checkpoint tensors -> params pytrees: the pure conversions every family's `assemble` uses.

The shell reads files into a `TensorSource` (name -> array, and which file each came from,
for error messages); a family's `assemble(cfg, src, opts)` turns it into the family's frozen
params pytree with these helpers: read a linear (dense, or MLX affine-quantized with its
`.scales`/`.biases`), fuse linears along the output axis, and finish each into its kept
representation (quantized where `opts.keep_quantized` says, dense [in, out] otherwise).
No files, no environment: arrays in, arrays out.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import attrs
import mlx.core as mx
import numpy as np

from fx_engine.core.nn import Linear, Numerics, group_params, row_major


class WeightsError(ValueError):
    """Missing, malformed or mismatched weights; the message names file and tensor."""


class TensorSource:
    """Named tensors from one or several files, remembering which file holds which."""

    def __init__(self) -> None:
        self.tensors: dict[str, mx.array] = {}
        self.origin: dict[str, str] = {}

    def add(self, path: Any, tensors: dict[str, mx.array]) -> None:
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


KeepQuantized = Union[bool, Callable[[int, int], bool]]


@attrs.frozen
class LoadOptions:
    """How `assemble` builds params: the activation dtype, which quantized linears stay
    quantized, the params' static Numerics, the checkpoint's quantization config
    (mlx-community's `quantization`: group_size/bits, per-module overrides) and where the
    tensors came from (for error messages)."""

    dtype: Any  # mx.Dtype
    keep_quantized: KeepQuantized = False
    numerics: Numerics = attrs.field(factory=Numerics)
    quant: dict | None = attrs.field(default=None, eq=False)
    where: str = "model"

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).split(".")[-1]

    def quant_for(self, module: str) -> dict | None:
        """The quantization of one module: the global group_size/bits or its override."""
        if not self.quant:
            return None
        override = self.quant.get(module)
        if isinstance(override, dict):
            return override
        return {"group_size": self.quant["group_size"], "bits": self.quant["bits"]}


@attrs.frozen
class TensorSpec:
    """One tensor of a family's checkpoint layout (`Family.checkpoint_layout`): its shape,
    and the centre and spread of the random values a tiny test model gets."""

    shape: tuple[int, ...]
    center: float = 0.0
    scale: float = 0.08


def read_linear(
    src: TensorSource, prefix: str, out_f: int, in_f: int, quant: dict | None,
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
        if scales.dtype == mx.uint8:  # MXFP4 (GGUF): E2M1 codes, E8M0 scales per 32, no biases
            if tuple(w.shape) != (out_f, in_f // 8) or tuple(scales.shape) != (out_f, in_f // 32):
                raise WeightsError(f"{src.origin[w_name]}: MXFP4 tensor '{w_name}' has shape {tuple(w.shape)} "
                                   f"(scales {tuple(scales.shape)}), expected ({out_f}, {in_f // 8})")
            return Linear(weight=w, bias=b, scales=scales, group_size=32, bits=4, mode="mxfp4",
                          origin=((prefix, out_f),))
        if scales.dtype == mx.int16:  # a GGUF K-quant's two-level form: [out, super-blocks, 2] factors
            biases = src.get(base + ".biases", None, where)
            if biases.ndim != 3 or biases.shape[0] != scales.shape[0] or biases.shape[-1] != 2:
                raise WeightsError(f"{src.origin[w_name]}: '{base}.biases' has shape {tuple(biases.shape)}, "
                                   f"expected ({scales.shape[0]}, super-blocks, 2) for int16 scales")
        else:
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
        return Linear(weight=w, bias=b, scales=scales, biases=biases, group_size=gs, bits=bits,
                      origin=((prefix, out_f),))
    if tuple(w.shape) != (out_f, in_f):
        raise WeightsError(
            f"{src.origin[w_name]}: tensor '{w_name}' has shape {tuple(w.shape)}, "
            f"expected {(out_f, in_f)}"
        )
    return Linear(weight=w, bias=b, origin=((prefix, out_f),))


def two_level(lin: Linear) -> bool:
    """Whether a quantized linear's scales are GGUF's K-quant two-level form (see
    `nn.group_params`), which only the native kernels and `group_params` read."""
    return lin.quantized and lin.scales is not None and lin.scales.dtype == mx.int16


def expanded(lin: Linear) -> Linear:
    """`lin` with its scales and biases in MLX's affine form (the two-level form decoded to
    float32, exactly; other forms unchanged): for regrouping, mixing formats, slicing inside
    a super-block."""
    if not two_level(lin):
        return lin
    scales, biases = group_params(lin.scales, lin.biases)
    return attrs.evolve(lin, scales=scales, biases=biases)


def stored_scales(lin: Linear, dtype: mx.Dtype, compact: bool) -> tuple[mx.array, mx.array]:
    """A kept linear's scales and biases as the model stores them: in `dtype`, except the
    compact forms the native kernels decode themselves (exactly) when `compact` (float32
    models on the native kernels): GGUF's two-level form, and float16 / bfloat16 scales as
    a checkpoint or GGUF legacy type holds them (half or a third of float32's bytes)."""
    if lin.mode != "affine":  # MXFP4's E8M0 scale bytes, no biases
        return lin.scales, lin.biases
    if two_level(lin) or (compact and dtype == mx.float32 and lin.scales.dtype in (mx.float16, mx.bfloat16)
                          and lin.biases.dtype == lin.scales.dtype):
        return lin.scales, lin.biases
    return lin.scales.astype(dtype), lin.biases.astype(dtype)


def dequantized(lin: Linear, dtype: mx.Dtype) -> Linear:
    lin = row_major(lin)  # (the 8-bit mode's interleaved weights: back in rows)
    if not lin.quantized:
        return Linear(weight=lin.weight.astype(dtype), bias=cast(lin.bias, dtype), origin=lin.origin)
    if lin.mode != "affine":
        w = mx.dequantize(lin.weight, lin.scales, None, group_size=lin.group_size, bits=lin.bits,
                          mode=lin.mode).astype(dtype)
        return Linear(weight=w, bias=cast(lin.bias, dtype), origin=lin.origin)
    scales, biases = group_params(lin.scales, lin.biases)
    w = mx.dequantize(
        lin.weight, scales.astype(dtype), biases.astype(dtype),
        group_size=lin.group_size, bits=lin.bits,
    ).astype(dtype)
    return Linear(weight=w, bias=cast(lin.bias, dtype), origin=lin.origin)


def keep(policy: KeepQuantized, lin: Linear) -> bool:
    """Whether a quantized linear stays quantized: a bool, or a predicate on (group_size,
    bits) (e.g. "the native CPU kernels support this format")."""
    if not lin.quantized:
        return False
    if callable(policy):  # the native kernels' formats: affine only (MXFP4 runs on MLX's kernels)
        return lin.mode == "affine" and bool(policy(lin.group_size, lin.bits))
    return bool(policy)


def widened(policy: KeepQuantized, lin: Linear, force: bool = False, bits: int | None = None) -> Linear:
    """`lin` stored in `bits` (None: the narrowest wider width the policy keeps, else 8)
    with the same scales and biases, when its own width is not kept (or `force`) but `bits`
    of its group size are (e.g. 2-/3-bit weights where the native CPU kernels run 4, 5, 6
    and 8; 4 bits in groups of 16; the narrower parts of a fusion): exact (every stored
    integer fits), and packed instead of a float copy. Otherwise `lin` unchanged."""
    if bits is None:
        bits = next((w for w in (5, 6) if lin.bits < w and callable(policy) and policy(lin.group_size, w)), 8)
    if (not lin.quantized or lin.bits >= bits or policy is False or lin.mode != "affine"
            or (keep(policy, lin) and not force) or (callable(policy) and not policy(lin.group_size, bits))):
        return lin
    k = lin.scales.shape[-1] * lin.group_size
    words = np.asarray(lin.weight)
    packed = (repacked_8bit(words, lin.bits, k) if bits == 8 else
              pack_stream(repacked_8bit(words, lin.bits, k).view(np.uint8).reshape(-1, k), bits)
              .reshape(*words.shape[:-1], -1))
    return Linear(weight=mx.array(packed), bias=lin.bias, scales=lin.scales, biases=lin.biases,
                  group_size=lin.group_size, bits=bits, origin=lin.origin)


def pack_stream(q: np.ndarray, bits: int) -> np.ndarray:
    """[R, K] unsigned values < 2**bits -> [R, K * bits / 32] uint32: MLX's layout, one
    little-endian bit stream per row. Each run of 32 values fills `bits` words; value i of a
    run lands at bit bits * i of the run (straddling two words when it crosses one)."""
    r, k = q.shape
    if bits == 8:  # whole bytes: element j is byte j
        return np.ascontiguousarray(q, dtype=np.uint8).view(np.uint32).reshape(r, k // 4)
    if bits == 4:  # element 2i in byte i's low nibble, 2i + 1 in its high one
        b = (q[:, 0::2].astype(np.uint8) | (q[:, 1::2].astype(np.uint8) << 4))
        return np.ascontiguousarray(b).view(np.uint32).reshape(r, k // 8)
    if bits == 6:  # 4 values -> 3 bytes
        v = q.reshape(r, k // 4, 4).astype(np.uint8)
        out = np.empty((r, k // 4, 3), np.uint8)
        out[..., 0] = v[..., 0] | (v[..., 1] << 6)
        out[..., 1] = (v[..., 1] >> 2) | (v[..., 2] << 4)
        out[..., 2] = (v[..., 2] >> 4) | (v[..., 3] << 2)
        return out.reshape(r, -1).view(np.uint32)
    if bits == 5:  # 8 values -> 5 bytes
        v = q.reshape(r, k // 8, 8).astype(np.uint8)
        out = np.empty((r, k // 8, 5), np.uint8)
        out[..., 0] = v[..., 0] | (v[..., 1] << 5)
        out[..., 1] = (v[..., 1] >> 3) | (v[..., 2] << 2) | (v[..., 3] << 7)
        out[..., 2] = (v[..., 3] >> 1) | (v[..., 4] << 4)
        out[..., 3] = (v[..., 4] >> 4) | (v[..., 5] << 1) | (v[..., 6] << 6)
        out[..., 4] = (v[..., 6] >> 2) | (v[..., 7] << 3)
        return out.reshape(r, -1).view(np.uint32)
    runs = q.reshape(-1, 32).astype(np.uint64)
    words = np.zeros((runs.shape[0], bits), np.uint64)
    for i in range(32):
        word, shift = divmod(bits * i, 32)
        v = runs[:, i] << np.uint64(shift)
        words[:, word] |= v & np.uint64(0xFFFFFFFF)
        if shift + bits > 32:
            words[:, word + 1] |= v >> np.uint64(32)
    return words.astype(np.uint32).reshape(r, k * bits // 32)


def repacked_8bit(words: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MLX-packed integers of `bits` bits ([..., K * bits / 32] uint32: one little-endian
    bit stream per row) -> the same integers as 8-bit ([..., K / 4] uint32: byte j is
    element j). In numpy, by bit planes, a row block at a time: measured 0.46 s for 58.7 M
    6-bit weights, 6x MLX's dequantize-and-repack (an mlx-community 6-bit folder on CPU)."""
    lead = words.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    raw = np.ascontiguousarray(words, dtype=np.uint32).reshape(rows, -1).view(np.uint8)
    out = np.empty((rows, k), np.uint8)
    step = max(1, (1 << 22) // k)  # ~4 M weights per block: bounded temporaries
    for r0 in range(0, rows, step):
        planes = np.unpackbits(raw[r0 : r0 + step], axis=-1, bitorder="little").reshape(-1, k, bits)
        acc = planes[:, :, 0].copy()
        for j in range(1, bits):
            acc |= planes[:, :, j] << np.uint8(j)
        out[r0 : r0 + step] = acc
    return out.view(np.uint32).reshape(*lead, k // 4)


def cast(x: mx.array | None, dtype: mx.Dtype) -> mx.array | None:
    return None if x is None else x.astype(dtype)


def regrouped(lin: Linear, group_size: int) -> Linear:
    """`lin` with groups of `group_size`, a divisor of its own: each group's scale and bias
    repeated over its parts (exact: the same affine map for every weight)."""
    if not lin.quantized or lin.group_size == group_size:
        return lin
    r = lin.group_size // group_size
    if two_level(lin):  # the codes repeated; a super-block's factors serve r times the groups
        return attrs.evolve(lin, scales=mx.repeat(lin.scales, r, axis=-1), group_size=group_size)
    return attrs.evolve(lin, scales=mx.repeat(lin.scales, r, axis=-1), biases=mx.repeat(lin.biases, r, axis=-1),
                        group_size=group_size)


def fuse(parts: list[Linear], dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    """Concatenate linears along the output axis (exact for dense and affine-quantized).
    Quantized parts of different group sizes (a GGUF mix: Q4_K q/k in groups of 32, a Q6_K
    v in groups of 16) are regrouped to the smallest when it divides the others, and parts
    of different widths widened to 8 bits: exact, and still one quantized matrix."""
    origin = sum((p.origin for p in parts), ()) if all(p.origin for p in parts) else ()
    if any(p.quantized and p.mode != "affine" for p in parts):  # MXFP4: kept whole, or dense
        if all(p.mode == parts[0].mode for p in parts) and keep(keep_quantized, parts[0]):
            cat = lambda xs: mx.concatenate(xs, axis=0)  # noqa: E731
            return Linear(weight=cat([p.weight for p in parts]), scales=cat([p.scales for p in parts]),
                          bias=None if parts[0].bias is None else cat([p.bias.astype(dtype) for p in parts]),
                          group_size=parts[0].group_size, bits=parts[0].bits, mode=parts[0].mode, origin=origin)
        parts = [dequantized(p, dtype) if p.quantized else p for p in parts]
    if all(p.quantized for p in parts) and len({p.group_size for p in parts}) > 1:
        g = min(p.group_size for p in parts)
        if all(p.group_size % g == 0 for p in parts) and keep(keep_quantized, attrs.evolve(parts[0], group_size=g, bits=8)):
            parts = [regrouped(p, g) for p in parts]
    parts = [widened(keep_quantized, p) for p in parts]
    if len({(p.scales.dtype, p.biases.ndim) for p in parts if p.quantized}) > 1:  # storage forms differ
        parts = [expanded(p) for p in parts]
        if len({p.scales.dtype for p in parts if p.quantized}) > 1:
            parts = [attrs.evolve(p, scales=p.scales.astype(mx.float32), biases=p.biases.astype(mx.float32))
                     if p.quantized else p for p in parts]
    if (all(p.quantized for p in parts) and len({p.group_size for p in parts}) == 1
            and len({p.bits for p in parts}) > 1):  # mixed widths (a GGUF K-quant mix): the widest
        wide = max(p.bits for p in parts)  # (a kept width: every narrower integer fits; else 8)
        wide = wide if keep(keep_quantized, attrs.evolve(parts[0], bits=wide)) else 8
        parts = [widened(keep_quantized, p, force=True, bits=wide) for p in parts]
    same_q = all(p.quantized for p in parts) and len(
        {(p.group_size, p.bits) for p in parts}
    ) == 1
    if same_q and keep(keep_quantized, parts[0]):
        cat = lambda xs: mx.concatenate(xs, axis=0)  # noqa: E731
        stored = [stored_scales(p, dtype, callable(keep_quantized)) for p in parts]
        return Linear(
            weight=cat([p.weight for p in parts]),
            bias=None if parts[0].bias is None else cat([p.bias.astype(dtype) for p in parts]),
            scales=cat([s for s, _ in stored]),
            biases=cat([b for _, b in stored]),
            group_size=parts[0].group_size, bits=parts[0].bits, origin=origin,
        )
    dense = [dequantized(p, dtype) for p in parts]
    return finish(Linear(
        weight=mx.concatenate([p.weight for p in dense], axis=0),
        bias=None if dense[0].bias is None else mx.concatenate([p.bias for p in dense]),
        origin=origin,
    ), dtype, keep_quantized)


def finish(lin: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized, table: bool = False,
           lookup_only: bool = False) -> Linear:
    """Final representation: quantized kept as is, or dense; dense matmul-only weights are
    stored transposed ([in, out]); embedding tables (`table`) stay [vocab, hidden]. A table
    that is only looked up (`lookup_only`: not also the output head) stays quantized in any
    format unless the policy is False: a lookup dequantizes just the gathered rows, so no
    kernel is needed (a Q6_K embedding of 128k x 4096 stays ~420 MB instead of 2 GB)."""
    if table:  # looked up by row (and maybe the tied head): no adapter targets it as a linear
        lin = attrs.evolve(lin, origin=())
    # (a table's float scales in `dtype`: lookups dequantize with MLX's ops, whose output
    # takes the scales' dtype; the two-level form decodes to float32 there)
    if table and lookup_only and lin.quantized and keep_quantized is not False:
        scales, biases = stored_scales(lin, dtype, False)
        return Linear(weight=lin.weight, bias=cast(lin.bias, dtype), scales=scales,
                      biases=biases, group_size=lin.group_size, bits=lin.bits, mode=lin.mode)
    lin = widened(keep_quantized, lin)
    if keep(keep_quantized, lin):
        scales, biases = stored_scales(lin, dtype, callable(keep_quantized) and not table)
        return Linear(
            weight=lin.weight, bias=cast(lin.bias, dtype), scales=scales,
            biases=biases, group_size=lin.group_size, bits=lin.bits, mode=lin.mode,
            origin=lin.origin,
        )
    dense = dequantized(lin, dtype)
    if table:
        return dense
    return Linear(weight=mx.contiguous(dense.weight.T), bias=dense.bias, transposed=True, origin=lin.origin)


def read_expert_stack(
    src: TensorSource, name: str, e: int, out_f: int, in_f: int, quant: dict | None, where: str,
    bias: bool = False,
) -> Linear:
    """A stacked expert weight [E, out, in] (mlx-lm's SwitchLinear), dense or quantized, with
    its per-expert biases [E, out] when `bias`."""
    w = src.get(name + ".weight", None, where)
    b = src.get(name + ".bias", (e, out_f), where) if bias else None
    if src.has(name + ".scales") and src.get(name + ".scales").dtype == mx.uint8:  # MXFP4 (GGUF)
        scales = src.get(name + ".scales", (e, out_f, in_f // 32), where)
        if tuple(w.shape) != (e, out_f, in_f // 8):
            raise WeightsError(f"{src.origin[name + '.weight']}: MXFP4 expert tensor '{name}.weight' has "
                               f"shape {tuple(w.shape)}, expected {(e, out_f, in_f // 8)}")
        return Linear(weight=w, bias=b, scales=scales, group_size=32, bits=4, mode="mxfp4")
    if src.has(name + ".scales"):
        scales = src.get(name + ".scales", None, where)
        q = quant or {}
        gs = int(q.get("group_size", in_f // scales.shape[-1]))
        bits = int(q.get("bits", w.shape[-1] * 32 // in_f))
        want = (e, out_f, in_f * bits // 32)
        if tuple(w.shape) != want or tuple(scales.shape) != (e, out_f, in_f // gs):
            raise WeightsError(f"{src.origin[name + '.weight']}: quantized expert tensor "
                               f"'{name}.weight' has shape {tuple(w.shape)}, expected {want}")
        biases = src.get(name + ".biases", None, where)
        # (GGUF K-quants on the native kernels: two-level int16 codes with float16 factors
        # per super-block [E, out, super-blocks, 2], `loading/gguf.py`)
        want_b = (e, out_f, biases.shape[-2], 2) if scales.dtype == mx.int16 else tuple(scales.shape)
        if tuple(biases.shape) != want_b:
            raise WeightsError(f"{src.origin[name + '.biases']}: tensor '{name}.biases' has shape "
                               f"{tuple(biases.shape)}, expected {want_b}")
        return Linear(weight=w, bias=b, scales=scales, biases=biases, group_size=gs, bits=bits)
    if tuple(w.shape) != (e, out_f, in_f):
        raise WeightsError(f"{src.origin[name + '.weight']}: tensor '{name}.weight' has shape "
                           f"{tuple(w.shape)}, expected {(e, out_f, in_f)}")
    return Linear(weight=w, bias=b)


GATHER_QMM_GROUPS = (32, 64, 128)  # the group sizes mx.gather_qmm runs


def finish_experts(lin: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    # Stacked experts run through mx.gather_qmm (MLX's kernels: no native CPU one), which
    # reads only the chosen experts: kept packed in any width it runs unless the policy is
    # False (a large MoE's float32 copy would not fit: 30B parameters are 120 GB). A GGUF's
    # Q6_K stack (group 16, which gather_qmm does not run) is dequantized. On the native
    # CPU kernels (a callable policy) a width they run stays as stored, compact scales
    # included (`kernels.gather_qmm`): a GGUF MoE takes about its file's bytes in memory.
    if lin.quantized and lin.mode == "affine" and callable(keep_quantized) \
            and keep_quantized(lin.group_size, lin.bits):
        scales, biases = stored_scales(lin, dtype, True)
        return attrs.evolve(lin, bias=cast(lin.bias, dtype), scales=scales, biases=biases)
    lin = expanded(lin)  # (stacks run on MLX's gather_qmm: MLX's affine form)
    if lin.quantized and lin.mode != "affine":  # MXFP4: packed whatever the policy (exact, 4 bits)
        return lin if keep_quantized is not False else Linear(
            weight=mx.contiguous(mx.dequantize(lin.weight, lin.scales, None, group_size=32, bits=4,
                                               mode=lin.mode).astype(dtype).swapaxes(-1, -2)),
            bias=cast(lin.bias, dtype), transposed=True)
    if lin.quantized and keep_quantized is not False and lin.group_size in GATHER_QMM_GROUPS:
        return Linear(weight=lin.weight, bias=cast(lin.bias, dtype), scales=lin.scales.astype(dtype),
                      biases=lin.biases.astype(dtype), group_size=lin.group_size, bits=lin.bits)
    w = lin.weight
    if lin.quantized:
        w = mx.dequantize(w, lin.scales.astype(dtype), lin.biases.astype(dtype),
                          group_size=lin.group_size, bits=lin.bits)
    return Linear(weight=mx.contiguous(w.astype(dtype).swapaxes(-1, -2)), bias=cast(lin.bias, dtype),
                  transposed=True)




def read_experts(
    src: TensorSource, stacked: str, per_expert: str, e: int, out_f: int, in_f: int,
    quant_for: Callable[[str], dict | None], where: str,
) -> Linear:
    """One projection of all E experts as a stacked Linear [E, out, in]: stored stacked
    (`stacked`, mlx-lm's switch_mlp / mlx-community layout and GGUF's, maybe quantized) or
    one tensor per expert (`per_expert` with `{e}`; "" when there is no such layout; Hugging Face's layout: stacked here, each expert
    dense or quantized alike)."""
    if src.has(stacked + ".weight") or not per_expert:
        return read_expert_stack(src, stacked, e, out_f, in_f, quant_for(stacked), where)
    parts = [read_linear(src, per_expert.format(e=j), out_f, in_f, quant_for(per_expert.format(e=j)),
                         False, where) for j in range(e)]
    if len({(p.quantized, p.group_size, p.bits) for p in parts}) != 1:
        raise WeightsError(f"{where}: the experts of '{per_expert}' are stored in different formats")
    stack = lambda xs: mx.stack(xs)  # noqa: E731
    if parts[0].quantized:
        return Linear(weight=stack([p.weight for p in parts]), scales=stack([p.scales for p in parts]),
                      biases=stack([p.biases for p in parts]), group_size=parts[0].group_size,
                      bits=parts[0].bits)
    return Linear(weight=stack([p.weight for p in parts]))


def fuse_experts(gate: Linear, up: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    """gate and up expert stacks [E, F, H] as one [E, 2F, H] (gate rows first; per-expert
    biases [E, F] likewise), in the representation `finish_experts` keeps: packed if both
    stay quantized, else dense [E, H, 2F] (transposed for gather_mm)."""
    bias = None if gate.bias is None else mx.concatenate([gate.bias, up.bias], axis=-1)
    if gate.quantized and up.quantized and gate.group_size == up.group_size and gate.bits != up.bits:
        gate, up = (widened(keep_quantized, p, force=True) for p in (gate, up))  # exact: 8 bits
    if gate.quantized and up.quantized and keep_quantized is not False and gate.bits == up.bits \
            and gate.group_size == up.group_size and gate.mode == up.mode \
            and (gate.group_size in GATHER_QMM_GROUPS or keep(keep_quantized, gate)):
        if gate.mode == "affine" and (gate.scales.dtype, gate.biases.shape[2:]) != (up.scales.dtype, up.biases.shape[2:]):
            # stored in different scale forms (a K-quant and a legacy type): one, float32
            gate, up = (attrs.evolve(expanded(p), scales=expanded(p).scales.astype(mx.float32),
                                     biases=expanded(p).biases.astype(mx.float32)) for p in (gate, up))
        cat = lambda xs: mx.concatenate(xs, axis=1)  # noqa: E731
        return finish_experts(Linear(weight=cat([gate.weight, up.weight]), bias=bias,
                                     scales=cat([gate.scales, up.scales]),
                                     biases=None if gate.biases is None else cat([gate.biases, up.biases]),
                                     group_size=gate.group_size, bits=gate.bits, mode=gate.mode),
                              dtype, keep_quantized)
    dense = [finish_experts(p, dtype, False).weight for p in (gate, up)]  # [E, H, F] each
    return Linear(weight=mx.concatenate(dense, axis=-1), bias=cast(bias, dtype), transposed=True)


# llama.cpp's tensor names shared by most architectures -> Hugging Face's (family modules
# add their own rules before these)
GGUF_COMMON_NAMES: tuple[tuple[str, str], ...] = (
    (r"^token_embd\.", "model.embed_tokens."), (r"^output_norm\.", "model.norm."),
    (r"^output\.", "lm_head."), (r"^blk\.(\d+)\.", r"model.layers.\1."),
    (r"\.attn_q_norm\.", ".self_attn.q_norm."), (r"\.attn_k_norm\.", ".self_attn.k_norm."),
    (r"\.attn_q\.", ".self_attn.q_proj."), (r"\.attn_k\.", ".self_attn.k_proj."),
    (r"\.attn_v\.", ".self_attn.v_proj."), (r"\.attn_output\.", ".self_attn.o_proj."),
    (r"\.ffn_gate\.", ".mlp.gate_proj."), (r"\.ffn_up\.", ".mlp.up_proj."), (r"\.ffn_down\.", ".mlp.down_proj."),
)


def renamed(src: TensorSource, rules: tuple[tuple[str, str], ...]) -> TensorSource:
    """The tensors under new names: each name through every (pattern, replacement) rule in
    order (GGUF -> Hugging Face names; the GGUF name is kept in the origin for errors)."""
    import re

    out = TensorSource()
    for name, t in src.tensors.items():
        new = name
        for pattern, repl in rules:
            new = re.sub(pattern, repl, new)
        out.tensors[new], out.origin[new] = t, f"{src.origin[name]} ({name})"
    return out
