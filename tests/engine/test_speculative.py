"""Speculative decoding: exact greedy identity, the sampled distribution, row-wise rollback,
recompiles, drafters and their errors."""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.engine.drafters import Draft, PromptLookup, lookup, self_draft_model
from fx_engine.engine.generate import reference_generate
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.state import init_state, sample_step
from fx_engine.core.steps import decode_step, prefill_step, verify_step, verify_step_compiled

from tests.conftest import LONG_TEXT


@pytest.fixture(scope="module")
def bi(tiny_folder):
    """Tiny llama in batch-invariant mode: verify (K+1 positions) and decode (1) give
    bitwise-identical logits, so greedy identity is exact, not just likely."""
    return fx_engine.load(tiny_folder(), batch_invariant=True)


@pytest.fixture(scope="module")
def draft(tiny_folder):
    """Another tiny model with the same tokenizer (a different seed): a real second model
    whose drafts are sometimes right and often wrong."""
    return fx_engine.load(tiny_folder(seed=5), batch_invariant=True)


def _prompt(model, n, offset=0):
    ids = model.tokenizer.encode(LONG_TEXT * 3)
    return ids[offset : offset + n]


def test_lookup_finds_the_latest_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    assert lookup(seq, 2, 1, 3) == [7, 8]  # the latest earlier "1 2 3" is followed by 7 8
    assert lookup([4, 5, 6], 3) == []
    assert lookup([5, 1, 5], 4, 1, 1) == [1, 5]


@pytest.mark.parametrize("kind", ["lookup", "draft", "self"])
def test_greedy_speculation_is_identical_to_plain_greedy(bi, draft, kind):
    spec = {"lookup": {"prompt_lookup": True}, "draft": {"draft_model": draft},
            "self": {"draft_model": self_draft_model(bi, 1)}}[kind]
    for n, k in ((40, 4), (130, 2), (9, 8)):
        prompt = _prompt(bi, n, offset=n)
        ref = reference_generate(bi, prompt, max_tokens=40, temperature=0.0)
        got = fx_engine.generate(bi, prompt, max_tokens=40, temperature=0.0,
                                 num_draft_tokens=k, **spec)
        assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason
        assert got.usage.drafted_tokens > 0
    if kind == "lookup":  # LONG_TEXT repeats: the n-gram drafts are mostly right
        assert got.usage.accepted_tokens > got.usage.drafted_tokens / 2


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_batched_speculation_with_late_joins_matches_plain(bi, draft, data):
    """Rows with and without speculation, different drafters and K, joining at random
    steps, share verify steps: every request's tokens equal its plain greedy run alone."""
    budget = data.draw(st.sampled_from([None, 1536]), label="kv budget")  # forces compaction
    engine = fx_engine.Engine(bi, max_rows=4, prefill_chunk=32, kv_budget_tokens=budget)
    reqs = []
    for i in range(data.draw(st.integers(2, 4), label="requests")):
        n = data.draw(st.integers(1, 150), label="prompt")
        spec = data.draw(st.sampled_from(["none", "lookup", "draft"]), label="drafter")
        kw = {"none": {}, "lookup": {"prompt_lookup": PromptLookup(1, 4)},
              "draft": {"draft_model": draft}}[spec]
        if spec != "none":
            kw["num_draft_tokens"] = data.draw(st.integers(1, 8), label="k")
        prompt = _prompt(bi, n, offset=data.draw(st.integers(0, 100)))
        mt = data.draw(st.integers(1, 30), label="max_tokens")
        reqs.append((engine.submit(prompt, max_tokens=mt, temperature=0.0, **kw), prompt, mt))
        for _ in range(data.draw(st.integers(0, 3), label="steps before the next")):
            engine.step()
    for h, prompt, mt in reqs:
        ref = reference_generate(bi, prompt, max_tokens=mt, temperature=0.0)
        assert h.result().token_ids == ref.token_ids


