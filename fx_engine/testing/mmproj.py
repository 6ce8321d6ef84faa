"""Write a tiny Gemma 3 multimodal folder (`write_tiny_gemma3_vlm`) as llama.cpp's two files:
the text model's GGUF and the mmproj GGUF (fx_engine/loading/mmproj.py reads the latter).

`write_mmproj` follows convert_hf_to_gguf.py's Gemma3VisionModel (`--mmproj`): general.architecture
"clip", its clip.* / clip.vision.* keys, gguf-py's MMPROJ tensor names (taken from the
installed `gguf` package's TensorNameMap: an independent oracle for the names),
"mm_input_projection_weight" renamed to "mm_input_projection.weight", mm_soft_emb_norm + 1,
the torch shapes kept (no transposes), and its tensor types: 1-D tensors and norms F32,
the embeddings (patch conv, positions) F32, the input projection F16 whatever the outtype,
the other matrices in the outtype (f32, f16 or q8_0: gguf-py's reference quantizer).

`write_text_gguf` writes the folder's text model as llama.cpp's Gemma3Model does (tensor
names, gemma3.* keys, norms + 1, a byte-level BPE vocabulary with the chat template).
`add_image_tokens` first gives the folder's tiny vocabulary Gemma 3's image tokens
(`<start_of_image>`, `<image_soft_token>`, `<end_of_image>` at the config's ids), as the
released Gemma 3 vocabulary has them: the mmproj loader finds the ids by these names.
Needs the `gguf` package (llama.cpp's gguf-py).
"""

from __future__ import annotations

import json
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


def write_mmproj(folder: str | Path, out: str | Path, *, outtype: str = "f16", projector_type: str = "gemma3",
                 skip: Iterable[str] = (), metadata: dict[str, Any] | None = None,
                 drop_metadata: Iterable[str] = ()) -> Path:
    """The folder's vision tower and projector as llama.cpp's mmproj GGUF at `out`.
    outtype: the matrices' type ("f32", "f16", "q8_0"); projector_type: clip.projector_type
    (tests of the refusal); skip: GGUF tensor names left out; metadata: keys added or
    replaced; drop_metadata: keys left out."""
    import gguf

    folder, out = Path(folder), Path(out)
    if outtype not in ("f32", "f16", "q8_0"):
        raise ValueError(f"outtype must be 'f32', 'f16' or 'q8_0', got {outtype!r}")
    cfg = json.loads((folder / "config.json").read_text())
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    v = cfg["vision_config"]
    hidden_text = cfg["text_config"]["hidden_size"]
    n_per_side = int(pre.get("image_seq_length", 256) ** 0.5)
    scale = (v["image_size"] // v["patch_size"]) // n_per_side
    md: dict[str, Any] = {
        "general.file_type": {"f32": 0, "f16": 1, "q8_0": 7}[outtype],
        "clip.has_vision_encoder": True, "clip.vision.projection_dim": hidden_text,
        "clip.vision.image_size": v["image_size"], "clip.vision.patch_size": v["patch_size"],
        "clip.vision.embedding_length": v["hidden_size"], "clip.vision.feed_forward_length": v["intermediate_size"],
        "clip.vision.block_count": v["num_hidden_layers"], "clip.vision.attention.head_count": v["num_attention_heads"],
        "clip.vision.image_mean": [float(x) for x in pre["image_mean"]],
        "clip.vision.image_std": [float(x) for x in pre["image_std"]],
        "clip.projector_type": projector_type,
        "clip.vision.attention.layer_norm_epsilon": float(v.get("layer_norm_eps", 1e-6)), "clip.use_gelu": True,
    }
    if scale > 0 and scale != 4:  # (the converter writes it only when it is not the default)
        md["clip.vision.projector.scale_factor"] = scale
    md.update(metadata or {})
    for k in drop_metadata:
        md.pop(k, None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "clip")
    w.add_type(gguf.GGUFType.MMPROJ)
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
    skip = set(skip)
    tensors = mx.load(str(folder / "model.safetensors"))
    for name in sorted(tensors):
        if not name.startswith(("multi_modal_projector.", "vision_tower.")) or "vision_model.head." in name:
            continue
        x = _numpy(tensors[name])
        hf = name.replace("_weight", ".weight")
        target = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"no llama.cpp name for {name}")
        if "soft_emb_norm.weight" in hf:
            x = x + np.float32(1.0)  # Gemma3RMSNorm's 1 + w
        if target in skip:
            continue
        if "input_projection" in hf:
            kind = "F16"
        elif ".embeddings." in hf or x.ndim <= 1 or target.endswith("_norm.weight"):
            kind = "F32"
        elif outtype == "q8_0" and x.shape[-1] % 32 == 0:
            kind = "Q8_0"
        else:
            kind = "F32" if outtype == "f32" else "F16"
        if kind == "Q8_0":
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(target, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(target, x.astype(np.float16 if kind == "F16" else np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return out


def write_text_gguf(folder: str | Path, out: str | Path) -> Path:
    """The folder's Gemma 3 text model as llama.cpp's Gemma3Model writes it
    (`fx_engine.testing.gguf.write_gemma_gguf`)."""
    from fx_engine.testing.gguf import write_gemma_gguf

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
