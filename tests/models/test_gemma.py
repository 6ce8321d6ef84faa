"""Gemma 2, Gemma 3 and Gemma 4 text models: parity with mlx-lm's gemma2 / gemma3_text /
gemma4_text.

Tolerance (same reasoning as test_parity): both sides compute in float32 from
identical weights. The differences are summation order (fused projections, BLAS blocking),
our exp polynomial (`fast_exp`, ~1e-7 relative near 0) inside softmax and the tanh-GELU
(computed as x * sigmoid(2u), equal in exact arithmetic), and RoPE composition; through
4-6 layers and logits up to ~35 (soft-capped at 30 for Gemma 4) this stays far below 2e-3.
Sequences are 70-96 tokens with a sliding window of 16-24: more than 3x the window, so every
sliding layer's ring wraps several times.
"""

from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.testing import write_tiny_model
from fx_engine.engine.generate import reference_generate

from tests.conftest import LONG_TEXT
from tests.models.test_parity import _compare

pytestmark = pytest.mark.oracle

G4_VARIANTS = [
    {},
    {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    {"hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0, "tie_word_embeddings": False},
    {"use_double_wide_mlp": False, "final_logit_softcapping": None, "global_head_dim": 0,
     "num_kv_shared_layers": 3, "sliding_window_pattern": 2},
    {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
]
MOE = G4_VARIANTS[-1]
CASES = [
    ("gemma3_text", {}),
    ("gemma3_text", {"rope_scaling": {"rope_type": "linear", "factor": 8.0},
                     "tie_word_embeddings": False, "num_key_value_heads": 1}),
    ("gemma3_text", {"sliding_window_pattern": 2, "query_pre_attn_scalar": 32, "head_dim": 32}),
    # Gemma 2: attention and final logit soft-capping (mlx-lm has no window: the tiny
    # default window of 4096 is longer than the sequence); caps low enough to bite
    ("gemma2", {}),
    ("gemma2", {"attn_logit_softcapping": 2.0, "final_logit_softcapping": 8.0,
                "num_key_value_heads": 1, "query_pre_attn_scalar": 32}),
] + [("gemma4_text", v) for v in G4_VARIANTS]


def _ids(n: int, seed: int = 1) -> list[int]:
    return [int(x) for x in mx.random.randint(3, 380, (n,), key=mx.random.key(seed)).tolist()]


def _until_eos(tokens: list[int], model) -> list[int]:
    """mlx-lm's generate_step does not stop at EOS; fx-engine does."""
    for i, t in enumerate(tokens):
        if t in model.eos_ids:
            return tokens[:i]
    return tokens


def _mlx_lm(path: Path):
    from mlx_lm.utils import load_model

    ref, _ = load_model(Path(path))
    ref.set_dtype(mx.float32)
    return ref


@pytest.mark.parametrize("model_type,overrides", CASES, ids=lambda x: str(x)[:70])
def test_teacher_forced_logits_match_mlx_lm(model_type, overrides, tiny_folder):
    path = tiny_folder(model_type, **overrides)
    model = fx_engine.load(path)
    ref = _mlx_lm(path)
    ids = _ids(80)
    want = ref(mx.array([ids]))[0]  # one call: mlx-lm's windowed causal mask, no cache
    for chunk in (16, 64):  # chunks that cross the window boundary and ones larger than it
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text", "gemma4_text"])
def test_mlx_quantized_folders_match_mlx_lm(tmp_path, model_type):
    path = write_tiny_model(tmp_path / "m", model_type, quantize={"group_size": 32, "bits": 4})
    model = fx_engine.load(path)
    ids = _ids(72, seed=2)
    _compare(fx_engine.logits(model, ids, chunk=32), _mlx_lm(path)(mx.array([ids]))[0])


def _to_mlx_moe_layout(path: Path, quantize: bool) -> None:
    """Rewrite a tiny MoE checkpoint in mlx-lm's sanitized layout (experts.switch_glu.*),
    optionally with 4-bit group-32 expert stacks, as an mlx-community conversion stores it."""
    import json

    w = mx.load(str(path / "model.safetensors"))
    for name in [n for n in w if n.endswith(".experts.gate_up_proj")]:
        base = name[: -len(".gate_up_proj")] + ".switch_glu."
        gate, up = mx.split(w.pop(name), 2, axis=-2)
        down = w.pop(name.replace("gate_up_proj", "down_proj"))
        for n, t in (("gate_proj", gate), ("up_proj", up), ("down_proj", down)):
            if quantize:
                q, sc, bi = mx.quantize(mx.contiguous(t), group_size=32, bits=4)
                w[base + n + ".weight"], w[base + n + ".scales"], w[base + n + ".biases"] = q, sc, bi
            else:
                w[base + n + ".weight"] = mx.contiguous(t)
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "mlx"})
    if quantize:
        cfg = json.loads((path / "config.json").read_text())
        cfg["quantization"] = {"group_size": 32, "bits": 4}
        (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("quantize", [False, True])
def test_moe_in_mlx_layout_and_quantized_experts_match_mlx_lm(tmp_path, quantize):
    path = write_tiny_model(tmp_path / "m", "gemma4_text", **MOE)
    _to_mlx_moe_layout(path, quantize)
    ref = _mlx_lm(path)
    ids = _ids(72, seed=4)
    want = ref(mx.array([ids]))[0]
    _compare(fx_engine.logits(fx_engine.load(path), ids, chunk=32), want)
    if quantize:  # experts kept packed: mx.gather_qmm instead of dequantized gather_mm
        kept = fx_engine.load(path, keep_quantized=True)
        assert kept.params.layers[0].moe.down.quantized
        _compare(fx_engine.logits(kept, ids, chunk=32), want)


@pytest.mark.parametrize("model_type,window,chunk", [
    ("gemma3_text", 16, 8),    # chunk divides the window
    ("gemma3_text", 24, 16),   # does not
    ("gemma4_text", 16, 32),   # chunk larger than the window
    ("gemma4_text", 24, 16),
    ("gemma2", 4096, 16),      # mlx-lm's gemma2 has no window: one longer than the run
])
def test_chunked_generation_matches_mlx_lm_generate_step(model_type, window, chunk, tiny_folder):
    """Greedy generation: our chunked prefill + ring caches vs mlx-lm's generate_step with
    its RotatingKVCache and the same prefill step size."""
    from mlx_lm.generate import generate_step

    path = tiny_folder(model_type, sliding_window=window)
    model = fx_engine.load(path)
    ref = _mlx_lm(path)
    prompt = _ids(min(3 * window + 5, 77), seed=3)
    want = []
    for tok, _ in generate_step(mx.array(prompt), ref, max_tokens=24, prefill_step_size=chunk,
                                sampler=lambda x: mx.argmax(x, axis=-1)):
        want.append(int(tok))
    want = _until_eos(want, model)
    kw = dict(max_tokens=24, temperature=0.0, prefill_chunk=chunk)
    got = fx_engine.generate(model, prompt, **kw)
    assert list(got.token_ids) == want and len(want) >= 8
    assert list(reference_generate(model, prompt, **kw).token_ids) == want


@pytest.mark.parametrize("variant", [{}, MOE], ids=["dense", "moe"])
def test_batched_engine_matches_single_requests(variant, tiny_folder):
    """Rows at different positions share ring caches in one batch (prompts shorter and
    longer than the window, joining at different steps)."""
    path = tiny_folder("gemma4_text", sliding_window=16, **variant)
    model = fx_engine.load(path, batch_invariant=True)
    prompts = [_ids(n, seed=n) for n in (5, 40, 17, 70)]
    alone = [reference_generate(model, p, max_tokens=20, temperature=0.0, prefill_chunk=16)
             for p in prompts]
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16)
    handles = []
    for p in prompts:
        handles.append(engine.submit(p, max_tokens=20, temperature=0.0))
        engine.step()
    for h, a in zip(handles, alone):
        assert h.result().token_ids == a.token_ids


def test_engine_with_rings_and_quantized_global_layers(tiny_folder):
    """Gemma 4 with 8-bit global layers (head_dim 32) and float rings in one cache: the
    engine's batched rows give the tokens of each request alone through the plain loop."""
    path = tiny_folder("gemma4_text", sliding_window=16)
    model = fx_engine.load(path)
    q = model.with_kv_cache(8, 32, 0)
    kinds = {s.kind for s in q.cache_layout()}
    assert kinds == {"ring", "quantized"}
    prompts = [_ids(n, seed=n) for n in (9, 50, 33)]
    alone = [reference_generate(q, p, max_tokens=16, temperature=0.0, prefill_chunk=16)
             for p in prompts]
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16, kv_bits=8, kv_group_size=32,
                              quantized_kv_start=0)
    hs = [engine.submit(p, max_tokens=16, temperature=0.0) for p in prompts]
    for h, a in zip(hs, alone):
        assert h.result().token_ids == a.token_ids
    st = engine.stats()
    assert st["kv_bytes_per_token"] < st["kv_bytes_per_token_float"]


