"""FP8 checkpoints for tests: a float model folder rewritten as Hugging Face's fine-grained
FP8 format (quant_method "fp8"), as DeepSeek-V3's and Qwen3-*-FP8's originals are stored:
each linear's weight as float8 e4m3 bytes (safetensors dtype F8_E4M3) beside
`weight_scale_inv`, one scale per `weight_block_size` block (amax / 448, as the published
quantizers choose, or its power of two above: DeepSeek V3.1's "ue8m0" scales);
embeddings, norms, routers and the output head stay in float, as there.

    write_fp8_folder(src, dst, block=(128, 128))     # dst: config.json with quantization_config
    E4M3_VALUES                                       # the 256 codes' values (numpy, NaN twice)
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

__all__ = ["E4M3_VALUES", "encode_fp8_blocks", "is_fp8_linear", "write_fp8_folder", "write_fp8_safetensors"]

E4M3_MAX = 448.0


def _e4m3_values() -> np.ndarray:
    """Every e4m3 code's value, from the format's definition (OCP FP8: 1 sign bit, 4
    exponent bits biased by 7, 3 mantissa bits; exponent 0 subnormal; S.1111.111 NaN, no
    infinities): written from the definition, not from any converter."""
    out = np.empty(256, np.float64)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            out[code] = np.nan
        elif e == 0:
            out[code] = sign * (m / 8.0) * 2.0 ** -6
        else:
            out[code] = sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return out


E4M3_VALUES = _e4m3_values()


def is_fp8_linear(name: str) -> bool:
    """The tensors the published FP8 checkpoints store in float8: the linear layers' weights
    (attention and MLP projections, experts, the MTP's eh_proj), not embeddings, norms,
    routers (mlp.gate) or the output head."""
    return name.endswith("proj.weight") and ".gate.weight" not in name


def encode_fp8_blocks(w: np.ndarray, block: tuple[int, int], *, pow2: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(e4m3 codes uint8 [..., R, C], scales float32 [..., ceil(R/r), ceil(C/c)]) of w: each
    block's scale amax / 448 (pow2: the power of two at or above it), its values w / scale
    rounded to e4m3 by MLX's converter (test data: what the bytes decode to is checked
    against E4M3_VALUES, not against the converter)."""
    r, c = block
    rows, cols = w.shape[-2:]
    nr, nc = -(-rows // r), -(-cols // c)
    pad = [(0, 0)] * (w.ndim - 2) + [(0, nr * r - rows), (0, nc * c - cols)]
    blocks = np.pad(np.asarray(w, np.float32), pad).reshape(*w.shape[:-2], nr, r, nc, c)
    amax = np.abs(blocks).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    if pow2:
        scale = (2.0 ** np.ceil(np.log2(scale))).astype(np.float32)
    full = np.repeat(np.repeat(scale, r, axis=-2)[..., :rows, :], c, axis=-1)[..., :cols]
    codes = np.asarray(mx.to_fp8(mx.array(np.asarray(w, np.float32) / full)))
    return codes.astype(np.uint8), scale


def write_fp8_safetensors(path: str | Path, tensors: dict[str, Any], fp8: set[str]) -> None:
    """A safetensors file whose tensors named in `fp8` (uint8 codes) are typed F8_E4M3, as
    torch writes float8_e4m3fn (mlx writes U8)."""
    path = Path(path)
    mx.save_safetensors(str(path), {n: mx.array(t) if isinstance(t, np.ndarray) else t for n, t in tensors.items()})
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + size])
    for name in fp8:
        assert header[name]["dtype"] == "U8", name
        header[name]["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + size:])


def write_fp8_folder(src: str | Path, dst: str | Path, block: tuple[int, int] = (128, 128), *,
                     pow2: bool = False, scale_dtype: str = "float32",
                     which: Callable[[str], bool] = is_fp8_linear,
                     config: dict[str, Any] | None = None) -> dict[str, np.ndarray]:
    """src's model rewritten into dst in the FP8 format: the tensors `which` names (2-D or
    more) as e4m3 codes and `weight_scale_inv` (in scale_dtype), every other file copied;
    config.json gains quantization_config (`config` overrides its fields). Returns, per
    FP8 tensor, its exact value (codes decoded by E4M3_VALUES times the scales, float64)."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy2(f, dst / f.name)
    exact: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    for f in sorted(src.glob("*.safetensors")):
        out: dict[str, Any] = {}
        fp8: set[str] = set()
        for name, t in mx.load(str(f)).items():
            if which(name) and t.ndim >= 2:
                codes, scale = encode_fp8_blocks(np.asarray(t.astype(mx.float32)), block, pow2=pow2)
                out[name], out[name + "_scale_inv"] = codes, mx.array(scale).astype(getattr(mx, scale_dtype))
                fp8.add(name)
                s = np.asarray(out[name + "_scale_inv"].astype(mx.float32), np.float64)
                full = np.repeat(np.repeat(s, block[0], axis=-2)[..., :codes.shape[-2], :], block[1],
                                 axis=-1)[..., :codes.shape[-1]]
                exact[name] = E4M3_VALUES[codes] * full
            else:
                out[name] = t
        write_fp8_safetensors(dst / f.name, out, fp8)
        weight_map.update({n: f.name for n in out})
    if (src / "model.safetensors.index.json").is_file():
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), **(config or {})}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return exact
