"""Tokenizers for fx-engine: one `Tokenizer` wrapper over a Hugging Face `tokenizers.Tokenizer`.

Two sources are supported:

* `Tokenizer.from_gguf_metadata(metadata)`: a GGUF file carries no `tokenizer.json`, only the
  vocabulary, merges, token types and special ids under llama.cpp's key names (what
  `mx.load(path, return_metadata=True)` returns). We rebuild the equivalent `tokenizers`
  pipeline from them. We never implement BPE ourselves: the Rust `tokenizers` library does the
  merging; we only choose its pre-tokenizer, decoder and added tokens to match what llama.cpp
  (the reference implementation for GGUF) and the model's original `tokenizer.json` do.
* `Tokenizer.from_hf_folder(path)`: a Hugging Face model folder (`tokenizer.json`,
  `tokenizer_config.json`, optional `generation_config.json`, `config.json`,
  `chat_template.jinja` / `chat_template.json`).

`StreamingDetokenizer` turns generated ids into text deltas for streaming without ever emitting
half of a multi-byte UTF-8 character, at O(1) amortized cost per token.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from fx_engine.loading import chat_template as _chat
from fx_engine.loading.pretokenizers import GGUF_PRE_TOKENIZERS, PreTokenizerSpec, pre_tokenizer

__all__ = ["StreamingDetokenizer", "Tokenizer", "GGUF_PRE_TOKENIZERS", "gguf_pre_tokenizer"]

# llama.cpp's token types (gguf `tokenizer.ggml.token_type`).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_REPLACEMENT_CHAR = "\ufffd"  # what a lossy UTF-8 decode yields for incomplete/invalid bytes
_SPM_SPACE = "\u2581"  # SentencePiece's visible space "▁"


# --------------------------------------------------------------------------------------------
# Small helpers for metadata and files
# --------------------------------------------------------------------------------------------


def _to_python(value: Any) -> Any:
    # GGUF scalars arrive as 0-d mx.arrays and arrays as mx.arrays; `.tolist()` turns both (and
    # numpy values) into plain Python scalars/lists without importing mlx here.
    return value.tolist() if hasattr(value, "tolist") else value


def _meta(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = metadata.get(key)
    return default if value is None else _to_python(value)


def _meta_id(metadata: Mapping[str, Any], key: str, n_vocab: int, source: str) -> int | None:
    """An optional token id from the metadata, checked against the vocabulary size."""
    value = _meta(metadata, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{source}: GGUF key {key!r} must be an integer token id, got {value!r}")
    if not 0 <= value < n_vocab:
        raise ValueError(f"{source}: GGUF key {key!r} = {value} is outside the vocabulary (size {n_vocab})")
    return value


def _unique(ids: Iterable[int | None]) -> tuple[int, ...]:
    # Deduplicate while keeping order: the first eos id is the primary one.
    out: list[int] = []
    for i in ids:
        if i is not None and i not in out:
            out.append(i)
    return tuple(out)


def _parse_merges(raw: Any, source: str) -> list[tuple[str, str]]:
    """GGUF stores merges as "left right" strings (byte-level symbols never contain a space)."""
    merges = []
    for i, merge in enumerate(raw):
        if isinstance(merge, (tuple, list)) and len(merge) == 2:
            merges.append((str(merge[0]), str(merge[1])))
            continue
        parts = merge.split(" ") if isinstance(merge, str) else []
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise ValueError(f"{source}: tokenizer.ggml.merges[{i}] = {merge!r} is not a 'left right' pair")
        merges.append((parts[0], parts[1]))
    return merges


def _first_index_vocab(tokens: list[str]) -> dict[str, int]:
    # Some vocabularies repeat a string; the first id wins (what encoding can produce), later
    # duplicates stay decodable through vocab_size but are never produced by encode.
    vocab: dict[str, int] = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    return vocab


def _read_json(path: Path, required: bool) -> dict | None:
    """Read a JSON object file; errors name the file so a broken model folder is easy to fix."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"{path}: required file is missing")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: malformed JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object at the top level, got {type(data).__name__}")
    return data


def _token_content(value: Any, path: Path, field: str) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as serialized AddedTokens.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{path}: {field} must be a string or an object with 'content', got {value!r}")


