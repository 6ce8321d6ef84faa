"""GGUF loading with every supported tensor type, checked against an independent path.

A tiny llama checkpoint is written as a GGUF with the `gguf` package (llama.cpp's own
Python writer and reference quantizers): token_embd F16, attn_q Q4_0, attn_k Q4_1, attn_v
Q8_0, attn_output F32, ffn_* mixed, untied `output` Q8_0; q/k rows permuted as llama.cpp's
converter does. The reference is mlx-lm's llama class holding the gguf package's own
dequantization of the *unpermuted* quantized rows (quantization runs along rows, so it
commutes with the row permutation): nothing of fx-engine's loader is reused by the oracle.
"""

import json

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.testing import write_tiny_model

pytestmark = pytest.mark.oracle

gguf = pytest.importorskip("gguf", reason="the gguf package (llama.cpp's writer) is a test dependency")
Q = gguf.GGMLQuantizationType


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (written out independently)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


TYPES = {
    "token_embd": Q.F16, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
    "attn_output": Q.F32, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q8_0, "ffn_down": Q.Q4_1,
    "output": Q.Q8_0,
}
HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _quant_roundtrip(w: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes to store, the gguf package's own dequantization of them)."""
    if qtype == Q.F32:
        return w.astype(np.float32), w.astype(np.float32)
    if qtype == Q.F16:
        return w.astype(np.float16), w.astype(np.float16).astype(np.float32)
    if qtype == Q.Q6_K:  # (the gguf package has no Q6_K quantizer: random valid blocks, small d)
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(w.shape[0]).integers(0, 256, (w.shape[0], w.shape[1] // block, size), np.uint8)
        raw[..., -2:] = np.full(raw.shape[:-1], 1e-4, np.float16).view(np.uint8).reshape(*raw.shape[:-1], 2)
        raw = raw.reshape(w.shape[0], -1)
    else:
        raw = gguf.quants.quantize(w.astype(np.float32), qtype)
    return raw, gguf.quants.dequantize(raw, qtype).reshape(w.shape).astype(np.float32)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def gguf_and_reference(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gguf"), rope_scaling=None)


@pytest.fixture(scope="module")
def gguf_llama3_and_reference(tmp_path_factory):
    return _build(tmp_path_factory.mktemp("gguf3"), rope_scaling=LLAMA3)


@pytest.fixture(scope="module")
def gguf_q4_0_and_reference(tmp_path_factory):  # the layers' matrices Q4_0 (ffn_down Q6_K), the output Q8_0
    qtypes = {**TYPES, **{k: Q.Q4_0 for k in HF}, "ffn_down": Q.Q6_K, "output": Q.Q8_0}
    return _build(tmp_path_factory.mktemp("gguf_q4_0"), rope_scaling=None, qtypes=qtypes)


def _build(d, rope_scaling, qtypes=TYPES):
    from mlx_lm.models import llama
    from mlx_lm.models.rope_utils import initialize_rope

    extra = {"rope_scaling": rope_scaling} if rope_scaling else {}
    folder = write_tiny_model(d / "hf", "llama", hidden_size=128, intermediate_size=256,
                              num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                              num_hidden_layers=2, rope_theta=50000.0, **extra)
    cfg = json.loads((folder / "config.json").read_text())
    hf = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab] + [a["content"] for a in tok["added_tokens"] if a["id"] >= len(vocab)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tokens += [f"<unused{i}>" for i in range(cfg["vocab_size"] - len(tokens))]
    types = [3 if t.startswith("<|") else 1 for t in tokens]

    path = d / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    heads, kv, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["hidden_size"] // heads)
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    ref: dict[str, mx.array] = {}

    def put(gguf_name: str, hf_name: str, kind: str, permute_heads: int | None = None):
        W = hf[hf_name]
        raw_perm, _ = _quant_roundtrip(_permute(W, permute_heads) if permute_heads else W, qtypes[kind])
        _, deq = _quant_roundtrip(W, qtypes[kind])  # reference: same rows, unpermuted
        w.add_tensor(gguf_name, raw_perm, raw_dtype=qtypes[kind] if qtypes[kind] not in (Q.F32, Q.F16) else None)
        ref[hf_name] = mx.array(deq)

    put("token_embd.weight", "model.embed_tokens.weight", "token_embd")
    put("output.weight", "lm_head.weight", "output")
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    ref["model.norm.weight"] = mx.array(hf["model.norm.weight"])
    for i in range(layers):
        for kind, hfn in HF.items():
            perm = heads if kind == "attn_q" else kv if kind == "attn_k" else None
            put(f"blk.{i}.{kind}.weight", f"model.layers.{i}.{hfn}.weight", kind, perm)
        for g, h in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            w.add_tensor(f"blk.{i}.{g}.weight", hf[f"model.layers.{i}.{h}.weight"])
            ref[f"model.layers.{i}.{h}.weight"] = mx.array(hf[f"model.layers.{i}.{h}.weight"])
    if rope_scaling:
        # llama.cpp's converter writes Llama-3 scaling as per-frequency factors
        # (rope_freqs.weight) = scaled period / unscaled period; mlx-lm's Llama3RoPE is the
        # independent source of the scaled periods.
        hd = cfg["hidden_size"] // heads
        rope = initialize_rope(hd, cfg["rope_theta"], False, rope_scaling, cfg["max_position_embeddings"])
        base_periods = cfg["rope_theta"] ** (np.arange(0, hd, 2) / hd)
        w.add_tensor("rope_freqs.weight", (np.array(rope._freqs) / base_periods).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    args = llama.ModelArgs(
        model_type="llama", hidden_size=cfg["hidden_size"], num_hidden_layers=layers,
        intermediate_size=cfg["intermediate_size"], num_attention_heads=heads,
        rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"], num_key_value_heads=kv,
        rope_theta=cfg["rope_theta"], tie_word_embeddings=False, rope_scaling=rope_scaling,
        max_position_embeddings=cfg["max_position_embeddings"],
    )
    model = llama.Model(args)
    model.load_weights(list(ref.items()))
    return path, model


@pytest.mark.parametrize("keep_quantized", [False, True])
def test_gguf_all_tensor_types_match_reference(gguf_and_reference, keep_quantized):
    path, ref = gguf_and_reference
    m = fx_engine.load(path, keep_quantized=keep_quantized)
    assert not m.config.tie_word_embeddings and m.config.rope_theta == 50000.0
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:80]
    assert len(ids) >= 64
    ours = fx_engine.logits(m, ids)
    theirs = ref(mx.array([ids]))[0]
    # keep_quantized runs MLX's quantized matmul (different rounding from dense float32)
    tol = 5e-3 if keep_quantized else 2e-3
    assert mx.abs(ours - theirs).max().item() < tol
    assert mx.mean((ours.argmax(-1) == theirs.argmax(-1)).astype(mx.float32)).item() >= 0.95


def test_gguf_llama3_rope_freqs(gguf_llama3_and_reference, gguf_and_reference):
    """Llama-3.x GGUFs carry rope scaling as a rope_freqs tensor: it must be applied."""
    path, ref = gguf_llama3_and_reference
    m = fx_engine.load(path)
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[:80]
    ours = fx_engine.logits(m, ids)
    assert mx.abs(ours - ref(mx.array([ids]))[0]).max().item() < 2e-3
    # and it matters: the unscaled model differs
    plain = fx_engine.logits(fx_engine.load(gguf_and_reference[0]), ids)
    assert mx.abs(ours - plain).max().item() > 1e-2


def test_gguf_tokenizer_round_trip(gguf_and_reference):
    m = fx_engine.load(gguf_and_reference[0])
    text = "What is the capital of France? 0123456789"
    assert m.tokenizer.decode(m.tokenizer.encode(text)) == text


def test_gguf_8_bit_mode_reads_compact_parameters(gguf_q4_0_and_reference, gguf_and_reference):
    """In the 8-bit mode the Q4_0 / Q8_0 matrices (w = d (q - 8) / d (q - 128): every bias
    -8 or -128 times its scale, checked on the values at load) are run from their float16
    scales alone (Quant.bias_multiplier: a decode step reads 2 bytes of parameters a group,
    not 4); Q4_1's own minimums, and matrices fused from mixed types, are read as stored.
    A Q6_K matrix (its bias codes equal to its scale codes) keeps one int8 code a group
    (nn.one_code). The logits equal, bit for bit, those of the same interleaved params
    with every stored bias and both codes. The float32 numerics record the same multipliers
    on their rows-layout matrices (nn.with_implied_bias), with the same logits as the
    stored biases give."""
    from fx_engine.core.adapters import map_linears
    from fx_engine.core.nn import linears, two_codes

    def stored_form(lin):
        if not lin.quantized:
            return lin
        q = lin.quant
        return lin.with_quant(bias_multiplier=None, scales=two_codes(q.scales) if q.scales.dtype == mx.int8 else q.scales)

    for path, want, int8_codes in ((gguf_q4_0_and_reference[0], 2 * 3 * [-8.0] + [-128.0], 2),  # qkv, o, gate_up x 2; output
                                   (gguf_and_reference[0], [-128.0], 0)):  # (mixed layers: only the Q8_0 output)
        a8 = fx_engine.load(path, numerics="int8")
        got = [lin.quant.bias_multiplier for lin in linears(a8.params) if lin.quantized and lin.interleaved]
        assert sorted(m for m in got if m is not None) == sorted(want), got
        assert sum(lin.quant.scales.dtype == mx.int8 for lin in linears(a8.params) if lin.quantized) == int8_codes
        exact = fx_engine.load(path)  # the float32 numerics: the same multipliers, rows layout
        got = [lin.quant.bias_multiplier for lin in linears(exact.params) if lin.quantized and not lin.interleaved]
        assert sorted(m for m in got if m is not None) == sorted(want), got
        ids = a8.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:40]
        for model in (a8, exact):
            stored = __import__("attrs").evolve(model, params=map_linears(model.params, lambda _, lin: stored_form(lin)))
            for chunk in (1, 16):
                assert np.array_equal(np.asarray(fx_engine.logits(model, ids, chunk=chunk)),
                                      np.asarray(fx_engine.logits(stored, ids, chunk=chunk)))
