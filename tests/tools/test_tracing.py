"""tools/trace.py's machinery (fx_engine.tracing): graph statistics, graph diffs, the
recompile detector, the Chrome trace timeline and its validator, and the CLI."""

import json

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.tracing import (Bucket, RecompileWatch, chrome_trace, function_graph, graph_diff,
                               step_graphs, validate_chrome_trace)
from fx_engine.core.tree import CompiledFunction


def _f(x, w):
    return mx.softmax(x @ w, axis=-1) * 2.0


def _f_plus_one_op(x, w):
    return mx.exp(mx.softmax(x @ w, axis=-1)) * 2.0


def _xw():
    return mx.ones((2, 3)), mx.ones((3, 4))


def test_graph_counts_are_reproducible_and_see_an_added_op():
    a = function_graph(_f, _xw())
    b = function_graph(_f, _xw())
    assert a.dot == b.dot and a.histogram() == b.histogram() and a.num_ops == b.num_ops
    assert a.histogram()["Matmul"] == 1 and a.histogram()["Softmax"] == 1
    c = function_graph(_f_plus_one_op, _xw())
    assert c.num_ops == a.num_ops + 1
    d = graph_diff(a, c)
    assert d["primitives"] == {"Exp": 1} and d["num_ops"] == (a.num_ops, a.num_ops + 1)
    assert [str(x) for x in a.inputs] == ["arg0: float32[2, 3]", "arg1: float32[3, 4]"]
    assert [str(x) for x in a.outputs] == ["out: float32[2, 4]"]


def test_step_graphs_of_a_bucket(tiny_model):
    b = Bucket(rows=2, capacity=256, chunk=16, draft=3)
    g1 = step_graphs(tiny_model, b)
    g2 = step_graphs(tiny_model, b)
    assert set(g1) == {(s, v) for s in ("prefill_step", "decode_step", "verify_step")
                       for v in ("traced", "compiled")}
    for k in g1:
        assert g1[k].dot == g2[k].dot and g1[k].num_ops == g2[k].num_ops > 10
        assert g1[k].histogram()["Matmul"] >= 2 * tiny_model.config.num_layers
    # compiling fuses: fewer operations than traced
    assert g1[("decode_step", "compiled")].num_ops < g1[("decode_step", "traced")].num_ops
    dec = g1[("decode_step", "traced")]
    assert any(x.path == "state.tokens" and x.shape == (2,) for x in dec.inputs)
    assert any(x.path == "cache.lengths" for x in dec.inputs)
    # a different bucket: same primitives, different shapes
    g4 = step_graphs(tiny_model, Bucket(rows=4, capacity=256, chunk=16, draft=3), ("decode_step",), ("traced",))
    d = graph_diff(dec, g4[("decode_step", "traced")])
    assert d["inputs_changed"]
    with pytest.raises(ValueError, match="steps"):
        step_graphs(tiny_model, b, ("decode",))
    with pytest.raises(ValueError, match="chunk"):
        Bucket(capacity=16, chunk=32)


def test_recompile_detector_reports_a_python_scalar_and_names_it():
    f = CompiledFunction(lambda x, scale: x * scale, name="scaled")
    x = mx.ones((4,))
    with RecompileWatch([f]) as w:
        mx.eval(f(x, 0.5))
        w.mark_warm()
        mx.eval(f(x, 0.5))  # same constant: no trace
        assert w.recompiles == []
        mx.eval(f(x, 0.7))  # a Python scalar where an array belongs: a new constant each call
        mx.eval(f(mx.ones((8,)), 0.7))  # same structure, new shape
    assert [e["after_warmup"] for e in w.events] == [False, True, True]
    assert "scale: 0.5 -> 0.7" in w.events[1]["reason"] and "static" in w.events[1]["reason"]
    assert "new shapes: x: float32(4,) -> float32(8,)" in w.events[2]["reason"]


def _workload(engine, model, n=6):
    base = list(range(10, 200))
    hs = [engine.submit(base[i * 7 : i * 7 + 20 + 9 * i], max_tokens=6 + i,
                        **({"temperature": 0.8, "seed": i} if i % 2 else {})) for i in range(n)]
    while engine.step():
        pass
    return [h.result() for h in hs]


def test_steady_decode_loop_has_no_recompiles_and_a_valid_timeline(tiny_folder):
    # a model of its own (3 layers): the step functions' compile cache is per process, and
    # this test wants to see its first compiles on the timeline, whatever ran before it
    model = fx_engine.load(tiny_folder("llama", num_hidden_layers=3))
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=32, prefix_cache_bytes=0)
    with RecompileWatch() as w:
        _workload(engine, model)
        w.mark_warm()
        mark = len(engine.trace_events)
        _workload(engine, model)
    assert w.recompiles == [], [e["reason"] for e in w.recompiles]
    trace = chrome_trace(list(engine.trace_events), w.events)
    assert validate_chrome_trace(trace) == []
    evs = trace["traceEvents"]
    cats = {e.get("cat") for e in evs}
    assert {"step", "prefill", "decode", "host", "eval", "request", "compile", "admit", "retire"} <= cats
    # host and eval nest inside their decode span on the engine track
    dec = next(e for e in evs if e.get("cat") == "decode")
    inner = [e for e in evs if e.get("cat") in ("host", "eval") and dec["ts"] <= e["ts"] < dec["ts"] + dec["dur"]]
    assert len(inner) == 2 and abs(sum(e["dur"] for e in inner) - dec["dur"]) < 1.0
    assert json.loads(json.dumps(trace)) == trace  # plain JSON
    assert all(e["kind"] != "decode" or "host_seconds" in e for e in list(engine.trace_events)[mark:])


