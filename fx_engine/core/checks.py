"""Argument checks of the public steps, run when a step is traced.

Why at trace time: under `mx.compile` every shape and dtype is static, so a check on them
runs once per compiled graph and costs nothing per step; eagerly it is a few Python
comparisons. A wrong input then fails with an error that names the argument and the
shape it must have, instead of a reshape or broadcast error deep inside the model.

Python values are converted where the meaning is unambiguous: token ids and counts given
as (nested) lists, tuples, numpy arrays or ints become int32 arrays, and a scalar count
applies to every row. The compiled forms convert them before flattening (`convert_args`),
so a list never becomes a compile-time constant (one compile per value).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import mlx.core as mx
import numpy as np

_INTS = (mx.int8, mx.int16, mx.int32, mx.int64, mx.uint8, mx.uint16, mx.uint32, mx.uint64)
_FLOATS = (mx.float16, mx.bfloat16, mx.float32)


def _shape(x: Any) -> str:
    return str(tuple(x.shape)) if hasattr(x, "shape") else type(x).__name__


def to_int_array(x: Any, name: str) -> mx.array:
    """`x` as an integer (or bool) mx.array; Python ints, (nested) lists/tuples of ints and
    integer numpy arrays are converted to int32. Anything else: a TypeError naming `name`."""
    if isinstance(x, mx.array):
        if x.dtype not in _INTS and x.dtype != mx.bool_:
            raise TypeError(f"{name} must hold integers (int32), got dtype {x.dtype}")
        return x
    if isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int or an integer array, got a bool")
    if isinstance(x, (int, np.integer, list, tuple, np.ndarray)):
        try:
            a = np.asarray(x)
        except ValueError as e:  # ragged nested lists
            raise ValueError(f"{name}: rows of different lengths ({e}); pad every row to one "
                             "length and pass the real counts separately") from None
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"{name} must hold integers, got {a.dtype} values")
        if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
            raise ValueError(f"{name} holds values outside int32")
        return mx.array(a.astype(np.int32))
    raise TypeError(f"{name} must be an mx.array of int32 (or a list of ints), got "
                    f"{type(x).__name__}")


def tokens_arg(tokens: Any, rows: int | None, name: str = "tokens") -> mx.array:
    """Token ids int32[B, T]: B = `rows` (the cache's rows) when given."""
    x = to_int_array(tokens, name)
    if x.dtype == mx.bool_:
        raise TypeError(f"{name} must hold token ids (int32), got dtype bool")
    if x.ndim != 2:
        hint = "; one row of ids is [ids]" if x.ndim == 1 else ""
        raise ValueError(f"{name} must be int32[B, T] (rows x tokens per row), got shape "
                         f"{_shape(x)}{hint}")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name} has {x.shape[0]} rows but the cache has {rows}: expected "
                         f"shape [{rows}, T], got {_shape(x)}")
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def counts_arg(n: Any, rows: int, name: str = "n_valid") -> mx.array:
    """A per-row count int32[B] (bool arrays count 0/1; a scalar applies to every row)."""
    x = to_int_array(n, name)
    if x.ndim == 0:
        x = mx.broadcast_to(x, (rows,))
    if tuple(x.shape) != (rows,):
        raise ValueError(f"{name} must be int32[B] with B = {rows} (one count per row), got "
                         f"shape {_shape(x)}")
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def float_arg(x: Any, shape: tuple[int | None, ...], name: str, what: str) -> mx.array:
    """A float array of the given shape (None: any size on that axis); `what` describes it
    in the error, e.g. "f32[B, V]"."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{name} must be an mx.array {what}, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a float array {what}, got dtype {x.dtype}")
    _check_shape(x, shape, name, what)
    return x


def mask_arg(mask: Any, lead: tuple[int, ...], vocab: int | None, name: str = "mask") -> mx.array:
    """An allowed-token bitmask int32[*lead, W], W >= ceil(V / 32) when V is known."""
    if not isinstance(mask, mx.array):
        raise TypeError(f"{name} must be an mx.array of int32 words [{', '.join(map(str, lead))}, W],"
                        f" got {type(mask).__name__}")
    if mask.dtype not in _INTS:
        raise TypeError(f"{name} must hold int32 or uint32 words, got dtype {mask.dtype}")
    what = f"int32[{', '.join(map(str, lead))}, W]"
    _check_shape(mask, (*lead, None), name, what)
    if vocab is not None and mask.shape[-1] * 32 < vocab:
        raise ValueError(f"{name} has {mask.shape[-1]} words per row, fewer than the "
                         f"{(vocab + 31) // 32} that {vocab} tokens need")
    return mask


def span_arg(span: Any, tokens: int, capacity: int) -> int | None:
    """The static attention span: None, or an int with tokens <= span <= capacity."""
    if span is None:
        return None
    if isinstance(span, bool) or not isinstance(span, (int, np.integer)):
        raise TypeError(f"span must be a Python int (static) or None, got {type(span).__name__}")
    if not tokens <= span <= capacity:
        raise ValueError(f"span must lie in [{tokens}, {capacity}] (the step's tokens per row, "
                         f"the cache's capacity), got {span}")
    return int(span)


def _check_shape(x: mx.array, shape: tuple[int | None, ...], name: str, what: str) -> None:
    ok = x.ndim == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
    if not ok:
        raise ValueError(f"{name} must be {what}, got shape {_shape(x)}")


def convert_args(positions: Mapping[int, str]) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """A `CompiledFunction` prepare hook: the arguments at these positions (or passed by
    these names) that are Python ints, lists, tuples or numpy arrays become int32 arrays
    before the call is flattened, so they are traced as inputs, not compile constants."""
    names = {v: k for k, v in positions.items()}

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if any(i < len(args) and not isinstance(args[i], mx.array) for i in positions):
            args = tuple(to_int_array(a, positions[i]) if i in positions and a is not None
                         else a for i, a in enumerate(args))
        if any(k in names and not isinstance(v, mx.array) for k, v in kwargs.items()):
            kwargs = {k: to_int_array(v, k) if k in names and v is not None else v
                      for k, v in kwargs.items()}
        return args, kwargs

    return convert
