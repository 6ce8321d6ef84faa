"""Gemma 3's image path (model_type `gemma3`): the SigLIP tower, the multimodal projector,
and where the image embeddings go in the text model's input.

The projector (Hugging Face's Gemma3MultiModalProjector; mlx-vlm's likewise): the tower's
patch features [N, P * P, Dv] (P = image_size / patch_size patches a side) are averaged
over k x k blocks of patches (k = P / s, s = sqrt(mm_tokens_per_image)) into s * s tokens
(row-major), RMS-normalized with Gemma's (1 + w) norm (`mm_soft_emb_norm`, eps the
tower's layer_norm_eps; the 1 is folded in at load) and projected by
`mm_input_projection_weight` [Dv, text_hidden] (stored as in -> out; a plain matrix, never
quantized). Result: [N, mm_tokens_per_image, text_hidden] per image.

The prompt (Gemma3Processor; with pan-and-scan crops engine/image_prompt.py also writes its
"Here is the original image ... crops" text, one run per crop): each `<start_of_image>`
in the text becomes "\\n\\n<start_of_image>" + "<image_soft_token>" * mm_tokens_per_image +
"<end_of_image>\\n\\n" before tokenizing (`expand_image_text`), so each image is one
contiguous run of `image_token_index` ids between `boi_token_index` and
`eoi_token_index`. The image embeddings replace the embeddings at those positions, in
order (`splice_images`: Hugging Face's masked_scatter), *after* the text embeddings'
sqrt(hidden) scaling: the projector's output goes into the residual stream as it is.
(mlx-vlm 0.7.10 instead divides it by sqrt(config.hidden_size) before its text model
multiplies every embedding by bfloat16(sqrt(text hidden)): the same where hidden_size is
the text model's and its square root is exact in bfloat16, else off by their ratio; its
`config.hidden_size` defaults to 2048 when the top-level config.json does not say.)

Attention over image tokens (the text model's forward does it for a step given an
`ImageInput`: fx_engine/core/models/gemma.py, through `StepGeometry`'s horizon): Hugging Face
(transformers 5.x, `create_masks_for_vision_model`, fed by the processor's token_type_ids
= 1 exactly at the soft tokens) makes the tokens of one image run attend to each other
bidirectionally during prefill: full-attention layers use causal OR same-image, sliding
layers (causal OR same-image) AND (key > query - window); boi/eoi and text stay causal;
decode steps (token_type_ids dropped after the first iteration) are plain causal.
`image_horizon` puts those masks in the form the cache's slot masks can take (a key is
visible up to a per-query horizon: the end of the query's image); `image_groups`,
`image_attention_overlay` and `prompt_attention_mask` build them outright.
mlx-vlm 0.7.10 does not: its generation drops the 4-D mask `get_input_embeddings` returns
and runs its ordinary causal / sliding masks (image tokens causal), and its
`Model.__call__` with a mask applies the padding mask's outer product to every layer (no
causality at all).
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx
import numpy as np
from jaxtyping import Bool, Float, Int

from fx_engine.core.checkpoint import LoadOptions, Reader, TensorSource, TensorSpec, Vec, read_tensors
from fx_engine.core.config import POSITIVE, ConfigError, Field, read_field
from fx_engine.core.nn import Linear, linear, rms_norm
from fx_engine.core.tree import CompiledFunction, static_field
from fx_engine.core.vision import siglip
from fx_engine.core.vision.siglip import tensor_prefix as _prefix
# (moved to splice.py; re-exported here, where they were first defined)
from fx_engine.core.vision.splice import ImageInput, check_image_input, splice_images  # noqa: F401

MODEL_TYPE = "gemma3"
#: where the tower's and the projector's tensors live: Hugging Face's original names (the
#: google/gemma-3-* checkpoints, mlx-community's conversions), then transformers >= 4.52's
TOWER_PREFIXES = ("vision_tower.vision_model.", "model.vision_tower.vision_model.")
PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
#: Gemma3Processor's placeholder strings (the tokenizer's boi / image / eoi tokens)
BOI_TEXT, IMAGE_TEXT, EOI_TEXT = "<start_of_image>", "<image_soft_token>", "<end_of_image>"


@attrs.frozen
class Gemma3VisionConfig:
    """What Gemma 3's image path reads from config.json: the tower (`vision_config`), the
    projector's sizes and the image token ids."""

    vision: siglip.SiglipConfig
    text_hidden_size: int
    mm_tokens_per_image: int = 256
    image_token_index: int = 262144  # <image_soft_token>
    boi_token_index: int = 255999  # <start_of_image>
    eoi_token_index: int = 256000  # <end_of_image>
    model_type: str = MODEL_TYPE

    @property
    def tokens_per_side(self) -> int:
        return int(round(self.mm_tokens_per_image ** 0.5))

    @property
    def pool(self) -> int:
        """The average pool's kernel (and stride), in patches."""
        return self.vision.patches_per_side // self.tokens_per_side

    @property
    def image_size(self) -> int:
        return self.vision.image_size

    @property
    def placeholder(self) -> str:
        """What the chat template writes in an image's place."""
        return BOI_TEXT


