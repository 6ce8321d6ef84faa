"""Test helpers: a tiny model folder's byte-level BPE tokenizer as GGUF metadata
(`add_tokenizer`: fx_engine.testing.gguf's, as llama.cpp's converter writes it), and the
mlx-lm oracle folder of what a GGUF holds."""

from pathlib import Path

from fx_engine.testing.gguf import add_bpe_tokenizer as add_tokenizer

__all__ = ["add_tokenizer", "dequantized_copy", "llama_cpp_logits", "llama_cpp_tokenize", "write_oracle"]


def write_oracle(folder: Path, out: Path, weights: dict) -> Path:
    """An HF folder at `out` with `folder`'s config and tokenizer and the given weights
    (numpy arrays: what a GGUF written from `folder` holds, dequantized), for mlx-lm."""
    import mlx.core as mx

    out.mkdir()
    mx.save_safetensors(str(out / "model.safetensors"), {k: mx.array(v) for k, v in weights.items()})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((folder / name).read_bytes())
    return out


_LLAMA_CPP_LOGITS = r"""
import json, sys
import numpy as np
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, logits_all=True, verbose=False, n_threads=2)
ids = json.loads(sys.argv[2])
llm.eval(ids)
np.save(sys.argv[3], np.array(llm.scores[: len(ids)], dtype=np.float32))
llm.close()
"""


def llama_cpp_logits(path: Path, ids: list, out: Path):
    """llama.cpp's logits (float32 [len(ids), V]) of `ids` through the GGUF at `path`, by
    llama-cpp-python in its own process (an optional peer: the caller skips without it);
    `out`: a scratch .npy path."""
    import json
    import subprocess
    import sys

    import numpy as np

    r = subprocess.run([sys.executable, "-c", _LLAMA_CPP_LOGITS, str(path), json.dumps(ids), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return np.load(out)


def dequantized_copy(src: Path, dst: Path) -> Path:
    """The GGUF at `src` with every tensor dequantized to F32 by gguf-py's reference (the
    metadata copied): what a quantized file holds, for a peer run without its quantized
    products (llama.cpp rounds the activations of those)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    for field in r.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = {"sub_type": field.types[-1]} if kind == gguf.GGUFValueType.ARRAY else {}
        w.add_key_value(field.name, field.contents(), kind, **sub)
    for t in r.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


# llama.cpp runs in its own process: loading it next to MLX, MKL and the native kernels in
# one process crashed (a segmentation fault in llama_model_load, seen once in the full suite)
_LLAMA_CPP_TOKENIZE = r"""
import json, sys
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts, add_bos = json.loads(sys.stdin.read()), sys.argv[2] == "1"
print(json.dumps([llm.tokenize(t.encode(), add_bos=add_bos, special=True) for t in texts]))
llm.close()
"""


def llama_cpp_tokenize(path: Path, texts: list, add_bos: bool) -> list:
    """llama.cpp's token ids of `texts` by the GGUF vocabulary at `path` (special tokens
    parsed), by llama-cpp-python in its own process; skips the test where it is not
    installed (an optional peer, not in CI)."""
    import importlib.util
    import json
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (an optional peer) is not installed")
    r = subprocess.run([sys.executable, "-c", _LLAMA_CPP_TOKENIZE, str(path), "1" if add_bos else "0"],
                       input=json.dumps(texts), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def assert_llama_cpp_logits(path: Path, scratch: Path) -> None:
    """fx-engine's logits of a short text through the GGUF at `path` equal llama.cpp's own
    (within 1e-3 of the largest logit); skips where llama-cpp-python is not installed."""
    import importlib.util

    import numpy as np
    import pytest

    import fx_engine

    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python (an optional peer) is not installed")
    model = fx_engine.load(path)
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6)[:48]
    theirs, ours = llama_cpp_logits(path, ids, scratch / "l.npy"), np.asarray(fx_engine.logits(model, ids))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-3 * np.abs(theirs).max())


def q8_0_round_trip(folder: Path, chosen) -> None:
    """The folder's matrices that `chosen(name, array)` picks (rows of whole 32-blocks) replaced
    by their Q8_0 round trip (gguf-py's reference quantizer): what a file written with those
    matrices in Q8_0 holds."""
    import mlx.core as mx
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    q8 = GGMLQuantizationType.Q8_0
    weights = dict(mx.load(str(folder / "model.safetensors")))
    for name, w in weights.items():
        x = np.asarray(w.astype(mx.float32))
        if x.ndim in (2, 3) and x.shape[-1] % 32 == 0 and chosen(name, x):
            weights[name] = mx.array(dequantize(quantize(x, q8), q8).reshape(x.shape))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
