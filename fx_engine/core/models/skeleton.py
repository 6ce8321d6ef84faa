"""The decoder skeleton every family's forward shares: the step geometry, the pipeline
stage's input and output, the final norm and the output head, around the family's own
layers.

A family's forward is `decoder_step(params, cache, tokens, n_valid, span, layers)`, where
`layers(h, geo)` runs its layers over the residual stream h [B*T, hidden] and returns the
new stream and the written cache entries; everything before (the geometry, the embedding
or the previous stage's stream) and after (the hand-over to the next stage, or the final
norm) is here once, so a family reads as its layers. The params records themselves
(`DecoderParams`) and the pipeline stage they may hold (`PipelineStage`) live here too.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, StepGeometry, advanced
from fx_engine.core.nn import Numerics, embed, linear, rms_norm
from fx_engine.core.tree import static_field

__all__ = ["DecoderParams", "PipelineStage", "cut_layers", "decoder_step", "embedded_scaled", "embedded_tokens",
           "final_rms_norm", "hands_on", "head_logits", "later_stage", "stage_input", "stage_logits", "stage_output"]


@attrs.frozen
class PipelineStage:
    """The pipeline stage a params pytree holds (core/parallel.stage_params): its `rank` of
    `ranks` stages, the index of its `first_layer` among the model's `num_layers`, and the
    mx.distributed `group` of the stages (None: the world group; a subgroup when each
    stage's layers are also split over ranks, whose ranks pass activations to the same
    tensor rank of the next stage). Static: part of the compile key, like the tuple it
    replaces."""

    rank: int
    ranks: int
    first_layer: int
    num_layers: int
    group: Any = None

    @property
    def later(self) -> bool:
        """Whether this stage comes after the first (its stream comes from the previous)."""
        return self.rank > 0

    @property
    def hands_on(self) -> bool:
        """Whether this stage comes before the last (it hands its stream to the next)."""
        return self.rank < self.ranks - 1


@attrs.frozen
class DecoderParams:
    """The params shape many families share (those that write their own forward over their
    own layer records): each subclasses it, so its type says which family it is."""

    __fx_memo_flatten__ = True  # immutable and flattened every step (fx_engine.core.tree)
    embed: Any  # nn.Linear (the embedding table)
    layers: tuple[Any, ...]
    norm: Any  # the final norm's weight
    lm_head: Any  # nn.Linear, or None: tied to the embedding
    config: Any = static_field()
    numerics: Any = static_field(factory=Numerics)
    dtype: str = static_field(default="float32")
    pipeline: PipelineStage | None = static_field(default=None)  # a stage's (core/parallel.stage_params)


def cut_layers(p: Any, start: int, end: int, per_layer: tuple[str, ...] = (),
               indices: tuple[str, ...] = ()) -> Any:
    """The params of layers [start, end) (shared arrays; embedding, final norm and head
    kept), with the config's per-layer fields cut: `per_layer` hold one entry per layer (a
    tuple or a string), `indices` hold layer numbers (renumbered from `start`). A family's
    `layer_range` calls it with its own fields."""
    cfg = p.config
    if not 0 <= start < end <= cfg.num_layers:
        raise ValueError(f"layers [{start}, {end}) are not a range of {cfg.num_layers} layers")
    cut = {name: getattr(cfg, name)[start:end] for name in per_layer if getattr(cfg, name, None)}
    cut.update({name: tuple(i - start for i in getattr(cfg, name) if start <= i < end)
                for name in indices if getattr(cfg, name, None)})
    return attrs.evolve(p, layers=tuple(p.layers[start:end]),
                        config=attrs.evolve(cfg, num_layers=end - start, **cut))


# ---------------------------------------------------------------- pipeline stages
# A family's forward runs pipeline stages through `decoder_step` (or, where it hands on
# more than the residual stream, calls these itself): at its start, after its layers and
# in its head; `params.pipeline` is the stage's `PipelineStage`, None for a whole model.


def _stage(p: Any) -> PipelineStage | None:
    return getattr(p, "pipeline", None)


def later_stage(p: Any) -> bool:
    """Whether p is a pipeline stage after the first (its stream comes from the previous)."""
    stage = _stage(p)
    return stage is not None and stage.later


def hands_on(p: Any) -> bool:
    """Whether p is a pipeline stage before the last (it hands its stream to the next)."""
    stage = _stage(p)
    return stage is not None and stage.hands_on


def stage_input(p: Any, rows: int, embedded: Callable[[], mx.array], width: int | None = None) -> mx.array:
    """The residual stream a step starts from: `embedded()` (the tokens' embeddings), or on
    a later pipeline stage the [rows, width] stream the previous stage sent (width: hidden,
    or more where a family hands on more than the residual stream with it)."""
    if later_stage(p):
        return mx.distributed.recv((rows, width or p.config.hidden_size), getattr(mx, p.dtype),
                                   p.pipeline.rank - 1, group=p.pipeline.group)
    return embedded()


def stage_output(p: Any, h: mx.array) -> mx.array | None:
    """On a pipeline stage before the last: h sent on to the next stage (evaluating it
    performs the send); None on the last stage (or without a pipeline)."""
    if hands_on(p):
        return mx.distributed.send(h, p.pipeline.rank + 1, group=p.pipeline.group)
    return None


def stage_logits(p: Any, h: mx.array, logits: Callable[[], mx.array]) -> mx.array:
    """`logits()` (float32), made the same on every pipeline stage: the last stage's are
    summed with zeros from the others (exact), so every rank samples the same tokens; the
    zeros depend on h, so evaluating them performs a stage's send."""
    stage = _stage(p)
    if stage is None:
        return logits()
    if stage.hands_on:
        zeros = mx.depends(mx.zeros((*h.shape[:-1], p.config.vocab_size), mx.float32), h)
        return mx.distributed.all_sum(zeros, group=stage.group)
    return mx.distributed.all_sum(logits(), group=stage.group)


# ---------------------------------------------------------------- the step


def embedded_tokens(p: Any, tokens: mx.array) -> mx.array:
    """The tokens' embeddings [B*T, hidden] in the activation dtype (the usual first step;
    a family that scales them passes its own `embedded` to `decoder_step`)."""
    return embed(tokens.reshape(-1), p.embed).astype(getattr(mx, p.dtype))


def embedded_scaled(p: Any, tokens: mx.array) -> mx.array:
    """The embeddings times the config's embedding_multiplier (muP-style families), always
    multiplied (as their reference implementations do, even by 1)."""
    return embedded_tokens(p, tokens) * p.config.embedding_multiplier


def final_rms_norm(p: Any, h: mx.array) -> mx.array:
    """The usual final norm: RMSNorm with the model's weight and eps."""
    return rms_norm(h, p.norm, p.config.rms_norm_eps, p.numerics)


Layers = Callable[[mx.array, StepGeometry], "tuple[mx.array, list[Any]]"]


def decoder_step(
    p: Any, cache: KVCache, tokens: mx.array, n_valid: mx.array, span: int | None, layers: Layers, *,
    embedded: Callable[[Any, mx.array], mx.array] = embedded_tokens,
    final_norm: Callable[[Any, mx.array], mx.array] = final_rms_norm,
) -> tuple[mx.array, KVCache]:
    """Run T tokens per row from each row's current length; advance lengths by n_valid.

    span (static): attend over cache slots [0, span) only; the caller guarantees
    max(lengths) + T <= span <= capacity (see `span_bucket`). None: the whole capacity.

    `layers(h, geo)` -> (h, entries) runs the family's layers over the residual stream,
    kept 2-D [B*T, hidden] (matmuls on 2-D inputs need no flatten/unflatten nodes; each
    graph node costs ~10 us on CPU), and returns every cache entry, written or not, in
    layout order. Returns the final-norm hidden states [B, T, hidden] (on a pipeline stage
    before the last: the stream as sent on) and the new cache. Positions past a row's
    n_valid (and past the capacity) are computed but written to the cache's sink slot: a
    row's valid entries are never touched by another row's step.
    """
    b, t = tokens.shape
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    h = stage_input(p, b * t, lambda: embedded(p, tokens))
    h, entries = layers(h, geo)
    handed = stage_output(p, h)
    if handed is not None:  # not the last stage: the stream went on (no norm, no head)
        return handed.reshape(b, t, -1), advanced(cache, entries, geo)
    return final_norm(p, h).reshape(b, t, -1), advanced(cache, entries, geo)


def head_logits(p: DecoderParams, h: Any) -> Any:
    """float32 logits of final hidden states through the output head (or the tied embedding)."""
    return stage_logits(p, h, lambda: linear(h, p.lm_head if p.lm_head is not None else p.embed,
                                             p.numerics).astype(mx.float32))