def test_rowwise_rollback_matches_never_written_drafts(bi):
    """Three rows accept 4, 1 and 0 of their drafts in one verify step; decoding on gives
    each row the tokens of plain decoding, as if the rejected drafts were never written."""
    p, vocab = bi.params, bi.config.vocab_size
    prompts = [_prompt(bi, n, offset=n) for n in (12, 30, 21)]

    def start(rows):
        cache = bi.new_cache(len(rows), 256)
        longest = max(len(r) for r in rows)
        toks = mx.array([r + [0] * (longest - len(r)) for r in rows])
        logits, cache = prefill_step(p, cache, toks, mx.array([len(r) for r in rows]))
        state = sample_step(init_state([SamplingConfig()] * len(rows), rows, vocab), logits)
        return state, cache

    state, cache = start(prompts)
    plain = [[int(t)] for t in state.tokens.tolist()]
    s2, c2 = state, cache
    for _ in range(12):
        s2, c2 = decode_step(p, c2, s2)
        for r, t in enumerate(s2.tokens.tolist()):
            plain[r].append(t)
    drafts = [plain[0][1:5], [plain[1][1], 7, 7, 7], [(plain[2][1] + 1) % vocab, 3, 3, 3]]
    state, cache, res = verify_step(p, cache, state, mx.array(drafts), mx.array([4, 4, 4]))
    assert res.accepted.tolist() == [4, 1, 0]
    got = [plain[r][:1] + res.tokens[r, : int(res.count[r])].tolist() for r in range(3)]
    for _ in range(6):
        state, cache = decode_step(p, cache, state)
        for r, t in enumerate(state.tokens.tolist()):
            got[r].append(t)
    for r in range(3):
        assert got[r] == plain[r][: len(got[r])]


def test_verify_never_writes_past_the_capacity(bi):
    p = bi.params
    prompt = _prompt(bi, 29)
    cache = bi.new_cache(1, 32)
    logits, cache = prefill_step(p, cache, mx.array([prompt]), mx.array([29]))
    state = sample_step(init_state([SamplingConfig()], [prompt], bi.config.vocab_size), logits)
    state, cache, res = verify_step(p, cache, state, mx.array([[5, 6, 7, 8]]), mx.array([4]))
    # room for the last token and 2 drafts only: at most 2 verified, lengths within capacity
    assert int(cache.lengths[0]) <= 32 and int(res.accepted[0]) <= 2


# ------------------------------------------------------------------ sampled distribution


def _chi2_sf_even(x: float, df: int) -> float:
    """P(chi2_df > x) for even df (closed form)."""
    m = df // 2
    return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(m))


@pytest.mark.slow
def test_sampled_speculation_has_the_target_distribution(bi):
    """Chi-square over the 9 tokens top_k keeps (df 8): the first token a verify step emits
    (the accepted draft or the residual draw) is distributed as the target's p (6000 rows,
    fixed seeds); telling verify a wrong q (the drafts were drawn from another
    distribution) is detected at p < 1e-6."""
    model, vocab, n = bi, bi.config.vocab_size, 6000
    p_params = model.params
    prompt = _prompt(model, 20)
    # Pin the context: every row has the same last token, so the same target p.
    cache = model.new_cache(1, 64)
    logits, cache = prefill_step(p_params, cache, mx.array([prompt]), mx.array([20]))
    last = int(mx.argmax(logits[0]).item())
    full = prompt + [last]
    lg = fx_engine.logits(model, full)[-1]
    top = mx.argsort(-lg)[:9]
    temp = 4.0  # flattens the tiny model's peaked distribution: every bin well populated
    target = mx.zeros((vocab,)).at[top].add(mx.softmax(lg[top] / temp))  # top_k 9
    # The drafter: skewed over the top 9 plus mass on two tokens outside p's support.
    outside = [int(t) for t in mx.argsort(lg)[:2].tolist()]
    qv = mx.zeros((vocab,)).at[top].add(mx.softmax(-lg[top] * 0.5)) * 0.8
    qv = qv.at[mx.array(outside)].add(0.1)

    def emitted(claimed):
        cfgs = [SamplingConfig(temperature=temp, top_k=9, seed=i) for i in range(n)]
        state = init_state(cfgs, [full] * n, vocab)
        state = attrs.evolve(state, tokens=mx.full((n,), last, mx.int32))
        c = model.new_cache(n, 64)
        _, c = prefill_step(p_params, c, mx.array([prompt] * n), mx.array([20] * n))
        drafts = mx.random.categorical(mx.log(qv)[None], num_samples=n, key=mx.random.key(7)).reshape(n, 1)
        q = mx.broadcast_to(claimed[None, None], (n, 1, vocab))
        _, _, res = verify_step(p_params, c, state, drafts.astype(mx.int32), mx.ones((n,), mx.int32), q)
        return res.tokens[:, 0]

    def pvalue(tokens):
        counts = [int((tokens == t).sum().item()) for t in top.tolist()]
        assert sum(counts) == n  # never a token outside the target's support
        exp = [n * float(target[t].item()) for t in top.tolist()]
        stat = sum((c - e) ** 2 / e for c, e in zip(counts, exp))
        return _chi2_sf_even(stat, 8)

    assert pvalue(emitted(qv)) > 1e-3
    uniform = mx.zeros((vocab,)).at[top].add(1 / 9)  # the wrong q: not what drafted
    assert pvalue(emitted(uniform)) < 1e-6


