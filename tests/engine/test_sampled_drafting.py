"""Sampled drafting of the drafters fed the target's captured states (EAGLE-3 heads, MTP
modules; issue 45; engine/captured_drafter.py, core/drafters/sampled.py): a row sampling at
temperature > 0 draws each draft from its head's distribution processed with the row's
sampling settings and reports it as q (over the target's vocabulary: an EAGLE-3 head's
draft vocabulary mapped through d2t, zero elsewhere); greedy rows draft the argmax as before.

Checked: greedy drafts unchanged (against the core's greedy chains, and beside sampled rows
in one batched call); q's shape, normalisation, support and values; sampled rows batched
equal to each alone step after step, seeded rows reproducible; the output distribution
exact (chi-square of the first two emitted tokens against the target's own distribution);
acceptance near 100% where the head's distribution is the target's (vs greedy drafts'); and
the engine running greedy and sampled rows of one drafter together."""

from __future__ import annotations

import math

import attrs
import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.cache import dense_layout, init_cache, with_lengths
from fx_engine.core.drafters import eagle3, mtp
from fx_engine.core.drafters.sampled import draw_compiled
from fx_engine.core.models import Capture
from fx_engine.core.sampling import SamplingConfig, init_keys, make_sampling_params, sampling_distribution
from fx_engine.core.speculative import verify_step
from fx_engine.core.state import init_state
from fx_engine.core.steps import decode_step, prefill_step
from fx_engine.engine.captured_drafter import CapturedDrafter
from fx_engine.engine.eagle3_drafter import Eagle3Drafter
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.kv_rows import stack_rows
from fx_engine.engine.mtp_drafter import MtpDrafter
from fx_engine.testing.eagle3 import write_echo_pair, write_tiny_eagle3
from fx_engine.testing.mtp import write_mtp_target

HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
            draft_vocab_size=128, intermediate_size=96)


class Oracle(CapturedDrafter):
    """A drafter whose head is the target's own distribution (times `scale`), for the echo
    pair's target (its layers add nothing: the next token's logits depend on the current
    token only, a [V, V] table computed once). `greedy`: its rows draft greedily whatever
    the request samples with (the drafting before sampled drafts, to compare with)."""

    def __init__(self, model, scale: float = 1.0, greedy: bool = False):
        v = model.config.vocab_size
        self.table, _ = prefill_step(model.params, model.new_cache(v, 16), mx.arange(v)[:, None],
                                     mx.ones((v,), mx.int32))
        self.table = self.table * scale
        mx.eval(self.table)
        self.capture = Capture((1,))
        self.greedy = greedy

    def new_row(self, prompt, sampling):
        return super().new_row(prompt, None if self.greedy else sampling)

    def step(self, hidden, ids, cache, n_valid, span):
        last = mx.take_along_axis(ids, mx.maximum(n_valid - 1, 0)[:, None], axis=1)[:, 0]
        lg = self.table[last]
        return mx.argmax(lg, axis=-1).astype(mx.int32), lg, mx.zeros((ids.shape[0], 1)), \
            with_lengths(cache, cache.lengths + n_valid)

    def new_cache(self, capacity):
        return init_cache(dense_layout(1, 1, 1), 1, capacity)


@pytest.fixture(scope="module")
def cases(tiny_folder, tmp_path_factory):
    """name -> (target, drafter): a random EAGLE-3 head over a 128-token draft vocabulary
    (d2t), a random DeepSeek-V3 MTP module, and the oracle (its q a flattened p)."""
    llama = fx_engine.load(tiny_folder("llama", num_hidden_layers=6), batch_invariant=True)
    head = write_tiny_eagle3(tmp_path_factory.mktemp("head") / "h", 64, seed=3, **HEAD)
    ds = fx_engine.load(write_mtp_target(tmp_path_factory.mktemp("ds") / "ds", "deepseek_v3", seed=3),
                        batch_invariant=True)
    t, _ = write_echo_pair(tmp_path_factory.mktemp("echo"))
    echo = fx_engine.load(t, batch_invariant=True)
    return {"eagle3": (llama, Eagle3Drafter.load(head, llama)), "mtp": (ds, MtpDrafter.from_model(ds)),
            "oracle": (echo, Oracle(echo, scale=0.6)), "oracle-exact": (echo, Oracle(echo)),
            "oracle-greedy": (echo, Oracle(echo, greedy=True))}


