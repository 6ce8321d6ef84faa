"""Scoring through the completions API (echo + logprobs, max_tokens 0, list prompts) and the
tokenizer routes (vLLM's /tokenize, /detokenize, /tokenizer_info), over real HTTP.

Oracle: `fx_engine.logits` (teacher-forced log-softmax) and the model's tokenizer."""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest

import fx_engine
from fx_engine.server.app import create_app

from tests.conftest import serve

TEXT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def server(default_model):
    engine = fx_engine.Engine(default_model, max_rows=8, prefill_chunk=16)  # several chunks
    app = create_app(engine, "smollm2")
    with serve(app, engine) as (url, _):
        yield {"url": url, "model": default_model}


def _post(server, path, body):
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        return h.post(path, json=body)


def _reference(model, ids):
    lg = fx_engine.logits(model, ids)
    return lg - mx.logsumexp(lg, axis=-1, keepdims=True)


def test_echo_logprobs_score_the_prompt(server):
    model = server["model"]
    ids = model.tokenizer.encode(TEXT)
    lsm = _reference(model, ids)
    for max_tokens in (0, 1):
        r = _post(server, "/v1/completions", {"prompt": TEXT, "echo": True, "logprobs": 2,
                                              "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(TEXT)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        n = len(ids)
        assert len(lp["tokens"]) == n + max_tokens
        for i in range(1, n):
            assert lp["token_logprobs"][i] == pytest.approx(float(lsm[i - 1, ids[i]]), abs=1e-4)
            best = mx.argsort(-lsm[i - 1])[:2].tolist()
            assert [model.tokenizer.decode([t]) for t in best] == list(lp["top_logprobs"][i])
        assert "".join(lp["tokens"]) == ch["text"]
        assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    assert r.json()["usage"]["prompt_tokens"] == len(ids)


def test_list_prompts_give_one_choice_per_prompt_and_n(server):
    model = server["model"]
    prompts = ["Once upon a time", "The sky is"]
    want = [fx_engine.generate(model, p, max_tokens=5, temperature=0.0).text for p in prompts]
    r = _post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 5, "temperature": 0, "n": 2})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == [want[0], want[0], want[1], want[1]]
    assert body["usage"]["prompt_tokens"] == sum(len(model.tokenizer.encode(p)) for p in prompts)
    token_prompts = [model.tokenizer.encode(p) for p in prompts]
    r = _post(server, "/v1/completions", {"prompt": token_prompts, "max_tokens": 5, "temperature": 0})
    assert [c["text"] for c in r.json()["choices"]] == want


def test_streamed_echo_sends_the_prompt_first(server):
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        with h.stream("POST", "/v1/completions", json={
                "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
                "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == TEXT and first["logprobs"]["token_logprobs"][0] is None
    whole = "".join(e["choices"][0]["text"] for e in events)
    nonstream = _post(server, "/v1/completions", {"prompt": TEXT, "echo": True, "max_tokens": 3,
                                                  "temperature": 0}).json()["choices"][0]["text"]
    assert whole == nonstream


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", ""]}, "prompt"),
    ({"prompt": [[1, 2], [999999]]}, "prompt"),
])
def test_bad_scoring_requests_are_400(server, body, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenizer_routes(server):
    tok = server["model"].tokenizer
    r = _post(server, "/tokenize", {"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    body = r.json()
    assert body["tokens"] == tok.encode(TEXT, add_special_tokens=False) and body["count"] == len(body["tokens"])
    # vLLM's token_strs: the vocabulary's tokens (transformers' convert_ids_to_tokens)
    assert body["token_strs"] == [tok.backend.id_to_token(i) for i in body["tokens"]]
    assert body["max_model_len"] > 0
    msgs = [{"role": "user", "content": "Hi"}]
    r = _post(server, "/tokenize", {"messages": msgs})
    assert r.json()["tokens"] == list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))
    r = _post(server, "/detokenize", {"tokens": body["tokens"]})
    assert r.json() == {"prompt": TEXT}
    with httpx.Client(base_url=server["url"]) as h:
        info = h.get("/tokenizer_info").json()
    assert info["eos_token"] and tok.encode(info["eos_token"], add_special_tokens=False)[0] in tok.eos_ids
    assert info["chat_template"] == tok.chat_template
    assert _post(server, "/tokenize", {"prompt": "a", "messages": msgs}).status_code == 400
    assert _post(server, "/detokenize", {"tokens": [-1]}).status_code == 400
    assert _post(server, "/tokenize", {"promt": "a"}).json()["error"]["param"] == "promt"


def test_prompt_logprobs_in_the_engine_match_teacher_forcing(default_model):
    """Engine-level: prompt_logprobs rows (chunked, beside ordinary rows, after a prefix
    of theirs was cached) equal fx_engine.logits' log-softmax; max_tokens=0 samples nothing."""
    model = default_model
    ids = model.tokenizer.encode(TEXT * 3)
    lsm = _reference(model, ids)
    engine = fx_engine.Engine(model, max_rows=4, prefill_chunk=16)
    engine.submit(ids[:40], max_tokens=2).result()  # puts a prefix in the prefix cache
    hs = [engine.submit(ids, max_tokens=0, prompt_logprobs=3),
          engine.submit(ids[:20], max_tokens=4, temperature=0.0),
          engine.submit(ids, max_tokens=2, prompt_logprobs=0, temperature=0.0)]
    engine.close()
    a, plain, b = (h.result() for h in hs)
    assert a.token_ids == () and a.finish_reason == "length" and a.usage.cached_tokens == 0
    assert plain.token_ids == fx_engine.generate(model, ids[:20], max_tokens=4, temperature=0.0).token_ids
    for out in (a, b):
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for i in range(1, len(ids)):
            rec = out.prompt_logprobs[i]
            assert rec.token_id == ids[i]
            assert rec.logprob == pytest.approx(float(lsm[i - 1, ids[i]]), abs=1e-4)
    assert [t for t, _, _ in a.prompt_logprobs[5].top] == mx.argsort(-lsm[4])[:3].tolist()
    assert b.prompt_logprobs[5].top == ()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        fx_engine.generate(model, "hi", prompt_logprobs=21)


def test_streamed_text_offsets_run_on(server):
    with httpx.Client(base_url=server["url"], timeout=120) as h:
        with h.stream("POST", "/v1/completions", json={
                "prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 6, "temperature": 0,
                "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
    offsets = [o for e in events if e["choices"] and e["choices"][0]["logprobs"]
               for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == sorted(offsets) and offsets[-1] >= len(TEXT)
