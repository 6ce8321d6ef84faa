#!/usr/bin/env python
"""Benchmark fx-engine against mlx-lm (and llama.cpp when `llama_cpp` is importable).

One process, one BLAS, the same weights for every engine:

  fx            fx-engine in its exact numerics (`fx_engine.load(path, numerics="exact")`:
                float32 activations, mlx-lm's numerics; on the CPU with the native
                kernels, the GGUF's 4-/8-bit tensors kept quantized; compiled
                steps, prefill chunks of 512, attention span buckets), timed through
                `fx_engine.stream` itself (one delta per token) with EOS suppressed by a logit
                bias, so every engine decodes the same number of tokens.
  fx-bi         the same with `load(..., batch_invariant=True)`.
  fx-a8         the same with `load(..., numerics="int8", kv_dtype="float16")`:
                activations rounded to 8 bits per weight group for the 4-/8-bit matmuls
                (int8 dot products) and a float16 KV cache, the numerics llama.cpp runs
                by default (`load`'s default numerics="auto" picks int8 for quantized
                models on CPUs with int8 dot products). Not in the default list.
  fx-mlx        fx-engine without its native kernels (`load(..., native=False)`): weights
                dequantized to dense float32, every op MLX's own (the default until the
                native kernels existed).
  mlx-lm        mlx-lm's natural representation of the model. For a GGUF: the GGUF tensors as
                `mx.load` returns them (MLX affine triples, group 32; Q4_1 -> 4-bit,
                Q8_0 -> 8-bit) in `nn.QuantizedLinear` / `nn.QuantizedEmbedding`, scales and
                biases cast to float32 so activations are float32 (float16 activations are
                ~30x slower on MLX's CPU backend). attn_q/attn_k rows are un-permuted back to
                the Hugging Face order (exact: whole rows move). For an HF folder:
                `mlx_lm.utils.load_model` as is.
  mlx-lm-f32    mlx-lm with the very dense float32 arrays fx-engine runs on (fused qkv and
                gate_up split back into q/k/v and gate/up).
  llama.cpp     llama-cpp-python on the GGUF file (only when importable and the model is a
                GGUF; it is not measured otherwise).

mlx-lm is timed through its own `generate_step` (its KVCache, its prefill chunking of 2048,
its async pipelining); llama.cpp through `Llama.generate`. Per engine and workload:

  prefill tok/s   prompt tokens / time to the first sampled token (fresh cache each run)
  decode tok/s    decoded tokens / time from the first token to the last (greedy, one token
                  fetched to the host per step)

Workloads (default): a 64-token prompt then 64 decoded tokens ("decode@64"); a 512-token
prefill; a 2048-token prefill then 64 decoded tokens ("prefill@2048", "decode@2048").
Warm-up: one run per workload for fx engines (they compile per shape: mx.compile tracing
and the C++ JIT of fused CPU kernels happen here), one run in all for the eager engines.
Then --runs measured rounds; each round runs every workload on every engine (engine order
rotated per round), so the shared machine's changing load falls on both sides of every
ratio alike, the decode@2048 / decode@64 slowdown included. Medians are reported.

Memory: per measurement the MLX peak (mx.reset_peak_memory before, mx.get_peak_memory
after) above the memory live before the run (i.e. KV cache + activations; the weights of
every loaded engine are live throughout, so they are reported separately), and the
process's peak RSS (VmHWM, reset through /proc/self/clear_refs where the kernel allows).

Usage:
  python tools/bench.py                             # full run on the default model
  python tools/bench.py --quick                     # fewer tokens (128/512 prefill, 16 decode)
  python tools/bench.py --model PATH.gguf|FOLDER --runs 5 --json out.json --markdown out.md
  python tools/bench.py --quick --model synth:llama-1b:Q4_K_M   # a synthetic file at a real
                            # size (tools/synth_gguf.py: written once into its cache folder)
  python tools/bench.py --smoke                     # tiny random model, seconds, no claims

For a GGUF file, the machine's DRAM read bandwidth is measured first (tools/membw.py; --no-dram
skips it) and every decode figure is also reported as effective bandwidth: tok/s x the file's
bytes (what llama.cpp's figures are usually read against), tok/s x the bytes a decode step
streams (the file less an untied embedding table, which is only gathered from), and the
latter's fraction of the measured DRAM read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from fx_engine.core.cache import init_cache  # noqa: E402
from fx_engine.core.models import cache_layout  # noqa: E402
from fx_engine.core.sampling import SamplingConfig  # noqa: E402
from fx_engine.core.state import init_state  # noqa: E402
from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled
from fx_engine.core.tree import tree_leaves  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: tools/ modules
from oracle import _mlx_lm_skeleton, mlx_lm_dense_from_fx  # noqa: E402
import membw  # noqa: E402

try:  # the shell's attention span buckets (newer engines); None: attend over the capacity
    from fx_engine.core.cache import span_bucket
except ImportError:  # pragma: no cover
    span_bucket = None

try:  # mirror the shell's bucketing exactly (fall back to its documented values)
    from fx_engine.engine.generate import MIN_CAPACITY, PREFILL_CHUNK, bucket
except ImportError:  # pragma: no cover
    PREFILL_CHUNK, MIN_CAPACITY = 512, 256

    def bucket(n: int, minimum: int = 16) -> int:
        return max(minimum, 1 << max(0, (n - 1)).bit_length())


# Published on these machines (2 vCPUs, llama.cpp with 2 threads, median of 3), for the
# default model only: /work/shared/reference/default-model.md. NOT measured by this tool.
LLAMA_CPP_REFERENCE = {"decode@64": 77.7, "prefill@512": 194.0, "prefill@2048": 159.0}
REFERENCE_SOURCE = "shared/reference/default-model.md (llama.cpp, 2 threads, same machines)"

# fx-engine with llama.cpp's kind of numerics (8-bit activations, float16 KV cache).
FX_A8 = {"numerics": "int8", "kv_dtype": "float16"}
FX_EXACT = {"numerics": "exact"}

ENGINE_LABELS = {
    "fx": "fx-engine",
    "fx-bi": "fx-engine (batch-invariant)",
    "fx-a8": "fx-engine (8-bit activations, float16 KV)",
    "fx-mlx": "fx-engine (MLX ops only, dense f32)",
    "mlx-lm": "mlx-lm (natural: 4/8-bit GGUF)",
    "mlx-lm-f32": "mlx-lm (dense f32, fx weights)",
    "llama.cpp": "llama.cpp (llama-cpp-python)",
}

TEXT = (
    "The history of computing is a story of abstraction layered upon abstraction. Early "
    "machines were programmed by rewiring panels; then came stored programs, assemblers, "
    "compilers, operating systems and networks. Each layer hid the details of the one below "
    "it, and each made new kinds of programs possible. Today a language model running on a "
    "laptop predicts the next word of a sentence by multiplying large matrices of numbers, "
    "billions of times per second, while the person typing the question sees only a few "
    "lines of text appear on the screen. What is the capital of France, and why did it "
    "become the center of the country? Numbers like 3.14159 and 2.71828 appear everywhere. "
)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- memory


def _proc_status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_rss_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)
        return True
    except OSError:
        return False


class MemProbe:
    """MLX peak above the live baseline, and process peak RSS, around one measurement."""

    def __enter__(self) -> "MemProbe":
        mx.synchronize()
        mx.clear_cache()
        self.rss_reset = _reset_rss_peak()
        self.rss_before_kb = _proc_status_kb("VmRSS") or 0
        mx.reset_peak_memory()
        self.active_before = mx.get_active_memory()
        return self

    def __exit__(self, *exc: Any) -> None:
        mx.synchronize()
        self.mlx_peak = mx.get_peak_memory()
        self.mlx_extra = max(0, self.mlx_peak - self.active_before)
        hwm = _proc_status_kb("VmHWM")
        if hwm is None:
            hwm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self.rss_peak_kb = hwm
        self.rss_extra_kb = max(0, hwm - self.rss_before_kb) if self.rss_reset else None


def _unique_nbytes(arrays: list[mx.array]) -> int:
    seen, total = set(), 0
    for a in arrays:
        if id(a) not in seen:
            seen.add(id(a))
            total += a.nbytes
    return total


# ------------------------------------------------------------------------------ engines


class Engine:
    key: str = ""
    notes: str = ""
    # Compiled per input shape (mx.compile traces + C++ JIT per shape): warm up every
    # workload. Eager engines (mlx-lm, llama.cpp) need one warm-up run in all.
    warmup_every_workload: bool = False

    @property
    def label(self) -> str:
        return ENGINE_LABELS.get(self.key, self.key)

    def weights_bytes(self) -> int:
        raise NotImplementedError

    def run(self, ids: list[int], n_decode: int) -> dict[str, Any]:
        """Prefill `ids` into a fresh cache, sample greedily, decode n_decode more tokens.

        Returns prefill_s (start -> first token on the host), decode_s (first -> last token)
        and tokens (the first token and the n_decode decoded ones).
        """
        raise NotImplementedError

    def last_logits(self, ids: list[int]) -> mx.array | None:
        return None


def _capacity(n_prompt: int, chunk: int) -> int:
    """The cache capacity the shell allocates for a prompt (engine/generate.py)."""
    if span_bucket is not None:  # span-aware shells pad the last chunk into a sink slot
        return bucket(n_prompt + 1, MIN_CAPACITY)
    return bucket(n_prompt + chunk, MIN_CAPACITY)


def _span_kw(needed: int, capacity: int) -> dict[str, int]:
    return {} if span_bucket is None else {"span": span_bucket(needed, capacity)}


class FxEngine(Engine):
    warmup_every_workload = True

    def __init__(self, model: Any, key: str):
        self.model, self.key = model, key
        self.notes = f"{model.weight_format}, prefill chunk {PREFILL_CHUNK}"

    def weights_bytes(self) -> int:
        return _unique_nbytes(tree_leaves(self.model.params))

    def _prefill(self, ids: list[int]) -> tuple[mx.array, Any]:
        m = self.model
        c, params = m.config, m.params
        chunk = bucket(min(PREFILL_CHUNK, len(ids)))
        capacity = _capacity(len(ids), chunk)
        cache = init_cache(cache_layout(c), 1, capacity,
                           getattr(mx, params.dtype))
        logits = None
        for start in range(0, len(ids), chunk):
            piece = ids[start : start + chunk]
            size = chunk if len(piece) == chunk else bucket(len(piece))
            padded = piece + [0] * (size - len(piece))
            logits, cache = prefill_step_compiled(
                params, cache, mx.array([padded], mx.int32), mx.array([len(piece)], mx.int32),
                **_span_kw(start + size, cache.capacity),
            )
            mx.eval(logits, *tree_leaves(cache))
        return logits, cache

    def run(self, ids: list[int], n_decode: int) -> dict[str, Any]:
        """Timed through fx_engine.stream itself (the Engine the shell serves with), so the
        benchmark measures the real path: chunking, span buckets, cache growth. EOS is
        suppressed with a logit bias so every engine decodes the same number of tokens."""
        m = self.model
        bias = {int(e): -1e9 for e in m.eos_ids}
        t0 = time.perf_counter()
        tokens: list[int] = []
        t1 = None
        for delta in fx_engine.stream(m, ids, max_tokens=n_decode + 1, logit_bias=bias):
            tokens.extend(delta.token_ids)
            if t1 is None and tokens:
                t1 = time.perf_counter()
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": tokens}

    def last_logits(self, ids: list[int]) -> mx.array:
        logits, _ = self._prefill(ids)
        return logits[0]


class MlxLmEngine(Engine):
    def __init__(self, model: nn.Module, key: str, notes: str, label: str | None = None):
        self.model, self.key, self.notes, self._label = model, key, notes, label

    @property
    def label(self) -> str:
        return self._label or ENGINE_LABELS.get(self.key, self.key)

    def weights_bytes(self) -> int:
        from mlx.utils import tree_flatten

        return _unique_nbytes([v for _, v in tree_flatten(self.model.parameters())])

    def run(self, ids: list[int], n_decode: int) -> dict[str, Any]:
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        t0 = time.perf_counter()
        gen = generate_step(mx.array(ids, mx.int32), self.model, max_tokens=n_decode + 1,
                            prompt_cache=cache)
        tok, _ = next(gen)
        tokens = [int(tok)]
        t1 = time.perf_counter()
        for _ in range(n_decode):
            tok, _ = next(gen)
            tokens.append(int(tok))
        t2 = time.perf_counter()
        gen.close()
        # generate_step queues one step ahead on its own stream: finish it outside the timing
        # (and before the next engine's run starts).
        mx.synchronize(generation_stream)
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": tokens}

    def last_logits(self, ids: list[int]) -> mx.array:
        from mlx_lm.models.cache import make_prompt_cache

        out = self.model(mx.array([ids], mx.int32), cache=make_prompt_cache(self.model))
        return out[0, -1].astype(mx.float32)


class LlamaCppEngine(Engine):
    key = "llama.cpp"

    def __init__(self, path: str, n_ctx: int):
        import llama_cpp

        self.path = path
        self.threads = os.cpu_count() or 1
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=512,
                                   n_threads=self.threads, n_threads_batch=self.threads,
                                   logits_all=False, verbose=False)
        try:  # which of llama.cpp's CPU paths this build runs (e.g. "AVX2 = 1 | AVX512 = 0")
            sysinfo = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        except Exception:  # noqa: BLE001 - informational only
            sysinfo = "?"
        self.notes = f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, " \
                     f"{self.threads} threads, n_batch 512; {sysinfo}"

    def weights_bytes(self) -> int:
        return os.path.getsize(self.path)

    def run(self, ids: list[int], n_decode: int) -> dict[str, Any]:
        self.llm.reset()  # no prefix reuse between runs
        t0 = time.perf_counter()
        gen = self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                repeat_penalty=1.0, reset=True)
        tokens = [int(next(gen))]
        t1 = time.perf_counter()
        for _ in range(n_decode):
            tokens.append(int(next(gen)))
        t2 = time.perf_counter()
        gen.close()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "tokens": tokens}


# ------------------------------------------------------------- building the mlx-lm peers


_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}


def _unpermute_rows(x: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved -> half-split RoPE); exact."""
    rows, rest = x.shape[0], x.shape[1:]
    return x.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def mlx_lm_quantized_from_gguf(path: str, cfg: Any) -> tuple[nn.Module, int]:
    """mlx-lm Model with the GGUF's own 4-/8-bit affine tensors in QuantizedLinear layers.

    Returns the model and the GGUF tensors' stored size (quantized weights + float16
    scales/biases + float32 norms), i.e. the bytes a GGUF-native kernel would stream.
    """
    tensors = mx.load(path)
    stored = sum(t.nbytes for t in tensors.values())
    w: dict[str, mx.array] = {}
    for name, t in tensors.items():
        if name.startswith("blk."):
            _, i, rest = name.split(".", 2)
            base, suffix = rest.rsplit(".", 1)
            if cfg.model_type == "llama" and base in ("attn_q", "attn_k"):
                t = _unpermute_rows(t, cfg.num_heads if base == "attn_q" else cfg.num_kv_heads)
            hf = f"model.layers.{i}.{_GGUF_TO_HF[base]}.{suffix}"
        elif name.startswith("token_embd."):
            hf = "model.embed_tokens." + name.split(".", 1)[1]
        elif name.startswith("output_norm."):
            hf = "model.norm." + name.split(".", 1)[1]
        elif name.startswith("output."):
            hf = "lm_head." + name.split(".", 1)[1]
        else:
            continue
        if t.dtype in (mx.float16, mx.bfloat16):
            t = t.astype(mx.float32)  # float32 activations (f16 on MLX CPU: ~30x slower)
        w[hf] = t
    if cfg.tie_word_embeddings:
        for s in ("weight", "scales", "biases"):
            w.pop(f"lm_head.{s}", None)
    # GGUF Q4_0/Q4_1/Q8_0 blocks hold 32 weights: group size 32; bits from the packed width.
    quant: dict[str, dict[str, int]] = {}
    for name, t in w.items():
        if name.endswith(".scales"):
            base = name[: -len(".scales")]
            in_f = t.shape[1] * 32
            quant[base] = {"group_size": 32, "bits": w[base + ".weight"].shape[1] * 32 // in_f}
    m = _mlx_lm_skeleton(cfg)
    nn.quantize(m, class_predicate=lambda p, _m: dict(quant[p]) if p in quant else False)
    m.load_weights(list(w.items()), strict=True)
    mx.eval(m.parameters())
    return m, stored


# ---------------------------------------------------------------------------- machine


def openblas_info() -> dict[str, Any] | None:
    """OpenBLAS's own view: the kernel set it picked (`corename`) and its thread count.

    An OpenBLAS older than the CPU can fall back to generic kernels (e.g. Debian's 0.3.21
    picks `Prescott`, SSE3, on Sapphire/Emerald Rapids); OPENBLAS_CORETYPE overrides it.
    """
    blas = fx_engine.runtime.blas.active()
    if blas.get("name") != "OpenBLAS" or not blas.get("path"):
        return None
    import ctypes

    try:
        lib = ctypes.CDLL(blas["path"])  # the already-loaded library: same handle
        out: dict[str, Any] = {"coretype_env": os.environ.get("OPENBLAS_CORETYPE")}
        for fn, restype in (("openblas_get_corename", ctypes.c_char_p),
                            ("openblas_get_config", ctypes.c_char_p),
                            ("openblas_get_num_threads", ctypes.c_int)):
            f = getattr(lib, fn)
            f.restype = restype
            v = f()
            out[fn.replace("openblas_get_", "")] = v.decode() if isinstance(v, bytes) else v
        return out
    except (OSError, AttributeError):
        return None


def fx_source_hash() -> str:
    """sha256 (16 hex) of fx_engine's sources (*.py and the native kernels' *.cpp): which
    engine version was measured."""
    import hashlib

    root = Path(fx_engine.__file__).resolve().parent
    h = hashlib.sha256()
    for f in sorted([*root.rglob("*.py"), *root.rglob("*.cpp")]):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


_BUSY: list[Any] = []
_BUSY_LOOP = "import time\nend = time.monotonic() + {limit}\nwhile time.monotonic() < end: pass\n"


def start_busy(n: int, limit: float = 4 * 3600) -> None:
    """n processes that each keep one core busy (a bounded loop: they end by themselves after
    `limit` seconds, and are killed when the tool exits), as another tenant would."""
    import atexit
    import subprocess

    for _ in range(n):
        _BUSY.append(subprocess.Popen([sys.executable, "-c", _BUSY_LOOP.format(limit=limit)]))
    atexit.register(lambda: [p.kill() for p in _BUSY])
    log(f"{n} busy-loop process(es) started")


def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                f = line.split(":", 1)[1].split()
                flags = [x for x in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                     "amx_tile", "neon") if x in f]
    except OSError:
        pass
    caches = {}
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            if kind != "Instruction":
                caches[f"L{level}"] = (idx / "size").read_text().strip()
        except OSError:
            pass
    mem_gb = None
    try:
        mem_gb = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError):
        pass
    try:
        import mlx_lm

        mlx_lm_version = getattr(mlx_lm, "__version__", "?")
    except ImportError:
        mlx_lm_version = None
    return {
        "cpu": cpu, "cpu_flags": flags, "caches": caches, "logical_cpus": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gb": mem_gb, "python": platform.python_version(), "platform": platform.platform(),
        "mlx": mx.__version__, "mlx_lm": mlx_lm_version, "fx_engine": fx_engine.__version__,
        "fx_engine_source_sha": fx_source_hash(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "blas": fx_engine.runtime.blas.active(), "openblas": openblas_info(),
        "device": str(mx.default_device()),
        # the native kernels' target (FX_ENGINE_NATIVE_ARCH measures another CPU's paths here)
        "native_arch": os.environ.get("FX_ENGINE_NATIVE_ARCH") or "native",
        # the 8-bit mode's many-row tiles on AMX where the CPU has it (FX_ENGINE_AMX=0: off)
        "native_amx": ("amx_tile" in flags and os.environ.get("FX_ENGINE_AMX") != "0"
                       and not os.environ.get("FX_ENGINE_NATIVE_ARCH")),
        "loadavg_start": os.getloadavg(),
    }


def _median_time(fn: Callable[[], Any], reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def measure_ceilings(reps: int = 5) -> dict[str, Any]:
    """Memory bandwidth and GEMM throughput this process's MLX + BLAS can reach."""
    out: dict[str, Any] = {}
    n = 64 * 2**20  # 256 MiB of float32
    a = mx.random.uniform(shape=(n,))
    mx.eval(a)
    t = _median_time(lambda: mx.eval(a + 1.0), reps)
    out["elementwise_rw_gbs"] = 2 * a.nbytes / t / 1e9  # read + write, MLX's own kernel
    t = _median_time(lambda: mx.eval(a.sum()), reps)
    out["reduce_read_gbs"] = a.nbytes / t / 1e9
    del a
    w = mx.random.uniform(shape=(16384, 8192))  # 512 MiB
    x = mx.random.uniform(shape=(1, 8192))
    mx.eval(w, x)
    t = _median_time(lambda: mx.eval(x @ w.T), reps)
    out["gemv_weight_gbs"] = w.nbytes / t / 1e9  # M=1 through MLX's matmul (BLAS)
    del w, x
    try:  # numpy's own (threaded) BLAS, independent of MLX: a second opinion on the machine
        import numpy as np

        wn = np.full((16384, 8192), 0.5, np.float32)
        xn = np.ones(8192, np.float32)
        t = _median_time(lambda: wn @ xn, reps)
        out["numpy_gemv_weight_gbs"] = wn.nbytes / t / 1e9
        dst = np.empty_like(wn)
        t = _median_time(lambda: np.copyto(dst, wn), reps)
        out["numpy_copy_rw_gbs"] = 2 * wn.nbytes / t / 1e9
        del wn, dst
    except Exception:  # pragma: no cover
        pass
    for m_rows in (512, 2048):
        xa = mx.random.uniform(shape=(m_rows, 576))
        wb = mx.random.uniform(shape=(3072, 576))
        mx.eval(xa, wb)
        t = _median_time(lambda: mx.eval(xa @ wb.T), reps)
        out[f"gemm_{m_rows}x576x3072_gflops"] = 2 * m_rows * 576 * 3072 / t / 1e9
    mx.clear_cache()
    return out


def measure_matmul_floor(model: Any, reps: int = 5) -> dict[str, Any]:
    """Only the model's weight matmuls, as MLX + BLAS run them: the floor of a step's time.

    decode: one row through every linear of every layer plus the tied/untied head (all the
    weight bytes once); prefill: a 512-row chunk through every layer's linears (the head
    only sees the last row, so it is left out).
    """
    p = model.params
    lins = [lin for lp in p.layers for lin in (lp.qkv, lp.o, lp.gate_up, lp.down)]
    head = p.lm_head if p.lm_head is not None else p.embed
    if any(lin.quantized for lin in [*lins, head]):
        return {}
    dt = getattr(mx, p.dtype)
    w = {id(lin): lin.dense_out_in for lin in [*lins, head]}  # [out, in] views
    xs = {n: mx.random.normal((1, n)).astype(dt) for n in {w[id(lin)].shape[1] for lin in lins}}
    xs512 = {n: mx.random.normal((512, n)).astype(dt) for n in xs}
    mx.eval(list(xs.values()), list(xs512.values()))
    dec = lambda: mx.eval([xs[w[id(l)].shape[1]] @ w[id(l)].T for l in [*lins, head]])  # noqa: E731
    pre = lambda: mx.eval([xs512[w[id(l)].shape[1]] @ w[id(l)].T for l in lins])  # noqa: E731
    t_dec = _median_time(dec, reps)
    t_pre = _median_time(pre, max(1, reps // 2))
    nbytes = sum(l.weight.nbytes for l in [*lins, head])
    flops = 2 * 512 * sum(l.weight.size for l in lins)
    mx.clear_cache()
    return {
        "matmul_floor_decode_tok_s": 1 / t_dec,
        "matmul_floor_decode_gbs": nbytes / t_dec / 1e9,
        "matmul_floor_prefill512_tok_s": 512 / t_pre,
        "matmul_floor_prefill512_gflops": flops / t_pre / 1e9,
        "weight_bytes_per_token_mb": nbytes / 1e6,
    }


def measure_breakdown(model: Any, decode_contexts: list[int], prefill_sizes: list[int],
                      reps: int = 9) -> dict[str, Any]:
    """Where a fx-engine step's time goes, at the cache capacity the shell would use.

    step_ms: the compiled step alone (the cache length pinned, so every repetition sees the
    same shapes and length): a decode step at the context, or the LAST 512-token prefill
    chunk of a prompt of that size; sdpa_ms: the same step's attention calls alone (all
    layers, MLX's fused SDPA over the whole capacity with a bool mask, as in the step).
    """
    from fx_engine.core.cache import with_lengths

    c, p = model.config, model.params
    dt = getattr(mx, p.dtype)
    sc = c.head_dim ** -0.5
    out: dict[str, Any] = {}

    def attention_ms(t: int, cap: int, length: int, n: int) -> float:
        q = mx.random.normal((1, c.num_heads, t, c.head_dim)).astype(dt)
        k = mx.random.normal((1, c.num_kv_heads, cap, c.head_dim)).astype(dt)
        v = mx.random.normal((1, c.num_kv_heads, cap, c.head_dim)).astype(dt)
        qpos = length + mx.arange(t)
        mask = (mx.arange(cap)[None, :] <= qpos[:, None])[None, None]
        mx.eval(q, k, v, mask)
        return _median_time(lambda: mx.eval([mx.fast.scaled_dot_product_attention(
            q, k, v, scale=sc, mask=mask) for _ in range(c.num_layers)]), n) * 1e3

    for ctx in decode_contexts:
        cap = _capacity(ctx, bucket(min(PREFILL_CHUNK, ctx)))
        kw = _span_kw(ctx + 1, cap)
        att = kw.get("span", cap)
        cache = with_lengths(init_cache(cache_layout(c), 1, cap, dt),
                             mx.array([ctx], mx.int32))
        box = {"state": init_state([SamplingConfig(temperature=0.0)], [[0]], c.vocab_size),
               "cache": cache}

        def step() -> None:
            # pop first: the step's inputs must have no other reference, or MLX cannot
            # update the cache in place and copies it (as the engine's shell does)
            st, ca = decode_step_compiled(p, box.pop("cache"), box.pop("state"), **kw)
            mx.eval(*tree_leaves(st), *tree_leaves(ca))
            int(st.tokens[0].item())
            box["state"], box["cache"] = st, with_lengths(ca, mx.array([ctx], mx.int32))

        out[f"decode@{ctx}"] = {"capacity": cap, "span": att,
                                "step_ms": _median_time(step, reps) * 1e3,
                                "sdpa_ms": attention_ms(1, att, ctx, reps)}
        del box, cache
        mx.clear_cache()
    for n in prefill_sizes:
        chunk = bucket(min(PREFILL_CHUNK, n))
        cap = _capacity(n, chunk)
        start = ((n - 1) // chunk) * chunk
        kw = _span_kw(start + chunk, cap)
        att = kw.get("span", cap)
        cache = with_lengths(init_cache(cache_layout(c), 1, cap, dt),
                             mx.array([start], mx.int32))
        toks = mx.zeros((1, chunk), mx.int32)
        nv = mx.array([chunk], mx.int32)
        box = {"cache": cache}

        def pstep() -> None:
            lg, ca = prefill_step_compiled(p, box.pop("cache"), toks, nv, **kw)
            mx.eval(lg, *tree_leaves(ca))
            box["cache"] = with_lengths(ca, mx.array([start], mx.int32))

        r = max(1, reps // 3)
        out[f"prefill@{n}(last chunk)"] = {
            "capacity": cap, "span": att, "chunk": chunk, "start": start,
            "step_ms": _median_time(pstep, r) * 1e3,
            "sdpa_ms": attention_ms(chunk, att, start, r)}
        del box, cache
        mx.clear_cache()
    return out


# ---------------------------------------------------------------------------- benchmark


def prompt_tokens(model: Any, n: int) -> list[int]:
    tok = model.tokenizer
    ids: list[int] = []
    text = TEXT
    while len(ids) < n:
        ids = list(tok.encode(text, add_special_tokens=False))
        text += TEXT
    return ids[:n]


def _chat_ids(model: Any) -> list[int]:
    from fx_engine.engine.generate import prompt_ids

    return prompt_ids(model, "What is the capital of France?", chat=True)


def compare_tokens(ref: list[int], other: list[int], eos: set[int]) -> tuple[int, int]:
    """(matching prefix, tokens compared), up to the first EOS of either sequence.

    The fx engines are timed with EOS suppressed (so every run decodes the same count) and
    the eager peers are not, so past an EOS the sequences legitimately part ways.
    """
    n = min(len(ref), len(other))
    for seq in (ref, other):
        for i, t in enumerate(seq[:n]):
            if t in eos:
                n = i  # fx cannot pick EOS (suppressed): compare what precedes it
                break
    same = 0
    for a, b in zip(ref[:n], other[:n]):
        if a != b:
            break
        same += 1
    return same, n


def agreement(engines: list[Engine], ref: Engine, ids: list[int], n_tokens: int,
              eos: set[int]) -> dict[str, Any]:
    """Greedy tokens and last-position logits of every engine against fx-engine's."""
    ref_run = ref.run(ids, n_tokens - 1)
    ref_logits = ref.last_logits(ids)
    out: dict[str, Any] = {"prompt_tokens": len(ids), "reference": ref.key,
                           "reference_tokens": ref_run["tokens"], "eos_ids": sorted(eos),
                           "engines": {}}
    for e in engines:
        r = e.run(ids, n_tokens - 1)
        same, compared = compare_tokens(ref_run["tokens"], r["tokens"], eos)
        info: dict[str, Any] = {"tokens": r["tokens"], "matching_prefix": same,
                                "compared": compared}
        lg = e.last_logits(ids)
        if lg is not None:
            diff = mx.abs(lg.astype(mx.float32) - ref_logits.astype(mx.float32))
            info["max_abs_logit_diff"] = float(diff.max().item())
            info["mean_abs_logit_diff"] = float(diff.mean().item())
            info["argmax_equal"] = bool((lg.argmax() == ref_logits.argmax()).item())
        out["engines"][e.key] = info
        mx.synchronize()
        mx.clear_cache()
    return out


def run_benchmark(engines: list[Engine], workloads: list[dict[str, Any]], ids: list[int],
                  runs: int, warmup: int,
                  checkpoint: Callable[[dict[str, Any], int], None] | None = None,
                  ) -> dict[str, Any]:
    """Warm up every (workload, engine), then `runs` rounds of every workload x engine.

    Rounds interleave workloads as well as engines, so a change of machine load during the
    benchmark falls on every ratio's numerator and denominator alike (including the
    decode@long / decode@short slowdown); the engine order rotates every round.
    """
    for wl in workloads:
        log(f"warm-up {wl['name']}: prompt {wl['context']} tokens, decode {wl['decode']}")
        for e in engines:
            if wl is not workloads[0] and not e.warmup_every_workload:
                continue
            for _ in range(warmup):
                t0 = time.perf_counter()
                e.run(ids[: wl["context"]], wl["decode"])
                mx.synchronize()
                log(f"  warm-up {e.key}: {time.perf_counter() - t0:.1f}s")
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {
        (wl["name"], e.key): [] for wl in workloads for e in engines}
    for r in range(runs):
        for wl in workloads:
            prompt, n_dec = ids[: wl["context"]], wl["decode"]
            order = engines[r % len(engines):] + engines[: r % len(engines)]
            for e in order:
                with MemProbe() as mem:
                    c0, w0 = os.times(), time.perf_counter()
                    res = e.run(prompt, n_dec)
                    c1, w1 = os.times(), time.perf_counter()
                res["cpu_util"] = ((c1.user - c0.user) + (c1.system - c0.system)) / (w1 - w0)
                res.update(mlx_extra=mem.mlx_extra, mlx_peak=mem.mlx_peak,
                           rss_peak_kb=mem.rss_peak_kb, rss_extra_kb=mem.rss_extra_kb,
                           round=r, loadavg=os.getloadavg()[0])
                samples[(wl["name"], e.key)].append(res)
                pre = len(prompt) / res["prefill_s"]
                dec = n_dec / res["decode_s"] if n_dec else float("nan")
                log(f"  round {r + 1}/{runs} {wl['name']:20s} {e.key:11s} prefill {pre:8.1f} tok/s"
                    + (f"  decode {dec:7.2f} tok/s" if n_dec else "")
                    + f"  (cpu {res['cpu_util']:.2f} cores, load {res['loadavg']:.2f})")
        if checkpoint is not None:  # a killed run still leaves its finished rounds on disk
            checkpoint(_aggregate(engines, workloads, samples), r + 1)
    return _aggregate(engines, workloads, samples)


def _aggregate(engines: list[Engine], workloads: list[dict[str, Any]],
               samples: dict[tuple[str, str], list[dict[str, Any]]]) -> dict[str, Any]:
    results: dict[str, dict[str, Any]] = {e.key: {"metrics": {}, "memory": {}} for e in engines}
    for wl in workloads:
        n_ctx, n_dec = wl["context"], wl["decode"]
        for e in engines:
            s = samples[(wl["name"], e.key)]
            if not s:
                continue
            res = results[e.key]
            if wl.get("prefill_metric"):
                v = [n_ctx / x["prefill_s"] for x in s]
                res["metrics"][wl["prefill_metric"]] = {"median": statistics.median(v), "runs": v}
            if wl.get("decode_metric"):
                v = [n_dec / x["decode_s"] for x in s]
                res["metrics"][wl["decode_metric"]] = {"median": statistics.median(v), "runs": v}
            res.setdefault("cpu_util", {})[wl["name"]] = statistics.median(
                x["cpu_util"] for x in s)
            res.setdefault("loadavg", {})[wl["name"]] = [round(x["loadavg"], 2) for x in s]
            res["memory"][wl["name"]] = {
                "mlx_extra_bytes": max(x["mlx_extra"] for x in s),
                "mlx_peak_bytes": max(x["mlx_peak"] for x in s),
                "rss_peak_kb": max(x["rss_peak_kb"] for x in s),
                "rss_extra_kb": max((x["rss_extra_kb"] or 0) for x in s)
                if all(x["rss_extra_kb"] is not None for x in s) else None,
            }
    return results


def _workloads(short_ctx: int, prefill_sizes: list[int], n_decode: int) -> list[dict[str, Any]]:
    long_ctx = max(prefill_sizes)
    wls = [{"name": f"decode@{short_ctx}", "context": short_ctx, "decode": n_decode,
            "decode_metric": f"decode@{short_ctx}"}]
    for n in sorted(prefill_sizes):
        if n == long_ctx:
            wls.append({"name": f"prefill+decode@{n}", "context": n, "decode": n_decode,
                        "prefill_metric": f"prefill@{n}", "decode_metric": f"decode@{n}"})
        else:
            wls.append({"name": f"prefill@{n}", "context": n, "decode": 0,
                        "prefill_metric": f"prefill@{n}"})
    return wls


# ------------------------------------------------------------------------------ report


def _label(report: dict[str, Any], key: str) -> str:
    return report.get("engines", {}).get(key, {}).get("label") or ENGINE_LABELS.get(key, key)


def _sci(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2e}"


def _fmt(v: float | None, nd: int = 1) -> str:
    if v is None or v != v:
        return "n/a"
    return f"{v:.{nd}f}"


def gguf_stream_bytes(path: str) -> dict[str, int]:
    """The file's bytes and the bytes a decode step reads: the tensors' data less an untied
    embedding table (only one row per token is gathered from it); of a mixture-of-experts
    layer's expert stacks (`*_exps`) only the chosen experts' share, expert_used_count /
    expert_count (a batch-1 step reads that many distinct experts per layer)."""
    out = {"file_bytes": Path(path).stat().st_size}
    try:
        from gguf import GGUFReader

        reader = GGUFReader(path)
        tensors = {t.name: int(t.n_bytes) for t in reader.tensors}
        embd = tensors.get("token_embd.weight", 0) if "output.weight" in tensors else 0
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""

        def meta_int(key: str) -> int:
            field = reader.fields.get(f"{arch}.{key}")
            return int(field.parts[field.data[0]][0]) if field else 0

        used, count = meta_int("expert_used_count"), meta_int("expert_count")
        experts = sum(v for k, v in tensors.items() if "_exps." in k)
        unread = experts - experts * used // count if used and count else 0
        out["tensor_bytes"] = sum(tensors.values())
        out["stream_bytes"] = out["tensor_bytes"] - embd - unread
    except Exception:  # pragma: no cover - the gguf package is optional here
        pass
    return out


def effective_bandwidth(report: dict[str, Any]) -> dict[str, Any] | None:
    """Per engine and decode metric: tok/s x file bytes, tok/s x streamed bytes (GB/s), and
    the latter over the measured DRAM read bandwidth."""
    bw = report.get("bandwidth")
    if not bw:
        return None
    dram = (bw.get("dram") or {}).get("gbs")
    fb, sb = bw["file_bytes"], bw.get("stream_bytes", bw["file_bytes"])
    out: dict[str, Any] = {}
    for k, v in report["results"].items():
        for m, vals in v["metrics"].items():
            if not m.startswith("decode@") or not vals:
                continue
            tok_s = vals["median"]
            out.setdefault(k, {})[m] = {
                "tok_s": tok_s, "file_gbs": tok_s * fb / 1e9, "stream_gbs": tok_s * sb / 1e9,
                "of_dram": (tok_s * sb / 1e9 / dram) if dram else None}
    return out


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Ratios and target verdicts from the medians."""
    res = report["results"]
    metrics = report["metric_names"]
    med = {k: {m: v["metrics"].get(m, {}).get("median") for m in metrics} for k, v in res.items()}
    fx = med.get("fx", {})
    ratios: dict[str, dict[str, float | None]] = {}
    for peer in ("fx-mlx", "mlx-lm", "mlx-lm-f32", "llama.cpp"):
        if peer in med:
            ratios[f"fx/{peer}"] = {
                m: (fx.get(m) / med[peer][m]) if fx.get(m) and med[peer].get(m) else None
                for m in metrics}
    if "fx-bi" in med:  # the cost of batch invariance: the share of fx's speed it keeps
        ratios["fx-bi/fx"] = {
            m: (med["fx-bi"][m] / fx[m]) if fx.get(m) and med["fx-bi"].get(m) else None
            for m in metrics}
    ref = report.get("llama_cpp_reference")
    if ref and "llama.cpp" not in med:
        ratios["fx/llama.cpp(reference)"] = {
            m: (fx.get(m) / ref[m]) if fx.get(m) and m in ref else None for m in metrics}
    short, long_ = report["short_context"], report["long_context"]
    targets = []
    llama = med.get("llama.cpp") or ref or {}
    llama_src = "measured" if "llama.cpp" in med else ("reference" if ref else None)

    def add(name: str, value: float | None, goal: float, higher: bool = True, note: str = "") -> None:
        met = None if value is None else (value >= goal if higher else value <= goal)
        targets.append({"target": name, "value": value, "goal": goal, "met": met, "note": note})

    d_short = f"decode@{short}"
    for peer in ("mlx-lm", "mlx-lm-f32"):
        if peer in med:
            r = ratios[f"fx/{peer}"].get(d_short)
            add(f"batch-1 decode >= 3x {_label(report, peer)} (same BLAS)", r, 3.0)
    if llama_src:
        key = "fx/llama.cpp" if llama_src == "measured" else "fx/llama.cpp(reference)"
        add("batch-1 decode >= 0.35x llama.cpp", ratios[key].get(d_short), 0.35, note=llama_src)
        for n in report["prefill_sizes"]:
            m = f"prefill@{n}"
            if m in llama:
                add(f"prefill@{n} >= 1.5x llama.cpp", ratios[key].get(m), 1.5, note=llama_src)
    if report.get("smoke"):
        targets = []  # a tiny random model: the tool ran, nothing to claim
    if fx.get(d_short) and fx.get(f"decode@{long_}") and not report.get("smoke"):
        add(f"decode@{long_} no more than 1.5x slower than decode@{short}",
            fx[d_short] / fx[f"decode@{long_}"], 1.5, higher=False, note="slowdown factor")
    return {"medians": med, "ratios": ratios, "targets": targets,
            "effective_bandwidth": effective_bandwidth(report)}


def render_markdown(report: dict[str, Any]) -> str:
    s = report["summary"]
    keys = list(report["results"])
    metrics = report["metric_names"]
    lines = []
    mi = report["machine"]
    if report.get("partial"):
        lines.append(f"**Partial report: {report.get('rounds_done')} of {report['runs']} rounds "
                     "finished.**")
    lines.append(f"Model: `{report['model']['path']}` ({report['model']['weight_format']}); "
                 f"runs: median of {report['runs']} after {report['warmup']} warm-up; "
                 f"decode {report['decode_tokens']} tokens.")
    lines.append(f"Machine: {mi['cpu']} (native kernels: {mi.get('native_arch', 'native')}), "
                 f"{mi['logical_cpus']} logical CPUs; MLX {mi['mlx']}, "
                 f"mlx-lm {mi['mlx_lm']}; BLAS {mi['blas']['name']}"
                 + (f" (core {mi['openblas']['corename']}, {mi['openblas']['num_threads']} threads"
                    + (f", OPENBLAS_CORETYPE={mi['openblas']['coretype_env']}"
                       if mi['openblas'].get('coretype_env') else "") + ")"
                    if mi.get("openblas") else "") + "; "
                 f"load average {tuple(round(x, 2) for x in mi['loadavg_start'])} at start, "
                 f"{tuple(round(x, 2) for x in report.get('loadavg_end', ()))} at end.")
    if mi.get("busy_processes"):
        lines.append(f"**Busy machine**: {mi['busy_processes']} busy-loop process(es) (one core "
                     "each) ran throughout (`--busy`).")
    lines.append("")
    lines.append("| tok/s (median) | " + " | ".join(_label(report, k) for k in keys) + " |")
    lines.append("|---|" + "---:|" * len(keys))
    for m in metrics:
        row = [m]
        for k in keys:
            v = report["results"][k]["metrics"].get(m)
            if v:
                lo, hi = min(v["runs"]), max(v["runs"])
                nd = 2 if v["median"] < 20 else 1
                row.append(f"{_fmt(v['median'], nd)} <sub>({_fmt(lo, nd)}-{_fmt(hi, nd)})</sub>")
            else:
                row.append("n/a")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| weights (MB) | " + " | ".join(
        _fmt(report["weights_bytes"][k] / 1e6, 0 if report["weights_bytes"][k] > 1e7 else 2)
        for k in keys) + " |")
    long_wl = report["workloads"][-1]["name"]
    lines.append(f"| KV + activations peak, {long_wl} (MB) | " + " | ".join(
        _fmt(report["results"][k]["memory"][long_wl]["mlx_extra_bytes"] / 1e6, 0)
        if k != "llama.cpp" else
        _fmt((report["results"][k]["memory"][long_wl]["rss_extra_kb"] or 0) / 1e3, 0) + " (RSS)"
        for k in keys) + " |")
    lines.append(f"| CPU cores busy (median), {long_wl} | " + " | ".join(
        _fmt(report["results"][k].get("cpu_util", {}).get(long_wl), 2) for k in keys) + " |")
    lines.append(f"| process peak RSS (all engines loaded), {long_wl} (MB) | " + " | ".join(
        _fmt(report["results"][k]["memory"][long_wl]["rss_peak_kb"] / 1e3, 0) for k in keys)
        + " |")
    lines.append("")
    lines.append("Ratios of medians (fx-engine / peer; fx/fx-mlx: what the native kernels "
                 "bring; fx-bi/fx: the share of fx-engine's speed the batch-invariant mode keeps):")
    lines.append("")
    lines.append("| ratio | " + " | ".join(metrics) + " |")
    lines.append("|---|" + "---:|" * len(metrics))
    for name, vals in s["ratios"].items():
        lines.append(f"| {name} | " + " | ".join(
            (_fmt(vals.get(m), 2) + "x") if vals.get(m) else "n/a" for m in metrics) + " |")
    eff = s.get("effective_bandwidth")
    if eff:
        bw = report["bandwidth"]
        d = bw.get("dram") or {}
        lines.append("")
        lines.append(f"Effective bandwidth of decode (tok/s x the file's {bw['file_bytes'] / 1e9:.3f} GB; "
                     f"x the {bw.get('stream_bytes', bw['file_bytes']) / 1e9:.3f} GB a step streams), "
                     "and the latter's fraction of the DRAM read bandwidth measured in this run"
                     + (f" ({d['gbs']:.1f} GB/s: {d['method']})" if d.get("gbs") else " (not measured)")
                     + ":")
        lines.append("")
        lines.append("| engine | metric | tok/s | GB/s (file) | GB/s (streamed) | of DRAM |")
        lines.append("|---|---|---:|---:|---:|---:|")
        for k, ms in eff.items():
            for m, v in ms.items():
                lines.append(f"| {_label(report, k)} | {m} | {_fmt(v['tok_s'], 2)} | "
                             f"{_fmt(v['file_gbs'])} | {_fmt(v['stream_gbs'])} | "
                             f"{_fmt(v['of_dram'], 2) if v['of_dram'] else 'n/a'} |")
    if report.get("llama_cpp_reference"):
        lines.append("")
        lines.append("llama.cpp(reference): " + ", ".join(
            f"{k} {v} tok/s" for k, v in report["llama_cpp_reference"].items())
            + f", from {REFERENCE_SOURCE}; not measured in this run.")
    if s["targets"]:
        lines.append("")
        lines.append("| target | value | goal | met |")
        lines.append("|---|---:|---:|:---:|")
    for t in s["targets"]:
        met = {True: "yes", False: "**no**", None: "n/a"}[t["met"]]
        note = f" ({t['note']})" if t["note"] else ""
        lines.append(f"| {t['target']}{note} | {_fmt(t['value'], 2)} | {t['goal']} | {met} |")
    ag = report.get("agreement")
    if ag:
        lines.append("")
        lines.append(f"Agreement with fx-engine on a {ag['prompt_tokens']}-token chat prompt "
                     f"(greedy, up to {len(ag['reference_tokens'])} tokens, compared up to the "
                     "first EOS: fx is timed with EOS suppressed):")
        lines.append("")
        lines.append("| engine | matching greedy prefix | argmax equal | max abs logit diff |")
        lines.append("|---|---:|:---:|---:|")
        for k, v in ag["engines"].items():
            lines.append(f"| {_label(report, k)} | {v['matching_prefix']}/"
                         f"{v.get('compared', len(ag['reference_tokens']))} | "
                         f"{v.get('argmax_equal', 'n/a')} | "
                         f"{_sci(v.get('max_abs_logit_diff'))} |")
    c = report.get("ceilings")
    if c:
        lines.append("")
        lines.append("Ceilings measured in this process: " + ", ".join(
            f"{k} {v:.1f}" for k, v in c.items()) + ".")
    bd = report.get("decode_breakdown")
    if bd and "error" not in bd:
        lines.append("")
        lines.append("fx-engine step breakdown (compiled step alone / its attention calls alone): "
                     + "; ".join(f"{k}: capacity {v['capacity']}, attention span "
                                 f"{v.get('span', v['capacity'])}, step {v['step_ms']:.1f} ms, "
                                 f"attention {v['sdpa_ms']:.1f} ms" for k, v in bd.items()) + ".")
    lines.append("")
    lines.append(f"Command: `{report['command']}`")
    return "\n".join(lines) + "\n"


def render_text(report: dict[str, Any]) -> str:
    keys = list(report["results"])
    metrics = report["metric_names"]
    w = max(len(_label(report, k)) for k in keys) + 2
    out = []
    head = f"{'tok/s (median)':{w}s}" + "".join(f"{m:>15s}" for m in metrics) + f"{'weights MB':>12s}"
    out.append(head)
    out.append("-" * len(head))
    for k in keys:
        row = f"{_label(report, k):{w}s}"
        for m in metrics:
            v = report["results"][k]["metrics"].get(m)
            row += f"{_fmt(v['median'] if v else None, 2):>15s}"
        row += f"{report['weights_bytes'][k] / 1e6:12.0f}"
        out.append(row)
    out.append("")
    for name, vals in report["summary"]["ratios"].items():
        out.append(f"{name:{w}s}" + "".join(
            f"{(_fmt(vals.get(m), 2) + 'x') if vals.get(m) else 'n/a':>15s}" for m in metrics))
    out.append("")
    for t in report["summary"]["targets"]:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        out.append(f"[{met:7s}] {t['target']}: {_fmt(t['value'], 2)} (goal {t['goal']})"
                   + (f" [{t['note']}]" if t["note"] else ""))
    ag = report.get("agreement")
    if ag:
        out.append("")
        for k, v in ag["engines"].items():
            out.append(f"agreement {k}: greedy prefix {v['matching_prefix']}/"
                       f"{v.get('compared', len(ag['reference_tokens']))}, max|dlogit| "
                       f"{_sci(v.get('max_abs_logit_diff'))}, argmax equal "
                       f"{v.get('argmax_equal', 'n/a')}")
    eff = report["summary"].get("effective_bandwidth")
    if eff:
        bw = report["bandwidth"]
        d = (bw.get("dram") or {}).get("gbs")
        out.append("")
        out.append(f"effective bandwidth (file {bw['file_bytes'] / 1e9:.3f} GB, streamed "
                   f"{bw.get('stream_bytes', bw['file_bytes']) / 1e9:.3f} GB per token; DRAM read "
                   + (f"{d:.1f} GB/s)" if d else "not measured)"))
        for k, ms in eff.items():
            for m, v in ms.items():
                out.append(f"  {_label(report, k):{w}s} {m:12s} {v['tok_s']:8.2f} tok/s  "
                           f"{v['file_gbs']:6.1f} GB/s (file)  {v['stream_gbs']:6.1f} GB/s (streamed)"
                           + (f"  {v['of_dram']:.2f} of DRAM" if v["of_dram"] else ""))
    if report.get("ceilings"):
        out.append("")
        out.append("ceilings: " + ", ".join(f"{k}={v:.1f}" for k, v in report["ceilings"].items()))
    return "\n".join(out)


# -------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--kv" in argv:  # the KV cache kinds benchmark (tools/bench_kv.py) takes the rest
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_kv

        return bench_kv.main([a for a in argv if a != "--kv"])
    if "--prefix" in argv:  # the prefix cache benchmark (tools/bench_prefix.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_prefix

        return bench_prefix.main([a for a in argv if a != "--prefix"])
    if "--server" in argv:  # the HTTP serving benchmark vs mlx_lm.server (tools/bench_server.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_server

        return bench_server.main([a for a in argv if a != "--server"])
    if "--spec" in argv:  # the speculative decoding benchmark (tools/bench_spec.py)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import bench_spec

        return bench_spec.main([a for a in argv if a != "--spec"])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file or HF folder (default: fx-engine's default model)")
    ap.add_argument("--runs", type=int, default=3, help="measured runs per engine and workload")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up runs (compile + JIT)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens: prefill 128/512, decode 16")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny random model, a few tokens; checks the tool runs (no timing claims)")
    ap.add_argument("--engines", default="fx,fx-bi,fx-mlx,mlx-lm,mlx-lm-f32,llama.cpp",
                    help="comma list among fx,fx-bi,fx-a8,fx-mlx,mlx-lm,mlx-lm-f32,llama.cpp")
    ap.add_argument("--short-context", type=int, default=None, help="prompt tokens for decode (64)")
    ap.add_argument("--prefill-sizes", default=None,
                    help="comma list (512,2048); the largest also carries the long-context decode")
    ap.add_argument("--decode-tokens", type=int, default=None, help="decoded tokens per run (64)")
    ap.add_argument("--no-ceilings", action="store_true", help="skip bandwidth/GEMM ceilings")
    ap.add_argument("--only-ceilings", action="store_true",
                    help="measure only the bandwidth/GEMM ceilings and fx's decode breakdown")
    ap.add_argument("--no-agreement", action="store_true", help="skip the agreement check")
    ap.add_argument("--no-dram", action="store_true",
                    help="skip the DRAM read bandwidth measurement (GGUF models: effective GB/s)")
    ap.add_argument("--render", metavar="JSON",
                    help="no measurement: re-render a saved --json report (text, --markdown)")
    ap.add_argument("--json", help="write the full report as JSON here")
    ap.add_argument("--markdown", help="write the tables as markdown here")
    ap.add_argument("--prefix", action="store_true",
                    help="the prefix cache benchmark instead (tools/bench_prefix.py)")
    ap.add_argument("--spec", action="store_true",
                    help="the speculative decoding benchmark instead (tools/bench_spec.py)")
    ap.add_argument("--server", action="store_true",
                    help="the HTTP serving benchmark instead (tools/bench_server.py; its own flags)")
    ap.add_argument("--kv", action="store_true",
                    help="the KV cache kinds benchmark instead (tools/bench_kv.py; its own flags)")
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N busy-loop processes (one core each) while measuring: a busy machine")
    ap.add_argument("--serving", action="store_true",
                    help="the serving workload instead: N concurrent requests through "
                         "fx_engine.Engine vs mlx-lm's BatchGenerator (tools/bench_serving.py)")
    ap.add_argument("--serving-n", default="1,8,32", help="concurrency levels (serving)")
    ap.add_argument("--serving-engines", default="fx,mlx-lm-f32",
                    help="serving engines: fx, fx-a8, mlx-lm-f32, mlx-lm, llama.cpp")
    ap.add_argument("--gen-tokens", type=int, default=None,
                    help="generated tokens per request (serving; 128)")
    ap.add_argument("--gen-range", default=None, metavar="LO,HI",
                    help="generated tokens per request drawn uniformly (serving; in place of "
                         "--gen-tokens: rows finish at different steps, as a server's do)")
    ap.add_argument("--prompt-range", default=None, metavar="LO,HI",
                    help="prompt lengths in tokens, drawn uniformly (serving; 64,512; "
                         "short chat turns: 20,120)")
    args = ap.parse_args(argv)
    if args.render:
        report = json.loads(Path(args.render).read_text())
        ag = report.get("agreement") or {}
        if ag.get("eos_ids") is not None:
            for v in ag["engines"].values():
                v["matching_prefix"], v["compared"] = compare_tokens(
                    ag["reference_tokens"], v["tokens"], set(ag["eos_ids"]))
        report["summary"] = summarize(report)
        print(render_text(report))
        if args.markdown:
            Path(args.markdown).write_text(render_markdown(report))
        return report

    short, sizes, n_dec = 64, [512, 2048], 64
    if args.quick:
        sizes, n_dec = [128, 512], 16
    if args.smoke:
        short, sizes, n_dec = 8, [16, 32], 4
        args.runs, args.warmup = min(args.runs, 1), min(args.warmup, 1)
        args.no_ceilings = True
    if args.short_context:
        short = args.short_context
    if args.prefill_sizes:
        sizes = [int(x) for x in args.prefill_sizes.split(",") if x.strip()]
    if args.decode_tokens is not None:
        n_dec = args.decode_tokens
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.only_ceilings:
        wanted = ["fx"]
    unknown = [e for e in wanted if e not in ENGINE_LABELS]
    if unknown:
        ap.error(f"unknown engine(s): {', '.join(unknown)}")

    tmp = None
    if args.smoke and not args.model:
        from fx_engine.testing import write_tiny_model

        tmp = tempfile.TemporaryDirectory(prefix="fx-bench-")
        path = str(write_tiny_model(Path(tmp.name) / "tiny"))
    elif args.model and args.model.startswith("synth:"):  # tools/synth_gguf.py's cached file
        import synth_gguf

        path = str(synth_gguf.resolve(args.model, log=log))
    elif args.model:
        path = str(Path(args.model).expanduser())
    else:
        from fx_engine.loading.default_model import DEFAULT_MODEL_FILE, default_model_path

        path = str(default_model_path())
    is_gguf = Path(path).is_file() and path.lower().endswith(".gguf")
    is_default = Path(path).name == "SmolLM2-135M-Instruct.Q4_1.gguf"

    info = machine_info()
    bandwidth = None
    if is_gguf and not args.smoke:
        bandwidth = gguf_stream_bytes(path)
        if not args.no_dram:  # before any model is loaded: the most free memory
            bandwidth["dram"] = membw.dram_read_gbs()
            log(f"DRAM read {bandwidth['dram']['gbs']:.1f} GB/s ({bandwidth['dram']['method']})")
    log(f"model {path}; MLX {info['mlx']}, mlx-lm {info['mlx_lm']}, BLAS {info['blas']['name']} "
        f"{info['openblas'] or ''}")
    t0 = time.perf_counter()
    fx_model = fx_engine.load(path, **FX_EXACT)
    log(f"loaded fx-engine model in {time.perf_counter() - t0:.1f}s ({fx_model.weight_format})")
    if fx_model.matmul_report is not None:
        info["matmul_plan"] = fx_model.matmul_report.lines()
    if args.busy:
        info["busy_processes"] = args.busy
        start_busy(args.busy)

    if args.serving:
        return _serving_main(args, argv, path, is_gguf, fx_model, info, tmp)

    engines: list[Engine] = []
    skipped: dict[str, str] = {}
    fx_eng = FxEngine(fx_model, "fx")
    engines.append(fx_eng)  # the reference of every ratio: always measured
    if "fx-bi" in wanted:
        engines.append(FxEngine(fx_engine.load(path, batch_invariant=True, **FX_EXACT), "fx-bi"))
    if "fx-mlx" in wanted:
        engines.append(FxEngine(fx_engine.load(path, native=False), "fx-mlx"))
    if "fx-a8" in wanted:
        engines.append(FxEngine(fx_engine.load(path, **FX_A8), "fx-a8"))
    gguf_stored = None
    if "mlx-lm" in wanted:
        try:
            if is_gguf:
                m, gguf_stored = mlx_lm_quantized_from_gguf(path, fx_model.config)
                notes = "GGUF tensors as MLX affine triples in QuantizedLinear/QuantizedEmbedding" \
                        " (group 32; Q4_1->4-bit, Q8_0->8-bit), float32 scales/activations"
            else:
                from mlx_lm.utils import load_model

                m, _ = load_model(Path(path))
                notes = "mlx_lm.utils.load_model on the folder"
            label = None if is_gguf else "mlx-lm (natural: load_model)"
            engines.append(MlxLmEngine(m, "mlx-lm", notes, label))
        except Exception as e:  # report, don't die: the other engines still compare
            skipped["mlx-lm"] = f"{type(e).__name__}: {e}"
    if "mlx-lm-f32" in wanted:
        try:
            engines.append(MlxLmEngine(mlx_lm_dense_from_fx(fx_model), "mlx-lm-f32",
                                       "fx-engine's dense float32 arrays, q/k/v and gate/up split"))
        except Exception as e:
            skipped["mlx-lm-f32"] = f"{type(e).__name__}: {e}"
    if "llama.cpp" in wanted:
        try:
            import llama_cpp  # noqa: F401

            if not is_gguf:
                skipped["llama.cpp"] = "model is not a GGUF file"
            else:
                engines.append(LlamaCppEngine(path, n_ctx=max(sizes) + n_dec + 64))
        except ImportError:
            skipped["llama.cpp"] = "llama_cpp (llama-cpp-python) is not importable"
        except Exception as e:
            skipped["llama.cpp"] = f"{type(e).__name__}: {e}"
    for k, why in skipped.items():
        log(f"skipping {k}: {why}")

    ceilings, breakdown = None, None
    if not args.no_ceilings or args.only_ceilings:
        log("measuring bandwidth / GEMM ceilings")
        ceilings = measure_ceilings()
        ceilings.update(measure_matmul_floor(fx_model))
        try:
            breakdown = measure_breakdown(fx_model, [short, max(sizes)], sorted(sizes))
        except Exception as e:  # a diagnostic only: never fail the benchmark for it
            breakdown = {"error": f"{type(e).__name__}: {e}"}
        log(f"ceilings {ceilings}; decode breakdown {breakdown}")
    if args.only_ceilings:
        print(json.dumps({"ceilings": ceilings, "decode_breakdown": breakdown,
                          "machine": info}, indent=1, default=str))
        return {"ceilings": ceilings, "decode_breakdown": breakdown}

    ag = None
    if not args.no_agreement:
        log("agreement check (greedy tokens, last-position logits)")
        ag = agreement(engines[1:], fx_eng, _chat_ids(fx_model), 16 if not args.smoke else 4,
                       set(fx_model.eos_ids))

    wls = _workloads(short, sizes, n_dec)
    ids = prompt_tokens(fx_model, max(short, *sizes))

    metric_names = ([f"decode@{short}"] + [f"prefill@{n}" for n in sorted(sizes)]
                    + [f"decode@{max(sizes)}"])
    weights = {e.key: e.weights_bytes() for e in engines}

    def make_report(results: dict[str, Any], rounds_done: int) -> dict[str, Any]:
        return {
            "command": " ".join(["python", "tools/bench.py",
                                 *(argv if argv is not None else sys.argv[1:])]),
            "smoke": args.smoke, "partial": rounds_done < args.runs,
            "rounds_done": rounds_done, "machine": info, "loadavg_end": os.getloadavg(),
            "model": {"path": path, "weight_format": fx_model.weight_format,
                      "fingerprint": fx_model.fingerprint, "config": {
                          k: getattr(fx_model.config, k) for k in (
                              "model_type", "num_layers", "hidden_size", "num_heads",
                              "num_kv_heads", "intermediate_size", "vocab_size")},
                      "gguf_tensor_bytes": gguf_stored},
            "runs": args.runs, "warmup": args.warmup, "decode_tokens": n_dec,
            "short_context": short, "long_context": max(sizes), "prefill_sizes": sorted(sizes),
            "workloads": wls, "metric_names": metric_names,
            "engines": {e.key: {"label": e.label, "notes": e.notes} for e in engines},
            "skipped": skipped, "weights_bytes": weights,
            "results": results, "agreement": ag, "ceilings": ceilings,
            "decode_breakdown": breakdown, "bandwidth": bandwidth,
            "llama_cpp_reference": (
                {k: v for k, v in LLAMA_CPP_REFERENCE.items() if k in metric_names}
                if is_default and "llama.cpp" not in {e.key for e in engines} else None),
        }

    def build(results: dict[str, Any], rounds_done: int) -> dict[str, Any]:
        rep = make_report(results, rounds_done)
        rep["summary"] = summarize(rep)
        return rep

    def checkpoint(results: dict[str, Any], rounds_done: int) -> None:
        if args.json and rounds_done < args.runs:
            Path(args.json).write_text(json.dumps(build(results, rounds_done), indent=1, default=str))
            log(f"checkpoint: {rounds_done}/{args.runs} rounds written to {args.json}")

    results = run_benchmark(engines, wls, ids, args.runs, args.warmup, checkpoint)
    report = build(results, args.runs)
    print(render_text(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        log(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(report))
        log(f"wrote {args.markdown}")
    if tmp is not None:
        tmp.cleanup()
    return report


def _range_arg(flag: str, value: str) -> tuple[int, int]:
    """A LO,HI option's two integers, 1 <= LO <= HI (SystemExit naming the flag)."""
    try:
        lo, hi = (int(x) for x in value.split(","))
    except ValueError:
        raise SystemExit(f"{flag} must be LO,HI (two integers), got {value!r}")
    if not 1 <= lo <= hi:
        raise SystemExit(f"{flag} needs 1 <= LO <= HI, got {value!r}")
    return lo, hi


def _serving_main(args: Any, argv: list[str] | None, path: str, is_gguf: bool, fx_model: Any,
                  info: dict[str, Any], tmp: Any) -> dict[str, Any]:
    """`--serving`: fx_engine.Engine vs mlx-lm's BatchGenerator (see tools/bench_serving.py)."""
    import bench_serving as bs  # noqa: PLC0415  (tools/ is on sys.path when run as a script)

    ns = [int(x) for x in args.serving_n.split(",") if x.strip()]
    gen, lo_hi = args.gen_tokens or bs.GEN_TOKENS, bs.PROMPT_RANGE
    if args.prompt_range:
        lo_hi = _range_arg("--prompt-range", args.prompt_range)
    if args.gen_range:
        if args.gen_tokens:
            raise SystemExit("give --gen-tokens or --gen-range, not both")
        gen = _range_arg("--gen-range", args.gen_range)
    if args.smoke:
        ns, gen, lo_hi = [1, 2], gen if args.gen_range else (args.gen_tokens or 4), (8, 16)
    engines: dict[str, tuple[str, Any]] = {}
    labels: dict[str, str] = {}
    for key in [e.strip() for e in args.serving_engines.split(",") if e.strip()]:
        if key == "fx":
            engines[key] = ("fx", fx_model)
        elif key == "fx-a8":
            engines[key] = ("fx", fx_engine.load(path, **FX_A8))
        elif key == "mlx-lm-f32":
            engines[key] = ("mlx-lm", mlx_lm_dense_from_fx(fx_model))
        elif key == "mlx-lm":
            if is_gguf:
                engines[key] = ("mlx-lm", mlx_lm_quantized_from_gguf(path, fx_model.config)[0])
            else:
                from mlx_lm.utils import load_model

                engines[key] = ("mlx-lm", load_model(Path(path))[0])
        elif key == "llama.cpp":
            if not is_gguf:
                raise SystemExit("serving engine llama.cpp needs a GGUF model")
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                raise SystemExit("serving engine llama.cpp needs llama-cpp-python (not installed)")
            engines[key] = ("llama.cpp", path)
        else:
            raise SystemExit(f"unknown serving engine {key!r} (fx, fx-a8, mlx-lm-f32, mlx-lm, llama.cpp)")
        labels[key] = ENGINE_LABELS[key]
    results = bs.run_serving(engines, fx_model, ns, args.runs, args.warmup, gen, lo_hi,
                             prompt_tokens, log)
    report = {
        "command": " ".join(["python", "tools/bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "smoke": args.smoke, "machine": info, "loadavg_end": os.getloadavg(),
        "model": {"path": path, "weight_format": fx_model.weight_format,
                  "fingerprint": fx_model.fingerprint},
        "engines": {k: {"label": labels[k]} for k in engines},
        "serving": {"ns": ns, "gen_tokens": gen if isinstance(gen, int) else list(gen), "prompt_range": list(lo_hi),
                    "runs": args.runs,
                    "warmup": args.warmup, "results": results},
    }
    md = bs.render_serving(report, lambda k: labels.get(k, k))
    print("\n".join(md))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        log(f"wrote {args.json}")
    if args.markdown:
        Path(args.markdown).write_text("\n".join(md).lstrip() + "\n")
        log(f"wrote {args.markdown}")
    if tmp is not None:
        tmp.cleanup()
    return report


if __name__ == "__main__":
    main()
