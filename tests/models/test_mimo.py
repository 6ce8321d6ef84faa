"""MiMo (XiaomiMiMo/MiMo-7B-*: config.json model_type "mimo", MiMoForCausalLM) as a target: a
Qwen2 trunk (q/k/v biases) whose checkpoint also holds num_nextn_predict_layers MTP modules
under model.mtp_layers.{k}.*. The trunk loads in the llama family (the module tensors left
for the drafter), its logits equal mlx-lm's mimo class, `draft_model="mtp"` drafts with
its module (greedy output unchanged; every draft accepted with a module built to agree), the
captured target state is the stream before the final norm (as vLLM's MiMoModel returns
it) and the module's first draft on it is the float64 reference's; `fx-engine info` lists
the modules."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

import fx_engine
from fx_engine.core.config import ConfigError
from fx_engine.core.drafters import mtp
from fx_engine.core.models import config_from_hf, model_types
from fx_engine.engine.generate import reference_generate
from fx_engine.engine.mtp_drafter import MtpDrafter
from fx_engine.loading.drafter import load_mtp_module, mtp_summary
from fx_engine.testing.mtp import reference_step
from tests.conftest import LONG_TEXT
from tests.engine.mtp_targets import write_mimo_target

PROMPT = [5, 9, 17, 40, 30, 77, 12, 100, 3, 40]  # (ends away from the EOS pair: the agreeing target alternates)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("mimo")
    return {"random": write_mimo_target(base / "random", seed=3),
            "agree": write_mimo_target(base / "agree", seed=3, agree=True),
            "two": write_mimo_target(base / "two", seed=5, modules=2)}


def test_mimo_is_a_registered_qwen2_trunk(folders):
    assert model_types()["mimo"] == "llama"
    d = json.loads((folders["random"] / "config.json").read_text())
    cfg = config_from_hf(d)
    assert (cfg.model_type, cfg.qkv_bias, cfg.o_bias, cfg.rope_theta) == ("mimo", True, False, 640000.0)
    # the RoPE base when unsaid: Hugging Face's MiMoConfig (and mlx-lm's) 1e4, not Qwen2's 1e6
    assert config_from_hf({k: v for k, v in d.items() if k != "rope_theta"}).rope_theta == 10000.0
    # the MTP modules' decoder layers: the same Qwen2 layer config
    layer = mtp.config_from_hf(d).layer
    assert (layer.qkv_bias, layer.o_bias, layer.rope_theta, layer.num_layers) == (True, False, 640000.0, 1)
    mtp.check_target(mtp.config_from_hf(d), cfg)
    with pytest.raises(ConfigError, match="MiMo format cannot draft for a qwen2 target"):
        mtp.check_target(mtp.config_from_hf(d), config_from_hf({**d, "model_type": "qwen2"}))


@pytest.mark.oracle
def test_logits_and_greedy_tokens_match_mlx_lm(folders):
    """mlx-lm's mimo class (its sanitize drops model.mtp_layers.*) on the folder with the
    module tensors: teacher-forced logits and greedy tokens equal."""
    from mlx_lm.utils import load_model

    from tests.models.test_parity import _compare, assert_greedy_matches_mlx_lm

    path = folders["random"]
    model = fx_engine.load(path)
    ref, _ = load_model(path)
    ref.set_dtype(mx.float32)
    ids = model.tokenizer.encode(LONG_TEXT)[:80]
    want = ref(mx.array([ids]))[0]
    for chunk in (8, 40):
        _compare(fx_engine.logits(model, ids, chunk=chunk), want)
    assert_greedy_matches_mlx_lm(path, model, ids[:45])


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_mtp_keeps_greedy_output(folders, k, steady_policy):
    for which in ("random", "agree"):
        model = fx_engine.load(folders[which], batch_invariant=True)
        ref = reference_generate(model, PROMPT, max_tokens=16, temperature=0.0)
        got = fx_engine.generate(model, PROMPT, max_tokens=16, temperature=0.0, draft_model="mtp",
                                 num_draft_tokens=k)
        assert got.token_ids == ref.token_ids and len(ref.token_ids) == 16, which
        assert got.usage.drafter == "mtp" and got.usage.drafted_tokens > 0
        if which == "agree":  # every draft right, chained ones too (module 0 on its own normed output)
            assert got.usage.accepted_tokens == got.usage.drafted_tokens


def test_captured_state_is_the_stream_before_the_final_norm(folders):
    """The drafter captures boundary N (vLLM's MiMoModel returns hidden_states + residual,
    before its norm): the module's first draft on the target's own captured states is the
    float64 reference's."""
    from fx_engine.core.cache import init_cache
    from fx_engine.core.steps import prefill_step

    path = folders["random"]
    model = fx_engine.load(path)
    d = json.loads((path / "config.json").read_text())
    drafter = MtpDrafter.from_model(model)
    n = d["num_hidden_layers"]
    assert drafter.capture == mtp.target_capture(drafter.config, n) and drafter.capture.layers == (n,)
    toks = mx.array([[5, 9, 17, 40, 3, 77, 12]], mx.int32)
    _, _, states = prefill_step(model.params, model.new_cache(1, 16), toks, mx.array([7], mx.int32),
                                capture=drafter.capture)
    # not the normed state: the final norm's weight is random here
    final = np.asarray(states[0, -1]) / np.sqrt((np.asarray(states[0, -1]) ** 2).mean() + d["rms_norm_eps"])
    assert np.abs(final * np.asarray(model.params.norm) - np.asarray(states[0, -1])).max() > 1e-2
    hidden, nxt = states[:, :6], toks[:, 1:]
    ids, lgs, _, _ = mtp.draft_chain(drafter.module, drafter.tables, hidden, nxt,
                                     init_cache(mtp.cache_specs(drafter.config), 1, 16), mx.array([6]), 1)
    w = dict(mx.load(str(path / "model.safetensors")))
    want = reference_step("mimo", d, w, np.asarray(hidden, np.float64), np.asarray(nxt), np.arange(6)[None])
    np.testing.assert_allclose(np.asarray(lgs[:, 0]), want["logits"][:, -1], rtol=2e-4, atol=2e-4)


def test_checkpoint_with_two_modules_loads_both_and_info_lists_them(folders, capsys):
    from fx_engine.cli import main

    path = folders["two"]
    model = fx_engine.load(path)
    p = load_mtp_module(path, model)
    assert p.config.num_modules == 2 and len(p.modules) == 2
    line = "2 MTP modules (MiMo format, from model.mtp_layers.0.*); --draft-model mtp drafts with it"
    assert mtp_summary(path) == line
    assert main(["info", "--model", str(path)]) == 0
    assert f"speculative modules: {line}" in capsys.readouterr().out
    ref = reference_generate(model, PROMPT, max_tokens=10, temperature=0.0)
    got = fx_engine.generate(model, PROMPT, max_tokens=10, temperature=0.0, draft_model="mtp", num_draft_tokens=2)
    assert got.token_ids == ref.token_ids and got.usage.drafted_tokens > 0
    # the trunk alone (mlx-lm's conversions drop the modules): info says so, drafting is refused
    w = {n: a for n, a in mx.load(str(path / "model.safetensors")).items() if not n.startswith("model.mtp_layers.")}
    dropped = path.parent / "dropped"
    dropped.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (dropped / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(str(dropped / "model.safetensors"), w)
    assert "but the weights do not hold it" in mtp_summary(dropped)
