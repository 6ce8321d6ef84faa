"""The serving workload of tools/bench.py (`python tools/bench.py --serving`).

N requests arrive at once (a burst; N = 1, 8, 32 by default). Prompt lengths are drawn
uniformly from [64, 512] tokens with a fixed seed (distinct text per request, so no two
prompts share a prefix); each request generates exactly 128 tokens, greedy (EOS
suppressed for fx-engine with a logit bias, no stop tokens for mlx-lm).

  fx           fx_engine.Engine(max_rows=N, prefill_chunk=512) on the model loaded with
               numerics="exact" (float32 activations), driven step by step in this
               thread; a token's time is when the step that produced it returned.
  fx-a8        the same with `fx_engine.load(..., numerics="int8", kv_dtype="float16")`
               (8-bit activations for the quantized matmuls and a float16 KV cache, as
               llama.cpp computes; what numerics="auto" picks on such CPUs, with the
               float16 cache).
  mlx-lm-f32   mlx-lm's BatchGenerator (completion_batch_size=N, prefill_batch_size
               min(N, 8), its default prefill step of 2048) on the same dense float32
               arrays fx-engine runs on; a token's time is when `next_generated()` returned it.
  mlx-lm       the same BatchGenerator on mlx-lm's natural (4/8-bit) representation. Its
               CPU quantized matmul is slow, so it is not in the default list.
  llama.cpp    llama.cpp's multi-sequence decoding through llama-cpp-python's low-level API
               on the GGUF itself (its own Q4_1/Q8_0 kernels, all threads): one sequence
               per request in one unified KV cache, and each llama_decode call is a batch of
               up to n_batch = 512 + N tokens, built like llama-server's continuous
               batching: one token for every generating sequence, then prompt tokens of
               the prefilling ones in FIFO order; greedy (argmax with EOS excluded). Only
               when `llama_cpp` is importable (it compiles for ~15 minutes; not a
               dependency).

Per run: aggregate generated tokens/s (all tokens / time from the burst to the last
token), time to first token (TTFT) per request, inter-token latency (ITL: every gap
between two consecutive tokens of a request, pooled). Reported: medians over runs of the
aggregate and of each run's p50/p95. Each engine gets one warm-up run per N (fx compiles
per shape bucket), then --runs measured rounds with the engine order rotated per round.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any, Callable

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx

GEN_TOKENS = 128
PROMPT_RANGE = (64, 512)


def serving_prompts(model: Any, n: int, seed: int, lo: int, hi: int,
                    base: Callable[[Any, int], list[int]]) -> list[list[int]]:
    """n prompts of lengths uniform in [lo, hi]: windows of a long text at distinct offsets."""
    rng = random.Random(seed)
    text = base(model, hi + 64 * n + 64)
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        off = (i * 61) % (len(text) - length)
        out.append(text[off : off + length])
    return out


def serving_gens(n: int, seed: int, gen: int | tuple[int, int]) -> list[int]:
    """Each request's generated tokens: `gen` for all, or uniform in [lo, hi] (`--gen-range`:
    answers of different lengths, so rows finish at different steps and the batch runs
    with free rows, as a server's does)."""
    if isinstance(gen, int):
        return [gen] * n
    rng = random.Random(seed + 7919)
    return [rng.randint(gen[0], gen[1]) for _ in range(n)]


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


def summarize_times(t0: float, times: list[list[float]]) -> dict[str, Any]:
    """Per-request token arrival times -> aggregate tok/s, TTFT and ITL percentiles."""
    total = sum(len(t) for t in times)
    last = max(t[-1] for t in times if t)
    ttft = [t[0] - t0 for t in times if t]
    itl = [b - a for t in times for a, b in zip(t, t[1:])]
    return {
        "tokens": total, "seconds": last - t0, "tok_s": total / (last - t0),
        "ttft_p50": _percentile(ttft, 0.5), "ttft_p95": _percentile(ttft, 0.95),
        "itl_p50": _percentile(itl, 0.5), "itl_p95": _percentile(itl, 0.95),
        "itl_max": max(itl) if itl else float("nan"),
    }


def run_fx(model: Any, prompts: list[list[int]], gens: list[int]) -> dict[str, Any]:
    from fx_engine.engine.engine import Engine

    bias = {int(i): -1e9 for i in model.eos_ids}  # always decode `gens[i]` tokens
    engine = Engine(model, max_rows=len(prompts), prefill_chunk=512)
    t0 = time.perf_counter()
    handles = [engine.submit(p, max_tokens=g, logit_bias=bias) for p, g in zip(prompts, gens)]
    times: list[list[float]] = [[] for _ in prompts]
    while engine.step():
        now = time.perf_counter()
        for i, h in enumerate(handles):
            # Drain what this step delivered (the tool reads the handle's queue directly so
            # that it can timestamp without a consumer thread per request).
            while h._events:
                ev = h._events.popleft()
                times[i].extend([now] * len(ev.token_ids))
    now = time.perf_counter()
    for i, h in enumerate(handles):
        while h._events:
            times[i].extend([now] * len(h._events.popleft().token_ids))
        h.result()
    out = summarize_times(t0, times)
    out["steps"] = engine.steps
    return out


