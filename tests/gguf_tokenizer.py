"""Test helpers: a tiny model folder's byte-level BPE tokenizer as GGUF metadata
(`add_tokenizer`: fx_engine.testing.gguf's, as llama.cpp's converter writes it), and the
mlx-lm oracle folder of what a GGUF holds."""

from pathlib import Path

from fx_engine.testing.gguf import add_bpe_tokenizer as add_tokenizer

__all__ = ["add_tokenizer", "write_oracle"]


def write_oracle(folder: Path, out: Path, weights: dict) -> Path:
    """An HF folder at `out` with `folder`'s config and tokenizer and the given weights
    (numpy arrays: what a GGUF written from `folder` holds, dequantized), for mlx-lm."""
    import mlx.core as mx

    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    return out
