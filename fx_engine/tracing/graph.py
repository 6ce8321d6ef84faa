"""What a step function computes: its MLX graph, as data (node counts, primitives, DOT).

    g = step_graph("decode_step", model, Bucket(rows=4, capacity=512))
    g.num_ops, g.histogram(), g.inputs, g.outputs, g.dot
    graph_diff(g_before, g_after)

Two views of the same step:
  traced    the graph the pure function builds (every primitive as written);
  compiled  the graph after `mx.compile` simplified and fused it (elementwise chains become
            one `Compiled...` node): what actually runs.

The graph comes from `mx.export_to_dot` on the step's lazy outputs, with the inputs
evaluated first so that the graph starts at them. MLX names nodes by memory address; they
are renumbered in order of appearance, so the same step on the same bucket yields the same
DOT text, node counts and histogram in every run.

This module is a tool over the pure core (it imports no shell code).
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any, Callable

import attrs
import mlx.core as mx

from fx_engine.core.tree import TreeDef, tree_flatten

_PRIM = re.compile(r'^\{ (\d+) \[label ="([^"]+)", shape=rectangle\]; \}$')
_ARRAY = re.compile(r'^\{ (?:rank=\w+; )?"([^"]+)"; \}$')
_EDGE = re.compile(r'^("?)([^"\s]+)\1 -> ("?)([^"\s]+)\3$')


@attrs.frozen
class Leaf:
    """One input or output array: its path in the argument pytree, shape and dtype."""

    path: str
    shape: tuple[int, ...]
    dtype: str

    def __str__(self) -> str:
        return f"{self.path}: {self.dtype}{list(self.shape)}"


@attrs.frozen
class Graph:
    """A step's graph. `ops` lists the primitive of each operation node, in graph order."""

    name: str
    view: str  # "traced" | "compiled"
    ops: tuple[str, ...]
    num_arrays: int
    num_edges: int
    inputs: tuple[Leaf, ...]
    outputs: tuple[Leaf, ...]
    dot: str

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    @property
    def num_nodes(self) -> int:
        """Operations plus the arrays between them (DOT nodes)."""
        return len(self.ops) + self.num_arrays

    def histogram(self) -> dict[str, int]:
        """Primitive name -> count, most frequent first."""
        return dict(collections.Counter(self.ops).most_common())

    def summary(self) -> dict[str, Any]:
        return {"name": self.name, "view": self.view, "num_ops": self.num_ops,
                "num_nodes": self.num_nodes, "num_edges": self.num_edges,
                "histogram": self.histogram(),
                "inputs": [str(x) for x in self.inputs], "outputs": [str(x) for x in self.outputs]}


def leaf_paths(treedef: TreeDef, prefix: str = "") -> list[str]:
    """Names of a flattened pytree's leaves, in `tree_flatten` order (e.g. `cache.layers[2].k`)."""
    kind = treedef[0]
    if kind == "leaf":
        return [prefix or "<leaf>"]
    if kind in ("none", "const"):
        return []
    if kind == "attrs":
        _, _cls, dynamic, _static, children = treedef
        return [p for name, c in zip(dynamic, children) for p in leaf_paths(c, f"{prefix}.{name}" if prefix else name)]
    if kind == "namedtuple":
        _, cls, children = treedef
        return [p for name, c in zip(cls._fields, children) for p in leaf_paths(c, f"{prefix}.{name}" if prefix else name)]
    if kind in ("list", "tuple"):
        return [p for i, c in enumerate(treedef[1]) for p in leaf_paths(c, f"{prefix}[{i}]")]
    if kind == "dict":
        _, keys, children = treedef
        return [p for k, c in zip(keys, children) for p in leaf_paths(c, f"{prefix}[{k!r}]")]
    raise TypeError(f"leaf_paths: unknown treedef node {kind!r}")


def static_values(treedef: TreeDef, prefix: str = "") -> dict[str, Any]:
    """The compile-time constants of a pytree: attrs static fields and Python scalars, by path."""
    kind = treedef[0]
    out: dict[str, Any] = {}
    if kind == "const":
        out[prefix or "<const>"] = treedef[2]
    elif kind == "attrs":
        _, cls, dynamic, static, children = treedef
        base = f"{prefix}." if prefix else ""
        for name, value in static:
            out[f"{base}{name}"] = value
        for name, c in zip(dynamic, children):
            out.update(static_values(c, base + name))
    elif kind == "namedtuple":
        for name, c in zip(treedef[1]._fields, treedef[2]):
            out.update(static_values(c, f"{prefix}.{name}" if prefix else name))
    elif kind in ("list", "tuple"):
        for i, c in enumerate(treedef[1]):
            out.update(static_values(c, f"{prefix}[{i}]"))
    elif kind == "dict":
        for k, c in zip(treedef[1], treedef[2]):
            out.update(static_values(c, f"{prefix}[{k!r}]"))
    return out


def _named_leaves(tree: Any, root: str) -> tuple[list[mx.array], list[str]]:
    leaves, td = tree_flatten(tree)
    return leaves, leaf_paths(td, root)


