"""Your own loop over the pure steps (issue 42, items 1 and 2): the public kit
(fx_engine.prefill, logits_step, jit, verify_step + draft_sync, the exports) and the rule
that nothing is ever silently wrong: a row past the capacity is flagged (DecodeState.full,
NaN logits), an over-long chunk raises, and a bad input names the argument at fault.

Oracles: the same model through the plain steps (score_step, a cache of exactly the
prompt's size, plain greedy decoding), and the compile counters of the compiled steps
(`fx_engine.tracing.RecompileWatch`)."""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.core.cache import CacheError, init_cache
from fx_engine.core.speculative import VerifyResult

ROOT = Path(__file__).resolve().parents[2]

NEW_NAMES = ["logits_step", "logits_step_compiled", "verify_step", "verify_step_compiled",
             "prefill_step_compiled", "decode_step_compiled", "sample_step_compiled",
             "score_step_compiled", "VerifyResult", "DecodeState", "init_state", "stop_rows",
             "KVCache", "with_lengths", "take_rows", "repeat_rows", "concat_rows", "num_rows",
             "jit", "tree_map", "tree_leaves", "draft_sync", "DraftSync", "prefill", "Prefilled",
             "self_draft_model"]


def _eval(*trees):
    mx.eval(*[fx_engine.tree_leaves(t) for t in trees])


def _greedy(model, prompts, n, room):
    """Plain greedy decoding (the oracle): the same bucketed prefill, then decode_step;
    n tokens per row."""
    _, cache, state = fx_engine.prefill(model, prompts, room=room)
    out = [[t] for t in state.tokens.tolist()]
    for _ in range(n - 1):
        state, cache = fx_engine.decode_step_compiled(model.params, cache, state)
        for r, t in enumerate(state.tokens.tolist()):
            out[r].append(t)
    return out


def _prompts(model, texts):
    return [model.tokenizer.apply_chat_template([{"role": "user", "content": t}],
                                                add_generation_prompt=True) for t in texts]


def test_the_kit_is_exported_and_documented():
    text = (ROOT / "specs" / "steps.md").read_text()
    for name in NEW_NAMES:
        assert name in fx_engine.__all__, name
        assert getattr(fx_engine, name) is not None
        assert name.removesuffix("_compiled") in text or name in ("Prefilled", "KVCache"), name
    assert fx_engine.jit is fx_engine.core.tree.jit


# ------------------------------------------------------------------ never silently wrong


@pytest.mark.slow
def test_decoding_past_the_capacity_stops_the_row_with_full(default_model):
    """The shorter prompt's row has more room; the other runs out first: it stops
    (inactive, `full`), its token and length stay; every token emitted before the stop is
    the one a cache with room to spare gives (no garbage)."""
    m, p = default_model, default_model.params
    prompts = _prompts(m, ["Name a color.", "What is the capital of France? Answer briefly."])
    longest = max(len(x) for x in prompts)
    _, cache, state = fx_engine.prefill(m, prompts, room=64 - longest)  # capacity 64
    assert cache.capacity == 64
    emitted = [[t] for t in state.tokens.tolist()]
    for _ in range(64 - min(len(x) for x in prompts) + 2):
        before = state
        state, cache = fx_engine.decode_step_compiled(p, cache, state)
        _eval(state, cache)
        for r in range(2):
            if state.active[r].item():
                emitted[r].append(state.tokens[r].item())
            else:  # stopped: nothing new, the flag says why
                assert state.full[r].item()
                assert state.tokens[r].item() == before.tokens[r].item()
    assert state.active.tolist() == [False, False] and state.full.tolist() == [True, True]
    assert cache.lengths.tolist() == [64, 64]
    ref = _greedy(m, prompts, 64, room=128)
    for r, ids in enumerate(prompts):  # the row forwarded 64 - len(ids) tokens, + the first
        assert len(emitted[r]) == 64 - len(ids) + 1
        assert emitted[r] == ref[r][: len(emitted[r])]
    # a verify step on a full row stops it the same way (nothing written, nothing emitted)
    fresh = fx_engine.init_state(fx_engine.SamplingConfig(), prompts, m.config.vocab_size)
    state, _, res = fx_engine.verify_step(p, cache, fresh, [[5, 6], [5, 6]], [2, 2])
    assert state.full.tolist() == [True, True] and res.count.tolist() == [0, 0]


