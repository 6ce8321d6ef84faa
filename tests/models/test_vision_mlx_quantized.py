"""MLX-quantized multimodal folders as mlx-vlm writes them (issue 46 item 1): each tiny
Hugging Face folder converted by mlx-vlm 0.7.10's own `convert(..., quantize=True)` (4-bit,
groups of 32: its quantization predicate decides which text and tower linears are packed),
loaded by fx-engine (packed weights kept, or dequantized), against mlx-vlm's model loaded
from the same converted folder: the whole prompt's logits with the images spliced in, and
greedy generation. (Gemma 3's quantized towers: tests/models/test_vision_gemma3.py; mlx-vlm's
converter does not take the tiny Gemma 3 folder's tokenizer.)

Tolerance: the same packed weights on both sides; fx-engine's kept-packed matmuls are MLX's
own quantized products (2e-4), its dequantized ones float32 products of the same values
(summation order: 2e-4 as well, measured ~1e-5)."""

from __future__ import annotations

import io

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.steps import logits_step
from fx_engine.engine.image_prompt import image_prompt
from fx_engine.testing.vision import write_tiny_idefics3, write_tiny_mistral3, write_tiny_qwen2_vl, write_tiny_qwen3_vl
from tests.models.vision_checks import close, load_mlx_vlm, messages, png, qwen_pixels, whole_images

TOL = 2e-4
WRITERS = {"qwen2_5_vl": write_tiny_qwen2_vl, "qwen3_vl": write_tiny_qwen3_vl, "idefics3": write_tiny_idefics3,
           "mistral3": write_tiny_mistral3}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    from mlx_vlm import convert

    made = {}

    def folder(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(f"q4-{family}")
            src = WRITERS[family](root / "hf")
            convert(str(src), str(root / "q4"), quantize=True, q_group_size=32, q_bits=4)
            made[family] = root / "q4"
        return made[family]

    return folder


def _oracle_logits(family: str, ref, model, msgs, ids: list[int]) -> mx.array:
    """mlx-vlm's whole forward on the prompt ids and the family's processor pixels."""
    import PIL.Image

    x = mx.array([ids], mx.int32)
    imgs = [PIL.Image.open(io.BytesIO(p["image"])) for m in msgs for p in m["content"] if p["type"] == "image"]
    if family in ("qwen2_5_vl", "qwen3_vl"):
        pixels, grid = qwen_pixels(model, msgs)
        return ref(x, pixels, image_grid_thw=grid).logits[0]
    if family == "idefics3":
        from fx_engine.loading.images import idefics3_tiles

        tiles = np.concatenate([idefics3_tiles(im, model.image_processor)[0] for im in imgs])
        return ref(x, mx.array(tiles)[None]).logits[0]
    from fx_engine.loading.images_pixtral import preprocess_one

    done = [preprocess_one(im, model.image_processor) for im in imgs]  # [C, H, W] each
    assert len({d.shape for d in done}) == 1  # (one image size: one batch)
    return ref(x, mx.array(np.stack(done)), mask=None, image_sizes=[list(d.shape[-2:]) for d in done]).logits[0]


@pytest.mark.oracle
@pytest.mark.parametrize("keep", [True, False], ids=["packed", "dequantized"])
@pytest.mark.parametrize("family", list(WRITERS))
def test_mlx_vlm_quantized_folder_matches_mlx_vlm(converted, family, keep):
    path = converted(family)
    model = fx_engine.load(str(path), keep_quantized=keep)
    ref = load_mlx_vlm(path)
    if family == "idefics3":  # mlx-vlm's post_layernorm takes LayerNorm's default eps
        from fx_engine.testing.vision import IDEFICS3_VISION

        ref.vision_model.post_layernorm.eps = IDEFICS3_VISION["layer_norm_eps"]
    msgs = messages(png(4, (48, 40)), text="what is in the picture?")
    ip = image_prompt(model, msgs)
    want = _oracle_logits(family, ref, model, msgs, ip.ids)
    got, _ = logits_step(model.params, model.new_cache(1, 512, headroom=256), mx.array([ip.ids], mx.int32),
                         len(ip.ids), images=whole_images(ip, model))
    close(got[0], want, TOL)
    done = fx_engine.generate(model, msgs, max_tokens=4)
    assert list(done.prompt_token_ids) == ip.ids and len(done.token_ids) >= 1
