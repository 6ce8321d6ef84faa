"""Per-row low-rank adapters (LoRA, DoRA) as step inputs: pure data and functions.

Many adapters serve one base model in one batch: every linear an adapter targets gets a
`nn.LoraStack` (one slot per loaded adapter, slot 0 = no adapter), and each step takes an
`Adapters` input, the bank of stacks plus the slot of every row. `with_adapters` binds them
to the params inside the step (at trace time), so the low-rank products run per row in the
same compiled graph as the base product (`nn.lora_update`); rows of different adapters and
rows without one share the step. The stacks' shapes come from buckets (slots and ranks
rounded up to powers of two), so loading another adapter re-uses the compiled steps unless
it needs a bigger bucket or targets a linear no adapter targeted before.

Which linear an adapter module lands on: `nn.Linear.origin` records the checkpoint modules
a linear's rows come from (q|k|v fused into one matrix: three segments), so the bank places
a module's low-rank factors on the rows of its segment: the A factors of a fused linear's
segments are concatenated along the rank and B is block-diagonal (exact).
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.nn import Linear, LoraBinding, LoraStack
from fx_engine.core.tree import tree_replace

__all__ = ["AdapterBank", "Adapters", "LoraStack", "Segment", "bank_from", "bucket", "map_linears",
           "with_adapters"]


@attrs.frozen
class AdapterBank:
    """Stacks aligned with `nn.linears(params)` order (None: no adapter targets that linear)."""

    __fx_memo_flatten__ = True

    stacks: tuple


@attrs.frozen
class Adapters:
    """One step's adapter input: the bank and each row's slot (0: the base model)."""

    bank: AdapterBank
    rows: Int[mx.array, "B"]


def map_linears(tree: Any, fn: Callable[[int, Linear], Linear]) -> Any:
    """`tree` with its i-th Linear (in `nn.linears` order) replaced by fn(i, linear); works
    on traced params (no validators run). Unchanged subtrees are returned as they are."""
    count = [0]

    def walk(node: Any) -> Any:
        if isinstance(node, Linear):
            i = count[0]
            count[0] += 1
            return fn(i, node)
        if attrs.has(type(node)):
            changes = {}
            for f in attrs.fields(type(node)):
                old = getattr(node, f.name)
                new = walk(old)
                if new is not old:
                    changes[f.name] = new
            return tree_replace(node, **changes) if changes else node
        if isinstance(node, (tuple, list)):
            items = [walk(x) for x in node]
            if all(a is b for a, b in zip(items, node)):
                return node
            return type(node)(items) if isinstance(node, list) or not hasattr(node, "_fields") else type(node)(*items)
        if isinstance(node, dict):
            items = {k: walk(v) for k, v in node.items()}
            return node if all(items[k] is node[k] for k in node) else items
        return node

    return walk(tree)


def with_adapters(params: Any, adapters: Adapters | None) -> Any:
    """params with each targeted linear bound to its stack and the step's row slots."""
    if adapters is None:
        return params
    stacks, rows = adapters.bank.stacks, adapters.rows

    def bind(i: int, lin: Linear) -> Linear:
        st = stacks[i] if i < len(stacks) else None
        return lin if st is None else tree_replace(lin, lora=LoraBinding(stack=st, rows=rows))

    return map_linears(params, bind)


def bucket(n: int, least: int) -> int:
    """n rounded up to a power of two, at least `least` (slot and rank buckets)."""
    b = least
    while b < n:
        b *= 2
    return b


@attrs.frozen
class Segment:
    """One adapter's factors on one row range of a linear: rows [start, start + B.shape[1])
    get x @ a @ b (a [K, r], b [r, rows], the LoRA scale folded into b), and `mag` (DoRA's
    m / row norm of the adapted weight, [rows]) when the adapter is DoRA."""

    start: int
    a: Float[mx.array, "K r"]
    b: Float[mx.array, "r rows"]
    mag: Float[mx.array, "rows"] | None = None


def bank_from(
    n_linears: int, shapes: dict[int, tuple[int, int]], slots: dict[int, dict[int, list[Segment]]],
    n_slots: int, min_rank: int = 8,
) -> AdapterBank:
    """The stacks of every targeted linear. shapes[i] = (in, out) of linear i; slots[i][s]:
    adapter slot s's segments on linear i (s >= 1). Each stack holds `n_slots` slots and the
    rank bucket of its widest slot; untouched slots are zeros (and magnitude one)."""
    stacks: list[LoraStack | None] = [None] * n_linears
    for i, per_slot in slots.items():
        k, n = shapes[i]
        rank = bucket(max(sum(s.a.shape[1] for s in segs) for segs in per_slot.values()), min_rank)
        a = mx.zeros((n_slots, k, rank), mx.float32)
        b = mx.zeros((n_slots, rank, n), mx.float32)
        dora = any(s.mag is not None for segs in per_slot.values() for s in segs)
        mag = mx.ones((n_slots, n), mx.float32) if dora else None
        for slot, segs in per_slot.items():
            r0 = 0
            for s in segs:
                r, rows = s.a.shape[1], s.b.shape[1]
                a[slot, :, r0 : r0 + r] = s.a.astype(mx.float32)
                b[slot, r0 : r0 + r, s.start : s.start + rows] = s.b.astype(mx.float32)
                if s.mag is not None:
                    mag[slot, s.start : s.start + rows] = s.mag.astype(mx.float32)
                r0 += r
        stacks[i] = LoraStack(a=a, b=b, mag=mag)
    return AdapterBank(stacks=tuple(stacks))
