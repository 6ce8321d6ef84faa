"""HTTP serving benchmark (`python tools/bench_server.py`, or `tools/bench.py --server`).

Side by side in one run, on exactly the same weights and tokenizer:
  fx           `fx-engine serve` on the model as given (for a GGUF: its 4-/8-bit tensors
               kept quantized and run by the native kernels, which compute with exactly the
               values the float32 folder holds; its defaults: --decode-concurrency 32,
               prefill chunk 512)
  fx-f32       `fx-engine serve` on the float32 folder the mlx-lm peers load
  mlx-lm       `mlx_lm.server` (its defaults: --decode-concurrency 32, --prompt-concurrency 8,
               prefill step 2048), with the optimized BLAS fx-engine preloads (MKL here)
  mlx-lm-stock the same with MLX's bundled reference BLAS, as a plain `pip install mlx-lm`
               runs on Linux (very slow batched prefill on CPU; not in the default list)
  llama.cpp    `python -m llama_cpp.server` on the original GGUF (its own quantized weights,
               one sequence at a time), only with --peers including it and when it starts
  direct       fx_engine.Engine in this process on the model fx serves, configured as the server, driven by its
               background thread: the reference for "the server adds almost nothing"
               (measured at 1 client only)

The default model is written once as a float32 Hugging Face folder (tools/oracle.py's
`write_hf_folder`), which both servers load. Each server runs as its own subprocess on a
free port; the servers are started one at a time and stopped before the next starts, so
they never compete for the CPU.

Workload: N concurrent streaming clients (N = 1, 8, 32) each POST /v1/completions with a
distinct text prompt (a window of a long text at its own offset, 64-512 tokens, so no two
requests share a prefix, also across rounds, and no prefix cache helps), `max_tokens` 128,
greedy, EOS suppressed by `logit_bias` so every request generates all 128 tokens, and
`stream_options.include_usage`. Per round: aggregate throughput (completion tokens / time
from the burst to the last chunk), time to first token (first chunk with text) and
inter-token latency (gaps between text chunks, pooled). Medians over --runs rounds after
--warmup rounds per N (fx compiles per shape bucket).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported

from tools.bench_serving import _percentile  # noqa: E402
from tools.oracle import write_hf_folder  # noqa: E402

GEN_TOKENS = 128
PROMPT_RANGE = (64, 512)


def corpus(model: Any, n_tokens: int) -> list[int]:
    """A long, varied, deterministic text (token ids) to cut prompts from."""
    words = ("river", "station", "engine", "garden", "signal", "market", "harbor", "lantern",
             "meadow", "circuit", "archive", "canyon", "orchard", "beacon", "glacier", "quarry")
    parts, i = [], 0
    ids: list[int] = []
    while len(ids) < n_tokens:
        for _ in range(200):
            a, b, c = words[i % 16], words[(i * 7 + 3) % 16], words[(i * 11 + 5) % 16]
            parts.append(f"Note {i}: the {a} near the {b} reported {i * 37 % 1009} readings, "
                         f"and the {c} crew logged {i * 13 % 97} events.")
            i += 1
        ids = model.tokenizer.encode(" ".join(parts), add_special_tokens=False)
    return ids


def prompt_sets(model: Any, text: list[int], ns: list[int], rounds: int, lo: int,
                hi: int) -> dict[tuple[int, int], list[str]]:
    """(N, round) -> N text prompts of lo..hi tokens. Every request of the whole run starts at
    its own offset of the text (a global counter), so no two requests sent to one server share
    a prefix and no prefix cache can help; every server gets the same prompts."""
    import random

    out, k = {}, 0
    for n in ns:
        rng = random.Random(1000 * n)
        for r in range(rounds):
            ps = []
            for _ in range(n):
                length = rng.randint(lo, hi)
                off = k * 97
                assert off + length <= len(text), "corpus too short for the run"
                ps.append(model.tokenizer.decode(text[off : off + length]))
                k += 1
            out[(n, r)] = ps
    return out


def summarize(t0: float, per_request: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in per_request)
    last = max((r["times"][-1] for r in per_request if r["times"]), default=float("nan"))
    ttft = [r["times"][0] - t0 for r in per_request if r["times"]]
    itl = [b - a for r in per_request for a, b in zip(r["times"], r["times"][1:])]
    return {"tokens": tokens, "seconds": last - t0, "tok_s": tokens / (last - t0),
            "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
            "itl_p50": _percentile(itl, 0.5), "itl_p95": _percentile(itl, 0.95),
            "errors": sum(1 for r in per_request if r.get("error"))}


async def _one_stream(client: Any, url: str, prompt: str, gen: int, bias: dict[str, float]) -> dict[str, Any]:
    # No "model" field: each server serves its one model.
    body = {"prompt": prompt, "max_tokens": gen, "temperature": 0.0, "logit_bias": bias,
            "stream": True, "stream_options": {"include_usage": True}}
    times: list[float] = []
    usage = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"tokens": 0, "times": [], "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk.get("choices") or []):
                    times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001  reported per request, the run goes on
        return {"tokens": 0, "times": times, "error": repr(e)}
    tokens = usage["completion_tokens"] if usage else len(times)
    out = {"tokens": tokens, "times": times, "usage": usage}
    if tokens != gen:  # the comparison needs every server to generate exactly `gen` tokens
        out["error"] = f"generated {tokens} tokens, not {gen}"
    return out


def run_http(url: str, prompts: list[str], gen: int, bias: dict[str, float]) -> dict[str, Any]:
    import httpx

    async def burst() -> tuple[float, list[dict[str, Any]]]:
        limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            t0 = time.perf_counter()
            res = await asyncio.gather(*(_one_stream(client, url, p, gen, bias) for p in prompts))
            return t0, list(res)

    t0, res = asyncio.run(burst())
    out = summarize(t0, res)
    errs = [r["error"] for r in res if r.get("error")]
    if errs:
        out["first_error"] = errs[0]
    return out


def run_direct(engine: Any, model: Any, prompts: list[str], gen: int) -> dict[str, Any]:
    """The same requests through the Engine's Python API (its background thread), no HTTP."""
    bias = {int(i): -1e9 for i in model.eos_ids}
    res: list[dict[str, Any]] = [{"tokens": 0, "times": []} for _ in prompts]

    def consume(i: int, h: Any) -> None:
        for ev in h:
            if ev.text:
                res[i]["times"].append(time.perf_counter())
        res[i]["tokens"] = h.result().usage.completion_tokens
        if res[i]["tokens"] != gen:
            res[i]["error"] = f"generated {res[i]['tokens']} tokens, not {gen}"

    t0 = time.perf_counter()
    handles = [engine.submit(model.tokenizer.encode(p), max_tokens=gen, logit_bias=bias)
               for p in prompts]
    threads = [threading.Thread(target=consume, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return summarize(t0, res)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(peer: str, folder: Path, gguf: str | None, port: int) -> list[str]:
    py = sys.executable
    if peer in ("fx", "fx-f32"):
        served = folder if peer == "fx-f32" or gguf is None else gguf
        return [py, "-m", "fx_engine.cli", "serve", "--model", str(served), "--port", str(port),
                "--max-tokens", str(GEN_TOKENS)]
    if peer in ("mlx-lm", "mlx-lm-stock"):
        args = ["--model", str(folder), "--port", str(port), "--log-level", "WARNING"]
        if peer == "mlx-lm-stock":  # MLX's bundled reference BLAS, as `pip install mlx-lm` runs
            return [py, "-m", "mlx_lm.server", *args]
        # The same optimized BLAS fx-engine preloads (fx_engine/runtime/blas.py), so that the two
        # servers differ only in their own code, not in the GEMM library under MLX.
        boot = ("import sys, runpy, fx_engine.runtime.blas as b; b.preload(); "
                "sys.argv = ['mlx_lm.server', *sys.argv[1:]]; "
                "runpy.run_module('mlx_lm.server', run_name='__main__')")
        return [py, "-c", boot, *args]
    if peer == "llama.cpp":
        return [py, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port),
                "--n_ctx", "4096", "--n_threads", str(os.cpu_count() or 2),
                # its default cancels the running request when another arrives: queue instead
                "--interrupt_requests", "False"]
    raise ValueError(f"--peers: unknown peer {peer!r} (fx, mlx-lm, mlx-lm-stock, llama.cpp)")


class Server:
    """One server subprocess; waits until it answers, stops it on exit."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path, ready_path: str):
        self.name = name
        self.cmd, self.url, self.log, self.ready_path = cmd, f"http://127.0.0.1:{port}", log, ready_path

    def __enter__(self) -> "Server":
        import httpx

        self.proc = subprocess.Popen(self.cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT,
                                     cwd=str(Path(__file__).resolve().parent.parent))
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; "
                                   f"log: {self.log}\n{self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"{self.name} did not answer within 300 s; log: {self.log}")

    def __exit__(self, *exc: Any) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


READY = {"fx": "/health", "mlx-lm": "/health", "mlx-lm-stock": "/health", "llama.cpp": "/v1/models"}


def medians(runs: list[dict[str, Any]]) -> dict[str, float]:
    import math

    ok = [r for r in runs if not math.isnan(r["tok_s"])] or runs  # rounds where every stream failed: no data
    out = {m: statistics.median(r[m] for r in ok)
           for m in ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95")}
    out["failed_streams"] = sum(r.get("errors", 0) for r in runs)  # over all measured rounds
    return out


def render(report: dict[str, Any]) -> list[str]:
    lines = [f"Served: N concurrent streaming clients on /v1/completions, prompts "
             f"{report['prompt_range'][0]}-{report['prompt_range'][1]} tokens (no shared prefixes), "
             f"{report['gen_tokens']} generated tokens each, greedy; medians of {report['runs']} "
             f"rounds after {report['warmup']} warm-up.", "",
             "| N | server | aggregate tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) | failed streams |",
             "|---:|---|---:|---:|---:|---:|"]
    for n, block in report["results"].items():
        for k, v in block.items():
            m = v.get("median")
            if m:
                lines.append(f"| {n} | {k} | {m['tok_s']:.1f} | {m['ttft_p50']:.2f} / {m['ttft_p95']:.2f}"
                             f" | {m['itl_p50'] * 1e3:.0f} / {m['itl_p95'] * 1e3:.0f} | "
                             f"{m.get('failed_streams', 0)} of {int(n) * report['runs']} |")
    lines += ["", "| N | ratio | throughput | p95 TTFT |", "|---:|---|---:|---:|"]
    for n, block in report["results"].items():
        fx = block.get("fx", {}).get("median")
        for k, v in block.items():
            m = v.get("median")
            if fx and m and k != "fx":
                lines.append(f"| {n} | fx / {k} | {fx['tok_s'] / m['tok_s']:.2f}x | "
                             f"{fx['ttft_p95'] / m['ttft_p95']:.2f}x |")
    return lines


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF or HF folder (default: the default model)")
    ap.add_argument("--clients", default="1,8,32", help="concurrency levels")
    ap.add_argument("--peers", default="fx,mlx-lm", help="fx, fx-f32, mlx-lm, mlx-lm-stock, llama.cpp (comma-separated)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--gen-tokens", type=int, default=GEN_TOKENS)
    ap.add_argument("--prompt-range", default=f"{PROMPT_RANGE[0]},{PROMPT_RANGE[1]}")
    ap.add_argument("--no-direct", action="store_true", help="skip the in-process engine at N=1")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--render", metavar="JSON", help="print the tables of a saved report and exit")
    a = ap.parse_args(argv)
    if a.render:
        report = json.loads(Path(a.render).read_text())
        for block in report["results"].values():
            for v in block.values():
                if v.get("runs"):
                    v["median"] = medians(v["runs"])
        print("\n".join(render(report)))
        return report
    ns = [int(x) for x in a.clients.split(",")]
    peers = [p.strip() for p in a.peers.split(",") if p.strip()]
    lo, hi = (int(x) for x in a.prompt_range.split(","))
    model = fx_engine.load(a.model)
    rounds = a.warmup + a.runs
    text = corpus(model, hi + 97 * sum(ns) * rounds + 64)
    prompts = prompt_sets(model, text, ns, rounds, lo, hi)
    bias = {str(i): -100.0 for i in model.eos_ids}
    results: dict[str, dict[str, Any]] = {str(n): {} for n in ns}
    tmp = Path(tempfile.mkdtemp(prefix="fx-bench-server-"))
    folder = write_hf_folder(model, tmp / "model") if not Path(model.path).is_dir() else Path(model.path)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    def make_report() -> dict[str, Any]:
        return {"model": model.path, "served_folder": str(folder), "clients": ns, "peers": peers,
                "runs": a.runs, "warmup": a.warmup, "gen_tokens": a.gen_tokens,
                "prompt_range": [lo, hi], "cpu_count": os.cpu_count(),
                "blas": __import__("fx_engine.runtime.blas", fromlist=["active"]).active()["name"],
                "date": time.strftime("%Y-%m-%d"), "results": results}

    def save() -> None:  # after every server too, so that a long run interrupted keeps its data
        if a.json:
            Path(a.json).write_text(json.dumps(make_report(), indent=1))

    if not a.no_direct and 1 in ns:
        engine = fx_engine.Engine(fx_engine.load(model.path), max_rows=32, prefill_chunk=512)
        with engine:
            runs = []
            for r in range(a.warmup + a.runs):
                res = run_direct(engine, model, prompts[(1, r)], a.gen_tokens)
                if r >= a.warmup:
                    runs.append(res)
                    log(f"direct N=1 round {r - a.warmup + 1}: {res['tok_s']:.1f} tok/s")
            results["1"]["direct"] = {"runs": runs, "median": medians(runs)}
        del engine

    for peer in peers:
        port = free_port()
        cmd = server_command(peer, folder, model.path, port)
        try:
            srv = Server(peer, cmd, port, tmp / f"{peer}.log", READY[peer]).__enter__()
        except RuntimeError as e:
            log(f"{peer}: not measured ({e})")
            for n in ns:
                results[str(n)][peer] = {"unavailable": str(e)[:500]}
            continue
        try:
            for n in ns:
                runs = []
                for r in range(a.warmup + a.runs):
                    res = run_http(srv.url, prompts[(n, r)], a.gen_tokens, bias)
                    if r >= a.warmup:
                        runs.append(res)
                    log(f"{peer} N={n} {'round' if r >= a.warmup else 'warm-up'} "
                        f"{max(r - a.warmup + 1, 0)}: {res['tok_s']:.1f} tok/s, TTFT p95 "
                        f"{res['ttft_p95']:.2f} s, errors {res['errors']} {res.get('first_error', '')[:300]}")
                results[str(n)][peer] = {"runs": runs, "median": medians(runs)}
                save()
        finally:
            srv.__exit__()

    report = make_report()
    print("\n".join(render(report)))
    save()
    return report


if __name__ == "__main__":
    main()
