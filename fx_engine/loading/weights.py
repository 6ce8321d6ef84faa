"""Read checkpoint files into the pure core's params pytrees: GGUF, Hugging Face safetensors
folders, MLX-quantized (mlx-community) folders.

The shell side: files in, a `TensorSource` out (name -> array, and the file each came
from); the model's family (the registry in fx_engine.core.models, chosen by config.json's
model_type or GGUF's general.architecture) turns it into its params with its own
`assemble`. Every error names the file and, where there is one, the tensor.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.core.checkpoint import KeepQuantized, LoadOptions, TensorSource, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.models import config_from_hf, gguf_family, hf_family
from fx_engine.core.nn import Numerics
from fx_engine.loading.fp8 import dequantize_fp8_source, fp8_blocks, is_fp8_scale

__all__ = ["KeepQuantized", "WeightsError", "gguf_read_options", "index_shards", "load_gguf", "load_hf_folder",
           "read_hf_config", "read_json_object", "read_weight_map"]



def mlx_quantization(raw: dict[str, Any], where: str | Path) -> dict[str, Any] | None:
    """config.json's quantization as the loaders read it: MLX's affine groups
    (`quantization` or `quantization_config` with group_size and bits), or None. Other
    schemes (AWQ, GPTQ, compressed-tensors, bitsandbytes, per-tensor FP8) are refused
    naming their quant_method; Hugging Face's FP8 blocks (quant_method "fp8": DeepSeek-V3's,
    Qwen3-*-FP8's originals) give None here: `loading.fp8` dequantizes them as they are read."""
    quant = raw.get("quantization") or raw.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise ConfigError(f"{where}: quantization is {quant!r}, not an object")
    method = quant.get("quant_method")
    if method == "fp8":
        fp8_blocks(raw, where)  # (its fields checked here too: a ConfigError naming one it cannot run)
        return None
    if method not in (None, "mlx", "affine"):  # (AWQ and GPTQ say bits and group_size too)
        raise ConfigError(f"{where}: quantization_config.quant_method {method!r} is not read (fx-engine reads "
                          "MLX's affine groups and GGUF files): use the checkpoint's BF16 copy or a conversion")
    if "group_size" not in quant or "bits" not in quant:
        raise ConfigError(f"{where}: quantization needs group_size and bits")
    return quant

def read_weight_map(index: Path) -> dict[str, str]:
    """A sharded checkpoint's index (model.safetensors.index.json, pytorch_model.bin.index.json)
    as tensor name -> shard file; a malformed one is a WeightsError naming it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"weight_map is {type(weight_map).__name__}, not an object")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{index}: malformed index ({e})") from e
    return weight_map


def index_shards(index: Path) -> list[str]:
    """The shard files an index names (sorted), every one present beside it; missing ones are
    a WeightsError naming them."""
    names = sorted(set(read_weight_map(index).values()))
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise WeightsError(f"{index}: shard files missing: {', '.join(missing)}")
    return names


def _mx_load(path: Path, **kw: Any) -> Any:
    try:
        return mx.load(str(path), **kw)
    except Exception as e:  # mlx raises RuntimeError/ValueError with terse messages
        raise WeightsError(f"{path}: cannot read weights ({e}); is the file truncated or corrupt?") from e


def gguf_read_options(dtype: mx.Dtype, keep_quantized: KeepQuantized, numerics: Numerics) -> tuple[Any, bool]:
    """(store_bits, compact) for `read_gguf`, as a model's load reads its GGUF: the widths
    the kernels run and the scales' form they decode."""
    store_bits = None
    if callable(keep_quantized):
        # widths the kernels do not run (Q2_K, Q3_K), widened while reading (numpy, one
        # pass) to the narrowest they do (5 bits in groups of 16); not embedding tables that
        # are only looked up (a lookup dequantizes its rows: kept as stored), unless the
        # table is also the head
        def store_bits(name: str, group: int, bits: int, head: bool) -> int:
            if ("token_embd" in name and not head) or bits >= 8 or keep_quantized(group, bits):
                return bits
            return next((w for w in (5, 6, 8) if w > bits and keep_quantized(group, w)), bits)

    # with the native kernels (float32), scales and biases in the compact forms they decode
    # themselves: K-quants two-level as the file stores them, legacy types as halves
    compact = callable(keep_quantized) and numerics.native and dtype == mx.float32
    return store_bits, bool(compact)


