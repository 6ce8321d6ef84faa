"""`fx_engine.load`: a model = config + params pytree + tokenizer (+ where it came from)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import attrs
import mlx.core as mx

from .config import ModelConfig
from .loading.default_model import default_model_path
from .loading.weights import WeightsError, load_gguf, load_hf_folder
from .models.llama import Params
from .nn import Numerics
from .tree import tree_leaves


@attrs.frozen
class Model:
    config: ModelConfig
    params: Params
    tokenizer: Any
    path: str
    fingerprint: str
    weight_format: str  # e.g. "gguf (Q4_1/Q8_0) -> float32"

    @property
    def eos_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_ids)
        return tuple(sorted(ids))

    def with_numerics(self, numerics: Numerics) -> "Model":
        return attrs.evolve(self, params=attrs.evolve(self.params, numerics=numerics))


def model_fingerprint(meta: list[str], files: list[Path]) -> str:
    """Identify a model by its source (config + weight files), not its in-memory layout.

    Hashes the config text and, per file, its size and three 1 MiB samples (head, middle,
    tail): cheap for multi-GB checkpoints, and any re-quantization or other checkpoint
    changes it.
    """
    h = hashlib.sha256("|".join(meta).encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            for offset in (0, max(0, size // 2 - (1 << 19)), max(0, size - (1 << 20))):
                fh.seek(offset)
                h.update(fh.read(1 << 20))
    return h.hexdigest()[:16]


def _on_cpu() -> bool:
    return mx.default_device() == mx.cpu


def load(
    path: str | Path | None = None,
    *,
    dtype: str | None = None,
    keep_quantized: bool | None = None,
    batch_invariant: bool = False,
) -> Model:
    """Load a model from a GGUF file or a Hugging Face style folder (None: the default model).

    dtype: activation/weight dtype ("float32", "float16", "bfloat16"); default float32 on
    CPU (MLX's CPU f16/bf16 math is 10-60x slower) and the stored dtype elsewhere.
    keep_quantized: keep quantized tensors quantized (default: not on CPU, where MLX's
    quantized matmul is a naive kernel and dequantized float32 through BLAS is ~10x faster;
    yes on GPU). batch_invariant: fixed-tile matmuls (see fx_engine.nn.Numerics).
    """
    from .loading.tokenizer import Tokenizer

    p = Path(path) if path is not None else default_model_path()
    if not p.exists():
        raise FileNotFoundError(f"model path does not exist: {p}")
    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
    if keep_quantized is None:
        keep_quantized = not _on_cpu()
    mx_dtype = getattr(mx, dtype) if dtype else (mx.float32 if _on_cpu() else None)
    numerics = Numerics(batch_invariant=batch_invariant)
    if p.is_file():
        if p.suffix.lower() != ".gguf":
            raise WeightsError(f"{p}: unsupported model file (expected a .gguf file or a folder)")
        cfg, params, metadata = load_gguf(p, mx_dtype or mx.float16, keep_quantized, numerics)
        tokenizer = Tokenizer.from_gguf_metadata(metadata, source=str(p))
        fmt = "gguf"
        fp_src = [str(p.stat().st_size), json.dumps(attrs.asdict(cfg), default=str)]
    else:
        cfg, params, raw = load_hf_folder(p, mx_dtype, keep_quantized, numerics)
        tokenizer = Tokenizer.from_hf_folder(p)
        fmt = "mlx-quantized" if raw.get("quantization") else "safetensors"
        fp_src = [json.dumps(raw, sort_keys=True)] + [
            f"{f.name}:{f.stat().st_size}" for f in sorted(p.glob("*.safetensors"))
        ]
    mx.eval(tree_leaves(params))
    files = [p] if p.is_file() else sorted(p.glob("*.safetensors"))
    fingerprint = model_fingerprint(fp_src, files)
    quant_kinds = "quantized" if keep_quantized else str(params.dtype)
    return Model(
        config=cfg, params=params, tokenizer=tokenizer, path=str(p),
        fingerprint=fingerprint, weight_format=f"{fmt} -> {quant_kinds}",
    )
