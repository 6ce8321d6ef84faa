"""Gemma 3's image path (issue 46 groundwork): the SigLIP tower and the multimodal projector
against mlx-vlm 0.7.10's Gemma 3 classes with the same random weights, the splice of image
embeddings into the token embeddings, the prompt layout and image-token attention masks,
pixel preprocessing against transformers' torch-free Gemma3ImageProcessorPil, and the
refusals.

Tolerance: both sides compute in float32 from identical weights; the differences are
summation order (our fused q|k|v and the patch conv as one matmul, BLAS blocking), our
softmax's `fast_exp` and tanh-GELU as x * sigmoid(2u): measured ~2e-6 on outputs of
magnitude ~4, against TOL = 1e-4. mlx-vlm's post_layernorm uses eps 1e-5 where Hugging
Face (and we) use the config's layer_norm_eps: the oracle's is set to the config's.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fx_engine.core.checkpoint import LoadOptions, TensorSource, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.nn import Numerics
from fx_engine.core.vision import gemma3, siglip, vision_module
from fx_engine.loading.images import (ImageError, ImageProcessorConfig, preprocess, processor_config_from_dict,
                                      read_processor_config)
from fx_engine.loading.vision import load_vision, read_config
from fx_engine.testing.vision import TINY_IDS, preprocessor_config, tiny_gemma3_config, write_tiny_gemma3_vlm
from tests.models.vision_checks import close, load_mlx_vlm

TOL = 1e-4
IMG, BOI, EOI = TINY_IDS["image_token_index"], TINY_IDS["boi_token_index"], TINY_IDS["eoi_token_index"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made: dict[str, Path] = {}

    def folder(kind: str = "hf") -> Path:
        if kind not in made:
            root = tmp_path_factory.mktemp(f"gemma3-vlm-{kind}")
            made[kind] = write_tiny_gemma3_vlm(
                root / "m", layout="mlx" if kind == "mlx" else "hf",
                quantize_vision={"group_size": 32, "bits": 4} if kind == "q4" else None)
        return made[kind]

    return folder


def _mlx_vlm(path: Path):
    ref = load_mlx_vlm(path)
    cfg = json.loads((path / "config.json").read_text())
    # mlx-vlm's post_layernorm has LayerNorm's default eps (1e-5); Hugging Face's the config's
    ref.vision_tower.vision_model.post_layernorm.eps = cfg["vision_config"]["layer_norm_eps"]
    return ref


def _pixels(n: int, size: int = 32, seed: int = 3) -> mx.array:
    return mx.random.uniform(-1, 1, (n, 3, size, size), key=mx.random.key(seed))


# ---------------------------------------------------------------- against mlx-vlm


@pytest.mark.oracle
@pytest.mark.parametrize("kind", ["hf", "mlx"])
def test_tower_and_projector_match_mlx_vlm(folders, kind):
    """Hugging Face's tensors and mlx-vlm's converted ones (patch conv channels last)."""
    path = folders(kind)
    params, ref = load_vision(path), _mlx_vlm(path)
    pix = _pixels(2)
    feats = siglip.forward(params.tower, pix)
    want, _, _ = ref.vision_tower(pix.transpose(0, 2, 3, 1))  # mlx-vlm's tower reads NHWC
    close(feats, want, TOL)
    assert feats.shape == (2, 64, 32)
    emb = gemma3.encode_images(params, pix)
    close(emb, ref.multi_modal_projector(want), TOL)
    assert emb.shape == (2, 16, 64)
    compiled = gemma3.encode_images_compiled(params, pix)
    assert mx.array_equal(compiled, emb)


@pytest.mark.oracle
@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "packed"])
def test_quantized_tower_matches_mlx_vlm(folders, keep):
    """An mlx-community folder whose vision linears are 4-bit: kept packed or dequantized."""
    path = folders("q4")
    params, ref = load_vision(path, keep_quantized=keep), _mlx_vlm(path)
    assert params.tower.layers[0].fc1.quantized == keep
    assert type(ref.vision_tower.vision_model.encoder.layers[0].mlp.fc1).__name__ == "QuantizedLinear"
    pix = _pixels(1, seed=5)
    want, _, _ = ref.vision_tower(pix.transpose(0, 2, 3, 1))
    close(gemma3.encode_images(params, pix), ref.multi_modal_projector(want), TOL)


@pytest.mark.oracle
def test_splice_matches_mlx_vlm_input_embeddings(folders):
    """mlx-vlm's get_input_embeddings: text rows from the table, image rows scattered in
    order, scaled by 1 / sqrt(hidden_size) (its text model multiplies by bf16(sqrt(64)) = 8
    after: exactly Hugging Face's unscaled image rows in the scaled stream)."""
    path = folders("hf")
    params, ref = load_vision(path), _mlx_vlm(path)
    cfg = params.config
    run = [BOI] + [IMG] * cfg.mm_tokens_per_image + [EOI]
    ids = mx.array([[1, 5, 6, *run, 7, 8, *run, 9]])
    pix = _pixels(2, seed=7)
    want = ref.get_input_embeddings(ids, pix, mask=mx.ones(ids.shape)).inputs_embeds
    table = mx.load(str(path / "model.safetensors"))["language_model.model.embed_tokens.weight"]
    images = gemma3.encode_images(params, pix) / cfg.text_hidden_size ** 0.5
    close(gemma3.splice_images(table[ids], ids, images, cfg.image_token_index), want, TOL)
    assert gemma3.image_token_runs(ids[0].tolist(), cfg, n_images=2) == [(4, 20), (24, 40)]


# ---------------------------------------------------------------- loading, layouts, compile


def test_text_model_of_the_folder_still_loads(folders):
    """The writer's folder is a valid `gemma3` wrapper for the text loader (which drops the
    vision tensors)."""
    import fx_engine

    model = fx_engine.load(folders("hf"))
    assert model.config.model_type == "gemma3_text"


def test_newer_transformers_prefixes_read_the_same(folders):
    """transformers >= 4.52 saves model.vision_tower.* / model.multi_modal_projector.*."""
    path = folders("hf")
    cfg, _ = read_config(path)
    tensors = {n: t for n, t in mx.load(str(path / "model.safetensors")).items() if gemma3.is_vision_tensor(n)}
    src = TensorSource()
    src.add("new", {"model." + n: t for n, t in tensors.items()})
    params = gemma3.assemble(cfg, src, LoadOptions(dtype=mx.float32))
    pix = _pixels(1)
    assert mx.array_equal(gemma3.encode_images(params, pix), gemma3.encode_images(load_vision(path), pix))


def test_compiled_encoder_traces_once_per_batch_size(folders):
    params = load_vision(folders("hf"))
    fn = gemma3.encode_images_compiled
    before = fn.traces
    for seed in range(3):
        fn(params, _pixels(1, seed=seed))
    assert fn.traces - before <= 1
    fn(params, _pixels(3))
    assert fn.traces - before <= 2


@pytest.mark.parametrize("kind", ["hf", "q4"])
def test_batch_invariant_mode_encodes_an_image_alike_in_any_batch(folders, kind):
    params = load_vision(folders(kind), keep_quantized=True, numerics=Numerics(batch_invariant=True))
    pix = _pixels(3, seed=11)
    alone = gemma3.encode_images(params, pix[1:2])
    assert mx.array_equal(gemma3.encode_images(params, pix)[1:2], alone)
    close(alone, gemma3.encode_images(load_vision(folders(kind), keep_quantized=True), pix[1:2]), TOL)


def test_tower_refuses_pixels_of_the_wrong_shape(folders):
    params = load_vision(folders("hf"))
    for shape in [(1, 3, 16, 16), (1, 32, 32, 3), (3, 32, 32)]:
        with pytest.raises(ValueError, match="channels first"):
            siglip.forward(params.tower, mx.zeros(shape))


def test_bfloat16_load_runs_in_bfloat16(folders):
    params = load_vision(folders("hf"), dtype=mx.bfloat16)
    out = gemma3.encode_images(params, _pixels(1))
    assert out.dtype == mx.bfloat16
    ref = gemma3.encode_images(load_vision(folders("hf")), _pixels(1))
    assert mx.abs(out.astype(mx.float32) - ref).max().item() < 0.1


# ---------------------------------------------------------------- splice, prompt layout, masks


def test_splice_per_row_and_per_chunk():
    """Rows take images in batch order; a prefill chunk's `start` picks up where the
    sequence's earlier chunks left off."""
    h, mm = 4, 3
    embeds = mx.zeros((2, 8, h))
    tokens = mx.array([[1, IMG, IMG, IMG, 2, IMG, IMG, IMG], [IMG, IMG, IMG, 5, 6, 7, 8, 9]])
    images = mx.arange(3 * mm * h, dtype=mx.float32).reshape(3, mm, h) + 1
    rows = images.reshape(-1, h)
    out = gemma3.splice_images(embeds, tokens, images, IMG)
    assert mx.array_equal(out[0, 1:4], rows[0:3]) and mx.array_equal(out[0, 5:8], rows[3:6])
    assert mx.array_equal(out[1, 0:3], rows[6:9])
    assert mx.array_equal(out[0, 0], embeds[0, 0]) and mx.array_equal(out[1, 3:], embeds[1, 3:])
    # row 0 in two chunks: [0, 5) then [5, 8), the second starting after 3 image tokens
    first = gemma3.splice_images(embeds[:1, :5], tokens[:1, :5], images[:2], IMG, start=mx.array([0]))
    second = gemma3.splice_images(embeds[:1, 5:], tokens[:1, 5:], images[:2], IMG, start=mx.array([3]))
    assert mx.array_equal(mx.concatenate([first, second], axis=1), out[:1])


def test_image_token_runs_are_checked():
    cfg = gemma3.config_from_hf(tiny_gemma3_config(mm_tokens_per_image=4))
    good = [1, BOI, IMG, IMG, IMG, IMG, EOI, 2]
    assert gemma3.image_token_runs(good, cfg, n_images=1) == [(2, 6)]
    with pytest.raises(ValueError, match="3 of them, expected mm_tokens_per_image = 4"):
        gemma3.image_token_runs([BOI, IMG, IMG, IMG, EOI], cfg)
    with pytest.raises(ValueError, match="not between a start-of-image"):
        gemma3.image_token_runs([1, IMG, IMG, IMG, IMG, EOI], cfg)
    with pytest.raises(ValueError, match="not between a start-of-image"):
        gemma3.image_token_runs([BOI, IMG, IMG, IMG, IMG], cfg)
    with pytest.raises(ValueError, match="2 image"):
        gemma3.image_token_runs(good, cfg, n_images=2)


def test_expand_image_text_is_gemma3_processors_layout():
    """transformers' Gemma3Processor: full_image_sequence = "\\n\\n" + boi + image * n +
    eoi + "\\n\\n" replaces each boi placeholder (pan-and-scan off)."""
    cfg = gemma3.config_from_hf(tiny_gemma3_config(mm_tokens_per_image=4))
    text = "<start_of_turn>user\n<start_of_image>What is this?<end_of_turn>\n"
    seq = "\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\n"
    assert gemma3.expand_image_text(text, cfg, 1) == text.replace("<start_of_image>", seq)
    with pytest.raises(ValueError, match="1 <start_of_image> placeholder"):
        gemma3.expand_image_text(text, cfg, 2)


def test_image_horizon_in_a_chunk():
    """A chunk at positions 10..: each image token's horizon is its run's last position."""
    tokens = mx.array([[2, BOI, IMG, IMG, IMG, EOI, BOI, IMG, IMG, EOI]])
    pos = mx.arange(10, 20, dtype=mx.int32)[None]
    assert gemma3.image_horizon(tokens, pos, IMG).tolist() == [[10, 11, 14, 14, 14, 15, 16, 18, 18, 19]]


def _hf_mask(groups: np.ndarray, window: int | None) -> np.ndarray:
    """transformers' mask functions, evaluated pointwise: causal_mask_function (kv <= q),
    blockwise_overlay (same group, not -1) OR-ed in, sliding_window_overlay (kv > q - W)
    AND-ed after (create_masks_for_vision_model)."""
    b, t = groups.shape
    out = np.zeros((b, 1, t, t), bool)
    for r in range(b):
        for q in range(t):
            for kv in range(t):
                allowed = kv <= q or (groups[r, q] == groups[r, kv] and groups[r, q] >= 0)
                if window is not None:
                    allowed = allowed and kv > q - window
                out[r, 0, q, kv] = allowed
    return out


@pytest.mark.parametrize("window", [None, 3, 6])
def test_prompt_mask_is_transformers_composition(window):
    tokens = mx.array([[1, BOI, IMG, IMG, IMG, IMG, EOI, 2, BOI, IMG, IMG, IMG, IMG, EOI, 3],
                       [BOI, IMG, IMG, IMG, IMG, EOI, BOI, IMG, IMG, IMG, IMG, EOI, 4, 5, 6]])
    groups = gemma3.image_groups(tokens, IMG)
    assert groups[0].tolist() == [-1, -1, 0, 0, 0, 0, -1, -1, -1, 1, 1, 1, 1, -1, -1]
    assert groups[1].tolist()[:12] == [-1, 0, 0, 0, 0, -1, -1, 1, 1, 1, 1, -1]
    ours = np.array(gemma3.prompt_attention_mask(tokens, IMG, window))
    want = _hf_mask(np.array(groups), window)
    assert np.array_equal(ours, want)
    overlay = np.array(gemma3.image_attention_overlay(groups, groups))
    causal = np.tril(np.ones((15, 15), bool))
    windowed = np.ones((15, 15), bool) if window is None else np.triu(np.ones((15, 15), bool), 1 - window)
    assert np.array_equal((causal | overlay) & windowed, want)
    # image tokens see later tokens of their own image only; text and boi/eoi stay causal
    assert ours[0, 0, 2, 5] and not ours[0, 0, 2, 9] and not ours[0, 0, 1, 2] and not ours[0, 0, 6, 7]


# ---------------------------------------------------------------- preprocessing vs transformers


def _hf_processor(d: dict):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    keys = ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean", "image_std", "resample",
            "rescale_factor", "size")
    return Gemma3ImageProcessorPil(**{k: d[k] for k in keys if d.get(k) is not None})


