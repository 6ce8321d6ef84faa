"""Qwen2.5-VL's (and Qwen2-VL's) vision tower and pixel preprocessing (issue 46, first half):
fx_engine/core/vision/qwen2_vl.py against mlx-vlm 0.7.10's qwen2_5_vl / qwen2_vl
`VisionModel` with the same random weights (tiny configs, Hugging Face and mlx-vlm tensor
names and conv layouts), fx_engine/loading/images_qwen2_vl.py against transformers'
torch-free Qwen2VLImageProcessorPil, and the refusals.

Tolerance: both sides compute in float32 from identical weights; the differences are
summation order and our swiglu's `fast_exp`: TOL = 1e-4 on outputs of magnitude ~1.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from fx_engine.core.checkpoint import LoadOptions, TensorSource, WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.vision import qwen2_vl

TOL = 1e-4

# tiny towers: patch 4, merge 2, window 16 px -> 2 x 2 merged tokens a window
VISION_25 = {"model_type": "qwen2_5_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
             "out_hidden_size": 40, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2,
             "in_channels": 3, "window_size": 16, "fullatt_block_indexes": [1], "hidden_act": "silu",
             "tokens_per_second": 2}
VISION_2 = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "hidden_size": 40, "mlp_ratio": 2,
            "num_heads": 2, "patch_size": 4, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_chans": 3,
            "hidden_act": "quick_gelu"}
GRIDS = {
    "one": [[1, 4, 6]],
    "two images": [[1, 4, 4], [1, 6, 8]],
    "not a window multiple": [[1, 6, 10]],
    "two frames": [[2, 4, 6]],
    "three mixed": [[1, 10, 6], [2, 4, 4], [1, 2, 2]],
}


def _config(mt: str = "qwen2_5_vl", vision: dict | None = None, **top) -> dict:
    v = dict(VISION_25 if mt == "qwen2_5_vl" else VISION_2)
    v.update(vision or {})
    return {"model_type": mt, "vision_config": v, "text_config": {"hidden_size": 40}, **top}


def _weights(cfg: qwen2_vl.Qwen2VLConfig, seed: int = 0) -> dict[str, mx.array]:
    layout = qwen2_vl.checkpoint_layout(cfg)
    keys = iter(mx.random.split(mx.random.key(seed), len(layout)))
    return {n: spec.center + spec.scale * mx.random.normal(spec.shape, key=next(keys)) for n, spec in layout.items()}


def _source(tensors: dict[str, mx.array]) -> TensorSource:
    src = TensorSource()
    src.add("model.safetensors", tensors)
    return src


def _ours(cfg, tensors, **opts):
    return qwen2_vl.assemble(cfg, _source(tensors), LoadOptions(dtype=mx.float32, **opts))


def _reference(mt: str, hf: dict[str, mx.array]):
    """mlx-vlm's VisionModel with the same weights (Hugging Face names through its sanitize)."""
    if mt == "qwen2_5_vl":
        from mlx_vlm.models.qwen2_5_vl.config import VisionConfig
        from mlx_vlm.models.qwen2_5_vl.vision import VisionModel
    else:
        from mlx_vlm.models.qwen2_vl.config import VisionConfig
        from mlx_vlm.models.qwen2_vl.vision import VisionModel
    v = dict(VISION_25 if mt == "qwen2_5_vl" else VISION_2)
    v.pop("hidden_act")
    if "in_chans" in v:
        v["in_channels"] = v.pop("in_chans")
    model = VisionModel(VisionConfig(**v))
    w = model.sanitize({n[len("visual."):]: t for n, t in hf.items()})
    model.load_weights(list(w.items()), strict=True)
    return model


def _patches(grid, seed: int = 1, features: int = 3 * 2 * 4 * 4) -> mx.array:
    n = sum(t * h * w for t, h, w in grid)
    return mx.random.uniform(-1, 1, (n, features), key=mx.random.key(seed))


def _close(ours: mx.array, ref: mx.array) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert diff <= TOL, f"max |diff| = {diff}"
    return diff


