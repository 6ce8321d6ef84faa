"""What a numerics choice costs in quality: KL divergence, top-1 agreement and perplexity of
teacher-forced logits on held-out text, against fx-engine's float32 numerics (issue 41,
item 4; docs/numerics.md).

    python tools/quality.py [--model FILE ...] [--ref-model FILE] [--text PATH]
                            [--window 512] [--tokens N] [--engines fx-a8,fx-a8-kv16,llama.cpp]
                            [--json OUT.json] [--markdown OUT.md]

For each model file (default: the default model), the reference is fx-engine's default
numerics on that file (`fx_engine.load(FILE, numerics="exact")`: float32 activations, the quantized weights
as stored). Each candidate engine runs the same token ids (fx-engine's tokenizer; llama.cpp
is fed the ids, never the text) over the same non-overlapping windows of `--window` tokens,
each window a fresh context. Per candidate, over every position that predicts a next token:

- KL(ref || candidate) per token (mean, its standard error, median, 99th percentile, max);
- top-1 agreement: the candidate's argmax equals the reference's;
- perplexity of the candidate and of the reference on the text's next tokens.

Candidates (`--engines`): `fx-a8` (`numerics="int8"`), `fx-a8-kv16` (that and a float16 KV
cache: tools/bench.py's fx-a8), `fx-kv16` (the float16 KV cache alone), `llama.cpp`
(llama-cpp-python, its default numerics: 8-bit activations for quantized weights, float16
KV cache; skipped when not installed). With more than one `--model`, each other file's
float32 numerics is also compared against `--ref-model`'s (default: the first file): the
cost of the weights' own quantization (e.g. the same model in Q4_0 against Q8_0), on the
same scale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"  # on every Debian/Ubuntu machine

# fx-engine's candidate numerics: load() keyword arguments
FX_ENGINES: dict[str, dict[str, Any]] = {
    "fx-a8": {"numerics": "int8"},
    "fx-a8-kv16": {"numerics": "int8", "kv_dtype": "float16"},
    "fx-kv16": {"numerics": "exact", "kv_dtype": "float16"},
}
ENGINES = (*FX_ENGINES, "llama.cpp")
DEFAULT_ENGINES = "fx-a8,fx-a8-kv16,llama.cpp"


# --- the math (pure numpy; tests/tools/test_quality.py checks it) -------------------------

def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-probabilities along the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def token_stats(ref_logits: np.ndarray, cand_logits: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per position t of [T, V] logits: KL(ref || cand), whether the argmaxes agree, and the
    negative log-likelihoods of targets[t] (the next token) under each."""
    lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)
    kl = np.sum(np.exp(lp) * (lp - lq), axis=-1)
    rows = np.arange(len(targets))
    return {
        "kl": np.maximum(kl, 0.0),  # >= 0 exactly; rounding can leave -1e-17
        "top1": np.argmax(ref_logits, axis=-1) == np.argmax(cand_logits, axis=-1),
        "nll_ref": -lp[rows, targets],
        "nll": -lq[rows, targets],
    }


def summarize(kl: np.ndarray, top1: np.ndarray, nll: np.ndarray, nll_ref: np.ndarray) -> dict[str, float]:
    """Aggregate per-token arrays: KL (mean, standard error, median, p99, max), top-1
    agreement, both perplexities (exp of the mean NLL) and their ratio."""
    n = len(kl)
    ppl, ppl_ref = math.exp(float(np.mean(nll))), math.exp(float(np.mean(nll_ref)))
    return {
        "tokens": int(n),
        "kl_mean": float(np.mean(kl)),
        "kl_stderr": float(np.std(kl, ddof=1) / math.sqrt(n)) if n > 1 else float("nan"),
        "kl_median": float(np.median(kl)),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(np.max(kl)),
        "top1": float(np.mean(top1)),
        "ppl": ppl,
        "ppl_ref": ppl_ref,
        "ppl_ratio": ppl / ppl_ref,
    }


def windows(ids: list[int], window: int) -> list[list[int]]:
    """Non-overlapping full windows (a text shorter than one window: one window of it)."""
    if len(ids) < 2:
        raise ValueError(f"need at least 2 tokens, got {len(ids)}")
    if len(ids) <= window:
        return [ids]
    return [ids[i : i + window] for i in range(0, len(ids) - window + 1, window)]


# --- engines: each a function token ids -> logits [T, V] float32 ---------------------------

Logits = Callable[[list[int]], np.ndarray]


def fx_logits_fn(model: Any) -> Logits:
    import fx_engine

    return lambda ids: np.array(fx_engine.logits(model, ids, chunk=max(len(ids), 16)), dtype=np.float32)


