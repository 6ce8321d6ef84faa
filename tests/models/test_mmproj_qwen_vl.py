"""llama.cpp's mmproj GGUF for Qwen2.5-VL, Qwen2-VL and Qwen3-VL (issue 46,
clip.projector_type "qwen2.5vl_merger" / "qwen2vl_merger" / "qwen3vl_merger"): `load_mmproj`
gives the image path of the Hugging Face folder the file was converted from.

The files are written as llama.cpp's Qwen2VLVisionModel / Qwen3VLVisionModel write them
(fx_engine/testing/mmproj.py: the Conv3d patch embedding split into v.patch_embd.weight and
v.patch_embd.weight.1, Qwen2(.5)-VL's q / k / v split out of attn.qkv, the merger as
v.post_ln / mm.0 / mm.2, n_wa_pattern from fullatt_block_indexes, Qwen2-VL's
feed_forward_length quirk, Qwen3-VL's DeepStack mergers under their layers' indexes), plus
the tiny folder's window and pixel bounds as llama.cpp's keys for them. The text side's GGUF
(architectures qwen2vl / qwen3vl) is not read by fx-engine yet, so the text model here is
the folder's own (its vocabulary given as the text metadata); the whole
`fx_engine.load(text.gguf, mmproj=...)` test skips until that architecture reads. Oracles:
the folder's image path (bit for bit from an F32 file; close for F16 / Q8_0) and the
folder's greedy generation with the mmproj's image path put on the folder's text model.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import attrs
import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.engine.image_prompt import _vision_module
from fx_engine.loading.images_qwen2_vl import preprocess_one
from fx_engine.loading.mmproj import load_mmproj
from fx_engine.testing.vision import write_tiny_qwen2_vl, write_tiny_qwen3_vl

from tests.models.vision_checks import messages, png

gguf = pytest.importorskip("gguf")

from fx_engine.testing.mmproj import write_mmproj  # noqa: E402

KINDS = {"qwen2_5_vl": "qwen2.5vl_merger", "qwen2_vl": "qwen2vl_merger", "qwen3_vl": "qwen3vl_merger",
         "qwen3_vl_moe": "qwen3vl_merger"}


@pytest.fixture(scope="module", params=list(KINDS))
def case(request, tmp_path_factory):
    """(folder, mmproj-f32.gguf, the folder's model, its vocabulary) of one tiny Qwen-VL."""
    root = tmp_path_factory.mktemp(f"mmproj-{request.param}")
    folder = (write_tiny_qwen3_vl(root / "m", moe=request.param == "qwen3_vl_moe")
              if request.param.startswith("qwen3_vl") else write_tiny_qwen2_vl(root / "m", request.param))
    mm = write_mmproj(folder, root / "mmproj-f32.gguf", outtype="f32")
    return folder, mm, fx_engine.load(str(folder)), _vocabulary(folder)


def _vocabulary(folder: Path) -> list[str]:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return [t for t, _ in sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])]


def _load(mm: Path, ref, tokens, **kw):
    return load_mmproj(mm, ref.config, {"tokenizer.ggml.tokens": tokens}, dtype=mx.float32,
                       numerics=ref.vision.numerics, **kw)


def _encode(vision, patches, grid) -> list[mx.array]:
    """The rows, and Qwen3-VL's DeepStack rows."""
    out = _vision_module(vision).encode_images(vision, mx.array(patches), [grid])
    return list(out) if isinstance(out, tuple) else [out]


def _image(seed: int, size=(52, 40)) -> np.ndarray:
    return (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)


def _png(seed: int, size=(52, 40)) -> bytes:
    return png(seed, size)


def _messages(*images: bytes) -> list[dict]:
    return messages(*images, text="What is in the picture?")


def test_the_file_is_written_as_llama_cpp_does(case):
    _, mm, ref, _ = case
    r = gguf.GGUFReader(str(mm))
    names = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    cfg = ref.vision.config
    h, p = cfg.hidden_size, cfg.patch_size
    assert names["v.patch_embd.weight"] == names["v.patch_embd.weight.1"] == (h, 3, p, p)
    assert {"mm.0.weight", "mm.2.weight", "mm.2.bias", "v.post_ln.weight"} <= set(names)
    kind = KINDS[cfg.model_type]
    assert str(bytes(r.fields["clip.projector_type"].parts[-1]), "utf-8") == kind
    assert ("clip.vision.n_wa_pattern" in r.fields) == (kind == "qwen2.5vl_merger")
    if kind == "qwen3vl_merger":  # q / k / v fused; DeepStack mergers under their layers' indexes
        assert names["v.blk.0.attn_qkv.weight"] == (3 * h, h) and "v.patch_embd.bias" in names
        assert {f"v.deepstack.{i}.fc2.weight" for i in cfg.deepstack_visual_indexes} <= set(names)
    else:
        assert names["v.blk.0.attn_q.weight"] == (h, h) and "v.blk.0.attn_qkv.weight" not in names