@pytest.fixture(scope="module")
def towers():
    made = {}

    def tower(mt: str = "qwen2_5_vl"):
        if mt not in made:
            cfg = qwen2_vl.config_from_hf(_config(mt))
            hf = _weights(cfg)
            made[mt] = (cfg, hf, _ours(cfg, hf), _reference(mt, hf))
        return made[mt]

    return tower


# ---------------------------------------------------------------- against mlx-vlm


@pytest.mark.oracle
@pytest.mark.parametrize("mt", ["qwen2_5_vl", "qwen2_vl"])
@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_tower_matches_mlx_vlm(towers, mt, grid):
    cfg, _, params, ref = towers(mt)
    pix = _patches(grid)
    g = mx.array(grid)
    ours = qwen2_vl.encode_images(params, pix, g)
    want = ref(pix, g)
    _close(ours, want)
    assert ours.shape == (sum(cfg.image_tokens(x) for x in grid), 40)


@pytest.mark.oracle
def test_mlx_vlm_layout_and_prefixes_read_the_same(towers):
    """mlx-vlm's converted names (vision_tower.*, conv channels last) and transformers >=
    4.52's model.visual.* give the same params."""
    cfg, hf, params, ref = towers()
    grid = GRIDS["two images"]
    pix = _patches(grid, seed=4)
    want = qwen2_vl.encode_images(params, pix, grid)
    mlx_names = {"vision_tower." + n: t for n, t in tree_flatten(ref.parameters())}
    assert mlx_names["vision_tower.patch_embed.proj.weight"].shape == (32, 2, 4, 4, 3)
    for tensors in (mlx_names, {"model." + n: t for n, t in hf.items()}):
        assert mx.array_equal(qwen2_vl.encode_images(_ours(cfg, tensors), pix, grid), want)


