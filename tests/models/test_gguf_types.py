"""GGUF tensor types (fx_engine/loading/gguf.py) against the `gguf` package (llama.cpp's
reader and reference numpy dequantization: the independent oracle).

Each type: blocks of random bytes (random quants, scales and mins; the float16 block scales
set to random finite values), written with `gguf.GGUFWriter`, read back by fx-engine.
Affine types must dequantize (through MLX's own `mx.dequantize`) to exactly the reference
values; the others are read as the reference's float32 values.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytestmark = pytest.mark.oracle

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize  # noqa: E402

from fx_engine.core.checkpoint import WeightsError  # noqa: E402
from fx_engine.loading.gguf import AFFINE_TYPES, DEQUANTIZED_TYPES, read_gguf  # noqa: E402

# byte offsets of each type's float16 fields inside a block (llama.cpp's block structs)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,)}


def _blocks(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[kind]
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, nbytes), dtype=np.uint8)
    for off in F16_FIELDS[kind]:
        vals = (rng.uniform(0.5, 2.0, len(raw)) * rng.choice([-1, 1], len(raw)) * 2.0 ** rng.integers(-12, -2, len(raw)))
        raw[:, off : off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * nbytes)


def _write(path: Path, tensors: dict[str, tuple[np.ndarray, str | None]]) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (data, kind) in tensors.items():
        if kind is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", AFFINE_TYPES + DEQUANTIZED_TYPES)
def test_each_type_reads_as_the_reference_dequantizes(tmp_path, kind):
    rows, cols = 5, 512
    raw = _blocks(kind, rows, cols, seed=len(kind) * 7 + ord(kind[-1]))
    f = _write(tmp_path / "t.gguf", {"blk.0.ffn_up.weight": (raw, kind)})
    ref = dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(rows, cols)
    assert np.isfinite(ref).all()
    tensors, md = read_gguf(f)
    assert md["general.architecture"] == "llama"
    if kind in AFFINE_TYPES:
        w, s, b = (tensors[f"blk.0.ffn_up.{x}"] for x in ("weight", "scales", "biases"))
        group = cols // s.shape[1]
        bits = w.shape[1] * 32 // cols
        want = {"Q2_K": (2, 16), "Q3_K": (3, 16), "Q6_K": (6, 16), "IQ4_NL": (8, 32), "IQ4_XS": (8, 32)}
        assert (bits, group) == (want[kind] if kind in want else (int(kind[1]), 32)), (bits, group)
        ours = np.asarray(mx.dequantize(w, s, b, group_size=group, bits=bits))
    else:
        ours = np.asarray(tensors["blk.0.ffn_up.weight"])
    if kind == "IQ4_XS":  # scale * (kv + 128) can take 25 bits: within 1 ulp of d * ls * kv
        ulp = np.spacing(np.abs(ref).astype(np.float32))
        assert (np.abs(ours - ref) <= ulp).all()
        assert (ours == ref).mean() > 0.9  # (measured: most values exact)
    else:
        np.testing.assert_array_equal(ours, ref)


def test_float_types_and_names(tmp_path):
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    f16 = rng.standard_normal((64,)).astype(np.float16)
    bf16 = (rng.standard_normal((2, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    f = _write(tmp_path / "f.gguf", {"a.weight": (f32, None), "b.weight": (f16, None),
                                     "c.weight": (bf16, "BF16")})
    tensors, _ = read_gguf(f)
    np.testing.assert_array_equal(np.asarray(tensors["a.weight"]), f32)
    np.testing.assert_array_equal(np.asarray(tensors["b.weight"]), f16)
    want = (bf16.astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(np.asarray(tensors["c.weight"].astype(mx.float32)), want)


def test_unsupported_type_and_truncation_are_named(tmp_path):
    raw = _blocks("Q4_K", 2, 256, seed=1)
    iq = np.random.default_rng(2).integers(0, 256, size=(2, 66), dtype=np.uint8)  # IQ2_XXS rows
    f = _write(tmp_path / "x.gguf", {"blk.0.attn_q.weight": (raw, "Q4_K"),
                                     "blk.0.attn_k.weight": (iq, "IQ2_XXS")})
    with pytest.raises(WeightsError, match=r"tensor 'blk\.0\.attn_k\.weight' has GGML type IQ2_XXS"):
        read_gguf(f)
    good = _write(tmp_path / "g.gguf", {"blk.0.attn_q.weight": (raw, "Q4_K")})
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-100])
    with pytest.raises(WeightsError, match="truncated"):
        read_gguf(cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(WeightsError, match="cannot read weights"):
        read_gguf(junk)


def _reader_view(path):
    """Metadata and tensor infos as llama.cpp's own reader sees them."""
    r = gguf.GGUFReader(str(path))
    md = {}
    for k, f in r.fields.items():
        if k.startswith("GGUF."):
            continue
        v = f.contents()
        md[k] = v.tolist() if hasattr(v, "tolist") else v
    infos = [(t.name, [int(x) for x in reversed(t.shape)], t.tensor_type.name, int(t.data_offset))
             for t in r.tensors]
    return md, infos