# ------------------------------------------------------------------ engine integration


def test_no_recompiles_in_steady_state_with_varying_k(bi):
    def workload():
        engine = fx_engine.Engine(bi, max_rows=4, prefill_chunk=32)
        hs = [engine.submit(_prompt(bi, n, offset=n), max_tokens=24, temperature=0.0,
                            prompt_lookup=True, num_draft_tokens=k)
              for n, k in ((30, 2), (60, 8), (90, 4), (45, 16))]
        for h in hs:
            h.result()

    workload()
    before = len(verify_step_compiled.trace_log)
    workload()
    assert len(verify_step_compiled.trace_log) == before


def test_sampled_rows_with_speculation_run_in_the_engine(bi, draft):
    prompt = _prompt(bi, 50)
    for kw in ({"prompt_lookup": True}, {"draft_model": draft}):
        out = fx_engine.generate(bi, prompt, max_tokens=30, temperature=0.8, top_p=0.9, seed=3, **kw)
        assert len(out.token_ids) == 30 or out.finish_reason == "stop"
        assert out.usage.drafted_tokens >= out.usage.accepted_tokens
        again = fx_engine.generate(bi, prompt, max_tokens=30, temperature=0.8, top_p=0.9, seed=3, **kw)
        assert again.token_ids == out.token_ids  # seeded: reproducible


def test_logprobs_reported_are_the_targets(bi):
    prompt = _prompt(bi, 60)
    ref = reference_generate(bi, prompt, max_tokens=20, temperature=0.0, logprobs=3)
    got = fx_engine.generate(bi, prompt, max_tokens=20, temperature=0.0, logprobs=3, prompt_lookup=True)
    assert got.token_ids == ref.token_ids and got.usage.accepted_tokens > 0
    for a, b in zip(got.logprobs, ref.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _, _ in a.top] == [t for t, _, _ in b.top]


@pytest.mark.parametrize("kw,match", [
    ({"prompt_lookup": True, "draft_model": "x"}, "not both"),
    ({"num_draft_tokens": 4}, "needs draft_model"),
    ({"prompt_lookup": True, "num_draft_tokens": 0}, "num_draft_tokens"),
    ({"prompt_lookup": True, "num_draft_tokens": 99}, "num_draft_tokens"),
    ({"prompt_lookup": "yes"}, "prompt_lookup"),
    ({"draft_model": 3}, "draft_model"),
    ({"prompt_lookup": True, "logits_processors": [lambda t, x: x]}, "logits_processors"),
])
def test_bad_speculation_arguments_are_clear_errors(bi, kw, match):
    with pytest.raises(ValueError, match=match):
        fx_engine.generate(bi, "hello", max_tokens=4, **kw)


