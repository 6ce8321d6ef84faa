"""A tiny llama GGUF with a K-quant mix like Q4_K_M's (Q4_K, Q6_K, Q5_0, Q8_0, F32 norms;
tied, and untied with llama.cpp's Q6_K output head),
written with llama.cpp's `gguf` package: fx-engine's logits from the file equal mlx-lm's on
a Hugging Face folder holding the reference dequantization of the same tensors (the q/k rows
un-permuted as llama.cpp's converter permuted them), and `fx-engine generate` runs on it."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.oracle

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

import fx_engine  # noqa: E402
from fx_engine.loading.gguf import _Header  # noqa: E402

from tests.models.test_gguf_types import F16_FIELDS  # noqa: E402

H, LAYERS, HEADS, KV, FF = 256, 2, 4, 2, 512
HD = H // HEADS
# per tensor: its type (a Q4_K_M-like mix)
TYPES = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
         "attn_output": "Q4_K", "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K"}
SHAPES = {"attn_q": (HEADS * HD, H), "attn_k": (KV * HD, H), "attn_v": (KV * HD, H),
          "attn_output": (H, HEADS * HD), "ffn_gate": (FF, H), "ffn_up": (FF, H), "ffn_down": (H, FF)}
HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
      "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
      "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# the float16 block scales' exponent range per type: weights of a sane size (|w| ~ 0.01-1)
EXP = {"Q4_K": (-13, -10), "Q6_K": (-17, -14), "Q5_0": (-8, -5), "Q8_0": (-11, -8),
       "IQ4_NL": (-14, -11), "IQ4_XS": (-18, -15)}
# layer 1's MLP in the codebook types (an IQ4_XS gate, an IQ4_NL up: 8-bit affine, fused)
LAYER1 = {"attn_output": "Q8_0", "ffn_gate": "IQ4_XS", "ffn_up": "IQ4_NL"}


def _blocks(kind, rows, cols, rng):
    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    lo, hi = EXP[kind]
    for off in F16_FIELDS[kind]:
        vals = rng.uniform(1, 2, len(raw)) * 2.0 ** rng.integers(lo, hi, len(raw))
        raw[:, off : off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def _unpermute(w, n_head):  # llama.cpp's convert permutes HF q/k rows; this undoes it
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module", params=["tied", "untied"])
def kquant_model(tmp_path_factory, default_model, request):
    return write_kquant_gguf(tmp_path_factory.mktemp("kq"), Path(default_model.path), request.param == "untied")


def write_kquant_gguf(tmp: Path, vocab_from: Path, untied: bool) -> tuple[Path, Path]:
    """The tiny Q4_K_M-like llama GGUF (the vocabulary of the GGUF `vocab_from`) and the
    Hugging Face folder holding its reference dequantization."""
    rng = np.random.default_rng(0)
    vocab_md = {k: v for k, v in _Header(vocab_from).metadata.items()
                if k.startswith("tokenizer.")}
    vocab = len(vocab_md["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(tmp / "tiny-Q4_K_M.gguf"), "llama")
    for key, fn, val in (("block_count", w.add_uint32, LAYERS), ("context_length", w.add_uint32, 2048),
                         ("embedding_length", w.add_uint32, H), ("feed_forward_length", w.add_uint32, FF),
                         ("attention.head_count", w.add_uint32, HEADS),
                         ("attention.head_count_kv", w.add_uint32, KV),
                         ("attention.layer_norm_rms_epsilon", w.add_float32, 1e-5),
                         ("rope.freq_base", w.add_float32, 10000.0)):
        fn(f"llama.{key}", val)
    for k, v in vocab_md.items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, np.ndarray):
            w.add_array(k, v.tolist())
        elif isinstance(v, np.bool_):
            w.add_bool(k, bool(v))
        else:
            w.add_uint32(k, int(v))
    hf = {}

    def add(name, rows, cols, kind, hf_name, permute=0):
        raw = _blocks(kind, rows, cols, rng)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[kind])
        ref = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
        hf[hf_name] = _unpermute(ref, permute) if permute else ref

    add("token_embd.weight", vocab, H, TYPES["token_embd"], "model.embed_tokens.weight")
    for i in range(LAYERS):
        for part, (rows, cols) in SHAPES.items():
            kind = LAYER1.get(part, TYPES[part]) if i == 1 else TYPES[part]
            heads = {"attn_q": HEADS, "attn_k": KV}.get(part, 0)
            add(f"blk.{i}.{part}.weight", rows, cols, kind, f"model.layers.{i}.{HF[part]}.weight", heads)
        for norm in ("attn_norm", "ffn_norm"):
            v = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
            w.add_tensor(f"blk.{i}.{norm}.weight", v)
            hf[f"model.layers.{i}.{HF[norm]}.weight"] = v
    if untied:  # llama.cpp's own output head, Q6_K as in Q4_K_M files
        add("output.weight", vocab, H, "Q6_K", "lm_head.weight")
    v = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    w.add_tensor("output_norm.weight", v)
    hf["model.norm.weight"] = v
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()

    folder = tmp / "hf"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), {k: mx.array(x) for k, x in hf.items()})
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": H, "num_hidden_layers": LAYERS,
        "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV,
        "rms_norm_eps": 1e-5, "vocab_size": vocab, "rope_theta": 10000.0,
        "max_position_embeddings": 2048, "tie_word_embeddings": not untied}))
    return tmp / "tiny-Q4_K_M.gguf", folder


@pytest.mark.slow
def test_kquant_gguf_matches_mlx_lm_on_its_reference_dequantization(kquant_model):
    from mlx_lm.utils import load_model

    path, folder = kquant_model
    model = fx_engine.load(path)
    l0, l1 = model.params.layers
    kinds = [(lin.quant.bits, lin.quant.group_size) if lin.quantized else "dense"
             for lin in (l0.o, l1.o, l0.gate_up, l0.qkv, l0.down)]
    # Q4_K kept as 4 bits; Q8_0 8 bits; Q4_K | Q5_0 fused at 5 bits (the widest part's:
    # exact); q|k|v with a Q6_K part at 6 bits in groups of 16 (the Q4_K parts' groups of 32
    # split in two, exact too); the Q6_K down projection as stored, 6 bits in groups of 16
    assert kinds == [(4, 32), (8, 32), (5, 32), (6, 16), (6, 16)], kinds
    # layer 1's IQ4_XS | IQ4_NL gate|up: codebook indices as 8-bit affine integers
    assert (l1.gate_up.quant.bits, l1.gate_up.quant.group_size) == (8, 32)
    # the Q6_K embedding, looked up (and the head when tied): as stored
    emb = model.params.embed
    assert ((emb.quant.bits, emb.quant.group_size) if emb.quantized else "dense") == (6, 16)
    ref_model, _ = load_model(folder)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[:64]
    ours = np.asarray(fx_engine.logits(model, ids, chunk=32))
    ref = np.asarray(ref_model(mx.array([ids]))[0])
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0.1
    # float32 on both sides, summation order only (measured: 2.6e-5 of 6)
    np.testing.assert_allclose(ours, ref, atol=2e-4 * np.abs(ref).max(), rtol=0)


def test_kquant_scales_stay_compact_and_give_the_float32_bits(kquant_model):
    """On the native kernels the K-quant tensors keep their two-level scales (int16 codes per
    group, float16 factors per super-block: about the file's bytes) and the legacy types'
    float16 ones; the kernels decode them to exactly the float32 values, so the logits equal
    those of the same params with every scale expanded to float32, bit for bit."""
    import attrs

    from fx_engine.core import checkpoint, nn
    from fx_engine.core.adapters import map_linears
    from fx_engine.runtime import native

    if native.ensure(quiet=True) is None:
        pytest.skip("native kernels unavailable")
    path, _ = kquant_model
    model = fx_engine.load(path)
    l0, l1 = model.params.layers
    forms = {name: (str(lin.quant.scales.dtype), lin.quant.bits, lin.quant.group_size)
             for name, lin in (("o", l0.o), ("o1", l1.o), ("qkv", l0.qkv), ("down", l0.down), ("gate_up", l0.gate_up))}
    assert forms == {"o": ("mlx.core.int16", 4, 32),  # Q4_K
                     "o1": ("mlx.core.float16", 8, 32),  # Q8_0: its d as a half
                     "qkv": ("mlx.core.int16", 6, 16),  # Q4_K q/k regrouped with a Q6_K v
                     "down": ("mlx.core.int16", 6, 16),  # Q6_K
                     "gate_up": ("mlx.core.float32", 5, 32)}, forms  # Q4_K | Q5_0: forms differ
    assert l0.down.quant.biases.shape == (H, FF // 256, 2) and l0.down.quant.biases.dtype == mx.float16

    def as_float32(lin):
        if not lin.quantized or lin.quant.mode != "affine":
            return lin
        lin = checkpoint.expanded(lin)
        return lin.with_quant(scales=lin.quant.scales.astype(mx.float32), biases=lin.quant.biases.astype(mx.float32))

    wide = attrs.evolve(model, params=map_linears(model.params, lambda i, lin: as_float32(lin)))
    assert all(lin.quant.scales.dtype == mx.float32 for lin in nn.linears(wide.params) if lin.quantized)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    for chunk in (1, 32):
        assert np.array_equal(np.asarray(fx_engine.logits(model, ids, chunk=chunk)),
                              np.asarray(fx_engine.logits(wide, ids, chunk=chunk)))
    compact = sum(a.nbytes for lin in nn.linears(model.params) if lin.quantized
                  for a in (lin.quant.scales, lin.quant.biases))
    full = sum(a.nbytes for lin in nn.linears(wide.params) if lin.quantized for a in (lin.quant.scales, lin.quant.biases))
    assert compact < 0.5 * full, (compact, full)


def test_cli_generates_from_a_kquant_gguf(kquant_model, capsys):
    from fx_engine.cli import main

    path, _ = kquant_model
    assert main(["generate", "--model", str(path), "--raw", "Once upon a time", "--max-tokens", "6"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "generation: 6 tokens" in out.err
