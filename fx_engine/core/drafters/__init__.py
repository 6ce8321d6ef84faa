"""Learned drafters: small heads that propose tokens for speculative decoding from the
target's own hidden states (issue 45).

    eagle3.py   EAGLE-3 heads in their published format (SafeAILab/EAGLE, SpecForge, vLLM and
                SGLang checkpoints): config, params from checkpoint tensors, the pure forward
                over an fx-engine KV cache, greedy chained drafting, draft -> target vocab maps
    mtp.py      multi-token-prediction modules shipped in target checkpoints (DeepSeek-V3,
                GLM-4.5, Qwen3-Next / Qwen3.5, MiMo; glm4moe GGUF NextN layers): config,
                params from checkpoint tensors, the pure forward over an fx-engine KV cache
                (the target family's own decoder layer), greedy chained drafting
    sampled.py  sampled drafting for both: a sampled row's draft drawn from its head's
                distribution processed with the row's sampling settings, q for verification

Pure core, like every module under fx_engine/core (tests/core/test_boundary.py).
"""