@pytest.mark.parametrize("field,value", [
    ("enable_moe_block", True),  # without num_experts: the message names that field
    ("attn_logit_softcapping", 50.0),
    ("hidden_activation", "silu"),
    ("rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 4.0},
                         "sliding_attention": {"rope_type": "default"}}),
    ("layer_types", ["sliding_attention"] * 5 + ["bogus"]),
    ("num_kv_shared_layers", 6),
])
def test_unsupported_gemma4_fields_are_clear_errors(tmp_path, field, value):
    path = write_tiny_model(tmp_path / "m", "gemma4_text")
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        fx_engine.load(path)
    named = {"enable_moe_block": "num_experts", "rope_parameters": "rope"}.get(field, field)
    assert "config.json" in str(e.value) and named in str(e.value)


# (a layer_types list that differs from the pattern is run as listed, as Hugging Face's
# Gemma3TextModel runs it: tests/models/test_layer_kinds.py)
@pytest.mark.parametrize("field,value", [
    ("final_logit_softcapping", 30.0),
])
def test_unsupported_gemma3_fields_are_clear_errors(tmp_path, field, value):
    path = write_tiny_model(tmp_path / "m", "gemma3_text")
    import json

    cfg = json.loads((path / "config.json").read_text())
    cfg[field] = value
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        fx_engine.load(path)