@pytest.mark.parametrize("doc, problem", [
    ({"events": []}, "traceEvents"),
    ({"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "pid": 1, "tid": 1}]}, "dur"),
    ({"traceEvents": [{"name": "a", "ph": "Q", "ts": 0, "pid": 1, "tid": 1}]}, "phase"),
    ({"traceEvents": [{"ph": "i", "ts": 0, "pid": 1, "tid": 1}]}, "name"),
    ({"traceEvents": [{"name": "a", "ph": "X", "ts": 0, "dur": 10, "pid": 1, "tid": 1},
                      {"name": "b", "ph": "X", "ts": 5, "dur": 10, "pid": 1, "tid": 1}]}, "without nesting"),
])
def test_trace_validator_rejects_malformed_documents(doc, problem):
    assert any(problem in p for p in validate_chrome_trace(doc))


def test_trace_cli_graphs_diff_run(tmp_path, tiny_dir, capsys):
    from fx_engine.cli import main

    small = ["--rows", "1", "--capacity", "256", "--chunk", "16", "--draft", "2", "--no-svg"]
    assert main(["trace", "graphs", "--model", str(tiny_dir), "--out", str(tmp_path / "a"), *small]) == 0
    big = [*small]
    big[1] = "2"
    assert main(["trace", "graphs", "--model", str(tiny_dir), "--out", str(tmp_path / "b"), *big]) == 0
    summary = json.loads((tmp_path / "a" / "graphs.json").read_text())
    assert summary["graphs"]["decode_step/traced"]["num_ops"] > 10
    assert (tmp_path / "a" / "decode_step.compiled.dot").read_text().startswith("digraph")
    assert main(["trace", "diff", str(tmp_path / "a" / "graphs.json"), str(tmp_path / "b" / "graphs.json")]) == 0
    assert main(["trace", "run", "--model", str(tiny_dir), "--requests", "4", "--max-tokens", "4",
                 "--rows", "2", "--chunk", "32", "--out", str(tmp_path / "r")]) == 0
    trace = json.loads((tmp_path / "r" / "timeline.json").read_text())
    assert validate_chrome_trace(trace) == []
    # with speculative decoding the timeline has verify spans too
    assert main(["trace", "run", "--model", str(tiny_dir), "--requests", "3", "--max-tokens", "12",
                 "--rows", "2", "--chunk", "32", "--speculative", "--out", str(tmp_path / "s")]) == 0
    spec = json.loads((tmp_path / "s" / "timeline.json").read_text())
    assert validate_chrome_trace(spec) == []
    assert any(e.get("cat") == "verify" for e in spec["traceEvents"])
    assert (tmp_path / "r" / "timeline.svg").read_text().startswith("<svg")
    out = capsys.readouterr().out
    assert "decode_step" in out and "0 in the steady pass" in out


def test_batched_prefill_call_is_one_slice(tiny_model):
    """Rows of one batched prefill call trace one event each (same `call`); the timeline
    draws the call once, naming its rows, and stays a valid nesting."""
    engine = fx_engine.Engine(tiny_model, max_rows=4, prefill_chunk=32, step_token_budget=4 * 32 + 4,
                              prefix_cache_bytes=0)
    hs = [engine.submit(list(range(10 + i, 40 + i)), max_tokens=3) for i in range(4)]
    while engine.step():
        pass
    [h.result() for h in hs]
    pre = [e for e in engine.trace_events if e["kind"] == "prefill"]
    assert len(pre) == 4 and len({e["call"] for e in pre}) == 1 and {e["rows"] for e in pre} == {4}
    trace = chrome_trace(list(engine.trace_events))
    assert validate_chrome_trace(trace) == []
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "prefill"]
    assert len(slices) == 1 and slices[0]["name"] == "prefill x4 (120 tok)"
    assert sorted(slices[0]["args"]["requests"]) == sorted(h.id for h in hs)
    # prompts of different lengths: the call runs on packed rows, and the slice says so
    engine = fx_engine.Engine(tiny_model, max_rows=4, prefill_chunk=32, step_token_budget=4 * 32 + 4,
                              prefix_cache_bytes=0)
    hs = [engine.submit(list(range(10 + i, 10 + i + n)), max_tokens=3) for i, n in enumerate((10, 30, 12, 25))]
    while engine.step():
        pass
    trace = chrome_trace(list(engine.trace_events))
    assert validate_chrome_trace(trace) == []
    slices = [e for e in trace["traceEvents"] if e.get("cat") == "prefill"]
    assert [e["name"] for e in slices] == ["prefill x4 (77 tok, 80 packed rows)"]
    assert slices[0]["args"]["packed"] == 80 and slices[0]["args"]["padded"] == 32
