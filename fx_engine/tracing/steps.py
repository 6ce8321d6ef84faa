"""The step functions' graphs for one shape bucket of a model."""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.cache import span_bucket
from fx_engine.loading.model import Model
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.speculative import verify_step
from fx_engine.core.state import init_state
from fx_engine.core.steps import (decode_step, decode_step_compiled, prefill_step, prefill_step_compiled, verify_step_compiled)
from fx_engine.tracing.graph import Graph, function_graph

STEPS = ("prefill_step", "decode_step", "verify_step")
VIEWS = ("traced", "compiled")


@attrs.frozen
class Bucket:
    """A shape bucket: batch rows, cache capacity, prefill chunk, draft length (verify)."""

    rows: int = 4
    capacity: int = 512
    chunk: int = 64
    draft: int = 4

    def __attrs_post_init__(self) -> None:
        for f in ("rows", "capacity", "chunk", "draft"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f}: must be >= 1, got {getattr(self, f)}")
        if self.chunk > self.capacity:
            raise ValueError(f"chunk: {self.chunk} is larger than capacity {self.capacity}")

    def label(self) -> str:
        return f"rows={self.rows} capacity={self.capacity} chunk={self.chunk} draft={self.draft}"


def step_inputs(model: Model, bucket: Bucket) -> dict[str, tuple[tuple, tuple[str, ...]]]:
    """step name -> (positional arguments, their names) for an empty cache of the bucket."""
    b = bucket
    cache = model.new_cache(b.rows, b.capacity, headroom=max(b.chunk, b.draft + 1))
    state = init_state([SamplingConfig()] * b.rows, [[0]] * b.rows, model.config.vocab_size)
    tokens = mx.zeros((b.rows, b.chunk), mx.int32)
    n_valid = mx.full((b.rows,), b.chunk, mx.int32)
    drafts = mx.zeros((b.rows, b.draft), mx.int32)
    n_draft = mx.full((b.rows,), b.draft, mx.int32)
    p = model.params
    return {
        "prefill_step": ((p, cache, tokens, n_valid), ("params", "cache", "tokens", "n_valid")),
        "decode_step": ((p, cache, state), ("params", "cache", "state")),
        "verify_step": ((p, cache, state, drafts, n_draft), ("params", "cache", "state", "drafts", "n_draft")),
    }


def step_spans(bucket: Bucket) -> dict[str, int]:
    """The attention span the Engine passes for the first step of each kind in this bucket
    (rows at position 0), so that the graphs are the ones it compiles."""
    b = bucket
    return {"prefill_step": span_bucket(b.chunk, b.capacity), "decode_step": span_bucket(1, b.capacity),
            "verify_step": span_bucket(b.draft + 1, b.capacity)}


_FUNCTIONS = {
    ("prefill_step", "traced"): prefill_step, ("prefill_step", "compiled"): prefill_step_compiled,
    ("decode_step", "traced"): decode_step, ("decode_step", "compiled"): decode_step_compiled,
    ("verify_step", "traced"): verify_step, ("verify_step", "compiled"): verify_step_compiled,
}


def step_graphs(model: Model, bucket: Bucket, steps: tuple[str, ...] = STEPS,
                views: tuple[str, ...] = VIEWS) -> dict[tuple[str, str], Graph]:
    """(step, view) -> Graph for the bucket. Unknown names are ValueErrors naming them."""
    for s in steps:
        if s not in STEPS:
            raise ValueError(f"steps: unknown step {s!r} (one of {', '.join(STEPS)})")
    for v in views:
        if v not in VIEWS:
            raise ValueError(f"views: unknown view {v!r} (one of {', '.join(VIEWS)})")
    inputs = step_inputs(model, bucket)
    spans = step_spans(bucket)
    out: dict[tuple[str, str], Any] = {}
    for s in steps:
        args, names = inputs[s]
        for v in views:
            out[(s, v)] = function_graph(_FUNCTIONS[(s, v)], args, {"span": spans[s]}, name=s, view=v,
                                         arg_names=names)
    return out
