"""Speculative decoding benchmark (`python tools/bench_spec.py`, or `tools/bench.py --spec`).

Two tasks on the default model, greedy:
  grounded    the prompt holds a ~300-token passage and asks to copy it with a small change
              (what prompt lookup is for); 200 generated tokens per request;
  open        an open-ended request (a story); 128 generated tokens per request.
At batch 1 and batch 8 (8 requests submitted at once to one fx_engine.Engine; each request
of a batch has its own passage / topic), for each drafter:
  none        plain decoding;
  lookup      prompt lookup (n-gram 1..3), num_draft_tokens 4 (the default) and 8;
  self-draft  a draft model made of the target's first 8 layers and its head
              (self-speculative; no smaller real model is available offline);
  eagle3      an EAGLE-3 head (`--eagle3 DIR`: e.g. tools/train_drafter.py's for the
              default model), num_draft_tokens 4 (the default) and 6 (`eagle3-k6`).
Reported per cell: decode throughput (generated tokens / time from the first request's first
token to the last request's last token, so prefill is excluded), the ratio to plain decoding
of the same task and batch, and the acceptance rate (accepted / drafted). Medians over
--runs runs after one warm-up run per cell; all cells run in one process, rotated per round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported

from fx_engine.engine.drafters import PromptLookup, self_draft_model  # noqa: E402

SENTENCES = [
    "The lighthouse stood on the northern cliff for two hundred years.",
    "Every night the keeper climbed the one hundred and twelve steps to light the lamp.",
    "Every morning he wrote the weather in a small leather book.",
    "Ships passed in the dark and never knew his name, but they trusted the light.",
    "In winter the sea froze near the rocks and the gulls slept on the ice.",
    "His daughter sent letters from the city, full of trams, theatres and rain.",
    "He answered each one by candlelight, slowly, in careful handwriting.",
    "When the new electric lamp arrived, he kept the old one polished anyway.",
]
TOPICS = ["a dragon who learns to paint", "a robot lost in a library", "a baker on the moon",
          "two rivals stuck in an elevator", "a cat that runs a small hotel",
          "a violin that plays by itself", "the last train of the night", "a garden in a desert"]


def grounded_prompt(i: int) -> list[dict[str, str]]:
    order = SENTENCES[i % 8:] + SENTENCES[: i % 8]
    passage = " ".join(order * 2)
    return [{"role": "user", "content":
             f"Copy the following text exactly, but write 'keeper' as 'guardian':\n\n{passage}"}]


def open_prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % 8]}."}]


TASKS = {"grounded": (grounded_prompt, 200), "open": (open_prompt, 128)}


def run_cell(model: Any, task: str, batch: int, spec: dict[str, Any]) -> dict[str, float]:
    make, max_tokens = TASKS[task]
    engine = fx_engine.Engine(model, max_rows=batch, prefill_chunk=512)
    hs = [engine.submit(make(i), max_tokens=max_tokens, temperature=0.0, **spec)
          for i in range(batch)]
    outs = [h.result() for h in hs]
    first = min(h.timings["first_token"] for h in hs)
    last = max(h.timings["finished"] for h in hs)
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.usage.drafted_tokens for o in outs)
    accepted = sum(o.usage.accepted_tokens for o in outs)
    rounds = sum(o.usage.draft_rounds for o in outs)
    return {"tok_s": tokens / (last - first), "tokens": tokens, "drafted": drafted,
            "accepted": accepted, "rounds": rounds}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tasks", default="grounded,open")
    ap.add_argument("--drafters", default="none,lookup,lookup-k8,self-draft")
    ap.add_argument("--self-draft-layers", type=int, default=8)
    ap.add_argument("--eagle3", default=None, help="an EAGLE-3 head's folder (adds the eagle3 drafters)")
    ap.add_argument("--eagle3-bits", default="8", choices=["8", "4", "none"],
                    help="the head's matrices quantized at load (Eagle3Drafter.load's bits; the CLI's 8)")
    ap.add_argument("--numerics", default="exact", choices=("auto", "exact", "int8"))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    model = fx_engine.load(a.model, numerics=a.numerics)
    drafters = {
        "none": {}, "lookup": {"prompt_lookup": PromptLookup(1, 3)},
        "lookup-k8": {"prompt_lookup": PromptLookup(1, 3), "num_draft_tokens": 8},
        "self-draft": {"draft_model": self_draft_model(model, a.self_draft_layers)},
    }
    if a.eagle3:
        from fx_engine.engine.eagle3_drafter import Eagle3Drafter

        head = Eagle3Drafter.load(a.eagle3, model, bits=None if a.eagle3_bits == "none" else int(a.eagle3_bits))
        drafters.update({"eagle3": {"draft_model": head},
                         "eagle3-k6": {"draft_model": head, "num_draft_tokens": 6}})
    names = a.drafters.split(",")
    cells = [(t, int(b), d) for t in a.tasks.split(",") for b in a.batches.split(",") for d in names]
    results: dict[tuple, list[dict[str, float]]] = {c: [] for c in cells}
    for c in cells:  # warm-up: compiles every shape bucket the cell uses
        run_cell(model, c[0], c[1], drafters[c[2]])
    for r in range(a.runs):
        for c in cells[r % len(cells):] + cells[: r % len(cells)]:
            results[c].append(run_cell(model, c[0], c[1], drafters[c[2]]))
            print(json.dumps({"task": c[0], "batch": c[1], "drafter": c[2], **results[c][-1]}), flush=True)
    rows = []
    for (task, batch, d), runs in results.items():
        med = statistics.median(x["tok_s"] for x in runs)
        base = statistics.median(x["tok_s"] for x in results[(task, batch, "none")]) \
            if (task, batch, "none") in results else float("nan")
        dr, ac = sum(x["drafted"] for x in runs), sum(x["accepted"] for x in runs)
        rd = sum(x.get("rounds", 0) for x in runs)
        rows.append({"task": task, "batch": batch, "drafter": d, "tok_s": med,
                     "speedup": med / base, "acceptance": ac / dr if dr else None,
                     "mean_accepted_length": 1 + ac / rd if rd else None,
                     "runs": [x["tok_s"] for x in runs]})
    report = {"model": model.path, "weights": model.weight_format, "numerics": model.numerics,
              "eagle3": a.eagle3, "eagle3_bits": a.eagle3_bits, "runs": a.runs,
              "self_draft_layers": a.self_draft_layers, "rows": rows,
              "blas": __import__("fx_engine.runtime.blas", fromlist=["active"]).active()["name"]}
    print()
    print(render(report))
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return report


def render(report: dict[str, Any]) -> str:
    lines = ["| task | batch | drafter | decode tok/s (median) | vs plain | acceptance | mean accepted length |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        mal = "-" if r.get("mean_accepted_length") is None else f"{r['mean_accepted_length']:.2f}"
        lines.append(f"| {r['task']} | {r['batch']} | {r['drafter']} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {acc} | {mal} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
