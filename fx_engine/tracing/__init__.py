"""Inspection tools over the pure core: step graphs, recompiles, run timelines.

    fx_engine.tracing.graph      function_graph, graph_diff, Graph (node counts, primitives, DOT)
    fx_engine.tracing.steps      step_graphs(model, Bucket(...)): prefill/decode/verify graphs
    fx_engine.tracing.timeline   RecompileWatch, chrome_trace, validate_chrome_trace
    fx_engine.tracing.cli        `fx-engine trace` / `python tools/trace.py`
"""

from fx_engine.runtime import setup

setup()  # a shell entry point: process set-up (BLAS, malloc) before mlx is imported

from fx_engine.tracing.graph import Graph, Leaf, function_graph, graph_diff, leaf_paths, static_values  # noqa: E402
from fx_engine.tracing.steps import Bucket, step_graphs  # noqa: E402
from fx_engine.tracing.timeline import RecompileWatch, chrome_trace, trace_reason, validate_chrome_trace  # noqa: E402

__all__ = ["Bucket", "Graph", "Leaf", "RecompileWatch", "chrome_trace", "function_graph", "graph_diff",
           "leaf_paths", "static_values", "step_graphs", "trace_reason", "validate_chrome_trace"]
