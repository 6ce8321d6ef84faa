"""The KV cache pytree: preallocated rows with per-row lengths, written in place, one entry
per attention layer, each of the kind its layer asks for (the static `layout`).

Kinds (`LayerSpec`):

* dense: K and V arrays [B, Hkv, C + 1, D] (capacity C): position p lives in slot p.
* ring (sliding-window layers): [B, Hkv, R + 1, D] with R = window + headroom slots; position
  p lives in slot p % R. Memory is bounded by R whatever the context length.
* quantized (mlx-lm's QuantizedKVCache layout): keys/values as MLX affine-quantized triples
  (packed uint32, scales, biases) along D, attended with `mx.quantized_matmul`. Positions
  below `quant_start` stay in a float "head" (mlx-lm's quantized_kv_start: a prompt's first
  tokens keep full precision), the rest are quantized.

Rows are independent: row b holds `lengths[b]` valid positions; entries at or past that length
are stale and never read (attention masks them), which is what makes rollback by length exact
and free: `with_lengths(cache, accepted)`. For a ring this needs headroom: a step of T tokens
(a prefill chunk, or a verify of T - 1 drafts) overwrites the slots of positions up to T - 1
past the window, so `headroom >= T - 1` is checked when the step is traced, before any write.

Every array has one extra slot (the last index) that is a write sink: padding tokens, rows that
do not advance (n_valid == 0) and anything past the capacity are written there, so a step never
touches a row's valid entries nor memory outside the array. Attention never reads it.

* recurrent (state-space, linear-attention and short-convolution layers): a fixed-size state
  per row (`LayerSpec.state`: the arrays' shapes after the row axis), the state after the
  row's `lengths[b]` tokens. Its memory does not grow with the context. A state cannot be
  trimmed back like K/V, so a verify step (`keep_steps`) keeps the state after every one of
  its positions and `commit` selects, per row, the one after its accepted tokens; a state
  is reusable only at exactly its length (prefix snapshots hold the whole row).

Why one array per layer (not a stacked [L, ...] array): MLX reuses an input buffer for an
update only when nothing else references it; a stacked cache is copied whole every step.
Why zero-initialised: a NaN in a masked V slot still poisons the row (0 * NaN).

Row surgery between steps (resize, insert a prefilled row, snapshots, gathering rows) is the
shell's: fx_engine/engine/kv_rows.py.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import attrs
import mlx.core as mx
from jaxtyping import Int

from fx_engine.core import kernels, packing
from fx_engine.core.buckets import pow2_floor
from fx_engine.core.nn import Numerics, attention, quantized_attention
from fx_engine.core.tree import static_field, tree_replace


class CacheError(ValueError):
    """A step or cache operation that the cache layout cannot hold (named in the message)."""


@attrs.frozen
class LayerSpec:
    """Static description of one cache entry (hashable: part of the compile key)."""

    kv_heads: int
    head_dim: int
    window: int | None = None  # sliding-window attention: keys within `window` positions
    ring: int = 0  # > 0: ring storage of `ring` slots (window + headroom)
    bits: int = 0  # > 0: quantized storage (4 or 8 bits)
    group_size: int = 64
    quant_start: int = 0  # quantized: positions below this stay in float
    # > 0: values of another width than keys (an MLA latent entry: keys the compressed
    # latent, values the shared RoPE key part, as mlx-lm stores them); never quantized
    value_dim: int = 0
    # a recurrent entry: the shapes (after the row axis) of its state arrays, and their
    # dtypes ("" : the cache's float dtype; "float32": kept in float32, as SSM states are)
    state: tuple[tuple[int, ...], ...] = ()
    state_dtypes: tuple[str, ...] = ()

    @property
    def v_dim(self) -> int:
        return self.value_dim or self.head_dim

    @property
    def kind(self) -> str:
        if self.state:
            return "recurrent"
        return "ring" if self.ring else ("quantized" if self.bits else "dense")

    @property
    def headroom(self) -> int:
        return self.ring - (self.window or 0)


@attrs.frozen
class LayerKV:
    """A dense or ring entry: K and V [B, Hkv, slots + 1, D]."""

    keys: mx.array
    values: mx.array


@attrs.frozen
class QuantKV:
    """A quantized entry. head_*: float [B, Hkv, F + 1, D] for positions < F = min(quant_start,
    capacity); keys/values: (packed, scales, biases) [B, Hkv, C - F + 1, *] for the rest."""

    head_keys: mx.array
    head_values: mx.array
    keys: tuple[mx.array, mx.array, mx.array]
    values: tuple[mx.array, mx.array, mx.array]

    @property
    def head_slots(self) -> int:
        return int(self.head_keys.shape[2]) - 1


@attrs.frozen
class RecState:
    """A recurrent entry: `arrays[i]` [B, *spec.state[i]], the state after each row's
    length. `steps` (only inside a verify step, `KVCache.keep_steps`): [B, T + 1, *shape]
    per array, the state after 0 .. T of the step's tokens, for `commit` to select from."""

    arrays: tuple[mx.array, ...]
    steps: tuple[mx.array, ...] | None = None


