"""KV cache kinds benchmark (`python tools/bench_kv.py`, or `tools/bench.py --kv`).

For the dense float cache and the 8-bit and 4-bit quantized caches (group 64, every position
quantized: quantized_kv_start=0), at 4k and 8k tokens of context, on the default model:

  memory      KV bytes per token of context, from the arrays each engine allocates;
  decode      tokens/s of greedy batch-1 decoding with the context already in the cache
              (median over --runs runs of --decode-tokens steps, after a warm-up run).

Peers, in the same process and on the same dense float32 weights:
  fx       fx-engine's decode_step (compiled) over its cache kind, spans as the shell picks;
  mlx-lm   mlx-lm's generate_step over its KVCache / QuantizedKVCache.

The context is random K/V content written straight into the caches (decode speed does not
depend on the values; prefilling 8k tokens per kind would dominate the run time). Each
cache holds context + 256 slots for mlx-lm (no growth during the measurement) and the shell's
power-of-two capacity bucket for fx-engine; memory per token is per slot.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx  # noqa: E402

from fx_engine.core.cache import LayerKV, QuantKV, bytes_per_token, span_bucket, with_lengths  # noqa: E402
from fx_engine.engine.scheduler import capacity_bucket  # noqa: E402
from fx_engine.core.sampling import SamplingConfig  # noqa: E402
from fx_engine.core.state import init_state  # noqa: E402
from fx_engine.core.steps import decode_step_compiled  # noqa: E402
from fx_engine.core.tree import tree_leaves  # noqa: E402

KINDS = {"dense": None, "8-bit": 8, "4-bit": 4}
GROUP = 64


def _random_like(x: mx.array, key: mx.array) -> mx.array:
    return mx.random.normal(x.shape, key=key).astype(x.dtype)


def fx_filled_cache(model: Any, ctx: int, cap: int) -> Any:
    """A 1-row cache of `model`'s layout whose first ctx positions hold random K/V."""
    cache = model.new_cache(1, cap)
    keys = iter(mx.random.split(mx.random.key(0), 4 * len(cache.layers)))
    layers = []
    for e, s in zip(cache.layers, cache.layout):
        if isinstance(e, QuantKV):
            shape = (1, s.kv_heads, e.keys[0].shape[2], s.head_dim)
            q = lambda: tuple(mx.quantize(mx.random.normal(shape, key=next(keys)),  # noqa: E731
                                          group_size=s.group_size, bits=s.bits))
            layers.append(QuantKV(e.head_keys, e.head_values, q(), q()))
        else:
            assert isinstance(e, LayerKV)
            layers.append(LayerKV(_random_like(e.keys, next(keys)), _random_like(e.values, next(keys))))
    out = with_lengths(type(cache)(layers=tuple(layers), lengths=cache.lengths, layout=cache.layout,
                                   capacity=cache.capacity), mx.array([ctx], mx.int32))
    mx.eval(tree_leaves(out))
    return out


def fx_decode(model: Any, ctx: int, n: int, runs: int) -> dict[str, Any]:
    cap = capacity_bucket(ctx + n + 1)
    base = fx_filled_cache(model, ctx, cap)
    p = model.params
    times = []
    for r in range(runs + 1):  # the first run warms up (compiles each span)
        cache = base
        state = init_state([SamplingConfig(temperature=0.0)], [[1]], model.config.vocab_size)
        mx.eval(tree_leaves(state))
        t0 = time.perf_counter()
        for i in range(n):
            state, cache = decode_step_compiled(p, cache, state, span=span_bucket(ctx + i + 1, cap))
            mx.eval(*tree_leaves(state), *tree_leaves(cache))
            int(state.tokens[0].item())
        if r:
            times.append(time.perf_counter() - t0)
        # decode writes in place: restore the base content's lengths (values past ctx unused)
        base = with_lengths(cache, mx.array([ctx], mx.int32))
        del cache, state
    per = bytes_per_token(base.layout, model.dtype)
    return {"tok_s": n / statistics.median(times), "bytes_per_token": per,
            "cache_bytes": base.nbytes, "capacity": cap}


