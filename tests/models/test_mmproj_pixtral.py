"""llama.cpp's mmproj GGUF for Mistral 3 (issue 46, clip.projector_type "pixtral"):
`fx_engine.load("text.gguf", mmproj="mmproj.gguf")` gives the image path of the Hugging Face
folder both files were converted from.

The files are written as llama.cpp's converter writes them (fx_engine/testing/mmproj.py:
LlavaVisionModel's keys, the tower's q / k rows permuted by LlamaModel.permute, the
projector as mm.input_norm / mm.patch_merger / mm.1 / mm.2, [IMG_BREAK]'s embedding copied
in; the `mistral` text model as its LlamaModel writes it, architecture llama). Oracles: the
folder's own image path (bit for bit from an F32 file; close for F16 / Q8_0) and the
folder's greedy generation with images of two sizes.
"""

from __future__ import annotations

import json
import re
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.vision import pixtral
from fx_engine.loading.vision import load_vision

from tests.models.vision_checks import messages, png

gguf = pytest.importorskip("gguf")

from fx_engine.testing.mmproj import write_mmproj, write_text_gguf, write_tiny_mistral3_gguf_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder, text.gguf, mmproj-f32.gguf) of one tiny Mistral 3."""
    return write_tiny_mistral3_gguf_pair(tmp_path_factory.mktemp("mmproj-pixtral") / "m", outtype="f32")


@pytest.fixture(scope="module")
def models(pair):
    folder, text, mm = pair
    return fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))


def _pixels(h: int = 32, w: int = 48, seed: int = 3) -> mx.array:
    return mx.random.uniform(-1, 1, (1, 3, h, w), key=mx.random.key(seed))


def _png(seed: int, size=(52, 40)) -> bytes:
    return png(seed, size)


def _messages(*images: bytes) -> list[dict]:
    return messages(*images, text="What is in the picture?")


def test_mmproj_config_and_processor_match_the_folder(pair, models):
    ref, model = models
    assert model.vision.config == ref.vision.config  # [IMG] id by name, merge 2, silu, the text eps
    p, q = model.image_processor, ref.image_processor
    for field in ("longest_edge", "patch_size", "merge_size", "resample", "rescale_factor", "do_convert_rgb"):
        assert getattr(p, field) == getattr(q, field), field
    assert np.array_equal(np.float32(p.image_mean), np.float32(q.image_mean))
    names = {t.name for t in gguf.GGUFReader(str(pair[2])).tensors}
    assert {"v.token_embd.img_break", "mm.patch_merger.weight", "mm.input_norm.weight", "v.pre_ln.weight"} <= names


def test_f32_mmproj_encoder_equals_the_folder_bitwise(pair, models):
    folder, _, _ = pair
    ref, model = models
    for h, w in ((32, 48), (64, 16)):  # (images of any size: one compiled trace per size)
        px = _pixels(h, w)
        got = pixtral.encode_images(model.vision, px)
        assert got.shape == (1, (h // 8) * (w // 8), 64)
        assert mx.array_equal(got, pixtral.encode_images(ref.vision, px)).item()
    own = load_vision(folder, numerics=model.vision.numerics)
    assert mx.array_equal(pixtral.encode_images(model.vision, _pixels()), pixtral.encode_images(own, _pixels())).item()


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_mmproj_encoders_are_close(pair, models, tmp_path, outtype, tol):
    folder, text, _ = pair
    ref, _ = models
    mm = write_mmproj(folder, tmp_path / f"mmproj-{outtype}.gguf", outtype=outtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mm)).tensors}
    assert kinds["v.blk.0.attn_q.weight"] == outtype.upper() and kinds["mm.1.weight"] == outtype.upper()
    assert kinds["mm.input_norm.weight"] == "F32" and kinds["v.pre_ln.weight"] == "F32"
    for keep in (None, False, True):  # the CPU default, dequantized, or Q8_0 kept packed (q / k rows unpermuted)
        model = fx_engine.load(str(text), mmproj=str(mm), keep_quantized=keep)
        px = _pixels()
        got, want = pixtral.encode_images(model.vision, px), pixtral.encode_images(ref.vision, px)
        err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert 0 < err < tol, (keep, err)


@pytest.mark.oracle
def test_image_prompt_through_gguf_and_mmproj_equals_the_folder(models):
    ref, model = models
    msgs = _messages(_png(1), _png(2, size=(20, 36)))
    want = fx_engine.generate(ref, msgs, max_tokens=10, logprobs=5)
    got = fx_engine.generate(model, msgs, max_tokens=10, logprobs=5)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-4)
    other = fx_engine.generate(model, _messages(_png(5), _png(2, size=(20, 36))), max_tokens=1, logprobs=3)
    assert other.logprobs[0].top != got.logprobs[0].top


# refusals: each names the field or tensor


def test_wrong_projector_dims_are_refused(pair, tmp_path):
    """The projector's output width is mm.2's rows (as clip.cpp sizes it); projection_dim is
    not read: convert_hf_to_gguf.py's --mistral-format path writes params.json's hidden_dim
    (the text model's feed-forward width) there, so such a file still loads."""
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "dim.gguf", metadata={"clip.vision.projection_dim": 128})
    assert fx_engine.load(str(text), mmproj=str(mm)).vision is not None
    from fx_engine.loading.mmproj import load_mmproj

    tokens = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    other = types.SimpleNamespace(model_type="llama", hidden_size=128, rms_norm_eps=1e-5)
    with pytest.raises(WeightsError, match=r"tensor 'mm.2.weight' has 64 rows, but the text model's hidden size is "
                                           r"128"):
        load_mmproj(mm, other, {"tokenizer.ggml.tokens": tokens}, dtype=mx.float32)


