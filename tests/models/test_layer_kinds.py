"""Which layers attend through a sliding window, and which rotate (RoPE), as Hugging Face's
configuration and model classes decide them (transformers >= 5 as the oracle, torch-free):
the configuration class derives its `layer_types` (or not) from use_sliding_window,
max_window_layers, sliding_window_pattern or no_rope_layers, and each model class reads a
window per layer its own way (the rules below, each from transformers 5.25's modeling file).
fx-engine's cache layout (one window per layer) must say the same for every variant."""

from __future__ import annotations

import copy
import json

import pytest

from fx_engine.core.models import config_from_hf
from fx_engine.core.models.registry import family_of
from fx_engine.testing.tiny import tiny_config

transformers = pytest.importorskip("transformers", minversion="5")
pytestmark = pytest.mark.oracle

CLASSES = transformers.CONFIG_MAPPING

#: model classes that give every layer config.sliding_window (MistralAttention's
#: `sliding_window=getattr(self.config, "sliding_window", None)`; Qwen3MoeConfig has no kinds)
EVERY_LAYER = {"mistral", "mixtral", "qwen3_moe", "phi3", "starcoder2"}
#: model classes that read no window at all (their modeling files never pass one)
NO_WINDOW = {"cohere", "deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"}
#: the rest: config.sliding_window on the layers config.layer_types calls sliding
PER_LAYER = {"qwen2", "qwen3", "qwen2_moe", "smollm3", "exaone4", "gemma2", "gemma3_text", "gpt_oss",
             "cohere2", "olmo3", "ministral"}


def hf_windows(c) -> list[int | None]:
    """Each layer's window as the model class of config `c` runs it (None: full attention).
    A window at least max_position_embeddings long reads as none (fx-engine keeps such
    layers dense: the same attention within the model's context)."""
    mt, n, w = c.model_type, c.num_hidden_layers, getattr(c, "sliding_window", None) or None
    if mt in NO_WINDOW:
        out = [None] * n
    elif mt in EVERY_LAYER:
        out = [w] * n
    elif mt == "smollm3" and not c.use_sliding_window:  # (SmolLM3Attention)
        out = [None] * n
    else:
        out = [w if t == "sliding_attention" else None for t in c.layer_types]
    limit = getattr(c, "max_position_embeddings", None)
    return [None if x is not None and limit and x >= limit else x for x in out]


def _variants(mt: str, n: int) -> list[dict]:
    alternate = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    out = [{}, {"use_sliding_window": True, "sliding_window": 8}, {"sliding_window": 8},
           {"use_sliding_window": False, "sliding_window": 8, "layer_types": alternate},
           {"use_sliding_window": True, "sliding_window": 8, "layer_types": alternate}]
    out += [{"use_sliding_window": True, "sliding_window": 8, "max_window_layers": k} for k in range(n + 1)]
    if mt not in ("gemma2", "gemma3_text", "gpt_oss", "cohere2", "olmo3", "exaone4"):
        # (those read an explicit null window as their default one, as mlx-lm does;
        # Exaone4Config cannot derive layer kinds without a window: its cases below list them)
        out.append({"sliding_window": None})
    if mt == "smollm3":
        nope = [1 if i % 2 else 0 for i in range(n)]
        out += [{"use_sliding_window": True, "sliding_window": 8, "no_rope_layers": nope},
                {"use_sliding_window": True, "sliding_window": 8, "no_rope_layer_interval": 2}]
    if mt == "exaone4":
        out += [{"sliding_window": 8, "sliding_window_pattern": 2},
                {"sliding_window": 8, "sliding_window_pattern": 3, "layer_types": None},
                {"sliding_window": 8, "layer_types": ["full_attention"] * n},
                {"sliding_window": None, "layer_types": ["full_attention"] * n},
                {"drop": ("sliding_window_pattern",), "sliding_window": 8},
                {"drop": ("sliding_window_pattern", "sliding_window")}]
    return out


def _cases():
    for mt in sorted(EVERY_LAYER | NO_WINDOW | PER_LAYER):
        base = tiny_config(mt)
        for i, v in enumerate(_variants(mt, base["num_hidden_layers"])):
            yield pytest.param(mt, v, id=f"{mt}-{i}")


def _config(mt: str, variant: dict) -> dict:
    # (Exaone4Config derives layer kinds from a numeric pattern only: the tiny config's "LLLG"
    # as the same every-4th-layer number)
    base = {**tiny_config(mt), **({"sliding_window_pattern": 4} if mt == "exaone4" else {})}
    d = {**base, **{k: v for k, v in copy.deepcopy(variant).items() if k != "drop"}}
    for k in variant.get("drop", ()):
        d.pop(k, None)
    return {k: v for k, v in d.items() if v is not None or k == "sliding_window"}


@pytest.mark.parametrize("mt,variant", list(_cases()))
def test_windows_are_hugging_faces(mt, variant, tmp_path):
    """AutoConfig reads the config.json (its heuristics too: a mistral config listing
    layer_types is Ministral's), the model class's rule gives each layer's window."""
    d = _config(mt, variant)
    (tmp_path / "config.json").write_text(json.dumps(d))
    # (every variant is one the configuration class can build: a refusal here is a test error)
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    want = hf_windows(hf)
    cfg = config_from_hf(d)
    limit = hf.max_position_embeddings
    got = [None if s.window is not None and s.window >= limit else s.window
           for s in family_of(cfg).cache_specs(cfg)]
    assert got == want, (variant, got, want)
    if mt == "smollm3":  # SmolLM3Attention: RoPE where no_rope_layers[i] is 1
        assert [i not in cfg.no_rope_layers for i in range(hf.num_hidden_layers)] == [
            bool(f) for f in hf.no_rope_layers]
    if mt == "exaone4":  # Exaone4Attention: RoPE when there is no window, or on sliding layers
        want_rope = [hf.sliding_window is None or t == "sliding_attention" for t in hf.layer_types]
        assert [r != "none" for r in cfg.layer_rope] == want_rope, (variant, cfg.layer_rope)


def test_classes_named_here_exist():
    """The rule tables name model types both sides know (a rename would skip silently)."""
    for mt in EVERY_LAYER | NO_WINDOW | PER_LAYER:
        assert mt in CLASSES, mt
        tiny_config(mt)
