"""FP8 checkpoints in blocks (Hugging Face's `quant_method: "fp8"`, the "fine-grained FP8" of
DeepSeek-V3 / R1, their NextN exports, Qwen3-*-FP8, Qwen3-Next-FP8, GLM-4.5-FP8, MiniMax):
each quantized linear stores its weight as float8 e4m3 bytes and `weight_scale_inv`, one
float per block of `weight_block_size` = [rows, columns] (the last block of a side may be
partial), the weight being e4m3(w) * scale_inv of its block.

    blocks = fp8_blocks(raw_config, where)        # (rows, columns), or None: not an FP8 checkpoint
    tensors = dequantize_fp8(tensors, blocks, dtype, where)

The weights are dequantized once, at load, to the model's dtype (bfloat16 unless asked):
MLX's CPU kernels multiply no float8, and the values are the checkpoint's own (an e4m3
byte times its block's scale is exact in float32; the rounding is the final cast's). So
the loaded model takes twice the file's memory for those matrices, as mlx-lm's loaders of
these checkpoints do. The activations are not quantized: `activation_scheme: "dynamic"`
is a kernel's choice at run time (vLLM quantizes them on FP8 hardware only); a "static"
scheme, whose checkpoint pins activation scales, is refused by name, as are other float8
formats (e5m2) and per-tensor schemes (other quant_method values, `weights.mlx_quantization`).
"""

from __future__ import annotations

from typing import Any, Mapping

import mlx.core as mx

from fx_engine.core.checkpoint import TensorSource, WeightsError
from fx_engine.core.config import ConfigError

__all__ = ["dequantize_fp8", "dequantize_fp8_source", "fp8_blocks", "is_fp8_scale"]

SCALE = "_scale_inv"  # X.weight's scales: X.weight_scale_inv


def is_fp8_scale(name: str) -> bool:
    """Whether a tensor name is an FP8 weight's block scales (not a model tensor: its
    dtype says nothing of the model's)."""
    return name.endswith(SCALE)


def fp8_blocks(raw: Mapping[str, Any], where: Any) -> tuple[int, int] | None:
    """config.json's FP8 block size (rows, columns) when its quantization_config is
    Hugging Face's fine-grained FP8 (quant_method "fp8"), else None. A field this loader
    does not run (fmt other than e4m3, a static activation scheme, no or a malformed
    weight_block_size) is a ConfigError naming it."""
    quant = raw.get("quantization_config")
    if not isinstance(quant, Mapping) and isinstance(raw.get("text_config"), Mapping):
        quant = raw["text_config"].get("quantization_config")
    if not isinstance(quant, Mapping) or quant.get("quant_method") != "fp8":
        return None
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt {fmt!r}: only float8 e4m3 weights are read")
    scheme = quant.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme {scheme!r}: only 'dynamic' is read "
                          "(a static scheme's activation scales are not applied here)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block!r}: expected two positive "
                          "integers (rows, columns), e.g. [128, 128]")
    return int(block[0]), int(block[1])


def dequantize_block_fp8(weight: mx.array, scale_inv: mx.array, block: tuple[int, int],
                         dtype: mx.Dtype) -> mx.array:
    """weight [..., R, C] (e4m3 bytes as uint8) times its blocks' scales scale_inv
    [..., ceil(R / r), ceil(C / c)] (each scale repeated over its r x c block, the edge
    blocks cut), in `dtype`."""
    r, c = block
    rows, cols = weight.shape[-2:]
    lead = tuple(weight.shape[:-2])
    pr, pc = -rows % r, -cols % c  # (edge blocks padded, then cut: the scales broadcast, never repeated)
    w = mx.from_fp8(weight, dtype=mx.float32)
    if pr or pc:
        w = mx.pad(w, [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
    w = w.reshape(*lead, (rows + pr) // r, r, (cols + pc) // c, c) * scale_inv.astype(mx.float32)[..., None, :, None]
    return w.reshape(*lead, rows + pr, cols + pc)[..., :rows, :cols].astype(dtype)


def dequantize_fp8(tensors: Mapping[str, mx.array], block: tuple[int, int], dtype: mx.Dtype,
                   where: Any, origin: Mapping[str, Any] | None = None) -> dict[str, mx.array]:
    """`tensors` with every FP8 weight (a `X.weight` beside its `X.weight_scale_inv`)
    dequantized to `dtype` and the scales dropped; the others as they are (lazily: nothing
    is computed here). A scale without its weight, a weight that is not one byte an
    element, or scales of the wrong shape are a WeightsError naming the tensor (and its
    file, `origin`: name -> file)."""
    def at(name: str) -> str:
        return str((origin or {}).get(name, where))

    out: dict[str, mx.array] = {}
    r, c = block
    for name, t in tensors.items():
        if name.endswith(SCALE):
            base = name[: -len(SCALE)]
            if base not in tensors:
                raise WeightsError(f"{at(name)}: FP8 scales '{name}' without their weight '{base}'")
            continue
        scale = tensors.get(name + SCALE)
        if scale is None:
            out[name] = t
            continue
        if t.dtype not in (mx.uint8, mx.int8) or t.ndim < 2:
            raise WeightsError(f"{at(name)}: tensor '{name}' has FP8 scales but is stored as {t.dtype} "
                               f"{tuple(t.shape)}, not float8 bytes")
        rows, cols = t.shape[-2:]
        want = (*t.shape[:-2], -(-rows // r), -(-cols // c))
        if tuple(scale.shape) != want:
            raise WeightsError(f"{at(name + SCALE)}: tensor '{name + SCALE}' has shape {tuple(scale.shape)}, "
                               f"expected {want} (blocks of {r} x {c} over {tuple(t.shape)})")
        out[name] = dequantize_block_fp8(t.view(mx.uint8), scale, block, dtype)
    return out


def dequantize_fp8_source(src: TensorSource, block: tuple[int, int], dtype: mx.Dtype, where: Any) -> TensorSource:
    """`dequantize_fp8` over a TensorSource (the files' tensors, each remembering its file:
    a weight and its scales may sit in different shards)."""
    out = TensorSource()
    for name, t in dequantize_fp8(src.tensors, block, dtype, where, src.origin).items():
        out.tensors[name] = t
        out.origin[name] = src.origin[name]
    return out