@pytest.mark.parametrize("wrapper,prefix", [
    ("gemma3", "language_model.model."),
    ("gemma4", "model.language_model."),
])
def test_multimodal_checkpoints_run_their_text_model(tmp_path, wrapper, prefix):
    """A gemma3 / gemma4 (multimodal) folder: config under text_config, text weights under a
    language-model prefix, a vision tower to ignore. Same logits as mlx-lm's wrapper."""
    import json

    path = write_tiny_model(tmp_path / "m", wrapper + "_text")
    cfg = json.loads((path / "config.json").read_text())
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "vocab_size", "eos_token_id")}
    (path / "config.json").write_text(json.dumps({
        "model_type": wrapper, "architectures": ["X"], "vocab_size": cfg["vocab_size"],
        "eos_token_id": cfg["eos_token_id"], "text_config": text, "vision_config": {"hidden_size": 8},
    }))
    w = mx.load(str(path / "model.safetensors"))
    w = {prefix + k[len("model."):] if k.startswith("model.") else k: v for k, v in w.items()}
    w["vision_tower.encoder.weight"] = mx.zeros((8, 8))
    mx.save_safetensors(str(path / "model.safetensors"), w, metadata={"format": "mlx"})
    model = fx_engine.load(path)
    assert model.config.model_type == wrapper + "_text"
    ids = _ids(70, seed=5)
    _compare(fx_engine.logits(model, ids, chunk=32), _mlx_lm(path)(mx.array([ids]))[0])


def _gemma_gguf(folder: Path, out: Path, arch: str = "gemma3") -> None:
    """A tiny gemma3_text / gemma2 folder as llama.cpp's converter writes it
    (fx_engine.testing.gguf.write_gemma_gguf)."""
    from fx_engine.testing.gguf import write_gemma_gguf

    write_gemma_gguf(folder, out, arch)


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}], ids=["tied", "untied"])
def test_gemma3_from_gguf_matches_mlx_lm(tmp_path, overrides, tiny_folder):
    """Gemma 3 read from GGUF metadata and llama.cpp's tensor names (norms stored + 1) gives
    mlx-lm's logits on the Hugging Face folder it was converted from, past the window."""
    pytest.importorskip("gguf")
    folder = tiny_folder("gemma3_text", sliding_window_pattern=6,
                         num_hidden_layers=6, **overrides)
    _gemma_gguf(folder, tmp_path / "m.gguf")
    model = fx_engine.load(tmp_path / "m.gguf")
    assert model.config.layer_types == fx_engine.load(folder).config.layer_types
    assert (model.params.lm_head is None) == ("tie_word_embeddings" not in overrides)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids, chunk=32), _mlx_lm(folder)(mx.array([ids]))[0])