def run_mlx_lm(model: Any, prompts: list[list[int]], gens: list[int]) -> dict[str, Any]:
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    bg = BatchGenerator(model, max_tokens=max(gens), stop_tokens=None, completion_batch_size=n,
                        prefill_batch_size=min(n, 8))
    t0 = time.perf_counter()
    uids = bg.insert(prompts, list(gens))
    index = {u: i for i, u in enumerate(uids)}
    times: list[list[float]] = [[] for _ in prompts]
    while responses := bg.next_generated():
        now = time.perf_counter()
        for r in responses:
            times[index[r.uid]].append(now)
    bg.close()
    return summarize_times(t0, times)


_QUIET_LLAMA_LOG = []


def _quiet_llama_log(llama_cpp):
    """A llama.cpp log callback that drops every message, made once and kept for the life of
    the process: llama_log_set installs it process-wide, so the ctypes object must outlive
    any one peer (freed with a peer, the next model load, anywhere in the process, called a
    dangling pointer: a segfault in llama_cpp.Llama(...) after a peer was closed)."""
    if not _QUIET_LLAMA_LOG:
        _QUIET_LLAMA_LOG.append(llama_cpp.llama_log_callback(lambda level, text, user: None))
    return _QUIET_LLAMA_LOG[0]


class LlamaCppServing:
    """A llama.cpp context sized for `n_seq` sequences of up to `per_seq` positions each."""

    def __init__(self, path: str, n_seq: int, per_seq: int, eos_ids: list[int]):
        import llama_cpp

        self.lib = llama_cpp
        self.threads = os.cpu_count() or 1
        self.n_seq = n_seq
        self.n_batch = 512 + n_seq
        # The low-level API: llama_cpp.Llama has no n_seq_max / kv_unified arguments.
        llama_cpp.llama_log_set(_quiet_llama_log(llama_cpp), None)  # its per-context logs, off
        llama_cpp.llama_backend_init()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = n_seq * per_seq
        cp.n_batch = cp.n_ubatch = self.n_batch
        cp.n_seq_max = n_seq
        cp.kv_unified = True
        cp.n_threads = cp.n_threads_batch = self.threads
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create its context")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.eos = [i for i in eos_ids if 0 <= i < self.n_vocab]
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.notes = (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, "
                      f"{self.threads} threads, n_batch {self.n_batch}, {n_seq} sequences")

    def close(self) -> None:
        """Free the batch, the context (its KV cache) and the model."""
        lib = self.lib
        lib.llama_batch_free(self.batch)
        lib.llama_free(self.ctx)
        lib.llama_model_free(self.model)

    def clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_clear"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            lib.llama_kv_self_clear(self.ctx)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        b = self.batch
        for j, (tok, pos, seq, want) in enumerate(entries):
            b.token[j] = tok
            b.pos[j] = pos
            b.n_seq_id[j] = 1
            b.seq_id[j][0] = seq
            b.logits[j] = 1 if want else 0
        b.n_tokens = len(entries)
        rc = self.lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(self, j: int) -> int:
        import numpy as np

        row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, j), (self.n_vocab,))
        row = row.copy()
        row[self.eos] = -np.inf  # always decode `gen` tokens, as the other peers
        return int(row.argmax())


def run_llama_cpp(peer: LlamaCppServing, prompts: list[list[int]], gens: list[int]) -> dict[str, Any]:
    import collections

    peer.clear()
    n = len(prompts)
    t0 = time.perf_counter()
    times: list[list[float]] = [[] for _ in prompts]
    fed = [0] * n  # prompt tokens already decoded
    last = [0] * n  # the sequence's last sampled token
    waiting = collections.deque(range(n))  # still prefilling, FIFO
    generating: list[int] = []
    tokens: list[list[int]] = [[] for _ in prompts]
    while waiting or generating:
        entries = [(last[i], len(prompts[i]) + len(times[i]) - 1, i, True) for i in generating]
        owners: list[int] = list(generating)
        budget = peer.n_batch - len(entries)
        for i in list(waiting):
            if budget <= 0:
                break
            take = min(budget, len(prompts[i]) - fed[i])
            for p in range(fed[i], fed[i] + take):
                done = p == len(prompts[i]) - 1
                entries.append((prompts[i][p], p, i, done))
                if done:
                    owners.append(i)
            fed[i] += take
            budget -= take
        peer.decode(entries)
        now = time.perf_counter()
        j_logit = [j for j, e in enumerate(entries) if e[3]]
        for j, i in zip(j_logit, owners):
            last[i] = peer.argmax(j)
            tokens[i].append(last[i])
            times[i].append(now)
            if i in waiting and fed[i] == len(prompts[i]):
                waiting.remove(i)
                generating.append(i)
        generating = [i for i in generating if len(times[i]) < gens[i]]
    out = summarize_times(t0, times)
    out["first_tokens"] = [t[:8] for t in tokens]  # for a sanity check against fx's
    return out


