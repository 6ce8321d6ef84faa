"""Generate golden outputs in specs/golden/ from the mlx-lm oracle (never hand-edited).

    python tools/make_golden.py            # regenerate every case in specs/golden/cases.json

For each case: the prompt is tokenized with fx-engine's tokenizer (the ids are recorded, so
the golden pins the model's behaviour, not the tokenizer's), then mlx-lm's own
`generate_step` with its own samplers and logits processors, `mx.random.seed(seed)`, runs on
the same weights (tools/oracle.py). The expected token ids, text, and provenance (oracle and
MLX versions, BLAS, model fingerprint, minimum greedy margin) are written to
specs/golden/<name>.json. tests/test_golden.py compares fx-engine's tokens exactly.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402  (BLAS preload first)
import mlx.core as mx  # noqa: E402

from tools.oracle import mlx_lm_generate, mlx_lm_model  # noqa: E402

GOLDEN = ROOT / "specs" / "golden"


def resolve_model(spec: str, cache: dict) -> fx_engine.Model:
    if spec not in cache:
        if spec == "default":
            cache[spec] = fx_engine.load()
        elif spec.startswith("tiny:"):
            import tempfile

            from fx_engine.testing import write_tiny_model

            model_type = spec.split(":", 1)[1]
            path = write_tiny_model(Path(tempfile.mkdtemp()) / model_type, model_type, seed=0)
            cache[spec] = fx_engine.load(path)
        else:
            cache[spec] = fx_engine.load(spec)
    return cache[spec]


def prompt_ids(model: fx_engine.Model, case: dict) -> list[int]:
    if "messages" in case:
        return list(model.tokenizer.apply_chat_template(case["messages"], add_generation_prompt=True))
    return list(model.tokenizer.encode(case["prompt"]))


def main() -> int:
    import mlx_lm

    cases = json.loads((GOLDEN / "cases.json").read_text())["cases"]
    models: dict = {}
    for case in cases:
        model = resolve_model(case["model"], models)
        ids = prompt_ids(model, case)
        ref = mlx_lm_model(model)
        sampling = dict(case.get("sampling", {}))
        tokens, lps, margin = mlx_lm_generate(
            ref, ids, max_tokens=case["max_tokens"], eos_ids=set(model.eos_ids), sampling=sampling
        )
        out = {
            "case": case,
            "prompt_token_ids": ids,
            "expected_token_ids": tokens,
            "expected_text": model.tokenizer.decode(tokens),
            "expected_logprobs": lps,
            "origin": {
                "generated_by": "tools/make_golden.py",
                "oracle": f"mlx-lm {mlx_lm.__version__} generate_step (make_sampler, make_logits_processors)",
                "mlx": mx.__version__,
                "blas": fx_engine.blas.active()["name"],
                "platform": f"{platform.system()} {platform.machine()}",
                "model_fingerprint": model.fingerprint,
                "min_top2_logprob_margin": margin,
                "date": datetime.date.today().isoformat(),
            },
        }
        (GOLDEN / f"{case['name']}.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
        print(f"{case['name']}: {len(tokens)} tokens, min margin {margin:.4f}: {out['expected_text'][:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
