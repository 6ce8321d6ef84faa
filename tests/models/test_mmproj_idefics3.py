"""llama.cpp's mmproj GGUF for Idefics3 / SmolVLM (issue 46, clip.projector_type "idefics3"):
`fx_engine.load("text.gguf", mmproj="mmproj.gguf")` gives the image path of the Hugging Face
folder both files were converted from.

The files are written as llama.cpp's converter writes them (fx_engine/testing/mmproj.py:
SmolVLMModel's keys, gguf-py's MMPROJ tensor names, the connector as mm.model.fc, the
embeddings F32; the text model as its LlamaModel writes it, q/k rows permuted). Oracles:
the folder's own image path (`load_vision`, bit for bit where the file holds float32; close
for F16 / Q8_0 matrices) and the folder's greedy generation with a tiled image.
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
from fx_engine.core.vision import idefics3
from fx_engine.loading.vision import load_vision

from tests.models.vision_checks import messages, png

gguf = pytest.importorskip("gguf")

from fx_engine.testing.mmproj import write_mmproj, write_text_gguf, write_tiny_idefics3_gguf_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder, text.gguf, mmproj-f32.gguf) of one tiny Idefics3."""
    return write_tiny_idefics3_gguf_pair(tmp_path_factory.mktemp("mmproj-idefics3") / "m", outtype="f32")


@pytest.fixture(scope="module")
def models(pair):
    folder, text, mm = pair
    return fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))


def _tiles(n: int = 3, seed: int = 3) -> mx.array:
    return mx.random.uniform(-1, 1, (n, 3, 32, 32), key=mx.random.key(seed))


def _png(seed: int, size=(52, 40)) -> bytes:
    return png(seed, size)


def _messages(*images: bytes) -> list[dict]:
    return messages(*images, text="What is in the picture?")


def test_mmproj_config_and_processor_match_the_folder(pair, models):
    ref, model = models
    assert model.vision.config == ref.vision.config  # <image> id from the vocabulary, scale 2, eps 1e-6
    assert model.vision.config.tokens_per_tile == 16
    assert model.image_processor == ref.image_processor  # longest edge 64 (preproc_image_size), tiles of 32
    md = {f.name: f for f in gguf.GGUFReader(str(pair[2])).fields.values()}
    assert "clip.vision.preproc_image_size" in md and "clip.vision.projector.scale_factor" in md
    assert model.weight_format.startswith("gguf")


def test_f32_mmproj_encoder_equals_the_folder_bitwise(pair, models):
    folder, _, _ = pair
    ref, model = models
    px = _tiles()
    got = idefics3.encode_images(model.vision, px)
    assert got.shape == (3, 16, 64) and got.dtype == mx.float32
    assert mx.array_equal(got, idefics3.encode_images(ref.vision, px)).item()
    own = load_vision(folder, numerics=model.vision.tower.numerics)
    assert mx.array_equal(got, idefics3.encode_images(own, px)).item()


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_mmproj_encoders_are_close(pair, models, tmp_path, outtype, tol):
    folder, text, _ = pair
    ref, _ = models
    mm = write_mmproj(folder, tmp_path / f"mmproj-{outtype}.gguf", outtype=outtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mm)).tensors}
    assert kinds["v.patch_embd.weight"] == "F32" and kinds["v.position_embd.weight"] == "F32"
    assert kinds["v.blk.0.attn_q.weight"] == outtype.upper() and kinds["mm.model.fc.weight"] == outtype.upper()
    assert kinds["v.post_ln.weight"] == "F32"
    for keep in (None, False, True):  # the CPU default, dequantized, or the Q8_0 linears kept packed
        model = fx_engine.load(str(text), mmproj=str(mm), keep_quantized=keep)
        px = _tiles()
        got, want = idefics3.encode_images(model.vision, px), idefics3.encode_images(ref.vision, px)
        err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert 0 < err < tol, (keep, err)


@pytest.mark.oracle
def test_image_prompt_through_gguf_and_mmproj_equals_the_folder(models):
    ref, model = models
    msgs = _messages(_png(1), _png(2, size=(30, 24)))  # a 2 x 2-tile image and an unsplit one
    want = fx_engine.generate(ref, msgs, max_tokens=10, logprobs=5)
    got = fx_engine.generate(model, msgs, max_tokens=10, logprobs=5)
    assert got.prompt_token_ids == want.prompt_token_ids
    row = model.tokenizer.encode("<row_2_col_2>", add_special_tokens=False)
    assert len(row) == 1 and row[0] in got.prompt_token_ids  # (the tiles' tokens, one id each)
    assert got.token_ids == want.token_ids  # greedy
    for g, w in zip(got.logprobs, want.logprobs):
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-4)
    other = fx_engine.generate(model, _messages(_png(5), _png(2, size=(30, 24))), max_tokens=1, logprobs=3)
    assert other.logprobs[0].top != got.logprobs[0].top


def test_smolvlm_folder_converts_alike(tmp_path):
    folder, text, mm = write_tiny_idefics3_gguf_pair(tmp_path / "s", model_type="smolvlm")
    ref, model = fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))
    # (the mmproj does not say which of the two: the same module runs both)
    assert model.vision.config == ref.vision.config.__class__(**{**_fields(ref.vision.config),
                                                                  "model_type": "idefics3"})
    px = _tiles(2, seed=5)
    assert mx.array_equal(idefics3.encode_images(model.vision, px), idefics3.encode_images(ref.vision, px)).item()


