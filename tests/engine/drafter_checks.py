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
