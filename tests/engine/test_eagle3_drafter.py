"""EAGLE-3 heads drafting inside the engine (fx_engine.engine.eagle3_drafter): greedy output
identical with and without the head (a random head: drafts mostly rejected; an "echo" head
whose first draft is always right and chained ones wrong: accepted and rejected drafts in
every verify), batched rows equal to each request alone, the head's cache after rollbacks
equal to a head fed the accepted sequence from scratch, no steady-state recompiles, grammars
and sampled rows composing, and the refusals."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest

import fx_engine
from tests.engine import drafter_checks
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import eagle3
from fx_engine.core.models import CaptureError
from fx_engine.engine.eagle3_drafter import Eagle3Drafter
from fx_engine.engine.generate import reference_generate
from fx_engine.testing.eagle3 import write_echo_pair, write_tiny_eagle3

HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
            draft_vocab_size=128, intermediate_size=96)


@pytest.fixture(scope="module")
def target(tiny_folder):
    """A tiny 6-layer Llama (aux layers (2, 3, 3)), batch-invariant: verify and decode give
    bitwise-equal logits, so greedy identity is exact."""
    return fx_engine.load(tiny_folder("llama", num_hidden_layers=6), batch_invariant=True)


@pytest.fixture(scope="module")
def random_head(target, tmp_path_factory):
    """A random head over a 128-token draft vocabulary (d2t / t2d maps)."""
    return Eagle3Drafter.load(write_tiny_eagle3(tmp_path_factory.mktemp("head") / "h", 64, seed=3, **HEAD), target)


class Recording(drafter_checks.RecordsRows, Eagle3Drafter):
    """The drafter, keeping its rows (to look at a row's head after generation)."""


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """(target, drafter) of `write_echo_pair`: first drafts right, chained drafts wrong."""
    t, h = write_echo_pair(tmp_path_factory.mktemp("echo"))
    model = fx_engine.load(t, batch_invariant=True)
    return model, Recording.load(h, model)


_prompt = drafter_checks.prompt


def test_greedy_output_is_identical_with_a_random_head(target, random_head):
    drafter_checks.greedy_output_is_identical(target, random_head, ((9, 4), (40, 2), (70, 8)), max_tokens=24)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accepted_and_rejected_drafts_keep_greedy_output(echo, k, steady_policy):
    drafter_checks.accepted_and_rejected_drafts_keep_greedy_output(*echo, k)


def test_the_heads_cache_after_rollbacks_is_a_head_fed_the_accepted_sequence(echo, steady_policy):
    """After a generation full of rejected chained drafts, the row's head holds exactly the
    pairs (the target's captured states at t, token t + 1) of the accepted sequence: its K/V
    equal those of a fresh head fed the final sequence's pairs in one step."""
    from fx_engine.core.cache import init_cache
    from fx_engine.core.nn import embed

    model, drafter = echo
    head = drafter.head

    def fresh(seq, f, aux):
        cache = init_cache(eagle3.cache_specs(head.config), 1, 64)
        return eagle3.eagle3_forward(head, embed(mx.array([seq[1: f + 1]]), drafter.table), aux[:, :f], cache,
                                     mx.array([f], mx.int32))[2]

    drafter_checks.cache_after_rollbacks_is_fed_the_accepted_sequence(model, drafter, fresh)


@pytest.mark.parametrize("which", ["random", "echo"])
def test_batched_rows_equal_each_request_alone(target, random_head, echo, which, steady_policy):
    """Rows with the head, without a drafter and with prompt lookup, joining one step apart,
    share prefill, decode and verify steps (each step captures for the head's rows only
    what it needs): every request's tokens equal its plain greedy run alone."""
    model, head = (target, random_head) if which == "random" else echo
    drafter_checks.batched_rows_equal_each_request_alone(model, head, max_tokens=20, echo=which == "echo")


def test_long_prompts_feed_the_head_in_pieces_and_prefix_hits_do_not_starve_it(echo, steady_policy):
    """A prompt longer than FLUSH_AT, prefilled in small chunks, feeds the head early (in
    bounded pieces); a second request sharing its prefix does not restore the prefix (its
    head needs every position's states) and drafts as well."""
    drafter_checks.long_prompts_feed_in_pieces(*echo, max_tokens=12, prefill_chunk=32)


def test_grammars_and_sampled_rows_compose(target, echo, steady_policy):
    model, drafter = echo
    drafter_checks.grammars_and_sampled_rows_compose(model, drafter)


def test_no_recompiles_in_steady_state(echo, steady_policy):
    model, drafter = echo
    drafter_checks.no_recompiles_in_steady_state(model, drafter, eagle3.head_step_compiled)


def test_refusals(target, tiny_folder, tmp_path):
    head = write_tiny_eagle3(tmp_path / "h", 64, seed=3, **HEAD)
    with pytest.raises(ValueError, match="tensor / pipeline parallelism"):
        Eagle3Drafter.load(head, attrs.evolve(target, tensor_parallel=2))
    with pytest.raises(ConfigError, match="vocab_size = 384 but the llama target's vocab_size is 500"):
        Eagle3Drafter.load(head, fx_engine.load(tiny_folder("llama", num_hidden_layers=6, vocab_size=500)))
    gemma = fx_engine.load(tiny_folder("gemma3_text"))
    g = gemma.config
    other = write_tiny_eagle3(tmp_path / "g", g.hidden_size, seed=3, **{
        **HEAD, "hidden_size": g.hidden_size, "head_dim": g.hidden_size // 4, "vocab_size": g.vocab_size,
        "draft_vocab_size": 64, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}})
    with pytest.raises(CaptureError, match="not supported for gemma3_text models"):
        Eagle3Drafter.load(other, gemma)


