"""Parity with an independent implementation: mlx-lm's own model classes (test-only oracle).

Tolerance: both sides compute in float32 from identical weights; the only differences are
summation order (fused q|k|v and gate|up projections, OpenBLAS blocking) and RoPE/SDPA
fallback composition. Float32 has a 2^-24 ~ 6e-8 relative epsilon; logits of these models
have magnitudes up to ~30 and pass through 2-30 layers, so accumulated rounding stays below
~1e-3 absolute. We assert max |diff| <= 2e-3 and identical argmax at every position (the
argmax check is made only where the top-2 margin exceeds the tolerance, since a near tie
may legitimately flip; the number of such positions is asserted to be small).

test_family_against_mlx_lm (at the end) runs every registered model_type against mlx-lm.
"""

from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.models import FAMILIES
from tools.oracle import mlx_lm_model

from tests.conftest import LONG_TEXT

pytestmark = pytest.mark.oracle

TOL = 2e-3


def _compare(ours: mx.array, ref: mx.array, min_positions: int = 64):
    assert ours.shape == ref.shape and ours.shape[0] >= min_positions
    diff = mx.abs(ours - ref).max().item()
    assert diff <= TOL, f"max |diff| = {diff}"
    top2 = mx.topk(ref, 2, axis=-1)
    margin = mx.abs(top2[:, 1] - top2[:, 0])
    clear = margin > 2 * TOL
    agree = ours.argmax(-1) == ref.argmax(-1)
    assert bool(mx.all(agree | ~clear)), "argmax differs at a position with a clear margin"
    assert int(mx.sum(~clear).item()) <= ours.shape[0] // 8
    return diff


