"""Checkpoint tensors -> params pytrees: the pure conversions every family's `assemble` uses.

The shell reads files into a `TensorSource` (name -> array, and which file each came from,
for error messages); a family's `assemble(cfg, src, opts)` turns it into the family's frozen
params pytree with these helpers: read a linear (dense, or MLX affine-quantized with its
`.scales`/`.biases`), fuse linears along the output axis, and finish each into its kept
representation (quantized where `opts.keep_quantized` says, dense [in, out] otherwise).
A family declares its checkpoint names as tables (`Vec`, `Norm`, `Lin`, `Fused`,
`Embedding`: params field <- tensor names, sizes, flags) that `read_tensors` reads through
a `Reader`; what no table says (expert stacks, conv weights, regrouped projections) stays
a small function in the family. No files, no environment: arrays in, arrays out.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import attrs
import mlx.core as mx
import numpy as np

from fx_engine.core.nn import Linear, Numerics, Quant, group_params, row_major


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
            return Linear(weight=w, bias=b, quant=Quant(scales, None, 32, 4, "mxfp4"), origin=((prefix, out_f),))
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
        return Linear(weight=w, bias=b, quant=Quant(scales, biases, gs, bits), origin=((prefix, out_f),))
    if tuple(w.shape) != (out_f, in_f):
        raise WeightsError(
            f"{src.origin[w_name]}: tensor '{w_name}' has shape {tuple(w.shape)}, "
            f"expected {(out_f, in_f)}"
        )
    return Linear(weight=w, bias=b, origin=((prefix, out_f),))


def two_level(lin: Linear) -> bool:
    """Whether a quantized linear's scales are GGUF's K-quant two-level form (see
    `nn.group_params`), which only the native kernels and `group_params` read."""
    return lin.quantized and lin.quant.scales.dtype == mx.int16


def expanded(lin: Linear) -> Linear:
    """`lin` with its scales and biases in MLX's affine form (the two-level form decoded to
    float32, exactly; other forms unchanged): for regrouping, mixing formats, slicing inside
    a super-block."""
    if not two_level(lin):
        return lin
    scales, biases = group_params(lin.quant.scales, lin.quant.biases)
    return lin.with_quant(scales=scales, biases=biases)


def stored_scales(lin: Linear, dtype: mx.Dtype, compact: bool) -> tuple[mx.array, mx.array]:
    """A kept linear's scales and biases as the model stores them: in `dtype`, except the
    compact forms the native kernels decode themselves (exactly) when `compact` (float32
    models on the native kernels): GGUF's two-level form, and float16 / bfloat16 scales as
    a checkpoint or GGUF legacy type holds them (half or a third of float32's bytes)."""
    q = lin.quant
    if q.mode != "affine":  # MXFP4's E8M0 scale bytes, no biases
        return q.scales, q.biases
    if two_level(lin) or (compact and dtype == mx.float32 and q.scales.dtype in (mx.float16, mx.bfloat16)
                          and q.biases.dtype == q.scales.dtype):
        return q.scales, q.biases
    return q.scales.astype(dtype), q.biases.astype(dtype)


def dequantized(lin: Linear, dtype: mx.Dtype) -> Linear:
    lin = row_major(lin)  # (the 8-bit mode's interleaved weights: back in rows)
    if not lin.quantized:
        return Linear(weight=lin.weight.astype(dtype), bias=cast(lin.bias, dtype), origin=lin.origin)
    q = lin.quant
    if q.mode != "affine":
        w = mx.dequantize(lin.weight, q.scales, None, group_size=q.group_size, bits=q.bits, mode=q.mode).astype(dtype)
        return Linear(weight=w, bias=cast(lin.bias, dtype), origin=lin.origin)
    scales, biases = group_params(q.scales, q.biases)
    w = mx.dequantize(
        lin.weight, scales.astype(dtype), biases.astype(dtype),
        group_size=q.group_size, bits=q.bits,
    ).astype(dtype)
    return Linear(weight=w, bias=cast(lin.bias, dtype), origin=lin.origin)


def keep(policy: KeepQuantized, lin: Linear) -> bool:
    """Whether a quantized linear stays quantized: a bool, or a predicate on (group_size,
    bits) (e.g. "the native CPU kernels support this format")."""
    if not lin.quantized:
        return False
    if callable(policy):  # the native kernels' formats: affine only (MXFP4 runs on MLX's kernels)
        return lin.quant.mode == "affine" and bool(policy(lin.quant.group_size, lin.quant.bits))
    return bool(policy)


def widened(policy: KeepQuantized, lin: Linear, force: bool = False, bits: int | None = None) -> Linear:
    """`lin` stored in `bits` (None: the narrowest wider width the policy keeps, else 8)
    with the same scales and biases, when its own width is not kept (or `force`) but `bits`
    of its group size are (e.g. 2-/3-bit weights where the native CPU kernels run 4, 5, 6
    and 8; 4 bits in groups of 16; the narrower parts of a fusion): exact (every stored
    integer fits), and packed instead of a float copy. Otherwise `lin` unchanged."""
    if not lin.quantized:
        return lin
    q = lin.quant
    if bits is None:
        bits = next((w for w in (5, 6) if q.bits < w and callable(policy) and policy(q.group_size, w)), 8)
    if (q.bits >= bits or policy is False or q.mode != "affine"
            or (keep(policy, lin) and not force) or (callable(policy) and not policy(q.group_size, bits))):
        return lin
    k = q.scales.shape[-1] * q.group_size
    words = np.asarray(lin.weight)
    packed = (repacked_8bit(words, q.bits, k) if bits == 8 else
              pack_stream(repacked_8bit(words, q.bits, k).view(np.uint8).reshape(-1, k), bits)
              .reshape(*words.shape[:-1], -1))
    return Linear(weight=mx.array(packed), bias=lin.bias, quant=Quant(q.scales, q.biases, q.group_size, bits),
                  origin=lin.origin)


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
    if not lin.quantized or lin.quant.group_size == group_size:
        return lin
    q = lin.quant
    r = q.group_size // group_size
    if two_level(lin):  # the codes repeated; a super-block's factors serve r times the groups
        return lin.with_quant(scales=mx.repeat(q.scales, r, axis=-1), group_size=group_size)
    return lin.with_quant(scales=mx.repeat(q.scales, r, axis=-1), biases=mx.repeat(q.biases, r, axis=-1),
                          group_size=group_size)


def fuse(parts: list[Linear], dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    """Concatenate linears along the output axis (exact for dense and affine-quantized).
    Quantized parts of different group sizes (a GGUF mix: Q4_K q/k in groups of 32, a Q6_K
    v in groups of 16) are regrouped to the smallest when it divides the others, and parts
    of different widths widened to 8 bits: exact, and still one quantized matrix."""
    origin = sum((p.origin for p in parts), ()) if all(p.origin for p in parts) else ()
    cat = lambda xs: mx.concatenate(xs, axis=0)  # noqa: E731
    if any(p.quantized and p.quant.mode != "affine" for p in parts):  # MXFP4: kept whole, or dense
        if len({p.quant.mode if p.quantized else "affine" for p in parts}) == 1 and keep(keep_quantized, parts[0]):
            q = parts[0].quant
            return Linear(weight=cat([p.weight for p in parts]),
                          bias=None if parts[0].bias is None else cat([p.bias.astype(dtype) for p in parts]),
                          quant=Quant(cat([p.quant.scales for p in parts]), None, q.group_size, q.bits, q.mode),
                          origin=origin)
        parts = [dequantized(p, dtype) if p.quantized else p for p in parts]
    if all(p.quantized for p in parts) and len({p.quant.group_size for p in parts}) > 1:
        g = min(p.quant.group_size for p in parts)
        if all(p.quant.group_size % g == 0 for p in parts) and keep(keep_quantized,
                                                                   parts[0].with_quant(group_size=g, bits=8)):
            parts = [regrouped(p, g) for p in parts]
    parts = [widened(keep_quantized, p) for p in parts]
    if len({(p.quant.scales.dtype, p.quant.biases.ndim) for p in parts if p.quantized}) > 1:  # storage forms differ
        parts = [expanded(p) for p in parts]
        if len({p.quant.scales.dtype for p in parts if p.quantized}) > 1:
            parts = [p.with_quant(scales=p.quant.scales.astype(mx.float32), biases=p.quant.biases.astype(mx.float32))
                     if p.quantized else p for p in parts]
    if (all(p.quantized for p in parts) and len({p.quant.group_size for p in parts}) == 1
            and len({p.quant.bits for p in parts}) > 1):  # mixed widths (a GGUF K-quant mix): the widest
        wide = max(p.quant.bits for p in parts)  # (a kept width: every narrower integer fits; else 8)
        wide = wide if keep(keep_quantized, parts[0].with_quant(bits=wide)) else 8
        parts = [widened(keep_quantized, p, force=True, bits=wide) for p in parts]
    same_q = all(p.quantized for p in parts) and len(
        {(p.quant.group_size, p.quant.bits) for p in parts}
    ) == 1
    if same_q and keep(keep_quantized, parts[0]):
        stored = [stored_scales(p, dtype, callable(keep_quantized)) for p in parts]
        q = parts[0].quant
        return Linear(
            weight=cat([p.weight for p in parts]),
            bias=None if parts[0].bias is None else cat([p.bias.astype(dtype) for p in parts]),
            quant=Quant(cat([s for s, _ in stored]), cat([b for _, b in stored]), q.group_size, q.bits),
            origin=origin,
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
        q = lin.quant
        return Linear(weight=lin.weight, bias=cast(lin.bias, dtype),
                      quant=Quant(scales, biases, q.group_size, q.bits, q.mode))
    lin = widened(keep_quantized, lin)
    if keep(keep_quantized, lin):
        scales, biases = stored_scales(lin, dtype, callable(keep_quantized) and not table)
        q = lin.quant
        return Linear(weight=lin.weight, bias=cast(lin.bias, dtype),
                      quant=Quant(scales, biases, q.group_size, q.bits, q.mode), origin=lin.origin)
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
        return Linear(weight=w, bias=b, quant=Quant(scales, None, 32, 4, "mxfp4"))
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
        return Linear(weight=w, bias=b, quant=Quant(scales, biases, gs, bits))
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
    if lin.quantized and lin.quant.mode == "affine" and callable(keep_quantized) \
            and keep_quantized(lin.quant.group_size, lin.quant.bits):
        scales, biases = stored_scales(lin, dtype, True)
        return attrs.evolve(lin, bias=cast(lin.bias, dtype)).with_quant(scales=scales, biases=biases)
    lin = expanded(lin)  # (stacks run on MLX's gather_qmm: MLX's affine form)
    q = lin.quant
    if lin.quantized and q.mode != "affine":  # MXFP4: packed whatever the policy (exact, 4 bits)
        return lin if keep_quantized is not False else Linear(
            weight=mx.contiguous(mx.dequantize(lin.weight, q.scales, None, group_size=32, bits=4,
                                               mode=q.mode).astype(dtype).swapaxes(-1, -2)),
            bias=cast(lin.bias, dtype), transposed=True)
    if lin.quantized and keep_quantized is not False and q.group_size in GATHER_QMM_GROUPS:
        return Linear(weight=lin.weight, bias=cast(lin.bias, dtype),
                      quant=Quant(q.scales.astype(dtype), q.biases.astype(dtype), q.group_size, q.bits))
    w = lin.weight
    if lin.quantized:
        w = mx.dequantize(w, q.scales.astype(dtype), q.biases.astype(dtype), group_size=q.group_size, bits=q.bits)
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
    if len({(p.quant.group_size, p.quant.bits) if p.quantized else None for p in parts}) != 1:
        raise WeightsError(f"{where}: the experts of '{per_expert}' are stored in different formats")
    stack = lambda xs: mx.stack(xs)  # noqa: E731
    if parts[0].quantized:
        q = parts[0].quant
        return Linear(weight=stack([p.weight for p in parts]),
                      quant=Quant(stack([p.quant.scales for p in parts]), stack([p.quant.biases for p in parts]),
                                  q.group_size, q.bits))
    return Linear(weight=stack([p.weight for p in parts]))


def fuse_experts(gate: Linear, up: Linear, dtype: mx.Dtype, keep_quantized: KeepQuantized) -> Linear:
    """gate and up expert stacks [E, F, H] as one [E, 2F, H] (gate rows first; per-expert
    biases [E, F] likewise), in the representation `finish_experts` keeps: packed if both
    stay quantized, else dense [E, H, 2F] (transposed for gather_mm)."""
    bias = None if gate.bias is None else mx.concatenate([gate.bias, up.bias], axis=-1)
    if gate.quantized and up.quantized and gate.quant.group_size == up.quant.group_size \
            and gate.quant.bits != up.quant.bits:
        gate, up = (widened(keep_quantized, p, force=True) for p in (gate, up))  # exact: 8 bits
    g, u = gate.quant, up.quant
    if gate.quantized and up.quantized and keep_quantized is not False and g.bits == u.bits \
            and g.group_size == u.group_size and g.mode == u.mode \
            and (g.group_size in GATHER_QMM_GROUPS or keep(keep_quantized, gate)):
        if g.mode == "affine" and (g.scales.dtype, g.biases.shape[2:]) != (u.scales.dtype, u.biases.shape[2:]):
            # stored in different scale forms (a K-quant and a legacy type): one, float32
            gate, up = (expanded(p).with_quant(scales=expanded(p).quant.scales.astype(mx.float32),
                                               biases=expanded(p).quant.biases.astype(mx.float32)) for p in (gate, up))
            g, u = gate.quant, up.quant
        cat = lambda xs: mx.concatenate(xs, axis=1)  # noqa: E731
        return finish_experts(Linear(weight=cat([gate.weight, up.weight]), bias=bias,
                                     quant=Quant(cat([g.scales, u.scales]),
                                                 None if g.biases is None else cat([g.biases, u.biases]),
                                                 g.group_size, g.bits, g.mode)),
                              dtype, keep_quantized)
    dense = [finish_experts(p, dtype, False).weight for p in (gate, up)]  # [E, H, F] each
    return Linear(weight=mx.concatenate(dense, axis=-1), bias=cast(bias, dtype), transposed=True)


# ---------------------------------------------------------------- reading a family's checkpoint


class Reader:
    """A family's view of a checkpoint while it assembles params: every linear read the
    same way (its quantization from the load options, shapes checked, `where` in errors),
    then finished or fused in the load's dtype and quantization policy. One reader instead
    of a local `lin` / `vec` helper in every `assemble`."""

    def __init__(self, src: TensorSource, opts: LoadOptions) -> None:
        self.src, self.opts = src, opts

    def raw(self, name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        """The linear `name` as stored (not yet finished: to fuse, cut or finish)."""
        return read_linear(self.src, name, out_f, in_f, self.opts.quant_for(name), bias, self.opts.where)

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = False) -> Linear:
        """The linear `name`, finished for the forward."""
        return self.finish(self.raw(name, out_f, in_f, bias))

    def finish(self, lin: Linear, **kwargs: Any) -> Linear:
        return finish(lin, self.opts.dtype, self.opts.keep_quantized, **kwargs)

    def fused(self, parts: list[Linear]) -> Linear:
        """Linears read with `raw`, fused row-wise into one (q|k|v, gate|up)."""
        return fuse(parts, self.opts.dtype, self.opts.keep_quantized)

    def table(self, name: str, rows: int, width: int, lookup_only: bool = False) -> Linear:
        """An embedding table (lookup_only: never used as the output head)."""
        return self.finish(self.raw(name, rows, width), table=True, lookup_only=lookup_only)

    def vec(self, name: str, n: int) -> mx.array:
        """A vector (a norm's weight) in the activation dtype."""
        return self.src.get(name, (n,), self.opts.where).astype(self.opts.dtype)

    def has(self, name: str) -> bool:
        return self.src.has(name)


# A family's checkpoint names as tables, as config fields are (`config.Field`): each entry
# names a params field (`to`), the tensor(s) it is read from and their sizes; `read_tensors`
# reads a table under a prefix. Sizes and flags are numbers / bools, or names looked up in
# the `sizes` given to `read_tensors`, else as the config's attributes ("hidden_size",
# "qkv_bias"): the table stays data while the shapes follow the config. Every tensor goes
# through `TensorSource.get` / `read_linear`, so a missing or misshapen one is an error
# naming it. `when`: a flag; where false nothing is read and the field is None (unless
# another entry of the table reads it: a field stored in either of two layouts).
Size = Union[int, str]
Flag = Union[bool, str]


@attrs.frozen
class Vec:
    """A vector or small array (a norm's weight, attention sinks) of `shape`, in the
    activation dtype, or kept in float32 (`float32`). `plus`: a number (a size name) added in
    float32 first (norms stored as w of 1 + w)."""

    to: str
    name: str
    shape: Size | tuple[Size, ...]
    when: Flag = True
    plus: float | str | None = None
    float32: bool = False

    def read(self, rd: Reader, name: Callable[[str], str], value: Callable[[Any], Any]) -> mx.array:
        shape = tuple(value(n) for n in (self.shape if isinstance(self.shape, tuple) else (self.shape,)))
        t = rd.src.get(name(self.name), shape, rd.opts.where)
        if self.float32:
            return t.astype(mx.float32)
        if self.plus is None:
            return t.astype(rd.opts.dtype)
        return (t.astype(mx.float32) + value(self.plus)).astype(rd.opts.dtype)


@attrs.frozen
class Norm:
    """A LayerNorm: (`name`.weight, `name`.bias where `bias`, else None) of `size`."""

    to: str
    name: str
    size: Size = "hidden_size"
    bias: Flag = True
    when: Flag = True

    def read(self, rd: Reader, name: Callable[[str], str], value: Callable[[Any], Any]) -> tuple:
        base, n = name(self.name), value(self.size)
        return rd.vec(base + ".weight", n), (rd.vec(base + ".bias", n) if value(self.bias) else None)


@attrs.frozen
class Lin:
    """A linear [rows, cols] (weight, `bias` where set, dense or quantized), finished."""

    to: str
    name: str
    rows: Size
    cols: Size
    bias: Flag = False
    when: Flag = True

    def read(self, rd: Reader, name: Callable[[str], str], value: Callable[[Any], Any]) -> Linear:
        return rd.linear(name(self.name), value(self.rows), value(self.cols), value(self.bias))


@attrs.frozen
class Fused:
    """Linears stored apart and fused row-wise into one, in order: `parts` are
    (name, rows), each [rows, cols] with `bias` where set (q|k|v, gate|up)."""

    to: str
    parts: tuple[tuple[str, Size], ...]
    cols: Size
    bias: Flag = False
    when: Flag = True

    def read(self, rd: Reader, name: Callable[[str], str], value: Callable[[Any], Any]) -> Linear:
        cols, bias = value(self.cols), value(self.bias)
        return rd.fused([rd.raw(name(n), value(rows), cols, bias) for n, rows in self.parts])


@attrs.frozen
class Embedding:
    """An embedding table [rows, cols]; `lookup_only`: never the output head (it may stay
    quantized in any format, see `finish`)."""

    to: str
    name: str
    rows: Size = "vocab_size"
    cols: Size = "hidden_size"
    lookup_only: Flag = False
    when: Flag = True

    def read(self, rd: Reader, name: Callable[[str], str], value: Callable[[Any], Any]) -> Linear:
        return rd.table(name(self.name), value(self.rows), value(self.cols), bool(value(self.lookup_only)))


Entry = Union[Vec, Norm, Lin, Fused, Embedding]


def read_tensors(rd: Reader, table: tuple[Entry, ...], cfg: Any, prefix: str = "", i: int | None = None,
                 sizes: dict[str, Any] | None = None, rename: dict[str, str] | None = None) -> dict[str, Any]:
    """The params fields of `table` (field name -> value, in table order) read from the
    tensors under `prefix` (with `{i}`: layer i's). `rename`: the table's names -> this
    checkpoint's (a GGUF file's, read as they are so that errors name its tensors), the
    prefix included; every name the table reads must be in it."""
    def value(v: Any) -> Any:  # a size or flag: as given, or by name (sizes, else the config)
        if not isinstance(v, str):
            return v
        return sizes[v] if sizes is not None and v in sizes else getattr(cfg, v)

    pre = (prefix if rename is None or not prefix else rename[prefix]).format(i=i)

    def name(n: str) -> str:
        return pre + (n if rename is None else rename[n])

    out: dict[str, Any] = {}
    for e in table:  # (two entries of one field: alternative layouts, the one whose `when` holds read)
        if value(e.when):
            out[e.to] = e.read(rd, name, value)
        else:
            out.setdefault(e.to, None)
    return out


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


def renamed_name(name: str, rules: tuple[tuple[str, str], ...]) -> str:
    """`name` through every (pattern, replacement) rule in order."""
    import re

    for pattern, repl in rules:
        name = re.sub(pattern, repl, name)
    return name


def renamed(src: TensorSource, rules: tuple[tuple[str, str], ...]) -> TensorSource:
    """The tensors under new names (`renamed_name`: GGUF -> Hugging Face names; the GGUF
    name is kept in the origin for errors)."""
    out = TensorSource()
    for name, t in src.tensors.items():
        new = renamed_name(name, rules)
        out.tensors[new], out.origin[new] = t, f"{src.origin[name]} ({name})"
    return out
