#!/usr/bin/env python
"""Training data for a learned drafter (issue 45, item 3): an open prompt set and the
target model's own answers to it.

    python tools/drafter_data.py --out ~/.cache/fx-engine/drafter/data.npz   # default model
    python tools/drafter_data.py --prompts 64 --max-tokens 64 --out /tmp/d.npz   # a quick one

The prompts are generated here, not downloaded: chat requests built from instruction
templates (explain, describe, list, compare, write a story / poem / letter, give advice,
...) crossed with subjects (everyday, science, history, work, nature, ...), shuffled with a
fixed seed, so anyone rebuilds the same set. None of them is a prompt of the speculative
benchmark (tools/bench_spec.py: its story topics are excluded, and
tests/tools/test_drafter_data.py checks it), so a drafter trained on this set is measured on
held-out requests.

The answers are the target's own greedy generations through `fx_engine.Engine` (many rows
at once), under the model's chat template: a drafter learns what this model writes, in the
numerics it is served with (`--numerics`, default auto as the CLI). The output `.npz` holds
every conversation's token ids back to back (`tokens`), where each starts (`starts`), where
its answer starts (`answer_starts`), and a JSON `meta` (model path and fingerprint,
numerics, settings, prompt count, tokens, seconds, the first prompts as a sample).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

TEMPLATES = [
    "Explain {s} to a ten-year-old.",
    "Describe {s} in a few paragraphs.",
    "Write a short story about {s}.",
    "Write a poem about {s}.",
    "List five interesting facts about {s}.",
    "What are the advantages and disadvantages of {s}?",
    "Give me some practical advice about {s}.",
    "Write a friendly letter to a friend about {s}.",
    "Summarize what most people should know about {s}.",
    "Why do people care about {s}?",
    "Write a blog post introduction about {s}.",
    "How would you teach a beginner about {s}?",
    "Compare {s} with something similar and explain the differences.",
    "Write a dialogue between two people discussing {s}.",
    "What is the history of {s}?",
    "What are common misconceptions about {s}?",
    "Write a product description inspired by {s}.",
    "Plan a one-day activity centred on {s}.",
    "Write a news report about a surprising discovery related to {s}.",
    "What questions would a curious student ask about {s}? Answer two of them.",
]

SUBJECTS = [
    # everyday life
    "cooking pasta", "morning routines", "learning to ride a bicycle", "keeping houseplants alive",
    "saving money", "moving to a new city", "making friends as an adult", "public libraries",
    "rainy weekends", "a family dinner", "packing for a trip", "writing a good email",
    "time management", "sleep", "drinking enough water", "board games", "gardening in spring",
    "baking bread", "a birthday party", "recycling",
    # nature and science
    "volcanoes", "the water cycle", "honey bees", "black holes", "photosynthesis", "the moon",
    "earthquakes", "rainforests", "whales", "the human heart", "electricity", "magnets",
    "the seasons", "dinosaurs", "coral reefs", "clouds", "the periodic table", "gravity",
    "migrating birds", "deserts",
    # history and society
    "ancient Egypt", "the printing press", "the Roman roads", "the invention of the telephone",
    "the first flight", "castles", "the Silk Road", "the history of chess", "old maps",
    "public transport", "democracy", "museums", "the Olympic Games", "lighthouses",
    # work and technology
    "computer programming", "spreadsheets", "job interviews", "remote work", "electric cars",
    "the internet", "smartphones", "3D printing", "solar panels", "online privacy",
    "a small bakery business", "teamwork", "giving a presentation", "open source software",
    # arts and imagination
    "jazz music", "painting with watercolours", "a forgotten island", "a talking tree",
    "a detective who hates rain", "a friendly ghost", "a journey to the mountains",
    "a robot chef", "a city under the sea", "an old clock shop", "a kite festival",
    "a snowy village", "a lost key", "a secret garden", "a time traveller's diary",
]

# the speculative benchmark's open-task topics (tools/bench_spec.py TOPICS): never trained on
HELD_OUT = ["a dragon who learns to paint", "a robot lost in a library", "a baker on the moon",
            "two rivals stuck in an elevator", "a cat that runs a small hotel",
            "a violin that plays by itself", "the last train of the night", "a garden in a desert"]


def prompts(n: int, seed: int = 0) -> list[str]:
    """The first `n` prompts of the shuffled template x subject set (at most all of it)."""
    subjects = [s for s in SUBJECTS if s not in HELD_OUT]
    every = [t.format(s=s) for t in TEMPLATES for s in subjects]
    random.Random(seed).shuffle(every)
    return every[:n]


def generate(model: Any, texts: list[str], max_tokens: int, rows: int,
             log: Any = print) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's chat-templated ids and the model's greedy answer ids."""
    import fx_engine

    prompt_ids = [list(model.tokenizer.apply_chat_template([{"role": "user", "content": t}]))
                  for t in texts]
    answers: list[list[int]] = []
    every = max(1, len(prompt_ids) // 10)
    with fx_engine.Engine(model, max_rows=rows, prefill_chunk=512) as engine:
        # a window of submitted requests (the engine's queue is bounded): the oldest is
        # collected before the next is submitted, in order
        window = min(engine.max_queue, 4 * rows)
        handles = []
        for i, ids in enumerate(prompt_ids + [None] * window):
            if i >= window:
                answers.append(list(handles[i - window].result().token_ids))
                if len(answers) % every == 0:
                    log(f"{len(answers)}/{len(prompt_ids)} answers")
            if ids is not None:
                handles.append(engine.submit(ids, max_tokens=max_tokens, temperature=0.0))
    return prompt_ids, answers[:len(prompt_ids)]


def pack(prompt_ids: list[list[int]], answers: list[list[int]]) -> dict[str, np.ndarray]:
    """Conversations back to back: tokens, starts (one more than conversations: the end),
    answer_starts."""
    tokens: list[int] = []
    starts, answer_starts = [], []
    for p, a in zip(prompt_ids, answers):
        starts.append(len(tokens))
        answer_starts.append(len(tokens) + len(p))
        tokens += p + a
    starts.append(len(tokens))
    return {"tokens": np.asarray(tokens, np.int32), "starts": np.asarray(starts, np.int64),
            "answer_starts": np.asarray(answer_starts, np.int64)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="the target (default: the default model)")
    ap.add_argument("--out", required=True, help="the .npz to write")
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--rows", type=int, default=32, help="requests decoded at once")
    ap.add_argument("--seed", type=int, default=0, help="the prompt set's shuffle")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip this many prompts of the shuffled set (a second file with other prompts)")
    ap.add_argument("--numerics", default="auto", choices=("auto", "exact", "int8"))
    a = ap.parse_args(argv)
    if a.prompts < 1 or a.max_tokens < 1 or a.rows < 1:
        ap.error("--prompts, --max-tokens and --rows must be positive")
    import fx_engine

    model = fx_engine.load(a.model, numerics=a.numerics)
    texts = prompts(a.offset + a.prompts, a.seed)[a.offset:]
    if not texts:
        ap.error(f"--offset {a.offset}: the prompt set has only {len(prompts(10**9, a.seed))} prompts")
    t0 = time.perf_counter()
    prompt_ids, answers = generate(model, texts, a.max_tokens, a.rows,
                                   log=lambda m: print(m, file=sys.stderr, flush=True))
    seconds = time.perf_counter() - t0
    arrays = pack(prompt_ids, answers)
    meta = {"tool": "tools/drafter_data.py", "model": model.path, "fingerprint": model.fingerprint,
            "numerics": model.numerics, "prompts": len(texts), "seed": a.seed, "offset": a.offset,
            "max_tokens": a.max_tokens, "temperature": 0.0, "tokens": int(arrays["tokens"].size),
            "answer_tokens": int(sum(len(x) for x in answers)), "seconds": round(seconds, 1),
            "sample_prompts": texts[:5]}
    out = Path(a.out).expanduser()
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(out, **arrays, meta=np.asarray(json.dumps(meta)))
    print(json.dumps(meta))
    return meta


if __name__ == "__main__":
    main()