def _hf_pixels(d: dict, images: list) -> np.ndarray:
    return _hf_processor(d)(images=images, return_tensors="np")["pixel_values"]


def _random_u8(h: int, w: int, c: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, c), dtype=np.uint8)


@pytest.mark.oracle
@pytest.mark.parametrize("resample", [2, 3, 1, 0, 4, 5])
def test_preprocessing_matches_transformers(resample):
    from PIL import Image

    d = preprocessor_config(32, resample=resample, image_mean=[0.48145466, 0.4578275, 0.40821073],
                            image_std=[0.26862954, 0.26130258, 0.27577711])
    cfg = processor_config_from_dict(d)
    rgba = _random_u8(40, 27, 4, 3)
    images = [_random_u8(50, 70, 3, 1), _random_u8(13, 20, 3, 2),  # down- and up-scaled
              rgba, Image.fromarray(rgba, "RGBA"),  # alpha onto white
              Image.fromarray(_random_u8(33, 31, 1, 4)[..., 0], "L"), _random_u8(32, 32, 3, 5)]
    ours = preprocess(images, cfg)
    want = _hf_pixels(d, images)
    assert ours.shape == want.shape == (6, 3, 32, 32) and ours.dtype == np.float32
    assert np.array_equal(ours, want)  # the same PIL resize and float steps: bit for bit