def _config_ids(value: Any, path: Path, field: str, vocab_size: int) -> list[int]:
    # generation_config.json / config.json: `eos_token_id` may be an int or a list of ints.
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab_size:
            raise ValueError(f"{path}: {field} must be token ids in [0, {vocab_size}), got {value!r}")
    return list(values)


# --------------------------------------------------------------------------------------------
# GGUF builders
# --------------------------------------------------------------------------------------------


def _gguf_chat_templates(metadata: Mapping[str, Any]) -> dict[str, str]:
    """`tokenizer.chat_template` is the default; `tokenizer.chat_template.NAME` are variants
    (e.g. `tool_use`), as llama.cpp's converter writes them."""
    templates = {}
    default = metadata.get("tokenizer.chat_template")
    if isinstance(default, str):
        templates["default"] = default
    prefix = "tokenizer.chat_template."
    for key, value in metadata.items():
        if key.startswith(prefix) and isinstance(value, str):
            templates[key[len(prefix) :]] = value
    return templates


def _added_tokens_from_types(tokens: list[str], token_types: list[int], special_types: set[int]) -> tuple[list[AddedToken], list[AddedToken]]:
    """Control-like tokens become special added tokens, user-defined ones plain added tokens.

    Why: registered added tokens are matched atomically in the input text ("<|im_start|>" is one
    id, not eight), as llama.cpp does; special ones are also dropped by skip_special_tokens.
    """
    special, user = [], []
    for token, token_type in zip(tokens, token_types):
        if not token:  # an empty string cannot be matched in text; it stays an ordinary vocab entry
            continue
        if token_type in special_types:
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == TOKEN_USER_DEFINED:
            user.append(AddedToken(token, special=False, normalized=False))
    return special, user


def gguf_pre_tokenizer(metadata: Mapping[str, Any], source: str) -> PreTokenizerSpec:
    """The file's `tokenizer.ggml.pre` (llama.cpp's default where it has none), or a
    ValueError naming it and the names this reads (loading/pretokenizers.py)."""
    pre = _meta(metadata, "tokenizer.ggml.pre", "default")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ValueError(f"{source}: unsupported tokenizer.ggml.pre = {pre!r}; supported: {sorted(GGUF_PRE_TOKENIZERS)}")
    return GGUF_PRE_TOKENIZERS[pre]