def test_window_order_is_mlx_vlms(towers):
    """Our window regrouping equals mlx-vlm's get_window_index (order and window sizes)."""
    cfg, _, _, ref = towers()
    for grid in GRIDS.values():
        index, cu = ref.get_window_index(mx.array(grid))
        order, lens = qwen2_vl._window_index(qwen2_vl._grids(grid, cfg), cfg)
        assert order.tolist() == index.tolist()
        cu = sorted(set(cu.tolist()))
        assert (np.diff(cu) // cfg.merge_unit).tolist() == lens


@pytest.mark.parametrize("mt", ["qwen2_5_vl", "qwen2_vl"])
@pytest.mark.parametrize("grid", list(GRIDS.values()), ids=list(GRIDS))
def test_compiled_padded_encoder_matches_mlx_vlm(towers, mt, grid):
    """The compiled forward pads the patches to a size bucket (padding patches, window and
    frame slots that real tokens never attend to): mlx-vlm's unpadded output all the same."""
    cfg, _, params, ref = towers(mt)
    pix = _patches(grid, seed=6)
    assert qwen2_vl.padded_tokens(qwen2_vl._grids(grid, cfg), cfg.merge_unit) >= pix.shape[0]
    got = qwen2_vl.encode_images_compiled(params, pix, grid)
    assert got.shape == (sum(cfg.image_tokens(x) for x in grid), 40)
    _close(got, ref(pix, mx.array(grid)))


def test_compiled_encoder_traces_once_per_size_bucket(towers):
    """Images whose merged-token count and window count fall in the same buckets share one
    trace (4 x 5 and 5 x 4 merged tokens: 20, 6 windows); another bucket traces once more
    (6 x 7 and 7 x 6: 42 padded to 44); the padding never reaches the output (each equals
    the eager unpadded forward)."""
    _, _, params, _ = towers()
    fn = qwen2_vl._compiled
    before = fn.traces
    same = [[[1, 8, 10]], [[1, 10, 8]]]
    for i, grid in enumerate(same):
        pix = _patches(grid, seed=10 + i)
        _close(qwen2_vl.encode_images_compiled(params, pix, np.array(grid)), qwen2_vl.encode_images(params, pix, grid))
    assert fn.traces - before == 1
    pix = _patches([[1, 12, 14]])
    _close(qwen2_vl.encode_images_compiled(params, pix, [[1, 12, 14]]), qwen2_vl.encode_images(params, pix, [[1, 12, 14]]))
    assert fn.traces - before == 2
    qwen2_vl.encode_images_compiled(params, _patches([[1, 14, 12]], seed=3), [[1, 14, 12]])
    assert fn.traces - before == 2


def test_geometry_padding_is_inert(towers):
    """Padded geometry: real tokens keep their order, positions and segments; padding
    patches sit last in both orders, scatter to slot 0, and every segment row has a key."""
    cfg, _, _, _ = towers()
    grid = [[1, 6, 10]]
    plain = qwen2_vl.geometry(grid, cfg)
    padded = qwen2_vl.geometry(grid, cfg, tokens=80)
    n, m = 60, 15
    assert np.array_equal(np.array(padded.order)[:n], np.array(plain.order))
    assert np.array_equal(np.array(padded.order)[n:], np.arange(n, 80))
    assert np.array_equal(np.array(padded.restore)[:m], np.array(plain.restore))
    assert np.array_equal(np.array(padded.rows_cols)[:n], np.array(plain.rows_cols))
    assert np.array(padded.windows.valid).any(axis=1).all() and np.array(padded.frames.valid).any(axis=1).all()
    assert (np.array(padded.windows.scatter)[n:] == 0).all()
    with pytest.raises(ValueError, match="cannot pad 60 patches to 62"):
        qwen2_vl.geometry(grid, cfg, tokens=62)


def test_images_encode_alike_alone_or_together(towers):
    _, _, params, _ = towers()
    grid = GRIDS["three mixed"]
    pix = _patches(grid, seed=8)
    rows = qwen2_vl.encode_images(params, pix, grid)
    cfg = params.config
    parts = qwen2_vl.split_images(rows, grid, cfg)
    start = 0
    for g, part in zip(grid, parts):
        n = g[0] * g[1] * g[2]
        _close(qwen2_vl.encode_images(params, pix[start:start + n], [g]), part)
        start += n


def test_bfloat16_load_runs_in_bfloat16(towers):
    cfg, hf, params, _ = towers()
    grid = GRIDS["one"]
    pix = _patches(grid)
    out = qwen2_vl.encode_images(qwen2_vl.assemble(cfg, _source(hf), LoadOptions(dtype=mx.bfloat16)), pix, grid)
    assert out.dtype == mx.bfloat16
    assert mx.abs(out.astype(mx.float32) - qwen2_vl.encode_images(params, pix, grid)).max().item() < 0.1


# ---------------------------------------------------------------- config and refusals


def test_config_reads_qwen2_5_vl_and_qwen2_vl():
    c = qwen2_vl.config_from_hf(_config())
    assert (c.hidden_size, c.out_hidden_size, c.window_tokens, c.fullatt_block_indexes) == (32, 40, 2, (1,))
    assert c.image_tokens((1, 6, 10)) == 15 and not c.v2
    c2 = qwen2_vl.config_from_hf(_config("qwen2_vl"))
    assert (c2.hidden_size, c2.intermediate_size, c2.out_hidden_size, c2.in_channels) == (32, 64, 40, 3)
    assert c2.v2 and c2.fullatt_block_indexes == (0, 1)
    # a real Qwen2.5-VL-7B vision_config (older top-level text fields)
    real = {"model_type": "qwen2_5_vl", "hidden_size": 3584, "image_token_id": 151655,
            "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                              "num_heads": 16, "in_chans": 3, "out_hidden_size": 3584, "patch_size": 14,
                              "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                              "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2,
                              "temporal_patch_size": 2}}
    r = qwen2_vl.config_from_hf(real)
    assert (r.window_tokens, r.head_dim, r.patch_features) == (4, 80, 1176)


