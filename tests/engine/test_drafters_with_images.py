"""Learned drafters on image prompts (issue 46 item 3: speculation composes): an EAGLE-3 head
drafting for a tiny Idefics3 target (its Llama text model) reads the target states that the
prefill steps capture with the image rows spliced in, pieces cutting the images. Greedy
output equals the plain run (the reference loop, no drafter), also batched with a text row;
the head's cache holds the pairs (captured state at t, token t + 1) of a forward with the
images, not of one over the placeholder tokens' embeddings."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.cache import init_cache
from fx_engine.core.drafters import eagle3
from fx_engine.core.nn import embed
from fx_engine.core.steps import prefill_step
from fx_engine.engine.eagle3_drafter import Eagle3Drafter
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.image_prompt import image_prompt, step_images
from fx_engine.testing.eagle3 import write_tiny_eagle3
from fx_engine.testing.vision import write_tiny_idefics3
from tests.engine.drafter_checks import RecordsRows
from tests.models.vision_checks import messages, png

HEAD = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=384,
            draft_vocab_size=128, intermediate_size=96, eagle_aux_hidden_state_layer_ids=[0, 1, 1])


class Recording(RecordsRows, Eagle3Drafter):
    """The drafter, keeping its rows (to look at a row's head after generation)."""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A batch-invariant Idefics3 target (verify and decode give bitwise-equal logits) and a
    random head over its 64-wide text model."""
    target = fx_engine.load(str(write_tiny_idefics3(tmp_path_factory.mktemp("idefics3") / "m")), batch_invariant=True)
    head = Recording.load(write_tiny_eagle3(tmp_path_factory.mktemp("head") / "h", 64, seed=5, **HEAD), target)
    return target, head


def test_greedy_output_is_the_plain_one_alone_and_batched_with_a_text_row(pair):
    model, head = pair
    prompts = [messages(png(3, (48, 40))), [{"role": "user", "content": "a text request beside it"}],
               messages(png(4, (30, 60)))]
    plain = [reference_generate(model, p, max_tokens=16, temperature=0.0).token_ids for p in prompts]
    alone = fx_engine.generate(model, prompts[0], max_tokens=16, temperature=0.0, draft_model=head,
                               num_draft_tokens=3, prefill_chunk=10)
    assert alone.token_ids == plain[0] and alone.usage.drafted_tokens > 0
    with fx_engine.Engine(model, max_rows=3, prefill_chunk=12) as engine:
        hs = [engine.submit(p, max_tokens=16, temperature=0.0, draft_model=head, num_draft_tokens=2)
              for p in prompts]
        done = [h.result() for h in hs]
    assert [d.token_ids for d in done] == plain
    assert all(d.usage.drafted_tokens > 0 for d in done)


def test_the_heads_cache_holds_the_states_of_the_forward_with_the_images(pair):
    model, head = pair
    head.rows.clear()
    msgs = messages(png(7, (48, 40)))
    got = fx_engine.generate(model, msgs, max_tokens=12, temperature=0.0, draft_model=head, num_draft_tokens=2,
                             prefill_chunk=10)
    (row,) = head.rows
    assert row.broken is None
    ip = image_prompt(model, msgs)
    seq = list(ip.ids) + list(got.token_ids)
    f = row.fed
    assert f > ip.spans[-1][1]  # the head was fed past the image tokens

    def fed_from(images):
        _, _, states = prefill_step(model.params, model.new_cache(1, 512, headroom=256), mx.array([seq], mx.int32),
                                    mx.array([len(seq)], mx.int32), capture=head.capture, **images)
        cache = init_cache(eagle3.cache_specs(head.head.config), 1, 512)
        return eagle3.eagle3_forward(head.head, embed(mx.array([seq[1: f + 1]]), head.table), states[:, :f], cache,
                                     mx.array([f], mx.int32))[2]

    holder = type("R", (), {"image": ip})()  # (the image rows of the whole sequence: prompt and reply)
    with_images = fed_from({"images": step_images([(holder, 0, len(seq))], model.vision.config.image_token_index)})
    placeholders = fed_from({})
    have = row.cache
    k_have, k_img, k_txt = (np.array(c.keys[0][:, :, :f]) for c in (have, with_images, placeholders))
    np.testing.assert_allclose(k_have, k_img, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(have.values[0][:, :, :f]), np.array(with_images.values[0][:, :, :f]),
                               rtol=1e-5, atol=1e-5)
    assert np.abs(k_have - k_txt).max() > 1e-2  # (the images' states are not the placeholders')