class LlamaCpp:
    """llama-cpp-python over token ids, every position's logits, a fresh context per call."""

    def __init__(self, path: str, n_ctx: int) -> None:
        import llama_cpp

        threads = os.cpu_count() or 1
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                                   n_threads=threads, n_threads_batch=threads,
                                   logits_all=True, verbose=False)
        try:
            sysinfo = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
        except Exception:  # noqa: BLE001 - informational only
            sysinfo = "?"
        self.notes = (f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {threads} threads, "
                      f"n_batch {n_ctx}, its default numerics; {sysinfo}")

    def __call__(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()  # n_tokens = 0: eval() drops the whole KV cache first
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)], dtype=np.float32)

    def close(self) -> None:
        self.llm.close()


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


# --- the run ----------------------------------------------------------------------------

def _machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                info["cpu"] = line.split(":", 1)[1].strip()
            if line.startswith("Flags:"):
                flags = line.split(":", 1)[1].split()
                info["cpu_flags"] = sorted(f for f in flags if f.startswith(("avx512", "avx_vnni", "amx", "avx2")))
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        from fx_engine.runtime import native

        info["fx_native_isa"] = native.isa() if native.available() else None
        info["fx_int8_dot"] = native.int8_dot_isa() if native.available() and native.int8_dot() else None
    except Exception:  # noqa: BLE001 - informational only
        pass
    return info


def _label(path: str) -> str:
    return Path(path).name


def run(models: list[str], ref_model: str | None, text_path: str, window: int, max_tokens: int,
        engines: list[str], log: Callable[[str], None] = print) -> dict[str, Any]:
    import fx_engine

    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"unknown engine(s) {unknown} (choose among {', '.join(ENGINES)})")
    skipped: dict[str, str] = {}
    if "llama.cpp" in engines and not llama_cpp_available():
        skipped["llama.cpp"] = "llama-cpp-python is not installed"
        engines = [e for e in engines if e != "llama.cpp"]
    ref_model = ref_model or models[0]
    if ref_model not in models:
        models = [ref_model, *models]
    else:  # the cross-file reference first: its logits are saved for the other files
        models = [ref_model, *(m for m in models if m != ref_model)]

    raw = Path(text_path).read_bytes()
    text = raw.decode("utf-8", errors="replace")
    t0 = time.perf_counter()
    ref_fx = fx_engine.load(ref_model, numerics="exact")
    ids = ref_fx.tokenizer.encode(text)  # the model asks for no BOS: the same ids as llama.cpp's
    if max_tokens:
        ids = ids[:max_tokens]
    wins = windows(ids, window)
    log(f"text {text_path}: {len(ids)} tokens, {len(wins)} windows of {len(wins[0])}")
    report: dict[str, Any] = {
        "text": {"path": text_path, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                 "tokens": len(ids), "scored_tokens": sum(len(w) - 1 for w in wins),
                 "windows": len(wins), "window": len(wins[0])},
        "ref_model": ref_model, "engines": engines, "skipped": skipped, "machine": _machine(),
        "models": {}, "rows": [],
    }
    tmp = tempfile.TemporaryDirectory(prefix="fx-quality-")
    try:
        for path in models:
            ref = ref_fx if path == ref_model else fx_engine.load(path, numerics="exact")
            label = _label(path)
            entry = {"path": str(path), "bytes": os.path.getsize(path), "fx_weights": ref.weight_format}
            report["models"][label] = entry
            cands: dict[str, Logits] = {}
            closers = []
            for e in engines:
                if e in FX_ENGINES:
                    cands[e] = fx_logits_fn(fx_engine.load(path, **FX_ENGINES[e]))
                else:
                    lc = LlamaCpp(str(path), n_ctx=len(wins[0]))
                    entry["llama.cpp"] = lc.notes
                    cands[e] = lc
                    closers.append(lc.close)
            cross = path != ref_model
            acc: dict[str, dict[str, list[np.ndarray]]] = {
                k: {"kl": [], "top1": [], "nll": [], "nll_ref": []}
                for k in ([*cands, "weights"] if cross else cands)
            }
            ref_fn = fx_logits_fn(ref)
            for i, w in enumerate(wins):
                tw = time.perf_counter()
                targets = np.asarray(w[1:])
                r = ref_fn(w)[:-1]
                if not cross:  # the cross-file reference, kept for the other files
                    np.save(Path(tmp.name) / f"{i}.npy", r)
                else:
                    base = np.load(Path(tmp.name) / f"{i}.npy")
                    st = token_stats(base, r, targets)
                    for k, v in st.items():
                        acc["weights"][k].append(v)
                for name, fn in cands.items():
                    st = token_stats(r, fn(w)[:-1], targets)
                    for k, v in st.items():
                        acc[name][k].append(v)
                log(f"  {label} window {i + 1}/{len(wins)} ({time.perf_counter() - tw:.1f} s)")
            for close in closers:
                close()
            ppl_ref = None
            for name, a in acc.items():
                s = summarize(*(np.concatenate(a[k]) for k in ("kl", "top1", "nll", "nll_ref")))
                if name == "weights":
                    row = {"model": label, "engine": "fx (float32)", "reference": f"fx (float32), {_label(ref_model)}",
                           **s}
                else:
                    row = {"model": label, "engine": name, "reference": "fx (float32), same file", **s}
                    ppl_ref = s["ppl_ref"]
                report["rows"].append(row)
                log(f"  {label} {row['engine']} vs {row['reference']}: KL mean {s['kl_mean']:.5f} "
                    f"p99 {s['kl_p99']:.5f} top-1 {s['top1']:.4f} ppl {s['ppl']:.3f} (ref {s['ppl_ref']:.3f})")
            if ppl_ref is None:  # no candidates: the reference's own perplexity
                nll = [-log_softmax(ref_fn(w)[:-1])[np.arange(len(w) - 1), w[1:]] for w in wins]
                ppl_ref = math.exp(float(np.mean(np.concatenate(nll))))
            entry["ppl_fx_float32"] = ppl_ref
    finally:
        tmp.cleanup()
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def _g(x: float, digits: int = 3) -> str:
    """A KL figure: `digits` significant digits, plain decimals down to 1e-4 (0 stays 0)."""
    if x == 0 or abs(x) >= 1e-4:
        return f"{x:.{digits}g}" if abs(x) < 1 else f"{x:.{digits}f}"
    return f"{x:.{digits - 1}e}"


