"""The continuous-batching engine: batch/chunk invariance against the request run alone,
bucketed shapes and recompiles, interleaving policy, cancellation, admission control,
failure containment, threads and asyncio, trace events, memory soak."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import attrs
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.engine import scheduler as sched
from fx_engine.engine.engine import Engine, EngineClosed, QueueFull, insert_row
from fx_engine.engine.generate import reference_generate
from fx_engine.core.steps import decode_step_compiled, prefill_step_compiled, sample_step_compiled


@pytest.fixture(scope="module")
def bi_model(tiny_dir):
    """The tiny model in batch-invariant mode (bitwise row and chunk invariance)."""
    return fx_engine.load(tiny_dir, batch_invariant=True)


@pytest.fixture(scope="module")
def bi_q4_model(tiny_folder):
    """A 4-bit quantized tiny model in batch-invariant mode: its linears run the native
    quantized matmul (where available), whose kernel paths differ by row count."""
    path = tiny_folder(seed=3,
                       quantize={"group_size": 32, "bits": 4})
    return fx_engine.load(path, batch_invariant=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    """n token ids of the tiny model (vocab 384), varied by salt."""
    return [3 + (i * 7 + salt * 13) % 370 for i in range(n)]


_ALONE: dict = {}


def alone(model, ids, **kw):
    """The reference: the request run alone through the plain single-request loop (one-shot prefill
    of up to 512 tokens, batch of one)."""
    key = (id(model), tuple(ids), tuple(sorted(kw.items())))
    if key not in _ALONE:
        _ALONE[key] = reference_generate(model, ids, **kw)
    return _ALONE[key]


def run_all(engine):
    while engine.step():
        pass


def sampling(kind: int, seed: int) -> dict:
    return [
        dict(),                                                     # greedy
        dict(temperature=1.0, seed=seed),                           # seeded
        dict(temperature=0.9, top_p=0.9, top_k=40, seed=seed),     # seeded + filters
        dict(temperature=0.7, repetition_penalty=1.3, seed=seed, logprobs=2),
    ][kind]


# ------------------------------------------------------------------------ the scheduler


@settings(max_examples=300, deadline=None)
@given(
    decode=st.integers(0, 16),
    remaining=st.lists(st.integers(0, 5000), max_size=6),
    chunk_pow=st.integers(4, 10),
    extra=st.integers(16, 1200),
)
def test_plan_prefill_respects_budget_and_fifo(decode, remaining, chunk_pow, extra):
    chunk = 1 << chunk_pow
    budget = decode + extra
    plan = sched.plan_prefill(decode, list(enumerate(remaining)), chunk, budget)
    assert sum(sched.chunk_bucket(n) for _, n in plan) <= budget - decode
    keys = [k for k, _ in plan]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    for k, n in plan:
        assert 1 <= n <= min(chunk, remaining[k])
        if n < remaining[k]:
            assert n == sched.chunk_bucket(n)  # unfinished pieces are unpadded bucket shapes
    # FIFO: a request is skipped only if it has nothing left; the head always progresses
    first = next((k for k, r in enumerate(remaining) if r > 0), None)
    if first is not None:
        assert plan and plan[0][0] == first
        for k in range(first, plan[-1][0]):
            assert remaining[k] == 0 or k in keys


@settings(max_examples=300, deadline=None)
@given(
    decode=st.integers(0, 16),
    waiting=st.lists(st.tuples(st.integers(0, 700), st.sampled_from([256, 512])), max_size=12),
    chunk_pow=st.integers(4, 9),
    extra=st.integers(16, 1200),
    max_rows=st.integers(1, 12),
)
def test_group_prefill_calls(decode, waiting, chunk_pow, extra, max_rows):
    """Batched prefill calls: the same requests as plan_prefill (FIFO, budget), rows x C
    within the budget, a power-of-two row count of one group, padding bounded, unfinished
    pieces unpadded."""
    chunk = 1 << chunk_pow
    budget = decode + extra
    w = [(k, r, g) for k, (r, g) in enumerate(waiting)]
    calls = sched.group_prefill(decode, w, chunk, budget, max_rows)
    base = sched.plan_prefill(decode, [(k, r) for k, r, _ in w], chunk, budget)
    keys = [k for _, members in calls for k, _ in members]
    assert sorted(keys) == [k for k, _ in base] and len(set(keys)) == len(keys)
    assert sum(c * len(members) for c, members in calls) <= budget - decode
    planned = dict(base)
    for c, members in calls:
        rows = len(members)
        assert rows & (rows - 1) == 0 and rows <= max_rows
        assert len({waiting[k][1] for k, _ in members}) == 1  # one prefill-cache shape
        assert c == max(sched.chunk_bucket(n) for _, n in members)
        for k, n in members:
            remaining = waiting[k][0]
            assert planned[k] <= n <= min(chunk, remaining)
            assert c <= sched.MAX_GROUP_PAD * sched.chunk_bucket(n)
            if n < remaining:
                assert n == c  # an unfinished piece fills its row
    # pieces of one padded shape and group in the same step share calls
    if len(waiting) >= 2 and decode == 0 and extra >= 2 * chunk and max_rows >= 2:
        same = [(k, chunk, 256) for k in range(2)]
        assert sched.group_prefill(0, same, chunk, budget, max_rows) == [(chunk, [(0, chunk), (1, chunk)])]


@settings(max_examples=300, deadline=None)
@given(
    decode=st.integers(0, 16),
    waiting=st.lists(st.tuples(st.integers(0, 700), st.sampled_from([256, 512]), st.booleans()), max_size=12),
    chunk_pow=st.integers(4, 9),
    extra=st.integers(16, 1200),
    max_rows=st.integers(1, 12),
    scoring=st.sets(st.integers(0, 11), max_size=3),
)
def test_packed_prefill_calls(decode, waiting, chunk_pow, extra, max_rows, scoring):
    """Requests whose calls may run on packed rows: they cost their real tokens (the calls'
    costs within the budget, packed rows rounded up by `packed_rows`), share calls only with
    each other, join calls up to PACKED_GROUP_PAD x their bucket, and their calls name the
    packed rows, fewer than the padded ones; scoring rows never pack."""
    chunk = 1 << chunk_pow
    budget = decode + extra
    w = [(k, r, g) for k, (r, g, _) in enumerate(waiting)]
    asked = {k for k, (_, _, p) in enumerate(waiting) if p}
    packable = asked - scoring  # (plan_step's rule: scoring rows run score_step, unpacked)
    calls = sched.group_prefill(decode, w, chunk, budget, max_rows, packable)
    base = sched.plan_prefill(decode, [(k, r) for k, r, _ in w], chunk, budget, packable)
    keys = [k for _, members in calls for k, _ in members]
    assert sorted(keys) == [k for k, _ in base] and len(set(keys)) == len(keys)
    cost = 0
    for c, members in calls:
        rows = len(members)
        assert rows & (rows - 1) == 0 and rows <= max_rows
        assert len({(waiting[k][1], k in packable) for k, _ in members}) == 1  # one shape, one kind
        assert c == max(sched.chunk_bucket(n) for _, n in members)
        packs = members[0][0] in packable
        cost += sum(n for _, n in members) if packs else c * rows
        for k, n in members:
            assert c <= (sched.PACKED_GROUP_PAD if packs else sched.MAX_GROUP_PAD) * sched.chunk_bucket(n)
            if n < waiting[k][0]:
                assert n == c
    assert cost <= budget - decode
    plan = sched.plan_step(decode, w, chunk, budget, max_rows, scoring=scoring, packable=asked)
    assert sorted(k for call in plan.calls for k, _ in call.pieces) == sorted(keys)
    for call in plan.calls:
        tokens = sum(n for _, n in call.pieces)
        if call.packed is not None:
            assert not call.score and all(k in packable and k not in scoring for k, _ in call.pieces)
            assert call.packed == sched.packed_rows(tokens) and tokens <= call.packed < call.size * len(call.pieces)
        elif all(k in packable and k not in scoring for k, _ in call.pieces) and len(call.pieces) > 1:
            assert sched.packed_rows(tokens) >= call.size * len(call.pieces)  # packing would not save rows


def test_packed_calls_of_a_chat_burst():
    """Eight short chats at once (the serving benchmark's N=8 prompt lengths): padded to their
    buckets they take six calls and 528 rows of products, one step short of the budget; packed,
    one call of 448 rows."""
    lengths = [49, 67, 68, 36, 44, 110, 25, 30]
    w = [(k, n, 256) for k, n in enumerate(lengths)]
    padded = sched.plan_step(0, w, 512, 512 + 8, 8)
    assert len(padded.calls) == 6 and sum(c.size * len(c.pieces) for c in padded.calls) == 512
    assert dict(p for c in padded.calls for p in c.pieces)[7] == 16  # the last prompt: 16 of 30 tokens
    packed = sched.plan_step(0, w, 512, 512 + 8, 8, packable=set(range(8)))
    assert [(c.size, c.packed, len(c.pieces)) for c in packed.calls] == [(112, 448, 8)]
    assert sorted(packed.calls[0].pieces) == list(enumerate(lengths))


@given(n=st.integers(0, 100))
def test_pow2_splits(n):
    parts = sched.pow2_splits(n)
    assert sum(parts) == n and len(set(parts)) == len(parts)
    assert all(p & (p - 1) == 0 for p in parts) and parts == sorted(parts, reverse=True)


@given(n=st.integers(1, 8192))
def test_chunk_bucket_shapes(n):
    b = sched.chunk_bucket(n)
    assert b >= max(n, sched.MIN_CHUNK) and sched.chunk_bucket(b) == b  # shapes are fixed points
    if n > 64:
        assert b - n < b / 5  # four shapes per octave: under 20% padding, never a doubling
    p = sched.pow2_ceil(n)
    assert sched.chunk_bucket(max(p, sched.MIN_CHUNK)) == max(p, sched.MIN_CHUNK)  # powers of two stay shapes


def test_chunk_bucket_shape_count():
    # the compile count the spec promises: 15 prefill shapes up to a 512-token chunk
    assert sorted({sched.chunk_bucket(n) for n in range(1, 513)}) == [
        16, 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]


@given(n=st.integers(0, 64), max_rows=st.integers(1, 64))
def test_row_buckets(n, max_rows):
    if n > max_rows:
        with pytest.raises(ValueError):
            sched.row_bucket(n, max_rows)
        return
    b = sched.row_bucket(n, max_rows)
    assert b in sched.row_buckets(max_rows) and b >= max(n, 1)
    assert len(sched.row_buckets(max_rows)) <= max_rows.bit_length() + 1


# ------------------------------------------------------------------------ invariance


request_st = st.fixed_dictionaries({
    "length": st.integers(1, 600),
    "max_tokens": st.integers(1, 64),
    "arrival": st.integers(0, 40),
    "kind": st.integers(0, 3),
    "seed": st.integers(0, 2**32),
    "cancel_after": st.one_of(st.none(), st.integers(0, 30)),
})


ENGINE_CASES = dict(
    requests=st.lists(request_st, min_size=1, max_size=6),
    chunk=st.sampled_from([16, 32, 64, 128, 512]),
    max_rows=st.integers(1, 5),
    extra_budget=st.integers(16, 300),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**ENGINE_CASES)
@pytest.mark.slow
def test_each_request_matches_running_alone(bi_model, requests, chunk, max_rows, extra_budget):
    """Random arrivals, lengths, chunk sizes, budgets, sampling settings and cancellations:
    every request that is not cancelled produces exactly (bitwise: tokens, logprobs) what it
    produces alone; a cancelled one produces a prefix of it."""
    _check_matches_alone(bi_model, requests, chunk, max_rows, extra_budget)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**ENGINE_CASES)
@pytest.mark.slow
def test_each_request_matches_running_alone_quantized(bi_q4_model, requests, chunk, max_rows,
                                                      extra_budget):
    """The same property with 4-bit weights: prefill chunks, decode batches of 1-5 rows and
    the one-shot reference run the quantized matmul at different row counts."""
    _check_matches_alone(bi_q4_model, requests, chunk, max_rows, extra_budget)


def _check_matches_alone(bi_model, requests, chunk, max_rows, extra_budget) -> None:
    engine = Engine(bi_model, max_rows=max_rows, prefill_chunk=chunk,
                    step_token_budget=max_rows + extra_budget)
    handles: dict[int, object] = {}
    step = 0
    while len(handles) < len(requests) or engine.has_work():
        for i, r in enumerate(requests):
            if r["arrival"] == step:
                handles[i] = engine.submit(prompt(r["length"], i), max_tokens=r["max_tokens"],
                                           **sampling(r["kind"], r["seed"]))
            if r["cancel_after"] is not None and r["arrival"] + r["cancel_after"] == step and i in handles:
                handles[i].cancel()
        engine.step()
        step += 1
        assert step < 5000
    for i, r in enumerate(requests):
        got = handles[i].result()
        ref = alone(bi_model, prompt(r["length"], i), max_tokens=r["max_tokens"],
                    **sampling(r["kind"], r["seed"]))
        if got.finish_reason == "cancelled":
            assert r["cancel_after"] is not None
            assert got.token_ids == ref.token_ids[: len(got.token_ids)]
        else:
            assert got.token_ids == ref.token_ids, (i, r)
            assert got.finish_reason == ref.finish_reason
            assert got.text == ref.text
            if ref.logprobs is not None:
                assert [(l.token_id, l.logprob, l.top) for l in got.logprobs] == [
                    (l.token_id, l.logprob, l.top) for l in ref.logprobs]
    assert not engine.has_work() and engine.stats()["rows"] == 0


def test_engine_alone_matches_generate(bi_model):
    """The engine's single-request output equals fx_engine.generate's (separate code path)."""
    for kw in (dict(), dict(temperature=1.0, seed=5), dict(temperature=0.8, top_p=0.9, seed=9, stop=["a"])):
        ids = prompt(90, 3)
        got = Engine(bi_model).submit(ids, max_tokens=24, **kw).result()
        ref = reference_generate(bi_model, ids, max_tokens=24, **kw)
        assert got.text == ref.text and got.finish_reason == ref.finish_reason
        assert got.usage.prompt_tokens == ref.usage.prompt_tokens == 90


def test_insert_row_copies_only_the_row(bi_model):
    from fx_engine.core.cache import LayerKV, init_cache
    from fx_engine.core.models import cache_layout

    c = bi_model.config
    big = init_cache(cache_layout(c), 4, 64)
    small = init_cache(cache_layout(c), 1, 32)
    small = attrs.evolve(small, layers=tuple(LayerKV(e.keys + 1, e.values + 2) for e in small.layers),
                         lengths=mx.array([5]))
    out = insert_row(big, small, 2)
    assert out.lengths.tolist() == [0, 0, 5, 0]
    k = out.keys[0]
    assert mx.all(k[2, :, :5] == 1).item() and mx.all(k[2, :, 5:] == 0).item()
    assert mx.all(k[[0, 1, 3]] == 0).item() and mx.all(out.values[1][2, :, :5] == 2).item()


# ------------------------------------------------------------------------ shapes / recompiles


def _workload(engine, salt):
    kinds = [dict(), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2)]
    spec = [(5, 30, 0), (300, 12, 1), (40, 50, 2), (700, 8, 0), (17, 40, 1), (120, 25, 2),
            (2, 60, 0), (450, 20, 1)]
    handles = []
    for step in range(400):
        if step % 3 == 0 and spec:
            n, mt, k = spec.pop(0)
            handles.append(engine.submit(prompt(n, salt + len(handles)), max_tokens=mt, **kinds[k]))
        if not engine.step() and not spec:
            break
    return [h.result() for h in handles]


def test_zero_recompiles_after_warmup_and_bounded_shapes(bi_model):
    fns = (prefill_step_compiled, decode_step_compiled, sample_step_compiled)
    engine = Engine(bi_model, max_rows=4, prefill_chunk=64)
    start = {f.name: f.traces for f in fns}
    _workload(engine, 0)  # warm-up
    warm = {f.name: f.traces for f in fns}
    _workload(engine, 100)  # same shapes, different tokens and prompts
    assert {f.name: f.traces for f in fns} == warm
    # Every compiled shape comes from the buckets; each trace is a distinct shape.
    dec = decode_step_compiled.trace_log[start["decode_step"]:]
    pre = prefill_step_compiled.trace_log[start["prefill_step"]:]
    rows = set(sched.row_buckets(4))
    caps = {sched.capacity_bucket(n) for n in range(1, 2049)}
    c = bi_model.config

    from fx_engine.core.cache import dense_layout, init_cache

    sink = init_cache(dense_layout(1, 1, 1), 1, 16).keys[0].shape[2] - 16  # extra slots past the capacity

    def kv_shape(sig):  # the first cache array [B, Hkv, C (+ sink), D] among the leaves
        return next(s for s, _ in sig if len(s) == 4 and s[1] == c.num_kv_heads and s[3] == c.head_dim)

    dec_shapes = {(kv_shape(t["signature"])[0], kv_shape(t["signature"])[2] - sink) for t in dec}
    assert {b for b, _ in dec_shapes} <= rows and {c for _, c in dec_shapes} <= caps, dec_shapes
    pre_chunks = {t["signature"][-2][0][1] for t in pre}  # tokens [1, chunk]
    assert pre_chunks <= {16, 32, 64}
    keys = [(t["structure_id"], t["signature"]) for t in dec]
    assert len(keys) == len(set(keys))
    # bound: row buckets x capacity buckets used x spans per capacity x sampling structures
    spans = {sched.capacity_bucket(1)}  # 256 covers all spans here (<= 770 + 60 tokens -> <= 1024)
    assert len(dec) <= len(rows) * 3 * 4 * 3 + len(spans)


# ------------------------------------------------------------------------ interleaving policy


def test_long_prompt_mid_stream_delays_decode_by_at_most_one_chunk(bi_model):
    """Two rows are decoding when a 1,500-token prompt arrives: every step still runs one
    decode step over them, and no step runs more than step_token_budget - rows prefill
    tokens (one chunk), so their decode gap is one step of bounded size."""
    chunk, rows = 64, 4
    budget = rows + 29  # 33: with two rows decoding, 31 tokens are left -> pieces of 16
    engine = Engine(bi_model, max_rows=rows, prefill_chunk=chunk, step_token_budget=budget)
    a = engine.submit(prompt(20, 1), max_tokens=60, temperature=1.0, seed=1)
    b = engine.submit(prompt(30, 2), max_tokens=60)
    for _ in range(5):
        engine.step()
    long = engine.submit(prompt(1500, 3), max_tokens=5)
    run_all(engine)
    ev = list(engine.trace_events)
    for h in (a, b):
        steps = [e["step"] for e in ev if e["kind"] == "decode" and h.id in e["requests"]]
        assert len(steps) == 59  # first token from prefill, 59 decode steps
        assert max(y - x for x, y in zip(steps, steps[1:])) == 1
    long_steps = {e["step"] for e in ev if e["kind"] == "prefill" and e["request"] == long.id}
    assert len(long_steps) >= 1500 // chunk  # interleaved, not one blocking prefill
    for s in {e["step"] for e in ev}:
        pre = sum(e["padded"] for e in ev if e["kind"] == "prefill" and e["step"] == s)
        decoding = {r for e in ev if e["kind"] == "decode" and e["step"] == s - 1 for r in e["requests"]}
        retired = {e["request"] for e in ev if e["kind"] == "retire" and e["step"] <= s - 1}
        assert pre <= min(chunk, budget - len(decoding - retired))  # decode rows come first
        assert pre <= budget - 2 or not ({a.id, b.id} <= decoding - retired)
    for h, n, kw in ((a, 20, dict(temperature=1.0, seed=1)), (b, 30, {})):
        assert h.result().token_ids == alone(bi_model, prompt(n, 1 if h is a else 2), max_tokens=60, **kw).token_ids
    assert long.result().token_ids == alone(bi_model, prompt(1500, 3), max_tokens=5).token_ids


def test_batched_prefill_one_call_first_tokens_together(bi_model):
    """Prompts that arrive together share prefill_step calls (several rows each) and get
    their first tokens in the same step; each row's output is bitwise the request alone."""
    engine = Engine(bi_model, max_rows=8, prefill_chunk=64, step_token_budget=8 * 64 + 8)
    lens = [40, 50, 57, 60, 64, 45, 20]
    hs = [engine.submit(prompt(n, i), max_tokens=6, **sampling(i % 4, i)) for i, n in enumerate(lens)]
    run_all(engine)
    ev = list(engine.trace_events)
    pre = [e for e in ev if e["kind"] == "prefill"]
    assert len({e["step"] for e in pre}) == 1  # all prompts in the first step
    assert max(e["rows"] for e in pre) == 4 and sum(e["padded"] for e in pre) <= engine.step_token_budget
    calls = {(e["rows"], e["padded"]) for e in pre}
    assert (4, 64) in calls and (2, 64) in calls  # 6 pieces of one shape: 4 + 2 rows
    first = {e["request"]: e["step"] for e in ev if e["kind"] == "sample"}
    assert len(set(first.values())) == 1
    for i, (h, n) in enumerate(zip(hs, lens)):
        assert h.result().token_ids == alone(bi_model, prompt(n, i), max_tokens=6, **sampling(i % 4, i)).token_ids


def test_batched_prefill_late_joins_and_prefix_rows(bi_model):
    """A long prompt prefilled chunk by chunk shares its calls with requests admitted
    later (rows at different positions), including one restored from the prefix cache;
    every output is bitwise the request alone."""
    engine = Engine(bi_model, max_rows=4, prefill_chunk=32, step_token_budget=132,
                    prefix_cache_bytes=64 << 20, prefix_block_size=16)
    base = prompt(70, 9)
    engine.submit(base, max_tokens=1)
    run_all(engine)
    long = engine.submit(prompt(200, 1), max_tokens=5)
    engine.step()
    late = [engine.submit(base + prompt(40, 2), max_tokens=5, temperature=1.0, seed=4),
            engine.submit(prompt(150, 3), max_tokens=5)]
    run_all(engine)
    ev = list(engine.trace_events)
    assert late[0].result().usage.cached_tokens >= 64
    steps = {}
    for e in ev:
        if e["kind"] == "prefill":
            steps.setdefault(e["step"], []).append(e)
    assert any({long.id, late[1].id} <= {e["request"] for e in es if e["rows"] > 1} for es in steps.values())
    assert any(len({e["start"] for e in es if e["rows"] > 1}) > 1 for es in steps.values())
    for es in steps.values():
        calls = {}
        for e in es:
            calls.setdefault((e["rows"], e["padded"], e["seconds"]), []).append(e)
        assert sum(r * p for (r, p, _) in calls) <= engine.step_token_budget
    assert long.result().token_ids == alone(bi_model, prompt(200, 1), max_tokens=5).token_ids
    assert late[0].result().token_ids == alone(bi_model, base + prompt(40, 2), max_tokens=5,
                                               temperature=1.0, seed=4).token_ids
    assert late[1].result().token_ids == alone(bi_model, prompt(150, 3), max_tokens=5).token_ids


def test_a_burst_prefills_on_packed_rows(bi_model):
    """Prompts of different lengths arriving together share one call on packed rows (the
    trace names them), and each request's output is the one it produces alone."""
    lengths = [10, 37, 50, 23]
    engine = Engine(bi_model, max_rows=4, prefill_chunk=64, step_token_budget=132)
    hs = [engine.submit(prompt(n, i), max_tokens=6) for i, n in enumerate(lengths)]
    run_all(engine)
    calls = {e["call"]: (e["rows"], e["padded"], e["packed"]) for e in engine.trace_events if e["kind"] == "prefill"}
    assert list(calls.values()) == [(4, 64, sched.packed_rows(sum(lengths)))]
    for i, (h, n) in enumerate(zip(hs, lengths)):
        assert h.result().token_ids == alone(bi_model, prompt(n, i), max_tokens=6).token_ids


def test_a_batch_with_free_rows_decodes_on_packed_rows(bi_model):
    """Requests that finish early leave free rows in the batch's row bucket (compaction
    waits until the live rows fit in a quarter of it): the decode steps then run on the
    live rows' bucket of packed rows (traced), and every request's output is its own."""
    budgets = [2, 3, 20, 20, 2, 3, 4, 20]
    engine = Engine(bi_model, max_rows=8, prefill_chunk=64, step_token_budget=8 * 64)
    hs = [engine.submit(prompt(12 + 3 * i, i), max_tokens=m) for i, m in enumerate(budgets)]
    run_all(engine)
    decodes = [(e["batch"], e["rows"], e["packed"]) for e in engine.trace_events if e["kind"] == "decode"]
    assert (3, 8, 4) in decodes  # three live rows of eight: four packed rows
    assert all(p is None if b > r // 2 else p == sched.pow2_ceil(b) for b, r, p in decodes)
    for i, (h, m) in enumerate(zip(hs, budgets)):
        assert h.result().token_ids == alone(bi_model, prompt(12 + 3 * i, i), max_tokens=m).token_ids


def test_batched_prefill_failure_stays_in_its_row(bi_model):
    """A request failing in a shared prefill call fails alone; the call's other rows run."""
    engine = Engine(bi_model, max_rows=4, prefill_chunk=64, step_token_budget=4 * 64 + 4)
    hs = [engine.submit(prompt(50, i), max_tokens=4) for i in range(4)]
    bad = hs[1]

    class Boom(Exception):
        pass

    engine.fault_hook = lambda stage, h: (_ for _ in ()).throw(Boom("x")) if stage == "prefill" and h is bad else None
    run_all(engine)
    with pytest.raises(Boom):
        bad.result()
    for i, h in enumerate(hs):
        if h is not bad:
            assert h.result().token_ids == alone(bi_model, prompt(50, i), max_tokens=4).token_ids
    rows = sorted(e["rows"] for e in engine.trace_events if e["kind"] == "prefill")
    assert rows == [1, 2, 2]  # three survivors: a 2-row call and a 1-row call


# ------------------------------------------------------------------------ cancellation


def test_cancel_frees_row_within_one_step(bi_model):
    engine = Engine(bi_model, max_rows=3, prefill_chunk=32)
    hs = [engine.submit(prompt(n, i), max_tokens=40, temperature=1.0, seed=i)
          for i, n in enumerate((10, 50, 25))]
    queued = engine.submit(prompt(8, 9), max_tokens=5)
    for _ in range(8):
        engine.step()
    victim = hs[1]
    victim.cancel()
    queued.cancel()
    step = engine.steps
    engine.step()
    retire = [e for e in engine.trace_events if e["kind"] == "retire" and e["request"] == victim.id]
    assert retire and retire[0]["step"] == step + 1 and retire[0]["reason"] == "cancelled"
    assert victim.done and engine.stats()["decoding"] == 2
    out = victim.result()
    assert out.finish_reason == "cancelled" and 0 < len(out.token_ids) < 40
    events = list(victim)
    assert events[-1].finish_reason == "cancelled" and events[-1].usage is not None
    assert [t for d in events for t in d.token_ids] == list(out.token_ids)
    assert "".join(events) == out.text
    assert queued.result().finish_reason == "cancelled" and queued.result().token_ids == ()
    run_all(engine)
    ref = alone(bi_model, prompt(50, 1), max_tokens=40, temperature=1.0, seed=1)
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    for i, n in ((0, 10), (2, 25)):
        assert hs[i].result().token_ids == alone(bi_model, prompt(n, i), max_tokens=40,
                                                 temperature=1.0, seed=i).token_ids


def test_cancel_during_prefill(bi_model):
    engine = Engine(bi_model, max_rows=2, prefill_chunk=16)
    h = engine.submit(prompt(500, 1), max_tokens=5)
    engine.step()
    engine.step()
    h.cancel()
    engine.step()
    assert h.result().finish_reason == "cancelled" and h.result().token_ids == ()
    assert not engine.has_work()


# ------------------------------------------------------------------------ admission


def test_queue_full_is_a_clear_error(bi_model):
    engine = Engine(bi_model, max_rows=1, max_queue=2)
    engine.submit(prompt(5), max_tokens=2)
    engine.submit(prompt(5), max_tokens=2)
    with pytest.raises(QueueFull, match="queue is full"):
        engine.submit(prompt(5), max_tokens=2)
    run_all(engine)
    engine.submit(prompt(5), max_tokens=2).result()  # room again


def test_context_overflow_and_never_fitting_budget_are_rejected(bi_model):
    ctx = bi_model.config.max_position_embeddings
    engine = Engine(bi_model, kv_budget_tokens=1024)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.submit(prompt(ctx - 10), max_tokens=12)  # positions 0 .. ctx: one too many
    with pytest.raises(ValueError, match="KV budget"):
        engine.submit(prompt(1000), max_tokens=100)  # 1100 slots -> a 2048 bucket > 1024
    with pytest.raises(ValueError, match="max_tokens"):
        engine.submit(prompt(5), max_tokens=-1)
    with pytest.raises(ValueError, match="temperature"):
        engine.submit(prompt(5), temperature=-1)
    assert engine.stats()["queued"] == 0
    Engine(bi_model).submit(prompt(ctx - 10), max_tokens=11)  # exactly fits: accepted


def test_kv_budget_queues_until_memory_is_free(bi_model):
    """Budget 768 slots. Each request needs a 256-slot decode row and, while prefilling, a
    256-slot prefill cache (100 + a 64 chunk -> 256). The first is admitted (256 + 256); the
    second only once the first has left prefill (2 x 256 + 256); a third (4-row bucket x
    256) waits until one finishes. Decode cache plus prefill caches never exceed the budget."""
    engine = Engine(bi_model, max_rows=4, kv_budget_tokens=768, prefill_chunk=64)
    hs = [engine.submit(prompt(100, i), max_tokens=20 + 10 * i) for i in range(3)]
    peak_rows = 0
    while engine.step():
        s = engine.stats()
        used = s["rows"] * s["capacity"] + s["prefill_cache_slots"]
        assert used <= 768, s
        assert s["prefilling"] <= 1 and s["prefilling"] + s["decoding"] <= 2
        peak_rows = max(peak_rows, s["decoding"])
    assert peak_rows == 2
    admits = [e for e in engine.trace_events if e["kind"] == "admit"]
    first_retire = min(e["step"] for e in engine.trace_events if e["kind"] == "retire")
    assert admits[2]["step"] >= first_retire
    for i, h in enumerate(hs):
        assert h.result().token_ids == alone(bi_model, prompt(100, i), max_tokens=20 + 10 * i).token_ids


def test_kv_budget_bytes(bi_model):
    engine = Engine(bi_model, kv_budget_bytes=engine_bytes(bi_model, 256))
    assert engine.kv_budget_tokens == 256
    with pytest.raises(ValueError, match="KV budget"):
        engine.submit(prompt(200), max_tokens=100)


def engine_bytes(model, tokens):
    c = model.config
    return tokens * 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


# ------------------------------------------------------------------------ failure containment


def test_failing_row_fails_only_that_request(bi_model):
    class Boom(RuntimeError):
        pass

    calls = []

    def bad_processor(tokens, logits):  # a user's processor that breaks on its 6th call
        calls.append(tokens.size)
        if len(calls) == 6:
            raise Boom("bad logits processor")
        return logits

    engine = Engine(bi_model, max_rows=4, prefill_chunk=32)
    a = engine.submit(prompt(40, 1), max_tokens=30, temperature=1.0, seed=3)
    v = engine.submit(prompt(70, 2), max_tokens=30, logits_processors=[bad_processor])
    b = engine.submit(prompt(15, 3), max_tokens=30, temperature=0.5, seed=4)
    run_all(engine)
    with pytest.raises(Boom, match="bad logits processor"):
        v.result()
    got = []
    with pytest.raises(Boom):
        for d in v:
            got.extend(d.token_ids)
    assert len(got) == 5  # partial output was delivered before the error
    assert calls == [70 + i for i in range(6)]  # saw the prompt plus every token so far
    retire = [e for e in engine.trace_events if e["kind"] == "retire" and e["request"] == v.id]
    assert retire[0]["reason"] == "error" and "Boom" in retire[0]["error"]
    assert a.result().token_ids == alone(bi_model, prompt(40, 1), max_tokens=30, temperature=1.0, seed=3).token_ids
    assert b.result().token_ids == alone(bi_model, prompt(15, 3), max_tokens=30, temperature=0.5, seed=4).token_ids
    # a failure in prefill is contained too
    engine.fault_hook = lambda stage, h: (_ for _ in ()).throw(Boom("prefill")) if stage == "prefill" and h.id == bad.id else None
    bad = engine.submit(prompt(50, 5), max_tokens=3)
    ok = engine.submit(prompt(50, 6), max_tokens=3)
    run_all(engine)
    with pytest.raises(Boom, match="prefill"):
        bad.result()
    assert ok.result().finish_reason == "length"


def _ban_top(tokens, logits):
    """A logits processor: forbid the currently most likely token (changes greedy output)."""
    top = mx.argmax(logits, axis=-1, keepdims=True)
    return mx.put_along_axis(logits, top, mx.array(-1e9, logits.dtype), axis=-1)


@pytest.mark.oracle
def test_logits_processors_match_mlx_lm(tiny_dir, bi_model):
    """Per-request logits processors (mlx-lm's callable convention), oracle: mlx-lm's
    generate_step with the same processor. Rows without processors share the step."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    ref_model, _ = load_model(tiny_dir)
    seen = []

    def ban_and_record(tokens, logits):
        seen.append(tokens.tolist())
        return _ban_top(tokens, logits)

    ids = prompt(33, 7)
    ref = [int(t) for t, _ in generate_step(mx.array(ids), ref_model, max_tokens=12,
                                            logits_processors=[_ban_top])]
    plain = alone(bi_model, ids, max_tokens=12).token_ids
    assert list(plain) != ref  # the processor really changes the output
    engine = Engine(bi_model, max_rows=4, prefill_chunk=16)
    h = engine.submit(ids, max_tokens=12, logits_processors=[ban_and_record])
    other = engine.submit(prompt(20, 8), max_tokens=12)
    run_all(engine)
    assert list(h.result().token_ids) == ref
    assert other.result().token_ids == alone(bi_model, prompt(20, 8), max_tokens=12).token_ids
    assert seen[0] == ids and seen[-1] == ids + ref[:-1]
    assert list(reference_generate(bi_model, ids, max_tokens=12,
                                   logits_processors=[_ban_top]).token_ids) == ref
    assert list(fx_engine.generate(bi_model, ids, max_tokens=12,
                                   logits_processors=[_ban_top]).token_ids) == ref


@pytest.mark.parametrize("bad, match", [
    (_ban_top, "logits_processors must be a list"),
    ([_ban_top, 3], r"logits_processors\[1\] must be callable"),
])
def test_logits_processors_validation(bi_model, bad, match):
    with pytest.raises(ValueError, match=match):
        Engine(bi_model).submit(prompt(5), logits_processors=bad)


@pytest.mark.parametrize("wrong", [lambda t, lg: lg[:, :10], lambda t, lg: lg.reshape(-1, 1)])
def test_processor_returning_a_wrong_shape_fails_its_request(bi_model, wrong):
    engine = Engine(bi_model, max_rows=2)
    bad = engine.submit(prompt(9), max_tokens=4, logits_processors=[wrong])
    ok = engine.submit(prompt(9, 1), max_tokens=4)
    run_all(engine)
    with pytest.raises(ValueError, match=r"logits_processors\[0\] must return logits of shape"):
        bad.result()
    assert ok.result().finish_reason == "length"


# ------------------------------------------------------------------------ threads, asyncio, events


def test_background_thread_and_submit_from_many_threads(bi_model):
    results = {}
    with Engine(bi_model, max_rows=4, prefill_chunk=64) as engine:
        assert engine.running

        def client(i):
            results[i] = engine.submit(prompt(30 + 20 * i, i), max_tokens=12, temperature=1.0, seed=i).result(timeout=60)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with pytest.raises(RuntimeError, match="background thread"):
            engine.step()
    assert not engine.running
    with pytest.raises(EngineClosed):
        engine.submit(prompt(5))
    for i in range(6):
        assert results[i].token_ids == alone(bi_model, prompt(30 + 20 * i, i), max_tokens=12,
                                             temperature=1.0, seed=i).token_ids


def test_asyncio_iteration(bi_model):
    async def main(engine):
        hs = [engine.submit(prompt(20 + i, i), max_tokens=10, seed=i, temperature=1.0) for i in range(3)]

        async def collect(h):
            return [t async for d in h.aiter() for t in d.token_ids]

        return await asyncio.gather(*(collect(h) for h in hs))

    with Engine(bi_model, max_rows=2) as engine:
        threaded = asyncio.run(main(engine))
    manual = asyncio.run(main(Engine(bi_model, max_rows=2)))  # no thread: aiter drives steps
    for i in range(3):
        ref = alone(bi_model, prompt(20 + i, i), max_tokens=10, seed=i, temperature=1.0).token_ids
        assert list(ref) == threaded[i] == manual[i]


def test_events_and_result_agree(bi_model):
    engine = Engine(bi_model, max_rows=2)
    h = engine.submit(prompt(33), max_tokens=16, temperature=1.0, seed=2, logprobs=3)
    deltas = list(h)
    out = h.result()
    assert "".join(deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == list(out.token_ids)
    assert len(out.logprobs) == len(out.token_ids) == 16
    assert all(len(lp.top) == 3 for lp in out.logprobs)
    last = deltas[-1]
    assert last.finish_reason == "length" and last.usage.completion_tokens == 16
    assert last.usage.prompt_tokens == 33 and last.usage.cached_tokens == 0
    assert h.timings["submitted"] <= h.timings["admitted"] <= h.timings["first_token"] <= h.timings["finished"]
    kinds = {e["kind"] for e in engine.trace_events}
    assert {"admit", "prefill", "sample", "insert", "decode", "retire", "step"} <= kinds
    pre = next(e for e in engine.trace_events if e["kind"] == "prefill")
    assert pre["tokens"] == 33 and pre["padded"] == 64 and pre["seconds"] >= 0


def test_eos_and_stop_strings_per_row(bi_model):
    """Different stop conditions share the batch: an EOS-biased row stops at once with
    finish 'stop', a stop-string row stops without leaking the string, others run on."""
    engine = Engine(bi_model, max_rows=4)
    eos = bi_model.eos_ids[0]
    ref = alone(bi_model, prompt(20, 7), max_tokens=30, temperature=1.0, seed=11)
    stop_at = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 2]
    h_eos = engine.submit(prompt(20, 1), max_tokens=30, logit_bias={eos: 1e4})
    h_stop = engine.submit(prompt(20, 7), max_tokens=30, temperature=1.0, seed=11, stop=[stop_at])
    h_len = engine.submit(prompt(20, 3), max_tokens=30)
    run_all(engine)
    assert h_eos.result().finish_reason == "stop" and h_eos.result().token_ids == ()
    s = h_stop.result()
    assert s.finish_reason == "stop" and stop_at not in s.text and ref.text.startswith(s.text)
    assert h_len.result().finish_reason == "length"


# ------------------------------------------------------------------------ memory soak


@pytest.mark.slow
def test_soak_memory_is_flat(bi_model):
    """300 short requests in waves: after warm-up, active and peak memory stay flat (the
    prefix cache's entries aside: at most its 2 MiB budget) and the engine keeps no reference
    to finished requests."""
    budget = 2 << 20
    engine = Engine(bi_model, max_rows=8, prefill_chunk=64, prefix_cache_bytes=budget)
    kinds = [dict(), dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2)]

    def wave(w):
        hs = [engine.submit(prompt(1 + (w * 37 + i * 11) % 120, w + i), max_tokens=1 + (i * 5) % 12,
                            **kinds[i % 3]) for i in range(30)]
        run_all(engine)
        refs = [weakref.ref(h) for h in hs]
        assert all(h.result().finish_reason in ("length", "stop") for h in hs)
        return refs

    for w in range(3):  # warm-up
        wave(w)
    gc.collect()
    mx.clear_cache()
    base_active = mx.get_active_memory()
    mx.reset_peak_memory()
    peaks = []
    for w in range(3, 10):
        refs = wave(w)
        gc.collect()
        assert all(r() is None for r in refs)  # nothing retained per finished request
        peaks.append(mx.get_peak_memory())
    assert mx.get_active_memory() <= base_active + budget + (1 << 20)
    assert peaks[-1] <= peaks[0] + budget + (1 << 20)
    st = engine.stats()
    assert st["rows"] == 0 and st["cache_bytes"] == 0
    assert 0 < st["prefix_cache"]["bytes"] <= budget


# ------------------------------------------------------------------------ default model


def test_default_model_batched_greedy_matches_generate(default_model):
    q1 = [{"role": "user", "content": "What is the capital of France?"}]
    q2 = "def fibonacci(n):"
    engine = Engine(default_model, max_rows=4, prefill_chunk=16)
    h1 = engine.submit(q1, max_tokens=16)
    engine.step()
    h2 = engine.submit(q2, max_tokens=16)
    run_all(engine)
    r1, r2 = h1.result(), h2.result()
    assert "Paris" in r1.text
    g1 = reference_generate(default_model, q1, max_tokens=16)
    g2 = reference_generate(default_model, q2, max_tokens=16)
    assert r1.text == g1.text and r2.text == g2.text  # prompts with clear margins


def test_a_finished_engine_is_freed_without_the_garbage_collector(tiny_model):
    """No reference cycle through the engine: dropping the last reference frees it (and its
    KV caches) at once. A cycle left each stream()'s engine alive until a collection, and
    the next request then paid for fresh memory (measured: prefill@512 20-30% slower)."""
    import gc
    import weakref

    gc.disable()
    try:
        engine = Engine(tiny_model, max_rows=2, prefill_chunk=16)
        ref = weakref.ref(engine)
        h = engine.submit("Hello there", max_tokens=4, prompt_lookup=True)
        h.result()
        del engine, h
        assert ref() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------------ hostile logits processors


def _processor_after(n_ok: int, fault):
    """A logits processor that passes its first n_ok calls through, then `fault(logits)`."""
    calls = []

    def proc(tokens, logits):
        calls.append(1)
        return logits if len(calls) <= n_ok else fault(logits)
    return proc


def _raise(exc):
    def fault(logits):
        raise exc("raised by the user's processor")
    return fault


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("n_ok", [0, 3])  # at the first token (prefill) / a later decode step
def test_a_processor_raising_a_base_exception_fails_only_its_request(bi_model, exc, n_ok):
    """On the engine's thread a KeyboardInterrupt/SystemExit can only come from the
    processor (signals reach the main thread): its request fails with a
    LogitsProcessorError; the neighbours finish as if alone and the engine serves on."""
    from fx_engine.engine.engine import LogitsProcessorError

    with Engine(bi_model, max_rows=4, prefill_chunk=32) as engine:
        a = engine.submit(prompt(40, 1), max_tokens=20)
        v = engine.submit(prompt(30, 2), max_tokens=20,
                          logits_processors=[_processor_after(n_ok, _raise(exc))])
        b = engine.submit(prompt(15, 3), max_tokens=20, temperature=0.5, seed=4)
        with pytest.raises(LogitsProcessorError, match=exc.__name__):
            v.result(timeout=60)
        assert a.result(timeout=60).token_ids == alone(bi_model, prompt(40, 1), max_tokens=20).token_ids
        assert b.result(timeout=60).token_ids == alone(bi_model, prompt(15, 3), max_tokens=20,
                                                       temperature=0.5, seed=4).token_ids
        assert engine.submit(prompt(9, 4), max_tokens=3).result(timeout=60).finish_reason == "length"


def test_a_keyboard_interrupt_on_the_main_thread_still_stops_the_program(bi_model):
    """Stepped on the main thread (no start()), a KeyboardInterrupt may be a real Ctrl-C:
    it propagates out of the step instead of becoming one request's error."""
    engine = Engine(bi_model, max_rows=2, prefill_chunk=32)
    engine.submit(prompt(20, 5), max_tokens=5, logits_processors=[_processor_after(1, _raise(KeyboardInterrupt))])
    with pytest.raises(KeyboardInterrupt):
        run_all(engine)


def _nan_everywhere(logits):
    return mx.full(logits.shape, float("nan"))


def _nan_once(logits):
    return mx.where(mx.arange(logits.shape[-1]) == 5, mx.array(float("nan")), logits)


@pytest.mark.parametrize("fault", [_nan_everywhere, _nan_once])
@pytest.mark.parametrize("n_ok", [0, 3])
def test_a_processor_returning_nan_fails_its_request(bi_model, fault, n_ok):
    """NaN logits would sample EOS until max_tokens, silently: the request fails with an
    error naming the logits processors; its neighbour is untouched."""
    from fx_engine.engine.engine import LogitsProcessorError

    engine = Engine(bi_model, max_rows=4, prefill_chunk=32)
    a = engine.submit(prompt(40, 1), max_tokens=20)
    v = engine.submit(prompt(30, 2), max_tokens=20, logits_processors=[_processor_after(n_ok, fault)])
    run_all(engine)
    with pytest.raises(LogitsProcessorError, match="logits_processors returned NaN"):
        v.result()
    assert a.result().token_ids == alone(bi_model, prompt(40, 1), max_tokens=20).token_ids