def test_forward_steps_return_nan_where_a_token_did_not_fit(tiny_model):
    p = tiny_model.params
    cache = init_cache(tiny_model.cache_layout(), 2, 16)
    _, cache = fx_engine.prefill_step(p, cache, [[1] * 12, [2] * 12], [12, 4])
    toks = mx.array([[3, 4, 5, 6, 7, 8], [3, 4, 5, 6, 7, 8]])
    # row 0: positions 12..17, the last two past the capacity; row 1: 4..9, all fit
    lg, after = fx_engine.logits_step(p, cache, toks, [6, 6])
    nan = mx.isnan(lg).any(axis=-1).tolist()
    assert nan == [[False] * 4 + [True] * 2, [False] * 6]
    assert after.lengths.tolist() == [16, 10]
    ref, _ = fx_engine.score_step(p, cache, toks, mx.array([4, 6]))  # what fits, unflagged
    assert mx.array_equal(lg[0, :4], ref[0, :4]).item() and mx.array_equal(lg[1], ref[1]).item()
    last, _ = fx_engine.prefill_step(p, cache, toks, [6, 6])
    assert mx.isnan(last[0]).all().item() and not mx.isnan(last[1]).any().item()
    # sample_step stops a row whose logits are NaN (with `full`), the other samples
    state = fx_engine.init_state(fx_engine.SamplingConfig(), [[1], [2]], tiny_model.config.vocab_size)
    state = fx_engine.sample_step(state, last)
    assert state.active.tolist() == [False, True] and state.full.tolist() == [True, False]


def test_a_chunk_longer_than_the_capacity_raises_when_traced(tiny_model):
    p = tiny_model.params
    cache = tiny_model.new_cache(1, 16)
    for step in (fx_engine.prefill_step, fx_engine.prefill_step_compiled, fx_engine.score_step,
                 fx_engine.logits_step):
        with pytest.raises(CacheError, match=r"tokens has 20 tokens per row .* 16 positions"):
            step(p, cache, mx.zeros((1, 20), mx.int32), mx.array([20]))
    state = fx_engine.init_state(fx_engine.SamplingConfig(), [[1]], tiny_model.config.vocab_size)
    with pytest.raises(CacheError, match="drafts"):
        fx_engine.verify_step(p, cache, state, mx.zeros((1, 16), mx.int32), mx.array([3]))
    assert isinstance(CacheError("x"), ValueError)