@pytest.mark.oracle
def test_encoded_images_open_as_load_image_does():
    """Bytes and files: EXIF orientation applied, alpha dropped (transformers' load_image)."""
    from PIL import Image
    from transformers.image_utils import load_image

    d = preprocessor_config(32)
    cfg = processor_config_from_dict(d)
    buf = io.BytesIO()
    img = Image.fromarray(_random_u8(24, 40, 3, 6))
    exif = Image.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: displayed 24 wide, 40 tall
    img.save(buf, "JPEG", exif=exif, quality=95)
    png = io.BytesIO()
    Image.fromarray(_random_u8(21, 17, 4, 7), "RGBA").save(png, "PNG")
    for data in (buf.getvalue(), png.getvalue()):
        want = _hf_pixels(d, [load_image(Image.open(io.BytesIO(data)))])
        assert np.array_equal(preprocess(data, cfg), want)
    assert load_image(Image.open(io.BytesIO(buf.getvalue()))).size == (24, 40)


def test_folder_preprocessor_config_and_paths(folders, tmp_path):
    from PIL import Image

    path = folders("hf")
    cfg = read_processor_config(path, image_size=32)
    assert (cfg.height, cfg.width, cfg.resample, cfg.image_mean) == (32, 32, 2, (0.5, 0.5, 0.5))
    file = tmp_path / "x.png"
    Image.fromarray(_random_u8(9, 11, 3, 8)).save(file)
    assert np.array_equal(preprocess(file, cfg), preprocess(file.read_bytes(), cfg))
    exact = preprocess(np.full((32, 32, 3), 255, np.uint8), cfg)
    assert np.all(exact == 1.0)
    with pytest.raises(ConfigError, match="not the vision tower's image_size"):
        read_processor_config(path, image_size=64)


