"""GGUF files: fx-engine's own header parser (`_Header`: mmap + struct, tested against
llama.cpp's `gguf` reader) and tensor data read from a numpy memmap.

Metadata comes back as Python / numpy values (scalars have `.item()`, arrays `.tolist()`).
Tensors come back as MLX arrays under llama.cpp's names, with quantized ones as MLX affine
triples (`<name>.weight` packed uint32, `<name>.scales`, `<name>.biases`) wherever the
GGML block format IS an affine quantization, which makes the conversion exact (every
dequantized value equals llama.cpp's reference dequantization, bit for bit):

    type   bits  group  scale          bias           (q: the stored unsigned integer)
    Q4_0     4    32    d              -8 d
    Q4_1     4    32    d              m
    Q5_0     5    32    d              -16 d
    Q5_1     5    32    d              m
    Q8_0     8    32    d              -128 d          (int8 q shifted by 128)
    Q2_K     2    16    d * sc         -dmin * m       (4-bit sc, m per 16)
    Q3_K     3    16    d * (sc - 32)  -4 d (sc - 32)  (6-bit sc per 16; q with its high bit)
    Q4_K     4    32    d * sc         -dmin * m       (6-bit sc, m per 32)
    Q5_K     5    32    d * sc         -dmin * m
    Q6_K     6    16    d * sc         -32 d * sc      (int8 sc per 16)
    IQ4_NL   8    32    d              -128 d          (q = kv[index] + 128: the codebook)
    IQ4_XS   8    32    d * (ls - 32)  -128 d (ls - 32) (6-bit ls per 32; q as IQ4_NL's)

(each product is exact in float32: d has 11 significant bits, sc and q at most 13 together;
IQ4_XS's scale * q has up to 25 bits, so its dequantized values may be 1 ulp from
llama.cpp's d * (ls - 32) * kv: measured and tested. IQ4_NL and IQ4_XS, 4-bit indices into
a non-uniform codebook, take 8 bits here: about twice the file, where a float32 copy took
7.5x.)
MLX packs every bit width as one little-endian bit stream per row, which is what
`core.checkpoint.pack_stream` writes. Where the native CPU kernels run a float32 model (`compact`), the scales
and biases of 2-D tensors stay about as small as the file's: the K types' in their
two-level form (int16 codes per group, the float16 factors per super-block: the kernels
compute d * sc themselves, runtime/native/scales.h), the legacy types' as float16 (d and m
are halves); both decode to exactly the float32 values above. F32 / F16 / BF16 tensors are
read as they are. Any other type is an error naming the tensor and its type.

Split files (llama.cpp's `gguf-split`, and what the Hub serves for large models:
`PREFIX-00001-of-0000N.gguf`, each shard a GGUF with `split.no` / `split.count`, the
metadata in the first) read as one model from the first shard's path (`gguf_files`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Union

import mlx.core as mx
import numpy as np

from fx_engine.core.checkpoint import WeightsError, pack_stream

__all__ = ["read_gguf", "read_gguf_metadata", "read_gguf_tensor_names", "gguf_files", "AFFINE_TYPES", "DEQUANTIZED_TYPES"]

QK = 32  # elements per block of the legacy types
QK_K = 256  # elements per super-block of the K types

AFFINE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS")
DEQUANTIZED_TYPES: tuple[str, ...] = ()  # (every supported block type maps to an affine one)
# kept as MLX's mxfp4 quantization (the same E2M1 codes and E8M0 scales, the nibbles
# reordered): expert stacks run by gather_qmm, matrices by quantized_matmul where kept
# (keep_quantized=True, the GPU form) and dequantized by the CPU default (no native kernel)
MX_TYPES = ("MXFP4",)
FLOAT_TYPES = ("F32", "F16", "BF16")


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] bytes -> float32 (from IEEE half)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: low nibbles first, then high (the legacy order)."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _q4_0(b: np.ndarray) -> tuple:  # [N, 18]
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:18]), d, -8 * d, 4, QK


def _q4_1(b: np.ndarray) -> tuple:  # [N, 20]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:20]), d, m, 4, QK


def _high_bits(qh: np.ndarray, n: int) -> np.ndarray:
    """[N, 4] bytes of a little-endian uint32 -> [N, n] bits 0..n-1."""
    word = np.ascontiguousarray(qh).view("<u4")[:, :1]
    return ((word >> np.arange(n, dtype=np.uint32)) & 1).astype(np.uint8)


def _q5_0(b: np.ndarray) -> tuple:  # [N, 22]
    d = _f16(b[:, 0:2])
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6], QK) << 4)
    return q, d, -16 * d, 5, QK


def _q5_1(b: np.ndarray) -> tuple:  # [N, 24]
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8], QK) << 4)
    return q, d, m, 5, QK


def _q8_0(b: np.ndarray) -> tuple:  # [N, 34]
    d = _f16(b[:, 0:2])
    q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return q, d, -128 * d, 8, QK


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of Q4_K / Q5_K -> 8 six-bit scales and 8 six-bit mins."""
    s = s.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_quads(lo: np.ndarray) -> np.ndarray:
    """[N, 128] bytes of 4-bit quants -> [N, 256] values: per 32-byte chunk c, 32 low
    nibbles (sub-block 2c) then 32 high nibbles (sub-block 2c + 1)."""
    c = lo.reshape(lo.shape[0], 4, 32)
    return np.stack([c & 0xF, c >> 4], axis=2).reshape(lo.shape[0], QK_K)


