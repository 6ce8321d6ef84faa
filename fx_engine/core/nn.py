"""Shared pure layers: linear (dense or affine-quantized), norms, RoPE, attention.

Everything here is a pure function of arrays and static metadata. `Numerics` is static
metadata carried by the params pytree; it selects the batch-invariant matmul mode.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core import kernels
from fx_engine.core.tree import static_field, tree_replace


@attrs.frozen
class MatmulPlan:
    """Which native kernel runs a float32-activation quantized product (static, part of the
    compile key through `Numerics`). Chosen per machine by the shell when a model loads
    (`fx_engine.runtime.native.plan`: measured on the model's own shapes, cached per build); the
    default is what AVX-512 builds measure.

    kernel: "qgemm" or "qmm", the fixed-arithmetic kernel for every row count (both are
    batch-invariant; qgemm also has the few-row path for decode batches).
    gemm_from: in the default (not batch-invariant) mode, products of at least this many
    rows run a BLAS GEMM on the natively dequantized weight instead (0: never). Always
    above qgemm's few-row path, so decode and verify steps share one kernel.
    """

    kernel: str = "qgemm"
    gemm_from: int = 0

    def __attrs_post_init__(self) -> None:
        if self.kernel not in ("qgemm", "qmm"):
            raise ValueError(f"MatmulPlan.kernel must be 'qgemm' or 'qmm', got {self.kernel!r}")
        if self.gemm_from != 0 and self.gemm_from <= kernels.FEW_GEMM_ROWS:
            raise ValueError(f"MatmulPlan.gemm_from must be 0 or above {kernels.FEW_GEMM_ROWS}, "
                             f"got {self.gemm_from}")


@attrs.frozen
class Numerics:
    """Static numerics policy (part of the compile key).

    batch_invariant: every matmul runs on fixed-size row tiles (`tile` rows, zero-padded),
    so one row's arithmetic never depends on how many other rows share the GEMM (the batch,
    or the prefill chunk). With an optimized BLAS the kernel choice and blocking depend on M,
    which otherwise changes a row's result in the last bits. The same holds for the
    contraction over cache slots in attention: its length is the attention span, which
    depends on the other rows, so `P @ V` is computed per fixed block of `kv_block` slots
    and the blocks are summed in order (trailing blocks past every row's length add exact
    zeros).
    """

    batch_invariant: bool = False
    tile: int = 8
    kv_block: int = 64  # batch-invariant attention sums P @ V over fixed blocks of slots
    # fx_engine.core.kernels for 4-/8-bit linears (CPU), batch-invariant by construction.
    # `matmul` says which: one kernel at every row count in batch-invariant mode (and in
    # the default mode below `matmul.gemm_from`), so a token's matmuls never depend on its
    # batch or chunk there. Measured at load per machine (fx_engine.runtime.native.plan, by a
    # request's time over each kernel layout's products): on the Zen 4 machine of
    # 2026-12-06 qmm for the default model (its 8-bit head weighed in; the 4-bit layers
    # alone were a tie) and the 1B shape (its fused one-row path ~1.5x qgemm's, its
    # many-row tiles level with them), on AVX-512 and AVX2 builds alike.
    native: bool = False
    matmul: MatmulPlan = MatmulPlan()
    # 8: the native kernels round each activation row to 8 bits per weight group before a
    # quantized matmul (`native.qmm_a8`: exact int8 dot products, 1.7-2.8x `native.qgemm`'s
    # speed from 8 rows up on the default model's shapes), as llama.cpp does for its
    # 4-/8-bit weights. Other numerics
    # than the default (default model: next-token KL ~2e-3 from float32, the argmax the
    # same on 98% of a text): opt-in. Batch-invariant by construction, in either mode.
    # None: float32 activations.
    activation_bits: int | None = None


@attrs.frozen
class Quant:
    """How a quantized linear's weight is stored (`Linear.quant`): MLX's packed integers
    ([out, in * bits / 32] uint32 rows) with one scale per group of `group_size` inputs and,
    in "affine" mode, one bias per group; "mxfp4" (a GGUF's MXFP4 tensors): E2M1 codes with
    E8M0 uint8 scales, no biases (expert stacks run by gather_qmm, matrices by
    quantized_matmul: MLX's kernels, no native one). `interleaved`: the packed weight is in
    qmm_a8's interleaved layout (`kernels.interleave16`: 16-row blocks, word by word; 5-/6-bit
    weights `interleave16_planes`; scales and biases likewise, `interleave16_groups` /
    `interleave16_factors`), which only the 8-bit mode's native product and `embed` read:
    set at load for its matrices (`interleave_for_a8`; a tied embedding table too). Anything
    else reading `weight` as rows (MLX's kernels, dequantize, slicing rows) must call
    `row_major` first; the products refuse an interleaved weight."""

    scales: mx.array
    biases: mx.array | None
    group_size: int = static_field()
    bits: int = static_field()
    mode: str = static_field(default="affine")
    interleaved: bool = static_field(default=False)
    # m where every bias is m * its scale in float32 (GGUF's Q4_0 / Q5_0 / Q8_0: w = d (q -
    # 2^(bits-1))), found by `implied_bias` when the 8-bit mode interleaves the matrix: its
    # product then reads the float16 scales alone (kernels.qmm_a8 with biases [m]), 2 bytes
    # of parameters a group instead of 4 (a 1B Q4_0 decode step: 61 of 842 MB). `biases`
    # stays, for the lookups and for `row_major`. None: the biases are read. The float32
    # numerics' native products read the same form in rows (`with_implied_bias`).
    bias_multiplier: float | None = static_field(default=None)


@attrs.frozen
class Shard:
    """A tensor-parallel linear's part (core/parallel.py). "sum": this rank holds input
    features [first, end) of `width`: the partial products (adapters' included) are summed
    over the ranks (before the bias). "vocab": this rank holds rows [first, first + rows) of
    a vocabulary-sized table of `width` rows, padded to the same rows on every rank: as a
    linear the outputs are gathered over the ranks (then cut to `width`), as a table each
    rank looks up its own rows and the embeddings are summed. `group`: the mx.distributed
    group the collectives span: None, the world group (tensor parallelism alone); a subgroup
    when tensor and pipeline parallelism combine (each stage's ranks split its layers:
    core/parallel.on_group)."""

    kind: str  # "sum" | "vocab"
    first: int
    width: int
    end: int = 0  # ("sum" only)
    group: Any = None


@attrs.frozen
class Linear:
    """y = x @ W.T (+ bias). Dense float or quantized ([out, in/packing], `quant`).

    Dense weights are stored transposed ([in, out], `transposed=True`) when loaded for
    matmul only: `x @ W` then needs no transpose node in the graph. Embedding tables stay
    [vocab, hidden] so rows can be gathered.
    """

    weight: mx.array
    bias: mx.array | None = None
    quant: Quant | None = None  # None: a dense weight
    transposed: bool = static_field(default=False)
    # Where the rows come from: ((checkpoint module name, rows), ...) in row order (a
    # tensor-parallel shard: (name, rows kept, first row kept, the module's rows)), set by
    # `checkpoint.read_linear` and kept through fusion and re-representation, so adapters
    # trained on the checkpoint's modules find their rows (core/adapters.py). () when the
    # weight was transformed (scaled, sliced): no adapter may target it; a name "<module>
    # (why)" refuses the module's adapters with that reason.
    origin: tuple = static_field(default=())
    # Per-row low-rank adapters bound for one step (`adapters.with_adapters`); None: none.
    lora: "LoraBinding | None" = None
    shard: Shard | None = static_field(default=None)  # None: a whole linear

    def with_quant(self, **changes: Any) -> "Linear":
        """This quantized linear with fields of its `quant` changed (scales, bits, ...)."""
        return tree_replace(self, quant=tree_replace(self.quant, **changes))

    @property
    def dense_out_in(self) -> mx.array:
        """The dense weight as [out, in] (a view; for tools and tests)."""
        if self.quantized:
            raise ValueError("dense_out_in: quantized weight (use mx.dequantize)")
        return self.weight.T if self.transposed else self.weight

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    @property
    def interleaved(self) -> bool:
        """Whether the packed weight is in qmm_a8's interleaved layout (`Quant.interleaved`)."""
        return self.quant is not None and self.quant.interleaved

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[-1] if self.transposed else self.weight.shape[-2])

    @property
    def in_features(self) -> int:
        if self.quantized:
            return int(self.quant.scales.shape[-1] * self.quant.group_size)
        return int(self.weight.shape[-2] if self.transposed else self.weight.shape[-1])


def shard_group(lin: Linear) -> Any:
    """The mx.distributed group a linear's collectives span (`Shard.group`; None: the world
    group, or a whole linear): where a norm over a split vector sums its squares."""
    return None if lin.shard is None else lin.shard.group


def linears(tree: object) -> list[Linear]:
    """Every Linear in a params pytree (attrs classes, tuples, lists, dicts), in order."""
    out: list[Linear] = []

    def walk(node: object) -> None:
        if isinstance(node, Linear):
            out.append(node)
        elif attrs.has(type(node)):
            for f in attrs.fields(type(node)):
                walk(getattr(node, f.name))
        elif isinstance(node, (tuple, list)):
            for x in node:
                walk(x)
        elif isinstance(node, dict):
            for x in node.values():
                walk(x)

    walk(tree)
    return out


def group_params(scales: mx.array, biases: mx.array) -> tuple[mx.array, mx.array]:
    """A quantized linear's group scales and biases in MLX's affine form ([..., groups]
    each, for mx.dequantize / mx.quantized_matmul): float arrays as stored; GGUF's K-quant
    two-level form (int16 scales: signed 8-bit scale code a in the low byte, bias code c in
    the high one; float16 biases [..., super-blocks, 2]: the factors (d, e)) decoded to
    float32 s = d * a, b = -(e * c), exactly the native kernels' values
    (runtime/native/scales.h). The loader stores that form only where the native kernels
    run a linear; this is the path of lookups and of the MLX fallbacks."""
    if scales.dtype not in (mx.int16, mx.int8):
        return scales, biases
    if scales.dtype == mx.int8:  # one code for both (`one_code`: an interleaved Q6_K / Q3_K matrix)
        a = c = scales.astype(mx.float32)
    else:
        codes = scales.view(mx.int8).reshape(*scales.shape, 2).astype(mx.float32)  # little-endian bytes
        a, c = codes[..., 0], codes[..., 1]
    per = scales.shape[-1] // biases.shape[-2]
    d, e = (mx.repeat(biases[..., i].astype(mx.float32), per, axis=-1) for i in (0, 1))
    return d * a, -(e * c)


def one_code(codes: mx.array) -> mx.array | None:
    """The two-level form's int16 codes as int8 where every group's bias code equals its
    scale code (GGUF's Q6_K: (sc, sc); Q3_K: (sc - 32, sc - 32)), else None: the kernels'
    SF_KQ1 form, the same floats from half the code bytes (checked on the values)."""
    pair = codes.view(mx.int8).reshape(*codes.shape, 2)
    return pair[..., 0] if bool(mx.all(pair[..., 0] == pair[..., 1]).item()) else None


def two_codes(codes: mx.array) -> mx.array:
    """`one_code`'s inverse: int8 codes a -> the int16 codes (a, a)."""
    lo = codes.view(mx.uint8).astype(mx.uint16)
    return (lo | (lo << 8)).view(mx.int16)


def _native_ok(lin: Linear, numerics: Numerics) -> bool:
    return (numerics.native and lin.quantized and lin.quant.mode == "affine"
            and kernels.supports(lin.quant.group_size, lin.quant.bits))


def _product_biases(q: Quant) -> mx.array | None:
    """The biases input of a native product of q: the stored biases, or the one float32
    multiplier of a matrix whose biases are its scales times it (`Quant.bias_multiplier`;
    the kernels' SF_F16M form, the same floats), in either layout."""
    if q.bias_multiplier is not None and q.scales.dtype == mx.float16:
        return mx.array([q.bias_multiplier], dtype=mx.float32)
    return q.biases


def _native_matmul(x: mx.array, lin: Linear, numerics: Numerics, add: mx.array | None = None) -> mx.array:
    """The native product; add (float32, the product's shape): add + product, in the same
    node where a native kernel computes it."""
    q = lin.quant
    args = (lin.weight, q.scales, _product_biases(q), q.group_size, q.bits)
    # 8-bit activations: qmm_a8 runs every native format (5- and 6-bit weights, such as a
    # Q4_K_M file's attn_v / ffn_down and a tied Q6_K head: interleaved as planes where the
    # build reads them, else unpacked to bytes per block)
    if numerics.activation_bits == 8 and kernels.supports(q.group_size, q.bits, 8):
        return kernels.qmm_a8(x, *args, interleaved=q.interleaved, add=add)
    _rows_layout(lin)
    plan = numerics.matmul
    rows = 1
    for n in x.shape[:-1]:
        rows *= n
    if not numerics.batch_invariant and plan.gemm_from and rows >= plan.gemm_from:
        y = x @ kernels.dequantize(*args).astype(x.dtype).T
        return y if add is None else add + y
    return (kernels.qgemm if plan.kernel == "qgemm" else kernels.qmm)(x, *args, add=add)


def _rows_layout(lin: Linear) -> None:
    if lin.interleaved:
        raise ValueError("this linear's weight is in qmm_a8's interleaved layout (the 8-bit "
                         "activation mode's): only that mode's native product reads it")


def _back_in_rows(bits: int) -> Callable[[mx.array], mx.array]:
    """The inverse of an interleaved weight's layout (4/8 bits: words; 5/6 bits: planes)."""
    if bits in (5, 6):
        return lambda w: kernels.deinterleave16_planes(w, bits)
    return kernels.deinterleave16


def _per_matrix(fn: Callable[[mx.array], mx.array], a: mx.array, stacked: bool) -> mx.array:
    """fn (a 16-row-block layout op on [rows, ...]) applied to each matrix of a stack
    [E, N, ...] at once: the stack's rows flattened (N a multiple of 16, so no block
    straddles two experts), then shaped back."""
    if not stacked:
        return fn(a)
    return fn(a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])).reshape(a.shape)


