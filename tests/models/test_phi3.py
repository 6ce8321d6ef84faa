"""phi3 (a family added as one module + one registry entry): parity with mlx-lm's phi3.py
(test-only oracle) on tiny random models (quantized folders: tests/models/test_parity.py),
and the engine's features on it."""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf, model_types
from fx_engine.testing import write_tiny_model
from fx_engine.testing.tiny import tiny_config

from tests.conftest import LONG_TEXT
from tests.gguf_tokenizer import add_tokenizer
from tests.models.test_parity import _compare

pytestmark = pytest.mark.oracle

LONG = [1.0 + 0.25 * i for i in range(8)]  # 8 rotated frequencies (16 rotated dims)
CASES = [
    {},
    {"tie_word_embeddings": True},
    {"num_key_value_heads": 4},
    # Phi-4-mini's shape: partial rotary (0.5 of head_dim 16 -> 8 dims, 4 frequencies)
    {"partial_rotary_factor": 0.5},
    # long-context Phi-3: longrope factors and the mscale of max_pos / original_max_pos (the
    # short factors the long ones: mlx-lm rotates by the long ones at every position; the
    # short ones below the original length are checked in test_phi3_short_factors_*)
    {"rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": LONG},
     "max_position_embeddings": 16384, "original_max_position_embeddings": 1024},
    {"rope_scaling": {"type": "su", "long_factor": LONG[:4], "short_factor": LONG[:4]},
     "partial_rotary_factor": 0.5, "max_position_embeddings": 8192,
     "original_max_position_embeddings": 4096},
    # mlx-lm requires long_factor even for linear scaling (and ignores it there)
    {"rope_scaling": {"type": "linear", "factor": 2.0, "long_factor": LONG}},
]


@pytest.mark.parametrize("overrides", CASES, ids=lambda x: str(x)[:70])
def test_phi3_matches_mlx_lm(overrides, tiny_folder):
    from mlx_lm.utils import load_model

    path = tiny_folder("phi3", **overrides)
    model = fx_engine.load(path)
    assert type(model.params).__name__ == "Phi3Params"
    ref_model, _ = load_model(Path(path))
    ids = model.tokenizer.encode(LONG_TEXT)[:96]
    _compare(fx_engine.logits(model, ids, chunk=32), ref_model(mx.array([ids]))[0])


def test_phi3_runs_in_the_engine_with_speculation_and_windows(tiny_folder):
    """Batched greedy output equals the single-row reference loop, with prompt-lookup
    speculation and self-drafting (the family's layer_range), and with a sliding window
    shorter than the context (a ring cache entry)."""
    from fx_engine.engine.drafters import self_draft_model
    from fx_engine.engine.generate import reference_generate

    path = tiny_folder("phi3", sliding_window=24, partial_rotary_factor=0.5)
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