def test_a_projector_without_a_patch_merger_is_named(pair, tmp_path):
    """Pixtral-12B's / LightOnOCR's pixtral mmproj files (no mm.input_norm, mm.patch_merger):
    refused as a variant, not as a broken file."""
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "nomerge.gguf", skip=("mm.input_norm.weight", "mm.patch_merger.weight"))
    with pytest.raises(WeightsError, match="a pixtral mmproj without a patch merger .* is not supported"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_activation_and_tensors_are_named(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "act.gguf", drop_metadata=("clip.use_silu",))
    with pytest.raises(ConfigError, match="exactly one of clip.use_silu and clip.use_gelu must be true"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_mmproj(folder, tmp_path / "cut.gguf", skip=("mm.patch_merger.weight",))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'mm.patch_merger.weight' \(an mmproj for Mistral 3"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_mmproj_for_another_text_model_is_refused(pair):
    from fx_engine.loading.mmproj import load_mmproj

    _, _, mm = pair
    with pytest.raises(ConfigError, match="the pixtral projector needs a Mistral text model"):
        load_mmproj(mm, types.SimpleNamespace(model_type="qwen3", hidden_size=64), {}, dtype=mx.float32)


@pytest.mark.parametrize("token", ["[IMG]", "[IMG_BREAK]", "[IMG_END]"])
def test_text_vocabulary_without_image_tokens_is_refused(pair, tmp_path, token):
    folder, _, mm = pair
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folder.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    tok = json.loads((plain / "tokenizer.json").read_text())
    tok["model"]["vocab"]["[OTHER]"] = tok["model"]["vocab"].pop(token)
    tok["added_tokens"] = [t if t["content"] != token else {**t, "content": "[OTHER]"} for t in tok["added_tokens"]]
    (plain / "tokenizer.json").write_text(json.dumps(tok))
    text = write_text_gguf(plain, tmp_path / "plain.gguf")
    with pytest.raises(ConfigError, match=re.escape(f"vocabulary has no '{token}' token")):
        fx_engine.load(str(text), mmproj=str(mm))