@attrs.frozen
class KVCache:
    layers: tuple[Any, ...]  # LayerKV | QuantKV | RecState, one per entry of `layout`
    lengths: Int[mx.array, "B"]
    layout: tuple[LayerSpec, ...] = static_field()
    capacity: int = static_field()  # usable positions per row (dense slots)
    # a verify step's forward: recurrent entries keep their per-position states (RecState.steps)
    keep_steps: bool = static_field(default=False)
    # a step's forward that also returns hidden states (a `skeleton.Capture`; None: none). Set
    # by `models.forward(..., capture=)` for the one step, read by its StepGeometry; never
    # kept past the step (`advanced` drops it)
    capture: Any = static_field(default=None)
    # a step's forward over packed rows (core/packing.py: its row-wise work on this many
    # rows holding the valid tokens; None: B*T). Set by `models.forward(..., pack=)` for
    # the one step like `capture`, dropped by `advanced`
    packed: int | None = static_field(default=None)

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for e in self.layers for a in entry_arrays(e))

    @property
    def keys(self) -> tuple[mx.array, ...]:
        """Float key arrays of dense/ring entries (inspection and tests)."""
        return tuple(e.keys for e in self.layers if isinstance(e, LayerKV))

    @property
    def values(self) -> tuple[mx.array, ...]:
        return tuple(e.values for e in self.layers if isinstance(e, LayerKV))


def check_cache(cache: Any, name: str = "cache") -> KVCache:
    """Trace-time check that `cache` is a KVCache with one length per row."""
    if not isinstance(cache, KVCache):
        raise TypeError(f"{name} must be a KVCache (Model.new_cache, fx_engine.prefill), got "
                        f"{type(cache).__name__}")
    if cache.lengths.ndim != 1:
        raise ValueError(f"{name}.lengths must be int32[B], got shape {tuple(cache.lengths.shape)}")
    return cache


def entry_arrays(entry: Any) -> list[mx.array]:
    if isinstance(entry, QuantKV):
        return [entry.head_keys, entry.head_values, *entry.keys, *entry.values]
    if isinstance(entry, RecState):
        return list(entry.arrays)
    return [entry.keys, entry.values]


def state_dtype(spec: LayerSpec, i: int, dtype: mx.Dtype) -> mx.Dtype:
    """The dtype of a recurrent entry's i-th state array in a cache of float `dtype`."""
    name = spec.state_dtypes[i] if i < len(spec.state_dtypes) else ""
    return getattr(mx, name) if name else dtype


# ------------------------------------------------------------------------------ layout


def dense_layout(num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(num_kv_heads, head_dim) for _ in range(num_layers))


