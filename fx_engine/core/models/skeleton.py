"""The decoder skeleton every family's forward shares: the step geometry, the pipeline
stage's input and output, the final norm and the output head, around the family's own
layers.

A family's forward is `decoder_step(params, cache, tokens, n_valid, span, layers)`, where
`layers(h, geo)` runs its layers over the residual stream h [B*T, hidden] and returns the
new stream and the written cache entries; everything before (the geometry, the embedding
or the previous stage's stream) and after (the hand-over to the next stage, or the final
norm) is here once, so a family reads as its layers. The params records themselves
(`DecoderParams`) and the pipeline stage they may hold (`PipelineStage`) live here too.

Capturing hidden states (the seam learned drafters read the target through: EAGLE-3's
three aux layers, an MTP head's last hidden state): a `Capture` names boundaries of the
layer stack; `models.forward(..., capture=)` hands it to this step through the cache (like
`keep_steps`), each family's layer loop reports the stream entering each layer
(`geo.layer_input(h)`), and the step returns, next to its hidden states and cache, the
captured states of every position it processed [B, T, points * hidden]: no second forward.
Without a Capture nothing is recorded and the graph is the one it always was.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs
import mlx.core as mx

from fx_engine.core.cache import KVCache, StepGeometry, advanced
from fx_engine.core.nn import Numerics, embed, linear, rms_norm
from fx_engine.core.tree import static_field

__all__ = ["Capture", "CaptureError", "DecoderParams", "PipelineStage", "captured_states", "cut_layers",
           "decoder_step", "embedded_scaled", "embedded_tokens", "final_rms_norm", "hands_on", "head_logits",
           "later_stage", "stage_input", "stage_logits", "stage_output"]


class CaptureError(ValueError):
    """A capture this model cannot give (its family does not report its layers, a
    pipeline stage, a boundary outside the model): the message names the model type."""


@attrs.frozen
class Capture:
    """Which hidden states a step returns next to its output, at every position it
    processes (a static value: part of the compiled step's key).

    layers: boundaries of the layer stack, in output order, each b in [0, N] (N: the
    model's num_layers): b < N the residual stream *entering* layer b (0: the embeddings as
    the first layer reads them; vLLM's and SGLang's EAGLE-3 capture point, their
    `hidden_states + residual` before layer b), b == N the stream after the last layer,
    before the final norm. normed: also the final norm's output (what the output head
    reads), after them. The captured array is [B, T, (len(layers) + normed) * hidden]."""

    layers: tuple[int, ...] = static_field(default=(), converter=tuple)
    normed: bool = static_field(default=False)

    def __attrs_post_init__(self) -> None:
        if not self.layers and not self.normed:
            raise CaptureError("Capture: name at least one layer boundary or normed=True")
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in self.layers):
            raise CaptureError(f"Capture: layer boundaries must be integers >= 0, got {self.layers!r}")

    @property
    def points(self) -> int:
        """How many hidden states each position gets."""
        return len(self.layers) + int(self.normed)


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
    before the last: the stream as sent on) and the new cache; when the cache carries a
    `Capture` (`cache.capture`), also the captured states [B, T, points * hidden] (the
    family's loop calls `geo.layer_input(h)` first thing for each layer). Positions past a row's
    n_valid (and past the capacity) are computed but written to the cache's sink slot: a
    row's valid entries are never touched by another row's step.

    With `cache.packed` (core/packing.py) the stream `layers` runs on is the packed rows
    [packed, hidden]; whatever the family does across rows goes through `geo.unpack` /
    `geo.pack` (its attention: `blocks.self_attention`), and the returned states are
    unpacked again.
    """
    b, t = tokens.shape
    geo = StepGeometry(cache, n_valid.astype(mx.int32), t, span)
    if geo.capture is not None:
        _check_capture(p, geo.capture)
    h = stage_input(p, b * t, lambda: embedded(p, tokens))
    if geo.packed is not None:  # (core/packing.py: the family's layers run on the packed rows)
        if _stage(p) is not None:
            raise ValueError(f"pack: packed rows are not supported with pipeline parallelism ({_model_type(p)})")
        h = geo.pack(h)
    h, entries = layers(h, geo)
    h = geo.unpack(h)
    handed = stage_output(p, h)
    if handed is not None:  # not the last stage: the stream went on (no norm, no head)
        return handed.reshape(b, t, -1), advanced(cache, entries, geo)
    out = final_norm(p, h)
    if geo.capture is None:
        return out.reshape(b, t, -1), advanced(cache, entries, geo)
    return out.reshape(b, t, -1), advanced(cache, entries, geo), captured_states(p, geo, h, out).reshape(b, t, -1)


def _model_type(p: Any) -> str:
    return getattr(p.config, "model_type", type(p).__name__)


def _check_capture(p: Any, capture: Capture) -> None:
    """Trace-time: the boundaries lie in the model; a pipeline stage refuses (its captured
    layers may live on other ranks: nothing carries them to the last stage yet)."""
    if _stage(p) is not None:
        raise CaptureError(f"capturing hidden states is not supported with pipeline parallelism "
                           f"({_model_type(p)}: use tensor parallelism or one process)")
    n = p.config.num_layers
    bad = [b for b in capture.layers if b > n]
    if bad:
        raise CaptureError(f"capture boundaries {bad} are not boundaries of a {n}-layer "
                           f"{_model_type(p)} model (0 .. {n})")


def captured_states(p: Any, geo: StepGeometry, h: mx.array, out: mx.array) -> mx.array:
    """The capture of a step [B*T, points * hidden]: the streams its layers reported
    entering each layer (`geo.layer_input`), h after the last one, the final norm's out."""
    n = p.config.num_layers
    seen = geo.layer_inputs
    if len(seen) != n:
        raise CaptureError(f"the {_model_type(p)} forward reported {len(seen)} layer inputs for {n} layers: "
                           "its layer loop does not support capturing hidden states")
    streams = [geo.unpack(seen[b]) if b < n else h for b in geo.capture.layers]
    if geo.capture.normed:
        streams.append(out)
    return streams[0] if len(streams) == 1 else mx.concatenate(streams, axis=-1)


def head_logits(p: DecoderParams, h: Any) -> Any:
    """float32 logits of final hidden states through the output head (or the tied embedding)."""
    return stage_logits(p, h, lambda: linear(h, p.lm_head if p.lm_head is not None else p.embed,
                                             p.numerics).astype(mx.float32))
