"""Frozen attrs classes as pytrees, and a compile wrapper keyed on the full static structure.

Why this exists: `mx.compile` accepts only lists/tuples/dicts of arrays, rejects attrs
instances as inputs and returns stale trace-time objects as outputs. Worse, its cache key
ignores container lengths and list-vs-tuple, so two different structures can silently share
one compiled entry (measured: a wrong result, no error). We flatten every argument into a
flat list of array leaves plus a hashable *treedef* (types, field names, static values,
container lengths) and key each compiled function on that treedef.

Convention: an attrs field is an array leaf unless declared with `static_field()`; static
fields (ints, strings, tuples of ints, dtypes, ...) become part of the treedef and therefore
of the compile key.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

import attrs
import mlx.core as mx

STATIC = "fx_static"


def static_field(**kwargs: Any) -> Any:
    """An attrs field that is compile-time metadata rather than an array leaf."""
    metadata = dict(kwargs.pop("metadata", {}) or {})
    metadata[STATIC] = True
    return attrs.field(metadata=metadata, **kwargs)


def _is_static(field: attrs.Attribute) -> bool:
    return bool(field.metadata.get(STATIC, False))


# A treedef is a nested tuple of hashable node descriptions:
#   ("leaf",) | ("none",) | ("const", value) | ("list", (children...)) | ("tuple", ...)
#   | ("dict", keys, children) | ("attrs", cls, leaf_names, static_items, children)
TreeDef = tuple


def tree_flatten(tree: Any) -> tuple[list[mx.array], TreeDef]:
    leaves: list[mx.array] = []
    treedef = _flatten(tree, leaves)
    return leaves, treedef


class _HashedTreeDef(tuple):
    """A treedef that computes its hash once (a plain tuple rehashes every node on every
    lookup): memoized subtrees (the params) and each call's whole key, which the compile
    wrapper looks up twice."""

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = tuple.__hash__(self)
        return h


# Immutable trees that are flattened on every step (model params: hundreds of leaves) can
# opt in to memoized flattening with a class attribute `__fx_memo_flatten__ = True`.
_MEMO: dict[int, tuple[Any, list[mx.array], TreeDef]] = {}

# Per attrs class: (leaf field names, static field names, memoized?), read once: a step
# flattens the same few classes hundreds of times (a cache's entries, a state's fields).
_KINDS: dict[type, tuple[tuple[str, ...], tuple[str, ...], bool] | None] = {}


def _kind(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], bool] | None:
    k = _KINDS.get(cls, False)
    if k is False:
        if attrs.has(cls):
            fields = attrs.fields(cls)
            k = (tuple(f.name for f in fields if not _is_static(f)),
                 tuple(f.name for f in fields if _is_static(f)),
                 bool(getattr(cls, "__fx_memo_flatten__", False)))
        else:
            k = None
        _KINDS[cls] = k
    return k


def _flatten(node: Any, leaves: list[mx.array]) -> TreeDef:
    if isinstance(node, mx.array):
        leaves.append(node)
        return ("leaf",)
    if node is None:
        return ("none",)
    kind = _kind(type(node))
    if kind is None:
        return _flatten_other(node, leaves)
    if kind[2]:
        hit = _MEMO.get(id(node))
        if hit is not None and hit[0]() is node:
            leaves.extend(hit[1])
            return hit[2]
        sub: list[mx.array] = []
        td = _HashedTreeDef(_flatten_attrs(node, sub, kind))
        _MEMO[id(node)] = (weakref.ref(node, lambda _, k=id(node): _MEMO.pop(k, None)), sub, td)
        leaves.extend(sub)
        return td
    return _flatten_attrs(node, leaves, kind)


def _flatten_attrs(node: Any, leaves: list[mx.array], kind: tuple) -> TreeDef:
    dynamic, static_names, _ = kind
    static = tuple((name, _freeze(getattr(node, name))) for name in static_names)
    children = tuple(_flatten(getattr(node, name), leaves) for name in dynamic)
    return ("attrs", type(node), dynamic, static, children)


def _flatten_other(node: Any, leaves: list[mx.array]) -> TreeDef:
    if isinstance(node, tuple) and hasattr(node, "_fields"):  # NamedTuple
        children = tuple(_flatten(x, leaves) for x in node)
        return ("namedtuple", type(node), children)
    if isinstance(node, (list, tuple)):
        kind = "list" if isinstance(node, list) else "tuple"
        return (kind, tuple(_flatten(x, leaves) for x in node))
    if isinstance(node, dict):
        keys = tuple(sorted(node))
        return ("dict", keys, tuple(_flatten(node[k], leaves) for k in keys))
    if isinstance(node, (bool, int, float, str)):
        # Python scalars are compile-time constants: they belong to the key, never to leaves.
        return ("const", type(node), node)
    raise TypeError(
        f"tree_flatten: unsupported node of type {type(node).__name__}; use mx.array, "
        "attrs classes, NamedTuple, list, tuple, dict, None or a Python scalar"
    )


_FROZEN_TYPES = (int, float, str, bool, type(None))


def _freeze(value: Any) -> Any:
    """Make a static value hashable (lists become tuples, dicts sorted item tuples)."""
    if isinstance(value, mx.array):
        raise TypeError("an mx.array cannot be a static field; declare it as a leaf")
    if type(value) is tuple and all(isinstance(v, _FROZEN_TYPES) or _kind(type(v)) is not None
                                    for v in value):
        return value  # (already hashable: scalars, attrs instances, e.g. a cache's layout)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return frozenset(value)
    return value


def tree_unflatten(treedef: TreeDef, leaves: list[mx.array]) -> Any:
    it = iter(leaves)
    out = _unflatten(treedef, it)
    rest = list(it)
    if rest:
        raise ValueError(f"tree_unflatten: {len(rest)} leaves left over")
    return out


_SET = object.__setattr__


def _unflatten(td: TreeDef, it: Any) -> Any:
    kind = td[0]
    if kind == "leaf":
        return next(it)
    if kind == "none":
        return None
    if kind == "const":
        return td[2]
    if kind == "attrs":
        _, cls, dynamic, static, children = td
        # Bypass validators/converters: leaves inside a trace are tracers.
        obj = object.__new__(cls)
        for name, c in zip(dynamic, children):
            _SET(obj, name, _unflatten(c, it))
        for name, value in static:
            _SET(obj, name, value)
        return obj
    if kind == "namedtuple":
        return td[1](*(_unflatten(c, it) for c in td[2]))
    if kind in ("list", "tuple"):
        items = [_unflatten(c, it) for c in td[1]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _unflatten(c, it) for k, c in zip(td[1], td[2])}
    raise ValueError(f"bad treedef node {kind!r}")


def tree_leaves(tree: Any) -> list[mx.array]:
    return tree_flatten(tree)[0]


def tree_map(fn: Callable[[mx.array], mx.array], tree: Any) -> Any:
    leaves, td = tree_flatten(tree)
    return tree_unflatten(td, [fn(x) for x in leaves])


def tree_replace(obj: Any, **changes: Any) -> Any:
    """attrs.evolve without running validators (safe on tracer leaves)."""
    values = {f.name: getattr(obj, f.name) for f in attrs.fields(type(obj))}
    values.update(changes)
    new = object.__new__(type(obj))
    for name, value in values.items():
        object.__setattr__(new, name, value)
    return new


_TRACES = [0]  # every CompiledFunction's traces, together


def total_traces() -> int:
    """How many traces (compiles) every CompiledFunction made so far: a timing that saw this
    number change measured a compile, not the steady state."""
    return _TRACES[0]


class CompiledFunction:
    """`mx.compile` keyed on the full static structure of the arguments.

    One underlying `mx.compile` per distinct input treedef, so MLX's own key (shapes,
    dtypes, constants) is only ever asked to separate calls that already share a structure.
    `trace_log` records every trace with the treedef and array signature that caused it,
    which is how tests and tools/trace.py count recompiles; `trace_hooks` observe traces.

    prepare: called as prepare(args, kwargs) -> (args, kwargs) before the arguments are
    flattened (the public steps convert token lists to arrays there, `jit` Python scalars),
    so what it converts is traced as an input instead of keyed as a constant.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None, compile: bool = True,
                 prepare: Callable[[tuple, dict], tuple[tuple, dict]] | None = None):
        self.fn = fn
        self.name = name or getattr(fn, "__name__", "fn")
        self.compile = compile
        self.prepare = prepare
        self._entries: dict[TreeDef, Callable[..., Any]] = {}
        self._out_treedefs: dict[TreeDef, TreeDef] = {}
        self._out_by_sig: dict[tuple, TreeDef] = {}
        self._shape_dependent: set[TreeDef] = set()
        self._ids: dict[TreeDef, int] = {}
        self.trace_log: list[dict[str, Any]] = []
        # Observers of traces, called as hook("start" | "end", trace_log entry): how tools
        # (fx_engine.tracing) timestamp compiles without the core reading a clock.
        self.trace_hooks: list[Callable[[str, dict[str, Any]], None]] = []
        self._lock = threading.Lock()

    @property
    def traces(self) -> int:
        return len(self.trace_log)

    def _make(self, in_td: TreeDef) -> Callable[..., Any]:
        def flat(*leaves: mx.array) -> list[mx.array]:
            args, kwargs = tree_unflatten(in_td, list(leaves))
            sig = _signature(leaves)
            entry = {"function": self.name, "structure_id": self._ids.setdefault(in_td, len(self._ids)),
                     "signature": sig, "treedef": in_td}
            self.trace_log.append(entry)
            _TRACES[0] += 1
            for hook in self.trace_hooks:
                hook("start", entry)
            out = self.fn(*args, **kwargs)
            for hook in self.trace_hooks:  # the Python trace is done; MLX compiles at first eval
                hook("end", entry)
            out_leaves, out_td = tree_flatten(out)
            # The output structure may depend on input shapes (e.g. a Python int derived
            # from a shape): keep one per (structure, shapes) once two ever differ.
            known = self._out_treedefs.get(in_td)
            if known is None or known == out_td:
                self._out_treedefs[in_td] = out_td
            else:
                self._shape_dependent.add(in_td)
            self._out_by_sig[(in_td, sig)] = out_td
            return out_leaves

        return mx.compile(flat) if self.compile else flat

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = bound_arguments(self.fn, args, kwargs)
        if self.prepare is not None:
            args, kwargs = self.prepare(args, kwargs)
        leaves, in_td = tree_flatten((args, kwargs))
        in_td = _HashedTreeDef(in_td)  # hashed once for the lookups below
        entry = self._entries.get(in_td)
        if entry is None:
            with self._lock:
                entry = self._entries.get(in_td)
                if entry is None:
                    entry = self._make(in_td)
                    self._entries[in_td] = entry
        out_leaves = entry(*leaves)
        if in_td in self._shape_dependent:
            out_td = self._out_by_sig[(in_td, _signature(leaves))]
        else:
            out_td = self._out_treedefs[in_td]
        return tree_unflatten(out_td, list(out_leaves))

    def structures(self) -> int:
        return len(self._entries)