def token_id_field(d: dict[str, Any], keys: tuple[str, ...], default: int, source: str) -> int:
    """A token id stored as `<name>_index` or `<name>_id` (Hugging Face accepts both)."""
    found = {k: d[k] for k in keys if d.get(k) is not None}
    for k, v in found.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{source}: field '{k}' must be a token id (an integer >= 0), got {v!r}")
    if len(set(found.values())) > 1:
        raise ConfigError(f"{source}: fields {' and '.join(repr(k) for k in found)} disagree ({found})")
    return next(iter(found.values()), default)


def config_from_hf(d: dict[str, Any], source: str = "config.json") -> Gemma3VisionConfig:
    """Gemma 3's image-path config from a multimodal config.json dict; ConfigError naming
    the field for what is missing, malformed or not implemented."""
    if d.get("model_type") != MODEL_TYPE:
        raise ConfigError(f"{source}: model_type {d.get('model_type')!r} is not Gemma 3's multimodal "
                          f"{MODEL_TYPE!r}")
    text, vision = d.get("text_config"), d.get("vision_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: field 'text_config' is missing or not an object")
    if not isinstance(vision, dict):
        raise ConfigError(f"{source}: field 'vision_config' is missing or not an object (a text-only checkpoint "
                          "has no vision tower)")
    tower = siglip.config_from_hf(vision, f"{source}: vision_config")
    if tower.num_channels != 3:
        raise ConfigError(f"{source}: vision_config.num_channels = {tower.num_channels} is not supported "
                          "(Gemma 3 reads RGB images: 3)")
    hidden = read_field(text, Field("hidden_size"), f"{source}: text_config")
    # mm_tokens_per_image: Hugging Face's is top level, mlx-vlm reads text_config's
    stated = {k: v for k, v in (("mm_tokens_per_image", d.get("mm_tokens_per_image")),
                                 ("text_config.mm_tokens_per_image", text.get("mm_tokens_per_image")))
              if v is not None}
    if len(set(stated.values())) > 1:
        raise ConfigError(f"{source}: fields {' and '.join(repr(k) for k in stated)} disagree ({stated})")
    mm = POSITIVE(next(iter(stated.values()), 256), next(iter(stated), "mm_tokens_per_image"), source)
    side = int(round(mm ** 0.5))
    if side * side != mm:
        raise ConfigError(f"{source}: mm_tokens_per_image ({mm}) is not a square number of tokens")
    if tower.patches_per_side % side:
        raise ConfigError(f"{source}: {tower.patches_per_side} patches a side (vision_config.image_size "
                          f"{tower.image_size} / patch_size {tower.patch_size}) do not pool evenly into "
                          f"{side} tokens a side (mm_tokens_per_image {mm})")
    ids = {name: token_id_field(d, (f"{name}_index", f"{name}_id"), default, source)
           for name, default in (("image_token", 262144), ("boi_token", 255999), ("eoi_token", 256000))}
    if len(set(ids.values())) != 3:
        raise ConfigError(f"{source}: the image, start-of-image and end-of-image token ids must differ, got {ids}")
    return Gemma3VisionConfig(vision=tower, text_hidden_size=hidden, mm_tokens_per_image=mm,
                              image_token_index=ids["image_token"], boi_token_index=ids["boi_token"],
                              eoi_token_index=ids["eoi_token"])


@attrs.frozen
class Gemma3VisionParams:
    tower: siglip.SiglipParams
    soft_norm: mx.array  # mm_soft_emb_norm's 1 + w, [Dv]
    projection: Linear  # [Dv -> text_hidden], dense, stored [in, out] (transposed)
    config: Gemma3VisionConfig = static_field()


def is_vision_tensor(name: str) -> bool:
    """Whether a checkpoint tensor belongs to the image path (tower or projector)."""
    return name.startswith(TOWER_PREFIXES + PROJECTOR_PREFIXES)


