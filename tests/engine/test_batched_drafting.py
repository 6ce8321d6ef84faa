"""One batched drafter call for all rows of a step (issue 45): the learned drafters (EAGLE-3
heads, MTP modules) propose the rows of one drafter object together (`propose_rows`, the
engine's `propose_drafts`). Their drafts equal each row's own `propose` step after step
(rows of different prompt lengths, k and accepted counts: rollbacks after rejections), the
engine's greedy output is unchanged, steady state compiles nothing new, and an error in one
row fails only that row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.cache import entry_arrays
from fx_engine.core.drafters import eagle3, mtp
from fx_engine.core.steps import prefill_step
from fx_engine.engine.captured_drafter import CapturedRow
from fx_engine.engine.drafters import Draft, propose_drafts
from fx_engine.engine.eagle3_drafter import Eagle3Drafter
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.mtp_drafter import MtpDrafter
from fx_engine.testing.eagle3 import write_echo_pair, write_tiny_eagle3
from fx_engine.testing.mtp import write_mtp_echo_target, write_mtp_target
from tests.engine import drafter_checks

HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
            draft_vocab_size=128, intermediate_size=96)


class Counting:
    """A drafter class mixin counting its batched calls (rows per call)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.batches: list[int] = []
        self.fail_rows: set[int] = set()  # rows (by creation order) whose drafting raises
        self.rows: list[CapturedRow] = []

    def new_row(self, prompt, sampling):
        row = super().new_row(prompt, sampling)
        if len(self.rows) in self.fail_rows:
            def broken(tokens, k):
                raise RuntimeError("this row's drafter broke")
            row._prepare = broken
        self.rows.append(row)
        return row

    def propose_rows(self, rows, tokens_list, ks):
        self.batches.append(len(rows))
        return super().propose_rows(rows, tokens_list, ks)


class CountingEagle3(Counting, Eagle3Drafter):
    pass


class CountingMtp(Counting, MtpDrafter):
    pass


@pytest.fixture(scope="module")
def pairs(tiny_folder, tmp_path_factory):
    """name -> (target, drafter, the drafter's compiled step): random drafters (drafts mostly
    wrong) and echo ones (first drafts right, chained ones wrong), batch-invariant targets
    (the drafters share their numerics: a row's arithmetic does not depend on its batch)."""
    out = {}
    llama = fx_engine.load(tiny_folder("llama", num_hidden_layers=6), batch_invariant=True)
    head = write_tiny_eagle3(tmp_path_factory.mktemp("head") / "h", 64, seed=3, **HEAD)
    out["eagle3"] = (llama, CountingEagle3.load(head, llama), eagle3.head_step_compiled)
    t, h = write_echo_pair(tmp_path_factory.mktemp("echo"))
    echo = fx_engine.load(t, batch_invariant=True)
    out["eagle3-echo"] = (echo, CountingEagle3.load(h, echo), eagle3.head_step_compiled)
    ds = fx_engine.load(write_mtp_target(tmp_path_factory.mktemp("ds") / "ds", "deepseek_v3", seed=3),
                        batch_invariant=True)
    out["mtp"] = (ds, CountingMtp.from_model(ds), mtp.mtp_step_compiled)
    me = fx_engine.load(write_mtp_echo_target(tmp_path_factory.mktemp("mecho") / "t"), batch_invariant=True)
    out["mtp-echo"] = (me, CountingMtp.from_model(me), mtp.mtp_step_compiled)
    return out


def _sequence(model, n, seed, extra=48):
    rng = np.random.default_rng(seed)
    prompt = [int(x) for x in rng.integers(3, min(380, model.config.vocab_size), size=n)]
    if not extra:
        return prompt
    return prompt + list(reference_generate(model, prompt, max_tokens=extra, temperature=0.0).token_ids)


def _captured(model, drafter, seq):
    cap = 1 << (len(seq) + 8).bit_length()
    _, _, states = prefill_step(model.params, model.new_cache(1, cap), mx.array([seq], mx.int32),
                                mx.array([len(seq)], mx.int32), capture=drafter.capture)
    return states[0]


