"""fx-engine's native CPU kernels as pure ops (MLX primitives): the core's view of them.

The extension is a shared library built and loaded by the shell
(`fx_engine.runtime.native.ensure()`, which `fx_engine.load` calls on the CPU); it then
`install`s it here, once per process. These wrappers never build, load, read files or the
environment: calling one before the extension is installed is a clear error. Whether a
model uses them at all is its params' static `Numerics.native` (part of the compile key).
"""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

_EXTENSION: list[ModuleType] = []  # the one installed extension (a loaded library, like MLX)
_UNAVAILABLE: list[str] = []  # why it could not be loaded, when the shell tried and failed

QMM_BITS = (4, 5, 6, 8)  # 5 and 6: unpacked to bytes a block of rows at a time
FEW_GEMM_ROWS = 16  # qgemm's few-row path takes up to this many rows (qmatmul.h QG_FEW)


def install(module: ModuleType | None, why: str = "") -> None:
    """Make a loaded extension the one these ops call (the shell's `ensure` does this), or
    record why there is none (module None)."""
    _EXTENSION[:] = [] if module is None else [module]
    _UNAVAILABLE[:] = [why] if module is None and why else []


def installed() -> ModuleType | None:
    return _EXTENSION[0] if _EXTENSION else None


def _module() -> ModuleType:
    if not _EXTENSION:
        why = _UNAVAILABLE[0] if _UNAVAILABLE else "not loaded in this process"
        raise RuntimeError(f"these params use fx-engine's native kernels ({why}); call "
                           "fx_engine.runtime.native.ensure() first (fx_engine.load does), or "
                           "load with native=False")
    return _EXTENSION[0]


def qmm(x, w, scales, biases, group_size: int, bits: int, add=None):  # type: ignore[no-untyped-def]
    """x[..., K] @ dequantize(w, scales, biases).T -> [..., N]: a pure op (an MLX primitive).
    scales / biases (every product and dequantize alike): float32, float16 or bfloat16
    pairs [N, K / group_size], or GGUF's K-quant two-level form (int16 scales [N, groups],
    float16 biases [N, super-blocks, 2]; `nn.group_params`), each decoded in the kernel
    to the same float32 values: the same bits, fewer bytes. add (every product alike): a
    float32 array of the product's shape, returned as add + product from the same node (a
    residual branch's last projection: the separate add's bits without its graph node)."""
    return _module().qmm(x, w, scales, biases, group_size, bits, add)


def qgemm(x, w, scales, biases, group_size: int, bits: int, add=None):  # type: ignore[no-untyped-def]
    """qmm's product with the many-rows kernel: vectors along the rows of x, register tiles
    of 12 features x 32 rows. ~2x qmm's speed from ~16 rows up; below that most vector
    lanes are padding. Batch-invariant too, with another fixed summation order than qmm
    (each output a sequential float32 sum over K), so the two differ in the last bits."""
    return _module().qgemm(x, w, scales, biases, group_size, bits, add)


def qmm_a8(x, w, scales, biases, group_size: int, bits: int, interleaved: bool = False, add=None):  # type: ignore[no-untyped-def]
    """The product with 8-bit activations (`Numerics.activation_bits == 8`): each row of x
    rounded per weight group (d = amax / 127, xq = rint(x / d)), y = x_hat @ w_hat.T with
    exact int32 dot products per group, combined in float32 in group order. A different
    (coarser) numerics than qmm/qgemm, like llama.cpp's 8-bit activations; batch-invariant
    and tile-independent bit for bit (the integer sums are exact). interleaved: w is
    `interleave16(w)` (4 or 8 bits, rows a multiple of 16; 5 or 6 bits:
    `interleave16_planes(w, bits)` where `il_planes()`), scales and biases `interleave16_groups`'s (the K-quant form: its
    codes `interleave16_groups`'s, its factors `interleave16_factors`'): the same bits, each
    16-row block read as one contiguous stream, its scales converted as they are read."""
    return _module().qmm_a8(x, w, scales, biases, group_size, bits, interleaved, add)