@pytest.mark.parametrize("change, field", [
    ({"vision_config": None}, "vision_config"),
    ({"model_type": "qwen3_vl"}, "model_type"),
    ({"vision": {"depth": 0}}, "depth"),
    ({"vision": {"hidden_act": "gelu"}}, "hidden_act"),
    ({"vision": {"fullatt_block_indexes": [5]}}, "fullatt_block_indexes"),
    ({"vision": {"window_size": 12}}, "window_size"),
    ({"vision": {"num_heads": 3}}, "num_heads"),
    ({"vision": {"out_hidden_size": 48}}, "out_hidden_size"),
    ({"image_token_id": -1}, "image_token_id"),
])
def test_config_refusals_name_the_field(change, field):
    vision = change.pop("vision", None)
    d = _config(vision=vision)
    d.update(change)
    with pytest.raises(ConfigError, match=field):
        qwen2_vl.config_from_hf(d)


def test_missing_or_misshapen_tensors_are_named(towers):
    cfg, hf, _, _ = towers()
    for name in ("visual.blocks.2.mlp.up_proj.bias", "visual.merger.ln_q.weight", "visual.blocks.0.attn.qkv.weight"):
        with pytest.raises(WeightsError, match=name.replace(".", r"\.")):
            _ours(cfg, {n: t for n, t in hf.items() if n != name})
    bad = dict(hf)
    bad["visual.patch_embed.proj.weight"] = mx.zeros((32, 3, 1, 4, 4))
    with pytest.raises(WeightsError, match="patch_embed.proj.weight.*shape"):
        _ours(cfg, bad)
    with pytest.raises(WeightsError, match="no vision tower tensors"):
        _ours(cfg, {"lm_head.weight": mx.zeros((2, 2))})


def test_bad_grids_and_patches_are_refused(towers):
    _, _, params, _ = towers()
    with pytest.raises(ValueError, match="multiples of spatial_merge_size"):
        qwen2_vl.encode_images(params, _patches([[1, 3, 4]]), [[1, 3, 4]])
    with pytest.raises(ValueError, match=r"grid_thw must be \[images, 3\]"):
        qwen2_vl.encode_images(params, _patches([[1, 4, 4]]), [1, 4, 4])
    with pytest.raises(ValueError, match=r"patches must be \[16, 96\]"):
        qwen2_vl.encode_images(params, _patches([[1, 4, 6]]), [[1, 4, 4]])


def test_is_vision_tensor():
    assert qwen2_vl.is_vision_tensor("visual.blocks.0.attn.qkv.weight")
    assert qwen2_vl.is_vision_tensor("model.visual.merger.mlp.0.bias")
    assert qwen2_vl.is_vision_tensor("vision_tower.patch_embed.proj.weight")
    assert not qwen2_vl.is_vision_tensor("model.layers.0.self_attn.q_proj.weight")
    assert not qwen2_vl.is_vision_tensor("model.language_model.embed_tokens.weight")


# ---------------------------------------------------------------- preprocessing vs transformers


from fx_engine.loading import images_qwen2_vl as pre  # noqa: E402
from fx_engine.loading.images import ImageError  # noqa: E402

QWEN_PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                     "merge_size": 2, "image_mean": list(pre.CLIP_MEAN), "image_std": list(pre.CLIP_STD),
                     "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}


def _hf_processor(d: dict):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    kw = {k: v for k, v in d.items() if k not in ("image_processor_type", "processor_class")}
    return Qwen2VLImageProcessorPil(**kw)


