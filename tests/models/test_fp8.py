"""FP8 checkpoints in blocks (Hugging Face's quant_method "fp8": DeepSeek-V3's original,
Qwen3-*-FP8, the NextN exports) load as their dequantized weights (fx_engine.loading.fp8).

The references are independent of the loader: each e4m3 byte's value from the format's
definition (fx_engine.testing.fp8.E4M3_VALUES, written from the OCP FP8 layout), times its
block's scale in float64; and mlx-lm's own DeepSeek-V3 loader, which dequantizes these
checkpoints in its `sanitize`."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.loading.fp8 import dequantize_block_fp8, dequantize_fp8, fp8_blocks
from fx_engine.testing.fp8 import E4M3_VALUES, write_fp8_folder, write_fp8_safetensors
from fx_engine.testing.tiny import write_tiny_model

from tests.conftest import LONG_TEXT


def _np(x):
    return np.asarray(x.astype(mx.float32), np.float64)


def test_every_e4m3_byte_decodes_to_the_formats_value():
    """All 256 codes (subnormals, both zeros, 448, the two NaNs) against the definition."""
    codes = mx.array(np.arange(256, dtype=np.uint8).reshape(16, 16))
    got = _np(dequantize_block_fp8(codes, mx.ones((1, 1)), (16, 16), mx.float32)).ravel()
    finite = ~np.isnan(E4M3_VALUES)
    np.testing.assert_array_equal(got[finite], E4M3_VALUES[finite])
    assert np.isnan(got[~finite]).all() and E4M3_VALUES[0x7E] == 448 and E4M3_VALUES[0x01] == 2.0 ** -9


@pytest.mark.parametrize("shape,block", [((130, 200), (128, 128)), ((3, 40, 70), (16, 32)), ((8, 8), (8, 8))])
def test_each_block_takes_its_own_scale(shape, block):
    """Full and cut edge blocks (a side not a multiple of the block), stacked experts."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, shape).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x10  # (no NaN codes: values compared exactly)
    nb = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    scale = rng.uniform(1e-4, 1e-2, nb).astype(np.float32)
    want = E4M3_VALUES[codes].copy()
    for idx in np.ndindex(*shape):
        want[idx] *= scale[(*idx[:-2], idx[-2] // block[0], idx[-1] // block[1])]
    got = dequantize_block_fp8(mx.array(codes), mx.array(scale), block, mx.float32)
    np.testing.assert_array_equal(_np(got), want.astype(np.float32))


def _qwen3_pair(tmp_path, **kw):
    """A tiny Qwen3 folder as FP8 and, beside it, the same model with those weights' exact
    values written as ordinary float32 tensors (the reference)."""
    base = write_tiny_model(tmp_path / "base", "qwen3", intermediate_size=200, **kw)
    exact = write_fp8_folder(base, tmp_path / "fp8", (32, 48))
    ref = write_tiny_model(tmp_path / "ref", "qwen3", intermediate_size=200, **kw)
    w = dict(mx.load(str(ref / "model.safetensors")))
    w.update({n: mx.array(v.astype(np.float32)) for n, v in exact.items()})
    mx.save_safetensors(str(ref / "model.safetensors"), w)
    return tmp_path / "fp8", ref, exact


def test_an_fp8_checkpoint_computes_what_its_exact_weights_do(tmp_path):
    """Every linear in FP8 blocks (scales in float32 and in bfloat16, as the published
    copies store them): the logits are those of the exact values written as floats,
    bitwise."""
    fp8, ref, exact = _qwen3_pair(tmp_path)
    assert exact and json.loads((fp8 / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    header = (fp8 / "model.safetensors").read_bytes()[8:4000]
    assert b"F8_E4M3" in header and b"weight_scale_inv" in header
    ours, theirs = fx_engine.load(fp8), fx_engine.load(ref)
    assert ours.params.dtype == theirs.params.dtype == "float32"
    ids = ours.tokenizer.encode(LONG_TEXT)[:40]
    np.testing.assert_array_equal(np.asarray(fx_engine.logits(ours, ids)), np.asarray(fx_engine.logits(theirs, ids)))
    bf = write_fp8_folder(tmp_path / "base", tmp_path / "fp8-bf16-scales", (32, 48), scale_dtype="bfloat16")
    m = fx_engine.load(tmp_path / "fp8-bf16-scales")
    assert fx_engine.generate(m, ids, max_tokens=6, temperature=0.0).token_ids  # (loads and runs)
    assert set(bf) == set(exact)


def test_a_bfloat16_fp8_checkpoint_loads_in_the_dtype_asked(tmp_path):
    """The published checkpoints keep norms and embeddings in bfloat16: the weights are
    dequantized to the dtype the model loads in (on the CPU float32 unless asked; asked
    bfloat16, bfloat16: not widened to the scales' float32)."""
    from fx_engine.loading.weights import load_hf_folder
    from fx_engine.core.nn import Numerics

    fp8, _, exact = _qwen3_pair(tmp_path, dtype="bfloat16")
    _, params, _ = load_hf_folder(fp8, None, False, Numerics())  # (the stored dtype: bfloat16)
    assert params.dtype == "bfloat16"
    m = fx_engine.load(fp8, dtype="bfloat16")
    assert m.params.dtype == "bfloat16"
    ids = m.tokenizer.encode(LONG_TEXT)[:12]
    assert len(fx_engine.generate(m, ids, max_tokens=4, temperature=0.0).token_ids) > 0


def test_sharded_fp8_scales_may_sit_in_another_shard(tmp_path):
    """A weight and its scales split over two shard files (the index names both)."""
    base = write_tiny_model(tmp_path / "base", "qwen3", intermediate_size=200)
    fp8 = tmp_path / "fp8"
    exact = write_fp8_folder(base, fp8, (32, 48))
    w = dict(mx.load(str(fp8 / "model.safetensors")))
    scales = {n for n in w if n.endswith("_scale_inv")}
    names = set(exact)
    write_fp8_safetensors(fp8 / "model-00001-of-00002.safetensors",
                          {n: a for n, a in w.items() if n not in scales}, names)
    write_fp8_safetensors(fp8 / "model-00002-of-00002.safetensors", {n: w[n] for n in scales}, set())
    (fp8 / "model.safetensors").unlink()
    (fp8 / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model-00001-of-00002.safetensors" for n in w if n not in scales},
        **{n: "model-00002-of-00002.safetensors" for n in scales}}}))
    whole = write_fp8_folder(base, tmp_path / "whole", (32, 48))
    assert set(whole) == names
    ids = list(range(3, 30))
    np.testing.assert_array_equal(np.asarray(fx_engine.logits(fx_engine.load(fp8), ids)),
                                  np.asarray(fx_engine.logits(fx_engine.load(tmp_path / "whole"), ids)))


@pytest.mark.oracle
def test_deepseek_v3_fp8_matches_mlx_lm(tmp_path):
    """mlx-lm's DeepSeek-V3 loader dequantizes the original's 128 x 128 blocks itself (to
    bfloat16): with power-of-two scales both sides hold the same exact weights, so the
    float parity tolerance applies."""
    from mlx_lm.utils import load_model

    from tests.models.test_parity import _compare

    base = write_tiny_model(tmp_path / "base", "deepseek_v3", intermediate_size=320)
    fp8 = tmp_path / "fp8"
    exact = write_fp8_folder(base, fp8, (128, 128), pow2=True)
    assert any(v.shape[-1] > 128 or v.shape[-2] > 128 for v in exact.values())  # (several blocks)
    ref, _ = load_model(fp8)
    ref.set_dtype(mx.float32)
    ours = fx_engine.load(fp8)
    ids = ours.tokenizer.encode(LONG_TEXT)[:72]
    _compare(fx_engine.logits(ours, ids, chunk=24), ref(mx.array([ids]))[0])


def test_config_fields_not_run_are_refused_by_name(tmp_path):
    ok = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert fp8_blocks({"quantization_config": ok}, "c") == (128, 128)
    assert fp8_blocks({"quantization_config": {**ok, "quant_method": "mlx"}}, "c") is None
    for field, value, match in (("fmt", "e5m2", "fmt 'e5m2'"), ("activation_scheme", "static", "'static'"),
                                ("weight_block_size", None, "weight_block_size None"),
                                ("weight_block_size", [128], r"weight_block_size \[128\]")):
        with pytest.raises(ConfigError, match=match):
            fp8_blocks({"quantization_config": {**ok, field: value}}, "c")
    fp8, _, _ = _qwen3_pair(tmp_path)
    raw = json.loads((fp8 / "config.json").read_text())
    raw["quantization_config"]["activation_scheme"] = "static"
    (fp8 / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="activation_scheme 'static'"):
        fx_engine.load(fp8)


def test_malformed_fp8_tensors_are_named():
    codes, scale = mx.zeros((64, 64), mx.uint8), mx.ones((1, 1))
    with pytest.raises(WeightsError, match=r"'w.weight_scale_inv' has shape \(1, 1\), expected \(2, 2\)"):
        dequantize_fp8({"w.weight": codes, "w.weight_scale_inv": scale}, (32, 32), mx.float32, "ckpt")
    with pytest.raises(WeightsError, match="scales 'v.weight_scale_inv' without their weight 'v.weight'"):
        dequantize_fp8({"v.weight_scale_inv": scale}, (64, 64), mx.float32, "ckpt")
    with pytest.raises(WeightsError, match="'w.weight' has FP8 scales but is stored as mlx.core.float32"):
        dequantize_fp8({"w.weight": mx.zeros((64, 64)), "w.weight_scale_inv": scale}, (64, 64), mx.float32, "ckpt")
    out = dequantize_fp8({"w.weight": codes, "w.weight_scale_inv": scale, "n.weight": mx.ones((4,))},
                         (64, 64), mx.bfloat16, "ckpt")
    assert set(out) == {"w.weight", "n.weight"} and out["w.weight"].dtype == mx.bfloat16