def _q4_k(b: np.ndarray) -> tuple:  # [N, 144]: d, dmin, scales[12], qs[128]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    scale = d[:, None] * sc.astype(np.float32)
    return (_k_quads(b[:, 16:144]), scale, -(dmin[:, None] * mn.astype(np.float32)), 4, 32,
            (sc, mn, d, dmin))


def _q5_k(b: np.ndarray) -> tuple:  # [N, 176]: d, dmin, scales[12], qh[32], qs[128]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # bit j of qh[l] is the high bit of element l of sub-block j
    high = ((qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1).reshape(-1, QK_K)
    q = _k_quads(b[:, 48:176]) | (high << 4)
    scale = d[:, None] * sc.astype(np.float32)
    return q, scale, -(dmin[:, None] * mn.astype(np.float32)), 5, 32, (sc, mn, d, dmin)


def _q6_k(b: np.ndarray) -> tuple:  # [N, 210]: ql[128], qh[64], scales[16] int8, d
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc8 = b[:, 192:208].view(np.int8)
    sc = sc8.astype(np.float32)
    d = _f16(b[:, 208:210])
    halves = []
    for n in range(2):  # 128 elements each: 4 runs of 32 (llama.cpp's dequantize_row_q6_K)
        lo, hi = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32]
        halves += [(lo[:, :32] & 0xF) | ((hi & 3) << 4), (lo[:, 32:] & 0xF) | (((hi >> 2) & 3) << 4),
                   (lo[:, :32] >> 4) | (((hi >> 4) & 3) << 4), (lo[:, 32:] >> 4) | (((hi >> 6) & 3) << 4)]
    q = np.concatenate(halves, axis=1)  # unsigned 0..63 (llama.cpp subtracts 32)
    scale = d[:, None] * sc
    return q, scale, -32 * scale, 6, 16, (sc8, sc8, d, 32 * d)


def _q2_k(b: np.ndarray) -> tuple:  # [N, 84]: scales[16], qs[64], d, dmin
    s, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    runs = []
    for n in range(2):  # 128 elements each: for each shift, 32 elements (two groups of 16)
        c = qs[:, 32 * n : 32 * n + 32]
        runs += [(c >> (2 * j)) & 3 for j in range(4)]
    q = np.concatenate(runs, axis=1)
    scale = d[:, None] * (s & 0xF).astype(np.float32)
    return q, scale, -(dmin[:, None] * (s >> 4).astype(np.float32)), 2, 16, (s & 0xF, s >> 4, d, dmin)