def interleave_for_a8(lin: Linear) -> Linear:
    """`lin` with its packed weight in qmm_a8's interleaved layout where that kernel reads it
    (a 4- or 8-bit affine matrix, or a stack of expert matrices, with a multiple of 16 rows;
    5- and 6-bit ones in the planes layout, `kernels.interleave16_planes`, where the build
    reads them); else `lin` unchanged. For the 8-bit mode's matrices only: the same
    products bit for bit, but a decode step reads each block of 16 rows as one contiguous
    stream (issue 41); an expert stack's blocks per expert (`kernels.gather_qmm`'s
    "qmm_a8_il")."""
    q = lin.quant
    if (lin.interleaved or not lin.quantized or q.mode != "affine" or lin.weight.ndim not in (2, 3)
            or lin.weight.shape[-2] % 16 or not kernels.supports(q.group_size, q.bits, 8)):
        return lin
    stacked = lin.weight.ndim == 3
    rows = lin.weight.reshape(-1, lin.weight.shape[-1])
    if kernels.planes_shape_ok(rows, q.bits) and kernels.il_planes():
        layout = partial(kernels.interleave16_planes, bits=q.bits)
    elif q.bits in (4, 8) and lin.weight.shape[-1] % 4 == 0:
        layout = kernels.interleave16
    else:
        return lin
    kq = q.scales.dtype == mx.int16  # the two-level K-quant form: codes and (d, e) factors
    factors = kernels.interleave16_factors if kq else kernels.interleave16_groups
    codes = one_code(q.scales) if kq else None
    scales = q.scales if codes is None else codes  # (a Q6_K matrix: one int8 code a group)
    out = tree_replace(lin, weight=_per_matrix(layout, lin.weight, stacked))
    implied = q.bias_multiplier if q.bias_multiplier is not None else implied_bias(q)
    return out.with_quant(interleaved=True, scales=_per_matrix(kernels.interleave16_groups, scales, stacked),
                          biases=_per_matrix(factors, q.biases, stacked), bias_multiplier=implied)


