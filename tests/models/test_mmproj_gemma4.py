"""llama.cpp's mmproj GGUF for Gemma 4 (clip.vision.projector_type "gemma4v"):
`fx_engine.load("text.gguf", mmproj="mmproj.gguf")` gives the image path of the Hugging Face
folder both files were converted from.

The files are written as llama.cpp's converter writes them (fx_engine/testing/mmproj.py
`write_gemma4_mmproj`: its Gemma4VisionAudioModel's keys, names through the installed gguf
package's MMPROJ map, input_proj as the conv kernel, the clip bounds as [1] tensors; the
text model as its Gemma4Model writes it). Oracles: the folder's own image path (bit for bit
from an F32 file; close for F16 / Q8_0) and the folder's greedy generation with images.
The folder's processor budget is set to 280 soft tokens (what an mmproj gets: the file
does not carry it).
"""

from __future__ import annotations

import types
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.engine.image_prompt import image_prompt
from tests.models.vision_checks import close, messages, png

gguf = pytest.importorskip("gguf")

from fx_engine.testing.mmproj import write_gemma4_mmproj, write_tiny_gemma4_gguf_pair  # noqa: E402

BUDGET = {"vision": {"default_output_length": 280, "use_clipped_linears": True, "standardize": True},
          "preprocessor": {"max_soft_tokens": 280}}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(folder, text.gguf, mmproj-f32.gguf) of one tiny Gemma 4 (clipped linears, standardize)."""
    return write_tiny_gemma4_gguf_pair(tmp_path_factory.mktemp("mmproj-gemma4") / "m", outtype="f32", **BUDGET)


@pytest.fixture(scope="module")
def models(pair):
    folder, text, mm = pair
    return fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))


def test_mmproj_config_and_processor_match_the_folder(models):
    ref, model = models
    want, got = ref.vision.config, model.vision.config
    for field in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "text_hidden_size", "patch_size", "pooling_kernel_size", "position_embedding_size", "rms_norm_eps",
                  "rope_theta", "standardize", "clipped_linears", "image_token_index", "boi_token_index",
                  "eoi_token_index"):
        assert getattr(got, field) == getattr(want, field), field
    a, b = ref.image_processor, model.image_processor
    assert (a.patch_size, a.pooling_kernel_size, a.max_soft_tokens, a.resample) == \
        (b.patch_size, b.pooling_kernel_size, b.max_soft_tokens, b.resample)


def test_f32_mmproj_encoder_equals_the_folder_bitwise(models):
    ref, model = models
    msgs = messages(png(1, (40, 30)), png(2, (20, 64)))
    a, b = image_prompt(ref, msgs), image_prompt(model, msgs)
    assert a.ids == b.ids
    close(b.rows, a.rows, 0)


@pytest.mark.parametrize("outtype,tol", [("f16", 5e-3), ("q8_0", 5e-2)])
def test_f16_and_q8_0_mmproj_encoders_are_close(pair, models, tmp_path, outtype, tol):
    """Relative to the rows' largest value, for the linears dequantized or kept packed; the
    types as the converter gives them (the patch conv F16 at f16, F32 at q8_0)."""
    folder, text, _ = pair
    ref, _ = models
    mm = write_gemma4_mmproj(folder, tmp_path / f"{outtype}.gguf", outtype=outtype)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(mm)).tensors}
    assert kinds["v.blk.0.attn_q.weight"] == outtype.upper() and kinds["mm.input_projection.weight"] == outtype.upper()
    assert kinds["v.patch_embd.weight"] == ("F16" if outtype == "f16" else "F32")
    assert kinds["v.position_embd.weight"] == kinds["v.blk.0.attn_q.input_min"] == kinds["v.std_bias"] == "F32"
    msgs = messages(png(3, (40, 30)))
    want = image_prompt(ref, msgs).rows
    for keep in (False, True):
        got = image_prompt(fx_engine.load(str(text), mmproj=str(mm), keep_quantized=keep), msgs).rows
        err = mx.abs(got - want).max().item() / mx.abs(want).max().item()
        assert 0 < err < tol, (keep, err)


@pytest.mark.oracle
def test_image_prompt_through_gguf_and_mmproj_equals_the_folder(models):
    ref, model = models
    msgs = messages(png(1, (52, 40)), png(2, (20, 36)), text="What is in the picture?")
    want = fx_engine.generate(ref, msgs, max_tokens=8, logprobs=5)
    got = fx_engine.generate(model, msgs, max_tokens=8, logprobs=5)
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        assert [t[0] for t in g.top] == [t[0] for t in w.top]
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-4)


def test_image_attention_follows_the_text_model(tmp_path):
    """A text GGUF does not say use_bidirectional_attention: a model with per-layer inputs
    (E2B / E4B) reads as causal, one without (26B-A4B / 31B) as "vision", as their configs
    say; the image path follows the text model, and such a model equals its folder."""
    folder, text, mm = write_tiny_gemma4_gguf_pair(tmp_path / "m", text={"hidden_size_per_layer_input": 0,
                                                                         "use_bidirectional_attention": "vision"},
                                                   **BUDGET)
    ref, model = fx_engine.load(str(folder)), fx_engine.load(str(text), mmproj=str(mm))
    assert model.config.vision_bidirectional
    msgs = messages(png(4, (40, 30)))
    assert image_prompt(model, msgs).whole
    want = fx_engine.generate(ref, msgs, max_tokens=4, logprobs=3)
    got = fx_engine.generate(model, msgs, max_tokens=4, logprobs=3)
    assert got.token_ids == want.token_ids
    for g, w in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose([t[2] for t in g.top], [t[2] for t in w.top], atol=1e-4)


def test_refusals_name_the_key_or_tensor(pair, tmp_path):
    folder, text, _ = pair
    mm = write_gemma4_mmproj(folder, tmp_path / "silu.gguf", metadata={"clip.use_silu": True})
    with pytest.raises(ConfigError, match="clip.use_silu"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_gemma4_mmproj(folder, tmp_path / "cut.gguf", skip=("v.blk.1.attn_post_norm.weight",))
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'v.blk.1.attn_post_norm.weight' \(an mmproj for "
                                           r"Gemma 4"):
        fx_engine.load(str(text), mmproj=str(mm))
    mm = write_gemma4_mmproj(folder, tmp_path / "dim.gguf", metadata={"clip.vision.projection_dim": 128})
    with pytest.raises(ConfigError, match="projection_dim = 128"):
        fx_engine.load(str(text), mmproj=str(mm))
    from fx_engine.loading.mmproj import load_mmproj

    with pytest.raises(ConfigError, match="the gemma4v projector needs a Gemma 4 text model"):
        load_mmproj(pair[2], types.SimpleNamespace(model_type="gemma3_text", hidden_size=64), {}, dtype=mx.float32)