def assemble(cfg: Gemma3VisionConfig, src: TensorSource, opts: LoadOptions) -> Gemma3VisionParams:
    """The image path's params from a checkpoint's tensors (Hugging Face or mlx-vlm names,
    either prefix of TOWER_PREFIXES / PROJECTOR_PREFIXES)."""
    tower = siglip.assemble(cfg.vision, src, opts,
                            _prefix(src, TOWER_PREFIXES, "embeddings.patch_embedding.weight", "vision tower",
                                    opts.where))
    pre = _prefix(src, PROJECTOR_PREFIXES, "mm_input_projection_weight", "multimodal projector", opts.where)
    dv, ht = cfg.vision.hidden_size, cfg.text_hidden_size
    proj = src.get(pre + "mm_input_projection_weight", (dv, ht), opts.where).astype(opts.dtype)
    norm = read_tensors(Reader(src, opts), (Vec("soft_norm", "mm_soft_emb_norm.weight", dv, plus=1.0),), cfg, pre)
    return Gemma3VisionParams(tower=tower, soft_norm=norm["soft_norm"],
                              projection=Linear(weight=mx.contiguous(proj), transposed=True), config=cfg)


def checkpoint_layout(cfg: Gemma3VisionConfig) -> dict[str, TensorSpec]:
    """The image path's tensors under Hugging Face's names (tiny test models)."""
    dv = cfg.vision.hidden_size
    out = siglip.checkpoint_layout(cfg.vision, TOWER_PREFIXES[0])
    out[PROJECTOR_PREFIXES[0] + "mm_soft_emb_norm.weight"] = TensorSpec((dv,), scale=0.1)
    out[PROJECTOR_PREFIXES[0] + "mm_input_projection_weight"] = TensorSpec((dv, cfg.text_hidden_size), scale=0.15)
    return out


def pool(feats: Float[mx.array, "N P D"], cfg: Gemma3VisionConfig) -> Float[mx.array, "N M D"]:
    """The projector's average pool: [N, P * P, D] patch features -> [N, s * s, D] tokens
    (each the mean of a k x k block of patches; row-major, as AvgPool2d then flatten)."""
    n, _, d = feats.shape
    s, k = cfg.tokens_per_side, cfg.pool
    x = feats.astype(mx.float32).reshape(n, s, k, s, k, d).mean(axis=(2, 4))
    return x.reshape(n, s * s, d).astype(feats.dtype)


def project(p: Gemma3VisionParams, feats: Float[mx.array, "N P D"]) -> Float[mx.array, "N M H"]:
    """The multimodal projector: patch features -> image token embeddings [N, mm, text_hidden]."""
    cfg = p.config
    return linear(rms_norm(pool(feats, cfg), p.soft_norm, cfg.vision.layer_norm_eps), p.projection,
                  p.tower.numerics)


def encode_images(p: Gemma3VisionParams, pixels: Float[mx.array, "N C S S"]) -> Float[mx.array, "N M H"]:
    """Images [N, 3, S, S] (preprocessed, channels first, S = image_size) -> their token
    embeddings [N, mm_tokens_per_image, text_hidden], in the params' dtype."""
    return project(p, siglip.forward(p.tower, pixels))


#: `encode_images` compiled (one trace per params structure and pixels shape: with
#: pan-and-scan off every Gemma 3 image has one size, so the shapes are the batch sizes)
encode_images_compiled = CompiledFunction(encode_images, name="encode_images")


def image_token_runs(tokens: Sequence[int] | np.ndarray, cfg: Gemma3VisionConfig,
                     n_images: int | None = None) -> list[tuple[int, int]]:
    """The [start, end) spans of the image soft-token runs of one token sequence, checked:
    each run is mm_tokens_per_image tokens between a start-of-image and an end-of-image
    token, and (given `n_images`) there is one per image. ValueError naming the position
    otherwise. The spans are where prefill chunks must not cut (an image's tokens attend to
    each other) and where the prefix cache must key on the image, not the token ids."""
    t = np.asarray(tokens).reshape(-1)
    is_image = t == cfg.image_token_index
    edges = np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]]))
    spans = list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
    for a, b in spans:
        if b - a != cfg.mm_tokens_per_image:
            raise ValueError(f"image tokens at positions {a}..{b - 1}: {b - a} of them, expected "
                             f"mm_tokens_per_image = {cfg.mm_tokens_per_image} per image")
        if a == 0 or t[a - 1] != cfg.boi_token_index or b == len(t) or t[b] != cfg.eoi_token_index:
            raise ValueError(f"image tokens at positions {a}..{b - 1} are not between a start-of-image "
                             f"({cfg.boi_token_index}) and an end-of-image ({cfg.eoi_token_index}) token")
    if n_images is not None and len(spans) != n_images:
        raise ValueError(f"the prompt has {len(spans)} image(s) worth of image tokens, but {n_images} image(s) "
                         "were given")
    return spans


