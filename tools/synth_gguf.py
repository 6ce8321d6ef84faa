#!/usr/bin/env python
"""Synthetic GGUF files at real model sizes: random but valid blocks (meaningless outputs,
real bytes and shapes), written with the gguf package, for benchmarks anyone can rerun
without downloading a model (issue 41).

    python tools/synth_gguf.py --list                         # the matrix, sizes, what is cached
    python tools/synth_gguf.py llama-1b --quant Q4_0,Q4_K_M   # write (or reuse) and print paths
    python tools/bench.py --quick --model synth:llama-1b:Q4_K_M --engines fx,fx-a8

Shapes (the published configs' dimensions):

  llama-1b   Llama 3.2 1B: hidden 2048, 16 layers, ff 8192, 32 q / 8 kv heads, vocab 128256, tied
  llama-3b   Llama 3.2 3B: hidden 3072, 28 layers, ff 8192, 24 / 8 heads, vocab 128256, tied
  llama-8b   Llama 3.1 8B: hidden 4096, 32 layers, ff 14336, 32 / 8 heads, vocab 128256, untied
  olmoe      OLMoE-1B-7B: hidden 2048, 16 layers, 64 experts top-8 of width 1024, 16 / 16 heads,
             vocab 50304, untied; q/k norms over the whole projections (arch `olmoe`)

Quantizations, llama.cpp's tensor-type choices (llama_tensor_get_type) for these shapes:

  Q4_0 / Q8_0 / Q6_K   every matrix in that type; the output matrix (or the tied embedding)
                       Q6_K, except in Q8_0 files
  Q4_K_M / Q5_K_M      Q4_K / Q5_K, with attn_v and ffn_down (ffn_down_exps) Q6_K on the
                       "use_more_bits" layers (the first and last eighth, every third between)
                       and the output matrix / tied embedding Q6_K
  norms and the MoE router (ffn_gate_inp) stay F32, as llama.cpp leaves them.

The tokenizer is the default model's (SmolLM2's byte-level BPE, as its GGUF stores it: real
merges, chat template, BOS/EOS), padded with unreachable normal tokens `[synthNNNNN]` to the
shape's vocabulary, so the embedding's rows and the token list agree (as llama.cpp requires).
Block scales (float16 fields) are drawn so weights have a sane magnitude; every other byte is
uniform random. Files are written to a temporary name then renamed: a cached file is whole.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path("~/.cache/fx-engine/synth").expanduser()


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    layers: int
    ff: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    arch: str = "llama"
    experts: int = 0  # 0: dense
    top_k: int = 0
    rope_theta: float = 500000.0
    context: int = 8192


SHAPES = {
    "llama-1b": Shape("llama-1b", 2048, 16, 8192, 32, 8, 128256, tied=True),
    "llama-3b": Shape("llama-3b", 3072, 28, 8192, 24, 8, 128256, tied=True),
    "llama-8b": Shape("llama-8b", 4096, 32, 14336, 32, 8, 128256, tied=False),
    "olmoe": Shape("olmoe", 2048, 16, 1024, 16, 16, 50304, tied=False, arch="olmoe",
                   experts=64, top_k=8, rope_theta=10000.0, context=4096),
}
QUANTS = ("Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0")
# llama.cpp's general.file_type (enum llama_ftype)
FILE_TYPE = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}

# offsets of the float16 fields in each block type (d, and dmin for the K types with mins), and
# the exponent range of their random values (weights of std ~0.01-0.05 with the random codes)
F16 = {"Q4_0": ((0,), (-9, -7)), "Q8_0": ((0,), (-13, -11)), "Q4_K": ((0, 2), (-13, -10)),
       "Q5_K": ((0, 2), (-14, -11)), "Q6_K": ((208,), (-17, -14))}


def _more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits(i_layer, n_layers)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_plan(s: Shape, quant: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, GGML type, logical shape [.., rows, cols]) of every tensor, in file order.
    quant: one of QUANTS, or "Q4_K_M-alt" (tools/bench_load.py's historical mix: Q6_K
    attn_v on every layer and ffn_down on the even ones)."""
    base = {"Q4_0": "Q4_0", "Q8_0": "Q8_0", "Q6_K": "Q6_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K",
            "Q4_K_M-alt": "Q4_K"}[quant]
    head_kind = "Q8_0" if quant == "Q8_0" else "Q6_K"  # the output matrix / tied embedding

    def more(i: int, n: int) -> str:
        if quant == "Q4_K_M-alt":
            return "Q6_K"
        return "Q6_K" if quant in ("Q4_K_M", "Q5_K_M") and _more_bits(i, n) else base

    hd = s.hidden // s.heads
    hq, hk = s.heads * hd, s.kv_heads * hd
    out: list[tuple[str, str, tuple[int, ...]]] = [
        ("token_embd.weight", head_kind if s.tied else base, (s.vocab, s.hidden)),
        ("output_norm.weight", "F32", (s.hidden,))]
    if not s.tied:
        out.append(("output.weight", head_kind, (s.vocab, s.hidden)))
    for i in range(s.layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", "F32", (s.hidden,)),
                (p + "attn_q.weight", base, (hq, s.hidden)),
                (p + "attn_k.weight", base, (hk, s.hidden)),
                (p + "attn_v.weight", more(i, s.layers), (hk, s.hidden)),
                (p + "attn_output.weight", base, (s.hidden, hq)),
                (p + "ffn_norm.weight", "F32", (s.hidden,))]
        if s.arch == "olmoe":
            out += [(p + "attn_q_norm.weight", "F32", (hq,)), (p + "attn_k_norm.weight", "F32", (hk,))]
        if s.experts:
            out += [(p + "ffn_gate_inp.weight", "F32", (s.experts, s.hidden)),
                    (p + "ffn_gate_exps.weight", base, (s.experts, s.ff, s.hidden)),
                    (p + "ffn_up_exps.weight", base, (s.experts, s.ff, s.hidden)),
                    (p + "ffn_down_exps.weight", more(i, s.layers), (s.experts, s.hidden, s.ff))]
        else:
            down = "Q6_K" if quant == "Q4_K_M-alt" and i % 2 == 0 else (
                base if quant == "Q4_K_M-alt" else more(i, s.layers))
            out += [(p + "ffn_gate.weight", base, (s.ff, s.hidden)),
                    (p + "ffn_up.weight", base, (s.ff, s.hidden)),
                    (p + "ffn_down.weight", down, (s.hidden, s.ff))]
    return out