def with_implied_bias(lin: Linear) -> Linear:
    """`lin` with `Quant.bias_multiplier` recorded where its biases are a multiple of its
    scales (`implied_bias`), for the float32 numerics' native products (rows layout): a
    1B Q4_0 decode step then reads 2 bytes of parameters a group, not 4."""
    if not lin.quantized or lin.quant.bias_multiplier is not None:
        return lin
    m = implied_bias(lin.quant)
    return lin if m is None else lin.with_quant(bias_multiplier=m)


def implied_bias(q: Quant) -> float | None:
    """m when every bias of q is exactly m * its scale in float32 (float16 scales and
    biases; m = -2^(bits-1), a GGUF Q4_0 / Q5_0 / Q8_0 tensor's, w = d (q - 2^(bits-1))),
    else None. Then the kernels may form each bias from its scale (`Quant.bias_multiplier`)
    and get the same floats. Checked on the values (one pass over them, at load), never
    assumed from a file's type name."""
    if q.mode != "affine" or q.biases is None or q.scales.dtype != mx.float16 or q.biases.dtype != mx.float16:
        return None
    m = -float(2 ** (q.bits - 1))
    same = mx.all(q.scales.astype(mx.float32) * m == q.biases.astype(mx.float32))
    return m if bool(same.item()) else None


def row_major(lin: Linear) -> Linear:
    """`lin` with its packed weight in rows (undoing `interleave_for_a8`), for code that reads
    the weight itself (dequantizing, slicing rows, fusing adapters)."""
    if not lin.interleaved:
        return lin
    q = lin.quant
    stacked = lin.weight.ndim == 3
    kq = q.scales.dtype in (mx.int16, mx.int8)
    back = kernels.interleave16_factors if kq else kernels.interleave16_groups
    scales = two_codes(q.scales) if q.scales.dtype == mx.int8 else q.scales  # (rows keep int16 codes)
    out = tree_replace(lin, weight=_per_matrix(_back_in_rows(q.bits), lin.weight, stacked))
    return out.with_quant(interleaved=False,  # (bias_multiplier kept: the same values)
                          scales=_per_matrix(partial(kernels.interleave16_groups, inverse=True), scales, stacked),
                          biases=_per_matrix(partial(back, inverse=True), q.biases, stacked))


def _matmul_rows(x: mx.array, lin: Linear) -> mx.array:
    _rows_layout(lin)
    if lin.quantized:
        q = lin.quant
        return mx.quantized_matmul(
            x, lin.weight, *group_params(q.scales, q.biases),
            transpose=True, group_size=q.group_size, bits=q.bits, mode=q.mode,
        )
    return x @ lin.weight if lin.transposed else x @ lin.weight.T


def _tiled_matmul(x2: mx.array, lin: Linear, tile: int) -> mx.array:
    """x2 [M, K] @ W on fixed-size row tiles: every BLAS call has M = tile rows."""
    m = x2.shape[0]
    pad = (-m) % tile
    if pad:
        x2 = mx.concatenate([x2, mx.zeros((pad, x2.shape[1]), x2.dtype)], axis=0)
    xt = x2.reshape(-1, tile, x2.shape[1])
    if lin.quantized:  # MLX's quantized matmul is computed row by row: no BLAS involved
        y = _matmul_rows(xt, lin)
    else:
        y = _gemm_per_tile(xt, lin.weight if lin.transposed else lin.weight.T)
    y = y.reshape(-1, y.shape[-1])
    return y[:m] if pad else y


def _gemm_per_tile(xt: Float[mx.array, "n tile K"], w: Float[mx.array, "K N"]) -> Float[mx.array, "n tile N"]:
    """One BLAS GEMM per tile of rows. [n, tile, K] @ [K, N] would be folded into one
    [n*tile, K] GEMM by MLX, and a BLAS may block K differently for different M (measured:
    MKL, K=1536, M=64 vs 8). A broadcast (stride-0, no copy) batch of weights makes MLX
    issue one GEMM per tile."""
    return xt @ mx.broadcast_to(w, (xt.shape[0], *w.shape))


