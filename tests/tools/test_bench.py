"""tools/bench.py runs end to end (--smoke: a tiny random model, a few tokens, no timing claims)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_bench_smoke(tmp_path: Path) -> None:
    out_json, out_md = tmp_path / "bench.json", tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "--smoke",
         "--json", str(out_json), "--markdown", str(out_md)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out_json.read_text())
    assert report["smoke"] and report["summary"]["targets"] == []
    for key in ("fx", "fx-bi", "mlx-lm", "mlx-lm-f32"):
        metrics = report["results"][key]["metrics"]
        assert set(metrics) == set(report["metric_names"])
        assert all(m["median"] > 0 for m in metrics.values())
    # The mlx-lm peers are built from the same weights: same greedy tokens, same logits.
    for key, agree in report["agreement"]["engines"].items():
        assert agree["matching_prefix"] == agree["compared"], key
        assert agree["max_abs_logit_diff"] < 1e-3, key
    assert "llama.cpp" in report["skipped"] or "llama.cpp" in report["results"]
    md = out_md.read_text()
    assert "| tok/s (median) |" in md and "fx/mlx-lm" in md


@pytest.mark.parametrize("gen", [[], ["--gen-range", "2,6"]])
def test_bench_serving_smoke(tmp_path: Path, gen) -> None:
    """The serving workload: every engine delivers each request's generated tokens (N x gen,
    or each request's own count drawn from --gen-range), metrics are finite."""
    out_json = tmp_path / "serving.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "--smoke", "--serving",
         "--serving-engines", "fx,fx-a8,mlx-lm-f32", "--json", str(out_json), *gen],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out_json.read_text())
    s = report["serving"]
    for n, block in s["results"].items():
        assert set(block["engines"]) == {"fx", "fx-a8", "mlx-lm-f32"}
        if gen:
            assert s["gen_tokens"] == [2, 6] and all(2 <= g <= 6 for g in block["gen_tokens"])
        else:
            assert block["gen_tokens"] == [s["gen_tokens"]] * int(n)
        for key, v in block["engines"].items():
            for run in v["runs"]:
                assert run["tokens"] == sum(block["gen_tokens"]), (n, key)
                assert run["tok_s"] > 0 and run["ttft_p50"] > 0 and run["itl_p50"] >= 0
    assert "aggregate throughput ratio" in proc.stdout
    assert "fx-engine (8-bit activations, float16 KV) / mlx-lm" in proc.stdout


def test_bench_kv_smoke(tmp_path: Path, tiny_folder) -> None:
    """tools/bench.py --kv (tools/bench_kv.py) on a tiny model: every kind and engine runs,
    and the reported memory per token is the same layout for both engines."""
    model = tiny_folder(head_dim=64)
    out = tmp_path / "kv.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench.py"), "--kv", "--model", str(model),
         "--contexts", "300", "--decode-tokens", "2", "--runs", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in rows] == ["dense", "8-bit", "4-bit"]
    for r in rows:
        assert r["fx"]["tok_s"] > 0 and r["mlx-lm"]["tok_s"] > 0
        assert r["fx"]["bytes_per_token"] == r["mlx-lm"]["bytes_per_token"]


def test_llama_cpp_serving_peer_decodes_what_fx_engine_decodes(default_model) -> None:
    """The optional llama.cpp serving peer (tools/bench_serving.py; only where
    llama-cpp-python is installed, never in CI): its multi-sequence greedy decoding of
    three short prompts in one unified KV cache starts with fx-engine's tokens (llama.cpp
    computes with 8-bit activations, so only the first few tokens are compared)."""
    pytest.importorskip("llama_cpp")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import bench_serving as bs
    finally:
        sys.path.pop(0)
    import fx_engine

    ids = default_model.tokenizer.encode(
        "The lighthouse keeper climbed the stairs every night. He counted the steps, "
        "checked the lamp, and wrote in his logbook. One winter evening")
    prompts = [ids, ids[5:], ids[:-3]]
    peer = bs.LlamaCppServing(default_model.path, len(prompts), 64 + len(ids), list(default_model.eos_ids))
    try:
        out = bs.run_llama_cpp(peer, prompts, [6, 6, 6])
        varied = bs.run_llama_cpp(peer, prompts, [2, 5, 3])
    finally:
        peer.close()
    assert out["tokens"] == 18 and varied["tokens"] == 10
    bias = {int(e): -1e9 for e in default_model.eos_ids}
    for p, got in zip(prompts, out["first_tokens"]):
        want = fx_engine.generate(default_model, p, max_tokens=3, temperature=0.0, logit_bias=bias)
        assert got[:3] == list(want.token_ids)