# ---------------------------------------------------------------- refusals


def _set_mm(d: dict, n: int) -> None:
    d["mm_tokens_per_image"] = d["text_config"]["mm_tokens_per_image"] = n


@pytest.mark.parametrize("change,match", [
    (lambda c: c.pop("vision_config"), "'vision_config' is missing"),
    (lambda c: c["vision_config"].update(model_type="siglip2_vision_model"), "'model_type' = 'siglip2_vision_model'"),
    (lambda c: c["vision_config"].update(hidden_act="gelu"), "'hidden_act' = 'gelu'"),
    (lambda c: c["vision_config"].pop("patch_size"), "required field 'patch_size'"),
    (lambda c: c["vision_config"].update(image_size=30), "not a multiple of patch_size"),
    (lambda c: c["vision_config"].update(num_attention_heads=5), "not a multiple of num_attention_heads"),
    (lambda c: c["vision_config"].update(num_channels=4), "num_channels = 4"),
    (lambda c: c["vision_config"].update(layer_norm_eps=0), "'layer_norm_eps' must be > 0"),
    (lambda c: _set_mm(c, 15), "not a square"),
    (lambda c: _set_mm(c, 9), "do not pool evenly"),
    (lambda c: c.update(mm_tokens_per_image=4), "disagree"),
    (lambda c: c.update(image_token_id=3), "'image_token_index' and 'image_token_id' disagree"),
    (lambda c: c.update(boi_token_index=IMG), "must differ"),
    (lambda c: c["text_config"].pop("hidden_size"), "text_config: required field 'hidden_size'"),
    (lambda c: c.update(model_type="gemma3n"), "not supported for model_type 'gemma3n'"),
])
def test_config_refusals_name_the_field(change, match):
    d = tiny_gemma3_config()
    change(d)
    with pytest.raises(ConfigError, match=match):
        vision_module(d, "config.json").config_from_hf(d, "config.json")