def bound_arguments(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A call's arguments in one canonical form: every positional parameter by position
    (keywords moved there), defaults applied, keyword-only ones as keywords. So equal calls
    (`f(p, c, s)`, `f(p, c, s, mask=None)`, `f(p, c, s, None)`) have one structure and share
    one trace. Calls it cannot bind (missing or unknown arguments, *args/**kwargs
    functions, callables without code) are returned unchanged: the function raises as usual.
    (Without `inspect`: the core's import rules.)"""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_flags & 0x0C:  # CO_VARARGS | CO_VARKEYWORDS
        return args, kwargs
    names = code.co_varnames[: code.co_argcount]
    kwonly = code.co_varnames[code.co_argcount: code.co_argcount + code.co_kwonlyargcount]
    if len(args) > len(names):
        return args, kwargs
    bound = dict(zip(names, args))
    defaults = getattr(fn, "__defaults__", None) or ()
    first_default = len(names) - len(defaults)
    for k, v in kwargs.items():
        if k in bound or (k not in names and k not in kwonly):
            return args, kwargs
        bound[k] = v
    for i, n in enumerate(names):
        if n not in bound:
            if i < first_default:
                return args, kwargs  # a required argument is missing
            bound[n] = defaults[i - first_default]
    kwdefaults = getattr(fn, "__kwdefaults__", None) or {}
    kw = {}
    for n in kwonly:
        if n in bound:
            kw[n] = bound[n]
        elif n in kwdefaults:
            kw[n] = kwdefaults[n]
        else:
            return args, kwargs
    return tuple(bound[n] for n in names), kw


def _signature(leaves: Any) -> tuple:
    return tuple((tuple(x.shape), str(x.dtype)) for x in leaves)


def _arg_positions(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of fn's positional parameters (without `inspect`: the core's import rules)."""
    code = getattr(fn, "__code__", None)
    return tuple(code.co_varnames[: code.co_argcount]) if code is not None else ()


def scalars_as_arrays(fn: Callable[..., Any], static_argnums: tuple[int, ...] = (),
                      static_argnames: tuple[str, ...] = ()) -> Callable[[tuple, dict], tuple[tuple, dict]]:
    """`jit`'s prepare hook: top-level Python int / float arguments become 0-d arrays (int32,
    float32) unless declared static by position or name; bools, strings and None stay
    compile-time constants."""
    names = _arg_positions(fn)
    static_pos = {i for i in static_argnums} | {i for i, n in enumerate(names) if n in static_argnames}
    static_kw = set(static_argnames) | {names[i] for i in static_argnums if i < len(names)}

    def traced(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    def convert(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args = tuple(mx.array(a) if traced(a) and i not in static_pos else a for i, a in enumerate(args))
        kwargs = {k: mx.array(v) if traced(v) and k not in static_kw else v for k, v in kwargs.items()}
        return args, kwargs

    return convert


def jit(fn: Callable[..., Any] | None = None, *, name: str | None = None,
        static_argnums: int | tuple[int, ...] = (), static_argnames: str | tuple[str, ...] = ()) -> Any:
    """Compile a function of pytrees (params, caches, states, arrays): a `CompiledFunction`
    keyed on the arguments' full static structure, usable as `@jit` or `@jit(...)`.

    The rule for Python scalars: a top-level int or float argument is traced as a 0-d
    array (int32 / float32), so `guided(p, cache, state, 1.5)` and `(..., 3.0)` share one
    compile. Arguments the function needs as Python values (a shape, a loop count, a
    step's `span`) are declared static: `static_argnums=(3,)` or `static_argnames="span"`;
    each distinct static value then compiles once. bools, strings and None are always
    static; Python scalars nested inside containers or attrs fields are static too (declare
    attrs fields with `static_field()`, or pass arrays). `.traces` counts the compiles.
    """
    nums = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    names = (static_argnames,) if isinstance(static_argnames, str) else tuple(static_argnames)

    def wrap(f: Callable[..., Any]) -> CompiledFunction:
        return CompiledFunction(f, name=name, prepare=scalars_as_arrays(f, nums, names))

    return wrap if fn is None else wrap(fn)