def canonical_dot(raw: str) -> tuple[str, list[str], int, int]:
    """Renumber MLX's address-named operation nodes n0, n1, ... in order of appearance.
    Returns (dot, primitive per op in order, number of array nodes, number of edges)."""
    ids: dict[str, str] = {}
    ops: list[str] = []
    arrays: set[str] = set()
    edges = 0
    out = []
    for line in raw.splitlines():
        s = line.strip()
        m = _PRIM.match(s)
        if m:
            ids.setdefault(m.group(1), f"n{len(ids)}")
            ops.append(m.group(2))
            out.append(f'{{ {ids[m.group(1)]} [label ="{m.group(2)}", shape=rectangle]; }}')
            continue
        m = _ARRAY.match(s)
        if m:
            arrays.add(m.group(1))
            out.append(s)
            continue
        m = _EDGE.match(s)
        if m:
            edges += 1
            a = ids.get(m.group(2), f'"{m.group(2)}"') if not m.group(1) else f'"{m.group(2)}"'
            b = ids.get(m.group(4), f'"{m.group(4)}"') if not m.group(3) else f'"{m.group(4)}"'
            out.append(f"{a} -> {b}")
            continue
        out.append(s)
    return "\n".join(out) + "\n", ops, len(arrays), edges


def function_graph(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None = None, *,
                   name: str | None = None, view: str = "traced",
                   arg_names: tuple[str, ...] | None = None) -> Graph:
    """The graph of `fn(*args, **kwargs)`: fn is called once, lazily, and not evaluated.

    view names what fn is ("traced" for a plain function, "compiled" for an `mx.compile`d or
    `CompiledFunction` one). Array arguments are evaluated first, so the graph starts at them.
    """
    kwargs = kwargs or {}
    names = arg_names or tuple(f"arg{i}" for i in range(len(args)))
    in_leaves: list[mx.array] = []
    in_paths: list[str] = []
    for a, n in zip(args, names):
        ls, ps = _named_leaves(a, n)
        in_leaves += ls
        in_paths += ps
    for k, v in kwargs.items():
        ls, ps = _named_leaves(v, k)
        in_leaves += ls
        in_paths += ps
    mx.eval(*in_leaves)
    out = fn(*args, **kwargs)
    out_leaves, out_paths = _named_leaves(out, "out")
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        # Name the inputs (once each: a leaf shared by two paths keeps the first name).
        named: dict[str, mx.array] = {}
        seen: set[int] = set()
        for leaf, p in zip(in_leaves, in_paths):
            if id(leaf) not in seen:
                seen.add(id(leaf))
                named[p] = leaf
        mx.export_to_dot(path, *out_leaves, **named)
        raw = open(path).read()
    finally:
        os.unlink(path)
    dot, ops, n_arrays, n_edges = canonical_dot(raw)
    leaf = lambda x, p: Leaf(p, tuple(x.shape), str(x.dtype).removeprefix("mlx.core."))  # noqa: E731
    return Graph(name=name or getattr(fn, "__name__", "fn"), view=view, ops=tuple(ops),
                 num_arrays=n_arrays, num_edges=n_edges,
                 inputs=tuple(leaf(x, p) for x, p in zip(in_leaves, in_paths)),
                 outputs=tuple(leaf(x, p) for x, p in zip(out_leaves, out_paths)), dot=dot)


def graph_diff(a: Graph | dict[str, Any], b: Graph | dict[str, Any]) -> dict[str, Any]:
    """What changed from a to b: op/node counts and per-primitive count deltas (non-zero only).
    Takes Graphs or their `summary()` dicts (e.g. read back from a saved graphs.json)."""
    sa = a.summary() if isinstance(a, Graph) else a
    sb = b.summary() if isinstance(b, Graph) else b
    ha, hb = sa["histogram"], sb["histogram"]
    prims = {p: hb.get(p, 0) - ha.get(p, 0) for p in sorted(set(ha) | set(hb))}
    return {"num_ops": (sa["num_ops"], sb["num_ops"]), "num_nodes": (sa["num_nodes"], sb["num_nodes"]),
            "primitives": {p: d for p, d in prims.items() if d},
            "inputs_changed": sa["inputs"] != sb["inputs"], "outputs_changed": sa["outputs"] != sb["outputs"]}


def render_svg(dot_path: str, max_nodes: int = 3000, timeout: float = 120.0) -> str | None:
    """DOT -> SVG beside it with Graphviz's `dot`, when installed and the graph has at most
    `max_nodes` nodes (Graphviz's layout takes minutes beyond a few thousand); returns the
    SVG's path, or None when skipped."""
    exe = shutil.which("dot")
    if exe is None:
        return None
    text = open(dot_path).read()
    nodes = text.count("shape=rectangle") + len(_ARRAY_LINE.findall(text))
    if nodes > max_nodes:
        return None
    svg = os.path.splitext(dot_path)[0] + ".svg"
    try:
        subprocess.run([exe, "-Tsvg", dot_path, "-o", svg], check=True, capture_output=True, timeout=timeout)
    except (subprocess.TimeoutExpired, subprocess.CalledProcessError):
        return None
    return svg


_ARRAY_LINE = re.compile(r'^\{ (?:rank=\w+; )?"[^"]+"; \}$', re.M)
