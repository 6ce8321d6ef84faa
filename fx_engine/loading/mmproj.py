"""llama.cpp's mmproj GGUF files (issue 46): Gemma 3's image path beside a GGUF text model.

llama.cpp runs a multimodal Gemma 3 as two files: the text model's GGUF and an "mmproj"
GGUF (`general.architecture` "clip", `clip.projector_type` "gemma3"): the SigLIP tower and
Gemma 3's projector, written by convert_hf_to_gguf.py's Gemma3VisionModel
(`--mmproj`). `fx_engine.load("text.gguf", mmproj="mmproj.gguf")` reads it here into the
same params the Hugging Face folder gives (`core.vision.gemma3.Gemma3VisionParams`), so
images run exactly as for a folder (engine/image_prompt.py).

What the converter writes, and how it is read back:

* metadata: clip.vision.image_size, patch_size, embedding_length (the tower's hidden
  size), feed_forward_length, block_count, attention.head_count,
  attention.layer_norm_epsilon (the tower's LayerNorms and, as in Hugging Face, the
  projector's RMSNorm), projection_dim (the text model's hidden size: checked against it),
  image_mean / image_std (the processor's), and clip.vision.projector.scale_factor only
  where the pool is not 4 x 4 patches (llama.cpp's default for Gemma 3; a tiny model's
  file says). mm_tokens_per_image = (image_size / patch_size / scale_factor)^2: 256 for
  the released models (896 / 14 / 4 = 16 a side), as clip.cpp pools.
* tensors (gguf-py's MMPROJ TensorNameMap), Hugging Face's values and layout: every tensor
  keeps its torch shape (GGUF's reversed dims read back as rows first):
  v.patch_embd.{weight,bias} (the conv [hidden, C, p, p]; forced F32),
  v.position_embd.weight (F32), v.blk.N.{ln1,ln2}.{weight,bias} (layer_norm1/2),
  v.blk.N.attn_{q,k,v,out}.{weight,bias} (q/k/v/out_proj), v.blk.N.ffn_up / ffn_down
  (mlp.fc1 / fc2), v.post_ln (post_layernorm), mm.input_projection.weight
  (mm_input_projection_weight [vision hidden, text hidden], stored as in -> out, not
  transposed: clip.cpp multiplies by its transpose; forced F16), mm.soft_emb_norm.weight
  (mm_soft_emb_norm with Gemma's + 1 folded in by the converter: read as it is, which is
  the scale `gemma3.assemble` computes from the folder, bit for bit in float32).
  Matrices are F32, F16 or (a quantized file) Q8_0 & co: read by fx_engine.loading.gguf
  (quantized linears follow the text model's keep-quantized policy; quantized
  non-linears are dequantized).
* preprocessing (llama.cpp's fixed-size path for Gemma 3): the image resized to
  image_size x image_size, scaled by 1/255, normalized with the file's mean / std. Here
  the resize is PIL's bilinear (resample 2), Hugging Face's Gemma3ImageProcessor's rule
  (loading/images.py); llama.cpp's own bilinear resize has no antialiasing, so a
  downscaled image's pixels can differ from llama.cpp's in the last bits.
* the image token ids: the text model's vocabulary's `<start_of_image>`,
  `<image_soft_token>` and `<end_of_image>` (ids 255999, 262144 and 256000 in Gemma 3's);
  the image soft token only marks positions (its embedding is replaced).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from fx_engine.core.checkpoint import KeepQuantized, LoadOptions, TensorSource, WeightsError, renamed
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Linear, Numerics

#: the projector types read here (clip.projector_type)
SUPPORTED_PROJECTORS = ("gemma3",)
#: llama.cpp's Gemma 3 pool (patches a side per image token a side) when the file does not say
DEFAULT_SCALE_FACTOR = 4
#: GGUF name -> Hugging Face name (under gemma3.TOWER_PREFIXES[0] / PROJECTOR_PREFIXES[0])
_TOWER = "vision_tower.vision_model."
_PROJ = "multi_modal_projector."
_TO_HF = (
    (r"^v\.patch_embd\.", _TOWER + "embeddings.patch_embedding."),
    (r"^v\.position_embd\.", _TOWER + "embeddings.position_embedding."),
    (r"^v\.post_ln\.", _TOWER + "post_layernorm."),
    (r"^v\.blk\.(\d+)\.ln1\.", _TOWER + r"encoder.layers.\1.layer_norm1."),
    (r"^v\.blk\.(\d+)\.ln2\.", _TOWER + r"encoder.layers.\1.layer_norm2."),
    (r"^v\.blk\.(\d+)\.attn_q\.", _TOWER + r"encoder.layers.\1.self_attn.q_proj."),
    (r"^v\.blk\.(\d+)\.attn_k\.", _TOWER + r"encoder.layers.\1.self_attn.k_proj."),
    (r"^v\.blk\.(\d+)\.attn_v\.", _TOWER + r"encoder.layers.\1.self_attn.v_proj."),
    (r"^v\.blk\.(\d+)\.attn_out\.", _TOWER + r"encoder.layers.\1.self_attn.out_proj."),
    (r"^v\.blk\.(\d+)\.ffn_up\.", _TOWER + r"encoder.layers.\1.mlp.fc1."),
    (r"^v\.blk\.(\d+)\.ffn_down\.", _TOWER + r"encoder.layers.\1.mlp.fc2."),
    (r"^mm\.input_projection\.weight$", _PROJ + "mm_input_projection_weight"),
    (r"^mm\.soft_emb_norm\.", _PROJ + "mm_soft_emb_norm."),
)
#: the tensors a Gemma 3 mmproj must hold ({i}: each block)
_BLOCK = tuple(f"v.blk.{{i}}.{n}.{s}" for n in ("ln1", "attn_q", "attn_k", "attn_v", "attn_out", "ln2",
                                                "ffn_up", "ffn_down") for s in ("weight", "bias"))
_GLOBAL = ("v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight", "v.post_ln.weight",
           "v.post_ln.bias", "mm.input_projection.weight", "mm.soft_emb_norm.weight")
#: Gemma 3's image placeholder tokens in the text model's vocabulary
IMAGE_TOKENS = {"boi": "<start_of_image>", "image": "<image_soft_token>", "eoi": "<end_of_image>"}


def expected_tensors(block_count: int) -> list[str]:
    """The GGUF tensor names a Gemma 3 mmproj of `block_count` blocks holds."""
    return list(_GLOBAL[:3]) + [n.format(i=i) for i in range(block_count) for n in _BLOCK] + list(_GLOBAL[3:])


def _value(md: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key not in md:
        if default is ...:
            raise ConfigError(f"{source}: GGUF metadata '{key}' is missing (an mmproj file for Gemma 3 "
                              "has it)")
        return default
    v = md[key]
    return v.tolist() if hasattr(v, "tolist") and getattr(v, "ndim", 0) else (v.item() if hasattr(v, "item") else v)


def _int(md: dict[str, Any], key: str, source: str, default: Any = ...) -> int:
    v = _value(md, key, source, default)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{source}: GGUF metadata '{key}' must be a positive integer, got {v!r}")
    return v


def projector_type(md: dict[str, Any]) -> str | None:
    """The file's projector type (clip.projector_type; clip.vision.projector_type in files
    with several encoders), None when neither is there."""
    v = md.get("clip.projector_type", md.get("clip.vision.projector_type"))
    return None if v is None else str(v)


def check_mmproj_metadata(md: dict[str, Any], source: str) -> None:
    """ConfigError unless `md` is an mmproj GGUF's metadata with a projector fx-engine runs."""
    arch = md.get("general.architecture")
    kind = projector_type(md)
    if arch != "clip" or kind is None:
        hint = (" (this looks like a text model's GGUF: pass the text model as the model and the mmproj "
                "file as mmproj)" if arch not in (None, "clip") else "")
        raise ConfigError(f"{source}: not an mmproj GGUF (general.architecture {arch!r}, expected 'clip' with "
                          f"clip.projector_type){hint}")
    if kind not in SUPPORTED_PROJECTORS:
        raise ConfigError(f"{source}: clip.projector_type {kind!r} is not supported (supported: "
                          f"{', '.join(SUPPORTED_PROJECTORS)}: Gemma 3's SigLIP tower and projector)")
    if md.get("clip.has_vision_encoder") is not None and not bool(_value(md, "clip.has_vision_encoder", source)):
        raise ConfigError(f"{source}: clip.has_vision_encoder is false: the file holds no vision tower")


