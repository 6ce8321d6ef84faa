"""Pure model forward functions, one module per architecture family.

Each family module provides `forward(params, cache, tokens, n_valid, span)`,
`hidden_to_logits(params, h)` and `cache_specs(config)`; the functions here dispatch on the
params (or config) type, at trace time.
"""

from __future__ import annotations

from typing import Any

from fx_engine.core.cache import LayerSpec, finish_layout
from fx_engine.core.config import GemmaConfig
from fx_engine.core.models import gemma, llama
from fx_engine.core.models.gemma import GemmaLayer, GemmaParams
from fx_engine.core.models.llama import LayerParams, Params

AnyParams = Params | GemmaParams  # the params pytree of any supported family

__all__ = [
    "AnyParams", "GemmaLayer", "GemmaParams", "LayerParams", "Params", "cache_layout", "forward",
    "hidden_to_logits",
]


def _family(x: Any) -> Any:
    if isinstance(x, (GemmaParams, GemmaConfig)):
        return gemma
    return llama


def forward(params: Any, cache: Any, tokens: Any, n_valid: Any, span: int | None = None) -> Any:
    return _family(params).forward(params, cache, tokens, n_valid, span)


def hidden_to_logits(params: Any, h: Any) -> Any:
    return _family(params).hidden_to_logits(params, h)


def cache_layout(
    config: Any, *, headroom: int = 512, kv_bits: int | None = None, kv_group_size: int = 64,
    quantized_kv_start: int = 0,
) -> tuple[LayerSpec, ...]:
    """The cache layout a model needs: one `LayerSpec` per cache entry.

    headroom: extra ring slots of sliding-window entries; must be >= the longest step (prefill
    chunk, verify length) minus one. kv_bits (4 or 8) / kv_group_size / quantized_kv_start:
    quantize full-attention entries as mlx-lm's QuantizedKVCache does, positions below
    quantized_kv_start kept in float.
    """
    return finish_layout(
        _family(config).cache_specs(config), headroom=headroom, kv_bits=kv_bits or 0,
        kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
    )
