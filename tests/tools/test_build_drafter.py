"""tools/build_drafter.py: the head's recipe in one command, resumable stage by stage."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import build_drafter  # noqa: E402
from fx_engine.core.drafters.eagle3 import config_from_hf, eagle3_params_from_tensors  # noqa: E402


def test_one_command_builds_a_loadable_head_and_resumes(tiny_folder, tmp_path, capsys) -> None:
    """The four stages (two data files of the target's own answers, a first training, a
    second one continued from it on both files) run from one command into a head in the
    published format; build.json records each stage's command; a second run skips every
    stage whose output exists (an interrupted build goes on where it stopped)."""
    import fx_engine

    target = tiny_folder("llama", num_hidden_layers=6)
    out = tmp_path / "head"
    args = ["--model", str(target), "--out", str(out), "--prompts", "4", "--max-tokens", "8", "--rows", "4",
            "--numerics", "exact", "--epochs", "1", "--draft-vocab", "300", "--steps", "2", "--batch", "2",
            "--seq", "256", "--holdout", "0.25"]
    build = build_drafter.main(args)
    assert [s["stage"] for s in build["stages"]] == ["data-1", "data-2", "head-1", "head"]
    assert not any(s.get("skipped") for s in build["stages"])
    work = tmp_path / "head-work"
    assert (work / "data-1.npz").exists() and (work / "data-2.npz").exists() and (work / "head-1").is_dir()
    assert "--offset 4" in build["stages"][1]["command"] and "--init" in build["stages"][3]["command"]
    assert json.loads((out / "build.json").read_text()) == build
    recipe = json.loads((out / "recipe.json").read_text())
    assert len(recipe["data"]) == 2 and recipe["init_recipe"]["data"] in (recipe["data"][0], recipe["data"][:1])
    cfg = config_from_hf(json.loads((out / "config.json").read_text()))
    p = eagle3_params_from_tensors(mx.load(str(out / "model.safetensors")), cfg)
    assert p.config.draft_vocab_size == 300 and p.config.vocab_size == fx_engine.load(target).config.vocab_size
    # the drafter the engine loads from it
    drafter = fx_engine.Eagle3Drafter.load(out, fx_engine.load(target))
    assert drafter is not None
    again = build_drafter.main(args)
    assert all(s.get("skipped") for s in again["stages"])
    assert capsys.readouterr().err.count("exists, skipped") == 4
