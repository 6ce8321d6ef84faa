"""Test helper: a tiny model folder's byte-level BPE tokenizer as GGUF metadata ("gpt2"
model: tokens by id, merges, control tokens), as llama.cpp's converter writes it."""

import json
from pathlib import Path


def add_tokenizer(writer, folder: Path, eos_id: int) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"]}
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [t for t, _ in vocab])
    writer.add_array("tokenizer.ggml.token_type", [3 if t in specials else 1 for t, _ in vocab])
    writer.add_array("tokenizer.ggml.merges",
                     [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_uint32("tokenizer.ggml.eos_token_id", eos_id)


def write_oracle(folder: Path, out: Path, weights: dict) -> Path:
    """An HF folder at `out` with `folder`'s config and tokenizer and the given weights
    (numpy arrays: what a GGUF written from `folder` holds, dequantized), for mlx-lm."""
    import mlx.core as mx

    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    return out
