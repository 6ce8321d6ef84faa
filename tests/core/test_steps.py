"""The pure step functions: determinism, batch invariance, rollback, recompiles, typing."""

import mlx.core as mx
import pytest
from beartype import beartype
from jaxtyping import jaxtyped

from fx_engine.core.cache import init_cache, with_lengths
from fx_engine.core.models import cache_layout
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.state import init_state
from fx_engine.core.steps import (decode_step, decode_step_compiled, prefill_step, prefill_step_compiled, sample_step_compiled, score_step)
from fx_engine.core.tree import tree_leaves

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the ocean and the moon.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "The history of the Roman Empire begins",
]


def run(model, prompts, configs, chunk, steps, capacity=256):
    """Prefill rows (different lengths) in chunks of `chunk`, then decode `steps` tokens.

    Returns (first-token logits [B, V], generated tokens [B, steps+1]).
    """
    c, p = model.config, model.params
    ids = [model.tokenizer.encode(t) for t in prompts]
    b = len(ids)
    cache = init_cache(cache_layout(c), b, capacity)
    logits = mx.zeros((b, c.vocab_size))
    longest = max(len(x) for x in ids)
    for start in range(0, longest, chunk):
        toks = [(x[start : start + chunk] + [0] * chunk)[:chunk] for x in ids]
        n = [max(0, min(chunk, len(x) - start)) for x in ids]
        lg, cache = prefill_step_compiled(p, cache, mx.array(toks), mx.array(n))
        # keep each row's logits from the chunk holding its last prompt token
        done = mx.array([start < len(x) <= start + chunk for x in ids])
        logits = mx.where(done[:, None], lg, logits)
        mx.eval(logits, *tree_leaves(cache))
    state = init_state(configs, ids, c.vocab_size)
    state = sample_step_compiled(state, logits)
    out = [state.tokens]
    for _ in range(steps):
        state, cache = decode_step_compiled(p, cache, state)
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
        out.append(state.tokens)
    return logits, mx.stack(out, axis=1)


GREEDY = SamplingConfig()
SEEDED = SamplingConfig(temperature=0.9, top_p=0.95, seed=1234)


