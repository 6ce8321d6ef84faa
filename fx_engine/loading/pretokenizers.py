"""The pre-tokenizers of byte-level BPE vocabularies in GGUF files, keyed by the file's
`tokenizer.ggml.pre`: the names llama.cpp's converter writes (convert_hf_to_gguf.py's
`get_vocab_base_pre`, one per tokenizer it recognises) and how llama.cpp splits text for each
(llama-vocab.cpp: a list of regular expressions applied in turn, each piece of the previous
split split again, the text between matches kept as pieces too; then BPE on each piece).

Each entry is data: its regular expressions (the original tokenizer.json's where llama.cpp
adapts them to its own regex engine: `(?i:...)`, `\\p{Lu}` and possessive quantifiers,
which the `tokenizers` library's Oniguruma reads), whether a whole piece found in the
vocabulary is taken as one token without merging (`ignore_merges`: Llama 3's tokenizer.json,
llama.cpp's flag), and whether BOS is prepended when the file does not say
(`tokenizer.ggml.add_bos_token`). Names llama.cpp treats alike share an entry.

Not here (refused by name, as an unknown name is): tokenizers whose split is code rather
than a regular expression in llama.cpp (afmoe's digit grouping, superbpe's zero-width
split, chameleon's image tokens), SentencePiece-style BPE over raw UTF-8 (gemma4,
sarvam-moe: not byte-level), and embedding models' vocabularies.
"""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["PreTokenizerSpec", "GGUF_PRE_TOKENIZERS", "pre_tokenizer"]


@attrs.frozen
class PreTokenizerSpec:
    splits: tuple[str, ...]  # regular expressions applied in turn ("isolated": matches become pieces)
    ignore_merges: bool = False
    add_bos: bool = False  # the default when the file has no tokenizer.ggml.add_bos_token


_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
# GPT-2's split (its ByteLevel regex)
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama 3's (tiktoken cl100k's): up to three digits a piece
LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen 2's: one digit a piece
QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Qwen 3.5's: combining marks stay with their letters
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
# tiktoken o200k's (GPT-4o, Llama 4, gpt-oss, Phi-4): case runs, contractions kept with the word
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
         rf"{_CONTRACTIONS}?|\p{{N}}{{1,3}}| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral's Tekken: o200k's case runs without contractions, one digit a piece
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}"
          rf"| ?[^\s\p{{L}}\p{{N}}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Kimi K2's (its tiktoken pattern): Han runs apart, o200k's case runs over the other letters
_NO_HAN_UPPER, _NO_HAN_LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
KIMI_K2 = (rf"[\p{{Han}}]+|[^\r\n\p{{L}}\p{{N}}]?{_NO_HAN_UPPER}*{_NO_HAN_LOWER}+{_CONTRACTIONS}?"
           rf"|[^\r\n\p{{L}}\p{{N}}]?{_NO_HAN_UPPER}+{_NO_HAN_LOWER}*{_CONTRACTIONS}?|\p{{N}}{{1,3}}"
           rf"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek V3's three splits: digits in threes, CJK runs, then its word pattern
DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
             r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
             r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_ENTRIES: tuple[tuple[tuple[str, ...], PreTokenizerSpec], ...] = (
    # llama.cpp's default (a missing or "default" name): punctuation runs first, then GPT-2's
    (("default",), PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))),
    (("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4", "gigachat",
      "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code",
      "roberta-bpe", "modern-bert"), PreTokenizerSpec((GPT2,))),
    # every digit its own piece, then GPT-2's (StarCoder's and SmolLM's Digits(individual_digits))
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
     PreTokenizerSpec((r"\p{N}", GPT2))),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
     PreTokenizerSpec((LLAMA3,), ignore_merges=True, add_bos=True)),
    (("dbrx", "smaug-bpe"), PreTokenizerSpec((LLAMA3,))),
    (("glm4", "chatglm-bpe"), PreTokenizerSpec((LLAMA3,))),
    (("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
     PreTokenizerSpec((QWEN2,))),
    (("qwen35",), PreTokenizerSpec((QWEN35,))),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), PreTokenizerSpec((GPT4O,))),
    (("tiny_aya", "cohere2moe"), PreTokenizerSpec((r"\d{1,3}(?=(?:\d{3})*\b)", GPT4O))),
    (("tekken",), PreTokenizerSpec((TEKKEN,), ignore_merges=True, add_bos=True)),
    (("kimi-k2",), PreTokenizerSpec((KIMI_K2,))),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm"), PreTokenizerSpec(DEEPSEEK3)),
    (("deepseek-coder",), PreTokenizerSpec((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"))),
    (("falcon",), PreTokenizerSpec((r"[\p{P}\$\+<=>\^~\|`]+", GPT2, r"[0-9][0-9][0-9]"))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizerSpec((_BLOOM,))),
    (("viking",), PreTokenizerSpec((_BLOOM, r"\p{N}"))),
    (("bailingmoe", "bailingmoe2", "llada-moe"),
     PreTokenizerSpec((r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]"
                       r"|\s+(?!\S)|\s+",))),
    (("seed-coder",), PreTokenizerSpec((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
                                        r"|\s*[\r\n]+|\s+(?!\S)|\s+",))),
    (("exaone-moe",), PreTokenizerSpec((_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
                                        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",))),
    (("laguna",), PreTokenizerSpec((r"[^\n]+|[\n]+", QWEN2))),
    (("minicpm5",), PreTokenizerSpec((r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
                                      r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), ignore_merges=True)),
)

GGUF_PRE_TOKENIZERS: dict[str, PreTokenizerSpec] = {name: spec for names, spec in _ENTRIES for name in names}


def pre_tokenizer(spec: PreTokenizerSpec) -> Any:
    """The `tokenizers` pre-tokenizer for `spec`: its splits in turn, then the byte-level
    mapping (no second GPT-2 split)."""
    from tokenizers import Regex, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated", invert=False) for p in spec.splits]
    return pre_tokenizers.Sequence([*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
