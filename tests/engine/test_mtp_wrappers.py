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


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_gguf_module_drafts_as_the_folders(models, wrapper, tmp_path, steady_policy):
    """The checkpoint converted as llama.cpp's converter writes qwen35 / qwen35moe (the
    module at blk.{N}.nextn.* and blk.{N}.*, norms as 1 + w; testing.gguf's writer):
    `draft_model="mtp"` on the GGUF target reads its module, which drafts what the folder's
    drafts; greedy output kept, and with the agreeing target every draft accepted."""
    import mlx.core as mx

    from fx_engine.testing.gguf import write_qwen3_next_gguf

    for agree in (False, True):
        folder_model = models[wrapper, agree]
        path = write_qwen3_next_gguf(folder_model.path, tmp_path / f"{agree}.gguf")
        assert mtp_summary(path) == (f"1 MTP (NextN) layer ({wrapper.replace('_', '')}, from blk.4.nextn.*); "
                                     "--draft-model mtp drafts with it")
        model = fx_engine.load(path, batch_invariant=True)
        ref = reference_generate(model, PROMPT, max_tokens=16, temperature=0.0)
        got = fx_engine.generate(model, PROMPT, max_tokens=16, temperature=0.0, draft_model="mtp", num_draft_tokens=3)
        assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0
        if agree:
            assert got.usage.accepted_tokens == got.usage.drafted_tokens
        drafters = [MtpDrafter.from_model(m) for m in (folder_model, model)]
        states = mx.random.normal((12, model.config.hidden_size), key=mx.random.key(1))
        rows = [d.new_row([], None) for d in drafters]
        for r in rows:
            r.observe(0, states)
        drafts = [r.propose(PROMPT + [7, 8, 9], 3).tokens for r in rows]
        assert len(drafts[0]) == 3 and drafts[0] == drafts[1], agree


def test_mtp_only_gguf_from_the_command_line(tmp_path, capsys):
    """llama.cpp's split of a Qwen3.5 checkpoint into a trunk GGUF (--no-mtp) and an MTP-only
    one (--mtp-only: the module with the tables, no trunk layer): `--draft-model mtp-only.gguf`
    drafts beside the trunk (the same text as without, every draft accepted with the
    agreeing module); `--draft-model mtp` is refused on the trunk; `fx-engine info` says the
    file is published alone."""
    from fx_engine.cli import main
    from fx_engine.loading.drafter import is_mtp_checkpoint
    from fx_engine.testing.gguf import write_qwen3_next_gguf

    folder = write_qwen3_5_wrapper_target(tmp_path / "t", seed=3, agree=True)
    trunk = write_qwen3_next_gguf(folder, tmp_path / "trunk.gguf", mtp="none")
    alone = write_qwen3_next_gguf(folder, tmp_path / "mtp-only.gguf", mtp="only")
    assert is_mtp_checkpoint(alone) and not is_mtp_checkpoint(trunk)
    base = ["generate", "hello there", "--raw", "--model", str(trunk), "--max-tokens", "16"]
    assert main(base) == 0
    plain = capsys.readouterr()
    assert main([*base, "--draft-model", "mtp"]) != 0
    capsys.readouterr()
    assert main([*base, "--draft-model", str(alone)]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    assert "drafts accepted" in drafted.err and "drafts accepted 0/" not in drafted.err
    assert main(["info", "--model", str(alone)]) == 0
    assert (f"1 MTP (NextN) layer (qwen35, from blk.4.nextn.*); published alone (no trunk): --draft-model {alone} "
            "drafts with it beside its target") in capsys.readouterr().out
