"""/metrics for speculative decoding: per drafter kind, the verify steps, drafted and
accepted tokens, the acceptance rate and the mean accepted length (issue 45, item 6), from
the requests' own usage."""

from __future__ import annotations

import re

import httpx

import fx_engine
from fx_engine.engine.drafters import PromptLookup
from fx_engine.engine.request import Usage
from fx_engine.server.app import create_app
from fx_engine.server.metrics import Metrics, render_models
from tests.conftest import serve


def _value(text: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    assert m, f"{name}{{{want}}} not in:\n{text}"
    return float(m.group(1))


def test_counters_and_figures_per_drafter() -> None:
    m = Metrics(None)
    m.count_tokens(Usage(5, 10, drafted_tokens=12, accepted_tokens=6, draft_rounds=4, drafter="prompt_lookup"))
    m.count_tokens(Usage(5, 10, drafted_tokens=8, accepted_tokens=2, draft_rounds=4, drafter="prompt_lookup"))
    m.count_tokens(Usage(5, 10, drafted_tokens=3, accepted_tokens=3, draft_rounds=1, drafter="eagle3"))
    m.count_tokens(Usage(5, 10))  # no speculation: counted nowhere
    text = m.render()
    assert _value(text, "fx_spec_decode_num_drafts_total", drafter="prompt_lookup") == 8
    assert _value(text, "fx_spec_decode_num_draft_tokens_total", drafter="prompt_lookup") == 20
    assert _value(text, "fx_spec_decode_num_accepted_tokens_total", drafter="prompt_lookup") == 8
    assert _value(text, "fx_spec_decode_acceptance_rate", drafter="prompt_lookup") == 0.4
    assert _value(text, "fx_spec_decode_mean_accepted_length", drafter="prompt_lookup") == 2.0
    assert _value(text, "fx_spec_decode_mean_accepted_length", drafter="eagle3") == 4.0
    assert text.count("# TYPE fx_spec_decode_acceptance_rate gauge") == 1
    several = render_models([("a", m), ("b", Metrics(None))])
    assert _value(several, "fx_spec_decode_num_drafts_total", model="a", drafter="eagle3") == 1
    assert 'model="b",drafter' not in several
    assert "fx_spec_decode" not in Metrics(None).render()  # nothing drafted: no samples


def test_a_served_request_with_prompt_lookup_is_counted(default_model) -> None:
    engine = fx_engine.Engine(default_model, max_rows=4)
    app = create_app(engine, "smollm2", defaults={"prompt_lookup": PromptLookup(1, 3)})
    text = "The lighthouse keeper climbed the stairs every night to light the lamp. " * 3
    with serve(app, engine) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as h:
            r = h.post("/v1/chat/completions", json={
                "model": "smollm2", "max_tokens": 40, "temperature": 0,
                "messages": [{"role": "user", "content": "Repeat exactly: " + text}]})
            assert r.status_code == 200
            metrics = h.get("/metrics").text
    steps = _value(metrics, "fx_spec_decode_num_drafts_total", drafter="prompt_lookup")
    drafted = _value(metrics, "fx_spec_decode_num_draft_tokens_total", drafter="prompt_lookup")
    accepted = _value(metrics, "fx_spec_decode_num_accepted_tokens_total", drafter="prompt_lookup")
    assert 0 < steps <= drafted and 0 < accepted <= drafted
    assert _value(metrics, "fx_spec_decode_mean_accepted_length", drafter="prompt_lookup") == 1 + accepted / steps


def test_an_eagle3_head_is_counted_under_its_kind(tmp_path) -> None:
    from fx_engine.engine.eagle3_drafter import Eagle3Drafter
    from fx_engine.testing.eagle3 import write_echo_pair

    target, head = write_echo_pair(tmp_path / "pair")
    model = fx_engine.load(target)
    engine = fx_engine.Engine(model, max_rows=2)
    app = create_app(engine, "echo", defaults={"draft_model": Eagle3Drafter.load(head, model)})
    with serve(app, engine) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as h:
            r = h.post("/v1/completions", json={"model": "echo", "prompt": "hello there", "max_tokens": 16,
                                                 "temperature": 0})
            assert r.status_code == 200
            metrics = h.get("/metrics").text
    assert _value(metrics, "fx_spec_decode_num_accepted_tokens_total", drafter="eagle3") > 0


def test_an_mtp_module_is_counted_under_its_kind_and_a_request_opts_out(tmp_path) -> None:
    """serve --draft-model mtp: the checkpoint's own MTP module drafts (counted as
    drafter="mtp"); a request with speculative_decoding: false gets the same text, no drafts."""
    from fx_engine.engine.mtp_drafter import mtp_drafter_for
    from fx_engine.testing.mtp import write_mtp_echo_target

    model = fx_engine.load(write_mtp_echo_target(tmp_path / "echo"))
    engine = fx_engine.Engine(model, max_rows=2)
    app = create_app(engine, "echo", defaults={"draft_model": mtp_drafter_for(model)})
    body = {"model": "echo", "prompt": "hello there", "max_tokens": 16, "temperature": 0}
    with serve(app, engine) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as h:
            on = h.post("/v1/completions", json=body)
            assert on.status_code == 200
            accepted = _value(h.get("/metrics").text, "fx_spec_decode_num_accepted_tokens_total", drafter="mtp")
            off = h.post("/v1/completions", json={**body, "speculative_decoding": False})
            assert off.status_code == 200 and _texts(off.json()) == _texts(on.json())
            metrics = h.get("/metrics").text
    assert accepted > 0 and _value(metrics, "fx_spec_decode_num_accepted_tokens_total", drafter="mtp") == accepted
    assert 1 < _value(metrics, "fx_spec_decode_mean_accepted_length", drafter="mtp")


def test_a_request_opts_out_of_speculation_on_every_route(default_model) -> None:
    """speculative_decoding: false (chat, completions, Anthropic messages, Responses): the
    same greedy text, and no drafts counted for it; a value of another type is a 400 naming
    the field."""
    engine = fx_engine.Engine(default_model, max_rows=4)
    app = create_app(engine, "smollm2", defaults={"prompt_lookup": PromptLookup(1, 3)})
    text = "The lighthouse keeper climbed the stairs every night to light the lamp. " * 3
    msgs = [{"role": "user", "content": "Repeat exactly: " + text}]
    routes = [("/v1/chat/completions", {"messages": msgs, "max_tokens": 24, "temperature": 0}),
              ("/v1/completions", {"prompt": "Repeat exactly: " + text, "max_tokens": 24, "temperature": 0}),
              ("/v1/messages", {"messages": msgs, "max_tokens": 24, "temperature": 0}),
              ("/v1/responses", {"input": msgs, "max_output_tokens": 24, "temperature": 0})]

    def drafts(h) -> float:
        m = re.search(r'^fx_spec_decode_num_draft_tokens_total\{drafter="prompt_lookup"\} (\S+)$',
                      h.get("/metrics").text, re.M)
        return float(m.group(1)) if m else 0.0

    with serve(app, engine) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as h:
            for path, body in routes:
                body = {"model": "smollm2", **body}
                before = drafts(h)
                off = h.post(path, json={**body, "speculative_decoding": False})
                assert off.status_code == 200, off.text
                assert drafts(h) == before, path
                on = h.post(path, json=body)
                assert on.status_code == 200 and drafts(h) > before, path
                assert _texts(off.json()) == _texts(on.json()) != "", path
            bad = h.post("/v1/chat/completions", json={"model": "smollm2", "messages": msgs,
                                                        "speculative_decoding": "sometimes"})
            assert bad.status_code == 400 and "speculative_decoding" in bad.json()["error"]["message"]


def _texts(body: dict) -> str:
    """A reply's text on any route."""
    if "choices" in body:
        return "".join(c.get("text") or c["message"]["content"] for c in body["choices"])
    if "content" in body:
        return "".join(b.get("text", "") for b in body["content"])
    return "".join(c.get("text", "") for o in body["output"] for c in o.get("content", []))