def markdown(report: dict[str, Any]) -> str:
    t = report["text"]
    lines = [
        f"Text: `{t['path']}` ({t['bytes']} bytes, sha256 {t['sha256'][:12]}...), {t['tokens']} tokens, "
        f"{t['windows']} windows of {t['window']} (each a fresh context), {t['scored_tokens']} scored positions.",
        "",
        "| model file | candidate | reference | KL mean (± s.e.) | KL median | KL p99 | KL max | top-1 agree | PPL | PPL ref | PPL ratio |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['reference']} | {_g(r['kl_mean'])} ± {_g(r['kl_stderr'], 2)} | "
            f"{_g(r['kl_median'])} | {_g(r['kl_p99'])} | {_g(r['kl_max'])} | {100 * r['top1']:.2f}% | "
            f"{r['ppl']:.3f} | {r['ppl_ref']:.3f} | {r['ppl_ratio']:.4f} |")
    lines += ["", "| model file | bytes | fx-engine weights | PPL, fx float32 |", "|---|---:|---|---:|"]
    for label, m in report["models"].items():
        lines.append(f"| {label} | {m['bytes']} | {m['fx_weights']} | {m['ppl_fx_float32']:.3f} |")
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    return "\n".join(lines) + "\n"


def main(argv: Iterable[str] | None = None) -> dict[str, Any]:
    import fx_engine

    fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
    os.environ.setdefault("FX_ENGINE_OFFLINE", "1")
    from fx_engine.loading.default_model import default_model_path

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None,
                    help="a GGUF file or model folder (repeatable; default: the default model)")
    ap.add_argument("--ref-model", default=None,
                    help="the file whose float32 numerics the other files' are compared with (default: the first)")
    ap.add_argument("--text", default=DEFAULT_TEXT, help=f"held-out text (default {DEFAULT_TEXT})")
    ap.add_argument("--window", type=int, default=512, help="tokens per window (a fresh context each)")
    ap.add_argument("--tokens", type=int, default=0, help="use the text's first N tokens (0: all)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help=f"comma list among {','.join(ENGINES)}")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--markdown", default=None, help="write the tables here")
    a = ap.parse_args(list(argv) if argv is not None else None)
    if a.window < 2:
        raise SystemExit("--window must be >= 2")
    models = [str(m) for m in (a.model or [default_model_path()])]
    engines = [e.strip() for e in a.engines.split(",") if e.strip()]
    report = run(models, a.ref_model, a.text, a.window, a.tokens, engines,
                 log=lambda s: print(s, file=sys.stderr, flush=True))
    report["command"] = " ".join(["python", "tools/quality.py", *(list(argv) if argv is not None else sys.argv[1:])])
    md = markdown(report)
    print(md)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    if a.markdown:
        Path(a.markdown).write_text(md)
    return report


if __name__ == "__main__":
    main()
