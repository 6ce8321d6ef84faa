"""`Family`: everything fx-engine knows about one model family, as one record of pure
functions. Each family module (llama.py, gemma.py, phi3.py, ...) ends with its `FAMILY`;
the registry (`fx_engine.core.models.registry`, re-exported by `fx_engine.core.models`)
maps every `model_type` and GGUF `general.architecture` to one, and nothing outside the
family modules branches on the family. The shared params record and the pipeline-stage
helpers are in skeleton.py.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs

from fx_engine.core.checkpoint import LoadOptions, TensorSource, TensorSpec


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
    # whether its forward runs on packed rows (core/packing.py; `models.forward(..., pack=)`):
    # its layers work row by row but for `blocks.self_attention`, which packs and unpacks
    # (recurrent layers, convolutions, its own attention: False)
    packs_rows: bool = False
    # (model_type, overrides) -> config.json of a tiny random test model (testing.tiny)
    tiny_config: Callable[[str, dict[str, Any]], dict[str, Any]] | None = None
