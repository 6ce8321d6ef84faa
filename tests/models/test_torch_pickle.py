"""fx_engine.loading.torch_pickle: PyTorch's zip checkpoints read without torch.

No torch here, so the files are written by `_torch_save` below, which emits what
torch/serialization.py's `_save` writes (torch is not a dependency of the tests): a zip of
`<stem>/data.pkl` (protocol 2; each tensor reduced to
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad,
OrderedDict())`, each storage a persistent id `("storage", torch.<Kind>Storage, key,
"cpu", numel)`), `<stem>/data/<key>` (the storage's little-endian bytes), `<stem>/byteorder`
and `<stem>/version`. The head folder round trip compares against the same tensors from
safetensors; hostile pickles must fail without running anything."""

from __future__ import annotations

import collections
import io
import json
import pickle
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from fx_engine.core.checkpoint import WeightsError
from fx_engine.loading.drafter import load_eagle3_head, read_head_folder
from fx_engine.loading.torch_pickle import read_torch_checkpoint
from fx_engine.testing.eagle3 import tiny_eagle3_config, tiny_eagle3_tensors

_KIND = {np.dtype(np.float32): "FloatStorage", np.dtype(np.float16): "HalfStorage", np.dtype(np.int64): "LongStorage",
         np.dtype(np.bool_): "BoolStorage", np.dtype(np.int32): "IntStorage", np.dtype(np.float64): "DoubleStorage"}


