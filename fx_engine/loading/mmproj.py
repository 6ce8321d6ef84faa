"""llama.cpp's mmproj GGUF files (issue 46): the image path beside a GGUF text model, for
Gemma 3, Gemma 4, Idefics3 / SmolVLM, Mistral 3 (Pixtral), Qwen2-VL / Qwen2.5-VL and Qwen3-VL.

llama.cpp runs a multimodal model as two files: the text model's GGUF and an "mmproj"
GGUF (`general.architecture` "clip", `clip.projector_type` naming the projector): the
vision tower and projector, written by convert_hf_to_gguf.py `--mmproj`.
`fx_engine.load("text.gguf", mmproj="mmproj.gguf")` reads it here into the same params the
Hugging Face folder gives (`core.vision.gemma3.Gemma3VisionParams`,
`core.vision.idefics3.Idefics3VisionParams`, `core.vision.pixtral.PixtralParams`,
`core.vision.qwen2_vl.Qwen2VLParams`, `core.vision.qwen3_vl.Qwen3VLParams`), so images
run exactly as for a folder
(engine/image_prompt.py). The projector types read (`SUPPORTED_PROJECTORS`):

* "gemma3" (convert_hf_to_gguf.py's Gemma3VisionModel): the SigLIP tower and Gemma 3's
  pooling projector, beside a GGUF of architecture gemma3.
* "idefics3" (its SmolVLMModel: Idefics3 and SmolVLM / SmolVLM2): the SigLIP tower and the
  connector (pixel shuffle + projection), beside a GGUF of architecture llama (llama.cpp's
  LlamaModel writes their text model).
* "pixtral" (its LlavaVisionModel, for Mistral3ForConditionalGeneration folders): the
  Pixtral tower and Mistral 3's projector with its patch merger, beside a GGUF of
  architecture llama (a `mistral` text model, as llama.cpp's LlamaModel writes it) or
  mistral3 (a `ministral3` one).
* "qwen2vl_merger" / "qwen2.5vl_merger" (its Qwen2VLVisionModel) and "qwen3vl_merger" (its
  Qwen3VLVisionModel): Qwen2-VL's / Qwen2.5-VL's / Qwen3-VL's vision transformer and patch
  merger (Qwen3-VL's DeepStack mergers too), beside a text model with M-RoPE. llama.cpp
  writes that text model as architecture qwen2vl / qwen3vl (its M-RoPE sections in
  rope.dimension_sections: core/models/llama.py reads them).

* "gemma4v" (its Gemma4VisionAudioModel, for Gemma4ForConditionalGeneration folders;
  clip.vision.projector_type, the file may hold an audio encoder too, not read): Gemma 4's
  tower and embedder (core/vision/gemma4.py), beside a GGUF of architecture gemma4.
  Written: the common keys (image_size a placeholder 224; layer_norm_epsilon 1e-6, the
  converter's default: Gemma 4's vision config names its eps rms_norm_eps); not written
  and taken here as clip.cpp takes them: head size = hidden / heads, the 3 x 3 pool, the
  rotary base 100; the KV heads from attn_k's rows (the released towers': all heads), the
  position table's size from v.position_embd's rows, clipped linears and standardize from
  whether v.blk.N.attn_q.input_min and v.std_bias are there. The tanh GELU of Hugging Face's
  config (the file says neither clip.use_gelu nor use_silu; one saying use_silu is
  refused). Tensors (gguf-py's names): v.patch_embd.weight (input_proj [hidden, p * p * 3]
  as a conv kernel [hidden, 3, p, p]: put back), v.position_embd.weight ([2, P, hidden],
  F32), v.blk.N.{ln1, attn_post_norm, ln2, ffn_post_norm} (input_layernorm,
  post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm; no + 1),
  attn_q/k/v/out and ffn_gate/up/down (the .linear weights; their clip bounds as
  attn_q.input_min etc., [1] F32), attn_q_norm / attn_k_norm, v.std_bias / v.std_scale,
  mm.input_projection.weight (embed_vision.embedding_projection). Image tokens `<|image|>`,
  `<|image>`, `<image|>` by name. Preprocessing: Gemma4ImageProcessor's resize within 280
  soft tokens (its default; the file does not say) with the file's mean / std, where
  clip.cpp letterboxes into its own token range. The image tokens' attention follows the
  text model (core/models/gemma.py's GGUF reader: "vision" for a model without per-layer
  inputs, as the published configs say).

Other projector types ("glm4v", "mlp", ...) are refused naming
clip.projector_type and listing these.

What the converter writes, and how it is read back:

* metadata (every projector's): clip.vision.image_size, patch_size, embedding_length (the
  tower's hidden size), feed_forward_length, block_count, attention.head_count,
  attention.layer_norm_epsilon, projection_dim (the text model's hidden size: checked
  against it), image_mean / image_std (the processor's).
  Gemma 3 and Idefics3 (SigLIP towers): the eps is the tower's LayerNorms' (and, for
  Gemma 3 as in Hugging Face, the projector's RMSNorm's); clip.use_gelu (the tanh GELU; a
  file saying clip.use_silu is refused).
  Gemma 3: clip.vision.projector.scale_factor only where the pool is not 4 x 4 patches
  (llama.cpp's default for Gemma 3; a tiny model's file says). mm_tokens_per_image =
  (image_size / patch_size / scale_factor)^2: 256 for the released models (896 / 14 / 4 =
  16 a side), as clip.cpp pools.
  Idefics3: clip.vision.projector.scale_factor (the connector's pixel shuffle, config.json's
  scale_factor; 2 when absent, Hugging Face's default) and clip.vision.preproc_image_size
  (preprocessor_config.json's size.longest_edge: the resize before tiling).
  Mistral 3: clip.use_silu or clip.use_gelu (the tower's hidden_act), and
  clip.vision.spatial_merge_size (config.json's; 2 when absent); every block is run
  (vision_feature_layer -1, Mistral 3's), the rotary base is Pixtral's 10000 (clip.cpp's
  too), and the projector's RMSNorm eps is the text model's rms_norm_eps (as in Hugging
  Face); the tower's eps is Hugging Face's fixed 1e-5.
  Qwen-VL (vision_config's depth / num_heads as block_count / head_count; no
  clip.use_gelu): Qwen2.5-VL's clip.use_silu and clip.vision.n_wa_pattern (the converter's
  fullatt_block_indexes[0] + 1, written only for evenly spaced indexes: every n-th layer
  attends over the whole image; clip.vision.wa_layer_indexes, where a file lists them,
  wins), clip.vision.window_size (not written by the converter: clip.cpp's 112 pixels, the
  released models' window, when absent), clip.vision.spatial_merge_size (2 when absent,
  as clip.cpp assumes), image_min_pixels / image_max_pixels (not written by the converter:
  the released models' preprocessor_config.json 3136 and 12845056 when absent, as their
  folders give; not Qwen2VLImageProcessor's smaller class defaults). Qwen2-VL's
  feed_forward_length is the merger's output size (the converter's reading of its config):
  the MLP width is taken from v.blk.0.ffn_up.weight instead (2.5's is checked against it);
  attention.layer_norm_epsilon is the text model's rms_norm_eps (the tower's norms use
  Hugging Face's fixed 1e-6). Qwen3-VL: clip.use_gelu, clip.vision.spatial_merge_size,
  clip.vision.is_deepstack_layers (a flag per tower layer: the DeepStack layers, in
  order); its feed_forward_length is the MLP width; the position grid's side comes from
  v.position_embd.weight's rows; min / max pixels (absent: the released
  preprocessor_config.json's 65536 / 16777216).
* tensors (gguf-py's MMPROJ TensorNameMap), Hugging Face's values and layout: every tensor
  keeps its torch shape (GGUF's reversed dims read back as rows first). The SigLIP towers
  (Gemma 3, Idefics3): v.patch_embd.{weight,bias} (the conv [hidden, C, p, p]; forced F32),
  v.position_embd.weight (F32), v.blk.N.{ln1,ln2}.{weight,bias} (layer_norm1/2),
  v.blk.N.attn_{q,k,v,out}.{weight,bias} (q/k/v/out_proj), v.blk.N.ffn_up / ffn_down
  (mlp.fc1 / fc2), v.post_ln (post_layernorm); then the projector's:
  Gemma 3: mm.input_projection.weight (mm_input_projection_weight [vision hidden, text
  hidden], stored as in -> out, not transposed: clip.cpp multiplies by its transpose;
  forced F16), mm.soft_emb_norm.weight (mm_soft_emb_norm with Gemma's + 1 folded in by the
  converter: read as it is, which is the scale `gemma3.assemble` computes from the folder,
  bit for bit in float32).
  Idefics3: mm.model.fc.weight (connector.modality_projection.proj [text hidden, vision
  hidden * s^2], out x in as in torch, no bias); the position table is the folder's
  (re-indexed at load by `idefics3.assemble` as for a folder).
  Mistral 3 (no biases in the tower): v.patch_embd (patch_conv), v.pre_ln (ln_pre),
  ln1 / ln2 (attention_norm / ffn_norm), attn_q/k/v/out (attention.q/k/v/o_proj: q and k
  rows permuted by the converter as LlamaModel.permute does, for clip.cpp's interleaved
  rotary: put back here), ffn_gate / ffn_up / ffn_down (feed_forward.*), mm.input_norm
  (the projector's norm), mm.patch_merger (patch_merger.merging_layer), mm.1 / mm.2
  (linear_1 / linear_2, with biases where multimodal_projector_bias: the file's tensors
  say); v.token_embd.img_break (a copy of [IMG_BREAK]'s text embedding) is not needed:
  the text model has it.
  Qwen-VL (no position table; names of their own): the Conv3d patch embedding
  [hidden, C, 2, P, P] split by frame into v.patch_embd.weight and v.patch_embd.weight.1
  (stacked back here), attn.qkv split into v.blk.N.attn_{q,k,v} (weights and biases;
  concatenated back, quantized parts alike), attn.proj as attn_out, norm1 / norm2 as
  ln1 / ln2 (RMSNorm; Qwen2-VL's LayerNorms with biases), mlp.gate_proj / up_proj /
  down_proj (Qwen2-VL: fc1 / fc2) as ffn_gate / ffn_up / ffn_down, merger.ln_q as
  v.post_ln, merger.mlp.0 / mlp.2 as mm.0 / mm.2 (mm.2's rows: the text hidden size).
  Qwen3-VL: the patch conv split likewise (its bias v.patch_embd.bias), pos_embed as
  v.position_embd, attn.qkv kept fused (attn_qkv), norm1 / norm2 as ln1 / ln2
  (LayerNorms with biases), mlp.linear_fc1 / fc2 as ffn_up / ffn_down, merger.norm /
  linear_fc1 / linear_fc2 as v.post_ln / mm.0 / mm.2, deepstack_merger_list.j as
  v.deepstack.{its layer}.{norm,fc1,fc2}.
  Matrices are F32, F16 or (a quantized file) Q8_0 & co: read by fx_engine.loading.gguf
  (quantized linears follow the text model's keep-quantized policy; quantized
  non-linears are dequantized).
* preprocessing. Gemma 3 (llama.cpp's fixed-size path): the image resized to image_size x
  image_size, scaled by 1/255, normalized with the file's mean / std. Here the resize is
  PIL's bilinear (resample 2), Hugging Face's Gemma3ImageProcessor's rule
  (loading/images.py); llama.cpp's own bilinear resize has no antialiasing, so a
  downscaled image's pixels can differ from llama.cpp's in the last bits.
  Idefics3: Idefics3ImageProcessor's rules (loading/images.idefics3_tiles): the longest
  edge resized to preproc_image_size, both sides rounded up to multiples of image_size,
  cut into image_size tiles plus the global image, PIL's LANCZOS (resample 1), 1/255, the
  file's mean / std. clip.cpp takes the same sizes (its tiles and global image are laid
  out as the processor's) but resizes with its own bicubic / bilinear filters, so its
  pixels differ from the processor's in the low bits; here the folder's processor wins.
  Mistral 3: PixtralImageProcessor's resize (loading/images_pixtral.py: the longest edge
  at most clip.vision.image_size, both sides rounded up to multiples of patch_size *
  spatial_merge_size, PIL's bicubic), the file's mean / std; clip.cpp fits the image
  into the same bound and multiples with its own filter (pixels differ in the low bits).
  Qwen-VL: Qwen2VLImageProcessor's smart resize (loading/images_qwen2_vl.py: both sides
  rounded to multiples of patch_size * merge, the pixel count kept within min / max
  pixels, PIL's bicubic), the file's mean / std. clip.cpp rounds to the same multiples
  but bounds an image by its own token limits and resizes with its own filter: an image
  may get another grid there than the processor gives (here: the processor's).
* the image token ids, found by name in the text model's vocabulary (its GGUF's
  tokenizer.ggml.tokens): Gemma 3's `<start_of_image>`, `<image_soft_token>` and
  `<end_of_image>` (ids 255999, 262144 and 256000 in Gemma 3's; the soft token only marks
  positions: its embedding is replaced); Idefics3's `<image>` (its rows' positions) and
  the tokens its prompt writes as text, which must be single tokens:
  `<fake_token_around_image>`, `<global-img>` and `<row_R_col_C>` for every tile the
  preprocessing can make (R, C up to ceil(preproc_image_size / image_size)); Mistral 3's
  `[IMG]`, `[IMG_BREAK]` and `[IMG_END]`; Qwen-VL's
  `<|vision_start|>`, `<|image_pad|>`, `<|vision_end|>` and `<|video_pad|>` (151652,
  151655, 151653 and 151656 in Qwen2's vocabulary).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from fx_engine.core.checkpoint import KeepQuantized, LoadOptions, TensorSource, WeightsError, renamed
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Linear, Numerics

#: the projector types read here (clip.projector_type) and what each is
SUPPORTED_PROJECTORS = ("gemma3", "gemma4v", "idefics3", "pixtral", "qwen2vl_merger", "qwen2.5vl_merger",
                        "qwen3vl_merger")
_DESCRIBED = {"gemma3": "Gemma 3", "gemma4v": "Gemma 4", "idefics3": "Idefics3 / SmolVLM", "pixtral": "Mistral 3 (Pixtral)",
              "qwen2vl_merger": "Qwen2-VL", "qwen2.5vl_merger": "Qwen2.5-VL", "qwen3vl_merger": "Qwen3-VL"}
#: the Qwen projectors' tower model_type (core/vision/qwen2_vl.py runs Qwen2(.5)-VL's,
#: qwen3_vl.py Qwen3-VL's)
_QWEN = {"qwen2vl_merger": "qwen2_vl", "qwen2.5vl_merger": "qwen2_5_vl", "qwen3vl_merger": "qwen3_vl"}
#: the text models (their config's model_type, as the GGUF reads) each projector goes with,
#: and the GGUF architecture that gives it (for the error)
_TEXT_MODELS = {"gemma3": (("gemma3_text",), "Gemma 3 text model (GGUF architecture 'gemma3')"),
                "gemma4v": (("gemma4_text",), "Gemma 4 text model (GGUF architecture 'gemma4')"),
                "idefics3": (("llama",), "Llama text model (GGUF architecture 'llama', as llama.cpp writes "
                                         "SmolVLM's)"),
                "pixtral": (("llama", "mistral", "ministral3"), "Mistral text model (GGUF architecture 'llama' "
                                                                "or 'mistral3', as llama.cpp writes Mistral 3's)"),
                **{k: (("qwen2",), "Qwen2 text model with M-RoPE (GGUF architecture 'qwen2vl', its "
                                   "rope.dimension_sections)") for k in ("qwen2vl_merger", "qwen2.5vl_merger")},
                "qwen3vl_merger": (("qwen3", "qwen3_moe"), "Qwen3 or Qwen3-MoE text model with interleaved M-RoPE "
                                                           "and DeepStack (GGUF architecture 'qwen3vl' or "
                                                           "'qwen3vlmoe')")}
#: llama.cpp's Gemma 3 pool (patches a side per image token a side) when the file does not say
DEFAULT_SCALE_FACTOR = 4
#: Idefics3's pixel shuffle when the file does not say (Hugging Face's default)
IDEFICS3_SCALE_FACTOR = 2
#: where each projector's tower and projector go under Hugging Face's names (the first of
#: gemma3.TOWER_PREFIXES / PROJECTOR_PREFIXES, idefics3.TOWER_PREFIXES / CONNECTOR_PREFIXES,
#: pixtral's earlier-transformers prefixes, qwen2_vl.TOWER_PREFIXES)
_TOWER = "vision_tower.vision_model."
_PROJ = "multi_modal_projector."
_IDEFICS3_TOWER = "model.vision_model."
_IDEFICS3_PROJ = "model.connector.modality_projection.proj."
_PIXTRAL_TOWER, _PIXTRAL_PROJ = "vision_tower.", "multi_modal_projector."
_PIXTRAL_LAYER = _PIXTRAL_TOWER + r"transformer.layers.\1."
_GEMMA4_TOWER = "model.vision_tower."
_GEMMA4_LAYER = _GEMMA4_TOWER + r"encoder.layers.\1."
_QWEN_TOWER = "visual."


def _tower_renames(tower: str) -> tuple[tuple[str, str], ...]:
    """GGUF name -> Hugging Face name of the SigLIP tower's tensors under `tower`."""
    return ((r"^v\.patch_embd\.", tower + "embeddings.patch_embedding."),
            (r"^v\.position_embd\.", tower + "embeddings.position_embedding."),
            (r"^v\.post_ln\.", tower + "post_layernorm."),
            (r"^v\.blk\.(\d+)\.ln1\.", tower + r"encoder.layers.\1.layer_norm1."),
            (r"^v\.blk\.(\d+)\.ln2\.", tower + r"encoder.layers.\1.layer_norm2."),
            (r"^v\.blk\.(\d+)\.attn_q\.", tower + r"encoder.layers.\1.self_attn.q_proj."),
            (r"^v\.blk\.(\d+)\.attn_k\.", tower + r"encoder.layers.\1.self_attn.k_proj."),
            (r"^v\.blk\.(\d+)\.attn_v\.", tower + r"encoder.layers.\1.self_attn.v_proj."),
            (r"^v\.blk\.(\d+)\.attn_out\.", tower + r"encoder.layers.\1.self_attn.out_proj."),
            (r"^v\.blk\.(\d+)\.ffn_up\.", tower + r"encoder.layers.\1.mlp.fc1."),
            (r"^v\.blk\.(\d+)\.ffn_down\.", tower + r"encoder.layers.\1.mlp.fc2."))


