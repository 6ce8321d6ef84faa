"""tools/train_drafter.py: its unrolled training forward (EAGLE-3's training-time test) is
what the engine's head computes when it drafts a chain (checked against chained
`eagle3_forward` calls on the ordinary KV cache), its draft vocabulary, and the saved head
loading through the published-format loader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import train_drafter as td  # noqa: E402
from fx_engine.core.cache import init_cache  # noqa: E402
from fx_engine.core.drafters.eagle3 import (cache_specs, config_from_hf, eagle3_forward,  # noqa: E402
                                            eagle3_params_from_tensors)

CFG = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
       "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 8, "vocab_size": 100, "draft_vocab_size": 40, "target_hidden_size": 24,
       "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512, "hidden_act": "silu",
       "tie_word_embeddings": False}


def _head(seed: int = 0) -> tuple[dict[str, mx.array], np.ndarray, mx.array]:
    rng = np.random.default_rng(seed)
    vocab_ids = np.sort(rng.choice(CFG["vocab_size"], CFG["draft_vocab_size"], replace=False))
    head = mx.array(rng.normal(size=(CFG["vocab_size"], CFG["hidden_size"])).astype(np.float32))
    w = td.init_head(CFG, vocab_ids, head, mx.ones((CFG["hidden_size"],)), seed)
    # larger than training's init, and norms away from one: every term shows
    w = {k: (v * 10 if v.ndim == 2 and k != "lm_head.weight" else v) for k, v in w.items()}
    for k in [k for k in w if k.endswith("norm.weight")]:
        w[k] = mx.array(rng.uniform(0.5, 1.5, CFG["hidden_size"]).astype(np.float32))
    table = mx.array(rng.normal(size=(CFG["vocab_size"], CFG["hidden_size"])).astype(np.float32))
    return w, vocab_ids, table


def _params(w: dict[str, mx.array], vocab_ids: np.ndarray):
    d2t = vocab_ids.astype(np.int64) - np.arange(len(vocab_ids))
    return eagle3_params_from_tensors({**w, "d2t": mx.array(d2t)}, config_from_hf(CFG))


def test_unrolled_steps_are_the_heads_drafting_chain() -> None:
    """Step k at row t of the unrolled forward = the head's k-th chained step of a chain
    started at t: step 0 over positions 0..t with the target's states, then the head's own
    output hidden and the true next token at t + 1, t + 2 (the engine's draft_chain, with
    the drafts replaced by the true tokens, as training does)."""
    w, vocab_ids, table = _head()
    p = _params(w, vocab_ids)
    rng = np.random.default_rng(1)
    t_len, steps = 12, 3
    tokens = mx.array(rng.integers(0, CFG["vocab_size"], (1, t_len)).astype(np.int32))
    feats = mx.array(rng.normal(size=(1, t_len, 3 * CFG["target_hidden_size"])).astype(np.float32))
    unrolled = td.unrolled_logits(w, CFG, table, feats, tokens, steps)
    tok = np.asarray(tokens[0])
    for t in (0, 4, t_len - 1 - steps):
        cache = init_cache(cache_specs(p.config), 1, 64)
        emb = mx.take(table, mx.array(tok[1:t + 2])[None], axis=0)
        lg, h, cache = eagle3_forward(p, emb, feats[:, :t + 1], cache, mx.array([t + 1]))
        ref, hid = [lg[0, t]], h[:, t:t + 1]
        for k in range(1, steps):
            emb = mx.take(table, mx.array([[int(tok[t + 1 + k])]]), axis=0)
            lg, hid, cache = eagle3_forward(p, emb, hid, cache, mx.array([1]))
            ref.append(lg[0, 0])
        for k in range(steps):
            np.testing.assert_allclose(np.asarray(unrolled[k][0, t]), np.asarray(ref[k]), rtol=2e-4, atol=2e-4,
                                       err_msg=f"step {k} at row {t}")


def test_labels_and_masks_follow_the_steps() -> None:
    tokens = mx.array([[5, 6, 7, 8, 9, 0]], mx.int32)
    t2d = mx.array(np.where(np.arange(10) == 8, -1, np.arange(10)).astype(np.int32))  # 8: not drafted
    labels, masks = td.step_labels(tokens, mx.array([3]), mx.array([5]), t2d, 2)
    # step 0: row t predicts tokens[t + 2], answer tokens from position 3 on, inside 5 tokens
    assert np.asarray(masks[0])[0].tolist() == [False, False, True, False, False, False]  # 8 (t=1) is out
    assert np.asarray(labels[0])[0, 2] == 9
    assert np.asarray(masks[1])[0].tolist() == [False, True, False, False, False, False]
    assert np.asarray(labels[1])[0, 1] == 9


def test_draft_vocab_takes_the_most_frequent_ids() -> None:
    toks = np.array([7, 7, 7, 3, 3, 9, 1, 1, 1, 1])
    assert td.draft_vocab(toks, 12, 2).tolist() == [1, 7]
    assert td.draft_vocab(toks, 12, 3).tolist() == [1, 3, 7]
    assert td.draft_vocab(toks, 12, 6).tolist() == [0, 1, 2, 3, 7, 9]  # unseen: by id


def test_the_saved_head_loads_in_the_published_format(tmp_path) -> None:
    w, vocab_ids, table = _head()
    td.save_head(tmp_path, w, CFG, vocab_ids, {"tool": "test"})
    loaded = mx.load(str(tmp_path / "model.safetensors"))
    p = eagle3_params_from_tensors(loaded, config_from_hf(CFG))
    np.testing.assert_array_equal(np.asarray(p.d2t) + np.arange(len(vocab_ids)), vocab_ids)
    ref = _params({k: v.astype(mx.float16).astype(mx.float32) for k, v in w.items()}, vocab_ids)
    x = mx.array(np.random.default_rng(2).normal(size=(1, 5, 3 * CFG["target_hidden_size"])).astype(np.float32))
    e = mx.take(table, mx.array([[1, 2, 3, 4, 5]]), axis=0)
    outs = [eagle3_forward(q, e, x, init_cache(cache_specs(q.config), 1, 16), mx.array([5]))[0] for q in (p, ref)]
    np.testing.assert_allclose(np.asarray(outs[0]), np.asarray(outs[1]), rtol=1e-5, atol=1e-5)
    with pytest.raises(SystemExit, match="rope_scaling"):
        td.head_config(type("M", (), {"config": type("C", (), {"rope_scaling": {"type": "yarn"}})()})(), 10)


def test_hidden_states_are_the_forwards_own(tiny_folder) -> None:
    """fx_engine.engine.scoring.hidden_states: boundary 0 is the embedding lookup, the last
    boundary through the final norm is hidden_step's output, in chunks or at once."""
    import fx_engine
    from fx_engine.core.nn import embed, rms_norm
    from fx_engine.core.steps import hidden_step
    from fx_engine.engine.scoring import hidden_states

    model = fx_engine.load(tiny_folder("llama", num_hidden_layers=6))
    ids = list(range(3, 40))
    n, width = model.config.num_layers, model.config.hidden_size
    hs = hidden_states(model, ids, (0, 2, n))
    assert hs.shape == (len(ids), 3 * width)
    np.testing.assert_array_equal(np.asarray(hs[:, :width]), np.asarray(embed(mx.array(ids), model.params.embed)))
    final, _ = hidden_step(model.params, model.new_cache(1, 256), mx.array([ids]), mx.array([len(ids)]))
    normed = rms_norm(hs[:, 2 * width:], model.params.norm, model.config.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(normed), np.asarray(final[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hidden_states(model, ids, (0, 2, n), chunk=16)), np.asarray(hs),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="token_ids"):
        hidden_states(model, [], (0,))


def test_a_tiny_training_run_writes_a_loadable_head(tiny_folder, tmp_path) -> None:
    import json

    import drafter_data

    import fx_engine

    target = tiny_folder("llama", num_hidden_layers=6)
    data = tmp_path / "d.npz"
    drafter_data.main(["--model", str(target), "--out", str(data), "--prompts", "8", "--max-tokens", "12",
                       "--rows", "4", "--numerics", "exact"])
    out = tmp_path / "head"
    recipe = td.main(["--data", str(data), "--out", str(out), "--draft-vocab", "64", "--steps", "2",
                      "--epochs", "2", "--batch", "2", "--seq", "64", "--holdout", "0.25"])
    assert [h["epoch"] for h in recipe["history"]] == [0, 1, 2]
    assert recipe["target"]["aux_layers"] == [2, 3, 3] and recipe["data"]["prompts"] == 8
    assert json.loads((out / "recipe.json").read_text()) == recipe
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    p = eagle3_params_from_tensors(mx.load(str(out / "model.safetensors")), cfg)
    assert p.config.draft_vocab_size == 64 and p.embed is None
    model = fx_engine.load(target)
    assert p.config.vocab_size == model.config.vocab_size and p.config.target_hidden_size == model.config.hidden_size


def test_training_continues_from_a_saved_head(tiny_folder, tmp_path, capsys) -> None:
    """--init DIR starts from a saved head (its draft vocabulary kept): before any step it
    scores what the saved head scored (float16 weights); the target's states come from the
    cache written beside the data by the first run."""
    import drafter_data

    target = tiny_folder("llama", num_hidden_layers=6)
    data = tmp_path / "d.npz"
    drafter_data.main(["--model", str(target), "--out", str(data), "--prompts", "8", "--max-tokens", "12",
                       "--rows", "4", "--numerics", "exact"])
    # (a small learning rate: the tiny model's repetitive answers are learnt to a zero loss fast)
    common = ["--data", str(data), "--steps", "2", "--batch", "2", "--seq", "256", "--holdout", "0.25",
              "--lr", "1e-5"]
    first = td.main([*common, "--out", str(tmp_path / "a"), "--draft-vocab", "300", "--epochs", "2"])
    assert first["history"][-1]["loss"] > 0  # (answer tokens were scored)
    assert list(tmp_path.glob("d.features-*.npy"))
    again = td.main([*common, "--out", str(tmp_path / "b"), "--init", str(tmp_path / "a"), "--epochs", "1"])
    assert "features from" in capsys.readouterr().err
    assert again["draft_vocab_size"] == 300 and again["init_recipe"] == first
    assert abs(again["history"][0]["loss"] - first["history"][-1]["loss"]) < 2e-2 * first["history"][-1]["loss"]


def test_several_data_files_train_together(tiny_folder, tmp_path) -> None:
    import drafter_data

    target = tiny_folder("llama", num_hidden_layers=6)
    files = [tmp_path / "a.npz", tmp_path / "b.npz"]
    for f, offset in zip(files, (0, 4)):
        drafter_data.main(["--model", str(target), "--out", str(f), "--prompts", "4", "--max-tokens", "8",
                           "--rows", "4", "--numerics", "exact", "--offset", str(offset)])
    metas = [json.loads(str(np.load(f)["meta"])) for f in files]
    assert metas[1]["sample_prompts"][0] == drafter_data.prompts(8)[4]
    recipe = td.main(["--data", *map(str, files), "--out", str(tmp_path / "h"), "--draft-vocab", "300",
                      "--steps", "2", "--batch", "2", "--seq", "256", "--holdout", "0.25", "--epochs", "1"])
    assert recipe["data"] == metas and recipe["conversations"] == {"train": 6, "holdout": 2}
