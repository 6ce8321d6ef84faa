"""Checks every drafter that reads the target's hidden states must pass (EAGLE-3 heads,
MTP modules: tests/engine/test_eagle3_drafter.py, test_mtp_drafter.py), given a target and
a drafter: a random one (drafts mostly rejected) or one whose first drafts are right and
chained ones wrong (the "echo" pairs of fx_engine.testing). A drafter that records its rows
(`drafter.rows`, the test files' `Recording` classes) is needed where a check looks at one."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

import fx_engine
from fx_engine.engine.captured_drafter import FLUSH_AT
from fx_engine.engine.drafters import PromptLookup
from fx_engine.engine.generate import reference_generate


class RecordsRows:
    """A drafter mixin keeping the rows it makes (`drafter.rows`: to look at a row's
    drafter cache after generation): `class Recording(RecordsRows, Eagle3Drafter)`."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.rows: list[Any] = []

    def new_row(self, prompt: Any, sampling: Any) -> Any:
        row = super().new_row(prompt, sampling)  # type: ignore[misc]
        self.rows.append(row)
        return row


def quantize_checkpoint(folder: Any, group_size: int = 32, bits: int = 4) -> Any:
    """Rewrite a tiny checkpoint folder's model.safetensors MLX affine-quantized as
    mlx-community's conversions store it: every 2-D `.weight` whose input width divides into
    groups (linears, tables, MTP modules' own), with `.scales` / `.biases` and config.json's
    `quantization`, except MoE routers (`mlp.gate.weight`: not quantized by mlx-lm). Returns
    the folder."""
    import json
    from pathlib import Path

    folder = Path(folder)
    f = folder / "model.safetensors"
    out: dict[str, mx.array] = {}
    for name, a in mx.load(str(f)).items():
        if (name.endswith(".weight") and a.ndim == 2 and a.shape[1] % group_size == 0
                and not name.endswith("mlp.gate.weight")):
            base = name[: -len(".weight")]
            out[name], out[base + ".scales"], out[base + ".biases"] = mx.quantize(a, group_size=group_size, bits=bits)
        else:
            out[name] = a
    mx.save_safetensors(str(f), out, metadata={"format": "mlx"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": group_size, "bits": bits}
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    return folder


def int8_target(folder: Any) -> Any:
    """The model at `folder` loaded in the 8-bit activation mode (numerics="int8"),
    batch-invariant, or a pytest skip where the native kernels are not built; its head
    (lm_head, or the table it is tied to) is in qmm_a8's interleaved layout, which only that
    mode's native product reads."""
    import pytest

    from fx_engine.runtime import native

    if native.ensure(quiet=True) is None:
        pytest.skip("native kernels unavailable: no 8-bit activation mode")
    model = fx_engine.load(folder, numerics="int8", batch_invariant=True)
    head = model.params.lm_head if getattr(model.params, "lm_head", None) is not None else model.params.embed
    assert model.numerics == "int8" and head.interleaved
    return model


def prompt(model: Any, n: int, offset: int = 0) -> list[int]:
    """n tokens of a fixed text from `offset`."""
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. 0123456789 def add(a, b): " * 8)
    return ids[offset: offset + n]


def greedy_output_is_identical(model: Any, drafter: Any, cases: Sequence[tuple[int, int]],
                               max_tokens: int) -> list[Any]:
    """For each (prompt length, k): the drafted greedy output is the plain one, drafts made.
    Returns the results."""
    out = []
    for n, k in cases:
        p = prompt(model, n, offset=n)
        ref = reference_generate(model, p, max_tokens=max_tokens, temperature=0.0)
        got = fx_engine.generate(model, p, max_tokens=max_tokens, temperature=0.0, draft_model=drafter,
                                 num_draft_tokens=k)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        assert got.usage.drafted_tokens > 0
        out.append(got)
    return out


def accepted_and_rejected_drafts_keep_greedy_output(model: Any, drafter: Any, k: int) -> None:
    """An echo drafter: its first drafts are accepted (with k = 1 every draft), its chained
    ones rejected (the drafter's rollback); the output is the plain greedy one."""
    p = [5, 9, 17, 40, 30]
    ref = reference_generate(model, p, max_tokens=20, temperature=0.0)
    got = fx_engine.generate(model, p, max_tokens=20, temperature=0.0, draft_model=drafter, num_draft_tokens=k)
    assert got.token_ids == ref.token_ids
    assert got.usage.accepted_tokens > 0
    if k == 1:  # every first draft is right
        assert got.usage.accepted_tokens == got.usage.drafted_tokens
    else:  # chained drafts are wrong: rejections (and the drafter's rollback) happen
        assert got.usage.accepted_tokens < got.usage.drafted_tokens


def cache_after_rollbacks_is_fed_the_accepted_sequence(
        model: Any, drafter: Any, fresh: Callable[[list[int], int, mx.array], Any]) -> None:
    """After a generation full of rejected chained drafts (an echo drafter recording its
    rows), the row's drafter cache holds exactly the pairs (the target's captured states at
    t, token t + 1) of the accepted sequence: its K/V equal those of `fresh(seq, f, states)`
    (a fresh cache fed the final sequence's first f pairs in one step; states [1, len, W]).
    Then the states the last step captured wait for their next tokens; fed now, the drafter
    drafts the token two ahead (right), then repeats it (its chained drafts are wrong)."""
    from fx_engine.core.steps import prefill_step

    drafter.rows.clear()
    p = [5, 9, 17, 40, 3, 77]
    got = fx_engine.generate(model, p, max_tokens=24, temperature=0.0, draft_model=drafter, num_draft_tokens=4)
    assert got.usage.drafted_tokens > got.usage.accepted_tokens > 0
    (row,) = drafter.rows
    assert row.broken is None and row.fed > len(p)
    seq = p + list(got.token_ids)
    f = row.fed
    _, _, states = prefill_step(model.params, model.new_cache(1, 64), mx.array([seq], mx.int32),
                                mx.array([len(seq)], mx.int32), capture=drafter.capture)
    want = fresh(seq, f, states)
    have = row.cache
    assert have.lengths.tolist()[0] >= f  # (chained guesses past `fed` are dropped at the next propose)
    for a, b in ((have.keys[0], want.keys[0]), (have.values[0], want.values[0])):
        np.testing.assert_allclose(np.array(a[:, :, :f]), np.array(b[:, :, :f]), rtol=1e-5, atol=1e-5)
    c = row.captured
    assert f < c < len(seq)
    assert row.propose(seq[: c + 1], 2).tokens == (seq[c - 1], seq[c - 1])


def batched_rows_equal_each_request_alone(model: Any, drafter: Any, max_tokens: int, echo: bool) -> None:
    """Rows with the drafter, without one and with prompt lookup, joining one step apart,
    share prefill, decode and verify steps (each step captures for the drafter's rows only
    what it needs): every request's tokens equal its plain greedy run alone."""
    kinds = [{"draft_model": drafter, "num_draft_tokens": 4}, {}, {"prompt_lookup": PromptLookup(1, 3)},
             {"draft_model": drafter, "num_draft_tokens": 2}]
    prompts = [prompt(model, n, offset=3 * n) for n in (12, 30, 5, 47)]
    alone = [reference_generate(model, p, max_tokens=max_tokens, temperature=0.0).token_ids for p in prompts]
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16)
    handles = []
    for p, kw in zip(prompts, kinds):
        handles.append(engine.submit(p, max_tokens=max_tokens, temperature=0.0, **kw))
        engine.step()
    results = [h.result() for h in handles]
    engine.close()
    assert [r.token_ids for r in results] == alone
    assert results[0].usage.drafted_tokens > 0
    if echo:
        assert results[0].usage.accepted_tokens > 0


def long_prompts_feed_in_pieces(model: Any, drafter: Any, max_tokens: int, prefill_chunk: int) -> None:
    """A prompt longer than FLUSH_AT, prefilled in small chunks, feeds the drafter early (in
    bounded pieces); a second request sharing its prefix does not restore the prefix (the
    drafter needs every position's states) and drafts as well (an echo drafter recording
    its rows)."""
    drafter.rows.clear()
    p = [int(x) for x in np.random.default_rng(0).integers(3, 380, size=FLUSH_AT + 40)]
    ref = reference_generate(model, p, max_tokens=max_tokens, temperature=0.0)
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=prefill_chunk)
    for _ in range(2):
        got = engine.submit(p, max_tokens=max_tokens, temperature=0.0, draft_model=drafter).result()
        assert got.token_ids == ref.token_ids and got.usage.accepted_tokens > 0
        assert got.usage.cached_tokens == 0
    engine.close()
    assert all(r.broken is None for r in drafter.rows)


