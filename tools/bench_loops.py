"""Time the five custom loops of examples/ in fx-engine and in mlx-lm (docs/loops.md).

    python tools/bench_loops.py [--runs 3]

The same workload in both, on the default model (SmolLM2-135M; mlx-lm's own model class
holding the same weights dequantized to float32, as mlx-lm cannot read the Q4_1 GGUF;
fx-engine runs its native 4-bit kernels): beam search width 4 x 16 tokens; best-of-8 x 16
tokens (no EOS stop); CFG 16 tokens (no EOS stop in mlx-lm's version); speculative decoding
of two prompts, 24 greedy tokens each, k = 3, a drafter of the first 28 of 30 layers; the
fork loop probing 12 tokens then 3 branches x 8 tokens; and, as a reference for the
per-token cost of the two forwards, plain greedy decoding of 16 tokens. Prints a markdown table: the
first call (fx-engine compiles its steps there), the median of the next `runs` calls,
and the lines of code of each loop (without blank lines, comments and docstrings).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import statistics
import sys
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import fx_engine  # noqa: E402

fx_engine.setup()
from examples import beam_search, best_of_n, cfg, fork, mlx_lm_loops as ml, speculative  # noqa: E402

CODE = {  # the functions each loop is made of
    "beam search (4)": ([beam_search.beam_step.fn, beam_search.beam_search], [ml._logp, ml._prefill, ml._take, ml.beam_search]),
    "best-of-8": ([best_of_n.best_of_n], [ml._logp, ml._prefill, ml._take, ml.best_of_n]),
    "CFG (2 prompts)": ([cfg._guide, cfg.guided_step.fn, cfg.cfg_generate], [ml._prefill, ml.cfg_generate]),
    "speculative (k=3)": ([speculative.speculative_generate], [ml.speculative]),
    "fork (entropy)": ([fork.tracked_step.fn, fork._uncertainty, fork.track, fork.fork, fork.decode, fork.entropy_fork],
                       [ml.entropy_fork]),
}


def lines(fn) -> int:
    """Lines of code of a function: no blank lines, comments, docstring or decorators."""
    src = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(src).body[0]
    doc = set()
    if ast.get_docstring(node):
        d = node.body[0]
        doc = set(range(d.lineno, d.end_lineno + 1))
    body = src.splitlines()
    return sum(1 for i, ln in enumerate(body, 1)
               if i not in doc and ln.strip() and not ln.strip().startswith(("#", "@")))


def timed(fn, runs: int) -> tuple[float, float]:
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return first, statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    m = fx_engine.load()
    ref, draft_ref = ml.models(m, m.config.num_layers - 2)
    draft = fx_engine.self_draft_model(m, m.config.num_layers - 2)
    chat = lambda q: m.tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], add_generation_prompt=True)
    ids = chat("Tell me a story about a cat.")
    cond, uncond = chat("Describe the sea in the style of a pirate."), chat("Describe the sea.")
    two = [chat("Count from one to twenty."), chat("Write a haiku about the sea.")]
    eos = tuple(m.eos_ids)
    def fx_greedy():  # the reference: plain greedy decoding, 16 tokens, one row
        _, cache, state = fx_engine.prefill(m, [ids], room=16)
        for _ in range(15):
            state, cache = fx_engine.decode_step_compiled(m.params, cache, state)
            fx_engine.tree_leaves(state)[0].item()

    def ml_greedy():
        for _ in zip(ml.generate_step(ml.mx.array(ids), ref, max_tokens=16), range(16)):
            pass

    loops = {
        "plain greedy, 16 tokens (reference)": (fx_greedy, ml_greedy),
        "beam search (4)": (lambda: beam_search.beam_search(m, ids, 4, 16, eos=-1),
                            lambda: ml.beam_search(ref, ids, 4, 16, eos=-1)),
        "best-of-8": (lambda: best_of_n.best_of_n(m, ids, 8, 16, eos_ids=()),
                      lambda: ml.best_of_n(ref, ids, 8, 16, eos_ids=())),
        "CFG (2 prompts)": (lambda: cfg.cfg_generate(m, cond, uncond, 2.0, 16),
                            lambda: ml.cfg_generate(ref, cond, uncond, 2.0, 16, eos_ids=())),
        "speculative (k=3)": (lambda: speculative.speculative_generate(m, two, draft, 3, 24),
                              lambda: ml.speculative(ref, draft_ref, two, 3, 24, eos)),
        "fork (entropy)": (lambda: fork.entropy_fork(m, ids, 12, 3, 8),
                           lambda: ml.entropy_fork(ref, ids, 12, 3, 8)),
    }
    print(f"| loop | fx-engine lines | mlx-lm lines | fx-engine first call (s) | fx-engine median (s) "
          f"| mlx-lm first call (s) | mlx-lm median (s) | mlx-lm / fx-engine |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, (fx_run, ml_run) in loops.items():
        fx_fns, ml_fns = CODE.get(name, ([], []))
        f1, fm = timed(fx_run, args.runs)
        g1, gm = timed(ml_run, args.runs)
        n_fx, n_ml = (sum(map(lines, f)) or "-" for f in (fx_fns, ml_fns))
        print(f"| {name} | {n_fx} | {n_ml} | {f1:.2f} | {fm:.3f} "
              f"| {g1:.2f} | {gm:.3f} | {gm / fm:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