def mlx_lm_caches(ref: Any, model: Any, bits: int | None, ctx: int) -> list[Any]:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    c = model.config
    slots = ctx + 256
    keys = iter(mx.random.split(mx.random.key(1), 4 * c.num_layers))
    out = []
    for _ in ref.layers:
        shape = (1, c.num_kv_heads, slots, c.head_dim)
        if bits:
            cache = QuantizedKVCache(group_size=GROUP, bits=bits)
            cache.keys = mx.quantize(mx.random.normal(shape, key=next(keys)), group_size=GROUP, bits=bits)
            cache.values = mx.quantize(mx.random.normal(shape, key=next(keys)), group_size=GROUP, bits=bits)
        else:
            cache = KVCache()
            cache.keys = mx.random.normal(shape, key=next(keys))
            cache.values = mx.random.normal(shape, key=next(keys))
        cache.offset = ctx
        out.append(cache)
    mx.eval([(x.keys, x.values) for x in out])
    return out


def mlx_lm_decode(ref: Any, model: Any, bits: int | None, ctx: int, n: int, runs: int) -> dict[str, Any]:
    from mlx_lm.generate import generate_step

    times = []
    nbytes = slots = 0
    for r in range(runs + 1):
        caches = mlx_lm_caches(ref, model, bits, ctx)
        arrays = [a for x in caches for a in tree_leaves([x.keys, x.values])]
        nbytes, slots = sum(a.nbytes for a in arrays), caches[0].offset + 256
        t0 = time.perf_counter()
        for _ in generate_step(mx.array([1]), ref, prompt_cache=caches, max_tokens=n,
                               sampler=lambda x: mx.argmax(x, axis=-1)):
            pass
        if r:
            times.append(time.perf_counter() - t0)
        del caches, arrays
    return {"tok_s": n / statistics.median(times), "bytes_per_token": nbytes / slots,
            "cache_bytes": nbytes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--contexts", default="4096,8192")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--engines", default="fx,mlx-lm")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model)
    engines = a.engines.split(",")
    ref = None
    if "mlx-lm" in engines:
        from tools.oracle import mlx_lm_dense_from_fx

        ref = mlx_lm_dense_from_fx(model)
    rows = []
    for ctx in [int(x) for x in a.contexts.split(",")]:
        for kind in a.kinds.split(","):
            bits = KINDS[kind]
            row: dict[str, Any] = {"context": ctx, "kind": kind}
            if "fx" in engines:
                m = model.with_kv_cache(bits, GROUP, 0)
                row["fx"] = fx_decode(m, ctx, a.decode_tokens, a.runs)
                mx.clear_cache()
            if ref is not None:
                row["mlx-lm"] = mlx_lm_decode(ref, model, bits, ctx, a.decode_tokens, a.runs)
                mx.clear_cache()
            if "fx" in row and "mlx-lm" in row:
                row["decode_ratio"] = row["fx"]["tok_s"] / row["mlx-lm"]["tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    report = {"model": model.path, "weights": model.weight_format, "group_size": GROUP,
              "decode_tokens": a.decode_tokens, "runs": a.runs, "rows": rows,
              "blas": __import__("fx_engine.runtime.blas", fromlist=["active"]).active()["name"]}
    print()
    print(render(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


def render(report: dict[str, Any]) -> str:
    lines = ["| context | KV cache | fx bytes/token | mlx-lm bytes/token | fx decode tok/s | "
             "mlx-lm decode tok/s | fx / mlx-lm |", "|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        fx, ml = r.get("fx", {}), r.get("mlx-lm", {})
        f = lambda d, k, fmt: format(d[k], fmt) if k in d else "-"  # noqa: E731
        lines.append(
            f"| {r['context']} | {r['kind']} | {f(fx, 'bytes_per_token', ',.0f')} | "
            f"{f(ml, 'bytes_per_token', ',.0f')} | {f(fx, 'tok_s', '.1f')} | "
            f"{f(ml, 'tok_s', '.1f')} | {format(r['decode_ratio'], '.2f') + 'x' if 'decode_ratio' in r else '-'} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
