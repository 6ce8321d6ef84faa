"""Gemma 4 GGUF files (llama.cpp's gemma4), as its converter writes them
(`fx_engine.testing.gguf.write_gemma4_gguf`, after convert_hf_to_gguf.py's Gemma4Model):
fx-engine's logits from the file equal its logits from the Hugging Face folder the file was
written from (that path is checked against mlx-lm in test_parity and test_gemma), and, where
llama-cpp-python is installed, llama.cpp's own logits from the same file (per-layer head
sizes and KV heads, KV-shared layers, per-layer inputs, the proportional RoPE as rope_freqs,
keys as values, the routed experts). And the `gemma4` vocabulary type (spaces as "▁",
newline runs apart, BPE over characters with byte fallback) against llama.cpp's tokenizer."""

import random
import re

import attrs
import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.loading.tokenizer import Tokenizer
from fx_engine.testing import write_tiny_model
from tests.gguf_tokenizer import assert_llama_cpp_logits, llama_cpp_tokenize, q8_0_round_trip

gguf = pytest.importorskip("gguf")

from fx_engine.testing.gguf import write_gemma4_gguf  # noqa: E402

KINDS = ["sliding_attention", "sliding_attention", "full_attention"] * 2
# (llama.cpp's KV sharing takes the last two computing layers as [sliding, full]: Gemma 4's
# published shapes, and these; Hugging Face's rule, the last computing layer of the same
# kind, agrees there. The tiny default's 2 shared layers end [full, sliding]: file = folder.)
CASES = {
    "shared": {"layer_types": KINDS, "num_kv_shared_layers": 3},
    "k_eq_v": {"layer_types": KINDS, "num_kv_shared_layers": 3, "attention_k_eq_v": True,
               "num_global_key_value_heads": 1, "num_key_value_heads": 2, "num_attention_heads": 4},
    # (26B-A4B's shape: no per-layer inputs, and its config's use_bidirectional_attention
    # "vision", which a GGUF does not carry: the reader infers it from the missing inputs)
    "moe": {"layer_types": KINDS, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
            "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32,
            "use_bidirectional_attention": "vision"},
    "tiny_default": {"layer_types": KINDS},
}
IDS = list(range(5, 69))


def _logits(model):
    return np.asarray(fx_engine.logits(model, IDS, chunk=16))


@pytest.mark.parametrize("case", sorted(CASES))
def test_gguf_logits_equal_the_folders(tmp_path, case):
    folder = write_tiny_model(tmp_path / "m", "gemma4_text", seed=3, **CASES[case])
    model, ref = fx_engine.load(write_gemma4_gguf(folder, tmp_path / "m.gguf")), fx_engine.load(folder)
    got, want = attrs.asdict(model.config, recurse=False), attrs.asdict(ref.config, recurse=False)
    waived = {"rms_norm_eps"}  # (float32 in the file)
    if not ref.config.num_kv_shared_layers:
        waived.add("use_double_wide_mlp")  # (widens only KV-shared layers: the file cannot say it without them)
    assert {k: (got[k], want[k]) for k in want if got[k] != want[k] and k not in waived} == {}
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=2e-5)


def test_q8_0_matrices(tmp_path):
    folder = write_tiny_model(tmp_path / "m", "gemma4_text", seed=5, **CASES["moe"])
    chosen = lambda name, x: ".layers." in name and "norm" not in name and "router" not in name  # noqa: E731
    model = fx_engine.load(write_gemma4_gguf(folder, tmp_path / "m.gguf", q8=chosen))
    q8_0_round_trip(folder, chosen)
    np.testing.assert_allclose(_logits(model), _logits(fx_engine.load(folder)), rtol=0, atol=2e-5)


@pytest.mark.parametrize("case", ["shared", "k_eq_v", "moe"])
def test_llama_cpp_logits(tmp_path, case):
    folder = write_tiny_model(tmp_path / "m", "gemma4_text", seed=3, **CASES[case])
    assert_llama_cpp_logits(write_gemma4_gguf(folder, tmp_path / "m.gguf"), tmp_path)