@pytest.mark.parametrize("which", ["default", "written"])
@pytest.mark.slow
def test_header_parser_agrees_with_the_gguf_reader(tmp_path, default_model, which):
    from fx_engine.loading.gguf import GGML_TYPES, _Header

    if which == "default":
        path = Path(default_model.path)
    else:
        w = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "qwen3")
        w.add_uint32("qwen3.block_count", 3)
        w.add_float32("qwen3.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_array("tokenizer.ggml.tokens", ["a", "b", "\u00e9\u4e2d", ""])
        w.add_array("tokenizer.ggml.scores", [0.5, -1.25, 3.0, 0.0])
        w.add_bool("tokenizer.ggml.add_bos_token", True)
        w.add_string("general.name", "t\u00ebst")
        w.add_tensor("blk.0.attn_q.weight", _blocks("Q6_K", 2, 256, 0),
                     raw_dtype=gguf.GGMLQuantizationType.Q6_K)
        w.add_tensor("output_norm.weight", np.ones(256, np.float32))
        w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
        path = tmp_path / "w.gguf"
    md, infos = _reader_view(path)
    h = _Header(path)
    ours = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in h.metadata.items()}
    assert ours == md
    mine = [(n, s, GGML_TYPES[t][0], h.data_start + o) for n, s, t, o in h.tensors]
    assert mine == infos


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
@pytest.mark.parametrize("shape", [(3, 256), (2, 5, 96)])
def test_repacking_to_8_bits_keeps_every_integer(bits, shape):
    """checkpoint.repacked_8bit (numpy bit planes) against MLX's own unpacking of the stored
    integers (dequantize with scale 1, bias 0), for 2-D and stacked (3-D) weights."""
    from fx_engine.core.checkpoint import repacked_8bit

    k = shape[-1]
    ints = mx.random.randint(0, 2**bits, shape, key=mx.random.key(bits)).astype(mx.float32)
    q, _, _ = mx.quantize(ints, group_size=32, bits=bits)  # only the packed integers matter
    one = mx.ones((*shape[:-1], k // 32))
    want = mx.dequantize(q, one, mx.zeros_like(one), group_size=32, bits=bits).astype(mx.uint8)
    got = repacked_8bit(np.asarray(q), bits, k)
    assert got.shape == (*shape[:-1], k // 4)
    np.testing.assert_array_equal(got.view(np.uint8).reshape(shape), np.asarray(want))


@pytest.mark.parametrize("bits", [2, 5, 6])
def test_widths_the_kernels_lack_are_widened_to_8_bits_exactly(bits):
    """A 2/5/6-bit linear where the policy keeps 8 bits (the native CPU kernels) becomes an
    8-bit one with the same scales and biases: the same values, not a float copy."""
    from fx_engine.core.checkpoint import finish
    from fx_engine.core.nn import Linear, Quant

    w = mx.random.normal((8, 256), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    lin = Linear(weight=q, quant=Quant(scales=s, biases=b, group_size=32, bits=bits))
    out = finish(lin, mx.float32, lambda group, width: width in (4, 8) and group % 32 == 0)
    assert out.quantized and out.quant.bits == 8 and out.quant.group_size == 32
    np.testing.assert_array_equal(
        np.asarray(mx.dequantize(out.weight, out.quant.scales, out.quant.biases, group_size=32, bits=8)),
        np.asarray(mx.dequantize(q, s, b, group_size=32, bits=bits)))
    dense = finish(lin, mx.float32, False)  # a bool policy: dequantized, as before
    assert not dense.quantized


def test_a_lookup_only_table_stays_quantized_in_any_format():
    """An untied embedding table (only gathered, never a matmul) keeps its stored format
    (here 6-bit, group 16: no native kernel), and its rows equal the dense table's."""
    from fx_engine.core.checkpoint import finish
    from fx_engine.core.nn import Linear, Quant, embed

    from fx_engine.core.checkpoint import pack_stream as _pack

    rng = np.random.default_rng(0)  # mx.quantize has no group 16: pack a triple by hand
    q = mx.array(_pack(rng.integers(0, 64, (64, 256), dtype=np.uint8), 6))
    s = mx.array(rng.uniform(0.01, 0.1, (64, 16)).astype(np.float32))
    b = mx.array(rng.uniform(-1, 1, (64, 16)).astype(np.float32))
    lin = Linear(weight=q, quant=Quant(scales=s, biases=b, group_size=16, bits=6))
    native = lambda group, width: width in (4, 8) and group % 32 == 0  # noqa: E731
    kept = finish(lin, mx.float32, native, table=True, lookup_only=True)
    dense = finish(lin, mx.float32, native, table=True)
    assert kept.quantized and (kept.quant.bits, kept.quant.group_size) == (6, 16) and not dense.quantized
    ids = mx.array([3, 0, 63, 3])
    np.testing.assert_array_equal(np.asarray(embed(ids, kept)), np.asarray(embed(ids, dense)))
    assert not finish(lin, mx.float32, False, table=True, lookup_only=True).quantized


def test_unsupported_architecture_and_missing_metadata_are_named(tmp_path):
    import fx_engine
    from fx_engine.core.config import ConfigError

    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ConfigError, match=r"GGUF architecture 'mamba' is not supported \(supported: llama"):
        fx_engine.load(tmp_path / "a.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "b.gguf"), "qwen3")
    w.add_uint32("qwen3.block_count", 1)
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ConfigError, match=r"GGUF metadata 'qwen3\.[a-z_.]+' is missing"):
        fx_engine.load(tmp_path / "b.gguf")