def _build_byte_level_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int], source: str) -> tuple[HFTokenizer, bool]:
    """GGUF `gpt2` model: GPT-2 style byte-level BPE. Returns (backend, default add_bos)."""
    spec = gguf_pre_tokenizer(metadata, source)
    raw_merges = _meta(metadata, "tokenizer.ggml.merges")
    if raw_merges is None:
        raise ValueError(f"{source}: GGUF byte-level BPE vocabulary has no tokenizer.ggml.merges")
    try:
        model = models.BPE(
            vocab=_first_index_vocab(tokens),
            merges=_parse_merges(raw_merges, source),
            ignore_merges=spec.ignore_merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    except Exception as e:  # the Rust side reports merges naming unknown tokens this way
        raise ValueError(f"{source}: inconsistent vocabulary/merges: {e}") from e
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizer(spec)
    backend.decoder = decoders.ByteLevel()
    special, user = _added_tokens_from_types(tokens, token_types, {TOKEN_CONTROL})
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend, spec.add_bos


def _merges_from_scores(tokens: list[str], scores: list[float], token_types: list[int]) -> list[tuple[str, str]]:
    """Merges equivalent to SentencePiece-BPE's scores.

    SentencePiece repeatedly joins the adjacent pair whose concatenation is the vocabulary piece
    with the highest score. `tokenizers` BPE joins the adjacent pair with the lowest merge rank.
    Listing every split (left, right) of every mergeable piece, ranked by the piece's score
    (best first), makes the two choose the same pair.
    """
    mergeable = {TOKEN_NORMAL, TOKEN_USER_DEFINED}
    pieces = {t: i for i, (t, ty) in enumerate(zip(tokens, token_types)) if ty in mergeable}
    ranked = []
    for piece, i in pieces.items():
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in pieces and right in pieces:
                ranked.append((-scores[i], i, pieces[left], (left, right)))
    ranked.sort()
    return [pair for *_, pair in ranked]


def _build_sentencepiece_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int], source: str) -> tuple[HFTokenizer, bool]:
    """GGUF `llama` model: SentencePiece BPE with byte fallback (Llama-1/2, Mistral, ...).

    Mirrors Llama-2's own tokenizer.json and llama.cpp: a normalizer that turns spaces into "▁"
    and (when `add_space_prefix`) prepends one "▁" to every stretch of text between added tokens
    -- llama.cpp adds that space at the start and after each special token, which is also how
    Llama-2 prompts were tokenized in training (each turn encoded separately). sentencepiece
    itself agrees on text without added tokens (tested); Metaspace(prepend_scheme="first") would
    not: it skips the prefix when the text already starts with a space. Then BPE with
    `byte_fallback` for characters outside the vocabulary, and a decoder that undoes all of it.
    """
    scores = _meta(metadata, "tokenizer.ggml.scores")
    raw_merges = _meta(metadata, "tokenizer.ggml.merges")
    if raw_merges is not None:
        merges = _parse_merges(raw_merges, source)
    elif scores is not None and len(scores) == len(tokens):
        merges = _merges_from_scores(tokens, scores, token_types)
    else:
        raise ValueError(f"{source}: SentencePiece vocabulary needs tokenizer.ggml.scores (one per token) or merges")
    add_space_prefix = bool(_meta(metadata, "tokenizer.ggml.add_space_prefix", True))
    unk_id = _meta_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens), source)
    try:
        model = models.BPE(
            vocab=_first_index_vocab(tokens),
            merges=merges,
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    except Exception as e:
        raise ValueError(f"{source}: inconsistent vocabulary/merges: {e}") from e
    backend = HFTokenizer(model)
    steps_in = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps_in, normalizers.Replace(" ", _SPM_SPACE)])
    steps = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # undo the prepended "▁"
    backend.decoder = decoders.Sequence(steps)
    special, user = _added_tokens_from_types(tokens, token_types, {TOKEN_CONTROL, TOKEN_UNKNOWN})
    backend.add_special_tokens(special)
    backend.add_tokens(user)
    return backend, True  # llama.cpp and transformers add BOS to SentencePiece vocabularies by default


def _build_gemma4_bpe(metadata: Mapping[str, Any], tokens: list[str], token_types: list[int], source: str) -> tuple[HFTokenizer, bool]:
    """GGUF `gemma4` model (Gemma 4: convert_hf_to_gguf.py's Gemma4Model writes no
    tokenizer.ggml.pre), as llama.cpp reads it (LLAMA_VOCAB_PRE_TYPE_GEMMA4): spaces escaped
    to "▁" and no space prefix, the text split only into runs of newlines and runs of
    anything else (`[^\n]+|[\n]+`), BPE by the file's merges over whole UTF-8 characters
    (no byte-level alphabet), a character with no token as its <0xXX> byte tokens, BOS added.
    A run of newlines that is itself a token is emitted whole (llama.cpp looks it up before
    merging): such tokens are registered as added tokens, matched before the split. (So a
    run longer than the longest newline token, 31 in Gemma's vocabulary, is taken as the
    longest tokens first, where llama.cpp merges it by BPE: the one known deviation.)"""
    raw_merges = _meta(metadata, "tokenizer.ggml.merges")
    if raw_merges is None:
        raise ValueError(f"{source}: GGUF gemma4 vocabulary has no tokenizer.ggml.merges")
    try:
        model = models.BPE(vocab=_first_index_vocab(tokens), merges=_parse_merges(raw_merges, source),
                           fuse_unk=False, byte_fallback=True)
    except Exception as e:
        raise ValueError(f"{source}: inconsistent vocabulary/merges: {e}") from e
    backend = HFTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    special, user = _added_tokens_from_types(tokens, token_types, {TOKEN_CONTROL, TOKEN_UNKNOWN})
    newline_runs = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, token_types)
                    if t and set(t) == {"\n"} and ty in (TOKEN_NORMAL, TOKEN_USER_DEFINED)]
    backend.add_special_tokens(special)
    backend.add_tokens(user + newline_runs)
    return backend, True


