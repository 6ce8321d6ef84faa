"""The splice of image embedding rows into a text model's token embeddings, family-neutral
(issue 46): `ImageInput`, a step's image rows (the step functions' `images` argument), and
`splice_images`, Hugging Face's masked_scatter of image rows at the image token positions.
Gemma 3's forward (fx_engine/core/models/gemma.py) and the Llama family's
(fx_engine/core/models/llama.py: Idefics3 / SmolVLM) both splice through here;
`fx_engine.core.vision.gemma3` re-exports these names.
"""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx
from jaxtyping import Float, Int

from fx_engine.core.tree import static_field


def splice_images(
    embeds: Float[mx.array, "B T H"], tokens: Int[mx.array, "B T"], images: mx.array, image_token_index: int,
    start: Int[mx.array, "B"] | None = None,
) -> Float[mx.array, "B T H"]:
    """`embeds` (the text embeddings, already scaled by the text model's embed_scale) with
    the positions holding `image_token_index` replaced by image embedding rows, in order.

    images: [N, mm, H] (`encode_images`) or [M, H] rows. Row b's first image token takes
    row start[b]; None: the rows before it are the image tokens of rows 0..b-1 (Hugging
    Face's masked_scatter over the flattened batch). A prefill chunk passes, per row, how
    many image tokens of that row's images came before the chunk. Shapes do not depend on
    the data (compiles once per shape); counts are not checked here (`image_token_runs`
    does, before): an index past the last row repeats it."""
    h = embeds.shape[-1]
    rows = images.reshape(-1, h).astype(embeds.dtype)
    is_image = tokens == image_token_index
    seen = mx.cumsum(is_image.astype(mx.int32), axis=1)  # image tokens up to and including t
    if start is None:
        per_row = seen[:, -1]
        start = mx.cumsum(per_row) - per_row
    idx = mx.clip(start.astype(mx.int32)[:, None] + seen - 1, 0, rows.shape[0] - 1)
    return mx.where(is_image[..., None], rows[idx], embeds)


@attrs.frozen
class ImageInput:
    """A step's image rows (an argument of the step functions; None: a text-only step,
    whose graph is unchanged).

    rows: the image embedding rows [M, H] (`encode_images`' [N, mm, H] flattened) of every
    image any row of the step reads; start: per row, the index in `rows` of the row its
    first image token in this step takes (the images of a row are consecutive rows, in
    prompt order; a chunk after part of a row's images starts past them). Positions
    holding `token_index` take rows in order (`splice_images`). bidirectional: the tokens
    of one image attend to each other (Hugging Face's Gemma 3 prefill rule,
    `image_horizon`); False: plain causal (mlx-vlm's generation). A causal family (the Llama
    family's Idefics3 / SmolVLM text models) ignores it: its image tokens are always
    causal. A step's chunk must hold whole image runs (the shell plans chunks so:
    `image_token_runs`).

    positions, position_start (Qwen2(.5)-VL's M-RoPE; None: plain RoPE): `positions` [3, P]
    holds, for the prompts of the step's M-RoPE rows one after another, each token's three
    rotary position ids minus its cache position (`vision.qwen2_vl.rope_offsets`: zero for
    the text after the last image); row b's token t reads column position_start[b] + t, a
    row with position_start < 0 none (its three ids are its cache position).
    `step_positions` turns them into the step's [3, B, T] ids.

    deepstack (Qwen3-VL's DeepStack; None: none): [L, M, H] rows parallel to `rows` (image
    token k of the step reads row k of each, by the same `start`); the text model adds
    deepstack[i] at the image tokens to its hidden states after decoder layer i
    (`deepstack_adder`)."""

    rows: Float[mx.array, "M H"]
    start: Int[mx.array, "B"]
    token_index: int = static_field()
    bidirectional: bool = static_field(default=True)
    positions: Int[mx.array, "3 P"] | None = None
    position_start: Int[mx.array, "B"] | None = None
    deepstack: Float[mx.array, "L M H"] | None = None


