"""The scheduler's plans as plain data (fx_engine/engine/scheduler.py): `plan_step`,
`plan_maintenance` (compaction and capacity shrink after a step) and `plan_growth` (room
before a decode/verify step)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fx_engine.engine import scheduler as sched


@settings(max_examples=100, deadline=None)
@given(decode=st.integers(0, 16), remaining=st.lists(st.integers(0, 3000), max_size=10),
       chunk_pow=st.integers(4, 10), extra=st.integers(0, 2000), max_rows=st.integers(1, 16))
def test_plan_step_is_plain_data_of_group_prefill(decode, remaining, chunk_pow, extra, max_rows):
    chunk = 1 << chunk_pow
    budget = decode + sched.MIN_CHUNK + extra
    waiting = [(i, r, 256) for i, r in enumerate(remaining)]
    plan = sched.plan_step(decode, waiting, chunk, budget, max_rows)
    assert plan.decode_rows == decode
    assert [(c, list(m)) for c, m in plan.prefill] == sched.group_prefill(
        decode, waiting, chunk, budget, max_rows)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.decode_rows = 0  # type: ignore[misc]
    hash(plan)


@st.composite
def batches(draw):
    max_rows = draw(st.integers(1, 32))
    rows = draw(st.sampled_from(sched.row_buckets(max_rows)))
    live = sorted(draw(st.sets(st.integers(0, rows - 1), max_size=rows)))
    capacity = draw(st.sampled_from([256, 512, 1024, 4096, 16384]))
    lengths = [draw(st.integers(1, capacity - 1)) for _ in live]
    budget = draw(st.one_of(st.none(), st.integers(256, 1 << 18)))
    return live, lengths, rows, capacity, max_rows, budget


@settings(max_examples=500, deadline=None)
@given(b=batches(), prefilling=st.booleans())
def test_plan_maintenance(b, prefilling):
    live, lengths, rows, capacity, max_rows, budget = b
    m = sched.plan_maintenance(live, lengths, rows, capacity, max_rows, budget, prefilling)
    assert m.drop == (not live and not prefilling)
    if not live:
        assert m.compact_to is None and m.capacity_to is None
        return
    if m.compact_to is not None:
        # a row bucket holding every live row, smaller or gathering rows to 0..live-1
        assert m.compact_to in sched.row_buckets(max_rows)
        assert m.compact_to >= len(live)
        assert m.compact_to < rows or live != list(range(len(live)))
    over = budget is not None and rows * capacity > budget
    if over:  # an over-budget batch always shrinks to its live rows' bucket (or less)
        target = m.compact_to if m.compact_to is not None else rows
        assert target <= sched.row_bucket(len(live), max_rows) or \
            live == list(range(len(live))) and rows == sched.row_bucket(len(live), max_rows)
    if sched.shrink_rows_target(len(live), rows, max_rows) is None and not over:
        assert m.compact_to is None  # hysteresis: no copy unless a quarter is enough
    if m.capacity_to is not None:
        assert max(lengths) + 1 <= m.capacity_to // 2 and m.capacity_to < capacity
    else:
        assert sched.capacity_bucket(max(lengths) + 1) * 4 > capacity or \
            sched.capacity_bucket(2 * (max(lengths) + 1)) >= capacity


@settings(max_examples=500, deadline=None)
@given(b=batches(), needed=st.integers(1, 1 << 16))
def test_plan_growth(b, needed):
    live, _, rows, capacity, max_rows, budget = b
    compact_to, cap = sched.plan_growth(needed, rows, len(live), capacity, max_rows, budget)
    if needed <= capacity:
        assert (compact_to, cap) == (None, None)
        return
    assert cap == sched.capacity_bucket(needed) and cap >= needed
    if budget is not None and rows * cap > budget:
        assert compact_to == sched.row_bucket(len(live), max_rows)
    else:
        assert compact_to is None
