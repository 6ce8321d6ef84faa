"""tools/drafter_data.py: the drafter's open prompt set (reproducible, held out from the
speculative benchmark) and its packed conversations, written from a tiny model's run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_spec  # noqa: E402
import drafter_data  # noqa: E402


def test_the_prompt_set_is_reproducible_and_held_out_from_the_benchmark() -> None:
    every = drafter_data.prompts(10**6)
    assert len(every) == len(set(every)) > 1000
    assert drafter_data.prompts(50) == every[:50] == drafter_data.prompts(50, seed=0)
    assert drafter_data.prompts(50, seed=1) != every[:50]
    # the benchmark's open-task topics appear in no training prompt
    assert set(drafter_data.HELD_OUT) == set(bench_spec.TOPICS)
    assert not [p for p in every if any(t in p for t in bench_spec.TOPICS)]
    assert not {bench_spec.open_prompt(i)[0]["content"] for i in range(8)} & set(every)


def test_pack_lays_conversations_back_to_back() -> None:
    out = drafter_data.pack([[1, 2], [3]], [[4, 5, 6], [7]])
    assert out["tokens"].tolist() == [1, 2, 4, 5, 6, 3, 7]
    assert out["starts"].tolist() == [0, 5, 7] and out["answer_starts"].tolist() == [2, 6]


def test_a_run_writes_the_models_own_greedy_answers(tiny_dir, tmp_path) -> None:
    import fx_engine

    out = tmp_path / "d.npz"
    meta = drafter_data.main(["--model", str(tiny_dir), "--out", str(out), "--prompts", "3",
                              "--max-tokens", "5", "--rows", "2", "--numerics", "exact"])
    d = np.load(out)
    assert json.loads(str(d["meta"])) == meta and meta["prompts"] == 3 and meta["numerics"] == "exact"
    model = fx_engine.load(tiny_dir)
    toks, starts, ans = d["tokens"].tolist(), d["starts"].tolist(), d["answer_starts"].tolist()
    for i, text in enumerate(drafter_data.prompts(3)):
        prompt = toks[starts[i]:ans[i]]
        assert prompt == list(model.tokenizer.apply_chat_template([{"role": "user", "content": text}]))
        solo = fx_engine.generate(model, prompt, max_tokens=5, temperature=0.0)
        assert toks[ans[i]:starts[i + 1]] == list(solo.token_ids)  # batched == solo, greedy