def _prompt(model, n, seed):
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, min(380, model.config.vocab_size), size=n)]


def _captured(model, drafter, seq):
    cap = 1 << (len(seq) + 8).bit_length()
    _, _, states = prefill_step(model.params, model.new_cache(1, cap), mx.array([seq], mx.int32),
                                mx.array([len(seq)], mx.int32), capture=drafter.capture)
    return states[0]


def _rows(drafter, full, states, cfgs):
    """Rows for the sequence `full` (the target processed all but its last token)."""
    rows = [drafter.new_row(full, c) for c in cfgs]
    for r in rows:
        r.observe(0, states[: len(full) - 1], full)
    return rows


# ------------------------------------------------------------------ greedy rows, q


@pytest.mark.parametrize("name", ["eagle3", "mtp"])
def test_greedy_rows_draft_the_argmax_chain_as_before(cases, name):
    """A greedy row (temperature 0, or no sampling settings) drafts the core's greedy chain
    (`draft_chain`) without q, alone and in one batched call beside sampled rows."""
    model, drafter = cases[name]
    full = _prompt(model, 23, seed=1)
    states = _captured(model, drafter, full)
    n, k = len(full) - 1, 4
    cache = drafter.new_cache(256)
    hid, ids = states[None, :n], mx.array([full[1:]], mx.int32)
    if name == "eagle3":
        want = eagle3.draft_chain(drafter.head, drafter.table, hid, ids, cache, mx.array([n]), k, span=256)[0]
    else:
        want = mtp.draft_chain(drafter.module, drafter.tables, hid, ids, cache, mx.array([n]), k, span=256)[0]
    want = tuple(want[0].tolist())
    for cfg in (None, SamplingConfig(), SamplingConfig(temperature=0.0, top_k=3, seed=4)):
        d = _rows(drafter, full, states, [cfg])[0].propose(full, k)
        assert d.tokens == want and d.probs is None
    sampled = SamplingConfig(temperature=0.9, seed=1)
    got = drafter.propose_rows(_rows(drafter, full, states, [None, sampled, SamplingConfig(), sampled]),
                               [full] * 4, [k, k, 2, 3])
    assert [d.tokens for d in got[::2]] == [want, want[:2]]
    assert got[0].probs is None and got[2].probs is None
    assert got[1].probs is not None and got[3].probs.shape[0] == 3


def test_eagle3_q_is_the_processed_head_distribution_over_the_target_vocabulary(cases):
    """q [k, V]: float32, each row sums to 1, zero outside the draft vocabulary (d2t's
    targets) and outside the row's top-k; each draft lies in its q's support; q of the
    first draft is the head's logits through the row's sampling settings, mapped by d2t."""
    model, drafter = cases["eagle3"]
    full = _prompt(model, 30, seed=2)
    states = _captured(model, drafter, full)
    cfg = SamplingConfig(temperature=0.7, top_k=20, top_p=0.95, seed=11)
    d = _rows(drafter, full, states, [cfg])[0].propose(full, 4)
    q = np.array(d.probs)
    assert q.dtype == np.float32 and q.shape == (4, 384)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    ids = np.array(eagle3.draft_target_ids(drafter.head))
    outside = np.ones(384, bool)
    outside[ids] = False
    assert outside.sum() == 384 - 128 and (q[:, outside] == 0).all()
    assert ((q > 0).sum(-1) <= 20).all()
    assert all(q[j, t] > 0 for j, t in enumerate(d.tokens)) and set(d.tokens) <= set(ids.tolist())
    # the first draft's q, computed apart: the head's logits after the pairs, processed
    twin = _rows(drafter, full, states, [None])[0]
    _, lg, _ = twin._feed(full, len(full) - 1)
    params = make_sampling_params([SamplingConfig(temperature=0.7, top_k=20, top_p=0.95)], 128)
    small = np.array(sampling_distribution(lg, params, init_keys([cfg]))[0])
    want = np.zeros(384, np.float32)
    want[ids] = small
    np.testing.assert_allclose(q[0], want, rtol=1e-5, atol=1e-7)