def test_gemma2_from_gguf_matches_mlx_lm(tmp_path, tiny_folder):
    """Gemma 2 from llama.cpp's gemma2 metadata (soft-capping values, no q/k norms) gives
    mlx-lm's logits on the folder it was converted from."""
    pytest.importorskip("gguf")
    folder = tiny_folder("gemma2", attn_logit_softcapping=3.0,  # low enough to bite
                         final_logit_softcapping=8.0)
    _gemma_gguf(folder, tmp_path / "m.gguf", arch="gemma2")
    model = fx_engine.load(tmp_path / "m.gguf")
    ref_cfg = fx_engine.load(folder).config
    for field in ("layer_types", "sliding_window", "attn_softcap", "final_logit_softcapping",
                  "attn_scale", "embed_scale", "rope_full", "qk_norm", "tie_word_embeddings"):
        assert getattr(model.config, field) == getattr(ref_cfg, field), field
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids, chunk=32), _mlx_lm(folder)(mx.array([ids]))[0])


GEMMA1 = [{}, {"num_key_value_heads": 1, "head_dim": 16, "rope_theta": 5000.0}]  # (mlx-lm: always tied)


@pytest.mark.parametrize("overrides", GEMMA1, ids=["default", "mqa"])
def test_gemma1_matches_mlx_lm_with_the_tanh_gelu(overrides, tiny_folder, monkeypatch):
    """Gemma 1 (pre-norms only, its post_attention_layernorm the MLP's input norm, every
    layer global, scaled embeddings) against mlx-lm's gemma.py with the tanh GELU: Hugging
    Face's GemmaConfig reads the releases' hidden_act "gelu" as gelu_pytorch_tanh, and
    llama.cpp and Google's reference run that one; mlx-lm's gemma.py applies the erf GELU,
    so its own logits sit farther from fx-engine's than the tanh oracle's."""
    import mlx.nn as nn

    path = tiny_folder("gemma", **overrides)
    model = fx_engine.load(path)
    assert model.config.model_type == "gemma" and not model.config.sandwich_norms
    ids = _ids(70, seed=3)
    ours = fx_engine.logits(model, ids, chunk=32)
    erf = _mlx_lm(path)(mx.array([ids]))[0]
    monkeypatch.setattr(nn, "gelu", nn.gelu_approx)  # (mlx-lm's gemma MLP calls nn.gelu)
    tanh = _mlx_lm(path)(mx.array([ids]))[0]
    _compare(ours, tanh)
    assert mx.abs(ours - tanh).max().item() < mx.abs(ours - erf).max().item() / 4


def test_gemma1_from_gguf_matches_the_folder(tmp_path, tiny_folder):
    """Gemma 1 as llama.cpp's converter writes it (architecture gemma; norms stored + 1; the
    MLP's input norm as ffn_norm, gguf-py's name for it) reads as the folder it came from."""
    gguf = pytest.importorskip("gguf")
    folder = tiny_folder("gemma")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA, 2)
    assert names.get_name("model.layers.0.post_attention_layernorm") == "blk.0.ffn_norm"
    _gemma_gguf(folder, tmp_path / "m.gguf", arch="gemma")
    model, ref = fx_engine.load(tmp_path / "m.gguf"), fx_engine.load(folder)
    for field in ("layer_types", "attn_scale", "embed_scale", "rope_full", "qk_norm", "sandwich_norms",
                  "attn_softcap", "final_logit_softcapping"):
        assert getattr(model.config, field) == getattr(ref.config, field), field
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    _compare(fx_engine.logits(model, ids, chunk=32), fx_engine.logits(ref, ids, chunk=32))


