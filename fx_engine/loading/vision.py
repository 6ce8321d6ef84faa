"""Shell-side loading of a multimodal checkpoint's image path (issue 46): config.json's
vision part and the vision tower's / projector's tensors of a Hugging Face or
mlx-community folder, into the pure core's params (fx_engine/core/vision/).

`fx_engine.load` reads the text model of the same folder (dropping these tensors from it)
and this image path onto `Model.vision` (with the folder's preprocessing rules on
`Model.image_processor`); `fx_engine.generate(model, messages_with_images)`
(engine/image_prompt.py) encodes the images and prefills the text model with their rows
(`core.vision.splice.ImageInput`). Gemma 3 (`gemma3`), Idefics3 / SmolVLM (`idefics3`,
`smolvlm`), Qwen2.5-VL / Qwen2-VL (`qwen2_5_vl`, `qwen2_vl`) and Qwen3-VL (`qwen3_vl`):
`core.vision.VISION_MODULES`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from fx_engine.core.checkpoint import KeepQuantized, LoadOptions, TensorSource, WeightsError
from fx_engine.core.nn import Numerics
from fx_engine.core.vision import vision_module
from fx_engine.loading.fp8 import dequantize_fp8_source, fp8_blocks, is_fp8_scale
from fx_engine.loading.weights import mlx_quantization, read_json_object


def read_config(folder: str | Path) -> tuple[Any, dict[str, Any]]:
    """(the image path's config, config.json as a dict) of a model folder."""
    raw, path = read_json_object(folder)
    return vision_module(raw, str(path)).config_from_hf(raw, str(path)), raw


def load_vision(folder: str | Path, dtype: mx.Dtype | None = None, keep_quantized: KeepQuantized = False,
                numerics: Numerics | None = None) -> Any:
    """The image path's params of a model folder (its safetensors files' vision tensors
    only). dtype: the activations' (None: the tensors' float dtype, else float32);
    keep_quantized: as for the text model (quantized vision linears stay packed where it
    says so, else are dequantized)."""
    folder = Path(folder)
    cfg, raw = read_config(folder)
    module = vision_module(raw)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{folder}: no *.safetensors files")
    src = TensorSource()
    stored = None
    for f in files:
        tensors = {n: t for n, t in mx.load(str(f)).items() if module.is_vision_tensor(n)}
        src.add(f, tensors)
        stored = stored or next((t.dtype for n, t in tensors.items()
                                 if t.dtype in (mx.float32, mx.float16, mx.bfloat16) and not is_fp8_scale(n)), None)
    quant = mlx_quantization(raw, folder / "config.json")
    blocks = fp8_blocks(raw, folder / "config.json")
    if blocks is not None:
        src = dequantize_fp8_source(src, blocks, dtype or stored or mx.bfloat16, folder)
    opts = LoadOptions(dtype=dtype or stored or mx.float32, keep_quantized=keep_quantized,
                       numerics=numerics or Numerics(), quant=quant, where=str(folder))
    return module.assemble(cfg, src, opts)