# --------------------------------------------------------------------------------------------
# The tokenizer
# --------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> ids for one model, plus its special tokens and chat template.

    Build with `from_gguf_metadata` or `from_hf_folder`. `encode` never relies on the backend's
    post-processor: it adds BOS (and EOS) itself, only when the model says so, so both sources
    behave the same way.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_id: int | None,
        eos_ids: Iterable[int],
        pad_id: int | None = None,
        unk_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        special_ids: Iterable[int] = (),
        chat_templates: Mapping[str, str] | None = None,
        template_tokens: Mapping[str, str | None] | None = None,
        vocab_size: int | None = None,
        source: str = "<memory>",
    ) -> None:
        self._backend = backend
        self._bos_id = bos_id
        self._eos_ids = _unique(eos_ids)
        self._pad_id = pad_id
        self._unk_id = unk_id
        self._add_bos = bool(add_bos)
        self._add_eos = bool(add_eos)
        self._vocab_size = vocab_size if vocab_size is not None else _backend_vocab_size(backend)
        self._special_ids = frozenset(i for i in (*special_ids, bos_id, *self._eos_ids, pad_id, unk_id) if i is not None)
        self._chat_templates = dict(chat_templates or {})
        self._template_tokens = {k: v for k, v in (template_tokens or {}).items() if v is not None}
        self.source = source

    # ---- constructors -----------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
        """Build from GGUF metadata (as returned by `mx.load(path, return_metadata=True)[1]`).

        `source` (usually the file path) is only used in error messages.
        """
        model_type = _meta(metadata, "tokenizer.ggml.model")
        if model_type is None:
            raise ValueError(f"{source}: GGUF metadata has no tokenizer.ggml.model; the file carries no tokenizer")
        tokens = _meta(metadata, "tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise ValueError(f"{source}: tokenizer.ggml.tokens must be a non-empty list of strings")
        token_types = _meta(metadata, "tokenizer.ggml.token_type")
        if token_types is None:
            token_types = [TOKEN_NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ValueError(
                f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )

        if model_type == "gpt2":
            backend, default_add_bos = _build_byte_level_bpe(metadata, tokens, token_types, source)
        elif model_type == "llama":
            backend, default_add_bos = _build_sentencepiece_bpe(metadata, tokens, token_types, source)
        elif model_type == "gemma4":
            backend, default_add_bos = _build_gemma4_bpe(metadata, tokens, token_types, source)
        else:
            raise NotImplementedError(
                f"{source}: tokenizer.ggml.model = {model_type!r} is not supported "
                "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece BPE, 'gemma4' BPE)"
            )

        n = len(tokens)
        id_keys = ("bos_token_id", "eos_token_id", "eot_token_id", "eom_token_id", "padding_token_id", "unknown_token_id")
        ids = {key: _meta_id(metadata, f"tokenizer.ggml.{key}", n, source) for key in id_keys}
        control = [i for i, ty in enumerate(token_types) if ty == TOKEN_CONTROL]
        templates = _gguf_chat_templates(metadata)

        def name(i: int | None) -> str | None:
            return tokens[i] if i is not None else None

        return cls(
            backend,
            bos_id=ids["bos_token_id"],
            # EOT/EOM (end of turn / of message) also end generation, as in llama.cpp.
            eos_ids=(ids["eos_token_id"], ids["eot_token_id"], ids["eom_token_id"]),
            pad_id=ids["padding_token_id"],
            unk_id=ids["unknown_token_id"],
            add_bos=bool(_meta(metadata, "tokenizer.ggml.add_bos_token", default_add_bos)),
            add_eos=bool(_meta(metadata, "tokenizer.ggml.add_eos_token", False)),
            special_ids=control,
            chat_templates=templates,
            template_tokens={
                "bos_token": name(ids["bos_token_id"]),
                "eos_token": name(ids["eos_token_id"]),
                "unk_token": name(ids["unknown_token_id"]),
                "pad_token": name(ids["padding_token_id"]),
            },
            vocab_size=n,
            source=source,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face model folder.

        Requires `tokenizer.json`. Optional: `tokenizer_config.json` (special tokens,
        add_bos_token/add_eos_token, chat_template, added_tokens_decoder), `generation_config.json`
        and `config.json` (extra `eos_token_id`s, an int or a list), `chat_template.json` and
        `chat_template.jinja` (which override the config's template, as in transformers).
        """
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: tokenizer folder does not exist")
        tokenizer_json = folder / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(
                f"{tokenizer_json}: required file is missing (only fast tokenizers with a tokenizer.json are supported)"
            )
        try:
            backend = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # tokenizers raises a bare Exception for parse errors
            raise ValueError(f"{tokenizer_json}: malformed tokenizer.json: {e}") from e

        config_path = folder / "tokenizer_config.json"
        config = _read_json(config_path, required=False) or {}
        _add_declared_tokens(backend, config.get("added_tokens_decoder"), config_path)
        vocab_size = _backend_vocab_size(backend)

        def token_id(field: str) -> tuple[str | None, int | None]:
            content = _token_content(config.get(field), config_path, field)
            if content is None:
                return None, None
            tid = backend.token_to_id(content)
            if tid is None:
                raise ValueError(f"{config_path}: {field} {content!r} is not in {tokenizer_json.name}'s vocabulary")
            return content, tid

        bos, bos_id = token_id("bos_token")
        eos, eos_id = token_id("eos_token")
        unk, unk_id = token_id("unk_token")
        pad, pad_id = token_id("pad_token")
        extra_tokens = {f: token_id(f)[0] for f in ("sep_token", "cls_token", "mask_token")}

        gen_path = folder / "generation_config.json"
        gen = _read_json(gen_path, required=False) or {}
        model_path = folder / "config.json"
        model_config = _read_json(model_path, required=False) or {}
        eos_ids = [
            eos_id,
            *_config_ids(gen.get("eos_token_id"), gen_path, "eos_token_id", vocab_size),
            *_config_ids(model_config.get("eos_token_id"), model_path, "eos_token_id", vocab_size),
        ]
        if pad_id is None:
            pad_ids = _config_ids(gen.get("pad_token_id"), gen_path, "pad_token_id", vocab_size)
            pad_id = pad_ids[0] if pad_ids else None

        probe_bos, probe_eos = _post_processor_adds(backend, bos_id, eos_id)
        add_bos = config.get("add_bos_token", probe_bos)
        add_eos = config.get("add_eos_token", probe_eos)
        for field, value in (("add_bos_token", add_bos), ("add_eos_token", add_eos)):
            if not isinstance(value, bool):
                raise ValueError(f"{config_path}: {field} must be true or false, got {value!r}")

        special = [i for i, tok in backend.get_added_tokens_decoder().items() if tok.special]
        return cls(
            backend,
            bos_id=bos_id,
            eos_ids=eos_ids,
            pad_id=pad_id,
            unk_id=unk_id,
            add_bos=add_bos,
            add_eos=add_eos,
            special_ids=special,
            chat_templates=_read_chat_templates(folder, config, config_path),
            template_tokens={"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad, **extra_tokens},
            vocab_size=vocab_size,
            source=str(folder),
        )

    # ---- properties -------------------------------------------------------------------------

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (read it, do not mutate it)."""
        return self._backend

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends generation; the first is the model's primary EOS."""
        return self._eos_ids

    @property
    def pad_id(self) -> int | None:
        return self._pad_id

    @property
    def unk_id(self) -> int | None:
        return self._unk_id

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def vocab_size(self) -> int:
        """One past the largest token id the tokenizer knows."""
        return self._vocab_size

    @property
    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def max_token_bytes(self) -> int:
        """An upper bound on the UTF-8 bytes of text one token stands for: the longest
        token decoded alone, + 1 (a SentencePiece decoder drops a lone token's leading
        space). Text of B bytes is at least B / max_token_bytes tokens. Computed once."""
        if not hasattr(self, "_max_token_bytes"):
            decoded = self._backend.decode_batch([[i] for i in range(self._vocab_size)],
                                                 skip_special_tokens=False)
            self._max_token_bytes = 1 + max([0] + [len(t.encode("utf-8", "replace"))
                                                   for t in decoded])
        return self._max_token_bytes

    @property
    def chat_template(self) -> str | None:
        """The model's default chat template, None when it ships none."""
        return self._chat_templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """All named templates (e.g. 'default', 'tool_use')."""
        return dict(self._chat_templates)

    @property
    def template_tokens(self) -> dict[str, str]:
        """Special-token strings the chat template sees (bos_token, eos_token, ...)."""
        return dict(self._template_tokens)

    # ---- text <-> ids -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special-token strings in the text become their ids.

        With `add_special_tokens`, BOS is prepended only if the model asks for it (add_bos_token),
        EOS appended only if it asks for that (rare).
        """
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        if len(text) > 1024:  # the batch form releases the GIL (same ids): a long text
            ids = self._backend.encode_batch([text], add_special_tokens=False)[0].ids
        else:                 # does not stall the server's event loop or engine thread
            ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self._add_bos and self._bos_id is not None:
                ids.insert(0, self._bos_id)
            if self._add_eos and self._eos_ids:
                ids.append(self._eos_ids[0])
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text for `ids`; bytes that do not form valid UTF-8 become U+FFFD."""
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self._vocab_size):
            bad = next(i for i in ids if not 0 <= i < self._vocab_size)
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self._vocab_size})")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def _stream_probes(self) -> tuple[int, ...] | None:
        # Computed once per tokenizer: every detokenizer of a server's requests needs them.
        if not hasattr(self, "_probes"):
            self._probes = _continuation_probes(self._backend)
        return self._probes

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        """A fresh streaming detokenizer for one generated sequence."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---- chat -------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Any = None,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's template; ids when `tokenize`, else the prompt text.

        Same semantics as transformers' `apply_chat_template`: the template gets the special
        token strings plus `template_kwargs`, the 'tool_use' variant is preferred when tools are
        given, and the rendered text is tokenized without adding BOS (templates write it
        themselves). A model without a template gets plain ChatML (`chat_template.DEFAULT_CHATML_TEMPLATE`).
        """
        template = chat_template  # an explicit template (e.g. the server's --chat-template) wins
        if template is None and tools is not None:
            template = self._chat_templates.get("tool_use")
        if template is None:
            template = self.chat_template
        text = _chat.render_chat_template(
            messages,
            template,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._template_tokens,
            **template_kwargs,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text

    # ---- identity ---------------------------------------------------------------------------

    def fingerprint(self) -> str:
        """sha256 over the backend's JSON serialization, the templates and the BOS/EOS settings.

        Two tokenizers with equal fingerprints produce identical ids and prompts, so caches keyed
        on prompts (e.g. a prefix cache on disk) can be keyed on this.
        """
        h = hashlib.sha256()
        h.update(self._backend.to_str().encode("utf-8"))
        settings = {
            "templates": self._chat_templates,
            "template_tokens": self._template_tokens,
            "bos_id": self._bos_id,
            "eos_ids": list(self._eos_ids),
            "add_bos": self._add_bos,
            "add_eos": self._add_eos,
        }
        h.update(b"\0" + json.dumps(settings, sort_keys=True).encode("utf-8"))
        return h.hexdigest()

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self._vocab_size}, bos_id={self._bos_id}, "
            f"eos_ids={self._eos_ids}, add_bos={self._add_bos})"
        )