def _nbytes(kind: str, shape: tuple[int, ...]) -> int:
    import gguf

    n = 1
    for d in shape:
        n *= d
    if kind == "F32":
        return 4 * n
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    return n // block * size


def estimate_bytes(s: Shape, quant: str) -> int:
    """The tensor data's bytes (the file is this plus a few MB of metadata)."""
    return sum(_nbytes(k, shp) for _, k, shp in tensor_plan(s, quant))


def file_name(s: Shape, quant: str) -> str:
    return f"synth-{s.name}-{quant}.gguf"


def _tokenizer(writer: Any, vocab: int) -> None:
    """The default model's tokenizer metadata, the token list padded to `vocab`."""
    import numpy as np

    from fx_engine.loading.default_model import default_model_path
    from fx_engine.loading.gguf import _Header

    md = _Header(default_model_path()).metadata
    tokens = list(md["tokenizer.ggml.tokens"])
    types = [int(t) for t in md["tokenizer.ggml.token_type"]]
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the tokenizer's {len(tokens)} tokens")
    pad = vocab - len(tokens)
    tokens += [f"[synth{i:06d}]" for i in range(pad)]
    types += [1] * pad  # normal tokens no merge reaches: never produced by encoding
    for k, v in md.items():
        if not k.startswith("tokenizer."):
            continue
        if k == "tokenizer.ggml.tokens":
            writer.add_array(k, tokens)
        elif k == "tokenizer.ggml.token_type":
            writer.add_array(k, types)
        elif isinstance(v, str):
            writer.add_string(k, v)
        elif isinstance(v, (list, np.ndarray)):
            writer.add_array(k, list(v.tolist() if isinstance(v, np.ndarray) else v))
        elif isinstance(v, (bool, np.bool_)):
            writer.add_bool(k, bool(v))
        else:
            writer.add_uint32(k, int(v))


def _blocks(rng: Any, kind: str, shape: tuple[int, ...]) -> Any:
    """Random valid blocks of `kind` as uint8 [.., rows, row bytes] (the gguf writer's raw form)."""
    import gguf
    import numpy as np

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[kind]]
    n = 1
    for d in shape:
        n *= d
    nblocks = n // block
    raw = np.frombuffer(bytearray(rng.bytes(nblocks * size)), np.uint8).reshape(nblocks, size)
    offsets, (lo, hi) = F16[kind]
    for off in offsets:
        vals = rng.uniform(1, 2, nblocks) * 2.0 ** rng.integers(lo, hi, nblocks)
        raw[:, off:off + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * size)


def _tensors(s: Shape, plan: list[tuple[str, str, tuple[int, ...]]], seed: int) -> Iterator[Any]:
    import numpy as np

    rng = np.random.default_rng(seed)
    for name, kind, shape in plan:
        if kind != "F32":
            yield _blocks(rng, kind, shape)
        elif name.endswith("ffn_gate_inp.weight"):  # the router: small random logits
            yield rng.normal(0, 0.02, shape).astype(np.float32)
        else:  # RMSNorm weights
            yield np.ones(shape, np.float32)