def _bad_calls(m):
    p, v = m.params, m.config.vocab_size
    cfg = fx_engine.SamplingConfig()
    c1, c4 = m.new_cache(1, 32), m.new_cache(4, 32)
    s1 = fx_engine.init_state(cfg, [[1]], v)
    return [
        ("1-row state, 4-row cache", lambda: fx_engine.decode_step(p, c4, s1), ValueError,
         r"state has 1 rows but the cache has 4"),
        ("1-D tokens", lambda: fx_engine.prefill_step(p, c1, mx.array([1, 2]), mx.array([2])),
         ValueError, r"tokens must be int32\[B, T\].*got shape \(2,\); one row of ids is \[ids\]"),
        ("tokens rows", lambda: fx_engine.prefill_step(p, c4, mx.array([[1, 2]]), mx.array([2])),
         ValueError, r"tokens has 1 rows but the cache has 4"),
        ("float tokens", lambda: fx_engine.prefill_step(p, c1, mx.array([[1.0, 2.0]]), mx.array([2])),
         TypeError, r"tokens must hold integers"),
        ("n_valid rows", lambda: fx_engine.prefill_step(p, c1, [[1, 2]], mx.array([2, 2])),
         ValueError, r"n_valid must be int32\[B\] with B = 1"),
        ("n_valid float", lambda: fx_engine.score_step(p, c1, [[1, 2]], mx.array([2.0])),
         TypeError, r"n_valid must hold integers"),
        ("ragged tokens", lambda: fx_engine.prefill_step(p, m.new_cache(2, 32), [[1, 2], [3]], [2, 1]),
         ValueError, r"tokens: rows of different lengths"),
        ("cache type", lambda: fx_engine.prefill_step(p, {"k": 1}, [[1]], [1]), TypeError,
         r"cache must be a KVCache"),
        ("state type", lambda: fx_engine.decode_step(p, c1, (1, 2)), TypeError,
         r"state must be a DecodeState"),
        ("logits rank", lambda: fx_engine.sample_step(s1, mx.zeros((v,))), ValueError,
         r"logits must be f32\[B, V\]"),
        ("logits type", lambda: fx_engine.sample_step(s1, [[0.0] * v]), TypeError,
         r"logits must be an mx.array"),
        ("logits dtype", lambda: fx_engine.sample_step(s1, mx.zeros((1, v), mx.int32)), TypeError,
         r"logits must be a float array"),
        ("mask words", lambda: fx_engine.sample_step(s1, mx.zeros((1, v)), mx.zeros((1, 2), mx.int32)),
         ValueError, r"mask has 2 words per row"),
        ("span", lambda: fx_engine.prefill_step(p, c1, [[1, 2, 3]], [3], span=64), ValueError,
         r"span must lie in \[3, 32\]"),
        ("drafts rank", lambda: fx_engine.verify_step(p, c1, s1, [1, 2], [2]), ValueError,
         r"drafts must be int32\[B, T\]"),
        ("n_draft rows", lambda: fx_engine.verify_step(p, c1, s1, [[1, 2]], [2, 2]), ValueError,
         r"n_draft must be int32\[B\]"),
        ("draft_probs", lambda: fx_engine.verify_step(p, c1, s1, [[1, 2]], [2], mx.zeros((1, 3, v))),
         ValueError, r"draft_probs must be f32\[B, K, V\]"),
        ("init_state counts", lambda: fx_engine.init_state([cfg, cfg], [[1]], v), ValueError,
         r"2 configs for 1 prompts"),
        ("init_state flat ids", lambda: fx_engine.init_state(cfg, [1, 2, 3], v), TypeError,
         r"prompts\[0\] must be a list of token ids"),
        ("prefill flat ids", lambda: fx_engine.prefill(m, [1, 2, 3]), TypeError,
         r"prompts\[0\] must be a list of token ids"),
        ("prefill id range", lambda: fx_engine.prefill(m, [[1, v]]), ValueError,
         r"outside \[0, %d\)" % v),
        ("prefill room", lambda: fx_engine.prefill(m, [[1, 2]], room=-1), ValueError, r"room must be"),
        ("cache rows", lambda: m.new_cache(0, 16), ValueError, r"rows must be an int >= 1"),
    ]


@pytest.mark.parametrize("case", range(23))
def test_bad_inputs_raise_errors_naming_the_argument(tiny_model, case):
    calls = _bad_calls(tiny_model)
    assert len(calls) == 23
    _, call, exc, match = calls[case]
    with pytest.raises(exc, match=match):
        call()