def test_mtp_q_covers_the_target_vocabulary(cases):
    model, drafter = cases["mtp"]
    full = _prompt(model, 17, seed=3)
    cfg = SamplingConfig(temperature=1.3, min_p=0.01, seed=2)
    d = _rows(drafter, full, _captured(model, drafter, full), [cfg])[0].propose(full, 3)
    q = np.array(d.probs)
    assert q.shape == (3, model.config.vocab_size)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert all(q[j, t] > 0 for j, t in enumerate(d.tokens))


# ------------------------------------------------------------------ batched = alone, seeds


@pytest.mark.parametrize("name", ["eagle3", "mtp"])
def test_sampled_rows_batched_equal_each_alone_step_after_step(cases, name):
    """Greedy and sampled rows (different settings, seeds, k) drafting together equal twins
    drafting alone, through several steps where the target keeps a random number of each
    row's positions (rollbacks): the same drafts, the same q, the same key streams. Two
    rows of one seed draft alike; another seed drafts otherwise."""
    model, drafter = cases[name]
    rng = np.random.default_rng(5)
    cfgs = [None, SamplingConfig(temperature=0.8, seed=1), SamplingConfig(temperature=1.5, top_p=0.9, seed=2),
            SamplingConfig(temperature=0.8, seed=1), SamplingConfig(temperature=1.1, top_k=7, seed=3)]
    seqs = [_prompt(model, n, seed=10 + i) + _prompt(model, 40, seed=20 + i) for i, n in enumerate((6, 19, 11, 19, 40))]
    seqs[3] = list(seqs[1])  # (row 3: row 1's twin, seed included)
    states = [_captured(model, drafter, s) for s in seqs]
    pos = [len(s) - 40 for s in seqs]
    together = [_rows(drafter, s[: p + 1], st, [c])[0] for s, st, p, c in zip(seqs, states, pos, cfgs)]
    alone = [_rows(drafter, s[: p + 1], st, [c])[0] for s, st, p, c in zip(seqs, states, pos, cfgs)]
    for step in range(5):
        ks = [int(rng.integers(1, 6)) for _ in seqs]
        ks[3] = ks[1]
        toks = [s[: p + 1] for s, p in zip(seqs, pos)]
        got = drafter.propose_rows(together, toks, ks)
        want = [r.propose(t, k) for r, t, k in zip(alone, toks, ks)]
        assert [d.tokens for d in got] == [d.tokens for d in want], step
        for g, w in zip(got, want):
            assert (g.probs is None) == (w.probs is None)
            if g.probs is not None:
                np.testing.assert_allclose(np.array(g.probs), np.array(w.probs), rtol=1e-6, atol=1e-7)
        assert got[1].tokens == got[3].tokens
        keeps = [1 + int(rng.integers(0, k + 1)) for k in ks]
        keeps[3] = keeps[1]
        for i, (s, st, keep) in enumerate(zip(seqs, states, keeps)):
            for row in (together[i], alone[i]):
                row.observe(pos[i], st[pos[i] : pos[i] + keep], s[: pos[i] + keep + 1])
            pos[i] += keep
    for r, a in zip(together, alone):
        if r.keys is not None:
            assert np.array_equal(np.array(r.keys), np.array(a.keys))
    # another seed, same sequence: other draws
    full = seqs[1][: pos[1] + 1]
    runs = {seed: _rows(drafter, full, states[1], [SamplingConfig(temperature=1.5, seed=seed)])[0].propose(full, 5)
            for seed in range(4)}
    assert len({d.tokens for d in runs.values()}) > 1


# ------------------------------------------------------------------ the output distribution


def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x), the regularized upper incomplete gamma Q(df / 2, x / 2) (Numerical
    Recipes' gammq: the series of P below a + 1, the continued fraction of Q above)."""
    a, z = df / 2, x / 2
    if z <= 0:
        return 1.0
    front = math.exp(-z + a * math.log(z) - math.lgamma(a))
    if z < a + 1:
        term = total = 1 / a
        for n in range(1, 100000):
            term *= z / (a + n)
            total += term
            if term < total * 1e-16:
                break
        return max(0.0, 1.0 - total * front)
    tiny = 1e-300
    b, c = z + 1 - a, 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 100000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > tiny else tiny)
        c = b + an / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        if abs(d * c - 1) < 1e-16:
            break
    return front * h