def finish_layout(
    base: Sequence[LayerSpec], *, headroom: int = 512, kv_bits: int = 0, kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> tuple[LayerSpec, ...]:
    """Turn a model's per-entry specs (heads, dims, window) into storage kinds.

    headroom: ring slots past the window; must be >= the largest step (prefill chunk or
    verify length) minus one. kv_bits: quantize the full-attention entries (sliding-window
    entries are already bounded and stay float, as in mlx-lm, whose rotating cache has no
    quantized form; nor do MLA latent entries, `value_dim`).
    """
    if kv_bits not in (0, 4, 8):
        raise CacheError(f"kv_bits must be 4 or 8 (or None), got {kv_bits!r}")
    if kv_bits and kv_group_size not in (32, 64, 128):
        raise CacheError(f"kv_group_size must be 32, 64 or 128, got {kv_group_size!r}")
    if quantized_kv_start < 0:
        raise CacheError(f"quantized_kv_start must be >= 0, got {quantized_kv_start!r}")
    if headroom < 0:
        raise CacheError(f"headroom must be >= 0, got {headroom!r}")
    out = []
    for s in base:
        if s.state:  # recurrent: a fixed state, whatever the options
            out.append(s)
        elif s.window is not None:
            out.append(attrs.evolve(s, ring=s.window + headroom, bits=0))
        elif kv_bits and not s.value_dim:
            if s.head_dim % kv_group_size:
                raise CacheError(
                    f"kv_group_size {kv_group_size} does not divide head_dim {s.head_dim}")
            out.append(attrs.evolve(s, bits=kv_bits, group_size=kv_group_size,
                                    quant_start=quantized_kv_start))
        else:
            out.append(s)
    return tuple(out)


def quant_head_slots(spec: LayerSpec, capacity: int) -> int:
    return min(spec.quant_start, capacity)


def _quant_zeros(rows: int, spec: LayerSpec, slots: int, dtype: mx.Dtype) -> tuple:
    shape = (rows, spec.kv_heads, slots)
    return (
        mx.zeros((*shape, spec.head_dim * spec.bits // 32), mx.uint32),
        mx.zeros((*shape, spec.head_dim // spec.group_size), dtype),
        mx.zeros((*shape, spec.head_dim // spec.group_size), dtype),
    )


def _init_entry(spec: LayerSpec, rows: int, capacity: int, dtype: mx.Dtype) -> Any:
    if spec.state:
        return RecState(tuple(mx.zeros((rows, *shape), state_dtype(spec, i, dtype))
                              for i, shape in enumerate(spec.state)))
    if spec.bits:
        f = quant_head_slots(spec, capacity)
        head = (rows, spec.kv_heads, f + 1, spec.head_dim)
        return QuantKV(
            head_keys=mx.zeros(head, dtype), head_values=mx.zeros(head, dtype),
            keys=_quant_zeros(rows, spec, capacity - f + 1, dtype),
            values=_quant_zeros(rows, spec, capacity - f + 1, dtype),
        )
    slots = spec.ring if spec.ring else capacity
    shape = (rows, spec.kv_heads, slots + 1)  # + the write sink
    return LayerKV(keys=mx.zeros((*shape, spec.head_dim), dtype), values=mx.zeros((*shape, spec.v_dim), dtype))


def init_cache(
    layout: Sequence[LayerSpec], rows: int, capacity: int, dtype: mx.Dtype = mx.float32
) -> KVCache:
    """An empty cache: `rows` rows of `capacity` positions, one entry per spec of `layout`
    (from `fx_engine.core.models.cache_layout` or `Model.cache_layout`)."""
    for name, v in (("rows", rows), ("capacity", capacity)):
        if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
            raise CacheError(f"{name} must be an int >= 1, got {v!r}")
    layout = tuple(layout)
    return KVCache(
        layers=tuple(_init_entry(s, rows, capacity, dtype) for s in layout),
        lengths=mx.zeros((rows,), mx.int32), layout=layout, capacity=capacity,
    )


# ------------------------------------------------------------------ one step's geometry


def write_positions(lengths: mx.array, t: int) -> mx.array:
    """Absolute positions [B, T] where a chunk of T tokens per row is written."""
    return lengths[:, None] + mx.arange(t, dtype=mx.int32)[None, :]


class StepGeometry:
    """Where a step of T tokens per row writes and what each query may read, per cache kind.

    Built once per step at trace time and shared by all layers (each distinct slot/mask
    array is computed once, memoised by its static key).

    span (static): dense entries attend over slots [0, span) only; the caller guarantees
    max(lengths) + T <= span <= capacity (see `span_bucket`). None: the whole capacity.

    horizon [B, T] (optional): the last key position each query may see, in place of its
    own position (Gemma 3's image tokens see their whole image during prefill:
    `vision.gemma3.image_horizon`); the sliding-window test stays on the query's own
    position. With a horizon the step is not causal, so attention is not blocked by the
    causal tail (`causal`).

    cache.packed (static, core/packing.py): the step's residual stream holds its valid
    tokens alone in that many rows; `pack` / `unpack` move an array of rows between that
    and the B*T layout every other method here speaks. A row's tokens that do not fit
    count as not valid (its length stops before them).
    """

    def __init__(self, cache: KVCache, n_valid: mx.array, t: int, span: int | None,
                 horizon: mx.array | None = None):
        self.t = t
        self.packed = cache.packed
        if self.packed is not None:
            n_valid = packing.fitted(n_valid, self.packed)
        self.n_valid = n_valid
        self.keep_steps = cache.keep_steps  # recurrent entries keep per-position states
        self.capacity = cache.capacity
        self.span = cache.capacity if span is None else span
        self.bounded = span is not None  # the span contract holds: blocked attention is safe
        self.positions = write_positions(cache.lengths, t)  # [B, T]
        self.causal = horizon is None
        self.horizon = self.positions if horizon is None else horizon
        offs = mx.arange(t, dtype=mx.int32)[None, :]
        self.valid = (offs < n_valid[:, None]) & (self.positions < cache.capacity)
        self.end = mx.minimum(cache.lengths + n_valid, cache.capacity)  # lengths after
        self._memo: dict[tuple, mx.array] = {}
        self.capture = cache.capture  # a skeleton.Capture, or None
        self.layer_inputs: list[mx.array] = []  # (capturing) the stream entering each layer

    def pack(self, x: mx.array) -> mx.array:
        """Rows [B*T, ...] -> the packed rows [packed, ...] (unchanged when not packing)."""
        if self.packed is None:
            return x
        return mx.take(x, self._get(("pack",), lambda: packing.pack_index(self.n_valid, self.t, self.packed)),
                       axis=0)

    def unpack(self, x: mx.array) -> mx.array:
        """Packed rows [packed, ...] -> [B*T, ...] (padding positions: some row's copy)."""
        if self.packed is None:
            return x
        return mx.take(x, self._get(("unpack",), lambda: packing.unpack_index(self.n_valid, self.t)), axis=0)

    def layer_input(self, h: mx.array) -> None:
        """A family's layer loop reports the residual stream [B*T, hidden] entering each of
        its layers, in order (`skeleton.decoder_step` picks the captured ones; a step that
        captures nothing keeps nothing, so its graph is unchanged)."""
        if self.capture is not None:
            self.layer_inputs.append(h)

    def _get(self, key: tuple, make: Callable[[], mx.array]) -> mx.array:
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def slots(self, lo: int, hi: int) -> mx.array:
        """Slots [B, T] of an array holding positions [lo, hi) at slot p - lo (sink hi - lo)."""
        def make() -> mx.array:
            p = self.positions
            keep = self.valid & (p >= lo) & (p < hi) if lo else self.valid & (p < hi)
            return mx.where(keep, p - lo, hi - lo)
        return self._get(("slots", lo, hi), make)

    def ring_slots(self, ring: int) -> mx.array:
        return self._get(("ring", ring), lambda: mx.where(
            self.valid, mx.remainder(self.positions, ring), ring))

    def mask(self, n_slots: int, window: int | None, ring: int = 0) -> mx.array:
        """Bool [B, 1, T, n_slots]: query t of row b may read slot s.

        The position held by slot s is s (dense) or, for a ring, the latest position
        congruent to s below the row's new length; a query at position q reads positions
        in (q - window, q]."""
        def make() -> mx.array:
            s = mx.arange(n_slots, dtype=mx.int32)
            if ring:
                last = (self.end - 1)[:, None]
                held = last - mx.remainder(last - s[None, :], ring)  # [B, S]; < 0: never written
            else:
                held = s[None, :]
            q = self.positions[:, :, None]
            k = held[:, None, :]
            m = k <= (q if self.causal else self.horizon[:, :, None])
            if ring:
                m = m & (k >= 0)
            if window is not None:
                m = m & (k > q - window)
            return m[:, None]
        return self._get(("mask", n_slots, window, ring), make)


# ------------------------------------------------------------------- writes and reads


def _put(cache_x: mx.array, new: mx.array, slots: mx.array, fast: bool = False) -> mx.array:
    """Write new [B, H, T, *] at per-row slots [B, T]. Both paths reuse cache_x's buffer when
    the caller holds no other reference. fast: the native kv_put (one node, ~10x cheaper
    than MLX's CPU scatter) for float K/V."""
    if fast and cache_x.ndim == 4 and cache_x.dtype in (mx.float32, mx.float16):
        return kernels.kv_put(cache_x, new, slots)
    return mx.put_along_axis(cache_x, slots[:, None, :, None], new.astype(cache_x.dtype), axis=2)


def write_entry(
    entry: Any, spec: LayerSpec, k: mx.array, v: mx.array, geo: StepGeometry,
    numerics: Numerics | None = None,
) -> Any:
    """Write this step's k, v [B, Hkv, T, D] into one entry (then attend over the result)."""
    fast = numerics is not None and numerics.native
    if spec.ring:
        if geo.t - 1 > spec.headroom:
            raise CacheError(
                f"a step of {geo.t} tokens needs ring headroom >= {geo.t - 1}, but this "
                f"sliding-window cache has {spec.headroom} (window {spec.window}, ring "
                f"{spec.ring}); build the cache layout with a larger headroom"
            )
        slots = geo.ring_slots(spec.ring)
        return LayerKV(_put(entry.keys, k, slots, fast), _put(entry.values, v, slots, fast))
    if spec.bits:
        f = entry.head_slots
        head = geo.slots(0, f)
        tail = geo.slots(f, geo.capacity)
        qk = mx.quantize(k, group_size=spec.group_size, bits=spec.bits)
        qv = mx.quantize(v, group_size=spec.group_size, bits=spec.bits)
        return QuantKV(
            head_keys=_put(entry.head_keys, k, head) if f else entry.head_keys,
            head_values=_put(entry.head_values, v, head) if f else entry.head_values,
            keys=tuple(_put(a, n, tail) for a, n in zip(entry.keys, qk)),
            values=tuple(_put(a, n, tail) for a, n in zip(entry.values, qv)),
        )
    slots = geo.slots(0, geo.capacity)
    return LayerKV(_put(entry.keys, k, slots, fast), _put(entry.values, v, slots, fast))


def fused_write(entry: Any, spec: LayerSpec, numerics: Numerics | None) -> bool:
    """Whether `write_rotated_entry` can write this entry: a dense float32 / float16 one
    (no window ring, no quantization) with the native kernels."""
    return (numerics is not None and numerics.native and not spec.ring and not spec.bits
            and isinstance(entry, LayerKV) and entry.keys.dtype in (mx.float32, mx.float16)
            and entry.values.shape == entry.keys.shape and entry.values.dtype == entry.keys.dtype)


def write_rotated_entry(
    entry: LayerKV, qkv: mx.array, q_heads: int, rope: tuple[mx.array, mx.array, mx.array],
    traditional: bool, geo: StepGeometry,
) -> tuple[mx.array, LayerKV]:
    """The fused q | k | v projection [B*T, (Hq + 2 Hk) * D] (float32) with RoPE over every
    dim of q and k (tables from `nn.rope_tables`): q [B, T, Hq, D] rotated and the entry with
    this step's rotated k and v written (where `fused_write` holds). One native node for what
    reshape, slices, rope, transposes and two cache writes (`write_entry`) do in ten."""
    q, keys, values = kernels.qkv_rope_put(qkv, rope[0], rope[1], traditional, q_heads, entry.keys,
                                           entry.values, geo.slots(0, geo.capacity))
    return q, LayerKV(keys, values)


def attend_entry(
    entry: Any, spec: LayerSpec, q: mx.array, geo: StepGeometry, scale: float,
    numerics: Numerics, softcap: float | None = None, sinks: mx.array | None = None,
    flat: bool = False,
) -> mx.array:
    """Attention of q [B, T, Hq, D] over one (already written) entry: [B, T, Hq * D]
    ([B*T, Hq * D] if flat). softcap: attention logit soft-capping; sinks: per-head sink
    logits (see `attention`)."""
    if spec.bits and flat:
        b, t = q.shape[:2]
        return attend_entry(entry, spec, q, geo, scale, numerics, softcap, sinks).reshape(b * t, -1)
    if spec.ring:
        n = min(geo.span, spec.ring)
        mask = geo.mask(n, spec.window, spec.ring)
        # While the span fits in the ring, slot == position: the causal-tail blocking holds.
        tail = geo.bounded and geo.causal and geo.span <= spec.ring
        return attention(q, entry.keys[:, :, :n], entry.values[:, :, :n], mask, scale,
                         numerics, causal_tail=tail, softcap=softcap, sinks=sinks, flat=flat)
    mask = geo.mask(geo.span, spec.window)
    if spec.bits:
        f = min(entry.head_slots, geo.span)
        rest = geo.span - f
        return quantized_attention(
            q, entry.head_keys[:, :, :f], entry.head_values[:, :, :f],
            tuple(a[:, :, :rest] for a in entry.keys),
            tuple(a[:, :, :rest] for a in entry.values),
            mask, scale, spec.group_size, spec.bits, softcap=softcap, sinks=sinks,
        )
    # (the whole arrays: attention reads the first span slots, the mask's)
    return attention(q, entry.keys, entry.values, mask, scale, numerics,
                     causal_tail=geo.bounded and geo.causal, softcap=softcap, sinks=sinks, flat=flat)


def attend_latent(
    entry: Any, spec: LayerSpec, q_lat: mx.array, q_pe: mx.array, geo: StepGeometry,
    scale: float, numerics: Numerics,
) -> mx.array:
    """Multi-head latent attention (MLA, absorbed form) over a latent entry: keys hold the
    compressed latent c [B, 1, S, r], values the shared RoPE key part k_pe [B, 1, S, dr].
    score(h, t, s) = scale * (q_lat[h, t] . c[s] + q_pe[h, t] . k_pe[s]); the output is
    the probabilities times c: [B, T, H * r] (the caller maps it up per head). Computed as
    one grouped-query attention (a single KV head) with the two parts side by side, so the
    causal blocking and the batch-invariant tiling are the usual ones."""
    if spec.ring or spec.bits:
        raise CacheError("a latent (MLA) cache entry is dense: no window, no quantization")
    c, pe = entry.keys[:, :, : geo.span], entry.values[:, :, : geo.span]
    k = mx.concatenate([c, pe.astype(c.dtype)], axis=-1)
    q = mx.concatenate([q_lat, q_pe.astype(q_lat.dtype)], axis=-1)
    return attention(q, k, c, geo.mask(geo.span, spec.window), scale, numerics,
                     causal_tail=geo.bounded and geo.causal)


def advanced(cache: KVCache, layers: Sequence[Any], geo: StepGeometry) -> KVCache:
    """The cache after a step: the written entries and lengths += n_valid (capped)."""
    return KVCache(layers=tuple(layers), lengths=geo.end, layout=cache.layout,
                   capacity=cache.capacity, keep_steps=cache.keep_steps)


def recurrent_entry(spec: LayerSpec, states: Sequence[mx.array], steps: Sequence[mx.array] | None,
                    geo: StepGeometry) -> RecState:
    """A recurrent layer's written entry: its states after each row's valid tokens and,
    in a verify step, the per-position ones ([B, T + 1, *shape]: after 0 .. T tokens)."""
    return RecState(tuple(states), tuple(steps) if geo.keep_steps and steps is not None else None)


def commit(cache: KVCache, lengths: mx.array, counts: mx.array) -> KVCache:
    """After a verify step's forward (`keep_steps`): row b keeps the first counts[b] of the
    step's tokens: lengths set (K/V past them are stale) and each recurrent entry's state
    taken after counts[b] tokens (0: unchanged)."""
    layers = []
    for e in cache.layers:
        if isinstance(e, RecState) and e.steps is not None:
            idx = counts.astype(mx.int32)
            layers.append(RecState(tuple(
                mx.take_along_axis(s, idx.reshape(-1, *([1] * (s.ndim - 1))), axis=1)[:, 0]
                for s in e.steps)))
        else:
            layers.append(e)
    return KVCache(layers=tuple(layers), lengths=lengths.astype(mx.int32), layout=cache.layout,
                   capacity=cache.capacity)


# ------------------------------------------------------------------ shell-side operations


def span_bucket(needed: int, capacity: int) -> int:
    """The attention span (a static shape) for `needed` slots: rounded up to a multiple of a
    quarter of the power of two below it (min 256), capped at capacity. CPU attention costs
    time linear in the span, and each distinct span is one compiled graph: four per octave
    keeps the waste under 25% (above 1024) and the compiles few."""
    if needed >= capacity:
        return capacity
    lower = pow2_floor(max(1, needed - 1))  # needed is in (lower, 2 * lower]
    step = max(256, lower // 4)
    return min(capacity, -(-needed // step) * step)


def with_lengths(cache: KVCache, lengths: mx.array) -> KVCache:
    """Rollback (or commit) by length: entries past each row's length become stale."""
    return tree_replace(cache, lengths=lengths.astype(mx.int32))


def prefix_in_cache(layout: Sequence[LayerSpec], length: int, prefix: int) -> bool:
    """Whether a row of `length` positions still holds its first `prefix` ones in every
    layer: a sliding-window ring that has wrapped keeps only the latest positions, so then
    only the whole row (prefix == length) can be reused. The one ring rule for reusing a
    cached row (insert_row, the prefix cache)."""
    if prefix == length:
        return True
    if any(s.state for s in layout):  # a recurrent state is that of exactly its length
        return False
    rings = [s.ring for s in layout if s.ring]
    return not rings or length <= min(rings)


def bytes_per_token(layout: Sequence[LayerSpec], dtype: mx.Dtype) -> float:
    """Cache bytes per position of capacity, per row (ring entries excluded: see
    `bytes_per_row_fixed`). Quantized entries: packed values plus a scale and bias per group
    (their float head is counted as quantized: an approximation for long contexts)."""
    total = 0.0
    for s in layout:
        if s.ring or s.state:
            continue
        if s.bits:
            groups = s.head_dim // s.group_size
            total += 2 * s.kv_heads * (s.head_dim * s.bits / 8 + 2 * groups * dtype.size)
        else:
            total += s.kv_heads * (s.head_dim + s.v_dim) * dtype.size
    return total


def bytes_per_row_fixed(layout: Sequence[LayerSpec], dtype: mx.Dtype) -> int:
    """Bytes per row of the ring and recurrent entries (independent of the capacity)."""
    rings = sum(s.kv_heads * (s.ring + 1) * (s.head_dim + s.v_dim) * dtype.size for s in layout if s.ring)
    states = sum(math.prod(shape) * state_dtype(s, i, dtype).size
                 for s in layout for i, shape in enumerate(s.state))
    return rings + states