def test_lists_and_ints_are_inputs_not_compile_constants(tiny_model):
    """Token lists and an int n_valid are converted to arrays before the compiled step
    flattens them: results equal the array call's, and other values reuse the compile."""
    p = tiny_model.params
    f = fx_engine.prefill_step_compiled
    cache = tiny_model.new_cache(2, 32)
    a, ca = f(p, cache, mx.array([[5, 6, 7], [8, 9, 10]]), mx.array([3, 3]))
    b, cb = f(p, cache, [[5, 6, 7], [8, 9, 10]], 3)
    assert mx.array_equal(a, b).item() and cb.lengths.tolist() == [3, 3]
    before = f.traces
    for toks in ([[11, 12, 13], [14, 15, 16]], [[1, 2, 3], [4, 5, 6]]):
        f(p, cache, toks, 3)
    assert f.traces == before
    # logits_step: one token per row ([B]) and a count per row given as a bool array
    lg1, _ = fx_engine.logits_step_compiled(p, ca, [4, 4], mx.array([True, False]))
    ref, _ = fx_engine.prefill_step(p, ca, mx.array([[4], [4]]), mx.array([1, 0]))
    assert lg1.shape == (2, tiny_model.config.vocab_size)
    assert mx.array_equal(lg1[0], ref[0]).item()