def _q3_k(b: np.ndarray) -> tuple:  # [N, 110]: hmask[32], qs[64], scales[12], d
    hm, qs, sb = b[:, 0:32], b[:, 32:96], np.ascontiguousarray(b[:, 96:108])
    d = _f16(b[:, 108:110])
    aux = sb.view("<u4")  # [N, 3]: 16 six-bit scales packed as llama.cpp's kmask dance
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    k1, k2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    words = np.stack([(a0 & k2) | (((tmp >> 0) & k1) << 4), (a1 & k2) | (((tmp >> 2) & k1) << 4),
                      ((a0 >> 4) & k2) | (((tmp >> 4) & k1) << 4),
                      ((a1 >> 4) & k2) | (((tmp >> 6) & k1) << 4)], axis=1).astype("<u4")
    sc8 = words.view(np.int8).reshape(-1, 16) - np.int8(32)  # -32..31
    sc = sc8.astype(np.float32)
    runs = []
    for n in range(2):  # 128 elements each: per shift, 32 elements (two groups of 16)
        c = qs[:, 32 * n : 32 * n + 32]
        for j in range(4):
            high = (hm >> (4 * n + j)) & 1  # set: 0..3 as stored; clear: 4 lower
            runs.append(((c >> (2 * j)) & 3) + 4 * high)  # unsigned 0..7 (llama.cpp: - 4)
    scale = d[:, None] * sc
    return np.concatenate(runs, axis=1), scale, -4 * scale, 3, 16, (sc8, sc8, d, 4 * d)


# IQ4_NL / IQ4_XS: 4-bit indices into a fixed codebook of 16 int8 values (kv), times the
# block's scale. kv + 128 fits a byte, so w = d * kv is the 8-bit affine map with q = kv + 128,
# scale d and bias -128 d.
_KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)


def _iq4_nl(b: np.ndarray) -> tuple:  # [N, 18]: d, qs[16] (low nibbles 0..15, high 16..31)
    d = _f16(b[:, 0:2])
    return (_KVALUES[_nibbles(b[:, 2:18])] + 128).astype(np.uint8), d, -128 * d, 8, QK