class _Global:
    """A global the pickle names (written as GLOBAL module\\nname, as pickling torch's would)."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def __call__(self, *args):  # (pickle's save_reduce wants a callable; never called)
        raise AssertionError("a marker of a global is not called")


class _Storage:
    def __init__(self, key: str, kind: str, data: bytes, numel: int) -> None:
        self.key, self.kind, self.data, self.numel = key, kind, data, numel


class _Tensor:
    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.args = (storage, offset, size, stride)

    def __reduce__(self):  # torch.Tensor._reduce_ex_internal's CPU case
        storage, offset, size, stride = self.args
        return (_Global("torch._utils", "_rebuild_tensor_v2"),
                (storage, offset, size, stride, False, collections.OrderedDict()))


class _Pickler(pickle._Pickler):  # the pure-Python pickler: its save_global can be taught _Global
    dispatch = dict(pickle._Pickler.dispatch)

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            return ("storage", _Global("torch", obj.kind), obj.key, "cpu", obj.numel)
        return None

    def save_global_marker(self, obj):
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())
        self.memoize(obj)

    dispatch[_Global] = save_global_marker


def _tensor(a: np.ndarray, key: str, *, bf16: bool = False) -> tuple[_Tensor, _Storage]:
    a = np.ascontiguousarray(a)
    if bf16:  # bfloat16: the top half of each float32
        raw = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        st = _Storage(key, "BFloat16Storage", raw.tobytes(), raw.size)
    else:
        st = _Storage(key, _KIND[a.dtype], a.tobytes(), a.size)
    stride = tuple(s // a.itemsize for s in a.strides) if a.ndim else ()
    return _Tensor(st, 0, a.shape, stride), st


def _torch_save(state: dict, path: Path, storages: list[_Storage]) -> None:
    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(state)
    stem = path.stem
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{stem}/data.pkl", buf.getvalue())
        z.writestr(f"{stem}/byteorder", "little")
        for st in storages:
            z.writestr(f"{stem}/data/{st.key}", st.data)
        z.writestr(f"{stem}/version", "3\n")


def _save_tensors(tensors: dict[str, mx.array], path: Path) -> None:
    state, storages = collections.OrderedDict(), []
    for i, (name, t) in enumerate(tensors.items()):
        bf16 = t.dtype == mx.bfloat16
        a = np.array(t.astype(mx.float32)) if bf16 else np.array(t)
        state[name], st = _tensor(a, str(i), bf16=bf16)
        storages.append(st)
    _torch_save(state, path, storages)


def test_a_head_from_pytorch_model_bin_equals_its_safetensors(tmp_path):
    """yuhuili's layout: config.json + pytorch_model.bin (float16 weights, int64 d2t, bool
    t2d, one bfloat16 tensor); the same head from safetensors gives the same tensors, and
    the loader builds the same params. A sharded pair (pytorch_model.bin.index.json) too."""
    cfg = tiny_eagle3_config(24)
    tensors = tiny_eagle3_tensors(cfg, dtype="float16")
    tensors["norm.weight"] = tensors["norm.weight"].astype(mx.bfloat16)
    st, pt = tmp_path / "st", tmp_path / "pt"
    for d in (st, pt):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(st / "model.safetensors"), tensors)
    _save_tensors(tensors, pt / "pytorch_model.bin")
    _, want = read_head_folder(st)
    _, got = read_head_folder(pt)
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert mx.array_equal(got[name], want[name]).item(), name
    a, b = load_eagle3_head(st), load_eagle3_head(pt)
    assert mx.array_equal(a.lm_head.weight, b.lm_head.weight).item() and mx.array_equal(a.d2t, b.d2t).item()

    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    halves = {"pytorch_model-00001-of-00002.bin": names[::2], "pytorch_model-00002-of-00002.bin": names[1::2]}
    for file, part in halves.items():
        _save_tensors({n: tensors[n] for n in part}, shards / file)
    (shards / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in halves.items() for n in part}}))
    _, sharded = read_head_folder(shards)
    assert all(mx.array_equal(sharded[n], want[n]).item() for n in want) and set(sharded) == set(want)


def test_strided_views_offsets_and_shared_storages(tmp_path):
    """Two tensors of one storage (an offset slice and a transposed view) and nested dicts:
    as numpy's strided views of the same bytes."""
    base = np.arange(24, dtype=np.float32)
    st = _Storage("0", "FloatStorage", base.tobytes(), base.size)
    state = collections.OrderedDict(
        a=_Tensor(st, 4, (2, 3), (3, 1)),  # base[4:10].reshape(2, 3)
        inner=collections.OrderedDict(t=_Tensor(st, 0, (4, 6), (1, 4))),  # base.reshape(6, 4).T
    )
    _torch_save(state, tmp_path / "m.bin", [st])
    got = read_torch_checkpoint(tmp_path / "m.bin")
    np.testing.assert_array_equal(np.array(got["a"]), base[4:10].reshape(2, 3))
    np.testing.assert_array_equal(np.array(got["inner.t"]), base.reshape(6, 4).T)
    bad = collections.OrderedDict(x=_Tensor(st, 20, (2, 3), (3, 1)))  # runs past the 24 values
    _torch_save(bad, tmp_path / "bad.bin", [st])
    with pytest.raises(WeightsError, match="outside its storage"):
        read_torch_checkpoint(tmp_path / "bad.bin")


class _Hostile:
    def __reduce__(self):
        return (_Global("os", "system"), ("touch /tmp/fx-engine-pwned",))


def test_a_pickle_naming_other_globals_is_refused_and_not_run(tmp_path):
    marker = Path("/tmp/fx-engine-pwned")
    marker.unlink(missing_ok=True)
    _torch_save(collections.OrderedDict(w=_Hostile()), tmp_path / "evil.bin", [])
    with pytest.raises(WeightsError, match="names os.system"):
        read_torch_checkpoint(tmp_path / "evil.bin")
    assert not marker.exists()
    (tmp_path / "legacy.bin").write_bytes(pickle.dumps({"w": 1}))  # not a zip: the pre-1.6 format
    with pytest.raises(WeightsError, match="legacy format"):
        read_torch_checkpoint(tmp_path / "legacy.bin")
    st = _Storage("0", "FloatStorage", np.zeros(2, np.float32).tobytes(), 2)
    _torch_save(collections.OrderedDict(step=3, w=_Tensor(st, 0, (2,), (1,))), tmp_path / "mixed.bin", [st])
    with pytest.raises(WeightsError, match="'step' is a int, not a tensor"):
        read_torch_checkpoint(tmp_path / "mixed.bin")