def test_a_failing_drafter_fails_only_its_request(bi):
    class Broken:
        def new_row(self, prompt, sampling):
            return self

        def propose(self, tokens, k):
            if len(tokens) > 25:
                raise RuntimeError("drafter broke")
            return Draft((1,) * (k + 5))  # too many tokens: also an error

    class Good:
        def new_row(self, prompt, sampling):
            return PromptLookup()

    engine = fx_engine.Engine(bi, max_rows=3, prefill_chunk=32)
    bad = engine.submit(_prompt(bi, 20), max_tokens=10, draft_model=Broken())
    ok = engine.submit(_prompt(bi, 40), max_tokens=10, draft_model=Good())
    plain = engine.submit(_prompt(bi, 30), max_tokens=10)
    with pytest.raises(ValueError, match="drafter proposed"):
        bad.result()
    assert ok.result().token_ids == reference_generate(bi, _prompt(bi, 40), max_tokens=10).token_ids
    assert plain.result().token_ids == reference_generate(bi, _prompt(bi, 30), max_tokens=10).token_ids


def test_speculation_with_ring_caches(tiny_folder):
    """Gemma 4 (sliding-window rings, KV-shared layers): greedy speculation through the
    engine equals plain greedy; a verify longer than the ring headroom is refused before
    any write."""
    from fx_engine.core.cache import CacheError

    path = tiny_folder("gemma4_text", sliding_window=16)
    g = fx_engine.load(path, batch_invariant=True)
    prompt = [int(t) for t in mx.random.randint(3, 50, (60,), key=mx.random.key(2)).tolist()]
    prompt = prompt[:30] * 2  # repeated: the lookup drafts something
    ref = reference_generate(g, prompt, max_tokens=30, temperature=0.0, prefill_chunk=16)
    got = fx_engine.generate(g, prompt, max_tokens=30, temperature=0.0, prompt_lookup=True,
                             num_draft_tokens=8, prefill_chunk=16)
    assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0
    cache = g.new_cache(1, 64, headroom=4)
    state = init_state([SamplingConfig()], [prompt[:5]], g.config.vocab_size)
    with pytest.raises(CacheError, match="headroom"):
        verify_step(g.params, cache, state, mx.zeros((1, 8), mx.int32), mx.array([8]))


def test_draft_model_with_another_vocabulary_size(bi, tiny_folder):
    """A draft model whose vocabulary is padded past the target's (as Qwen 0.5B vs 7B):
    its q is trimmed/padded to the target's vocabulary; greedy output is unchanged and a
    sampled request runs."""
    big = fx_engine.load(tiny_folder(vocab_size=400, seed=5), batch_invariant=True)
    prompt = _prompt(bi, 50)
    ref = reference_generate(bi, prompt, max_tokens=20, temperature=0.0)
    got = fx_engine.generate(bi, prompt, max_tokens=20, temperature=0.0, draft_model=big)
    assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0
    out = fx_engine.generate(bi, prompt, max_tokens=20, temperature=0.7, seed=1, draft_model=big)
    assert len(out.token_ids) > 0


def test_verify_steps_run_on_packed_rows(bi, steady_policy):
    """Rows drafting different numbers of tokens (per-row K) share verify steps on packed
    rows (traced; no work on the shorter drafts' padding) and each request's tokens are
    its plain greedy run's. (The target drafts for itself: every draft is accepted, so the
    per-row draft lengths grow to each request's K.)"""
    engine = fx_engine.Engine(bi, max_rows=4, prefill_chunk=64)
    reqs = [(_prompt(bi, n, offset=n), k) for n, k in ((40, 8), (60, 1), (35, 2), (50, 1))]
    hs = [engine.submit(p, max_tokens=30, temperature=0.0, draft_model=bi, num_draft_tokens=k) for p, k in reqs]
    while engine.step():
        pass
    verifies = [e for e in engine.trace_events if e["kind"] == "verify"]
    assert any(e["packed"] is not None and e["packed"] < e["rows"] * (e["k"] + 1) for e in verifies)
    for h, (p, _) in zip(hs, reqs):
        assert h.result().token_ids == reference_generate(bi, p, max_tokens=30, temperature=0.0).token_ids