@pytest.mark.oracle  # (the adapter is made by mlx-lm's own LoRA layers: tools/oracle.py)
def test_adapters_compose(tiny_folder, tmp_path, steady_policy):
    """A request on a LoRA adapter drafts from the adapted target's captured states; its
    output is the adapted target's greedy output (and the base rows beside it are the base's)."""
    from fx_engine.loading.adapters import AdapterSet
    from tools.oracle import write_mlx_lm_adapter

    path = tiny_folder("llama", num_hidden_layers=6)
    model = attrs.evolve(fx_engine.load(path, batch_invariant=True), adapters=AdapterSet())
    adapter = write_mlx_lm_adapter(path, tmp_path / "ad", rank=4, scale=3.0, num_layers=3, init_scale=0.2, seed=1)
    fx_engine.load_adapter(model, adapter, name="ft")
    drafter = Eagle3Drafter.load(write_tiny_eagle3(tmp_path / "h", 64, seed=3, **HEAD), model)
    prompt = _prompt(model, 30, offset=7)
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=16)
    tuned = engine.submit(prompt, max_tokens=16, temperature=0.0, adapter="ft", draft_model=drafter)
    base = engine.submit(prompt, max_tokens=16, temperature=0.0, draft_model=drafter)
    tuned, base = tuned.result(), base.result()
    engine.close()
    want = reference_generate(model, prompt, max_tokens=16, temperature=0.0, adapter="ft").token_ids
    assert tuned.token_ids == want
    assert base.token_ids == reference_generate(model, prompt, max_tokens=16, temperature=0.0).token_ids
    assert tuned.token_ids != base.token_ids and tuned.usage.drafted_tokens > 0


def test_a_rows_states_feed_early_replace_on_overlap_and_stop_at_a_gap(echo):
    drafter_checks.rows_feed_early_replace_on_overlap_and_stop_at_a_gap(*echo)


def test_a_head_folder_is_told_from_a_model_folder(tiny_folder, tmp_path):
    from fx_engine.loading.drafter import is_eagle3_head

    assert is_eagle3_head(write_tiny_eagle3(tmp_path / "h", 64, seed=3, **HEAD))
    assert not is_eagle3_head(tiny_folder("llama", num_hidden_layers=6))
    assert not is_eagle3_head(tmp_path / "nothing-here")


@pytest.mark.parametrize("bits", [8, 4])
def test_a_head_quantized_at_load_keeps_output_and_still_drafts_right(tmp_path, bits, steady_policy):
    """`Eagle3Drafter.load(..., bits=)` runs the head's matrices quantized on the target's
    native kernels: the echo head's first drafts stay right (accepted), the output is plain
    greedy's, and its linears are packed (the native formats) with the target's numerics."""
    from fx_engine.runtime import native as fx_native

    t, h = write_echo_pair(tmp_path)
    model = fx_engine.load(t, batch_invariant=True)
    drafter = Eagle3Drafter.load(h, model, bits=bits)
    if not model.params.numerics.native or not fx_native.supports(32, bits):
        pytest.skip("native kernels unavailable: the head stays as stored")
    assert drafter.head.lm_head.quantized and drafter.head.layer.qkv.quantized
    assert drafter.head.lm_head.quant.bits == bits and drafter.head.numerics.native
    prompt = [5, 9, 17, 40, 30]
    ref = reference_generate(model, prompt, max_tokens=20, temperature=0.0)
    got = fx_engine.generate(model, prompt, max_tokens=20, temperature=0.0, draft_model=drafter, num_draft_tokens=3)
    assert got.token_ids == ref.token_ids and got.usage.accepted_tokens > 0
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        Eagle3Drafter.load(h, model, bits=3)


@pytest.mark.parametrize("bits", [None, 8])
def test_a_quantized_target_in_the_8bit_mode_drafts(tmp_path, bits, steady_policy):
    """A 4-bit target loaded with numerics="int8" (its matrices, head included, in qmm_a8's
    interleaved layout): the head (its own lm_head; as stored, or quantized at load and run
    in the target's numerics) drafts from the target's states and embeddings, the echo
    head's first drafts still right, and the output is the int8 target's own greedy output."""
    t, h = write_echo_pair(tmp_path)
    model = drafter_checks.int8_target(drafter_checks.quantize_checkpoint(t, bits=4))
    drafter = Eagle3Drafter.load(h, model, bits=bits)
    if bits is not None:
        assert drafter.head.lm_head.quantized and drafter.head.numerics == model.params.numerics
    drafter_checks.accepted_and_rejected_drafts_keep_greedy_output(model, drafter, 3)


def test_a_tied_quantized_target_in_the_8bit_mode_drafts(tmp_path, steady_policy):
    """The head looks its tokens up in the target's embedding table, which a tied int8
    target keeps interleaved (it is the head): the drafted output is the target's own."""
    from fx_engine.testing import write_tiny_model

    folder = write_tiny_model(tmp_path / "tied", "llama", num_hidden_layers=6)
    model = drafter_checks.int8_target(drafter_checks.quantize_checkpoint(folder, bits=4))
    assert model.params.lm_head is None
    drafter = Eagle3Drafter.load(write_tiny_eagle3(tmp_path / "h", 64, seed=3, **HEAD), model)
    drafter_checks.greedy_output_is_identical(model, drafter, ((9, 4), (40, 2)), max_tokens=16)