def test_gemma1_gguf_matches_llama_cpp(tmp_path, tiny_folder):
    """The same file through llama.cpp itself (where llama-cpp-python is installed): its
    Gemma graph (tanh GELU, pre-norms, scaled embeddings) gives fx-engine's logits."""
    pytest.importorskip("gguf")
    from tests.gguf_tokenizer import assert_llama_cpp_logits

    _gemma_gguf(tiny_folder("gemma"), tmp_path / "m.gguf", arch="gemma")
    assert_llama_cpp_logits(tmp_path / "m.gguf", tmp_path)


def test_gemma2_sliding_layers_in_the_engine(tiny_folder):
    """Gemma 2 with a window shorter than the context (even layers sliding, as Hugging Face
    and llama.cpp run it): batched rows equal each request alone through the plain loop,
    and the window changes the output once a sequence is longer than it."""
    path = tiny_folder("gemma2", sliding_window=16)
    model = fx_engine.load(path)
    specs = model.cache_layout(headroom=32)
    assert [s.window for s in specs] == [16, None, 16, None]
    prompts = [_ids(n, seed=n) for n in (5, 40, 23)]
    alone = [reference_generate(model, p, max_tokens=20, temperature=0.0, prefill_chunk=8)
             for p in prompts]
    with fx_engine.Engine(model, max_rows=4, prefill_chunk=8) as engine:
        handles = [engine.submit(p, max_tokens=20, temperature=0.0) for p in prompts]
        assert [h.result().token_ids for h in handles] == [a.token_ids for a in alone]
    wide = fx_engine.load(tiny_folder("gemma2"))  # same weights, no window
    ids = _ids(40, seed=9)
    a, b = fx_engine.logits(model, ids), fx_engine.logits(wide, ids)
    assert mx.allclose(a[:16], b[:16], atol=1e-4).item() and not mx.allclose(a[16:], b[16:], atol=1e-2).item()


@pytest.mark.parametrize("quantize", [None, {"group_size": 32, "bits": 8}], ids=["float", "q8"])
def test_gemma4_self_draft_is_the_truncated_checkpoint(tmp_path, quantize, tiny_folder):
    """A Gemma 4 draft of its first 5 of 6 layers (`Family.layer_range`: one of its two
    KV-shared layers kept; the per-layer input table's first 5 layers' columns and the
    projection's rows) computes what the same checkpoint cut to 5 layers does when loaded
    (the oracle: the cut tensors written as a checkpoint of its own). (Later ranges of
    layers, pipeline stages: tests/distributed/test_parallel.py.)"""
    import json

    from fx_engine.engine.drafters import self_draft_model

    # (quantized: 32 inputs per layer, one group of the per-layer table per layer)
    src = tiny_folder("gemma4_text", quantize=quantize,
                      **({"hidden_size_per_layer_input": 32} if quantize else {}))
    cfg = json.loads((src / "config.json").read_text())
    n, hpl = 5, cfg["hidden_size_per_layer_input"]
    cut = tmp_path / "cut"
    cut.mkdir()
    w = mx.load(str(src / "model.safetensors"))
    keep = {}
    for k, v in w.items():
        if k.startswith(f"model.layers.{n}."):
            continue
        if k.startswith("model.embed_tokens_per_layer."):  # [vocab, L * hpl] (packed when quantized)
            per = v.shape[1] // cfg["num_hidden_layers"]
            v = v[:, : n * per]
        elif k.startswith("model.per_layer_model_projection."):  # [L * hpl, hidden]
            v = v[: n * hpl]
        keep[k] = v
    mx.save_safetensors(str(cut / "model.safetensors"), keep, metadata={"format": "mlx"})
    (cut / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": n,
                                                 "num_kv_shared_layers": cfg["num_kv_shared_layers"] - 1}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (cut / name).write_text((src / name).read_text())
    model = fx_engine.load(src)
    draft = self_draft_model(model, n)
    assert draft.config.num_kv_shared_layers == cfg["num_kv_shared_layers"] - 1
    ids = model.tokenizer.encode(LONG_TEXT)[:40]
    want = fx_engine.logits(fx_engine.load(cut), ids)
    assert mx.abs(fx_engine.logits(draft, ids) - want).max().item() <= 1e-4 * mx.abs(want).max().item()
