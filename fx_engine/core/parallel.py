"""Tensor parallelism: one rank's shard of a model's params (pure).

Megatron's split, on an `mx.distributed` group (the world's, or a subgroup): each rank
holds a contiguous group of KV heads with their query heads (q|k|v rows; the same columns of o_proj, whose partial
products are summed over the ranks: `Linear.shard`, a "sum" `Shard`), a contiguous slice of the MLP's
intermediate features (gate|up rows, the same columns of down_proj, summed), and a slice of
the vocabulary (rows of the embedding table and of the output head: lookups summed, logits
gathered: a "vocab" `Shard`). Norms, RoPE tables and biases of summed linears are
replicated. The shard's config says how many heads and features it holds, so the family's
own forward runs unchanged on it, and its cache layout holds only its KV heads.

Pipeline parallelism (`stage_params`): rank r holds a contiguous run of layers (its cache
only those layers' entries); the first stage embeds, each stage receives the residual
stream from the one before (`recv`) and hands it on (`send`), the last applies the final
norm and the head, and its logits are summed with zeros from the others (`all_sum`), so
every rank samples the same tokens. One stage computes at a time (no micro-batches): it
adds memory (each rank holds 1/N of the layers), not speed.

Each family names its split (`Family.tensor_split`): `shard_decoder` for the decoders whose
layers hold a fused q|k|v, o and an MLP or routed experts (the Llama decoder's families,
Cohere, GPT-OSS); the others their own (Gemma's per-layer head sizes, DeepSeek's latent
attention, the recurrent mixers), built from the helpers in core/splits.py (`split_attention`,
`split_mlp`, `split_experts`, `split_mixer`, `split_head`); and how it cuts its layers
(`Family.layer_range`), which `stage_params` uses for every family.

Both at once (T x P ranks): `shard_params` then `stage_params`, each given its subgroup of
the world group (`on_group` records the tensor group on every split linear; the stage's
group is `params.pipeline.group`), so a stage's sums stay among its ranks and
its hand-over goes to the same tensor rank of the next stage.

Uneven splits are allowed (SmolLM2's 3 KV heads on 2 ranks: 2 + 1, with their 6 + 3 query
heads); quantized linears split only where their groups stay whole. Every rank computes
the same full logits, so sampling (per-row keys) gives the same tokens on every rank.
"""

from __future__ import annotations

import itertools
from typing import Any

import attrs
import mlx.core as mx

from fx_engine.core.adapters import map_linears
from fx_engine.core.config import ConfigError
from fx_engine.core.models.registry import family_of
from fx_engine.core.models.skeleton import PipelineStage
from fx_engine.core.nn import Linear
from fx_engine.core.splits import (head_range, shard_decoder, split, split_attention, split_cols, split_experts,
                                   split_head, split_mixer, split_mlp, split_rows, split_vocab)

__all__ = ["head_range", "on_group", "shard_decoder", "shard_params", "split", "split_attention", "split_cols",
           "split_experts", "split_head", "split_mixer", "split_mlp", "split_rows", "split_vocab",
           "stage_layers", "stage_params"]

def shard_params(params: Any, rank: int, size: int, group: Any = None) -> Any:
    """Rank `rank` of `size`'s tensor-parallel shard of a model (its family's
    `Family.tensor_split`): ConfigError for a family without one or a split the weights do
    not allow. group: the mx.distributed group of the `size` ranks (None: the world group;
    a subgroup when pipeline stages are split too: `on_group`)."""
    if size == 1:
        return params
    family = family_of(params.config)
    if family.tensor_split is None:
        raise ConfigError(f"tensor parallel: {family.name} models cannot be split over ranks yet "
                          "(pipeline parallelism splits them by layers)")
    # Some splits fail on one rank only (heads across a B/C group, a quantization group cut
    # by one rank's share): every rank tries every rank's split (lazy slices, nothing read),
    # so all stop with the same error instead of the others waiting on a collective.
    for r in range(size):
        if r != rank:
            family.tensor_split(params, r, size)
    shard = family.tensor_split(params, rank, size)
    return shard if group is None else on_group(shard, group)
def on_group(tree: Any, group: Any) -> Any:
    """`tree` with every tensor-parallel linear's collectives on `group` (`Shard.group`):
    the families' splits name what is summed or gathered, this names over which ranks."""
    return map_linears(tree, lambda _, lin: lin if lin.shard is None else
                       attrs.evolve(lin, shard=attrs.evolve(lin.shard, group=group)))
def stage_layers(num_layers: int, size: int, layers: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each of `size` stages' [start, end) of `num_layers` layers: `layers`, one count per
    stage (hosts of unequal memory), or as even as possible (earlier stages taking the
    remainder)."""
    if layers is None:
        return [split(num_layers, size, r, kind="pipeline parallel") for r in range(size)]
    if len(layers) != size or sum(layers) != num_layers or min(layers) < 1:
        raise ConfigError(f"pipeline_layers: {size} layer counts of at least 1 that sum to the model's "
                          f"{num_layers} layers are needed, got {list(layers)}")
    ends = list(itertools.accumulate(layers))
    return [(end - n, end) for n, end in zip(layers, ends)]
def stage_params(params: Any, rank: int, size: int, group: Any = None,
                 layers: tuple[int, ...] | None = None) -> Any:
    """Rank `rank` of `size`'s pipeline stage of a model of any family that can cut its
    layers (`Family.layer_range`): its layers (`stage_layers`: `layers` per stage, or as
    even as possible), the embedding table on the first stage, the head on the last (a
    tied head keeps the table; the final norm, one vector, stays on every stage). group:
    the mx.distributed group of the `size` stages (None: the world group); params already
    split over ranks (`shard_params`) make each stage's split of its layers."""
    if size == 1:
        return params
    family = family_of(params.config)
    if family.layer_range is None:
        raise ConfigError(f"pipeline parallel: {family.name} models cannot be split by layers")
    cfg = params.config
    cuts = stage_layers(cfg.num_layers, size, layers)
    try:  # every stage's cut, on every rank (one may be refused where another is not)
        stages = [family.layer_range(params, *cut) for cut in cuts]
    except ConfigError as e:
        raise ConfigError(str(e) if str(e).startswith("pipeline parallel") else f"pipeline parallel: {e}") from None
    l0, _ = cuts[rank]
    stage = stages[rank]
    first, last = rank == 0, rank == size - 1
    head = getattr(params, "lm_head", None)
    nothing = Linear(weight=mx.zeros((1, 1), mx.float32))
    changes: dict[str, Any] = {"embed": params.embed if first or (last and head is None) else nothing,
                               "pipeline": PipelineStage(rank, size, l0, cfg.num_layers, group)}
    if "lm_head" in attrs.fields_dict(type(params)):  # (a family without one ties its head)
        changes["lm_head"] = head if last else None
    return attrs.evolve(stage, **changes)