def _backend_vocab_size(backend: HFTokenizer) -> int:
    # Max id + 1 rather than the entry count: a vocabulary may have holes.
    vocab = backend.get_vocab(with_added_tokens=True)
    return max(vocab.values()) + 1 if vocab else 0


def _post_processor_adds(backend: HFTokenizer, bos_id: int | None, eos_id: int | None) -> tuple[bool, bool]:
    """Whether tokenizer.json's post-processor adds BOS / EOS (used when the config is silent).

    We encode with the post-processor disabled and add the tokens ourselves, so this recovers
    the model's intent from the post-processor's template.
    """
    probe = backend.encode("a", add_special_tokens=True).ids
    plain = backend.encode("a", add_special_tokens=False).ids
    adds_bos = bos_id is not None and len(probe) > len(plain) and probe[0] == bos_id
    adds_eos = eos_id is not None and len(probe) > len(plain) and probe[-1] == eos_id
    return adds_bos, adds_eos


def _add_declared_tokens(backend: HFTokenizer, declared: Any, path: Path) -> None:
    """Add tokens that tokenizer_config.json's added_tokens_decoder declares but tokenizer.json lacks."""
    if declared is None:
        return
    if not isinstance(declared, Mapping):
        raise ValueError(f"{path}: added_tokens_decoder must be an object mapping ids to tokens")
    for key, entry in sorted(declared.items(), key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else -1):
        if not str(key).isdigit() or not isinstance(entry, Mapping) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] must map an id to an object with 'content'")
        content, want = entry["content"], int(key)
        have = backend.token_to_id(content)
        if have is None:
            token = AddedToken(content, special=bool(entry.get("special", False)), normalized=bool(entry.get("normalized", False)))
            (backend.add_special_tokens if token.special else backend.add_tokens)([token])
            have = backend.token_to_id(content)
        if have != want:
            raise ValueError(f"{path}: added_tokens_decoder says {content!r} is id {want}, tokenizer.json has {have}")