def test_config_and_processor_match_the_folder(case):
    _, mm, ref, tokens = case
    vision, rules = _load(mm, ref, tokens)
    assert vision.config == ref.vision.config  # token ids by name, windows / full layers / DeepStack layers
    want = ref.image_processor
    assert attrs.evolve(rules, image_mean=want.image_mean, image_std=want.image_std) == want
    # (the file's mean / std are float32: the same float32 values normalize the pixels)
    assert np.array_equal(np.float32(rules.image_mean), np.float32(want.image_mean))
    assert np.array_equal(np.float32(rules.image_std), np.float32(want.image_std))


def test_f32_mmproj_encoder_equals_the_folder_bitwise(case):
    _, mm, ref, tokens = case
    vision, _ = _load(mm, ref, tokens)
    patches, grid = preprocess_one(_image(1), ref.image_processor, "x")
    got, want = _encode(vision, patches, grid), _encode(ref.vision, patches, grid)
    assert got[0].shape == (ref.vision.config.image_tokens(grid), 64) and len(got) == len(want)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_mmproj_encoders_are_close(case, tmp_path, outtype, tol):
    folder, _, ref, tokens = case
    mm = write_mmproj(folder, tmp_path / f"mmproj-{outtype}.gguf", outtype=outtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mm)).tensors}
    q = "v.blk.0.attn_qkv.weight" if "v.blk.0.attn_qkv.weight" in kinds else "v.blk.0.attn_q.weight"
    assert kinds[q] == outtype.upper() and kinds["mm.0.weight"] == outtype.upper()
    assert kinds["v.post_ln.weight"] == "F32" and kinds["v.blk.0.ln1.weight"] == "F32"
    patches, grid = preprocess_one(_image(2), ref.image_processor, "x")
    want = _encode(ref.vision, patches, grid)
    for keep in (False, True):  # dequantized, or the Q8_0 linears kept packed (q / k / v fused packed)
        vision, _ = _load(mm, ref, tokens, keep_quantized=keep)
        for g, w in zip(_encode(vision, patches, grid), want):
            err = mx.abs(g - w).max().item() / mx.abs(w).max().item()
            assert 0 < err < tol, (keep, err)


@pytest.mark.oracle
def test_generation_with_the_mmproj_image_path_equals_the_folder(case):
    _, mm, ref, tokens = case
    vision, rules = _load(mm, ref, tokens)
    model = attrs.evolve(ref, vision=vision, image_processor=rules)
    msgs = _messages(_png(1), _png(2, size=(30, 24)))
    want = fx_engine.generate(ref, msgs, max_tokens=8, logprobs=5)
    got = fx_engine.generate(model, msgs, max_tokens=8, logprobs=5)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-5)


@pytest.mark.oracle
def test_load_text_gguf_with_mmproj_equals_the_folder(case, tmp_path):
    """The whole path, `fx_engine.load("text.gguf", mmproj=...)`: the text GGUF llama.cpp
    writes for Qwen-VL (architecture qwen2vl / qwen3vl: M-RoPE sections in
    rope.dimension_sections, qwen3vl's interleaved) beside its mmproj."""
    from fx_engine.testing.mmproj import write_text_gguf

    folder, mm, ref, _ = case
    text = write_text_gguf(folder, tmp_path / "text.gguf")
    model = fx_engine.load(str(text), mmproj=str(mm))
    assert model.config.mrope_section == ref.config.mrope_section
    assert model.config.mrope_interleaved == ref.config.mrope_interleaved
    want = fx_engine.generate(ref, _messages(_png(1)), max_tokens=8)
    got = fx_engine.generate(model, _messages(_png(1)), max_tokens=8)
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids


def test_text_gguf_m_rope_sections_are_checked(case, tmp_path):
    """rope.dimension_sections: 3 sections (a zero fourth) summing to head_dim / 2; a missing
    key or another layout is a ConfigError naming it."""
    from fx_engine.core.models.registry import gguf_family
    from fx_engine.loading.gguf import read_gguf_metadata
    from fx_engine.testing.mmproj import write_text_gguf

    folder, _, ref, _ = case
    md = read_gguf_metadata(write_text_gguf(folder, tmp_path / "text.gguf"))
    config_from_gguf = gguf_family(md, "t.gguf").config_from_gguf  # (qwen3vlmoe: the MoE family's)
    arch = md["general.architecture"]
    key = f"{arch}.rope.dimension_sections"
    assert config_from_gguf(md, "t.gguf").mrope_section == ref.config.mrope_section
    t, h, w = ref.config.mrope_section
    for bad, why in (([t, h, w, 2], "must be 3 sections"), ([t + 1, h, w, 0], "summing to head_dim / 2"),
                     (None, "is missing")):
        broken = {k: v for k, v in md.items() if k != key}
        if bad is not None:
            broken[key] = np.array(bad, np.int32)
        with pytest.raises(ConfigError, match=re.escape(key) + ".*" + re.escape(why) if bad else re.escape(why)):
            config_from_gguf(broken, "t.gguf")


def test_pixel_bounds_and_window_default_to_the_processor_s_and_clip_cpp_s(case, tmp_path):
    """A file without the keys (what the converter writes for the released models): the
    released models' preprocessor_config.json min / max pixels (what their folders give,
    not Qwen2VLImageProcessor's smaller class defaults), clip.cpp's 112-pixel window
    (Qwen2.5-VL)."""
    folder, _, ref, tokens = case
    mm = write_mmproj(folder, tmp_path / "plain.gguf", drop_metadata=(
        "clip.vision.image_min_pixels", "clip.vision.image_max_pixels", "clip.vision.window_size"))
    vision, rules = _load(mm, ref, tokens)
    if vision.config.model_type == "qwen3_vl":
        assert (rules.min_pixels, rules.max_pixels) == (65536, 16777216)
    else:
        assert (rules.min_pixels, rules.max_pixels) == (3136, 12845056)
        assert vision.config.window_size == (0 if vision.config.v2 else 112)


# refusals: each names the field or tensor


def test_unsupported_projector_type_is_refused(case, tmp_path):
    folder, _, ref, tokens = case
    mm = write_mmproj(folder, tmp_path / "glm.gguf", projector_type="glm4v")
    with pytest.raises(ConfigError, match=r"clip.projector_type 'glm4v' is not supported \(supported: gemma3 .*"
                                          r"pixtral .*qwen2vl_merger \(Qwen2-VL\), qwen2.5vl_merger \(Qwen2.5-VL\), "
                                          r"qwen3vl_merger \(Qwen3-VL\)\)"):
        _load(mm, ref, tokens)


def test_wrong_projector_dims_are_refused(case, tmp_path):
    folder, _, ref, tokens = case
    mm = write_mmproj(folder, tmp_path / "dim.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(ConfigError, match=r"clip.vision.projection_dim = 128, but the text model's hidden size"):
        _load(mm, ref, tokens)
    # the merger's output rows are the text model's hidden size: another text model's is refused
    other = types.SimpleNamespace(model_type=ref.config.model_type, hidden_size=128, mrope_section=(2, 3, 3),
                                  vocab_size=384)
    with pytest.raises(WeightsError, match=r"tensor 'mm.2.weight' has 64 rows .* the text model's hidden size is "
                                           r"128"):
        load_mmproj(mm, other, {"tokenizer.ggml.tokens": tokens}, dtype=mx.float32)


def test_missing_patch_frame_is_named(case, tmp_path):
    folder, _, ref, tokens = case
    mm = write_mmproj(folder, tmp_path / "cut.gguf", skip=("v.patch_embd.weight.1",))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'v.patch_embd.weight.1' \(an mmproj for Qwen"):
        _load(mm, ref, tokens)


def test_text_model_without_m_rope_or_image_tokens_is_refused(case):
    _, mm, ref, tokens = case
    plain = types.SimpleNamespace(model_type=ref.config.model_type, hidden_size=64, mrope_section=())
    with pytest.raises(ConfigError, match="needs a text model with M-RoPE"):
        load_mmproj(mm, plain, {"tokenizer.ggml.tokens": tokens}, dtype=mx.float32)
    gemma = types.SimpleNamespace(model_type="gemma3_text", hidden_size=64)
    with pytest.raises(ConfigError, match="needs a Qwen[23].* text model with .*M-RoPE"):
        load_mmproj(mm, gemma, {"tokenizer.ggml.tokens": tokens}, dtype=mx.float32)
    for missing in ("<|image_pad|>", "<|vision_start|>"):
        cut = [t if t != missing else "<|other|>" for t in tokens]
        with pytest.raises(ConfigError, match=re.escape(f"vocabulary has no '{missing}' token")):
            _load(mm, ref, cut)
