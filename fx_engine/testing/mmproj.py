"""Write a tiny Gemma 3 (`write_tiny_gemma3_vlm`), Gemma 4 (`write_tiny_gemma4_gguf_pair`,
`write_gemma4_mmproj`), Idefics3 / SmolVLM (`write_tiny_idefics3`),
Mistral 3 (`write_tiny_mistral3`), Qwen2(.5)-VL (`write_tiny_qwen2_vl`) or Qwen3-VL
(`write_tiny_qwen3_vl`) multimodal folder as llama.cpp's two files: the text model's GGUF and
the mmproj GGUF (fx_engine/loading/mmproj.py reads the latter).

Mistral 3 (its LlavaVisionModel): projector_type pixtral, use_silu / use_gelu, the tower's
q / k rows permuted as LlamaModel.permute does (for clip.cpp's interleaved rotary), the
projector as mm.input_norm / mm.patch_merger / mm.1 / mm.2, and [IMG_BREAK]'s text
embedding copied in as v.token_embd.img_break; its `mistral` text model as LlamaModel
writes it (architecture llama).

Qwen-VL (its Qwen2VLVisionModel): projector_type qwen2vl_merger / qwen2.5vl_merger, 2.5's
use_silu and n_wa_pattern, the converter's vision_config renames (Qwen2-VL's hidden_size as
feed_forward_length), the patch Conv3d split into v.patch_embd.weight / .weight.1, q / k / v
split out of attn.qkv, the merger as v.post_ln / mm.0 / mm.2; then, as llama.cpp's keys for
them, the tiny folder's window_size and min / max pixels where they differ from what a file
without them gets (the released models' values: the converter does not write them).
Qwen3-VL (its Qwen3VLVisionModel): projector_type qwen3vl_merger, use_gelu,
spatial_merge_size, is_deepstack_layers (a flag per tower layer), image_size from the
position grid; the patch conv split likewise (its bias as v.patch_embd.bias), q / k / v kept
fused (attn_qkv), the merger's norm / linear_fc1 / linear_fc2 as v.post_ln / mm.0 / mm.2,
DeepStack merger j as v.deepstack.{deepstack_visual_indexes[j]}.{norm,fc1,fc2}; the
position table F32.

`write_mmproj` follows convert_hf_to_gguf.py's Gemma3VisionModel / SmolVLMModel (`--mmproj`):
general.architecture "clip", their clip.* / clip.vision.* keys (SmolVLMModel's:
projector_type "idefics3", the tower's layer_norm_eps, projector.scale_factor (the pixel
shuffle), use_gelu, preproc_image_size = the processor's size.longest_edge), gguf-py's
MMPROJ tensor names (taken from the installed `gguf` package's TensorNameMap: an
independent oracle for the names; Idefics3's connector projection is mm.model.fc),
Gemma 3's "mm_input_projection_weight" renamed to "mm_input_projection.weight" and its
mm_soft_emb_norm + 1, the torch shapes kept (no transposes), and the tensor types: 1-D
tensors and norms F32, the embeddings (patch conv, positions) F32, Gemma 3's input
projection F16 whatever the outtype, the other matrices in the outtype (f32, f16 or q8_0:
gguf-py's reference quantizer).

`write_text_gguf` writes the folder's text model as llama.cpp's Gemma3Model does (tensor
names, gemma3.* keys, norms + 1, a byte-level BPE vocabulary with the chat template), or
for Idefics3 / SmolVLM as its LlamaModel does (llama.*, q/k rows permuted).
`add_image_tokens` first gives the folder's tiny vocabulary Gemma 3's image tokens
(`<start_of_image>`, `<image_soft_token>`, `<end_of_image>` at the config's ids), as the
released Gemma 3 vocabulary has them: the mmproj loader finds the ids by these names.
Needs the `gguf` package (llama.cpp's gguf-py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from fx_engine.testing.vision import write_tiny_gemma3_vlm

IMAGE_TOKEN_FIELDS = {"boi_token_index": "<start_of_image>", "image_token_index": "<image_soft_token>",
                      "eoi_token_index": "<end_of_image>"}


def add_image_tokens(folder: str | Path) -> dict[str, int]:
    """Rename the tokens at the folder's image token ids (config.json's boi / image / eoi
    token indexes) to Gemma 3's image token strings, as special added tokens, in
    tokenizer.json (the merges that made the old strings dropped). Returns {string: id}."""
    folder = Path(folder)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    by_id = {i: t for t, i in vocab.items()}
    out = {}
    for field, text in IMAGE_TOKEN_FIELDS.items():
        i = int(cfg[field])
        old = by_id[i]
        del vocab[old]
        vocab[text] = i
        merges = tok["model"]["merges"]
        tok["model"]["merges"] = [m for m in merges
                                  if "".join(m.split(" ") if isinstance(m, str) else m) != old]
        tok["added_tokens"].append({"id": i, "content": text, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
        out[text] = i
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    return out


def round_projection_to_f16(folder: str | Path) -> None:
    """Round the folder's mm_input_projection_weight to float16 values (stored in its dtype):
    the converter always writes that tensor as F16, so a folder rounded so holds exactly
    what an mmproj of it holds (for bit-for-bit comparisons)."""
    path = Path(folder) / "model.safetensors"
    weights = dict(mx.load(str(path)))
    for name in [n for n in weights if n.endswith("mm_input_projection_weight")]:
        weights[name] = weights[name].astype(mx.float16).astype(weights[name].dtype)
    mx.save_safetensors(str(path), weights, metadata={"format": "mlx"})


def _numpy(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32))


#: the folder families written here: config.json model_type -> clip.projector_type
PROJECTORS = {"gemma3": "gemma3", "idefics3": "idefics3", "smolvlm": "idefics3", "mistral3": "pixtral",
              "qwen2_vl": "qwen2vl_merger", "qwen3_vl": "qwen3vl_merger", "qwen3_vl_moe": "qwen3vl_merger",
              "qwen2_5_vl": "qwen2.5vl_merger"}
#: the image processor's pixel bounds and clip.cpp's attention window (what a file without
#: the keys gets: loading/mmproj.py): a tiny folder's other values are written as extra keys
_QWEN_PIXELS = {"qwen2_vl": (3136, 12845056), "qwen2_5_vl": (3136, 12845056), "qwen3_vl": (65536, 16777216),
               "qwen3_vl_moe": (65536, 16777216)}
_QWEN_WINDOW = 112
#: SmolVLM2 folders leave these tower sizes out; the converter fills in transformers' defaults
_SMOLVLM_DEFAULTS = {"hidden_size": 1152, "num_attention_heads": 16, "intermediate_size": 3072}


def _base_metadata(v: dict[str, Any], pre: dict[str, Any], hidden_text: int, outtype: str) -> dict[str, Any]:
    """MmprojModel's keys (every projector's): the tower's sizes, the processor's mean / std."""
    return {
        "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7}[outtype],
        "clip.has_vision_encoder": True, "clip.vision.projection_dim": hidden_text,
        "clip.vision.image_size": v["image_size"], "clip.vision.patch_size": v["patch_size"],
        "clip.vision.embedding_length": v["hidden_size"], "clip.vision.feed_forward_length": v["intermediate_size"],
        "clip.vision.block_count": v["num_hidden_layers"], "clip.vision.attention.head_count": v["num_attention_heads"],
        "clip.vision.image_mean": [float(x) for x in pre["image_mean"]],
        "clip.vision.image_std": [float(x) for x in pre["image_std"]],
    }


def _gemma3_metadata(cfg: dict[str, Any], pre: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """Gemma3VisionModel's keys."""
    n_per_side = int(pre.get("image_seq_length", 256) ** 0.5)
    scale = (v["image_size"] // v["patch_size"]) // n_per_side
    md: dict[str, Any] = {"clip.projector_type": "gemma3",
                          "clip.vision.attention.layer_norm_epsilon": float(v.get("layer_norm_eps", 1e-6)),
                          "clip.use_gelu": True}
    if scale > 0 and scale != 4:  # (the converter writes it only when it is not the default)
        md["clip.vision.projector.scale_factor"] = scale
    return md


def _idefics3_metadata(cfg: dict[str, Any], pre: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """SmolVLMModel's keys: the tower's eps, the pixel shuffle, the resize before tiling."""
    return {"clip.projector_type": "idefics3",
            "clip.vision.attention.layer_norm_epsilon": float(v.get("layer_norm_eps", 1e-5)),
            "clip.vision.projector.scale_factor": int(cfg.get("scale_factor", 2)), "clip.use_gelu": True,
            "clip.vision.preproc_image_size": int(pre.get("size", {}).get("longest_edge", v["image_size"]))}


def _pixtral_metadata(cfg: dict[str, Any], pre: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """LlavaVisionModel's keys for a pixtral tower: the eps (1e-5 unless the config says),
    use_silu / use_gelu from hidden_act, config.json's spatial_merge_size."""
    act = v.get("hidden_act", "gelu")
    md: dict[str, Any] = {"clip.projector_type": "pixtral",
                          "clip.vision.attention.layer_norm_epsilon": float(v.get("layer_norm_eps", 1e-5)),
                          "clip.use_silu" if act == "silu" else "clip.use_gelu": True}
    if "spatial_merge_size" in cfg:
        md["clip.vision.spatial_merge_size"] = int(cfg["spatial_merge_size"])
    return md


def _llama_permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (the Pixtral tower's q / k rows, for clip.cpp's rotary)."""
    return x.reshape(heads, 2, x.shape[0] // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _qwen_vision(v: dict[str, Any]) -> dict[str, Any]:
    """Qwen2VLVisionModel's renames of vision_config: image_size 560 unless given, heads and
    depth under the common names; Qwen2-VL's embed_dim as hidden_size and its hidden_size
    (the merger's output) as intermediate_size (the converter's own reading)."""
    size = 560 if "num_position_embeddings" not in v else int(v["num_position_embeddings"] ** 0.5 * v["patch_size"])
    v = {**v, "image_size": v.get("image_size", size), "num_attention_heads": v.get("num_heads"),
         "num_hidden_layers": v.get("depth")}
    if "embed_dim" in v:
        v["intermediate_size"], v["hidden_size"] = v.get("hidden_size"), v["embed_dim"]
    return v


def _qwen_metadata(cfg: dict[str, Any], pre: dict[str, Any], v: dict[str, Any]) -> dict[str, Any]:
    """Qwen2VLVisionModel's keys (2.5: use_silu and n_wa_pattern from fullatt_block_indexes;
    the eps is the text model's rms_norm_eps), then the tiny folder's values the converter
    does not write but the image path depends on, as the keys llama.cpp has for them
    (clip.vision.window_size, image_min_pixels, image_max_pixels), only where they differ
    from what a file without them gets."""
    text = cfg.get("text_config") or cfg
    md: dict[str, Any] = {"clip.projector_type": PROJECTORS[cfg["model_type"]],
                          "clip.vision.attention.layer_norm_epsilon": float(text.get("rms_norm_eps", 1e-6))}
    if cfg["model_type"] in ("qwen3_vl", "qwen3_vl_moe"):  # (Qwen3VLVisionModel: gelu, merge size, DeepStack flags)
        md["clip.use_gelu"] = True
        if v.get("spatial_merge_size") is not None:
            md["clip.vision.spatial_merge_size"] = int(v["spatial_merge_size"])
        deep = set(v.get("deepstack_visual_indexes", []))
        md["clip.vision.is_deepstack_layers"] = [i in deep for i in range(v["num_hidden_layers"])]
    if cfg["model_type"] == "qwen2_5_vl":
        full = v["fullatt_block_indexes"]
        n = full[0] + 1
        if any(b - a != n for a, b in zip(full, full[1:])):
            raise ValueError(f"Invalid fullatt_block_indexes: {full}")
        md.update({"clip.use_silu": True, "clip.vision.n_wa_pattern": n})
        if v.get("window_size", _QWEN_WINDOW) != _QWEN_WINDOW:
            md["clip.vision.window_size"] = v["window_size"]
    size = pre.get("size") or {}
    bounds = (pre.get("min_pixels", size.get("shortest_edge")), pre.get("max_pixels", size.get("longest_edge")))
    for key, value, default in zip(("clip.vision.image_min_pixels", "clip.vision.image_max_pixels"), bounds,
                                   _QWEN_PIXELS[cfg["model_type"]]):
        if value is not None and value != default:
            md[key] = int(value)
    return md


def _qwen_tensors(name: str, x: np.ndarray, v: dict[str, Any] | None = None) -> list[tuple[str, np.ndarray]]:
    """Qwen2VLVisionModel.modify_tensors: q / k / v split out of attn.qkv, the Conv3d patch
    embedding split into its two frames' 2-D convs (the second named v.patch_embd.weight.1).
    v: Qwen3-VL's vision_config (Qwen3VLVisionModel.modify_tensors: q / k / v stay fused,
    the patch bias kept, the merger as v.post_ln / mm.0 / mm.2, DeepStack merger j under its
    tower layer deepstack_visual_indexes[j])."""
    if v is not None:
        if name == "visual.patch_embed.proj.bias":
            return [("v.patch_embd.bias", x)]
        m = re.match(r"^visual\.deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)$", name)
        if m:
            layer = v["deepstack_visual_indexes"][int(m.group(1))]
            return [(f"v.deepstack.{layer}.{m.group(2).replace('linear_', '')}.{m.group(3)}", x)]
        m = re.match(r"^visual\.merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)$", name)
        if m:
            return [({"norm": "v.post_ln", "linear_fc1": "mm.0", "linear_fc2": "mm.2"}[m.group(1)] + "." + m.group(2),
                     x)]
    elif ".qkv." in name:
        c = x.shape[0] // 3
        return [(name.replace("qkv", p), x[i * c:(i + 1) * c]) for i, p in enumerate("qkv")]
    if "patch_embed.proj.weight" in name:
        assert x.shape[2] == 2, "the converter supports temporal_patch_size 2 only"
        return [("v.patch_embd.weight", x[:, :, 0]), ("v.patch_embd.weight.1", x[:, :, 1])]
    return [(name, x)]


def _tensor_kind(family: str, hf: str, target: str, x: np.ndarray, outtype: str) -> str:
    """The GGUF type the converter gives a tensor: Gemma 3's projection F16 whatever the
    outtype; the embeddings (patch conv, positions), 1-D tensors and norms F32; other
    matrices the outtype (Q8_0 where the rows split into 32-blocks)."""
    if family == "gemma3" and "input_projection" in hf:
        return "F16"
    if ".embeddings." in hf or "position_embd" in target or x.ndim <= 1 or target.endswith("_norm.weight"):
        return "F32"
    if outtype == "q8_0" and x.shape[-1] % 32 == 0:
        return "Q8_0"
    return "F32" if outtype == "f32" else "F16"


def _is_mmproj_tensor(family: str, name: str) -> bool:
    if family == "idefics3":  # (SmolVLMModel: the tower and the connector)
        return name.startswith(("model.vision_model.", "model.connector."))
    if family.startswith("qwen"):  # (transformers >= 4.52's model.visual. read as visual.)
        return name.startswith(("visual.", "model.visual."))
    if family == "pixtral":
        return name.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                                "model.multi_modal_projector."))
    return name.startswith(("multi_modal_projector.", "vision_tower.")) and "vision_model.head." not in name


def _add_metadata(w: Any, md: dict[str, Any]) -> None:
    """Each key with its GGUF type (bools, strings, float32, arrays, else uint32)."""
    for key, value in md.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)


def write_mmproj(folder: str | Path, out: str | Path, *, outtype: str = "f16", projector_type: str | None = None,
                 skip: Iterable[str] = (), metadata: dict[str, Any] | None = None,
                 drop_metadata: Iterable[str] = ()) -> Path:
    """The folder's vision tower and projector as llama.cpp's mmproj GGUF at `out` (a
    Gemma 3, Idefics3 / SmolVLM, Mistral 3, Qwen2(.5)-VL or Qwen3-VL folder: `PROJECTORS`).
    outtype: the matrices' type ("f32", "f16", "q8_0"); projector_type:
    clip.projector_type (default: the folder's; tests of the refusal); skip: GGUF tensor
    names left out; metadata: keys added or replaced; drop_metadata: keys left out."""
    import gguf

    folder, out = Path(folder), Path(out)
    if outtype not in ("f32", "f16", "q8_0"):
        raise ValueError(f"outtype must be 'f32', 'f16' or 'q8_0', got {outtype!r}")
    cfg = json.loads((folder / "config.json").read_text())
    if cfg.get("model_type") not in PROJECTORS:
        raise ValueError(f"write_mmproj: model_type {cfg.get('model_type')!r} is not one of {', '.join(PROJECTORS)}")
    family = PROJECTORS[cfg["model_type"]]
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    v = cfg["vision_config"]
    if family == "idefics3":
        v = {**_SMOLVLM_DEFAULTS, **v}
    elif family.startswith("qwen"):
        v = _qwen_vision(v)
    md = _base_metadata(v, pre, (cfg.get("text_config") or cfg)["hidden_size"], outtype)
    extra = {"gemma3": _gemma3_metadata, "idefics3": _idefics3_metadata,
             "pixtral": _pixtral_metadata}.get(family, _qwen_metadata)
    md.update(extra(cfg, pre, v))
    if projector_type is not None:
        md["clip.projector_type"] = projector_type
    md.update(metadata or {})
    for k in drop_metadata:
        md.pop(k, None)
    # (the merger's mm.2 is a "block" 2 of the map: a tiny 2-layer tower needs 3 in the map)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(3, v["num_hidden_layers"]))
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    _add_metadata(w, md)
    skip = set(skip)
    tensors = mx.load(str(folder / "model.safetensors"))
    for name in sorted(tensors):
        if not _is_mmproj_tensor(family, name):
            continue
        x = _numpy(tensors[name])
        hf = name.replace("_weight", ".weight")
        if hf.startswith(("model.visual.", "model.vision_tower.", "model.multi_modal_projector.")):
            hf = hf[len("model."):]
        if family == "pixtral" and hf.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
            x = _llama_permute(x, v["num_attention_heads"])
        parts = (_qwen_tensors(hf, x, v if family == "qwen3vl_merger" else None) if family.startswith("qwen")
                 else [(hf, x)])
        for hf, x in parts:
            target = hf if hf.startswith("v.") else names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if target is None:
                raise ValueError(f"no llama.cpp name for {name}")
            if "soft_emb_norm.weight" in hf:
                x = x + np.float32(1.0)  # Gemma3RMSNorm's 1 + w
            if target in skip:
                continue
            kind = _tensor_kind(family, hf, target, x, outtype)
            if kind == "Q8_0":
                q = gguf.quants.quantize(np.ascontiguousarray(x), gguf.GGMLQuantizationType.Q8_0)
                w.add_tensor(target, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            else:
                w.add_tensor(target, np.ascontiguousarray(x).astype(np.float16 if kind == "F16" else np.float32))
    if family == "pixtral" and "v.token_embd.img_break" not in skip:
        # (the converter copies [IMG_BREAK]'s text embedding in: clip.cpp ends each row of
        # image embeddings with it, where the Hugging Face prompt has the [IMG_BREAK] token)
        tok = json.loads((folder / "tokenizer.json").read_text())
        brk = next(t["id"] for t in tok["added_tokens"] if t["content"] == "[IMG_BREAK]")
        embed = next(n for n in tensors if n.endswith("embed_tokens.weight"))
        w.add_tensor("v.token_embd.img_break", _numpy(tensors[embed][brk]))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_text_gguf(folder: str | Path, out: str | Path) -> Path:
    """The folder's text model as llama.cpp writes it: Gemma 3's as its Gemma3Model
    (`fx_engine.testing.gguf.write_gemma_gguf`), Idefics3 / SmolVLM's as its LlamaModel
    (`write_llama_gguf`; Mistral 3's with a `mistral` text model likewise), Qwen2(.5)-VL's as
    its Qwen2VLModel (`write_qwen2vl_gguf`), Qwen3-VL's as its Qwen3VLTextModel and
    Qwen3-VL-MoE's as its Qwen3VLMoeTextModel (`write_qwen3vl_gguf`)."""
    from fx_engine.testing.gguf import write_gemma_gguf, write_llama_gguf, write_qwen2vl_gguf, write_qwen3vl_gguf

    mt = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    if mt in ("idefics3", "smolvlm", "mistral3"):
        return write_llama_gguf(folder, out)
    if mt in ("qwen2_vl", "qwen2_5_vl"):
        return write_qwen2vl_gguf(folder, out)
    if mt in ("qwen3_vl", "qwen3_vl_moe"):
        return write_qwen3vl_gguf(folder, out)
    return write_gemma_gguf(folder, out, "gemma3")


def write_tiny_gemma3_gguf_pair(folder: str | Path, *, outtype: str = "f32", f16_projection_folder: bool = True,
                                **vlm: Any) -> tuple[Path, Path, Path]:
    """A tiny Gemma 3 folder and its two llama.cpp files: (folder, text.gguf, mmproj.gguf)
    beside it. The text model has llama.cpp's fixed Gemma 3 layout (6 layers, every 6th
    global, query scale 1/sqrt(head_dim)) so the GGUF reads as the folder does;
    f16_projection_folder: the folder's projection rounded to float16 first (what the
    mmproj holds: the two then hold the same values). vlm: `write_tiny_gemma3_vlm`'s
    arguments."""
    folder = Path(folder)
    text = {"num_hidden_layers": 6, "sliding_window_pattern": 6, **vlm.pop("text", {})}
    mm = vlm.get("mm_tokens_per_image", 16)
    preprocessor = {"image_seq_length": mm, **vlm.pop("preprocessor", {})}  # (the converter reads it)
    write_tiny_gemma3_vlm(folder, text=text, preprocessor=preprocessor, **vlm)
    add_image_tokens(folder)
    if f16_projection_folder:
        round_projection_to_f16(folder)
    text_gguf = write_text_gguf(folder, folder.parent / f"{folder.name}-text.gguf")
    mmproj = write_mmproj(folder, folder.parent / f"{folder.name}-mmproj-{outtype}.gguf", outtype=outtype)
    return folder, text_gguf, mmproj


def write_tiny_idefics3_gguf_pair(folder: str | Path, *, outtype: str = "f32", model_type: str = "idefics3",
                                  **kw: Any) -> tuple[Path, Path, Path]:
    """A tiny Idefics3 / SmolVLM folder (`write_tiny_idefics3`; its vocabulary has the image
    tokens already) and its two llama.cpp files: (folder, text.gguf, mmproj.gguf) beside
    it. Every tensor the mmproj holds in F32 at outtype "f32": the two hold the same values."""
    from fx_engine.testing.vision import write_tiny_idefics3

    folder = Path(folder)
    write_tiny_idefics3(folder, model_type, **kw)
    text_gguf = write_text_gguf(folder, folder.parent / f"{folder.name}-text.gguf")
    mmproj = write_mmproj(folder, folder.parent / f"{folder.name}-mmproj-{outtype}.gguf", outtype=outtype)
    return folder, text_gguf, mmproj


def write_tiny_mistral3_gguf_pair(folder: str | Path, *, outtype: str = "f32", **kw: Any) -> tuple[Path, Path, Path]:
    """A tiny Mistral 3 folder (`write_tiny_mistral3`: a `mistral` text model, its vocabulary
    with [IMG] / [IMG_BREAK] / [IMG_END]) and its two llama.cpp files: (folder, text.gguf,
    mmproj.gguf) beside it."""
    from fx_engine.testing.vision import write_tiny_mistral3

    folder = Path(folder)
    write_tiny_mistral3(folder, **kw)
    text_gguf = write_text_gguf(folder, folder.parent / f"{folder.name}-text.gguf")
    mmproj = write_mmproj(folder, folder.parent / f"{folder.name}-mmproj-{outtype}.gguf", outtype=outtype)
    return folder, text_gguf, mmproj


def write_gemma4_mmproj(folder: str | Path, out: str | Path, *, outtype: str = "f16",
                        metadata: dict[str, Any] | None = None, skip: Iterable[str] = ()) -> Path:
    """A Gemma 4 folder's vision tower and embedder as llama.cpp's mmproj GGUF, as its
    Gemma4VisionAudioModel converter writes them: clip.vision.projector_type "gemma4v"
    (clip.projector_type not written), clip.vision.image_size 224 (a placeholder), the
    tower's sizes, layer_norm_epsilon 1e-6 (the converter reads vision_config's
    layer_norm_eps, which Gemma 4's does not have), projection_dim, the processor's mean /
    std; no head_count_kv, pool or rotary keys. Tensors: the converter's renames
    (encoder. -> vision_model.model., .linear.weight -> .weight, the position table +
    .weight, 0-D clip bounds as [1]) through the installed gguf package's MMPROJ name map;
    input_proj [hidden, p * p * 3] written as the conv kernel [hidden, 3, p, p] (F16 at
    outtype f16, else F32), the position table and every 1-D tensor F32, the other
    matrices the outtype. metadata: keys added or replaced; skip: GGUF tensors left out."""
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    v = cfg["vision_config"]
    md: dict[str, Any] = {
        "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7}[outtype], "clip.has_vision_encoder": True,
        "clip.vision.projector_type": "gemma4v", "clip.vision.projection_dim": cfg["text_config"]["hidden_size"],
        "clip.vision.image_size": 224, "clip.vision.patch_size": v["patch_size"],
        "clip.vision.embedding_length": v["hidden_size"], "clip.vision.feed_forward_length": v["intermediate_size"],
        "clip.vision.block_count": v["num_hidden_layers"], "clip.vision.attention.head_count": v["num_attention_heads"],
        "clip.vision.attention.layer_norm_epsilon": float(v.get("layer_norm_eps", 1e-6)),
        "clip.vision.image_mean": [float(x) for x in pre.get("image_mean", [0.0] * 3)],
        "clip.vision.image_std": [float(x) for x in pre.get("image_std", [1.0] * 3)], **(metadata or {})}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(3, v["num_hidden_layers"]))
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
    _add_metadata(w, md)
    skip = set(skip)
    p = v["patch_size"]
    tensors = mx.load(str(folder / "model.safetensors"))
    for name in sorted(tensors):
        if not name.startswith(("model.vision_tower.", "model.embed_vision.")):
            continue
        x = _numpy(tensors[name])
        hf = name.replace("model.vision_tower.encoder.", "vision_model.model.").replace(".linear.weight", ".weight")
        if hf.endswith("position_embedding_table"):
            hf += ".weight"
        if x.ndim == 0:
            x = x.reshape(1)
        if hf.endswith("patch_embedder.input_proj.weight"):
            x = x.reshape(x.shape[0], p, p, 3).transpose(0, 3, 1, 2)
        target = names.get_name(hf, try_suffixes=(".weight", ".bias", ".input_max", ".input_min", ".output_max",
                                                  ".output_min"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        if target in skip:
            continue
        if "patch_embd" in target:
            kind = "F16" if outtype == "f16" else "F32"
        elif "position_embd" in target or x.ndim <= 1 or target.endswith("_norm.weight"):
            kind = "F32"
        elif outtype == "q8_0" and x.shape[-1] % 32 == 0:
            kind = "Q8_0"
        else:
            kind = "F32" if outtype == "f32" else "F16"
        if kind == "Q8_0":
            w.add_tensor(target, gguf.quants.quantize(np.ascontiguousarray(x), gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(target, np.ascontiguousarray(x).astype(np.float16 if kind == "F16" else np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_tiny_gemma4_gguf_pair(folder: str | Path, *, outtype: str = "f32", **kw: Any) -> tuple[Path, Path, Path]:
    """A tiny Gemma 4 folder (`write_tiny_gemma4`; its vocabulary has <|image|>, <|image>,
    <image|>) and its two llama.cpp files: (folder, text.gguf, mmproj.gguf) beside it (the
    text model as `fx_engine.testing.gguf.write_gemma4_gguf` writes it, from a text-only
    copy of the folder listing its layer kinds)."""
    from fx_engine.core.models import config_from_hf
    from fx_engine.testing.gguf import write_gemma4_gguf
    from fx_engine.testing.vision import write_tiny_gemma4

    folder = Path(folder)
    write_tiny_gemma4(folder, **kw)
    cfg = json.loads((folder / "config.json").read_text())
    text_dir = folder.parent / f"{folder.name}-text"
    text_dir.mkdir(parents=True, exist_ok=True)
    text = dict(cfg["text_config"])
    text["layer_types"] = list(config_from_hf(text, "tiny").layer_types)
    (text_dir / "config.json").write_text(json.dumps(text))
    weights = {"model." + n[len("model.language_model."):]: t for n, t in mx.load(str(folder / "model.safetensors")).items()
               if n.startswith("model.language_model.")}
    mx.save_safetensors(str(text_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (text_dir / f).write_text((folder / f).read_text())
    text_gguf = write_gemma4_gguf(text_dir, folder.parent / f"{folder.name}-text.gguf")
    mmproj = write_gemma4_mmproj(folder, folder.parent / f"{folder.name}-mmproj-{outtype}.gguf", outtype=outtype)
    return folder, text_gguf, mmproj
