"""A step's plan as plain data (issue 43, item 1; fx_engine/engine/scheduler.py): the
intake (retirements, admissions), the prefill calls with their splits, the decode or
verify (per-row K, masks, growth), and the lockstep message that carries them are frozen,
hashable, picklable values, and each phase's planner equals the rule it replaced."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_engine.engine import scheduler as sched
from fx_engine.engine.lockstep import RequestRecord, StepMessage


def _admit_one_by_one(queued, admitted, cancelled, max_rows, budget):
    """The engine's admission loop before the plan was data: retire, then admit from the
    head while can_admit holds, each admitted request counted for the next."""
    gone = set(cancelled)
    needs = [n for k, n, _ in admitted if k not in gone]
    slots = [s for k, _, s in admitted if k not in gone and s]
    out = []
    for k, need, ps in queued:
        if k in gone:
            continue
        if not sched.can_admit(needs, need, max_rows, budget, slots, ps):
            break
        needs.append(need)
        slots.append(ps)
        out.append(k)
    return out


@settings(max_examples=200, deadline=None)
@given(q=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 1)), max_size=8),
       a=st.lists(st.tuples(st.integers(1, 3000), st.booleans(), st.integers(0, 1)), max_size=8),
       max_rows=st.integers(1, 8), budget=st.one_of(st.none(), st.integers(256, 1 << 15)),
       abort=st.booleans())
def test_plan_intake_is_the_admission_rule(q, a, max_rows, budget, abort):
    queued = [(i, need, sched.prefill_slots(need // 2 + 1, 64)) for i, (need, _) in enumerate(q)]
    admitted = [(100 + i, need, sched.prefill_slots(need // 2 + 1, 64) if pre else 0)
                for i, (need, pre, _) in enumerate(a)]
    cancelled = [k for (k, _, _), (_, c) in zip(queued, q) if c] + \
                [k for (k, _, _), (_, _, c) in zip(admitted, a) if c]
    if abort:
        cancelled = [k for k, _, _ in queued + admitted]
    intake = sched.plan_intake(iter(queued), admitted, cancelled, max_rows, budget, abort)
    assert intake.retire == tuple(cancelled)
    assert intake.abort == abort
    assert list(intake.admit) == ([] if abort else _admit_one_by_one(queued, admitted, cancelled,
                                                                      max_rows, budget))
    with pytest.raises(dataclasses.FrozenInstanceError):
        intake.admit = ()  # type: ignore[misc]
    assert pickle.loads(pickle.dumps(intake)) == intake and hash(intake) is not None


def test_split_call_runs_scoring_rows_alone_and_keeps_power_of_two_rows():
    pieces = [(0, 64), (1, 40), (2, 50), (3, 64)]
    # no scoring row, nothing failed: the group as planned
    assert sched.split_call(64, pieces) == (sched.PrefillCall(64, tuple(pieces)),)
    # a scoring row runs alone, first, at its own bucket; the other 3 as 2 + 1 rows
    calls = sched.split_call(64, pieces, {1})
    assert calls[0] == sched.PrefillCall(sched.chunk_bucket(40), ((1, 40),), True)
    assert [len(c.pieces) for c in calls[1:]] == [2, 1]
    assert all(not c.score for c in calls[1:])
    assert sorted(k for c in calls for k, _ in c.pieces) == [0, 1, 2, 3]
    for c in calls:
        assert c.size == max(sched.chunk_bucket(n) for _, n in c.pieces)
    # survivors of a planned 4-row call (a testing fault hook failed one): 2 + 1 rows
    assert [len(c.pieces) for c in sched.split_call(64, pieces[:3], planned=4)] == [2, 1]


@settings(max_examples=100, deadline=None)
@given(decode=st.integers(0, 16), remaining=st.lists(st.integers(0, 3000), max_size=10),
       chunk_pow=st.integers(4, 10), extra=st.integers(0, 2000), max_rows=st.integers(1, 16),
       scoring=st.sets(st.integers(0, 9)))
def test_plan_step_calls_are_the_groups_split(decode, remaining, chunk_pow, extra, max_rows, scoring):
    chunk, budget = 1 << chunk_pow, decode + sched.MIN_CHUNK + extra
    waiting = [(i, r, 256) for i, r in enumerate(remaining)]
    plan = sched.plan_step(decode, waiting, chunk, budget, max_rows, scoring=scoring)
    assert plan.calls == tuple(c for size, members in plan.prefill
                               for c in sched.split_call(size, members, scoring))
    assert sorted(p for c in plan.calls for p in c.pieces) == sorted(
        p for _, members in plan.prefill for p in members)
    for c in plan.calls:
        assert c.score == (c.pieces[0][0] in scoring) and (not c.score or len(c.pieces) == 1)
        assert len(c.pieces) & (len(c.pieces) - 1) == 0  # a power of two of rows
    assert pickle.loads(pickle.dumps(plan)) == plan
    hash(plan)


def test_plan_decode_holds_per_row_k_masks_and_growth():
    rows = [(7, 100, False, False), (8, 40, True, False), (9, 90, False, False)]
    verify = sched.plan_decode(rows, {7: 3, 8: 4}, 4)
    assert verify.k == 4 and verify.drafts == ((7, 3), (8, 4))
    assert verify.masked == (8,) and verify.grow_to == 104 and not verify.split
    decode = sched.plan_decode(rows + [(10, 5, False, True)])
    assert decode.k == 0 and decode.drafts == () and decode.grow_to == 101 and decode.split
    # drafts without a K are not verified: a plain decode
    assert sched.plan_decode(rows, {7: 3}, 0).drafts == ()
    assert pickle.loads(pickle.dumps(verify)) == verify


def test_the_lockstep_message_is_plain_data():
    plan = sched.plan_step(1, [(3, 100, 256)], 64, 128, 4, intake=sched.Intake((), (3,)))
    msg = StepMessage((RequestRecord(3, (1, 2, 3), {"max_tokens": 4, "seed": 5}),), plan.intake, plan)
    back = pickle.loads(pickle.dumps(msg))
    assert back == msg and back.records[0].kwargs == {"max_tokens": 4, "seed": 5}
    assert back.prefill.calls == plan.calls and back.intake.admit == (3,)