def _fields(cfg) -> dict:
    import attrs

    return attrs.asdict(cfg, recurse=False)


# refusals: each names the field or tensor


def test_unsupported_projector_type_is_refused_listing_the_supported(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "llava.gguf", projector_type="mlp")
    listed = ("gemma3 (Gemma 3), gemma4v (Gemma 4), idefics3 (Idefics3 / SmolVLM), pixtral (Mistral 3 (Pixtral)), "
              "qwen2vl_merger (Qwen2-VL), qwen2.5vl_merger (Qwen2.5-VL), qwen3vl_merger (Qwen3-VL)")
    refusal = f"clip.projector_type 'mlp' is not supported (supported: {listed})"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        fx_engine.load(str(text), mmproj=str(mm))


def test_wrong_projector_dims_are_refused(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "dim.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(ConfigError, match=r"clip.vision.projection_dim = 128, but the text model's hidden size"):
        fx_engine.load(str(text), mmproj=str(mm))
    # a pixel shuffle of 4 would need a [64, 32 * 16] projection: the file's is [64, 128]
    mm = write_mmproj(folder, tmp_path / "scale.gguf", metadata={"clip.vision.projector.scale_factor": 4})
    with pytest.raises(WeightsError, match=r"tensor 'mm.model.fc.weight' has shape \(64, 128\).*expected "
                                           r"\(64, 512\)"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_mmproj(folder, tmp_path / "odd.gguf", metadata={"clip.vision.projector.scale_factor": 3})
    with pytest.raises(ConfigError, match="do not pixel-shuffle by clip.vision.projector.scale_factor 3"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_a_file_without_preproc_image_size_tiles_as_the_processor(pair, tmp_path):
    """Files converted before llama.cpp wrote clip.vision.preproc_image_size: the longest
    edge is Idefics3ImageProcessor's 4 tiles a side (the released models' size), so images
    still tile as through their folders."""
    from fx_engine.loading.mmproj import preproc_edge

    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "old.gguf", drop_metadata=("clip.vision.preproc_image_size",))
    md = {"clip.vision.image_size": 32}
    assert preproc_edge(md, 32, "f") == 128 and preproc_edge({**md, "clip.vision.preproc_image_size": 64}, 32, "f") == 64
    model = fx_engine.load(str(text), mmproj=str(mm))
    assert model.image_processor.longest_edge == 128 and model.image_processor.max_image_size == 32


def test_missing_tensor_and_metadata_are_named(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "cut.gguf", skip=("mm.model.fc.weight",))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'mm.model.fc.weight' \(an mmproj for Idefics3"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_mmproj(folder, tmp_path / "nokey.gguf", drop_metadata=("clip.vision.patch_size",))
    with pytest.raises(ConfigError, match=r"'clip.vision.patch_size' is missing \(an mmproj file for Idefics3"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_mmproj(folder, tmp_path / "silu.gguf", metadata={"clip.use_silu": True})
    with pytest.raises(ConfigError, match="clip.use_silu is true"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_mmproj_for_another_text_model_is_refused(pair):
    from fx_engine.loading.mmproj import load_mmproj

    _, _, mm = pair
    with pytest.raises(ConfigError, match="mmproj was given for a 'gemma3_text' text model; the idefics3 projector "
                                          "needs a Llama text model"):
        load_mmproj(mm, types.SimpleNamespace(model_type="gemma3_text", hidden_size=64), {}, dtype=mx.float32)


def _with_token_renamed(folder: Path, dest: Path, old: str, new: str) -> Path:
    dest.mkdir()
    for f in folder.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    tok = json.loads((dest / "tokenizer.json").read_text())
    tok["model"]["vocab"][new] = tok["model"]["vocab"].pop(old)
    tok["added_tokens"] = [t if t["content"] != old else {**t, "content": new} for t in tok["added_tokens"]]
    (dest / "tokenizer.json").write_text(json.dumps(tok))
    return dest


@pytest.mark.parametrize("token", ["<image>", "<global-img>", "<fake_token_around_image>", "<row_2_col_1>"])
def test_text_vocabulary_without_image_tokens_is_refused(pair, tmp_path, token):
    folder, _, mm = pair
    plain = _with_token_renamed(folder, tmp_path / "plain", token, "<other>")
    text = write_text_gguf(plain, tmp_path / "plain.gguf")
    with pytest.raises(ConfigError, match=f"vocabulary has no '{token}' token"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_tiles_beyond_the_vocabulary_s_row_tokens_are_refused(pair, tmp_path):
    """A preproc_image_size of 8 tiles a side needs <row_7_col_1> .. <row_8_col_8>; the
    tiny vocabulary stops at 6."""
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "big.gguf", metadata={"clip.vision.preproc_image_size": 8 * 32})
    with pytest.raises(ConfigError, match="vocabulary has no '<row_1_col_7>' token"):
        fx_engine.load(str(text), mmproj=str(mm))