def test_refusals(tmp_path):
    from fx_engine.core.models import gemma
    from fx_engine.loading.gguf import read_gguf_metadata

    folder = write_tiny_model(tmp_path / "m", "gemma4_text", seed=3, **CASES["shared"])
    path = write_gemma4_gguf(folder, tmp_path / "m.gguf")
    md = read_gguf_metadata(path)
    for key, value, match in (("attention.sliding_window_pattern", None, "sliding_window_pattern"),
                              ("attention.sliding_window_pattern", mx.array([True, False]), "sliding_window_pattern"),
                              ("feed_forward_length", mx.array([64, 64, 64, 64, 64, 96]), "feed_forward_length"),
                              ("attention.head_count_kv", mx.array([2, 1, 2, 2, 2, 2]), "one count per layer kind"),
                              ("attention.value_length", 16, "value_length")):
        bad = {k: v for k, v in md.items() if k != "gemma4." + key} if value is None else {**md, "gemma4." + key: value}
        with pytest.raises(ConfigError, match=match):
            gemma.config_from_gguf(bad, "x.gguf")


# ---------------------------------------------------------------- the gemma4 vocabulary type

LONGEST_NEWLINES = 8
TEXTS = ["Hello world", "  two  spaces\tand a tab", "line one\nline two\n\nafter a blank\n\n\n\nfour",
         "\n", "\n\n\n\n\n\n\n\n", "trailing\n\n", "Ünïcödé 🙂 中文テキスト", "no-vocab: ½ ∑ Ω", "<start>hi<end> x",
         "aaaa aaa aa a", " leading space", "ends with space "]


def _gemma4_vocab(tmp_path):
    """A small gemma4 vocabulary as Gemma4Model writes one: control tokens, the 256 byte
    tokens, newline runs, and BPE pieces over "▁"-escaped lines trained by `tokenizers`
    (its merges in rank order), in a vocab-only file llama.cpp loads."""
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers, trainers

    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "line one line two",
              "numbers 123 456 and more", "a aa aaa aaaa", "spaces  and\ttabs"] * 20
    hf = HF(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Split("\n", behavior="isolated")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "<end>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    newlines = ["\n" * k for k in range(1, LONGEST_NEWLINES + 1)]  # (Gemma's own vocabulary: 1 to 31)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials + byte_tokens + newlines,
                                  initial_alphabet=list("abcdefghijklmnopqrstuvwxyz\u2581,0123456789\t"),
                                  show_progress=False)
    hf.train_from_iterator([t.replace(" ", "\u2581") for t in corpus], trainer)
    data = hf.to_str()
    import json

    model = json.loads(data)["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t in specials[:3] + specials[4:] else 2 if t == "<unk>" else 6 if t in byte_tokens else 1
             for t in tokens]
    w = gguf.GGUFWriter(str(tmp_path / "v.gguf"), "gemma4")
    for key, val in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                     ("feed_forward_length", 128), ("attention.head_count", 4)):
        w.add_uint32(f"gemma4.{key}", val)
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<bos>"))
    w.add_eos_token_id(tokens.index("<eos>"))
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    meta = {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": tokens.index("<bos>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<eos>"), "tokenizer.ggml.add_bos_token": True}
    return tmp_path / "v.gguf", meta


def test_gemma4_vocabulary_matches_llama_cpp(tmp_path):
    """Texts whose newline runs are at most the longest newline token (one token each, in
    both); a longer run (beyond 31 newlines in Gemma's vocabulary) fx-engine splits into
    the longest tokens first, where llama.cpp runs BPE on it (`_build_gemma4_bpe`)."""
    path, meta = _gemma4_vocab(tmp_path)
    tok = Tokenizer.from_gguf_metadata(meta, "<gemma4>")
    rng = random.Random(7)
    alphabet = list("abcdehlopqrtwxyz ,.1\n\t") + ["  ", "\n\n", "é", "🙂", "<start>"]
    texts = TEXTS + ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(200)]
    texts = [re.sub("\n{%d,}" % (LONGEST_NEWLINES + 1), "\n" * LONGEST_NEWLINES, t) for t in texts]
    want = llama_cpp_tokenize(path, texts, add_bos=True)
    for text, ids in zip(texts, want):
        assert tok.encode(text) == ids, (text, tok.encode(text), ids)
        if "<start>" not in text:  # (decoding gives the text back: bytes fall back, "▁" is a space)
            assert tok.decode(ids, skip_special_tokens=True) == text
