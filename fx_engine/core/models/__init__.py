"""Model families and their registry.

One module per family (llama.py, gemma.py, phi3.py, moe.py, postnorm.py, gpt_oss.py,
deepseek.py, starcoder2.py, cohere.py, neox.py, and the recurrent / hybrid lfm2.py, mamba2.py,
nemotron_h.py, qwen3_next.py, granitemoehybrid.py, falcon_h1.py) holds everything about it as pure
functions over frozen pytrees: its config and how it is read from config.json / GGUF
metadata, how checkpoint tensors become its params, its cache layout, its forward and
output head, collected in its `FAMILY` record (family.py). The families are built from
shared modules they import: blocks.py (attention, RoPE, MLPs, routed experts, the
checkpoint reader), ssm.py (the Mamba-2 mixer) and skeleton.py (the decoder step around a
family's layers: geometry, pipeline stages, final norm, head). The registry (registry.py,
re-exported here) maps every `model_type` and GGUF `general.architecture` to a family; the
functions there dispatch on a config's (or params') type at trace time. A new architecture
is one new module plus one entry in registry.FAMILIES.
"""

from __future__ import annotations

from fx_engine.core.models.gemma import GemmaConfig, GemmaLayer, GemmaParams
from fx_engine.core.models.llama import LayerParams, LlamaConfig, Params
from fx_engine.core.models.registry import (FAMILIES, FAMILY_MODULES, MODEL_TYPE_MODULES, AnyParams, Capture,
                                            CaptureError, Family, cache_layout, config_from_gguf, config_from_hf,
                                            family_of, forward, gguf_family, hf_family, hidden_to_logits,
                                            model_type_modules, model_types, module_file, packs_rows,
                                            text_config_of)

__all__ = [
    "AnyParams", "Capture", "CaptureError", "FAMILIES", "FAMILY_MODULES", "Family", "GemmaConfig", "GemmaLayer",
    "GemmaParams", "LayerParams", "LlamaConfig", "MODEL_TYPE_MODULES", "Params", "cache_layout", "config_from_gguf",
    "config_from_hf", "family_of", "forward", "packs_rows", "gguf_family", "hf_family", "hidden_to_logits", "model_type_modules",
    "model_types", "module_file", "text_config_of",
]
