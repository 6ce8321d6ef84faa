"""llama.cpp's mmproj GGUF for Gemma 3 (issue 46): `fx_engine.load("text.gguf",
mmproj="mmproj.gguf")` gives the image path of the Hugging Face folder both files were
converted from.

The files are written as llama.cpp's converter writes them (fx_engine/testing/mmproj.py:
gguf-py's MMPROJ tensor names, the + 1 on mm.soft_emb_norm, the projection forced to F16,
embeddings and norms F32). Oracles: the folder's own image path (`load_vision`, bit for bit
where the file holds the same float32 values; close for F16 / Q8_0 matrices) and the
folder's greedy generation with an image.
"""

from __future__ import annotations

import io
import json
import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.vision import gemma3
from fx_engine.loading.vision import load_vision

gguf = pytest.importorskip("gguf")

from fx_engine.testing.mmproj import write_mmproj, write_text_gguf, write_tiny_gemma3_gguf_pair  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder, text.gguf, mmproj-f32.gguf) of one tiny Gemma 3."""
    return write_tiny_gemma3_gguf_pair(tmp_path_factory.mktemp("mmproj") / "m", outtype="f32")


@pytest.fixture(scope="module")
def models(pair):
    folder, text, mm = pair
    return fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))


def _pixels(n: int = 2, seed: int = 3) -> mx.array:
    return mx.random.uniform(-1, 1, (n, 3, 32, 32), key=mx.random.key(seed))


def _png(seed: int) -> bytes:
    from PIL import Image

    arr = (np.random.default_rng(seed).random((40, 52, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _messages(*images: bytes) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": "What is in the picture?"}]}]


def test_mmproj_config_and_processor_match_the_folder(models):
    ref, model = models
    assert model.vision.config == ref.vision.config  # ids from the vocabulary, 16 tokens, eps 1e-6
    assert model.vision.config.mm_tokens_per_image == 16 and model.vision.config.pool == 2
    p, q = model.image_processor, ref.image_processor
    for field in ("height", "width", "resample", "rescale_factor", "image_mean", "image_std", "do_convert_rgb"):
        assert getattr(p, field) == getattr(q, field), field
    assert model.weight_format.startswith("gguf")


def test_f32_mmproj_encoder_equals_the_folder_bitwise(pair, models):
    folder, _, _ = pair
    ref, model = models
    px = _pixels()
    got = gemma3.encode_images(model.vision, px)
    assert got.shape == (2, 16, 64) and got.dtype == mx.float32
    assert mx.array_equal(got, gemma3.encode_images(ref.vision, px)).item()
    # and the folder's image path loaded on its own, in the same numerics
    own = load_vision(folder, numerics=model.vision.tower.numerics)
    assert mx.array_equal(got, gemma3.encode_images(own, px)).item()


@pytest.mark.parametrize("outtype,tol", [("f16", 2e-3), ("q8_0", 2e-2)])
def test_f16_and_q8_0_mmproj_encoders_are_close(pair, models, tmp_path, outtype, tol):
    folder, text, _ = pair
    ref, _ = models
    mm = write_mmproj(folder, tmp_path / f"mmproj-{outtype}.gguf", outtype=outtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mm)).tensors}
    assert kinds["mm.input_projection.weight"] == "F16" and kinds["v.patch_embd.weight"] == "F32"
    assert kinds["v.blk.0.attn_q.weight"] == outtype.upper() and kinds["mm.soft_emb_norm.weight"] == "F32"
    for keep in (None, False, True):  # the CPU default, dequantized, or the Q8_0 linears kept packed
        model = fx_engine.load(str(text), mmproj=str(mm), keep_quantized=keep)
        px = _pixels()
        got, want = gemma3.encode_images(model.vision, px), gemma3.encode_images(ref.vision, px)
        err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert 0 < err < tol, (keep, err)


@pytest.mark.oracle
def test_image_prompt_through_gguf_and_mmproj_equals_the_folder(models):
    ref, model = models
    msgs = _messages(_png(1), _png(2))
    want = fx_engine.generate(ref, msgs, max_tokens=10, logprobs=5)
    got = fx_engine.generate(model, msgs, max_tokens=10, logprobs=5)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.token_ids == want.token_ids  # greedy
    # (the tiny model's greedy token is near certain: its runners-up carry the comparison)
    for g, w in zip(got.logprobs, want.logprobs):
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-4)
    # the image is read: another image changes the first token's distribution
    other = fx_engine.generate(model, _messages(_png(5), _png(2)), max_tokens=1, logprobs=3)
    assert other.logprobs[0].top != got.logprobs[0].top


def test_cli_generate_takes_mmproj(pair, tmp_path, capsys):
    from fx_engine.cli import main

    folder, text, mm = pair
    image = tmp_path / "x.png"
    image.write_bytes(_png(1))
    rc = main(["generate", "--model", str(text), "--mmproj", str(mm), "--image", str(image), "--max-tokens", "3",
               "--no-warmup", "What is it?"])
    assert rc in (0, None)
    want = fx_engine.generate(fx_engine.load(str(text), mmproj=str(mm)), _messages(image.read_bytes()),
                              max_tokens=3).text
    assert want in capsys.readouterr().out
    # without it the GGUF is a text-only model: the image is refused
    assert main(["generate", "--model", str(text), "--image", str(image), "--max-tokens", "3", "--no-warmup",
                 "What is it?"]) == 2
    assert "has no vision tower" in capsys.readouterr().err


def test_serve_takes_mmproj_for_its_first_model():
    from fx_engine.cli import build_parser

    a = build_parser().parse_args(["serve", "--model", "t.gguf", "--mmproj", "mm.gguf"])
    assert a.mmproj == "mm.gguf"
    with pytest.raises(SystemExit):  # (chat has no image input)
        build_parser().parse_args(["chat", "--mmproj", "mm.gguf"])


# refusals: each names the field or tensor


def test_wrong_projector_type_is_refused(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "llava.gguf", projector_type="mlp")
    with pytest.raises(ConfigError, match=r"clip.projector_type 'mlp' is not supported \(supported: gemma3"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_missing_tensor_is_named(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "cut.gguf", skip=("v.blk.1.attn_k.weight", "mm.soft_emb_norm.weight"))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'v.blk.1.attn_k.weight', 'mm.soft_emb_norm.weight'"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_missing_or_mismatched_metadata_is_named(pair, tmp_path):
    folder, text, _ = pair
    mm = write_mmproj(folder, tmp_path / "nokey.gguf", drop_metadata=("clip.vision.block_count",))
    with pytest.raises(ConfigError, match="'clip.vision.block_count' is missing"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_mmproj(folder, tmp_path / "other.gguf", metadata={"clip.vision.projection_dim": 2560})
    with pytest.raises(ConfigError, match=r"clip.vision.projection_dim = 2560, but the text model's hidden size"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_text_gguf_given_as_mmproj_is_refused(pair):
    _, text, _ = pair
    with pytest.raises(ConfigError, match="not an mmproj GGUF .*general.architecture 'gemma3'"):
        fx_engine.load(str(text), mmproj=str(text))


def test_mmproj_for_a_text_only_architecture_is_refused(pair, tmp_path):
    from fx_engine.loading.mmproj import load_mmproj
    from fx_engine.testing import write_tiny_model

    _, text, mm = pair
    llama = write_tiny_model(tmp_path / "llama", "llama")
    with pytest.raises(ValueError, match="mmproj applies to a GGUF text model; .* is a folder"):
        fx_engine.load(str(llama), mmproj=str(mm))
    with pytest.raises(ConfigError, match="mmproj was given for a 'llama' text model; the gemma3 projector needs"):
        load_mmproj(mm, types.SimpleNamespace(model_type="llama", hidden_size=64), {}, dtype=mx.float32)


def test_text_vocabulary_without_image_tokens_is_refused(pair, tmp_path):
    folder, _, mm = pair
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in folder.iterdir():
        (plain / f.name).write_bytes(f.read_bytes())
    tok = json.loads((plain / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["<start_of_img>"] = vocab.pop("<start_of_image>")
    tok["added_tokens"] = [t if t["content"] != "<start_of_image>" else {**t, "content": "<start_of_img>"}
                           for t in tok["added_tokens"]]
    (plain / "tokenizer.json").write_text(json.dumps(tok))
    text = write_text_gguf(plain, tmp_path / "plain.gguf")
    with pytest.raises(ConfigError, match="vocabulary has no '<start_of_image>' token"):
        fx_engine.load(str(text), mmproj=str(mm))


def test_images_to_a_gguf_without_its_mmproj_say_what_to_load(pair):
    """A GGUF text model given images: the ImageError names the mmproj file as the fix."""
    from fx_engine.loading.images import ImageError

    _, text_gguf, _ = pair
    model = fx_engine.load(str(text_gguf))
    with pytest.raises(ImageError, match=r"load its mmproj file too .*--mmproj FILE"):
        fx_engine.generate(model, _messages(_png(1)), max_tokens=2)