def run_serving(engines: dict[str, tuple[str, Any]], fx_model: Any, ns: list[int], runs: int,
                warmup: int, gen: int | tuple[int, int], prompt_range: tuple[int, int],
                base: Callable[[Any, int], list[int]], log: Callable[[str], None],
                ) -> dict[str, Any]:
    """engines: key -> ("fx" | "mlx-lm", model); gen: tokens per request, or a (lo, hi)
    range (`serving_gens`). Returns {n: {key: {"runs": [...]}}}."""
    results: dict[str, Any] = {}
    keys = list(engines)
    for n in ns:
        prompts = serving_prompts(fx_model, n, seed=n, lo=prompt_range[0], hi=prompt_range[1],
                                  base=base)
        gens = serving_gens(n, n, gen)
        res = {k: {"runs": []} for k in keys}
        results[str(n)] = {"prompt_tokens": [len(p) for p in prompts], "gen_tokens": gens, "engines": res}

        peers: dict[str, Any] = {}

        def once(key: str) -> dict[str, Any]:
            kind, model = engines[key]
            if kind == "llama.cpp":  # model: the GGUF path; one context per N
                if key not in peers:
                    peers[key] = LlamaCppServing(model, n, max(map(len, prompts)) + max(gens) + 8,
                                                 list(fx_model.eos_ids))
                return run_llama_cpp(peers[key], prompts, gens)
            r = (run_fx if kind == "fx" else run_mlx_lm)(model, prompts, gens)
            mx.clear_cache()
            return r

        for k in keys:
            for _ in range(warmup):
                log(f"serving N={n}: warm-up {k}")
                once(k)
        for rnd in range(runs):
            order = keys[rnd % len(keys):] + keys[: rnd % len(keys)]
            for k in order:
                r = once(k)
                res[k]["runs"].append(r)
                log(f"serving N={n} round {rnd + 1}/{runs} {k}: {r['tok_s']:.1f} tok/s, "
                    f"TTFT p50 {r['ttft_p50']:.2f} s, ITL p50 {r['itl_p50'] * 1e3:.0f} ms")
        for peer in peers.values():  # a context per N: free this one's KV cache now
            peer.close()
        for k in keys:
            rs = res[k]["runs"]
            res[k]["median"] = {m: statistics.median(r[m] for r in rs)
                                for m in ("tok_s", "ttft_p50", "ttft_p95", "itl_p50", "itl_p95")}
    return results


def render_serving(report: dict[str, Any], label: Callable[[str], str]) -> list[str]:
    s = report.get("serving")
    if not s:
        return []
    lines = ["", f"Serving: N concurrent requests (burst), prompts {s['prompt_range'][0]}-"
                 f"{s['prompt_range'][1]} tokens, "
                 + (f"{s['gen_tokens']} generated tokens each, " if isinstance(s['gen_tokens'], int) else
                    f"{s['gen_tokens'][0]}-{s['gen_tokens'][1]} generated tokens (uniform per request), ")
                 + f"greedy; medians of {s['runs']} runs after {s['warmup']} warm-up."
                 + (f" **Busy machine**: {report['machine']['busy_processes']} busy-loop "
                    "process(es) (one core each) ran throughout (`--busy`)."
                    if (report.get("machine") or {}).get("busy_processes") else ""), "",
             "| N | engine | aggregate tok/s | TTFT p50 / p95 (s) | ITL p50 / p95 (ms) |",
             "|---:|---|---:|---:|---:|"]
    for n, block in s["results"].items():
        for k, v in block["engines"].items():
            m = v.get("median")
            if not m:
                continue
            lines.append(f"| {n} | {label(k)} | {m['tok_s']:.1f} | {m['ttft_p50']:.2f} / "
                         f"{m['ttft_p95']:.2f} | {m['itl_p50'] * 1e3:.0f} / "
                         f"{m['itl_p95'] * 1e3:.0f} |")
    ratios = []
    for n, block in s["results"].items():
        e = block["engines"]
        for base in ("fx", "fx-a8"):  # each fx-engine mode against the other engines
            if base not in e or "median" not in e[base]:
                continue
            for k, v in e.items():
                if not k.startswith("fx") and v.get("median"):
                    ratios.append(f"| {n} | {label(base)} / {label(k)} | "
                                  f"{e[base]['median']['tok_s'] / v['median']['tok_s']:.2f}x |")
    if ratios:
        lines += ["", "| N | aggregate throughput ratio | value |", "|---:|---|---:|", *ratios]
    return lines
