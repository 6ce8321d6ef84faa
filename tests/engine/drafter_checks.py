"""Checks every drafter that reads the target's hidden states must pass (EAGLE-3 heads,
MTP modules: tests/engine/test_eagle3_drafter.py, test_mtp_drafter.py), given a target and
a drafter whose first drafts are right (the "echo" pairs of fx_engine.testing)."""

from __future__ import annotations

from typing import Any

import fx_engine
from fx_engine.engine.generate import reference_generate


def grammars_and_sampled_rows_compose(model: Any, drafter: Any) -> None:
    # a constrained row: drafts the grammar disallows are cut, output as without drafting
    kw = dict(max_tokens=10, temperature=0.0, regex="[a-z ]{1,12}")
    plain = fx_engine.generate(model, [5, 9, 17], **kw)
    spec = fx_engine.generate(model, [5, 9, 17], draft_model=drafter, num_draft_tokens=3, **kw)
    assert spec.token_ids == plain.token_ids
    # a sampled row (the acceptance rule's random path; top_k=1 makes the target's draw the
    # argmax): deterministic drafts are verified exactly, so the output is the greedy one
    ref = reference_generate(model, [5, 9, 17], max_tokens=16, temperature=0.0)
    got = fx_engine.generate(model, [5, 9, 17], max_tokens=16, temperature=0.8, top_k=1, seed=3,
                             draft_model=drafter, num_draft_tokens=3)
    assert got.token_ids == ref.token_ids and got.usage.accepted_tokens > 0


def no_recompiles_in_steady_state(model: Any, drafter: Any, drafter_step: Any) -> None:
    """The drafter's steps are keyed on a few shapes (power-of-two pair counts, the span): a
    third generation of the same shape compiles nothing new, neither `drafter_step` nor the
    target's capturing prefill, decode and verify steps."""
    from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled, verify_step_compiled

    prompt = [5, 9, 17, 40, 30]
    fns = (drafter_step, prefill_step_compiled, decode_step_compiled, verify_step_compiled)
    for _ in range(2):
        fx_engine.generate(model, prompt, max_tokens=24, temperature=0.0, draft_model=drafter, num_draft_tokens=4)
    before = [f.traces for f in fns]
    got = fx_engine.generate(model, prompt, max_tokens=24, temperature=0.0, draft_model=drafter, num_draft_tokens=4)
    assert got.usage.accepted_tokens > 0
    assert [f.traces for f in fns] == before


def no_recompiles_with_concurrent_rows(model: Any, drafter: Any, drafter_step: Any) -> None:
    """Several rows of one drafter drafting together (one batched drafter call per step, its
    row count a power of two): a third run of the same requests compiles nothing new."""
    from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled, verify_step_compiled

    prompts = [[5, 9, 17, 40, 30], [7, 3, 11], [21, 8, 5, 40, 30, 9, 12]]
    fns = (drafter_step, prefill_step_compiled, decode_step_compiled, verify_step_compiled)

    def run() -> list[Any]:
        engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16)
        handles = [engine.submit(p, max_tokens=24, temperature=0.0, draft_model=drafter, num_draft_tokens=k)
                   for p, k in zip(prompts, (4, 2, 3))]
        out = [h.result() for h in handles]
        engine.close()
        return out

    for _ in range(2):
        run()
    before = [f.traces for f in fns]
    got = run()
    assert all(r.usage.accepted_tokens > 0 for r in got)
    assert [f.traces for f in fns] == before