def write_file(path: Path, s: Shape, quant: str, seed: int = 0) -> Path:
    """Write `s` at `quant` to `path` (through `path`.partial, renamed when complete),
    tensor by tensor: memory holds one tensor at a time."""
    import gguf
    import numpy as np

    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    plan = tensor_plan(s, quant)
    w = gguf.GGUFWriter(str(tmp), s.arch)
    a = s.arch
    w.add_string("general.name", f"fx-engine synthetic {s.name} {quant} (random weights)")
    if quant in FILE_TYPE:
        w.add_uint32("general.file_type", FILE_TYPE[quant])
    w.add_uint32("general.quantization_version", 2)
    hd = s.hidden // s.heads
    ints = {"block_count": s.layers, "context_length": s.context, "embedding_length": s.hidden,
            "feed_forward_length": s.ff, "attention.head_count": s.heads,
            "attention.head_count_kv": s.kv_heads, "rope.dimension_count": hd,
            "vocab_size": s.vocab}
    if s.experts:
        ints.update({"expert_count": s.experts, "expert_used_count": s.top_k,
                     "expert_feed_forward_length": s.ff})
    for key, val in ints.items():
        w.add_uint32(f"{a}.{key}", val)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32(f"{a}.rope.freq_base", s.rope_theta)
    _tokenizer(w, s.vocab)
    for name, kind, shape in plan:
        nbytes = _nbytes(kind, shape)
        if kind == "F32":
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            w.add_tensor_info(name, (*shape[:-1], shape[-1] // block * size), np.dtype(np.uint8),
                              nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in _tensors(s, plan, seed):
        w.write_tensor_data(t)
    w.close()
    os.replace(tmp, path)
    return path


def ensure(shape: str | Shape, quant: str, folder: str | Path | None = None, log: Any = None) -> Path:
    """The cached file of `shape` at `quant` in `folder` (written first when absent)."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    if quant not in QUANTS and quant != "Q4_K_M-alt":
        raise ValueError(f"unknown quantization {quant!r} (one of {', '.join(QUANTS)})")
    d = Path(folder).expanduser() if folder else DEFAULT_DIR
    d.mkdir(parents=True, exist_ok=True)
    path = d / file_name(s, quant)
    if path.exists():
        return path
    need = estimate_bytes(s, quant)
    free = shutil.disk_usage(d).free
    if need + 2**30 > free:
        raise OSError(f"{path}: needs {need / 1e9:.2f} GB, {free / 1e9:.2f} GB free in {d}")
    if log:
        log(f"writing {path} ({need / 1e9:.2f} GB)")
    return write_file(path, s, quant)


def resolve(spec: str, folder: str | Path | None = None, log: Any = None) -> Path:
    """`synth:SHAPE:QUANT` (tools/bench.py's --model) -> the cached file's path."""
    parts = spec.split(":")
    if len(parts) != 3 or parts[0] != "synth" or parts[1] not in SHAPES:
        raise ValueError(f"{spec!r}: expected synth:SHAPE:QUANT, SHAPE in {', '.join(SHAPES)}, "
                         f"QUANT in {', '.join(QUANTS)}")
    return ensure(parts[1], parts[2].upper(), folder, log)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shapes", nargs="*", help=f"comma/space list among {', '.join(SHAPES)}, or all")
    ap.add_argument("--quant", default=None,
                    help=f"comma list among {', '.join(QUANTS)}, or all (default: Q4_K_M; --list: all)")
    ap.add_argument("--dir", default=str(DEFAULT_DIR), help="the cache folder (files reused if present)")
    ap.add_argument("--list", action="store_true", help="print every shape x quantization, its size "
                    "and whether it is cached; write nothing")
    a = ap.parse_args(argv)
    folder = Path(a.dir).expanduser()
    names = [n for arg in a.shapes for n in arg.split(",") if n]
    names = list(SHAPES) if (a.list and not names) or "all" in names else names
    a.quant = a.quant or ("all" if a.list else "Q4_K_M")
    quants = list(QUANTS) if a.quant == "all" else [q.strip().upper() for q in a.quant.split(",")]
    bad = [n for n in names if n not in SHAPES] + [q for q in quants if q not in QUANTS]
    if bad or not names:
        ap.error(f"unknown or missing: {bad or 'a shape'}")
    for n in names:
        for q in quants:
            s = SHAPES[n]
            path = folder / file_name(s, q)
            if a.list:
                state = "cached" if path.exists() else "absent"
                print(f"{n:9s} {q:7s} {estimate_bytes(s, q) / 1e9:6.2f} GB  {state:6s}  {path}")
                continue
            p = ensure(s, q, folder, log=lambda m: print(m, file=sys.stderr, flush=True))
            print(f"{p}  {p.stat().st_size / 1e9:.3f} GB")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