def assert_greedy_matches_mlx_lm(path, model, prompt: list[int], max_tokens: int = 24, chunk: int = 16):
    """fx-engine's greedy tokens equal mlx-lm's generate_step (its own caches, the same
    prefill step size) on the same folder, up to the first EOS (generate_step does not
    stop there); at least 8 tokens, so the check means something."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(path))
    ref.set_dtype(mx.float32)
    want = [int(t) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=max_tokens,
                                             prefill_step_size=chunk, sampler=lambda x: mx.argmax(x, axis=-1))]
    for i, t in enumerate(want):
        if t in model.eos_ids:
            want = want[:i]
            break
    got = fx_engine.generate(model, prompt, max_tokens=max_tokens, temperature=0.0, prefill_chunk=chunk)
    assert list(got.token_ids) == want and len(want) >= 8


def assert_batch_equals_solo(model, prompts: list[list[int]], max_tokens: int = 16, chunk: int = 8):
    """Rows joining a running batch one step apart give each request's tokens alone through
    the plain reference loop (bitwise for a batch-invariant model)."""
    from fx_engine.engine.generate import reference_generate

    alone = [reference_generate(model, p, max_tokens=max_tokens, temperature=0.0, prefill_chunk=chunk).token_ids
             for p in prompts]
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=chunk)
    handles = []
    for p in prompts:
        handles.append(engine.submit(p, max_tokens=max_tokens, temperature=0.0))
        engine.step()
    assert [h.result().token_ids for h in handles] == alone
    engine.close()


def mlx_community(folder, out, bits: int = 4):
    """`folder` as mlx-community publishes it: mlx-lm's sanitized weights quantized by its
    own quantize_model (group 32; the model's own predicate where it has one, e.g. gpt_oss's
    8-bit router) and saved by its save_model, with the tokenizer files."""
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    model, config = load_model(Path(folder))
    kw = {"quant_predicate": model.quant_predicate} if hasattr(model, "quant_predicate") else {}
    model, config = quantize_model(model, config, group_size=32, bits=bits, **kw)
    out = Path(out)
    out.mkdir()
    save_model(out, model)
    save_config(config, out / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((Path(folder) / name).read_bytes())
    return out


CASES = [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 4}),  # MHA (GQA ratio 1)
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 128}),  # ratio 4, hd 16
    ("llama", {"head_dim": 32}),  # head_dim != hidden / heads
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    ("llama", {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    ("llama", {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True}),
    ("mistral", {"tie_word_embeddings": False, "rope_theta": 1e6}),
    ("qwen2", {}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen3", {"head_dim": 32}),
    ("qwen3", {"tie_word_embeddings": False, "num_key_value_heads": 1, "head_dim": 16}),
    # YaRN (Qwen3's long-context setting; the ramp and the mscale on q and k), with a short
    # original context so the interpolated band covers mid frequencies of head_dim 16
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 64}}),
    ("llama", {"rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                                "beta_fast": 16, "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.3}}),
    ("qwen2", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    # SmolLM3: NoPE layers (every 4th by default; an explicit list too)
    ("smollm3", {}),
    ("smollm3", {"no_rope_layers": [1, 0, 0, 1], "tie_word_embeddings": False}),
    # sliding-window layers from layer_types (mlx-lm's llama reads them; a ring cache here)
    ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}),
    # Ministral 3: YaRN from rope_parameters, Llama 4's query temperature (a short original
    # length so it grows within the sequence), sliding layers
    ("ministral3", {}),
    ("ministral3", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 24,
                    "tie_word_embeddings": False}),
    # Granite: embedding, attention, residual and logits multipliers
    ("granite", {}),
    ("granite", {"tie_word_embeddings": False, "attention_bias": True, "num_key_value_heads": 1}),
    # Llama-shaped model types with their own bias switches, names and RoPE (mlx-lm's
    # ernie4_5.py, helium.py, seed_oss.py, internlm3.py, exaone.py)
    ("ernie4_5", {"use_bias": True, "tie_word_embeddings": False}),
    ("helium", {"attention_bias": True, "mlp_bias": True}),  # (no bias on o_proj)
    ("seed_oss", {"attention_out_bias": True, "mlp_bias": True, "tie_word_embeddings": True}),
    ("internlm3", {"qkv_bias": True, "bias": True}),
    ("exaone", {"tie_word_embeddings": False, "attention_bias": True,
                "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}}),
    # Hunyuan dense (mlx-lm's hunyuan_v1_dense.py): q/k norms after RoPE, biases on every
    # attention projection, plain RoPE (its default case: NTK alpha 1000)
    ("hunyuan_v1_dense", {"attention_bias": True, "rope_scaling": None, "tie_word_embeddings": False}),
    # longrope through the Llama family (mlx-lm's SuScaledRoPE): 8 long factors for hd 16
    ("llama", {"rope_scaling": {"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                "short_factor": [1.0] * 8, "original_max_position_embeddings": 256},
               "max_position_embeddings": 4096}),
]


@pytest.mark.parametrize("model_type,overrides", CASES, ids=lambda x: str(x)[:60])
def test_tiny_architectures_match_mlx_lm(model_type, overrides, tiny_folder):
    from mlx_lm.utils import load_model

    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    ref_model, _ = load_model(Path(path))
    ids = model.tokenizer.encode(LONG_TEXT)[:96]
    _compare(fx_engine.logits(model, ids, chunk=32), ref_model(mx.array([ids]))[0])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_folders_load_and_match(dtype, tiny_folder):
    """Stored in f16/bf16; on CPU fx-engine computes in float32, so compare with mlx-lm's
    model converted to float32 (same stored values)."""
    from mlx_lm.utils import load_model

    path = tiny_folder("qwen2", dtype=dtype)
    model = fx_engine.load(path)
    ref_model, _ = load_model(Path(path))
    ref_model.set_dtype(mx.float32)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids), ref_model(mx.array([ids]))[0])


@pytest.mark.parametrize("keep_quantized", [True, False])
@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("phi3", {"partial_rotary_factor": 0.5})])
def test_mlx_quantized_folder(keep_quantized, bits, group, model_type, extra, tiny_folder):
    from mlx_lm.utils import load_model

    path = tiny_folder(model_type, hidden_size=128, intermediate_size=256,
                       quantize={"group_size": group, "bits": bits}, **extra)
    model = fx_engine.load(path, keep_quantized=keep_quantized)
    assert model.params.layers[0].qkv.quantized == keep_quantized
    ref_model, _ = load_model(Path(path))
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids), ref_model(mx.array([ids]))[0])


def test_sharded_folder(tiny_folder):
    from mlx_lm.utils import load_model

    path = tiny_folder("llama", shards=3)
    model = fx_engine.load(path)
    ref_model, _ = load_model(Path(path))
    ids = model.tokenizer.encode(LONG_TEXT)[:72]
    _compare(fx_engine.logits(model, ids), ref_model(mx.array([ids]))[0])


def test_default_gguf_matches_mlx_lm(default_model):
    """The real SmolLM2 GGUF: same dequantized tensors in mlx-lm's llama class."""
    ref = mlx_lm_model(default_model)
    ids = default_model.tokenizer.encode(LONG_TEXT)[:128]
    assert len(ids) >= 64
    _compare(fx_engine.logits(default_model, ids, chunk=64), ref(mx.array([ids]))[0])