def load_gguf(
    path: Path, dtype: mx.Dtype, keep_quantized: KeepQuantized, numerics: Numerics,
    spill: Path | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    from fx_engine.loading.gguf import read_gguf  # llama.cpp's reader, K-quants included

    store_bits, compact = gguf_read_options(dtype, keep_quantized, numerics)
    tensors, metadata = read_gguf(path, store_bits, compact, spill)
    family = gguf_family(metadata, str(path))
    cfg = family.config_from_gguf(metadata, str(path))
    src = TensorSource()
    src.add(path, tensors)
    opts = LoadOptions(dtype=dtype, keep_quantized=keep_quantized, numerics=numerics, where=str(path))
    params = family.assemble_gguf(cfg, src, opts)
    return params.config, params, metadata


def read_json_object(folder: str | Path, name: str = "config.json",
                     missing: str = "is this a Hugging Face model folder?") -> tuple[dict[str, Any], Path]:
    """A folder's JSON file as a dict (and its path); a missing file, bad JSON or another
    kind of value is a ConfigError naming the file."""
    path = Path(folder) / name
    if not path.exists():
        raise ConfigError(f"{folder}: no {name} ({missing})")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: invalid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return raw, path


def read_hf_config(folder: Path) -> tuple[Any, dict[str, Any]]:
    raw, path = read_json_object(folder)
    return config_from_hf(raw, str(path)), raw


_TEXT_PREFIXES = (  # multimodal checkpoints: where the text model's tensors live
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("language_model.model.", "model."),  # earlier transformers, mlx-community
    ("language_model.lm_head.", "lm_head."),
    ("model.text_model.", "model."),  # Idefics3 / SmolVLM (Hugging Face)
    ("language_model.", "model."),  # Idefics3 / SmolVLM (mlx-vlm's conversions: no inner .model)
    # Qwen2(.5)-VL before transformers 4.52: the text model's own names beside visual.*
    ("model.embed_tokens.", "model.embed_tokens."), ("model.layers.", "model.layers."), ("model.norm.", "model.norm."),
)


def _text_model_tensors(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """The text model's tensors of a multimodal checkpoint, under text-model names (vision
    and audio towers and projectors are dropped)."""
    out = {}
    for name, t in tensors.items():
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                out[new + name[len(old):]] = t
                break
        else:
            if name.startswith("lm_head."):
                out[name] = t
    return out


def load_hf_folder(
    folder: Path, dtype: mx.Dtype | None, keep_quantized: KeepQuantized, numerics: Numerics
) -> tuple[Any, Any, dict[str, Any]]:
    cfg, raw = read_hf_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder}: no *.safetensors files")
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index_shards(index)
    src = TensorSource()
    stored_dtype = None
    wrapper = raw.get("model_type") in hf_family(raw, str(folder / "config.json")).wrappers
    for f in files:
        tensors = _mx_load(f)
        if wrapper:
            tensors = _text_model_tensors(tensors)
        src.add(f, tensors)
        for name, t in tensors.items():
            if t.dtype in (mx.float16, mx.bfloat16, mx.float32) and not is_fp8_scale(name):
                stored_dtype = stored_dtype or t.dtype
    quant = mlx_quantization(raw, folder / "config.json")
    blocks = fp8_blocks(raw, folder / "config.json")
    dtype = dtype or stored_dtype or (mx.float32 if blocks is None else mx.bfloat16)
    if blocks is not None:  # (to the model's dtype: bfloat16, as stored beside them, unless asked)
        src = dequantize_fp8_source(src, blocks, dtype, folder)
    opts = LoadOptions(dtype=dtype, keep_quantized=keep_quantized,
                       numerics=numerics, quant=quant, where=str(folder))
    params = hf_family(raw).assemble(cfg, src, opts)
    return params.config, params, raw
