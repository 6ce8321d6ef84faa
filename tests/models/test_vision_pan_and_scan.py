"""Gemma 3's pan-and-scan (issue 46, item 1: off by default, on where a folder's
preprocessor_config.json says `do_pan_and_scan`): the crops against transformers' torch-free
Gemma3ImageProcessorPil (pixels bit for bit, crop counts), the prompt against
Gemma3Processor's text rule (its "Here is the original image ... and here are some crops
to help you see better ..." expansion, tokenized whole by a tokenizer that has Gemma 3's
image tokens as special tokens), and generation through the Engine equal to the reference
loop.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import fx_engine
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.image_prompt import image_prompt, image_prompt_from_text
from fx_engine.loading.images import pan_and_scan_crops, preprocess_crops, processor_config_from_dict
from fx_engine.testing.mmproj import add_image_tokens
from fx_engine.testing.vision import preprocessor_config, write_tiny_gemma3_vlm

PAS = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 8, "pan_and_scan_max_num_crops": 3,
       "pan_and_scan_min_ratio_to_activate": 1.2}


def _u8(h: int, w: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# wide (3 crops, capped), tall (3), near-square (none), crops under the minimum (none), 2:1 (2)
IMAGES = [_u8(30, 100, 1), _u8(70, 25, 2), _u8(40, 44, 3), _u8(7, 40, 4), _u8(20, 40, 5)]


@pytest.mark.oracle
def test_crops_match_transformers():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    d = preprocessor_config(32, **PAS)
    cfg = processor_config_from_dict(d)
    hf = Gemma3ImageProcessorPil(size=d["size"], resample=d["resample"], image_mean=d["image_mean"],
                                 image_std=d["image_std"], **PAS)(images=IMAGES, return_tensors="np")
    ours = [preprocess_crops(im, cfg) for im in IMAGES]
    assert [o.shape[0] - 1 for o in ours] == list(hf["num_crops"]) == [3, 3, 0, 0, 2]
    assert np.array_equal(np.concatenate(ours), hf["pixel_values"])


def test_off_by_default_and_the_crop_rule():
    off = processor_config_from_dict(preprocessor_config(32))
    assert not off.pan_and_scan and preprocess_crops(IMAGES[0], off).shape == (1, 3, 32, 32)
    on = processor_config_from_dict(preprocessor_config(32, **PAS))
    crops = pan_and_scan_crops(IMAGES[0], on)  # 100 x 30: ratio 3.3 -> 3 crops of ceil(100 / 3) = 34
    assert [c.shape[:2] for c in crops] == [(30, 34), (30, 34), (30, 32)]
    assert np.array_equal(np.concatenate(crops, axis=1), IMAGES[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_gemma3_vlm(tmp_path_factory.mktemp("pas") / "m", preprocessor=PAS)
    add_image_tokens(folder)  # (the tokenizer knows Gemma 3's image strings: the layout oracle below)
    return fx_engine.load(str(folder))


def _hf_text(text: str, crops: list[int], mm: int) -> str:
    """Gemma3Processor's expansion of each <start_of_image> (transformers'
    processing_gemma3: full_image_sequence, and with crops the original-and-crops text)."""
    seq = "\n\n<start_of_image>" + "<image_soft_token>" * mm + "<end_of_image>\n\n"
    pieces = text.split("<start_of_image>")
    out = pieces[0]
    for n, piece in zip(crops, pieces[1:]):
        out += (seq if not n else "Here is the original image " + seq
                + " and here are some crops to help you see better " + " ".join([seq] * n)) + piece
    return out


def test_prompt_is_gemma3_processors_layout(model):
    mm = model.vision.config.mm_tokens_per_image
    text = "<|im_start|>user\nlook <start_of_image> and <start_of_image> then <start_of_image><|im_end|>\n"
    images = [IMAGES[0], IMAGES[2], IMAGES[4]]  # 3 crops, none, 2
    ip = image_prompt_from_text(model, text, images)
    want = list(model.tokenizer.encode(_hf_text(text, [3, 0, 2], mm), add_special_tokens=False))
    assert list(ip.ids) == want
    assert len(ip.spans) == 4 + 1 + 3 and ip.image_tokens == (4 * mm, mm, 3 * mm)
    assert ip.rows.shape[0] == 8 * mm


def test_generation_with_crops_equals_the_reference_loop(model):
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(IMAGES[0]).save(buf, format="PNG")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image", "image": buf.getvalue()}]}]
    got = fx_engine.generate(model, msgs, max_tokens=5, logprobs=2)
    want = reference_generate(model, msgs, max_tokens=5, logprobs=2, prefill_chunk=32)
    assert list(got.prompt_token_ids) == list(image_prompt(model, msgs).ids)
    assert list(got.token_ids) == list(want.token_ids)
    for x, y in zip(got.logprobs, want.logprobs, strict=True):
        assert [t[0] for t in x.top] == [t[0] for t in y.top]
        assert max(abs(p[2] - q[2]) for p, q in zip(x.top, y.top)) <= 1e-4
    cfg = json.loads((Path(model.path) / "preprocessor_config.json").read_text())
    assert cfg["do_pan_and_scan"] is True
