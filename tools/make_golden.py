"""Record the project's golden outputs (specs/golden/expected.json) from the mlx-lm oracle.

    python tools/make_golden.py        # every case of specs/golden/cases.json

Uses the golden-output kit (fx_engine.testing.golden: the document format, fingerprints,
versions) with an independent producer and scorer instead of fx-engine itself:
  producer  mlx-lm's own `generate_step` with its own samplers and logits processors and
            `mx.random.seed(seed)`, on the same weights (tools/oracle.py), from the prompt
            token ids fx-engine's tokenizer produced (recorded, so the golden pins the model's
            behaviour; the kit also checks the tokenization);
  scorer    mlx-lm's model forward over prompt + expected tokens: each token's logprob under
            the raw distribution (log_softmax), teacher forced.
The origin (oracle and MLX versions, BLAS, platform, date, the minimum top-2 greedy margin
per case) is written into the document, with check_producer fx_engine.generate: the kit
checks fx-engine's own generate against the oracle's outputs (tests/models/test_golden.py, with
the `golden` fixture); never edit the generated file by hand.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fx_engine  # noqa: E402

fx_engine.setup()  # BLAS preload and malloc tuning, before mlx is imported
import mlx.core as mx  # noqa: E402

from fx_engine.testing import golden as g  # noqa: E402
from tools.oracle import mlx_lm_generate, mlx_lm_model  # noqa: E402

GOLDEN = ROOT / "specs" / "golden"


def main() -> int:
    import mlx_lm

    refs: dict[int, object] = {}
    margins: dict[str, float] = {}

    def ref_of(model):
        if id(model) not in refs:
            refs[id(model)] = mlx_lm_model(model)
        return refs[id(model)]

    def producer(model, case):  # tokens only: the logprobs are the scorer's (teacher forced)
        tokens, _lps, margin = mlx_lm_generate(ref_of(model), case.prompt_ids(model), max_tokens=case.max_tokens,
                                               eos_ids=set(model.eos_ids), sampling=dict(case.sampling))
        margins[case.name] = margin
        return tokens

    def scorer(model, prompt, tokens, top_k):
        if not tokens:
            return [], []
        x = mx.array(prompt + tokens[:-1])[None]
        return g.token_logprobs(ref_of(model)(x)[0, len(prompt) - 1 :], tokens, top_k)

    cases = g.load_cases(GOLDEN / "cases.json")
    doc = g.record(cases, producer=producer, scorer=scorer,
                   producer_name=f"mlx-lm {mlx_lm.__version__} generate_step (make_sampler, "
                                 "make_logits_processors); logprobs: mlx-lm model forward",
                   check_producer=g.DEFAULT_PRODUCER)  # fx_engine.generate must reproduce it
    doc["origin"]["generated_by"] = "tools/make_golden.py"
    doc["origin"]["min_top2_logprob_margin"] = margins
    g.save(doc, GOLDEN / "expected.json")
    for e in doc["cases"]:
        name = e["case"]["name"]
        print(f"{name}: {len(e['token_ids'])} tokens, min margin {margins[name]:.4f}: {e['text'][:60]!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