@pytest.mark.parametrize("name", ["eagle3", "eagle3-echo", "mtp", "mtp-echo"])
def test_batched_proposals_equal_per_row_proposals_step_after_step(pairs, name):
    """Rows of different prompt lengths (one fed in several FEED_CHUNK rounds, one fed early
    by `observe`) and k drafted together equal twins drafting alone, through a generation:
    each step the target keeps a random number of the drafts (rejections roll the drafters
    back), sometimes re-runs positions, some rows ask for k = 0 or ask twice; the caches
    after it hold the same pairs."""
    model, drafter, _ = pairs[name]
    rng = np.random.default_rng(7)
    lengths = (5, 30, 150, 300, 17)
    seqs = [_sequence(model, n, seed=i) for i, n in enumerate(lengths)]
    states = [_captured(model, drafter, s) for s in seqs]
    together = [drafter.new_row([], None) for _ in seqs]
    alone = [drafter.new_row([], None) for _ in seqs]
    pos = list(lengths)  # positions the target processed (the next token: seq[pos])
    for r, a, s, st, n in zip(together, alone, seqs, states, lengths):
        for row in (r, a):
            row.observe(0, st[:n], s[: n + 1])
    drafted = 0
    for step in range(12):
        ks = [int(rng.integers(0, 7)) if step % 5 != 4 else 0 for _ in seqs]
        ks[step % len(ks)] = max(ks[step % len(ks)], 1)
        toks = [s[: p + 1] for s, p in zip(seqs, pos)]
        got = drafter.propose_rows(together, toks, ks)
        want = [row.propose(t, k) for row, t, k in zip(alone, toks, ks)]
        assert [d.tokens for d in got] == [d.tokens for d in want], step
        assert all(len(d.tokens) <= k for d, k in zip(got, ks))
        drafted += sum(len(d.tokens) for d in got)
        if step == 3:  # asked again without a target step: nothing new to feed, no drafts
            again = drafter.propose_rows(together, toks, ks)
            assert [d.tokens for d in again] == [row.propose(t, k).tokens for row, t, k in zip(alone, toks, ks)]
        for i, (s, st) in enumerate(zip(seqs, states)):
            keep = 1 + int(rng.integers(0, ks[i] + 1))
            start, end = pos[i], min(pos[i] + keep, len(s) - 2)
            if step == 6 and i == 1:  # the target ran two positions again
                start -= 2
            for row in (together[i], alone[i]):
                row.observe(start, st[start:end], s[: end + 1])
            pos[i] = end
    assert drafted > 0
    assert len(drafter.batches) >= 12
    for r, a in zip(together, alone):
        assert (r.fed, r.waiting, r.length, r.broken) == (a.fed, a.waiting, a.length, a.broken)
        assert r.cache.capacity == a.cache.capacity
        for x, y in zip(entry_arrays(r.cache.layers[0]), entry_arrays(a.cache.layers[0])):
            np.testing.assert_array_equal(np.array(x[:, :, : r.fed]), np.array(y[:, :, : a.fed]))