def expand_image_text(text: str, cfg: Gemma3VisionConfig, n_images: int | None = None, *, boi: str = BOI_TEXT,
                      image: str = IMAGE_TEXT, eoi: str = EOI_TEXT) -> str:
    """The prompt text with each `boi` placeholder (what Gemma 3's chat template writes for
    an image) expanded as Gemma3Processor does with pan-and-scan off:
    "\\n\\n" + boi + image * mm_tokens_per_image + eoi + "\\n\\n". ValueError when the
    placeholders do not match `n_images`."""
    found = text.count(boi)
    if n_images is not None and found != n_images:
        raise ValueError(f"the prompt has {found} {boi} placeholder(s), but {n_images} image(s) were given")
    return text.replace(boi, f"\n\n{boi}{image * cfg.mm_tokens_per_image}{eoi}\n\n")


def image_groups(tokens: Int[mx.array, "B T"], image_token_index: int) -> Int[mx.array, "B T"]:
    """Each position's image run (0, 1, ... in order within its row), -1 for other tokens:
    Hugging Face's get_block_sequence_ids_for_mask of the processor's token_type_ids."""
    is_image = tokens == image_token_index
    prev = mx.concatenate([mx.zeros((tokens.shape[0], 1), mx.bool_), is_image[:, :-1]], axis=1)
    new = mx.logical_and(is_image, mx.logical_not(prev))
    return mx.where(is_image, mx.cumsum(new.astype(mx.int32), axis=1) - 1, -1)


def image_attention_overlay(q_groups: Int[mx.array, "B T"], k_groups: Int[mx.array, "B S"]) -> Bool[mx.array, "B 1 T S"]:
    """Where a query may also see a key because both are tokens of the same image (Hugging
    Face's blockwise_overlay): OR it into the causal mask (before a sliding layer's window
    AND). Group ids only have to agree between the two sides."""
    q, k = q_groups[:, :, None], k_groups[:, None, :]
    return mx.logical_and(q == k, q >= 0)[:, None]


def image_horizon(tokens: Int[mx.array, "B T"], positions: Int[mx.array, "B T"],
                  image_token_index: int) -> Int[mx.array, "B T"]:
    """The last key position each query may see: its own position, or for an image token
    the position of its image run's last token. Hugging Face's mask is then exactly
    `key <= horizon[query]` (full-attention layers) AND `key > position[query] - window`
    (sliding layers): causal OR same-image is "every key up to the end of my image", since
    the image's earlier tokens are causal anyway. The form a cache's slot mask takes
    (held key position <= horizon instead of <= position); the runs must lie whole inside
    `tokens` (a prefill chunk never cuts an image)."""
    t = tokens.shape[1]
    is_image = tokens == image_token_index
    nxt = mx.concatenate([is_image[:, 1:], mx.zeros((tokens.shape[0], 1), mx.bool_)], axis=1)
    idx = mx.arange(t, dtype=mx.int32)[None]
    ends = mx.where(mx.logical_and(is_image, mx.logical_not(nxt)), idx, t)  # a run's last index
    run_end = mx.cummin(ends, axis=1, reverse=True)  # the first run end at or after each index
    return mx.where(is_image, positions + (run_end - idx), positions)


def prompt_attention_mask(tokens: Int[mx.array, "B T"], image_token_index: int,
                          sliding_window: int | None = None) -> Bool[mx.array, "B 1 T T"]:
    """Hugging Face's Gemma 3 attention mask for a whole prompt with no cache (query i, key
    j): (j <= i OR same image) for full-attention layers, AND j > i - sliding_window for
    sliding ones (built as `image_horizon` says). Padding is not modelled."""
    t = tokens.shape[1]
    pos = mx.broadcast_to(mx.arange(t, dtype=mx.int32)[None], tokens.shape)
    q, k = pos[:, :, None], mx.arange(t, dtype=mx.int32)[None, None, :]
    mask = k <= image_horizon(tokens, pos, image_token_index)[:, :, None]
    if sliding_window is not None:
        mask = mx.logical_and(mask, k > q - sliding_window)
    return mask[:, None]
