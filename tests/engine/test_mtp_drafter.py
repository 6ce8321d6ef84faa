"""MTP modules shipped in target checkpoints drafting inside the engine
(fx_engine.engine.mtp_drafter): tiny targets whose checkpoint holds the module where the real
ones do (DeepSeek-V3 and GLM-4.5: model.layers.{N}.*; Qwen3-Next, a hybrid recurrent target:
mtp.*; GLM-4.5's GGUF: blk.{N}.nextn.*) load and draft; greedy output identical with and
without the module (random modules: drafts rejected; an "echo" module whose first draft is
always right and chained ones wrong: accepted and rejected drafts in every verify), batched
rows equal to each request alone, the module's cache after rollbacks equal to a module fed
the accepted sequence from scratch, no steady-state recompiles, grammars and sampled rows
composing, `draft_model="mtp"`, the refusals, and the command line's flag and info line."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import mlx.core as mx
import pytest

import fx_engine
from tests.engine import drafter_checks
from fx_engine.core.checkpoint import WeightsError
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import mtp
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.mtp_drafter import MtpDrafter, mtp_drafter_for
from fx_engine.testing.mtp import write_mtp_echo_target, write_mtp_target


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """kind -> (target, its drafter): tiny targets of the three families the engine loads,
    each with a random MTP module in its checkpoint; batch-invariant (verify and decode give
    bitwise-equal logits, so greedy identity is exact)."""
    out = {}
    for kind in ("deepseek_v3", "glm4_moe", "qwen3_next"):
        model = fx_engine.load(write_mtp_target(tmp_path_factory.mktemp(kind) / kind, kind, seed=3),
                               batch_invariant=True)
        out[kind] = (model, MtpDrafter.from_model(model))
    return out


class Recording(drafter_checks.RecordsRows, MtpDrafter):
    """The drafter, keeping its rows (to look at a row's module cache after generation)."""


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    """(target, drafter) of `write_mtp_echo_target`: first drafts right, chained drafts wrong."""
    model = fx_engine.load(write_mtp_echo_target(tmp_path_factory.mktemp("echo") / "t"), batch_invariant=True)
    return model, Recording.from_model(model)


_prompt = drafter_checks.prompt


@pytest.mark.parametrize("kind", ["deepseek_v3", "glm4_moe", "qwen3_next"])
def test_greedy_output_is_identical_with_a_random_module(targets, kind):
    """Qwen3-Next's linear-attention layers roll their recurrent state back with the verify,
    the module's attention cache by length: the output is the plain one."""
    model, drafter = targets[kind]
    assert drafter.kind == "mtp" and drafter.capture == mtp.target_capture(drafter.config, model.config.num_layers)
    got = drafter_checks.greedy_output_is_identical(model, drafter, ((9, 4), (40, 2)), max_tokens=16)
    assert all(r.usage.drafter == "mtp" for r in got)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_accepted_and_rejected_drafts_keep_greedy_output(echo, k, steady_policy):
    drafter_checks.accepted_and_rejected_drafts_keep_greedy_output(*echo, k)


@pytest.mark.parametrize("which", ["echo", "tied"])
def test_a_quantized_target_in_the_8bit_mode_drafts(which, tmp_path, steady_policy):
    """A 4-bit target loaded with numerics="int8" keeps its head (lm_head, or the embedding
    table it is tied to) in qmm_a8's interleaved layout; the module reads that head (and,
    tied, looks its embeddings up in it) and runs in the target's numerics: it drafts (the
    echo module's first drafts still right), and the output is the int8 target's own greedy
    output."""
    if which == "echo":
        folder = write_mtp_echo_target(tmp_path / "echo")
    else:
        folder = write_mtp_target(tmp_path / "tied", "glm4_moe", seed=5, tie_word_embeddings=True)
    model = drafter_checks.int8_target(drafter_checks.quantize_checkpoint(folder, bits=4))
    drafter = MtpDrafter.from_model(model)
    assert drafter.module.numerics == model.params.numerics
    assert drafter.module.modules[0].proj.quantized and not drafter.module.modules[0].proj.interleaved
    if which == "echo":
        drafter_checks.accepted_and_rejected_drafts_keep_greedy_output(model, drafter, 3)
    else:
        assert model.params.lm_head is None
        drafter_checks.greedy_output_is_identical(model, drafter, ((9, 4), (40, 2)), max_tokens=16)


def test_the_modules_cache_after_rollbacks_is_a_module_fed_the_accepted_sequence(echo, steady_policy):
    """After a generation full of rejected chained drafts, the row's module holds exactly
    the pairs (the target's captured state at t, token t + 1) of the accepted sequence: its
    latent K/V equal those of a fresh module fed the final sequence's pairs in one step."""
    model, drafter = echo

    def fresh(seq, f, states):
        return mtp.mtp_forward(drafter.module, drafter.tables, states[:, :f], mx.array([seq[1: f + 1]]),
                               drafter.new_cache(64), mx.array([f], mx.int32))[2]

    drafter_checks.cache_after_rollbacks_is_fed_the_accepted_sequence(model, drafter, fresh)


@pytest.mark.parametrize("which", ["random", "echo", "qwen3_next"])
def test_batched_rows_equal_each_request_alone(targets, echo, which, steady_policy):
    """Rows with the module, without a drafter and with prompt lookup, joining one step
    apart, share prefill, decode and verify steps: every request's tokens equal its plain
    greedy run alone."""
    model, drafter = {"random": targets["deepseek_v3"], "echo": echo, "qwen3_next": targets["qwen3_next"]}[which]
    drafter_checks.batched_rows_equal_each_request_alone(model, drafter, max_tokens=16, echo=which == "echo")


def test_long_prompts_feed_the_module_in_pieces(echo, steady_policy):
    """A prompt longer than FLUSH_AT, prefilled in small chunks, feeds the module early (in
    bounded pieces); a second request sharing its prefix does not restore it (the module
    needs every position's state) and drafts as well."""
    drafter_checks.long_prompts_feed_in_pieces(*echo, max_tokens=10, prefill_chunk=64)


def test_a_rows_states_feed_early_replace_on_overlap_and_stop_at_a_gap(echo):
    drafter_checks.rows_feed_early_replace_on_overlap_and_stop_at_a_gap(*echo)


def test_grammars_and_sampled_rows_compose(echo, steady_policy):
    model, drafter = echo
    drafter_checks.grammars_and_sampled_rows_compose(model, drafter)


def test_no_recompiles_in_steady_state(echo, steady_policy):
    model, drafter = echo
    drafter_checks.no_recompiles_in_steady_state(model, drafter, mtp.mtp_step_compiled)


def test_draft_model_mtp_names_the_checkpoints_own_module(echo, tiny_folder):
    model, _ = echo
    first = mtp_drafter_for(model)
    assert mtp_drafter_for(model) is first  # built once per model
    assert mtp_drafter_for(model.with_max_context(512)) is first  # (its variants share the params)
    ref = reference_generate(model, [5, 9, 17, 40], max_tokens=12, temperature=0.0)
    got = fx_engine.generate(model, [5, 9, 17, 40], max_tokens=12, temperature=0.0, draft_model="mtp")
    assert got.token_ids == ref.token_ids and got.usage.accepted_tokens > 0 and got.usage.drafter == "mtp"
    with fx_engine.Engine(model, max_rows=2) as engine:
        h = engine.submit([5, 9, 17, 40], max_tokens=12, temperature=0.0, draft_model="mtp")
        assert h.result().token_ids == ref.token_ids
    with pytest.raises(ValueError, match="the one name it takes is 'mtp'"):
        fx_engine.generate(model, [5, 9], max_tokens=2, draft_model="eagle")
    llama = fx_engine.load(tiny_folder("llama"))
    with pytest.raises(ConfigError, match="ships no MTP module fx-engine can draft with .*model_type 'llama'"):
        fx_engine.generate(llama, [5, 9], max_tokens=2, draft_model="mtp")


def test_refusals(targets, echo, tmp_path):
    model, drafter = targets["deepseek_v3"]
    with pytest.raises(ValueError, match="tensor / pipeline parallelism"):
        MtpDrafter(drafter.module, None, attrs.evolve(model, tensor_parallel=2))
    with pytest.raises(ValueError, match="tensor / pipeline parallelism"):
        MtpDrafter(drafter.module, None, attrs.evolve(model, pipeline_parallel=2))
    # a module of another family or size than the target
    glm, _ = targets["glm4_moe"]
    with pytest.raises(ConfigError, match="DeepSeek-V3 format cannot draft for a glm4_moe target"):
        MtpDrafter.load(model.path, glm)
    # a config that declares a module its weights do not hold (mlx-lm's conversions drop it)
    folder = write_mtp_target(tmp_path / "dropped", "deepseek_v3", seed=5)
    w = {n: a for n, a in mx.load(str(folder / "model.safetensors")).items() if not n.startswith("model.layers.3.")}
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    dropped = fx_engine.load(folder)
    with pytest.raises(WeightsError, match=r"declares 1 MTP module but its weights hold no tensor under "
                                           r"'model.layers.3.\*' \(mlx-lm's conversions"):
        MtpDrafter.from_model(dropped)
    from fx_engine.loading.drafter import mtp_summary

    assert "but the weights do not hold it (dropped at conversion)" in mtp_summary(folder)
    # a config without modules
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(ConfigError, match=f"{folder}: the checkpoint ships no MTP module .*"
                                          "'num_nextn_predict_layers' = 0"):
        MtpDrafter.load(folder, dropped)


def test_glm4moe_gguf_nextn_layer_drafts_as_the_safetensors_one(targets, tmp_path):
    """llama.cpp's glm4moe GGUF keeps the MTP layer as blk.{N}.nextn.* with the layer's usual
    tensors: a drafter read from it (only those tensors converted) drafts what the drafter
    read from the safetensors folder drafts."""
    from fx_engine.loading.drafter import mtp_summary
    from fx_engine.testing.mtp import write_glm4moe_mtp_gguf

    model, from_folder = targets["glm4_moe"]
    cfg = json.loads((Path(model.path) / "config.json").read_text())
    tensors = dict(mx.load(str(Path(model.path) / "model.safetensors")))
    mine = {n: a for n, a in tensors.items() if n.startswith("model.layers.3.") or not n.startswith("model.layers.")}
    path = write_glm4moe_mtp_gguf(tmp_path / "m.gguf", cfg, mine)
    from_gguf = MtpDrafter.load(path, model)
    assert mtp_summary(path) == ("1 MTP (NextN) layer (glm4moe, from blk.3.nextn.*); published alone (no "
                                 f"trunk): --draft-model {path} drafts with it beside its target")
    _drafts_alike(model, from_folder, from_gguf)


def _drafts_alike(model, from_folder, from_gguf):
    """Both drafters keep the target's greedy output while drafting, and draft the same
    tokens from the same captured states; returns those states."""
    prompt = _prompt(model, 20, offset=4)
    ref = reference_generate(model, prompt, max_tokens=10, temperature=0.0)
    for d in (from_folder, from_gguf):
        got = fx_engine.generate(model, prompt, max_tokens=10, temperature=0.0, draft_model=d, num_draft_tokens=3)
        assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0
    states = mx.random.normal((12, model.config.hidden_size), key=mx.random.key(1))
    rows = [d.new_row([], None) for d in (from_folder, from_gguf)]
    for r in rows:
        r.observe(0, states)
    drafts = [r.propose(prompt[:13], 3).tokens for r in rows]
    assert len(drafts[0]) == 3 and drafts[0] == drafts[1]
    return states, prompt


@pytest.mark.parametrize("split_kv_b", [True, False])
def test_deepseek2_gguf_nextn_layer_drafts_as_the_safetensors_one(targets, tmp_path, split_kv_b):
    """llama.cpp's deepseek2 GGUF keeps the MTP layer (GLM-4.7-Flash, DeepSeek V3.2; an
    MTP-only file holds it alone): a drafter read from it (kv_b split or whole) drafts what
    the drafter read from the safetensors folder drafts (and the same logits)."""
    from fx_engine.loading.drafter import mtp_summary
    from fx_engine.testing.mtp import write_deepseek2_mtp_gguf

    model, from_folder = targets["deepseek_v3"]
    cfg = json.loads((Path(model.path) / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    tensors = dict(mx.load(str(Path(model.path) / "model.safetensors")))
    mine = {k: a for k, a in tensors.items() if k.startswith(f"model.layers.{n}.") or not k.startswith("model.layers.")}
    path = write_deepseek2_mtp_gguf(tmp_path / "m.gguf", cfg, mine, split_kv_b=split_kv_b)
    from_gguf = MtpDrafter.load(path, model)
    assert mtp_summary(path).startswith(f"1 MTP (NextN) layer (deepseek2, from blk.{n}.nextn.*); published alone")
    states, prompt = _drafts_alike(model, from_folder, from_gguf)
    logits = [mtp.draft_chain(d.module, d.tables, states[None, :4], mx.array([prompt[1:5]]),
                              d.new_cache(16), mx.array([4]), 1)[1] for d in (from_folder, from_gguf)]
    assert mx.allclose(logits[0], logits[1], rtol=1e-5, atol=1e-5).item()


def test_command_line_flag_and_info_line(tmp_path, capsys):
    """--draft-model mtp drafts with the checkpoint's own module (the same text as without
    it, drafts accepted); `fx-engine info --model` names the module it ships."""
    from fx_engine.cli import main

    target = write_mtp_echo_target(tmp_path / "echo")
    base = ["generate", "hello there", "--raw", "--model", str(target), "--max-tokens", "16"]
    assert main(base) == 0
    plain = capsys.readouterr()
    assert main([*base, "--draft-model", "mtp"]) == 0
    drafted = capsys.readouterr()
    assert drafted.out == plain.out
    assert "drafts accepted" in drafted.err and "drafts accepted 0/" not in drafted.err
    assert main(["info", "--model", str(target)]) == 0
    out = capsys.readouterr().out
    assert ("speculative modules: 1 MTP module (DeepSeek-V3 format, from model.layers.3.*); "
            "--draft-model mtp drafts with it") in out


def _trunk_only(target, folder):
    """The target as a conversion that dropped its MTP layer (mlx-lm's, llama.cpp's
    --no-mtp): the same config, the module's tensors gone."""
    import shutil

    shutil.copytree(target, folder)
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    w = {k: a for k, a in mx.load(str(folder / "model.safetensors")).items()
         if not k.startswith(f"model.layers.{n}.")}
    mx.save_safetensors(str(folder / "model.safetensors"), w, metadata={"format": "mlx"})
    return folder


def test_a_module_published_alone_drafts_from_the_command_line(tmp_path, capsys):
    """--draft-model FOLDER with SGLang's NextN export of the module (the layer renamed to
    layer 0, the tables left out), and its FP8 copy (the published exports are DeepSeek-V3's
    FP8 blocks), for a target whose own checkpoint dropped the module (--draft-model mtp is
    refused there): the same text as without a draft, drafts accepted."""
    from fx_engine.cli import main
    from fx_engine.loading.drafter import is_mtp_checkpoint
    from fx_engine.testing.fp8 import write_fp8_folder
    from fx_engine.testing.mtp import write_nextn_export

    full = write_mtp_echo_target(tmp_path / "echo")
    trunk = _trunk_only(full, tmp_path / "trunk")
    export = write_nextn_export(full, tmp_path / "nextn")
    write_fp8_folder(export, tmp_path / "nextn-fp8", (32, 32))
    assert is_mtp_checkpoint(export) and not is_mtp_checkpoint(full) and not is_mtp_checkpoint(trunk)
    base = ["generate", "hello there", "--raw", "--model", str(trunk), "--max-tokens", "16"]
    assert main(base) == 0
    plain = capsys.readouterr()
    assert main([*base, "--draft-model", "mtp"]) != 0
    assert "weights hold no tensor" in capsys.readouterr().err
    for draft in (export, tmp_path / "nextn-fp8"):
        assert main([*base, "--draft-model", str(draft)]) == 0
        drafted = capsys.readouterr()
        assert drafted.out == plain.out
        assert "drafts accepted" in drafted.err and "drafts accepted 0/" not in drafted.err
    assert main(["info", "--model", str(export)]) == 0
    assert ("speculative modules: 1 MTP module (DeepSeek-V3 format, from model.layers.0.*); published alone "
            f"(no trunk): --draft-model {export} drafts with it beside its target") in capsys.readouterr().out


def test_an_mtp_only_gguf_is_told_from_a_model(targets, tmp_path):
    """A GGUF declaring NextN layers and holding no trunk layer (llama.cpp's --mtp file) is a
    drafter's checkpoint; one holding the trunk's layers is a model."""
    from fx_engine.loading.drafter import is_mtp_checkpoint
    from fx_engine.testing.mtp import write_glm4moe_mtp_gguf

    model, _ = targets["glm4_moe"]
    cfg = json.loads((Path(model.path) / "config.json").read_text())
    tensors = dict(mx.load(str(Path(model.path) / "model.safetensors")))
    mine = {n: a for n, a in tensors.items() if n.startswith("model.layers.3.") or not n.startswith("model.layers.")}
    assert is_mtp_checkpoint(write_glm4moe_mtp_gguf(tmp_path / "m.gguf", cfg, mine))
    with_trunk = {n: a for n, a in tensors.items() if n.startswith(("model.layers.0.", "model.layers.3."))}
    assert not is_mtp_checkpoint(write_glm4moe_mtp_gguf(tmp_path / "t.gguf", cfg, with_trunk))
    assert not is_mtp_checkpoint(tmp_path / "missing.gguf")


@pytest.mark.oracle  # (the adapter is made by mlx-lm's own LoRA layers: tools/oracle.py)
def test_adapters_compose(tmp_path, steady_policy):
    """A request on a LoRA adapter drafts from the adapted target's captured states; its
    output is the adapted target's greedy output (and the base rows beside it the base's)."""
    from fx_engine.loading.adapters import AdapterSet
    from tools.oracle import write_mlx_lm_adapter

    from fx_engine.testing import write_tiny_model

    path = write_mtp_target(tmp_path / "ds", "deepseek_v3", seed=7)
    model = attrs.evolve(fx_engine.load(path, batch_invariant=True), adapters=AdapterSet())
    # (mlx-lm's loader refuses the MTP layer's tensors: the adapter is made on the same trunk without them)
    trunk = write_tiny_model(tmp_path / "trunk", "deepseek_v3", seed=7, num_nextn_predict_layers=1)
    adapter = write_mlx_lm_adapter(trunk, tmp_path / "ad", rank=4, scale=3.0, num_layers=3, init_scale=0.2, seed=1,
                                   keys=["self_attn.o_proj", "self_attn.q_b_proj"])
    fx_engine.load_adapter(model, adapter, name="ft")
    drafter = MtpDrafter.from_model(model)
    prompt = _prompt(model, 30, offset=7)
    engine = fx_engine.Engine(model, max_rows=2, prefill_chunk=16)
    tuned = engine.submit(prompt, max_tokens=12, temperature=0.0, adapter="ft", draft_model=drafter)
    base = engine.submit(prompt, max_tokens=12, temperature=0.0, draft_model=drafter)
    tuned, base = tuned.result(), base.result()
    engine.close()
    want = reference_generate(model, prompt, max_tokens=12, temperature=0.0, adapter="ft").token_ids
    assert tuned.token_ids == want
    assert base.token_ids == reference_generate(model, prompt, max_tokens=12, temperature=0.0).token_ids
    assert tuned.token_ids != base.token_ids and tuned.usage.drafted_tokens > 0
