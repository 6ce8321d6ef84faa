"""phi3 (a family added as one module + one registry entry): parity with mlx-lm's phi3.py
(test-only oracle) on tiny random models (quantized folders: tests/test_models_parity.py),
and the engine's features on it."""

from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf, model_types
from fx_engine.testing import write_tiny_model
from fx_engine.testing.tiny import tiny_config

from .conftest import LONG_TEXT
from .test_models_parity import _compare

LONG = [1.0 + 0.25 * i for i in range(8)]  # 8 rotated frequencies (16 rotated dims)
CASES = [
    {},
    {"tie_word_embeddings": True},
    {"num_key_value_heads": 4},
    # Phi-4-mini's shape: partial rotary (0.5 of head_dim 16 -> 8 dims, 4 frequencies)
    {"partial_rotary_factor": 0.5},
    # long-context Phi-3: longrope factors and the mscale of max_pos / original_max_pos
    {"rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": [1.0] * 8},
     "max_position_embeddings": 16384, "original_max_position_embeddings": 1024},
    {"rope_scaling": {"type": "su", "long_factor": LONG[:4], "short_factor": [1.0] * 4},
     "partial_rotary_factor": 0.5, "max_position_embeddings": 8192,
     "original_max_position_embeddings": 4096},
    # mlx-lm requires long_factor even for linear scaling (and ignores it there)
    {"rope_scaling": {"type": "linear", "factor": 2.0, "long_factor": LONG}},
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda x: str(x)[:70])
def test_phi3_matches_mlx_lm(tmp_path, overrides):
    from mlx_lm.utils import load_model

    path = write_tiny_model(tmp_path / "m", "phi3", **overrides)
    model = fx_engine.load(path)
    assert type(model.params).__name__ == "Phi3Params"
    ref_model, _ = load_model(Path(path))
    ids = model.tokenizer.encode(LONG_TEXT)[:96]
    _compare(fx_engine.logits(model, ids, chunk=32), ref_model(mx.array([ids]))[0])


def test_phi3_runs_in_the_engine_with_speculation_and_windows(tmp_path):
    """Batched greedy output equals the single-row reference loop, with prompt-lookup
    speculation and self-drafting (the family's first_layers), and with a sliding window
    shorter than the context (a ring cache entry)."""
    from fx_engine.engine.drafters import self_draft_model
    from fx_engine.engine.generate import reference_generate

    path = write_tiny_model(tmp_path / "m", "phi3", sliding_window=24, partial_rotary_factor=0.5)
    model = fx_engine.load(path)
    assert all(s.window is not None for s in model.cache_layout(headroom=32))
    prompts = ["The quick brown fox", "What is the capital of France? The capital"]
    refs = [reference_generate(model, p, max_tokens=40, temperature=0.0).token_ids for p in prompts]
    with fx_engine.Engine(model, max_rows=4, prefill_chunk=8) as engine:
        plain = [engine.submit(p, max_tokens=40) for p in prompts]
        spec = [engine.submit(p, max_tokens=40, prompt_lookup=True) for p in prompts]
        draft = [engine.submit(p, max_tokens=40, draft_model=self_draft_model(model, 1)) for p in prompts]
        for group in (plain, spec, draft):
            assert [h.result().token_ids for h in group] == refs


def test_phi3_config_refusals():
    base = tiny_config("phi3")
    assert model_types()["phi3"] == "phi3"
    cases = [
        ({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_scaling type 'yarn'"),
        ({"rope_scaling": {"type": "longrope", "long_factor": [1.0] * 3, "short_factor": [1.0]}},
         "long_factor must list 8"),
        ({"rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": LONG,
                           "long_mscale": 1.2}}, "long_mscale"),
        ({"partial_rotary_factor": 0.2}, "partial_rotary_factor"),  # 3.2 -> 3 dims: odd
        ({"head_dim": 32}, "head_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            config_from_hf({**base, **overrides}, "config.json")


def test_info_lists_every_registered_model_type(capsys):
    from fx_engine.cli import main
    from fx_engine.core.models import FAMILIES

    assert main(["info"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("model types"))
    for fam in FAMILIES:
        assert all(mt in line for mt in fam.model_types) and f"{fam.name}:" in line


def test_phi3_reads_transformers_5_rope_parameters():
    """transformers >= 5 writes rope settings under rope_parameters: the same config."""
    scaling = {"type": "longrope", "long_factor": LONG[:4], "short_factor": [1.0] * 4}
    old = config_from_hf(tiny_config("phi3", rope_theta=5e5, partial_rotary_factor=0.5,
                                     rope_scaling=scaling, max_position_embeddings=8192))
    v5 = tiny_config("phi3", max_position_embeddings=8192, rope_parameters={
        "rope_type": "longrope", "rope_theta": 5e5, "partial_rotary_factor": 0.5,
        "long_factor": LONG[:4], "short_factor": [1.0] * 4})
    v5.pop("rope_theta")
    assert config_from_hf(v5) == old and old.rope_long_factor and old.rope_dims == 8