@pytest.mark.parametrize("config", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.slow
def test_batch_invariant_mode_is_bitwise(default_model_bi, config):
    """Batch-invariant mode: a row's logits and tokens are bitwise identical alone or in a
    batch (neighbours at other lengths and settings), and with any prefill chunk size."""
    m = default_model_bi
    target = PROMPTS[1]
    lg_alone, tok_alone = run(m, [target], [config], chunk=64, steps=6)
    lg_chunk, tok_chunk = run(m, [target], [config], chunk=4, steps=6)
    others = [PROMPTS[0], target, PROMPTS[3], PROMPTS[4]]
    cfgs = [SamplingConfig(temperature=0.7, seed=5), config, GREEDY, SamplingConfig(temperature=1.0, top_k=5, seed=9)]
    lg_batch, tok_batch = run(m, others, cfgs, chunk=16, steps=6)
    assert mx.array_equal(lg_alone[0], lg_chunk[0])
    assert mx.array_equal(lg_alone[0], lg_batch[1])
    assert tok_alone[0].tolist() == tok_chunk[0].tolist() == tok_batch[1].tolist()


def test_default_mode_token_identity_with_clear_margins(default_model):
    """Default (fastest BLAS) mode: arithmetic may differ in the last bits with batch and
    chunk size, so we check greedy tokens where the top-2 margin is clear."""
    m = default_model
    lg_alone, tok_alone = run(m, [PROMPTS[0]], [GREEDY], chunk=64, steps=8)
    lg_batch, tok_batch = run(m, PROMPTS[:3], [GREEDY] * 3, chunk=8, steps=8)
    assert mx.abs(lg_alone[0] - lg_batch[0]).max().item() < 1e-3
    top2 = mx.topk(lg_alone[0], 2)
    assert abs((top2[1] - top2[0]).item()) > 0.05  # the first token has a clear margin
    assert tok_alone[0].tolist() == tok_batch[0].tolist()


def test_prefill_step_matches_score_step_and_rollback_is_exact(tiny_model):
    m = tiny_model
    c, p = m.config, m.params
    ids = m.tokenizer.encode("The quick brown fox jumps over the lazy dog again and again.")[:24]
    cache = init_cache(cache_layout(c), 1, 64)
    all_logits, full = score_step(p, cache, mx.array([ids]), mx.array([len(ids)]))
    # prefill the first 10, then write 8 junk tokens and roll back by length
    cache = init_cache(cache_layout(c), 1, 64)
    lg, cache = prefill_step(p, cache, mx.array([ids[:10]]), mx.array([10]))
    assert mx.allclose(lg[0], all_logits[0, 9], atol=1e-5)
    _, junk = prefill_step(p, cache, mx.array([[5] * 8]), mx.array([8]))
    assert junk.lengths.tolist() == [18]
    rolled = with_lengths(junk, mx.array([10]))
    lg2, _ = prefill_step(p, rolled, mx.array([ids[10:]]), mx.array([len(ids) - 10]))
    lg3, _ = prefill_step(p, cache, mx.array([ids[10:]]), mx.array([len(ids) - 10]))
    assert mx.array_equal(lg2, lg3)  # stale entries past the length are never read
    assert mx.allclose(lg2[0], all_logits[0, -1], atol=1e-4)


def test_rows_with_zero_valid_tokens_are_untouched(tiny_model):
    m = tiny_model
    c, p = m.config, m.params
    cache = init_cache(cache_layout(c), 2, 32)
    _, cache = prefill_step(p, cache, mx.array([[3, 4, 5], [6, 7, 8]]), mx.array([3, 2]))
    assert cache.lengths.tolist() == [3, 2]
    _, cache2 = prefill_step(p, cache, mx.array([[9, 9, 9], [9, 9, 9]]), mx.array([0, 1]))
    assert cache2.lengths.tolist() == [3, 3]
    # row 0's valid entries unchanged
    assert mx.array_equal(cache2.keys[0][0, :, :3], cache.keys[0][0, :, :3])


def test_decode_loop_never_recompiles(tiny_model):
    """After warm-up, 200 decode steps trigger zero traces (every per-step value is an
    array, sampled tokens stay int32, shapes are fixed)."""
    m = tiny_model
    c, p = m.config, m.params
    cfgs = [SamplingConfig(temperature=0.8, top_p=0.9, seed=1), SamplingConfig(temperature=0.5, top_p=0.5, seed=2)]
    cache = init_cache(cache_layout(c), 2, 256)
    lg, cache = prefill_step_compiled(p, cache, mx.array([[1, 2, 3, 4], [5, 6, 7, 8]]), mx.array([4, 3]))
    state = sample_step_compiled(init_state(cfgs, [[1, 2, 3, 4], [5, 6, 7]], c.vocab_size), lg)
    for _ in range(3):  # warm-up
        state, cache = decode_step_compiled(p, cache, state)
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
    before = decode_step_compiled.traces
    for _ in range(200):
        state, cache = decode_step_compiled(p, cache, state)
        mx.eval(*tree_leaves(state), *tree_leaves(cache))
    assert decode_step_compiled.traces == before
    assert cache.lengths.tolist() == [4 + 203, 3 + 203]


def test_recompile_is_detected_for_a_python_scalar(tiny_model):
    """The counter is real: passing a Python int where an array belongs retraces."""
    from fx_engine.core.tree import CompiledFunction

    f = CompiledFunction(lambda x, n: x + n)
    for i in range(3):
        f(mx.array([1]), i)
    assert f.traces == 3
    for i in range(3):
        f(mx.array([1]), mx.array(i))
    assert f.traces == 4


def test_compiled_equals_eager(tiny_model):
    m = tiny_model
    c, p = m.config, m.params
    cache = init_cache(cache_layout(c), 1, 32)
    toks, n = mx.array([[3, 4, 5, 6]]), mx.array([4])
    a, ca = prefill_step(p, cache, toks, n)
    b, cb = prefill_step_compiled(p, cache, toks, n)
    assert mx.allclose(a, b, atol=1e-6)
    state = init_state([SEEDED], [[3, 4, 5, 6]], c.vocab_size)
    s1 = sample_step_compiled(state, a)
    s2, _ = decode_step(p, ca, s1)
    s3, _ = decode_step_compiled(p, cb, s1)
    assert s2.tokens.tolist() == s3.tokens.tolist()


def test_shape_annotations_are_checked(tiny_model):
    """jaxtyping annotations on the public step functions, checked with beartype."""
    m = tiny_model
    c, p = m.config, m.params
    checked = jaxtyped(typechecker=beartype)(prefill_step)
    cache = init_cache(cache_layout(c), 2, 32)
    logits, _ = checked(p, cache, mx.array([[1, 2], [3, 4]]), mx.array([2, 2]))
    assert logits.shape == (2, c.vocab_size)
    with pytest.raises(Exception, match="n_valid|B"):
        checked(p, cache, mx.array([[1, 2], [3, 4]]), mx.array([2, 2, 2]))  # B mismatch
    with pytest.raises(Exception):
        checked(p, cache, mx.array([1, 2]), mx.array([2]))  # tokens must be [B, C]
    checked_score = jaxtyped(typechecker=beartype)(score_step)
    out, _ = checked_score(p, cache, mx.array([[1, 2], [3, 4]]), mx.array([2, 2]))
    assert out.shape == (2, 2, c.vocab_size)


def test_attention_span_matches_full_capacity(tiny_model):
    """Attending over a span bucket (>= every row's length) equals attending over the whole
    capacity up to float rounding: slots past a row's length contribute exactly zero."""
    from fx_engine.core.cache import span_bucket

    m = tiny_model
    c, p = m.config, m.params
    cache = init_cache(cache_layout(c), 2, 1024)
    toks = mx.array([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    full, cf = prefill_step(p, cache, toks, mx.array([6, 4]))
    span = span_bucket(6, 1024)
    assert span == 256
    part, cp = prefill_step(p, cache, toks, mx.array([6, 4]), span=span)
    assert mx.allclose(full, part, atol=1e-5)
    assert mx.array_equal(cf.keys[1], cp.keys[1])


def test_span_buckets_are_few():
    from fx_engine.core.cache import span_bucket

    spans = {span_bucket(n, 8192) for n in range(1, 8193)}
    assert len(spans) <= 4 * 6  # four per octave from 256 to 8192
    for n in range(1, 8193, 37):
        s = span_bucket(n, 8192)
        assert n <= s <= 8192 and s - n < max(256, n // 4 + 1)


def test_write_sink_protects_full_and_inactive_rows(tiny_model):
    """Padding, inactive rows and writes past the capacity go to the cache's sink slot:
    a full, inactive row keeps its entries and nothing is written out of bounds."""
    m = tiny_model
    c, p = m.config, m.params
    cache = init_cache(cache_layout(c), 2, 16)
    full = list(range(3, 19))  # 16 tokens: row 0 is full
    lg, cache = prefill_step(p, cache, mx.array([full, full[:16]]), mx.array([16, 5]))
    before = [mx.array(k[0]) for k in cache.keys]
    state = init_state([GREEDY, GREEDY], [full, full[:5]], c.vocab_size)
    state = sample_step_compiled(state, lg)
    from fx_engine.core.tree import tree_replace

    state = tree_replace(state, active=mx.array([False, True]))
    for _ in range(3):
        state, cache = decode_step(p, cache, state)
    assert cache.lengths.tolist() == [16, 8]
    for k0, k in zip(before, cache.keys):
        assert mx.array_equal(k0[:, :16], k[0, :, :16])
    # a chunk that would run past the capacity stays in bounds (lengths capped)
    _, over = prefill_step(p, cache, mx.array([[5] * 16, [5] * 16]), mx.array([16, 16]))
    mx.eval(over.keys)
    assert over.lengths.tolist() == [16, 16]


def test_half_precision_activations_stay_half(tiny_folder):
    from fx_engine.core.models.llama import forward
    import fx_engine

    m = fx_engine.load(tiny_folder("llama"), dtype="float16")
    c = m.config
    cache = init_cache(cache_layout(c), 1, 32, mx.float16)
    h, cache = forward(m.params, cache, mx.array([[3, 4, 5]]), mx.array([3]))
    assert h.dtype == mx.float16 and cache.keys[0].dtype == mx.float16


def test_the_custom_loop_in_specs_steps_md_runs(capsys):
    """The documented 20-line loop stays true: it runs and answers the question."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "specs" / "steps.md").read_text()
    code = re.search(r"## A custom greedy loop.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 22
    exec(compile(code, "specs/steps.md", "exec"), {})
    assert "Paris" in capsys.readouterr().out