def _iq4_xs(b: np.ndarray) -> tuple:  # [N, 136]: d, scales_h (u16), scales_l[4], qs[128]
    d = _f16(b[:, 0:2])
    sh = np.ascontiguousarray(b[:, 2:4]).view("<u2")[:, :1]  # [N, 1]
    sl = b[:, 4:8]
    sub = np.arange(8)
    lo = (sl[:, sub // 2] >> (4 * (sub % 2)).astype(np.uint8)) & 0xF
    hi = ((sh >> (2 * sub).astype(np.uint16)) & 3).astype(np.uint8)
    ls = (lo | (hi << 4)).astype(np.int8) - np.int8(32)  # [N, 8]: -32..31
    qs = b[:, 8:136].reshape(-1, 8, 16)
    q = (_KVALUES[np.concatenate([qs & 0xF, qs >> 4], axis=-1)] + 128).astype(np.uint8).reshape(-1, QK_K)
    scale = d[:, None] * ls.astype(np.float32)
    return q, scale, -128 * scale, 8, 32, (ls, ls, d, 128 * d)


_AFFINE = {"IQ4_NL": (_iq4_nl, QK, 18), "IQ4_XS": (_iq4_xs, QK_K, 136), "Q3_K": (_q3_k, QK_K, 110), "Q4_0": (_q4_0, QK, 18), "Q4_1": (_q4_1, QK, 20), "Q5_0": (_q5_0, QK, 22),
           "Q5_1": (_q5_1, QK, 24), "Q8_0": (_q8_0, QK, 34), "Q2_K": (_q2_k, QK_K, 84),
           "Q4_K": (_q4_k, QK_K, 144), "Q5_K": (_q5_k, QK_K, 176), "Q6_K": (_q6_k, QK_K, 210)}




def _two_level(parts: tuple, blocks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A K-quant's scale codes a, bias codes c (per group) and factors d, e (per super-block)
    -> the native kernels' two-level form: int16 codes (a in the low byte, c in the high
    one, both signed 8-bit) [blocks, groups] and float16 (d, e) [blocks, 1, 2]; None when
    e overflows a half (Q6_K's 32 d, Q3_K's 4 d for d near the half's maximum)."""
    a, c, d, e = parts
    de = np.stack([np.asarray(d, np.float32), np.asarray(e, np.float32)], axis=-1).astype(np.float16)
    if not np.isfinite(de).all():
        return None
    a8, c8 = (np.asarray(v).astype(np.int8).view(np.uint8).astype(np.uint16).reshape(blocks, -1) for v in (a, c))
    return (a8 | (c8 << 8)).view(np.int16), de.reshape(blocks, 1, 2)


def _affine(name: str, kind: str, data: np.ndarray, rows: int, cols: int,
            lead: tuple[int, ...] = (), store_bits: StoreBits = None, head: bool = False,
            compact: bool = False) -> dict[str, np.ndarray]:
    """Rows of an affine-quantizable type -> MLX's packed weight, scales and biases, shaped
    lead + (packed,) (lead: the tensor's leading dims, rows = their product). numpy only:
    this runs on worker threads, where MLX ops have no stream. store_bits: the width to pack
    the integers in (8 for a width the native kernels do not run: exact). compact: 2-D
    tensors' scales and biases in the forms the native kernels decode themselves (exactly:
    runtime/native/scales.h): K-quants two-level (int16 codes [rows, groups], float16
    factors [rows, super-blocks, 2]: 0.625 bits per weight in groups of 32 where float32
    scales and biases take 2), the legacy types float16 (their d and m are halves), except
    an embedding table's (a lookup dequantizes with MLX's ops: float32)."""
    fn, block, nbytes = _AFFINE[kind]
    if cols % block:
        raise WeightsError(f"tensor '{name}' ({kind}): row length {cols} is not a multiple of {block}")
    out_w, out_s, out_b = [], [], []
    step = max(1, (1 << 22) // cols)  # rows per piece: bounded temporaries
    raw = data.reshape(rows, cols // block, nbytes)
    # expert stacks (3-D) too where the native experts' product runs the width (Q4_K, Q5_K,
    # Q6_K; every legacy type): packed as the file stores them, ~its bytes in memory
    stack_ok = len(lead) <= 1 or kind in ("Q4_K", "Q5_K", "Q6_K") or block == QK
    two_level = compact and stack_ok and block == QK_K
    half = compact and stack_ok and block == QK and not name.startswith("token_embd")
    for r0 in range(0, rows, step):
        piece = raw[r0 : r0 + step]
        n = piece.shape[0]
        blocks = piece.reshape(-1, nbytes)
        q, scale, bias, bits, group, *factors = fn(blocks)
        scale = np.asarray(scale, np.float32).reshape(len(blocks), -1)  # [blocks, groups/block]
        bias = np.broadcast_to(np.asarray(bias, np.float32).reshape(len(blocks), -1), scale.shape)
        # expert stacks (3-D) run on mx.gather_qmm, which takes every width: as stored
        width = store_bits(name, group, bits, head) if store_bits and len(lead) <= 1 else bits
        out_w.append(pack_stream(q.reshape(n, cols), width))
        packed = _two_level(factors[0], len(blocks)) if two_level else None
        if packed is not None:  # [n, groups] codes, [n, super-blocks, 2] factors
            out_s.append(packed[0].reshape(n, cols // group))
            out_b.append(packed[1].reshape(n, cols // QK_K, 2))
        else:
            out_s.append(scale.reshape(n, cols // group))
            out_b.append(bias.reshape(n, cols // group))
    if two_level and any(s.dtype != np.int16 for s in out_s):  # a piece overflowed: all float32
        return _affine(name, kind, data, rows, cols, lead, store_bits, head, compact=False)
    if half:
        s16, b16 = (np.concatenate(x).astype(np.float16) for x in (out_s, out_b))
        if np.isfinite(s16).all() and np.isfinite(b16).all():  # d, m halves; -8 d, -128 d too
            out_s, out_b = [s16], [b16]
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    lead = lead or (rows,)
    return {f"{base}.{part}": np.concatenate(arrays).reshape(*lead, *arrays[0].shape[1:-1], -1)
            for part, arrays in (("weight", out_w), ("scales", out_s), ("biases", out_b))}


# GGML tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 39: ("MXFP4", 32, 17),
}
# GGUF metadata value types: id -> numpy dtype (8: string, 9: array)
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}


class _Header:
    """A GGUF file's header (versions 2 and 3): metadata, tensor infos, where data starts.
    Parsed from an mmap with struct (a vocabulary of 100k strings takes ~0.1 s; the `gguf`
    package's reader, which this is tested against, takes seconds)."""

    def __init__(self, path: Path) -> None:
        import mmap
        import struct

        self.path = path
        with open(path, "rb") as f:
            self.size = path.stat().st_size
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if self.size else b""
        try:
            self._parse(buf, struct)
        except (struct.error, IndexError, ValueError, UnicodeDecodeError) as e:
            raise WeightsError(f"{path}: cannot read weights: the GGUF header is cut short or "
                               f"corrupt ({type(e).__name__}: {e}); is the file truncated?") from e

    def _parse(self, buf: Any, struct: Any) -> None:
        if buf[:4] != b"GGUF":
            raise WeightsError(f"{self.path}: cannot read weights: not a GGUF file (magic "
                               f"{bytes(buf[:4])!r}, expected b'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise WeightsError(f"{self.path}: cannot read weights: GGUF version {version} is "
                               "not supported (2 and 3 are)")
        off = 24

        def string(off: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, off)
            end = off + 8 + n
            if end > len(buf):
                raise ValueError("string past the end of the file")
            return bytes(buf[off + 8 : end]).decode("utf-8", errors="surrogateescape"), end

        def value(kind: int, off: int) -> tuple[Any, int]:
            if kind == 8:
                return string(off)
            if kind == 9:
                inner, n = struct.unpack_from("<IQ", buf, off)
                off += 12
                if inner == 8:
                    out = []
                    for _ in range(n):
                        s, off = string(off)
                        out.append(s)
                    return out, off
                if inner not in _SCALARS:
                    raise ValueError(f"arrays of value type {inner} are not supported")
                dt = np.dtype(_SCALARS[inner])
                end = off + n * dt.itemsize
                if end > len(buf):
                    raise ValueError("array past the end of the file")
                return np.frombuffer(buf[off:end], dtype=dt).copy(), end
            if kind not in _SCALARS:
                raise ValueError(f"unknown metadata value type {kind}")
            dt = np.dtype(_SCALARS[kind])
            return np.frombuffer(buf[off : off + dt.itemsize], dtype=dt)[0], off + dt.itemsize

        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, off = string(off)
            (kind,) = struct.unpack_from("<I", buf, off)
            self.metadata[key], off = value(kind, off + 4)
        self.tensors: list[tuple[str, list[int], int, int]] = []  # name, shape (rows first), type, offset
        for _ in range(n_tensors):
            name, off = string(off)
            (n_dims,) = struct.unpack_from("<I", buf, off)
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, off + 4))
            kind, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
            off += 4 + 8 * n_dims + 12
            self.tensors.append((name, [int(x) for x in reversed(dims)], int(kind), int(offset)))
        align = int(self.metadata.get("general.alignment", 32))
        self.data_start = (off + align - 1) // align * align


# (name, group, bits, is_head) -> the width to pack a tensor's integers in; is_head: the
# output head (output.weight, or token_embd.weight in a file without one: tied, llama.cpp's
# convention)
def _mxfp4(name: str, data: np.ndarray, rows: int, cols: int, lead: tuple[int, ...]) -> dict[str, np.ndarray]:
    """MXFP4 blocks (1 E8M0 scale byte, then 16 bytes: element j in the low nibble of byte
    j, element j + 16 in its high nibble) -> MLX's mxfp4 form: codes packed 8 per uint32 in
    element order, the scale bytes as uint8 scales (no biases). The codes and scales are the
    same numbers (llama.cpp stores E2M1 values doubled with the scale halved: equal
    products)."""
    blocks = data.reshape(-1, 17)
    codes = blocks[:, 1:]
    q = np.concatenate([codes & 0xF, codes >> 4], axis=1).reshape(rows, cols)  # element order
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    return {f"{base}.weight": pack_stream(q, 4).reshape(*lead, -1),
            f"{base}.scales": np.ascontiguousarray(blocks[:, 0]).reshape(*lead, -1)}


StoreBits = Union[Callable[[str, int, int, bool], int], None]


_INT_TYPES = {"I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _convert(name: str, kind: str, shape: list[int], rows: int, cols: int,
             raw: np.ndarray, store_bits: StoreBits = None, head: bool = False,
             compact: bool = False) -> dict[str, np.ndarray]:
    """One tensor's bytes -> its MLX array(s) (see the module docstring)."""
    if kind in FLOAT_TYPES:
        dt = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}[kind]
        return {name: np.frombuffer(raw, dtype=dt).reshape(shape)}  # BF16: bits
    if kind in _INT_TYPES:  # (index tables: an EAGLE-3 head's d2t)
        return {name: np.frombuffer(raw, dtype=_INT_TYPES[kind]).reshape(shape)}
    if kind == "MXFP4" and len(shape) >= 2:
        return _mxfp4(name, raw, rows, cols, tuple(shape[:-1]))
    if kind in _AFFINE:  # stacked (expert) tensors [E, rows, cols]: each row alike
        return _affine(name, kind, raw, rows, cols, tuple(shape[:-1]), store_bits, head, compact)
    from gguf import GGMLQuantizationType  # not affine: llama.cpp's reference dequantization
    from gguf.quants import dequantize

    values = dequantize(raw.reshape(rows, -1), GGMLQuantizationType[kind])  # IQ types, 1-D MXFP4
    return {name: values.astype(np.float32).reshape(shape)}


_ST_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.uint32): "U32",
              np.dtype(np.int16): "I16", np.dtype(np.uint8): "U8", np.dtype(np.uint16): "BF16",
              np.dtype(np.int8): "I8", np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}


def _write_safetensors(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """numpy arrays -> one safetensors file (the format mx.load reads lazily); uint16 arrays
    are a GGUF's BF16 bits. Written straight from numpy: no MLX allocation."""
    import json

    header: dict[str, Any] = {}
    at = 0
    for name, a in arrays.items():
        n = a.nbytes
        header[name] = {"dtype": _ST_DTYPES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + n]}
        at += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for a in arrays.values():
            f.write(np.ascontiguousarray(a).data)


# llama.cpp's shard names (llama_split_path): "%s-%05d-of-%05d.gguf"
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)


def _split_count(header: "_Header") -> tuple[int, int]:
    meta = header.metadata
    count = int(meta.get("split.count", 1))
    return int(meta.get("split.no", 0)), max(count, 1)


def _shard_paths(path: Path, header: "_Header") -> list[Path]:
    """Every shard of the split GGUF whose first shard is `path` ([path] if not split)."""
    no, count = _split_count(header)
    if count == 1:
        return [path]
    m = _SHARD.match(path.name)
    if no != 0:
        first = f"{m['prefix']}-00001-of-{m['count']}.gguf" if m else "its first shard"
        raise WeightsError(f"{path}: this is shard {no + 1} of {count} of a split GGUF; load "
                           f"the first shard ({first}), which holds the model's metadata")
    if m is None or int(m["count"]) != count:
        raise WeightsError(f"{path}: a split GGUF (split.count = {count}) must be named as "
                           f"llama.cpp's gguf-split names it (PREFIX-00001-of-{count:05d}.gguf) "
                           "so its other shards can be found")
    paths = [path.with_name(f"{m['prefix']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [q.name for q in paths if not q.is_file()]
    if missing:
        raise WeightsError(f"{path}: split GGUF of {count} shards, missing: {', '.join(missing)} "
                           f"(expected beside it in {path.parent})")
    return paths


def gguf_files(path: str | Path) -> list[Path]:
    """The files a GGUF model is read from: its shards in order for a split file's first
    shard (errors name a missing shard), else the file itself."""
    path = Path(path)
    return _shard_paths(path, _Header(path))


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """A GGUF file's metadata (its first shard's header), no tensor read."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such file")
    return _Header(path).metadata


def read_gguf_tensor_names(path: str | Path) -> list[str]:
    """The tensor names of a GGUF file's first shard (its header only)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such file")
    return [t[0] for t in _Header(path).tensors]


def read_gguf(path: str | Path, store_bits: StoreBits = None, compact: bool = False,
              spill: str | Path | None = None,
              only: Callable[[str], bool] | None = None) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """(tensors, metadata) of a GGUF file; see the module docstring for the representation.
    store_bits(name, group, bits, is_head) -> the width to pack each affine tensor's integers in (None:
    its own; the loader widens what the CPU kernels do not run (2, 3 bits) here, in numpy,
    rather than unpacking and repacking later). compact: scales and biases of 2-D tensors
    in the native kernels' compact forms (see `_affine`; the same values). spill: a folder
    where each converted tensor is written (safetensors) and freed at once, each tensor's
    bytes read with pread rather than mapped: the arrays come back lazy (mx.load), so a
    sharded load reads back only what its rank keeps (peak memory ~ its shard plus one
    tensor's conversion, not the whole model). only: read just the tensors whose GGUF name
    it accepts (e.g. a checkpoint's MTP layers)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such file")
    first = _Header(path)
    paths = _shard_paths(path, first)
    headers = [first] + [_Header(q) for q in paths[1:]]
    for i, (q, h) in enumerate(zip(paths, headers)):
        if _split_count(h) != (i, len(paths)):
            raise WeightsError(f"{q}: expected shard {i + 1} of {len(paths)} (split.no = {i}), its "
                               f"header says split.no = {_split_count(h)[0]}, split.count = {_split_count(h)[1]}")
    want = int(first.metadata.get("split.tensors.count", 0))
    got = sum(len(h.tensors) for h in headers)
    if len(paths) > 1 and want and want != got:
        raise WeightsError(f"{path}: split GGUF declares {want} tensors (split.tensors.count), "
                           f"its {len(paths)} shards hold {got}")
    jobs = []
    for k, (shard, header) in enumerate(zip(paths, headers)):
        jobs += _shard_jobs(shard, k, header, spill is not None)
    if len({job[0] for job in jobs}) != len(jobs):
        raise WeightsError(f"{path}: a tensor name appears twice across the file's shards")
    if only is not None:
        jobs = [job for job in jobs if only(job[0])]
    tensors = _convert_all(paths, jobs, store_bits, compact, spill)
    return tensors, first.metadata


def _shard_jobs(path: Path, k: int, header: "_Header", spilled: bool) -> list[tuple]:
    """One conversion job per tensor of shard k: (name, kind, shape, rows, cols, source),
    source its bytes (a memmap slice) or, when spilled, (k, start, end) to pread."""
    data = np.memmap(path, dtype=np.uint8, mode="r") if header.size and not spilled else np.zeros(0, np.uint8)
    jobs = []
    for name, shape, type_id, offset in header.tensors:
        kind, block, nbytes = GGML_TYPES.get(type_id, (f"type {type_id}", 0, 0))
        known = FLOAT_TYPES + AFFINE_TYPES + DEQUANTIZED_TYPES + MX_TYPES + tuple(_INT_TYPES)
        if kind not in known:
            raise WeightsError(
                f"{path}: tensor '{name}' has GGML type {kind}, which fx-engine cannot read "
                f"(supported: {', '.join(known)})")
        cols = shape[-1]
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        if cols % block:
            raise WeightsError(f"{path}: tensor '{name}' ({kind}): row length {cols} is not a "
                               f"multiple of its block of {block}")
        start = header.data_start + offset
        end = start + rows * cols // block * nbytes
        if end > header.size:
            raise WeightsError(f"{path}: cannot read weights: the file is truncated (tensor "
                               f"'{name}' needs bytes up to {end}, the file has {header.size})")
        jobs.append((name, kind, shape, rows, cols, (k, start, end) if spilled else data[start:end]))
    return jobs


def _convert_all(paths: list[Path], jobs: list[tuple], store_bits: StoreBits, compact: bool,
                 spill: str | Path | None) -> dict[str, mx.array]:
    """Every job's tensor(s) as MLX arrays, converted on a thread per core."""
    # Tensors convert independently and numpy releases the GIL in its loops: a thread per
    # core (2 cores: a 517 MiB K-quant file's conversion 8.5 -> 4.5 s, docs/benchmarks-archive.md).
    from concurrent.futures import ThreadPoolExecutor

    workers = max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))
    tensors: dict[str, mx.array] = {}
    names = {job[0] for job in jobs}
    head = "output.weight" if "output.weight" in names else "token_embd.weight"
    if spill is None:
        def run(job: tuple) -> dict[str, Any]:
            return {k: mx.array(v) for k, v in _convert(*job, store_bits, job[0] == head, compact).items()}
    else:
        folder = Path(spill)
        folder.mkdir(parents=True, exist_ok=True)
        try:  # mx.load keeps each file open until its arrays are read: one per tensor
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            want = len(jobs) + 256
            if soft != resource.RLIM_INFINITY and soft < want:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY
                                                            else min(want, hard), hard))
        except (ImportError, ValueError, OSError):
            pass
        fds = [os.open(q, os.O_RDONLY) for q in paths]

        def run(job: tuple) -> dict[str, Any]:
            name, kind, shape, rows, cols, (k, start, end) = job
            raw = np.empty(end - start, np.uint8)  # (pread returns at most ~2 GiB per call)
            done = 0
            while done < raw.size:
                got = os.preadv(fds[k], [memoryview(raw)[done:]], start + done)
                if got <= 0:
                    raise WeightsError(f"{paths[k]}: cannot read weights: tensor '{name}' ends past the file")
                done += got
            out = folder / f"{name}.safetensors"  # (GGUF tensor names are unique)
            _write_safetensors(out, _convert(name, kind, shape, rows, cols, raw, store_bits, name == head, compact))
            return {"": out}
    try:
        with ThreadPoolExecutor(workers) as pool:
            for part in pool.map(run, jobs):
                if spill is None:
                    tensors.update(part)
                else:
                    tensors.update(mx.load(str(part[""])))  # lazy: read when evaluated
    finally:
        if spill is not None:
            for fd in fds:
                os.close(fd)
    for name, kind, *_ in jobs:  # MLX ops need this thread's stream: reinterpret here
        if kind == "BF16" and spill is None:
            tensors[name] = tensors[name].view(mx.bfloat16)
    return tensors
