"""`fx-engine trace` (also `python tools/trace.py`): look inside the compiled steps and a run.

    fx-engine trace graphs [--model M] [--rows 4 --capacity 512 --chunk 64 --draft 4] [--out DIR]
        prefill/decode/verify graphs (traced and compiled views) of one shape bucket: node
        counts, primitive histograms, inputs and outputs; DIR/<step>.<view>.dot (+ .svg with
        Graphviz) and DIR/graphs.json (the summary that `diff` reads).
    fx-engine trace diff A/graphs.json B/graphs.json
        what changed between two graph summaries (two buckets, or before/after a change).
    fx-engine trace run [--model M] [--requests 8] [--max-tokens 32] [--out DIR]
        a traced workload through the Engine, twice (a warm-up pass, then the same workload
        again): every trace/compile with its reason, host vs evaluation time per step kind,
        and DIR/timeline.json, a Chrome/Perfetto trace (open it in https://ui.perfetto.dev or
        chrome://tracing); DIR/timeline.svg draws it without a viewer.
    fx-engine trace            graphs, then run, into ./trace-out
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def _load(model: str | None) -> Any:
    import fx_engine

    return fx_engine.load(model)


def _add_bucket(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rows", type=int, default=4, help="batch rows (default 4)")
    ap.add_argument("--capacity", type=int, default=512, help="KV cache capacity (default 512)")
    ap.add_argument("--chunk", type=int, default=64, help="prefill chunk (default 64)")
    ap.add_argument("--draft", type=int, default=4, help="draft tokens for verify_step (default 4)")


def cmd_graphs(a: argparse.Namespace, console: Console) -> dict[str, Any]:
    from fx_engine.tracing.graph import render_svg
    from fx_engine.tracing.steps import STEPS, VIEWS, Bucket, step_graphs

    model = _load(a.model)
    bucket = Bucket(rows=a.rows, capacity=a.capacity, chunk=a.chunk, draft=a.draft)
    views = VIEWS if a.view == "both" else (a.view,)
    graphs = step_graphs(model, bucket, STEPS, views)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"model": model.path, "fingerprint": model.fingerprint,
                               "bucket": {"rows": a.rows, "capacity": a.capacity, "chunk": a.chunk,
                                          "draft": a.draft}, "graphs": {}}
    t = Table(title=f"step graphs, {bucket.label()}")
    for col in ("step", "view", "ops", "nodes", "top primitives", "files"):
        t.add_column(col, overflow="fold")
    for (step, view), g in graphs.items():
        dot = out / f"{step}.{view}.dot"
        dot.write_text(g.dot)
        files = [dot.name]
        if not a.no_svg:
            svg = render_svg(str(dot), max_nodes=a.svg_max_nodes)
            files.append(Path(svg).name if svg else
                         f"(no SVG: Graphviz missing or > {a.svg_max_nodes} nodes)")
        summary["graphs"][f"{step}/{view}"] = g.summary()
        top = ", ".join(f"{k} {v}" for k, v in list(g.histogram().items())[:4])
        t.add_row(step, view, str(g.num_ops), str(g.num_nodes), top, " ".join(files))
    summary["cache"] = cache_summary(model, bucket.capacity)
    (out / "graphs.json").write_text(json.dumps(summary, indent=1))
    console.print(t)
    ct = Table(title=f"cache entries at capacity {bucket.capacity} (per row)")
    for col in ("kind", "entries", "shape", "bytes per row"):
        ct.add_column(col, overflow="fold")
    for row in summary["cache"]:
        ct.add_row(row["kind"], str(row["entries"]), row["shape"], str(row["bytes_per_row"]))
    console.print(ct)
    for step in STEPS:
        g = graphs[(step, views[0])]
        io = Table(title=f"{step}: {len(g.inputs)} inputs, {len(g.outputs)} outputs "
                         "(layers 1.. folded; every array is in graphs.json)")
        io.add_column("side")
        io.add_column("array", overflow="fold")
        for side, leaves in (("in", g.inputs), ("out", g.outputs)):
            folded = 0
            for x in leaves:
                if "layers[" in x.path and "layers[0]" not in x.path:
                    folded += 1
                else:
                    io.add_row(side, str(x))
            if folded:
                io.add_row(side, f"... and {folded} more arrays of layers 1..")
        console.print(io)
    console.print(f"wrote {out / 'graphs.json'} and the DOT files (all inputs/outputs are in graphs.json)")
    return summary


def cache_summary(model: Any, capacity: int) -> list[dict[str, Any]]:
    """The cache layout by kind: dense / ring / quantized K/V entries and recurrent state
    entries (whose size does not grow with the context), with their per-row bytes."""
    from fx_engine.core.cache import entry_arrays

    cache = model.new_cache(1, capacity)
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for spec, entry in zip(cache.layout, cache.layers):
        arrays = entry_arrays(entry)
        shape = " + ".join(f"{tuple(a.shape[1:])} {str(a.dtype).split('.')[-1]}" for a in arrays)
        g = groups.setdefault((spec.kind, shape), {"kind": spec.kind, "entries": 0, "shape": shape,
                                                   "bytes_per_row": 0})
        g["entries"] += 1
        g["bytes_per_row"] += sum(a.nbytes for a in arrays)
    return list(groups.values())


def cmd_diff(a: argparse.Namespace, console: Console) -> dict[str, Any]:
    from fx_engine.tracing.graph import graph_diff

    docs = []
    for p in (a.a, a.b):
        try:
            docs.append(json.loads(Path(p).read_text()))
        except (OSError, ValueError) as e:
            raise SystemExit(f"trace diff: cannot read graph summary {p}: {e}") from None
    ga, gb = docs[0].get("graphs", {}), docs[1].get("graphs", {})
    report: dict[str, Any] = {}
    t = Table(title=f"graph diff: {a.a} -> {a.b}")
    for col in ("graph", "ops", "nodes", "primitive count changes"):
        t.add_column(col, overflow="fold")
    for key in sorted(set(ga) | set(gb)):
        if key not in ga or key not in gb:
            t.add_row(key, "only in " + ("B" if key not in ga else "A"), "", "")
            continue
        d = graph_diff(ga[key], gb[key])
        report[key] = d
        changes = ", ".join(f"{p} {n:+d}" for p, n in d["primitives"].items()) or "none"
        t.add_row(key, f"{d['num_ops'][0]} -> {d['num_ops'][1]}", f"{d['num_nodes'][0]} -> {d['num_nodes'][1]}",
                  changes)
    console.print(t)
    return report


def _workload(model: Any, n: int, max_tokens: int, seed: int,
              speculative: bool = False) -> list[tuple[list[int], dict[str, Any]]]:
    rng = random.Random(seed)
    base = model.tokenizer.encode(
        " ".join(f"Item {i}: a short note about topic {i % 7} and its details." for i in range(200)),
        add_special_tokens=False)
    reqs = []
    for i in range(n):
        length = rng.randint(16, 200)
        off = rng.randint(0, len(base) - length)
        sampling = {"temperature": 0.8, "seed": i} if i % 2 else {}
        if speculative:  # n-gram drafts from the prompt: verify_step spans in the timeline
            sampling["prompt_lookup"] = True
        reqs.append((base[off : off + length], {"max_tokens": max_tokens, **sampling}))
    return reqs


def _run_pass(engine: Any, reqs: list, arrive_every: int) -> list[Any]:
    """Drive the engine step by step; a new request arrives every `arrive_every` steps."""
    pending, handles, step = list(reqs), [], 0
    while True:
        if pending and step % max(1, arrive_every) == 0:
            ids, kw = pending.pop(0)
            handles.append(engine.submit(ids, **kw))
        busy = engine.step()
        step += 1
        if not busy and not pending:
            return [h.result() for h in handles]


def cmd_run(a: argparse.Namespace, console: Console) -> dict[str, Any]:
    import fx_engine

    from fx_engine.tracing.timeline import RecompileWatch, chrome_trace, validate_chrome_trace
    from fx_engine.tracing.svg import timeline_svg

    model = _load(a.model)
    engine = fx_engine.Engine(model, max_rows=a.rows, prefill_chunk=a.chunk, prefix_cache_bytes=0,
                              trace_capacity=1_000_000)  # the whole run: the timeline keeps every event
    reqs = _workload(model, a.requests, a.max_tokens, a.seed, a.speculative)
    with RecompileWatch() as watch:
        t0 = time.perf_counter()
        _run_pass(engine, reqs, a.arrive_every)
        warm_s = time.perf_counter() - t0
        watch.mark_warm()
        t1 = time.perf_counter()
        _run_pass(engine, reqs, a.arrive_every)
        steady_s = time.perf_counter() - t1
    events = list(engine.trace_events)
    steady = [e for e in events if e["t"] >= t1]
    trace = chrome_trace(events, watch.events)
    problems = validate_chrome_trace(trace)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "timeline.json").write_text(json.dumps(trace))
    (out / "timeline.svg").write_text(timeline_svg(trace))

    ct = Table(title=f"traces / compiles ({len(watch.events)}; {len(watch.recompiles)} in the steady pass)")
    for col in ("function", "pass", "structure", "trace ms", "reason"):
        ct.add_column(col, overflow="fold")
    for e in watch.events:
        ct.add_row(e["function"], "steady" if e["after_warmup"] else "warm-up", str(e["structure_id"]),
                   f"{((e['t1'] or e['t0']) - e['t0']) * 1e3:.1f}", e["reason"])
    console.print(ct)

    kinds: dict[str, dict[str, list[float]]] = {}
    for e in steady:
        if "host_seconds" in e:
            k = kinds.setdefault(e["kind"], {"host": [], "eval": [], "batch": []})
            k["host"].append(e["host_seconds"])
            k["eval"].append(e["seconds"] - e["host_seconds"])
            k["batch"].append(e.get("batch", 1))
    st = Table(title=f"steady pass: {len(reqs)} requests, {sum(1 for e in steady if e['kind'] == 'step')} "
                     f"steps, {steady_s:.2f} s (warm-up pass {warm_s:.2f} s)")
    for col in ("kind", "count", "host ms (median)", "eval ms (median)", "host share", "mean batch"):
        st.add_column(col)
    summary: dict[str, Any] = {}
    for kind, k in kinds.items():
        h, ev = sum(k["host"]), sum(k["eval"])
        summary[kind] = {"count": len(k["host"]), "host_s": h, "eval_s": ev,
                         "host_ms_median": statistics.median(k["host"]) * 1e3,
                         "eval_ms_median": statistics.median(k["eval"]) * 1e3}
        st.add_row(kind, str(len(k["host"])), f"{summary[kind]['host_ms_median']:.2f}",
                   f"{summary[kind]['eval_ms_median']:.2f}", f"{h / max(h + ev, 1e-9):.0%}",
                   f"{statistics.mean(k['batch']):.1f}")
    console.print(st)
    console.print(f"wrote {out / 'timeline.json'} ({len(trace['traceEvents'])} events"
                  f"{'' if not problems else f', {len(problems)} FORMAT PROBLEMS: ' + problems[0]}) "
                  f"and {out / 'timeline.svg'}; open the JSON in https://ui.perfetto.dev or chrome://tracing")
    return {"compiles": [{k: v for k, v in e.items() if k != "signature"} for e in watch.events],
            "recompiles": len(watch.recompiles), "steps": summary, "problems": problems}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="fx-engine trace", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd")
    g = sub.add_parser("graphs", help="step graphs of one shape bucket")
    g.add_argument("--model", "-m", default=None, help="model path or org/name (default: the default model)")
    _add_bucket(g)
    g.add_argument("--view", choices=("traced", "compiled", "both"), default="both",
                   help="the graph as traced, after mx.compile's simplification, or both (default both)")
    g.add_argument("--out", default="trace-out", help="output folder (default trace-out)")
    g.add_argument("--no-svg", action="store_true", help="skip Graphviz rendering")
    g.add_argument("--svg-max-nodes", type=int, default=3000,
                   help="render SVG only for graphs this small (Graphviz is slow on large ones)")
    d = sub.add_parser("diff", help="compare two graphs.json summaries")
    d.add_argument("a", help="the first graphs.json (before)")
    d.add_argument("b", help="the second graphs.json (after)")
    r = sub.add_parser("run", help="a traced workload: compiles, host/eval time, timeline")
    r.add_argument("--model", "-m", default=None, help="model path or org/name (default: the default model)")
    r.add_argument("--requests", type=int, default=8, help="requests in the workload (default 8)")
    r.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    r.add_argument("--rows", type=int, default=4, help="Engine max_rows (default 4)")
    r.add_argument("--chunk", type=int, default=128, help="Engine prefill_chunk (default 128)")
    r.add_argument("--arrive-every", type=int, default=2, help="a new request every N steps (default 2)")
    r.add_argument("--seed", type=int, default=0, help="seed of the workload's random prompts (default 0)")
    r.add_argument("--speculative", action="store_true",
                   help="prompt-lookup speculative decoding (verify_step spans)")
    r.add_argument("--out", default="trace-out", help="output folder (default trace-out)")
    if not argv:
        argv = ["graphs"]
        a = ap.parse_args(argv)
        console = Console()
        cmd_graphs(a, console)
        cmd_run(ap.parse_args(["run"]), console)
        return 0
    a = ap.parse_args(argv)
    console = Console()
    if a.cmd is None:
        ap.print_help()
        return 2
    {"graphs": cmd_graphs, "diff": cmd_diff, "run": cmd_run}[a.cmd](a, console)
    return 0