def _pvalue(tokens: np.ndarray, p: np.ndarray) -> float:
    """Chi-square of token counts against p: tokens expected >= 5 times are bins, the rest
    one bin (when it is expected >= 5 times)."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(p))
    exp = n * p
    big = exp >= 5
    c, e = list(counts[big]), list(exp[big])
    if exp[~big].sum() >= 5:
        c.append(counts[~big].sum())
        e.append(exp[~big].sum())
    stat = sum((ci - ei) ** 2 / ei for ci, ei in zip(c, e))
    return _chi2_sf(stat, len(e) - 1)


def _emitted(model, drafter, prompt, cfgs, k, uniform=False):
    """The first two tokens each row emits after `prompt` + its pinned next token: one
    verify of the rows' k sampled drafts (q as drafted, or, `uniform`, a wrong q: told the
    drafts were drawn uniformly), then a decode for rows whose verify emitted one token."""
    n, v = len(cfgs), model.config.vocab_size
    lg, one = prefill_step(model.params, model.new_cache(1, 64), mx.array([prompt]), mx.array([len(prompt)]))
    last = int(mx.argmax(lg[0]).item())
    full = prompt + [last]
    states = _captured(model, drafter, prompt)
    toks, qs = [], []
    for lo in range(0, n, 512):
        chunk = cfgs[lo : lo + 512]
        got = drafter.propose_rows(_rows(drafter, full, states, chunk), [full] * len(chunk), [k] * len(chunk))
        assert all(len(d.tokens) == k for d in got)
        toks += [d.tokens for d in got]
        qs += [d.probs[:, :v] for d in got]
    drafts = mx.array(toks, mx.int32)
    q = mx.full((n, k, v), 1 / v) if uniform else mx.stack(qs)
    state = attrs.evolve(init_state(cfgs, [full] * n, v), tokens=mx.full((n,), last, mx.int32))
    cache = stack_rows([one] * n)  # (every row's prompt cache: the one row's)
    state, cache, res = verify_step(model.params, cache, state, drafts, mx.full((n,), k, mx.int32), q)
    after, _ = decode_step(model.params, cache, state)
    second = mx.where(res.count >= 2, res.tokens[:, 1], after.tokens)
    return full, np.array(res.tokens[:, 0]), np.array(second)


def _exact(model, full, cfg):
    """The target's distributions of the first two tokens after `full` (exact: the second
    is the first's mixture of each continuation's)."""
    v = model.config.vocab_size
    plain = attrs.evolve(cfg, seed=0)
    first = np.array(sampling_distribution(fx_engine.logits(model, full)[-1:], make_sampling_params([plain], v),
                                           init_keys([plain])))[0].astype(np.float64)
    lg, _ = prefill_step(model.params, model.new_cache(v, 64), mx.array([full + [t] for t in range(v)]),
                         mx.full((v,), len(full) + 1, mx.int32))
    nxt = np.array(sampling_distribution(lg, make_sampling_params([plain] * v, v), init_keys([plain] * v)))
    second = first @ nxt.astype(np.float64)
    return first / first.sum(), second / second.sum()


@pytest.mark.slow
@pytest.mark.parametrize("name,temp,top_k", [("eagle3", 3.0, 0), ("mtp", 1.0, 0), ("oracle", 8.0, 12)])
def test_sampled_drafting_keeps_the_target_distribution(cases, name, temp, top_k):
    """Chi-square of the first and second token each of 2000 rows emits (seeded) against
    the target's exact distributions: the drafts sampled from the head's processed
    distribution and verified with that q leave the output distributed as the target's.
    Telling verify a q the drafts were not drawn from (uniform) is detected. (The oracle's q
    is a flattened p: drafts often accepted.)"""
    model, drafter = cases[name]
    n = 2000
    cfgs = [SamplingConfig(temperature=temp, top_k=top_k, seed=i) for i in range(n)]
    full, first, second = _emitted(model, drafter, _prompt(model, 20, seed=7), cfgs, 2)
    p1, p2 = _exact(model, full, cfgs[0])
    assert _pvalue(first, p1) > 1e-3 and _pvalue(second, p2) > 1e-3
    _, wrong, _ = _emitted(model, drafter, _prompt(model, 20, seed=7), cfgs, 2, uniform=True)
    assert _pvalue(wrong, p1) < 1e-6


# ------------------------------------------------------------------ acceptance


def _acceptance(model, drafter, cfgs, k=4):
    prompt = _prompt(model, 12, seed=9)
    lg, one = prefill_step(model.params, model.new_cache(1, 64), mx.array([prompt]), mx.array([len(prompt)]))
    full = prompt + [int(mx.argmax(lg[0]).item())]
    n, v = len(cfgs), model.config.vocab_size
    got = drafter.propose_rows(_rows(drafter, full, _captured(model, drafter, prompt), cfgs), [full] * n, [k] * n)
    drafts = mx.array([d.tokens for d in got], mx.int32)
    q = None if got[0].probs is None else mx.stack([d.probs for d in got])
    state = attrs.evolve(init_state(cfgs, [full] * n, v), tokens=mx.full((n,), full[-1], mx.int32))
    _, _, res = verify_step(model.params, stack_rows([one] * n), state, drafts, mx.full((n,), k, mx.int32), q)
    return float(res.accepted.sum().item()) / (n * k)


def test_drafts_from_the_target_distribution_are_all_accepted(cases):
    """A head whose distribution is the target's: sampled drafts are accepted ~always (q =
    p: min(1, p / q) = 1), its greedy drafts at the same temperature only as often as the
    target samples the argmax."""
    model, exact = cases["oracle-exact"]
    cfgs = [SamplingConfig(temperature=5.0, top_k=50, seed=i) for i in range(64)]
    sampled = _acceptance(model, exact, cfgs)
    greedy = _acceptance(model, cases["oracle-greedy"][1], cfgs)
    assert sampled > 0.97 and greedy < 0.8 and sampled > greedy + 0.2


# ------------------------------------------------------------------ the engine


@pytest.mark.parametrize("name", ["eagle3", "mtp", "oracle-exact"])
def test_engine_runs_greedy_and_sampled_rows_of_one_drafter_together(cases, name, steady_policy):
    """Greedy and sampled requests on one drafter in one engine (its rows drafting in
    batched calls): greedy outputs equal their plain runs, seeded sampled outputs repeat,
    sampled rows' drafts are accepted (the oracle: nearly all); a third run compiles
    nothing new (the draws' steps included)."""
    model, drafter = cases[name]
    prompts = [_prompt(model, n, seed=30 + n) for n in (9, 21, 14, 30)]
    kws = [dict(temperature=0.0), dict(temperature=0.9, seed=4), dict(temperature=0.0),
           dict(temperature=1.2, top_p=0.9, seed=5)]
    if name.startswith("oracle"):
        kws[1]["temperature"] = kws[3]["temperature"] = 6.0

    def run():
        engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16)
        hs = [engine.submit(p, max_tokens=16, draft_model=drafter, num_draft_tokens=3, **kw)
              for p, kw in zip(prompts, kws)]
        out = [h.result() for h in hs]
        engine.close()
        return out

    first, again = run(), run()
    fns = (draw_compiled, eagle3.head_step_compiled, mtp.mtp_step_compiled)
    before = [f.traces for f in fns]
    assert [r.token_ids for r in run()] == [r.token_ids for r in first]
    assert [f.traces for f in fns] == before
    for p, kw, r, r2 in zip(prompts, kws, first, again):
        assert r.token_ids == r2.token_ids
        assert r.usage.drafted_tokens > 0
        if kw["temperature"] == 0:
            assert r.token_ids == reference_generate(model, p, max_tokens=16, temperature=0.0).token_ids
    if name == "oracle-exact":
        for r in (first[1], first[3]):
            assert r.usage.accepted_tokens >= 0.9 * r.usage.drafted_tokens
