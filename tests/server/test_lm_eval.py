"""lm-evaluation-harness against `fx-engine serve`, with its default settings: its
`local-completions` model finds the tokenizer through the server's /tokenizer_info and
/tokenize routes (the "remote" backend it auto-detects), scores a multiple-choice task with
echo + logprobs (loglikelihood) and runs a generate_until task; `local-chat-completions`
runs the generate_until task through the chat API. The oracle: the same scores computed
directly with `fx_engine.logits` and `fx_engine.generate` on the same model.

The tasks are local (JSON lines written here, loaded through `datasets`' json builder);
nothing is downloaded."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import serve

lm_eval = pytest.importorskip("lm_eval")

MC = [
    ("What is the capital of France?", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("What is the capital of Italy?", ["Paris", "Rome", "Oslo", "Lima"], 1),
    ("How many legs does a spider have?", ["four", "six", "eight", "ten"], 2),
    ("What color is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("What is two plus two?", ["four", "five", "three", "six"], 0),
    ("Which animal barks?", ["cat", "dog", "fish", "bird"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wool"], 2),
    ("Which planet do we live on?", ["Mars", "Venus", "Jupiter", "Earth"], 3),
]
GEN = [("What is the capital of France?", "Paris"), ("What is the capital of Japan?", "Tokyo"),
       ("What is 3 + 4?", "7"), ("Name the largest ocean.", "Pacific")]

PROMPT = "Question: {q}\nAnswer:"


def _write_tasks(root):
    with open(root / "mc.jsonl", "w") as f:
        for q, choices, gold in MC:
            f.write(json.dumps({"question": q, "choices": choices, "answer": gold}) + "\n")
    with open(root / "gen.jsonl", "w") as f:
        for q, a in GEN:
            f.write(json.dumps({"question": q, "answer": a}) + "\n")
    common = ("dataset_path: json\ntest_split: test\n"
              'doc_to_text: "Question: {{question}}\\nAnswer:"\n')
    (root / "fx_mc.yaml").write_text(
        "task: fx_mc\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        'output_type: multiple_choice\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n")
    (root / "fx_gen.yaml").write_text(
        "task: fx_gen\n" + common + f"dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        'output_type: generate_until\ndoc_to_target: " {{answer}}"\n'
        'generation_kwargs:\n  until: ["\\n", "."]\n  max_gen_toks: 12\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n")


def _direct_mc(model):
    """acc by scoring each choice's continuation (lm-eval's split: the whole text encoded,
    the context's tokens cut off) with fx_engine.logits."""
    tok = model.tokenizer
    right, lls = 0, []
    for q, choices, gold in MC:
        ctx = PROMPT.format(q=q)
        ctx_ids = tok.encode(ctx, add_special_tokens=False)
        scores = []
        for c in choices:
            whole = tok.encode(ctx + " " + c, add_special_tokens=False)
            lg = fx_engine.logits(model, whole)
            lsm = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
            scores.append(sum(float(lsm[i - 1, whole[i]]) for i in range(len(ctx_ids), len(whole))))
        lls.append(scores)
        right += int(max(range(len(choices)), key=scores.__getitem__) == gold)
    return right / len(MC), lls


def _direct_gen(model):
    tok = model.tokenizer
    outs = [fx_engine.generate(model, tok.encode(PROMPT.format(q=q), add_special_tokens=False),
                               max_tokens=12, temperature=0.0, stop=["\n", "."]).text for q, _ in GEN]
    return sum(o == f" {a}" for o, (_, a) in zip(outs, GEN)) / len(GEN), outs


def _evaluate(model, tmp_path, monkeypatch, lm: str, route: str, tasks: list[str], **kw):
    """lm-eval's simple_evaluate with model `lm` against a live server (its defaults but
    for one retry), on the local tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    _write_tasks(tmp_path)
    engine = fx_engine.Engine(model, max_rows=4)
    app = create_app(engine, "smollm2")
    # only the local tasks: indexing lm-eval's thousands of bundled ones takes ~7 s
    tasks_here = TaskManager(include_path=str(tmp_path), include_defaults=False)
    with serve(app, engine) as (url, _):
        return simple_evaluate(
            model=lm, model_args={"base_url": f"{url}{route}", "model": "smollm2", "max_retries": 1},
            tasks=tasks, task_manager=tasks_here, log_samples=True, **kw)


@pytest.mark.slow
def test_lm_eval_local_completions_scores_equal_direct_scoring(default_model, tmp_path, monkeypatch):
    res = _evaluate(default_model, tmp_path, monkeypatch, "local-completions", "/v1/completions",
                    ["fx_mc", "fx_gen"])
    acc, lls = _direct_mc(default_model)
    assert res["results"]["fx_mc"]["acc,none"] == pytest.approx(acc)
    for s in res["samples"]["fx_mc"]:
        got = [float(r[0][0]) for r in s["resps"]]
        assert got == pytest.approx(lls[s["doc_id"]], abs=2e-3)
    em, outs = _direct_gen(default_model)
    assert res["results"]["fx_gen"]["exact_match,none"] == pytest.approx(em)
    for s in res["samples"]["fx_gen"]:
        assert s["resps"][0][0] == outs[s["doc_id"]]


@pytest.mark.slow
def test_lm_eval_local_chat_completions_runs_generate_until(default_model, tmp_path, monkeypatch):
    res = _evaluate(default_model, tmp_path, monkeypatch, "local-chat-completions",
                    "/v1/chat/completions", ["fx_gen"], apply_chat_template=True)
    want = []
    for q, _ in GEN:
        msgs = [{"role": "user", "content": PROMPT.format(q=q)}]
        want.append(fx_engine.generate(default_model, msgs, max_tokens=12, temperature=0.0,
                                       stop=["\n", "."]).text)
    for s in res["samples"]["fx_gen"]:
        assert s["resps"][0][0] == want[s["doc_id"]]
    em = sum(w == f" {a}" for w, (_, a) in zip(want, GEN)) / len(GEN)
    assert res["results"]["fx_gen"]["exact_match,none"] == pytest.approx(em)