def test_bench_kernels_smoke(tmp_path: Path) -> None:
    """tools/bench_kernels.py: every kernel timed on every shape, positive rates, the table."""
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_kernels.py"), "--rows", "1,17",
         "--rounds", "1", "--budget", "0.001", "--json", str(out)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert {(r["rows"], r["linear"]) for r in report["results"]} == {
        (m, name) for m in (1, 17) for name in ("qkv", "o", "gate_up", "down", "head")}
    for r in report["results"]:
        for kern in ("qmm", "qgemm", "qmm_a8"):
            assert r[kern]["us"] > 0 and r[kern]["gflops"] > 0
    assert "| 17 | head |" in proc.stdout


def test_synth_gguf_writes_a_file_fx_engine_loads(tmp_path: Path) -> None:
    """tools/synth_gguf.py (issue 41): random valid blocks at a tiny shape, the tokenizer padded
    to the vocabulary; fx_engine.load reads it and decodes; llama.cpp's Q4_K_M mix at 1B."""
    pytest.importorskip("gguf")
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import synth_gguf as sg
    finally:
        sys.path.pop(0)
    import fx_engine
    from fx_engine.loading.gguf import _Header

    for arch, quant in (("llama", "Q4_K_M"), ("olmoe", "Q8_0")):
        shape = sg.Shape("tiny", 256, 2, 512, 4, 2, 49300, tied=arch == "llama", arch=arch,
                         experts=4 if arch == "olmoe" else 0, top_k=2 if arch == "olmoe" else 0)
        path = sg.write_file(tmp_path / f"{arch}.gguf", shape, quant)
        assert not path.with_name(path.name + ".partial").exists()
        model = fx_engine.load(path)
        assert model.config.vocab_size == 49300 and model.config.num_layers == 2
        assert len(_Header(path).metadata["tokenizer.ggml.tokens"]) == 49300  # as llama.cpp needs
        out = fx_engine.generate(model, "Hello", max_tokens=3, temperature=0.0)
        assert len(out.token_ids) >= 1
    plan = {name: kind for name, kind, _ in sg.tensor_plan(sg.SHAPES["llama-1b"], "Q4_K_M")}
    assert plan["token_embd.weight"] == "Q6_K" and "output.weight" not in plan
    assert [i for i in range(16) if plan[f"blk.{i}.attn_v.weight"] == "Q6_K"] == [0, 1, 4, 7, 10, 13, 14, 15]
    assert plan["blk.2.ffn_gate.weight"] == "Q4_K" and plan["blk.2.ffn_down.weight"] == "Q4_K"
    assert 0.79e9 < sg.estimate_bytes(sg.SHAPES["llama-1b"], "Q4_K_M") < 0.82e9


def test_bench_vision_smoke(tmp_path: Path) -> None:
    """tools/bench_vision.py (issue 46's benchmark against mlx-vlm) end to end on the tests'
    tiny Gemma 3: both engines timed, the medians written."""
    out = tmp_path / "vision.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_vision.py"), "--geometry", "tiny",
                           "--runs", "1", "--tokens", "4", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    med = json.loads(out.read_text())["medians"]
    assert set(med) == {"fx", "mlx-vlm"} and all(m["ttft"] > 0 for m in med.values())
    assert "fx speed vs mlx-vlm" in proc.stdout
