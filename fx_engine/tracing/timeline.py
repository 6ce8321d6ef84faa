"""Recompiles and timelines: what compiled when, and why; where the time of a run went.

    with RecompileWatch() as watch:             # every trace of the compiled step functions
        ... run a workload ...
    watch.events                                # [{function, reason, structure_id, ...}]

    trace = chrome_trace(engine.trace_events, watch.events)
    json.dump(trace, open("timeline.json", "w"))   # opens in Perfetto / chrome://tracing
    validate_chrome_trace(trace)                # [] when well formed

A `CompiledFunction` traces (and MLX compiles) once per static structure and array
signature. The reason reported for a trace compares it with the function's earlier traces:
the static values that changed (`span: 256 -> 512`, a Python scalar such as
`[1]['temperature']: 0.7 -> 0.8`), or, under the same structure, the array shapes that
changed (`cache.layers[0].k: (4, 512, ...) -> (8, 512, ...)`).

The engine's trace events (admit, prefill, decode, verify, sample, retire, resize, step)
carry a perf_counter time at their end and, for timed ones, `seconds` and `host_seconds`
(graph build + call, before evaluation): they become nested complete events (step >
decode > host / eval) on the engine's track, request lifetimes on one track per request,
and traces on a compile track.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

from fx_engine.core.steps import (decode_step_compiled, logits_step_compiled, prefill_step_compiled, sample_step_compiled, score_step_compiled, verify_step_compiled)
from fx_engine.core.tree import CompiledFunction
from fx_engine.tracing.graph import leaf_paths, static_values

STEP_FUNCTIONS = (prefill_step_compiled, decode_step_compiled, verify_step_compiled,
                  sample_step_compiled, score_step_compiled, logits_step_compiled)


def _fmt(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _parts(td: Any, names: list[str]) -> list[tuple[str, Any]]:
    """A CompiledFunction's input treedef is ((args...), {kwargs}): name each argument."""
    if not (isinstance(td, tuple) and td and td[0] == "tuple" and len(td[1]) == 2):
        return [("", td)]
    args_td, kwargs_td = td[1]
    out = [(names[i] if i < len(names) else f"arg{i}", c) for i, c in enumerate(args_td[1])]
    if kwargs_td[0] == "dict":
        out += list(zip(kwargs_td[1], kwargs_td[2]))
    return out


def _paths(td: Any, names: list[str]) -> list[str]:
    return [p for n, c in _parts(td, names) for p in leaf_paths(c, n)]


