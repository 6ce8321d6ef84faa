"""`Family`: everything fx-engine knows about one model family, as one record of pure
functions. Each family module (llama.py, gemma.py, phi3.py, ...) ends with its `FAMILY`;
the registry (`fx_engine.core.models`) maps every `model_type` and GGUF
`general.architecture` to one, and nothing outside the family modules branches on the
family.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import mlx.core as mx

from fx_engine.core.checkpoint import LoadOptions, TensorSource, TensorSpec
from fx_engine.core.nn import Numerics, linear
from fx_engine.core.tree import static_field


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
    # (rank, ranks, first layer, all layers, group) on a pipeline stage (core/parallel.stage_params)
    pipeline: tuple = static_field(default=())


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


def head_logits(p: DecoderParams, h: Any) -> Any:
    """float32 logits of final hidden states through the output head (or the tied embedding)."""
    return stage_logits(p, h, lambda: linear(h, p.lm_head if p.lm_head is not None else p.embed,
                                             p.numerics).astype(mx.float32))


# ---------------------------------------------------------------- pipeline stages
# A family whose forward runs pipeline stages (core/parallel.stage_params) calls these at
# its start, after its layers and in its head; `params.pipeline` is (rank, ranks, first
# layer, all layers, group) on a stage, () otherwise: the stages' mx.distributed group
# (None: the world group; a subgroup when each stage's layers are also split over ranks,
# whose ranks pass activations to the same tensor rank of the next stage).


def _pipe_group(p: Any) -> Any:
    return p.pipeline[4]


def later_stage(p: Any) -> bool:
    """Whether p is a pipeline stage after the first (its stream comes from the previous)."""
    pipe = getattr(p, "pipeline", ())
    return bool(pipe) and pipe[0] > 0


def hands_on(p: Any) -> bool:
    """Whether p is a pipeline stage before the last (it hands its stream to the next)."""
    pipe = getattr(p, "pipeline", ())
    return bool(pipe) and pipe[0] < pipe[1] - 1


def stage_input(p: Any, rows: int, embedded: Callable[[], mx.array], width: int | None = None) -> mx.array:
    """The residual stream a step starts from: `embedded()` (the tokens' embeddings), or on
    a later pipeline stage the [rows, width] stream the previous stage sent (width: hidden,
    or more where a family hands on more than the residual stream with it)."""
    if later_stage(p):
        return mx.distributed.recv((rows, width or p.config.hidden_size), getattr(mx, p.dtype),
                                   p.pipeline[0] - 1, group=_pipe_group(p))
    return embedded()


def stage_output(p: Any, h: mx.array) -> mx.array | None:
    """On a pipeline stage before the last: h sent on to the next stage (evaluating it
    performs the send); None on the last stage (or without a pipeline)."""
    if hands_on(p):
        return mx.distributed.send(h, p.pipeline[0] + 1, group=_pipe_group(p))
    return None


def stage_logits(p: Any, h: mx.array, logits: Callable[[], mx.array]) -> mx.array:
    """`logits()` (float32), made the same on every pipeline stage: the last stage's are
    summed with zeros from the others (exact), so every rank samples the same tokens; the
    zeros depend on h, so evaluating them performs a stage's send."""
    if not getattr(p, "pipeline", ()):
        return logits()
    if hands_on(p):
        zeros = mx.depends(mx.zeros((*h.shape[:-1], p.config.vocab_size), mx.float32), h)
        return mx.distributed.all_sum(zeros, group=_pipe_group(p))
    return mx.distributed.all_sum(logits(), group=_pipe_group(p))


@attrs.frozen
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json `model_type`s this family reads
    config_type: type  # its frozen config class (the params' static `config`)
    params_type: type  # its params pytree class
    # config.json dict (and its source, for errors) -> config; refuses what it cannot run
    config_from_hf: Callable[[dict[str, Any], str], Any]
    # config, checkpoint tensors under Hugging Face / mlx-community names -> params
    assemble: Callable[[Any, TensorSource, LoadOptions], Any]
    # config -> one `LayerSpec` per cache entry (before `finish_layout`)
    cache_specs: Callable[[Any], tuple[Any, ...]]
    # (params, cache, tokens [B, T], n_valid [B], span) -> (final hidden [B, T, H], cache)
    forward: Callable[..., Any]
    # (params, hidden [..., H]) -> float32 logits [..., V]
    hidden_to_logits: Callable[[Any, Any], Any]
    # config -> the Hugging Face checkpoint's tensors (names, shapes; tiny test models)
    checkpoint_layout: Callable[[Any], Mapping[str, TensorSpec]]
    # GGUF `general.architecture`s, and metadata -> config, tensors -> params
    gguf_architectures: tuple[str, ...] = ()
    # metadata -> whether this family reads the file, where two share an architecture
    # (llama.cpp writes Mixtral as "llama" with expert_count)
    gguf_accepts: Callable[[dict[str, Any]], bool] | None = None
    config_from_gguf: Callable[[dict[str, Any], str], Any] | None = None
    assemble_gguf: Callable[[Any, TensorSource, LoadOptions], Any] | None = None
    # multimodal wrappers: model_type -> (the text model_type, defaults mlx-lm applies)
    wrappers: Mapping[str, tuple[str, Mapping[str, Any]]] = attrs.field(factory=dict)
    # (params, start, end) -> params of layers [start, end), their config's per-layer fields
    # cut (`cut_layers`): the first n for self-speculative drafts, a run of layers for a
    # pipeline stage (core/parallel.stage_params); ConfigError where the family's layers
    # cannot be cut there; None: neither
    layer_range: Callable[[Any, int, int], Any] | None = None
    # (params, rank, ranks) -> that rank's tensor-parallel shard (core/parallel.py: heads,
    # MLP features, experts' features, vocabulary rows); None: not split over ranks
    tensor_split: Callable[[Any, int, int], Any] | None = None
    # (model_type, overrides) -> config.json of a tiny random test model (testing.tiny)
    tiny_config: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