def test_mm_tokens_may_come_from_either_place():
    d = tiny_gemma3_config()
    del d["mm_tokens_per_image"]
    assert gemma3.config_from_hf(d).mm_tokens_per_image == 16
    d = tiny_gemma3_config(image_token_id=IMG)
    assert gemma3.config_from_hf(d).image_token_index == IMG


def _src(path: Path) -> TensorSource:
    src = TensorSource()
    src.add(path / "model.safetensors", dict(mx.load(str(path / "model.safetensors"))))
    return src


def test_weight_refusals_name_the_tensor(folders):
    path = folders("hf")
    cfg, _ = read_config(path)
    opts = LoadOptions(dtype=mx.float32)
    src = _src(path)
    name = "vision_tower.vision_model.encoder.layers.1.mlp.fc2.bias"
    del src.tensors[name]
    with pytest.raises(WeightsError, match="missing tensor '" + name.replace(".", r"\.")):
        gemma3.assemble(cfg, src, opts)
    src = _src(path)
    patch = "vision_tower.vision_model.embeddings.patch_embedding.weight"
    src.tensors[patch] = mx.zeros((32, 3, 5, 4))
    with pytest.raises(WeightsError, match="expected \\(32, 3, 4, 4\\) \\(Hugging Face\\) or \\(32, 4, 4, 3\\)"):
        gemma3.assemble(cfg, src, opts)
    src = _src(path)
    src.tensors = {n: t for n, t in src.tensors.items() if not n.startswith("vision_tower.")}
    with pytest.raises(WeightsError, match="no vision tower tensors"):
        gemma3.assemble(cfg, src, opts)
    src = _src(path)
    src.tensors["multi_modal_projector.mm_input_projection_weight"] = mx.zeros((64, 32))
    with pytest.raises(WeightsError, match="mm_input_projection_weight' has shape \\(64, 32\\), expected \\(32, 64\\)"):
        gemma3.assemble(cfg, src, opts)


