"""PyTorch checkpoints (`torch.save`'s zip format: pytorch_model.bin, *.pt) read without
torch and without running their pickles' code.

Why: the most used EAGLE-3 heads (yuhuili/EAGLE3-*, AngelSlim's) ship only a
pytorch_model.bin. Unpickling such a file with `pickle` would import and call whatever its
opcodes name; here only what a tensor state dict is made of is allowed (the same set
`torch.load(weights_only=True)` allows for tensors):

* `collections.OrderedDict` (state dicts and the tensors' empty backward-hook dicts),
* `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[,
  metadata])` and `torch._utils._rebuild_parameter(tensor, requires_grad, hooks)`,
* the typed storage classes (`torch.FloatStorage`, `torch.HalfStorage`, ...) named by each
  storage's persistent id `("storage", <class>, key, location, numel)`, whose bytes are the
  archive's `<prefix>/data/<key>` (little-endian, as torch writes on every platform it
  supports; the archive's `byteorder` record says so when present).

Any other global is an error naming it; so is the legacy (pre-1.6, not zip) format. The
layout is torch/serialization.py's `_save` (persistent_id) and torch/_utils.py's
`_rebuild_tensor_v2`.
"""

from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from fx_engine.core.checkpoint import WeightsError

__all__ = ["read_torch_checkpoint"]

# typed storage class -> (numpy dtype of its bytes, the mlx dtype it becomes)
_STORAGES = {
    "FloatStorage": (np.float32, mx.float32), "HalfStorage": (np.float16, mx.float16),
    "BFloat16Storage": (np.uint16, mx.bfloat16), "DoubleStorage": (np.float64, mx.float32),
    "LongStorage": (np.int64, mx.int64), "IntStorage": (np.int32, mx.int32),
    "ShortStorage": (np.int16, mx.int16), "CharStorage": (np.int8, mx.int8),
    "ByteStorage": (np.uint8, mx.uint8), "BoolStorage": (np.bool_, mx.bool_),
}


class _Storage:
    """A storage the pickle refers to: its class's dtypes and its bytes' record."""

    def __init__(self, kind: str, key: str) -> None:
        self.np_dtype, self.mx_dtype = _STORAGES[kind]
        self.key = key


class _Tensor:
    """A tensor the pickle rebuilt: a strided view of a storage, read after unpickling."""

    def __init__(self, storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, tuple(size), tuple(stride)


def _rebuild_tensor_v2(storage: _Storage, offset: int, size: Any, stride: Any, *_: Any) -> _Tensor:
    if not isinstance(storage, _Storage):
        raise WeightsError(f"a tensor's storage is {type(storage).__name__}, not a saved storage")
    return _Tensor(storage, int(offset), tuple(size), tuple(stride))


def _rebuild_parameter(data: _Tensor, *_: Any) -> _Tensor:
    return data


_ALLOWED = {("collections", "OrderedDict"): collections.OrderedDict,
            ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
            ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in _STORAGES:
            return name  # (the persistent id carries it; only its name is needed)
        raise WeightsError(f"{self.where}: the pickle names {module}.{name}, which a tensor checkpoint does not "
                           "use; it is not run (only tensors and state dicts are read)")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in _STORAGES):
            raise WeightsError(f"{self.where}: unsupported storage record {pid!r:.120}")
        return _Storage(pid[1], str(pid[2]))


def _array(t: _Tensor, raw: bytes, where: str, name: str) -> mx.array:
    """The tensor's values (a copy, C-contiguous) from its storage's bytes."""
    dt = np.dtype(t.storage.np_dtype)
    flat = np.frombuffer(raw, dtype=dt)
    need = t.offset + (sum((s - 1) * st for s, st in zip(t.size, t.stride)) + 1 if all(t.size) else 0)
    if any(s < 0 for s in t.size + t.stride) or need > flat.size:
        raise WeightsError(f"{where}: tensor '{name}' ({t.size}, stride {t.stride}, offset {t.offset}) lies "
                           f"outside its storage of {flat.size} values")
    view = np.lib.stride_tricks.as_strided(flat[t.offset:], shape=t.size,
                                           strides=tuple(st * dt.itemsize for st in t.stride))
    a = np.ascontiguousarray(view)
    if t.storage.mx_dtype == mx.bfloat16:
        return mx.array(a).view(mx.bfloat16)
    return mx.array(a).astype(t.storage.mx_dtype) if a.dtype == np.float64 else mx.array(a)


def read_torch_checkpoint(path: str | Path) -> dict[str, mx.array]:
    """The tensors of a `torch.save`d state dict (name -> array; nested dicts' names joined
    with "."), in their stored dtypes (float64 as float32). WeightsError names what is
    wrong: not a zip archive (the legacy format), a global other than a state dict's, a
    value that is not a tensor, a tensor outside its storage."""
    path = Path(path)
    where = str(path)
    if not zipfile.is_zipfile(path):
        raise WeightsError(f"{where}: not a zip archive (torch.save's legacy format, before PyTorch 1.6, is not "
                           "read: re-save it with a current torch, or convert it to safetensors)")
    with zipfile.ZipFile(path) as z:
        pkl = [n for n in z.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkl) != 1:
            raise WeightsError(f"{where}: expected one <archive>/data.pkl record, found {pkl or 'none'}")
        prefix = pkl[0][: -len("data.pkl")]
        order = z.read(prefix + "byteorder").decode().strip() if prefix + "byteorder" in z.namelist() else "little"
        if order != "little":
            raise WeightsError(f"{where}: byteorder {order!r}: only little-endian archives are read")
        try:
            obj = _Unpickler(z.read(pkl[0]), where).load()
        except WeightsError:
            raise
        except Exception as e:  # a malformed pickle: say which file
            raise WeightsError(f"{where}: cannot unpickle {pkl[0]} ({type(e).__name__}: {e})") from e
        flat: dict[str, _Tensor] = {}

        def walk(d: Any, pre: str) -> None:
            if not isinstance(d, dict):
                raise WeightsError(f"{where}: '{pre[:-1] or 'the checkpoint'}' is a {type(d).__name__}, not a "
                                   "tensor or a dict of tensors")
            for k, v in d.items():
                if isinstance(v, _Tensor):
                    flat[pre + str(k)] = v
                elif isinstance(v, dict):
                    walk(v, pre + str(k) + ".")
                else:
                    raise WeightsError(f"{where}: '{pre}{k}' is a {type(v).__name__}, not a tensor")

        walk(obj, "")
        raw: dict[str, bytes] = {}
        out = {}
        for name, t in flat.items():
            key = prefix + "data/" + t.storage.key
            if key not in raw:
                try:
                    raw[key] = z.read(key)
                except KeyError as e:
                    raise WeightsError(f"{where}: storage record {key} of tensor '{name}' is missing") from e
            out[name] = _array(t, raw[key], where, name)
    return out
