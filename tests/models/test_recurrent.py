"""Recurrent cache entries: LFM2's gated short convolutions (LFM2-MoE's too), Mamba-2's SSM, Nemotron-H's
hybrid, Qwen3-Next's Gated DeltaNet, Granite 4.0's hybrid (dense, NoPE variant here; the MoE one
with RoPE runs in test_every_family.py), Falcon-H1's parallel mixer + attention.

Oracles: mlx-lm's Lfm2 class on the same folder (logits, greedy tokens: also run for every
family by test_every_family.py), and the model itself fed one token at a time (the
recurrence's definition) for the properties: chunked prefill with random chunk sizes and
rows at different positions equals token-by-token; a verify step's per-row rollback equals
plain decoding of the accepted tokens; a prefix-cache restore equals a cold prefill.
LFM2's conv is exact (bitwise in the batch-invariant mode); Mamba-2's chunked scan sums in
another order than one token at a time, so its comparisons allow float32 rounding."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fx_engine
from fx_engine.core.cache import RecState
from fx_engine.core.sampling import SamplingConfig
from fx_engine.core.state import init_state
from fx_engine.core.steps import prefill_step, verify_step
from fx_engine.testing import write_tiny_model

from tests.models.test_parity import assert_greedy_matches_mlx_lm

pytestmark = pytest.mark.oracle


FAMILIES = {"lfm2": {"conv_bias": True, "conv_L_cache": 4}, "lfm2_moe": {"conv_L_cache": 4}, "mamba2": {},
            "nemotron_h": {"hybrid_override_pattern": "M*-ME"}, "qwen3_next": {"mlp_only_layers": [1]},
            "granitemoehybrid": {"num_local_experts": 0, "position_embedding_type": "nope"},
            "falcon_h1": {"mamba_norm_before_gate": True}}
EXACT = {"lfm2": 0.0, "lfm2_moe": 0.0, "mamba2": 2e-4, "nemotron_h": 2e-4, "qwen3_next": 2e-4, "granitemoehybrid": 2e-4,
         "falcon_h1": 2e-4}


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tiny_folder):
    return tiny_folder(request.param,
                       **FAMILIES[request.param])


def _close(a, b, model):
    tol = EXACT[model.config.model_type]
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=tol, atol=tol)


@pytest.fixture(scope="module")
def model(folder):
    return fx_engine.load(folder, batch_invariant=True)


def _states(cache, row=0):
    return [np.array(a[row]) for e in cache.layers if isinstance(e, RecState) for a in e.arrays]


def _feed(model, ids, chunks, cap=256):
    """Prefill `ids` in pieces of the given sizes (each padded to 16): last logits, cache."""
    cache = model.new_cache(1, cap, headroom=64)
    at, logits = 0, None
    for n in chunks:
        piece = ids[at : at + n]
        if not piece:
            break
        padded = piece + [0] * (16 * -(-len(piece) // 16) - len(piece))
        logits, cache = prefill_step(model.params, cache, mx.array([padded]), mx.array([len(piece)]))
        at += len(piece)
    return logits, cache


def test_matches_mlx_lm(folder):
    m = fx_engine.load(folder)
    assert_greedy_matches_mlx_lm(folder, m, list(range(5, 60)))


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.integers(1, 13), min_size=1, max_size=6))
@pytest.mark.slow
def test_chunked_prefill_equals_one_token_at_a_time(model, chunks):
    ids = list(range(7, 7 + sum(chunks)))
    one_lg, one = _feed(model, ids, [1] * len(ids))
    lg, cache = _feed(model, ids, chunks)
    _close(lg, one_lg, model)
    for a, b in zip(_states(cache), _states(one)):
        _close(a, b, model)


def test_rows_at_different_positions_with_padding(model):
    """Two rows in one chunk call, one with fewer valid tokens: each equals itself alone."""
    a, b = list(range(10, 30)), list(range(40, 47))
    cache = model.new_cache(2, 256, headroom=64)
    toks = mx.array([a, b + [0] * (len(a) - len(b))])
    lg, cache = prefill_step(model.params, cache, toks, mx.array([len(a), len(b)]))
    for row, ids in ((0, a), (1, b)):
        solo_lg, solo = _feed(model, ids, [len(ids)])
        assert mx.array_equal(lg[row], solo_lg[0])  # the same computation: bitwise
        for x, y in zip(_states(cache, row), _states(solo)):
            np.testing.assert_array_equal(x, y)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(0, 4), st.lists(st.integers(3, 300), min_size=4, max_size=4))
@pytest.mark.slow
def test_verify_rollback_equals_plain_decoding(model, accept_upto, noise):
    """Drafts whose first `accept_upto` are the greedy continuation: the state after the
    verify step is the state after prefilling exactly the tokens it kept."""
    ids = list(range(20, 45))
    lg, cache = _feed(model, ids, [len(ids)])
    first = int(mx.argmax(lg[0]).item())
    greedy, seq = [], ids + [first]
    for _ in range(4):  # the greedy continuation after `first`
        l2, _ = _feed(model, seq, [len(seq)])
        greedy.append(int(mx.argmax(l2[0]).item()))
        seq.append(greedy[-1])
    drafts = greedy[:accept_upto] + [t for t in noise if t not in greedy[accept_upto:accept_upto + 1]][: 4 - accept_upto]
    state = attrs.evolve(init_state([SamplingConfig()], [ids], model.config.vocab_size),
                         tokens=mx.array([first], mx.int32))
    _, after, res = verify_step(model.params, cache, state, mx.array([drafts], mx.int32),
                                mx.array([4], mx.int32))
    kept = int(res.count[0].item())  # accepted drafts + the correction (or bonus) token
    assert kept - 1 >= accept_upto  # the greedy drafts were accepted
    # the cache now holds ids + first + the accepted drafts
    want_seq = ids + [first] + drafts[: kept - 1]
    _, want = _feed(model, want_seq, [len(want_seq)])
    assert int(after.lengths[0].item()) == len(want_seq)
    for x, y in zip(_states(after), _states(want)):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_prefix_cache_restore_equals_cold_prefill(model):
    prompt = list(range(10, 75))
    cold = fx_engine.generate(model, prompt + [5, 6], max_tokens=10, temperature=0.0, prefill_chunk=16)
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=16)
    engine.submit(prompt, max_tokens=3).result()  # snapshots at chunk boundaries and the end
    warm = engine.submit(prompt + [5, 6], max_tokens=10, temperature=0.0).result()
    engine.close()
    assert warm.usage.cached_tokens > 0 and warm.token_ids == cold.token_ids


def test_state_memory_does_not_grow_with_the_context(model):
    small, big = model.new_cache(1, 256), model.new_cache(1, 8192)
    rec = lambda c: sum(a.nbytes for e in c.layers if isinstance(e, RecState) for a in e.arrays)  # noqa: E731
    assert rec(small) == rec(big) > 0
    engine = fx_engine.Engine(model, max_rows=4, kv_budget_bytes=4 * rec(small) + 10**6)
    assert engine.stats()["state_bytes_per_row"] == rec(small)
    if engine.bytes_per_token:  # the rows' states are reserved out of the budget
        assert engine.kv_budget_tokens == int(10**6 // engine.bytes_per_token)
    with pytest.raises(ValueError, match="recurrent"):
        fx_engine.Engine(model, max_rows=64, kv_budget_bytes=rec(small))


@pytest.mark.parametrize("text_type,wrapper", [("qwen3_5_text", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5_moe")])
def test_qwen3_5_checkpoints_match_mlx_lm(tmp_path, text_type, wrapper):
    """Qwen3.5 as Hugging Face ships it: the multimodal wrapper config (text_config) and
    `model.language_model.` tensor names, separate q|k|v, z, b, a projections, norms stored
    as 1 + w, fused [E, 2F, H] experts (MoE)."""
    import json

    folder = write_tiny_model(tmp_path / "t", text_type)
    cfg = json.loads((folder / "config.json").read_text())
    w = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
                         for k, v in w.items()})
    (folder / "config.json").write_text(json.dumps({"model_type": wrapper, "text_config": cfg}))
    m = fx_engine.load(folder)
    assert m.config.qwen3_5
    assert_greedy_matches_mlx_lm(folder, m, list(range(5, 80)))


def test_disk_tier_holds_recurrent_states(model, tmp_path):
    """A later engine (a new process, as far as the cache knows) restores a recurrent row
    from the disk tier: the same tokens as a cold run."""
    prompt = list(range(30, 90))
    cold = fx_engine.generate(model, prompt + [3], max_tokens=8, temperature=0.0)
    with fx_engine.Engine(model, max_rows=1, prefill_chunk=16, prefix_cache_dir=str(tmp_path)) as e:
        e.submit(prompt, max_tokens=2).result()
    with fx_engine.Engine(model, max_rows=1, prefill_chunk=16, prefix_cache_dir=str(tmp_path)) as e:
        warm = e.submit(prompt + [3], max_tokens=8, temperature=0.0).result()
    assert warm.usage.cached_tokens > 0 and warm.token_ids == cold.token_ids


def test_prompt_snapshots_survive_the_conversation_snapshot(model):
    """A recurrent snapshot serves only its own length, so the finished conversation's
    snapshot must not evict the prompt's (the next turn shares the prompt, not the reply)."""
    prompt = list(range(10, 75))
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=16)
    engine.submit(prompt, max_tokens=3).result()
    again = engine.submit(prompt + [5, 6], max_tokens=2).result()
    engine.close()
    assert again.usage.cached_tokens == len(prompt)