def matmul_t(x: Float[mx.array, "N K"], w: Float[mx.array, "E K"], numerics: Numerics) -> Float[mx.array, "N E"]:
    """x @ w.T for a plain float matrix that is not a Linear (DeepSeek's router): in the
    batch-invariant numerics on fixed row tiles as linear's dense products, so a row's
    logits (and so its experts) never depend on the other rows of the step (MKL on an Intel
    CPU rounds a 4-row GEMM otherwise than a 1-row one)."""
    if not numerics.batch_invariant:
        return x @ w.T
    n, tile = x.shape[0], numerics.tile
    pad = (-n) % tile
    xt = mx.pad(x, [(0, pad), (0, 0)]) if pad else x
    y = _gemm_per_tile(xt.reshape(-1, tile, x.shape[1]), w.T).reshape(-1, w.shape[0])
    return y[:n] if pad else y


@attrs.frozen
class LoraStack:
    """The low-rank adapters of one linear, one slot per loaded adapter (slot 0: none, all
    zeros): y += (x @ a[s]) @ b[s] for a row in slot s, then y *= mag[s] (DoRA's magnitude
    over the adapted weight's row norm; ones for plain LoRA slots; None when no slot is
    DoRA). The LoRA scale is folded into b. Ranks are zero-padded to the stack's bucket
    (exact: padded columns add zeros)."""

    __fx_memo_flatten__ = True

    a: Float[mx.array, "S K R"]
    b: Float[mx.array, "S R N"]
    mag: Float[mx.array, "S N"] | None = None


@attrs.frozen
class LoraBinding:
    """A LoraStack bound to one step's rows: `rows[b]` is row b's slot."""

    stack: LoraStack
    rows: Int[mx.array, "B"]


def lora_update(x: mx.array, y: mx.array, lora: LoraBinding, numerics: Numerics) -> mx.array:
    """y (x's base product, before the bias) with each row's adapter applied. x: [B, ...,
    K] with the rows first (the step's batch rows); the low-rank products are gathered per
    row (`gather_mm`: no copy of the stacks), in float32 as mlx-lm computes them. In the
    batch-invariant mode every product runs on fixed tiles of `numerics.tile` tokens, so a
    row's result does not depend on the other rows or the chunk length."""
    st, rows = lora.stack, lora.rows
    b = rows.shape[0]
    lead, k = x.shape[:-1], x.shape[-1]
    xb = x.reshape(b, -1, k).astype(st.a.dtype)
    t = xb.shape[1]
    idx = rows
    if numerics.batch_invariant:
        pad = (-t) % numerics.tile
        if pad:
            xb = mx.concatenate([xb, mx.zeros((b, pad, k), xb.dtype)], axis=1)
        n = xb.shape[1] // numerics.tile
        xb = xb.reshape(b * n, numerics.tile, k)
        idx = mx.repeat(rows, n)
    z = mx.gather_mm(mx.gather_mm(xb, st.a, rhs_indices=idx), st.b, rhs_indices=idx)
    z = z.reshape(b, -1, z.shape[-1])[:, :t]
    out = y.reshape(b, t, -1) + z.astype(y.dtype)
    if st.mag is not None:
        out = mx.take(st.mag, rows, axis=0)[:, None, :].astype(y.dtype) * out
    return out.reshape(*lead, -1)


def linear(x: mx.array, lin: Linear, numerics: Numerics, residual: mx.array | None = None) -> mx.array:
    """x @ W.T (+ LoRA, tensor-parallel combine, bias). residual: an array of the output's
    shape returned as residual + that (a residual branch's last projection); the native
    kernels add it in the product's own node (the same bits, one graph node fewer)."""
    if residual is not None:
        if (_native_ok(lin, numerics) and lin.lora is None and lin.shard is None and lin.bias is None
                and x.dtype == residual.dtype == mx.float32
                and residual.shape == (*x.shape[:-1], lin.weight.shape[0])):
            return _native_matmul(x, lin, numerics, add=residual)
        return residual + linear(x, lin, numerics)
    if _native_ok(lin, numerics):
        y = _native_matmul(x, lin, numerics)
    elif numerics.batch_invariant:
        lead = x.shape[:-1]
        y = _tiled_matmul(x.reshape(-1, x.shape[-1]), lin, numerics.tile)
        y = y.reshape(*lead, y.shape[-1])
    else:
        y = _matmul_rows(x, lin)
    if lin.lora is not None:
        y = lora_update(x, y, lin.lora, numerics)
    if lin.shard is not None:
        y = _tp_combine(y, lin.shard)
    if lin.bias is not None:
        y = y + lin.bias
    return y


def expert_linear(x: mx.array, lin: Linear, indices: mx.array, sorted_indices: bool = False) -> mx.array:
    """Per-token expert matmuls: x [N, k or 1, 1, in] @ expert `indices` [N, k] of a stacked
    Linear ([E, out, in], or [E, in, out] when transposed) -> [N, k, 1, out]. sorted_indices:
    the rows come grouped by expert (x [M, 1, in], indices [M] ascending), so each expert's
    weights are read once for all its rows."""
    if lin.quantized:
        _rows_layout(lin)
        q = lin.quant
        y = mx.gather_qmm(x, lin.weight, q.scales, q.biases, rhs_indices=indices,
                          transpose=True, group_size=q.group_size, bits=q.bits, mode=q.mode,
                          sorted_indices=sorted_indices)
    else:
        w = lin.weight if lin.transposed else lin.weight.swapaxes(-1, -2)
        y = mx.gather_mm(x, w, rhs_indices=indices, sorted_indices=sorted_indices)
    if lin.bias is not None:  # per-expert biases [E, out]
        y = y + mx.expand_dims(lin.bias[indices], -2)
    return y


def _expert_kernel(numerics: Numerics, pairs: int) -> str:
    """Which 2-D native kernel runs each expert's rows: the 8-bit mode's, else the plan's
    (qgemm from the plan's many-row threshold on, where the dense path would dequantize
    for BLAS: a stack has no dense copy), as `_native_matmul` chooses for a matrix."""
    if numerics.activation_bits == 8:
        return "qmm_a8"
    plan = numerics.matmul
    many = not numerics.batch_invariant and plan.gemm_from and pairs >= plan.gemm_from
    return "qgemm" if plan.kernel == "qgemm" or many else "qmm"


def _native_experts(x: mx.array, lin: Linear, indices: mx.array, kind: str) -> mx.array:
    """x [N, 1 or K, in] through each token's experts `indices` [N, K] of a packed stack
    -> [N, K, out] (`kernels.gather_qmm`), with the experts' own biases."""
    q = lin.quant
    if q.interleaved:  # (only the 8-bit mode interleaves: kind is "qmm_a8")
        kind += "_il"
    y = kernels.gather_qmm(x, indices, lin.weight, q.scales, _product_biases(q), q.group_size, q.bits, kind)
    return y if lin.bias is None else y + lin.bias[indices].astype(y.dtype)