#: Gemma 4's linears: GGUF name -> Hugging Face name (under the layer)
_GEMMA4_LINEARS = (("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
                   ("attn_out", "self_attn.o_proj"), ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                   ("ffn_down", "mlp.down_proj"))
#: GGUF name -> Hugging Face name, per projector (Qwen-VL's: `_qwen_renames`)
_TO_HF = {
    "gemma3": _tower_renames(_TOWER) + ((r"^mm\.input_projection\.weight$", _PROJ + "mm_input_projection_weight"),
                                        (r"^mm\.soft_emb_norm\.", _PROJ + "mm_soft_emb_norm.")),
    "idefics3": _tower_renames(_IDEFICS3_TOWER) + ((r"^mm\.model\.fc\.", _IDEFICS3_PROJ),),
    "pixtral": (
        (r"^v\.patch_embd\.", _PIXTRAL_TOWER + "patch_conv."), (r"^v\.pre_ln\.", _PIXTRAL_TOWER + "ln_pre."),
        (r"^v\.blk\.(\d+)\.ln1\.", _PIXTRAL_LAYER + "attention_norm."),
        (r"^v\.blk\.(\d+)\.ln2\.", _PIXTRAL_LAYER + "ffn_norm."),
        *((rf"^v\.blk\.(\d+)\.attn_{g}\.", _PIXTRAL_LAYER + f"attention.{h}_proj.")
          for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("out", "o"))),
        *((rf"^v\.blk\.(\d+)\.ffn_{g}\.", _PIXTRAL_LAYER + f"feed_forward.{g}_proj.") for g in ("gate", "up", "down")),
        (r"^mm\.input_norm\.", _PIXTRAL_PROJ + "norm."),
        (r"^mm\.patch_merger\.", _PIXTRAL_PROJ + "patch_merger.merging_layer."),
        (r"^mm\.(1|2)\.", _PIXTRAL_PROJ + r"linear_\1.")),
    # (Gemma 4: each linear's weight under .linear, its clip bounds beside it; the patch
    # conv is put back into the folder's layout first: _gemma4_source)
    "gemma4v": (
        (r"^v\.position_embd\.weight$", _GEMMA4_TOWER + "patch_embedder.position_embedding_table"),
        (r"^v\.std_(bias|scale)$", _GEMMA4_TOWER + r"std_\1"),
        *((rf"^v\.blk\.(\d+)\.{g}\.", _GEMMA4_LAYER + f"{h}.")
          for g, h in (("ln1", "input_layernorm"), ("attn_post_norm", "post_attention_layernorm"),
                       ("ln2", "pre_feedforward_layernorm"), ("ffn_post_norm", "post_feedforward_layernorm"),
                       ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"))),
        *((rf"^v\.blk\.(\d+)\.{g}\.(weight|scales|biases)$", _GEMMA4_LAYER + f"{h}.linear.\\2")
          for g, h in _GEMMA4_LINEARS),
        *((rf"^v\.blk\.(\d+)\.{g}\.((input|output)_(min|max))$", _GEMMA4_LAYER + f"{h}.\\2")
          for g, h in _GEMMA4_LINEARS),
        (r"^mm\.input_projection\.", "model.embed_vision.embedding_projection.")),
}


def _qwen_renames(v2: bool) -> tuple[tuple[str, str], ...]:
    """GGUF name -> Hugging Face name of a Qwen-VL tower's tensors other than the patch conv
    and q / k / v (put together first: `_qwen_source`)."""
    up, down = ("mlp.fc1.", "mlp.fc2.") if v2 else ("mlp.up_proj.", "mlp.down_proj.")
    blk = _QWEN_TOWER + r"blocks.\1."
    return ((r"^v\.blk\.(\d+)\.ln1\.", blk + "norm1."), (r"^v\.blk\.(\d+)\.ln2\.", blk + "norm2."),
            (r"^v\.blk\.(\d+)\.attn_out\.", blk + "attn.proj."),
            (r"^v\.blk\.(\d+)\.ffn_gate\.", blk + "mlp.gate_proj."),
            (r"^v\.blk\.(\d+)\.ffn_up\.", blk + up), (r"^v\.blk\.(\d+)\.ffn_down\.", blk + down),
            (r"^v\.post_ln\.", _QWEN_TOWER + "merger.ln_q."), (r"^mm\.(0|2)\.", _QWEN_TOWER + r"merger.mlp.\1."))


#: the tensors an mmproj must hold ({i}: each block): the tower's, then each projector's
_BLOCK = tuple(f"v.blk.{{i}}.{n}.{s}" for n in ("ln1", "attn_q", "attn_k", "attn_v", "attn_out", "ln2",
                                                "ffn_up", "ffn_down") for s in ("weight", "bias"))
_EMBEDDINGS = ("v.patch_embd.weight", "v.patch_embd.bias", "v.position_embd.weight")
_POST = ("v.post_ln.weight", "v.post_ln.bias")
_PROJECTOR_TENSORS = {"gemma3": ("mm.input_projection.weight", "mm.soft_emb_norm.weight"),
                      "idefics3": ("mm.model.fc.weight",)}
#: each projector's image tokens in the text model's vocabulary: {role: token string}
IMAGE_TOKENS = {"boi": "<start_of_image>", "image": "<image_soft_token>", "eoi": "<end_of_image>"}
IDEFICS3_IMAGE_TOKENS = {"image": "<image>", "fake": "<fake_token_around_image>", "global": "<global-img>"}
QWEN2_VL_IMAGE_TOKENS = {"vision_start_token_id": "<|vision_start|>", "image_token_id": "<|image_pad|>",
                         "vision_end_token_id": "<|vision_end|>", "video_token_id": "<|video_pad|>"}
PIXTRAL_IMAGE_TOKENS = {"image": "[IMG]", "break": "[IMG_BREAK]", "end": "[IMG_END]"}
GEMMA4_IMAGE_TOKENS = {"image": "<|image|>", "boi": "<|image>", "eoi": "<image|>"}
_IMAGE_TOKENS = {"gemma3": IMAGE_TOKENS, "gemma4v": GEMMA4_IMAGE_TOKENS, "idefics3": IDEFICS3_IMAGE_TOKENS,
                 "pixtral": PIXTRAL_IMAGE_TOKENS,
                 **{k: QWEN2_VL_IMAGE_TOKENS for k in _QWEN}}


def _qwen_tensors(block_count: int, projector: str) -> list[str]:
    """A Qwen-VL mmproj's tensors: the patch conv as two 2-D convs (its two frames), q / k /
    v split, the MLP's gate (2.5) or biased LayerNorms (2), the merger as mm.0 / mm.2."""
    v2 = projector == "qwen2vl_merger"
    norm = ("weight", "bias") if v2 else ("weight",)
    mlp = ("ffn_up", "ffn_down") if v2 else ("ffn_gate", "ffn_up", "ffn_down")
    block = ([f"ln1.{s}" for s in norm] + [f"{n}.{s}" for n in ("attn_q", "attn_k", "attn_v", "attn_out")
                                           for s in ("weight", "bias")]
             + [f"ln2.{s}" for s in norm] + [f"{n}.{s}" for n in mlp for s in ("weight", "bias")])
    return (["v.patch_embd.weight", "v.patch_embd.weight.1"]
            + [f"v.blk.{i}.{n}" for i in range(block_count) for n in block]
            + [f"v.post_ln.{s}" for s in norm] + [f"mm.{k}.{s}" for k in (0, 2) for s in ("weight", "bias")])


def _pixtral_tensors(block_count: int) -> list[str]:
    """A Mistral 3 mmproj's tensors: the Pixtral tower (no biases) and the projector with its
    patch merger (linear_1 / linear_2 biases only where multimodal_projector_bias: optional)."""
    block = ["ln1.weight", *(f"attn_{n}.weight" for n in ("q", "k", "v", "out")), "ln2.weight",
             *(f"ffn_{n}.weight" for n in ("gate", "up", "down"))]
    return (["v.patch_embd.weight", "v.pre_ln.weight"] + [f"v.blk.{i}.{n}" for i in range(block_count) for n in block]
            + ["mm.input_norm.weight", "mm.patch_merger.weight", "mm.1.weight", "mm.2.weight"])


def _qwen3_tensors(block_count: int, deepstack: Sequence[int] = ()) -> list[str]:
    """A Qwen3-VL mmproj's tensors: the patch conv as two 2-D convs and its bias, the learned
    position table, q / k / v fused (attn_qkv), LayerNorms with biases, the merger as
    v.post_ln / mm.0 / mm.2, and each DeepStack merger under its tower layer's index."""
    wb = ("weight", "bias")
    block = [f"{n}.{s}" for n in ("ln1", "attn_qkv", "attn_out", "ln2", "ffn_up", "ffn_down") for s in wb]
    return (["v.patch_embd.weight", "v.patch_embd.weight.1", "v.patch_embd.bias", "v.position_embd.weight"]
            + [f"v.blk.{i}.{n}" for i in range(block_count) for n in block]
            + [f"v.post_ln.{s}" for s in wb] + [f"mm.{k}.{s}" for k in (0, 2) for s in wb]
            + [f"v.deepstack.{i}.{n}.{s}" for i in deepstack for n in ("norm", "fc1", "fc2") for s in wb])


def _gemma4_tensors(block_count: int) -> list[str]:
    """A Gemma 4 mmproj's tensors (no biases; the clip bounds and v.std_bias / v.std_scale
    only where the model has them: optional)."""
    block = ["ln1", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_out", "attn_post_norm", "ln2",
             "ffn_gate", "ffn_up", "ffn_down", "ffn_post_norm"]
    return (["v.patch_embd.weight", "v.position_embd.weight"]
            + [f"v.blk.{i}.{n}.weight" for i in range(block_count) for n in block] + ["mm.input_projection.weight"])


def expected_tensors(block_count: int, projector: str = "gemma3", deepstack: Sequence[int] = ()) -> list[str]:
    """The GGUF tensor names an mmproj of `projector` type with `block_count` blocks holds
    (deepstack: Qwen3-VL's DeepStack layers)."""
    if projector == "gemma4v":
        return _gemma4_tensors(block_count)
    if projector == "qwen3vl_merger":
        return _qwen3_tensors(block_count, deepstack)
    if projector in _QWEN:
        return _qwen_tensors(block_count, projector)
    if projector == "pixtral":
        return _pixtral_tensors(block_count)
    return (list(_EMBEDDINGS) + [n.format(i=i) for i in range(block_count) for n in _BLOCK] + list(_POST)
            + list(_PROJECTOR_TENSORS[projector]))


def _value(md: dict[str, Any], key: str, source: str, default: Any = ...) -> Any:
    if key not in md:
        if default is ...:
            kind = projector_type(md)
            what = _DESCRIBED.get(kind or "", "this projector")
            raise ConfigError(f"{source}: GGUF metadata '{key}' is missing (an mmproj file for {what} has it)")
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


def check_mmproj_metadata(md: dict[str, Any], source: str) -> str:
    """The projector type of `md`, or ConfigError unless it is an mmproj GGUF's metadata
    with a projector fx-engine runs."""
    arch = md.get("general.architecture")
    kind = projector_type(md)
    if arch != "clip" or kind is None:
        hint = (" (this looks like a text model's GGUF: pass the text model as the model and the mmproj "
                "file as mmproj)" if arch not in (None, "clip") else "")
        raise ConfigError(f"{source}: not an mmproj GGUF (general.architecture {arch!r}, expected 'clip' with "
                          f"clip.projector_type){hint}")
    if kind not in SUPPORTED_PROJECTORS:
        listed = ", ".join(f"{k} ({_DESCRIBED[k]})" for k in SUPPORTED_PROJECTORS)
        raise ConfigError(f"{source}: clip.projector_type {kind!r} is not supported (supported: {listed})")
    if md.get("clip.has_vision_encoder") is not None and not bool(_value(md, "clip.has_vision_encoder", source)):
        raise ConfigError(f"{source}: clip.has_vision_encoder is false: the file holds no vision tower")
    return kind


def _token_index(tokens: Sequence[str] | None, source: str) -> dict[str, int]:
    """{token string: its first id} of the text model's vocabulary."""
    if not tokens:
        raise ConfigError(f"{source}: the text model's GGUF has no vocabulary (tokenizer.ggml.tokens): the "
                          "image token ids cannot be found")
    index: dict[str, int] = {}
    for i, t in enumerate(tokens):
        index.setdefault(t, i)
    return index


_TEXT_HINT = {"gemma3": "is the text model Gemma 3 4B/12B/27B?", "gemma4v": "is the text model Gemma 4?",
              "idefics3": "is the text model this mmproj's Idefics3 / SmolVLM?",
              "pixtral": "is the text model this mmproj's Mistral 3?",
              **{k: "is the text model this mmproj's Qwen-VL?" for k in _QWEN}}


def image_token_ids(tokens: Sequence[str] | None, source: str, projector: str = "gemma3",
                    extra: Sequence[str] = ()) -> dict[str, int]:
    """The ids of `projector`'s image tokens ({role: id}) in the text model's vocabulary
    (its GGUF's tokenizer.ggml.tokens); `extra`: more token strings that must be there too
    (the ones a prompt writes as text: Idefics3's <row_R_col_C>). ConfigError naming the
    token that is missing."""
    index = _token_index(tokens, source)
    for text in [*_IMAGE_TOKENS[projector].values(), *extra]:
        if text not in index:
            raise ConfigError(f"{source}: the text model's vocabulary has no {text!r} token ({_DESCRIBED[projector]}"
                              f"'s image tokens: {_TEXT_HINT[projector]})")
    return {key: index[text] for key, text in _IMAGE_TOKENS[projector].items()}


def _eps(md: dict[str, Any], source: str) -> float:
    eps = _value(md, "clip.vision.attention.layer_norm_epsilon", source, 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise ConfigError(f"{source}: GGUF metadata 'clip.vision.attention.layer_norm_epsilon' must be a number, "
                          f"got {eps!r}")
    # (a float32 in the file: its shortest decimal, the config's 1e-6 rather than 9.99999997e-07)
    return float(str(np.float32(eps)))


#: the tower's config model_type as the folder's config.json names it
_TOWER_TYPES = {"gemma3": "siglip_vision_model", "idefics3": "idefics3_vision"}


def _siglip_config(md: dict[str, Any], source: str) -> Any:
    """The SigLIP tower's config from clip.vision.* (both projectors' towers are SigLIP with
    the tanh GELU: a file that says clip.use_silu is refused)."""
    from fx_engine.core.vision import siglip

    if bool(_value(md, "clip.use_silu", source, False)):
        raise ConfigError(f"{source}: clip.use_silu is true, but the {projector_type(md)} projector's SigLIP tower "
                          "runs the tanh GELU (clip.use_gelu)")
    d = {"model_type": _TOWER_TYPES[projector_type(md) or "gemma3"], "hidden_act": "gelu_pytorch_tanh",
         "hidden_size": _int(md, "clip.vision.embedding_length", source),
         "intermediate_size": _int(md, "clip.vision.feed_forward_length", source),
         "num_hidden_layers": _int(md, "clip.vision.block_count", source),
         "num_attention_heads": _int(md, "clip.vision.attention.head_count", source),
         "patch_size": _int(md, "clip.vision.patch_size", source),
         "image_size": _int(md, "clip.vision.image_size", source), "layer_norm_eps": _eps(md, source)}
    return siglip.config_from_hf(d, f"{source}: clip.vision.*")


def _check_projection_dim(md: dict[str, Any], text_hidden: int, source: str) -> None:
    proj = _int(md, "clip.vision.projection_dim", source, text_hidden)
    if proj != text_hidden:
        raise ConfigError(f"{source}: clip.vision.projection_dim = {proj}, but the text model's hidden size "
                          f"(embedding_length) is {text_hidden}: this mmproj belongs to another model size")


def _pixtral_config(md: dict[str, Any], text_hidden: int, ids: dict[str, int], source: str, text_eps: float,
                    projector_bias: bool) -> Any:
    """Mistral 3's image-path config: the tower's sizes from clip.vision.*, its activation
    from clip.use_silu / use_gelu, every block run (vision_feature_layer -1, Mistral 3's),
    the rotary base 10000 (Pixtral's, which clip.cpp fixes too), the projector's RMSNorm eps
    the text model's (text_eps)."""
    from fx_engine.core.vision import pixtral

    silu, gelu_ = (bool(_value(md, k, source, False)) for k in ("clip.use_silu", "clip.use_gelu"))
    if silu == gelu_:
        raise ConfigError(f"{source}: exactly one of clip.use_silu and clip.use_gelu must be true (the Pixtral "
                          f"tower's activation), got use_silu={silu}, use_gelu={gelu_}")
    hidden, heads = _int(md, "clip.vision.embedding_length", source), _int(md, "clip.vision.attention.head_count",
                                                                           source)
    if hidden % heads or (hidden // heads) % 4:
        raise ConfigError(f"{source}: the head size (clip.vision.embedding_length {hidden} / attention.head_count "
                          f"{heads}) must be a whole multiple of 4 (the 2-D rotary's halves)")
    return pixtral.PixtralConfig(
        hidden_size=hidden, intermediate_size=_int(md, "clip.vision.feed_forward_length", source),
        num_layers=_int(md, "clip.vision.block_count", source), num_heads=heads,
        patch_size=_int(md, "clip.vision.patch_size", source), text_hidden_size=text_hidden,
        image_size=_int(md, "clip.vision.image_size", source), hidden_act="silu" if silu else "gelu",
        text_rms_norm_eps=float(text_eps), spatial_merge_size=_int(md, "clip.vision.spatial_merge_size", source, 2),
        projector_bias=projector_bias, image_token_index=ids["image"])


def mmproj_config(md: dict[str, Any], text_hidden: int, ids: dict[str, int], source: str,
                  tensor_size: int | None = None, text_eps: float = 1e-5, projector_bias: bool = False) -> Any:
    """The image path's config (`Gemma3VisionConfig`, `Idefics3VisionConfig`,
    `PixtralConfig`, `Qwen2VLConfig`, `Qwen3VLConfig`) from an mmproj's metadata
    (ConfigError naming the key for what is missing, malformed or disagrees with the text
    model). tensor_size: the size a Qwen tower takes from its tensors (Qwen2(.5)-VL: the MLP
    width, ffn_up's rows; Qwen3-VL: the position table's rows); text_eps / projector_bias:
    Mistral 3's projector norm eps (the text model's) and whether its linears have biases
    (the file's tensors say)."""
    kind = check_mmproj_metadata(md, source)
    if kind == "qwen3vl_merger":
        _check_projection_dim(md, text_hidden, source)
        if tensor_size is None:
            raise ConfigError(f"{source}: a Qwen3-VL mmproj's position grid comes from v.position_embd.weight")
        return _qwen3_config(md, text_hidden, ids, source, tensor_size)
    if kind in _QWEN:
        _check_projection_dim(md, text_hidden, source)
        return _qwen_config(md, text_hidden, ids, source, tensor_size)
    if kind == "pixtral":
        # (not clip.vision.projection_dim: convert_hf_to_gguf.py's --mistral-format path writes
        # params.json's hidden_dim there, the text model's feed-forward width; clip.cpp sizes
        # the projector by mm.2's rows, as _pixtral_params checks them against the text model)
        return _pixtral_config(md, text_hidden, ids, source, text_eps, projector_bias)
    tower = _siglip_config(md, source)
    _check_projection_dim(md, text_hidden, source)
    if kind == "idefics3":
        return _idefics3_config(md, tower, text_hidden, ids, source)
    from fx_engine.core.vision import gemma3

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


#: clip.cpp's Qwen2.5-VL attention window in pixels when the file does not say (the released
#: models' window_size)
QWEN_WINDOW = 112
#: (min_pixels, max_pixels) when the file does not say (llama.cpp's converters never write
#: them): the released checkpoints' preprocessor_config.json values, which their folders
#: give (Qwen2-VL / Qwen2.5-VL: min_pixels 3136, max_pixels 12845056; Qwen3-VL: size's
#: shortest / longest edge), not Qwen2VLImageProcessor's smaller class defaults
QWEN_PIXELS = {"qwen2vl_merger": (3136, 12845056), "qwen2.5vl_merger": (3136, 12845056),
               "qwen3vl_merger": (65536, 16777216)}


def _qwen_full_layers(md: dict[str, Any], depth: int, source: str) -> tuple[int, ...]:
    """Qwen2.5-VL's full-attention layers: clip.vision.wa_layer_indexes where a file lists
    them, else every n_wa_pattern-th layer (the converter's n_wa_pattern =
    fullatt_block_indexes[0] + 1, written only for evenly spaced indexes)."""
    listed = _value(md, "clip.vision.wa_layer_indexes", source, None)
    if listed is not None:
        if (not isinstance(listed, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                                    and 0 <= i < depth for i in listed)):
            raise ConfigError(f"{source}: GGUF metadata 'clip.vision.wa_layer_indexes' must list layer indexes in "
                              f"[0, {depth}), got {listed!r}")
        return tuple(sorted(set(listed)))
    n = _int(md, "clip.vision.n_wa_pattern", source)
    return tuple(i for i in range(depth) if (i + 1) % n == 0)


def _qwen_config(md: dict[str, Any], text_hidden: int, ids: dict[str, int], source: str, ffn: int | None) -> Any:
    """Qwen2-VL's / Qwen2.5-VL's tower config. ffn: the MLP width from the ffn_up tensor
    (Qwen2-VL's converter writes the merger's output size as feed_forward_length: only
    2.5's metadata holds the MLP width, and it is checked against the tensor)."""
    from fx_engine.core.vision import qwen2_vl

    kind = projector_type(md) or ""
    v2 = kind == "qwen2vl_merger"
    if not v2 and bool(_value(md, "clip.use_gelu", source, False)):
        raise ConfigError(f"{source}: clip.use_gelu is true, but Qwen2.5-VL's tower runs SiLU (clip.use_silu)")
    # (clip.vision.attention.layer_norm_epsilon is the text model's rms_norm_eps as the
    # converter writes it; the tower's norms use Hugging Face's fixed qwen2_vl.EPS)
    depth = _int(md, "clip.vision.block_count", source)
    hidden = _int(md, "clip.vision.embedding_length", source)
    if ffn is None:
        raise ConfigError(f"{source}: the MLP width of a Qwen-VL mmproj comes from v.blk.0.ffn_up.weight")
    if not v2 and _int(md, "clip.vision.feed_forward_length", source, ffn) != ffn:
        raise ConfigError(f"{source}: clip.vision.feed_forward_length = {md['clip.vision.feed_forward_length']} "
                          f"but v.blk.0.ffn_up.weight has {ffn} rows")
    d = {"depth": depth, "hidden_size": hidden, "intermediate_size": ffn,
         "num_heads": _int(md, "clip.vision.attention.head_count", source), "out_hidden_size": text_hidden,
         "patch_size": _int(md, "clip.vision.patch_size", source),
         "spatial_merge_size": _int(md, "clip.vision.spatial_merge_size", source, 2)}
    if hidden % d["num_heads"] or (hidden // d["num_heads"]) % 4:
        raise ConfigError(f"{source}: the head size (clip.vision.embedding_length {hidden} / "
                          f"attention.head_count {d['num_heads']}) must be a whole multiple of 4")
    if v2:
        d.update(window_size=0, fullatt_block_indexes=tuple(range(depth)))
    else:
        window = _int(md, "clip.vision.window_size", source, QWEN_WINDOW)
        unit = d["spatial_merge_size"] * d["patch_size"]
        if window % unit:
            raise ConfigError(f"{source}: clip.vision.window_size {window} is not a multiple of "
                              f"spatial_merge_size * patch_size ({unit})")
        d.update(window_size=window, fullatt_block_indexes=_qwen_full_layers(md, depth, source))
    if len(set(ids.values())) != 4:
        raise ConfigError(f"{source}: the image, video, vision-start and vision-end token ids must differ, got {ids}")
    return qwen2_vl.Qwen2VLConfig(model_type=_QWEN[kind], tokens_per_second=2, **d, **ids)


def deepstack_layers(md: dict[str, Any], depth: int, source: str) -> tuple[int, ...]:
    """Qwen3-VL's DeepStack layers: the true entries of clip.vision.is_deepstack_layers (one
    flag per tower layer), in layer order (the converter's deepstack_visual_indexes)."""
    flags = _value(md, "clip.vision.is_deepstack_layers", source, [])
    ok = isinstance(flags, list) and all(isinstance(f, (bool, int)) for f in flags) and len(flags) in (0, depth)
    if not ok:
        raise ConfigError(f"{source}: GGUF metadata 'clip.vision.is_deepstack_layers' must hold one flag per tower "
                          f"layer ({depth}), got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if f)


def _qwen3_config(md: dict[str, Any], text_hidden: int, ids: dict[str, int], source: str, positions: int) -> Any:
    """Qwen3-VL's tower config; positions: the learned position table's rows (its
    v.position_embd.weight)."""
    from fx_engine.core.vision import qwen3_vl

    if bool(_value(md, "clip.use_silu", source, False)):
        raise ConfigError(f"{source}: clip.use_silu is true, but Qwen3-VL's tower runs the tanh GELU (clip.use_gelu)")
    depth = _int(md, "clip.vision.block_count", source)
    d = {"depth": depth, "hidden_size": _int(md, "clip.vision.embedding_length", source),
         "intermediate_size": _int(md, "clip.vision.feed_forward_length", source),
         "num_heads": _int(md, "clip.vision.attention.head_count", source), "out_hidden_size": text_hidden,
         "patch_size": _int(md, "clip.vision.patch_size", source),
         "spatial_merge_size": _int(md, "clip.vision.spatial_merge_size", source, 2)}
    if d["hidden_size"] % d["num_heads"] or (d["hidden_size"] // d["num_heads"]) % 4:
        raise ConfigError(f"{source}: the head size (clip.vision.embedding_length {d['hidden_size']} / "
                          f"attention.head_count {d['num_heads']}) must be a whole multiple of 4")
    side = int(round(positions ** 0.5))
    if side * side != positions:
        raise ConfigError(f"{source}: tensor 'v.position_embd.weight' has {positions} rows, not a square grid")
    if len(set(ids.values())) != 4:
        raise ConfigError(f"{source}: the image, video, vision-start and vision-end token ids must differ, got {ids}")
    return qwen3_vl.Qwen3VLConfig(num_position_embeddings=positions,
                                  deepstack_visual_indexes=deepstack_layers(md, depth, source), **d, **ids)


def _idefics3_config(md: dict[str, Any], tower: Any, text_hidden: int, ids: dict[str, int], source: str) -> Any:
    from fx_engine.core.vision import idefics3

    s = _int(md, "clip.vision.projector.scale_factor", source, IDEFICS3_SCALE_FACTOR)
    if tower.patches_per_side % s:
        raise ConfigError(f"{source}: {tower.patches_per_side} patches a side (clip.vision.image_size "
                          f"{tower.image_size} / patch_size {tower.patch_size}) do not pixel-shuffle by "
                          f"clip.vision.projector.scale_factor {s}")
    return idefics3.Idefics3VisionConfig(vision=tower, text_hidden_size=text_hidden, scale_factor=s,
                                         image_token_index=ids["image"], model_type="idefics3")


def _channels(md: dict[str, Any], key: str, positive: bool, source: str) -> tuple[float, float, float]:
    v = _value(md, key, source, [0.5, 0.5, 0.5])
    vals = list(v) if isinstance(v, (list, tuple)) else None
    if (vals is None or len(vals) != 3 or not all(isinstance(x, (int, float)) for x in vals)
            or (positive and not all(x > 0 for x in vals))):
        raise ConfigError(f"{source}: GGUF metadata '{key}' must be 3 {'positive ' if positive else ''}"
                          f"numbers, got {v!r}")
    return tuple(float(x) for x in vals)  # type: ignore[return-value]


def preproc_edge(md: dict[str, Any], image_size: int, source: str) -> int:
    """Idefics3's resize before tiling (clip.vision.preproc_image_size). Files converted
    before llama.cpp wrote that key (its Idefics3 tiling came later; such files' images ran
    untiled there) take Idefics3ImageProcessor's rule for the released models, 4 tiles a
    side (SmolVLM's longest_edge 2048 = 4 x 512, Idefics3's 1456 = 4 x 364): what their
    folders give, and the engine's rule for a folder without a processor size."""
    edge = _int(md, "clip.vision.preproc_image_size", source, 4 * image_size)
    if edge < image_size:
        raise ConfigError(f"{source}: clip.vision.preproc_image_size {edge} is less than clip.vision.image_size "
                          f"{image_size} (the tile side)")
    return edge


def processor_config(md: dict[str, Any], image_size: int, source: str) -> Any:
    """The preprocessing rules of an mmproj (the module docstring). Gemma 3: resize to
    image_size (PIL bilinear), x / 255, the file's image_mean / image_std; Idefics3:
    Idefics3ImageProcessor's tiling at the file's sizes and mean / std; Mistral 3:
    PixtralImageProcessor's resize within image_size; Qwen-VL: Qwen2VLImageProcessor's
    resize to multiples of patch_size * merge within its min / max pixels (the file's
    clip.vision.image_min_pixels / image_max_pixels where it has them; image_size is not
    used)."""
    from fx_engine.loading.images import Idefics3ProcessorConfig, ImageProcessorConfig

    mean = _channels(md, "clip.vision.image_mean", False, source)
    std = _channels(md, "clip.vision.image_std", True, source)
    if projector_type(md) in _QWEN:
        from fx_engine.loading.images_qwen2_vl import Qwen2VLProcessorConfig

        lo_default, hi_default = QWEN_PIXELS[projector_type(md) or ""]
        lo = _int(md, "clip.vision.image_min_pixels", source, lo_default)
        hi = _int(md, "clip.vision.image_max_pixels", source, hi_default)
        if lo > hi:
            raise ConfigError(f"{source}: clip.vision.image_min_pixels {lo} is more than image_max_pixels {hi}")
        return Qwen2VLProcessorConfig(image_mean=mean, image_std=std, min_pixels=lo, max_pixels=hi,
                                      patch_size=_int(md, "clip.vision.patch_size", source),
                                      merge_size=_int(md, "clip.vision.spatial_merge_size", source, 2))
    if projector_type(md) == "pixtral":
        from fx_engine.loading.images_pixtral import PixtralProcessorConfig

        return PixtralProcessorConfig(longest_edge=image_size, patch_size=_int(md, "clip.vision.patch_size", source),
                                      merge_size=_int(md, "clip.vision.spatial_merge_size", source, 2),
                                      image_mean=mean, image_std=std)
    if projector_type(md) == "idefics3":
        return Idefics3ProcessorConfig(longest_edge=preproc_edge(md, image_size, source), max_image_size=image_size,
                                       do_image_splitting=True, resample=1, image_mean=mean, image_std=std)
    return ImageProcessorConfig(height=image_size, width=image_size, resample=2, image_mean=mean, image_std=std)


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


def read_mmproj_tensors(path: Path, block_count: int, projector: str = "gemma3",
                        deepstack: Sequence[int] = ()) -> TensorSource:
    """The mmproj's tensors under Hugging Face's names (the GGUF name kept in the origin for
    errors); WeightsError naming each missing GGUF tensor."""
    from fx_engine.loading.gguf import read_gguf

    tensors, _ = read_gguf(path)
    want = expected_tensors(block_count, projector, deepstack)
    missing = [n for n in want if n not in tensors]
    if projector == "pixtral" and {"mm.input_norm.weight", "mm.patch_merger.weight"} <= set(missing) \
            and len(missing) == 2:
        raise WeightsError(f"{path}: a pixtral mmproj without a patch merger (mm.input_norm, mm.patch_merger: "
                           "Pixtral-12B's or LightOnOCR's projector) is not supported; Mistral 3's (Mistral "
                           "Small 3.1 / 3.2) is")
    if missing:
        shown = ", ".join(repr(n) for n in missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise WeightsError(f"{path}: missing tensor(s) {shown} (an mmproj for {_DESCRIBED[projector]} with "
                           f"clip.vision.block_count = {block_count} holds {len(want)} of llama.cpp's v.* / mm.* "
                           "tensors)")
    if projector == "qwen3vl_merger":
        return _qwen3_source(path, tensors, deepstack)
    if projector in _QWEN:
        return _qwen_source(path, tensors, projector)
    if projector == "gemma4v":
        return _gemma4_source(path, tensors)
    src = TensorSource()
    src.add(path, {n: t for n, t in tensors.items() if re.match(r"^(v|mm)\.", n)})
    return renamed(src, _TO_HF[projector])


def _patch_conv(path: Path, tensors: dict[str, mx.array]) -> TensorSource:
    """A Qwen-VL tower's Conv3d patch embedding [hidden, C, 2, P, P] from the two 2-D convs
    the converter split it into (v.patch_embd.weight: frame 0, v.patch_embd.weight.1: frame 1)."""
    w0, w1 = tensors["v.patch_embd.weight"], tensors["v.patch_embd.weight.1"]
    if w0.dtype == mx.uint32 or w1.dtype == mx.uint32 or "v.patch_embd.scales" in tensors:
        raise WeightsError(f"{path}: tensor 'v.patch_embd.weight' is quantized; a quantized patch embedding is "
                           "not supported (use an F16, F32 or Q8_0 mmproj)")
    if w0.shape != w1.shape or w0.ndim != 4:
        raise WeightsError(f"{path}: tensors 'v.patch_embd.weight' {tuple(w0.shape)} and 'v.patch_embd.weight.1' "
                           f"{tuple(w1.shape)} must be two [hidden, C, P, P] convs (the Conv3d's two frames)")
    out = TensorSource()
    out.tensors[_QWEN_TOWER + "patch_embed.proj.weight"] = mx.stack([w0, w1], axis=2)
    out.origin[_QWEN_TOWER + "patch_embed.proj.weight"] = f"{path} (v.patch_embd.weight, v.patch_embd.weight.1)"
    return out


def _qwen_source(path: Path, tensors: dict[str, mx.array], projector: str) -> TensorSource:
    """A Qwen-VL mmproj's tensors under Hugging Face's names: the two 2-D patch convs
    stacked back into the Conv3d [hidden, C, 2, P, P] (its two frames), each block's q / k /
    v rows (and biases; quantized parts alike) concatenated into attn.qkv, the rest renamed."""
    out = _patch_conv(path, tensors)
    used = {"v.patch_embd.weight", "v.patch_embd.weight.1"}
    blocks = {int(m.group(1)) for n in tensors if (m := re.match(r"^v\.blk\.(\d+)\.attn_q\.", n))}
    for i in sorted(blocks):
        for suffix in (".weight", ".bias", ".scales", ".biases"):
            parts = [f"v.blk.{i}.attn_{x}{suffix}" for x in "qkv"]
            have = [n for n in parts if n in tensors]
            if not have:
                continue
            if len(have) != 3:
                raise WeightsError(f"{path}: {', '.join(repr(n) for n in parts if n not in tensors)} missing beside "
                                   f"{', '.join(repr(n) for n in have)}")
            name = f"{_QWEN_TOWER}blocks.{i}.attn.qkv{suffix}"
            out.tensors[name] = mx.concatenate([tensors[n] for n in parts], axis=0)
            out.origin[name] = f"{path} ({', '.join(parts)})"
            used.update(parts)
    rest = TensorSource()
    rest.add(path, {n: t for n, t in tensors.items() if n not in used and re.match(r"^(v|mm)\.", n)})
    moved = renamed(rest, _qwen_renames(projector == "qwen2vl_merger"))  # (origins name the GGUF tensor)
    out.tensors.update(moved.tensors)
    out.origin.update(moved.origin)
    return out


def _qwen3_renames(deepstack: Sequence[int]) -> tuple[tuple[str, str], ...]:
    """GGUF name -> Hugging Face name of a Qwen3-VL tower's tensors other than the patch
    conv's weight; v.deepstack.{layer} becomes deepstack_merger_list.{j}, j its rank among
    the DeepStack layers."""
    blk = _QWEN_TOWER + r"blocks.\1."
    out = [(r"^v\.patch_embd\.bias$", _QWEN_TOWER + "patch_embed.proj.bias"),
           (r"^v\.position_embd\.", _QWEN_TOWER + "pos_embed."),
           (r"^v\.blk\.(\d+)\.ln1\.", blk + "norm1."), (r"^v\.blk\.(\d+)\.ln2\.", blk + "norm2."),
           (r"^v\.blk\.(\d+)\.attn_qkv\.", blk + "attn.qkv."), (r"^v\.blk\.(\d+)\.attn_out\.", blk + "attn.proj."),
           (r"^v\.blk\.(\d+)\.ffn_up\.", blk + "mlp.linear_fc1."),
           (r"^v\.blk\.(\d+)\.ffn_down\.", blk + "mlp.linear_fc2."),
           (r"^v\.post_ln\.", _QWEN_TOWER + "merger.norm."), (r"^mm\.0\.", _QWEN_TOWER + "merger.linear_fc1."),
           (r"^mm\.2\.", _QWEN_TOWER + "merger.linear_fc2.")]
    for j, layer in enumerate(deepstack):
        for g, h in (("norm", "norm"), ("fc1", "linear_fc1"), ("fc2", "linear_fc2")):
            out.append((rf"^v\.deepstack\.{layer}\.{g}\.", f"{_QWEN_TOWER}deepstack_merger_list.{j}.{h}."))
    return tuple(out)


def _qwen3_source(path: Path, tensors: dict[str, mx.array], deepstack: Sequence[int]) -> TensorSource:
    """A Qwen3-VL mmproj's tensors under Hugging Face's names: the two 2-D patch convs
    stacked back into the Conv3d, the rest renamed (`_qwen3_renames`)."""
    out = _patch_conv(path, tensors)
    rest = TensorSource()
    rest.add(path, {n: t for n, t in tensors.items()
                    if n not in ("v.patch_embd.weight", "v.patch_embd.weight.1") and re.match(r"^(v|mm)\.", n)})
    moved = renamed(rest, _qwen3_renames(deepstack))
    out.tensors.update(moved.tensors)
    out.origin.update(moved.origin)
    return out


def _dequantized_embeddings(src: TensorSource, vision: Any, tower: str, source: str) -> None:
    """The patch conv and position table as floats in `src` (the converter forces them to
    F32; a requantized file may not have)."""
    for name, shape in ((tower + "embeddings.patch_embedding.weight",
                         (vision.hidden_size, vision.num_channels, vision.patch_size, vision.patch_size)),
                        (tower + "embeddings.position_embedding.weight", (vision.num_patches, vision.hidden_size))):
        base = name[: -len(".weight")]
        if src.has(base + ".scales"):
            src.tensors[name] = _dense(src, name, shape, source)
            del src.tensors[base + ".scales"]
            src.tensors.pop(base + ".biases", None)


def _row_col_tokens(md: dict[str, Any], source: str) -> list[str]:
    """The `<row_R_col_C>` tokens an Idefics3 prompt may write: up to ceil(preproc edge /
    tile side) tiles a side."""
    size = _int(md, "clip.vision.image_size", source)
    n = math.ceil(preproc_edge(md, size, source) / size)
    return [f"<row_{r}_col_{c}>" for r in range(1, n + 1) for c in range(1, n + 1)]


def load_mmproj(path: str | Path, text_config: Any, text_metadata: dict[str, Any], *, dtype: mx.Dtype,
                keep_quantized: KeepQuantized = False, numerics: Numerics | None = None) -> tuple[Any, Any]:
    """(vision params, preprocessing rules) of an mmproj GGUF for a GGUF text model (its
    config and metadata: the hidden size and the image token ids). ConfigError /
    WeightsError name the file and the key or tensor."""
    from fx_engine.loading.gguf import read_gguf_metadata

    path = Path(path)
    source = str(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such mmproj file")
    if path.suffix.lower() != ".gguf":
        raise WeightsError(f"{path}: an mmproj must be a .gguf file (llama.cpp's mmproj-*.gguf)")
    md = read_gguf_metadata(path)
    kind = check_mmproj_metadata(md, source)  # (first: an unsupported projector is named as such)
    text_types, text_what = _TEXT_MODELS[kind]
    if getattr(text_config, "model_type", None) not in text_types:
        raise ConfigError(f"{source}: an mmproj was given for a {getattr(text_config, 'model_type', '?')!r} text "
                          f"model; the {kind} projector needs a {text_what}")
    if kind in _QWEN and not getattr(text_config, "mrope_section", ()):
        raise ConfigError(f"{source}: the {kind} projector needs a text model with M-RoPE (mrope_section: GGUF "
                          "architecture 'qwen2vl' / 'qwen3vl' / 'qwen3vlmoe'); this text model has plain RoPE")
    extra = _row_col_tokens(md, source) if kind == "idefics3" else ()
    ids = image_token_ids(text_metadata.get("tokenizer.ggml.tokens"), f"{source} (with the text model)", kind, extra)
    vocab = int(getattr(text_config, "vocab_size", 0) or 0)
    if vocab and max(ids.values()) >= vocab:
        raise ConfigError(f"{source}: image token ids {ids} lie outside the text model's {vocab} embeddings")
    opts = LoadOptions(dtype=dtype, keep_quantized=keep_quantized, numerics=numerics or Numerics(), where=source)
    if kind in _QWEN:
        return _qwen_params(path, md, int(text_config.hidden_size), ids, opts, source)
    if kind == "pixtral":
        return _pixtral_params(path, md, text_config, ids, opts, source)
    if kind == "gemma4v":
        return _gemma4_params(path, md, text_config, ids, opts, source)
    cfg = mmproj_config(md, int(text_config.hidden_size), ids, source)
    src = read_mmproj_tensors(path, cfg.vision.num_layers, kind)
    if kind == "idefics3":
        vision = _idefics3_params(cfg, src, opts, source)
    else:
        vision = _gemma3_params(cfg, src, opts, source)
    return vision, processor_config(md, cfg.vision.image_size, source)


def _qwen_params(path: Path, md: dict[str, Any], text_hidden: int, ids: dict[str, int], opts: LoadOptions,
                 source: str) -> tuple[Any, Any]:
    """A Qwen-VL tower's (params, rules): the tensors first (they give Qwen2(.5)-VL's MLP
    width and Qwen3-VL's position grid), the merger's output checked against the text
    model's hidden size, then the folder's assembly (`qwen2_vl.assemble` /
    `qwen3_vl.assemble`)."""
    from fx_engine.core.vision import qwen2_vl, qwen3_vl

    kind = projector_type(md) or ""
    blocks = _int(md, "clip.vision.block_count", source)
    if kind == "qwen3vl_merger":
        src = read_mmproj_tensors(path, blocks, kind, deepstack_layers(md, blocks, source))
        sized, out_name = _QWEN_TOWER + "pos_embed.weight", "merger.linear_fc2.weight"
    else:
        src = read_mmproj_tensors(path, blocks, kind)
        sized = _QWEN_TOWER + "blocks.0." + ("mlp.fc1" if kind == "qwen2vl_merger" else "mlp.up_proj") + ".weight"
        out_name = "merger.mlp.2.weight"
    cfg = mmproj_config(md, text_hidden, ids, source, tensor_size=int(src.tensors[sized].shape[0]))
    rows = src.tensors[_QWEN_TOWER + out_name].shape[0]
    if rows != cfg.out_hidden_size:
        raise WeightsError(f"{source}: tensor 'mm.2.weight' has {rows} rows (the merger's output), but the text "
                           f"model's hidden size is {cfg.out_hidden_size}: this mmproj belongs to another model size")
    module = qwen3_vl if kind == "qwen3vl_merger" else qwen2_vl
    return module.assemble(cfg, src, opts), processor_config(md, 0, source)


def _pixtral_params(path: Path, md: dict[str, Any], text_config: Any, ids: dict[str, int], opts: LoadOptions,
                    source: str) -> tuple[Any, Any]:
    """Mistral 3's (params, rules): the tensors renamed, the q / k rows the converter
    permuted for clip.cpp's interleaved rotary (LlamaModel.permute) put back in Hugging
    Face's half-split order, then the folder's assembly (`pixtral.assemble`)."""
    from fx_engine.core.models.llama import unpermute_rows
    from fx_engine.core.vision import pixtral

    src = read_mmproj_tensors(path, _int(md, "clip.vision.block_count", source), "pixtral")
    cfg = mmproj_config(md, int(text_config.hidden_size), ids, source,
                        # (a float32 in the text GGUF: its shortest decimal, as the folder's config says)
                        text_eps=float(str(np.float32(getattr(text_config, "rms_norm_eps", 1e-5)))),
                        projector_bias=src.has(_PIXTRAL_PROJ + "linear_1.bias"))
    for i in range(cfg.num_layers):
        for part in ("q", "k"):
            for suffix in (".weight", ".scales", ".biases"):
                name = f"{_PIXTRAL_TOWER}transformer.layers.{i}.attention.{part}_proj{suffix}"
                if name in src.tensors:
                    src.tensors[name] = unpermute_rows(src.tensors[name], cfg.num_heads)
    merger = src.tensors[_PIXTRAL_PROJ + "linear_2.weight"]
    if merger.shape[0] != cfg.text_hidden_size:
        raise WeightsError(f"{source}: tensor 'mm.2.weight' has {merger.shape[0]} rows, but the text model's hidden "
                           f"size is {cfg.text_hidden_size}: this mmproj belongs to another model size")
    return pixtral.assemble(cfg, src, opts), processor_config(md, cfg.image_size, source)


def _gemma3_params(cfg: Any, src: TensorSource, opts: LoadOptions, source: str) -> Any:
    from fx_engine.core.vision import gemma3, siglip

    _dequantized_embeddings(src, cfg.vision, _TOWER, source)
    tower = siglip.assemble(cfg.vision, src, opts, _TOWER)
    dv, ht = cfg.vision.hidden_size, cfg.text_hidden_size
    proj_name, norm_name = _PROJ + "mm_input_projection_weight", _PROJ + "mm_soft_emb_norm.weight"
    proj = _dense(src, proj_name, (dv, ht), source)  # [vision hidden, text hidden]: in -> out
    norm = _dense(src, norm_name, (dv,), source)
    # the file's soft_emb_norm is the scale itself (the converter added Gemma's 1)
    return gemma3.Gemma3VisionParams(tower=tower, soft_norm=norm.astype(opts.dtype),
                                     projection=Linear(weight=mx.contiguous(proj.astype(opts.dtype)),
                                                       transposed=True),
                                     config=cfg)


def _idefics3_params(cfg: Any, src: TensorSource, opts: LoadOptions, source: str) -> Any:
    """The folder's assembly (`idefics3.assemble`: the position table re-indexed, the
    projection read as a linear) from the renamed tensors, after the shape check of the
    projection that names the GGUF tensor."""
    from fx_engine.core.vision import idefics3

    _dequantized_embeddings(src, cfg.vision, _IDEFICS3_TOWER, source)
    name = _IDEFICS3_PROJ + "weight"
    cols = cfg.vision.hidden_size * cfg.scale_factor ** 2
    w = src.tensors[name]
    packed = src.has(_IDEFICS3_PROJ + "scales")
    if w.shape[0] != cfg.text_hidden_size or (not packed and w.shape[-1] != cols):
        raise WeightsError(f"{src.origin[name]}: tensor 'mm.model.fc.weight' has shape {tuple(w.shape)} (rows "
                           f"first), expected ({cfg.text_hidden_size}, {cols}): the text model's hidden size x "
                           "the vision hidden size * clip.vision.projector.scale_factor^2")
    return idefics3.assemble(cfg, src, opts)


def _gemma4_source(path: Path, tensors: dict[str, mx.array]) -> TensorSource:
    """A Gemma 4 mmproj's tensors under Hugging Face's names: the patch conv [hidden, 3, p, p]
    (the converter's view of input_proj) back to input_proj [hidden, p * p * 3] in (row,
    column, channel) order, the rest renamed."""
    src = TensorSource()
    src.add(path, {n: t for n, t in tensors.items() if re.match(r"^(v|mm)\.", n) and n != "v.patch_embd.weight"})
    out = renamed(src, _TO_HF["gemma4v"])
    probe = TensorSource()
    probe.add(path, {n: t for n, t in tensors.items() if n.startswith("v.patch_embd.")})
    w = probe.tensors["v.patch_embd.weight"]
    if w.ndim != 4 or w.shape[1] != 3 or w.shape[2] != w.shape[3]:
        raise WeightsError(f"{path}: tensor 'v.patch_embd.weight' has shape {tuple(w.shape)} (rows first), expected "
                           "[hidden, 3, patch, patch]")
    w = _dense(probe, "v.patch_embd.weight", tuple(w.shape), str(path))
    name = _GEMMA4_TOWER + "patch_embedder.input_proj.weight"
    out.tensors[name] = mx.contiguous(w.transpose(0, 2, 3, 1).reshape(w.shape[0], -1))
    out.origin[name] = f"{path} (v.patch_embd.weight)"
    return out


def _gemma4_params(path: Path, md: dict[str, Any], text_config: Any, ids: dict[str, int], opts: LoadOptions,
                   source: str) -> tuple[Any, Any]:
    """Gemma 4's (params, rules): its config from clip.vision.* and the tensors (what the
    converter does not write: head size = hidden / heads, the KV heads from attn_k's rows
    (the released towers': as many as the query heads), the 3 x 3
    pool and rotary base 100 (clip.cpp fixes them too), the position table's size from its
    rows, clipped linears and standardize from whether their tensors are there; the image
    tokens' attention is the text model's: its `vision_bidirectional`), the folder's
    assembly (`gemma4.assemble`), and Gemma4ImageProcessor's rules at the file's patch size
    and mean / std (280 soft tokens an image, the processor's default)."""
    from fx_engine.core.vision import gemma4
    from fx_engine.loading.images_gemma4 import Gemma4ProcessorConfig

    if bool(_value(md, "clip.use_silu", source, False)):
        raise ConfigError(f"{source}: clip.use_silu is true, but Gemma 4's vision tower runs the tanh GELU")
    blocks = _int(md, "clip.vision.block_count", source)
    src = read_mmproj_tensors(path, blocks, "gemma4v")
    _check_projection_dim(md, int(text_config.hidden_size), source)
    table = src.tensors[_GEMMA4_TOWER + "patch_embedder.position_embedding_table"]
    heads = _int(md, "clip.vision.attention.head_count", source)
    hidden = _int(md, "clip.vision.embedding_length", source)
    pool = _int(md, "clip.vision.projector.scale_factor", source, 3)
    k_rows = int(src.tensors[_GEMMA4_TOWER + "encoder.layers.0.self_attn.k_proj.linear.weight"].shape[0])
    vision = {"model_type": "gemma4_vision", "hidden_size": hidden,
              "intermediate_size": _int(md, "clip.vision.feed_forward_length", source), "num_hidden_layers": blocks,
              "num_attention_heads": heads,
              "num_key_value_heads": _int(md, "clip.vision.attention.head_count_kv", source,
                                          max(1, k_rows // max(1, hidden // heads))),
              "head_dim": hidden // heads, "patch_size": _int(md, "clip.vision.patch_size", source),
              "pooling_kernel_size": pool, "rms_norm_eps": _eps(md, source),
              "position_embedding_size": int(table.shape[1]) if table.ndim == 3 else 0,
              "use_clipped_linears": src.has(_GEMMA4_TOWER + "encoder.layers.0.self_attn.q_proj.input_min"),
              "standardize": src.has(_GEMMA4_TOWER + "std_bias")}
    text = {"hidden_size": int(text_config.hidden_size)}
    cfg = gemma4.config_from_hf({"model_type": "gemma4", "text_config": text, "vision_config": vision,
                                 "image_token_id": ids["image"], "boi_token_id": ids["boi"],
                                 "eoi_token_id": ids["eoi"]}, f"{source}: clip.vision.*")
    rules = Gemma4ProcessorConfig(patch_size=cfg.patch_size, pooling_kernel_size=cfg.pooling_kernel_size,
                                  do_normalize=True, image_mean=_channels(md, "clip.vision.image_mean", False, source),
                                  image_std=_channels(md, "clip.vision.image_std", True, source))
    return gemma4.assemble(cfg, src, opts), rules