def _read_chat_templates(folder: Path, config: Mapping[str, Any], config_path: Path) -> dict[str, str]:
    """Named chat templates; later sources override earlier ones, as in transformers.

    tokenizer_config.json's `chat_template` (a string or a list of {name, template}) <
    chat_template.json's `chat_template` < chat_template.jinja.
    """
    templates: dict[str, str] = {}

    def take(value: Any, path: Path) -> None:
        if value is None:
            return
        if isinstance(value, str):
            templates["default"] = value
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if not (isinstance(item, Mapping) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                    raise ValueError(f"{path}: chat_template[{i}] must be an object with string 'name' and 'template'")
                templates[item["name"]] = item["template"]
            return
        raise ValueError(f"{path}: chat_template must be a string or a list of named templates, got {type(value).__name__}")

    take(config.get("chat_template"), config_path)
    json_path = folder / "chat_template.json"
    json_config = _read_json(json_path, required=False)
    if json_config is not None:
        take(json_config.get("chat_template"), json_path)
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            templates["default"] = jinja_path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{jinja_path}: not valid UTF-8: {e}") from e
    return templates


# --------------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------------


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte in byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = chr(256 + extra)
            extra += 1
    return spelled


def _continuation_probes(backend: HFTokenizer) -> tuple[int, ...] | None:
    """Ids of the single-byte tokens 0x80 and 0xBF, if the decoder is a lossy UTF-8 decoder.

    With such a decoder (byte-level BPE) an incomplete trailing sequence shows as exactly one
    U+FFFD, and appending a continuation byte either extends it (text unchanged or completed)
    or, when the end is clean, adds one more U+FFFD; 0x80 and 0xBF together are valid second
    bytes after every lead byte. SentencePiece's ByteFallback instead gives one U+FFFD per byte
    of a broken sequence (an incomplete one included), so the probe cannot tell there: None.
    """
    alphabet = _byte_level_alphabet()

    def byte_token(b: int) -> int | None:
        for spelling in (alphabet[b], f"<0x{b:02X}>"):
            i = backend.token_to_id(spelling)
            if i is not None and backend.decode([i]) == _REPLACEMENT_CHAR:
                return i
        return None

    c80, cbf, e2 = byte_token(0x80), byte_token(0xBF), byte_token(0xE2)
    if c80 is None or cbf is None or e2 is None:
        return None
    if backend.decode([e2, c80]) != _REPLACEMENT_CHAR:  # E2 80 is an incomplete 3-byte sequence
        return None
    return (c80, cbf)


class StreamingDetokenizer:
    """Turn generated ids into text deltas, one `add` per token, plus a final `finalize`.

    Invariant: the concatenation of every delta and `finalize()` equals
    `tokenizer.decode(all_ids, skip_special_tokens)`, and every delta is the corresponding slice
    of that full decode, so no delta ever carries a U+FFFD that the full text lacks there.

    How: we decode a sliding window of ids. `window[:read]` was already emitted and is kept only
    as left context (a SentencePiece decoder strips the leading space of the first token it sees,
    so the token before the new ones must be present to decode them the same way as in the full
    sequence). New text is emitted when the window's text no longer ends with U+FFFD, i.e. when
    the bytes decoded so far do not end in the middle of a multi-byte UTF-8 character; the window
    then slides so that only the just-emitted tokens remain as context. Each token is decoded a
    bounded number of times, so the cost is O(1) amortized per token.

    Exactness holds for byte-level BPE. With SentencePiece byte fallback it holds whenever each
    run of byte tokens (`<0xNN>`) is valid UTF-8 (all text from `encode`, all well-formed output);
    tokenizers' ByteFallback decoder turns a whole run into U+FFFDs as soon as one byte of it is
    invalid, so a stream that already showed the run's valid characters then differs from
    `decode` (it has shown them already). Holding every byte run until it
    closes would avoid that but stall streaming of CJK text, which such models spell in bytes.

    A genuine U+FFFD at the end (the model produced the replacement character, or invalid bytes)
    would hold the window open forever; after `max_hold` held tokens we therefore check whether
    it is final. For lossy UTF-8 decoders (byte-level BPE) we append a lone continuation byte:
    it adds one more U+FFFD exactly when no character is pending. Otherwise (ByteFallback) we
    check whether the newest token starts a fresh character (its own text starts with a real
    character, and decoding the window in two halves gives the same text as decoding it whole,
    which is false while a character is split between the halves) and if so emit everything
    before it.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False, max_hold: int = 4) -> None:
        self._tokenizer = tokenizer
        self._decode_backend = tokenizer.backend.decode
        self._probes = tokenizer._stream_probes()
        self._vocab_size = tokenizer.vocab_size
        self._skip = skip_special_tokens
        self._max_hold = max(1, int(max_hold))
        self._window: list[int] = []
        self._read = 0  # window[:read] is already emitted (context only)
        self._prefix_text = ""  # decode(window[:read])
        self._finalized = False
        self.token_count = 0

    def _decode(self, ids: list[int]) -> str:
        return self._decode_backend(ids, skip_special_tokens=self._skip)

    def _slide(self, cut: int) -> None:
        # window[:cut] is now emitted; keep window[read:cut] as the context of what follows.
        self._window = self._window[self._read :]
        self._read = cut - self._read
        self._prefix_text = self._decode(self._window[: self._read])

    def add(self, token_id: int) -> str:
        """Feed one generated id; return the text it completes (often "", never a broken char)."""
        if self._finalized:
            raise RuntimeError("StreamingDetokenizer.add after finalize(); use a new detokenizer")
        token_id = int(token_id)
        if not 0 <= token_id < self._vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})")
        self.token_count += 1
        self._window.append(token_id)
        text = self._decode(self._window)
        if text == self._prefix_text:
            # The unemitted tokens add no text (e.g. skipped special tokens). Dropping them keeps
            # the window from growing during long runs of such tokens, but only when the context
            # has text of its own: a SentencePiece "▁" decodes to "" when it is the first token
            # (its space is stripped) yet to " " after others, so it must stay.
            if self._prefix_text:
                del self._window[self._read :]
            return ""
        if text.endswith(_REPLACEMENT_CHAR):
            return self._maybe_emit_held(text)
        if len(text) <= len(self._prefix_text):
            return ""
        delta = text[len(self._prefix_text) :]
        self._slide(len(self._window))
        return delta

    def _maybe_emit_held(self, text: str) -> str:
        """Text ends with U+FFFD: hold it, unless the hold has lasted `max_hold` tokens and the
        U+FFFD provably is final (see the class docstring)."""
        cut = len(self._window) - 1
        if cut - self._read < self._max_hold:
            return ""
        if self._probes is not None:
            # Lossy UTF-8 decoder: the end is clean iff a continuation byte cannot extend it.
            if all(self._decode(self._window + [p]) == text + _REPLACEMENT_CHAR for p in self._probes):
                delta = text[len(self._prefix_text) :]
                self._slide(len(self._window))
                return delta
            return ""
        head = self._decode(self._window[:cut])
        tail = self._decode(self._window[cut:])
        # The newest token must begin with a whole character (its own text does not start with
        # U+FFFD, so its first byte is not a continuation byte) and splitting there must not
        # change the text (no character spans the cut). The first test is needed because
        # SentencePiece's ByteFallback turns every byte of a broken sequence into its own U+FFFD,
        # so a split in the middle of a character can leave the text unchanged.
        if not tail or tail[0] == _REPLACEMENT_CHAR or head + tail != text:
            return ""
        if len(head) < len(self._prefix_text):
            return ""
        delta = head[len(self._prefix_text) :]
        self._slide(cut)
        return delta

    def finalize(self) -> str:
        """Flush whatever is held (an incomplete trailing character becomes U+FFFD, exactly as
        in the full decode). The detokenizer cannot be fed afterwards."""
        if self._finalized:
            return ""
        self._finalized = True
        text = self._decode(self._window)
        delta = text[len(self._prefix_text) :]
        self._window, self._read, self._prefix_text = [], 0, ""
        return delta