def _statics(td: Any, names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for n, c in _parts(td, names):
        out.update(static_values(c, n))
    return out


def _dtype(d: str) -> str:
    return d.removeprefix("mlx.core.")


def trace_reason(entry: dict[str, Any], earlier: list[dict[str, Any]], arg_names: list[str] = ()) -> str:
    """Why `entry` (a CompiledFunction.trace_log item) traced, given the same function's
    earlier trace_log items; arg_names name the positional arguments."""
    if not earlier:
        return "first trace"
    names = list(arg_names)
    td, sig = entry.get("treedef"), entry["signature"]
    same = [e for e in earlier if e.get("treedef") == td]
    if same:  # same static structure: some array's shape or dtype changed
        prev = same[-1]
        paths = _paths(td, names) if td is not None else [f"leaf{i}" for i in range(len(sig))]
        groups: dict[tuple, list[str]] = {}  # arrays with the same change (e.g. every layer's K/V)
        for p, a, b in zip(paths, prev["signature"], sig):
            if a != b:
                groups.setdefault((a, b), []).append(p)
        changes = [f"{ps[0]}{f' (+{len(ps) - 1} more)' if len(ps) > 1 else ''}: "
                   f"{_dtype(a[1])}{a[0]} -> {_dtype(b[1])}{b[0]}" for (a, b), ps in groups.items()]
        return "new shapes: " + ("; ".join(changes[:4]) + (f"; +{len(changes) - 4} more" if len(changes) > 4 else "")
                                 if changes else "(none: MLX retraced the same signature)")
    prev = earlier[-1]
    if td is None or prev.get("treedef") is None:
        return "new static structure"
    a, b = _statics(prev["treedef"], names), _statics(td, names)
    changes = [f"{k}: {_fmt(a.get(k, '<absent>'))} -> {_fmt(b.get(k, '<absent>'))}"
               for k in sorted(set(a) | set(b), key=str) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    if changes:
        return "new static structure: " + "; ".join(changes[:4]) + (
            f"; +{len(changes) - 4} more" if len(changes) > 4 else "")
    na, nb = len(_paths(prev["treedef"], names)), len(_paths(td, names))
    return f"new static structure: tree shape changed ({na} -> {nb} array leaves)"


def _arg_names(fn: Any) -> list[str]:
    import inspect

    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


def _timestamp(phase: str, entry: dict[str, Any]) -> None:
    entry["t0" if phase == "start" else "t1"] = time.perf_counter()


class RecompileWatch:
    """Record every trace of the given compiled functions inside a `with` block.

    `events`: one dict per trace, in order: function, structure_id, reason, signature, t0/t1
    (perf_counter, while inside `with`), and `after_warmup` (False until `mark_warm()` is
    called). `recompiles`: the events after warm-up, which a steady loop should not have.
    """

    def __init__(self, functions: Iterable[CompiledFunction] = STEP_FUNCTIONS):
        self.functions = tuple(functions)
        self.events: list[dict[str, Any]] = []
        self._warm_at: dict[str, int] | None = None
        self._start = {id(f): len(f.trace_log) for f in self.functions}  # usable without `with` too

    def __enter__(self) -> "RecompileWatch":
        self._start = {id(f): len(f.trace_log) for f in self.functions}
        for f in self.functions:
            f.trace_hooks.append(_timestamp)
        return self

    def __exit__(self, *exc: Any) -> None:
        for f in self.functions:
            if _timestamp in f.trace_hooks:
                f.trace_hooks.remove(_timestamp)
        self.collect()

    def mark_warm(self) -> None:
        """From now on, every trace is a recompile."""
        self.collect()
        self._warm_at = {f.name: len(f.trace_log) for f in self.functions}

    def collect(self) -> list[dict[str, Any]]:
        seen = {(e["function"], e["index"]) for e in self.events}
        for f in self.functions:
            log = f.trace_log
            for i in range(self._start[id(f)], len(log)):
                if (f.name, i) in seen:
                    continue
                e = log[i]
                self.events.append({
                    "function": f.name, "index": i, "structure_id": e["structure_id"],
                    "reason": trace_reason(e, log[:i], _arg_names(f.fn)), "signature": e["signature"],
                    "t0": e.get("t0"), "t1": e.get("t1"),
                    "after_warmup": self._warm_at is not None and i >= self._warm_at.get(f.name, 0)})
        self.events.sort(key=lambda e: (e["t0"] or 0.0))
        return self.events

    @property
    def recompiles(self) -> list[dict[str, Any]]:
        return [e for e in self.collect() if e["after_warmup"]]


# ------------------------------------------------------------------ Chrome trace format
_TIMED = ("prefill", "decode", "verify")
ENGINE_TID, COMPILE_TID, REQUEST_TID0 = 1, 2, 100


def chrome_trace(events: Iterable[dict[str, Any]], compiles: Iterable[dict[str, Any]] = (),
                 pid: int = 1, name: str = "fx-engine") -> dict[str, Any]:
    """Chrome/Perfetto trace-event JSON (the "JSON Object Format") of an engine run."""
    events = list(events)
    compiles = [c for c in compiles if c.get("t0") is not None]
    starts = [e["t"] - e.get("seconds", 0.0) for e in events] + [c["t0"] for c in compiles]
    if not starts:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(starts)
    us = lambda t: round((t - origin) * 1e6, 3)  # noqa: E731
    out: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": name}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": ENGINE_TID, "args": {"name": "engine steps"}},
        {"name": "thread_name", "ph": "M", "pid": pid, "tid": COMPILE_TID, "args": {"name": "traces / compiles"}},
    ]
    admitted: dict[Any, float] = {}
    # a batched prefill call traces one event per row (same `call`): one slice for them all
    calls: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e["kind"] == "prefill" and "call" in e:
            calls.setdefault(e["call"], []).append(e)
    for e in events:
        kind, t = e["kind"], e["t"]
        args = {k: v for k, v in e.items() if k not in ("t", "kind")}
        if kind == "prefill" and "call" in e:
            rows = calls.pop(e["call"], None)
            if rows is None:
                continue  # already drawn
            if len(rows) > 1:
                args = {"call": e["call"], "rows": len(rows), "padded": e.get("padded"),
                        "packed": e.get("packed"), "seconds": e.get("seconds"), "host_seconds": e.get("host_seconds"),
                        "requests": [r.get("request") for r in rows],
                        "tokens": [r.get("tokens") for r in rows], "step": e.get("step")}
        if kind == "step" or kind in _TIMED:
            dur = e.get("seconds", 0.0)
            if kind == "prefill" and isinstance(args.get("tokens"), list):
                label = f"prefill x{args['rows']} ({sum(args['tokens'])} tok"
                label += f", {args['packed']} packed rows)" if args.get("packed") else ")"
            else:
                label = kind if kind == "step" else (
                    f"{kind} ({e['tokens']} tok)" if kind == "prefill" else f"{kind} x{e.get('batch', '?')}")
            out.append({"name": label, "cat": kind, "ph": "X", "ts": us(t - dur), "dur": round(dur * 1e6, 3),
                        "pid": pid, "tid": ENGINE_TID, "args": args})
            host = e.get("host_seconds")
            if kind != "step" and host is not None and 0 <= host <= dur:
                out.append({"name": "host (build + call)", "cat": "host", "ph": "X", "ts": us(t - dur),
                            "dur": round(host * 1e6, 3), "pid": pid, "tid": ENGINE_TID, "args": {}})
                out.append({"name": "eval", "cat": "eval", "ph": "X", "ts": us(t - dur + host),
                            "dur": round((dur - host) * 1e6, 3), "pid": pid, "tid": ENGINE_TID, "args": {}})
        elif kind == "retire":
            rid = e.get("request")
            t0 = admitted.pop(rid, None)
            if t0 is not None:
                out.append({"name": f"request {rid}", "cat": "request", "ph": "X", "ts": us(t0),
                            "dur": round((t - t0) * 1e6, 3), "pid": pid, "tid": REQUEST_TID0 + int(rid),
                            "args": args})
            out.append({"name": "retire", "cat": "retire", "ph": "i", "s": "t", "ts": us(t), "pid": pid,
                        "tid": ENGINE_TID, "args": args})
        else:  # admit, insert, sample, resize, compact, ...: instants
            if kind == "admit":
                admitted[e.get("request")] = t
            out.append({"name": kind, "cat": kind, "ph": "i", "s": "t", "ts": us(t), "pid": pid,
                        "tid": ENGINE_TID, "args": args})
    for rid in sorted({int(e["request"]) for e in events if e["kind"] == "admit" and "request" in e}):
        out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": REQUEST_TID0 + rid,
                    "args": {"name": f"request {rid}"}})
    for c in compiles:
        out.append({"name": f"trace {c['function']}", "cat": "compile", "ph": "X", "ts": us(c["t0"]),
                    "dur": round(((c.get("t1") or c["t0"]) - c["t0"]) * 1e6, 3), "pid": pid,
                    "tid": COMPILE_TID,
                    "args": {"reason": c["reason"], "structure_id": c["structure_id"],
                             "after_warmup": c.get("after_warmup", False)}})
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"generator": "fx-engine trace"}}