SORT_EXPERT_ROWS = 64  # route this many (token, expert) pairs or more: group them by expert


def routed_glu(
    x: Float[mx.array, "N H"], gate_up: Linear, down: Linear, indices: Int[mx.array, "N K"],
    glu: Callable[[mx.array], mx.array], numerics: Numerics,
) -> Float[mx.array, "N K H"]:
    """Each token's gated MLP through each of its K chosen experts: down(glu(gate_up(x)))
    with stacked expert weights (gate_up [E, 2F, H] fused, gate rows first; glu maps the
    fused [..., 2F] to [..., F], e.g. `swiglu_fused`). Only the chosen experts' weights are
    read, so a step costs what its routing picks, not all E. From SORT_EXPERT_ROWS pairs on
    (prefill chunks, wide batches) the pairs are grouped by expert first (mlx-lm's SwitchGLU
    does the same), except in batch-invariant mode: there each pair's product must not
    depend on which other tokens share its expert."""
    n, k = indices.shape
    native_gu, native_down = _native_ok(gate_up, numerics), _native_ok(down, numerics)
    if native_gu or native_down:
        # (one stack in a native format and the other not, e.g. a dense gate_up beside a
        # packed down: each through its own product; the 8-bit mode's interleaved stacks
        # are read by the native one only)
        kind = _expert_kernel(numerics, n * k)
        h = glu(_native_experts(x[:, None, :], gate_up, indices, kind) if native_gu
                else expert_linear(x[:, None, None, :], gate_up, indices)[:, :, 0])  # [N, K, F]
        if native_down:
            return _native_experts(h, down, indices, kind)
        return expert_linear(h[:, :, None, :], down, indices)[:, :, 0]
    if n * k < SORT_EXPERT_ROWS or numerics.batch_invariant:
        h = glu(expert_linear(x[:, None, None, :], gate_up, indices))  # [N, K, 1, F]
        return expert_linear(h, down, indices)[:, :, 0]
    flat = indices.reshape(-1)
    order = mx.argsort(flat)
    rows, idx = x[order // k][:, None, :], flat[order]  # [N*K, 1, H] grouped by expert
    y = expert_linear(glu(expert_linear(rows, gate_up, idx, True)), down, idx, True)
    return y[mx.argsort(order)].reshape(n, k, -1)


def routed_mixture(
    x: Float[mx.array, "N H"], gate_up: Linear, down: Linear, indices: Int[mx.array, "N K"],
    weights: Float[mx.array, "N K"], glu: Callable[[mx.array], mx.array], numerics: Numerics,
) -> Float[mx.array, "N H"]:
    """Each token's mixture of its K chosen experts: `routed_glu`'s outputs weighted and
    summed, made whole over the ranks when the experts' features are split (tensor
    parallelism: each rank ran its slice of every expert's features)."""
    y = routed_glu(x, gate_up, down, indices, glu, numerics)
    y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2).astype(x.dtype)
    return mx.distributed.all_sum(y, group=down.shard.group) if down.shard is not None else y


def _tp_combine(y: mx.array, shard: Shard) -> mx.array:
    """A tensor-parallel linear's output made whole over its group (see `Shard`): every
    rank gets the same full result."""
    if shard.kind == "sum":
        return mx.distributed.all_sum(y, group=shard.group)
    total = shard.width
    lead, per = y.shape[:-1], y.shape[-1]
    parts = mx.distributed.all_gather(y.reshape(-1, per).T, group=shard.group)  # [ranks * per, M]
    return parts[:total].T.reshape(*lead, total)


def embed(tokens: mx.array, table: Linear) -> mx.array:
    """Look up rows of an embedding table (dequantizing only the gathered rows). A
    vocabulary-parallel table (`Shard` "vocab") looks up the tokens in its own rows and sums
    the ranks' results (other ranks' tokens contribute zeros)."""
    if table.shard is not None:
        start, rows = table.shard.first, table.weight.shape[0]
        local = tokens - start
        mine = (local >= 0) & (local < rows)
        whole = tree_replace(table, shard=None)
        out = embed(mx.where(mine, local, 0), whole)
        return mx.distributed.all_sum(mx.where(mine[..., None], out, 0), group=table.shard.group)
    if table.quantized:
        q = table.quant
        w, scales, biases = (_interleaved_rows(table, tokens) if table.interleaved else
                             (table.weight[tokens], q.scales[tokens], None if q.biases is None else q.biases[tokens]))
        return mx.dequantize(w, *group_params(scales, biases),  # (MXFP4: no biases)
                             group_size=q.group_size, bits=q.bits, mode=q.mode)
    return table.weight[tokens]


def _interleaved_rows(table: Linear, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array | None]:
    """Rows `tokens` of an interleaved table (a head tied to the embeddings, in the 8-bit
    mode's layout) in the rows layout: each token's elements gathered out of its 16-row
    block (`kernels.il16_take`), 5-/6-bit planes repacked. (weight, scales, biases) shaped
    [*tokens.shape, ...]."""
    q, flat = table.quant, tokens.reshape(-1)

    def rows(a: mx.array) -> mx.array:
        return kernels.il16_take(a, flat)

    weight = rows(table.weight.reshape(table.weight.shape[0], -1, q.bits) if q.bits in (5, 6) else table.weight)
    if q.bits in (5, 6):
        weight = kernels.planes_to_rows(weight, q.bits)
    out = (weight, rows(q.scales), rows(q.biases))
    return tuple(a.reshape(*tokens.shape, *a.shape[1:]) for a in out)  # type: ignore[return-value]


def rms_norm(x: mx.array, weight: mx.array, eps: float, numerics: Numerics | None = None,
             width: int | None = None, group: Any = None) -> mx.array:
    """RMSNorm over the last axis. width: x is this rank's slice of a vector of `width`
    features split over the ranks of `group` (tensor parallelism; None: the world group):
    the mean square is summed over them."""
    if width is not None:
        xf = x.astype(mx.float32)
        ms = mx.distributed.all_sum(mx.sum(xf * xf, axis=-1, keepdims=True), group=group) / width
        return (xf * mx.rsqrt(ms + eps)).astype(x.dtype) * weight
    # MLX's CPU rms_norm is a fallback of 3-4 graph nodes; the native one is a single node.
    if numerics is not None and numerics.native and x.dtype == mx.float32:
        return kernels.rms_norm(x, weight, eps)
    return mx.fast.rms_norm(x, weight, eps)