GATHER_KINDS = {"qmm": 0, "qgemm": 1, "qmm_a8": 2, "qmm_a8_il": 3}


def gather_qmm(x, indices, w, scales, biases, group_size: int, bits: int, kind: str = "qmm"):  # type: ignore[no-untyped-def]
    """Stacked experts' products: x [T, 1 or k, K], indices [T, k] into w [E, N, K packed]
    (scales and biases [E, N, ...] in any form qmm takes) -> [T, k, N], out[t, j] =
    x[t, j or 0] @ dequantize(w[indices[t, j]]).T. The pairs are grouped by expert inside
    the kernel and each group runs through `kind` ("qmm", "qgemm" or "qmm_a8", the same
    bits as that 2-D product on the expert's matrix; "qmm_a8_il": qmm_a8 on a stack whose
    matrices are each in its interleaved layout, nn.interleave_for_a8), so only the chosen
    experts' packed bytes are read, once per step."""
    return _module().gather_qmm(x, indices, w, scales, biases, group_size, bits, GATHER_KINDS[kind])


def interleave16(w: "mx.array") -> "mx.array":
    """A packed uint32 weight [N, words] (N a multiple of 16, words a multiple of 4) in
    qmm_a8's interleaved layout: per block of 16 rows and per 4 words (16 bytes) of each row,
    the 16 rows' words word by word ([word][row]), so a decode step reads each block as one
    contiguous stream of whole vectors instead of 16 interleaved row streams transposed in
    registers (issue 41). The same shape and bytes, reordered; a pure op."""
    n, words = w.shape
    if n % 16 or words % 4:
        raise ValueError(f"interleave16: needs rows a multiple of 16 and words a multiple of 4, got {tuple(w.shape)}")
    return mx.contiguous(w.reshape(n // 16, 16, words // 4, 4).transpose(0, 2, 3, 1).reshape(n, words))


def deinterleave16(w: "mx.array") -> "mx.array":
    """`interleave16`'s inverse: the packed weight back in rows."""
    n, words = w.shape
    return mx.contiguous(w.reshape(n // 16, words // 4, 4, 16).transpose(0, 3, 1, 2).reshape(n, words))


def _unpack_bits(w: "mx.array", bits: int) -> "mx.array":
    """MLX's 5- or 6-bit packing (a little-endian bit stream: 8 values per `bits` bytes)
    [N, words] -> the values [N, K] as uint32."""
    n = w.shape[0]
    b = w.view(mx.uint8).reshape(n, -1, bits).astype(mx.uint64)
    x = (b << mx.arange(0, 8 * bits, 8, dtype=mx.uint64)).sum(-1)  # 8 * bits bits a group
    return ((x[..., None] >> mx.arange(0, 8 * bits, bits, dtype=mx.uint64)) & ((1 << bits) - 1)).astype(mx.uint32).reshape(n, -1)


def _pack_bits(v: "mx.array", bits: int) -> "mx.array":
    """`_unpack_bits`' inverse: values [N, K] -> MLX's packed words [N, K * bits / 32]."""
    n = v.shape[0]
    x = (v.astype(mx.uint64).reshape(n, -1, 8) << mx.arange(0, 8 * bits, bits, dtype=mx.uint64)).sum(-1)
    b = (x[..., None] >> mx.arange(0, 8 * bits, 8, dtype=mx.uint64)) & 255
    return b.astype(mx.uint8).reshape(n, -1).view(mx.uint32)


def _shifts(n: int, step: int) -> "mx.array":
    return mx.arange(0, n * step, step, dtype=mx.uint32)


def planes_shape_ok(w: "mx.array", bits: int) -> bool:
    """Whether a packed 5- or 6-bit weight [N, words] fits the planes layout: N a multiple
    of 16, K = words * 32 / bits a multiple of 32."""
    return (bits in (5, 6) and w.ndim == 2 and w.shape[0] % 16 == 0
            and (w.shape[1] * 32) % (bits * 32) == 0)


def interleave16_planes(w: "mx.array", bits: int = 6) -> "mx.array":
    """A 5- or 6-bit packed weight [N, words] (N a multiple of 16, K = words * 32 / bits a
    multiple of 32) in qmm_a8's planes layout (the runtime's ilp_base): per block of 16 rows
    and per 32-k step, 16 * bits words: the values' low 4 bits as 4 words per row in 4-bit
    packing (nibble j of word i = value 8i + j), [word][row]; then their high bits as
    bits - 4 words per row, [word][row]: 6 bits: byte b of word p holds at bits 2i the high
    2 bits of value 8i + 2b + p; 5 bits: byte b of the word holds at bit i the high bit of
    value 8i + 2b, at bit 4 + i that of value 8i + 2b + 1. So the 8-bit mode's few-row
    product reads one contiguous stream and builds each weight byte with a shift, a mask
    and an or. The same shape and bit count; a pure op."""
    if not planes_shape_ok(w, bits):
        raise ValueError(f"interleave16_planes: needs {bits} in (5, 6), rows a multiple of 16 and K a "
                         f"multiple of 32, got {tuple(w.shape)}")
    n, words = w.shape
    v = _unpack_bits(w, bits).reshape(n, -1, 4, 8)  # [N, steps, i, j]: value 8i + j of the step
    lo = ((v & 15) << _shifts(8, 4)).sum(-1).astype(mx.uint32)  # [N, S, 4]
    hi = (v >> 4).reshape(n, -1, 4, 4, 2)  # [N, S, i, b, p]: value 8i + 2b + p
    if bits == 6:
        hi = (hi << (_shifts(4, 2)[:, None, None] + _shifts(4, 8)[None, :, None])).sum((2, 3))  # [N, S, p]
    else:
        hi = (hi << (_shifts(4, 1)[:, None, None] + _shifts(4, 8)[None, :, None]
                     + _shifts(2, 4)[None, None, :])).sum((2, 3, 4))[..., None]  # [N, S, 1]
    planes = mx.concatenate([lo, hi.astype(mx.uint32)], axis=-1)  # [N, S, bits]
    return mx.contiguous(planes.reshape(n // 16, 16, -1, bits).transpose(0, 2, 3, 1).reshape(n, words))


def deinterleave16_planes(w: "mx.array", bits: int = 6) -> "mx.array":
    """`interleave16_planes`' inverse: the weight back in rows (MLX's packing)."""
    n = w.shape[0]
    return planes_to_rows(w.reshape(n // 16, -1, bits, 16).transpose(0, 3, 1, 2).reshape(n, -1, bits), bits)


def il16_take(a: "mx.array", rows: "mx.array") -> "mx.array":
    """Rows `rows` [T] of an array in a 16-row interleaved layout ([block][element][16]:
    `interleave16`'s words, `interleave16_groups`' scales, `interleave16_factors`' factors,
    `interleave16_planes`' words) gathered straight into rows [T, *a.shape[1:]] (for the
    planes: each row's [steps, bits] words, `planes_to_rows`' input): only the T rows'
    elements are read, not their blocks."""
    per = a.size // a.shape[0]  # elements per row
    base = (rows // 16) * (16 * per) + rows % 16
    idx = base.astype(mx.int64)[:, None] + mx.arange(per, dtype=mx.int64)[None, :] * 16
    return mx.take(a.reshape(-1), idx.reshape(-1)).reshape(rows.shape[0], *a.shape[1:])


def planes_to_rows(blk: "mx.array", bits: int) -> "mx.array":
    """Rows' planes words [N, steps, bits] (`interleave16_planes`' words of each row, in
    order) -> those rows in MLX's packing [N, steps * bits]."""
    n = blk.shape[0]
    lo = (blk[..., :4, None] >> _shifts(8, 4)) & 15  # [N, S, i, j]
    if bits == 6:
        hi = (blk[..., 4:, None, None] >> (_shifts(4, 2)[:, None] + _shifts(4, 8)[None, :])) & 3  # [N, S, p, i, b]
        hi = hi.transpose(0, 1, 3, 4, 2)  # [N, S, i, b, p]
    else:
        hi = (blk[..., 4, None, None, None] >> (_shifts(4, 1)[:, None, None] + _shifts(4, 8)[None, :, None]
                                                 + _shifts(2, 4)[None, None, :])) & 1  # [N, S, i, b, p]
    return _pack_bits((lo | (hi.reshape(lo.shape) << 4)).reshape(n, -1), bits)


def il_planes() -> bool:
    """Whether this build's qmm_a8 reads 5- and 6-bit weights in the planes layout
    (`interleave16_planes`: AVX-512 VNNI and AVX2 builds)."""
    return bool(getattr(_module(), "il_planes", False))


def interleave16_factors(f: "mx.array", inverse: bool = False) -> "mx.array":
    """The two-level K-quant form's factors [N, super-blocks, 2] (float16 (d, e) per row and
    super-block) in the order an interleaved weight's product reads them: per block of 16
    rows, [super-block][d or e][row] (inverse: back in rows). The same shape."""
    n, sbk, two = f.shape
    if inverse:
        return mx.contiguous(f.reshape(n // 16, sbk, two, 16).transpose(0, 3, 1, 2).reshape(n, sbk, two))
    return mx.contiguous(f.reshape(n // 16, 16, sbk, two).transpose(0, 2, 3, 1).reshape(n, sbk, two))


def interleave16_groups(a: "mx.array", inverse: bool = False) -> "mx.array":
    """Per-group scales or biases [N, groups] (float32, float16 or bfloat16; the K-quant
    form's int16 codes) in the order an interleaved weight's product reads them: per block
    of 16 rows, [group][row] (inverse: back in rows)."""
    n, g = a.shape
    if inverse:
        return mx.contiguous(a.reshape(n // 16, g, 16).transpose(0, 2, 1).reshape(n, g))
    return mx.contiguous(a.reshape(n // 16, 16, g).transpose(0, 2, 1).reshape(n, g))


def int8_dot() -> bool:
    """Whether qmm_a8 runs the CPU's int8 dot products (AVX-512 VNNI, AVX-VNNI or AVX2's
    vpmaddubsw); without them it runs a scalar loop: the same values, much slower."""
    return bool(getattr(_module(), "int8_dot", False))


def int8_dot_isa() -> str:
    """Which instructions qmm_a8's exact integer sums run on this build."""
    return str(getattr(_module(), "int8_dot_isa", "unknown"))


def amx() -> bool:
    """Whether qmm_a8's many-row tiles (above 32 rows, interleaved weights: prefill in the
    8-bit mode) run their integer sums on Intel AMX here: a build for AMX-INT8, the tile
    state granted by the kernel, not turned off (FX_ENGINE_AMX=0). The same bits either way."""
    f = getattr(_module(), "amx", None)
    return bool(f()) if f is not None else False


def tiled_gemm() -> bool:
    """Whether qgemm's register tile fits this build's vector registers (AVX-512); AVX2
    builds run qgemm's few-row path at every row count instead (fx-engine info)."""
    return bool(getattr(_module(), "tiled_gemm", False))



def few_gemm() -> bool:
    """Whether qgemm has its few-row path (vectors along the features, weights dequantized
    in registers: AVX-512 and AVX2 builds), the fast kernel for decode batches."""
    return bool(getattr(_module(), "few_gemm", False))


def isa() -> str:
    """The vector instruction set this build's kernels were written for: avx512, avx2,
    neon or generic."""
    return str(getattr(_module(), "isa", "generic"))


def dequantize(w, scales, biases, group_size: int, bits: int):  # type: ignore[no-untyped-def]
    """Affine dequantization to float32 [N, K] (multi-threaded; the same values as
    mx.dequantize), from the unpacking qmm and qgemm use (the tests check it bit for bit).
    fx_engine.core.nn runs a BLAS GEMM on it for many-row products where qgemm's tile does not
    fit the build (no AVX-512)."""
    return _module().dequantize(w, scales, biases, group_size, bits)


def supports(group_size: int, bits: int, activation_bits: int | None = None) -> bool:
    """Whether the native products run this format: 4 or 8 bits in groups of a multiple of
    32; 5 and 6 bits (GGUF's Q5_0/Q5_1/Q5_K, Q6_K: unpacked to bytes a block of rows at a
    time, then the 8-bit code) likewise; 5, 6 and 8 bits also in groups of 16 (Q6_K's).
    With 8-bit activations (qmm_a8: exact int8 dot products, the activations rounded per
    weight group) the same formats."""
    if bits not in QMM_BITS or group_size <= 0 or activation_bits not in (None, 8):
        return False
    return group_size % 32 == 0 or (bits >= 5 and group_size == 16)


def masked_softmax(scores, mask):  # type: ignore[no-untyped-def]
    """Softmax over the last axis of float32 scores [B, H, T, S], taking only the slots where
    bool mask [B, T, S] is set (softmax(where(mask, scores, finfo.min)), one pass, `fast_exp`'s
    polynomial)."""
    return _module().masked_softmax(scores, mask)


def rms_norm(x, weight, eps: float):  # type: ignore[no-untyped-def]
    """x * rsqrt(mean(x**2, -1) + eps) * weight, in float32, in one node."""
    return _module().rms_norm(x, weight, eps)


def kv_put(cache, new, slots):  # type: ignore[no-untyped-def]
    """cache [B, H, S, D] (float32/float16) with new [B, H, T, D] written at slots [B, T]:
    mx.put_along_axis(cache, slots[:, None, :, None], new, axis=2) in one node, in place
    when the cache's buffer is donatable. Slots outside [0, S) are skipped."""
    return _module().kv_put(cache, new, slots)


def qkv_rope_put(qkv, cos, sin, traditional: bool, q_heads: int, keys, values, slots):  # type: ignore[no-untyped-def]
    """An attention layer's inputs from its fused projection in three nodes (one per output,
    so the caches can be written in place): qkv [B*T, (Hq +
    2 Hk) * D] float32 (q | k | v heads), RoPE tables cos / signed sin [B, T, 1, D]
    (`nn.rope_tables`), caches keys / values [B, Hk, S, D] (float32 / float16), slots
    [B, T] -> (q [B, T, Hq, D] rotated, keys, values with the rotated k and v written at
    the slots). The same values as reshape + slices + `rope` + transposes + `kv_put` (float16
    caches: rounded to nearest even, as astype); in place when the caches are donatable;
    slots outside [0, S) are skipped."""
    return tuple(_module().qkv_rope_put(qkv, cos, sin, traditional, q_heads, keys, values, slots))


def add_rms_norm(h, a, weight, eps: float):  # type: ignore[no-untyped-def]
    """(h + a, rms_norm(h + a, weight, eps)) for float32 h, a [..., D] in one node: a residual
    add and the next pre-norm (the same values as the add and `rms_norm`)."""
    return tuple(_module().add_rms_norm(h, a, weight, eps))


def swiglu(gu):  # type: ignore[no-untyped-def]
    """silu(gate) * up for the fused gate|up projection gu [..., 2F] -> [..., F], in one
    node, with fx_engine.core.nn.fast_exp's arithmetic (float32)."""
    return _module().swiglu(gu)


def attend(q, k, v, mask, scale: float, flat: bool = False):  # type: ignore[no-untyped-def]
    """Grouped-query attention in one node: q [B, T, Hq, D] (float32) over the first S
    slots of k/v [B, Hk, >= S, D] (the whole cache, or strided views of it, read in place),
    bool mask [B, T, S] -> [B, T, Hq * D] ([B*T, Hq * D] if flat: what the output
    projection reads, without a reshape node)."""
    return _module().attend(q, k, v, mask, scale, flat)


def rope(x, cos, sin, traditional: bool):  # type: ignore[no-untyped-def]
    """RoPE with precomputed tables (fx_engine.core.nn.rope_tables): x [B, T, H, D] float32,
    cos / signed sin [B, T, 1, D]."""
    return _module().rope(x, cos, sin, traditional)