def _image(h: int, w: int, seed: int = 0, channels: int = 3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (h, w) if channels == 1 else (h, w, channels)
    return rng.integers(0, 256, shape, dtype=np.uint8)


SIZES = {"non-square": (50, 80), "tiny": (10, 12), "exact multiple": (56, 84), "tall": (300, 70),
         "wide odd": (33, 257)}


@pytest.mark.oracle
@pytest.mark.parametrize("hw", list(SIZES.values()), ids=list(SIZES))
def test_preprocessing_matches_transformers(hw):
    cfg = pre.processor_config_from_dict(QWEN_PREPROCESSOR)
    img = _image(*hw, seed=hw[0])
    ours, grid = pre.preprocess(img, cfg)
    want = _hf_processor(QWEN_PREPROCESSOR)(images=[img])
    assert grid.tolist() == np.asarray(want["image_grid_thw"]).tolist()
    np.testing.assert_array_equal(ours, np.asarray(want["pixel_values"]))


@pytest.mark.oracle
def test_preprocessing_batch_and_max_pixels_cap_match_transformers():
    """Two images at once (patches concatenated), with a max_pixels small enough to cap
    both (and the newer size.{shortest,longest}_edge spelling)."""
    from PIL import Image

    d = {k: v for k, v in QWEN_PREPROCESSOR.items() if k not in ("min_pixels", "max_pixels")}
    d["size"] = {"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 6}
    cfg = pre.processor_config_from_dict(d)
    assert (cfg.min_pixels, cfg.max_pixels) == (784, 4704)
    rgba = Image.fromarray(_image(120, 90, seed=5, channels=4), "RGBA")
    imgs = [_image(200, 310, seed=3), rgba, Image.fromarray(_image(64, 40, seed=9, channels=1), "L")]
    ours, grid = pre.preprocess(imgs, cfg)
    want = _hf_processor(d)(images=imgs)
    assert grid.tolist() == np.asarray(want["image_grid_thw"]).tolist()
    assert all(t * h * w * 196 <= 4704 * 4 for t, h, w in grid.tolist())  # the cap held
    np.testing.assert_array_equal(ours, np.asarray(want["pixel_values"]))
    assert pre.image_tokens(grid, 2) == [h * w // 4 for _, h, w in grid.tolist()]


def test_smart_resize_matches_transformers():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    for h, w in [(1, 1), (10, 1900), (4000, 3000), (28, 28), (29, 55), (1000, 17)]:
        for lo, hi in [(3136, 12845056), (784, 4704), (28 * 28 * 4, 28 * 28 * 16)]:
            assert pre.smart_resize(h, w, 28, lo, hi) == smart_resize(h, w, 28, lo, hi)
    with pytest.raises(ImageError, match="aspect ratio"):
        pre.smart_resize(2, 500)


@pytest.mark.oracle
def test_preprocessed_image_through_the_tower_matches_mlx_vlm(towers):
    """The whole first half: an image -> our processor (the tiny tower's patch geometry) ->
    our tower, against the same patches through mlx-vlm's tower."""
    cfg, _, params, ref = towers()
    proc = pre.processor_config_from_dict({**QWEN_PREPROCESSOR, "patch_size": 4, "min_pixels": 64,
                                           "max_pixels": 32 * 48})
    pre.check_matches(proc, cfg)
    patches, grid = pre.preprocess([_image(40, 70, seed=1), _image(25, 25, seed=2)], proc)
    want_pix = _hf_processor({**QWEN_PREPROCESSOR, "patch_size": 4, "min_pixels": 64, "max_pixels": 32 * 48})(
        images=[_image(40, 70, seed=1), _image(25, 25, seed=2)])
    np.testing.assert_array_equal(patches, np.asarray(want_pix["pixel_values"]))
    ours = qwen2_vl.encode_images(params, mx.array(patches), grid)
    _close(ours, ref(mx.array(patches), mx.array(grid)))
    assert ours.shape[0] == sum(pre.image_tokens(grid, 2))


@pytest.mark.parametrize("change, field", [
    ({"image_processor_type": "Gemma3ImageProcessor"}, "image_processor_type"),
    ({"min_pixels": 0}, "min_pixels"),
    ({"max_pixels": "big"}, "max_pixels"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
    ({"patch_size": 0}, "patch_size"),
    ({"image_std": [1, 0, 1]}, "image_std"),
    ({"image_mean": [1, 2]}, "image_mean"),
    ({"resample": 9}, "resample"),
    ({"do_resize": False}, "do_resize"),
    ({"do_normalize": "yes"}, "do_normalize"),
])
def test_processor_config_refusals_name_the_field(change, field):
    with pytest.raises(ConfigError, match=field):
        pre.processor_config_from_dict({**QWEN_PREPROCESSOR, **change})


def test_processor_geometry_must_match_the_tower(towers):
    cfg, _, _, _ = towers()
    with pytest.raises(ConfigError, match="patch_size"):
        pre.check_matches(pre.processor_config_from_dict(QWEN_PREPROCESSOR), cfg)
    with pytest.raises(ImageError, match="image 1"):
        pre.preprocess([_image(30, 30), "not an image"], pre.processor_config_from_dict(QWEN_PREPROCESSOR))


@pytest.mark.oracle
@pytest.mark.parametrize("keep", [False, True], ids=["dequantized", "packed"])
def test_quantized_tower_matches_mlx_vlm(towers, keep):
    """An mlx-community-style folder whose vision linears are 4-bit (those whose inputs
    split into groups of 32; the others and the patch conv stay dense)."""
    import mlx.nn as nn

    cfg, hf, _, _ = towers()
    ref = _reference("qwen2_5_vl", hf)
    nn.quantize(ref, group_size=32, bits=4,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0)
    tensors = {"vision_tower." + n: t for n, t in tree_flatten(ref.parameters())}
    assert "vision_tower.blocks.0.attn.qkv.scales" in tensors
    assert "vision_tower.blocks.0.mlp.down_proj.scales" not in tensors
    params = _ours(cfg, tensors, keep_quantized=keep, quant={"group_size": 32, "bits": 4})
    assert (params.layers[0].qkv.quant is not None) == keep
    grid = GRIDS["two images"]
    pix = _patches(grid, seed=12)
    _close(qwen2_vl.encode_images(params, pix, grid), ref(pix, mx.array(grid)))


def test_full_attention_everywhere_would_differ(towers):
    """The windows matter in the tiny tower (the oracle test could not pass without them)."""
    cfg, hf, params, _ = towers()
    grid = GRIDS["not a window multiple"]
    pix = _patches(grid)
    no_windows = attrs.evolve(params, config=attrs.evolve(cfg, fullatt_block_indexes=(0, 1, 2)))
    diff = mx.abs(qwen2_vl.encode_images(params, pix, grid) - qwen2_vl.encode_images(no_windows, pix, grid))
    assert diff.max().item() > 1e-2


@pytest.mark.oracle
def test_real_patch_and_window_geometry_matches_mlx_vlm():
    """Qwen2.5-VL's own geometry (patch 14, window 112: 4 x 4 merged tokens a window) on a
    narrow tower, grids with and without whole windows."""
    vision = {"patch_size": 14, "window_size": 112, "depth": 2, "fullatt_block_indexes": [0]}
    cfg = qwen2_vl.config_from_hf(_config(vision=vision))
    assert cfg.window_tokens == 4
    hf = _weights(cfg, seed=3)
    from mlx_vlm.models.qwen2_5_vl.config import VisionConfig
    from mlx_vlm.models.qwen2_5_vl.vision import VisionModel

    v = {**VISION_25, **vision}
    v.pop("hidden_act")
    ref = VisionModel(VisionConfig(**v))
    ref.load_weights(list(ref.sanitize({n[len("visual."):]: t for n, t in hf.items()}).items()), strict=True)
    grid = [[1, 20, 28], [1, 16, 8]]
    pix = _patches(grid, seed=2, features=cfg.patch_features)
    _close(qwen2_vl.encode_images(_ours(cfg, hf), pix, grid), ref(pix, mx.array(grid)))


def test_batch_invariant_mode_encodes_an_image_alike_alone_or_with_others(towers):
    from fx_engine.core.nn import Numerics

    cfg, hf, params, _ = towers()
    bi = _ours(cfg, hf, numerics=Numerics(batch_invariant=True))
    grid = GRIDS["three mixed"]
    pix = _patches(grid, seed=13)
    together = qwen2_vl.split_images(qwen2_vl.encode_images(bi, pix, grid), grid, cfg)
    alone = qwen2_vl.encode_images(bi, pix[:60], grid[:1])
    assert mx.array_equal(together[0], alone)
    _close(alone, qwen2_vl.encode_images(params, pix[:60], grid[:1]))