_PHASES = {"X", "B", "E", "i", "I", "M", "C", "b", "e", "n", "s", "t", "f"}


def validate_chrome_trace(trace: Any) -> list[str]:
    """Problems with a Chrome trace-event document ([] when none): the JSON Object Format's
    required fields and types per phase, and proper nesting of complete (X) events on each
    thread (a child starts and ends within its parent). Tolerance 1 ns for rounding."""
    problems: list[str] = []
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["top level: an object with a 'traceEvents' list is required"]
    spans: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    for i, ev in enumerate(trace["traceEvents"]):
        where = f"traceEvents[{i}]"
        if not isinstance(ev, dict):
            problems.append(f"{where}: not an object")
            continue
        ph = ev.get("ph")
        if ph not in _PHASES:
            problems.append(f"{where}: ph {ph!r} is not a trace event phase")
            continue
        for f, types in (("name", str), ("pid", int), ("tid", int)):
            if not isinstance(ev.get(f), types):
                problems.append(f"{where}: {f} missing or not {types.__name__}")
        if ph == "M":
            if not isinstance(ev.get("args"), dict):
                problems.append(f"{where}: metadata event without args")
            continue
        if not isinstance(ev.get("ts"), (int, float)) or ev["ts"] < 0:
            problems.append(f"{where}: ts missing or negative")
            continue
        if "args" in ev and not isinstance(ev["args"], dict):
            problems.append(f"{where}: args is not an object")
        if ph == "X":
            if not isinstance(ev.get("dur"), (int, float)) or ev["dur"] < 0:
                problems.append(f"{where}: complete event without a non-negative dur")
                continue
            spans.setdefault((ev["pid"], ev["tid"]), []).append((ev["ts"], ev["ts"] + ev["dur"], ev["name"]))
        if ph in ("i", "I") and ev.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"{where}: instant scope {ev.get('s')!r} not in g/p/t")
    eps = 1e-3
    for (pid, tid), xs in spans.items():
        xs.sort(key=lambda s: (s[0], -s[1]))
        stack: list[tuple[float, float, str]] = []
        for s in xs:
            while stack and s[0] >= stack[-1][1] - eps:
                stack.pop()
            if stack and s[1] > stack[-1][1] + eps:
                problems.append(f"pid {pid} tid {tid}: {s[2]!r} [{s[0]}, {s[1]}] overlaps "
                                f"{stack[-1][2]!r} [{stack[-1][0]}, {stack[-1][1]}] without nesting")
            stack.append(s)
    return problems