def test_gguf_unpermute_inverts_llama_cpp_permutation():
    """Independent check of the q/k row layout: mlx-lm's GGUF exporter permutes HF rows the
    way llama.cpp's converter does; our loader must invert it exactly."""
    from mlx_lm.gguf import permute_weights

    from fx_engine.core.models.llama import unpermute_rows as _unpermute_rows

    for heads, kv in ((9, 3), (4, 4), (8, 2)):
        hd = 16
        w = mx.random.normal((heads * hd, 32))
        assert mx.array_equal(_unpermute_rows(permute_weights(w, heads, heads), heads), w)
        wk = mx.random.normal((kv * hd, 32))
        assert mx.array_equal(_unpermute_rows(permute_weights(wk, heads, kv), kv), wk)


def test_gguf_quantized_kept_quantized_matches_dequantized(default_model):
    """GGUF Q4_1/Q8_0 tensors kept quantized (the GPU path) give the same logits as the
    dequantized float32 path within quantized-matmul rounding."""
    q = fx_engine.load(default_model.path, keep_quantized=True)
    assert q.params.layers[0].qkv.quant.bits == 4 and q.params.embed.quant.bits == 8
    ids = default_model.tokenizer.encode(LONG_TEXT)[:64]
    a = fx_engine.logits(q, ids)
    b = fx_engine.logits(default_model, ids)
    assert mx.abs(a - b).max().item() < 2e-2
    assert mx.mean((a.argmax(-1) == b.argmax(-1)).astype(mx.float32)).item() >= 0.95


# ------------------------------------------------------------------ every registered family
# One parity test over the whole registry (fx_engine.core.models.FAMILIES), on each
# model_type's tiny example folder (conftest's `family_folders`, shared with
# tests/models/test_every_family.py). Each family's own variants (configs, quantized
# layouts, GGUF files) are in tests/models/test_family_configs.py, test_gemma.py,
# test_phi3.py, test_moe.py, test_recurrent.py and test_gguf_conversion.py.
MODEL_TYPES = [mt for fam in FAMILIES for mt in fam.model_types]


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_family_against_mlx_lm(family_folders, model_type, tmp_path):
    """Each family's tiny example against mlx-lm's own class for it: greedy tokens equal
    mlx-lm's generate_step; in the batch-invariant mode rows joining a batch equal each
    request alone (bitwise); and mlx-lm's own 4-bit conversion of the folder loads and gives
    mlx-lm's logits (the float model's tolerance: both sides run the same packed weights)."""
    import importlib.util

    from mlx_lm.utils import MODEL_REMAPPING

    path = family_folders[model_type]
    model = fx_engine.load(path)
    ids = model.tokenizer.encode(LONG_TEXT)
    assert_batch_equals_solo(fx_engine.load(path, batch_invariant=True), [ids[:n] for n in (5, 40, 23)])
    if importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(model_type, model_type)}") is None:
        return  # an alias mlx-lm does not know (smollm2: real checkpoints say llama)
    assert_greedy_matches_mlx_lm(path, model, ids[:45])
    q = mlx_community(path, tmp_path / "q")
    from mlx_lm.utils import load_model

    ref, _ = load_model(q)
    quantized = fx_engine.load(q)
    _compare(fx_engine.logits(quantized, ids[:72], chunk=24), ref(mx.array([ids[:72]]))[0])
