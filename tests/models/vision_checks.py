"""Helpers the vision-language tests share (tests/models/test_qwen2_vl_text.py,
test_qwen3_vl.py, test_mistral3_vision.py, test_vision_idefics3.py, test_vision_gemma3.py):
random test images, a user turn holding them, the max-difference check against an oracle
(each file passes its own tolerance), mlx-vlm's model loaded from a folder, greedy decoding
with an oracle's whole forward, and for the Qwen-VL files (qwen2_vl / qwen3_vl) a two-image
prompt, its processor pixels, its whole-prompt image input and mlx-vlm's greedy tokens."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Collection, Sequence

import mlx.core as mx
import numpy as np

from fx_engine.core.vision.splice import ImageInput
from fx_engine.engine.image_prompt import image_prompt, step_images
from fx_engine.loading.images_qwen2_vl import preprocess


def image(seed: int, size: tuple[int, int] = (40, 30)) -> Any:
    """A random RGB PIL image of `size` (width, height)."""
    import PIL.Image

    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png(seed: int, size: tuple[int, int] = (40, 30)) -> bytes:
    """`image(seed, size)` encoded as PNG bytes."""
    buf = io.BytesIO()
    image(seed, size).save(buf, format="PNG")
    return buf.getvalue()


def messages(*images: Any, text: str = "what is in the picture?") -> list[dict]:
    """One user turn: the images (encoded bytes, or content parts as they are), then the text."""
    parts = [img if isinstance(img, dict) else {"type": "image", "image": img} for img in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def close(ours: mx.array, ref: mx.array, tol: float) -> float:
    """Asserts the shapes agree and max |ours - ref| (in float32) <= tol; returns the max."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert diff <= tol, f"max |diff| = {diff}"
    return diff


def load_mlx_vlm(path: str | Path) -> Any:
    """mlx-vlm's whole model from a checkpoint folder (the oracle)."""
    from mlx_vlm.utils import load_model

    return load_model(Path(path))


def greedy_tokens(logits: Callable[[mx.array], mx.array], prompt: Sequence[int], n: int,
                  eos_ids: Collection[int]) -> list[int]:
    """Up to n greedy tokens after `prompt` from an oracle's whole forward, no cache: each
    step runs `logits(ids [1, L])` -> [1, L, vocab] over the whole sequence so far; stops
    after an end token."""
    ids, out = list(prompt), []
    for _ in range(n):
        tok = int(mx.argmax(logits(mx.array([ids]))[0, -1]).item())
        out.append(tok)
        if tok in eos_ids:
            break
        ids.append(tok)
    return out


# ---------------------------------------------------------------- Qwen-VL (qwen2_vl, qwen3_vl)


def two_images() -> list[dict]:
    """Messages with two images of different sizes and text between and after them."""
    return [{"role": "user", "content": [
        {"type": "text", "text": "compare"}, {"type": "image", "image": png(4)},
        {"type": "text", "text": "with this one"}, {"type": "image", "image": png(5, (24, 56))},
        {"type": "text", "text": "what differs?"}]}]


def qwen_pixels(model: Any, msgs: list[dict]) -> tuple[mx.array, mx.array]:
    """The Qwen-VL processor's pixel_values and image_grid_thw of the messages' images."""
    import PIL.Image

    imgs = [PIL.Image.open(io.BytesIO(p["image"])) for m in msgs for p in m["content"] if p["type"] == "image"]
    patches, grid = preprocess(imgs, model.image_processor)
    return mx.array(patches), mx.array(grid)


def whole_images(ip: Any, model: Any) -> ImageInput:
    """The image input of a prefill step over the whole prompt `ip` (an ImagePrompt)."""
    return step_images([(type("R", (), {"image": ip})(), 0, len(ip.ids))], model.vision.config.image_token_index)


def qwen_decode_matches(ref: Any, model: Any, msgs: list[dict], steps: int, tol: float) -> mx.array:
    """The image prompt's logits [L, vocab] through our step (image rows, M-RoPE offsets,
    DeepStack), then `steps` greedy decode steps (plain RoPE at the cache position) each
    checked against mlx-vlm's whole Qwen-VL forward `ref` over the prompt and the tokens so
    far; returns the prompt's logits (the caller checks them)."""
    from fx_engine.core.steps import logits_step

    ip = image_prompt(model, msgs)
    pixels, grid = qwen_pixels(model, msgs)
    lg, cache = logits_step(model.params, model.new_cache(1, 256), mx.array([ip.ids], mx.int32), len(ip.ids),
                            images=whole_images(ip, model))
    prompt, seq = lg[0], list(ip.ids)
    for _ in range(steps):
        tok = int(mx.argmax(lg[0, -1]).item())
        seq.append(tok)
        lg, cache = logits_step(model.params, cache, mx.array([[tok]], mx.int32), 1)
        close(lg[0, -1], ref(mx.array([seq]), pixels, image_grid_thw=grid).logits[0, -1], tol)
    return prompt


def qwen_greedy(ref: Any, model: Any, msgs: list[dict], n: int) -> tuple[list[int], list[int]]:
    """(prompt ids, up to n greedy tokens) with mlx-vlm's whole Qwen-VL forward `ref`, no
    cache (each step the whole sequence: its get_rope_index puts the generated text after
    the images)."""
    ip = image_prompt(model, msgs)
    pixels, grid = qwen_pixels(model, msgs)
    return ip.ids, greedy_tokens(lambda ids: ref(ids, pixels, image_grid_thw=grid).logits, ip.ids, n, model.eos_ids)
