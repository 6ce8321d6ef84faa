#!/usr/bin/env python
"""Build an EAGLE-3 draft head for a target in one command (issue 45, item 3): the recipe of
docs/benchmarks.md's head for the default model, every stage resumable.

    python tools/build_drafter.py --out ~/.cache/fx-engine/drafters/smollm2-eagle3   # ~2 h on 2 vCPUs
    fx-engine serve --draft-model ~/.cache/fx-engine/drafters/smollm2-eagle3       # or Eagle3Drafter.load(DIR, model)

The stages (each skipped when its output exists, so an interrupted build goes on where it
stopped; they live in --work, by default OUT-work beside OUT):

  1. tools/drafter_data.py --prompts P --max-tokens T            -> WORK/data-1.npz
  2. tools/drafter_data.py --offset P --prompts P --max-tokens T -> WORK/data-2.npz
     (the target's own greedy answers to the tool's generated prompt set, the rest of it
     in the second file: 1,024 and 636 prompts by default)
  3. tools/train_drafter.py --data data-1 --epochs E              -> WORK/head-1
  4. tools/train_drafter.py --data data-1 data-2 --init head-1 --epochs E -> OUT

The defaults are the recipe of the head measured in docs/benchmarks.md (section "Issue 45:
an EAGLE-3 head trained for the default model"). OUT/build.json records each stage's
command line and time, beside the head's own recipe.json (data origin, every setting, each
epoch's loss and per-step accuracy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def stages(out: Path, work: Path, a: argparse.Namespace) -> list[tuple[str, str, list[str], Path]]:
    """(name, tool, arguments, output) of each stage, in order."""
    model = ["--model", a.model] if a.model else []
    data = ["--max-tokens", str(a.max_tokens), "--rows", str(a.rows), "--numerics", a.numerics]
    train = []
    for flag in ("draft_vocab", "steps", "batch", "seq", "holdout", "lr"):
        value = getattr(a, flag)
        if value is not None:
            train += ["--" + flag.replace("_", "-"), str(value)]
    d1, d2, h1 = work / "data-1.npz", work / "data-2.npz", work / "head-1"
    return [
        ("data-1", "drafter_data", [*model, "--out", str(d1), "--prompts", str(a.prompts), *data], d1),
        ("data-2", "drafter_data", [*model, "--out", str(d2), "--offset", str(a.prompts),
                                    "--prompts", str(a.prompts), *data], d2),
        ("head-1", "train_drafter", ["--data", str(d1), "--out", str(h1), "--epochs", str(a.epochs), *train], h1),
        ("head", "train_drafter", ["--data", str(d1), str(d2), "--init", str(h1), "--out", str(out),
                                   "--epochs", str(a.epochs), *train], out),
    ]


def _done(path: Path) -> bool:
    return (path / "model.safetensors").exists() if path.suffix != ".npz" else path.exists()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the head's folder (config.json, model.safetensors, recipe.json)")
    ap.add_argument("--work", default=None, help="the stages' outputs (default: OUT-work beside OUT)")
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--prompts", type=int, default=1024, help="prompts of each data file")
    ap.add_argument("--max-tokens", type=int, default=192, help="answer tokens per prompt")
    ap.add_argument("--rows", type=int, default=32, help="requests decoded at once while making the data")
    ap.add_argument("--numerics", default="auto", choices=("auto", "exact", "int8"),
                    help="the target's numerics while making the data (auto: as the CLI serves it)")
    ap.add_argument("--epochs", type=int, default=2, help="epochs of each training stage")
    ap.add_argument("--draft-vocab", type=int, default=None, help="(train_drafter.py's default: 8192)")
    ap.add_argument("--steps", type=int, default=None, help="unrolled steps (train_drafter.py's default: 3)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--holdout", type=float, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--force", action="store_true", help="run every stage again")
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_tokens < 1 or a.epochs < 1 or a.rows < 1:
        ap.error("--prompts, --max-tokens, --epochs and --rows must be positive")
    out = Path(a.out).expanduser().resolve()
    work = Path(a.work).expanduser().resolve() if a.work else out.with_name(out.name + "-work")
    work.mkdir(parents=True, exist_ok=True)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    import drafter_data
    import train_drafter

    tools = {"drafter_data": drafter_data.main, "train_drafter": train_drafter.main}
    record: list[dict[str, Any]] = []
    for name, tool, args, dest in stages(out, work, a):
        command = f"python tools/{tool}.py " + " ".join(args)
        if _done(dest) and not a.force:
            log(f"[build_drafter] {name}: {dest} exists, skipped")
            record.append({"stage": name, "command": command, "skipped": True})
            continue
        log(f"[build_drafter] {name}: {command}")
        t0 = time.perf_counter()
        tools[tool](args)
        record.append({"stage": name, "command": command, "seconds": round(time.perf_counter() - t0, 1)})
    build = {"tool": "tools/build_drafter.py", "argv": sys.argv[1:] if argv is None else list(argv),
             "stages": record, "work": str(work)}
    (out / "build.json").write_text(json.dumps(build, indent=1) + "\n")
    log(f"[build_drafter] the head is in {out}")
    return build


if __name__ == "__main__":
    main()