def test_logits_step_is_the_forward_of_the_other_steps(tiny_model):
    p = tiny_model.params
    cache = tiny_model.new_cache(2, 64)
    toks = mx.array([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    many, c1 = fx_engine.logits_step(p, cache, toks)  # n_valid defaults to every token
    score, c2 = fx_engine.score_step(p, cache, toks, mx.array([5, 5]))
    assert mx.array_equal(many, score).item() and c1.lengths.tolist() == c2.lengths.tolist() == [5, 5]
    # one token per row, then sampling it = decode_step
    state = fx_engine.init_state(fx_engine.SamplingConfig(), [[3], [8]], tiny_model.config.vocab_size)
    state = fx_engine.sample_step(state, many[:, -1])
    one, _ = fx_engine.logits_step(p, c1, state.tokens)
    via_logits = fx_engine.sample_step(state, one)
    via_decode, _ = fx_engine.decode_step(p, c1, state)
    assert via_logits.tokens.tolist() == via_decode.tokens.tolist()
    compiled, _ = fx_engine.logits_step_compiled(p, c1, state.tokens)
    assert mx.allclose(compiled, one, atol=1e-6).item()


def test_engine_reports_length_when_a_row_runs_out_of_cache(tiny_model, monkeypatch):
    """If the batch cannot grow (forced here), the row stops with finish_reason "length"
    at the capacity instead of decoding garbage past it."""
    from fx_engine.engine.batch import DecodeBatch

    monkeypatch.setattr(DecodeBatch, "ensure_capacity", lambda self, needed: None)
    eos = {t: -100.0 for t in tiny_model.eos_ids}
    prompt = list(range(3, 23))
    out = fx_engine.generate(tiny_model, prompt, max_tokens=400, logit_bias=eos)
    assert out.finish_reason == "length"
    assert len(prompt) + len(out.token_ids) == 256 + 1  # capacity 256, + the last sampled token
    monkeypatch.undo()
    ref = fx_engine.generate(tiny_model, prompt, max_tokens=len(out.token_ids), logit_bias=eos)
    assert out.token_ids == ref.token_ids


# ------------------------------------------------------------------- the bucketed prefill


def test_bucketed_prefill_compiles_once_for_prompts_in_a_bucket(tiny_model):
    """Prompts of 40 and 43 tokens (room 64) run the same prefill, sampling and decode
    graphs: no recompile after the first; the logits equal an exact-size cache's."""
    from fx_engine.tracing import RecompileWatch

    m, p = tiny_model, tiny_model.params
    fns = [fx_engine.prefill_step_compiled, fx_engine.sample_step_compiled, fx_engine.decode_step_compiled]
    with RecompileWatch(fns) as watch:
        for i, n in enumerate((40, 43)):
            ids = [3 + (7 * j + n) % 300 for j in range(n)]
            logits, cache, state = fx_engine.prefill(m, [ids], room=64)
            assert cache.capacity == 128 and cache.lengths.tolist() == [n]
            for _ in range(3):
                state, cache = fx_engine.decode_step_compiled(p, cache, state)
                _eval(state, cache)
            if i == 0:
                watch.mark_warm()
        assert watch.recompiles == [], [e["reason"] for e in watch.recompiles]
    exact = m.new_cache(1, 43)
    ref, _ = fx_engine.prefill_step(p, exact, mx.array([ids]), mx.array([43]))
    assert mx.allclose(logits, ref, atol=1e-5).item()


def test_bucketed_prefill_of_several_rows_in_pieces(tiny_model):
    """Rows of different lengths in 16-token pieces: each row's logits and first token are
    those of the row alone in one piece; the plan's shapes are powers of two."""
    from fx_engine.core.buckets import prefill_plan

    assert prefill_plan([5, 20, 37], 10, 16) == (64, [(0, 16, 16), (16, 16, 16), (32, 5, 16)])
    assert prefill_plan([40], 64)[0] == prefill_plan([43], 64)[0] == 128
    with pytest.raises(ValueError, match="chunk"):
        prefill_plan([4], 0, 24)
    m = tiny_model
    prompts = [[3 + (5 * j + r) % 300 for j in range(n)] for r, n in enumerate((5, 20, 37))]
    cfgs = [fx_engine.SamplingConfig(), fx_engine.SamplingConfig(temperature=0.8, seed=3),
            fx_engine.SamplingConfig()]
    logits, cache, state = fx_engine.prefill(m, prompts, room=10, chunk=16, configs=cfgs)
    assert cache.lengths.tolist() == [5, 20, 37] and cache.capacity == 64
    for r, ids in enumerate(prompts):
        alone, _, st = fx_engine.prefill(m, [ids], room=64 - len(ids), configs=cfgs[r])
        assert mx.allclose(logits[r], alone[0], atol=1e-5).item()
        assert st.tokens.item() == state.tokens[r].item()
    # params instead of a Model; one config for every row
    lg2, c2, s2 = fx_engine.prefill(m.params, prompts, room=10, chunk=16)
    assert mx.array_equal(lg2, logits).item() and c2.capacity == 64


# ------------------------------------------------------------------------------- jit


def test_jit_traces_a_python_float_once_and_static_args_per_value():
    f = fx_engine.jit(lambda x, scale: x * scale)
    x = mx.array([1.0, 2.0])
    outs = [f(x, s).tolist() for s in (1.5, 3.0, 0.25)]
    assert outs == [[1.5, 3.0], [3.0, 6.0], [0.25, 0.5]]
    # one structure for every value; MLX's compile itself sometimes traces a second time on
    # the second call (fresh input arrays; it varies from process to process), never after
    warm = f.traces
    assert f.structures() == 1 and warm <= 2, f.trace_log
    assert [f(x, s).tolist() for s in (4.0, -1.0, 0.5)] == [[4.0, 8.0], [-1.0, -2.0], [0.5, 1.0]]
    assert f.traces == warm
    g = fx_engine.jit(lambda x, n: x[:n], static_argnames="n")
    assert g(x, 1).tolist() == [1.0] and g(x, 2).tolist() == [1.0, 2.0] and g(x, n=1).tolist() == [1.0]
    assert g.traces == 2  # one per static value (by position or keyword: the same call)
    h = fx_engine.jit(static_argnums=1)(lambda x, n: x[:n])
    h(x, 1), h(x, 2)
    assert h.traces == 2


def test_jit_composes_the_steps_one_compile_for_every_guidance_scale(tiny_model):
    """Classifier-free guidance over two rows of one batch (conditional, unconditional) in
    one compiled step: the scale is a Python float, traced once."""
    m = tiny_model

    @fx_engine.jit
    def guided(params, cache, state, scale):
        logits, cache = fx_engine.logits_step(params, cache, state.tokens, state.active)
        mixed = logits[1] + scale * (logits[0] - logits[1])
        state = fx_engine.sample_step(state, mx.stack([mixed, mixed]))
        return state, cache

    _, cache, state = fx_engine.prefill(m, [[3, 4, 5, 6, 7], [3]], room=8)
    outs = {}
    for scale in (1.0, 1.5, 3.0):
        s, c = guided(m.params, cache, state, scale)
        outs[scale] = s.tokens.tolist()
    assert guided.traces == 1
    # scale 1.0 is the conditional row's own greedy choice
    lg, _ = fx_engine.logits_step(m.params, cache, state.tokens)
    assert outs[1.0][0] == int(mx.argmax(lg[0]).item())


# ------------------------------------------------------------------ speculative loops


def test_draft_sync_bookkeeping():
    """Hand-built verify results: what the drafter keeps, feeds, and where EOS cuts."""
    res = VerifyResult(
        tokens=mx.array([[7, 8, 9], [7, 5, 0], [6, 0, 0], [0, 0, 0]]),
        count=mx.array([3, 2, 1, 0]), accepted=mx.array([2, 1, 0, 0]),
        logprobs=mx.zeros((4, 3)), top_ids=mx.zeros((4, 3, 0), mx.int32), top_logprobs=mx.zeros((4, 3, 0)))
    last = mx.array([1, 1, 1, 1])
    n_fed = mx.array([2, 2, 0, 2])  # K = 2 drafts fed as t0, d1; row 2 has no drafter cache
    s = fx_engine.draft_sync(res, last, mx.array([12, 12, 10, 12]), n_fed)
    # row 0: all 2 accepted -> keeps t0, d1, feeds d2 and the bonus 9
    # row 1: 1 accepted -> keeps t0, d1 (= accepted), feeds the correction 5
    # row 2: no drafts, nothing fed -> feeds t0 and the token; row 3: inactive
    assert s.count.tolist() == [3, 2, 1, 0]
    assert s.draft_lengths.tolist() == [12, 12, 10, 12]
    assert s.n_feed.tolist() == [2, 1, 2, 0]
    assert [f[:n] for f, n in zip(s.feed.tolist(), s.n_feed.tolist())] == [[8, 9], [5], [1, 6], []]
    assert s.stopped.tolist() == [False] * 4
    # EOS (8) inside row 0's accepted run: keep through it, the row stops
    e = fx_engine.draft_sync(res, last, mx.array([12, 12, 10, 12]), n_fed, stop_ids=[8])
    assert e.count.tolist() == [2, 2, 1, 0] and e.stopped.tolist() == [True, False, False, False]


def test_a_hand_written_speculative_loop_equals_greedy_decoding(default_model):
    """A self-draft (the model's first 28 of 30 layers, its own cache) proposes K tokens per row,
    verify_step accepts, draft_sync rolls the drafter back and says what to feed: the
    tokens equal plain greedy decoding, including a stop token met inside an accepted run
    (that row ends there, the other goes on)."""
    m, K, N = default_model, 3, 24
    draft = fx_engine.self_draft_model(m, 28)
    prompts = _prompts(m, ["Count from one to twenty.", "Write a haiku about the sea."])
    room = N + 2 * K + 4
    oracle = _greedy(m, prompts, N + K + 2, room)
    j = next(i for i in range(3, N) if oracle[1].index(oracle[1][i]) >= 1
             and oracle[1][i] not in oracle[0])
    stop = oracle[1][j]  # row 1 ends at the first occurrence of this token, row 0 has none
    cut = oracle[1].index(stop)
    from examples.speculative import speculative_generate  # the worked example's loop

    out, stats = speculative_generate(m, prompts, draft=draft, k=K, max_tokens=N, stop_ids=[stop])
    accepted, rejected = stats["accepted"], stats["proposed"] - stats["accepted"]
    assert accepted > 0 and rejected > 0  # both paths of the drafter's bookkeeping ran
    assert out[0][:N] == oracle[0][:N]
    assert out[1] == oracle[1][: cut + 1]


# ------------------------------------------------------------------- the README example


def test_the_readme_own_loop_runs_with_public_names_only(capsys):
    text = (ROOT / "README.md").read_text()
    code = re.search(r"### Your own loop over the pure steps.*?```python\n(.*?)```", text, re.S).group(1)
    assert "fx_engine.core" not in code and "fx_engine.prefill(" in code
    exec(compile(code, "README.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out