def add_rms_norm(h: mx.array, a: mx.array, weight: mx.array, eps: float,
                 numerics: Numerics | None = None) -> tuple[mx.array, mx.array]:
    """(h + a, rms_norm(h + a)): a residual add and the next branch's pre-norm. Native
    (float32): one node with the same values as the two (each graph node costs several
    microseconds of scheduling on the CPU, a decode step's add about as much as its work)."""
    if (numerics is not None and numerics.native and h.dtype == a.dtype == mx.float32
            and h.shape == a.shape):
        return kernels.add_rms_norm(h, a, weight, eps)
    s = h + a
    return s, rms_norm(s, weight, eps, numerics)


def _rope_kind(scaling: dict) -> str:
    return str(scaling.get("type") or scaling.get("rope_type") or "default") if scaling else "default"


def scaled_rope_mscale(scaling: dict, max_position_embeddings: int) -> float:
    """The factor on the rotated dims of q and k of a scaled RoPE (a config's rope_scaling
    dict): YaRN's attention scaling (0.1 ln(factor) mscale + 1, over the same with
    mscale_all_dim), longrope's sqrt(1 + ln(max_pos / original) / ln(original)); 1
    otherwise (mlx-lm's rope_utils)."""
    kind = _rope_kind(scaling)
    if kind == "yarn":
        f = float(scaling["factor"])

        def get(m: float) -> float:
            return 1.0 if f <= 1 else 0.1 * m * math.log(f) + 1.0

        if scaling.get("attention_factor") is not None:  # (Hugging Face: a given factor wins)
            return float(scaling["attention_factor"])
        return get(float(scaling.get("mscale", 1))) / get(float(scaling.get("mscale_all_dim", 0)))
    if kind == "longrope":
        orig = float(scaling["original_max_position_embeddings"])
        factor = max_position_embeddings / orig
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return 1.0