def image_token_ids(tokens: Sequence[str] | None, source: str) -> dict[str, int]:
    """The ids of Gemma 3's image tokens in the text model's vocabulary (its GGUF's
    tokenizer.ggml.tokens); ConfigError naming the token that is missing."""
    if not tokens:
        raise ConfigError(f"{source}: the text model's GGUF has no vocabulary (tokenizer.ggml.tokens): the "
                          "image token ids cannot be found")
    index: dict[str, int] = {}
    want = set(IMAGE_TOKENS.values())
    for i, t in enumerate(tokens):
        if t in want and t not in index:
            index[t] = i
    out = {}
    for key, text in IMAGE_TOKENS.items():
        if text not in index:
            raise ConfigError(f"{source}: the text model's vocabulary has no {text!r} token (Gemma 3's image "
                              "tokens: is the text model Gemma 3 4B/12B/27B?)")
        out[key] = index[text]
    return out


def mmproj_config(md: dict[str, Any], text_hidden: int, ids: dict[str, int], source: str) -> Any:
    """The image path's `Gemma3VisionConfig` from an mmproj's metadata (ConfigError naming
    the key for what is missing, malformed or disagrees with the text model)."""
    from fx_engine.core.vision import gemma3, siglip

    check_mmproj_metadata(md, source)
    eps = _value(md, "clip.vision.attention.layer_norm_epsilon", source, 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ConfigError(f"{source}: GGUF metadata 'clip.vision.attention.layer_norm_epsilon' must be a number, "
                          f"got {eps!r}")
    # (a float32 in the file: its shortest decimal, the config's 1e-6 rather than 9.99999997e-07)
    eps = float(str(np.float32(eps)))
    d = {"model_type": "siglip_vision_model", "hidden_act": "gelu_pytorch_tanh",
         "hidden_size": _int(md, "clip.vision.embedding_length", source),
         "intermediate_size": _int(md, "clip.vision.feed_forward_length", source),
         "num_hidden_layers": _int(md, "clip.vision.block_count", source),
         "num_attention_heads": _int(md, "clip.vision.attention.head_count", source),
         "patch_size": _int(md, "clip.vision.patch_size", source),
         "image_size": _int(md, "clip.vision.image_size", source), "layer_norm_eps": float(eps)}
    tower = siglip.config_from_hf(d, f"{source}: clip.vision.*")
    proj = _int(md, "clip.vision.projection_dim", source, text_hidden)
    if proj != text_hidden:
        raise ConfigError(f"{source}: clip.vision.projection_dim = {proj}, but the text model's hidden size "
                          f"(embedding_length) is {text_hidden}: this mmproj belongs to another model size")
    k = _int(md, "clip.vision.projector.scale_factor", source, DEFAULT_SCALE_FACTOR)
    if tower.patches_per_side % k:
        raise ConfigError(f"{source}: {tower.patches_per_side} patches a side (clip.vision.image_size "
                          f"{tower.image_size} / patch_size {tower.patch_size}) do not pool evenly by "
                          f"clip.vision.projector.scale_factor {k}")
    side = tower.patches_per_side // k
    if len(set(ids.values())) != 3:
        raise ConfigError(f"{source}: the image token ids must differ, got {ids}")
    return gemma3.Gemma3VisionConfig(vision=tower, text_hidden_size=text_hidden, mm_tokens_per_image=side * side,
                                     image_token_index=ids["image"], boi_token_index=ids["boi"],
                                     eoi_token_index=ids["eoi"])


def processor_config(md: dict[str, Any], image_size: int, source: str) -> Any:
    """The preprocessing rules of an mmproj: resize to image_size (PIL bilinear), x / 255,
    the file's image_mean / image_std."""
    from fx_engine.loading.images import ImageProcessorConfig

    def channels(key: str, positive: bool) -> tuple[float, float, float]:
        v = _value(md, key, source, [0.5, 0.5, 0.5])
        vals = list(v) if isinstance(v, (list, tuple)) else None
        if (vals is None or len(vals) != 3 or not all(isinstance(x, (int, float)) for x in vals)
                or (positive and not all(x > 0 for x in vals))):
            raise ConfigError(f"{source}: GGUF metadata '{key}' must be 3 {'positive ' if positive else ''}"
                              f"numbers, got {v!r}")
        return tuple(float(x) for x in vals)  # type: ignore[return-value]

    return ImageProcessorConfig(height=image_size, width=image_size, resample=2,
                                image_mean=channels("clip.vision.image_mean", False),
                                image_std=channels("clip.vision.image_std", True))


def _dense(src: TensorSource, name: str, shape: tuple[int, ...], where: str) -> mx.array:
    """A tensor that is not run as a linear (patch conv, position table, projection, norm)
    as floats: dequantized if the file quantized it (its width and group follow from the
    packed and scale shapes, given its `shape`), shape-checked (the GGUF name in errors)."""
    w = src.get(name, None, where)
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if src.has(base + ".scales"):
        scales, biases = src.tensors[base + ".scales"], src.tensors.get(base + ".biases")
        cols = shape[-1]
        ok = (w.dtype == mx.uint32 and biases is not None and scales.dtype in (mx.float32, mx.float16, mx.bfloat16)
              and (w.shape[-1] * 32) % cols == 0 and cols % scales.shape[-1] == 0)
        if not ok:
            raise WeightsError(f"{src.origin[name]}: tensor '{name}' is stored in a quantized form that is not "
                               "supported here (use an F16, F32 or Q8_0 mmproj)")
        flat = mx.dequantize(w.reshape(-1, w.shape[-1]), scales.reshape(-1, scales.shape[-1]).astype(mx.float32),
                             biases.reshape(-1, biases.shape[-1]).astype(mx.float32),
                             group_size=cols // scales.shape[-1], bits=w.shape[-1] * 32 // cols)
        w = flat.reshape(*w.shape[:-1], cols)
    if tuple(w.shape) != tuple(shape):
        raise WeightsError(f"{src.origin[name]}: tensor '{name}' has shape {tuple(w.shape)} (rows first), "
                           f"expected {tuple(shape)}")
    return w


def read_mmproj_tensors(path: Path, block_count: int) -> TensorSource:
    """The mmproj's tensors under Hugging Face's names (the GGUF name kept in the origin for
    errors); WeightsError naming each missing GGUF tensor."""
    from fx_engine.loading.gguf import read_gguf

    tensors, _ = read_gguf(path)
    missing = [n for n in expected_tensors(block_count) if n not in tensors]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise WeightsError(f"{path}: missing tensor(s) {shown} (a Gemma 3 mmproj with clip.vision.block_count = "
                           f"{block_count} holds {len(expected_tensors(block_count))} of llama.cpp's v.* / mm.* "
                           "tensors)")
    src = TensorSource()
    src.add(path, {n: t for n, t in tensors.items() if re.match(r"^(v|mm)\.", n)})
    return renamed(src, _TO_HF)


def load_mmproj(path: str | Path, text_config: Any, text_metadata: dict[str, Any], *, dtype: mx.Dtype,
                keep_quantized: KeepQuantized = False, numerics: Numerics | None = None) -> tuple[Any, Any]:
    """(vision params, preprocessing rules) of an mmproj GGUF for a GGUF text model (its
    config and metadata: the hidden size and the image token ids). ConfigError /
    WeightsError name the file and the key or tensor."""
    from fx_engine.core.vision import gemma3, siglip
    from fx_engine.loading.gguf import read_gguf_metadata

    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such mmproj file")
    if path.suffix.lower() != ".gguf":
        raise WeightsError(f"{path}: an mmproj must be a .gguf file (llama.cpp's mmproj-*.gguf)")
    md = read_gguf_metadata(path)
    check_mmproj_metadata(md, source)  # (first: an unsupported projector is named as such)
    if getattr(text_config, "model_type", None) != "gemma3_text":
        raise ConfigError(f"{source}: an mmproj was given for a {getattr(text_config, 'model_type', '?')!r} text "
                          "model; the gemma3 projector needs a Gemma 3 text model (GGUF architecture 'gemma3')")
    ids = image_token_ids(text_metadata.get("tokenizer.ggml.tokens"), f"{source} (with the text model)")
    cfg = mmproj_config(md, int(text_config.hidden_size), ids, source)
    vocab = int(getattr(text_config, "vocab_size", 0) or 0)
    if vocab and max(ids.values()) >= vocab:
        raise ConfigError(f"{source}: image token ids {ids} lie outside the text model's {vocab} embeddings")
    src = read_mmproj_tensors(path, cfg.vision.num_layers)
    opts = LoadOptions(dtype=dtype, keep_quantized=keep_quantized, numerics=numerics or Numerics(), where=source)
    v = cfg.vision
    for name, shape in ((_TOWER + "embeddings.patch_embedding.weight",
                         (v.hidden_size, v.num_channels, v.patch_size, v.patch_size)),
                        (_TOWER + "embeddings.position_embedding.weight", (v.num_patches, v.hidden_size))):
        base = name[: -len(".weight")]
        if src.has(base + ".scales"):  # (the converter forces these to F32; a requantized file may not)
            src.tensors[name] = _dense(src, name, shape, source)
            del src.tensors[base + ".scales"]
            src.tensors.pop(base + ".biases", None)
    tower = siglip.assemble(cfg.vision, src, opts, _TOWER)
    dv, ht = cfg.vision.hidden_size, cfg.text_hidden_size
    proj_name, norm_name = _PROJ + "mm_input_projection_weight", _PROJ + "mm_soft_emb_norm.weight"
    proj = _dense(src, proj_name, (dv, ht), source)  # [vision hidden, text hidden]: in -> out
    norm = _dense(src, norm_name, (dv,), source)
    # the file's soft_emb_norm is the scale itself (the converter added Gemma's 1)
    vision = gemma3.Gemma3VisionParams(tower=tower, soft_norm=norm.astype(dtype),
                                       projection=Linear(weight=mx.contiguous(proj.astype(dtype)), transposed=True),
                                       config=cfg)
    return vision, processor_config(md, cfg.vision.image_size, source)