def test_patch_layout_ambiguity_is_refused():
    d = tiny_gemma3_config(vision={"patch_size": 3, "image_size": 24})
    d["mm_tokens_per_image"] = d["text_config"]["mm_tokens_per_image"] = 16
    cfg = gemma3.config_from_hf(d)
    src = TensorSource()
    src.add("x", {"vision_tower.vision_model.embeddings.patch_embedding.weight": mx.zeros((32, 3, 3, 3))})
    with pytest.raises(WeightsError, match="cannot be told apart"):
        gemma3.assemble(cfg, src, LoadOptions(dtype=mx.float32))


@pytest.mark.parametrize("change,match", [
    ({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 0}, "'pan_and_scan_max_num_crops' must be a positive"),
    ({"pan_and_scan_min_ratio_to_activate": "x"}, "'pan_and_scan_min_ratio_to_activate' must be a positive number"),
    ({"size": {"shortest_edge": 32}}, "field 'size'"),
    ({"resample": 7}, "field 'resample'"),
    ({"image_std": [0.5, 0, 0.5]}, "'image_std' must be > 0"),
    ({"image_mean": [0.5, 0.5]}, "'image_mean' must be a number or a list of 3"),
    ({"image_processor_type": "SiglipImageProcessor"}, "image_processor_type 'SiglipImageProcessor'"),
    ({"do_center_crop": True}, "'do_center_crop' = true"),
    ({"rescale_factor": -1}, "'rescale_factor'"),
    ({"do_resize": "yes"}, "'do_resize' must be true, false or null"),
])
def test_preprocessor_config_refusals(change, match):
    with pytest.raises(ConfigError, match=match):
        processor_config_from_dict(preprocessor_config(32, **change))


@pytest.mark.parametrize("image,match", [
    (b"not an image", "image 0: not a readable image"),
    (np.zeros((8, 8, 3), np.float32), "must be uint8"),
    (np.zeros((8, 8, 2), np.uint8), "channels last"),
    (np.zeros((2, 8, 8, 3), np.uint8), "channels last"),
    (np.zeros((0, 8, 3), np.uint8), "empty"),
    ("photo.png", "a str is not an image"),
    (Path("/nonexistent/photo.png"), "no such file"),
    (3.5, "unsupported image type float"),
    ([], "no images given"),
])
def test_bad_images_are_refused(image, match):
    with pytest.raises(ImageError, match=match):
        preprocess(image, ImageProcessorConfig(height=8, width=8))


def test_without_resizing_the_size_must_match():
    cfg = ImageProcessorConfig(height=8, width=8, do_resize=False)
    assert preprocess(np.zeros((8, 8, 3), np.uint8), cfg).shape == (1, 3, 8, 8)
    with pytest.raises(ImageError, match="resizing is off"):
        preprocess(np.zeros((9, 8, 3), np.uint8), cfg)