def step_positions(images: ImageInput, positions: Int[mx.array, "B T"]) -> Int[mx.array, "3 B T"]:
    """The step's M-RoPE position ids: its cache positions [B, T] (on all three rows) plus
    each row's offsets from `images.positions` (module docstring of `ImageInput`). Shapes do
    not depend on the data: a column past the table repeats its last one (only padding
    slots of a row read there; their outputs are never used)."""
    b, t = positions.shape
    table = images.positions.astype(mx.int32)
    start = images.position_start.astype(mx.int32)
    idx = mx.clip(start[:, None] + mx.arange(t, dtype=mx.int32)[None, :], 0, table.shape[1] - 1)  # [B, T]
    offsets = mx.where((start >= 0)[None, :, None], table[:, idx], 0)  # [3, B, T]
    return positions[None].astype(mx.int32) + offsets


class DeepstackAdder:
    """`deepstack_adder`'s result: adder(i, h [B*T, H]) -> h with images.deepstack[i]
    added at the step's image tokens (elsewhere h unchanged, bit for bit); `layers` = L."""

    def __init__(self, tokens: mx.array, images: ImageInput):
        deep = images.deepstack
        self.layers = int(deep.shape[0])
        self.rows = deep.reshape(self.layers, -1, deep.shape[-1])
        is_image = tokens == images.token_index
        seen = mx.cumsum(is_image.astype(mx.int32), axis=1)
        idx = mx.clip(images.start.astype(mx.int32)[:, None] + seen - 1, 0, self.rows.shape[1] - 1)
        self.mask = is_image.reshape(-1, 1)
        self.index = idx.reshape(-1)

    def __call__(self, i: int, h: mx.array) -> mx.array:
        return mx.where(self.mask, h + self.rows[i][self.index].astype(h.dtype), h)


def deepstack_adder(tokens: Int[mx.array, "B T"], images: ImageInput) -> DeepstackAdder:
    """What a text model's layer loop calls after layer i < adder.layers (Qwen3-VL's
    DeepStack; mlx-vlm's `_deepstack_process`, transformers' `Qwen3VLTextModel._deepstack_process`:
    the visual features added at the image positions, after the layer)."""
    return DeepstackAdder(tokens, images)


def check_image_input(images: Any, rows: int, hidden: int) -> ImageInput:
    """Trace-time check of a step's `images` argument (rows [M, H] or [N, mm, H], start [B])."""
    if not isinstance(images, ImageInput):
        raise TypeError(f"images must be a fx_engine.core.vision.splice.ImageInput, got {type(images).__name__}")
    r = images.rows
    if r.ndim not in (2, 3) or r.shape[-1] != hidden or r.shape[0] == 0:
        raise ValueError(f"images.rows must be [M, {hidden}] (or [N, mm, {hidden}]) image embedding rows, got "
                         f"shape {tuple(r.shape)}")
    if images.start.ndim != 1 or images.start.shape[0] != rows:
        raise ValueError(f"images.start must be int32[{rows}] (one index per row), got shape "
                         f"{tuple(images.start.shape)}")
    if (images.positions is None) != (images.position_start is None):
        raise ValueError("images.positions and images.position_start go together (both or neither)")
    if images.positions is not None:
        if images.positions.ndim != 2 or images.positions.shape[0] != 3 or images.positions.shape[1] == 0:
            raise ValueError(f"images.positions must be int32[3, P] (M-RoPE offsets), got shape "
                             f"{tuple(images.positions.shape)}")
        if images.position_start.ndim != 1 or images.position_start.shape[0] != rows:
            raise ValueError(f"images.position_start must be int32[{rows}], got shape "
                             f"{tuple(images.position_start.shape)}")
    d = images.deepstack
    if d is not None and (d.ndim != 3 or d.shape[-1] != hidden or d.shape[1] != r.size // hidden):
        raise ValueError(f"images.deepstack must be [L, {r.size // hidden}, {hidden}] (rows parallel to "
                         f"images.rows), got shape {tuple(d.shape)}")
    return attrs.evolve(images, rows=r.reshape(-1, hidden)) if r.ndim == 3 else images