@pytest.mark.parametrize("name", ["eagle3", "eagle3-echo", "mtp-echo"])
def test_engine_rows_of_one_drafter_draft_together_with_unchanged_output(pairs, name, steady_policy):
    """Four requests on one drafter (different prompt lengths and k), joining one step apart
    and beside a plain row: the drafter is asked in batched calls, every output is its plain
    greedy run alone."""
    model, drafter, _ = pairs[name]
    drafter.batches.clear()
    prompts = [_sequence(model, n, seed=10 + n, extra=0) for n in (9, 33, 4, 70, 21)]
    kinds = [{"draft_model": drafter, "num_draft_tokens": 4}, {"draft_model": drafter, "num_draft_tokens": 2},
             {}, {"draft_model": drafter, "num_draft_tokens": 6}, {"draft_model": drafter, "num_draft_tokens": 3}]
    alone = [reference_generate(model, p, max_tokens=20, temperature=0.0).token_ids for p in prompts]
    engine = fx_engine.Engine(model, max_rows=5, prefill_chunk=16)
    handles = []
    for p, kw in zip(prompts, kinds):
        handles.append(engine.submit(p, max_tokens=20, temperature=0.0, **kw))
        engine.step()
    results = [h.result() for h in handles]
    engine.close()
    assert [r.token_ids for r in results] == alone
    assert max(drafter.batches, default=0) >= 2
    assert all(r.usage.drafted_tokens > 0 for r, kw in zip(results, kinds) if kw)
    if "echo" in name:
        assert all(r.usage.accepted_tokens > 0 for r, kw in zip(results, kinds) if kw)


@pytest.mark.parametrize("name", ["eagle3-echo", "mtp-echo"])
def test_no_recompiles_in_steady_state_with_concurrent_rows(pairs, name, steady_policy):
    model, drafter, step = pairs[name]
    drafter.batches.clear()
    drafter_checks.no_recompiles_with_concurrent_rows(model, drafter, step)
    assert max(drafter.batches) >= 2


@pytest.mark.parametrize("name", ["eagle3-echo", "mtp-echo"])
def test_an_error_in_one_row_fails_only_that_row(pairs, name, steady_policy):
    """The second row's drafting raises: the batched call fails, each row is then asked
    alone; the broken row's request fails with the error, the others finish as alone."""
    model, drafter, _ = pairs[name]
    drafter.rows.clear()
    drafter.fail_rows = {1}
    try:
        prompts = [_sequence(model, n, seed=20 + n, extra=0) for n in (12, 25, 40)]
        engine = fx_engine.Engine(model, max_rows=3, prefill_chunk=32)
        handles = [engine.submit(p, max_tokens=12, temperature=0.0, draft_model=drafter, num_draft_tokens=3)
                   for p in prompts]
        with pytest.raises(RuntimeError, match="this row's drafter broke"):
            handles[1].result()
        for i in (0, 2):
            got = handles[i].result()
            assert got.token_ids == reference_generate(model, prompts[i], max_tokens=12, temperature=0.0).token_ids
            assert got.usage.drafted_tokens > 0
        engine.close()
    finally:
        drafter.fail_rows = set()


def test_propose_drafts_groups_rows_by_drafter_and_isolates_errors(pairs):
    """propose_drafts calls `propose_rows` once per drafter object with two or more planned
    rows; a raising batched call falls back to each row alone (only the bad row errs)."""

    class Req:
        def __init__(self, drafter, ids):
            self.drafter, self.row_drafter, self.ids, self.cfg, self.generated = drafter, None, ids, None, []

    class Rows:
        def __init__(self, fail=False):
            self.calls, self.fail = [], fail

        def new_row(self, prompt, sampling):
            return self

        def propose(self, tokens, k):
            if tokens[0] == 666:
                raise RuntimeError("bad row")
            return Draft((1,) * k)

        def propose_rows(self, rows, tokens_list, ks):
            self.calls.append(len(rows))
            if any(t[0] == 666 for t in tokens_list):
                raise RuntimeError("bad row")
            return [Draft((2,) * k) for k in ks]

    a, b = Rows(), Rows()
    reqs = [Req(a, [5, 6]), Req(b, [7]), Req(a, [8]), Req(a, [666]), Req(b, [9])]
    errors = []
    out = propose_drafts({r: 2 for r in reqs}, 100, lambda req, e: errors.append(req))
    assert a.calls == [3] and b.calls == [2]
    assert errors == [reqs[3]]
    assert out[reqs[0]][0] == (1, 1) and out[reqs[2]][0] == (1, 1)  # a's batch failed: alone
    assert out[reqs[1]][0] == (2, 2) and out[reqs[4]][0] == (2, 2)  # b's batch