def _phi3_gguf(folder: Path, out: Path, q8: tuple[str, ...] = ()) -> dict:
    """Convert a tiny phi3 HF folder to GGUF as llama.cpp's converter does (its tensor names
    and metadata keys; fused projections and half-split RoPE kept; long RoPE factors as
    tensors and their scale as metadata), with the tensors named in `q8` stored as Q8_0 (the
    gguf package's reference quantizer). Returns the float weights the file holds, under HF
    names (Q8_0 ones dequantized by the reference), for the mlx-lm oracle."""
    import json
    import math

    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = json.loads((folder / "config.json").read_text())
    weights = {k: np.asarray(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(out), "phi3")
    w.add_uint32("phi3.context_length", cfg["max_position_embeddings"])
    w.add_uint32("phi3.rope.scaling.original_context_length", cfg["original_max_position_embeddings"])
    w.add_uint32("phi3.embedding_length", h)
    w.add_uint32("phi3.feed_forward_length", cfg["intermediate_size"])
    w.add_uint32("phi3.block_count", cfg["num_hidden_layers"])
    w.add_uint32("phi3.attention.head_count", heads)
    w.add_uint32("phi3.attention.head_count_kv", cfg["num_key_value_heads"])
    w.add_float32("phi3.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"])
    rot = int(cfg.get("partial_rotary_factor", 1.0) * h) // heads
    w.add_uint32("phi3.rope.dimension_count", rot)
    w.add_float32("phi3.rope.freq_base", cfg["rope_theta"])
    w.add_uint32("phi3.attention.sliding_window", cfg.get("sliding_window") or 0)
    add_tokenizer(w, folder, cfg["eos_token_id"])
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("type") in ("longrope", "su"):
        scale = cfg["max_position_embeddings"] / cfg["original_max_position_embeddings"]
        w.add_float32("phi3.rope.scaling.attn_factor", math.sqrt(
            1 + math.log(scale) / math.log(cfg["original_max_position_embeddings"])) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], np.float32))
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    held = {}
    for name, x in weights.items():
        g = names.get(name)
        if g is None:
            i, rest = name.split(".")[2], ".".join(name.split(".")[3:]).removesuffix(".weight")
            g = f"blk.{i}.{parts[rest]}.weight"
        if any(g.endswith(s) for s in q8):
            raw = quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(g, raw, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            x = dequantize(raw, gguf.GGMLQuantizationType.Q8_0).reshape(x.shape)
        else:
            w.add_tensor(g, x)
        held[name] = x
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return held


@pytest.mark.parametrize("overrides", [
    {"partial_rotary_factor": 0.5},
    {"rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": LONG},
     "max_position_embeddings": 16384, "original_max_position_embeddings": 1024},
], ids=["partial", "longrope"])
def test_phi3_from_gguf_matches_mlx_lm(tmp_path, overrides):
    """phi3 read from GGUF metadata and llama.cpp's tensor names (a Q8_0 mix) gives mlx-lm's
    logits on the same weights in a Hugging Face folder."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    folder = write_tiny_model(tmp_path / "m", "phi3", **overrides)
    held = _phi3_gguf(folder, tmp_path / "m.gguf", q8=("attn_qkv.weight", "ffn_down.weight"))
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(v) for k, v in held.items()})
    model = fx_engine.load(tmp_path / "m.gguf")
    assert type(model.params).__name__ == "Phi3Params" and model.params.layers[0].qkv.quantized
    ref_model, _ = load_model(folder)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    assert ids == fx_engine.load(folder).tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids, chunk=32), ref_model(mx.array([ids]))[0])


def _hf_longrope_tables(positions, factors_at, rot, base, mscale):
    """Hugging Face's longrope rotation (modeling_rope_utils._compute_longrope_parameters,
    float64): inv_freq = 1 / (factors * base^(2i/d)), cos/sin of position * inv_freq over
    the two halves, times attention_factor."""
    out = []
    for p in positions:
        f = np.asarray(factors_at(p), np.float64)
        inv = 1.0 / (f * base ** (np.arange(0, rot, 2) / rot))
        ang = np.concatenate([p * inv, p * inv])
        out.append((np.cos(ang) * mscale, np.sin(ang) * mscale))
    return out


@pytest.mark.parametrize("source", ["folder", "gguf"])
def test_phi3_short_factors_below_the_original_length(tmp_path, source):
    """Positions below original_max_position_embeddings rotate by short_factor, the others
    by long_factor (Hugging Face's longrope while the sequence fits, llama.cpp's at a context
    up to the original length; mlx-lm: long everywhere), from a folder and from a GGUF."""
    import math

    from fx_engine.core.models.phi3 import _rope

    short = [0.5 + 0.125 * i for i in range(8)]
    overrides = {"rope_scaling": {"type": "longrope", "long_factor": LONG, "short_factor": short},
                 "max_position_embeddings": 4096, "original_max_position_embeddings": 32}
    folder = write_tiny_model(tmp_path / "m", "phi3", **overrides)
    path = folder
    if source == "gguf":
        _phi3_gguf(folder, tmp_path / "m.gguf", q8=())
        path = tmp_path / "m.gguf"
    model = fx_engine.load(path)
    positions = [0, 5, 31, 32, 33, 200]
    cos, sin, _ = _rope(model.params, mx.array([positions]))
    mscale = math.sqrt(1 + math.log(4096 / 32) / math.log(32))
    want = _hf_longrope_tables(positions, lambda p: short if p < 32 else LONG, 16, 10000.0, mscale)
    for j, (c, s) in enumerate(want):
        np.testing.assert_allclose(np.asarray(cos[0, j, 0], np.float64), c, rtol=0, atol=3e-5)
        np.testing.assert_allclose(np.abs(np.asarray(sin[0, j, 0], np.float64)), np.abs(s), rtol=0, atol=3e-5)


def test_phi3_short_factors_llama_cpp_logits(tmp_path):
    """llama.cpp at a context of the original length (256) rotates by the short factors, as
    fx-engine does below it: the same logits from the same file."""
    from tests.gguf_tokenizer import assert_llama_cpp_logits

    short = [0.5 + 0.125 * i for i in range(8)]
    folder = write_tiny_model(tmp_path / "m", "phi3", rope_scaling={
        "type": "longrope", "long_factor": LONG, "short_factor": short},
        max_position_embeddings=4096, original_max_position_embeddings=256)
    _phi3_gguf(folder, tmp_path / "m.gguf", q8=())
    assert_llama_cpp_logits(tmp_path / "m.gguf", tmp_path)