def rows_feed_early_replace_on_overlap_and_stop_at_a_gap(model: Any, drafter: Any) -> None:
    """The row drafter's bookkeeping: many waiting states feed the drafter early (all but
    the last, whose next token is unknown); states from an earlier position replace what the
    row had from there (its cache rolled back); a gap stops the row's drafting (it proposes
    nothing; the engine then decodes it)."""
    row = drafter.new_row([], None)
    width = drafter.capture.points * model.config.hidden_size
    states = mx.random.normal((FLUSH_AT + 10, width), key=mx.random.key(0))
    tokens = list(range(4, FLUSH_AT + 14))
    row.observe(0, states[:100], tokens)
    assert (row.fed, row.waiting) == (0, 100)  # below FLUSH_AT: nothing fed yet
    row.observe(100, states[100:], tokens)
    assert (row.fed, row.waiting, row.cache.lengths.tolist()) == (FLUSH_AT + 9, 1, [FLUSH_AT + 9])
    row.observe(50, states[50:60])  # the target ran positions 50.. again
    assert (row.fed, row.waiting, row.captured, row.cache.lengths.tolist()) == (50, 10, 60, [50])
    assert len(row.propose(tokens[:61], 3).tokens) == 3
    row.observe(70, states[:1])  # positions 60 .. 69 never came
    assert row.broken is not None and row.propose(tokens[:72], 3).tokens == ()


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
