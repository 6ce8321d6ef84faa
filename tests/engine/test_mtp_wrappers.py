"""Qwen3.5 checkpoints as Hugging Face ships them (config.json model_type "qwen3_5" /
"qwen3_5_moe" with text_config; the text model under model.language_model.*, its MTP module
under mtp.*) drafting with `draft_model="mtp"` end to end: the wrapper target loads (the
module tensors are not the text model's), the drafter reads the module from the same
folder, greedy output is the plain one with a random module (drafts rejected) and with one
built to agree (every draft accepted, chained ones too); `fx-engine info`'s line."""

from __future__ import annotations

import pytest

import fx_engine
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.mtp_drafter import MtpDrafter
from fx_engine.loading.drafter import mtp_summary
from tests.engine.mtp_targets import write_qwen3_5_wrapper_target

PROMPT = [5, 9, 17, 40, 30, 77, 12, 100, 3, 40]  # (ends away from the EOS pair: the agreeing target alternates)
WRAPPERS = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    out = {}
    for wrapper in WRAPPERS:
        for agree in (False, True):
            folder = write_qwen3_5_wrapper_target(tmp_path_factory.mktemp(wrapper) / "t", wrapper, seed=3, agree=agree)
            out[wrapper, agree] = fx_engine.load(folder, batch_invariant=True)
    return out


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_target_loads_and_its_module_is_found(models, wrapper):
    model = models[wrapper, False]
    assert model.config.qwen3_5 and model.config.model_type == f"{wrapper}_text"
    drafter = MtpDrafter.from_model(model)
    assert drafter.config.kind == "qwen3_next" and drafter.config.num_modules == 1
    assert drafter.config.layer.qwen3_5 and drafter.capture.normed
    assert mtp_summary(model.path) == ("1 MTP module (Qwen3-Next / Qwen3.5 format, from mtp.layers.0.*); "
                                       "--draft-model mtp drafts with it")


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_mtp_keeps_greedy_output(models, wrapper, k, steady_policy):
    for agree in (False, True):
        model = models[wrapper, agree]
        ref = reference_generate(model, PROMPT, max_tokens=16, temperature=0.0)
        got = fx_engine.generate(model, PROMPT, max_tokens=16, temperature=0.0, draft_model="mtp",
                                 num_draft_tokens=k)
        assert got.token_ids == ref.token_ids and len(ref.token_ids) == 16, agree
        assert got.usage.drafter == "mtp" and got.usage.drafted_tokens > 0
        if agree:
            assert got.usage.accepted_tokens == got.usage.drafted_tokens


def test_tied_embeddings(tmp_path, steady_policy):
    """A wrapper whose text model ties its output head to the embeddings (no lm_head): the
    module reads the target's tied table as its head."""
    model = fx_engine.load(write_qwen3_5_wrapper_target(tmp_path / "t", seed=4, tied=True), batch_invariant=True)
    assert model.params.lm_head is None
    ref = reference_generate(model, PROMPT, max_tokens=12, temperature=0.0)
    got = fx_engine.generate(model, PROMPT, max_tokens=12, temperature=0.0, draft_model="mtp", num_draft_tokens=2)
    assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_batched_rows_with_and_without_the_module(models, wrapper, steady_policy):
    """Rows drafting with the module next to plain rows (the target's linear-attention
    states roll back with its verifies): each request's tokens are its greedy run alone."""
    model = models[wrapper, True]
    prompts = [PROMPT, PROMPT[2:] + [8, 50], PROMPT[:5] + [60]]
    alone = [reference_generate(model, p, max_tokens=12, temperature=0.0).token_ids for p in prompts]
    engine = fx_engine.Engine(model, max_rows=3, prefill_chunk=8)
    hs = []
    for i, p in enumerate(prompts):  # (joining one step apart)
        hs.append(engine.submit(p, max_tokens=12, temperature=0.0,
                                **({"draft_model": "mtp", "num_draft_tokens": 2} if i != 1 else {})))
        engine.step()
    results = [h.result() for h in hs]
    engine.close()
    assert [r.token_ids for r in results] == alone
    assert results[0].usage.accepted_tokens > 0
