"""The custom loops in examples/ (issue 42, item 3), each checked against an independent
oracle and for zero recompiles after warm-up across prompts of different lengths:

    beam search    its score = the teacher-forced sum of its tokens' logprobs (fx_engine.logits),
                   and >= the greedy sequence's score
    best-of-n      every candidate's reported logprobs = teacher-forced rescoring
    CFG            scale 1 = plain greedy `generate`; every guided logit vector =
                   uncond + s * (cond - uncond) from two separate fx_engine.logits calls
    speculative    greedy output = `generate(..., temperature=0)`, token for token
    fork           each forked row continues exactly as that row alone (batch == solo,
                   bitwise in the batch-invariant mode); the branch on the greedy token
                   continues the original row (rollback by length is exact); entropies =
                   teacher-forced ones

Prompts are chat prompts of 34 to 38 tokens: the same buckets, so after the first prompt
nothing may compile again (`fx_engine.tracing.RecompileWatch`)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import fx_engine
from examples import beam_search, best_of_n, cfg, fork, speculative
from fx_engine.tracing import RecompileWatch
from fx_engine.tracing.timeline import STEP_FUNCTIONS

pytestmark = pytest.mark.slow

QUESTIONS = ["Tell me a story about a cat.", "Name a color.", "Count from one to twenty.",
             "What is the capital of France?", "Write a haiku about the sea."]


def chat(model, q):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)


def teacher_forced(model, ids, out):
    """log p(out[i] | ids + out[:i]) for each i, from one fx_engine.logits call."""
    lg = fx_engine.logits(model, ids + out[:-1])[len(ids) - 1 :]
    logp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    return mx.take_along_axis(logp, mx.array(out)[:, None], axis=-1)[:, 0].tolist()


def no_recompiles(fns, run, inputs):
    """run(inputs[0]) warms up; the later inputs (other prompt lengths) compile nothing."""
    results = []
    with RecompileWatch([*STEP_FUNCTIONS, *fns]) as watch:
        for i, x in enumerate(inputs):
            results.append(run(x))
            if i == 0:
                watch.mark_warm()
    assert watch.recompiles == [], [(e["function"], e["reason"]) for e in watch.recompiles]
    return results


def test_beam_search(default_model):
    m, n = default_model, 8
    prompts = [chat(m, q) for q in QUESTIONS[:3]]
    assert len({len(p) for p in prompts}) == 3
    results = no_recompiles([beam_search.beam_step],
                            lambda ids: beam_search.beam_search(m, ids, width=4, max_tokens=n, eos=-1), prompts)
    for ids, (out, score) in zip(prompts, results):
        assert len(out) == n
        assert score == pytest.approx(sum(teacher_forced(m, ids, out)), abs=2e-3)
        greedy = list(fx_engine.generate(m, ids, max_tokens=n, temperature=0.0).token_ids)
        if len(greedy) == n:  # no EOS inside: the same length
            assert score >= sum(teacher_forced(m, ids, greedy)) - 1e-4
    # with EOS: the best sequence ends there, its score is still its teacher-forced sum
    ids = chat(m, QUESTIONS[3])
    out, score = beam_search.beam_search(m, ids, width=4, max_tokens=12)
    assert out[-1] in m.eos_ids and "Paris" in m.tokenizer.decode(out)
    assert score == pytest.approx(sum(teacher_forced(m, ids, out)), abs=2e-3)


def test_best_of_n(default_model):
    m = default_model
    prompts = [chat(m, q) for q in QUESTIONS[4:] + QUESTIONS[:1]]
    results = no_recompiles([], lambda ids: best_of_n.best_of_n(m, ids, n=8, max_tokens=8, seed=1), prompts)
    for ids, cands in zip(prompts, results):
        assert len(cands) == 8 and len({tuple(c["tokens"]) for c in cands}) > 1  # 8 samples, not one
        assert [c["mean"] for c in cands] == sorted((c["mean"] for c in cands), reverse=True)
        for c in cands:
            assert c["logprobs"] == pytest.approx(teacher_forced(m, ids, c["tokens"]), abs=2e-3)
    assert best_of_n.best_of_n(m, prompts[0], n=8, max_tokens=8, seed=1) == results[0]  # seeded


def test_cfg(default_model):
    m, n = default_model, 10
    pairs = [(chat(m, "Describe the sea in the style of a pirate."), chat(m, "Describe the sea.")),
             (chat(m, QUESTIONS[0]), chat(m, QUESTIONS[1]))]
    scales = iter([1.5, 3.0])
    results = no_recompiles([cfg.guide, cfg.guided_step],
                            lambda p: cfg.cfg_generate(m, *p, scale=next(scales), max_tokens=n), pairs)
    assert cfg.guided_step.traces == 1 and cfg.guide.traces == 1  # one compile for every scale
    (cond, uncond), (out, mixed) = pairs[1], results[1]
    c = fx_engine.logits(m, cond + out[:-1])[len(cond) - 1 :]
    u = fx_engine.logits(m, uncond + out[:-1])[len(uncond) - 1 :]
    want = u + 3.0 * (c - u)
    got = mx.concatenate(mixed, axis=0)
    assert mx.abs(got - want).max().item() < 2e-2, mx.abs(got - want).max().item()
    assert out == mx.argmax(want, axis=-1).tolist()
    # scale 1: plain greedy decoding of the conditional prompt
    for cond, uncond in pairs:
        out, _ = cfg.cfg_generate(m, cond, uncond, scale=1.0, max_tokens=n)
        greedy = list(fx_engine.generate(m, cond, max_tokens=n, temperature=0.0).token_ids)
        assert [t for t in out if t not in m.eos_ids] == greedy


def test_speculative(default_model):
    m, n = default_model, 16
    batches = [[chat(m, QUESTIONS[2]), chat(m, QUESTIONS[3])], [chat(m, QUESTIONS[4]), chat(m, QUESTIONS[1])]]
    draft = fx_engine.self_draft_model(m, m.config.num_layers - 2)
    results = no_recompiles([], lambda ps: speculative.speculative_generate(m, ps, draft, k=3, max_tokens=n),
                            batches)
    for prompts, (outs, stats) in zip(batches, results):
        assert stats["accepted"] > 0 and stats["verify_steps"] < n
        for ids, out in zip(prompts, outs):
            greedy = list(fx_engine.generate(m, ids, max_tokens=n, temperature=0.0).token_ids)
            assert [t for t in out if t not in m.eos_ids] == greedy


def test_fork(default_model_bi):
    m, probe, n = default_model_bi, 10, 6
    prompts = [chat(m, q) for q in QUESTIONS[:3]]
    results = no_recompiles([fork.tracked_step], lambda ids: fork.entropy_fork(m, ids, probe, 3, n), prompts)
    for ids, res in zip(prompts, results):
        at, alts = res["at"], res["alternatives"]
        assert res["entropy"][at] == max(res["entropy"])
        # entropies: those of the teacher-forced distributions
        lg = fx_engine.logits(m, ids + res["tokens"][:-1])[len(ids) - 1 :]
        logp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
        ent = (-(mx.exp(logp) * logp).sum(axis=-1)).tolist()
        assert res["entropy"] == pytest.approx(ent, abs=2e-3)
        # batch == solo: each branch forked alone decodes the same tokens, bitwise
        for j, alt in enumerate(alts):
            state, cache = fork.fork(res["states"], res["cache"], len(ids), at, [alt])
            assert res["branches"][j] == res["tokens"][:at] + [alt] + fork.decode(m, state, cache, n)[0]
        # the greedy token's branch continues the original row (the rollback is exact)
        assert alts[0] == res["tokens"][at]
        k = min(probe, at + 1 + n)
        assert res["branches"][0][:k] == res["tokens"][:k]


@pytest.mark.oracle
def test_the_mlx_lm_versions_give_the_same_results(default_model):
    """examples/mlx_lm_loops.py (docs/loops.md's comparison) on mlx-lm's own model class
    holding the same weights: the greedy loops give the same tokens as fx-engine's, and
    best-of-n's logprobs are teacher-forced ones (sampling draws differ by design)."""
    from examples import mlx_lm_loops as ml

    m = default_model
    eos = tuple(m.eos_ids)
    ref, draft = ml.models(m, m.config.num_layers - 2)
    ids = chat(m, QUESTIONS[0])
    assert ml.beam_search(ref, ids, 4, 6)[0] == beam_search.beam_search(m, ids, 4, 6, eos=-1)[0]
    cond, uncond = chat(m, QUESTIONS[0]), chat(m, QUESTIONS[1])
    assert ml.cfg_generate(ref, cond, uncond, 2.0, 8, eos) == cfg.cfg_generate(m, cond, uncond, 2.0, 8)[0]
    prompts = [chat(m, QUESTIONS[3])]
    assert ml.speculative(ref, draft, prompts, 3, 10, eos) == speculative.speculative_generate(m, prompts, k=3, max_tokens=10)[0]
    a, b = ml.entropy_fork(ref, ids, 8, 2, 4), fork.entropy_fork(m, ids, 8, 2, 4)
    assert (a["at"], a["alternatives"], a["branches"]) == (b["at"], b["alternatives"], b["branches"])
    for c in ml.best_of_n(ref, ids, 4, 6, eos_ids=eos):
        assert c["logprobs"] == pytest.approx(teacher_forced(m, ids, c["tokens"]), abs=2e-3)