def scaled_rope_freqs(scaling: dict, dims: int, base: float) -> mx.array | None:
    """The per-pair rotation periods of a scaled RoPE over `dims` rotated dims, with the
    same op composition as mlx-lm's rope_utils (on device, float32): llama3, yarn (the ramp
    between interpolated and extrapolated frequencies), longrope (periods times long_factor,
    used at every length as mlx-lm does). None: plain base^(2i/d) (default, linear; and
    dynamic, which changes the base only past max_position_embeddings, a length the engine
    never runs)."""
    kind, d = _rope_kind(scaling), dims
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old = scaling.get("original_max_position_embeddings", 8192)
        low_wl, high_wl = old / low, old / high
        freqs = base ** (mx.arange(0, d, 2) / d)
        wavelens = 2 * mx.pi * freqs
        freqs = mx.where(wavelens > low_wl, freqs * factor, freqs)
        medium = (wavelens > high_wl) & (wavelens < low_wl)
        smooth = (old / wavelens - low) / (high - low)
        smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
        return mx.where(medium, smooth_freqs, freqs)
    if kind == "longrope":
        long = mx.array(scaling["long_factor"], dtype=mx.float32)
        if long.shape != (d // 2,):
            raise ValueError(f"rope_scaling.long_factor has {long.shape[0]} entries, expected {d // 2}")
        return long * base ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    if kind != "yarn":
        return None
    f, orig = float(scaling["factor"]), float(scaling.get("original_max_position_embeddings", 4096))
    beta_fast, beta_slow = float(scaling.get("beta_fast", 32)), float(scaling.get("beta_slow", 1))

    def correction_dim(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True) is not False:  # (gpt-oss: False, as OpenAI's and Hugging Face's code run it)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as mlx-lm: no division by zero
    ramp = mx.clip((mx.arange(d // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    extra = base ** (mx.arange(0, d, 2, dtype=mx.float32) / d)
    inter = f * extra
    return (inter * extra) / (inter * mask + extra * (1 - mask))


def rope_tables(
    positions: mx.array, head_dim: int, *, base: float | None, scale: float,
    freqs: mx.array | None, traditional: bool,
) -> tuple[mx.array, mx.array, mx.array]:
    """cos/sin tables for positions [B, T], computed once per step and shared by all layers.

    Returns (cos [B, T, 1, D], signed sin [B, T, 1, D], pair permutation P [D, D]) such that
    rope(x) = x * cos + (x @ P) * sin for x [B, T, H, D]. `x @ P` moves each element to
    its rotation partner; every output of that matmul is one input times 1 plus exact
    zeros, so it is exact whatever the BLAS. Why not mx.fast.rope: on CPU it is a ~15-node
    fallback per call that recomputes cos/sin in every layer; this costs 2 nodes per layer.
    """
    half = head_dim // 2
    if freqs is not None:
        inv = 1.0 / freqs
    else:
        inv = mx.power(mx.array(base, mx.float32), -mx.arange(0, head_dim, 2, dtype=mx.float32) / head_dim)
    theta = (positions.astype(mx.float32) * scale)[..., None] * inv  # [B, T, D/2]
    cos, sin = mx.cos(theta), mx.sin(theta)
    idx = mx.arange(head_dim)
    if traditional:  # rotate adjacent pairs (x0, x1)
        cos_f = mx.repeat(cos, 2, axis=-1)
        sin_f = mx.stack([-sin, sin], axis=-1).reshape(*sin.shape[:-1], head_dim)
        partner = idx ^ 1
    else:  # rotate the two halves
        cos_f = mx.concatenate([cos, cos], axis=-1)
        sin_f = mx.concatenate([-sin, sin], axis=-1)
        partner = (idx + half) % head_dim
    perm = (idx[:, None] == partner[None, :]).astype(mx.float32)  # (x @ P)[j] = x[partner[j]]
    return cos_f[:, :, None, :], sin_f[:, :, None, :], perm


def apply_rope(x: mx.array, cos: mx.array, sin: mx.array, perm: mx.array,
               numerics: Numerics | None = None, traditional: bool = False) -> mx.array:
    """x [B, T, H, D] rotated by the tables from `rope_tables` (`traditional` must be what
    they were built with). Native: one node and no BLAS call (a BLAS call per layer wakes
    the BLAS threads, which then compete with the native kernels' threads)."""
    if numerics is not None and numerics.native and x.dtype == cos.dtype == mx.float32:
        return kernels.rope(x, cos, sin, traditional)
    return x * cos + (x @ perm) * sin


_LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: (t + _ROUND) - _ROUND rounds t to the nearest integer
# Taylor coefficients of 2**f = exp(f ln 2), highest first; on |f| <= 0.5 the truncation
# error is below float32 resolution.
_EXP2_POLY = (1.525273380405984e-05, 1.5403530393381608e-04, 1.3333558146428443e-03,
              9.618129107628477e-03, 5.550410866482158e-02, 2.402265069591007e-01,
              6.931471805599453e-01, 1.0)


def fast_exp(x: mx.array) -> mx.array:
    """exp(x) in float32 from multiply-adds, a rounding trick and an exponent bit shift.

    Why: on the Linux CPU backend MLX's exp (and sigmoid, softmax, which use it) costs
    ~25 ns per element, 50x a multiply; attention's softmax over a 512-token chunk and the
    SwiGLU sigmoid took more time than the matmuls. This costs a few ns per element (one
    fused kernel) with the same accuracy as mx.exp (relative error ~4e-6 at |x| ~ 80,
    dominated by rounding x * log2(e); ~1e-7 near 0). exp(x) for x < -87.3 (including -inf)
    is exactly 0, so masked scores contribute exact zeros; x > 88.7 gives inf.
    """
    t = mx.clip(x.astype(mx.float32) * _LOG2E, -127.0, 128.0)
    n = (t + _ROUND) - _ROUND  # round to nearest (no floor: it is slow on this backend)
    f = t - n  # in [-0.5, 0.5]
    p = mx.array(_EXP2_POLY[0], mx.float32)
    for c in _EXP2_POLY[1:]:
        p = p * f + c
    # 2**n built in the exponent field: n = -127 gives the bit pattern 0, i.e. exactly 0.0.
    two_n = mx.view((n.astype(mx.int32) + 127) << 23, mx.float32)
    return p * two_n


def capped(x: mx.array, cap: float) -> mx.array:
    """Logit soft-capping: tanh(x / cap) * cap (Gemma's attention and final logits)."""
    return mx.tanh(x / cap) * cap


def sink_softmax(scores: mx.array, sinks: mx.array, dtype: mx.Dtype) -> mx.array:
    """Softmax of masked scores [B, Hk, rep, T, S] with one more logit per head (sinks
    [Hk, rep]) in the denominator; that column is dropped after."""
    b, hk, rep, t, _ = scores.shape
    col = mx.broadcast_to(sinks.astype(scores.dtype)[None, :, :, None, None], (b, hk, rep, t, 1))
    return softmax(mx.concatenate([scores, col], axis=-1))[..., :-1].astype(dtype)


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis with `fast_exp` (float32 throughout, like precise=True)."""
    x = x.astype(mx.float32)
    e = fast_exp(x - mx.max(x, axis=-1, keepdims=True))
    return e / mx.sum(e, axis=-1, keepdims=True)


QUERY_BLOCK = 128  # query rows per block in prefill attention (see `attention`)


def attention(
    q: mx.array, k: mx.array, v: mx.array, mask: mx.array, scale: float, numerics: Numerics,
    causal_tail: bool = False, softcap: float | None = None, sinks: mx.array | None = None,
    flat: bool = False,
) -> mx.array:
    """Grouped-query softmax attention.

    q [B, T, Hq, D] (token-major, as projected), k [B, Hk, >= S, D] and v [B, Hk, >= S, Dv]
    (the cache; Dv = D but for MLA's latent), bool mask [B, 1, T, S]: the first S slots of
    k and v are read (a whole cache may be passed: the native kernel reads its first S
    slots in place, no slice node). Returns [B, T, Hq*Dv]. The Hq/Hk query heads that share a KV head are
    stacked into the rows of one matmul per (row, KV head), so K and V are never repeated.
    In batch-invariant mode the query rows are cut into fixed tiles so that a query's
    scores never depend on the chunk size (the BLAS kernel sees the same M every time).

    causal_tail: the caller guarantees max(lengths) + T <= S (true for the shell's span
    buckets). Then query block j (rows [j*QB, (j+1)*QB)) can only see the first
    S - T + (j+1)*QB slots, a static bound, and a long chunk is computed block by block:
    the causal part above the diagonal is skipped and each block's scores stay small
    enough for the caches and the allocator (a [9 x 512 x 2048] score matrix is 38 MB).

    softcap: scores become tanh(scores / softcap) * softcap before the mask (Gemma 2's
    attention logit soft-capping); the native fused kernel does not do it, so such layers
    take the MLX path.

    sinks [Hq]: a per-head logit in every softmax's denominator that attends to nothing
    (GPT-OSS's attention sinks, as mx.fast.scaled_dot_product_attention's `sinks`); MLX path.

    flat: return [B*T, Hq*Dv] (what an output projection reads; the native kernel writes
    that shape, no reshape node).
    """
    b, t, hq, d = q.shape
    hk, s, dv = k.shape[1], mask.shape[-1], v.shape[-1]
    native = (numerics.native and not numerics.batch_invariant and d % 16 == 0 and softcap is None
              and sinks is None and dv == d
              and q.dtype == mx.float32 and k.dtype == v.dtype and k.dtype in (mx.float32, mx.float16))
    if flat and not native:
        return attention(q, k, v, mask, scale, numerics, causal_tail, softcap, sinks).reshape(b * t, hq * dv)
    if native:
        # One native node per layer instead of ~15: for decode and verify (<= 16 tokens) one
        # pass over each row's K/V, for prefill chunks register-tiled scores and P @ V per
        # block of 16 query tokens, keys only up to each block's last visible slot (no
        # per-(row, head) BLAS calls, no causal blocking needed). Not in batch-invariant
        # mode, where a token's arithmetic must not depend on whether it came in a chunk
        # or a decode step: that mode takes the tiled GEMM path below.
        return kernels.attend(q, k, v, mx.broadcast_to(mask[:, 0], (b, t, s)), scale, flat)
    if k.shape[2] > s:
        k, v = k[:, :, :s], v[:, :, :s]
    if k.dtype != q.dtype:  # a cache stored in another dtype (Model.kv_dtype): computed in q's
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    if causal_tail and not numerics.batch_invariant and QUERY_BLOCK < t <= s:
        outs = []
        for j0 in range(0, t, QUERY_BLOCK):
            j1 = min(t, j0 + QUERY_BLOCK)
            kv = min(s, s - t + j1)
            outs.append(attention(q[:, j0:j1], k[:, :, :kv], v[:, :, :kv],
                                  mask[:, :, j0:j1, :kv], scale, numerics, softcap=softcap,
                                  sinks=sinks))
        return mx.concatenate(outs, axis=1)
    rep = hq // hk
    qh = (q * scale).reshape(b, t, hk, rep, d).transpose(0, 2, 3, 1, 4)  # [B, Hk, rep, T, D]
    m = mask[:, :, None]  # [B, 1, 1, T, S]
    if numerics.batch_invariant:
        tile = numerics.tile
        pad = (-t) % tile
        if pad:
            qh = mx.pad(qh, [(0, 0), (0, 0), (0, 0), (0, pad), (0, 0)])
            m = mx.pad(m, [(0, 0), (0, 0), (0, 0), (0, pad), (0, 0)], constant_values=True)
        tp = t + pad
        qt = qh.reshape(b, hk, rep * tp // tile, tile, d)
        scores = qt @ k[:, :, None].swapaxes(-1, -2)  # M = tile for every GEMM
        scores = scores.reshape(b, hk, rep, tp, s)
    else:
        tp = t
        scores = (qh.reshape(b, hk, rep * t, d) @ k.swapaxes(-1, -2)).reshape(b, hk, rep, t, s)
    if softcap is not None:
        scores = capped(scores, softcap)
    if sinks is not None:
        scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
        probs = sink_softmax(scores, sinks.reshape(hk, rep), scores.dtype)
    elif numerics.native and scores.dtype == mx.float32:  # one pass, multi-threaded
        mb = mx.broadcast_to(m, (b, 1, 1, tp, s)).reshape(b, tp, s)
        probs = kernels.masked_softmax(scores.reshape(b, hk * rep, tp, s), mb)
        probs = probs.reshape(b, hk, rep, tp, s)
    else:
        scores = mx.where(m, scores, mx.finfo(scores.dtype).min)
        probs = softmax(scores).astype(scores.dtype)
    if numerics.batch_invariant:
        out = _blocked_pv(probs.reshape(b, hk, rep * tp // numerics.tile, numerics.tile, s), v,
                          numerics.kv_block)
        out = out.reshape(b, hk, rep, tp, dv)[:, :, :, :t]
    else:
        out = (probs.reshape(b, hk, rep * t, s) @ v).reshape(b, hk, rep, t, dv)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, hq * dv)


def _blocked_pv(p: mx.array, v: mx.array, block: int) -> mx.array:
    """p [B, Hk, N, tile, S] @ v [B, Hk, S, D] with the S contraction cut into fixed blocks.

    Why: a BLAS may split or order a GEMM's inner dimension differently for different
    lengths (measured with both OpenBLAS and MKL), so p @ v over a span of 320 slots and
    over 512 slots (the tail all zero) can differ in the last bit. Here every GEMM
    contracts exactly `block` slots and the per-block results are summed along an axis in
    slot order, so extra all-zero blocks leave the sum bitwise unchanged.
    """
    b, hk, n, tile, s = p.shape
    d = v.shape[-1]
    pad = (-s) % block
    if pad:  # only for capacities that are not multiples of the block (tiny test caches)
        p = mx.pad(p, [(0, 0)] * 4 + [(0, pad)])
        v = mx.pad(v, [(0, 0), (0, 0), (0, pad), (0, 0)])
    nb = (s + pad) // block
    pb = p.reshape(b, hk, n, tile, nb, block).transpose(0, 1, 2, 4, 3, 5)
    vb = v.reshape(b, hk, 1, nb, block, d)
    return (pb @ vb).sum(axis=3)  # [B, Hk, N, tile, D]


def layer_norm(x: mx.array, weight: mx.array | None, bias: mx.array | None, eps: float) -> mx.array:
    """LayerNorm over the last axis (mean and variance), with optional scale and shift."""
    return mx.fast.layer_norm(x, weight, bias, eps)


def gelu(x: mx.array) -> mx.array:
    """GELU, exact (erf) form: x * (1 + erf(x / sqrt(2))) / 2, as mlx's nn.gelu."""
    return x * (1 + mx.erf(x * 0.7071067811865476)) / 2


def gelu_tanh(x: mx.array) -> mx.array:
    """GELU, tanh approximation: 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi)(x +
    0.044715 x^3); the sigmoid from `fast_exp` (MLX's CPU tanh/exp cost ~25 ns/element)."""
    xf = x.astype(mx.float32)
    u = 0.7978845608028654 * (xf + 0.044715 * xf * xf * xf)
    return (xf / (1.0 + fast_exp(-2.0 * u))).astype(x.dtype)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """silu(gate) * up, with the sigmoid from `fast_exp` (see there for why)."""
    g = gate.astype(mx.float32)
    return (g / (1.0 + fast_exp(-g)) * up).astype(gate.dtype)


def swiglu_fused(gu: mx.array, numerics: Numerics | None = None) -> mx.array:
    """`swiglu` of a fused gate|up projection gu [..., 2F] -> [..., F]. Natively one graph
    node (MLX's is seven elementwise nodes and two slices, each ~10 us on CPU)."""
    if numerics is not None and numerics.native and gu.dtype == mx.float32:
        return kernels.swiglu(gu)
    f = gu.shape[-1] // 2
    return swiglu(gu[..., :f], gu[..., f:])


def quantized_attention(
    q: mx.array, head_k: mx.array, head_v: mx.array, k_q: tuple, v_q: tuple, mask: mx.array,
    scale: float, group_size: int, bits: int, softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention over a quantized cache entry, as mlx-lm's quantized SDPA computes it.

    q [B, T, Hq, D]; head_k/head_v [B, Hk, F, D] float slots (F may be 0), then k_q/v_q
    (packed, scales, biases) [B, Hk, S2, *] quantized slots; mask [B, 1, T, F + S2].
    Scores come from `mx.quantized_matmul` against the packed keys and the output from the
    probabilities against the packed values (no dequantized copy of the cache).
    """
    b, t, hq, d = q.shape
    hk, f, s2 = k_q[0].shape[1], head_k.shape[2], k_q[0].shape[2]
    rep = hq // hk
    # A cache stored in another float dtype (Model.kv_dtype) is computed in q's.
    head_k, head_v = head_k.astype(q.dtype), head_v.astype(q.dtype)
    k_q, v_q = ((w, *(a.astype(q.dtype) for a in sb)) for w, *sb in (k_q, v_q))
    qh = (q * scale).reshape(b, t, hk, rep, d).transpose(0, 2, 3, 1, 4).reshape(b, hk, rep * t, d)
    parts = []
    if f:
        parts.append(qh @ head_k.swapaxes(-1, -2))
    if s2:
        parts.append(mx.quantized_matmul(qh, *k_q, transpose=True, group_size=group_size, bits=bits))
    scores = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)
    scores = scores.reshape(b, hk, rep, t, f + s2)
    if softcap is not None:
        scores = capped(scores, softcap)
    scores = mx.where(mask[:, :, None], scores, mx.finfo(scores.dtype).min)
    if sinks is not None:
        probs = sink_softmax(scores, sinks.reshape(hk, rep), q.dtype).reshape(b, hk, rep * t, f + s2)
    else:
        probs = softmax(scores).astype(q.dtype).reshape(b, hk, rep * t, f + s2)
    out = None
    if f:
        out = probs[..., :f] @ head_v
    if s2:
        pv = mx.quantized_matmul(probs[..., f:], *v_q, transpose=False, group_size=group_size, bits=bits)
        out = pv if out is None else out + pv
    return out.reshape(b, hk, rep, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq * d)
